//! The end of a lease-mode attempt: record the answer fenced, or end the
//! lease so the next attempt resumes. Shared by the layer and the completer.

use bytes::Bytes;
use http::{HeaderName, Response};

use super::{LeaseError, Leased};
use crate::classify::Classification;
use crate::expiry::add_expiry;
use crate::outcome::IdempotencyOutcome;
use crate::problem::{Problem, ProblemKind};
use crate::replay::{StoredResponse, Trailers};
use crate::store::{Backend, Completion, Fence, FinishError, LeaseWrite, RecordStatus, Scope};

fn refused(problem: Problem, attempts: u32) -> (Response<Bytes>, IdempotencyOutcome) {
    let outcome = IdempotencyOutcome::Refused {
        problem: problem.kind,
        attempts,
    };
    (problem.into_response(), outcome)
}

/// Ends the lease so the next attempt resumes at once (best effort: a
/// lease that cannot be ended lapses on its own).
pub(crate) async fn release<DB: Backend>(leased: &Leased<DB>) {
    drop(leased.take_final());
    if leased.usable().is_ok()
        && let Err(e) = leased.write(&LeaseWrite::Release).await
    {
        tracing::warn!(error = %e, "could not end the lease; it lapses on its own");
    }
}

/// Keeps what the handler's answer says to keep and returns what the
/// client gets. `not_kept`: the answer's body was over this recording
/// limit and is not in `res` (it is recorded without its body, and an
/// `Executed` outcome means the caller sends the handler's whole body).
pub(crate) async fn settle<DB: Backend>(
    leased: &Leased<DB>,
    res: Response<Bytes>,
    recorded_headers: &[HeaderName],
    not_kept: Option<usize>,
) -> (Response<Bytes>, IdempotencyOutcome) {
    let Some(final_tx) = leased.take_final() else {
        release(leased).await;
        let detail = "the handler kept the final phase's transaction after answering; nothing of it was committed";
        return refused(Problem::new(ProblemKind::TransactionHeld, detail), 1);
    };
    {
        let state = leased.state();
        if state.lost {
            return refused(Problem::lease_lost(), 1);
        }
        if state.parked {
            return refused(Problem::reconciling(), 1);
        }
    }
    let (parts, body) = res.into_parts();
    let trailers = parts.extensions.get::<Trailers>().map(|t| &t.0);
    let class = Classification::of_answer(&parts, trailers, not_kept.is_none());
    let outcome = IdempotencyOutcome::Executed(class);
    let (progressed, pending) = {
        let state = leased.state();
        (state.progressed, state.pending.clone())
    };
    if let Some(step) = &pending
        && class != Classification::Transient
    {
        // A step that may have run and was not recovered: nothing final
        // (an answer, a rejection, a deleted claim) may be written over
        // it. Parked, so an operator (or a pass that runs the step) says
        // what happened.
        drop(final_tx);
        tracing::error!(
            step,
            "the handler answered over a pending step it did not recover; parked"
        );
        return match leased.park(step, true).await {
            LeaseError::Lost => refused(Problem::lease_lost(), 1),
            _ => refused(Problem::reconciling(), 1),
        };
    }
    let status = match class {
        Classification::Success => RecordStatus::Succeeded,
        Classification::FinalFailure => RecordStatus::FailedFinal,
        // A rejection after a phase or step committed is final: what was
        // committed stays, so the key must not run again with another
        // request, nor be resumed behind the client's back.
        Classification::Rejected if progressed => RecordStatus::FailedFinal,
        Classification::Rejected | Classification::Transient => {
            drop(final_tx);
            let write = if class == Classification::Rejected {
                // Nothing but the claim was committed: the key may be used
                // again with a corrected request, as in the default mode.
                LeaseWrite::Delete
            } else {
                LeaseWrite::Release
            };
            return match leased.write(&write).await {
                Ok(()) => (Response::from_parts(parts, body), outcome),
                // A later attempt owns the key: its answer is the one.
                Err(LeaseError::Lost) => refused(Problem::lease_lost(), 1),
                Err(e) => {
                    tracing::warn!(error = %e, "could not end the lease; it lapses on its own");
                    (Response::from_parts(parts, body), outcome)
                }
            };
        }
    };
    let stored = match not_kept {
        Some(limit) => {
            StoredResponse::capture_not_kept(parts.status, &parts.headers, recorded_headers, limit)
        }
        None => StoredResponse::capture(
            parts.status,
            &parts.headers,
            recorded_headers,
            body,
            parts.extensions.get(),
        ),
    };
    let completion = Completion::of(status, &stored, &parts.extensions);
    let inner = &leased.inner;
    let tx = match final_tx {
        Some(tx) => Ok(tx),
        None => DB::begin_phase(&inner.pool, inner.isolation).await,
    };
    let committed = match tx {
        Ok(tx) => {
            let write = LeaseWrite::Complete(&completion);
            DB::commit_fenced(&inner.pool, tx, &leased.scope(), leased.fence(), &write).await
        }
        Err(e) => Err(FinishError::Store(e)),
    };
    match committed {
        Ok(Some(expires_at)) => {
            let mut res = Response::from_parts(parts, stored.body);
            add_expiry(res.headers_mut(), expires_at);
            (res, outcome)
        }
        Ok(None) => {
            leased.state().lost = true;
            refused(Problem::lease_lost(), 1)
        }
        // The database says the commit is still running: it may yet land;
        // the lease stays until it has, or lapses.
        Err(FinishError::InProgress(_)) => {
            let detail = "the answer's commit is still in progress; retry with the same key";
            refused(
                Problem::new(ProblemKind::InFlight, detail).retry_after(1),
                1,
            )
        }
        Err(e) => {
            // Rolled back, or unknown: ending the lease is refused if the
            // record committed, and lets the retry resume if it did not.
            tracing::warn!(error = %e, "recording a lease-mode answer failed");
            release(leased).await;
            let detail = "the answer could not be recorded; retry with the same key, which resumes or replays";
            refused(
                Problem::new(ProblemKind::CommitUnknown, detail).retry_after(1),
                1,
            )
        }
    }
}

/// Parks a row taken over whose saved data cannot be read (written by
/// another version, or by hand): no attempt can resume it, so it is left
/// to an operator, and never listed for completers again.
pub(crate) async fn park_unreadable<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    scope: &Scope<'_>,
    fence: Fence<'_>,
    error: &LeaseError,
) -> Result<(), sqlx::Error> {
    tracing::error!(%error, "a leased record's saved data cannot be read; parked for an operator");
    DB::lease_write(pool, scope, fence, &LeaseWrite::Park { retry_ms: None }).await?;
    Ok(())
}

/// Ends the lease when an attempt is dropped or panics before it settled.
pub(crate) struct ReleaseOnDrop<DB: Backend> {
    leased: Option<Leased<DB>>,
}

impl<DB: Backend> ReleaseOnDrop<DB> {
    pub(crate) fn new(leased: Leased<DB>) -> Self {
        Self {
            leased: Some(leased),
        }
    }

    /// The attempt settled: nothing to do on drop.
    pub(crate) fn disarm(&mut self) {
        self.leased = None;
    }
}

impl<DB: Backend> Drop for ReleaseOnDrop<DB> {
    fn drop(&mut self) {
        let Some(leased) = self.leased.take() else {
            return;
        };
        // The final phase (if any) rolls back as its transaction drops.
        drop(leased.take_final());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { release(&leased).await });
        }
    }
}

impl From<LeaseError> for Problem {
    fn from(e: LeaseError) -> Self {
        match e {
            LeaseError::Lost => Problem::lease_lost(),
            LeaseError::Reconciling => Problem::reconciling(),
            // A programming error: no retry fixes it until the handler is.
            LeaseError::Misuse(_) | LeaseError::InvalidName { .. } => {
                tracing::error!(error = %e, "the handler misused lease mode");
                Problem::new(
                    ProblemKind::LeaseMisuse,
                    "the service misused its idempotency lease mode; nothing was charged by the misused call",
                )
            }
            // Never the database's own words in an answer: they are logged.
            other => {
                tracing::warn!(error = %other, "lease mode failed; the client may retry");
                let detail = match other {
                    LeaseError::Store(_) => "the ledger could not be reached",
                    LeaseError::Data(_) => "this key's saved state could not be read",
                    _ => "the handler used lease mode wrongly",
                };
                Problem::new(
                    ProblemKind::StoreUnavailable,
                    format!("{detail}; retry with the same key"),
                )
                .retry_after(1)
            }
        }
    }
}
