//! An in-memory fake payment provider, run as its own process, for
//! end-to-end tests of code that charges a card through an
//! `Idempotency-Key`: it remembers every charge by key, and faults can be
//! queued to make it fail, hang or drop the connection at chosen moments.
//!
//! ```text
//! cargo run --example fake_provider                         # 127.0.0.1:3100
//! cargo run --example fake_provider -- --addr 127.0.0.1:0   # any free port
//! ```
//!
//! The first line on stdout is always the bound address, so a test that
//! starts it with port 0 can read where it listens:
//!
//! ```text
//! fake_provider listening on http://127.0.0.1:40123
//! ```
//!
//! Everything lives in memory behind one mutex and is lost on exit. SIGTERM
//! or ctrl-c stops accepting connections, lets answers in progress finish
//! (for at most [`SHUTDOWN_GRACE`]) and exits with status 0.
//!
//! # Routes
//!
//! Errors are JSON objects `{"code":"…","message":"…"}` (a decline is
//! exactly `{"code":"card_declined"}`).
//!
//! - `POST /charges`, header `Idempotency-Key: K`, body
//!   `{"amount":N,"currency":"KRW","source":"tok_…"}` (`amount` a positive
//!   integer, `currency` three upper-case letters, `source` non-empty;
//!   other fields are ignored). The key is the header value exactly as sent
//!   (quotes included), 1 to 255 characters.
//!   - new key: the card is charged, `201`
//!     `{"chargeId":"ch_…","amount":N,"currency":"KRW","status":"succeeded"}`;
//!   - same key, same amount, currency and source: `200` with the same body,
//!     byte for byte, and no second charge;
//!   - same key, anything of the three different: `409`
//!     (`idempotency_key_reused`), nothing charged;
//!   - no key, or a body that does not parse or validate: `400`, nothing
//!     charged and no fault consumed.
//!
//!   The check for the key and the charge happen under one lock, so
//!   concurrent requests with one key make one charge: the first is `201`,
//!   the others replay `200`.
//! - `GET /charges?idempotency_key=K`: the status look-up, `200` with the
//!   same body the `POST` answered, `404` (`charge_not_found`) when the key
//!   never made a charge, `503` while the look-up is down (see below).
//! - `GET /charges`: the ground truth, every charge in creation order as a
//!   JSON array of `{"chargeId","amount","currency","status","source",
//!   "idempotencyKey"}`. Never affected by faults.
//! - `POST /faults` `{"mode":M,"count":N,"delay_ms":D}`: queues a fault
//!   (below); `DELETE /faults` clears the queue and brings the look-up back
//!   up; `GET /faults` shows both. All three answer
//!   `{"faults":[{"mode","remaining","delay_ms"}],"lookup_down":bool}`.
//! - `GET /health`: `200 ok`.
//!
//! # Faults
//!
//! Queued faults are FIFO and only affect `POST /charges`: each valid
//! `POST /charges` takes the fault at the front of the queue and uses up
//! one of its `count` (default 1); the fault leaves the queue when its count
//! reaches 0. `delay_ms` (default 0, at most one hour) is how long the
//! affected request waits before answering (or, for `charge_then_drop`,
//! before closing the connection), in every mode.
//!
//! - `fail_before`: `503` (`provider_unavailable`) before the provider
//!   looks at anything: no charge, even for a known key.
//! - `charge_then_hang`: processed normally (a new key is charged at once,
//!   and is visible to the look-up and the listing), but the answer comes
//!   only after `delay_ms`.
//! - `charge_then_drop`: processed normally, then (after `delay_ms`) the
//!   connection is closed without a single byte of answer: the client sees
//!   the connection die, yet the charge exists.
//! - `decline`: a new key answers `402` `{"code":"card_declined"}` and is
//!   not charged; the key is not remembered, so a later request with it
//!   charges normally.
//!
//! A request whose key already has a charge still consumes the front fault,
//! but is never charged a second time: under `charge_then_hang` it replays
//! `200` late, under `charge_then_drop` the connection closes instead of the
//! replay, under `decline` the replay wins (`200`, a charge that succeeded
//! stays succeeded), and under `fail_before` it gets `503`. A reused key
//! with a different payload is `409` under every fault but `fail_before`
//! (and is delayed or dropped like any answer).
//!
//! Two modes are switches, not queue entries (`count` and `delay_ms` are
//! ignored): `{"mode":"lookup_down"}` makes `GET /charges?idempotency_key=…`
//! answer `503` (`lookup_unavailable`) until `{"mode":"lookup_up"}` (or
//! `DELETE /faults`); charging and the listing keep working.
//!
//! # Serving
//!
//! Connections are served one by one with `hyper::server::conn::http1`
//! (HTTP/1.1, keep-alive) around the axum router, so that a handler can
//! ask its own connection to be dropped: that is how `charge_then_drop`
//! closes the socket without answering.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tower::ServiceExt;

/// How long shutdown waits for answers in progress (a hanging fault, say)
/// before closing their connections.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// The longest `delay_ms` a fault may ask for.
const MAX_DELAY: Duration = Duration::from_secs(3600);
const MAX_KEY_LEN: usize = 255;

/// The `POST /charges` body; a reused key must repeat all three fields.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
struct ChargeRequest {
    amount: i64,
    currency: String,
    source: String,
}

impl ChargeRequest {
    fn validate(&self) -> Result<(), String> {
        if self.amount < 1 {
            return Err("amount must be a positive integer".into());
        }
        if self.currency.len() != 3 || !self.currency.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err("currency must be an ISO 4217 code such as KRW".into());
        }
        if self.source.is_empty() || self.source.len() > 255 {
            return Err("source must be 1 to 255 characters, such as tok_visa".into());
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct Charge {
    id: String,
    key: String,
    request: ChargeRequest,
}

/// The answer to `POST /charges` and to the look-up: exactly these fields.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ChargeBody<'a> {
    charge_id: &'a str,
    amount: i64,
    currency: &'a str,
    status: &'static str,
}

/// One element of `GET /charges`.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ChargeListing<'a> {
    charge_id: &'a str,
    amount: i64,
    currency: &'a str,
    status: &'static str,
    source: &'a str,
    idempotency_key: &'a str,
}

impl Charge {
    fn body(&self) -> ChargeBody<'_> {
        ChargeBody {
            charge_id: &self.id,
            amount: self.request.amount,
            currency: &self.request.currency,
            status: "succeeded",
        }
    }

    fn listing(&self) -> ChargeListing<'_> {
        ChargeListing {
            charge_id: &self.id,
            amount: self.request.amount,
            currency: &self.request.currency,
            status: "succeeded",
            source: &self.request.source,
            idempotency_key: &self.key,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Mode {
    FailBefore,
    ChargeThenHang,
    ChargeThenDrop,
    Decline,
    LookupDown,
    LookupUp,
}

#[derive(Debug, Clone, Serialize)]
struct QueuedFault {
    mode: Mode,
    remaining: u32,
    delay_ms: u64,
}

/// The `POST /faults` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultRequest {
    mode: Mode,
    #[serde(default = "one")]
    count: u32,
    #[serde(default)]
    delay_ms: u64,
}

fn one() -> u32 {
    1
}

/// What `POST /charges` decided under the lock, before any delay or drop.
enum Outcome {
    Created(Charge),
    Replayed(Charge),
    Reused,
    Declined,
    Unavailable,
}

/// The whole provider: one mutex around this.
struct Provider {
    charges: Vec<Charge>,
    by_key: HashMap<String, usize>,
    faults: VecDeque<QueuedFault>,
    lookup_down: bool,
    next_seq: u64,
    /// Makes charge ids differ between runs.
    salt: u64,
}

impl Provider {
    fn new() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        Self {
            charges: Vec::new(),
            by_key: HashMap::new(),
            faults: VecDeque::new(),
            lookup_down: false,
            next_seq: 1,
            salt: h.finish() & 0xffff_ffff_ffff,
        }
    }

    /// Takes one use of the front fault.
    fn take_fault(&mut self) -> Option<(Mode, Duration)> {
        let front = self.faults.front_mut()?;
        let taken = (front.mode, Duration::from_millis(front.delay_ms));
        front.remaining = front.remaining.saturating_sub(1);
        if front.remaining == 0 {
            self.faults.pop_front();
        }
        Some(taken)
    }

    fn charge(&mut self, key: String, request: ChargeRequest, mode: Option<Mode>) -> Outcome {
        if mode == Some(Mode::FailBefore) {
            return Outcome::Unavailable;
        }
        if let Some(existing) = self.find(&key) {
            return if existing.request == request {
                Outcome::Replayed(existing.clone())
            } else {
                Outcome::Reused
            };
        }
        if mode == Some(Mode::Decline) {
            return Outcome::Declined;
        }
        let charge = Charge {
            id: format!("ch_{:012x}{:06}", self.salt, self.next_seq),
            key: key.clone(),
            request,
        };
        self.next_seq += 1;
        self.by_key.insert(key, self.charges.len());
        self.charges.push(charge.clone());
        Outcome::Created(charge)
    }

    /// The charge made with `key`, if any.
    fn find(&self, key: &str) -> Option<&Charge> {
        self.by_key.get(key).and_then(|&i| self.charges.get(i))
    }

    fn faults_json(&self) -> serde_json::Value {
        json!({"faults": self.faults, "lookup_down": self.lookup_down})
    }
}

type Shared = Arc<Mutex<Provider>>;

fn lock(state: &Shared) -> Result<MutexGuard<'_, Provider>, ApiError> {
    state.lock().map_err(|_| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "state lock poisoned",
        )
    })
}

/// Every error answer: `{"code":…,"message":…}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"code": self.code, "message": self.message});
        (self.status, Json(body)).into_response()
    }
}

/// Put in every request's extensions by the connection that carries it:
/// notifying it closes that connection without an answer.
#[derive(Clone)]
struct DropConnection(Arc<Notify>);

fn idempotency_key(headers: &HeaderMap) -> Result<String, ApiError> {
    let mut values = headers.get_all("idempotency-key").iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(ApiError::bad_request(
            "send exactly one Idempotency-Key header",
        ));
    };
    let key = value
        .to_str()
        .map_err(|_| ApiError::bad_request("Idempotency-Key must be visible ASCII"))?
        .trim();
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        return Err(ApiError::bad_request(format!(
            "Idempotency-Key must be 1 to {MAX_KEY_LEN} characters"
        )));
    }
    Ok(key.to_owned())
}

/// `POST /charges`.
async fn create_charge(
    State(state): State<Shared>,
    connection: Option<Extension<DropConnection>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let key = idempotency_key(&headers)?;
    let request: ChargeRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid charge: {e}")))?;
    request.validate().map_err(ApiError::bad_request)?;
    let (fault, outcome) = {
        let mut provider = lock(&state)?;
        let fault = provider.take_fault();
        let outcome = provider.charge(key, request, fault.map(|(mode, _)| mode));
        (fault, outcome)
    };
    let response = match outcome {
        Outcome::Created(charge) => (StatusCode::CREATED, Json(charge.body())).into_response(),
        Outcome::Replayed(charge) => (StatusCode::OK, Json(charge.body())).into_response(),
        Outcome::Reused => ApiError::new(
            StatusCode::CONFLICT,
            "idempotency_key_reused",
            "this Idempotency-Key was used with a different amount, currency or source",
        )
        .into_response(),
        Outcome::Declined => (
            StatusCode::PAYMENT_REQUIRED,
            Json(json!({"code": "card_declined"})),
        )
            .into_response(),
        Outcome::Unavailable => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "provider_unavailable",
            "injected fault: nothing was charged",
        )
        .into_response(),
    };
    let Some((mode, delay)) = fault else {
        return Ok(response);
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if mode != Mode::ChargeThenDrop {
        return Ok(response);
    }
    let Some(Extension(DropConnection(drop_now))) = connection else {
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "charge_then_drop needs the provider's own connection handling",
        ));
    };
    // The connection task drops the connection, and this future with it.
    drop_now.notify_one();
    std::future::pending().await
}

#[derive(Deserialize)]
struct LookupQuery {
    idempotency_key: Option<String>,
}

/// `GET /charges` (the listing) and `GET /charges?idempotency_key=K` (the
/// look-up).
async fn get_charges(
    State(state): State<Shared>,
    Query(query): Query<LookupQuery>,
) -> Result<Response, ApiError> {
    let provider = lock(&state)?;
    let Some(key) = query.idempotency_key else {
        let all: Vec<_> = provider.charges.iter().map(Charge::listing).collect();
        return Ok(Json(all).into_response());
    };
    if key.is_empty() {
        return Err(ApiError::bad_request("idempotency_key must not be empty"));
    }
    if provider.lookup_down {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "lookup_unavailable",
            "injected fault: the status look-up is down",
        ));
    }
    match provider.find(&key) {
        Some(charge) => Ok(Json(charge.body()).into_response()),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "charge_not_found",
            "no charge was made with this idempotency key",
        )),
    }
}

/// `POST /faults`.
async fn add_fault(
    State(state): State<Shared>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let fault: FaultRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid fault: {e}")))?;
    if fault.count == 0 {
        return Err(ApiError::bad_request("count must be at least 1"));
    }
    if Duration::from_millis(fault.delay_ms) > MAX_DELAY {
        return Err(ApiError::bad_request(format!(
            "delay_ms must be at most {}",
            MAX_DELAY.as_millis()
        )));
    }
    let mut provider = lock(&state)?;
    match fault.mode {
        Mode::LookupDown => provider.lookup_down = true,
        Mode::LookupUp => provider.lookup_down = false,
        mode => provider.faults.push_back(QueuedFault {
            mode,
            remaining: fault.count,
            delay_ms: fault.delay_ms,
        }),
    }
    Ok(Json(provider.faults_json()))
}

/// `GET /faults`.
async fn show_faults(State(state): State<Shared>) -> Result<Json<serde_json::Value>, ApiError> {
    Ok(Json(lock(&state)?.faults_json()))
}

/// `DELETE /faults`.
async fn clear_faults(State(state): State<Shared>) -> Result<Json<serde_json::Value>, ApiError> {
    let mut provider = lock(&state)?;
    provider.faults.clear();
    provider.lookup_down = false;
    Ok(Json(provider.faults_json()))
}

fn router() -> Router {
    Router::new()
        .route("/charges", get(get_charges).post(create_charge))
        .route(
            "/faults",
            get(show_faults).post(add_fault).delete(clear_faults),
        )
        .route("/health", get(|| async { "ok" }))
        .with_state(Arc::new(Mutex::new(Provider::new())))
}

/// Accepts connections until a shutdown signal, then drains them.
async fn serve(listener: TcpListener, app: Router) {
    let (stop, stopped) = watch::channel(());
    let mut connections = JoinSet::new();
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(serve_connection(stream, app.clone(), stopped.clone()));
                }
                Err(e) => {
                    // Out of file descriptors and the like: do not spin.
                    eprintln!("fake_provider: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    // Idle connections close now, busy ones after their answer.
    let _ = stop.send(());
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        eprintln!(
            "fake_provider: {} connection(s) still busy after {SHUTDOWN_GRACE:?}, closing them",
            connections.len()
        );
        connections.shutdown().await;
    }
}

/// Serves one connection; returns (dropping it) when the client is done,
/// when a handler asks for [`DropConnection`], or after a graceful stop.
async fn serve_connection(stream: TcpStream, app: Router, mut stop: watch::Receiver<()>) {
    let _ = stream.set_nodelay(true);
    let drop_now = Arc::new(Notify::new());
    let token = DropConnection(drop_now.clone());
    let service = service_fn(move |mut req: Request<Incoming>| {
        req.extensions_mut().insert(token.clone());
        app.clone().oneshot(req)
    });
    let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            // Errors here are clients going away; nothing to report.
            _ = conn.as_mut() => return,
            // Returning drops `conn`, which closes the socket unanswered.
            () = drop_now.notified() => return,
            _ = stop.changed(), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

struct Args {
    addr: SocketAddr,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        addr: ([127, 0, 0, 1], 3100).into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--addr" => args.addr = value.parse().map_err(|e| format!("--addr {value}: {e}"))?,
            other => return Err(format!("unknown flag {other}; use --addr HOST:PORT")),
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let listener = TcpListener::bind(args.addr).await?;
    println!(
        "fake_provider listening on http://{}",
        listener.local_addr()?
    );
    serve(listener, router()).await;
    Ok(())
}
