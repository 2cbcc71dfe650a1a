//! The ledger statements of lease mode, written once for every backend.
//!
//! Each backend supplies a [`Dialect`] (how a value becomes an SQL literal
//! made of hex digits, and its database clock); the statements are built
//! here. Every write on a leased row is **fenced**: its `WHERE` names the
//! generation the writer holds, so a write from an owner that lost the row
//! to a takeover matches nothing, in the same statement as the write.

use super::literal::hex;
use super::{Claim, Completion, RecordStatus, Scope};

/// How a backend writes literals and reads its clock.
pub(crate) struct Dialect {
    /// A value for a binary-compared text column (scope, step and point).
    pub(crate) key: fn(&str) -> String,
    /// A value for a character text column (`resource_id`).
    pub(crate) text: fn(&str) -> String,
    /// A value for a binary column.
    pub(crate) blob: fn(&[u8]) -> String,
    /// A key column read back as text.
    pub(crate) read_key: fn(&str) -> String,
    /// The database clock, epoch milliseconds.
    pub(crate) now: &'static str,
}

/// A fenced write on a leased row. The owner's writes match only while the
/// row is `PROCESSING` at the writer's generation; an operator's verdicts
/// ([`Rerun`](Self::Rerun), [`Resolve`](Self::Resolve)) only while it is
/// `NEEDS_RECONCILIATION`.
#[derive(Debug, Clone, Copy)]
pub enum LeaseWrite<'a> {
    /// Extends the lease to `lease_ms` from now.
    Renew {
        /// The lease, milliseconds.
        lease_ms: i64,
    },
    /// Notes that an external step is about to run, and extends the lease.
    Pending {
        /// The step's name.
        step: &'a str,
        /// The lease, milliseconds.
        lease_ms: i64,
    },
    /// Records a recovery point and the saved data (a JSON object), and
    /// extends the lease; a step's progress also clears its pending mark.
    Progress {
        /// The point reached (`None`: the point stays where it was).
        point: Option<&'a str>,
        /// Everything saved so far, a JSON object.
        data: &'a [u8],
        /// Whether the pending step is settled (a step's own progress).
        settled: bool,
        /// The lease, milliseconds.
        lease_ms: i64,
    },
    /// Ends the lease now, so the next retry (or the completer) resumes
    /// at once; the row is `PROCESSING` at its last recovery point.
    Release,
    /// Parks the row as `NEEDS_RECONCILIATION` (its pending step kept, to
    /// tell which outcome is unknown); it is never resumed on its own.
    Park {
        /// Whether a completer pass may retry the step's look-up; a step
        /// without one is left to an operator (the row is not listed for
        /// completers at all).
        recoverable: bool,
    },
    /// An operator's verdict on a parked row: the pending step had no
    /// effect. The row is `PROCESSING` again with its lease ended and no
    /// pending step, so the next attempt resumes and runs the step.
    /// Matches only a row still `NEEDS_RECONCILIATION` that no completer
    /// pass holds, like [`Resolve`](Self::Resolve).
    Rerun,
    /// Records the answer, `SUCCEEDED` or `FAILED_FINAL`, and ends the lease.
    Complete(&'a Completion<'a>),
    /// An operator's verdict on a parked row: records the answer as
    /// [`Complete`](Self::Complete) does, but only while the row is still
    /// `NEEDS_RECONCILIATION` and no completer pass holds it, so that of
    /// two resolutions of one record exactly one wins.
    Resolve(&'a Completion<'a>),
    /// Deletes the row: nothing was committed but the claim, and the key
    /// may be used again (a request the handler rejected).
    Delete,
}

/// A leased row that a completer may take over, as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    /// The stored principal.
    pub principal: String,
    /// The stored operation.
    pub operation: String,
    /// The stored key.
    pub key: String,
    /// `PROCESSING` (lease lapsed) or `NEEDS_RECONCILIATION`.
    pub status: RecordStatus,
    /// The generation seen; a takeover must name it.
    pub generation: i64,
}

pub(crate) type LeaseRow = (String, String, String, String, i64);

pub(crate) fn lease_from_row(row: LeaseRow) -> Result<LeaseRecord, sqlx::Error> {
    let (principal, operation, key, status, generation) = row;
    Ok(LeaseRecord {
        principal,
        operation,
        key,
        status: super::parse_status(&status)?,
        generation,
    })
}

/// The `locked_until` of a parked row no completer can help: never.
const NEVER: &str = "9223372036854775807";

/// An attempt writes only while the row is `PROCESSING`: parked or settled
/// rows take no owner writes.
const OWNED: &str = "status = 'PROCESSING'";

impl Dialect {
    /// The three scope columns, as a condition.
    pub(crate) fn scope(&self, scope: &Scope<'_>) -> String {
        format!(
            "principal_id = {} AND operation = {} AND idem_key = {}",
            (self.key)(scope.principal),
            (self.key)(scope.operation),
            (self.key)(scope.key),
        )
    }

    /// The fence: the scope, at the writer's generation, `PROCESSING`.
    pub(crate) fn fenced(&self, scope: &Scope<'_>, generation: i64) -> String {
        format!(
            "{} AND generation = {generation} AND {OWNED}",
            self.scope(scope)
        )
    }

    /// A lease claim: `PROCESSING`, generation 1, leased for `lease_ms`.
    /// `tail` is the backend's conflict clause.
    pub(crate) fn claim(
        &self,
        claim: &Claim<'_>,
        lease_ms: i64,
        data: &[u8],
        tail: &str,
    ) -> String {
        format!(
            "INSERT INTO idempotency_records (principal_id, operation, idem_key, \
             request_fingerprint, status, created_at, expires_at, generation, locked_until, \
             recovery_data) \
             VALUES ({}, {}, {}, {}, 'PROCESSING', {now}, {now} + {}, 1, {now} + {lease_ms}, {}) \
             {tail}",
            (self.key)(claim.scope.principal),
            (self.key)(claim.scope.operation),
            (self.key)(claim.scope.key),
            (self.blob)(claim.fingerprint),
            claim.retention_ms,
            (self.blob)(data),
            now = self.now,
        )
    }

    /// Takes a lapsed lease (or, with `parked`, a parked row, which becomes
    /// `PROCESSING` again while its step is recovered) over: one
    /// conditional statement that names the generation seen.
    pub(crate) fn take_over(
        &self,
        scope: &Scope<'_>,
        seen: i64,
        lease_ms: i64,
        parked: bool,
    ) -> String {
        let also = if parked {
            " OR (status = 'NEEDS_RECONCILIATION' AND (locked_until IS NULL OR locked_until <= "
        } else {
            ""
        };
        format!(
            "UPDATE idempotency_records SET generation = {}, locked_until = {now} + {lease_ms}, \
             status = 'PROCESSING' \
             WHERE {} AND generation = {seen} AND ((status = 'PROCESSING' \
             AND locked_until <= {now}){also}{close})",
            seen.saturating_add(1),
            self.scope(scope),
            close = if parked {
                format!("{}))", self.now)
            } else {
                String::new()
            },
            now = self.now,
        )
    }

    /// The statement of a fenced write.
    pub(crate) fn write(
        &self,
        scope: &Scope<'_>,
        generation: i64,
        write: &LeaseWrite<'_>,
    ) -> String {
        let fence = match write {
            // An operator's resolution: the row must still be parked (a
            // `PROCESSING` row at the same generation is one resolved as
            // `Rerun` already) and not held by a completer pass.
            // The generation is not checked: completer passes take parked
            // rows over (and give them back) between an operator's listing
            // and their verdict, and the status alone tells the first
            // resolution from a second.
            // A completer pass turns the row `PROCESSING` while it works,
            // so the status alone says no pass holds it.
            LeaseWrite::Rerun | LeaseWrite::Resolve(_) => {
                format!("{} AND status = 'NEEDS_RECONCILIATION'", self.scope(scope))
            }
            _ => self.fenced(scope, generation),
        };
        let set = match write {
            LeaseWrite::Delete => return format!("DELETE FROM idempotency_records WHERE {fence}"),
            LeaseWrite::Renew { lease_ms } => format!("locked_until = {} + {lease_ms}", self.now),
            LeaseWrite::Pending { step, lease_ms } => format!(
                "pending_step = {}, locked_until = {} + {lease_ms}",
                (self.key)(step),
                self.now
            ),
            LeaseWrite::Progress {
                point,
                data,
                settled,
                lease_ms,
            } => format!(
                "recovery_point = {}, recovery_data = {}, pending_step = {}, \
                 locked_until = {} + {lease_ms}",
                point.map_or_else(|| "recovery_point".to_string(), self.key),
                (self.blob)(data),
                if *settled { "NULL" } else { "pending_step" },
                self.now
            ),
            LeaseWrite::Release => format!("locked_until = {}", self.now),
            LeaseWrite::Rerun => format!(
                "status = 'PROCESSING', locked_until = {}, pending_step = NULL",
                self.now
            ),
            // A row no completer can help is held out of their listing by
            // a lease that never ends (operators resolve it by status).
            LeaseWrite::Park { recoverable } => format!(
                "status = 'NEEDS_RECONCILIATION', locked_until = {}",
                if *recoverable { "NULL" } else { NEVER }
            ),
            LeaseWrite::Complete(c) | LeaseWrite::Resolve(c) => format!(
                "status = '{}', response_status = {}, response_headers = {}, \
                 response_body = {}, resource_id = {}, locked_until = NULL, pending_step = NULL",
                c.status.as_str(),
                c.response_status,
                (self.blob)(c.response_headers),
                (self.blob)(c.response_body),
                c.resource_id.map_or_else(|| "NULL".to_string(), self.text),
            ),
        };
        format!("UPDATE idempotency_records SET {set} WHERE {fence}")
    }

    /// The rows of `operations` a completer may take over, oldest lease
    /// first.
    pub(crate) fn list(&self, operations: &[&str], limit: i64) -> String {
        let operations = operations
            .iter()
            .map(|op| (self.key)(op))
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "SELECT {}, {}, {}, status, generation FROM idempotency_records \
             WHERE generation > 0 AND operation IN ({operations}) \
             AND ((status = 'PROCESSING' AND locked_until <= {now}) \
             OR (status = 'NEEDS_RECONCILIATION' AND pending_step IS NOT NULL \
             AND (locked_until IS NULL OR locked_until <= {now}))) \
             ORDER BY locked_until LIMIT {limit}",
            (self.read_key)("principal_id"),
            (self.read_key)("operation"),
            (self.read_key)("idem_key"),
            now = self.now,
        )
    }

    /// The row's `expires_at`, read back after a fenced completion.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn expires_at(&self, scope: &Scope<'_>) -> String {
        format!(
            "SELECT expires_at FROM idempotency_records WHERE {}",
            self.scope(scope)
        )
    }
}

/// Ends a phase's transaction by the fenced write's outcome: commits when
/// it matched (`Some(expires_at)`), rolls back when it did not or failed.
pub(crate) async fn commit_if_written<DB: sqlx::Database>(
    tx: sqlx::Transaction<'static, DB>,
    written: Result<Option<i64>, sqlx::Error>,
) -> Result<Option<i64>, super::FinishError> {
    match written {
        Ok(Some(expires_at)) => {
            tx.commit().await?;
            Ok(Some(expires_at))
        }
        Ok(None) => {
            tx.rollback().await?;
            Ok(None)
        }
        Err(e) => {
            let _ = tx.rollback().await;
            Err(e.into())
        }
    }
}

/// Stamps out `Backend::list_leases` for a backend whose `DIALECT` is in
/// scope.
macro_rules! list_leases {
    () => {
        async fn list_leases(
            pool: &sqlx::Pool<Self>,
            operations: &[&str],
            limit: i64,
        ) -> Result<Vec<$crate::store::LeaseRecord>, sqlx::Error> {
            use sqlx::FromRow as _;
            if operations.is_empty() {
                return Ok(Vec::new());
            }
            sqlx::raw_sql(sqlx::AssertSqlSafe(DIALECT.list(operations, limit)))
                .fetch_all(pool)
                .await?
                .iter()
                .map(|row| {
                    $crate::store::lease::lease_from_row($crate::store::lease::LeaseRow::from_row(
                        row,
                    )?)
                })
                .collect()
        }
    };
}
pub(crate) use list_leases;

/// Hex literal for SQLite and MySQL binary values.
pub(crate) fn x_literal(value: &[u8]) -> String {
    format!("X'{}'", hex(value))
}
