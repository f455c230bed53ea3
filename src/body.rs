//! One body type for both directions: buffered bytes, a stream passed through, or a buffered prefix then the stream.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;

/// A body the proxy sends, to the client or to the upstream. An enum rather
/// than a boxed trait object: no allocation per request.
pub enum Body {
    /// Fully buffered (protected requests, replays, problems); its length is known.
    Full(Option<Bytes>),
    /// Streamed through untouched (pass-through).
    Stream(Incoming),
    /// What was read before a limit was hit, then the rest of the stream.
    Prefixed(Option<Bytes>, Incoming),
}

impl Body {
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        let b = bytes.into();
        Body::Full(if b.is_empty() { None } else { Some(b) })
    }

    pub fn empty() -> Self {
        Body::Full(None)
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            Body::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Body::Stream(s) => Pin::new(s).poll_frame(cx),
            Body::Prefixed(prefix, s) => match prefix.take() {
                Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
                None => Pin::new(s).poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Full(b) => b.is_none(),
            Body::Stream(s) => s.is_end_stream(),
            Body::Prefixed(p, s) => p.is_none() && s.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Body::Stream(s) => s.size_hint(),
            Body::Prefixed(p, s) => {
                let extra = p.as_ref().map_or(0, |b| b.len() as u64);
                let h = s.size_hint();
                let mut out = SizeHint::new();
                out.set_lower(h.lower() + extra);
                if let Some(u) = h.upper() {
                    out.set_upper(u + extra);
                }
                out
            }
        }
    }
}
