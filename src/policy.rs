//! [`Policy`]: retention and limits chosen per request (per tenant, per
//! route) by a function the layer calls before it claims the key.

use std::time::Duration;

use crate::config::{Config, MAX_WAIT};
use crate::config_error::{ConfigError, at_most, nonzero};

/// The settings one request runs with where they differ from the layer's:
/// what [`IdempotencyLayer::with_policy`](crate::IdempotencyLayer::with_policy)'s
/// function returns. A setting left unset is the layer's. Each setter
/// checks its value as the layer's setter of the same name does (a value
/// that cannot work is a [`ConfigError`] when the policy is built, never a
/// surprise on a request).
///
/// The retention chosen is the record's own: its `expires_at` is written
/// with the record, and the `410` decision and the [`Sweeper`](crate::Sweeper)
/// read that column, so records of different retentions sit side by side
/// in one ledger and each expires on its own clock. Changing a policy
/// changes new records only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Policy {
    retention: Option<Duration>,
    max_request_body: Option<usize>,
    max_response_body: Option<usize>,
    in_flight_wait: Option<Duration>,
}

impl Policy {
    /// The layer's own settings, changed by the setters below.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long this request's key is honoured (see
    /// [`with_retention`](crate::IdempotencyLayer::with_retention)).
    pub fn with_retention(mut self, retention: Duration) -> Result<Self, ConfigError> {
        self.retention = Some(nonzero(retention, "retention")?);
        Ok(self)
    }

    /// The largest request body buffered (see
    /// [`with_max_request_body`](crate::IdempotencyLayer::with_max_request_body)).
    pub fn with_max_request_body(mut self, bytes: usize) -> Result<Self, ConfigError> {
        self.max_request_body = Some(nonzero(bytes, "max_request_body")?);
        Ok(self)
    }

    /// The largest response body recorded (see
    /// [`with_max_response_body`](crate::IdempotencyLayer::with_max_response_body)).
    pub fn with_max_response_body(mut self, bytes: usize) -> Result<Self, ConfigError> {
        self.max_response_body = Some(nonzero(bytes, "max_response_body")?);
        Ok(self)
    }

    /// How long a duplicate waits for the request that holds its key (see
    /// [`with_in_flight_wait`](crate::IdempotencyLayer::with_in_flight_wait)).
    pub fn with_in_flight_wait(mut self, wait: Duration) -> Result<Self, ConfigError> {
        let wait = at_most(wait, MAX_WAIT, "in_flight_wait")?;
        self.in_flight_wait = Some(nonzero(wait, "in_flight_wait")?);
        Ok(self)
    }

    /// `config` with this policy's settings, or `None` when it changes
    /// nothing.
    pub(crate) fn applied_to(&self, config: &Config) -> Option<Config> {
        if *self == Self::default() {
            return None;
        }
        let mut config = config.clone();
        if let Some(v) = self.retention {
            config.retention = v;
        }
        if let Some(v) = self.max_request_body {
            config.max_request_body = v;
        }
        if let Some(v) = self.max_response_body {
            config.max_response_body = v;
        }
        if let Some(v) = self.in_flight_wait {
            config.in_flight_wait = v;
        }
        Some(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_that_cannot_work_are_refused_when_built() {
        assert!(Policy::new().with_retention(Duration::ZERO).is_err());
        assert!(Policy::new().with_max_request_body(0).is_err());
        assert!(Policy::new().with_max_response_body(0).is_err());
        assert!(Policy::new().with_in_flight_wait(Duration::ZERO).is_err());
        assert!(Policy::new().with_in_flight_wait(Duration::MAX).is_err());
        assert!(
            Policy::new()
                .with_retention(Duration::from_secs(3600))
                .is_ok()
        );
    }
}
