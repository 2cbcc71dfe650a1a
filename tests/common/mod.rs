//! Shared test harness: a fresh database per test on real PostgreSQL, SQLite
//! (and MariaDB), and a small order service built on the layer.
#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

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
use tower_idempotency::{Backend, Classification, IdempotencyLayer, Principal, ResourceId, Tx};

/// What a test needs from a database besides the ledger.
pub trait TestDb: Backend + Sized {
    const LABEL: &'static str;
    /// A pool on a database of its own, with the ledger and the test tables,
    /// and the guard that drops it.
    fn fresh() -> impl Future<Output = (Pool<Self>, DropDb)> + Send;
    /// The URL of a new, empty database, and the guard that drops it.
    fn fresh_url() -> impl Future<Output = (String, DropDb)> + Send;
    fn insert_order(
        conn: &mut Self::Connection,
        principal: &str,
        amount: i64,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;
    fn take_stock(
        conn: &mut Self::Connection,
        sku: &str,
        qty: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
    fn set_stock(pool: &Pool<Self>, sku: &str, qty: i64) -> impl Future<Output = ()> + Send;
    fn stock(pool: &Pool<Self>, sku: &str) -> impl Future<Output = i64> + Send;
    fn count(pool: &Pool<Self>, sql: &'static str) -> impl Future<Output = i64> + Send;
    fn exec(pool: &Pool<Self>, sql: &'static str) -> impl Future<Output = ()> + Send;
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
}

static SEQ: AtomicUsize = AtomicUsize::new(0);

fn unique_name() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "ti_{}_{}_{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed),
        nanos
    )
}

/// Drops a test database when the test ends, even when it panics.
pub struct DropDb(Option<Box<dyn FnOnce() + Send>>);

impl Drop for DropDb {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            // Run outside the test's runtime, which may be shutting down.
            let _ = std::thread::spawn(f).join();
        }
    }
}

pub fn pg_admin_url() -> String {
    std::env::var("PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

pub fn mysql_admin_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

fn with_db(url: &str, db: &str) -> String {
    match url.rfind('/') {
        Some(i) if i > "postgres://".len() => format!("{}/{db}", &url[..i]),
        _ => format!("{url}/{db}"),
    }
}

const PG_SCHEMA: &str = "
CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, principal TEXT NOT NULL, amount BIGINT NOT NULL);
CREATE TABLE stock (sku TEXT PRIMARY KEY, qty BIGINT NOT NULL);";
const SQLITE_SCHEMA: &str = "
CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, principal TEXT NOT NULL, amount INTEGER NOT NULL);
CREATE TABLE stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL);";

impl TestDb for sqlx::Postgres {
    const LABEL: &'static str = "postgres";

    async fn fresh() -> (Pool<Self>, DropDb) {
        let (url, drop) = Self::fresh_url().await;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(20)
            .acquire_timeout(Duration::from_secs(20))
            .connect(&url)
            .await
            .unwrap();
        tower_idempotency::migrate(&pool).await.unwrap();
        sqlx::raw_sql(PG_SCHEMA).execute(&pool).await.unwrap();
        (pool, drop)
    }

    async fn fresh_url() -> (String, DropDb) {
        use sqlx::{Connection, Executor};
        let admin = pg_admin_url();
        let name = unique_name();
        let mut conn = sqlx::PgConnection::connect(&admin)
            .await
            .expect("PostgreSQL is not reachable: start it or set PG_URL");
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .unwrap();
        conn.close().await.unwrap();
        let url = with_db(&admin, &name);
        let drop = DropDb(Some(Box::new(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                if let Ok(mut c) = sqlx::PgConnection::connect(&admin).await {
                    let _ = c
                        .execute(sqlx::AssertSqlSafe(format!(
                            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                        )))
                        .await;
                }
            });
        })));
        (url, drop)
    }

    async fn insert_order(
        conn: &mut sqlx::PgConnection,
        principal: &str,
        amount: i64,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar("INSERT INTO orders (principal, amount) VALUES ($1, $2) RETURNING id")
            .bind(principal)
            .bind(amount)
            .fetch_one(conn)
            .await
    }

    async fn take_stock(
        conn: &mut sqlx::PgConnection,
        sku: &str,
        qty: i64,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query("UPDATE stock SET qty = qty - $1 WHERE sku = $2 AND qty >= $1")
            .bind(qty)
            .bind(sku)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn set_stock(pool: &Pool<Self>, sku: &str, qty: i64) {
        sqlx::query(
            "INSERT INTO stock (sku, qty) VALUES ($1, $2) ON CONFLICT (sku) DO UPDATE SET qty = $2",
        )
        .bind(sku)
        .bind(qty)
        .execute(pool)
        .await
        .unwrap();
    }

    async fn stock(pool: &Pool<Self>, sku: &str) -> i64 {
        sqlx::query_scalar("SELECT qty FROM stock WHERE sku = $1")
            .bind(sku)
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn count(pool: &Pool<Self>, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
    }

    async fn exec(pool: &Pool<Self>, sql: &'static str) {
        sqlx::raw_sql(sql).execute(pool).await.unwrap();
    }

    async fn hold_claim(
        pool: &Pool<Self>,
        principal: &str,
        operation: &str,
        key: &str,
    ) -> Transaction<'static, Self> {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at) VALUES ($1, $2, $3, '\\x00', 'PROCESSING', 0, 9000000000000)")
            .bind(principal).bind(operation).bind(key)
            .execute(&mut *tx).await.unwrap();
        tx
    }

    async fn kill_own_connection(pool: &Pool<Self>, conn: &mut sqlx::PgConnection) -> bool {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        sqlx::query("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .execute(pool)
            .await
            .unwrap();
        true
    }
}

impl TestDb for sqlx::Sqlite {
    const LABEL: &'static str = "sqlite";

    async fn fresh() -> (Pool<Self>, DropDb) {
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
        let (url, drop) = Self::fresh_url().await;
        let options = url
            .parse::<SqliteConnectOptions>()
            .unwrap()
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_millis(1000));
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .unwrap();
        tower_idempotency::migrate(&pool).await.unwrap();
        sqlx::raw_sql(SQLITE_SCHEMA).execute(&pool).await.unwrap();
        (pool, drop)
    }

    async fn fresh_url() -> (String, DropDb) {
        let path = std::env::temp_dir().join(format!("{}.db", unique_name()));
        let url = format!("sqlite://{}", path.display());
        let drop = DropDb(Some(Box::new(move || {
            for suffix in ["", "-wal", "-shm"] {
                let mut p = path.clone().into_os_string();
                p.push(suffix);
                let _ = std::fs::remove_file(p);
            }
        })));
        (url, drop)
    }

    async fn insert_order(
        conn: &mut sqlx::SqliteConnection,
        principal: &str,
        amount: i64,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar("INSERT INTO orders (principal, amount) VALUES (?, ?) RETURNING id")
            .bind(principal)
            .bind(amount)
            .fetch_one(conn)
            .await
    }

    async fn take_stock(
        conn: &mut sqlx::SqliteConnection,
        sku: &str,
        qty: i64,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query("UPDATE stock SET qty = qty - ?1 WHERE sku = ?2 AND qty >= ?1")
            .bind(qty)
            .bind(sku)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn set_stock(pool: &Pool<Self>, sku: &str, qty: i64) {
        sqlx::query(
            "INSERT INTO stock (sku, qty) VALUES (?1, ?2) ON CONFLICT (sku) DO UPDATE SET qty = ?2",
        )
        .bind(sku)
        .bind(qty)
        .execute(pool)
        .await
        .unwrap();
    }

    async fn stock(pool: &Pool<Self>, sku: &str) -> i64 {
        sqlx::query_scalar("SELECT qty FROM stock WHERE sku = ?")
            .bind(sku)
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn count(pool: &Pool<Self>, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
    }

    async fn exec(pool: &Pool<Self>, sql: &'static str) {
        sqlx::raw_sql(sql).execute(pool).await.unwrap();
    }

    async fn hold_claim(
        pool: &Pool<Self>,
        principal: &str,
        operation: &str,
        key: &str,
    ) -> Transaction<'static, Self> {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
        sqlx::query("INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at) VALUES (?, ?, ?, x'00', 'PROCESSING', 0, 9000000000000)")
            .bind(principal).bind(operation).bind(key)
            .execute(&mut *tx).await.unwrap();
        tx
    }

    async fn kill_own_connection(_pool: &Pool<Self>, _conn: &mut sqlx::SqliteConnection) -> bool {
        false
    }
}

#[cfg(feature = "mysql")]
const MYSQL_SCHEMA: &str = "
CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, principal VARCHAR(255) NOT NULL, amount BIGINT NOT NULL) ENGINE = InnoDB;
CREATE TABLE stock (sku VARCHAR(64) PRIMARY KEY, qty BIGINT NOT NULL) ENGINE = InnoDB;";

#[cfg(feature = "mysql")]
impl TestDb for sqlx::MySql {
    const LABEL: &'static str = "mysql";

    async fn fresh() -> (Pool<Self>, DropDb) {
        let (url, drop) = Self::fresh_url().await;
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(20)
            .acquire_timeout(Duration::from_secs(20))
            .connect(&url)
            .await
            .unwrap();
        tower_idempotency::migrate(&pool).await.unwrap();
        sqlx::raw_sql(MYSQL_SCHEMA).execute(&pool).await.unwrap();
        (pool, drop)
    }

    async fn fresh_url() -> (String, DropDb) {
        use sqlx::{Connection, Executor};
        let admin = mysql_admin_url();
        let name = unique_name();
        let mut conn = sqlx::MySqlConnection::connect(&admin)
            .await
            .expect("MariaDB is not reachable: start it or set MYSQL_URL");
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .unwrap();
        conn.close().await.unwrap();
        let url = with_db(&admin, &name);
        let drop = DropDb(Some(Box::new(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                if let Ok(mut c) = sqlx::MySqlConnection::connect(&admin).await {
                    let _ = c
                        .execute(sqlx::AssertSqlSafe(format!(
                            "DROP DATABASE IF EXISTS {name}"
                        )))
                        .await;
                }
            });
        })));
        (url, drop)
    }

    async fn insert_order(
        conn: &mut sqlx::MySqlConnection,
        principal: &str,
        amount: i64,
    ) -> Result<i64, sqlx::Error> {
        let done = sqlx::query("INSERT INTO orders (principal, amount) VALUES (?, ?)")
            .bind(principal)
            .bind(amount)
            .execute(conn)
            .await?;
        Ok(done.last_insert_id() as i64)
    }

    async fn take_stock(
        conn: &mut sqlx::MySqlConnection,
        sku: &str,
        qty: i64,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query("UPDATE stock SET qty = qty - ? WHERE sku = ? AND qty >= ?")
            .bind(qty)
            .bind(sku)
            .bind(qty)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn set_stock(pool: &Pool<Self>, sku: &str, qty: i64) {
        sqlx::query(
            "INSERT INTO stock (sku, qty) VALUES (?, ?) ON DUPLICATE KEY UPDATE qty = VALUES(qty)",
        )
        .bind(sku)
        .bind(qty)
        .execute(pool)
        .await
        .unwrap();
    }

    async fn stock(pool: &Pool<Self>, sku: &str) -> i64 {
        sqlx::query_scalar("SELECT qty FROM stock WHERE sku = ?")
            .bind(sku)
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn count(pool: &Pool<Self>, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
    }

    async fn exec(pool: &Pool<Self>, sql: &'static str) {
        sqlx::raw_sql(sql).execute(pool).await.unwrap();
    }

    async fn hold_claim(
        pool: &Pool<Self>,
        principal: &str,
        operation: &str,
        key: &str,
    ) -> Transaction<'static, Self> {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at) VALUES (?, ?, ?, x'00', 'PROCESSING', 0, 9000000000000)")
            .bind(principal).bind(operation).bind(key)
            .execute(&mut *tx).await.unwrap();
        tx
    }

    async fn kill_own_connection(pool: &Pool<Self>, conn: &mut sqlx::MySqlConnection) -> bool {
        let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL {id}")))
            .execute(pool)
            .await
            .unwrap();
        true
    }
}

/// One test's world: a fresh database, an execution counter, the app.
pub struct Harness<DB: TestDb> {
    pub pool: Pool<DB>,
    pub executions: Arc<AtomicUsize>,
    _drop: DropDb,
}

struct AppState<DB: TestDb> {
    pool: Pool<DB>,
    executions: Arc<AtomicUsize>,
}

impl<DB: TestDb> Clone for AppState<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            executions: Arc::clone(&self.executions),
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

async fn create_order<DB: TestDb>(
    State(st): State<AppState<DB>>,
    headers: HeaderMap,
    tx: Option<Tx<DB>>,
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
    st.executions.fetch_add(1, Ordering::SeqCst);
    let principal = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .trim_start_matches("Bearer ")
        .to_string();
    let mut conn = tx.lock().unwrap();
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
        if !DB::take_stock(&mut conn, &item.sku, item.qty)
            .await
            .unwrap()
        {
            let problem = json!({"type": "https://example.test/problems/out-of-stock", "title": "Out of stock", "status": 409, "sku": item.sku});
            return (
                StatusCode::CONFLICT,
                [("content-type", "application/problem+json")],
                problem.to_string(),
            )
                .into_response();
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

fn rand_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

impl<DB: TestDb> Harness<DB> {
    pub async fn new() -> Self {
        let (pool, drop) = DB::fresh().await;
        Self {
            pool,
            executions: Arc::new(AtomicUsize::new(0)),
            _drop: drop,
        }
    }

    /// The default layer for these tests: Bearer-token principals.
    pub fn layer(&self) -> IdempotencyLayer<DB> {
        IdempotencyLayer::new(self.pool.clone()).with_principal(bearer)
    }

    pub fn app(&self) -> Router {
        self.app_with(self.layer())
    }

    pub fn app_with(&self, layer: IdempotencyLayer<DB>) -> Router {
        Router::new()
            .route("/orders", post(create_order::<DB>).put(create_order::<DB>))
            .layer(layer)
            .with_state(AppState {
                pool: self.pool.clone(),
                executions: Arc::clone(&self.executions),
            })
    }

    pub fn executions(&self) -> usize {
        self.executions.load(Ordering::SeqCst)
    }

    pub async fn orders(&self) -> i64 {
        DB::count(&self.pool, "SELECT COUNT(*) FROM orders").await
    }

    pub async fn ledger(&self) -> i64 {
        DB::count(&self.pool, "SELECT COUNT(*) FROM idempotency_records").await
    }

    pub async fn ledger_with(&self, status: &str) -> i64 {
        let sql = match status {
            "SUCCEEDED" => "SELECT COUNT(*) FROM idempotency_records WHERE status = 'SUCCEEDED'",
            "FAILED_FINAL" => {
                "SELECT COUNT(*) FROM idempotency_records WHERE status = 'FAILED_FINAL'"
            }
            "PROCESSING" => "SELECT COUNT(*) FROM idempotency_records WHERE status = 'PROCESSING'",
            other => panic!("unknown status {other}"),
        };
        DB::count(&self.pool, sql).await
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
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
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

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

pub async fn send(app: &Router, req: Request<axum::body::Body>) -> Answer {
    let res = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// Instantiates each generic test once per backend.
#[macro_export]
macro_rules! backend_tests {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name(super::common::Harness::<sqlx::Postgres>::new().await).await;
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name(super::common::Harness::<sqlx::Sqlite>::new().await).await;
                }
            )*
        }
        #[cfg(feature = "mysql")]
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name(super::common::Harness::<sqlx::MySql>::new().await).await;
                }
            )*
        }
    };
}
