//! [`Completer`]: drives abandoned lease-mode records to completion with no
//! client retry.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Response};
use sqlx::Pool;

use super::settle::{ReleaseOnDrop, park_unreadable, settle};
use super::{LeaseMode, Leased};
use crate::classify::Classification;
use crate::outcome::IdempotencyOutcome;
use crate::problem::ProblemKind;
use crate::scope::http_operation;
use crate::store::{Backend, Fence, IsolationLevel, RecordStatus, Scope, end_lease};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type Resume<DB> = Arc<dyn Fn(Leased<DB>) -> BoxFuture<Response<Bytes>> + Send + Sync>;

/// Finds lease-mode records whose lease lapsed (the attempt crashed and no
/// client retried) and drives each to completion through the resume
/// function registered for its operation, with the same fencing as a
/// retry: a takeover in one conditional update, generation + 1, the resume
/// function given the [`Leased`] context at the last recovery point, the
/// answer recorded fenced (or the lease ended again on a transient
/// failure). Parked (`NEEDS_RECONCILIATION`) records with a pending step
/// are taken over the same way so their step's `recover` runs again: `Done`
/// completes them, `Unknown` parks them again.
///
/// Safe on every instance at once: each record is taken over by at most
/// one of them, and a client retry racing a completer is fenced the same
/// way. Each pass handles at most [`with_batch`](Self::with_batch) records,
/// one at a time, each bounded by its steps' timeouts and by
/// [`with_attempt_timeout`](Self::with_attempt_timeout).
pub struct Completer<DB: Backend> {
    pool: Pool<DB>,
    mode: LeaseMode,
    isolation: IsolationLevel,
    batch: u32,
    attempt_timeout: Duration,
    recorded_headers: Vec<HeaderName>,
    resumers: HashMap<String, Resume<DB>>,
}

impl<DB: Backend> std::fmt::Debug for Completer<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completer")
            .field("mode", &self.mode)
            .field("batch", &self.batch)
            .field("operations", &self.resumers.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// What one completer pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompleterReport {
    /// Records found abandoned (or parked with a pending step).
    pub found: usize,
    /// Records this pass took over (the others were taken by someone else
    /// first, or had no resume function).
    pub taken_over: usize,
    /// Records completed (`SUCCEEDED` or `FAILED_FINAL` recorded).
    pub completed: usize,
    /// Records parked (again) for reconciliation.
    pub parked: usize,
}

impl<DB: Backend> Completer<DB> {
    /// A completer for the ledger in `pool`, taking leases of `mode` (use
    /// the routes' own). Records the same headers as the layer by default.
    pub fn new(pool: Pool<DB>, mode: LeaseMode) -> Self {
        Self {
            pool,
            mode,
            isolation: IsolationLevel::default(),
            batch: 16,
            attempt_timeout: mode.lease.max(mode.step_timeout).saturating_mul(4),
            recorded_headers: crate::replay::default_recorded_headers(),
            resumers: HashMap::new(),
        }
    }

    /// Registers how to resume records of `operation` (as the layer names
    /// it: `POST /payments` for the route's method and path, or the name
    /// given to `with_operation`, stored as the layer stores it). The
    /// function gets the context at the record's last recovery point, with
    /// no request: everything it needs must have been saved by a phase. Its answer is recorded as a
    /// handler's is. A record whose first attempt died before its first
    /// phase has nothing saved: answer a rejection (such as `422`) and the
    /// claim is deleted, so the client's retry runs afresh. But first look
    /// at [`Leased::pending_step`]: a step that may have run must be run
    /// again (its `recover` runs first), or answered with a transient
    /// failure; a final answer (or a rejection) over it is refused and the
    /// record is parked for an operator. A resume function that panics or
    /// times out ends its lease and is tried again at a later pass. A
    /// record whose saved data cannot be read is parked for an operator
    /// and never taken again.
    #[must_use]
    pub fn resume<F, Fut>(mut self, operation: &str, resume: F) -> Self
    where
        F: Fn(Leased<DB>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Response<Bytes>> + Send + 'static,
    {
        let resume: Resume<DB> = Arc::new(move |leased| Box::pin(resume(leased)));
        self.resumers
            .insert(http_operation(operation).into_owned(), resume);
        self
    }

    /// At most this many records per pass (default 16, at least 1).
    #[must_use]
    pub fn with_batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// The longest one resumed attempt may run (default four leases); past
    /// it the attempt is dropped and its lease ended.
    #[must_use]
    pub fn with_attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// The isolation level of the phases' transactions (default `READ
    /// COMMITTED`); use the layer's.
    #[must_use]
    pub fn with_isolation_level(mut self, level: IsolationLevel) -> Self {
        self.isolation = level;
        self
    }

    /// The response headers recorded with an answer; use the layer's.
    #[must_use]
    pub fn with_recorded_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.recorded_headers = headers.into_iter().collect();
        self
    }

    /// One pass: list, take over, resume, record.
    pub async fn run_once(&self) -> Result<CompleterReport, sqlx::Error> {
        let operations: Vec<&str> = self.resumers.keys().map(String::as_str).collect();
        let listed = DB::list_leases(&self.pool, &operations, i64::from(self.batch)).await?;
        let mut report = CompleterReport {
            found: listed.len(),
            ..CompleterReport::default()
        };
        for record in listed {
            let Some(resume) = self.resumers.get(&record.operation) else {
                continue;
            };
            let scope = Scope {
                principal: &record.principal,
                operation: &record.operation,
                key: &record.key,
            };
            let parked = record.status == RecordStatus::NeedsReconciliation;
            let lease_ms = self.mode.lease_ms();
            if !DB::take_over(&self.pool, &scope, record.fence(), lease_ms, parked).await? {
                continue;
            }
            report.taken_over += 1;
            let generation = record.generation + 1;
            let saved = match DB::fetch(&self.pool, &scope).await {
                Ok(record) => record.and_then(|r| r.lease),
                Err(e) => {
                    // Won, but unusable: no lease is left without its owner.
                    let won = Fence {
                        generation,
                        claim: record.claim_id.as_deref(),
                    };
                    end_lease(&self.pool, &scope, won).await;
                    return Err(e);
                }
            };
            let Some(saved) = saved else {
                continue;
            };
            if saved.generation != generation || saved.claim_id != record.claim_id {
                // Taken over again in between (a client's retry): theirs.
                continue;
            }
            let leased =
                match Leased::new(self.pool.clone(), &scope, self.mode, self.isolation, &saved) {
                    Ok(leased) => leased,
                    Err(e) => {
                        park_unreadable(&self.pool, &scope, saved.fence(), &e).await?;
                        report.parked += 1;
                        continue;
                    }
                };
            tracing::info!(generation, "completer resuming an abandoned record");
            match self.attempt(resume, leased).await {
                Some(IdempotencyOutcome::Executed(
                    Classification::Success | Classification::FinalFailure,
                )) => report.completed += 1,
                Some(IdempotencyOutcome::Refused {
                    problem: ProblemKind::Reconciling,
                    ..
                }) => report.parked += 1,
                _ => {}
            }
        }
        Ok(report)
    }

    /// Runs one resumed attempt in its own task (a panic ends its lease),
    /// bounded by the attempt timeout, and records its answer.
    async fn attempt(&self, resume: &Resume<DB>, leased: Leased<DB>) -> Option<IdempotencyOutcome> {
        let mut guard = ReleaseOnDrop::new(leased.clone());
        let run = tokio::spawn(resume(leased.clone()));
        let abort = run.abort_handle();
        let res = match tokio::time::timeout(self.attempt_timeout, run).await {
            Ok(Ok(res)) => res,
            Ok(Err(_)) | Err(_) => {
                abort.abort();
                tracing::warn!("a resumed attempt panicked or timed out; its lease ends");
                return None;
            }
        };
        guard.disarm();
        let (_, outcome) = settle(&leased, res, &self.recorded_headers, None).await;
        Some(outcome)
    }

    /// Runs [`run_once`](Self::run_once) every `interval` on the tokio
    /// runtime until the returned handle is aborted. A failed pass is
    /// retried at the next tick.
    pub fn spawn(self, interval: Duration) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                if let Err(e) = self.run_once().await {
                    tracing::warn!(error = %e, "completer pass failed");
                }
            }
        })
    }
}
