//! The layer's cost on SQLite and MySQL/MariaDB: a transactional handler
//! (insert an order, decrement one stock row) served bare and behind the
//! layer, called in process (no HTTP) by concurrent tasks in interleaved
//! rounds, and the ratio of first executions and replays to the bare
//! handler in the same run. MySQL/MariaDB runs with `--features mysql`
//! against `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`).
//!
//! `cargo bench --bench stores [--features mysql]`

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::{Request, Response};
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::{IdempotencyBody, IdempotencyLayer, Principal, Tx};

const PHASE: Duration = Duration::from_secs(2);
const ROUNDS: usize = 2;
const CONCURRENCY: [usize; 2] = [1, 8];
const INSERT: &str = "INSERT INTO orders (principal, amount) VALUES ('user-42', 12000)";
const DECREMENT: &str = "UPDATE stock SET qty = qty - 1 WHERE sku = 'A-10'";

/// Requests per second of `concurrency` tasks calling `call` for `PHASE`.
async fn rate<F, Fut>(concurrency: usize, call: F) -> f64
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (call, next) = (call.clone(), Arc::clone(&next));
            tokio::spawn(async move {
                let mut done = 0u64;
                while started.elapsed() < PHASE {
                    call(next.fetch_add(1, Ordering::Relaxed)).await;
                    done += 1;
                }
                done
            })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await.unwrap();
    }
    total as f64 / started.elapsed().as_secs_f64()
}

/// Bare, first execution and replay rates on `$pool` (a pool of `$db`),
/// printed as table rows labelled `$label`.
macro_rules! measure {
    ($label:expr, $db:ty, $pool:expr) => {{
        let pool = $pool;
        tower_idempotency::migrate(&pool).await.unwrap();
        let app = ServiceBuilder::new()
            .layer(IdempotencyLayer::new(pool.clone()).unscoped())
            .service_fn(|req: Request<IdempotencyBody<String>>| async move {
                let tx = req.extensions().get::<Tx<$db>>().cloned().unwrap();
                let mut conn = tx.lock().unwrap();
                for sql in [INSERT, DECREMENT] {
                    sqlx::raw_sql(sql).execute(&mut *conn).await.unwrap();
                }
                Ok::<_, Infallible>(Response::builder().status(201).body(String::new()).unwrap())
            });
        let layered = move |key: String| {
            let mut app = app.clone();
            async move {
                let mut req = Request::post("/orders")
                    .header("idempotency-key", format!("\"{key}\""))
                    .body(String::new())
                    .unwrap();
                req.extensions_mut().insert(Principal::new("user-42"));
                let res = app.ready().await.unwrap().call(req).await.unwrap();
                assert_eq!(res.status(), 201);
            }
        };
        let bare = {
            let pool = pool.clone();
            move |_: u64| {
                let pool = pool.clone();
                async move {
                    let mut tx = pool.begin().await.unwrap();
                    for sql in [INSERT, DECREMENT] {
                        sqlx::raw_sql(sql).execute(&mut *tx).await.unwrap();
                    }
                    tx.commit().await.unwrap();
                }
            }
        };
        let run = Arc::new(AtomicU64::new(0));
        layered("replayed".to_string()).await;
        for conc in CONCURRENCY {
            let (mut b, mut f, mut r) = (0.0, 0.0, 0.0);
            for _ in 0..ROUNDS {
                b += rate(conc, bare.clone()).await;
                let (first, run) = (layered.clone(), Arc::clone(&run));
                f += rate(conc, move |i| {
                    let n = run.fetch_add(1, Ordering::Relaxed);
                    first(format!("k-{n}-{i}"))
                })
                .await;
                let replay = layered.clone();
                r += rate(conc, move |_| replay("replayed".to_string())).await;
            }
            println!(
                "| {} | {conc} | {:.0} | {:.0} | {:.2} | {:.0} | {:.2} |",
                $label,
                b / ROUNDS as f64,
                f / ROUNDS as f64,
                f / b,
                r / ROUNDS as f64,
                r / b
            );
        }
    }};
}

#[tokio::main]
async fn main() {
    println!(
        "| store | concurrency | bare req/s | first execution req/s | ratio | replay req/s | ratio |"
    );
    println!("|---|---|---|---|---|---|---|");
    let path = std::env::temp_dir().join(format!("ti_bench_{}.db", std::process::id()));
    let sqlite = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(
            sqlx::sqlite::SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal),
        )
        .await
        .unwrap();
    sqlx::raw_sql(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, principal TEXT NOT NULL, amount INTEGER NOT NULL);
         CREATE TABLE stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL);
         INSERT INTO stock VALUES ('A-10', 1000000000);",
    )
    .execute(&sqlite)
    .await
    .unwrap();
    measure!("SQLite (WAL)", sqlx::Sqlite, sqlite);
    for suffix in ["", "-wal", "-shm"] {
        let mut p = path.clone().into_os_string();
        p.push(suffix);
        let _ = std::fs::remove_file(p);
    }
    #[cfg(feature = "mysql")]
    mysql().await;
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
    sqlx::raw_sql(
        "CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, principal VARCHAR(64) NOT NULL, amount BIGINT NOT NULL) ENGINE = InnoDB;
         CREATE TABLE stock (sku VARCHAR(16) PRIMARY KEY, qty BIGINT NOT NULL) ENGINE = InnoDB;
         INSERT INTO stock VALUES ('A-10', 1000000000);",
    )
    .execute(&pool)
    .await
    .unwrap();
    measure!("MariaDB", sqlx::MySql, pool.clone());
    pool.close().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {db}")))
        .execute(&mut c)
        .await
        .unwrap();
}
