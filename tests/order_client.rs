//! End to end, both halves: `order_client` (the retry layer) places orders
//! against `order_service` through a lossy TCP proxy written for this test.
//! The proxy (loopback only, bounded) drops the answer after forwarding the
//! request (the server committed, the client never heard), resets
//! connections before forwarding, and delays some answers. Judged by the
//! rows: one order per logical request, stock decremented once per order,
//! every client line's `orderId` committed, and each client's answer the
//! first committed answer for its key.
//!
//! And `order_client` against a server that sends an answer's headers and
//! never finishes its body: the process exits by its deadline (or sooner,
//! when the body passes its size bound), killed by the test if it does not.

mod common;

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tower_idempotency::testkit::{Cleanup, ConformanceDb as TestDb};

async fn start_service(url: &str) -> (Child, String) {
    let mut child = Command::new(common::example("order_service"))
        .args(["--addr", "127.0.0.1:0"])
        .env("DATABASE_URL", url)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the service starts")
        .unwrap()
        .expect("a start-up line");
    let addr = common::address(&line);
    (child, addr)
}

/// What the proxy did, by kind.
#[derive(Debug, Default)]
struct Counts {
    requests: AtomicU64,
    dropped_answers: AtomicU64,
    resets: AtomicU64,
    delayed: AtomicU64,
}

/// A proxy that reads one HTTP/1.1 request at a time (Content-Length
/// bodies), forwards it on a fresh upstream connection, reads the whole
/// answer, and then, by the request's number: passes it, drops it (closing
/// the client's connection: the server has committed), resets the client
/// before forwarding anything, or delays it.
async fn lossy_proxy(upstream: String, counts: Arc<Counts>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let (upstream, counts) = (upstream.clone(), Arc::clone(&counts));
            tokio::spawn(async move {
                let _ = tokio::time::timeout(
                    Duration::from_secs(30),
                    serve(client, &upstream, &counts),
                )
                .await;
            });
        }
    });
    addr
}

async fn serve(mut client: TcpStream, upstream: &str, counts: &Counts) -> std::io::Result<()> {
    loop {
        let Some(request) = read_message(&mut client).await? else {
            return Ok(());
        };
        let n = counts.requests.fetch_add(1, Ordering::SeqCst);
        if n % 6 == 2 {
            counts.resets.fetch_add(1, Ordering::SeqCst);
            // A zero linger makes the close a reset, at once (it cannot
            // block, which is why tokio deprecates SO_LINGER in general).
            #[allow(deprecated)]
            let _ = client.set_linger(Some(Duration::ZERO));
            return Ok(());
        }
        let mut server = TcpStream::connect(upstream).await?;
        server.write_all(&request).await?;
        let Some(answer) = read_message(&mut server).await? else {
            return Ok(());
        };
        if n % 3 == 1 {
            counts.dropped_answers.fetch_add(1, Ordering::SeqCst);
            return Ok(());
        }
        if n % 6 == 3 {
            counts.delayed.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        client.write_all(&answer).await?;
    }
}

/// One HTTP/1.1 message (head and a Content-Length body), at most 1 MiB;
/// `None` at a clean end of stream.
async fn read_message(stream: &mut TcpStream) -> std::io::Result<Option<Vec<u8>>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(end) = find(&buf, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            let total = end + 4 + len;
            while buf.len() < total {
                let n = stream.read(&mut chunk).await?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            return Ok(Some(buf));
        }
        if buf.len() > 1 << 20 {
            return Err(std::io::ErrorKind::InvalidData.into());
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err(std::io::ErrorKind::UnexpectedEof.into())
            };
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The recorded answers, key → the committed orderId.
async fn ledger_answers(url: &str) -> HashMap<String, String> {
    let rows: Vec<(String, Vec<u8>)> = if url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        sqlx::query_as(
            "SELECT idem_key, response_body FROM idempotency_records WHERE status = 'SUCCEEDED'",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    } else {
        let pool = sqlx::SqlitePool::connect(url).await.unwrap();
        sqlx::query_as(
            "SELECT idem_key, response_body FROM idempotency_records WHERE status = 'SUCCEEDED'",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    rows.into_iter()
        .map(|(key, body)| {
            let doc: Value = serde_json::from_slice(&body).unwrap();
            (key, doc["orderId"].as_str().unwrap().to_string())
        })
        .collect()
}

async fn orders_through_a_lossy_link<DB: TestDb>() {
    const ORDERS: usize = 30;
    let (url, _cleanup): (String, Cleanup) = DB::fresh_url().await;
    let (_service, addr) = start_service(&url).await;
    // Stock for every order and then some; set directly, not through the proxy.
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let put = http::Request::put(format!("http://{addr}/stock/sku-lossy"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            br#"{"qty":100}"#,
        )))
        .unwrap();
    let res = client.request(put).await.unwrap();
    assert!(res.status().is_success(), "{res:?}");

    let counts = Arc::new(Counts::default());
    let proxy = lossy_proxy(addr, Arc::clone(&counts)).await;
    let run = Command::new(common::example("order_client"))
        .args([
            "--base-url",
            &format!("http://{proxy}"),
            "--orders",
            &ORDERS.to_string(),
            "--concurrency",
            "4",
            "--principal",
            "lossy-user",
            "--sku",
            "sku-lossy",
        ])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the client finishes")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let (orders, summary) = lines.split_at(lines.len() - 1);
    let summary = &summary[0];
    assert_eq!(orders.len(), ORDERS);
    assert_eq!(summary["ok"], ORDERS);

    let pool = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    assert_eq!(
        DB::count(&pool, "SELECT COUNT(*) FROM orders").await,
        ORDERS as i64
    );
    assert_eq!(
        DB::stock(&pool, "sku-lossy").await,
        100 - ORDERS as i64,
        "one decrement per order"
    );
    let answers = ledger_answers(&url).await;
    assert_eq!(
        answers.len(),
        ORDERS,
        "one recorded answer per logical request"
    );
    let mut seen = HashSet::new();
    for line in orders {
        assert_eq!(line["status"], 201, "{line}");
        let key = line["key"].as_str().unwrap();
        let order = line["orderId"].as_str().unwrap();
        assert_eq!(
            answers.get(key).map(String::as_str),
            Some(order),
            "the first committed answer: {line}"
        );
        assert!(
            seen.insert(order.to_string()),
            "one order per request: {line}"
        );
    }
    let disturbed = counts.dropped_answers.load(Ordering::SeqCst)
        + counts.resets.load(Ordering::SeqCst)
        + counts.delayed.load(Ordering::SeqCst);
    let requests = counts.requests.load(Ordering::SeqCst);
    println!(
        "{}: requests {requests}, disturbed {disturbed} (answers dropped {}, resets {}, delayed {}), \
         retries {}, replays {}",
        DB::LABEL,
        counts.dropped_answers.load(Ordering::SeqCst),
        counts.resets.load(Ordering::SeqCst),
        counts.delayed.load(Ordering::SeqCst),
        summary["attempts"].as_u64().unwrap() - ORDERS as u64,
        summary["replayed"],
    );
    assert!(disturbed * 3 >= requests, "a meaningful share is disturbed");
    assert!(counts.dropped_answers.load(Ordering::SeqCst) > 0);
    assert!(counts.resets.load(Ordering::SeqCst) > 0);
    assert!(counts.delayed.load(Ordering::SeqCst) > 0);
    assert!(
        summary["replayed"].as_u64().unwrap() > 0,
        "lost answers were replayed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_orders_through_a_lossy_link() {
    orders_through_a_lossy_link::<sqlx::Postgres>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_orders_through_a_lossy_link() {
    orders_through_a_lossy_link::<sqlx::Sqlite>().await;
}

/// A server on loopback that answers every request with `201` headers
/// promising a body of `declared` bytes, sends `sent` bytes of it (at
/// most 8 MiB, in 64 KiB writes), and then never finishes it: the
/// connection stays open and silent until the client closes it.
async fn unfinished_body_server(declared: u64, sent: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let sent = sent.min(8 << 20);
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                if read_message(&mut conn).await.ok().flatten().is_none() {
                    return;
                }
                let head = format!(
                    "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n\r\n"
                );
                if conn.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = vec![b' '; 64 * 1024];
                let mut left = sent;
                while left > 0 {
                    let n = left.min(chunk.len());
                    if conn.write_all(&chunk[..n]).await.is_err() {
                        return;
                    }
                    left -= n;
                }
                // Hold the connection, silent, until the client closes it.
                let _ = conn.read(&mut [0u8; 1]).await;
            });
        }
    });
    addr
}

/// Runs `order_client` for one order against `addr` with `deadline_ms`;
/// the process is killed if it has not exited within `within`.
async fn one_order(addr: &str, deadline_ms: u64, within: Duration) -> std::process::Output {
    let run = Command::new(common::example("order_client"))
        .args([
            "--base-url",
            &format!("http://{addr}"),
            "--orders",
            "1",
            "--concurrency",
            "1",
            "--principal",
            "stalled-user",
            "--sku",
            "sku-1",
            "--deadline-ms",
            &deadline_ms.to_string(),
        ])
        .kill_on_drop(true)
        .output();
    let started = std::time::Instant::now();
    let out = tokio::time::timeout(within, run).await.unwrap_or_else(|_| {
        panic!("order_client still running {within:?} after it started (killed)")
    });
    println!("order_client exited after {:?}", started.elapsed());
    out.unwrap()
}

#[tokio::test]
async fn an_answer_body_that_never_ends_is_cut_at_the_deadline() {
    // Headers, a few bytes of the body, then silence.
    let addr = unfinished_body_server(1000, 10).await;
    let out = one_order(&addr, 2000, Duration::from_secs(10)).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "no order was confirmed: {stdout}");
    let line: Value = serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
    assert!(line["error"].is_string(), "the line says why: {line}");
}

#[tokio::test]
async fn an_answer_body_over_the_bound_is_cut_before_the_deadline() {
    // A body declared and sent far larger than any order answer; the
    // deadline (60 s) is not what ends it.
    let addr = unfinished_body_server(1 << 40, 8 << 20).await;
    let out = one_order(&addr, 60_000, Duration::from_secs(20)).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "no order was confirmed: {stdout}");
    let line: Value = serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
    assert!(line["error"].is_string(), "the line says why: {line}");
}
