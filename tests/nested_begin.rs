//! A handler (or a library it calls) that runs `begin()` and `commit()` on
//! the claimed transaction's connection ends the layer's transaction: on
//! PostgreSQL sqlx does not count the claimed transaction, so its `BEGIN` is
//! ignored by the server and its `COMMIT` is real. Whatever that commits
//! must hold the key: a duplicate that was waiting on the claim must meet a
//! committed row and never run the handler again (one order, never two).

use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use sqlx::{Connection, PgPool};
use tower::ServiceBuilder;
use tower::util::BoxCloneService;
use tower_idempotency::{IdempotencyBody, IdempotencyLayer};

#[path = "common/orders_app.rs"]
mod orders_app;

use orders_app::{App, claimed_tx, orders_db, post};

/// One instance whose handler writes its order in a nested `begin()` /
/// `commit()`, then takes its time answering.
fn instance(pool: PgPool) -> App {
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(pool))
        .service_fn(|req: Request<IdempotencyBody<String>>| async move {
            let tx = claimed_tx(&req);
            {
                let mut conn = tx.lock().unwrap();
                let mut nested = conn.begin().await.unwrap();
                sqlx::raw_sql("INSERT INTO orders (n) VALUES (1)")
                    .execute(&mut *nested)
                    .await
                    .unwrap();
                nested.commit().await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok::<_, Infallible>(Response::builder().status(201).body(String::new()).unwrap())
        });
    BoxCloneService::new(service)
}

fn send(app: &App) -> impl Future<Output = StatusCode> + Send + 'static {
    post(app, "/orders", "nested", "{}", 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_commit_in_the_handler_never_lets_a_duplicate_run() {
    let (url, _drop) = orders_db().await;
    let setup = PgPool::connect(&url).await.unwrap();
    // Two instances, so the duplicate waits in the database.
    let a = instance(PgPool::connect(&url).await.unwrap());
    let b = instance(PgPool::connect(&url).await.unwrap());
    let first = tokio::spawn(send(&a));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let duplicate = tokio::spawn(send(&b));
    let (first, duplicate) = (first.await.unwrap(), duplicate.await.unwrap());
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&setup)
        .await
        .unwrap();
    println!("first {first}, duplicate {duplicate}, orders {orders}");
    assert_eq!(orders, 1, "the duplicate ran the handler again");
    assert_ne!(
        duplicate,
        StatusCode::CREATED,
        "the duplicate is held, not run"
    );
    let retry = send(&a).await;
    assert_eq!(
        retry,
        StatusCode::SERVICE_UNAVAILABLE,
        "held for reconciliation"
    );
}
