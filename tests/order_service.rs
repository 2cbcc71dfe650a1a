//! End-to-end: the example order service as a real process over real HTTP,
//! on PostgreSQL and SQLite, judged by the rows in its database.

mod common;
#[path = "common/http.rs"]
mod http_call;

use std::time::Duration;

use http::{Method, StatusCode};
use http_call::{Answer, http_call, try_http_call};
use sqlx::Pool;
use tokio::process::Child;
use tower_idempotency::testkit::{Cleanup, ConformanceDb as TestDb};

/// One running service on its own database.
struct Service<DB: TestDb> {
    url: String,
    addr: String,
    child: Child,
    pool: Pool<DB>,
    _drop: Cleanup,
}

impl<DB: TestDb> Service<DB> {
    async fn start(delay_ms: u64) -> Self {
        let (url, drop) = DB::fresh_url().await;
        let (child, addr) = spawn(&url, delay_ms).await;
        let pool = sqlx::pool::PoolOptions::<DB>::new()
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap();
        Self {
            url,
            addr,
            child,
            pool,
            _drop: drop,
        }
    }

    /// SIGKILL, then start again on the same database.
    async fn kill_and_restart(&mut self) {
        self.child.start_kill().unwrap();
        self.child.wait().await.unwrap();
        let (child, addr) = spawn(&self.url, 0).await;
        self.child = child;
        self.addr = addr;
    }

    async fn count(&self, sql: &'static str) -> i64 {
        DB::count(&self.pool, sql).await
    }

    async fn orders(&self) -> i64 {
        self.count("SELECT COUNT(*) FROM orders").await
    }

    async fn ledger(&self) -> i64 {
        self.count("SELECT COUNT(*) FROM idempotency_records").await
    }

    async fn stock(&self, sku: &str) -> i64 {
        DB::stock(&self.pool, sku).await
    }

    async fn put_stock(&self, sku: &str, qty: i64) {
        let a = self
            .call(
                Method::PUT,
                &format!("/stock/{sku}"),
                None,
                None,
                &format!(r#"{{"qty":{qty}}}"#),
            )
            .await;
        assert_eq!(a.status, StatusCode::OK, "{a:?}");
    }

    /// Sends the standard order for `user-42` from a task; `Err` when the
    /// connection dies before the answer.
    fn order_in_background(&self) -> tokio::task::JoinHandle<Result<Answer, hyper::Error>> {
        let addr = self.addr.clone();
        tokio::spawn(async move {
            try_http_call(
                &addr,
                Method::POST,
                "/orders",
                Some("user-42"),
                Some(KEY),
                ORDER,
            )
            .await
        })
    }

    async fn order(&self, principal: &str, key: &str, body: &str) -> Answer {
        self.call(Method::POST, "/orders", Some(principal), Some(key), body)
            .await
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        principal: Option<&str>,
        key: Option<&str>,
        body: &str,
    ) -> Answer {
        http_call(&self.addr, method, path, principal, key, body).await
    }
}

async fn spawn(url: &str, delay_ms: u64) -> (Child, String) {
    spawn_with(url, delay_ms, &[]).await
}

/// libfaketime, from Debian's `faketime` package (`.ci/run` installs it).
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

async fn spawn_with(url: &str, delay_ms: u64, env: &[(&str, &str)]) -> (Child, String) {
    common::order_service(url, delay_ms, env).await
}

const ORDER: &str = r#"{"currency":"KRW","items":[{"sku":"A-10","qty":2}],"amount":12000}"#;
const KEY: &str = "\"checkout-20260914-001\"";

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
    create_then_retry_is_one_order,
    concurrent_duplicates_make_one_order_and_one_decrement,
    changed_amount_is_refused,
    out_of_stock_on_second_item_leaves_nothing_and_replays,
    sigkill_mid_transaction_leaves_nothing_and_retry_runs_once,
    other_principal_is_independent,
    invalid_and_unauthenticated_requests_store_nothing,
    expired_key_is_refused_without_a_new_order,
    orders_are_visible_to_their_owner_only,
    sigterm_lets_the_in_flight_order_finish,
    instances_with_skewed_clocks_agree_on_expiry,
    lost_database_connections_answer_503_never_500,
    patch_is_guarded_and_a_retry_changes_nothing_more,
    delete_passes_through_unguarded,
);

/// `PATCH /orders/{id}` is guarded: no key, 400 and no change; with a key,
/// one change; its retry is replayed (no second history row); the key with
/// another memo is refused. Judged by the history rows.
async fn patch_is_guarded_and_a_retry_changes_nothing_more<DB: TestDb>() {
    let s = Service::<DB>::start(0).await;
    s.put_stock("A-10", 5).await;
    let created = s.order("user-42", KEY, ORDER).await;
    let location = created.headers["location"].to_str().unwrap().to_string();
    let patch = r#"{"memo":"gift wrap"}"#;
    let changes = "SELECT COUNT(*) FROM order_changes";

    let no_key = s
        .call(Method::PATCH, &location, Some("user-42"), None, patch)
        .await;
    assert_eq!(no_key.status, StatusCode::BAD_REQUEST, "{no_key:?}");
    assert!(no_key.problem_type().ends_with("#missing-key"));
    assert_eq!(s.count(changes).await, 0);

    let key = Some("\"memo-1\"");
    let first = s
        .call(Method::PATCH, &location, Some("user-42"), key, patch)
        .await;
    assert_eq!(first.status, StatusCode::OK, "{first:?}");
    assert_eq!(first.json()["memo"], "gift wrap");
    let retry = s
        .call(Method::PATCH, &location, Some("user-42"), key, patch)
        .await;
    assert_eq!(retry.status, StatusCode::OK);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(retry.body, first.body);
    let other = s
        .call(
            Method::PATCH,
            &location,
            Some("user-42"),
            key,
            r#"{"memo":"no wrap"}"#,
        )
        .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.json()["idempotency_key"], "memo-1");

    assert_eq!(s.count(changes).await, 1);
    assert_eq!(
        s.count("SELECT COUNT(*) FROM orders WHERE memo = 'gift wrap'")
            .await,
        1
    );
    // The order's claim and the change's claim.
    assert_eq!(s.ledger().await, 2);
}

/// `DELETE /orders/{id}` is idempotent by nature: it passes the layer
/// unguarded (no key needed, none recorded), `204` and then `404`.
async fn delete_passes_through_unguarded<DB: TestDb>() {
    let s = Service::<DB>::start(0).await;
    s.put_stock("A-10", 5).await;
    let created = s.order("user-42", KEY, ORDER).await;
    let location = created.headers["location"].to_str().unwrap().to_string();

    let theirs = s
        .call(Method::DELETE, &location, Some("user-7"), None, "")
        .await;
    assert_eq!(theirs.status, StatusCode::NOT_FOUND);
    assert_eq!(s.orders().await, 1);

    let gone = s
        .call(Method::DELETE, &location, Some("user-42"), None, "")
        .await;
    assert_eq!(gone.status, StatusCode::NO_CONTENT, "{gone:?}");
    assert_eq!(s.orders().await, 0);
    assert_eq!(s.count("SELECT COUNT(*) FROM order_items").await, 0);
    // A key changes nothing for an unguarded method: no claim, no replay.
    let again = s
        .call(
            Method::DELETE,
            &location,
            Some("user-42"),
            Some("\"del-1\""),
            "",
        )
        .await;
    assert_eq!(again.status, StatusCode::NOT_FOUND);
    assert!(again.headers.get("idempotent-replayed").is_none());
    assert_eq!(s.ledger().await, 1);
}

/// Acceptance 1 and 2.
async fn create_then_retry_is_one_order<DB: TestDb>() {
    let s = Service::<DB>::start(0).await;
    s.put_stock("A-10", 5).await;
    let first = s.order("user-42", KEY, ORDER).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let id = first.json()["orderId"].as_str().unwrap().to_string();
    assert_eq!(first.headers["location"], format!("/orders/{id}"));
    assert_eq!(s.orders().await, 1);
    assert_eq!(
        s.count("SELECT COUNT(*) FROM idempotency_records WHERE status = 'SUCCEEDED'")
            .await,
        1
    );
    let retry = s.order("user-42", KEY, ORDER).await;
    // Other key order, and the optional memo at its default: the same request.
    let retry2 = s
        .order(
            "user-42",
            KEY,
            r#"{"amount":12000,"memo":"","items":[{"qty":2,"sku":"A-10"}],"currency":"KRW"}"#,
        )
        .await;
    for r in [&retry, &retry2] {
        assert_eq!(r.status, StatusCode::CREATED);
        assert_eq!(r.body, first.body, "byte-identical replay");
        assert!(r.replayed());
    }
    assert_eq!(s.orders().await, 1);
    assert_eq!(s.count("SELECT COUNT(*) FROM order_items").await, 1);
    assert_eq!(s.stock("A-10").await, 3);
    assert_eq!(s.ledger().await, 1);
}

/// Acceptance 3 over real connections.
async fn concurrent_duplicates_make_one_order_and_one_decrement<DB: TestDb>() {
    let s = Service::<DB>::start(200).await;
    s.put_stock("A-10", 100).await;
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let addr = s.addr.clone();
            tokio::spawn(async move {
                http_call(
                    &addr,
                    Method::POST,
                    "/orders",
                    Some("user-42"),
                    Some(KEY),
                    ORDER,
                )
                .await
            })
        })
        .collect();
    let mut bodies = Vec::new();
    for t in tasks {
        let a = t.await.unwrap();
        match a.status {
            StatusCode::CREATED => bodies.push(a.body),
            StatusCode::CONFLICT => assert!(a.problem_type().ends_with("#in-flight"), "{a:?}"),
            other => panic!("unexpected {other}: {a:?}"),
        }
    }
    assert!(!bodies.is_empty());
    assert!(
        bodies.iter().all(|b| *b == bodies[0]),
        "every 201 carries the same order: {bodies:?}"
    );
    assert_eq!(s.orders().await, 1);
    assert_eq!(s.stock("A-10").await, 98, "one decrement");
    assert_eq!(s.ledger().await, 1);
}

/// Acceptance 4.
async fn changed_amount_is_refused<DB: TestDb>() {
    let s = Service::<DB>::start(0).await;
    s.put_stock("A-10", 5).await;
    s.order("user-42", KEY, ORDER).await;
    let changed = s
        .order("user-42", KEY, &ORDER.replace("12000", "15000"))
        .await;
    assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(changed.problem_type().ends_with("#key-reused"));
    let other_item = s
        .order("user-42", KEY, &ORDER.replace("A-10", "B-20"))
        .await;
    assert_eq!(other_item.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(s.orders().await, 1);
    assert_eq!(s.stock("A-10").await, 3);
}

/// Acceptance 5, first half: a final business error after partial writes.
async fn out_of_stock_on_second_item_leaves_nothing_and_replays<DB: TestDb>() {
    let s = Service::<DB>::start(0).await;
    s.put_stock("A-10", 5).await;
    s.put_stock("B-20", 1).await;
    let body = r#"{"currency":"KRW","items":[{"sku":"A-10","qty":2},{"sku":"B-20","qty":2}],"amount":30000}"#;
    let first = s.order("user-42", KEY, body).await;
    assert_eq!(first.status, StatusCode::CONFLICT);
    assert!(first.problem_type().ends_with("out-of-stock"), "{first:?}");
    assert_eq!(
        s.stock("A-10").await,
        5,
        "the first item's decrement was undone"
    );
    assert_eq!(s.orders().await, 0);
    assert_eq!(s.count("SELECT COUNT(*) FROM order_items").await, 0);
    assert_eq!(
        s.count("SELECT COUNT(*) FROM idempotency_records WHERE status = 'FAILED_FINAL'")
            .await,
        1
    );
    s.put_stock("B-20", 10).await;
    let retry = s.order("user-42", KEY, body).await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(retry.body, first.body);
    assert!(retry.replayed());
    assert_eq!(s.orders().await, 0);
    assert_eq!(s.stock("B-20").await, 10);
}

/// Acceptance 5, second half, and the failure-point table's "crash after the
/// order insert": the process dies before commit; nothing survives; the
/// retry after restart executes exactly once.
async fn sigkill_mid_transaction_leaves_nothing_and_retry_runs_once<DB: TestDb>() {
    let mut s = Service::<DB>::start(3000).await;
    s.put_stock("A-10", 5).await;
    let inflight = s.order_in_background();
    // Wait until the handler has written (stock taken inside the open transaction).
    tokio::time::sleep(Duration::from_millis(1000)).await;
    s.kill_and_restart().await;
    assert!(
        inflight.await.unwrap().is_err(),
        "the client saw the connection die"
    );
    assert_eq!(s.orders().await, 0);
    assert_eq!(s.ledger().await, 0);
    assert_eq!(s.stock("A-10").await, 5);
    let retry = s.order("user-42", KEY, ORDER).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    let again = s.order("user-42", KEY, ORDER).await;
    assert!(again.replayed());
    assert_eq!(s.orders().await, 1);
    assert_eq!(s.stock("A-10").await, 3);
}

async fn other_principal_is_independent<DB: TestDb>() {
    let s = Service::<DB>::start(0).await;
    s.put_stock("A-10", 5).await;
    let alice = s.order("user-42", KEY, ORDER).await;
    let bob = s.order("user-7", KEY, ORDER).await;
    assert_eq!(bob.status, StatusCode::CREATED);
    assert!(!bob.replayed());
    assert_ne!(alice.json()["orderId"], bob.json()["orderId"]);
    assert_eq!(s.orders().await, 2);
    assert_eq!(s.stock("A-10").await, 1);
}

async fn invalid_and_unauthenticated_requests_store_nothing<DB: TestDb>() {
    let s = Service::<DB>::start(0).await;
    s.put_stock("A-10", 5).await;
    let cases = [
        r#"{"currency":"KRW","items":[],"amount":12000}"#,
        r#"{"currency":"KRW","items":[{"sku":"A-10","qty":0}],"amount":12000}"#,
        r#"{"currency":"KRW","items":[{"sku":"A-10","qty":1}],"amount":-1}"#,
        r#"{"currency":"krw","items":[{"sku":"A-10","qty":1}],"amount":1}"#,
        r#"{"currency":"KRW","items":[{"sku":"A-10","qty":1}]"#,
    ];
    for body in cases {
        let a = s.order("user-42", KEY, body).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {a:?}");
        assert_eq!(a.headers["content-type"], "application/problem+json");
    }
    let no_auth = s
        .call(Method::POST, "/orders", None, Some(KEY), ORDER)
        .await;
    assert_eq!(no_auth.status, StatusCode::UNAUTHORIZED);
    let empty_auth = s
        .call(Method::POST, "/orders", Some(""), Some(KEY), ORDER)
        .await;
    assert_eq!(empty_auth.status, StatusCode::UNAUTHORIZED);
    let no_key = s
        .call(Method::POST, "/orders", Some("user-42"), None, ORDER)
        .await;
    assert_eq!(no_key.status, StatusCode::BAD_REQUEST);
    assert_eq!(s.orders().await, 0);
    assert_eq!(s.ledger().await, 0);
    assert_eq!(s.stock("A-10").await, 5);
    // The key was never used: a corrected request runs.
    assert_eq!(
        s.order("user-42", KEY, ORDER).await.status,
        StatusCode::CREATED
    );
}

/// Acceptance 7.
async fn expired_key_is_refused_without_a_new_order<DB: TestDb>() {
    let s = Service::<DB>::start(0).await;
    s.put_stock("A-10", 5).await;
    let first = s.order("user-42", KEY, ORDER).await;
    let id = first.json()["orderId"].as_str().unwrap().to_string();
    DB::exec(&s.pool, "UPDATE idempotency_records SET expires_at = 1").await;
    let late = s.order("user-42", KEY, ORDER).await;
    assert_eq!(late.status, StatusCode::GONE);
    assert_eq!(late.json()["resource_id"], id.as_str());
    assert_eq!(s.orders().await, 1);
    assert_eq!(s.stock("A-10").await, 3);
}

async fn orders_are_visible_to_their_owner_only<DB: TestDb>() {
    let s = Service::<DB>::start(0).await;
    s.put_stock("A-10", 5).await;
    let first = s.order("user-42", KEY, ORDER).await;
    let location = first.headers["location"].to_str().unwrap().to_string();
    let mine = s
        .call(Method::GET, &location, Some("user-42"), None, "")
        .await;
    assert_eq!(mine.status, StatusCode::OK);
    assert_eq!(mine.json()["orderId"], first.json()["orderId"]);
    assert_eq!(mine.json()["items"][0]["sku"], "A-10");
    let theirs = s
        .call(Method::GET, &location, Some("user-7"), None, "")
        .await;
    assert_eq!(theirs.status, StatusCode::NOT_FOUND);
    let health = s.call(Method::GET, "/health", None, None, "").await;
    assert_eq!(health.status, StatusCode::OK);
}

/// SIGTERM during a request: the service stops taking connections, lets the
/// in-flight order finish and commit, and exits cleanly.
async fn sigterm_lets_the_in_flight_order_finish<DB: TestDb>() {
    let mut s = Service::<DB>::start(800).await;
    s.put_stock("A-10", 5).await;
    let inflight = s.order_in_background();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = s.child.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let answer = inflight.await.unwrap().unwrap();
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    let exit = tokio::time::timeout(Duration::from_secs(10), s.child.wait())
        .await
        .expect("exits")
        .unwrap();
    assert!(exit.success(), "{exit:?}");
    assert_eq!(s.orders().await, 1);
    assert_eq!(s.ledger().await, 1);
    assert_eq!(s.stock("A-10").await, 3);
}

/// Hardening 14: one clock. A second instance whose clock runs two days
/// ahead (libfaketime) shares the database: it replays the first
/// instance's answer instead of calling the key expired, and the rows it
/// writes carry the database's time, not its own. SQLite has no clock but
/// the process's, so the case is for the servers.
async fn instances_with_skewed_clocks_agree_on_expiry<DB: TestDb>() {
    if DB::LABEL == "sqlite" {
        return;
    }
    assert!(
        std::path::Path::new(FAKETIME).exists(),
        "{FAKETIME} is missing: apt-get install faketime (.ci/run does)"
    );
    let s = Service::<DB>::start(0).await;
    s.put_stock("A-10", 10).await;
    let first = s.order("user-42", KEY, ORDER).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let ahead = [
        ("LD_PRELOAD", FAKETIME),
        ("FAKETIME", "+2d"),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
    ];
    let (mut skewed, addr) = spawn_with(&s.url, 0, &ahead).await;
    let call = |key: &'static str| {
        http_call(
            &addr,
            Method::POST,
            "/orders",
            Some("user-42"),
            Some(key),
            ORDER,
        )
    };
    // Give the skewed instance's sweeper (it sweeps at start) its chance.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let retry = call(KEY).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    // A key claimed by the skewed instance is dated by the database.
    let fresh = call("\"skewed-instance-key\"").await;
    assert_eq!(fresh.status, StatusCode::CREATED, "{fresh:?}");
    let skew = s
        .count(if DB::LABEL == "postgres" {
            "SELECT ABS(created_at - (EXTRACT(EPOCH FROM now()) * 1000)::BIGINT) \
             FROM idempotency_records WHERE idem_key = 'skewed-instance-key'"
        } else {
            "SELECT ABS(created_at - (TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)) \
             FROM idempotency_records WHERE idem_key = 'skewed-instance-key'"
        })
        .await;
    assert!(
        skew < 60_000,
        "created_at is {skew} ms off the database clock"
    );
    // And the first instance replays it.
    let back = s.order("user-42", "\"skewed-instance-key\"", ORDER).await;
    assert!(back.replayed(), "{back:?}");
    assert_eq!(s.orders().await, 2);
    skewed.start_kill().unwrap();
    let _ = skewed.wait().await;
}

/// Hardening 15: connections to the database die under load. Every
/// answer is a success or a retryable 503 (never 500), and each key that
/// got a 201 is one committed order.
async fn lost_database_connections_answer_503_never_500<DB: TestDb>() {
    if DB::LABEL != "postgres" {
        // Killing a server's sessions from outside: PostgreSQL shows it.
        return;
    }
    let s = Service::<DB>::start(0).await;
    s.put_stock("A-10", 1_000_000).await;
    let killer = {
        let pool = s.pool.clone();
        tokio::spawn(async move {
            for _ in 0..300 {
                let _ = DB::exec_on(
                    &mut *pool.acquire().await.unwrap(),
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE datname = current_database() AND pid <> pg_backend_pid()",
                )
                .await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let orders: Vec<_> = (0..120)
        .map(|i| {
            let addr = s.addr.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(i * 12)).await;
                let key = format!("\"load-{i}\"");
                try_http_call(
                    &addr,
                    Method::POST,
                    "/orders",
                    Some("user-42"),
                    Some(&key),
                    ORDER,
                )
                .await
            })
        })
        .collect();
    let (mut created, mut unavailable, mut retry) = (0, 0, Vec::new());
    for (i, o) in orders.into_iter().enumerate() {
        let key = format!("\"load-{i}\"");
        match o.await.unwrap() {
            Ok(a) if a.status == StatusCode::CREATED => created += 1,
            Ok(a) if a.status == StatusCode::SERVICE_UNAVAILABLE => {
                assert!(a.headers.contains_key("retry-after"), "{a:?}");
                unavailable += 1;
                retry.push(key);
            }
            Ok(a) => panic!("{}: {a:?}", a.status),
            Err(_) => retry.push(key),
        }
    }
    killer.await.unwrap();
    println!("lost connections under load: {created} created, {unavailable} answered 503");
    assert!(unavailable > 0, "the killer hit no request");
    // Each retry of a 503 runs once or replays: one order per key.
    for key in &retry {
        let a = s.order("user-42", key, ORDER).await;
        assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    }
    assert_eq!(s.orders().await, 120, "one order per key");
}
