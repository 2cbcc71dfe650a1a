//! [`ConfigError`]: a setting that cannot work, and the checks the
//! builders (the layer's, lease mode's) share. Below both.

use std::time::Duration;

use http::StatusCode;

/// A configuration value that cannot work.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// The status for a key reused with a different request must be `409` or `422`.
    MismatchStatus(StatusCode),
    /// A limit, wait, count or retention was zero.
    Zero(&'static str),
    /// A header that differs from one attempt to the next, or carries a
    /// credential, cannot be part of the fingerprint (see
    /// `IdempotencyLayer::with_fingerprint_headers`).
    FingerprintHeader(http::HeaderName),
    /// A duration was longer than the longest the store's clock arithmetic
    /// (and the protocol) can use.
    TooLong {
        /// The setting.
        what: &'static str,
        /// The longest accepted.
        max: Duration,
    },
    /// Two modes that cannot hold together (the claim-at-commit mode on a
    /// layer in lease mode, whose claim commits before the handler runs).
    ModeConflict {
        /// The mode asked for.
        asked: &'static str,
        /// The mode already set.
        set: &'static str,
    },
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::MismatchStatus(s) => write!(f, "mismatch status must be 409 or 422, not {s}"),
            Self::Zero(what) => write!(f, "{what} must be greater than zero"),
            Self::FingerprintHeader(name) => write!(
                f,
                "{name} cannot be fingerprinted: it differs between attempts or carries a credential"
            ),
            Self::TooLong { what, max } => write!(f, "{what} must be at most {max:?}"),
            Self::ModeConflict { asked, set } => write!(f, "{asked} cannot be used with {set}"),
        }
    }
}

impl std::error::Error for ConfigError {}

/// `value` when it is not zero, else [`ConfigError::Zero`].
pub(crate) fn nonzero<T: Default + PartialEq>(
    value: T,
    what: &'static str,
) -> Result<T, ConfigError> {
    if value == T::default() {
        Err(ConfigError::Zero(what))
    } else {
        Ok(value)
    }
}

/// `value` when it is at most `max`, else [`ConfigError::TooLong`].
pub(crate) fn at_most(
    value: Duration,
    max: Duration,
    what: &'static str,
) -> Result<Duration, ConfigError> {
    if value > max {
        Err(ConfigError::TooLong { what, max })
    } else {
        Ok(value)
    }
}
