//! A streaming JSON canonicalizer: bytes in, canonical bytes out, no tree.
//!
//! The parser follows RFC 8259 with the restrictions of I-JSON (RFC 7493):
//! valid UTF-8 only, no byte order mark, no unpaired surrogate escapes, no
//! duplicate object names (after decoding escapes). It writes the canonical
//! form as it reads:
//!
//! - no whitespace;
//! - object members sorted by the UTF-8 bytes of their decoded names;
//! - strings with `"`, `\` and the control characters below U+0020 escaped
//!   (`\b`, `\t`, `\n`, `\f`, `\r`, else `\u00xx` in lower case), everything
//!   else raw UTF-8;
//! - a number as its exact decimal value, `[-]De[-]N`: the significant
//!   digits `D` without leading or trailing zeros, times ten to the `N`
//!   (`1.50` is `15e-1`, `100` is `1e2`); zero, whatever its sign or
//!   exponent, is `0`;
//! - `true`, `false` and `null` as they are.
//!
//! The canonical form is itself JSON that this parser accepts, so
//! canonicalizing twice changes nothing.
//!
//! Objects are sorted without building a tree: each member's canonical
//! `"name":value` is written to the output as it is read, its position
//! remembered; when the object closes, and only if its members are not
//! already in order, the object's region of the output is rewritten in
//! sorted order through one scratch buffer shared by the whole run. Every
//! byte is moved at most once per enclosing object, so the work is bounded
//! by the body's length times [`MAX_DEPTH`].

use std::fmt;
use std::ops::Range;

use super::FingerprintError;

/// The deepest nesting of arrays and objects accepted (serde_json's default
/// recursion limit is the same number).
pub(crate) const MAX_DEPTH: usize = 128;

/// The longest piece of an object name quoted back in an error, in bytes.
const ECHO_LEN: usize = 32;

/// Canonicalizes a JSON text; the error is worded for the client, as the
/// `detail` of a `400` problem.
pub(crate) fn canonical_json(bytes: &[u8]) -> Result<Vec<u8>, FingerprintError> {
    canonicalize(bytes)
        .map_err(|e| FingerprintError::new(format!("the request body is not valid JSON: {e}")))
}

/// Canonicalizes a JSON text.
pub(crate) fn canonicalize(input: &[u8]) -> Result<Vec<u8>, SyntaxError> {
    if let Err(e) = std::str::from_utf8(input) {
        return Err(SyntaxError::new(e.valid_up_to(), What::Utf8));
    }
    if input.starts_with("\u{feff}".as_bytes()) {
        return Err(SyntaxError::new(0, What::Bom));
    }
    let mut c = Canon {
        input,
        pos: 0,
        depth: 0,
        out: Vec::with_capacity(input.len() + input.len() / 4 + 8),
        names: Vec::new(),
        members: Vec::new(),
        scratch: Vec::new(),
    };
    c.skip_ws();
    if c.pos == input.len() {
        return Err(SyntaxError::new(c.pos, What::Empty));
    }
    c.value()?;
    c.skip_ws();
    if c.pos != input.len() {
        return Err(SyntaxError::new(c.pos, What::Trailing));
    }
    Ok(c.out)
}

/// Where and why a text is not (I-)JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SyntaxError {
    /// Byte offset into the input, counted from 0.
    at: usize,
    what: What,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum What {
    Utf8,
    Bom,
    Empty,
    Eof,
    Expected(&'static str, u8),
    Trailing,
    Control,
    Escape,
    Surrogate,
    Number,
    Exponent,
    Depth,
    /// The name, escaped, quoted and cut short.
    Duplicate(String),
}

impl SyntaxError {
    fn new(at: usize, what: What) -> Self {
        Self { at, what }
    }
}

impl fmt::Display for SyntaxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.what {
            What::Utf8 => f.write_str("invalid UTF-8")?,
            What::Bom => f.write_str("a byte order mark")?,
            What::Empty => return f.write_str("the body is empty"),
            What::Eof => f.write_str("unexpected end")?,
            What::Expected(what, found) if found.is_ascii_graphic() => {
                write!(f, "expected {what}, found '{}'", char::from(*found))?
            }
            What::Expected(what, found) => write!(f, "expected {what}, found byte 0x{found:02x}")?,
            What::Trailing => f.write_str("unexpected data after the value")?,
            What::Control => f.write_str("unescaped control character in a string")?,
            What::Escape => f.write_str("invalid escape in a string")?,
            What::Surrogate => f.write_str("unpaired surrogate escape in a string")?,
            What::Number => f.write_str("invalid number")?,
            What::Exponent => f.write_str("number exponent out of range")?,
            What::Depth => write!(f, "nested deeper than {MAX_DEPTH} levels")?,
            What::Duplicate(name) => write!(f, "duplicate object name {name}")?,
        }
        write!(f, " at byte {}", self.at)
    }
}

impl std::error::Error for SyntaxError {}

/// One member of an open object.
struct Member {
    /// Its decoded name, in `Canon::names`.
    name: Range<usize>,
    /// Its canonical `"name":value`, in `Canon::out`.
    span: Range<usize>,
    /// Where its name starts in the input.
    at: usize,
}

struct Canon<'a> {
    input: &'a [u8],
    pos: usize,
    depth: usize,
    out: Vec<u8>,
    /// The decoded names of the members of the open objects, innermost last.
    names: Vec<u8>,
    /// The members of the open objects, innermost last.
    members: Vec<Member>,
    /// Where an object is put in order.
    scratch: Vec<u8>,
}

fn slice<T>(buf: &[T], range: Range<usize>) -> &[T] {
    buf.get(range).unwrap_or_default()
}

impl Canon<'_> {
    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn expected(&self, what: &'static str) -> SyntaxError {
        match self.peek() {
            Some(b) => SyntaxError::new(self.pos, What::Expected(what, b)),
            None => SyntaxError::new(self.pos, What::Eof),
        }
    }

    /// One value, after optional whitespace.
    fn value(&mut self) -> Result<(), SyntaxError> {
        self.skip_ws();
        match self.peek() {
            Some(b'{') => self.object(),
            Some(b'[') => self.array(),
            Some(b'"') => {
                self.pos += 1;
                self.out.push(b'"');
                string(self.input, &mut self.pos, &mut self.out, true)?;
                self.out.push(b'"');
                Ok(())
            }
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => Err(self.expected("a value")),
        }
    }

    fn literal(&mut self, word: &'static [u8]) -> Result<(), SyntaxError> {
        let end = self.pos + word.len();
        if self.input.get(self.pos..end) == Some(word) {
            self.out.extend_from_slice(word);
            self.pos = end;
            Ok(())
        } else {
            Err(self.expected("a value"))
        }
    }

    fn enter(&mut self) -> Result<(), SyntaxError> {
        if self.depth == MAX_DEPTH {
            return Err(SyntaxError::new(self.pos, What::Depth));
        }
        self.depth += 1;
        self.pos += 1;
        Ok(())
    }

    fn array(&mut self) -> Result<(), SyntaxError> {
        self.enter()?;
        self.out.push(b'[');
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
        } else {
            loop {
                self.value()?;
                self.skip_ws();
                match self.peek() {
                    Some(b',') => {
                        self.pos += 1;
                        self.out.push(b',');
                    }
                    Some(b']') => {
                        self.pos += 1;
                        break;
                    }
                    _ => return Err(self.expected("',' or ']'")),
                }
            }
        }
        self.out.push(b']');
        self.depth -= 1;
        Ok(())
    }

    fn object(&mut self) -> Result<(), SyntaxError> {
        self.enter()?;
        if self.members.capacity() == 0 {
            // Sized once, at the first object, for a small body's names and
            // members (grown from empty, they allocated several times).
            self.names.reserve(self.input.len().min(256));
            self.members.reserve(16);
        }
        self.out.push(b'{');
        let region = self.out.len();
        let first_member = self.members.len();
        let first_name = self.names.len();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
        } else {
            loop {
                self.skip_ws();
                if self.peek() != Some(b'"') {
                    return Err(self.expected("a string (an object name)"));
                }
                let at = self.pos;
                self.pos += 1;
                let name_start = self.names.len();
                string(self.input, &mut self.pos, &mut self.names, false)?;
                let name = name_start..self.names.len();
                if self.members.len() > first_member {
                    self.out.push(b',');
                }
                let span_start = self.out.len();
                self.out.push(b'"');
                escape_into(&mut self.out, slice(&self.names, name.clone()));
                self.out.extend_from_slice(b"\":");
                self.skip_ws();
                if self.peek() != Some(b':') {
                    return Err(self.expected("':'"));
                }
                self.pos += 1;
                self.value()?;
                self.members.push(Member {
                    name,
                    span: span_start..self.out.len(),
                    at,
                });
                self.skip_ws();
                match self.peek() {
                    Some(b',') => self.pos += 1,
                    Some(b'}') => {
                        self.pos += 1;
                        break;
                    }
                    _ => return Err(self.expected("',' or '}'")),
                }
            }
            self.put_in_order(first_member, region)?;
        }
        self.members.truncate(first_member);
        self.names.truncate(first_name);
        self.out.push(b'}');
        self.depth -= 1;
        Ok(())
    }

    /// Sorts the members of the object that closed (`members[first..]`,
    /// written from `out[region..]`) by their decoded names and refuses a
    /// name that appears twice.
    fn put_in_order(&mut self, first: usize, region: usize) -> Result<(), SyntaxError> {
        let Self {
            out,
            names,
            members,
            scratch,
            ..
        } = self;
        let members = members.get_mut(first..).unwrap_or_default();
        let name = |m: &Member| slice(names, m.name.clone());
        let in_order = members.windows(2).all(|w| match w {
            [a, b] => name(a) < name(b),
            _ => true,
        });
        if in_order {
            return Ok(());
        }
        members.sort_unstable_by(|a, b| name(a).cmp(name(b)).then(a.at.cmp(&b.at)));
        // Of the repeated names, report the one repeated first in the body.
        let duplicate = members
            .windows(2)
            .filter_map(|w| match w {
                [a, b] if name(a) == name(b) => Some(b),
                _ => None,
            })
            .min_by_key(|m| m.at);
        if let Some(m) = duplicate {
            return Err(SyntaxError::new(m.at, What::Duplicate(echo_name(name(m)))));
        }
        scratch.clear();
        scratch.reserve(out.len().saturating_sub(region));
        for (i, m) in members.iter().enumerate() {
            if i > 0 {
                scratch.push(b',');
            }
            scratch.extend_from_slice(slice(out, m.span.clone()));
        }
        out.truncate(region);
        out.extend_from_slice(scratch);
        Ok(())
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, written as
    /// its exact decimal value.
    fn number(&mut self) -> Result<(), SyntaxError> {
        let start = self.pos;
        let input = self.input;
        let digits_from = |mut pos: usize| {
            while input.get(pos).is_some_and(u8::is_ascii_digit) {
                pos += 1;
            }
            pos
        };
        let negative = self.peek() == Some(b'-');
        if negative {
            self.pos += 1;
        }
        let int = match self.peek() {
            Some(b'0') => self.pos..self.pos + 1,
            Some(b'1'..=b'9') => self.pos..digits_from(self.pos + 1),
            _ => return Err(SyntaxError::new(start, What::Number)),
        };
        self.pos = int.end;
        if self.peek().is_some_and(|b| b.is_ascii_digit()) {
            // A leading zero, as in `01`.
            return Err(SyntaxError::new(start, What::Number));
        }
        let mut frac = self.pos..self.pos;
        if self.peek() == Some(b'.') {
            frac = self.pos + 1..digits_from(self.pos + 1);
            if frac.is_empty() {
                return Err(SyntaxError::new(start, What::Number));
            }
            self.pos = frac.end;
        }
        let mut exp_negative = false;
        let mut exp = self.pos..self.pos;
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            if let Some(sign @ (b'+' | b'-')) = self.peek() {
                exp_negative = sign == b'-';
                self.pos += 1;
            }
            exp = self.pos..digits_from(self.pos);
            if exp.is_empty() {
                return Err(SyntaxError::new(start, What::Number));
            }
            self.pos = exp.end;
        }

        // The significant digits are int ++ frac, less leading and trailing
        // zeros; the value is them times 10^(exp - frac.len() + trailing).
        let int = slice(input, int);
        let frac = slice(input, frac);
        let nonzero = |b: &u8| *b != b'0';
        let first = int
            .iter()
            .position(nonzero)
            .or_else(|| frac.iter().position(nonzero).map(|i| i + int.len()));
        let last = frac
            .iter()
            .rposition(nonzero)
            .map(|i| i + int.len())
            .or_else(|| int.iter().rposition(nonzero));
        let (Some(first), Some(last)) = (first, last) else {
            // Zero, whatever its sign and exponent.
            self.out.push(b'0');
            return Ok(());
        };
        // The exponent of the canonical form, computed in i128, where
        // nothing a body can hold overflows: a written exponent beyond
        // i128 is beyond i64 after any adjustment a body's length allows.
        let out_of_range = || SyntaxError::new(start, What::Exponent);
        let mut e: i128 = 0;
        for d in slice(input, exp) {
            e = e
                .checked_mul(10)
                .and_then(|e| e.checked_add(i128::from(d - b'0')))
                .ok_or_else(out_of_range)?;
        }
        if exp_negative {
            e = -e;
        }
        let trailing = int.len() + frac.len() - 1 - last;
        let e = i128::try_from(frac.len())
            .ok()
            .zip(i128::try_from(trailing).ok())
            .and_then(|(f, t)| e.checked_sub(f)?.checked_add(t))
            .and_then(|e| i64::try_from(e).ok())
            .ok_or_else(out_of_range)?;

        if negative {
            self.out.push(b'-');
        }
        if first < int.len() {
            self.out
                .extend_from_slice(slice(int, first..(last + 1).min(int.len())));
        }
        if last >= int.len() {
            let from = first.max(int.len()) - int.len();
            self.out
                .extend_from_slice(slice(frac, from..last + 1 - int.len()));
        }
        self.out.push(b'e');
        push_i64(&mut self.out, e);
        Ok(())
    }
}

fn push_i64(out: &mut Vec<u8>, n: i64) {
    if n < 0 {
        out.push(b'-');
    }
    let mut n = n.unsigned_abs();
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        if let Some(slot) = buf.get_mut(i) {
            // `n % 10` is below 10.
            *slot = b'0' + (n % 10) as u8;
        }
        n /= 10;
        if n == 0 || i == 0 {
            break;
        }
    }
    out.extend_from_slice(slice(&buf, i..buf.len()));
}

/// Reads a string from just after its opening quote to just after its
/// closing one. `escape`: write it canonically escaped (without the
/// quotes); else write it decoded.
fn string(
    input: &[u8],
    pos: &mut usize,
    dst: &mut Vec<u8>,
    escape: bool,
) -> Result<(), SyntaxError> {
    loop {
        let rest = input.get(*pos..).unwrap_or_default();
        // A run of bytes that stand for themselves. The input is valid
        // UTF-8 and the run stops only at ASCII bytes, so it is whole
        // characters, and none needs escaping.
        let Some(run) = rest
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
        else {
            return Err(SyntaxError::new(input.len(), What::Eof));
        };
        dst.extend_from_slice(slice(rest, 0..run));
        *pos += run;
        match rest.get(run) {
            Some(b'"') => {
                *pos += 1;
                return Ok(());
            }
            Some(b'\\') => {
                let c = unescape(input, pos)?;
                if escape {
                    escape_char(dst, c);
                } else {
                    let mut buf = [0u8; 4];
                    dst.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
            _ => return Err(SyntaxError::new(*pos, What::Control)),
        }
    }
}

/// Decodes the escape at `*pos` (a backslash) and moves past it.
fn unescape(input: &[u8], pos: &mut usize) -> Result<char, SyntaxError> {
    let at = *pos;
    let bad = || SyntaxError::new(at, What::Escape);
    let c = match input.get(at + 1) {
        Some(b'"') => '"',
        Some(b'\\') => '\\',
        Some(b'/') => '/',
        Some(b'b') => '\u{8}',
        Some(b'f') => '\u{c}',
        Some(b'n') => '\n',
        Some(b'r') => '\r',
        Some(b't') => '\t',
        Some(b'u') => {
            let unit = hex4(input, at + 2).ok_or_else(bad)?;
            *pos = at + 6;
            let code = match unit {
                0xD800..=0xDBFF => {
                    let low = match (input.get(at + 6), input.get(at + 7)) {
                        (Some(b'\\'), Some(b'u')) => hex4(input, at + 8),
                        _ => None,
                    };
                    match low {
                        Some(low @ 0xDC00..=0xDFFF) => {
                            *pos = at + 12;
                            0x10000 + ((u32::from(unit) - 0xD800) << 10) + (u32::from(low) - 0xDC00)
                        }
                        _ => return Err(SyntaxError::new(at, What::Surrogate)),
                    }
                }
                0xDC00..=0xDFFF => return Err(SyntaxError::new(at, What::Surrogate)),
                _ => u32::from(unit),
            };
            return char::from_u32(code).ok_or_else(bad);
        }
        Some(_) => return Err(bad()),
        None => return Err(SyntaxError::new(input.len(), What::Eof)),
    };
    *pos = at + 2;
    Ok(c)
}

fn hex4(input: &[u8], at: usize) -> Option<u16> {
    let digits = input.get(at..at + 4)?;
    digits.iter().try_fold(0u16, |n, &b| {
        let d = char::from(b).to_digit(16)?;
        // Four hex digits fit in 16 bits.
        Some((n << 4) | d as u16)
    })
}

fn escape_char(dst: &mut Vec<u8>, c: char) {
    if c.is_ascii() {
        escape_byte(dst, c as u8);
    } else {
        let mut buf = [0u8; 4];
        dst.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
    }
}

fn escape_byte(dst: &mut Vec<u8>, b: u8) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    match b {
        b'"' => dst.extend_from_slice(b"\\\""),
        b'\\' => dst.extend_from_slice(b"\\\\"),
        0x08 => dst.extend_from_slice(b"\\b"),
        b'\t' => dst.extend_from_slice(b"\\t"),
        b'\n' => dst.extend_from_slice(b"\\n"),
        0x0C => dst.extend_from_slice(b"\\f"),
        b'\r' => dst.extend_from_slice(b"\\r"),
        0..0x20 => {
            let hex = |n: u8| HEX.get(usize::from(n)).copied().unwrap_or(b'0');
            dst.extend_from_slice(&[b'\\', b'u', b'0', b'0', hex(b >> 4), hex(b & 0xF)]);
        }
        _ => dst.push(b),
    }
}

/// Writes decoded UTF-8 `s` canonically escaped. Bytes of multi-byte
/// characters are all at or above 0x80, so escaping byte by byte is exact.
fn escape_into(dst: &mut Vec<u8>, s: &[u8]) {
    for &b in s {
        escape_byte(dst, b);
    }
}

/// An object name for an error message: escaped, quoted, and cut to
/// [`ECHO_LEN`] bytes on a character boundary.
fn echo_name(name: &[u8]) -> String {
    let name = String::from_utf8_lossy(name);
    let mut cut = name.len().min(ECHO_LEN);
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    let short = name.get(..cut).unwrap_or_default();
    let mut quoted = vec![b'"'];
    escape_into(&mut quoted, short.as_bytes());
    if cut < name.len() {
        quoted.extend_from_slice("…".as_bytes());
    }
    quoted.push(b'"');
    String::from_utf8_lossy(&quoted).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::Config;

    fn canon(s: &str) -> Result<String, String> {
        canonical_bytes(s.as_bytes())
    }

    fn canonical_bytes(b: &[u8]) -> Result<String, String> {
        canonicalize(b)
            .map(|v| String::from_utf8(v).unwrap())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn canonical_forms() {
        for (input, expected) in [
            // numbers
            ("1", "1e0"),
            ("1.50", "15e-1"),
            ("100", "1e2"),
            ("-0", "0"),
            ("0.000", "0"),
            ("-0e-7", "0"),
            ("0e99999999999999999999999999", "0"),
            ("-1.5e-3", "-15e-4"),
            ("123.456E+2", "123456e-1"),
            ("0.000123", "123e-6"),
            ("1e+2", "1e2"),
            ("1E-0002", "1e-2"),
            ("10.0100", "1001e-2"),
            ("18446744073709551617", "18446744073709551617e0"),
            ("1234567890123456.78", "123456789012345678e-2"),
            ("0.10000000000000001", "10000000000000001e-17"),
            ("1e9223372036854775807", "1e9223372036854775807"),
            ("1e-9223372036854775807", "1e-9223372036854775807"),
            ("0.1e-9223372036854775807", "1e-9223372036854775808"),
            ("1.5e-9223372036854775807", "15e-9223372036854775808"),
            ("0.1e9223372036854775808", "1e9223372036854775807"),
            (
                "1000e-00000000000000000000000000000000000000000000000003",
                "1e0",
            ),
            // strings
            (r#""\u0041\/\n\u001F\"\\""#, r#""A/\n\u001f\"\\""#),
            (r#""\b\f\r\t\u0000\u007f""#, "\"\\b\\f\\r\\t\\u0000\u{7f}\""),
            (r#""\ud83d\uDE00é""#, "\"😀é\""),
            ("\"\u{2028}\"", "\"\u{2028}\""),
            // structure
            (" \t\r\n[ ] ", "[]"),
            ("{ }", "{}"),
            ("[true,false,null]", "[true,false,null]"),
            (
                r#"{"b":[1,{"d":1,"c":2}],"a":{}}"#,
                r#"{"a":{},"b":[1e0,{"c":2e0,"d":1e0}]}"#,
            ),
            // by decoded bytes: '"' (0x22) < '#' (0x23) < 'b' < 'é'
            (
                r##"{"\u00e9":0,"b":1,"#":2,"\"":3}"##,
                r##"{"\"":3e0,"#":2e0,"b":1e0,"é":0}"##,
            ),
            (r#"{"ab":1,"a":2,"":3}"#, r#"{"":3e0,"a":2e0,"ab":1e0}"#),
        ] {
            assert_eq!(canon(input).as_deref(), Ok(expected), "{input}");
        }
    }

    #[test]
    fn exponent_limits() {
        let refused = "number exponent out of range at byte 0";
        for input in [
            "1e9223372036854775808",
            "10e9223372036854775807",
            "0.1e-9223372036854775808",
            "1e-9223372036854775809",
            "1.55e-9223372036854775807",
        ] {
            assert_eq!(canon(input), Err(refused.into()), "{input}");
        }
        // Beyond i128 as written, too.
        assert_eq!(canon(&format!("1e{}", "9".repeat(60))), Err(refused.into()));
        assert_eq!(
            canon("[1e99999999999999999999]"),
            Err("number exponent out of range at byte 1".into())
        );
    }

    #[test]
    fn refusals_name_the_place() {
        for (input, message) in [
            (
                r#"{"a":1,"\u0061":2}"#,
                r#"duplicate object name "a" at byte 7"#,
            ),
            (
                r#"{"b":0,"a":1,"b":2,"a":3}"#,
                r#"duplicate object name "b" at byte 13"#,
            ),
            (
                r#"[{"x":{"\"":1,"\"":2}}]"#,
                r#"duplicate object name "\"" at byte 14"#,
            ),
            ("", "the body is empty"),
            (" \n", "the body is empty"),
            ("\u{feff}{}", "a byte order mark at byte 0"),
            ("{\"a\":1", "unexpected end at byte 6"),
            (
                "{\"a\":1,}",
                "expected a string (an object name), found '}' at byte 7",
            ),
            (
                "{,}",
                "expected a string (an object name), found ',' at byte 1",
            ),
            ("{\"a\" 1}", "expected ':', found '1' at byte 5"),
            ("[1,]", "expected a value, found ']' at byte 3"),
            ("[1 2]", "expected ',' or ']', found '2' at byte 3"),
            (
                "{\"a\":1 \"b\":2}",
                "expected ',' or '}', found '\"' at byte 7",
            ),
            ("1 2", "unexpected data after the value at byte 2"),
            ("{}{}", "unexpected data after the value at byte 2"),
            ("tru", "expected a value, found 't' at byte 0"),
            ("nul", "expected a value, found 'n' at byte 0"),
            ("NaN", "expected a value, found 'N' at byte 0"),
            ("'a'", "expected a value, found ''' at byte 0"),
            ("\u{c}1", "expected a value, found byte 0x0c at byte 0"),
            ("\u{a0}1", "expected a value, found byte 0xc2 at byte 0"),
            ("01", "invalid number at byte 0"),
            ("-01", "invalid number at byte 0"),
            ("1.", "invalid number at byte 0"),
            (".5", "expected a value, found '.' at byte 0"),
            ("1e", "invalid number at byte 0"),
            ("1e+", "invalid number at byte 0"),
            ("+1", "expected a value, found '+' at byte 0"),
            ("-", "invalid number at byte 0"),
            ("[-a]", "invalid number at byte 1"),
            (
                "\"a\tb\"",
                "unescaped control character in a string at byte 2",
            ),
            (
                "\"a\u{0}\"",
                "unescaped control character in a string at byte 2",
            ),
            ("\"abc", "unexpected end at byte 4"),
            ("\"\\", "unexpected end at byte 2"),
            (r#""\x""#, "invalid escape in a string at byte 1"),
            (r#""\u12""#, "invalid escape in a string at byte 1"),
            (r#""\u12g4""#, "invalid escape in a string at byte 1"),
            (
                r#""\ud800""#,
                "unpaired surrogate escape in a string at byte 1",
            ),
            (
                r#""a\udc00""#,
                "unpaired surrogate escape in a string at byte 2",
            ),
            (
                r#""\ud800\u0041""#,
                "unpaired surrogate escape in a string at byte 1",
            ),
            (
                r#""\ud800\ud800""#,
                "unpaired surrogate escape in a string at byte 1",
            ),
            (
                r#""\ud800\n""#,
                "unpaired surrogate escape in a string at byte 1",
            ),
        ] {
            assert_eq!(canon(input), Err(message.into()), "{input:?}");
        }
    }

    #[test]
    fn invalid_utf8_is_refused() {
        for (input, at) in [
            (&b"\"\xff\""[..], 1),
            (b"\"\xc0\x80\"", 1),       // overlong NUL
            (b"[\"\xed\xa0\x80\"]", 2), // an encoded surrogate
            (b"\"\xe2\x82\"", 1),       // cut short
            (b"{\"a\":1}\xe2", 7),
        ] {
            assert_eq!(
                canonical_bytes(input),
                Err(format!("invalid UTF-8 at byte {at}")),
                "{input:?}"
            );
        }
    }

    #[test]
    fn nesting_is_bounded() {
        let nest = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(canon(&nest(MAX_DEPTH)).is_ok());
        assert_eq!(
            canon(&nest(MAX_DEPTH + 1)),
            Err("nested deeper than 128 levels at byte 128".into())
        );
        // No stack overflow, however deep the body tries to go.
        assert!(canon(&"[".repeat(1_000_000)).is_err());
        assert!(canon(&"{\"a\":".repeat(1_000_000)).is_err());
        let objects = format!("{}1{}", "{\"a\":".repeat(MAX_DEPTH), "}".repeat(MAX_DEPTH));
        assert!(canon(&objects).is_ok());
    }

    #[test]
    fn errors_echo_only_a_short_piece() {
        let long = "é".repeat(10_000);
        let err = canon(&format!("{{\"{long}\":1,\"{long}\":2}}")).unwrap_err();
        assert!(err.len() < 100, "{err}");
        assert!(err.starts_with("duplicate object name \"éééé"), "{err}");
        assert!(err.contains("…\" at byte 20006"), "{err}");
        let err = canon(&format!("{{\"\\u0001{long}\":1,\"\\u0001{long}\":2}}")).unwrap_err();
        assert!(err.contains("\"\\u0001é"), "{err}");
    }

    #[test]
    fn push_i64_writes_every_value() {
        for n in [0, 1, -1, 9, 10, -10, 1234567890, i64::MAX, i64::MIN] {
            let mut out = Vec::new();
            push_i64(&mut out, n);
            assert_eq!(String::from_utf8(out).unwrap(), n.to_string());
        }
    }

    fn config() -> Config {
        Config {
            cases: 256,
            failure_persistence: None,
            ..Config::default()
        }
    }

    const WS: &str = "[ \t\r\n]{0,2}";
    const STRING: &str = r#""([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u00[0-9a-fA-F]{2}|\\u[4-9a-cA-C][0-9a-f]{3}|\\ud83d\\ude00){0,5}""#;
    const NUMBER: &str = "-?(0|[1-9][0-9]{0,25})(\\.[0-9]{1,25})?([eE][+-]?[0-9]{1,3})?";
    /// Numbers that a `serde_json::Value` holds exactly.
    const SMALL_INT: &str = "-?(0|[1-9][0-9]{0,14})";

    /// JSON texts with whitespace, escapes and all number forms.
    fn json_text(number: &'static str) -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_string()),
            Just("true".to_string()),
            Just("false".to_string()),
            number,
            STRING,
        ];
        leaf.prop_recursive(4, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec((WS, inner.clone(), WS), 0..6).prop_map(|items| {
                    let items: Vec<_> = items.into_iter().map(|(a, v, b)| a + &v + &b).collect();
                    format!("[{}]", items.join(","))
                }),
                prop::collection::vec((WS, STRING, WS, WS, inner, WS), 0..6).prop_map(|members| {
                    let members: Vec<_> = members
                        .into_iter()
                        .map(|(a, k, b, c, v, d)| format!("{a}{k}{b}:{c}{v}{d}"))
                        .collect();
                    format!("{{{}}}", members.join(","))
                }),
            ]
        })
    }

    fn is_duplicate(e: &SyntaxError) -> bool {
        matches!(e.what, What::Duplicate(_))
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn canonicalization_is_idempotent(text in json_text(NUMBER)) {
            match canonicalize(text.as_bytes()) {
                Ok(once) => {
                    let twice = canonicalize(&once);
                    prop_assert_eq!(twice, Ok(once), "{}", text);
                }
                Err(e) => prop_assert!(is_duplicate(&e), "{text:?}: {e}"),
            }
        }

        /// Strings, escapes and order agree with serde_json's own decoding.
        #[test]
        fn agrees_with_serde_json(text in json_text(SMALL_INT)) {
            let ours = canonicalize(text.as_bytes());
            let value: serde_json::Value = serde_json::from_str(&text).unwrap();
            let theirs = canonicalize(&serde_json::to_vec(&value).unwrap());
            match ours {
                Ok(ours) => prop_assert_eq!(Ok(ours), theirs),
                Err(e) => prop_assert!(is_duplicate(&e), "{text:?}: {e}"),
            }
        }

        /// What we accept, serde_json accepts, and the other way around,
        /// but for duplicate names and numbers beyond f64 (`1e999`).
        #[test]
        fn accepts_what_serde_json_accepts(
            text in json_text(NUMBER),
            at in any::<prop::sample::Index>(),
            op in 0..3u8,
            byte in prop::sample::select(b"[]{}:,\"\\0123456789eE.+- \tu\x01\xc3\xa9".to_vec()),
        ) {
            let mut bytes = text.into_bytes();
            let i = at.index(bytes.len() + 1);
            match op {
                0 if i < bytes.len() => { bytes.remove(i); }
                1 if i < bytes.len() => bytes[i] = byte,
                _ => bytes.insert(i, byte),
            }
            let ours = canonicalize(&bytes);
            let theirs = serde_json::from_slice::<serde_json::Value>(&bytes);
            match (&ours, &theirs) {
                (Ok(_), Ok(_)) => {}
                (Err(_), Err(_)) => {}
                (Err(e), Ok(_)) => prop_assert!(is_duplicate(e), "{bytes:?}: {e}"),
                (Ok(_), Err(e)) => prop_assert!(
                    e.to_string().contains("number out of range"),
                    "{:?}: {e}", String::from_utf8_lossy(&bytes)
                ),
            }
            if let Ok(once) = ours {
                prop_assert_eq!(canonicalize(&once), Ok(once));
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(once) = canonicalize(&bytes) {
                prop_assert_eq!(canonicalize(&once), Ok(once));
            }
        }
    }
}
