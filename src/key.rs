//! Parsing and validating the `Idempotency-Key` request header.
//!
//! The IETF draft (`draft-ietf-httpapi-idempotency-key-header`) makes the
//! header an RFC 8941 Structured Field String: `Idempotency-Key: "8e03978e-…"`.
//! Many real clients (Stripe's SDKs among them) send the bare value instead,
//! so by default both forms are accepted and name the same key: `"k-1"` and
//! `k-1` are one key. [`KeyMode::Strict`] accepts only the quoted form.
//!
//! A key is 1 to 255 characters of printable ASCII after unquoting. A bare
//! value may not contain whitespace, `"`, `\` or `,` (a comma is how HTTP
//! folds two header lines into one, so it would make the key ambiguous).
//! Two `Idempotency-Key` header lines are refused.
//!
//! [`IdempotencyKey::new`] makes a key from its text under the same rules,
//! and [`IdempotencyKey::to_sf_string`] writes it in the quoted form, which
//! both modes accept (the client half sends keys that way).

use http::HeaderMap;

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// Which syntaxes of the `Idempotency-Key` header are accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyMode {
    /// Accept the Structured Field String (`"…"`) and a bare value; both name
    /// the same key. The default.
    #[default]
    Lenient,
    /// Accept only the Structured Field String form required by the draft.
    Strict,
}

/// A validated idempotency key, unquoted.
///
/// Guarantees: 1 to [`MAX_KEY_LEN`] bytes, every byte printable ASCII
/// (`0x20..=0x7E`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// The key as the client meant it, without Structured Field quoting.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A key from its text as meant, unquoted, under the rules a parsed
    /// header's key meets: 1 to [`MAX_KEY_LEN`] bytes of printable ASCII
    /// (spaces, `"` and `\` included; [`to_sf_string`] quotes them).
    ///
    /// # Errors
    ///
    /// [`KeyError::InvalidCharacter`] for a byte outside printable ASCII
    /// (`0x20..=0x7E`), [`KeyError::Empty`], [`KeyError::TooLong`].
    ///
    /// [`to_sf_string`]: Self::to_sf_string
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        let key = key.into();
        check(key.as_bytes())?;
        Ok(Self(key))
    }

    /// Parses one header value under `mode`.
    pub fn parse(value: &[u8], mode: KeyMode) -> Result<Self, KeyError> {
        let value = trim_ows(value);
        let key = match value.first() {
            Some(b'"') => parse_sf_string(value)?,
            Some(_) if mode == KeyMode::Strict => return Err(KeyError::NotAString),
            Some(_) => parse_bare(value)?,
            None => return Err(KeyError::Empty),
        };
        Self::new(key)
    }

    /// The key as an RFC 8941 Structured Field String (§4.1.6): in double
    /// quotes, each `"` and `\` escaped with a `\`. Every key has this
    /// form, both [`KeyMode`]s accept it, and [`parse`](Self::parse) gives
    /// back this key.
    pub fn to_sf_string(&self) -> String {
        let mut out = String::with_capacity(self.0.len() + 2);
        out.push('"');
        for c in self.0.chars() {
            if matches!(c, '"' | '\\') {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('"');
        out
    }

    /// Reads the key from request headers: `Ok(None)` when the header is
    /// absent, an error when it is malformed or repeated.
    pub fn from_headers(headers: &HeaderMap, mode: KeyMode) -> Result<Option<Self>, KeyError> {
        let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyError::Repeated);
        }
        Self::parse(first.as_bytes(), mode).map(Some)
    }
}

impl std::fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why an `Idempotency-Key` header was refused. Every variant is answered
/// with `400` and a problem document of type
/// [`ProblemKind::MalformedKey`](crate::ProblemKind::MalformedKey).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty (`""` or a blank header).
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] bytes.
    TooLong,
    /// A byte outside printable ASCII, or a character a bare key may not hold.
    InvalidCharacter,
    /// A quoted key without its closing quote, a bad escape, or text after
    /// the closing quote.
    BadQuoting,
    /// Strict mode, and the value is not a Structured Field String.
    NotAString,
    /// More than one `Idempotency-Key` header line.
    Repeated,
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Empty => "the Idempotency-Key is empty",
            Self::TooLong => "the Idempotency-Key is longer than 255 characters",
            Self::InvalidCharacter => {
                "the Idempotency-Key holds a character outside printable ASCII, or whitespace, a quote, a backslash or a comma in an unquoted key"
            }
            Self::BadQuoting => {
                "the Idempotency-Key is not a well-formed Structured Field String (RFC 8941)"
            }
            Self::NotAString => {
                "the Idempotency-Key must be a quoted Structured Field String, such as \"8e03978e-40d5-43e8-bc93-6894a57f9324\""
            }
            Self::Repeated => "more than one Idempotency-Key header was sent",
        })
    }
}

impl std::error::Error for KeyError {}

/// What every key meets, unquoted: printable ASCII, not empty, at most
/// [`MAX_KEY_LEN`] bytes.
fn check(key: &[u8]) -> Result<(), KeyError> {
    if !key.iter().all(|c| (0x20..=0x7e).contains(c)) {
        return Err(KeyError::InvalidCharacter);
    }
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    Ok(())
}

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

/// RFC 8941 §4.2.5: `"` then printable ASCII with `\"` and `\\` escapes, `"`.
fn parse_sf_string(v: &[u8]) -> Result<String, KeyError> {
    let mut out = String::with_capacity(v.len());
    let mut bytes = v[1..].iter();
    loop {
        match bytes.next() {
            None => return Err(KeyError::BadQuoting),
            Some(b'\\') => match bytes.next() {
                Some(&c @ (b'"' | b'\\')) => out.push(c as char),
                _ => return Err(KeyError::BadQuoting),
            },
            Some(b'"') => break,
            Some(&c @ 0x20..=0x7e) => out.push(c as char),
            Some(_) => return Err(KeyError::InvalidCharacter),
        }
    }
    if bytes.next().is_some() {
        return Err(KeyError::BadQuoting);
    }
    Ok(out)
}

fn parse_bare(v: &[u8]) -> Result<String, KeyError> {
    if v.iter()
        .all(|&c| (0x21..=0x7e).contains(&c) && !matches!(c, b'"' | b'\\' | b','))
    {
        // Every byte is ASCII, so this cannot fail; map rather than unwrap.
        String::from_utf8(v.to_vec()).map_err(|_| KeyError::InvalidCharacter)
    } else {
        Err(KeyError::InvalidCharacter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lenient(v: &str) -> Result<String, KeyError> {
        IdempotencyKey::parse(v.as_bytes(), KeyMode::Lenient).map(|k| k.0)
    }

    #[test]
    fn quoted_and_bare_name_the_same_key() {
        assert_eq!(lenient("\"k-1\"").unwrap(), "k-1");
        assert_eq!(lenient("k-1").unwrap(), "k-1");
        assert_eq!(lenient("  \"k-1\" ").unwrap(), "k-1");
    }

    #[test]
    fn sf_escapes_are_decoded() {
        assert_eq!(lenient(r#""a\"b\\c d""#).unwrap(), r#"a"b\c d"#);
        assert_eq!(lenient(r#""a\nb""#), Err(KeyError::BadQuoting));
    }

    #[test]
    fn strict_mode_refuses_bare_values() {
        let strict = |v: &str| IdempotencyKey::parse(v.as_bytes(), KeyMode::Strict);
        assert_eq!(strict("k-1"), Err(KeyError::NotAString));
        assert_eq!(strict("\"k-1\"").unwrap().as_str(), "k-1");
    }

    #[test]
    fn malformed_keys_are_refused() {
        assert_eq!(lenient(""), Err(KeyError::Empty));
        assert_eq!(lenient("\"\""), Err(KeyError::Empty));
        assert_eq!(lenient("\"abc"), Err(KeyError::BadQuoting));
        assert_eq!(lenient("\"abc\"x"), Err(KeyError::BadQuoting));
        assert_eq!(lenient("a b"), Err(KeyError::InvalidCharacter));
        assert_eq!(lenient("a,b"), Err(KeyError::InvalidCharacter));
        assert_eq!(lenient("a\u{1}b"), Err(KeyError::InvalidCharacter));
        assert_eq!(lenient("\"a\u{7f}\""), Err(KeyError::InvalidCharacter));
        assert_eq!(
            IdempotencyKey::parse(b"caf\xc3\xa9", KeyMode::Lenient),
            Err(KeyError::InvalidCharacter)
        );
    }

    #[test]
    fn length_bounds() {
        assert_eq!(lenient(&"a".repeat(255)).unwrap().len(), 255);
        assert_eq!(lenient(&"a".repeat(256)), Err(KeyError::TooLong));
        assert_eq!(
            lenient(&format!("\"{}\"", "a".repeat(256))),
            Err(KeyError::TooLong)
        );
    }

    #[test]
    fn a_key_made_from_its_text_meets_the_parsers_rules() {
        assert_eq!(
            IdempotencyKey::new("order 42 for bob").unwrap().as_str(),
            "order 42 for bob"
        );
        assert_eq!(IdempotencyKey::new(""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::new("a".repeat(256)), Err(KeyError::TooLong));
        assert_eq!(
            IdempotencyKey::new("a".repeat(255)).unwrap().as_str().len(),
            255
        );
        for bad in ["caf\u{e9}", "a\tb", "a\nb", "\u{7f}"] {
            assert_eq!(
                IdempotencyKey::new(bad),
                Err(KeyError::InvalidCharacter),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_sf_string_parses_back_to_the_key_in_both_modes() {
        for text in [
            "k-1",
            "order 42 for bob",
            r#"say "hi" \o/"#,
            "\\",
            "\"",
            " ",
        ] {
            let key = IdempotencyKey::new(text).unwrap();
            let sf = key.to_sf_string();
            for mode in [KeyMode::Lenient, KeyMode::Strict] {
                assert_eq!(
                    IdempotencyKey::parse(sf.as_bytes(), mode).as_ref(),
                    Ok(&key),
                    "{sf}"
                );
            }
        }
        assert_eq!(
            IdempotencyKey::new(r#"a"b\c"#).unwrap().to_sf_string(),
            r#""a\"b\\c""#
        );
    }

    #[test]
    fn repeated_header_is_refused() {
        let mut h = HeaderMap::new();
        assert_eq!(IdempotencyKey::from_headers(&h, KeyMode::Lenient), Ok(None));
        h.append(IDEMPOTENCY_KEY, "a".parse().unwrap());
        h.append(IDEMPOTENCY_KEY, "b".parse().unwrap());
        assert_eq!(
            IdempotencyKey::from_headers(&h, KeyMode::Lenient),
            Err(KeyError::Repeated)
        );
    }
}
