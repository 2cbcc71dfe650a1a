//! The ledger statements of lease mode, written once for every backend.
//!
//! Each backend supplies a [`Dialect`] (how a value enters a statement:
//! a bound parameter on PostgreSQL, an SQL literal made of hex digits
//! elsewhere; and its database clock); the statements are built here. Every write on a leased row is **fenced**: its `WHERE` names the
//! generation the writer holds, so a write from an owner that lost the row
//! to a takeover matches nothing, in the same statement as the write.

use super::{Claim, Completion, RecordStatus, Scope};

/// A value a statement binds to one of its placeholders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Arg {
    /// A binary value. (Only PostgreSQL binds values; the other backends
    /// write them as literals and their `Args` stay empty.)
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Bytes(Vec<u8>),
}

/// The values of a statement's placeholders, in their order: empty where
/// the backend writes values as literals.
pub(crate) type Args = Vec<Arg>;

/// Binds `arg` as the next PostgreSQL placeholder (`$1`, `$2`, …).
#[cfg(feature = "postgres")]
pub(crate) fn numbered(args: &mut Args, arg: Arg) -> String {
    args.push(arg);
    format!("${}", args.len())
}

/// How a backend puts values into a statement and reads its clock.
pub(crate) struct Dialect {
    /// A value for a binary-compared text column (scope, step and point).
    pub(crate) key: fn(&mut Args, &str) -> String,
    /// A value for a character text column (`resource_id`).
    pub(crate) text: fn(&mut Args, &str) -> String,
    /// A value for a binary column.
    pub(crate) blob: fn(&mut Args, &[u8]) -> String,
    /// A key column read back as text.
    pub(crate) read_key: fn(&str) -> String,
    /// The database clock, epoch milliseconds.
    pub(crate) now: &'static str,
    /// The `parks` column read as a 64-bit integer.
    pub(crate) parks: &'static str,
}

/// What a fenced write names: the claim (its random id) and the
/// generation of the attempt that holds it. A row deleted or purged and
/// claimed again has a new claim id, so a fence taken on the earlier row
/// never matches it, though both start at generation 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence<'a> {
    /// The generation held (1 at the claim, one more per takeover). For an
    /// operator's verdict, the generation the record was listed at (0 for a
    /// record of the default mode).
    pub generation: i64,
    /// The claim's id; `None` for a row claimed before the ledger stored
    /// claim ids (it matches only such rows).
    pub claim: Option<&'a str>,
}

/// A fenced write on a leased row. The owner's writes match only while the
/// row is `PROCESSING` at the writer's generation; an operator's verdicts
/// ([`Rerun`](Self::Rerun), [`Resolve`](Self::Resolve)) only while it is
/// `NEEDS_RECONCILIATION`.
#[derive(Debug, Clone, Copy)]
pub enum LeaseWrite<'a> {
    /// Extends a live lease to `lease_ms` from now (a lease that lapsed or
    /// was ended stays so).
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
        /// The step's timeout, milliseconds: until then its call may still
        /// land, so the record is neither listed as stranded nor open to a
        /// verdict (a takeover is: it runs the step with the same step key).
        step_ms: i64,
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
    /// tell which outcome is unknown); it is never resumed on its own, and
    /// counts one more park.
    Park {
        /// When a completer pass may retry the step's look-up, milliseconds
        /// from now; `None`: never (a step without a look-up, or saved data
        /// that cannot be read: left to an operator, and not listed for
        /// completers at all).
        retry_ms: Option<i64>,
    },
    /// An operator's verdict: the pending step had no effect. A lease-mode
    /// row is `PROCESSING` again with its lease ended, no pending step and
    /// the generation moved on (any earlier owner is fenced out), so the
    /// next attempt resumes and runs the step; a default-mode row is
    /// deleted, so the key runs afresh. Matches only an unsettled row of
    /// the claim named: parked, or (as listed, at the listed generation)
    /// `PROCESSING` with its lease lapsed, like [`Resolve`](Self::Resolve).
    Rerun {
        /// How often the record had been parked when it was listed.
        parks: i64,
    },
    /// Records the answer, `SUCCEEDED` or `FAILED_FINAL`, and ends the
    /// lease. Retention counts from now.
    Complete(&'a Completion<'a>),
    /// An operator's verdict: records the answer as
    /// [`Complete`](Self::Complete) does (moving the generation on, so an
    /// earlier owner is fenced out), but only on an unsettled row of the
    /// claim named that no attempt holds: parked as often as when it was
    /// listed (a completer pass that acted on it since parks it once more),
    /// or `PROCESSING` with its lease lapsed at the listed generation. Of
    /// two verdicts on one record exactly one wins.
    Resolve {
        /// The answer.
        completion: &'a Completion<'a>,
        /// How often the record had been parked when it was listed.
        parks: i64,
    },
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
    /// The claim's id; a takeover names it too.
    pub claim_id: Option<String>,
}

impl LeaseRecord {
    /// The fence a takeover of the row as listed names.
    pub fn fence(&self) -> Fence<'_> {
        Fence {
            generation: self.generation,
            claim: self.claim_id.as_deref(),
        }
    }
}

pub(crate) type LeaseRow = (String, String, String, String, i64, Option<String>);

pub(crate) fn lease_from_row(row: LeaseRow) -> Result<LeaseRecord, sqlx::Error> {
    let (principal, operation, key, status, generation, claim_id) = row;
    Ok(LeaseRecord {
        principal,
        operation,
        key,
        status: super::parse_status(&status)?,
        generation,
        claim_id,
    })
}

/// The reserved name under which the saved data holds the claim id too:
/// where rows claimed before the ledger had a `claim_id` column keep
/// theirs, and what an instance of that version derives step keys from,
/// so that versions side by side during an upgrade agree on them.
pub(crate) const CLAIM_ID: &str = "~claim";

/// The saved data a claim starts with: the claim id under [`CLAIM_ID`].
pub(crate) fn claim_data(claim_id: &str) -> String {
    format!(r#"{{"{CLAIM_ID}":"{claim_id}"}}"#)
}

/// The `locked_until` of a parked row no completer can help: never.
const NEVER: &str = "9223372036854775807";

/// An attempt writes only while the row is `PROCESSING`: parked or settled
/// rows take no owner writes.
const OWNED: &str = "status = 'PROCESSING'";

impl Dialect {
    /// The three scope columns, as a condition.
    pub(crate) fn scope(&self, a: &mut Args, scope: &Scope<'_>) -> String {
        format!(
            "principal_id = {} AND operation = {} AND idem_key = {}",
            (self.key)(a, scope.principal),
            (self.key)(a, scope.operation),
            (self.key)(a, scope.key),
        )
    }

    /// The scope and the claim: the row as it was claimed.
    fn claimed(&self, a: &mut Args, scope: &Scope<'_>, claim: Option<&str>) -> String {
        let claim = match claim {
            Some(id) => format!("claim_id = {}", (self.key)(a, id)),
            None => "claim_id IS NULL".to_string(),
        };
        format!("{} AND {claim}", self.scope(a, scope))
    }

    /// The fence: the claim, at the writer's generation, `PROCESSING`.
    pub(crate) fn fenced(&self, a: &mut Args, scope: &Scope<'_>, fence: Fence<'_>) -> String {
        format!(
            "{} AND generation = {} AND {OWNED}",
            self.claimed(a, scope, fence.claim),
            fence.generation
        )
    }

    /// An operator's fence: an unsettled row that no attempt holds, as it
    /// was listed. A lease-mode row of the claim named, parked as often as
    /// when listed (at any generation: a completer pass that only takes it
    /// and gives it back moves the generation, one that parks it again
    /// moves `parks`), or `PROCESSING` with its lease lapsed at the listed
    /// generation; a default-mode row `PROCESSING` or parked, parked as
    /// often as when listed (so a `PROCESSING` row seen before the layer
    /// parked it is not taken for the parked one).
    fn verdict(&self, a: &mut Args, scope: &Scope<'_>, fence: Fence<'_>, parks: i64) -> String {
        if fence.generation == 0 {
            return format!(
                "{} AND generation = 0 AND status IN ('PROCESSING', 'NEEDS_RECONCILIATION') \
                 AND parks = {parks}",
                self.scope(a, scope)
            );
        }
        format!(
            "{} AND generation > 0 AND ((status = 'NEEDS_RECONCILIATION' AND parks = {parks}) OR \
             (status = 'PROCESSING' AND generation = {} AND locked_until <= {now} AND {}))",
            self.claimed(a, scope, fence.claim),
            fence.generation,
            self.no_call_in_flight(),
            now = self.now
        )
    }

    /// No step's call may still land: none pending, or past its timeout.
    fn no_call_in_flight(&self) -> String {
        format!(
            "(pending_step IS NULL OR pending_until IS NULL OR pending_until <= {})",
            self.now
        )
    }

    /// A lease claim: `PROCESSING`, generation 1, the claim id (in its
    /// column, and in the saved data as [`CLAIM_ID`]), leased for
    /// `lease_ms`. `tail` is the backend's conflict clause; `gate`, a
    /// condition evaluated once before the row is written (PostgreSQL's
    /// bound on the statement's lock wait: see `postgres::lock_wait`). The
    /// claim id is made of hex digits.
    pub(crate) fn claim(
        &self,
        a: &mut Args,
        claim: &Claim<'_>,
        lease_ms: i64,
        claim_id: &str,
        gate: Option<&str>,
        tail: &str,
    ) -> String {
        let (open, close) = match gate {
            None => ("VALUES (".to_string(), ")".to_string()),
            Some(gate) => ("SELECT ".to_string(), format!(" WHERE {gate}")),
        };
        format!(
            "INSERT INTO idempotency_records (principal_id, operation, idem_key, \
             request_fingerprint, status, created_at, expires_at, generation, locked_until, \
             recovery_data, claim_id) \
             {open}{}, {}, {}, {}, 'PROCESSING', {now}, {now} + {}, 1, {now} + {lease_ms}, {}, {}{close} \
             {tail}",
            (self.key)(a, claim.scope.principal),
            (self.key)(a, claim.scope.operation),
            (self.key)(a, claim.scope.key),
            (self.blob)(a, claim.fingerprint),
            claim.retention_ms,
            (self.blob)(a, claim_data(claim_id).as_bytes()),
            (self.key)(a, claim_id),
            now = self.now,
        )
    }

    /// Takes a lapsed lease (or, with `parked`, a parked row, which becomes
    /// `PROCESSING` again while its step is recovered) over: one
    /// conditional statement that names the generation seen.
    pub(crate) fn take_over(
        &self,
        a: &mut Args,
        scope: &Scope<'_>,
        seen: Fence<'_>,
        lease_ms: i64,
        parked: bool,
    ) -> String {
        let status = if parked {
            "status IN ('PROCESSING', 'NEEDS_RECONCILIATION')"
        } else {
            OWNED
        };
        format!(
            "UPDATE idempotency_records SET generation = {}, locked_until = {now} + {lease_ms}, \
             status = 'PROCESSING' \
             WHERE {} AND generation = {} AND {status} AND locked_until <= {now}",
            seen.generation.saturating_add(1),
            self.claimed(a, scope, seen.claim),
            seen.generation,
            now = self.now,
        )
    }

    /// The statement of a fenced write.
    pub(crate) fn write(
        &self,
        a: &mut Args,
        scope: &Scope<'_>,
        fence: Fence<'_>,
        write: &LeaseWrite<'_>,
    ) -> String {
        let (fence, default_mode) = match write {
            LeaseWrite::Rerun { parks } | LeaseWrite::Resolve { parks, .. } => {
                (self.verdict(a, scope, fence, *parks), fence.generation == 0)
            }
            LeaseWrite::Renew { .. } => (
                format!(
                    "{} AND locked_until > {}",
                    self.fenced(a, scope, fence),
                    self.now
                ),
                false,
            ),
            _ => (self.fenced(a, scope, fence), false),
        };
        // Retention counts from the answer's recording: the row keeps its
        // retention as the distance from `created_at` to `expires_at`.
        let retain = format!("expires_at = {} + (expires_at - created_at)", self.now);
        let set = match write {
            LeaseWrite::Delete => return format!("DELETE FROM idempotency_records WHERE {fence}"),
            LeaseWrite::Rerun { .. } if default_mode => {
                return format!("DELETE FROM idempotency_records WHERE {fence}");
            }
            LeaseWrite::Renew { lease_ms } => format!("locked_until = {} + {lease_ms}", self.now),
            LeaseWrite::Pending {
                step,
                lease_ms,
                step_ms,
            } => format!(
                "pending_step = {}, locked_until = {now} + {lease_ms}, \
                 pending_until = {now} + {step_ms}",
                (self.key)(a, step),
                now = self.now
            ),
            LeaseWrite::Progress {
                point,
                data,
                settled,
                lease_ms,
            } => format!(
                "recovery_point = {}, recovery_data = {}, pending_step = {}, \
                 locked_until = {} + {lease_ms}",
                point.map_or_else(|| "recovery_point".to_string(), |p| (self.key)(a, p)),
                (self.blob)(a, data),
                if *settled { "NULL" } else { "pending_step" },
                self.now
            ),
            LeaseWrite::Release => format!("locked_until = {}", self.now),
            LeaseWrite::Rerun { .. } => format!(
                "status = 'PROCESSING', locked_until = {}, pending_step = NULL, \
                 generation = generation + 1",
                self.now
            ),
            // A row no completer can help is held out of their listing by
            // a lease that never ends (operators resolve it by status).
            LeaseWrite::Park { retry_ms } => format!(
                "status = 'NEEDS_RECONCILIATION', parks = parks + 1, locked_until = {}",
                retry_ms.map_or_else(|| NEVER.to_string(), |ms| format!("{} + {ms}", self.now))
            ),
            LeaseWrite::Complete(c) | LeaseWrite::Resolve { completion: c, .. } => {
                let verdict = if matches!(write, LeaseWrite::Resolve { .. }) && !default_mode {
                    ", generation = generation + 1"
                } else {
                    ""
                };
                format!(
                    "status = '{}', response_status = {}, response_headers = {}, \
                     response_body = {}, resource_id = {}, locked_until = NULL, \
                     pending_step = NULL, {retain}{verdict}",
                    c.status.as_str(),
                    c.response_status,
                    (self.blob)(a, c.response_headers),
                    (self.blob)(a, c.response_body),
                    c.resource_id
                        .map_or_else(|| "NULL".to_string(), |id| (self.text)(a, id)),
                )
            }
        };
        format!("UPDATE idempotency_records SET {set} WHERE {fence}")
    }

    /// The rows of `operations` a completer may take over, the one due
    /// longest first: lapsed leases, and parked rows whose back-off ended
    /// (`locked_until` is never NULL on either, so every store orders them
    /// alike).
    pub(crate) fn list(&self, a: &mut Args, operations: &[&str], limit: i64) -> String {
        let operations = operations
            .iter()
            .map(|op| (self.key)(a, op))
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "SELECT {}, {}, {}, status, generation, {} FROM idempotency_records \
             WHERE locked_until <= {now} AND generation > 0 AND operation IN ({operations}) \
             AND (status = 'PROCESSING' \
             OR (status = 'NEEDS_RECONCILIATION' AND pending_step IS NOT NULL)) \
             ORDER BY locked_until LIMIT {limit}",
            (self.read_key)("principal_id"),
            (self.read_key)("operation"),
            (self.read_key)("idem_key"),
            (self.read_key)("claim_id"),
            now = self.now,
        )
    }

    /// The records whose outcome is not settled, oldest first: parked
    /// ones, committed `PROCESSING` rows of the default mode, and lease-mode
    /// rows whose lease lapsed with a step pending, or more than
    /// `stranded_ms` ago.
    pub(crate) fn unresolved(&self, limit: i64, stranded_ms: i64) -> String {
        format!(
            "SELECT {}, {}, {}, status, response_status, created_at, generation, {}, {}, {}, \
             locked_until, {} FROM idempotency_records WHERE {} \
             ORDER BY created_at LIMIT {limit}",
            (self.read_key)("principal_id"),
            (self.read_key)("operation"),
            (self.read_key)("idem_key"),
            (self.read_key)("pending_step"),
            (self.read_key)("recovery_point"),
            (self.read_key)("claim_id"),
            self.parks,
            self.unresolved_where(stranded_ms),
        )
    }

    /// The condition of [`unresolved`](Self::unresolved): one definition
    /// for the listing, the operators' counts and the gauges.
    pub(crate) fn unresolved_where(&self, stranded_ms: i64) -> String {
        format!(
            "(status = 'NEEDS_RECONCILIATION' \
             OR (status = 'PROCESSING' AND generation = 0) \
             OR (status = 'PROCESSING' AND generation > 0 AND locked_until <= {now} AND {} \
             AND (pending_step IS NOT NULL OR locked_until <= {now} - {stranded_ms})))",
            self.no_call_in_flight(),
            now = self.now,
        )
    }

    /// The row's `expires_at` (PostgreSQL's tests read it back).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn expires_at(&self, a: &mut Args, scope: &Scope<'_>) -> String {
        format!(
            "SELECT expires_at FROM idempotency_records WHERE {}",
            self.scope(a, scope)
        )
    }
}

/// Ends a phase's transaction by the fenced write's outcome: commits when
/// it matched (`Some(expires_at)`), rolls back when it did not or failed.
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(crate) async fn commit_if_written<DB: sqlx::Database>(
    tx: super::Claimed<DB>,
    written: Result<Option<i64>, sqlx::Error>,
) -> Result<Option<i64>, super::FinishError> {
    match written {
        Ok(Some(expires_at)) => {
            tx.commit().await?;
            Ok(Some(expires_at))
        }
        Ok(None) => {
            tx.rollback().await;
            Ok(None)
        }
        Err(e) => {
            tx.rollback().await;
            Err(e.into())
        }
    }
}

/// Stamps out `Backend::list_leases` for a backend whose `DIALECT` and
/// `stmt` (a statement with its values) are in scope.
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
            let mut args = Vec::new();
            let sql = DIALECT.list(&mut args, operations, limit);
            $crate::store::on_ledger!(Self, pool, |ex, cached| stmt(pool, sql, args, cached)
                .fetch_all(ex))
            .iter()
            .map(|row| {
                $crate::store::lease::lease_from_row($crate::store::lease::LeaseRow::from_row(row)?)
            })
            .collect()
        }
    };
}
pub(crate) use list_leases;

/// Stamps out `Backend::list_unresolved` for a backend whose `DIALECT` is
/// in scope.
macro_rules! list_unresolved {
    () => {
        async fn list_unresolved(
            pool: &sqlx::Pool<Self>,
            limit: i64,
            stranded_ms: i64,
        ) -> Result<Vec<$crate::store::UnresolvedRecord>, sqlx::Error> {
            use sqlx::FromRow as _;
            let sql = DIALECT.unresolved(limit, stranded_ms);
            $crate::store::on_ledger!(Self, pool, |ex, cached| stmt(pool, sql, Vec::new(), cached)
                .fetch_all(ex))
            .iter()
            .map(|row| {
                $crate::store::unresolved_from_row($crate::store::UnresolvedRow::from_row(row)?)
            })
            .collect()
        }
    };
}
pub(crate) use list_unresolved;

/// Stamps out `Backend::count_unresolved` for a backend whose `DIALECT`
/// is in scope.
macro_rules! count_unresolved {
    () => {
        async fn count_unresolved(
            pool: &sqlx::Pool<Self>,
            stranded_ms: i64,
        ) -> Result<(i64, Option<i64>, i64), sqlx::Error> {
            use sqlx::FromRow as _;
            let sql = format!(
                "SELECT COUNT(*), MIN(created_at), {} FROM idempotency_records WHERE {}",
                DIALECT.now,
                DIALECT.unresolved_where(stranded_ms)
            );
            let row = $crate::store::on_ledger!(Self, pool, |ex, cached| stmt(
                pool,
                sql,
                Vec::new(),
                cached
            )
            .fetch_one(ex));
            <(i64, Option<i64>, i64)>::from_row(&row)
        }
    };
}
pub(crate) use count_unresolved;
