//! The "Testing your own handlers" example of `docs/testing.md`, kept compiling and
//! passing: a handler behind the layer, tested with `oneshot` on in-memory
//! SQLite.

use axum::body::Body;
use axum::routing::post;
use axum::{Json, Router};
use http::{Request, StatusCode};
use serde_json::{Value, json};
use sqlx::Sqlite;
use sqlx::sqlite::SqlitePoolOptions;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, Principal, Tx};

async fn create_order(tx: Tx<Sqlite>, Json(body): Json<Value>) -> (StatusCode, Json<Value>) {
    let mut conn = tx.lock().unwrap();
    let id: i64 = sqlx::query_scalar("INSERT INTO orders (amount) VALUES (?) RETURNING id")
        .bind(body["amount"].as_i64())
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    (StatusCode::CREATED, Json(json!({"orderId": id})))
}

#[tokio::test]
async fn a_retry_replays_the_order() {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await
        .unwrap();
    tower_idempotency::migrate(&pool).await.unwrap();
    sqlx::raw_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, amount INTEGER)")
        .execute(&pool)
        .await
        .unwrap();
    let app = Router::new()
        .route("/orders", post(create_order)) // your handler, taking Tx<Sqlite>
        .layer(
            IdempotencyLayer::new(pool.clone()).with_principal(|_| Some(Principal::new("test"))),
        );
    let order = || {
        Request::post("/orders")
            .header("idempotency-key", "k-1")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"amount":1000}"#))
            .unwrap()
    };

    let first = app.clone().oneshot(order()).await.unwrap();
    let retry = app.clone().oneshot(order()).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let orders: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(orders, 1); // judge by rows, not by responses
}
