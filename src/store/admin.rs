//! The operators' statements: audited verdicts, one record, the audit
//! trail, the ledger's status. Written once over each backend's
//! [`Dialect`]; every value is a literal of hex digits or a decimal
//! integer, as in lease mode, so nothing an operator types can change a
//! statement, and every statement runs through a transaction-pooling proxy.
// Without a store's feature nothing here is used.
#![cfg_attr(
    not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(unused)
)]

use std::future::Future;

use sqlx::{Pool, Row};

use super::lease::{Args, Dialect};
use super::{Backend, Fence, LeaseWrite, Scope, parse_status};
use crate::admin::{AuditEntry, DiskSize, LedgerRow, LedgerStatus, StatusCount, SweepPreview};

/// Who gave a verdict and why, as the audit row records it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AuditNote<'a> {
    pub(crate) actor: &'a str,
    pub(crate) reason: &'a str,
    pub(crate) verdict: &'static str,
    pub(crate) response_status: Option<i32>,
}

mod sealed {
    pub trait Sealed {}
}

/// A [`Backend`] the operators' tools work on: PostgreSQL, SQLite and
/// MySQL/MariaDB, behind their features. Sealed: its methods are the
/// statements of [`admin::Ledger`](crate::admin::Ledger), which is the API.
#[allow(private_interfaces)]
pub trait AdminBackend: Backend + sealed::Sealed {
    /// In one transaction: reads the row (locking it), writes the fenced
    /// verdict, and inserts its audit row with the row as it was before.
    /// `Ok(false)`, with nothing written, when the verdict matched nothing.
    #[doc(hidden)]
    fn audited_verdict(
        pool: &Pool<Self>,
        scope: &Scope<'_>,
        fence: Fence<'_>,
        write: &LeaseWrite<'_>,
        note: &AuditNote<'_>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// The whole row of a stored scope.
    #[doc(hidden)]
    fn row(
        pool: &Pool<Self>,
        scope: &Scope<'_>,
    ) -> impl Future<Output = Result<Option<LedgerRow>, sqlx::Error>> + Send;

    /// The newest `limit` audit rows of a stored scope, oldest first.
    #[doc(hidden)]
    fn audit_trail(
        pool: &Pool<Self>,
        scope: &Scope<'_>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<AuditEntry>, sqlx::Error>> + Send;

    /// Rows by status and operation, leased rows past their lease, size;
    /// unresolved records with lapsed leases stranded after `stranded_ms`.
    #[doc(hidden)]
    fn status(
        pool: &Pool<Self>,
        stranded_ms: i64,
    ) -> impl Future<Output = Result<LedgerStatus, sqlx::Error>> + Send;

    /// The database clock, epoch milliseconds.
    #[doc(hidden)]
    fn clock(pool: &Pool<Self>) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;

    /// The applied ledger migrations, `(version, name)` in order; empty
    /// when the ledger was never migrated.
    #[doc(hidden)]
    fn applied_migrations(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Vec<(i64, String)>, sqlx::Error>> + Send;

    /// What a sweep would expire and purge now.
    #[doc(hidden)]
    fn sweep_preview(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<SweepPreview, sqlx::Error>> + Send;
}

impl Dialect {
    /// Every column of the ledger row, and the database clock.
    fn row_select(&self) -> String {
        format!(
            "SELECT {}, {}, {}, status, request_fingerprint, response_status, response_headers, \
             response_body, resource_id, created_at, expires_at, generation, locked_until, {}, \
             recovery_data, {}, pending_until, {}, {}, {} FROM idempotency_records",
            (self.read_key)("principal_id"),
            (self.read_key)("operation"),
            (self.read_key)("idem_key"),
            (self.read_key)("recovery_point"),
            (self.read_key)("pending_step"),
            (self.read_key)("claim_id"),
            self.parks,
            self.now,
        )
    }

    fn audit_insert(
        &self,
        a: &mut Args,
        scope: &Scope<'_>,
        note: &AuditNote<'_>,
        before: &str,
    ) -> String {
        format!(
            "INSERT INTO tower_idempotency_audit (principal_id, operation, idem_key, actor, \
             reason, verdict, response_status, recorded_at, before_record) \
             VALUES ({}, {}, {}, {}, {}, '{}', {}, {}, {})",
            (self.key)(a, scope.principal),
            (self.key)(a, scope.operation),
            (self.key)(a, scope.key),
            (self.text)(a, note.actor),
            (self.text)(a, note.reason),
            // One of three constants.
            note.verdict,
            note.response_status
                .map_or_else(|| "NULL".to_string(), |s| s.to_string()),
            self.now,
            (self.text)(a, before),
        )
    }

    fn audit_select(&self, a: &mut Args, scope: &Scope<'_>, limit: i64) -> String {
        format!(
            "SELECT id, {}, {}, {}, {}, {}, verdict, response_status, recorded_at, {} \
             FROM tower_idempotency_audit WHERE principal_id = {} AND operation = {} \
             AND idem_key = {} ORDER BY id DESC LIMIT {limit}",
            (self.read_key)("principal_id"),
            (self.read_key)("operation"),
            (self.read_key)("idem_key"),
            (self.read_key)("actor"),
            (self.read_key)("reason"),
            (self.read_key)("before_record"),
            (self.key)(a, scope.principal),
            (self.key)(a, scope.operation),
            (self.key)(a, scope.key),
        )
    }

    fn status_groups(&self) -> String {
        format!(
            "SELECT status, {}, COUNT(*), MIN(created_at) FROM idempotency_records \
             GROUP BY status, operation ORDER BY 2, 1",
            (self.read_key)("operation"),
        )
    }

    /// Leased rows past their lease at `now` (read first: a literal, so
    /// the lease index serves the range, which a volatile clock call in
    /// the statement would prevent).
    fn status_leases(&self, now: i64) -> String {
        format!(
            "SELECT COUNT(*) FROM idempotency_records WHERE locked_until <= {now} \
             AND generation > 0 AND status = 'PROCESSING'"
        )
    }

    /// What a sweep would expire and purge at `now` (a literal, so the
    /// expiry index serves both ranges).
    fn sweep_counts(&self, now: i64) -> String {
        format!(
            "SELECT (SELECT COUNT(*) FROM idempotency_records WHERE status IN \
             ('SUCCEEDED', 'FAILED_FINAL') AND expires_at <= {now}), \
             (SELECT COUNT(*) FROM idempotency_records WHERE status = 'EXPIRED' \
             AND expires_at <= {now})"
        )
    }
}

/// Reads a [`LedgerRow`] from a row of [`Dialect::row_select`].
fn ledger_row<R: Row>(row: &R) -> Result<LedgerRow, sqlx::Error>
where
    usize: sqlx::ColumnIndex<R>,
    String: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Vec<u8>: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i64: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i32: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let status: String = row.try_get(3)?;
    Ok(LedgerRow {
        principal: row.try_get(0)?,
        operation: row.try_get(1)?,
        key: row.try_get(2)?,
        status: parse_status(&status)?,
        fingerprint: row.try_get(4)?,
        response_status: row.try_get(5)?,
        response_headers: row.try_get(6)?,
        response_body: row.try_get(7)?,
        resource_id: row.try_get(8)?,
        created_at: row.try_get(9)?,
        expires_at: row.try_get(10)?,
        generation: row.try_get(11)?,
        locked_until: row.try_get(12)?,
        recovery_point: row.try_get(13)?,
        recovery_data: row.try_get(14)?,
        pending_step: row.try_get(15)?,
        pending_until: row.try_get(16)?,
        claim_id: row.try_get(17)?,
        parks: row.try_get(18)?,
        read_at: row.try_get(19)?,
    })
}

fn audit_entry<R: Row>(row: &R) -> Result<AuditEntry, sqlx::Error>
where
    usize: sqlx::ColumnIndex<R>,
    String: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i64: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i32: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    Ok(AuditEntry {
        id: row.try_get(0)?,
        principal: row.try_get(1)?,
        operation: row.try_get(2)?,
        key: row.try_get(3)?,
        actor: row.try_get(4)?,
        reason: row.try_get(5)?,
        verdict: row.try_get(6)?,
        response_status: row.try_get(7)?,
        recorded_at: row.try_get(8)?,
        before: row.try_get(9)?,
    })
}

/// Stamps out [`AdminBackend`] for a backend: `$begin` opens the verdict's
/// transaction, `$lock` is appended to the read that locks the row,
/// `$bound` bounds a statement's lock wait, `$size` reads the size on
/// disk; `$feature` is the Cargo feature the backend comes with (shown
/// on docs.rs).
macro_rules! admin_backend {
    ($db:ty, feature = $feature:literal, $dialect:expr, $stmt:path, begin = $begin:expr,
     lock = $lock:expr, bound = $bound:expr, size = $size:expr $(,)?) => {
        impl sealed::Sealed for $db {}

        #[allow(private_interfaces)]
        #[cfg_attr(docsrs, doc(cfg(feature = $feature)))]
        impl AdminBackend for $db {
            async fn audited_verdict(
                pool: &Pool<Self>,
                scope: &Scope<'_>,
                fence: Fence<'_>,
                write: &LeaseWrite<'_>,
                note: &AuditNote<'_>,
            ) -> Result<bool, sqlx::Error> {
                let d: &Dialect = &$dialect;
                let bound: fn(String) -> String = $bound;
                let mut tx = pool.begin_with($begin).await?;
                let mut a = Vec::new();
                let read = format!(
                    "{} WHERE {}{}",
                    d.row_select(),
                    d.scope(&mut a, scope),
                    $lock
                );
                let cached = super::caches_statements(pool);
                let Some(row) = $stmt(pool, bound(read), a, cached)
                    .fetch_optional(&mut *tx)
                    .await?
                else {
                    tx.rollback().await?;
                    return Ok(false);
                };
                let before = ledger_row(&row)?.before_json().to_string();
                let mut a = Vec::new();
                let write = bound(d.write(&mut a, scope, fence, write));
                let done = $stmt(pool, write, a, cached).execute(&mut *tx).await?;
                if done.rows_affected() != 1 {
                    tx.rollback().await?;
                    return Ok(false);
                }
                let mut a = Vec::new();
                let insert = d.audit_insert(&mut a, scope, note, &before);
                $stmt(pool, insert, a, cached).execute(&mut *tx).await?;
                tx.commit().await?;
                Ok(true)
            }

            async fn row(
                pool: &Pool<Self>,
                scope: &Scope<'_>,
            ) -> Result<Option<LedgerRow>, sqlx::Error> {
                let d: &Dialect = &$dialect;
                let mut a = Vec::new();
                let sql = format!("{} WHERE {}", d.row_select(), d.scope(&mut a, scope));
                super::on_ledger!($db, pool, |ex, cached| $stmt(pool, sql, a, cached)
                    .fetch_optional(ex))
                .as_ref()
                .map(ledger_row)
                .transpose()
            }

            async fn audit_trail(
                pool: &Pool<Self>,
                scope: &Scope<'_>,
                limit: i64,
            ) -> Result<Vec<AuditEntry>, sqlx::Error> {
                let d: &Dialect = &$dialect;
                // Newest first in the statement (so the limit keeps the
                // newest rows), oldest first in the answer.
                let mut a = Vec::new();
                let sql = d.audit_select(&mut a, scope, limit);
                let mut trail =
                    super::on_ledger!($db, pool, |ex, cached| $stmt(pool, sql, a, cached)
                        .fetch_all(ex))
                    .iter()
                    .map(audit_entry)
                    .collect::<Result<Vec<_>, _>>()?;
                trail.reverse();
                Ok(trail)
            }

            async fn status(
                pool: &Pool<Self>,
                stranded_ms: i64,
            ) -> Result<LedgerStatus, sqlx::Error> {
                let d: &Dialect = &$dialect;
                let sql = d.status_groups();
                let groups =
                    super::on_ledger!($db, pool, |ex, cached| $stmt(pool, sql, Vec::new(), cached)
                        .fetch_all(ex))
                    .iter()
                    .map(|row| {
                        let status: String = row.try_get(0)?;
                        Ok(StatusCount {
                            status: parse_status(&status)?,
                            operation: row.try_get(1)?,
                            rows: row.try_get(2)?,
                            oldest_created_at: row.try_get(3)?,
                        })
                    })
                    .collect::<Result<Vec<_>, sqlx::Error>>()?;
                let now = <$db as AdminBackend>::clock(pool).await?;
                let sql = d.status_leases(now);
                let leases =
                    super::on_ledger!($db, pool, |ex, cached| $stmt(pool, sql, Vec::new(), cached)
                        .fetch_one(ex));
                let (unresolved, oldest_unresolved, _) =
                    <$db as Backend>::count_unresolved(pool, stranded_ms).await?;
                let size: Option<DiskSize> = {
                    let sql: &'static str = $size.0;
                    let estimate: bool = $size.1;
                    let what: &'static str = $size.2;
                    match sqlx::raw_sql(sql).fetch_optional(pool).await? {
                        Some(row) => Some(DiskSize {
                            bytes: row.try_get(0)?,
                            estimate,
                            what,
                        }),
                        None => None,
                    }
                };
                Ok(LedgerStatus::new(
                    groups,
                    leases.try_get(0)?,
                    unresolved,
                    oldest_unresolved,
                    size,
                    now,
                ))
            }

            async fn clock(pool: &Pool<Self>) -> Result<i64, sqlx::Error> {
                let d: &Dialect = &$dialect;
                let sql = format!("SELECT {}", d.now);
                super::on_ledger!($db, pool, |ex, cached| $stmt(pool, sql, Vec::new(), cached)
                    .fetch_one(ex))
                .try_get(0)
            }

            async fn applied_migrations(
                pool: &Pool<Self>,
            ) -> Result<Vec<(i64, String)>, sqlx::Error> {
                let sql = "SELECT version, name FROM tower_idempotency_migrations ORDER BY version";
                match sqlx::raw_sql(sql).fetch_all(pool).await {
                    Ok(rows) => rows
                        .iter()
                        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
                        .collect(),
                    // No migrations table yet: nothing applied.
                    Err(sqlx::Error::Database(_)) => Ok(Vec::new()),
                    Err(e) => Err(e),
                }
            }

            async fn sweep_preview(pool: &Pool<Self>) -> Result<SweepPreview, sqlx::Error> {
                let d: &Dialect = &$dialect;
                let now = <$db as AdminBackend>::clock(pool).await?;
                let sql = d.sweep_counts(now);
                let row =
                    super::on_ledger!($db, pool, |ex, cached| $stmt(pool, sql, Vec::new(), cached)
                        .fetch_one(ex));
                Ok(SweepPreview {
                    expirable: row.try_get(0)?,
                    purgeable: row.try_get(1)?,
                })
            }
        }
    };
}

#[cfg(feature = "postgres")]
admin_backend!(
    sqlx::Postgres,
    feature = "postgres",
    super::postgres::DIALECT,
    super::postgres::stmt,
    // SET LOCAL ends with the verdict's transaction.
    begin = "BEGIN; SET LOCAL lock_timeout = '5000ms'",
    lock = " FOR UPDATE",
    bound = |sql| sql,
    size = (
        "SELECT pg_total_relation_size(c.oid)::INT8 FROM pg_class c \
         WHERE c.oid = to_regclass('idempotency_records')",
        false,
        "the ledger table with its indexes and TOAST (pg_total_relation_size)",
    ),
);

#[cfg(feature = "sqlite")]
admin_backend!(
    sqlx::Sqlite,
    feature = "sqlite",
    super::sqlite::DIALECT,
    super::sqlite::stmt,
    // The write lock up front: one writer, and the row cannot change
    // between the read and the verdict.
    begin = "BEGIN IMMEDIATE",
    lock = "",
    bound = |sql| sql,
    size = (
        "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()",
        false,
        "the whole database file, not the ledger alone (page_count * page_size)",
    ),
);

#[cfg(feature = "mysql")]
admin_backend!(
    sqlx::MySql,
    feature = "mysql",
    super::mysql::DIALECT,
    super::mysql::stmt,
    begin = "START TRANSACTION",
    lock = " FOR UPDATE",
    // For that statement alone (MariaDB); MySQL keeps its default wait.
    bound = |sql| format!("/*M!100301 SET STATEMENT innodb_lock_wait_timeout = 5 FOR */ {sql}"),
    size = (
        "SELECT CAST(data_length + index_length AS SIGNED) FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name = 'tower_idempotency_records'",
        true,
        "the ledger table with its indexes (information_schema, InnoDB's estimate)",
    ),
);
