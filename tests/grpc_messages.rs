//! gRPC request messages (feature `grpc`): the key from a request field
//! (AIP-155 `request_id`) and `Normalizer::protobuf`, through the layer on
//! every store, judged by the handler's runs and the rows committed.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use prost::Message;
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::testkit::{ConformanceDb, Harness};
use tower_idempotency::{IdempotencyBody, IdempotencyLayer, Normalizer, Tx, protobuf};

/// An AIP-155 request: the key travels in `request_id`.
#[derive(Clone, PartialEq, Message)]
struct PayRequest {
    #[prost(string, tag = "1")]
    account: String,
    #[prost(int64, tag = "2")]
    amount: i64,
    #[prost(string, repeated, tag = "3")]
    tags: Vec<String>,
    #[prost(string, tag = "9")]
    request_id: String,
}

fn framed(message: &[u8]) -> Bytes {
    let mut out = vec![0];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    Bytes::from(out)
}

fn encode(req: &PayRequest) -> Bytes {
    framed(&req.encode_to_vec())
}

fn pay(account: &str, amount: i64, request_id: &str) -> PayRequest {
    PayRequest {
        account: account.into(),
        amount,
        tags: vec!["a".into(), "b".into()],
        request_id: request_id.into(),
    }
}

/// What the answer said: its gRPC status (trailers-only refusals carry it
/// in the headers; the handler's answer in its trailers).
struct Said {
    grpc_status: String,
    replayed: bool,
    body: Bytes,
}

/// A gRPC app behind `layer`: the handler inserts an order on the claimed
/// transaction and answers its id in one message, ending in trailers.
async fn call<DB: ConformanceDb>(
    layer: &IdempotencyLayer<DB>,
    runs: &Arc<AtomicUsize>,
    body: Bytes,
    metadata: &[(&str, &str)],
) -> Said {
    let runs = Arc::clone(runs);
    let handler = tower::service_fn(move |req: http::Request<IdempotencyBody<Full<Bytes>>>| {
        let runs = Arc::clone(&runs);
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let tx = req.extensions().get::<Tx<DB>>().cloned().unwrap();
            let id = {
                let mut conn = tx.lock().unwrap();
                DB::insert_order(&mut conn, "alice", 1).await.unwrap()
            };
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", "0".parse().unwrap());
            let body = Answer {
                data: Some(framed(id.to_string().as_bytes())),
                trailers: Some(trailers),
            };
            Ok::<_, Infallible>(
                http::Response::builder()
                    .header("content-type", "application/grpc")
                    .body(body)
                    .unwrap(),
            )
        }
    });
    let mut svc = layer.clone().layer(handler);
    let mut req = http::Request::post("/pay.v1.Payments/Pay")
        .header("content-type", "application/grpc")
        .header("authorization", "Bearer alice")
        .header("te", "trailers");
    for (k, v) in metadata {
        req = req.header(*k, *v);
    }
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(req.body(Full::new(body)).unwrap())
        .await
        .unwrap();
    let replayed = res.headers().contains_key("idempotent-replayed");
    let head_status = res
        .headers()
        .get("grpc-status")
        .map(|v| v.to_str().unwrap().to_owned());
    let collected = res.into_body().collect().await.unwrap();
    let trailer_status = collected
        .trailers()
        .and_then(|t| t.get("grpc-status"))
        .map(|v| v.to_str().unwrap().to_owned());
    Said {
        grpc_status: head_status.or(trailer_status).unwrap_or_default(),
        replayed,
        body: collected.to_bytes(),
    }
}

/// A gRPC answer's body: one message, then trailers.
struct Answer {
    data: Option<Bytes>,
    trailers: Option<http::HeaderMap>,
}

impl http_body::Body for Answer {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        let frame = match self.data.take() {
            Some(data) => Some(http_body::Frame::data(data)),
            None => self.trailers.take().map(http_body::Frame::trailers),
        };
        std::task::Poll::Ready(frame.map(Ok))
    }
}

macro_rules! stores {
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

stores!(
    the_request_id_field_is_the_key,
    a_header_and_a_field_that_disagree_are_refused,
    protobuf_fingerprints_the_value_not_the_bytes,
);

fn field_layer<DB: ConformanceDb>(h: &Harness<DB>) -> IdempotencyLayer<DB> {
    h.layer()
        .with_key_from_body(protobuf::request_field(|r: &PayRequest| &r.request_id))
        .with_normalizer(Normalizer::protobuf::<PayRequest>())
}

async fn the_request_id_field_is_the_key<DB: ConformanceDb>() {
    let h = Harness::<DB>::new().await;
    let layer = field_layer(&h);
    let runs = Arc::new(AtomicUsize::new(0));
    let first = call(&layer, &runs, encode(&pay("acc-1", 500, "req-1")), &[]).await;
    assert_eq!(first.grpc_status, "0");
    let again = call(&layer, &runs, encode(&pay("acc-1", 500, "req-1")), &[]).await;
    assert_eq!(again.grpc_status, "0");
    assert!(again.replayed);
    assert_eq!(again.body, first.body);
    // The same payload under another request_id is another operation.
    let other = call(&layer, &runs, encode(&pay("acc-1", 500, "req-2")), &[]).await;
    assert_eq!(other.grpc_status, "0");
    assert!(!other.replayed);
    // Another payload under req-1: refused, key reused.
    let reused = call(&layer, &runs, encode(&pay("acc-1", 900, "req-1")), &[]).await;
    assert_eq!(reused.grpc_status, "9");
    // No request_id and no metadata: no key.
    let keyless = call(&layer, &runs, encode(&pay("acc-1", 500, "")), &[]).await;
    assert_eq!(keyless.grpc_status, "3");
    // A field that breaks the key's syntax rules.
    let long = "x".repeat(300);
    let malformed = call(&layer, &runs, encode(&pay("acc-1", 500, &long)), &[]).await;
    assert_eq!(malformed.grpc_status, "3");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(h.orders().await, 2);
    assert_eq!(h.ledger().await, 2);
}

async fn a_header_and_a_field_that_disagree_are_refused<DB: ConformanceDb>() {
    let h = Harness::<DB>::new().await;
    let layer = field_layer(&h);
    let runs = Arc::new(AtomicUsize::new(0));
    let body = encode(&pay("acc-1", 500, "req-1"));
    let disagree = call(
        &layer,
        &runs,
        body.clone(),
        &[("idempotency-key", "\"other\"")],
    )
    .await;
    assert_eq!(disagree.grpc_status, "3");
    let agree = call(
        &layer,
        &runs,
        body.clone(),
        &[("idempotency-key", "\"req-1\"")],
    )
    .await;
    assert_eq!(agree.grpc_status, "0");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(h.orders().await, 1);
}

async fn protobuf_fingerprints_the_value_not_the_bytes<DB: ConformanceDb>() {
    let h = Harness::<DB>::new().await;
    let layer = h
        .layer()
        .with_normalizer(Normalizer::protobuf::<PayRequest>());
    let runs = Arc::new(AtomicUsize::new(0));
    let meta = [("idempotency-key", "\"same\"")];
    let canonical = pay("acc-1", 500, "");
    let first = call(&layer, &runs, encode(&canonical), &meta).await;
    assert_eq!(first.grpc_status, "0");
    // The same value, encoded otherwise: fields in reverse order, a default
    // value sent explicitly (request_id = ""), and a field this service
    // does not know (tag 15).
    let mut other = Vec::new();
    prost::encoding::string::encode(15, &"unknown".to_string(), &mut other);
    prost::encoding::string::encode(9, &String::new(), &mut other);
    prost::encoding::string::encode_repeated(3, &canonical.tags, &mut other);
    prost::encoding::int64::encode(2, &500, &mut other);
    prost::encoding::string::encode(1, &"acc-1".to_string(), &mut other);
    assert_ne!(other, canonical.encode_to_vec(), "another encoding");
    let again = call(&layer, &runs, framed(&other), &meta).await;
    assert_eq!(again.grpc_status, "0");
    assert!(again.replayed, "the same value is the same request");
    // Another value is another request: refused, key reused.
    let changed = call(&layer, &runs, encode(&pay("acc-1", 501, "")), &meta).await;
    assert_eq!(changed.grpc_status, "9");
    // Not one uncompressed message: refused before any claim.
    let mut compressed = encode(&canonical).to_vec();
    compressed[0] = 1;
    let meta2 = [("idempotency-key", "\"other\"")];
    let refused = call(&layer, &runs, Bytes::from(compressed), &meta2).await;
    assert_eq!(refused.grpc_status, "3");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(h.ledger().await, 1);
}
