//! The claim-at-commit mode (`IdempotencyLayer::with_claim_at_commit`):
//! no claim statement before the handler. The handler runs at once on a
//! transaction that holds nothing of the key; the ledger row is written
//! with the `COMMIT`, under the unique constraint, and a request that
//! loses there is rolled back whole and answered from the ledger, as a
//! duplicate of the claim-first mode is. What an existing record means
//! (the decision table) stays in [`claim`](super::claim); this module only
//! takes and settles the transaction differently.

use std::time::{Duration, Instant};

use super::claim::{Claimed, Pending};
use super::{Answer, Identity, Run, refusal, store_problem};
use crate::store::{
    AtCommitOutcome, Backend, Claimed as ClaimedTx, Completion, FinishError, MIN_READ_WAIT,
    StoreErrorKind,
};

/// What recording at commit came to.
pub(super) enum AtCommit {
    /// The row was written and committed (or the commit failed, as the
    /// error says, to be explained as in the claim-first mode).
    Finished(Result<i64, FinishError>),
    /// Another request's row held the scope: nothing of this one
    /// committed, and this is its answer.
    Lost(Answer),
}

impl<DB: Backend> Run<DB> {
    /// Begins the transaction the handler runs on, holding nothing of the
    /// key. A request known to be a duplicate (its local leader answered),
    /// or every request with `with_read_first`, reads the ledger first; so
    /// does a request whose scope `finished_here` (a hint: a read that
    /// fails then proves nothing, and the request goes on, the row's
    /// constraint deciding as for any other).
    pub(super) async fn begin_at_commit(
        &self,
        id: &Identity<'_>,
        duplicate: bool,
        finished_here: bool,
        deadline: Instant,
    ) -> Claimed<DB> {
        let must_read = self.config.read_first || duplicate;
        if must_read || finished_here {
            let read_by = match must_read {
                true => deadline,
                false => deadline.min(Instant::now() + MIN_READ_WAIT),
            };
            match self.lookup(id, read_by, 1).await {
                Ok(Some(answer)) => return Claimed::Answer(answer),
                Ok(None) => {}
                Err(_) if !must_read => {}
                Err(e) => return Claimed::Answer(refusal(store_problem::<DB>(&e), 1)),
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let mut conn = match tokio::time::timeout(left, crate::store::acquire(&self.pool)).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => return Claimed::Answer(refusal(store_problem::<DB>(&e), 1)),
            Err(_) => {
                let e = sqlx::Error::PoolTimedOut;
                return Claimed::Answer(refusal(store_problem::<DB>(&e), 1));
            }
        };
        if let Err(e) = self.find_ledger(&mut conn).await {
            return Claimed::Answer(refusal(store_problem::<DB>(&e), 1));
        }
        match DB::begin_at_commit(conn, &self.ledger_claim(id)).await {
            Ok(tx) => Claimed::Won(tx),
            Err(e) => Claimed::Answer(refusal(store_problem::<DB>(&e), 1)),
        }
    }

    /// In the claim-at-commit mode, the answer a committed record of the
    /// key calls for, read in a transaction of its own: for an answer the
    /// layer would otherwise give without writing a row (a rejection, a
    /// `5xx`) or before writing it (one that streams past the recording
    /// limit), since this request's handler may have run for a key that
    /// was already recorded. `None` in the claim-first mode (the claim
    /// read it), or when no record can be read.
    pub(super) async fn recorded_at_commit(&self, id: &Identity<'_>) -> Option<Answer> {
        if !self.config.claim_at_commit {
            return None;
        }
        let deadline = Instant::now() + MIN_READ_WAIT;
        self.lookup(id, deadline, 1).await.ok().flatten()
    }

    /// How long the row written at commit may wait for another request's
    /// uncommitted row of the same scope: the layer's in-flight wait,
    /// never past the caller's deadline.
    pub(super) fn commit_wait(&self) -> Duration {
        match self.caller_deadline {
            Some(deadline) => self
                .config
                .in_flight_wait
                .min(deadline.saturating_duration_since(Instant::now())),
            None => self.config.in_flight_wait,
        }
        .max(Duration::from_millis(1))
    }

    /// Writes the ledger row under the unique constraint and commits; a
    /// request that loses there (everything of it rolled back) gets the
    /// answer the ledger calls for.
    pub(super) async fn finish_at_commit(
        &self,
        tx: ClaimedTx<DB>,
        id: &Identity<'_>,
        completion: &Completion<'_>,
    ) -> AtCommit {
        let mut claim = self.ledger_claim(id);
        claim.lock_wait = self.commit_wait();
        let pending = match DB::finish_at_commit(&self.pool, tx, &claim, completion).await {
            Ok(AtCommitOutcome::Committed(expires_at)) => {
                return AtCommit::Finished(Ok(expires_at));
            }
            // A row committed before ours, read on the way.
            Ok(AtCommitOutcome::Lost(Some(record))) => {
                return AtCommit::Lost(self.judge(&record, id, 1));
            }
            // A row committed before ours: read it (in a transaction of its
            // own, so a stricter level's snapshot never hides it).
            Ok(AtCommitOutcome::Lost(None)) => Pending::Unconfirmed,
            // The other request's row is still uncommitted past the wait.
            Err(FinishError::Store(e)) if DB::error_kind(&e) == StoreErrorKind::LockTimeout => {
                Pending::InFlight
            }
            Err(e) => return AtCommit::Finished(Err(e)),
        };
        let deadline = Instant::now() + MIN_READ_WAIT;
        AtCommit::Lost(match self.lookup(id, deadline, 1).await {
            Ok(Some(answer)) => answer,
            Ok(None) => self.pending(pending, 1),
            Err(e) => refusal(store_problem::<DB>(&e), 1),
        })
    }
}
