//! The conformance suite (`src/testkit/cases.rs`) in the claim-at-commit
//! mode (`IdempotencyLayer::with_claim_at_commit`) on every built-in store,
//! judged by the rows committed: "the handler ran once" reads "one
//! execution answered and committed" (`Harness::at_commit`).

tower_idempotency::conformance_suite!(postgres, sqlx::Postgres, at_commit);
tower_idempotency::conformance_suite!(sqlite, sqlx::Sqlite, at_commit);
#[cfg(feature = "mysql")]
tower_idempotency::conformance_suite!(mysql, sqlx::MySql, at_commit);
