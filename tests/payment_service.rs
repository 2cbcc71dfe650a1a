//! End-to-end: `examples/payment_service` (lease mode) charging through
//! `examples/fake_provider`, both as real processes over real HTTP, on
//! PostgreSQL and SQLite (and MariaDB with the `mysql` feature). Every
//! crash point is judged by the provider's own charges (`GET /charges`:
//! exactly one per payment key, none for a decline) and by the rows in the
//! service's database (`payments`, the ledger's status and generation).
//!
//! Each test has its own provider and its own database; the provider
//! outlives every service crash. A plain `cargo test` builds both examples
//! first; `cargo test --test payment_service` alone does not, so run
//! `cargo build --example payment_service --example fake_provider` before
//! it (the test refuses binaries older than their sources). Run with
//! `--nocapture` to see the counts each case prints.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use sqlx::Pool;
use tokio::process::Child;
use tower_idempotency::store::RecordStatus;
use tower_idempotency::testkit::{Cleanup, ConformanceDb as TestDb};
use tower_idempotency::{Reconciler, Resolution};

/// The bound on every HTTP call (some wait out a provider's hang).
const CALL: Duration = Duration::from_secs(20);
/// The bound on a process start, and on every polled condition.
const START: Duration = Duration::from_secs(30);

const PAYMENT: &str = r#"{"orderId":"o-1001","amount":12000,"currency":"KRW","source":"tok_visa"}"#;
const USER: &str = "user-42";
const KEY: &str = "pay-20260914-001";

/// Starts an example and reads the address from its first line.
async fn spawn(name: &str, args: &[String], env: &[(&str, &str)]) -> (Child, String) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    common::start_example(name, &args, env).await
}

#[derive(Debug, Clone)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    fn problem_type(&self) -> String {
        self.json()["type"].as_str().unwrap_or_default().to_string()
    }

    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    fn charge_id(&self) -> String {
        self.json()["chargeId"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

/// One request on a fresh connection, bounded by [`CALL`]; `Err` when the
/// connection dies (a killed service) or the answer does not come.
async fn try_http(
    addr: &str,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<Answer, String> {
    let call = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr)
            .header("content-type", "application/json");
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
        let res = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let (parts, body) = res.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    };
    tokio::time::timeout(CALL, call)
        .await
        .unwrap_or_else(|_| Err(format!("{path}: no answer within {CALL:?}")))
}

async fn http(
    addr: &str,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    try_http(addr, method, path, headers, body)
        .await
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The fake provider: outlives every service process of a test.
struct Provider {
    addr: String,
    _child: Child,
}

impl Provider {
    async fn start() -> Self {
        let args = ["--addr", "127.0.0.1:0"].map(String::from);
        let (child, addr) = spawn("fake_provider", &args, &[]).await;
        Self {
            addr,
            _child: child,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn fault(&self, fault: Value) {
        let a = http(&self.addr, Method::POST, "/faults", &[], &fault.to_string()).await;
        assert_eq!(a.status, StatusCode::OK, "{fault}: {a:?}");
    }

    async fn hang(&self, delay_ms: u64) {
        self.fault(json!({"mode": "charge_then_hang", "delay_ms": delay_ms}))
            .await;
    }

    /// Every charge the provider made: the ground truth.
    async fn charges(&self) -> Vec<Value> {
        let a = http(&self.addr, Method::GET, "/charges", &[], "").await;
        assert_eq!(a.status, StatusCode::OK, "{a:?}");
        a.json().as_array().cloned().unwrap_or_default()
    }

    /// Waits until the provider has made `n` charges.
    async fn wait_for_charges(&self, n: usize) {
        let start = Instant::now();
        while self.charges().await.len() < n {
            assert!(start.elapsed() < START, "no charge within {START:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The service's flags besides `--addr` and `--provider`.
#[derive(Debug, Clone, Copy)]
struct Flags {
    lease_ms: u64,
    completer_ms: u64,
    provider_timeout_ms: u64,
}

/// Crash cases: leases that lapse soon after a SIGKILL, and no completer
/// pass after the one at start-up (which finds nothing: a crashed
/// attempt's lease is still live when its successor starts).
const CRASH: Flags = Flags {
    lease_ms: 1000,
    completer_ms: 600_000,
    provider_timeout_ms: 5000,
};

/// One payment_service process.
struct Service {
    child: Child,
    addr: String,
    flags: Flags,
}

impl Service {
    async fn start(url: &str, provider: &str, flags: Flags) -> Self {
        let args = [
            "--addr",
            "127.0.0.1:0",
            "--provider",
            provider,
            "--lease-ms",
            &flags.lease_ms.to_string(),
            "--provider-timeout-ms",
            &flags.provider_timeout_ms.to_string(),
            "--completer-interval-ms",
            &flags.completer_ms.to_string(),
        ]
        .map(String::from);
        let (child, addr) = spawn("payment_service", &args, &[("DATABASE_URL", url)]).await;
        Self { child, addr, flags }
    }

    async fn kill(&mut self) {
        self.child.start_kill().unwrap();
        tokio::time::timeout(START, self.child.wait())
            .await
            .expect("the service dies")
            .unwrap();
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("a running service").to_string();
        let status = std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal} {pid}");
    }

    async fn pay(&self, key: &str) -> Answer {
        self.try_pay(key)
            .await
            .unwrap_or_else(|e| panic!("POST /payments: {e}"))
    }

    async fn try_pay(&self, key: &str) -> Result<Answer, String> {
        let auth = format!("Bearer {USER}");
        let headers = [("authorization", auth.as_str()), ("idempotency-key", key)];
        try_http(&self.addr, Method::POST, "/payments", &headers, PAYMENT).await
    }

    /// The payment from a task; `Err` when the service dies first.
    fn pay_in_background(&self, key: &str) -> tokio::task::JoinHandle<Result<Answer, String>> {
        let addr = self.addr.clone();
        let key = key.to_string();
        tokio::spawn(async move {
            let auth = format!("Bearer {USER}");
            let headers = [("authorization", auth.as_str()), ("idempotency-key", &key)];
            try_http(&addr, Method::POST, "/payments", &headers, PAYMENT).await
        })
    }

    async fn get(&self, path: &str, principal: Option<&str>) -> Answer {
        let auth = principal.map(|p| format!("Bearer {p}"));
        let headers: Vec<_> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
        http(&self.addr, Method::GET, path, &headers, "").await
    }
}

/// One test's world: a provider, a fresh database, a pool on it.
struct World<DB: TestDb> {
    provider: Provider,
    url: String,
    pool: Pool<DB>,
    _drop: Cleanup,
}

impl<DB: TestDb> World<DB> {
    /// The world and its first service (which creates the tables).
    async fn start(flags: Flags) -> (Self, Service) {
        let provider = Provider::start().await;
        let (url, drop) = DB::fresh_url().await;
        let service = Service::start(&url, &provider.url(), flags).await;
        let pool = sqlx::pool::PoolOptions::<DB>::new()
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap();
        let world = Self {
            provider,
            url,
            pool,
            _drop: drop,
        };
        (world, service)
    }

    /// Another instance on the same database and provider.
    async fn service(&self, flags: Flags) -> Service {
        Service::start(&self.url, &self.provider.url(), flags).await
    }

    /// SIGKILL, then the same flags again on the same database.
    async fn restart(&self, service: &mut Service) {
        service.kill().await;
        *service = self.service(service.flags).await;
    }

    async fn count(&self, sql: &'static str) -> i64 {
        DB::count(&self.pool, sql).await
    }

    async fn counts(&self) -> Counts {
        Counts {
            charges: self.provider.charges().await.len(),
            payments: self.count("SELECT COUNT(*) FROM payments").await,
            captured: self
                .count("SELECT COUNT(*) FROM payments WHERE status = 'captured' AND charge_id IS NOT NULL")
                .await,
            failed: self
                .count("SELECT COUNT(*) FROM payments WHERE status = 'failed' AND charge_id IS NULL")
                .await,
            pending: self
                .count("SELECT COUNT(*) FROM payments WHERE status = 'pending'")
                .await,
            succeeded: self
                .count("SELECT COUNT(*) FROM idempotency_records WHERE status = 'SUCCEEDED'")
                .await,
            failed_final: self
                .count("SELECT COUNT(*) FROM idempotency_records WHERE status = 'FAILED_FINAL'")
                .await,
            parked: self
                .count("SELECT COUNT(*) FROM idempotency_records WHERE status = 'NEEDS_RECONCILIATION'")
                .await,
            ledger: self.count("SELECT COUNT(*) FROM idempotency_records").await,
            generation: self
                .count("SELECT COALESCE(MAX(generation), 0) FROM idempotency_records")
                .await,
        }
    }

    /// Polls until `done(counts)` holds.
    async fn wait_until(&self, what: &str, done: impl Fn(&Counts) -> bool) -> Counts {
        let start = Instant::now();
        loop {
            let counts = self.counts().await;
            if done(&counts) {
                return counts;
            }
            assert!(
                start.elapsed() < START,
                "{what}: not within {START:?}: {counts:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// One captured payment, charged exactly once, matching `answer` (a
    /// `201` from `service`); prints the counts.
    async fn judge_captured(&self, case: &str, service: &Service, answer: &Answer) -> Counts {
        assert_eq!(answer.status, StatusCode::CREATED, "{case}: {answer:?}");
        let charges = self.provider.charges().await;
        assert_eq!(charges.len(), 1, "{case}: exactly one charge: {charges:?}");
        let charge_id = answer.charge_id();
        assert_eq!(charges[0]["chargeId"], charge_id.as_str(), "{case}");
        let body = answer.json();
        assert_eq!(body["status"], "captured", "{case}");
        assert_eq!(body["amount"], 12000, "{case}");
        assert_eq!(body["currency"], "KRW", "{case}");
        assert_eq!(body["orderId"], "o-1001", "{case}");
        let id = body["paymentId"].as_str().unwrap_or_default().to_string();
        assert!(id.starts_with("p-"), "{case}: {body}");
        assert_eq!(
            answer.headers["location"],
            format!("/payments/{id}"),
            "{case}"
        );
        let row = service.get(&format!("/payments/{id}"), Some(USER)).await;
        assert_eq!(row.status, StatusCode::OK, "{case}: {row:?}");
        assert_eq!(row.json()["chargeId"], charge_id.as_str(), "{case}");
        assert_eq!(row.json()["status"], "captured", "{case}");
        let counts = self.counts().await;
        assert_eq!(
            (
                counts.payments,
                counts.captured,
                counts.succeeded,
                counts.ledger
            ),
            (1, 1, 1, 1),
            "{case}: {counts:?}"
        );
        println!("[{}] {case}: {counts}", DB::LABEL);
        counts
    }
}

#[derive(Debug, Clone, Copy)]
#[allow(dead_code)] // Read through Debug.
struct Counts {
    charges: usize,
    payments: i64,
    captured: i64,
    failed: i64,
    pending: i64,
    succeeded: i64,
    failed_final: i64,
    parked: i64,
    ledger: i64,
    generation: i64,
}

impl std::fmt::Display for Counts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "provider charges={} | payments={} captured={} failed={} pending={} | ledger rows={} SUCCEEDED={} FAILED_FINAL={} NEEDS_RECONCILIATION={} generation={}",
            self.charges,
            self.payments,
            self.captured,
            self.failed,
            self.pending,
            self.ledger,
            self.succeeded,
            self.failed_final,
            self.parked,
            self.generation
        )
    }
}

/// A second answer with the key: the first one's bytes, replayed.
async fn assert_replays(case: &str, service: &Service, first: &Answer) {
    let again = service.pay(KEY).await;
    assert_eq!(again.status, first.status, "{case}: {again:?}");
    assert_eq!(again.body, first.body, "{case}: byte-identical replay");
    assert!(again.replayed(), "{case}: {again:?}");
}

macro_rules! e2e {
    ($($name:ident),* $(,)?) => {
        mod postgres { $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name::<sqlx::Postgres>().await }
        )* }
        mod sqlite { $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name::<sqlx::Sqlite>().await }
        )* }
        #[cfg(feature = "mysql")]
        mod mysql { $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name::<sqlx::MySql>().await }
        )* }
    };
}

e2e!(
    validation_and_ownership,
    decline_is_final_and_replayed,
    a_crash_before_phase_1_leaves_a_bare_claim_the_completer_deletes,
    a_crash_before_the_provider_saw_the_call,
    a_provider_failure_before_charging,
    b_crash_after_the_charge_before_the_commit,
    c_lost_provider_answer_is_recovered_in_the_same_request,
    c_provider_timeout_is_recovered_in_the_same_request,
    d_after_the_commit_the_answer_replays,
    e_stale_owner_after_a_takeover_records_nothing,
    f_concurrent_takeovers_one_wins,
    g_unknown_outcome_parks_until_an_operator_reruns,
    g_parked_record_is_finished_by_the_completer,
    h_heartbeats_keep_a_long_step_in_flight,
    i_completer_finishes_an_abandoned_payment,
    sigterm_lets_the_payment_in_progress_finish,
    j_stale_owner_of_a_deleted_claim_charges_nothing,
    k_provider_down_is_a_plain_retryable_503,
    l_a_claim_lost_with_its_payment_is_charged_once,
);

/// 401 without a principal, 400 for an invalid body (nothing claimed),
/// `GET /payments/{id}` for its owner only, `GET /health`.
async fn validation_and_ownership<DB: TestDb>() {
    let (w, s) = World::<DB>::start(CRASH).await;
    let health = s.get("/health", None).await;
    assert_eq!(health.status, StatusCode::OK);
    let no_auth = http(
        &s.addr,
        Method::POST,
        "/payments",
        &[("idempotency-key", KEY)],
        PAYMENT,
    )
    .await;
    assert_eq!(no_auth.status, StatusCode::UNAUTHORIZED, "{no_auth:?}");
    let auth = format!("Bearer {USER}");
    for body in [
        r#"{"orderId":"o-1","amount":0,"currency":"KRW","source":"tok_visa"}"#,
        r#"{"orderId":"o-1","amount":100,"currency":"krw","source":"tok_visa"}"#,
        r#"{"orderId":"","amount":100,"currency":"KRW","source":"tok_visa"}"#,
        r#"{"orderId":"o-1","amount":100,"currency":"KRW","source":""}"#,
        r#"{"orderId":"o-1","amount":100,"currency":"KRW"}"#,
        r#"{"orderId":"o-1","amount":100,"currency":"KRW","source":"tok_visa","extra":1}"#,
        "not json",
    ] {
        let headers = [("authorization", auth.as_str()), ("idempotency-key", KEY)];
        let a = http(&s.addr, Method::POST, "/payments", &headers, body).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {a:?}");
    }
    let counts = w.counts().await;
    assert_eq!(
        (counts.ledger, counts.payments, counts.charges),
        (0, 0, 0),
        "{counts:?}"
    );
    // The key was never claimed: it still works.
    let first = s.pay(KEY).await;
    w.judge_captured("validation", &s, &first).await;
    let id = first.json()["paymentId"].as_str().unwrap().to_string();
    let other = s.get(&format!("/payments/{id}"), Some("user-7")).await;
    assert_eq!(other.status, StatusCode::NOT_FOUND, "{other:?}");
    let anonymous = s.get(&format!("/payments/{id}"), None).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED, "{anonymous:?}");
}

/// A decline is a final failure: `402 #card-declined`, the row `failed`,
/// `FAILED_FINAL`, replayed, and no charge.
async fn decline_is_final_and_replayed<DB: TestDb>() {
    let (w, s) = World::<DB>::start(CRASH).await;
    w.provider.fault(json!({"mode": "decline"})).await;
    let first = s.pay(KEY).await;
    assert_eq!(first.status, StatusCode::PAYMENT_REQUIRED, "{first:?}");
    assert!(first.problem_type().ends_with("card-declined"), "{first:?}");
    assert_eq!(
        first.headers["content-type"], "application/problem+json",
        "{first:?}"
    );
    assert_replays("decline", &s, &first).await;
    let counts = w.counts().await;
    assert_eq!(
        (
            counts.charges,
            counts.payments,
            counts.failed,
            counts.failed_final,
            counts.ledger
        ),
        (0, 1, 1, 1, 1),
        "{counts:?}"
    );
    println!("[{}] decline: {counts}", DB::LABEL);
}

/// a, first point) A crash after the claim committed and before phase 1
/// did: the test holds a lock that phase 1's `INSERT INTO payments` waits
/// on (PostgreSQL `LOCK TABLE`, MariaDB a gap lock on the empty table),
/// SIGKILLs the service there, and lets go. Nothing was saved, so nothing
/// can be resumed: the completer's pass takes the lapsed lease over and the
/// resume function answers it *rejected*, which deletes the bare claim;
/// the client's retry then runs afresh (generation 1) and charges once.
/// SQLite has no lock that holds back phase 1 and not the claim: skipped.
async fn a_crash_before_phase_1_leaves_a_bare_claim_the_completer_deletes<DB: TestDb>() {
    let Some(hold_sql) = phase_1_lock::<DB>("a0") else {
        return;
    };
    let flags = Flags {
        lease_ms: 1000,
        completer_ms: 200,
        provider_timeout_ms: 5000,
    };
    let (w, mut s) = World::<DB>::start(flags).await;
    let mut hold = w.pool.begin().await.unwrap();
    DB::exec_on(&mut hold, hold_sql).await.unwrap();
    let pending = s.pay_in_background(KEY);
    w.wait_until("the claim commits", |c| c.ledger == 1).await;
    // Phase 1 is now waiting on the lock (it runs right after the claim).
    tokio::time::sleep(Duration::from_millis(300)).await;
    s.kill().await;
    assert!(pending.await.unwrap().is_err(), "the client saw the crash");
    hold.rollback().await.unwrap();
    let left = w.counts().await;
    assert_eq!(
        (left.ledger, left.payments, left.charges),
        (1, 0, 0),
        "a bare claim: {left:?}"
    );
    s = w.service(flags).await;
    let gone = w
        .wait_until("the completer deletes the bare claim", |c| c.ledger == 0)
        .await;
    assert_eq!((gone.payments, gone.charges), (0, 0), "{gone:?}");
    println!(
        "[{}] a0) bare claim deleted by the completer: {gone}",
        DB::LABEL
    );
    let retry = s.pay(KEY).await;
    assert!(!retry.replayed(), "{retry:?}");
    let counts = w
        .judge_captured("a0) crash before phase 1, retry", &s, &retry)
        .await;
    assert_eq!(counts.generation, 1, "a fresh claim: {counts:?}");
}

/// A statement that holds back phase 1 alone (its insert into `payments`)
/// while it runs in a transaction; `None` where the store has none (SQLite
/// has one write lock for everything), and the case is skipped.
fn phase_1_lock<DB: TestDb>(case: &str) -> Option<&'static str> {
    match DB::LABEL {
        "postgres" => Some("LOCK TABLE payments IN EXCLUSIVE MODE"),
        "mysql" => Some("SELECT id FROM payments FOR UPDATE"),
        _ => {
            println!(
                "[{}] {case}) skipped: no lock holds back phase 1 alone",
                DB::LABEL
            );
            None
        }
    }
}

/// a) A crash after phase 1 and after the step was noted pending, while
/// the call is on its way but before the provider saw it. The provider's
/// address is a test socket that accepts connections and never reads
/// them: the service is inside `execute` and nothing can have been
/// charged. SIGKILL, restart against the real provider, retry: the
/// takeover's `recover` finds no charge (`Absent`), so the step runs with
/// the same step key, once.
async fn a_crash_before_the_provider_saw_the_call<DB: TestDb>() {
    let (w, first_service) = World::<DB>::start(CRASH).await;
    drop(first_service);
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole_url = format!("http://{}", hole.local_addr().unwrap());
    let (accepted, mut calls) = tokio::sync::mpsc::channel(4);
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = hole.accept().await {
            held.push(stream);
            let _ = accepted.send(()).await;
        }
    });
    let mut s = Service::start(&w.url, &hole_url, CRASH).await;
    let pending = s.pay_in_background(KEY);
    tokio::time::timeout(START, calls.recv())
        .await
        .expect("the service calls the provider")
        .unwrap();
    let counts = w.counts().await;
    assert_eq!((counts.pending, counts.charges), (1, 0), "{counts:?}");
    assert_eq!(
        w.count("SELECT COUNT(*) FROM idempotency_records WHERE pending_step = 'charge' AND recovery_point = 'created'")
            .await,
        1,
        "the step is noted pending before the call"
    );
    s.kill().await;
    assert!(pending.await.unwrap().is_err(), "the client saw the crash");
    holder.abort();
    s = Service::start(&w.url, &w.provider.url(), CRASH).await;
    let retry = s.pay(KEY).await;
    let counts = w
        .judge_captured("a) crash before the provider call", &s, &retry)
        .await;
    assert_eq!(counts.generation, 2, "one takeover: {counts:?}");
    assert_replays("a", &s, &retry).await;
}

/// a') The provider fails before charging (`fail_before`: 503): `recover`
/// proves nothing happened, the request answers 503 and ends its lease at
/// once, and the retry resumes at `created` and charges once.
async fn a_provider_failure_before_charging<DB: TestDb>() {
    // A lease far longer than any wait of the retry (its in-flight wait is
    // 2 s): a retry that found the lease still held would be refused
    // `409`, not take the key over.
    let (w, s) = World::<DB>::start(Flags {
        lease_ms: 60_000,
        ..CRASH
    })
    .await;
    w.provider.fault(json!({"mode": "fail_before"})).await;
    let first = s.pay(KEY).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
    assert!(first.headers.contains_key("retry-after"), "{first:?}");
    let counts = w.counts().await;
    assert_eq!(
        (
            counts.charges,
            counts.pending,
            counts.ledger,
            counts.succeeded
        ),
        (0, 1, 1, 0),
        "{counts:?}"
    );
    assert_eq!(
        w.count("SELECT COUNT(*) FROM idempotency_records WHERE pending_step IS NULL AND recovery_point = 'created'")
            .await,
        1,
        "no step pending after a proven absence"
    );
    // The lease ended with the 503: the retry takes the key over at once
    // (with the lease still held it would be refused `409`).
    let retry = s.pay(KEY).await;
    assert!(!retry.replayed());
    let counts = w
        .judge_captured("a') provider 503 before charging", &s, &retry)
        .await;
    assert_eq!(counts.generation, 2, "{counts:?}");
}

/// b) The provider charged, the service died before its local commit
/// (SIGKILL while `charge_then_hang` holds the answer). The retry takes the
/// lapsed lease over; `recover` finds the charge; no second call.
async fn b_crash_after_the_charge_before_the_commit<DB: TestDb>() {
    let (w, mut s) = World::<DB>::start(CRASH).await;
    w.provider.hang(10_000).await;
    let pending = s.pay_in_background(KEY);
    w.provider.wait_for_charges(1).await;
    w.restart(&mut s).await;
    assert!(pending.await.unwrap().is_err(), "the client saw the crash");
    let counts = w.counts().await;
    assert_eq!(
        (counts.pending, counts.charges, counts.succeeded),
        (1, 1, 0),
        "{counts:?}"
    );
    // The crashed attempt's lease may still be live: the retry waits on it
    // (bounded by the layer's in-flight wait), then takes over.
    let retry = s.pay(KEY).await;
    let counts = w
        .judge_captured("b) crash after the charge", &s, &retry)
        .await;
    assert_eq!(counts.generation, 2, "{counts:?}");
    assert_replays("b", &s, &retry).await;
}

/// c) The provider charged and the connection died without an answer:
/// `recover` runs at once and finds the charge; `201` in the same request.
async fn c_lost_provider_answer_is_recovered_in_the_same_request<DB: TestDb>() {
    let (w, s) = World::<DB>::start(CRASH).await;
    w.provider.fault(json!({"mode": "charge_then_drop"})).await;
    let first = s.pay(KEY).await;
    assert!(!first.replayed());
    let counts = w
        .judge_captured("c) provider answer lost", &s, &first)
        .await;
    assert_eq!(counts.generation, 1, "no takeover: {counts:?}");
    assert_replays("c", &s, &first).await;
}

/// c') The provider charged but answers later than `--provider-timeout-ms`:
/// `execute` times out, `recover` finds the charge, `201` in the same
/// request, one charge.
async fn c_provider_timeout_is_recovered_in_the_same_request<DB: TestDb>() {
    let flags = Flags {
        provider_timeout_ms: 300,
        ..CRASH
    };
    let (w, s) = World::<DB>::start(flags).await;
    // The provider hangs far longer than the timeout: an answer before
    // it ends was the timeout's.
    w.provider.hang(30_000).await;
    let started = Instant::now();
    let first = s.pay(KEY).await;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    assert!(!first.replayed());
    let counts = w.judge_captured("c') provider timeout", &s, &first).await;
    assert_eq!(counts.generation, 1, "{counts:?}");
}

/// d) After the final commit the answer is the ledger's: whatever is lost
/// after it (here the whole process, SIGKILLed), the retry replays the
/// identical answer and nothing runs again.
async fn d_after_the_commit_the_answer_replays<DB: TestDb>() {
    let (w, mut s) = World::<DB>::start(CRASH).await;
    let first = s.pay(KEY).await;
    w.judge_captured("d) before the crash", &s, &first).await;
    w.restart(&mut s).await;
    assert_replays("d", &s, &first).await;
    let counts = w
        .judge_captured("d) after the crash and replay", &s, &first)
        .await;
    assert_eq!(counts.generation, 1, "{counts:?}");
}

/// e) Instance A is frozen (SIGSTOP) inside the charge, after the
/// provider charged: it cannot renew its lease. Once the lease lapsed, the
/// retry to instance B takes over, recovers the charge and answers `201`.
/// Then A wakes (SIGCONT): every write it tries is fenced out, its client
/// gets `409 #lease-lost` (or B's answer replayed), never a success of its
/// own, and the provider still has one charge.
async fn e_stale_owner_after_a_takeover_records_nothing<DB: TestDb>() {
    let flags = Flags {
        lease_ms: 500,
        completer_ms: 600_000,
        provider_timeout_ms: 5000,
    };
    let (w, a) = World::<DB>::start(flags).await;
    let b = w.service(flags).await;
    w.provider.hang(4000).await;
    let from_a = a.pay_in_background(KEY);
    w.provider.wait_for_charges(1).await;
    a.signal("-STOP");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let from_b = b.pay(KEY).await;
    assert!(!from_b.replayed(), "B took over and ran: {from_b:?}");
    let counts = w.judge_captured("e) takeover by B", &b, &from_b).await;
    assert_eq!(counts.generation, 2, "{counts:?}");
    a.signal("-CONT");
    let stale = from_a.await.unwrap().expect("A answers its client");
    let lease_lost =
        stale.status == StatusCode::CONFLICT && stale.problem_type().ends_with("#lease-lost");
    let replay =
        stale.status == StatusCode::CREATED && stale.replayed() && stale.body == from_b.body;
    assert!(lease_lost || replay, "the stale owner: {stale:?}");
    println!(
        "[{}] e) stale owner A answered {} {}",
        DB::LABEL,
        stale.status,
        stale.problem_type()
    );
    let counts = w.judge_captured("e) after A woke", &b, &from_b).await;
    assert_eq!(counts.generation, 2, "A wrote nothing: {counts:?}");
    assert_replays("e", &b, &from_b).await;
}

/// f) Three instances; A dies inside the charge; once its lease lapsed,
/// retries reach B and C at the same moment: one takeover wins
/// (generation 2, not 3), the other waits and replays or gets `409`; one
/// charge.
async fn f_concurrent_takeovers_one_wins<DB: TestDb>() {
    let flags = Flags {
        lease_ms: 500,
        completer_ms: 600_000,
        provider_timeout_ms: 5000,
    };
    let (w, mut a) = World::<DB>::start(flags).await;
    let b = w.service(flags).await;
    let c = w.service(flags).await;
    w.provider.hang(10_000).await;
    let pending = a.pay_in_background(KEY);
    w.provider.wait_for_charges(1).await;
    a.kill().await;
    assert!(pending.await.unwrap().is_err());
    tokio::time::sleep(Duration::from_millis(800)).await;
    let (from_b, from_c) = tokio::join!(b.pay(KEY), c.pay(KEY));
    let fresh: Vec<_> = [&from_b, &from_c]
        .into_iter()
        .filter(|x| x.status == StatusCode::CREATED && !x.replayed())
        .collect();
    assert_eq!(fresh.len(), 1, "exactly one winner: {from_b:?} {from_c:?}");
    let winner = fresh[0].clone();
    for other in [&from_b, &from_c] {
        let in_flight =
            other.status == StatusCode::CONFLICT && other.problem_type().ends_with("#in-flight");
        assert!(
            other.body == winner.body || in_flight,
            "the loser replays or is told in flight: {other:?}"
        );
    }
    let counts = w
        .judge_captured("f) concurrent takeovers", &b, &winner)
        .await;
    assert_eq!(counts.generation, 2, "exactly one takeover: {counts:?}");
    println!(
        "[{}] f) answers: B {} replayed={}, C {} replayed={}",
        DB::LABEL,
        from_b.status,
        from_b.replayed(),
        from_c.status,
        from_c.replayed()
    );
}

/// g) The charge was made, the service died, and the provider's look-up is
/// down: the takeover cannot tell whether the charge happened, so the
/// record is parked and every retry gets `503 #reconciling` (no second
/// call). The operator checks the provider's listing, sees the charge
/// made with this payment's step key, and resolves the record as `Rerun`:
/// the step runs again with the same step key, which the provider
/// deduplicates (one charge), and the payment is captured locally.
/// (`Resolution::Succeeded` would also stop the retries, but with an
/// answer the operator writes by hand and the `payments` row left
/// `pending`.)
async fn g_unknown_outcome_parks_until_an_operator_reruns<DB: TestDb>() {
    let (w, mut s) = World::<DB>::start(CRASH).await;
    w.provider.fault(json!({"mode": "lookup_down"})).await;
    w.provider.hang(10_000).await;
    let pending = s.pay_in_background(KEY);
    w.provider.wait_for_charges(1).await;
    w.restart(&mut s).await;
    assert!(pending.await.unwrap().is_err());
    let mut parked_answers = 0;
    for _ in 0..2 {
        let retry = s.pay(KEY).await;
        assert_eq!(retry.status, StatusCode::SERVICE_UNAVAILABLE, "{retry:?}");
        assert!(retry.problem_type().ends_with("#reconciling"), "{retry:?}");
        assert!(retry.headers.contains_key("retry-after"), "{retry:?}");
        parked_answers += 1;
    }
    let counts = w.counts().await;
    assert_eq!(
        (
            counts.charges,
            counts.parked,
            counts.pending,
            counts.succeeded
        ),
        (1, 1, 1, 0),
        "{counts:?}"
    );
    println!(
        "[{}] g) parked after {parked_answers} retries: {counts}",
        DB::LABEL
    );
    // The operator.
    let reconciler = Reconciler::new(w.pool.clone());
    let unresolved: Vec<_> = reconciler
        .unresolved(10)
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.status == RecordStatus::NeedsReconciliation)
        .collect();
    assert_eq!(unresolved.len(), 1, "{unresolved:?}");
    let record = &unresolved[0];
    assert_eq!(record.pending_step.as_deref(), Some("charge"), "{record:?}");
    assert_eq!(record.operation, "POST /payments");
    let charges = w.provider.charges().await;
    assert_eq!(charges.len(), 1, "the provider's listing shows the charge");
    reconciler.resolve(record, Resolution::Rerun).await.unwrap();
    // Each resolution is fenced: a second one (another operator) loses,
    // and says why.
    let again = reconciler.resolve(record, Resolution::Rerun).await;
    assert!(again.is_err(), "{again:?}");
    let by_hand = http::Response::builder()
        .status(StatusCode::CREATED)
        .body(Bytes::from_static(b"{}"))
        .unwrap();
    let late = reconciler
        .resolve(record, Resolution::Succeeded(by_hand))
        .await;
    assert!(late.is_err(), "{late:?}");
    // The look-up is still down; the rerun does not need it.
    let retry = s.pay(KEY).await;
    assert!(!retry.replayed(), "{retry:?}");
    assert_eq!(retry.charge_id(), charges[0]["chargeId"].as_str().unwrap());
    w.judge_captured("g) operator rerun", &s, &retry).await;
    assert_replays("g", &s, &retry).await;
}

/// g') A parked record with a pending step is retried by every completer
/// pass: while the look-up is down it stays parked (retries get `503
/// #reconciling`); once the look-up is back, a pass finds the charge and
/// finishes the payment with no client request.
async fn g_parked_record_is_finished_by_the_completer<DB: TestDb>() {
    let flags = Flags {
        lease_ms: 1000,
        completer_ms: 200,
        provider_timeout_ms: 5000,
    };
    let (w, mut s) = World::<DB>::start(flags).await;
    w.provider.fault(json!({"mode": "lookup_down"})).await;
    w.provider.hang(10_000).await;
    let pending = s.pay_in_background(KEY);
    w.provider.wait_for_charges(1).await;
    w.restart(&mut s).await;
    assert!(pending.await.unwrap().is_err());
    let parked = w
        .wait_until("parked by the completer", |c| c.parked == 1)
        .await;
    assert_eq!((parked.charges, parked.pending), (1, 1), "{parked:?}");
    let retry = s.pay(KEY).await;
    assert_eq!(retry.status, StatusCode::SERVICE_UNAVAILABLE, "{retry:?}");
    assert!(retry.problem_type().ends_with("#reconciling"), "{retry:?}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let still = w.counts().await;
    assert_eq!(
        (still.parked, still.charges),
        (1, 1),
        "stays parked: {still:?}"
    );
    w.provider.fault(json!({"mode": "lookup_up"})).await;
    let done = w
        .wait_until("finished by the completer", |c| c.succeeded == 1)
        .await;
    println!("[{}] g') completer after lookup_up: {done}", DB::LABEL);
    let retry = s.pay(KEY).await;
    assert!(retry.replayed(), "{retry:?}");
    w.judge_captured("g') completer resolved the parked record", &s, &retry)
        .await;
}

/// h) A step longer than the lease: heartbeats renew it, so a duplicate
/// during the call is told `409 #in-flight` (it never takes over), and
/// the first request answers `201`. The provider holds its answer for
/// 3000 ms (not 1500): the duplicate waits up to the layer's in-flight
/// wait (2 s) before its `409`, and with 1500 ms it would see the first
/// request finish and replay instead.
async fn h_heartbeats_keep_a_long_step_in_flight<DB: TestDb>() {
    let flags = Flags {
        lease_ms: 300,
        completer_ms: 600_000,
        provider_timeout_ms: 5000,
    };
    let (w, s) = World::<DB>::start(flags).await;
    w.provider.hang(3000).await;
    let first = s.pay_in_background(KEY);
    w.provider.wait_for_charges(1).await;
    // More than a lease: without renewals the duplicate would take over.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let duplicate = s.pay(KEY).await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
    assert!(
        duplicate.problem_type().ends_with("#in-flight"),
        "{duplicate:?}"
    );
    assert!(
        duplicate.headers.contains_key("retry-after"),
        "{duplicate:?}"
    );
    let first = first.await.unwrap().unwrap();
    assert!(!first.replayed());
    let counts = w.judge_captured("h) renewed lease", &s, &first).await;
    assert_eq!(counts.generation, 1, "never taken over: {counts:?}");
    assert_replays("h", &s, &first).await;
}

/// i) Nobody retries: after a SIGKILL inside the charge, the restarted
/// instance's completer takes the lapsed lease over, recovers the charge
/// and records the answer; the client's later retry replays it.
async fn i_completer_finishes_an_abandoned_payment<DB: TestDb>() {
    let flags = Flags {
        lease_ms: 1000,
        completer_ms: 200,
        provider_timeout_ms: 5000,
    };
    let (w, mut s) = World::<DB>::start(flags).await;
    w.provider.hang(10_000).await;
    let pending = s.pay_in_background(KEY);
    w.provider.wait_for_charges(1).await;
    w.restart(&mut s).await;
    assert!(pending.await.unwrap().is_err());
    let done = w
        .wait_until("finished by the completer", |c| {
            c.succeeded == 1 && c.captured == 1
        })
        .await;
    assert_eq!(done.charges, 1, "{done:?}");
    println!("[{}] i) completer, no client request: {done}", DB::LABEL);
    let retry = s.pay(KEY).await;
    assert!(retry.replayed(), "{retry:?}");
    let counts = w
        .judge_captured("i) completer then client retry", &s, &retry)
        .await;
    assert_eq!(counts.generation, 2, "{counts:?}");
}

/// SIGTERM while a payment waits on the provider: the service stops
/// accepting, lets the payment finish (`201`), and exits with status 0.
async fn sigterm_lets_the_payment_in_progress_finish<DB: TestDb>() {
    let (w, mut s) = World::<DB>::start(CRASH).await;
    w.provider.hang(1000).await;
    let pending = s.pay_in_background(KEY);
    w.provider.wait_for_charges(1).await;
    s.signal("-TERM");
    let first = pending.await.unwrap().expect("the payment finishes");
    let status = tokio::time::timeout(START, s.child.wait())
        .await
        .expect("the service exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
    s = w.service(CRASH).await;
    w.judge_captured("SIGTERM mid-payment", &s, &first).await;
    assert_replays("SIGTERM", &s, &first).await;
}

/// j) A stalls before phase 1 (frozen while its phase waits on a lock),
/// its lease lapses, B's completer deletes the bare claim, and the client's
/// retry on B claims the key again (generation 1 once more). A wakes while
/// B's charge is in flight: its first write is refused (the fence names the
/// claim), so it never charges under a step key of its own. One charge,
/// one payment row.
async fn j_stale_owner_of_a_deleted_claim_charges_nothing<DB: TestDb>() {
    let Some(hold_sql) = phase_1_lock::<DB>("j") else {
        return;
    };
    let flags = Flags {
        lease_ms: 1000,
        completer_ms: 200,
        provider_timeout_ms: 5000,
    };
    let (w, a) = World::<DB>::start(flags).await;
    let b = w.service(flags).await;
    let mut hold = w.pool.begin().await.unwrap();
    DB::exec_on(&mut hold, hold_sql).await.unwrap();
    let from_a = a.pay_in_background(KEY);
    w.wait_until("A's claim commits", |c| c.ledger == 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.signal("-STOP");
    hold.rollback().await.unwrap();
    w.wait_until("B's completer deletes the bare claim", |c| c.ledger == 0)
        .await;
    w.provider.hang(3000).await;
    let from_b = b.pay_in_background(KEY);
    w.provider.wait_for_charges(1).await;
    a.signal("-CONT");
    let stale = from_a.await.unwrap();
    let from_b = from_b.await.unwrap().expect("B answers its client");
    let counts = w.judge_captured("j) B after A woke", &b, &from_b).await;
    println!(
        "[{}] j) stale owner A answered {:?}; {counts}",
        DB::LABEL,
        stale.as_ref().map(|s| (s.status, s.problem_type()))
    );
    assert_replays("j", &b, &from_b).await;
}

/// k) The provider is down (connection refused: nothing can have been
/// sent). The payment is not parked: a plain retryable 503, the lease
/// ended, and the retry once the provider is back charges once.
async fn k_provider_down_is_a_plain_retryable_503<DB: TestDb>() {
    let (w, first_service) = World::<DB>::start(CRASH).await;
    drop(first_service);
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    let mut s = Service::start(&w.url, &closed, CRASH).await;
    let first = s.pay(KEY).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
    assert!(
        !first.problem_type().ends_with("#reconciling"),
        "parked though nothing was sent: {first:?}"
    );
    let counts = w.counts().await;
    assert_eq!((counts.parked, counts.charges), (0, 0), "{counts:?}");
    assert_eq!(
        w.count("SELECT COUNT(*) FROM idempotency_records WHERE pending_step IS NOT NULL")
            .await,
        0,
        "no step left pending: nothing was sent"
    );
    let again = s.pay(KEY).await;
    assert_eq!(again.status, StatusCode::SERVICE_UNAVAILABLE, "{again:?}");
    assert!(!again.problem_type().ends_with("#reconciling"), "{again:?}");
    s.kill().await;
    s = Service::start(&w.url, &w.provider.url(), CRASH).await;
    let retry = s.pay(KEY).await;
    w.judge_captured("k) provider back", &s, &retry).await;
}

/// l) The provider charged, then the database lost the claim and the
/// pending payment with it, as a standby promoted under asynchronous
/// replication loses the last commits (here: the service is SIGKILLed
/// while the provider holds its answer, and both rows are deleted). The
/// client's retry finds no record and makes a new claim. Its step key
/// derives from what the retry presents again (principal, operation, key,
/// payload), not from the lost claim, so the provider recognises the
/// charge: one charge, and the answer names it.
async fn l_a_claim_lost_with_its_payment_is_charged_once<DB: TestDb>() {
    let (w, mut s) = World::<DB>::start(CRASH).await;
    w.provider.hang(10_000).await;
    let pending = s.pay_in_background(KEY);
    w.provider.wait_for_charges(1).await;
    s.kill().await;
    assert!(pending.await.unwrap().is_err(), "the client saw the crash");
    DB::exec(&w.pool, "DELETE FROM payments").await;
    DB::exec(&w.pool, "DELETE FROM idempotency_records").await;
    let s = w.service(s.flags).await;
    let retry = s.pay(KEY).await;
    let counts = w
        .judge_captured("l) claim lost with its payment", &s, &retry)
        .await;
    assert_eq!(counts.generation, 1, "a new claim: {counts:?}");
}
