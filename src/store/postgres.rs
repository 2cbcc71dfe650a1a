//! PostgreSQL: the production store.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, Postgres};
use sqlx::{AssertSqlSafe, FromRow, Pool, Row, SqlSafeStr};

use super::claimed::rollback;
use super::lease::{Arg, Args, Dialect, numbered};
use super::{
    AtCommitOutcome, Backend, Claim, ClaimOutcome, Claimed, Completion, Fence, FinishError,
    IsolationLevel, LeaseWrite, Migration, Record, RecordStatus, Savepoint, Scope, StoreErrorKind,
    generic_error_kind, migrations, record_from_row, run_migrations, shared_statements,
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
    8 => "0008_scope_lock_wait",
);

/// The schema of the ledger table the session finds (never a temporary
/// one), quoted; `NULL` where it finds none.
const FIND_LEDGER: &str = "SELECT (SELECT quote_ident(s.nspname) FROM pg_catalog.pg_class c \
     JOIN pg_catalog.pg_namespace s ON s.oid = c.relnamespace \
     WHERE c.relname = 'idempotency_records' AND c.relkind IN ('r', 'p') \
     AND s.nspname = ANY (pg_catalog.current_schemas(false)) \
     ORDER BY pg_catalog.array_position(pg_catalog.current_schemas(false), s.nspname) LIMIT 1)";

/// The claim's read, prepared (round trip 2), of the ledger table of
/// `schema` (the one the pool's sessions find, [`Backend::find_ledger`]:
/// never a temporary one, whatever the session's `search_path`): the
/// transaction's id when round trip 1 took the scope's lock (`NULL`:
/// another transaction holds it), and the scope's committed row, as
/// `fetch` reads it. The claim-at-commit mode reads it when its row was
/// not written ([`write_at_commit`]).
fn claim_read_sql(schema: Option<&str>) -> String {
    format!(
        "SELECT txid_current_if_assigned(), r.status, r.request_fingerprint, r.response_status, \
         r.response_headers, r.response_body, r.resource_id, r.expires_at, \
         CASE WHEN r.expires_at <= n.now THEN 1::INT8 ELSE 0::INT8 END, r.generation, \
         CASE WHEN r.locked_until > n.now THEN 1::INT8 ELSE 0::INT8 END, \
         r.recovery_point, r.recovery_data, r.pending_step, r.claim_id, r.parks::INT8 \
         FROM (SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT AS now) n \
         LEFT JOIN {table} r \
         ON r.principal_id = convert_from($1, 'UTF8') COLLATE \"default\" \
         AND r.operation = convert_from($2, 'UTF8') COLLATE \"default\" \
         AND r.idem_key = convert_from($3, 'UTF8') COLLATE \"default\"",
        table = ledger_table(schema),
    )
}

/// Waits for the scope's lock within a bound (ledger v8's function).
const WAIT: &str = "SELECT tower_idempotency_wait($1, $2, $3)";

/// The ledger table of `schema` (quoted, as [`Backend::find_ledger`]
/// found it), or the one the session finds where none was found.
fn ledger_table(schema: Option<&str>) -> String {
    match schema {
        Some(schema) => format!("{schema}.idempotency_records"),
        None => "idempotency_records".to_owned(),
    }
}

/// The one ledger row, written just before the COMMIT into the ledger
/// table of `schema` (as the claim read it), only on the transaction the
/// claim began (`$11`, its id).
fn record(schema: Option<&str>) -> String {
    let table = ledger_table(schema);
    format!(
        "INSERT INTO {table} (principal_id, operation, idem_key, request_fingerprint, \
         status, response_status, response_headers, response_body, resource_id, created_at, \
         expires_at) SELECT convert_from($1, 'UTF8'), convert_from($2, 'UTF8'), \
         convert_from($3, 'UTF8'), $4, $5, $6, $7, $8, convert_from($9, 'UTF8'), {now}, {now} + $10 \
         WHERE txid_current() = $11 RETURNING expires_at",
        now = now_ms!(),
    )
}

/// The one ledger row of the claim-at-commit mode, prepared, written
/// just before the `COMMIT` into the ledger table of `schema` (the one the
/// pool's sessions find, [`Backend::find_ledger`]; a handler's
/// `search_path` never moves it): quietly
/// (`ON CONFLICT DO NOTHING`: a row of another request makes it write
/// nothing, with no error in the server's log), only inside a transaction
/// that has an id (the handler's first write gave the claimed one its
/// id, and [`give_id`] gives one to a transaction the handler wrote
/// nothing in; a statement of its own after a handler's `COMMIT` or
/// `ROLLBACK` has none when it starts), and with the wait on another
/// request's uncommitted row bounded by `lock_timeout` (`$11`, in
/// milliseconds), set for the rest of this transaction alone. Returns the
/// expiry and the transaction's id (what a lost `COMMIT` is asked about)
/// when it wrote the row, and no row when it did not: [`claim_read_sql`]
/// then says why, in a round trip of its own (a first execution pays for
/// neither the read nor its columns).
fn record_at_commit(schema: Option<&str>) -> String {
    format!(
        "INSERT INTO {table} (principal_id, operation, idem_key, request_fingerprint, status, \
         response_status, response_headers, response_body, resource_id, created_at, \
         expires_at) SELECT convert_from($1, 'UTF8'), convert_from($2, 'UTF8'), \
         convert_from($3, 'UTF8'), $4, $5, $6, $7, $8, convert_from($9, 'UTF8'), {now}, \
         {now} + $10 WHERE txid_current_if_assigned() IS NOT NULL \
         AND (SELECT set_config('lock_timeout', $11::INT4::TEXT, true)) IS NOT NULL \
         ON CONFLICT (principal_id, operation, idem_key) DO NOTHING \
         RETURNING expires_at, txid_current()",
        table = ledger_table(schema),
        now = now_ms!(),
    )
}

/// Every isolation level, in the order of [`begin_at_commit_sql`]'s texts.
const LEVELS: [IsolationLevel; 3] = [
    IsolationLevel::ReadCommitted,
    IsolationLevel::RepeatableRead,
    IsolationLevel::Serializable,
];

/// Claim at commit's `BEGIN` batch at `isolation`: the level and this
/// process's savepoint, formatted once per level.
fn begin_at_commit_sql(isolation: IsolationLevel) -> Arc<str> {
    static BEGINS: std::sync::OnceLock<[Arc<str>; 3]> = std::sync::OnceLock::new();
    let begins = BEGINS.get_or_init(|| {
        LEVELS.map(|level| {
            let take = &Savepoint::get().take;
            format!("BEGIN ISOLATION LEVEL {}; {take}", level.as_sql()).into()
        })
    });
    // Exhaustive, where a search of `LEVELS` would need a fallback for a
    // level it does not hold.
    let i = match isolation {
        IsolationLevel::ReadCommitted => 0,
        IsolationLevel::RepeatableRead => 1,
        IsolationLevel::Serializable => 2,
    };
    Arc::clone(&begins[i])
}

/// The per-request statements of the ledger table of one schema
/// ([`claim_read_sql`], [`record`], [`record_at_commit`]), formatted once
/// per thread and schema: a request's statements are shared, not formatted
/// and copied anew for every request.
struct LedgerSql {
    schema: Option<Box<str>>,
    claim_read: Arc<str>,
    record: Arc<str>,
    record_at_commit: Arc<str>,
}

/// How many schemas' statements a thread keeps (the oldest goes first;
/// a thread that takes turns among more schemas formats on every request,
/// as before the cache): a process has one ledger, or a few.
const LEDGER_SQL_KEPT: usize = 8;

/// The statements of the ledger table of `schema`.
fn ledger_sql(schema: Option<&str>) -> Arc<LedgerSql> {
    thread_local! {
        static KEPT: std::cell::RefCell<Vec<Arc<LedgerSql>>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    let format = || {
        Arc::new(LedgerSql {
            schema: schema.map(Into::into),
            claim_read: claim_read_sql(schema).into(),
            record: record(schema).into(),
            record_at_commit: record_at_commit(schema).into(),
        })
    };
    // A thread whose locals are being torn down formats without keeping.
    KEPT.try_with(|kept| {
        let mut kept = kept.borrow_mut();
        if let Some(sql) = kept.iter().find(|sql| sql.schema.as_deref() == schema) {
            return Arc::clone(sql);
        }
        let sql = format();
        if kept.len() >= LEDGER_SQL_KEPT {
            kept.remove(0);
        }
        kept.push(Arc::clone(&sql));
        sql
    })
    .unwrap_or_else(|_| format())
}

#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
impl Backend for Postgres {
    const UNNAMED_IN_TRANSACTIONS: bool = true;

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
        conn: PoolConnection<Self>,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome<Self>, sqlx::Error> {
        // Round trip 1, the transaction's start (sqlx counts it: a
        // handler's nested `begin()` is a savepoint): take the scope's
        // transaction advisory lock if it is free, and only then give the
        // transaction its id, so that the id says whether the lock is
        // ours; take the savepoint final business errors roll back to. The
        // statement holds nothing from the request: the isolation level's
        // name and the lock's two keys, integers made from the scope's
        // SHA-256 (64 bits, so no principal can make another one's claims
        // wait).
        let (k1, k2) = scope_lock(&claim.scope);
        let mut begin = begin_locked(claim.isolation, k1, k2);
        begin.push_str("; ");
        begin.push_str(&Savepoint::get().take);
        let begin = AssertSqlSafe(begin).into_sql_str();
        let mut tx = match Claimed::begin(conn, begin, rollback).await {
            Ok(tx) => tx,
            Err((e, mut conn)) => {
                // The batch may have left the server inside its `BEGIN`.
                conn.close_on_drop();
                return Err(e);
            }
        };
        // Round trip 2, prepared: the transaction's id (set only when the
        // lock was taken in round trip 1) and the scope's committed row.
        // Lost to a committed row: that row. Not ours and no row: wait for
        // the lock within the claim's bound, then read again.
        //
        // At READ COMMITTED each read has a snapshot of its own, taken
        // after the lock was: it sees every commit of the scope's earlier
        // holder. Above it, the snapshot is the transaction's, taken when
        // round trip 1's statement started, before its lock was tried (or
        // before a wait): an earlier holder that committed in between holds
        // a row this snapshot cannot see. Such a claim moves the lock into
        // a new transaction whose snapshot is taken after it (`relock`, one
        // round trip) and reads again.
        let relock = || {
            AssertSqlSafe(format!(
                "SELECT pg_advisory_lock({k1}, {k2}); COMMIT; {begin}; \
                 SELECT pg_advisory_unlock({k1}, {k2}); {}",
                Savepoint::get().take,
                begin = begin_locked(claim.isolation, k1, k2),
            ))
            .into_sql_str()
        };
        let mut fresh = claim.isolation == IsolationLevel::ReadCommitted;
        let mut waited = false;
        let outcome = loop {
            let read = claim_read(&mut tx, claim).await;
            let (xid, record) = match read {
                Ok(read) => read,
                Err(e) => {
                    tx.discard();
                    return Err(e);
                }
            };
            let moved = match (xid, record) {
                (_, Some(record)) => break ClaimOutcome::Lost(Some(Box::new(record))),
                (Some(xid), None) if fresh => {
                    tx.xid = Some(xid);
                    return Ok(ClaimOutcome::Won(tx));
                }
                // Ours, on a snapshot that may precede the last holder's
                // commit.
                (Some(_), None) => tx.begin_again(relock()).await,
                (None, None) if waited => break ClaimOutcome::InFlight,
                (None, None) => {
                    waited = true;
                    let ms = wait_ms(claim.lock_wait);
                    let got: Result<bool, _> = sqlx::query_scalar(WAIT)
                        .persistent(claim.cached_statements)
                        .bind(k1)
                        .bind(k2)
                        .bind(ms)
                        .fetch_one(&mut *tx)
                        .await;
                    match got {
                        Ok(true) => {}
                        Ok(false) => break ClaimOutcome::InFlight,
                        Err(e) => {
                            tx.discard();
                            return Err(e);
                        }
                    }
                    // The lock was taken inside the claim's savepoint: a
                    // rollback to it (a final business error) would let
                    // the next waiter in before the answer is recorded.
                    // Release the savepoint (the lock moves to the
                    // transaction) and take it again; above READ
                    // COMMITTED, move it to a new transaction.
                    if fresh {
                        sqlx::raw_sql(Savepoint::get().retake.as_str())
                            .execute(&mut *tx)
                            .await
                            .map(drop)
                    } else {
                        tx.begin_again(relock()).await
                    }
                }
            };
            if let Err(e) = moved {
                tx.discard();
                return Err(e);
            }
            // A transaction begun after the lock was ours.
            fresh = true;
        };
        // Nothing was written: ending with COMMIT keeps the server's
        // rollback count for real failures.
        tx.commit().await?;
        Ok(outcome)
    }

    async fn finish(
        pool: &Pool<Self>,
        mut tx: Claimed<Self>,
        claim: &Claim<'_>,
        c: &Completion<'_>,
    ) -> Result<i64, FinishError> {
        // One ledger row, written once, just before the COMMIT: a prepared
        // insert whose `WHERE` proves the transaction is still the one the
        // claim began (a handler that ended it itself and went on in
        // another writes no ledger row), then sqlx's COMMIT. A final
        // business error first undoes the business writes.
        let Some(xid) = tx.xid else {
            tx.discard();
            return Err(
                sqlx::Error::Protocol("a claimed transaction without its id".into()).into(),
            );
        };
        if c.status == RecordStatus::FailedFinal
            && let Err(e) = Self::check_savepoint(&mut tx).await
        {
            tx.discard();
            return Err(e.into());
        }
        let sql = AssertSqlSafe(Arc::clone(&ledger_sql(claim.database).record));
        let inserted: Result<Option<i64>, _> = ledger_row(sql, claim, c)
            .bind(xid)
            .fetch_optional(&mut *tx)
            .await
            .and_then(|row| row.map(|row| row.try_get(0)).transpose());
        let expires_at = match inserted {
            Ok(Some(expires_at)) => expires_at,
            Ok(None) => {
                // Not the claimed transaction any more: the savepoint says
                // how (an error of kind `TransactionEnded`).
                let e = match Self::check_savepoint(&mut tx).await {
                    Err(e) => e,
                    Ok(()) => sqlx::Error::Protocol(
                        "the claimed transaction was replaced by another one".into(),
                    ),
                };
                tx.discard();
                return Err(FinishError::Ended(e));
            }
            Err(e) => {
                // A server's refusal (a row written without the scope's
                // lock, a serialization failure) leaves the connection
                // sound: rolled back, not closed.
                if e.as_database_error().is_some() {
                    tx.rollback().await;
                } else {
                    tx.discard();
                }
                return Err(e.into());
            }
        };
        match tx.commit().await {
            Ok(()) => Ok(expires_at),
            Err(e) => {
                let lost = Committing {
                    xid,
                    expires_at,
                    scope: &claim.scope,
                    schema: claim.database,
                    mark: Mark::Answer(c),
                };
                lost_commit(pool, &lost, e).await
            }
        }
    }

    async fn find_ledger(
        conn: &mut sqlx::PgConnection,
    ) -> Result<Option<std::sync::Arc<str>>, sqlx::Error> {
        // The simple protocol, one message: outside a transaction, an
        // unnamed statement's Parse and Bind may reach two server
        // connections behind a transaction-mode pooler (PgBouncer).
        let row = sqlx::raw_sql(FIND_LEDGER).fetch_one(conn).await?;
        let found: Option<String> = row.try_get(0)?;
        Ok(found.map(Into::into))
    }

    async fn begin_at_commit(
        conn: PoolConnection<Self>,
        claim: &Claim<'_>,
    ) -> Result<Claimed<Self>, sqlx::Error> {
        // One round trip, the transaction's start (sqlx counts it): the
        // level and the savepoint. The transaction gets its id from the
        // handler's first write, or from `give_id` when it wrote nothing.
        let begin = AssertSqlSafe(begin_at_commit_sql(claim.isolation)).into_sql_str();
        match Claimed::begin(conn, begin, rollback).await {
            Ok(tx) => Ok(tx),
            Err((e, mut conn)) => {
                // The batch may have left the server inside its `BEGIN`.
                conn.close_on_drop();
                Err(e)
            }
        }
    }

    async fn finish_at_commit(
        pool: &Pool<Self>,
        mut tx: Claimed<Self>,
        claim: &Claim<'_>,
        c: &Completion<'_>,
    ) -> Result<AtCommitOutcome, FinishError> {
        if c.status == RecordStatus::FailedFinal
            && let Err(e) = Self::check_savepoint(&mut tx).await
        {
            tx.discard();
            return Err(ended_or_store(e));
        }
        let wait = wait_ms(claim.lock_wait);
        let mut written = write_at_commit(&mut tx, claim, c, wait).await;
        if matches!(written, Ok(Written::NoId)) {
            // No id: the handler wrote nothing, or ended the transaction.
            // Only the savepoint, still there, says the transaction is
            // ours; then it gets an id, and the row is written again.
            if let Err(e) = sqlx::raw_sql(AssertSqlSafe(give_id()))
                .execute(&mut *tx)
                .await
            {
                tx.discard();
                return Err(ended_or_store(e));
            }
            written = write_at_commit(&mut tx, claim, c, wait).await;
        }
        let (expires_at, xid) = match written {
            Ok(Written::Row(expires_at, xid)) => (expires_at, xid),
            Ok(Written::Lost(record)) => {
                // A committed row of another request: nothing of this
                // transaction may commit.
                tx.rollback().await;
                return Ok(AtCommitOutcome::Lost(Some(record)));
            }
            Ok(Written::Nothing | Written::NoId) => {
                // Nothing written and no row seen: a row of another request
                // committed while this one waited for it, or the handler
                // ended the transaction (the savepoint says which).
                return match Self::check_savepoint(&mut tx).await {
                    Ok(()) => {
                        tx.rollback().await;
                        Ok(AtCommitOutcome::Lost(None))
                    }
                    Err(e) => {
                        tx.discard();
                        Err(ended_or_store(e))
                    }
                };
            }
            Err(e) => {
                // A server's refusal (the lock wait's bound, a
                // serialization failure) leaves the connection sound.
                if e.as_database_error().is_some() {
                    tx.rollback().await;
                } else {
                    tx.discard();
                }
                return Err(e.into());
            }
        };
        match tx.commit().await {
            Ok(()) => Ok(AtCommitOutcome::Committed(expires_at)),
            Err(e) => {
                let lost = Committing {
                    xid,
                    expires_at,
                    scope: &claim.scope,
                    schema: claim.database,
                    mark: Mark::Answer(c),
                };
                lost_commit(pool, &lost, e)
                    .await
                    .map(AtCommitOutcome::Committed)
            }
        }
    }

    async fn check_savepoint(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(Savepoint::get().undo.as_str())
            .execute(conn)
            .await
            .map(drop)
    }

    shared_statements!(
        Postgres,
        scope = utf8,
        fetch = concat!(
            "SELECT status, request_fingerprint, response_status, response_headers, \
             response_body, resource_id, expires_at, \
             CASE WHEN expires_at <= ",
            now_ms!(),
            " THEN 1::INT8 ELSE 0::INT8 END, generation, \
             CASE WHEN locked_until > ",
            now_ms!(),
            " THEN 1::INT8 ELSE 0::INT8 END, \
             recovery_point, recovery_data, pending_step, claim_id, parks::INT8 \
             FROM idempotency_records \
             WHERE principal_id = convert_from($1, 'UTF8') COLLATE \"default\" AND operation = convert_from($2, 'UTF8') COLLATE \"default\" \
             AND idem_key = convert_from($3, 'UTF8') COLLATE \"default\""
        ),
        mark = concat!(
            "INSERT INTO idempotency_records (principal_id, operation, idem_key, \
             request_fingerprint, status, response_status, parks, created_at, expires_at) \
             VALUES (convert_from($1, 'UTF8'), convert_from($2, 'UTF8'), convert_from($3, 'UTF8'), \
             $4, 'NEEDS_RECONCILIATION', $5, 1, ",
            now_ms!(),
            ", ",
            now_ms!(),
            " + $6) \
             ON CONFLICT (principal_id, operation, idem_key) DO UPDATE \
             SET status = 'NEEDS_RECONCILIATION', response_status = EXCLUDED.response_status, \
             parks = idempotency_records.parks + 1 \
             WHERE idempotency_records.status = 'PROCESSING'"
        ),
        expire = concat!(
            "UPDATE idempotency_records SET status = 'EXPIRED', response_headers = NULL, \
             response_body = NULL, expires_at = expires_at + $1 \
             WHERE (principal_id, operation, idem_key) IN \
             (SELECT principal_id, operation, idem_key FROM idempotency_records \
             WHERE status IN ('SUCCEEDED', 'FAILED_FINAL') AND expires_at <= COALESCE($2, ",
            now_ms!(),
            ") LIMIT $3 FOR UPDATE SKIP LOCKED)"
        ),
        purge = concat!(
            "DELETE FROM idempotency_records WHERE (principal_id, operation, idem_key) IN \
             (SELECT principal_id, operation, idem_key FROM idempotency_records \
             WHERE status = 'EXPIRED' AND expires_at <= COALESCE($1, ",
            now_ms!(),
            ") LIMIT $2 FOR UPDATE SKIP LOCKED)"
        ),
    );

    async fn lease_claim(
        pool: &Pool<Self>,
        claim: &Claim<'_>,
        lease_ms: i64,
        claim_id: &str,
    ) -> Result<bool, sqlx::Error> {
        let mut a = Vec::new();
        let sql = DIALECT.claim(
            &mut a,
            claim,
            lease_ms,
            claim_id,
            Some(&lock_wait(wait_ms(claim.lock_wait))),
            "ON CONFLICT (principal_id, operation, idem_key) DO NOTHING",
        );
        Ok(execute(pool, sql, a).await? == 1)
    }

    async fn take_over(
        pool: &Pool<Self>,
        scope: &Scope<'_>,
        seen: Fence<'_>,
        lease_ms: i64,
        parked: bool,
    ) -> Result<bool, sqlx::Error> {
        let mut a = Vec::new();
        let sql = DIALECT.take_over(&mut a, scope, seen, lease_ms, parked);
        let sql = format!("{sql} AND {}", lock_wait(LEASE_LOCK_WAIT_MS));
        Ok(execute(pool, sql, a).await? == 1)
    }

    async fn lease_write(
        pool: &Pool<Self>,
        scope: &Scope<'_>,
        fence: Fence<'_>,
        write: &LeaseWrite<'_>,
    ) -> Result<bool, sqlx::Error> {
        let mut a = Vec::new();
        let sql = DIALECT.write(&mut a, scope, fence, write);
        let sql = format!("{sql} AND {}", lock_wait(LEASE_LOCK_WAIT_MS));
        Ok(execute(pool, sql, a).await? == 1)
    }

    async fn begin_phase(
        pool: &Pool<Self>,
        isolation: IsolationLevel,
    ) -> Result<Claimed<Self>, sqlx::Error> {
        let begin = format!("BEGIN ISOLATION LEVEL {}", isolation.as_sql());
        let conn = super::acquire(pool).await?;
        Claimed::begin(conn, AssertSqlSafe(begin).into_sql_str(), rollback)
            .await
            .map_err(|(e, mut conn)| {
                conn.close_on_drop();
                e
            })
    }

    async fn commit_fenced(
        pool: &Pool<Self>,
        mut tx: Claimed<Self>,
        scope: &Scope<'_>,
        fence: Fence<'_>,
        write: &LeaseWrite<'_>,
    ) -> Result<Option<i64>, FinishError> {
        // The fenced write and the transaction's id; the COMMIT only when
        // the fence matched (a stale writer's phase rolls back).
        let mut a = Vec::new();
        let sql = format!(
            "WITH done AS ({} RETURNING expires_at) \
             SELECT max(expires_at), txid_current() FROM done",
            DIALECT.write(&mut a, scope, fence, write)
        );
        let written = stmt(pool, sql, a, super::caches_statements(pool))
            .fetch_one(&mut *tx)
            .await;
        let (expires_at, xid) = match written.and_then(|row| <(Option<i64>, i64)>::from_row(&row)) {
            Ok((Some(expires_at), xid)) => (expires_at, xid),
            Ok((None, _)) => {
                tx.rollback().await;
                return Ok(None);
            }
            Err(e) => {
                // A server's refusal (a row written without the scope's
                // lock, a serialization failure) leaves the connection
                // sound: rolled back, not closed.
                if e.as_database_error().is_some() {
                    tx.rollback().await;
                } else {
                    tx.discard();
                }
                return Err(e.into());
            }
        };
        match tx.commit().await {
            Ok(()) => Ok(Some(expires_at)),
            Err(e) => {
                let lost = Committing {
                    xid,
                    expires_at,
                    scope,
                    schema: None,
                    mark: Mark::Writer,
                };
                lost_commit(pool, &lost, e).await.map(Some)
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
        let Some(code) = err.as_database_error().and_then(|e| e.code()) else {
            return StoreErrorKind::Other;
        };
        match &*code {
            // lock_not_available: our lock_timeout fired; query_canceled:
            // the application's own statement_timeout fired first.
            "55P03" | "57014" => StoreErrorKind::LockTimeout,
            // serialization_failure, deadlock_detected; unique_violation
            // (the one ledger row meets a row written without the scope's
            // lock: nothing of this transaction commits)
            "40001" | "40P01" | "23505" => StoreErrorKind::Conflict,
            // invalid_savepoint_specification, no_active_sql_transaction
            "3B001" | "25P01" => StoreErrorKind::TransactionEnded,
            // too_many_connections; read_only_sql_transaction (a standby,
            // or a leader being demoted, refuses writes for now)
            "53300" | "25006" => StoreErrorKind::Busy,
            // connection_exception (08…), operator intervention (57P…: terminated, shutdown).
            c if c.starts_with("08") || c.starts_with("57P") => StoreErrorKind::ConnectionLost,
            _ => StoreErrorKind::Other,
        }
    }
}

/// A `COMMIT` whose answer may be lost: the transaction `xid` wrote the
/// row of `scope` (in the ledger table of `schema`, as [`record`] names
/// it), which then expires at `expires_at` and is told by `mark`.
struct Committing<'a> {
    xid: i64,
    expires_at: i64,
    scope: &'a Scope<'a>,
    schema: Option<&'a str>,
    mark: Mark<'a>,
}

/// How the row a lost `COMMIT` wrote is told from another's.
enum Mark<'a> {
    /// It records this answer: whoever wrote it, replaying it is giving
    /// this answer. (The claim's row is written inside the claim's
    /// savepoint, so its `xmin` is a subtransaction's id, not `xid`.)
    Answer(&'a Completion<'a>),
    /// The transaction `xid` wrote it last, outside any savepoint (a lease
    /// phase's fenced write): its `xmin` is `xid`'s low 32 bits.
    Writer,
}

/// The `COMMIT` of `c` failed with `e`. A lost connection is explained by
/// the server: it is asked what became of the transaction. Its
/// "committed" is trusted only when the row that transaction wrote is on
/// the server asked: after a failover the write port reaches a new leader
/// that may never have received the transaction and has since given its
/// id to a transaction of its own (`tests/patroni_failover.rs`).
async fn lost_commit(
    pool: &Pool<Postgres>,
    c: &Committing<'_>,
    e: sqlx::Error,
) -> Result<i64, FinishError> {
    if Postgres::error_kind(&e) != StoreErrorKind::ConnectionLost {
        return Err(FinishError::Store(e));
    }
    let status = lost_commit_status(pool, c.xid).await;
    tracing::warn!(
        xid = c.xid,
        xact_status = status.as_str(),
        "the connection was lost during COMMIT; the server's transaction status decides"
    );
    match status {
        XactStatus::Committed if written_here(pool, c).await => Ok(c.expires_at),
        XactStatus::Committed => {
            tracing::warn!(
                xid = c.xid,
                "the server reports the transaction committed, but not the row it wrote: \
                 another server's transaction of the same id (a failover); the ledger decides"
            );
            Err(FinishError::Store(e))
        }
        XactStatus::Aborted => Err(FinishError::Aborted(e)),
        XactStatus::InProgress => Err(FinishError::InProgress(e)),
        // Too old to be known, or no answer: the layer reads the ledger.
        XactStatus::Unknown => Err(FinishError::Store(e)),
    }
}

/// Whether the scope's row on the server `pool` reaches is the one `c`
/// wrote: its expiry, and its [`Mark`]. No such row, or no answer within
/// [`LOST_COMMIT_WAIT`], is a "no", never a wrong "yes": the layer then
/// reads the ledger, which answers the replay or a retryable `503`.
async fn written_here(pool: &Pool<Postgres>, c: &Committing<'_>) -> bool {
    let mark = match c.mark {
        Mark::Answer(_) => {
            "status = $5 AND response_status = $6 AND response_headers = $7 \
             AND response_body IS NOT DISTINCT FROM $8"
        }
        Mark::Writer => "xmin::text = $5",
    };
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM {table} WHERE principal_id = convert_from($1, 'UTF8') \
         COLLATE \"default\" AND operation = convert_from($2, 'UTF8') COLLATE \"default\" \
         AND idem_key = convert_from($3, 'UTF8') COLLATE \"default\" \
         AND expires_at = $4 AND {mark})",
        table = ledger_table(c.schema),
    );
    let query = sqlx::query_scalar::<_, bool>(AssertSqlSafe(sql))
        .persistent(false)
        .bind(utf8(c.scope.principal))
        .bind(utf8(c.scope.operation))
        .bind(utf8(c.scope.key))
        .bind(c.expires_at);
    let query = match c.mark {
        Mark::Answer(a) => query
            .bind(a.status.as_str())
            .bind(a.response_status)
            .bind(a.response_headers)
            .bind(a.response_body),
        Mark::Writer => query.bind((c.xid & 0xFFFF_FFFF).to_string()),
    };
    matches!(
        tokio::time::timeout(LOST_COMMIT_WAIT, query.fetch_one(pool)).await,
        Ok(Ok(true))
    )
}

/// What the row written at commit found.
enum Written {
    /// Written: its expiry and the transaction's id.
    Row(i64, i64),
    /// Not written: another request's row, committed before the read.
    Lost(Box<Record>),
    /// Not written, and no row seen.
    Nothing,
    /// Not written, no row seen, and the transaction has no id: the
    /// handler wrote nothing in it, or ended it.
    NoId,
}

/// Writes the claim-at-commit mode's row ([`record_at_commit`]) on the
/// claimed transaction, its wait on another request's row bounded by
/// `wait_ms`; when nothing was written, the claim's read says why: the
/// scope's row as a statement of this transaction sees it, and whether
/// the transaction has an id.
async fn write_at_commit(
    tx: &mut Claimed<Postgres>,
    claim: &Claim<'_>,
    c: &Completion<'_>,
    wait_ms: i32,
) -> Result<Written, sqlx::Error> {
    let sql = AssertSqlSafe(Arc::clone(&ledger_sql(claim.database).record_at_commit));
    let written = ledger_row(sql, claim, c)
        .bind(wait_ms)
        .fetch_optional(&mut **tx)
        .await?;
    if let Some(row) = written {
        return Ok(Written::Row(row.try_get(0)?, row.try_get(1)?));
    }
    Ok(match claim_read(tx, claim).await? {
        (_, Some(record)) => Written::Lost(Box::new(record)),
        (Some(_), None) => Written::Nothing,
        (None, None) => Written::NoId,
    })
}

/// The ledger row's values, `$1` to `$10` of [`record`] and
/// [`record_at_commit`], bound to `sql` prepared as the claim says.
fn ledger_row<'q>(
    sql: impl SqlSafeStr,
    claim: &Claim<'q>,
    c: &Completion<'q>,
) -> sqlx::query::Query<'q, Postgres, PgArguments> {
    // Sized once for every value (and the one the caller binds after
    // them): binding into the default buffer grew it several times.
    let mut arguments = PgArguments::default();
    let scope = &claim.scope;
    let text = scope.principal.len()
        + scope.operation.len()
        + scope.key.len()
        + claim.fingerprint.len()
        + c.response_headers.len()
        + c.response_body.len()
        + c.resource_id.map_or(0, str::len);
    sqlx::Arguments::reserve(&mut arguments, 11, text + 11 * 4 + 64);
    sqlx::query_with(sql, arguments)
        .persistent(claim.cached_statements)
        .bind(utf8(claim.scope.principal))
        .bind(utf8(claim.scope.operation))
        .bind(utf8(claim.scope.key))
        .bind(claim.fingerprint)
        .bind(c.status.as_str())
        .bind(c.response_status)
        .bind(c.response_headers)
        .bind(c.response_body)
        .bind(c.resource_id.map(str::as_bytes))
        .bind(claim.retention_ms)
}

/// Proves the claimed transaction is still this request's (its savepoint
/// is released and taken again: that fails, `TransactionEnded`, once the
/// handler or the server ended it) and gives it an id, for the row written
/// at commit when the handler wrote nothing.
fn give_id() -> String {
    format!("{}; SELECT txid_current()", Savepoint::get().retake)
}

/// A failed check of the claimed transaction's savepoint: the handler
/// ended it ([`FinishError::Ended`]), or the store failed.
fn ended_or_store(e: sqlx::Error) -> FinishError {
    if Postgres::error_kind(&e) == StoreErrorKind::TransactionEnded {
        FinishError::Ended(e)
    } else {
        FinishError::Store(e)
    }
}

/// A text value bound as its UTF-8 bytes, which the statement decodes
/// (`convert_from($n, 'UTF8')`): the session's `client_encoding` (an
/// application may set one sqlx cannot speak, such as `SJIS`) never
/// converts, or refuses, a scope on its way to the ledger. Compared with a
/// scope column, the decoded value is given the database's default
/// collation (`COLLATE "default"`, the columns' own): `convert_from` takes
/// the collation of its `name` argument (`C`), with which the ledger's
/// unique index cannot serve the comparison and every lookup would read
/// the whole ledger (`tests/pg_scope_index.rs`).
fn utf8(text: &str) -> &[u8] {
    text.as_bytes()
}

/// The two keys of a scope's transaction advisory lock: 64 bits of the
/// SHA-256 of its three parts, each prefixed with its length (so no two
/// scopes share an input). No principal can choose a scope whose lock
/// meets a given scope of another's (a second preimage of 64 bits).
pub(crate) fn scope_lock(scope: &Scope<'_>) -> (i32, i32) {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    for part in [scope.principal, scope.operation, scope.key] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    let d = hash.finalize();
    let word = |i: usize| i32::from_be_bytes([d[i], d[i + 1], d[i + 2], d[i + 3]]);
    (word(0), word(4))
}

/// Begins a transaction at `isolation` that takes the scope's lock
/// `(k1, k2)` if it is free (or already this session's), and only then gets
/// its id: the id says whether the lock is the transaction's.
fn begin_locked(isolation: IsolationLevel, k1: i32, k2: i32) -> String {
    use std::fmt::Write;
    // Room for the savepoint the claim appends: one allocation.
    let mut sql = String::with_capacity(192);
    let _ = write!(
        sql,
        "BEGIN ISOLATION LEVEL {}; \
         SELECT txid_current() WHERE pg_try_advisory_xact_lock({k1}, {k2})",
        isolation.as_sql()
    );
    sql
}

/// The claim's read on the claimed transaction: its id (if round trip 1
/// took the scope's lock; in the claim-at-commit mode, if the transaction
/// wrote anything) and the scope's committed row.
async fn claim_read(
    tx: &mut Claimed<Postgres>,
    claim: &Claim<'_>,
) -> Result<(Option<i64>, Option<Record>), sqlx::Error> {
    let row = sqlx::query(AssertSqlSafe(Arc::clone(
        &ledger_sql(claim.database).claim_read,
    )))
    .persistent(claim.cached_statements)
    .bind(utf8(claim.scope.principal))
    .bind(utf8(claim.scope.operation))
    .bind(utf8(claim.scope.key))
    .fetch_one(&mut **tx)
    .await?;
    let xid = row.try_get::<Option<i64>, _>(0)?;
    if row.try_get::<Option<String>, _>(1)?.is_none() {
        return Ok((xid, None));
    }
    let record = record_at(&row, 1)?;
    Ok((xid, Some(record)))
}

/// How lease and operator statements take their values (bound
/// parameters) and read the clock. Lease times are read from the wall
/// clock at the statement (`clock_timestamp()`), not at the transaction's
/// start: a phase that commits after a long transaction gets a full lease
/// from its commit.
pub(super) const DIALECT: Dialect = Dialect {
    key: |a, v| {
        format!(
            "convert_from({}, 'UTF8') COLLATE \"default\"",
            numbered(a, Arg::Bytes(v.into()))
        )
    },
    text: |a, v| {
        format!(
            "convert_from({}, 'UTF8') COLLATE \"default\"",
            numbered(a, Arg::Bytes(v.into()))
        )
    },
    blob: |a, v| numbered(a, Arg::Bytes(v.to_vec())),
    read_key: |column| column.to_string(),
    now: "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT",
    parks: "parks::INT8",
};

/// A lease or operator statement with its values bound, its results read
/// in binary; named and kept in the pool's statement cache as `cached`
/// says (`caches_statements`: off for PgBouncer before 1.21, where it runs
/// unnamed, in a transaction of its own when outside one: see
/// `on_ledger!`). Nothing of a request is ever part of its text.
pub(super) fn stmt(
    _pool: &Pool<Postgres>,
    sql: String,
    args: Args,
    cached: bool,
) -> sqlx::query::Query<'static, Postgres, PgArguments> {
    args.into_iter().fold(
        sqlx::query(AssertSqlSafe(sql)).persistent(cached),
        |q, Arg::Bytes(v)| q.bind(v),
    )
}

/// Runs one lease statement on the pool (where the pool keeps no
/// statement cache, in a transaction of its own); the rows it changed.
async fn execute(pool: &Pool<Postgres>, sql: String, args: Args) -> Result<u64, sqlx::Error> {
    let done = super::on_ledger!(Postgres, pool, |ex, cached| stmt(pool, sql, args, cached)
        .execute(ex));
    Ok(done.rows_affected())
}

/// A lock wait in whole milliseconds, as PostgreSQL's `lock_timeout` and
/// `tower_idempotency_wait` take it: at least 1 (0 would mean no bound),
/// at most `i32::MAX`.
fn wait_ms(wait: Duration) -> i32 {
    i32::try_from(wait.as_millis()).unwrap_or(i32::MAX).max(1)
}

/// A condition that bounds the lock waits of the statement whose `WHERE`
/// it joins to `ms`: an uncorrelated sub-select is a one-time filter,
/// evaluated before the statement reads or writes a row, and its
/// `set_config(…, true)` lasts as long as the statement's own implicit
/// transaction, so nothing of the session changes.
fn lock_wait(ms: i32) -> String {
    format!("(SELECT set_config('lock_timeout', '{ms}ms', true)) IS NOT NULL")
}

/// The longest wait of a lease statement on another writer's row lock.
/// Phases hold the row's lock only while they commit.
const LEASE_LOCK_WAIT_MS: i32 = 5_000;

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
/// itself) is briefly "in progress" while it ends the transaction. A later
/// question that gets no answer (its share of the wait ran out) leaves the
/// last answer standing: "in progress" is never turned into "unknown".
async fn lost_commit_status(pool: &Pool<Postgres>, xid: i64) -> XactStatus {
    let deadline = Instant::now() + LOST_COMMIT_WAIT;
    let mut last = XactStatus::Unknown;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match xact_status(pool, xid, left).await {
            XactStatus::InProgress => last = XactStatus::InProgress,
            XactStatus::Unknown => return last,
            settled => return settled,
        }
        if Instant::now() + LOST_COMMIT_POLL >= deadline {
            return last;
        }
        tokio::time::sleep(LOST_COMMIT_POLL).await;
    }
}

/// The scope's record in the 15 columns of `row` from `first` on, in
/// `CLAIM_READ`'s order (status to parks).
fn record_at(row: &sqlx::postgres::PgRow, first: usize) -> Result<super::Record, sqlx::Error> {
    let at = |i: usize| first + i;
    record_from_row((
        row.try_get(at(0))?,
        row.try_get(at(1))?,
        row.try_get(at(2))?,
        row.try_get(at(3))?,
        row.try_get(at(4))?,
        row.try_get(at(5))?,
        row.try_get(at(6))?,
        row.try_get(at(7))?,
        row.try_get(at(8))?,
        row.try_get(at(9))?,
        row.try_get(at(10))?,
        row.try_get(at(11))?,
        row.try_get(at(12))?,
        row.try_get(at(13))?,
        row.try_get(at(14))?,
    ))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::{LEDGER_SQL_KEPT, LEVELS, XactStatus, begin_at_commit_sql, ledger_sql, wait_ms};

    #[test]
    fn a_schemas_statements_are_formatted_once_and_name_it() {
        let public = ledger_sql(Some("\"public\""));
        assert!(Arc::ptr_eq(&public, &ledger_sql(Some("\"public\""))));
        assert!(public.record.contains("\"public\".idempotency_records"));
        let other = ledger_sql(Some("\"other\""));
        assert!(!Arc::ptr_eq(&public, &other));
        for sql in [&other.claim_read, &other.record, &other.record_at_commit] {
            assert!(sql.contains("\"other\".idempotency_records"), "{sql}");
        }
        assert!(!ledger_sql(None).record.contains('"'));
        // Bounded: the oldest is formatted again once others pushed it out.
        for i in 0..LEDGER_SQL_KEPT {
            ledger_sql(Some(&format!("s{i}")));
        }
        assert!(!Arc::ptr_eq(&public, &ledger_sql(Some("\"public\""))));
    }

    #[test]
    fn lock_waits_are_whole_milliseconds_within_int4() {
        assert_eq!(wait_ms(Duration::ZERO), 1, "0 would mean no bound");
        assert_eq!(wait_ms(Duration::from_micros(999)), 1);
        assert_eq!(wait_ms(Duration::from_millis(300)), 300);
        assert_eq!(wait_ms(Duration::from_secs(u64::MAX)), i32::MAX);
    }

    #[test]
    fn claim_at_commits_begin_names_its_level_and_the_savepoint() {
        let take = &crate::store::Savepoint::get().take;
        for level in LEVELS {
            let begin = begin_at_commit_sql(level);
            assert_eq!(
                &*begin,
                format!("BEGIN ISOLATION LEVEL {}; {take}", level.as_sql())
            );
            assert!(Arc::ptr_eq(&begin, &begin_at_commit_sql(level)));
        }
    }

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

    /// The statement cache is read off the pool's options: a guard against
    /// sqlx changing how they print.
    #[tokio::test]
    async fn a_pool_without_a_statement_cache_is_recognised() {
        use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
        let with = PgPoolOptions::new().connect_lazy_with(PgConnectOptions::new());
        let without = PgPoolOptions::new()
            .connect_lazy_with(PgConnectOptions::new().statement_cache_capacity(0));
        assert!(crate::store::caches_statements(&with));
        assert!(!crate::store::caches_statements(&without));
    }

    #[test]
    fn lease_statements_bind_every_value() {
        use super::{Arg, DIALECT};
        use crate::store::Scope;
        let crafted = "x'); DROP TABLE t; --";
        let scope = Scope {
            principal: crafted,
            operation: "POST /pay",
            key: "k-1",
        };
        let mut args = Vec::new();
        let sql = DIALECT.expires_at(&mut args, &scope);
        assert!(!sql.contains(crafted) && !sql.contains("k-1"), "{sql}");
        assert!(sql.contains("$1") && sql.contains("$3"), "{sql}");
        assert_eq!(args[0], Arg::Bytes(crafted.as_bytes().to_vec()));
        assert_eq!(args.len(), 3);
    }
}
