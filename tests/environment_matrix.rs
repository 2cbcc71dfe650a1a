//! The conformance suite in the caller's environments (issue 33): every
//! case on every store, each under one isolation level, session setting
//! and handler prelude chosen by `TOWER_IDEMPOTENCY_MATRIX_SEED` (see
//! `tower_idempotency::testkit::environment` and docs/testing.md), judged by
//! the rows committed as in `tests/conformance.rs`; and the claim-at-commit
//! mode's suite (`tests/conformance_at_commit.rs`) the same way, each case
//! under an environment picked apart from its claim-first twin's.

tower_idempotency::conformance_suite!(postgres, sqlx::Postgres, matrix);
tower_idempotency::conformance_suite!(sqlite, sqlx::Sqlite, matrix);
#[cfg(feature = "mysql")]
tower_idempotency::conformance_suite!(mysql, sqlx::MySql, matrix);

tower_idempotency::conformance_suite!(postgres_at_commit, sqlx::Postgres, at_commit_matrix);
tower_idempotency::conformance_suite!(sqlite_at_commit, sqlx::Sqlite, at_commit_matrix);
#[cfg(feature = "mysql")]
tower_idempotency::conformance_suite!(mysql_at_commit, sqlx::MySql, at_commit_matrix);
