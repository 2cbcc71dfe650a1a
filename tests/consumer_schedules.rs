//! Seeded randomized fault schedules for the message consumer, on
//! PostgreSQL, SQLite (and MariaDB with the `mysql` feature).
//!
//! Each schedule is a list of steps over five message ids: a delivery, or
//! a few deliveries at once (of one id or of several), each with a planned
//! fault: none, a slow handler, a handler error after its write, a panic
//! after its write, the delivery's future dropped while its transaction is
//! open (after the write), or dropped at a random moment (in the claim,
//! the handler or the commit). Then every id is redelivered until it is
//! acknowledged. The judge is the database: after every step no id has
//! more than one committed business row (an `orders` row per effect), an id
//! whose delivery was acknowledged as processed (`Applied` or `Duplicate`)
//! has exactly one, at most one delivery per id is `Applied`, and at the
//! end every id has exactly one effect and one `SUCCEEDED` ledger row.
//!
//! The schedule is a function of its seed alone (a tiny PRNG below, no
//! dependency); a failure prints the seed and the schedule, and
//! `SCHEDULE_SEED=<seed>` replays that one schedule (the interleaving of
//! concurrent deliveries is the runtime's, so a race may need a few runs).
//! `SCHEDULES=<n>` runs `n` schedules per store (default 150), from seed
//! `SCHEDULE_BASE` (default 1).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::Pool;
use tower_idempotency::consumer::{ConsumeError, Consumer, Processed};
use tower_idempotency::testkit::{ConformanceDb, Harness};

/// Message ids per schedule.
const IDS: usize = 5;
/// Schedules per store in a plain `cargo test`.
const DEFAULT_SCHEDULES: u64 = 150;

/// SplitMix64: a tiny, good-enough seeded generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What a delivery's handler (or its caller) does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Writes and returns `Ok`.
    None,
    /// Writes, sleeps this many ms, returns `Ok`.
    Slow(u64),
    /// Writes, then returns `Err`.
    Fail,
    /// Writes, then panics.
    Panic,
    /// Writes, then the delivery's future is dropped (the transaction open).
    DropInTransaction,
    /// The delivery's future is dropped after this many µs, wherever it is.
    DropAfter(u64),
}

/// One step: deliveries that run at once (one, or a few).
#[derive(Debug, Clone)]
struct Step(Vec<(usize, Fault)>);

fn fault(rng: &mut Rng) -> Fault {
    match rng.below(100) {
        0..20 => Fault::None,
        20..35 => Fault::Slow(1 + rng.below(15)),
        35..52 => Fault::Fail,
        52..65 => Fault::Panic,
        65..85 => Fault::DropInTransaction,
        _ => Fault::DropAfter(rng.below(8000)),
    }
}

/// The schedule of `seed`.
fn schedule(seed: u64) -> Vec<Step> {
    let mut rng = Rng(seed);
    let steps = 6 + rng.below(10);
    (0..steps)
        .map(|_| {
            let n = match rng.below(10) {
                0..6 => 1,
                6..9 => 2 + rng.below(2),
                _ => 4,
            };
            // Concurrent deliveries mostly of one id, sometimes of several.
            let same = rng.below(3) > 0;
            let first = rng.below(IDS as u64) as usize;
            Step(
                (0..n)
                    .map(|_| {
                        let id = if same {
                            first
                        } else {
                            rng.below(IDS as u64) as usize
                        };
                        (id, fault(&mut rng))
                    })
                    .collect(),
            )
        })
        .collect()
}

/// What became of one delivery.
#[derive(Debug)]
enum Outcome {
    /// Acknowledged as processed: the handler ran and committed.
    Applied,
    /// Acknowledged as processed: an earlier delivery committed.
    Duplicate,
    /// Not acknowledged (redelivered): the error.
    Redeliver(String),
    /// The handler panicked (not acknowledged).
    Panicked,
    /// The delivery's future was dropped (not acknowledged).
    Dropped,
    /// An answer no schedule may produce here.
    Unexpected(String),
}

struct World<DB: ConformanceDb> {
    pool: Pool<DB>,
    consumer: Consumer<DB>,
    subscriber: String,
    payloads: Vec<String>,
    runs: Arc<AtomicUsize>,
}

impl<DB: ConformanceDb> World<DB> {
    fn id(i: usize) -> String {
        format!("m{i}")
    }

    /// The `orders.principal` of an effect of message `i`.
    fn principal(&self, i: usize) -> String {
        format!("{}/m{i}", self.subscriber)
    }

    /// One delivery with its fault, as a task of its own.
    async fn deliver(&self, i: usize, fault: Fault) -> Outcome {
        let (consumer, id, payload) =
            (self.consumer.clone(), Self::id(i), self.payloads[i].clone());
        let principal = self.principal(i);
        let runs = Arc::clone(&self.runs);
        let (wrote_tx, wrote_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let processing = consumer.process(&id, payload.as_bytes(), |tx| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let mut conn = tx.lock().map_err(|e| e.to_string())?;
                DB::insert_order(&mut conn, &principal, 1)
                    .await
                    .map_err(|e| e.to_string())?;
                drop(conn);
                match fault {
                    Fault::Slow(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                    Fault::Fail => return Err("a planned handler failure".to_string()),
                    Fault::Panic => panic!("a planned panic"),
                    Fault::DropInTransaction => {
                        let _ = wrote_tx.send(());
                        std::future::pending::<()>().await;
                    }
                    Fault::None | Fault::DropAfter(_) => {}
                }
                Ok(())
            });
            match fault {
                Fault::DropAfter(us) => tokio::time::timeout(Duration::from_micros(us), processing)
                    .await
                    .ok(),
                _ => Some(processing.await),
            }
        });
        let abort = task.abort_handle();
        let joined = if fault == Fault::DropInTransaction {
            // Dropped once the handler wrote; a duplicate never writes.
            tokio::pin!(task);
            tokio::select! {
                joined = &mut task => joined,
                Ok(()) = wrote_rx => {
                    abort.abort();
                    let _ = task.await;
                    return Outcome::Dropped;
                }
            }
        } else {
            task.await
        };
        match joined {
            Err(e) if e.is_panic() => Outcome::Panicked,
            Err(e) => Outcome::Unexpected(format!("the task failed: {e}")),
            Ok(None) => Outcome::Dropped,
            Ok(Some(Ok(Processed::Applied(())))) => Outcome::Applied,
            Ok(Some(Ok(Processed::Duplicate))) => Outcome::Duplicate,
            Ok(Some(Err(
                e @ (ConsumeError::Handler(_) | ConsumeError::InFlight | ConsumeError::Store(_)),
            ))) => Outcome::Redeliver(e.to_string()),
            Ok(Some(Err(e))) => Outcome::Unexpected(e.to_string()),
        }
    }

    /// Committed effects per id.
    async fn effects(&self) -> [i64; IDS] {
        let terms: Vec<String> = (0..IDS)
            .map(|i| {
                format!(
                    "{} * (SELECT COUNT(*) FROM orders WHERE principal = '{}')",
                    1000_i64.pow(i as u32),
                    self.principal(i)
                )
            })
            .collect();
        let sql = format!("SELECT {}", terms.join(" + "));
        // The testkit's hook takes `&'static str`; a schedule's SQL is small.
        let packed = DB::count(&self.pool, Box::leak(sql.into_boxed_str())).await;
        std::array::from_fn(|i| packed / 1000_i64.pow(i as u32) % 1000)
    }

    async fn succeeded_rows(&self) -> i64 {
        let sql = format!(
            "SELECT COUNT(*) FROM idempotency_records WHERE principal_id = '{}' \
             AND operation = 'message' AND status = 'SUCCEEDED'",
            self.subscriber
        );
        DB::count(&self.pool, Box::leak(sql.into_boxed_str())).await
    }
}

/// How often each outcome was seen, over all schedules of a run.
#[derive(Debug, Default)]
struct Tally {
    applied: usize,
    duplicate: usize,
    handler_failed: usize,
    in_flight: usize,
    store_error: usize,
    panicked: usize,
    dropped: usize,
}

impl Tally {
    fn count(&mut self, outcome: &Outcome) {
        match outcome {
            Outcome::Applied => self.applied += 1,
            Outcome::Duplicate => self.duplicate += 1,
            Outcome::Redeliver(e) if e.starts_with("the handler failed") => {
                self.handler_failed += 1;
            }
            Outcome::Redeliver(e) if e.contains("in progress") => self.in_flight += 1,
            Outcome::Redeliver(_) => self.store_error += 1,
            Outcome::Panicked => self.panicked += 1,
            Outcome::Dropped => self.dropped += 1,
            Outcome::Unexpected(_) => {}
        }
    }
}

/// Runs the schedule of `seed`; what broke, with the trace, otherwise.
async fn run_schedule<DB: ConformanceDb>(
    pool: &Pool<DB>,
    seed: u64,
    tally: &mut Tally,
) -> Result<(), String> {
    let subscriber = format!("s{seed}");
    let world = World::<DB> {
        pool: pool.clone(),
        consumer: Consumer::new(pool.clone(), subscriber.as_str())
            .with_lock_wait(Duration::from_secs(5)),
        payloads: (0..IDS)
            .map(|i| format!(r#"{{"message":{i},"seed":{seed}}}"#))
            .collect(),
        subscriber,
        runs: Arc::new(AtomicUsize::new(0)),
    };
    let mut trace = Vec::new();
    let mut acked = BTreeSet::new();
    let mut applied = [0usize; IDS];
    for (n, step) in schedule(seed).into_iter().enumerate() {
        let outcomes = futures_join(step.0.iter().map(|&(i, f)| world.deliver(i, f))).await;
        for (&(i, f), outcome) in step.0.iter().zip(&outcomes) {
            trace.push(format!("step {n}: m{i} {f:?} -> {outcome:?}"));
            tally.count(outcome);
            match outcome {
                Outcome::Applied => {
                    applied[i] += 1;
                    acked.insert(i);
                }
                Outcome::Duplicate => {
                    acked.insert(i);
                }
                Outcome::Unexpected(e) => {
                    return Err(format!(
                        "m{i}: an unexpected answer: {e}\n{}",
                        trace.join("\n")
                    ));
                }
                _ => {}
            }
        }
        check(&world, &acked, &applied, &trace).await?;
    }
    // Redeliveries until every id is acknowledged.
    for (i, applied) in applied.iter_mut().enumerate() {
        let mut tries = 0;
        loop {
            let outcome = world.deliver(i, Fault::None).await;
            trace.push(format!("redelivery: m{i} -> {outcome:?}"));
            tally.count(&outcome);
            match outcome {
                Outcome::Applied => {
                    *applied += 1;
                    break;
                }
                Outcome::Duplicate => break,
                Outcome::Redeliver(_) if tries < 20 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => {
                    return Err(format!(
                        "m{i} was not acknowledged on redelivery: {other:?}\n{}",
                        trace.join("\n")
                    ));
                }
            }
        }
        acked.insert(i);
    }
    check(&world, &acked, &applied, &trace).await?;
    let effects = world.effects().await;
    let ledger = world.succeeded_rows().await;
    if effects != [1; IDS] || ledger != IDS as i64 {
        return Err(format!(
            "at the end: effects {effects:?}, {ledger} SUCCEEDED rows, want one each\n{}",
            trace.join("\n")
        ));
    }
    Ok(())
}

/// The invariants after a step.
async fn check<DB: ConformanceDb>(
    world: &World<DB>,
    acked: &BTreeSet<usize>,
    applied: &[usize; IDS],
    trace: &[String],
) -> Result<(), String> {
    let effects = world.effects().await;
    for i in 0..IDS {
        let broken = if effects[i] > 1 {
            Some(format!("m{i} has {} committed effects", effects[i]))
        } else if acked.contains(&i) && effects[i] != 1 {
            Some(format!(
                "m{i} was acknowledged as processed with {} effects",
                effects[i]
            ))
        } else if applied[i] > 1 {
            Some(format!("m{i} was applied {} times", applied[i]))
        } else {
            None
        };
        if let Some(broken) = broken {
            return Err(format!("{broken}\n{}", trace.join("\n")));
        }
    }
    Ok(())
}

/// Awaits futures concurrently (each delivery is a task of its own, so
/// they run in parallel), in order.
async fn futures_join<F: Future<Output = Outcome>>(
    futures: impl Iterator<Item = F>,
) -> Vec<Outcome> {
    let mut pinned: Vec<_> = futures.map(Box::pin).collect();
    let mut out: Vec<Option<Outcome>> = pinned.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, slot) in pinned.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *slot = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(|o| o.expect("ready")).collect()
}

/// Planned panics print nothing; any other panic prints as usual.
fn quiet_planned_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let planned = info
                .payload()
                .downcast_ref::<&str>()
                .is_some_and(|m| m.contains("a planned panic"));
            if !planned {
                default(info);
            }
        }));
    });
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

async fn schedules<DB: ConformanceDb>() {
    quiet_planned_panics();
    let h = Harness::<DB>::new().await;
    let seeds: Vec<u64> = match env_u64("SCHEDULE_SEED") {
        Some(seed) => vec![seed],
        None => {
            let base = env_u64("SCHEDULE_BASE").unwrap_or(1);
            let n = env_u64("SCHEDULES").unwrap_or(DEFAULT_SCHEDULES);
            (base..base.saturating_add(n)).collect()
        }
    };
    let started = std::time::Instant::now();
    let mut tally = Tally::default();
    for &seed in &seeds {
        if let Err(broken) = run_schedule(&h.pool, seed, &mut tally).await {
            panic!(
                "{}: schedule {seed} broke an invariant (replay: SCHEDULE_SEED={seed}):\n\
                 schedule: {:?}\n{broken}",
                DB::LABEL,
                schedule(seed)
            );
        }
    }
    println!(
        "{}: {} schedules (seeds {}..={}) in {:?}: {tally:?}",
        DB::LABEL,
        seeds.len(),
        seeds.first().copied().unwrap_or_default(),
        seeds.last().copied().unwrap_or_default(),
        started.elapsed()
    );
}

#[test]
fn the_same_seed_is_the_same_schedule() {
    let a = format!("{:?}", schedule(42));
    assert_eq!(a, format!("{:?}", schedule(42)));
    assert_ne!(a, format!("{:?}", schedule(43)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_schedules_keep_one_effect_per_id() {
    schedules::<sqlx::Postgres>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_schedules_keep_one_effect_per_id() {
    schedules::<sqlx::Sqlite>().await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_schedules_keep_one_effect_per_id() {
    schedules::<sqlx::MySql>().await;
}
