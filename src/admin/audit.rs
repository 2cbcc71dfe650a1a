//! The operators' audit trail: who settled a record, why, when, and what
//! the record was before.

use serde_json::{Value, json};

/// The longest actor name kept, in bytes.
pub const MAX_ACTOR_LEN: usize = 255;
/// The longest reason kept, in bytes.
pub const MAX_REASON_LEN: usize = 2000;

/// Who gives a verdict, and why: both recorded with it, in the same
/// transaction (see [`Ledger::resolve`](super::Ledger::resolve)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attribution {
    actor: String,
    reason: String,
}

/// Why an [`Attribution`] was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AttributionError {
    /// The actor is empty (after trimming) or longer than [`MAX_ACTOR_LEN`].
    Actor,
    /// The reason is empty (after trimming) or longer than [`MAX_REASON_LEN`].
    Reason,
}

impl std::fmt::Display for AttributionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Actor => write!(f, "the actor must be 1 to {MAX_ACTOR_LEN} bytes of text"),
            Self::Reason => write!(f, "the reason must be 1 to {MAX_REASON_LEN} bytes of text"),
        }
    }
}

impl std::error::Error for AttributionError {}

impl Attribution {
    /// `actor` (a person or a tool) gives a verdict for `reason`. Both are
    /// trimmed; neither may be empty, hold a NUL, or be longer than its
    /// bound.
    pub fn new(actor: &str, reason: &str) -> Result<Self, AttributionError> {
        let (actor, reason) = (actor.trim(), reason.trim());
        if actor.is_empty() || actor.len() > MAX_ACTOR_LEN || actor.contains('\0') {
            return Err(AttributionError::Actor);
        }
        if reason.is_empty() || reason.len() > MAX_REASON_LEN || reason.contains('\0') {
            return Err(AttributionError::Reason);
        }
        Ok(Self {
            actor: actor.to_string(),
            reason: reason.to_string(),
        })
    }

    /// Who.
    pub fn actor(&self) -> &str {
        &self.actor
    }

    /// Why.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

/// One recorded verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AuditEntry {
    /// The row's id: increasing in the order verdicts committed on one
    /// store.
    pub id: i64,
    /// The record's stored principal.
    pub principal: String,
    /// The record's stored operation.
    pub operation: String,
    /// The record's stored key.
    pub key: String,
    /// Who gave the verdict.
    pub actor: String,
    /// Why.
    pub reason: String,
    /// `succeeded`, `failed` or `rerun`.
    pub verdict: String,
    /// The answer's status code (none for a rerun).
    pub response_status: Option<i32>,
    /// When the verdict committed, epoch milliseconds (database clock).
    pub recorded_at: i64,
    /// The record as it was just before the verdict, a JSON object.
    pub before: String,
}

impl AuditEntry {
    /// The entry as JSON (`before` parsed back into an object).
    pub fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "principal": self.principal,
            "operation": self.operation,
            "key": self.key,
            "actor": self.actor,
            "reason": self.reason,
            "verdict": self.verdict,
            "response_status": self.response_status,
            "recorded_at": self.recorded_at,
            "before": serde_json::from_str::<Value>(&self.before).unwrap_or(Value::Null),
        })
    }
}
