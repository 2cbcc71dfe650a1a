//! gRPC's status on the wire: the headers of a trailers-only answer
//! (`grpc-status`, a percent-encoded `grpc-message`, and a
//! `google.rpc.Status` with an `ErrorInfo` in `grpc-status-details-bin`),
//! written without a protobuf dependency. Used by the layer's refusals and
//! by an answer whose recording failed at the end of its stream.

use http::{HeaderMap, HeaderValue, header};

/// The headers of a trailers-only gRPC answer: its content type, `code`,
/// `message` and, where a client acts on it, a `google.rpc.ErrorInfo`
/// with `reason`.
pub(crate) fn trailers_only(
    headers: &mut HeaderMap,
    code: u32,
    message: &str,
    reason: Option<&str>,
) {
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert("grpc-status", HeaderValue::from(code));
    if let Ok(v) = HeaderValue::from_str(&percent_encode(message)) {
        headers.insert("grpc-message", v);
    }
    if let Some(reason) = reason {
        let details = status_details(code, message, reason);
        if let Ok(v) = HeaderValue::from_str(&base64(&details)) {
            headers.insert("grpc-status-details-bin", v);
        }
    }
}

/// gRPC's `grpc-message` encoding: printable ASCII but `%` as is, every
/// other byte `%XX`.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A `google.rpc.Status` with one `google.rpc.ErrorInfo` detail, encoded
/// as protobuf.
fn status_details(code: u32, message: &str, reason: &str) -> Vec<u8> {
    let mut info = Vec::new();
    field(&mut info, 1, reason.as_bytes());
    field(&mut info, 2, b"tower-idempotency");
    let mut any = Vec::new();
    field(&mut any, 1, b"type.googleapis.com/google.rpc.ErrorInfo");
    field(&mut any, 2, &info);
    let mut status = Vec::new();
    status.push(1 << 3);
    varint(&mut status, u64::from(code));
    field(&mut status, 2, message.as_bytes());
    field(&mut status, 3, &any);
    status
}

/// A length-delimited protobuf field.
fn field(out: &mut Vec<u8>, number: u8, bytes: &[u8]) {
    out.push((number << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn varint(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// Standard base64 without padding, as gRPC sends `-bin` metadata.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (u32::from(b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_without_padding() {
        assert_eq!(base64(b"hello"), "aGVsbG8");
        assert_eq!(base64(b"hi"), "aGk");
        assert_eq!(base64(b"abc"), "YWJj");
        assert_eq!(base64(b""), "");
    }

    #[test]
    fn status_details_are_protobuf() {
        let d = status_details(9, "m", "R");
        // code 9, message "m", one detail: Any{type_url, ErrorInfo{reason "R", domain}}.
        assert_eq!(&d[..5], &[0x08, 9, 0x12, 1, b'm']);
        assert_eq!(d[5], 0x1a);
        let any = &d[7..];
        assert_eq!(usize::from(d[6]), any.len());
        assert!(any.windows(3).any(|w| w == [0x0a, 1, b'R']), "reason R");
        assert!(
            any.windows(b"google.rpc.ErrorInfo".len())
                .any(|w| w == b"google.rpc.ErrorInfo")
        );
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("a b%ü"), "a b%25%C3%BC");
    }
}
