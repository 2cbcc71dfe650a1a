//! The connection dies *during* `COMMIT` (PostgreSQL): the layer cannot know
//! whether the commit landed, re-reads the ledger, finds nothing, and answers
//! a retryable 503; the retry runs exactly once.
//!
//! The failure is produced by the database itself: a deferred constraint
//! trigger on the business table runs at `COMMIT` and terminates its own
//! backend, so the commit never completes and the client sees the
//! connection drop mid-`COMMIT`.

use tower_idempotency::testkit::{ConformanceDb, Harness, order, send};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_lost_during_commit_answers_503_and_the_retry_runs_once() {
    let h = Harness::<sqlx::Postgres>::new().await;
    sqlx::raw_sql(
        "CREATE FUNCTION die_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.amount = 666 THEN PERFORM pg_terminate_backend(pg_backend_pid()); END IF;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER die_at_commit AFTER INSERT ON orders
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION die_at_commit();",
    )
    .execute(&h.pool)
    .await
    .unwrap();
    let app = h.app();
    let key = Some("commit-lost");
    let lost = send(&app, order(Some("user-42"), key, r#"{"amount":666}"#)).await;
    assert_eq!(
        lost.status,
        http::StatusCode::SERVICE_UNAVAILABLE,
        "{lost:?}"
    );
    assert_eq!(lost.problem(), "commit-unknown");
    assert!(lost.headers.contains_key("retry-after"));
    h.assert_nothing_stored().await;
    assert_eq!(h.executions(), 1);

    sqlx::raw_sql("DROP TRIGGER die_at_commit ON orders")
        .execute(&h.pool)
        .await
        .unwrap();
    let retry = send(&app, order(Some("user-42"), key, r#"{"amount":666}"#)).await;
    assert_eq!(retry.status, http::StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    let again = send(&app, order(Some("user-42"), key, r#"{"amount":666}"#)).await;
    assert!(again.replayed());
    assert_eq!(h.executions(), 2);
    assert_eq!(h.orders().await, 1);
    assert_eq!(
        <sqlx::Postgres as ConformanceDb>::count(
            &h.pool,
            "SELECT COUNT(*) FROM idempotency_records WHERE status = 'SUCCEEDED'"
        )
        .await,
        1
    );
}
