//! [`IdempotencyLayer`]: configuration and the tower `Layer`.

use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode};
use sqlx::Pool;
use tower_layer::Layer;

use crate::config::{Config, MAX_WAIT};
use crate::config_error::{ConfigError, at_most, nonzero};
use crate::expiry::DEFAULT_RETENTION;
use crate::fairness::PrincipalSlots;
use crate::fingerprint::Normalizer;
use crate::key::KeyMode;
use crate::lease::LeaseMode;
use crate::policy::Policy;
use crate::replay::default_recorded_headers;
use crate::scope::{Principal, principal_from_extensions};
use crate::service::Idempotency;
use crate::store::{Backend, IsolationLevel};

/// Adds the idempotency guarantee to a service: for guarded methods (POST and
/// PATCH by default) a request with an `Idempotency-Key` takes effect at most
/// once, and every retry gets the answer of the first attempt that finished.
///
/// Every setting has a default that is safe for payments; each `with_*`
/// method names its default. See the [crate docs](crate) for the protocol.
///
/// # Checked in one place
///
/// The setters chain without `?`, as tower-http's do. Each checks its
/// value; the first one that cannot work (a zero limit, a wait past ten
/// minutes, a credential header in the fingerprint) is kept, and
/// [`check`](Self::check) reports it. A layer that still holds one panics
/// when it wraps a service, with the setting named: at start-up (where
/// axum's router also panics on a route that cannot work), never on a
/// request, and never with a value silently replaced.
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # fn build(pool: sqlx::SqlitePool) -> Result<(), tower_idempotency::ConfigError> {
/// use std::time::Duration;
/// use tower_idempotency::IdempotencyLayer;
///
/// let layer = IdempotencyLayer::new(pool)
///     .with_retention(Duration::from_secs(7 * 24 * 3600))
///     .with_max_request_body(256 * 1024)
///     .check()?; // a value read from your configuration may be refused
/// # Ok(())
/// # }
/// ```
pub struct IdempotencyLayer<DB: Backend> {
    pool: Pool<DB>,
    config: Config,
    /// The first setting that could not work, if any.
    invalid: Option<ConfigError>,
}

impl<DB: Backend> Clone for IdempotencyLayer<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            config: self.config.clone(),
            invalid: self.invalid.clone(),
        }
    }
}

impl<DB: Backend> std::fmt::Debug for IdempotencyLayer<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> IdempotencyLayer<DB> {
    /// A layer that keeps its ledger in `pool`'s database. Create the ledger
    /// table first with [`migrate`](crate::migrate).
    pub fn new(pool: Pool<DB>) -> Self {
        let max_connections = pool.options().get_max_connections();
        let max_waiting = default_max_waiting(max_connections);
        let turns = default_turns::<DB>(max_connections);
        let cached_statements = crate::store::caches_statements(&pool);
        let database = DB::database(&pool);
        Self {
            pool,
            config: Config {
                methods: vec![Method::POST, Method::PATCH],
                paths: None,
                key_from_body: None,
                fingerprint_headers: Vec::new(),
                key_required: true,
                key_mode: KeyMode::Lenient,
                principal: principal_from_extensions(),
                operation: None,
                normalizer: Normalizer::default(),
                max_request_body: 1024 * 1024,
                max_response_body: 1024 * 1024,
                max_stream_hold: Duration::from_secs(60),
                retention: DEFAULT_RETENTION,
                in_flight_wait: Duration::from_secs(2),
                claim_attempts: 3,
                claim_deadline: Duration::from_secs(10),
                mismatch_status: StatusCode::UNPROCESSABLE_ENTITY,
                replayed_header: true,
                recorded_headers: default_recorded_headers(),
                hash_keys: false,
                read_first: false,
                resource_link: None,
                local: Arc::default(),
                isolation: IsolationLevel::default(),
                cached_statements,
                database,
                found_ledger: Arc::default(),
                found_causal_wait: Arc::default(),
                max_waiting,
                waiters: Arc::new(tokio::sync::Semaphore::new(max_waiting)),
                principal_slots: Arc::new(turns),
                lease: None,
                claim_at_commit: false,
                policy: None,
            },
            invalid: None,
        }
    }

    /// The layer, or the first setting given to it that cannot work (see
    /// [Checked in one place](Self#checked-in-one-place)).
    pub fn check(self) -> Result<Self, ConfigError> {
        match self.invalid {
            Some(e) => Err(e),
            None => Ok(self),
        }
    }

    /// Applies a checked value, or keeps its error when it is the first.
    fn checked<T>(
        mut self,
        value: Result<T, ConfigError>,
        apply: impl FnOnce(&mut Config, T),
    ) -> Self {
        match value {
            Ok(v) => apply(&mut self.config, v),
            Err(e) => {
                self.invalid.get_or_insert(e);
            }
        }
        self
    }

    /// The methods the layer guards; others pass through untouched. The
    /// default is `POST` and `PATCH`.
    #[must_use]
    pub fn with_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// Guards only requests whose path is exactly one of `paths` (and whose
    /// method is guarded); others pass through untouched. The default is
    /// every path. For a layer that wraps a whole router, such as a tower
    /// layer of tonic's server, where every gRPC call is a `POST`:
    /// `.with_paths(["/orders.v1.Orders/CreateOrder"])`.
    #[must_use]
    pub fn with_paths<P: Into<String>>(mut self, paths: impl IntoIterator<Item = P>) -> Self {
        self.config.paths = Some(paths.into_iter().map(Into::into).collect());
        self
    }

    /// The key-status look-up for this layer's keys ("did my key land?"):
    /// a read-only service to mount behind the same authentication as the
    /// guarded routes. See [`keys`](crate::keys).
    pub fn key_status(&self) -> crate::keys::KeyStatus<DB> {
        crate::keys::KeyStatus {
            pool: self.pool.clone(),
            config: Arc::new(self.config.clone()),
        }
    }

    /// Chooses retention and limits per request: `f` sees the request head
    /// and its principal (as [`with_principal`](Self::with_principal)
    /// finds it) before the key is claimed, and returns a [`Policy`]; what
    /// the policy leaves unset is this layer's. For example 30 days for an
    /// enterprise tenant's payments, an hour for everyone's cart:
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{ConfigError, IdempotencyLayer, Policy};
    /// # fn build(pool: sqlx::SqlitePool) -> Result<IdempotencyLayer<sqlx::Sqlite>, ConfigError> {
    /// let month = Policy::new().with_retention(Duration::from_secs(30 * 86_400))?;
    /// let hour = Policy::new().with_retention(Duration::from_secs(3_600))?;
    /// Ok(IdempotencyLayer::new(pool).with_policy(move |parts, principal| {
    ///     let enterprise = principal.is_some_and(|p| p.as_str().starts_with("ent-"));
    ///     match parts.uri.path() {
    ///         "/payments" if enterprise => month,
    ///         "/cart" => hour,
    ///         _ => Policy::new(),
    ///     }
    /// }))
    /// # }
    /// ```
    ///
    /// The function runs on every guarded request: keep it cheap (no I/O).
    /// Every setting of a policy was checked when it was built.
    #[must_use]
    pub fn with_policy<F>(mut self, f: F) -> Self
    where
        F: Fn(&Parts, Option<&Principal>) -> Policy + Send + Sync + 'static,
    {
        self.config.policy = Some(Arc::new(f));
        self
    }

    /// Request headers whose values are part of "the same request": for
    /// APIs that version by header (`Api-Version`, a `Stripe-Version`
    /// style date), a retry under another version, or without the header,
    /// is then another request (`422`, key reused) rather than a replay of
    /// an answer shaped for the first one. Values count byte for byte, all
    /// of a repeated header in order. The default is none.
    ///
    /// Refused with [`ConfigError::FingerprintHeader`]: credentials and
    /// headers that differ from one attempt to the next by design
    /// (`authorization`, `proxy-authorization`, `cookie`, `idempotency-key`,
    /// `date`, `traceparent`, `tracestate`, `baggage`, `x-request-id`,
    /// `x-correlation-id`, `grpc-timeout`, `user-agent`, `set-cookie`, the
    /// layer's own `idempotent-replayed` and `idempotency-key-expires`, and
    /// the hop-by-hop and framing headers `content-length`,
    /// `transfer-encoding`, `connection`, `te`, `host`).
    #[must_use]
    pub fn with_fingerprint_headers(self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        // Credentials and request-only headers, besides those that
        // describe any attempt (shared with the replay's list).
        const REFUSED: [&str; 7] = [
            "authorization",
            "proxy-authorization",
            "cookie",
            "idempotency-key",
            "grpc-timeout",
            "user-agent",
            "host",
        ];
        let mut names: Vec<HeaderName> = Vec::new();
        let mut refused = None;
        for name in headers {
            if REFUSED.contains(&name.as_str())
                || crate::replay::PER_ATTEMPT_HEADERS.contains(&name.as_str())
            {
                refused.get_or_insert(ConfigError::FingerprintHeader(name));
            } else if !names.contains(&name) {
                names.push(name);
            }
        }
        let names = refused.map_or(Ok(names), Err);
        self.checked(names, |c, names| c.fingerprint_headers = names)
    }

    /// Reads the key from the request body when the request has no
    /// `Idempotency-Key` header (or gRPC `idempotency-key` metadata): for
    /// APIs that carry it in a field of the message, such as Google's
    /// AIP-155 `request_id` ([`protobuf::request_field`](crate::protobuf::request_field),
    /// feature `grpc`). `f` sees the request head and the whole buffered
    /// body (bounded by [`with_max_request_body`](Self::with_max_request_body));
    /// `None` means no key. The key then follows the same rules as the
    /// header's (1 to 255 printable ASCII bytes: anything else is refused as
    /// malformed), and a request with both a header and a field must carry
    /// the same key in each, or it is refused as malformed: one request,
    /// one key. The body is read before the key is known, so a request
    /// without either is refused only after its body is read.
    #[must_use]
    pub fn with_key_from_body<F>(mut self, f: F) -> Self
    where
        F: Fn(&Parts, &bytes::Bytes) -> Option<String> + Send + Sync + 'static,
    {
        self.config.key_from_body = Some(Arc::new(f));
        self
    }

    /// Whether a guarded request without `Idempotency-Key` is refused with
    /// `400` (`true`) or passed through unprotected (`false`). The default is
    /// `true`. A request without a key is never deduplicated by its body:
    /// two identical orders are two orders.
    #[must_use]
    pub fn with_key_required(mut self, required: bool) -> Self {
        self.config.key_required = required;
        self
    }

    /// Which key syntaxes are accepted. The default is [`KeyMode::Lenient`]
    /// (Structured Field String or bare value).
    #[must_use]
    pub fn with_key_mode(mut self, mode: KeyMode) -> Self {
        self.config.key_mode = mode;
        self
    }

    /// Where the principal comes from: a function of the request head that
    /// returns `None` for an unauthenticated request (answered `401`). The
    /// default reads a [`Principal`] from the request extensions.
    #[must_use]
    pub fn with_principal<F>(mut self, f: F) -> Self
    where
        F: Fn(&Parts) -> Option<Principal> + Send + Sync + 'static,
    {
        self.config.principal = Arc::new(f);
        self
    }

    /// Puts every request in one shared principal scope. Only for services
    /// without authentication: any client that guesses a key can then read
    /// the stored answer. The default is per-principal scopes.
    #[must_use]
    pub fn unscoped(self) -> Self {
        self.with_principal(|_| Some(Principal::new("")))
    }

    /// Names the operation explicitly, so renaming a route never changes the
    /// scope. The default is the method and the route:
    ///
    /// - with the layer on an axum route or router (`Router::layer`,
    ///   `MethodRouter::layer`; feature `axum`), the route template, such as
    ///   `POST /orders/{id}/pay`: one operation for every order, told apart
    ///   by the fingerprint, which hashes the (normalized) path;
    /// - with the layer outside the router (`ServiceBuilder` around it, or
    ///   plain hyper), the request path normalized per RFC 3986 §6.2.2
    ///   (unreserved escapes decoded, other escapes upper-cased, dot segments
    ///   removed), so `/orders/abc/pay` and `/orders/%61bc/pay` are one
    ///   operation.
    ///
    /// The name `message` is reserved for message consumers
    /// ([`MESSAGE_OPERATION`](crate::consumer::MESSAGE_OPERATION)): given
    /// here, it is stored as its `sha256:` form, so an HTTP request never
    /// meets a consumer's processed message in the ledger.
    #[must_use]
    pub fn with_operation(mut self, name: impl Into<String>) -> Self {
        self.config.operation = Some(Arc::from(name.into()));
        self
    }

    /// How bodies are normalized before hashing. The default is
    /// [`Normalizer::canonical_json`].
    #[must_use]
    pub fn with_normalizer(mut self, normalizer: Normalizer) -> Self {
        self.config.normalizer = normalizer;
        self
    }

    /// The largest request body buffered, in bytes; larger requests get `413`
    /// without the rest being read. The default is 1 MiB.
    #[must_use]
    pub fn with_max_request_body(self, bytes: usize) -> Self {
        self.checked(nonzero(bytes, "max_request_body"), |c, v| {
            c.max_request_body = v;
        })
    }

    /// The largest response body recorded, in bytes. A larger answer is
    /// never undone for its size: its operation commits with the answer's
    /// status and headers and a mark that the body was not kept; the
    /// client that ran it gets the whole body as it streams (only the first
    /// `bytes` are held while the commit runs), and a retry gets the
    /// recorded status and headers with a `#response-too-large` problem
    /// body in place of the body, never a second run. Set it per route (a
    /// layer per route) for exports and batch answers. The default is
    /// 1 MiB.
    #[must_use]
    pub fn with_max_response_body(self, bytes: usize) -> Self {
        self.checked(nonzero(bytes, "max_response_body"), |c, v| {
            c.max_response_body = v;
        })
    }

    /// How long an answer streamed past the recording limit
    /// ([`with_max_response_body`](Self::with_max_response_body)) may keep
    /// its transaction open. Such an answer commits when its body ends,
    /// and only if it ends well (a gRPC `OK`, an HTTP body that finishes):
    /// its transaction, its connection and the key's lock are held while
    /// it streams. One that streams longer is rolled back and its body
    /// broken off, so the client never takes it for a success. The
    /// default is 60 seconds; zero is refused.
    #[must_use]
    pub fn with_max_stream_hold(self, hold: Duration) -> Self {
        self.checked(nonzero(hold, "max_stream_hold"), |c, v| {
            c.max_stream_hold = v;
        })
    }

    /// How long a key is honoured after its first use, on the database's
    /// clock: retries within it replay, later ones get `410`. Part of your
    /// API contract: publish it. Zero is refused (every retry would be
    /// `410`); more than 10 000 years is that, "forever". The default is
    /// 24 hours. Counted from when the answer is recorded, so a lease-mode
    /// record settled late is replayable for all of it.
    #[must_use]
    pub fn with_retention(self, retention: Duration) -> Self {
        self.checked(nonzero(retention, "retention"), |c, v| c.retention = v)
    }

    /// The longest a request waits, in all, for another request that holds
    /// its key (a duplicate sent while the first still runs) before it is
    /// answered `409` with `Retry-After`. The one bound covers the wait in
    /// this process, the database lock waits of every claim attempt, the
    /// backoff between them and acquiring pooled connections. On SQLite the
    /// connection's `busy_timeout` bounds each database wait instead; on
    /// MySQL lock waits are whole seconds. A gRPC caller's `grpc-timeout`
    /// shortens it to three quarters of the deadline, SQLite's included
    /// (see `docs/grpc.md`). The default is 2 seconds; zero and more
    /// than ten minutes are refused.
    #[must_use]
    pub fn with_in_flight_wait(self, wait: Duration) -> Self {
        let wait = at_most(wait, MAX_WAIT, "in_flight_wait")
            .and_then(|wait| nonzero(wait, "in_flight_wait"));
        self.checked(wait, |c, v| c.in_flight_wait = v)
    }

    /// How many pooled connections requests that wait on another request's
    /// claim may hold at once, per layer. A duplicate that finds them all
    /// taken gets `409` with `Retry-After` at once, so requests with keys
    /// nobody contends always find a connection. A request not yet known to
    /// wait probes a held key for at most 50 ms without a permit. The
    /// default is a quarter of the pool's `max_connections`, at least 1.
    #[must_use]
    pub fn with_max_waiting(self, connections: usize) -> Self {
        self.checked(nonzero(connections, "max_waiting"), |c, v| {
            c.max_waiting = v;
            c.waiters = Arc::new(tokio::sync::Semaphore::new(v));
        })
    }

    /// How many pooled connections one principal's guarded requests may
    /// hold at once (the claim, and the handler's transaction after it),
    /// and how many all principals that hold more than one may hold
    /// together: the share. Fairness between tenants: the layer's guarded
    /// requests take turns at the store's connections in a fair queue.
    ///
    /// - A principal that holds none may take any free connection; one
    ///   that holds one takes another only while fewer than the share are
    ///   held in all. The rest of the pool (the reserve) only ever goes to
    ///   principals' first connections, so one storm, or many together,
    ///   leave it to principals that hold none.
    /// - A connection given back goes to the waiting request whose
    ///   principal holds the fewest, then whose last turn is the oldest,
    ///   then the one that came first.
    /// - A request waits within its in-flight wait, then gets `503`
    ///   (`#store-busy`, with `Retry-After`); at most four times the pool's
    ///   size (at least 64) of one principal's requests wait at once, more
    ///   are refused at once.
    ///
    /// So a principal that holds no connection finds one at once while
    /// fewer principals than the reserve has connections hold one of it
    /// each, and otherwise is first in line for the next one given back.
    /// No connection is taken back from a running handler: when more
    /// principals than the reserve each hold one longer than a calm
    /// tenant's wait, it waits for one of them.
    ///
    /// The default share is all but a quarter of the pool's
    /// `max_connections` (a pool of two or more keeps at least one back);
    /// a share of the pool's size (or more) keeps no reserve, for a
    /// single-tenant service that wants the whole pool for its one
    /// principal. On SQLite every claim holds the one writer until its
    /// commit, so the layer gives one request a turn at a time whatever
    /// the pool's size and this setting, principals in rotation (a calm
    /// tenant waits for the writer's holder and one turn of each principal
    /// already waiting). Duplicates waiting for a request of theirs in
    /// this process hold no connection and take no turn; the queue is per
    /// layer (per process) and counts only the layer's own requests;
    /// lease mode's phases are not counted.
    #[must_use]
    pub fn with_max_per_principal(self, connections: usize) -> Self {
        self.checked(nonzero(connections, "max_per_principal"), |c, v| {
            let capacity = c.principal_slots.capacity();
            c.principal_slots = Arc::new(PrincipalSlots::new(capacity, v));
        })
    }

    /// How many of this layer's requests wait for a turn at the store now
    /// (see [`with_max_per_principal`](Self::with_max_per_principal)); for
    /// tests that judge fairness by events.
    #[cfg(feature = "testkit")]
    #[doc(hidden)]
    pub fn waiting_for_a_turn(&self) -> usize {
        self.config.principal_slots.waiting()
    }

    /// The isolation level of the claimed transaction the handler writes on
    /// (see [`IsolationLevel`]); it applies to that transaction only. The
    /// default is [`IsolationLevel::ReadCommitted`].
    #[must_use]
    pub fn with_isolation_level(mut self, level: IsolationLevel) -> Self {
        self.config.isolation = level;
        self
    }

    /// The bounds on claiming a contested key: at most `attempts` tries, with
    /// jittered backoff between them, all within `deadline` (and within the
    /// in-flight wait, whichever ends first). The default is 3 attempts
    /// within 10 seconds.
    #[must_use]
    pub fn with_claim_retries(self, attempts: u32, deadline: Duration) -> Self {
        let bounds = nonzero(attempts, "claim attempts").and_then(|attempts| {
            let deadline = at_most(deadline, MAX_WAIT, "claim deadline")?;
            Ok((attempts, nonzero(deadline, "claim deadline")?))
        });
        self.checked(bounds, |c, (attempts, deadline)| {
            c.claim_attempts = attempts;
            c.claim_deadline = deadline;
        })
    }

    /// The status for a key reused with a different request: `422` (the IETF
    /// draft) or `409`. The default is `422`.
    #[must_use]
    pub fn with_mismatch_status(self, status: StatusCode) -> Self {
        let status = if status == StatusCode::CONFLICT || status == StatusCode::UNPROCESSABLE_ENTITY
        {
            Ok(status)
        } else {
            Err(ConfigError::MismatchStatus(status))
        };
        self.checked(status, |c, v| c.mismatch_status = v)
    }

    /// Whether replays carry `Idempotent-Replayed: true`. The default is `true`.
    #[must_use]
    pub fn with_replayed_header(mut self, enabled: bool) -> Self {
        self.config.replayed_header = enabled;
        self
    }

    /// The response headers recorded and replayed besides status and body.
    /// The default is the headers that describe the body's representation
    /// (`content-type`, `content-encoding`, `content-language`,
    /// `content-location`) and `location`, so a compressed answer replays
    /// decodable.
    #[must_use]
    pub fn with_recorded_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config.recorded_headers = headers.into_iter().collect();
        self
    }

    /// Stores `sha256:<hex>` of each key instead of the key (keys can carry
    /// personal data). Same guarantees: equal keys hash equal, different keys
    /// do not collide in practice. Switching it on or off changes which
    /// stored rows a key matches, so choose before going live. The default
    /// is `false`.
    #[must_use]
    pub fn with_hashed_keys(mut self, hashed: bool) -> Self {
        self.config.hash_keys = hashed;
        self
    }

    /// Whether a request reads the ledger before claiming. With `false` a
    /// first execution costs no extra read (the claim insert comes first and
    /// a lost claim is explained by one read); with `true` a replay costs a
    /// single read and no transaction, and a first execution one read more.
    /// Choose `true` when retries are a large share of the traffic. Either
    /// way the unique constraint decides. The default is `false`.
    #[must_use]
    pub fn with_read_first(mut self, read_first: bool) -> Self {
        self.config.read_first = read_first;
        self
    }

    /// Lease mode for this layer's routes: for handlers that call the
    /// outside world (a payment provider). The claim commits at once with a
    /// lease and a fencing generation; the handler works through a
    /// [`Leased`](crate::lease::Leased) context in phases and external
    /// steps; a retry after a crash resumes from the last recovery point.
    /// See [`lease`](crate::lease). The default is the single-transaction
    /// mode. `with_in_flight_wait` bounds how long a duplicate waits on a
    /// live lease.
    ///
    /// Lease mode replaces the claim-at-commit mode
    /// ([`with_claim_at_commit`](Self::with_claim_at_commit)) when both
    /// are asked for in this order; the other order is refused.
    #[must_use]
    pub fn with_lease(mut self, mode: LeaseMode) -> Self {
        self.config.lease = Some(mode);
        self.config.claim_at_commit = false;
        self
    }

    /// The claim-at-commit mode: the cheapest guarded first execution, for
    /// handlers whose effects are **all** inside the claimed transaction
    /// (the same handlers the default mode serves; never one that calls
    /// the outside world, for which see [`with_lease`](Self::with_lease)).
    ///
    /// The handler runs at once on a fresh transaction (at the layer's
    /// isolation level), with nothing of the key held; the ledger row is
    /// written just before the `COMMIT`, under the unique constraint on the
    /// scope, so a first execution costs one ledger row and no claim
    /// statement (on PostgreSQL the bare transaction's round trips plus
    /// one). A duplicate that arrives while the first runs, or after it
    /// committed, **loses at the constraint**: its whole transaction,
    /// business writes included, is rolled back, and it is answered the
    /// recorded answer (or the refusals of the decision table: `422` for a
    /// different request, `410` once expired), or, when the first is
    /// still running past the layer's in-flight wait, `409` with
    /// `Retry-After`. Never a second effect. The lost race is quiet where
    /// the store allows it (`ON CONFLICT DO NOTHING` on PostgreSQL and
    /// SQLite; on MySQL/MariaDB a duplicate key, which they do not log).
    ///
    /// # The trade-off
    ///
    /// **A duplicate's handler may run and be undone.** A retry that
    /// reaches another instance runs the handler, whose writes are then
    /// rolled back, unless [`with_read_first`](Self::with_read_first)
    /// reads the ledger first (one read more for every first execution).
    /// Within one layer, duplicates wait for the first, off the pool, and
    /// a retry of a key that finished in this layer (among the last 1024
    /// distinct keys to finish, shared by all principals, kept as hashes:
    /// under 32 KiB) reads the ledger before its handler runs: a replay.
    /// A key that ended with nothing recorded (a rejection, a `5xx`), or a
    /// read that fails, costs that retry one read, and it runs as any
    /// other. Anything the handler does outside the transaction (an email,
    /// a provider call, a message) **would happen twice**: use this mode
    /// only when every effect is a write on the claimed transaction. Two concurrent duplicates also
    /// hold their business rows' locks against each other until one loses
    /// (a deadlock between them is resolved by the database and answered
    /// as a lost race). Final business errors still roll the business
    /// writes back and record `FAILED_FINAL` in the same transaction;
    /// rejections and `5xx` still record nothing.
    ///
    /// A handler that ends the transaction itself is detected as in the
    /// default mode, except on PostgreSQL after a `COMMIT` followed by a
    /// new transaction that writes: the answer is then recorded in that
    /// transaction. The row goes to the ledger table the pool's sessions
    /// find, asked once per layer (as in the default mode): a handler's
    /// `SET LOCAL search_path` never moves it.
    ///
    /// The default is the claim-first mode, which holds the key before the
    /// handler runs (a duplicate never runs it). Refused with
    /// [`ConfigError::ModeConflict`] on a layer in lease mode.
    #[must_use]
    pub fn with_claim_at_commit(self) -> Self {
        let allowed = match self.config.lease {
            Some(_) => Err(ConfigError::ModeConflict {
                asked: "claim at commit",
                set: "lease mode",
            }),
            None => Ok(()),
        };
        self.checked(allowed, |c, ()| c.claim_at_commit = true)
    }

    /// How to link a resource id to its URL, for the `410` answer to an
    /// expired key (`Link: <url>; rel="related"` and a `resource` member),
    /// so the client can look the result up. The default is no link; the
    /// `resource_id` is named either way.
    #[must_use]
    pub fn with_resource_link<F>(mut self, link: F) -> Self
    where
        F: Fn(&str) -> String + Send + Sync + 'static,
    {
        self.config.resource_link = Some(Arc::new(link));
        self
    }
}

/// A quarter of the pool, at least one connection.
fn default_max_waiting(pool_size: u32) -> usize {
    usize::try_from(pool_size / 4).unwrap_or(1).max(1)
}

/// The default turns at the store: the pool's connections (SQLite's one
/// writer where claims take it), a principal's share all but a quarter of
/// them, the quarter (at least one of two or more) kept for principals
/// that hold none.
fn default_turns<DB: Backend>(pool_size: u32) -> PrincipalSlots {
    let capacity = if DB::ONE_WRITER {
        1
    } else {
        usize::try_from(pool_size).unwrap_or(usize::MAX).max(1)
    };
    let reserve = if capacity > 1 {
        (capacity / 4).max(1)
    } else {
        0
    };
    let share = capacity - reserve;
    PrincipalSlots::new(capacity, share)
}

impl<S, DB: Backend> Layer<S> for IdempotencyLayer<DB> {
    type Service = Idempotency<S, DB>;

    /// # Panics
    ///
    /// When a setting given to the layer cannot work (see
    /// [Checked in one place](IdempotencyLayer#checked-in-one-place)):
    /// when the service is built, at start-up, never on a request.
    fn layer(&self, inner: S) -> Self::Service {
        if let Some(e) = &self.invalid {
            panic!("IdempotencyLayer: {e} (IdempotencyLayer::check reports it as an error)");
        }
        Idempotency::new(inner, self.pool.clone(), Arc::new(self.config.clone()))
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use http::header;

    fn layer() -> IdempotencyLayer<sqlx::Sqlite> {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(8)
            .connect_lazy("sqlite::memory:")
            .unwrap();
        IdempotencyLayer::new(pool)
    }

    #[tokio::test]
    async fn settings_that_cannot_work_are_refused() {
        assert_eq!(
            layer().with_retention(Duration::ZERO).check().unwrap_err(),
            ConfigError::Zero("retention")
        );
        assert!(
            layer()
                .with_retention(Duration::from_millis(1))
                .check()
                .is_ok()
        );
        assert!(layer().with_in_flight_wait(Duration::ZERO).check().is_err());
        assert!(layer().with_max_waiting(0).check().is_err());
        assert!(
            layer()
                .with_claim_retries(0, Duration::from_secs(1))
                .check()
                .is_err()
        );
        assert!(
            layer()
                .with_claim_retries(1, Duration::ZERO)
                .check()
                .is_err()
        );
        assert!(layer().with_max_request_body(0).check().is_err());
        assert!(
            layer()
                .with_mismatch_status(StatusCode::OK)
                .check()
                .is_err()
        );
        for refused in [header::AUTHORIZATION, header::COOKIE, header::DATE] {
            assert_eq!(
                layer()
                    .with_fingerprint_headers([refused.clone()])
                    .check()
                    .unwrap_err(),
                ConfigError::FingerprintHeader(refused)
            );
        }
        assert!(
            layer()
                .with_fingerprint_headers([HeaderName::from_static("api-version")])
                .check()
                .is_ok()
        );
        // Waits that become `Instant + d` are bounded: Duration::MAX
        // panicked on every request. (A retention that long is "forever",
        // capped: see `longest_retention_still_records_and_replays`.)
        assert!(matches!(
            layer()
                .with_in_flight_wait(Duration::MAX)
                .check()
                .unwrap_err(),
            ConfigError::TooLong {
                what: "in_flight_wait",
                ..
            }
        ));
        assert!(
            layer()
                .with_claim_retries(3, Duration::MAX)
                .check()
                .is_err()
        );
        // The claim-at-commit mode cannot run in lease mode.
        assert_eq!(
            layer()
                .with_lease(LeaseMode::default())
                .with_claim_at_commit()
                .check()
                .unwrap_err(),
            ConfigError::ModeConflict {
                asked: "claim at commit",
                set: "lease mode"
            }
        );
        assert!(layer().with_claim_at_commit().check().is_ok());
        // The defaults: a quarter of the pool may wait, and the body's
        // representation headers are recorded.
        let l = layer();
        assert_eq!(l.config.max_waiting, 2);
        assert!(
            l.config
                .recorded_headers
                .contains(&header::CONTENT_ENCODING)
        );
    }

    /// A chain keeps its first refused setting, whatever follows, and the
    /// value it refused never replaces the default.
    #[tokio::test]
    async fn a_chain_reports_its_first_refused_setting() {
        let chained = layer()
            .with_retention(Duration::from_secs(60))
            .with_max_request_body(0)
            .with_mismatch_status(StatusCode::OK)
            .with_in_flight_wait(Duration::from_secs(1));
        assert_eq!(chained.config.max_request_body, 1024 * 1024);
        assert_eq!(chained.config.retention, Duration::from_secs(60));
        assert_eq!(
            chained.check().unwrap_err(),
            ConfigError::Zero("max_request_body")
        );
    }

    /// A layer holding a refused setting never serves: it panics when it
    /// wraps a service, naming the setting.
    #[tokio::test]
    #[should_panic(expected = "max_request_body must be greater than zero")]
    async fn a_layer_with_a_refused_setting_panics_when_it_wraps_a_service() {
        let _ = layer().with_max_request_body(0).layer(tower::service_fn(
            |_: http::Request<String>| async {
                Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
            },
        ));
    }
}
