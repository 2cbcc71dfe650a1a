//! Recording a response and replaying it byte for byte.
//!
//! A recorded response is its status, the headers on the layer's allow-list
//! (by default `content-type` and `location`), the whole body and every
//! trailer (gRPC's `grpc-status` travels there). A trailers-only gRPC
//! answer's headers are its trailers: all of them are recorded, but those
//! that describe the attempt or its framing. An answer whose status HTTP
//! sends without a body (`1xx`, `204`, `304`) is recorded and replayed
//! without one, whatever body the handler gave it: a replay is
//! well-framed for every status. A replay
//! returns exactly those, plus `Idempotent-Replayed: true` unless disabled.
//! Headers off the allow-list (dates, trace ids, cookies) are not recorded:
//! they describe an attempt, not the result.
//!
//! An answer whose body is over the recording limit is never undone for
//! its size: the first client gets the whole body as it streams, and when
//! it ends well (an HTTP body that finishes, a gRPC `OK` in its trailers)
//! the operation commits with the answer's status and headers and a mark
//! that its body was not kept; a retry gets the recorded status and
//! headers with a problem body (`#response-too-large`) that says so, never
//! a second run. One that ends in failure (a gRPC error in its trailers, a
//! broken body, longer than `with_max_stream_hold`) is rolled back: what
//! commits is what the client was told. Its transaction is held open
//! while it streams.

use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_LANGUAGE, CONTENT_LENGTH, CONTENT_TYPE, TRAILER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use crate::problem::{Problem, ProblemKind};

/// The header added to replayed responses.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The response header that tells the client until when its key is honoured
/// (an HTTP-date), on first answers and replays alike. Retries after that
/// time get `410 Gone`.
pub const IDEMPOTENCY_KEY_EXPIRES: &str = "idempotency-key-expires";

/// A response as stored in the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    pub(crate) status: u16,
    pub(crate) headers: Vec<u8>,
    pub(crate) body: Bytes,
}

impl StoredResponse {
    /// Captures `status`, the allow-listed `headers`, `body` and every
    /// trailer (`trailers`: what the body ended with).
    pub(crate) fn capture(
        status: StatusCode,
        headers: &HeaderMap,
        allow: &[HeaderName],
        body: Bytes,
        trailers: Option<&Trailers>,
    ) -> Self {
        // A trailers-only gRPC answer (what a gRPC server sends for every
        // error) carries its status and its trailing metadata in the
        // headers: they are its trailers, recorded whole as trailers are
        // (custom metadata included), whatever the allow-list; only what
        // describes the attempt or its framing is left out.
        let mut encoded = if is_trailers_only(headers) {
            let kept: Vec<HeaderName> = headers
                .keys()
                .filter(|n| !PER_ATTEMPT_HEADERS.contains(&n.as_str()))
                .cloned()
                .collect();
            encode_headers(headers, &kept)
        } else {
            encode_headers(headers, allow)
        };
        if let Some(Trailers(trailers)) = trailers.filter(|t| !t.0.is_empty()) {
            encoded.extend_from_slice(TRAILERS.as_bytes());
            encoded.push(b'\n');
            for (name, value) in trailers {
                encoded.extend_from_slice(name.as_str().as_bytes());
                encoded.push(b':');
                encoded.extend_from_slice(value.as_bytes());
                encoded.push(b'\n');
            }
        }
        Self {
            status: status.as_u16(),
            // What the client got: HTTP sends no body with these.
            body: if carries_no_body(status) {
                Bytes::new()
            } else {
                body
            },
            headers: encoded,
        }
    }

    /// Captures an answer whose body was over the recording `limit`: its
    /// status and allow-listed headers, and a mark that its body was not
    /// kept (a line no header can be; earlier versions skip it and replay
    /// the status with an empty body, so finish a rolling upgrade first).
    pub(crate) fn capture_not_kept(
        status: StatusCode,
        headers: &HeaderMap,
        allow: &[HeaderName],
        limit: usize,
    ) -> Self {
        let mut encoded = encode_headers(headers, allow);
        encoded.extend_from_slice(format!("{NOT_KEPT}{limit}\n").as_bytes());
        Self {
            status: status.as_u16(),
            headers: encoded,
            body: Bytes::new(),
        }
    }

    /// The recording limit the body went over, when it was not kept.
    fn not_kept(&self) -> Option<&str> {
        self.headers
            .split(|&b| b == b'\n')
            .find_map(|l| l.strip_prefix(NOT_KEPT.as_bytes()))
            .and_then(|limit| std::str::from_utf8(limit).ok())
    }

    /// Rebuilds the response. Unreadable stored headers are skipped rather
    /// than failing the replay; the status and body are what the contract
    /// promises byte for byte. An answer whose body was not kept replays its
    /// status and headers with a problem body
    /// ([`ResponseTooLarge`](crate::ProblemKind::ResponseTooLarge)) in place
    /// of the body.
    pub(crate) fn to_response(&self, replayed_header: bool) -> Response<Bytes> {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        let (mut recorded, mut trailers) = decode_headers(&self.headers);
        let mut res = match self.not_kept() {
            // Well-framed whatever was recorded (earlier versions kept a
            // `204`'s body): no body where HTTP sends none.
            None if carries_no_body(status) => Response::new(Bytes::new()),
            None => Response::new(self.body.clone()),
            // A gRPC answer has no problem body: a trailers-only answer,
            // `ALREADY_EXISTS` (the operation happened; its message is
            // gone), with the recorded metadata (a `location`, say).
            Some(limit) if crate::classify::is_grpc(&recorded) => {
                trailers.clear();
                let mut res = Response::new(Bytes::new());
                let message = format!(
                    "the first call with this idempotency key completed; its answer was larger \
                     than the recording limit ({limit} bytes) and was not kept. Read the \
                     resource it created instead of retrying"
                );
                crate::grpc::status::trailers_only(
                    res.headers_mut(),
                    6,
                    &message,
                    Some("IDEMPOTENCY_RESPONSE_NOT_KEPT"),
                );
                res
            }
            Some(limit) => {
                let detail = format!(
                    "the first request with this Idempotency-Key completed with status {}; its \
                     answer was larger than the recording limit ({limit} bytes) and was not \
                     kept. Read the resource it names (Location) instead of retrying",
                    status.as_u16()
                );
                Problem::new(ProblemKind::ResponseTooLarge, detail)
                    .status(status)
                    .into_response()
            }
        };
        *res.status_mut() = status;
        if self.not_kept().is_some() {
            // The problem body's own representation stands.
            for name in [
                CONTENT_TYPE,
                CONTENT_ENCODING,
                CONTENT_LANGUAGE,
                CONTENT_LENGTH,
            ] {
                recorded.remove(name);
            }
        }
        for (name, value) in &recorded {
            res.headers_mut().append(name, value.clone());
        }
        if !trailers.is_empty() {
            // HTTP/1.1 sends only the trailers the `Trailer` header names.
            if !res.headers().contains_key(TRAILER) {
                let names: Vec<&str> = trailers.keys().map(HeaderName::as_str).collect();
                if let Ok(v) = HeaderValue::from_str(&names.join(", ")) {
                    res.headers_mut().insert(TRAILER, v);
                }
            }
            res.extensions_mut().insert(Trailers(trailers));
        }
        if replayed_header {
            res.headers_mut().insert(
                HeaderName::from_static(IDEMPOTENT_REPLAYED),
                HeaderValue::from_static("true"),
            );
        }
        res
    }
}

/// A recorded answer's trailers, inside the layer: carried as a response
/// extension from where the body is read (or the record decoded) to where
/// the body the client gets is built.
#[derive(Debug, Clone)]
pub(crate) struct Trailers(pub(crate) HeaderMap);

/// The line after the recorded headers that starts the recorded trailers
/// (one `name:value` line each). No header can be named so. Earlier
/// versions skip this line but replay the trailers after it as headers:
/// finish a rolling upgrade before relying on replayed trailers.
const TRAILERS: &str = ":trailers:";

/// Headers that describe one attempt or its framing, never an answer:
/// not recorded from a trailers-only gRPC answer's headers (and never
/// part of a request's fingerprint, see
/// `IdempotencyLayer::with_fingerprint_headers`).
pub(crate) const PER_ATTEMPT_HEADERS: [&str; 13] = [
    "date",
    "traceparent",
    "tracestate",
    "baggage",
    "x-request-id",
    "x-correlation-id",
    "set-cookie",
    "content-length",
    "transfer-encoding",
    "connection",
    "te",
    IDEMPOTENT_REPLAYED,
    IDEMPOTENCY_KEY_EXPIRES,
];

/// A status HTTP sends without a body (RFC 9110 §6.4.1): `1xx`, `204`,
/// `304`.
fn carries_no_body(status: StatusCode) -> bool {
    status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
}

/// A trailers-only gRPC answer: `grpc-status` in its headers.
fn is_trailers_only(headers: &HeaderMap) -> bool {
    crate::classify::is_grpc(headers) && headers.contains_key("grpc-status")
}

/// The line that marks an answer whose body was not kept, followed by the
/// recording limit.
const NOT_KEPT: &str = ":body-not-kept:";

/// `name:value\n` per header; values cannot hold `\n` (the `http` crate
/// refuses them), and names cannot hold `:`.
fn encode_headers(headers: &HeaderMap, allow: &[HeaderName]) -> Vec<u8> {
    let lines = || {
        allow
            .iter()
            .flat_map(|name| headers.get_all(name).iter().map(move |value| (name, value)))
    };
    // Measured first: one allocation of the exact size.
    let size = lines()
        .map(|(name, value)| name.as_str().len() + value.len() + 2)
        .sum();
    let mut out = Vec::with_capacity(size);
    for (name, value) in lines() {
        out.extend_from_slice(name.as_str().as_bytes());
        out.push(b':');
        out.extend_from_slice(value.as_bytes());
        out.push(b'\n');
    }
    out
}

/// The recorded headers and trailers. Lines that are neither (the marks)
/// are skipped.
fn decode_headers(encoded: &[u8]) -> (HeaderMap, HeaderMap) {
    let (mut headers, mut trailers) = (HeaderMap::new(), HeaderMap::new());
    let mut into = &mut headers;
    for line in encoded.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        if line == TRAILERS.as_bytes() {
            into = &mut trailers;
            continue;
        }
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&line[..colon]),
            HeaderValue::from_bytes(&line[colon + 1..]),
        ) else {
            continue;
        };
        into.append(name, value);
    }
    (headers, trailers)
}

/// The headers recorded by default: the body's representation and `Location`.
pub(crate) fn default_recorded_headers() -> Vec<HeaderName> {
    vec![
        http::header::CONTENT_TYPE,
        http::header::CONTENT_ENCODING,
        http::header::CONTENT_LANGUAGE,
        http::header::CONTENT_LOCATION,
        http::header::LOCATION,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header::{CONTENT_TYPE, DATE, LOCATION, SET_COOKIE};

    #[test]
    fn round_trip_keeps_allow_listed_headers_and_exact_body() {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, "application/json".parse().unwrap());
        h.insert(LOCATION, "/orders/7".parse().unwrap());
        h.insert(DATE, "Sun, 29 Nov 2026 00:00:00 GMT".parse().unwrap());
        h.insert(SET_COOKIE, "s=1".parse().unwrap());
        let body = Bytes::from_static(b"{\"orderId\":7}\xff\x00");
        let stored = StoredResponse::capture(
            StatusCode::CREATED,
            &h,
            &[CONTENT_TYPE, LOCATION],
            body.clone(),
            None,
        );
        let res = stored.to_response(true);
        assert_eq!(res.status(), StatusCode::CREATED);
        assert_eq!(res.body(), &body);
        assert_eq!(res.headers()[LOCATION], "/orders/7");
        assert_eq!(res.headers()[CONTENT_TYPE], "application/json");
        assert_eq!(res.headers()[IDEMPOTENT_REPLAYED], "true");
        assert!(res.headers().get(DATE).is_none());
        assert!(res.headers().get(SET_COOKIE).is_none());
        assert!(
            stored
                .to_response(false)
                .headers()
                .get(IDEMPOTENT_REPLAYED)
                .is_none()
        );
    }
}
