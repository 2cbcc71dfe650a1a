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
