//! gRPC's side of the boundary: a gRPC request (`content-type:
//! application/grpc…`) gets the layer's own refusals as trailers-only gRPC
//! answers (HTTP `200`, `grpc-status` in the headers, no message), so a
//! gRPC client sees a status it understands and gRPC's retry policy can act
//! on it. The key is the `idempotency-key` metadata entry (the same header,
//! the same syntax rules).
//!
//! | refusal | `grpc-status` | also |
//! |---|---|---|
//! | missing or malformed key, invalid or oversized request | `INVALID_ARGUMENT` (3) | |
//! | no principal | `UNAUTHENTICATED` (16) | |
//! | key reused with another request | `FAILED_PRECONDITION` (9) | `google.rpc.ErrorInfo` reason `IDEMPOTENCY_KEY_REUSED` |
//! | key expired | `FAILED_PRECONDITION` (9) | `google.rpc.ErrorInfo` reason `IDEMPOTENCY_KEY_EXPIRED` |
//! | still in flight, store unavailable or busy, a conflict, a commit of unknown outcome, a key being reconciled, a lease lost | `UNAVAILABLE` (14) | `grpc-retry-pushback-ms` from the refusal's `Retry-After` |
//! | the handler misused the transaction or lease mode, an unreadable answer | `INTERNAL` (13) | |
//! | a replay of an answer over the recording limit (the call happened; its message was not kept) | `ALREADY_EXISTS` (6) | `google.rpc.ErrorInfo` reason `IDEMPOTENCY_RESPONSE_NOT_KEPT`, the recorded metadata |
//!
//! A refusal that names a resource (an expired key's `Link`, with
//! `IdempotencyLayer::with_resource_link`) keeps that header as metadata.
//!
//! A gRPC caller's `grpc-timeout` also bounds everything the layer does
//! for it (within the layer's own bound, see
//! `IdempotencyLayer::with_in_flight_wait`): the wait for an in-flight
//! duplicate, the claim and every store read end by three quarters of the
//! deadline, so the layer's `UNAVAILABLE` reaches the caller before tonic's
//! `CANCELLED` would; a deadline that leaves less than 1 ms is answered
//! `UNAVAILABLE` at once, and nothing runs.
//!
//! `grpc-message` names the problem's `type` fragment and title; the
//! `ErrorInfo` travels in `grpc-status-details-bin` (a `google.rpc.Status`,
//! domain `tower-idempotency`).

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, header};

use crate::body::IdempotencyBody;
#[cfg(test)]
use crate::classify::is_grpc;
use crate::outcome::IdempotencyOutcome;
use crate::problem::ProblemKind;

pub(crate) mod status;

use status::trailers_only;

/// The caller's deadline from `grpc-timeout` (1 to 8 digits and a unit:
/// `H`, `M`, `S`, `m`, `u`, `n`). A request waits for an in-flight
/// duplicate no longer than this, nor than the layer's own bound.
pub(crate) fn timeout(headers: &HeaderMap) -> Option<std::time::Duration> {
    use std::time::Duration;
    let v = headers.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The gRPC status code of a refusal.
fn code(kind: ProblemKind) -> u32 {
    match kind {
        ProblemKind::MissingKey
        | ProblemKind::MalformedKey
        | ProblemKind::BodyTooLarge
        | ProblemKind::InvalidBody => 3,
        ProblemKind::MissingPrincipal => 16,
        ProblemKind::KeyReused | ProblemKind::Expired => 9,
        ProblemKind::InFlight
        | ProblemKind::Unconfirmed
        | ProblemKind::CommitUnknown
        | ProblemKind::StoreUnavailable
        | ProblemKind::StoreBusy
        | ProblemKind::TransactionConflict
        | ProblemKind::Reconciling
        | ProblemKind::LeaseLost => 14,
        _ => 13,
    }
}

/// The `ErrorInfo` reason of a refusal, where a client acts on it.
fn reason(kind: ProblemKind) -> Option<&'static str> {
    match kind {
        ProblemKind::KeyReused => Some("IDEMPOTENCY_KEY_REUSED"),
        ProblemKind::Expired => Some("IDEMPOTENCY_KEY_EXPIRED"),
        _ => None,
    }
}

/// The layer's refusal `res` as a trailers-only gRPC answer; any other
/// answer as it is.
pub(crate) fn refusal<B>(res: Response<IdempotencyBody<B>>) -> Response<IdempotencyBody<B>> {
    let Some(&IdempotencyOutcome::Refused { problem, attempts }) = res.extensions().get() else {
        return res;
    };
    let pushback = res
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let code = code(problem);
    let message = format!("{}: {}", problem.slug(), problem.title());
    let mut out = Response::new(IdempotencyBody::buffered(Bytes::new()));
    let headers = out.headers_mut();
    trailers_only(headers, code, &message, reason(problem));
    if let Some(link) = res.headers().get(header::LINK) {
        headers.insert(header::LINK, link.clone());
    }
    if let (14, Some(secs)) = (code, pushback) {
        headers.insert(
            "grpc-retry-pushback-ms",
            HeaderValue::from(secs.saturating_mul(1000)),
        );
    }
    out.extensions_mut()
        .insert(IdempotencyOutcome::Refused { problem, attempts });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expired_refusal_keeps_its_link() {
        let mut res: Response<IdempotencyBody<http_body_util::Empty<Bytes>>> =
            Response::new(IdempotencyBody::buffered(Bytes::from_static(b"{}")));
        res.headers_mut().insert(
            header::LINK,
            HeaderValue::from_static("</orders/7>; rel=\"related\""),
        );
        res.extensions_mut().insert(IdempotencyOutcome::Refused {
            problem: ProblemKind::Expired,
            attempts: 1,
        });
        let out = refusal(res);
        assert_eq!(out.headers()["grpc-status"], "9");
        assert_eq!(out.headers()[header::LINK], "</orders/7>; rel=\"related\"");
        assert!(out.headers().contains_key("grpc-status-details-bin"));
    }

    #[test]
    fn grpc_web_is_not_grpc() {
        let is = |ct: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
            is_grpc(&h)
        };
        assert!(is("application/grpc"));
        assert!(is("application/grpc+proto"));
        assert!(is("application/grpc;charset=utf-8"));
        assert!(!is("application/grpc-web"));
        assert!(!is("application/grpc-web-text+proto"));
        assert!(!is("application/json"));
    }

    #[test]
    fn grpc_timeouts_parse() {
        use std::time::Duration;
        let t = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert("grpc-timeout", HeaderValue::from_static(v));
            timeout(&h)
        };
        assert_eq!(t("100m"), Some(Duration::from_millis(100)));
        assert_eq!(t("2S"), Some(Duration::from_secs(2)));
        assert_eq!(t("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(t("5u"), Some(Duration::from_micros(5)));
        for bad in ["", "m", "100", "123456789m", "10x", "-1S", "1.5S"] {
            assert_eq!(t(bad), None, "{bad:?}");
        }
    }
}
