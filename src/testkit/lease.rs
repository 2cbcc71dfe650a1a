//! Lease mode's part of the suite: a payment handler in three parts (a
//! local phase, an external charge, a final phase) against an in-process
//! provider whose faults the cases choose.
//!
//! The test tables stand in for the payment's rows: phase 1 inserts an
//! `orders` row (the pending payment); the final phase takes one unit of
//! stock `captured` (or `declined`). The provider's own charges are the
//! ground truth for "charged once".

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{ConformanceDb, Harness, bearer};
use crate::IdempotencyLayer;
use crate::lease::{CallError, Completer, LeaseMode, Leased, Recovered, StepError, StepKey};

pub mod cases;
pub mod hardening;
pub mod review;

/// Stock the final phase takes from; plenty for any case.
const STOCK: i64 = 1_000;

/// What the provider does with its next charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fails without charging.
    FailBefore,
    /// Charges, then answers after this long.
    ChargeThenHang(Duration),
    /// Charges, then the answer is lost.
    ChargeThenDrop,
    /// Declines without charging.
    Decline,
    /// Refuses the connection: the request provably never left.
    Refused,
}

/// An in-process payment provider that deduplicates on the idempotency key
/// and offers a look-up.
#[derive(Debug, Default)]
pub struct Provider {
    charges: Mutex<HashMap<String, i64>>,
    faults: Mutex<VecDeque<Fault>>,
    lookup_down: AtomicBool,
    lookup_delay: Mutex<Duration>,
    posts: AtomicUsize,
    lookups: AtomicUsize,
}

/// The result of a charge, as the handler saves it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum Charge {
    /// Charged: the charge's id.
    Captured(String),
    /// Declined: nothing charged.
    Declined,
}

impl Provider {
    /// Queues a fault for the next charge.
    pub fn fault(&self, fault: Fault) {
        lock(&self.faults).push_back(fault);
    }

    /// Takes the look-up down or brings it back.
    pub fn lookup_down(&self, down: bool) {
        self.lookup_down.store(down, Ordering::SeqCst);
    }

    /// Makes every look-up take `delay` before it answers.
    pub fn lookup_delay(&self, delay: Duration) {
        *lock(&self.lookup_delay) = delay;
    }

    /// How many look-ups were made.
    pub fn lookups(&self) -> usize {
        self.lookups.load(Ordering::SeqCst)
    }

    /// How many distinct charges exist.
    pub fn charges(&self) -> usize {
        lock(&self.charges).len()
    }

    /// Every charge: its id (what the handler records) and its amount.
    pub fn charged(&self) -> HashMap<String, i64> {
        lock(&self.charges)
            .iter()
            .map(|(key, amount)| (charge_id(key), *amount))
            .collect()
    }

    /// Whether the provider holds a charge under `key`.
    pub fn has_charge(&self, key: &StepKey) -> bool {
        lock(&self.charges).contains_key(key.as_str())
    }

    /// Forgets the queued faults.
    pub fn clear_faults(&self) {
        lock(&self.faults).clear();
    }

    /// How many charge calls were made.
    pub fn posts(&self) -> usize {
        self.posts.load(Ordering::SeqCst)
    }

    async fn charge(&self, key: StepKey, amount: i64) -> Result<Charge, CallError<String>> {
        let fault = lock(&self.faults).pop_front();
        if fault == Some(Fault::Refused) {
            return Err(CallError::NotSent("connection refused".into()));
        }
        self.posts.fetch_add(1, Ordering::SeqCst);
        if fault == Some(Fault::FailBefore) {
            return Err("503 from the provider".to_string().into());
        }
        if fault == Some(Fault::Decline) {
            return Ok(Charge::Declined);
        }
        lock(&self.charges).entry(key.to_string()).or_insert(amount);
        let id = charge_id(key.as_str());
        match fault {
            Some(Fault::ChargeThenHang(d)) => tokio::time::sleep(d).await,
            Some(Fault::ChargeThenDrop) => return Err("connection closed".to_string().into()),
            _ => {}
        }
        Ok(Charge::Captured(id))
    }

    async fn lookup(&self, key: StepKey) -> Result<Recovered<Charge>, String> {
        self.lookups.fetch_add(1, Ordering::SeqCst);
        let delay = *lock(&self.lookup_delay);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if self.lookup_down.load(Ordering::SeqCst) {
            return Err("503 from the look-up".into());
        }
        let known = lock(&self.charges).contains_key(key.as_str());
        Ok(if known {
            Recovered::Done(Charge::Captured(charge_id(key.as_str())))
        } else {
            Recovered::Absent
        })
    }
}

/// The provider's charge id for a key.
fn charge_id(key: &str) -> String {
    format!("ch_{}", key.get(..16).unwrap_or_default())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The payment app's state.
pub struct PayState<DB: ConformanceDb> {
    /// The provider.
    pub provider: Arc<Provider>,
    /// How many times the handler (or the resume function) ran.
    pub executions: Arc<AtomicUsize>,
    /// How long the next execution pauses before anything else, with no
    /// ledger write (a stale owner that wakes later); 0 for none. Taken by
    /// the execution that pauses.
    pub pause_next_ms: Arc<AtomicU64>,
    _db: std::marker::PhantomData<fn() -> DB>,
}

impl<DB: ConformanceDb> std::fmt::Debug for PayState<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PayState")
            .field("provider", &self.provider)
            .finish_non_exhaustive()
    }
}

impl<DB: ConformanceDb> std::fmt::Debug for PayApp<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PayApp")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl<DB: ConformanceDb> Clone for PayState<DB> {
    fn clone(&self) -> Self {
        Self {
            provider: Arc::clone(&self.provider),
            executions: Arc::clone(&self.executions),
            pause_next_ms: Arc::clone(&self.pause_next_ms),
            _db: std::marker::PhantomData,
        }
    }
}

#[derive(Deserialize)]
struct PayReq {
    amount: i64,
    /// Pause after the charge, before the final phase (a stale owner).
    #[serde(default)]
    pause_ms: u64,
    /// Use a step with no look-up.
    #[serde(default)]
    no_lookup: bool,
}

/// What phase 1 saves.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Created {
    order_id: i64,
    amount: i64,
    pause_ms: u64,
    no_lookup: bool,
}

async fn pay<DB: ConformanceDb>(
    State(st): State<PayState<DB>>,
    headers: http::HeaderMap,
    leased: Leased<DB>,
    Json(req): Json<PayReq>,
) -> Response {
    st.executions.fetch_add(1, Ordering::SeqCst);
    let pause = st.pause_next_ms.swap(0, Ordering::SeqCst);
    if pause > 0 {
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    if req.amount <= 0 {
        return (StatusCode::UNPROCESSABLE_ENTITY, "amount must be positive").into_response();
    }
    let created = match leased.saved::<Created>("created") {
        Ok(Some(created)) => created,
        Ok(None) => {
            let phase = async {
                let mut phase = leased.phase().await?;
                let principal = headers
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default();
                let order_id = DB::insert_order(&mut phase, principal, req.amount).await?;
                let created = Created {
                    order_id,
                    amount: req.amount,
                    pause_ms: req.pause_ms,
                    no_lookup: req.no_lookup,
                };
                phase.commit_with("created", &created).await?;
                Ok::<_, crate::lease::LeaseError>(created)
            };
            match phase.await {
                Ok(created) => created,
                Err(e) => return e.into_response(),
            }
        }
        Err(e) => return e.into_response(),
    };
    drive(&st, &leased, created).await
}

/// Steps 2 and 3, shared by the handler and the completer's resume.
async fn drive<DB: ConformanceDb>(
    st: &PayState<DB>,
    leased: &Leased<DB>,
    created: Created,
) -> Response {
    let provider = &st.provider;
    let amount = created.amount;
    let charged = if created.no_lookup {
        leased
            .step_without_lookup("charge", |key| provider.charge(key, amount))
            .await
    } else {
        leased
            .step(
                "charge",
                |key| provider.charge(key, amount),
                |key| provider.lookup(key),
            )
            .await
    };
    let charge = match charged {
        Ok(charge) => charge,
        Err(StepError::Lease(e)) => return e.into_response(),
        Err(_) => return (StatusCode::SERVICE_UNAVAILABLE, "provider failed").into_response(),
    };
    if created.pause_ms > 0 && leased.generation() == 1 {
        tokio::time::sleep(Duration::from_millis(created.pause_ms)).await;
    }
    let tx = match leased.final_phase().await {
        Ok(tx) => tx,
        Err(e) => return e.into_response(),
    };
    let sku = match &charge {
        Charge::Captured(_) => "captured",
        Charge::Declined => "declined",
    };
    {
        let Ok(mut conn) = tx.lock() else {
            return (StatusCode::INTERNAL_SERVER_ERROR, "tx").into_response();
        };
        if let Err(e) = DB::take_stock(&mut conn, sku, 1).await {
            return (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response();
        }
    }
    match charge {
        Charge::Captured(id) => (
            StatusCode::CREATED,
            [("location", format!("/payments/{}", created.order_id))],
            Json(json!({"orderId": created.order_id, "chargeId": id})),
        )
            .into_response(),
        Charge::Declined => (
            StatusCode::PAYMENT_REQUIRED,
            [("content-type", "application/problem+json")],
            json!({"type": "https://example.test/problems/card-declined", "status": 402})
                .to_string(),
        )
            .into_response(),
    }
}

/// A payment app in lease mode, its provider, and a completer for it.
pub struct PayApp<DB: ConformanceDb> {
    /// The app (`POST /payments`).
    pub router: Router,
    /// The app's state: the provider and the execution count.
    pub state: PayState<DB>,
    /// The lease settings.
    pub mode: LeaseMode,
}

impl<DB: ConformanceDb> PayApp<DB> {
    /// How many times the handler (or the resume function) ran.
    pub fn executions(&self) -> usize {
        self.state.executions.load(Ordering::SeqCst)
    }

    /// A second instance of the app on the same database and provider.
    pub fn instance(&self, h: &Harness<DB>, in_flight_wait: Duration) -> Router {
        router(h, self.state.clone(), self.mode, in_flight_wait)
    }

    /// A completer that resumes this app's payments.
    pub fn completer(&self, h: &Harness<DB>) -> Completer<DB> {
        let st = self.state.clone();
        Completer::new(h.pool.clone(), self.mode).resume("POST /payments", move |leased| {
            let st = st.clone();
            async move {
                st.executions.fetch_add(1, Ordering::SeqCst);
                let res = match leased.saved::<Created>("created") {
                    Ok(Some(created)) => drive(&st, &leased, created).await,
                    // Nothing saved: the documented rule, a rejection,
                    // which deletes a bare claim so the retry runs afresh.
                    Ok(None) => {
                        (StatusCode::UNPROCESSABLE_ENTITY, "nothing to resume").into_response()
                    }
                    Err(e) => e.into_response(),
                };
                buffered(res).await
            }
        })
    }
}

fn router<DB: ConformanceDb>(
    h: &Harness<DB>,
    state: PayState<DB>,
    mode: LeaseMode,
    in_flight_wait: Duration,
) -> Router {
    let layer = IdempotencyLayer::new(h.pool.clone())
        .with_principal(bearer)
        .with_lease(mode)
        .with_in_flight_wait(in_flight_wait);
    Router::new()
        .route("/payments", post(pay::<DB>))
        .layer(layer)
        .with_state(state)
}

impl<DB: ConformanceDb> Harness<DB> {
    /// The payment app in lease `mode`, duplicates waiting at most
    /// `in_flight_wait` on a live lease.
    pub async fn pay_app(&self, mode: LeaseMode, in_flight_wait: Duration) -> PayApp<DB> {
        DB::set_stock(&self.pool, "captured", STOCK).await;
        DB::set_stock(&self.pool, "declined", STOCK).await;
        let state = PayState {
            provider: Arc::new(Provider::default()),
            executions: Arc::new(AtomicUsize::new(0)),
            pause_next_ms: Arc::new(AtomicU64::new(0)),
            _db: std::marker::PhantomData,
        };
        PayApp {
            router: router(self, state.clone(), mode, in_flight_wait),
            state,
            mode,
        }
    }

    /// Payments captured (final phases committed as captured).
    pub async fn captured(&self) -> i64 {
        STOCK - DB::stock(&self.pool, "captured").await
    }

    /// Payments declined (final phases committed as declined).
    pub async fn declined(&self) -> i64 {
        STOCK - DB::stock(&self.pool, "declined").await
    }
}

/// A request to `POST /payments`.
pub fn payment(key: &str, body: &str) -> http::Request<axum::body::Body> {
    http::Request::post("/payments")
        .header("content-type", "application/json")
        .header("authorization", "Bearer payer-1")
        .header("idempotency-key", key)
        .body(axum::body::Body::from(body.to_string()))
        .expect("a valid request")
}

/// The payment body the cases send.
const PAY: &str = r#"{"amount":5000}"#;

/// Sends `req` and drops it after `after` (the client went away), then lets
/// the dropped attempt's release land.
async fn abandon(router: &Router, req: http::Request<axum::body::Body>, after: Duration) {
    let cut = tokio::time::timeout(after, super::send(router, req)).await;
    assert!(cut.is_err(), "the attempt was meant to be cut: {cut:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
}

/// The provider charges and hangs; the attempt for `key` is dropped (the
/// client went away) `after` it began, mid-charge, which ends its lease at
/// once.
async fn abandon_mid_charge(router: &Router, provider: &Provider, key: &str, after: Duration) {
    provider.fault(Fault::ChargeThenHang(Duration::from_secs(5)));
    abandon(router, payment(key, PAY), after).await;
}

/// Parks the payment `key`: its charge's answer is lost and the look-up is
/// down (it stays down).
async fn park(router: &Router, provider: &Provider, key: &str) {
    provider.fault(Fault::ChargeThenDrop);
    provider.lookup_down(true);
    let a = super::send(router, payment(key, PAY)).await;
    assert_eq!(a.problem(), "reconciling", "{a:?}");
}

/// A handler's answer with its body read, as a resume function returns it.
async fn buffered(res: Response) -> http::Response<bytes::Bytes> {
    let (parts, body) = res.into_parts();
    let body = http_body_util::BodyExt::collect(body)
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    http::Response::from_parts(parts, body)
}
