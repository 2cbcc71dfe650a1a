//! The order flow on plain hyper 1 + hyper-util, no axum: the layer is a
//! tower layer like any other, stacked with `tower::ServiceBuilder` and
//! served through `hyper_util::service::TowerToHyperService`.
//!
//! ```text
//! cargo run --example hyper_server                        # SQLite file ./hyper_server.db, port 3002
//! cargo run --example hyper_server -- --addr 127.0.0.1:0  # any free port
//! curl -i -X POST http://127.0.0.1:3002/orders -H 'Authorization: Bearer user-42' \
//!      -H 'Idempotency-Key: k-1' -H 'Content-Type: application/json' -d '{"amount":1000}'
//! ```
//!
//! `POST /orders` `{"amount":N}` inserts an order on the claimed
//! transaction ([`Tx`]) and answers `201 {"orderId":…,"amount":N}`; the same
//! key again replays it byte for byte. `GET /health` answers `200`.
//! The principal is the Bearer token.

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use tokio::net::TcpListener;
use tower::ServiceBuilder;
use tower_idempotency::{IdempotencyBody, IdempotencyLayer, Principal, Tx};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The Bearer token as the principal.
fn bearer(parts: &http::request::Parts) -> Option<Principal> {
    let value = parts.headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let token = value.strip_prefix("Bearer ")?.trim();
    (!token.is_empty()).then(|| Principal::new(token))
}

fn json(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(Bytes::from(body)));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        "application/json".parse().expect("a valid value"),
    );
    res
}

/// The handler: plain `async fn` over the request, the claimed transaction
/// taken from its extensions.
async fn handle(
    req: Request<IdempotencyBody<hyper::body::Incoming>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET, "/health") => json(StatusCode::OK, r#"{"status":"ok"}"#.into()),
        (&Method::POST, "/orders") => create_order(req).await.unwrap_or_else(|e| {
            json(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(r#"{{"error":"{e}"}}"#),
            )
        }),
        _ => json(StatusCode::NOT_FOUND, r#"{"error":"not found"}"#.into()),
    })
}

async fn create_order(
    req: Request<IdempotencyBody<hyper::body::Incoming>>,
) -> Result<Response<Full<Bytes>>, BoxError> {
    let Some(tx) = req.extensions().get::<Tx<Sqlite>>().cloned() else {
        return Ok(json(
            StatusCode::BAD_REQUEST,
            r#"{"error":"Idempotency-Key required"}"#.into(),
        ));
    };
    let body = req.into_body().collect().await?.to_bytes();
    let amount = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["amount"].as_i64())
        .filter(|a| *a > 0);
    let Some(amount) = amount else {
        return Ok(json(
            StatusCode::UNPROCESSABLE_ENTITY,
            r#"{"error":"amount must be a positive integer"}"#.into(),
        ));
    };
    let mut conn = tx.lock()?;
    let id: i64 = sqlx::query_scalar("INSERT INTO orders (amount) VALUES (?) RETURNING id")
        .bind(amount)
        .fetch_one(&mut *conn)
        .await?;
    Ok(json(
        StatusCode::CREATED,
        format!(r#"{{"orderId":{id},"amount":{amount}}}"#),
    ))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut addr: SocketAddr = ([127, 0, 0, 1], 3002).into();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--addr", Some(value)) => addr = value.parse()?,
            _ => return Err(format!("unknown flag {flag}; use --addr HOST:PORT").into()),
        }
    }
    let options = SqliteConnectOptions::new()
        .filename("hyper_server.db")
        .create_if_missing(true);
    let pool = SqlitePoolOptions::new().connect_with(options).await?;
    tower_idempotency::migrate(&pool).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL)",
    )
    .execute(&pool)
    .await?;

    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(pool).with_principal(bearer))
        .service_fn(handle);

    let listener = TcpListener::bind(addr).await?;
    println!(
        "hyper_server listening on http://{}",
        listener.local_addr()?
    );
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => accepted?,
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        let service = TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                eprintln!("connection: {e}");
            }
        });
    }
}
