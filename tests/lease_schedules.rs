//! Randomized fault schedules for lease mode, on every store.
//!
//! Each schedule is drawn from a seed: a few payment keys, and a sequence of
//! events that mix client attempts (some cut short at a random moment: a
//! crash at whatever await point the attempt had reached), stalls past the
//! lease (a stale owner that wakes later), the provider's faults (fail
//! before charging, charge then drop the answer, slow, refused, decline),
//! its look-up going down and up, two completers, an operator who settles
//! what the listing shows (truthfully, from the provider's records), and
//! the sweeper as if the retention had run out. After the events, every attempt is
//! let finish, and the invariants are checked against the provider and the
//! rows committed:
//!
//! - at most one provider charge per payment (per key: its amount names it);
//! - every recorded success names a charge the provider holds for that
//!   payment, and the business rows agree (one order per payment at most,
//!   one captured unit per success the handler recorded); a recorded
//!   decline has no charge;
//! - nothing unsettled is invisible: every parked record, and every lapsed
//!   lease with a step pending, is in the operator's listing as an operator
//!   sees it (stranded after the default hour); every other lapsed lease,
//!   and every charge not recorded as a success, is listed as stranded; no
//!   lease is still live once every attempt ended.
//!
//! Recorded answers never change, so they are checked when seen: before
//! each sweep (which drops them) and at the end.
//!
//! The same seed draws the same schedule; a failing seed is printed with
//! its schedule. `cargo test` runs a fixed budget per store
//! (`LEASE_SCHEDULES`, default 24, [`PARALLEL`] at a time: about 40 s on
//! two cores); `LEASE_SCHEDULES=500` runs more, and
//! `LEASE_SEED=n` runs one.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use tokio::task::JoinHandle;
use tower_idempotency::lease::{LeaseMode, StepKey};
use tower_idempotency::store::RecordStatus;
use tower_idempotency::testkit::lease::{Fault, PayApp, payment};
use tower_idempotency::testkit::{Answer, ConformanceDb, Harness, send};
use tower_idempotency::{Reconciler, Resolution, Sweeper};

const KEYS: usize = 2;
const EVENTS: usize = 16;
const LEASE: Duration = Duration::from_millis(300);

/// A small seeded generator (xorshift64*): the schedule is a function of
/// the seed alone.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug, Clone, Copy)]
enum Event {
    /// A client attempt for a key, dropped after `cut_ms` when set.
    Send { key: usize, cut_ms: Option<u64> },
    /// A client attempt for a key whose execution first pauses this long
    /// with no ledger write, past the lease (a stale owner that wakes
    /// later).
    Stall { key: usize, ms: u64 },
    /// The provider's next charge.
    Fault(Fault),
    /// The look-up goes down (`true`) or comes back.
    LookupDown(bool),
    /// A pass of completer 0 or 1.
    Complete(usize),
    /// An operator settles what the listing shows.
    Operator,
    /// A sweeper pass (retention is short).
    Sweep,
    /// Time passes.
    Sleep { ms: u64 },
}

struct Schedule {
    /// Per key: whether its first attempt pauses after the charge.
    pause_after_charge: [bool; KEYS],
    events: Vec<Event>,
}

fn draw(seed: u64) -> Schedule {
    let mut rng = Rng::new(seed);
    let pause_after_charge = std::array::from_fn(|_| rng.below(3) == 0);
    let events = (0..EVENTS)
        .map(|_| match rng.below(20) {
            0..=4 => Event::Send {
                key: rng.below(KEYS as u64) as usize,
                cut_ms: (rng.below(2) == 0).then(|| rng.below(700)),
            },
            5..=7 => Event::Stall {
                key: rng.below(KEYS as u64) as usize,
                ms: 300 + rng.below(1000),
            },
            8..=10 => Event::Fault(match rng.below(7) {
                0 => Fault::FailBefore,
                1 => Fault::ChargeThenDrop,
                2 | 3 => Fault::ChargeThenHang(Duration::from_millis(100 + rng.below(900))),
                4 => Fault::Refused,
                5 => Fault::Decline,
                _ => Fault::ChargeThenHang(Duration::from_millis(50)),
            }),
            11 => Event::LookupDown(rng.below(3) == 0),
            12..=14 => Event::Complete(rng.below(2) as usize),
            15 => Event::Operator,
            16 => Event::Sweep,
            _ => Event::Sleep { ms: rng.below(500) },
        })
        .collect();
    Schedule {
        pause_after_charge,
        events,
    }
}

/// The key's name and body (its amount tells its charges apart).
fn request(s: &Schedule, key: usize) -> (String, String) {
    let pause = if s.pause_after_charge[key] { 500 } else { 0 };
    (
        format!("sched-{key}"),
        format!(r#"{{"amount":{},"pause_ms":{pause}}}"#, amount(key)),
    )
}

fn amount(key: usize) -> i64 {
    1001 + key as i64
}

fn spawn_send(
    app: &PayApp<impl ConformanceDb>,
    s: &Schedule,
    key: usize,
    cut: Option<u64>,
) -> JoinHandle<Option<Answer>> {
    let router = app.router.clone();
    let (k, body) = request(s, key);
    tokio::spawn(async move {
        let attempt = send(&router, payment(&k, &body));
        match cut {
            Some(ms) => tokio::time::timeout(Duration::from_millis(ms), attempt)
                .await
                .ok(),
            None => tokio::time::timeout(Duration::from_secs(20), attempt)
                .await
                .ok(),
        }
    })
}

/// An operator who settles every listed record by the provider's records:
/// succeeded when the charge is there, rerun when it is not.
async fn operate<DB: ConformanceDb>(h: &Harness<DB>, app: &PayApp<DB>) -> Result<(), String> {
    let reconciler = Reconciler::new(h.pool.clone()).with_stranded_after(LEASE);
    let listed = reconciler
        .unresolved(20)
        .await
        .map_err(|e| format!("operator's listing: {e}"))?;
    for record in listed {
        let Some(step) = StepKey::of(&record, "charge") else {
            continue;
        };
        let verdict = if app.state.provider.has_charge(&step) {
            let body = format!(r#"{{"operator":true,"step":"{step}"}}"#);
            let answer = http::Response::builder()
                .status(201)
                .body(bytes::Bytes::from(body))
                .map_err(|e| e.to_string())?;
            Resolution::Succeeded(answer)
        } else {
            Resolution::Rerun
        };
        match reconciler.resolve(&record, verdict).await {
            Ok(())
            | Err(tower_idempotency::ResolveError::Settled { .. })
            | Err(tower_idempotency::ResolveError::Held { .. })
            | Err(tower_idempotency::ResolveError::Changed { .. })
            | Err(tower_idempotency::ResolveError::Gone) => {}
            Err(e) => return Err(format!("verdict failed: {e}")),
        }
    }
    Ok(())
}

async fn run<DB: ConformanceDb>(s: &Schedule) -> Result<(), String> {
    let h = Harness::<DB>::new().await;
    let mode = LeaseMode::new(LEASE)
        .and_then(|m| m.with_step_timeout(Duration::from_millis(400)))
        .map_err(|e| e.to_string())?;
    let app = h.pay_app(mode, Duration::from_millis(200)).await;
    let completers = [app.completer(&h), app.completer(&h)];
    let sweeper = Sweeper::new(h.pool.clone());
    let mut seen = Seen::default();
    let mut failed_passes = Vec::new();
    let mut attempts = Vec::new();
    for event in &s.events {
        match *event {
            Event::Send { key, cut_ms } => attempts.push(spawn_send(&app, s, key, cut_ms)),
            Event::Stall { key, ms } => {
                app.state.pause_next_ms.store(ms, Ordering::SeqCst);
                attempts.push(spawn_send(&app, s, key, None));
            }
            Event::Fault(f) => app.state.provider.fault(f),
            Event::LookupDown(down) => app.state.provider.lookup_down(down),
            Event::Complete(i) => pass(&completers[i], &mut failed_passes).await,
            Event::Operator => operate(&h, &app).await?,
            // As if the retention had run out: terminal rows become
            // tombstones (kept, so their keys answer 410).
            Event::Sweep => {
                check_settled(&h, &app, &mut seen).await?;
                let later = SystemTime::now() + Duration::from_secs(2 * 86_400);
                sweeper
                    .sweep_at(later)
                    .await
                    .map_err(|e| format!("sweep: {e}"))?;
            }
            Event::Sleep { ms } => tokio::time::sleep(Duration::from_millis(ms)).await,
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    // Quiesce: every attempt ends, the provider is healthy again, leases
    // lapse, the completers pass, and every key is retried once.
    for attempt in attempts {
        let _ = attempt.await;
    }
    app.state.provider.clear_faults();
    app.state.provider.lookup_down(false);
    app.state.pause_next_ms.store(0, Ordering::SeqCst);
    tokio::time::sleep(LEASE * 2).await;
    for c in &completers {
        pass(c, &mut failed_passes).await;
    }
    for key in 0..KEYS {
        let (k, body) = request(s, key);
        let _ = send(&app.router, payment(&k, &body)).await;
    }
    // Detached work (a takeover nobody waited for ends its lease) settles.
    tokio::time::sleep(LEASE * 2).await;
    check(&h, &app, &mut seen)
        .await
        .map_err(|why| format!("{why} (failed completer passes: {failed_passes:?})"))
}

/// One completer pass. A pass that fails (a lock wait ran out, say) is
/// what `Completer::spawn` retries at its next tick: noted, not fatal; the
/// invariants decide.
async fn pass<DB: ConformanceDb>(
    c: &tower_idempotency::lease::Completer<DB>,
    failed: &mut Vec<String>,
) {
    if let Err(e) = c.run_once().await {
        failed.push(e.to_string());
    }
}

/// What the schedule saw recorded: a recorded answer never changes, so it
/// is checked when seen (before a sweep drops it, and at the end).
#[derive(Default)]
struct Seen {
    /// Keys whose success the handler recorded (its final phase captured).
    handler_successes: HashSet<usize>,
    /// Keys recorded as a failure.
    failures: HashSet<usize>,
    /// Keys first seen as tombstones: settled after one check and swept
    /// before the next (an attempt in flight may commit its final phase
    /// between a sweep's check and the sweep itself), so their answer was
    /// never read.
    swept_unseen: HashSet<usize>,
}

/// The provider's charge for `key`, if any.
fn charge_of(charged: &HashMap<String, i64>, key: usize) -> Option<String> {
    charged
        .iter()
        .find(|(_, a)| **a == amount(key))
        .map(|(id, _)| id.clone())
}

/// Checks every settled answer against the provider's charges.
async fn check_settled<DB: ConformanceDb>(
    h: &Harness<DB>,
    app: &PayApp<DB>,
    seen: &mut Seen,
) -> Result<(), String> {
    let charged = app.state.provider.charged();
    for key in 0..KEYS {
        let Some(r) = h
            .record("payer-1", "POST /payments", &format!("sched-{key}"))
            .await
        else {
            continue;
        };
        let body =
            String::from_utf8_lossy(r.response_body.as_deref().unwrap_or_default()).into_owned();
        let charge = charge_of(&charged, key);
        let by_operator = body.contains("\"operator\":true");
        match r.status {
            RecordStatus::Succeeded if by_operator && charge.is_none() => {
                return Err(format!("key {key}: the operator's success has no charge"));
            }
            RecordStatus::Succeeded if by_operator => {}
            RecordStatus::Succeeded => match &charge {
                Some(id) if body.contains(id.as_str()) => {
                    seen.handler_successes.insert(key);
                }
                _ => {
                    return Err(format!(
                        "key {key}: recorded {body} but the provider holds {charge:?}"
                    ));
                }
            },
            RecordStatus::FailedFinal => {
                seen.failures.insert(key);
            }
            RecordStatus::Expired
                if !seen.handler_successes.contains(&key) && !seen.failures.contains(&key) =>
            {
                seen.swept_unseen.insert(key);
            }
            _ => {}
        }
    }
    Ok(())
}

async fn check<DB: ConformanceDb>(
    h: &Harness<DB>,
    app: &PayApp<DB>,
    seen: &mut Seen,
) -> Result<(), String> {
    check_settled(h, app, seen).await?;
    let charged = app.state.provider.charged();
    // The operator's listing as an operator sees it (stranded after the
    // default hour: only parked records and lapsed leases with a step
    // pending), and with every lapsed lease.
    let default = Reconciler::new(h.pool.clone())
        .unresolved(100)
        .await
        .map_err(|e| e.to_string())?;
    let every = Reconciler::new(h.pool.clone())
        .with_stranded_after(Duration::ZERO)
        .unresolved(100)
        .await
        .map_err(|e| e.to_string())?;
    for key in 0..KEYS {
        let k = format!("sched-{key}");
        let n = charged.values().filter(|a| **a == amount(key)).count();
        if n > 1 {
            return Err(format!("key {key} was charged {n} times: {charged:?}"));
        }
        let charge = charge_of(&charged, key);
        if charge.is_some() && seen.failures.contains(&key) {
            return Err(format!(
                "key {key}: recorded a failure, yet charged {charge:?}"
            ));
        }
        let orders = count(
            h,
            format!("SELECT COUNT(*) FROM orders WHERE amount = {}", amount(key)),
        )
        .await;
        if orders > 1 {
            return Err(format!("key {key}: {orders} orders"));
        }
        let in_default = default.iter().any(|r| r.key == k);
        let in_every = every.iter().any(|r| r.key == k);
        let Some(r) = h.record("payer-1", "POST /payments", &k).await else {
            if let Some(id) = &charge {
                return Err(format!(
                    "key {key}: charge {id} taken, and no record at all"
                ));
            }
            continue;
        };
        let lease = r.lease.clone();
        match r.status {
            RecordStatus::NeedsReconciliation if !in_default => {
                return Err(format!(
                    "key {key}: parked and not in the operator's listing"
                ));
            }
            RecordStatus::Processing => {
                let lease =
                    lease.ok_or_else(|| format!("key {key}: a PROCESSING row with no lease"))?;
                if lease.live {
                    return Err(format!(
                        "key {key}: a lease still live after every attempt ended: {lease:?}"
                    ));
                }
                if lease.pending_step.is_some() && !in_default {
                    return Err(format!(
                        "key {key}: lapsed with step {:?} pending, not in the operator's listing",
                        lease.pending_step
                    ));
                }
                if !in_every {
                    return Err(format!("key {key}: lapsed and not listed even as stranded"));
                }
            }
            RecordStatus::Succeeded | RecordStatus::Expired => {}
            _ if charge.is_some() && !in_every => {
                return Err(format!(
                    "key {key}: charged, {:?}, and not in the operator's listing",
                    r.status
                ));
            }
            _ => {}
        }
    }
    // Every capture is a recorded success, or the settled answer of a key
    // swept before a check read it (its charge, at most one, is there).
    let captured = h.captured().await;
    let unseen = seen
        .swept_unseen
        .iter()
        .filter(|key| charge_of(&charged, **key).is_some())
        .count();
    if captured > (seen.handler_successes.len() + unseen) as i64 {
        return Err(format!(
            "{captured} payments captured, {} successes recorded, {unseen} charged keys swept unseen",
            seen.handler_successes.len()
        ));
    }
    Ok(())
}

async fn count<DB: ConformanceDb>(h: &Harness<DB>, sql: String) -> i64 {
    DB::count(&h.pool, sql.leak()).await
}

fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("LEASE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return vec![seed];
    }
    let n = std::env::var("LEASE_SCHEDULES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24);
    (1..=n).collect()
}

/// How many schedules of one store run at once: each mostly waits (on
/// leases, timers and the provider's pauses), using about 2 % of a core.
const PARALLEL: usize = 4;

async fn explore<DB: ConformanceDb>() {
    let limit = std::sync::Arc::new(tokio::sync::Semaphore::new(PARALLEL));
    let mut runs = tokio::task::JoinSet::new();
    for seed in seeds() {
        let limit = std::sync::Arc::clone(&limit);
        runs.spawn(async move {
            let _permit = limit.acquire_owned().await;
            (seed, run::<DB>(&draw(seed)).await)
        });
    }
    let mut failed = Vec::new();
    while let Some(done) = runs.join_next().await {
        let (seed, result) = done.expect("a schedule's run panicked");
        if let Err(why) = result {
            let s = draw(seed);
            eprintln!(
                "{}: seed {seed} failed (rerun with LEASE_SEED={seed}): {why}\n  schedule: pause after charge {:?}, {:?}",
                DB::LABEL,
                s.pause_after_charge,
                s.events
            );
            failed.push(seed);
        }
    }
    failed.sort_unstable();
    assert!(failed.is_empty(), "{}: failing seeds {failed:?}", DB::LABEL);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_schedules_postgres() {
    explore::<sqlx::Postgres>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_schedules_sqlite() {
    explore::<sqlx::Sqlite>().await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_schedules_mysql() {
    explore::<sqlx::MySql>().await;
}

#[test]
fn a_seed_draws_the_same_schedule() {
    let (a, b) = (draw(42), draw(42));
    assert_eq!(format!("{:?}", a.events), format!("{:?}", b.events));
    assert_ne!(format!("{:?}", a.events), format!("{:?}", draw(43).events));
}
