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
        // An answer streamed past the recording limit, its transaction
        // still open: what was read, the rest, and then its settling.
        Settling { data: Option<Bytes>, body: Pin<Box<B>>, settling: Box<Settling> },
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// How an answer streamed past the recording limit ended.
pub(crate) enum Ending<'a> {
    /// Its body ended, with these trailers if any.
    Finished(Option<&'a HeaderMap>),
    /// Its body failed, or it ran past the bound on its transaction.
    Broken,
}

/// What came of settling it.
pub(crate) enum Settled {
    /// Its record and its writes committed.
    Committed,
    /// Its ending was a failure: everything was rolled back.
    RolledBack,
    /// Its commit failed: nothing is known to have committed.
    Failed,
}

/// Settles an answer streamed past the recording limit once its ending is
/// known: commits it, or rolls it back.
pub(crate) type Settle = Box<dyn FnOnce(Ending<'_>) -> BoxFuture<Settled> + Send>;

/// The state of an answer whose transaction waits for its end.
pub(crate) struct Settling {
    settle: Option<Settle>,
    running: Option<BoxFuture<Settled>>,
    /// How the body ended, given to the client once settled.
    ending: Option<Result<Option<HeaderMap>, BoxError>>,
    grpc: bool,
    bound: Pin<Box<tokio::time::Sleep>>,
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

    /// `prefix` (read from `body` already), then the rest of `body`;
    /// `settle` runs when it ends (or fails, or outlives `bound`), and
    /// its end reaches the client only once settled.
    pub(crate) fn settling(
        prefix: Bytes,
        body: Pin<Box<B>>,
        settle: Settle,
        grpc: bool,
        bound: std::time::Duration,
    ) -> Self {
        let data = (!prefix.is_empty()).then_some(prefix);
        let settling = Box::new(Settling {
            settle: Some(settle),
            running: None,
            ending: None,
            grpc,
            bound: Box::pin(tokio::time::sleep(bound)),
        });
        Self {
            inner: Inner::Settling {
                data,
                body,
                settling,
            },
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
            Inner::Settling { data, .. } => f
                .debug_struct("IdempotencyBody::Settling")
                .field("prefix", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
        }
    }
}

impl<B> Body for IdempotencyBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let into = |p: Poll<Option<Result<Frame<Bytes>, B::Error>>>| {
            p.map(|f| f.map(|r| r.map_err(Into::into)))
        };
        match self.project().inner.project() {
            InnerProj::Buffered { data, trailers } => Poll::Ready(
                data.take()
                    .map(Frame::data)
                    .or_else(|| trailers.take().map(Frame::trailers))
                    .map(Ok),
            ),
            InnerProj::Streaming { body } => into(body.poll_frame(cx)),
            InnerProj::Prefixed { data, body } => match data.take() {
                Some(d) => Poll::Ready(Some(Ok(Frame::data(d)))),
                None => into(body.as_mut().poll_frame(cx)),
            },
            InnerProj::Settling {
                data,
                body,
                settling,
            } => {
                if let Some(d) = data.take() {
                    return Poll::Ready(Some(Ok(Frame::data(d))));
                }
                settling.poll_frame(body.as_mut(), cx)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Buffered { data, trailers } => data.is_none() && trailers.is_none(),
            Inner::Streaming { body } => body.is_end_stream(),
            Inner::Prefixed { data, body } => data.is_none() && body.is_end_stream(),
            // Its end comes once settled.
            Inner::Settling { .. } => false,
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
            Inner::Prefixed { data, body } | Inner::Settling { data, body, .. } => {
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

impl Settling {
    /// The rest of `body`, then its end once settled: the handler's
    /// trailers or end when its answer committed, or when its own failure
    /// was rolled back; a failed commit is a gRPC `UNAVAILABLE` in the
    /// trailers, or a broken HTTP body, so the client never takes an
    /// answer that did not commit for one that did.
    fn poll_frame<B>(
        &mut self,
        mut body: Pin<&mut B>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
    where
        B: Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        loop {
            if let Some(running) = self.running.as_mut() {
                let settled = std::task::ready!(running.as_mut().poll(cx));
                self.running = None;
                let ending = self.ending.take().unwrap_or(Ok(None));
                return Poll::Ready(match settled {
                    Settled::Committed | Settled::RolledBack => match ending {
                        Ok(trailers) => trailers.map(|t| Ok(Frame::trailers(t))),
                        Err(e) => Some(Err(e)),
                    },
                    Settled::Failed if self.grpc => {
                        let mut trailers = HeaderMap::new();
                        crate::grpc::status::trailers_only(
                            &mut trailers,
                            14,
                            "the answer could not be recorded; nothing was committed, retry with the same key",
                            None,
                        );
                        trailers.remove(http::header::CONTENT_TYPE);
                        Some(Ok(Frame::trailers(trailers)))
                    }
                    Settled::Failed => Some(Err(
                        "the answer could not be recorded; nothing was committed, retry with the same key".into(),
                    )),
                });
            }
            let Some(settle) = self.settle.take() else {
                // Settled and ended.
                return Poll::Ready(None);
            };
            if self.bound.as_mut().poll(cx).is_ready() {
                self.ending = Some(Err(
                    "the answer streamed longer than the layer holds its transaction open; nothing was committed".into(),
                ));
                self.running = Some(settle(Ending::Broken));
                continue;
            }
            let frame = match body.as_mut().poll_frame(cx) {
                Poll::Pending => {
                    self.settle = Some(settle);
                    return Poll::Pending;
                }
                Poll::Ready(frame) => frame,
            };
            match frame {
                Some(Ok(frame)) if frame.is_data() => {
                    self.settle = Some(settle);
                    return Poll::Ready(Some(Ok(frame)));
                }
                Some(Ok(frame)) => {
                    let trailers = frame.into_trailers().ok();
                    self.running = Some(settle(Ending::Finished(trailers.as_ref())));
                    self.ending = Some(Ok(trailers));
                }
                None => {
                    self.running = Some(settle(Ending::Finished(None)));
                    self.ending = Some(Ok(None));
                }
                Some(Err(e)) => {
                    self.running = Some(settle(Ending::Broken));
                    self.ending = Some(Err(e.into()));
                }
            }
        }
    }
}
