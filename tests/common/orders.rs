//! An order sent to the example order service from outside. Uses the
//! `http_call` module of the test crate that includes it.

use http::Method;

use crate::http_call::{Answer, try_http_call};

/// One unit of `A-10`, as `user-42`.
pub const ORDER: &str = r#"{"currency":"KRW","items":[{"sku":"A-10","qty":1}],"amount":12000}"#;

/// `POST /orders` with [`ORDER`] and `key` (sent as a quoted string);
/// `Err` when the connection dies first.
pub async fn order(addr: &str, key: &str) -> Result<Answer, hyper::Error> {
    try_http_call(
        addr,
        Method::POST,
        "/orders",
        Some("user-42"),
        Some(&format!("\"{key}\"")),
        ORDER,
    )
    .await
}
