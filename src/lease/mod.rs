//! Lease mode: idempotent handlers that call the outside world.
//!
//! One database transaction cannot cover a call to a payment provider: the
//! charge can succeed and the process die before the local commit. For such
//! a route, turn on lease mode ([`IdempotencyLayer::with_lease`]); the key,
//! scope, fingerprint, replay and problem answers stay those of the default
//! mode. What changes:
//!
//! - **Claim.** The ledger row commits at once as `PROCESSING`, with a lease
//!   (`locked_until`, on the database's clock), a claim id (the request's
//!   step seed and random bits, see [`StepKey`]) and a fencing
//!   `generation` (1). The handler gets a [`Leased`] context (an
//!   axum extractor, or the request extension) with the key, the
//!   generation, the last recovery point, the pending step and what was
//!   saved.
//! - **A fence names the claim.** Every write of an attempt names the
//!   claim id and its generation, in the statement of the write. A row
//!   deleted (a bare claim the completer removed), purged or expired and
//!   then claimed again has another claim id (its random part), so an owner of the earlier
//!   row is refused at its first write, though both rows start at
//!   generation 1.
//! - **Local phases.** [`Leased::phase`] opens a transaction for business
//!   writes; [`Phase::commit`] commits them together with the next recovery
//!   point (and optional JSON data), and only when the row is still at this
//!   attempt's generation: the fence is in the same transaction as the
//!   writes, in the statement that records the point. A refused phase
//!   commits nothing and answers [`LeaseError::Lost`].
//! - **External steps.** [`Leased::step`] runs one external call with a
//!   [`StepKey`] derived from the ledger row (principal, operation, key,
//!   step name): the same for every attempt and takeover, different for
//!   every step. Pass it to the provider as its idempotency key. The step
//!   notes itself pending (fenced) before the call, keeps the lease alive
//!   while the call runs, and saves the result as a recovery point. When a
//!   step was pending in an earlier attempt, `recover(step_key)` runs first:
//!   [`Recovered::Done`] finishes the step without calling again, only a
//!   proven [`Recovered::Absent`] allows `execute`, and
//!   [`Recovered::Unknown`] (or an error, or a timeout) parks the record as
//!   `NEEDS_RECONCILIATION`. A failed `execute` (an error or a timeout: the
//!   call may have landed) is followed by `recover` at once. A step without
//!   a look-up ([`Leased::step_without_lookup`]) can never prove what
//!   happened: its uncertain outcomes always go to reconciliation. An
//!   `execute` that fails with [`CallError::NotSent`] (connection refused,
//!   a name that did not resolve: the request provably never left) is no
//!   uncertainty: the step is no longer pending, nothing is looked up, and
//!   [`StepError::NotSent`] tells the handler to answer a 5xx, so the lease
//!   ends and the retry runs the step. Step names are used once per attempt
//!   (a second step of the same name is [`LeaseError::Misuse`], never the
//!   first one's result) and, like recovery points, hold at most
//!   [`MAX_NAME_LEN`] bytes with no control character and no leading `~`
//!   ([`LeaseError::InvalidName`], on every store alike).
//! - **Finish.** The handler's answer is recorded as in the default mode
//!   (status, allow-listed headers, body; `SUCCEEDED` or `FAILED_FINAL`),
//!   fenced, in one transaction with the writes of [`Leased::final_phase`].
//!   Unlike the default mode a final failure keeps those writes (earlier
//!   phases are committed already): mark the business row failed there.
//! - **Transient failures** (the handler answers 5xx, errors, panics, or its
//!   future is dropped) end the lease at once: the record stays at its last
//!   recovery point and the client's retry resumes it without waiting. A
//!   request the handler rejects (4xx such as 400 or 422) before any phase
//!   or step committed deletes the claim, as in the default mode; a
//!   rejection after one is recorded as `FAILED_FINAL` and replayed (what
//!   was committed stays, so the key never runs again with another request
//!   and is never resumed behind the client's back).
//! - **Nothing final over a pending step.** An answer of any kind (a
//!   success, a rejection, or the claim deleted) while a step that may
//!   have run was not recovered is refused: the record is parked for an
//!   operator. A resume function that finds [`Leased::pending_step`] runs
//!   that step (its `recover` runs first) or answers a transient failure.
//! - **One step at a time, outside phases.** A step begun while another
//!   runs, or inside an open phase (or after the final phase began), is
//!   refused with [`LeaseError::Misuse`]; a step begun while an earlier
//!   step's outcome is unknown parks the record. The name `~claim` in the
//!   saved data is reserved (the claim's id, whose seed is part of every
//!   step key).
//! - **Takeover.** A duplicate that finds a live lease waits (bounded by
//!   [`with_in_flight_wait`](crate::IdempotencyLayer::with_in_flight_wait)), then
//!   gets `409` + `Retry-After`. One that finds the lease lapsed takes the
//!   row over in one conditional update (generation + 1, a new lease) and
//!   resumes from the last recovery point; of concurrent takeovers exactly
//!   one wins. The earlier owner is refused on its next write (a phase, a
//!   step, the answer), never records an answer, and its client gets `409`
//!   `#lease-lost`; the retry gets the new owner's answer.
//! - **Reconciliation.** A parked record answers every retry with `503`
//!   `#reconciling` + `Retry-After` and is never executed again on its own.
//!   [`Reconciler`](crate::Reconciler) lists every record whose outcome is
//!   not settled (parked ones, and leases that lapsed with a step pending,
//!   whatever operations the completers serve) and resolves them: a
//!   verdict is recorded or fails with [`ResolveError`](crate::ResolveError)
//!   saying why (of two verdicts on one record exactly one wins). A
//!   [`Completer`] pass takes parked records over (`PROCESSING` again while
//!   it works, so retries meanwhile get `409`) and retries `recover`:
//!   `Done` finishes the record, a proven `Absent` lets the step run again
//!   (with the same step key, which the provider deduplicates on),
//!   `Unknown` parks it again, and the next pass waits longer for it (at
//!   once after the first park, then a lease, doubling, at most an hour).
//!   A record parked by a step without a look-up, or whose saved data
//!   cannot be decoded, is left to the operator (completers do not list
//!   it).
//! - **Retention** counts from when the answer is recorded: a record
//!   settled late replays for the full retention.
//! - **Completer.** [`Completer`] finds records whose lease lapsed with no
//!   client retry, takes them over with the same fencing and drives them to
//!   completion through a resume function registered per operation.
//!
//! # Example
//!
//! ```
//! use std::collections::HashMap;
//! use std::sync::{Arc, Mutex};
//!
//! use http::{Request, Response, StatusCode};
//! use sqlx::{Sqlite, sqlite::SqlitePoolOptions};
//! use tower::{ServiceBuilder, ServiceExt};
//! use tower_idempotency::lease::{CallError, LeaseMode, Leased, Recovered};
//! use tower_idempotency::{IdempotencyBody, IdempotencyLayer, Principal};
//!
//! type BoxError = Box<dyn std::error::Error + Send + Sync>;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BoxError> {
//! let pool = SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await?;
//! tower_idempotency::migrate(&pool).await?;
//! sqlx::raw_sql("CREATE TABLE payments (id INTEGER PRIMARY KEY, status TEXT, charge TEXT)")
//!     .execute(&pool)
//!     .await?;
//! // A provider that deduplicates on the idempotency key it is sent.
//! let provider: Arc<Mutex<HashMap<String, String>>> = Arc::default();
//!
//! let pay = move |req: Request<IdempotencyBody<String>>| {
//!     let provider = Arc::clone(&provider);
//!     async move {
//!         let leased = req.extensions().get::<Leased<Sqlite>>().cloned().ok_or("no lease")?;
//!         // Phase 1: the pending payment, committed with its recovery point.
//!         if leased.saved::<i64>("created")?.is_none() {
//!             let mut phase = leased.phase().await?;
//!             let id: i64 = sqlx::query_scalar(
//!                 "INSERT INTO payments (status) VALUES ('pending') RETURNING id",
//!             )
//!             .fetch_one(&mut *phase)
//!             .await?;
//!             phase.commit_with("created", &id).await?;
//!         }
//!         let id: i64 = leased.saved("created")?.ok_or("phase 1 saved nothing")?;
//!         // Step 2: the charge, sent with the step key; `recover` is the
//!         // provider's look-up by that key.
//!         let charge: String = leased
//!             .step(
//!                 "charge",
//!                 |key| {
//!                     let provider = Arc::clone(&provider);
//!                     async move {
//!                         let mut charges = provider.lock().unwrap();
//!                         let n = charges.len();
//!                         let id = charges.entry(key.to_string()).or_insert(format!("ch_{n}"));
//!                         Ok::<_, CallError<BoxError>>(id.clone())
//!                     }
//!                 },
//!                 |key| {
//!                     let found = provider.lock().unwrap().get(key.as_str()).cloned();
//!                     async move { Ok(found.map_or(Recovered::Absent, Recovered::Done)) }
//!                 },
//!             )
//!             .await
//!             .map_err(|e| e.to_string())?;
//!         // Phase 3: the final writes commit together with the recorded answer.
//!         let tx = leased.final_phase().await?;
//!         sqlx::query("UPDATE payments SET status = 'captured', charge = ? WHERE id = ?")
//!             .bind(&charge)
//!             .bind(id)
//!             .execute(&mut *tx.lock()?)
//!             .await?;
//!         let body = format!(r#"{{"paymentId":{id},"chargeId":"{charge}"}}"#);
//!         Ok::<_, BoxError>(Response::builder().status(201).body(body)?)
//!     }
//! };
//! let service = ServiceBuilder::new()
//!     .layer(IdempotencyLayer::new(pool.clone()).with_lease(LeaseMode::default()))
//!     .service_fn(pay);
//!
//! let request = || {
//!     let mut req = Request::post("/payments")
//!         .header("idempotency-key", "pay-20260914-001")
//!         .body(r#"{"amount":5000}"#.to_string())
//!         .unwrap();
//!     req.extensions_mut().insert(Principal::new("user-42"));
//!     req
//! };
//! let first = service.clone().oneshot(request()).await?;
//! let retry = service.clone().oneshot(request()).await?;
//! assert_eq!(first.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! let captured: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payments WHERE status = 'captured'")
//!     .fetch_one(&pool)
//!     .await?;
//! assert_eq!(captured, 1);
//! # Ok(())
//! # }
//! ```
//!
//! # When to choose it
//!
//! The default mode is one transaction: the claim, the business rows and
//! the recorded answer commit together, so a crash leaves nothing and a
//! retry simply runs again. Keep it whenever the handler only writes to the
//! database the layer is on. Choose lease mode when the handler has an
//! effect outside that database (a charge, an e-mail, a call to another
//! service): it costs a commit per phase and step, and in return every
//! crash point resumes instead of repeating the effect.
//!
//! # Guarantees under concurrency
//!
//! At most one attempt holds a key's row at a time (the generation names
//! it); every ledger write of an attempt is refused once a later attempt
//! took over, in the statement of the write. An external call can still be
//! made twice for one step (a takeover while the first call is in flight):
//! both carry the same [`StepKey`], so a provider that deduplicates on it
//! charges once. Nothing that cannot be proven is re-executed.
//!
//! [`IdempotencyLayer::with_lease`]: crate::IdempotencyLayer::with_lease
//! [`IdempotencyLayer`]: crate::IdempotencyLayer

use std::time::Duration;

use crate::config_error::{ConfigError, at_most};

mod completer;
mod context;
pub(crate) mod settle;
mod step;

pub use completer::{Completer, CompleterReport};
pub use context::{Leased, Phase};
pub use step::{CallError, Recovered, StepError, StepKey};

/// The longest step or recovery point name, in bytes (the ledger's
/// `pending_step` and `recovery_point` columns hold 255 on MySQL).
pub const MAX_NAME_LEN: usize = 255;

/// Checks a step or recovery point name against the one limit of every
/// store (see [`LeaseError::InvalidName`]).
pub(crate) fn check_name(name: &str) -> Result<(), LeaseError> {
    let why = if name.is_empty() {
        "empty"
    } else if name.len() > MAX_NAME_LEN {
        "longer than 255 bytes"
    } else if name.chars().any(char::is_control) {
        "contains a control character"
    } else if name.starts_with('~') {
        "names starting with '~' are reserved"
    } else {
        return Ok(());
    };
    Err(LeaseError::InvalidName {
        name: name.to_owned(),
        why,
    })
}

/// A new claim's id: the request's step seed, a dot, and 96 random bits
/// (hex). Every fenced write names the whole id, so a key used again
/// after its record was deleted or purged never meets its old owner. Every
/// [`StepKey`] mixes in the seed alone ([`step_seed`]), which derives from
/// the request's fingerprint: a retry that finds no record (its claim was
/// lost with a database failover, say) makes a new claim with the same
/// seed, and asks the provider again under the same step keys.
pub(crate) fn new_claim_id(fingerprint: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let seed = Sha256::new()
        .chain_update(b"tower-idempotency step seed\n")
        .chain_update(fingerprint)
        .finalize();
    format!(
        "{}.{:016x}{:08x}",
        crate::store::hex(&seed[..16]),
        crate::random::random_u64(),
        crate::random::random_u64() as u32
    )
}

/// The part of a claim id that step keys mix in: before the dot, or the
/// whole id of a claim made before step seeds (a random id alone).
pub(crate) fn step_seed(claim_id: &str) -> &str {
    claim_id.split_once('.').map_or(claim_id, |(seed, _)| seed)
}

/// The settings of lease mode; see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseMode {
    pub(crate) lease: Duration,
    pub(crate) step_timeout: Duration,
}

impl LeaseMode {
    /// Leases of `lease` (renewed by every phase, and every third of the
    /// lease while a step runs); steps time out after `lease` too.
    ///
    /// A lease shorter than a millisecond is one millisecond; one longer
    /// than [`MAX_LEASE`] is refused ([`ConfigError::TooLong`]): the lease
    /// is how long a crashed attempt blocks its key, and it becomes SQL
    /// arithmetic on the database's clock.
    pub fn new(lease: Duration) -> Result<Self, ConfigError> {
        let lease = at_most(lease, MAX_LEASE, "lease")?.max(Duration::from_millis(1));
        Ok(Self {
            lease,
            step_timeout: lease,
        })
    }

    /// The longest one `execute` or `recover` call may run (default: the
    /// lease). Past it the call counts as failed with an unknown outcome.
    /// At least a millisecond, at most [`MAX_LEASE`].
    pub fn with_step_timeout(mut self, timeout: Duration) -> Result<Self, ConfigError> {
        self.step_timeout =
            at_most(timeout, MAX_LEASE, "step_timeout")?.max(Duration::from_millis(1));
        Ok(self)
    }

    pub(crate) fn lease_ms(&self) -> i64 {
        crate::expiry::millis(self.lease)
    }
}

impl Default for LeaseMode {
    /// A 30 second lease.
    fn default() -> Self {
        let lease = Duration::from_secs(30);
        Self {
            lease,
            step_timeout: lease,
        }
    }
}

/// The longest lease and step timeout [`LeaseMode`] takes: one day.
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 60 * 60);

/// Why a lease-mode write did not happen.
#[derive(Debug)]
#[non_exhaustive]
pub enum LeaseError {
    /// A later attempt took the record over: stop; nothing more this
    /// attempt writes is kept, and the layer answers `409 #lease-lost`.
    Lost,
    /// A step's outcome could not be established: the record is parked as
    /// `NEEDS_RECONCILIATION`, and the layer answers `503 #reconciling`.
    Reconciling,
    /// The phase API was misused (a second final phase, a step name used
    /// twice in one attempt, a step inside a phase).
    Misuse(&'static str),
    /// A step or recovery point name the ledger cannot hold: empty, over
    /// [`MAX_NAME_LEN`] bytes, with a control character, or starting with
    /// `~` (reserved). Refused before anything runs, on every store.
    InvalidName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// Saved data could not be encoded or decoded as JSON.
    Data(serde_json::Error),
    /// The store failed.
    Store(sqlx::Error),
}

impl std::fmt::Display for LeaseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Lost => f.write_str("the lease was taken over by a later attempt"),
            Self::Reconciling => {
                f.write_str("the step's outcome is unknown; parked for reconciliation")
            }
            Self::Misuse(what) => write!(f, "lease mode misuse: {what}"),
            Self::InvalidName { name, why } => {
                let shown: String = name.chars().take(40).collect();
                write!(f, "step or point name {shown:?}: {why}")
            }
            Self::Data(e) => write!(f, "saved data: {e}"),
            Self::Store(e) => write!(f, "ledger: {e}"),
        }
    }
}

impl std::error::Error for LeaseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Data(e) => Some(e),
            Self::Store(e) => Some(e),
            _ => None,
        }
    }
}

impl From<sqlx::Error> for LeaseError {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(e)
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl axum::response::IntoResponse for LeaseError {
    /// The problem document for the error (`409 #lease-lost`, `503
    /// #reconciling`, `500 #lease-misuse` for a misuse or an invalid name,
    /// or a `503` that ends the lease so the retry resumes);
    /// the layer replaces it with the answer the record's state calls for.
    /// A store error's own text is logged, never sent.
    fn into_response(self) -> axum::response::Response {
        crate::problem::Problem::from(self).into_axum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_that_cannot_work_are_refused() {
        // `now + lease` overflowed BIGINT on every claim.
        assert!(matches!(
            LeaseMode::new(Duration::MAX),
            Err(ConfigError::TooLong { what: "lease", .. })
        ));
        assert!(LeaseMode::new(MAX_LEASE).is_ok());
        let mode = LeaseMode::default();
        assert!(mode.with_step_timeout(Duration::MAX).is_err());
        assert_eq!(
            mode.with_step_timeout(Duration::ZERO)
                .map(|m| m.step_timeout),
            Ok(Duration::from_millis(1))
        );
    }

    #[test]
    fn names_are_checked_against_one_limit() {
        assert!(check_name("charge").is_ok());
        assert!(check_name(&"s".repeat(MAX_NAME_LEN)).is_ok());
        for bad in [
            String::new(),
            "s".repeat(MAX_NAME_LEN + 1),
            "nul\0".to_string(),
            "~claim".to_string(),
        ] {
            assert!(
                matches!(check_name(&bad), Err(LeaseError::InvalidName { .. })),
                "{bad:?}"
            );
        }
    }
}
