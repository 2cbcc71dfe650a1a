//! Make non-idempotent HTTP operations (create an order, take a payment, move
//! money) safe to retry.
//!
//! A client sends `POST /orders`, the response is lost, and it cannot tell
//! "never arrived" from "committed, answer lost". It retries with the same
//! `Idempotency-Key`. [`IdempotencyLayer`] promises that the effect happens
//! **at most once** and that every retry gets **the same answer** as the
//! first attempt that finished.
//!
//! # Example
//!
//! ```
//! use http::{Request, Response, StatusCode};
//! use sqlx::{Sqlite, sqlite::SqlitePoolOptions};
//! use tower::{ServiceBuilder, ServiceExt};
//! use tower_idempotency::{IdempotencyBody, IdempotencyLayer, Principal, Tx};
//!
//! type BoxError = Box<dyn std::error::Error + Send + Sync>;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BoxError> {
//! let pool = SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await?;
//! tower_idempotency::migrate(&pool).await?;
//! sqlx::raw_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, amount INTEGER)")
//!     .execute(&pool)
//!     .await?;
//!
//! // The handler writes on the transaction that holds the idempotency claim.
//! let create_order = |req: Request<IdempotencyBody<String>>| async move {
//!     let tx = req.extensions().get::<Tx<Sqlite>>().cloned().ok_or("no layer")?;
//!     let mut conn = tx.lock()?;
//!     let id: i64 = sqlx::query_scalar("INSERT INTO orders (amount) VALUES (12000) RETURNING id")
//!         .fetch_one(&mut *conn)
//!         .await?;
//!     Ok::<_, BoxError>(Response::builder().status(201).body(format!("{{\"orderId\":{id}}}"))?)
//! };
//! let service = ServiceBuilder::new()
//!     .layer(IdempotencyLayer::new(pool.clone()))
//!     .service_fn(create_order);
//!
//! let request = || {
//!     let mut req = Request::post("/orders")
//!         .header("idempotency-key", "\"checkout-20260914-001\"")
//!         .header("content-type", "application/json")
//!         .body(r#"{"amount":12000}"#.to_string())
//!         .unwrap();
//!     // Normally your authentication layer inserts the principal.
//!     req.extensions_mut().insert(Principal::new("user-42"));
//!     req
//! };
//! let first = service.clone().oneshot(request()).await?;
//! let retry = service.clone().oneshot(request()).await?;
//! assert_eq!(first.status(), StatusCode::CREATED);
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//!
//! let orders: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders").fetch_one(&pool).await?;
//! assert_eq!(orders, 1);
//! # Ok(())
//! # }
//! ```
//!
//! With axum (feature `axum`), add `.layer(IdempotencyLayer::new(pool))` to a
//! router and take the transaction with the [`Tx`] extractor; a handler
//! returning `Result<_, HandlerError>` uses `?` on the lock and on sqlx alike
//! (see [`Tx`] for the rules and an example).
//!
//! # The protocol
//!
//! For a guarded method (POST and PATCH by default) the layer:
//!
//! 1. parses the `Idempotency-Key` ([`KeyMode`]), finds the principal and the
//!    operation (the *scope*, see [`Principal`]), buffers the body up to a
//!    limit and fingerprints it ([`Normalizer`]);
//! 2. begins a transaction and claims the scope with a unique-constraint
//!    insert, then takes a savepoint; the database decides who wins, never a
//!    read followed by an `if`;
//! 3. if the scope was already taken, reads the committed record once and
//!    answers from it (replay, `422` for a different payload, `410` once
//!    expired); on PostgreSQL the claim reads it in its own round trip, and
//!    elsewhere [`IdempotencyLayer::with_read_first`] moves that read before
//!    the claim, for replay-heavy traffic;
//! 4. otherwise hands the claimed transaction to the handler ([`Tx`]);
//! 5. classifies the answer ([`Classification`]) and records it on the same
//!    transaction, so the business rows and the ledger row commit together.
//!
//! | situation | answer | kept in the store |
//! |---|---|---|
//! | guarded method, no key (key required) | `400` problem | nothing |
//! | malformed key | `400` problem | nothing |
//! | no principal | `401` problem | nothing |
//! | body over the limit | `413` problem, the rest unread | nothing |
//! | body labelled JSON that does not parse | `400` problem | nothing |
//! | first request for the scope | handler runs on the claimed transaction | |
//! | … handler answers 1xx–3xx | the answer, recorded as `SUCCEEDED` | business rows + ledger row, one commit |
//! | … handler rejects the request (400, 401, 403, 404, 405, 406, 408, 413, 415, 422, 429) | the answer, unrecorded; the key stays usable | nothing |
//! | … handler answers another 4xx (a final business error) | the answer, recorded as `FAILED_FINAL` | only the ledger row: business writes rolled back to the savepoint |
//! | … handler answers 5xx, fails, panics, or its future is dropped | the answer (or the error, or the panic) | nothing: a retry runs afresh |
//! | same scope, same fingerprint, finished | stored status, headers and body, byte for byte, `Idempotent-Replayed: true` | nothing new |
//! | same scope, different fingerprint | `422` problem (or `409`) | nothing new |
//! | same scope, first still running | waits up to the in-flight wait (one budget, see below), then replays; else `409` + `Retry-After` | nothing new |
//! | key taken but its record unreadable | retries within attempts and the same budget, then `409` + `Retry-After` | nothing new |
//! | key past its retention (database clock), or a tombstone | `410` problem naming the resource | nothing new, never a new execution |
//! | connection lost during `COMMIT` | PostgreSQL asks the server on a fresh connection (`txid_status` of the `txid_current()` read in the committing batch): committed, the answer; rolled back, `503` `#commit-unknown` + `Retry-After`; still in progress, `409` `#in-flight` + `Retry-After`. When the server cannot say (an id too old, no answer within 1 s), and on SQLite and MySQL: the answer if the ledger shows the commit, else `503` `#commit-unknown` + `Retry-After` | what committed |
//! | store busy (SQLite's write lock, no pooled connection in time) | `503` + `Retry-After`, `#store-busy` | nothing |
//! | serialization failure or deadlock when recording or committing | `503` + `Retry-After`, `#transaction-conflict` | nothing |
//! | the handler ended the claimed transaction itself | `500`, `#transaction-ended`; every retry `503` `#reconciling` until an operator resolves the key ([`Reconciler`]) | what the handler committed |
//!
//! Request bodies are fingerprinted as exact canonical JSON: numbers are
//! compared as decimal values from their text (`1`, `1.0` and `10e-1` are
//! one value; `0.1` and `0.10000000000000001` are two), and a body with a
//! duplicate object name is refused with `400`, as I-JSON (RFC 7493)
//! requires, so the handler's parser and the fingerprint never disagree on
//! what was asked. See [`Normalizer`].
//!
//! Every refusal is an RFC 9457 problem document, with an `instance` URN
//! (also in the layer's log line), `retryable`, the `idempotency_key` it is
//! about and the IETF draft's section it rests on; see [`problem`] for the
//! `type` URIs and members, and `docs/ietf-draft.md` for where the layer
//! departs from the draft. The layer never returns an error of its own: store failures
//! become `503` with `Retry-After`, and [`IdempotencyOutcome`] in the response
//! extensions tells outer layers what happened.
//!
//! # Concurrency
//!
//! Two requests with one scope at the same moment: both may find no record;
//! both try to insert; the database's unique constraint lets exactly one
//! proceed. On PostgreSQL the loser waits on the winner's transaction lock
//! on the scope (an advisory lock every claim takes first), on MySQL on the
//! winner's uncommitted row (bounded by the in-flight wait); it then sees
//! the winner's committed row and replays it; if the winner rolls back, the
//! loser claims the key and runs. On SQLite writers are serialized by the
//! database lock. On PostgreSQL at `READ COMMITTED` none of this is an
//! error on the server: a replay, a lost race and a wait that runs out are
//! values the claim returns, so the server log and its rollback count keep
//! to real faults. (Above `READ COMMITTED` a duplicate whose snapshot
//! predates the winner's commit still fails with a serialization error,
//! read back and replayed.)
//! A request that cannot settle within its bounds gets `409` with
//! `Retry-After` and has changed nothing.
//!
//! Duplicates that reach the same process meet before the database: the
//! later ones wait for the first to answer without holding a pooled
//! connection, then read its stored answer. This is only a shortcut; the
//! unique constraint still decides, across processes too.
//!
//! A duplicate waits **at most the in-flight wait in all** (2 s by default,
//! [`IdempotencyLayer::with_in_flight_wait`]): the wait in this process, the
//! database lock waits of its claim attempts, the backoff between them and
//! acquiring pooled connections all come out of that one budget. Requests
//! that wait on another request's claim may hold only a bounded number of
//! pooled connections at once ([`IdempotencyLayer::with_max_waiting`], a
//! quarter of the pool by default); a duplicate that finds none free is
//! answered `409` at once. So a storm of retries cannot exhaust the pool,
//! and keys nobody contends always find a connection.
//!
//! # The caller's environment
//!
//! The claimed transaction runs at the [`IsolationLevel`] the layer is given
//! (`READ COMMITTED` by default; [`IdempotencyLayer::with_isolation_level`]),
//! set for that transaction only. The claim's bounded lock wait never
//! changes a session setting: on PostgreSQL it is set inside the claim's
//! function for the wait alone and the session's own `lock_timeout` put
//! back after it; on MySQL/MariaDB it applies to the claim's insert alone. The claim runs as a
//! task of its own, so a response future dropped mid-claim never returns a
//! connection to the pool halfway through it. Under `REPEATABLE READ` or
//! `SERIALIZABLE`, a claim that loses to a concurrent one with a
//! serialization error is read back and replayed like any lost claim, and
//! a duplicate of a key that committed is always replayed, never run
//! again: on PostgreSQL a claim whose snapshot may predate the last
//! holder's commit moves the scope's lock into a transaction begun after
//! it (one more round trip) and reads again.
//!
//! Nothing a handler or a session does moves the ledger or decides a claim:
//! the layer's savepoint has a name drawn once per process, so a handler's
//! own savepoints never catch its `ROLLBACK TO`; on PostgreSQL the finished
//! row goes to the ledger table the claim read before the handler ran
//! (a handler's `SET LOCAL search_path` never moves it) and scopes travel
//! as UTF-8 bytes the statement decodes (whatever the session's
//! `client_encoding`); on SQLite every statement names
//! `main.idempotency_records`, never a `TEMP` table; on MySQL/MariaDB every
//! statement names the ledger table, `tower_idempotency_records` since
//! migration 8, in the pool's database (a handler's `USE` or `TEMPORARY`
//! table named `idempotency_records` never moves it). The crate's own suite
//! runs every conformance case under a sample of such environments
//! (`tests/environment_matrix.rs`; see docs/testing.md and
//! docs/choices.md).
//!
//! # One clock
//!
//! Creation, expiry, the `410` decision and the [`Sweeper`] all use the
//! **database's** clock, so application instances with skewed clocks agree
//! on when a key expires. (SQLite's clock is the process's own.)
//!
//! # What the handler must not do
//!
//! The rules are on [`Tx`]. The layer commits or rolls back; the handler never does. A handler that
//! runs `COMMIT` or `ROLLBACK` on the [`Tx`], or DDL that commits implicitly
//! (MySQL), is detected at no extra round trip (the claim's savepoint is
//! gone when the layer records or rolls back): the request is answered
//! `500` (`#transaction-ended`), the event is logged at error level, and
//! the key answers `503` `#reconciling` (never "in flight", never a new
//! execution) until an operator resolves it with a [`Reconciler`]. (A
//! `ROLLBACK` followed by more writes leaves the key unprotected until the
//! layer marks it: a handler must never end the layer's transaction.)
//!
//! # Cancellation and panics
//!
//! Nothing is committed until the handler has answered and the answer is
//! recorded. A dropped response future drops the transaction, which rolls
//! back; a panicking handler is rolled back (and awaited) before the panic
//! continues. Either way no ledger row remains and a retry runs afresh.
//!
//! # Retention
//!
//! See [`DEFAULT_RETENTION`] and [`IdempotencyLayer::with_retention`]: a key
//! replays for its retention (24 hours by default) and is refused with `410`
//! afterwards, never executed again.
//!
//! # Observability
//!
//! Each guarded request runs in a `tracing` span `idempotency` with its
//! outcome and the claim, handler and commit timings; keys appear only
//! hashed and bodies never. With the `metrics` feature the layer also counts
//! outcomes and records claim latency. See [`IdempotencyOutcome::label`].
//!
//! # What is not covered
//!
//! The guarantee covers what the handler writes through [`Tx`]. The scope
//! compares byte for byte on every store (no collation makes `alice` equal
//! `alice ` or `Alice`), and the default operation is the route template
//! (axum) or the RFC 3986-normalized path (see
//! [`IdempotencyLayer::with_operation`]). A call to another system (a
//! payment provider, a message broker) is not rolled back with the
//! transaction: for such handlers use lease mode (below).
//!
//! # Lease mode
//!
//! For a handler with an effect outside the database,
//! [`IdempotencyLayer::with_lease`] commits the claim first with a lease and
//! a fencing generation; the handler works in phases (business writes
//! committed with a recovery point, fenced) and external steps (a step key
//! the provider deduplicates on, `recover` before any second `execute`,
//! unknown outcomes parked for reconciliation), and a retry after a crash
//! resumes where the last attempt stopped. A [`Completer`](lease::Completer)
//! finishes abandoned records with no client retry. See [`lease`].
//!
//! # Claim at commit
//!
//! For handlers whose effects are all on the claimed transaction,
//! [`IdempotencyLayer::with_claim_at_commit`] trades the claim before the
//! handler for the cheapest first execution: the handler runs at once, the
//! ledger row is written with the `COMMIT` under the unique constraint, and
//! a duplicate that loses there is rolled back whole and answered from the
//! ledger. A duplicate's handler may run and be undone; the default stays
//! claim-first.
//!
//! # gRPC
//!
//! Under tonic the layer is a tower layer of the server
//! (`Server::builder().layer(auth).layer(idempotency)`); every gRPC call is
//! a `POST`, so [`IdempotencyLayer::with_paths`] names the methods it
//! guards. The key is the `idempotency-key` metadata entry (or a message
//! field, [`IdempotencyLayer::with_key_from_body`]); the principal comes
//! from a layer before this one (a tonic interceptor runs after the claim);
//! the handler finds [`Tx`] in the request's extensions. Answers are sorted
//! by `grpc-status` (see [`Classification`]), recorded with their trailers
//! and replayed with `idempotent-replayed: true`; the layer's refusals are
//! trailers-only answers (`INVALID_ARGUMENT`, `UNAUTHENTICATED`,
//! `FAILED_PRECONDITION` with an `ErrorInfo` reason, `UNAVAILABLE` with
//! `grpc-retry-pushback-ms`), and a caller's `grpc-timeout` bounds
//! everything the layer does for it (three quarters of it; a deadline too
//! short for any read is answered at once). What counts as the same request, and a key
//! from an AIP-155 `request_id` field: the `protobuf` module (feature
//! `grpc`). `examples/grpc_order_service.rs` and its client show the whole.
//!
//! # Tenants
//!
//! [`IdempotencyLayer::with_policy`] chooses retention and limits per
//! request (per tenant, per route) before the claim; each record keeps its
//! own expiry. The layer's requests take turns at the store's connections
//! in a fair queue ([`IdempotencyLayer::with_max_per_principal`]): one
//! principal holds at most its share (by default all but a quarter of the
//! pool), storms together never take the reserve (the rest), which goes
//! only to principals that hold no connection, and a connection given back
//! goes first to the principal that holds the fewest. A calm tenant finds
//! a connection at once while fewer principals than the reserve's size
//! hold one of it each, and is otherwise first in line for the next one;
//! on SQLite, whose claims all need the one writer, principals take turns
//! at it in rotation.
//! [`IdempotencyLayer::with_fingerprint_headers`] makes chosen headers
//! (an API version) part of "the same request". [`keys`] answers a caller
//! that lost its request body where its own key stands.
//!
//! # The other halves
//!
//! - **Message consumers**: [`consumer::Consumer`] runs an at-least-once
//!   consumer's handler on a transaction that claims the message id in the
//!   same ledger, so a redelivery never applies twice and a failed message
//!   is never marked processed. Only repeated handler failures may become
//!   poison (an id still in flight, a store error: redeliver); an id the
//!   store cannot hold (empty, a NUL) is refused as invalid on every store;
//!   consumer scopes and HTTP scopes never meet (the operation `message` is
//!   reserved for consumers). See [`consumer`].
//! - **Clients** (feature `client`): `client::IdempotentRetryLayer` keeps
//!   one key per logical request and retries it safely (bounded attempts,
//!   deadline, `Retry-After`, a shared budget). The key is sent as a
//!   Structured Field String (`"…"`) so servers in either [`KeyMode`]
//!   accept it.
//!
//! # Feature flags
//!
//! Every sqlx 0.9 release is supported (the one this crate re-exports as
//! [`sqlx`], and the application's own `sqlx = "0.9"`: one and
//! the same); the minimum Rust version is 1.94, sqlx 0.9's own.
//!
#![doc = include_str!("../docs/features.md")]
//!
//! # Guides
//!
//! The repository's `docs/` holds a guide per topic: `choices.md` (what a
//! payments engineer should know), `lease-mode.md`, `client.md`,
//! `consumers.md`, `grpc.md`, `operating.md` (runbook, CLI, console),
//! `ledger.md` (backends, the table, retention), `deployments.md`
//! (PgBouncer, failover, Galera), `performance.md`, `testing.md` and
//! `upgrading.md`; the README links them all.

#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unreachable_pub, unsafe_code)]
#![warn(missing_docs, missing_debug_implementations)]

pub mod admin;
mod body;
mod classify;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
mod config;
mod config_error;
pub mod consumer;
mod expiry;
mod fairness;
mod fingerprint;
mod grpc;
#[cfg(feature = "axum")]
mod handler_error;
mod key;
pub mod keys;
mod layer;
pub mod lease;
mod local;
mod observe;
mod outcome;
mod path;
mod policy;
pub mod problem;
#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
pub mod protobuf;
mod random;
mod reconcile;
mod replay;
mod scope;
mod service;
pub mod store;
#[cfg(feature = "testkit")]
#[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
pub mod testkit;
mod tx;

pub use body::IdempotencyBody;
pub use classify::{Classification, ResourceId};
pub use config_error::ConfigError;
pub use expiry::{
    DEFAULT_RETENTION, DEFAULT_TOMBSTONE_RETENTION, IDEMPOTENCY_KEY_EXPIRES, SweepReport, Sweeper,
};
pub use fingerprint::{Fingerprint, FingerprintError, Normalizer};
#[cfg(feature = "axum")]
pub use handler_error::HandlerError;
pub use key::{IDEMPOTENCY_KEY, IdempotencyKey, KeyError, KeyMode, MAX_KEY_LEN};
pub use layer::IdempotencyLayer;
pub use outcome::IdempotencyOutcome;
pub use policy::Policy;
pub use problem::ProblemKind;
pub use reconcile::{DEFAULT_STRANDED_AFTER, Reconciler, Resolution, ResolveError};
pub use replay::IDEMPOTENT_REPLAYED;
pub use scope::Principal;
pub use service::{Idempotency, ResponseFuture};
pub use store::{Backend, IsolationLevel, UnresolvedRecord, migrate};
pub use tx::{Tx, TxError, TxGuard};

/// The `sqlx` this crate is built on; its types appear in the public API.
pub use sqlx;

#[cfg(test)]
mod feature_table {
    //! The feature table (docs/features.md, included in the crate docs) and
    //! the README's copy of it name exactly the features `Cargo.toml` has.

    const TABLE: &str = include_str!("../docs/features.md");

    /// The features `Cargo.toml` declares, `default` aside.
    fn declared() -> Vec<String> {
        let manifest = include_str!("../Cargo.toml");
        let section = manifest
            .split("\n[features]\n")
            .nth(1)
            .and_then(|rest| rest.split("\n[").next())
            .unwrap_or_default();
        let mut names: Vec<String> = section
            .lines()
            .filter_map(|line| line.split_once(" = "))
            .map(|(name, _)| name.trim().to_string())
            .filter(|name| !name.starts_with('#') && name != "default")
            .collect();
        names.sort();
        names
    }

    /// The features in `Cargo.toml`'s `default` list.
    fn default_on() -> Vec<String> {
        let manifest = include_str!("../Cargo.toml");
        let list = manifest
            .split("\ndefault = [")
            .nth(1)
            .and_then(|rest| rest.split(']').next())
            .unwrap_or_default();
        let mut names: Vec<String> = list
            .split(',')
            .map(|name| name.trim().trim_matches('"').to_string())
            .filter(|name| !name.is_empty())
            .collect();
        names.sort();
        names
    }

    /// The features the table has a row for, each with its "default"
    /// column.
    fn tabled() -> Vec<(String, String)> {
        let mut rows: Vec<(String, String)> = TABLE
            .lines()
            .filter_map(|line| line.strip_prefix("| `"))
            .filter_map(|rest| rest.split_once("` | "))
            .filter_map(|(name, rest)| {
                let default = rest.split_once(" |")?.0;
                Some((name.to_string(), default.to_string()))
            })
            .collect();
        rows.sort();
        rows
    }

    #[test]
    fn every_feature_has_one_row_and_every_row_a_feature() {
        let declared = declared();
        assert!(declared.contains(&"postgres".to_string()), "{declared:?}");
        let rows = tabled();
        let names: Vec<String> = rows.iter().map(|(name, _)| name.clone()).collect();
        assert_eq!(names, declared);
        let on: Vec<String> = rows
            .iter()
            .filter(|(_, default)| default == "yes")
            .map(|(name, _)| name.clone())
            .collect();
        assert_eq!(on, default_on(), "the \"default\" column");
        assert!(
            rows.iter().all(|(_, d)| d == "yes" || d == "no"),
            "{rows:?}"
        );
    }

    #[test]
    fn the_readme_carries_the_same_table() {
        assert!(
            include_str!("../README.md").contains(TABLE),
            "README.md's \"Features\" section differs from docs/features.md"
        );
    }
}
