//! Trailers over the wire: a handler's answer that ends with trailers,
//! served behind the layer by hyper over HTTP/1.1 (chunked, the client
//! asking with `TE: trailers`) and HTTP/2, keeps its trailers on the first
//! answer and on the replay, byte for byte.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use tower_idempotency::{IdempotencyLayer, Principal, Tx};

/// The answer's body: one message, then trailers.
struct Message(Option<Bytes>, Option<HeaderMap>);

impl Body for Message {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let frame = match self.0.take() {
            Some(data) => Some(Frame::data(data)),
            None => self.1.take().map(Frame::trailers),
        };
        Poll::Ready(frame.map(Ok))
    }
}

async fn export(tx: Tx<sqlx::Sqlite>) -> Response {
    let mut conn = tx.lock().unwrap();
    sqlx::raw_sql("INSERT INTO exports (at) VALUES ('now')")
        .execute(&mut *conn)
        .await
        .unwrap();
    let mut trailers = HeaderMap::new();
    trailers.insert("x-checksum", HeaderValue::from_static("sha256=abc"));
    trailers.insert("x-rows", HeaderValue::from_static("1"));
    (
        StatusCode::CREATED,
        [("trailer", "x-checksum, x-rows")],
        axum::body::Body::new(Message(
            Some(Bytes::from_static(b"rows...")),
            Some(trailers),
        )),
    )
        .into_response()
}

async fn principal(mut req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    req.extensions_mut().insert(Principal::new("user-42"));
    next.run(req).await
}

/// (status, body, trailers, replayed) of one call.
type Seen = (StatusCode, Bytes, Option<HeaderMap>, bool);

async fn call(addr: std::net::SocketAddr, h2: bool, key: &str) -> Seen {
    let io = TokioIo::new(tokio::net::TcpStream::connect(addr).await.unwrap());
    let req = Request::post("/exports")
        .header("host", "test")
        .header("te", "trailers")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let res = if h2 {
        let (mut sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .unwrap();
        tokio::spawn(conn);
        sender.send_request(req).await.unwrap()
    } else {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
        tokio::spawn(conn);
        sender.send_request(req).await.unwrap()
    };
    let status = res.status();
    let replayed = res.headers().contains_key("idempotent-replayed");
    let collected = res.into_body().collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    (status, collected.to_bytes(), trailers, replayed)
}

#[tokio::test(flavor = "multi_thread")]
async fn trailers_survive_the_first_answer_and_the_replay_on_http1_and_http2() {
    let path = std::env::temp_dir().join(format!("ti_trailers_{}.db", std::process::id()));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .connect_with(
            sqlx::sqlite::SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true),
        )
        .await
        .unwrap();
    tower_idempotency::migrate(&pool).await.unwrap();
    sqlx::raw_sql("CREATE TABLE exports (id INTEGER PRIMARY KEY, at TEXT)")
        .execute(&pool)
        .await
        .unwrap();
    let app = Router::new()
        .route("/exports", post(export))
        .layer(IdempotencyLayer::new(pool.clone()))
        .layer(axum::middleware::from_fn(principal));
    for h2 in [false, true] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = app.clone();
        let server = tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let service = TowerToHyperService::new(app.clone());
                let io = TokioIo::new(stream);
                tokio::spawn(async move {
                    if h2 {
                        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .serve_connection(io, service)
                            .await;
                    } else {
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(io, service)
                            .await;
                    }
                });
            }
        });
        let key = if h2 { "\"h2-1\"" } else { "\"h1-1\"" };
        let run = async {
            let first = call(addr, h2, key).await;
            let replay = call(addr, h2, key).await;
            (first, replay)
        };
        let (first, replay) = tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .expect("answers within 30 s");
        let protocol = if h2 { "HTTP/2" } else { "HTTP/1.1" };
        assert_eq!(first.0, StatusCode::CREATED, "{protocol}");
        assert!(!first.3, "{protocol}");
        let trailers = first
            .2
            .clone()
            .unwrap_or_else(|| panic!("{protocol}: trailers on the first answer"));
        assert_eq!(trailers["x-checksum"], "sha256=abc", "{protocol}");
        assert_eq!(trailers["x-rows"], "1", "{protocol}");
        assert!(replay.3, "{protocol}: replayed");
        assert_eq!(replay.0, first.0, "{protocol}");
        assert_eq!(replay.1, first.1, "{protocol}");
        assert_eq!(replay.2, first.2, "{protocol}: the same trailers replayed");
        server.abort();
    }
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM exports")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 2, "one export per key");
    pool.close().await;
    let _ = std::fs::remove_file(&path);
}
