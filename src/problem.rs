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
//! | [`TransactionMissing`](ProblemKind::TransactionMissing) | 500 | `#transaction-missing` | a handler took [`Tx`](crate::Tx) where the layer claimed nothing (a route added after `.layer(…)`, an unguarded method); the handler's answer ([`TxError`](crate::TxError)) |
//! | [`TransactionBusy`](ProblemKind::TransactionBusy) | 500 | `#transaction-busy` | a handler locked [`Tx`](crate::Tx) twice at once; rolled back |
//! | [`TransactionFinished`](ProblemKind::TransactionFinished) | 500 | `#transaction-finished` | a handler locked [`Tx`](crate::Tx) after the layer took the transaction back |
//! | [`DatabaseError`](ProblemKind::DatabaseError) | 500 | `#database-error` | a handler's statement failed ([`HandlerError`](crate::HandlerError) from a `sqlx::Error` that is not transient; a transient one answers `#store-busy`, `#store-unavailable` or `#transaction-conflict`); rolled back, the database's message logged, never sent |
//!
//! # Members
//!
//! Every document carries, besides `type`, `title`, `status` and `detail`:
//!
//! - `instance`: `urn:uuid:…`, new for every answer, and written in the
//!   layer's `tracing` event for that answer (`idempotency problem
//!   answered`, INFO for a 4xx, WARN for a 5xx, with `problem` and
//!   `status`), so an operator finds the line a client quotes;
//! - `retryable`: whether the same request with the same key may be sent
//!   again as it is ([`ProblemKind::retryable`]);
//! - `idempotency_key`: the request's key as the client sent it (unquoted,
//!   never the stored form), in the layer's own answers once a valid key
//!   was read. A missing key has none, and a malformed one (or a header and
//!   a body field that disagree) is never echoed. A handler's errors do not
//!   name it;
//! - `spec`: the section of the IETF draft the refusal rests on, for those
//!   that rest on one ([`ProblemKind::draft_section`]): `#section-2.1` for a
//!   missing or malformed key, `#section-2.2` for a reused one,
//!   `#section-2.3` for an expired one, `#section-2.6` for one in flight.
//!
//! `docs/ietf-draft.md` lists where the layer departs from the draft.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde_json::json;

/// Where the problem types are documented; each `type` is this plus a fragment.
pub const PROBLEM_TYPE_BASE: &str =
    "https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/index.html";

/// A section of the IETF draft the `spec` member links to, at the
/// revision this crate was checked against.
macro_rules! draft {
    ($section:literal) => {
        concat!(
            "https://datatracker.ietf.org/doc/html/draft-ietf-httpapi-idempotency-key-header-07#section-",
            $section
        )
    };
}
const DRAFT_SYNTAX: &str = draft!("2.1");
const DRAFT_UNIQUENESS: &str = draft!("2.2");
const DRAFT_EXPIRY: &str = draft!("2.3");
const DRAFT_ENFORCEMENT: &str = draft!("2.6");

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
    /// A handler asked for [`Tx`](crate::Tx) where the layer claimed
    /// nothing: the route is not behind the layer (added after
    /// `.layer(…)`), the method is not guarded, or keys are optional and
    /// none was sent. A server misconfiguration ([`TxError::Missing`](crate::TxError::Missing)).
    TransactionMissing,
    /// A handler locked [`Tx`](crate::Tx) while another guard of it was
    /// alive ([`TxError::Busy`](crate::TxError::Busy)); rolled back.
    TransactionBusy,
    /// A handler locked [`Tx`](crate::Tx) after the layer had taken the
    /// transaction back ([`TxError::Finished`](crate::TxError::Finished)).
    TransactionFinished,
    /// A handler's own statement failed with an error that is not
    /// transient (see [`HandlerError`](crate::HandlerError)); rolled back.
    /// The database's message is logged, never sent.
    DatabaseError,
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
            Self::TransactionMissing => "transaction-missing",
            Self::TransactionBusy => "transaction-busy",
            Self::TransactionFinished => "transaction-finished",
            Self::DatabaseError => "database-error",
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
            Self::TransactionMissing => "No idempotency transaction for this route",
            Self::TransactionBusy => "Idempotency transaction already locked",
            Self::TransactionFinished => "Idempotency transaction already finished",
            Self::DatabaseError => "Database error",
        }
    }

    /// Whether the client may send the same request with the same key
    /// again and expect it to succeed without changing anything: nothing
    /// of this attempt was committed and the cause passes (a duplicate
    /// still running, a busy or unreachable store, a conflict, an outcome
    /// an operator is settling). `false` when the request must change
    /// (a missing, malformed or reused key, a body over the limit), when
    /// the answer is final (an expired key, a replay), or when the cause
    /// is the server's own bug that a retry would meet again. Written as
    /// the problem document's `retryable` member.
    pub fn retryable(self) -> bool {
        match self {
            Self::InFlight
            | Self::Unconfirmed
            | Self::CommitUnknown
            | Self::StoreUnavailable
            | Self::StoreBusy
            | Self::TransactionConflict
            | Self::Reconciling
            | Self::LeaseLost
            | Self::ResponseUnreadable => true,
            Self::MissingKey
            | Self::MalformedKey
            | Self::MissingPrincipal
            | Self::BodyTooLarge
            | Self::InvalidBody
            | Self::KeyReused
            | Self::Expired
            | Self::ResponseTooLarge
            | Self::TransactionHeld
            | Self::TransactionEnded
            | Self::LeaseMisuse
            | Self::TransactionMissing
            | Self::TransactionBusy
            | Self::TransactionFinished
            | Self::DatabaseError => false,
        }
    }

    /// The section of the IETF draft (`draft-ietf-httpapi-idempotency-key-header-07`)
    /// the refusal rests on, as a URL, for the refusals that rest on one:
    /// `#section-2.1` (Syntax) for a missing or malformed key,
    /// `#section-2.2` (Uniqueness) for a key reused with another request,
    /// `#section-2.3` (Validity and Expiry) for an expired key,
    /// `#section-2.6` (Enforcement Scenarios: a concurrent request) for a
    /// key still in flight. Written as the problem document's `spec` member.
    pub fn draft_section(self) -> Option<&'static str> {
        match self {
            Self::MissingKey | Self::MalformedKey => Some(DRAFT_SYNTAX),
            Self::KeyReused => Some(DRAFT_UNIQUENESS),
            Self::Expired => Some(DRAFT_EXPIRY),
            Self::InFlight => Some(DRAFT_ENFORCEMENT),
            _ => None,
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
            | Self::LeaseMisuse
            | Self::TransactionMissing
            | Self::TransactionBusy
            | Self::TransactionFinished
            | Self::DatabaseError => StatusCode::INTERNAL_SERVER_ERROR,
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
    /// Why, for the log line only (a database's message): never sent.
    pub(crate) cause: Option<String>,
}

/// A problem answer's document, kept in the response's extensions so that
/// the layer can name the request's key in it ([`name_key`]) once the key is
/// known. Never leaves the crate: an answer a handler returns through the
/// axum conversions ([`Problem::into_axum`]) drops it.
#[derive(Debug, Clone)]
pub(crate) struct Document(serde_json::Map<String, serde_json::Value>);

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
            cause: None,
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

    /// Logs `cause` with the refusal's log line, never sending it.
    #[cfg(feature = "axum")]
    pub(crate) fn cause(mut self, cause: impl std::fmt::Display) -> Self {
        self.cause = Some(cause.to_string());
        self
    }

    /// The answer: an `application/problem+json` document with `type`,
    /// `title`, `status`, `detail`, a fresh `instance` (`urn:uuid:…`),
    /// `retryable`, and `spec` where the IETF draft has a section for it.
    /// One `tracing` event names the instance (WARN for a 5xx, INFO
    /// otherwise), so the operator finds the line a client quotes.
    pub(crate) fn into_response(self) -> Response<Bytes> {
        let instance = format!("urn:uuid:{}", crate::random::uuid_v4());
        let mut doc = serde_json::Map::new();
        doc.insert("type".into(), json!(self.kind.type_uri()));
        doc.insert("title".into(), json!(self.kind.title()));
        doc.insert("status".into(), json!(self.status.as_u16()));
        doc.insert("detail".into(), json!(self.detail));
        doc.insert("instance".into(), json!(instance));
        doc.insert("retryable".into(), json!(self.kind.retryable()));
        if let Some(section) = self.kind.draft_section() {
            doc.insert("spec".into(), json!(section));
        }
        if let Some(id) = &self.resource_id {
            doc.insert("resource_id".into(), json!(id));
        }
        if let Some(link) = &self.resource_link {
            doc.insert("resource".into(), json!(link));
        }
        let problem = self.kind.slug();
        let status = self.status.as_u16();
        let cause = self.cause.as_deref().unwrap_or("");
        if self.status.is_server_error() {
            tracing::warn!(%instance, problem, status, cause, "idempotency problem answered");
        } else {
            tracing::info!(%instance, problem, status, "idempotency problem answered");
        }
        let body = Bytes::from(serde_json::Value::Object(doc.clone()).to_string());
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
        res.extensions_mut().insert(Document(doc));
        res
    }

    /// The answer as an axum response, for errors a handler returns
    /// ([`TxError`](crate::TxError), [`HandlerError`](crate::HandlerError),
    /// [`LeaseError`](crate::lease::LeaseError)): the same document, without
    /// the layer's private extension (the layer names its key only in the
    /// answers it gives itself).
    #[cfg(feature = "axum")]
    pub(crate) fn into_axum(self) -> axum::response::Response {
        let (parts, body) = self.into_standalone().into_parts();
        axum::response::Response::from_parts(parts, axum::body::Body::from(body))
    }

    /// The answer of a service other than the layer (the key-status
    /// endpoint, a handler's error): the same document, without the
    /// layer's private extension.
    pub(crate) fn into_standalone(self) -> Response<Bytes> {
        let mut res = self.into_response();
        res.extensions_mut().remove::<Document>();
        res
    }
}

/// Names `key` (the request's key as the client sent it, unquoted) in the
/// layer's own problem answer `res` as the `idempotency_key` member. Any
/// other answer, and any answer when no valid key was read (a missing or
/// malformed one is never echoed), is returned as it is.
pub(crate) fn name_key<B>(
    mut res: Response<crate::IdempotencyBody<B>>,
    key: Option<&str>,
) -> Response<crate::IdempotencyBody<B>> {
    let Some(Document(mut doc)) = res.extensions_mut().remove::<Document>() else {
        return res;
    };
    // Only the layer's own answers: never what a handler answered.
    let own = matches!(
        res.extensions().get::<crate::IdempotencyOutcome>(),
        Some(crate::IdempotencyOutcome::Refused { .. } | crate::IdempotencyOutcome::Replayed)
    );
    let Some(key) = key.filter(|_| own) else {
        return res;
    };
    doc.insert("idempotency_key".into(), json!(key));
    let body = Bytes::from(serde_json::Value::Object(doc).to_string());
    *res.body_mut() = crate::IdempotencyBody::buffered(body);
    res.headers_mut().remove(header::CONTENT_LENGTH);
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(res: &Response<Bytes>) -> serde_json::Value {
        serde_json::from_slice(res.body()).unwrap()
    }

    #[test]
    fn every_document_names_its_instance_and_whether_to_retry() {
        let a = Problem::new(ProblemKind::StoreBusy, "busy").into_response();
        let b = Problem::new(ProblemKind::StoreBusy, "busy").into_response();
        let (a, b) = (doc(&a), doc(&b));
        assert!(a["instance"].as_str().unwrap().starts_with("urn:uuid:"));
        assert_ne!(a["instance"], b["instance"]);
        assert_eq!(a["retryable"], true);
        assert!(a.get("spec").is_none());
        assert!(a.get("idempotency_key").is_none());
    }

    #[test]
    fn refusals_link_the_drafts_section_they_rest_on() {
        let section = |kind: ProblemKind| {
            kind.draft_section()
                .map(|s| s.rsplit('#').next().unwrap().to_owned())
        };
        assert_eq!(
            section(ProblemKind::MissingKey).as_deref(),
            Some("section-2.1")
        );
        assert_eq!(
            section(ProblemKind::MalformedKey).as_deref(),
            Some("section-2.1")
        );
        assert_eq!(
            section(ProblemKind::KeyReused).as_deref(),
            Some("section-2.2")
        );
        assert_eq!(
            section(ProblemKind::Expired).as_deref(),
            Some("section-2.3")
        );
        assert_eq!(
            section(ProblemKind::InFlight).as_deref(),
            Some("section-2.6")
        );
        assert_eq!(section(ProblemKind::StoreBusy), None);
        let expired = doc(&Problem::new(ProblemKind::Expired, "gone").into_response());
        assert_eq!(
            expired["spec"],
            ProblemKind::Expired.draft_section().unwrap()
        );
        assert_eq!(expired["retryable"], false);
    }
}
