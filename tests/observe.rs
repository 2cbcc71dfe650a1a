//! Operations: the span and event per guarded request never carry a raw key
//! or a body, and the metrics count each outcome and time each claim.

use std::io::Write;
use std::sync::{Arc, Mutex};

use http::{Request, Response, StatusCode};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use sqlx::sqlite::SqlitePoolOptions;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::{IdempotencyBody, IdempotencyLayer};

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

const SECRET_KEY: &str = "alice@example.com-checkout-1";
const BODY_MARKER: &str = "card-4242424242424242";

#[tokio::test]
async fn logs_hash_keys_and_metrics_count_outcomes() {
    let logs = Captured::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().unwrap();

    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await
        .unwrap();
    tower_idempotency::migrate(&pool).await.unwrap();
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(pool).unscoped())
        .service_fn(|_req: Request<IdempotencyBody<String>>| async {
            Ok::<_, std::convert::Infallible>(
                Response::builder()
                    .status(201)
                    .body(String::from("{\"id\":1}"))
                    .unwrap(),
            )
        });
    let send = |body: &str| {
        let req = Request::post("/payments")
            .header("idempotency-key", SECRET_KEY)
            .header("content-type", "application/json")
            .body(body.to_string())
            .unwrap();
        service.clone().oneshot(req)
    };
    let body = format!(r#"{{"card":"{BODY_MARKER}","amount":1}}"#);
    assert_eq!(send(&body).await.unwrap().status(), StatusCode::CREATED);
    assert_eq!(send(&body).await.unwrap().status(), StatusCode::CREATED);
    let changed = send(&body.replace("\"amount\":1", "\"amount\":2"))
        .await
        .unwrap();
    assert_eq!(changed.status(), StatusCode::UNPROCESSABLE_ENTITY);

    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(!text.contains(SECRET_KEY), "raw key logged:\n{text}");
    assert!(!text.contains(BODY_MARKER), "body logged:\n{text}");
    let digest = <sha2::Sha256 as sha2::Digest>::digest(SECRET_KEY.as_bytes());
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    assert!(text.contains(&format!("key_hash=\"{hash}\"")), "{text}");
    for outcome in ["claimed", "replayed", "mismatch"] {
        assert!(
            text.contains(&format!("outcome=\"{outcome}\"")),
            "no {outcome} in:\n{text}"
        );
    }
    assert!(
        text.contains("claim_ms=") && text.contains("handler_ms=") && text.contains("commit_ms="),
        "{text}"
    );

    let mut counts = std::collections::HashMap::new();
    let mut claim_samples = 0;
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        match (key.name(), value) {
            ("idempotency_requests_total", DebugValue::Counter(n)) => {
                let outcome = key
                    .labels()
                    .find(|l| l.key() == "outcome")
                    .unwrap()
                    .value()
                    .to_string();
                counts.insert(outcome, n);
            }
            ("idempotency_claim_seconds", DebugValue::Histogram(samples)) => {
                claim_samples = samples.len()
            }
            _ => {}
        }
    }
    assert_eq!(counts.get("claimed"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("replayed"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("mismatch"), Some(&1), "{counts:?}");
    assert_eq!(claim_samples, 3);
}
