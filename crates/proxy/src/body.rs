//! One body type for both directions (buffered bytes, a stream passed through, or a buffered prefix
//! then the stream), and reading a body into memory up to a limit.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::budget::Room;

/// Buffered bytes go out in frames of at most this size: the connection asks
/// for the next one only when it has written the last, so a client that reads
/// slowly holds back our bytes (counted in the budget), not the connection's.
const FRAME: usize = 64 * 1024;

/// A body the proxy sends, to the client or to the upstream. An enum rather
/// than a boxed trait object: no allocation per request.
pub enum Body {
    /// Fully buffered (protected requests, replays, problems); its length is known.
    Full(Option<Bytes>),
    /// Streamed through untouched (pass-through).
    Stream(Inbound),
    /// What was read before a limit was hit, then the rest of the stream.
    Prefixed(Option<Bytes>, Inbound),
    /// A body whose bytes are counted in the memory budget until it is dropped.
    Counted(Box<Body>, Room),
    /// A body, then its trailers (a replayed gRPC answer's `grpc-status`).
    Trailed(Box<Body>, Option<HeaderMap>),
}

impl Body {
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        let b = bytes.into();
        Body::Full(if b.is_empty() { None } else { Some(b) })
    }

    /// This body, its bytes held against the budget by `room` until it is dropped.
    pub fn counted(self, room: Room) -> Self {
        Body::Counted(Box::new(self), room)
    }

    /// Reads what is left of a request body the proxy answers without (up to
    /// 64 KiB, at most 1 s): an HTTP/2 answer that ends the stream while the
    /// client still uploads makes clients report a stream error instead of it.
    pub(crate) async fn drain_some(&mut self) {
        let deadline = tokio::time::sleep(std::time::Duration::from_secs(1));
        tokio::pin!(deadline);
        let mut left: usize = 64 * 1024;
        while left > 0 {
            tokio::select! {
                frame = self.frame() => match frame {
                    Some(Ok(f)) => left = left.saturating_sub(f.data_ref().map_or(0, Bytes::len)),
                    _ => return,
                },
                () = &mut deadline => return,
            }
        }
    }

    /// This body followed by `trailers` (none: the body as it is).
    pub(crate) fn trailed(self, trailers: Option<HeaderMap>) -> Self {
        match trailers {
            Some(t) if !t.is_empty() => Body::Trailed(Box::new(self), Some(t)),
            _ => self,
        }
    }
}

/// The next frame of buffered bytes.
fn next_frame(buffered: &mut Option<Bytes>) -> Option<Bytes> {
    let b = buffered.as_mut()?;
    if b.len() > FRAME {
        Some(b.split_to(FRAME))
    } else {
        buffered.take()
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
            Body::Full(b) => Poll::Ready(next_frame(b).map(|b| Ok(Frame::data(b)))),
            Body::Stream(s) => Pin::new(s).poll_frame(cx),
            Body::Prefixed(prefix, s) => match next_frame(prefix) {
                Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
                None => Pin::new(s).poll_frame(cx),
            },
            Body::Counted(inner, _) => Pin::new(inner.as_mut()).poll_frame(cx),
            Body::Trailed(inner, trailers) => match Pin::new(inner.as_mut()).poll_frame(cx) {
                Poll::Ready(None) => Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t)))),
                other => other,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Full(b) => b.is_none(),
            Body::Stream(s) => s.is_end_stream(),
            Body::Prefixed(p, s) => p.is_none() && s.is_end_stream(),
            Body::Counted(inner, _) => inner.is_end_stream(),
            Body::Trailed(inner, t) => t.is_none() && inner.is_end_stream(),
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
            Body::Counted(inner, _) => inner.size_hint(),
            // Not exact: an HTTP/1.1 answer with trailers must be chunked
            // (a `Content-Length` leaves no place for them).
            Body::Trailed(inner, _) => {
                let mut h = SizeHint::new();
                h.set_lower(inner.size_hint().lower());
                h
            }
        }
    }
}

/// A body read up to a limit.
#[derive(Debug)]
pub(crate) enum Capped<B: http_body::Body> {
    /// All of it, and its trailers if it had any.
    Whole(Bytes, Option<HeaderMap>),
    /// Stopped before the end: what was read, the rest still to come, and why.
    /// (Shadow mode forwards the two as they came.)
    Partial(Bytes, B, Cut<B::Error>),
}

/// Why a body was not read to its end.
#[derive(Debug)]
pub enum Cut<E> {
    /// Over the limit (declared, or counted as it came).
    TooLarge,
    /// The deadline passed.
    Late,
    /// The memory budget had no room for more.
    NoRoom,
    /// The body itself failed (a client gone, bad chunking).
    Failed(E),
}

/// Reads a body into memory, refusing more than `limit` bytes, more than
/// `room` can hold, and waiting no later than `deadline`: the declared length
/// is checked before anything is read, the bytes counted as they come.
/// Trailers come back beside the bytes (a request's are part of neither the
/// fingerprint nor the record; an answer's are recorded).
pub(crate) async fn read_capped<B>(
    mut body: B,
    limit: u64,
    deadline: Option<tokio::time::Instant>,
    room: &mut Room,
) -> Capped<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    if body.size_hint().lower() > limit {
        return Capped::Partial(Bytes::new(), body, Cut::TooLarge);
    }
    let mut read = Collected {
        // The declared length (its room taken already): one allocation of
        // the body's size, not a doubling buffer whose copies and slack lie
        // outside the budget (and fragment the heap with 8 MiB answers).
        expected: body.size_hint().lower().min(limit),
        ..Collected::default()
    };
    let mut trailers: Option<HeaderMap> = None;
    loop {
        let frame = match deadline {
            None => body.frame().await,
            Some(at) => match tokio::time::timeout_at(at, body.frame()).await {
                Ok(frame) => frame,
                Err(_) => return Capped::Partial(read.take(), body, Cut::Late),
            },
        };
        let data = match frame {
            None => return Capped::Whole(read.take(), trailers),
            Some(Err(e)) => return Capped::Partial(read.take(), body, Cut::Failed(e)),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        trailers.get_or_insert_with(HeaderMap::new).extend(t);
                    }
                    continue;
                }
            },
        };
        let total = read.push(data);
        if total > limit {
            return Capped::Partial(read.take(), body, Cut::TooLarge);
        }
        if !room.reach(total) {
            return Capped::Partial(read.take(), body, Cut::NoRoom);
        }
    }
}

/// Bytes read so far. A body in one frame (the common case) is kept as it
/// came, without a copy.
#[derive(Default)]
struct Collected {
    first: Option<Bytes>,
    buf: BytesMut,
    total: u64,
    /// The length the body declared: reserved once it takes a second frame.
    expected: u64,
}

impl Collected {
    /// Adds a frame; returns the total so far.
    fn push(&mut self, data: Bytes) -> u64 {
        self.total += data.len() as u64;
        match self.first.take() {
            None if self.buf.is_empty() => self.first = Some(data),
            Some(f) => {
                let expected = usize::try_from(self.expected).unwrap_or(0);
                self.buf.reserve(expected.max(f.len() + data.len()));
                self.buf.extend_from_slice(&f);
                self.buf.extend_from_slice(&data);
            }
            None => self.buf.extend_from_slice(&data),
        }
        self.total
    }

    fn take(&mut self) -> Bytes {
        self.first
            .take()
            .unwrap_or_else(|| self.buf.split().freeze())
    }
}

/// A connection lent to one answer's body by the pool it came from: the body
/// drives its I/O while it is read, and gives it back at its end. (A trait,
/// so that bodies need not know the upstream pool; the box is the
/// connection's own, made once when it was opened.)
pub(crate) trait LentConnection: Send {
    /// Drives the connection's I/O; true while it is still open.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool;
    /// The body was read to its end: the connection may serve the next request.
    fn give_back(self: Box<Self>, cx: &mut Context<'_>);
}

/// A body from a peer: a client's request body, or an upstream answer's,
/// whose reader drives the pooled connection it arrives on. Dropped before
/// its end, it closes that connection (the rest of the answer is unread).
pub struct Inbound {
    body: Incoming,
    lease: Option<Box<dyn LentConnection>>,
}

impl From<Incoming> for Inbound {
    fn from(body: Incoming) -> Self {
        Inbound { body, lease: None }
    }
}

impl Inbound {
    /// An answer's body holding the connection it arrives on until it is read
    /// to its end. No body to read (HEAD, 204, 304, `Content-Length: 0`): the
    /// server may never poll it, so the connection goes back now.
    pub(crate) fn lent(body: Incoming, conn: Box<dyn LentConnection>) -> Self {
        let mut inbound = Inbound {
            body,
            lease: Some(conn),
        };
        if inbound.body.is_end_stream() {
            inbound.give_back(None);
        }
        inbound
    }

    fn give_back(&mut self, cx: Option<&mut Context<'_>>) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        let mut noop = Context::from_waker(std::task::Waker::noop());
        lease.give_back(cx.unwrap_or(&mut noop));
    }
}

impl http_body::Body for Inbound {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Some(lease) = &mut this.lease {
            lease.drive(cx);
        }
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        if this.lease.is_some() {
            match &frame {
                Poll::Ready(None) => this.give_back(Some(cx)),
                Poll::Ready(Some(Ok(_))) if this.body.is_end_stream() => this.give_back(Some(cx)),
                // An error: the connection is in no state to be used again.
                Poll::Ready(Some(Err(_))) => this.lease = None,
                _ => {}
            }
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::Budget;
    use std::collections::VecDeque;

    /// Data frames served one by one, with the exact length declared or not.
    #[derive(Debug)]
    struct Frames {
        frames: VecDeque<Bytes>,
        declared: Option<u64>,
    }

    impl Frames {
        fn new(parts: &[&'static [u8]], declared: Option<u64>) -> Self {
            let frames = parts.iter().map(|p| Bytes::from_static(p)).collect();
            Frames { frames, declared }
        }
    }

    impl http_body::Body for Frames {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(
                self.get_mut()
                    .frames
                    .pop_front()
                    .map(|b| Ok(Frame::data(b))),
            )
        }

        fn size_hint(&self) -> SizeHint {
            self.declared
                .map_or_else(SizeHint::new, SizeHint::with_exact)
        }
    }

    async fn read(parts: &[&'static [u8]], declared: Option<u64>, limit: u64) -> Capped<Frames> {
        let mut room = Budget::new(1 << 20).take(0).unwrap();
        read_capped(Frames::new(parts, declared), limit, None, &mut room).await
    }

    #[tokio::test]
    async fn whole_bodies_are_joined() {
        let c = read(&[b"ab", b"cd", b"e"], None, 5).await;
        assert!(matches!(c, Capped::Whole(b, None) if b == "abcde"));
        let c = read(&[], None, 5).await;
        assert!(matches!(c, Capped::Whole(b, None) if b.is_empty()));
    }

    #[tokio::test]
    async fn a_declared_length_over_the_limit_is_refused_before_reading() {
        let c = read(&[b"abcdef"], Some(6), 5).await;
        assert!(
            matches!(c, Capped::Partial(read, rest, Cut::TooLarge) if read.is_empty() && rest.frames.len() == 1)
        );
    }

    #[tokio::test]
    async fn an_undeclared_body_stops_at_the_first_frame_over_the_limit() {
        let c = read(&[b"abc", b"def", b"gh"], None, 5).await;
        match c {
            Capped::Partial(read, rest, Cut::TooLarge) => {
                assert_eq!(read, "abcdef");
                assert_eq!(rest.frames, [Bytes::from_static(b"gh")]);
            }
            other => panic!("over the limit: {other:?}"),
        }
    }

    /// A body whose second frame never comes.
    #[derive(Debug)]
    struct Stalled(Option<Bytes>);

    impl http_body::Body for Stalled {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            match self.get_mut().0.take() {
                Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
                None => Poll::Pending,
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_body_keeps_what_was_read_and_the_rest() {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
        let body = Stalled(Some(Bytes::from_static(b"abc")));
        let mut room = Budget::new(1 << 20).take(0).unwrap();
        match read_capped(body, 100, Some(deadline), &mut room).await {
            Capped::Partial(read, _, Cut::Late) => assert_eq!(read, "abc"),
            other => panic!("{other:?}"),
        }
        assert_eq!(tokio::time::Instant::now(), deadline);
    }

    #[tokio::test]
    async fn reading_stops_when_the_budget_has_no_room_and_gives_it_back_on_drop() {
        let budget = Budget::new(5);
        let mut room = budget.take(0).unwrap();
        let body = Frames::new(&[b"abc", b"def"], None);
        match read_capped(body, 100, None, &mut room).await {
            Capped::Partial(read, rest, Cut::NoRoom) => {
                assert_eq!(read, "abcdef");
                assert!(rest.frames.is_empty());
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(room.held(), 3, "room for what fitted");
        let body = Body::full(Bytes::from_static(b"abc")).counted(room);
        assert_eq!(budget.used(), 3);
        drop(body);
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn large_buffered_bodies_go_out_in_frames() {
        let big = Bytes::from(vec![7u8; FRAME * 2 + 1]);
        let mut body = Body::full(big.clone());
        let mut sizes = Vec::new();
        while let Some(frame) = body.frame().await {
            sizes.push(frame.unwrap().into_data().unwrap().len());
        }
        assert_eq!(sizes, [FRAME, FRAME, 1]);
    }
}
