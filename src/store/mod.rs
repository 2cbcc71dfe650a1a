//! The ledger: the `idempotency_records` table (`tower_idempotency_records`
//! on MySQL/MariaDB, see below) and the small backend trait that talks to
//! it.
//!
//! The layer never decides a claim with a read followed by an `if` alone:
//! the unique key `(principal_id, operation, idem_key)` decides. SQLite and
//! MySQL/MariaDB insert the `PROCESSING` row at the claim; PostgreSQL
//! (ledger v8) holds the scope with a transaction-scoped lock taken before
//! the read, and writes its one row before the `COMMIT`, where the unique
//! key still refuses a second row (nothing of that transaction commits).
//!
//! In the claim-at-commit mode (`IdempotencyLayer::with_claim_at_commit`)
//! nothing is held before the handler: [`Backend::begin_at_commit`] begins
//! the transaction as a bare `BEGIN` would, and
//! [`Backend::finish_at_commit`] inserts the one row under the unique key
//! just before the `COMMIT`; a row already there rolls everything back.
//!
//! Built-in backends (each behind its cargo feature):
//!
//! | backend | claim | waiting on an in-flight duplicate |
//! |---|---|---|
//! | PostgreSQL | with the transaction's `BEGIN`: the scope's transaction advisory lock if free (two `int4` keys, 64 bits of the scope's SHA-256), and a transaction id only when it was taken; then a prepared read of the id and the scope's row. One finished row, prepared, written just before the `COMMIT` | the claim waits on the first claimer's lock in `tower_idempotency_wait` (ledger v8), bounded by a `lock_timeout` set for the wait alone and put back; a wait that runs out is a value, never an error |
//! | SQLite | `INSERT … ON CONFLICT DO NOTHING` in a `BEGIN IMMEDIATE` transaction | writers are serialized (one layer's own requests take turns in its fair queue, see `with_max_per_principal`); the wait on another writer is the connection's `busy_timeout` (`SqliteConnectOptions::busy_timeout`, 5 s by default), and a busy database answers `503` |
//! | MySQL/MariaDB | a plain `INSERT`, a duplicate key reported by the driver's unique-violation signal | the insert blocks on the uncommitted row, bounded by `innodb_lock_wait_timeout` set **for that one statement** (`SET STATEMENT … FOR` on MariaDB, the `SET_VAR` hint on MySQL 8), so no session setting ever changes |
//!
//! # Isolation
//!
//! The claimed transaction runs at the [`IsolationLevel`] the layer is
//! configured with (`READ COMMITTED` by default), set for that transaction
//! only (`BEGIN ISOLATION LEVEL …` / `SET TRANSACTION …`), never for the
//! session. SQLite transactions are always serializable.
//!
//! # Byte-for-byte scopes
//!
//! Scope columns compare byte for byte on every store: `TEXT` with the
//! database's deterministic collation on PostgreSQL, `TEXT` (`BINARY`
//! collation) on SQLite, `VARBINARY` on MySQL/MariaDB (whose `_bin`
//! collations are `PAD SPACE`, so `'alice'` would equal `'alice '`). No
//! trailing space, case or Unicode normalization ever makes two scopes one.
//!
//! # The caller's session (MySQL/MariaDB)
//!
//! A setting a handler leaves on its pooled connection never changes what
//! the ledger reads: scope values are hex literals or bound bytes (no
//! `SET NAMES` or `character_set_client` converts them);
//! `character_set_results` and `sql_select_limit` are pinned for each
//! ledger statement alone (MariaDB's `SET STATEMENT … FOR`); every end is
//! `AND NO CHAIN NO RELEASE` whatever `completion_type` says, and no
//! connection goes back to the pool inside a transaction; the claimed
//! transaction is `READ WRITE` whatever `tx_read_only` says. A recording
//! that ran to its `COMMIT` is never answered "nothing was recorded".
//! Every ledger statement names the table `tower_idempotency_records`
//! (migration 8; `idempotency_records` is a view of it) in the pool's
//! database ([`Backend::database`]), so neither a handler's `USE` nor its
//! `TEMPORARY` table named `idempotency_records` moves the ledger.
//! See `docs/choices.md`, "The caller's session on MySQL/MariaDB".
//!
//! # One clock
//!
//! `created_at`, `expires_at`, the `410` decision and the sweeper all use
//! the **database's** clock (epoch milliseconds computed in SQL), so
//! application instances with skewed clocks agree on when a key expires.
//!
//! # Migrations
//!
//! [`migrate`] applies the crate's versioned migrations (in
//! `migrations/<backend>/`) that are missing, in order, and records each in
//! its own table `tower_idempotency_migrations` (never `_sqlx_migrations`,
//! the table your own `sqlx::migrate!` uses). It holds a lock while it works
//! (PostgreSQL `pg_advisory_xact_lock`, MySQL `GET_LOCK`, SQLite's write
//! lock), so any number of instances may call it at start-up at once. A
//! database created by an earlier version of this crate (the table without
//! the migrations table) is upgraded in place.

// Without a backend feature (a build for the client half alone, say), the
// statements and helpers the backends share have no user; each backend's
// build still checks them.
#![cfg_attr(
    not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(dead_code, unused_imports, unused_macros)
)]

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool};

mod admin;
mod claimed;
mod error;
mod lease;
mod literal;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod record;
#[cfg(feature = "sqlite")]
mod sqlite;
mod task;

pub use admin::AdminBackend;
pub(crate) use admin::AuditNote;
pub use claimed::Claimed;
pub(crate) use error::generic_error_kind;
pub use error::{FinishError, StoreErrorKind};
pub(crate) use lease::{CLAIM_ID, claim_data};
pub use lease::{Fence, LeaseRecord, LeaseWrite};
pub(crate) use literal::hex;

/// A scope's part bound as the text it is.
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(crate) fn as_text(part: &str) -> &str {
    part
}
#[cfg(all(feature = "postgres", feature = "testkit"))]
pub(crate) use postgres::scope_lock;
pub use record::{Completion, LeaseState, Record, RecordStatus, UnresolvedRecord};
pub(crate) use record::{
    RecordRow, UnresolvedRow, parse_status, record_from_row, unresolved_from_row,
};
pub(crate) use task::{OwnedClaim, OwnedScope, Owning, end_lease, spawn_claim, spawn_owning};

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

/// The isolation level of the claimed transaction the handler writes on.
///
/// The level applies to that transaction only; the session's own default
/// is never changed. Under `RepeatableRead` and `Serializable` a claim that
/// conflicts with a concurrent one may fail with a serialization error
/// instead of waiting: the layer treats that as a lost claim and reads the
/// winner's record. A serialization failure or deadlock at `COMMIT` rolls
/// everything back and is answered `503` with `Retry-After`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum IsolationLevel {
    /// `READ COMMITTED`: the default. On SQLite, serializable.
    #[default]
    ReadCommitted,
    /// `REPEATABLE READ`. On SQLite, serializable.
    RepeatableRead,
    /// `SERIALIZABLE`: for handlers that check, then write (a balance
    /// before a debit).
    Serializable,
}

impl IsolationLevel {
    /// The SQL name of the level.
    pub fn as_sql(self) -> &'static str {
        match self {
            Self::ReadCommitted => "READ COMMITTED",
            Self::RepeatableRead => "REPEATABLE READ",
            Self::Serializable => "SERIALIZABLE",
        }
    }
}

/// A new `PROCESSING` row to claim a scope.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The scope to claim.
    pub scope: Scope<'a>,
    /// The request fingerprint (32 bytes of SHA-256).
    pub fingerprint: &'a [u8],
    /// How long the key is honoured, in milliseconds from the claim,
    /// measured on the database's clock.
    pub retention_ms: i64,
    /// The longest wait for another claimer's uncommitted row.
    pub lock_wait: Duration,
    /// The isolation level of the claimed transaction.
    pub isolation: IsolationLevel,
    /// Whether the store's prepared statements may be named and kept on
    /// the connection ([`caches_statements`] of the pool); `false`: parsed
    /// afresh on every use and never left on a server connection.
    pub cached_statements: bool,
    /// The database every ledger statement names, where a store names one
    /// ([`Backend::database`]: MySQL/MariaDB's, from the pool's connect
    /// options), so that a handler's `USE` never moves the ledger; on
    /// PostgreSQL the ledger's schema ([`Backend::find_ledger`]).
    pub database: Option<&'a str>,
    /// Whether the claim first waits until the server has applied what
    /// its cluster committed before it (MySQL/MariaDB: a Galera node's
    /// causal wait); `false` only where the server was found not to be a
    /// Galera node ([`Backend::causal_wait`]). Ignored by other stores.
    pub causal_wait: bool,
}

/// Whether `pool`'s connections keep sqlx's statement cache (its default).
/// With the cache off (`statement_cache_capacity(0)`, the setting for
/// PgBouncer before 1.21 in transaction pooling mode) the ledger's own
/// prepared statements are unnamed, as the application's must be there:
/// parsed on every use, never left on a server connection. Read from the
/// pool's connect options (sqlx has no getter for the capacity).
pub fn caches_statements<DB: Database>(pool: &Pool<DB>) -> bool {
    !format!("{:?}", pool.connect_options()).contains("statement_cache_capacity: 0,")
}

/// A read of the ledger gets at least this long, even when the wait budget
/// is spent: a lost claim must still be explained.
pub(crate) const MIN_READ_WAIT: std::time::Duration = std::time::Duration::from_millis(250);

/// What a claim attempt found.
#[derive(Debug)]
pub enum ClaimOutcome<DB: Database> {
    /// This transaction owns the scope, past the savepoint.
    Won(Claimed<DB>),
    /// A committed row already holds the scope; nothing is left open. The
    /// row, when the claim read it on its way (PostgreSQL, MySQL/MariaDB);
    /// `None`: read it.
    Lost(Option<Box<Record>>),
    /// Another claim of the scope was still running when the lock wait
    /// ran out; nothing is left open. (PostgreSQL tells this without an
    /// error; the other stores report a [`StoreErrorKind::LockTimeout`]
    /// error.)
    InFlight,
}

/// What [`Backend::finish_at_commit`] came to.
#[derive(Debug)]
pub enum AtCommitOutcome {
    /// The ledger row was written and committed: the key's `expires_at`
    /// (epoch milliseconds, database clock).
    Committed(i64),
    /// Another request's row held the scope, and everything of this
    /// transaction was rolled back. The row, when the insert read it on
    /// its way (PostgreSQL, a row committed before the insert began);
    /// `None`: read it, in a transaction of its own.
    Lost(Option<Box<Record>>),
}

/// A database that can hold the ledger. Implemented for `sqlx::Postgres`,
/// `sqlx::Sqlite` and `sqlx::MySql` behind their features.
///
/// Every method is short (a few statements at most, no unbounded waits) and
/// must keep its guarantee under concurrency: [`claim`](Backend::claim) is
/// decided by the unique constraint alone. No method may leave a changed
/// session setting on a connection. The `testkit` feature's conformance
/// suite checks an implementation against the whole contract.
pub trait Backend: Database {
    /// Whether a claimed transaction runs with autocommit off, so that
    /// once the server has rolled it back on its own (a deadlock, a lock
    /// wait timeout, or on a Galera cluster a certification conflict or a
    /// replicated writer's abort), nothing the handler sends afterwards
    /// commits unless it sends `COMMIT` itself: the layer then rolls it
    /// all back, and a claimed transaction found ended whose `PROCESSING`
    /// row never committed committed nothing. `true` for MySQL/MariaDB,
    /// where statements after such a rollback would otherwise commit one
    /// by one; `false` elsewhere (PostgreSQL keeps a failed transaction
    /// open and refuses every statement until it ends; SQLite's claims
    /// hold the database's one write lock), where a transaction found
    /// ended always holds the key for reconciliation.
    const CLAIMS_RUN_WITHOUT_AUTOCOMMIT: bool = false;

    /// Whether the ledger's unnamed prepared statements (a pool without a
    /// statement cache, see [`caches_statements`]) outside a claim run in a
    /// transaction of their own: `true` for PostgreSQL, where such a
    /// statement takes two round trips that a transaction-pooling proxy
    /// (PgBouncer before 1.21) could send to two server connections.
    const UNNAMED_IN_TRANSACTIONS: bool = false;

    /// Whether every claim takes the database's one write lock until its
    /// commit (`true` for SQLite's `BEGIN IMMEDIATE`): the layer then lets
    /// one of its requests claim at a time, and principals take turns at
    /// the writer in its own fair queue instead of polling the lock.
    const ONE_WRITER: bool = false;

    /// The database `pool`'s ledger statements name, read once from its
    /// connect options when a layer or consumer is built: MySQL/MariaDB's
    /// database (a handler's `USE` changes the connection's current one),
    /// `None` where the store finds its ledger otherwise (PostgreSQL reads
    /// the ledger's schema in the claim; SQLite names `main`).
    fn database(pool: &Pool<Self>) -> Option<Arc<str>> {
        let _ = pool;
        None
    }

    /// A shared ledger statement's text (written against
    /// `idempotency_records`) as `pool`'s store sends it: unchanged, or on
    /// MySQL/MariaDB naming the ledger table in the pool's database.
    #[doc(hidden)]
    fn ledger_sql(pool: &Pool<Self>, sql: &'static str) -> sqlx::SqlStr {
        let _ = pool;
        sqlx::SqlSafeStr::into_sql_str(sql)
    }

    /// Applies the missing versioned migrations, under a lock. Safe to
    /// re-run and to run from several instances at once.
    fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Claims a scope on `conn`: begins the transaction that is handed to
    /// the handler (one sqlx counts, see [`Claimed`]), holds the scope in
    /// it (SQLite and MySQL/MariaDB insert the `PROCESSING` row,
    /// PostgreSQL takes the scope's lock and reads the row), and takes the
    /// savepoint that final business errors roll back to. Waits for
    /// another claimer at most about `claim.lock_wait`, then fails with an
    /// error of kind [`StoreErrorKind::LockTimeout`] (or returns
    /// [`ClaimOutcome::InFlight`], as PostgreSQL does).
    ///
    /// The layer runs each claim as a task of its own, which finishes
    /// (within its lock wait) whatever becomes of the request.
    fn claim(
        conn: PoolConnection<Self>,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<ClaimOutcome<Self>, sqlx::Error>> + Send;

    /// Records the terminal state of `claim`'s scope (for `FailedFinal`,
    /// after rolling back to the claim's savepoint) and commits, checking
    /// that the claimed transaction is still the one the claim began
    /// ([`FinishError::Ended`], or an error of kind
    /// [`StoreErrorKind::TransactionEnded`], when it is not) before the
    /// `COMMIT` (MySQL/MariaDB: after the writes, the check being the last
    /// statement before the `COMMIT`). PostgreSQL
    /// writes its one ledger row here; the other stores update the row
    /// the claim inserted.
    /// Returns the key's `expires_at` (epoch milliseconds, database clock).
    /// The transaction is rolled back on error.
    ///
    /// # When the connection is lost during `COMMIT`
    ///
    /// The commit may or may not have landed. A backend that can ask the
    /// database what became of the transaction does so, on a fresh
    /// connection from `pool`, within a short bound, and answers for it:
    /// `Ok` with the expiry when it committed, [`FinishError::Aborted`]
    /// when it rolled back, [`FinishError::InProgress`] when it is still
    /// running. Otherwise (the backend cannot ask, or the database could not
    /// say) it returns [`FinishError::Store`] with an error of kind
    /// [`StoreErrorKind::ConnectionLost`], and the layer re-reads the ledger:
    /// the committed row there means the commit landed. PostgreSQL asks
    /// (the transaction's id is read by the claim, at no extra round trip,
    /// then `txid_status`, the `pg_xact_status` of every version, whose
    /// "committed" counts only with the row the transaction wrote on the
    /// server asked: a new leader after a failover reuses ids); SQLite
    /// and MySQL/MariaDB leave it to the ledger re-read. On any other error
    /// nothing of the transaction is committed.
    fn finish(
        pool: &Pool<Self>,
        tx: Claimed<Self>,
        claim: &Claim<'_>,
        completion: &Completion<'_>,
    ) -> impl Future<Output = Result<i64, FinishError>> + Send;

    /// Where a layer's ledger statements go, asked once per layer on a
    /// pooled connection `conn` before its first claim: PostgreSQL's
    /// ledger schema as the pool's sessions find it on their
    /// `search_path` (never `pg_temp`; the claim's read and the row
    /// written after the handler both name it, so neither a handler's
    /// `SET LOCAL search_path` nor a temporary table of the same name
    /// moves them); `None` elsewhere (MySQL/MariaDB name
    /// [`database`](Backend::database), SQLite `main`). It travels in
    /// `Claim.database`.
    #[doc(hidden)]
    fn find_ledger(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<Option<Arc<str>>, sqlx::Error>> + Send {
        let _ = conn;
        std::future::ready(Ok(None))
    }

    /// Whether a claim on the server `conn` reaches must first wait for
    /// what its cluster committed before it ([`Claim::causal_wait`]),
    /// asked once per layer beside [`find_ledger`](Backend::find_ledger):
    /// on MySQL/MariaDB whether the server is a Galera node; `true`
    /// elsewhere.
    #[doc(hidden)]
    fn causal_wait(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send {
        let _ = conn;
        std::future::ready(Ok(true))
    }

    /// Begins the claimed transaction of the claim-at-commit mode
    /// (`IdempotencyLayer::with_claim_at_commit`) on `conn`: a transaction
    /// sqlx counts, at `claim.isolation`, with the savepoint final
    /// business errors roll back to, and **nothing of the scope held**:
    /// the handler runs at once, and the ledger row is written by
    /// [`finish_at_commit`](Backend::finish_at_commit). The same one round
    /// trip as a bare `BEGIN`.
    fn begin_at_commit(
        conn: PoolConnection<Self>,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<Claimed<Self>, sqlx::Error>> + Send;

    /// Records the terminal state of a transaction begun by
    /// [`begin_at_commit`](Backend::begin_at_commit) and commits, as
    /// [`finish`](Backend::finish) does (for `FailedFinal`, after rolling
    /// back to the savepoint; a transaction the handler ended is
    /// [`FinishError::Ended`]), except that the ledger row is **inserted
    /// here, under the unique constraint**: [`AtCommitOutcome::Committed`]
    /// when it was written and committed; [`AtCommitOutcome::Lost`] when a
    /// row of another request already held the scope (committed, or
    /// committed while this one waited for it), and then the whole
    /// transaction, business writes included, was rolled back. The insert is quiet where the store
    /// allows it (no server error for a lost race: PostgreSQL and SQLite
    /// `ON CONFLICT DO NOTHING`; MySQL/MariaDB, whose quiet forms are
    /// ambiguous or too broad, the driver's unique-violation signal, which
    /// the server does not log). A wait on another request's uncommitted
    /// row is bounded by about `claim.lock_wait`, then an error of kind
    /// [`StoreErrorKind::LockTimeout`] with everything rolled back.
    fn finish_at_commit(
        pool: &Pool<Self>,
        tx: Claimed<Self>,
        claim: &Claim<'_>,
        completion: &Completion<'_>,
    ) -> impl Future<Output = Result<AtCommitOutcome, FinishError>> + Send;

    /// Rolls back to the claim's savepoint before the transaction is
    /// abandoned: an error of kind [`StoreErrorKind::TransactionEnded`]
    /// when the savepoint is gone.
    fn check_savepoint(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Reads the committed row of a scope, outside any claim transaction.
    fn fetch(
        pool: &Pool<Self>,
        scope: &Scope<'_>,
    ) -> impl Future<Output = Result<Option<Record>, sqlx::Error>> + Send;

    /// Holds `scope` as `NEEDS_RECONCILIATION`, noting the handler's status:
    /// a committed `PROCESSING` row is marked, and a missing row (the
    /// handler rolled the claim back, then kept writing) is inserted with
    /// `claim`'s fingerprint and retention, so the key can never run again
    /// on its own. A terminal row is left alone. Returns the rows changed.
    fn mark_unresolved(
        pool: &Pool<Self>,
        claim: &Claim<'_>,
        response_status: i32,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Lists at most `limit` rows whose outcome is not settled, oldest
    /// first: `NEEDS_RECONCILIATION` rows, committed `PROCESSING` rows of
    /// the default mode (generation 0), and lease-mode `PROCESSING` rows
    /// whose lease lapsed with a step pending, or more than `stranded_ms`
    /// ago. Operators' verdicts are [`lease_write`](Backend::lease_write)s
    /// of [`LeaseWrite::Resolve`] or [`LeaseWrite::Rerun`] with the listed
    /// record's fence.
    fn list_unresolved(
        pool: &Pool<Self>,
        limit: i64,
        stranded_ms: i64,
    ) -> impl Future<Output = Result<Vec<UnresolvedRecord>, sqlx::Error>> + Send;

    /// How many records [`list_unresolved`](Backend::list_unresolved)
    /// would list with no limit, and the oldest one's `created_at` (epoch
    /// milliseconds) with the database clock's `now`, as `(count, oldest,
    /// now)`. One statement; the same definition as the listing.
    fn count_unresolved(
        pool: &Pool<Self>,
        stranded_ms: i64,
    ) -> impl Future<Output = Result<(i64, Option<i64>, i64), sqlx::Error>> + Send;

    /// Turns at most `limit` terminal rows (`SUCCEEDED`, `FAILED_FINAL`) whose
    /// `expires_at` is at or before `now` (epoch milliseconds; `None`: the
    /// database's clock) into `EXPIRED` tombstones: response headers and
    /// body dropped, scope, fingerprint and resource id kept, and
    /// `expires_at` moved `keep_ms` later, to when the tombstone may be
    /// purged (so the sweeper's range scans never wade through kept
    /// tombstones). Never touches `PROCESSING` or `NEEDS_RECONCILIATION`
    /// rows. One short statement; returns the rows changed.
    fn expire_batch(
        pool: &Pool<Self>,
        now: Option<i64>,
        keep_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Deletes at most `limit` tombstones whose (moved) `expires_at` is at
    /// or before `now` (`None`: the database's clock). One short statement;
    /// returns the rows deleted.
    fn purge_batch(
        pool: &Pool<Self>,
        now: Option<i64>,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Sorts a driver error.
    fn error_kind(err: &sqlx::Error) -> StoreErrorKind;

    // Lease mode (see `crate::lease`). Every write below names the
    // generation its writer holds and matches nothing once the row was
    // taken over: the fence is in the same statement as the write.

    /// Inserts and commits a lease claim: `PROCESSING`, generation 1,
    /// `locked_until` = now + `lease_ms` (database clock), `claim_id` (hex
    /// digits), nothing saved but the claim id. `Ok(false)` when a row
    /// already holds the scope. Waits
    /// for another claimer's uncommitted row at most about
    /// `claim.lock_wait`.
    fn lease_claim(
        pool: &Pool<Self>,
        claim: &Claim<'_>,
        lease_ms: i64,
        claim_id: &str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Takes over the scope's row of the claim and generation `seen` when
    /// its lease has lapsed (or, with `parked`, when it is
    /// `NEEDS_RECONCILIATION` and its back-off ended): generation `seen +
    /// 1`, leased for `lease_ms`, in one conditional statement. Of any
    /// number of concurrent takeovers of one generation, at most one
    /// returns `Ok(true)`.
    fn take_over(
        pool: &Pool<Self>,
        scope: &Scope<'_>,
        seen: Fence<'_>,
        lease_ms: i64,
        parked: bool,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// One fenced write on its own (committed at once); `Ok(false)` when the
    /// row is no longer the claim at the generation `fence` names (or is
    /// settled). Lock waits are bounded (a few seconds).
    fn lease_write(
        pool: &Pool<Self>,
        scope: &Scope<'_>,
        fence: Fence<'_>,
        write: &LeaseWrite<'_>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Begins the transaction of one lease-mode phase, at `isolation`
    /// (for that transaction only), as the claim's does where
    /// [`CLAIMS_RUN_WITHOUT_AUTOCOMMIT`](Backend::CLAIMS_RUN_WITHOUT_AUTOCOMMIT)
    /// (autocommit off, a savepoint that `commit_fenced` checks after its
    /// write, so a phase the server rolled back on its own commits nothing,
    /// its point included).
    fn begin_phase(
        pool: &Pool<Self>,
        isolation: IsolationLevel,
    ) -> impl Future<Output = Result<Claimed<Self>, sqlx::Error>> + Send;

    /// Ends a phase: the fenced write and the phase's own writes commit
    /// together, or (when the fence does not match) nothing commits and
    /// `Ok(None)` is returned. `Ok(Some(expires_at))` after the commit.
    /// A connection lost during the `COMMIT` is explained as for
    /// [`finish`](Backend::finish).
    fn commit_fenced(
        pool: &Pool<Self>,
        tx: Claimed<Self>,
        scope: &Scope<'_>,
        fence: Fence<'_>,
        write: &LeaseWrite<'_>,
    ) -> impl Future<Output = Result<Option<i64>, FinishError>> + Send;

    /// At most `limit` leased rows of `operations` a completer may take
    /// over, the one due longest first: `PROCESSING` with a lapsed lease,
    /// and `NEEDS_RECONCILIATION` with a pending step whose outcome a
    /// completer may still recover (parked as recoverable, its back-off
    /// ended).
    fn list_leases(
        pool: &Pool<Self>,
        operations: &[&str],
        limit: i64,
    ) -> impl Future<Output = Result<Vec<LeaseRecord>, sqlx::Error>> + Send;
}

/// Applies the crate's missing ledger migrations on `pool`, in order and
/// under a lock (see the [module docs](self)). Safe to call on every start
/// of every instance; independent of your application's `sqlx::migrate!`
/// history.
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn start() -> Result<(), sqlx::Error> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/shop").await?;
/// tower_idempotency::migrate(&pool).await?; // before the layer serves a request
/// # Ok(())
/// # }
/// ```
pub async fn migrate<DB: Backend>(pool: &Pool<DB>) -> Result<(), sqlx::Error> {
    DB::migrate(pool).await
}

/// The migrations of a backend, from its folder under `migrations/`:
/// `migrations!("postgres", 1 => "0001_idempotency_records", …)`; the file
/// stem is the name recorded with the version.
macro_rules! migrations {
    ($dir:literal, $($version:literal => $file:literal),+ $(,)?) => {
        &[$($crate::store::Migration {
            version: $version,
            name: $file,
            sql: include_str!(concat!("../../migrations/", $dir, "/", $file, ".sql")),
        }),+]
    };
}
use migrations;

/// One versioned schema change.
pub(crate) struct Migration {
    pub(crate) version: i64,
    pub(crate) name: &'static str,
    pub(crate) sql: &'static str,
}

/// The claim's savepoint, the one final business errors roll back to.
///
/// Its name is drawn once per process (`tower_idempotency_` and 16 random
/// hex digits), so no savepoint a handler takes on the claimed transaction,
/// whatever it calls it, can be the one the layer rolls back to: a
/// `ROLLBACK TO` reaches the most recent savepoint of a name, and a
/// handler's `SAVEPOINT tower_idempotency_claimed` (a name it could guess)
/// would otherwise keep the business writes made before it.
pub(crate) struct Savepoint {
    /// Takes the savepoint, right after the claim.
    pub(crate) take: String,
    /// Rolls back to it; fails when the claimed transaction is gone
    /// ([`StoreErrorKind::TransactionEnded`]).
    pub(crate) undo: String,
    /// Releases it and takes it again (what the claim holds moves to the
    /// transaction).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) retake: String,
    /// Opens the recording of a final failure: the business writes are
    /// undone, then the savepoint is released.
    undo_and_release: String,
    /// Releases it, which proves the claimed transaction is still ours (it
    /// fails, [`StoreErrorKind::TransactionEnded`], when the handler or
    /// the server ended it): SQLite's recordings open with it, MySQL's
    /// batches send it after their writes.
    release: String,
}

impl Savepoint {
    /// This process's claim savepoint.
    pub(crate) fn get() -> &'static Self {
        static SAVEPOINT: std::sync::OnceLock<Savepoint> = std::sync::OnceLock::new();
        SAVEPOINT.get_or_init(|| {
            let name = format!("tower_idempotency_{:016x}", crate::random::random_u64());
            Self {
                take: format!("SAVEPOINT {name}"),
                undo: format!("ROLLBACK TO SAVEPOINT {name}"),
                retake: format!("RELEASE SAVEPOINT {name}; SAVEPOINT {name}"),
                undo_and_release: format!("ROLLBACK TO SAVEPOINT {name}; RELEASE SAVEPOINT {name}"),
                release: format!("RELEASE SAVEPOINT {name}"),
            }
        })
    }

    /// What opens the recording of an answer of `status`.
    #[cfg_attr(not(any(feature = "sqlite", feature = "mysql")), allow(dead_code))]
    pub(crate) fn release(&self, status: RecordStatus) -> &str {
        if status == RecordStatus::FailedFinal {
            &self.undo_and_release
        } else {
            &self.release
        }
    }
}

/// Stamps out the statements every backend runs with bound parameters,
/// given its SQL text; `$scope` turns a scope's part into the value bound
/// for it. `$now` is the backend's SQL expression for the database clock
/// in epoch milliseconds.
macro_rules! shared_statements {
    ($db:ty, scope = $scope:path, fetch = $fetch:expr, mark = $mark:expr,
     expire = $expire:expr, purge = $purge:expr $(,)?) => {
        async fn expire_batch(
            pool: &sqlx::Pool<$db>,
            now: Option<i64>,
            keep_ms: i64,
            limit: i64,
        ) -> Result<u64, sqlx::Error> {
            let done = $crate::store::on_ledger!($db, pool, |ex, cached| sqlx::query(
                <$db as $crate::store::Backend>::ledger_sql(pool, $expire)
            )
            .persistent(cached)
            .bind(keep_ms)
            .bind(now)
            .bind(limit)
            .execute(ex));
            Ok(done.rows_affected())
        }

        async fn purge_batch(
            pool: &sqlx::Pool<$db>,
            now: Option<i64>,
            limit: i64,
        ) -> Result<u64, sqlx::Error> {
            let done = $crate::store::on_ledger!($db, pool, |ex, cached| sqlx::query(
                <$db as $crate::store::Backend>::ledger_sql(pool, $purge)
            )
            .persistent(cached)
            .bind(now)
            .bind(limit)
            .execute(ex));
            Ok(done.rows_affected())
        }

        async fn fetch(
            pool: &sqlx::Pool<$db>,
            scope: &$crate::store::Scope<'_>,
        ) -> Result<Option<$crate::store::Record>, sqlx::Error> {
            $crate::store::on_ledger!($db, pool, |ex, cached| {
                sqlx::query_as::<_, $crate::store::RecordRow>(
                    <$db as $crate::store::Backend>::ledger_sql(pool, $fetch),
                )
                .persistent(cached)
                .bind($scope(scope.principal))
                .bind($scope(scope.operation))
                .bind($scope(scope.key))
                .fetch_optional(ex)
            })
            .map($crate::store::record_from_row)
            .transpose()
        }

        async fn mark_unresolved(
            pool: &sqlx::Pool<$db>,
            claim: &$crate::store::Claim<'_>,
            response_status: i32,
        ) -> Result<u64, sqlx::Error> {
            let done = $crate::store::on_ledger!($db, pool, |ex, cached| sqlx::query(
                <$db as $crate::store::Backend>::ledger_sql(pool, $mark)
            )
            .persistent(cached)
            .bind($scope(claim.scope.principal))
            .bind($scope(claim.scope.operation))
            .bind($scope(claim.scope.key))
            .bind(claim.fingerprint)
            .bind(response_status)
            .bind(claim.retention_ms)
            .execute(ex));
            Ok(done.rows_affected())
        }
    };
}
use shared_statements;

/// A connection from `pool`. sqlx's acquire future carries its connect
/// path inline (about 8 KiB in a release build); boxed here, it stays out
/// of the future of every request that takes a connection, which is moved
/// whole when the request starts (`docs/performance.md`, *The size of a
/// request's future*).
pub(crate) async fn acquire<DB: Database>(
    pool: &Pool<DB>,
) -> Result<PoolConnection<DB>, sqlx::Error> {
    Box::pin(pool.acquire()).await
}

/// Runs one prepared ledger statement (`$body`, on the executor `$ex`,
/// named and cached as `$cached` says) outside any claim: unnamed where
/// [`Backend::UNNAMED_IN_TRANSACTIONS`], in a transaction of its own, so
/// that a transaction-pooling proxy keeps its parse and its execution on
/// one server connection.
macro_rules! on_ledger {
    ($db:ty, $pool:expr, |$ex:ident, $cached:ident| $body:expr) => {{
        let $cached = $crate::store::caches_statements($pool);
        if <$db as $crate::store::Backend>::UNNAMED_IN_TRANSACTIONS && !$cached {
            // Boxed, as in `acquire`.
            let mut tx = Box::pin($pool.begin()).await?;
            let out = {
                let $ex = &mut *tx;
                $body.await?
            };
            tx.commit().await?;
            out
        } else {
            let $ex = $pool;
            $body.await?
        }
    }};
}
pub(crate) use on_ledger;

/// Stamps out the versioned migration runner for a backend: `$create`
/// runs on `$conn` first (and takes the backend's migration lock where it
/// is a statement), then each missing migration and its record, with
/// `$now` the backend's database clock. Simple statements only (no
/// protocol-level prepared statements), so it runs through a
/// transaction-pooling proxy.
macro_rules! run_migrations {
    ($conn:expr, $migrations:expr, create = $create:expr, now = $now:expr $(,)?) => {{
        use sqlx::Row as _;
        let conn = $conn;
        sqlx::raw_sql($create).execute(&mut *conn).await?;
        let applied = sqlx::raw_sql("SELECT version FROM tower_idempotency_migrations")
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(|row| row.try_get::<i64, _>(0))
            .collect::<Result<Vec<i64>, _>>()?;
        for m in $migrations {
            if applied.contains(&m.version) {
                continue;
            }
            sqlx::raw_sql(m.sql).execute(&mut *conn).await?;
            // Version and name are this crate's constants (digits, [a-z_]).
            let record = format!(
                "INSERT INTO tower_idempotency_migrations (version, name, applied_at) \
                 VALUES ({}, '{}', {})",
                m.version, m.name, $now
            );
            sqlx::raw_sql(sqlx::AssertSqlSafe(record))
                .execute(&mut *conn)
                .await?;
        }
        Ok::<(), sqlx::Error>(())
    }};
}
use run_migrations;
