//! Running the handler on the claimed transaction, and keeping what its
//! answer says to keep.

use std::panic::resume_unwind;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use tower_service::Service;

use super::claim::MIN_READ_WAIT;
use super::{
    BoxError, CatchUnwind, IdempotencyOutcome, Identity, Run, buffered, expiry_header,
    read_response, refuse, store_problem,
};
use crate::body::IdempotencyBody;
use crate::classify::Classification;
use crate::expiry::{IDEMPOTENCY_KEY_EXPIRES, retention_ms};
use crate::observe;
use crate::problem::{Problem, ProblemKind};
use crate::replay::StoredResponse;
use crate::store::{
    Backend, Claim, Claimed, Completion, FinishError, RecordStatus, StoreErrorKind,
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
                self.abandon(tx, id, 500).await;
                resume_unwind(panic);
            }
            Ok(Err(e)) => {
                self.abandon(tx, id, 500).await;
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
        let (res_parts, body) = match read_response(res, self.config.max_response_body).await {
            Ok(res) => res.into_parts(),
            Err(problem) => {
                if self.abandon(Some(tx), id, handler_status).await {
                    return Ok(transaction_ended());
                }
                return Ok(refuse(problem, 1));
            }
        };
        let class = res_parts
            .extensions
            .get::<Classification>()
            .copied()
            .unwrap_or_else(|| Classification::from_status(res_parts.status));
        let outcome = IdempotencyOutcome::Executed(class);
        let status = match class {
            Classification::Success => RecordStatus::Succeeded,
            Classification::FinalFailure => RecordStatus::FailedFinal,
            Classification::Rejected | Classification::Transient => {
                if self.abandon(Some(tx), id, handler_status).await {
                    return Ok(transaction_ended());
                }
                return Ok(buffered(Response::from_parts(res_parts, body), outcome));
            }
        };
        let stored = StoredResponse::capture(
            res_parts.status,
            &res_parts.headers,
            &self.config.recorded_headers,
            body,
        );
        let completion = Completion::of(status, &stored, &res_parts.extensions);
        let committing = Instant::now();
        let finished = DB::finish(&self.pool, tx, &id.scope, &completion).await;
        observe::timing("commit_ms", committing.elapsed());
        // The answer as the handler gave it, with the key's expiry.
        let respond = |expiry: Option<HeaderValue>| {
            let mut res = Response::from_parts(res_parts, stored.body);
            if let Some(expiry) = expiry {
                res.headers_mut().insert(IDEMPOTENCY_KEY_EXPIRES, expiry);
            }
            Ok(buffered(res, outcome))
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
            Err(FinishError::Store(e)) => e,
        };
        match DB::error_kind(&e) {
            StoreErrorKind::TransactionEnded => {
                self.strand(id, handler_status).await;
                Ok(transaction_ended())
            }
            StoreErrorKind::ConnectionLost => {
                // The commit may or may not have landed, and the store could
                // not tell: ask the ledger.
                let deadline = Instant::now() + MIN_READ_WAIT;
                match self.lookup(id, deadline, 1).await {
                    Ok(Some((replay, IdempotencyOutcome::Replayed))) => {
                        respond(replay.headers().get(IDEMPOTENCY_KEY_EXPIRES).cloned())
                    }
                    _ => {
                        let detail = "the connection was lost while committing and the ledger shows no commit; retry with the same key";
                        let problem =
                            Problem::new(ProblemKind::CommitUnknown, detail).retry_after(1);
                        Ok(refuse(problem, 1))
                    }
                }
            }
            _ => Ok(refuse(store_problem::<DB>(&e), 1)),
        }
    }

    /// Rolls the claimed transaction back and waits for it, so the key's row
    /// lock is released before the answer leaves (a queued rollback could
    /// leave the next retry waiting). Returns `true` when the handler had
    /// ended the transaction itself: the key is then marked for
    /// reconciliation.
    async fn abandon(
        &self,
        tx: Option<Claimed<DB>>,
        id: &Identity<'_>,
        handler_status: i32,
    ) -> bool {
        let Some(mut tx) = tx else { return false };
        let ended = DB::check_savepoint(&mut tx)
            .await
            .is_err_and(|e| DB::error_kind(&e) == StoreErrorKind::TransactionEnded);
        if ended {
            // Whatever the handler left open is closed with its connection.
            tx.discard();
            self.strand(id, handler_status).await;
        } else {
            tx.rollback().await;
        }
        ended
    }

    /// The handler ended the claimed transaction itself: whatever it
    /// committed stays (with the `PROCESSING` row, after a `COMMIT`; without
    /// it, after a `ROLLBACK` followed by more writes). Hold the key so that
    /// it answers "outcome unknown" until an operator resolves it: the
    /// committed row is marked, a missing one inserted. Between the
    /// handler's own `ROLLBACK` and this, the key was unprotected: a
    /// handler must never end the layer's transaction.
    async fn strand(&self, id: &Identity<'_>, handler_status: i32) {
        let claim = Claim {
            scope: id.scope,
            fingerprint: id.fingerprint.as_bytes(),
            retention_ms: retention_ms(self.config.retention),
            lock_wait: Duration::ZERO,
            isolation: self.config.isolation,
        };
        let marked = DB::mark_unresolved(&self.pool, &claim, handler_status).await;
        tracing::error!(
            handler_status,
            marked = marked.is_ok(),
            "the handler ended the claimed transaction itself (COMMIT, ROLLBACK or DDL); \
             what it committed is kept and the key needs reconciliation"
        );
    }
}

fn transaction_ended<B>() -> Response<IdempotencyBody<B>> {
    let detail = "the handler ended the idempotency transaction itself; what it committed is kept, and this key is held for reconciliation";
    refuse(Problem::new(ProblemKind::TransactionEnded, detail), 1)
}
