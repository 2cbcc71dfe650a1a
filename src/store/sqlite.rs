//! SQLite: the embedded default.

use sqlx::pool::PoolConnection;
use sqlx::sqlite::Sqlite;
use sqlx::{AssertSqlSafe, Pool, SqlSafeStr};

use super::claimed::rollback;
use super::lease::{Args, Dialect, commit_if_written};
use super::literal::x_literal;
use super::{
    AtCommitOutcome, Backend, Claim, ClaimOutcome, Claimed, Completion, Fence, FinishError,
    IsolationLevel, LeaseWrite, Migration, RecordStatus, Savepoint, Scope, StoreErrorKind,
    generic_error_kind, migrations, run_migrations, shared_statements,
};

/// The database clock, epoch milliseconds.
macro_rules! now_ms {
    () => {
        "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"
    };
}

const MIGRATIONS: &[Migration] = migrations!(
    "sqlite",
    1 => "0001_idempotency_records",
    2 => "0002_byte_scopes_and_reconciliation",
    3 => "0003_tombstone_purge_time",
    4 => "0004_lease_mode",
    5 => "0005_claim_fence",
    6 => "0006_operator_audit",
);

/// The statements that carry the claim's savepoint, built once per process
/// (the savepoint's name is the process's). Each is one call to sqlx's
/// worker thread, and every call inside `BEGIN IMMEDIATE` holds SQLite's
/// one writer for every other request.
struct Statements {
    /// The claim's row, then the savepoint (taken even when no row was
    /// inserted; that transaction is rolled back).
    claim: String,
    /// The claim-at-commit mode's start: the write lock and the savepoint.
    begin_at_commit: String,
    /// The claim's row updated with the answer.
    record: AfterRelease,
    /// The claim-at-commit mode's one row, quietly: `RETURNING` gives
    /// nothing when a row already holds the scope.
    record_at_commit: AfterRelease,
}

/// A recording statement behind what opens a recording
/// ([`Savepoint::release`]): the savepoint released, which fails when the
/// handler ended the claimed transaction, and for a final failure the
/// business writes undone first.
struct AfterRelease {
    released: String,
    undone: String,
}

impl AfterRelease {
    fn new(savepoint: &Savepoint, statement: &str) -> Self {
        Self {
            released: format!(
                "{}; {statement}",
                savepoint.release(RecordStatus::Succeeded)
            ),
            undone: format!(
                "{}; {statement}",
                savepoint.release(RecordStatus::FailedFinal)
            ),
        }
    }

    fn for_status(&self, status: RecordStatus) -> AssertSqlSafe<&str> {
        AssertSqlSafe(if status == RecordStatus::FailedFinal {
            &self.undone
        } else {
            &self.released
        })
    }
}

fn statements() -> &'static Statements {
    static STATEMENTS: std::sync::OnceLock<Statements> = std::sync::OnceLock::new();
    STATEMENTS.get_or_init(|| {
        let savepoint = Savepoint::get();
        Statements {
            claim: format!(
                concat!(
                    "INSERT INTO main.idempotency_records \
                     (principal_id, operation, idem_key, request_fingerprint, status, created_at, \
                     expires_at) VALUES (?, ?, ?, ?, 'PROCESSING', ",
                    now_ms!(),
                    ", ",
                    now_ms!(),
                    " + ?) ON CONFLICT (principal_id, operation, idem_key) DO NOTHING; {}"
                ),
                savepoint.take
            ),
            begin_at_commit: format!("BEGIN IMMEDIATE; {}", savepoint.take),
            record: AfterRelease::new(
                savepoint,
                "UPDATE main.idempotency_records SET status = ?, response_status = ?, \
                 response_headers = ?, response_body = ?, resource_id = ? \
                 WHERE principal_id = ? AND operation = ? AND idem_key = ? RETURNING expires_at",
            ),
            record_at_commit: AfterRelease::new(
                savepoint,
                concat!(
                    "INSERT INTO main.idempotency_records \
                     (principal_id, operation, idem_key, request_fingerprint, status, \
                     response_status, response_headers, response_body, resource_id, created_at, \
                     expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ",
                    now_ms!(),
                    ", ",
                    now_ms!(),
                    " + ?) ON CONFLICT (principal_id, operation, idem_key) DO NOTHING \
                     RETURNING expires_at"
                ),
            ),
        }
    })
}

#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
impl Backend for Sqlite {
    const ONE_WRITER: bool = true;

    async fn migrate(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        // The write lock, taken up front, serializes concurrent callers;
        // SQLite's DDL is transactional.
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        run_migrations!(
            &mut *tx,
            MIGRATIONS,
            create = "CREATE TABLE IF NOT EXISTS tower_idempotency_migrations \
                      (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)",
            now = now_ms!(),
        )?;
        tx.commit().await
    }

    // Take the write lock up front: SQLite has one writer, and a deferred
    // transaction that read first could not upgrade after waiting. The wait
    // is bounded by the connection's busy_timeout. SQLite transactions are
    // serializable whatever level is asked for.
    async fn claim(
        conn: PoolConnection<Self>,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome<Self>, sqlx::Error> {
        let mut tx = begin_immediate(conn).await?;
        // The row and the savepoint in one call to sqlx's worker thread:
        // every call inside `BEGIN IMMEDIATE` holds SQLite's one writer.
        // The call's count is the insert's (0 or 1) on sqlx 0.9.1, and
        // twice it on 0.9.0, which adds `sqlite3_changes()` again for the
        // savepoint: only "none" means the row was there.
        let inserted = sqlx::query(AssertSqlSafe(statements().claim.as_str()))
            .bind(claim.scope.principal)
            .bind(claim.scope.operation)
            .bind(claim.scope.key)
            .bind(claim.fingerprint)
            .bind(claim.retention_ms)
            .execute(&mut *tx)
            .await;
        match inserted {
            Ok(done) if done.rows_affected() != 0 => Ok(ClaimOutcome::Won(tx)),
            Ok(_) => {
                tx.rollback().await;
                Ok(ClaimOutcome::Lost(None))
            }
            Err(e) => {
                tx.rollback().await;
                Err(e)
            }
        }
    }

    async fn finish(
        _pool: &Pool<Self>,
        mut tx: Claimed<Self>,
        claim: &Claim<'_>,
        c: &Completion<'_>,
    ) -> Result<i64, FinishError> {
        let scope = &claim.scope;
        // Prove the claimed transaction is still ours and record, with
        // parameters, in one call to the worker thread; commit. No
        // connection to lose: every error is a `FinishError::Store`.
        let recorded: Result<i64, _> = sqlx::query_scalar(statements().record.for_status(c.status))
            .bind(c.status.as_str())
            .bind(c.response_status)
            .bind(c.response_headers)
            .bind(c.response_body)
            .bind(c.resource_id)
            .bind(scope.principal)
            .bind(scope.operation)
            .bind(scope.key)
            .fetch_one(&mut *tx)
            .await;
        match recorded {
            Ok(expires_at) => {
                tx.commit().await?;
                Ok(expires_at)
            }
            Err(e) => Err(abandon(tx, e).await),
        }
    }

    // Claim at commit: the write lock is still taken up front (one writer;
    // a duplicate waits at its `BEGIN IMMEDIATE` for the first to commit),
    // and the row is written last, `ON CONFLICT DO NOTHING`.
    async fn begin_at_commit(
        conn: PoolConnection<Self>,
        _claim: &Claim<'_>,
    ) -> Result<Claimed<Self>, sqlx::Error> {
        // The savepoint with the `BEGIN IMMEDIATE`, one call.
        let begin = AssertSqlSafe(statements().begin_at_commit.as_str()).into_sql_str();
        match Claimed::begin(conn, begin, rollback).await {
            Ok(tx) => Ok(tx),
            Err((e, mut conn)) => {
                // The call may have stopped inside its transaction.
                conn.close_on_drop();
                Err(e)
            }
        }
    }

    async fn finish_at_commit(
        _pool: &Pool<Self>,
        mut tx: Claimed<Self>,
        claim: &Claim<'_>,
        c: &Completion<'_>,
    ) -> Result<AtCommitOutcome, FinishError> {
        // (Undo the business writes,) prove the transaction is still ours,
        // then the one row, in one call.
        let recorded: Result<Option<i64>, _> =
            sqlx::query_scalar(statements().record_at_commit.for_status(c.status))
                .bind(claim.scope.principal)
                .bind(claim.scope.operation)
                .bind(claim.scope.key)
                .bind(claim.fingerprint)
                .bind(c.status.as_str())
                .bind(c.response_status)
                .bind(c.response_headers)
                .bind(c.response_body)
                .bind(c.resource_id)
                .bind(claim.retention_ms)
                .fetch_optional(&mut *tx)
                .await;
        match recorded {
            Ok(Some(expires_at)) => {
                tx.commit().await?;
                Ok(AtCommitOutcome::Committed(expires_at))
            }
            Ok(None) => {
                tx.rollback().await;
                Ok(AtCommitOutcome::Lost(None))
            }
            Err(e) => Err(abandon(tx, e).await),
        }
    }

    async fn check_savepoint(conn: &mut sqlx::SqliteConnection) -> Result<(), sqlx::Error> {
        match sqlx::raw_sql(Savepoint::get().undo.as_str())
            .execute(&mut *conn)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => Err(reopen_if_ended(conn, e).await),
        }
    }

    shared_statements!(
        Sqlite,
        scope = super::as_text,
        fetch = concat!(
            "SELECT status, request_fingerprint, response_status, response_headers, \
             response_body, resource_id, expires_at, \
             CASE WHEN expires_at <= ",
            now_ms!(),
            " THEN 1 ELSE 0 END, generation, CASE WHEN locked_until > ",
            now_ms!(),
            " THEN 1 ELSE 0 END, recovery_point, recovery_data, pending_step, claim_id, parks \
             FROM main.idempotency_records WHERE principal_id = ? AND operation = ? AND idem_key = ?"
        ),
        mark = concat!(
            "INSERT INTO main.idempotency_records (principal_id, operation, idem_key, \
             request_fingerprint, status, response_status, parks, created_at, expires_at) \
             VALUES (?, ?, ?, ?, 'NEEDS_RECONCILIATION', ?, 1, ",
            now_ms!(),
            ", ",
            now_ms!(),
            " + ?) ON CONFLICT (principal_id, operation, idem_key) DO UPDATE \
             SET status = 'NEEDS_RECONCILIATION', response_status = excluded.response_status, \
             parks = main.idempotency_records.parks + 1 \
             WHERE main.idempotency_records.status = 'PROCESSING'"
        ),
        expire = concat!(
            "UPDATE main.idempotency_records SET status = 'EXPIRED', response_headers = NULL, \
             response_body = NULL, expires_at = expires_at + ? \
             WHERE rowid IN (SELECT rowid FROM main.idempotency_records \
             WHERE status IN ('SUCCEEDED', 'FAILED_FINAL') AND expires_at <= COALESCE(?, ",
            now_ms!(),
            ") LIMIT ?)"
        ),
        purge = concat!(
            "DELETE FROM main.idempotency_records WHERE rowid IN (SELECT rowid FROM main.idempotency_records \
             WHERE status = 'EXPIRED' AND expires_at <= COALESCE(?, ",
            now_ms!(),
            ") LIMIT ?)"
        ),
    );

    // Lease statements are literal SQL built once for every backend (see
    // `lease.rs`); lock waits are the connection's busy_timeout.

    async fn lease_claim(
        pool: &Pool<Self>,
        claim: &Claim<'_>,
        lease_ms: i64,
        claim_id: &str,
    ) -> Result<bool, sqlx::Error> {
        let sql = DIALECT.claim(
            &mut Vec::new(),
            claim,
            lease_ms,
            claim_id,
            None,
            "ON CONFLICT (principal_id, operation, idem_key) DO NOTHING",
        );
        Ok(execute(pool, sql).await? == 1)
    }

    async fn take_over(
        pool: &Pool<Self>,
        scope: &Scope<'_>,
        seen: Fence<'_>,
        lease_ms: i64,
        parked: bool,
    ) -> Result<bool, sqlx::Error> {
        Ok(execute(
            pool,
            DIALECT.take_over(&mut Vec::new(), scope, seen, lease_ms, parked),
        )
        .await?
            == 1)
    }

    async fn lease_write(
        pool: &Pool<Self>,
        scope: &Scope<'_>,
        fence: Fence<'_>,
        write: &LeaseWrite<'_>,
    ) -> Result<bool, sqlx::Error> {
        Ok(execute(pool, DIALECT.write(&mut Vec::new(), scope, fence, write)).await? == 1)
    }

    async fn begin_phase(
        pool: &Pool<Self>,
        _isolation: IsolationLevel,
    ) -> Result<Claimed<Self>, sqlx::Error> {
        // The write lock up front, as for a claim.
        begin_immediate(super::acquire(pool).await?).await
    }

    async fn commit_fenced(
        _pool: &Pool<Self>,
        mut tx: Claimed<Self>,
        scope: &Scope<'_>,
        fence: Fence<'_>,
        write: &LeaseWrite<'_>,
    ) -> Result<Option<i64>, FinishError> {
        let sql = format!(
            "{} RETURNING expires_at",
            DIALECT.write(&mut Vec::new(), scope, fence, write)
        );
        let written: Result<Option<i64>, _> = sqlx::query_scalar(AssertSqlSafe(in_main(&sql)))
            .fetch_optional(&mut *tx)
            .await;
        commit_if_written(tx, written).await
    }

    super::lease::list_leases!();
    super::lease::list_unresolved!();
    super::lease::count_unresolved!();

    fn error_kind(err: &sqlx::Error) -> StoreErrorKind {
        if let Some(kind) = generic_error_kind(err) {
            return kind;
        }
        let Some(db) = err.as_database_error() else {
            return StoreErrorKind::Other;
        };
        // SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their extended codes:
        // the database's write lock, whoever holds it.
        match db.code().as_deref().and_then(|c| c.parse::<i32>().ok()) {
            Some(c) if matches!(c & 0xff, 5 | 6) => StoreErrorKind::Busy,
            // SQLite reports a missing savepoint as a plain SQLITE_ERROR (1),
            // with no extended code; only the message tells it apart.
            Some(1) if db.message().starts_with("no such savepoint") => {
                StoreErrorKind::TransactionEnded
            }
            _ => StoreErrorKind::Other,
        }
    }
}

/// Text as a literal of hex digits (SQLite reads the blob as UTF-8 text).
fn text(value: &str) -> String {
    format!("CAST({} AS TEXT)", x_literal(value.as_bytes()))
}

/// Values as literals of hex digits (nothing is bound: see [`stmt`]).
pub(super) const DIALECT: Dialect = Dialect {
    key: |_, v| text(v),
    text: |_, v| text(v),
    blob: |_, v| x_literal(v),
    read_key: |column| column.to_string(),
    now: now_ms!(),
    parks: "parks",
};

/// A lease or operator statement: its values are literals (`DIALECT`
/// binds none), sent as written, with the ledger's tables named in the
/// `main` database (see [`in_main`]).
pub(super) fn stmt(_pool: &Pool<Sqlite>, sql: String, args: Args, _cached: bool) -> sqlx::RawSql {
    debug_assert!(args.is_empty(), "SQLite's dialect binds nothing");
    sqlx::raw_sql(AssertSqlSafe(in_main(&sql)))
}

/// `sql` (one of the shared lease and operator statements, whose text
/// names the ledger's tables unqualified) with the ledger's tables named in
/// the `main` database: SQLite resolves an unqualified name to a `TEMP`
/// table first, and a handler may leave one of that name on a pooled
/// connection.
fn in_main(sql: &str) -> String {
    sql.replace(" idempotency_records", " main.idempotency_records")
        .replace(" tower_idempotency_audit", " main.tower_idempotency_audit")
}

/// Runs one literal statement on the pool; the rows it changed.
async fn execute(pool: &Pool<Sqlite>, sql: String) -> Result<u64, sqlx::Error> {
    Ok(sqlx::raw_sql(AssertSqlSafe(in_main(&sql)))
        .execute(pool)
        .await?
        .rows_affected())
}

/// Begins a claimed transaction that holds SQLite's write lock.
async fn begin_immediate(conn: PoolConnection<Sqlite>) -> Result<Claimed<Sqlite>, sqlx::Error> {
    Claimed::begin(conn, "BEGIN IMMEDIATE".into_sql_str(), rollback)
        .await
        .map_err(|(e, _)| e)
}

/// A recording that failed: the claimed transaction rolled back (opened
/// again first if the handler had ended it, see [`reopen_if_ended`]).
async fn abandon(mut tx: Claimed<Sqlite>, e: sqlx::Error) -> FinishError {
    let e = reopen_if_ended(&mut tx, e).await;
    tx.rollback().await;
    e.into()
}

/// The handler ended the claimed transaction: sqlx still counts it open,
/// and SQLite refuses a `ROLLBACK` outside a transaction, which would leave
/// that count behind on a pooled connection. Open a transaction again so
/// the layer's rollback closes it and the connection goes back clean.
async fn reopen_if_ended(conn: &mut sqlx::SqliteConnection, e: sqlx::Error) -> sqlx::Error {
    if Sqlite::error_kind(&e) == StoreErrorKind::TransactionEnded {
        // Fails harmlessly when the handler had begun a new transaction.
        let _ = sqlx::raw_sql("BEGIN").execute(conn).await;
    }
    e
}
