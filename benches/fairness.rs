//! Fairness between tenants: the latency of one principal's first
//! executions alone, then while another principal storms the same layer
//! (40 keys at a time, each sent five times at once, every handler holding
//! its transaction for 500 ms), on PostgreSQL in process: with the layer's
//! default share per principal, and with none. Prints both tenants'
//! answers and the calm tenant's p50 and p99 alone and during each storm,
//! measured in the same run.
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

/// The calm tenant during a storm on `app`, and the storm's own answers.
async fn during_storm(
    app: &axum::Router,
    tag: &'static str,
) -> (
    Vec<Duration>,
    std::collections::BTreeMap<u16, usize>,
    std::collections::BTreeMap<u16, usize>,
) {
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
                        let key = format!("\"storm-{tag}-{round}-{k}\"");
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
    let (latencies, statuses) = calm(app, tag).await;
    storming.store(false, Ordering::Relaxed);
    (latencies, statuses, storm.await.expect("no panic"))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let h = Harness::<sqlx::Postgres>::new().await;
    let app = h.app();
    // No bound: one principal may hold the whole pool.
    let unbounded = h.app_with(h.layer().with_max_per_principal(20));
    // Warm the pool and the statement caches.
    let _ = calm(&app, "warm").await;
    let (alone, alone_statuses) = calm(&app, "alone").await;
    let (stormed, stormed_statuses, storm_statuses) = during_storm(&app, "bounded").await;
    let (free, free_statuses, free_storm) = during_storm(&unbounded, "unbounded").await;

    println!(
        "Fairness between tenants (PostgreSQL, in process, pool of 20; a storm: 40 keys x 5 copies at a time, handlers holding their transaction 500 ms)"
    );
    println!();
    println!(
        "| calm tenant ({CALM} first executions, {CALM_CONCURRENCY} at a time) | p50 ms | p99 ms | its statuses | the storm's statuses |"
    );
    println!("|---|---|---|---|---|");
    let empty = std::collections::BTreeMap::new();
    for (what, lat, st, storm) in [
        ("alone", &alone, &alone_statuses, &empty),
        (
            "during the storm, default share (15 of 20)",
            &stormed,
            &stormed_statuses,
            &storm_statuses,
        ),
        (
            "during the storm, no share (20 of 20)",
            &free,
            &free_statuses,
            &free_storm,
        ),
    ] {
        println!(
            "| {what} | {:.2} | {:.2} | {st:?} | {storm:?} |",
            percentile(lat, 0.5).as_secs_f64() * 1e3,
            percentile(lat, 0.99).as_secs_f64() * 1e3
        );
    }
    println!();
    let ratio =
        |l: &[Duration]| percentile(l, 0.99).as_secs_f64() / percentile(&alone, 0.99).as_secs_f64();
    println!(
        "calm p99 with / without the storm: {:.2} with the default share, {:.2} with none",
        ratio(&stormed),
        ratio(&free)
    );
}
