//! MySQL and MariaDB (InnoDB).

use sqlx::mysql::{MySql, MySqlDatabaseError};
use sqlx::{AssertSqlSafe, Pool};

use super::{Backend, StoreErrorKind, claim_by_statements, generic_error_kind, shared_statements};

impl Backend for MySql {
    async fn migrate(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(include_str!(
            "../../migrations/mysql/0001_idempotency_records.sql"
        ))
        .execute(pool)
        .await
        .map(drop)
    }

    // InnoDB counts lock waits in whole seconds (at least 1), per session; the
    // savepoint step puts the server's setting back. READ COMMITTED lets
    // the read after a lost claim see the winner's row. A plain insert: a
    // duplicate key is the driver's unique-violation error (which ends the
    // statement, not the transaction). Not `ON DUPLICATE KEY UPDATE`, whose
    // affected-row count is 1 for a no-op update when the client asks for
    // found rows, as sqlx does; not `INSERT IGNORE`, which also swallows
    // unrelated errors.
    claim_by_statements!(
        MySql,
        begin = |pool, lock_wait| {
            let secs = lock_wait.as_secs_f64().ceil().clamp(1.0, 3600.0) as u64;
            pool.begin_with(AssertSqlSafe(format!(
                "SET SESSION innodb_lock_wait_timeout = {secs}; \
                 SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION"
            )))
        },
        insert = "INSERT INTO idempotency_records \
                  (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at) \
                  VALUES (?, ?, ?, ?, 'PROCESSING', ?, ?)",
        // The handler's own lock waits go back to the server's setting.
        savepoint = "SAVEPOINT tower_idempotency_claimed; \
                     SET SESSION innodb_lock_wait_timeout = DEFAULT",
    );

    shared_statements!(
        MySql,
        complete = "UPDATE idempotency_records SET status = ?, response_status = ?, \
                    response_headers = ?, response_body = ?, resource_id = ? \
                    WHERE principal_id = ? AND operation = ? AND idem_key = ?",
        fetch = "SELECT status, request_fingerprint, response_status, response_headers, \
                 response_body, resource_id, expires_at FROM idempotency_records \
                 WHERE principal_id = ? AND operation = ? AND idem_key = ?",
        expire = "UPDATE idempotency_records SET status = 'EXPIRED', response_headers = NULL, \
                  response_body = NULL \
                  WHERE status IN ('SUCCEEDED', 'FAILED_FINAL') AND expires_at <= ? LIMIT ?",
        purge =
            "DELETE FROM idempotency_records WHERE status = 'EXPIRED' AND expires_at <= ? LIMIT ?",
    );

    fn error_kind(err: &sqlx::Error) -> StoreErrorKind {
        if let Some(kind) = generic_error_kind(err) {
            return kind;
        }
        let number = err
            .as_database_error()
            .and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>())
            .map(MySqlDatabaseError::number);
        match number {
            // ER_LOCK_WAIT_TIMEOUT, ER_LOCK_DEADLOCK
            Some(1205 | 1213) => StoreErrorKind::LockTimeout,
            // server gone / lost / killed
            Some(2006 | 2013 | 1927 | 1053) => StoreErrorKind::ConnectionLost,
            _ => StoreErrorKind::Other,
        }
    }
}
