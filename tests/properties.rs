//! Property tests of the request fingerprint and the key parser, through the
//! public API only.
//!
//! A JSON value is generated as a model ([`J`]), then rendered as text in
//! many ways that mean the same thing (member order, whitespace, string
//! escapes, number spellings) from a seed. Equal meaning must give equal
//! fingerprints; a change of meaning must give a different one.

use bytes::Bytes;
use http::Request;
use proptest::prelude::*;
use proptest::test_runner::Config;
use tower_idempotency::{Fingerprint, FingerprintError, IdempotencyKey, KeyMode, Normalizer};

fn config() -> Config {
    Config {
        cases: 256,
        // Never write regression files into the repository.
        failure_persistence: None,
        ..Config::default()
    }
}

fn fingerprint(body: &[u8]) -> Result<Fingerprint, FingerprintError> {
    let (parts, ()) = Request::post("/orders")
        .header("content-type", "application/json")
        .body(())
        .expect("a valid request")
        .into_parts();
    Normalizer::canonical_json().fingerprint(&parts, &Bytes::copy_from_slice(body))
}

/// A decimal number: `digits × 10^exp`, negative or not. `digits` is empty
/// for zero, else it has no leading and no trailing zero.
#[derive(Clone, Debug)]
struct Num {
    neg: bool,
    digits: String,
    exp: i64,
}

/// A JSON value. Object names are unique.
#[derive(Clone, Debug)]
enum J {
    Null,
    Bool(bool),
    Num(Num),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
}

fn num() -> impl Strategy<Value = Num> {
    prop_oneof![
        1 => Just(Num { neg: false, digits: String::new(), exp: 0 }),
        6 => (any::<bool>(), "[1-9]([0-9]{0,30}[1-9])?", -40i64..40)
            .prop_map(|(neg, digits, exp)| Num { neg, digits, exp }),
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[ab\"\\\\/\u{0}-\u{1f}\u{7f}\u{e9}\u{2028}\u{1f600}]{0,4}",
        prop::collection::vec(any::<char>(), 0..6).prop_map(String::from_iter),
    ]
}

fn json() -> impl Strategy<Value = J> {
    let leaf = prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::Bool),
        num().prop_map(J::Num),
        text().prop_map(J::Str),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(J::Arr),
            prop::collection::btree_map(text(), inner, 0..6)
                .prop_map(|m| J::Obj(m.into_iter().collect())),
        ]
    })
}

/// SplitMix64: the rendering choices, from a seed proptest can shrink.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

fn ws(out: &mut String, rng: &mut Rng) {
    if rng.one_in(2) {
        out.push_str(rng.pick(&[" ", "\t", "\n", "\r\n", "  ", " \t\r\n "]));
    }
}

fn hex4(out: &mut String, rng: &mut Rng, unit: u32) {
    let s = format!("{unit:04x}");
    if rng.one_in(2) {
        out.push_str(&s.to_ascii_uppercase());
    } else {
        out.push_str(&s);
    }
}

fn render_str(out: &mut String, rng: &mut Rng, s: &str) {
    out.push('"');
    for c in s.chars() {
        let short = match c {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            '\u{8}' => Some("\\b"),
            '\u{c}' => Some("\\f"),
            '/' => Some("\\/"),
            _ => None,
        };
        let must_escape = c < ' ' || c == '"' || c == '\\';
        if must_escape || rng.one_in(6) {
            match short {
                Some(e) if rng.one_in(2) => out.push_str(e),
                _ => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str("\\u");
                        hex4(out, rng, u32::from(*unit));
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out.push('"');
}

fn render_num(out: &mut String, rng: &mut Rng, n: &Num) {
    if n.digits.is_empty() {
        out.push_str(rng.pick(&["0", "-0", "0.0", "0e5", "-0.000E-7", "0E+0", "0.00e00"]));
        return;
    }
    if n.neg {
        out.push('-');
    }
    // digits × 10^zeros, with `frac` of them after the point.
    let zeros = rng.below(3);
    let mut mantissa = format!("{}{}", n.digits, "0".repeat(zeros));
    let frac = rng.below(mantissa.len() + 3);
    if frac >= mantissa.len() {
        mantissa = format!("{}{mantissa}", "0".repeat(frac - mantissa.len() + 1));
    }
    let (int, fraction) = mantissa.split_at(mantissa.len() - frac);
    out.push_str(int);
    if !fraction.is_empty() {
        out.push('.');
        out.push_str(fraction);
    }
    let exp = n.exp - zeros as i64 + frac as i64;
    if exp != 0 || rng.one_in(3) {
        out.push_str(rng.pick(&["e", "E"]));
        if exp >= 0 && rng.one_in(2) {
            out.push('+');
        }
        if exp < 0 {
            out.push('-');
        }
        out.push_str(&"0".repeat(rng.below(3)));
        out.push_str(&exp.unsigned_abs().to_string());
    }
}

/// One of the many texts of `j`: members shuffled, whitespace between
/// tokens, strings and numbers spelled in a random way.
fn render(j: &J, rng: &mut Rng) -> String {
    let mut out = String::new();
    ws(&mut out, rng);
    render_into(&mut out, rng, j);
    ws(&mut out, rng);
    out
}

fn render_into(out: &mut String, rng: &mut Rng, j: &J) {
    match j {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Num(n) => render_num(out, rng, n),
        J::Str(s) => render_str(out, rng, s),
        J::Arr(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(out, rng);
                render_into(out, rng, item);
                ws(out, rng);
            }
            if items.is_empty() {
                ws(out, rng);
            }
            out.push(']');
        }
        J::Obj(members) => {
            let mut order: Vec<&(String, J)> = members.iter().collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i + 1));
            }
            out.push('{');
            for (i, (name, value)) in order.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(out, rng);
                render_str(out, rng, name);
                ws(out, rng);
                out.push(':');
                ws(out, rng);
                render_into(out, rng, value);
                ws(out, rng);
            }
            if members.is_empty() {
                ws(out, rng);
            }
            out.push('}');
        }
    }
}

/// The meaning of `j` as one string, independent of the crate: the oracle
/// that tells whether a mutation changed anything.
fn meaning(j: &J) -> String {
    match j {
        J::Null => "null".into(),
        J::Bool(b) => b.to_string(),
        J::Num(n) if n.digits.is_empty() => "0".into(),
        J::Num(n) => format!("{}{}e{}", if n.neg { "-" } else { "" }, n.digits, n.exp),
        J::Str(s) => format!("{s:?}"),
        J::Arr(items) => format!(
            "[{}]",
            items.iter().map(meaning).collect::<Vec<_>>().join(",")
        ),
        J::Obj(members) => {
            let mut m: Vec<_> = members.iter().collect();
            m.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            let m: Vec<_> = m
                .iter()
                .map(|(k, v)| format!("{k:?}:{}", meaning(v)))
                .collect();
            format!("{{{}}}", m.join(","))
        }
    }
}

fn count(j: &J) -> usize {
    1 + match j {
        J::Arr(items) => items.iter().map(count).sum(),
        J::Obj(members) => members.iter().map(|(_, v)| count(v)).sum(),
        _ => 0,
    }
}

/// Changes the meaning of the `target`-th node (pre-order) of `j`.
fn mutate(j: &mut J, target: &mut usize, rng: &mut Rng) -> bool {
    if *target == 0 {
        mutate_here(j, rng);
        return true;
    }
    *target -= 1;
    match j {
        J::Arr(items) => items.iter_mut().any(|item| mutate(item, target, rng)),
        J::Obj(members) => members.iter_mut().any(|(_, v)| mutate(v, target, rng)),
        _ => false,
    }
}

fn mutate_here(j: &mut J, rng: &mut Rng) {
    // A change of nesting, for any node: wrap it in an array or an object.
    if rng.one_in(4) {
        let inner = std::mem::replace(j, J::Null);
        *j = if rng.one_in(2) {
            J::Arr(vec![inner])
        } else {
            J::Obj(vec![("k".into(), inner)])
        };
        return;
    }
    match j {
        J::Null => *j = J::Bool(false),
        J::Bool(b) => *b = !*b,
        J::Str(s) => {
            if !s.is_empty() && rng.one_in(2) {
                s.pop();
            } else {
                s.push(['a', '"', '\u{0}', '\u{e9}'][rng.below(4)]);
            }
        }
        J::Num(n) if n.digits.is_empty() => {
            *n = Num {
                neg: rng.one_in(2),
                digits: "1".into(),
                exp: rng.below(5) as i64 - 2,
            };
        }
        J::Num(n) => match rng.below(4) {
            0 => n.neg = !n.neg,
            1 => n.exp += 1,
            2 => n.digits.insert(0, '1'),
            _ => {
                // Another last digit, still non-zero.
                let last = n.digits.pop().map_or(1, |c| c as u8 - b'0');
                n.digits.push(char::from(b'0' + last % 9 + 1));
            }
        },
        J::Arr(items) if items.len() >= 2 => {
            let a = rng.below(items.len());
            let b = (a + 1 + rng.below(items.len() - 1)) % items.len();
            items.swap(a, b);
        }
        J::Arr(items) if items.len() == 1 => {
            // Unwrap a one-element array: nesting again.
            *j = items.pop().unwrap_or(J::Null);
        }
        J::Arr(items) => items.push(J::Null),
        J::Obj(members) => {
            let name = format!("{}\u{1}", members.first().map_or("", |m| m.0.as_str()));
            if !members.iter().any(|m| m.0 == name) {
                members.push((name, J::Null));
            } else {
                members.clear();
                members.push(("only".into(), J::Bool(true)));
            }
        }
    }
}

/// Printable ASCII without space, `"`, `\` and `,`: what a bare key may hold.
const BARE_KEY: &str = "[!#-+\\--\\[\\]-~]{1,255}";

proptest! {
    #![proptest_config(config())]

    #[test]
    fn order_whitespace_and_spelling_never_change_the_fingerprint(
        j in json(), s1 in any::<u64>(), s2 in any::<u64>()
    ) {
        let a = render(&j, &mut Rng(s1));
        let b = render(&j, &mut Rng(s2));
        let fa = fingerprint(a.as_bytes());
        let fb = fingerprint(b.as_bytes());
        prop_assert!(fa.is_ok(), "{a:?} refused: {fa:?}");
        prop_assert_eq!(fa, fb, "{:?} vs {:?}", a, b);
    }

    #[test]
    fn a_change_of_meaning_changes_the_fingerprint(
        j in json(), target in any::<usize>(), s1 in any::<u64>(), s2 in any::<u64>()
    ) {
        let mut changed = j.clone();
        let mut at = target % count(&j);
        let mut rng = Rng(s1);
        prop_assert!(mutate(&mut changed, &mut at, &mut rng));
        // A swap of two equal array elements changes nothing.
        prop_assume!(meaning(&j) != meaning(&changed));
        let a = render(&j, &mut rng);
        let b = render(&changed, &mut Rng(s2));
        let fa = fingerprint(a.as_bytes());
        let fb = fingerprint(b.as_bytes());
        prop_assert!(fa.is_ok() && fb.is_ok(), "{a:?}: {fa:?}, {b:?}: {fb:?}");
        prop_assert_ne!(fa, fb, "{:?} vs {:?}", a, b);
    }

    #[test]
    fn equal_numbers_spelled_differently_match(n in num(), s1 in any::<u64>(), s2 in any::<u64>()) {
        let a = render(&J::Num(n.clone()), &mut Rng(s1));
        let b = render(&J::Num(n), &mut Rng(s2));
        prop_assert_eq!(fingerprint(a.as_bytes()), fingerprint(b.as_bytes()), "{:?} vs {:?}", a, b);
    }

    #[test]
    fn a_duplicate_name_is_refused(j in json(), name in text(), s in any::<u64>()) {
        let mut rng = Rng(s);
        let mut first = String::new();
        render_str(&mut first, &mut rng, &name);
        let mut second = String::new();
        render_str(&mut second, &mut rng, &name);
        let body = format!("{{{first}:{},{second}:null}}", render(&j, &mut rng));
        let err = fingerprint(body.as_bytes());
        prop_assert!(
            err.as_ref().is_err_and(|e| e.to_string().contains("duplicate object name")),
            "{body:?}: {err:?}"
        );
    }

    #[test]
    fn quoted_and_bare_keys_are_one_key(key in BARE_KEY) {
        let bare = IdempotencyKey::parse(key.as_bytes(), KeyMode::Lenient);
        let quoted = IdempotencyKey::parse(format!("\"{key}\"").as_bytes(), KeyMode::Lenient);
        prop_assert!(bare.is_ok(), "{key:?}: {bare:?}");
        prop_assert_eq!(&bare, &quoted);
        let strict = IdempotencyKey::parse(format!("\"{key}\"").as_bytes(), KeyMode::Strict);
        prop_assert_eq!(&bare, &strict);
        prop_assert_eq!(bare.map(|k| k.as_str() == key), Ok(true));
    }

    #[test]
    fn quoted_keys_unescape_to_any_printable_ascii(key in "[ -~]{1,200}") {
        let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
        for mode in [KeyMode::Lenient, KeyMode::Strict] {
            let parsed = IdempotencyKey::parse(quoted.as_bytes(), mode);
            prop_assert_eq!(parsed.map(|k| k.as_str() == key), Ok(true), "{:?}", quoted);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = IdempotencyKey::parse(&bytes, KeyMode::Lenient);
        let _ = IdempotencyKey::parse(&bytes, KeyMode::Strict);
        let _ = fingerprint(&bytes);
    }

    #[test]
    fn json_like_bytes_never_panic(body in "[\\[\\]{}:,\"\\\\0-9eE.+\\- \tunlratfsx\u{e9}]{0,256}") {
        let _ = fingerprint(body.as_bytes());
        let _ = IdempotencyKey::parse(body.as_bytes(), KeyMode::Lenient);
    }

    #[test]
    fn deep_nesting_is_refused_without_overflow(
        depth in prop_oneof![0usize..=140, 0usize..20_000], obj in any::<bool>()
    ) {
        let (open, close) = if obj { ("{\"a\":", "}") } else { ("[", "]") };
        let body = format!("{}0{}", open.repeat(depth), close.repeat(depth));
        let fp = fingerprint(body.as_bytes());
        if depth <= 128 {
            prop_assert!(fp.is_ok(), "depth {depth}: {fp:?}");
        } else {
            prop_assert!(fp.is_err(), "depth {depth}");
        }
    }
}

#[test]
fn the_pairs_of_the_issue() {
    let fp = |n: &str| fingerprint(format!("{{\"n\":{n}}}").as_bytes()).map_err(|e| e.to_string());
    for (a, b) in [
        ("1234567890123456.78", "1234567890123456.79"),
        ("18446744073709551616", "18446744073709551617"),
        ("0.1", "0.10000000000000001"),
    ] {
        assert_ne!(fp(a), fp(b), "{a} vs {b}");
    }
    for same in ["1", "1.0", "1e0", "10e-1", "100e-2", "0.1e1"] {
        assert_eq!(fp("1"), fp(same), "{same}");
    }
    for zero in ["-0", "0", "0.0", "0e5"] {
        assert_eq!(fp("0"), fp(zero), "{zero}");
    }
}
