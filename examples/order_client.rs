//! The client half: places orders against the order service through
//! [`IdempotentRetryLayer`], one `Idempotency-Key` per order, kept on every
//! retry.
//!
//! ```text
//! cargo run --example order_service &
//! cargo run --example order_client --features client -- \
//!     --base-url http://127.0.0.1:3000 --orders 20 --concurrency 4 \
//!     --principal user-42 --sku sku-1 [--attempts 8] [--deadline-ms 20000]
//! ```
//!
//! Each order is its own logical request, `POST /orders` with
//! `{"currency":"KRW","items":[{"sku":SKU,"qty":1}],"amount":1000}` and
//! `Authorization: Bearer NAME`, over plain HTTP/1.1 (hyper-util's client).
//! One JSON line per order, then a summary:
//!
//! ```text
//! {"n":0,"status":201,"orderId":"o-…","attempts":1,"replayed":false,"key":"…"}
//! {"orders":20,"ok":20,"failed":0,"attempts":23,"replayed":2}
//! ```
//!
//! The exit status is 0 only when every order got a 2xx answer, read whole.
//!
//! The stack, outermost first: the retry layer (attempts, deadline, backoff
//! with full jitter, `Retry-After`, the shared budget), then a per-attempt
//! timeout, then the client. `--attempts` is the total number of sends per
//! order, the first included; `--deadline-ms` bounds each order's whole
//! time, waits included, and the reading of its answer's body: the layer's
//! bounds end once the answer's headers are in, so the body is read here
//! within what is left of the deadline and at most [`MAX_ANSWER`] bytes. A
//! body that does not end in time, or is larger, fails the order (its line
//! says why).

use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tower::retry::budget::TpsBudget;
use tower::timeout::TimeoutLayer;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::client::{IdempotentRetryLayer, RetryBody, RetryError, RetryReport};

/// The most of an answer's body read: an order's answer is a small JSON
/// document.
const MAX_ANSWER: usize = 64 * 1024;

const HELP: &str = "\
order_client: place orders through the idempotent retry layer

  --base-url URL       the order service, such as http://127.0.0.1:3000 (required)
  --orders N           how many orders, each its own logical request (required)
  --concurrency C      orders in flight at once (required)
  --principal NAME     sent as Authorization: Bearer NAME (required)
  --sku SKU            the item of every order (required)
  --attempts K         sends per order, the first included (default 8)
  --deadline-ms MS     each order's whole time, waits and its answer's body
                       included (default 20000)

Every attempt has its own timeout (5 s, or less when the deadline is nearer).
The answer's body is read within the deadline too, and at most 64 KiB.
The retry budget is shared by all orders. It protects the service against an
outage, not against a lossy link: it allows 10 retries a second plus two per
order placed in the last 10 s, so a run in which a third (or even all) of the
first attempts fail at once still completes.";

struct Args {
    base_url: String,
    orders: u32,
    concurrency: usize,
    principal: String,
    sku: String,
    attempts: u32,
    deadline: Duration,
}

fn parse_args() -> Result<Args, String> {
    let (mut base_url, mut orders, mut concurrency, mut principal, mut sku) =
        (None, None, None, None, None);
    let (mut attempts, mut deadline) = (8, Duration::from_millis(20_000));
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            println!("{HELP}");
            std::process::exit(0);
        }
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n\n{HELP}"))?;
        let num = |v: &str| v.parse::<u64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--base-url" => base_url = Some(value.trim_end_matches('/').to_string()),
            "--orders" => orders = Some(u32::try_from(num(&value)?).map_err(|e| e.to_string())?),
            "--concurrency" => {
                concurrency = Some(usize::try_from(num(&value)?.max(1)).unwrap_or(1))
            }
            "--principal" => principal = Some(value),
            "--sku" => sku = Some(value),
            "--attempts" => attempts = u32::try_from(num(&value)?.max(1)).unwrap_or(u32::MAX),
            "--deadline-ms" => deadline = Duration::from_millis(num(&value)?),
            other => return Err(format!("unknown flag {other}\n\n{HELP}")),
        }
    }
    let missing = |name: &str| format!("{name} is required\n\n{HELP}");
    Ok(Args {
        base_url: base_url.ok_or_else(|| missing("--base-url"))?,
        orders: orders.ok_or_else(|| missing("--orders"))?,
        concurrency: concurrency.ok_or_else(|| missing("--concurrency"))?,
        principal: principal.ok_or_else(|| missing("--principal"))?,
        sku: sku.ok_or_else(|| missing("--sku"))?,
        attempts,
        deadline,
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    let client = Client::builder(TokioExecutor::new()).build_http::<RetryBody>();
    let layer = IdempotentRetryLayer::new()
        .with_max_attempts(args.attempts)
        .with_deadline(args.deadline)
        .with_backoff(Duration::from_millis(50), Duration::from_secs(2))
        .with_budget(TpsBudget::new(Duration::from_secs(10), 10, 2.0));
    let service = ServiceBuilder::new()
        .layer(layer)
        .layer(TimeoutLayer::new(Duration::from_secs(5).min(args.deadline)))
        .service(client);
    let body = json!({"currency": "KRW", "items": [{"sku": args.sku, "qty": 1}], "amount": 1000})
        .to_string();
    let url = format!("{}/orders", args.base_url);
    let auth = format!("Bearer {}", args.principal);

    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(args.concurrency));
    let mut tasks = Vec::new();
    for n in 0..args.orders {
        let (service, gate) = (service.clone(), std::sync::Arc::clone(&gate));
        let deadline = args.deadline;
        let req = Request::post(&url)
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::AUTHORIZATION, &auth)
            .body(Full::new(Bytes::from(body.clone())));
        tasks.push(tokio::spawn(async move {
            let _slot = gate.acquire_owned().await;
            let req = match req {
                Ok(req) => req,
                Err(e) => return json!({"n": n, "status": 0, "error": e.to_string()}),
            };
            // The order's deadline, the reading of its answer included.
            let by = tokio::time::Instant::now() + deadline;
            place(n, service.oneshot(req).await, by).await
        }));
    }
    let (mut ok, mut attempts, mut replayed) = (0u32, 0u64, 0u32);
    for (n, task) in tasks.into_iter().enumerate() {
        let line = task
            .await
            .unwrap_or_else(|e| json!({"n": n, "status": 0, "error": e.to_string()}));
        let status = line["status"].as_u64().unwrap_or(0);
        ok += u32::from((200..300).contains(&status) && line["error"].is_null());
        attempts += line["attempts"].as_u64().unwrap_or(0);
        replayed += u32::from(line["replayed"].as_bool().unwrap_or(false));
        println!("{line}");
    }
    let failed = args.orders - ok;
    println!(
        "{}",
        json!({"orders": args.orders, "ok": ok, "failed": failed, "attempts": attempts, "replayed": replayed})
    );
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// One order's line, from its answer (or the error after the last
/// attempt); the answer's body is read by `by`, at most [`MAX_ANSWER`]
/// bytes.
async fn place(
    n: u32,
    answer: Result<http::Response<RetryBody>, RetryError>,
    by: tokio::time::Instant,
) -> Value {
    let res = match answer {
        Ok(res) => res,
        Err(e) => {
            return json!({
                "n": n,
                "status": 0,
                "orderId": null,
                "attempts": e.report.attempts,
                "replayed": false,
                "key": e.report.key,
                "error": e.to_string(),
            });
        }
    };
    let report = res.extensions().get::<RetryReport>().cloned();
    let status = res.status().as_u16();
    let read = Limited::new(res.into_body(), MAX_ANSWER).collect();
    let (order, error) = match tokio::time::timeout_at(by, read).await {
        Ok(Ok(body)) => (
            serde_json::from_slice(&body.to_bytes()).unwrap_or(Value::Null),
            None,
        ),
        Ok(Err(e)) => (Value::Null, Some(format!("reading the answer: {e}"))),
        Err(_) => (
            Value::Null,
            Some("the answer's body did not end by the deadline".to_string()),
        ),
    };
    let report = report.unwrap_or(RetryReport {
        attempts: 1,
        waited: Duration::ZERO,
        replayed: false,
        key: None,
        stop: tower_idempotency::client::RetryStop::Final,
    });
    let mut line = json!({
        "n": n,
        "status": status,
        "orderId": order["orderId"],
        "attempts": report.attempts,
        "replayed": report.replayed,
        "key": report.key,
    });
    if let Some(error) = error {
        line["error"] = Value::String(error);
    }
    line
}
