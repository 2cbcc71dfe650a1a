//! Randomness without a dependency, for jitter and ids that need to be
//! unpredictable, not cryptographic: each call draws fresh keys from the
//! standard library's hasher seeding (per-thread random keys, bumped on
//! every use).

use std::hash::{BuildHasher, Hasher};

/// A random 64-bit number.
pub(crate) fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// A random number below `n` (0 for `n` = 0).
pub(crate) fn random_below(n: u64) -> u64 {
    random_u64() % n.max(1)
}

/// A random (version 4) UUID in its hyphenated text form, for problem
/// documents' `instance`: unique per occurrence, not a secret.
pub(crate) fn uuid_v4() -> String {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&random_u64().to_be_bytes());
    b[8..].copy_from_slice(&random_u64().to_be_bytes());
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}
