//! MySQL and MariaDB (InnoDB).

use std::sync::atomic::{AtomicBool, Ordering};

use sqlx::mysql::{MySql, MySqlDatabaseError, MySqlTransactionManager};
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Pool, Row, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;

use super::claimed::{CloseOnCancel, Ending};
use super::lease::{Args, Dialect};
use super::literal::hex;
use super::literal::x_literal;
use super::{
    AtCommitOutcome, Backend, Claim, ClaimOutcome, Claimed, Completion, Fence, FinishError,
    IsolationLevel, LeaseWrite, MIN_READ_WAIT, Migration, Record, RecordRow, RecordStatus,
    Savepoint, Scope, StoreErrorKind, generic_error_kind, migrations, record_from_row,
    run_migrations, shared_statements,
};

/// The caller's session settings that would change what a ledger
/// statement reads, or how its answer and errors are encoded, pinned to
/// the server's defaults for that one statement (MariaDB's `SET STATEMENT
/// … FOR`; MySQL reads the `/*M!…*/` form as a comment): the results come
/// in `utf8mb4` whatever `character_set_results` or `SET NAMES` says (so
/// text columns decode, and a duplicate key's message stays UTF-8), and a
/// `SELECT` returns all its rows whatever `sql_select_limit` says. The
/// session's own values are never changed. (`character_set_client` and
/// `character_set_connection` cannot be set per statement: the ledger's
/// scope values are hex literals or bound bytes, which no character set
/// converts.)
macro_rules! pinned_vars {
    () => {
        "character_set_results = utf8mb4, sql_select_limit = DEFAULT"
    };
}

/// [`pinned_vars!`] for the statement that follows.
macro_rules! pinned {
    () => {
        concat!("/*M!100301 SET STATEMENT ", pinned_vars!(), " FOR */ ")
    };
}

/// Ends a claimed transaction that is not committed: rolls it back (or
/// does nothing when there is none) and turns autocommit back on, as the
/// pool handed the connection out.
/// `AND NO CHAIN NO RELEASE`: whatever the session's `completion_type`,
/// the end opens no next transaction and keeps the connection.
const END_CLAIM: &str = "ROLLBACK AND NO CHAIN NO RELEASE; SET autocommit = 1";

/// Commits a claimed (or phase) transaction at the end of the batch that
/// records it, then turns autocommit back on; never chained or released,
/// whatever the session's `completion_type`.
macro_rules! commit {
    () => {
        "COMMIT AND NO CHAIN NO RELEASE; SET autocommit = 1"
    };
}

/// Read in a batch that commits: whether the session's `completion_type`
/// is not `NO_CHAIN`, so that sqlx's own `ROLLBACK` of nothing, queued
/// once the batch ended the transaction, would open a transaction (or end
/// the connection): see [`ended`].
const CHAINS: &str = "CAST(@@SESSION.completion_type <> 'NO_CHAIN' AS SIGNED)";

/// On a Galera node: waits until the node has applied what the cluster
/// committed before it (reads, updates, deletes, inserts), for one
/// table-less read (MariaDB waits only outside a transaction). Sent only
/// where [`Claim::causal_wait`] asks for it: a layer that found its server
/// is not a Galera node leaves it out (it costs such a server about 40 µs
/// per claim, docs/performance.md); MySQL reads the `/*M!…*/` form as a
/// comment.
const SYNC_READ: &str = concat!(
    "/*M!100301 SET STATEMENT wsrep_sync_wait = 15, ",
    pinned_vars!(),
    " FOR */ SELECT 1; "
);

/// Set once a server refused `wsrep_sync_wait` (`ER_UNKNOWN_SYSTEM_VARIABLE`:
/// a MariaDB built without Galera support, such as the Windows builds);
/// claims then leave the wait out. Process-wide: a process that meets such
/// a server and also a Galera node loses the causal wait on the cluster
/// (a retry that outruns the replication then runs and is rolled back by
/// the cluster, answered from the ledger or with a retryable `503`).
static NO_SYNC_WAIT: AtomicBool = AtomicBool::new(false);

/// A pause, in milliseconds, that the next recording batch takes right
/// after it released the claim's savepoint (or right before, with
/// [`PAUSE_BEFORE_PROOF`]), once (0: none); armed by
/// [`crate::testkit::pause_at_next_proof`], so a test can land a
/// replicated writer's abort at that point of the batch.
#[cfg(feature = "testkit")]
pub(crate) static PAUSE_AT_PROOF_MS: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

/// The bit of [`PAUSE_AT_PROOF_MS`] that puts the pause before the proof.
#[cfg(feature = "testkit")]
pub(crate) const PAUSE_BEFORE_PROOF: u64 = 1 << 63;

/// Releases the claim's savepoint, which proves the claimed transaction is
/// still the one the claim began: it fails (`ER_SP_DOES_NOT_EXIST`, or the
/// deadlock error of a transaction the server rolled back) once the
/// server or the handler ended it.
///
/// Every batch that writes on a claimed (or phase) transaction sends it
/// after its last write, never before: when the server rolls a transaction
/// back while one of its batches runs (on Galera, a replicated writer's
/// abort), MariaDB may end that statement without an error and run the
/// rest of the batch in a new transaction, which the batch's `COMMIT` then
/// commits (and reports as a deadlock). A write after the proof could so
/// commit alone (a ledger row that names an order rolled back); a write
/// before it is followed by a proof that fails, and the batch stops. An
/// abort after the proof leaves nothing but the `COMMIT`, of an empty
/// transaction, which reports the deadlock (tests/galera.rs,
/// `abort_at_the_proof`).
fn proof() -> std::borrow::Cow<'static, str> {
    let release = Savepoint::get().release(RecordStatus::Succeeded);
    #[cfg(feature = "testkit")]
    {
        let armed = PAUSE_AT_PROOF_MS.swap(0, Ordering::SeqCst);
        let ms = armed & !PAUSE_BEFORE_PROOF;
        if ms > 0 {
            let pause = format!("DO SLEEP({}.{:03})", ms / 1000, ms % 1000);
            return if armed & PAUSE_BEFORE_PROOF != 0 {
                format!("{pause}; {release}")
            } else {
                format!("{release}; {pause}")
            }
            .into();
        }
    }
    release.into()
}

/// What opens every batch that writes on a claimed (or phase) transaction:
/// autocommit off again (a handler's `SET autocommit = 1` committed the
/// transaction and would make the batch's writes commit one by one before
/// the [`proof`] fails; off, they wait for a `COMMIT` that never comes),
/// then, for a final failure, the business writes undone (the savepoint
/// stays, for the proof at the batch's end).
fn opening(status: RecordStatus) -> String {
    if status == RecordStatus::FailedFinal {
        format!("SET autocommit = 0; {}; ", Savepoint::get().undo)
    } else {
        "SET autocommit = 0; ".to_owned()
    }
}

/// The database clock, epoch milliseconds, in UTC arithmetic only (no
/// session time zone conversion).
macro_rules! now_ms {
    () => {
        "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)"
    };
}

/// A ledger row as a [`super::RecordRow`], without its `WHERE`: the
/// layer's read of a scope (`fetch`, bound) and a lost claim's (literal,
/// [`end_and_read`]).
macro_rules! read_record {
    () => {
        concat!(
            pinned!(),
            "SELECT status, request_fingerprint, response_status, response_headers, \
             response_body, resource_id, expires_at, \
             CASE WHEN expires_at <= ",
            now_ms!(),
            " THEN 1 ELSE 0 END, generation, CASE WHEN locked_until > ",
            now_ms!(),
            " THEN 1 ELSE 0 END, CONVERT(recovery_point USING utf8mb4), recovery_data, \
             CONVERT(pending_step USING utf8mb4), CONVERT(claim_id USING utf8mb4), \
             CAST(parks AS SIGNED) FROM idempotency_records"
        )
    };
}

const MIGRATIONS: &[Migration] = migrations!(
    "mysql",
    1 => "0001_idempotency_records",
    2 => "0002_byte_scopes_and_reconciliation",
    3 => "0003_tombstone_purge_time",
    4 => "0004_lease_mode",
    5 => "0005_claim_fence",
    6 => "0006_operator_audit",
    7 => "0007_ledger_view",
    8 => "0008_ledger_table_name",
);

/// The ledger table's name since migration 8
/// (`migrations/mysql/0008_ledger_table_name.sql`), which every ledger
/// statement names: a `TEMPORARY` table named `idempotency_records` (now a
/// view of this table, for readers outside the layer) shadows that name
/// on the connection that made it, qualified or not, never this one.
/// Named directly, not through a view, which the server would expand for
/// every statement.
const LEDGER_TABLE: &str = "tower_idempotency_records";

/// `sql` (written against `idempotency_records` and
/// `tower_idempotency_audit`) naming the ledger table and the audit table
/// in `database`, the pool's (see [`Backend::database`]): neither a
/// handler's temporary table nor its `USE` moves the ledger.
fn in_ledger(sql: &str, database: Option<&str>) -> String {
    let db = database.map_or_else(String::new, |db| format!("`{}`.", db.replace('`', "``")));
    sql.replace(" idempotency_records", &format!(" {db}{LEDGER_TABLE}"))
        .replace(
            " tower_idempotency_audit",
            &format!(" {db}tower_idempotency_audit"),
        )
}

#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
impl Backend for MySql {
    const CLAIMS_RUN_WITHOUT_AUTOCOMMIT: bool = true;

    fn database(pool: &Pool<Self>) -> Option<std::sync::Arc<str>> {
        pool.connect_options().get_database().map(Into::into)
    }

    fn ledger_sql(pool: &Pool<Self>, sql: &'static str) -> sqlx::SqlStr {
        AssertSqlSafe(in_ledger(sql, Self::database(pool).as_deref())).into_sql_str()
    }

    async fn migrate(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        // MySQL's DDL commits implicitly, so the lock is a named session
        // lock; the connection is closed afterwards (never pooled holding
        // it, whatever happens).
        let mut conn = pool.acquire().await?;
        conn.close_on_drop();
        let got: Option<i64> =
            sqlx::query_scalar("SELECT GET_LOCK('tower_idempotency_migrate', 60)")
                .fetch_one(&mut *conn)
                .await?;
        if got != Some(1) {
            return Err(sqlx::Error::Protocol(
                "timed out after 60 s waiting for the tower_idempotency_migrate lock".into(),
            ));
        }
        // DDL waits for every transaction that has used its table, and
        // every new statement on that table queues behind it: a bounded
        // wait (the server's default is a day or more) fails the migration,
        // which changed nothing and runs again, rather than stalling the
        // ledger behind one long transaction. The connection is closed
        // afterwards, setting and all.
        sqlx::raw_sql("SET SESSION lock_wait_timeout = 10")
            .execute(&mut *conn)
            .await?;
        run_migrations!(
            &mut *conn,
            MIGRATIONS,
            create = "CREATE TABLE IF NOT EXISTS tower_idempotency_migrations \
                      (version BIGINT PRIMARY KEY, name VARCHAR(255) NOT NULL, \
                      applied_at BIGINT NOT NULL) ENGINE = InnoDB",
            now = now_ms!(),
        )?;
        sqlx::query("SELECT RELEASE_LOCK('tower_idempotency_migrate')")
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn claim(
        conn: PoolConnection<Self>,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome<Self>, sqlx::Error> {
        // One round trip: on a Galera node, wait until the node has applied
        // every transaction the cluster committed before this one
        // (`SYNC_READ`, first: MariaDB waits only outside a transaction),
        // so a retry sent to another node right after the answer finds the
        // recorded row; then autocommit off for the claim's session, begin,
        // insert, savepoint. `SET TRANSACTION` (without SESSION) applies to
        // the next transaction only. With autocommit off, a statement the
        // handler sends after the server rolled the transaction back
        // itself (a deadlock, a lock wait timeout with
        // `innodb_rollback_on_timeout`, or on Galera a certification
        // conflict or a replicated writer's abort) opens a new transaction
        // that nothing commits, instead of committing on its own: business
        // rows never commit without the ledger row. `READ WRITE`: a
        // session left read-only (`SET SESSION TRANSACTION READ ONLY`,
        // `tx_read_only`) never refuses the claimed transaction or the
        // handler's writes on it. `finish` and every
        // rollback (`END_CLAIM`) turn autocommit back on before the
        // connection goes back to the pool.
        // The insert is bounded and plain (`bounded_insert`); values are
        // hex literals.
        let insert = format!(
            "{}INTO idempotency_records \
             (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at) \
             VALUES (X'{}', X'{}', X'{}', X'{}', 'PROCESSING', {now}, {now} + {}); ",
            bounded_insert(claim),
            hex(claim.scope.principal.as_bytes()),
            hex(claim.scope.operation.as_bytes()),
            hex(claim.scope.key.as_bytes()),
            hex(claim.fingerprint),
            claim.retention_ms,
            now = now_ms!(),
        );
        let begun = begin_claimed(conn, claim, &insert).await;
        match begun {
            Ok(claimed) => Ok(ClaimOutcome::Won(claimed)),
            // The batch stopped at its failing statement, perhaps with
            // autocommit off and a transaction open: end both. A duplicate
            // key (the driver's own signal, never a parsed message) is a
            // committed row, read on the way.
            Err((e, conn)) => match e.as_database_error() {
                Some(d) if d.is_unique_violation() => {
                    Ok(ClaimOutcome::Lost(end_and_read(conn, claim).await))
                }
                _ => {
                    end_or_close(conn).await;
                    Err(e)
                }
            },
        }
    }

    async fn finish(
        _pool: &Pool<Self>,
        mut tx: Claimed<Self>,
        claim: &Claim<'_>,
        c: &Completion<'_>,
    ) -> Result<i64, FinishError> {
        let scope = &claim.scope;
        // One round trip: autocommit off again (and the business writes
        // undone, for a final failure; see `opening`), record (the
        // `UPDATE`'s lock wait bounded at once: the claim holds its row's
        // lock, so a wait means the transaction is no longer the claim's),
        // read the expiry, prove the claimed transaction is still ours by
        // releasing its savepoint (after the writes: see `proof`), commit,
        // and turn autocommit back on. The expiry comes back without a
        // read of the row (MariaDB has no `UPDATE … RETURNING`, and a
        // read is a statement more for the server to run): the
        // `UPDATE` hands it to the session's `LAST_INSERT_ID()` (the
        // ledger has no auto-increment column, so a connection's value
        // after a recording is that expiry, as after any insert it is that
        // insert's id). The read fails (`ER_DATA_OUT_OF_RANGE`: a BIGINT
        // overflow is an error whatever the `sql_mode`) when the `UPDATE`
        // changed no row (`ROW_COUNT()`), so the COMMIT never runs without
        // the recorded row. (A scalar subquery of a three-way `UNION`,
        // which failed with two rows, cost `mariadbd` about 40 µs more per
        // recording: docs/performance.md.) On any error the
        // transaction is rolled back (`END_CLAIM`, which restores
        // autocommit; a `ROLLBACK` after a `COMMIT` that landed finds no
        // transaction and does nothing), or the connection closed. A
        // connection lost during the COMMIT is left to the layer's re-read
        // of the ledger (`FinishError::Store`).
        let resource = resource_literal(c);
        let row = DIALECT.scope(&mut Args::new(), scope);
        let status = c.status.as_str();
        let sql = format!(
            "{open}{bounded}UPDATE /*+ SET_VAR(innodb_lock_wait_timeout = 1) */ idempotency_records SET status = '{status}', response_status = {}, \
             response_headers = X'{}', response_body = X'{}', resource_id = {resource}, \
             expires_at = LAST_INSERT_ID(expires_at) WHERE {row}; \
             {pinned}SELECT CAST(LAST_INSERT_ID() AS SIGNED) \
             + (9223372036854775807 + (ROW_COUNT() <> 1) - 9223372036854775807), \
             {CHAINS}; {proof}; {commit}",
            c.response_status,
            hex(c.response_headers),
            hex(c.response_body),
            open = opening(c.status),
            bounded = concat!(
                "/*M!100301 SET STATEMENT innodb_lock_wait_timeout = 0, ",
                pinned_vars!(),
                " FOR */ "
            ),
            pinned = pinned!(),
            proof = proof(),
            commit = commit!(),
        );
        let sql = in_ledger(&sql, claim.database);
        let ran = sqlx::raw_sql(AssertSqlSafe(sql)).fetch_all(&mut *tx).await;
        match ran {
            // ER_DATA_OUT_OF_RANGE, the read's: the `UPDATE` found no row
            // of the claim; ER_LOCK_WAIT_TIMEOUT: the `UPDATE` (whose wait
            // is bounded at once) met another transaction's lock on the
            // row the claim holds. Either way the transaction is no longer
            // the claim's (the handler or the server ended it, and the
            // batch ran on in a new one, which is rolled back).
            Err(e) if matches!(number(&e), Some(1690 | 1205)) => {
                tx.rollback().await;
                Err(FinishError::Ended(e))
            }
            ran => settle_recording(tx, ran).await,
        }
    }

    async fn begin_at_commit(
        conn: PoolConnection<Self>,
        claim: &Claim<'_>,
    ) -> Result<Claimed<Self>, sqlx::Error> {
        // The claim's batch without its insert: one round trip, as a bare
        // `BEGIN`.
        match begin_claimed(conn, claim, "").await {
            Ok(tx) => Ok(tx),
            Err((e, conn)) => {
                end_or_close(conn).await;
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
        // One round trip: autocommit off again (and the business writes
        // undone, for a final failure; see `opening`), insert the scope's
        // finished row (its lock wait bounded for the insert alone), read
        // its expiry, prove the claimed transaction is still ours by
        // releasing its savepoint (after the write: see `proof`), commit,
        // and turn autocommit back on: one ledger write. A duplicate key
        // is the driver's unique-violation signal, which MySQL/MariaDB do
        // not log; the batch stops at it, so nothing of the transaction
        // commits. The expiry comes back without
        // a read of the row: on MariaDB 10.5 and later the insert
        // returns it (`RETURNING`), and the next statement is `DO 0`
        // (`/*!50700` being MySQL's alone there: a statement that returns
        // nothing and reads nothing, where a `SELECT` of a derived table
        // cost `mariadbd` about 50 µs per request); MySQL 5.7 and later
        // read it back from the row the statement before inserted
        // (`RETURNING` and `/*M!` being MariaDB's alone).
        let resource = resource_literal(c);
        let (principal, operation, key) = (
            hex(claim.scope.principal.as_bytes()),
            hex(claim.scope.operation.as_bytes()),
            hex(claim.scope.key.as_bytes()),
        );
        let sql = format!(
            "{open}{insert}INTO idempotency_records \
             (principal_id, operation, idem_key, request_fingerprint, status, response_status, \
             response_headers, response_body, resource_id, created_at, expires_at) \
             VALUES (X'{principal}', X'{operation}', X'{key}', X'{fingerprint}', '{status}', \
             {response_status}, X'{headers}', X'{body}', {resource}, {now}, {now} + {retention}) \
             /*M!100500 RETURNING expires_at, {CHAINS} */; \
             /*!50700 SELECT expires_at, {CHAINS} FROM idempotency_records WHERE {row} */ \
             /*M!100500 DO 0 */; \
             {proof}; {commit}",
            row = DIALECT.scope(&mut Args::new(), &claim.scope),
            open = opening(c.status),
            proof = proof(),
            insert = bounded_insert(claim),
            fingerprint = hex(claim.fingerprint),
            status = c.status.as_str(),
            response_status = c.response_status,
            headers = hex(c.response_headers),
            body = hex(c.response_body),
            retention = claim.retention_ms,
            now = now_ms!(),
            commit = commit!(),
        );
        let sql = in_ledger(&sql, claim.database);
        let ran = sqlx::raw_sql(AssertSqlSafe(sql)).fetch_all(&mut *tx).await;
        match ran {
            Err(e)
                if e.as_database_error()
                    .is_some_and(|d| d.is_unique_violation()) =>
            {
                tx.rollback().await;
                Ok(AtCommitOutcome::Lost(None))
            }
            // The insert's bounded wait ran out: on another request's
            // uncommitted row, or, when the transaction was no longer the
            // claim's (the batch ran on in a new one), on anything. The
            // savepoint says which.
            Err(e) if number(&e) == Some(1205) => {
                let ended = Self::check_savepoint(&mut tx)
                    .await
                    .is_err_and(|e| Self::error_kind(&e) == StoreErrorKind::TransactionEnded);
                tx.rollback().await;
                Err(if ended {
                    FinishError::Ended(e)
                } else {
                    FinishError::Store(e)
                })
            }
            ran => settle_recording(tx, ran)
                .await
                .map(AtCommitOutcome::Committed),
        }
    }

    async fn causal_wait(conn: &mut sqlx::MySqlConnection) -> Result<bool, sqlx::Error> {
        // Only a Galera node has `wsrep_on` set (globally: a session may
        // turn it off for itself). A server without the variable (MySQL,
        // a MariaDB built without Galera) is none.
        let sql = concat!(pinned!(), "SELECT CAST(@@GLOBAL.wsrep_on AS SIGNED)");
        match sqlx::raw_sql(sql).fetch_one(conn).await {
            Ok(row) => Ok(row.try_get::<i64, _>(0)? != 0),
            Err(e) if number(&e) == Some(1193) => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn check_savepoint(conn: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(Savepoint::get().undo.as_str())
            .execute(conn)
            .await
            .map(drop)
    }

    shared_statements!(
        MySql,
        // Bytes, which no character set of the session converts: a string
        // would be converted to `character_set_connection` before it meets
        // the `VARBINARY` column.
        scope = str::as_bytes,
        fetch = concat!(
            read_record!(),
            " WHERE principal_id = ? AND operation = ? AND idem_key = ?"
        ),
        // Assignments run left to right: response_status and parks before
        // status.
        mark = concat!(
            pinned!(),
            "INSERT INTO idempotency_records (principal_id, operation, idem_key, \
             request_fingerprint, status, response_status, parks, created_at, expires_at) \
             VALUES (?, ?, ?, ?, 'NEEDS_RECONCILIATION', ?, 1, ",
            now_ms!(),
            ", ",
            now_ms!(),
            " + ?) ON DUPLICATE KEY UPDATE \
             response_status = IF(status = 'PROCESSING', VALUES(response_status), response_status), \
             parks = IF(status = 'PROCESSING', parks + 1, parks), \
             status = IF(status = 'PROCESSING', 'NEEDS_RECONCILIATION', status)"
        ),
        expire = concat!(
            pinned!(),
            "UPDATE idempotency_records SET status = 'EXPIRED', response_headers = NULL, \
             response_body = NULL, expires_at = expires_at + ? \
             WHERE status IN ('SUCCEEDED', 'FAILED_FINAL') AND expires_at <= COALESCE(?, ",
            now_ms!(),
            ") LIMIT ?"
        ),
        purge = concat!(
            pinned!(),
            "DELETE FROM idempotency_records WHERE status = 'EXPIRED' \
             AND expires_at <= COALESCE(?, ",
            now_ms!(),
            ") LIMIT ?"
        ),
    );

    // Lease statements are literal SQL built once for every backend (see
    // `lease.rs`); each lock wait is bounded for its statement only.

    async fn lease_claim(
        pool: &Pool<Self>,
        claim: &Claim<'_>,
        lease_ms: i64,
        claim_id: &str,
    ) -> Result<bool, sqlx::Error> {
        let secs = claim.lock_wait.as_secs_f64().round().clamp(1.0, 3600.0) as u64;
        let sql = with_lock_wait(
            secs,
            &DIALECT.claim(&mut Vec::new(), claim, lease_ms, claim_id, None, ""),
        );
        match execute(pool, sql).await {
            Ok(_) => Ok(true),
            Err(e)
                if e.as_database_error()
                    .is_some_and(|d| d.is_unique_violation()) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    async fn take_over(
        pool: &Pool<Self>,
        scope: &Scope<'_>,
        seen: Fence<'_>,
        lease_ms: i64,
        parked: bool,
    ) -> Result<bool, sqlx::Error> {
        let sql = DIALECT.take_over(&mut Vec::new(), scope, seen, lease_ms, parked);
        Ok(execute(pool, with_lock_wait(LEASE_LOCK_WAIT_SECS, &sql)).await? == 1)
    }

    async fn lease_write(
        pool: &Pool<Self>,
        scope: &Scope<'_>,
        fence: Fence<'_>,
        write: &LeaseWrite<'_>,
    ) -> Result<bool, sqlx::Error> {
        let sql = DIALECT.write(&mut Vec::new(), scope, fence, write);
        Ok(execute(pool, with_lock_wait(LEASE_LOCK_WAIT_SECS, &sql)).await? == 1)
    }

    async fn begin_phase(
        pool: &Pool<Self>,
        isolation: IsolationLevel,
    ) -> Result<Claimed<Self>, sqlx::Error> {
        // As a claim: autocommit off (a statement sent after the server
        // rolled the phase back opens a transaction nothing commits), and
        // a savepoint `commit_fenced` releases after its write, so a phase
        // that ended commits nothing, its recovery point included.
        let begin = format!(
            "SET autocommit = 0; SET TRANSACTION ISOLATION LEVEL {}; START TRANSACTION READ WRITE; \
             {}",
            isolation.as_sql(),
            Savepoint::get().take,
        );
        let conn = super::acquire(pool).await?;
        match Claimed::begin(conn, AssertSqlSafe(begin).into_sql_str(), end_claim).await {
            Ok(phase) => Ok(phase),
            Err((e, conn)) => {
                end_or_close(conn).await;
                Err(e)
            }
        }
    }

    async fn commit_fenced(
        pool: &Pool<Self>,
        mut tx: Claimed<Self>,
        scope: &Scope<'_>,
        fence: Fence<'_>,
        write: &LeaseWrite<'_>,
    ) -> Result<Option<i64>, FinishError> {
        // The fenced write, then the proof that the phase is still the one
        // begun (its savepoint is there: an error of kind
        // `TransactionEnded` otherwise; after the write, see `proof`). A
        // phase keeps all its writes, as a success does. The affected-row
        // count is the count of rows found (sqlx asks for found rows), so
        // it says whether the fence matched.
        let database = Self::database(pool);
        let written = async {
            let sql = format!(
                "{}{}; {}",
                opening(RecordStatus::Succeeded),
                with_lock_wait(
                    LEASE_LOCK_WAIT_SECS,
                    &DIALECT.write(&mut Vec::new(), scope, fence, write)
                ),
                proof(),
            );
            let sql = in_ledger(&sql, database.as_deref());
            let done = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *tx).await?;
            if done.rows_affected() != 1 {
                return Ok(None);
            }
            let sql = format!(
                "{}SELECT expires_at, {CHAINS} FROM idempotency_records WHERE {}; {}",
                pinned!(),
                DIALECT.scope(&mut Vec::new(), scope),
                commit!(),
            );
            let sql = in_ledger(&sql, database.as_deref());
            let rows = sqlx::raw_sql(AssertSqlSafe(sql))
                .fetch_all(&mut *tx)
                .await
                .map_err(maybe_committed)?;
            // The batch ran to its end: the COMMIT ran.
            Ok::<_, sqlx::Error>(Some(expiry(&rows).map_err(committed_unread)))
        }
        .await;
        match written {
            Ok(Some(Ok((expires_at, chains)))) => {
                ended(tx, chains).await;
                Ok(Some(expires_at))
            }
            Ok(Some(Err(e))) => {
                ended(tx, true).await;
                Err(e.into())
            }
            Ok(None) => {
                tx.rollback().await;
                Ok(None)
            }
            Err(e) => {
                tx.rollback().await;
                Err(e.into())
            }
        }
    }

    super::lease::list_leases!();
    super::lease::list_unresolved!();
    super::lease::count_unresolved!();

    fn error_kind(err: &sqlx::Error) -> StoreErrorKind {
        if let Some(kind) = generic_error_kind(err) {
            return kind;
        }
        match number(err) {
            // ER_LOCK_WAIT_TIMEOUT
            Some(1205) => StoreErrorKind::LockTimeout,
            // ER_LOCK_DEADLOCK
            Some(1213) => StoreErrorKind::Conflict,
            // ER_SP_DOES_NOT_EXIST: "SAVEPOINT … does not exist"
            Some(1305) => StoreErrorKind::TransactionEnded,
            // ER_CON_COUNT_ERROR; a server that refuses writes for now
            // (ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION, and
            // ER_OPTION_PREVENTS_STATEMENT: `--read-only`, as a replica
            // or a primary being switched over answers)
            Some(1040 | 1792 | 1290) => StoreErrorKind::Busy,
            // server gone / lost / killed
            Some(2006 | 2013 | 1927 | 1053) => StoreErrorKind::ConnectionLost,
            _ => StoreErrorKind::Other,
        }
    }
}

/// An `INSERT ` whose lock wait is bounded by `claim.lock_wait` for the
/// statement alone: InnoDB counts it in whole seconds (MariaDB's
/// `SET STATEMENT … FOR`, MySQL 8's `SET_VAR` hint; each server ignores
/// the other's form), rounded to the nearest; MariaDB takes 0 (fail at
/// once, for the first attempt's short probe), MySQL at least 1. A plain
/// insert: a duplicate key is the driver's unique-violation error, which
/// ends the statement and the rest of the batch, not the transaction. Not
/// `ON DUPLICATE KEY UPDATE`, whose affected-row count is 1 for a no-op
/// update when the client asks for found rows, as sqlx does; not
/// `INSERT IGNORE`, which also swallows unrelated errors.
fn bounded_insert(claim: &Claim<'_>) -> String {
    let secs = claim.lock_wait.as_secs_f64().round().clamp(0.0, 3600.0) as u64;
    let mysql_secs = secs.max(1);
    format!(
        "/*M!100301 SET STATEMENT innodb_lock_wait_timeout = {secs}, {pinned} FOR */ \
         INSERT /*+ SET_VAR(innodb_lock_wait_timeout = {mysql_secs}) */ ",
        pinned = pinned_vars!(),
    )
}

/// Begins the claimed transaction in one round trip: on a Galera node,
/// first wait until the node has applied every transaction the cluster
/// committed before this one (`SYNC_READ`); then autocommit off, the
/// level for the next transaction only, `START TRANSACTION READ WRITE`,
/// `insert` (the claim's row, or nothing), the savepoint. The batch is the
/// transaction's start, so sqlx counts it (a handler's nested `begin()` is
/// a savepoint). On an error the batch stopped at its failing statement,
/// perhaps with autocommit off and a transaction open: the caller ends
/// both.
async fn begin_claimed(
    conn: PoolConnection<MySql>,
    claim: &Claim<'_>,
    insert: &str,
) -> Result<Claimed<MySql>, (sqlx::Error, PoolConnection<MySql>)> {
    let sql = format!(
        "SET autocommit = 0; SET TRANSACTION ISOLATION LEVEL {isolation}; START TRANSACTION READ WRITE; \
         {insert}{}",
        Savepoint::get().take,
        isolation = claim.isolation.as_sql(),
    );
    let sql = in_ledger(&sql, claim.database);
    let waits = claim.causal_wait && !NO_SYNC_WAIT.load(Ordering::Relaxed);
    let first = if waits {
        format!("{SYNC_READ}{sql}")
    } else {
        sql.clone()
    };
    let mut begun = Claimed::begin(conn, AssertSqlSafe(first).into_sql_str(), end_claim).await;
    if waits
        && let Err((e, _)) = &begun
        && number(e) == Some(1193)
    {
        // The batch stopped at its first statement: nothing changed yet.
        NO_SYNC_WAIT.store(true, Ordering::Relaxed);
        if let Err((_, conn)) = begun {
            begun = Claimed::begin(conn, AssertSqlSafe(sql).into_sql_str(), end_claim).await;
        }
    }
    begun
}

/// [`END_CLAIM`] on a connection whose batch failed halfway; closed when
/// that fails or its future is dropped.
async fn end_or_close(mut conn: PoolConnection<MySql>) {
    let guard = CloseOnCancel::new(&mut conn);
    if sqlx::raw_sql(END_CLAIM)
        .execute(&mut **guard.0)
        .await
        .is_ok()
    {
        guard.done();
    }
}

/// A claim that met a committed row: [`END_CLAIM`], then that row read
/// in the same round trip, by a statement of its own under autocommit (a
/// snapshot of its own, whatever the claim's isolation level), so that a
/// retry of a finished key costs the claim's batch and this one. `None`
/// (the layer reads the row itself, within its own bound) when the batch
/// fails, finds no row or takes longer than the claim's lock wait (at
/// least [`MIN_READ_WAIT`]: the read may wait behind a table's lock); the
/// connection is then closed, unless the batch ran to its end.
async fn end_and_read(conn: PoolConnection<MySql>, claim: &Claim<'_>) -> Option<Box<Record>> {
    let bound = claim.lock_wait.max(MIN_READ_WAIT);
    tokio::time::timeout(bound, end_then_read(conn, claim))
        .await
        .ok()
        .flatten()
}

/// [`end_and_read`] without its bound.
async fn end_then_read(mut conn: PoolConnection<MySql>, claim: &Claim<'_>) -> Option<Box<Record>> {
    let sql = format!(
        "{END_CLAIM}; {} WHERE {}",
        read_record!(),
        DIALECT.scope(&mut Args::new(), &claim.scope)
    );
    let sql = in_ledger(&sql, claim.database);
    let guard = CloseOnCancel::new(&mut conn);
    let rows = sqlx::raw_sql(AssertSqlSafe(sql))
        .fetch_all(&mut **guard.0)
        .await
        .ok()?;
    guard.done();
    let row = rows.first()?;
    let record = <RecordRow as sqlx::FromRow<'_, _>>::from_row(row).and_then(record_from_row);
    record.ok().map(Box::new)
}

/// Ends a claimed (or phase) transaction that is not committed: sqlx's
/// count goes back to zero (its `ROLLBACK`, which a session's
/// `completion_type = CHAIN` turns into one that opens the next
/// transaction), then [`END_CLAIM`] ends whatever is open, never chained,
/// and turns autocommit back on. (A `completion_type = RELEASE` ends the
/// connection at sqlx's `ROLLBACK`: it is then closed.)
fn end_claim(conn: &mut PoolConnection<MySql>) -> Ending<'_> {
    Box::pin(async move {
        <MySqlTransactionManager as TransactionManager>::start_rollback(&mut **conn);
        sqlx::raw_sql(END_CLAIM).execute(&mut **conn).await?;
        Ok(())
    })
}

/// A claimed (or phase) transaction that a batch committed: sqlx's count
/// goes back to zero. Its `ROLLBACK` of nothing is queued; where the
/// session's `completion_type` is not `NO_CHAIN` (`chains`) that
/// `ROLLBACK` opens a transaction (or ends the connection), so it is sent
/// now and followed by a `ROLLBACK AND NO CHAIN` (one more round trip,
/// for such sessions only), and the connection never goes back to the
/// pool inside a transaction.
async fn ended(tx: Claimed<MySql>, chains: bool) {
    if chains {
        tx.ended_by_batch_then("ROLLBACK AND NO CHAIN NO RELEASE")
            .await;
    } else {
        tx.ended_by_batch();
    }
}

/// A resource id as a character literal (hex digits), or `NULL`.
fn resource_literal(c: &Completion<'_>) -> String {
    c.resource_id.map_or_else(
        || "NULL".to_string(),
        |id| format!("CONVERT(X'{}' USING utf8mb4)", hex(id.as_bytes())),
    )
}

/// Settles a batch that records an answer, reads its expiry and commits:
/// the expiry when it ran to its end (so the `COMMIT` ran; a read that
/// cannot be decoded never becomes "nothing was recorded"); otherwise the
/// transaction is rolled back and the error says whether the `COMMIT` may
/// have run ([`maybe_committed`]).
async fn settle_recording(
    tx: Claimed<MySql>,
    ran: Result<Vec<sqlx::mysql::MySqlRow>, sqlx::Error>,
) -> Result<i64, FinishError> {
    match ran {
        Ok(rows) => match expiry(&rows) {
            Ok((expires_at, chains)) => {
                ended(tx, chains).await;
                Ok(expires_at)
            }
            Err(e) => {
                ended(tx, true).await;
                Err(committed_unread(e).into())
            }
        },
        Err(e) => {
            tx.rollback().await;
            Err(maybe_committed(e).into())
        }
    }
}

/// The expiry a committing batch read, and whether the session chains.
fn expiry(rows: &[sqlx::mysql::MySqlRow]) -> Result<(i64, bool), sqlx::Error> {
    let row = rows.first().ok_or(sqlx::Error::RowNotFound)?;
    Ok((row.try_get(0)?, row.try_get::<i64, _>(1)? != 0))
}

/// A committing batch that ran to its end (so its `COMMIT` ran) but whose
/// read could not be decoded: reported as an outcome the store cannot
/// tell (kind [`StoreErrorKind::ConnectionLost`]), so the layer re-reads
/// the ledger and never answers "nothing was recorded".
fn committed_unread(e: sqlx::Error) -> sqlx::Error {
    sqlx::Error::Protocol(format!(
        "the recording batch committed, but its read of the expiry failed: {e}"
    ))
}

/// A committing batch that failed: a server error stops the batch at its
/// statement, before the `COMMIT` (or is the `COMMIT`'s own: a deadlock
/// reported there, for a transaction the server rolled back during the
/// batch, commits nothing of it, every write being before the [`proof`]);
/// any other error (the driver could not
/// read or decode an answer) may have come after it, so the outcome is
/// one the store cannot tell (kind [`StoreErrorKind::ConnectionLost`]).
fn maybe_committed(e: sqlx::Error) -> sqlx::Error {
    if e.as_database_error().is_some() || generic_error_kind(&e).is_some() {
        e
    } else {
        sqlx::Error::Protocol(format!(
            "the recording batch failed after it was sent and may have committed: {e}"
        ))
    }
}

/// The server's error number, when the error is the server's.
fn number(err: &sqlx::Error) -> Option<u16> {
    err.as_database_error()
        .and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>())
        .map(MySqlDatabaseError::number)
}

/// Character text from hex digits.
fn text(value: &str) -> String {
    format!("CONVERT({} USING utf8mb4)", x_literal(value.as_bytes()))
}

/// Values as literals of hex digits (nothing is bound: see [`stmt`]).
pub(super) const DIALECT: Dialect = Dialect {
    key: |_, v| x_literal(v.as_bytes()),
    text: |_, v| text(v),
    blob: |_, v| x_literal(v),
    read_key: |column| format!("CONVERT({column} USING utf8mb4)"),
    now: now_ms!(),
    parks: "CAST(parks AS SIGNED)",
};

/// The longest wait of a lease statement on another writer's row lock,
/// seconds (InnoDB counts whole seconds). Phases hold the row's lock only
/// while they commit.
const LEASE_LOCK_WAIT_SECS: u64 = 5;

/// `sql` with its lock wait bounded for that statement alone.
fn with_lock_wait(secs: u64, sql: &str) -> String {
    format!(
        "/*M!100301 SET STATEMENT innodb_lock_wait_timeout = {secs}, {} FOR */ {sql}",
        pinned_vars!()
    )
}

/// A lease or operator statement: its values are literals (`DIALECT`
/// binds none), sent as written.
pub(super) fn stmt(pool: &Pool<MySql>, sql: String, args: Args, _cached: bool) -> sqlx::RawSql {
    debug_assert!(args.is_empty(), "MySQL's dialect binds nothing");
    let sql = in_ledger(&sql, MySql::database(pool).as_deref());
    sqlx::raw_sql(AssertSqlSafe(format!("{}{sql}", pinned!())))
}

/// Runs one literal statement on the pool; the rows it found.
async fn execute(pool: &Pool<MySql>, sql: String) -> Result<u64, sqlx::Error> {
    let sql = in_ledger(&sql, MySql::database(pool).as_deref());
    Ok(sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(pool)
        .await?
        .rows_affected())
}
