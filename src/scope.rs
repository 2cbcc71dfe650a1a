//! Who is asking and for which operation: the parts of the scope besides the key.
//!
//! The unique constraint is on `(principal, operation, key)`, never on the
//! key alone, so another principal sending the same key never sees, replays
//! or blocks someone else's record.
//!
//! - **Principal**: by default the [`Principal`] that your authentication
//!   layer put in the request extensions; with none there the request is
//!   refused with `401`. [`IdempotencyLayer::with_principal`](crate::IdempotencyLayer::with_principal)
//!   takes any function of the request head instead.
//!   [`IdempotencyLayer::unscoped`](crate::IdempotencyLayer::unscoped) puts
//!   every request in one shared scope: a conscious choice for services
//!   without authentication.
//! - **Operation**: by default the method and route template (axum's
//!   `MatchedPath` when the `axum` feature is on and the router set it, else
//!   the request path), such as `POST /orders`. Name it explicitly with
//!   [`IdempotencyLayer::with_operation`](crate::IdempotencyLayer::with_operation)
//!   so that renaming a route never silently changes scopes.
//!
//! Values longer than 255 bytes are stored as `sha256:<hex>` of the value,
//! which keeps them distinct and fits every backend's key columns.

use std::borrow::Cow;
use std::sync::Arc;

use http::request::Parts;
use sha2::{Digest, Sha256};

/// The authenticated party a request acts for: a user, tenant or account id.
///
/// Insert one into the request extensions from your authentication layer;
/// the default principal source reads it from there.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Principal(String);

impl Principal {
    /// A principal with this id.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The principal id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

pub(crate) type PrincipalFn = Arc<dyn Fn(&Parts) -> Option<Principal> + Send + Sync>;

pub(crate) fn principal_from_extensions() -> PrincipalFn {
    Arc::new(|parts: &Parts| parts.extensions.get::<Principal>().cloned())
}

/// The default operation name: method and route template.
pub(crate) fn default_operation(parts: &Parts) -> String {
    #[cfg(feature = "axum")]
    if let Some(path) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return format!("{} {}", parts.method, path.as_str());
    }
    format!("{} {}", parts.method, parts.uri.path())
}

/// Keeps a scope column within 255 bytes without making two values equal.
pub(crate) fn bounded(value: &str) -> Cow<'_, str> {
    if value.len() <= 255 {
        Cow::Borrowed(value)
    } else {
        hashed(value)
    }
}

/// `sha256:<hex>` of the value: distinct values stay distinct, and the
/// value itself is not stored.
pub(crate) fn hashed(value: &str) -> Cow<'static, str> {
    let digest = Sha256::digest(value.as_bytes());
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256:");
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_values_are_hashed_short_ones_kept() {
        assert_eq!(bounded("user-42"), "user-42");
        let long_a = "a".repeat(300);
        let long_b = format!("{}b", "a".repeat(299));
        assert_eq!(bounded(&long_a).len(), 71);
        assert_ne!(bounded(&long_a), bounded(&long_b));
        assert!(bounded(&long_a).starts_with("sha256:"));
    }

    #[test]
    fn default_operation_is_method_and_path() {
        let (parts, ()) = http::Request::post("/orders?x=1")
            .body(())
            .unwrap()
            .into_parts();
        assert_eq!(default_operation(&parts), "POST /orders");
    }
}
