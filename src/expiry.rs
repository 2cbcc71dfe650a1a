//! Retention: how long a key keeps meaning "this request".
//!
//! Every claim stores `expires_at = claim time + retention` (the layer's
//! [`with_retention`](crate::IdempotencyLayer::with_retention), 24 hours by
//! default). Until then a retry with the key replays the stored answer. From
//! then on the key is refused with `410 Gone` and never executed again, the
//! same whether or not a sweeper has already turned the row into an
//! `EXPIRED` tombstone, so behaviour never depends on sweeper timing. A client
//! that wants to order again sends a new key.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::store::{Record, RecordStatus};

/// The default retention of a key: 24 hours.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// Now, in Unix epoch milliseconds (the unit of the ledger's time columns).
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// `now + retention`, in epoch milliseconds, saturating.
pub(crate) fn expires_at(now: i64, retention: Duration) -> i64 {
    now.saturating_add(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX))
}

/// A tombstone, or a terminal row whose retention has ended.
pub(crate) fn is_expired(record: &Record, now: i64) -> bool {
    record.status == RecordStatus::Expired
        || (record.status.is_terminal() && now >= record.expires_at)
}
