//! The other boundary: at-least-once message consumers on the same ledger.
//!
//! A broker delivers at least once: the same message can arrive again after
//! a crash, a lost acknowledgement or an acknowledgement timeout. A
//! [`Consumer`] runs the handler on a transaction in which the message id is
//! claimed under the unique `(subscriber, message id)`, in the **same ledger
//! table and migrations** as the HTTP layer (the subscriber is the scope's
//! principal, the operation is [`MESSAGE_OPERATION`]). The processed-message
//! row commits together with the handler's business writes or not at all:
//!
//! - **first delivery**: the handler runs; on `Ok` its writes and the
//!   message's row commit together, [`Processed::Applied`]; acknowledge the
//!   message *after* this returns.
//! - **a duplicate delivery** of a committed message: the handler does not
//!   run, [`Processed::Duplicate`]; acknowledge it.
//! - **the handler fails** (`Err`, or a panic): both roll back,
//!   [`ConsumeError::Handler`]; do not acknowledge, so the redelivery runs it
//!   again. The message is never marked processed before its effect commits
//!   (the trap of marking first, where a failed message's redelivery is
//!   dropped).
//! - **concurrent deliveries of one id** (two consumers, a redelivery while
//!   the first is still running): the unique constraint decides. The second
//!   delivery's claim waits on the first's uncommitted row (bounded by
//!   [`with_lock_wait`](Consumer::with_lock_wait), then
//!   [`ConsumeError::InFlight`]); when the first commits it is a duplicate,
//!   when the first rolls back it runs. So two runs of one id never overlap,
//!   and a handler runs again only after an earlier run of the id rolled
//!   back: the effect on the database happens exactly once per committed
//!   delivery. An effect *outside* the transaction (a call to another
//!   service) can still repeat after a rollback: keep those out of handlers,
//!   or use lease mode's steps.
//! - **the same id with a different payload** (a producer bug): with the
//!   payload check on (the default), the payload's fingerprint (canonical
//!   JSON when it is JSON, the bytes otherwise) is stored with the id, and a
//!   mismatch is [`ConsumeError::PayloadMismatch`]: logged at error level,
//!   counted (`idempotency_messages_total{outcome="payload_mismatch"}` with
//!   the `metrics` feature), never applied and never silently dropped.
//! - **an id the ledger cannot hold** (empty, or with a NUL, which
//!   PostgreSQL's `TEXT` refuses): [`ConsumeError::InvalidId`] at once, on
//!   every store alike, before anything runs or is stored. No redelivery
//!   can fix it ([`ConsumeError::redeliver`] is `false`): record it as
//!   poison under an encoding your own tables hold, and acknowledge it.
//!   Ids longer than 255 bytes are stored as their SHA-256, like long HTTP
//!   scope values, and stay distinct.
//!
//! # Poison: only repeated handler failures
//!
//! A message that fails the same way on every delivery would be redelivered
//! forever, so consumers give up on it after a few tries (record it, then
//! acknowledge it). Only the handler's own failures may count
//! ([`ConsumeError::is_handler_failure`]): [`ConsumeError::InFlight`] (an
//! earlier delivery's transaction still holds the id: a frozen or
//! partitioned process whose transaction may yet roll back) and
//! [`ConsumeError::Store`] mean the message was not applied and may yet
//! be. Acknowledging them would drop a message that was never applied:
//! redeliver them however often, with a growing delay.
//!
//! # Consumer scopes and HTTP scopes never meet
//!
//! Processed-message rows share the ledger with HTTP requests, so the two
//! must never claim each other's rows, whatever a route or an operation
//! is named. The operation [`MESSAGE_OPERATION`] (`message`) is reserved
//! for consumers: the layer's default operation is always a method and a
//! path (`POST /message`, never `message`), and a name given to
//! [`IdempotencyLayer::with_operation`](crate::IdempotencyLayer::with_operation)
//! (or a completer's [`resume`](crate::lease::Completer::resume)) that is
//! exactly `message` is stored as its `sha256:` form, as long names are
//! (see the scope rules on [`Principal`](crate::Principal)). One function
//! maps every HTTP operation name to its stored form, so no HTTP row ever
//! has the operation `message`, and an HTTP request of principal `stock`
//! with key `evt-1` never makes consumer `stock`'s message `evt-1` a
//! duplicate or a mismatch (nor the other way round).
//!
//! # Retention
//!
//! Processed-message rows are kept for [`with_retention`] (7 days by
//! default): choose it longer than the broker can redeliver a message
//! (JetStream's `max_age` or redelivery limits, a producer's outbox retry
//! window). The [`Sweeper`](crate::Sweeper) turns them into tombstones and
//! purges the tombstones much later, as for HTTP records; a tombstoned id is
//! still a duplicate.
//!
//! # Example
//!
//! ```
//! use sqlx::{Sqlite, sqlite::SqlitePoolOptions};
//! use tower_idempotency::consumer::{Consumer, Processed};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let pool = SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await?;
//! tower_idempotency::migrate(&pool).await?;
//! sqlx::raw_sql("CREATE TABLE stock (sku TEXT PRIMARY KEY, qty INTEGER);
//!                INSERT INTO stock VALUES ('sku-1', 10)")
//!     .execute(&pool)
//!     .await?;
//! let consumer = Consumer::new(pool.clone(), "stock");
//! let payload = br#"{"orderId":"o-1","sku":"sku-1","qty":2}"#;
//! for _delivery in 0..2 {
//!     let done = consumer
//!         .process("evt-1", payload, |tx| async move {
//!             let mut conn = tx.lock()?;
//!             sqlx::query("UPDATE stock SET qty = qty - 2 WHERE sku = 'sku-1'")
//!                 .execute(&mut *conn)
//!                 .await?;
//!             Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
//!         })
//!         .await?;
//!     // Acknowledge the message here, after the commit.
//!     let _ = matches!(done, Processed::Applied(()) | Processed::Duplicate);
//! }
//! let qty: i64 = sqlx::query_scalar("SELECT qty FROM stock").fetch_one(&pool).await?;
//! assert_eq!(qty, 8);
//! # Ok(())
//! # }
//! ```
//!
//! [`with_retention`]: Consumer::with_retention

use std::future::Future;
use std::panic::resume_unwind;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::Pool;
use tokio::time::Instant;

use crate::expiry::{is_expired, retention_ms};
use crate::fingerprint::canonical_json;
use crate::observe;
use crate::scope::bounded;
use crate::service::CatchUnwind;
use crate::store::{
    Backend, Claim, ClaimOutcome, Claimed, Completion, FinishError, IsolationLevel, Record,
    RecordStatus, Scope, StoreErrorKind, spawn_claim,
};
use crate::tx::Tx;

pub use crate::scope::MESSAGE_OPERATION;

/// What became of a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed<T> {
    /// The handler ran and its writes committed with the message's row.
    Applied(T),
    /// The message was processed before: the handler did not run.
    Duplicate,
}

/// Why a delivery was not processed. Except for
/// [`PayloadMismatch`](Self::PayloadMismatch) and
/// [`InvalidId`](Self::InvalidId), nothing was committed and the message
/// should be redelivered (not acknowledged).
#[derive(Debug)]
#[non_exhaustive]
pub enum ConsumeError<E> {
    /// The handler failed: its writes were rolled back.
    Handler(E),
    /// The inner service of a [`ConsumeService`] was not ready (its
    /// `poll_ready` failed): no handler ran and nothing was claimed.
    /// Redeliver; it never counts towards poison.
    NotReady(E),
    /// The id was processed before with a different payload: a producer
    /// bug. Nothing was applied; redelivery cannot fix it (decide, then
    /// acknowledge or dead-letter it).
    PayloadMismatch {
        /// The message id.
        message_id: String,
    },
    /// The message id is one the ledger cannot hold on every store: empty,
    /// or with a NUL character. Nothing ran and nothing was stored; no
    /// redelivery fixes it.
    InvalidId,
    /// Another delivery of the id held it past the lock wait: retry later.
    InFlight,
    /// The id's row is awaiting reconciliation (a handler ended the
    /// transaction itself): retry after an operator resolved it.
    Unresolved,
    /// The handler kept the transaction handle past its return: rolled back.
    TransactionHeld,
    /// The store failed. When the connection was lost during `COMMIT`, the
    /// outcome is unknown: the redelivery finds out (a duplicate if it
    /// committed).
    Store(sqlx::Error),
}

impl<E> ConsumeError<E> {
    /// Whether a redelivery can succeed: `true` when nothing was committed
    /// and the cause may pass (leave the message unacknowledged, or nak
    /// it); `false` for [`PayloadMismatch`](Self::PayloadMismatch) and
    /// [`InvalidId`](Self::InvalidId), which no redelivery fixes (record
    /// the message as poison or dead-letter it, then acknowledge it). A
    /// variant added later says which it is here, so a catch-all arm on
    /// this method never retries forever by mistake.
    pub fn redeliver(&self) -> bool {
        !matches!(self, Self::PayloadMismatch { .. } | Self::InvalidId)
    }

    /// Whether the handler itself failed ([`Handler`](Self::Handler), or
    /// [`TransactionHeld`](Self::TransactionHeld): nothing of it is
    /// committed by the layer, though a held transaction stays open until
    /// the handle the handler kept is dropped): a failure that repeats
    /// delivery after delivery may be given up on as poison. `false` for everything else, in particular
    /// [`InFlight`](Self::InFlight), [`Store`](Self::Store) and
    /// [`NotReady`](Self::NotReady) (no handler ran): the message
    /// was not applied and may yet be, so it must be redelivered however
    /// often (with backoff), never counted towards poison. (A handler
    /// error that wraps a transient store error is the handler's to tell
    /// apart; [`Backend::error_kind`] sorts `sqlx` errors.)
    pub fn is_handler_failure(&self) -> bool {
        matches!(self, Self::Handler(_) | Self::TransactionHeld)
    }
}

impl<E: std::fmt::Display> std::fmt::Display for ConsumeError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Handler(e) => write!(f, "the handler failed: {e}"),
            Self::NotReady(e) => write!(f, "the handler's service was not ready: {e}"),
            Self::PayloadMismatch { message_id } => write!(
                f,
                "message {message_id:?} was processed before with a different payload"
            ),
            Self::InvalidId => f.write_str("the message id is empty or contains NUL"),
            Self::InFlight => f.write_str("another delivery of this message is in progress"),
            Self::Unresolved => f.write_str("the message's record awaits reconciliation"),
            Self::TransactionHeld => f.write_str("the handler kept the transaction"),
            Self::Store(e) => write!(f, "ledger: {e}"),
        }
    }
}

impl<E: std::fmt::Debug + std::fmt::Display> std::error::Error for ConsumeError<E> {}

/// Runs message handlers at most once per `(subscriber, message id)`; see
/// the [module docs](self). Cheap to clone.
pub struct Consumer<DB: Backend> {
    pool: Pool<DB>,
    subscriber: String,
    retention: Duration,
    lock_wait: Duration,
    check_payload: bool,
    isolation: IsolationLevel,
    cached_statements: bool,
    /// See [`Backend::database`].
    database: Option<Arc<str>>,
}

impl<DB: Backend> Clone for Consumer<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            subscriber: self.subscriber.clone(),
            database: self.database.clone(),
            ..*self
        }
    }
}

impl<DB: Backend> std::fmt::Debug for Consumer<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("subscriber", &self.subscriber)
            .field("retention", &self.retention)
            .field("lock_wait", &self.lock_wait)
            .field("check_payload", &self.check_payload)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Consumer<DB> {
    /// A consumer for `subscriber` (the name of the consuming service or
    /// durable subscription: ids are unique per subscriber), keeping
    /// processed ids 7 days, waiting at most 10 s on a concurrent delivery,
    /// checking payloads.
    pub fn new(pool: Pool<DB>, subscriber: impl Into<String>) -> Self {
        Self {
            cached_statements: crate::store::caches_statements(&pool),
            database: DB::database(&pool),
            pool,
            subscriber: bounded(&subscriber.into()).into_owned(),
            retention: Duration::from_secs(7 * 24 * 3600),
            lock_wait: Duration::from_secs(10),
            check_payload: true,
            isolation: IsolationLevel::default(),
        }
    }

    /// How long a processed id is remembered (default 7 days, at least
    /// 1 ms, at most 10 000 years: a longer one is that, "forever").
    #[must_use]
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention.max(Duration::from_millis(1));
        self
    }

    /// The longest wait on a concurrent delivery of the same id (default
    /// 10 s, at most an hour), after which [`ConsumeError::InFlight`].
    #[must_use]
    pub fn with_lock_wait(mut self, wait: Duration) -> Self {
        self.lock_wait = wait.clamp(Duration::from_millis(1), Duration::from_secs(3600));
        self
    }

    /// Whether a payload is fingerprinted and compared under its id
    /// (default `true`). Choose once per subscriber: ids recorded with the
    /// other setting compare as mismatches (turning the check on) or skip
    /// the comparison (turning it off) until their retention ends.
    #[must_use]
    pub fn with_payload_check(mut self, check: bool) -> Self {
        self.check_payload = check;
        self
    }

    /// The isolation level of the handler's transaction (default
    /// `READ COMMITTED`).
    #[must_use]
    pub fn with_isolation_level(mut self, level: IsolationLevel) -> Self {
        self.isolation = level;
        self
    }

    /// Processes one delivery of `message_id` with `payload`: runs
    /// `handler` on the transaction that claims the id, unless the id was
    /// processed before. The handler writes through the [`Tx`] handle
    /// (lock it, write, drop the guard) and must not commit or roll back
    /// itself. An id the ledger cannot hold on every store (empty, or with
    /// a NUL) is [`ConsumeError::InvalidId`] before anything runs.
    pub async fn process<T, E, F, Fut>(
        &self,
        message_id: &str,
        payload: &[u8],
        handler: F,
    ) -> Result<Processed<T>, ConsumeError<E>>
    where
        F: FnOnce(Tx<DB>) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        if !storable_id(message_id) {
            return Err(ConsumeError::InvalidId);
        }
        let key = bounded(message_id);
        let scope = Scope {
            principal: &self.subscriber,
            operation: MESSAGE_OPERATION,
            key: &key,
        };
        let fingerprint = self.fingerprint(payload);
        let deadline = Instant::now() + self.lock_wait;
        let tx = loop {
            let found = match self.claim(&scope, &fingerprint, deadline).await? {
                Ok(tx) => break tx,
                // The row the claim met, read on its way (PostgreSQL).
                Err(Some(record)) => Some(*record),
                Err(None) => DB::fetch(&self.pool, &scope)
                    .await
                    .map_err(ConsumeError::Store)?,
            };
            match found {
                Some(record) if record.fingerprint != fingerprint => {
                    tracing::error!(
                        subscriber = %self.subscriber,
                        message_id,
                        "a message id was delivered again with a different payload; not applied"
                    );
                    observe::message("payload_mismatch");
                    return Err(ConsumeError::PayloadMismatch {
                        message_id: message_id.to_owned(),
                    });
                }
                Some(record) if record.status.is_terminal() || is_expired(&record) => {
                    observe::message("duplicate");
                    return Ok(Processed::Duplicate);
                }
                Some(_) => return Err(ConsumeError::Unresolved),
                // Gone between the claim and the read (swept): claim again.
                None if Instant::now() < deadline => continue,
                None => return Err(ConsumeError::InFlight),
            }
        };
        let handle = Tx::new(tx);
        let ran = CatchUnwind {
            inner: handler(handle.clone()),
        }
        .await;
        let tx = handle.take();
        drop(handle);
        let value = match ran {
            Err(panic) => {
                rollback(tx).await;
                resume_unwind(panic);
            }
            Ok(Err(e)) => {
                rollback(tx).await;
                observe::message("handler_error");
                return Err(ConsumeError::Handler(e));
            }
            Ok(Ok(value)) => value,
        };
        let Some(tx) = tx else {
            return Err(ConsumeError::TransactionHeld);
        };
        let done = Completion {
            status: RecordStatus::Succeeded,
            response_status: 200,
            response_headers: b"",
            response_body: b"",
            resource_id: None,
        };
        let claim = Claim {
            scope,
            fingerprint: &fingerprint,
            retention_ms: retention_ms(self.retention),
            lock_wait: Duration::ZERO,
            isolation: self.isolation,
            cached_statements: self.cached_statements,
            database: self.database.as_deref(),
            causal_wait: true,
        };
        match DB::finish(&self.pool, tx, &claim, &done).await {
            Ok(_) => {
                observe::message("applied");
                Ok(Processed::Applied(value))
            }
            Err(FinishError::Ended(e)) => Err(self.ended(&claim, e).await),
            Err(FinishError::Store(e))
                if DB::error_kind(&e) == StoreErrorKind::TransactionEnded =>
            {
                Err(self.ended(&claim, e).await)
            }
            Err(e) => Err(ConsumeError::Store(e.into_inner())),
        }
    }

    /// The claimed transaction was found ended (`e`), not by the consumer:
    /// the handler ended it itself, and what it committed stays, so the id
    /// is held for an operator ([`ConsumeError::Unresolved`]). Where claims
    /// run without autocommit and the claim's row never committed, the
    /// server rolled everything back instead (a deadlock, a Galera abort):
    /// nothing was applied, and a redelivery runs it.
    async fn ended<E>(&self, claim: &Claim<'_>, e: sqlx::Error) -> ConsumeError<E> {
        if DB::CLAIMS_RUN_WITHOUT_AUTOCOMMIT {
            match DB::fetch(&self.pool, &claim.scope).await {
                Ok(Some(record))
                    if record.status == RecordStatus::Processing
                        && record.fingerprint == claim.fingerprint => {}
                // A read that fails proves nothing: the redelivery finds out.
                Ok(_) => return ConsumeError::Store(e),
                Err(read) => return ConsumeError::Store(read),
            }
        }
        let marked = DB::mark_unresolved(&self.pool, claim, 200).await;
        tracing::error!(
            subscriber = %self.subscriber,
            marked = marked.is_ok(),
            "a message handler ended the claimed transaction itself; what it committed is kept and the id needs reconciliation"
        );
        observe::message("unresolved");
        ConsumeError::Unresolved
    }

    /// One claim of the id, waiting on a concurrent delivery at most until
    /// `deadline`: the claimed transaction, or `Err` when a committed row
    /// holds the id (with that row, when the claim read it).
    async fn claim<E>(
        &self,
        scope: &Scope<'_>,
        fingerprint: &[u8; 32],
        deadline: Instant,
    ) -> Result<Result<Claimed<DB>, Option<Box<Record>>>, ConsumeError<E>> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let conn = match tokio::time::timeout(left, crate::store::acquire(&self.pool)).await {
                Ok(conn) => conn.map_err(ConsumeError::Store)?,
                Err(_) => return Err(ConsumeError::InFlight),
            };
            let claim = Claim {
                scope: *scope,
                fingerprint,
                retention_ms: retention_ms(self.retention),
                lock_wait: left.max(Duration::from_millis(1)),
                isolation: self.isolation,
                cached_statements: self.cached_statements,
                database: self.database.as_deref(),
                causal_wait: true,
            };
            // The wait for the claim's task is bounded here, whatever the
            // store's own lock wait granularity (SQLite's busy timeout,
            // MySQL's whole seconds): a claim still waiting is left to
            // finish and roll back on its own.
            let claimed = match tokio::time::timeout(left, spawn_claim(conn, &claim, ())).await {
                Ok(claimed) => claimed,
                Err(_) => return Err(ConsumeError::InFlight),
            };
            match claimed {
                Ok(ClaimOutcome::Won(tx)) => return Ok(Ok(tx)),
                Ok(ClaimOutcome::Lost(record)) => return Ok(Err(record)),
                Ok(ClaimOutcome::InFlight) if Instant::now() + RETRY_PAUSE < deadline => {
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                Ok(ClaimOutcome::InFlight) => return Err(ConsumeError::InFlight),
                Err(e) => match DB::error_kind(&e) {
                    // A concurrent claim above READ COMMITTED: read it.
                    StoreErrorKind::Conflict => return Ok(Err(None)),
                    StoreErrorKind::LockTimeout | StoreErrorKind::Busy
                        if Instant::now() + RETRY_PAUSE < deadline =>
                    {
                        tokio::time::sleep(RETRY_PAUSE).await;
                    }
                    StoreErrorKind::LockTimeout | StoreErrorKind::Busy => {
                        return Err(ConsumeError::InFlight);
                    }
                    _ => return Err(ConsumeError::Store(e)),
                },
            }
        }
    }

    /// The payload's fingerprint: SHA-256 of its canonical JSON, or of its
    /// bytes when it is not JSON; all zeros with the check off.
    fn fingerprint(&self, payload: &[u8]) -> [u8; 32] {
        if !self.check_payload {
            return [0; 32];
        }
        let canonical = canonical_json(payload);
        let bytes = canonical.as_deref().unwrap_or(payload);
        Sha256::digest(bytes).into()
    }
}

/// One delivery, for [`ConsumeService`]: the message id (the producer's
/// event id, the dedupe key) and the payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The message id.
    pub id: String,
    /// The payload, byte for byte.
    pub payload: bytes::Bytes,
}

/// A tower [`Service`](tower_service::Service) over [`Message`]s: each call
/// is one [`Consumer::process`], the inner service called with the claimed
/// transaction and the message (only when the message is not a
/// duplicate). Made by [`Consumer::service`].
pub struct ConsumeService<DB: Backend, S> {
    consumer: Consumer<DB>,
    inner: S,
}

impl<DB: Backend, S: Clone> Clone for ConsumeService<DB, S> {
    fn clone(&self) -> Self {
        Self {
            consumer: self.consumer.clone(),
            inner: self.inner.clone(),
        }
    }
}

impl<DB: Backend, S> std::fmt::Debug for ConsumeService<DB, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumeService")
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Consumer<DB> {
    /// This consumer as a tower service over [`Message`]s, running `inner`
    /// (a service over `(Tx<DB>, Message)`) for each message not processed
    /// before.
    pub fn service<S>(self, inner: S) -> ConsumeService<DB, S> {
        ConsumeService {
            consumer: self,
            inner,
        }
    }
}

type BoxFuture<T> = std::pin::Pin<Box<dyn Future<Output = T> + Send>>;

impl<DB, S> tower_service::Service<Message> for ConsumeService<DB, S>
where
    DB: Backend,
    S: tower_service::Service<(Tx<DB>, Message)> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Processed<S::Response>;
    type Error = ConsumeError<S::Error>;
    type Future = BoxFuture<Result<Processed<S::Response>, ConsumeError<S::Error>>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(ConsumeError::NotReady)
    }

    fn call(&mut self, message: Message) -> Self::Future {
        // The service that was polled ready runs this message.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let consumer = self.consumer.clone();
        Box::pin(async move {
            let (id, payload) = (message.id.clone(), message.payload.clone());
            consumer
                .process(&id, &payload, move |tx| inner.call((tx, message)))
                .await
        })
    }
}

/// The pause before another claim of an id whose claim is in flight.
const RETRY_PAUSE: Duration = Duration::from_millis(20);

/// Whether every store can hold `message_id` in its key column: not
/// empty, and no NUL (PostgreSQL's `TEXT` refuses it; SQLite and MySQL
/// would take it, so it is refused everywhere alike). Length is no limit:
/// ids over 255 bytes are stored hashed.
fn storable_id(message_id: &str) -> bool {
    !message_id.is_empty() && !message_id.contains('\0')
}

/// Rolls the claimed transaction back and waits for it.
async fn rollback<DB: Backend>(tx: Option<Claimed<DB>>) {
    if let Some(tx) = tx {
        tx.rollback().await;
    }
}

#[cfg(test)]
mod tests {
    use super::ConsumeError;

    #[test]
    fn only_what_a_redelivery_can_fix_is_redelivered() {
        let fixed_by_redelivery: [ConsumeError<()>; 5] = [
            ConsumeError::Handler(()),
            ConsumeError::InFlight,
            ConsumeError::Unresolved,
            ConsumeError::TransactionHeld,
            ConsumeError::Store(sqlx::Error::PoolTimedOut),
        ];
        assert!(fixed_by_redelivery.iter().all(ConsumeError::redeliver));
        let never: [ConsumeError<()>; 2] = [
            ConsumeError::PayloadMismatch {
                message_id: "evt-1".into(),
            },
            ConsumeError::InvalidId,
        ];
        assert!(!never.iter().any(ConsumeError::redeliver));
        // Only the handler's own failures may become poison.
        assert!(ConsumeError::Handler(()).is_handler_failure());
        assert!(ConsumeError::<()>::TransactionHeld.is_handler_failure());
        for e in [
            ConsumeError::<()>::InFlight,
            ConsumeError::Store(sqlx::Error::PoolTimedOut),
            ConsumeError::Unresolved,
            ConsumeError::InvalidId,
        ] {
            assert!(!e.is_handler_failure(), "{e:?}");
        }
    }

    /// An inner service that is never ready (a dead `Buffer` worker, say):
    /// no message ran, so nothing may count towards poison.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_service_that_is_not_ready_ran_no_handler() {
        use std::task::{Context, Poll};
        #[derive(Clone)]
        struct Broken;
        impl tower_service::Service<(crate::Tx<sqlx::Sqlite>, super::Message)> for Broken {
            type Response = ();
            type Error = &'static str;
            type Future = std::future::Ready<Result<(), &'static str>>;
            fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
                Poll::Ready(Err("worker gone"))
            }
            fn call(&mut self, _: (crate::Tx<sqlx::Sqlite>, super::Message)) -> Self::Future {
                std::future::ready(Ok(()))
            }
        }
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .connect_lazy("sqlite::memory:")
            .expect("a lazy pool");
        let mut service = super::Consumer::new(pool, "stock").service(Broken);
        let ready =
            std::future::poll_fn(|cx| tower_service::Service::poll_ready(&mut service, cx)).await;
        let e = ready.expect_err("not ready");
        assert!(!e.is_handler_failure(), "{e:?}");
        assert!(e.redeliver(), "{e:?}");
    }

    #[test]
    fn ids_every_store_holds() {
        assert!(super::storable_id("evt-1"));
        assert!(super::storable_id(&"x".repeat(1000)));
        assert!(!super::storable_id(""));
        assert!(!super::storable_id("evt\0-1"));
    }
}
