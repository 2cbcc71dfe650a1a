//! Lease mode in the service: claim or take over the key, run the handler
//! with its [`Leased`] context, settle the answer.

use std::panic::resume_unwind;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::claim::{Pending, backoff};
use super::{
    Answer, BoxError, CatchUnwind, Identity, ReadAnswer, Run, buffered, read_response, refusal,
    refuse, store_problem,
};
use crate::body::IdempotencyBody;
use crate::expiry::retention_ms;
use crate::lease::new_claim_id;
use crate::lease::settle::{ReleaseOnDrop, park_unreadable, release, settle};
use crate::lease::{LeaseMode, Leased};
use crate::observe;
use crate::outcome::IdempotencyOutcome;
use crate::problem::Problem;
use crate::store::{
    Backend, Claim, Fence, LeaseState, MIN_READ_WAIT, OwnedClaim, OwnedScope, Owning, RecordStatus,
    claim_data, end_lease, spawn_owning,
};

/// How a lease-mode claim ended.
enum LeaseClaim<DB: Backend> {
    /// This attempt holds the key.
    Won(Leased<DB>),
    /// Answer without running the handler.
    Answer(Answer),
}

impl<DB: Backend> Run<DB> {
    /// The lease-mode path of a guarded request.
    pub(super) async fn leased<S, ReqBody, ResBody>(
        &self,
        mode: LeaseMode,
        inner: S,
        id: &Identity<'_>,
        parts: Parts,
        body: Bytes,
        deadline: Instant,
    ) -> Result<Response<IdempotencyBody<ResBody>>, S::Error>
    where
        S: Service<Request<IdempotencyBody<ReqBody>>, Response = Response<ResBody>>,
        ResBody: Body<Data = Bytes>,
        ResBody::Error: Into<BoxError>,
    {
        let claiming = Instant::now();
        let claimed = self.lease_claim(mode, id, deadline).await;
        observe::timing("claim_ms", claiming.elapsed());
        match claimed {
            LeaseClaim::Answer((res, outcome)) => Ok(buffered(res, outcome)),
            LeaseClaim::Won(leased) => self.run_leased(inner, leased, parts, body).await,
        }
    }

    /// Claims the key, or takes a lapsed lease over, or finds the answer a
    /// retry gets; waits on a live lease until `deadline`.
    async fn lease_claim(
        &self,
        mode: LeaseMode,
        id: &Identity<'_>,
        deadline: Instant,
    ) -> LeaseClaim<DB> {
        let cfg = &self.config;
        let mut attempts = 0;
        loop {
            attempts += 1;
            let left = deadline.saturating_duration_since(Instant::now());
            let claim = Claim {
                scope: id.scope,
                fingerprint: id.fingerprint.as_bytes(),
                retention_ms: retention_ms(cfg.retention),
                lock_wait: left.clamp(Duration::from_millis(1), MIN_READ_WAIT),
                isolation: cfg.isolation,
                cached_statements: cfg.cached_statements,
                database: cfg.database.as_deref(),
                causal_wait: cfg.causal_wait(),
            };
            let claim_id = new_claim_id(id.fingerprint.as_bytes());
            let owning = Owning::Claim {
                claim: OwnedClaim::new(&claim),
                lease_ms: mode.lease_ms(),
                claim_id: claim_id.clone(),
            };
            let won = spawn_owning(self.pool.clone(), owning, self.read_bound(left)).await;
            match won {
                Ok(true) => {
                    let fresh = LeaseState {
                        generation: 1,
                        live: true,
                        recovery_point: None,
                        recovery_data: Some(claim_data(&claim_id).into_bytes()),
                        pending_step: None,
                        claim_id: Some(claim_id),
                        parks: 0,
                    };
                    let fresh =
                        Leased::new(self.pool.clone(), &id.scope, mode, cfg.isolation, &fresh);
                    return match fresh {
                        Ok(leased) => LeaseClaim::Won(leased),
                        Err(e) => LeaseClaim::Answer(refusal(Problem::from(e), attempts)),
                    };
                }
                Ok(false) => match self.lease_lookup(mode, id, deadline, attempts).await {
                    Lookup::Answer(answer) => return LeaseClaim::Answer(answer),
                    Lookup::TookOver(leased) => return LeaseClaim::Won(leased),
                    Lookup::Wait => {}
                },
                Err(e) => return LeaseClaim::Answer(refusal(store_problem::<DB>(&e), attempts)),
            }
            let delay = backoff(attempts);
            if Instant::now() + delay >= deadline {
                return LeaseClaim::Answer(self.pending(Pending::InFlight, attempts));
            }
            tokio::time::sleep(delay).await;
        }
    }

    /// Reads the row that holds the key: a stored answer, a lapsed lease to
    /// take over, or a live one to wait on.
    async fn lease_lookup(
        &self,
        mode: LeaseMode,
        id: &Identity<'_>,
        deadline: Instant,
        attempts: u32,
    ) -> Lookup<DB> {
        let wait = deadline.saturating_duration_since(Instant::now());
        let record = match self.fetch_within(wait, &id.scope).await {
            Ok(Some(record)) => record,
            // Deleted in between (a rejected request): claim again.
            Ok(None) => return Lookup::Wait,
            Err(e) => return Lookup::Answer(refusal(store_problem::<DB>(&e), attempts)),
        };
        let leased = record.status == RecordStatus::Processing
            && record.fingerprint == id.fingerprint.as_bytes();
        let lease = match (&record.lease, leased) {
            (Some(lease), true) => lease,
            _ => return Lookup::Answer(self.judge(&record, id, attempts)),
        };
        if lease.live {
            return Lookup::Wait;
        }
        let owning = Owning::TakeOver {
            scope: OwnedScope::new(&id.scope),
            generation: lease.generation,
            claim_id: lease.claim_id.clone(),
            lease_ms: mode.lease_ms(),
            parked: false,
        };
        match spawn_owning(self.pool.clone(), owning, self.read_bound(wait)).await {
            Ok(true) => {}
            // Another attempt took it first: wait on its lease.
            Ok(false) => return Lookup::Wait,
            Err(e) => return Lookup::Answer(refusal(store_problem::<DB>(&e), attempts)),
        }
        // The state at the generation just taken, read after the takeover:
        // a write of the earlier owner can have landed since the read above.
        let generation = lease.generation + 1;
        let saved = match self.fetch_within(wait, &id.scope).await {
            Ok(record) => record.and_then(|r| r.lease),
            Err(e) => {
                // Won, but unusable: no lease is left without its owner.
                let won = Fence {
                    generation,
                    claim: lease.claim_id.as_deref(),
                };
                end_lease(&self.pool, &id.scope, won).await;
                return Lookup::Answer(refusal(store_problem::<DB>(&e), attempts));
            }
        };
        let Some(saved) =
            saved.filter(|s| s.generation == generation && s.claim_id == lease.claim_id)
        else {
            // Taken over again in between: wait on the newer owner.
            return Lookup::Wait;
        };
        tracing::info!(generation, "took over a lapsed lease; resuming");
        match Leased::new(
            self.pool.clone(),
            &id.scope,
            mode,
            self.config.isolation,
            &saved,
        ) {
            Ok(leased) => Lookup::TookOver(leased),
            Err(e) => {
                // Nothing can resume it: left to an operator.
                if let Err(e) = park_unreadable(&self.pool, &id.scope, saved.fence(), &e).await {
                    return Lookup::Answer(refusal(store_problem::<DB>(&e), attempts));
                }
                Lookup::Answer(refusal(Problem::reconciling(), attempts))
            }
        }
    }

    /// Runs the handler with its lease and settles the answer; a panic, an
    /// error or a dropped future ends the lease at once.
    async fn run_leased<S, ReqBody, ResBody>(
        &self,
        mut inner: S,
        leased: Leased<DB>,
        parts: Parts,
        body: Bytes,
    ) -> Result<Response<IdempotencyBody<ResBody>>, S::Error>
    where
        S: Service<Request<IdempotencyBody<ReqBody>>, Response = Response<ResBody>>,
        ResBody: Body<Data = Bytes>,
        ResBody::Error: Into<BoxError>,
    {
        let mut guard = ReleaseOnDrop::new(leased.clone());
        let mut req = Request::from_parts(parts, IdempotencyBody::buffered(body));
        req.extensions_mut().insert(leased.clone());
        let handling = Instant::now();
        let result = CatchUnwind {
            inner: inner.call(req),
        }
        .await;
        observe::timing("handler_ms", handling.elapsed());
        let res = match result {
            Err(panic) => {
                guard.disarm();
                release(&leased).await;
                resume_unwind(panic);
            }
            Ok(Err(e)) => {
                guard.disarm();
                release(&leased).await;
                return Err(e);
            }
            Ok(Ok(res)) => res,
        };
        let limit = self.config.max_response_body;
        let answer = match read_response(res, limit).await {
            Ok(answer) => answer,
            Err(problem) => {
                guard.disarm();
                release(&leased).await;
                return Ok(refuse(problem, 1));
            }
        };
        let headers = &self.config.recorded_headers;
        let res = match answer {
            ReadAnswer::Whole(parts, body) => {
                let (res, outcome) =
                    settle(&leased, Response::from_parts(parts, body), headers, None).await;
                buffered(res, outcome)
            }
            // Recorded without its body; the client that ran it gets the
            // whole body as it streams.
            ReadAnswer::Over {
                parts,
                prefix,
                rest,
            } => {
                let res = Response::from_parts(parts, Bytes::new());
                let (res, outcome) = settle(&leased, res, headers, Some(limit)).await;
                if matches!(outcome, IdempotencyOutcome::Executed(_)) {
                    let over = ReadAnswer::Over {
                        parts: res.into_parts().0,
                        prefix,
                        rest,
                    };
                    over.into_response(outcome)
                } else {
                    buffered(res, outcome)
                }
            }
        };
        guard.disarm();
        Ok(res)
    }
}

/// What the row holding a key means for a lease-mode request.
enum Lookup<DB: Backend> {
    Answer(Answer),
    TookOver(Leased<DB>),
    /// A live lease (or a row gone in between): try again after a pause.
    Wait,
}
