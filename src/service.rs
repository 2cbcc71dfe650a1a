//! [`Idempotency`]: the service that runs the protocol around the inner one.

use std::any::Any;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Request, Response, header};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use pin_project_lite::pin_project;
use sqlx::{Pool, Transaction};
use tower_service::Service;
use tracing::Instrument;

use crate::body::IdempotencyBody;
use crate::classify::{Classification, ResourceId};
use crate::expiry::{IDEMPOTENCY_KEY_EXPIRES, http_date, is_expired, millis};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::layer::Config;
use crate::local::Local;
use crate::observe;
use crate::problem::{Problem, ProblemKind};
use crate::replay::StoredResponse;
use crate::scope::{bounded, default_operation, hashed};
use crate::store::{
    Backend, Claim, ClaimOutcome, Completion, IsolationLevel, Record, RecordStatus, Scope,
    StoreErrorKind,
};
use crate::tx::Tx;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the layer did with a request. Every response it returns carries one
/// in its extensions, for outer layers (logging, metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdempotencyOutcome {
    /// The method is not guarded, or no key was sent and keys are optional.
    Unguarded,
    /// The handler ran on a fresh claim; the class says what was kept.
    Executed(Classification),
    /// A stored answer was replayed; the handler did not run.
    Replayed,
    /// The layer answered with a problem document; the handler did not run,
    /// or its work was rolled back.
    Refused {
        /// Which refusal.
        problem: ProblemKind,
        /// How many claim attempts were made (0 when refused before claiming).
        attempts: u32,
    },
}

/// The middleware service built by [`IdempotencyLayer`](crate::IdempotencyLayer).
pub struct Idempotency<S, DB: Backend> {
    inner: S,
    pool: Pool<DB>,
    config: Arc<Config>,
}

impl<S: Clone, DB: Backend> Clone for Idempotency<S, DB> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            pool: self.pool.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S, DB: Backend> std::fmt::Debug for Idempotency<S, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<S, DB: Backend> Idempotency<S, DB> {
    pub(crate) fn new(inner: S, pool: Pool<DB>, config: Arc<Config>) -> Self {
        Self {
            inner,
            pool,
            config,
        }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

pin_project! {
    /// The response future of [`Idempotency`].
    pub struct ResponseFuture<R, E> {
        #[pin]
        inner: BoxFuture<Result<R, E>>,
    }
}

impl<R, E> Future for ResponseFuture<R, E> {
    type Output = Result<R, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().inner.poll(cx)
    }
}

impl<S, DB, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, DB>
where
    S: Service<Request<IdempotencyBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    DB: Backend,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<IdempotencyBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<Self::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        if !self.config.guards(req.method()) {
            let fut = self.inner.call(req.map(IdempotencyBody::streaming));
            return ResponseFuture {
                inner: Box::pin(async move {
                    let res = fut.await?;
                    Ok(streamed(res, IdempotencyOutcome::Unguarded))
                }),
            };
        }
        // The service that was polled ready goes into the future; a fresh
        // clone stays behind (tower-http#561).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let run = Run {
            pool: self.pool.clone(),
            config: Arc::clone(&self.config),
        };
        let guarded = async move {
            let res = run.guarded(inner, req).await;
            observe::finish(res.as_ref().ok().and_then(|r| r.extensions().get()));
            res
        };
        ResponseFuture {
            inner: Box::pin(guarded.instrument(observe::span())),
        }
    }
}

fn streamed<B>(res: Response<B>, outcome: IdempotencyOutcome) -> Response<IdempotencyBody<B>> {
    let mut res = res.map(IdempotencyBody::streaming);
    res.extensions_mut().insert(outcome);
    res
}

fn buffered<B>(res: Response<Bytes>, outcome: IdempotencyOutcome) -> Response<IdempotencyBody<B>> {
    let mut res = res.map(IdempotencyBody::buffered);
    res.extensions_mut().insert(outcome);
    res
}

fn refusal(problem: Problem, attempts: u32) -> (Response<Bytes>, IdempotencyOutcome) {
    let outcome = IdempotencyOutcome::Refused {
        problem: problem.kind,
        attempts,
    };
    (problem.into_response(), outcome)
}

fn refuse<B>(problem: Problem, attempts: u32) -> Response<IdempotencyBody<B>> {
    let (res, outcome) = refusal(problem, attempts);
    buffered(res, outcome)
}

/// An answer the layer gives without running the handler.
type Answer = (Response<Bytes>, IdempotencyOutcome);

/// The outcome of the claim stage.
enum Claimed<DB: Backend> {
    /// This request owns the scope; the transaction is past its savepoint.
    Won(Transaction<'static, DB>),
    /// Answer without running the handler.
    Answer(Answer),
}

/// Why one claim attempt did not settle the request.
enum Pending {
    /// Another request holds the key.
    InFlight,
    /// The key is taken but its record could not be read.
    Unconfirmed,
}

/// Who is asking for what: the scope and the request's fingerprint.
struct Identity<'a> {
    scope: Scope<'a>,
    fingerprint: Fingerprint,
}

/// The first attempt of a request not known to be a duplicate waits this
/// long at most on another claimer's row; longer waits need a waiter permit.
const PROBE_WAIT: Duration = Duration::from_millis(50);

/// A read of the ledger gets at least this long, even when the wait budget
/// is spent: a lost claim must still be explained.
const MIN_READ_WAIT: Duration = Duration::from_millis(250);

/// The state one guarded request runs with.
struct Run<DB: Backend> {
    pool: Pool<DB>,
    config: Arc<Config>,
}

impl<DB: Backend> Run<DB> {
    async fn guarded<S, ReqBody, ResBody>(
        self,
        inner: S,
        req: Request<ReqBody>,
    ) -> Result<Response<IdempotencyBody<ResBody>>, S::Error>
    where
        S: Service<Request<IdempotencyBody<ReqBody>>, Response = Response<ResBody>>,
        ReqBody: Body<Data = Bytes>,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body<Data = Bytes>,
        ResBody::Error: Into<BoxError>,
    {
        let cfg = &self.config;
        let (parts, body) = req.into_parts();
        let key = match IdempotencyKey::from_headers(&parts.headers, cfg.key_mode) {
            Ok(Some(key)) => key,
            Ok(None) if cfg.key_required => {
                let detail = format!(
                    "{} requests to this resource need an Idempotency-Key header: a new unique key per operation, reused only to retry it",
                    parts.method
                );
                return Ok(refuse(Problem::new(ProblemKind::MissingKey, detail), 0));
            }
            Ok(None) => {
                let mut inner = inner;
                let req = Request::from_parts(parts, IdempotencyBody::streaming(body));
                let res = inner.call(req).await?;
                return Ok(streamed(res, IdempotencyOutcome::Unguarded));
            }
            Err(e) => {
                return Ok(refuse(
                    Problem::new(ProblemKind::MalformedKey, e.to_string()),
                    0,
                ));
            }
        };
        let Some(principal) = (cfg.principal)(&parts) else {
            let detail =
                "the request carries no authenticated principal to scope its Idempotency-Key";
            return Ok(refuse(
                Problem::new(ProblemKind::MissingPrincipal, detail),
                0,
            ));
        };
        let body = match read_body(&parts.headers, body, cfg.max_request_body).await {
            Ok(body) => body,
            Err(problem) => return Ok(refuse(problem, 0)),
        };
        let fingerprint = match cfg.normalizer.fingerprint(&parts, &body) {
            Ok(fp) => fp,
            Err(e) => {
                return Ok(refuse(
                    Problem::new(ProblemKind::InvalidBody, e.to_string()),
                    0,
                ));
            }
        };
        let operation = match &cfg.operation {
            Some(op) => op.to_string(),
            None => default_operation(&parts),
        };
        observe::scope(&operation, key.as_str());
        let principal = bounded(principal.as_str());
        let operation = bounded(&operation);
        let key = if cfg.hash_keys {
            hashed(key.as_str())
        } else {
            std::borrow::Cow::Borrowed(key.as_str())
        };
        let id = Identity {
            scope: Scope {
                principal: &principal,
                operation: &operation,
                key: &key,
            },
            fingerprint,
        };
        let claiming = Instant::now();
        // One bound on everything a request spends waiting for another
        // request with its key: the local wait, lock waits, backoff and
        // acquiring connections.
        let deadline = claiming + cfg.in_flight_wait.min(cfg.claim_deadline);
        // A duplicate of a request running in this process waits here, off
        // the pool; the leader's token lives until the answer is settled.
        let local_wait = deadline.saturating_duration_since(Instant::now());
        let local = cfg.local.lead_or_wait(&id.scope, local_wait).await;
        let claimed = match &local {
            Local::StillRunning => Claimed::Answer(self.pending(Pending::InFlight, 0)),
            Local::Finished => self.claim(&id, true, deadline).await,
            Local::Leader { .. } => self.claim(&id, false, deadline).await,
        };
        observe::timing("claim_ms", claiming.elapsed());
        match claimed {
            Claimed::Won(tx) => self.execute(inner, &id, tx, parts, body).await,
            Claimed::Answer((res, outcome)) => Ok(buffered(res, outcome)),
        }
    }

    /// Claims the scope, or finds the answer a retry gets: at most the
    /// configured attempts, all before `deadline`.
    async fn claim(&self, id: &Identity<'_>, duplicate: bool, deadline: Instant) -> Claimed<DB> {
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
                match self.lookup(id, deadline).await {
                    Ok(Some(answer)) => return Claimed::Answer(with_attempts(answer, attempts)),
                    Ok(None) => {}
                    Err(e) => return Claimed::Answer(refusal(store_problem::<DB>(&e), attempts)),
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
                Ok(Attempt::Lost) => match self.lookup(id, deadline).await {
                    Ok(Some(answer)) => return Claimed::Answer(with_attempts(answer, attempts)),
                    Ok(None) => Pending::Unconfirmed,
                    Err(e) => return Claimed::Answer(refusal(store_problem::<DB>(&e), attempts)),
                },
                Ok(Attempt::Blocked) => {
                    waiting = true;
                    Pending::InFlight
                }
                Err(e) => return Claimed::Answer(refusal(store_problem::<DB>(&e), attempts)),
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
    fn pending(&self, pending: Pending, attempts: u32) -> Answer {
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
        let conn = match tokio::time::timeout(left, self.pool.acquire()).await {
            Ok(conn) => conn?,
            // No connection within what is left of the wait budget: for a
            // request that met another one with its key, still in flight.
            Err(_) if contended => return Ok(Attempt::NoPermit),
            Err(_) => return Err(sqlx::Error::PoolTimedOut),
        };
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
        let owned = OwnedClaim {
            principal: id.scope.principal.to_owned(),
            operation: id.scope.operation.to_owned(),
            key: id.scope.key.to_owned(),
            fingerprint: *id.fingerprint.as_bytes(),
            retention_ms: millis(cfg.retention),
            lock_wait,
            isolation: cfg.isolation,
        };
        let task = tokio::spawn(async move {
            let _permit = permit;
            DB::claim(conn, &owned.as_claim()).await
        });
        let outcome = match task.await {
            Ok(outcome) => outcome,
            // The claim task panicked (a driver bug): its connection is gone.
            Err(_) => return Err(sqlx::Error::WorkerCrashed),
        };
        match outcome {
            Ok(ClaimOutcome::Won(tx)) => Ok(Attempt::Won(tx)),
            Ok(ClaimOutcome::Lost) => Ok(Attempt::Lost),
            Err(e) => match DB::error_kind(&e) {
                StoreErrorKind::LockTimeout => Ok(Attempt::Blocked),
                StoreErrorKind::Conflict => Ok(Attempt::Lost),
                _ => Err(e),
            },
        }
    }

    /// Reads the committed record and decides what it means for `id`;
    /// `None` when there is no committed record.
    async fn lookup(
        &self,
        id: &Identity<'_>,
        deadline: Instant,
    ) -> Result<Option<Answer>, sqlx::Error> {
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .max(MIN_READ_WAIT);
        let record = match tokio::time::timeout(wait, DB::fetch(&self.pool, &id.scope)).await {
            Ok(record) => record?,
            Err(_) => return Err(sqlx::Error::PoolTimedOut),
        };
        Ok(record.map(|record| self.judge(&record, id)))
    }

    /// The decision table for a committed record. Expiry first: a key past
    /// its retention is never executed again, whatever the payload.
    fn judge(&self, record: &Record, id: &Identity<'_>) -> Answer {
        if is_expired(record) {
            let detail = "this Idempotency-Key's retention has ended; the original request is not executed again. Look the resource up, or send a new key for a new operation";
            let link = match (&record.resource_id, &self.config.resource_link) {
                (Some(id), Some(link)) => Some(link(id)),
                _ => None,
            };
            return refusal(
                Problem::new(ProblemKind::Expired, detail)
                    .resource(record.resource_id.clone(), link),
                1,
            );
        }
        if record.fingerprint != id.fingerprint.as_bytes() {
            let detail = "this Idempotency-Key was already used with a different request; use a new key for a different operation";
            return refusal(
                Problem::new(ProblemKind::KeyReused, detail).status(self.config.mismatch_status),
                1,
            );
        }
        match (record.status, record.response_status) {
            (RecordStatus::Succeeded | RecordStatus::FailedFinal, Some(status)) => {
                let stored = StoredResponse {
                    status: u16::try_from(status).unwrap_or(500),
                    headers: record.response_headers.clone().unwrap_or_default(),
                    body: Bytes::from(record.response_body.clone().unwrap_or_default()),
                };
                let mut res = stored.to_response(self.config.replayed_header);
                add_expiry(res.headers_mut(), record.expires_at);
                (res, IdempotencyOutcome::Replayed)
            }
            // A committed PROCESSING row: in this mode rows are PROCESSING
            // only inside their own transaction, so the handler ended that
            // transaction itself and nobody knows what took effect.
            _ => {
                let detail = "the outcome of the first request with this Idempotency-Key is unknown; it is not executed again until it has been reconciled. Retry later with the same key";
                refusal(
                    Problem::new(ProblemKind::Reconciling, detail).retry_after(RECONCILING_RETRY),
                    1,
                )
            }
        }
    }

    /// Runs the handler on the claimed transaction and keeps what its answer
    /// says to keep.
    async fn execute<S, ReqBody, ResBody>(
        &self,
        mut inner: S,
        id: &Identity<'_>,
        tx: Transaction<'static, DB>,
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
        let Some(tx) = tx else {
            // The handler still holds the transaction: it rolls back when the
            // handler lets go, and nothing may be recorded.
            let detail = "the handler kept the idempotency transaction after answering; nothing was committed";
            return Ok(refuse(
                Problem::new(ProblemKind::TransactionHeld, detail),
                1,
            ));
        };
        let (res_parts, res_body) = res.into_parts();
        let handler_status = i32::from(res_parts.status.as_u16());
        let body = match Limited::new(res_body, self.config.max_response_body)
            .collect()
            .await
        {
            Ok(collected) => collected.to_bytes(),
            Err(e) => {
                if self.abandon(Some(tx), id, handler_status).await {
                    return Ok(transaction_ended());
                }
                let (kind, detail) = if e.downcast_ref::<LengthLimitError>().is_some() {
                    (
                        ProblemKind::ResponseTooLarge,
                        "the response was larger than the recording limit; nothing was committed",
                    )
                } else {
                    (
                        ProblemKind::ResponseUnreadable,
                        "the response body failed while being recorded; nothing was committed",
                    )
                };
                return Ok(refuse(Problem::new(kind, detail), 1));
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
        // An id the ledger's column cannot hold (over 255 bytes, or a NUL)
        // is not recorded: the answer still is.
        let resource_id = res_parts
            .extensions
            .get::<ResourceId>()
            .map(ResourceId::as_str)
            .filter(|id| id.len() <= 255 && !id.contains('\0'));
        let completion = Completion {
            status,
            response_status: i32::from(stored.status),
            response_headers: &stored.headers,
            response_body: &stored.body,
            resource_id,
        };
        let committing = Instant::now();
        let finished = DB::finish(tx, &id.scope, &completion).await;
        observe::timing("commit_ms", committing.elapsed());
        let respond = |body: Bytes, expires_at: Option<i64>| {
            let mut res = Response::from_parts(res_parts, body);
            if let Some(expires_at) = expires_at {
                add_expiry(res.headers_mut(), expires_at);
            }
            Ok(buffered(res, outcome))
        };
        match finished {
            Ok(expires_at) => respond(stored.body, Some(expires_at)),
            Err(e) => match DB::error_kind(&e) {
                StoreErrorKind::TransactionEnded => {
                    self.strand(id, handler_status).await;
                    Ok(transaction_ended())
                }
                StoreErrorKind::ConnectionLost => {
                    // The commit may or may not have landed: ask the ledger.
                    let deadline = Instant::now() + MIN_READ_WAIT;
                    match self.lookup(id, deadline).await {
                        Ok(Some((replay, IdempotencyOutcome::Replayed))) => {
                            let expires_at = replay.headers().get(IDEMPOTENCY_KEY_EXPIRES).cloned();
                            let mut res = respond(stored.body, None);
                            if let (Ok(res), Some(value)) = (&mut res, expires_at) {
                                res.headers_mut().insert(IDEMPOTENCY_KEY_EXPIRES, value);
                            }
                            res
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
            },
        }
    }

    /// Rolls the claimed transaction back and waits for it, so the key's row
    /// lock is released before the answer leaves (a queued rollback could
    /// leave the next retry waiting). Returns `true` when the handler had
    /// ended the transaction itself: the key is then marked for
    /// reconciliation.
    async fn abandon(
        &self,
        tx: Option<Transaction<'static, DB>>,
        id: &Identity<'_>,
        handler_status: i32,
    ) -> bool {
        let Some(mut tx) = tx else { return false };
        let ended = DB::check_savepoint(&mut tx)
            .await
            .is_err_and(|e| DB::error_kind(&e) == StoreErrorKind::TransactionEnded);
        // A failed rollback means a lost connection: the server aborts the
        // transaction itself.
        let _ = tx.rollback().await;
        if ended {
            self.strand(id, handler_status).await;
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
            retention_ms: millis(self.config.retention),
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

/// What one claim attempt found.
enum Attempt<DB: Backend> {
    Won(Transaction<'static, DB>),
    /// A committed row holds the scope.
    Lost,
    /// Another claimer's uncommitted row held the scope past the lock wait.
    Blocked,
    /// No waiter permit (or no connection) left for a request that waits.
    NoPermit,
}

/// The claim's values, owned by the task that runs the claim.
struct OwnedClaim {
    principal: String,
    operation: String,
    key: String,
    fingerprint: [u8; 32],
    retention_ms: i64,
    lock_wait: Duration,
    isolation: IsolationLevel,
}

impl OwnedClaim {
    fn as_claim(&self) -> Claim<'_> {
        Claim {
            scope: Scope {
                principal: &self.principal,
                operation: &self.operation,
                key: &self.key,
            },
            fingerprint: &self.fingerprint,
            retention_ms: self.retention_ms,
            lock_wait: self.lock_wait,
            isolation: self.isolation,
        }
    }
}

/// How soon a retry of a key awaiting reconciliation is worth it, seconds.
const RECONCILING_RETRY: u64 = 30;

fn transaction_ended<B>() -> Response<IdempotencyBody<B>> {
    let detail = "the handler ended the idempotency transaction itself; what it committed is kept, and this key is held for reconciliation";
    refuse(Problem::new(ProblemKind::TransactionEnded, detail), 1)
}

fn with_attempts((res, outcome): Answer, attempts: u32) -> Answer {
    let outcome = match outcome {
        IdempotencyOutcome::Refused { problem, .. } => {
            IdempotencyOutcome::Refused { problem, attempts }
        }
        other => other,
    };
    (res, outcome)
}

/// Tells the client until when its key is honoured.
fn add_expiry(headers: &mut HeaderMap, expires_at: i64) {
    if let Ok(value) = http::HeaderValue::from_str(&http_date(expires_at)) {
        headers.insert(
            http::HeaderName::from_static(IDEMPOTENCY_KEY_EXPIRES),
            value,
        );
    }
}

/// A store error before anything was committed: nothing took effect, retry.
fn store_problem<DB: Backend>(e: &sqlx::Error) -> Problem {
    let (kind, detail) = match DB::error_kind(e) {
        StoreErrorKind::Busy => (
            ProblemKind::StoreBusy,
            "the idempotency store is busy; nothing was recorded, retry with the same key",
        ),
        StoreErrorKind::Conflict => (
            ProblemKind::TransactionConflict,
            "the transaction conflicted with a concurrent one and was rolled back; nothing was committed, retry with the same key",
        ),
        StoreErrorKind::ConnectionLost => (
            ProblemKind::StoreUnavailable,
            "the idempotency store could not be reached; nothing was recorded, retry with the same key",
        ),
        _ => (
            ProblemKind::StoreUnavailable,
            "the idempotency store failed; nothing was recorded, retry with the same key",
        ),
    };
    Problem::new(kind, detail).retry_after(1)
}

/// Buffers the request body up to `limit` bytes; a declared or actual larger
/// body is refused without reading past the limit.
async fn read_body<B>(headers: &HeaderMap, body: B, limit: usize) -> Result<Bytes, Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        Problem::new(
            ProblemKind::BodyTooLarge,
            format!("the request body is larger than {limit} bytes"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large());
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Err(e) => Err(Problem::new(
            ProblemKind::InvalidBody,
            format!("the request body could not be read: {e}"),
        )),
    }
}

/// Exponential backoff from 25 ms, capped at 1 s, with up to 50 % jitter so
/// contending retries spread out.
fn backoff(attempt: u32) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let base = 25u64.saturating_mul(1 << attempt.min(6)).min(1000);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(attempt);
    let jitter = h.finish() % (base / 2 + 1);
    Duration::from_millis(base / 2 + jitter)
}

pin_project! {
    /// Polls a future, turning a panic into an `Err` so the layer can roll
    /// back before the panic continues.
    struct CatchUnwind<F> {
        #[pin]
        inner: F,
    }
}

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Box<dyn Any + Send>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.project().inner;
        match catch_unwind(AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => Poll::Ready(Ok(out)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}
