//! The connection dies *during* `COMMIT` (PostgreSQL). The layer read the
//! transaction's id (`txid_current()`) before the `COMMIT`, and asks
//! the server on a fresh connection what became of it (`txid_status`, the
//! `pg_xact_status` of every version): aborted is a retryable 503,
//! committed is the handler's answer, still running is a 409 to retry
//! later. Each case checks in the logs that the server's answer, not a
//! re-read of the ledger, decided.
//!
//! Three ways to lose the connection:
//! - a deferred constraint trigger on the business table terminates its own
//!   backend at `COMMIT`: the commit never completes (aborted);
//! - a relay between the layer and the server cuts the connection just
//!   before the server's acknowledgement of the `COMMIT` (committed);
//! - a deferred trigger announces itself with a notice and sleeps, and the
//!   relay cuts the connection after the notice (still in progress).

use std::io::Write;
use std::net::ToSocketAddrs;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgPoolOptions, PgSslMode};
use tower_idempotency::testkit::relay::{Cut, Relay};
use tower_idempotency::testkit::{ConformanceDb, Harness, order, send};

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Everything logged in this process so far (the subscriber is installed
/// by the first call). The cases run in parallel; each looks for its own
/// transaction status, which no other case produces.
fn logs() -> String {
    static LOGS: OnceLock<Captured> = OnceLock::new();
    let logs = LOGS.get_or_init(|| {
        let logs = Captured::default();
        let writer = logs.clone();
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .init();
        logs
    });
    String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned()
}

/// Whether the server's transaction status decided, with `status`; a
/// "committed" only with the row the transaction wrote found on the
/// server (no case here loses a commit to another server).
fn decided_by_xact_status(status: &str) -> bool {
    let logs = logs();
    logs.lines().any(|line| {
        line.contains("the connection was lost during COMMIT")
            && line.contains(&format!("xact_status=\"{status}\""))
    }) && !logs.contains("but not the row it wrote")
}

/// The warnings logged so far, for a failure's message.
fn warnings() -> String {
    let logs = logs();
    let lines: Vec<&str> = logs.lines().filter(|l| l.contains("WARN")).collect();
    lines.join("\n")
}

/// The case's database reached through a relay (unencrypted, so the relay
/// can read the protocol).
async fn through_relay(h: Harness<sqlx::Postgres>) -> (Harness<sqlx::Postgres>, Relay) {
    let options = (*h.pool.connect_options()).clone();
    let upstream = (options.get_host(), options.get_port())
        .to_socket_addrs()
        .unwrap()
        .next()
        .unwrap();
    let relay = Relay::start(upstream, Duration::ZERO);
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .connect_with(
            options
                .host("127.0.0.1")
                .port(relay.addr.port())
                .ssl_mode(PgSslMode::Disable),
        )
        .await
        .unwrap();
    (h.with_pool(pool), relay)
}

async fn succeeded(h: &Harness<sqlx::Postgres>) -> i64 {
    <sqlx::Postgres as ConformanceDb>::count(
        &h.pool,
        "SELECT COUNT(*) FROM idempotency_records WHERE status = 'SUCCEEDED'",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_lost_during_commit_answers_503_and_the_retry_runs_once() {
    logs();
    let h = Harness::<sqlx::Postgres>::new().await;
    sqlx::raw_sql(
        "CREATE FUNCTION die_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.amount = 666 THEN PERFORM pg_terminate_backend(pg_backend_pid()); END IF;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER die_at_commit AFTER INSERT ON orders
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION die_at_commit();",
    )
    .execute(&h.pool)
    .await
    .unwrap();
    let app = h.app();
    let key = Some("commit-lost");
    let lost = send(&app, order(Some("user-42"), key, r#"{"amount":666}"#)).await;
    assert_eq!(
        lost.status,
        http::StatusCode::SERVICE_UNAVAILABLE,
        "{lost:?}"
    );
    assert_eq!(lost.problem(), "commit-unknown");
    assert!(lost.headers.contains_key("retry-after"));
    assert!(
        decided_by_xact_status("aborted"),
        "the server's transaction status decided:\n{}",
        warnings()
    );
    h.assert_nothing_stored().await;
    assert_eq!(h.executions(), 1);

    sqlx::raw_sql("DROP TRIGGER die_at_commit ON orders")
        .execute(&h.pool)
        .await
        .unwrap();
    let retry = send(&app, order(Some("user-42"), key, r#"{"amount":666}"#)).await;
    assert_eq!(retry.status, http::StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    let again = send(&app, order(Some("user-42"), key, r#"{"amount":666}"#)).await;
    assert!(again.replayed());
    assert_eq!(h.executions(), 2);
    assert_eq!(h.orders().await, 1);
    assert_eq!(succeeded(&h).await, 1);
}

/// The `COMMIT` lands, the acknowledgement never arrives: the handler's
/// answer, not a 503, and a retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_that_landed_unheard_answers_the_handlers_success() {
    logs();
    let (h, relay) = through_relay(Harness::<sqlx::Postgres>::new().await).await;
    let app = h.app();
    let key = Some("commit-unheard");
    let body = r#"{"amount":7}"#;
    relay.cut_next_commit(Cut::BeforeCommitAck);
    let first = send(&app, order(Some("user-42"), key, body)).await;
    assert!(!relay.cut_pending(), "the relay cut the COMMIT's answer");
    assert_eq!(first.status, http::StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    assert!(first.headers.contains_key("idempotency-key-expires"));
    assert!(
        decided_by_xact_status("committed"),
        "the server's transaction status decided:\n{}",
        warnings()
    );
    assert_eq!(h.orders().await, 1);
    assert_eq!(succeeded(&h).await, 1);

    let retry = send(&app, order(Some("user-42"), key, body)).await;
    assert_eq!(retry.status, http::StatusCode::CREATED, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(retry.json(), first.json());
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 1);
}

/// The connection is lost while the `COMMIT` still runs (a slow deferred
/// trigger): the ledger shows nothing yet, but the server says the
/// transaction is in progress, so the answer is a 409 to retry later, not
/// a 503 claiming nothing was committed. The commit then lands, and the
/// retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_still_running_answers_409_and_the_retry_replays() {
    logs();
    let (h, relay) = through_relay(Harness::<sqlx::Postgres>::new().await).await;
    sqlx::raw_sql(
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.amount = 777 THEN
                 RAISE NOTICE 'committing slowly';
                 PERFORM pg_sleep(6);
             END IF;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON orders
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();",
    )
    .execute(&h.pool)
    .await
    .unwrap();
    let app = h.app();
    let key = Some("commit-running");
    let body = r#"{"amount":777}"#;
    relay.cut_next_commit(Cut::AfterNotice);
    let first = send(&app, order(Some("user-42"), key, body)).await;
    assert!(!relay.cut_pending(), "the relay cut the COMMIT's answer");
    // Judged by order, not by the clock: the answer came while the COMMIT
    // still ran (its order is not visible yet; the trigger sleeps 6 s).
    assert_eq!(h.orders().await, 0, "answered while the COMMIT still ran");
    assert_eq!(first.status, http::StatusCode::CONFLICT, "{first:?}");
    assert_eq!(first.problem(), "in-flight");
    assert!(first.headers.contains_key("retry-after"));
    assert!(
        decided_by_xact_status("in progress"),
        "the server's transaction status decided:\n{}",
        warnings()
    );

    // The trigger wakes up and the commit completes on the server.
    let deadline = Instant::now() + Duration::from_secs(30);
    while h.orders().await == 0 {
        assert!(Instant::now() < deadline, "the commit never landed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(succeeded(&h).await, 1);
    let retry = send(&app, order(Some("user-42"), key, body)).await;
    assert_eq!(retry.status, http::StatusCode::CREATED, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(h.executions(), 1);
    assert_eq!(h.orders().await, 1);
}

/// Lease mode's final commit shares the check: the answer's `COMMIT` lands
/// unheard (after an earlier attempt committed phase 1 and failed at the
/// provider), the server's transaction status says committed, and the
/// client gets the success, once, with one charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_final_commit_that_landed_unheard_answers_the_success() {
    use tower_idempotency::lease::LeaseMode;
    use tower_idempotency::testkit::lease::{Fault, payment};
    logs();
    let (h, relay) = through_relay(Harness::<sqlx::Postgres>::new().await).await;
    let app = h
        .pay_app(
            LeaseMode::new(Duration::from_secs(30)).expect("a usable lease"),
            Duration::from_secs(2),
        )
        .await;
    // Phase 1 commits; the provider fails before charging; the lease ends.
    app.state.provider.fault(Fault::FailBefore);
    let failed = send(&app.router, payment("pay-unheard", r#"{"amount":5000}"#)).await;
    assert_eq!(
        failed.status,
        http::StatusCode::SERVICE_UNAVAILABLE,
        "{failed:?}"
    );
    // The retry resumes: no phase 1, the charge, then the final phase,
    // whose COMMIT is the next one on the wire.
    relay.cut_next_commit(Cut::BeforeCommitAck);
    let first = send(&app.router, payment("pay-unheard", r#"{"amount":5000}"#)).await;
    assert!(
        !relay.cut_pending(),
        "the relay cut the final COMMIT's answer"
    );
    assert_eq!(first.status, http::StatusCode::CREATED, "{first:?}");
    assert!(
        decided_by_xact_status("committed"),
        "the server's transaction status decided:\n{}",
        warnings()
    );
    assert_eq!(succeeded(&h).await, 1);
    assert_eq!(h.captured().await, 1);
    assert_eq!(app.state.provider.charges(), 1);
    let retry = send(&app.router, payment("pay-unheard", r#"{"amount":5000}"#)).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(app.state.provider.charges(), 1);
}
