//! What the layer tells operators: a `tracing` span per guarded request and,
//! with the `metrics` feature, counters and a claim-latency histogram.
//!
//! Span `idempotency` (level INFO) with fields `operation`, `key_hash` (the
//! first 8 bytes of SHA-256 of the key, hex: keys can carry personal data and
//! are never logged raw), `outcome`, `claim_ms`, `handler_ms`, `commit_ms`.
//! One event closes each guarded request: DEBUG for the expected outcomes,
//! WARN for store failures, unconfirmed commits and held transactions,
//! ERROR for a handler that ended the claimed transaction itself.
//! Request and response bodies are never logged.
//!
//! Metrics (feature `metrics`, through the `metrics` facade):
//! `idempotency_requests_total{outcome}` and the histogram
//! `idempotency_claim_seconds` (time from the first ledger read to an owned
//! claim or a settled answer). Outcome labels are [`IdempotencyOutcome::label`].
//!
//! Gauges (feature `metrics`), refreshed at the end of every
//! [`Sweeper`](crate::Sweeper) pass, so an alert can fire before a
//! customer calls: `idempotency_unresolved_records` (how many records the
//! operators' listing holds: parked, and stranded with the default
//! stranded age) and `idempotency_unresolved_oldest_age_seconds` (the
//! oldest one's age on the database clock; 0 when there is none). One
//! counting statement per pass; a failed count leaves the gauges as they
//! were and is logged at WARN.

use std::time::Duration;

use sha2::{Digest, Sha256};
use tracing::Span;

use crate::outcome::IdempotencyOutcome;

/// The span a guarded request runs in.
pub(crate) fn span() -> Span {
    tracing::info_span!(
        "idempotency",
        operation = tracing::field::Empty,
        key_hash = tracing::field::Empty,
        outcome = tracing::field::Empty,
        claim_ms = tracing::field::Empty,
        handler_ms = tracing::field::Empty,
        commit_ms = tracing::field::Empty,
    )
}

/// Names the scope on the current span, with the key hashed; nothing is
/// hashed or formatted when no subscriber takes the span.
pub(crate) fn scope(operation: &str, key: &str) {
    let span = Span::current();
    if span.is_disabled() {
        return;
    }
    let digest = Sha256::digest(key.as_bytes());
    let hash = u64::from_be_bytes(digest[..8].try_into().unwrap_or_default());
    span.record("operation", operation);
    span.record("key_hash", format!("{hash:016x}").as_str());
}

/// Records a phase's duration on the current span.
pub(crate) fn timing(field: &'static str, took: Duration) {
    Span::current().record(field, took.as_secs_f64() * 1000.0);
    #[cfg(feature = "metrics")]
    if field == "claim_ms" {
        metrics::histogram!("idempotency_claim_seconds").record(took.as_secs_f64());
    }
}

/// Refreshes the unresolved-records gauges from the ledger in `pool`,
/// counting lapsed leases as stranded after `stranded_ms`.
#[cfg(feature = "metrics")]
pub(crate) async fn unresolved_gauges<DB: crate::Backend>(pool: &sqlx::Pool<DB>, stranded_ms: i64) {
    match DB::count_unresolved(pool, stranded_ms).await {
        Ok((count, oldest, now)) => {
            metrics::gauge!("idempotency_unresolved_records").set(count as f64);
            let age_ms = oldest.map_or(0, |t| now.saturating_sub(t).max(0));
            metrics::gauge!("idempotency_unresolved_oldest_age_seconds")
                .set(age_ms as f64 / 1000.0);
        }
        Err(e) => tracing::warn!(error = %e, "could not count the unresolved records"),
    }
}

/// Counts one message delivery by what became of it
/// (`idempotency_messages_total{outcome}`, with the `metrics` feature).
pub(crate) fn message(outcome: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_messages_total", "outcome" => outcome).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = outcome;
}

/// Closes a guarded request: outcome on the span, one event, one count.
pub(crate) fn finish(outcome: Option<&IdempotencyOutcome>) {
    let label = outcome.map_or("error", IdempotencyOutcome::label);
    Span::current().record("outcome", label);
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_requests_total", "outcome" => label).increment(1);
    match label {
        "transaction-ended" => {
            tracing::error!(
                outcome = label,
                "the handler ended the claimed transaction itself; the key needs reconciliation"
            )
        }
        "store-unavailable" | "store-busy" | "commit-unknown" | "error" => {
            tracing::warn!(outcome = label, "idempotent request not settled")
        }
        "transient-rollback" => tracing::debug!(outcome = label, "idempotent request rolled back"),
        _ => tracing::debug!(outcome = label, "idempotent request finished"),
    }
}
