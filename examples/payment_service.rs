//! A payment service in lease mode: `POST /payments` charges a card at a
//! payment provider (`examples/fake_provider.rs`) exactly once per
//! `Idempotency-Key`, whatever crashes on the way.
//!
//! ```text
//! cargo run --example fake_provider -- --addr 127.0.0.1:3100
//! cargo run --example payment_service -- --addr 127.0.0.1:3002 --provider http://127.0.0.1:3100
//! DATABASE_URL=postgres://postgres@127.0.0.1/test cargo run --example payment_service -- \
//!     --provider http://127.0.0.1:3100 --lease-ms 30000 --provider-timeout-ms 5000 \
//!     --completer-interval-ms 10000
//! DATABASE_URL=mysql://root@127.0.0.1/test cargo run --example payment_service --features mysql -- …
//!
//! curl -si localhost:3002/payments -H 'Authorization: Bearer user-42' \
//!     -H 'Idempotency-Key: pay-001' -H 'Content-Type: application/json' \
//!     -d '{"orderId":"o-1","amount":12000,"currency":"KRW","source":"tok_visa"}'
//! ```
//!
//! `DATABASE_URL` is read as by `order_service` (empty: the SQLite file
//! `./payment_service.db`). Flags: `--addr` (default `127.0.0.1:3002`),
//! `--provider` (default `http://127.0.0.1:3100`), `--lease-ms` (30000),
//! `--provider-timeout-ms` (5000: the bound on each call to the provider),
//! `--completer-interval-ms` (10000). The first line on stdout is
//! `payment_service listening on http://ADDR (store: …)`.
//!
//! # How a payment flows
//!
//! The route is behind `IdempotencyLayer::with_lease`: the claim commits at
//! once as `PROCESSING` with a lease (`--lease-ms`) and generation 1, and
//! [`drive`] runs three parts, each committed on its own. The same [`drive`]
//! runs for a client's request, for a client's retry that takes a lapsed
//! lease over, and for the [`Completer`] that finishes abandoned payments
//! with no client at all (it starts from what phase 1 saved, never from a
//! request).
//!
//! 0. **Before the claim.** [`authenticate`] (401 without a Bearer token)
//!    and [`normalize_payment`], the layer's normalizer: an invalid body is
//!    `400` before anything is claimed, and a valid one is fingerprinted in
//!    canonical form.
//! 1. **Phase `created`** ([`create`]): inserts the `payments` row as
//!    `pending` and saves everything later parts need ([`Created`]: payment
//!    id, principal, order id, amount, currency, source) with
//!    `Phase::commit_with`, fenced by the generation.
//! 2. **Step `charge`** ([`charge`]): `POST /charges` at the provider with
//!    `Idempotency-Key: <step key>` (the same for every attempt of this
//!    request), bounded by `--provider-timeout-ms`. The step is noted
//!    pending before the call and the lease is renewed while it runs. A
//!    `402` is a result ([`ChargeResult::Declined`]); a `503`, a timeout or
//!    a lost connection is an error, after which the step's `recover`
//!    (`GET /charges?idempotency_key=<step key>`: 200 → `Done`, 404 →
//!    `Absent`, anything else → `Unknown`) decides.
//! 3. **Final phase** ([`finish`]): marks the row `captured` with the
//!    charge id (or `failed` for a decline) in the transaction in which the
//!    layer records the answer, fenced: `201` with `Location:
//!    /payments/{id}` (`SUCCEEDED`), or `402` `#card-declined`
//!    (`FAILED_FINAL`: the layer keeps the `failed` row). Retries replay it.
//!
//! # Crash points, and what happens
//!
//! | crash (SIGKILL, or a lost answer) | state left | what the next attempt does |
//! |---|---|---|
//! | before phase 1 commits | a bare claim, nothing saved | the retry takes the lapsed lease over and runs phase 1 with its own body; the completer cannot resume it (no saved data) and [`resume`] answers it *rejected*, which deletes the claim so the key runs afresh |
//! | after phase 1, before the provider saw the call | row `pending`, point `created`, maybe step `charge` pending | takeover: `recover` finds no charge (`Absent`), so the charge runs, with the same step key |
//! | after the provider charged, before the local commit | row `pending`, step `charge` pending | takeover: `recover` finds the charge (`Done`), no second call; phase 3 captures it |
//! | the provider's answer lost (`charge_then_drop`) | — (same request) | `execute` fails, `recover` runs at once and finds the charge: `201` in the same request |
//! | the provider call fails (`503`) or times out, nothing charged | step not pending (`recover` proved `Absent`) | this request answers `503`, the lease ends at once, the retry resumes at `created` and charges |
//! | `recover` cannot tell (look-up down) | record parked `NEEDS_RECONCILIATION` | every retry gets `503 #reconciling` with `Retry-After`; each completer pass retries `recover`, an operator resolves it with `Reconciler` |
//! | after phase 3 commits, before the response | `SUCCEEDED` (or `FAILED_FINAL`) with the answer | the retry replays the identical answer |
//! | the owner stalls past its lease (GC pause, SIGSTOP) | another attempt took over (generation + 1) | the stale owner's next write (a renewal, the step's result, phase 3) is refused: its client gets `409 #lease-lost`, it never records an answer, and a charge it repeats carries the same step key, which the provider deduplicates |
//! | nobody retries | lapsed lease | the [`Completer`] (every `--completer-interval-ms`) takes it over and runs [`drive`] from the saved data; the client's later retry replays |
//!
//! Other routes: `GET /payments/{id}` (owner only, else 404), `GET /health`.
//!
//! # The operators' console
//!
//! Built with the `admin` feature and started with `ADMIN_TOKEN` set, the
//! service mounts [`tower_idempotency::admin::router`] under `/admin`,
//! behind [`operators_only`]: a request needs `Authorization: Bearer
//! $ADMIN_TOKEN` (scripts), or the session cookie a browser gets by posting
//! the token to the login form at `/admin/login`. The cookie holds a random
//! session id, never the token (`HttpOnly`, `SameSite=Strict`, path
//! `/admin`, `Secure` when a TLS proxy says `X-Forwarded-Proto: https`); a
//! session lasts `$ADMIN_SESSION_SECS` (8 hours by default), `POST
//! /admin/logout` ends it, and the token is never taken from a URL (it
//! would land in history and logs). Verdicts are recorded as
//! `$ADMIN_ACTOR` (default `operator`). A stand-in for real operator
//! authentication (single sign-on, mTLS): the console never authenticates
//! by itself.
//!
//! ```text
//! ADMIN_TOKEN=s3cret cargo run --example payment_service --features admin -- …
//! open 'http://127.0.0.1:3002/admin/login'
//! ```
//! SIGTERM (or ctrl-c) stops accepting, lets requests in progress finish,
//! and stops the completer.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::Pool;
use tower_idempotency::lease::{
    CallError, Completer, LeaseError, LeaseMode, Leased, Recovered, StepError, StepKey,
};
use tower_idempotency::store::StoreErrorKind;
use tower_idempotency::{
    Backend, Classification, ConfigError, FingerprintError, IdempotencyLayer, Normalizer,
    Principal, ResourceId,
};

/// The operation the layer names the route (`MethodRouter::layer`: method
/// and route template); the completer's resume function is registered
/// under it.
const OPERATION: &str = "POST /payments";

/// The `POST /payments` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct CreatePayment {
    order_id: String,
    amount: i64,
    currency: String,
    source: String,
}

impl CreatePayment {
    fn validate(&self) -> Result<(), String> {
        if self.order_id.is_empty() || self.order_id.len() > 128 {
            return Err("orderId must be 1 to 128 characters".into());
        }
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

/// The layer's normalizer: parse, validate (400 before any claim), and the
/// canonical bytes that are fingerprinted.
fn normalize_payment(
    _: &axum::http::request::Parts,
    body: &Bytes,
) -> Result<Vec<u8>, FingerprintError> {
    let payment: CreatePayment = serde_json::from_slice(body)
        .map_err(|e| FingerprintError::new(format!("invalid payment: {e}")))?;
    payment.validate().map_err(FingerprintError::new)?;
    serde_json::to_vec(&payment).map_err(|e| FingerprintError::new(e.to_string()))
}

/// What phase 1 saves: everything the later parts need, so that a takeover
/// or the completer can finish the payment without the request.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Created {
    payment_id: String,
    principal: String,
    order_id: String,
    amount: i64,
    currency: String,
    source: String,
}

/// The result of the `charge` step, saved as its recovery point.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "camelCase")]
enum ChargeResult {
    /// The provider charged the card.
    #[serde(rename_all = "camelCase")]
    Captured { charge_id: String },
    /// The provider declined (`402`): nothing was charged.
    Declined,
}

/// A `payments` row.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
struct PaymentBody {
    payment_id: String,
    charge_id: Option<String>,
    order_id: String,
    amount: i64,
    currency: String,
    status: String,
}

/// The example's own table and statements, per database.
trait PaymentDb: tower_idempotency::admin::AdminBackend {
    /// Creates the `payments` table if missing.
    fn create_schema(pool: &Pool<Self>) -> impl Future<Output = sqlx::Result<()>> + Send;
    fn insert_payment(
        conn: &mut Self::Connection,
        p: &Created,
    ) -> impl Future<Output = sqlx::Result<()>> + Send;
    /// Sets the status (and charge id) of a `pending` row; `false` when the
    /// row is not there or no longer pending.
    fn settle_payment(
        conn: &mut Self::Connection,
        id: &str,
        charge_id: Option<&str>,
        status: &str,
    ) -> impl Future<Output = sqlx::Result<bool>> + Send;
    fn payment(
        pool: &Pool<Self>,
        id: &str,
        principal: &str,
    ) -> impl Future<Output = sqlx::Result<Option<PaymentBody>>> + Send;
}

/// One implementation per database; only the SQL text differs.
macro_rules! payment_db {
    ($db:ty, schema: $schema:expr, insert: $insert:expr, settle: $settle:expr, get: $get:expr $(,)?) => {
        impl PaymentDb for $db {
            async fn create_schema(pool: &Pool<Self>) -> sqlx::Result<()> {
                sqlx::raw_sql($schema).execute(pool).await.map(drop)
            }

            async fn insert_payment(conn: &mut Self::Connection, p: &Created) -> sqlx::Result<()> {
                sqlx::query($insert)
                    .bind(&p.payment_id)
                    .bind(&p.principal)
                    .bind(&p.order_id)
                    .bind(p.amount)
                    .bind(&p.currency)
                    .execute(conn)
                    .await
                    .map(drop)
            }

            async fn settle_payment(
                conn: &mut Self::Connection,
                id: &str,
                charge_id: Option<&str>,
                status: &str,
            ) -> sqlx::Result<bool> {
                let done = sqlx::query($settle)
                    .bind(charge_id)
                    .bind(status)
                    .bind(id)
                    .execute(conn)
                    .await?;
                Ok(done.rows_affected() == 1)
            }

            async fn payment(
                pool: &Pool<Self>,
                id: &str,
                principal: &str,
            ) -> sqlx::Result<Option<PaymentBody>> {
                let row: Option<(String, Option<String>, String, i64, String, String)> =
                    sqlx::query_as($get)
                        .bind(id)
                        .bind(principal)
                        .fetch_optional(pool)
                        .await?;
                Ok(row.map(
                    |(payment_id, charge_id, order_id, amount, currency, status)| PaymentBody {
                        payment_id,
                        charge_id,
                        order_id,
                        amount,
                        currency,
                        status,
                    },
                ))
            }
        }
    };
}

#[cfg(feature = "sqlite")]
payment_db!(
    sqlx::Sqlite,
    schema: "CREATE TABLE IF NOT EXISTS payments (id TEXT PRIMARY KEY, principal TEXT NOT NULL,
        order_id TEXT NOT NULL, amount INTEGER NOT NULL, currency TEXT NOT NULL, charge_id TEXT,
        status TEXT NOT NULL)",
    insert: "INSERT INTO payments (id, principal, order_id, amount, currency, status)
        VALUES (?, ?, ?, ?, ?, 'pending')",
    settle: "UPDATE payments SET charge_id = ?, status = ? WHERE id = ? AND status = 'pending'",
    get: "SELECT id, charge_id, order_id, amount, currency, status FROM payments
        WHERE id = ? AND principal = ?",
);

#[cfg(feature = "postgres")]
payment_db!(
    sqlx::Postgres,
    schema: "CREATE TABLE IF NOT EXISTS payments (id TEXT PRIMARY KEY, principal TEXT NOT NULL,
        order_id TEXT NOT NULL, amount BIGINT NOT NULL, currency TEXT NOT NULL, charge_id TEXT,
        status TEXT NOT NULL)",
    insert: "INSERT INTO payments (id, principal, order_id, amount, currency, status)
        VALUES ($1, $2, $3, $4, $5, 'pending')",
    settle: "UPDATE payments SET charge_id = $1, status = $2 WHERE id = $3 AND status = 'pending'",
    get: "SELECT id, charge_id, order_id, amount, currency, status FROM payments
        WHERE id = $1 AND principal = $2",
);

#[cfg(feature = "mysql")]
payment_db!(
    sqlx::MySql,
    schema: "CREATE TABLE IF NOT EXISTS payments (id VARCHAR(64) PRIMARY KEY, principal TEXT NOT NULL,
        order_id VARCHAR(128) NOT NULL, amount BIGINT NOT NULL, currency CHAR(3) NOT NULL,
        charge_id VARCHAR(255) NULL, status VARCHAR(16) NOT NULL) ENGINE = InnoDB",
    insert: "INSERT INTO payments (id, principal, order_id, amount, currency, status)
        VALUES (?, ?, ?, ?, ?, 'pending')",
    settle: "UPDATE payments SET charge_id = ?, status = ? WHERE id = ? AND status = 'pending'",
    get: "SELECT id, charge_id, order_id, amount, currency, status FROM payments
        WHERE id = ? AND principal = ?",
);

/// Why a call to the provider gave no usable answer (the step then asks
/// `recover`).
#[derive(Debug)]
struct ProviderError(String);

impl std::fmt::Display for ProviderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The provider's answer to a charge or a look-up.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ChargeBody {
    charge_id: String,
}

/// A client of the payment provider: one HTTP/1.1 connection per call,
/// each call bounded by `timeout` (connect, send, and the whole answer).
#[derive(Debug, Clone)]
struct Provider {
    /// `host:port`.
    authority: String,
    timeout: Duration,
}

impl Provider {
    fn new(url: &str, timeout: Duration) -> Result<Self, String> {
        let uri: http::Uri = url.parse().map_err(|e| format!("--provider {url}: {e}"))?;
        if uri.scheme_str() != Some("http") {
            return Err(format!("--provider {url}: only http:// is supported"));
        }
        let authority = uri
            .authority()
            .ok_or_else(|| format!("--provider {url}: no host"))?;
        let port = authority.port_u16().unwrap_or(80);
        Ok(Self {
            authority: format!("{}:{port}", authority.host()),
            timeout,
        })
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: Bytes,
    ) -> Result<(StatusCode, Bytes), CallError<ProviderError>> {
        match tokio::time::timeout(self.timeout, self.call_unbounded(method, path, key, body)).await
        {
            Ok(answer) => answer,
            Err(_) => Err(CallError::Uncertain(ProviderError(format!(
                "{path}: no answer within {:?}",
                self.timeout
            )))),
        }
    }

    async fn call_unbounded(
        &self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: Bytes,
    ) -> Result<(StatusCode, Bytes), CallError<ProviderError>> {
        let err =
            |what: &str, e: &dyn std::fmt::Display| ProviderError(format!("{path}: {what}: {e}"));
        // No connection, nothing sent: the one failure that proves the
        // provider never saw the request.
        let stream = tokio::net::TcpStream::connect(&self.authority)
            .await
            .map_err(|e| CallError::NotSent(err("connect", &e)))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| err("handshake", &e))?;
        let mut req = http::Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, &self.authority)
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        let req = req.body(Full::new(body)).map_err(|e| err("request", &e))?;
        let exchange = async {
            let res = sender
                .send_request(req)
                .await
                .map_err(|e| err("send", &e))?;
            let (parts, body) = res.into_parts();
            let body = body.collect().await.map_err(|e| err("answer", &e))?;
            Ok((parts.status, body.to_bytes()))
        };
        tokio::pin!(exchange);
        // The connection is driven here, not in a task of its own, so a
        // call that times out leaves nothing behind. Once it ends, the
        // exchange ends too (with what was read, or an error).
        tokio::select! {
            biased;
            answer = &mut exchange => answer,
            _ = conn => exchange.await,
        }
    }

    /// The `charge` step's `execute`: `POST /charges` with the step key.
    async fn charge(
        &self,
        key: StepKey,
        p: &Created,
    ) -> Result<ChargeResult, CallError<ProviderError>> {
        let body = json!({"amount": p.amount, "currency": p.currency, "source": p.source});
        let (status, body) = self
            .call(
                Method::POST,
                "/charges",
                Some(key.as_str()),
                Bytes::from(body.to_string()),
            )
            .await?;
        match status {
            StatusCode::OK | StatusCode::CREATED => {
                let charge_id = charge_id(&body)?;
                Ok(ChargeResult::Captured { charge_id })
            }
            StatusCode::PAYMENT_REQUIRED => Ok(ChargeResult::Declined),
            other => Err(CallError::Uncertain(ProviderError(format!(
                "POST /charges answered {other}: {}",
                String::from_utf8_lossy(&body)
            )))),
        }
    }

    /// The `charge` step's `recover`: the provider's look-up by step key.
    async fn lookup(&self, key: StepKey) -> Result<Recovered<ChargeResult>, ProviderError> {
        let path = format!("/charges?idempotency_key={}", key.as_str());
        let (status, body) = self
            .call(Method::GET, &path, None, Bytes::new())
            .await
            .map_err(CallError::into_inner)?;
        Ok(match status {
            StatusCode::OK => match charge_id(&body) {
                Ok(charge_id) => Recovered::Done(ChargeResult::Captured { charge_id }),
                Err(_) => Recovered::Unknown,
            },
            StatusCode::NOT_FOUND => Recovered::Absent,
            _ => Recovered::Unknown,
        })
    }
}

fn charge_id(body: &[u8]) -> Result<String, ProviderError> {
    serde_json::from_slice::<ChargeBody>(body)
        .map(|b| b.charge_id)
        .map_err(|e| ProviderError(format!("unreadable charge: {e}")))
}

struct App<DB: PaymentDb> {
    pool: Pool<DB>,
    provider: Provider,
}

impl<DB: PaymentDb> Clone for App<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            provider: self.provider.clone(),
        }
    }
}

/// An answer as the layer and the completer record it.
fn answer(status: StatusCode, content_type: &'static str, body: Vec<u8>) -> Response<Bytes> {
    let mut res = Response::new(Bytes::from(body));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    res
}

fn problem_doc(status: StatusCode, kind: &str, title: &str, detail: &str) -> serde_json::Value {
    json!({
        "type": format!("https://example.com/problems/{kind}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    })
}

fn problem(status: StatusCode, kind: &str, title: &str, detail: &str) -> Response<Bytes> {
    let doc = problem_doc(status, kind, title, detail);
    answer(
        status,
        "application/problem+json",
        doc.to_string().into_bytes(),
    )
}

/// A `503` worth retrying with the same key: the layer ends the lease, and
/// the retry resumes at the last recovery point.
fn unavailable(kind: &str, detail: &str) -> Response<Bytes> {
    let mut res = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        kind,
        "Temporarily unavailable",
        detail,
    );
    res.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    res
}

/// A lease-mode write that did not happen. For a lost lease or a parked
/// record the layer (or the completer) replaces this `503` with `409
/// #lease-lost` or `503 #reconciling`; anything else is transient.
fn lease_failed(e: LeaseError) -> Response<Bytes> {
    match e {
        LeaseError::Lost | LeaseError::Reconciling => {}
        ref other => eprintln!("payment_service: lease mode: {other}"),
    }
    unavailable(
        "unavailable",
        &format!("{e}; retry with the same key, which resumes the payment"),
    )
}

/// A database error inside a phase: nothing of the phase committed.
fn db_failed<DB: Backend>(e: sqlx::Error) -> Response<Bytes> {
    match DB::error_kind(&e) {
        StoreErrorKind::ConnectionLost | StoreErrorKind::Busy | StoreErrorKind::Conflict => {
            eprintln!("payment_service: transient database error: {e}");
        }
        _ => eprintln!("payment_service: database error: {e}"),
    }
    unavailable(
        "unavailable",
        "the database could not complete this part of the payment; retry with the same key",
    )
}

/// A request for `POST /payments` as the handler received it.
struct NewPayment {
    principal: Principal,
    input: CreatePayment,
}

/// The whole payment, from wherever the record stands: used by the handler
/// (with the request) and by the completer (without: everything comes from
/// what phase 1 saved).
async fn drive<DB: PaymentDb>(
    app: &App<DB>,
    leased: &Leased<DB>,
    new: Option<NewPayment>,
) -> Response<Bytes> {
    let created = match leased.saved::<Created>("created") {
        Ok(Some(created)) => created,
        Ok(None) => match new {
            Some(new) => match create(leased, new).await {
                Ok(created) => created,
                Err(res) => return res,
            },
            // A step may have run with nothing saved before it: never
            // answered over (the layer would park it); a transient answer
            // ends the lease, and the client's retry resumes it.
            None if leased.pending_step().is_some() => {
                return unavailable("unavailable", "retry with the same key");
            }
            None => return nothing_to_resume(),
        },
        Err(e) => return lease_failed(e),
    };
    let result = match charge(app, leased, &created).await {
        Ok(result) => result,
        Err(res) => return res,
    };
    finish(leased, &created, &result).await
}

/// Phase 1: the `pending` row, and the data every later attempt needs.
async fn create<DB: PaymentDb>(
    leased: &Leased<DB>,
    new: NewPayment,
) -> Result<Created, Response<Bytes>> {
    let created = Created {
        payment_id: new_payment_id(),
        principal: new.principal.as_str().to_owned(),
        order_id: new.input.order_id,
        amount: new.input.amount,
        currency: new.input.currency,
        source: new.input.source,
    };
    let mut phase = leased.phase().await.map_err(lease_failed)?;
    DB::insert_payment(&mut phase, &created)
        .await
        .map_err(db_failed::<DB>)?;
    phase
        .commit_with("created", &created)
        .await
        .map_err(lease_failed)?;
    Ok(created)
}

/// Step 2: the charge at the provider, with the step key as its
/// idempotency key; `recover` is the provider's look-up.
async fn charge<DB: PaymentDb>(
    app: &App<DB>,
    leased: &Leased<DB>,
    created: &Created,
) -> Result<ChargeResult, Response<Bytes>> {
    let provider = &app.provider;
    let outcome = leased
        .step(
            "charge",
            move |key| provider.charge(key, created),
            move |key| provider.lookup(key),
        )
        .await;
    outcome.map_err(|e| match e {
        StepError::Lease(e) => lease_failed(e),
        StepError::Failed(e) | StepError::NotSent(e) => {
            eprintln!("payment_service: the charge failed without effect: {e}");
            unavailable(
                "provider-unavailable",
                "the payment provider could not be reached; nothing was charged, retry with the same key",
            )
        }
        StepError::TimedOut => unavailable(
            "provider-unavailable",
            "the payment provider did not answer in time; nothing was charged, retry with the same key",
        ),
        other => {
            eprintln!("payment_service: the charge: {other}");
            unavailable("unavailable", "retry with the same key")
        }
    })
}

/// Phase 3: the row's final state, in the transaction in which the layer
/// records the answer.
async fn finish<DB: PaymentDb>(
    leased: &Leased<DB>,
    created: &Created,
    result: &ChargeResult,
) -> Response<Bytes> {
    let (charge_id, status) = match result {
        ChargeResult::Captured { charge_id } => (Some(charge_id.as_str()), "captured"),
        ChargeResult::Declined => (None, "failed"),
    };
    let tx = match leased.final_phase().await {
        Ok(tx) => tx,
        Err(e) => return lease_failed(e),
    };
    {
        let mut conn = match tx.lock() {
            Ok(conn) => conn,
            Err(e) => {
                eprintln!("payment_service: final phase: {e}");
                return unavailable("unavailable", "retry with the same key");
            }
        };
        match DB::settle_payment(&mut conn, &created.payment_id, charge_id, status).await {
            Ok(true) => {}
            Ok(false) => {
                // The row is missing or settled already: nothing a retry
                // could repair by running again.
                eprintln!(
                    "payment_service: payment {} is not pending",
                    created.payment_id
                );
                return problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "Internal error",
                    "the payment row is not pending",
                );
            }
            Err(e) => return db_failed::<DB>(e),
        }
    }
    match result {
        ChargeResult::Captured { charge_id } => {
            let body = PaymentBody {
                payment_id: created.payment_id.clone(),
                charge_id: Some(charge_id.clone()),
                order_id: created.order_id.clone(),
                amount: created.amount,
                currency: created.currency.clone(),
                status: status.to_owned(),
            };
            let bytes = match serde_json::to_vec(&body) {
                Ok(bytes) => bytes,
                Err(e) => {
                    eprintln!("payment_service: {e}");
                    return unavailable("unavailable", "retry with the same key");
                }
            };
            let mut res = answer(StatusCode::CREATED, "application/json", bytes);
            let location = format!("/payments/{}", created.payment_id);
            if let Ok(value) = HeaderValue::from_str(&location) {
                res.headers_mut().insert(header::LOCATION, value);
            }
            res.extensions_mut()
                .insert(ResourceId::new(created.payment_id.clone()));
            res
        }
        ChargeResult::Declined => {
            // A final failure (402): the layer records it, and keeps this
            // phase's `failed` row.
            let mut doc = problem_doc(
                StatusCode::PAYMENT_REQUIRED,
                "card-declined",
                "Card declined",
                "the payment provider declined the card; nothing was charged",
            );
            doc["paymentId"] = json!(created.payment_id);
            let mut res = answer(
                StatusCode::PAYMENT_REQUIRED,
                "application/problem+json",
                doc.to_string().into_bytes(),
            );
            res.extensions_mut()
                .insert(ResourceId::new(created.payment_id.clone()));
            res
        }
    }
}

/// The completer found a claim with nothing saved (the first attempt died
/// before phase 1 committed): nothing took effect and nothing can be
/// resumed without the request. Answered as *rejected*, which deletes the
/// bare claim: the client's retry then runs afresh with its own body.
fn nothing_to_resume() -> Response<Bytes> {
    let mut res = problem(
        StatusCode::CONFLICT,
        "nothing-to-resume",
        "Nothing to resume",
        "the first attempt stopped before saving anything; retry with the same key to run it",
    );
    res.extensions_mut().insert(Classification::Rejected);
    res
}

/// The completer's resume function for `POST /payments`.
async fn resume<DB: PaymentDb>(app: App<DB>, leased: Leased<DB>) -> Response<Bytes> {
    drive(&app, &leased, None).await
}

/// `POST /payments`, behind the layer in lease mode.
async fn create_payment<DB: PaymentDb>(
    State(app): State<App<DB>>,
    Extension(principal): Extension<Principal>,
    leased: Leased<DB>,
    Json(input): Json<CreatePayment>,
) -> Response {
    drive(&app, &leased, Some(NewPayment { principal, input }))
        .await
        .map(axum::body::Body::from)
}

async fn get_payment<DB: PaymentDb>(
    State(app): State<App<DB>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Response {
    let res = match DB::payment(&app.pool, &id, principal.as_str()).await {
        Ok(Some(payment)) => return Json(payment).into_response(),
        Ok(None) => problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "Not found",
            &format!("no payment {id}"),
        ),
        Err(e) => db_failed::<DB>(e),
    };
    res.map(axum::body::Body::from)
}

/// Demo authentication: any non-empty Bearer token is the principal.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_owned);
    let Some(token) = token else {
        return problem(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "Authentication required",
            "send Authorization: Bearer <principal>",
        )
        .map(axum::body::Body::from);
    };
    req.extensions_mut().insert(Principal::new(token));
    next.run(req).await
}

fn new_payment_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    format!("p-{:016x}", h.finish())
}

fn lease_mode(args: &Args) -> Result<LeaseMode, ConfigError> {
    // The step's own bound is a backstop past the provider call's timeout.
    LeaseMode::new(args.lease)?
        .with_step_timeout(args.provider_timeout.saturating_add(Duration::from_secs(1)))
}

fn router<DB: PaymentDb>(app: App<DB>, mode: LeaseMode) -> Router {
    let idempotency = IdempotencyLayer::new(app.pool.clone())
        .with_normalizer(Normalizer::custom(normalize_payment))
        .with_lease(mode)
        .with_resource_link(|id| format!("/payments/{id}"));
    let payments = Router::new()
        .route("/payments", post(create_payment::<DB>).layer(idempotency))
        .route("/payments/{id}", get(get_payment::<DB>))
        .layer(middleware::from_fn(authenticate));
    #[cfg(feature = "admin")]
    let pool = app.pool.clone();
    let router = Router::new()
        .merge(payments)
        .route("/health", get(|| async { "ok" }))
        .with_state(app);
    #[cfg(feature = "admin")]
    let router = match std::env::var("ADMIN_TOKEN") {
        Ok(token) if !token.is_empty() => router.nest("/admin", console(&pool, token)),
        _ => router,
    };
    router
}

/// The operators' console behind [`operators_only`], and the browser's
/// login and logout routes beside it.
#[cfg(feature = "admin")]
fn console<DB: PaymentDb>(pool: &Pool<DB>, token: String) -> Router {
    use axum::routing::post;
    use tower_idempotency::admin::{self, Actor, Ledger};
    let actor = std::env::var("ADMIN_ACTOR").unwrap_or_else(|_| "operator".into());
    let lifetime = std::env::var("ADMIN_SESSION_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(SESSION_LIFETIME, Duration::from_secs);
    let auth = ConsoleAuth {
        token: token.into(),
        actor: Actor(actor),
        sessions: Default::default(),
        lifetime,
    };
    let console = admin::router(Ledger::new(pool.clone()))
        .layer(middleware::from_fn_with_state(auth.clone(), operators_only));
    Router::new()
        .route("/login", get(login_form).post(login))
        .route("/logout", post(logout))
        .with_state(auth)
        .merge(console)
}

/// How long a console session lasts by default: 8 hours.
#[cfg(feature = "admin")]
const SESSION_LIFETIME: Duration = Duration::from_secs(8 * 60 * 60);
/// The most sessions held at once; a login beyond is refused (`503`).
#[cfg(feature = "admin")]
const MAX_SESSIONS: usize = 1024;
/// The session cookie's name.
#[cfg(feature = "admin")]
const SESSION_COOKIE: &str = "admin_session";

/// The console's stand-in authentication: one shared token, traded at the
/// login form for a random session id that expires.
#[cfg(feature = "admin")]
#[derive(Clone)]
struct ConsoleAuth {
    token: std::sync::Arc<str>,
    actor: tower_idempotency::admin::Actor,
    /// Session id -> when it expires.
    sessions:
        std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, tokio::time::Instant>>>,
    lifetime: Duration,
}

#[cfg(feature = "admin")]
impl ConsoleAuth {
    /// Compares in time independent of where the first difference is.
    fn accepts(&self, sent: &str) -> bool {
        let (a, b) = (self.token.as_bytes(), sent.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }

    /// Whether `id` names a session that has not expired.
    fn in_session(&self, id: &str) -> bool {
        let now = tokio::time::Instant::now();
        let Ok(sessions) = self.sessions.lock() else {
            return false;
        };
        sessions.get(id).is_some_and(|until| *until > now)
    }

    /// A new session's id (128 random bits from the OS), or `None` when
    /// the OS has no randomness or [`MAX_SESSIONS`] live sessions exist.
    fn open_session(&self) -> Option<String> {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes).ok()?;
        let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let now = tokio::time::Instant::now();
        let mut sessions = self.sessions.lock().ok()?;
        sessions.retain(|_, until| *until > now);
        if sessions.len() >= MAX_SESSIONS {
            return None;
        }
        sessions.insert(id.clone(), now + self.lifetime);
        Some(id)
    }

    fn close_session(&self, id: &str) {
        if let Ok(mut sessions) = self.sessions.lock() {
            sessions.remove(id);
        }
    }
}

/// The value of the cookie `name` in `headers`.
#[cfg(feature = "admin")]
fn cookie<'h>(headers: &'h axum::http::HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(name)?.strip_prefix('='))
}

/// Lets a request through to the console with `Authorization: Bearer
/// $ADMIN_TOKEN` or a live session cookie, as the operator `$ADMIN_ACTOR`;
/// anything else is `401`.
#[cfg(feature = "admin")]
async fn operators_only(State(auth): State<ConsoleAuth>, mut req: Request, next: Next) -> Response {
    let headers = req.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| auth.accepts(t));
    let session = cookie(headers, SESSION_COOKIE).is_some_and(|id| auth.in_session(id));
    if !bearer && !session {
        return (StatusCode::UNAUTHORIZED, "operators only\n").into_response();
    }
    req.extensions_mut().insert(auth.actor.clone());
    next.run(req).await
}

/// `GET /admin/login`: the form that posts the token.
#[cfg(feature = "admin")]
async fn login_form() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            (header::X_FRAME_OPTIONS, "DENY"),
        ],
        "<!doctype html><title>Console login</title>\
         <form method=\"post\" action=\"/admin/login\">\
         <label>Operator token <input type=\"password\" name=\"token\" id=\"token\" \
         autocomplete=\"current-password\"></label> \
         <button type=\"submit\" id=\"login\">Log in</button></form>",
    )
        .into_response()
}

#[cfg(feature = "admin")]
#[derive(Deserialize)]
struct Login {
    token: String,
}

/// `POST /admin/login` (form: `token`): with the right token, a new
/// session's cookie and a redirect to the console; else `401`.
#[cfg(feature = "admin")]
async fn login(
    State(auth): State<ConsoleAuth>,
    headers: axum::http::HeaderMap,
    axum::extract::Form(form): axum::extract::Form<Login>,
) -> Response {
    if !auth.accepts(&form.token) {
        return (StatusCode::UNAUTHORIZED, "operators only\n").into_response();
    }
    let Some(id) = auth.open_session() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "no session free\n").into_response();
    };
    let tls = headers
        .get("x-forwarded-proto")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
    let cookie = format!(
        "{SESSION_COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/admin; Max-Age={}{}",
        auth.lifetime.as_secs(),
        if tls { "; Secure" } else { "" }
    );
    match HeaderValue::from_str(&cookie) {
        Ok(cookie) => (
            StatusCode::SEE_OTHER,
            [
                (header::SET_COOKIE, cookie),
                (header::LOCATION, HeaderValue::from_static("/admin")),
            ],
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// `POST /admin/logout`: ends the session and clears its cookie.
#[cfg(feature = "admin")]
async fn logout(State(auth): State<ConsoleAuth>, headers: axum::http::HeaderMap) -> Response {
    if let Some(id) = cookie(&headers, SESSION_COOKIE) {
        auth.close_session(id);
    }
    (
        StatusCode::SEE_OTHER,
        [
            (
                header::SET_COOKIE,
                format!("{SESSION_COOKIE}=; HttpOnly; SameSite=Strict; Path=/admin; Max-Age=0"),
            ),
            (header::LOCATION, "/admin/login".to_string()),
        ],
    )
        .into_response()
}

async fn serve<DB: PaymentDb>(
    pool: Pool<DB>,
    args: &Args,
    store: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    tower_idempotency::migrate(&pool).await?;
    DB::create_schema(&pool).await?;
    let app = App {
        pool: pool.clone(),
        provider: Provider::new(&args.provider, args.provider_timeout)?,
    };
    let mode = lease_mode(args)?;
    let resumer = app.clone();
    let completer = Completer::new(pool.clone(), mode)
        .resume(OPERATION, move |leased| resume(resumer.clone(), leased))
        .spawn(args.completer_interval);
    let listener = tokio::net::TcpListener::bind(args.addr).await?;
    println!(
        "payment_service listening on http://{} (store: {store})",
        listener.local_addr()?
    );
    let served = axum::serve(listener, router(app, mode))
        .with_graceful_shutdown(shutdown_signal())
        .await;
    completer.abort();
    pool.close().await;
    Ok(served?)
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
    provider: String,
    lease: Duration,
    provider_timeout: Duration,
    completer_interval: Duration,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        addr: ([127, 0, 0, 1], 3002).into(),
        provider: "http://127.0.0.1:3100".into(),
        lease: Duration::from_secs(30),
        provider_timeout: Duration::from_secs(5),
        completer_interval: Duration::from_secs(10),
    };
    let millis = |flag: &str, value: &str| -> Result<Duration, String> {
        let ms: u64 = value.parse().map_err(|e| format!("{flag} {value}: {e}"))?;
        if ms == 0 {
            return Err(format!("{flag} must be at least 1"));
        }
        Ok(Duration::from_millis(ms))
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--addr" => args.addr = value.parse().map_err(|e| format!("--addr {value}: {e}"))?,
            "--provider" => args.provider = value,
            "--lease-ms" => args.lease = millis(&flag, &value)?,
            "--provider-timeout-ms" => args.provider_timeout = millis(&flag, &value)?,
            "--completer-interval-ms" => args.completer_interval = millis(&flag, &value)?,
            other => {
                return Err(format!(
                    "unknown flag {other}; use --addr HOST:PORT, --provider URL, --lease-ms N, \
                     --provider-timeout-ms N, --completer-interval-ms N"
                ));
            }
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let url = std::env::var("DATABASE_URL").unwrap_or_default();
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        #[cfg(feature = "postgres")]
        return serve(sqlx::PgPool::connect(&url).await?, &args, "postgres").await;
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        #[cfg(feature = "mysql")]
        return serve(sqlx::MySqlPool::connect(&url).await?, &args, "mysql").await;
        #[cfg(not(feature = "mysql"))]
        return Err(
            "mysql:// needs the mysql feature: cargo run --example payment_service --features mysql"
                .into(),
        );
    } else if url.is_empty() || url.starts_with("sqlite:") {
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
        let options = if url.is_empty() {
            SqliteConnectOptions::new().filename("payment_service.db")
        } else {
            url.parse::<SqliteConnectOptions>()?
        };
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .foreign_keys(true);
        let store = format!("sqlite ({})", options.get_filename().display());
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .connect_with(options)
            .await?;
        return serve(pool, &args, &store).await;
    }
    Err(format!("unsupported DATABASE_URL {url:?}: use postgres://, mysql:// or sqlite:").into())
}
