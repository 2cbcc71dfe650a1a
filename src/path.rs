//! Syntax-based normalization of request paths (RFC 3986 §6.2.2), so that
//! spellings of one path name one operation and one fingerprint:
//! `/orders/abc/pay`, `/orders/%61bc/pay` and `/orders/x/../abc/./pay` are
//! the same path.
//!
//! 1. Percent-encoded unreserved characters (`A-Z a-z 0-9 - . _ ~`) are
//!    decoded; every other escape keeps its encoding, with upper-case hex
//!    digits (`%2f` becomes `%2F`, and stays distinct from `/`).
//! 2. Dot segments are removed (RFC 3986 §5.2.4).
//!
//! Nothing else changes: case outside escapes, repeated slashes and
//! trailing slashes are significant, as they are to most routers.

use std::borrow::Cow;

/// The normalized form of `path` (borrowed when it is already normal).
pub(crate) fn normalize(path: &str) -> Cow<'_, str> {
    if !path.contains('%') && !path.split('/').any(|s| s == "." || s == "..") {
        // Already normal (the common case): no escape, no dot segment.
        return Cow::Borrowed(path);
    }
    Cow::Owned(remove_dot_segments(&normalize_escapes(path)))
}

fn normalize_escapes(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%'
            && i + 2 < bytes.len()
            && let (Some(hi), Some(lo)) = (hex_value(bytes[i + 1]), hex_value(bytes[i + 2]))
        {
            let decoded = (hi << 4) | lo;
            if is_unreserved(decoded) {
                out.push(char::from(decoded));
            } else {
                out.push('%');
                out.push(char::from(bytes[i + 1].to_ascii_uppercase()));
                out.push(char::from(bytes[i + 2].to_ascii_uppercase()));
            }
            i += 3;
            continue;
        }
        // A path is ASCII in an `http::Uri`; keep any other byte as it is.
        let ch_len = utf8_len(b);
        out.push_str(path.get(i..i + ch_len).unwrap_or_default());
        i += ch_len.max(1);
    }
    out
}

fn utf8_len(first: u8) -> usize {
    match first {
        0x00..=0x7f => 1,
        0xc0..=0xdf => 2,
        0xe0..=0xef => 3,
        _ => 4,
    }
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// RFC 3986 §5.2.4, on segments.
fn remove_dot_segments(path: &str) -> String {
    let absolute = path.starts_with('/');
    let mut segments: Vec<&str> = Vec::new();
    let parts: Vec<&str> = path.split('/').collect();
    let last = parts.len().saturating_sub(1);
    // A path ending in a dot segment keeps a trailing slash ("/a/b/.." is "/a/").
    let mut trailing_slash = false;
    for (i, segment) in parts.iter().enumerate() {
        if i == 0 && absolute {
            continue;
        }
        match *segment {
            "." => trailing_slash = i == last,
            ".." => {
                segments.pop();
                trailing_slash = i == last;
            }
            s => {
                segments.push(s);
                trailing_slash = false;
            }
        }
    }
    let mut out = String::with_capacity(path.len());
    if absolute {
        out.push('/');
    }
    out.push_str(&segments.join("/"));
    if trailing_slash && !out.ends_with('/') {
        out.push('/');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::normalize;

    #[test]
    fn spellings_of_one_path_are_one_path() {
        assert_eq!(normalize("/orders/abc/pay"), "/orders/abc/pay");
        assert_eq!(normalize("/orders/%61bc/pay"), "/orders/abc/pay");
        assert_eq!(normalize("/orders/%61%62%63/pay"), "/orders/abc/pay");
        assert_eq!(normalize("/orders/x/../abc/./pay"), "/orders/abc/pay");
        assert_eq!(
            normalize("/orders/%2e%2E/orders/abc/pay"),
            "/orders/abc/pay"
        );
        assert_eq!(normalize("/a/b/.."), "/a/");
        assert_eq!(normalize("/a/b/."), "/a/b/");
        assert_eq!(normalize("/../a"), "/a");
        assert_eq!(normalize("/"), "/");
        assert_eq!(normalize(""), "");
    }

    #[test]
    fn other_escapes_are_kept_upper_case() {
        assert_eq!(normalize("/a%2fb"), "/a%2Fb");
        assert_ne!(normalize("/a%2fb"), normalize("/a/b"));
        assert_eq!(normalize("/caf%c3%a9"), "/caf%C3%A9");
        // Not an escape: kept.
        assert_eq!(normalize("/100%"), "/100%");
        assert_eq!(normalize("/%zz"), "/%zz");
        // Case outside escapes and repeated slashes are significant.
        assert_ne!(normalize("/Orders"), normalize("/orders"));
        assert_eq!(normalize("//a"), "//a");
    }
}
