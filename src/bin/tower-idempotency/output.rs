//! What every command shares: how a command ends, and how stored text
//! and times are printed.

use serde_json::Value;

/// How a command ended.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Refused, or not found: exit 1.
    Refused(String, Option<Value>),
    /// Bad usage, or no database: exit 2.
    Usage(String),
}

pub(crate) type Outcome = Result<(), Failure>;

pub(crate) fn usage(msg: impl std::fmt::Display) -> Failure {
    Failure::Usage(msg.to_string())
}

pub(crate) fn store(e: sqlx::Error) -> Failure {
    Failure::Usage(format!("database: {e}"))
}

/// A message as one line: clap's usage block and tips dropped, line breaks
/// folded.
pub(crate) fn one_line(msg: &str) -> String {
    msg.lines()
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Stored text as a terminal may show it: control characters (a terminal
/// escape sequence, a newline) written as `\x1b` or `\u{…}`, and a
/// backslash as `\\`, so nothing stored reaches the terminal raw and the
/// spelling is never ambiguous.
/// Invisible characters that reorder or hide what a terminal shows: the
/// bidirectional controls, zero-width characters and the byte order mark.
fn reorders(c: char) -> bool {
    matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}')
}

pub(crate) fn shown(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            c if c.is_control() && (c as u32) < 0x80 => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if c.is_control() || reorders(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

pub(crate) fn clip(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        return s.to_string();
    }
    let mut out: String = s.chars().take(width.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// Epoch milliseconds as `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub(crate) fn time(ms: i64) -> String {
    let (secs, millis) = (ms.div_euclid(1000), ms.rem_euclid(1000));
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn stored_text_is_shown_escaped() {
        assert_eq!(super::shown("a\u{1b}[31mb"), "a\\x1b[31mb");
        assert_eq!(super::shown("a\\x1b"), "a\\\\x1b");
        assert_eq!(super::shown("line\nnext\u{85}"), "line\\x0anext\\u{85}");
        assert_eq!(super::shown("plain ü"), "plain ü");
        // A right-to-left override would make the terminal show the rest reversed.
        assert_eq!(super::shown("a\u{202e}1-yap"), "a\\u{202e}1-yap");
        assert_eq!(super::shown("a\u{200b}b\u{feff}"), "a\\u{200b}b\\u{feff}");
    }

    #[test]
    fn times_are_utc_iso_8601() {
        assert_eq!(super::time(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(super::time(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(super::time(1_796_188_611_281), "2026-12-02T05:16:51.281Z");
        assert_eq!(super::time(-1), "1969-12-31T23:59:59.999Z");
    }

    #[test]
    fn clap_errors_become_one_line() {
        let e = "error: the following required arguments were not provided:\n  --reason <REASON>\n\nUsage: tower-idempotency resolve --reason <REASON>\n\nFor more information, try '--help'.\n";
        assert_eq!(
            super::one_line(e),
            "error: the following required arguments were not provided: --reason <REASON>"
        );
    }
}
