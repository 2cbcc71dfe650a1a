//! Micro-benchmarks of the layer's own work: key parsing, fingerprinting
//! 1 KiB and 64 KiB JSON bodies, and a whole replay through the layer on
//! in-memory SQLite (ledger read plus response construction), next to a
//! bare service call as the baseline of the same run.

use std::hint::black_box;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use http::{Request, Response};
use sqlx::sqlite::SqlitePoolOptions;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::{IdempotencyBody, IdempotencyKey, IdempotencyLayer, KeyMode, Normalizer};

fn json_body(bytes: usize) -> Bytes {
    let mut items = Vec::new();
    let mut i = 0;
    while serde_json::to_vec(&items).unwrap().len() < bytes {
        items.push(serde_json::json!({"sku": format!("SKU-{i:05}"), "qty": i % 7 + 1, "note": "gift wrap"}));
        i += 1;
    }
    Bytes::from(
        serde_json::to_vec(
            &serde_json::json!({"currency": "KRW", "items": items, "amount": 12000}),
        )
        .unwrap(),
    )
}

fn keys(c: &mut Criterion) {
    let mut g = c.benchmark_group("key");
    g.bench_function("parse quoted", |b| {
        b.iter(|| {
            IdempotencyKey::parse(
                black_box(b"\"8e03978e-40d5-43e8-bc93-6894a57f9324\""),
                KeyMode::Lenient,
            )
        })
    });
    g.bench_function("parse bare", |b| {
        b.iter(|| {
            IdempotencyKey::parse(
                black_box(b"8e03978e-40d5-43e8-bc93-6894a57f9324"),
                KeyMode::Lenient,
            )
        })
    });
    g.finish();
}

fn fingerprints(c: &mut Criterion) {
    let (parts, ()) = Request::post("/orders")
        .header("content-type", "application/json")
        .body(())
        .unwrap()
        .into_parts();
    let n = Normalizer::canonical_json();
    let mut g = c.benchmark_group("fingerprint");
    for (name, size) in [("1 KiB JSON", 1024), ("64 KiB JSON", 64 * 1024)] {
        let body = json_body(size);
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(name, |b| {
            b.iter(|| n.fingerprint(&parts, black_box(&body)).unwrap())
        });
    }
    g.finish();
}

fn replay(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let handler = |_req: Request<IdempotencyBody<String>>| async {
        Ok::<_, std::convert::Infallible>(
            Response::builder()
                .status(201)
                .body(String::from(r#"{"orderId":"o-1"}"#))
                .unwrap(),
        )
    };
    let (mut layered, bare) = rt.block_on(async {
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        tower_idempotency::migrate(&pool).await.unwrap();
        let layered = ServiceBuilder::new()
            .layer(IdempotencyLayer::new(pool).unscoped())
            .service_fn(handler);
        let bare = tower::service_fn(|_req: Request<String>| async {
            Ok::<_, std::convert::Infallible>(
                Response::builder()
                    .status(201)
                    .body(String::from(r#"{"orderId":"o-1"}"#))
                    .unwrap(),
            )
        });
        (layered, bare)
    });
    let req = || {
        Request::post("/orders")
            .header("idempotency-key", "\"k-1\"")
            .header("content-type", "application/json")
            .body(r#"{"amount":12000}"#.to_string())
            .unwrap()
    };
    // Record the answer once; every measured call is a replay.
    rt.block_on(async { layered.ready().await.unwrap().call(req()).await.unwrap() });
    let mut g = c.benchmark_group("request");
    g.bench_function("bare service call (baseline)", |b| {
        b.to_async(&rt).iter(|| bare.oneshot(req()))
    });
    g.bench_function("replay through the layer (SQLite in memory)", |b| {
        b.to_async(&rt).iter(|| layered.clone().oneshot(req()))
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(2));
    targets = keys, fingerprints, replay
}
criterion_main!(benches);
