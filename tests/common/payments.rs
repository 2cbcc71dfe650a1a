//! The example payment pair from outside: the fake provider (its charges,
//! the ground truth, and its faults) and a payment sent to the example
//! payment service. Uses `common` and the `http_call` module of the test
//! crate that includes it.

// Each test crate that includes this module uses a part of it.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use tokio::process::Child;

use crate::common;
use crate::http_call::{Answer, http_call, try_http_call};

/// The payment every case sends, as `user-42`.
pub const PAYMENT: &str =
    r#"{"orderId":"o-1001","amount":12000,"currency":"KRW","source":"tok_visa"}"#;

/// A running fake provider.
pub struct Provider {
    pub addr: String,
    _child: Child,
}

impl Provider {
    pub async fn start() -> Self {
        let (child, addr) =
            common::start_example("fake_provider", &["--addr", "127.0.0.1:0"], &[]).await;
        Self {
            addr,
            _child: child,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The next charge is made, and its answer held for `delay_ms`.
    pub async fn charge_then_hang(&self, delay_ms: u64) {
        let fault = format!(r#"{{"mode":"charge_then_hang","delay_ms":{delay_ms}}}"#);
        let a = http_call(&self.addr, Method::POST, "/faults", None, None, &fault).await;
        assert_eq!(a.status, StatusCode::OK, "{a:?}");
    }

    /// How many charges the provider made.
    pub async fn charges(&self) -> usize {
        let a = http_call(&self.addr, Method::GET, "/charges", None, None, "").await;
        a.json().as_array().map_or(0, Vec::len)
    }

    /// Waits (at most 20 s) until the provider made a charge.
    pub async fn wait_for_a_charge(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.charges().await == 0 {
            assert!(Instant::now() < deadline, "no charge within 20 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Starts the example payment service on `database_url` with `provider`,
/// and `args` added; the process and its `HOST:PORT`.
pub async fn payment_service(
    database_url: &str,
    provider: &Provider,
    args: &[&str],
) -> (Child, String) {
    let url = provider.url();
    let mut all = vec!["--addr", "127.0.0.1:0", "--provider", &url];
    all.extend_from_slice(args);
    common::start_example("payment_service", &all, &[("DATABASE_URL", database_url)]).await
}

/// `POST /payments` with [`PAYMENT`] and `key`; `Err` when the connection
/// dies first.
pub async fn pay(addr: &str, key: &str) -> Result<Answer, hyper::Error> {
    try_http_call(
        addr,
        Method::POST,
        "/payments",
        Some("user-42"),
        Some(key),
        PAYMENT,
    )
    .await
}
