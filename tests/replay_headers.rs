//! Hardening 12: a compression layer inside the idempotency layer encodes
//! the answer; the replay carries the same `Content-Encoding` with the same
//! bytes, so it decodes to the same answer.

use std::io::Read;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use sqlx::sqlite::SqlitePoolOptions;
use tower::{ServiceBuilder, ServiceExt};
use tower_http::compression::CompressionLayer;
use tower_idempotency::{IdempotencyBody, IdempotencyLayer, Principal};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn gunzip(bytes: &[u8]) -> String {
    let mut out = String::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_string(&mut out)
        .expect("a gzip body");
    out
}

#[tokio::test]
async fn a_gzip_encoded_answer_replays_decodable() -> Result<(), BoxError> {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await?;
    tower_idempotency::migrate(&pool).await?;
    let answer = format!(
        "{{\"orderId\":7,\"note\":\"{}\"}}",
        "compressible ".repeat(40)
    );
    let expected = answer.clone();
    let handler = move |_req: Request<IdempotencyBody<String>>| {
        let answer = answer.clone();
        async move {
            Ok::<_, BoxError>(
                Response::builder()
                    .status(201)
                    .header("content-type", "application/json")
                    .header("content-language", "en")
                    .body(answer)?,
            )
        }
    };
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(pool.clone()).unscoped())
        .layer(CompressionLayer::new())
        .service_fn(handler);
    let request = || {
        let mut req = Request::post("/orders")
            .header("idempotency-key", "k-gzip")
            .header("accept-encoding", "gzip")
            .body(String::new())
            .unwrap();
        req.extensions_mut().insert(Principal::new("p"));
        req
    };
    let mut seen = Vec::new();
    for _ in 0..2 {
        let res = service.clone().oneshot(request()).await?;
        assert_eq!(res.status(), StatusCode::CREATED);
        let headers = res.headers().clone();
        let body: Bytes = res.into_body().collect().await?.to_bytes();
        assert_eq!(headers["content-encoding"], "gzip", "{headers:?}");
        assert_eq!(headers["content-language"], "en");
        assert_eq!(gunzip(&body), expected);
        seen.push((headers.contains_key("idempotent-replayed"), body));
    }
    assert!(!seen[0].0 && seen[1].0, "the second answer is the replay");
    assert_eq!(seen[0].1, seen[1].1, "byte for byte");
    Ok(())
}
