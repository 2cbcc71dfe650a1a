//! Fairness between tenants (issue 28): one principal's storm of slow
//! requests (many keys, each sent five times at once) cannot take the
//! whole pool from another principal, whose first executions keep
//! succeeding while the storm holds its share. Judged by the second
//! principal's answers, by the order in which answers came (every one of
//! its orders committed before the storm's first order did), and by the
//! rows committed; on the stores with a connection pool worth sharing
//! (SQLite has one writer for everyone).

use std::sync::Arc;
use std::time::Instant;

use http::StatusCode;
use tokio::sync::Mutex;
use tower_idempotency::testkit::{ConformanceDb, Harness, order, send};

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
async fn postgres() {
    a_storm_from_one_principal_leaves_the_pool_to_another::<sqlx::Postgres>().await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql() {
    a_storm_from_one_principal_leaves_the_pool_to_another::<sqlx::MySql>().await;
}
