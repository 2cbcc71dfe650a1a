//! One ledger row as an operator sees it, and how to name it.

use std::borrow::Cow;

use serde_json::{Value, json};

use crate::ResolveError;
use crate::store::{RecordStatus, Scope, UnresolvedRecord};

/// Every column of one ledger row, as read (see [`Ledger::show`](super::Ledger::show)).
///
/// A snapshot: the row may change the moment after it was read.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LedgerRow {
    /// The stored principal (`sha256:…` when it was long).
    pub principal: String,
    /// The stored operation.
    pub operation: String,
    /// The stored key (`sha256:…` with hashed keys, or when it was long).
    pub key: String,
    /// The row's status.
    pub status: RecordStatus,
    /// The request fingerprint (SHA-256).
    pub fingerprint: Vec<u8>,
    /// The `response_status` column: on a settled record, the recorded
    /// answer's status ([`answer_status`](Self::answer_status)); on an
    /// unsettled one, what the handler answered before the layer found its
    /// transaction ended, never sent ([`handler_status`](Self::handler_status)).
    pub response_status: Option<i32>,
    /// The recorded answer's headers, encoded (`name:value\n` each).
    pub response_headers: Option<Vec<u8>>,
    /// The recorded answer's body.
    pub response_body: Option<Vec<u8>>,
    /// The created resource's id, when the handler named one.
    pub resource_id: Option<String>,
    /// When the key was claimed, epoch milliseconds (database clock).
    pub created_at: i64,
    /// End of retention (a tombstone's: when it may be purged), epoch ms.
    pub expires_at: i64,
    /// Lease mode: the fencing generation (0 for the default mode).
    pub generation: i64,
    /// Lease mode: when the lease ends or ended, epoch ms.
    pub locked_until: Option<i64>,
    /// Lease mode: the last committed recovery point.
    pub recovery_point: Option<String>,
    /// Lease mode: what the phases and steps saved (a JSON object).
    pub recovery_data: Option<Vec<u8>>,
    /// Lease mode: the external step whose outcome is not recorded.
    pub pending_step: Option<String>,
    /// Lease mode: until when the pending step's call may still land.
    pub pending_until: Option<i64>,
    /// Lease mode: the claim's random id.
    pub claim_id: Option<String>,
    /// How often the row was parked (`NEEDS_RECONCILIATION`): by a lease-mode
    /// step whose outcome was unknown, or by the layer when a handler ended
    /// its transaction itself. At least 1 while the row is parked.
    pub parks: i64,
    /// The database clock when the row was read, epoch ms: ages are
    /// measured against it, never against this machine's clock.
    pub read_at: i64,
}

impl LedgerRow {
    /// Whether `other` is the same stored scope.
    pub(crate) fn same_scope(&self, other: &Self) -> bool {
        (&self.principal, &self.operation, &self.key)
            == (&other.principal, &other.operation, &other.key)
    }

    /// How long ago the key was claimed, milliseconds (database clock).
    pub fn age_ms(&self) -> i64 {
        self.read_at.saturating_sub(self.created_at)
    }

    /// Whether the outcome is settled (`SUCCEEDED`, `FAILED_FINAL`, or an
    /// `EXPIRED` tombstone): no verdict applies to it.
    pub fn is_settled(&self) -> bool {
        self.status.is_terminal() || self.status == RecordStatus::Expired
    }

    /// The row as a record a verdict can name: its claim, generation and
    /// parks as read now. `None` when it is settled.
    pub fn as_unresolved(&self) -> Option<UnresolvedRecord> {
        if self.is_settled() {
            return None;
        }
        Some(UnresolvedRecord {
            principal: self.principal.clone(),
            operation: self.operation.clone(),
            key: self.key.clone(),
            status: self.status,
            response_status: self.response_status,
            created_at: self.created_at,
            generation: self.generation,
            pending_step: self.pending_step.clone(),
            recovery_point: self.recovery_point.clone(),
            claim_id: self.claim_id.clone(),
            locked_until: self.locked_until,
            parks: self.parks,
        })
    }

    /// Whether a verdict naming the record as `seen` would be recorded on
    /// the row as read: the check the verdict's fenced write makes,
    /// evaluated on this snapshot at its [`read_at`](Self::read_at) (what
    /// a dry run reports). `Err` says why it would be refused, as the
    /// write itself would.
    pub fn admits(&self, seen: &Seen) -> Result<(), ResolveError> {
        if self.is_settled() {
            return Err(ResolveError::Settled {
                status: self.status,
            });
        }
        let (parked, processing) = (
            self.status == RecordStatus::NeedsReconciliation,
            self.status == RecordStatus::Processing,
        );
        if seen.generation == 0 {
            return if self.generation == 0 && (parked || processing) && self.parks == seen.parks {
                Ok(())
            } else {
                Err(ResolveError::Changed {
                    generation: self.generation,
                })
            };
        }
        if self.generation == 0 || self.claim_id != seen.claim_id {
            return Err(ResolveError::Gone);
        }
        let lapsed = self.locked_until.is_none_or(|t| t <= self.read_at);
        let no_call =
            self.pending_step.is_none() || self.pending_until.is_none_or(|t| t <= self.read_at);
        if parked && self.parks == seen.parks {
            return Ok(());
        }
        if processing && self.generation == seen.generation && lapsed && no_call {
            return Ok(());
        }
        if processing && !lapsed {
            return Err(ResolveError::Held {
                retry_after: std::time::Duration::from_millis(
                    u64::try_from(self.locked_until.unwrap_or(0) - self.read_at).unwrap_or(0),
                ),
            });
        }
        Err(ResolveError::Changed {
            generation: self.generation,
        })
    }

    /// What the record is, in one line: its status, answer (or, unsettled,
    /// its [`handler_status`](Self::handler_status), named as such),
    /// generation, parks and lease (for messages about a record that moved).
    pub fn describe(&self) -> String {
        let mut out = self.status.as_str().to_string();
        if let Some(s) = self.answer_status() {
            out.push_str(&format!(" {s}"));
        }
        if let Some(s) = self.handler_status() {
            out.push_str(&format!(", handler status {s} (never sent)"));
        }
        if self.generation > 0 {
            out.push_str(&format!(
                ", generation {}, parks {}",
                self.generation, self.parks
            ));
            if self.status == RecordStatus::Processing {
                match self.locked_until {
                    Some(t) if t > self.read_at => out.push_str(", leased (an attempt holds it)"),
                    _ => out.push_str(", lease lapsed"),
                }
            }
            if let Some(step) = &self.pending_step {
                out.push_str(&format!(", step {step} pending"));
            }
        }
        out
    }

    /// The status of the recorded answer, the one retries replay: set on a
    /// settled record only.
    pub fn answer_status(&self) -> Option<i32> {
        self.response_status.filter(|_| self.is_settled())
    }

    /// The status the handler answered when the layer found that it had
    /// ended the claimed transaction itself: on an unsettled record only.
    /// Never an answer anyone was given: the layer answered that request
    /// `500` (`#transaction-ended`), and retries get `503`
    /// (`#reconciling`) until an operator settles the record. (A message
    /// consumer's record holds `200` here: its handler succeeded, and the
    /// message was not acknowledged.)
    pub fn handler_status(&self) -> Option<i32> {
        self.response_status.filter(|_| !self.is_settled())
    }

    /// The recorded headers as `(name, value)` text pairs.
    pub fn headers(&self) -> Vec<(String, String)> {
        let Some(encoded) = &self.response_headers else {
            return Vec::new();
        };
        encoded
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .filter_map(|line| {
                let colon = line.iter().position(|&b| b == b':')?;
                Some((
                    String::from_utf8_lossy(&line[..colon]).into_owned(),
                    String::from_utf8_lossy(&line[colon + 1..]).into_owned(),
                ))
            })
            .collect()
    }

    /// The recorded body decoded as UTF-8 text; `None` when there is none
    /// or it is not text.
    pub fn body_text(&self) -> Option<&str> {
        self.response_body
            .as_deref()
            .and_then(|b| std::str::from_utf8(b).ok())
    }

    /// The row as JSON: every column, the body as text when it is text
    /// (`response_body`) and as hex otherwise (`response_body_hex`), and
    /// `response_status` named for what it is: `answer_status` (settled)
    /// or `handler_status` (unsettled), the other `null`.
    pub fn to_json(&self) -> Value {
        let mut v = self.before_json();
        if let Value::Object(map) = &mut v {
            map.insert("fingerprint".into(), hex(&self.fingerprint).into());
            map.insert(
                "response_headers".into(),
                self.headers()
                    .into_iter()
                    .map(|(n, v)| json!([n, v]))
                    .collect::<Vec<_>>()
                    .into(),
            );
            match (self.body_text(), &self.response_body) {
                (Some(text), _) => {
                    map.insert("response_body".into(), text.into());
                }
                (None, Some(bytes)) => {
                    map.insert("response_body_hex".into(), hex(bytes).into());
                }
                (None, None) => {
                    map.insert("response_body".into(), Value::Null);
                }
            }
            map.insert("answer_status".into(), json!(self.answer_status()));
            map.insert("handler_status".into(), json!(self.handler_status()));
            map.insert("resource_id".into(), json!(self.resource_id));
            map.insert("age_ms".into(), self.age_ms().into());
            map.insert("read_at".into(), self.read_at.into());
        }
        v
    }

    /// What the audit trail keeps of the row before a verdict: its state,
    /// not the answer (an unsettled row has none).
    pub(crate) fn before_json(&self) -> Value {
        json!({
            "principal": self.principal,
            "operation": self.operation,
            "key": self.key,
            "status": self.status.as_str(),
            "response_status": self.response_status,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "generation": self.generation,
            "locked_until": self.locked_until,
            "recovery_point": self.recovery_point,
            "recovery_data": self.recovery_data.as_deref().map(String::from_utf8_lossy),
            "pending_step": self.pending_step,
            "pending_until": self.pending_until,
            "claim_id": self.claim_id,
            "parks": self.parks,
        })
    }
}

fn hex(bytes: &[u8]) -> String {
    crate::store::hex(bytes)
}

/// A record as an operator saw it (its generation, parks and claim id, as
/// [`Ledger::show`](super::Ledger::show) read them): what a verdict names,
/// so that it is refused if the record moved on since
/// ([`Ledger::resolve_seen`](super::Ledger::resolve_seen)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Seen {
    /// The fencing generation seen (0 for the default mode).
    pub generation: i64,
    /// How often the record had been parked ([`LedgerRow::parks`]).
    pub parks: i64,
    /// The claim id seen (`None` for the default mode).
    pub claim_id: Option<String>,
}

impl Seen {
    /// The record seen at `generation`, parked `parks` times, of the claim
    /// `claim_id`.
    pub fn new(generation: i64, parks: i64, claim_id: Option<String>) -> Self {
        Self {
            generation,
            parks,
            claim_id,
        }
    }

    /// `row` as read.
    pub fn of(row: &LedgerRow) -> Self {
        Self::new(row.generation, row.parks, row.claim_id.clone())
    }
}

/// How an operator names a record: its scope as the client sent it
/// ([`new`](Self::new)), or exactly as the ledger stores it
/// ([`stored`](Self::stored), the form listings print).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    principal: String,
    operation: String,
    key: String,
    stored: bool,
}

impl Lookup {
    /// The record of `(principal, operation, key)` as the client sent
    /// them: the key as the `Idempotency-Key` header's value (a Structured
    /// Field String `"…"` or a bare value, parsed as the layer parses it),
    /// each value in the form the layer stores it (long values, and every
    /// key with `with_hashed_keys`, as `sha256:…`). The values are also
    /// tried as stored, so a listing's `sha256:…` form names its record.
    ///
    /// When the two readings name two different records (a stored key
    /// `"abc"`, quotes included, beside a key `abc` sent as `"abc"`), the
    /// lookup is ambiguous: [`Ledger::find`](super::Ledger::find) returns
    /// both, the reading as sent first, and a verdict through it is refused
    /// ([`ResolveError::Ambiguous`](crate::reconcile::ResolveError::Ambiguous)).
    /// Name the record with [`stored`](Self::stored) then.
    pub fn new(
        principal: impl Into<String>,
        operation: impl Into<String>,
        key: impl Into<String>,
    ) -> Self {
        Self {
            principal: principal.into(),
            operation: operation.into(),
            key: key.into(),
            stored: false,
        }
    }

    /// The record whose stored scope is exactly `(principal, operation,
    /// key)`, as listings print it: no other form is tried, so it is never
    /// ambiguous.
    pub fn stored(
        principal: impl Into<String>,
        operation: impl Into<String>,
        key: impl Into<String>,
    ) -> Self {
        Self {
            stored: true,
            ..Self::new(principal, operation, key)
        }
    }

    /// The stored scopes this lookup may name: the reading as sent first,
    /// then the values as stored; without repeats (at most nineteen,
    /// usually two).
    pub(crate) fn candidates(&self) -> Vec<(String, String, String)> {
        let literal = (
            self.principal.clone(),
            self.operation.clone(),
            self.key.clone(),
        );
        if self.stored {
            return vec![literal];
        }
        // What the layer stores for a value as sent (bounded, or hashed),
        // then (`literal`) the value as a listing printed it.
        let forms = |v: &str, op: bool, literal: bool| -> Vec<String> {
            let stored: Cow<'_, str> = if op {
                crate::scope::http_operation(v)
            } else {
                crate::scope::bounded(v)
            };
            let mut out = vec![stored.into_owned()];
            for f in [crate::scope::hashed(v).into_owned(), v.to_string()]
                .into_iter()
                .take(if literal { 2 } else { 1 })
            {
                if !out.contains(&f) {
                    out.push(f);
                }
            }
            out
        };
        // The key as the header carried it: the layer stores a Structured
        // Field String (`"…"`) unquoted, a bare value as it is.
        let sent_key =
            crate::key::IdempotencyKey::parse(self.key.as_bytes(), crate::key::KeyMode::Lenient)
                .map_or_else(|_| self.key.clone(), |k| k.as_str().to_string());
        let mut out = Vec::new();
        for p in forms(&self.principal, false, true) {
            for o in forms(&self.operation, true, true) {
                for k in forms(&sent_key, false, false) {
                    let c = (p.clone(), o.clone(), k);
                    if !out.contains(&c) {
                        out.push(c);
                    }
                }
            }
        }
        if !out.contains(&literal) {
            out.push(literal);
        }
        out
    }
}

/// A scope borrowed from owned parts.
pub(crate) fn scope_of(parts: &(String, String, String)) -> Scope<'_> {
    Scope {
        principal: &parts.0,
        operation: &parts.1,
        key: &parts.2,
    }
}
