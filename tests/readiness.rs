//! The layer calls the inner service it polled ready, never an unready clone
//! (the bug fixed in tower-http#561). `tower_test::mock` panics when a clone
//! that was not polled ready is called.

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use sqlx::sqlite::SqlitePoolOptions;
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::{IdempotencyBody, IdempotencyLayer};

type Req = Request<IdempotencyBody<Full<Bytes>>>;

#[tokio::test]
async fn guarded_call_uses_the_service_that_was_polled_ready() {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await
        .unwrap();
    tower_idempotency::migrate(&pool).await.unwrap();
    let (mock, mut handle) = tower_test::mock::pair::<Req, Response<Full<Bytes>>>();
    let mut svc = IdempotencyLayer::new(pool).unscoped().layer(mock);

    handle.allow(1);
    svc.ready().await.unwrap();
    let req = Request::post("/orders")
        .header("idempotency-key", "\"k\"")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let fut = tokio::spawn(svc.call(req));
    let called = tokio::time::timeout(std::time::Duration::from_secs(5), handle.next_request());
    let (got, send) = called.await.ok().flatten().unwrap_or_else(|| {
        panic!(
            "the ready inner service was not called: {:?}",
            fut.is_finished()
        )
    });
    assert_eq!(got.uri().path(), "/orders");
    send.send_response(
        Response::builder()
            .status(201)
            .body(Full::new(Bytes::from_static(b"created")))
            .unwrap(),
    );
    let res = fut.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
}
