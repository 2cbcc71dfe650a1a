//! The claimed transaction, handed to the handler.
//!
//! The layer begins a transaction, claims the idempotency key in it, and puts
//! a [`Tx`] handle in the request extensions. The handler does its business
//! writes on that same transaction, so the writes and the ledger row commit
//! together or not at all. The layer commits or rolls back after the handler
//! returns; the handler never does.
//!
//! # Caveats
//!
//! - Lock the handle, do the work, and drop the guard before returning. A
//!   guard (or the handle) still held when the response is ready means the
//!   layer cannot finish the transaction: it answers `500` and nothing is
//!   committed. Locking is never a wait: a handle that is already locked, or
//!   whose transaction the layer has already taken back, is an error.
//! - Do not spawn tasks that outlive the handler with the handle.
//! - Nested transactions are savepoints. The claimed transaction is a
//!   transaction sqlx counts, on every store: `begin()` on the guard's
//!   connection (or any library's "run this in a transaction" helper given
//!   it) takes a savepoint; its `commit()` releases it, its `rollback()` or
//!   drop rolls back to it. The claim, and what holds the scope against a
//!   concurrent duplicate, survive all of them; only what the handler's
//!   outermost work leaves stands when the layer commits.
//! - Never send a `COMMIT` or `ROLLBACK` statement yourself (or, on
//!   MySQL/MariaDB, DDL, which commits implicitly). The layer notices it at
//!   no extra round trip, answers `500` `#transaction-ended` and holds the
//!   key for reconciliation, keeping what the handler committed; on
//!   PostgreSQL the scope is unprotected from that statement until the key
//!   is held.
//! - On MySQL/MariaDB the claimed transaction runs with `autocommit` off
//!   (turned back on before the connection returns to the pool), so that
//!   once the server rolls it back on its own (a deadlock, or on Galera a
//!   certification conflict), nothing the handler sends afterwards commits
//!   by itself: the layer rolls it back and answers with the winner's
//!   recorded answer or a retryable `503`. A handler that sends `ROLLBACK`
//!   and then commits writes of its own cannot be told from such a
//!   rollback: those writes stay without a ledger row.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use sqlx::Database;
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};

use crate::store::Claimed;

type Slot<DB> = Arc<Mutex<Option<Claimed<DB>>>>;

/// A handle to the transaction that holds this request's idempotency claim.
/// Cheap to clone.
///
/// In axum, take it as a handler argument (`tx: Tx<Postgres>`); that needs
/// the crate's `axum` feature (on by default). Without it, axum's error is
/// only `Handler<_, _> is not satisfied`, naming no feature. Under plain
/// tower, hyper or tonic (no feature needed), the handler finds it in the
/// request's extensions: `req.extensions().get::<Tx<DB>>()`.
pub struct Tx<DB: Database> {
    slot: Slot<DB>,
}

impl<DB: Database> Clone for Tx<DB> {
    fn clone(&self) -> Self {
        Self {
            slot: Arc::clone(&self.slot),
        }
    }
}

impl<DB: Database> std::fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx").finish_non_exhaustive()
    }
}

impl<DB: Database> Tx<DB> {
    pub(crate) fn new(tx: Claimed<DB>) -> Self {
        Self {
            slot: Arc::new(Mutex::new(Some(tx))),
        }
    }

    /// Locks the transaction for use. The guard dereferences to the
    /// connection: `sqlx::query(…).execute(&mut *guard)`.
    ///
    /// Never waits: fails with [`TxError::Busy`] when another guard is alive
    /// and [`TxError::Finished`] once the layer has taken the transaction back.
    pub fn lock(&self) -> Result<TxGuard<DB>, TxError> {
        let guard = Arc::clone(&self.slot)
            .try_lock_owned()
            .map_err(|_| TxError::Busy)?;
        OwnedMutexGuard::try_map(guard, Option::as_mut)
            .map(|guard| TxGuard { guard })
            .map_err(|_| TxError::Finished)
    }

    /// Takes the transaction back; `None` if a guard is still alive or it was
    /// already taken.
    pub(crate) fn take(&self) -> Option<Claimed<DB>> {
        self.slot.try_lock().ok()?.take()
    }
}

/// Exclusive use of the claimed transaction; see [`Tx::lock`].
pub struct TxGuard<DB: Database> {
    guard: OwnedMappedMutexGuard<Option<Claimed<DB>>, Claimed<DB>>,
}

impl<DB: Database> std::fmt::Debug for TxGuard<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxGuard").finish_non_exhaustive()
    }
}

impl<DB: Database> Deref for TxGuard<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.guard
    }
}

impl<DB: Database> DerefMut for TxGuard<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.guard
    }
}

/// Why the claimed transaction could not be locked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TxError {
    /// No [`Tx`] in the request extensions: the route is not behind
    /// `IdempotencyLayer`, or the method is not guarded.
    Missing,
    /// Another guard of the same transaction is alive.
    Busy,
    /// The layer has already committed or rolled back the transaction.
    Finished,
}

impl std::fmt::Display for TxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Missing => {
                "no idempotency transaction in the request: is IdempotencyLayer enabled for this route and method?"
            }
            Self::Busy => "the idempotency transaction is already locked by another guard",
            Self::Finished => "the idempotency transaction has already been finished by the layer",
        })
    }
}

impl std::error::Error for TxError {}

#[cfg(feature = "axum")]
mod axum_impl {
    use super::{Tx, TxError};
    use axum::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum::response::{IntoResponse, Response};
    use http::StatusCode;
    use http::request::Parts;

    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    impl<S, DB> FromRequestParts<S> for Tx<DB>
    where
        S: Send + Sync,
        DB: sqlx::Database,
    {
        type Rejection = TxError;

        async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, TxError> {
            parts
                .extensions
                .get::<Tx<DB>>()
                .cloned()
                .ok_or(TxError::Missing)
        }
    }

    /// `Option<Tx<DB>>`: `None` where the layer did not claim (an unguarded
    /// method, or no key with keys optional), so one handler can serve both.
    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    impl<S, DB> OptionalFromRequestParts<S> for Tx<DB>
    where
        S: Send + Sync,
        DB: sqlx::Database,
    {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<Tx<DB>>().cloned())
        }
    }

    /// Answers `500` with the reason as plain text: each case is a server
    /// misconfiguration or bug, never the client's fault.
    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    impl IntoResponse for TxError {
        fn into_response(self) -> Response {
            (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
        }
    }
}
