//! [`Leased`]: what a lease-mode handler works with, and its [`Phase`]s.

use std::collections::HashSet;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use sqlx::Pool;

use super::{LeaseError, LeaseMode};
use crate::store::{
    Backend, CLAIM_ID, Claimed, Fence, IsolationLevel, LeaseState, LeaseWrite, Scope,
};
use crate::tx::Tx;

/// The lease an attempt holds on its key: the handler's context in lease
/// mode. Taken from the request extensions (or as an axum extractor); cheap
/// to clone. See the [module docs](super) for the protocol.
///
/// Every write through it is fenced by [`generation`](Self::generation):
/// once a later attempt has taken the key over, each of them is refused
/// with [`LeaseError::Lost`] and commits nothing.
pub struct Leased<DB: Backend> {
    pub(crate) inner: Arc<Inner<DB>>,
}

impl<DB: Backend> Clone for Leased<DB> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<DB: Backend> std::fmt::Debug for Leased<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leased")
            .field("operation", &self.inner.operation)
            .field("generation", &self.inner.generation)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner<DB: Backend> {
    pub(crate) pool: Pool<DB>,
    pub(crate) principal: String,
    pub(crate) operation: String,
    pub(crate) key: String,
    pub(crate) generation: i64,
    /// The claim's id as stored (`None` for a row claimed before the
    /// ledger stored it): the fence names it.
    pub(crate) claim_id: Option<String>,
    /// What every step key mixes in: the claim id's seed (see
    /// [`step_seed`](super::step_seed); for an older row, of the id its
    /// saved data holds).
    pub(crate) step_seed: String,
    /// How often the row was parked before this attempt took it.
    pub(crate) parks: i64,
    pub(crate) mode: LeaseMode,
    pub(crate) isolation: IsolationLevel,
    state: Mutex<State>,
    final_tx: Mutex<Option<Tx<DB>>>,
}

/// What this attempt knows of its row. Never locked across an `await`.
#[derive(Debug, Default)]
pub(crate) struct State {
    pub(crate) point: Option<String>,
    pub(crate) data: Map<String, Value>,
    pub(crate) pending: Option<String>,
    /// A fenced write was refused: a later attempt owns the row.
    pub(crate) lost: bool,
    /// The row was parked as `NEEDS_RECONCILIATION`.
    pub(crate) parked: bool,
    /// Something beyond the claim was committed (or may have run).
    pub(crate) progressed: bool,
    /// A step is running (steps run one at a time, outside phases).
    pub(crate) stepping: bool,
    /// Phases open now (including the final phase once begun).
    pub(crate) phases: usize,
    /// The step names this attempt began (each runs once per attempt).
    pub(crate) steps: HashSet<String>,
}

impl<DB: Backend> Leased<DB> {
    /// The context of the attempt that holds `scope` as `saved` says (its
    /// generation, claim and saved state). Saved data that cannot be
    /// decoded is [`LeaseError::Data`]: the caller parks the row.
    pub(crate) fn new(
        pool: Pool<DB>,
        scope: &Scope<'_>,
        mode: LeaseMode,
        isolation: IsolationLevel,
        saved: &LeaseState,
    ) -> Result<Self, LeaseError> {
        let mut state = State {
            point: saved.recovery_point.clone(),
            pending: saved.pending_step.clone(),
            ..State::default()
        };
        if let Some(data) = &saved.recovery_data {
            state.data = serde_json::from_slice(data).map_err(LeaseError::Data)?;
        }
        state.progressed = state.point.is_some()
            || state.pending.is_some()
            || state.data.keys().any(|k| k != CLAIM_ID);
        let claim_id = match &saved.claim_id {
            Some(id) => id.as_str(),
            None => state
                .data
                .get(CLAIM_ID)
                .and_then(Value::as_str)
                .unwrap_or_default(),
        };
        let step_seed = super::step_seed(claim_id).to_owned();
        Ok(Self {
            inner: Arc::new(Inner {
                pool,
                principal: scope.principal.to_owned(),
                operation: scope.operation.to_owned(),
                key: scope.key.to_owned(),
                generation: saved.generation,
                claim_id: saved.claim_id.clone(),
                step_seed,
                parks: saved.parks,
                mode,
                isolation,
                state: Mutex::new(state),
                final_tx: Mutex::new(None),
            }),
        })
    }

    /// The key as stored (hashed when the layer hashes keys).
    pub fn key(&self) -> &str {
        &self.inner.key
    }

    /// The stored operation, such as `POST /payments` (an operation named
    /// exactly `message`, reserved for consumers, is stored in its
    /// `sha256:` form).
    pub fn operation(&self) -> &str {
        &self.inner.operation
    }

    /// This attempt's fencing token: 1 for the first attempt, one more per
    /// takeover. Only the ledger checks it; never send it to a provider
    /// (send the [`StepKey`](super::StepKey)).
    pub fn generation(&self) -> i64 {
        self.inner.generation
    }

    /// Whether this attempt resumes an earlier one (a takeover).
    pub fn is_resumed(&self) -> bool {
        self.inner.generation > 1
    }

    /// The last recovery point committed for this key (a phase or a step
    /// name), `None` before the first one.
    pub fn recovery_point(&self) -> Option<String> {
        self.state().point.clone()
    }

    /// The external step that may have run in an earlier attempt and whose
    /// outcome is not recorded (`None` when there is none). A resume
    /// function that finds one must run that step (its `recover` runs
    /// first) or answer a transient failure: a final answer over it parks
    /// the record for an operator, since the effect may have happened.
    pub fn pending_step(&self) -> Option<String> {
        self.state().pending.clone()
    }

    /// What the phase or step `point` saved, if it committed.
    pub fn saved<T: DeserializeOwned>(&self, point: &str) -> Result<Option<T>, LeaseError> {
        let value = self.state().data.get(point).cloned();
        value
            .map(|v| serde_json::from_value(v).map_err(LeaseError::Data))
            .transpose()
    }

    /// Begins a local phase: a transaction for business writes that
    /// [`Phase::commit`] commits together with its recovery point, fenced.
    /// Dropping the phase rolls it back.
    pub async fn phase(&self) -> Result<Phase<DB>, LeaseError> {
        self.usable()?;
        let open = PhaseOpen::new(self)?;
        let tx = DB::begin_phase(&self.inner.pool, self.inner.isolation).await?;
        Ok(Phase {
            tx,
            leased: self.clone(),
            _open: open,
        })
    }

    /// Begins the final phase: a transaction (through a [`Tx`] handle, as
    /// in the default mode) in which the layer records the handler's answer,
    /// fenced, and commits. Lock it, write, drop the guard, and answer.
    /// At most one per attempt.
    pub async fn final_phase(&self) -> Result<Tx<DB>, LeaseError> {
        self.usable()?;
        if lock(&self.inner.final_tx).is_some() {
            return Err(LeaseError::Misuse("final_phase called twice"));
        }
        // Open until the attempt ends: no step may follow it.
        {
            let mut state = self.state();
            if state.stepping {
                return Err(LeaseError::Misuse("a phase cannot begin while a step runs"));
            }
            state.phases += 1;
        }
        let phase = DB::begin_phase(&self.inner.pool, self.inner.isolation).await?;
        let tx = Tx::new(phase);
        *lock(&self.inner.final_tx) = Some(tx.clone());
        Ok(tx)
    }

    /// The final phase's transaction, taken back by the layer (`None` when
    /// there is none, or the handler still holds its guard).
    pub(crate) fn take_final(&self) -> Option<Option<Claimed<DB>>> {
        match lock(&self.inner.final_tx).take() {
            None => Some(None),
            Some(handle) => handle.take().map(Some),
        }
    }

    /// What this attempt's writes name: its claim and generation.
    pub(crate) fn fence(&self) -> Fence<'_> {
        Fence {
            generation: self.inner.generation,
            claim: self.inner.claim_id.as_deref(),
        }
    }

    pub(crate) fn scope(&self) -> Scope<'_> {
        Scope {
            principal: &self.inner.principal,
            operation: &self.inner.operation,
            key: &self.inner.key,
        }
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.inner.state)
    }

    /// Refuses work once the attempt lost its row or parked it.
    pub(crate) fn usable(&self) -> Result<(), LeaseError> {
        let state = self.state();
        if state.lost {
            Err(LeaseError::Lost)
        } else if state.parked {
            Err(LeaseError::Reconciling)
        } else {
            Ok(())
        }
    }

    /// One fenced write committed on its own.
    pub(crate) async fn write(&self, write: &LeaseWrite<'_>) -> Result<(), LeaseError> {
        if DB::lease_write(&self.inner.pool, &self.scope(), self.fence(), write).await? {
            Ok(())
        } else {
            self.state().lost = true;
            Err(LeaseError::Lost)
        }
    }

    /// The saved data with `value` under `point`, encoded.
    fn data_with(
        &self,
        point: Option<&str>,
        value: Option<Value>,
    ) -> Result<(Map<String, Value>, Vec<u8>), LeaseError> {
        let mut data = self.state().data.clone();
        if let (Some(point), Some(value)) = (point, value) {
            data.insert(point.to_owned(), value);
        }
        let encoded = serde_json::to_vec(&data).map_err(LeaseError::Data)?;
        Ok((data, encoded))
    }

    /// Notes a recovery point (and the data) as committed.
    fn reached(&self, point: Option<&str>, data: Map<String, Value>, settled: bool) {
        let mut state = self.state();
        if let Some(point) = point {
            state.point = Some(point.to_owned());
        }
        state.data = data;
        if settled {
            state.pending = None;
        }
        state.progressed = true;
    }

    /// Commits `tx` with the recovery point `point` (saving `value` under
    /// it), fenced.
    pub(crate) async fn commit_point(
        &self,
        tx: Claimed<DB>,
        point: &str,
        value: Option<Value>,
    ) -> Result<(), LeaseError> {
        super::check_name(point)?;
        let (data, encoded) = self.data_with(Some(point), value)?;
        let write = LeaseWrite::Progress {
            point: Some(point),
            data: &encoded,
            settled: false,
            lease_ms: self.inner.mode.lease_ms(),
        };
        let pool = &self.inner.pool;
        let committed = DB::commit_fenced(pool, tx, &self.scope(), self.fence(), &write)
            .await
            .map_err(|e| LeaseError::Store(e.into_inner()))?;
        if committed.is_none() {
            self.state().lost = true;
            return Err(LeaseError::Lost);
        }
        self.reached(Some(point), data, false);
        Ok(())
    }

    /// Records `point` (saving `value` under it; `None`: the point stays)
    /// with nothing else, fenced, and settles the pending step.
    pub(crate) async fn save(
        &self,
        point: Option<&str>,
        value: Option<Value>,
    ) -> Result<(), LeaseError> {
        let (data, encoded) = self.data_with(point, value)?;
        self.write(&LeaseWrite::Progress {
            point,
            data: &encoded,
            settled: true,
            lease_ms: self.inner.mode.lease_ms(),
        })
        .await?;
        self.reached(point, data, true);
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks cannot leave them half-written.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One local phase of a lease-mode handler: a transaction for business
/// writes. Dereferences to the connection (`sqlx::query(…).execute(&mut
/// *phase)`). Dropping it without [`commit`](Self::commit) rolls it back.
pub struct Phase<DB: Backend> {
    tx: Claimed<DB>,
    leased: Leased<DB>,
    _open: PhaseOpen<DB>,
}

/// Counts a phase as open while it lives; refuses one during a step.
pub(crate) struct PhaseOpen<DB: Backend> {
    leased: Leased<DB>,
}

impl<DB: Backend> PhaseOpen<DB> {
    fn new(leased: &Leased<DB>) -> Result<Self, LeaseError> {
        let mut state = leased.state();
        if state.stepping {
            return Err(LeaseError::Misuse("a phase cannot begin while a step runs"));
        }
        state.phases += 1;
        drop(state);
        Ok(Self {
            leased: leased.clone(),
        })
    }
}

impl<DB: Backend> Drop for PhaseOpen<DB> {
    fn drop(&mut self) {
        let mut state = self.leased.state();
        state.phases = state.phases.saturating_sub(1);
    }
}

impl<DB: Backend> std::fmt::Debug for Phase<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Phase").finish_non_exhaustive()
    }
}

impl<DB: Backend> Phase<DB> {
    /// Commits the phase's writes with the recovery point `point`, if the
    /// row is still this attempt's: otherwise nothing commits and the
    /// answer is [`LeaseError::Lost`].
    pub async fn commit(self, point: &str) -> Result<(), LeaseError> {
        self.leased.commit_point(self.tx, point, None).await
    }

    /// As [`commit`](Self::commit), saving `data` (as JSON) under `point`,
    /// for [`Leased::saved`] in a later attempt.
    pub async fn commit_with<T: Serialize>(self, point: &str, data: &T) -> Result<(), LeaseError> {
        let value = serde_json::to_value(data).map_err(LeaseError::Data)?;
        self.leased.commit_point(self.tx, point, Some(value)).await
    }
}

impl<DB: Backend> Deref for Phase<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.tx
    }
}

impl<DB: Backend> DerefMut for Phase<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.tx
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl<DB: Backend, S: Send + Sync> axum::extract::FromRequestParts<S> for Leased<DB> {
    type Rejection = (http::StatusCode, &'static str);

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Self>().cloned().ok_or((
            http::StatusCode::INTERNAL_SERVER_ERROR,
            "this route is not behind an IdempotencyLayer in lease mode",
        ))
    }
}
