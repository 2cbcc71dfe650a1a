//! External steps: one call to the outside world per step, with a step key
//! that stays the same across attempts, `recover` before any second
//! `execute`, and the lease kept alive while the call runs.

use std::future::{Future, Ready};
use std::pin::pin;
use std::task::Poll;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use super::{LeaseError, Leased};
use crate::store::{Backend, LeaseWrite, Scope, UnresolvedRecord};

/// The idempotency key of one external step, derived from what every retry
/// of the request presents again (principal, operation, key, and the
/// request's fingerprint, kept in the claim id) and the step's name: the
/// same in every attempt and takeover of the request, and in a new claim
/// made after the record was lost (a failover that lost the last commits),
/// different for every step and for every other request, a key used again
/// with another payload after its record was purged included. Send it to
/// the provider as its idempotency key, so a call repeated after a crash
/// or a failover is deduplicated there. 64 hex digits.
///
/// The trade-off: a key used again after its record was purged, with a
/// byte-for-byte identical request, derives the same step keys. A provider
/// that still remembers them answers with the first call's result instead
/// of acting again: the same request under the same key is treated as the
/// same intent, never charged twice. (Rows claimed by earlier versions
/// keep their random claim id as the seed.)
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StepKey(String);

impl StepKey {
    /// The key's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The step key of step `name` of a listed record, for an operator
    /// who checks the provider before a verdict; `None` for a record
    /// without a claim id (the default mode, or a row claimed before the
    /// ledger stored claim ids).
    pub fn of(record: &UnresolvedRecord, name: &str) -> Option<Self> {
        let seed = super::step_seed(record.claim_id.as_deref()?);
        Some(Self::derive(&record.scope(), seed, name))
    }

    fn derive(scope: &Scope<'_>, seed: &str, name: &str) -> Self {
        let mut h = Sha256::new();
        for part in [scope.principal, scope.operation, scope.key, seed, name] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        Self(crate::store::hex(&h.finalize()))
    }
}

impl std::fmt::Display for StepKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a step's look-up found at the provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovered<T> {
    /// The call took effect; this is its result.
    Done(T),
    /// Proven absent: the provider has no effect for this step key, so the
    /// step may run (again).
    Absent,
    /// The look-up cannot tell: the record goes to reconciliation.
    Unknown,
}

/// How an `execute` call failed. Any error converts into
/// [`Uncertain`](Self::Uncertain) (so `?` works); say
/// [`NotSent`](Self::NotSent) only when the request provably never left.
#[derive(Debug)]
pub enum CallError<E> {
    /// The request may have reached the provider (a timeout, a reset, an
    /// answer that could not be read, a 5xx): `recover` decides what
    /// happened.
    Uncertain(E),
    /// The request provably never left this process: the connection was
    /// refused, the name did not resolve, the client refused the request
    /// before writing it. Nothing can have taken effect: the step is no
    /// longer pending, the lease ends without parking, and the retry runs
    /// the step.
    NotSent(E),
}

impl<E> CallError<E> {
    /// The error underneath.
    pub fn into_inner(self) -> E {
        match self {
            Self::Uncertain(e) | Self::NotSent(e) => e,
        }
    }
}

impl<E> From<E> for CallError<E> {
    fn from(e: E) -> Self {
        Self::Uncertain(e)
    }
}

/// Why a step gave no result.
#[derive(Debug)]
#[non_exhaustive]
pub enum StepError<E> {
    /// The lease or the ledger refused (see [`LeaseError`]): stop.
    Lease(LeaseError),
    /// `execute` failed and `recover` proved nothing took effect: the step
    /// may run again. Answer a 5xx: the lease ends and the retry resumes.
    Failed(E),
    /// `execute` timed out and `recover` proved nothing took effect.
    TimedOut,
    /// `execute` failed before its request left ([`CallError::NotSent`]):
    /// nothing took effect and nothing was looked up. Answer a 5xx: the
    /// lease ends and the retry runs the step.
    NotSent(E),
}

impl<E> From<LeaseError> for StepError<E> {
    fn from(e: LeaseError) -> Self {
        Self::Lease(e)
    }
}

impl<E: std::fmt::Display> std::fmt::Display for StepError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Lease(e) => e.fmt(f),
            Self::Failed(e) => write!(f, "the step failed without effect: {e}"),
            Self::TimedOut => f.write_str("the step timed out without effect"),
            Self::NotSent(e) => write!(f, "the step's request was never sent: {e}"),
        }
    }
}

impl<E: std::fmt::Debug + std::fmt::Display> std::error::Error for StepError<E> {}

/// Marks a step as running for as long as it lives (a dropped step
/// future included): steps run one at a time, never inside a phase.
struct Stepping<DB: Backend> {
    leased: Leased<DB>,
}

impl<DB: Backend> Stepping<DB> {
    fn new(leased: &Leased<DB>) -> Result<Self, LeaseError> {
        let mut state = leased.state();
        if state.stepping {
            return Err(LeaseError::Misuse("steps run one at a time"));
        }
        if state.phases > 0 {
            return Err(LeaseError::Misuse(
                "a step cannot run inside a phase: commit the phase first",
            ));
        }
        state.stepping = true;
        drop(state);
        Ok(Self {
            leased: leased.clone(),
        })
    }
}

impl<DB: Backend> Drop for Stepping<DB> {
    fn drop(&mut self) {
        self.leased.state().stepping = false;
    }
}

/// How long a completer waits before retrying the look-up of a record
/// parked `parks` times before: at once after the first park, then the
/// lease, doubling with each park, at most an hour.
fn park_backoff_ms(parks: i64, mode: super::LeaseMode) -> i64 {
    if parks <= 0 {
        return 0;
    }
    let doublings = u32::try_from(parks - 1).unwrap_or(u32::MAX).min(20);
    mode.lease_ms()
        .saturating_mul(1_i64 << doublings)
        .min(MAX_PARK_BACKOFF_MS)
}

/// The longest back-off between a parked record's look-ups: an hour.
const MAX_PARK_BACKOFF_MS: i64 = 60 * 60 * 1000;

/// How the step's call ended.
enum Call<T, E> {
    Ok(T),
    Err(E),
    TimedOut,
}

type NoLookup<T, E> = fn(StepKey) -> Ready<Result<Recovered<T>, E>>;

impl<DB: Backend> Leased<DB> {
    /// The [`StepKey`] of step `name` for this request.
    pub fn step_key(&self, name: &str) -> StepKey {
        StepKey::derive(&self.scope(), &self.inner.step_seed, name)
    }

    /// Runs the external step `name` at most once in effect:
    ///
    /// - a step that completed in an earlier attempt returns its saved
    ///   result without calling anything;
    /// - a step an earlier attempt may have run calls `recover` first:
    ///   `Done` is the result, only `Absent` lets `execute` run,
    ///   `Unknown`, an error or a timeout parks the record
    ///   ([`LeaseError::Reconciling`]);
    /// - otherwise the step is noted pending (fenced: a stale attempt is
    ///   refused here, before any call), `execute` runs under the step
    ///   timeout while the lease is renewed, and its result is saved as the
    ///   recovery point `name`. An `execute` error or timeout (the call may
    ///   have landed) calls `recover` at once, with the same rules.
    ///
    /// `T` is saved as JSON: make it everything a later phase needs.
    pub async fn step<T, E, X, XF, R, RF>(
        &self,
        name: &str,
        execute: X,
        recover: R,
    ) -> Result<T, StepError<E>>
    where
        T: Serialize + DeserializeOwned,
        X: Fn(StepKey) -> XF,
        XF: Future<Output = Result<T, CallError<E>>>,
        R: Fn(StepKey) -> RF,
        RF: Future<Output = Result<Recovered<T>, E>>,
    {
        self.run_step(name, execute, Some(recover)).await
    }

    /// A step whose provider offers no look-up: when its outcome is
    /// uncertain (an earlier attempt may have run it, or `execute` failed
    /// or timed out) the record is parked for reconciliation, never run
    /// again.
    pub async fn step_without_lookup<T, E, X, XF>(
        &self,
        name: &str,
        execute: X,
    ) -> Result<T, StepError<E>>
    where
        T: Serialize + DeserializeOwned,
        X: Fn(StepKey) -> XF,
        XF: Future<Output = Result<T, CallError<E>>>,
    {
        self.run_step(name, execute, None::<NoLookup<T, E>>).await
    }

    async fn run_step<T, E, X, XF, R, RF>(
        &self,
        name: &str,
        execute: X,
        recover: Option<R>,
    ) -> Result<T, StepError<E>>
    where
        T: Serialize + DeserializeOwned,
        X: Fn(StepKey) -> XF,
        XF: Future<Output = Result<T, CallError<E>>>,
        R: Fn(StepKey) -> RF,
        RF: Future<Output = Result<Recovered<T>, E>>,
    {
        self.usable()?;
        super::check_name(name)?;
        if !self.state().steps.insert(name.to_owned()) {
            return Err(LeaseError::Misuse("a step name is used once per attempt").into());
        }
        if let Some(done) = self.saved::<T>(name)? {
            return Ok(done);
        }
        let _running = Stepping::new(self)?;
        let key = self.step_key(name);
        let pending = self.state().pending.clone();
        match pending.as_deref() {
            // Another step's outcome is unknown and this attempt does not
            // recover it first (the handler took another path): nothing may
            // run before it is known.
            Some(other) if other != name => {
                tracing::error!(
                    step = name,
                    pending = other,
                    "a step began while another step's outcome is unknown"
                );
                return Err(self.park(other, true).await.into());
            }
            _ => {}
        }
        if pending.is_some() {
            match self.recover(&key, recover.as_ref()).await {
                Recovered::Done(result) => return self.finish_step(name, result).await,
                Recovered::Absent => {}
                Recovered::Unknown => return Err(self.park(name, recover.is_some()).await.into()),
            }
        }
        self.write(&LeaseWrite::Pending {
            step: name,
            lease_ms: self.inner.mode.lease_ms(),
            step_ms: crate::expiry::millis(self.inner.mode.step_timeout),
        })
        .await?;
        {
            let mut state = self.state();
            state.pending = Some(name.to_owned());
            state.progressed = true;
        }
        let failure = match self.bounded(execute(key.clone())).await {
            Call::Ok(result) => return self.finish_step(name, result).await,
            Call::Err(CallError::NotSent(e)) => {
                // Nothing left: the step is not pending, nothing to recover.
                tracing::warn!(step = name, "an external step's request was never sent");
                self.save(None, None).await?;
                return Err(StepError::NotSent(e));
            }
            Call::Err(CallError::Uncertain(e)) => StepError::Failed(e),
            Call::TimedOut => StepError::TimedOut,
        };
        tracing::warn!(
            step = name,
            "an external step failed or timed out; recovering its outcome"
        );
        match self.recover(&key, recover.as_ref()).await {
            Recovered::Done(result) => self.finish_step(name, result).await,
            Recovered::Absent => {
                // Nothing happened: the step is no longer pending.
                self.save(None, None).await?;
                Err(failure)
            }
            Recovered::Unknown => Err(self.park(name, recover.is_some()).await.into()),
        }
    }

    /// Saves a step's result as its recovery point.
    async fn finish_step<T: Serialize, E>(&self, name: &str, result: T) -> Result<T, StepError<E>> {
        let value = serde_json::to_value(&result).map_err(LeaseError::Data)?;
        self.save(Some(name), Some(value)).await?;
        Ok(result)
    }

    /// Asks `recover`, bounded; no look-up, an error or a timeout is
    /// `Unknown`.
    async fn recover<T, E, R, RF>(&self, key: &StepKey, recover: Option<&R>) -> Recovered<T>
    where
        R: Fn(StepKey) -> RF,
        RF: Future<Output = Result<Recovered<T>, E>>,
    {
        let Some(recover) = recover else {
            return Recovered::Unknown;
        };
        match self.bounded(recover(key.clone())).await {
            Call::Ok(found) => found,
            Call::Err(_) | Call::TimedOut => Recovered::Unknown,
        }
    }

    /// Parks the record as `NEEDS_RECONCILIATION`; the error to stop with.
    /// `recoverable`: a completer may retry the step's look-up (after a
    /// back-off that grows with each park).
    pub(crate) async fn park(&self, step: &str, recoverable: bool) -> LeaseError {
        tracing::error!(
            step,
            "the outcome of an external step is unknown; the key is parked for reconciliation"
        );
        let retry_ms = recoverable.then(|| park_backoff_ms(self.inner.parks, self.inner.mode));
        let parked = self.write(&LeaseWrite::Park { retry_ms }).await;
        // Whether or not the park was heard back, this attempt stops here:
        // a later one finds the step pending (or parked) and recovers first.
        self.state().parked = true;
        match parked {
            Ok(()) => LeaseError::Reconciling,
            Err(e) => e,
        }
    }

    /// Runs a call under the step timeout, renewing the lease every third
    /// of it meanwhile. A renewal runs beside the call, as a task of its
    /// own, never in its way: the call and its timeout keep running while a
    /// renewal waits on a lock (bounded by the store's lock wait), and a
    /// tick while one still waits starts none, so a step holds at most one
    /// connection for its renewals. A renewal only extends a live lease: one that lands
    /// late, after the attempt ended its lease, changes nothing. A renewal
    /// that matches nothing says nothing either; the attempt's next write
    /// is fenced and tells.
    async fn bounded<T, E>(&self, call: impl Future<Output = Result<T, E>>) -> Call<T, E> {
        let mut call = pin!(tokio::time::timeout(self.inner.mode.step_timeout, call));
        let period = (self.inner.mode.lease / 3).max(std::time::Duration::from_millis(1));
        let mut tick = pin!(tokio::time::sleep(period));
        let mut renewal: Option<tokio::task::JoinHandle<()>> = None;
        let ended = std::future::poll_fn(|cx| {
            if let Poll::Ready(out) = call.as_mut().poll(cx) {
                return Poll::Ready(out);
            }
            while tick.as_mut().poll(cx).is_ready() {
                tick.as_mut().reset(tokio::time::Instant::now() + period);
                if renewal
                    .as_ref()
                    .is_none_or(tokio::task::JoinHandle::is_finished)
                {
                    renewal = Some(self.spawn_renewal());
                }
            }
            Poll::Pending
        })
        .await;
        match ended {
            Ok(Ok(out)) => Call::Ok(out),
            Ok(Err(e)) => Call::Err(e),
            Err(_) => Call::TimedOut,
        }
    }

    /// One lease renewal as a task of its own: its statement finishes on
    /// its connection whatever becomes of the step.
    fn spawn_renewal(&self) -> tokio::task::JoinHandle<()> {
        let leased = self.clone();
        tokio::spawn(async move {
            let renew = LeaseWrite::Renew {
                lease_ms: leased.inner.mode.lease_ms(),
            };
            let inner = &leased.inner;
            match DB::lease_write(&inner.pool, &leased.scope(), leased.fence(), &renew).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!("the lease was not renewed: it ended or was taken over")
                }
                Err(e) => tracing::warn!(error = %e, "could not renew the lease during a step"),
            }
        })
    }
}
