//! `orders.proto`'s messages and method paths, written by hand with prost's
//! derive (no protoc, no build script): shared by `examples/grpc_order_service.rs`
//! and its tests (`#[path]`). Keep in step with `orders.proto`.

/// `orders.v1.Item`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Item {
    #[prost(string, tag = "1")]
    pub sku: String,
    #[prost(int64, tag = "2")]
    pub qty: i64,
}

/// `orders.v1.CreateOrderRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CreateOrderRequest {
    #[prost(string, tag = "1")]
    pub currency: String,
    #[prost(message, repeated, tag = "2")]
    pub items: Vec<Item>,
    #[prost(int64, tag = "3")]
    pub amount: i64,
}

/// `orders.v1.Order`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Order {
    #[prost(string, tag = "1")]
    pub order_id: String,
    #[prost(string, tag = "2")]
    pub currency: String,
    #[prost(int64, tag = "3")]
    pub amount: i64,
}

/// `orders.v1.SetStockRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SetStockRequest {
    #[prost(string, tag = "1")]
    pub sku: String,
    #[prost(int64, tag = "2")]
    pub qty: i64,
}

/// `orders.v1.GetStockRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct GetStockRequest {
    #[prost(string, tag = "1")]
    pub sku: String,
}

/// `orders.v1.Stock`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Stock {
    #[prost(string, tag = "1")]
    pub sku: String,
    #[prost(int64, tag = "2")]
    pub qty: i64,
}

/// The service's name, as gRPC routes it.
pub const SERVICE: &str = "orders.v1.Orders";
/// `CreateOrder`'s path: the one method the idempotency layer guards.
pub const CREATE_ORDER: &str = "/orders.v1.Orders/CreateOrder";
/// `SetStock`'s path.
pub const SET_STOCK: &str = "/orders.v1.Orders/SetStock";
/// `GetStock`'s path.
pub const GET_STOCK: &str = "/orders.v1.Orders/GetStock";
