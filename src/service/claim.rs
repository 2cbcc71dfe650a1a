//! What an existing record means for a request (the decision table), and
//! taking the claim: bounded waits, waiter permits, the claim's own task.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Answer, IdempotencyOutcome, Identity, Run, refusal, store_problem};
use crate::expiry::{add_expiry, is_expired, retention_ms};
use crate::problem::{Problem, ProblemKind};
use crate::store::{
    Backend, Claim, ClaimOutcome, Claimed as ClaimedTx, Record, RecordStatus, StoreErrorKind,
    spawn_claim,
};

/// The outcome of the claim stage.
pub(super) enum Claimed<DB: Backend> {
    /// This request owns the scope; the transaction is past its savepoint.
    Won(ClaimedTx<DB>),
    /// Answer without running the handler.
    Answer(Answer),
}

/// Why one claim attempt did not settle the request.
pub(super) enum Pending {
    /// Another request holds the key.
    InFlight,
    /// The key is taken but its record could not be read.
    Unconfirmed,
}

/// The first attempt of a request not known to be a duplicate waits this
/// long at most on another claimer's row; longer waits need a waiter permit.
const PROBE_WAIT: Duration = Duration::from_millis(50);

impl<DB: Backend> Run<DB> {
    /// Claims the scope, or finds the answer a retry gets: at most the
    /// configured attempts, all before `deadline`.
    pub(super) async fn claim(
        &self,
        id: &Identity<'_>,
        duplicate: bool,
        deadline: Instant,
    ) -> Claimed<DB> {
        let cfg = &self.config;
        let mut attempts = 0;
        // Claim first by default: a first execution then costs no read. A
        // known duplicate, and every retry after a contended attempt, reads
        // first.
        let mut read_first = cfg.read_first || duplicate;
        // A request known to wait on another request's claim holds one of
        // the layer's waiter permits while it holds a connection to wait. (A
        // duplicate whose local leader has answered waits on nobody.)
        let mut waiting = false;
        let pending = loop {
            attempts += 1;
            if read_first {
                match self.lookup(id, deadline, attempts).await {
                    Ok(Some(answer)) => return Claimed::Answer(answer),
                    Ok(None) => {}
                    Err(e) => return store_failure::<DB>(&e, attempts),
                }
            }
            read_first = true;
            let contended = waiting || duplicate;
            let pending = match self
                .try_claim(id, deadline, (waiting, contended), attempts)
                .await
            {
                Ok(Attempt::Won(tx)) => return Claimed::Won(tx),
                Ok(Attempt::NoPermit) => break Pending::InFlight,
                // Lost to a committed row (or, above READ COMMITTED, to a
                // concurrent claim): a fresh read explains it.
                Ok(Attempt::Lost(Some(record))) => {
                    return Claimed::Answer(self.judge(&record, id, attempts));
                }
                Ok(Attempt::Lost(None)) => match self.lookup(id, deadline, attempts).await {
                    Ok(Some(answer)) => return Claimed::Answer(answer),
                    Ok(None) => Pending::Unconfirmed,
                    Err(e) => return store_failure::<DB>(&e, attempts),
                },
                Ok(Attempt::Blocked) => {
                    waiting = true;
                    Pending::InFlight
                }
                Err(e) => return store_failure::<DB>(&e, attempts),
            };
            if attempts >= cfg.claim_attempts {
                break pending;
            }
            let delay = backoff(attempts);
            if Instant::now() + delay >= deadline {
                break pending;
            }
            tokio::time::sleep(delay).await;
        };
        Claimed::Answer(self.pending(pending, attempts))
    }

    /// The `409` for a request that could not settle within its bounds.
    pub(super) fn pending(&self, pending: Pending, attempts: u32) -> Answer {
        let (kind, detail) = match pending {
            Pending::Unconfirmed => (
                ProblemKind::Unconfirmed,
                "the Idempotency-Key is taken but its record could not be read; retry with the same key",
            ),
            Pending::InFlight => (
                ProblemKind::InFlight,
                "a request with this Idempotency-Key is still being processed; retry with the same key later",
            ),
        };
        let retry_after = self.config.in_flight_wait.as_secs().max(1);
        refusal(
            Problem::new(kind, detail).retry_after(retry_after),
            attempts,
        )
    }

    /// One claim attempt, on a connection acquired within the deadline. The
    /// claim itself runs as its own task, so a response future dropped
    /// mid-claim can never return a connection to the pool halfway through
    /// the claim's statements: the task finishes (within its lock wait) and
    /// rolls back.
    async fn try_claim(
        &self,
        id: &Identity<'_>,
        deadline: Instant,
        (waiting, contended): (bool, bool),
        attempts: u32,
    ) -> Result<Attempt<DB>, sqlx::Error> {
        let cfg = &self.config;
        let permit = if waiting {
            match Arc::clone(&cfg.waiters).try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => return Ok(Attempt::NoPermit),
            }
        } else {
            None
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let mut conn = match tokio::time::timeout(left, crate::store::acquire(&self.pool)).await {
            Ok(conn) => conn?,
            // No connection within what is left of the wait budget: for a
            // request that met another one with its key, still in flight.
            Err(_) if contended => return Ok(Attempt::NoPermit),
            Err(_) => return Err(sqlx::Error::PoolTimedOut),
        };
        self.find_ledger(&mut conn).await?;
        // The rest of the budget, shared by the attempts still allowed; a
        // request not yet known to wait only probes.
        let left = deadline.saturating_duration_since(Instant::now());
        let share = left / (cfg.claim_attempts.saturating_sub(attempts) + 1);
        let lock_wait = if waiting {
            share
        } else {
            share.min(PROBE_WAIT)
        }
        .max(Duration::from_millis(1));
        let claim = Claim {
            scope: id.scope,
            fingerprint: id.fingerprint.as_bytes(),
            retention_ms: retention_ms(cfg.retention),
            lock_wait,
            isolation: cfg.isolation,
            cached_statements: cfg.cached_statements,
            database: cfg.ledger(),
            causal_wait: cfg.causal_wait(),
        };
        // The claim runs as its own task: a caller whose deadline comes
        // first stops waiting for it (a lock wait on SQLite is its
        // `busy_timeout`), and the task rolls back what nobody took.
        let claiming = spawn_claim(conn, &claim, permit);
        let outcome = match self.caller_deadline {
            None => claiming.await,
            Some(caller) => {
                let left = caller.saturating_duration_since(Instant::now());
                match tokio::time::timeout(left, claiming).await {
                    Ok(outcome) => outcome,
                    Err(_) if contended => return Ok(Attempt::Blocked),
                    Err(_) => return Err(sqlx::Error::PoolTimedOut),
                }
            }
        };
        match outcome {
            Ok(ClaimOutcome::Won(tx)) => Ok(Attempt::Won(tx)),
            Ok(ClaimOutcome::Lost(record)) => Ok(Attempt::Lost(record)),
            Ok(ClaimOutcome::InFlight) => Ok(Attempt::Blocked),
            Err(e) => match DB::error_kind(&e) {
                StoreErrorKind::LockTimeout => Ok(Attempt::Blocked),
                StoreErrorKind::Conflict => Ok(Attempt::Lost(None)),
                _ => Err(e),
            },
        }
    }

    /// Reads the committed record and decides what it means for `id`, the
    /// answer telling how many claim attempts were made; `None` when there
    /// is no committed record.
    pub(super) async fn lookup(
        &self,
        id: &Identity<'_>,
        deadline: Instant,
        attempts: u32,
    ) -> Result<Option<Answer>, sqlx::Error> {
        let wait = deadline.saturating_duration_since(Instant::now());
        let record = self.fetch_within(wait, &id.scope).await?;
        Ok(record.map(|record| self.judge(&record, id, attempts)))
    }

    /// The decision table for a committed record. Expiry first: a key past
    /// its retention is never executed again, whatever the payload.
    pub(super) fn judge(&self, record: &Record, id: &Identity<'_>, attempts: u32) -> Answer {
        if is_expired(record) {
            let detail = "this Idempotency-Key's retention has ended; the original request is not executed again. Look the resource up, or send a new key for a new operation";
            let link = match (&record.resource_id, &self.config.resource_link) {
                (Some(id), Some(link)) => Some(link(id)),
                _ => None,
            };
            return refusal(
                Problem::new(ProblemKind::Expired, detail)
                    .resource(record.resource_id.clone(), link),
                attempts,
            );
        }
        if record.fingerprint != id.fingerprint.as_bytes() {
            let detail = "this Idempotency-Key was already used with a different request; use a new key for a different operation";
            return refusal(
                Problem::new(ProblemKind::KeyReused, detail).status(self.config.mismatch_status),
                attempts,
            );
        }
        match (record.status, record.response_status) {
            (RecordStatus::Succeeded | RecordStatus::FailedFinal, Some(status)) => {
                let mut res = record
                    .stored_response(status)
                    .to_response(self.config.replayed_header);
                add_expiry(res.headers_mut(), record.expires_at);
                (res, IdempotencyOutcome::Replayed)
            }
            // A committed PROCESSING row: in this mode rows are PROCESSING
            // only inside their own transaction, so the handler ended that
            // transaction itself and nobody knows what took effect. (Lease
            // rows in PROCESSING are judged by the lease path first.)
            _ => refusal(Problem::reconciling(), attempts),
        }
    }
}

/// What one claim attempt found.
enum Attempt<DB: Backend> {
    Won(ClaimedTx<DB>),
    /// A committed row holds the scope (read on the way, or to be read).
    Lost(Option<Box<Record>>),
    /// Another claimer's uncommitted row held the scope past the lock wait.
    Blocked,
    /// No waiter permit (or no connection) left for a request that waits.
    NoPermit,
}

/// A store failure ends the claim stage with a retryable refusal.
fn store_failure<DB: Backend>(e: &sqlx::Error, attempts: u32) -> Claimed<DB> {
    Claimed::Answer(refusal(store_problem::<DB>(e), attempts))
}

/// Exponential backoff from 25 ms, capped at 1 s, with up to 50 % jitter so
/// contending retries spread out.
pub(super) fn backoff(attempt: u32) -> Duration {
    let base = 25u64.saturating_mul(1 << attempt.min(6)).min(1000);
    let jitter = crate::random::random_below(base / 2 + 1);
    Duration::from_millis(base / 2 + jitter)
}
