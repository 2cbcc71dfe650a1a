//! Keys whose outcome is unknown, and the operator API that resolves them.
//!
//! In lease mode (see [`lease`](crate::lease)), a key's outcome is unknown
//! when an external step's `recover` could not tell whether the step took
//! effect: the record is parked as `NEEDS_RECONCILIATION` with its pending
//! step named. Resolve it here once the provider's records say what
//! happened; each resolution is fenced by the record's generation.
//!
//! A key's outcome is unknown when the handler ended the claimed transaction
//! itself (ran `COMMIT` or `ROLLBACK` on the [`Tx`](crate::Tx), or DDL that
//! commits implicitly): the layer can no longer record the answer with the
//! business writes, and whatever the handler committed stays. The layer
//! answers that request `500` (problem type `#transaction-ended`), logs it
//! at error level, and marks the key `NEEDS_RECONCILIATION`. Every retry
//! then gets `503` with `Retry-After` (problem type `#reconciling`), never
//! a new execution and never "in flight", until an operator looks at what
//! was committed and resolves the key with a [`Reconciler`].
//!
//! # Example
//!
//! ```no_run
//! # async fn f(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
//! use tower_idempotency::{Reconciler, Resolution};
//!
//! let reconciler = Reconciler::new(pool);
//! for record in reconciler.unresolved(100).await? {
//!     // Look at the business rows for `record`, then decide. Here: nothing
//!     // took effect, so the client's retry may run again.
//!     reconciler.resolve(&record, Resolution::Rerun).await?;
//! }
//! # Ok(())
//! # }
//! ```

use bytes::Bytes;
use http::Response;
use sqlx::Pool;

use crate::replay::StoredResponse;
use crate::store::{Backend, Completion, LeaseWrite, RecordStatus, Scope, UnresolvedRecord};

/// How an operator settles a key whose outcome was unknown.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Resolution {
    /// The operation took effect: retries replay this answer (status, every
    /// header given, body), as `SUCCEEDED`.
    Succeeded(Response<Bytes>),
    /// The operation failed for good: retries replay this answer, as
    /// `FAILED_FINAL`.
    Failed(Response<Bytes>),
    /// Nothing took effect: the record is deleted and the key's next
    /// request runs the handler again. For a lease-mode record, the pending
    /// step had no effect: the record resumes at its last recovery point
    /// and runs that step again (with the same step key).
    Rerun,
}

/// Lists and resolves the keys whose outcome is unknown.
///
/// Concurrency: each resolution is one conditional statement that only
/// touches a row still unresolved, so two operators (or two instances)
/// resolving the same key cannot both win; the loser is told `false`.
#[derive(Debug, Clone)]
pub struct Reconciler<DB: Backend> {
    pool: Pool<DB>,
}

impl<DB: Backend> Reconciler<DB> {
    /// A reconciler for the ledger in `pool`.
    pub fn new(pool: Pool<DB>) -> Self {
        Self { pool }
    }

    /// At most `limit` unresolved records, oldest first: committed
    /// `PROCESSING` rows (stranded, when marking them failed) and
    /// `NEEDS_RECONCILIATION` rows.
    pub async fn unresolved(&self, limit: u32) -> Result<Vec<UnresolvedRecord>, sqlx::Error> {
        DB::list_unresolved(&self.pool, i64::from(limit)).await
    }

    /// Settles `record`; `Ok(false)` when it was no longer unresolved
    /// (someone else resolved it first).
    pub async fn resolve(
        &self,
        record: &UnresolvedRecord,
        resolution: Resolution,
    ) -> Result<bool, sqlx::Error> {
        let scope = Scope {
            principal: &record.principal,
            operation: &record.operation,
            key: &record.key,
        };
        let lease = record.generation;
        let (status, response) = match resolution {
            Resolution::Succeeded(res) => (RecordStatus::Succeeded, res),
            Resolution::Failed(res) => (RecordStatus::FailedFinal, res),
            Resolution::Rerun if lease > 0 => {
                return DB::lease_write(&self.pool, &scope, lease, &LeaseWrite::Rerun).await;
            }
            Resolution::Rerun => return Ok(DB::resolve(&self.pool, &scope, None).await? == 1),
        };
        let (parts, body) = response.into_parts();
        let names: Vec<_> = parts.headers.keys().cloned().collect();
        let stored = StoredResponse::capture(parts.status, &parts.headers, &names, body);
        let completion = Completion {
            status,
            response_status: i32::from(stored.status),
            response_headers: &stored.headers,
            response_body: &stored.body,
            resource_id: None,
        };
        if lease > 0 {
            let write = LeaseWrite::Resolve(&completion);
            return DB::lease_write(&self.pool, &scope, lease, &write).await;
        }
        Ok(DB::resolve(&self.pool, &scope, Some(&completion)).await? == 1)
    }
}
