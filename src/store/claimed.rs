//! The claimed transaction's connection, as a backend hands it over.
//!
//! Every backend hands over the pooled connection inside a transaction
//! that **sqlx counts** (its transaction depth is one): a handler's nested
//! `begin()` on it is a savepoint, its `commit()` releases the savepoint,
//! its `rollback()` or drop rolls back to it, and the claim (with whatever
//! holds the scope) survives all of them. The transaction is begun with the
//! backend's own statement (`TransactionManager::begin` with a custom
//! `BEGIN`, which may carry the claim), and ended by the layer alone.
//!
//! Whatever becomes of a `Claimed` that is never finished (a panicking
//! handler, a dropped future), its connection never returns to the pool
//! inside the transaction or with a changed session setting: it is rolled
//! back (and what the backend changed for the claim put back) by a task of
//! its own, or closed (the server then rolls back) when that fails. (Like
//! any pooled connection, it needs the tokio runtime it came from to go
//! back.)

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Database, SqlStr};
use sqlx_core::transaction::TransactionManager;

/// How long the rollback of an abandoned claimed transaction may take
/// before its connection is closed instead.
const ROLLBACK_WAIT: Duration = Duration::from_secs(5);

/// Ends a claimed transaction that is not committed, and puts back what the
/// backend changed for it, as the pool handed the connection out; `Err`
/// when the connection cannot be vouched for (it is then closed).
pub(crate) type EndFn<DB> = for<'c> fn(&'c mut PoolConnection<DB>) -> Ending<'c>;

/// What an [`EndFn`] returns.
pub(crate) type Ending<'c> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), sqlx::Error>> + Send + 'c>>;

/// The connection of a claimed transaction: dereferences to the
/// connection the handler's statements run on. Owned by one request at a
/// time (the layer's [`Tx`](crate::Tx) hands it out under a lock); dropped
/// unfinished, it never returns its connection to the pool inside the
/// transaction.
pub struct Claimed<DB: Database> {
    /// `None` once ended or handed back.
    conn: Option<PoolConnection<DB>>,
    end: EndFn<DB>,
    /// The server's id of the transaction, where the store has one and the
    /// claim read it (PostgreSQL): what a lost `COMMIT` is asked about, and
    /// what proves at recording time that the transaction is still the one
    /// the claim began.
    #[cfg(feature = "postgres")]
    pub(crate) xid: Option<i64>,
}

impl<DB: Database> std::fmt::Debug for Claimed<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claimed").finish_non_exhaustive()
    }
}

/// Rolls back sqlx's transaction (the default [`EndFn`]; MySQL has its
/// own, which also puts back the claim's session changes).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn rollback<DB: Database>(conn: &mut PoolConnection<DB>) -> Ending<'_> {
    Box::pin(<DB::TransactionManager as TransactionManager>::rollback(
        &mut **conn,
    ))
}

impl<DB: Database> Claimed<DB> {
    /// Begins a transaction sqlx counts on `conn` with `sql` (a `BEGIN`,
    /// and whatever the backend runs with it in the same round trip). On an
    /// error the connection comes back with it, outside any transaction
    /// sqlx counts; the server may still be inside one the statement opened
    /// (its caller ends it, or closes the connection).
    pub(crate) async fn begin(
        mut conn: PoolConnection<DB>,
        sql: SqlStr,
        end: EndFn<DB>,
    ) -> Result<Self, (sqlx::Error, PoolConnection<DB>)> {
        // A future dropped while the statement is on the wire closes the
        // connection: it may be inside a transaction sqlx does not count.
        let begun = {
            let guard = CloseOnCancel::new(&mut conn);
            let begun =
                <DB::TransactionManager as TransactionManager>::begin(&mut **guard.0, Some(sql))
                    .await;
            guard.done();
            begun
        };
        match begun {
            Ok(()) => Ok(Self {
                conn: Some(conn),
                end,
                #[cfg(feature = "postgres")]
                xid: None,
            }),
            Err(e) => Err((e, conn)),
        }
    }

    /// Commits (sqlx's `COMMIT`). A future dropped while the `COMMIT` is on
    /// the wire, or a failed `COMMIT`, closes the connection: the server
    /// then ends the transaction itself, and nothing of it is pooled.
    pub(crate) async fn commit(mut self) -> Result<(), sqlx::Error> {
        let Some(mut conn) = self.conn.take() else {
            return Ok(());
        };
        let guard = CloseOnCancel::new(&mut conn);
        <DB::TransactionManager as TransactionManager>::commit(&mut **guard.0).await?;
        guard.done();
        Ok(())
    }

    /// The backend ended the transaction in a batch of its own (a `COMMIT`
    /// riding with the recording): sqlx's count goes back to zero, its
    /// `ROLLBACK` of nothing queued for the connection's next use (sent
    /// when the pool checks the connection back in, off the request's
    /// path).
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn ended_by_batch(mut self) {
        if let Some(mut conn) = self.conn.take() {
            <DB::TransactionManager as TransactionManager>::start_rollback(&mut *conn);
        }
    }

    /// A connection in a state nobody can vouch for (a failed batch, a
    /// handler that ended the transaction itself): closed, so the server
    /// rolls back whatever is open and nothing of it reaches the pool.
    pub(crate) fn discard(mut self) {
        if let Some(mut conn) = self.conn.take() {
            conn.close_on_drop();
        }
    }

    /// Rolls the transaction back (and puts back what the backend changed
    /// for it) and waits for it; a connection whose rollback fails is
    /// closed.
    pub(crate) async fn rollback(mut self) {
        if let Some(conn) = self.conn.take() {
            // A task of its own: a caller dropped while the rollback waits
            // (say, behind a statement the handler abandoned) never returns
            // the connection to the pool inside the transaction.
            let _ = tokio::spawn(end_within(conn, self.end)).await;
        }
    }
}

#[cfg(feature = "mysql")]
impl Claimed<sqlx::MySql> {
    /// As [`ended_by_batch`](Self::ended_by_batch), then sends sqlx's
    /// queued `ROLLBACK` at once, followed by `sql` (which puts right what
    /// that `ROLLBACK` did to the session), within [`ROLLBACK_WAIT`]; a
    /// connection where either fails or the wait runs out is closed.
    pub(crate) async fn ended_by_batch_then(mut self, sql: &'static str) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        <sqlx::mysql::MySqlTransactionManager as TransactionManager>::start_rollback(&mut *conn);
        let guard = CloseOnCancel::new(&mut conn);
        let done =
            tokio::time::timeout(ROLLBACK_WAIT, sqlx::raw_sql(sql).execute(&mut **guard.0)).await;
        if matches!(done, Ok(Ok(_))) {
            guard.done();
        }
    }
}

#[cfg(feature = "postgres")]
impl Claimed<sqlx::Postgres> {
    /// Runs `sql`, a batch that ends the transaction and begins the next
    /// one on the same connection (sqlx's count is one before and after),
    /// in one round trip. A batch that fails or is dropped midway leaves
    /// the connection in a state nobody can vouch for: on an error the
    /// caller discards it, and a dropped future closes it.
    pub(crate) async fn begin_again(&mut self, sql: SqlStr) -> Result<(), sqlx::Error> {
        let Some(conn) = self.conn.as_mut() else {
            return Err(sqlx::Error::PoolClosed);
        };
        let guard = CloseOnCancel::new(conn);
        sqlx::raw_sql(sql).execute(&mut **guard.0).await?;
        guard.done();
        Ok(())
    }
}

/// Ends `conn`'s transaction with `end` within [`ROLLBACK_WAIT`], or
/// closes the connection (the server then rolls back).
async fn end_within<DB: Database>(mut conn: PoolConnection<DB>, end: EndFn<DB>) {
    let done = tokio::time::timeout(ROLLBACK_WAIT, end(&mut conn)).await;
    if !matches!(done, Ok(Ok(()))) {
        conn.close_on_drop();
    }
}

/// Closes a connection when it goes, unless the statement it is held for
/// finished: a future dropped (or a statement failed) while the server
/// may be inside a transaction sqlx does not count never pools it.
pub(crate) struct CloseOnCancel<'c, DB: Database>(pub(crate) &'c mut PoolConnection<DB>, bool);

impl<'c, DB: Database> CloseOnCancel<'c, DB> {
    pub(crate) fn new(conn: &'c mut PoolConnection<DB>) -> Self {
        Self(conn, false)
    }

    /// The statement finished: the connection is kept.
    pub(crate) fn done(mut self) {
        self.1 = true;
    }
}

impl<DB: Database> Drop for CloseOnCancel<'_, DB> {
    fn drop(&mut self) {
        if !self.1 {
            self.0.close_on_drop();
        }
    }
}

impl<DB: Database> Drop for Claimed<DB> {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        // Abandoned (a panic, a dropped future, a handle kept past the
        // answer): rolled back off the request's path, or closed.
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(end_within(conn, self.end))),
            Err(_) => conn.close_on_drop(),
        }
    }
}

impl<DB: Database> Deref for Claimed<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        match &self.conn {
            Some(conn) => conn,
            None => unreachable!("a Claimed is never used after it ended"),
        }
    }
}

impl<DB: Database> DerefMut for Claimed<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        match &mut self.conn {
            Some(conn) => conn,
            None => unreachable!("a Claimed is never used after it ended"),
        }
    }
}
