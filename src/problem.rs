//! RFC 9457 `application/problem+json` refusals.
//!
//! Every answer the layer gives on its own (rather than the handler's) is a
//! problem document with a stable `type` URI, so a client can tell a key-reuse
//! `422` from a business validation `422`. The same [`ProblemKind`] travels in
//! the response extensions as [`IdempotencyOutcome::Refused`](crate::IdempotencyOutcome::Refused)
//! for outer layers.
//!
//! | kind | status | `type` ends in | meaning |
//! |---|---|---|---|
//! | [`MissingKey`](ProblemKind::MissingKey) | 400 | `#missing-key` | guarded method without `Idempotency-Key` |
//! | [`MalformedKey`](ProblemKind::MalformedKey) | 400 | `#malformed-key` | key empty, too long, bad characters or quoting |
//! | [`MissingPrincipal`](ProblemKind::MissingPrincipal) | 401 | `#missing-principal` | no authenticated principal for the scope |
//! | [`BodyTooLarge`](ProblemKind::BodyTooLarge) | 413 | `#body-too-large` | request body over the limit |
//! | [`InvalidBody`](ProblemKind::InvalidBody) | 400 | `#invalid-body` | body could not be read or fingerprinted |
//! | [`KeyReused`](ProblemKind::KeyReused) | 422 (or 409) | `#key-reused` | same key, different request |
//! | [`InFlight`](ProblemKind::InFlight) | 409 + `Retry-After` | `#in-flight` | the first request with this key is still running (or, on PostgreSQL, this request's own `COMMIT` lost its connection and the server reports it still in progress) |
//! | [`Unconfirmed`](ProblemKind::Unconfirmed) | 409 + `Retry-After` | `#unconfirmed` | the key is taken but its record could not be read |
//! | [`Expired`](ProblemKind::Expired) | 410 | `#expired` | the key's retention is over; it is never executed again. Names `resource_id` (and `resource` plus a `Link` header when a resource link is configured) |
//! | [`CommitUnknown`](ProblemKind::CommitUnknown) | 503 + `Retry-After` | `#commit-unknown` | the connection was lost during `COMMIT` and nothing is recorded: on PostgreSQL the server reports the transaction rolled back (`txid_status`), or could not say and the ledger shows no commit; elsewhere the ledger shows no commit |
//! | [`StoreUnavailable`](ProblemKind::StoreUnavailable) | 503 + `Retry-After` | `#store-unavailable` | the ledger could not be reached; nothing was executed |
//! | [`ResponseTooLarge`](ProblemKind::ResponseTooLarge) | the recorded status | `#response-too-large` | a replay: the first answer with this key was over the recording limit; its operation committed and its status and headers were recorded without its body, which this problem body replaces (the first client got the whole body) |
//! | [`ResponseUnreadable`](ProblemKind::ResponseUnreadable) | 500 | `#response-unreadable` | the handler's body failed while being recorded; rolled back |
//! | [`TransactionHeld`](ProblemKind::TransactionHeld) | 500 | `#transaction-held` | the handler kept the transaction handle past its response; rolled back |
//! | [`StoreBusy`](ProblemKind::StoreBusy) | 503 + `Retry-After` | `#store-busy` | the store is busy (SQLite's write lock, no free pooled connection); nothing was executed |
//! | [`TransactionConflict`](ProblemKind::TransactionConflict) | 503 + `Retry-After` | `#transaction-conflict` | a serialization failure or deadlock at commit; everything was rolled back |
//! | [`TransactionEnded`](ProblemKind::TransactionEnded) | 500 | `#transaction-ended` | the handler ended the claimed transaction itself (`COMMIT`, `ROLLBACK`, implicitly committing DDL); what it committed stays, and the key answers `#reconciling` until an operator resolves it |
//! | [`Reconciling`](ProblemKind::Reconciling) | 503 + `Retry-After` | `#reconciling` | the outcome of the first request with this key is unknown; it is never executed again automatically, and an operator resolves it (see [`Reconciler`](crate::Reconciler)) |
//! | [`LeaseMisuse`](ProblemKind::LeaseMisuse) | 500 | `#lease-misuse` | lease mode: the handler misused it (a step or point name the ledger cannot hold, a second final phase); a programming error, never retried by itself; the key stays claimable, so a fixed deployment serves the retry |
//! | [`LeaseLost`](ProblemKind::LeaseLost) | 409 + `Retry-After` | `#lease-lost` | lease mode: this attempt ran past its lease and a later attempt took the key over; nothing this attempt wrote after that was kept, and the retry gets the later attempt's answer |

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde_json::json;

/// Where the problem types are documented; each `type` is this plus a fragment.
pub const PROBLEM_TYPE_BASE: &str =
    "https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/index.html";

/// The cases the layer answers itself. See the [module docs](self) for the
/// status and `type` of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// A guarded method without an `Idempotency-Key` header, and the key is required.
    MissingKey,
    /// The `Idempotency-Key` header is not a valid key.
    MalformedKey,
    /// The principal extractor found no principal.
    MissingPrincipal,
    /// The request body is larger than the configured limit.
    BodyTooLarge,
    /// The request body could not be read or fingerprinted (for example JSON
    /// that does not parse).
    InvalidBody,
    /// The key was used before with a different request.
    KeyReused,
    /// The first request with this key is still running.
    InFlight,
    /// The claim conflicted but the existing record could not be read within
    /// the retry limits.
    Unconfirmed,
    /// The key's retention has ended.
    Expired,
    /// The connection was lost while committing, and nothing was committed
    /// as far as the store can tell: PostgreSQL reports the transaction
    /// rolled back, or (when it cannot say, and on the other stores) the
    /// ledger shows no commit. A retry with the same key is safe.
    CommitUnknown,
    /// The ledger store could not be reached before anything was executed.
    StoreUnavailable,
    /// A replay of an answer whose body was over the recording limit: the
    /// operation committed, its status and headers were recorded, and its
    /// body was not kept (the first client got it whole). Answered with the
    /// recorded status, never by running the handler again.
    ResponseTooLarge,
    /// The handler's response body failed while being read for recording.
    ResponseUnreadable,
    /// The handler still held the transaction when its response was ready.
    TransactionHeld,
    /// The store is busy: SQLite's write lock is held, or the pool has no
    /// free connection within the wait. Nothing was executed.
    StoreBusy,
    /// A serialization failure or deadlock at commit: nothing was committed.
    TransactionConflict,
    /// The handler ended the claimed transaction itself.
    TransactionEnded,
    /// The key's first request has an unknown outcome, awaiting an operator.
    Reconciling,
    /// Lease mode: this attempt's lease was taken over by a later attempt
    /// (it ran past its lease); the later attempt answers for the key.
    LeaseLost,
    /// Lease mode: the handler misused it (a step or point name the ledger
    /// cannot hold, a second final phase): a programming error, not an
    /// outage. Nothing of the attempt's misused call ran, and the key stays
    /// claimable, so a fixed deployment serves the retry.
    LeaseMisuse,
}

impl ProblemKind {
    /// The stable fragment of the `type` URI, such as `"key-reused"`.
    pub fn slug(self) -> &'static str {
        match self {
            Self::MissingKey => "missing-key",
            Self::MalformedKey => "malformed-key",
            Self::MissingPrincipal => "missing-principal",
            Self::BodyTooLarge => "body-too-large",
            Self::InvalidBody => "invalid-body",
            Self::KeyReused => "key-reused",
            Self::InFlight => "in-flight",
            Self::Unconfirmed => "unconfirmed",
            Self::Expired => "expired",
            Self::CommitUnknown => "commit-unknown",
            Self::StoreUnavailable => "store-unavailable",
            Self::ResponseTooLarge => "response-too-large",
            Self::ResponseUnreadable => "response-unreadable",
            Self::TransactionHeld => "transaction-held",
            Self::StoreBusy => "store-busy",
            Self::TransactionConflict => "transaction-conflict",
            Self::TransactionEnded => "transaction-ended",
            Self::Reconciling => "reconciling",
            Self::LeaseLost => "lease-lost",
            Self::LeaseMisuse => "lease-misuse",
        }
    }

    /// The full `type` URI of the problem document.
    pub fn type_uri(self) -> String {
        format!("{PROBLEM_TYPE_BASE}#{}", self.slug())
    }

    pub(crate) fn title(self) -> &'static str {
        match self {
            Self::MissingKey => "Idempotency-Key header required",
            Self::MalformedKey => "Malformed Idempotency-Key",
            Self::MissingPrincipal => "Authentication required",
            Self::BodyTooLarge => "Request body too large",
            Self::InvalidBody => "Invalid request body",
            Self::KeyReused => "Idempotency-Key reused with a different request",
            Self::InFlight => "A request with this Idempotency-Key is in progress",
            Self::Unconfirmed => "Request status unconfirmed",
            Self::Expired => "Idempotency-Key expired",
            Self::CommitUnknown => "Outcome not confirmed",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::ResponseTooLarge => "Response too large to record",
            Self::ResponseUnreadable => "Response could not be recorded",
            Self::TransactionHeld => "Transaction handle held past the response",
            Self::StoreBusy => "Idempotency store busy",
            Self::TransactionConflict => "Transaction conflict",
            Self::TransactionEnded => "Transaction ended by the handler",
            Self::Reconciling => "Outcome unknown, awaiting reconciliation",
            Self::LeaseLost => "The request was taken over by a retry",
            Self::LeaseMisuse => "Lease mode misused by the handler",
        }
    }

    fn default_status(self) -> StatusCode {
        match self {
            Self::MissingKey | Self::MalformedKey | Self::InvalidBody => StatusCode::BAD_REQUEST,
            Self::MissingPrincipal => StatusCode::UNAUTHORIZED,
            Self::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::InFlight | Self::Unconfirmed | Self::LeaseLost => StatusCode::CONFLICT,
            Self::Expired => StatusCode::GONE,
            Self::CommitUnknown
            | Self::StoreUnavailable
            | Self::StoreBusy
            | Self::TransactionConflict
            | Self::Reconciling => StatusCode::SERVICE_UNAVAILABLE,
            Self::ResponseTooLarge
            | Self::ResponseUnreadable
            | Self::TransactionHeld
            | Self::TransactionEnded
            | Self::LeaseMisuse => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// One refusal, ready to become a response.
#[derive(Debug, Clone)]
pub(crate) struct Problem {
    pub(crate) kind: ProblemKind,
    pub(crate) status: StatusCode,
    pub(crate) detail: String,
    pub(crate) retry_after_secs: Option<u64>,
    pub(crate) resource_id: Option<String>,
    pub(crate) resource_link: Option<String>,
}

/// How soon a retry of a parked key is worth it, seconds.
pub(crate) const RECONCILING_RETRY: u64 = 30;

impl Problem {
    /// The answer for a guarded request without an authenticated principal.
    pub(crate) fn missing_principal() -> Self {
        Self::new(
            ProblemKind::MissingPrincipal,
            "the request carries no authenticated principal to scope its Idempotency-Key",
        )
    }

    /// The answer for a key whose record is parked.
    pub(crate) fn reconciling() -> Self {
        let detail = "the outcome of the first request with this Idempotency-Key is unknown; it is not executed again until it has been reconciled. Retry later with the same key";
        Self::new(ProblemKind::Reconciling, detail).retry_after(RECONCILING_RETRY)
    }

    /// The answer for an attempt that lost its lease to a later one.
    pub(crate) fn lease_lost() -> Self {
        let detail = "this attempt ran past its lease and a later attempt with the same Idempotency-Key took over; retry with the same key to get its answer";
        Self::new(ProblemKind::LeaseLost, detail).retry_after(1)
    }

    pub(crate) fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            status: kind.default_status(),
            detail: detail.into(),
            retry_after_secs: None,
            resource_id: None,
            resource_link: None,
        }
    }

    pub(crate) fn status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    pub(crate) fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after_secs = Some(secs.max(1));
        self
    }

    pub(crate) fn resource(mut self, id: Option<String>, link: Option<String>) -> Self {
        self.resource_id = id;
        self.resource_link = link;
        self
    }

    pub(crate) fn into_response(self) -> Response<Bytes> {
        let mut doc = json!({
            "type": self.kind.type_uri(),
            "title": self.kind.title(),
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        if let Some(id) = &self.resource_id {
            doc["resource_id"] = json!(id);
        }
        if let Some(link) = &self.resource_link {
            doc["resource"] = json!(link);
        }
        let body = Bytes::from(doc.to_string());
        let mut res = Response::new(body);
        *res.status_mut() = self.status;
        res.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        let link = self
            .resource_link
            .as_ref()
            .map(|l| format!("<{l}>; rel=\"related\""));
        if let Some(value) = link.and_then(|l| HeaderValue::from_str(&l).ok()) {
            res.headers_mut().insert(header::LINK, value);
        }
        if let Some(secs) = self.retry_after_secs {
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        res
    }
}
