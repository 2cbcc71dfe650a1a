//! The ledger: the `idempotency_records` table and the small backend trait
//! that talks to it.
//!
//! The layer never decides a claim with a read followed by an `if`: a claim
//! is an insert under the unique key `(principal_id, operation, idem_key)`,
//! and the database's answer decides. Reads only explain a lost claim.
//!
//! Built-in backends (each behind its cargo feature):
//!
//! | backend | claim | waiting on an in-flight duplicate |
//! |---|---|---|
//! | PostgreSQL | `INSERT … ON CONFLICT DO NOTHING` in a `READ COMMITTED` transaction | the insert blocks on the first claimer's uncommitted row, bounded by `SET LOCAL lock_timeout` |
//! | SQLite | `INSERT … ON CONFLICT DO NOTHING` in a `BEGIN IMMEDIATE` transaction | writers are serialized; the wait is the connection's `busy_timeout` (`SqliteConnectOptions::busy_timeout`, 5 s by default) |
//! | MySQL/MariaDB | a plain `INSERT`, a duplicate key reported by the driver's unique-violation signal, in a `READ COMMITTED` transaction | the insert blocks on the uncommitted row, bounded by `innodb_lock_wait_timeout` (whole seconds, set for the claim, then put back) |
//!
//! Migrations: [`migrate`] creates the table and its index with idempotent
//! DDL (`CREATE … IF NOT EXISTS`), so it is safe on every start and never
//! touches `_sqlx_migrations`, the table your own `sqlx::migrate!` uses. The
//! SQL lives in `migrations/<backend>/` in this crate.

use std::future::Future;
use std::time::Duration;

use sqlx::{Database, Pool, Transaction};

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// The identity of one logical request: who, which operation, which key.
/// The unique constraint is on all three, never on the key alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scope<'a> {
    /// The authenticated principal (user, tenant, account).
    pub principal: &'a str,
    /// The operation, such as `POST /orders` or `create-order`.
    pub operation: &'a str,
    /// The client's idempotency key, unquoted.
    pub key: &'a str,
}

/// A new `PROCESSING` row to claim a scope.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The scope to claim.
    pub scope: Scope<'a>,
    /// The request fingerprint (32 bytes of SHA-256).
    pub fingerprint: &'a [u8],
    /// Creation time, Unix epoch milliseconds.
    pub created_at: i64,
    /// End of retention, Unix epoch milliseconds.
    pub expires_at: i64,
}

/// The state of a ledger row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordStatus {
    /// Claimed; the first request is running (in this crate's short mode the
    /// row is only ever seen in this state inside its own transaction).
    Processing,
    /// The operation succeeded; the response is stored.
    Succeeded,
    /// The operation ended in a final business error; the error is stored.
    FailedFinal,
    /// Retention ended; the response was dropped, the key stays refused.
    Expired,
}

impl RecordStatus {
    /// The value stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Processing => "PROCESSING",
            Self::Succeeded => "SUCCEEDED",
            Self::FailedFinal => "FAILED_FINAL",
            Self::Expired => "EXPIRED",
        }
    }

    /// Parses the `status` column.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "PROCESSING" => Self::Processing,
            "SUCCEEDED" => Self::Succeeded,
            "FAILED_FINAL" => Self::FailedFinal,
            "EXPIRED" => Self::Expired,
            _ => return None,
        })
    }

    /// `SUCCEEDED` and `FAILED_FINAL`: a stored answer that is replayed.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::FailedFinal)
    }
}

/// A ledger row as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The row's state.
    pub status: RecordStatus,
    /// The fingerprint of the request that claimed the scope.
    pub fingerprint: Vec<u8>,
    /// The recorded response status, for terminal rows.
    pub response_status: Option<i32>,
    /// The recorded, allow-listed response headers, for terminal rows.
    pub response_headers: Option<Vec<u8>>,
    /// The recorded response body, for terminal rows.
    pub response_body: Option<Vec<u8>>,
    /// The id of the resource the request created, when the handler named it.
    pub resource_id: Option<String>,
    /// End of retention, Unix epoch milliseconds.
    pub expires_at: i64,
}

/// The terminal state written on the claimed row before commit.
#[derive(Debug, Clone, Copy)]
pub struct Completion<'a> {
    /// `Succeeded` or `FailedFinal`.
    pub status: RecordStatus,
    /// The response status code.
    pub response_status: i32,
    /// The allow-listed response headers, encoded.
    pub response_headers: &'a [u8],
    /// The response body.
    pub response_body: &'a [u8],
    /// The created resource's id, if the handler named one.
    pub resource_id: Option<&'a str>,
}

/// How a store error bears on the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorKind {
    /// A lock wait ran out: another transaction holds the scope's row.
    LockTimeout,
    /// The connection was lost or could not be had: an outcome may be unknown.
    ConnectionLost,
    /// Any other error.
    Other,
}

/// A database that can hold the ledger. Implemented for `sqlx::Postgres`,
/// `sqlx::Sqlite` and `sqlx::MySql` behind their features.
///
/// Every method is short (a few statements at most, no unbounded waits) and
/// must keep its guarantee under concurrency: [`claim`](Backend::claim) is
/// decided by the unique constraint alone. The `testkit` feature's
/// conformance suite checks an implementation against the whole contract.
pub trait Backend: Database {
    /// Creates the ledger table and index if missing. Safe to re-run.
    fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Claims a scope: begins the transaction that is handed to the
    /// handler, inserts the `PROCESSING` row, and takes the savepoint that
    /// final business errors roll back to. `Ok(Some)`: this transaction owns
    /// the scope. `Ok(None)`: a committed row already holds it (nothing is
    /// left open). Waits for another claimer's uncommitted row at most about
    /// `lock_wait`, then fails with an error of kind
    /// [`StoreErrorKind::LockTimeout`].
    fn claim(
        pool: &Pool<Self>,
        claim: &Claim<'_>,
        lock_wait: Duration,
    ) -> impl Future<Output = Result<Option<Transaction<'static, Self>>, sqlx::Error>> + Send;

    /// Rolls back to the savepoint taken by [`claim`](Backend::claim).
    fn rollback_to_savepoint(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Writes the terminal state on the claimed row.
    fn complete(
        conn: &mut Self::Connection,
        scope: &Scope<'_>,
        completion: &Completion<'_>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Reads the committed row of a scope, outside any claim transaction.
    fn fetch(
        pool: &Pool<Self>,
        scope: &Scope<'_>,
    ) -> impl Future<Output = Result<Option<Record>, sqlx::Error>> + Send;

    /// Turns at most `limit` terminal rows (`SUCCEEDED`, `FAILED_FINAL`) with
    /// `expires_at <= now` into `EXPIRED` tombstones: response headers and
    /// body dropped, scope, fingerprint and resource id kept. Never touches
    /// `PROCESSING` rows. One short statement; returns the rows changed.
    fn expire_batch(
        pool: &Pool<Self>,
        now: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Deletes at most `limit` tombstones with `expires_at <= before`. One
    /// short statement; returns the rows deleted.
    fn purge_batch(
        pool: &Pool<Self>,
        before: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Sorts a driver error.
    fn error_kind(err: &sqlx::Error) -> StoreErrorKind;
}

/// Creates the ledger table on `pool` if it does not exist. Safe to call on
/// every start; independent of your application's `sqlx::migrate!` history.
pub async fn migrate<DB: Backend>(pool: &Pool<DB>) -> Result<(), sqlx::Error> {
    DB::migrate(pool).await
}

/// Errors every driver reports the same way: lost or unavailable connections.
fn generic_error_kind(err: &sqlx::Error) -> Option<StoreErrorKind> {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Tls(_) => Some(StoreErrorKind::ConnectionLost),
        _ => None,
    }
}

type RecordRow = (
    String,
    Vec<u8>,
    Option<i32>,
    Option<Vec<u8>>,
    Option<Vec<u8>>,
    Option<String>,
    i64,
);

fn record_from_row(row: RecordRow) -> Result<Record, sqlx::Error> {
    let (
        status,
        fingerprint,
        response_status,
        response_headers,
        response_body,
        resource_id,
        expires_at,
    ) = row;
    let status = RecordStatus::parse(&status)
        .ok_or_else(|| sqlx::Error::Decode(format!("unknown ledger status {status:?}").into()))?;
    Ok(Record {
        status,
        fingerprint,
        response_status,
        response_headers,
        response_body,
        resource_id,
        expires_at,
    })
}

/// Stamps out the statements every backend shares, given its SQL text.
macro_rules! shared_statements {
    ($db:ty, complete = $complete:expr, fetch = $fetch:expr,
     expire = $expire:expr, purge = $purge:expr $(,)?) => {
        async fn expire_batch(
            pool: &sqlx::Pool<$db>,
            now: i64,
            limit: i64,
        ) -> Result<u64, sqlx::Error> {
            let done = sqlx::query($expire)
                .bind(now)
                .bind(limit)
                .execute(pool)
                .await?;
            Ok(done.rows_affected())
        }

        async fn purge_batch(
            pool: &sqlx::Pool<$db>,
            before: i64,
            limit: i64,
        ) -> Result<u64, sqlx::Error> {
            let done = sqlx::query($purge)
                .bind(before)
                .bind(limit)
                .execute(pool)
                .await?;
            Ok(done.rows_affected())
        }

        async fn rollback_to_savepoint(
            conn: &mut <$db as sqlx::Database>::Connection,
        ) -> Result<(), sqlx::Error> {
            sqlx::raw_sql("ROLLBACK TO SAVEPOINT tower_idempotency_claimed")
                .execute(&mut *conn)
                .await
                .map(drop)
        }

        async fn complete(
            conn: &mut <$db as sqlx::Database>::Connection,
            scope: &$crate::store::Scope<'_>,
            c: &$crate::store::Completion<'_>,
        ) -> Result<(), sqlx::Error> {
            let done = sqlx::query($complete)
                .bind(c.status.as_str())
                .bind(c.response_status)
                .bind(c.response_headers)
                .bind(c.response_body)
                .bind(c.resource_id)
                .bind(scope.principal)
                .bind(scope.operation)
                .bind(scope.key)
                .execute(&mut *conn)
                .await?;
            if done.rows_affected() == 1 {
                Ok(())
            } else {
                Err(sqlx::Error::RowNotFound)
            }
        }

        async fn fetch(
            pool: &sqlx::Pool<$db>,
            scope: &$crate::store::Scope<'_>,
        ) -> Result<Option<$crate::store::Record>, sqlx::Error> {
            sqlx::query_as::<_, $crate::store::RecordRow>($fetch)
                .bind(scope.principal)
                .bind(scope.operation)
                .bind(scope.key)
                .fetch_optional(pool)
                .await?
                .map($crate::store::record_from_row)
                .transpose()
        }
    };
}
use shared_statements;

/// Stamps out [`Backend::claim`] as three statements with bound parameters:
/// `begin`, the claim `insert` (a duplicate key is the driver's
/// unique-violation error, or zero rows), then the `savepoint` statement(s).
#[cfg(any(feature = "sqlite", feature = "mysql"))]
macro_rules! claim_by_statements {
    ($db:ty, begin = |$pool:ident, $wait:ident| $begin:expr, insert = $insert:expr,
     savepoint = $savepoint:expr $(,)?) => {
        async fn claim(
            $pool: &sqlx::Pool<$db>,
            claim: &$crate::store::Claim<'_>,
            $wait: std::time::Duration,
        ) -> Result<Option<sqlx::Transaction<'static, $db>>, sqlx::Error> {
            let mut tx = $begin.await?;
            let inserted = sqlx::query($insert)
                .bind(claim.scope.principal)
                .bind(claim.scope.operation)
                .bind(claim.scope.key)
                .bind(claim.fingerprint)
                .bind(claim.created_at)
                .bind(claim.expires_at)
                .execute(&mut *tx)
                .await;
            let won = match inserted {
                Ok(done) => done.rows_affected() == 1,
                // The driver's own signal, never a parsed message.
                Err(e)
                    if e.as_database_error()
                        .is_some_and(|d| d.is_unique_violation()) =>
                {
                    false
                }
                Err(e) => {
                    // Some drivers refuse further statements after an error.
                    let _ = tx.rollback().await;
                    return Err(e);
                }
            };
            if !won {
                tx.rollback().await?;
                return Ok(None);
            }
            sqlx::raw_sql($savepoint).execute(&mut *tx).await?;
            Ok(Some(tx))
        }
    };
}
#[cfg(any(feature = "sqlite", feature = "mysql"))]
use claim_by_statements;
