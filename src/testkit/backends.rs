//! The built-in backends' conformance hooks: one database per case.

// With no built-in backend (the kit for a backend of your own), the helpers
// the built-in hooks share have no user.
#![cfg_attr(
    not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(dead_code, unused_imports, unused_macros)
)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::{Pool, Transaction};

use super::ConformanceDb;

/// The hooks whose code is the same on every built-in backend.
macro_rules! simple_queries {
    ($stock:expr) => {
        async fn stock(pool: &Pool<Self>, sku: &str) -> i64 {
            sqlx::query_scalar($stock)
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

        async fn exec_on(
            conn: &mut Self::Connection,
            sql: &'static str,
        ) -> Result<(), sqlx::Error> {
            sqlx::raw_sql(sql).execute(conn).await.map(drop)
        }
    };
}

/// The test app's statements for SQLite (`$N` parameters, `RETURNING`).
#[cfg(feature = "sqlite")]
macro_rules! order_statements {
    () => {
        async fn insert_order(
            conn: &mut Self::Connection,
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
            conn: &mut Self::Connection,
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
    };
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

/// Drops a test database when the case ends, even when it panics. (In a
/// mutex, never locked, only so that a harness can be shared between
/// tasks.)
pub struct Cleanup(std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>);

impl Cleanup {
    /// Runs `f` on a plain thread (outside the test's runtime) when dropped.
    pub fn new(f: impl FnOnce() + Send + 'static) -> Self {
        Self(std::sync::Mutex::new(Some(Box::new(f))))
    }
}

impl std::fmt::Debug for Cleanup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cleanup")
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let f = self
            .0
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(f) = f {
            // Run outside the test's runtime, which may be shutting down.
            let _ = std::thread::spawn(f).join();
        }
    }
}

/// The PostgreSQL server the built-in cases create databases on (`PG_URL`).
pub fn pg_admin_url() -> String {
    if let Some(url) = PG_URL_OVERRIDE.get() {
        return url.clone();
    }
    std::env::var("PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

static PG_URL_OVERRIDE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Sends every later PostgreSQL case of this process to the server at
/// `url` instead of `PG_URL`, such as a PgBouncer in front of it. The first
/// call wins; later calls change nothing.
pub fn use_postgres_url(url: impl Into<String>) {
    let _ = PG_URL_OVERRIDE.set(url.into());
}

/// The MySQL/MariaDB server the built-in cases create databases on (`MYSQL_URL`).
pub fn mysql_admin_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
fn with_db(url: &str, db: &str) -> String {
    // Keep the query (connection options such as the statement cache).
    let (base, query) = match url.find('?') {
        Some(q) => url.split_at(q),
        None => (url, ""),
    };
    match base.rfind('/') {
        Some(i) if i > "postgres://".len() => format!("{}/{db}{query}", &base[..i]),
        _ => format!("{base}/{db}{query}"),
    }
}

/// Expands to a new database on a server, as `(url, Cleanup)`; the cleanup
/// drops it (`$drop_suffix` is appended to `DROP DATABASE`). A macro, not a
/// generic function: sqlx's executor bounds do not hold across `await` in a
/// generic `Send` future.
#[cfg(any(feature = "postgres", feature = "mysql"))]
macro_rules! server_database {
    ($conn:ty, $admin:expr, $drop_suffix:expr) => {{
        use sqlx::{Connection, Executor};
        let admin: String = $admin;
        let name = unique_name();
        let mut conn = <$conn>::connect(&admin).await.unwrap_or_else(|e| {
            panic!("{admin} is not reachable ({e}): start the server or set PG_URL / MYSQL_URL")
        });
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .unwrap();
        conn.close().await.unwrap();
        let url = with_db(&admin, &name);
        let drop = Cleanup::new(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                if let Ok(mut c) = <$conn>::connect(&admin).await {
                    let sql = format!("DROP DATABASE IF EXISTS {name}{}", $drop_suffix);
                    let _ = c.execute(sqlx::AssertSqlSafe(sql)).await;
                }
            });
        });
        (url, drop)
    }};
}

/// Expands to a pool on a server database, with the ledger and the test tables.
#[cfg(any(feature = "postgres", feature = "mysql"))]
macro_rules! server_pool {
    ($db:ty, $url:expr, $schema:expr) => {{
        let pool = sqlx::pool::PoolOptions::<$db>::new()
            .max_connections(20)
            .acquire_timeout(Duration::from_secs(20))
            .connect($url)
            .await
            .unwrap();
        crate::migrate(&pool).await.unwrap();
        sqlx::raw_sql($schema).execute(&pool).await.unwrap();
        pool
    }};
}

#[cfg(feature = "postgres")]
const PG_SCHEMA: &str = "
CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, principal TEXT NOT NULL, amount BIGINT NOT NULL);
CREATE TABLE stock (sku TEXT PRIMARY KEY, qty BIGINT NOT NULL);";
#[cfg(feature = "sqlite")]
const SQLITE_SCHEMA: &str = "
CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, principal TEXT NOT NULL, amount INTEGER NOT NULL);
CREATE TABLE stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL);";

/// A PostgreSQL string literal for a test value (standard conforming
/// strings: only `'` needs doubling).
#[cfg(feature = "postgres")]
fn pg_lit(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// The first column of the first row of a literal statement.
#[cfg(feature = "postgres")]
async fn pg_scalar<'c, T>(
    conn: impl sqlx::Executor<'c, Database = sqlx::Postgres>,
    sql: String,
) -> Result<T, sqlx::Error>
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    use sqlx::Row;
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .fetch_one(conn)
        .await?
        .try_get(0)
}

/// PostgreSQL's hooks use the simple query protocol only (no prepared
/// statements), so the whole suite also runs through PgBouncer in
/// transaction pooling mode, whatever its version.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
impl ConformanceDb for sqlx::Postgres {
    const LABEL: &'static str = "postgres";

    async fn fresh() -> (Pool<Self>, Cleanup) {
        let (url, drop) = Self::fresh_url().await;
        (server_pool!(sqlx::Postgres, &url, PG_SCHEMA), drop)
    }

    async fn fresh_url() -> (String, Cleanup) {
        server_database!(sqlx::PgConnection, pg_admin_url(), " WITH (FORCE)")
    }

    async fn insert_order(
        conn: &mut sqlx::PgConnection,
        principal: &str,
        amount: i64,
    ) -> Result<i64, sqlx::Error> {
        let sql = format!(
            "INSERT INTO orders (principal, amount) VALUES ({}, {amount}) RETURNING id",
            pg_lit(principal)
        );
        pg_scalar(conn, sql).await
    }

    async fn take_stock(
        conn: &mut sqlx::PgConnection,
        sku: &str,
        qty: i64,
    ) -> Result<bool, sqlx::Error> {
        let sql = format!(
            "UPDATE stock SET qty = qty - {qty} WHERE sku = {} AND qty >= {qty}",
            pg_lit(sku)
        );
        let done = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn set_stock(pool: &Pool<Self>, sku: &str, qty: i64) {
        let sql = format!(
            "INSERT INTO stock (sku, qty) VALUES ({}, {qty}) ON CONFLICT (sku) DO UPDATE SET qty = {qty}",
            pg_lit(sku)
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(pool)
            .await
            .unwrap();
    }

    async fn stock(pool: &Pool<Self>, sku: &str) -> i64 {
        let sql = format!("SELECT qty FROM stock WHERE sku = {}", pg_lit(sku));
        pg_scalar(pool, sql).await.unwrap()
    }

    async fn count(pool: &Pool<Self>, sql: &'static str) -> i64 {
        pg_scalar(pool, sql.to_string()).await.unwrap()
    }

    async fn exec(pool: &Pool<Self>, sql: &'static str) {
        sqlx::raw_sql(sql).execute(pool).await.unwrap();
    }

    async fn exec_on(conn: &mut sqlx::PgConnection, sql: &'static str) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(sql).execute(conn).await.map(drop)
    }

    async fn hold_claim(
        pool: &Pool<Self>,
        principal: &str,
        operation: &str,
        key: &str,
    ) -> Transaction<'static, Self> {
        let mut tx = pool.begin().await.unwrap();
        // As a claim holds a scope: its advisory lock (see
        // `store::postgres::scope_lock`), and an uncommitted row.
        let (k1, k2) = crate::store::scope_lock(&crate::store::Scope {
            principal,
            operation,
            key,
        });
        let sql = format!(
            "SELECT pg_advisory_xact_lock({k1}, {k2}); \
             INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, \
             status, created_at, expires_at) VALUES ({p}, {o}, {k}, decode('00', 'hex'), 'PROCESSING', 0, 9000000000000)",
            p = pg_lit(principal),
            o = pg_lit(operation),
            k = pg_lit(key)
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&mut *tx)
            .await
            .unwrap();
        tx
    }

    async fn kill_own_connection(pool: &Pool<Self>, conn: &mut sqlx::PgConnection) -> bool {
        let pid: i32 = pg_scalar(&mut *conn, "SELECT pg_backend_pid()".into())
            .await
            .unwrap();
        let sql = format!("SELECT pg_terminate_backend({pid})");
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(pool)
            .await
            .unwrap();
        true
    }

    async fn seed_expired(pool: &Pool<Self>, n: u32) {
        let sql = format!(
            "INSERT INTO idempotency_records SELECT 'bulk', 'op', 'k' || g, decode('00', 'hex'), \
             'SUCCEEDED', 201, NULL, 'stored response body', NULL, 0, 1 \
             FROM generate_series(1, {n}) AS g"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(pool)
            .await
            .unwrap();
    }
}

#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
impl ConformanceDb for sqlx::Sqlite {
    simple_queries!("SELECT qty FROM stock WHERE sku = $1");
    order_statements!();

    const LABEL: &'static str = "sqlite";

    async fn fresh() -> (Pool<Self>, Cleanup) {
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
        crate::migrate(&pool).await.unwrap();
        sqlx::raw_sql(SQLITE_SCHEMA).execute(&pool).await.unwrap();
        (pool, drop)
    }

    async fn fresh_url() -> (String, Cleanup) {
        let path = std::env::temp_dir().join(format!("{}.db", unique_name()));
        let url = format!("sqlite://{}", path.display());
        let drop = Cleanup::new(move || {
            for suffix in ["", "-wal", "-shm"] {
                let mut p = path.clone().into_os_string();
                p.push(suffix);
                let _ = std::fs::remove_file(p);
            }
        });
        (url, drop)
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

    async fn seed_expired(pool: &Pool<Self>, n: u32) {
        sqlx::query(
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < ?) \
                     INSERT INTO idempotency_records SELECT 'bulk', 'op', 'k' || x, x'00', \
                     'SUCCEEDED', 201, NULL, 'stored response body', NULL, 0, 1, 0, NULL, NULL, NULL, NULL, NULL, 0, NULL FROM c",
        )
        .bind(i64::from(n))
        .execute(pool)
        .await
        .unwrap();
    }
}

#[cfg(feature = "mysql")]
const MYSQL_SCHEMA: &str = "
CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, principal TEXT NOT NULL, amount BIGINT NOT NULL) ENGINE = InnoDB;
CREATE TABLE stock (sku VARCHAR(64) PRIMARY KEY, qty BIGINT NOT NULL) ENGINE = InnoDB;";

#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
impl ConformanceDb for sqlx::MySql {
    simple_queries!("SELECT qty FROM stock WHERE sku = ?");

    const LABEL: &'static str = "mysql";

    async fn fresh() -> (Pool<Self>, Cleanup) {
        let (url, drop) = Self::fresh_url().await;
        (server_pool!(sqlx::MySql, &url, MYSQL_SCHEMA), drop)
    }

    async fn fresh_url() -> (String, Cleanup) {
        server_database!(sqlx::MySqlConnection, mysql_admin_url(), "")
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

    async fn hold_claim(
        pool: &Pool<Self>,
        principal: &str,
        operation: &str,
        key: &str,
    ) -> Transaction<'static, Self> {
        let mut tx = pool.begin().await.unwrap();
        // The table, not the view named `idempotency_records`: a pooled
        // connection may hold a handler's temporary table of that name.
        sqlx::query("INSERT INTO tower_idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at) VALUES (?, ?, ?, x'00', 'PROCESSING', 0, 9000000000000)")
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

    async fn seed_expired(pool: &Pool<Self>, n: u32) {
        // MariaDB's sequence engine: seq_1_to_N is a table of 1..=N.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "INSERT INTO tower_idempotency_records SELECT 'bulk', 'op', CONCAT('k', seq), x'00', \
             'SUCCEEDED', 201, NULL, 'stored response body', NULL, 0, 1, 0, NULL, NULL, NULL, NULL, \
             NULL, 0, NULL FROM seq_1_to_{n}"
        )))
        .execute(pool)
        .await
        .unwrap();
    }
}
