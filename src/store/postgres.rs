//! PostgreSQL: the production store.

use std::time::Duration;

use sqlx::postgres::Postgres;
use sqlx::{AssertSqlSafe, Pool, Transaction};

use super::{Backend, Claim, StoreErrorKind, generic_error_kind, shared_statements};

impl Backend for Postgres {
    async fn migrate(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(include_str!(
            "../../migrations/postgres/0001_idempotency_records.sql"
        ))
        .execute(pool)
        .await
        .map(drop)
    }

    async fn claim(
        pool: &Pool<Self>,
        claim: &Claim<'_>,
        lock_wait: Duration,
    ) -> Result<Option<Transaction<'static, Self>>, sqlx::Error> {
        // Round trip 1: the claim's lock wait is bounded, and READ COMMITTED
        // lets the insert see a winner that committed while it waited.
        let ms = lock_wait.as_millis().clamp(1, i32::MAX as u128);
        let mut tx = pool
            .begin_with(AssertSqlSafe(format!(
                "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = '{ms}ms'"
            )))
            .await?;
        // Round trip 2: insert, restore the session's lock timeout for the
        // handler, take the savepoint. Three statements need the simple query
        // protocol, which has no parameters, so every value is written as hex
        // digits or a decimal integer: nothing from the request can change
        // the statement.
        let sql = format!(
            "INSERT INTO idempotency_records \
             (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at) \
             VALUES ({}, {}, {}, decode('{}', 'hex'), 'PROCESSING', {}, {}) \
             ON CONFLICT (principal_id, operation, idem_key) DO NOTHING; \
             SET LOCAL lock_timeout = DEFAULT; SAVEPOINT tower_idempotency_claimed",
            text_literal(claim.scope.principal),
            text_literal(claim.scope.operation),
            text_literal(claim.scope.key),
            hex(claim.fingerprint),
            claim.created_at,
            claim.expires_at,
        );
        // SET and SAVEPOINT report no rows: the sum is the insert's count.
        match sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *tx).await {
            Ok(done) if done.rows_affected() == 1 => Ok(Some(tx)),
            Ok(_) => {
                tx.rollback().await?;
                Ok(None)
            }
            Err(e) => {
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    shared_statements!(
        Postgres,
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

/// A text value as an SQL expression made of hex digits only.
fn text_literal(value: &str) -> String {
    format!(
        "convert_from(decode('{}', 'hex'), 'UTF8')",
        hex(value.as_bytes())
    )
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0x0f)] as char);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn literals_hold_only_hex_digits() {
        let lit = super::text_literal("x'); DROP TABLE t; --");
        let inner = lit
            .strip_prefix("convert_from(decode('")
            .and_then(|l| l.strip_suffix("', 'hex'), 'UTF8')"))
            .unwrap();
        assert!(inner.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(super::hex(&[0x00, 0xab, 0xff]), "00abff");
    }
}
