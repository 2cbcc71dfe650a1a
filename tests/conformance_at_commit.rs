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

/// PostgreSQL alone: a retry the layer remembers as finished reads the
/// ledger first, and that read is a hint only. When it fails (here the
/// service's role may write the ledger's row and the handler's, but not
/// read the ledger's back), the request goes on to its handler as any
/// other, and its lost row is then a store error with nothing committed;
/// a layer that reads first (`with_read_first`) refuses on the same failed
/// read before its handler runs. Judged by the handler's runs and the rows
/// committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_failed_hinted_read_goes_on_to_the_handler() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::Router;
    use axum::routing::post;
    use http::StatusCode;
    use sqlx::AssertSqlSafe;
    use tower_idempotency::testkit::{Harness, order, send};
    use tower_idempotency::{IdempotencyLayer, Principal, Tx};

    let h = Harness::<sqlx::Postgres>::at_commit().await;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let role = format!("ti_writes_only_{}_{nanos}", std::process::id());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE writes (at TIMESTAMPTZ NOT NULL DEFAULT now()); \
         CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA public TO {role}; \
         GRANT INSERT ON writes TO {role}; \
         GRANT INSERT, SELECT (principal_id, operation, idem_key, expires_at) \
         ON idempotency_records TO {role}"
    )))
    .execute(&h.pool)
    .await
    .unwrap();
    let options = (*h.pool.connect_options()).clone().username(&role);
    let writer = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = |layer: IdempotencyLayer<sqlx::Postgres>| {
        let runs = Arc::clone(&runs);
        Router::new()
            .route(
                "/orders",
                post(move |tx: Tx<sqlx::Postgres>| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let mut conn = tx.lock().unwrap();
                    sqlx::query("INSERT INTO writes DEFAULT VALUES")
                        .execute(&mut *conn)
                        .await
                        .unwrap();
                    (StatusCode::CREATED, "made")
                }),
            )
            .layer(layer)
    };
    let request = || {
        let mut req = order(None, Some("k-1"), r#"{"amount": 1}"#);
        req.extensions_mut().insert(Principal::new("alice"));
        req
    };
    let runs_now = || runs.load(Ordering::SeqCst);
    let here = app(IdempotencyLayer::new(writer.clone()).with_claim_at_commit());
    let first = send(&here, request()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(runs_now(), 1);
    // The remembered key's read fails: the handler runs, its row meets the
    // recorded one, and the read that would explain it fails too.
    let retry = send(&here, request()).await;
    assert_eq!(retry.status, StatusCode::SERVICE_UNAVAILABLE, "{retry:?}");
    assert_eq!(runs_now(), 2, "a failed hinted read goes on to the handler");
    // Reading first, the same failed read is a refusal before the handler.
    let reading = app(IdempotencyLayer::new(writer.clone())
        .with_claim_at_commit()
        .with_read_first(true));
    let refused = send(&reading, request()).await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    assert_eq!(runs_now(), 2, "a layer that reads first refuses");
    assert_eq!(h.ledger().await, 1);
    let writes: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM writes")
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert_eq!(writes, 1, "the first execution's alone");
    writer.close().await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP OWNED BY {role}; DROP ROLE {role}"
    )))
    .execute(&h.pool)
    .await
    .unwrap();
}
