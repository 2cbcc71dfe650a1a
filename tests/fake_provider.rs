//! End-to-end: the fake payment provider (`examples/fake_provider.rs`) as a
//! real process over real HTTP, judged by its own `GET /charges` listing.
//! Each test starts its own provider, so faults never leak between tests.
//!
//! A plain `cargo test` builds the example first; `cargo test --test
//! fake_provider` alone does not, so run `cargo build --example
//! fake_provider` before it (the test refuses a binary older than its source).

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Every request, start-up and exit is bounded by this.
const TIMEOUT: Duration = Duration::from_secs(5);

/// One running provider.
struct Provider {
    addr: String,
    child: Child,
}

#[derive(Debug, Clone)]
struct Answer {
    status: StatusCode,
    body: Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

const CHARGE: &str = r#"{"amount":12000,"currency":"KRW","source":"tok_visa"}"#;

impl Provider {
    async fn start() -> Self {
        let mut child = Command::new(common::example("fake_provider"))
            .args(["--addr", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(TIMEOUT, lines.next_line())
            .await
            .expect("the provider starts")
            .unwrap()
            .expect("a start-up line");
        let addr = common::address(&line);
        Self { addr, child }
    }

    async fn call(&self, method: Method, path: &str, key: Option<&str>, body: &str) -> Answer {
        self.try_call(method, path, key, body)
            .await
            .unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// One request on a fresh connection; `Err` when the connection dies.
    async fn try_call(
        &self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: &str,
    ) -> Result<Answer, hyper::Error> {
        tokio::time::timeout(TIMEOUT, http_call(&self.addr, method, path, key, body))
            .await
            .unwrap_or_else(|_| panic!("{path}: no answer within {TIMEOUT:?}"))
    }

    async fn charge(&self, key: &str, body: &str) -> Answer {
        self.call(Method::POST, "/charges", Some(key), body).await
    }

    async fn fault(&self, fault: Value) {
        let a = self
            .call(Method::POST, "/faults", None, &fault.to_string())
            .await;
        assert_eq!(a.status, StatusCode::OK, "{fault}: {a:?}");
    }

    async fn lookup(&self, key: &str) -> Answer {
        self.call(
            Method::GET,
            &format!("/charges?idempotency_key={key}"),
            None,
            "",
        )
        .await
    }

    /// The ground truth: every charge the provider made.
    async fn charges(&self) -> Vec<Value> {
        let a = self.call(Method::GET, "/charges", None, "").await;
        assert_eq!(a.status, StatusCode::OK, "{a:?}");
        match a.json() {
            Value::Array(all) => all,
            other => panic!("GET /charges is not an array: {other}"),
        }
    }

    async fn charges_for(&self, key: &str) -> usize {
        self.charges()
            .await
            .iter()
            .filter(|c| c["idempotencyKey"] == key)
            .count()
    }
}

async fn http_call(
    addr: &str,
    method: Method,
    path: &str,
    key: Option<&str>,
    body: &str,
) -> Result<Answer, hyper::Error> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr)
        .header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    let res = sender
        .send_request(req.body(Full::new(Bytes::from(body.to_string()))).unwrap())
        .await?;
    let (parts, body) = res.into_parts();
    Ok(Answer {
        status: parts.status,
        body: body.collect().await?.to_bytes(),
    })
}

#[tokio::test]
async fn a_key_charges_once_replays_and_refuses_a_changed_payload() {
    let p = Provider::start().await;
    let first = p.charge("k-1", CHARGE).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let body = first.json();
    let fields: Vec<_> = body.as_object().unwrap().keys().cloned().collect();
    assert_eq!(fields.len(), 4, "exactly four fields: {body}");
    assert!(body["chargeId"].as_str().unwrap().starts_with("ch_"));
    assert_eq!(body["amount"], 12000);
    assert_eq!(body["currency"], "KRW");
    assert_eq!(body["status"], "succeeded");

    let again = p.charge("k-1", CHARGE).await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.body, first.body, "the same charge, byte for byte");

    for changed in [
        CHARGE.replace("12000", "15000"),
        CHARGE.replace("KRW", "USD"),
        CHARGE.replace("tok_visa", "tok_mastercard"),
    ] {
        let a = p.charge("k-1", &changed).await;
        assert_eq!(a.status, StatusCode::CONFLICT, "{changed}: {a:?}");
        assert!(a.json()["code"].is_string(), "a JSON error: {a:?}");
    }

    let found = p.lookup("k-1").await;
    assert_eq!(found.status, StatusCode::OK);
    assert_eq!(found.body, first.body);
    assert_eq!(p.lookup("k-unknown").await.status, StatusCode::NOT_FOUND);

    let all = p.charges().await;
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0]["idempotencyKey"], "k-1");
    assert_eq!(all[0]["chargeId"], body["chargeId"]);
}

#[tokio::test]
async fn a_missing_key_or_a_bad_body_is_400_and_charges_nothing() {
    let p = Provider::start().await;
    let no_key = p.call(Method::POST, "/charges", None, CHARGE).await;
    assert_eq!(no_key.status, StatusCode::BAD_REQUEST, "{no_key:?}");
    for body in [
        "",
        "{",
        r#"{"amount":12000,"currency":"KRW"}"#,
        r#"{"amount":"12000","currency":"KRW","source":"tok_visa"}"#,
        r#"{"amount":0,"currency":"KRW","source":"tok_visa"}"#,
        r#"{"amount":12000,"currency":"krw","source":"tok_visa"}"#,
        r#"{"amount":12000,"currency":"KRW","source":""}"#,
    ] {
        let a = p.charge("k-bad", body).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {a:?}");
        assert!(a.json()["code"].is_string(), "a JSON error: {a:?}");
    }
    assert!(p.charges().await.is_empty());
    // The key was never used: a correct request charges.
    assert_eq!(p.charge("k-bad", CHARGE).await.status, StatusCode::CREATED);
    let health = p.call(Method::GET, "/health", None, "").await;
    assert_eq!(health.status, StatusCode::OK);
}

#[tokio::test]
async fn fail_before_and_decline_charge_nothing_and_faults_are_fifo() {
    let p = Provider::start().await;
    p.fault(json!({"mode": "fail_before", "count": 2})).await;
    p.fault(json!({"mode": "decline"})).await;
    for _ in 0..2 {
        let a = p.charge("k-f", CHARGE).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
    }
    assert!(p.charges().await.is_empty(), "fail_before charges nothing");
    let declined = p.charge("k-f", CHARGE).await;
    assert_eq!(
        declined.status,
        StatusCode::PAYMENT_REQUIRED,
        "{declined:?}"
    );
    assert_eq!(declined.json()["code"], "card_declined");
    assert!(p.charges().await.is_empty(), "decline charges nothing");
    assert_eq!(p.lookup("k-f").await.status, StatusCode::NOT_FOUND);
    // The queue is empty: the same key now charges.
    assert_eq!(p.charge("k-f", CHARGE).await.status, StatusCode::CREATED);
    assert_eq!(p.charges().await.len(), 1);
}

#[tokio::test]
async fn charge_then_hang_charges_at_once_and_answers_late() {
    let p = Provider::start().await;
    p.fault(json!({"mode": "charge_then_hang", "delay_ms": 500}))
        .await;
    let started = Instant::now();
    let (answer, lookup) = tokio::join!(p.charge("k-hang", CHARGE), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        p.lookup("k-hang").await
    });
    let elapsed = started.elapsed();
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    assert!(
        elapsed >= Duration::from_millis(500),
        "answered after {elapsed:?}"
    );
    assert_eq!(
        lookup.status,
        StatusCode::OK,
        "charged before the answer: {lookup:?}"
    );
    assert_eq!(lookup.body, answer.body);
    assert_eq!(p.charges_for("k-hang").await, 1);
}

#[tokio::test]
async fn charge_then_drop_closes_the_connection_after_charging() {
    let p = Provider::start().await;
    p.fault(json!({"mode": "charge_then_drop", "count": 2}))
        .await;
    let lost = p
        .try_call(Method::POST, "/charges", Some("k-drop"), CHARGE)
        .await;
    assert!(lost.is_err(), "the connection closes unanswered: {lost:?}");
    let all = p.charges().await;
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0]["idempotencyKey"], "k-drop");
    // On a known key the second drop makes no second charge.
    let lost = p
        .try_call(Method::POST, "/charges", Some("k-drop"), CHARGE)
        .await;
    assert!(lost.is_err(), "{lost:?}");
    assert_eq!(p.charges().await.len(), 1);
    // The retry once the faults are used up recovers the same charge.
    let retry = p.charge("k-drop", CHARGE).await;
    assert_eq!(retry.status, StatusCode::OK, "{retry:?}");
    assert_eq!(retry.json()["chargeId"], all[0]["chargeId"]);
}

#[tokio::test]
async fn lookup_down_answers_503_until_lookup_up() {
    let p = Provider::start().await;
    assert_eq!(p.charge("k-l", CHARGE).await.status, StatusCode::CREATED);
    p.fault(json!({"mode": "lookup_down"})).await;
    assert_eq!(
        p.lookup("k-l").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        p.lookup("k-unknown").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    // Charging and the listing are unaffected.
    assert_eq!(p.charge("k-l2", CHARGE).await.status, StatusCode::CREATED);
    assert_eq!(p.charges().await.len(), 2);
    p.fault(json!({"mode": "lookup_up"})).await;
    assert_eq!(p.lookup("k-l").await.status, StatusCode::OK);
    assert_eq!(p.lookup("k-l2").await.status, StatusCode::OK);
}

#[tokio::test]
async fn delete_faults_clears_the_queue_and_the_lookup_switch() {
    let p = Provider::start().await;
    p.fault(json!({"mode": "fail_before", "count": 5})).await;
    p.fault(json!({"mode": "decline"})).await;
    p.fault(json!({"mode": "lookup_down"})).await;
    let cleared = p.call(Method::DELETE, "/faults", None, "").await;
    assert_eq!(cleared.status, StatusCode::OK, "{cleared:?}");
    assert_eq!(p.charge("k-d", CHARGE).await.status, StatusCode::CREATED);
    assert_eq!(p.lookup("k-d").await.status, StatusCode::OK);
    assert_eq!(p.charges().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_with_one_key_make_one_charge() {
    let p = Provider::start().await;
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let addr = p.addr.clone();
            tokio::spawn(async move {
                tokio::time::timeout(
                    TIMEOUT,
                    http_call(&addr, Method::POST, "/charges", Some("k-race"), CHARGE),
                )
                .await
                .expect("an answer in time")
                .unwrap()
            })
        })
        .collect();
    let mut created = 0;
    let mut bodies = Vec::new();
    for t in tasks {
        let a = t.await.unwrap();
        match a.status {
            StatusCode::CREATED => created += 1,
            StatusCode::OK => {}
            other => panic!("unexpected {other}: {a:?}"),
        }
        bodies.push(a.body);
    }
    assert_eq!(created, 1, "one request charged, the others replayed");
    assert!(bodies.iter().all(|b| *b == bodies[0]), "{bodies:?}");
    assert_eq!(p.charges().await.len(), 1);
}

#[tokio::test]
async fn sigterm_exits_cleanly() {
    let mut p = Provider::start().await;
    assert_eq!(p.charge("k-t", CHARGE).await.status, StatusCode::CREATED);
    let pid = p.child.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let exit = tokio::time::timeout(TIMEOUT, p.child.wait())
        .await
        .expect("exits")
        .unwrap();
    assert!(exit.success(), "{exit:?}");
}
