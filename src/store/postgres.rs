//! PostgreSQL: the production store.

use std::future::poll_fn;
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgRow, Postgres};
use sqlx::{AssertSqlSafe, FromRow, Pool, Row, SqlSafeStr};

use super::lease::Dialect;
use super::literal::hex;
use super::{
    Backend, Claim, ClaimOutcome, Claimed, Completion, Fence, FinishError, IsolationLevel,
    LeaseWrite, Migration, Record, RecordRow, Scope, StoreErrorKind, TAKE_SAVEPOINT,
    UNDO_TO_SAVEPOINT, generic_error_kind, migrations, record_from_row, release_savepoint,
    run_migrations,
};

/// The database clock, epoch milliseconds (the transaction's start time).
macro_rules! now_ms {
    () => {
        "(EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT"
    };
}

const MIGRATIONS: &[Migration] = migrations!(
    "postgres",
    1 => "0001_idempotency_records",
    2 => "0002_byte_scopes_and_reconciliation",
    3 => "0003_hot_completion",
    4 => "0004_lease_mode",
    5 => "0005_claim_fence",
    6 => "0006_claim_functions",
    7 => "0007_operator_audit",
);

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
            now = now_ms!(),
        )?;
        tx.commit().await
    }

    async fn claim(
        mut conn: PoolConnection<Self>,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome<Self>, sqlx::Error> {
        // One round trip. The statements run in the implicit transaction of
        // a multi-statement query until `BEGIN` turns it into an explicit
        // one that stays open for the handler, past the savepoint. The
        // claim is `tower_idempotency_claim` (ledger v6): it takes the
        // scope's advisory lock (a wait bounded inside the function, the
        // session's own `lock_timeout` put back after it), then inserts the
        // `PROCESSING` row; won, lost (with the row that holds the scope)
        // and still in flight are values, so a retry raises no error on the
        // server, and a replay writes nothing. A serialization failure
        // (above READ COMMITTED) ends in an error that rolls everything
        // back and leaves the connection idle. Several statements need the simple query
        // protocol, which has no parameters, so every value is written as
        // hex digits or a decimal integer: nothing from the request can
        // change the statement.
        //
        // sqlx cannot both read a statement's rows and count the
        // transaction it opens, so the won transaction is handed over as
        // the raw connection (`Claimed::raw`): `finish` commits it in the
        // recording's batch, and nothing is queued after it.
        let ms = claim.lock_wait.as_millis().clamp(1, i32::MAX as u128);
        let sql = format!(
            "SET TRANSACTION ISOLATION LEVEL {}; \
             SELECT * FROM tower_idempotency_claim({}, {}, {}, {}, {}, {ms}); \
             BEGIN; {TAKE_SAVEPOINT}",
            claim.isolation.as_sql(),
            text_arg(claim.scope.principal),
            text_arg(claim.scope.operation),
            text_arg(claim.scope.key),
            bytea_arg(claim.fingerprint),
            claim.retention_ms,
        );
        let row = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_one(&mut *conn)
            .await?;
        // From here the connection is inside the transaction: on an error
        // it is closed, never pooled.
        let outcome = match claim_outcome(&row) {
            Ok(Some(outcome)) => outcome,
            Ok(None) => return Ok(ClaimOutcome::Won(Claimed::raw(conn))),
            Err(e) => {
                conn.close_on_drop();
                return Err(e);
            }
        };
        // The transaction wrote nothing; ending it with COMMIT keeps the
        // server's rollback count for real failures.
        if let Err(e) = sqlx::raw_sql("COMMIT").execute(&mut *conn).await {
            conn.close_on_drop();
            return Err(e);
        }
        Ok(outcome)
    }

    async fn finish(
        pool: &Pool<Self>,
        tx: Claimed<Self>,
        scope: &Scope<'_>,
        c: &Completion<'_>,
    ) -> Result<i64, FinishError> {
        // One round trip: (undo the business writes,) prove the claimed
        // transaction is still ours by releasing its savepoint, record
        // (`tower_idempotency_finish`, which fails when the row is gone, so
        // the COMMIT never runs without it), commit. The transaction's id
        // rides along with the expiry, so that a connection lost during the
        // `COMMIT` can be explained (`txid_current()`: 64 bits with the
        // epoch, on every version, where PostgreSQL 13's
        // `pg_current_xact_id()` is not).
        let release = release_savepoint(c.status);
        let sql = format!(
            "{release}; \
             SELECT tower_idempotency_finish({}, {}, {}, '{}', {}, {}, {}, {}), txid_current(); \
             COMMIT",
            text_arg(scope.principal),
            text_arg(scope.operation),
            text_arg(scope.key),
            c.status.as_str(),
            c.response_status,
            bytea_arg(c.response_headers),
            bytea_arg(c.response_body),
            c.resource_id.map_or_else(|| "NULL".to_string(), text_arg),
        );
        run_commit(pool, tx, sql).await
    }

    async fn check_savepoint(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(UNDO_TO_SAVEPOINT)
            .execute(conn)
            .await
            .map(drop)
    }

    // Every statement below goes through the simple query protocol with
    // hex literals, like the claim: one round trip each, no prepared
    // statements, so the ledger works through PgBouncer in transaction
    // pooling mode whatever its version and the application's statement
    // cache settings.

    async fn fetch(pool: &Pool<Self>, scope: &Scope<'_>) -> Result<Option<Record>, sqlx::Error> {
        let sql = format!(
            "SELECT status, request_fingerprint, response_status, response_headers, \
             response_body, resource_id, expires_at, \
             CASE WHEN expires_at <= {now} THEN 1::INT8 ELSE 0::INT8 END, generation, \
             CASE WHEN locked_until > {now} THEN 1::INT8 ELSE 0::INT8 END, \
             recovery_point, recovery_data, pending_step, claim_id, parks::INT8 \
             FROM idempotency_records WHERE {}",
            where_scope(scope),
            now = now_ms!(),
        );
        let Some(row) = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_optional(pool)
            .await?
        else {
            return Ok(None);
        };
        record_from_row(RecordRow::from_row(&row)?).map(Some)
    }

    async fn mark_unresolved(
        pool: &Pool<Self>,
        claim: &Claim<'_>,
        response_status: i32,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "INSERT INTO idempotency_records (principal_id, operation, idem_key, \
             request_fingerprint, status, response_status, created_at, expires_at) \
             VALUES ({}, {}, {}, {}, 'NEEDS_RECONCILIATION', {response_status}, {now}, {now} + {}) \
             ON CONFLICT (principal_id, operation, idem_key) DO UPDATE \
             SET status = 'NEEDS_RECONCILIATION', response_status = EXCLUDED.response_status \
             WHERE idempotency_records.status = 'PROCESSING'",
            text(claim.scope.principal),
            text(claim.scope.operation),
            text(claim.scope.key),
            bytea(claim.fingerprint),
            claim.retention_ms,
            now = now_ms!(),
        );
        execute(pool, sql).await
    }

    async fn expire_batch(
        pool: &Pool<Self>,
        now: Option<i64>,
        keep_ms: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "UPDATE idempotency_records SET status = 'EXPIRED', response_headers = NULL, \
             response_body = NULL, expires_at = expires_at + {keep_ms} \
             WHERE (principal_id, operation, idem_key) IN \
             (SELECT principal_id, operation, idem_key FROM idempotency_records \
             WHERE status IN ('SUCCEEDED', 'FAILED_FINAL') AND expires_at <= {} \
             LIMIT {limit} FOR UPDATE SKIP LOCKED)",
            now.map_or_else(|| now_ms!().to_string(), |n| n.to_string()),
        );
        execute(pool, sql).await
    }

    async fn purge_batch(
        pool: &Pool<Self>,
        now: Option<i64>,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let sql = format!(
            "DELETE FROM idempotency_records WHERE (principal_id, operation, idem_key) IN \
             (SELECT principal_id, operation, idem_key FROM idempotency_records \
             WHERE status = 'EXPIRED' AND expires_at <= {} \
             LIMIT {limit} FOR UPDATE SKIP LOCKED)",
            now.map_or_else(|| now_ms!().to_string(), |n| n.to_string()),
        );
        execute(pool, sql).await
    }

    async fn lease_claim(
        pool: &Pool<Self>,
        claim: &Claim<'_>,
        lease_ms: i64,
        claim_id: &str,
    ) -> Result<bool, sqlx::Error> {
        let ms = claim.lock_wait.as_millis().clamp(1, i32::MAX as u128);
        let sql = format!(
            "SET LOCAL lock_timeout = '{ms}ms'; {}",
            DIALECT.claim(
                claim,
                lease_ms,
                claim_id,
                "ON CONFLICT (principal_id, operation, idem_key) DO NOTHING"
            )
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
        let sql = DIALECT.take_over(scope, seen, lease_ms, parked);
        Ok(execute(pool, bounded_wait(&sql)).await? == 1)
    }

    async fn lease_write(
        pool: &Pool<Self>,
        scope: &Scope<'_>,
        fence: Fence<'_>,
        write: &LeaseWrite<'_>,
    ) -> Result<bool, sqlx::Error> {
        let sql = DIALECT.write(scope, fence, write);
        Ok(execute(pool, bounded_wait(&sql)).await? == 1)
    }

    async fn begin_phase(
        pool: &Pool<Self>,
        isolation: IsolationLevel,
    ) -> Result<Claimed<Self>, sqlx::Error> {
        let begin = format!("BEGIN ISOLATION LEVEL {}", isolation.as_sql());
        let tx = pool.begin_with(AssertSqlSafe(begin).into_sql_str()).await?;
        Ok(tx.into())
    }

    async fn commit_fenced(
        pool: &Pool<Self>,
        tx: Claimed<Self>,
        scope: &Scope<'_>,
        fence: Fence<'_>,
        write: &LeaseWrite<'_>,
    ) -> Result<Option<i64>, FinishError> {
        // One round trip, as `finish`: the division fails when the fence
        // matched nothing, so the COMMIT never runs for a stale writer.
        let sql = format!(
            "WITH done AS ({} RETURNING expires_at) \
             SELECT max(expires_at) + 0 * (1 / count(*)), txid_current() FROM done; \
             COMMIT; BEGIN",
            DIALECT.write(scope, fence, write)
        );
        match run_commit(pool, tx, sql).await {
            Ok(expires_at) => Ok(Some(expires_at)),
            Err(FinishError::Store(e))
                if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("22012") =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    super::lease::list_leases!();
    super::lease::list_unresolved!();
    super::lease::count_unresolved!();

    fn error_kind(err: &sqlx::Error) -> StoreErrorKind {
        if let Some(kind) = generic_error_kind(err) {
            return kind;
        }
        let Some(code) = err.as_database_error().and_then(|e| e.code()) else {
            return StoreErrorKind::Other;
        };
        match &*code {
            // lock_not_available: our lock_timeout fired; query_canceled:
            // the application's own statement_timeout fired first.
            "55P03" | "57014" => StoreErrorKind::LockTimeout,
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

/// Runs a recording batch whose one row is `(expires_at, txid_current())`
/// and which ends in `COMMIT` (raw, from a claim) or `COMMIT; BEGIN` (a
/// sqlx transaction, whose count of one open transaction the `BEGIN`
/// matches); on error rolls back (sqlx) or closes the connection (raw: its
/// state after a failed batch is not known here, and a closed connection
/// leaves nothing open). Read as a stream: the row the server sent before
/// the connection died is kept with the error that followed it, and the
/// transaction's id then asks the server what became of the commit.
async fn run_commit(
    pool: &Pool<Postgres>,
    mut tx: Claimed<Postgres>,
    sql: String,
) -> Result<i64, FinishError> {
    tx.committing();
    let (row, failed) = {
        let mut rows = sqlx::raw_sql(AssertSqlSafe(sql)).fetch(&mut *tx);
        let mut first = None;
        loop {
            match poll_fn(|cx| rows.as_mut().poll_next(cx)).await {
                Some(Ok(row)) => {
                    first.get_or_insert(row);
                }
                Some(Err(e)) => break (first, Some(e)),
                None => break (first, None),
            }
        }
    };
    let recorded = row.map(|row| <(i64, i64)>::from_row(&row)).transpose();
    let Some(e) = failed else {
        tx.ended();
        let (expires_at, _) = recorded?.ok_or(sqlx::Error::RowNotFound)?;
        return Ok(expires_at);
    };
    match tx.into_transaction() {
        Ok(tx) => {
            let _ = tx.rollback().await;
        }
        Err(raw) => raw.discard(),
    }
    let (expires_at, xid) = match recorded {
        // The row arrived, so the server ran the batch this far and may
        // have committed: ask what became of the transaction.
        Ok(Some(read)) if Postgres::error_kind(&e) == StoreErrorKind::ConnectionLost => read,
        _ => return Err(FinishError::Store(e)),
    };
    let status = lost_commit_status(pool, xid).await;
    tracing::warn!(
        xid,
        xact_status = status.as_str(),
        "the connection was lost during COMMIT; the server's transaction status decides"
    );
    match status {
        XactStatus::Committed => Ok(expires_at),
        XactStatus::Aborted => Err(FinishError::Aborted(e)),
        XactStatus::InProgress => Err(FinishError::InProgress(e)),
        // Too old to be known, or no answer: the layer reads the ledger.
        XactStatus::Unknown => Err(FinishError::Store(e)),
    }
}

/// What the claim function's row says: `None` when the claim was won; a
/// lost claim with the row that holds the scope, as `fetch` reads it
/// (`None` when it was deleted meanwhile); or still in flight.
fn claim_outcome(row: &PgRow) -> Result<Option<ClaimOutcome<Postgres>>, sqlx::Error> {
    Ok(Some(match row.try_get::<Option<bool>, _>(0)? {
        Some(true) => return Ok(None),
        Some(false) => ClaimOutcome::Lost(match row.try_get::<Option<String>, _>(1)? {
            Some(_) => Some(Box::new(record_from_row((
                row.try_get(1)?,
                row.try_get(2)?,
                row.try_get(3)?,
                row.try_get(4)?,
                row.try_get(5)?,
                row.try_get(6)?,
                row.try_get(7)?,
                row.try_get(8)?,
                row.try_get(9)?,
                row.try_get(10)?,
                row.try_get(11)?,
                row.try_get(12)?,
                row.try_get(13)?,
                row.try_get(14)?,
                row.try_get(15)?,
            ))?)),
            None => None,
        }),
        None => ClaimOutcome::InFlight,
    }))
}

/// How lease statements write literals and read the clock.
/// Lease times are read from the wall clock at the statement
/// (`clock_timestamp()`), not at the transaction's start: a phase that
/// commits after a long transaction gets a full lease from its commit.
pub(super) const DIALECT: Dialect = Dialect {
    key: text,
    text,
    blob: bytea,
    read_key: |column| column.to_string(),
    now: "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT",
    parks: "parks::INT8",
};

/// A lease statement whose row-lock wait is bounded: the statement runs in
/// the implicit transaction of its query, so `SET LOCAL` ends with it.
fn bounded_wait(sql: &str) -> String {
    format!("SET LOCAL lock_timeout = '{LEASE_LOCK_WAIT_MS}ms'; {sql}")
}

/// The longest wait of a lease statement on another writer's row lock.
/// Phases hold the row's lock only while they commit.
const LEASE_LOCK_WAIT_MS: u64 = 5_000;

/// What the server says became of a transaction, by its id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum XactStatus {
    /// Committed: everything it wrote is there.
    Committed,
    /// Rolled back (or crashed before its commit): nothing it wrote is there.
    Aborted,
    /// Still running, prepared, or its backend is still ending it: it may
    /// yet commit or roll back, and its row locks are held until it has.
    InProgress,
    /// The server could not say: the id is too old for the server to
    /// remember (`NULL`), or no answer came in time. Look elsewhere (the
    /// ledger) for what committed.
    Unknown,
}

impl XactStatus {
    /// Reads `txid_status`'s (`pg_xact_status`'s) answer.
    fn parse(status: Option<&str>) -> Self {
        match status {
            Some("committed") => Self::Committed,
            Some("aborted") => Self::Aborted,
            Some("in progress") => Self::InProgress,
            _ => Self::Unknown,
        }
    }

    /// The server's word for the status (`unknown` for no answer).
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Committed => "committed",
            Self::Aborted => "aborted",
            Self::InProgress => "in progress",
            Self::Unknown => "unknown",
        }
    }
}

/// Asks the server what became of the transaction `xid` (a
/// `txid_current()` value, epoch included, so a wrapped-around id never
/// names a newer transaction), on a connection of `pool` (never the
/// transaction's own, which is gone), within `timeout`. One question:
/// [`XactStatus::InProgress`] can be over a moment later. The question is
/// `txid_status`, which PostgreSQL 13 renamed `pg_xact_status` and still
/// answers under its old name, so it works on every version since 10.
pub(crate) async fn xact_status(pool: &Pool<Postgres>, xid: i64, timeout: Duration) -> XactStatus {
    let sql = format!("SELECT txid_status({xid})");
    let asked =
        tokio::time::timeout(timeout, sqlx::raw_sql(AssertSqlSafe(sql)).fetch_one(pool)).await;
    match asked {
        Ok(Ok(row)) => row
            .try_get::<Option<String>, _>(0)
            .map_or(XactStatus::Unknown, |status| {
                XactStatus::parse(status.as_deref())
            }),
        // A failed question ("in the future", no connection) or no answer in time.
        _ => XactStatus::Unknown,
    }
}

/// How long the layer asks about a `COMMIT` whose connection was lost
/// before it falls back to re-reading the ledger (or, while the server
/// says "in progress", answers that).
const LOST_COMMIT_WAIT: Duration = Duration::from_secs(1);

/// The pause between two questions while the transaction is in progress.
const LOST_COMMIT_POLL: Duration = Duration::from_millis(20);

/// What became of the transaction `xid` whose `COMMIT` lost its
/// connection. Asked again while it is in progress, within
/// [`LOST_COMMIT_WAIT`]: a backend that lost its client (or terminated
/// itself) is briefly "in progress" while it ends the transaction.
async fn lost_commit_status(pool: &Pool<Postgres>, xid: i64) -> XactStatus {
    let deadline = Instant::now() + LOST_COMMIT_WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let status = xact_status(pool, xid, left).await;
        if status != XactStatus::InProgress || Instant::now() + LOST_COMMIT_POLL >= deadline {
            return status;
        }
        tokio::time::sleep(LOST_COMMIT_POLL).await;
    }
}

/// Runs one literal statement on the pool; the rows it changed.
async fn execute(pool: &Pool<Postgres>, sql: String) -> Result<u64, sqlx::Error> {
    Ok(sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(pool)
        .await?
        .rows_affected())
}

/// `principal_id = … AND operation = … AND idem_key = …`, as literals.
fn where_scope(scope: &Scope<'_>) -> String {
    format!(
        "principal_id = {} AND operation = {} AND idem_key = {}",
        text(scope.principal),
        text(scope.operation),
        text(scope.key)
    )
}

/// A text value as an SQL expression made of hex digits only. The
/// explicit collation lets the planner use the ledger's indexes with it
/// (without it, `convert_from`'s result has no collation to match and a
/// lookup becomes a sequential scan).
fn text(value: &str) -> String {
    format!(
        "convert_from(decode('{}', 'hex'), 'UTF8') COLLATE \"default\"",
        hex(value.as_bytes())
    )
}

/// A text value as a function's argument: an escape string literal
/// (`E'…'`, every backslash and quote doubled, so it reads the same under
/// either `standard_conforming_strings`), which the server takes without a
/// function call; a value with a NUL, which no PostgreSQL text can hold, is
/// written as [`text`] writes it and fails there.
fn text_arg(value: &str) -> String {
    if value.contains('\0') {
        return text(value);
    }
    let mut lit = String::with_capacity(value.len() + 3);
    lit.push_str("E'");
    for c in value.chars() {
        match c {
            '\\' => lit.push_str("\\\\"),
            '\'' => lit.push_str("''"),
            c => lit.push(c),
        }
    }
    lit.push('\'');
    lit
}

/// A `bytea` value as a function's argument: hex digits in an escape
/// string literal (`E'\\x…'::bytea`).
fn bytea_arg(value: &[u8]) -> String {
    format!("E'\\\\x{}'::bytea", hex(value))
}

/// A `bytea` value as an SQL expression made of hex digits only.
fn bytea(value: &[u8]) -> String {
    format!("decode('{}', 'hex')", hex(value))
}

#[cfg(test)]
mod tests {
    use super::XactStatus;

    #[test]
    fn xact_statuses_map_to_outcomes() {
        assert_eq!(XactStatus::parse(Some("committed")), XactStatus::Committed);
        assert_eq!(XactStatus::parse(Some("aborted")), XactStatus::Aborted);
        assert_eq!(
            XactStatus::parse(Some("in progress")),
            XactStatus::InProgress
        );
        // NULL: the id is older than the server remembers.
        assert_eq!(XactStatus::parse(None), XactStatus::Unknown);
        assert_eq!(XactStatus::parse(Some("frozen")), XactStatus::Unknown);
        for status in [
            XactStatus::Committed,
            XactStatus::Aborted,
            XactStatus::InProgress,
        ] {
            assert_eq!(XactStatus::parse(Some(status.as_str())), status);
        }
    }

    /// The helper against the server: a transaction left open, committed,
    /// rolled back, and an id the server has not handed out yet.
    #[cfg(feature = "testkit")]
    #[tokio::test]
    async fn xact_status_asks_the_server() {
        use std::time::Duration;

        use sqlx::Row as _;
        use sqlx::postgres::PgPoolOptions;

        use super::xact_status;

        let pool = PgPoolOptions::new()
            .max_connections(3)
            .connect(&crate::testkit::pg_admin_url())
            .await
            .unwrap();
        let wait = Duration::from_secs(5);
        async fn xid(conn: &mut sqlx::PgConnection) -> i64 {
            sqlx::raw_sql("SELECT txid_current()")
                .fetch_one(conn)
                .await
                .unwrap()
                .get(0)
        }
        let mut open = pool.begin().await.unwrap();
        let committed = xid(&mut open).await;
        assert_eq!(
            xact_status(&pool, committed, wait).await,
            XactStatus::InProgress
        );
        open.commit().await.unwrap();
        assert_eq!(
            xact_status(&pool, committed, wait).await,
            XactStatus::Committed
        );
        let mut open = pool.begin().await.unwrap();
        let aborted = xid(&mut open).await;
        open.rollback().await.unwrap();
        assert_eq!(xact_status(&pool, aborted, wait).await, XactStatus::Aborted);
        // "transaction ID … is in the future": an error, so no answer.
        assert_eq!(
            xact_status(&pool, aborted + (1 << 40), wait).await,
            XactStatus::Unknown
        );
    }

    #[test]
    fn function_arguments_are_escaped_literals() {
        assert_eq!(super::text_arg("a'b\\c"), "E'a''b\\\\c'");
        assert_eq!(
            super::text_arg("x'); DROP TABLE t; --"),
            "E'x''); DROP TABLE t; --'"
        );
        assert!(super::text_arg("a\0b").starts_with("convert_from(decode('"));
        assert_eq!(super::bytea_arg(&[0, 0xab]), "E'\\\\x00ab'::bytea");
    }

    #[test]
    fn literals_hold_only_hex_digits() {
        let lit = super::text("x'); DROP TABLE t; --");
        let inner = lit
            .strip_prefix("convert_from(decode('")
            .and_then(|l| l.strip_suffix("', 'hex'), 'UTF8') COLLATE \"default\""))
            .unwrap();
        assert!(inner.bytes().all(|b| b.is_ascii_hexdigit()));
    }
}
