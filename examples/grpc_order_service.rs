//! The create-order service over gRPC (tonic), `proto/orders.proto`, with
//! `IdempotencyLayer` as a tower layer of tonic's server.
//!
//! ```text
//! cargo run --example grpc_order_service                  # SQLite file ./grpc_order_service.db
//! DATABASE_URL=postgres://postgres@127.0.0.1/test cargo run --example grpc_order_service
//! cargo run --example grpc_order_service -- --addr 127.0.0.1:50051 --handler-delay-ms 500
//! ```
//!
//! Plain HTTP/2 (no TLS), no server reflection. `CreateOrder` is guarded:
//! the key is the `idempotency-key` metadata entry, the principal the
//! `authorization: Bearer <name>` metadata (read by a tower layer placed
//! before the idempotency layer: a tonic interceptor runs inside the
//! service, after the layer has claimed the key, too late to scope it). The
//! handler takes the claimed transaction from the request's extensions,
//! inserts the order and decrements stock on it; a short item is
//! `FAILED_PRECONDITION`, recorded and replayed like any final answer.
//! `SetStock` (absolute, idempotent by nature) and `GetStock` pass through.
//!
//! The messages are written by hand with prost's derive (`proto/orders.rs`),
//! and so is the service's routing: the build needs no protoc.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::Pool;
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;
use tower_idempotency::{Backend, IdempotencyLayer, Principal, ResourceId, Sweeper, Tx};

#[path = "../proto/orders.rs"]
mod orders;
use orders::{CreateOrderRequest, GetStockRequest, Item, Order, SetStockRequest, Stock};

/// The statements the service runs, per store.
trait OrderDb: Backend {
    const SCHEMA: &'static str;
    const INSERT_ORDER: &'static str;
    const TAKE_STOCK: &'static str;
    const SET_STOCK: &'static str;
    const GET_STOCK: &'static str;
}

macro_rules! order_db {
    ($db:ty, $schema:expr, $p1:literal, $p2:literal, $p3:literal, $p4:literal, $p5:literal, $upsert:literal) => {
        impl OrderDb for $db {
            const SCHEMA: &'static str = $schema;
            const INSERT_ORDER: &'static str = concat!(
                "INSERT INTO grpc_orders (id, principal, currency, amount, created_at) VALUES (",
                $p1,
                ", ",
                $p2,
                ", ",
                $p3,
                ", ",
                $p4,
                ", ",
                $p5,
                ")"
            );
            const TAKE_STOCK: &'static str = concat!(
                "UPDATE grpc_stock SET qty = qty - ",
                $p1,
                " WHERE sku = ",
                $p2,
                " AND qty >= ",
                $p3,
                " RETURNING qty"
            );
            const SET_STOCK: &'static str = $upsert;
            const GET_STOCK: &'static str = concat!("SELECT qty FROM grpc_stock WHERE sku = ", $p1);
        }
    };
}

order_db!(
    sqlx::Sqlite,
    "CREATE TABLE IF NOT EXISTS grpc_orders (id TEXT PRIMARY KEY, principal TEXT NOT NULL, \
     currency TEXT NOT NULL, amount INTEGER NOT NULL, created_at INTEGER NOT NULL); \
     CREATE TABLE IF NOT EXISTS grpc_stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL CHECK (qty >= 0));",
    "?",
    "?",
    "?",
    "?",
    "?",
    "INSERT INTO grpc_stock (sku, qty) VALUES (?, ?) ON CONFLICT (sku) DO UPDATE SET qty = excluded.qty"
);
order_db!(
    sqlx::Postgres,
    "CREATE TABLE IF NOT EXISTS grpc_orders (id TEXT PRIMARY KEY, principal TEXT NOT NULL, \
     currency TEXT NOT NULL, amount BIGINT NOT NULL, created_at BIGINT NOT NULL); \
     CREATE TABLE IF NOT EXISTS grpc_stock (sku TEXT PRIMARY KEY, qty BIGINT NOT NULL CHECK (qty >= 0));",
    "$1",
    "$2",
    "$3",
    "$4",
    "$5",
    "INSERT INTO grpc_stock (sku, qty) VALUES ($1, $2) ON CONFLICT (sku) DO UPDATE SET qty = EXCLUDED.qty"
);

/// Binds and runs one statement on any store.
macro_rules! run {
    ($sql:expr, $conn:expr $(, $arg:expr)*) => {
        sqlx::query(sqlx::AssertSqlSafe($sql)) $(.bind($arg))* .execute($conn)
    };
}

struct App<DB: Backend> {
    pool: Pool<DB>,
    handler_delay: Duration,
}

/// `orders.v1.Orders`, routed by method path (what tonic's generated
/// server does).
struct Orders<DB: Backend>(Arc<App<DB>>);

impl<DB: Backend> Clone for Orders<DB> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<DB: Backend> NamedService for Orders<DB> {
    const NAME: &'static str = orders::SERVICE;
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// One unary method: an async function of the app and the request.
struct Method<DB: Backend, F>(Arc<App<DB>>, F);

impl<DB, F, Fut, Req, Res> UnaryService<Req> for Method<DB, F>
where
    DB: Backend,
    F: Fn(Arc<App<DB>>, Request<Req>) -> Fut,
    Fut: Future<Output = Result<Response<Res>, Status>> + Send + 'static,
{
    type Response = Res;
    type Future = BoxFuture<Response<Res>, Status>;

    fn call(&mut self, request: Request<Req>) -> Self::Future {
        Box::pin((self.1)(Arc::clone(&self.0), request))
    }
}

impl<DB, B> tower::Service<http::Request<B>> for Orders<DB>
where
    DB: OrderDb,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB> + sqlx::Decode<'q, DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let app = Arc::clone(&self.0);
        match req.uri().path() {
            orders::CREATE_ORDER => Box::pin(async move {
                Ok(Grpc::new(ProstCodec::default())
                    .unary(Method(app, create_order::<DB>), req)
                    .await)
            }),
            orders::SET_STOCK => Box::pin(async move {
                Ok(Grpc::new(ProstCodec::default())
                    .unary(Method(app, set_stock::<DB>), req)
                    .await)
            }),
            orders::GET_STOCK => Box::pin(async move {
                Ok(Grpc::new(ProstCodec::default())
                    .unary(Method(app, get_stock::<DB>), req)
                    .await)
            }),
            _ => Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) }),
        }
    }
}

fn db_status(e: sqlx::Error) -> Status {
    // A lost connection, a busy store or a conflict: the caller may retry
    // (with the same key: the layer rolled the attempt back).
    Status::unavailable(format!("database: {e}"))
}

async fn create_order<DB>(
    app: Arc<App<DB>>,
    request: Request<CreateOrderRequest>,
) -> Result<Response<Order>, Status>
where
    DB: OrderDb,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let principal = request
        .extensions()
        .get::<Principal>()
        .map(|p| p.as_str().to_owned())
        .ok_or_else(|| Status::unauthenticated("authorization: Bearer <name> is required"))?;
    let tx = request
        .extensions()
        .get::<Tx<DB>>()
        .cloned()
        .ok_or_else(|| Status::internal("CreateOrder runs behind the idempotency layer"))?;
    let input = request.into_inner();
    validate(&input)?;
    let mut conn = tx.lock().map_err(|e| Status::internal(e.to_string()))?;
    let id = new_order_id();
    run!(
        DB::INSERT_ORDER,
        &mut *conn,
        id.clone(),
        principal,
        input.currency.clone(),
        input.amount,
        now_ms()
    )
    .await
    .map_err(db_status)?;
    for item in &input.items {
        let taken = sqlx::query(sqlx::AssertSqlSafe(DB::TAKE_STOCK))
            .bind(item.qty)
            .bind(item.sku.clone())
            .bind(item.qty)
            .fetch_optional(&mut *conn)
            .await
            .map_err(db_status)?;
        if taken.is_none() {
            // A final business error: the layer rolls the order back to its
            // savepoint and records this answer for every retry.
            // Custom metadata travels with it (trailers-only, as tonic
            // sends every error), and is replayed with it.
            let mut metadata = tonic::metadata::MetadataMap::new();
            metadata.insert(
                "x-reason",
                tonic::metadata::MetadataValue::from_static("stock"),
            );
            return Err(Status::with_metadata(
                tonic::Code::FailedPrecondition,
                format!("not enough stock for {} (wanted {})", item.sku, item.qty),
                metadata,
            ));
        }
    }
    if !app.handler_delay.is_zero() {
        tokio::time::sleep(app.handler_delay).await;
    }
    drop(conn);
    let mut response = Response::new(Order {
        order_id: id.clone(),
        currency: input.currency,
        amount: input.amount,
    });
    response.extensions_mut().insert(ResourceId::new(id));
    Ok(response)
}

fn validate(input: &CreateOrderRequest) -> Result<(), Status> {
    let bad = |m: &str| Err(Status::invalid_argument(m.to_owned()));
    if input.currency.len() != 3 || !input.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return bad("currency must be three upper-case letters");
    }
    if input.items.is_empty() || input.items.len() > 100 {
        return bad("an order has 1 to 100 items");
    }
    if input.amount <= 0 {
        return bad("amount must be positive");
    }
    if input
        .items
        .iter()
        .any(|Item { sku, qty }| sku.is_empty() || sku.len() > 64 || *qty <= 0)
    {
        return bad("every item needs a sku (1 to 64 bytes) and a positive qty");
    }
    Ok(())
}

async fn set_stock<DB>(
    app: Arc<App<DB>>,
    request: Request<SetStockRequest>,
) -> Result<Response<Stock>, Status>
where
    DB: OrderDb,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let SetStockRequest { sku, qty } = request.into_inner();
    if sku.is_empty() || sku.len() > 64 || qty < 0 {
        return Err(Status::invalid_argument(
            "a sku of 1 to 64 bytes and a qty >= 0",
        ));
    }
    let mut conn = app.pool.acquire().await.map_err(db_status)?;
    run!(DB::SET_STOCK, &mut *conn, sku.clone(), qty)
        .await
        .map_err(db_status)?;
    Ok(Response::new(Stock { sku, qty }))
}

async fn get_stock<DB>(
    app: Arc<App<DB>>,
    request: Request<GetStockRequest>,
) -> Result<Response<Stock>, Status>
where
    DB: OrderDb,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: sqlx::Decode<'q, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    let sku = request.into_inner().sku;
    let mut conn = app.pool.acquire().await.map_err(db_status)?;
    let row = sqlx::query(sqlx::AssertSqlSafe(DB::GET_STOCK))
        .bind(sku.clone())
        .fetch_optional(&mut *conn)
        .await
        .map_err(db_status)?;
    let Some(row) = row else {
        return Err(Status::not_found(format!("no stock for {sku}")));
    };
    let qty: i64 = sqlx::Row::try_get(&row, 0usize).map_err(db_status)?;
    Ok(Response::new(Stock { sku, qty }))
}

/// `authorization: Bearer <name>` becomes the request's [`Principal`]; a
/// request without one reaches the idempotency layer unscoped and is
/// refused there (`UNAUTHENTICATED`) on the guarded method.
fn authenticate<B>(mut req: http::Request<B>) -> http::Request<B> {
    let name = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|name| !name.is_empty() && name.len() <= 128)
        .map(str::to_owned);
    if let Some(name) = name {
        req.extensions_mut().insert(Principal::new(name));
    }
    req
}

fn new_order_id() -> String {
    format!("o-{:016x}", random_u64())
}

/// 64 bits that differ per call (time, a counter and the process id mixed;
/// enough for an example's order ids, whose uniqueness the primary key
/// checks anyway).
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(now_ns());
    h.write_u32(std::process::id());
    h.finish()
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

fn now_ms() -> i64 {
    i64::try_from(now_ns() / 1_000_000).unwrap_or(i64::MAX)
}

async fn serve<DB>(
    pool: Pool<DB>,
    args: &Args,
    store: &str,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB: OrderDb,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB> + sqlx::Decode<'q, DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    tower_idempotency::migrate(&pool).await?;
    sqlx::raw_sql(DB::SCHEMA).execute(&pool).await?;
    let sweeper = Sweeper::new(pool.clone()).spawn(Duration::from_secs(60));
    // The key guards CreateOrder alone; every gRPC call is a POST, so the
    // layer is told the path. Retries replay for 24 hours.
    let idempotency = IdempotencyLayer::new(pool.clone())
        .with_paths([orders::CREATE_ORDER])
        .with_retention(Duration::from_secs(24 * 3600));
    let listener = tokio::net::TcpListener::bind(args.addr).await?;
    println!(
        "grpc_order_service listening on http://{} (store: {store})",
        listener.local_addr()?
    );
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let app = Arc::new(App {
        pool: pool.clone(),
        handler_delay: args.handler_delay,
    });
    tonic::transport::Server::builder()
        .layer(tower::util::MapRequestLayer::new(authenticate))
        .layer(idempotency)
        .add_service(Orders(app))
        .serve_with_incoming_shutdown(incoming, shutdown_signal())
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
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        addr: ([127, 0, 0, 1], 50051).into(),
        handler_delay: Duration::ZERO,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
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
                    "unknown flag {other}; use --addr HOST:PORT, --handler-delay-ms N"
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
        return serve(sqlx::PgPool::connect(&url).await?, &args, "postgres").await;
    } else if url.is_empty() || url.starts_with("sqlite:") {
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
        let options = if url.is_empty() {
            SqliteConnectOptions::new().filename("grpc_order_service.db")
        } else {
            url.parse::<SqliteConnectOptions>()?
        };
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal);
        let store = format!("sqlite ({})", options.get_filename().display());
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .connect_with(options)
            .await?;
        return serve(pool, &args, &store).await;
    }
    Err(format!("unsupported DATABASE_URL {url:?}: use postgres:// or sqlite:").into())
}
