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
use crate::expiry::{IDEMPOTENCY_KEY_EXPIRES, expires_at, http_date, is_expired, now_ms};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::layer::Config;
use crate::observe;
use crate::problem::{Problem, ProblemKind};
use crate::replay::StoredResponse;
use crate::scope::{bounded, default_operation, hashed};
use crate::store::{Backend, Claim, Completion, Record, RecordStatus, Scope, StoreErrorKind};
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

/// What a read of the ledger says about a request.
enum Verdict {
    /// Answer with this, without running the handler.
    Answer((Response<Bytes>, IdempotencyOutcome)),
    /// The key is held by a request still running.
    InFlight,
}

/// The outcome of the claim stage.
enum Claimed<DB: Backend> {
    /// This request owns the scope (until the returned `expires_at`); the
    /// transaction is past its savepoint.
    Won(Transaction<'static, DB>, i64),
    /// Answer without running the handler.
    Answer((Response<Bytes>, IdempotencyOutcome)),
}

/// Who is asking for what: the scope and the request's fingerprint.
struct Identity<'a> {
    scope: Scope<'a>,
    fingerprint: Fingerprint,
}

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
        // A duplicate of a request running in this process waits here, off
        // the pool; the leader's token lives until the answer is settled.
        let leader = cfg.local.lead_or_wait(&id.scope, cfg.in_flight_wait).await;
        let claimed = self.claim(&id, leader.is_none()).await;
        observe::timing("claim_ms", claiming.elapsed());
        match claimed {
            Claimed::Won(tx, expires_at) => {
                self.execute(inner, &id, (tx, expires_at), parts, body)
                    .await
            }
            Claimed::Answer((res, outcome)) => Ok(buffered(res, outcome)),
        }
    }

    /// Claims the scope, or finds the answer a retry gets: at most the
    /// configured attempts, within the configured deadline.
    async fn claim(&self, id: &Identity<'_>, duplicate: bool) -> Claimed<DB> {
        let cfg = &self.config;
        let deadline = Instant::now() + cfg.claim_deadline;
        let mut attempts = 0;
        // Claim first by default: a first execution then costs no read. A
        // known duplicate, and every retry after a contended attempt, reads
        // first.
        let mut read_first = cfg.read_first || duplicate;
        let pending = loop {
            attempts += 1;
            let settled = if read_first {
                self.lookup(id).await
            } else {
                Ok(None)
            };
            read_first = true;
            let pending = match settled {
                Ok(Some(Verdict::Answer(answer))) => return Claimed::Answer(answer),
                Ok(Some(Verdict::InFlight)) => ProblemKind::InFlight,
                Ok(None) => match self.try_claim(id, deadline).await {
                    Ok(Some((tx, expires_at))) => return Claimed::Won(tx, expires_at),
                    // Lost to a committed row: a fresh read explains it.
                    Ok(None) => match self.lookup(id).await {
                        Ok(Some(Verdict::Answer(answer))) => return Claimed::Answer(answer),
                        Ok(Some(Verdict::InFlight)) => ProblemKind::InFlight,
                        Ok(None) => ProblemKind::Unconfirmed,
                        Err(e) => {
                            return Claimed::Answer(refusal(store_problem::<DB>(&e), attempts));
                        }
                    },
                    Err(e) if DB::error_kind(&e) == StoreErrorKind::LockTimeout => {
                        ProblemKind::InFlight
                    }
                    Err(e) => return Claimed::Answer(refusal(store_problem::<DB>(&e), attempts)),
                },
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
        let detail = if pending == ProblemKind::Unconfirmed {
            "the Idempotency-Key is taken but its record could not be read; retry with the same key"
        } else {
            "a request with this Idempotency-Key is still being processed; retry with the same key later"
        };
        let retry_after = cfg.in_flight_wait.as_secs().max(1);
        Claimed::Answer(refusal(
            Problem::new(pending, detail).retry_after(retry_after),
            attempts,
        ))
    }

    /// One claim attempt: `Ok(Some)` owns the scope (past the savepoint),
    /// `Ok(None)` lost it to a committed row.
    async fn try_claim(
        &self,
        id: &Identity<'_>,
        deadline: Instant,
    ) -> Result<Option<(Transaction<'static, DB>, i64)>, sqlx::Error> {
        let cfg = &self.config;
        let wait = cfg
            .in_flight_wait
            .min(deadline.saturating_duration_since(Instant::now()))
            .max(Duration::from_millis(1));
        let now = now_ms();
        let claim = Claim {
            scope: id.scope,
            fingerprint: id.fingerprint.as_bytes(),
            created_at: now,
            expires_at: expires_at(now, cfg.retention),
        };
        Ok(DB::claim(&self.pool, &claim, wait)
            .await?
            .map(|tx| (tx, claim.expires_at)))
    }

    /// Reads the committed record and decides what it means for `id`.
    async fn lookup(&self, id: &Identity<'_>) -> Result<Option<Verdict>, sqlx::Error> {
        let Some(record) = DB::fetch(&self.pool, &id.scope).await? else {
            return Ok(None);
        };
        Ok(Some(self.judge(&record, id)))
    }

    /// The decision table for an existing record. Expiry first: a key past
    /// its retention is never executed again, whatever the payload.
    fn judge(&self, record: &Record, id: &Identity<'_>) -> Verdict {
        let refuse = |problem: Problem| Verdict::Answer(refusal(problem, 1));
        if is_expired(record, now_ms()) {
            let detail = "this Idempotency-Key's retention has ended; the original request is not executed again. Look the resource up, or send a new key for a new operation";
            let link = match (&record.resource_id, &self.config.resource_link) {
                (Some(id), Some(link)) => Some(link(id)),
                _ => None,
            };
            return refuse(
                Problem::new(ProblemKind::Expired, detail)
                    .resource(record.resource_id.clone(), link),
            );
        }
        if record.fingerprint != id.fingerprint.as_bytes() {
            let detail = "this Idempotency-Key was already used with a different request; use a new key for a different operation";
            return refuse(
                Problem::new(ProblemKind::KeyReused, detail).status(self.config.mismatch_status),
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
                Verdict::Answer((res, IdempotencyOutcome::Replayed))
            }
            _ => Verdict::InFlight,
        }
    }

    /// Runs the handler on the claimed transaction and keeps what its answer
    /// says to keep.
    async fn execute<S, ReqBody, ResBody>(
        &self,
        mut inner: S,
        id: &Identity<'_>,
        (tx, expires_at): (Transaction<'static, DB>, i64),
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
                rollback(tx).await;
                resume_unwind(panic);
            }
            Ok(Err(e)) => {
                rollback(tx).await;
                return Err(e);
            }
            Ok(Ok(res)) => res,
        };
        let Some(mut tx) = tx else {
            // The handler still holds the transaction: it rolls back when the
            // handler lets go, and nothing may be recorded.
            let detail = "the handler kept the idempotency transaction after answering; nothing was committed";
            return Ok(refuse(
                Problem::new(ProblemKind::TransactionHeld, detail),
                1,
            ));
        };
        let (res_parts, res_body) = res.into_parts();
        let body = match Limited::new(res_body, self.config.max_response_body)
            .collect()
            .await
        {
            Ok(collected) => collected.to_bytes(),
            Err(e) => {
                rollback(Some(tx)).await;
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
                rollback(Some(tx)).await;
                return Ok(buffered(Response::from_parts(res_parts, body), outcome));
            }
        };
        let stored = StoredResponse::capture(
            res_parts.status,
            &res_parts.headers,
            &self.config.recorded_headers,
            body,
        );
        let resource_id = res_parts
            .extensions
            .get::<ResourceId>()
            .map(ResourceId::as_str);
        let recorded = async {
            if status == RecordStatus::FailedFinal {
                DB::rollback_to_savepoint(&mut tx).await?;
            }
            let completion = Completion {
                status,
                response_status: i32::from(stored.status),
                response_headers: &stored.headers,
                response_body: &stored.body,
                resource_id,
            };
            DB::complete(&mut tx, &id.scope, &completion).await
        }
        .await;
        if let Err(e) = recorded {
            rollback(Some(tx)).await;
            return Ok(refuse(store_problem::<DB>(&e), 1));
        }
        let respond = |body: Bytes| {
            let mut res = Response::from_parts(res_parts, body);
            add_expiry(res.headers_mut(), expires_at);
            Ok(buffered(res, outcome))
        };
        let committing = Instant::now();
        let committed = tx.commit().await;
        observe::timing("commit_ms", committing.elapsed());
        match committed {
            Ok(()) => respond(stored.body),
            Err(e) if DB::error_kind(&e) == StoreErrorKind::ConnectionLost => {
                // The commit may or may not have landed: ask the ledger.
                match self.lookup(id).await {
                    Ok(Some(Verdict::Answer((_, IdempotencyOutcome::Replayed)))) => {
                        respond(stored.body)
                    }
                    _ => {
                        let detail = "the connection was lost while committing and the ledger shows no commit; retry with the same key";
                        let problem =
                            Problem::new(ProblemKind::CommitUnknown, detail).retry_after(1);
                        Ok(refuse(problem, 1))
                    }
                }
            }
            Err(e) => Ok(refuse(store_problem::<DB>(&e), 1)),
        }
    }
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
    let detail = match DB::error_kind(e) {
        StoreErrorKind::ConnectionLost => {
            "the idempotency store could not be reached; nothing was recorded, retry with the same key"
        }
        _ => "the idempotency store failed; nothing was recorded, retry with the same key",
    };
    Problem::new(ProblemKind::StoreUnavailable, detail).retry_after(1)
}

/// Rolls back and waits for it, so the key's row lock is released before the
/// answer leaves (a queued rollback could leave the next retry waiting).
async fn rollback<DB: Backend>(tx: Option<Transaction<'static, DB>>) {
    if let Some(tx) = tx {
        // A failed rollback means a lost connection: the server aborts the
        // transaction itself.
        let _ = tx.rollback().await;
    }
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
