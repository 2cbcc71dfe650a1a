//! PostgreSQL failover: the example order service, connected through a
//! relay, under load from clients that retry with the same key; the
//! primary is SIGKILLed mid-load, the standby promoted, and the relay
//! re-pointed to it (`tests/common/pg_pair.rs` makes both servers). Run
//! with synchronous and with asynchronous replication, and judged on the
//! promoted standby's rows: one order per key, no order without its ledger
//! row nor a ledger row without its order, every key's retry replays the
//! order that exists, and (synchronous) no answer a client was given is
//! lost; asynchronous replication's losses are counted.

mod common;
#[path = "common/http.rs"]
mod http_call;
#[path = "common/orders.rs"]
mod orders;
#[path = "common/payments.rs"]
mod payments;
#[path = "common/pg_pair.rs"]
mod pg_pair;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use orders::order;
use payments::{Provider, pay, payment_service};
use pg_pair::{Pair, Relay, Replication};
use sqlx::PgPool;

const KEYS: usize = 240;
const CLIENTS: usize = 6;

/// What the clients saw.
#[derive(Default)]
struct Seen {
    /// Every `201`'s order id, by key.
    answers: HashMap<String, Vec<String>>,
    /// Answers outside the contract (not `201`, not a retryable
    /// `503`/`409` with `Retry-After`, not a lost connection).
    faults: Vec<String>,
    retries: usize,
}

/// Sends `key` until it gets `201` (at most 60 s).
async fn settle(addr: &str, key: &str, seen: &std::sync::Mutex<Seen>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match order(addr, key).await {
            Ok(a) if a.status == StatusCode::CREATED => {
                let id = a.json()["orderId"].as_str().unwrap_or_default().to_string();
                let mut seen = seen.lock().unwrap();
                seen.answers.entry(key.to_string()).or_default().push(id);
                return;
            }
            Ok(a)
                if matches!(
                    a.status,
                    StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT
                ) && a.headers.contains_key(http::header::RETRY_AFTER) => {}
            Ok(a) => {
                let mut seen = seen.lock().unwrap();
                seen.faults
                    .push(format!("{key}: {} {}", a.status, a.problem_type()));
            }
            // The service is up throughout; a connection error is the
            // answer lost on its way (never here, but allowed).
            Err(_) => {}
        }
        seen.lock().unwrap().retries += 1;
        if Instant::now() > deadline {
            seen.lock()
                .unwrap()
                .faults
                .push(format!("{key}: no 201 in 60 s"));
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What a failover left.
#[derive(Debug)]
#[allow(dead_code)] // Read through Debug.
struct Report {
    keys: usize,
    orders: i64,
    unledgered: i64,
    orphaned: i64,
    /// `201` answers whose order no longer exists.
    lost_answers: usize,
    /// Keys whose clients were told two different order ids.
    two_ids: usize,
    retries: usize,
    took: Duration,
}

async fn failover(replication: Replication) -> Report {
    let started = Instant::now();
    let mut pair = tokio::task::block_in_place(|| Pair::start(replication));
    let relay = Relay::start(pair.addr(0)).await;
    let (_service, addr) = common::order_service(&relay.url(), 0, &[]).await;
    let put = http_call::http_call(
        &addr,
        Method::PUT,
        "/stock/A-10",
        None,
        None,
        r#"{"qty":1000000}"#,
    )
    .await;
    assert_eq!(put.status, StatusCode::OK, "{put:?}");

    let seen = Arc::new(std::sync::Mutex::new(Seen::default()));
    let next = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (addr, seen, next) = (addr.clone(), Arc::clone(&seen), Arc::clone(&next));
            tokio::spawn(async move {
                loop {
                    let k = next.fetch_add(1, Ordering::SeqCst);
                    if k >= KEYS {
                        return;
                    }
                    settle(&addr, &format!("k-{k}"), &seen).await;
                }
            })
        })
        .collect();
    // A third of the way in, the standby is cut off; the primary dies two
    // thirds of the way in (or after 300 ms, since synchronous commits
    // now wait), with requests in flight.
    let answered = || seen.lock().unwrap().answers.len();
    while answered() < KEYS / 3 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    pair.partition();
    let cut = Instant::now();
    while answered() < 2 * KEYS / 3 && cut.elapsed() < Duration::from_millis(300) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::task::block_in_place(|| {
        pair.kill_primary();
        pair.promote_standby();
    });
    relay.repoint(pair.addr(1));
    for c in clients {
        c.await.unwrap();
    }
    // Every key once more: it replays the order that exists.
    for k in 0..KEYS {
        settle(&addr, &format!("k-{k}"), &seen).await;
    }

    let pool = PgPool::connect(&pair.url(1)).await.unwrap();
    let one = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let orders = one("SELECT COUNT(*) FROM orders").await;
    let unledgered = one("SELECT COUNT(*) FROM orders o WHERE NOT EXISTS \
         (SELECT 1 FROM idempotency_records r WHERE r.resource_id = o.id)")
    .await;
    let orphaned = one(
        "SELECT COUNT(*) FROM idempotency_records r WHERE r.status = 'SUCCEEDED' \
         AND NOT EXISTS (SELECT 1 FROM orders o WHERE o.id = r.resource_id)",
    )
    .await;
    let existing: HashSet<String> = sqlx::query_scalar("SELECT id FROM orders")
        .fetch_all(&pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert!(seen.faults.is_empty(), "{:#?}", seen.faults);
    let mut lost_answers = 0;
    let mut two_ids = 0;
    for ids in seen.answers.values() {
        let distinct: HashSet<&String> = ids.iter().collect();
        two_ids += usize::from(distinct.len() > 1);
        lost_answers += distinct
            .iter()
            .filter(|id| !existing.contains(**id))
            .count();
        // The last answer is the replay after the failover: it exists.
        assert!(existing.contains(ids.last().unwrap()), "{ids:?}");
    }
    pool.close().await;
    Report {
        keys: seen.answers.len(),
        orders,
        unledgered,
        orphaned,
        lost_answers,
        two_ids,
        retries: seen.retries,
        took: started.elapsed(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn synchronous_replication_loses_no_answer() {
    let r = failover(Replication::Synchronous).await;
    eprintln!("failover, synchronous replication: {r:?}");
    assert_eq!(r.keys, KEYS);
    assert_eq!(
        (r.orders, r.unledgered, r.orphaned),
        (KEYS as i64, 0, 0),
        "{r:?}"
    );
    assert_eq!((r.lost_answers, r.two_ids), (0, 0), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn asynchronous_replication_keeps_orders_and_ledger_together() {
    let r = failover(Replication::Asynchronous).await;
    eprintln!("failover, asynchronous replication: {r:?}");
    assert_eq!(r.keys, KEYS);
    // What was lost was lost whole: one order per key, each with its row.
    assert_eq!(
        (r.orders, r.unledgered, r.orphaned),
        (KEYS as i64, 0, 0),
        "{r:?}"
    );
    // Each lost answer is a key whose clients then saw a second order id.
    assert_eq!(r.lost_answers, r.two_ids, "{r:?}");
}

/// Lease mode through a failover with asynchronous replication: the
/// standby is cut off, then the example payment service claims a payment
/// and the provider charges it (and holds its answer); the primary dies
/// and the standby, which never saw the claim nor the pending payment, is
/// promoted. The client's retry finds no record and makes a new claim,
/// whose step key is the lost claim's: the provider answers with the first
/// charge. One charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_payment_claim_lost_in_a_failover_is_charged_once() {
    let mut pair = tokio::task::block_in_place(|| Pair::start(Replication::Asynchronous));
    let relay = Relay::start(pair.addr(0)).await;
    let provider = Provider::start().await;
    let args = ["--provider-timeout-ms", "5000"];
    let (_service, addr) = payment_service(&relay.url(), &provider, &args).await;
    provider.charge_then_hang(3000).await;
    // The service's schema (created at its start) is on the standby
    // before it is cut off; what follows never reaches it.
    tokio::task::block_in_place(|| pair.wait_caught_up());
    pair.partition();
    let first = {
        let addr = addr.clone();
        tokio::spawn(async move { pay(&addr, "pay-1").await })
    };
    provider.wait_for_a_charge().await;
    tokio::task::block_in_place(|| {
        pair.kill_primary();
        pair.promote_standby();
    });
    relay.repoint(pair.addr(1));
    let first = first.await.unwrap();
    assert!(
        first
            .as_ref()
            .map_or(true, |a| a.status != StatusCode::CREATED),
        "the first attempt cannot have recorded: {first:?}"
    );
    let pool = PgPool::connect(&pair.url(1)).await.unwrap();
    let lost: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_records")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(lost, 0, "the promoted standby never saw the claim");
    let deadline = Instant::now() + Duration::from_secs(30);
    let answer = loop {
        match pay(&addr, "pay-1").await {
            Ok(a) if a.status == StatusCode::CREATED => break a,
            Ok(a) => assert!(
                matches!(
                    a.status,
                    StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT
                ),
                "{a:?}"
            ),
            Err(_) => {}
        }
        assert!(Instant::now() < deadline, "the retry never answered 201");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        provider.charges().await,
        1,
        "one charge for one payment key"
    );
    let captured: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM payments WHERE status = 'captured'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(captured, 1);
    eprintln!(
        "failover, lease mode, asynchronous replication: claim lost, {} charge, answer {}",
        provider.charges().await,
        answer.status
    );
    pool.close().await;
}
