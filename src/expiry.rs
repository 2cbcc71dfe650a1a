//! Retention: how long a key keeps meaning "this request".
//!
//! Every claim stores `expires_at = claim time + retention` (the layer's
//! [`with_retention`](crate::IdempotencyLayer::with_retention), 24 hours by
//! default), both taken from the **database's clock**, as is every later
//! expiry decision and the sweeper's `now`: application instances whose
//! clocks disagree still agree on when a key expires. Until then a retry with the key replays the stored answer. From
//! then on the key is refused with `410 Gone` and never executed again, the
//! same whether or not a sweeper has already turned the row into an
//! `EXPIRED` tombstone, so behaviour never depends on sweeper timing. A client
//! that wants to order again sends a new key.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use sqlx::Pool;

use crate::store::{Backend, Record, RecordStatus};

/// The default retention of a key: 24 hours.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// A duration in whole milliseconds, saturating.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The longest retention (of a key, a processed message id or a
/// tombstone) applied: 10 000 years, "forever". Every store computes
/// `now + retention` and later `expires_at + tombstone retention` in a
/// signed 64-bit column: capped here, both fit with room to spare.
pub(crate) const MAX_RETENTION_MS: i64 = 10_000 * 366 * 24 * 3600 * 1000;

/// A retention in whole milliseconds, capped at [`MAX_RETENTION_MS`]: the
/// one conversion of every retention that becomes SQL arithmetic.
pub(crate) fn retention_ms(d: Duration) -> i64 {
    millis(d).min(MAX_RETENTION_MS)
}

/// A tombstone, or a terminal row whose retention has ended on the
/// database's clock.
pub(crate) fn is_expired(record: &Record) -> bool {
    record.status == RecordStatus::Expired || (record.status.is_terminal() && record.past_expiry)
}

pub use crate::replay::IDEMPOTENCY_KEY_EXPIRES;

/// The default time a tombstone is kept after its key expired: 90 days.
pub const DEFAULT_TOMBSTONE_RETENTION: Duration = Duration::from_secs(90 * 24 * 60 * 60);

/// Turns expired ledger rows into tombstones and, much later, deletes them.
///
/// - A terminal row (`SUCCEEDED`, `FAILED_FINAL`) past its `expires_at`
///   becomes an `EXPIRED` tombstone: the response is dropped; the scope,
///   fingerprint and resource id stay, so the key is still refused (`410`).
/// - A tombstone is deleted once the tombstone retention (90 days by
///   default) has passed since its key expired: the sweep that makes the
///   tombstone moves its `expires_at` to that purge time. Only then may the
///   key be used again, as a new request: keep it longer than any client
///   could retry.
/// - `PROCESSING` and `NEEDS_RECONCILIATION` rows are never touched by
///   time alone.
///
/// Work is done in batches of one short statement each (1 000 rows by
/// default, 10 ms apart) through the expiry index, so a sweep never holds
/// long locks and claims run between batches.
#[derive(Debug, Clone)]
pub struct Sweeper<DB: Backend> {
    pool: Pool<DB>,
    batch_size: i64,
    max_batches: u32,
    pause: Duration,
    tombstone_retention: Duration,
    stranded_after: Duration,
}

/// What one sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Terminal rows turned into tombstones.
    pub expired: u64,
    /// Tombstones deleted.
    pub purged: u64,
    /// Statements run.
    pub batches: u32,
}

impl<DB: Backend> Sweeper<DB> {
    /// A sweeper for the ledger in `pool`.
    pub fn new(pool: Pool<DB>) -> Self {
        Self {
            pool,
            batch_size: 1000,
            max_batches: 10_000,
            pause: Duration::from_millis(10),
            tombstone_retention: DEFAULT_TOMBSTONE_RETENTION,
            stranded_after: crate::DEFAULT_STRANDED_AFTER,
        }
    }

    /// Rows per statement. The default is 1 000.
    #[must_use]
    pub fn with_batch_size(mut self, rows: u32) -> Self {
        self.batch_size = i64::from(rows.max(1));
        self
    }

    /// The most statements one sweep runs; the rest waits for the next
    /// sweep. The default is 10 000.
    #[must_use]
    pub fn with_max_batches(mut self, batches: u32) -> Self {
        self.max_batches = batches.max(1);
        self
    }

    /// The pause between two statements of a sweep, which leaves room for
    /// claims on single-writer stores (SQLite). The default is 10 ms.
    #[must_use]
    pub fn with_pause(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// How long tombstones are kept after their key expired. The default
    /// is [`DEFAULT_TOMBSTONE_RETENTION`] (90 days). It is fixed for each
    /// tombstone when a sweep makes it (its `expires_at` moves to the time
    /// it may be purged).
    #[must_use]
    pub fn with_tombstone_retention(mut self, retention: Duration) -> Self {
        self.tombstone_retention = retention;
        self
    }

    /// The stranded age the unresolved-records gauges count with (feature
    /// `metrics`), as [`Reconciler::with_stranded_after`](crate::Reconciler::with_stranded_after):
    /// set it to what the operators' listing uses. The default is
    /// [`DEFAULT_STRANDED_AFTER`](crate::DEFAULT_STRANDED_AFTER).
    #[must_use]
    pub fn with_stranded_after(mut self, age: Duration) -> Self {
        self.stranded_after = age;
        self
    }

    /// Sweeps now, by the database's clock.
    pub async fn sweep(&self) -> Result<SweepReport, sqlx::Error> {
        self.sweep_until(None).await
    }

    /// Sweeps as if the time were `now` (for operators catching up, and for
    /// tests that control time instead of sleeping).
    pub async fn sweep_at(&self, now: SystemTime) -> Result<SweepReport, sqlx::Error> {
        let now = millis(now.duration_since(UNIX_EPOCH).unwrap_or_default());
        self.sweep_until(Some(now)).await
    }

    async fn sweep_until(&self, now: Option<i64>) -> Result<SweepReport, sqlx::Error> {
        // Capped at 10 000 years, so `expires_at + keep` fits the column.
        let keep = retention_ms(self.tombstone_retention);
        let mut report = SweepReport::default();
        // Expire first, then purge; each phase until a short batch.
        for expiring in [true, false] {
            while report.batches < self.max_batches {
                report.batches += 1;
                let n = if expiring {
                    let n = DB::expire_batch(&self.pool, now, keep, self.batch_size).await?;
                    report.expired += n;
                    n
                } else {
                    let n = DB::purge_batch(&self.pool, now, self.batch_size).await?;
                    report.purged += n;
                    n
                };
                if n < self.batch_size as u64 {
                    break;
                }
                tokio::time::sleep(self.pause).await;
            }
        }
        #[cfg(feature = "metrics")]
        crate::observe::unresolved_gauges(&self.pool, millis(self.stranded_after)).await;
        Ok(report)
    }

    /// Runs [`sweep`](Self::sweep) every `interval` on the tokio runtime
    /// until the returned handle is aborted. A failed sweep is retried at
    /// the next tick.
    pub fn spawn(self, interval: Duration) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let _ = self.sweep().await;
            }
        })
    }
}

/// The header that tells the client until when its key is honoured.
pub(crate) fn expiry_header(expires_at: i64) -> Option<HeaderValue> {
    // The date's own buffer becomes the value's (`from_str` copied it).
    HeaderValue::from_maybe_shared(Bytes::from(http_date(expires_at))).ok()
}

/// Tells the client until when its key is honoured.
pub(crate) fn add_expiry(headers: &mut HeaderMap, expires_at: i64) {
    if let Some(value) = expiry_header(expires_at) {
        headers.insert(EXPIRES, value);
    }
}

/// The `Idempotency-Key-Expires` header's name, checked when the crate
/// is built (inserting the `&str` copied it on every answer).
pub(crate) const EXPIRES: HeaderName = HeaderName::from_static(IDEMPOTENCY_KEY_EXPIRES);

/// Formats epoch milliseconds as an HTTP-date (IMF-fixdate, RFC 9110 §5.6.7).
pub(crate) fn http_date(epoch_ms: i64) -> String {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let secs = epoch_ms.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month = MONTHS[(month - 1) as usize];
    if !(1000..=9999).contains(&year) {
        return format!(
            "{weekday}, {day:02} {month} {year} {:02}:{:02}:{:02} GMT",
            rem / 3600,
            rem % 3600 / 60,
            rem % 60
        );
    }
    // Every date a key can expire at: written digit by digit into its
    // exact length (this runs for every recorded answer).
    fn digits(out: &mut String, n: i64, width: u32) {
        for place in (0..width).rev() {
            out.push(char::from(b'0' + (n / 10_i64.pow(place) % 10) as u8));
        }
    }
    let mut out = String::with_capacity(29);
    out.push_str(weekday);
    out.push_str(", ");
    digits(&mut out, day, 2);
    out.push(' ');
    out.push_str(month);
    out.push(' ');
    digits(&mut out, year, 4);
    out.push(' ');
    digits(&mut out, rem / 3600, 2);
    out.push(':');
    digits(&mut out, rem % 3600 / 60, 2);
    out.push(':');
    digits(&mut out, rem % 60, 2);
    out.push_str(" GMT");
    out
}

/// Parses an HTTP-date (RFC 9110 §5.6.7) into epoch milliseconds: the
/// IMF-fixdate every sender must use (`Sun, 06 Nov 1994 08:49:37 GMT`), and
/// the two obsolete forms a recipient must accept, RFC 850
/// (`Sunday, 06-Nov-94 08:49:37 GMT`) and asctime
/// (`Sun Nov  6 08:49:37 1994`); `None` otherwise.
#[cfg_attr(not(feature = "client"), allow(dead_code))]
pub(crate) fn parse_http_date(s: &str) -> Option<i64> {
    let (day, month, year, time) = if let Some(rest) = s.strip_suffix(" GMT") {
        let (_, date) = rest.split_once(", ")?;
        let mut parts = date.split(' ');
        let first = parts.next()?;
        if !first.contains('-') {
            // IMF-fixdate: `06 Nov 1994 08:49:37`.
            let (month, year, time) = (parts.next()?, parts.next()?, parts.next()?);
            if parts.next().is_some() || first.len() != 2 || year.len() != 4 {
                return None;
            }
            (first, month, digits(year)?, time)
        } else {
            // RFC 850: `06-Nov-94 08:49:37`, a two-digit year.
            let time = parts.next()?;
            let mut dmy = first.split('-');
            let (day, month, yy) = (dmy.next()?, dmy.next()?, dmy.next()?);
            if parts.next().is_some() || dmy.next().is_some() || yy.len() != 2 || day.len() != 2 {
                return None;
            }
            let yy = digits(yy)?;
            // RFC 9110: a year more than 50 years ahead is in the past;
            // from here, 70 and later are the 1900s.
            let year = if yy >= 70 { 1900 + yy } else { 2000 + yy };
            (day, month, year, time)
        }
    } else {
        // asctime: `Sun Nov  6 08:49:37 1994`.
        let mut parts = s.split_whitespace();
        let (_, month, day, time, year) = (
            parts.next()?,
            parts.next()?,
            parts.next()?,
            parts.next()?,
            parts.next()?,
        );
        if parts.next().is_some() || year.len() != 4 || day.is_empty() || day.len() > 2 {
            return None;
        }
        (day, month, digits(year)?, time)
    };
    civil_ms(digits(day)?, month, year, time)
}

/// A run of ASCII digits as a number.
fn digits(t: &str) -> Option<i64> {
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    t.parse().ok()
}

/// Epoch milliseconds of a civil date and `HH:MM:SS` time, UTC.
fn civil_ms(day: i64, month: &str, year: i64, time: &str) -> Option<i64> {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let month = i64::try_from(MONTHS.iter().position(|m| *m == month)? + 1).ok()?;
    if time.len() != 8 {
        return None;
    }
    let mut hms = time.split(':');
    let (h, m, sec) = (
        digits(hms.next()?)?,
        digits(hms.next()?)?,
        digits(hms.next()?)?,
    );
    if hms.next().is_some() || !(1..=31).contains(&day) || h > 23 || m > 59 || sec > 60 {
        return None;
    }
    // Days since 1970-01-01 from a civil date (H. Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + h * 3600 + m * 60 + sec) * 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_dates_parse_back() {
        for ms in [0, 784_111_777_000, 1_795_963_187_000, 951_782_400_000] {
            assert_eq!(parse_http_date(&http_date(ms)), Some(ms));
        }
        // The obsolete forms a recipient must accept.
        assert_eq!(
            parse_http_date("Sunday, 06-Nov-94 08:49:37 GMT"),
            Some(784_111_777_000)
        );
        assert_eq!(
            parse_http_date("Sun Nov  6 08:49:37 1994"),
            Some(784_111_777_000)
        );
        assert_eq!(parse_http_date("Sunday, 06-Nov-1994 08:49:37 GMT"), None);
        assert_eq!(parse_http_date("Sun, 06 Nov 1994 08:49:37"), None);
        assert_eq!(parse_http_date("Sun, 06 Foo 1994 08:49:37 GMT"), None);
        assert_eq!(parse_http_date("Sun, +6 Nov 1994 08:49:37 GMT"), None);
    }

    #[test]
    fn http_dates() {
        assert_eq!(http_date(0), "Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(http_date(784_111_777_000), "Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(
            http_date(1_795_963_187_878),
            "Sun, 29 Nov 2026 14:39:47 GMT"
        );
        assert_eq!(http_date(951_782_400_000), "Tue, 29 Feb 2000 00:00:00 GMT");
        // Years of fewer or more than four digits, written as they are.
        assert_eq!(
            http_date(-30_641_760_000_000),
            "Tue, 01 Jan 999 00:00:00 GMT"
        );
        assert_eq!(
            http_date(253_402_300_800_000),
            "Sat, 01 Jan 10000 00:00:00 GMT"
        );
        // Digit by digit, every field: each second of a day, each day of
        // four centuries, parsed back.
        for ms in (0..86_400_000)
            .step_by(1000)
            .chain((-10_000_i64..136_000).map(|day| day * 86_400_000 + 45_296_000))
        {
            assert_eq!(parse_http_date(&http_date(ms)), Some(ms), "{ms}");
        }
    }
}
