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

use http::StatusCode;

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
