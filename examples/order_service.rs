//! A create-order service (orders, their items, stock), on top of
//! `IdempotencyLayer`.
//!
//! ```text
//! cargo run --example order_service                      # SQLite file ./order_service.db
//! DATABASE_URL=postgres://postgres@127.0.0.1/test cargo run --example order_service
//! cargo run --example order_service -- --addr 127.0.0.1:3001 --handler-delay-ms 500
//! cargo run --example order_service -- --claim-at-commit   # IdempotencyLayer::with_claim_at_commit
//! ```
//!
//! How a `POST /orders` flows, step by step. Each step opens with the line
//! of the textbook pseudo-code of one create-order attempt (a transaction
//! that claims the key, takes a savepoint, writes, records and commits)
//! that it implements; the whole pseudo-code is those lines, in order:
//!
//! 1. `principal = authenticate(request)`: [`authenticate`] turns
//!    `Authorization: Bearer <principal>` into a [`Principal`] (401 without).
//! 2. `normalized = normalizeOrderInput(request.body)` and `validate(normalized)`:
//!    [`normalize_order`] is the layer's normalizer. It parses the body into
//!    [`CreateOrder`] (so a missing `memo` and `"memo":""` are the same),
//!    validates it (400 before any claim), and returns the bytes that are
//!    fingerprinted.
//! 3. `tx = db.begin()`, `tx.insertIdempotencyIfAbsent(…)`, the lost-claim
//!    branch and `retryWithSameKey`: all inside `IdempotencyLayer` (claim,
//!    replay, 422 on a changed payload, 409 while in flight, 410 once expired).
//! 4. `savepoint = tx.savepoint()`: taken by the layer right after the claim.
//! 5. `insertOrder`, `decreaseStock`: [`create_order`] writes the order, its
//!    items and the stock decrements on the claimed transaction ([`Tx`]). A
//!    short item is a final business error (`FinalBusinessError`): a `409`
//!    whose type ends in `out-of-stock`. The layer rolls back to the
//!    savepoint (the order row and earlier decrements vanish) and records
//!    `FAILED_FINAL`.
//! 6. `tx.updateIdempotency(…SUCCEEDED…)`, `tx.commit()`: done by the layer
//!    with the `201` response, in the handler's own transaction.
//!
//! 7. Retention: keys replay for 24 hours (`Idempotency-Key-Expires` says
//!    until when), then answer `410` linking the order; a [`Sweeper`] runs
//!    every minute, turning expired answers into tombstones and deleting
//!    tombstones after 90 days.
//!
//! Other routes: `PATCH /orders/{id}` `{"memo":"…"}` changes an order's
//! memo and appends the change to its history (guarded like `POST`: a key
//! required, a retry replayed, never a second change); `DELETE /orders/{id}`
//! deletes it (idempotent by nature, so unguarded: `204`, then `404`);
//! `PUT /stock/{sku}` `{"qty":N}` sets stock (idempotent by
//! nature, no key); `GET /stock/{sku}`; `GET /orders/{id}` (owner only, else
//! 404); `GET /idempotency-keys?operation=create-order` with the key in
//! `Idempotency-Key`: where the caller's own key stands; `GET /health`.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::Pool;
use tower_idempotency::store::StoreErrorKind;
use tower_idempotency::{
    Backend, FingerprintError, HandlerError, IdempotencyLayer, Normalizer, Principal, ResourceId,
    Sweeper, Tx,
};

/// The `POST /orders` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateOrder {
    currency: String,
    items: Vec<LineItem>,
    amount: i64,
    #[serde(default)]
    memo: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LineItem {
    sku: String,
    qty: i64,
}

impl CreateOrder {
    fn validate(&self) -> Result<(), String> {
        if self.items.is_empty() {
            return Err("items must not be empty".into());
        }
        if let Some(item) = self.items.iter().find(|i| i.qty < 1) {
            return Err(format!("qty of {} must be at least 1", item.sku));
        }
        if self
            .items
            .iter()
            .any(|i| i.sku.is_empty() || i.sku.len() > 64)
        {
            return Err("sku must be 1 to 64 characters".into());
        }
        if self.amount < 0 {
            return Err("amount must not be negative".into());
        }
        if self.currency.len() != 3 || !self.currency.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err("currency must be an ISO 4217 code such as KRW".into());
        }
        if self.memo.len() > 500 {
            return Err("memo must be at most 500 characters".into());
        }
        Ok(())
    }
}

/// Parse, fill defaults, validate, and produce the canonical bytes that
/// are fingerprinted (serde writes struct fields in declaration order).
fn normalize_order(
    _: &axum::http::request::Parts,
    body: &bytes::Bytes,
) -> Result<Vec<u8>, FingerprintError> {
    let order: CreateOrder = serde_json::from_slice(body)
        .map_err(|e| FingerprintError::new(format!("invalid order: {e}")))?;
    order.validate().map_err(FingerprintError::new)?;
    serde_json::to_vec(&order).map_err(|e| FingerprintError::new(e.to_string()))
}

/// The example's own tables and statements, per database.
trait OrderDb: Backend {
    /// Creates the example's tables if missing.
    fn create_schema(pool: &Pool<Self>) -> impl Future<Output = sqlx::Result<()>> + Send;
    fn insert_order(
        conn: &mut Self::Connection,
        o: &OrderRow,
    ) -> impl Future<Output = sqlx::Result<()>> + Send;
    fn insert_item(
        conn: &mut Self::Connection,
        order_id: &str,
        line: i64,
        item: &LineItem,
    ) -> impl Future<Output = sqlx::Result<()>> + Send;
    /// Conditional decrement: `false` when the item is short.
    fn take_stock(
        conn: &mut Self::Connection,
        item: &LineItem,
    ) -> impl Future<Output = sqlx::Result<bool>> + Send;
    fn set_stock(
        pool: &Pool<Self>,
        sku: &str,
        qty: i64,
    ) -> impl Future<Output = sqlx::Result<()>> + Send;
    fn stock(
        pool: &Pool<Self>,
        sku: &str,
    ) -> impl Future<Output = sqlx::Result<Option<i64>>> + Send;
    fn order(
        pool: &Pool<Self>,
        id: &str,
        principal: &str,
    ) -> impl Future<Output = sqlx::Result<Option<(OrderRow, Vec<LineItem>)>>> + Send;
    /// Sets the memo of `principal`'s order `id` and appends the change to
    /// its history: `false` when there is no such order.
    fn update_memo(
        conn: &mut Self::Connection,
        id: &str,
        principal: &str,
        memo: &str,
    ) -> impl Future<Output = sqlx::Result<bool>> + Send;
    /// Deletes `principal`'s order `id` with its items and history, in a
    /// transaction of its own: `false` when there is no such order.
    fn delete_order(
        pool: &Pool<Self>,
        id: &str,
        principal: &str,
    ) -> impl Future<Output = sqlx::Result<bool>> + Send;
}

#[derive(Debug, Clone)]
struct OrderRow {
    id: String,
    principal: String,
    currency: String,
    amount: i64,
    memo: String,
    created_at: i64,
}

impl OrderRow {
    fn to_json(&self, items: &[LineItem]) -> serde_json::Value {
        json!({
            "orderId": self.id,
            "principal": self.principal,
            "currency": self.currency,
            "items": items,
            "amount": self.amount,
            "memo": self.memo,
            "createdAt": self.created_at,
        })
    }
}

/// One implementation per database; only the SQL text differs.
macro_rules! order_db {
    ($db:ty, schema: $schema:expr, insert_order: $io:expr, insert_item: $ii:expr,
     take_stock: $ts:expr, set_stock: $ss:expr, stock: $st:expr, order: $o:expr, items: $it:expr,
     update_memo: $um:expr, log_change: $lc:expr, owner: $ow:expr, delete: [$($del:expr),* $(,)?] $(,)?) => {
        impl OrderDb for $db {
            async fn create_schema(pool: &Pool<Self>) -> sqlx::Result<()> {
                sqlx::raw_sql($schema).execute(pool).await.map(drop)
            }

            async fn insert_order(conn: &mut Self::Connection, o: &OrderRow) -> sqlx::Result<()> {
                sqlx::query($io)
                    .bind(&o.id)
                    .bind(&o.principal)
                    .bind(&o.currency)
                    .bind(o.amount)
                    .bind(&o.memo)
                    .bind(o.created_at)
                    .execute(conn)
                    .await
                    .map(drop)
            }

            async fn insert_item(
                conn: &mut Self::Connection,
                order_id: &str,
                line: i64,
                item: &LineItem,
            ) -> sqlx::Result<()> {
                sqlx::query($ii)
                    .bind(order_id)
                    .bind(line)
                    .bind(&item.sku)
                    .bind(item.qty)
                    .execute(conn)
                    .await
                    .map(drop)
            }

            async fn take_stock(
                conn: &mut Self::Connection,
                item: &LineItem,
            ) -> sqlx::Result<bool> {
                let done = sqlx::query($ts)
                    .bind(item.qty)
                    .bind(&item.sku)
                    .bind(item.qty)
                    .execute(conn)
                    .await?;
                Ok(done.rows_affected() == 1)
            }

            async fn set_stock(pool: &Pool<Self>, sku: &str, qty: i64) -> sqlx::Result<()> {
                sqlx::query($ss)
                    .bind(sku)
                    .bind(qty)
                    .execute(pool)
                    .await
                    .map(drop)
            }

            async fn stock(pool: &Pool<Self>, sku: &str) -> sqlx::Result<Option<i64>> {
                sqlx::query_scalar($st).bind(sku).fetch_optional(pool).await
            }

            async fn order(
                pool: &Pool<Self>,
                id: &str,
                principal: &str,
            ) -> sqlx::Result<Option<(OrderRow, Vec<LineItem>)>> {
                let row: Option<(String, String, String, i64, String, i64)> = sqlx::query_as($o)
                    .bind(id)
                    .bind(principal)
                    .fetch_optional(pool)
                    .await?;
                let Some((id, principal, currency, amount, memo, created_at)) = row else {
                    return Ok(None);
                };
                let items: Vec<(String, i64)> =
                    sqlx::query_as($it).bind(&id).fetch_all(pool).await?;
                let items = items
                    .into_iter()
                    .map(|(sku, qty)| LineItem { sku, qty })
                    .collect();
                Ok(Some((
                    OrderRow {
                        id,
                        principal,
                        currency,
                        amount,
                        memo,
                        created_at,
                    },
                    items,
                )))
            }

            async fn update_memo(
                conn: &mut Self::Connection,
                id: &str,
                principal: &str,
                memo: &str,
            ) -> sqlx::Result<bool> {
                let done = sqlx::query($um)
                    .bind(memo)
                    .bind(id)
                    .bind(principal)
                    .execute(&mut *conn)
                    .await?;
                if done.rows_affected() != 1 {
                    return Ok(false);
                }
                sqlx::query($lc)
                    .bind(id)
                    .bind(memo)
                    .bind(now_ms())
                    .execute(&mut *conn)
                    .await?;
                Ok(true)
            }

            async fn delete_order(
                pool: &Pool<Self>,
                id: &str,
                principal: &str,
            ) -> sqlx::Result<bool> {
                let mut tx = pool.begin().await?;
                let owned: Option<String> = sqlx::query_scalar($ow)
                    .bind(id)
                    .bind(principal)
                    .fetch_optional(&mut *tx)
                    .await?;
                if owned.is_none() {
                    return Ok(false);
                }
                for sql in [$($del),*] {
                    sqlx::query(sql).bind(id).execute(&mut *tx).await?;
                }
                tx.commit().await?;
                Ok(true)
            }
        }
    };
}

#[cfg(feature = "sqlite")]
order_db!(
    sqlx::Sqlite,
    schema: "
        CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, principal TEXT NOT NULL, currency TEXT NOT NULL,
            amount INTEGER NOT NULL, memo TEXT NOT NULL, created_at INTEGER NOT NULL);
        CREATE TABLE IF NOT EXISTS order_items (order_id TEXT NOT NULL REFERENCES orders (id), line INTEGER NOT NULL,
            sku TEXT NOT NULL, qty INTEGER NOT NULL, PRIMARY KEY (order_id, line));
        CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL CHECK (qty >= 0));
        CREATE TABLE IF NOT EXISTS order_changes (order_id TEXT NOT NULL, memo TEXT NOT NULL, changed_at INTEGER NOT NULL);",
    insert_order: "INSERT INTO orders (id, principal, currency, amount, memo, created_at) VALUES (?, ?, ?, ?, ?, ?)",
    insert_item: "INSERT INTO order_items (order_id, line, sku, qty) VALUES (?, ?, ?, ?)",
    take_stock: "UPDATE stock SET qty = qty - ? WHERE sku = ? AND qty >= ?",
    set_stock: "INSERT INTO stock (sku, qty) VALUES (?, ?) ON CONFLICT (sku) DO UPDATE SET qty = excluded.qty",
    stock: "SELECT qty FROM stock WHERE sku = ?",
    order: "SELECT id, principal, currency, amount, memo, created_at FROM orders WHERE id = ? AND principal = ?",
    items: "SELECT sku, qty FROM order_items WHERE order_id = ? ORDER BY line",
    update_memo: "UPDATE orders SET memo = ? WHERE id = ? AND principal = ?",
    log_change: "INSERT INTO order_changes (order_id, memo, changed_at) VALUES (?, ?, ?)",
    owner: "SELECT id FROM orders WHERE id = ? AND principal = ?",
    delete: [
        "DELETE FROM order_items WHERE order_id = ?",
        "DELETE FROM order_changes WHERE order_id = ?",
        "DELETE FROM orders WHERE id = ?",
    ],
);

#[cfg(feature = "postgres")]
order_db!(
    sqlx::Postgres,
    schema: "
        CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, principal TEXT NOT NULL, currency TEXT NOT NULL,
            amount BIGINT NOT NULL, memo TEXT NOT NULL, created_at BIGINT NOT NULL);
        CREATE TABLE IF NOT EXISTS order_items (order_id TEXT NOT NULL REFERENCES orders (id), line BIGINT NOT NULL,
            sku TEXT NOT NULL, qty BIGINT NOT NULL, PRIMARY KEY (order_id, line));
        CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, qty BIGINT NOT NULL CHECK (qty >= 0));
        CREATE TABLE IF NOT EXISTS order_changes (order_id TEXT NOT NULL, memo TEXT NOT NULL, changed_at BIGINT NOT NULL);",
    insert_order: "INSERT INTO orders (id, principal, currency, amount, memo, created_at) VALUES ($1, $2, $3, $4, $5, $6)",
    insert_item: "INSERT INTO order_items (order_id, line, sku, qty) VALUES ($1, $2, $3, $4)",
    take_stock: "UPDATE stock SET qty = qty - $1 WHERE sku = $2 AND qty >= $3",
    set_stock: "INSERT INTO stock (sku, qty) VALUES ($1, $2) ON CONFLICT (sku) DO UPDATE SET qty = excluded.qty",
    stock: "SELECT qty FROM stock WHERE sku = $1",
    order: "SELECT id, principal, currency, amount, memo, created_at FROM orders WHERE id = $1 AND principal = $2",
    items: "SELECT sku, qty FROM order_items WHERE order_id = $1 ORDER BY line",
    update_memo: "UPDATE orders SET memo = $1 WHERE id = $2 AND principal = $3",
    log_change: "INSERT INTO order_changes (order_id, memo, changed_at) VALUES ($1, $2, $3)",
    owner: "SELECT id FROM orders WHERE id = $1 AND principal = $2",
    delete: [
        "DELETE FROM order_items WHERE order_id = $1",
        "DELETE FROM order_changes WHERE order_id = $1",
        "DELETE FROM orders WHERE id = $1",
    ],
);

#[cfg(feature = "mysql")]
order_db!(
    sqlx::MySql,
    schema: "
        CREATE TABLE IF NOT EXISTS orders (id VARCHAR(64) PRIMARY KEY, principal TEXT NOT NULL,
            currency CHAR(3) NOT NULL, amount BIGINT NOT NULL, memo VARCHAR(500) NOT NULL, created_at BIGINT NOT NULL) ENGINE = InnoDB;
        CREATE TABLE IF NOT EXISTS order_items (order_id VARCHAR(64) NOT NULL, line BIGINT NOT NULL,
            sku VARCHAR(64) NOT NULL, qty BIGINT NOT NULL, PRIMARY KEY (order_id, line),
            FOREIGN KEY (order_id) REFERENCES orders (id)) ENGINE = InnoDB;
        CREATE TABLE IF NOT EXISTS stock (sku VARCHAR(64) PRIMARY KEY, qty BIGINT NOT NULL CHECK (qty >= 0)) ENGINE = InnoDB;
        CREATE TABLE IF NOT EXISTS order_changes (order_id VARCHAR(64) NOT NULL, memo VARCHAR(500) NOT NULL,
            changed_at BIGINT NOT NULL) ENGINE = InnoDB;",
    insert_order: "INSERT INTO orders (id, principal, currency, amount, memo, created_at) VALUES (?, ?, ?, ?, ?, ?)",
    insert_item: "INSERT INTO order_items (order_id, line, sku, qty) VALUES (?, ?, ?, ?)",
    take_stock: "UPDATE stock SET qty = qty - ? WHERE sku = ? AND qty >= ?",
    set_stock: "INSERT INTO stock (sku, qty) VALUES (?, ?) ON DUPLICATE KEY UPDATE qty = VALUES(qty)",
    stock: "SELECT qty FROM stock WHERE sku = ?",
    order: "SELECT id, principal, currency, amount, memo, created_at FROM orders WHERE id = ? AND principal = ?",
    items: "SELECT sku, qty FROM order_items WHERE order_id = ? ORDER BY line",
    update_memo: "UPDATE orders SET memo = ? WHERE id = ? AND principal = ?",
    log_change: "INSERT INTO order_changes (order_id, memo, changed_at) VALUES (?, ?, ?)",
    owner: "SELECT id FROM orders WHERE id = ? AND principal = ?",
    delete: [
        "DELETE FROM order_items WHERE order_id = ?",
        "DELETE FROM order_changes WHERE order_id = ?",
        "DELETE FROM orders WHERE id = ?",
    ],
);

struct App<DB: OrderDb> {
    pool: Pool<DB>,
    handler_delay: Duration,
}

impl<DB: OrderDb> Clone for App<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            handler_delay: self.handler_delay,
        }
    }
}

fn problem(status: StatusCode, kind: &str, title: &str, detail: String) -> Response {
    let doc = json!({
        "type": format!("https://example.com/problems/{kind}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        doc.to_string(),
    )
        .into_response()
}

fn internal(e: impl std::fmt::Display) -> Response {
    eprintln!("order_service: {e}");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "Internal error",
        "the order could not be processed; retry with the same key".into(),
    )
}

/// A database error: a lost connection, a busy store or a serialization
/// conflict rolled everything back and is worth a retry (`503` with
/// `Retry-After`); anything else is a bug (`500`).
fn db_error<DB: Backend>(e: sqlx::Error) -> Response {
    match DB::error_kind(&e) {
        StoreErrorKind::ConnectionLost | StoreErrorKind::Busy | StoreErrorKind::Conflict => {
            eprintln!("order_service: transient database error: {e}");
            let mut res = problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "Temporarily unavailable",
                "the database could not complete the order; nothing was kept, retry with the same key".into(),
            );
            res.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
            res
        }
        _ => internal(e),
    }
}

/// Demo authentication: any non-empty Bearer token is the principal.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_owned);
    let Some(token) = token else {
        return problem(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "Authentication required",
            "send Authorization: Bearer <principal>".into(),
        );
    };
    req.extensions_mut().insert(Principal::new(token));
    next.run(req).await
}

fn new_order_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    format!("o-{:016x}", h.finish())
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// `POST /orders`: runs on the transaction that holds the idempotency claim.
async fn create_order<DB: OrderDb>(
    State(app): State<App<DB>>,
    Extension(principal): Extension<Principal>,
    tx: Tx<DB>,
    Json(input): Json<CreateOrder>,
) -> Response {
    let mut conn = match tx.lock() {
        Ok(conn) => conn,
        Err(e) => return internal(e),
    };
    let order = OrderRow {
        id: new_order_id(),
        principal: principal.as_str().to_owned(),
        currency: input.currency,
        amount: input.amount,
        memo: input.memo,
        created_at: now_ms(),
    };
    if let Err(e) = DB::insert_order(&mut conn, &order).await {
        return db_error::<DB>(e);
    }
    for (line, item) in (1..).zip(&input.items) {
        if let Err(e) = DB::insert_item(&mut conn, &order.id, line, item).await {
            return db_error::<DB>(e);
        }
    }
    for item in &input.items {
        match DB::take_stock(&mut conn, item).await {
            Ok(true) => {}
            // A final business error: the layer rolls back to its
            // savepoint (this order and earlier decrements) and records it.
            Ok(false) => {
                let detail = format!("not enough stock for {} (wanted {})", item.sku, item.qty);
                return problem(StatusCode::CONFLICT, "out-of-stock", "Out of stock", detail);
            }
            Err(e) => return db_error::<DB>(e),
        }
    }
    if !app.handler_delay.is_zero() {
        tokio::time::sleep(app.handler_delay).await;
    }
    drop(conn);
    let location = format!("/orders/{}", order.id);
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Extension(ResourceId::new(order.id.clone())),
        Json(order.to_json(&input.items)),
    )
        .into_response()
}

async fn get_order<DB: OrderDb>(
    State(app): State<App<DB>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Response {
    match DB::order(&app.pool, &id, principal.as_str()).await {
        Ok(Some((order, items))) => Json(order.to_json(&items)).into_response(),
        Ok(None) => problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "Not found",
            format!("no order {id}"),
        ),
        Err(e) => db_error::<DB>(e),
    }
}

/// The `PATCH /orders/{id}` body (a JSON merge patch of the one field an
/// order lets change).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateOrder {
    memo: String,
}

/// `PATCH /orders/{id}`: guarded by the layer like `POST` (PATCH is not
/// idempotent: each change is appended to the order's history), so a key
/// is required and a retry replays the first answer without a second
/// change. Written with `?` on the transaction and sqlx: [`HandlerError`]
/// answers their errors as problem documents.
async fn update_order<DB: OrderDb>(
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    tx: Tx<DB>,
    Json(patch): Json<UpdateOrder>,
) -> Result<Response, HandlerError> {
    if patch.memo.len() > 500 {
        let detail = "memo must be at most 500 characters".to_owned();
        return Ok(problem(
            StatusCode::BAD_REQUEST,
            "invalid-order",
            "Invalid order",
            detail,
        ));
    }
    let mut conn = tx.lock()?;
    if !DB::update_memo(&mut conn, &id, principal.as_str(), &patch.memo).await? {
        let detail = format!("no order {id}");
        return Ok(problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "Not found",
            detail,
        ));
    }
    drop(conn);
    Ok(Json(json!({"orderId": id, "memo": patch.memo})).into_response())
}

/// `DELETE /orders/{id}`: idempotent by nature (a second delete finds
/// nothing more to delete), so the layer lets it pass unguarded, key or
/// not, as the IETF draft describes: `204`, then `404`.
async fn delete_order<DB: OrderDb>(
    State(app): State<App<DB>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Response, HandlerError> {
    if DB::delete_order(&app.pool, &id, principal.as_str()).await? {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        let detail = format!("no order {id}");
        Ok(problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "Not found",
            detail,
        ))
    }
}

#[derive(Deserialize)]
struct SetStock {
    qty: i64,
}

async fn put_stock<DB: OrderDb>(
    State(app): State<App<DB>>,
    Path(sku): Path<String>,
    Json(body): Json<SetStock>,
) -> Response {
    if body.qty < 0 || sku.is_empty() || sku.len() > 64 {
        return problem(
            StatusCode::BAD_REQUEST,
            "invalid-stock",
            "Invalid stock",
            "qty must be >= 0 and sku 1 to 64 characters".into(),
        );
    }
    match DB::set_stock(&app.pool, &sku, body.qty).await {
        Ok(()) => Json(json!({"sku": sku, "qty": body.qty})).into_response(),
        Err(e) => db_error::<DB>(e),
    }
}

async fn get_stock<DB: OrderDb>(State(app): State<App<DB>>, Path(sku): Path<String>) -> Response {
    match DB::stock(&app.pool, &sku).await {
        Ok(Some(qty)) => Json(json!({"sku": sku, "qty": qty})).into_response(),
        Ok(None) => problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "Not found",
            format!("no stock for {sku}"),
        ),
        Err(e) => db_error::<DB>(e),
    }
}

fn router<DB: OrderDb>(
    pool: Pool<DB>,
    handler_delay: Duration,
    claim_at_commit: bool,
) -> Result<Router, tower_idempotency::ConfigError> {
    // Retention: a key replays for 24 hours, then answers 410 with a link to
    // the order; tombstones are kept 90 days (see the sweeper in `serve`).
    let idempotency = IdempotencyLayer::new(pool.clone())
        .with_operation("create-order")
        .with_normalizer(Normalizer::custom(normalize_order))
        .with_retention(Duration::from_secs(24 * 3600))
        .with_resource_link(|id| format!("/orders/{id}"));
    // `--claim-at-commit`: the handler runs at once and the ledger row is
    // written with the `COMMIT` (one ledger write; a duplicate's handler
    // may run and be rolled back).
    let idempotency = if claim_at_commit {
        idempotency.with_claim_at_commit()
    } else {
        idempotency
    };
    // "Did my key land?": the same layer's keys, behind the same
    // authentication (`GET /idempotency-keys?operation=create-order`).
    let key_status = idempotency.key_status();
    // One order: GET and DELETE pass through (idempotent methods); PATCH
    // is guarded (a key required, replayed), in a scope of its own.
    let updates = IdempotencyLayer::new(pool.clone())
        .with_operation("update-order")
        .with_retention(Duration::from_secs(24 * 3600));
    let order = get(get_order::<DB>)
        .patch(update_order::<DB>)
        .delete(delete_order::<DB>)
        .layer(updates);
    let orders = Router::new()
        .route("/orders", post(create_order::<DB>).layer(idempotency))
        .route("/orders/{id}", order)
        .route_service("/idempotency-keys", axum::routing::any_service(key_status))
        .layer(middleware::from_fn(authenticate));
    Ok(Router::new()
        .merge(orders)
        .route("/stock/{sku}", get(get_stock::<DB>).put(put_stock::<DB>))
        .route("/health", get(|| async { "ok" }))
        .with_state(App {
            pool,
            handler_delay,
        }))
}

async fn serve<DB: OrderDb>(
    pool: Pool<DB>,
    args: &Args,
    store: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    tower_idempotency::migrate(&pool).await?;
    DB::create_schema(&pool).await?;
    let sweeper = Sweeper::new(pool.clone()).spawn(Duration::from_secs(60));
    let listener = tokio::net::TcpListener::bind(args.addr).await?;
    println!(
        "order_service listening on http://{} (store: {store})",
        listener.local_addr()?
    );
    axum::serve(
        listener,
        router(pool.clone(), args.handler_delay, args.claim_at_commit)?,
    )
    .with_graceful_shutdown(shutdown_signal())
    .await?;
    sweeper.abort();
    pool.close().await;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

struct Args {
    addr: SocketAddr,
    handler_delay: Duration,
    claim_at_commit: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        addr: ([127, 0, 0, 1], 3000).into(),
        handler_delay: Duration::ZERO,
        claim_at_commit: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--claim-at-commit" {
            args.claim_at_commit = true;
            continue;
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--addr" => args.addr = value.parse().map_err(|e| format!("--addr {value}: {e}"))?,
            "--handler-delay-ms" => {
                let ms: u64 = value
                    .parse()
                    .map_err(|e| format!("--handler-delay-ms {value}: {e}"))?;
                args.handler_delay = Duration::from_millis(ms);
            }
            other => {
                return Err(format!(
                    "unknown flag {other}; use --addr HOST:PORT, --handler-delay-ms N, --claim-at-commit"
                ));
            }
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let url = std::env::var("DATABASE_URL").unwrap_or_default();
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        #[cfg(feature = "postgres")]
        return serve(sqlx::PgPool::connect(&url).await?, &args, "postgres").await;
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        #[cfg(feature = "mysql")]
        return serve(sqlx::MySqlPool::connect(&url).await?, &args, "mysql").await;
        #[cfg(not(feature = "mysql"))]
        return Err(
            "mysql:// needs the mysql feature: cargo run --example order_service --features mysql"
                .into(),
        );
    } else if url.is_empty() || url.starts_with("sqlite:") {
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
        let options = if url.is_empty() {
            SqliteConnectOptions::new().filename("order_service.db")
        } else {
            url.parse::<SqliteConnectOptions>()?
        };
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .foreign_keys(true);
        let store = format!("sqlite ({})", options.get_filename().display());
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .connect_with(options)
            .await?;
        return serve(pool, &args, &store).await;
    }
    Err(format!("unsupported DATABASE_URL {url:?}: use postgres://, mysql:// or sqlite:").into())
}
