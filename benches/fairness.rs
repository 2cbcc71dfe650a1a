//! Fairness between tenants: the latency of one principal's first
//! executions alone, then while another principal storms the same layer
//! (40 keys at a time, each sent five times at once, every handler holding
//! its transaction for 500 ms), on PostgreSQL in process. Prints both
//! tenants' answers and the calm tenant's p50 and p99 with and without the
//! storm, measured in the same run.
//!
//! `cargo bench --bench fairness` (needs PostgreSQL as for the tests).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tower_idempotency::testkit::{Harness, order, send};

const CALM: usize = 200;
const CALM_CONCURRENCY: usize = 4;

/// The calm tenant's latencies for `CALM` first executions,
/// `CALM_CONCURRENCY` at a time, and its statuses.
async fn calm(
    app: &axum::Router,
    tag: &str,
) -> (Vec<Duration>, std::collections::BTreeMap<u16, usize>) {
    let mut latencies = Vec::new();
    let mut statuses = std::collections::BTreeMap::new();
    for batch in 0..CALM / CALM_CONCURRENCY {
        let calls = (0..CALM_CONCURRENCY).map(|i| {
            let app = app.clone();
            let key = format!("\"{tag}-{batch}-{i}\"");
            tokio::spawn(async move {
                let started = Instant::now();
                let answer = send(
                    &app,
                    order(Some("user-calm"), Some(&key), r#"{"amount":2,"items":[]}"#),
                )
                .await;
                (started.elapsed(), answer.status.as_u16())
            })
        });
        for call in calls {
            let (took, status) = call.await.expect("no panic");
            latencies.push(took);
            *statuses.entry(status).or_insert(0) += 1;
        }
    }
    latencies.sort();
    (latencies, statuses)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let h = Harness::<sqlx::Postgres>::new().await;
    let app = h.app();
    // Warm the pool and the statement caches.
    let _ = calm(&app, "warm").await;
    let (alone, alone_statuses) = calm(&app, "alone").await;

    let storming = Arc::new(AtomicBool::new(true));
    let storm = {
        let app = app.clone();
        let storming = Arc::clone(&storming);
        tokio::spawn(async move {
            let mut statuses = std::collections::BTreeMap::new();
            let mut round = 0;
            while storming.load(Ordering::Relaxed) {
                let mut calls = Vec::new();
                for k in 0..40 {
                    for _ in 0..5 {
                        let app = app.clone();
                        let key = format!("\"storm-{round}-{k}\"");
                        calls.push(tokio::spawn(async move {
                            let body = r#"{"amount":1,"items":[],"sleep_ms":500}"#;
                            send(&app, order(Some("user-storm"), Some(&key), body))
                                .await
                                .status
                                .as_u16()
                        }));
                    }
                }
                for call in calls {
                    *statuses.entry(call.await.expect("no panic")).or_insert(0) += 1;
                }
                round += 1;
            }
            statuses
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (stormed, stormed_statuses) = calm(&app, "stormed").await;
    storming.store(false, Ordering::Relaxed);
    let storm_statuses = storm.await.expect("no panic");

    println!(
        "Fairness between tenants (PostgreSQL, in process, pool of 20, the default share: three quarters of the pool per principal)"
    );
    println!();
    println!(
        "| calm tenant ({CALM} first executions, {CALM_CONCURRENCY} at a time) | p50 ms | p99 ms | statuses |"
    );
    println!("|---|---|---|---|");
    for (what, lat, st) in [
        ("alone", &alone, &alone_statuses),
        ("during the storm", &stormed, &stormed_statuses),
    ] {
        println!(
            "| {what} | {:.2} | {:.2} | {st:?} |",
            percentile(lat, 0.5).as_secs_f64() * 1e3,
            percentile(lat, 0.99).as_secs_f64() * 1e3
        );
    }
    println!();
    println!(
        "p99 with / without the storm: {:.2}; the storm's own answers: {storm_statuses:?}",
        percentile(&stormed, 0.99).as_secs_f64() / percentile(&alone, 0.99).as_secs_f64()
    );
}
