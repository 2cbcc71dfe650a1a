//! A fresh PostgreSQL database with the ledger and an `orders` table, and
//! requests to an app behind the layer there. Shared by
//! `tests/server_errors.rs` and `tests/pg_session_hazards.rs`.

use std::convert::Infallible;

use http::{Request, Response, StatusCode};
use sqlx::PgPool;
use tower::ServiceExt;
use tower::util::BoxCloneService;
use tower_idempotency::testkit::{Cleanup, ConformanceDb};
use tower_idempotency::{IdempotencyBody, Principal, Tx};

/// An application instance behind the layer.
pub type App = BoxCloneService<Request<String>, Response<IdempotencyBody<String>>, Infallible>;

/// A fresh database, migrated, with `orders (id, n)`: its URL, and what
/// drops it.
pub async fn orders_db() -> (String, Cleanup) {
    let (url, drop) = <sqlx::Postgres as ConformanceDb>::fresh_url().await;
    let setup = PgPool::connect(&url).await.unwrap();
    tower_idempotency::migrate(&setup).await.unwrap();
    sqlx::raw_sql("CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, n INT NOT NULL)")
        .execute(&setup)
        .await
        .unwrap();
    setup.close().await;
    (url, drop)
}

/// `POST path` as `user-42` with `key` and a JSON `body`, asking the
/// handler to take `delay_ms` (`x-delay-ms`); the answer's status.
pub fn post(
    app: &App,
    path: &str,
    key: &str,
    body: &str,
    delay_ms: u64,
) -> impl Future<Output = StatusCode> + Send + 'static {
    let app = app.clone();
    let mut req = Request::post(path)
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .header("x-delay-ms", delay_ms.to_string())
        .body(body.to_string())
        .unwrap();
    req.extensions_mut().insert(Principal::new("user-42"));
    async move { app.oneshot(req).await.unwrap().status() }
}

/// The claimed transaction the layer put in `req`.
pub fn claimed_tx(req: &Request<IdempotencyBody<String>>) -> Tx<sqlx::Postgres> {
    req.extensions()
        .get::<Tx<sqlx::Postgres>>()
        .cloned()
        .expect("the layer claimed this request")
}
