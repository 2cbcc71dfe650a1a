//! Fairness between tenants (issues 28 and 33): one principal's storm of
//! slow requests (many keys, each sent five times at once) cannot take the
//! whole pool from another principal, whose first executions keep
//! succeeding while the storm holds its share; nor can two storms, or
//! many, together: the reserve (the pool's last quarter) goes only to
//! principals that hold no connection, and a connection given back goes to
//! the principal that holds the fewest. On SQLite, whose one writer every
//! claim needs, principals take turns at the writer. Judged by the second
//! principal's answers, by the order of events (which handlers had a
//! connection when the calm tenant was answered; storms' handlers hold
//! theirs until the test opens their gate) and by the rows committed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::{HeaderMap, StatusCode};
use tokio::sync::{Mutex, Semaphore};
use tower_idempotency::testkit::{Answer, ConformanceDb, Harness, order, send};
use tower_idempotency::{IdempotencyLayer, Principal, Tx};

const STORM_KEYS: usize = 40;
const COPIES: usize = 5;

async fn a_storm_from_one_principal_leaves_the_pool_to_another<DB: ConformanceDb>() {
    let h = Harness::<DB>::new().await;
    // The harness pool has 20 connections: by default a principal may hold
    // 15 of them.
    let app = h.app();
    let storm_done: Arc<Mutex<Vec<(Instant, StatusCode)>>> = Arc::default();
    let mut storm = Vec::new();
    for k in 0..STORM_KEYS {
        for _ in 0..COPIES {
            let app = app.clone();
            let done = Arc::clone(&storm_done);
            storm.push(tokio::spawn(async move {
                let key = format!("\"storm-{k}\"");
                let body = r#"{"amount":1,"items":[],"sleep_ms":2500}"#;
                let answer = send(&app, order(Some("user-storm"), Some(&key), body)).await;
                done.lock().await.push((Instant::now(), answer.status));
                answer
            }));
        }
    }
    // The other tenant's first executions, one after another, while the
    // storm's handlers sleep on their connections.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let mut finished = Vec::new();
    for i in 0..10 {
        let key = format!("\"calm-{i}\"");
        let answer = send(
            &app,
            order(Some("user-calm"), Some(&key), r#"{"amount":2,"items":[]}"#),
        )
        .await;
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
        finished.push(Instant::now());
    }
    let calm_last = *finished.last().expect("ten answers");
    for s in storm {
        let answer = s.await.expect("no panic");
        // The storm's own: an order, or a retryable refusal (its share
        // in use: 503; a copy that outwaited its first: 409).
        assert!(
            answer.status == StatusCode::CREATED
                || ([StatusCode::SERVICE_UNAVAILABLE, StatusCode::CONFLICT]
                    .contains(&answer.status)
                    && answer.headers.contains_key("retry-after")),
            "{answer:?}"
        );
    }
    let done = storm_done.lock().await;
    let first_storm_order = done
        .iter()
        .filter(|(_, s)| *s == StatusCode::CREATED)
        .map(|(at, _)| *at)
        .min()
        .expect("the storm's own share made orders");
    assert!(
        calm_last < first_storm_order,
        "the calm tenant's orders never waited for the storm's"
    );
    let storm_keys_ordered = DB::count(
        &h.pool,
        "SELECT COUNT(*) FROM idempotency_records WHERE principal_id = 'user-storm'",
    )
    .await;
    let calm = DB::count(
        &h.pool,
        "SELECT COUNT(*) FROM idempotency_records WHERE principal_id = 'user-calm'",
    )
    .await;
    assert_eq!(calm, 10);
    assert!(storm_keys_ordered >= 1 && storm_keys_ordered <= STORM_KEYS as i64);
    assert_eq!(
        h.orders().await,
        10 + storm_keys_ordered,
        "one order per recorded key, never two"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_one_storm() {
    a_storm_from_one_principal_leaves_the_pool_to_another::<sqlx::Postgres>().await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_one_storm() {
    a_storm_from_one_principal_leaves_the_pool_to_another::<sqlx::MySql>().await;
}

/// How long the test waits for an event that should come at once: far
/// from the work, so only a real stall (or the defect) reaches it.
const FAR: Duration = Duration::from_secs(30);

/// The storms' handlers hold their transaction (and connection) until
/// their principal's gate lets one through; every handler's entry is
/// counted per principal.
#[derive(Clone, Default)]
struct World {
    entered: Arc<std::sync::Mutex<HashMap<String, usize>>>,
    /// Whose handlers ran, in order.
    log: Arc<std::sync::Mutex<Vec<String>>>,
    gates: Arc<std::sync::Mutex<HashMap<String, Arc<Semaphore>>>>,
}

impl World {
    fn gate(&self, principal: &str) -> Arc<Semaphore> {
        let mut gates = self.gates.lock().unwrap();
        Arc::clone(
            gates
                .entry(principal.to_string())
                .or_insert_with(|| Arc::new(Semaphore::new(0))),
        )
    }

    fn entered(&self, principal: &str) -> usize {
        *self.entered.lock().unwrap().get(principal).unwrap_or(&0)
    }

    fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    fn all_entered(&self) -> usize {
        self.entered.lock().unwrap().values().sum()
    }

    /// Lets `n` of `principal`'s handlers finish.
    fn open(&self, principal: &str, n: usize) {
        self.gate(principal).add_permits(n);
    }
}

fn bearer(parts: &http::request::Parts) -> Option<Principal> {
    let v = parts.headers.get("authorization")?.to_str().ok()?;
    Some(Principal::new(v.strip_prefix("Bearer ")?))
}

async fn gated_order<DB: ConformanceDb>(
    State(world): State<World>,
    headers: HeaderMap,
    tx: Tx<DB>,
) -> Response {
    let principal = headers["authorization"]
        .to_str()
        .unwrap()
        .trim_start_matches("Bearer ")
        .to_string();
    {
        let mut conn = tx.lock().unwrap();
        DB::insert_order(&mut conn, &principal, 1).await.unwrap();
    }
    *world
        .entered
        .lock()
        .unwrap()
        .entry(principal.clone())
        .or_default() += 1;
    world.log.lock().unwrap().push(principal.clone());
    if principal.starts_with("storm") {
        let gate = world.gate(&principal);
        let permit = tokio::time::timeout(Duration::from_secs(120), gate.acquire()).await;
        if let Ok(Ok(permit)) = permit {
            permit.forget();
        }
    }
    StatusCode::CREATED.into_response()
}

fn gated_app<DB: ConformanceDb>(layer: IdempotencyLayer<DB>, world: &World) -> Router {
    Router::new()
        .route("/orders", post(gated_order::<DB>))
        .layer(layer)
        .with_state(world.clone())
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < FAR, "never happened: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

type Sent = tokio::task::JoinHandle<Answer>;

fn storm_requests(app: &Router, principal: &str, n: usize, sent: &mut Vec<Sent>) {
    for k in 0..n {
        let app = app.clone();
        let principal = principal.to_string();
        sent.push(tokio::spawn(async move {
            let key = format!("\"{principal}-{k}\"");
            send(&app, order(Some(&principal), Some(&key), r#"{"amount":1}"#)).await
        }));
    }
}

/// Opens every gate, and checks the storms' answers (an order, or a
/// retryable refusal) and that every answered order committed once.
async fn settle<DB: ConformanceDb>(
    h: &Harness<DB>,
    world: &World,
    storms: usize,
    sent: Vec<Sent>,
    calm: i64,
) {
    for s in 0..storms {
        world.open(&format!("storm-{s}"), 10_000);
    }
    let mut ordered = 0;
    for s in sent {
        let answer = s.await.expect("no panic");
        if answer.status == StatusCode::CREATED {
            ordered += 1;
        } else {
            assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
            assert_eq!(answer.problem(), "store-busy");
            assert!(answer.headers.contains_key("retry-after"));
        }
    }
    assert_eq!(h.orders().await, ordered + calm, "one order per answer");
    assert_eq!(h.ledger_with("SUCCEEDED").await, ordered + calm);
}

/// `storms` principals storm a pool of `pool_size` one after another, so
/// that the first holds its whole share and each other one a connection
/// of the reserve: with as many storms as the reserve has connections
/// plus one, every connection is held. One of the first storm's requests
/// ends; the calm tenant's five first executions, one after another, are
/// all answered `201` before any storm gets another connection.
async fn storms_leave_the_calm_tenant_a_turn<DB: ConformanceDb>(pool_size: u32, storms: usize) {
    let h = Harness::<DB>::new().await;
    let pool = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(pool_size)
        .acquire_timeout(FAR)
        .connect_with((*h.pool.connect_options()).clone())
        .await
        .unwrap();
    let layer = IdempotencyLayer::new(pool)
        .with_principal(bearer)
        .with_in_flight_wait(Duration::from_secs(10));
    let world = World::default();
    let app = gated_app(layer, &world);
    let share = pool_size as usize - pool_size as usize / 4;
    let mut sent = Vec::new();
    storm_requests(&app, "storm-0", share + 2, &mut sent);
    until("the first storm holds its share", || {
        world.entered("storm-0") == share
    })
    .await;
    for s in 1..storms {
        let principal = format!("storm-{s}");
        storm_requests(&app, &principal, 3, &mut sent);
        until(&format!("{principal} holds a connection"), || {
            world.entered(&principal) >= 1
        })
        .await;
    }
    world.open("storm-0", 1);
    for i in 0..5 {
        let key = format!("\"calm-{i}\"");
        let answer = send(&app, order(Some("calm"), Some(&key), r#"{"amount":2}"#)).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    }
    assert_eq!(
        world.entered("storm-0"),
        share,
        "the first storm had no turn before the calm tenant"
    );
    for s in 1..storms {
        assert_eq!(
            world.entered(&format!("storm-{s}")),
            1,
            "storm-{s} took no second connection before the calm tenant"
        );
    }
    settle(&h, &world, storms, sent, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_storms_on_a_pool_of_four() {
    storms_leave_the_calm_tenant_a_turn::<sqlx::Postgres>(4, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_six_storms_on_a_pool_of_twenty() {
    storms_leave_the_calm_tenant_a_turn::<sqlx::Postgres>(20, 6).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_two_storms_on_a_pool_of_four() {
    storms_leave_the_calm_tenant_a_turn::<sqlx::MySql>(4, 2).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_six_storms_on_a_pool_of_twenty() {
    storms_leave_the_calm_tenant_a_turn::<sqlx::MySql>(20, 6).await;
}

/// SQLite: one storm holds the writer (its handler waits at its gate) with
/// more of its requests, and `storms - 1` other storms', waiting; then the
/// calm tenant sends one request. The test lets whichever storm request
/// holds the writer finish, one at a time: the calm tenant's request is
/// answered `201` before any storm has a second turn (each storm that came
/// before it had one; the calm tenant came before their seconds).
#[cfg(feature = "sqlite")]
async fn calm_takes_its_turn_at_the_writer(storms: usize) {
    let h = Harness::<sqlx::Sqlite>::new().await;
    let layer = h
        .layer()
        .with_in_flight_wait(Duration::from_secs(60))
        .with_claim_retries(3, Duration::from_secs(60));
    let world = World::default();
    let app = gated_app(layer.clone(), &world);
    let mut sent = Vec::new();
    storm_requests(&app, "storm-0", 4, &mut sent);
    until("the storm holds the writer", || {
        world.entered("storm-0") == 1
    })
    .await;
    for s in 1..storms {
        storm_requests(&app, &format!("storm-{s}"), 4, &mut sent);
    }
    // The calm tenant comes after every storm request waits (spawned
    // tasks may start in any order on a busy machine, and a turn goes to
    // the earliest waiter among equals).
    let storming = 3 + 4 * (storms - 1);
    until("every storm request waits for its turn", || {
        layer.waiting_for_a_turn() == storming
    })
    .await;
    let calm = tokio::spawn({
        let app = app.clone();
        async move {
            send(
                &app,
                order(Some("calm"), Some("\"calm-0\""), r#"{"amount":2}"#),
            )
            .await
        }
    });
    let queued = storming + 1;
    until("every request waits for its turn", || {
        layer.waiting_for_a_turn() == queued || calm.is_finished()
    })
    .await;
    let calm_ran = || world.log().iter().any(|p| p == "calm");
    let mut opened = vec![0; storms];
    while !calm_ran() && !calm.is_finished() {
        let before = world.all_entered();
        let holder = (0..storms)
            .find(|&s| world.entered(&format!("storm-{s}")) > opened[s])
            .expect("a storm request holds the writer");
        world.open(&format!("storm-{holder}"), 1);
        opened[holder] += 1;
        until("the writer's next turn", || {
            world.all_entered() > before || calm.is_finished()
        })
        .await;
    }
    let answer = calm.await.unwrap();
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    let log = world.log();
    let calm_at = log.iter().position(|p| p == "calm").expect("calm ran");
    for s in 0..storms {
        let storm = format!("storm-{s}");
        assert_eq!(
            log[..calm_at].iter().filter(|p| **p == storm).count(),
            1,
            "{storm} had one turn before the calm tenant's: {log:?}"
        );
    }
    settle(&h, &world, storms, sent, 1).await;
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_one_storm_at_the_writer() {
    calm_takes_its_turn_at_the_writer(1).await;
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_three_storms_at_the_writer() {
    calm_takes_its_turn_at_the_writer(3).await;
}
