//! The client layer's policy against `tower_test::mock`: which answers are
//! retried, `Retry-After`, one key for every attempt, the deadline, the
//! attempts and the budget bounding it, and the body re-sent byte for byte.
//! Time is paused: waits are exact and instant.
//!
//! And both halves in one process: the client layer in front of the crate's
//! own server layer on in-memory SQLite, in either key mode, judged by the
//! rows committed.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::retry::budget::TpsBudget;
use tower::{Layer, ServiceExt};
use tower_idempotency::ProblemKind;
use tower_idempotency::client::{
    IdempotentRetryLayer, IntentKey, RetryBody, RetryError, RetryReport, RetryStop,
};
use tower_test::mock::{self, Handle};

type Mock = Handle<Request<RetryBody>, Response<Full<Bytes>>>;
type Answer = Result<Response<RetryBody>, RetryError>;

/// Sends `req` through `layer` in a task; the test answers it through the
/// handle.
fn start(
    layer: IdempotentRetryLayer,
    req: Request<Full<Bytes>>,
) -> (tokio::task::JoinHandle<Answer>, Mock) {
    let (service, handle) = mock::pair::<Request<RetryBody>, Response<Full<Bytes>>>();
    let service = layer.layer(service);
    let task = tokio::spawn(async move { service.oneshot(req).await });
    (task, handle)
}

fn post(body: &'static str) -> Request<Full<Bytes>> {
    Request::post("http://127.0.0.1/orders")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

fn answer(status: u16, headers: &[(&str, &str)], body: &str) -> Response<Full<Bytes>> {
    let mut b = Response::builder().status(status);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(Bytes::from(body.to_string()))).unwrap()
}

fn problem(kind: ProblemKind, status: u16, retry_after: Option<&str>) -> Response<Full<Bytes>> {
    let mut headers = vec![("content-type", "application/problem+json")];
    if let Some(r) = retry_after {
        headers.push(("retry-after", r));
    }
    answer(
        status,
        &headers,
        &format!(r#"{{"type":"{}"}}"#, kind.type_uri()),
    )
}

/// Takes the next attempt: its key and body.
async fn next(handle: &mut Mock) -> (String, Bytes, mock::SendResponse<Response<Full<Bytes>>>) {
    let (req, respond) = handle.next_request().await.expect("an attempt");
    let key = req.headers()["idempotency-key"]
        .to_str()
        .unwrap()
        .to_string();
    let body = req.into_body().collect().await.unwrap().to_bytes();
    (key, body, respond)
}

fn report(res: &Response<RetryBody>) -> RetryReport {
    res.extensions()
        .get::<RetryReport>()
        .cloned()
        .expect("a report")
}

#[tokio::test(start_paused = true)]
async fn one_key_for_every_attempt_and_the_body_byte_for_byte() {
    let body = r#"{"amount": 1000, "items":[{"sku":"a","qty":1}]}"#;
    let (task, mut handle) = start(IdempotentRetryLayer::new(), post(body));
    let (k1, b1, r) = next(&mut handle).await;
    r.send_error("connection reset");
    let (k2, b2, r) = next(&mut handle).await;
    r.send_response(problem(ProblemKind::InFlight, 409, Some("1")));
    let (k3, b3, r) = next(&mut handle).await;
    r.send_response(answer(201, &[("idempotent-replayed", "true")], "{}"));
    let res = task.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(k1, k2);
    assert_eq!(k2, k3);
    // A Structured Field String: the UUID in quotes.
    let uuid = k1
        .strip_prefix('"')
        .and_then(|k| k.strip_suffix('"'))
        .unwrap_or_else(|| panic!("not quoted: {k1}"));
    assert!(uuid_v4(uuid), "{k1}");
    for b in [&b1, &b2, &b3] {
        assert_eq!(&b[..], body.as_bytes());
    }
    let rep = report(&res);
    assert_eq!(rep.attempts, 3);
    assert!(rep.replayed);
    assert_eq!(rep.key.as_deref(), Some(uuid), "the key, unquoted");
    assert!(
        rep.waited >= Duration::from_secs(1),
        "Retry-After honoured: {rep:?}"
    );
}

fn uuid_v4(s: &str) -> bool {
    s.len() == 36
        && s.as_bytes()[14] == b'4'
        && s.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

#[tokio::test(start_paused = true)]
async fn the_callers_key_and_intent_key_are_kept() {
    let mut req = post("{}");
    req.headers_mut()
        .insert("idempotency-key", "mine-1".parse().unwrap());
    let (task, mut handle) = start(IdempotentRetryLayer::new(), req);
    let (k, _, r) = next(&mut handle).await;
    r.send_response(answer(201, &[], "{}"));
    assert_eq!(k, "mine-1", "the caller's header, as they sent it");
    let rep = report(&task.await.unwrap().unwrap());
    assert_eq!(rep.key.as_deref(), Some("mine-1"));

    let mut req = post("{}");
    req.headers_mut()
        .insert("idempotency-key", r#""mine 2""#.parse().unwrap());
    let (task, mut handle) = start(IdempotentRetryLayer::new(), req);
    let (k, _, r) = next(&mut handle).await;
    r.send_response(answer(201, &[], "{}"));
    assert_eq!(k, r#""mine 2""#);
    let rep = report(&task.await.unwrap().unwrap());
    assert_eq!(rep.key.as_deref(), Some("mine 2"), "the key, unquoted");

    let mut req = post("{}");
    req.extensions_mut()
        .insert(IntentKey::new("intent-7").unwrap());
    let (task, mut handle) = start(IdempotentRetryLayer::new(), req);
    let (k, _, r) = next(&mut handle).await;
    r.send_response(answer(503, &[], ""));
    let (k2, _, r) = next(&mut handle).await;
    r.send_response(answer(201, &[], "{}"));
    assert_eq!(
        (k.as_str(), k2.as_str()),
        (r#""intent-7""#, r#""intent-7""#)
    );
    let rep = report(&task.await.unwrap().unwrap());
    assert_eq!(rep.key.as_deref(), Some("intent-7"));
}

#[tokio::test(start_paused = true)]
async fn final_answers_are_never_retried() {
    let finals = [
        problem(ProblemKind::KeyReused, 422, None),
        problem(ProblemKind::Expired, 410, None),
        answer(
            409,
            &[("content-type", "application/problem+json")],
            r#"{"type":"https://example.test/problems/out-of-stock"}"#,
        ),
        answer(409, &[("retry-after", "1")], "conflict"),
        answer(400, &[], "bad"),
        answer(404, &[], ""),
        answer(500, &[], "bug"),
        answer(201, &[], "{}"),
    ];
    for fin in finals {
        let status = fin.status();
        let (task, mut handle) = start(IdempotentRetryLayer::new(), post("{}"));
        let (_, _, r) = next(&mut handle).await;
        r.send_response(fin);
        let res = task.await.unwrap().unwrap();
        assert_eq!(res.status(), status);
        let rep = report(&res);
        assert_eq!((rep.attempts, rep.stop), (1, RetryStop::Final), "{status}");
    }
}

#[tokio::test(start_paused = true)]
async fn retryable_answers_are_retried_until_the_attempts_run_out() {
    for retryable in [
        problem(ProblemKind::InFlight, 409, None),
        problem(ProblemKind::Unconfirmed, 409, None),
        problem(ProblemKind::LeaseLost, 409, None),
        answer(429, &[], ""),
        answer(502, &[], ""),
        answer(503, &[], ""),
        answer(504, &[], ""),
    ] {
        let status = retryable.status();
        let layer = IdempotentRetryLayer::new().with_max_attempts(3);
        let (task, mut handle) = start(layer, post("{}"));
        for _ in 0..3 {
            let (_, _, r) = next(&mut handle).await;
            let (parts, body) = retryable.clone().into_parts();
            r.send_response(Response::from_parts(parts, body));
        }
        let res = task.await.unwrap().unwrap();
        assert_eq!(res.status(), status);
        let rep = report(&res);
        assert_eq!(
            (rep.attempts, rep.stop),
            (3, RetryStop::Attempts),
            "{status}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn retry_after_as_an_http_date_is_honoured() {
    let (task, mut handle) = start(IdempotentRetryLayer::new(), post("{}"));
    let (_, _, r) = next(&mut handle).await;
    let in_three = std::time::SystemTime::now() + Duration::from_secs(3);
    let date = httpdate(in_three);
    r.send_response(answer(503, &[("retry-after", date.as_str())], ""));
    let (_, _, r) = next(&mut handle).await;
    r.send_response(answer(201, &[], "{}"));
    let rep = report(&task.await.unwrap().unwrap());
    assert!(rep.waited >= Duration::from_secs(2), "{rep:?}");
}

/// An IMF-fixdate, for the test.
fn httpdate(t: std::time::SystemTime) -> String {
    let secs = t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    format!(
        "{}, {:02} {} {} {:02}:{:02}:{:02} GMT",
        DAYS[days.rem_euclid(7) as usize],
        day,
        MONTHS[(month - 1) as usize],
        year,
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[tokio::test(start_paused = true)]
async fn the_deadline_bounds_the_whole() {
    let layer = IdempotentRetryLayer::new()
        .with_max_attempts(10)
        .with_deadline(Duration::from_secs(10));
    let (task, mut handle) = start(layer, post("{}"));
    let (_, _, r) = next(&mut handle).await;
    r.send_response(answer(503, &[("retry-after", "100")], ""));
    let res = task.await.unwrap().unwrap();
    let rep = report(&res);
    assert_eq!((rep.attempts, rep.stop), (1, RetryStop::Deadline));

    // An attempt that never answers is cut at the deadline.
    let layer = IdempotentRetryLayer::new().with_deadline(Duration::from_secs(5));
    let (task, mut handle) = start(layer, post("{}"));
    let started = tokio::time::Instant::now();
    let (_, _, _hold) = next(&mut handle).await;
    let err = task.await.unwrap().unwrap_err();
    assert!(started.elapsed() <= Duration::from_secs(6));
    assert_eq!(err.report.stop, RetryStop::Deadline, "{err}");
}

#[tokio::test(start_paused = true)]
async fn connection_errors_end_in_an_error_with_the_report() {
    let layer = IdempotentRetryLayer::new().with_max_attempts(2);
    let (task, mut handle) = start(layer, post("{}"));
    for _ in 0..2 {
        let (_, _, r) = next(&mut handle).await;
        r.send_error("connection refused");
    }
    let err = task.await.unwrap().unwrap_err();
    assert_eq!(
        (err.report.attempts, err.report.stop),
        (2, RetryStop::Attempts)
    );
    assert!(err.to_string().contains("connection refused"), "{err}");
}

#[tokio::test(start_paused = true)]
async fn the_shared_budget_stops_a_retry_storm() {
    // No reserve and no share of the traffic: not a single retry.
    let layer =
        IdempotentRetryLayer::new().with_budget(TpsBudget::new(Duration::from_secs(1), 0, 0.0));
    let (task, mut handle) = start(layer.clone(), post("{}"));
    let (_, _, r) = next(&mut handle).await;
    r.send_response(answer(503, &[], ""));
    let rep = report(&task.await.unwrap().unwrap());
    assert_eq!((rep.attempts, rep.stop), (1, RetryStop::Budget));

    // A budget of half the traffic, shared by the clones: 10 requests that
    // all fail get about 5 retries between them, not 10 × 3.
    let layer = IdempotentRetryLayer::new()
        .with_max_attempts(4)
        .with_budget(TpsBudget::new(Duration::from_secs(10), 0, 0.5));
    let (service, mut handle) = mock::pair::<Request<RetryBody>, Response<Full<Bytes>>>();
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let svc = layer.layer(service.clone());
        tasks.push(tokio::spawn(async move { svc.oneshot(post("{}")).await }));
    }
    let answering = tokio::spawn(async move {
        let mut attempts = 0;
        while let Some((_, r)) = handle.next_request().await {
            attempts += 1;
            r.send_response(answer(503, &[], ""));
        }
        attempts
    });
    let mut sent = 0;
    for t in tasks {
        sent += report(&t.await.unwrap().unwrap()).attempts;
    }
    drop(service);
    let attempts = answering.await.unwrap();
    assert_eq!(sent, attempts);
    assert!(
        attempts <= 10 + 6,
        "the budget bounds the retries: {attempts}"
    );
    assert!(attempts > 10, "some retries are allowed: {attempts}");
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_bound_is_sent_once_and_the_caller_can_tell() {
    let layer = IdempotentRetryLayer::new().with_max_body(8);
    let (task, mut handle) = start(layer, post("0123456789abcdef"));
    let (_, body, r) = next(&mut handle).await;
    assert_eq!(&body[..], b"0123456789abcdef");
    r.send_response(answer(503, &[], ""));
    let res = task.await.unwrap().unwrap();
    let rep = report(&res);
    assert_eq!((rep.attempts, rep.stop), (1, RetryStop::BodyTooLarge));

    // Without a Content-Length, what was read and the rest go out as one.
    let stream =
        http_body_util::StreamBody::new(tokio_stream_of(&["0123", "4567", "89ab", "cdef"]));
    let req = Request::post("http://127.0.0.1/orders")
        .body(stream)
        .unwrap();
    let (service, mut handle) = mock::pair::<Request<RetryBody>, Response<Full<Bytes>>>();
    let svc = IdempotentRetryLayer::new().with_max_body(8).layer(service);
    let task = tokio::spawn(async move { svc.oneshot(req).await });
    let (_, body, r) = next(&mut handle).await;
    assert_eq!(&body[..], b"0123456789abcdef");
    r.send_response(answer(201, &[], ""));
    assert_eq!(
        report(&task.await.unwrap().unwrap()).stop,
        RetryStop::BodyTooLarge
    );
}

type Chunk = Result<http_body::Frame<Bytes>, std::convert::Infallible>;

fn tokio_stream_of(
    chunks: &[&'static str],
) -> impl futures_core::Stream<Item = Chunk> + Send + 'static {
    let frames: Vec<Chunk> = chunks
        .iter()
        .map(|c| Ok(http_body::Frame::data(Bytes::from_static(c.as_bytes()))))
        .collect();
    Frames(frames.into_iter())
}

struct Frames(std::vec::IntoIter<Chunk>);

impl futures_core::Stream for Frames {
    type Item = Chunk;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Chunk>> {
        std::task::Poll::Ready(self.0.next())
    }
}

#[tokio::test(start_paused = true)]
async fn methods_not_guarded_pass_once_without_a_key() {
    let req = Request::get("http://127.0.0.1/orders/1")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (task, mut handle) = start(IdempotentRetryLayer::new(), req);
    let (req, r) = handle.next_request().await.unwrap();
    assert!(!req.headers().contains_key("idempotency-key"));
    r.send_response(answer(503, &[], ""));
    let rep = report(&task.await.unwrap().unwrap());
    assert_eq!(
        (rep.attempts, rep.stop, rep.key),
        (1, RetryStop::NotGuarded, None)
    );
}

// ---- review: failing cases ----

/// A body that never yields a frame (a peer that stalls mid-body).
struct Stuck;

impl http_body::Body for Stuck {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Pending
    }
}

#[tokio::test(start_paused = true)]
async fn a_huge_retry_after_does_not_panic() {
    let (task, mut handle) = start(IdempotentRetryLayer::new(), post("{}"));
    let (_, _, r) = next(&mut handle).await;
    r.send_response(answer(503, &[("retry-after", "10000000000000000000")], ""));
    let res = task.await.expect("the layer must not panic").unwrap();
    assert_eq!(report(&res).stop, RetryStop::Deadline);
}

#[tokio::test(start_paused = true)]
async fn a_409_body_that_never_ends_is_cut_at_the_deadline() {
    let (service, mut handle) = mock::pair::<Request<RetryBody>, Response<Stuck>>();
    let svc = IdempotentRetryLayer::new()
        .with_deadline(Duration::from_secs(5))
        .layer(service);
    let task = tokio::spawn(async move { svc.oneshot(post("{}")).await });
    let (_, r) = handle.next_request().await.unwrap();
    r.send_response(
        Response::builder()
            .status(409)
            .header("content-type", "application/problem+json")
            .body(Stuck)
            .unwrap(),
    );
    let out = tokio::time::timeout(Duration::from_secs(60), task).await;
    assert!(
        out.is_ok(),
        "still reading the 409 body 60 s into a 5 s deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_body_that_never_ends_is_cut_at_the_deadline() {
    let (service, _handle) = mock::pair::<Request<RetryBody>, Response<Full<Bytes>>>();
    let svc = IdempotentRetryLayer::new()
        .with_deadline(Duration::from_secs(5))
        .layer(service);
    let req = Request::post("http://127.0.0.1/orders")
        .body(Stuck)
        .unwrap();
    let task = tokio::spawn(async move { svc.oneshot(req).await });
    let out = tokio::time::timeout(Duration::from_secs(60), task).await;
    assert!(
        out.is_ok(),
        "still buffering the request body 60 s into a 5 s deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn a_large_business_409_is_delivered_intact() {
    let big = "x".repeat(100 * 1024);
    // Not a problem document (not read), and one over the reading bound
    // (read in part, then handed on whole).
    for content_type in ["application/json", "application/problem+json"] {
        let (task, mut handle) = start(IdempotentRetryLayer::new(), post("{}"));
        let (_, _, r) = next(&mut handle).await;
        r.send_response(answer(409, &[("content-type", content_type)], &big));
        let res = task.await.unwrap().expect("the caller gets the 409 itself");
        assert_eq!(res.status(), StatusCode::CONFLICT);
        assert_eq!(report(&res).attempts, 1);
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], big.as_bytes(), "{content_type}");
    }
}

// ---- both halves: the client layer in front of the crate's own server ----

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a run through both halves committed: orders, and the recorded
/// answers' keys.
struct Committed {
    orders: i64,
    keys: Vec<String>,
}

/// Sends `requests` one after another through the client layer in front
/// of an [`IdempotencyLayer`] in `mode` on in-memory SQLite (one
/// connection: one database), whose handler inserts one order; answers
/// with each request's status and the rows committed.
async fn through_both_halves(
    mode: tower_idempotency::KeyMode,
    requests: Vec<Request<Full<Bytes>>>,
) -> (Vec<StatusCode>, Committed) {
    use sqlx::Sqlite;
    use tower_idempotency::{IdempotencyBody, IdempotencyLayer, Principal, Tx};

    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await
        .unwrap();
    tower_idempotency::migrate(&pool).await.unwrap();
    sqlx::raw_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    let create_order = |req: Request<IdempotencyBody<RetryBody>>| async move {
        let tx = req
            .extensions()
            .get::<Tx<Sqlite>>()
            .cloned()
            .ok_or("no claimed transaction")?;
        let mut conn = tx.lock()?;
        let id: i64 = sqlx::query_scalar("INSERT INTO orders DEFAULT VALUES RETURNING id")
            .fetch_one(&mut *conn)
            .await?;
        Ok::<_, BoxError>(
            Response::builder()
                .status(201)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(format!(r#"{{"orderId":{id}}}"#))))?,
        )
    };
    let service = tower::ServiceBuilder::new()
        .layer(IdempotentRetryLayer::new().with_max_attempts(2))
        .layer(
            IdempotencyLayer::new(pool.clone())
                .with_key_mode(mode)
                .with_principal(|_| Some(Principal::new("user-1"))),
        )
        .service_fn(create_order);
    let mut statuses = Vec::new();
    for req in requests {
        let res = service.clone().oneshot(req).await.unwrap();
        statuses.push(res.status());
    }
    let orders = sqlx::query_scalar("SELECT COUNT(*) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    let keys = sqlx::query_scalar(
        "SELECT idem_key FROM idempotency_records WHERE status = 'SUCCEEDED' ORDER BY idem_key",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    (statuses, Committed { orders, keys })
}

fn with_intent(key: IntentKey) -> Request<Full<Bytes>> {
    let mut req = post(r#"{"amount":1000}"#);
    req.extensions_mut().insert(key);
    req
}

#[tokio::test]
async fn the_layers_keys_are_accepted_by_the_server_in_either_key_mode() {
    use tower_idempotency::KeyMode;
    for mode in [KeyMode::Lenient, KeyMode::Strict] {
        // A generated key, an intent key, and the intent again (a replay).
        let requests = vec![
            post(r#"{"amount":1000}"#),
            with_intent(IntentKey::new("intent-7").unwrap()),
            with_intent(IntentKey::new("intent-7").unwrap()),
        ];
        let (statuses, committed) = through_both_halves(mode, requests).await;
        assert_eq!(statuses, [StatusCode::CREATED; 3], "{mode:?}");
        assert_eq!(committed.orders, 2, "one order per intent: {mode:?}");
        assert_eq!(committed.keys.len(), 2, "{mode:?}");
        assert!(
            committed.keys.iter().any(|k| k == "intent-7"),
            "the intent key, unquoted, names the record: {:?}",
            committed.keys
        );
    }
}

#[test]
fn an_intent_key_is_checked_when_made_by_the_servers_rules() {
    use tower_idempotency::KeyError;
    for ok in ["order 42 for bob", r#"say "hi" \o/"#, " ", &"k".repeat(255)] {
        assert_eq!(IntentKey::new(ok).unwrap().as_str(), ok);
    }
    assert_eq!(IntentKey::new(""), Err(KeyError::Empty));
    assert_eq!(IntentKey::new("k".repeat(256)), Err(KeyError::TooLong));
    for bad in [
        "caf\u{e9}",
        "tab\there",
        "line\nbreak",
        "nul\0",
        "del\u{7f}",
    ] {
        assert_eq!(
            IntentKey::new(bad),
            Err(KeyError::InvalidCharacter),
            "{bad:?}"
        );
    }
}

#[tokio::test]
async fn an_intent_key_with_spaces_quotes_and_backslashes_is_sent_intact() {
    use tower_idempotency::KeyMode;
    for mode in [KeyMode::Lenient, KeyMode::Strict] {
        let spaced = "order 42 for bob";
        let odd = r#"say "hi" \o/"#;
        let requests = vec![
            with_intent(IntentKey::new(spaced).unwrap()),
            with_intent(IntentKey::new(odd).unwrap()),
            with_intent(IntentKey::new(spaced).unwrap()),
        ];
        let (statuses, committed) = through_both_halves(mode, requests).await;
        assert_eq!(statuses, [StatusCode::CREATED; 3], "{mode:?}");
        assert_eq!(committed.orders, 2, "{mode:?}");
        let mut want = vec![spaced.to_string(), odd.to_string()];
        want.sort();
        assert_eq!(committed.keys, want, "{mode:?}");
    }
}

/// A body that yields its data, then ends, or fails when `breaks` (a
/// connection that broke mid-body).
struct Scripted {
    data: Option<Bytes>,
    breaks: bool,
}

impl http_body::Body for Scripted {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(match self.data.take() {
            Some(data) => Some(Ok(http_body::Frame::data(data))),
            None if self.breaks => Some(Err(std::io::ErrorKind::ConnectionReset.into())),
            None => None,
        })
    }
}

fn broken_in_flight() -> Response<Scripted> {
    Response::builder()
        .status(409)
        .header("content-type", "application/problem+json")
        .body(Scripted {
            data: Some(Bytes::from_static(br#"{"type":"https://"#)),
            breaks: true,
        })
        .unwrap()
}

fn created() -> Response<Scripted> {
    Response::builder()
        .status(201)
        .body(Scripted {
            data: Some(Bytes::from_static(b"{}")),
            breaks: false,
        })
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_409_whose_body_breaks_mid_read_is_retried_with_the_same_key() {
    let (service, mut handle) = mock::pair::<Request<RetryBody>, Response<Scripted>>();
    let svc = IdempotentRetryLayer::new()
        .with_max_attempts(3)
        .layer(service);
    let task = tokio::spawn(async move { svc.oneshot(post("{}")).await });
    let (req, r) = handle.next_request().await.unwrap();
    let k1 = req.headers()["idempotency-key"].clone();
    r.send_response(broken_in_flight());
    let (req, r) = handle.next_request().await.expect("a second attempt");
    assert_eq!(req.headers()["idempotency-key"], k1, "the same key");
    r.send_response(created());
    let res = task.await.unwrap().expect("the second attempt's answer");
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(report(&res).attempts, 2);

    // Broken every time: the attempts bound it, and the caller is told
    // there was no answer (not that the answer was final).
    let (service, mut handle) = mock::pair::<Request<RetryBody>, Response<Scripted>>();
    let svc = IdempotentRetryLayer::new()
        .with_max_attempts(3)
        .layer(service);
    let task = tokio::spawn(async move { svc.oneshot(post("{}")).await });
    for _ in 0..3 {
        let (_, r) = handle.next_request().await.unwrap();
        r.send_response(broken_in_flight());
    }
    let err = task.await.unwrap().unwrap_err();
    assert_eq!(
        (err.report.attempts, err.report.stop),
        (3, RetryStop::Attempts),
        "{err}"
    );
}
