//! Request fingerprints: what makes two attempts "the same request".
//!
//! A fingerprint is SHA-256 over the method, the path and query, and the
//! request body normalized by a [`Normalizer`]. It decides whether a retry
//! under an already-used key carries the same payload (replay) or a different
//! one (refused). Headers are never part of it: authorization, trace ids and
//! dates change from attempt to attempt. The fingerprint compares requests; it
//! never authenticates them (the principal in the scope does that).
//!
//! # Canonical JSON
//!
//! The default normalizer reads JSON bodies (`application/json` and any
//! `+json` media type) as canonical JSON, so that two bodies match exactly
//! when they hold the same JSON value:
//!
//! - whitespace between tokens is dropped and object members are sorted by
//!   the UTF-8 bytes of their names, so `{"a":1, "b":2}` and
//!   `{"b":2,"a":1}` match;
//! - strings are compared after decoding escapes: `"\u0041\/"` and `"A/"`
//!   match;
//! - numbers are compared as exact decimal values, never through a binary
//!   float: `1`, `1.0`, `1e0`, `10e-1`, `100e-2` and `0.1e1` match, and so
//!   do `-0`, `0`, `0.0` and `0e5`; but `0.1` and `0.10000000000000001`
//!   differ, as do `18446744073709551616` and `18446744073709551617`, or
//!   `1234567890123456.78` and `1234567890123456.79`;
//! - array order is meaning: `[1,2]` and `[2,1]` differ.
//!
//! What is hashed is the body rewritten in one fixed form, itself JSON: no
//! whitespace; members in order; strings with only `"`, `\` and control
//! characters escaped; each number as its significant digits and a power of
//! ten (`1.50` is written `15e-1`, `100` is `1e2`, zero is `0`).
//!
//! A body labelled JSON is refused with `400` (a problem of type
//! [`ProblemKind::InvalidBody`](crate::ProblemKind::InvalidBody)) before
//! anything is stored when it is not an I-JSON text (RFC 7493):
//!
//! - it is not exactly one JSON value (RFC 8259), is not valid UTF-8,
//!   starts with a byte order mark, or escapes an unpaired surrogate
//!   (`"\ud800"`);
//! - an object has the same name twice, also when spelled differently
//!   (`{"a":1,"\u0061":2}`): parsers disagree on which of the two counts,
//!   so the handler could act on a value other than the one fingerprinted;
//! - arrays and objects nest deeper than 128 levels;
//! - a number's exponent, once the decimal point is moved behind its last
//!   significant digit, is outside the range of an `i64` (as in
//!   `1e9223372036854775808`); no real payload comes near.
//!
//! Bodies of other content types are hashed as raw bytes.

mod canonical;

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use serde::{Serialize, de::DeserializeOwned};
use sha2::{Digest, Sha256};

/// Canonical JSON of a payload (a request body, or any other JSON to
/// fingerprint); the error reads like a refused request body.
pub(crate) use canonical::canonical_json;

/// A SHA-256 request fingerprint.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub(crate) [u8; 32]);

impl Fingerprint {
    /// The 32 digest bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("…")
    }
}

/// Why a body could not be fingerprinted. Answered with `400` and a problem
/// document of type [`ProblemKind::InvalidBody`](crate::ProblemKind::InvalidBody).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FingerprintError(String);

impl FingerprintError {
    /// A refusal with a message shown to the client in the problem `detail`.
    pub fn new(detail: impl Into<String>) -> Self {
        Self(detail.into())
    }
}

impl std::fmt::Display for FingerprintError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FingerprintError {}

type NormalizeFn = dyn Fn(&Parts, &Bytes) -> Result<Vec<u8>, FingerprintError> + Send + Sync;

/// How a request body is reduced to the bytes that are hashed.
///
/// The default is [`Normalizer::canonical_json`].
#[derive(Clone)]
pub struct Normalizer(Inner);

#[derive(Clone)]
enum Inner {
    CanonicalJson,
    Custom(Arc<NormalizeFn>),
}

impl Default for Normalizer {
    fn default() -> Self {
        Self::canonical_json()
    }
}

impl std::fmt::Debug for Normalizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Inner::CanonicalJson => "Normalizer::CanonicalJson",
            Inner::Custom(_) => "Normalizer::Custom",
        })
    }
}

impl Normalizer {
    /// JSON bodies (`application/json` and any `+json` media type) as
    /// canonical JSON; any other content type as raw bytes.
    ///
    /// Two JSON bodies match when they hold the same value: member order,
    /// whitespace and string escapes do not count (`{"a":"\u0041", "b":2}`
    /// matches `{"b":2,"a":"A"}`), and numbers are compared as exact
    /// decimals, never through a float: `1`, `1.0`, `1e0`, `10e-1` and
    /// `0.1e1` match, and so do `-0`, `0.0` and `0e5`; `0.1` does not match
    /// `0.10000000000000001`, nor `18446744073709551616`
    /// `18446744073709551617`. Array order counts. What is hashed is the
    /// value written in one fixed JSON form: members sorted by the UTF-8
    /// bytes of their names, no whitespace, each number as its significant
    /// digits and a power of ten (`1.50` as `15e-1`, zero as `0`).
    ///
    /// A JSON body is refused with `400` (problem type
    /// [`ProblemKind::InvalidBody`](crate::ProblemKind::InvalidBody)) when
    /// it is not an I-JSON text (RFC 7493):
    ///
    /// - not exactly one JSON value (RFC 8259), not valid UTF-8, a leading
    ///   byte order mark, or an escaped unpaired surrogate (`"\ud800"`);
    /// - an object that **repeats a name**, also when spelled differently
    ///   (`{"a":1,"\u0061":2}`): parsers disagree on which one counts, so
    ///   the handler could act on another value than the one fingerprinted;
    /// - arrays and objects nested deeper than 128 levels;
    /// - a number whose exponent, with the decimal point moved behind its
    ///   last significant digit, does not fit in an `i64`
    ///   (`1e9223372036854775808`).
    pub fn canonical_json() -> Self {
        Self(Inner::CanonicalJson)
    }

    /// Deserializes the body into `T` (so `#[serde(default)]` fields are
    /// filled), serializes it back and hashes that canonically: a body that
    /// omits an optional field and one that sends its default value match.
    /// A body that does not deserialize into `T` is refused with `400`, and
    /// so is one that [`canonical_json`](Self::canonical_json) refuses, such
    /// as an object with a repeated name (which serde would settle silently).
    pub fn typed<T>() -> Self
    where
        T: DeserializeOwned + Serialize + 'static,
    {
        Self::custom(|_, body| {
            // The raw body first: serde keeps one of two repeated names
            // without a word, and the handler may pick the other.
            canonical_json(body)?;
            let typed: T = serde_json::from_slice(body).map_err(|e| {
                FingerprintError::new(format!("the request body is not valid: {e}"))
            })?;
            let bytes = serde_json::to_vec(&typed).map_err(|e| {
                FingerprintError::new(format!("the request body is not valid: {e}"))
            })?;
            canonical::canonicalize(&bytes).map_err(|e| {
                FingerprintError::new(format!(
                    "the request body is not valid: its typed form is not JSON: {e}"
                ))
            })
        })
    }

    /// A function of the request head and body that returns the bytes to
    /// hash. The method and path are hashed in addition to what it returns.
    pub fn custom<F>(f: F) -> Self
    where
        F: Fn(&Parts, &Bytes) -> Result<Vec<u8>, FingerprintError> + Send + Sync + 'static,
    {
        Self(Inner::Custom(Arc::new(f)))
    }

    /// Computes the fingerprint of a buffered request. The path is hashed
    /// in its RFC 3986 normal form (unreserved escapes decoded, other
    /// escapes upper-cased, dot segments removed), so spellings of one path
    /// are one request; the query is hashed as sent.
    pub fn fingerprint(
        &self,
        parts: &Parts,
        body: &Bytes,
    ) -> Result<Fingerprint, FingerprintError> {
        self.fingerprint_with(parts, body, &[])
    }

    /// [`fingerprint`](Self::fingerprint), with the values of `headers`
    /// (`IdempotencyLayer::with_fingerprint_headers`) hashed after the
    /// target: each name, then how many values it has (none when absent),
    /// then each value, all length-prefixed. With no headers named, the
    /// fingerprint is the one earlier versions computed.
    pub(crate) fn fingerprint_with(
        &self,
        parts: &Parts,
        body: &Bytes,
        headers: &[http::HeaderName],
    ) -> Result<Fingerprint, FingerprintError> {
        let mut h = Sha256::new();
        let path = crate::path::normalize(parts.uri.path());
        let (mark, query) = parts.uri.query().map_or(("", ""), |q| ("?", q));
        // Method and target (the path, then `?` and the query, if any) are
        // length-prefixed; the body comes last, so no two different
        // requests hash alike.
        let method = parts.method.as_str();
        h.update((method.len() as u64).to_be_bytes());
        h.update(method);
        let target = [&*path, mark, query];
        h.update((target.iter().map(|p| p.len()).sum::<usize>() as u64).to_be_bytes());
        target.iter().for_each(|p| h.update(p));
        for name in headers {
            h.update((name.as_str().len() as u64).to_be_bytes());
            h.update(name.as_str());
            let values = parts.headers.get_all(name);
            h.update((values.iter().count() as u64).to_be_bytes());
            for value in values {
                h.update((value.len() as u64).to_be_bytes());
                h.update(value.as_bytes());
            }
        }
        match &self.0 {
            Inner::CanonicalJson if is_json(parts) => h.update(canonical_json(body)?),
            Inner::CanonicalJson => h.update(body),
            Inner::Custom(f) => h.update(f(parts, body)?),
        }
        Ok(Fingerprint(h.finalize().into()))
    }
}

fn is_json(parts: &Parts) -> bool {
    let Some(ct) = parts.headers.get(http::header::CONTENT_TYPE) else {
        return false;
    };
    let Ok(ct) = ct.to_str() else { return false };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json" || essence.ends_with("+json")
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Method, Request};

    fn fp(
        n: &Normalizer,
        method: Method,
        uri: &str,
        ct: Option<&str>,
        body: &str,
    ) -> Result<Fingerprint, FingerprintError> {
        let mut b = Request::builder().method(method).uri(uri);
        if let Some(ct) = ct {
            b = b.header("content-type", ct);
        }
        let (parts, ()) = b.body(()).unwrap().into_parts();
        n.fingerprint(&parts, &Bytes::copy_from_slice(body.as_bytes()))
    }

    const JSON: Option<&str> = Some("application/json");

    fn body_fp(body: &str) -> Result<Fingerprint, FingerprintError> {
        fp(&Normalizer::default(), Method::POST, "/o", JSON, body)
    }

    #[test]
    fn key_order_and_whitespace_are_ignored() {
        let n = Normalizer::default();
        let a = fp(
            &n,
            Method::POST,
            "/orders",
            JSON,
            r#"{"amount":12000,"items":[{"sku":"A","qty":2}]}"#,
        )
        .unwrap();
        let b = fp(
            &n,
            Method::POST,
            "/orders",
            Some("application/json; charset=utf-8"),
            "{ \"items\" : [ {\"qty\":2, \"sku\":\"A\"} ],\n \"amount\": 12000 }",
        )
        .unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn meaning_changes_change_the_fingerprint() {
        let n = Normalizer::default();
        let base = fp(&n, Method::POST, "/orders", JSON, r#"{"amount":12000}"#).unwrap();
        assert_ne!(
            base,
            fp(&n, Method::POST, "/orders", JSON, r#"{"amount":15000}"#).unwrap()
        );
        assert_ne!(
            base,
            fp(&n, Method::PATCH, "/orders", JSON, r#"{"amount":12000}"#).unwrap()
        );
        assert_ne!(
            base,
            fp(&n, Method::POST, "/payments", JSON, r#"{"amount":12000}"#).unwrap()
        );
        // array order is meaning
        assert_ne!(
            fp(&n, Method::POST, "/o", JSON, "[1,2]").unwrap(),
            fp(&n, Method::POST, "/o", JSON, "[2,1]").unwrap()
        );
    }

    #[test]
    fn invalid_json_is_refused_and_other_types_hash_raw() {
        let n = Normalizer::default();
        assert!(fp(&n, Method::POST, "/o", JSON, "{\"a\":").is_err());
        assert!(
            fp(
                &n,
                Method::POST,
                "/o",
                Some("application/problem+json"),
                "nope"
            )
            .is_err()
        );
        let raw1 = fp(
            &n,
            Method::POST,
            "/o",
            Some("text/plain"),
            "{\"a\":1, \"b\":2}",
        )
        .unwrap();
        let raw2 = fp(
            &n,
            Method::POST,
            "/o",
            Some("text/plain"),
            "{\"b\":2, \"a\":1}",
        )
        .unwrap();
        assert_ne!(raw1, raw2);
    }

    /// The digest's layout, written out here: fingerprints recorded by an
    /// earlier release must still match a retry's after an upgrade.
    #[test]
    fn the_digest_layout_is_unchanged() {
        let digest = |method: &str, target: &str, header: Option<(&str, &str)>, body: &[u8]| {
            let mut h = Sha256::new();
            for part in [method.as_bytes(), target.as_bytes()] {
                h.update((part.len() as u64).to_be_bytes());
                h.update(part);
            }
            if let Some((name, value)) = header {
                h.update((name.len() as u64).to_be_bytes());
                h.update(name);
                h.update(1_u64.to_be_bytes());
                h.update((value.len() as u64).to_be_bytes());
                h.update(value);
            }
            h.update(body);
            <[u8; 32]>::from(h.finalize())
        };
        let n = Normalizer::default();
        let body = r#"{"b":1,"a":2}"#;
        let canonical = canonical_json(body.as_bytes()).unwrap();
        for (uri, target) in [
            ("/orders/x/../%61bc", "/orders/abc"),
            (
                "/orders/abc?currency=KRW&x=%2f",
                "/orders/abc?currency=KRW&x=%2f",
            ),
            ("/o?", "/o?"),
        ] {
            let ours = fp(&n, Method::POST, uri, JSON, body).unwrap();
            assert_eq!(ours.0, digest("POST", target, None, &canonical), "{uri}");
        }
        let (parts, ()) = Request::post("/o")
            .header("content-type", "text/plain")
            .header("x-tenant", "t-1")
            .body(())
            .unwrap()
            .into_parts();
        let headers = [http::HeaderName::from_static("x-tenant")];
        let ours = n
            .fingerprint_with(&parts, &Bytes::from_static(b"raw"), &headers)
            .unwrap();
        assert_eq!(
            ours.0,
            digest("POST", "/o", Some(("x-tenant", "t-1")), b"raw")
        );
    }

    #[test]
    fn canonical_form_is_stable() {
        let body = br#"{"b":[true,null,1.5,"x\"y"],"a":{"d":1,"c":2}}"#;
        assert_eq!(
            String::from_utf8(canonical_json(body).unwrap()).unwrap(),
            r#"{"a":{"c":2e0,"d":1e0},"b":[true,null,15e-1,"x\"y"]}"#
        );
    }

    #[test]
    fn errors_become_client_messages() {
        assert_eq!(
            body_fp(r#"{"a":1,"\u0061":2}"#).unwrap_err().to_string(),
            r#"the request body is not valid JSON: duplicate object name "a" at byte 7"#
        );
    }

    #[test]
    fn typed_normalizer_compares_numbers_exactly() {
        let n = Normalizer::typed::<serde_json::Value>();
        let a = fp(&n, Method::POST, "/o", JSON, r#"{"n":1.50}"#).unwrap();
        let b = fp(&n, Method::POST, "/o", JSON, r#"{"n":15e-1}"#).unwrap();
        let c = fp(&n, Method::POST, "/o", JSON, r#"{"n":1.51}"#).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn numbers_are_compared_exactly() {
        for (a, b) in [
            ("1234567890123456.78", "1234567890123456.79"),
            ("18446744073709551616", "18446744073709551617"),
            ("0.1", "0.10000000000000001"),
        ] {
            let fa = body_fp(&format!("{{\"n\":{a}}}")).unwrap();
            let fb = body_fp(&format!("{{\"n\":{b}}}")).unwrap();
            assert_ne!(fa, fb, "{a} and {b} must not match");
        }
    }

    #[test]
    fn equal_decimal_values_match() {
        let one = body_fp(r#"{"n":1}"#).unwrap();
        for s in ["1.0", "1e0", "10e-1", "100e-2", "0.1e1", "1E+0", "1.000"] {
            assert_eq!(one, body_fp(&format!("{{\"n\":{s}}}")).unwrap(), "{s}");
        }
        let zero = body_fp(r#"{"n":0}"#).unwrap();
        for s in ["-0", "0.0", "0e5", "-0.000e-7"] {
            assert_eq!(zero, body_fp(&format!("{{\"n\":{s}}}")).unwrap(), "{s}");
        }
    }

    #[test]
    fn duplicate_names_are_refused() {
        for body in [
            r#"{"a":1,"a":2}"#,
            r#"{"a":1,"\u0061":2}"#,
            r#"{"x":{"b":1,"a":2,"b":1}}"#,
        ] {
            let err = body_fp(body).unwrap_err();
            assert!(err.to_string().contains("duplicate"), "{body}: {err}");
        }
    }

    #[test]
    fn typed_normalizer_refuses_duplicate_names() {
        // A map type takes one of the duplicates silently under serde.
        let n = Normalizer::typed::<std::collections::BTreeMap<String, u64>>();
        let err = fp(&n, Method::POST, "/o", JSON, r#"{"amount":1,"amount":2}"#).unwrap_err();
        assert!(err.to_string().contains("duplicate"), "{err}");
        let n = Normalizer::typed::<serde_json::Value>();
        let err = fp(&n, Method::POST, "/o", JSON, r#"{"a":1,"\u0061":2}"#).unwrap_err();
        assert!(err.to_string().contains("duplicate"), "{err}");
    }

    #[test]
    fn typed_normalizer_fills_defaults() {
        #[derive(serde::Deserialize, serde::Serialize)]
        struct Order {
            amount: u64,
            #[serde(default)]
            memo: String,
        }
        let n = Normalizer::typed::<Order>();
        let a = fp(&n, Method::POST, "/o", JSON, r#"{"amount":1}"#).unwrap();
        let b = fp(&n, Method::POST, "/o", JSON, r#"{"memo":"","amount":1}"#).unwrap();
        let c = fp(&n, Method::POST, "/o", JSON, r#"{"memo":"x","amount":1}"#).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(fp(&n, Method::POST, "/o", JSON, r#"{"memo":"x"}"#).is_err());
    }
}
