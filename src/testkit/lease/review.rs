//! Lease-mode cases from an adversarial review: each failed before its fix.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::StatusCode;

use super::{Fault, Provider, park, pay, payment};
use crate::IdempotencyLayer;
use crate::lease::{Completer, LeaseMode, Leased, Recovered};
use crate::testkit::{ConformanceDb, Harness, bearer, send};
use crate::{Reconciler, Resolution};

const PAY: &str = r#"{"amount":5000}"#;
const WAIT: Duration = Duration::from_secs(2);

fn layer<DB: ConformanceDb>(h: &Harness<DB>, mode: LeaseMode) -> IdempotencyLayer<DB> {
    IdempotencyLayer::new(h.pool.clone())
        .with_principal(bearer)
        .with_lease(mode)
        .with_in_flight_wait(WAIT)
}

/// Phase "created" (once), then 422 — on generation 1 only after a pause
/// with no ledger write (a stale owner); later generations answer 201.
async fn reject_after_phase<DB: ConformanceDb>(leased: Leased<DB>) -> Response {
    if leased.saved::<i64>("created").ok().flatten().is_none() {
        let mut phase = match leased.phase().await {
            Ok(p) => p,
            Err(e) => return e.into_response(),
        };
        let id = match DB::insert_order(&mut phase, "Bearer payer-1", 1).await {
            Ok(id) => id,
            Err(e) => return (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
        };
        if let Err(e) = phase.commit_with("created", &id).await {
            return e.into_response();
        }
    }
    if leased.generation() == 1 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        return (StatusCode::UNPROCESSABLE_ENTITY, "card number invalid").into_response();
    }
    (StatusCode::CREATED, "charged").into_response()
}

/// Case: a client told 422 after a phase committed must not have its request
/// resumed (and completed) in the background by the completer.
pub async fn lease_rejection_after_a_phase_is_not_resumed_by_the_completer<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let mode = LeaseMode::new(Duration::from_secs(30)).expect("a usable lease");
    let app = Router::new()
        .route("/payments", post(reject_after_phase::<DB>))
        .layer(layer(&h, mode));
    let a = send(&app, payment("rej-1", PAY)).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{a:?}");
    let resumed = Arc::new(AtomicUsize::new(0));
    let r = Arc::clone(&resumed);
    let completer = Completer::new(h.pool.clone(), mode).resume("POST /payments", move |_l| {
        r.fetch_add(1, Ordering::SeqCst);
        async {
            http::Response::builder()
                .status(201)
                .body(bytes::Bytes::new())
                .unwrap()
        }
    });
    let pass = completer.run_once().await.expect("pass");
    assert_eq!(
        resumed.load(Ordering::SeqCst),
        0,
        "{pass:?}: the client was told 422, yet the completer resumed it; SUCCEEDED rows: {}",
        h.ledger_with("SUCCEEDED").await
    );
    // The rejection is the key's answer: recorded, replayed, final.
    assert_eq!(h.ledger_with("FAILED_FINAL").await, 1);
    let again = send(&app, payment("rej-1", PAY)).await;
    assert_eq!(again.status, StatusCode::UNPROCESSABLE_ENTITY, "{again:?}");
    assert!(again.replayed(), "{again:?}");
}

/// Case: a stale owner (taken over while paused) that answers a 4xx must get
/// `409 #lease-lost`, not pass its unrecorded 4xx through.
pub async fn lease_stale_owner_rejection_is_not_passed_through<DB: ConformanceDb>(h: Harness<DB>) {
    let mode = LeaseMode::new(Duration::from_millis(400)).expect("a usable lease");
    let app = Router::new()
        .route("/payments", post(reject_after_phase::<DB>))
        .layer(layer(&h, mode));
    let stale = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, payment("stale-1", PAY)).await })
    };
    tokio::time::sleep(Duration::from_millis(900)).await;
    let retry = send(&app, payment("stale-1", PAY)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    let stale = stale.await.expect("no panic");
    assert_eq!(
        stale.status,
        StatusCode::CONFLICT,
        "the stale owner answered {stale:?} while the recorded answer is 201"
    );
}

/// Case: records of an operation with no resume function must not starve the
/// registered ones (the list has no ORDER BY / no operation filter).
pub async fn lease_completer_is_not_starved_by_unregistered_operations<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h
        .pay_app(
            LeaseMode::new(Duration::from_secs(30)).expect("a usable lease"),
            WAIT,
        )
        .await;
    let other: Router = Router::new()
        .route("/other", post(pay::<DB>))
        .layer(layer(&h, app.mode))
        .with_state(app.state.clone());
    let req = |path: &str, key: &str| {
        http::Request::post(path)
            .header("content-type", "application/json")
            .header("authorization", "Bearer payer-1")
            .header("idempotency-key", key)
            .body(axum::body::Body::from(PAY))
            .unwrap()
    };
    for (router, path) in [(&other, "/other"), (&app.router, "/payments")] {
        app.state
            .provider
            .fault(Fault::ChargeThenHang(Duration::from_secs(5)));
        let cut =
            tokio::time::timeout(Duration::from_millis(500), send(router, req(path, "k-1"))).await;
        assert!(cut.is_err());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let completer = app.completer(&h).with_batch(1);
    let mut completed = 0;
    for _ in 0..3 {
        completed += completer.run_once().await.expect("pass").completed;
    }
    assert_eq!(completed, 1, "the POST /payments record was never reached");
}

/// Case: an operator's resolution of a parked record that a completer pass
/// re-took (and re-parked) meanwhile is never refused as "resolved by
/// someone else": it says the record changed, and given on a new listing it
/// wins.
pub async fn lease_completer_pass_does_not_void_an_operator_resolution<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let app = h
        .pay_app(
            LeaseMode::new(Duration::from_secs(30)).expect("a usable lease"),
            WAIT,
        )
        .await;
    // Parked with its look-up down: a completer pass may retry it.
    park(&app.router, &app.state.provider, "pay-1").await;
    let reconciler = Reconciler::new(h.pool.clone());
    let parked = reconciler.unresolved(10).await.expect("list");
    assert_eq!(parked.len(), 1);
    // A completer pass meanwhile: the look-up is still down, so it parks
    // the record again, one generation later.
    let pass = app.completer(&h).run_once().await.expect("pass");
    assert_eq!(pass.parked, 1, "{pass:?}");
    let answer = http::Response::builder()
        .status(201)
        .body(bytes::Bytes::from_static(b"{}"))
        .unwrap();
    let verdict = reconciler
        .resolve(&parked[0], Resolution::Succeeded(answer.clone()))
        .await;
    assert!(
        matches!(verdict, Err(crate::ResolveError::Changed { .. })),
        "{verdict:?}: the pass acted on the record since the listing"
    );
    let listed = reconciler.unresolved(10).await.expect("list");
    let verdict = reconciler
        .resolve(&listed[0], Resolution::Succeeded(answer))
        .await;
    assert!(
        verdict.is_ok(),
        "refused ({verdict:?}) though nobody resolved it"
    );
}

/// Two steps run at once: the one that finishes first clears the other's
/// pending mark, so a step with no look-up is executed again on resume.
async fn two_steps<DB: ConformanceDb>(
    State(p): State<Arc<Provider>>,
    leased: Leased<DB>,
) -> Response {
    let charge = leased.step_without_lookup("charge", |key| p.charge(key, 1));
    let note = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        leased
            .step(
                "note",
                |_k| async { Ok::<_, crate::lease::CallError<String>>(1u8) },
                |_k| async { Ok::<_, String>(Recovered::Done(1u8)) },
            )
            .await
    };
    let (c, n) = tokio::join!(charge, note);
    match (c, n) {
        (Ok(_), Ok(_)) => (StatusCode::CREATED, "ok").into_response(),
        _ => (StatusCode::SERVICE_UNAVAILABLE, "step").into_response(),
    }
}

/// Case: a second step started while another runs is refused, so a step
/// with no look-up keeps its pending mark and is parked on resume, never
/// executed again.
pub async fn lease_concurrent_steps_keep_each_pending_mark<DB: ConformanceDb>(h: Harness<DB>) {
    let provider = Arc::new(Provider::default());
    let app = Router::new()
        .route("/payments", post(two_steps::<DB>))
        .layer(layer(
            &h,
            LeaseMode::new(Duration::from_secs(30)).expect("a usable lease"),
        ))
        .with_state(Arc::clone(&provider));
    provider.fault(Fault::ChargeThenHang(Duration::from_secs(5)));
    let cut = tokio::time::timeout(
        Duration::from_millis(500),
        send(&app, payment("two-1", PAY)),
    )
    .await;
    assert!(cut.is_err());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let retry = send(&app, payment("two-1", PAY)).await;
    assert_eq!(
        provider.posts(),
        1,
        "a step without a look-up was executed again ({retry:?}); it should be parked"
    );
}

/// Case: a key reused after its tombstone was purged is a new request, but its
/// step key is the old one: the provider deduplicates the new charge away.
pub async fn lease_step_key_differs_for_a_reused_key<DB: ConformanceDb>(h: Harness<DB>) {
    let app = h
        .pay_app(
            LeaseMode::new(Duration::from_secs(30)).expect("a usable lease"),
            WAIT,
        )
        .await;
    let a = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    let sweeper =
        crate::Sweeper::new(h.pool.clone()).with_tombstone_retention(Duration::from_millis(1));
    let later = SystemTime::now() + Duration::from_secs(10 * 365 * 86_400);
    sweeper.sweep_at(later).await.expect("sweep");
    sweeper
        .sweep_at(later + Duration::from_secs(1))
        .await
        .expect("sweep");
    assert_eq!(h.ledger().await, 0, "purged");
    let b = send(&app.router, payment("pay-1", r#"{"amount":7000}"#)).await;
    assert_eq!(b.status, StatusCode::CREATED, "{b:?}");
    assert_eq!(
        app.state.provider.charges(),
        2,
        "the new payment's charge was deduplicated onto the old one: {} / {}",
        String::from_utf8_lossy(&a.body),
        String::from_utf8_lossy(&b.body)
    );
}

/// Generation 1: a phase that outlasts the lease, then a pause with no
/// write; later generations answer at once.
async fn long_phase<DB: ConformanceDb>(leased: Leased<DB>) -> Response {
    if leased.generation() == 1 {
        let phase = match leased.phase().await {
            Ok(p) => p,
            Err(e) => return e.into_response(),
        };
        tokio::time::sleep(Duration::from_millis(700)).await;
        if let Err(e) = phase.commit("created").await {
            return e.into_response();
        }
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    (StatusCode::CREATED, "done").into_response()
}

/// Case: "leases … renewed by every phase": right after a phase commit the lease
/// must be live, so a duplicate waits instead of taking over.
pub async fn lease_phase_commit_renews_the_lease_from_commit_time<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let mode = LeaseMode::new(Duration::from_millis(500)).expect("a usable lease");
    let app = Router::new()
        .route("/payments", post(long_phase::<DB>))
        .layer(
            IdempotencyLayer::new(h.pool.clone())
                .with_principal(bearer)
                .with_lease(mode)
                .with_in_flight_wait(Duration::from_millis(200)),
        );
    let first = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, payment("long-1", PAY)).await })
    };
    tokio::time::sleep(Duration::from_millis(850)).await;
    let dup = send(&app, payment("long-1", PAY)).await;
    let first = first.await.expect("no panic");
    assert_eq!(
        dup.status,
        StatusCode::CONFLICT,
        "duplicate 50 ms after the phase commit took the lease over: {dup:?}; first: {first:?}"
    );
}

/// Phase "created" whose transaction the server rolls back on its own
/// (simulated: a `ROLLBACK` on the phase's connection, as a deadlock or a
/// Galera abort does), after which the handler "retries" its insert and
/// commits the phase; on later generations, a plain phase.
async fn phase_rolled_back<DB: ConformanceDb>(leased: Leased<DB>) -> Response {
    let mut phase = match leased.phase().await {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    if leased.generation() == 1
        && let Err(e) = DB::exec_on(&mut phase, "ROLLBACK").await
    {
        return (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response();
    }
    if let Err(e) = DB::insert_order(&mut phase, "Bearer payer-1", 1).await {
        return (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response();
    }
    match phase.commit("created").await {
        Ok(()) => (StatusCode::CREATED, "created").into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}

/// Case (MySQL/MariaDB, where claims and phases run with autocommit off):
/// a phase the server rolled back on its own commits nothing, neither the
/// writes sent after the rollback nor its recovery point; the phase's
/// commit is refused, and the retry runs the phase once.
pub async fn lease_phase_rolled_back_by_the_server_commits_nothing<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    if !DB::CLAIMS_RUN_WITHOUT_AUTOCOMMIT {
        // Elsewhere a statement after a server's rollback is refused until
        // the transaction ends (PostgreSQL) or the write lock is held
        // throughout (SQLite): nothing to hold here.
        return;
    }
    let mode = LeaseMode::new(Duration::from_secs(5)).expect("a usable lease");
    let app = Router::new()
        .route("/payments", post(phase_rolled_back::<DB>))
        .layer(layer(&h, mode));
    let first = send(&app, payment("rolled-back-1", PAY)).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
    assert_eq!(
        h.orders().await,
        0,
        "nothing of the rolled-back phase commits"
    );
    let points = DB::count(
        &h.pool,
        "SELECT COUNT(*) FROM idempotency_records WHERE recovery_point IS NOT NULL",
    )
    .await;
    assert_eq!(points, 0, "its recovery point is not recorded");
    let retry = send(&app, payment("rolled-back-1", PAY)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert_eq!(h.orders().await, 1);
}
