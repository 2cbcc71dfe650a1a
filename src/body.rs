//! The body type the layer hands to the inner service and returns.
//!
//! Guarded requests are buffered (to fingerprint them) and answered from a
//! buffer (to record them), trailers included; an answer over the
//! recording limit streams on after what was read; everything else streams
//! through untouched. One
//! type covers both so the inner service sees a single body type.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// Either a complete buffer or the original streaming body `B`.
    pub struct IdempotencyBody<B> {
        #[pin]
        inner: Inner<B>,
    }
}

pin_project! {
    #[project = InnerProj]
    enum Inner<B> {
        Buffered { data: Option<Bytes>, trailers: Option<HeaderMap> },
        Streaming { #[pin] body: B },
        // What was read of `body` already, then the rest of it.
        Prefixed { data: Option<Bytes>, body: Pin<Box<B>> },
    }
}

impl<B> IdempotencyBody<B> {
    pub(crate) fn buffered(data: Bytes) -> Self {
        Self::buffered_with(data, None)
    }

    /// `data`, then `trailers` when there are any.
    pub(crate) fn buffered_with(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        let data = (!data.is_empty()).then_some(data);
        let trailers = trailers.filter(|t| !t.is_empty());
        Self {
            inner: Inner::Buffered { data, trailers },
        }
    }

    /// `prefix` (read from `body` already), then the rest of `body`.
    pub(crate) fn prefixed(prefix: Bytes, body: Pin<Box<B>>) -> Self {
        let data = (!prefix.is_empty()).then_some(prefix);
        Self {
            inner: Inner::Prefixed { data, body },
        }
    }

    pub(crate) fn streaming(body: B) -> Self {
        Self {
            inner: Inner::Streaming { body },
        }
    }
}

impl<B> std::fmt::Debug for IdempotencyBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Buffered { data, trailers } => f
                .debug_struct("IdempotencyBody::Buffered")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .field("trailers", &trailers.as_ref().map_or(0, HeaderMap::len))
                .finish(),
            Inner::Streaming { .. } => f.write_str("IdempotencyBody::Streaming"),
            Inner::Prefixed { data, .. } => f
                .debug_struct("IdempotencyBody::Prefixed")
                .field("prefix", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
        }
    }
}

impl<B> Body for IdempotencyBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().inner.project() {
            InnerProj::Buffered { data, trailers } => Poll::Ready(
                data.take()
                    .map(Frame::data)
                    .or_else(|| trailers.take().map(Frame::trailers))
                    .map(Ok),
            ),
            InnerProj::Streaming { body } => body.poll_frame(cx),
            InnerProj::Prefixed { data, body } => match data.take() {
                Some(d) => Poll::Ready(Some(Ok(Frame::data(d)))),
                None => body.as_mut().poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Buffered { data, trailers } => data.is_none() && trailers.is_none(),
            Inner::Streaming { body } => body.is_end_stream(),
            Inner::Prefixed { data, body } => data.is_none() && body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Buffered { data, trailers } => {
                let len = data.as_ref().map_or(0, |d| d.len() as u64);
                if trailers.is_some() {
                    // Not exact, so HTTP/1.1 sends it chunked: trailers
                    // cannot follow a `Content-Length` body.
                    let mut hint = SizeHint::new();
                    hint.set_lower(len);
                    hint
                } else {
                    SizeHint::with_exact(len)
                }
            }
            Inner::Streaming { body } => body.size_hint(),
            Inner::Prefixed { data, body } => {
                let prefix = data.as_ref().map_or(0, |d| d.len() as u64);
                let rest = body.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower().saturating_add(prefix));
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper.saturating_add(prefix));
                }
                hint
            }
        }
    }
}
