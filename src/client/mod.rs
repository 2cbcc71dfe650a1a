//! The client half (feature `client`): [`IdempotentRetryLayer`], a tower
//! layer for HTTP clients (and tonic channels: `examples/grpc_order_client.rs`)
//! that keeps one `Idempotency-Key` per logical request and retries it
//! safely.
//!
//! For guarded methods (POST and PATCH by default) the layer attaches an
//! `Idempotency-Key` when the request has none (a random UUID v4, or the
//! [`IntentKey`] the caller put in the request extensions for an intent that
//! must survive a process restart) and sends **the same key on every
//! attempt**, so the server runs the operation at most once however many
//! attempts reach it.
//!
//! The key is sent as a Structured Field String (RFC 8941: `"…"`, with `"`
//! and `\` escaped), so servers in either key mode accept it ([`KeyMode`]:
//! the IETF draft's strict syntax, or the default that also takes a bare
//! value). An `Idempotency-Key` header the caller set is kept as they sent
//! it: a bare key is refused by a strict server, so quote it yourself (see
//! [`IdempotencyKey::to_sf_string`]).
//!
//! # What is retried
//!
//! | answer | retried? |
//! |---|---|
//! | connection error (a `409` body that breaks while the layer reads it included), or the attempt's own timeout (the request may have landed: exactly when the key matters) | yes |
//! | `409` whose problem `type` is `#in-flight`, `#unconfirmed` or `#lease-lost` (this crate's server layer) | yes, honouring `Retry-After` |
//! | `429`, `502`, `503`, `504` | yes, honouring `Retry-After` (seconds, or an HTTP-date in any of its three forms) |
//! | a trailers-only gRPC answer (`content-type: application/grpc`, `grpc-status` in its headers) with `UNAVAILABLE` (14): this crate's refusals, a server that is down | yes, honouring `grpc-retry-pushback-ms` (a negative value: no) |
//! | a gRPC answer with any other `grpc-status` | no: final |
//! | `422` key reused, `410` expired, any other `409` (a business conflict: told apart by the problem `type`, not the status), other 4xx, `500`, 2xx, 3xx | no: final |
//!
//! Waits are exponential backoff with full jitter, at least the server's
//! `Retry-After`; attempts are bounded ([`with_max_attempts`], the first
//! included) and so is the whole ([`with_deadline`]: every attempt and wait
//! together). A retry budget shared by every request through the layer (and
//! its clones; tower's [`TpsBudget`]) stops retries when they would exceed
//! a share of the traffic, so an outage cannot turn into a retry storm.
//! Methods that are not guarded pass through once. Let only one layer of a
//! stack retry: retries multiply.
//!
//! The request body is buffered once, up to [`with_max_body`] (1 MiB by
//! default), so it can be re-sent byte for byte. A larger body is streamed
//! once, without retries, and the answer's [`RetryReport`] says
//! [`RetryStop::BodyTooLarge`]. Request trailers are not re-sent.
//!
//! # Composition
//!
//! A per-request timeout the caller stacks *inside* this layer (such as
//! `tower::timeout::TimeoutLayer` between it and the client) bounds each
//! attempt; the layer's deadline bounds the whole. Both end once an
//! answer's headers are in (and the `409` problem document the layer reads
//! to judge it): the caller bounds the reading of the answer's body, in
//! time and size (`tokio::time::timeout_at` with the same deadline and
//! `http_body_util::Limited`, as `examples/order_client.rs` does), or a peer
//! that never finishes the body holds the caller forever.
//!
//! What happened travels on the response's extensions as a [`RetryReport`]
//! (attempts, total wait, whether the answer was a replay, the key), and on
//! a failure as a [`RetryError`].
//!
//! [`with_max_attempts`]: IdempotentRetryLayer::with_max_attempts
//! [`with_deadline`]: IdempotentRetryLayer::with_deadline
//! [`with_max_body`]: IdempotentRetryLayer::with_max_body

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::{Body, Frame};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use tower::retry::budget::{Budget, TpsBudget};
use tower_layer::Layer;
use tower_service::Service;

use crate::key::{IDEMPOTENCY_KEY, IdempotencyKey, KeyError, KeyMode};
use crate::replay::IDEMPOTENT_REPLAYED;

mod policy;

use policy::Verdict;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The body the wrapped client is called with, and the layer answers with:
/// any body, boxed.
pub struct RetryBody(UnsyncBoxBody<Bytes, BoxError>);

impl std::fmt::Debug for RetryBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryBody").finish_non_exhaustive()
    }
}

impl Body for RetryBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.0).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.0.size_hint()
    }
}

/// The idempotency key of one user intent, set by the caller in the
/// request extensions: the layer sends it instead of a fresh UUID. Use it
/// when the intent must survive a process restart (keep the key with the
/// intent, in your database).
///
/// Guarantees: a key the server accepts in either [`KeyMode`], checked when
/// it is made by the server's own rules: 1 to
/// [`MAX_KEY_LEN`](crate::MAX_KEY_LEN) bytes of printable ASCII
/// (`0x20..=0x7E`, so spaces, `"` and `\` too). The layer sends it as a
/// Structured Field String (`"…"`, with `"` and `\` escaped); the server
/// names and records it unquoted, as [`as_str`](Self::as_str) gives it.
///
/// ```
/// use tower_idempotency::KeyError;
/// use tower_idempotency::client::IntentKey;
///
/// let key = IntentKey::new("order 42 for bob")?;
/// assert_eq!(key.as_str(), "order 42 for bob");
/// assert_eq!(IntentKey::new(""), Err(KeyError::Empty));
/// assert_eq!(IntentKey::new("a".repeat(256)), Err(KeyError::TooLong));
/// assert_eq!(IntentKey::new("caf\u{e9}"), Err(KeyError::InvalidCharacter));
/// # Ok::<(), KeyError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IntentKey(IdempotencyKey);

impl IntentKey {
    /// The key of an intent, from its text as meant (unquoted).
    ///
    /// # Errors
    ///
    /// What is wrong with it, as the server would answer `400` for it:
    /// [`KeyError::Empty`], [`KeyError::TooLong`] (over
    /// [`MAX_KEY_LEN`](crate::MAX_KEY_LEN) bytes) or
    /// [`KeyError::InvalidCharacter`] (a byte outside printable ASCII: a
    /// control character, a tab, a newline, any non-ASCII one).
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        IdempotencyKey::new(key).map(Self)
    }

    /// The key, unquoted: what the server records.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl From<IdempotencyKey> for IntentKey {
    /// Every [`IdempotencyKey`] meets the same rules.
    fn from(key: IdempotencyKey) -> Self {
        Self(key)
    }
}

/// Why the layer stopped retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryStop {
    /// The answer was final (a success, or an answer never retried).
    Final,
    /// The method is not guarded: sent once.
    NotGuarded,
    /// The body was over the buffering limit: sent once.
    BodyTooLarge,
    /// The attempts were used up.
    Attempts,
    /// The next wait would pass the deadline, or the deadline passed.
    Deadline,
    /// The shared retry budget was spent.
    Budget,
}

/// What the layer did for one logical request; on the response's
/// extensions and in a [`RetryError`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryReport {
    /// Attempts sent, the first included.
    pub attempts: u32,
    /// Time spent waiting between attempts.
    pub waited: Duration,
    /// Whether the answer carries `Idempotent-Replayed: true`: the first
    /// attempt's answer, recorded by the server, replayed.
    pub replayed: bool,
    /// The idempotency key, unquoted: the key the server names and
    /// records (`None` for methods not guarded). For an `Idempotency-Key`
    /// header the caller set, that header as a lenient server reads it
    /// (its text as sent when it does not parse).
    pub key: Option<String>,
    /// Why retrying stopped.
    pub stop: RetryStop,
}

/// Every attempt failed without an answer.
#[derive(Debug)]
pub struct RetryError {
    /// What the layer did.
    pub report: RetryReport,
    /// The last attempt's error.
    pub source: BoxError,
}

impl std::fmt::Display for RetryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "no answer after {} attempt(s) ({:?}): {}",
            self.report.attempts, self.report.stop, self.source
        )
    }
}

impl std::error::Error for RetryError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

#[derive(Debug)]
struct Config {
    methods: Vec<Method>,
    max_attempts: u32,
    deadline: Duration,
    base: Duration,
    cap: Duration,
    max_body: usize,
    budget: Arc<TpsBudget>,
}

/// Retries HTTP requests with one idempotency key per logical request; see
/// the [module docs](self). Clones share the retry budget.
#[derive(Debug, Clone)]
pub struct IdempotentRetryLayer {
    config: Arc<Config>,
}

impl Default for IdempotentRetryLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotentRetryLayer {
    /// POST and PATCH guarded; 4 attempts; a 30 s deadline; backoff from
    /// 100 ms capped at 5 s; bodies buffered up to 1 MiB; a budget of 20 %
    /// of the traffic over 10 s on top of 10 retries a second.
    pub fn new() -> Self {
        Self {
            config: Arc::new(Config {
                methods: vec![Method::POST, Method::PATCH],
                max_attempts: 4,
                deadline: Duration::from_secs(30),
                base: Duration::from_millis(100),
                cap: Duration::from_secs(5),
                max_body: 1024 * 1024,
                budget: Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2)),
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut Config)) -> Self {
        let mut config = Config {
            methods: self.config.methods.clone(),
            budget: Arc::clone(&self.config.budget),
            ..*self.config
        };
        f(&mut config);
        self.config = Arc::new(config);
        self
    }

    /// The methods that get a key and retries (default POST, PATCH).
    #[must_use]
    pub fn with_methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods: Vec<_> = methods.into_iter().collect();
        self.with(|c| c.methods = methods)
    }

    /// At most `attempts` sends per logical request, the first included
    /// (default 4; at least 1).
    #[must_use]
    pub fn with_max_attempts(self, attempts: u32) -> Self {
        self.with(|c| c.max_attempts = attempts.max(1))
    }

    /// The whole logical request (every attempt and wait) ends by
    /// `deadline` after it started (default 30 s).
    #[must_use]
    pub fn with_deadline(self, deadline: Duration) -> Self {
        self.with(|c| c.deadline = deadline)
    }

    /// Backoff: the n-th retry waits a random time below `base · 2^(n−1)`,
    /// at most `cap` (default 100 ms, 5 s), and at least `Retry-After`.
    #[must_use]
    pub fn with_backoff(self, base: Duration, cap: Duration) -> Self {
        self.with(|c| {
            c.base = base;
            c.cap = cap.max(base);
        })
    }

    /// Bodies up to `bytes` are buffered for re-sending (default 1 MiB);
    /// larger ones are sent once.
    #[must_use]
    pub fn with_max_body(self, bytes: usize) -> Self {
        self.with(|c| c.max_body = bytes)
    }

    /// The retry budget shared by every request through this layer and its
    /// clones (see [`TpsBudget::new`]).
    #[must_use]
    pub fn with_budget(self, budget: TpsBudget) -> Self {
        let budget = Arc::new(budget);
        self.with(|c| c.budget = budget)
    }
}

impl<S> Layer<S> for IdempotentRetryLayer {
    type Service = IdempotentRetry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentRetry {
            inner,
            config: Arc::clone(&self.config),
        }
    }
}

/// The service built by [`IdempotentRetryLayer`].
#[derive(Debug, Clone)]
pub struct IdempotentRetry<S> {
    inner: S,
    config: Arc<Config>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, RB> Service<Request<B>> for IdempotentRetry<S>
where
    S: Service<Request<RetryBody>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<RetryBody>;
    type Error = RetryError;
    type Future = BoxFuture<Result<Response<RetryBody>, RetryError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), RetryError>> {
        self.inner.poll_ready(cx).map_err(|e| RetryError {
            report: RetryReport {
                attempts: 0,
                waited: Duration::ZERO,
                replayed: false,
                key: None,
                stop: RetryStop::Final,
            },
            source: e.into(),
        })
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The service that was polled ready serves the first attempt.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = Arc::clone(&self.config);
        Box::pin(run(inner, config, req))
    }
}

/// One logical request: buffer, key, attempts.
async fn run<S, B, RB>(
    mut inner: S,
    cfg: Arc<Config>,
    req: Request<B>,
) -> Result<Response<RetryBody>, RetryError>
where
    S: Service<Request<RetryBody>, Response = Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let started = Instant::now();
    // A deadline past what the clock can hold is "no deadline" (30 years).
    let deadline = started
        .checked_add(cfg.deadline)
        .unwrap_or_else(|| started + Duration::from_secs(30 * 365 * 86_400));
    let left = || deadline.saturating_duration_since(Instant::now());
    let cut = || -> BoxError { DEADLINE.into() };
    let (mut parts, body) = req.into_parts();
    let mut report = RetryReport {
        attempts: 1,
        waited: Duration::ZERO,
        replayed: false,
        key: None,
        stop: RetryStop::Final,
    };
    let fail = |report: RetryReport, source: BoxError| RetryError { report, source };
    if !cfg.methods.contains(&parts.method) {
        report.stop = RetryStop::NotGuarded;
        let req = Request::from_parts(parts, boxed(body));
        return send_once(&mut inner, req, left(), report).await;
    }
    let key = match parts.headers.get(IDEMPOTENCY_KEY) {
        // The caller's own header is sent as they wrote it.
        Some(value) => callers_key(value),
        None => {
            let key = match parts.extensions.get::<IntentKey>() {
                Some(intent) => Ok(intent.0.clone()),
                None => IdempotencyKey::new(uuid::Uuid::new_v4().to_string()),
            };
            let sent = key.and_then(|key| {
                // Printable ASCII in quotes: always a header value.
                let value = HeaderValue::from_str(&key.to_sf_string())
                    .map_err(|_| KeyError::InvalidCharacter)?;
                Ok((key, value))
            });
            match sent {
                Ok((key, value)) => {
                    parts.headers.insert(IDEMPOTENCY_KEY, value);
                    key.as_str().to_owned()
                }
                Err(e) => return Err(fail(report, format!("unusable key: {e}").into())),
            }
        }
    };
    report.key = Some(key);
    cfg.budget.deposit();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let buffered = match tokio::time::timeout(left(), buffer(declared, body, cfg.max_body)).await {
        Ok(buffered) => buffered,
        Err(_) => {
            report.stop = RetryStop::Deadline;
            return Err(fail(report, cut()));
        }
    };
    let body = match buffered {
        Ok(Buffered::Whole(bytes)) => bytes,
        Ok(Buffered::TooLarge(body)) => {
            report.stop = RetryStop::BodyTooLarge;
            let req = Request::from_parts(parts, body);
            return send_once(&mut inner, req, left(), report).await;
        }
        Err(e) => return Err(fail(report, e)),
    };
    loop {
        let attempt = Request::from_parts(parts.clone(), boxed(Full::new(body.clone())));
        // The attempt and the reading of its answer, within the deadline.
        let sent = async {
            std::future::poll_fn(|cx| inner.poll_ready(cx))
                .await
                .map_err(Into::into)?;
            send(&mut inner, attempt).await
        };
        let judged = async { judge(sent.await).await };
        let (answer, verdict) = match tokio::time::timeout(left(), judged).await {
            Ok(judged) => judged,
            Err(_) => (Err(cut()), Verdict::Retry(None)),
        };
        let Verdict::Retry(at_least) = verdict else {
            report.stop = RetryStop::Final;
            return deliver(answer, report);
        };
        if report.attempts >= cfg.max_attempts {
            report.stop = RetryStop::Attempts;
            return deliver(answer, report);
        }
        let wait = policy::full_jitter(report.attempts, cfg.base, cfg.cap)
            .max(at_least.unwrap_or_default());
        if wait >= left() {
            report.stop = RetryStop::Deadline;
            return deliver(answer, report);
        }
        if !cfg.budget.withdraw() {
            report.stop = RetryStop::Budget;
            return deliver(answer, report);
        }
        tokio::time::sleep(wait).await;
        report.waited += wait;
        report.attempts += 1;
    }
}

/// The key of a header the caller set, as a lenient server reads it
/// (unquoted); its text as sent when it is not a well-formed key (the
/// server will refuse it).
fn callers_key(value: &HeaderValue) -> String {
    IdempotencyKey::parse(value.as_bytes(), KeyMode::Lenient).map_or_else(
        |_| String::from_utf8_lossy(value.as_bytes()).into_owned(),
        |key| key.as_str().to_owned(),
    )
}

/// One send without retries (a method not guarded, a body over the bound),
/// within what is left of the deadline.
async fn send_once<S, RB>(
    inner: &mut S,
    req: Request<RetryBody>,
    left: Duration,
    report: RetryReport,
) -> Result<Response<RetryBody>, RetryError>
where
    S: Service<Request<RetryBody>, Response = Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let answer = match tokio::time::timeout(left, send(inner, req)).await {
        Ok(answer) => answer,
        Err(_) => Err(DEADLINE.into()),
    };
    deliver(answer, report)
}

/// The error of an attempt cut by the deadline.
const DEADLINE: &str = "the deadline passed";

/// Calls the inner service, the future boxed where its type is known (an
/// `async` body that held the inner future by its type could not be shown
/// `Send` for every lifetime).
fn send<S, RB>(
    inner: &mut S,
    req: Request<RetryBody>,
) -> BoxFuture<Result<Response<RetryBody>, BoxError>>
where
    S: Service<Request<RetryBody>, Response = Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let call = inner.call(req);
    Box::pin(async move { call.await.map(|res| res.map(boxed)).map_err(Into::into) })
}

/// Judges one attempt. A `409` problem document is read (at most
/// [`MAX_PROBLEM`] bytes) to see its type; any other body, and a larger
/// one, is handed on as it came (what was read first, then the rest). A
/// `409` body that fails mid-read is no answer: retried.
async fn judge(
    answer: Result<Response<RetryBody>, BoxError>,
) -> (Result<Response<RetryBody>, BoxError>, Verdict) {
    let res = match answer {
        Ok(res) => res,
        // No answer: the request may or may not have landed.
        Err(e) => return (Err(e), Verdict::Retry(None)),
    };
    if res.status() != StatusCode::CONFLICT || !policy::is_problem(res.headers()) {
        let verdict = policy::by_status(res.status(), res.headers());
        return (Ok(res), verdict);
    }
    let (parts, body) = res.into_parts();
    match read_up_to(body, MAX_PROBLEM).await {
        Ok(read) => {
            let verdict = if read.whole() && policy::retryable_conflict(&parts.headers, &read.data)
            {
                Verdict::Retry(policy::retry_after(&parts.headers))
            } else {
                Verdict::Final
            };
            (Ok(Response::from_parts(parts, read.into_body())), verdict)
        }
        // The body broke while being read: a connection error (the request
        // may have landed), retried with the same key like any other.
        Err(e) => (Err(e), Verdict::Retry(policy::retry_after(&parts.headers))),
    }
}

/// The largest `409` body read to find its problem type.
const MAX_PROBLEM: usize = 64 * 1024;

fn deliver(
    answer: Result<Response<RetryBody>, BoxError>,
    report: RetryReport,
) -> Result<Response<RetryBody>, RetryError> {
    match answer {
        Ok(res) => Ok(finish(res, report)),
        Err(source) => Err(RetryError { report, source }),
    }
}

fn finish<RB>(res: Response<RB>, mut report: RetryReport) -> Response<RetryBody>
where
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let mut res = res.map(boxed);
    report.replayed = res
        .headers()
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v == "true");
    res.extensions_mut().insert(report);
    res
}

fn boxed<B>(body: B) -> RetryBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    RetryBody(body.map_err(Into::into).boxed_unsync())
}

enum Buffered {
    Whole(Bytes),
    /// Over the limit: what was read, then the rest, as one body.
    TooLarge(RetryBody),
}

/// Reads the body up to `limit` bytes; a declared or actual larger body is
/// handed back whole (what was read first, then the rest) to be sent once.
/// Request trailers are not kept for re-sending.
async fn buffer<B>(declared: Option<u64>, body: B, limit: usize) -> Result<Buffered, BoxError>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    if declared.is_some_and(|len| len > limit as u64) {
        return Ok(Buffered::TooLarge(boxed(body)));
    }
    let read = read_up_to(boxed(body), limit).await?;
    if read.whole() {
        Ok(Buffered::Whole(read.data.freeze()))
    } else {
        Ok(Buffered::TooLarge(read.into_body()))
    }
}

/// The first frames of a body, up to a limit of data.
struct Prefix {
    /// The frames read, in order (data and trailers).
    frames: std::collections::VecDeque<Frame<Bytes>>,
    /// The data of those frames.
    data: BytesMut,
    /// Whether the body ended within the limit.
    ended: bool,
    limit: usize,
    rest: RetryBody,
}

impl Prefix {
    /// The body ended, and its data is within the limit.
    fn whole(&self) -> bool {
        self.ended && self.data.len() <= self.limit
    }

    /// The body as it came: the frames read, then the rest.
    fn into_body(self) -> RetryBody {
        RetryBody(
            Chained {
                head: self.frames,
                rest: self.rest,
            }
            .boxed_unsync(),
        )
    }
}

/// Reads frames until the body ends or more than `limit` bytes of data came.
async fn read_up_to(mut body: RetryBody, limit: usize) -> Result<Prefix, BoxError> {
    let mut frames = std::collections::VecDeque::new();
    let mut data = BytesMut::new();
    let ended = loop {
        let frame = match body.frame().await {
            None => break true,
            Some(Ok(frame)) => frame,
            Some(Err(e)) => return Err(e),
        };
        if let Some(chunk) = frame.data_ref() {
            data.extend_from_slice(chunk);
        }
        frames.push_back(frame);
        if data.len() > limit {
            break false;
        }
    };
    Ok(Prefix {
        frames,
        data,
        ended,
        limit,
        rest: body,
    })
}

/// What was read of a body, then the rest of it.
struct Chained {
    head: std::collections::VecDeque<Frame<Bytes>>,
    rest: RetryBody,
}

impl Body for Chained {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(frame) = self.head.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }
}
