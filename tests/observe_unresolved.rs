//! Operations: a sweeper pass refreshes the gauges of unresolved records
//! and of the oldest one's age (`metrics` facade), so an alert can fire
//! before a customer calls.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::ledger::{park, pay, pay_app};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tower_idempotency::admin::{Attribution, Ledger};
use tower_idempotency::{Resolution, Sweeper};

/// The two gauges from one snapshot (a snapshot drains the recorder, so
/// each value is read once, right after the pass that set it).
fn gauges(snapshotter: &Snapshotter) -> (Option<f64>, Option<f64>) {
    let (mut records, mut age) = (None, None);
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        if let DebugValue::Gauge(v) = value {
            match key.key().name() {
                "idempotency_unresolved_records" => records = Some(v.into_inner()),
                "idempotency_unresolved_oldest_age_seconds" => age = Some(v.into_inner()),
                _ => {}
            }
        }
    }
    (records, age)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sweeper_pass_refreshes_the_unresolved_gauges() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().unwrap();

    let (h, app) = pay_app::<sqlx::Sqlite>().await;
    pay(&app, "pay-0").await;
    let sweeper = Sweeper::new(h.pool.clone());
    sweeper.sweep().await.unwrap();
    assert_eq!(gauges(&snapshotter), (Some(0.0), Some(0.0)));

    park(&app, "pay-1").await;
    park(&app, "pay-2").await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    sweeper.sweep().await.unwrap();
    let (records, age) = gauges(&snapshotter);
    assert_eq!(records, Some(2.0));
    let age = age.unwrap();
    assert!((1.0..60.0).contains(&age), "{age}");

    // Both settled, a third parked: the next pass counts one, a new one.
    let ledger = Ledger::new(h.pool.clone());
    let by = Attribution::new("alice", "provider shows the charges").unwrap();
    for record in ledger.unresolved(10).await.unwrap() {
        let answer = http::Response::builder()
            .status(201)
            .body(Bytes::from_static(b"{}"))
            .unwrap();
        ledger
            .resolve(&record, Resolution::Succeeded(answer), &by)
            .await
            .unwrap();
    }
    park(&app, "pay-3").await;
    sweeper.sweep().await.unwrap();
    let (records, age) = gauges(&snapshotter);
    assert_eq!(records, Some(1.0));
    assert!(age.is_some_and(|a| (0.0..1.0).contains(&a)), "{age:?}");

    // Rerun: PROCESSING, its lease lapsed, nothing pending; nobody
    // retries. A sweeper configured with a short stranded age counts it.
    let by = Attribution::new("alice", "provider shows no charge").unwrap();
    let record = ledger.unresolved(10).await.unwrap().remove(0);
    ledger
        .resolve(&record, Resolution::Rerun, &by)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    sweeper.sweep().await.unwrap();
    assert_eq!(gauges(&snapshotter).0, Some(0.0), "the default hour");
    Sweeper::new(h.pool.clone())
        .with_stranded_after(Duration::from_millis(100))
        .sweep()
        .await
        .unwrap();
    assert_eq!(gauges(&snapshotter).0, Some(1.0), "stranded after 100 ms");
}
