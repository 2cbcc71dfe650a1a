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
