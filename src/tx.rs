//! The claimed transaction, handed to the handler: [`Tx`], its guard and
//! its error. The rules a handler follows are on [`Tx`] itself.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use sqlx::Database;
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};

use crate::store::Claimed;

type Slot<DB> = Arc<Mutex<Option<Claimed<DB>>>>;

/// A handle to the transaction that holds this request's idempotency claim.
/// Cheap to clone.
///
/// The layer begins a transaction, claims the request's key in it, and puts
/// a `Tx` in the request's extensions (with axum, take it as an extractor;
/// with any tower service, `req.extensions().get::<Tx<DB>>()`). The handler
/// writes on that same transaction, so its business rows and the ledger row
/// commit together or not at all. The layer commits or rolls back after the
/// handler has answered; the handler never does.
///
/// Taking it as an axum handler argument (`tx: Tx<Postgres>`) needs the
/// crate's `axum` feature (on by default): without it, axum's error is only
/// `Handler<_, _> is not satisfied`, naming no feature. Under plain tower,
/// hyper or tonic no feature is needed.
///
/// # Rules
///
/// - **Lock, work, drop the guard before returning.** [`Tx::lock`] gives a
///   [`TxGuard`] that dereferences to the connection (`&mut *guard` is an
///   sqlx executor). A guard or handle still held when the answer is ready
///   (moved into the response, kept in a static) means the layer cannot
///   finish the transaction: it answers `500` `#transaction-held` and
///   nothing commits. A guard local to the handler drops when it returns.
///   Locking never waits: a second live guard is [`TxError::Busy`], a lock
///   after the layer took the transaction back is [`TxError::Finished`].
/// - **Never `COMMIT` or `ROLLBACK` it yourself** (nor, on MySQL/MariaDB,
///   run DDL, which commits implicitly). The layer notices it at no extra
///   round trip, answers `500` `#transaction-ended` and holds the key for
///   reconciliation ([`Reconciler`](crate::Reconciler)), keeping what the
///   handler committed; on PostgreSQL the scope is unprotected from that
///   statement until the key is held.
/// - **Do not spawn tasks with it** that outlive the handler: their writes
///   would land after the layer decided, or not at all.
/// - **A nested `begin()` is a savepoint.** The claimed transaction is one
///   sqlx counts, on every store: `begin()` on the guard's connection (or
///   any library's "run this in a transaction" helper given it) takes a
///   savepoint; its `commit()` releases it, its `rollback()` or drop rolls
///   back to it. The claim, and what holds the scope against a concurrent
///   duplicate, survive all of them; only what the handler's outermost work
///   leaves stands when the layer commits.
/// - On MySQL/MariaDB the claimed transaction runs with `autocommit` off
///   (turned back on before the connection returns to the pool), so that
///   once the server rolls it back on its own (a deadlock, or on Galera a
///   certification conflict), nothing the handler sends afterwards commits
///   by itself: the layer rolls it back and answers with the winner's
///   recorded answer or a retryable `503`. A handler that sends `ROLLBACK`
///   and then commits writes of its own cannot be told from such a
///   rollback: those writes stay without a ledger row.
///
/// # Errors
///
/// With axum, a handler returns `Result<_, `[`HandlerError`](crate::HandlerError)`>`
/// and uses `?` on both [`TxError`] and `sqlx::Error`: each becomes a
/// problem+json answer (a transient database error a retryable `503`, any
/// other a `500` whose text is logged, never sent). A handler asked for a
/// `Tx` on a route the layer does not cover is answered `500`
/// `#transaction-missing`; take `Option<Tx<DB>>` where a route serves both.
///
/// # Example
///
/// ```no_run
/// use axum::{Json, Router, http::StatusCode, routing::post};
/// use serde_json::{Value, json};
/// use sqlx::Postgres;
/// use tower_idempotency::{HandlerError, IdempotencyLayer, Tx};
///
/// async fn create_order(
///     tx: Tx<Postgres>,
///     Json(order): Json<Value>,
/// ) -> Result<(StatusCode, Json<Value>), HandlerError> {
///     let mut conn = tx.lock()?; // TxError -> HandlerError
///     let id: i64 = sqlx::query_scalar("INSERT INTO orders (amount) VALUES ($1) RETURNING id")
///         .bind(order["amount"].as_i64())
///         .fetch_one(&mut *conn)
///         .await?; // sqlx::Error -> HandlerError
///     Ok((StatusCode::CREATED, Json(json!({ "orderId": id }))))
///     // `conn` drops here, before the layer records the answer.
/// }
///
/// # async fn app() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/test").await?;
/// tower_idempotency::migrate(&pool).await?;
/// // Routes first, then the layer: a route added after `.layer(…)` is not covered.
/// let app: Router = Router::new()
///     .route("/orders", post(create_order))
///     .layer(IdempotencyLayer::new(pool));
/// # let _ = app;
/// # Ok(())
/// # }
/// ```
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

/// Exclusive use of the claimed transaction; see [`Tx::lock`]. It
/// dereferences to the connection (`&mut *guard` is an executor), and
/// must be dropped before the handler returns its response.
///
/// ```no_run
/// # #[cfg(all(feature = "sqlite", feature = "axum"))]
/// # async fn handler(tx: tower_idempotency::Tx<sqlx::Sqlite>) -> Result<(), tower_idempotency::HandlerError> {
/// let mut guard = tx.lock()?;
/// sqlx::query("INSERT INTO orders (sku) VALUES ('A-10')")
///     .execute(&mut *guard)
///     .await?;
/// drop(guard); // or let it go out of scope before the answer is returned
/// # Ok(())
/// # }
/// ```
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
impl TxError {
    /// The problem answer for this error.
    pub(crate) fn problem(self) -> crate::problem::Problem {
        use crate::problem::{Problem, ProblemKind};
        let kind = match self {
            Self::Missing => ProblemKind::TransactionMissing,
            Self::Busy => ProblemKind::TransactionBusy,
            Self::Finished => ProblemKind::TransactionFinished,
        };
        Problem::new(kind, self.to_string())
    }
}

#[cfg(feature = "axum")]
mod axum_impl {
    use super::{Tx, TxError};
    use axum::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum::response::{IntoResponse, Response};
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

    /// Answers `500` problem+json (`#transaction-missing`,
    /// `#transaction-busy`, `#transaction-finished`, not retryable): each
    /// case is a server misconfiguration or bug, never the client's fault.
    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    impl IntoResponse for TxError {
        fn into_response(self) -> Response {
            self.problem().into_axum()
        }
    }
}
