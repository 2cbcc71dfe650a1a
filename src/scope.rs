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
//! - **Operation**: by default the method and the route:
//!   - with the layer on an axum route or router (`Router::layer`,
//!     `MethodRouter::layer`: the `axum` feature, and the router has set
//!     `MatchedPath`), the route template, such as `POST /orders/{id}/pay`:
//!     one operation for every order, told apart by the fingerprint, which
//!     hashes the path;
//!   - with the layer outside the router (`ServiceBuilder` around a router,
//!     plain hyper), the request path, normalized per RFC 3986 §6.2.2
//!     (unreserved escapes decoded, other escapes upper-cased, dot segments
//!     removed), so `/orders/abc/pay` and `/orders/%61bc/pay` are one
//!     operation.
//!
//!   Name it explicitly with
//!   [`IdempotencyLayer::with_operation`](crate::IdempotencyLayer::with_operation)
//!   so that renaming a route never silently changes scopes.
//!
//! Values longer than 255 bytes are stored as `sha256:<hex>` of the value,
//! which keeps them distinct and fits every backend's key columns. A value
//! that itself starts with `sha256:` is stored hashed too, so a literal
//! principal can never meet a long principal's hashed form.
//!
//! The operation `message` is reserved for message consumers
//! ([`MESSAGE_OPERATION`]): an HTTP operation named exactly that is stored as its `sha256:` form too, so an
//! HTTP request and a consumer's message never claim each other's row,
//! whatever a route or an operation is named. (The default operation, a
//! method and a path, never is `message`.)

use std::borrow::Cow;
use std::sync::Arc;

use http::request::Parts;
use sha2::{Digest, Sha256};

/// The authenticated party a request acts for: a user, tenant or account id.
///
/// Insert one into the request extensions from your authentication layer;
/// the default principal source reads it from there (or give the layer
/// your own source with `with_principal`). A guarded request without one
/// is refused `401` `#missing-principal`, and nothing is stored. A handler
/// reads it back with axum's `Extension<Principal>`.
///
/// ```
/// use http::Request;
/// use tower_idempotency::Principal;
///
/// // In your authentication middleware, once the caller is known:
/// let mut req = Request::new(());
/// req.extensions_mut().insert(Principal::new("user-42"));
/// assert_eq!(req.extensions().get::<Principal>().map(Principal::as_str), Some("user-42"));
/// ```
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
        return operation(parts.method.as_str(), path.as_str());
    }
    operation(
        parts.method.as_str(),
        &crate::path::normalize(parts.uri.path()),
    )
}

/// `METHOD path`, in one allocation of its exact size.
fn operation(method: &str, path: &str) -> String {
    let mut op = String::with_capacity(method.len() + 1 + path.len());
    op.push_str(method);
    op.push(' ');
    op.push_str(path);
    op
}

/// Marks a stored value as a hash of the real one.
const HASHED: &str = "sha256:";

/// The operation of every processed-message row, reserved for message
/// consumers ([`crate::consumer`]): no HTTP request's row ever has it (an
/// HTTP operation named exactly `message` is stored in its `sha256:` form;
/// see the [consumer docs](crate::consumer)).
pub const MESSAGE_OPERATION: &str = "message";

/// Keeps a scope column within 255 bytes without making two values equal:
/// long values, and values that look hashed, are stored hashed.
pub(crate) fn bounded(value: &str) -> Cow<'_, str> {
    if value.len() <= 255 && !value.starts_with(HASHED) {
        Cow::Borrowed(value)
    } else {
        hashed(value)
    }
}

/// The stored form of an HTTP operation name (the layer's, and the names a
/// completer resumes): [`bounded`], and the consumers' reserved operation
/// hashed, so that no HTTP row ever has the operation of a processed
/// message. The one place that keeps the two kinds of scope apart.
pub(crate) fn http_operation(name: &str) -> Cow<'_, str> {
    if name == MESSAGE_OPERATION {
        hashed(name)
    } else {
        bounded(name)
    }
}

/// The stored form of a key: as sent, or its [`hashed`] form when the
/// layer hashes keys (`with_hashed_keys`). Keys are at most 255 bytes.
pub(crate) fn stored_key(key: &str, hash_keys: bool) -> Cow<'_, str> {
    if hash_keys {
        hashed(key)
    } else {
        Cow::Borrowed(key)
    }
}

/// `sha256:<hex>` of the value: distinct values stay distinct, and the
/// value itself is not stored.
pub(crate) fn hashed(value: &str) -> Cow<'static, str> {
    let digest = Sha256::digest(value.as_bytes());
    let mut out = String::with_capacity(HASHED.len() + 64);
    out.push_str(HASHED);
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
        // A literal value in the hashed form is hashed again: it never
        // equals the stored form of the long value it spells.
        let spelled = bounded(&long_a).into_owned();
        assert_ne!(bounded(&spelled), bounded(&long_a));
        assert_eq!(bounded(&spelled), hashed(&spelled));
    }

    #[test]
    fn no_http_operation_is_the_consumers() {
        let message = MESSAGE_OPERATION;
        for name in [
            message.to_string(),
            hashed(message).into_owned(),
            format!("{message} "),
            "x".repeat(300),
        ] {
            assert_ne!(http_operation(&name), message, "{name:?}");
        }
        // Every other name is stored as `bounded` stores it.
        assert_eq!(http_operation("POST /orders"), "POST /orders");
        assert_eq!(http_operation("Message"), "Message");
    }

    #[test]
    fn default_operation_is_method_and_path() {
        let (parts, ()) = http::Request::post("/orders?x=1")
            .body(())
            .unwrap()
            .into_parts();
        assert_eq!(default_operation(&parts), "POST /orders");
        let (parts, ()) = http::Request::post("/orders/%61bc/./pay")
            .body(())
            .unwrap()
            .into_parts();
        assert_eq!(default_operation(&parts), "POST /orders/abc/pay");
    }
}
