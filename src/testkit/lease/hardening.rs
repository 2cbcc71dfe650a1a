//! Lease-mode cases from the outside probes of the money paths: each failed
//! before its fix (the numbers are the hardening issue's).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::StatusCode;

use super::{
    Charge, Fault, PayApp, PayState, Provider, abandon, abandon_mid_charge, buffered, park, pay,
    payment,
};
use crate::IdempotencyLayer;
use crate::lease::{Completer, LeaseError, LeaseMode, Leased, Recovered, StepError};
use crate::reconcile::ResolveError;
use crate::store::RecordStatus;
use crate::testkit::{ConformanceDb, Harness, bearer, send};
use crate::{Reconciler, Resolution};

const PAY: &str = r#"{"amount":5000}"#;
const WAIT: Duration = Duration::from_secs(2);

fn mode(lease: Duration) -> LeaseMode {
    LeaseMode::new(lease).expect("a usable lease")
}

fn layer<DB: ConformanceDb>(h: &Harness<DB>, mode: LeaseMode) -> IdempotencyLayer<DB> {
    IdempotencyLayer::new(h.pool.clone())
        .with_principal(bearer)
        .with_lease(mode)
        .with_in_flight_wait(WAIT)
}

fn answer(status: u16, body: &'static str) -> http::Response<bytes::Bytes> {
    http::Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(bytes::Bytes::from_static(body.as_bytes()))
        .expect("a response")
}

async fn count<DB: ConformanceDb>(h: &Harness<DB>, sql: &'static str) -> i64 {
    DB::count(&h.pool, sql).await
}

async fn pending<DB: ConformanceDb>(h: &Harness<DB>) -> i64 {
    count(
        h,
        "SELECT COUNT(*) FROM idempotency_records WHERE pending_step IS NOT NULL",
    )
    .await
}

async fn generation<DB: ConformanceDb>(h: &Harness<DB>) -> i64 {
    count(h, "SELECT MAX(generation) FROM idempotency_records").await
}

/// Holds every ledger row's write lock (SQLite: the database's) until the
/// transaction returned ends, as a writer that stalls would.
async fn lock_ledger<DB: ConformanceDb>(h: &Harness<DB>) -> sqlx::Transaction<'static, DB> {
    let mut holder = h.pool.begin().await.expect("begin");
    DB::exec_on(
        &mut holder,
        "UPDATE idempotency_records SET generation = generation",
    )
    .await
    .expect("lock the rows");
    holder
}

/// A handler that charges first, with no phase before its step.
async fn charge_first<DB: ConformanceDb>(
    State(st): State<PayState<DB>>,
    leased: Leased<DB>,
) -> Response {
    st.executions.fetch_add(1, Ordering::SeqCst);
    charge_then_answer(&st.provider, &leased).await
}

async fn charge_then_answer<DB: ConformanceDb>(
    provider: &Provider,
    leased: &Leased<DB>,
) -> Response {
    let charged = leased
        .step(
            "charge",
            |key| provider.charge(key, 100),
            |key| provider.lookup(key),
        )
        .await;
    match charged {
        Ok(Charge::Captured(id)) => (StatusCode::CREATED, id).into_response(),
        Ok(Charge::Declined) => StatusCode::PAYMENT_REQUIRED.into_response(),
        Err(StepError::Lease(e)) => e.into_response(),
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "provider failed").into_response(),
    }
}

fn charge_first_app<DB: ConformanceDb>(h: &Harness<DB>, app: &PayApp<DB>) -> Router {
    Router::new()
        .route("/payments", post(charge_first::<DB>))
        .layer(layer(h, app.mode))
        .with_state(app.state.clone())
}

/// A completer for `charge_first`: its resume function answers the rule for
/// a bare claim (a rejection), or with `drive_pending` runs a pending step.
fn charge_first_completer<DB: ConformanceDb>(
    h: &Harness<DB>,
    app: &PayApp<DB>,
    drive_pending: bool,
) -> Completer<DB> {
    let provider = Arc::clone(&app.state.provider);
    Completer::new(h.pool.clone(), app.mode).resume("POST /payments", move |leased| {
        let provider = Arc::clone(&provider);
        async move {
            let res = if drive_pending && leased.pending_step().is_some() {
                // The step may have run: run it, so it recovers first.
                charge_then_answer(&provider, &leased).await
            } else {
                // Nothing saved: the rule for a bare claim, a rejection.
                (StatusCode::UNPROCESSABLE_ENTITY, "nothing to resume").into_response()
            };
            buffered(res).await
        }
    })
}

/// Case (point 1): a stale owner whose bare claim the completer deleted (and the
/// retry claimed again, at generation 1 once more) is refused at its first
/// write, and never charges under its own step key.
pub async fn lease_stale_owner_of_a_deleted_claim_charges_nothing<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h
        .pay_app(
            mode(Duration::from_millis(1000)),
            Duration::from_millis(200),
        )
        .await;
    // A stalls before its first phase, past its lease.
    app.state.pause_next_ms.store(1500, Ordering::SeqCst);
    let a = {
        let router = app.router.clone();
        tokio::spawn(async move { send(&router, payment("re-1", PAY)).await })
    };
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // Nothing saved: the completer deletes the bare claim, as documented.
    let pass = app.completer(&h).run_once().await.expect("pass");
    assert_eq!(h.ledger().await, 0, "{pass:?}: the bare claim is deleted");
    // B claims again; its charge is slow, so A wakes while B holds the row.
    app.state
        .provider
        .fault(Fault::ChargeThenHang(Duration::from_millis(1000)));
    let b = send(&app.router, payment("re-1", PAY)).await;
    let a = a.await.expect("no panic");
    assert_eq!(
        app.state.provider.charges(),
        1,
        "two charges for one key: A {a:?}, B {b:?}"
    );
    assert_eq!(h.orders().await, 1, "A {a:?}, B {b:?}");
    assert_eq!(b.status, StatusCode::CREATED, "{b:?}");
    assert_eq!(a.status, StatusCode::CONFLICT, "{a:?}");
    assert_eq!(a.problem(), "lease-lost", "{a:?}");
    let again = send(&app.router, payment("re-1", PAY)).await;
    assert_eq!(again.body, b.body, "the retry replays B's answer");
}

/// Case (point 2): a resume function that answers a final answer over a pending
/// step it never recovered (the charge may be taken) is refused: the record
/// is parked, listed, and a resume that runs the step finishes it.
pub async fn lease_final_answer_over_an_unrecovered_pending_step_parks<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h.pay_app(mode(Duration::from_secs(30)), WAIT).await;
    let router = charge_first_app(&h, &app);
    abandon_mid_charge(
        &router,
        &app.state.provider,
        "pend-1",
        Duration::from_millis(500),
    )
    .await;
    assert_eq!(pending(&h).await, 1);
    let pass = charge_first_completer(&h, &app, false)
        .run_once()
        .await
        .expect("pass");
    assert_eq!(
        h.ledger_with("FAILED_FINAL").await,
        0,
        "{pass:?}: a final answer was recorded over a charge that may be taken"
    );
    assert_eq!(pending(&h).await, 1, "the pending step is kept");
    assert_eq!(h.ledger_with("NEEDS_RECONCILIATION").await, 1, "{pass:?}");
    let listed = Reconciler::new(h.pool.clone())
        .unresolved(10)
        .await
        .expect("list");
    assert_eq!(listed.len(), 1, "{listed:?}");
    let r = send(&router, payment("pend-1", PAY)).await;
    assert_eq!(r.problem(), "reconciling", "{r:?}");
    // A resume function that sees the pending step and runs it: `recover`
    // finds the charge, and the record completes without a second one.
    let pass = charge_first_completer(&h, &app, true)
        .run_once()
        .await
        .expect("pass");
    assert_eq!(pass.completed, 1, "{pass:?}");
    assert_eq!(app.state.provider.posts(), 1);
    assert_eq!(app.state.provider.charges(), 1);
    let r = send(&router, payment("pend-1", PAY)).await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert!(r.replayed());
}

/// Case (point 3): a charge stranded with no retry and no completer (a lapsed
/// lease with a pending step) is listed for operators, and so is a record
/// lapsed for longer than the configured age; an operator's verdict on it
/// wins over the stale owner.
pub async fn lease_stranded_records_are_listed_for_operators<DB: ConformanceDb>(h: Harness<DB>) {
    let lease = mode(Duration::from_secs(30))
        .with_step_timeout(Duration::from_millis(700))
        .expect("a usable timeout");
    let app = h.pay_app(lease, WAIT).await;
    let router = charge_first_app(&h, &app);
    abandon_mid_charge(
        &router,
        &app.state.provider,
        "strand-1",
        Duration::from_millis(500),
    )
    .await;
    let reconciler = Reconciler::new(h.pool.clone());
    // Listed once its call cannot land any more (the step's timeout).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let listed = reconciler.unresolved(10).await.expect("list");
    assert_eq!(listed.len(), 1, "a taken charge nobody can see: {listed:?}");
    assert_eq!(listed[0].status, RecordStatus::Processing);
    assert_eq!(listed[0].pending_step.as_deref(), Some("charge"));
    // A bare claim lapsed (nothing pending) is listed once it is older than
    // the configured age.
    app.state.pause_next_ms.store(5000, Ordering::SeqCst);
    abandon(
        &app.router,
        payment("strand-2", PAY),
        Duration::from_millis(300),
    )
    .await;
    assert_eq!(reconciler.unresolved(10).await.expect("list").len(), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let aged = Reconciler::new(h.pool.clone()).with_stranded_after(Duration::from_millis(100));
    let listed = aged.unresolved(10).await.expect("list");
    assert_eq!(listed.len(), 2, "{listed:?}");
    // The operator checked the provider: the charge is there.
    let stranded = listed
        .iter()
        .find(|r| r.pending_step.is_some())
        .expect("the stranded charge");
    reconciler
        .resolve(
            stranded,
            Resolution::Succeeded(answer(201, r#"{"by":"operator"}"#)),
        )
        .await
        .expect("the verdict wins");
    let r = send(&router, payment("strand-1", PAY)).await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert_eq!(&r.body[..], br#"{"by":"operator"}"#);
    assert_eq!(app.state.provider.posts(), 1);
}

/// Case (point 4): a step name used twice in one attempt is refused as misuse,
/// never answered with the first step's saved result.
pub async fn lease_step_name_reused_in_one_attempt_is_refused<DB: ConformanceDb>(h: Harness<DB>) {
    let provider = Arc::new(Provider::default());
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let (p, s) = (Arc::clone(&provider), Arc::clone(&seen));
    let handler = move |leased: Leased<DB>| {
        let (p, s) = (Arc::clone(&p), Arc::clone(&s));
        async move {
            for amount in [100, 250] {
                let r = leased
                    .step("charge", |k| p.charge(k, amount), |k| p.lookup(k))
                    .await;
                let seen = match &r {
                    Ok(c) => format!("ok {c:?}"),
                    Err(StepError::Lease(LeaseError::Misuse(m))) => format!("misuse {m}"),
                    Err(e) => format!("error {e}"),
                };
                s.lock().expect("lock").push(seen);
                if r.is_err() {
                    return (StatusCode::INTERNAL_SERVER_ERROR, "misuse").into_response();
                }
            }
            (StatusCode::CREATED, "both charged").into_response()
        }
    };
    let router = Router::new()
        .route("/payments", post(handler))
        .layer(layer(&h, mode(Duration::from_secs(30))));
    let r = send(&router, payment("twice-1", PAY)).await;
    let seen = seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen[1].starts_with("misuse"), "{seen:?}");
    assert_ne!(r.status, StatusCode::CREATED, "{r:?}");
    assert_eq!(h.ledger_with("SUCCEEDED").await, 0);
    assert_eq!(provider.posts(), 1);
}

/// Case (point 5): an operator's verdict given while a completer pass holds the
/// parked record is never dropped as a lost race: it wins, or it fails with
/// an error that says the record is held, and wins when given again.
pub async fn lease_operator_verdict_during_a_completer_pass_is_not_dropped<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h.pay_app(mode(Duration::from_secs(30)), WAIT).await;
    park(&app.router, &app.state.provider, "verdict-1").await;
    let reconciler = Reconciler::new(h.pool.clone());
    let listed = reconciler.unresolved(10).await.expect("list");
    assert_eq!(listed.len(), 1);
    // A pass whose look-up is slow (and then fails) holds the record.
    app.state.provider.lookup_delay(Duration::from_millis(1500));
    let pass = {
        let completer = app.completer(&h);
        tokio::spawn(async move { completer.run_once().await })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    let verdict = reconciler
        .resolve(&listed[0], Resolution::Succeeded(answer(201, r#"{"v":1}"#)))
        .await;
    let pass = pass.await.expect("no panic").expect("pass");
    match verdict {
        Ok(()) => {}
        Err(ResolveError::Held { .. }) => {
            // Said why; given again on a new listing once the pass let go
            // (it parked the record again), it wins.
            let listed = reconciler.unresolved(10).await.expect("list");
            reconciler
                .resolve(&listed[0], Resolution::Succeeded(answer(201, r#"{"v":1}"#)))
                .await
                .expect("the verdict given again wins");
        }
        Err(e) => panic!("{pass:?}: the verdict was refused with {e:?} though nobody settled it"),
    }
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1, "{pass:?}");
    let r = send(&app.router, payment("verdict-1", PAY)).await;
    assert_eq!(&r.body[..], br#"{"v":1}"#, "{r:?}");
}

/// Case (point 6): a record parked past its retention, then settled (by a
/// completer or an operator), replays its answer for a full retention.
pub async fn lease_settled_answer_is_replayable_for_the_full_retention<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h.pay_app(mode(Duration::from_secs(30)), WAIT).await;
    let router = Router::new()
        .route("/payments", post(pay::<DB>))
        .layer(layer(&h, app.mode).with_retention(Duration::from_millis(1500)))
        .with_state(app.state.clone());
    for key in ["ret-1", "ret-2"] {
        park(&router, &app.state.provider, key).await;
    }
    tokio::time::sleep(Duration::from_millis(1800)).await;
    // One recovered by a completer, the other settled by an operator.
    let reconciler = Reconciler::new(h.pool.clone());
    let listed = reconciler.unresolved(10).await.expect("list");
    let manual = listed
        .iter()
        .find(|r| r.key == "ret-2")
        .expect("listed")
        .clone();
    reconciler
        .resolve(
            &manual,
            Resolution::Succeeded(answer(201, r#"{"by":"operator"}"#)),
        )
        .await
        .expect("resolved");
    app.state.provider.lookup_down(false);
    let pass = app.completer(&h).run_once().await.expect("pass");
    assert_eq!(pass.completed, 1, "{pass:?}");
    for key in ["ret-1", "ret-2"] {
        let r = send(&router, payment(key, PAY)).await;
        assert_eq!(
            r.status,
            StatusCode::CREATED,
            "{key}: a settled answer must replay for its retention: {r:?}"
        );
        assert!(r.replayed(), "{r:?}");
    }
}

/// Case (point 7): parked records whose look-up stays down back off, so a pass
/// reaches the abandoned record behind them, and on every store in the same
/// order.
pub async fn lease_parked_records_back_off_and_do_not_starve_the_completer<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h.pay_app(mode(Duration::from_secs(30)), WAIT).await;
    for i in 0..16 {
        park(&app.router, &app.state.provider, &format!("parked-{i}")).await;
    }
    // An abandoned record that needs only its final phase: charged, then
    // the attempt is dropped during its pause.
    abandon(
        &app.router,
        payment("abandoned", r#"{"amount":5000,"pause_ms":3000}"#),
        Duration::from_millis(500),
    )
    .await;
    let before = app.state.provider.lookups();
    let completer = app.completer(&h);
    let mut completed = 0;
    for _ in 0..3 {
        completed += completer.run_once().await.expect("pass").completed;
    }
    let lookups = app.state.provider.lookups() - before;
    assert_eq!(completed, 1, "the abandoned record was never reached");
    assert!(
        lookups <= 16,
        "{lookups} look-ups in three passes: parked records are retried on every pass"
    );
}

/// Case (point 7): saved data that cannot be decoded parks the record for an
/// operator instead of being retaken every lease.
pub async fn lease_undecodable_saved_data_is_parked_not_retaken<DB: ConformanceDb>(h: Harness<DB>) {
    let lease = mode(Duration::from_millis(300))
        .with_step_timeout(Duration::from_secs(10))
        .expect("a usable timeout");
    let app = h.pay_app(lease, WAIT).await;
    abandon_mid_charge(
        &app.router,
        &app.state.provider,
        "bad-1",
        Duration::from_millis(400),
    )
    .await;
    let corrupt = if DB::LABEL == "postgres" {
        "UPDATE idempotency_records SET recovery_data = '\\x7b'::bytea"
    } else {
        "UPDATE idempotency_records SET recovery_data = X'7B'"
    };
    DB::exec(&h.pool, corrupt).await;
    let completer = app.completer(&h);
    completer.run_once().await.expect("pass");
    let taken = generation(&h).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let pass = completer.run_once().await.expect("pass");
    assert_eq!(
        generation(&h).await,
        taken,
        "{pass:?}: retaken after its lease lapsed again"
    );
    assert_eq!(h.ledger_with("NEEDS_RECONCILIATION").await, 1);
    let listed = Reconciler::new(h.pool.clone())
        .unresolved(10)
        .await
        .expect("list");
    assert_eq!(listed.len(), 1, "{listed:?}");
    let r = send(&app.router, payment("bad-1", PAY)).await;
    assert_eq!(r.problem(), "reconciling", "{r:?}");
}

/// Case (point 7): a takeover whose statement wins after its caller
/// stopped waiting (the row was locked past the caller's wait) ends the
/// lease it won: no live lease is left without an owner.
pub async fn lease_takeover_nobody_waits_for_ends_its_lease<DB: ConformanceDb>(h: Harness<DB>) {
    use crate::store::{OwnedScope, Owning, Scope, spawn_owning};
    let app = h.pay_app(mode(Duration::from_secs(3)), WAIT).await;
    abandon_mid_charge(
        &app.router,
        &app.state.provider,
        "cut-1",
        Duration::from_millis(400),
    )
    .await;
    let seen = h
        .record("payer-1", "POST /payments", "cut-1")
        .await
        .and_then(|r| r.lease)
        .expect("a lapsed lease");
    assert!(!seen.live);
    // Another writer holds the row past the takeover's wait.
    let holder = lock_ledger(&h).await;
    let scope = Scope {
        principal: "payer-1",
        operation: "POST /payments",
        key: "cut-1",
    };
    let owning = Owning::TakeOver {
        scope: OwnedScope::new(&scope),
        generation: seen.generation,
        claim_id: seen.claim_id.clone(),
        lease_ms: 60_000,
        parked: false,
    };
    let waited = spawn_owning(h.pool.clone(), owning, Duration::from_millis(100)).await;
    assert!(waited.is_err(), "the caller stopped waiting: {waited:?}");
    holder.commit().await.expect("let go");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let now = h
        .record("payer-1", "POST /payments", "cut-1")
        .await
        .and_then(|r| r.lease)
        .expect("the lease row");
    assert_eq!(now.generation, seen.generation + 1, "the takeover landed");
    assert!(!now.live, "a live lease nobody owns: {now:?}");
    let r = send(&app.router, payment("cut-1", PAY)).await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert_eq!(app.state.provider.charges(), 1);
}

/// Case (point 8): a call provably never sent (connection refused) ends the lease
/// without parking, and the retry runs the step.
pub async fn lease_call_provably_not_sent_ends_the_lease_without_parking<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h.pay_app(mode(Duration::from_secs(30)), WAIT).await;
    // The provider is down: its look-up too.
    app.state.provider.lookup_down(true);
    app.state.provider.fault(Fault::Refused);
    let r = send(&app.router, payment("down-1", PAY)).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{r:?}");
    assert!(
        !String::from_utf8_lossy(&r.body).contains("reconciling"),
        "{r:?}"
    );
    assert_eq!(h.ledger_with("NEEDS_RECONCILIATION").await, 0);
    assert_eq!(pending(&h).await, 0);
    assert_eq!(app.state.provider.lookups(), 0, "nothing to look up");
    app.state.provider.lookup_down(false);
    let r = send(&app.router, payment("down-1", PAY)).await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert_eq!(app.state.provider.charges(), 1);
    assert_eq!(h.captured().await, 1);
}

/// Notes when the guarded call's future is dropped.
struct DropAt(Arc<Mutex<Option<Instant>>>);

impl Drop for DropAt {
    fn drop(&mut self) {
        *self.0.lock().expect("lock") = Some(Instant::now());
    }
}

/// Case (point 9): a renewal blocked on a row lock does not freeze the step's
/// timeout: the call is cut at its timeout, not when the lock is let go.
pub async fn lease_blocked_renewal_does_not_freeze_the_step_timeout<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let started: Arc<Mutex<Option<Instant>>> = Arc::default();
    let dropped: Arc<Mutex<Option<Instant>>> = Arc::default();
    let (s, d) = (Arc::clone(&started), Arc::clone(&dropped));
    let handler = move |leased: Leased<DB>| {
        let (s, d) = (Arc::clone(&s), Arc::clone(&d));
        async move {
            let r = leased
                .step(
                    "slow",
                    |_k| {
                        let (s, d) = (Arc::clone(&s), Arc::clone(&d));
                        async move {
                            *s.lock().expect("lock") = Some(Instant::now());
                            let _noted = DropAt(d);
                            tokio::time::sleep(Duration::from_secs(10)).await;
                            Ok::<_, crate::lease::CallError<String>>(1u8)
                        }
                    },
                    |_k| async { Ok::<_, String>(Recovered::<u8>::Absent) },
                )
                .await;
            match r {
                Ok(_) => (StatusCode::CREATED, "done").into_response(),
                Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "timed out").into_response(),
            }
        }
    };
    let lease = mode(Duration::from_millis(300))
        .with_step_timeout(Duration::from_secs(1))
        .expect("a usable timeout");
    let router = Router::new()
        .route("/payments", post(handler))
        .layer(layer(&h, lease));
    let request = {
        let router = router.clone();
        tokio::spawn(async move { send(&router, payment("slow-1", PAY)).await })
    };
    let t0 = loop {
        if let Some(t) = *started.lock().expect("lock") {
            break t;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let holder = lock_ledger(&h).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    holder.rollback().await.expect("let go");
    let r = request.await.expect("no panic");
    let cut = dropped.lock().expect("lock").expect("the call was dropped") - t0;
    assert!(
        cut < Duration::from_millis(2500),
        "a 1 s step timeout fired after {cut:?}: {r:?}"
    );
}

/// Case (point 10): step and point names are checked against one limit on every
/// store, refused with a typed error before anything runs, and no raw
/// database message reaches the client.
pub async fn lease_step_and_point_names_are_validated<DB: ConformanceDb>(h: Harness<DB>) {
    let provider = Arc::new(Provider::default());
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let (p, s, c) = (Arc::clone(&provider), Arc::clone(&seen), Arc::clone(&calls));
    let handler = move |leased: Leased<DB>| {
        let (p, s, c) = (Arc::clone(&p), Arc::clone(&s), Arc::clone(&c));
        async move {
            let n = c.fetch_add(1, Ordering::SeqCst);
            let long = "s".repeat(256);
            let name = match n {
                0 => long.as_str(),
                1 => "nul\0step",
                _ => "~claim",
            };
            let stepped = leased.step(name, |k| p.charge(k, 1), |k| p.lookup(k)).await;
            s.lock().expect("lock").push(match stepped {
                Err(StepError::Lease(LeaseError::InvalidName { .. })) => "invalid".into(),
                other => format!("{other:?}"),
            });
            let point = match leased.phase().await {
                Ok(phase) => phase.commit(name).await,
                Err(e) => Err(e),
            };
            s.lock().expect("lock").push(match point {
                Err(LeaseError::InvalidName { .. }) => "invalid".into(),
                other => format!("{other:?}"),
            });
            (StatusCode::UNPROCESSABLE_ENTITY, "refused").into_response()
        }
    };
    let router = Router::new()
        .route("/payments", post(handler))
        .layer(layer(&h, mode(Duration::from_secs(30))));
    for i in 0..3 {
        let r = send(&router, payment(&format!("name-{i}"), PAY)).await;
        let body = String::from_utf8_lossy(&r.body).to_lowercase();
        assert!(!body.contains("data too long"), "{r:?}");
    }
    let seen = seen.lock().expect("lock").clone();
    assert_eq!(seen, vec!["invalid"; 6], "{seen:?}");
    assert_eq!(provider.posts(), 0);
}

/// Case (issue 26, point 3): a handler that misuses lease mode (a step
/// name the ledger cannot hold) is a programming error, not an outage: the
/// client gets `500 #lease-misuse` without `Retry-After`, nothing is
/// charged, and the key stays claimable, so the fixed deployment's retry
/// runs once.
pub async fn lease_misuse_is_a_500_and_the_key_stays_claimable<DB: ConformanceDb>(h: Harness<DB>) {
    let provider = Arc::new(Provider::default());
    let fixed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (p, f) = (Arc::clone(&provider), Arc::clone(&fixed));
    let handler = move |leased: Leased<DB>| {
        let (p, f) = (Arc::clone(&p), Arc::clone(&f));
        async move {
            let long = "s".repeat(256);
            let name = if f.load(Ordering::SeqCst) {
                "charge"
            } else {
                long.as_str()
            };
            match leased.step(name, |k| p.charge(k, 1), |k| p.lookup(k)).await {
                Ok(_) => (StatusCode::CREATED, "charged").into_response(),
                Err(StepError::Lease(e)) => e.into_response(),
                Err(other) => (StatusCode::BAD_GATEWAY, format!("{other:?}")).into_response(),
            }
        }
    };
    let router = Router::new()
        .route("/payments", post(handler))
        .layer(layer(&h, mode(Duration::from_secs(30))));
    for _ in 0..2 {
        let r = send(&router, payment("misused-1", PAY)).await;
        assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{r:?}");
        assert_eq!(r.problem(), "lease-misuse", "{r:?}");
        assert!(!r.headers.contains_key("retry-after"), "{r:?}");
    }
    assert_eq!(provider.posts(), 0);
    fixed.store(true, Ordering::SeqCst);
    let r = send(&router, payment("misused-1", PAY)).await;
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "the fixed deployment serves the retry: {r:?}"
    );
    assert_eq!(provider.posts(), 1);
}

/// Case (review): an operator's verdict given on a listing that a completer
/// pass has since acted on (it found the charge absent, ran the step, and
/// parked the record again) is refused as changed, never recorded over the
/// charge the pass made.
pub async fn lease_verdict_on_a_record_changed_since_its_listing_is_refused<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let lease = mode(Duration::from_secs(30))
        .with_step_timeout(Duration::from_secs(1))
        .expect("a usable timeout");
    let app = h.pay_app(lease, WAIT).await;
    let provider = Arc::clone(&app.state.provider);
    provider.fault(Fault::FailBefore);
    provider.lookup_down(true);
    let a = send(&app.router, payment("old-1", PAY)).await;
    assert_eq!(a.problem(), "reconciling", "{a:?}");
    let reconciler = Reconciler::new(h.pool.clone());
    let listed = reconciler.unresolved(10).await.expect("list");
    assert_eq!(listed.len(), 1);
    let step = crate::lease::StepKey::of(&listed[0], "charge").expect("a claim id");
    assert!(
        !provider.has_charge(&step),
        "the operator checked: no charge"
    );
    // A completer pass: the look-up is back and proves the charge absent,
    // so the step runs; its answer is slow, and the look-up fails again.
    provider.lookup_down(false);
    provider.fault(Fault::ChargeThenHang(Duration::from_secs(3)));
    let watcher = {
        let provider = Arc::clone(&provider);
        tokio::spawn(async move {
            while provider.posts() < 2 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            provider.lookup_down(true);
        })
    };
    let pass = app.completer(&h).run_once().await.expect("pass");
    watcher.abort();
    assert_eq!(pass.parked, 1, "{pass:?}");
    assert!(provider.has_charge(&step), "the pass charged");
    let verdict = reconciler
        .resolve(
            &listed[0],
            Resolution::Failed(answer(402, r#"{"declined":true}"#)),
        )
        .await;
    assert!(
        matches!(verdict, Err(ResolveError::Changed { .. })),
        "a verdict on the old listing: {verdict:?}; FAILED_FINAL rows: {}",
        h.ledger_with("FAILED_FINAL").await
    );
    assert_eq!(h.ledger_with("NEEDS_RECONCILIATION").await, 1);
}

/// Case (review): a step still inside its timeout is not listed as
/// stranded, even when its renewals are held up: a step's lease covers its
/// timeout, so an operator never settles a call that may still land.
pub async fn lease_step_within_its_timeout_is_not_listed_as_stranded<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let lease = mode(Duration::from_millis(300))
        .with_step_timeout(Duration::from_secs(3))
        .expect("a usable timeout");
    let app = h.pay_app(lease, WAIT).await;
    app.state
        .provider
        .fault(Fault::ChargeThenHang(Duration::from_millis(1500)));
    let request = {
        let router = app.router.clone();
        tokio::spawn(async move { send(&router, payment("slow-2", PAY)).await })
    };
    while app.state.provider.posts() < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Renewals are held up by a lock on the row.
    let holder = lock_ledger(&h).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let listed = Reconciler::new(h.pool.clone())
        .unresolved(10)
        .await
        .expect("list");
    holder.rollback().await.expect("let go");
    assert!(
        listed.is_empty(),
        "a call inside its timeout was listed for a verdict: {listed:?}"
    );
    let r = request.await.expect("no panic");
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
}
