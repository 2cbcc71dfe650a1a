//! Micro-benchmarks of the layer's own work: key parsing, fingerprinting
//! 1 KiB and 64 KiB JSON bodies, and a whole replay through the layer on
//! in-memory SQLite (ledger read plus response construction), next to a
//! bare service call as the baseline of the same run. The fingerprints run
//! next to the former `serde_json::Value` canonicalization, as a baseline.

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
        g.bench_function(
            format!("{name}, serde_json::Value + sorted keys (old, baseline)"),
            |b| b.iter(|| old_fingerprint(&parts, black_box(&body))),
        );
    }
    g.finish();
}

/// The fingerprint as computed before the streaming canonicalizer: parse
/// into a `serde_json::Value` (numbers as u64/i64/f64), write it back with
/// sorted keys into SHA-256. Kept as the same-run baseline.
fn old_fingerprint(parts: &http::request::Parts, body: &Bytes) -> [u8; 32] {
    use serde_json::Value;
    use sha2::{Digest, Sha256};

    struct HashWriter<'a>(&'a mut Sha256);
    impl std::io::Write for HashWriter<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.update(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    fn write_canonical(value: &Value, out: &mut impl std::io::Write) -> std::io::Result<()> {
        match value {
            Value::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
                out.write_all(b"{")?;
                for (i, (k, v)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.write_all(b",")?;
                    }
                    serde_json::to_writer(&mut *out, k.as_str())?;
                    out.write_all(b":")?;
                    write_canonical(v, out)?;
                }
                out.write_all(b"}")
            }
            Value::Array(items) => {
                out.write_all(b"[")?;
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.write_all(b",")?;
                    }
                    write_canonical(v, out)?;
                }
                out.write_all(b"]")
            }
            scalar => Ok(serde_json::to_writer(&mut *out, scalar)?),
        }
    }

    let mut h = Sha256::new();
    let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    for part in [parts.method.as_str().as_bytes(), target.as_bytes()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    let value: Value = serde_json::from_slice(body).unwrap();
    write_canonical(&value, &mut HashWriter(&mut h)).unwrap();
    h.finalize().into()
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
