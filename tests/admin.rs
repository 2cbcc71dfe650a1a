//! The operators' library API (`admin::Ledger`) on every store: list, show,
//! resolve with an audit row in the verdict's transaction, refusals, the
//! status summary.

#[macro_use]
mod common;

use std::time::Duration;

use bytes::Bytes;
use common::ledger::{OPERATION, PAY, PAYER, Store, park, pay, pay_app};
use tower_idempotency::admin::{Attribution, Ledger, Lookup};
use tower_idempotency::store::RecordStatus;
use tower_idempotency::testkit::lease::{Fault, payment};
use tower_idempotency::testkit::send;
use tower_idempotency::{Resolution, ResolveError};

on_every_store!(
    a_verdict_is_audited_and_the_retry_replays_it,
    concurrent_verdicts_one_wins_with_one_audit_row,
    no_verdict_lands_without_its_audit_row,
    status_counts_by_status_and_operation,
    show_finds_a_record_by_its_key_or_its_stored_hash,
    the_trail_ends_with_the_newest_verdict_past_its_limit,
    status_counts_stranded_records_at_the_configured_age,
    show_finds_a_record_by_its_key_as_sent_on_the_wire,
);

fn answer() -> Resolution {
    let res = http::Response::builder()
        .status(201)
        .header("content-type", "application/json")
        .body(Bytes::from_static(br#"{"chargeId":"ch_by_operator"}"#))
        .unwrap();
    Resolution::Succeeded(res)
}

async fn a_verdict_is_audited_and_the_retry_replays_it<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    park(&app, "pay-1").await;
    let ledger = Ledger::new(h.pool.clone());
    let listed = ledger.unresolved(10).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    let record = &listed[0];
    assert_eq!(record.status, RecordStatus::NeedsReconciliation);
    assert_eq!(record.pending_step.as_deref(), Some("charge"));
    assert!(tower_idempotency::admin::step_key(record).is_some());

    let row = ledger
        .show(&Lookup::new(PAYER, OPERATION, "pay-1"))
        .await
        .unwrap()
        .expect("the parked record");
    assert_eq!(row.status, RecordStatus::NeedsReconciliation);
    assert_eq!(row.as_unresolved().as_ref(), Some(record));
    assert!(ledger.audit(&record.scope()).await.unwrap().is_empty());

    let alice = Attribution::new("alice", "provider shows the charge").unwrap();
    ledger.resolve(record, answer(), &alice).await.unwrap();
    let trail = ledger.audit(&record.scope()).await.unwrap();
    assert_eq!(trail.len(), 1, "{trail:?}");
    let e = &trail[0];
    assert_eq!(
        (e.actor.as_str(), e.verdict.as_str()),
        ("alice", "succeeded")
    );
    assert_eq!(e.reason, "provider shows the charge");
    assert_eq!(e.response_status, Some(201));
    let before: serde_json::Value = serde_json::from_str(&e.before).unwrap();
    assert_eq!(before["status"], "NEEDS_RECONCILIATION", "{before}");
    assert_eq!(before["pending_step"], "charge", "{before}");
    assert_eq!(before["generation"], record.generation, "{before}");
    let clock = ledger.clock().await.unwrap();
    assert!((clock - e.recorded_at).abs() < 60_000, "database clock");

    // Someone else settled it first: refused, says what it is, no new row.
    let bob = Attribution::new("bob", "late").unwrap();
    let late = ledger.resolve(record, Resolution::Rerun, &bob).await;
    assert!(
        matches!(
            late,
            Err(ResolveError::Settled {
                status: RecordStatus::Succeeded
            })
        ),
        "{late:?}"
    );
    let by_lookup = ledger
        .resolve_lookup(
            &Lookup::new(PAYER, OPERATION, "pay-1"),
            Resolution::Rerun,
            &bob,
        )
        .await;
    assert!(
        matches!(by_lookup, Err(ResolveError::Settled { .. })),
        "{by_lookup:?}"
    );
    let missing = ledger
        .resolve_lookup(
            &Lookup::new(PAYER, OPERATION, "nope"),
            Resolution::Rerun,
            &bob,
        )
        .await;
    assert!(matches!(missing, Err(ResolveError::Gone)), "{missing:?}");
    assert_eq!(ledger.audit(&record.scope()).await.unwrap().len(), 1);

    // The client's retry replays the operator's answer.
    let retry = send(&app.router, payment("pay-1", PAY)).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.status, 201);
    assert_eq!(&retry.body[..], br#"{"chargeId":"ch_by_operator"}"#);
    assert_eq!(app.state.provider.charges(), 1, "never charged again");
    assert!(ledger.unresolved(10).await.unwrap().is_empty());
}

async fn concurrent_verdicts_one_wins_with_one_audit_row<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    park(&app, "pay-1").await;
    let ledger = Ledger::new(h.pool.clone());
    let record = ledger.unresolved(10).await.unwrap().remove(0);
    let tries: Vec<_> = (0..4)
        .map(|i| {
            let (ledger, record) = (ledger.clone(), record.clone());
            tokio::spawn(async move {
                let by = Attribution::new(&format!("op-{i}"), "race").unwrap();
                let resolution = if i % 2 == 0 {
                    answer()
                } else {
                    Resolution::Rerun
                };
                ledger.resolve(&record, resolution, &by).await
            })
        })
        .collect();
    let mut won = 0;
    for t in tries {
        match t.await.unwrap() {
            Ok(()) => won += 1,
            Err(
                ResolveError::Settled { .. } | ResolveError::Changed { .. } | ResolveError::Gone,
            ) => {}
            // SQLite's single writer may be busy for a loser.
            Err(ResolveError::Store(e)) if DB::LABEL == "sqlite" => {
                assert!(e.to_string().contains("locked"), "{e}")
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(won, 1);
    assert_eq!(ledger.audit(&record.scope()).await.unwrap().len(), 1);
}

async fn no_verdict_lands_without_its_audit_row<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    park(&app, "pay-1").await;
    let ledger = Ledger::new(h.pool.clone());
    let record = ledger.unresolved(10).await.unwrap().remove(0);
    // The audit insert fails (its table is gone): the verdict must not land.
    DB::exec(&h.pool, "DROP TABLE tower_idempotency_audit").await;
    let by = Attribution::new("alice", "provider shows the charge").unwrap();
    let failed = ledger.resolve(&record, answer(), &by).await;
    assert!(matches!(failed, Err(ResolveError::Store(_))), "{failed:?}");
    let row = ledger
        .show(&Lookup::new(PAYER, OPERATION, "pay-1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.status, RecordStatus::NeedsReconciliation, "{row:?}");
    assert_eq!(ledger.unresolved(10).await.unwrap(), vec![record]);
}

async fn status_counts_by_status_and_operation<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    pay(&app, "pay-1").await;
    pay(&app, "pay-2").await;
    park(&app, "pay-3").await;
    // A client that went away mid-charge: its lease ends at once, the
    // step pending (not listed while the call may still land).
    app.state
        .provider
        .fault(Fault::ChargeThenHang(Duration::from_secs(5)));
    let cut = tokio::time::timeout(
        Duration::from_millis(500),
        send(&app.router, payment("pay-4", PAY)),
    )
    .await;
    assert!(cut.is_err(), "cut mid-charge");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let ledger = Ledger::new(h.pool.clone());
    let s = ledger.status().await.unwrap();
    assert_eq!(
        (s.total, s.parked, s.tombstones, s.unresolved),
        (4, 1, 0, 1),
        "{s:?}"
    );
    assert_eq!(s.leased_past_lease, 1, "{s:?}");
    assert!(
        s.oldest_processing_age_ms().is_some_and(|a| a >= 0),
        "{s:?}"
    );
    let succeeded = s
        .counts
        .iter()
        .find(|c| c.status == RecordStatus::Succeeded)
        .unwrap();
    assert_eq!(
        (succeeded.operation.as_str(), succeeded.rows),
        (OPERATION, 2)
    );
    assert!(s.oldest_unresolved_age_ms().is_some_and(|a| a >= 0));
    assert!(s.size.as_ref().is_some_and(|size| size.bytes > 0), "{s:?}");
    assert_eq!(s.estimates().is_empty(), DB::LABEL != "mysql");
    let json = s.to_json();
    assert_eq!(json["parked"], 1);
    let preview = ledger.sweep_preview().await.unwrap();
    assert_eq!((preview.expirable, preview.purgeable), (0, 0));
}

async fn show_finds_a_record_by_its_key_or_its_stored_hash<DB: Store>() {
    use tower_idempotency::testkit::{Harness, order};
    let h = Harness::<DB>::new().await;
    let app = h.app_with(h.layer().with_hashed_keys(true));
    let body = r#"{"amount":1}"#;
    let a = send(&app, order(Some("alice"), Some("key-1"), body)).await;
    assert_eq!(a.status, 201, "{a:?}");
    let ledger = Ledger::new(h.pool.clone());
    let row = ledger
        .show(&Lookup::new("alice", "POST /orders", "key-1"))
        .await
        .unwrap()
        .expect("found by the key the client sent");
    assert!(row.key.starts_with("sha256:"), "stored hashed: {row:?}");
    assert_eq!(row.status, RecordStatus::Succeeded);
    let by_hash = ledger
        .show(&Lookup::new("alice", "POST /orders", &row.key))
        .await
        .unwrap();
    let by_hash = by_hash.expect("found by the stored form");
    assert_eq!(
        (&by_hash.key, by_hash.created_at),
        (&row.key, row.created_at)
    );
    let none = ledger
        .show(&Lookup::new("bob", "POST /orders", "key-1"))
        .await
        .unwrap();
    assert_eq!(none, None, "another principal's key is not found");
}

/// A trail longer than [`MAX_TRAIL`](tower_idempotency::admin::MAX_TRAIL):
/// `audit` keeps the newest rows (oldest first), so its last entry is the
/// newest verdict.
async fn the_trail_ends_with_the_newest_verdict_past_its_limit<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    park(&app, "pay-1").await;
    let ledger = Ledger::new(h.pool.clone());
    let row = ledger
        .show(&Lookup::new(PAYER, OPERATION, "pay-1"))
        .await
        .unwrap()
        .unwrap();
    let values = |actor: &str, n: usize| {
        vec![
            format!(
                "('{PAYER}', '{OPERATION}', 'pay-1', '{actor}', 'x', 'rerun', NULL, 1, '{{}}')"
            );
            n
        ]
        .join(", ")
    };
    let insert = "INSERT INTO tower_idempotency_audit (principal_id, operation, idem_key, \
                  actor, reason, verdict, response_status, recorded_at, before_record) VALUES ";
    DB::exec(&h.pool, format!("{insert}{}", values("old", 1001)).leak()).await;
    DB::exec(&h.pool, format!("{insert}{}", values("newest", 1)).leak()).await;
    let trail = ledger
        .audit(&row.as_unresolved().unwrap().scope())
        .await
        .unwrap();
    assert_eq!(trail.len(), 1000);
    assert_eq!(trail.last().unwrap().actor, "newest");
    assert!(trail.windows(2).all(|w| w[0].id < w[1].id), "oldest first");
}

/// `status` counts what `unresolved` lists: with the ledger's stranded
/// age, not the default hour.
async fn status_counts_stranded_records_at_the_configured_age<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    park(&app, "pay-1").await;
    let ledger = Ledger::new(h.pool.clone());
    let record = ledger.unresolved(10).await.unwrap().remove(0);
    let by = Attribution::new("alice", "provider shows no charge").unwrap();
    // Rerun: PROCESSING, its lease lapsed, nothing pending; nobody retries.
    ledger
        .resolve(&record, Resolution::Rerun, &by)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let quick = ledger
        .clone()
        .with_stranded_after(Duration::from_millis(100));
    assert_eq!(quick.unresolved(10).await.unwrap().len(), 1);
    assert_eq!(quick.status().await.unwrap().unresolved, 1);
    assert_eq!(ledger.unresolved(10).await.unwrap().len(), 0);
    assert_eq!(ledger.status().await.unwrap().unresolved, 0);
}

/// The key as the client sent it in the header, a Structured Field String
/// (`"…"`, with `\"` and `\\` escapes), names the record stored unquoted.
async fn show_finds_a_record_by_its_key_as_sent_on_the_wire<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    let sent = r#""pay \"q\" 1""#;
    park(&app, sent).await;
    let ledger = Ledger::new(h.pool.clone());
    let listed = ledger.unresolved(10).await.unwrap();
    assert_eq!(listed[0].key, r#"pay "q" 1"#, "stored unquoted");
    for key in [sent, r#"pay "q" 1"#] {
        let row = ledger
            .show(&Lookup::new(PAYER, OPERATION, key))
            .await
            .unwrap();
        assert_eq!(
            row.map(|r| r.key),
            Some(r#"pay "q" 1"#.to_string()),
            "{key}"
        );
    }
}
