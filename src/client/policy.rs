//! Which answers are worth another attempt with the same key, and how long
//! to wait before it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, StatusCode, header};

use crate::expiry::parse_http_date;
use crate::problem::ProblemKind;

/// What to do with one attempt's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Final: hand it to the caller.
    Final,
    /// Worth another attempt with the same key, after at least this long
    /// (the server's `Retry-After`, when it sent one).
    Retry(Option<Duration>),
}

/// The problem types (this crate's server layer) a `409` may be retried on:
/// the key's first request is still running, its record could not be read,
/// or the attempt lost its lease to a later one. Any other `409` (a
/// business conflict such as out-of-stock) is final.
const RETRYABLE_CONFLICTS: [ProblemKind; 3] = [
    ProblemKind::InFlight,
    ProblemKind::Unconfirmed,
    ProblemKind::LeaseLost,
];

/// Whether the answer is a problem document (RFC 9457).
pub(crate) fn is_problem(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/problem+json"))
}

/// Whether a `409`'s problem document says "retry with the same key".
pub(crate) fn retryable_conflict(headers: &HeaderMap, body: &[u8]) -> bool {
    if !is_problem(headers) {
        return false;
    }
    let Ok(doc) = serde_json::from_slice::<serde_json::Value>(body) else {
        return false;
    };
    let Some(kind) = doc.get("type").and_then(|t| t.as_str()) else {
        return false;
    };
    RETRYABLE_CONFLICTS.iter().any(|k| k.type_uri() == kind)
}

/// The verdict on an answer by its status alone (`409` needs its body:
/// see [`retryable_conflict`]).
pub(crate) fn by_status(status: StatusCode, headers: &HeaderMap) -> Verdict {
    if status == StatusCode::OK
        && let Some(code) = grpc_status(headers)
    {
        // A trailers-only gRPC answer (this crate's refusals, and any
        // unary error tonic sends before a message): UNAVAILABLE is retried,
        // honouring `grpc-retry-pushback-ms` (a negative value: not retried,
        // as gRPC's own retry policy reads it); any other code is final.
        return match (code, grpc_pushback(headers)) {
            (GRPC_UNAVAILABLE, Some(Err(()))) => Verdict::Final,
            (GRPC_UNAVAILABLE, Some(Ok(wait))) => Verdict::Retry(Some(wait)),
            (GRPC_UNAVAILABLE, None) => Verdict::Retry(None),
            _ => Verdict::Final,
        };
    }
    match status.as_u16() {
        // Too many requests, and the gateway or service is unavailable:
        // the request may not have run, or may have; the key makes a retry
        // safe either way.
        429 | 502 | 503 | 504 => Verdict::Retry(retry_after(headers)),
        _ => Verdict::Final,
    }
}

/// `Retry-After` as delay-seconds or an HTTP-date, from now.
/// gRPC's `UNAVAILABLE`.
const GRPC_UNAVAILABLE: u32 = 14;

/// The `grpc-status` of a gRPC answer's headers (a trailers-only answer).
fn grpc_status(headers: &HeaderMap) -> Option<u32> {
    let is_grpc = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"));
    if !is_grpc {
        return None;
    }
    headers.get("grpc-status")?.to_str().ok()?.parse().ok()
}

/// `grpc-retry-pushback-ms`: `Ok(wait)`, or `Err(())` for a negative value
/// (the server asks not to retry).
fn grpc_pushback(headers: &HeaderMap) -> Option<Result<Duration, ()>> {
    let ms: i64 = headers
        .get("grpc-retry-pushback-ms")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(u64::try_from(ms).map(Duration::from_millis).map_err(drop))
}

pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = parse_http_date(value)?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .ok()?
        .as_millis();
    let ms = u64::try_from(i128::from(at) - i128::try_from(now).ok()?).unwrap_or(0);
    Some(Duration::from_millis(ms))
}

/// Exponential backoff with full jitter: a uniformly random wait below
/// `base · 2^(retry − 1)`, capped at `cap`.
pub(crate) fn full_jitter(retry: u32, base: Duration, cap: Duration) -> Duration {
    let ceiling = base
        .saturating_mul(1u32 << retry.saturating_sub(1).min(20))
        .min(cap);
    let ms = u64::try_from(ceiling.as_millis()).unwrap_or(u64::MAX);
    Duration::from_millis(crate::random::random_below(ms.saturating_add(1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn conflicts_are_told_apart_by_problem_type() {
        let problem = headers(&[("content-type", "application/problem+json")]);
        let doc = |kind: ProblemKind| format!(r#"{{"type":"{}"}}"#, kind.type_uri());
        assert!(retryable_conflict(
            &problem,
            doc(ProblemKind::InFlight).as_bytes()
        ));
        assert!(retryable_conflict(
            &problem,
            doc(ProblemKind::LeaseLost).as_bytes()
        ));
        assert!(!retryable_conflict(
            &problem,
            doc(ProblemKind::KeyReused).as_bytes()
        ));
        assert!(!retryable_conflict(
            &problem,
            br#"{"type":"https://example.test/problems/out-of-stock"}"#
        ));
        let json = headers(&[("content-type", "application/json")]);
        assert!(!retryable_conflict(
            &json,
            doc(ProblemKind::InFlight).as_bytes()
        ));
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        assert_eq!(
            retry_after(&headers(&[("retry-after", "7")])),
            Some(Duration::from_secs(7))
        );
        let soon = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
            + 5_000;
        let date = crate::expiry::http_date(soon);
        let wait = retry_after(&headers(&[("retry-after", &date)])).unwrap();
        assert!(
            wait <= Duration::from_secs(5) && wait >= Duration::from_secs(3),
            "{wait:?}"
        );
        assert_eq!(
            retry_after(&headers(&[(
                "retry-after",
                "Thu, 01 Jan 1970 00:00:00 GMT"
            )])),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after(&headers(&[("retry-after", "soon")])), None);
    }

    #[test]
    fn grpc_unavailable_is_retried_with_its_pushback() {
        let grpc = |pairs: &[(&'static str, &str)]| {
            let mut h = headers(&[("content-type", "application/grpc")]);
            h.extend(headers(pairs));
            h
        };
        let ok = StatusCode::OK;
        assert_eq!(
            by_status(ok, &grpc(&[("grpc-status", "14")])),
            Verdict::Retry(None)
        );
        assert_eq!(
            by_status(
                ok,
                &grpc(&[("grpc-status", "14"), ("grpc-retry-pushback-ms", "250")])
            ),
            Verdict::Retry(Some(Duration::from_millis(250)))
        );
        assert_eq!(
            by_status(
                ok,
                &grpc(&[("grpc-status", "14"), ("grpc-retry-pushback-ms", "-1")])
            ),
            Verdict::Final
        );
        for code in ["0", "3", "9", "13", "4"] {
            assert_eq!(
                by_status(ok, &grpc(&[("grpc-status", code)])),
                Verdict::Final
            );
        }
        // Not gRPC: a 200 is final whatever its headers say.
        assert_eq!(
            by_status(ok, &headers(&[("grpc-status", "14")])),
            Verdict::Final
        );
    }

    #[test]
    fn statuses() {
        let none = HeaderMap::new();
        for s in [429, 502, 503, 504] {
            assert_eq!(
                by_status(StatusCode::from_u16(s).unwrap(), &none),
                Verdict::Retry(None)
            );
        }
        for s in [200, 201, 400, 402, 404, 409, 410, 422, 500] {
            assert_eq!(
                by_status(StatusCode::from_u16(s).unwrap(), &none),
                Verdict::Final
            );
        }
    }

    #[test]
    fn jitter_stays_under_its_ceiling() {
        let base = Duration::from_millis(100);
        let cap = Duration::from_secs(2);
        for retry in 1..30 {
            let ceiling = (base * 2u32.pow((retry - 1).min(20))).min(cap);
            assert!(full_jitter(retry, base, cap) <= ceiling);
        }
    }
}
