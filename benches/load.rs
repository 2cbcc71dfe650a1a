//! What the guarantee costs: the layered create-order against the same
//! business transaction without the layer, measured in one run on
//! PostgreSQL, over loopback HTTP, at concurrency 1, 8 and 64.
//!
//! ```sh
//! cargo bench --bench load            # PG_URL overrides the server
//! ```
//!
//! Prints a table (throughput, p50/p99, ratio to the baseline), database work
//! per request from `pg_stat_database`, round trips and WAL bytes per
//! request (counted by a TCP relay between the service and PostgreSQL, see
//! `relay.rs`), the same comparison with the database at a distance (the
//! relay delays each direction, `TI_BENCH_DISTANCE_US`, 250 µs by default),
//! a duplicate-storm check, the peak RSS of the example service under 1 000
//! concurrent 64 KiB requests, and writes `docs/throughput.svg`. Every phase
//! is bounded by time and count.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Connection, Executor, PgConnection, Postgres};
use tower_idempotency::{IdempotencyLayer, Principal, Tx};

// The bench counts and delays; the relay's cuts (and their unit tests, which
// a harness-less bench never runs) go unused here.
#[path = "../src/testkit/relay.rs"]
#[allow(dead_code, unused_imports)]
mod relay;

#[allow(dead_code)]
#[path = "../tests/common/pg_log.rs"]
mod pg_log;

#[path = "support/allocations.rs"]
mod allocations;

#[global_allocator]
static ALLOCATOR: allocations::Counting = allocations::Counting;

const PHASE: Duration = Duration::from_secs(3);
const ROUNDS: usize = 2;
const MAX_REQUESTS: u64 = 200_000;
const CONCURRENCY: [usize; 3] = [1, 8, 64];
const ORDER: &str = r#"{"currency":"KRW","items":[{"sku":"A-10","qty":1}],"amount":12000}"#;
/// An order that meets an empty shelf: a final business error (`409`).
const SHORT: &str = r#"{"currency":"KRW","items":[{"sku":"EMPTY","qty":1}],"amount":12000}"#;

#[derive(Deserialize)]
struct CreateOrder {
    currency: String,
    items: Vec<Item>,
    amount: i64,
}

#[derive(Deserialize)]
struct Item {
    sku: String,
    qty: i64,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The example's create-order business writes: order, items, stock.
async fn business(
    conn: &mut PgConnection,
    principal: &str,
    order: &CreateOrder,
) -> sqlx::Result<Response> {
    let id = format!("o-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
    sqlx::query("INSERT INTO orders (id, principal, currency, amount) VALUES ($1, $2, $3, $4)")
        .bind(&id)
        .bind(principal)
        .bind(&order.currency)
        .bind(order.amount)
        .execute(&mut *conn)
        .await?;
    for (line, item) in (1i64..).zip(&order.items) {
        sqlx::query("INSERT INTO order_items (order_id, line, sku, qty) VALUES ($1, $2, $3, $4)")
            .bind(&id)
            .bind(line)
            .bind(&item.sku)
            .bind(item.qty)
            .execute(&mut *conn)
            .await?;
        let done = sqlx::query("UPDATE stock SET qty = qty - $1 WHERE sku = $2 AND qty >= $1")
            .bind(item.qty)
            .bind(&item.sku)
            .execute(&mut *conn)
            .await?;
        if done.rows_affected() != 1 {
            return Ok((StatusCode::CONFLICT, "out of stock").into_response());
        }
    }
    let body = serde_json::json!({"orderId": id, "principal": principal, "amount": order.amount});
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

async fn bare(State(pool): State<PgPool>, Json(order): Json<CreateOrder>) -> Response {
    let run = async {
        let mut tx = pool.begin().await?;
        let res = business(&mut tx, "user-42", &order).await?;
        tx.commit().await?;
        Ok::<_, sqlx::Error>(res)
    };
    run.await
        .unwrap_or_else(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response())
}

async fn layered(tx: Tx<Postgres>, Json(order): Json<CreateOrder>) -> Response {
    let Ok(mut conn) = tx.lock() else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    business(&mut conn, "user-42", &order)
        .await
        .unwrap_or_else(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response())
}

/// The layer of the layered routes. Every route serves one principal,
/// `user-42`; the layer is told it through its own hook, so that its routes
/// carry no middleware the others lack (an authentication middleware would
/// sit in front of every route alike).
fn idempotency(pool: &PgPool) -> IdempotencyLayer<Postgres> {
    IdempotencyLayer::new(pool.clone()).with_principal(|_| Some(Principal::new("user-42")))
}

/// What serves `POST /orders`: the bare transaction, the layer as built,
/// or a candidate ledger design written by hand around the same business
/// writes (for its cost only: no waits, no classification, no replay).
#[derive(Clone, Copy, PartialEq)]
enum Route {
    Bare,
    Layer,
    /// Ledger v6 (the release before): the claim and recording functions,
    /// called in one simple query each with literal arguments, the claim
    /// riding with `BEGIN`, the recording with `COMMIT`, on a raw connection.
    V6,
    /// Two prepared writes on a sqlx transaction: the `PROCESSING` row at
    /// the claim, updated before the `COMMIT`.
    TwoWrites,
    /// The layer in the claim-at-commit mode (`with_claim_at_commit`): no
    /// claim statement, one ledger row written before the `COMMIT`.
    AtCommit,
    /// One prepared write on a sqlx transaction: the finished row inserted
    /// before the `COMMIT` (claim at commit's shape, written by hand).
    OneWrite,
}

fn app(pool: PgPool, route: Route) -> Router {
    match route {
        Route::Layer => Router::new()
            .route("/orders", post(layered).layer(idempotency(&pool)))
            .with_state(pool),
        Route::AtCommit => Router::new()
            .route(
                "/orders",
                post(layered).layer(idempotency(&pool).with_claim_at_commit()),
            )
            .with_state(pool),
        Route::Bare => Router::new().route("/orders", post(bare)).with_state(pool),
        Route::V6 => Router::new()
            .route("/orders", post(candidate_v6))
            .with_state(pool),
        Route::TwoWrites => Router::new()
            .route("/orders", post(candidate_two_writes))
            .with_state(pool),
        Route::OneWrite => Router::new()
            .route("/orders", post(candidate_one_write))
            .with_state(pool),
    }
}

fn key_of(headers: &http::HeaderMap) -> String {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none")
        .to_string()
}

/// The recorded answer's body, as a candidate stores it.
const ANSWER: &[u8] = br#"{"orderId":"o-1","principal":"user-42","amount":12000}"#;

async fn candidate_v6(
    State(pool): State<PgPool>,
    headers: http::HeaderMap,
    Json(order): Json<CreateOrder>,
) -> Response {
    // The bench's own keys are `k-<digits>`: nothing to escape.
    let key = key_of(&headers);
    let run = async {
        let mut conn = pool.acquire().await?;
        let claim = format!(
            "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; \
             SELECT claimed FROM tower_idempotency_claim(E'user-42', E'POST /orders', E'{key}', \
             E'\\\\x{fp}'::bytea, 86400000, 50); BEGIN; SAVEPOINT tower_idempotency_claimed",
            fp = "ab".repeat(32),
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(claim))
            .fetch_one(&mut *conn)
            .await?;
        let res = business(&mut conn, "user-42", &order).await?;
        let body: String = ANSWER.iter().map(|b| format!("{b:02x}")).collect();
        let finish = format!(
            "RELEASE SAVEPOINT tower_idempotency_claimed; \
             SELECT tower_idempotency_finish(E'user-42', E'POST /orders', E'{key}', 'SUCCEEDED', \
             201, E'\\\\x'::bytea, E'\\\\x{body}'::bytea, NULL), txid_current(); COMMIT"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(finish))
            .fetch_all(&mut *conn)
            .await?;
        Ok::<_, sqlx::Error>(res)
    };
    run.await
        .unwrap_or_else(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response())
}

async fn candidate_two_writes(
    State(pool): State<PgPool>,
    headers: http::HeaderMap,
    Json(order): Json<CreateOrder>,
) -> Response {
    let key = key_of(&headers);
    let run = async {
        let mut tx = pool.begin().await?;
        sqlx::query(
            "INSERT INTO idempotency_records (principal_id, operation, idem_key, \
             request_fingerprint, status, created_at, expires_at) VALUES ($1, $2, $3, $4, \
             'PROCESSING', (EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT, \
             (EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT + $5) \
             ON CONFLICT DO NOTHING",
        )
        .bind("user-42")
        .bind("POST /orders")
        .bind(&key)
        .bind(&[0xab_u8; 32][..])
        .bind(86_400_000_i64)
        .execute(&mut *tx)
        .await?;
        let res = business(&mut tx, "user-42", &order).await?;
        sqlx::query(
            "UPDATE idempotency_records SET status = 'SUCCEEDED', response_status = 201, \
             response_headers = $4, response_body = $5 \
             WHERE principal_id = $1 AND operation = $2 AND idem_key = $3",
        )
        .bind("user-42")
        .bind("POST /orders")
        .bind(&key)
        .bind(&b""[..])
        .bind(ANSWER)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok::<_, sqlx::Error>(res)
    };
    run.await
        .unwrap_or_else(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response())
}

async fn candidate_one_write(
    State(pool): State<PgPool>,
    headers: http::HeaderMap,
    Json(order): Json<CreateOrder>,
) -> Response {
    let key = key_of(&headers);
    let run = async {
        let mut tx = pool.begin().await?;
        let res = business(&mut tx, "user-42", &order).await?;
        sqlx::query(
            "INSERT INTO idempotency_records (principal_id, operation, idem_key, \
             request_fingerprint, status, response_status, response_headers, response_body, \
             created_at, expires_at) VALUES ($1, $2, $3, $4, 'SUCCEEDED', 201, $5, $6, \
             (EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT, \
             (EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT + $7) \
             ON CONFLICT DO NOTHING RETURNING expires_at",
        )
        .bind("user-42")
        .bind("POST /orders")
        .bind(&key)
        .bind(&[0xab_u8; 32][..])
        .bind(&b""[..])
        .bind(ANSWER)
        .bind(86_400_000_i64)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok::<_, sqlx::Error>(res)
    };
    run.await
        .unwrap_or_else(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response())
}

/// A server on its own pool; closing the pool flushes its backends' stats.
struct Server {
    addr: std::net::SocketAddr,
    pool: PgPool,
    task: tokio::task::JoinHandle<()>,
}

/// The service's own runtime, on threads named `svc`, so that its CPU is
/// told apart from the load generator's in the same process.
fn service_runtime() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("svc")
            .on_thread_start(allocations::service_thread)
            .enable_all()
            .build()
            .unwrap()
    })
}

async fn serve(url: &str, route: Route) -> Server {
    let url = url.to_string();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task = service_runtime().spawn(async move {
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .connect(&url)
            .await
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = app(pool.clone(), route);
        let _ = tx.send((addr, pool));
        axum::serve(listener, router).await.unwrap();
    });
    let (addr, pool) = rx.await.unwrap();
    Server { addr, pool, task }
}

/// CPU time so far, in microseconds: this process's `svc` threads (the
/// service), its other threads (the load generator), and every PostgreSQL
/// process (backends and the server's own).
fn cpu_now() -> (f64, f64, f64) {
    fn ticks(stat: &str) -> Option<(String, u64)> {
        let open = stat.find('(')?;
        let close = stat.rfind(')')?;
        let comm = stat[open + 1..close].to_string();
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        let utime: u64 = fields.get(11)?.parse().ok()?;
        let stime: u64 = fields.get(12)?.parse().ok()?;
        Some((comm, utime + stime))
    }
    let us_per_tick = 1e6 / 100.0;
    let (mut svc, mut other) = (0u64, 0u64);
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for t in tasks.flatten() {
            if let Some((comm, n)) = std::fs::read_to_string(t.path().join("stat"))
                .ok()
                .and_then(|s| ticks(&s))
            {
                if comm.starts_with("svc") {
                    svc += n;
                } else {
                    other += n;
                }
            }
        }
    }
    let mut pg = 0u64;
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for p in procs.flatten() {
            if let Some((comm, n)) = std::fs::read_to_string(p.path().join("stat"))
                .ok()
                .and_then(|s| ticks(&s))
                && comm.starts_with("postgres")
            {
                pg += n;
            }
        }
    }
    (
        svc as f64 * us_per_tick,
        other as f64 * us_per_tick,
        pg as f64 * us_per_tick,
    )
}

impl Server {
    async fn stop(self) {
        self.task.abort();
        self.pool.close().await;
    }
}

#[derive(Clone, Copy)]
enum Keys {
    None,
    Unique,
    One,
}

struct Run {
    requests: u64,
    elapsed: Duration,
    latencies: Vec<Duration>,
    statuses: std::collections::BTreeMap<u16, u64>,
}

impl Run {
    fn absorb(&mut self, other: Run) {
        self.requests += other.requests;
        self.elapsed += other.elapsed;
        self.latencies.extend(other.latencies);
        for (k, v) in other.statuses {
            *self.statuses.entry(k).or_insert(0) += v;
        }
    }

    fn rps(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }
    fn pct(&self, p: f64) -> Duration {
        let mut l = self.latencies.clone();
        l.sort_unstable();
        l.get(((l.len() as f64 * p) as usize).min(l.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    }
}

static KEY_SEQ: AtomicU64 = AtomicU64::new(0);

/// `POST /orders` with `body`, keyed as `keys` says.
fn order_request(keys: Keys, body: &'static str) -> Request<Full<Bytes>> {
    let mut req = Request::post("/orders")
        .header("host", "bench")
        .header("content-type", "application/json");
    match keys {
        Keys::None => {}
        Keys::Unique => {
            req = req.header(
                "idempotency-key",
                format!("k-{}", KEY_SEQ.fetch_add(1, Ordering::Relaxed)),
            )
        }
        Keys::One => req = req.header("idempotency-key", "the-one-key"),
    }
    // New orders spread over the 64 stock rows, as in the reference
    // workload (`bench/pg-limit`): one hot row would measure its lock queue,
    // not the ledger. A replay sends the same body each time.
    let body = if body == ORDER && !matches!(keys, Keys::One) {
        let sku = SKU_SEQ.fetch_add(1, Ordering::Relaxed) % 64;
        Bytes::from(ORDER.replace("A-10", &format!("S-{sku}")))
    } else {
        Bytes::from_static(body.as_bytes())
    };
    req.body(Full::new(body)).unwrap()
}

static SKU_SEQ: AtomicU64 = AtomicU64::new(0);

/// `workers` keep-alive connections sending as fast as answers come back.
async fn load(
    addr: std::net::SocketAddr,
    workers: usize,
    keys: Keys,
    body: &'static str,
    phase: Duration,
) -> Run {
    let started = Instant::now();
    let deadline = started + phase;
    let count = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let count = Arc::clone(&count);
            tokio::spawn(async move {
                let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
                stream.set_nodelay(true).unwrap();
                let (mut sender, conn) =
                    hyper::client::conn::http1::handshake(TokioIo::new(stream))
                        .await
                        .unwrap();
                tokio::spawn(conn);
                let mut latencies = Vec::new();
                let mut statuses = std::collections::BTreeMap::new();
                while Instant::now() < deadline
                    && count.fetch_add(1, Ordering::Relaxed) < MAX_REQUESTS
                {
                    let req = order_request(keys, body);
                    let t = Instant::now();
                    sender.ready().await.unwrap();
                    let res = sender.send_request(req).await.unwrap();
                    let status = res.status().as_u16();
                    res.into_body().collect().await.unwrap();
                    latencies.push(t.elapsed());
                    *statuses.entry(status).or_insert(0) += 1;
                }
                (latencies, statuses)
            })
        })
        .collect();
    let mut run = Run {
        requests: 0,
        elapsed: Duration::ZERO,
        latencies: Vec::new(),
        statuses: Default::default(),
    };
    for t in tasks {
        let (l, s) = t.await.unwrap();
        run.latencies.extend(l);
        for (k, v) in s {
            *run.statuses.entry(k).or_insert(0) += v;
        }
    }
    run.elapsed = started.elapsed();
    run.requests = run.latencies.len() as u64;
    run
}

#[derive(Default, Clone, Copy)]
struct PgStats {
    commits: i64,
    rollbacks: i64,
    inserted: i64,
    updated: i64,
    fetched: i64,
}

impl PgStats {
    /// Adds `after - before`, less the stats reader's own transaction.
    fn add_delta(&mut self, before: PgStats, after: PgStats) {
        self.commits += after.commits - before.commits - 1;
        self.rollbacks += after.rollbacks - before.rollbacks;
        self.inserted += after.inserted - before.inserted;
        self.updated += after.updated - before.updated;
        self.fetched += after.fetched - before.fetched;
    }
}

async fn pg_stats(admin: &str, db: &str) -> PgStats {
    let mut c = PgConnection::connect(admin).await.unwrap();
    let row: (i64, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_fetched FROM pg_stat_database WHERE datname = $1",
    )
    .bind(db)
    .fetch_one(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    PgStats {
        commits: row.0,
        rollbacks: row.1,
        inserted: row.2,
        updated: row.3,
        fetched: row.4,
    }
}

fn with_db(url: &str, db: &str) -> String {
    let i = url.rfind('/').unwrap();
    format!("{}/{db}", &url[..i])
}

#[tokio::main]
async fn main() {
    let admin = std::env::var("PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let db = format!("ti_bench_{}", std::process::id());
    let mut c = PgConnection::connect(&admin)
        .await
        .expect("PostgreSQL on PG_URL");
    c.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .await
        .unwrap();
    c.close().await.unwrap();
    let url = with_db(&admin, &db);
    let setup = PgPool::connect(&url).await.unwrap();
    tower_idempotency::migrate(&setup).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE orders (id TEXT PRIMARY KEY, principal TEXT NOT NULL, currency TEXT NOT NULL, amount BIGINT NOT NULL);
         CREATE TABLE order_items (order_id TEXT NOT NULL REFERENCES orders (id), line BIGINT NOT NULL, sku TEXT NOT NULL, qty BIGINT NOT NULL, PRIMARY KEY (order_id, line));
         CREATE TABLE stock (sku TEXT PRIMARY KEY, qty BIGINT NOT NULL CHECK (qty >= 0));
         INSERT INTO stock VALUES ('A-10', 1000000000), ('EMPTY', 0);
         INSERT INTO stock SELECT 'S-' || i, 1000000000 FROM generate_series(0, 63) i;",
    )
    .execute(&setup)
    .await
    .unwrap();
    setup.close().await;

    // `TI_BENCH_PROFILE=layer|bare|two|v6|commit|one [TI_BENCH_SECS=20] [TI_BENCH_CLIENTS=8]`:
    // serve one route at that many clients and print its allocator calls per sequential
    // request and its CPU split only, for `perf record` alongside. With
    // `TI_BENCH_SEQUENTIAL=N`: only N sequential requests, for `benches/instructions.sh`
    // (valgrind counts the service's instructions).
    if let Ok(which) = std::env::var("TI_BENCH_PROFILE") {
        let route = match which.as_str() {
            "bare" => Route::Bare,
            "two" => Route::TwoWrites,
            "v6" => Route::V6,
            "commit" => Route::AtCommit,
            "one" => Route::OneWrite,
            _ => Route::Layer,
        };
        let keys = if route == Route::Bare {
            Keys::None
        } else {
            Keys::Unique
        };
        let secs = std::env::var("TI_BENCH_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(20);
        let clients = std::env::var("TI_BENCH_CLIENTS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(8);
        let server = serve(&url, route).await;
        if let Some(n) = std::env::var("TI_BENCH_SEQUENTIAL")
            .ok()
            .and_then(|n| n.parse().ok())
        {
            load_n(server.addr, keys, ORDER, n).await;
            server.stop().await;
            drop_database(&admin, &db).await;
            return;
        }
        load(server.addr, clients, keys, ORDER, Duration::from_secs(2)).await;
        const SEQUENTIAL: u64 = 200;
        let (_, calls, bytes) =
            allocations::count(load_n(server.addr, keys, ORDER, SEQUENTIAL)).await;
        let n = SEQUENTIAL as f64;
        println!(
            "{which}: per sequential request, {:.0} allocator calls, {:.0} bytes requested",
            calls as f64 / n,
            bytes as f64 / n
        );
        let (s0, l0, p0) = cpu_now();
        let run = load(server.addr, clients, keys, ORDER, Duration::from_secs(secs)).await;
        let (s1, l1, p1) = cpu_now();
        let n = run.requests.max(1) as f64;
        println!(
            "{which}: {:.0} req/s, per request: service {:.0} us, PostgreSQL {:.0} us, load {:.0} us, {:?}",
            run.rps(),
            (s1 - s0) / n,
            (p1 - p0) / n,
            (l1 - l0) / n,
            run.statuses
        );
        server.stop().await;
        drop_database(&admin, &db).await;
        return;
    }
    println!(
        "tower-idempotency load benchmark: PostgreSQL, loopback HTTP/1.1, {} s per phase, {} cores",
        PHASE.as_secs(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!();
    println!(
        "| scenario | concurrency | req/s | p50 ms | p99 ms | vs baseline | each round | statuses |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut plot: Vec<Point> = Vec::new();
    let mut work = Vec::new();
    let mut cpu = Vec::new();
    // Errors and warnings the server logged for the bench's database.
    let mut log = pg_log::ServerLog::open();
    for &conc in &CONCURRENCY {
        let scenarios = [
            ("baseline (no layer)", Route::Bare, Keys::None),
            ("first execution", Route::Layer, Keys::Unique),
            ("replay", Route::Layer, Keys::One),
            (
                "candidate: two prepared writes",
                Route::TwoWrites,
                Keys::Unique,
            ),
            (
                "claim at commit: first execution",
                Route::AtCommit,
                Keys::Unique,
            ),
            ("claim at commit: replay", Route::AtCommit, Keys::One),
            (
                "candidate: one prepared write",
                Route::OneWrite,
                Keys::Unique,
            ),
        ];
        let mut spent = vec![(0.0, 0.0, 0.0); scenarios.len()];
        // Each phase's req/s, by round: a route's ratio to the same round's
        // baseline shows the spread within the run.
        let mut rounds = vec![Vec::with_capacity(ROUNDS); scenarios.len()];
        let mut measured: Vec<(&str, Run, PgStats, usize)> = scenarios
            .iter()
            .map(|s| {
                (
                    s.0,
                    Run {
                        requests: 0,
                        elapsed: Duration::ZERO,
                        latencies: Vec::new(),
                        statuses: Default::default(),
                    },
                    PgStats::default(),
                    0usize,
                )
            })
            .collect();
        // Rounds interleave the scenarios so drift on a shared machine hits all alike.
        for _round in 0..ROUNDS {
            for (i, &(_, route, keys)) in scenarios.iter().enumerate() {
                let server = serve(&url, route).await;
                if matches!(keys, Keys::One) {
                    load(server.addr, 1, Keys::One, ORDER, Duration::from_millis(100)).await;
                }
                let before = pg_stats(&admin, &db).await;
                if let Some(log) = &mut log {
                    log.problems(&db);
                }
                let (svc0, load0, pg0) = cpu_now();
                let run = load(server.addr, conc, keys, ORDER, PHASE).await;
                let (svc1, load1, pg1) = cpu_now();
                rounds[i].push(run.rps());
                spent[i].0 += svc1 - svc0;
                spent[i].1 += load1 - load0;
                spent[i].2 += pg1 - pg0;
                server.stop().await;
                tokio::time::sleep(Duration::from_millis(300)).await;
                let after = pg_stats(&admin, &db).await;
                measured[i].1.absorb(run);
                measured[i].2.add_delta(before, after);
                measured[i].3 += log.as_mut().map_or(0, |log| log.problems(&db).len());
            }
        }
        let base = measured[0].1.rps();
        let per = |i: usize| {
            let n = measured[i].1.requests.max(1) as f64;
            let (svc, load, pg) = spent[i];
            (svc / n, load / n, pg / n)
        };
        let base_cpu = {
            let (svc, _, pg) = per(0);
            svc + pg
        };
        for (i, (name, run, _, _)) in measured.iter().enumerate() {
            let (svc, load, pg) = per(i);
            cpu.push(format!(
                "| {name} | {conc} | {svc:.0} | {pg:.0} | {:.0} | {load:.0} | {:.2} | {:.2} |",
                svc + pg,
                base_cpu / (svc + pg),
                run.rps() / base,
            ));
        }
        for (i, (name, run, delta, errors)) in measured.iter().enumerate() {
            let each: Vec<String> = rounds[i]
                .iter()
                .zip(&rounds[0])
                .map(|(rps, &base)| match base {
                    base if base > 0.0 => format!("{:.2}", rps / base),
                    _ => "-".to_owned(),
                })
                .collect();
            println!(
                "| {name} | {conc} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {:?} |",
                run.rps(),
                run.pct(0.50).as_secs_f64() * 1e3,
                run.pct(0.99).as_secs_f64() * 1e3,
                run.rps() / base,
                each.join(" / "),
                run.statuses
            );
            let n = run.requests as f64;
            let errors = match log {
                Some(_) => format!("{:.3}", *errors as f64 / n),
                None => "(no log)".to_string(),
            };
            work.push(format!(
                "| {name} | {conc} | {:.2} | {:.3} | {errors} | {:.2} | {:.2} | {:.1} |",
                delta.commits as f64 / n,
                delta.rollbacks as f64 / n,
                delta.inserted as f64 / n,
                delta.updated as f64 / n,
                delta.fetched as f64 / n,
            ));
        }
        plot.push(Point {
            conc,
            base,
            first: measured[1].1.rps(),
            replay: measured[2].1.rps(),
            at_commit: measured[4].1.rps(),
        });
    }
    println!();
    println!(
        "Database work per request (pg_stat_database deltas; server errors and warnings from the server log):"
    );
    println!();
    println!(
        "| scenario | concurrency | commits | rollbacks | server errors | rows inserted | rows updated | rows fetched |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for w in &work {
        println!("{w}");
    }
    println!();
    println!(
        "CPU per completed request, µs, by process (the service's threads, PostgreSQL's processes, the load generator's threads), and the ratios to the baseline it implies (CPU) and measured (throughput):"
    );
    println!();
    println!(
        "| route | concurrency | service | PostgreSQL | service + PostgreSQL | load generator | CPU ratio | throughput ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for c in &cpu {
        println!("{c}");
    }

    let pg: std::net::SocketAddr = {
        let hostport = admin
            .split('@')
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .unwrap_or("127.0.0.1:5432");
        tokio::net::lookup_host(hostport)
            .await
            .unwrap()
            .next()
            .unwrap()
    };
    round_trips_and_wal(&admin, &db, pg).await;
    let distance_us: u64 = std::env::var("TI_BENCH_DISTANCE_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(250);
    at_a_distance(&db, pg, Duration::from_micros(distance_us), &plot).await;

    storm(&url).await;
    designs(&plot);
    write_svg(&plot);
    peak_rss().await;

    drop_database(&admin, &db).await;
}

/// Drops the bench's database (every route's rows and ledger).
async fn drop_database(admin: &str, db: &str) {
    let mut c = PgConnection::connect(admin).await.unwrap();
    c.execute(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {db} WITH (FORCE)"
    )))
    .await
    .unwrap();
}

/// The URL of `db` through `relay`.
fn via(relay: &relay::Relay, db: &str) -> String {
    format!("postgres://postgres@{}/{db}", relay.addr)
}

async fn wal_lsn(admin: &str) -> String {
    let mut c = PgConnection::connect(admin).await.unwrap();
    let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&mut c)
        .await
        .unwrap();
    c.close().await.unwrap();
    lsn
}

async fn wal_bytes(admin: &str, from: &str, to: &str) -> i64 {
    let mut c = PgConnection::connect(admin).await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::int8")
        .bind(to)
        .bind(from)
        .fetch_one(&mut c)
        .await
        .unwrap();
    c.close().await.unwrap();
    n
}

/// Round trips and WAL bytes per request, one client, sequential requests,
/// through a relay without delay. Figures that do not depend on machine
/// noise.
async fn round_trips_and_wal(admin: &str, db: &str, pg: std::net::SocketAddr) {
    const N: u64 = 200;
    let scenarios: [(&str, Route, Keys, &'static str); 10] = [
        ("baseline (no layer)", Route::Bare, Keys::None, ORDER),
        ("first execution", Route::Layer, Keys::Unique, ORDER),
        ("replay", Route::Layer, Keys::One, ORDER),
        (
            "final business error (409 recorded)",
            Route::Layer,
            Keys::Unique,
            SHORT,
        ),
        ("candidate: v6 functions", Route::V6, Keys::Unique, ORDER),
        (
            "candidate: two prepared writes",
            Route::TwoWrites,
            Keys::Unique,
            ORDER,
        ),
        (
            "claim at commit: first execution",
            Route::AtCommit,
            Keys::Unique,
            ORDER,
        ),
        ("claim at commit: replay", Route::AtCommit, Keys::One, ORDER),
        (
            "claim at commit: final business error (409 recorded)",
            Route::AtCommit,
            Keys::Unique,
            SHORT,
        ),
        (
            "candidate: one prepared write",
            Route::OneWrite,
            Keys::Unique,
            ORDER,
        ),
    ];
    println!();
    println!(
        "Round trips to PostgreSQL, WAL and the service's allocator calls per request ({N} sequential \
         requests each, counted by a relay and a counting allocator on the service's threads; sqlx's pool \
         adds its own check of each returned connection, included here for both):"
    );
    println!();
    println!(
        "| scenario | round trips | WAL bytes | allocator calls | bytes requested | statuses |"
    );
    println!("|---|---|---|---|---|---|");
    for (name, layer, keys, body) in scenarios {
        let relay = relay::Relay::start(pg, Duration::ZERO);
        let server = serve(&via(&relay, db), layer).await;
        // Warm up: connections, statement caches, the replayed key.
        load_n(server.addr, keys, body, 20).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let before = relay.round_trips();
        let lsn = wal_lsn(admin).await;
        let (statuses, calls, bytes) = allocations::count(load_n(server.addr, keys, body, N)).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let rts = relay.round_trips() - before;
        let wal = wal_bytes(admin, &lsn, &wal_lsn(admin).await).await;
        server.stop().await;
        let n = N as f64;
        println!(
            "| {name} | {:.2} | {:.0} | {:.0} | {:.0} | {statuses:?} |",
            rts as f64 / n,
            wal as f64 / n,
            calls as f64 / n,
            bytes as f64 / n
        );
    }
}

/// `n` sequential requests on one connection; the statuses seen.
async fn load_n(
    addr: std::net::SocketAddr,
    keys: Keys,
    body: &'static str,
    n: u64,
) -> std::collections::BTreeMap<u16, u64> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut statuses = std::collections::BTreeMap::new();
    for _ in 0..n {
        let req = order_request(keys, body);
        sender.ready().await.unwrap();
        let res = sender.send_request(req).await.unwrap();
        *statuses.entry(res.status().as_u16()).or_insert(0) += 1;
        res.into_body().collect().await.unwrap();
    }
    statuses
}

/// The ledger designs at the SQL level (`benches/sql/run.sh`: pgbench
/// replays each design's statements, ratios to the bare transaction in the
/// same run), beside this run's end-to-end ratio for the design built.
/// (`run.sh` alone also prices the older `v5`, `v6` and `v6_nosp`, left out here
/// to keep `cargo bench` short.)
fn designs(loopback: &[Point]) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/sql/run.sh");
    let what = [
        ("bare", "the business transaction alone"),
        (
            "one_write",
            "advisory lock and a read, then the finished row inserted with the `COMMIT` (the shape ledger v8 builds, here as literal simple queries; v8 sends the read and the row as prepared statements of their own)",
        ),
    ];
    let Some(ratios) = pgbench_ratios(script, "simple", &what) else {
        return;
    };
    println!();
    println!(
        "Ledger designs at the SQL level (pgbench, simple protocol, tps / bare tps in the same run) and end to end (this run, first execution / baseline):"
    );
    println!();
    println!(
        "| design | what PostgreSQL receives | SQL 1 | SQL 8 | SQL 64 | end to end 1 | 8 | 64 |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (i, (name, text)) in what.iter().enumerate() {
        let e2e: Vec<String> = loopback
            .iter()
            .map(|p| match *name {
                "bare" => "1.00".to_string(),
                _ => format!("{:.2} (v8)", p.first / p.base),
            })
            .collect();
        println!(
            "| {name} | {text} | {} | {} |",
            ratios[i].join(" | "),
            e2e.join(" | ")
        );
    }
    floor(script, loopback);
}

/// The floor with bound parameters (`benches/sql/floor_*.sql`, pgbench
/// `-M prepared`: statements prepared once, variables bound, one round trip
/// per statement, as sqlx sends them): the bare transaction plus one ledger
/// statement (not claim-first; plain, and `ON CONFLICT DO NOTHING` as claim at
/// commit writes it), and plus two (the least a claim-first design
/// sends with sqlx: the claim's statement, whose answer must come back before
/// the handler runs, and the answer's row before the `COMMIT`).
fn floor(script: &str, loopback: &[Point]) {
    let what = [
        ("bare", "the business transaction alone"),
        (
            "floor_one",
            "bare + one prepared finished-row insert before the `COMMIT` (nothing held or read before the handler)",
        ),
        (
            "floor_one_quiet",
            "floor_one with the row inserted `ON CONFLICT DO NOTHING RETURNING` (a lost race answered without a server error, as claim at commit writes it)",
        ),
        (
            "floor_two",
            "bare + two prepared statements: the claim (`INSERT PROCESSING ... ON CONFLICT DO NOTHING RETURNING`) and the answer (`UPDATE`); no lock, wait bound or savepoint",
        ),
    ];
    let Some(ratios) = pgbench_ratios(script, "prepared", &what) else {
        return;
    };
    println!();
    println!(
        "The floor with bound parameters (pgbench, prepared statements, tps / bare tps in the same run), and the layer end to end (this run, first executions / baseline):"
    );
    println!();
    println!("| shape | what PostgreSQL receives | 1 | 8 | 64 |");
    println!("|---|---|---|---|---|");
    for (i, (name, text)) in what.iter().enumerate() {
        println!("| {name} (SQL) | {text} | {} |", ratios[i].join(" | "));
    }
    // Each route's first executions, read from this run's points.
    let first_of: fn(&Point) -> f64 = |p| p.first;
    let at_commit_of: fn(&Point) -> f64 = |p| p.at_commit;
    let layer = [
        (
            "v8",
            "the layer: claim-first, bare + 2 round trips",
            first_of,
        ),
        (
            "claim at commit",
            "the layer's opt-in mode: bare + 1 round trip",
            at_commit_of,
        ),
    ];
    for (name, text, first) in layer {
        let ratios: Vec<String> = loopback
            .iter()
            .map(|p| format!("{:.2}", first(p) / p.base))
            .collect();
        println!("| {name} (end to end) | {text} | {} |", ratios.join(" | "));
    }
}

/// `benches/sql/run.sh` at each concurrency for the named scripts: each
/// one's tps / bare tps, per concurrency (`None`, said, without pgbench).
fn pgbench_ratios(script: &str, protocol: &str, what: &[(&str, &str)]) -> Option<Vec<Vec<String>>> {
    let mut ratios: Vec<Vec<String>> = vec![Vec::new(); what.len()];
    for conc in CONCURRENCY {
        let out = std::process::Command::new(script)
            .env("PROTOCOL", protocol)
            .args([conc.to_string(), "4".into(), "2".into()])
            .args(what.iter().map(|(name, _)| *name))
            .output();
        let Some(out) = out.ok().filter(|o| o.status.success()) else {
            println!("\n(SQL-level comparison skipped: {script} needs pgbench)");
            return None;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        for (i, (name, _)) in what.iter().enumerate() {
            let ratio = text
                .lines()
                .find(|l| l.split_whitespace().next() == Some(name))
                .and_then(|l| l.rsplit(' ').next())
                .unwrap_or("-");
            ratios[i].push(ratio.to_string());
        }
    }
    Some(ratios)
}

/// The baseline and first executions with the database `delay` away (each
/// direction), interleaved, next to the loopback ratios of this run.
async fn at_a_distance(db: &str, pg: std::net::SocketAddr, delay: Duration, loopback: &[Point]) {
    println!();
    println!(
        "With the database at a distance ({} µs each way, through the relay):",
        delay.as_micros()
    );
    println!();
    println!(
        "| concurrency | baseline req/s | first execution req/s | ratio at distance | ratio on loopback |"
    );
    println!("|---|---|---|---|---|");
    let relay = relay::Relay::start(pg, delay);
    let url = via(&relay, db);
    for (i, &conc) in CONCURRENCY.iter().enumerate() {
        let mut runs = [None, None];
        for round in 0..ROUNDS {
            // A-B then B-A.
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for which in order {
                let server = serve(
                    &url,
                    if which == 1 {
                        Route::Layer
                    } else {
                        Route::Bare
                    },
                )
                .await;
                let keys = if which == 1 { Keys::Unique } else { Keys::None };
                let run = load(server.addr, conc, keys, ORDER, PHASE).await;
                server.stop().await;
                match &mut runs[which] {
                    Some(total) => Run::absorb(total, run),
                    slot => *slot = Some(run),
                }
            }
        }
        let [Some(base), Some(first)] = runs else {
            unreachable!()
        };
        println!(
            "| {conc} | {:.0} | {:.0} | {:.2} | {:.2} |",
            base.rps(),
            first.rps(),
            first.rps() / base.rps(),
            loopback.get(i).map_or(f64::NAN, |p| p.first / p.base)
        );
    }
}

/// 100 concurrent duplicates of one key while other keys flow: exactly one
/// execution per burst, and the other keys' p99 against a run without bursts.
async fn storm(url: &str) {
    let server = serve(url, Route::Layer).await;
    let calm = load(server.addr, 8, Keys::Unique, ORDER, PHASE).await;
    let addr = server.addr;
    let bursts = tokio::spawn(async move {
        let mut executions = Vec::new();
        let end = Instant::now() + PHASE;
        let mut n = 0;
        while Instant::now() < end {
            n += 1;
            let key = format!("storm-{n}");
            let tasks: Vec<_> = (0..100)
                .map(|_| {
                    let key = key.clone();
                    tokio::spawn(async move {
                        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
                        let (mut sender, conn) =
                            hyper::client::conn::http1::handshake(TokioIo::new(stream))
                                .await
                                .unwrap();
                        tokio::spawn(conn);
                        let req = Request::post("/orders")
                            .header("host", "bench")
                            .header("content-type", "application/json")
                            .header("idempotency-key", key)
                            .body(Full::new(Bytes::from_static(ORDER.as_bytes())))
                            .unwrap();
                        let res = sender.send_request(req).await.unwrap();
                        let status = res.status().as_u16();
                        let body = res.into_body().collect().await.unwrap().to_bytes();
                        (status, body)
                    })
                })
                .collect();
            let mut bodies = std::collections::BTreeSet::new();
            let mut statuses = std::collections::BTreeMap::new();
            for t in tasks {
                let (s, b) = t.await.unwrap();
                *statuses.entry(s).or_insert(0u32) += 1;
                if s == 201 {
                    bodies.insert(b);
                }
            }
            executions.push((bodies.len(), statuses));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        executions
    });
    let stormy = load(server.addr, 8, Keys::Unique, ORDER, PHASE).await;
    let executions = bursts.await.unwrap();
    let pool = server.pool.clone();
    let ledger: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM idempotency_records WHERE idem_key LIKE 'storm-%'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    server.stop().await;
    println!();
    println!(
        "Duplicate storm: {} bursts of 100 concurrent requests with one key each, while 8 workers send new keys:",
        executions.len()
    );
    println!();
    println!("| | other keys req/s | other keys p50 ms | other keys p99 ms |");
    println!("|---|---|---|---|");
    println!(
        "| without bursts | {:.0} | {:.2} | {:.2} |",
        calm.rps(),
        calm.pct(0.5).as_secs_f64() * 1e3,
        calm.pct(0.99).as_secs_f64() * 1e3
    );
    println!(
        "| with bursts | {:.0} | {:.2} | {:.2} |",
        stormy.rps(),
        stormy.pct(0.5).as_secs_f64() * 1e3,
        stormy.pct(0.99).as_secs_f64() * 1e3
    );
    println!();
    println!(
        "p99 ratio with/without bursts: {:.2}; distinct 201 bodies per burst: {:?}; ledger rows for the bursts: {ledger}; burst statuses: {:?}",
        stormy.pct(0.99).as_secs_f64() / calm.pct(0.99).as_secs_f64(),
        executions.iter().map(|e| e.0).collect::<Vec<_>>(),
        executions.first().map(|e| &e.1),
    );
    println!("other keys' statuses during bursts: {:?}", stormy.statuses);
}

/// Throughput at one concurrency, for the plot.
struct Point {
    conc: usize,
    base: f64,
    first: f64,
    replay: f64,
    /// Claim at commit's first executions.
    at_commit: f64,
}

fn write_svg(points: &[Point]) {
    let (w, h, pad) = (640.0, 400.0, 60.0);
    let max = points
        .iter()
        .map(|p| p.base.max(p.first).max(p.replay))
        .fold(1.0, f64::max)
        * 1.1;
    let x = |i: usize| pad + (w - 2.0 * pad) * i as f64 / (points.len().max(2) - 1) as f64;
    let y = |v: f64| h - pad - (h - 2.0 * pad) * v / max;
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="24" text-anchor="middle" font-size="15">Throughput against concurrency (PostgreSQL, create-order)</text>
<line x1="{pad}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{pad}" y1="{pad}" x2="{pad}" y2="{}" stroke="black"/>
<text x="{}" y="{}" text-anchor="middle">concurrent clients</text>
<text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">requests per second</text>
"#,
        w / 2.0,
        h - pad,
        w - pad,
        h - pad,
        h - pad,
        w / 2.0,
        h - 20.0,
        h / 2.0,
        h / 2.0
    );
    for (i, p) in points.iter().enumerate() {
        svg += &format!(
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            x(i),
            h - pad + 16.0,
            p.conc
        );
    }
    for t in 0..=4 {
        let v = max * t as f64 / 4.0;
        svg += &format!(
            r##"<text x="{}" y="{:.1}" text-anchor="end">{:.0}</text><line x1="{pad}" y1="{:.1}" x2="{}" y2="{:.1}" stroke="#ddd"/>"##,
            pad - 6.0,
            y(v) + 4.0,
            v,
            y(v),
            w - pad,
            y(v)
        );
    }
    type Series = (&'static str, &'static str, fn(&Point) -> f64);
    let series: [Series; 3] = [
        ("baseline (no layer)", "#444", |p| p.base),
        ("layered, first execution", "#d62728", |p| p.first),
        ("layered, replay", "#1f77b4", |p| p.replay),
    ];
    for (i, (name, color, value)) in series.into_iter().enumerate() {
        let line: Vec<String> = points
            .iter()
            .enumerate()
            .map(|(j, p)| format!("{:.1},{:.1}", x(j), y(value(p))))
            .collect();
        svg += &format!(
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            line.join(" ")
        );
        svg += &format!(
            r#"<rect x="{}" y="{}" width="12" height="3" fill="{color}"/><text x="{}" y="{}">{name}</text>"#,
            pad + 10.0,
            pad + 10.0 + 16.0 * i as f64,
            pad + 28.0,
            pad + 15.0 + 16.0 * i as f64
        );
    }
    svg += "</svg>\n";
    std::fs::create_dir_all("docs").unwrap();
    std::fs::write("docs/throughput.svg", svg).unwrap();
    println!();
    println!("wrote docs/throughput.svg");
}

/// The feature flags this bench was built with, for `cargo build`: the
/// same flags build the crate's artifacts the bench already has (a feature
/// missing from this list only costs a rebuild), plus what the example
/// needs.
fn own_feature_flags() -> Vec<String> {
    let extras = [
        ("mysql", cfg!(feature = "mysql")),
        ("metrics", cfg!(feature = "metrics")),
        ("grpc", cfg!(feature = "grpc")),
        ("client", cfg!(feature = "client")),
        ("cli", cfg!(feature = "cli")),
        ("admin", cfg!(feature = "admin")),
        ("testkit", cfg!(feature = "testkit")),
    ];
    if extras.iter().all(|(_, on)| *on) && cfg!(feature = "default") {
        return vec!["--all-features".into()];
    }
    let mut on: Vec<&str> = extras
        .iter()
        .filter(|(_, on)| *on)
        .map(|(n, _)| *n)
        .collect();
    let mut flags = Vec::new();
    if !cfg!(feature = "default") {
        flags.push("--no-default-features".into());
        on.extend(["postgres", "sqlite", "axum"]);
    }
    if !on.is_empty() {
        flags.extend(["--features".into(), on.join(",")]);
    }
    flags
}

/// Peak RSS of the example service (its own process, SQLite) while 1 000
/// clients each send a 64 KiB body at once, and while 1 000 send bodies
/// declared over the 1 MiB limit.
async fn peak_rss() {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .and_then(|d| d.parent())
        .unwrap()
        .join("examples")
        .join("order_service");
    // The service under test is the example binary, built here if missing
    // (`cargo bench` builds no example) with this bench's profile and
    // features, so that only the example itself is compiled, and without
    // the variables cargo set for this bench's run (this package's name,
    // version, manifest): build scripts that watch them (ring's) would
    // otherwise rebuild, with everything above them, here and again in the
    // next `cargo bench`.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = std::process::Command::new(cargo);
    for (name, _) in std::env::vars_os() {
        let set_for_the_run = name.to_str().is_some_and(|n| {
            [
                "CARGO_PKG_",
                "CARGO_MANIFEST_",
                "CARGO_BIN_",
                "CARGO_CRATE_",
            ]
            .iter()
            .any(|p| n.starts_with(p))
                || ["CARGO_PRIMARY_PACKAGE", "CARGO_TARGET_TMPDIR", "OUT_DIR"].contains(&n)
        });
        if set_for_the_run {
            build.env_remove(name);
        }
    }
    let built = build
        .args(["build", "--profile", "bench", "--example", "order_service"])
        .args(own_feature_flags())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status();
    if !built.is_ok_and(|s| s.success()) || !bin.exists() {
        println!("\n(peak RSS skipped: cargo build of the example order_service failed)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("ti_rss_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut child = tokio::process::Command::new(&bin)
        .args(["--addr", "127.0.0.1:0"])
        .env("DATABASE_URL", format!("sqlite://{}/rss.db", dir.display()))
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let mut lines =
        tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(child.stdout.take().unwrap()));
    let line = lines.next_line().await.unwrap().unwrap();
    let addr: std::net::SocketAddr = line
        .split("http://")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let status = |field: &str| -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let idle = status("VmRSS:");
    // Valid JSON, 64 KiB: buffered in full and fingerprinted, then refused by
    // the example's validation (memo too long) before any claim.
    let body: &'static str = Box::leak(
        format!(
            r#"{{"currency":"KRW","items":[{{"sku":"A-10","qty":1}}],"amount":1,"memo":"{}"}}"#,
            "m".repeat(64 * 1024 - 80)
        )
        .into_boxed_str(),
    );
    let burst = |body: &'static str, declared: Option<usize>| async move {
        let tasks: Vec<_> = (0..1000)
            .map(|i| {
                tokio::spawn(async move {
                    let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
                    let (mut sender, conn) =
                        hyper::client::conn::http1::handshake(TokioIo::new(stream))
                            .await
                            .ok()?;
                    tokio::spawn(conn);
                    let mut req = Request::post("/orders")
                        .header("host", "bench")
                        .header("content-type", "application/json")
                        .header("authorization", "Bearer rss")
                        .header("idempotency-key", format!("rss-{i}"));
                    if let Some(len) = declared {
                        req = req.header("content-length", len);
                    }
                    let res = sender
                        .send_request(
                            req.body(Full::new(Bytes::from_static(body.as_bytes())))
                                .unwrap(),
                        )
                        .await
                        .ok()?;
                    Some(res.status().as_u16())
                })
            })
            .collect();
        let mut statuses = std::collections::BTreeMap::new();
        for t in tasks {
            *statuses
                .entry(t.await.unwrap().unwrap_or(0))
                .or_insert(0u32) += 1;
        }
        statuses
    };
    let statuses = burst(body, None).await;
    let peak = status("VmHWM:");
    let over: &'static str = Box::leak("x".repeat(16).into_boxed_str());
    let over_statuses = burst(over, Some(2 * 1024 * 1024)).await;
    let peak_after = status("VmHWM:");
    child.kill().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    println!();
    println!("Memory of the example service (SQLite, separate process), 1 000 concurrent clients:");
    println!();
    println!("| | RSS |");
    println!("|---|---|");
    println!("| idle after start | {:.1} MiB |", idle as f64 / 1024.0);
    println!(
        "| peak, 1 000 x 64 KiB bodies (62.5 MiB in flight) | {:.1} MiB |",
        peak as f64 / 1024.0
    );
    println!(
        "| peak after 1 000 bodies declared at 2 MiB (limit 1 MiB) | {:.1} MiB |",
        peak_after as f64 / 1024.0
    );
    println!();
    println!("statuses: 64 KiB {statuses:?}; declared 2 MiB {over_statuses:?}");
}
