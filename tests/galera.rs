//! MariaDB Galera (multi-primary): the example order service with one
//! instance on each of two nodes of a three-node cluster that this test
//! starts and stops itself (`tests/common/galera.rs`). Judged by the rows
//! the cluster holds: one order, one stock decrement and one ledger row per
//! key, no order without its ledger row, and every answer the recorded one
//! or a retryable `503`/`409`, never a `500`.
//!
//! `GALERA_ROUNDS` (default 6) sets how many rounds of the concurrent case
//! run; one round in three runs with both cores kept busy.

#[path = "common/causal_wait.rs"]
mod causal_wait;
mod common;
#[path = "common/galera.rs"]
mod galera;
#[path = "common/http.rs"]
mod http_call;
#[path = "common/orders.rs"]
mod orders;
#[path = "common/payments.rs"]
mod payments;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use galera::Cluster;
use http::{Method, StatusCode};
use http_call::{Answer, http_call};
use payments::{Provider, pay, payment_service};
use sqlx::MySqlPool;
use tokio::process::Child;

/// One example order service on one node.
struct Instance {
    _child: Child,
    addr: String,
}

impl Instance {
    async fn start(url: &str, delay_ms: u64) -> Self {
        let (child, addr) = common::order_service(url, delay_ms, &[]).await;
        Self {
            _child: child,
            addr,
        }
    }

    /// As [`start`](Self::start), the layer claiming at commit.
    async fn start_at_commit(url: &str) -> Self {
        let (child, addr) = common::start_example(
            "order_service",
            &["--addr", "127.0.0.1:0", "--claim-at-commit"],
            &[("DATABASE_URL", url)],
        )
        .await;
        Self {
            _child: child,
            addr,
        }
    }

    async fn order(&self, key: &str) -> Answer {
        orders::order(&self.addr, key).await.unwrap()
    }
}

/// Sets the stock to a million. Not an idempotent request's business: a
/// plain write, which the cluster may roll back (the service answers `503`
/// with `Retry-After`, say while a new database's tables replicate), so
/// it is sent again until it lands.
async fn put_stock(addr: &str) {
    let mut last = None;
    for _ in 0..20 {
        let put = http_call(
            addr,
            Method::PUT,
            "/stock/A-10",
            None,
            None,
            r#"{"qty":1000000}"#,
        )
        .await;
        if put.status == StatusCode::OK {
            return;
        }
        assert!(acceptable(&put), "PUT /stock: {put:?}");
        last = Some(put);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("PUT /stock never landed: {last:?}");
}

/// What the cluster holds, read on `pool`'s node after it caught up.
#[derive(Debug, PartialEq, Eq)]
struct Rows {
    orders: i64,
    ledger: i64,
    succeeded: i64,
    /// Orders no ledger row names: executions the ledger does not know.
    unledgered: i64,
    /// Ledger rows that name no order.
    orphaned: i64,
    stock_taken: i64,
}

/// A pool of one connection, so that a session setting (the causal wait
/// of [`rows`]) holds for every read.
async fn one_connection(url: &str) -> MySqlPool {
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .unwrap()
}

/// The one integer `sql` reads on `pool`.
async fn count(pool: &MySqlPool, sql: &'static str) -> i64 {
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn rows(pool: &MySqlPool) -> Rows {
    let one = |sql| count(pool, sql);
    sqlx::raw_sql("SET SESSION wsrep_sync_wait = 1")
        .execute(pool)
        .await
        .unwrap();
    Rows {
        orders: one("SELECT COUNT(*) FROM orders").await,
        ledger: one("SELECT COUNT(*) FROM idempotency_records").await,
        succeeded: one("SELECT COUNT(*) FROM idempotency_records WHERE status = 'SUCCEEDED'").await,
        unledgered: one("SELECT COUNT(*) FROM orders o WHERE NOT EXISTS \
             (SELECT 1 FROM idempotency_records r WHERE r.resource_id = o.id)")
        .await,
        orphaned: one(
            "SELECT COUNT(*) FROM idempotency_records r WHERE r.status = 'SUCCEEDED' \
             AND NOT EXISTS (SELECT 1 FROM orders o WHERE o.id = r.resource_id)",
        )
        .await,
        stock_taken: one("SELECT CAST(1000000 - qty AS SIGNED) FROM stock WHERE sku = 'A-10'")
            .await,
    }
}

/// An answer a client may get: the order (first or replayed), or a
/// retryable refusal with `Retry-After`.
fn acceptable(a: &Answer) -> bool {
    match a.status {
        StatusCode::CREATED => true,
        StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT => {
            a.headers.contains_key(http::header::RETRY_AFTER)
        }
        _ => false,
    }
}

/// The order id a `201` carries.
fn order_id(a: &Answer) -> String {
    a.json()["orderId"].as_str().unwrap_or_default().to_string()
}

/// Retries `key` on `instance` until it answers `201` (bounded); `None`
/// when it never does.
async fn settle(instance: &Instance, key: &str, faults: &mut Vec<String>) -> Option<Answer> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let a = instance.order(key).await;
        if !acceptable(&a) {
            faults.push(format!("{key} retried: {} {}", a.status, a.problem_type()));
        }
        if a.status == StatusCode::CREATED {
            return Some(a);
        }
        if Instant::now() > deadline {
            faults.push(format!(
                "{key} never settled: {} {}",
                a.status,
                a.problem_type()
            ));
            return None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What one round saw.
#[derive(Debug, Default)]
struct Round {
    /// Retryable refusals among the concurrent answers.
    refused: usize,
    /// Everything that broke the guarantee or the contract.
    faults: Vec<String>,
}

/// Two instances, `keys` keys: half sent four times at once, two to each
/// node; half sent to node 0 and retried on node 1 as soon as it answered;
/// the layer claims first, or at commit (`at_commit`).
async fn concurrent_round(cluster: &Cluster, db: &str, keys: usize, at_commit: bool) -> Round {
    cluster.create_database(db);
    let (a, b) = if at_commit {
        (
            Instance::start_at_commit(&cluster.url(0, db)).await,
            Instance::start_at_commit(&cluster.url(1, db)).await,
        )
    } else {
        (
            Instance::start(&cluster.url(0, db), 0).await,
            Instance::start(&cluster.url(1, db), 0).await,
        )
    };
    let pool = one_connection(&cluster.url(2, db)).await;
    put_stock(&a.addr).await;

    let a = std::sync::Arc::new(a);
    let b = std::sync::Arc::new(b);
    let mut tasks = Vec::new();
    for k in 0..keys / 2 {
        for i in 0..4 {
            let node = if i % 2 == 0 { a.clone() } else { b.clone() };
            let key = format!("together-{k}");
            tasks.push(tokio::spawn(async move {
                (key.clone(), node.order(&key).await)
            }));
        }
    }
    let mut answers: HashMap<String, Vec<Answer>> = HashMap::new();
    for t in tasks {
        let (key, answer) = t.await.unwrap();
        answers.entry(key).or_default().push(answer);
    }
    let mut round = Round::default();
    for (key, list) in &answers {
        let first = settle(&a, key, &mut round.faults).await;
        for answer in list {
            if !acceptable(answer) {
                round.faults.push(format!(
                    "{key}: {} {}",
                    answer.status,
                    answer.problem_type()
                ));
            } else if answer.status != StatusCode::CREATED {
                round.refused += 1;
            } else if let Some(first) = &first
                && order_id(answer) != order_id(first)
            {
                round.faults.push(format!("{key}: two orders answered"));
            }
        }
    }
    // Sequential: nothing conflicts, unless a retry on node 1 missed the
    // recorded row and ran the handler again (then the cluster aborts it).
    let before: i64 = (0..3).map(|i| cluster.conflicts(i)).sum();
    for k in 0..keys / 2 {
        let key = format!("then-{k}");
        let first = a.order(&key).await;
        if first.status != StatusCode::CREATED {
            round
                .faults
                .push(format!("{key}: {} {}", first.status, first.problem_type()));
            continue;
        }
        let again = b.order(&key).await;
        if !again.replayed() || again.body != first.body {
            round.faults.push(format!(
                "{key} on node 1 not replayed: {} {}",
                again.status,
                again.problem_type()
            ));
        }
    }
    let after: i64 = (0..3).map(|i| cluster.conflicts(i)).sum();
    if after != before {
        round.faults.push(format!(
            "{db}: {} retries on node 1 ran the handler again",
            after - before
        ));
    }
    let keys = keys as i64;
    let want = Rows {
        orders: keys,
        ledger: keys,
        succeeded: keys,
        unledgered: 0,
        orphaned: 0,
        stock_taken: keys,
    };
    let got = rows(&pool).await;
    if got != want {
        round.faults.push(format!("{db}: {got:?}"));
    }
    pool.close().await;
    round
}

/// Keeps both cores busy until dropped.
struct Load(Vec<std::process::Child>);

impl Load {
    fn start() -> Self {
        Self(
            (0..2)
                .map(|_| {
                    std::process::Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .unwrap()
                })
                .collect(),
        )
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A node is SIGKILLed while an instance's claimed transaction is open on
/// it: nothing of it commits; the client's retry on another node runs once;
/// the node rejoins with the same rows.
async fn node_killed_mid_transaction(cluster: &mut Cluster) -> Vec<String> {
    let db = "killed";
    cluster.create_database(db);
    let slow = Instance::start(&cluster.url(1, db), 1500).await;
    let other = Instance::start(&cluster.url(0, db), 0).await;
    put_stock(&other.addr).await;
    let slow = std::sync::Arc::new(slow);
    let first = {
        let slow = slow.clone();
        tokio::spawn(async move { slow.order("killed-1").await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    tokio::task::block_in_place(|| cluster.kill(1));
    let mut faults = Vec::new();
    let first = first.await.unwrap();
    if !acceptable(&first) {
        faults.push(format!(
            "on the killed node: {} {}",
            first.status,
            first.problem_type()
        ));
    }
    let retry = settle(&other, "killed-1", &mut faults).await;
    let pool = one_connection(&cluster.url(2, db)).await;
    let want = Rows {
        orders: 1,
        ledger: 1,
        succeeded: 1,
        unledgered: 0,
        orphaned: 0,
        stock_taken: 1,
    };
    let got = rows(&pool).await;
    if got != want {
        faults.push(format!("after the kill: {got:?}"));
    }
    pool.close().await;
    tokio::task::block_in_place(|| cluster.restart(1, 3));
    let back = one_connection(&cluster.url(1, db)).await;
    let got = rows(&back).await;
    if got != want {
        faults.push(format!("on the rejoined node: {got:?}"));
    }
    back.close().await;
    let again = slow.order("killed-1").await;
    if !again.replayed() || retry.is_some_and(|r| r.body != again.body) {
        faults.push(format!(
            "the rejoined node did not replay: {}",
            again.status
        ));
    }
    faults
}

/// Lease mode across nodes: the example payment service on node 0 is
/// SIGKILLed after the provider charged; the client's retry goes to an
/// instance on node 1, which takes the lapsed lease over, finds the charge
/// under the same step key and answers: one charge, one captured payment.
async fn lease_taken_over_on_another_node(cluster: &Cluster) -> Vec<String> {
    let db = "lease";
    cluster.create_database(db);
    let provider = Provider::start().await;
    let args = [
        "--lease-ms",
        "1000",
        "--provider-timeout-ms",
        "5000",
        "--completer-interval-ms",
        "600000",
    ];
    let (mut first, first_addr) = payment_service(&cluster.url(0, db), &provider, &args).await;
    let (_second, second_addr) = payment_service(&cluster.url(1, db), &provider, &args).await;
    provider.charge_then_hang(10_000).await;
    let pending = tokio::spawn(async move { pay(&first_addr, "pay-1").await });
    provider.wait_for_a_charge().await;
    first.start_kill().unwrap();
    first.wait().await.unwrap();
    let mut faults = Vec::new();
    if let Ok(Ok(Ok(a))) = tokio::time::timeout(Duration::from_secs(1), pending).await {
        faults.push(format!("the killed instance answered: {}", a.status));
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let answer = loop {
        match pay(&second_addr, "pay-1").await {
            Ok(a) if a.status == StatusCode::CREATED => break Some(a),
            Ok(a) if acceptable(&a) => {}
            Ok(a) => faults.push(format!(
                "retry on node 1: {} {}",
                a.status,
                a.problem_type()
            )),
            Err(e) => faults.push(format!("retry on node 1: {e}")),
        }
        if Instant::now() > deadline {
            faults.push("the retry on node 1 never answered 201".into());
            break None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let charged = provider.charges().await;
    if charged != 1 {
        faults.push(format!("{charged} charges for one payment key"));
    }
    let pool = one_connection(&cluster.url(2, db)).await;
    sqlx::raw_sql("SET SESSION wsrep_sync_wait = 1")
        .execute(&pool)
        .await
        .unwrap();
    let captured: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM payments WHERE status = 'captured' AND charge_id IS NOT NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let payments: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payments")
        .fetch_one(&pool)
        .await
        .unwrap();
    if (payments, captured) != (1, 1) || answer.is_none() {
        faults.push(format!("payments {payments}, captured {captured}"));
    }
    pool.close().await;
    faults
}

/// The writes of [`abort_at_the_proof`]'s handlers: an order row and the
/// one row every request updates; the order's id.
async fn order_and_hot_row_on(conn: &mut sqlx::MySqlConnection) -> Result<String, sqlx::Error> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = format!(
        "o-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    );
    sqlx::query("INSERT INTO orders (id) VALUES (?)")
        .bind(&id)
        .execute(&mut *conn)
        .await?;
    sqlx::query("UPDATE hot SET n = n + 1 WHERE id = 1")
        .execute(&mut *conn)
        .await?;
    Ok(id)
}

/// The `201` for order `id`, its resource id recorded.
fn created(id: String) -> axum::response::Response {
    use axum::response::IntoResponse;
    (
        StatusCode::CREATED,
        axum::Extension(tower_idempotency::ResourceId::new(id.clone())),
        axum::Json(serde_json::json!({ "orderId": id })),
    )
        .into_response()
}

/// The handler of [`abort_at_the_proof`]: [`order_and_hot_row_on`] the
/// claimed transaction.
async fn order_and_hot_row(tx: tower_idempotency::Tx<sqlx::MySql>) -> axum::response::Response {
    use axum::response::IntoResponse;
    let Ok(mut conn) = tx.lock() else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    match order_and_hot_row_on(&mut conn).await {
        Ok(id) => created(id),
        Err(e) => tower_idempotency::HandlerError::from(e).into_response(),
    }
}

/// How [`abort_at_the_proof`]'s layer runs.
#[derive(Debug, Clone, Copy)]
enum Mode {
    ClaimFirst,
    AtCommit,
    Lease,
}

/// [`order_and_hot_row`] in lease mode: the same writes in one phase,
/// committed with a recovery point.
async fn leased_order_and_hot_row(
    leased: tower_idempotency::lease::Leased<sqlx::MySql>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut phase = match leased.phase().await {
        Ok(phase) => phase,
        Err(e) => return e.into_response(),
    };
    let id = match order_and_hot_row_on(&mut phase).await {
        Ok(id) => id,
        Err(e) => return tower_idempotency::HandlerError::from(e).into_response(),
    };
    match phase.commit("ordered").await {
        Ok(()) => created(id),
        Err(e) => e.into_response(),
    }
}

/// A replicated writer's abort that lands inside a request's recording
/// batch, right after the batch proved its claimed transaction (the
/// savepoint's release) or right before (after its writes), where
/// `pause_at_next_proof` holds the batch: MariaDB runs the rest of such a
/// batch in a new transaction and its `COMMIT` commits that one, so a
/// ledger write placed after the proof would commit without the order it
/// names. Nothing of the aborted request may commit. Both modes, and
/// lease mode's phase (its recovery point and business rows); the writer
/// is a duplicate of the key on node 1 (not in lease mode, where it would
/// wait for the lease), or a plain write there of the row the handler
/// updated; the writer goes once node 0 shows the batch in its pause, and
/// node 0 must count the abort.
async fn abort_at_the_proof(cluster: &Cluster) -> Vec<String> {
    use tower_idempotency::testkit::{order, pause_at_next_proof, send};
    let mut faults = Vec::new();
    let cases = [
        (Mode::ClaimFirst, true),
        (Mode::ClaimFirst, false),
        (Mode::AtCommit, true),
        (Mode::AtCommit, false),
        (Mode::Lease, false),
    ];
    let cases = cases
        .into_iter()
        .flat_map(|c| [(c, false), (c, true)])
        .enumerate();
    for (i, ((mode, duplicate), before_proof)) in cases {
        let case = format!(
            "{mode:?} against {}, the abort {} the proof",
            if duplicate {
                "a duplicate"
            } else {
                "a write of the row"
            },
            if before_proof { "before" } else { "after" }
        );
        let db = format!("proof{i}");
        cluster.create_database(&db);
        let on = |node: usize| {
            let url = cluster.url(node, &db);
            async move {
                sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(4)
                    .connect(&url)
                    .await
                    .unwrap()
            }
        };
        let (p0, p1) = (on(0).await, on(1).await);
        tower_idempotency::migrate(&p0).await.unwrap();
        sqlx::raw_sql(
            "CREATE TABLE orders (id VARCHAR(64) PRIMARY KEY) ENGINE = InnoDB; \
             CREATE TABLE hot (id INT PRIMARY KEY, n BIGINT NOT NULL) ENGINE = InnoDB; \
             INSERT INTO hot VALUES (1, 0)",
        )
        .execute(&p0)
        .await
        .unwrap();
        // Node 1 has applied the tables before its layer starts.
        sqlx::raw_sql("SET STATEMENT wsrep_sync_wait = 15 FOR SELECT n FROM hot")
            .execute(&p1)
            .await
            .unwrap();
        let app = |pool: sqlx::MySqlPool| {
            let layer = tower_idempotency::IdempotencyLayer::new(pool)
                .with_principal(|_| Some(tower_idempotency::Principal::new("galera")));
            let route = match mode {
                Mode::Lease => axum::routing::post(leased_order_and_hot_row),
                _ => axum::routing::post(order_and_hot_row),
            };
            let layer = match mode {
                Mode::ClaimFirst => layer,
                Mode::AtCommit => layer.with_claim_at_commit(),
                Mode::Lease => layer.with_lease(
                    tower_idempotency::lease::LeaseMode::new(Duration::from_secs(5)).unwrap(),
                ),
            };
            axum::Router::new().route("/orders", route).layer(layer)
        };
        let (app0, app1) = (app(p0.clone()), app(p1.clone()));
        let key = format!("proof-{i}");
        let aborts_before = cluster.conflicts(0);
        pause_at_next_proof(Duration::from_millis(2000), before_proof);
        let victim = {
            let key = key.clone();
            tokio::spawn(async move { send(&app0, order(None, Some(&key), "{}")).await })
        };
        // The victim's batch in its pause (bounded: a victim that never gets
        // there is still aborted, and judged the same).
        for _ in 0..100 {
            let pausing: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
                 WHERE STATE = 'User sleep' AND INFO LIKE '%SLEEP(2.000)%'",
            )
            .fetch_one(&p0)
            .await
            .unwrap();
            if pausing > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if duplicate {
            let other = send(&app1, order(None, Some(&key), "{}")).await;
            if other.status != StatusCode::CREATED {
                faults.push(format!("{case}: the duplicate on node 1: {}", other.status));
            }
        } else {
            sqlx::query("UPDATE hot SET n = n + 100 WHERE id = 1")
                .execute(&p1)
                .await
                .unwrap();
        }
        let victim = victim.await.unwrap();
        pause_at_next_proof(Duration::ZERO, false);
        if cluster.conflicts(0) <= aborts_before {
            faults.push(format!("{case}: node 0 counted no abort"));
        }
        let judge = one_connection(&cluster.url(2, &db)).await;
        sqlx::raw_sql("SET SESSION wsrep_sync_wait = 1")
            .execute(&judge)
            .await
            .unwrap();
        let orders = count(&judge, "SELECT COUNT(*) FROM orders").await;
        let ledger = count(&judge, "SELECT COUNT(*) FROM idempotency_records").await;
        let orphaned = count(
            &judge,
            "SELECT COUNT(*) FROM idempotency_records r WHERE r.resource_id IS NOT NULL \
             AND NOT EXISTS (SELECT 1 FROM orders o WHERE o.id = r.resource_id)",
        )
        .await;
        let points = count(
            &judge,
            "SELECT COUNT(*) FROM idempotency_records WHERE recovery_point IS NOT NULL",
        )
        .await;
        let unledgered = count(
            &judge,
            "SELECT COUNT(*) FROM orders o \
             WHERE NOT EXISTS (SELECT 1 FROM idempotency_records r WHERE r.resource_id = o.id)",
        )
        .await;
        // Lease mode's claim commits at once: its row stays, at no point.
        let rows = i64::from(duplicate);
        let want = match mode {
            Mode::Lease => (0, 1, 0, 0, 0),
            _ => (rows, rows, 0, 0, 0),
        };
        if (orders, ledger, orphaned, unledgered, points) != want {
            faults.push(format!(
                "{case}: orders {orders}, ledger {ledger}, orphaned {orphaned}, \
                 unledgered {unledgered}, recovery points {points} \
                 (the aborted request's answer: {} {})",
                victim.status,
                String::from_utf8_lossy(&victim.body)
            ));
        }
        let answered_well = match victim.status {
            StatusCode::CREATED => duplicate && victim.replayed(),
            StatusCode::SERVICE_UNAVAILABLE => {
                victim.headers.contains_key(http::header::RETRY_AFTER)
            }
            _ => false,
        };
        if !answered_well {
            faults.push(format!(
                "{case}: the aborted request answered {} {}",
                victim.status,
                String::from_utf8_lossy(&victim.body)
            ));
        }
        judge.close().await;
    }
    faults
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn galera_cluster_keeps_one_effect_per_key() {
    let started = Instant::now();
    let cluster = Cluster::start(3);
    eprintln!("galera: three nodes synced in {:?}", started.elapsed());
    let rounds: usize = std::env::var("GALERA_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let mut cluster = cluster;
    // A claim on a Galera node still waits for what the cluster committed
    // before it (its table-less `SELECT` beside the recording's read); a
    // server that is not a node is not asked to (`tests/round_trips.rs`).
    cluster.create_database("causal");
    assert_eq!(
        causal_wait::selects_per_first_execution(&cluster.url(0, "causal")).await,
        2,
        "the causal wait and the recording batch's read"
    );
    let (mut refused, mut faults) = (0, Vec::new());
    for round in 0..rounds {
        let _load = (round % 3 == 2).then(Load::start);
        let r = concurrent_round(&cluster, &format!("round{round}"), 40, false).await;
        refused += r.refused;
        faults.extend(r.faults);
    }
    // The claim-at-commit mode: duplicates on two nodes both run their
    // handler; the cluster lets one row of the key commit.
    for round in 0..2 {
        let _load = (round == 1).then(Load::start);
        let r = concurrent_round(&cluster, &format!("commit{round}"), 40, true).await;
        refused += r.refused;
        faults.extend(r.faults);
    }
    let conflicts: i64 = (0..3).map(|i| cluster.conflicts(i)).sum();
    faults.extend(abort_at_the_proof(&cluster).await);
    faults.extend(lease_taken_over_on_another_node(&cluster).await);
    faults.extend(node_killed_mid_transaction(&mut cluster).await);
    eprintln!(
        "galera: {rounds} rounds of 40 keys and 2 claiming at commit: {refused} retryable refusals, \
         {conflicts} certification conflicts, in {:?}",
        started.elapsed()
    );
    assert!(faults.is_empty(), "{} faults: {faults:#?}", faults.len());
}
