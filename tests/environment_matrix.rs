//! The conformance suite in the caller's environments (issue 33): every
//! case on every store, each under one isolation level, session setting
//! and handler prelude chosen by `TOWER_IDEMPOTENCY_MATRIX_SEED` (see
//! `tower_idempotency::testkit::environment` and docs/testing.md), judged by
//! the rows committed as in `tests/conformance.rs`.

tower_idempotency::conformance_suite!(postgres, sqlx::Postgres, matrix);
tower_idempotency::conformance_suite!(sqlite, sqlx::Sqlite, matrix);
#[cfg(feature = "mysql")]
tower_idempotency::conformance_suite!(mysql, sqlx::MySql, matrix);
