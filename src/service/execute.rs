//! Running the handler on the claimed transaction, and keeping what its
//! answer says to keep.

use std::any::Any;
use std::panic::resume_unwind;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use tower_service::Service;

use super::at_commit::AtCommit;
use super::{
    BoxError, CatchUnwind, IdempotencyOutcome, Identity, ReadAnswer, Run, buffered, read_response,
    refuse, store_problem,
};
use crate::body::{Ending, IdempotencyBody, Settle, Settled};
use crate::classify::Classification;
use crate::expiry::{EXPIRES, expiry_header, retention_ms};
use crate::observe;
use crate::problem::{Problem, ProblemKind};
use crate::replay::StoredResponse;
use crate::store::{
    AtCommitOutcome, Backend, Claim, Claimed, Completion, FinishError, MIN_READ_WAIT, OwnedClaim,
    Record, RecordStatus, StoreErrorKind,
};
use crate::tx::Tx;

impl<DB: Backend> Run<DB> {
    /// Runs the handler on the claimed transaction and keeps what its answer
    /// says to keep.
    pub(super) async fn execute<S, ReqBody, ResBody>(
        &self,
        mut inner: S,
        id: &Identity<'_>,
        tx: Claimed<DB>,
        parts: Parts,
        body: Bytes,
        hold: Box<dyn Any + Send>,
    ) -> Result<Response<IdempotencyBody<ResBody>>, S::Error>
    where
        S: Service<Request<IdempotencyBody<ReqBody>>, Response = Response<ResBody>>,
        ResBody: Body<Data = Bytes>,
        ResBody::Error: Into<BoxError>,
    {
        let handle = Tx::new(tx);
        let mut req = Request::from_parts(parts, IdempotencyBody::buffered(body));
        req.extensions_mut().insert(handle.clone());
        let handling = Instant::now();
        let result = CatchUnwind {
            inner: inner.call(req),
        }
        .await;
        observe::timing("handler_ms", handling.elapsed());
        let tx = handle.take();
        drop(handle);
        let res = match result {
            Err(panic) => {
                self.abandon::<ResBody>(tx, id, 500).await;
                resume_unwind(panic);
            }
            Ok(Err(e)) => {
                self.abandon::<ResBody>(tx, id, 500).await;
                return Err(e);
            }
            Ok(Ok(res)) => res,
        };
        let handler_status = i32::from(res.status().as_u16());
        let Some(tx) = tx else {
            // The handler still holds the transaction: it rolls back when the
            // handler lets go, and nothing may be recorded.
            let detail = "the handler kept the idempotency transaction after answering; nothing was committed";
            return Ok(refuse(
                Problem::new(ProblemKind::TransactionHeld, detail),
                1,
            ));
        };
        let limit = self.config.max_response_body;
        let answer = match read_response(res, limit).await {
            Ok(answer) => answer,
            Err(problem) => {
                if let Some(ended) = self.abandon(Some(tx), id, handler_status).await {
                    return Ok(ended);
                }
                return Ok(refuse(problem, 1));
            }
        };
        let class = answer.class();
        let outcome = IdempotencyOutcome::Executed(class);
        let status = match class {
            Classification::Success => RecordStatus::Succeeded,
            Classification::FinalFailure => RecordStatus::FailedFinal,
            Classification::Rejected | Classification::Transient => {
                if let Some(ended) = self.abandon(Some(tx), id, handler_status).await {
                    return Ok(ended);
                }
                // Claim at commit: the handler of a key already recorded
                // ran again; the record, not this answer, is the key's.
                if let Some(recorded) = self.recorded_at_commit(id).await {
                    return Ok(buffered(recorded.0, recorded.1));
                }
                return Ok(answer.into_response(outcome));
            }
        };
        // An answer over the limit streams on with its transaction open,
        // and commits (without its body) once it ends well.
        let answer = match answer {
            ReadAnswer::Over {
                parts,
                prefix,
                rest,
            } => {
                // Claim at commit: an answer that streams before its row is
                // written is first checked against the ledger.
                if let Some(recorded) = self.recorded_at_commit(id).await {
                    tx.rollback().await;
                    return Ok(buffered(recorded.0, recorded.1));
                }
                return Ok(self.settle_at_end(id, tx, parts, prefix, rest, class, hold));
            }
            whole => whole,
        };
        let stored = answer.stored(&self.config.recorded_headers, limit);
        let completion = Completion::of(status, &stored, &answer.parts().extensions);
        let committing = Instant::now();
        let finished = if self.config.claim_at_commit {
            match self.finish_at_commit(tx, id, &completion).await {
                AtCommit::Finished(finished) => finished,
                AtCommit::Lost((res, outcome)) => return Ok(buffered(res, outcome)),
            }
        } else {
            DB::finish(&self.pool, tx, &self.ledger_claim(id), &completion).await
        };
        observe::timing("commit_ms", committing.elapsed());
        // The answer as the handler gave it, with the key's expiry.
        let respond = |expiry: Option<HeaderValue>| {
            let mut res = answer.into_response(outcome);
            if let Some(expiry) = expiry {
                res.headers_mut().insert(EXPIRES, expiry);
            }
            Ok(res)
        };
        // What a failed commit means, for every store: the one place it is
        // decided.
        let e = match finished {
            Ok(expires_at) => return respond(expiry_header(expires_at)),
            Err(FinishError::Aborted(_)) => {
                // The connection was lost during COMMIT, and the database
                // says the transaction rolled back.
                let detail = "the connection was lost while committing and the database reports the transaction rolled back; nothing was committed, retry with the same key";
                let problem = Problem::new(ProblemKind::CommitUnknown, detail).retry_after(1);
                return Ok(refuse(problem, 1));
            }
            Err(FinishError::InProgress(_)) => {
                // Still committing (or rolling back) on the server: the key
                // stays locked until it is done, and a retry then replays.
                let detail = "the connection was lost while committing and the database reports the transaction still in progress; retry with the same key later";
                let problem = Problem::new(ProblemKind::InFlight, detail).retry_after(1);
                return Ok(refuse(problem, 1));
            }
            Err(FinishError::Ended(_)) => return Ok(self.ended(id, handler_status).await),
            Err(FinishError::Store(e)) => e,
        };
        match DB::error_kind(&e) {
            StoreErrorKind::TransactionEnded => Ok(self.ended(id, handler_status).await),
            // The database rolled the transaction back (a deadlock, a
            // serialization failure, a Galera certification conflict at
            // COMMIT): the request that conflicted may have recorded this
            // key's answer.
            StoreErrorKind::Conflict => Ok(self.rolled_back(id, &e).await),
            StoreErrorKind::ConnectionLost => {
                // The commit may or may not have landed, and the store could
                // not tell: ask the ledger. The handler's answer is given
                // only when the ledger holds it; another one there (a
                // duplicate on another instance ran the key once this
                // transaction was gone) is the key's answer, replayed.
                let record = match self.fetch_within(MIN_READ_WAIT, &id.scope).await {
                    Ok(Some(record)) => record,
                    _ => return Ok(refuse(commit_unknown(), 1)),
                };
                if record.status == status
                    && record
                        .response_status
                        .map(|s| record.stored_response(s))
                        .as_ref()
                        == Some(&stored)
                {
                    return respond(expiry_header(record.expires_at));
                }
                match self.judge(&record, id, 1) {
                    (replay, IdempotencyOutcome::Replayed) => {
                        Ok(buffered(replay, IdempotencyOutcome::Replayed))
                    }
                    _ => Ok(refuse(commit_unknown(), 1)),
                }
            }
            _ => Ok(refuse(store_problem::<DB>(&e), 1)),
        }
    }

    /// An answer streamed past the recording limit: the client gets it as
    /// it streams, and its transaction stays open until its body ends
    /// (within `max_stream_hold`). It commits, recorded without its body,
    /// only if it ends well: a gRPC `OK` (or a final failure) in its
    /// trailers, an HTTP body that finishes. A failed end (an `INTERNAL`,
    /// a broken body, the bound) rolls everything back, so what commits is
    /// what the client was told. `hold` (the key's local lead, the
    /// principal's slot) lives until then.
    #[allow(clippy::too_many_arguments)]
    fn settle_at_end<B>(
        &self,
        id: &Identity<'_>,
        tx: Claimed<DB>,
        parts: http::response::Parts,
        prefix: Bytes,
        rest: std::pin::Pin<Box<B>>,
        class: Classification,
        hold: Box<dyn Any + Send>,
    ) -> Response<IdempotencyBody<B>> {
        let limit = self.config.max_response_body;
        let stored = StoredResponse::capture_not_kept(
            parts.status,
            &parts.headers,
            &self.config.recorded_headers,
            limit,
        );
        let claim = OwnedClaim::new(&self.ledger_claim(id));
        // What the answer is sorted by once its trailers are known: its
        // head, and the handler's mark or resource id.
        let (mut head, ()) = Response::new(()).into_parts();
        head.status = parts.status;
        head.headers = parts.headers.clone();
        if let Some(mark) = parts.extensions.get::<Classification>() {
            head.extensions.insert(*mark);
        }
        if let Some(resource) = parts.extensions.get::<crate::ResourceId>() {
            head.extensions.insert(resource.clone());
        }
        let pool = self.pool.clone();
        let at_commit = self.config.claim_at_commit.then(|| self.commit_wait());
        let settle: Settle = Box::new(move |ending| {
            let class = match ending {
                Ending::Finished(trailers) => {
                    Some(Classification::of_answer(&head, trailers, true))
                }
                Ending::Broken => None,
            };
            Box::pin(async move {
                let _hold = hold;
                let status = match class {
                    Some(Classification::Success) => RecordStatus::Succeeded,
                    Some(Classification::FinalFailure) => RecordStatus::FailedFinal,
                    _ => {
                        tx.rollback().await;
                        return Settled::RolledBack;
                    }
                };
                let completion = Completion::of(status, &stored, &head.extensions);
                let finished = match at_commit {
                    // Claim at commit: a row of another request makes this
                    // answer's transaction roll back whole.
                    Some(wait) => {
                        let mut claim = claim.as_claim();
                        claim.lock_wait = wait;
                        match DB::finish_at_commit(&pool, tx, &claim, &completion).await {
                            Ok(AtCommitOutcome::Committed(expires_at)) => Ok(expires_at),
                            Ok(AtCommitOutcome::Lost(_)) => return Settled::RolledBack,
                            Err(e) => Err(e),
                        }
                    }
                    None => DB::finish(&pool, tx, &claim.as_claim(), &completion).await,
                };
                match finished {
                    Ok(_) => Settled::Committed,
                    Err(e) => {
                        tracing::warn!(error = ?e, "an answer streamed past the recording limit could not be committed");
                        Settled::Failed
                    }
                }
            })
        });
        let grpc = crate::classify::is_grpc(&parts.headers);
        let body =
            IdempotencyBody::settling(prefix, rest, settle, grpc, self.config.max_stream_hold);
        let mut res = Response::from_parts(parts, body);
        res.extensions_mut()
            .insert(IdempotencyOutcome::Executed(class));
        res
    }

    /// Rolls the claimed transaction back and waits for it, so the key's row
    /// lock is released before the answer leaves (a queued rollback could
    /// leave the next retry waiting). Returns the answer to give instead
    /// of the handler's when the transaction had ended before (see
    /// [`ended`](Self::ended)).
    async fn abandon<B>(
        &self,
        tx: Option<Claimed<DB>>,
        id: &Identity<'_>,
        handler_status: i32,
    ) -> Option<Response<IdempotencyBody<B>>> {
        let mut tx = tx?;
        let ended = DB::check_savepoint(&mut tx)
            .await
            .is_err_and(|e| DB::error_kind(&e) == StoreErrorKind::TransactionEnded);
        if !ended {
            tx.rollback().await;
            return None;
        }
        if DB::CLAIMS_RUN_WITHOUT_AUTOCOMMIT {
            // Whatever ran after the end is uncommitted: rolled back.
            tx.rollback().await;
        } else {
            // Whatever the handler left open is closed with its connection.
            tx.discard();
        }
        Some(self.ended(id, handler_status).await)
    }

    /// The claimed transaction was found ended, not by the layer (its
    /// savepoint is gone). Where claims run without autocommit
    /// ([`Backend::CLAIMS_RUN_WITHOUT_AUTOCOMMIT`]) and the claim's
    /// `PROCESSING` row did not commit, nothing of this execution
    /// committed: the server rolled the transaction back (a deadlock, or on
    /// Galera a replicated writer's abort), and whatever the handler sent
    /// afterwards was rolled back with the claim. The ledger then says what
    /// to answer ([`answer_after_rollback`](Self::answer_after_rollback)). Otherwise the
    /// handler ended it itself, and what it committed is kept: the key is
    /// held for reconciliation.
    async fn ended<B>(
        &self,
        id: &Identity<'_>,
        handler_status: i32,
    ) -> Response<IdempotencyBody<B>> {
        if DB::CLAIMS_RUN_WITHOUT_AUTOCOMMIT {
            // A read that fails proves nothing: asked once more, then a
            // retryable refusal with the key left as it is (a committed
            // row of this claim, if any, holds it by itself).
            let mut read = self.fetch_within(MIN_READ_WAIT, &id.scope).await;
            if read.is_err() {
                tokio::time::sleep(self.read_bound(MIN_READ_WAIT)).await;
                read = self.fetch_within(MIN_READ_WAIT, &id.scope).await;
            }
            // A default-mode row (no lease) with this request's
            // fingerprint, committed unsettled: this claim's row.
            let own_row_committed = match &read {
                Ok(Some(record)) => {
                    matches!(
                        record.status,
                        RecordStatus::Processing | RecordStatus::NeedsReconciliation
                    ) && record.lease.is_none()
                        && record.fingerprint == id.fingerprint.as_bytes()
                }
                Ok(None) => false,
                Err(e) => {
                    tracing::warn!(error = %e, "the claimed transaction ended and the ledger could not be read");
                    let detail = "the database ended the transaction, and the ledger could not be read to tell what became of this key; its outcome is not known yet, retry with the same key";
                    let problem =
                        Problem::new(ProblemKind::StoreUnavailable, detail).retry_after(1);
                    return refuse(problem, 1);
                }
            };
            if !own_row_committed {
                return self.answer_after_rollback(id, read);
            }
        }
        self.strand(id, handler_status).await;
        transaction_ended()
    }

    /// The database rolled the claimed transaction back (`e`): nothing of
    /// this execution committed. Replays the answer recorded since by the
    /// request that won the key (on Galera, the duplicate on another node
    /// whose commit was certified first), else asks for a retry.
    async fn rolled_back<B>(
        &self,
        id: &Identity<'_>,
        e: &sqlx::Error,
    ) -> Response<IdempotencyBody<B>> {
        tracing::warn!(error = %e, "the claimed transaction was rolled back by the database");
        let read = self.fetch_within(MIN_READ_WAIT, &id.scope).await;
        self.answer_after_rollback(id, read)
    }

    /// What to answer once nothing of this execution committed, given the
    /// key's committed record: the recorded answer (or the refusal) it
    /// calls for, else `503` `#transaction-conflict` with `Retry-After`.
    fn answer_after_rollback<B>(
        &self,
        id: &Identity<'_>,
        read: Result<Option<Record>, sqlx::Error>,
    ) -> Response<IdempotencyBody<B>> {
        match read {
            Ok(Some(record)) => {
                let (res, outcome) = self.judge(&record, id, 1);
                buffered(res, outcome)
            }
            Ok(None) => {
                let detail = "the database rolled the transaction back (a conflict with a concurrent one); nothing was committed, retry with the same key";
                refuse(
                    Problem::new(ProblemKind::TransactionConflict, detail).retry_after(1),
                    1,
                )
            }
            Err(e) => refuse(store_problem::<DB>(&e), 1),
        }
    }

    /// The handler ended the claimed transaction itself: whatever it
    /// committed stays (on the stores that insert a `PROCESSING` row at the
    /// claim, with that row after a `COMMIT`; without a ledger row on
    /// PostgreSQL, or after a `ROLLBACK` followed by more writes). Hold the
    /// key so that
    /// it answers "outcome unknown" until an operator resolves it: the
    /// committed row is marked, a missing one inserted. Between the
    /// handler's own `ROLLBACK` and this, the key was unprotected: a
    /// handler must never end the layer's transaction.
    async fn strand(&self, id: &Identity<'_>, handler_status: i32) {
        let marked = DB::mark_unresolved(&self.pool, &self.ledger_claim(id), handler_status).await;
        tracing::error!(
            handler_status,
            marked = marked.is_ok(),
            "the handler ended the claimed transaction itself (COMMIT, ROLLBACK or DDL); \
             what it committed is kept and the key needs reconciliation"
        );
    }
}

impl<DB: Backend> Run<DB> {
    /// What the ledger keeps of `id`'s claim: its scope, fingerprint and
    /// retention.
    pub(super) fn ledger_claim<'a>(&'a self, id: &'a Identity<'_>) -> Claim<'a> {
        Claim {
            scope: id.scope,
            fingerprint: id.fingerprint.as_bytes(),
            retention_ms: retention_ms(self.config.retention),
            lock_wait: Duration::ZERO,
            isolation: self.config.isolation,
            cached_statements: self.config.cached_statements,
            database: self.config.ledger(),
            causal_wait: self.config.causal_wait(),
        }
    }
}

fn transaction_ended<B>() -> Response<IdempotencyBody<B>> {
    let detail = "the handler ended the idempotency transaction itself; what it committed is kept, and this key is held for reconciliation";
    refuse(Problem::new(ProblemKind::TransactionEnded, detail), 1)
}

/// A commit whose connection was lost, with no answer in the ledger to
/// give instead.
fn commit_unknown() -> Problem {
    let detail = "the connection was lost while committing and the ledger shows no commit; retry with the same key";
    Problem::new(ProblemKind::CommitUnknown, detail).retry_after(1)
}
