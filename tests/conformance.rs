//! The conformance suite (`src/testkit/cases.rs`) on every built-in store:
//! the decision table of `../shared/CONTRACT.md` and the seed's acceptance
//! list, judged by the rows committed.

tower_idempotency::conformance_suite!(postgres, sqlx::Postgres);
tower_idempotency::conformance_suite!(sqlite, sqlx::Sqlite);
#[cfg(feature = "mysql")]
tower_idempotency::conformance_suite!(mysql, sqlx::MySql);
