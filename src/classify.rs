//! Sorting the handler's answer into what the ledger does with it, and the
//! marks a handler attaches to its response.
//!
//! | class | default for | effect |
//! |---|---|---|
//! | [`Success`](Classification::Success) | 1xx, 2xx, 3xx | response recorded as `SUCCEEDED`, committed with the handler's writes |
//! | [`Rejected`](Classification::Rejected) | 400, 401, 403, 404, 405, 406, 408, 413, 415, 422, 429 | everything rolled back, answer passed through unrecorded; the key stays usable for a corrected request |
//! | [`FinalFailure`](Classification::FinalFailure) | every other 4xx (402, 409, 410, …) | business writes rolled back to the savepoint taken after the claim, response recorded as `FAILED_FINAL`, committed |
//! | [`Transient`](Classification::Transient) | 5xx, an inner service error, a panic, a dropped future | everything rolled back, nothing recorded; a retry runs afresh |
//!
//! A handler overrides the default for one response by putting a
//! [`Classification`] in the response extensions (with axum:
//! `(Extension(Classification::FinalFailure), …)`).
//!
//! A gRPC answer (`content-type: application/grpc…`) is sorted by its
//! `grpc-status` (in the trailers, or in the headers of a trailers-only
//! answer) instead of its HTTP status, which is `200` either way:
//!
//! | class | `grpc-status` |
//! |---|---|
//! | [`Success`](Classification::Success) | `OK` (0) |
//! | [`Rejected`](Classification::Rejected) | `INVALID_ARGUMENT` (3), `NOT_FOUND` (5), `PERMISSION_DENIED` (7), `OUT_OF_RANGE` (11), `UNIMPLEMENTED` (12), `UNAUTHENTICATED` (16) |
//! | [`FinalFailure`](Classification::FinalFailure) | `ALREADY_EXISTS` (6), `FAILED_PRECONDITION` (9): recorded and replayed with their trailers (details included) |
//! | [`Transient`](Classification::Transient) | `CANCELLED` (1), `UNKNOWN` (2), `DEADLINE_EXCEEDED` (4), `RESOURCE_EXHAUSTED` (8), `ABORTED` (10), `INTERNAL` (13), `UNAVAILABLE` (14), `DATA_LOSS` (15), any other code, and a finished gRPC answer with no readable `grpc-status` |
//!
//! A gRPC answer over the recording limit is sorted by a `grpc-status` in
//! its headers when it has one, and is otherwise a
//! [`Success`](Classification::Success): its trailers come after a body the
//! layer does not hold back.

use http::{HeaderMap, StatusCode};

/// What the ledger does with a handler's response. Insert one into the
/// response extensions to override the status-based default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Classification {
    /// The operation took effect: record and commit.
    Success,
    /// The request was refused before anything executed: roll back, record
    /// nothing, let the key be reused with a corrected request.
    Rejected,
    /// A final business outcome (out of stock, card declined): undo the
    /// business writes, record the error response so retries replay it.
    FinalFailure,
    /// A retryable failure: roll back everything, record nothing.
    Transient,
}

impl Classification {
    /// The default classification of a status code (see the module table).
    pub fn from_status(status: StatusCode) -> Self {
        match status.as_u16() {
            100..=399 => Self::Success,
            400 | 401 | 403 | 404 | 405 | 406 | 408 | 413 | 415 | 422 | 429 => Self::Rejected,
            400..=499 => Self::FinalFailure,
            _ => Self::Transient,
        }
    }

    /// The default classification of a gRPC status code (see the module
    /// table).
    pub fn from_grpc_status(code: u32) -> Self {
        match code {
            0 => Self::Success,
            3 | 5 | 7 | 11 | 12 | 16 => Self::Rejected,
            6 | 9 => Self::FinalFailure,
            _ => Self::Transient,
        }
    }

    /// The class of an answer: the handler's mark, else (a gRPC answer)
    /// its `grpc-status`, else its HTTP status. `trailers`: what its body
    /// ended with; `whole`: the body was read to its end.
    pub(crate) fn of_answer(
        parts: &http::response::Parts,
        trailers: Option<&HeaderMap>,
        whole: bool,
    ) -> Self {
        if let Some(class) = parts.extensions.get::<Self>() {
            return *class;
        }
        if !is_grpc(&parts.headers) {
            return Self::from_status(parts.status);
        }
        let code = trailers
            .and_then(|t| t.get("grpc-status"))
            .or_else(|| parts.headers.get("grpc-status"))
            .and_then(|v| v.to_str().ok()?.parse::<u32>().ok());
        match code {
            Some(code) => Self::from_grpc_status(code),
            None if whole => Self::Transient,
            None => Self::Success,
        }
    }
}

/// Whether `headers` are a gRPC message's (`application/grpc`, `application/grpc+proto`, …; not grpc-web, whose
/// trailers travel inside the body).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.as_bytes().strip_prefix(b"application/grpc"))
        .is_some_and(|rest| matches!(rest.first(), None | Some(b'+' | b';')))
}

/// The id of the resource a request created, recorded in the ledger's
/// `resource_id` column (and named in the `410` for an expired key). Insert
/// one into the response extensions.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ResourceId(String);

impl ResourceId {
    /// A resource id.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_table() {
        let c = Classification::from_grpc_status;
        assert_eq!(c(0), Classification::Success);
        for code in [3, 5, 7, 11, 12, 16] {
            assert_eq!(c(code), Classification::Rejected, "{code}");
        }
        for code in [6, 9] {
            assert_eq!(c(code), Classification::FinalFailure, "{code}");
        }
        for code in [1, 2, 4, 8, 10, 13, 14, 15, 17, 99] {
            assert_eq!(c(code), Classification::Transient, "{code}");
        }
    }

    #[test]
    fn default_table() {
        let c = |s: u16| Classification::from_status(StatusCode::from_u16(s).unwrap());
        assert_eq!(c(200), Classification::Success);
        assert_eq!(c(201), Classification::Success);
        assert_eq!(c(303), Classification::Success);
        for s in [400, 401, 403, 404, 405, 406, 408, 413, 415, 422, 429] {
            assert_eq!(c(s), Classification::Rejected, "{s}");
        }
        for s in [402, 409, 410, 412, 451] {
            assert_eq!(c(s), Classification::FinalFailure, "{s}");
        }
        for s in [500, 502, 503, 504] {
            assert_eq!(c(s), Classification::Transient, "{s}");
        }
    }
}
