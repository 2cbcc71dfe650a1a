//! Operating the ledger: list what is unsettled, look at one record, settle
//! it with an audit trail, see the ledger at a glance.
//!
//! [`Ledger`] is the API under the `tower-idempotency` command-line tool
//! (feature `cli`) and the embeddable console (`admin::router`, feature
//! `admin`). Its verdicts are [`Reconciler`]'s, with the same fences and
//! the same refusals ([`ResolveError`]); what it adds is the audit trail:
//! each verdict is written in one transaction with a row of the crate's
//! own table `tower_idempotency_audit` (created by
//! [`migrate`](crate::migrate)) naming who gave it, why, when (database
//! clock) and what the record was just before. A verdict never commits
//! without its audit row, and an audit row never without its verdict.
//!
//! # Concurrency
//!
//! - A verdict reads the record under a row lock (PostgreSQL and
//!   MySQL/MariaDB `FOR UPDATE`, SQLite's write lock), writes the fenced
//!   verdict, and inserts the audit row, then commits. Of two operators
//!   settling one record, exactly one wins; the other gets
//!   [`ResolveError::Settled`] (with what the record is now) and writes
//!   nothing. The completer and a client's retry are fenced out the same
//!   way as with [`Reconciler::resolve`].
//! - Lock waits are bounded (5 s on PostgreSQL and MariaDB; SQLite's
//!   `busy_timeout`).
//! - Reads ([`unresolved`](Ledger::unresolved), [`show`](Ledger::show),
//!   [`status`](Ledger::status)) take no locks and see committed rows only;
//!   what they return may have changed the moment after.
//!
//! # Cost on a large ledger
//!
//! [`show`](Ledger::show) and the audit trail are primary-key and index
//! look-ups. [`unresolved`](Ledger::unresolved) is [`Reconciler`]'s listing:
//! its lease-mode rows come through the lease index, but on PostgreSQL the
//! default mode's unsettled rows cannot be told from settled ones by an
//! index without giving up heap-only completions (every column a
//! completion writes is one such an index would name), so the listing
//! reads the table once. [`status`](Ledger::status) counts by one scan of
//! the table. See `docs/operating.md` for timings on a million rows.
//!
//! # Example
//!
//! ```no_run
//! # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use tower_idempotency::admin::{Attribution, Ledger};
//! use tower_idempotency::Resolution;
//!
//! let ledger = Ledger::new(pool);
//! let by = Attribution::new("alice", "provider shows no charge for the step key")?;
//! for record in ledger.unresolved(100).await? {
//!     ledger.resolve(&record, Resolution::Rerun, &by).await?;
//!     let trail = ledger.audit(&record.scope()).await?;
//!     assert_eq!(trail.last().map(|e| e.actor.as_str()), Some("alice"));
//! }
//! # Ok(())
//! # }
//! ```

mod audit;
#[cfg(feature = "admin")]
mod html;
mod record;
#[cfg(feature = "admin")]
mod router;
mod status;

use std::time::Duration;

use sqlx::Pool;

pub use audit::{Attribution, AttributionError, AuditEntry, MAX_ACTOR_LEN, MAX_REASON_LEN};
pub use record::{LedgerRow, Lookup, Seen};
#[cfg(feature = "admin")]
#[cfg_attr(docsrs, doc(cfg(feature = "admin")))]
pub use router::{Actor, MAX_FORM_BYTES, router};
pub use status::{DiskSize, LedgerStatus, StatusCount, SweepPreview};

use crate::reconcile::{Verdict, refusal};
pub use crate::store::AdminBackend;
use crate::store::{AuditNote, Scope, UnresolvedRecord};
use crate::{Reconciler, Resolution, ResolveError};

/// A listed record as JSON, its age measured against `now` (the
/// database clock, [`Ledger::clock`]), with the step key of its pending
/// step (what the provider knows the call by). `handler_status` (also
/// under its column's name, `response_status`) is what the handler
/// answered before the layer found its transaction ended: never sent.
pub fn unresolved_json(record: &UnresolvedRecord, now: i64) -> serde_json::Value {
    serde_json::json!({
        "principal": record.principal,
        "operation": record.operation,
        "key": record.key,
        "status": record.status.as_str(),
        "generation": record.generation,
        "pending_step": record.pending_step,
        "step_key": step_key(record).map(|k| k.as_str().to_string()),
        "recovery_point": record.recovery_point,
        "response_status": record.response_status,
        "handler_status": record.response_status,
        "created_at": record.created_at,
        "age_ms": now.saturating_sub(record.created_at),
        "locked_until": record.locked_until,
        "parks": record.parks,
    })
}

/// The step key of `record`'s pending step, when it has one (lease mode).
pub fn step_key(record: &UnresolvedRecord) -> Option<crate::lease::StepKey> {
    crate::lease::StepKey::of(record, record.pending_step.as_deref()?)
}

/// Who settled `row`, by its audit trail (oldest first, as
/// [`Ledger::audit`] returns it): the operator whose latest verdict is the
/// `succeeded` or `failed` answer the record now carries. `None` when the
/// service settled it (a client's retry or the completer): no verdict, a
/// rerun last, or a last verdict that does not match the record now.
pub fn settled_by<'a>(row: &LedgerRow, trail: &'a [AuditEntry]) -> Option<&'a AuditEntry> {
    use crate::store::RecordStatus;
    let last = trail.last()?;
    let matches = match row.status {
        RecordStatus::Succeeded => last.verdict == "succeeded",
        RecordStatus::FailedFinal => last.verdict == "failed",
        _ => false,
    };
    (matches && last.response_status == row.response_status).then_some(last)
}

/// An age in milliseconds for people: `850ms`, `42s`, `17m 3s`, `5h 2m`,
/// `3d 4h`.
pub fn human_age(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        _ if ms < 1000 => format!("{}ms", ms.max(0)),
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h {}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// The most records one listing returns.
pub const MAX_LIST: u32 = 1000;

/// The most audit rows one record's trail returns.
pub const MAX_TRAIL: u32 = 1000;

/// The operators' view of a ledger (see the [module docs](self)).
#[derive(Debug)]
pub struct Ledger<DB: AdminBackend> {
    pool: Pool<DB>,
    stranded_after: Duration,
}

impl<DB: AdminBackend> Clone for Ledger<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            stranded_after: self.stranded_after,
        }
    }
}

/// A verdict that was recorded: the record before it, and now.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Resolved {
    /// The record just before the verdict, as read to name it.
    pub before: LedgerRow,
    /// The record after it (`None`: a rerun of a default-mode record
    /// deleted it, so the key's next request runs afresh).
    pub after: Option<LedgerRow>,
}

impl<DB: AdminBackend> Ledger<DB> {
    /// The ledger in `pool`.
    pub fn new(pool: Pool<DB>) -> Self {
        Self {
            pool,
            stranded_after: crate::DEFAULT_STRANDED_AFTER,
        }
    }

    /// As [`Reconciler::with_stranded_after`]: when a lapsed lease with
    /// nothing pending is listed. The default is
    /// [`DEFAULT_STRANDED_AFTER`](crate::DEFAULT_STRANDED_AFTER).
    #[must_use]
    pub fn with_stranded_after(mut self, age: Duration) -> Self {
        self.stranded_after = age;
        self
    }

    /// At most `limit` (capped at [`MAX_LIST`]) records whose outcome is
    /// not settled, oldest first: [`Reconciler::unresolved`]. One
    /// statement, no locks: a record may be settled (or another parked)
    /// the moment after; a verdict on a listed record names it as listed
    /// and is refused if it moved on.
    pub async fn unresolved(&self, limit: u32) -> Result<Vec<UnresolvedRecord>, sqlx::Error> {
        Reconciler::new(self.pool.clone())
            .with_stranded_after(self.stranded_after)
            .unresolved(limit.min(MAX_LIST))
            .await
    }

    /// The record `lookup` names (see [`Lookup::new`] for the forms tried),
    /// every column; the reading as sent first when the lookup is
    /// ambiguous (see [`find`](Self::find)). `None` when there is none. A
    /// read of committed rows, no locks: a snapshot of the moment it ran.
    pub async fn show(&self, lookup: &Lookup) -> Result<Option<LedgerRow>, sqlx::Error> {
        Ok(self.find(lookup).await?.into_iter().next())
    }

    /// Every record `lookup` may name, each once, the reading as sent
    /// first: one at most for [`Lookup::stored`], two when a
    /// [`Lookup::new`] is ambiguous. A read of committed rows, no locks.
    pub async fn find(&self, lookup: &Lookup) -> Result<Vec<LedgerRow>, sqlx::Error> {
        let mut found: Vec<LedgerRow> = Vec::new();
        for parts in lookup.candidates() {
            if let Some(row) = DB::row(&self.pool, &record::scope_of(&parts)).await?
                && !found.iter().any(|r| r.same_scope(&row))
            {
                found.push(row);
            }
        }
        Ok(found)
    }

    /// The one record `lookup` names, for a verdict.
    async fn one(&self, lookup: &Lookup) -> Result<LedgerRow, ResolveError> {
        let mut found = self.find(lookup).await?;
        match found.len() {
            0 => Err(ResolveError::Gone),
            1 => Ok(found.remove(0)),
            _ => Err(ResolveError::Ambiguous {
                scopes: found
                    .into_iter()
                    .map(|r| (r.principal, r.operation, r.key))
                    .collect(),
            }),
        }
    }

    /// The record's audit trail, oldest first: its newest [`MAX_TRAIL`]
    /// entries (so the last entry is the newest verdict), committed
    /// verdicts only, each written with its verdict. The last entry is not
    /// always the verdict the record carries: after a rerun, the service
    /// (a retry or the completer) settles it; see [`settled_by`].
    pub async fn audit(&self, scope: &Scope<'_>) -> Result<Vec<AuditEntry>, sqlx::Error> {
        DB::audit_trail(&self.pool, scope, i64::from(MAX_TRAIL)).await
    }

    /// Settles `record` as listed, as [`Reconciler::resolve`] does, and
    /// records the audit row with the verdict in one transaction. Refused
    /// (nothing written, no audit row) with the same [`ResolveError`]s.
    pub async fn resolve(
        &self,
        record: &UnresolvedRecord,
        resolution: Resolution,
        by: &Attribution,
    ) -> Result<(), ResolveError> {
        let verdict = Verdict::of(resolution);
        let completion = verdict.completion();
        let write = verdict.write(record, completion.as_ref());
        let note = AuditNote {
            actor: by.actor(),
            reason: by.reason(),
            verdict: verdict.name(),
            response_status: verdict.response_status(),
        };
        if DB::audited_verdict(&self.pool, &record.scope(), record.fence(), &write, &note).await? {
            return Ok(());
        }
        Err(refusal(&self.pool, record).await)
    }

    /// Settles the record `lookup` names, as it is now: reads it, refuses
    /// when it is settled ([`ResolveError::Settled`]) or missing
    /// ([`ResolveError::Gone`]), else [`resolve`](Self::resolve)s it as read
    /// (so a completer pass or an attempt between the read and the verdict
    /// makes the verdict refused, never lost).
    ///
    /// "As it is now" is not as the operator saw it: a verdict decided on
    /// an earlier look lands on whatever the record became meanwhile
    /// (another operator's rerun, say). The CLI and the console settle
    /// lease-mode records through [`resolve_seen`](Self::resolve_seen)
    /// only.
    pub async fn resolve_lookup(
        &self,
        lookup: &Lookup,
        resolution: Resolution,
        by: &Attribution,
    ) -> Result<Resolved, ResolveError> {
        let before = self.one(lookup).await?;
        let seen = Seen::of(&before);
        self.resolve_read(before, &seen, resolution, by).await
    }

    /// Settles the record `lookup` names, as the operator saw it (`seen`:
    /// its generation, parks and claim id as [`show`](Self::show) read
    /// them): the verdict is fenced on those, as on a listed record
    /// ([`resolve`](Self::resolve)), so it is refused
    /// ([`ResolveError::Changed`], [`Held`](ResolveError::Held),
    /// [`Settled`](ResolveError::Settled) or [`Gone`](ResolveError::Gone))
    /// when the record moved on since: rerun by another operator, taken
    /// over, parked again. (A completer pass that took a parked record and
    /// gave it back unchanged moves its generation but not its parks; a
    /// verdict on it still lands, as on a listed record.)
    pub async fn resolve_seen(
        &self,
        lookup: &Lookup,
        seen: &Seen,
        resolution: Resolution,
        by: &Attribution,
    ) -> Result<Resolved, ResolveError> {
        let before = self.one(lookup).await?;
        self.resolve_read(before, seen, resolution, by).await
    }

    async fn resolve_read(
        &self,
        before: LedgerRow,
        seen: &Seen,
        resolution: Resolution,
        by: &Attribution,
    ) -> Result<Resolved, ResolveError> {
        let Some(mut record) = before.as_unresolved() else {
            return Err(ResolveError::Settled {
                status: before.status,
            });
        };
        // The stored scope found, fenced as the operator saw it.
        record.generation = seen.generation;
        record.parks = seen.parks;
        record.claim_id.clone_from(&seen.claim_id);
        self.resolve(&record, resolution, by).await?;
        let after = DB::row(&self.pool, &record.scope()).await?;
        Ok(Resolved { before, after })
    }

    /// The ledger at a glance: one scan of the table, and the lease index.
    /// Its unresolved count is [`unresolved`](Self::unresolved)'s
    /// definition, with this ledger's stranded age.
    pub async fn status(&self) -> Result<LedgerStatus, sqlx::Error> {
        DB::status(&self.pool, crate::expiry::millis(self.stranded_after)).await
    }

    /// What a [`Sweeper`](crate::Sweeper) pass would expire and purge now
    /// (two counts through the expiry index; nothing is written).
    pub async fn sweep_preview(&self) -> Result<SweepPreview, sqlx::Error> {
        DB::sweep_preview(&self.pool).await
    }

    /// The database clock, epoch milliseconds: what ages are measured
    /// against.
    pub async fn clock(&self) -> Result<i64, sqlx::Error> {
        DB::clock(&self.pool).await
    }

    /// Applies the crate's missing migrations ([`migrate`](crate::migrate))
    /// and returns those it applied, `(version, name)`, in order: the
    /// versions missing before the call and present after it. Safe beside
    /// other instances migrating (each version is applied once, under the
    /// migration lock), but then each caller may report versions another
    /// one applied.
    pub async fn migrate(&self) -> Result<Vec<(i64, String)>, sqlx::Error> {
        let before = DB::applied_migrations(&self.pool).await?;
        crate::migrate(&self.pool).await?;
        let after = DB::applied_migrations(&self.pool).await?;
        Ok(after.into_iter().filter(|m| !before.contains(m)).collect())
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }
}
