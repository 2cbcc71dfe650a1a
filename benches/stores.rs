//! The layer's cost on SQLite and MySQL/MariaDB, against the floor of its
//! design at the SQL level, in the same run.
//!
//! A transactional handler (insert an order, decrement one of 64 stock
//! rows, as in `bench/pg-limit`'s reference workload) is called in process
//! (no HTTP) by concurrent tasks in interleaved rounds, as:
//! - **bare**: the handler's own transaction;
//! - **the design by hand**: the statements the layer sends for a first
//!   execution, sent by the bench itself with nothing of the layer's Rust
//!   around them (SQLite: `BEGIN IMMEDIATE`, the claim's row inserted
//!   and a savepoint in one call, the handler, the savepoint released and
//!   the row updated with the answer in one call, `COMMIT`; MariaDB: the
//!   claim's one batch in place of the `BEGIN` with the row inserted and
//!   the savepoint, the handler, and the answer's update, its read and the
//!   `COMMIT` in one batch): the
//!   floor of the design, what no implementation of it can go below;
//! - **one row**: the bare transaction plus one finished ledger row before
//!   the `COMMIT` (what the claim-at-commit mode writes; it holds nothing
//!   before the handler);
//! - the layer's **first executions** and **replays**, and the claim-at-
//!   commit mode's first executions.
//!
//! Each prints its ratio to bare and its CPU per request by process: on
//! SQLite the bench process's `sqlx-sqlite-worker` threads (the database
//! engine) and its other threads (load, layer and handler); on MariaDB the
//! bench process and `mariadbd`. MySQL/MariaDB runs with `--features
//! mysql` against `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`).
//!
//! `cargo bench --bench stores [--features mysql]`; `TI_BENCH_PROFILE`
//! runs one route alone ([`profile`]), with its allocator calls per
//! request.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::{Request, Response};
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::{IdempotencyBody, IdempotencyLayer, Principal, Tx};

#[path = "support/allocations.rs"]
mod allocations;

#[global_allocator]
static ALLOCATOR: allocations::Counting = allocations::Counting;

const PHASE: Duration = Duration::from_secs(2);
const ROUNDS: usize = 2;
const CONCURRENCY: [usize; 3] = [1, 8, 64];

/// The handler's two statements for request `i`: an order, and one of the
/// 64 stock rows (`S-0` … `S-63`).
fn business(i: u64) -> [String; 2] {
    [
        "INSERT INTO orders (principal, amount) VALUES ('user-42', 12000)".to_owned(),
        format!("UPDATE stock SET qty = qty - 1 WHERE sku = 'S-{}'", i % 64),
    ]
}

/// Hex digits of `bytes`, for a blob literal.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A distinct key per call of a measured route.
fn fresh_key(i: u64) -> String {
    static RUN: AtomicU64 = AtomicU64::new(0);
    format!("k-{}-{i}", RUN.fetch_add(1, Ordering::Relaxed))
}

/// CPU time so far, in microseconds: this process's threads whose name
/// starts with `db_thread` (none for a server store), its other threads,
/// and every process named `db_process` (none for an embedded store).
fn cpu_now(db_thread: &str, db_process: &str) -> (f64, f64) {
    fn ticks(stat: &str) -> Option<(String, u64)> {
        let open = stat.find('(')?;
        let close = stat.rfind(')')?;
        let comm = stat[open + 1..close].to_string();
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        let utime: u64 = fields.get(11)?.parse().ok()?;
        let stime: u64 = fields.get(12)?.parse().ok()?;
        Some((comm, utime + stime))
    }
    let read =
        |path: std::path::PathBuf| std::fs::read_to_string(path).ok().and_then(|s| ticks(&s));
    // The process's total includes threads that have exited.
    let total = read("/proc/self/stat".into()).map_or(0, |(_, n)| n);
    let mut engine = 0u64;
    if !db_thread.is_empty()
        && let Ok(tasks) = std::fs::read_dir("/proc/self/task")
    {
        for t in tasks.flatten() {
            if let Some((comm, n)) = read(t.path().join("stat"))
                && comm.starts_with(db_thread)
            {
                engine += n;
            }
        }
    }
    if !db_process.is_empty()
        && let Ok(procs) = std::fs::read_dir("/proc")
    {
        for p in procs.flatten() {
            if let Some((comm, n)) = read(p.path().join("stat"))
                && comm == db_process
            {
                engine += n;
            }
        }
    }
    let us_per_tick = 1e6 / 100.0;
    (
        total.saturating_sub(if db_process.is_empty() { engine } else { 0 }) as f64 * us_per_tick,
        engine as f64 * us_per_tick,
    )
}

/// What a route measured over its rounds: requests, seconds, and CPU
/// microseconds of the bench process and of the database.
#[derive(Default, Clone, Copy)]
struct Tally {
    requests: u64,
    seconds: f64,
    process_us: f64,
    db_us: f64,
}

impl Tally {
    fn rps(&self) -> f64 {
        self.requests as f64 / self.seconds
    }
}

/// Runs `concurrency` tasks calling `call` for `PHASE`, into `tally`.
async fn run<F, Fut>(tally: &mut Tally, cpu: (&str, &str), concurrency: usize, call: F)
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    run_for(PHASE, tally, cpu, concurrency, call).await
}

/// [`run`] for `phase`.
async fn run_for<F, Fut>(
    phase: Duration,
    tally: &mut Tally,
    cpu: (&str, &str),
    concurrency: usize,
    call: F,
) where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let next = Arc::new(AtomicU64::new(0));
    let before = cpu_now(cpu.0, cpu.1);
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (call, next) = (call.clone(), Arc::clone(&next));
            tokio::spawn(async move {
                let mut done = 0u64;
                while started.elapsed() < phase {
                    call(next.fetch_add(1, Ordering::Relaxed)).await;
                    done += 1;
                }
                done
            })
        })
        .collect();
    for task in tasks {
        tally.requests += task.await.unwrap();
    }
    tally.seconds += started.elapsed().as_secs_f64();
    let after = cpu_now(cpu.0, cpu.1);
    tally.process_us += after.0 - before.0;
    tally.db_us += after.1 - before.1;
}

/// `TI_BENCH_PROFILE=bare|floor|one|layer|replay|commit` (with `TI_BENCH_CLIENTS`,
/// default 8, `TI_BENCH_SECS`, default 10, and `TI_BENCH_STORE=sqlite|mysql`):
/// one route alone, its row printed, for `perf record` beside it.
fn profile() -> Option<(String, usize, u64)> {
    let route = std::env::var("TI_BENCH_PROFILE").ok()?;
    let num = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    Some((
        route,
        num("TI_BENCH_CLIENTS", 8) as usize,
        num("TI_BENCH_SECS", 10),
    ))
}

/// The routes of one store at one concurrency, as table rows.
fn print_rows(store: &str, conc: usize, routes: &[(&str, Tally)]) {
    let bare = routes[0].1;
    let per = |t: &Tally, us: f64| us / t.requests as f64;
    let bare_cpu = per(&bare, bare.process_us + bare.db_us);
    for (name, t) in routes {
        let total = per(t, t.process_us + t.db_us);
        println!(
            "| {store} | {conc} | {name} | {:.0} | {:.2} | {:.0} | {:.0} | {:.2} |",
            t.rps(),
            t.rps() / bare.rps(),
            per(t, t.process_us),
            per(t, t.db_us),
            bare_cpu / total,
        );
    }
}

/// The layer on `$pool` (a pool of `$db`), in the default mode or
/// claiming at commit: a closure sending one request with the key and the
/// request number.
macro_rules! layered {
    ($db:ty, $pool:expr, $at_commit:expr) => {{
        let layer = IdempotencyLayer::new($pool.clone()).unscoped();
        let layer = if $at_commit {
            layer.with_claim_at_commit()
        } else {
            layer
        };
        let app = ServiceBuilder::new().layer(layer).service_fn(
            |req: Request<IdempotencyBody<String>>| async move {
                let i: u64 = req.headers()["x-n"].to_str().unwrap().parse().unwrap();
                let tx = req.extensions().get::<Tx<$db>>().cloned().unwrap();
                let mut conn = tx.lock().unwrap();
                for sql in business(i) {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut *conn)
                        .await
                        .unwrap();
                }
                Ok::<_, Infallible>(Response::builder().status(201).body(String::new()).unwrap())
            },
        );
        move |key: String, i: u64| {
            let mut app = app.clone();
            async move {
                let mut req = Request::post("/orders")
                    .header("idempotency-key", format!("\"{key}\""))
                    .header("x-n", i)
                    .body(String::new())
                    .unwrap();
                req.extensions_mut().insert(Principal::new("user-42"));
                let res = app.ready().await.unwrap().call(req).await.unwrap();
                assert_eq!(res.status(), 201);
            }
        }
    }};
}

/// Measures every route of `$store` at every concurrency and prints the
/// rows: `$bare`, `$design` and `$one_row` are closures of the request
/// number.
macro_rules! measure {
    ($store:expr, $cpu:expr, $db:ty, $pool:expr, $bare:expr, $design:expr, $one_row:expr) => {{
        let pool = $pool;
        let layered = layered!($db, pool, false);
        let at_commit = layered!($db, pool, true);
        layered("replayed".to_string(), 0).await;
        if let Some((route, conc, secs)) = profile() {
            // One route alone, for `perf record` beside it, its allocator
            // calls counted.
            let mut t = Tally::default();
            let phase = Duration::from_secs(secs);
            allocations::every_thread();
            let ((), calls, bytes) = allocations::count(async {
                match route.as_str() {
                    "bare" => run_for(phase, &mut t, $cpu, conc, $bare.clone()).await,
                    "floor" => run_for(phase, &mut t, $cpu, conc, $design.clone()).await,
                    "one" => run_for(phase, &mut t, $cpu, conc, $one_row.clone()).await,
                    "layer" => {
                        let first = layered.clone();
                        run_for(phase, &mut t, $cpu, conc, move |i| first(fresh_key(i), i)).await
                    }
                    "commit" => {
                        let first = at_commit.clone();
                        run_for(phase, &mut t, $cpu, conc, move |i| first(fresh_key(i), i)).await
                    }
                    "replay" => {
                        let replay = layered.clone();
                        run_for(phase, &mut t, $cpu, conc, move |_| {
                            replay("replayed".to_string(), 0)
                        })
                        .await
                    }
                    other => panic!("TI_BENCH_PROFILE: no route {other}"),
                }
            })
            .await;
            print_rows($store, conc, &[(route.as_str(), t)]);
            println!(
                "{}: per request, {:.0} allocator calls, {:.0} bytes requested (every thread of \
                 the bench process: the calls, the layer, the handler, sqlx; a layer's route also \
                 builds its HTTP request)",
                route,
                calls as f64 / t.requests as f64,
                bytes as f64 / t.requests as f64
            );
        } else {
            for conc in CONCURRENCY {
                let mut t = [Tally::default(); 6];
                for _ in 0..ROUNDS {
                    run(&mut t[0], $cpu, conc, $bare.clone()).await;
                    run(&mut t[1], $cpu, conc, $design.clone()).await;
                    run(&mut t[2], $cpu, conc, $one_row.clone()).await;
                    let first = layered.clone();
                    run(&mut t[3], $cpu, conc, move |i| first(fresh_key(i), i)).await;
                    let replay = layered.clone();
                    run(&mut t[4], $cpu, conc, move |_| {
                        replay("replayed".to_string(), 0)
                    })
                    .await;
                    let first = at_commit.clone();
                    run(&mut t[5], $cpu, conc, move |i| first(fresh_key(i), i)).await;
                }
                print_rows(
                    $store,
                    conc,
                    &[
                        ("bare", t[0]),
                        ("the design by hand (floor)", t[1]),
                        ("bare + one finished row", t[2]),
                        ("**layer, first execution**", t[3]),
                        ("layer, replay", t[4]),
                        ("claim at commit, first execution", t[5]),
                    ],
                );
            }
        }
    }};
}

#[tokio::main]
async fn main() {
    println!(
        "| store | clients | route | req/s | ratio to bare | bench process µs | database µs | CPU ratio to bare |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let only = std::env::var("TI_BENCH_STORE").unwrap_or_default();
    if only != "mysql" {
        sqlite().await;
    }
    #[cfg(feature = "mysql")]
    if only != "sqlite" {
        mysql().await;
    }
}

async fn sqlite() {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    let path = std::env::temp_dir().join(format!("ti_bench_{}.db", std::process::id()));
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal),
        )
        .await
        .unwrap();
    tower_idempotency::migrate(&pool).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, principal TEXT NOT NULL, amount INTEGER NOT NULL);
         CREATE TABLE stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL);
         WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 63)
         INSERT INTO stock SELECT 'S-' || i, 1000000000 FROM n;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let bare = {
        let pool = pool.clone();
        move |i: u64| {
            let pool = pool.clone();
            async move {
                let mut tx = pool.begin().await.unwrap();
                for sql in business(i) {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();
            }
        }
    };
    // The layer's statements for a first execution (src/store/sqlite.rs).
    const NOW: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)";
    let design = {
        let pool = pool.clone();
        move |i: u64| {
            let pool = pool.clone();
            async move {
                let key = fresh_key(i);
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
                let claim = format!(
                    "INSERT INTO main.idempotency_records (principal_id, operation, idem_key, \
                     request_fingerprint, status, created_at, expires_at) VALUES (?, ?, ?, ?, \
                     'PROCESSING', {NOW}, {NOW} + ?) \
                     ON CONFLICT (principal_id, operation, idem_key) DO NOTHING; \
                     SAVEPOINT bench"
                );
                let done = sqlx::query(sqlx::AssertSqlSafe(claim))
                    .bind("user-42")
                    .bind("POST /orders")
                    .bind(&key)
                    .bind(&[7u8; 32][..])
                    .bind(86_400_000i64)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                assert_eq!(done.rows_affected(), 1);
                for sql in business(i) {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                }
                let _: i64 = sqlx::query_scalar(
                    "RELEASE SAVEPOINT bench; \
                     UPDATE main.idempotency_records SET status = ?, response_status = ?, \
                     response_headers = ?, response_body = ?, resource_id = ? \
                     WHERE principal_id = ? AND operation = ? AND idem_key = ? RETURNING expires_at",
                )
                .bind("SUCCEEDED")
                .bind(201)
                .bind(&b""[..])
                .bind(&b""[..])
                .bind(None::<&str>)
                .bind("user-42")
                .bind("POST /orders")
                .bind(&key)
                .fetch_one(&mut *tx)
                .await
                .unwrap();
                tx.commit().await.unwrap();
            }
        }
    };
    let one_row = {
        let pool = pool.clone();
        move |i: u64| {
            let pool = pool.clone();
            async move {
                let key = fresh_key(i);
                let mut tx = pool.begin().await.unwrap();
                for sql in business(i) {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                }
                let row = format!(
                    "INSERT INTO main.idempotency_records (principal_id, operation, idem_key, \
                     request_fingerprint, status, response_status, response_headers, \
                     response_body, created_at, expires_at) VALUES (?, ?, ?, ?, 'SUCCEEDED', 201, \
                     X'', X'', {NOW}, {NOW} + ?) \
                     ON CONFLICT (principal_id, operation, idem_key) DO NOTHING RETURNING expires_at"
                );
                let _: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(row))
                    .bind("user-42")
                    .bind("POST /orders")
                    .bind(&key)
                    .bind(&[7u8; 32][..])
                    .bind(86_400_000i64)
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
            }
        }
    };
    measure!(
        "SQLite (WAL)",
        ("sqlx-sqlite", ""),
        sqlx::Sqlite,
        pool,
        bare,
        design,
        one_row
    );
    for suffix in ["", "-wal", "-shm"] {
        let mut p = path.clone().into_os_string();
        p.push(suffix);
        let _ = std::fs::remove_file(p);
    }
}

#[cfg(feature = "mysql")]
async fn mysql() {
    use sqlx::Connection;
    let admin =
        std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let db = format!("ti_bench_{}", std::process::id());
    let Ok(mut c) = sqlx::MySqlConnection::connect(&admin).await else {
        println!("\n(MySQL/MariaDB skipped: nothing answers on {admin})");
        return;
    };
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&mut c)
        .await
        .unwrap();
    let url = format!("{}/{db}", &admin[..admin.rfind('/').unwrap()]);
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(16)
        .connect(&url)
        .await
        .unwrap();
    tower_idempotency::migrate(&pool).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, principal VARCHAR(64) NOT NULL, amount BIGINT NOT NULL) ENGINE = InnoDB;
         CREATE TABLE stock (sku VARCHAR(16) PRIMARY KEY, qty BIGINT NOT NULL) ENGINE = InnoDB;
         INSERT INTO stock SELECT CONCAT('S-', seq), 1000000000 FROM seq_0_to_63;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let bare = {
        let pool = pool.clone();
        move |i: u64| {
            let pool = pool.clone();
            async move {
                let mut tx = pool.begin().await.unwrap();
                for sql in business(i) {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();
            }
        }
    };
    // The layer's batches for a first execution (src/store/mysql.rs),
    // without the per-statement lock wait and pinned session variables.
    const NOW: &str =
        "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)";
    let design = {
        let pool = pool.clone();
        move |i: u64| {
            let pool = pool.clone();
            async move {
                let (p, o, k) = (
                    hex(b"user-42"),
                    hex(b"POST /orders"),
                    hex(fresh_key(i).as_bytes()),
                );
                let scope =
                    format!("principal_id = X'{p}' AND operation = X'{o}' AND idem_key = X'{k}'");
                let mut conn = pool.acquire().await.unwrap();
                let claim = format!(
                    "SET autocommit = 0; SET TRANSACTION ISOLATION LEVEL READ COMMITTED; \
                     START TRANSACTION READ WRITE; INSERT INTO tower_idempotency_records \
                     (principal_id, operation, idem_key, request_fingerprint, status, created_at, \
                     expires_at) SELECT X'{p}', X'{o}', X'{k}', X'{}', 'PROCESSING', {NOW}, \
                     {NOW} + 86400000; SAVEPOINT bench",
                    hex(&[7u8; 32]),
                );
                sqlx::raw_sql(sqlx::AssertSqlSafe(claim))
                    .execute(&mut *conn)
                    .await
                    .unwrap();
                for sql in business(i) {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut *conn)
                        .await
                        .unwrap();
                }
                let finish = format!(
                    "RELEASE SAVEPOINT bench; UPDATE tower_idempotency_records SET status = 'SUCCEEDED', \
                     response_status = 201, response_headers = X'', response_body = X'', \
                     resource_id = NULL WHERE {scope}; \
                     SELECT expires_at FROM tower_idempotency_records WHERE {scope}; \
                     COMMIT; SET autocommit = 1"
                );
                let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(finish))
                    .fetch_all(&mut *conn)
                    .await
                    .unwrap();
                assert_eq!(rows.len(), 1);
            }
        }
    };
    let one_row = {
        let pool = pool.clone();
        move |i: u64| {
            let pool = pool.clone();
            async move {
                let mut tx = pool.begin().await.unwrap();
                let mut statements = business(i).to_vec();
                statements.push(format!(
                    "INSERT INTO tower_idempotency_records (principal_id, operation, idem_key, \
                     request_fingerprint, status, response_status, response_headers, \
                     response_body, created_at, expires_at) SELECT X'{}', X'{}', X'{}', X'{}', \
                     'SUCCEEDED', 201, X'', X'', {NOW}, {NOW} + 86400000",
                    hex(b"user-42"),
                    hex(b"POST /orders"),
                    hex(fresh_key(i).as_bytes()),
                    hex(&[7u8; 32]),
                ));
                for sql in statements {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();
            }
        }
    };
    measure!(
        "MariaDB",
        ("", "mariadbd"),
        sqlx::MySql,
        pool.clone(),
        bare,
        design,
        one_row
    );
    pool.close().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {db}")))
        .execute(&mut c)
        .await
        .unwrap();
}
