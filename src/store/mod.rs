//! The ledger: the `idempotency_records` table and the small backend trait
//! that talks to it.
//!
//! The layer never decides a claim with a read followed by an `if` alone:
//! the unique key `(principal_id, operation, idem_key)` decides. SQLite and
//! MySQL/MariaDB insert the `PROCESSING` row at the claim; PostgreSQL
//! (ledger v8) holds the scope with a transaction-scoped lock taken before
//! the read, and writes its one row before the `COMMIT`, where the unique
//! key still refuses a second row (nothing of that transaction commits).
//!
//! Built-in backends (each behind its cargo feature):
//!
//! | backend | claim | waiting on an in-flight duplicate |
//! |---|---|---|
//! | PostgreSQL | with the transaction's `BEGIN`: the scope's transaction advisory lock if free (two `int4` keys, 64 bits of the scope's SHA-256), and a transaction id only when it was taken; then a prepared read of the id and the scope's row. One finished row, prepared, written just before the `COMMIT` | the claim waits on the first claimer's lock in `tower_idempotency_wait` (ledger v8), bounded by a `lock_timeout` set for the wait alone and put back; a wait that runs out is a value, never an error |
//! | SQLite | `INSERT … ON CONFLICT DO NOTHING` in a `BEGIN IMMEDIATE` transaction | writers are serialized; the wait is the connection's `busy_timeout` (`SqliteConnectOptions::busy_timeout`, 5 s by default), and a busy database answers `503` |
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

use std::future::Future;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool};

mod admin;
mod claimed;
mod lease;
mod literal;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

pub use admin::AdminBackend;
pub(crate) use admin::AuditNote;
pub use claimed::Claimed;
pub(crate) use lease::{CLAIM_ID, claim_data};
pub use lease::{Fence, LeaseRecord, LeaseWrite};
pub(crate) use literal::hex;
#[cfg(all(feature = "postgres", feature = "testkit"))]
pub(crate) use postgres::scope_lock;

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

/// Runs a claim on `conn` as a task of its own, so that a caller that goes
/// away mid-claim can never return the connection halfway through the
/// claim's statements (see [`Backend::claim`]): the task finishes, within
/// its lock wait, and a claim won by nobody rolls back as it drops. `hold`
/// (a permit, say) lives as long as the claim. A task that panicked (a
/// driver bug) is [`sqlx::Error::WorkerCrashed`].
pub(crate) fn spawn_claim<DB: Backend, H: Send + 'static>(
    conn: PoolConnection<DB>,
    claim: &Claim<'_>,
    hold: H,
) -> impl Future<Output = Result<ClaimOutcome<DB>, sqlx::Error>> + Send + 'static {
    let owned = OwnedClaim::new(claim);
    let task = tokio::spawn(async move {
        let _hold = hold;
        DB::claim(conn, &owned.as_claim()).await
    });
    async move { task.await.unwrap_or(Err(sqlx::Error::WorkerCrashed)) }
}

/// A lease statement that makes its caller the owner of a row: a fresh
/// lease claim, or the takeover of a lapsed (or parked) lease.
pub(crate) enum Owning {
    /// [`Backend::lease_claim`] with a new claim id.
    Claim {
        claim: OwnedClaim,
        lease_ms: i64,
        claim_id: String,
    },
    /// [`Backend::take_over`] of the generation and claim seen.
    TakeOver {
        scope: OwnedScope,
        generation: i64,
        claim_id: Option<String>,
        lease_ms: i64,
        parked: bool,
    },
}

/// Runs an [`Owning`] statement as a task of its own and waits for it at
/// most `wait`. A caller that stops waiting (its deadline passed, or its
/// future was dropped) never leaves a live lease without an owner behind:
/// when the statement wins after nobody waits for it any more, the task
/// ends the lease it won, so the next retry takes over at once. A wait
/// that runs out is [`sqlx::Error::PoolTimedOut`].
pub(crate) async fn spawn_owning<DB: Backend>(
    pool: Pool<DB>,
    owning: Owning,
    wait: Duration,
) -> Result<bool, sqlx::Error> {
    let (answer, waiting) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (won, scope, generation, claim_id) = match &owning {
            Owning::Claim {
                claim,
                lease_ms,
                claim_id,
            } => {
                let c = claim.as_claim();
                let won = DB::lease_claim(&pool, &c, *lease_ms, claim_id).await;
                (won, c.scope, 1, Some(claim_id.as_str()))
            }
            Owning::TakeOver {
                scope,
                generation,
                claim_id,
                lease_ms,
                parked,
            } => {
                let scope = scope.as_scope();
                let seen = Fence {
                    generation: *generation,
                    claim: claim_id.as_deref(),
                };
                let won = DB::take_over(&pool, &scope, seen, *lease_ms, *parked).await;
                (
                    won,
                    scope,
                    generation.saturating_add(1),
                    claim_id.as_deref(),
                )
            }
        };
        if let Err(Ok(true)) = answer.send(won) {
            let fence = Fence {
                generation,
                claim: claim_id,
            };
            end_lease(&pool, &scope, fence).await;
        }
    });
    match tokio::time::timeout(wait, waiting).await {
        Ok(Ok(won)) => won,
        Ok(Err(_)) => Err(sqlx::Error::WorkerCrashed),
        Err(_) => Err(sqlx::Error::PoolTimedOut),
    }
}

/// Ends a lease this process won but nobody will use (best effort: a
/// lease that cannot be ended lapses on its own), so the next retry takes
/// the row over at once.
pub(crate) async fn end_lease<DB: Backend>(pool: &Pool<DB>, scope: &Scope<'_>, fence: Fence<'_>) {
    if let Err(e) = DB::lease_write(pool, scope, fence, &LeaseWrite::Release).await {
        tracing::warn!(error = %e, "could not end a lease nobody holds; it lapses on its own");
    }
}

/// A scope, owned, for a task.
pub(crate) struct OwnedScope {
    principal: String,
    operation: String,
    key: String,
}

impl OwnedScope {
    pub(crate) fn new(scope: &Scope<'_>) -> Self {
        Self {
            principal: scope.principal.to_owned(),
            operation: scope.operation.to_owned(),
            key: scope.key.to_owned(),
        }
    }

    fn as_scope(&self) -> Scope<'_> {
        Scope {
            principal: &self.principal,
            operation: &self.operation,
            key: &self.key,
        }
    }
}

/// A claim's values, owned, for the task that runs the claim.
pub(crate) struct OwnedClaim {
    principal: String,
    operation: String,
    key: String,
    fingerprint: Vec<u8>,
    retention_ms: i64,
    lock_wait: Duration,
    isolation: IsolationLevel,
    cached_statements: bool,
}

impl OwnedClaim {
    pub(crate) fn new(claim: &Claim<'_>) -> Self {
        Self {
            principal: claim.scope.principal.to_owned(),
            operation: claim.scope.operation.to_owned(),
            key: claim.scope.key.to_owned(),
            fingerprint: claim.fingerprint.to_vec(),
            retention_ms: claim.retention_ms,
            lock_wait: claim.lock_wait,
            isolation: claim.isolation,
            cached_statements: claim.cached_statements,
        }
    }

    fn as_claim(&self) -> Claim<'_> {
        Claim {
            scope: Scope {
                principal: &self.principal,
                operation: &self.operation,
                key: &self.key,
            },
            fingerprint: &self.fingerprint,
            retention_ms: self.retention_ms,
            lock_wait: self.lock_wait,
            isolation: self.isolation,
            cached_statements: self.cached_statements,
        }
    }
}

/// The state of a ledger row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordStatus {
    /// Claimed; the first request is running. In the layer's transaction
    /// mode the row is only ever `PROCESSING` inside its own transaction: a
    /// committed `PROCESSING` row means the handler ended that transaction
    /// itself, and the key answers "outcome unknown".
    Processing,
    /// The operation succeeded; the response is stored.
    Succeeded,
    /// The operation ended in a final business error; the error is stored.
    FailedFinal,
    /// Retention ended; the response was dropped, the key stays refused.
    Expired,
    /// The outcome is not known (the handler ended the claimed transaction
    /// itself); never executed again until an operator resolves it (see
    /// [`Reconciler`](crate::Reconciler)).
    NeedsReconciliation,
}

impl RecordStatus {
    /// The value stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Processing => "PROCESSING",
            Self::Succeeded => "SUCCEEDED",
            Self::FailedFinal => "FAILED_FINAL",
            Self::Expired => "EXPIRED",
            Self::NeedsReconciliation => "NEEDS_RECONCILIATION",
        }
    }

    /// Parses the `status` column.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "PROCESSING" => Self::Processing,
            "SUCCEEDED" => Self::Succeeded,
            "FAILED_FINAL" => Self::FailedFinal,
            "EXPIRED" => Self::Expired,
            "NEEDS_RECONCILIATION" => Self::NeedsReconciliation,
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
    /// End of retention, Unix epoch milliseconds (database clock).
    pub expires_at: i64,
    /// Whether `expires_at` had passed on the database's clock when read.
    pub past_expiry: bool,
    /// The lease state, for a row claimed in lease mode.
    pub lease: Option<LeaseState>,
}

/// Where a lease-mode row stands (see [`lease`](crate::lease)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseState {
    /// The fencing token: 1 at the claim, one more at each takeover.
    pub generation: i64,
    /// Whether the lease was still running on the database's clock when
    /// read (`locked_until` in the future).
    pub live: bool,
    /// The last committed recovery point.
    pub recovery_point: Option<String>,
    /// What the phases and steps saved: a JSON object by point name.
    pub recovery_data: Option<Vec<u8>>,
    /// An external step that may have run and whose outcome is not
    /// recorded.
    pub pending_step: Option<String>,
    /// The id of the claim that made the row (`None` for rows
    /// claimed before the ledger stored it): with the generation, what
    /// every fenced write names.
    pub claim_id: Option<String>,
    /// How often the row was parked (completer passes back off by it).
    pub parks: i64,
}

impl LeaseState {
    /// The fence of the attempt that holds this state.
    pub fn fence(&self) -> Fence<'_> {
        Fence {
            generation: self.generation,
            claim: self.claim_id.as_deref(),
        }
    }
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

impl<'a> Completion<'a> {
    /// The completion recording `stored` with `status`, naming the
    /// resource the handler put in `extensions` (an id the ledger's column
    /// cannot hold, over 255 bytes or with a NUL, is not recorded: the
    /// answer still is).
    pub(crate) fn of(
        status: RecordStatus,
        stored: &'a crate::replay::StoredResponse,
        extensions: &'a http::Extensions,
    ) -> Self {
        let resource_id = extensions
            .get::<crate::ResourceId>()
            .map(crate::ResourceId::as_str)
            .filter(|id| id.len() <= 255 && !id.contains('\0'));
        Self {
            status,
            response_status: i32::from(stored.status),
            response_headers: &stored.headers,
            response_body: &stored.body,
            resource_id,
        }
    }
}

/// A committed record whose outcome is unknown, as listed for operators.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnresolvedRecord {
    /// The stored principal (hashed when it was long, see the scope docs).
    pub principal: String,
    /// The stored operation.
    pub operation: String,
    /// The stored key (hashed with `with_hashed_keys`).
    pub key: String,
    /// `PROCESSING` (stranded: the default mode's handler ended its
    /// transaction, or a lease lapsed with a step pending or long ago) or
    /// `NEEDS_RECONCILIATION`.
    pub status: RecordStatus,
    /// The status the handler answered, when known.
    pub response_status: Option<i32>,
    /// When the key was claimed, epoch milliseconds (database clock).
    pub created_at: i64,
    /// Lease mode: the record's generation (0 for the default mode).
    pub generation: i64,
    /// Lease mode: the external step whose outcome is unknown.
    pub pending_step: Option<String>,
    /// Lease mode: the last committed recovery point.
    pub recovery_point: Option<String>,
    /// Lease mode: the claim's id (what a verdict names with the
    /// generation).
    pub claim_id: Option<String>,
    /// Lease mode: when the lease ends or ended (for a parked record, when
    /// a completer may retry it), epoch milliseconds (database clock).
    pub locked_until: Option<i64>,
    /// Lease mode: how often the record was parked (a verdict names it, so
    /// a completer pass that acted on the record since the listing makes
    /// the verdict [`Changed`](crate::ResolveError::Changed)).
    pub parks: i64,
}

impl UnresolvedRecord {
    /// The fence a verdict on the record as listed names.
    pub fn fence(&self) -> Fence<'_> {
        Fence {
            generation: self.generation,
            claim: self.claim_id.as_deref(),
        }
    }

    /// The record's scope.
    pub fn scope(&self) -> Scope<'_> {
        Scope {
            principal: &self.principal,
            operation: &self.operation,
            key: &self.key,
        }
    }
}

/// How a store error bears on the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// A lock wait on the claimed row ran out: another transaction holds the scope.
    LockTimeout,
    /// The store is busy (SQLite's write lock, a pool with no free
    /// connection): nothing happened, retry later.
    Busy,
    /// A serialization failure or deadlock: the transaction was rolled back.
    Conflict,
    /// The claimed transaction is gone (the handler committed or rolled it
    /// back itself, or ran DDL that commits implicitly).
    TransactionEnded,
    /// The connection was lost or could not be had: an outcome may be unknown.
    ConnectionLost,
    /// Any other error.
    Other,
}

/// Why [`Backend::finish`] returned no expiry. A commit the store knows
/// landed is no error: `finish` returns `Ok`.
#[derive(Debug)]
#[non_exhaustive]
pub enum FinishError {
    /// A driver error, sorted by [`Backend::error_kind`]. Nothing was
    /// committed, unless its kind is [`StoreErrorKind::ConnectionLost`]:
    /// then the commit's outcome is unknown to the store, and the layer
    /// re-reads the ledger to find out.
    Store(sqlx::Error),
    /// The connection was lost during `COMMIT` (the error), and the
    /// database reports the transaction rolled back: nothing was committed.
    Aborted(sqlx::Error),
    /// The connection was lost during `COMMIT` (the error), and the
    /// database reports the transaction still running: it may yet commit
    /// or roll back, and the key stays locked until it has.
    InProgress(sqlx::Error),
    /// The claimed transaction was no longer the one the claim began (the
    /// handler ended it itself, with a `COMMIT` or `ROLLBACK` statement):
    /// nothing was recorded, and what the handler committed stays.
    Ended(sqlx::Error),
}

impl From<sqlx::Error> for FinishError {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(e)
    }
}

impl FinishError {
    /// The driver error underneath.
    pub fn into_inner(self) -> sqlx::Error {
        match self {
            Self::Store(e) | Self::Aborted(e) | Self::InProgress(e) | Self::Ended(e) => e,
        }
    }
}

impl std::fmt::Display for FinishError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Store(e) => e.fmt(f),
            Self::Aborted(e) => write!(
                f,
                "the connection was lost during COMMIT ({e}); the transaction was rolled back"
            ),
            Self::InProgress(e) => write!(
                f,
                "the connection was lost during COMMIT ({e}); the transaction is still running"
            ),
            Self::Ended(e) => write!(
                f,
                "the claimed transaction was ended by the handler ({e}); nothing was recorded"
            ),
        }
    }
}

impl std::error::Error for FinishError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Store(e) | Self::Aborted(e) | Self::InProgress(e) | Self::Ended(e) => Some(e),
        }
    }
}

/// What a claim attempt found.
#[derive(Debug)]
pub enum ClaimOutcome<DB: Database> {
    /// This transaction owns the scope, past the savepoint.
    Won(Claimed<DB>),
    /// A committed row already holds the scope; nothing is left open. The
    /// row, when the claim read it on its way (PostgreSQL); `None`: read it.
    Lost(Option<Box<Record>>),
    /// Another claim of the scope was still running when the lock wait
    /// ran out; nothing is left open. (PostgreSQL tells this without an
    /// error; the other stores report a [`StoreErrorKind::LockTimeout`]
    /// error.)
    InFlight,
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
    /// first that the claimed transaction is still the one the claim began
    /// ([`FinishError::Ended`], or an error of kind
    /// [`StoreErrorKind::TransactionEnded`], when it is not). PostgreSQL
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
    /// then `txid_status`, the `pg_xact_status` of every version); SQLite
    /// and MySQL/MariaDB leave it to the ledger re-read. On any other error
    /// nothing of the transaction is committed.
    fn finish(
        pool: &Pool<Self>,
        tx: Claimed<Self>,
        claim: &Claim<'_>,
        completion: &Completion<'_>,
    ) -> impl Future<Output = Result<i64, FinishError>> + Send;

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
    /// (autocommit off, a savepoint that `commit_fenced` checks first, so a
    /// phase the server rolled back on its own commits nothing, its point
    /// included).
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

/// Takes the savepoint, right after the claim, that final business errors
/// roll back to.
pub(crate) const TAKE_SAVEPOINT: &str = "SAVEPOINT tower_idempotency_claimed";

/// Rolls back to the claim's savepoint; fails when the claimed transaction
/// is gone ([`StoreErrorKind::TransactionEnded`]).
pub(crate) const UNDO_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT tower_idempotency_claimed";

/// What opens a recording: for a final failure the business writes are
/// undone first; then releasing the savepoint proves the claimed
/// transaction is still ours (it fails, [`StoreErrorKind::TransactionEnded`],
/// when the handler ended it).
pub(crate) fn release_savepoint(status: RecordStatus) -> &'static str {
    if status == RecordStatus::FailedFinal {
        "ROLLBACK TO SAVEPOINT tower_idempotency_claimed; RELEASE SAVEPOINT tower_idempotency_claimed"
    } else {
        "RELEASE SAVEPOINT tower_idempotency_claimed"
    }
}

/// Errors every driver reports the same way: lost or unavailable connections.
fn generic_error_kind(err: &sqlx::Error) -> Option<StoreErrorKind> {
    match err {
        sqlx::Error::PoolTimedOut => Some(StoreErrorKind::Busy),
        sqlx::Error::Io(_)
        | sqlx::Error::Protocol(_)
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
    i64,
    i64,
    i64,
    Option<String>,
    Option<Vec<u8>>,
    Option<String>,
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
        past_expiry,
        generation,
        live,
        recovery_point,
        recovery_data,
        pending_step,
        claim_id,
        parks,
    ) = row;
    let lease = (generation > 0).then_some(LeaseState {
        generation,
        live: live != 0,
        recovery_point,
        recovery_data,
        pending_step,
        claim_id,
        parks,
    });
    Ok(Record {
        status: parse_status(&status)?,
        fingerprint,
        response_status,
        response_headers,
        response_body,
        resource_id,
        expires_at,
        past_expiry: past_expiry != 0,
        lease,
    })
}

fn parse_status(status: &str) -> Result<RecordStatus, sqlx::Error> {
    RecordStatus::parse(status)
        .ok_or_else(|| sqlx::Error::Decode(format!("unknown ledger status {status:?}").into()))
}

type UnresolvedRow = (
    String,
    String,
    String,
    String,
    Option<i32>,
    i64,
    i64,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<i64>,
    i64,
);

fn unresolved_from_row(row: UnresolvedRow) -> Result<UnresolvedRecord, sqlx::Error> {
    let (
        principal,
        operation,
        key,
        status,
        response_status,
        created_at,
        generation,
        pending_step,
        recovery_point,
        claim_id,
        locked_until,
        parks,
    ) = row;
    Ok(UnresolvedRecord {
        principal,
        operation,
        key,
        status: parse_status(&status)?,
        response_status,
        created_at,
        generation,
        pending_step,
        recovery_point,
        claim_id,
        locked_until,
        parks,
    })
}

/// Stamps out the statements every backend runs with bound parameters,
/// given its SQL text. `$now` is the backend's SQL expression for the
/// database clock in epoch milliseconds.
macro_rules! shared_statements {
    ($db:ty, fetch = $fetch:expr, mark = $mark:expr,
     expire = $expire:expr, purge = $purge:expr $(,)?) => {
        async fn expire_batch(
            pool: &sqlx::Pool<$db>,
            now: Option<i64>,
            keep_ms: i64,
            limit: i64,
        ) -> Result<u64, sqlx::Error> {
            let done = $crate::store::on_ledger!($db, pool, |ex, cached| sqlx::query($expire)
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
            let done = $crate::store::on_ledger!($db, pool, |ex, cached| sqlx::query($purge)
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
                sqlx::query_as::<_, $crate::store::RecordRow>($fetch)
                    .persistent(cached)
                    .bind(scope.principal)
                    .bind(scope.operation)
                    .bind(scope.key)
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
            let done = $crate::store::on_ledger!($db, pool, |ex, cached| sqlx::query($mark)
                .persistent(cached)
                .bind(claim.scope.principal)
                .bind(claim.scope.operation)
                .bind(claim.scope.key)
                .bind(claim.fingerprint)
                .bind(response_status)
                .bind(claim.retention_ms)
                .execute(ex));
            Ok(done.rows_affected())
        }
    };
}
use shared_statements;

/// Runs one prepared ledger statement (`$body`, on the executor `$ex`,
/// named and cached as `$cached` says) outside any claim: unnamed where
/// [`Backend::UNNAMED_IN_TRANSACTIONS`], in a transaction of its own, so
/// that a transaction-pooling proxy keeps its parse and its execution on
/// one server connection.
macro_rules! on_ledger {
    ($db:ty, $pool:expr, |$ex:ident, $cached:ident| $body:expr) => {{
        let $cached = $crate::store::caches_statements($pool);
        if <$db as $crate::store::Backend>::UNNAMED_IN_TRANSACTIONS && !$cached {
            let mut tx = $pool.begin().await?;
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
/// prepared statements), so it runs through a transaction-pooling proxy.
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
