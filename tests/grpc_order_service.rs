//! End-to-end: `examples/grpc_order_service.rs` as a real process, called
//! by a real tonic client over HTTP/2 (and by a raw HTTP/2 client where the
//! trailers themselves are compared), judged by the rows in its database.

mod common;

#[path = "../proto/orders.rs"]
#[allow(dead_code)]
mod orders;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use orders::{CreateOrderRequest, GetStockRequest, Item, Order, SetStockRequest, Stock};
use prost::Message;
use sqlx::Pool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Child;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower_idempotency::client::{IdempotentRetryLayer, RetryReport};
use tower_idempotency::testkit::{Cleanup, ConformanceDb as TestDb};

/// The service on its own database.
struct Service<DB: TestDb> {
    url: String,
    addr: String,
    _child: Child,
    pool: Pool<DB>,
    _drop: Cleanup,
}

impl<DB: TestDb> Service<DB> {
    async fn start(delay_ms: u64) -> Self {
        let (url, drop) = DB::fresh_url().await;
        let delay = delay_ms.to_string();
        let (child, addr) = common::start_example(
            "grpc_order_service",
            &["--addr", "127.0.0.1:0", "--handler-delay-ms", &delay],
            &[("DATABASE_URL", &url)],
        )
        .await;
        let pool = sqlx::pool::PoolOptions::<DB>::new()
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap();
        Self {
            url,
            addr,
            _child: child,
            pool,
            _drop: drop,
        }
    }

    async fn orders(&self) -> i64 {
        DB::count(&self.pool, "SELECT COUNT(*) FROM grpc_orders").await
    }

    async fn ledger(&self) -> i64 {
        DB::count(&self.pool, "SELECT COUNT(*) FROM idempotency_records").await
    }

    fn channel(&self) -> Channel {
        endpoint(&self.addr).connect_lazy()
    }
}

fn endpoint(addr: &str) -> Endpoint {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(20))
}

fn order(sku: &str, qty: i64) -> CreateOrderRequest {
    CreateOrderRequest {
        currency: "KRW".into(),
        items: vec![Item {
            sku: sku.into(),
            qty,
        }],
        amount: 12_000,
    }
}

/// One unary call on any tonic transport, with metadata.
async fn call<T, Req, Res>(
    transport: T,
    path: &'static str,
    message: Req,
    metadata: &[(&'static str, &str)],
) -> Result<tonic::Response<Res>, Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    T::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    Req: Message + Send + Sync + 'static,
    Res: Message + Default + Send + Sync + 'static,
{
    let mut grpc = tonic::client::Grpc::new(transport);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.into().to_string()))?;
    let mut request = tonic::Request::new(message);
    for (k, v) in metadata {
        request.metadata_mut().insert(*k, v.parse().unwrap());
    }
    grpc.unary(
        request,
        http::uri::PathAndQuery::from_static(path),
        ProstCodec::default(),
    )
    .await
}

async fn create(
    channel: Channel,
    key: &str,
    who: &str,
    req: CreateOrderRequest,
) -> Result<tonic::Response<Order>, Status> {
    let bearer = format!("Bearer {who}");
    call(
        channel,
        orders::CREATE_ORDER,
        req,
        &[("idempotency-key", key), ("authorization", &bearer)],
    )
    .await
}

async fn set_stock(channel: Channel, sku: &str, qty: i64) {
    let stock: tonic::Response<Stock> = call(
        channel,
        orders::SET_STOCK,
        SetStockRequest {
            sku: sku.into(),
            qty,
        },
        &[],
    )
    .await
    .unwrap();
    assert_eq!(stock.get_ref().qty, qty);
}

async fn stock(channel: Channel, sku: &str) -> i64 {
    let stock: tonic::Response<Stock> = call(
        channel,
        orders::GET_STOCK,
        GetStockRequest { sku: sku.into() },
        &[],
    )
    .await
    .unwrap();
    stock.get_ref().qty
}

fn replayed<T>(res: &tonic::Response<T>) -> bool {
    res.metadata()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// A raw HTTP/2 gRPC call: the answer's status, headers and trailers as
/// sent, and the message bytes.
struct Raw {
    headers: http::HeaderMap,
    trailers: Option<http::HeaderMap>,
    body: Bytes,
}

async fn raw(addr: &str, path: &str, message: &impl Message, metadata: &[(&str, &str)]) -> Raw {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let encoded = message.encode_to_vec();
    let mut framed = BytesMut::with_capacity(5 + encoded.len());
    framed.put_u8(0);
    framed.put_u32(encoded.len() as u32);
    framed.put_slice(&encoded);
    let mut req = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (k, v) in metadata {
        req = req.header(*k, *v);
    }
    let res = sender
        .send_request(req.body(Full::new(framed.freeze())).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), http::StatusCode::OK);
    let (parts, body) = res.into_parts();
    let collected = tokio::time::timeout(Duration::from_secs(20), body.collect())
        .await
        .unwrap()
        .unwrap();
    let trailers = collected.trailers().cloned();
    Raw {
        headers: parts.headers,
        trailers,
        body: collected.to_bytes(),
    }
}

/// What gRPC status an answer carries: in its trailers, or in its headers
/// for a trailers-only answer.
fn grpc_status(raw: &Raw) -> String {
    raw.trailers
        .as_ref()
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| raw.headers.get("grpc-status"))
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
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
    };
}

e2e!(
    concurrent_duplicates_make_one_order,
    a_replay_has_identical_trailers_and_the_replay_marker,
    a_short_stock_answer_is_recorded_and_replayed_with_its_details,
    key_reuse_and_expiry_are_failed_precondition_with_their_reasons,
    an_in_flight_duplicate_gets_unavailable_with_pushback_within_its_timeout,
    short_deadlines_get_unavailable_with_pushback_never_cancelled,
    unguarded_methods_and_bad_metadata,
    a_retrying_client_through_a_lossy_proxy_makes_each_order_once,
);

async fn concurrent_duplicates_make_one_order<DB: TestDb>() {
    let svc = Service::<DB>::start(300).await;
    set_stock(svc.channel(), "A-10", 100).await;
    let calls = (0..12).map(|_| {
        let channel = svc.channel();
        tokio::spawn(async move { create(channel, "\"dup-1\"", "alice", order("A-10", 2)).await })
    });
    let mut ids = std::collections::BTreeSet::new();
    let mut refused = 0;
    for call in calls {
        match call.await.unwrap() {
            Ok(res) => {
                ids.insert(res.into_inner().order_id);
            }
            // A duplicate that waited its whole bound: retryable.
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable, "{status:?}");
                refused += 1;
            }
        }
    }
    assert_eq!(ids.len(), 1, "one order id for every answer: {ids:?}");
    assert!(refused < 12);
    assert_eq!(svc.orders().await, 1);
    assert_eq!(svc.ledger().await, 1);
    assert_eq!(stock(svc.channel(), "A-10").await, 98);
}

async fn a_replay_has_identical_trailers_and_the_replay_marker<DB: TestDb>() {
    let svc = Service::<DB>::start(0).await;
    set_stock(svc.channel(), "A-10", 10).await;
    let meta = [
        ("idempotency-key", "\"raw-1\""),
        ("authorization", "Bearer alice"),
    ];
    let first = raw(&svc.addr, orders::CREATE_ORDER, &order("A-10", 1), &meta).await;
    let again = raw(&svc.addr, orders::CREATE_ORDER, &order("A-10", 1), &meta).await;
    assert_eq!(grpc_status(&first), "0");
    assert!(
        first.trailers.is_some(),
        "a message answer ends in trailers"
    );
    assert_eq!(first.trailers, again.trailers, "trailers replayed as sent");
    assert_eq!(first.body, again.body, "the message replayed byte for byte");
    assert!(first.headers.get("idempotent-replayed").is_none());
    assert_eq!(
        again
            .headers
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true")
    );
    assert_eq!(svc.orders().await, 1);
    // The tonic client reads the same order and the marker.
    let res = create(svc.channel(), "\"raw-1\"", "alice", order("A-10", 1))
        .await
        .unwrap();
    assert!(replayed(&res));
    let sent = Order::decode(&first.body[5..]).unwrap();
    assert_eq!(res.into_inner(), sent);
    assert_eq!(stock(svc.channel(), "A-10").await, 9);
}

async fn a_short_stock_answer_is_recorded_and_replayed_with_its_details<DB: TestDb>() {
    let svc = Service::<DB>::start(0).await;
    set_stock(svc.channel(), "A-10", 1).await;
    let first = create(svc.channel(), "\"short-1\"", "alice", order("A-10", 5))
        .await
        .unwrap_err();
    assert_eq!(first.code(), Code::FailedPrecondition, "{first:?}");
    // Stock is put back to more than enough: the key still answers what
    // its first attempt answered, and nothing was ordered.
    set_stock(svc.channel(), "A-10", 100).await;
    let again = create(svc.channel(), "\"short-1\"", "alice", order("A-10", 5))
        .await
        .unwrap_err();
    assert_eq!(again.code(), first.code());
    assert_eq!(again.message(), first.message());
    assert_eq!(again.details(), first.details());
    // Trailers-only, its custom metadata comes back too.
    assert_eq!(
        first
            .metadata()
            .get("x-reason")
            .map(|v| v.to_str().unwrap()),
        Some("stock")
    );
    assert_eq!(
        again.metadata().get("x-reason"),
        first.metadata().get("x-reason")
    );
    assert_eq!(
        again
            .metadata()
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true")
    );
    assert_eq!(svc.orders().await, 0);
    assert_eq!(svc.ledger().await, 1, "the final answer is recorded");
    assert_eq!(stock(svc.channel(), "A-10").await, 100);
}

fn reason(status: &Status) -> String {
    String::from_utf8_lossy(status.details()).into_owned()
}

async fn key_reuse_and_expiry_are_failed_precondition_with_their_reasons<DB: TestDb>() {
    let svc = Service::<DB>::start(0).await;
    set_stock(svc.channel(), "A-10", 10).await;
    create(svc.channel(), "\"reuse-1\"", "alice", order("A-10", 1))
        .await
        .unwrap();
    let reused = create(svc.channel(), "\"reuse-1\"", "alice", order("A-10", 2))
        .await
        .unwrap_err();
    assert_eq!(reused.code(), Code::FailedPrecondition, "{reused:?}");
    assert!(
        reason(&reused).contains("IDEMPOTENCY_KEY_REUSED"),
        "{reused:?}"
    );
    // Another principal's same key is another operation.
    create(svc.channel(), "\"reuse-1\"", "bob", order("A-10", 2))
        .await
        .unwrap();
    assert_eq!(svc.orders().await, 2);
    // Past its expiry, the key is refused, never run again.
    DB::exec(&svc.pool, "UPDATE idempotency_records SET expires_at = 0").await;
    let expired = create(svc.channel(), "\"reuse-1\"", "alice", order("A-10", 1))
        .await
        .unwrap_err();
    assert_eq!(expired.code(), Code::FailedPrecondition, "{expired:?}");
    assert!(
        reason(&expired).contains("IDEMPOTENCY_KEY_EXPIRED"),
        "{expired:?}"
    );
    assert_eq!(svc.orders().await, 2);
    assert_eq!(stock(svc.channel(), "A-10").await, 7);
}

async fn an_in_flight_duplicate_gets_unavailable_with_pushback_within_its_timeout<DB: TestDb>() {
    let svc = Service::<DB>::start(3_000).await;
    set_stock(svc.channel(), "A-10", 10).await;
    let first = {
        let channel = svc.channel();
        tokio::spawn(async move { create(channel, "\"slow-1\"", "alice", order("A-10", 1)).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let meta = [
        ("idempotency-key", "\"slow-1\""),
        ("authorization", "Bearer alice"),
        ("grpc-timeout", "400m"),
    ];
    let started = std::time::Instant::now();
    let dup = raw(&svc.addr, orders::CREATE_ORDER, &order("A-10", 1), &meta).await;
    let took = started.elapsed();
    assert_eq!(grpc_status(&dup), "14", "{:?}", dup.headers);
    let pushback: u64 = dup.headers["grpc-retry-pushback-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(pushback > 0);
    assert!(
        took < Duration::from_millis(2_500),
        "answered within its deadline: {took:?}"
    );
    let first = first.await.unwrap().unwrap();
    let again = create(svc.channel(), "\"slow-1\"", "alice", order("A-10", 1))
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(again.into_inner(), first.into_inner());
    assert_eq!(svc.orders().await, 1);
}

/// A caller's deadline bounds everything the layer does for it: an
/// in-flight duplicate with a 60 ms or 150 ms `grpc-timeout`, on this
/// instance (the layer's own wait) or on another one (the store's lock and
/// reads), gets `UNAVAILABLE` with a pushback from the layer, never tonic's
/// own `CANCELLED` at the deadline; a deadline too short for any read (1 ms)
/// is answered at once, and runs nothing. Judged by tonic's status, then
/// by the orders committed.
async fn short_deadlines_get_unavailable_with_pushback_never_cancelled<DB: TestDb>() {
    // The first request's handler runs for 6 s: every duplicate below is
    // sent while it is in flight, even with many tries.
    let svc = Service::<DB>::start(6_000).await;
    // A second instance of the service on the same database.
    let (_other, other_addr) = common::start_example(
        "grpc_order_service",
        &["--addr", "127.0.0.1:0", "--handler-delay-ms", "3000"],
        &[("DATABASE_URL", &svc.url)],
    )
    .await;
    let other = endpoint(&other_addr).connect_lazy();
    set_stock(svc.channel(), "A-10", 10).await;
    let first = {
        let channel = svc.channel();
        tokio::spawn(async move { create(channel, "\"short-1\"", "alice", order("A-10", 1)).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let with_deadline = |channel: Channel, key: &'static str, timeout: &'static str| async move {
        call::<_, _, Order>(
            channel,
            orders::CREATE_ORDER,
            order("A-10", 1),
            &[
                ("idempotency-key", key),
                ("authorization", "Bearer alice"),
                ("grpc-timeout", timeout),
            ],
        )
        .await
    };
    // A machine this busy may delay the layer's answer past a client's
    // 60 ms: tonic then cancels at the deadline, whatever the layer does.
    // A layer that answers within the deadline does so on one of a few
    // tries (many for a 1 ms deadline, which a loaded machine's scheduling
    // alone often exceeds); one that waits past it (the 250 ms floor it
    // once had) never does.
    let tries = |timeout: &str| if timeout == "1m" { 100 } else { 5 };
    for (instance, channel) in [("same", svc.channel()), ("other", other.clone())] {
        for timeout in ["60m", "150m", "1m"] {
            let mut status = with_deadline(channel.clone(), "\"short-1\"", timeout)
                .await
                .unwrap_err();
            for _ in 1..tries(timeout) {
                if status.code() != Code::Cancelled {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
                status = with_deadline(channel.clone(), "\"short-1\"", timeout)
                    .await
                    .unwrap_err();
            }
            assert_eq!(
                status.code(),
                Code::Unavailable,
                "{instance} instance, grpc-timeout {timeout}: {status:?}"
            );
            assert!(
                status.metadata().get("grpc-retry-pushback-ms").is_some(),
                "{instance} instance, grpc-timeout {timeout}: {status:?}"
            );
        }
    }
    // A new key with a deadline too short for any read: answered at once,
    // nothing ran.
    let mut status = with_deadline(other.clone(), "\"short-2\"", "1m")
        .await
        .unwrap_err();
    for _ in 1..tries("1m") {
        if status.code() != Code::Cancelled {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        status = with_deadline(other.clone(), "\"short-2\"", "1m")
            .await
            .unwrap_err();
    }
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let first = first.await.unwrap().unwrap();
    let again = create(svc.channel(), "\"short-1\"", "alice", order("A-10", 1))
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(again.into_inner(), first.into_inner());
    assert_eq!(svc.orders().await, 1);
    assert_eq!(svc.ledger().await, 1);
}

async fn unguarded_methods_and_bad_metadata<DB: TestDb>() {
    let svc = Service::<DB>::start(0).await;
    // SetStock and GetStock take no key and pass through.
    set_stock(svc.channel(), "B-1", 3).await;
    set_stock(svc.channel(), "B-1", 3).await;
    assert_eq!(stock(svc.channel(), "B-1").await, 3);
    // CreateOrder without a key, with a malformed one, without a principal.
    let no_key = call::<_, _, Order>(
        svc.channel(),
        orders::CREATE_ORDER,
        order("B-1", 1),
        &[("authorization", "Bearer alice")],
    )
    .await
    .unwrap_err();
    assert_eq!(no_key.code(), Code::InvalidArgument, "{no_key:?}");
    let bad_key = create(svc.channel(), "\"a\" , \"b\"", "alice", order("B-1", 1))
        .await
        .unwrap_err();
    assert_eq!(bad_key.code(), Code::InvalidArgument, "{bad_key:?}");
    let anonymous = call::<_, _, Order>(
        svc.channel(),
        orders::CREATE_ORDER,
        order("B-1", 1),
        &[("idempotency-key", "\"anon-1\"")],
    )
    .await
    .unwrap_err();
    assert_eq!(anonymous.code(), Code::Unauthenticated, "{anonymous:?}");
    // A message the handler refuses: a request rejection, not recorded.
    let mut invalid = order("B-1", 1);
    invalid.currency = "krw".into();
    let refused = create(svc.channel(), "\"invalid-1\"", "alice", invalid)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert_eq!(svc.orders().await, 0);
    assert_eq!(
        svc.ledger().await,
        0,
        "nothing is stored for refused requests"
    );
    assert_eq!(stock(svc.channel(), "B-1").await, 3);
}

/// A TCP proxy that loses answers: each connection forwards the server's
/// HTTP/2 frames of its first answer, and when the head of a second answer
/// comes (a `HEADERS` frame on a new stream, sent once the handler has
/// finished) closes both sides instead: that request ran, its answer never
/// reaches the caller. A caller that reconnects and retries gets one answer
/// through on the new connection, and loses the next.
struct LossyProxy {
    addr: String,
    lost: Arc<AtomicUsize>,
}

impl LossyProxy {
    async fn start(upstream: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let lost = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&lost);
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                tokio::spawn(relay(client, server, Arc::clone(&counter)));
            }
        });
        Self { addr, lost }
    }
}

/// HTTP/2's `HEADERS` frame type.
const HEADERS: u8 = 0x1;

async fn relay(
    client: tokio::net::TcpStream,
    server: tokio::net::TcpStream,
    lost: Arc<AtomicUsize>,
) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let up = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut cr, &mut sw).await;
    });
    let mut pending = BytesMut::new();
    let mut answers = std::collections::HashSet::new();
    let mut buf = vec![0u8; 64 * 1024];
    'relay: loop {
        let n = match sr.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        // Whole frames only: a 9-byte head (24-bit length, type, flags,
        // stream), then the payload.
        while pending.len() >= 9 {
            let len = u32::from_be_bytes([0, pending[0], pending[1], pending[2]]) as usize;
            if pending.len() < 9 + len {
                break;
            }
            let stream = u32::from_be_bytes([pending[5], pending[6], pending[7], pending[8]]);
            if pending[3] == HEADERS && answers.insert(stream) && answers.len() == 2 {
                lost.fetch_add(1, Ordering::Relaxed);
                break 'relay;
            }
            let frame = pending.split_to(9 + len);
            if cw.write_all(&frame).await.is_err() {
                break 'relay;
            }
        }
    }
    up.abort();
}

async fn a_retrying_client_through_a_lossy_proxy_makes_each_order_once<DB: TestDb>() {
    let svc = Service::<DB>::start(200).await;
    set_stock(svc.channel(), "A-10", 1_000).await;
    let proxy = LossyProxy::start(svc.addr.clone()).await;
    let channel = endpoint(&proxy.addr).connect_lazy();
    // The crate's client layer in front of the tonic channel: one key per
    // logical call, the same on every attempt; lost answers (transport
    // errors) and UNAVAILABLE are retried.
    let client = tower::ServiceBuilder::new()
        .layer(
            IdempotentRetryLayer::new()
                .with_max_attempts(8)
                .with_backoff(Duration::from_millis(20), Duration::from_millis(200))
                .with_deadline(Duration::from_secs(60)),
        )
        .map_request(|req: http::Request<tower_idempotency::client::RetryBody>| {
            req.map(tonic::body::Body::new)
        })
        .service(channel);
    let calls = 10;
    let mut replays = 0;
    for _ in 0..calls {
        let res: tonic::Response<Order> = call(
            client.clone(),
            orders::CREATE_ORDER,
            order("A-10", 1),
            &[("authorization", "Bearer alice")],
        )
        .await
        .unwrap();
        let report = res.extensions().get::<RetryReport>().cloned();
        if report.is_some_and(|r| r.replayed) || replayed(&res) {
            replays += 1;
        }
    }
    assert!(
        proxy.lost.load(Ordering::Relaxed) > 0,
        "the proxy lost answers"
    );
    assert!(replays > 0, "some calls were answered by a replay");
    assert_eq!(svc.orders().await, calls, "one order per logical call");
    assert_eq!(svc.ledger().await, calls);
    assert_eq!(stock(svc.channel(), "A-10").await, 1_000 - calls);
}

/// The store goes away under the running service (PostgreSQL refuses every
/// connection to its database, and its sessions are ended): a call is
/// answered `UNAVAILABLE` with a pushback, nothing is half-kept, and the
/// retry with the same key, once the store is back, makes the order once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_down_is_unavailable_and_the_retry_orders_once() {
    use sqlx::Connection;
    let svc = Service::<sqlx::Postgres>::start(0).await;
    set_stock(svc.channel(), "A-10", 10).await;
    let db = svc.url.rsplit('/').next().unwrap().to_owned();
    let admin_url = std::env::var("PG_URL").unwrap();
    let mut admin = sqlx::PgConnection::connect(&admin_url).await.unwrap();
    let allow = |on: bool| format!("ALTER DATABASE \"{db}\" ALLOW_CONNECTIONS {on}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(allow(false)))
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
        .bind(&db)
        .execute(&mut admin)
        .await
        .unwrap();
    let down = create(svc.channel(), "\"down-1\"", "alice", order("A-10", 1))
        .await
        .unwrap_err();
    assert_eq!(down.code(), Code::Unavailable, "{down:?}");
    let pushback = down.metadata().get("grpc-retry-pushback-ms");
    assert!(pushback.is_some(), "{down:?}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(allow(true)))
        .execute(&mut admin)
        .await
        .unwrap();
    let mut committed = None;
    for _ in 0..50 {
        match create(svc.channel(), "\"down-1\"", "alice", order("A-10", 1)).await {
            Ok(res) => {
                committed = Some(res.into_inner());
                break;
            }
            Err(status) if status.code() == Code::Unavailable => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    }
    let committed = committed.expect("the store came back");
    let again = create(svc.channel(), "\"down-1\"", "alice", order("A-10", 1))
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(again.into_inner(), committed);
    assert_eq!(svc.orders().await, 1);
    assert_eq!(svc.ledger().await, 1);
    assert_eq!(stock(svc.channel(), "A-10").await, 9);
}

/// The example client (`examples/grpc_order_client.rs`) through the lossy
/// proxy: every order it reports is committed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_client_through_a_lossy_proxy_orders_once() {
    let svc = Service::<sqlx::Sqlite>::start(200).await;
    let proxy = LossyProxy::start(svc.addr.clone()).await;
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(common::example("grpc_order_client"))
            .args(["--addr", &proxy.addr, "--orders", "4"])
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the client ends within 120 s")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids: std::collections::BTreeSet<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("order "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(ids.len(), 4, "{stdout}");
    assert!(
        proxy.lost.load(Ordering::Relaxed) > 0,
        "the proxy lost answers"
    );
    assert!(stdout.contains("replayed true"), "{stdout}");
    assert_eq!(svc.orders().await, 4);
    assert_eq!(stock(svc.channel(), "A-10").await, 1_000 - 4);
}
