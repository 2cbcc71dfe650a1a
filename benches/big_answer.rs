//! What a large answer costs in memory: a 100 MiB answer streamed through
//! the layer (over its 1 MiB recording limit, so recorded without its body)
//! against the same answer served bare, in one process on SQLite, called in
//! process (no HTTP), the client dropping each chunk as it comes. Peak RSS
//! is reset before each run (`/proc/self/clear_refs`), so each figure is the
//! peak of its own run over the resident set before it.
//!
//! `cargo bench --bench big_answer`

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::{IdempotencyBody, IdempotencyLayer, Principal, Tx};

const CHUNK: usize = 64 * 1024;
const TOTAL: usize = 100 * 1024 * 1024;
const ROUNDS: usize = 3;

/// `TOTAL` bytes in `CHUNK`s, made as they are polled.
struct Export {
    left: usize,
    chunk: Bytes,
}

impl Body for Export {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        self.left -= CHUNK;
        // A fresh buffer per chunk, as a real export writes them.
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(self.chunk.to_vec())))))
    }
}

fn export() -> Export {
    Export {
        left: TOTAL,
        chunk: Bytes::from(vec![b'x'; CHUNK]),
    }
}

/// (current RSS, peak RSS since the last reset), KiB.
fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Drains `body` chunk by chunk; returns the bytes seen.
async fn drain<B: Body<Data = Bytes> + Unpin>(mut body: B) -> usize
where
    B::Error: std::fmt::Debug,
{
    let mut n = 0;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            n += data.len();
        }
    }
    n
}

/// Drains `body` like [`drain`], calling `at_half` once when half of the
/// answer has reached the client.
async fn drain_observing<B: Body<Data = Bytes> + Unpin>(
    mut body: B,
    mut at_half: impl FnMut(),
) -> usize
where
    B::Error: std::fmt::Debug,
{
    let mut n = 0;
    let mut observed = false;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            n += data.len();
        }
        if !observed && n >= TOTAL / 2 {
            observed = true;
            at_half();
        }
    }
    n
}

/// Peak RSS growth of one run of `run`, KiB.
async fn peak_of<F: Future<Output = usize>>(run: F) -> u64 {
    reset_peak();
    let (before, _) = rss();
    let seen = run.await;
    assert_eq!(seen, TOTAL, "the whole answer reaches the client");
    rss().1.saturating_sub(before)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let path = std::env::temp_dir().join(format!("ti_big_{}.db", std::process::id()));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(
            sqlx::sqlite::SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true),
        )
        .await
        .unwrap();
    tower_idempotency::migrate(&pool).await.unwrap();
    sqlx::raw_sql("CREATE TABLE exports (id INTEGER PRIMARY KEY, at TEXT)")
        .execute(&pool)
        .await
        .unwrap();
    let layered = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(pool.clone()).unscoped())
        .service_fn(|req: Request<IdempotencyBody<String>>| async move {
            let tx = req.extensions().get::<Tx<sqlx::Sqlite>>().cloned().unwrap();
            let mut conn = tx.lock().unwrap();
            sqlx::raw_sql("INSERT INTO exports (at) VALUES ('now')")
                .execute(&mut *conn)
                .await
                .unwrap();
            Ok::<_, Infallible>(Response::new(export()))
        });
    let mut key = 0u64;
    let mut layered_run = || {
        key += 1;
        let mut app = layered.clone();
        let mut req = Request::post("/exports")
            .header("idempotency-key", format!("\"export-{key}\""))
            .body(String::new())
            .unwrap();
        req.extensions_mut().insert(Principal::new("user-42"));
        async move {
            let res = app.ready().await.unwrap().call(req).await.unwrap();
            assert_eq!(res.status(), 200);
            drain(res.into_body()).await
        }
    };
    let bare_run = || async { drain(export()).await };

    // Warm both paths once (allocator arenas, the pool's connections).
    drain(export()).await;
    layered_run().await;
    let (mut bare, mut layer) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        bare.push(peak_of(bare_run()).await);
        layer.push(peak_of(layered_run()).await);
    }
    // What the commit at the stream's end costs (issue 33 point 7): the
    // pooled connections held, and the rows committed, when half the
    // answer has reached its client; and the stream's time against bare.
    let held_mid_stream = {
        let mut app = layered.clone();
        let mut req = Request::post("/exports")
            .header("idempotency-key", "\"export-observed\"")
            .body(String::new())
            .unwrap();
        req.extensions_mut().insert(Principal::new("user-42"));
        let res = app.ready().await.unwrap().call(req).await.unwrap();
        let mut held = 0;
        let seen = drain_observing(res.into_body(), || {
            held = pool.size() as usize - pool.num_idle();
        })
        .await;
        assert_eq!(seen, TOTAL);
        held
    };
    let (mut bare_time, mut layer_time) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let started = std::time::Instant::now();
        drain(export()).await;
        bare_time.push(started.elapsed());
        let started = std::time::Instant::now();
        layered_run().await;
        layer_time.push(started.elapsed());
    }
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM exports")
        .fetch_one(&pool)
        .await
        .unwrap();
    let max = |v: &[u64]| v.iter().copied().max().unwrap_or(0);
    println!(
        "A {} MiB answer in {} KiB chunks, {ROUNDS} runs each; peak RSS growth over the run's start, KiB:",
        TOTAL >> 20,
        CHUNK >> 10
    );
    println!();
    println!("| route | peak RSS growth (max of runs) | each run |");
    println!("|---|---|---|");
    println!(
        "| bare (the body drained as made) | {} | {bare:?} |",
        max(&bare)
    );
    println!(
        "| behind the layer (1 MiB recording limit: recorded without its body) | {} | {layer:?} |",
        max(&layer)
    );
    println!();
    println!(
        "Behind the layer minus bare: {} KiB for a {} KiB answer ({} export rows committed, one per key).",
        max(&layer).saturating_sub(max(&bare)),
        TOTAL >> 10,
        rows
    );
    let min = |v: &[std::time::Duration]| v.iter().copied().min().unwrap_or_default();
    println!(
        "Half-way through an answer behind the layer, {held_mid_stream} pooled connection(s) \
         held by it (its transaction commits when the body ends well; bare holds none). \
         The whole stream takes {:.2}x bare's time (best of {ROUNDS}: {:?} against {:?}), \
         and holds the connection and the key's lock all that time, bounded by \
         with_max_stream_hold.",
        min(&layer_time).as_secs_f64() / min(&bare_time).as_secs_f64().max(1e-9),
        min(&layer_time),
        min(&bare_time),
    );
    pool.close().await;
    let _ = std::fs::remove_file(&path);
}
