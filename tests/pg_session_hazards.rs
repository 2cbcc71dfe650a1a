//! Issue 25, on PostgreSQL: nothing of the caller's session and nothing a
//! principal chooses changes what the ledger does. A caller's
//! `bytea_output` never stops a replay; a principal crafted against a
//! session in `SJIS` with `backslash_quote = on` runs no statement of its
//! own; and a principal can never make another principal's claim wait
//! through a colliding scope lock. Judged by the rows committed and by
//! which request finished first, never by a clock.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::Notify;
use tower::util::BoxCloneService;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::{IdempotencyBody, IdempotencyLayer, Principal};

// `post` there sends as one principal; these cases choose theirs.
#[allow(dead_code)]
#[path = "common/orders_app.rs"]
mod orders_app;

use orders_app::{App, claimed_tx, orders_db};

/// An app whose handler writes one order and answers 201 with a body of
/// every byte value; a request with `x-hold: 1` first waits on `hold`.
fn app(pool: PgPool, hold: Arc<Notify>) -> App {
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(pool))
        .service_fn(move |req: Request<IdempotencyBody<String>>| {
            let hold = Arc::clone(&hold);
            async move {
                let tx = claimed_tx(&req);
                {
                    let mut conn = tx.lock().unwrap();
                    sqlx::query("INSERT INTO orders (n) VALUES (1)")
                        .execute(&mut *conn)
                        .await
                        .unwrap();
                }
                if req.headers().contains_key("x-hold") {
                    hold.notified().await;
                }
                let body: String = (0u8..128).map(char::from).collect();
                Ok::<_, Infallible>(Response::builder().status(201).body(body).unwrap())
            }
        });
    BoxCloneService::new(service)
}

async fn send(app: App, principal: &str, key: &str, hold: bool) -> (StatusCode, Vec<u8>) {
    let mut req = Request::post("/orders")
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json");
    if hold {
        req = req.header("x-hold", "1");
    }
    let mut req = req.body("{}".to_string()).unwrap();
    req.extensions_mut().insert(Principal::new(principal));
    let res = app.oneshot(req).await.unwrap();
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes().to_vec();
    (status, body)
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// A pool whose every connection runs `setup` first (the caller's own
/// session settings).
async fn pool_with(url: &str, setup: &'static str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(4)
        .after_connect(move |conn, _| {
            Box::pin(async move { sqlx::raw_sql(setup).execute(conn).await.map(drop) })
        })
        .connect(url)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_bytea_output_never_stops_a_replay() {
    let (url, _drop) = orders_db().await;
    let pool = pool_with(&url, "SET bytea_output = 'escape'").await;
    let app = app(pool.clone(), Arc::new(Notify::new()));
    let (first, body) = send(app.clone(), "user-42", "k-1", false).await;
    assert_eq!(first, StatusCode::CREATED);
    let (replay, replayed) = send(app.clone(), "user-42", "k-1", false).await;
    assert_eq!(replay, StatusCode::CREATED, "the replay is served");
    assert_eq!(replayed, body, "byte for byte");
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
}

/// The operators' statements (the CLI's `show`, the console) bind their
/// values and read results in binary too: a session's `bytea_output`
/// cannot garble a stored answer, and the row is found by its scope.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_read_ignores_the_callers_bytea_output() {
    use tower_idempotency::admin::{Ledger, Lookup};
    let (url, _drop) = orders_db().await;
    let pool = pool_with(&url, "SET bytea_output = 'escape'").await;
    let app = app(pool.clone(), Arc::new(Notify::new()));
    let (first, body) = send(app, "user-42", "k-1", false).await;
    assert_eq!(first, StatusCode::CREATED);
    let rows = Ledger::new(pool)
        .find(&Lookup::new("user-42", "POST /orders", "\"k-1\""))
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].response_body.as_deref(), Some(&body[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crafted_principal_runs_no_statement_of_its_own() {
    let (url, _drop) = orders_db().await;
    let pool = pool_with(
        &url,
        "SET client_encoding = 'SJIS'; SET backslash_quote = on",
    )
    .await;
    let app = app(pool.clone(), Arc::new(Notify::new()));
    // `Á` ends in 0x81, an SJIS lead byte that swallows the backslash an
    // escaper doubles: the literal would close early and the rest run.
    let crafted = "\u{c1}\\', E'', E'', E''::bytea, 0, 1); \
                   CREATE TABLE injected_by_a_principal (x INT); --";
    let _ = send(app.clone(), crafted, "k-1", false).await;
    let _ = send(app.clone(), crafted, "k-1", false).await;
    let injected = count(
        &pool,
        "SELECT count(*) FROM pg_class WHERE relname = 'injected_by_a_principal'",
    )
    .await;
    assert_eq!(injected, 0, "a principal ran a statement of its own");
    assert!(
        count(&pool, "SELECT count(*) FROM orders").await <= 1,
        "one order at most"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_never_waits_on_another_principals_scope() {
    let (url, _drop) = orders_db().await;
    let pool = PgPool::connect(&url).await.unwrap();
    // Two scopes of two principals whose 32-bit `hashtext` meet (what the
    // lock keyed on before ledger v8): found among 2 × 200 000 keys.
    let pair: Option<(String, String)> = sqlx::query_as(
        "SELECT min(k) FILTER (WHERE p = 'alice'), min(k) FILTER (WHERE p = 'bob') \
         FROM (SELECT p, p || '-' || g AS k, \
           hashtext(p || E'\\n' || 'POST /orders' || E'\\n' || p || '-' || g) AS h \
           FROM unnest(ARRAY['alice', 'bob']) p, generate_series(1, 200000) g) s \
         GROUP BY h HAVING count(DISTINCT p) = 2 LIMIT 1",
    )
    .fetch_optional(&pool)
    .await
    .unwrap();
    let (alice_key, bob_key) = pair.expect("a colliding pair among 4e10 pairs");
    let hold = Arc::new(Notify::new());
    let app = app(pool.clone(), Arc::clone(&hold));
    // Alice's request holds its claim until Bob's has answered.
    let alice = {
        let app = app.clone();
        tokio::spawn(async move { send(app, "alice", &alice_key, true).await })
    };
    while count(
        &pool,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'",
    )
    .await
        == 0
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (bob, _) = send(app.clone(), "bob", &bob_key, false).await;
    assert!(
        !alice.is_finished(),
        "Alice's request still holds its scope"
    );
    hold.notify_one();
    let (alice, _) = alice.await.unwrap();
    assert_eq!(
        bob,
        StatusCode::CREATED,
        "Bob's first execution ran at once"
    );
    assert_eq!(alice, StatusCode::CREATED);
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 2);
}

/// A duplicate that waited for the scope's lock and then won keeps the
/// scope through a final business error: rolling its business writes back
/// to the claim's savepoint must not let a third request, waiting behind
/// it, in before its answer is recorded (one execution, one answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_that_wins_keeps_the_scope_through_a_final_error() {
    use tower_idempotency::testkit::{ConformanceDb, Harness, order, send};
    let h = Harness::<sqlx::Postgres>::new().await;
    let layer = || h.layer().with_in_flight_wait(Duration::from_secs(5));
    let (b, c) = (h.app_with(layer()), h.app_with(layer()));
    // Out of stock: a final business error, recorded.
    let body = r#"{"amount":1,"items":[{"sku":"none","qty":1}]}"#;
    let key = "checkout-20260914-001";
    let holder =
        <sqlx::Postgres as ConformanceDb>::hold_claim(&h.pool, "user-42", "POST /orders", key)
            .await;
    let second =
        tokio::spawn(async move { send(&b, order(Some("user-42"), Some(key), body)).await });
    let third =
        tokio::spawn(async move { send(&c, order(Some("user-42"), Some(key), body)).await });
    // Both wait on the holder's lock; it goes away with nothing recorded.
    tokio::time::sleep(Duration::from_millis(400)).await;
    holder.rollback().await.unwrap();
    let (second, third) = (second.await.unwrap(), third.await.unwrap());
    assert_eq!(second.status, StatusCode::CONFLICT, "{second:?}");
    assert_eq!(third.status, StatusCode::CONFLICT, "{third:?}");
    assert_eq!(
        h.executions(),
        1,
        "one of the two waiters ran, the other replayed"
    );
    assert_eq!(h.ledger_with("FAILED_FINAL").await, 1);
}

/// A lease write behind a row lock another session holds gives up after
/// its bound (a `lock_timeout` inside the statement), as a lock timeout,
/// and leaves the session's own `lock_timeout` as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_write_behind_a_held_row_waits_within_its_bound() {
    use sqlx::Acquire;
    use tower_idempotency::store::{
        Backend, Claim, Fence, IsolationLevel, LeaseWrite, Scope, StoreErrorKind,
    };
    let (url, _drop) = orders_db().await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    let scope = Scope {
        principal: "user-42",
        operation: "POST /pay",
        key: "k-1",
    };
    let claim = Claim {
        scope,
        fingerprint: &[7; 32],
        retention_ms: 60_000,
        lock_wait: Duration::from_secs(1),
        isolation: IsolationLevel::ReadCommitted,
        cached_statements: true,
        database: None,
        causal_wait: true,
    };
    assert!(
        sqlx::Postgres::lease_claim(&pool, &claim, 30_000, "c1")
            .await
            .unwrap()
    );
    // Another session holds the row.
    let other = PgPool::connect(&url).await.unwrap();
    let mut conn = other.acquire().await.unwrap();
    let mut holder = conn.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_records WHERE idem_key = 'k-1' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let fence = Fence {
        generation: 1,
        claim: Some("c1"),
    };
    let write = tokio::time::timeout(
        Duration::from_secs(30),
        sqlx::Postgres::lease_write(
            &pool,
            &scope,
            fence,
            &LeaseWrite::Renew { lease_ms: 30_000 },
        ),
    )
    .await
    .expect("the write ends by its own bound, not the test's");
    let e = write.expect_err("the row stays held past the bound");
    assert_eq!(
        sqlx::Postgres::error_kind(&e),
        StoreErrorKind::LockTimeout,
        "{e}"
    );
    holder.rollback().await.unwrap();
    // The pool's one connection ran the write: its session setting is
    // the server's default still.
    let after: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(after, "0");
    // Once the row is free the same write goes through.
    assert!(
        sqlx::Postgres::lease_write(
            &pool,
            &scope,
            fence,
            &LeaseWrite::Renew { lease_ms: 30_000 }
        )
        .await
        .unwrap()
    );
}
