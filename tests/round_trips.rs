//! What a request costs in round trips, held by a test. On PostgreSQL
//! (ledger v8, issue 25) a first execution costs the bare transaction's
//! round trips and two more: the claim's read, prepared, after the
//! `BEGIN` that takes the scope's lock (sqlx cannot read rows from the
//! statement that begins a transaction it counts), and the one ledger row,
//! prepared, before the `COMMIT` (a bind parameter cannot ride with sqlx's
//! `COMMIT`). A final business error one more (the rollback to the
//! claim's savepoint); a replay fewer than bare. On MySQL a first
//! execution costs one more than bare, after the answer has left: the
//! claim's one batch replaces the bare `BEGIN` and the recording's batch
//! ends with the `COMMIT`, and then sqlx's count of the transaction goes
//! back to zero with a `ROLLBACK` of nothing, queued and sent by the pool's
//! check of the returned connection. A replay there is the transaction's
//! start with the insert that meets the row, then its rollback with the
//! read. Counted
//! by a TCP
//! relay between a one-connection pool and the server, which does not
//! depend on machine noise.

#[cfg(feature = "mysql")]
#[path = "common/causal_wait.rs"]
mod causal_wait;

use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::testkit::ConformanceDb;
use tower_idempotency::testkit::relay::Relay;
use tower_idempotency::{IdempotencyBody, IdempotencyLayer, Principal, Tx};

/// The URL of `url`'s database through `relay`.
fn via(url: &str, relay: &Relay) -> String {
    let (scheme_user, rest) = url.split_once('@').unwrap();
    let db = rest.split_once('/').map_or("", |(_, db)| db);
    format!("{scheme_user}@{}/{db}", relay.addr)
}

fn upstream(url: &str) -> std::net::SocketAddr {
    let hostport = url.split_once('@').unwrap().1.split('/').next().unwrap();
    std::net::ToSocketAddrs::to_socket_addrs(hostport)
        .unwrap()
        .next()
        .unwrap()
}

/// Round trips per request: the bare transaction, a first execution, a
/// final business error, a replay through the layer that ran the key and
/// one through another layer (another instance of the service).
macro_rules! count {
    ($db:ty, $schema:expr, $statements:expr) => {
        count!($db, $schema, $statements, false)
    };
    ($db:ty, $schema:expr, $statements:expr, $at_commit:expr) => {{
        let (url, _drop) = <$db as ConformanceDb>::fresh_url().await;
        let direct = sqlx::pool::PoolOptions::<$db>::new()
            .max_connections(1)
            .connect(&url)
            .await
            .unwrap();
        tower_idempotency::migrate(&direct).await.unwrap();
        sqlx::raw_sql($schema).execute(&direct).await.unwrap();
        direct.close().await;
        let relay = Relay::start(upstream(&url), Duration::ZERO);
        let pool = sqlx::pool::PoolOptions::<$db>::new()
            .max_connections(1)
            .connect(&via(&url, &relay))
            .await
            .unwrap();
        // The same three business statements, bare or on the claimed
        // transaction; `short` makes the last one a final business error.
        let statements: [&'static str; 3] = $statements;
        // A layer; a second one stands for another instance of the service,
        // which has not seen the key.
        let make = || {
            let layer = IdempotencyLayer::new(pool.clone()).unscoped();
            let layer = if $at_commit {
                layer.with_claim_at_commit()
            } else {
                layer
            };
            ServiceBuilder::new().layer(layer).service_fn(
                move |req: Request<IdempotencyBody<String>>| async move {
                    let short = req.uri().path() == "/short";
                    let tx = req.extensions().get::<Tx<$db>>().cloned().unwrap();
                    let mut conn = tx.lock().unwrap();
                    for sql in statements {
                        sqlx::raw_sql(sql).execute(&mut *conn).await.unwrap();
                    }
                    let status = if short { 409 } else { 201 };
                    Ok::<_, Infallible>(
                        Response::builder()
                            .status(status)
                            .body(String::new())
                            .unwrap(),
                    )
                },
            )
        };
        let service = make();
        let call = |path: &'static str, key: String, elsewhere: bool| {
            let service = if elsewhere { make() } else { service.clone() };
            async move {
                let mut req = Request::post(path)
                    .header("idempotency-key", key)
                    .body(String::new())
                    .unwrap();
                req.extensions_mut().insert(Principal::new("p"));
                let res = service.oneshot(req).await.unwrap();
                res.status()
            }
        };
        const N: u64 = 20;
        let settle = || tokio::time::sleep(Duration::from_millis(50));
        // Warm the one connection (its statements prepared: a first
        // execution's and a replay's, here and elsewhere), then count each
        // scenario.
        call("/orders", "warm".into(), false).await;
        call("/orders", "warm".into(), false).await;
        call("/orders", "warm".into(), true).await;
        settle().await;
        let mut counts = Vec::new();
        for scenario in ["bare", "first", "final", "replay", "elsewhere"] {
            let before = relay.round_trips();
            for i in 0..N {
                match scenario {
                    "bare" => {
                        let mut tx = pool.begin().await.unwrap();
                        for sql in statements {
                            sqlx::raw_sql(sql).execute(&mut *tx).await.unwrap();
                        }
                        tx.commit().await.unwrap();
                    }
                    "first" => assert_eq!(
                        call("/orders", format!("k-{i}"), false).await,
                        StatusCode::CREATED
                    ),
                    "final" => assert_eq!(
                        call("/short", format!("s-{i}"), false).await,
                        StatusCode::CONFLICT
                    ),
                    // A retry of a finished key, through the layer that ran
                    // it or through another one.
                    _ => assert_eq!(
                        call("/orders", "k-0".into(), scenario == "elsewhere").await,
                        StatusCode::CREATED
                    ),
                }
                settle().await;
            }
            let per = (relay.round_trips() - before) as f64 / N as f64;
            println!(
                "[{}] {scenario}: {per:.2} round trips per request",
                <$db as ConformanceDb>::LABEL
            );
            counts.push(per);
        }
        counts
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_first_execution_costs_the_bare_round_trips_and_two() {
    let c = count!(
        sqlx::Postgres,
        "CREATE TABLE t (id BIGSERIAL PRIMARY KEY, v INT); CREATE TABLE s (k INT PRIMARY KEY, n INT); INSERT INTO s VALUES (1, 1000000);",
        [
            "INSERT INTO t (v) VALUES (1)",
            "INSERT INTO t (v) VALUES (2)",
            "UPDATE s SET n = n - 1 WHERE k = 1"
        ]
    );
    let (bare, first, fin, replay) = (c[0], c[1], c[2], c[3]);
    assert_eq!(first, bare + 2.0, "the claim's read and the ledger row");
    assert!(
        fin <= bare + 3.0,
        "a final business error: {fin} > {bare} + 3"
    );
    assert!(replay < bare, "a replay: {replay} >= {bare}");
    // (Through a new layer each time: one more, its look-up of the ledger,
    // once in a layer's life.)
    assert_eq!(c[4], replay + 1.0, "a replay through another layer");
}

/// In the claim-at-commit mode a first execution costs one more than bare
/// (the row written before the `COMMIT`). A retry of a finished key
/// through the layer that ran it is known there and reads the ledger
/// first: fewer than bare, the handler not run. Through another layer it
/// runs the handler again: its row meets the recorded one, the row's
/// statement returns that one, and the `ROLLBACK` takes the `COMMIT`'s
/// place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_at_commit_first_execution_costs_the_bare_round_trips_and_one() {
    let c = count!(
        sqlx::Postgres,
        "CREATE TABLE t (id BIGSERIAL PRIMARY KEY, v INT); CREATE TABLE s (k INT PRIMARY KEY, n INT); INSERT INTO s VALUES (1, 1000000);",
        [
            "INSERT INTO t (v) VALUES (1)",
            "INSERT INTO t (v) VALUES (2)",
            "UPDATE s SET n = n - 1 WHERE k = 1"
        ],
        true
    );
    let (bare, first, fin, replay) = (c[0], c[1], c[2], c[3]);
    assert_eq!(first, bare + 1.0, "the ledger row");
    assert_eq!(fin, bare + 2.0, "the rollback to the savepoint, the row");
    assert_eq!(replay, 3.0, "a replay here: the ledger's read, no handler");
    // (Through a new layer each time: one more, its look-up of the ledger,
    // once in a layer's life.)
    assert_eq!(
        c[4],
        bare + 2.0 + 1.0,
        "elsewhere: the row that meets the recorded one, the read"
    );
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_first_execution_costs_the_bare_round_trips_and_one_off_the_path() {
    let c = count!(
        sqlx::MySql,
        "CREATE TABLE t (id BIGINT AUTO_INCREMENT PRIMARY KEY, v INT) ENGINE = InnoDB; \
         CREATE TABLE s (k INT PRIMARY KEY, n INT) ENGINE = InnoDB; INSERT INTO s VALUES (1, 1000000);",
        [
            "INSERT INTO t (v) VALUES (1)",
            "INSERT INTO t (v) VALUES (2)",
            "UPDATE s SET n = n - 1 WHERE k = 1"
        ]
    );
    let (bare, first, fin, replay) = (c[0], c[1], c[2], c[3]);
    // The claim's one batch (autocommit off, begin, insert, savepoint)
    // replaces the bare BEGIN, and sqlx counts it; the recording's batch
    // ends with the COMMIT (and autocommit back on). sqlx's count then goes
    // back to zero with its ROLLBACK of nothing queued, which the pool's
    // check of the returned connection sends: one round trip after the
    // answer has left.
    assert_eq!(
        first,
        bare + 1.0,
        "the bare round trips and the queued ROLLBACK"
    );
    assert!(fin <= bare + 1.0, "a final business error: {fin}");
    // The claim batch that meets the row, then its rollback and the read
    // in one batch, on one connection, which the pool checks as it hands
    // it out and as it takes it back (before: the read on a connection of
    // its own, 7).
    assert_eq!(replay, 4.0, "a replay");
}

/// A server that is not a Galera node is not asked to wait for a cluster:
/// the layer asks once, and its claims then leave the causal wait out (a
/// `SELECT` that costs such a server about 40 µs per claim). Galera nodes
/// still get it (`tests/galera.rs`).
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_server_that_is_not_a_galera_node_is_not_asked_to_wait() {
    let (url, _drop) = <sqlx::MySql as ConformanceDb>::fresh_url().await;
    assert_eq!(
        causal_wait::selects_per_first_execution(&url).await,
        1,
        "the recording batch's read alone"
    );
}

/// The message consumer pays what the HTTP layer pays: a first delivery
/// costs the bare transaction's round trips and two on PostgreSQL (the
/// claim's read, the processed-message row); a duplicate at most one more
/// than bare (the `BEGIN` with the lock, the read that meets the row, its
/// `COMMIT`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_first_delivery_costs_the_bare_round_trips_and_two() {
    use tower_idempotency::consumer::{Consumer, Processed};
    let (url, _drop) = <sqlx::Postgres as ConformanceDb>::fresh_url().await;
    let direct = sqlx::PgPool::connect(&url).await.unwrap();
    tower_idempotency::migrate(&direct).await.unwrap();
    sqlx::raw_sql("CREATE TABLE s (k INT PRIMARY KEY, n INT); INSERT INTO s VALUES (1, 1000000);")
        .execute(&direct)
        .await
        .unwrap();
    direct.close().await;
    let relay = Relay::start(upstream(&url), Duration::ZERO);
    let pool = sqlx::pool::PoolOptions::<sqlx::Postgres>::new()
        .max_connections(1)
        .connect(&via(&url, &relay))
        .await
        .unwrap();
    let consumer = Consumer::new(pool.clone(), "stock");
    const UPDATE: &str = "UPDATE s SET n = n - 1 WHERE k = 1";
    let deliver = |id: String| {
        let consumer = consumer.clone();
        async move {
            consumer
                .process(&id, br#"{"qty":1}"#, |tx| async move {
                    let mut conn = tx.lock().unwrap();
                    sqlx::raw_sql(UPDATE).execute(&mut *conn).await.map(drop)
                })
                .await
                .unwrap()
        }
    };
    const N: u64 = 20;
    let settle = || tokio::time::sleep(Duration::from_millis(50));
    deliver("warm".into()).await;
    settle().await;
    let mut counts = Vec::new();
    for scenario in ["bare", "first", "duplicate"] {
        let before = relay.round_trips();
        for i in 0..N {
            match scenario {
                "bare" => {
                    let mut tx = pool.begin().await.unwrap();
                    sqlx::raw_sql(UPDATE).execute(&mut *tx).await.unwrap();
                    tx.commit().await.unwrap();
                }
                "first" => assert_eq!(deliver(format!("evt-{i}")).await, Processed::Applied(())),
                _ => assert_eq!(deliver("evt-0".into()).await, Processed::Duplicate),
            }
            settle().await;
        }
        let per = (relay.round_trips() - before) as f64 / N as f64;
        println!("[postgres] consumer {scenario}: {per:.2} round trips per delivery");
        counts.push(per);
    }
    let (bare, first, duplicate) = (counts[0], counts[1], counts[2]);
    assert_eq!(
        first,
        bare + 2.0,
        "the claim's read and the processed-message row"
    );
    assert!(
        duplicate <= bare + 1.0,
        "a duplicate: {duplicate} > {bare} + 1"
    );
}
