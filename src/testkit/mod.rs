//! A conformance kit: the layer's behaviour suite, runnable against any
//! [`Backend`] (feature `testkit`).
//!
//! The crate runs this very suite against PostgreSQL, SQLite and MariaDB. To
//! hold a fourth backend to the same contract, implement [`ConformanceDb`]
//! for its database type and instantiate the suite in an integration test:
//!
//! ```no_run
//! // tests/conformance.rs (dev-dependencies: tokio with "macros", "rt-multi-thread").
//! // `sqlx::Sqlite` stands for your database type here.
//! tower_idempotency::conformance_suite!(my_store, sqlx::Sqlite);
//! ```
//!
//! Every case is a `#[tokio::test]` on a fresh database, and judges by the
//! rows committed (orders, stock, ledger rows), not by response text. The
//! cases cover the decision table, the seed's acceptance list and failure
//! points, a 50-caller race on one key, principal isolation, cancellation,
//! panics, lost connections and the bad-input list. A backend that cannot
//! hold a behaviour fails the case; nothing is skipped, except the
//! lost-connection case for databases that have no connection to lose
//! ([`ConformanceDb::kill_own_connection`] returns `false`).
//!
//! The built-in backends read `PG_URL` and `MYSQL_URL` (defaults
//! `postgres://postgres@127.0.0.1:5432/test` and
//! `mysql://root@127.0.0.1:3306/test`) and create one database per case.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::{Backend, Classification, IdempotencyLayer, Principal, ResourceId, Tx};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::{Pool, Transaction};
use tower::ServiceExt;

mod backends;
pub mod cases;
pub mod consumer;
pub mod environment;
pub mod lease;
pub mod relay;

pub use backends::{Cleanup, mysql_admin_url, pg_admin_url, use_postgres_url};
pub use environment::Environment;

/// What the suite needs from a database besides the ledger: a fresh
/// database, and the order-service statements the test app runs.
pub trait ConformanceDb: Backend + Sized {
    /// A short name for messages (`postgres`, `sqlite`, `mysql`).
    const LABEL: &'static str;
    /// A pool on a database of its own, with the ledger and the test tables,
    /// and the guard that drops it.
    fn fresh() -> impl Future<Output = (Pool<Self>, Cleanup)> + Send;
    /// The URL of a new, empty database, and the guard that drops it.
    fn fresh_url() -> impl Future<Output = (String, Cleanup)> + Send;
    /// Inserts an order row for `principal`; returns its id.
    fn insert_order(
        conn: &mut Self::Connection,
        principal: &str,
        amount: i64,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;
    /// Takes `qty` of `sku` if enough is left (a conditional decrement); `false` when short.
    fn take_stock(
        conn: &mut Self::Connection,
        sku: &str,
        qty: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
    /// Sets the stock of `sku` (outside any claim).
    fn set_stock(pool: &Pool<Self>, sku: &str, qty: i64) -> impl Future<Output = ()> + Send;
    /// The stock of `sku`.
    fn stock(pool: &Pool<Self>, sku: &str) -> impl Future<Output = i64> + Send;
    /// Runs a `SELECT COUNT(*)`-like query that returns one integer.
    fn count(pool: &Pool<Self>, sql: &'static str) -> impl Future<Output = i64> + Send;
    /// Runs a statement (no parameters).
    fn exec(pool: &Pool<Self>, sql: &'static str) -> impl Future<Output = ()> + Send;
    /// Runs statements (no parameters) on a connection, such as the
    /// claimed transaction's.
    fn exec_on(
        conn: &mut Self::Connection,
        sql: &'static str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Holds the key's write lock the way a stuck first request would: a
    /// transaction with the scope's uncommitted claim, left open.
    fn hold_claim(
        pool: &Pool<Self>,
        principal: &str,
        operation: &str,
        key: &str,
    ) -> impl Future<Output = Transaction<'static, Self>> + Send;
    /// Kills the connection under `conn` from another session; `false` where
    /// the backend has no such thing.
    fn kill_own_connection(
        pool: &Pool<Self>,
        conn: &mut Self::Connection,
    ) -> impl Future<Output = bool> + Send;
    /// Inserts `n` committed `SUCCEEDED` ledger rows of principal `bulk`,
    /// already past their `expires_at`, in as few statements as the
    /// database allows.
    fn seed_expired(pool: &Pool<Self>, n: u32) -> impl Future<Output = ()> + Send;
}

/// Fault injection for MySQL/MariaDB tests: the next recording batch a
/// layer of this process sends pauses for `pause` right after it proved
/// its claimed transaction is still the claim's (the savepoint's release),
/// or right before (`before_proof`), once; a zero `pause` disarms it. The
/// crate's Galera test lands a replicated writer's abort there.
#[cfg(feature = "mysql")]
#[doc(hidden)]
pub fn pause_at_next_proof(pause: Duration, before_proof: bool) {
    use crate::store::mysql::{PAUSE_AT_PROOF_MS, PAUSE_BEFORE_PROOF};
    let ms = u64::try_from(pause.as_millis())
        .map_or(!PAUSE_BEFORE_PROOF, |ms| ms.min(!PAUSE_BEFORE_PROOF));
    let armed = if before_proof && ms > 0 {
        ms | PAUSE_BEFORE_PROOF
    } else {
        ms
    };
    PAUSE_AT_PROOF_MS.store(armed, Ordering::SeqCst);
}

/// Claims the test handler holds past its answer (`rollback_held_201`), by
/// key: each is a task holding the transaction until [`let_go`] asks it
/// to roll back, or 20 s on (so a case that panics before it lets go has
/// its `DROP DATABASE` wait at most that long).
type Held = Vec<(
    String,
    tokio::sync::oneshot::Sender<tokio::sync::oneshot::Sender<()>>,
)>;
static HELD: std::sync::Mutex<Held> = std::sync::Mutex::new(Vec::new());

/// Holds `tx` for `key` (see [`Held`]).
fn hold<DB: sqlx::Database>(key: String, tx: sqlx::Transaction<'static, DB>) {
    let (go, told) = tokio::sync::oneshot::channel::<tokio::sync::oneshot::Sender<()>>();
    tokio::spawn(async move {
        let told = tokio::time::timeout(Duration::from_secs(20), told).await;
        let _ = tx.rollback().await;
        if let Ok(Ok(done)) = told {
            let _ = done.send(());
        }
    });
    HELD.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((key, go));
}

/// Rolls back the claim held for `key` and waits until it is; whether it
/// was still held.
async fn let_go(key: &str) -> bool {
    let go = {
        let mut held = HELD
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = held.iter().position(|(k, _)| k == key);
        at.map(|at| held.swap_remove(at).1)
    };
    let Some(go) = go else {
        return false;
    };
    let (done, rolled_back) = tokio::sync::oneshot::channel();
    // A task that let go on its own (20 s on) no longer listens.
    go.send(done).is_ok() && rolled_back.await.is_ok()
}

/// The setup of a suite that needs none.
pub fn no_setup() {}

/// One case's world: a fresh database, an execution counter, the test app.
pub struct Harness<DB: ConformanceDb> {
    /// The case's database.
    pub pool: Pool<DB>,
    /// How many times the test handler ran.
    pub executions: Arc<AtomicUsize>,
    /// The caller's environment the case runs in.
    pub environment: Environment,
    /// Whether the case's layer runs in the claim-at-commit mode
    /// ([`Harness::at_commit`]).
    pub at_commit: bool,
    /// What the counts and reads of the judging helpers run on: the case's
    /// database in the server's default session (a session setting or a
    /// temporary table of the environment never hides a committed row).
    judge: Pool<DB>,
    _drop: Cleanup,
}

struct AppState<DB: ConformanceDb> {
    pool: Pool<DB>,
    executions: Arc<AtomicUsize>,
    /// What the handler runs first on the claimed transaction.
    first: &'static [&'static str],
}

impl<DB: ConformanceDb> Clone for AppState<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            executions: Arc::clone(&self.executions),
            first: self.first,
        }
    }
}

#[derive(Deserialize)]
struct OrderReq {
    amount: i64,
    #[serde(default)]
    items: Vec<Item>,
    #[serde(default)]
    mode: String,
    #[serde(default)]
    sleep_ms: u64,
}

#[derive(Deserialize)]
struct Item {
    sku: String,
    qty: i64,
}

fn bearer(parts: &http::request::Parts) -> Option<Principal> {
    let v = parts
        .headers
        .get(http::header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let token = v.strip_prefix("Bearer ")?.trim();
    (!token.is_empty()).then(|| Principal::new(token))
}

/// A body: `data`, then `trailers`.
struct WithTrailers {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl http_body::Body for WithTrailers {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let frame = match self.data.take() {
            Some(data) => Some(http_body::Frame::data(data)),
            None => self.trailers.take().map(http_body::Frame::trailers),
        };
        std::task::Poll::Ready(frame.map(Ok))
    }
}

/// `left` copies of `chunk`, as a streamed answer.
struct Chunks {
    chunk: Bytes,
    left: usize,
}

impl futures_core::Stream for Chunks {
    type Item = Result<Bytes, std::convert::Infallible>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        if self.left == 0 {
            return std::task::Poll::Ready(None);
        }
        self.left -= 1;
        std::task::Poll::Ready(Some(Ok(self.chunk.clone())))
    }
}

/// `left` copies of `chunk`, then trailers (`Some`) or a failure (`None`).
struct ChunksThen {
    chunk: Bytes,
    left: usize,
    end: Option<Option<HeaderMap>>,
}

impl http_body::Body for ChunksThen {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if self.left > 0 {
            self.left -= 1;
            return std::task::Poll::Ready(Some(Ok(http_body::Frame::data(self.chunk.clone()))));
        }
        std::task::Poll::Ready(match self.end.take() {
            Some(Some(trailers)) => Some(Ok(http_body::Frame::trailers(trailers))),
            Some(None) => Some(Err(std::io::Error::other("the answer broke mid-stream"))),
            None => None,
        })
    }
}

/// The test handler's final business error: `409`, out of stock (of
/// `sku`, when it names one).
fn out_of_stock(sku: Option<&str>) -> Response {
    let mut problem = json!({"type": "https://example.test/problems/out-of-stock", "title": "Out of stock", "status": 409});
    if let Some(sku) = sku {
        problem["sku"] = json!(sku);
    }
    (
        StatusCode::CONFLICT,
        [("content-type", "application/problem+json")],
        problem.to_string(),
    )
        .into_response()
}

async fn create_order<DB: ConformanceDb>(
    State(st): State<AppState<DB>>,
    headers: HeaderMap,
    tx: Option<Tx<DB>>,
    ran: Option<Extension<Ran>>,
    Json(req): Json<OrderReq>,
) -> Response {
    let Some(tx) = tx else {
        // Not guarded: the handler runs its own transaction.
        st.executions.fetch_add(1, Ordering::SeqCst);
        let mut own = st.pool.begin().await.unwrap();
        let id = DB::insert_order(&mut own, "unguarded", req.amount)
            .await
            .unwrap();
        own.commit().await.unwrap();
        return (StatusCode::CREATED, Json(json!({"orderId": id}))).into_response();
    };
    let run = st.executions.fetch_add(1, Ordering::SeqCst);
    if let Some(Extension(ran)) = ran {
        ran.0.store(true, Ordering::SeqCst);
    }
    let principal = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .trim_start_matches("Bearer ")
        .to_string();
    let mut conn = tx.lock().unwrap();
    for sql in st.first {
        DB::exec_on(&mut conn, sql).await.unwrap();
    }
    // Handlers that write nothing on the claimed transaction: a quote
    // answered from a read, and a refusal decided before the first write.
    match req.mode.as_str() {
        "read_only" => {
            DB::exec_on(&mut conn, "SELECT COUNT(*) FROM orders")
                .await
                .unwrap();
            return (StatusCode::OK, Json(json!({"quote": req.amount}))).into_response();
        }
        "refuse_first" => return out_of_stock(None),
        _ => {}
    }
    let id = DB::insert_order(&mut conn, &principal, req.amount)
        .await
        .unwrap();
    if req.amount < 0 {
        // Validation after a write: the rejection must roll it back.
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            "amount must not be negative",
        )
            .into_response();
    }
    for item in &req.items {
        // A failed stock update (a serialization failure, a deadlock with
        // a concurrent request) is answered as handlers do: a problem, a
        // retryable `503` for a conflict, nothing committed.
        let taken = match DB::take_stock(&mut conn, &item.sku, item.qty).await {
            Ok(taken) => taken,
            Err(e) => return crate::HandlerError::from(e).into_response(),
        };
        if !taken {
            return out_of_stock(Some(&item.sku));
        }
    }
    // A nested transaction on the claimed one, as sqlx idioms (and the
    // libraries a handler calls) open them: a savepoint, whatever ends it.
    if let Some(end) = req.mode.strip_prefix("nested_") {
        let mut nested = sqlx::Connection::begin(&mut *conn).await.unwrap();
        DB::insert_order(&mut nested, "nested", 1).await.unwrap();
        match end {
            "commit" => nested.commit().await.unwrap(),
            "rollback" => nested.rollback().await.unwrap(),
            _ => drop(nested),
        }
    }
    if req.sleep_ms > 0 {
        tokio::time::sleep(Duration::from_millis(req.sleep_ms)).await;
    }
    match req.mode.as_str() {
        "fail500" => return (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response(),
        "panic" => panic!("handler panicked on purpose"),
        "mark_final" => {
            return (
                StatusCode::BAD_GATEWAY,
                Extension(Classification::FinalFailure),
                "declined upstream",
            )
                .into_response();
        }
        // A trailers-only gRPC answer: the status in the headers, no
        // message (`grpconly_<code>`), as a gRPC server sends an error.
        mode if mode.starts_with("grpconly_") => {
            let code = mode.trim_start_matches("grpconly_").to_string();
            return (
                StatusCode::OK,
                [
                    ("content-type", "application/grpc".to_string()),
                    ("grpc-status", code),
                    ("grpc-message", "stock%20short".to_string()),
                    // Custom metadata, as `Status::with_metadata` sends it.
                    ("x-reason", "stock".to_string()),
                ],
            )
                .into_response();
        }
        // A gRPC answer: HTTP 200, a message, `grpc-status` in the
        // trailers (`grpc_<code>`).
        mode if mode.starts_with("grpc_") => {
            let mut trailers = HeaderMap::new();
            let code = mode.trim_start_matches("grpc_").to_string();
            trailers.insert(
                "grpc-status",
                http::HeaderValue::from_str(&code).expect("a code"),
            );
            trailers.insert(
                "grpc-message",
                http::HeaderValue::from_static("from%20the%20handler"),
            );
            let body = WithTrailers {
                data: Some(Bytes::from(format!("\0\0\0\0\x08order-{id}"))),
                trailers: Some(trailers),
            };
            return (
                StatusCode::OK,
                [("content-type", "application/grpc")],
                axum::body::Body::new(body),
            )
                .into_response();
        }
        // An answer whose body ends with trailers (as gRPC's do).
        "trailers" => {
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
            trailers.insert("x-checksum", http::HeaderValue::from_static("sha256=abc"));
            let body = WithTrailers {
                data: Some(Bytes::from(json!({"orderId": id}).to_string())),
                trailers: Some(trailers),
            };
            return (
                StatusCode::CREATED,
                [("location", format!("/orders/{id}"))],
                axum::body::Body::new(body),
            )
                .into_response();
        }
        // An export-sized answer: 2 MiB in 64 KiB chunks, over the
        // default recording limit.
        "big" => {
            let chunks = Chunks {
                chunk: Bytes::from(vec![b'x'; 64 * 1024]),
                left: 32,
            };
            return (
                StatusCode::CREATED,
                [
                    ("location", format!("/orders/{id}")),
                    ("content-type", "application/octet-stream".to_string()),
                ],
                axum::body::Body::from_stream(chunks),
            )
                .into_response();
        }
        // The same, as a gRPC answer (a long server reply), ending `OK`.
        "big_grpc" => {
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
            let body = ChunksThen {
                chunk: Bytes::from(vec![b'x'; 64 * 1024]),
                left: 32,
                end: Some(Some(trailers)),
            };
            return (
                StatusCode::OK,
                [
                    ("location", format!("/orders/{id}")),
                    ("content-type", "application/grpc".to_string()),
                ],
                axum::body::Body::new(body),
            )
                .into_response();
        }
        // A `204` with a body (which HTTP does not send).
        "no_content_with_body" => {
            return (StatusCode::NO_CONTENT, "hello").into_response();
        }
        // 2 MiB over the recording limit, then a failure: a gRPC
        // `INTERNAL` in the trailers, or a broken HTTP body.
        "big_grpc_internal" | "big_broken" => {
            let grpc = req.mode == "big_grpc_internal";
            let end = if grpc {
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", http::HeaderValue::from_static("13"));
                Some(trailers)
            } else {
                None
            };
            let body = ChunksThen {
                chunk: Bytes::from(vec![b'x'; 64 * 1024]),
                left: 32,
                end: Some(end),
            };
            let (status, content_type) = if grpc {
                (StatusCode::OK, "application/grpc")
            } else {
                (StatusCode::CREATED, "application/octet-stream")
            };
            return (
                status,
                [("content-type", content_type)],
                axum::body::Body::new(body),
            )
                .into_response();
        }
        // Savepoints of the handler's own before a final business error,
        // one under the name the layer's savepoint had before ledger v8's
        // names were drawn per process.
        "own_savepoints_409" => {
            for sql in ["SAVEPOINT tower_idempotency_claimed", "SAVEPOINT step_1"] {
                DB::exec_on(&mut conn, sql).await.unwrap();
            }
            DB::insert_order(&mut conn, "after-savepoints", 1)
                .await
                .unwrap();
            return (
                StatusCode::CONFLICT,
                [("content-type", "application/problem+json")],
                r#"{"type":"https://example.test/problems/out-of-stock","status":409}"#,
            )
                .into_response();
        }
        "mark_retryable" => {
            return (
                StatusCode::CONFLICT,
                Extension(Classification::Transient),
                "try again",
            )
                .into_response();
        }
        "hold" => {
            drop(conn);
            let held = tx.clone();
            tokio::spawn(async move {
                let _guard = held.lock();
                tokio::time::sleep(Duration::from_millis(300)).await;
            });
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        "kill_connection" => {
            assert!(DB::kill_own_connection(&st.pool, &mut conn).await);
        }
        // The first run loses its connection, then answers only once a
        // duplicate has committed the key (within 10 s), as a request
        // whose transaction died while its answer was on its way.
        "kill_first_await_duplicate" if run == 0 => {
            assert!(DB::kill_own_connection(&st.pool, &mut conn).await);
            let recorded = "SELECT COUNT(*) FROM idempotency_records WHERE status = 'SUCCEEDED'";
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while DB::count(&st.pool, recorded).await == 0 && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        // The handler ends the claimed transaction itself: an explicit
        // COMMIT, then an answer the layer would roll back or record.
        "commit_503" => {
            DB::exec_on(&mut conn, "COMMIT").await.unwrap();
            return (StatusCode::SERVICE_UNAVAILABLE, "try later").into_response();
        }
        "commit_201" => DB::exec_on(&mut conn, "COMMIT").await.unwrap(),
        // ROLLBACK, then more writes (a handler "retrying" a deadlock by
        // hand): they autocommit, and the claim is gone.
        "rollback_201" => {
            DB::exec_on(&mut conn, "ROLLBACK").await.unwrap();
            DB::insert_order(&mut conn, "after-rollback", 1)
                .await
                .unwrap();
        }
        // As a deadlock victim's: the transaction is gone; then the pool
        // closes, so the ledger cannot be read afterwards.
        "rollback_pool_closed" => {
            DB::exec_on(&mut conn, "ROLLBACK").await.unwrap();
            let pool = st.pool.clone();
            tokio::spawn(async move { pool.close().await });
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        "commit_409" => {
            DB::exec_on(&mut conn, "COMMIT").await.unwrap();
            return (StatusCode::CONFLICT, "out of stock").into_response();
        }
        // The handler deletes the claim's own ledger row.
        "delete_ledger" => DB::exec_on(&mut conn, "DELETE FROM idempotency_records")
            .await
            .unwrap(),
        // ROLLBACK, then another request's claim of the same key holds its
        // row, uncommitted, past this answer (see `let_go`).
        "rollback_held_201" => {
            DB::exec_on(&mut conn, "ROLLBACK").await.unwrap();
            let key = headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let held = DB::hold_claim(&st.pool, &principal, "POST /orders", &key).await;
            hold(key, held);
        }
        // MySQL: autocommit turned back on, which commits the claimed
        // transaction (and would commit each later statement on its own).
        "autocommit_201" if DB::LABEL == "mysql" => {
            DB::exec_on(&mut conn, "SET autocommit = 1").await.unwrap();
        }
        // MySQL's DDL commits implicitly (elsewhere it is transactional).
        "ddl_201" if DB::LABEL == "mysql" => {
            DB::exec_on(&mut conn, "CREATE TABLE implicit_commit (id INT)")
                .await
                .unwrap()
        }
        _ => {}
    }
    let body = json!({"orderId": id, "principal": principal, "amount": req.amount});
    (
        StatusCode::CREATED,
        [
            ("location", format!("/orders/{id}")),
            ("x-attempt-nonce", format!("{}", rand_nonce())),
        ],
        Extension(ResourceId::new(id.to_string())),
        Json(body),
    )
        .into_response()
}

/// Set by the test handler when it runs for the request that carries it.
#[derive(Clone)]
struct Ran(Arc<std::sync::atomic::AtomicBool>);

/// In the claim-at-commit mode, takes back the count of a handler run that
/// was undone because its request lost at the unique constraint: the
/// handler ran for the request, and the layer answered from the ledger
/// (the replay, or a refusal for an existing record).
async fn undone_runs(
    executions: Arc<AtomicUsize>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
    req.extensions_mut().insert(Ran(Arc::clone(&ran)));
    let res = next.run(req).await;
    use crate::problem::ProblemKind;
    // Answered from the ledger: the recorded answer, or a refusal the
    // decision table gives for an existing record.
    let from_ledger = match res.extensions().get::<crate::IdempotencyOutcome>() {
        Some(crate::IdempotencyOutcome::Replayed) => true,
        Some(crate::IdempotencyOutcome::Refused { problem, .. }) => matches!(
            problem,
            ProblemKind::KeyReused
                | ProblemKind::InFlight
                | ProblemKind::Unconfirmed
                | ProblemKind::Expired
                | ProblemKind::Reconciling
        ),
        _ => false,
    };
    if ran.load(Ordering::SeqCst) && from_ledger {
        executions.fetch_sub(1, Ordering::SeqCst);
    }
    res
}

fn rand_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

impl<DB: ConformanceDb> std::fmt::Debug for Harness<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harness")
            .field("executions", &self.executions())
            .finish_non_exhaustive()
    }
}

impl<DB: ConformanceDb> Harness<DB> {
    /// A fresh database with the ledger and the test tables.
    pub async fn new() -> Self {
        let (pool, drop) = DB::fresh().await;
        Self {
            judge: pool.clone(),
            pool,
            executions: Arc::new(AtomicUsize::new(0)),
            environment: Environment::default(),
            at_commit: false,
            _drop: drop,
        }
    }

    /// A fresh database whose pooled connections, layer and handler live in
    /// `environment` (see [`environment`]).
    pub async fn in_environment(environment: Environment) -> Self {
        let (plain, drop) = DB::fresh().await;
        for sql in environment
            .session
            .setup
            .iter()
            .chain(environment.handler.setup)
        {
            DB::exec(&plain, sql).await;
        }
        let session = environment.session.statements;
        let pool = sqlx::pool::PoolOptions::<DB>::new()
            .max_connections(plain.options().get_max_connections())
            .acquire_timeout(plain.options().get_acquire_timeout())
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    for sql in session {
                        DB::exec_on(conn, sql).await?;
                    }
                    Ok(())
                })
            })
            .connect_with((*plain.connect_options()).clone())
            .await
            .unwrap();
        Self {
            pool,
            executions: Arc::new(AtomicUsize::new(0)),
            environment,
            at_commit: false,
            judge: plain,
            _drop: drop,
        }
    }

    /// A fresh database whose layers run in the claim-at-commit mode
    /// (`IdempotencyLayer::with_claim_at_commit`). There a duplicate's
    /// handler may run and be rolled back when it loses at the unique
    /// constraint: [`executions`](Self::executions) leaves out the runs
    /// whose request was then answered from the ledger (a replay, or a
    /// refusal for an existing record), so "the handler ran once" reads
    /// "one execution answered as the handler's", and every case still
    /// judges by the rows committed.
    pub async fn at_commit() -> Self {
        let mut h = Self::new().await;
        h.at_commit = true;
        h
    }

    /// The same database and counter, reached through `pool` instead (a
    /// pool through a [`relay`] or a proxy): the layer, the handler and the
    /// assertions all use it.
    pub fn with_pool(mut self, pool: Pool<DB>) -> Self {
        self.judge = pool.clone();
        self.pool = pool;
        self
    }

    /// The case's database in the server's default session, for the SQL
    /// a case runs itself to set up or to judge (`h.pool` is the
    /// environment's).
    pub fn plain(&self) -> &Pool<DB> {
        &self.judge
    }

    /// The default layer for these tests: Bearer-token principals.
    pub fn layer(&self) -> IdempotencyLayer<DB> {
        let layer = IdempotencyLayer::new(self.pool.clone())
            .with_principal(bearer)
            .with_isolation_level(self.environment.isolation);
        if self.at_commit {
            layer.with_claim_at_commit()
        } else {
            layer
        }
    }

    /// The test app behind the default layer.
    pub fn app(&self) -> Router {
        self.app_with(self.layer())
    }

    /// The test app behind `layer` (for cases that change configuration).
    pub fn app_with(&self, layer: IdempotencyLayer<DB>) -> Router {
        let app = Router::new()
            .route("/orders", post(create_order::<DB>).put(create_order::<DB>))
            .layer(layer)
            .with_state(AppState {
                pool: self.pool.clone(),
                executions: Arc::clone(&self.executions),
                first: self.environment.handler.statements,
            });
        self.judged(app)
    }

    /// `app` as the case judges it: in the claim-at-commit mode, a run of
    /// the test handler that was undone (its request lost at the unique
    /// constraint) is not counted in [`executions`](Self::executions).
    pub fn judged(&self, app: Router) -> Router {
        if self.at_commit {
            let executions = Arc::clone(&self.executions);
            app.layer(axum::middleware::from_fn(move |req, next| {
                undone_runs(Arc::clone(&executions), req, next)
            }))
        } else {
            app
        }
    }

    /// How many times the test handler ran.
    pub fn executions(&self) -> usize {
        self.executions.load(Ordering::SeqCst)
    }

    /// Committed order rows.
    pub async fn orders(&self) -> i64 {
        DB::count(&self.judge, "SELECT COUNT(*) FROM orders").await
    }

    /// Committed ledger rows.
    pub async fn ledger(&self) -> i64 {
        DB::count(&self.judge, "SELECT COUNT(*) FROM idempotency_records").await
    }

    /// Committed ledger rows with `status`.
    pub async fn ledger_with(&self, status: &str) -> i64 {
        let sql = match status {
            "SUCCEEDED" => "SELECT COUNT(*) FROM idempotency_records WHERE status = 'SUCCEEDED'",
            "FAILED_FINAL" => {
                "SELECT COUNT(*) FROM idempotency_records WHERE status = 'FAILED_FINAL'"
            }
            "PROCESSING" => "SELECT COUNT(*) FROM idempotency_records WHERE status = 'PROCESSING'",
            "EXPIRED" => "SELECT COUNT(*) FROM idempotency_records WHERE status = 'EXPIRED'",
            "NEEDS_RECONCILIATION" => {
                "SELECT COUNT(*) FROM idempotency_records WHERE status = 'NEEDS_RECONCILIATION'"
            }
            other => panic!("unknown status {other}"),
        };
        DB::count(&self.judge, sql).await
    }

    /// The committed ledger row of a scope, if any.
    pub async fn record(
        &self,
        principal: &str,
        operation: &str,
        key: &str,
    ) -> Option<crate::store::Record> {
        let scope = crate::store::Scope {
            principal,
            operation,
            key,
        };
        DB::fetch(&self.judge, &scope)
            .await
            .expect("a readable ledger")
    }

    /// Nothing at all was stored.
    pub async fn assert_nothing_stored(&self) {
        assert_eq!(self.orders().await, 0, "orders");
        assert_eq!(self.ledger().await, 0, "ledger rows");
    }
}

/// A request to `POST /orders`.
pub fn order(principal: Option<&str>, key: Option<&str>, body: &str) -> Request<axum::body::Body> {
    let mut b = Request::post("/orders").header("content-type", "application/json");
    if let Some(p) = principal {
        b = b.header("authorization", format!("Bearer {p}"));
    }
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(axum::body::Body::from(body.to_string())).unwrap()
}

/// A response read to the end.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The response status.
    pub status: StatusCode,
    /// The response headers.
    pub headers: HeaderMap,
    /// The response body, byte for byte.
    pub body: Bytes,
    /// The trailers the body ended with, if any.
    pub trailers: Option<HeaderMap>,
    /// What the layer reported it did, from the response extensions.
    pub outcome: Option<crate::IdempotencyOutcome>,
}

impl Answer {
    /// The body as JSON (`null` when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// The `type` of a problem document, after the `#`.
    pub fn problem(&self) -> String {
        assert_eq!(
            self.headers["content-type"], "application/problem+json",
            "not a problem: {self:?}"
        );
        let t = self.json()["type"].as_str().unwrap_or_default().to_string();
        t.rsplit('#').next().unwrap_or_default().to_string()
    }

    /// Whether the answer carries `Idempotent-Replayed: true`.
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

/// Sends `req` through `app` and reads the whole answer.
pub async fn send(app: &Router, req: Request<axum::body::Body>) -> Answer {
    let res = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    Answer {
        status: parts.status,
        outcome: parts.extensions.get().copied(),
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    }
}

/// Instantiates every conformance case as a `#[tokio::test]` in a module
/// named `$name`, for the database type `$db` (which implements
/// [`ConformanceDb`](crate::testkit::ConformanceDb)). With `setup = f`,
/// each case first calls the plain function `f()` (to start a proxy, say,
/// and point the backend at it with [`use_postgres_url`]).
#[macro_export]
#[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
macro_rules! conformance_suite {
    ($name:ident, $db:ty) => {
        $crate::conformance_suite!($name, $db, setup = $crate::testkit::no_setup);
    };
    ($name:ident, $db:ty, setup = $setup:path) => {
        $crate::conformance_suite!(@cases $name, $db, $setup, plain);
    };
    ($name:ident, $db:ty, at_commit) => {
        $crate::conformance_suite!(@at_commit_cases $name, $db, at_commit);
    };
    ($name:ident, $db:ty, at_commit_matrix) => {
        $crate::conformance_suite!(@at_commit_cases $name, $db, at_commit_matrix);
    };
    (@at_commit_cases $name:ident, $db:ty, $harness:ident) => {
        // The cases of the claim-first suite that hold in the
        // claim-at-commit mode, judged by the rows committed (see
        // `Harness::at_commit`). Left out: lease mode's and consumers'
        // cases (the mode is the HTTP layer's, refused with lease mode),
        // and the claim-first promises this mode gives up, each named in
        // `tests/conformance_at_commit.rs` with its reason.
        // `handler_that_ends_the_transaction_is_held_for_reconciliation`:
        // its retries of a key held for reconciliation run the handler
        // again (nothing holds the key before it), and that handler
        // commits by itself, an effect outside the rolled-back
        // transaction: the misuse this mode's contract excludes.
        // `a_grpc_timeout_bounds_the_wait_for_an_in_flight_duplicate`: the
        // handler runs before anything waits in this mode, and the case's
        // gRPC message is a body the test handler rejects (`415`, passed
        // through as the handler's own answer): the bound it checks is the
        // claim's wait, which this mode does not have.
        $crate::__shared_conformance_cases!($name, $db, $crate::testkit::no_setup, $harness;
            at_commit_a_retry_through_the_same_layer_does_not_run_the_handler,
        );
    };
    ($name:ident, $db:ty, matrix) => {
        $crate::conformance_suite!(@cases $name, $db, $crate::testkit::no_setup, matrix);
    };
    (@cases $name:ident, $db:ty, $setup:path, $harness:ident) => {
        // The shared cases, then those of the claim-first mode alone.
        $crate::__shared_conformance_cases!($name, $db, $setup, $harness;
            handler_that_ends_the_transaction_is_held_for_reconciliation,
            a_grpc_timeout_bounds_the_wait_for_an_in_flight_duplicate,
            the_key_status_look_up_says_where_a_key_stands,
            the_key_status_answer_is_the_replay_trailers_included,
            a_handler_that_deletes_its_ledger_row_commits_nothing,
            lease_first_payment_charges_once_and_replays,
            lease_charge_then_dropped_attempt_resumes_without_a_second_charge,
            lease_lost_provider_answer_is_recovered_in_the_same_attempt,
            lease_provider_failure_ends_the_lease_and_the_retry_charges_once,
            lease_decline_is_final_and_replayed,
            lease_unknown_outcome_parks_until_an_operator_resolves_it,
            lease_completer_recovers_a_parked_record,
            lease_stale_owner_is_refused_and_its_writes_are_not_kept,
            lease_concurrent_takeovers_exactly_one_wins,
            lease_is_renewed_during_a_long_step,
            lease_completer_finishes_an_abandoned_payment,
            lease_rejection_before_any_phase_frees_the_key,
            lease_step_without_lookup_parks_an_uncertain_outcome,
            lease_rejection_after_a_phase_is_not_resumed_by_the_completer,
            lease_stale_owner_rejection_is_not_passed_through,
            lease_completer_is_not_starved_by_unregistered_operations,
            lease_completer_pass_does_not_void_an_operator_resolution,
            lease_concurrent_steps_keep_each_pending_mark,
            lease_step_key_differs_for_a_reused_key,
            lease_phase_commit_renews_the_lease_from_commit_time,
            lease_phase_rolled_back_by_the_server_commits_nothing,
            lease_stale_owner_of_a_deleted_claim_charges_nothing,
            lease_final_answer_over_an_unrecovered_pending_step_parks,
            lease_stranded_records_are_listed_for_operators,
            lease_step_name_reused_in_one_attempt_is_refused,
            lease_operator_verdict_during_a_completer_pass_is_not_dropped,
            lease_settled_answer_is_replayable_for_the_full_retention,
            lease_parked_records_back_off_and_do_not_starve_the_completer,
            lease_undecodable_saved_data_is_parked_not_retaken,
            lease_takeover_nobody_waits_for_ends_its_lease,
            lease_call_provably_not_sent_ends_the_lease_without_parking,
            lease_blocked_renewal_does_not_freeze_the_step_timeout,
            lease_step_and_point_names_are_validated,
            lease_misuse_is_a_500_and_the_key_stays_claimable,
            lease_verdict_on_a_record_changed_since_its_listing_is_refused,
            lease_step_within_its_timeout_is_not_listed_as_stranded,
            consumer_applies_once_and_skips_duplicates,
            consumer_handler_error_then_redelivery_applies_once,
            consumer_concurrent_deliveries_apply_once,
            consumer_payload_mismatch_is_reported,
            consumer_swept_ids_stay_duplicates,
            consumer_as_a_tower_service_applies_once,
            consumer_lock_wait_bounds_a_concurrent_delivery,
            consumer_refuses_ids_the_store_cannot_hold,
            consumer_longest_durations_still_process,
            consumer_and_http_scopes_never_meet,
            consumer_nested_rollback_keeps_the_claim,
            consumer_handler_that_commits_itself_is_held,
            a_failed_read_after_a_server_rollback_never_holds_the_key,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __shared_conformance_cases {
    // The cases both modes run (the claim-at-commit suite is these alone),
    // then `$extra`.
    ($name:ident, $db:ty, $setup:path, $harness:ident; $($extra:ident),* $(,)?) => {
        $crate::__conformance_cases!($name, $db, $setup, $harness;
            first_request_commits_order_and_succeeded_row,
            retry_replays_byte_for_byte_without_executing,
            quoted_and_bare_key_are_the_same_key,
            missing_key_is_refused_and_nothing_stored,
            malformed_keys_are_refused_and_nothing_stored,
            missing_principal_is_refused_and_nothing_stored,
            oversized_body_is_refused_before_buffering,
            invalid_bodies_are_refused_and_nothing_stored,
            changed_payload_is_refused_with_422,
            mismatch_status_can_be_409,
            handler_rejection_rolls_back_and_key_stays_usable,
            final_business_error_records_failed_final_without_partial_writes,
            a_handler_that_writes_nothing_is_recorded_and_replayed,
            server_error_rolls_back_and_retry_runs_afresh,
            handler_can_mark_a_response_final_or_retryable,
            concurrent_duplicate_waits_then_replays,
            stuck_claim_is_bounded_then_in_flight_409,
            expired_record_is_refused_with_410,
            fifty_concurrent_duplicates_execute_once,
            other_principal_same_key_is_independent,
            dropped_future_commits_nothing,
            panicking_handler_commits_nothing,
            held_transaction_handle_commits_nothing,
            lost_connection_commits_nothing_and_retry_runs_once,
            a_lost_transaction_never_answers_an_order_that_did_not_commit,
            unguarded_methods_pass_through,
            answers_advertise_the_key_expiry,
            longest_retention_still_records_and_replays,
            hashed_keys_keep_the_guarantees,
            sweep_tombstones_expired_rows_and_purges_them_later,
            claims_run_while_a_large_sweep_runs,
            read_first_path_keeps_the_guarantees,
            duplicate_on_another_instance_waits_on_the_database_then_replays,
            long_principals_are_scoped_by_their_hash,
            waiting_duplicates_hold_no_pooled_connection,
            answer_lost_after_commit_is_replayed_not_re_executed,
            scopes_compare_byte_for_byte,
            literal_hash_principal_never_meets_a_long_one,
            path_spellings_are_one_operation,
            waiting_is_bounded_and_leaves_the_pool_to_others,
            busy_store_is_503_not_in_flight,
            nested_transactions_in_the_handler_are_savepoints,
            a_handlers_own_savepoints_never_keep_writes_of_a_final_error,
            stricter_isolation_keeps_the_guarantees,
            stricter_isolation_never_runs_a_finished_key_again,
            migrations_upgrade_in_place_and_run_concurrently,
            dropped_futures_leave_a_clean_connection,
            an_answer_over_the_recording_limit_commits_once_and_never_runs_again,
            a_grpc_answer_over_the_recording_limit_replays_as_already_exists,
            an_answer_that_fails_past_the_recording_limit_commits_nothing,
            trailers_are_recorded_and_replayed,
            grpc_answers_are_sorted_by_their_grpc_status,
            a_trailers_only_grpc_answer_replays_its_metadata,
            a_replay_is_well_framed_for_every_status,
            grpc_requests_get_trailers_only_grpc_refusals,
            fingerprinted_headers_tell_versions_apart,
            policies_give_records_their_own_retention_and_limits
            $(, $extra)*
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ($name:ident, $db:ty, $setup:path, $harness:ident; $($case:ident),* $(,)?) => {
        mod $name {
            $(
                #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    $setup();
                    let harness = $crate::__conformance_harness!($harness, $db, $case);
                    $crate::testkit::cases::$case(harness).await;
                }
            )*
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_harness {
    (plain, $db:ty, $case:ident) => {
        $crate::testkit::Harness::<$db>::new().await
    };
    (at_commit, $db:ty, $case:ident) => {
        $crate::testkit::Harness::<$db>::at_commit().await
    };
    (matrix, $db:ty, $case:ident) => {
        $crate::__conformance_harness!(@in_environment $db, stringify!($case))
    };
    (at_commit_matrix, $db:ty, $case:ident) => {{
        // Its own pick of the environment, apart from the claim-first
        // case's.
        let case = concat!(stringify!($case), " at commit");
        let mut harness = $crate::__conformance_harness!(@in_environment $db, case);
        harness.at_commit = true;
        harness
    }};
    (@in_environment $db:ty, $case:expr) => {{
        let seed = $crate::testkit::environment::seed();
        let label = <$db as $crate::testkit::ConformanceDb>::LABEL;
        let environment = $crate::testkit::Environment::of(label, $case, seed);
        // Printed with the case's failure: what to re-run.
        eprintln!(
            "environment matrix: {label}::{} under {environment} \
             (TOWER_IDEMPOTENCY_MATRIX_SEED={seed})",
            $case
        );
        $crate::testkit::Harness::<$db>::in_environment(environment).await
    }};
}
