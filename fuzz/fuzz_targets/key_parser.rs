//! Arbitrary bytes as an `Idempotency-Key` header value, in both modes: the
//! parser returns a key or an error, never panics, and what it returns
//! holds to the documented bounds.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_idempotency::{IdempotencyKey, KeyMode, MAX_KEY_LEN};

fuzz_target!(|data: &[u8]| {
    for mode in [KeyMode::Lenient, KeyMode::Strict] {
        let Ok(key) = IdempotencyKey::parse(data, mode) else {
            continue;
        };
        let s = key.as_str();
        assert!(!s.is_empty() && s.len() <= MAX_KEY_LEN, "{s:?}");
        assert!(s.bytes().all(|b| (0x20..=0x7e).contains(&b)), "{s:?}");
        // The key, quoted again as a Structured Field String, is the same key.
        let quoted = format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""));
        assert_eq!(
            IdempotencyKey::parse(quoted.as_bytes(), KeyMode::Strict).as_ref(),
            Ok(&key)
        );
    }
});
