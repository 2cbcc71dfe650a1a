//! [`Idempotency`]: the service that runs the protocol around the inner one.
//!
//! `mod.rs` reads the request into an identity (key, principal, scope,
//! fingerprint); [`claim`] decides what an existing record means and takes
//! the claim; [`execute`] runs the handler on the claimed transaction and
//! records its answer.

use std::any::Any;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, header};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use pin_project_lite::pin_project;
use sqlx::Pool;
use tower_service::Service;
use tracing::Instrument;

use crate::body::IdempotencyBody;
use crate::classify::Classification;
use crate::config::Config;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::local::Local;
use crate::observe;
use crate::problem::{Problem, ProblemKind};
use crate::replay::{StoredResponse, Trailers};
use crate::scope::{bounded, default_operation, http_operation, stored_key};
use crate::store::{Backend, Record, Scope, StoreErrorKind};

mod at_commit;
mod claim;
mod execute;
mod lease;

use claim::{Claimed, Pending};

pub(crate) use crate::outcome::IdempotencyOutcome;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

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
        if !self.config.guards(req.method(), req.uri().path()) {
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
            caller_deadline: None,
        };
        let grpc = crate::classify::is_grpc(req.headers());
        let guarded = async move {
            let res = run.guarded(inner, req).await;
            let res = match res {
                Ok(res) if grpc => Ok(crate::grpc::refusal(res)),
                res => res,
            };
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
    let mut res = buffered_body(res);
    res.extensions_mut().insert(outcome);
    res
}

/// A whole answer's body for the client: its bytes, then the trailers it
/// carries (as read, or as recorded).
pub(crate) fn buffered_body<B>(mut res: Response<Bytes>) -> Response<IdempotencyBody<B>> {
    let trailers = res.extensions_mut().remove::<Trailers>().map(|t| t.0);
    res.map(|body| IdempotencyBody::buffered_with(body, trailers))
}

fn refusal(problem: Problem, attempts: u32) -> (Response<Bytes>, IdempotencyOutcome) {
    let outcome = IdempotencyOutcome::Refused {
        problem: problem.kind,
        attempts,
    };
    (problem.into_response(), outcome)
}

fn missing_key(parts: &http::request::Parts) -> Problem {
    let detail = format!(
        "{} requests to this resource need an Idempotency-Key header: a new unique key per operation, reused only to retry it",
        parts.method
    );
    Problem::new(ProblemKind::MissingKey, detail)
}

/// The request's key: its header's, or the one the body carries (see
/// `IdempotencyLayer::with_key_from_body`), which must agree when both are
/// there.
fn key_of(
    cfg: &Config,
    parts: &http::request::Parts,
    body: &Bytes,
    header: Option<IdempotencyKey>,
) -> Result<Option<IdempotencyKey>, Problem> {
    let Some(from_body) = cfg.key_from_body.as_ref().and_then(|f| f(parts, body)) else {
        return Ok(header);
    };
    let from_body = IdempotencyKey::new(from_body).map_err(|e| {
        Problem::new(
            ProblemKind::MalformedKey,
            format!("the request's key field: {e}"),
        )
    })?;
    match header {
        Some(header) if header.as_str() != from_body.as_str() => Err(Problem::new(
            ProblemKind::MalformedKey,
            "the Idempotency-Key header and the request's key field disagree: one request, one key",
        )),
        _ => Ok(Some(from_body)),
    }
}

/// A request that goes to the handler unprotected (no key, keys optional).
async fn unguarded<S, ReqBody, ResBody>(
    mut inner: S,
    req: Request<IdempotencyBody<ReqBody>>,
) -> Result<Response<IdempotencyBody<ResBody>>, S::Error>
where
    S: Service<Request<IdempotencyBody<ReqBody>>, Response = Response<ResBody>>,
{
    let res = inner.call(req).await?;
    Ok(streamed(res, IdempotencyOutcome::Unguarded))
}

fn refuse<B>(problem: Problem, attempts: u32) -> Response<IdempotencyBody<B>> {
    let (res, outcome) = refusal(problem, attempts);
    buffered(res, outcome)
}

/// An answer the layer gives without running the handler.
pub(super) type Answer = (Response<Bytes>, IdempotencyOutcome);

/// Who is asking for what: the scope and the request's fingerprint.
struct Identity<'a> {
    scope: Scope<'a>,
    fingerprint: Fingerprint,
}

/// The state one guarded request runs with.
struct Run<DB: Backend> {
    pool: Pool<DB>,
    config: Arc<Config>,
    /// When the layer's work for a gRPC caller must be done by: three
    /// quarters of its `grpc-timeout`, so that the layer's own answer
    /// reaches the caller before its deadline does. Every wait and store
    /// read of the layer ends by then.
    caller_deadline: Option<Instant>,
}

/// A gRPC caller whose deadline leaves the layer less than this is
/// answered at once (`UNAVAILABLE`, `#store-busy`, with a pushback): no
/// store read fits in it.
pub(super) const MIN_CALLER_BUDGET: std::time::Duration = std::time::Duration::from_millis(1);

impl<DB: Backend> Run<DB> {
    /// A guarded request's answer; the layer's own problem answers name
    /// the request's key (once a valid one was read: see `problem::name_key`).
    async fn guarded<S, ReqBody, ResBody>(
        mut self,
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
        let mut key = None;
        let res = self.decide(inner, req, &mut key).await?;
        Ok(crate::problem::name_key(res, key.as_deref()))
    }

    /// Everything a guarded request goes through; `named` receives the
    /// request's key as soon as a valid one is read.
    async fn decide<S, ReqBody, ResBody>(
        &mut self,
        inner: S,
        req: Request<ReqBody>,
        named: &mut Option<String>,
    ) -> Result<Response<IdempotencyBody<ResBody>>, S::Error>
    where
        S: Service<Request<IdempotencyBody<ReqBody>>, Response = Response<ResBody>>,
        ReqBody: Body<Data = Bytes>,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body<Data = Bytes>,
        ResBody::Error: Into<BoxError>,
    {
        let (parts, body) = req.into_parts();
        // Read once: the policy sees it, and a guarded request needs it.
        let principal = (self.config.principal)(&parts);
        if let Some(policy) = &self.config.policy
            && let Some(config) = policy(&parts, principal.as_ref()).applied_to(&self.config)
        {
            self.config = Arc::new(config);
        }
        let cfg = &self.config;
        let header_key = match IdempotencyKey::from_headers(&parts.headers, cfg.key_mode) {
            Ok(key) => key,
            Err(e) => {
                return Ok(refuse(
                    Problem::new(ProblemKind::MalformedKey, e.to_string()),
                    0,
                ));
            }
        };
        *named = header_key.as_ref().map(|k| k.as_str().to_owned());
        if header_key.is_none() && cfg.key_from_body.is_none() {
            if cfg.key_required {
                return Ok(refuse(missing_key(&parts), 0));
            }
            let req = Request::from_parts(parts, IdempotencyBody::streaming(body));
            return unguarded(inner, req).await;
        }
        let Some(principal) = principal else {
            return Ok(refuse(Problem::missing_principal(), 0));
        };
        // A gRPC caller's own deadline bounds everything the layer does for
        // it: three quarters of it, so the refusal (with its pushback)
        // reaches the caller before its deadline does (tonic's server ends
        // the call itself at the deadline, with a `CANCELLED` that says
        // nothing of the key). A deadline too short for any read is
        // answered at once.
        let caller_budget = crate::grpc::timeout(&parts.headers).map(|t| t - t / 4);
        if caller_budget.is_some_and(|b| b < MIN_CALLER_BUDGET) {
            let detail = "the call's deadline (grpc-timeout) leaves no time to read the idempotency store; nothing was executed, retry with the same key and a longer deadline";
            return Ok(refuse(
                Problem::new(ProblemKind::StoreBusy, detail).retry_after(1),
                0,
            ));
        }
        self.caller_deadline = caller_budget.map(|b| Instant::now() + b);
        let cfg = &self.config;
        let body = match read_body(&parts.headers, body, cfg.max_request_body).await {
            Ok(body) => body,
            Err(problem) => return Ok(refuse(problem, 0)),
        };
        let key = match key_of(cfg, &parts, &body, header_key) {
            Ok(Some(key)) => key,
            Ok(None) if cfg.key_required => return Ok(refuse(missing_key(&parts), 0)),
            Ok(None) => {
                let req = Request::from_parts(parts, IdempotencyBody::buffered(body));
                return unguarded(inner, req).await;
            }
            Err(problem) => {
                // The header and the body disagree, or the body's key is
                // malformed: no key of this request is named.
                *named = None;
                return Ok(refuse(problem, 0));
            }
        };
        if named.as_deref() != Some(key.as_str()) {
            *named = Some(key.as_str().to_owned());
        }
        let fingerprint =
            match cfg
                .normalizer
                .fingerprint_with(&parts, &body, &cfg.fingerprint_headers)
            {
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
        let lease_mode = cfg.lease;
        let principal = bounded(principal.as_str());
        let operation = http_operation(&operation);
        let key = stored_key(key.as_str(), cfg.hash_keys);
        let id = Identity {
            scope: Scope {
                principal: &principal,
                operation: &operation,
                key: &key,
            },
            fingerprint,
        };
        let in_flight_wait = self.caller_deadline.map_or(cfg.in_flight_wait, |d| {
            d.saturating_duration_since(Instant::now())
                .min(cfg.in_flight_wait)
        });
        if let Some(mode) = lease_mode {
            let deadline = Instant::now() + in_flight_wait;
            return self.leased(mode, inner, &id, parts, body, deadline).await;
        }
        let claiming = Instant::now();
        // One bound on everything a request spends waiting for another
        // request with its key: the local wait, lock waits, backoff and
        // acquiring connections.
        let deadline = claiming + in_flight_wait.min(cfg.claim_deadline);
        // A duplicate of a request running in this process waits here, off
        // the pool; the leader's token lives until the answer is settled.
        let local_wait = deadline.saturating_duration_since(Instant::now());
        // The claim-at-commit mode remembers the scopes that finished here
        // (the claim-first mode's claim reads the row anyway).
        let local = cfg
            .local
            .lead_or_wait(&id.scope, local_wait, cfg.claim_at_commit)
            .await;
        // The principal's turn at the store, held from the claim to the
        // answer's commit (fairness between tenants: see `fairness`).
        let _slot = match &local {
            Local::StillRunning => None,
            Local::Finished | Local::Leader { .. } => {
                let wait = deadline.saturating_duration_since(Instant::now());
                match cfg.principal_slots.take(id.scope.principal, wait).await {
                    Some(slot) => Some(slot),
                    None => {
                        let detail = "no turn at the idempotency store came within the wait (this principal's share of its connections, or all of them, in use); nothing was recorded, retry with the same key";
                        let problem = Problem::new(ProblemKind::StoreBusy, detail).retry_after(1);
                        return Ok(refuse(problem, 0));
                    }
                }
            }
        };
        let claimed = match &local {
            Local::StillRunning => Claimed::Answer(self.pending(Pending::InFlight, 0)),
            Local::Finished if cfg.claim_at_commit => {
                self.begin_at_commit(&id, true, false, deadline).await
            }
            Local::Leader { finished, .. } if cfg.claim_at_commit => {
                self.begin_at_commit(&id, false, *finished, deadline).await
            }
            Local::Finished => self.claim(&id, true, deadline).await,
            Local::Leader { .. } => self.claim(&id, false, deadline).await,
        };
        observe::timing("claim_ms", claiming.elapsed());
        match claimed {
            Claimed::Won(tx) => {
                // The answer may settle after this returns (streamed past
                // the recording limit): the key's local lead and the
                // principal's slot live until it does.
                let hold: Box<dyn std::any::Any + Send> = Box::new((local, _slot));
                self.execute(inner, &id, tx, parts, body, hold).await
            }
            Claimed::Answer((res, outcome)) => Ok(buffered(res, outcome)),
        }
    }
}

/// A store error before anything was committed: nothing took effect, retry.
pub(crate) fn store_problem<DB: Backend>(e: &sqlx::Error) -> Problem {
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

impl<DB: Backend> Run<DB> {
    /// How long a store read may take when `wait` is left of a bound: at
    /// least [`MIN_READ_WAIT`](crate::store::MIN_READ_WAIT) (a lost claim must
    /// still be explained), never past the caller's deadline.
    pub(super) fn read_bound(&self, wait: std::time::Duration) -> std::time::Duration {
        let wait = wait.max(crate::store::MIN_READ_WAIT);
        match self.caller_deadline {
            Some(deadline) => wait.min(deadline.saturating_duration_since(Instant::now())),
            None => wait,
        }
    }

    /// Finds the ledger, and whether claims wait for the cluster, once per
    /// layer, on `conn` before its first transaction
    /// ([`Backend::find_ledger`], [`Backend::causal_wait`]).
    pub(super) async fn find_ledger(&self, conn: &mut DB::Connection) -> Result<(), sqlx::Error> {
        self.config
            .found_ledger
            .get_or_try_init(|| DB::find_ledger(&mut *conn))
            .await?;
        self.config
            .found_causal_wait
            .get_or_try_init(|| DB::causal_wait(conn))
            .await
            .map(drop)
    }

    /// The scope's committed record ([`Backend::fetch`]), read within
    /// [`read_bound`](Self::read_bound)`(wait)`; running out is a busy
    /// store, and a read with no time left is not started.
    pub(super) async fn fetch_within(
        &self,
        wait: Duration,
        scope: &Scope<'_>,
    ) -> Result<Option<Record>, sqlx::Error> {
        let wait = self.read_bound(wait);
        if wait.is_zero() {
            return Err(sqlx::Error::PoolTimedOut);
        }
        tokio::time::timeout(wait, DB::fetch(&self.pool, scope))
            .await
            .unwrap_or(Err(sqlx::Error::PoolTimedOut))
    }
}

/// Buffers the handler's answer for recording, up to `limit` bytes.
/// A handler's answer as the layer read it: whole, or (over the recording
/// limit) what was read and the rest of the body, still streaming.
pub(super) enum ReadAnswer<B> {
    Whole(http::response::Parts, Bytes),
    Over {
        parts: http::response::Parts,
        prefix: Bytes,
        rest: Pin<Box<B>>,
    },
}

impl<B> ReadAnswer<B> {
    pub(super) fn parts(&self) -> &http::response::Parts {
        match self {
            Self::Whole(parts, _) => parts,
            Self::Over { parts, .. } => parts,
        }
    }

    /// Its class: the handler's mark, gRPC's status, or the HTTP status.
    pub(super) fn class(&self) -> Classification {
        let trailers = self.parts().extensions.get::<Trailers>().map(|t| &t.0);
        Classification::of_answer(self.parts(), trailers, matches!(self, Self::Whole(..)))
    }

    /// What the ledger keeps of it: the whole answer, or (over `limit`)
    /// its status and headers with the mark that its body was not kept.
    pub(super) fn stored(&self, allow: &[http::HeaderName], limit: usize) -> StoredResponse {
        match self {
            Self::Whole(parts, body) => StoredResponse::capture(
                parts.status,
                &parts.headers,
                allow,
                body.clone(),
                parts.extensions.get(),
            ),
            Self::Over { parts, .. } => {
                StoredResponse::capture_not_kept(parts.status, &parts.headers, allow, limit)
            }
        }
    }

    /// The answer as the client gets it, whole or streaming on, marked
    /// with `outcome`.
    pub(super) fn into_response(self, outcome: IdempotencyOutcome) -> Response<IdempotencyBody<B>> {
        let mut res = match self {
            Self::Whole(parts, body) => buffered_body(Response::from_parts(parts, body)),
            Self::Over {
                parts,
                prefix,
                rest,
            } => Response::from_parts(parts, IdempotencyBody::prefixed(prefix, rest)),
        };
        res.extensions_mut().insert(outcome);
        res
    }
}

/// Reads the handler's answer up to `limit` bytes: past it, the rest is
/// left unread (see [`ReadAnswer::Over`]), so a large answer is never
/// buffered whole. A body that fails is a problem.
async fn read_response<B>(res: Response<B>, limit: usize) -> Result<ReadAnswer<B>, Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = res.into_parts();
    let mut body = Box::pin(body);
    let mut read = bytes::BytesMut::new();
    loop {
        match body.frame().await {
            None => {
                return Ok(ReadAnswer::Whole(parts, read.freeze()));
            }
            Some(Ok(frame)) => {
                let frame = match frame.into_data() {
                    Ok(data) => {
                        read.extend_from_slice(&data);
                        if read.len() > limit {
                            return Ok(ReadAnswer::Over {
                                parts,
                                prefix: read.freeze(),
                                rest: body,
                            });
                        }
                        continue;
                    }
                    Err(frame) => frame,
                };
                // Trailers end the body: nothing after them is read.
                if let Ok(trailers) = frame.into_trailers() {
                    parts.extensions.insert(Trailers(trailers));
                    return Ok(ReadAnswer::Whole(parts, read.freeze()));
                }
            }
            Some(Err(_)) => {
                return Err(Problem::new(
                    ProblemKind::ResponseUnreadable,
                    "the response body failed while being recorded; nothing was committed",
                ));
            }
        }
    }
}

pin_project! {
    /// Polls a future, turning a panic into an `Err` so the layer can roll
    /// back before the panic continues.
    pub(crate) struct CatchUnwind<F> {
        #[pin]
        pub(crate) inner: F,
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

#[cfg(all(test, any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
mod tests {
    use bytes::Bytes;
    use http::{Request, Response};
    use http_body_util::Full;
    use tower_layer::Layer;
    use tower_service::Service;

    use crate::IdempotencyLayer;
    use crate::store::Backend;

    /// The bytes a guarded request's future takes (boxed once, and moved
    /// whole into its box when the request starts). One type serves every
    /// mode.
    fn future_size<DB: Backend>(pool: sqlx::Pool<DB>) -> usize {
        let handler = tower::service_fn(|_req: Request<_>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::new())))
        });
        let mut service = IdempotencyLayer::new(pool).layer(handler);
        let req = Request::post("/orders")
            .header("idempotency-key", "k-1")
            .body(Full::new(Bytes::new()))
            .expect("a request");
        let future = service.call(req);
        std::mem::size_of_val(&*future.inner)
    }

    /// sqlx's acquire and `begin` futures carry their connect path inline
    /// (about 8 KiB each in a release build; 1.2–2.6 KiB in this debug
    /// build, where sqlx boxes part of it itself): held by value at each
    /// place the layer takes a connection, they made a request's future
    /// 22 KiB on PostgreSQL in the bench, 10 KiB here (5.4–5.6 KiB now).
    /// `store::acquire` and `on_ledger` box them. A future's size is that
    /// of its largest state, so this catches the request's future growing
    /// back, not every single unboxed site.
    #[tokio::test]
    async fn a_request_future_stays_small() {
        const MOST: usize = 8 * 1024;
        let sizes = [
            #[cfg(feature = "sqlite")]
            (
                "sqlite",
                future_size(
                    sqlx::sqlite::SqlitePoolOptions::new().connect_lazy_with(Default::default()),
                ),
            ),
            #[cfg(feature = "postgres")]
            (
                "postgres",
                future_size(
                    sqlx::postgres::PgPoolOptions::new().connect_lazy_with(Default::default()),
                ),
            ),
            #[cfg(feature = "mysql")]
            (
                "mysql",
                future_size(
                    sqlx::mysql::MySqlPoolOptions::new().connect_lazy_with(Default::default()),
                ),
            ),
        ];
        for (store, size) in sizes {
            assert!(
                size <= MOST,
                "{store}: a request's future takes {size} bytes, over {MOST}"
            );
        }
    }
}
