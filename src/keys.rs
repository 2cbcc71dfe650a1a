//! "Did my key land?": [`KeyStatus`], a read-only service that tells a
//! caller where its own key stands, for a client that lost the request's
//! body (a crashed job, a replayed queue) and cannot retry the payload.
//!
//! Mount it behind the same authentication as the guarded routes, from the
//! same layer (so it scopes keys as they were stored):
//!
//! ```no_run
//! # async fn run(pool: sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
//! use axum::{Router, routing::{any_service, post}};
//! use tower_idempotency::IdempotencyLayer;
//!
//! let idempotency = IdempotencyLayer::new(pool);
//! let app: Router = Router::new()
//!     .route("/orders", post(|| async { "created" }).layer(idempotency.clone()))
//!     .route_service("/idempotency-keys", any_service(idempotency.key_status()));
//! // .layer(your authentication, which puts a `Principal` in the extensions)
//! # Ok(()) }
//! ```
//!
//! ```text
//! curl -H 'Authorization: Bearer alice' -H 'Idempotency-Key: "order-7"' \
//!   'http://127.0.0.1:3000/idempotency-keys?operation=POST%20/orders'
//! {"key":"order-7","operation":"POST /orders","status":"succeeded","response_status":201,"expires":"Fri, 04 Dec 2026 10:00:00 GMT"}
//! curl ... '...?operation=POST%20/orders&answer=true'    # the recorded answer itself, as a replay
//! ```
//!
//! The key is the `Idempotency-Key` header, parsed as the layer parses it;
//! the operation is the `operation` query parameter, as the layer names it
//! (`METHOD /route` by default, or the name given to
//! [`with_operation`](crate::IdempotencyLayer::with_operation)); the
//! principal is the one the layer would use for the request. A caller only
//! ever reads its own records: the principal is part of the scope read.
//!
//! | `status` | meaning |
//! |---|---|
//! | `not_found` | no request with this key has committed, and none holds it now: retry with the original payload (if you have it), or treat the operation as not done |
//! | `in_flight` | a request with this key is running now: ask again after `Retry-After` |
//! | `succeeded`, `failed` | it finished; `response_status` is the recorded answer's status (`failed`: a recorded final business error); `answer=true` returns that answer itself, byte for byte, as a replay: status, headers, body and trailers (a gRPC answer's `grpc-status` among them) |
//! | `expired` | it finished, and its retention ended: the answer is gone, the key stays refused |
//! | `needs_reconciliation` | its outcome is unknown and waits for an operator |
//!
//! Telling `not_found` from `in_flight`: a request running in this
//! process is known from the layer's own table; otherwise the look-up
//! takes the claim's own look at the scope (PostgreSQL's scope lock,
//! MySQL's uncommitted row, SQLite's write lock), in a transaction rolled
//! back at once: nothing is written, and a request that arrives meanwhile
//! waits only that long. On SQLite a write of any other key running in
//! another process makes that look wait (its `busy_timeout`) and answer
//! `503`: ask again. Refusals are the layer's problem
//! documents (`400` for a missing or malformed key or operation, `401`
//! without a principal, `503` when the store cannot be read).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use serde_json::json;
use sqlx::Pool;
use tower_service::Service;

use crate::config::Config;
use crate::expiry::{http_date, is_expired};
use crate::key::IdempotencyKey;
use crate::problem::{Problem, ProblemKind};
use crate::scope::{bounded, http_operation, stored_key};
use crate::service::{buffered_body, store_problem};
use crate::store::{Backend, Claim, ClaimOutcome, Record, RecordStatus, Scope, StoreErrorKind};

/// How long telling `not_found` from `in_flight` may wait for the store.
const PROBE_WAIT: Duration = Duration::from_millis(200);

/// The key-status look-up of one [`IdempotencyLayer`](crate::IdempotencyLayer)
/// ([`key_status`](crate::IdempotencyLayer::key_status)). See the
/// [module](self).
pub struct KeyStatus<DB: Backend> {
    pub(crate) pool: Pool<DB>,
    pub(crate) config: Arc<Config>,
}

impl<DB: Backend> Clone for KeyStatus<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<DB: Backend> std::fmt::Debug for KeyStatus<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyStatus").finish_non_exhaustive()
    }
}

/// The body of a look-up's answer: its bytes, and the trailers of a
/// recorded answer (`answer=true`) after them.
pub type KeyStatusBody = crate::IdempotencyBody<http_body_util::Empty<Bytes>>;

impl<DB: Backend, B> Service<Request<B>> for KeyStatus<DB> {
    type Response = Response<KeyStatusBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let this = self.clone();
        let (parts, _) = req.into_parts();
        Box::pin(async move {
            let res = match this.answer(&parts).await {
                Ok(res) => res,
                Err(problem) => problem.into_standalone(),
            };
            // A recorded answer's trailers travel after its body, as on a
            // replay.
            Ok(buffered_body(res))
        })
    }
}

impl<DB: Backend> KeyStatus<DB> {
    async fn answer(&self, parts: &http::request::Parts) -> Result<Response<Bytes>, Problem> {
        let cfg = &self.config;
        let key = match IdempotencyKey::from_headers(&parts.headers, cfg.key_mode) {
            Ok(Some(key)) => key,
            Ok(None) => {
                return Err(Problem::new(
                    ProblemKind::MissingKey,
                    "name the key to look up in the Idempotency-Key header",
                ));
            }
            Err(e) => return Err(Problem::new(ProblemKind::MalformedKey, e.to_string())),
        };
        let (operation, want_answer) = query(parts.uri.query().unwrap_or(""));
        let Some(operation) = operation.filter(|op| !op.is_empty() && op.len() <= 1024) else {
            return Err(Problem::new(
                ProblemKind::InvalidBody,
                "name the operation in the `operation` query parameter (such as `POST /orders`)",
            ));
        };
        let Some(principal) = (cfg.principal)(parts) else {
            return Err(Problem::missing_principal());
        };
        let principal = bounded(principal.as_str());
        let stored_operation = http_operation(&operation);
        let stored_key = stored_key(key.as_str(), cfg.hash_keys);
        let scope = Scope {
            principal: &principal,
            operation: &stored_operation,
            key: &stored_key,
        };
        let unavailable = |e: sqlx::Error| {
            tracing::warn!(error = %e, "key status: the store could not be read");
            store_problem::<DB>(&e)
        };
        let found = match DB::fetch(&self.pool, &scope).await.map_err(unavailable)? {
            Some(record) => Found::Record(Box::new(record)),
            // Running in this process: known without asking the store
            // (SQLite's one writer would make the probe wait on any write).
            None if cfg.local.is_running(&scope) => Found::Held,
            None => self.probe(&scope).await.map_err(unavailable)?,
        };
        let mut doc = json!({"key": key.as_str(), "operation": operation});
        let record = match found {
            Found::Nothing => {
                doc["status"] = json!("not_found");
                return Ok(json_response(StatusCode::OK, &doc));
            }
            Found::Held => return Ok(self.in_flight(doc)),
            Found::Record(record) => record,
        };
        let status = standing(&record);
        if status == "in_flight" {
            return Ok(self.in_flight(doc));
        }
        doc["status"] = json!(status);
        if let Some(s) = record.response_status {
            doc["response_status"] = json!(s);
        }
        if let Some(id) = &record.resource_id {
            doc["resource_id"] = json!(id);
        }
        if matches!(status, "succeeded" | "failed") {
            doc["expires"] = json!(http_date(record.expires_at));
            if want_answer && let Some(s) = record.response_status {
                return Ok(record.stored_response(s).to_response(true));
            }
        }
        Ok(json_response(StatusCode::OK, &doc))
    }

    /// `doc` for a key a running request holds, with when to ask again.
    fn in_flight(&self, mut doc: serde_json::Value) -> Response<Bytes> {
        doc["status"] = json!("in_flight");
        let mut res = json_response(StatusCode::OK, &doc);
        let secs = self.config.in_flight_wait.as_secs().max(1);
        res.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        res
    }

    /// No committed record: does a running request hold the scope? The
    /// claim's own look (its lock or uncommitted row), rolled back at once.
    async fn probe(&self, scope: &Scope<'_>) -> Result<Found, sqlx::Error> {
        let claim = Claim {
            scope: *scope,
            fingerprint: &[0; 32],
            retention_ms: 1,
            lock_wait: PROBE_WAIT,
            isolation: self.config.isolation,
            cached_statements: self.config.cached_statements,
            database: self.config.database.as_deref(),
            causal_wait: self.config.causal_wait(),
        };
        let conn =
            match tokio::time::timeout(PROBE_WAIT * 5, crate::store::acquire(&self.pool)).await {
                Ok(conn) => conn?,
                Err(_) => return Err(sqlx::Error::PoolTimedOut),
            };
        match DB::claim(conn, &claim).await {
            Ok(ClaimOutcome::Won(tx)) => {
                tx.rollback().await;
                Ok(Found::Nothing)
            }
            Ok(ClaimOutcome::Lost(Some(record))) => Ok(Found::Record(record)),
            Ok(ClaimOutcome::Lost(None)) => Ok(match DB::fetch(&self.pool, scope).await? {
                Some(record) => Found::Record(Box::new(record)),
                None => Found::Nothing,
            }),
            Ok(ClaimOutcome::InFlight) => Ok(Found::Held),
            Err(e) if DB::error_kind(&e) == StoreErrorKind::LockTimeout => Ok(Found::Held),
            Err(e) => Err(e),
        }
    }
}

/// What the look-up found for a scope.
enum Found {
    /// No committed record, and nothing holds the scope.
    Nothing,
    /// No committed record; a running request holds the scope.
    Held,
    /// The committed record.
    Record(Box<Record>),
}

/// Where a committed record stands, as the look-up names it.
fn standing(record: &Record) -> &'static str {
    if is_expired(record) {
        return "expired";
    }
    match record.status {
        RecordStatus::Succeeded => "succeeded",
        RecordStatus::FailedFinal => "failed",
        RecordStatus::Expired => "expired",
        RecordStatus::NeedsReconciliation => "needs_reconciliation",
        // A lease-mode row whose lease runs is in flight; a committed
        // default-mode row, or a lapsed lease, waits for recovery.
        RecordStatus::Processing if record.lease.as_ref().is_some_and(|l| l.live) => "in_flight",
        RecordStatus::Processing => "needs_reconciliation",
    }
}

/// The `operation` and `answer` query parameters (percent-decoded).
fn query(q: &str) -> (Option<String>, bool) {
    let mut operation = None;
    let mut answer = false;
    for pair in q.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        match name {
            "operation" => operation = percent_decode(value),
            "answer" => answer = matches!(value, "true" | "1"),
            _ => {}
        }
    }
    (operation, answer)
}

/// `%XX` and `+` decoded; `None` when not valid UTF-8 or a bad escape.
fn percent_decode(s: &str) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'%' => {
                let hi = char::from(bytes.next()?).to_digit(16)?;
                let lo = char::from(bytes.next()?).to_digit(16)?;
                out.push(u8::try_from(hi * 16 + lo).ok()?);
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
    }
    String::from_utf8(out).ok()
}

fn json_response(status: StatusCode, doc: &serde_json::Value) -> Response<Bytes> {
    let mut res = Response::new(Bytes::from(doc.to_string()));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_is_read_and_decoded() {
        assert_eq!(
            query("operation=POST%20%2Forders&answer=true"),
            (Some("POST /orders".to_owned()), true)
        );
        assert_eq!(
            query("answer=0&operation=create-order"),
            (Some("create-order".to_owned()), false)
        );
        assert_eq!(query("operation=%ZZ"), (None, false));
        assert_eq!(query(""), (None, false));
    }
}
