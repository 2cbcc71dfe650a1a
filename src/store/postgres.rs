//! PostgreSQL: the production store.

use sqlx::pool::{MaybePoolConnection, PoolConnection};
use sqlx::postgres::Postgres;
use sqlx::{AssertSqlSafe, Pool, Row, SqlSafeStr, Transaction};

use super::literal::hex;
use super::{
    Backend, Claim, ClaimOutcome, Completion, Migration, RecordStatus, SAVEPOINT, Scope,
    StoreErrorKind, generic_error_kind, run_migrations, shared_statements,
};

/// The database clock, epoch milliseconds (the transaction's start time).
macro_rules! now_ms {
    () => {
        "(EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT"
    };
}

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "idempotency_records",
        sql: include_str!("../../migrations/postgres/0001_idempotency_records.sql"),
    },
    Migration {
        version: 2,
        name: "byte_scopes_and_reconciliation",
        sql: include_str!("../../migrations/postgres/0002_byte_scopes_and_reconciliation.sql"),
    },
];

impl Backend for Postgres {
    async fn migrate(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        // One transaction: PostgreSQL's DDL is transactional, and the
        // advisory lock (released at commit) serializes concurrent callers.
        let mut tx = pool.begin().await?;
        run_migrations!(
            &mut *tx,
            MIGRATIONS,
            create = "SELECT pg_advisory_xact_lock(7412390118661024); \
                      CREATE TABLE IF NOT EXISTS tower_idempotency_migrations \
                      (version BIGINT PRIMARY KEY, name TEXT NOT NULL, applied_at BIGINT NOT NULL)",
            record = concat!(
                "INSERT INTO tower_idempotency_migrations (version, name, applied_at) VALUES ($1, $2, ",
                now_ms!(),
                ")"
            ),
        )?;
        tx.commit().await
    }

    async fn claim(
        conn: PoolConnection<Self>,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome<Self>, sqlx::Error> {
        // One round trip. The statements run in the implicit transaction of
        // a multi-statement query until `BEGIN` turns it into an explicit
        // one that stays open for the handler. So a lost claim (the insert's
        // unique violation), a lock timeout or a serialization failure rolls
        // everything back and leaves the connection idle, as sqlx expects;
        // a won claim leaves it inside the transaction, past the savepoint.
        // The lock wait is bounded for the insert only: the session's own
        // lock_timeout is remembered first and put back after it. Several
        // statements need the simple query protocol, which has no
        // parameters, so every value is written as hex digits or a decimal
        // integer: nothing from the request can change the statement.
        let ms = claim.lock_wait.as_millis().clamp(1, i32::MAX as u128);
        let sql = format!(
            "SET TRANSACTION ISOLATION LEVEL {}; \
             SELECT set_config('tower_idempotency.lock_timeout', current_setting('lock_timeout'), true); \
             SELECT set_config('lock_timeout', '{ms}ms', true); \
             INSERT INTO idempotency_records \
             (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at) \
             VALUES ({}, {}, {}, {}, 'PROCESSING', {now}, {now} + {}); \
             SELECT set_config('lock_timeout', current_setting('tower_idempotency.lock_timeout'), true); \
             BEGIN; SAVEPOINT {SAVEPOINT}",
            claim.isolation.as_sql(),
            text(claim.scope.principal),
            text(claim.scope.operation),
            text(claim.scope.key),
            bytea(claim.fingerprint),
            claim.retention_ms,
            now = now_ms!(),
        );
        let claimed = Transaction::begin(
            MaybePoolConnection::PoolConnection(conn),
            Some(AssertSqlSafe(sql).into_sql_str()),
        )
        .await;
        match claimed {
            Ok(tx) => Ok(ClaimOutcome::Won(tx)),
            // The driver's own signal, never a parsed message.
            Err(e)
                if e.as_database_error()
                    .is_some_and(|d| d.is_unique_violation()) =>
            {
                Ok(ClaimOutcome::Lost)
            }
            Err(e) => Err(e),
        }
    }

    async fn finish(
        mut tx: Transaction<'static, Self>,
        scope: &Scope<'_>,
        c: &Completion<'_>,
    ) -> Result<i64, sqlx::Error> {
        // One round trip: (undo the business writes,) prove the claimed
        // transaction is still ours by releasing its savepoint, record,
        // commit. The trailing `BEGIN` opens an empty transaction that
        // matches sqlx's count of one open transaction; its rollback is
        // queued when `tx` drops and rides on the pool's own check of the
        // returned connection.
        let undo = if c.status == RecordStatus::FailedFinal {
            format!("ROLLBACK TO SAVEPOINT {SAVEPOINT}; ")
        } else {
            String::new()
        };
        // A missing row (a handler that deleted it) fails the cast, so the
        // COMMIT never runs without the ledger row.
        let sql = format!(
            "{undo}RELEASE SAVEPOINT {SAVEPOINT}; \
             WITH done AS (UPDATE idempotency_records SET status = '{}', response_status = {}, \
             response_headers = {}, response_body = {}, resource_id = {} \
             WHERE principal_id = {} AND operation = {} AND idem_key = {} RETURNING expires_at) \
             SELECT (CASE WHEN count(*) = 1 THEN max(expires_at)::text \
             ELSE 'the idempotency ledger row is gone' END)::int8 FROM done; \
             COMMIT; BEGIN",
            c.status.as_str(),
            c.response_status,
            bytea(c.response_headers),
            bytea(c.response_body),
            c.resource_id.map_or_else(|| "NULL".to_string(), text),
            text(scope.principal),
            text(scope.operation),
            text(scope.key),
        );
        match sqlx::raw_sql(AssertSqlSafe(sql)).fetch_all(&mut *tx).await {
            Ok(rows) => rows.first().ok_or(sqlx::Error::RowNotFound)?.try_get(0),
            Err(e) => {
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    async fn check_savepoint(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql("ROLLBACK TO SAVEPOINT tower_idempotency_claimed")
            .execute(conn)
            .await
            .map(drop)
    }

    shared_statements!(
        Postgres,
        fetch = concat!(
            "SELECT status, request_fingerprint, response_status, response_headers, \
             response_body, resource_id, expires_at, \
             CASE WHEN expires_at <= ",
            now_ms!(),
            " THEN 1::INT8 ELSE 0::INT8 END FROM idempotency_records \
             WHERE principal_id = $1 AND operation = $2 AND idem_key = $3"
        ),
        mark = concat!(
            "INSERT INTO idempotency_records (principal_id, operation, idem_key, \
             request_fingerprint, status, response_status, created_at, expires_at) \
             VALUES ($1, $2, $3, $4, 'NEEDS_RECONCILIATION', $5, ",
            now_ms!(),
            ", ",
            now_ms!(),
            " + $6) ON CONFLICT (principal_id, operation, idem_key) DO UPDATE \
             SET status = 'NEEDS_RECONCILIATION', response_status = EXCLUDED.response_status \
             WHERE idempotency_records.status = 'PROCESSING'"
        ),
        list = "SELECT principal_id, operation, idem_key, status, response_status, created_at \
                FROM idempotency_records WHERE status IN ('PROCESSING', 'NEEDS_RECONCILIATION') \
                ORDER BY created_at LIMIT $1",
        resolve = "UPDATE idempotency_records SET status = $1, response_status = $2, \
                   response_headers = $3, response_body = $4, resource_id = $5 \
                   WHERE principal_id = $6 AND operation = $7 AND idem_key = $8 \
                   AND status IN ('PROCESSING', 'NEEDS_RECONCILIATION')",
        delete = "DELETE FROM idempotency_records \
                  WHERE principal_id = $1 AND operation = $2 AND idem_key = $3 \
                  AND status IN ('PROCESSING', 'NEEDS_RECONCILIATION')",
        expire = concat!(
            "UPDATE idempotency_records SET status = 'EXPIRED', response_headers = NULL, \
             response_body = NULL WHERE (principal_id, operation, idem_key) IN \
             (SELECT principal_id, operation, idem_key FROM idempotency_records \
             WHERE status IN ('SUCCEEDED', 'FAILED_FINAL') AND expires_at <= COALESCE($1, ",
            now_ms!(),
            ") LIMIT $2 FOR UPDATE SKIP LOCKED)"
        ),
        purge = concat!(
            "DELETE FROM idempotency_records WHERE (principal_id, operation, idem_key) IN \
             (SELECT principal_id, operation, idem_key FROM idempotency_records \
             WHERE status = 'EXPIRED' AND expires_at <= COALESCE($1, ",
            now_ms!(),
            ") - $2 LIMIT $3 FOR UPDATE SKIP LOCKED)"
        ),
    );

    fn error_kind(err: &sqlx::Error) -> StoreErrorKind {
        if let Some(kind) = generic_error_kind(err) {
            return kind;
        }
        let Some(code) = err.as_database_error().and_then(|e| e.code()) else {
            return StoreErrorKind::Other;
        };
        match &*code {
            // lock_not_available: our lock_timeout fired.
            "55P03" => StoreErrorKind::LockTimeout,
            // serialization_failure, deadlock_detected
            "40001" | "40P01" => StoreErrorKind::Conflict,
            // invalid_savepoint_specification, no_active_sql_transaction
            "3B001" | "25P01" => StoreErrorKind::TransactionEnded,
            // too_many_connections
            "53300" => StoreErrorKind::Busy,
            // connection_exception (08…), operator intervention (57P…: terminated, shutdown).
            c if c.starts_with("08") || c.starts_with("57P") => StoreErrorKind::ConnectionLost,
            _ => StoreErrorKind::Other,
        }
    }
}

/// A text value as an SQL expression made of hex digits only.
fn text(value: &str) -> String {
    format!(
        "convert_from(decode('{}', 'hex'), 'UTF8')",
        hex(value.as_bytes())
    )
}

/// A `bytea` value as an SQL expression made of hex digits only.
fn bytea(value: &[u8]) -> String {
    format!("decode('{}', 'hex')", hex(value))
}

#[cfg(test)]
mod tests {
    #[test]
    fn literals_hold_only_hex_digits() {
        let lit = super::text("x'); DROP TABLE t; --");
        let inner = lit
            .strip_prefix("convert_from(decode('")
            .and_then(|l| l.strip_suffix("', 'hex'), 'UTF8')"))
            .unwrap();
        assert!(inner.bytes().all(|b| b.is_ascii_hexdigit()));
    }
}
