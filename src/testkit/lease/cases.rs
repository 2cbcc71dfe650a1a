//! Lease mode's conformance cases: every crash point of a handler that
//! charges at a provider, judged by the provider's charges and the rows
//! committed.

use std::time::Duration;

use http::StatusCode;

use super::{Fault, abandon_mid_charge, payment};
use crate::lease::LeaseMode;
use crate::testkit::{ConformanceDb, Harness, send};
use crate::{Reconciler, Resolution};

const PAY: &str = r#"{"amount":5000}"#;
/// When an attempt dropped mid-charge is cut.
const CUT: Duration = Duration::from_millis(500);
const LEASE: Duration = Duration::from_secs(30);
const WAIT: Duration = Duration::from_secs(2);

async fn generation<DB: ConformanceDb>(h: &Harness<DB>) -> i64 {
    DB::count(&h.pool, "SELECT MAX(generation) FROM idempotency_records").await
}

/// Case: a first payment charges once, commits every phase and replays.
pub async fn lease_first_payment_charges_once_and_replays<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h
        .pay_app(LeaseMode::new(LEASE).expect("a usable lease"), WAIT)
        .await;
    let a = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    assert!(a.headers.contains_key("idempotency-key-expires"));
    let b = send(&app.router, payment("pay-1", PAY)).await;
    assert!(b.replayed(), "{b:?}");
    assert_eq!(b.body, a.body);
    assert_eq!(app.executions(), 1);
    assert_eq!(app.state.provider.charges(), 1);
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.captured().await, 1);
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
    assert_eq!(generation(&h).await, 1);
    // A different payload under the key is refused, as in the default mode.
    let c = send(&app.router, payment("pay-1", r#"{"amount":5001}"#)).await;
    assert_eq!(c.status, StatusCode::UNPROCESSABLE_ENTITY, "{c:?}");
}

/// Case: the provider charged, then the attempt was dropped before the
/// local commit; the retry takes over at once, recovers the charge, and
/// never charges again.
pub async fn lease_charge_then_dropped_attempt_resumes_without_a_second_charge<
    DB: ConformanceDb,
>(
    h: Harness<DB>,
) {
    let app = h
        .pay_app(LeaseMode::new(LEASE).expect("a usable lease"), WAIT)
        .await;
    abandon_mid_charge(&app.router, &app.state.provider, "pay-1", CUT).await;
    assert_eq!(app.state.provider.charges(), 1);
    let retry = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert_eq!(app.state.provider.charges(), 1);
    assert_eq!(app.state.provider.posts(), 1, "recover, not execute");
    assert_eq!(h.orders().await, 1, "phase 1 is not repeated");
    assert_eq!(h.captured().await, 1);
    assert_eq!(generation(&h).await, 2);
    let again = send(&app.router, payment("pay-1", PAY)).await;
    assert!(again.replayed());
    assert_eq!(again.body, retry.body);
}

/// Case: the provider's answer is lost; the step recovers the charge in
/// the same attempt.
pub async fn lease_lost_provider_answer_is_recovered_in_the_same_attempt<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h
        .pay_app(LeaseMode::new(LEASE).expect("a usable lease"), WAIT)
        .await;
    app.state.provider.fault(Fault::ChargeThenDrop);
    let a = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    assert_eq!(app.state.provider.charges(), 1);
    assert_eq!(app.state.provider.posts(), 1);
    assert_eq!(h.captured().await, 1);
    assert_eq!(generation(&h).await, 1);
}

/// Case: the provider fails before charging; the handler answers 503, the
/// lease ends, and the retry resumes and charges once.
pub async fn lease_provider_failure_ends_the_lease_and_the_retry_charges_once<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h
        .pay_app(LeaseMode::new(LEASE).expect("a usable lease"), WAIT)
        .await;
    app.state.provider.fault(Fault::FailBefore);
    let a = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
    assert_eq!(app.state.provider.charges(), 0);
    assert_eq!(h.ledger_with("PROCESSING").await, 1);
    let retry = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(app.state.provider.charges(), 1);
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.captured().await, 1);
}

/// Case: a decline is a final failure: recorded with the final phase's
/// writes, replayed, never charged.
pub async fn lease_decline_is_final_and_replayed<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h
        .pay_app(LeaseMode::new(LEASE).expect("a usable lease"), WAIT)
        .await;
    app.state.provider.fault(Fault::Decline);
    let a = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(a.status, StatusCode::PAYMENT_REQUIRED, "{a:?}");
    assert!(
        a.json()["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("card-declined")),
        "{a:?}"
    );
    let b = send(&app.router, payment("pay-1", PAY)).await;
    assert!(b.replayed(), "{b:?}");
    assert_eq!(b.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(app.state.provider.charges(), 0);
    assert_eq!(h.declined().await, 1, "the final phase's writes are kept");
    assert_eq!(h.captured().await, 0);
    assert_eq!(h.ledger_with("FAILED_FINAL").await, 1);
}

/// Case: an unknown outcome parks the record: no second charge, `503
/// #reconciling` for every retry, until an operator resolves it.
pub async fn lease_unknown_outcome_parks_until_an_operator_resolves_it<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h
        .pay_app(LeaseMode::new(LEASE).expect("a usable lease"), WAIT)
        .await;
    app.state.provider.lookup_down(true);
    abandon_mid_charge(&app.router, &app.state.provider, "pay-1", CUT).await;
    for _ in 0..2 {
        let r = send(&app.router, payment("pay-1", PAY)).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{r:?}");
        assert_eq!(r.problem(), "reconciling");
        assert!(r.headers.contains_key("retry-after"));
    }
    assert_eq!(app.state.provider.posts(), 1, "never executed again");
    let reconciler = Reconciler::new(h.pool.clone());
    let parked = reconciler.unresolved(10).await.expect("list");
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(parked[0].pending_step.as_deref(), Some("charge"));
    // The operator finds the charge at the provider and records success.
    let answer = http::Response::builder()
        .status(201)
        .header("content-type", "application/json")
        .body(bytes::Bytes::from_static(br#"{"resolved":true}"#))
        .expect("a response");
    reconciler
        .resolve(&parked[0], Resolution::Succeeded(answer))
        .await
        .expect("resolve");
    let r = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert!(r.replayed());
    assert_eq!(&r.body[..], br#"{"resolved":true}"#);
    assert_eq!(app.state.provider.charges(), 1);
}

/// Case: a completer pass recovers a parked record once the look-up is
/// back, and finishes it without charging again.
pub async fn lease_completer_recovers_a_parked_record<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h
        .pay_app(LeaseMode::new(LEASE).expect("a usable lease"), WAIT)
        .await;
    app.state.provider.lookup_down(true);
    abandon_mid_charge(&app.router, &app.state.provider, "pay-1", CUT).await;
    let completer = app.completer(&h);
    let pass = completer.run_once().await.expect("pass");
    assert_eq!(pass.parked, 1, "{pass:?}: the look-up is still down");
    app.state.provider.lookup_down(false);
    let pass = completer.run_once().await.expect("pass");
    assert_eq!(pass.completed, 1, "{pass:?}");
    assert_eq!(app.state.provider.posts(), 1);
    assert_eq!(h.captured().await, 1);
    let r = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert!(r.replayed());
}

/// Case: an owner that wakes after a takeover is refused at its next
/// write: its final phase is not kept and it does not answer a success.
pub async fn lease_stale_owner_is_refused_and_its_writes_are_not_kept<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h
        .pay_app(
            LeaseMode::new(Duration::from_millis(400)).expect("a usable lease"),
            WAIT,
        )
        .await;
    let stale = {
        let router = app.router.clone();
        tokio::spawn(async move {
            send(
                &router,
                payment("pay-1", r#"{"amount":5000,"pause_ms":1500}"#),
            )
            .await
        })
    };
    // The first attempt charged and pauses (no step runs, so no renewal);
    // its lease lapses and a retry takes over.
    tokio::time::sleep(Duration::from_millis(900)).await;
    let other = app.instance(&h, WAIT);
    let retry = send(
        &other,
        payment("pay-1", r#"{"amount":5000,"pause_ms":1500}"#),
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    let stale = stale.await.expect("no panic");
    assert_eq!(stale.status, StatusCode::CONFLICT, "{stale:?}");
    assert_eq!(stale.problem(), "lease-lost");
    assert_eq!(app.state.provider.charges(), 1);
    assert_eq!(app.state.provider.posts(), 1);
    assert_eq!(
        h.captured().await,
        1,
        "the stale final phase was rolled back"
    );
    assert_eq!(h.orders().await, 1);
    assert_eq!(generation(&h).await, 2);
    let again = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(
        again.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "another body"
    );
    let again = send(
        &app.router,
        payment("pay-1", r#"{"amount":5000,"pause_ms":1500}"#),
    )
    .await;
    assert!(again.replayed());
    assert_eq!(again.body, retry.body);
}

/// Case: concurrent retries of a lapsed lease: exactly one takes over.
pub async fn lease_concurrent_takeovers_exactly_one_wins<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h
        .pay_app(
            LeaseMode::new(LEASE).expect("a usable lease"),
            Duration::from_secs(5),
        )
        .await;
    app.state.provider.fault(Fault::FailBefore);
    let a = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
    let mut retries = Vec::new();
    for i in 0..10 {
        let router = if i % 2 == 0 {
            app.router.clone()
        } else {
            app.instance(&h, Duration::from_secs(5))
        };
        retries.push(tokio::spawn(async move {
            send(&router, payment("pay-1", PAY)).await
        }));
    }
    let mut created = 0;
    for r in retries {
        let r = r.await.expect("no panic");
        assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
        created += usize::from(!r.replayed());
    }
    assert_eq!(created, 1, "one took over, the others replayed its answer");
    assert_eq!(app.executions(), 2);
    assert_eq!(generation(&h).await, 2);
    assert_eq!(app.state.provider.charges(), 1);
    assert_eq!(h.captured().await, 1);
}

/// Case: a step longer than the lease keeps it by renewing: a duplicate
/// meanwhile waits and gets `409`, it does not take over.
pub async fn lease_is_renewed_during_a_long_step<DB: ConformanceDb>(h: Harness<DB>) {
    // The call outlasts the lease five times over; the step's own timeout
    // is longer still. A lease of a second (renewed every third of it)
    // keeps two thirds of it to spare for a renewal that a busy machine
    // delays; the duplicate comes after two leases, when only renewals
    // can have kept it.
    let mode = LeaseMode::new(Duration::from_secs(1))
        .expect("a usable lease")
        .with_step_timeout(Duration::from_secs(10))
        .expect("a usable lease");
    let app = h.pay_app(mode, Duration::from_millis(300)).await;
    app.state
        .provider
        .fault(Fault::ChargeThenHang(Duration::from_secs(5)));
    let first = {
        let router = app.router.clone();
        tokio::spawn(async move { send(&router, payment("pay-1", PAY)).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let dup = send(
        &app.instance(&h, Duration::from_millis(300)),
        payment("pay-1", PAY),
    )
    .await;
    assert_eq!(dup.status, StatusCode::CONFLICT, "{dup:?}");
    assert_eq!(dup.problem(), "in-flight");
    assert!(dup.headers.contains_key("retry-after"));
    let first = first.await.expect("no panic");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(generation(&h).await, 1, "never taken over");
    assert_eq!(app.state.provider.posts(), 1);
    assert_eq!(h.captured().await, 1);
}

/// Case: the completer finishes a payment abandoned mid-charge, with no
/// client retry; the client's later retry replays it.
pub async fn lease_completer_finishes_an_abandoned_payment<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h
        .pay_app(LeaseMode::new(LEASE).expect("a usable lease"), WAIT)
        .await;
    abandon_mid_charge(&app.router, &app.state.provider, "pay-1", CUT).await;
    let completer = app.completer(&h);
    let pass = completer.run_once().await.expect("pass");
    assert_eq!(pass.completed, 1, "{pass:?}");
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
    assert_eq!(h.captured().await, 1);
    assert_eq!(app.state.provider.posts(), 1);
    // Another instance's completer finds nothing left.
    let pass = app.completer(&h).run_once().await.expect("pass");
    assert_eq!(pass.found, 0, "{pass:?}");
    let r = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert!(r.replayed());
}

/// Case: a request the handler rejects before any phase frees the key.
pub async fn lease_rejection_before_any_phase_frees_the_key<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h
        .pay_app(LeaseMode::new(LEASE).expect("a usable lease"), WAIT)
        .await;
    let bad = send(&app.router, payment("pay-1", r#"{"amount":0}"#)).await;
    assert_eq!(bad.status, StatusCode::UNPROCESSABLE_ENTITY, "{bad:?}");
    assert_eq!(h.ledger().await, 0);
    let good = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(good.status, StatusCode::CREATED, "{good:?}");
    assert_eq!(app.state.provider.charges(), 1);
}

/// Case: a step with no look-up parks an uncertain outcome at once.
pub async fn lease_step_without_lookup_parks_an_uncertain_outcome<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h
        .pay_app(LeaseMode::new(LEASE).expect("a usable lease"), WAIT)
        .await;
    app.state.provider.fault(Fault::ChargeThenDrop);
    let body = r#"{"amount":5000,"no_lookup":true}"#;
    let a = send(&app.router, payment("pay-1", body)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
    assert_eq!(a.problem(), "reconciling");
    let b = send(&app.router, payment("pay-1", body)).await;
    assert_eq!(b.problem(), "reconciling");
    assert_eq!(app.state.provider.posts(), 1);
    assert_eq!(h.captured().await, 0);
    // No completer can prove its outcome: passes leave it to an operator
    // (not even listed, so no takeover after takeover).
    let pass = app.completer(&h).run_once().await.expect("pass");
    assert_eq!(pass.found, 0, "{pass:?}");
    assert_eq!(generation(&h).await, 1);
    // An operator resolves it by its status.
    let reconciler = Reconciler::new(h.pool.clone());
    let parked = reconciler.unresolved(10).await.expect("list");
    assert_eq!(parked.len(), 1, "{parked:?}");
    reconciler
        .resolve(&parked[0], Resolution::Rerun)
        .await
        .expect("resolve");
    // The sweeper never touches it.
    crate::Sweeper::new(h.pool.clone())
        .sweep_at(std::time::SystemTime::now() + Duration::from_secs(100 * 365 * 86_400))
        .await
        .expect("sweep");
    assert_eq!(h.ledger().await, 1);
}
