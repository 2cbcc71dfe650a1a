//! The claimed transaction's connection, as a backend hands it over.
//!
//! A backend either hands over a sqlx [`Transaction`] (SQLite, lease-mode
//! phases), or the pooled connection with the server inside the claimed
//! transaction: where the claim itself opened the transaction in a
//! statement whose rows it had to read (PostgreSQL: the claim's one round
//! trip both begins the transaction and says whether the claim was won),
//! or changed a session setting for it that every end must put back
//! (MySQL/MariaDB: autocommit off). sqlx does not count the second kind
//! as a transaction, so the backend that made it is the one that ends it:
//! its `finish` commits in the same batch as the recording, with nothing
//! queued after, and its rollback puts back what the claim changed.
//!
//! Whatever becomes of a `Claimed` that is never finished (a panicking
//! handler, a dropped future), its connection never returns to the pool
//! inside the transaction: a `Transaction` queues its rollback as sqlx
//! does, and a raw connection is rolled back (and its session setting put
//! back) by a task of its own, or closed (the server then rolls back) when
//! that fails. (Like any
//! pooled connection, it needs the tokio runtime it came from to go back.)

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Database, Transaction};

/// How long the rollback of an abandoned raw transaction may take before
/// its connection is closed instead.
const ROLLBACK_WAIT: Duration = Duration::from_secs(5);

/// The connection of a claimed transaction: dereferences to the
/// connection the handler's statements run on. Owned by one request at a
/// time (the layer's [`Tx`](crate::Tx) hands it out under a lock); dropped
/// unfinished, it never returns its connection to the pool inside the
/// transaction: a sqlx transaction queues its rollback, a raw connection is
/// rolled back by a task of its own or closed.
pub struct Claimed<DB: Database> {
    inner: Inner<DB>,
}

enum Inner<DB: Database> {
    Transaction(Transaction<'static, DB>),
    /// The server is inside a transaction sqlx does not count (`None` once
    /// ended or handed back), and how to roll it back.
    Raw(Option<PoolConnection<DB>>, RollbackFn<DB>),
}

/// Rolls a raw connection's transaction back within [`ROLLBACK_WAIT`], or
/// marks the connection to be closed when it goes.
pub(crate) type RollbackFn<DB> = fn(PoolConnection<DB>) -> BoxFuture<()>;

pub(crate) type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<DB: Database> From<Transaction<'static, DB>> for Claimed<DB> {
    fn from(tx: Transaction<'static, DB>) -> Self {
        Self {
            inner: Inner::Transaction(tx),
        }
    }
}

impl<DB: Database> std::fmt::Debug for Claimed<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claimed").finish_non_exhaustive()
    }
}

impl<DB: Database> Claimed<DB> {
    /// A pooled connection whose server session is inside the claimed
    /// transaction, which sqlx does not count: the backend's own `finish`
    /// ends it (see [`Claimed::ended`]).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn raw(conn: PoolConnection<DB>) -> Self
    where
        for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    {
        Self::raw_with(conn, |conn| Box::pin(rollback_raw(conn, "ROLLBACK")))
    }

    /// A raw claimed connection that `rollback` ends (and puts back as the
    /// pool handed it out: a backend that changed a session setting for the
    /// claim restores it there), within [`ROLLBACK_WAIT`], or closes.
    pub(crate) fn raw_with(conn: PoolConnection<DB>, rollback: RollbackFn<DB>) -> Self {
        Self {
            inner: Inner::Raw(Some(conn), rollback),
        }
    }

    /// The sqlx transaction, for backends that hand one over; the claimed
    /// connection back when it is raw.
    pub fn into_transaction(mut self) -> Result<Transaction<'static, DB>, Self> {
        match self.take() {
            Inner::Transaction(tx) => Ok(tx),
            raw => Err(Self { inner: raw }),
        }
    }

    /// What this holds, leaving an ended raw connection behind (for the
    /// methods that consume `self`, whose `Drop` then does nothing).
    fn take(&mut self) -> Inner<DB> {
        std::mem::replace(&mut self.inner, Inner::Raw(None, |_| Box::pin(async {})))
    }

    /// The batch that ends the transaction is about to be sent: if this is
    /// dropped before its answer is read, the raw connection is closed, not
    /// rolled back (a `ROLLBACK` queued behind a `COMMIT` would find no
    /// transaction). The batch then committed whole or not at all.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn committing(&mut self) {
        if let Inner::Raw(_, rollback) = &mut self.inner {
            *rollback = |mut conn| {
                conn.close_on_drop();
                Box::pin(async {})
            };
        }
    }

    /// A raw connection whose transaction the backend has ended (committed
    /// in its recording batch): it goes back to the pool as it is.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn ended(mut self) {
        drop(self.take());
    }

    /// A raw connection in a state nobody can vouch for (a failed batch, a
    /// handler that ended the transaction itself): closed, so the server
    /// rolls back whatever is open and nothing of it reaches the pool.
    pub(crate) fn discard(mut self) {
        // A sqlx transaction dropped queues its rollback, sent before the
        // connection is pooled again.
        if let Inner::Raw(Some(mut conn), _) = self.take() {
            conn.close_on_drop();
        }
    }

    /// Rolls the transaction back and waits for it (a raw connection whose
    /// rollback fails is closed; a failed sqlx rollback means a lost
    /// connection, whose server aborts the transaction itself).
    pub(crate) async fn rollback(mut self) {
        match self.take() {
            Inner::Transaction(tx) => {
                let _ = tx.rollback().await;
            }
            // A task of its own: a caller dropped while the rollback waits
            // (say, behind a statement the handler abandoned) never returns
            // the connection to the pool inside the transaction.
            Inner::Raw(Some(conn), rollback) => {
                let _ = tokio::spawn(rollback(conn)).await;
            }
            Inner::Raw(None, _) => {}
        }
    }
}

/// Rolls back a raw connection's transaction with `sql` within
/// [`ROLLBACK_WAIT`], or closes the connection (the server then rolls
/// back).
pub(crate) async fn rollback_raw<DB: Database>(mut conn: PoolConnection<DB>, sql: &'static str)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let done = tokio::time::timeout(ROLLBACK_WAIT, sqlx::raw_sql(sql).execute(&mut *conn)).await;
    if !matches!(done, Ok(Ok(_))) {
        conn.close_on_drop();
    }
}

impl<DB: Database> Drop for Claimed<DB> {
    fn drop(&mut self) {
        let Inner::Raw(conn, rollback) = &mut self.inner else {
            return;
        };
        let Some(mut conn) = conn.take() else { return };
        // Abandoned (a panic, a dropped future, a handle kept past the
        // answer): rolled back off the request's path, or closed.
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(rollback(conn))),
            Err(_) => conn.close_on_drop(),
        }
    }
}

impl<DB: Database> Deref for Claimed<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        match &self.inner {
            Inner::Transaction(tx) => tx,
            Inner::Raw(Some(conn), _) => conn,
            Inner::Raw(None, _) => unreachable!("a Claimed is never used after it ended"),
        }
    }
}

impl<DB: Database> DerefMut for Claimed<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        match &mut self.inner {
            Inner::Transaction(tx) => tx,
            Inner::Raw(Some(conn), _) => conn,
            Inner::Raw(None, _) => unreachable!("a Claimed is never used after it ended"),
        }
    }
}
