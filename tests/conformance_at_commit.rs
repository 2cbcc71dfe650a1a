//! The conformance suite (`src/testkit/cases.rs`) in the claim-at-commit
//! mode (`IdempotencyLayer::with_claim_at_commit`) on every built-in store,
//! judged by the rows committed: "the handler ran once" reads "one
//! execution answered and committed" (`Harness::at_commit`).

tower_idempotency::conformance_suite!(postgres, sqlx::Postgres, at_commit);
tower_idempotency::conformance_suite!(sqlite, sqlx::Sqlite, at_commit);
#[cfg(feature = "mysql")]
tower_idempotency::conformance_suite!(mysql, sqlx::MySql, at_commit);

/// MySQL/MariaDB alone: the recording's insert meets another request's
/// uncommitted row after the handler rolled back (see the case).
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_at_commit_a_rolled_back_handler_meeting_a_held_duplicate() {
    let h = tower_idempotency::testkit::Harness::<sqlx::MySql>::at_commit().await;
    tower_idempotency::testkit::cases::at_commit_a_rolled_back_handler_meeting_a_held_duplicate(h)
        .await;
}

/// A retry of a finished key through the layer that ran it reads the
/// ledger first, so its handler does not run again; through another layer
/// (another instance of the service) it runs and is undone. Judged by the
/// handler's runs and the ledger's rows.
async fn a_retry_through_the_same_layer_does_not_run_the_handler<DB>()
where
    DB: tower_idempotency::testkit::ConformanceDb,
{
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::Router;
    use axum::routing::post;
    use http::StatusCode;
    use tower_idempotency::testkit::{Harness, order, send};

    let h = Harness::<DB>::at_commit().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = |layer| {
        let runs = Arc::clone(&runs);
        Router::new()
            .route(
                "/orders",
                post(move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, "made")
                }),
            )
            .layer(layer)
    };
    let here = app(h.layer());
    let body = r#"{"amount": 1}"#;
    let first = send(&here, order(Some("alice"), Some("k-1"), body)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    for _ in 0..3 {
        let again = send(&here, order(Some("alice"), Some("k-1"), body)).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "retries through this layer");
    let elsewhere = app(h.layer());
    let again = send(&elsewhere, order(Some("alice"), Some("k-1"), body)).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "a retry through another layer"
    );
    assert_eq!(h.ledger().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_retry_through_the_same_layer_does_not_run_the_handler() {
    a_retry_through_the_same_layer_does_not_run_the_handler::<sqlx::Postgres>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_retry_through_the_same_layer_does_not_run_the_handler() {
    a_retry_through_the_same_layer_does_not_run_the_handler::<sqlx::Sqlite>().await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_retry_through_the_same_layer_does_not_run_the_handler() {
    a_retry_through_the_same_layer_does_not_run_the_handler::<sqlx::MySql>().await;
}
