//! Request fingerprints: what makes two attempts "the same request".
//!
//! A fingerprint is SHA-256 over the method, the path and query, and the
//! request body normalized by a [`Normalizer`]. It decides whether a retry
//! under an already-used key carries the same payload (replay) or a different
//! one (refused). Headers are never part of it: authorization, trace ids and
//! dates change from attempt to attempt. The fingerprint compares requests; it
//! never authenticates them (the principal in the scope does that).
//!
//! The default normalizer reads JSON bodies (`application/json` and any
//! `+json` media type) as canonical JSON: object keys sorted, insignificant
//! whitespace dropped, so `{"a":1, "b":2}` and `{"b":2,"a":1}` match. Other
//! bodies are hashed as raw bytes. A body labelled JSON that does not parse is
//! refused with `400` before anything is stored.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use serde::{Serialize, de::DeserializeOwned};
use serde_json::Value;
use sha2::{Digest, Sha256};

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
    /// JSON bodies as canonical JSON (sorted keys, no whitespace); any other
    /// content type as raw bytes. Invalid JSON is refused.
    pub fn canonical_json() -> Self {
        Self(Inner::CanonicalJson)
    }

    /// Deserializes the body into `T` (so `#[serde(default)]` fields are
    /// filled), serializes it back and hashes that canonically: a body that
    /// omits an optional field and one that sends its default value match.
    /// A body that does not deserialize into `T` is refused with `400`.
    pub fn typed<T>() -> Self
    where
        T: DeserializeOwned + Serialize + 'static,
    {
        Self::custom(|_, body| {
            let typed: T = serde_json::from_slice(body).map_err(|e| {
                FingerprintError::new(format!("the request body is not valid: {e}"))
            })?;
            let value = serde_json::to_value(&typed).map_err(|e| {
                FingerprintError::new(format!("the request body is not valid: {e}"))
            })?;
            Ok(canonical(&value))
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

    /// Computes the fingerprint of a buffered request.
    pub fn fingerprint(
        &self,
        parts: &Parts,
        body: &Bytes,
    ) -> Result<Fingerprint, FingerprintError> {
        let mut h = Sha256::new();
        let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        // Method and target are length-prefixed; the body comes last, so no
        // two different requests hash alike.
        for part in [parts.method.as_str().as_bytes(), target.as_bytes()] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        match &self.0 {
            Inner::CanonicalJson if is_json(parts) => {
                let value: Value = serde_json::from_slice(body).map_err(|e| {
                    FingerprintError::new(format!("the request body is not valid JSON: {e}"))
                })?;
                // Writing into the hash cannot fail.
                let _ = write_canonical(&value, &mut HashWriter(&mut h));
            }
            Inner::CanonicalJson => h.update(body),
            Inner::Custom(f) => h.update(f(parts, body)?),
        }
        Ok(Fingerprint(h.finalize().into()))
    }
}

/// Feeds written bytes straight into the hash, so the canonical form is
/// never materialized.
struct HashWriter<'a>(&'a mut Sha256);

impl std::io::Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
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

/// Canonical JSON: object keys sorted by their UTF-8 bytes, no whitespace.
/// Sorting is done here, not left to `serde_json::Map`, whose order depends
/// on whether some crate in the build enabled `preserve_order`.
pub(crate) fn canonical(value: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    // Writing into a Vec cannot fail.
    let _ = write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut impl std::io::Write) -> std::io::Result<()> {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.write_all(b"{")?;
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                serde_json::to_writer(&mut *out, k.as_str())?;
                out.write_all(b":")?;
                write_canonical(v, out)?;
            }
            out.write_all(b"}")
        }
        Value::Array(items) => {
            out.write_all(b"[")?;
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                write_canonical(v, out)?;
            }
            out.write_all(b"]")
        }
        scalar => Ok(serde_json::to_writer(&mut *out, scalar)?),
    }
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

    #[test]
    fn canonical_form_is_stable() {
        let v: Value =
            serde_json::from_str(r#"{"b":[true,null,1.5,"x\"y"],"a":{"d":1,"c":2}}"#).unwrap();
        assert_eq!(
            String::from_utf8(canonical(&v)).unwrap(),
            r#"{"a":{"c":2,"d":1},"b":[true,null,1.5,"x\"y"]}"#
        );
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
