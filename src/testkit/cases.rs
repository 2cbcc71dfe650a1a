//! The conformance cases, each generic over the backend. See the
//! [module docs](super) for how to run them.

use std::time::{Duration, Instant};

use axum::extract::State;
use bytes::Bytes;
use http::StatusCode;
use sqlx::Pool;

use super::{ConformanceDb, Harness, order, send};
use crate::expiry::http_date;
use crate::{IdempotencyLayer, Sweeper};

pub use super::consumer::*;
pub use super::lease::cases::*;
pub use super::lease::hardening::*;
pub use super::lease::review::*;

const BODY: &str = r#"{"amount":12000,"items":[]}"#;
const ALICE: Option<&str> = Some("user-42");
const KEY: Option<&str> = Some("\"checkout-20260914-001\"");

/// Case: first request commits order and succeeded row.
pub async fn first_request_commits_order_and_succeeded_row<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let a = send(&app, order(ALICE, KEY, BODY)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    let id = a.json()["orderId"].as_i64().expect("order id");
    assert_eq!(a.headers["location"], format!("/orders/{id}"));
    assert!(!a.replayed());
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
    assert_eq!(h.ledger().await, 1);
    let resource: String = DB::count(h.plain(), "SELECT COUNT(*) FROM idempotency_records WHERE resource_id IS NOT NULL AND response_body IS NOT NULL AND response_status = 201").await.to_string();
    assert_eq!(resource, "1");
}

/// Case: retry replays byte for byte without executing.
pub async fn retry_replays_byte_for_byte_without_executing<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let first = send(&app, order(ALICE, KEY, BODY)).await;
    // Same meaning, other whitespace and key order: same fingerprint.
    let retry = send(
        &app,
        order(ALICE, KEY, r#"{ "items": [], "amount": 12000 }"#),
    )
    .await;
    assert_eq!(retry.status, first.status);
    assert_eq!(
        retry.body, first.body,
        "replayed body must be byte-identical"
    );
    assert_eq!(retry.headers["location"], first.headers["location"]);
    assert_eq!(retry.headers["content-type"], first.headers["content-type"]);
    assert!(retry.replayed());
    assert!(
        retry.headers.get("x-attempt-nonce").is_none(),
        "only allow-listed headers are replayed"
    );
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger().await, 1);
}

/// Case: quoted and bare key are the same key.
pub async fn quoted_and_bare_key_are_the_same_key<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let first = send(&app, order(ALICE, Some("\"k-1\""), BODY)).await;
    let bare = send(&app, order(ALICE, Some("k-1"), BODY)).await;
    assert_eq!(bare.body, first.body);
    assert!(bare.replayed());
    assert_eq!(h.orders().await, 1);
    // Strict mode refuses the bare form.
    let strict = h.app_with(h.layer().with_key_mode(crate::KeyMode::Strict));
    let refused = send(&strict, order(ALICE, Some("k-2"), BODY)).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert_eq!(refused.problem(), "malformed-key");
    assert_eq!(h.orders().await, 1);
}

/// Case: missing key is refused and nothing stored.
pub async fn missing_key_is_refused_and_nothing_stored<DB: ConformanceDb>(h: Harness<DB>) {
    let a = send(&h.app(), order(ALICE, None, BODY)).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(a.problem(), "missing-key");
    assert_eq!(h.executions(), 0);
    h.assert_nothing_stored().await;
    // Optional keys: passes through unprotected, and is never deduplicated by body.
    let optional = h.app_with(h.layer().with_key_required(false));
    send(&optional, order(ALICE, None, BODY)).await;
    send(&optional, order(ALICE, None, BODY)).await;
    assert_eq!(h.orders().await, 2);
    assert_eq!(h.ledger().await, 0);
}

/// Case: malformed keys are refused and nothing stored.
pub async fn malformed_keys_are_refused_and_nothing_stored<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let long = "a".repeat(256);
    let long_quoted = format!("\"{long}\"");
    for key in [
        "",
        "\"\"",
        long.as_str(),
        long_quoted.as_str(),
        "a\tb",
        "\"abc",
        "\"a\"b",
        "a b",
        "a,b",
    ] {
        let a = send(&app, order(ALICE, Some(key), BODY)).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "key {key:?}");
        assert_eq!(a.problem(), "malformed-key", "key {key:?}");
    }
    // Non-ASCII bytes (obs-text) reach the layer; other control characters
    // than tab are refused by the HTTP parser itself (see the key unit tests).
    for raw in [&b"caf\xc3\xa9"[..], b"\"\xffab\""] {
        let mut req = order(ALICE, None, BODY);
        req.headers_mut().insert(
            "idempotency-key",
            http::HeaderValue::from_bytes(raw).unwrap(),
        );
        let a = send(&app, req).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "key {raw:?}");
        assert_eq!(a.problem(), "malformed-key");
    }
    // Two header lines.
    let mut req = order(ALICE, Some("a"), BODY);
    req.headers_mut()
        .append("idempotency-key", "b".parse().unwrap());
    assert_eq!(send(&app, req).await.problem(), "malformed-key");
    // 255 is still fine.
    let ok = send(&app, order(ALICE, Some(&"a".repeat(255)), BODY)).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger().await, 1);
}

/// Case: missing principal is refused and nothing stored.
pub async fn missing_principal_is_refused_and_nothing_stored<DB: ConformanceDb>(h: Harness<DB>) {
    let a = send(&h.app(), order(None, KEY, BODY)).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert_eq!(a.problem(), "missing-principal");
    // The default principal source (request extensions) finds none either.
    let a = send(
        &h.app_with(IdempotencyLayer::new(h.pool.clone())),
        order(ALICE, KEY, BODY),
    )
    .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert_eq!(h.executions(), 0);
    h.assert_nothing_stored().await;
}

/// Case: oversized body is refused before buffering.
pub async fn oversized_body_is_refused_before_buffering<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app_with(h.layer().with_max_request_body(64));
    let big = format!(r#"{{"amount":1,"pad":"{}"}}"#, "x".repeat(100));
    // Declared length over the limit.
    let a = send(&app, order(ALICE, KEY, &big)).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(a.problem(), "body-too-large");
    // No declared length: a stream that never ends would hang a layer that
    // reads it all; this one stops at the limit.
    let endless = futures_stream(1024);
    let mut req = order(ALICE, KEY, "");
    *req.body_mut() = axum::body::Body::from_stream(endless);
    req.headers_mut().remove("content-length");
    let a = tokio::time::timeout(Duration::from_secs(5), send(&app, req))
        .await
        .expect("no hang");
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(h.executions(), 0);
    h.assert_nothing_stored().await;
}

/// An endless body stream of `chunk`-byte pieces.
fn futures_stream(
    chunk: usize,
) -> impl futures_core::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Send {
    struct Endless(bytes::Bytes);
    impl futures_core::Stream for Endless {
        type Item = Result<bytes::Bytes, std::io::Error>;
        fn poll_next(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            std::task::Poll::Ready(Some(Ok(self.0.clone())))
        }
    }
    Endless(bytes::Bytes::from(vec![b' '; chunk]))
}

/// Case: invalid bodies are refused and nothing stored.
pub async fn invalid_bodies_are_refused_and_nothing_stored<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let a = send(&app, order(ALICE, KEY, r#"{"amount":"#)).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(a.problem(), "invalid-body");
    let mut req = order(ALICE, KEY, "");
    *req.body_mut() = axum::body::Body::from(vec![b'{', 0xff, 0xfe, b'}']);
    let a = send(&app, req).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(a.problem(), "invalid-body");
    assert_eq!(h.executions(), 0);
    h.assert_nothing_stored().await;
}

/// Case: changed payload is refused with 422.
pub async fn changed_payload_is_refused_with_422<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let first = send(&app, order(ALICE, KEY, BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let changed = send(&app, order(ALICE, KEY, r#"{"amount":15000,"items":[]}"#)).await;
    assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(changed.problem(), "key-reused");
    // Interoperable members (RFC 9457 instance, the key as sent, whether
    // to retry, the IETF draft's section), whatever the key's storage.
    let doc = changed.json();
    assert_eq!(doc["idempotency_key"], "checkout-20260914-001", "{doc}");
    assert_eq!(doc["retryable"], false, "{doc}");
    assert!(
        doc["instance"]
            .as_str()
            .is_some_and(|i| i.starts_with("urn:uuid:")),
        "{doc}"
    );
    assert!(
        doc["spec"]
            .as_str()
            .is_some_and(|s| s.ends_with("#section-2.2")),
        "{doc}"
    );
    assert!(!changed.replayed());
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger().await, 1);
}

/// Case: mismatch status can be 409.
pub async fn mismatch_status_can_be_409<DB: ConformanceDb>(h: Harness<DB>) {
    assert!(
        h.layer()
            .with_mismatch_status(StatusCode::BAD_REQUEST)
            .check()
            .is_err()
    );
    let app = h.app_with(h.layer().with_mismatch_status(StatusCode::CONFLICT));
    send(&app, order(ALICE, KEY, BODY)).await;
    let changed = send(&app, order(ALICE, KEY, r#"{"amount":1,"items":[]}"#)).await;
    assert_eq!(changed.status, StatusCode::CONFLICT);
    assert_eq!(changed.problem(), "key-reused");
    assert_eq!(h.orders().await, 1);
}

/// Case: handler rejection rolls back and key stays usable.
pub async fn handler_rejection_rolls_back_and_key_stays_usable<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    // The handler writes an order, then rejects the request with 422.
    let bad = send(&app, order(ALICE, KEY, r#"{"amount":-1}"#)).await;
    assert_eq!(bad.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        h.orders().await,
        0,
        "the rejected request's write is rolled back"
    );
    assert_eq!(h.ledger().await, 0, "a rejection is not recorded");
    // The same key with a corrected request runs.
    let good = send(&app, order(ALICE, KEY, BODY)).await;
    assert_eq!(good.status, StatusCode::CREATED);
    assert!(!good.replayed());
    assert_eq!(h.executions(), 2);
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
}

/// Case: a handler that writes nothing on the claimed transaction (a
/// quote answered from a read, a refusal decided before the first write)
/// is recorded and replayed like one that writes.
pub async fn a_handler_that_writes_nothing_is_recorded_and_replayed<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h.app();
    let quote = (Some("quote-1"), r#"{"amount":5,"mode":"read_only"}"#);
    let refused = (Some("sold-out-1"), r#"{"amount":5,"mode":"refuse_first"}"#);
    let first_quote = send(&app, order(ALICE, quote.0, quote.1)).await;
    assert_eq!(first_quote.status, StatusCode::OK, "{first_quote:?}");
    let first_refused = send(&app, order(ALICE, refused.0, refused.1)).await;
    assert_eq!(
        first_refused.status,
        StatusCode::CONFLICT,
        "{first_refused:?}"
    );
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
    assert_eq!(h.ledger_with("FAILED_FINAL").await, 1);
    assert_eq!(h.ledger().await, 2);
    assert_eq!(h.orders().await, 0);
    for ((key, body), first) in [(quote, first_quote), (refused, first_refused)] {
        let retry = send(&app, order(ALICE, key, body)).await;
        assert_eq!(retry.status, first.status, "{retry:?}");
        assert_eq!(retry.body, first.body);
        assert!(retry.replayed(), "{retry:?}");
    }
    assert_eq!(h.executions(), 2);
    assert_eq!(h.ledger().await, 2);
}

/// Case (the claim-at-commit suite alone): a retry of a finished key
/// through the layer that ran it reads the ledger first, so the handler
/// does not run again; through another layer (another instance of the
/// service) it runs and is undone. Another principal's key of the same
/// name is its own, and a key that ended with nothing recorded (a `5xx`)
/// runs again and is recorded. Judged by the handler's runs, undone ones
/// included, and the rows committed.
pub async fn at_commit_a_retry_through_the_same_layer_does_not_run_the_handler<
    DB: ConformanceDb,
>(
    h: Harness<DB>,
) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use axum::response::IntoResponse;

    // The test app with every run of its handler counted (not judged);
    // while `failing`, the handler's answer is replaced by a `5xx`.
    let runs = Arc::new(AtomicUsize::new(0));
    let failing = Arc::new(AtomicBool::new(false));
    let app = |layer: IdempotencyLayer<DB>| {
        let failing = Arc::clone(&failing);
        let flaky = axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let failing = Arc::clone(&failing);
                async move {
                    let res = next.run(req).await;
                    if failing.load(Ordering::SeqCst) {
                        return (StatusCode::INTERNAL_SERVER_ERROR, "down").into_response();
                    }
                    res
                }
            },
        );
        axum::Router::new()
            .route(
                "/orders",
                axum::routing::post(super::create_order::<DB>).layer(flaky),
            )
            .layer(layer)
            .with_state(super::AppState {
                pool: h.pool.clone(),
                executions: Arc::clone(&runs),
                first: h.environment.handler.statements,
            })
    };
    let runs_now = || runs.load(Ordering::SeqCst);
    let here = app(h.layer());
    let first = send(&here, order(ALICE, KEY, BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    for _ in 0..3 {
        let again = send(&here, order(ALICE, KEY, BODY)).await;
        assert!(again.replayed(), "{again:?}");
        assert_eq!(again.body, first.body);
    }
    assert_eq!(runs_now(), 1, "retries through the layer that ran the key");
    let elsewhere = send(&app(h.layer()), order(ALICE, KEY, BODY)).await;
    assert!(elsewhere.replayed(), "{elsewhere:?}");
    assert_eq!(elsewhere.body, first.body);
    assert_eq!(runs_now(), 2, "a retry through another layer runs");
    let bob = send(&here, order(Some("user-7"), KEY, BODY)).await;
    assert_eq!(bob.status, StatusCode::CREATED, "{bob:?}");
    assert!(!bob.replayed());
    assert_eq!(runs_now(), 3, "another principal's key");
    let down = Some("\"down-1\"");
    failing.store(true, Ordering::SeqCst);
    let answer = send(&here, order(ALICE, down, BODY)).await;
    assert_eq!(
        answer.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{answer:?}"
    );
    failing.store(false, Ordering::SeqCst);
    let retried = send(&here, order(ALICE, down, BODY)).await;
    assert_eq!(retried.status, StatusCode::CREATED, "{retried:?}");
    assert!(!retried.replayed());
    assert_eq!(runs_now(), 5, "a key with nothing recorded runs again");
    assert_eq!(h.orders().await, 3, "alice's two orders and bob's");
    assert_eq!(h.ledger().await, 3);
}

/// Case: final business error records failed final without partial writes.
pub async fn final_business_error_records_failed_final_without_partial_writes<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    DB::set_stock(h.plain(), "A-10", 5).await;
    DB::set_stock(h.plain(), "B-20", 1).await;
    let app = h.app();
    // A-10 is taken (a partial write), then B-20 is short: final error.
    let body = r#"{"amount":12000,"items":[{"sku":"A-10","qty":2},{"sku":"B-20","qty":3}]}"#;
    let first = send(&app, order(ALICE, KEY, body)).await;
    assert_eq!(first.status, StatusCode::CONFLICT);
    assert_eq!(
        first.json()["type"],
        "https://example.test/problems/out-of-stock"
    );
    assert_eq!(h.orders().await, 0, "no partial order");
    assert_eq!(
        DB::stock(h.plain(), "A-10").await,
        5,
        "no partial stock change"
    );
    assert_eq!(DB::stock(h.plain(), "B-20").await, 1);
    assert_eq!(h.ledger_with("FAILED_FINAL").await, 1);
    assert_eq!(h.ledger().await, 1);
    // The retry replays the same error, even after a restock.
    DB::set_stock(h.plain(), "B-20", 10).await;
    let retry = send(&app, order(ALICE, KEY, body)).await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(retry.body, first.body);
    assert!(retry.replayed());
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 0);
    assert_eq!(DB::stock(h.plain(), "B-20").await, 10);
}

/// Case: server error rolls back and retry runs afresh.
pub async fn server_error_rolls_back_and_retry_runs_afresh<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let failed = send(
        &app,
        order(ALICE, KEY, r#"{"amount":12000,"mode":"fail500"}"#),
    )
    .await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    h.assert_nothing_stored().await;
    let ok = send(
        &app,
        order(
            ALICE,
            KEY,
            r#"{"amount":12000,"mode":"fail500"}"#.replace("fail500", "").as_str(),
        ),
    )
    .await;
    assert_eq!(ok.status, StatusCode::CREATED, "{ok:?}");
    assert_eq!(h.executions(), 2);
    assert_eq!(h.orders().await, 1);
}

/// Case: handler can mark a response final or retryable.
pub async fn handler_can_mark_a_response_final_or_retryable<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    // A 502 marked final: recorded, business writes undone, replayed.
    let body = r#"{"amount":1,"mode":"mark_final"}"#;
    let first = send(&app, order(ALICE, Some("final"), body)).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    assert_eq!(h.ledger_with("FAILED_FINAL").await, 1);
    assert_eq!(h.orders().await, 0);
    let retry = send(&app, order(ALICE, Some("final"), body)).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    // A 409 marked retryable: nothing recorded, the retry runs again.
    let body = r#"{"amount":1,"mode":"mark_retryable"}"#;
    send(&app, order(ALICE, Some("retryable"), body)).await;
    let again = send(&app, order(ALICE, Some("retryable"), body)).await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert!(!again.replayed());
    assert_eq!(h.executions(), 3);
    assert_eq!(h.ledger().await, 1);
    assert_eq!(h.orders().await, 0);
}

/// A duplicate reaching the same instance while the first runs waits for
/// it, then replays its answer.
pub async fn concurrent_duplicate_waits_then_replays<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    duplicate_during_the_first_replays_it(&h, app.clone(), app).await;
}

/// Acceptance 6: the claim conflicts with a row nobody can read yet (an
/// uncommitted claim of a stuck request). Retries stay within the attempt
/// bound and the one wait budget (the in-flight wait), then the answer is
/// "in flight" (on SQLite, whose lock is database-wide, "store busy" after
/// the connection's busy timeout), and nothing runs.
pub async fn stuck_claim_is_bounded_then_in_flight_409<DB: ConformanceDb>(h: Harness<DB>) {
    let wait = Duration::from_millis(300);
    let layer = h
        .layer()
        .with_in_flight_wait(wait)
        .with_claim_retries(3, Duration::from_secs(60));
    let app = h.app_with(layer);
    let stuck = DB::hold_claim(&h.pool, "user-42", "POST /orders", "checkout-20260914-001").await;
    let started = Instant::now();
    let response = send(&app, order(ALICE, KEY, BODY)).await;
    let elapsed = started.elapsed();
    // Bounded by the in-flight wait (300 ms; on SQLite the harness's 1 s
    // busy_timeout), not by the claim deadline (60 s) nor by the stuck
    // claim, which never ends by itself: a bound far from both.
    let bound = Duration::from_secs(20);
    let (status, problem) = if DB::LABEL == "sqlite" {
        (StatusCode::SERVICE_UNAVAILABLE, "store-busy")
    } else {
        (StatusCode::CONFLICT, "in-flight")
    };
    assert_eq!(response.status, status, "{response:?}");
    assert_eq!(response.problem(), problem);
    assert!(response.headers.contains_key("retry-after"));
    match response.outcome {
        Some(crate::IdempotencyOutcome::Refused { attempts, .. }) => {
            assert!((1..=3).contains(&attempts), "{attempts} attempts")
        }
        other => panic!("{other:?}"),
    }
    assert!(
        elapsed < bound,
        "bounded by the in-flight wait: {elapsed:?}"
    );
    assert_eq!(h.executions(), 0);
    // The stuck request dies: the key is free and runs once.
    stuck.rollback().await.unwrap();
    let ok = send(&app, order(ALICE, KEY, BODY)).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 1);
}

/// Acceptance 7: a late retry after retention is refused, never re-executed.
pub async fn expired_record_is_refused_with_410<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let first = send(&app, order(ALICE, KEY, BODY)).await;
    let id = first.json()["orderId"].as_i64().unwrap().to_string();
    DB::exec(h.plain(), "UPDATE idempotency_records SET expires_at = 1").await;
    let late = send(&app, order(ALICE, KEY, BODY)).await;
    assert_eq!(late.status, StatusCode::GONE);
    assert_eq!(late.problem(), "expired");
    assert_eq!(late.json()["resource_id"], id.as_str());
    assert_eq!(late.json()["idempotency_key"], "checkout-20260914-001");
    assert_eq!(late.json()["retryable"], false);
    assert!(
        late.json()["spec"]
            .as_str()
            .is_some_and(|s| s.ends_with("#section-2.3")),
        "{late:?}"
    );
    // A tombstone is refused too, whatever the payload.
    DB::exec(h.plain(), "UPDATE idempotency_records SET status = 'EXPIRED', response_body = NULL, response_headers = NULL, expires_at = 9000000000000").await;
    let changed = send(&app, order(ALICE, KEY, r#"{"amount":1}"#)).await;
    assert_eq!(changed.status, StatusCode::GONE);
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger().await, 1);
}

/// Acceptance 3 at scale: 50 callers, one key, one execution.
pub async fn fifty_concurrent_duplicates_execute_once<DB: ConformanceDb>(h: Harness<DB>) {
    DB::set_stock(h.plain(), "A-10", 100).await;
    let app = h.app();
    let body = r#"{"amount":12000,"items":[{"sku":"A-10","qty":1}],"sleep_ms":50}"#;
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, order(ALICE, KEY, body)).await })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    assert_eq!(h.executions(), 1, "exactly one execution");
    assert_eq!(h.orders().await, 1);
    assert_eq!(
        DB::stock(h.plain(), "A-10").await,
        99,
        "one stock decrement"
    );
    assert_eq!(h.ledger().await, 1);
    let created: Vec<_> = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED)
        .collect();
    assert!(!created.is_empty());
    for a in &answers {
        match a.status {
            StatusCode::CREATED => {
                assert_eq!(a.body, created[0].body, "every 201 is the same bytes")
            }
            StatusCode::CONFLICT => assert_eq!(a.problem(), "in-flight"),
            other => panic!("unexpected {other}: {a:?}"),
        }
    }
}

/// Case: other principal same key is independent.
pub async fn other_principal_same_key_is_independent<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let alice = send(&app, order(ALICE, KEY, BODY)).await;
    let bob = send(&app, order(Some("user-7"), KEY, BODY)).await;
    assert_eq!(bob.status, StatusCode::CREATED);
    assert!(!bob.replayed(), "never another principal's answer");
    assert_ne!(alice.json()["orderId"], bob.json()["orderId"]);
    assert_eq!(bob.json()["principal"], "user-7");
    // A changed payload for Bob is not judged against Alice's record.
    let bob2 = send(
        &app,
        order(Some("user-7"), Some("fresh"), r#"{"amount":5}"#),
    )
    .await;
    assert_eq!(bob2.status, StatusCode::CREATED);
    assert_eq!(h.executions(), 3);
    assert_eq!(h.orders().await, 3);
    assert_eq!(h.ledger().await, 3);
}

/// Case: dropped future commits nothing.
pub async fn dropped_future_commits_nothing<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let slow = r#"{"amount":12000,"sleep_ms":2000}"#;
    let cut = tokio::time::timeout(
        Duration::from_millis(300),
        send(&app, order(ALICE, KEY, slow)),
    )
    .await;
    assert!(cut.is_err(), "the client went away mid-handler");
    assert_eq!(h.executions(), 1);
    // The retry is not blocked by the abandoned claim and runs afresh.
    let retry = send(&app, order(ALICE, KEY, slow.replace("2000", "0").as_str())).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(h.executions(), 2);
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger().await, 1);
}

/// Case: panicking handler commits nothing.
pub async fn panicking_handler_commits_nothing<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let panicked = tokio::spawn({
        let app = app.clone();
        async move { send(&app, order(ALICE, KEY, r#"{"amount":1,"mode":"panic"}"#)).await }
    })
    .await;
    assert!(
        panicked.unwrap_err().is_panic(),
        "the panic continues past the layer"
    );
    h.assert_nothing_stored().await;
    let retry = send(&app, order(ALICE, KEY, r#"{"amount":1,"mode":"ok"}"#)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(h.executions(), 2);
    assert_eq!(h.orders().await, 1);
}

/// Case: held transaction handle commits nothing.
pub async fn held_transaction_handle_commits_nothing<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let a = send(&app, order(ALICE, KEY, r#"{"amount":1,"mode":"hold"}"#)).await;
    assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(a.problem(), "transaction-held");
    tokio::time::sleep(Duration::from_millis(500)).await;
    h.assert_nothing_stored().await;
}

/// The connection dies under the handler's transaction: nothing commits, the
/// client gets a retryable 503, and the retry runs exactly once.
pub async fn lost_connection_commits_nothing_and_retry_runs_once<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    if DB::LABEL == "sqlite" {
        // An embedded database has no connection to lose.
        return;
    }
    let app = h.app();
    let a = send(
        &app,
        order(ALICE, KEY, r#"{"amount":1,"mode":"kill_connection"}"#),
    )
    .await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
    assert!(a.headers.contains_key("retry-after"));
    h.assert_nothing_stored().await;
    let retry = send(&app, order(ALICE, KEY, r#"{"amount":1,"mode":"ok"}"#)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(h.executions(), 2);
    assert_eq!(h.orders().await, 1);
}

/// The connection dies under the handler's transaction, and a duplicate
/// runs the key and commits it before the first request's answer is
/// decided: the first request is answered what the ledger holds (the
/// duplicate's order, replayed) or a retryable `503`, never its own order,
/// which was rolled back with its connection.
pub async fn a_lost_transaction_never_answers_an_order_that_did_not_commit<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    if DB::LABEL == "sqlite" {
        // An embedded database has no connection to lose.
        return;
    }
    // Two instances of the service: one process's duplicates wait for its
    // own request.
    let (app, other) = (h.app(), h.app());
    let body = r#"{"amount":1,"mode":"kill_first_await_duplicate"}"#;
    let first = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, order(ALICE, KEY, body)).await })
    };
    // Refused while the first holds the key (sent once its handler runs);
    // run once its transaction is gone.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while h.executions() == 0 {
        assert!(std::time::Instant::now() < deadline, "the first never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let duplicate = loop {
        let r = send(&other, order(ALICE, KEY, body)).await;
        if r.status == StatusCode::CREATED {
            break r;
        }
        assert!(
            r.status.as_u16() == 409 || r.status.as_u16() == 503,
            "{r:?}"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "the duplicate never ran"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(!duplicate.replayed(), "{duplicate:?}");
    let first = first.await.unwrap();
    assert_eq!(h.orders().await, 1, "the first order rolled back");
    if first.status == StatusCode::CREATED {
        assert_eq!(
            first.json()["orderId"],
            duplicate.json()["orderId"],
            "the first request is told the order that committed: {first:?}"
        );
    } else {
        assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
        assert!(first.headers.contains_key("retry-after"));
    }
}

/// Case: unguarded methods pass through.
pub async fn unguarded_methods_pass_through<DB: ConformanceDb>(h: Harness<DB>) {
    // PUT is not guarded by default: no key needed, no ledger row.
    let mut req = order(ALICE, None, BODY);
    *req.method_mut() = http::Method::PUT;
    let a = send(&h.app(), req).await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(h.ledger().await, 0);
    assert_eq!(h.orders().await, 1);
}

/// Case: the longest retention a layer can be given (`Duration::MAX`)
/// still records and replays: it is capped (10 000 years) before it
/// becomes SQL arithmetic, on every store.
pub async fn longest_retention_still_records_and_replays<DB: ConformanceDb>(h: Harness<DB>) {
    let layer = h.layer().with_retention(Duration::MAX);
    let app = h.app_with(layer);
    let first = send(&app, order(ALICE, KEY, BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let retry = send(&app, order(ALICE, KEY, BODY)).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(h.orders().await, 1);
}

/// Issue 5: clients learn until when a retry is safe, on first answers and
/// replays alike; an expired key's 410 links the resource.
pub async fn answers_advertise_the_key_expiry<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app_with(h.layer().with_resource_link(|id| format!("/orders/{id}")));
    let first = send(&app, order(ALICE, KEY, BODY)).await;
    let expires_at = DB::count(h.plain(), "SELECT expires_at FROM idempotency_records").await;
    assert_eq!(
        first.headers["idempotency-key-expires"],
        http_date(expires_at).as_str()
    );
    let retry = send(&app, order(ALICE, KEY, BODY)).await;
    assert!(retry.replayed());
    assert_eq!(
        retry.headers["idempotency-key-expires"],
        first.headers["idempotency-key-expires"]
    );
    // About 24 hours ahead by default.
    let created = DB::count(h.plain(), "SELECT created_at FROM idempotency_records").await;
    assert_eq!(expires_at - created, 24 * 60 * 60 * 1000);
    // Unrecorded answers promise nothing.
    let rejected = send(&app, order(ALICE, Some("neg"), r#"{"amount":-1}"#)).await;
    assert!(rejected.headers.get("idempotency-key-expires").is_none());
    DB::exec(h.plain(), "UPDATE idempotency_records SET expires_at = 1").await;
    let late = send(&app, order(ALICE, KEY, BODY)).await;
    assert_eq!(late.status, StatusCode::GONE);
    let id = first.json()["orderId"].as_i64().unwrap();
    assert_eq!(
        late.headers["link"],
        format!("</orders/{id}>; rel=\"related\"").as_str()
    );
    assert_eq!(late.json()["resource"], format!("/orders/{id}").as_str());
    assert_eq!(h.orders().await, 1);
}

/// Issue 5: hashed keys store no raw key and keep every guarantee.
pub async fn hashed_keys_keep_the_guarantees<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app_with(h.layer().with_hashed_keys(true));
    let first = send(&app, order(ALICE, Some("alice@example.com-checkout"), BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = send(&app, order(ALICE, Some("alice@example.com-checkout"), BODY)).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    let changed = send(
        &app,
        order(ALICE, Some("alice@example.com-checkout"), r#"{"amount":1}"#),
    )
    .await;
    assert_eq!(changed.problem(), "key-reused");
    let other = send(&app, order(ALICE, Some("another-key"), BODY)).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert_eq!(h.executions(), 2);
    assert_eq!(h.orders().await, 2);
    let raw = DB::count(
        h.plain(),
        "SELECT COUNT(*) FROM idempotency_records WHERE idem_key LIKE '%example.com%'",
    )
    .await;
    assert_eq!(raw, 0, "no raw key stored");
    let hashed = DB::count(
        h.plain(),
        "SELECT COUNT(*) FROM idempotency_records WHERE idem_key LIKE 'sha256:%'",
    )
    .await;
    assert_eq!(hashed, 2);
}

/// Issue 5: the sweeper tombstones terminal rows past expiry (keeping what
/// refuses the key), never touches PROCESSING, and purges tombstones only
/// after the second retention. Time is set by the test.
pub async fn sweep_tombstones_expired_rows_and_purges_them_later<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    DB::set_stock(h.plain(), "A-10", 1).await;
    let app = h.app();
    let k1 = send(&app, order(ALICE, Some("k1"), BODY)).await;
    send(&app, order(ALICE, Some("k2"), BODY)).await;
    let short = r#"{"amount":1,"items":[{"sku":"A-10","qty":5}]}"#;
    let k3 = send(&app, order(ALICE, Some("k3"), short)).await;
    assert_eq!(k3.status, StatusCode::CONFLICT);
    // k2 is kept for centuries; k1 and k3 have the default 24 hours.
    DB::exec(
        h.plain(),
        "UPDATE idempotency_records SET expires_at = 9000000000000 WHERE idem_key = 'k2'",
    )
    .await;
    // A committed PROCESSING row long past its expiry (lease-style): untouchable by time.
    DB::exec(h.plain(), "INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at) VALUES ('user-42', 'POST /orders', 'stuck', '\\x00', 'PROCESSING', 0, 1)").await;

    let sweeper = Sweeper::new(h.pool.clone()).with_batch_size(1);
    let day = Duration::from_secs(24 * 3600);
    let now = std::time::SystemTime::now() + 2 * day;
    assert_eq!(
        sweeper.sweep_at(now - 2 * day).await.unwrap(),
        crate::SweepReport {
            expired: 0,
            purged: 0,
            batches: 2
        }
    );
    let report = sweeper.sweep_at(now).await.unwrap();
    assert_eq!((report.expired, report.purged), (2, 0));
    assert_eq!(h.ledger_with("EXPIRED").await, 2);
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
    assert_eq!(h.ledger_with("PROCESSING").await, 1);
    let kept = DB::count(h.plain(), "SELECT COUNT(*) FROM idempotency_records WHERE status = 'EXPIRED' AND response_body IS NULL AND response_headers IS NULL AND request_fingerprint IS NOT NULL").await;
    assert_eq!(
        kept, 2,
        "tombstones drop the response, keep the fingerprint"
    );
    let with_resource = DB::count(h.plain(), "SELECT COUNT(*) FROM idempotency_records WHERE status = 'EXPIRED' AND resource_id IS NOT NULL").await;
    assert_eq!(with_resource, 1, "k1's resource id survives");
    // The tombstone refuses the key and names the resource.
    let late = send(&app, order(ALICE, Some("k1"), BODY)).await;
    assert_eq!(late.status, StatusCode::GONE);
    assert_eq!(
        late.json()["resource_id"],
        k1.json()["orderId"].to_string().as_str()
    );
    // Nothing to do again.
    assert_eq!(sweeper.sweep_at(now).await.unwrap().expired, 0);
    // 88 days on the tombstones are still kept; 200 days on they are past
    // the 90-day tombstone retention. k2 and PROCESSING stay.
    let report = sweeper.sweep_at(now + 88 * day).await.unwrap();
    assert_eq!((report.expired, report.purged), (0, 0));
    let report = sweeper.sweep_at(now + 200 * day).await.unwrap();
    assert_eq!((report.expired, report.purged), (0, 2));
    assert_eq!(
        report.batches, 4,
        "batches of one row: 1 expire + 3 purge statements"
    );
    assert_eq!(h.ledger().await, 2);
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
    assert_eq!(h.ledger_with("PROCESSING").await, 1);
    assert_eq!(h.orders().await, 2, "sweeping never touches business rows");
    // "Keep tombstones forever" works: the purge time does not overflow.
    DB::exec(
        h.plain(),
        "UPDATE idempotency_records SET expires_at = 1 WHERE idem_key = 'k2'",
    )
    .await;
    let forever = Sweeper::new(h.pool.clone()).with_tombstone_retention(Duration::MAX);
    let report = forever.sweep().await.unwrap();
    assert_eq!((report.expired, report.purged), (1, 0));
    assert_eq!(
        forever
            .sweep_at(now + 5_000 * 365 * day)
            .await
            .unwrap()
            .purged,
        0
    );
}

/// Issue 5: a claim runs while a sweep of 100 000 rows is under way.
pub async fn claims_run_while_a_large_sweep_runs<DB: ConformanceDb>(h: Harness<DB>) {
    DB::seed_expired(&h.pool, 100_000).await;
    let app = h.app();
    // Tombstones are kept (the seeded rows expired in 1970).
    let sweeper = Sweeper::new(h.pool.clone())
        .with_tombstone_retention(Duration::from_secs(200 * 365 * 24 * 3600));
    let sweep = tokio::spawn(async move {
        let started = Instant::now();
        let report = sweeper.sweep().await.unwrap();
        (report, started, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let claim_started = Instant::now();
    let claim = send(&app, order(ALICE, KEY, BODY)).await;
    let claim_done = Instant::now();
    let (report, sweep_started, sweep_done) = sweep.await.unwrap();
    assert_eq!(claim.status, StatusCode::CREATED, "{claim:?}");
    assert_eq!(report.expired, 100_000);
    assert!(report.batches >= 100, "bounded batches: {report:?}");
    assert!(
        sweep_started < claim_started && claim_done < sweep_done,
        "the claim completed while the sweep was running (claim took {:?}, sweep took {:?})",
        claim_done - claim_started,
        sweep_done - sweep_started,
    );
    println!(
        "[{}] sweep of 100 000 rows: {} batches in {:?}; a claim during it took {:?}",
        DB::LABEL,
        report.batches,
        sweep_done - sweep_started,
        claim_done - claim_started
    );
    assert_eq!(h.ledger_with("EXPIRED").await, 100_000);
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
}

/// The read-first path (`with_read_first(true)`) keeps every guarantee: the
/// replay comes from the read, a changed payload is refused there, and
/// concurrent duplicates still execute once.
pub async fn read_first_path_keeps_the_guarantees<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app_with(h.layer().with_read_first(true));
    let first = send(&app, order(ALICE, KEY, BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = send(&app, order(ALICE, KEY, BODY)).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    let changed = send(&app, order(ALICE, KEY, r#"{"amount":1}"#)).await;
    assert_eq!(changed.problem(), "key-reused");
    let body = r#"{"amount":7,"sleep_ms":50}"#;
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, order(ALICE, Some("race"), body)).await })
        })
        .collect();
    for t in tasks {
        let a = t.await.unwrap();
        assert!(
            matches!(a.status, StatusCode::CREATED | StatusCode::CONFLICT),
            "{a:?}"
        );
    }
    assert_eq!(h.executions(), 2);
    assert_eq!(h.orders().await, 2);
    assert_eq!(h.ledger().await, 2);
}

/// Two instances of the service (two layers, as in two processes) share one
/// database: the duplicate on the second instance waits on the first's
/// uncommitted claim in the database itself, then replays its answer.
pub async fn duplicate_on_another_instance_waits_on_the_database_then_replays<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    duplicate_during_the_first_replays_it(&h, h.app(), h.app()).await;
}

/// A slow first request through `first`, its duplicate through `second`
/// while it runs: one execution, and the duplicate replays its answer.
async fn duplicate_during_the_first_replays_it<DB: ConformanceDb>(
    h: &Harness<DB>,
    first: axum::Router,
    second: axum::Router,
) {
    let body = r#"{"amount":12000,"sleep_ms":300}"#;
    let first = tokio::spawn(async move { send(&first, order(ALICE, KEY, body)).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = send(&second, order(ALICE, KEY, body)).await;
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(second.status, StatusCode::CREATED, "{second:?}");
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 1);
}

/// Principals longer than a key column (a JWT subject, say) are scoped by
/// their hash: retries replay, and two long principals that share a prefix
/// stay apart.
pub async fn long_principals_are_scoped_by_their_hash<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let alice = format!("{}-alice", "p".repeat(600));
    let bob = format!("{}-bob", "p".repeat(600));
    let first = send(&app, order(Some(&alice), KEY, BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let retry = send(&app, order(Some(&alice), KEY, BODY)).await;
    assert!(retry.replayed());
    let other = send(&app, order(Some(&bob), KEY, BODY)).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert!(!other.replayed());
    assert_eq!(h.executions(), 2);
    assert_eq!(h.ledger().await, 2);
    let hashed = DB::count(
        h.plain(),
        "SELECT COUNT(*) FROM idempotency_records WHERE principal_id LIKE 'sha256:%'",
    )
    .await;
    assert_eq!(hashed, 2);
}

/// Duplicates that reach the same process wait for the first off the pool:
/// while the first runs, only its own connection is in use.
pub async fn waiting_duplicates_hold_no_pooled_connection<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let body = r#"{"amount":12000,"sleep_ms":600}"#;
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, order(ALICE, KEY, body)).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let duplicates: Vec<_> = (0..20)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, order(ALICE, KEY, body)).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let in_use = h.pool.size() as usize - h.pool.num_idle();
    assert_eq!(
        in_use, 1,
        "only the first request's transaction holds a connection"
    );
    let first = first.await.unwrap();
    for d in duplicates {
        let d = d.await.unwrap();
        assert_eq!(d.status, StatusCode::CREATED, "{d:?}");
        assert!(d.replayed());
        assert_eq!(d.body, first.body);
    }
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 1);
}

/// The failure-point table's "after the commit, before the response": the
/// answer is lost on its way out (an outer layer swallows it), the client
/// sees only a gateway error and retries. The retry replays the committed
/// answer; nothing runs twice.
pub async fn answer_lost_after_commit_is_replayed_not_re_executed<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    use axum::response::IntoResponse;
    let lossy = h.app().layer(axum::middleware::map_response(
        |_committed: axum::response::Response| async { StatusCode::BAD_GATEWAY.into_response() },
    ));
    let lost = send(&lossy, order(ALICE, KEY, BODY)).await;
    assert_eq!(lost.status, StatusCode::BAD_GATEWAY);
    assert_eq!(
        h.orders().await,
        1,
        "the order committed before the answer was lost"
    );
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
    let retry = send(&h.app(), order(ALICE, KEY, BODY)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 1);
}

/// A layer whose principal is the raw `x-principal` header, byte for byte
/// (no trimming, any UTF-8), for the identity cases.
fn raw_principal_layer<DB: ConformanceDb>(h: &Harness<DB>) -> IdempotencyLayer<DB> {
    IdempotencyLayer::new(h.pool.clone()).with_principal(|parts| {
        let raw = parts.headers.get("x-principal")?.as_bytes();
        String::from_utf8(raw.to_vec())
            .ok()
            .map(crate::Principal::new)
    })
}

fn as_principal(principal: &str, key: &str, body: &str) -> http::Request<axum::body::Body> {
    let mut req = order(None, Some(key), body);
    req.headers_mut().insert(
        "x-principal",
        http::HeaderValue::from_bytes(principal.as_bytes()).unwrap(),
    );
    req
}

/// Hardening 1: scopes compare byte for byte on every store: trailing
/// spaces, case and Unicode-equivalent spellings are different principals
/// and keys, never a replay of someone else's answer.
pub async fn scopes_compare_byte_for_byte<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app_with(raw_principal_layer(&h));
    let nfc = "caf\u{e9}";
    let nfd = "cafe\u{301}";
    let cases = [
        ("alice", "\"k-1\""),
        ("alice", "\"k-1 \""),
        ("alice ", "\"k-1\""),
        ("Alice", "\"k-1\""),
        ("alice", "\"K-1\""),
        (nfc, "\"k-1\""),
        (nfd, "\"k-1\""),
    ];
    for (principal, key) in cases {
        let a = send(&app, as_principal(principal, key, BODY)).await;
        assert_eq!(
            a.status,
            StatusCode::CREATED,
            "{principal:?} {key:?}: {a:?}"
        );
        assert!(
            !a.replayed(),
            "{principal:?} {key:?} got another scope's answer"
        );
    }
    assert_eq!(h.executions(), cases.len());
    assert_eq!(h.orders().await, cases.len() as i64);
    assert_eq!(h.ledger().await, cases.len() as i64);
    // Each one still replays its own answer.
    for (principal, key) in cases {
        assert!(
            send(&app, as_principal(principal, key, BODY))
                .await
                .replayed()
        );
    }
    assert_eq!(h.executions(), cases.len());
}

/// Hardening 2: a literal principal spelled like a long principal's stored
/// hash is a scope of its own.
pub async fn literal_hash_principal_never_meets_a_long_one<DB: ConformanceDb>(h: Harness<DB>) {
    use sha2::Digest;
    let app = h.app_with(raw_principal_layer(&h));
    let long = "p".repeat(600);
    let digest = sha2::Sha256::digest(long.as_bytes());
    let spelled: String = std::iter::once("sha256:".to_string())
        .chain(digest.iter().map(|b| format!("{b:02x}")))
        .collect();
    let first = send(&app, as_principal(&long, "k", BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = send(&app, as_principal(&spelled, "k", BODY)).await;
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    assert!(
        !other.replayed(),
        "the literal principal read the long one's answer"
    );
    assert_eq!(h.executions(), 2);
    assert_eq!(h.orders().await, 2);
}

/// `POST /orders/{id}/pay` for the path cases: one order per execution.
async fn pay<DB: ConformanceDb>(
    State(st): State<super::AppState<DB>>,
    tx: crate::Tx<DB>,
    ran: Option<axum::Extension<super::Ran>>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    st.executions
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    if let Some(axum::Extension(ran)) = ran {
        ran.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    let mut conn = tx.lock().unwrap();
    let id = DB::insert_order(&mut conn, "payer", 1).await.unwrap();
    (StatusCode::CREATED, format!("{{\"paymentId\":{id}}}")).into_response()
}

/// Hardening 3: the same key on two spellings of one path is one request,
/// with the layer outside the router (no `MatchedPath`: the operation is
/// the normalized path) and on the route (the template).
pub async fn path_spellings_are_one_operation<DB: ConformanceDb>(h: Harness<DB>) {
    use axum::routing::post;
    let state = super::AppState {
        pool: h.pool.clone(),
        executions: std::sync::Arc::clone(&h.executions),
        first: h.environment.handler.statements,
    };
    let inside = axum::Router::new()
        .route("/orders/{id}/pay", post(pay::<DB>).layer(h.layer()))
        .with_state(state.clone());
    let routes = axum::Router::new()
        .route("/orders/{id}/pay", post(pay::<DB>))
        .with_state(state);
    let outside = h.judged(
        axum::Router::new().fallback_service(
            tower::ServiceBuilder::new()
                .layer(h.layer())
                .service(routes),
        ),
    );
    let inside = h.judged(inside);
    let request = |path: &str, key: &str| {
        let mut req = order(ALICE, Some(key), "{}");
        *req.uri_mut() = path.parse().unwrap();
        req
    };
    for (app, key) in [(&outside, "outside"), (&inside, "inside")] {
        let first = send(app, request("/orders/abc/pay", key)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{key}: {first:?}");
        // (axum's router does not remove dot segments: that spelling only
        // reaches the layer outside it.)
        let spellings: &[&str] = if key == "outside" {
            &[
                "/orders/%61bc/pay",
                "/orders/x/../abc/./pay",
                "/orders/%61%62%63/pay",
            ]
        } else {
            &["/orders/%61bc/pay", "/orders/%61%62%63/pay"]
        };
        for spelling in spellings {
            let again = send(app, request(spelling, key)).await;
            assert_eq!(
                again.status,
                StatusCode::CREATED,
                "{key} {spelling}: {again:?}"
            );
            assert!(again.replayed(), "{key} {spelling} ran again");
            assert_eq!(again.body, first.body);
        }
        // Another resource under the same key: outside the router another
        // operation (its own scope, so it runs); on the route the same
        // operation (the template) with another fingerprint (refused).
        let other = send(app, request("/orders/xyz/pay", key)).await;
        if key == "outside" {
            assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
            assert!(!other.replayed());
        } else {
            assert_eq!(other.problem(), "key-reused", "{other:?}");
        }
    }
    assert_eq!(h.executions(), 3, "one payment per resource and placement");
    assert_eq!(h.orders().await, 3);
}

/// Hardening 7: duplicates of a slow first request wait a bounded time
/// (answered `409` in-flight with `Retry-After` while the first still
/// runs), and while they wait, unrelated keys still find a connection in a
/// pool of 3. Judged by the order of answers, not by a clock: every
/// unrelated key is answered `201` before any duplicate that waits its
/// whole in-flight wait (3 s), and every duplicate before the first, whose
/// handler holds its transaction 4 s longer than that wait. The pool's
/// acquire timeout is far (20 s), so only starvation (an unrelated key
/// queued behind the waiters) could reverse the order.
pub async fn waiting_is_bounded_and_leaves_the_pool_to_others<DB: ConformanceDb>(h: Harness<DB>) {
    if DB::LABEL == "sqlite" {
        // One writer at a time: another key waits for the write lock (and
        // gets 503 store-busy) whatever the pool does.
        return;
    }
    use std::sync::{Arc, Mutex};
    let small = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(20))
        .connect_with((*h.pool.connect_options()).clone())
        .await
        .unwrap();
    let wait = Duration::from_secs(3);
    let layer = || {
        IdempotencyLayer::new(small.clone())
            .with_principal(super::bearer)
            .with_in_flight_wait(wait)
    };
    let one = h.app_with(layer());
    let two = h.app_with(layer());
    // What was answered, in order.
    let events: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = |events: &Arc<Mutex<Vec<String>>>, what: String| {
        events.lock().unwrap_or_else(|e| e.into_inner()).push(what);
    };
    let slow = r#"{"amount":1,"sleep_ms":7000}"#;
    let first = tokio::spawn({
        let app = one.clone();
        let events = Arc::clone(&events);
        async move {
            let a = send(&app, order(ALICE, KEY, slow)).await;
            log(&events, "first".into());
            a
        }
    });
    // The first's handler runs (an event, with a far bound).
    let started = Instant::now();
    while h.executions() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the first never ran"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Duplicates on this instance (they wait off the pool for the first)
    // and on another one (another layer: they wait in the database, within
    // the layer's waiter permits, or are answered at once).
    let duplicates: Vec<_> = (0..10)
        .map(|i| {
            let local = i % 2 == 0;
            let app = if local { one.clone() } else { two.clone() };
            let events = Arc::clone(&events);
            tokio::spawn(async move {
                let a = send(&app, order(ALICE, KEY, slow)).await;
                let who = if local {
                    "local duplicate"
                } else {
                    "remote duplicate"
                };
                log(&events, who.into());
                a
            })
        })
        .collect();
    for n in 0..3 {
        let key = format!("unrelated-{n}");
        let other = send(&one, order(ALICE, Some(&key), BODY)).await;
        assert_eq!(
            other.status,
            StatusCode::CREATED,
            "an uncontended key found no connection: {other:?}"
        );
        log(&events, "unrelated".into());
    }
    for (i, d) in duplicates.into_iter().enumerate() {
        let a = d.await.unwrap();
        assert!(a.headers.contains_key("retry-after"), "{a:?}");
        if i % 2 == 0 || a.status == StatusCode::CONFLICT {
            assert_eq!(a.status, StatusCode::CONFLICT, "{a:?}");
            assert_eq!(a.problem(), "in-flight");
        } else {
            // On the other instance a duplicate first waits for a slot of
            // its principal's share; the ones holding it wait out the
            // in-flight wait, so a duplicate may find none in time.
            assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
            assert_eq!(a.problem(), "store-busy");
        }
    }
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let events = events.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let last_unrelated = events.iter().rposition(|e| e == "unrelated");
    let first_local = events.iter().position(|e| e == "local duplicate");
    assert!(
        last_unrelated < first_local,
        "unrelated keys waited for the duplicates' wait: {events:?}"
    );
    assert_eq!(
        events.last().map(String::as_str),
        Some("first"),
        "every duplicate was answered while the first still ran: {events:?}"
    );
    assert_eq!(h.executions(), 4, "the first and three unrelated keys");
    assert_eq!(h.orders().await, 4);
}

/// Hardening 10: a busy store is `503` store-busy, never "in flight" for a
/// key that has no record: another scope holds the database's write lock
/// on SQLite; elsewhere the fresh key just runs.
pub async fn busy_store_is_503_not_in_flight<DB: ConformanceDb>(h: Harness<DB>) {
    let held = DB::hold_claim(&h.pool, "someone-else", "POST /orders", "their-key").await;
    let a = send(&h.app(), order(ALICE, KEY, BODY)).await;
    if DB::LABEL == "sqlite" {
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
        assert_eq!(a.problem(), "store-busy");
        assert!(a.headers.contains_key("retry-after"));
        assert_eq!(h.executions(), 0);
    } else {
        assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    }
    held.rollback().await.unwrap();
    let a = send(&h.app(), order(ALICE, KEY, BODY)).await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(h.orders().await, 1);
}

/// Hardening 11: a handler that ends the claimed transaction itself is
/// answered `500` transaction-ended; what it committed stays, the key
/// answers `503` reconciling (never "in flight", never a new execution)
/// until an operator resolves it.
pub async fn handler_that_ends_the_transaction_is_held_for_reconciliation<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h.app();
    let mut modes = vec!["commit_503", "commit_201", "commit_409"];
    if DB::CLAIMS_RUN_WITHOUT_AUTOCOMMIT {
        // A ROLLBACK, then more writes: with autocommit off they stay
        // uncommitted and the layer rolls them back. Nothing committed, so
        // the key is free again, never held.
        let body = r#"{"amount":1,"mode":"rollback_201"}"#;
        let a = send(&app, order(ALICE, Some("rollback_201"), body)).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
        assert_eq!(a.problem(), "transaction-conflict");
        assert!(a.headers.contains_key("retry-after"));
        assert_eq!(
            h.orders().await,
            0,
            "the writes after the ROLLBACK stay uncommitted"
        );
        assert_eq!(h.ledger().await, 0);
        let retry = send(
            &app,
            order(ALICE, Some("rollback_201"), r#"{"amount":1,"mode":"ok"}"#),
        )
        .await;
        assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
        assert_eq!(h.orders().await, 1);
        // A ROLLBACK, and then another request's claim of the key holds
        // the row, uncommitted: the recording, in a transaction that is no
        // longer the claim's, does not wait on that lock. The answer comes
        // while the other claim still holds it (let go 20 s on otherwise).
        let (_, a) = rolled_back_then_held(&app).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
        assert_eq!(a.problem(), "transaction-conflict");
        assert_eq!(h.orders().await, 1, "only the retry's order above");
        DB::exec(h.plain(), "DELETE FROM orders").await;
        DB::exec(h.plain(), "DELETE FROM idempotency_records").await;
        h.executions.store(0, std::sync::atomic::Ordering::SeqCst);
    } else {
        modes.push("rollback_201");
    }
    if DB::LABEL == "mysql" {
        modes.push("ddl_201");
        modes.push("autocommit_201");
    }
    for mode in &modes {
        let body = format!(r#"{{"amount":1,"mode":"{mode}"}}"#);
        let a = send(&app, order(ALICE, Some(mode), &body)).await;
        assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR, "{mode}: {a:?}");
        assert_eq!(a.problem(), "transaction-ended", "{mode}");
        for _ in 0..2 {
            let retry = send(&app, order(ALICE, Some(mode), &body)).await;
            assert_eq!(
                retry.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{mode}: {retry:?}"
            );
            assert_eq!(retry.problem(), "reconciling", "{mode}");
            assert!(retry.headers.contains_key("retry-after"));
        }
    }
    assert_eq!(h.executions(), modes.len(), "retries never execute");
    assert_eq!(
        h.orders().await,
        modes.len() as i64,
        "the handler's commits stay"
    );
    let marked = DB::count(
        h.plain(),
        "SELECT COUNT(*) FROM idempotency_records WHERE status = 'NEEDS_RECONCILIATION'",
    )
    .await;
    assert_eq!(marked, modes.len() as i64);
    // The operator resolves one as succeeded and one as safe to re-run.
    let reconciler = crate::Reconciler::new(h.pool.clone());
    let open = reconciler.unresolved(100).await.unwrap();
    assert_eq!(open.len(), modes.len());
    let find = |key: &str| open.iter().find(|r| r.key == key).unwrap().clone();
    let answer = http::Response::builder()
        .status(201)
        .header("content-type", "application/json")
        .body(Bytes::from_static(b"{\"orderId\":\"resolved\"}"))
        .unwrap();
    let resolved = find("commit_201");
    reconciler
        .resolve(&resolved, crate::Resolution::Succeeded(answer))
        .await
        .unwrap();
    let twice = reconciler
        .resolve(&resolved, crate::Resolution::Rerun)
        .await;
    assert!(
        matches!(
            twice,
            Err(crate::ResolveError::Settled {
                status: crate::store::RecordStatus::Succeeded
            })
        ),
        "a resolved key cannot be resolved twice: {twice:?}"
    );
    reconciler
        .resolve(&find("commit_503"), crate::Resolution::Rerun)
        .await
        .unwrap();
    let replay = send(
        &app,
        order(
            ALICE,
            Some("commit_201"),
            r#"{"amount":1,"mode":"commit_201"}"#,
        ),
    )
    .await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(&replay.body[..], b"{\"orderId\":\"resolved\"}");
    let rerun = send(
        &app,
        order(ALICE, Some("commit_503"), r#"{"amount":1,"mode":"ok"}"#),
    )
    .await;
    assert_eq!(rerun.status, StatusCode::CREATED, "{rerun:?}");
    assert_eq!(
        reconciler.unresolved(100).await.unwrap().len(),
        modes.len() - 2
    );
}

/// Issue 25: a nested `begin()` on the claimed transaction is a savepoint
/// sqlx counts, whatever ends it (`commit()`, `rollback()`, a drop): the
/// claim and what holds the scope survive, a duplicate sent meanwhile on
/// another instance never runs the handler and replays, and only the
/// nested work the handler committed is kept.
pub async fn nested_transactions_in_the_handler_are_savepoints<DB: ConformanceDb>(h: Harness<DB>) {
    let mut expected_orders = 0;
    for (mode, orders) in [
        ("nested_rollback", 1),
        ("nested_drop", 1),
        ("nested_commit", 2),
    ] {
        let body = format!(r#"{{"amount":1,"mode":"{mode}","sleep_ms":300}}"#);
        let (a, b) = (h.app(), h.app());
        let first = {
            let body = body.clone();
            tokio::spawn(async move { send(&a, order(ALICE, Some(mode), &body)).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        let second = send(&b, order(ALICE, Some(mode), &body)).await;
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{mode}: {first:?}");
        assert_eq!(second.status, StatusCode::CREATED, "{mode}: {second:?}");
        assert!(second.replayed(), "{mode}: the duplicate replays");
        assert_eq!(second.body, first.body, "{mode}");
        expected_orders += orders;
        assert_eq!(h.orders().await, expected_orders, "{mode}: rows committed");
    }
    assert_eq!(h.executions(), 3, "one run per key");
    assert_eq!(h.ledger_with("SUCCEEDED").await, 3);
}

/// Issue 33, point 3: a handler that takes savepoints of its own (one
/// named as the layer's savepoint once was, `tower_idempotency_claimed`)
/// and then answers a final business error keeps none of its writes: the
/// layer rolls back to its own savepoint, whose name no handler can know,
/// and records `FAILED_FINAL` alone.
pub async fn a_handlers_own_savepoints_never_keep_writes_of_a_final_error<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h.app();
    let body = r#"{"amount":7,"mode":"own_savepoints_409"}"#;
    let first = send(&app, order(ALICE, KEY, body)).await;
    assert_eq!(first.status, StatusCode::CONFLICT, "{first:?}");
    assert_eq!(h.orders().await, 0, "no business write of a final error");
    assert_eq!(h.ledger_with("FAILED_FINAL").await, 1);
    assert_eq!(h.ledger().await, 1);
    let retry = send(&app, order(ALICE, KEY, body)).await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 0);
}

/// Issue 26, point 1: where claims run without autocommit (MySQL,
/// MariaDB), a claimed transaction the server rolled back on its own (a
/// deadlock victim) whose ledger re-read then fails proves nothing: the
/// answer is a retryable `503`, and the key is never held as if the
/// handler had committed (before: `500 #transaction-ended` and
/// `NEEDS_RECONCILIATION` until an operator acted). Elsewhere a
/// transaction found ended is the handler's doing and is held.
pub async fn a_failed_read_after_a_server_rollback_never_holds_the_key<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    if !DB::CLAIMS_RUN_WITHOUT_AUTOCOMMIT {
        return;
    }
    let check = h.pool.clone();
    let options = (*check.connect_options()).clone();
    let closing = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap();
    let h = h.with_pool(closing);
    let a = send(
        &h.app(),
        order(
            ALICE,
            Some("lost-read"),
            r#"{"amount":1,"mode":"rollback_pool_closed"}"#,
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
    assert!(a.headers.contains_key("retry-after"), "{a:?}");
    let held = DB::count(
        &check,
        "SELECT COUNT(*) FROM idempotency_records WHERE status = 'NEEDS_RECONCILIATION'",
    )
    .await;
    assert_eq!(held, 0, "the key is never held on a failed read");
    assert_eq!(DB::count(&check, "SELECT COUNT(*) FROM orders").await, 0);
}

/// Hardening 9: under `SERIALIZABLE` (and `REPEATABLE READ`), a claim that
/// loses to a concurrent one is read back and replayed, never a store
/// error; concurrent duplicates still execute once.
pub async fn stricter_isolation_keeps_the_guarantees<DB: ConformanceDb>(h: Harness<DB>) {
    for (level, key) in [
        (crate::IsolationLevel::Serializable, "serializable"),
        (crate::IsolationLevel::RepeatableRead, "repeatable"),
    ] {
        // Two instances: the duplicate waits on the first in the database.
        let one = h.app_with(h.layer().with_isolation_level(level));
        let two = h.app_with(h.layer().with_isolation_level(level));
        let body = r#"{"amount":3,"sleep_ms":300}"#;
        let first = tokio::spawn({
            let one = one.clone();
            async move { send(&one, order(ALICE, Some(key), body)).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let second = send(&two, order(ALICE, Some(key), body)).await;
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        assert!(
            second.replayed() || second.problem() == "in-flight",
            "{level:?}: {second:?}"
        );
        let again = send(&two, order(ALICE, Some(key), body)).await;
        assert!(again.replayed(), "{again:?}");
        assert_eq!(again.body, first.body);
    }
    assert_eq!(h.executions(), 2);
    assert_eq!(h.orders().await, 2);
}

/// Issue 33, point 1: above `READ COMMITTED`, a duplicate that arrives
/// as the first request commits never runs the handler again. Storms of
/// duplicates at `REPEATABLE READ` and `SERIALIZABLE` (each key's copies
/// sent to instances of their own around its first execution's commit), judged by executions, orders
/// and stock: one of each per key, and every answer the first one's, a
/// replay or the in-flight refusal (before: a duplicate whose snapshot was
/// taken just before the first committed won the released lock, found no
/// row and ran the handler again).
pub async fn stricter_isolation_never_runs_a_finished_key_again<DB: ConformanceDb>(h: Harness<DB>) {
    stricter_isolation_storms(h, 12).await;
}

/// [`stricter_isolation_never_runs_a_finished_key_again`] with `keys`
/// storms per isolation level (for slow environments).
pub async fn stricter_isolation_storms<DB: ConformanceDb>(h: Harness<DB>, keys_per_level: usize) {
    const COPIES: u64 = 8;
    DB::set_stock(h.plain(), "A-10", 1_000).await;
    let body = r#"{"amount":5,"items":[{"sku":"A-10","qty":1}]}"#;
    let mut keys = 0;
    for level in [
        crate::IsolationLevel::RepeatableRead,
        crate::IsolationLevel::Serializable,
    ] {
        // One instance per copy: each claim meets the others in the
        // database, not in one process's table of keys in flight.
        let apps: Vec<_> = (0..COPIES)
            .map(|_| h.app_with(h.layer().with_isolation_level(level)))
            .collect();
        for k in 0..keys_per_level {
            keys += 1;
            let key = format!("storm-{level:?}-{k}");
            let copies: Vec<_> = (0..COPIES)
                .map(|i| {
                    let (app, key) = (apps[i as usize].clone(), key.clone());
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(i * 2)).await;
                        send(&app, order(ALICE, Some(&key), body)).await
                    })
                })
                .collect();
            let mut created = Vec::new();
            for copy in copies {
                let a = copy.await.unwrap();
                match a.status {
                    StatusCode::CREATED => created.push(a.body),
                    StatusCode::CONFLICT => assert_eq!(a.problem(), "in-flight", "{a:?}"),
                    // A slow session (a matrix environment) may keep the
                    // pool busy: a retryable refusal, nothing recorded.
                    // In the claim-at-commit mode, duplicates run the
                    // handler at once: one that conflicts with another in
                    // the database (on the stock row, or at the ledger row
                    // under SERIALIZABLE) is rolled back and told to retry.
                    StatusCode::SERVICE_UNAVAILABLE if h.at_commit => {
                        let problem = a.problem();
                        assert!(
                            problem == "store-busy" || problem == "transaction-conflict",
                            "{a:?}"
                        )
                    }
                    StatusCode::SERVICE_UNAVAILABLE => {
                        assert_eq!(a.problem(), "store-busy", "{a:?}")
                    }
                    _ => panic!("{level:?} {key}: {a:?}"),
                }
            }
            assert!(created.windows(2).all(|w| w[0] == w[1]), "{level:?} {key}");
            assert_eq!(
                h.executions(),
                keys,
                "{level:?} {key}: one execution per key"
            );
        }
    }
    assert_eq!(h.orders().await, keys as i64);
    assert_eq!(DB::stock(h.plain(), "A-10").await, 1_000 - keys as i64);
    assert_eq!(h.ledger_with("SUCCEEDED").await, keys as i64);
}

/// Migrations: a database created by the previous release (the ledger
/// without a migrations table, with a row in it) is upgraded in place, and
/// three instances migrating at once apply each version exactly once.
pub async fn migrations_upgrade_in_place_and_run_concurrently<DB: ConformanceDb>(h: Harness<DB>) {
    let (url, _drop) = DB::fresh_url().await;
    let url = if DB::LABEL == "sqlite" {
        format!("{url}?mode=rwc")
    } else {
        url
    };
    let pools: Vec<Pool<DB>> = {
        let mut pools = Vec::new();
        for _ in 0..3 {
            pools.push(
                sqlx::pool::PoolOptions::<DB>::new()
                    .max_connections(2)
                    .connect(&url)
                    .await
                    .unwrap(),
            );
        }
        pools
    };
    let v1 = match DB::LABEL {
        "postgres" => include_str!("../../migrations/postgres/0001_idempotency_records.sql"),
        "mysql" => include_str!("../../migrations/mysql/0001_idempotency_records.sql"),
        _ => include_str!("../../migrations/sqlite/0001_idempotency_records.sql"),
    };
    DB::exec(&pools[0], v1).await;
    let old_row = if DB::LABEL == "postgres" {
        "INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, \
         status, response_status, created_at, expires_at) \
         VALUES ('old', 'op', 'k', '\\x00', 'SUCCEEDED', 201, 0, 9000000000000)"
    } else {
        "INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, \
         status, response_status, created_at, expires_at) \
         VALUES ('old', 'op', 'k', X'00', 'SUCCEEDED', 201, 0, 9000000000000)"
    };
    DB::exec(&pools[0], old_row).await;
    let runs: Vec<_> = pools
        .iter()
        .cloned()
        .map(|pool| tokio::spawn(async move { crate::migrate(&pool).await }))
        .collect();
    for run in runs {
        run.await.unwrap().unwrap();
    }
    let pool = &pools[0];
    // PostgreSQL's v6 is its claim functions; v7 (v6 elsewhere) is the
    // operators' audit trail; v8 (PostgreSQL) the scope lock's wait, v7
    // (MySQL/MariaDB) the ledger's view, v8 (MySQL/MariaDB) the table's
    // own name.
    let versions = match DB::LABEL {
        "postgres" => 8,
        "mysql" => 8,
        _ => 6,
    };
    assert_eq!(
        DB::count(pool, "SELECT COUNT(*) FROM tower_idempotency_migrations").await,
        versions
    );
    assert_eq!(
        DB::count(
            pool,
            "SELECT MAX(version) FROM tower_idempotency_migrations"
        )
        .await,
        versions
    );
    assert_eq!(
        DB::count(
            pool,
            "SELECT COUNT(*) FROM idempotency_records WHERE principal_id = 'old' AND response_status = 201"
        )
        .await,
        1,
        "the old row survives the upgrade"
    );
    // The new status is allowed; trailing spaces make another scope.
    let new_row = if DB::LABEL == "postgres" {
        "INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, \
         status, created_at, expires_at) VALUES ('old ', 'op', 'k', '\\x00', 'NEEDS_RECONCILIATION', 0, 1)"
    } else {
        "INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, \
         status, created_at, expires_at) VALUES ('old ', 'op', 'k', X'00', 'NEEDS_RECONCILIATION', 0, 1)"
    };
    DB::exec(pool, new_row).await;
    // Re-running is a no-op.
    crate::migrate(pool).await.unwrap();
    assert_eq!(
        DB::count(pool, "SELECT COUNT(*) FROM tower_idempotency_migrations").await,
        versions
    );
    if DB::LABEL == "mysql" {
        // MySQL's DDL commits statement by statement: migration 8 stopped
        // after its batch (its version unrecorded), or after its rename
        // (no view yet), runs again to its end.
        for halfway in [
            "DELETE FROM tower_idempotency_migrations WHERE version = 8",
            "DROP VIEW idempotency_records; DROP VIEW tower_idempotency_ledger; \
             DELETE FROM tower_idempotency_migrations WHERE version = 8",
        ] {
            DB::exec(pool, halfway).await;
            crate::migrate(pool).await.unwrap();
            assert_eq!(
                DB::count(
                    pool,
                    "SELECT COUNT(*) FROM information_schema.tables \
                     WHERE table_schema = DATABASE() AND table_type = 'VIEW' \
                     AND table_name IN ('idempotency_records', 'tower_idempotency_ledger')"
                )
                .await,
                2,
                "{halfway}"
            );
            assert_eq!(
                DB::count(pool, "SELECT COUNT(*) FROM tower_idempotency_records").await,
                2,
                "{halfway}"
            );
        }
    }
    // v4: an old row is a default-mode row, never leased; v5: no claim id,
    // never parked.
    assert_eq!(
        DB::count(
            pool,
            "SELECT COUNT(*) FROM idempotency_records WHERE principal_id = 'old' \
             AND generation = 0 AND locked_until IS NULL AND pending_step IS NULL \
             AND claim_id IS NULL AND parks = 0"
        )
        .await,
        1
    );
    drop(h);
}

/// Issue 10: a response future dropped at each await point (waiting in
/// the claim, in the handler, while the answer is recorded and committed)
/// leaves nothing behind on a single-connection pool: no open
/// transaction, no claim. The next request on that one connection runs,
/// and its commit is real (another pool sees it).
pub async fn dropped_futures_leave_a_clean_connection<DB: ConformanceDb>(h: Harness<DB>) {
    let one = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(1)
        .connect_with((*h.pool.connect_options()).clone())
        .await
        .unwrap();
    let app = h.app_with(IdempotencyLayer::new(one.clone()).with_principal(super::bearer));
    let cut = |body: &'static str, key: &'static str, after: u64| {
        let app = app.clone();
        async move {
            let sent = tokio::time::timeout(
                Duration::from_millis(after),
                send(&app, order(ALICE, Some(key), body)),
            )
            .await;
            assert!(sent.is_err(), "{key}: the client went away in time");
        }
    };
    // 1. Mid-claim: the key is held by a stuck claim (another pool), the
    //    request waits on it and is dropped. (SQLite: on the write lock.)
    let stuck = DB::hold_claim(&h.pool, "user-42", "POST /orders", "mid-claim").await;
    cut(BODY, "mid-claim", 30).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    stuck.rollback().await.unwrap();
    // 2. Mid-handler.
    cut(r#"{"amount":1,"sleep_ms":2000}"#, "mid-handler", 300).await;
    // 3. Mid-recording: the commit is slowed by the database itself.
    let slow_commit = match DB::LABEL {
        "postgres" => Some((
            "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN IF NEW.amount = 777 THEN PERFORM pg_sleep(1); END IF; RETURN NULL; END $$; \
             CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON orders \
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();",
            "DROP TRIGGER slow_commit ON orders",
        )),
        "mysql" => Some((
            "CREATE TRIGGER slow_record BEFORE UPDATE ON tower_idempotency_records FOR EACH ROW \
             SET @slept = IF(NEW.status = 'SUCCEEDED' AND NEW.idem_key = 'mid-finish', SLEEP(1), 0)",
            "DROP TRIGGER slow_record",
        )),
        // No server-side sleep in SQLite; its commit is local.
        _ => None,
    };
    if let Some((create, drop_it)) = slow_commit {
        DB::exec(h.plain(), create).await;
        cut(r#"{"amount":777}"#, "mid-finish", 400).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        DB::exec(h.plain(), drop_it).await;
    }
    // The one connection is clean: nothing of the cancelled requests is
    // kept, and a request through it commits for real.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let kept_before = h.orders().await;
    let ok = send(&app, order(ALICE, Some("after"), BODY)).await;
    assert_eq!(ok.status, StatusCode::CREATED, "{ok:?}");
    assert_eq!(
        DB::count(
            h.plain(),
            "SELECT COUNT(*) FROM idempotency_records WHERE idem_key = 'after' AND status = 'SUCCEEDED'"
        )
        .await,
        1,
        "another pool sees the commit"
    );
    assert_eq!(h.orders().await, kept_before + 1);
    for key in ["mid-claim", "mid-handler"] {
        let sql = match key {
            "mid-claim" => "SELECT COUNT(*) FROM idempotency_records WHERE idem_key = 'mid-claim'",
            _ => "SELECT COUNT(*) FROM idempotency_records WHERE idem_key = 'mid-handler'",
        };
        assert_eq!(DB::count(h.plain(), sql).await, 0, "{key} left a row");
    }
    // The mid-finish request either committed whole or not at all: its
    // order and its SUCCEEDED row together.
    let finished = DB::count(
        h.plain(),
        "SELECT COUNT(*) FROM idempotency_records WHERE idem_key = 'mid-finish' AND status = 'SUCCEEDED'",
    )
    .await;
    let order_kept = DB::count(h.plain(), "SELECT COUNT(*) FROM orders WHERE amount = 777").await;
    assert_eq!(finished, order_kept, "all or nothing");
    // Each cancelled key runs (or replays) on retry.
    for (key, body) in [("mid-claim", BODY), ("mid-handler", r#"{"amount":1}"#)] {
        let retry = send(&app, order(ALICE, Some(key), body)).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{key}: {retry:?}");
    }
    assert_eq!(one.size(), 1);
}

/// Sends a request whose handler rolls back, after which another
/// request's claim of its key holds the row uncommitted past the answer
/// (`rollback_held_201`), under a key of its own in the process (held
/// claims are found by key); lets that claim go once answered, and fails
/// when it was no longer held: the answer waited it out. The key and the
/// answer.
async fn rolled_back_then_held(app: &axum::Router) -> (String, super::Answer) {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let key = format!(
        "rollback_held_{}",
        N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    );
    let body = r#"{"amount":1,"mode":"rollback_held_201"}"#;
    let a = send(app, order(ALICE, Some(&key), body)).await;
    assert!(
        super::let_go(&key).await,
        "the answer waited until the other claim of the key let go"
    );
    (key, a)
}

/// MySQL/MariaDB, claim at commit: a handler that rolls back, after which
/// another request's claim of the key holds the row uncommitted. The
/// row's insert then runs in a new transaction and meets that row; its
/// wait runs out (`1205`), and the claim's savepoint (gone with the
/// rollback) tells that the transaction ended, not that a duplicate is in
/// flight: answered the retryable conflict while the other claim still
/// holds the key, with nothing committed.
pub async fn at_commit_a_rolled_back_handler_meeting_a_held_duplicate<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    assert!(h.at_commit && DB::CLAIMS_RUN_WITHOUT_AUTOCOMMIT);
    let layer = h.layer().with_in_flight_wait(Duration::from_millis(500));
    let app = h.app_with(layer);
    let (key, a) = rolled_back_then_held(&app).await;
    let key = key.as_str();
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
    assert_eq!(a.problem(), "transaction-conflict");
    assert_eq!(h.orders().await, 0);
    assert_eq!(h.ledger().await, 0);
    let retry = send(&app, order(ALICE, Some(key), r#"{"amount":1,"mode":"ok"}"#)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger().await, 1);
}

/// A handler that deletes its own claim's ledger row (and answers 201)
/// commits nothing without it: the layer never commits business rows
/// without the ledger row that makes a retry replay them (where the row is
/// only written with the COMMIT, the delete finds nothing to delete).
pub async fn a_handler_that_deletes_its_ledger_row_commits_nothing<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h.app();
    let body = r#"{"amount":5,"mode":"delete_ledger"}"#;
    let a = send(&app, order(ALICE, KEY, body)).await;
    if a.status == StatusCode::CREATED {
        // A store that writes the ledger row with the COMMIT (PostgreSQL at
        // READ COMMITTED): the delete found nothing, and the order and its
        // row committed together; a retry replays.
        let recorded = DB::count(
            h.plain(),
            "SELECT COUNT(*) FROM idempotency_records WHERE status = 'SUCCEEDED'",
        )
        .await;
        assert_eq!((h.orders().await, recorded), (1, 1));
        let retry = send(&app, order(ALICE, KEY, body)).await;
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(h.orders().await, 1);
        return;
    }
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
    h.assert_nothing_stored().await;
    let retry = send(&app, order(ALICE, KEY, r#"{"amount":5}"#)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(h.orders().await, 1);
}

/// Case: an answer over the recording limit (2 MiB, streamed, against the
/// default 1 MiB) commits its operation once, reaches its client whole,
/// and its retry replays the recorded status and headers with a problem
/// body, never running the handler again.
pub async fn an_answer_over_the_recording_limit_commits_once_and_never_runs_again<
    DB: ConformanceDb,
>(
    h: Harness<DB>,
) {
    let app = h.app();
    let big = r#"{"amount":12000,"items":[],"mode":"big"}"#;
    let first = send(&app, order(ALICE, KEY, big)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.headers);
    assert_eq!(first.body.len(), 2 * 1024 * 1024, "the whole answer");
    assert!(first.body.iter().all(|&b| b == b'x'));
    assert!(!first.replayed());
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);

    let retry = send(&app, order(ALICE, KEY, big)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "the recorded status");
    assert!(retry.replayed());
    assert_eq!(retry.headers["location"], first.headers["location"]);
    assert_eq!(retry.headers["content-type"], "application/problem+json");
    let doc = retry.json();
    assert!(
        doc["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("#response-too-large")),
        "{doc}"
    );
    assert_eq!(doc["status"], 201);
    assert_eq!(doc["idempotency_key"], "checkout-20260914-001", "{doc}");
    assert_eq!(doc["retryable"], false, "{doc}");
    assert_eq!(h.executions(), 1, "never run again");
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger().await, 1);
}

/// Case: a policy per principal puts two retentions and two body limits
/// side by side in one ledger: each record expires on its own clock (the
/// `410` and the sweeper read the record's `expires_at`), and each request
/// is held to its own limit.
pub async fn policies_give_records_their_own_retention_and_limits<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    use crate::Policy;
    let short = Policy::new()
        .with_retention(Duration::from_secs(1))
        .unwrap();
    let long = Policy::new()
        .with_retention(Duration::from_secs(86_400))
        .unwrap()
        .with_max_request_body(64)
        .unwrap();
    let layer = h
        .layer()
        .with_policy(move |_, principal| match principal.map(|p| p.as_str()) {
            Some("user-42") => short,
            Some("user-7") => long,
            _ => Policy::new(),
        });
    let app = h.app_with(layer);
    let alice = send(&app, order(ALICE, KEY, BODY)).await;
    let bob = send(&app, order(Some("user-7"), KEY, BODY)).await;
    assert_eq!(
        (alice.status, bob.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    let kept = |who: &'static str| {
        let sql: &'static str = match who {
            "user-42" => {
                "SELECT expires_at - created_at FROM idempotency_records WHERE principal_id = 'user-42'"
            }
            _ => {
                "SELECT expires_at - created_at FROM idempotency_records WHERE principal_id = 'user-7'"
            }
        };
        DB::count(h.plain(), sql)
    };
    assert_eq!(kept("user-42").await, 1_000);
    assert_eq!(kept("user-7").await, 86_400_000);
    // Bob's limit is his policy's: a body over 64 bytes is refused, unread
    // and unstored; Alice keeps the layer's 1 MiB.
    let big = format!(
        r#"{{"amount":12000,"items":[],"note":"{}"}}"#,
        "x".repeat(100)
    );
    let refused = send(&app, order(Some("user-7"), Some("\"big\""), &big)).await;
    assert_eq!(refused.status, StatusCode::PAYLOAD_TOO_LARGE, "{refused:?}");
    let fits = send(&app, order(ALICE, Some("\"big\""), &big)).await;
    assert_eq!(fits.status, StatusCode::CREATED, "{fits:?}");
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let alice_again = send(&app, order(ALICE, KEY, BODY)).await;
    assert_eq!(alice_again.status, StatusCode::GONE, "{alice_again:?}");
    let bob_again = send(&app, order(Some("user-7"), KEY, BODY)).await;
    assert!(bob_again.replayed(), "{bob_again:?}");
    let swept = crate::Sweeper::new(h.pool.clone()).sweep().await.unwrap();
    assert_eq!(swept.expired, 2, "Alice's two records, not Bob's");
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
    assert_eq!(h.executions(), 3);
}

/// Case: the key-status look-up tells a caller where its own key stands
/// (not found, in flight, succeeded with the answer on request, failed,
/// expired), never shows another principal's record, and stores nothing.
pub async fn the_key_status_look_up_says_where_a_key_stands<DB: ConformanceDb>(h: Harness<DB>) {
    let layer = h.layer();
    let app = h.app_with(layer.clone()).route_service(
        "/idempotency-keys",
        axum::routing::any_service(layer.key_status()),
    );
    let look = |who: Option<&'static str>, key: Option<&'static str>, answer: bool| {
        let uri = format!(
            "/idempotency-keys?operation=POST%20%2Forders{}",
            if answer { "&answer=true" } else { "" }
        );
        let mut req = http::Request::get(uri);
        if let Some(who) = who {
            req = req.header("authorization", format!("Bearer {who}"));
        }
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        req.body(axum::body::Body::empty()).unwrap()
    };
    let status_of = |a: &super::Answer| a.json()["status"].as_str().unwrap_or("").to_owned();

    let none = send(&app, look(ALICE, KEY, false)).await;
    assert_eq!(none.status, StatusCode::OK, "{none:?}");
    assert_eq!(status_of(&none), "not_found");

    let first = send(&app, order(ALICE, KEY, BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let done = send(&app, look(ALICE, KEY, false)).await;
    assert_eq!(status_of(&done), "succeeded", "{done:?}");
    assert_eq!(done.json()["response_status"], 201);
    assert!(done.json()["expires"].is_string());
    let answer = send(&app, look(ALICE, KEY, true)).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    assert!(answer.replayed());
    assert_eq!(answer.body, first.body, "the recorded answer itself");
    // Another principal's look at the same key and operation: its own
    // (absent) record, never Alice's.
    let other = send(&app, look(Some("user-7"), KEY, true)).await;
    assert_eq!(status_of(&other), "not_found", "{other:?}");

    // A recorded final business error.
    let declined = Some("\"declined-1\"");
    let final_error = r#"{"amount":12000,"items":[],"mode":"mark_final"}"#;
    let failed = send(&app, order(ALICE, declined, final_error)).await;
    assert_eq!(failed.status, StatusCode::BAD_GATEWAY);
    let looked = send(&app, look(ALICE, declined, false)).await;
    assert_eq!(status_of(&looked), "failed", "{looked:?}");
    assert_eq!(looked.json()["response_status"], 502);

    // A request still running.
    let slow = Some("\"slow-1\"");
    let running = {
        let app = app.clone();
        tokio::spawn(async move {
            send(
                &app,
                order(ALICE, slow, r#"{"amount":1,"items":[],"sleep_ms":1500}"#),
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    let flying = send(&app, look(ALICE, slow, false)).await;
    assert_eq!(status_of(&flying), "in_flight", "{flying:?}");
    assert!(flying.headers.contains_key("retry-after"));
    assert_eq!(running.await.unwrap().status, StatusCode::CREATED);
    let landed = send(&app, look(ALICE, slow, false)).await;
    assert_eq!(status_of(&landed), "succeeded", "{landed:?}");

    // Past its retention.
    DB::exec(h.plain(), "UPDATE idempotency_records SET expires_at = 0").await;
    let gone = send(&app, look(ALICE, KEY, true)).await;
    assert_eq!(status_of(&gone), "expired", "{gone:?}");

    // Refusals: no key, no principal.
    let no_key = send(&app, look(ALICE, None, false)).await;
    assert_eq!(no_key.status, StatusCode::BAD_REQUEST);
    let anonymous = send(&app, look(None, KEY, false)).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);

    assert_eq!(h.executions(), 3, "look-ups run nothing");
    assert_eq!(h.ledger().await, 3, "and store nothing");
}

/// Case: the key-status look-up's `answer=true` is the recorded answer as
/// a replay gives it, trailers included: an HTTP answer's, and a gRPC
/// answer's `grpc-status`.
pub async fn the_key_status_answer_is_the_replay_trailers_included<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let layer = h.layer();
    let app = h.app_with(layer.clone()).route_service(
        "/idempotency-keys",
        axum::routing::any_service(layer.key_status()),
    );
    let look = |key: &'static str| {
        http::Request::get("/idempotency-keys?operation=POST%20%2Forders&answer=true")
            .header("authorization", "Bearer user-42")
            .header("idempotency-key", key)
            .body(axum::body::Body::empty())
            .unwrap()
    };
    for (key, mode) in [("\"http-1\"", "trailers"), ("\"grpc-1\"", "grpc_0")] {
        let body = format!(r#"{{"amount":12000,"items":[],"mode":"{mode}"}}"#);
        let first = send(&app, order(ALICE, Some(key), &body)).await;
        assert!(first.trailers.is_some(), "{mode}: {first:?}");
        let replay = send(&app, order(ALICE, Some(key), &body)).await;
        assert!(replay.replayed(), "{mode}: {replay:?}");
        let looked = send(&app, look(key)).await;
        assert!(looked.replayed(), "{mode}: {looked:?}");
        assert_eq!(looked.status, replay.status, "{mode}");
        assert_eq!(looked.body, replay.body, "{mode}");
        assert_eq!(looked.trailers, replay.trailers, "{mode}: {looked:?}");
        assert_eq!(looked.trailers, first.trailers, "{mode}");
    }
    assert_eq!(h.executions(), 2, "look-ups run nothing");
    assert_eq!(h.orders().await, 2);
    assert_eq!(h.ledger().await, 2);
}

/// Case: with `Api-Version` fingerprinted, a retry under the same version
/// replays, and one under another version (or without the header) is
/// another request: refused as a reused key, never run, never replayed.
pub async fn fingerprinted_headers_tell_versions_apart<DB: ConformanceDb>(h: Harness<DB>) {
    let layer = h
        .layer()
        .with_fingerprint_headers([http::HeaderName::from_static("api-version")]);
    let app = h.app_with(layer);
    let versioned = |version: Option<&'static str>| {
        let mut req = order(ALICE, KEY, BODY);
        if let Some(v) = version {
            req.headers_mut()
                .insert("api-version", http::HeaderValue::from_static(v));
        }
        req
    };
    let first = send(&app, versioned(Some("2026-01-01"))).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let again = send(&app, versioned(Some("2026-01-01"))).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, first.body);
    for other in [Some("2026-06-01"), None] {
        let refused = send(&app, versioned(other)).await;
        assert_eq!(
            refused.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{other:?}: {refused:?}"
        );
        assert!(!refused.replayed());
    }
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger().await, 1);
}

/// Case: a gRPC answer over the recording limit commits once and reaches
/// its client whole; a retry gets a trailers-only `ALREADY_EXISTS` (reason
/// `IDEMPOTENCY_RESPONSE_NOT_KEPT`) with the recorded metadata, never a
/// problem document in a gRPC body, and never a second run.
pub async fn a_grpc_answer_over_the_recording_limit_replays_as_already_exists<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h.app();
    let big = r#"{"amount":12000,"items":[],"mode":"big_grpc"}"#;
    let first = send(&app, order(ALICE, KEY, big)).await;
    assert_eq!(first.status, StatusCode::OK, "{:?}", first.headers);
    assert_eq!(first.body.len(), 2 * 1024 * 1024, "the whole answer");
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);

    let retry = send(&app, order(ALICE, KEY, big)).await;
    assert_eq!(retry.status, StatusCode::OK);
    assert!(retry.replayed());
    assert_eq!(retry.headers["content-type"], "application/grpc");
    assert_eq!(retry.headers["grpc-status"], "6", "{:?}", retry.headers);
    assert_eq!(retry.headers["location"], first.headers["location"]);
    assert!(
        retry.headers.contains_key("grpc-status-details-bin"),
        "{:?}",
        retry.headers
    );
    assert!(retry.body.is_empty(), "trailers-only: no message");
    assert!(retry.trailers.is_none(), "trailers-only: no trailers");
    assert_eq!(h.executions(), 1, "never run again");
    assert_eq!(h.orders().await, 1);
}

/// Case: an answer streamed past the recording limit that then fails (a
/// gRPC `INTERNAL` in its trailers, an HTTP body that breaks) commits
/// nothing: the client was told it failed, so its order is rolled back and
/// no ledger row is left; the retry runs afresh. What commits agrees with
/// what the client was told.
pub async fn an_answer_that_fails_past_the_recording_limit_commits_nothing<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    use http_body_util::BodyExt;
    let app = h.app();
    let grpc = r#"{"amount":12000,"items":[],"mode":"big_grpc_internal"}"#;
    let first = send(&app, order(ALICE, KEY, grpc)).await;
    assert_eq!(first.body.len(), 2 * 1024 * 1024, "the whole message");
    let told = first.trailers.as_ref().expect("the answer's trailers");
    assert_eq!(told["grpc-status"], "13", "{told:?}");
    assert_eq!(h.orders().await, 0, "told INTERNAL: no order");
    assert_eq!(h.ledger().await, 0, "and no ledger row");
    let retry = send(&app, order(ALICE, KEY, grpc)).await;
    assert!(
        !retry.replayed(),
        "the retry runs afresh: {:?}",
        retry.headers
    );
    assert_eq!(h.executions(), 2);
    assert_eq!(h.orders().await, 0);
    assert_eq!(h.ledger().await, 0);

    // HTTP: the body breaks after the limit.
    use tower::ServiceExt;
    let broken = r#"{"amount":12000,"items":[],"mode":"big_broken"}"#;
    let key = Some("\"broken-1\"");
    let res = app
        .clone()
        .oneshot(order(ALICE, key, broken))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    let read = res.into_body().collect().await;
    assert!(read.is_err(), "the client sees the stream break");
    assert_eq!(h.orders().await, 0, "a broken answer: no order");
    assert_eq!(h.ledger().await, 0, "and no ledger row");
    assert_eq!(h.executions(), 3);
}

/// Case: an answer's trailers reach the client on the first answer, are
/// recorded, and come back identical on a replay.
pub async fn trailers_are_recorded_and_replayed<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let with = r#"{"amount":12000,"items":[],"mode":"trailers"}"#;
    let first = send(&app, order(ALICE, KEY, with)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let trailers = first.trailers.clone().expect("the first answer's trailers");
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(trailers["x-checksum"], "sha256=abc");
    let retry = send(&app, order(ALICE, KEY, with)).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.status, first.status);
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.trailers, first.trailers, "the same trailers replayed");
    assert!(
        retry.headers.get("grpc-status").is_none(),
        "trailers stay trailers"
    );
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 1);
}

/// Case: a gRPC answer (HTTP 200) is sorted by the `grpc-status` in its
/// trailers: `OK` recorded, `FAILED_PRECONDITION` recorded as a final
/// failure with its trailers (business writes undone), `INVALID_ARGUMENT`
/// and `UNAVAILABLE` rolled back with the key left usable.
pub async fn grpc_answers_are_sorted_by_their_grpc_status<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let call = |code: u32, key: &'static str| {
        let app = app.clone();
        async move {
            let body = format!(r#"{{"amount":12000,"items":[],"mode":"grpc_{code}"}}"#);
            send(&app, order(ALICE, Some(key), &body)).await
        }
    };
    let grpc_status = |a: &super::Answer| -> String {
        let t = a.trailers.as_ref().expect("gRPC trailers");
        t["grpc-status"].to_str().unwrap().to_string()
    };

    // OK: recorded with the order; the retry replays it, trailers and all.
    let ok = call(0, "grpc-ok").await;
    assert_eq!(grpc_status(&ok), "0");
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
    let again = call(0, "grpc-ok").await;
    assert!(again.replayed());
    assert_eq!(again.body, ok.body);
    assert_eq!(again.trailers, ok.trailers);

    // FAILED_PRECONDITION: final, recorded, its order undone.
    let failed = call(9, "grpc-9").await;
    assert_eq!(failed.status, StatusCode::OK);
    assert_eq!(grpc_status(&failed), "9");
    assert_eq!(h.orders().await, 1, "the failed call's order is undone");
    assert_eq!(h.ledger_with("FAILED_FINAL").await, 1);
    let replay = call(9, "grpc-9").await;
    assert!(replay.replayed());
    assert_eq!(replay.trailers, failed.trailers);

    // The same, trailers-only (the status in the headers): replayed with it.
    let body = r#"{"amount":12000,"items":[],"mode":"grpconly_9"}"#;
    let only = send(&app, order(ALICE, Some("grpc-only-9"), body)).await;
    assert_eq!(only.headers["grpc-status"], "9", "{only:?}");
    assert_eq!(h.ledger_with("FAILED_FINAL").await, 2);
    let replayed = send(&app, order(ALICE, Some("grpc-only-9"), body)).await;
    assert!(replayed.replayed());
    assert_eq!(replayed.headers["grpc-status"], "9", "{replayed:?}");
    assert_eq!(replayed.headers["grpc-message"], "stock%20short");

    // INVALID_ARGUMENT and UNAVAILABLE: nothing kept; the key runs again.
    for (code, key) in [(3, "grpc-3"), (14, "grpc-14")] {
        let first = call(code, key).await;
        assert_eq!(grpc_status(&first), code.to_string());
        assert!(!first.replayed());
        let second = call(code, key).await;
        assert!(!second.replayed(), "{code}: the key stays usable");
    }
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger().await, 3);
    assert_eq!(h.executions(), 1 + 1 + 1 + 2 * 2, "replays ran nothing");
}

/// Case: a trailers-only gRPC answer (what tonic sends for every
/// `Err(Status)`) is replayed whole: its headers are its trailers, custom
/// metadata (`x-reason`) included, as an answer's trailers are.
pub async fn a_trailers_only_grpc_answer_replays_its_metadata<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let body = r#"{"amount":12000,"items":[],"mode":"grpconly_9"}"#;
    let first = send(&app, order(ALICE, KEY, body)).await;
    assert_eq!(first.headers["grpc-status"], "9", "{first:?}");
    assert_eq!(first.headers["x-reason"], "stock", "{first:?}");
    assert_eq!(h.ledger_with("FAILED_FINAL").await, 1);
    let replay = send(&app, order(ALICE, KEY, body)).await;
    assert!(replay.replayed(), "{replay:?}");
    for name in ["content-type", "grpc-status", "grpc-message", "x-reason"] {
        assert_eq!(
            replay.headers.get(name),
            first.headers.get(name),
            "{name}: {replay:?}"
        );
    }
    assert!(replay.body.is_empty(), "trailers-only: {replay:?}");
    assert!(replay.trailers.is_none(), "trailers-only: {replay:?}");
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 0);
    assert_eq!(h.ledger().await, 1);
}

/// Case: a replay is well-framed for every status: a `204` the handler
/// gave a body replays with no body and no `Content-Length` of one (HTTP
/// sends no body with a `204`, and the first client got none).
pub async fn a_replay_is_well_framed_for_every_status<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let body = r#"{"amount":12000,"items":[],"mode":"no_content_with_body"}"#;
    let first = send(&app, order(ALICE, KEY, body)).await;
    assert_eq!(first.status, StatusCode::NO_CONTENT, "{first:?}");
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
    let replay = send(&app, order(ALICE, KEY, body)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.status, StatusCode::NO_CONTENT);
    assert!(replay.body.is_empty(), "{replay:?}");
    // The layer sends none; axum's router (in-process, as here) sets one
    // from the body's exact size, which must then be the body's: `0`.
    assert!(
        replay
            .headers
            .get("content-length")
            .is_none_or(|v| v == "0"),
        "a Content-Length that agrees with no body: {replay:?}"
    );
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 1);
}

/// Case: a gRPC request gets the layer's refusals as trailers-only gRPC
/// answers (HTTP 200, `grpc-status` in the headers, no message), with the
/// `ErrorInfo` reason of a reused key; nothing is stored.
pub async fn grpc_requests_get_trailers_only_grpc_refusals<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h.app();
    let grpc = |principal: Option<&str>, key: Option<&str>, message: &[u8]| {
        let mut b = http::Request::post("/orders").header("content-type", "application/grpc");
        if let Some(p) = principal {
            b = b.header("authorization", format!("Bearer {p}"));
        }
        if let Some(k) = key {
            b = b.header("idempotency-key", k);
        }
        b.body(axum::body::Body::from(message.to_vec())).unwrap()
    };
    let status_of = |a: &super::Answer| -> String {
        assert_eq!(a.status, StatusCode::OK, "{a:?}");
        assert_eq!(a.headers["content-type"], "application/grpc", "{a:?}");
        assert!(a.body.is_empty(), "trailers-only: {a:?}");
        a.headers["grpc-status"].to_str().unwrap().to_string()
    };
    let message = b"\0\0\0\0\x04abcd";
    let missing = send(&app, grpc(ALICE, None, message)).await;
    assert_eq!(status_of(&missing), "3");
    assert!(
        missing.headers["grpc-message"]
            .to_str()
            .unwrap()
            .starts_with("missing-key")
    );
    let malformed = send(&app, grpc(ALICE, Some("\"unterminated"), message)).await;
    assert_eq!(status_of(&malformed), "3");
    let anonymous = send(&app, grpc(None, KEY, message)).await;
    assert_eq!(status_of(&anonymous), "16");
    h.assert_nothing_stored().await;

    // The key used by a JSON order, then sent with another request.
    let first = send(&app, order(ALICE, KEY, BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let reused = send(&app, grpc(ALICE, KEY, message)).await;
    assert_eq!(status_of(&reused), "9");
    let details = reused.headers["grpc-status-details-bin"].to_str().unwrap();
    let decoded = base64_decode(details);
    assert!(
        decoded
            .windows(b"IDEMPOTENCY_KEY_REUSED".len())
            .any(|w| w == b"IDEMPOTENCY_KEY_REUSED"),
        "{details}"
    );
    assert!(reused.headers.get("grpc-retry-pushback-ms").is_none());
    assert_eq!(h.executions(), 1);
    assert_eq!(h.ledger().await, 1);
}

/// Standard base64, padded or not.
fn base64_decode(s: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => u32::from(c - b'A'),
        b'a'..=b'z' => u32::from(c - b'a') + 26,
        b'0'..=b'9' => u32::from(c - b'0') + 52,
        b'+' => 62,
        _ => 63,
    };
    let clean: Vec<u8> = s.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::new();
    for chunk in clean.chunks(4) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &c)| n | (value(c) << (18 - 6 * i)));
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

/// Case: a gRPC caller's `grpc-timeout` bounds its wait for an in-flight
/// duplicate below the layer's own bound: `UNAVAILABLE` with a pushback,
/// well before the layer's own wait (120 s here).
pub async fn a_grpc_timeout_bounds_the_wait_for_an_in_flight_duplicate<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let layer = h
        .layer()
        .with_in_flight_wait(Duration::from_secs(120))
        .with_claim_retries(3, Duration::from_secs(120));
    let app = h.app_with(layer);
    let stuck = DB::hold_claim(&h.pool, "user-42", "POST /orders", "checkout-20260914-001").await;
    let req = http::Request::post("/orders")
        .header("content-type", "application/grpc")
        .header("authorization", "Bearer user-42")
        .header("idempotency-key", KEY.unwrap_or_default())
        .header("grpc-timeout", "200m")
        .body(axum::body::Body::from(b"\0\0\0\0\x01x".to_vec()))
        .unwrap();
    let started = Instant::now();
    let answer = send(&app, req).await;
    let elapsed = started.elapsed();
    assert_eq!(answer.headers["grpc-status"], "14", "{answer:?}");
    assert!(answer.headers.contains_key("grpc-retry-pushback-ms"));
    // Bounded by grpc-timeout (200 ms; SQLite's claim blocks for the
    // harness's busy_timeout, 1 s, at most), not by the layer's own 120 s:
    // a bound far from both.
    let bound = Duration::from_secs(30);
    assert!(elapsed < bound, "bounded by grpc-timeout: {elapsed:?}");
    assert_eq!(h.executions(), 0);
    stuck.rollback().await.unwrap();
}
