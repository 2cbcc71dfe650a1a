//! PostgreSQL high availability the way production runs it: a three-node
//! Patroni cluster with etcd and HAProxy (`tests/patroni/cluster.py`), the
//! example order service on HAProxy's write port, and clients retrying
//! through [`IdempotentRetryLayer`] while the leader is taken away: its
//! PostgreSQL SIGKILLed, its Patroni agent SIGKILLed, a `patronictl
//! switchover`, its agent cut off from etcd. Each fault is one phase with
//! keys of its own, on one cluster. Judged by rows on the final leader:
//! one order per key, no order without its ledger row nor a ledger row
//! without its order, every retry replays the order that exists; with
//! `synchronous_mode: true` no answer a client was given is lost. Every
//! attempt a client sent is recorded, so what clients see during an
//! election (which answers, for how long) is printed for the docs.
//!
//! Each phase answers `PATRONI_KEYS` keys (default 12) before its fault
//! and as many after the new leader is elected (a longer run by hand sets
//! more); clients send new keys throughout.

#[path = "common/commit_hold.rs"]
mod commit_hold;
mod common;
#[path = "common/http.rs"]
mod http_call;
#[path = "common/orders.rs"]
mod orders;
#[path = "common/patroni.rs"]
#[allow(dead_code)]
mod patroni;
#[path = "common/payments.rs"]
mod payments;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use patroni::{Cluster, Replication};
use sqlx::PgPool;
use tower::retry::budget::TpsBudget;
use tower::util::BoxCloneSyncService;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::client::{
    IdempotentRetryLayer, IntentKey, RetryBody, RetryError, RetryReport,
};

const CLIENTS: usize = 4;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn keys_per_phase() -> usize {
    std::env::var("PATRONI_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12)
}

/// One attempt as it left the client and came back.
#[derive(Debug, Clone)]
struct Attempt {
    began: Instant,
    ended: Instant,
    /// `0`: no answer (the connection failed or the attempt timed out).
    status: u16,
    problem: String,
    retry_after: bool,
}

type Log = Arc<Mutex<Vec<Attempt>>>;

type Retrying =
    BoxCloneSyncService<http::Request<Full<Bytes>>, http::Response<RetryBody>, BoxError>;

/// The client stack: the retry layer over a recorder of every attempt
/// over hyper's client (each attempt bounded at 10 s).
fn client(log: Log) -> Retrying {
    let client: Client<HttpConnector, RetryBody> =
        Client::builder(TokioExecutor::new()).build_http();
    let recorder = tower::service_fn(move |req: http::Request<RetryBody>| {
        let (client, log) = (client.clone(), Arc::clone(&log));
        async move {
            let began = Instant::now();
            let answer = tokio::time::timeout(Duration::from_secs(10), async {
                let res = client.request(req).await?;
                let (parts, body) = res.into_parts();
                let body = body.collect().await?.to_bytes();
                Ok::<_, BoxError>(http::Response::from_parts(parts, body))
            })
            .await;
            let mut attempt = Attempt {
                began,
                ended: Instant::now(),
                status: 0,
                problem: String::new(),
                retry_after: false,
            };
            let result = match answer {
                Ok(Ok(res)) => {
                    attempt.status = res.status().as_u16();
                    attempt.retry_after = res.headers().contains_key(http::header::RETRY_AFTER);
                    attempt.problem = serde_json::from_slice::<serde_json::Value>(res.body())
                        .ok()
                        .and_then(|v| v["type"].as_str().map(str::to_string))
                        .unwrap_or_default();
                    Ok(res.map(Full::new))
                }
                Ok(Err(e)) => {
                    attempt.problem = "connection".into();
                    Err(e)
                }
                Err(_) => {
                    attempt.problem = "timeout".into();
                    Err(BoxError::from("the attempt timed out"))
                }
            };
            log.lock().unwrap().push(attempt);
            result
        }
    });
    let service = ServiceBuilder::new()
        .map_err(|e: RetryError| -> BoxError { Box::new(e) })
        .layer(
            IdempotentRetryLayer::new()
                .with_max_attempts(400)
                .with_deadline(Duration::from_secs(150))
                .with_backoff(Duration::from_millis(50), Duration::from_secs(1))
                // Outages here are the point: the budget must not end them.
                .with_budget(TpsBudget::new(Duration::from_secs(10), 10_000, 1000.0)),
        )
        .service(recorder);
    BoxCloneSyncService::new(service)
}

/// What the clients send: orders to the example order service, or
/// payments (lease mode) to the example payment service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Orders,
    Payments,
}

impl Route {
    fn path(self) -> &'static str {
        match self {
            Self::Orders => "/orders",
            Self::Payments => "/payments",
        }
    }

    fn body(self) -> &'static str {
        match self {
            Self::Orders => orders::ORDER,
            Self::Payments => payments::PAYMENT,
        }
    }

    /// The answer's field naming what was created.
    fn id(self) -> &'static str {
        match self {
            Self::Orders => "orderId",
            Self::Payments => "paymentId",
        }
    }

    /// The prefix of this route's keys.
    fn prefix(self) -> &'static str {
        match self {
            Self::Orders => "order",
            Self::Payments => "pay",
        }
    }
}

/// What one logical request ended with.
#[derive(Debug, Clone)]
struct Outcome {
    status: u16,
    /// The order's or payment's id.
    order_id: String,
    replayed: bool,
    error: String,
}

/// One order or payment (the common `ORDER` or `PAYMENT`, as `user-42`)
/// under `key`, retried by the layer.
async fn place(svc: &Retrying, addr: &str, route: Route, key: &str) -> Outcome {
    let mut req = http::Request::post(format!("http://{addr}{}", route.path()))
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(http::header::AUTHORIZATION, "Bearer user-42")
        .body(Full::new(Bytes::from_static(route.body().as_bytes())))
        .unwrap();
    req.extensions_mut()
        .insert(IntentKey::new(key).expect("a valid key"));
    match svc.clone().oneshot(req).await {
        Ok(res) => {
            let status = res.status().as_u16();
            let replayed = res
                .extensions()
                .get::<RetryReport>()
                .is_some_and(|r| r.replayed);
            let body = res.into_body().collect().await.map(|b| b.to_bytes());
            let json: serde_json::Value = body
                .as_ref()
                .ok()
                .and_then(|b| serde_json::from_slice(b).ok())
                .unwrap_or_default();
            Outcome {
                status,
                order_id: json[route.id()].as_str().unwrap_or_default().to_string(),
                replayed,
                error: body.err().map(|e| e.to_string()).unwrap_or_default(),
            }
        }
        Err(e) => Outcome {
            status: 0,
            order_id: String::new(),
            replayed: false,
            error: e.to_string(),
        },
    }
}

/// How the leader is taken away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// SIGKILL of the leader's PostgreSQL (its agent lives on).
    KillPostgres,
    /// SIGKILL of the leader's Patroni agent (its PostgreSQL runs on,
    /// unmanaged, until the agent comes back and demotes it).
    KillAgent,
    /// `patronictl switchover` to a replica (the synchronous standby).
    Switchover,
    /// The leader's agent cut off from etcd (it demotes itself).
    CutFromEtcd,
}

/// What one phase saw.
#[derive(Debug)]
#[allow(dead_code)] // Read through Debug.
struct PhaseReport {
    route: Route,
    fault: Fault,
    old_leader: String,
    new_leader: String,
    /// From the fault until Patroni reported another leader.
    election: Duration,
    /// The longest time without a `201` answered, around the fault: how
    /// long writes were unavailable to the clients.
    outage: Duration,
    /// Answers to attempts sent after the fault, by status and problem
    /// type (`0 connection`: no answer).
    answers: BTreeMap<String, usize>,
}

async fn phase(
    cluster: &Cluster,
    addr: &str,
    route: Route,
    fault: Fault,
    n: usize,
    keys: usize,
    outcomes: &Arc<Mutex<HashMap<String, Vec<Outcome>>>>,
) -> PhaseReport {
    let old = tokio::task::block_in_place(|| cluster.leader())
        .expect("a leader before the fault")
        .name;
    let log: Log = Arc::default();
    let svc = client(Arc::clone(&log));
    let next = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (svc, addr, next, answered, done, outcomes) = (
                svc.clone(),
                addr.to_string(),
                Arc::clone(&next),
                Arc::clone(&answered),
                Arc::clone(&done),
                Arc::clone(outcomes),
            );
            tokio::spawn(async move {
                // New keys, paced, until the phase has seen the election
                // through: a client stuck in one key's retries sends no
                // other.
                while !done.load(Ordering::SeqCst) {
                    let key = format!(
                        "{}{n}-k{}",
                        route.prefix(),
                        next.fetch_add(1, Ordering::SeqCst)
                    );
                    let outcome = place(&svc, &addr, route, &key).await;
                    outcomes
                        .lock()
                        .unwrap()
                        .entry(key)
                        .or_default()
                        .push(outcome);
                    answered.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        })
        .collect();
    // `keys` answers before the fault; the clients then meet it, and stop
    // once `keys` more were answered after the new leader was elected.
    let wait_for = |count: usize| {
        let answered = Arc::clone(&answered);
        async move {
            // A bound far from the work (a phase answers its keys in
            // seconds), so a broken service fails the test, not hangs it.
            let deadline = Instant::now() + Duration::from_secs(300);
            while answered.load(Ordering::SeqCst) < count {
                assert!(
                    Instant::now() < deadline,
                    "{fault:?}: {count} answers not reached in 300 s"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    wait_for(keys).await;
    let at = Instant::now();
    let new = tokio::task::block_in_place(|| {
        match fault {
            Fault::KillPostgres => cluster.kill_postgres(&old),
            Fault::KillAgent => cluster.kill_agent(&old),
            Fault::CutFromEtcd => cluster.cut(&old),
            Fault::Switchover => {
                let members = cluster.members();
                let to = members
                    .iter()
                    .find(|m| m.role == "sync_standby")
                    .or_else(|| members.iter().find(|m| m.role == "replica"))
                    .expect("a replica to switch over to");
                cluster.switchover(&old, &to.name);
            }
        }
        cluster.wait_new_leader(&old, Duration::from_secs(90))
    });
    let election = at.elapsed();
    wait_for(answered.load(Ordering::SeqCst) + keys).await;
    done.store(true, Ordering::SeqCst);
    for c in clients {
        c.await.unwrap();
    }
    tokio::task::block_in_place(|| {
        match fault {
            Fault::KillAgent => cluster.start_agent(&old),
            Fault::CutFromEtcd => cluster.heal(&old),
            Fault::KillPostgres | Fault::Switchover => {}
        }
        // The old leader rejoins as a replica (rewound where it diverged).
        cluster.wait_whole(Duration::from_secs(120));
    });
    let log = std::mem::take(&mut *log.lock().unwrap());
    let after: Vec<&Attempt> = log.iter().filter(|a| a.began >= at).collect();
    let mut written: Vec<Instant> = log
        .iter()
        .filter(|a| a.status == 201)
        .map(|a| a.ended)
        .collect();
    written.sort();
    let outage = written
        .windows(2)
        .filter(|w| w[1] >= at)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    let mut answers = BTreeMap::new();
    for a in &after {
        let label = format!(
            "{} {}{}",
            a.status,
            a.problem.rsplit(['#', '/']).next().unwrap_or_default(),
            if a.retry_after { " (Retry-After)" } else { "" }
        );
        *answers.entry(label).or_insert(0) += 1;
    }
    // Answers outside the contract: anything but a 201, a retryable
    // 503/409 with Retry-After, or no answer (the connection lost).
    let faults: Vec<&&Attempt> = after
        .iter()
        .filter(|a| {
            !(a.status == 201 || a.status == 0 || (matches!(a.status, 503 | 409) && a.retry_after))
        })
        .collect();
    assert!(
        faults.is_empty(),
        "{fault:?}: answers outside the contract: {faults:#?}"
    );
    PhaseReport {
        route,
        fault,
        old_leader: old,
        new_leader: new.name,
        election,
        outage,
        answers,
    }
}

/// Every key of `route` once more, after every fault: each must replay
/// what exists (its answer is added to the key's outcomes). With `lossy`
/// (asynchronous replication, whose failover may lose a commit whole) a
/// key may be answered by a new execution instead; [`judge`] then counts
/// the lost answer against the second order id.
async fn replay_all(
    addr: &str,
    route: Route,
    outcomes: &Arc<Mutex<HashMap<String, Vec<Outcome>>>>,
    lossy: bool,
) {
    let svc = client(Arc::default());
    let keys: Vec<String> = outcomes
        .lock()
        .unwrap()
        .keys()
        .filter(|k| k.starts_with(route.prefix()))
        .cloned()
        .collect();
    for key in &keys {
        let again = place(&svc, addr, route, key).await;
        assert!(
            again.status == 201 && (again.replayed || lossy),
            "{key}: the retry after the failovers is not a replay: {again:?}"
        );
        outcomes.lock().unwrap().get_mut(key).unwrap().push(again);
    }
}

/// What the final leader holds, against what the clients were told.
#[derive(Debug)]
#[allow(dead_code)] // Read through Debug.
struct Rows {
    keys: usize,
    orders: i64,
    unledgered: i64,
    orphaned: i64,
    /// Order ids a client was given that no longer exist.
    lost_answers: usize,
    /// Keys whose clients were given two different order ids.
    two_ids: usize,
}

async fn judge(
    cluster: &Cluster,
    addr: &str,
    outcomes: &Arc<Mutex<HashMap<String, Vec<Outcome>>>>,
    lossy: bool,
) -> Rows {
    replay_all(addr, Route::Orders, outcomes, lossy).await;
    let leader = tokio::task::block_in_place(|| cluster.leader()).expect("a final leader");
    let pool = PgPool::connect(&cluster.url(&leader.name)).await.unwrap();
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
         AND r.operation LIKE '%/orders' \
         AND NOT EXISTS (SELECT 1 FROM orders o WHERE o.id = r.resource_id)",
    )
    .await;
    let existing: HashSet<String> = sqlx::query_scalar("SELECT id FROM orders")
        .fetch_all(&pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    pool.close().await;
    let outcomes = outcomes.lock().unwrap();
    let (mut lost_answers, mut two_ids) = (0, 0);
    let orders_only = outcomes
        .iter()
        .filter(|(k, _)| k.starts_with(Route::Orders.prefix()));
    for (key, seen) in orders_only.clone() {
        for o in seen {
            assert_eq!((o.status, o.error.as_str()), (201, ""), "{key}: {seen:?}");
        }
        let distinct: HashSet<&String> = seen.iter().map(|o| &o.order_id).collect();
        two_ids += usize::from(distinct.len() > 1);
        lost_answers += distinct
            .iter()
            .filter(|id| !existing.contains(**id))
            .count();
        // The last answer is the replay after every failover: it exists.
        assert!(
            existing.contains(&seen.last().unwrap().order_id),
            "{key}: {seen:?}"
        );
    }
    Rows {
        keys: orders_only.count(),
        orders,
        unledgered,
        orphaned,
        lost_answers,
        two_ids,
    }
}

/// Every payment key charged once, captured once, one payment id per key
/// (on the final leader and at the provider, the ground truth); the number
/// of payments.
async fn judge_payments(
    cluster: &Cluster,
    addr: &str,
    provider: &payments::Provider,
    outcomes: &Arc<Mutex<HashMap<String, Vec<Outcome>>>>,
) -> usize {
    replay_all(addr, Route::Payments, outcomes, false).await;
    let leader = tokio::task::block_in_place(|| cluster.leader()).expect("a final leader");
    let pool = PgPool::connect(&cluster.url(&leader.name)).await.unwrap();
    let captured: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM payments WHERE status = 'captured'")
            .fetch_one(&pool)
            .await
            .unwrap();
    pool.close().await;
    let mut paid = 0;
    for (key, seen) in outcomes
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with(Route::Payments.prefix()))
    {
        paid += 1;
        let ids: HashSet<&String> = seen.iter().map(|o| &o.order_id).collect();
        assert_eq!(ids.len(), 1, "{key}: one payment id: {seen:?}");
    }
    assert_eq!(
        (provider.charges().await, captured),
        (paid, paid as i64),
        "one charge and one captured payment per payment key"
    );
    paid
}

async fn start_service(cluster: &Cluster) -> (tokio::process::Child, String) {
    let (service, addr) = common::order_service(&cluster.write_url(), 0, &[]).await;
    let put = http_call::http_call(
        &addr,
        http::Method::PUT,
        "/stock/A-10",
        None,
        None,
        r#"{"qty":1000000}"#,
    )
    .await;
    assert_eq!(put.status, http::StatusCode::OK, "{put:?}");
    (service, addr)
}

/// `synchronous_mode: true`: the leader's PostgreSQL SIGKILLed, its agent
/// SIGKILLed, a switchover and the leader cut off from etcd, one after
/// the other on one cluster; no answer a client was given is lost, and
/// no key runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn synchronous_mode_loses_no_answer_through_every_kind_of_failover() {
    let cluster = tokio::task::block_in_place(|| Cluster::start(Replication::Synchronous));
    let (_service, addr) = start_service(&cluster).await;
    let keys = keys_per_phase();
    let outcomes = Arc::default();
    let faults = [
        Fault::KillPostgres,
        Fault::KillAgent,
        Fault::Switchover,
        Fault::CutFromEtcd,
    ];
    for (n, fault) in faults.into_iter().enumerate() {
        let report = phase(&cluster, &addr, Route::Orders, fault, n, keys, &outcomes).await;
        eprintln!("patroni, synchronous_mode: {report:?}");
    }
    // Lease mode: the payment service on the same cluster, its leader's
    // PostgreSQL SIGKILLed under load (a lease of 3 s, so a claim whose
    // owner lost its connection is taken over soon).
    let provider = payments::Provider::start().await;
    let lease = ["--lease-ms", "3000", "--provider-timeout-ms", "5000"];
    let (_payments, pay_addr) =
        payments::payment_service(&cluster.write_url(), &provider, &lease).await;
    let report = phase(
        &cluster,
        &pay_addr,
        Route::Payments,
        Fault::KillPostgres,
        faults.len(),
        keys,
        &outcomes,
    )
    .await;
    eprintln!("patroni, synchronous_mode: {report:?}");
    let paid = judge_payments(&cluster, &pay_addr, &provider, &outcomes).await;
    eprintln!("patroni, synchronous_mode, payments: {paid} keys, {paid} charges");
    let rows = judge(&cluster, &addr, &outcomes, false).await;
    eprintln!("patroni, synchronous_mode, rows: {rows:?}");
    assert!(rows.keys >= 2 * keys * faults.len(), "{rows:?}");
    assert_eq!(
        (rows.orders, rows.unledgered, rows.orphaned),
        (rows.keys as i64, 0, 0),
        "{rows:?}"
    );
    assert_eq!((rows.lost_answers, rows.two_ids), (0, 0), "{rows:?}");
}

/// Asynchronous replication: the leader's PostgreSQL SIGKILLed under
/// load. What was lost is lost whole (an order never without its ledger
/// row), and each lost answer is a key later answered with a second
/// order id: counted, not forbidden.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn asynchronous_replication_keeps_orders_and_ledger_together() {
    let cluster = tokio::task::block_in_place(|| Cluster::start(Replication::Asynchronous));
    let (_service, addr) = start_service(&cluster).await;
    let keys = keys_per_phase();
    let outcomes = Arc::default();
    let report = phase(
        &cluster,
        &addr,
        Route::Orders,
        Fault::KillPostgres,
        0,
        keys,
        &outcomes,
    )
    .await;
    eprintln!("patroni, asynchronous: {report:?}");
    let rows = judge(&cluster, &addr, &outcomes, true).await;
    eprintln!("patroni, asynchronous, rows: {rows:?}");
    assert!(rows.keys >= 2 * keys, "{rows:?}");
    assert_eq!(
        (rows.orders, rows.unledgered, rows.orphaned),
        (rows.keys as i64, 0, 0),
        "{rows:?}"
    );
    assert_eq!(rows.lost_answers, rows.two_ids, "{rows:?}");
}

/// Points 3 and 4, asynchronous replication: the leader is cut off from
/// its replicas, answers an order (`201`, order A) and commits one more
/// transaction (id X), then its PostgreSQL is SIGKILLed and a replica that
/// never saw either is promoted.
///
/// - `txid_status(X)` on the new leader: X is from before the promotion
///   and was never replicated; printed before and after the new leader
///   hands out X itself, when it answers `committed` for a transaction
///   that is not the one the old leader committed (a transaction id does
///   not name a transaction across a failover).
/// - The client's retry finds no record and runs afresh (order B): the
///   answer A was lost, as asynchronous replication allows.
/// - The old leader comes back (Patroni rewinds it with pg_rewind) and is
///   made the leader again by a switchover: order A is gone from it, and
///   the key replays order B, never the stale A.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rewound_primary_never_replays_a_lost_answer() {
    let cluster = tokio::task::block_in_place(|| Cluster::start(Replication::Asynchronous));
    let (_service, addr) = start_service(&cluster).await;
    let svc = client(Arc::default());
    let old = tokio::task::block_in_place(|| {
        let old = cluster.wait_whole(Duration::from_secs(60)).name;
        cluster.wait_caught_up(&old);
        cluster.cut_replication(&old);
        old
    });
    let a = place(&svc, &addr, Route::Orders, "lost-1").await;
    assert_eq!((a.status, a.replayed), (201, false), "{a:?}");
    let (xid, before, after, new) = tokio::task::block_in_place(|| {
        let xid: i64 = cluster
            .query(&old, "SELECT txid_current()")
            .expect("a transaction on the old leader")
            .parse()
            .expect("a transaction id");
        cluster.kill_postgres(&old);
        let new = cluster.wait_new_leader(&old, Duration::from_secs(90)).name;
        // Wait until it takes transactions (a busy machine once asked in
        // between).
        cluster.wait_promoted(&new, Duration::from_secs(90));
        let status = format!("SELECT txid_status({xid})");
        let before = cluster.query(&new, &status);
        // The new leader hands out transaction ids from where its replay
        // stopped: soon X again.
        let mut handed = 0;
        for _ in 0..10_000 {
            handed = cluster
                .query(&new, "SELECT txid_current()")
                .expect("a transaction on the new leader")
                .parse::<i64>()
                .expect("a transaction id");
            if handed >= xid {
                break;
            }
        }
        assert!(handed >= xid, "the new leader never reached {xid}");
        (xid, before, cluster.query(&new, &status), new)
    });
    eprintln!(
        "patroni, txid_status({xid}) of the old leader on the new leader {new}: \
         before it hands out {xid}: {before:?}; after: {after:?}"
    );
    assert!(
        before.as_ref().is_err_and(|e| e.contains("in the future")),
        "before the new leader reaches {xid}: {before:?}"
    );
    assert_eq!(
        after.as_deref(),
        Ok("committed"),
        "the new leader's own transaction {xid}"
    );
    let b = place(&svc, &addr, Route::Orders, "lost-1").await;
    assert_eq!(
        (b.status, b.replayed),
        (201, false),
        "a fresh execution: {b:?}"
    );
    assert_ne!(
        a.order_id, b.order_id,
        "order A was never on the new leader"
    );
    let rewound = tokio::task::block_in_place(|| {
        cluster.heal_replication(&old);
        cluster.wait_whole(Duration::from_secs(120));
        cluster.wait_caught_up(&new);
        let on_old = |sql: String| cluster.query(&old, &sql).expect(&sql);
        let stale = on_old(format!(
            "SELECT count(*) FROM orders WHERE id = '{}'",
            a.order_id
        ));
        let ledger = on_old(
            "SELECT resource_id FROM idempotency_records WHERE idem_key = 'lost-1'".to_string(),
        );
        cluster.switchover(&new, &old);
        assert_eq!(
            cluster.wait_new_leader(&new, Duration::from_secs(60)).name,
            old
        );
        (stale, ledger)
    });
    assert_eq!(
        rewound,
        ("0".to_string(), b.order_id.clone()),
        "the rewound node holds order B's ledger row, and no order A"
    );
    let log = std::fs::read_to_string(cluster.dir().join(&old).join("patroni.log")).unwrap();
    assert!(log.contains("pg_rewind"), "{old} came back by pg_rewind");
    let c = place(&svc, &addr, Route::Orders, "lost-1").await;
    assert_eq!(
        (c.status, c.replayed, c.order_id.as_str()),
        (201, true, b.order_id.as_str()),
        "the old leader, leading again, replays order B: {c:?}"
    );
}

/// A write port that reaches a read-only server (as during a demotion,
/// before HAProxy's check marks the old leader down): here the leader
/// made read-only by default (`default_transaction_read_only`, SQLSTATE
/// `25006` on the first write, as a hot standby answers). The answer must
/// be a retryable `503` with `Retry-After`, nothing executed; once
/// writable again, the same key runs once.
///
/// The claim writes nothing before the handler, whose first `INSERT`
/// meets `25006`: `Backend::error_kind` sorts it as
/// `StoreErrorKind::Busy` (it once was `Other`, answered `500`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_only_leader_is_answered_503_not_500() {
    let cluster = tokio::task::block_in_place(|| Cluster::start(Replication::Asynchronous));
    let (_service, addr) = start_service(&cluster).await;
    let first = place(&client(Arc::default()), &addr, Route::Orders, "writable-1").await;
    assert_eq!(first.status, 201, "{first:?}");
    let leader = tokio::task::block_in_place(|| cluster.leader())
        .expect("a leader")
        .name;
    // `pg_reload_conf()` only signals the postmaster, which re-reads the
    // file and then signals every backend: a new session that shows the
    // value proves the postmaster has, so the service's pooled backends
    // take it before their next command.
    let set = |value: &str| {
        let sql = format!("ALTER SYSTEM SET default_transaction_read_only = {value}");
        tokio::task::block_in_place(|| {
            cluster.query(&leader, &sql).expect("ALTER SYSTEM");
            cluster
                .query(&leader, "SELECT pg_reload_conf()")
                .expect("reload");
            let deadline = Instant::now() + Duration::from_secs(10);
            while cluster
                .query(&leader, "SHOW default_transaction_read_only")
                .as_deref()
                != Ok(value)
            {
                assert!(
                    Instant::now() < deadline,
                    "default_transaction_read_only never became {value}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        });
    };
    set("on");
    // One attempt, without the retry layer: its answer as sent.
    let read_only = orders::order(&addr, "read-only-1")
        .await
        .expect("an answer");
    set("off");
    eprintln!(
        "patroni, a read-only leader: {} {}",
        read_only.status,
        read_only.problem_type()
    );
    assert_eq!(
        read_only.status,
        http::StatusCode::SERVICE_UNAVAILABLE,
        "{read_only:?}"
    );
    assert!(read_only.headers.contains_key(http::header::RETRY_AFTER));
    let svc = client(Arc::default());
    let orders_before = 1;
    let written = place(&svc, &addr, Route::Orders, "read-only-1").await;
    assert_eq!(
        (written.status, written.replayed),
        (201, false),
        "{written:?}"
    );
    let pool = PgPool::connect(&cluster.url(&leader)).await.unwrap();
    let orders: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    assert_eq!(orders, orders_before + 1, "the key ran once");
}

/// Point 3, end to end: a `COMMIT` that landed on the old leader (cut off
/// from its replicas, asynchronous replication) and whose answer is lost
/// late, after a failover, as a partition without a reset loses it (a
/// relay between the service and HAProxy holds the answer back, then
/// closes the connection). By then the new leader, which never received
/// the claim's transaction X, has handed out X itself and committed it.
/// The layer asks `txid_status(X)` through the write port, now the new
/// leader: the answer must not be the claim's `201` for an order that the
/// new leader does not have (a retryable `503 #commit-unknown` is right:
/// the retry then runs the key on the new leader).
///
/// The layer once took the new leader's `committed` (its own, different
/// transaction X) for the claim's commit and answered `201` with an order
/// that does not exist; its retry then got a second order id. It now
/// trusts "committed" only when the row the claim wrote is on the server
/// asked (`src/store/postgres.rs`, `lost_commit`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_lost_across_a_failover_is_never_confirmed_by_another_transaction() {
    let cluster = tokio::task::block_in_place(|| Cluster::start(Replication::Asynchronous));
    let relay = commit_hold::CommitHold::start(cluster.write_addr()).await;
    let (_service, addr) = common::order_service(&relay.url("test"), 0, &[]).await;
    let put = http_call::http_call(
        &addr,
        http::Method::PUT,
        "/stock/A-10",
        None,
        None,
        r#"{"qty":1000000}"#,
    )
    .await;
    assert_eq!(put.status, http::StatusCode::OK, "{put:?}");
    let old = tokio::task::block_in_place(|| {
        let old = cluster.wait_whole(Duration::from_secs(60)).name;
        cluster.wait_caught_up(&old);
        cluster.cut_replication(&old);
        old
    });
    relay.hold_next_commit();
    let first = {
        let addr = addr.clone();
        tokio::spawn(async move { orders::order(&addr, "xid-1").await })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !relay.holding() {
        assert!(Instant::now() < deadline, "no COMMIT answer held in 60 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (xid, new) = tokio::task::block_in_place(|| {
        // The claim's transaction, committed on the old leader only.
        let xid: i64 = cluster
            .query(
                &old,
                "SELECT xmin::text::bigint FROM idempotency_records WHERE idem_key = 'xid-1'",
            )
            .expect("the claim's row on the old leader")
            .parse()
            .expect("a transaction id");
        cluster.kill_postgres(&old);
        let new = cluster.wait_new_leader(&old, Duration::from_secs(90)).name;
        // Asked before its promotion ended, it once refused (`cannot
        // execute pg_current_xact_id() during recovery`).
        cluster.wait_promoted(&new, Duration::from_secs(90));
        let mut handed = 0;
        for _ in 0..10_000 {
            handed = cluster
                .query(&new, "SELECT txid_current()")
                .expect("a transaction on the new leader")
                .parse::<i64>()
                .expect("a transaction id");
            if handed >= xid {
                break;
            }
        }
        assert!(handed >= xid, "the new leader never reached {xid}");
        // The answer is lost late: once the write port reaches the new
        // leader.
        cluster.wait_writable(Duration::from_secs(60));
        (xid, new)
    });
    relay.release();
    let first = first.await.unwrap().expect("an answer");
    let pool = PgPool::connect(&cluster.url(&new)).await.unwrap();
    let order_id = first.json()["orderId"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let exists: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE id = $1")
        .bind(&order_id)
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    let status =
        tokio::task::block_in_place(|| cluster.query(&new, &format!("SELECT txid_status({xid})")));
    eprintln!(
        "patroni, a COMMIT (transaction {xid}) lost across a failover, answered after the \
         new leader {new} committed its own {xid} (txid_status there: {status:?}): {} {} {} \
         (order {order_id:?} on the new leader: {exists})",
        first.status,
        first.problem_type(),
        first.json()["detail"],
    );
    assert!(
        first.status != http::StatusCode::CREATED || exists == 1,
        "answered 201 for order {order_id}, which the new leader never had: {first:?}"
    );
}
