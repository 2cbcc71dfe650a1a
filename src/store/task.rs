//! The claim and lease statements that run as tasks of their own, so that
//! a caller that goes away never leaves a connection halfway through them
//! or a won lease without an owner.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Pool;
use sqlx::pool::PoolConnection;

use super::{Backend, Claim, ClaimOutcome, Fence, IsolationLevel, LeaseWrite, Scope};

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
    let task = tokio::spawn(claim_task::<DB, H>(conn, OwnedClaim::new(claim), hold));
    async move { task.await.unwrap_or(Err(sqlx::Error::WorkerCrashed)) }
}

/// The task [`spawn_claim`] runs (a function of its own, so that a profile
/// can name it: `benches/instructions.sh`).
async fn claim_task<DB: Backend, H>(
    conn: PoolConnection<DB>,
    claim: OwnedClaim,
    hold: H,
) -> Result<ClaimOutcome<DB>, sqlx::Error> {
    let _hold = hold;
    DB::claim(conn, &claim.as_claim()).await
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
    database: Option<Arc<str>>,
    causal_wait: bool,
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
            database: claim.database.map(Arc::from),
            causal_wait: claim.causal_wait,
        }
    }

    pub(crate) fn as_claim(&self) -> Claim<'_> {
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
            database: self.database.as_deref(),
            causal_wait: self.causal_wait,
        }
    }
}
