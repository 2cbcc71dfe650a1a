//! [`IdempotencyOutcome`]: what the layer did with a request, for outer
//! layers, logs and metrics. Shared by the request path and lease mode.

use crate::classify::Classification;
use crate::problem::ProblemKind;

/// What the layer did with a request. Every response it returns carries one
/// in its extensions, for outer layers (logging, metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdempotencyOutcome {
    /// The method is not guarded, or no key was sent and keys are optional.
    Unguarded,
    /// The handler ran on a fresh claim; the class says what was kept.
    Executed(Classification),
    /// A stored answer was replayed; the handler did not run.
    Replayed,
    /// The layer answered with a problem document; the handler did not run,
    /// or its work was rolled back.
    Refused {
        /// Which refusal.
        problem: ProblemKind,
        /// How many claim attempts were made (0 when refused before claiming).
        attempts: u32,
    },
}

impl IdempotencyOutcome {
    /// A stable label for logs and metrics: `claimed`, `replayed`,
    /// `mismatch`, `in-flight`, `unconfirmed`, `expired`,
    /// `transient-rollback`, `final-failure`, `rejected`, `refused` (bad
    /// input), `store-unavailable`, `store-busy`, `transaction-conflict`,
    /// `transaction-ended`, `reconciling`, `commit-unknown`, `unguarded`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Unguarded => "unguarded",
            Self::Executed(Classification::Success) => "claimed",
            Self::Executed(Classification::FinalFailure) => "final-failure",
            Self::Executed(Classification::Transient) => "transient-rollback",
            Self::Executed(Classification::Rejected) => "rejected",
            Self::Replayed => "replayed",
            Self::Refused { problem, .. } => match problem {
                ProblemKind::KeyReused => "mismatch",
                ProblemKind::InFlight => "in-flight",
                ProblemKind::Unconfirmed => "unconfirmed",
                ProblemKind::Expired => "expired",
                ProblemKind::StoreUnavailable => "store-unavailable",
                ProblemKind::StoreBusy => "store-busy",
                ProblemKind::TransactionConflict => "transaction-conflict",
                ProblemKind::TransactionEnded => "transaction-ended",
                ProblemKind::Reconciling => "reconciling",
                ProblemKind::CommitUnknown => "commit-unknown",
                ProblemKind::ResponseUnreadable | ProblemKind::TransactionHeld => {
                    "transient-rollback"
                }
                _ => "refused",
            },
        }
    }
}
