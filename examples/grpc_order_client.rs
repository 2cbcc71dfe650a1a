//! A client of `grpc_order_service` that makes each order exactly once
//! however many answers the network loses: the crate's
//! `IdempotentRetryLayer` in front of a tonic `Channel` keeps one key per
//! logical call (sent as `idempotency-key` metadata) and retries lost
//! answers and `UNAVAILABLE` (honouring `grpc-retry-pushback-ms`) with it.
//!
//! ```text
//! cargo run --example grpc_order_service -- --addr 127.0.0.1:50051 &
//! cargo run --example grpc_order_client --features client -- --addr 127.0.0.1:50051 --orders 3
//! ```
//!
//! Prints one line per order (`order <id> attempts <n> replayed <bool>`).

use std::time::Duration;

use tonic::transport::Endpoint;
use tonic_prost::ProstCodec;
use tower_idempotency::client::{IdempotentRetryLayer, RetryBody, RetryReport};

#[path = "../proto/orders.rs"]
#[allow(dead_code)]
mod orders;
use orders::{CreateOrderRequest, Item, Order, SetStockRequest, Stock};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut addr = "127.0.0.1:50051".to_string();
    let mut count = 1u32;
    let mut token = "alice".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--addr" => addr = value,
            "--orders" => count = value.parse()?,
            "--token" => token = value,
            other => {
                return Err(format!("unknown flag {other}; use --addr, --orders, --token").into());
            }
        }
    }
    let channel = Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect_lazy();
    // Retries outside, the channel inside: every attempt of one call
    // carries the key the layer chose for it.
    let client = tower::ServiceBuilder::new()
        .layer(
            IdempotentRetryLayer::new()
                .with_max_attempts(8)
                .with_backoff(Duration::from_millis(50), Duration::from_secs(2))
                .with_deadline(Duration::from_secs(60)),
        )
        .map_request(|req: http::Request<RetryBody>| req.map(tonic::body::Body::new))
        .service(channel);
    let mut grpc = tonic::client::Grpc::new(client);

    grpc.ready().await?;
    let stock: tonic::Response<Stock> = grpc
        .unary(
            tonic::Request::new(SetStockRequest {
                sku: "A-10".into(),
                qty: 1_000,
            }),
            http::uri::PathAndQuery::from_static(orders::SET_STOCK),
            ProstCodec::default(),
        )
        .await?;
    println!("stock {} {}", stock.get_ref().sku, stock.get_ref().qty);
    for _ in 0..count {
        let mut request = tonic::Request::new(CreateOrderRequest {
            currency: "KRW".into(),
            items: vec![Item {
                sku: "A-10".into(),
                qty: 1,
            }],
            amount: 12_000,
        });
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse()?);
        grpc.ready().await?;
        let order: tonic::Response<Order> = grpc
            .unary(
                request,
                http::uri::PathAndQuery::from_static(orders::CREATE_ORDER),
                ProstCodec::default(),
            )
            .await?;
        let report = order.extensions().get::<RetryReport>().cloned();
        println!(
            "order {} attempts {} replayed {}",
            order.get_ref().order_id,
            report.as_ref().map_or(1, |r| r.attempts),
            report.is_some_and(|r| r.replayed),
        );
    }
    Ok(())
}
