//! Recording a response and replaying it byte for byte.
//!
//! A recorded response is its status, the headers on the layer's allow-list
//! (by default `content-type` and `location`) and the whole body. A replay
//! returns exactly those, plus `Idempotent-Replayed: true` unless disabled.
//! Headers off the allow-list (dates, trace ids, cookies) are not recorded:
//! they describe an attempt, not the result.

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

/// The header added to replayed responses.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// A response as stored in the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    pub(crate) status: u16,
    pub(crate) headers: Vec<u8>,
    pub(crate) body: Bytes,
}

impl StoredResponse {
    /// Captures `status`, the allow-listed `headers` and `body`.
    pub(crate) fn capture(
        status: StatusCode,
        headers: &HeaderMap,
        allow: &[HeaderName],
        body: Bytes,
    ) -> Self {
        Self {
            status: status.as_u16(),
            headers: encode_headers(headers, allow),
            body,
        }
    }

    /// Rebuilds the response. Unreadable stored headers are skipped rather
    /// than failing the replay; the status and body are what the contract
    /// promises byte for byte.
    pub(crate) fn to_response(&self, replayed_header: bool) -> Response<Bytes> {
        let mut res = Response::new(self.body.clone());
        *res.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        decode_headers(&self.headers, res.headers_mut());
        if replayed_header {
            res.headers_mut().insert(
                HeaderName::from_static(IDEMPOTENT_REPLAYED),
                HeaderValue::from_static("true"),
            );
        }
        res
    }
}

/// `name:value\n` per header; values cannot hold `\n` (the `http` crate
/// refuses them), and names cannot hold `:`.
fn encode_headers(headers: &HeaderMap, allow: &[HeaderName]) -> Vec<u8> {
    let mut out = BytesMut::new();
    for name in allow {
        for value in headers.get_all(name) {
            out.put_slice(name.as_str().as_bytes());
            out.put_u8(b':');
            out.put_slice(value.as_bytes());
            out.put_u8(b'\n');
        }
    }
    out.to_vec()
}

fn decode_headers(encoded: &[u8], into: &mut HeaderMap) {
    for line in encoded.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
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
