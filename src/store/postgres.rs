//! PostgreSQL: the production store.

use std::time::Duration;

use sqlx::postgres::Postgres;
use sqlx::{AssertSqlSafe, Pool, Transaction};

use super::{Backend, StoreErrorKind, generic_error_kind, shared_statements};

impl Backend for Postgres {
    async fn migrate(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(include_str!(
            "../../migrations/postgres/0001_idempotency_records.sql"
        ))
        .execute(pool)
        .await
        .map(drop)
    }

    async fn begin_claim(
        pool: &Pool<Self>,
        lock_wait: Duration,
    ) -> Result<Transaction<'static, Self>, sqlx::Error> {
        // One round trip: the claim's lock wait is bounded, and READ COMMITTED
        // lets the insert see a winner that committed while it waited.
        let ms = lock_wait.as_millis().clamp(1, i32::MAX as u128);
        pool.begin_with(AssertSqlSafe(format!(
            "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = '{ms}ms'"
        )))
        .await
    }

    async fn savepoint(conn: &mut Self::Connection) -> Result<(), sqlx::Error> {
        // The handler's own lock waits go back to the session's setting.
        sqlx::raw_sql("SET LOCAL lock_timeout = DEFAULT; SAVEPOINT tower_idempotency_claimed")
            .execute(&mut *conn)
            .await
            .map(drop)
    }

    shared_statements!(
        Postgres,
        insert = "INSERT INTO idempotency_records \
                  (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at) \
                  VALUES ($1, $2, $3, $4, 'PROCESSING', $5, $6) \
                  ON CONFLICT (principal_id, operation, idem_key) DO NOTHING",
        complete = "UPDATE idempotency_records SET status = $1, response_status = $2, \
                    response_headers = $3, response_body = $4, resource_id = $5 \
                    WHERE principal_id = $6 AND operation = $7 AND idem_key = $8",
        fetch = "SELECT status, request_fingerprint, response_status, response_headers, \
                 response_body, resource_id, expires_at FROM idempotency_records \
                 WHERE principal_id = $1 AND operation = $2 AND idem_key = $3",
        expire = "UPDATE idempotency_records SET status = 'EXPIRED', response_headers = NULL, \
                  response_body = NULL WHERE (principal_id, operation, idem_key) IN \
                  (SELECT principal_id, operation, idem_key FROM idempotency_records \
                  WHERE status IN ('SUCCEEDED', 'FAILED_FINAL') AND expires_at <= $1 \
                  LIMIT $2 FOR UPDATE SKIP LOCKED)",
        purge = "DELETE FROM idempotency_records WHERE (principal_id, operation, idem_key) IN \
                 (SELECT principal_id, operation, idem_key FROM idempotency_records \
                 WHERE status = 'EXPIRED' AND expires_at <= $1 LIMIT $2 FOR UPDATE SKIP LOCKED)",
    );

    fn error_kind(err: &sqlx::Error) -> StoreErrorKind {
        if let Some(kind) = generic_error_kind(err) {
            return kind;
        }
        match err.as_database_error().and_then(|e| e.code()) {
            // lock_not_available: our lock_timeout fired.
            Some(code) if code == "55P03" => StoreErrorKind::LockTimeout,
            // connection_exception (08…), operator intervention (57P…: terminated, shutdown).
            Some(code) if code.starts_with("08") || code.starts_with("57P") => {
                StoreErrorKind::ConnectionLost
            }
            _ => StoreErrorKind::Other,
        }
    }
}
