//! SQLite: the embedded default.

use sqlx::Pool;
use sqlx::sqlite::Sqlite;

use super::{Backend, StoreErrorKind, claim_by_statements, generic_error_kind, shared_statements};

impl Backend for Sqlite {
    async fn migrate(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(include_str!(
            "../../migrations/sqlite/0001_idempotency_records.sql"
        ))
        .execute(pool)
        .await
        .map(drop)
    }

    // Take the write lock up front: SQLite has one writer, and a deferred
    // transaction that read first could not upgrade after waiting. The wait
    // is bounded by the connection's busy_timeout.
    claim_by_statements!(
        Sqlite,
        begin = |pool, _lock_wait| pool.begin_with("BEGIN IMMEDIATE"),
        insert = "INSERT INTO idempotency_records \
                  (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at) \
                  VALUES (?, ?, ?, ?, 'PROCESSING', ?, ?) \
                  ON CONFLICT (principal_id, operation, idem_key) DO NOTHING",
        savepoint = "SAVEPOINT tower_idempotency_claimed",
    );

    shared_statements!(
        Sqlite,
        complete = "UPDATE idempotency_records SET status = ?, response_status = ?, \
                    response_headers = ?, response_body = ?, resource_id = ? \
                    WHERE principal_id = ? AND operation = ? AND idem_key = ?",
        fetch = "SELECT status, request_fingerprint, response_status, response_headers, \
                 response_body, resource_id, expires_at FROM idempotency_records \
                 WHERE principal_id = ? AND operation = ? AND idem_key = ?",
        expire = "UPDATE idempotency_records SET status = 'EXPIRED', response_headers = NULL, \
                  response_body = NULL WHERE rowid IN (SELECT rowid FROM idempotency_records \
                  WHERE status IN ('SUCCEEDED', 'FAILED_FINAL') AND expires_at <= ? LIMIT ?)",
        purge = "DELETE FROM idempotency_records WHERE rowid IN (SELECT rowid FROM idempotency_records \
                 WHERE status = 'EXPIRED' AND expires_at <= ? LIMIT ?)",
    );

    fn error_kind(err: &sqlx::Error) -> StoreErrorKind {
        if let Some(kind) = generic_error_kind(err) {
            return kind;
        }
        let code = err.as_database_error().and_then(|e| e.code());
        // SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their extended codes.
        match code.as_deref().and_then(|c| c.parse::<i32>().ok()) {
            Some(c) if matches!(c & 0xff, 5 | 6) => StoreErrorKind::LockTimeout,
            _ => StoreErrorKind::Other,
        }
    }
}
