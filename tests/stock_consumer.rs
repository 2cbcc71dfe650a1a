//! End-to-end: examples/stock_consumer as real processes on a JetStream
//! server (127.0.0.1:4222, or `NATS_PORT`; started here when nothing answers), on
//! PostgreSQL and SQLite (and MariaDB with the `mysql` feature), judged by
//! the rows in its database and the JetStream consumer's counts.
//!
//! Each case has its own database, stream and subject (a unique suffix),
//! so the cases run in parallel; the stream is deleted when a case ends.
//! `STOCK_CONSUMER_LOGS=1` prints every consumer process's lines.

mod common;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use bytes::Bytes;
use sqlx::Pool;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tower_idempotency::testkit::{Cleanup, ConformanceDb as TestDb};

/// The JetStream server's port on 127.0.0.1: `NATS_PORT`, else 4222.
fn nats_port() -> u16 {
    std::env::var("NATS_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(4222)
}

fn nats_url() -> String {
    format!("nats://127.0.0.1:{}", nats_port())
}
/// JetStream redelivers an unacked message after this.
const ACK_WAIT_MS: u64 = 1000;
/// The longest wait for the consumers to settle.
const SETTLE: Duration = Duration::from_secs(30);
const INITIAL_STOCK: i64 = 1000;

/// Whether a NATS server answers on its port (its `INFO` greeting).
fn nats_answers() -> bool {
    use std::io::Read;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], nats_port()));
    let Ok(mut conn) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500))
    else {
        return false;
    };
    let _ = conn.set_read_timeout(Some(Duration::from_millis(1000)));
    let mut greeting = [0u8; 4];
    conn.read_exact(&mut greeting).is_ok() && &greeting == b"INFO"
}

/// Starts `nats-server -js` on 127.0.0.1:`NATS_PORT` (store in a temp dir) unless
/// a server answers there; it is left running for later cases and runs.
fn ensure_nats() {
    static NATS_SERVER: std::sync::OnceLock<Mutex<std::process::Child>> =
        std::sync::OnceLock::new();
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        if nats_answers() {
            return;
        }
        let bin = ["/usr/sbin/nats-server", "/usr/bin/nats-server"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("nothing answers on the NATS port and nats-server is missing: apt-get install nats-server");
        let store = std::env::temp_dir().join(format!("ti_nats_{}", std::process::id()));
        let child = std::process::Command::new(bin)
            .args(["-a", "127.0.0.1", "-p", &nats_port().to_string(), "-js", "-sd"])
            .arg(&store)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server starts");
        // Kept (never waited on): it serves the later cases and runs.
        let _ = NATS_SERVER.set(Mutex::new(child));
        for _ in 0..100 {
            if nats_answers() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("nats-server did not answer on port {} within 10 s", nats_port());
    });
}

fn unique_suffix() -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "{}_{}_{nanos}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// A consumer process and every line it printed (stderr lines start `! `).
struct Proc {
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    fn lines(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    fn count(&self, prefix: &str) -> usize {
        self.lines()
            .iter()
            .filter(|l| l.starts_with(prefix))
            .count()
    }

    /// The first line that starts with `prefix`, waiting at most `wait`.
    async fn wait_line(&mut self, prefix: &str, wait: Duration) -> String {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(line) = self.lines().into_iter().find(|l| l.starts_with(prefix)) {
                return line;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "the consumer exited ({status}) before printing {prefix:?}:\n{}",
                    self.lines().join("\n")
                );
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {prefix:?} line within {wait:?}:\n{}",
                self.lines().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn sigkill(&mut self) {
        self.child.start_kill().unwrap();
        self.child.wait().await.unwrap();
    }
}

fn collect(
    reader: impl AsyncRead + Unpin + Send + 'static,
    log: Arc<Mutex<Vec<String>>>,
    tag: &'static str,
) {
    tokio::spawn(async move {
        let mut lines = BufReader::new(reader).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            log.lock().unwrap().push(format!("{tag}{line}"));
        }
    });
}

/// One case's world: a fresh database, a stream and subject of its own,
/// and the consumer processes.
struct World<DB: TestDb> {
    procs: Vec<Proc>,
    url: String,
    pool: Option<Pool<DB>>,
    js: jetstream::Context,
    stream: String,
    subject: String,
    durable: String,
    published: usize,
    _stream_drop: Cleanup,
    _db_drop: Cleanup,
}

impl<DB: TestDb> World<DB> {
    async fn new() -> Self {
        ensure_nats();
        let (url, db_drop) = DB::fresh_url().await;
        let suffix = unique_suffix();
        let stream = format!("TI_ORDERS_{suffix}");
        let client = async_nats::connect(nats_url()).await.unwrap();
        let js = jetstream::new(client);
        let stream_drop = {
            let stream = stream.clone();
            Cleanup::new(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let _ = tokio::time::timeout(Duration::from_secs(5), async {
                        if let Ok(client) = async_nats::connect(nats_url()).await {
                            let _ = jetstream::new(client).delete_stream(&stream).await;
                        }
                    })
                    .await;
                });
            })
        };
        Self {
            procs: Vec::new(),
            url,
            pool: None,
            js,
            subject: format!("ti.{suffix}.orders.created"),
            stream,
            durable: "stock".into(),
            published: 0,
            _stream_drop: stream_drop,
            _db_drop: db_drop,
        }
    }

    fn pool(&self) -> &Pool<DB> {
        self.pool
            .as_ref()
            .expect("a consumer started (it creates the tables)")
    }

    /// Starts a consumer process and waits for its start-up line; the
    /// first one also creates the tables, then the stock is seeded.
    async fn spawn(&mut self, delay_ms: u64) -> usize {
        self.spawn_with(delay_ms, &[]).await
    }

    /// [`spawn`](Self::spawn) with more flags.
    async fn spawn_with(&mut self, delay_ms: u64, flags: &[&str]) -> usize {
        let mut child = Command::new(common::example("stock_consumer"))
            .args([
                "--nats",
                &nats_url(),
                "--stream",
                &self.stream,
                "--subject",
                &self.subject,
                "--durable",
                &self.durable,
                "--ack-wait-ms",
                &ACK_WAIT_MS.to_string(),
                "--handler-delay-ms",
                &delay_ms.to_string(),
            ])
            .args(flags)
            .env("DATABASE_URL", &self.url)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        collect(child.stdout.take().unwrap(), log.clone(), "");
        collect(child.stderr.take().unwrap(), log.clone(), "! ");
        let mut proc = Proc { child, log };
        let line = proc
            .wait_line("stock_consumer consuming", Duration::from_secs(30))
            .await;
        assert!(
            line.contains(&format!("consuming {} as {}", self.subject, self.durable)),
            "{line}"
        );
        if self.pool.is_none() {
            let pool = sqlx::pool::PoolOptions::<DB>::new()
                .max_connections(2)
                .connect(&self.url)
                .await
                .unwrap();
            for sku in ["sku-a", "sku-b"] {
                DB::set_stock(&pool, sku, INITIAL_STOCK).await;
            }
            self.pool = Some(pool);
        }
        self.procs.push(proc);
        self.procs.len() - 1
    }

    async fn publish_raw(&mut self, message_id: Option<&str>, body: &str) {
        let payload = Bytes::from(body.to_owned());
        let ack = match message_id {
            Some(id) => {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Message-Id", id);
                self.js
                    .publish_with_headers(self.subject.clone(), headers, payload)
                    .await
            }
            None => self.js.publish(self.subject.clone(), payload).await,
        };
        ack.unwrap().await.unwrap();
        self.published += 1;
    }

    async fn publish(&mut self, e: &Event) {
        self.publish_raw(Some(&e.id), &e.body()).await;
    }

    async fn consumer_info(&self) -> jetstream::consumer::Info {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        stream.consumer_info(&self.durable).await.unwrap()
    }

    async fn count(&self, sql: String) -> i64 {
        // The testkit's hook takes `&'static str`; test SQL is small.
        DB::count(self.pool(), Box::leak(sql.into_boxed_str())).await
    }

    /// Waits (bounded) until every published message was handled and
    /// acked, then judges: one move and one decrement per distinct
    /// Message-Id, and exactly the expected poison rows.
    async fn settle_and_judge(&self, case: &str, applied: &[Event], poison: &Poison) {
        let ids = applied
            .iter()
            .map(|e| format!("'{}'", e.id))
            .collect::<Vec<_>>()
            .join(", ");
        let moves_sql = format!("SELECT COUNT(*) FROM stock_moves WHERE message_id IN ({ids})");
        let deadline = tokio::time::Instant::now() + SETTLE;
        loop {
            let moves = self.count("SELECT COUNT(*) FROM stock_moves".into()).await;
            let poisoned = self
                .count("SELECT COUNT(*) FROM poison_messages".into())
                .await;
            let info = self.consumer_info().await;
            let done = moves == applied.len() as i64
                && poisoned == poison.total() as i64
                && info.num_pending == 0
                && info.num_ack_pending == 0;
            if done {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "{} {case}: not settled within {SETTLE:?}: {moves} moves of {}, {poisoned} poison rows of {}, \
                     pending {}, ack pending {}\n{}",
                    DB::LABEL,
                    applied.len(),
                    poison.total(),
                    info.num_pending,
                    info.num_ack_pending,
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Past another ack_wait nothing comes back (nothing left unacked).
        tokio::time::sleep(Duration::from_millis(ACK_WAIT_MS + 500)).await;
        let info = self.consumer_info().await;
        assert_eq!(
            (info.num_pending, info.num_ack_pending),
            (0, 0),
            "{}",
            self.logs()
        );
        let distinct = applied.len() as i64;
        assert_eq!(
            self.count("SELECT COUNT(*) FROM stock_moves".into()).await,
            distinct,
            "one move per Message-Id\n{}",
            self.logs()
        );
        assert_eq!(self.count(moves_sql).await, distinct, "the expected ids");
        for sku in ["sku-a", "sku-b"] {
            let taken: i64 = applied.iter().filter(|e| e.sku == sku).map(|e| e.qty).sum();
            assert_eq!(
                DB::stock(self.pool(), sku).await,
                INITIAL_STOCK - taken,
                "{sku}: one decrement per Message-Id\n{}",
                self.logs()
            );
        }
        assert_eq!(
            self.count("SELECT COUNT(*) FROM poison_messages WHERE message_id IS NULL".into())
                .await,
            poison.without_id as i64,
            "poison rows without a Message-Id"
        );
        for (id, reason) in &poison.with_id {
            assert_eq!(
                self.count(format!(
                    "SELECT COUNT(*) FROM poison_messages WHERE message_id = '{id}' AND reason LIKE '%{reason}%'"
                ))
                .await,
                1,
                "one poison row for {id} ({reason})\n{}",
                self.logs()
            );
        }
        // The ledger: one processed-message row per id that went through
        // a claim (applied, or poison with a Message-Id but no mismatch).
        let claimed = distinct
            + poison
                .with_id
                .iter()
                .filter(|(_, reason)| !UNCLAIMED.contains(reason))
                .count() as i64;
        assert_eq!(
            self.count(
                "SELECT COUNT(*) FROM idempotency_records WHERE operation = 'message' AND principal_id = 'stock'"
                    .into()
            )
            .await,
            claimed,
            "the ledger"
        );
        let lines: Vec<String> = self.procs.iter().flat_map(Proc::lines).collect();
        let count = |prefix: &str| lines.iter().filter(|l| l.starts_with(prefix)).count();
        let redelivered = lines
            .iter()
            .filter(|l| l.starts_with("received ") && !l.ends_with(" delivery=1"))
            .count();
        if std::env::var_os("STOCK_CONSUMER_LOGS").is_some() {
            println!("{}", self.logs());
        }
        let per_process: Vec<usize> = self.procs.iter().map(|p| p.count("applied ")).collect();
        let info = self.consumer_info().await;
        println!(
            "{} {case}: published {} ({} distinct applied, {} poison rows), deliveries seen {} \
             (redeliveries {redelivered}; JetStream: {} deliveries of {} stream messages), \
             applied {} (per process {per_process:?}), duplicates {}, poison {}, retries {}",
            DB::LABEL,
            self.published,
            applied.len(),
            poison.total(),
            count("received "),
            info.delivered.consumer_sequence,
            info.delivered.stream_sequence,
            count("applied "),
            count("duplicate "),
            count("poison "),
            count("retry "),
        );
    }

    /// SIGKILLs consumer `i` inside a transaction, its `from`th or a later
    /// one, and proves it landed there: the process is frozen (SIGSTOP)
    /// while it says it is in a transaction, then the id of that
    /// transaction must be held by an open transaction (a claim of it from
    /// here waits and gives up, `InFlight`) and have no committed ledger
    /// row. Only then is it killed. A stop that landed after the
    /// transaction ended (the id committed or was rolled back) lets the
    /// process go on and tries its next transaction. Returns the id.
    async fn kill_inside_a_transaction(&mut self, i: usize, from: usize) -> String {
        let probe = tower_idempotency::consumer::Consumer::new(self.pool().clone(), &self.durable)
            .with_lock_wait(Duration::from_secs(2));
        let pid = self.procs[i].child.id().expect("running").to_string();
        let signal = |sig: &str| {
            let sent = std::process::Command::new("kill")
                .args([sig, &pid])
                .status()
                .unwrap();
            assert!(sent.success(), "kill {sig} {pid}");
        };
        let mut wanted = from;
        for _attempt in 0..20 {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while self.procs[i].count("in-transaction ") < wanted {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no transaction {wanted} within 20 s\n{}",
                    self.logs()
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            signal("-STOP");
            let lines = self.procs[i].lines();
            let in_tx = lines
                .iter()
                .filter(|l| l.starts_with("in-transaction "))
                .count();
            let id = lines
                .iter()
                .rev()
                .find_map(|l| l.strip_prefix("in-transaction "))
                .expect("an in-transaction line")
                .to_string();
            let probed = probe
                .process(&id, b"probe", |_tx| async {
                    Err::<(), _>("the probe never applies")
                })
                .await;
            let committed = self
                .count(format!(
                    "SELECT COUNT(*) FROM idempotency_records WHERE idem_key = '{id}'"
                ))
                .await;
            if matches!(
                probed,
                Err(tower_idempotency::consumer::ConsumeError::InFlight)
            ) && committed == 0
            {
                self.procs[i].sigkill().await;
                return id;
            }
            // Stopped outside that transaction: let it go on.
            signal("-CONT");
            wanted = in_tx + 1;
        }
        panic!(
            "consumer {i} was never stopped inside a transaction in 20 tries\n{}",
            self.logs()
        );
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for (i, p) in self.procs.iter().enumerate() {
            out.push_str(&format!("--- consumer process {i}:\n"));
            for line in p.lines() {
                out.push_str(&line);
                out.push('\n');
            }
        }
        out
    }
}

/// One `orders.created` event.
#[derive(Debug, Clone)]
struct Event {
    id: String,
    order: String,
    sku: &'static str,
    qty: i64,
}

impl Event {
    fn new(case: &str, i: usize) -> Self {
        Self {
            id: format!("evt-{case}-{i}"),
            order: format!("o-{case}-{i}"),
            sku: if i.is_multiple_of(2) {
                "sku-a"
            } else {
                "sku-b"
            },
            qty: (i % 3 + 1) as i64,
        }
    }

    fn body(&self) -> String {
        format!(
            r#"{{"orderId":"{}","sku":"{}","qty":{}}}"#,
            self.order, self.sku, self.qty
        )
    }
}

/// Poison reasons recorded without a claim of the Message-Id.
const UNCLAIMED: [&str; 2] = ["mismatch", "invalid Message-Id"];

/// The poison rows a case expects.
#[derive(Default)]
struct Poison {
    without_id: usize,
    /// (message id, a word of the reason)
    with_id: Vec<(String, &'static str)>,
}

impl Poison {
    fn total(&self) -> usize {
        self.without_id + self.with_id.len()
    }
}

/// Publishes the kinds of poison (no Message-Id, a body that does not
/// parse, a qty that is not positive, a sku without stock), the bad body
/// twice by the relay.
async fn publish_poison<DB: TestDb>(w: &mut World<DB>, case: &str) -> Poison {
    w.publish_raw(None, r#"{"orderId":"o-x","sku":"sku-a","qty":1}"#)
        .await;
    let bad = format!("bad-{case}");
    w.publish_raw(Some(&bad), "{not json").await;
    w.publish_raw(Some(&bad), "{not json").await;
    let zero = format!("zero-{case}");
    w.publish_raw(Some(&zero), r#"{"orderId":"o-z","sku":"sku-a","qty":0}"#)
        .await;
    let unknown = format!("unknown-sku-{case}");
    w.publish_raw(
        Some(&unknown),
        r#"{"orderId":"o-u","sku":"sku-none","qty":1}"#,
    )
    .await;
    Poison {
        without_id: 1,
        with_id: vec![
            (bad, "invalid body"),
            (zero, "positive"),
            (unknown, "no stock row"),
        ],
    }
}

macro_rules! e2e {
    ($($name:ident),* $(,)?) => {
        mod postgres { $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name::<sqlx::Postgres>().await }
        )* }
        mod sqlite { $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name::<sqlx::Sqlite>().await }
        )* }
        #[cfg(feature = "mysql")]
        mod mysql { $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name::<sqlx::MySql>().await }
        )* }
    };
}

e2e!(
    sigkill_mid_transaction_then_redelivery_applies_each_id_once,
    two_processes_on_one_durable_apply_each_id_once,
    payload_mismatch_is_poison_and_the_first_payload_stands,
    sigterm_finishes_the_message_in_hand,
    a_message_id_the_store_cannot_hold_is_poison_and_acked,
    a_claim_still_in_flight_is_redelivered_never_poison,
);

/// (a), (b), (c): N events and relay duplicates; the consumer is SIGKILLed
/// inside its first transaction, restarted, and the unacked deliveries come
/// back after ack_wait. Poison is recorded once and acked.
async fn sigkill_mid_transaction_then_redelivery_applies_each_id_once<DB: TestDb>() {
    let case = "kill";
    let mut w = World::<DB>::new().await;
    let first = w.spawn(3000).await;
    let events: Vec<Event> = (0..6).map(|i| Event::new(case, i)).collect();
    for e in &events {
        w.publish(e).await;
    }
    // The relay publishes one again right away.
    w.publish(&events[1]).await;
    let poison = publish_poison(&mut w, case).await;
    let line = w.procs[first]
        .wait_line("in-transaction ", Duration::from_secs(20))
        .await;
    assert_eq!(line, format!("in-transaction {}", events[0].id));
    w.procs[first].sigkill().await;
    // Killed inside the transaction: nothing of it is kept.
    assert_eq!(w.count("SELECT COUNT(*) FROM stock_moves".into()).await, 0);
    assert_eq!(
        w.count("SELECT COUNT(*) FROM idempotency_records".into())
            .await,
        0
    );
    assert_eq!(DB::stock(w.pool(), "sku-a").await, INITIAL_STOCK);
    let second = w.spawn(0).await;
    // Later, the relay publishes two more again (same id, same body).
    tokio::time::sleep(Duration::from_millis(300)).await;
    w.publish(&events[0]).await;
    w.publish(&events[4]).await;
    w.settle_and_judge(case, &events, &poison).await;
    let redelivered = w.procs[second].lines().iter().any(|l| {
        l.starts_with(&format!("received {} ", events[0].id)) && !l.ends_with(" delivery=1")
    });
    assert!(redelivered, "the killed delivery came back\n{}", w.logs());
    assert!(w.procs[second].count("duplicate ") >= 3, "{}", w.logs());
}

/// (d): two processes on one durable at once, relay duplicates published
/// meanwhile, and one of them SIGKILLed inside a transaction.
async fn two_processes_on_one_durable_apply_each_id_once<DB: TestDb>() {
    let case = "pair";
    let mut w = World::<DB>::new().await;
    w.spawn(150).await;
    w.spawn(150).await;
    let events: Vec<Event> = (0..16).map(|i| Event::new(case, i)).collect();
    for e in &events {
        w.publish(e).await;
    }
    // The relay publishes every third again, newest first: copies of one
    // id land in both processes' batches, out of order.
    for e in events.iter().step_by(3).rev() {
        w.publish(e).await;
    }
    let poison = publish_poison(&mut w, case).await;
    // Kill one inside a transaction (whichever began one first: JetStream
    // may hand the early messages to either); its fetched batch comes back
    // to the other after ack_wait.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let victim = loop {
        if let Some(i) = (0..w.procs.len()).find(|&i| w.procs[i].count("in-transaction ") > 0) {
            break i;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no transaction began within 20 s\n{}",
            w.logs()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Its third transaction (or a later one): kill it inside one, with
    // work of both done, and prove the kill landed there.
    let killed = w.kill_inside_a_transaction(victim, 3).await;
    println!(
        "{} {case}: killed inside the transaction of {killed}",
        DB::LABEL
    );
    for e in events.iter().step_by(5) {
        w.publish(e).await;
    }
    w.settle_and_judge(case, &events, &poison).await;
}

/// (e): the same Message-Id with another body is recorded as a mismatch,
/// acked, and only the first payload's effect is kept.
async fn payload_mismatch_is_poison_and_the_first_payload_stands<DB: TestDb>() {
    let case = "mismatch";
    let mut w = World::<DB>::new().await;
    w.spawn(0).await;
    let first = Event::new(case, 0);
    let changed = Event {
        qty: 5,
        order: "o-other".into(),
        ..first.clone()
    };
    w.publish(&first).await;
    w.publish(&changed).await;
    // The same body in another key order is the same payload.
    w.publish_raw(
        Some(&first.id),
        &format!(
            r#"{{"qty":{},"sku":"{}","orderId":"{}"}}"#,
            first.qty, first.sku, first.order
        ),
    )
    .await;
    let poison = Poison {
        without_id: 0,
        with_id: vec![(first.id.clone(), "mismatch")],
    };
    w.settle_and_judge(case, std::slice::from_ref(&first), &poison)
        .await;
    assert_eq!(
        w.count(format!(
            "SELECT COUNT(*) FROM stock_moves WHERE message_id = '{}' AND qty = {} AND order_id = '{}'",
            first.id, first.qty, first.order
        ))
        .await,
        1
    );
}

/// SIGTERM while a message is inside its transaction: it commits and is
/// acked, the process exits 0; a new process handles the rest once.
async fn sigterm_finishes_the_message_in_hand<DB: TestDb>() {
    let case = "term";
    let mut w = World::<DB>::new().await;
    let p = w.spawn(1500).await;
    let events: Vec<Event> = (0..4).map(|i| Event::new(case, i)).collect();
    for e in &events {
        w.publish(e).await;
    }
    w.procs[p]
        .wait_line("in-transaction ", Duration::from_secs(20))
        .await;
    let pid = w.procs[p].child.id().unwrap().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(sent.success());
    let exit = tokio::time::timeout(Duration::from_secs(15), w.procs[p].child.wait())
        .await
        .expect("exits after the message in hand")
        .unwrap();
    assert!(exit.success(), "{exit:?}\n{}", w.logs());
    assert_eq!(
        w.count(format!(
            "SELECT COUNT(*) FROM stock_moves WHERE message_id = '{}'",
            events[0].id
        ))
        .await,
        1,
        "the message in hand committed\n{}",
        w.logs()
    );
    assert_eq!(w.procs[p].count("applied "), 1, "{}", w.logs());
    w.spawn(0).await;
    w.settle_and_judge(case, &events, &Poison::default()).await;
    // The message in hand was acked before the exit: not delivered again.
    let again = w.procs[1]
        .lines()
        .iter()
        .any(|l| l.starts_with(&format!("received {} ", events[0].id)));
    assert!(!again, "{}", w.logs());
}

/// Review: a message no redelivery can fix (PostgreSQL TEXT refuses NUL,
/// so `insert_move` fails the same way on every delivery) must end as
/// poison and be acked, not nak'ed every second forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_deterministic_handler_error_is_not_retried_forever() {
    let mut w = World::<sqlx::Postgres>::new().await;
    w.spawn(0).await;
    w.publish_raw(
        Some("evt-nul"),
        r#"{"orderId":"o-\u0000","sku":"sku-a","qty":1}"#,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let info = w.consumer_info().await;
    let retries = w.procs[0]
        .lines()
        .iter()
        .filter(|l| l.starts_with("retry evt-nul"))
        .count();
    assert!(
        info.num_ack_pending == 0 && retries < 3,
        "ack pending {}, {retries} retries in 8 s\n{}",
        info.num_ack_pending,
        w.logs()
    );
}

/// A transaction that fails the same way on every delivery (here a CHECK
/// constraint the decrement violates) is recorded as poison after a few
/// deliveries and acked, not retried forever; nothing of it is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_repeated_failure_becomes_poison_after_a_few_deliveries() {
    let mut w = World::<sqlx::Postgres>::new().await;
    w.spawn(0).await;
    sqlx::raw_sql("ALTER TABLE stock ADD CONSTRAINT stock_never_negative CHECK (qty >= 0)")
        .execute(w.pool())
        .await
        .unwrap();
    w.publish_raw(
        Some("evt-too-many"),
        r#"{"orderId":"o-big","sku":"sku-a","qty":100000}"#,
    )
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let poison = w
            .count(
                "SELECT COUNT(*) FROM poison_messages WHERE reason LIKE 'failed 5 deliveries%'"
                    .into(),
            )
            .await;
        if poison == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no poison row\n{}",
            w.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let info = w.consumer_info().await;
    assert_eq!(info.num_ack_pending, 0, "acked\n{}", w.logs());
    assert_eq!(info.num_pending, 0);
    assert_eq!(
        <sqlx::Postgres as TestDb>::stock(w.pool(), "sku-a").await,
        INITIAL_STOCK
    );
    assert_eq!(w.count("SELECT COUNT(*) FROM stock_moves".into()).await, 0);
}

/// #16: a Message-Id with a NUL (which PostgreSQL's `TEXT` cannot hold) is
/// refused as invalid on every store, recorded once as poison (under its
/// percent-encoded id) and acked: not nak'ed forever, not applied.
async fn a_message_id_the_store_cannot_hold_is_poison_and_acked<DB: TestDb>() {
    let case = "nul";
    let mut w = World::<DB>::new().await;
    w.spawn(0).await;
    w.publish_raw(
        Some("evt-nul\0id"),
        r#"{"orderId":"o-nul","sku":"sku-a","qty":1}"#,
    )
    .await;
    let fine = Event::new(case, 1);
    w.publish(&fine).await;
    let poison = Poison {
        without_id: 0,
        with_id: vec![("evt-nul%00id".into(), "invalid Message-Id")],
    };
    w.settle_and_judge(case, std::slice::from_ref(&fine), &poison)
        .await;
    let retries = w.procs[0].count("retry ");
    assert_eq!(retries, 0, "{}", w.logs());
}

/// #19: an earlier delivery's transaction still holds the claim (a frozen
/// or partitioned process, here a transaction of the test's own): every
/// delivery meanwhile is `InFlight`, nak'ed with a growing delay however
/// often (more than five times), never poison; once the holder rolls back
/// the redelivery applies it, exactly once.
async fn a_claim_still_in_flight_is_redelivered_never_poison<DB: TestDb>() {
    let case = "held";
    let mut w = World::<DB>::new().await;
    w.spawn_with(
        0,
        &[
            "--lock-wait-ms",
            "100",
            "--retry-delay-ms",
            "100",
            "--max-retry-delay-ms",
            "400",
        ],
    )
    .await;
    let event = Event::new(case, 0);
    let holder = DB::hold_claim(w.pool(), &w.durable, "message", &event.id).await;
    w.publish(&event).await;
    let received = format!("received {} ", event.id);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    while w.procs[0].count(&received) < 7 && w.procs[0].count("poison ") == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "fewer than 7 deliveries within 40 s\n{}",
            w.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        w.procs[0].count("poison "),
        0,
        "a message whose claim is in flight became poison\n{}",
        w.logs()
    );
    // The holder gives up: the next redelivery runs the handler.
    holder.rollback().await.unwrap();
    w.settle_and_judge(case, std::slice::from_ref(&event), &Poison::default())
        .await;
}
