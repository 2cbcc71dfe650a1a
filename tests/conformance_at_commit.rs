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
/// (another instance of the service) it runs and is undone. A key that
/// finished with nothing recorded (a `5xx`) runs again and is recorded,
/// and another principal's key of the same name is its own. Judged by the
/// handler's runs and the ledger's rows.
async fn a_retry_through_the_same_layer_does_not_run_the_handler<DB>()
where
    DB: tower_idempotency::testkit::ConformanceDb,
{
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use axum::Router;
    use axum::routing::post;
    use http::StatusCode;
    use tower_idempotency::testkit::{Harness, order, send};

    let h = Harness::<DB>::at_commit().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let failing = Arc::new(AtomicBool::new(false));
    let app = |layer| {
        let (runs, failing) = (Arc::clone(&runs), Arc::clone(&failing));
        Router::new()
            .route(
                "/orders",
                post(move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    match failing.load(Ordering::SeqCst) {
                        true => (StatusCode::INTERNAL_SERVER_ERROR, "down"),
                        false => (StatusCode::CREATED, "made"),
                    }
                }),
            )
            .layer(layer)
    };
    let runs_now = || runs.load(Ordering::SeqCst);
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
    assert_eq!(runs_now(), 1, "retries through this layer");
    let elsewhere = app(h.layer());
    let again = send(&elsewhere, order(Some("alice"), Some("k-1"), body)).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(runs_now(), 2, "a retry through another layer");
    // Another principal's key of the same name: its own first execution.
    let bob = send(&here, order(Some("bob"), Some("k-1"), body)).await;
    assert_eq!(bob.status, StatusCode::CREATED);
    assert!(!bob.replayed());
    assert_eq!(runs_now(), 3, "bob's key");
    // A key that finished with nothing recorded runs again when retried.
    failing.store(true, Ordering::SeqCst);
    let down = send(&here, order(Some("alice"), Some("k-2"), body)).await;
    assert_eq!(down.status, StatusCode::INTERNAL_SERVER_ERROR);
    failing.store(false, Ordering::SeqCst);
    let retried = send(&here, order(Some("alice"), Some("k-2"), body)).await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert!(!retried.replayed());
    assert_eq!(runs_now(), 5, "the 5xx and its retry");
    assert_eq!(h.ledger().await, 3, "alice's k-1 and k-2, bob's k-1");
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
