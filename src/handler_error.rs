//! [`HandlerError`]: the one error type an axum handler behind the layer
//! needs.

use axum::response::{IntoResponse, Response};
use http::StatusCode;

use crate::lease::LeaseError;
use crate::problem::{Problem, ProblemKind};
use crate::store::StoreErrorKind;
use crate::tx::TxError;

/// The error an axum handler behind [`IdempotencyLayer`](crate::IdempotencyLayer)
/// returns, so that `?` works on everything it calls: `From<sqlx::Error>`,
/// `From<`[`TxError`]`>` and `From<`[`LeaseError`]`>`, and your own
/// answers through [`HandlerError::from_response`].
///
/// Every case answers as the layer classifies it (see
/// [`Classification`](crate::Classification)):
///
/// | from | answer | the layer |
/// |---|---|---|
/// | [`TxError`] | `500` problem+json `#transaction-missing`, `#transaction-busy` or `#transaction-finished`, not retryable | rolls back |
/// | `sqlx::Error`, transient: a pool timeout, a busy store (SQLite's lock, too many connections), a lost connection, a serialization failure or deadlock, a lock or statement timeout | `503` problem+json `#store-busy`, `#store-unavailable` or `#transaction-conflict`, `retryable: true`, `Retry-After: 1` | rolls back; the retry runs afresh |
/// | `sqlx::Error`, any other (a constraint, a syntax error, a missing table) | `500` problem+json `#database-error`, not retryable | rolls back |
/// | [`LeaseError`] | its own answer (see its `IntoResponse`) | answers as the record's state calls for |
/// | [`HandlerError::from_response`] | that response, as it is | classifies it by status: a `409` or `402` is recorded as a final answer, a `422` passes unrecorded, a `5xx` rolls back |
///
/// A database error's text (which may quote SQL or data) is never sent:
/// it is logged at WARN with the answer's `instance` URN, which the client
/// sees, so the line a client quotes is found. A unique violation counts
/// as "any other" (a business conflict, not a retry).
///
/// # Your own errors
///
/// Wrap a business refusal as the response you want the client to see:
/// `return Err(HandlerError::from_response((StatusCode::CONFLICT, Json(problem))))`,
/// or once for your whole error type, so `?` works on it too:
///
/// ```
/// use axum::{Json, http::StatusCode};
/// use serde_json::json;
/// use tower_idempotency::HandlerError;
///
/// enum OrderError {
///     OutOfStock(String),
/// }
///
/// impl From<OrderError> for HandlerError {
///     fn from(e: OrderError) -> Self {
///         match e {
///             OrderError::OutOfStock(sku) => HandlerError::from_response((
///                 StatusCode::CONFLICT,
///                 Json(json!({"type": "https://example.com/problems/out-of-stock", "sku": sku})),
///             )),
///         }
///     }
/// }
///
/// let err = HandlerError::from(OrderError::OutOfStock("sku-1".into()));
/// assert_eq!(err.status(), StatusCode::CONFLICT);
/// ```
///
/// See [`Tx`](crate::Tx) for a handler using it.
pub struct HandlerError {
    inner: Inner,
}

enum Inner {
    Problem {
        problem: Problem,
        source: Option<sqlx::Error>,
    },
    Response(Response),
}

impl HandlerError {
    /// Answers `res` as it is (a business refusal in your own shape); the
    /// layer classifies it by its status like any answer of the handler.
    pub fn from_response(res: impl IntoResponse) -> Self {
        Self {
            inner: Inner::Response(res.into_response()),
        }
    }

    /// The status the answer will have.
    pub fn status(&self) -> StatusCode {
        match &self.inner {
            Inner::Problem { problem, .. } => problem.status,
            Inner::Response(res) => res.status(),
        }
    }
}

impl From<sqlx::Error> for HandlerError {
    fn from(e: sqlx::Error) -> Self {
        let (kind, detail) = match error_kind(&e) {
            StoreErrorKind::Busy | StoreErrorKind::LockTimeout => (
                ProblemKind::StoreBusy,
                "the database is busy or refuses writes for now; nothing was committed, retry with the same key",
            ),
            StoreErrorKind::ConnectionLost => (
                ProblemKind::StoreUnavailable,
                "the database could not be reached; nothing was committed, retry with the same key",
            ),
            StoreErrorKind::Conflict => (
                ProblemKind::TransactionConflict,
                "the transaction conflicted with a concurrent one and was rolled back; nothing was committed, retry with the same key",
            ),
            _ => (
                ProblemKind::DatabaseError,
                "a database statement of the handler failed; nothing was committed",
            ),
        };
        let mut problem = Problem::new(kind, detail).cause(&e);
        if kind.retryable() {
            problem = problem.retry_after(1);
        }
        Self {
            inner: Inner::Problem {
                problem,
                source: Some(e),
            },
        }
    }
}

/// How a handler's database error bears on a retry, by the store it came
/// from (each store's own reading of its codes), with a unique violation
/// (which the stores read as a lost race on the ledger) kept final.
fn error_kind(e: &sqlx::Error) -> StoreErrorKind {
    if let Some(kind) = crate::store::generic_error_kind(e) {
        return kind;
    }
    let Some(db) = e.as_database_error() else {
        return StoreErrorKind::Other;
    };
    if db.is_unique_violation() {
        return StoreErrorKind::Other;
    }
    #[cfg(feature = "postgres")]
    if db
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .is_some()
    {
        return <sqlx::Postgres as crate::Backend>::error_kind(e);
    }
    #[cfg(feature = "sqlite")]
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        return <sqlx::Sqlite as crate::Backend>::error_kind(e);
    }
    #[cfg(feature = "mysql")]
    if db
        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .is_some()
    {
        return <sqlx::MySql as crate::Backend>::error_kind(e);
    }
    StoreErrorKind::Other
}

impl From<TxError> for HandlerError {
    fn from(e: TxError) -> Self {
        Self {
            inner: Inner::Problem {
                problem: e.problem(),
                source: None,
            },
        }
    }
}

impl From<LeaseError> for HandlerError {
    fn from(e: LeaseError) -> Self {
        Self::from_response(e)
    }
}

impl IntoResponse for HandlerError {
    fn into_response(self) -> Response {
        match self.inner {
            Inner::Problem { problem, .. } => problem.into_axum(),
            Inner::Response(res) => res,
        }
    }
}

impl std::fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Problem { problem, source } => f
                .debug_struct("HandlerError")
                .field("problem", &problem.kind)
                .field("source", source)
                .finish(),
            Inner::Response(res) => f
                .debug_struct("HandlerError")
                .field("status", &res.status())
                .finish_non_exhaustive(),
        }
    }
}

impl std::fmt::Display for HandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Problem {
                source: Some(e), ..
            } => write!(f, "database error: {e}"),
            Inner::Problem { problem, .. } => f.write_str(&problem.detail),
            Inner::Response(res) => write!(f, "handler answered {}", res.status()),
        }
    }
}

impl std::error::Error for HandlerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.inner {
            Inner::Problem {
                source: Some(e), ..
            } => Some(e),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(e: impl Into<HandlerError>) -> (StatusCode, serde_json::Value, Option<String>) {
        let res = e.into().into_response();
        let status = res.status();
        let retry_after = res
            .headers()
            .get(http::header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap().to_owned());
        let body = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(http_body_util::BodyExt::collect(res.into_body()))
            .unwrap()
            .to_bytes();
        (status, serde_json::from_slice(&body).unwrap(), retry_after)
    }

    #[test]
    fn transient_database_errors_are_retryable_503s() {
        let (status, doc, retry_after) = answer(sqlx::Error::PoolTimedOut);
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(doc["type"].as_str().unwrap().ends_with("#store-busy"));
        assert_eq!(doc["retryable"], true);
        assert_eq!(retry_after.as_deref(), Some("1"));
        let lost = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        let (status, doc, _) = answer(sqlx::Error::Io(lost));
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            doc["type"]
                .as_str()
                .unwrap()
                .ends_with("#store-unavailable")
        );
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn a_unique_violation_is_final_and_its_text_stays_in_the_log() {
        let err = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(async {
                use sqlx::Connection;
                let mut conn = sqlx::SqliteConnection::connect("sqlite::memory:")
                    .await
                    .unwrap();
                sqlx::raw_sql(
                    "CREATE TABLE t (secret_name TEXT PRIMARY KEY); INSERT INTO t VALUES ('x')",
                )
                .execute(&mut conn)
                .await
                .unwrap();
                sqlx::query("INSERT INTO t VALUES ('x')")
                    .execute(&mut conn)
                    .await
                    .unwrap_err()
            });
        let (status, doc, retry_after) = answer(err);
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(doc["type"].as_str().unwrap().ends_with("#database-error"));
        assert_eq!(doc["retryable"], false);
        assert_eq!(retry_after, None);
        assert!(!doc.to_string().contains("secret_name"), "{doc}");
    }

    #[test]
    fn a_response_of_your_own_is_answered_as_it_is() {
        let err = HandlerError::from_response((StatusCode::PAYMENT_REQUIRED, "declined"));
        assert_eq!(err.status(), StatusCode::PAYMENT_REQUIRED);
        assert_eq!(err.into_response().status(), StatusCode::PAYMENT_REQUIRED);
    }
}
