//! How a store error bears on the protocol, and why a recording failed.

/// How a store error bears on the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// A lock wait on the claimed row ran out: another transaction holds the scope.
    LockTimeout,
    /// The store is busy (SQLite's write lock, a pool with no free
    /// connection, a server that refuses writes for now, as a standby or a
    /// primary being demoted does): nothing happened, retry later.
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

/// Why [`Backend::finish`](super::Backend::finish) returned no expiry. A commit the store knows
/// landed is no error: `finish` returns `Ok`.
#[derive(Debug)]
#[non_exhaustive]
pub enum FinishError {
    /// A driver error, sorted by [`Backend::error_kind`](super::Backend::error_kind). Nothing was
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
    /// The claimed transaction was no longer the one the claim began: the
    /// handler ended it itself (a `COMMIT` or `ROLLBACK` statement, DDL
    /// that commits implicitly), or the server did and the recording ran
    /// on in a new transaction (on Galera, a replicated writer's abort
    /// that lands while the recording batch runs). Nothing was recorded;
    /// what the handler committed stays.
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
                "the claimed transaction was ended by the handler or the server before the recording could commit ({e}); nothing was recorded"
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

/// Errors every driver reports the same way: lost or unavailable connections.
pub(crate) fn generic_error_kind(err: &sqlx::Error) -> Option<StoreErrorKind> {
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
