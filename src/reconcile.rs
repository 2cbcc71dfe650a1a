//! Keys whose outcome is unknown, and the operator API that resolves them.
//!
//! In lease mode (see [`lease`](crate::lease)), a key's outcome is unknown
//! when an external step's `recover` could not tell whether the step took
//! effect: the record is parked as `NEEDS_RECONCILIATION` with its pending
//! step named. It is also unsettled when its attempt died mid-step and
//! nobody retried (no completer serves its operation): the lease lapsed
//! with the step pending. [`Reconciler::unresolved`] lists both, whatever
//! operations the completers know, and records that lapsed long ago with
//! nothing pending. Resolve them here once the provider's records say what
//! happened (look the charge up by its [`StepKey`](crate::lease::StepKey));
//! each verdict names the record's claim, and an operator's verdict is
//! never dropped: it is recorded, or [`ResolveError`] says why not.
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
//! # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
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

use std::time::Duration;

use bytes::Bytes;
use http::Response;
use sqlx::Pool;

use crate::replay::StoredResponse;
use crate::store::{Backend, Completion, LeaseWrite, RecordStatus, UnresolvedRecord};

/// How an operator settles a key whose outcome was unknown.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Resolution {
    /// The operation took effect: retries replay this answer (status, every
    /// header given, body), as `SUCCEEDED`.
    Succeeded(Response<Bytes>),
    /// The operation failed for good: retries replay this answer, as
    /// `FAILED_FINAL`. (For a message consumer's record, this and
    /// `Succeeded` make the message a duplicate: acknowledged, never
    /// applied again; `Rerun` lets its redelivery run the handler.)
    Failed(Response<Bytes>),
    /// Nothing took effect: the record is deleted and the key's next
    /// request runs the handler again. For a lease-mode record, the pending
    /// step had no effect: the record resumes at its last recovery point
    /// and runs that step again (with the same step key). Give it only when
    /// the provider proves the step had no effect: a record with nothing
    /// saved may then be deleted as a bare claim by a resume function that
    /// follows the rule for those, and its next request gets a new claim
    /// (with the same step keys, which derive from the request: no step of
    /// a bare claim ever reached the provider).
    Rerun,
}

/// Lists and resolves the keys whose outcome is unknown.
///
/// Concurrency: each verdict is one conditional statement that only
/// touches the record's claim while it is unsettled and no attempt holds
/// it, so two operators (or two instances) resolving the same key cannot
/// both win; the loser is told why ([`ResolveError`]), never a lost race
/// when there was none.
#[derive(Debug, Clone)]
pub struct Reconciler<DB: Backend> {
    pool: Pool<DB>,
    stranded_after: Duration,
}

/// Why an operator's verdict was not recorded. Never returned for a verdict
/// that was recorded; never a lost race when there was none.
#[derive(Debug)]
#[non_exhaustive]
pub enum ResolveError {
    /// The record was settled first (by the completer, a client's retry, or
    /// another operator): it is now `status`, and retries replay that.
    Settled {
        /// The record's status now.
        status: RecordStatus,
    },
    /// There is no such record any more (resolved with `Rerun` and run
    /// again, or purged), or the key was claimed again by a new request.
    Gone,
    /// An attempt (a client's retry or a completer pass) holds the record's
    /// lease right now, and may still record the outcome itself. List
    /// again after `retry_after`, and resolve then if it is still listed.
    Held {
        /// How long the lease still runs.
        retry_after: Duration,
    },
    /// The record is unsettled but no longer as listed: an attempt took it
    /// over (and let it go) since, or a completer pass acted on it and
    /// parked it again; it is at `generation` now. Its state may have moved
    /// on (a pass may have run the step): list it again, check the provider
    /// again, and decide on what it is now.
    Changed {
        /// The record's generation now.
        generation: i64,
    },
    /// The operator's lookup names more than one record (the key as sent,
    /// and another stored with the same text; see
    /// [`Lookup::new`](crate::admin::Lookup::new)): nothing was settled.
    /// Name the record exactly as stored.
    Ambiguous {
        /// Each record's stored `(principal, operation, key)`, the reading
        /// as sent first.
        scopes: Vec<(String, String, String)>,
    },
    /// The store failed.
    Store(sqlx::Error),
}

impl std::fmt::Display for ResolveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Settled { status } => write!(
                f,
                "the record was settled first; it is {} now",
                status.as_str()
            ),
            Self::Gone => f.write_str("the record no longer exists (rerun, or purged)"),
            Self::Held { retry_after } => write!(
                f,
                "an attempt holds the record's lease for {retry_after:?} more; list it again then"
            ),
            Self::Changed { generation } => write!(
                f,
                "the record was taken over since it was listed (generation {generation} now); list it again"
            ),
            Self::Ambiguous { scopes } => write!(
                f,
                "the lookup names {} records; name one exactly as stored",
                scopes.len()
            ),
            Self::Store(e) => write!(f, "ledger: {e}"),
        }
    }
}

impl std::error::Error for ResolveError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Store(e) => Some(e),
            _ => None,
        }
    }
}

impl From<sqlx::Error> for ResolveError {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(e)
    }
}

/// How long a lapsed lease-mode record with nothing pending may wait for a
/// retry or a completer before it is listed as stranded: one hour.
pub const DEFAULT_STRANDED_AFTER: Duration = Duration::from_secs(60 * 60);

impl<DB: Backend> Reconciler<DB> {
    /// A reconciler for the ledger in `pool`.
    pub fn new(pool: Pool<DB>) -> Self {
        Self {
            pool,
            stranded_after: DEFAULT_STRANDED_AFTER,
        }
    }

    /// Lists lease-mode records whose lease lapsed this long ago with no
    /// step pending (nobody retried, no completer serves them) as stranded
    /// (default [`DEFAULT_STRANDED_AFTER`]). Records that lapsed with a
    /// step pending are listed at once.
    #[must_use]
    pub fn with_stranded_after(mut self, age: Duration) -> Self {
        self.stranded_after = age;
        self
    }

    /// At most `limit` records whose outcome is not settled, oldest
    /// first, whatever operations the completers serve: parked
    /// (`NEEDS_RECONCILIATION`) records; committed `PROCESSING` rows of the
    /// default mode (the handler ended the claimed transaction); and
    /// lease-mode records whose lease lapsed with a step pending (a charge
    /// may be taken and nobody retried), or lapsed longer ago than
    /// [`with_stranded_after`](Self::with_stranded_after).
    pub async fn unresolved(&self, limit: u32) -> Result<Vec<UnresolvedRecord>, sqlx::Error> {
        let stranded_ms = crate::expiry::millis(self.stranded_after);
        DB::list_unresolved(&self.pool, i64::from(limit), stranded_ms).await
    }

    /// Settles `record` as listed. The verdict is one conditional statement
    /// on the record's claim: it is recorded on a parked record (whatever
    /// completer passes did to it since the listing), or on a stranded one
    /// still at the listed generation with its lease lapsed; any earlier
    /// owner of the record is fenced out by it. Otherwise nothing is
    /// written and the error says why: settled first (and what it is now),
    /// gone, held by an attempt right now (list again after its lease), or
    /// [`ResolveError::Changed`].
    ///
    /// This writes no audit row: it is the primitive for any [`Backend`],
    /// and it does not know who decided or why. On the built-in stores,
    /// settle through [`admin::Ledger::resolve`](crate::admin::Ledger::resolve)
    /// (what the CLI and the console use), which records the actor, the
    /// reason, the database's time and the record as it was, in the
    /// verdict's own transaction.
    pub async fn resolve(
        &self,
        record: &UnresolvedRecord,
        resolution: Resolution,
    ) -> Result<(), ResolveError> {
        let verdict = Verdict::of(resolution);
        let completion = verdict.completion();
        let write = verdict.write(record, completion.as_ref());
        if DB::lease_write(&self.pool, &record.scope(), record.fence(), &write).await? {
            return Ok(());
        }
        Err(refusal(&self.pool, record).await)
    }
}

/// A [`Resolution`] ready to be written: the answer captured as the ledger
/// stores it (every header given).
pub(crate) struct Verdict {
    answer: Option<(RecordStatus, StoredResponse)>,
}

impl Verdict {
    pub(crate) fn of(resolution: Resolution) -> Self {
        let (status, response) = match resolution {
            Resolution::Succeeded(res) => (RecordStatus::Succeeded, res),
            Resolution::Failed(res) => (RecordStatus::FailedFinal, res),
            Resolution::Rerun => return Self { answer: None },
        };
        let (parts, body) = response.into_parts();
        let names: Vec<_> = parts.headers.keys().cloned().collect();
        let stored = StoredResponse::capture(parts.status, &parts.headers, &names, body, None);
        Self {
            answer: Some((status, stored)),
        }
    }

    /// The verdict's name: `succeeded`, `failed` or `rerun`.
    pub(crate) fn name(&self) -> &'static str {
        match &self.answer {
            Some((RecordStatus::Succeeded, _)) => "succeeded",
            Some(_) => "failed",
            None => "rerun",
        }
    }

    /// The answer's status code (none for a rerun).
    pub(crate) fn response_status(&self) -> Option<i32> {
        self.answer.as_ref().map(|(_, s)| i32::from(s.status))
    }

    pub(crate) fn completion(&self) -> Option<Completion<'_>> {
        self.answer.as_ref().map(|(status, stored)| Completion {
            status: *status,
            response_status: i32::from(stored.status),
            response_headers: &stored.headers,
            response_body: &stored.body,
            resource_id: None,
        })
    }

    /// The fenced write of the verdict on `record` as listed.
    pub(crate) fn write<'a>(
        &self,
        record: &UnresolvedRecord,
        completion: Option<&'a Completion<'a>>,
    ) -> LeaseWrite<'a> {
        match completion {
            Some(completion) => LeaseWrite::Resolve {
                completion,
                parks: record.parks,
            },
            None => LeaseWrite::Rerun {
                parks: record.parks,
            },
        }
    }
}

/// Why a verdict on `record` matched nothing: reads the record to say.
pub(crate) async fn refusal<DB: Backend>(
    pool: &Pool<DB>,
    record: &UnresolvedRecord,
) -> ResolveError {
    let now = match DB::fetch(pool, &record.scope()).await {
        Ok(Some(now)) => now,
        Ok(None) => return ResolveError::Gone,
        Err(e) => return ResolveError::Store(e),
    };
    if now.status.is_terminal() || now.status == RecordStatus::Expired {
        return ResolveError::Settled { status: now.status };
    }
    match now.lease {
        Some(lease) if lease.claim_id != record.claim_id => ResolveError::Gone,
        // Parked again since the listing: a pass acted on it.
        Some(lease) if now.status == RecordStatus::NeedsReconciliation => ResolveError::Changed {
            generation: lease.generation,
        },
        Some(lease) if lease.live => ResolveError::Held {
            retry_after: HELD_RETRY,
        },
        Some(lease) => ResolveError::Changed {
            generation: lease.generation,
        },
        None => ResolveError::Changed { generation: 0 },
    }
}

/// How soon to look again at a record an attempt holds.
const HELD_RETRY: Duration = Duration::from_secs(1);
