//! Arbitrary bytes as a JSON request body: the fingerprint is computed or
//! refused, never panics, and accepts what serde_json accepts but for what
//! the canonical form refuses on purpose (repeated names, deep nesting).

#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tower_idempotency::Normalizer;

fuzz_target!(|data: &[u8]| {
    let Ok(request) = http::Request::post("/fuzz")
        .header("content-type", "application/json")
        .body(())
    else {
        return;
    };
    let (parts, ()) = request.into_parts();
    let ours = Normalizer::canonical_json().fingerprint(&parts, &Bytes::copy_from_slice(data));
    let theirs = serde_json::from_slice::<serde_json::Value>(data);
    match (&ours, &theirs) {
        (Err(e), Ok(_)) => {
            let e = e.to_string();
            assert!(
                e.contains("duplicate object name") || e.contains("exponent out of range"),
                "{e}"
            );
        }
        (Ok(_), Err(e)) => {
            let e = e.to_string();
            assert!(
                e.contains("number out of range") || e.contains("recursion limit"),
                "{e}"
            );
        }
        _ => {}
    }
});
