//! SQL literals made of hex digits only, for the statements that must go
//! through a text protocol (several statements in one round trip), where
//! parameters cannot be bound. Nothing from a request can change such a
//! statement: every value becomes `[0-9a-f]*` inside a fixed wrapper.

/// Lower-case hex digits of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

/// Hex literal for SQLite and MySQL binary values (`X'…'`).
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn x_literal(value: &[u8]) -> String {
    format!("X'{}'", hex(value))
}

#[cfg(test)]
mod tests {
    #[test]
    fn hex_digits_only() {
        assert_eq!(super::hex(&[0x00, 0xab, 0xff]), "00abff");
        assert!(
            super::hex(b"x'); DROP TABLE t; --")
                .bytes()
                .all(|b| b.is_ascii_hexdigit())
        );
    }
}
