//! Protocol Buffers request messages (feature `grpc`): what counts as "the
//! same request" for a gRPC method, and a key carried in a field of the
//! request (Google's AIP-155 `request_id`).
//!
//! By default a gRPC request is fingerprinted as its method path and the
//! bytes of its body (the gRPC frame as sent). Protobuf encoding is not
//! canonical across implementations: field order, a default value sent or
//! left out, packed or unpacked repeated numbers and unknown fields all
//! change the bytes of one message. A client that re-encodes its message on
//! a retry with another library (or another version of one) would then be
//! refused with "key reused". [`Normalizer::protobuf`] decodes the message
//! first and hashes prost's own encoding of it, so any two encodings of the
//! same value match:
//!
//! - fields in any order, default values sent or omitted, packed or not:
//!   one request;
//! - **unknown fields are dropped** before hashing (prost does not keep
//!   them): two requests that differ only in fields this service does not
//!   know are one request, which is what the handler sees too;
//! - map fields must decode into a `BTreeMap` (prost-build's `btree_map`
//!   option) for a stable encoding: a `HashMap` encodes its entries in a
//!   different order from one process to the next.
//!
//! Compressed messages (`grpc-encoding` with the frame's compressed flag
//! set) and bodies that are not exactly one message (a streaming call) are
//! refused with `INVALID_ARGUMENT`: guard unary methods, uncompressed.
//!
//! [`request_field`] takes the key from a string field of the request
//! instead of the `idempotency-key` metadata entry, for APIs that follow
//! AIP-155. See [`IdempotencyLayer::with_key_from_body`].
//!
//! [`Normalizer::protobuf`]: crate::Normalizer::protobuf
//! [`IdempotencyLayer::with_key_from_body`]: crate::IdempotencyLayer::with_key_from_body

use bytes::Bytes;
use http::request::Parts;

use crate::fingerprint::{FingerprintError, Normalizer};

/// The one message of a unary gRPC request body: the bytes its 5-byte
/// prefix (not compressed, then the length) announces, and nothing after.
pub(crate) fn message(body: &[u8]) -> Result<&[u8], FingerprintError> {
    let [flag, a, b, c, d, rest @ ..] = body else {
        return Err(FingerprintError::new(
            "the request body is not a gRPC message (shorter than its 5-byte prefix)",
        ));
    };
    if *flag != 0 {
        return Err(FingerprintError::new(
            "a compressed gRPC message is not fingerprinted: send this method uncompressed",
        ));
    }
    let len = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
    if rest.len() != len {
        return Err(FingerprintError::new(
            "the request body is not exactly one gRPC message (a unary call)",
        ));
    }
    Ok(rest)
}

/// Decodes a unary gRPC request body into `M`.
pub(crate) fn decode<M: prost::Message + Default>(body: &[u8]) -> Result<M, FingerprintError> {
    M::decode(message(body)?)
        .map_err(|e| FingerprintError::new(format!("the request message does not decode: {e}")))
}

#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
impl Normalizer {
    /// A unary gRPC request's message, decoded into `M` and hashed in
    /// prost's encoding of it (feature `grpc`): two encodings of one value
    /// (fields in another order, a default value sent or left out, unknown
    /// fields) are one request. A body that is not one uncompressed message
    /// decoding into `M` is refused with `INVALID_ARGUMENT` (`400` over
    /// HTTP). What counts as the same request, and what to do with map
    /// fields: see [`protobuf`](crate::protobuf).
    pub fn protobuf<M>() -> Self
    where
        M: prost::Message + Default + 'static,
    {
        Self::custom(|_, body| Ok(decode::<M>(body)?.encode_to_vec()))
    }
}

/// A key function for
/// [`with_key_from_body`](crate::IdempotencyLayer::with_key_from_body):
/// decodes the request message into `M` and takes the key from the string
/// `field` returns. An empty field (proto3's default) is no key; a body
/// that does not decode is no key either (the request is then refused as
/// one without a key, or refused for its body by the fingerprint).
///
/// ```
/// # #[derive(Clone, PartialEq, prost::Message)]
/// # struct CreateOrderRequest { #[prost(string, tag = "9")] request_id: String }
/// # fn layer(pool: sqlx::SqlitePool) -> tower_idempotency::IdempotencyLayer<sqlx::Sqlite> {
/// use tower_idempotency::{IdempotencyLayer, protobuf};
///
/// IdempotencyLayer::new(pool)
///     .with_key_from_body(protobuf::request_field(|r: &CreateOrderRequest| &r.request_id))
/// # }
/// ```
pub fn request_field<M>(
    field: fn(&M) -> &str,
) -> impl Fn(&Parts, &Bytes) -> Option<String> + Send + Sync + 'static
where
    M: prost::Message + Default + 'static,
{
    move |_, body| {
        let message: M = decode(body).ok()?;
        Some(field(&message).to_owned()).filter(|key| !key.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, PartialEq, prost::Message)]
    struct Req {
        #[prost(string, tag = "1")]
        name: String,
        #[prost(int64, repeated, tag = "2")]
        nums: Vec<i64>,
        #[prost(string, tag = "3")]
        request_id: String,
    }

    fn frame(message: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    #[test]
    fn frames_are_one_uncompressed_message() {
        assert_eq!(message(&frame(b"abc")).unwrap(), b"abc");
        assert_eq!(message(&frame(b"")).unwrap(), b"");
        assert!(message(b"\0\0\0").is_err());
        let mut compressed = frame(b"abc");
        compressed[0] = 1;
        assert!(message(&compressed).is_err());
        let mut two = frame(b"abc");
        two.extend(frame(b"d"));
        assert!(message(&two).is_err());
        assert!(message(&frame(b"abc")[..7]).is_err());
    }

    #[test]
    fn the_key_field_is_read_and_an_empty_one_is_none() {
        let key = request_field(|r: &Req| &r.request_id);
        let parts = http::Request::new(()).into_parts().0;
        let with = prost::Message::encode_to_vec(&Req {
            request_id: "r-1".into(),
            ..Req::default()
        });
        assert_eq!(
            key(&parts, &Bytes::from(frame(&with))),
            Some("r-1".to_owned())
        );
        let without = prost::Message::encode_to_vec(&Req::default());
        assert_eq!(key(&parts, &Bytes::from(frame(&without))), None);
        assert_eq!(key(&parts, &Bytes::from_static(b"\0\0\0\0\x02\xff")), None);
    }
}
