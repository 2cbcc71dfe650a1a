//! The layer's settings, below the request path that reads them.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};

use crate::fingerprint::Normalizer;
use crate::key::KeyMode;
use crate::lease::LeaseMode;
use crate::local::LocalClaims;
use crate::scope::PrincipalFn;
use crate::store::IsolationLevel;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) methods: Vec<Method>,
    /// `None`: every path.
    pub(crate) paths: Option<Vec<String>>,
    pub(crate) key_required: bool,
    pub(crate) key_mode: KeyMode,
    /// Where the key is read from the buffered body when the request has
    /// no `Idempotency-Key` header.
    pub(crate) key_from_body: Option<KeyFromBodyFn>,
    pub(crate) principal: PrincipalFn,
    pub(crate) operation: Option<Arc<str>>,
    pub(crate) normalizer: Normalizer,
    /// Request headers whose values join the fingerprint.
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    /// How long an answer streamed past the recording limit may keep its
    /// transaction open (`with_max_stream_hold`).
    pub(crate) max_stream_hold: Duration,
    pub(crate) retention: Duration,
    pub(crate) in_flight_wait: Duration,
    pub(crate) claim_attempts: u32,
    pub(crate) claim_deadline: Duration,
    pub(crate) mismatch_status: StatusCode,
    pub(crate) replayed_header: bool,
    pub(crate) recorded_headers: Vec<HeaderName>,
    pub(crate) hash_keys: bool,
    pub(crate) local: Arc<LocalClaims>,
    pub(crate) read_first: bool,
    pub(crate) resource_link: Option<ResourceLinkFn>,
    pub(crate) isolation: IsolationLevel,
    /// Whether the pool keeps a statement cache (see
    /// [`caches_statements`](crate::store::caches_statements)).
    pub(crate) cached_statements: bool,
    /// See [`Backend::database`](crate::store::Backend::database).
    pub(crate) database: Option<Arc<str>>,
    /// The claim-at-commit mode's ledger, found once
    /// ([`Backend::find_ledger`](crate::store::Backend::find_ledger)).
    pub(crate) found_ledger: Arc<tokio::sync::OnceCell<Option<Arc<str>>>>,
    /// Whether claims wait for the cluster, found once
    /// ([`Backend::causal_wait`](crate::store::Backend::causal_wait)).
    pub(crate) found_causal_wait: Arc<tokio::sync::OnceCell<bool>>,
    pub(crate) max_waiting: usize,
    /// How many pooled connections each principal's requests may hold,
    /// and the slots they hold now.
    pub(crate) principal_slots: Arc<crate::fairness::PrincipalSlots>,
    pub(crate) waiters: Arc<tokio::sync::Semaphore>,
    pub(crate) lease: Option<LeaseMode>,
    /// The claim-at-commit mode (`with_claim_at_commit`): the ledger row is
    /// written with the `COMMIT`, nothing held while the handler runs.
    pub(crate) claim_at_commit: bool,
    /// Chooses a request's retention and limits (`with_policy`).
    pub(crate) policy: Option<PolicyFn>,
}

pub(crate) type PolicyFn =
    Arc<dyn Fn(&http::request::Parts, Option<&crate::Principal>) -> crate::Policy + Send + Sync>;

pub(crate) type KeyFromBodyFn =
    Arc<dyn Fn(&http::request::Parts, &bytes::Bytes) -> Option<String> + Send + Sync>;

pub(crate) type ResourceLinkFn = Arc<dyn Fn(&str) -> String + Send + Sync>;

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("methods", &self.methods)
            .field("paths", &self.paths)
            .field("key_required", &self.key_required)
            .field("key_mode", &self.key_mode)
            .field("key_from_body", &self.key_from_body.is_some())
            .field("operation", &self.operation)
            .field("normalizer", &self.normalizer)
            .field("fingerprint_headers", &self.fingerprint_headers)
            .field("max_request_body", &self.max_request_body)
            .field("max_response_body", &self.max_response_body)
            .field("retention", &self.retention)
            .field("in_flight_wait", &self.in_flight_wait)
            .field("claim_attempts", &self.claim_attempts)
            .field("claim_deadline", &self.claim_deadline)
            .field("mismatch_status", &self.mismatch_status)
            .field("replayed_header", &self.replayed_header)
            .field("recorded_headers", &self.recorded_headers)
            .field("hash_keys", &self.hash_keys)
            .field("read_first", &self.read_first)
            .field("isolation", &self.isolation)
            .field("max_waiting", &self.max_waiting)
            .field("max_per_principal", &self.principal_slots.per_principal())
            .field("lease", &self.lease)
            .field("claim_at_commit", &self.claim_at_commit)
            .field("policy", &self.policy.is_some())
            .finish_non_exhaustive()
    }
}

impl Config {
    /// What every ledger statement of a claim names: the ledger found once
    /// ([`Backend::find_ledger`](crate::store::Backend::find_ledger)), or
    /// the pool's database.
    pub(crate) fn ledger(&self) -> Option<&str> {
        match self.found_ledger.get() {
            Some(Some(found)) => Some(found),
            _ => self.database.as_deref(),
        }
    }

    /// Whether a claim waits for the cluster: as found once
    /// ([`Backend::causal_wait`](crate::store::Backend::causal_wait)), and
    /// until then, or where nothing was asked, yes.
    pub(crate) fn causal_wait(&self) -> bool {
        self.found_causal_wait.get().copied().unwrap_or(true)
    }

    pub(crate) fn guards(&self, method: &Method, path: &str) -> bool {
        self.methods.contains(method)
            && self
                .paths
                .as_ref()
                .is_none_or(|paths| paths.iter().any(|p| p == path))
    }
}

/// The longest wait a request may be held for (a duplicate's in-flight
/// wait, the claim deadline): ten minutes.
pub(crate) const MAX_WAIT: Duration = Duration::from_secs(10 * 60);
