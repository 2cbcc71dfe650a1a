//! A JetStream consumer that takes stock for `orders.created` events,
//! exactly once per event, on top of [`Consumer`].
//!
//! ```text
//! cargo run --example stock_consumer -- --nats nats://127.0.0.1:4222 \
//!     --stream ORDERS --subject orders.created --durable stock \
//!     [--ack-wait-ms 30000] [--handler-delay-ms 0] [--lock-wait-ms 10000] \
//!     [--retry-delay-ms 1000] [--max-retry-delay-ms 60000]
//! DATABASE_URL=postgres://postgres@127.0.0.1/test cargo run --example stock_consumer -- …
//! DATABASE_URL=mysql://root@127.0.0.1/test cargo run --example stock_consumer --features mysql -- …
//! ```
//!
//! `DATABASE_URL` chooses the store as for the order service: a SQLite file
//! (`./stock_consumer.db` by default, or `sqlite:…`), `postgres://…`, or
//! `mysql://…` (with `--features mysql`). At start it creates its tables
//! (`stock`, `stock_moves`, `poison_messages`, `delivery_failures`, and the ledger through
//! [`tower_idempotency::migrate`]), the stream (subjects = the subject) and a
//! durable pull consumer (explicit ack, `ack_wait` = `--ack-wait-ms`) when
//! they are missing, prints `stock_consumer consuming <subject> as <durable>
//! (store: …)`, then fetches bounded batches until SIGTERM or Ctrl-C. It
//! prints one line per delivery: `received <id> seq=<stream seq>
//! delivery=<n>`, `in-transaction <id>` (the handler has written, the
//! transaction is open), then `applied <id>`, `duplicate <id>`,
//! `poison <id> <reason>` or `retry <id> <error>` (`-` for no id).
//!
//! # The message
//!
//! Header `Message-Id`: the producer's event id (an outbox row's id), the
//! dedupe key. JetStream's `Nats-Msg-Id` is a different thing (a
//! publish-side window of a few minutes) and is neither set nor read here.
//! Body: `{"orderId":"…","sku":"…","qty":N}` (other fields are ignored).
//!
//! The effect, on the transaction that claims the Message-Id under the
//! durable's name ([`Consumer::process`] with subscriber = `--durable`):
//! `UPDATE stock SET qty = qty - N WHERE sku = …` and one
//! `stock_moves (message_id, order_id, sku, qty)` row. `--handler-delay-ms`
//! pauses inside that transaction, after the writes and before the commit.
//!
//! # The guarantee
//!
//! The effect happens once per Message-Id (per durable): the claim row, the
//! decrement and the move commit together or not at all, and the message is
//! acknowledged only after [`Consumer::process`] returned (the commit, or
//! the finding that an earlier delivery committed). Where a crash lands:
//!
//! - **before the commit** (inside the handler, during `COMMIT` before the
//!   database made it durable): the database rolls the transaction back
//!   when the connection dies; nothing is kept and nothing was acked, so
//!   JetStream redelivers after `ack_wait` and the redelivery runs it.
//! - **after the commit, before the ack** (or the ack is lost): the
//!   redelivery finds the claimed id, does not run the handler
//!   (`duplicate`) and acks.
//! - **after the ack**: nothing is redelivered.
//! - **the same Message-Id twice at once** (an outbox relay that published
//!   it again, two processes on one durable): the database's unique
//!   constraint decides; the second waits for the first (at most
//!   `--lock-wait-ms`, 10 s by default, then it is nak'ed and comes back,
//!   however often) and is a duplicate when it committed, or runs when it
//!   rolled back.
//! - **the connection is lost during `COMMIT`**: the outcome is unknown,
//!   the delivery is nak'ed, and its redelivery finds out (a duplicate if
//!   it committed).
//!
//! While a delivery is in the handler the consumer sends JetStream
//! "in progress" acks every half `ack_wait`, so a slow transaction is not
//! redelivered to another process meanwhile; a dead process sends none, so
//! its message comes back after `ack_wait`. Messages still waiting in a
//! fetched batch (at most 10) get no such acks: with handlers slower than
//! `ack_wait / 10` some are redelivered meanwhile, which costs a duplicate
//! delivery, not a second effect. Ids are remembered 7 days (the
//! ledger's retention): a producer that republishes an event later than
//! that would apply it again, so keep the outbox's retry window shorter.
//!
//! # Poison messages
//!
//! A message that can never be applied is recorded once in
//! `poison_messages (id, message_id, reason, payload)` and acked, never
//! redelivered forever; the raw payload is kept for an operator:
//!
//! - a message whose handler failed five times (a value the database
//!   refuses, say: a failure that repeats is not transient), counted in
//!   `delivery_failures` across deliveries, restarts and processes. Only
//!   the handler's own failures count
//!   ([`ConsumeError::is_handler_failure`], and not a lost connection, a
//!   lock wait or a serialization conflict inside it);
//! - no `Message-Id` header (or an empty one, or one longer than 255 bytes);
//! - a Message-Id the ledger cannot hold ([`ConsumeError::InvalidId`]: one
//!   with a NUL), recorded under its percent-encoded form (`%00` for the
//!   NUL, `%25` for `%`, every control character so), which every store's
//!   text column holds;
//! - a body that does not parse, a `qty` that is not a positive integer, an
//!   empty or over-long `orderId`/`sku`, or a `sku` with no `stock` row;
//! - the Message-Id was processed before with a **different** payload
//!   ([`ConsumeError::PayloadMismatch`], a producer bug): the first
//!   payload's effect stands, this one is only recorded.
//!
//! When the message has a Message-Id, its poison row is written on the
//! claiming transaction, so a redelivery or a republished copy is a
//! duplicate, not a second row. Otherwise (no id, a mismatch) the row's id
//! is the delivery's place in the stream (`<stream>:<stream created>:<stream
//! sequence>`), inserted if absent, so a redelivery after a crash before the
//! ack records nothing new. A poison id counts as processed: once the
//! cause is fixed (say the missing `stock` row added), the producer
//! republishes the event under a new Message-Id.
//!
//! Every other failure rolls back, is *not* acked but nak'ed, and is
//! retried however often, with a growing delay (`--retry-delay-ms` doubled
//! per delivery, at most `--max-retry-delay-ms`): the database is down, a
//! lock wait ran out, a serialization conflict, and above all
//! [`ConsumeError::InFlight`]: an earlier delivery's transaction still
//! holds the Message-Id (a frozen or partitioned process) and may yet roll
//! back, so acking it could drop a message that was never applied.
//!
//! SIGTERM (or Ctrl-C) lets the message in hand finish (commit and ack),
//! naks the rest of the fetched batch, flushes the acks and exits 0.

use std::pin::Pin;
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, AckKind, Message};
use serde::Deserialize;
use sqlx::Pool;
use tokio::sync::watch;
use tower_idempotency::Backend;
use tower_idempotency::consumer::{ConsumeError, Consumer, Processed};
use tower_idempotency::store::StoreErrorKind;

/// Messages asked for per pull request.
const BATCH: usize = 10;
/// How long one pull request waits for messages.
const PULL_EXPIRES: Duration = Duration::from_secs(1);
/// The pause after a failed pull request.
const RETRY_DELAY: Duration = Duration::from_secs(1);
/// The redelivery delay of a message whose record awaits an operator.
const UNRESOLVED_DELAY: Duration = Duration::from_secs(30);
/// The longest Message-Id kept as it is (the ledger's and the tables' key
/// size).
const MAX_ID_LEN: usize = 255;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A line on stdout; a closed stdout is no reason to stop (`println!`
/// would panic).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// A line on stderr, likewise.
macro_rules! log {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

/// The body of an `orders.created` event.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct OrderCreated {
    order_id: String,
    sku: String,
    qty: i64,
}

/// Parses and validates a body; the reason it is poison otherwise.
fn parse_event(payload: &[u8]) -> Result<OrderCreated, String> {
    let event: OrderCreated =
        serde_json::from_slice(payload).map_err(|e| format!("invalid body: {e}"))?;
    if event.qty < 1 {
        return Err(format!("qty must be a positive integer, got {}", event.qty));
    }
    if event.order_id.is_empty() || event.order_id.len() > 255 {
        return Err("orderId must be 1 to 255 bytes".into());
    }
    if event.order_id.contains('\0') || event.sku.contains('\0') {
        return Err("orderId and sku must not contain NUL".into());
    }
    if event.sku.is_empty() || event.sku.len() > 64 {
        return Err("sku must be 1 to 64 bytes".into());
    }
    Ok(event)
}

/// The example's own tables and statements, per database.
trait StockDb: Backend {
    /// Creates the example's tables if missing.
    fn create_schema(pool: &Pool<Self>) -> impl Future<Output = sqlx::Result<()>> + Send;
    /// `UPDATE stock SET qty = qty - N`: `false` when the sku has no row.
    fn take_stock(
        conn: &mut Self::Connection,
        sku: &str,
        qty: i64,
    ) -> impl Future<Output = sqlx::Result<bool>> + Send;
    fn insert_move(
        conn: &mut Self::Connection,
        message_id: &str,
        event: &OrderCreated,
    ) -> impl Future<Output = sqlx::Result<()>> + Send;
    /// Records a poison message unless a row with `id` exists.
    fn insert_poison(
        conn: &mut Self::Connection,
        poison: &Poison<'_>,
    ) -> impl Future<Output = sqlx::Result<()>> + Send;
    /// Counts one more handler failure of `message_id` (committed on its
    /// own, after the delivery rolled back); how many there were.
    fn count_failure(
        pool: &Pool<Self>,
        message_id: &str,
    ) -> impl Future<Output = sqlx::Result<i64>> + Send;
    /// Forgets the failures of `message_id`, on the transaction that
    /// applies it.
    fn forget_failures(
        conn: &mut Self::Connection,
        message_id: &str,
    ) -> impl Future<Output = sqlx::Result<()>> + Send;
}

/// One `poison_messages` row.
struct Poison<'a> {
    id: &'a str,
    message_id: Option<&'a str>,
    reason: &'a str,
    payload: &'a [u8],
}

/// One implementation per database; only the SQL text differs.
macro_rules! stock_db {
    ($db:ty, schema: $schema:expr, take_stock: $ts:expr, insert_move: $im:expr,
     insert_poison: $ip:expr, count_failure: $cf:expr, failures: $f:expr,
     forget_failures: $ff:expr $(,)?) => {
        impl StockDb for $db {
            async fn create_schema(pool: &Pool<Self>) -> sqlx::Result<()> {
                sqlx::raw_sql($schema).execute(pool).await.map(drop)
            }

            async fn take_stock(
                conn: &mut Self::Connection,
                sku: &str,
                qty: i64,
            ) -> sqlx::Result<bool> {
                let done = sqlx::query($ts).bind(qty).bind(sku).execute(conn).await?;
                Ok(done.rows_affected() == 1)
            }

            async fn insert_move(
                conn: &mut Self::Connection,
                message_id: &str,
                event: &OrderCreated,
            ) -> sqlx::Result<()> {
                sqlx::query($im)
                    .bind(message_id)
                    .bind(&event.order_id)
                    .bind(&event.sku)
                    .bind(event.qty)
                    .execute(conn)
                    .await
                    .map(drop)
            }

            async fn insert_poison(
                conn: &mut Self::Connection,
                p: &Poison<'_>,
            ) -> sqlx::Result<()> {
                sqlx::query($ip)
                    .bind(p.id)
                    .bind(p.message_id)
                    .bind(p.reason)
                    .bind(p.payload)
                    .execute(conn)
                    .await
                    .map(drop)
            }

            async fn count_failure(pool: &Pool<Self>, message_id: &str) -> sqlx::Result<i64> {
                let mut conn = pool.acquire().await?;
                sqlx::query($cf)
                    .bind(message_id)
                    .execute(&mut *conn)
                    .await?;
                sqlx::query_scalar($f)
                    .bind(message_id)
                    .fetch_one(&mut *conn)
                    .await
            }

            async fn forget_failures(
                conn: &mut Self::Connection,
                message_id: &str,
            ) -> sqlx::Result<()> {
                sqlx::query($ff)
                    .bind(message_id)
                    .execute(conn)
                    .await
                    .map(drop)
            }
        }
    };
}

#[cfg(feature = "sqlite")]
stock_db!(
    sqlx::Sqlite,
    schema: "
        CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL);
        CREATE TABLE IF NOT EXISTS stock_moves (message_id TEXT PRIMARY KEY, order_id TEXT NOT NULL,
            sku TEXT NOT NULL, qty INTEGER NOT NULL);
        CREATE TABLE IF NOT EXISTS poison_messages (id TEXT PRIMARY KEY, message_id TEXT NULL,
            reason TEXT NOT NULL, payload BLOB NOT NULL);
        CREATE TABLE IF NOT EXISTS delivery_failures (message_id TEXT PRIMARY KEY,
            failures INTEGER NOT NULL);",
    take_stock: "UPDATE stock SET qty = qty - ? WHERE sku = ?",
    insert_move: "INSERT INTO stock_moves (message_id, order_id, sku, qty) VALUES (?, ?, ?, ?)",
    insert_poison: "INSERT INTO poison_messages (id, message_id, reason, payload) VALUES (?, ?, ?, ?)
        ON CONFLICT (id) DO NOTHING",
    count_failure: "INSERT INTO delivery_failures (message_id, failures) VALUES (?, 1)
        ON CONFLICT (message_id) DO UPDATE SET failures = delivery_failures.failures + 1",
    failures: "SELECT failures FROM delivery_failures WHERE message_id = ?",
    forget_failures: "DELETE FROM delivery_failures WHERE message_id = ?",
);

#[cfg(feature = "postgres")]
stock_db!(
    sqlx::Postgres,
    schema: "
        CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, qty BIGINT NOT NULL);
        CREATE TABLE IF NOT EXISTS stock_moves (message_id TEXT PRIMARY KEY, order_id TEXT NOT NULL,
            sku TEXT NOT NULL, qty BIGINT NOT NULL);
        CREATE TABLE IF NOT EXISTS poison_messages (id TEXT PRIMARY KEY, message_id TEXT NULL,
            reason TEXT NOT NULL, payload BYTEA NOT NULL);
        CREATE TABLE IF NOT EXISTS delivery_failures (message_id TEXT PRIMARY KEY,
            failures BIGINT NOT NULL);",
    take_stock: "UPDATE stock SET qty = qty - $1 WHERE sku = $2",
    insert_move: "INSERT INTO stock_moves (message_id, order_id, sku, qty) VALUES ($1, $2, $3, $4)",
    insert_poison: "INSERT INTO poison_messages (id, message_id, reason, payload) VALUES ($1, $2, $3, $4)
        ON CONFLICT (id) DO NOTHING",
    count_failure: "INSERT INTO delivery_failures (message_id, failures) VALUES ($1, 1)
        ON CONFLICT (message_id) DO UPDATE SET failures = delivery_failures.failures + 1",
    failures: "SELECT failures FROM delivery_failures WHERE message_id = $1",
    forget_failures: "DELETE FROM delivery_failures WHERE message_id = $1",
);

#[cfg(feature = "mysql")]
stock_db!(
    sqlx::MySql,
    schema: "
        CREATE TABLE IF NOT EXISTS stock (sku VARCHAR(64) PRIMARY KEY, qty BIGINT NOT NULL) ENGINE = InnoDB;
        CREATE TABLE IF NOT EXISTS stock_moves (
            message_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin PRIMARY KEY,
            order_id VARCHAR(255) NOT NULL, sku VARCHAR(64) NOT NULL, qty BIGINT NOT NULL) ENGINE = InnoDB;
        CREATE TABLE IF NOT EXISTS poison_messages (id VARCHAR(255) PRIMARY KEY,
            message_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
            reason TEXT NOT NULL, payload LONGBLOB NOT NULL) ENGINE = InnoDB;
        CREATE TABLE IF NOT EXISTS delivery_failures (message_id VARBINARY(255) PRIMARY KEY,
            failures BIGINT NOT NULL) ENGINE = InnoDB;",
    take_stock: "UPDATE stock SET qty = qty - ? WHERE sku = ?",
    insert_move: "INSERT INTO stock_moves (message_id, order_id, sku, qty) VALUES (?, ?, ?, ?)",
    insert_poison: "INSERT INTO poison_messages (id, message_id, reason, payload) VALUES (?, ?, ?, ?)
        ON DUPLICATE KEY UPDATE id = id",
    count_failure: "INSERT INTO delivery_failures (message_id, failures) VALUES (?, 1)
        ON DUPLICATE KEY UPDATE failures = failures + 1",
    failures: "SELECT failures FROM delivery_failures WHERE message_id = ?",
    forget_failures: "DELETE FROM delivery_failures WHERE message_id = ?",
);

/// What the handler did on the claiming transaction.
enum Handled {
    Applied,
    Poison(String),
}

/// A message whose handler failed this many times (rolled back each time)
/// is recorded as poison and acked: a failure that repeats is not
/// transient. Nothing else counts.
const MAX_FAILURES: i64 = 5;

/// What to tell JetStream about a delivery.
enum Verdict {
    Ack,
    Nak(Duration),
}

struct Worker<DB: StockDb> {
    pool: Pool<DB>,
    consumer: Consumer<DB>,
    handler_delay: Duration,
    /// The first redelivery delay of a nak'ed message, doubled per
    /// delivery up to `max_retry_delay`.
    retry_delay: Duration,
    max_retry_delay: Duration,
    /// `<stream>:<stream created, unix ns>`: with the stream sequence, a
    /// delivery's place in the stream.
    stream_key: String,
}

impl<DB: StockDb> Worker<DB> {
    /// Handles one delivery and says whether to ack it; never panics on a
    /// bad message.
    async fn handle(&self, msg: &Message) -> Verdict {
        let (seq, delivered, delivery_id) = match msg.info() {
            Ok(info) => (
                info.stream_sequence,
                info.delivered,
                format!("{}:{}", self.stream_key, info.stream_sequence),
            ),
            // Not a JetStream delivery (no ack subject): a unique row id.
            Err(_) => (0, 0, format!("{}:unknown:{}", self.stream_key, now_nanos())),
        };
        let payload: &[u8] = &msg.payload;
        let message_id = message_id(msg);
        say!(
            "received {} seq={seq} delivery={delivered}",
            message_id.unwrap_or("-")
        );
        let id = match message_id {
            Some(id) if id.len() <= MAX_ID_LEN => id,
            other => {
                let reason = if other.is_some() {
                    "the Message-Id header is longer than 255 bytes"
                } else {
                    "no Message-Id header"
                };
                let poison = Poison {
                    id: &delivery_id,
                    message_id: None,
                    reason,
                    payload,
                };
                return self.record_poison("-", &poison, delivered).await;
            }
        };
        let parsed = parse_event(payload);
        let delay = self.handler_delay;
        let poison_id = delivery_id.clone();
        let done = self
            .consumer
            .process(id, payload, |tx| async move {
                let mut conn = tx.lock()?;
                if delivered > 1 {
                    // An earlier delivery may have counted a failure.
                    DB::forget_failures(&mut conn, id).await?;
                }
                let handled = match parsed {
                    Ok(event) => {
                        if DB::take_stock(&mut conn, &event.sku, event.qty).await? {
                            DB::insert_move(&mut conn, id, &event).await?;
                            Handled::Applied
                        } else {
                            let reason = format!("no stock row for sku {:?}", event.sku);
                            let poison = Poison {
                                id: &poison_id,
                                message_id: Some(id),
                                reason: &reason,
                                payload,
                            };
                            DB::insert_poison(&mut conn, &poison).await?;
                            Handled::Poison(reason)
                        }
                    }
                    Err(reason) => {
                        let poison = Poison {
                            id: &poison_id,
                            message_id: Some(id),
                            reason: &reason,
                            payload,
                        };
                        DB::insert_poison(&mut conn, &poison).await?;
                        Handled::Poison(reason)
                    }
                };
                say!("in-transaction {id}");
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                drop(conn);
                Ok::<_, BoxError>(handled)
            })
            .await;
        match done {
            Ok(Processed::Applied(Handled::Applied)) => {
                say!("applied {id}");
                Verdict::Ack
            }
            Ok(Processed::Applied(Handled::Poison(reason))) => {
                log!("stock_consumer: poison message {id:?}: {reason}");
                say!("poison {id} {reason}");
                Verdict::Ack
            }
            Ok(Processed::Duplicate) => {
                say!("duplicate {id}");
                Verdict::Ack
            }
            Err(ConsumeError::PayloadMismatch { .. }) => {
                let poison = Poison {
                    id: &delivery_id,
                    message_id: Some(id),
                    reason: "payload mismatch: the Message-Id was processed before with a different payload",
                    payload,
                };
                self.record_poison(id, &poison, delivered).await
            }
            Err(ConsumeError::InvalidId) => {
                // The ledger cannot hold the id (a NUL): recorded under its
                // percent-encoded form, which every store's text holds.
                let printable = printable_id(id);
                let poison = Poison {
                    id: &delivery_id,
                    message_id: (printable.len() <= MAX_ID_LEN).then_some(printable.as_str()),
                    reason: "invalid Message-Id: the ledger cannot hold it (a NUL)",
                    payload,
                };
                self.record_poison(&printable, &poison, delivered).await
            }
            Err(e @ ConsumeError::Unresolved) => {
                log!("stock_consumer: {id:?}: {e}; retrying later");
                say!("retry {id} {e}");
                Verdict::Nak(UNRESOLVED_DELAY)
            }
            // Anything else no redelivery can fix: poison, acked.
            Err(e) if !e.redeliver() => {
                let reason = e.to_string();
                let poison = Poison {
                    id: &delivery_id,
                    message_id: Some(id),
                    reason: &reason,
                    payload,
                };
                self.record_poison(id, &poison, delivered).await
            }
            // The handler failed the same way delivery after delivery (a
            // value the database refuses, say): poison, not a retry
            // forever. Only the handler's own failures count.
            Err(e) if e.is_handler_failure() && !transient::<DB>(&e) => {
                match DB::count_failure(&self.pool, id).await {
                    Ok(failures) if failures >= MAX_FAILURES => {
                        let reason = format!("failed {failures} deliveries, the last: {e}");
                        let poison = Poison {
                            id: &delivery_id,
                            message_id: Some(id),
                            reason: &reason,
                            payload,
                        };
                        self.record_poison(id, &poison, delivered).await
                    }
                    counted => {
                        if let Err(c) = counted {
                            log!("stock_consumer: {id:?}: counting the failure failed: {c}");
                        }
                        self.retry(id, &e, delivered)
                    }
                }
            }
            // InFlight (an earlier delivery's transaction still holds the
            // id and may yet roll back), Store, a transient failure inside
            // the handler: not applied, so redelivered however often.
            Err(e) => self.retry(id, &e, delivered),
        }
    }

    /// Naks a delivery that may yet succeed, with a delay that grows with
    /// its delivery count.
    fn retry(&self, id: &str, e: &dyn std::fmt::Display, delivered: i64) -> Verdict {
        let delay = backoff(self.retry_delay, self.max_retry_delay, delivered);
        log!("stock_consumer: {id:?}: {e}; not acked, redelivered in {delay:?}");
        say!("retry {id} {e}");
        Verdict::Nak(delay)
    }

    /// Records a poison message outside any claim (inserted if absent);
    /// acks it once recorded, retries (with backoff) when the database
    /// failed.
    async fn record_poison(&self, label: &str, poison: &Poison<'_>, delivered: i64) -> Verdict {
        let recorded = async {
            let mut conn = self.pool.acquire().await?;
            DB::insert_poison(&mut conn, poison).await
        }
        .await;
        match recorded {
            Ok(()) => {
                log!(
                    "stock_consumer: poison message {label:?} ({}): {}",
                    poison.id,
                    poison.reason
                );
                say!("poison {label} {}", poison.reason);
                Verdict::Ack
            }
            Err(e) => {
                log!("stock_consumer: recording poison {label:?} failed: {e}");
                self.retry(label, &e, delivered)
            }
        }
    }
}

/// `base` doubled per earlier delivery, at most `max`.
fn backoff(base: Duration, max: Duration, delivered: i64) -> Duration {
    let doublings = u32::try_from(delivered.saturating_sub(1).clamp(0, 20)).unwrap_or(20);
    base.saturating_mul(1 << doublings).min(max)
}

/// Whether a handler error is the store's transient failure (a lost
/// connection, a lock wait, a serialization conflict, a busy pool), which a
/// redelivery may fix: never counted towards poison.
fn transient<DB: Backend>(e: &ConsumeError<BoxError>) -> bool {
    let ConsumeError::Handler(e) = e else {
        return false;
    };
    e.downcast_ref::<sqlx::Error>()
        .is_some_and(|e| DB::error_kind(e) != StoreErrorKind::Other)
}

/// The id with `%` and every control character (NUL included)
/// percent-encoded, byte by byte: text every store holds, and two ids
/// never share one form.
fn printable_id(id: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(id.len());
    for c in id.chars() {
        if c == '%' || c.is_control() {
            for b in c.encode_utf8(&mut [0; 4]).bytes() {
                let _ = write!(out, "%{b:02X}");
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn now_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// The `Message-Id` header (any case), when present and non-empty.
fn message_id(msg: &Message) -> Option<&str> {
    let headers = msg.headers.as_ref()?;
    let value = match headers.get("Message-Id") {
        Some(v) => Some(v.as_str()),
        None => headers
            .iter()
            .find(|(name, _)| {
                let name: &str = name.as_ref();
                name.eq_ignore_ascii_case("message-id")
            })
            .and_then(|(_, values)| values.first())
            .map(|v| v.as_str()),
    };
    value.filter(|v| !v.is_empty())
}

/// The next message of a batch.
/// Naks, for immediate redelivery, what was fetched and is already here.
async fn hand_back(batch: &mut pull::Batch) {
    while let Ok(Some(Ok(msg))) = tokio::time::timeout(Duration::ZERO, next_message(batch)).await {
        settle(&msg, Verdict::Nak(Duration::ZERO)).await;
    }
}

async fn next_message(batch: &mut pull::Batch) -> Option<Result<Message, async_nats::Error>> {
    std::future::poll_fn(|cx| futures_core::Stream::poll_next(Pin::new(&mut *batch), cx)).await
}

/// Handles a delivery while keeping it ours: an "in progress" ack every
/// half `ack_wait`, so JetStream does not hand it to another process while
/// the transaction runs.
async fn handle_with_progress<DB: StockDb>(
    worker: &Worker<DB>,
    msg: &Message,
    ack_wait: Duration,
) -> Verdict {
    let handling = worker.handle(msg);
    tokio::pin!(handling);
    let period = (ack_wait / 2).max(Duration::from_millis(100));
    let mut progress = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    loop {
        tokio::select! {
            verdict = &mut handling => return verdict,
            _ = progress.tick() => {
                if let Err(e) = msg.ack_with(AckKind::Progress).await {
                    log!("stock_consumer: in-progress ack failed: {e}");
                }
            }
        }
    }
}

async fn settle(msg: &Message, verdict: Verdict) {
    let sent = match verdict {
        Verdict::Ack => msg.ack().await,
        Verdict::Nak(delay) if delay.is_zero() => msg.ack_with(AckKind::Nak(None)).await,
        Verdict::Nak(delay) => msg.ack_with(AckKind::Nak(Some(delay))).await,
    };
    if let Err(e) = sent {
        // Not acked: redelivered after ack_wait, then a duplicate.
        log!("stock_consumer: ack failed: {e}");
    }
}

/// Creates the stream and the durable pull consumer if missing (twice, for
/// a race with another process creating them).
async fn subscribe(
    js: &jetstream::Context,
    args: &Args,
) -> Result<(PullConsumer, String, Duration), BoxError> {
    let mut last = None;
    for _ in 0..2 {
        let stream = match js
            .get_or_create_stream(jetstream::stream::Config {
                name: args.stream.clone(),
                subjects: vec![args.subject.clone()],
                ..Default::default()
            })
            .await
        {
            Ok(stream) => stream,
            Err(e) => {
                last = Some(BoxError::from(e));
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let info = stream.cached_info();
        if !info.config.subjects.contains(&args.subject) {
            log!(
                "stock_consumer: stream {} exists with subjects {:?}, not {}",
                args.stream,
                info.config.subjects,
                args.subject
            );
        }
        let stream_key = format!("{}:{}", args.stream, info.created.unix_timestamp_nanos());
        let config = pull::Config {
            durable_name: Some(args.durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: args.ack_wait,
            ..Default::default()
        };
        match stream.get_or_create_consumer(&args.durable, config).await {
            Ok(consumer) => {
                let existing = consumer.cached_info().config.ack_wait;
                if existing != args.ack_wait {
                    log!(
                        "stock_consumer: durable {} exists with ack_wait {existing:?}, kept",
                        args.durable
                    );
                }
                return Ok((consumer, stream_key, existing));
            }
            Err(e) => {
                last = Some(e.into());
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    Err(last.unwrap_or_else(|| "could not create the stream or the consumer".into()))
}

async fn run<DB: StockDb>(pool: Pool<DB>, args: &Args, store: &str) -> Result<(), BoxError> {
    tower_idempotency::migrate(&pool).await?;
    DB::create_schema(&pool).await?;
    let mut stop = shutdown_signal();
    let client = tokio::time::timeout(Duration::from_secs(10), async_nats::connect(&args.nats))
        .await
        .map_err(|_| format!("{}: no answer within 10 s", args.nats))??;
    let js = jetstream::new(client.clone());
    // Progress acks follow the durable's own ack_wait, which an existing
    // durable keeps whatever --ack-wait-ms says.
    let (consumer, stream_key, ack_wait) = subscribe(&js, args).await?;
    let worker = Worker {
        consumer: Consumer::new(pool.clone(), args.durable.as_str()).with_lock_wait(args.lock_wait),
        pool: pool.clone(),
        handler_delay: args.handler_delay,
        retry_delay: args.retry_delay,
        max_retry_delay: args.max_retry_delay,
        stream_key,
    };
    say!(
        "stock_consumer consuming {} as {} (store: {store})",
        args.subject,
        args.durable
    );
    'pull: while !*stop.borrow() {
        let batch = tokio::select! {
            batch = consumer.batch().max_messages(BATCH).expires(PULL_EXPIRES).messages() => batch,
            _ = stop.changed() => break,
        };
        let mut batch = match batch {
            Ok(batch) => batch,
            Err(e) => {
                log!("stock_consumer: pull request failed: {e}");
                tokio::select! {
                    _ = tokio::time::sleep(RETRY_DELAY) => {}
                    _ = stop.changed() => {}
                }
                continue;
            }
        };
        loop {
            let next = tokio::select! {
                // A message already here is taken before the stop is seen;
                // the stop then hands back the rest of the batch below.
                biased;
                next = next_message(&mut batch) => next,
                _ = stop.changed() => {
                    hand_back(&mut batch).await;
                    break 'pull;
                }
            };
            match next {
                None => break,
                Some(Err(e)) => {
                    log!("stock_consumer: pull failed: {e}");
                    break;
                }
                Some(Ok(msg)) => {
                    // Not interrupted by SIGTERM: the message in hand finishes.
                    let verdict = handle_with_progress(&worker, &msg, ack_wait).await;
                    settle(&msg, verdict).await;
                }
            }
            if *stop.borrow() {
                hand_back(&mut batch).await;
                break 'pull;
            }
        }
    }
    if tokio::time::timeout(Duration::from_secs(5), client.flush())
        .await
        .is_err()
    {
        log!("stock_consumer: the last acks were not flushed within 5 s");
    }
    pool.close().await;
    Ok(())
}

/// `true` once SIGTERM or Ctrl-C arrived.
fn shutdown_signal() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(term) => term,
                    Err(_) => std::future::pending().await,
                };
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        let _ = tx.send(true);
    });
    rx
}

struct Args {
    nats: String,
    stream: String,
    subject: String,
    durable: String,
    ack_wait: Duration,
    handler_delay: Duration,
    lock_wait: Duration,
    retry_delay: Duration,
    max_retry_delay: Duration,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        nats: "nats://127.0.0.1:4222".into(),
        stream: "ORDERS".into(),
        subject: "orders.created".into(),
        durable: "stock".into(),
        ack_wait: Duration::from_secs(30),
        handler_delay: Duration::ZERO,
        lock_wait: Duration::from_secs(10),
        retry_delay: Duration::from_secs(1),
        max_retry_delay: Duration::from_secs(60),
    };
    let millis = |flag: &str, value: &str| -> Result<Duration, String> {
        value
            .parse::<u64>()
            .map(Duration::from_millis)
            .map_err(|e| format!("{flag} {value}: {e}"))
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--nats" => args.nats = value,
            "--stream" => args.stream = value,
            "--subject" => args.subject = value,
            "--durable" => args.durable = value,
            "--ack-wait-ms" => args.ack_wait = millis(&flag, &value)?,
            "--handler-delay-ms" => args.handler_delay = millis(&flag, &value)?,
            "--lock-wait-ms" => args.lock_wait = millis(&flag, &value)?,
            "--retry-delay-ms" => args.retry_delay = millis(&flag, &value)?,
            "--max-retry-delay-ms" => args.max_retry_delay = millis(&flag, &value)?,
            other => {
                return Err(format!(
                    "unknown flag {other}; use --nats URL, --stream NAME, --subject SUBJECT, \
                     --durable NAME, --ack-wait-ms N, --handler-delay-ms N, --lock-wait-ms N, \
                     --retry-delay-ms N, --max-retry-delay-ms N"
                ));
            }
        }
    }
    if args.retry_delay.is_zero() || args.max_retry_delay < args.retry_delay {
        return Err("--retry-delay-ms must be at least 1 and at most --max-retry-delay-ms".into());
    }
    if args.ack_wait < Duration::from_millis(100) {
        return Err("--ack-wait-ms must be at least 100".into());
    }
    if args.durable.is_empty() || args.stream.is_empty() || args.subject.is_empty() {
        return Err("--stream, --subject and --durable must not be empty".into());
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .init();
    let args = parse_args()?;
    let url = std::env::var("DATABASE_URL").unwrap_or_default();
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        #[cfg(feature = "postgres")]
        return run(sqlx::PgPool::connect(&url).await?, &args, "postgres").await;
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        #[cfg(feature = "mysql")]
        return run(sqlx::MySqlPool::connect(&url).await?, &args, "mysql").await;
        #[cfg(not(feature = "mysql"))]
        return Err(
            "mysql:// needs the mysql feature: cargo run --example stock_consumer --features mysql"
                .into(),
        );
    } else if url.is_empty() || url.starts_with("sqlite:") {
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
        let options = if url.is_empty() {
            SqliteConnectOptions::new().filename("stock_consumer.db")
        } else {
            url.parse::<SqliteConnectOptions>()?
        };
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal);
        let store = format!("sqlite ({})", options.get_filename().display());
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .connect_with(options)
            .await?;
        return run(pool, &args, &store).await;
    }
    Err(format!("unsupported DATABASE_URL {url:?}: use postgres://, mysql:// or sqlite:").into())
}
