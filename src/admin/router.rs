//! The operators' console: [`router`], JSON routes and a small
//! server-rendered HTML page over a [`Ledger`].

use axum::extract::FromRequest;
use axum::extract::rejection::{FormRejection, JsonRejection, NestedPathRejection};
use axum::extract::{DefaultBodyLimit, NestedPath, Query, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Form, Json, Router};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::json;

use super::html;
use super::{
    AdminBackend, Attribution, Ledger, LedgerRow, Lookup, Resolved, Seen, unresolved_json,
};
use crate::{Resolution, ResolveError};

/// The largest request body the console reads (a resolution with its
/// answer): 64 KiB. Larger ones are answered `413`.
#[cfg_attr(docsrs, doc(cfg(feature = "admin")))]
pub const MAX_FORM_BYTES: usize = 64 * 1024;

/// How many records the console lists by default.
const DEFAULT_LIST: u32 = 100;

/// The operator a request acts for, put in the request extensions by the
/// application's authentication layer. Verdicts are recorded as theirs;
/// without it, a resolution must name its `actor` itself (the record page
/// then asks for it; the field is the operator's word, not a proof, and is
/// checked as [`Attribution::new`] checks it).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(docsrs, doc(cfg(feature = "admin")))]
pub struct Actor(pub String);

/// The operators' console for `ledger`, to be nested under a path of the
/// application's choice (`Router::nest("/admin", admin::router(ledger))`).
///
/// | method and path | what |
/// |---|---|
/// | `GET /` | HTML: the unresolved records, with age, pending step and step key |
/// | `GET /record?principal=…&operation=…&key=…` | HTML: one record, its audit trail, a form that settles it |
/// | `POST /resolve` | HTML form post: settles it, answers a confirmation page (`409` when refused) |
/// | `GET /api/unresolved?limit=N` | JSON: `{"records": […]}` (at most [`MAX_LIST`](super::MAX_LIST)) |
/// | `GET /api/record?principal=…&operation=…&key=…` | JSON: the record and its audit trail (`404` when none) |
/// | `POST /api/resolve` | JSON: settles a record as seen (`generation`, `parks`, `claim_id` as `/api/record` showed them; required for a lease-mode record, `400` without, `claim_id` included when the record has one); `409` with the reason when refused (`claimed_afresh` when the record now is another claim's, `settled`, `held`, `changed`); `404` only when no record holds the scope |
/// | `GET /api/status` | JSON: [`LedgerStatus`](super::LedgerStatus) |
///
/// # Authentication
///
/// The router never authenticates: mount it behind a layer that does, and
/// that puts the operator's name in the request extensions as an
/// [`Actor`]:
///
/// ```no_run
/// # fn f(pool: sqlx::PgPool) -> axum::Router {
/// use axum::extract::Request;
/// use axum::middleware::{self, Next};
/// use axum::response::{IntoResponse, Response};
/// use tower_idempotency::admin::{self, Actor, Ledger};
///
/// async fn operators_only(mut req: Request, next: Next) -> Response {
///     // Your single sign-on, mTLS or token check here.
///     let token = std::env::var("ADMIN_TOKEN").unwrap_or_default();
///     let sent = req.headers().get("authorization").and_then(|v| v.to_str().ok());
///     if token.is_empty() || sent != Some(&format!("Bearer {token}")) {
///         return http::StatusCode::UNAUTHORIZED.into_response();
///     }
///     req.extensions_mut().insert(Actor("on-call".into()));
///     next.run(req).await
/// }
///
/// axum::Router::new().nest(
///     "/admin",
///     admin::router(Ledger::new(pool)).layer(middleware::from_fn(operators_only)),
/// )
/// # }
/// ```
///
/// # Cross-site request forgery
///
/// Every `POST` must come from the console's own origin: its `Origin`
/// header (or, without one, its `Referer`) must name the same host and
/// port as its `Host` header (or, without one, as HTTP/2 requests come,
/// the request's `:authority`), else it is refused `403` before its body
/// is read. Browsers send `Origin` on every cross-site `POST`, and a page on
/// another site cannot forge it. A request with neither header is
/// accepted only as `application/json` (a script or `curl`): a browser
/// sends JSON across origins only after a CORS preflight, which this
/// router never grants. Behind a proxy, keep the client's `Host` header
/// (`proxy_set_header Host $host;`), or the check refuses every form.
/// The session cookie an authentication layer may use should still be
/// `SameSite=Lax` or stricter.
///
/// Every answer carries `Content-Security-Policy: frame-ancestors 'none'`
/// and `X-Frame-Options: DENY` (no page can be framed by another, on this
/// host or elsewhere), `Cache-Control: no-store` and `Referrer-Policy:
/// same-origin` (no URL of the console leaves its origin; `no-referrer`
/// would make a browser send `Origin: null` with the console's own form
/// posts, which the same-origin check must refuse). Answers made outside
/// the router (your authentication layer's `401`, an outer app's `404`)
/// are yours to dress.
///
/// # Limits
///
/// Request bodies are capped at [`MAX_FORM_BYTES`]; listings at
/// [`MAX_LIST`](super::MAX_LIST). Every value from the ledger is
/// HTML-escaped in the pages. Store errors are answered `503` with a
/// one-line reason, never a panic.
#[cfg_attr(docsrs, doc(cfg(feature = "admin")))]
pub fn router<DB: AdminBackend>(ledger: Ledger<DB>) -> Router {
    Router::new()
        .route("/", get(page_list::<DB>))
        .route("/record", get(page_record::<DB>))
        .route("/resolve", post(page_resolve::<DB>))
        .route("/api/unresolved", get(api_list::<DB>))
        .route("/api/record", get(api_record::<DB>))
        .route("/api/resolve", post(api_resolve::<DB>))
        .route("/api/status", get(api_status::<DB>))
        .layer(DefaultBodyLimit::max(MAX_FORM_BYTES))
        .layer(axum::middleware::map_response(guarded))
        .with_state(ledger)
}

/// Every answer of the console, refusals included: never framed (the
/// settle form under someone else's page), never cached, never sent as a
/// referrer.
async fn guarded(mut res: Response) -> Response {
    let headers = res.headers_mut();
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, "frame-ancestors 'none'"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::CACHE_CONTROL, "no-store"),
        // Not `no-referrer`: under it a browser sends `Origin: null` with
        // the console's own form posts, which the CSRF check refuses.
        (header::REFERRER_POLICY, "same-origin"),
    ] {
        headers.insert(name, header::HeaderValue::from_static(value));
    }
    res
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    limit: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct ScopeQuery {
    principal: String,
    operation: String,
    key: String,
}

impl ScopeQuery {
    fn lookup(&self) -> Lookup {
        Lookup::stored(&self.principal, &self.operation, &self.key)
    }
}

/// A resolution as the HTML form posts it (every field text).
#[derive(Debug, Deserialize)]
struct ResolveForm {
    principal: String,
    operation: String,
    key: String,
    verdict: String,
    #[serde(default)]
    status: String,
    #[serde(default)]
    content_type: String,
    #[serde(default)]
    body: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    actor: String,
    #[serde(default)]
    generation: String,
    #[serde(default)]
    claim_id: String,
    #[serde(default)]
    parks: String,
}

/// A resolution as the JSON API takes it.
#[derive(Debug, Deserialize)]
struct ResolveJson {
    principal: String,
    operation: String,
    key: String,
    /// `succeeded`, `failed` or `rerun`.
    verdict: String,
    status: Option<u16>,
    #[serde(default)]
    headers: Vec<(String, String)>,
    #[serde(default)]
    body: String,
    #[serde(default)]
    reason: String,
    actor: Option<String>,
    /// The record as seen (generation and parks, with claim_id when it
    /// has one). Required for a lease-mode record (generation > 0); a
    /// default-mode one without them is taken as it is now.
    generation: Option<i64>,
    claim_id: Option<String>,
    parks: Option<i64>,
}

/// A resolution request, checked.
struct Request {
    lookup: Lookup,
    resolution: Resolution,
    by: Attribution,
    /// The record as the operator saw it: `(generation, claim_id, parks)`.
    seen: Option<(i64, Option<String>, i64)>,
}

/// Why a request was not carried out, as an answer.
struct Refusal {
    status: StatusCode,
    kind: &'static str,
    message: String,
    record: Option<Box<LedgerRow>>,
}

impl Refusal {
    fn bad(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "bad_request",
            message: message.into(),
            record: None,
        }
    }

    fn store(e: &sqlx::Error) -> Self {
        tracing::warn!(error = %e, "admin console: the ledger failed");
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "store",
            message: format!("the ledger failed: {e}"),
            record: None,
        }
    }

    fn json(&self) -> Response {
        let body = json!({
            "error": self.kind,
            "message": self.message,
            "record": self.record.as_deref().map(LedgerRow::to_json),
        });
        (self.status, Json(body)).into_response()
    }

    fn html(&self, base: html::Base<'_>) -> Response {
        let page = html::refused(base, self.kind, &self.message, self.record.as_deref());
        (self.status, Html(page)).into_response()
    }
}

/// The CSRF defence (see [`router`]): `Ok` when the request comes from
/// the console's own origin, or is JSON with neither `Origin` nor
/// `Referer`. The console's host is the `Host` header, or without one
/// (HTTP/2 sends `:authority` instead) the request URI's authority.
fn same_origin(headers: &HeaderMap, uri: &Uri, json_body: bool) -> Result<(), Refusal> {
    let forbidden = |message: &str| Refusal {
        status: StatusCode::FORBIDDEN,
        kind: "cross_origin",
        message: message.to_string(),
        record: None,
    };
    let host = match headers.get(header::HOST) {
        Some(h) => h.to_str().ok().map(|h| h.trim().to_ascii_lowercase()),
        None => uri.authority().map(|a| a.as_str().to_ascii_lowercase()),
    };
    let source = headers
        .get(header::ORIGIN)
        .or_else(|| headers.get(header::REFERER))
        .map(|v| v.to_str().unwrap_or("\u{0}"));
    let Some(source) = source else {
        return if json_body {
            Ok(())
        } else {
            Err(forbidden(
                "a form post without Origin or Referer is refused (cross-site request forgery defence)",
            ))
        };
    };
    // `scheme://authority[/…]`; the opaque origin `null` has no authority.
    let authority = source
        .split_once("://")
        .map(|(_, rest)| rest.split(['/', '?', '#']).next().unwrap_or_default())
        .map(str::to_ascii_lowercase);
    match (authority, host) {
        (Some(a), Some(h)) if !a.is_empty() && a == h => Ok(()),
        _ => Err(forbidden(
            "the request comes from another origin than the console's (cross-site request forgery defence)",
        )),
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            ct.split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
        })
}

impl Request {
    #[allow(clippy::too_many_arguments)]
    fn new(
        scope: (String, String, String),
        verdict: &str,
        status: Option<u16>,
        headers: Vec<(String, String)>,
        body: String,
        actor: Option<&Actor>,
        given_actor: Option<&str>,
        reason: &str,
        seen: Option<(i64, Option<String>, i64)>,
    ) -> Result<Self, Refusal> {
        let actor = match (actor, given_actor.map(str::trim).filter(|a| !a.is_empty())) {
            (Some(Actor(a)), _) => a.clone(),
            (None, Some(a)) => a.to_string(),
            (None, None) => {
                return Err(Refusal::bad("no actor: the request must name who resolves"));
            }
        };
        let by = Attribution::new(&actor, reason).map_err(|e| Refusal::bad(e.to_string()))?;
        let resolution = match verdict {
            "rerun" => Resolution::Rerun,
            "succeeded" | "failed" => {
                let status = status
                    .ok_or_else(|| Refusal::bad("a succeeded or failed verdict needs a status"))?;
                if !(200..=599).contains(&status) {
                    return Err(Refusal::bad("the status must be 200 to 599"));
                }
                let mut res = http::Response::builder().status(status);
                for (name, value) in &headers {
                    res = res.header(name.trim(), value.trim());
                }
                let res = res
                    .body(Bytes::from(body))
                    .map_err(|e| Refusal::bad(format!("the answer: {e}")))?;
                if verdict == "succeeded" {
                    Resolution::Succeeded(res)
                } else {
                    Resolution::Failed(res)
                }
            }
            _ => {
                return Err(Refusal::bad(
                    "the verdict must be succeeded, failed or rerun",
                ));
            }
        };
        Ok(Self {
            lookup: Lookup::stored(&scope.0, &scope.1, &scope.2),
            resolution,
            by,
            seen,
        })
    }

    fn from_form(f: ResolveForm, actor: Option<&Actor>) -> Result<Self, Refusal> {
        // The form presets no verdict and no answer: each must be chosen.
        match f.verdict.trim() {
            "" => {
                return Err(Refusal::bad("choose a verdict: succeeded, failed or rerun"));
            }
            "succeeded" | "failed" => {
                if f.status.trim().is_empty() {
                    return Err(Refusal::bad(
                        "a succeeded or failed verdict needs the answer's status",
                    ));
                }
                if f.body.trim().is_empty() {
                    return Err(Refusal::bad(
                        "a succeeded or failed verdict needs the answer's body (what retries will replay)",
                    ));
                }
            }
            _ => {}
        }
        let status = match f.status.trim() {
            "" => None,
            s => Some(
                s.parse::<u16>()
                    .map_err(|_| Refusal::bad("the status must be a number"))?,
            ),
        };
        let headers = match f.content_type.trim() {
            "" => Vec::new(),
            ct => vec![("content-type".to_string(), ct.to_string())],
        };
        let seen = match (f.generation.trim(), f.parks.trim()) {
            ("", _) | (_, "") => None,
            (g, p) => Some((
                g.parse().map_err(|_| Refusal::bad("bad generation"))?,
                Some(f.claim_id.trim().to_string()).filter(|c| !c.is_empty()),
                p.parse().map_err(|_| Refusal::bad("bad parks"))?,
            )),
        };
        Self::new(
            (f.principal, f.operation, f.key),
            f.verdict.trim(),
            status,
            headers,
            f.body,
            actor,
            Some(&f.actor),
            &f.reason,
            seen,
        )
    }

    fn from_json(j: ResolveJson, actor: Option<&Actor>) -> Result<Self, Refusal> {
        let seen = match (j.generation, j.parks) {
            (Some(g), Some(p)) => Some((g, j.claim_id, p)),
            _ => None,
        };
        Self::new(
            (j.principal, j.operation, j.key),
            j.verdict.trim(),
            j.status,
            j.headers,
            j.body,
            actor,
            j.actor.as_deref(),
            &j.reason,
            seen,
        )
    }
}

/// Carries a resolution out: on the record as the operator saw it when
/// the request names it, else as it is now.
async fn carry_out<DB: AdminBackend>(
    ledger: &Ledger<DB>,
    req: Request,
) -> Result<Resolved, Refusal> {
    let Request {
        lookup,
        resolution,
        by,
        seen,
    } = req;
    // Whether the verdict named a claim id (a lease-mode record's fence).
    // A lease-mode record seen without its claim id: a malformed verdict.
    let claim_missing = seen
        .as_ref()
        .is_some_and(|(generation, claim, _)| *generation > 0 && claim.is_none());
    let outcome = match seen {
        Some((generation, claim_id, parks)) => {
            let seen = Seen::new(generation, parks, claim_id);
            ledger.resolve_seen(&lookup, &seen, resolution, &by).await
        }
        // Not named as seen: allowed for a default-mode record only (its
        // fence is its status); a lease-mode one moves on (reruns, parks,
        // takeovers) and a verdict must name the state it was decided on.
        None => match ledger.show(&lookup).await {
            Err(e) => Err(ResolveError::Store(e)),
            Ok(None) => Err(ResolveError::Gone),
            Ok(Some(row)) if row.is_settled() => Err(ResolveError::Settled { status: row.status }),
            Ok(Some(row)) if row.generation > 0 => {
                return Err(Refusal::bad(format!(
                    "the record is in lease mode (it is {} now): name it as seen, with the \
                     generation, parks and claim_id the record showed",
                    row.describe()
                )));
            }
            Ok(Some(row)) => {
                ledger
                    .resolve_seen(&lookup, &Seen::of(&row), resolution, &by)
                    .await
            }
        },
    };
    match outcome {
        Ok(done) => Ok(done),
        Err(ResolveError::Store(e)) => Err(Refusal::store(&e)),
        Err(e) => {
            let (status, kind) = match &e {
                ResolveError::Gone => (StatusCode::NOT_FOUND, "gone"),
                ResolveError::Settled { .. } => (StatusCode::CONFLICT, "settled"),
                ResolveError::Held { .. } => (StatusCode::CONFLICT, "held"),
                _ => (StatusCode::CONFLICT, "changed"),
            };
            let record = ledger.show(&lookup).await.ok().flatten();
            // "Gone" while a record holds the scope: the verdict named
            // another claim (or none), never a missing record.
            if let (ResolveError::Gone, Some(now)) = (&e, &record) {
                let refusal = match &now.claim_id {
                    Some(claim) if claim_missing => Refusal::bad(format!(
                        "claim_id is required for this record: name the claim_id it showed \
                         ({claim}), with its generation and parks"
                    )),
                    _ => Refusal {
                        status: StatusCode::CONFLICT,
                        kind: "claimed_afresh",
                        message: format!(
                            "the key was claimed afresh since it was seen; it is {} now",
                            now.describe()
                        ),
                        record: None,
                    },
                };
                return Err(Refusal {
                    record: record.map(Box::new),
                    ..refusal
                });
            }
            let message = match (&e, &record) {
                (ResolveError::Settled { .. }, Some(now)) => {
                    let trail = ledger.audit(&row_scope(now)).await.unwrap_or_default();
                    let who = match super::settled_by(now, &trail) {
                        Some(last) => format!("{} ({})", last.actor, last.reason),
                        None => "the service (a retry or the completer)".to_string(),
                    };
                    format!(
                        "the record was settled first by {who}; it is {} now",
                        match now.response_status {
                            Some(s) => format!("{} {s}", now.status.as_str()),
                            None => now.status.as_str().to_string(),
                        }
                    )
                }
                (ResolveError::Changed { .. } | ResolveError::Held { .. }, Some(now)) => format!(
                    "{e}; the record moved since it was seen: it is {} now",
                    now.describe()
                ),
                _ => e.to_string(),
            };
            Err(Refusal {
                status,
                kind,
                message,
                record: record.map(Box::new),
            })
        }
    }
}

fn row_scope(row: &LedgerRow) -> crate::store::Scope<'_> {
    crate::store::Scope {
        principal: &row.principal,
        operation: &row.operation,
        key: &row.key,
    }
}

async fn api_list<DB: AdminBackend>(
    State(ledger): State<Ledger<DB>>,
    Query(q): Query<ListQuery>,
) -> Response {
    let limit = q.limit.unwrap_or(DEFAULT_LIST);
    let listed =
        async { Ok::<_, sqlx::Error>((ledger.unresolved(limit).await?, ledger.clock().await?)) }
            .await;
    match listed {
        Ok((records, now)) => Json(json!({
            "records": records.iter().map(|r| unresolved_json(r, now)).collect::<Vec<_>>(),
        }))
        .into_response(),
        Err(e) => Refusal::store(&e).json(),
    }
}

async fn api_record<DB: AdminBackend>(
    State(ledger): State<Ledger<DB>>,
    Query(q): Query<ScopeQuery>,
) -> Response {
    match ledger.show(&q.lookup()).await {
        Ok(Some(row)) => match ledger.audit(&row_scope(&row)).await {
            Ok(trail) => {
                let mut v = row.to_json();
                v["audit"] = trail.iter().map(|e| e.to_json()).collect::<Vec<_>>().into();
                v["step_key"] = json!(
                    row.as_unresolved()
                        .as_ref()
                        .and_then(super::step_key)
                        .map(|k| k.as_str().to_string())
                );
                Json(v).into_response()
            }
            Err(e) => Refusal::store(&e).json(),
        },
        Ok(None) => Refusal {
            status: StatusCode::NOT_FOUND,
            kind: "not_found",
            message: "no such record".into(),
            record: None,
        }
        .json(),
        Err(e) => Refusal::store(&e).json(),
    }
}

async fn api_status<DB: AdminBackend>(State(ledger): State<Ledger<DB>>) -> Response {
    match ledger.status().await {
        Ok(s) => Json(s.to_json()).into_response(),
        Err(e) => Refusal::store(&e).json(),
    }
}

async fn api_resolve<DB: AdminBackend>(
    State(ledger): State<Ledger<DB>>,
    actor: Option<Extension<Actor>>,
    req: axum::extract::Request,
) -> Response {
    // Checked before the body is read.
    if let Err(refused) = same_origin(req.headers(), req.uri(), is_json(req.headers())) {
        return refused.json();
    }
    let body: Result<Json<ResolveJson>, JsonRejection> = Json::from_request(req, &()).await;
    let Json(body) = match body {
        Ok(body) => body,
        Err(e) => {
            return Refusal {
                status: e.status(),
                kind: "bad_request",
                message: e.body_text(),
                record: None,
            }
            .json();
        }
    };
    let req = match Request::from_json(body, actor.as_deref()) {
        Ok(req) => req,
        Err(refused) => return refused.json(),
    };
    match carry_out(&ledger, req).await {
        Ok(done) => Json(json!({
            "resolved": true,
            "before": done.before.to_json(),
            "after": done.after.as_ref().map(LedgerRow::to_json),
        }))
        .into_response(),
        Err(refused) => refused.json(),
    }
}

/// The prefix the console is nested at (`""` when it is not).
fn prefix(nested: &Result<NestedPath, NestedPathRejection>) -> &str {
    nested
        .as_ref()
        .map_or("", |n| n.as_str().trim_end_matches('/'))
}

async fn page_list<DB: AdminBackend>(
    State(ledger): State<Ledger<DB>>,
    nested: Result<NestedPath, NestedPathRejection>,
    Query(q): Query<ListQuery>,
) -> Response {
    let base = html::Base(prefix(&nested));
    let limit = q.limit.unwrap_or(DEFAULT_LIST);
    let listed =
        async { Ok::<_, sqlx::Error>((ledger.unresolved(limit).await?, ledger.clock().await?)) }
            .await;
    match listed {
        Ok((records, now)) => Html(html::list(base, &records, now)).into_response(),
        Err(e) => Refusal::store(&e).html(base),
    }
}

async fn page_record<DB: AdminBackend>(
    State(ledger): State<Ledger<DB>>,
    nested: Result<NestedPath, NestedPathRejection>,
    actor: Option<Extension<Actor>>,
    Query(q): Query<ScopeQuery>,
) -> Response {
    let base = html::Base(prefix(&nested));
    let actor = actor.as_deref().map(|Actor(a)| a.as_str());
    match ledger.show(&q.lookup()).await {
        Ok(Some(row)) => match ledger.audit(&row_scope(&row)).await {
            Ok(trail) => Html(html::record(base, &row, &trail, actor)).into_response(),
            Err(e) => Refusal::store(&e).html(base),
        },
        Ok(None) => Refusal {
            status: StatusCode::NOT_FOUND,
            kind: "not_found",
            message: "no such record".into(),
            record: None,
        }
        .html(base),
        Err(e) => Refusal::store(&e).html(base),
    }
}

async fn page_resolve<DB: AdminBackend>(
    State(ledger): State<Ledger<DB>>,
    nested: Result<NestedPath, NestedPathRejection>,
    actor: Option<Extension<Actor>>,
    req: axum::extract::Request,
) -> Response {
    let base = html::Base(prefix(&nested));
    // Checked before the body is read.
    if let Err(refused) = same_origin(req.headers(), req.uri(), false) {
        return refused.html(base);
    }
    let form: Result<Form<ResolveForm>, FormRejection> = Form::from_request(req, &()).await;
    let Form(form) = match form {
        Ok(form) => form,
        Err(e) => {
            return Refusal {
                status: e.status(),
                kind: "bad_request",
                message: e.body_text(),
                record: None,
            }
            .html(base);
        }
    };
    let req = match Request::from_form(form, actor.as_deref()) {
        Ok(req) => req,
        Err(refused) => return refused.html(base),
    };
    let by = req.by.clone();
    match carry_out(&ledger, req).await {
        Ok(done) => Html(html::resolved(base, &done, &by)).into_response(),
        Err(refused) => refused.html(base),
    }
}
