//! A payments service of your own, on PostgreSQL: the README's start,
//! verbatim (tests/start.rs checks that the README shows exactly this file
//! and runs it).
//!
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo run --example start

use axum::extract::{Json, Request};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use axum::{Extension, Router};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Postgres};
use tower_idempotency::{HandlerError, IdempotencyLayer, Principal, Tx};

#[derive(Deserialize)]
struct NewPayment {
    amount: i64,
    currency: String,
}

#[derive(Serialize)]
struct Payment {
    id: i64,
    amount: i64,
    currency: String,
}

/// Runs at most once per `Idempotency-Key`: a retry gets this answer again.
async fn create_payment(
    tx: Tx<Postgres>,
    Extension(payer): Extension<Principal>,
    Json(new): Json<NewPayment>,
) -> Result<(StatusCode, Json<Payment>), HandlerError> {
    if new.amount <= 0 {
        // A 422 is not recorded: the client may fix the request and retry.
        let refusal = (StatusCode::UNPROCESSABLE_ENTITY, "amount must be positive");
        return Err(HandlerError::from_response(refusal));
    }
    // The claimed transaction: your rows and the ledger's commit together,
    // when the layer commits after this handler returns. Never COMMIT here.
    let mut conn = tx.lock()?;
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO payments (payer, amount, currency) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(payer.as_str())
    .bind(new.amount)
    .bind(&new.currency)
    .fetch_one(&mut *conn)
    .await?;
    let payment = Payment {
        id,
        amount: new.amount,
        currency: new.currency,
    };
    Ok((StatusCode::CREATED, Json(payment)))
}

/// Your authentication: here the bearer token is the payer's id. The layer
/// scopes keys by the `Principal` it finds in the request's extensions.
async fn authenticate(mut req: Request, next: Next) -> Result<Response, StatusCode> {
    let payer = req
        .headers()
        .get("authorization")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .ok_or(StatusCode::UNAUTHORIZED)?;
    let principal = Principal::new(payer);
    req.extensions_mut().insert(principal);
    Ok(next.run(req).await)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The layer logs through `tracing`: a subscriber shows its warnings.
    tracing_subscriber::fmt::init();
    let pool = PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
    tower_idempotency::migrate(&pool).await?; // the ledger; safe to re-run
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS payments (id BIGSERIAL PRIMARY KEY, \
         payer TEXT NOT NULL, amount BIGINT NOT NULL, currency TEXT NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let app = Router::new()
        .route("/payments", post(create_payment))
        .layer(IdempotencyLayer::new(pool)) // POST and PATCH need a key
        .layer(middleware::from_fn(authenticate)); // runs before the layer
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
