//! Whether a claim on MySQL/MariaDB waits for its cluster: the `SELECT`s a
//! first execution sends, counted by its session (`Com_select`). The
//! recording batch's read is one; the Galera causal wait, a table-less
//! `SELECT` before the claim, would be the second.

use std::convert::Infallible;

use http::{Request, Response, StatusCode};
use sqlx::Row;
use sqlx::mysql::{MySql, MySqlPoolOptions};
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::{IdempotencyBody, IdempotencyLayer, Principal, Tx};

/// `SELECT`s per first execution of a layer on a one-connection pool to
/// `url` (a database of its own, migrated here), over five requests after
/// one that warms the connection (and asks the server what it is).
pub async fn selects_per_first_execution(url: &str) -> i64 {
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .unwrap();
    tower_idempotency::migrate(&pool).await.unwrap();
    sqlx::raw_sql("CREATE TABLE t (id BIGINT AUTO_INCREMENT PRIMARY KEY) ENGINE = InnoDB")
        .execute(&pool)
        .await
        .unwrap();
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(pool.clone()).unscoped())
        .service_fn(|req: Request<IdempotencyBody<String>>| async move {
            let tx = req.extensions().get::<Tx<MySql>>().cloned().unwrap();
            let mut conn = tx.lock().unwrap();
            sqlx::raw_sql("INSERT INTO t () VALUES ()")
                .execute(&mut *conn)
                .await
                .unwrap();
            Ok::<_, Infallible>(Response::builder().status(201).body(String::new()).unwrap())
        });
    let call = |key: String| {
        let service = service.clone();
        async move {
            let mut req = Request::post("/orders")
                .header("idempotency-key", key)
                .body(String::new())
                .unwrap();
            req.extensions_mut().insert(Principal::new("p"));
            service.oneshot(req).await.unwrap().status()
        }
    };
    let selects = || async {
        let row = sqlx::raw_sql("SHOW SESSION STATUS LIKE 'Com_select'")
            .fetch_one(&pool)
            .await
            .unwrap();
        row.get::<String, _>(1).parse::<i64>().unwrap()
    };
    assert_eq!(call("warm".into()).await, StatusCode::CREATED);
    let before = selects().await;
    for i in 0..5 {
        assert_eq!(call(format!("k-{i}")).await, StatusCode::CREATED);
    }
    let per = (selects().await - before) / 5;
    pool.close().await;
    per
}
