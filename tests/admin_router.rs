//! `admin::router()` driven with `oneshot`: the JSON routes, the HTML
//! pages (escaped), the form post and its confirmation, the refusal when
//! someone settled first, the CSRF defence and the body limit.

#[macro_use]
mod common;

use axum::Router;
use axum::body::Body;
use common::ledger::{OPERATION, PAY, PAYER, Store, park, pay_app};
use http::{Request, StatusCode};
use serde_json::json;
use tower_idempotency::admin::{self, Actor, Ledger};
use tower_idempotency::testkit::lease::payment;
use tower_idempotency::testkit::{Answer, send};

on_every_store!(
    json_routes_list_show_resolve_and_refuse_when_settled,
    html_pages_escape_and_the_form_settles_a_record,
    cross_site_posts_are_refused,
    a_json_verdict_names_the_record_as_seen,
    without_an_actor_extension_the_form_asks_who,
    the_form_presets_no_verdict_and_an_answer_needs_status_and_body,
    without_a_host_header_the_origin_is_checked_against_the_authority,
    every_answer_forbids_framing_caching_and_referrers,
    a_verdict_without_or_with_a_wrong_claim_id_is_not_gone,
    a_record_whose_handler_committed_reads_as_the_cli_shows_it,
);

/// The key the client sent (an SF string), and as stored (unquoted):
/// markup that the pages must escape.
const SENT: &str = "\"pay-<b>x</b>&'1'\"";
const KEY: &str = "pay-<b>x</b>&'1'";
const HOST: &str = "console.test";

/// The console behind a stand-in for the application's authentication,
/// which names the operator.
fn console<DB: Store>(pool: sqlx::Pool<DB>, actor: Option<&str>) -> Router {
    let router = admin::router(Ledger::new(pool));
    match actor {
        Some(a) => router.layer(axum::Extension(Actor(a.to_string()))),
        None => router,
    }
}

fn get(path: &str) -> Request<Body> {
    Request::get(path)
        .header("host", HOST)
        .body(Body::empty())
        .unwrap()
}

fn post_json(path: &str, body: serde_json::Value, origin: Option<&str>) -> Request<Body> {
    let mut b = Request::post(path)
        .header("host", HOST)
        .header("content-type", "application/json");
    if let Some(o) = origin {
        b = b.header("origin", o);
    }
    b.body(Body::from(body.to_string())).unwrap()
}

fn form(fields: &[(&str, &str)]) -> String {
    fields
        .iter()
        .map(|(k, v)| {
            let enc = |s: &str| {
                s.bytes()
                    .map(|b| {
                        if b.is_ascii_alphanumeric() {
                            (b as char).to_string()
                        } else {
                            format!("%{b:02X}")
                        }
                    })
                    .collect::<String>()
            };
            format!("{}={}", enc(k), enc(v))
        })
        .collect::<Vec<_>>()
        .join("&")
}

fn post_form(body: String, headers: &[(&str, &str)]) -> Request<Body> {
    let mut b = Request::post("/resolve")
        .header("host", HOST)
        .header("content-type", "application/x-www-form-urlencoded");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Body::from(body)).unwrap()
}

fn text(a: &Answer) -> String {
    String::from_utf8(a.body.to_vec()).unwrap()
}

fn record_query(key: &str) -> String {
    let enc = |s: &str| {
        s.bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect::<String>()
    };
    format!(
        "principal={}&operation={}&key={}",
        enc(PAYER),
        enc(OPERATION),
        enc(key)
    )
}

async fn json_routes_list_show_resolve_and_refuse_when_settled<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    park(&app, "pay-1").await;
    let c = console(h.pool.clone(), Some("alice"));

    let listed = send(&c, get("/api/unresolved?limit=5")).await;
    assert_eq!(listed.status, StatusCode::OK, "{listed:?}");
    let records = listed.json()["records"].as_array().unwrap().clone();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0]["pending_step"], "charge");
    let shown = send(&c, get(&format!("/api/record?{}", record_query("pay-1")))).await;
    assert_eq!(shown.status, StatusCode::OK, "{shown:?}");
    assert_eq!(shown.json()["status"], "NEEDS_RECONCILIATION");
    assert_eq!(shown.json()["step_key"], records[0]["step_key"]);
    let missing = send(&c, get(&format!("/api/record?{}", record_query("nope")))).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);

    let seen = shown.json();
    let verdict = json!({
        "principal": PAYER, "operation": OPERATION, "key": "pay-1",
        "verdict": "succeeded", "status": 201,
        "headers": [["content-type", "application/json"]],
        "body": "{\"chargeId\":\"ch_console\"}",
        "reason": "provider shows ch_console",
        "generation": seen["generation"], "parks": seen["parks"], "claim_id": seen["claim_id"],
    });
    // No reason: 400, nothing written.
    let mut no_reason = verdict.clone();
    no_reason["reason"] = json!("  ");
    let bad = send(&c, post_json("/api/resolve", no_reason, None)).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{bad:?}");
    // A script (no Origin) may post JSON.
    let done = send(&c, post_json("/api/resolve", verdict.clone(), None)).await;
    assert_eq!(done.status, StatusCode::OK, "{done:?}");
    assert_eq!(done.json()["after"]["status"], "SUCCEEDED");
    assert_eq!(done.json()["before"]["status"], "NEEDS_RECONCILIATION");
    let retry = send(&app.router, payment("pay-1", PAY)).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(&retry.body[..], br#"{"chargeId":"ch_console"}"#);

    // Someone settled it first: 409, who and what it is now.
    let bob = console(h.pool.clone(), Some("bob"));
    let mut rerun = verdict.clone();
    rerun["verdict"] = json!("rerun");
    let late = send(&bob, post_json("/api/resolve", rerun, None)).await;
    assert_eq!(late.status, StatusCode::CONFLICT, "{late:?}");
    assert_eq!(late.json()["error"], "settled");
    let message = late.json()["message"].as_str().unwrap().to_string();
    assert!(
        message.contains("alice") && message.contains("SUCCEEDED 201"),
        "{message}"
    );
    let trail = send(&c, get(&format!("/api/record?{}", record_query("pay-1")))).await;
    let audit = trail.json()["audit"].as_array().unwrap().clone();
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(
        audit[0]["actor"], "alice",
        "the Actor extension, not the body"
    );

    // Without an Actor from authentication, the request must name one.
    let anonymous = console(h.pool.clone(), None);
    let park2 = park(&app, "pay-2");
    park2.await;
    let seen2 = send(&c, get(&format!("/api/record?{}", record_query("pay-2"))))
        .await
        .json();
    let mut v2 = verdict.clone();
    v2["key"] = json!("pay-2");
    v2["generation"] = seen2["generation"].clone();
    v2["parks"] = seen2["parks"].clone();
    v2["claim_id"] = seen2["claim_id"].clone();
    let refused = send(&anonymous, post_json("/api/resolve", v2.clone(), None)).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{refused:?}");
    v2["actor"] = json!("carol");
    let ok = send(&anonymous, post_json("/api/resolve", v2, None)).await;
    assert_eq!(ok.status, StatusCode::OK, "{ok:?}");

    let status = send(&c, get("/api/status")).await;
    assert_eq!(status.status, StatusCode::OK);
    assert_eq!(status.json()["parked"], 0);
    assert_eq!(status.json()["counts"][0]["rows"], 2);
}

async fn html_pages_escape_and_the_form_settles_a_record<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    park(&app, SENT).await;
    let c = console(h.pool.clone(), Some("alice"));

    let list = send(&c, get("/")).await;
    assert_eq!(list.status, StatusCode::OK);
    assert_eq!(list.headers["content-type"], "text/html; charset=utf-8");
    let page = text(&list);
    assert!(
        page.contains("pay-&lt;b&gt;x&lt;/b&gt;&amp;&#39;1&#39;"),
        "{page}"
    );
    assert!(!page.contains("<b>x</b>"), "unescaped ledger value: {page}");
    assert!(page.contains("charge"), "{page}");
    assert!(page.contains("NEEDS_RECONCILIATION"));

    // Nested, its links and its form name the prefix.
    let nested = Router::new().nest("/admin", console(h.pool.clone(), Some("alice")));
    let page = text(&send(&nested, get("/admin")).await);
    assert!(page.contains("href=\"/admin/record?principal="), "{page}");
    let page = text(
        &send(
            &nested,
            get(&format!("/admin/record?{}", record_query(KEY))),
        )
        .await,
    );
    assert!(page.contains("action=\"/admin/resolve\""), "{page}");

    let record = send(&c, get(&format!("/record?{}", record_query(KEY)))).await;
    assert_eq!(record.status, StatusCode::OK, "{record:?}");
    let page = text(&record);
    assert!(!page.contains("<b>x</b>"), "{page}");
    assert!(page.contains("<form"), "{page}");
    assert!(page.contains("name=\"reason\""));
    // The generation the page showed is posted back with the verdict.
    let shown = send(&c, get(&format!("/api/record?{}", record_query(KEY))))
        .await
        .json();
    let generation = shown["generation"].to_string();
    let parks = shown["parks"].to_string();
    let claim = shown["claim_id"].as_str().unwrap().to_string();
    let fields = |verdict: &'static str| {
        form(&[
            ("principal", PAYER),
            ("operation", OPERATION),
            ("key", KEY),
            ("generation", &generation),
            ("claim_id", &claim),
            ("parks", &parks),
            ("verdict", verdict),
            ("status", "201"),
            ("content_type", "application/json"),
            ("body", r#"{"chargeId":"ch_form"}"#),
            ("reason", "provider <shows> ch_form"),
        ])
    };
    let origin = format!("http://{HOST}");
    // The record as the page showed it is what the verdict names: one
    // parked again since (a stale page) is refused, nothing written.
    let stale = fields("succeeded").replace(&format!("parks={parks}"), "parks=0");
    assert_ne!(stale, fields("succeeded"));
    let refused = send(&c, post_form(stale, &[("origin", &origin)])).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{refused:?}");
    assert!(text(&refused).contains("Refused (changed)"), "{refused:?}");
    let gone = fields("succeeded").replace("key=pay", "key=nopay");
    let refused = send(&c, post_form(gone, &[("origin", &origin)])).await;
    assert_eq!(refused.status, StatusCode::NOT_FOUND, "{refused:?}");
    assert!(text(&refused).contains("Refused (gone)"), "{refused:?}");
    let done = send(&c, post_form(fields("succeeded"), &[("origin", &origin)])).await;
    assert_eq!(done.status, StatusCode::OK, "{done:?}");
    let page = text(&done);
    assert!(page.contains("Verdict recorded"), "{page}");
    assert!(page.contains("SUCCEEDED 201"), "{page}");
    assert!(page.contains("provider &lt;shows&gt; ch_form"), "{page}");
    let retry = send(&app.router, payment(SENT, PAY)).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(&retry.body[..], br#"{"chargeId":"ch_form"}"#);

    // The same form again: someone (here: this operator) settled it first.
    let referer = format!("http://{HOST}/admin/record?x=1");
    let again = send(&c, post_form(fields("rerun"), &[("referer", &referer)])).await;
    assert_eq!(again.status, StatusCode::CONFLICT, "{again:?}");
    let page = text(&again);
    assert!(page.contains("Refused (settled)"), "{page}");
    assert!(page.contains("SUCCEEDED 201"), "{page}");

    // Bodies past the limit are refused before they are read.
    let huge = form(&[("principal", PAYER), ("body", &"x".repeat(100_000))]);
    let too_big = send(&c, post_form(huge, &[("origin", &origin)])).await;
    assert_eq!(too_big.status, StatusCode::PAYLOAD_TOO_LARGE, "{too_big:?}");

    let list = text(&send(&c, get("/")).await);
    assert!(list.contains("Nothing unresolved"), "{list}");
}

async fn cross_site_posts_are_refused<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    park(&app, "pay-1").await;
    let c = console(h.pool.clone(), Some("alice"));
    let fields = form(&[
        ("principal", PAYER),
        ("operation", OPERATION),
        ("key", "pay-1"),
        ("verdict", "rerun"),
        ("reason", "forged"),
    ]);
    for headers in [
        vec![("origin", "http://evil.example")],
        vec![("origin", "null")],
        vec![("referer", "https://evil.example/console.test/")],
        vec![("origin", "http://console.test.evil.example")],
        // A form post with neither header.
        vec![],
    ] {
        let a = send(&c, post_form(fields.clone(), &headers)).await;
        assert_eq!(a.status, StatusCode::FORBIDDEN, "{headers:?}: {a:?}");
        assert!(text(&a).contains("cross-site request forgery"), "{a:?}");
    }
    let verdict = json!({
        "principal": PAYER, "operation": OPERATION, "key": "pay-1",
        "verdict": "rerun", "reason": "forged",
    });
    let a = send(
        &c,
        post_json("/api/resolve", verdict, Some("https://evil.example")),
    )
    .await;
    assert_eq!(a.status, StatusCode::FORBIDDEN, "{a:?}");
    assert_eq!(a.json()["error"], "cross_origin");
    // A text/plain post (a cross-site "simple" request) is no JSON.
    let plain = Request::post("/api/resolve")
        .header("host", HOST)
        .header("content-type", "text/plain")
        .body(Body::from("{}"))
        .unwrap();
    let a = send(&c, plain).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN, "{a:?}");
    // Nothing was written.
    let shown = send(&c, get(&format!("/api/record?{}", record_query("pay-1")))).await;
    assert_eq!(shown.json()["status"], "NEEDS_RECONCILIATION");
    assert_eq!(shown.json()["audit"], json!([]));
}

/// Two operators look at one parked record through the JSON API. Alice
/// reruns it as she saw it; Bob, from the same earlier look, records it
/// succeeded: `409`, nothing written. A lease-mode record cannot be
/// resolved without naming it as seen (`400`).
async fn a_json_verdict_names_the_record_as_seen<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    park(&app, "pay-1").await;
    let alice = console(h.pool.clone(), Some("alice"));
    let bob = console(h.pool.clone(), Some("bob"));
    let seen = send(&bob, get(&format!("/api/record?{}", record_query("pay-1"))))
        .await
        .json();
    let rerun = json!({
        "principal": PAYER, "operation": OPERATION, "key": "pay-1",
        "verdict": "rerun", "reason": "provider shows no charge",
        "generation": seen["generation"], "parks": seen["parks"], "claim_id": seen["claim_id"],
    });
    let done = send(&alice, post_json("/api/resolve", rerun, None)).await;
    assert_eq!(done.status, StatusCode::OK, "{done:?}");
    assert_eq!(done.json()["after"]["status"], "PROCESSING");

    let succeeded = json!({
        "principal": PAYER, "operation": OPERATION, "key": "pay-1",
        "verdict": "succeeded", "status": 201, "body": "{}",
        "reason": "provider shows a charge",
    });
    let mut stale = succeeded.clone();
    stale["generation"] = seen["generation"].clone();
    stale["parks"] = seen["parks"].clone();
    stale["claim_id"] = seen["claim_id"].clone();
    let refused = send(&bob, post_json("/api/resolve", stale, None)).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{refused:?}");
    assert_eq!(refused.json()["error"], "changed");
    assert_eq!(refused.json()["record"]["status"], "PROCESSING");
    let blind = send(&bob, post_json("/api/resolve", succeeded, None)).await;
    assert_eq!(blind.status, StatusCode::BAD_REQUEST, "{blind:?}");
    assert!(
        blind.json()["message"]
            .as_str()
            .unwrap()
            .contains("generation"),
        "{blind:?}"
    );

    let now = send(&bob, get(&format!("/api/record?{}", record_query("pay-1"))))
        .await
        .json();
    assert_eq!(now["status"], "PROCESSING", "{now}");
    assert_eq!(now["audit"].as_array().unwrap().len(), 1, "{now}");
    assert_eq!(now["audit"][0]["actor"], "alice");

    // The client's retry completes it after Alice's rerun: a late verdict
    // is refused as settled by the service, not credited to Alice.
    app.state.provider.lookup_down(false);
    let retry = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    let mut late = json!({
        "principal": PAYER, "operation": OPERATION, "key": "pay-1",
        "verdict": "rerun", "reason": "late",
    });
    late["generation"] = seen["generation"].clone();
    late["parks"] = seen["parks"].clone();
    let late = send(&bob, post_json("/api/resolve", late, None)).await;
    assert_eq!(late.status, StatusCode::CONFLICT, "{late:?}");
    assert_eq!(late.json()["error"], "settled");
    let message = late.json()["message"].as_str().unwrap().to_string();
    assert!(message.contains("by the service"), "{message}");
    assert!(!message.contains("alice"), "{message}");
}

/// Mounted without an authentication layer that names the operator, the
/// record page asks who resolves, and the form's post records that name.
async fn without_an_actor_extension_the_form_asks_who<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    park(&app, "pay-1").await;
    let anonymous = console(h.pool.clone(), None);
    let page = text(
        &send(
            &anonymous,
            get(&format!("/record?{}", record_query("pay-1"))),
        )
        .await,
    );
    assert!(page.contains("name=\"actor\""), "{page}");
    assert!(page.contains("maxlength=\"255\""), "{page}");
    // With an Actor from authentication, the page does not ask.
    let known = console(h.pool.clone(), Some("alice"));
    let page = text(&send(&known, get(&format!("/record?{}", record_query("pay-1")))).await);
    assert!(!page.contains("name=\"actor\""), "{page}");

    let seen = send(
        &anonymous,
        get(&format!("/api/record?{}", record_query("pay-1"))),
    )
    .await
    .json();
    let (generation, parks) = (seen["generation"].to_string(), seen["parks"].to_string());
    let claim = seen["claim_id"].as_str().unwrap().to_string();
    let fields = |actor: &str| {
        form(&[
            ("principal", PAYER),
            ("operation", OPERATION),
            ("key", "pay-1"),
            ("generation", &generation),
            ("claim_id", &claim),
            ("parks", &parks),
            ("verdict", "rerun"),
            ("reason", "provider shows no charge"),
            ("actor", actor),
        ])
    };
    let origin = format!("http://{HOST}");
    let nobody = send(&anonymous, post_form(fields("  "), &[("origin", &origin)])).await;
    assert_eq!(nobody.status, StatusCode::BAD_REQUEST, "{nobody:?}");
    let too_long = "x".repeat(256);
    let long = send(
        &anonymous,
        post_form(fields(&too_long), &[("origin", &origin)]),
    )
    .await;
    assert_eq!(long.status, StatusCode::BAD_REQUEST, "{long:?}");
    let done = send(
        &anonymous,
        post_form(fields("carol"), &[("origin", &origin)]),
    )
    .await;
    assert_eq!(done.status, StatusCode::OK, "{done:?}");
    assert!(
        text(&done).contains("Recorded by <strong>carol</strong>"),
        "{done:?}"
    );
    let now = send(
        &anonymous,
        get(&format!("/api/record?{}", record_query("pay-1"))),
    )
    .await
    .json();
    assert_eq!(now["audit"][0]["actor"], "carol", "{now}");
}

/// The form chooses nothing for the operator: no verdict preselected, no
/// status filled in; a succeeded or failed verdict without a status or a
/// body is refused `400` with what is missing, nothing written.
async fn the_form_presets_no_verdict_and_an_answer_needs_status_and_body<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    park(&app, "pay-1").await;
    let c = console(h.pool.clone(), Some("alice"));
    let page = text(&send(&c, get(&format!("/record?{}", record_query("pay-1")))).await);
    assert!(page.contains("name=\"verdict\""), "{page}");
    assert!(!page.contains("checked"), "no verdict preselected: {page}");
    let status_input = page
        .split("<input")
        .find(|i| i.contains("name=\"status\""))
        .unwrap();
    assert!(
        !status_input.contains("value="),
        "no status preset: {status_input}"
    );

    let seen = send(&c, get(&format!("/api/record?{}", record_query("pay-1"))))
        .await
        .json();
    let (generation, parks) = (seen["generation"].to_string(), seen["parks"].to_string());
    let claim = seen["claim_id"].as_str().unwrap().to_string();
    let fields = |verdict: &str, status: &str, body: &str| {
        form(&[
            ("principal", PAYER),
            ("operation", OPERATION),
            ("key", "pay-1"),
            ("generation", &generation),
            ("claim_id", &claim),
            ("parks", &parks),
            ("verdict", verdict),
            ("status", status),
            ("content_type", "application/json"),
            ("body", body),
            ("reason", "provider shows ch_1"),
        ])
    };
    let origin = format!("http://{HOST}");
    for (verdict, status, body, says) in [
        ("", "201", "{}", "choose a verdict"),
        ("succeeded", "", "{}", "status"),
        ("failed", "", "{}", "status"),
        ("succeeded", "201", "", "body"),
        ("failed", "402", "  ", "body"),
    ] {
        let a = send(
            &c,
            post_form(fields(verdict, status, body), &[("origin", &origin)]),
        )
        .await;
        assert_eq!(
            a.status,
            StatusCode::BAD_REQUEST,
            "{verdict} {status} {body:?}: {a:?}"
        );
        assert!(text(&a).contains(says), "{says:?}: {a:?}");
    }
    let now = send(&c, get(&format!("/api/record?{}", record_query("pay-1"))))
        .await
        .json();
    assert_eq!(now["status"], "NEEDS_RECONCILIATION", "{now}");
    assert_eq!(now["audit"], json!([]), "nothing written");
    let done = send(
        &c,
        post_form(fields("succeeded", "201", "{}"), &[("origin", &origin)]),
    )
    .await;
    assert_eq!(done.status, StatusCode::OK, "{done:?}");
}

/// A request body that never arrives.
struct Never;

impl http_body::Body for Never {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        std::task::Poll::Pending
    }
}

/// HTTP/2 carries the host in the `:authority` pseudo-header (the URI), not
/// in a `Host` header: the same-origin check compares `Origin` with it. A
/// cross-site post is refused before its body is read.
async fn without_a_host_header_the_origin_is_checked_against_the_authority<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    park(&app, "pay-1").await;
    let c = console(h.pool.clone(), Some("alice"));
    let seen = send(&c, get(&format!("/api/record?{}", record_query("pay-1"))))
        .await
        .json();
    let fields = form(&[
        ("principal", PAYER),
        ("operation", OPERATION),
        ("key", "pay-1"),
        ("generation", &seen["generation"].to_string()),
        ("claim_id", seen["claim_id"].as_str().unwrap()),
        ("parks", &seen["parks"].to_string()),
        ("verdict", "rerun"),
        ("reason", "provider shows no charge"),
    ]);
    let h2 = |origin: &str, body: Body| {
        Request::post(format!("https://{HOST}/resolve"))
            .version(http::Version::HTTP_2)
            .header("content-type", "application/x-www-form-urlencoded")
            .header("origin", origin)
            .body(body)
            .unwrap()
    };
    let within = |req| async {
        tokio::time::timeout(std::time::Duration::from_secs(5), send(&c, req))
            .await
            .expect("answered without waiting for the body")
    };
    let forged = within(h2("https://evil.example", Body::new(Never))).await;
    assert_eq!(forged.status, StatusCode::FORBIDDEN, "{forged:?}");
    let done = within(h2(&format!("https://{HOST}"), Body::from(fields))).await;
    assert_eq!(done.status, StatusCode::OK, "{done:?}");
    assert!(text(&done).contains("Verdict recorded"), "{done:?}");
}

/// Issue 26, point 7: no page of the console can be framed (a page on the
/// same host framed the record page, settle form included), cached or
/// leak its URL as a referrer; refusals included.
async fn every_answer_forbids_framing_caching_and_referrers<DB: Store>() {
    let (h, _) = pay_app::<DB>().await;
    let app = console::<DB>(h.pool.clone(), Some("op"));
    let oversized = "x".repeat(80 * 1024);
    let requests = [
        get("/"),
        get("/api/status"),
        get("/api/unresolved"),
        get("/record?principal=p&operation=o&key=k"),
        post_json("/api/resolve", json!({}), Some("https://elsewhere.test")),
        Request::post("/resolve")
            .header("host", HOST)
            .header("origin", format!("http://{HOST}"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(Body::from(oversized))
            .unwrap(),
    ];
    for req in requests {
        let what = format!("{} {}", req.method(), req.uri());
        let a: Answer = send(&app, req).await;
        let header = |name: &str| {
            a.headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string()
        };
        assert_eq!(
            header("content-security-policy"),
            "frame-ancestors 'none'",
            "{what}: {}",
            a.status
        );
        assert_eq!(header("x-frame-options"), "DENY", "{what}");
        assert_eq!(header("cache-control"), "no-store", "{what}");
        assert_eq!(header("referrer-policy"), "same-origin", "{what}");
    }
}

/// Issue 26, point 5: a JSON verdict on a lease-mode record that exists
/// is never answered `404 gone`: without its `claim_id` it is a malformed
/// verdict (`400`), and with another claim's id the record was claimed
/// afresh since (`409`); neither records anything.
async fn a_verdict_without_or_with_a_wrong_claim_id_is_not_gone<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    park(&app, "pay-1").await;
    let c = console(h.pool.clone(), Some("alice"));
    let seen = send(&c, get(&format!("/api/record?{}", record_query("pay-1"))))
        .await
        .json();
    assert!(seen["claim_id"].is_string(), "{seen}");
    let verdict = |claim_id: serde_json::Value| {
        let mut v = json!({
            "principal": PAYER, "operation": OPERATION, "key": "pay-1",
            "verdict": "rerun", "reason": "provider shows no charge",
            "generation": seen["generation"], "parks": seen["parks"],
        });
        if !claim_id.is_null() {
            v["claim_id"] = claim_id;
        }
        v
    };
    let missing = send(
        &c,
        post_json("/api/resolve", verdict(serde_json::Value::Null), None),
    )
    .await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST, "{missing:?}");
    assert!(
        missing.json()["message"]
            .as_str()
            .unwrap()
            .contains("claim_id"),
        "{missing:?}"
    );
    let wrong = send(
        &c,
        post_json("/api/resolve", verdict(json!("0123abcd.feed")), None),
    )
    .await;
    assert_eq!(wrong.status, StatusCode::CONFLICT, "{wrong:?}");
    assert_eq!(wrong.json()["error"], "claimed_afresh", "{wrong:?}");
    let now = send(&c, get(&format!("/api/record?{}", record_query("pay-1"))))
        .await
        .json();
    assert_eq!(now["status"], "NEEDS_RECONCILIATION", "{now}");
    assert_eq!(now["audit"].as_array().unwrap().len(), 0, "{now}");
}

/// A default-mode record whose handler ran `COMMIT` and answered `201`
/// (its client got `500`): the console says what the CLI says. Parked
/// once (`/api/status`'s `parked` and the record's `parks` agree), the
/// `201` named the handler's status, never the answer, and the form's
/// hidden fields name the record so that its verdict lands.
async fn a_record_whose_handler_committed_reads_as_the_cli_shows_it<DB: Store>() {
    use tower_idempotency::testkit::{Harness, order};
    let h = Harness::<DB>::new().await;
    let app = h.app();
    let a = send(
        &app,
        order(
            Some("alice"),
            Some("k-1"),
            r#"{"amount":1,"mode":"commit_201"}"#,
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR, "{a:?}");
    let c = console(h.pool.clone(), Some("carol"));
    let query = "principal=alice&operation=POST%20%2Forders&key=k-1";

    let status = send(&c, get("/api/status")).await.json();
    assert_eq!(status["parked"], 1, "{status}");
    let row = send(&c, get(&format!("/api/record?{query}"))).await.json();
    assert_eq!(row["parks"], 1, "{row}");
    assert_eq!(row["handler_status"], 201, "{row}");
    assert_eq!(row["answer_status"], serde_json::Value::Null, "{row}");
    let listed = send(&c, get("/api/unresolved")).await.json();
    assert_eq!(listed["records"][0]["handler_status"], 201, "{listed}");

    let page = text(&send(&c, get(&format!("/record?{query}"))).await);
    assert!(!page.contains("Answer status</th>"), "{page}");
    assert!(page.contains("<th>Handler status</th><td>201 "), "{page}");
    assert!(page.contains("<th>Parks</th><td>1</td>"), "{page}");
    assert!(
        page.contains("name=\"parks\" value=\"1\""),
        "the form names the record as shown: {page}"
    );
    let done = send(
        &c,
        post_form(
            form(&[
                ("principal", "alice"),
                ("operation", "POST /orders"),
                ("key", "k-1"),
                ("generation", "0"),
                ("claim_id", ""),
                ("parks", "1"),
                ("verdict", "rerun"),
                ("reason", "the order row is not there"),
            ]),
            &[("origin", &format!("http://{HOST}"))],
        ),
    )
    .await;
    assert_eq!(done.status, StatusCode::OK, "{done:?}");
}
