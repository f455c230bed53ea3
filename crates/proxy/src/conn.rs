//! A client connection's I/O with its three deadlines (docs/reference/behaviour.md#deadlines):
//! a client that
//! accepts no bytes of an answer for `client_write_timeout` is disconnected;
//! an HTTP/1.1 request's head must arrive within `header_read_timeout` of its
//! first byte; and a connection with no request in progress and no bytes
//! either way for `idle_timeout` is closed. One timer per connection, reset
//! in place: hyper's own header timer would box and register a timer per
//! request.
//!
//! The same timer says when an HTTP/1.1 connection has been idle long enough
//! to be parked (`crate::serve`): its HTTP state and buffers freed until the
//! client sends again.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{Instant, Sleep};

use crate::metrics::Counted;
use crate::stall::Stalls;

/// Requests in progress on one connection, from the handler's start to the
/// end of its response body (or of its upgrade tunnel).
///
/// It also holds the connection's slot of `max_connections`: the slot is free
/// once the last holder is gone — the client socket ([`Guarded`] keeps a
/// `Busy`), and a tunnel that outlives hyper's connection (it keeps a [`BusyGuard`]).
#[derive(Clone, Default)]
pub struct Busy(Arc<Counter>);

#[derive(Default)]
struct Counter {
    requests: AtomicUsize,
    /// Requests begun on this connection, ever (wrapping).
    begun: AtomicUsize,
    /// The connection has been idle for the parking delay (set by [`Guarded`]).
    park_wanted: AtomicBool,
    /// The HTTP connection is being closed to park it: its shutdown must not
    /// close the socket (read by `crate::serve`'s I/O).
    parking: AtomicBool,
    /// The connection speaks HTTP/1.1: bytes that come with no request in
    /// progress are a request's head (HTTP/2 sends frames of its own while idle).
    http1: AtomicBool,
    /// Bytes of a head were handed to hyper from outside [`Guarded`]'s
    /// reads (those a parked connection kept): `begun` then, plus one (0: none).
    /// While no request has begun since, a head is in progress.
    head_handed: AtomicUsize,
    _slot: Option<OwnedSemaphorePermit>,
    /// HTTP/2: the answers waiting for the client's window (their send deadline).
    stalls: Stalls,
    /// The connection's place in its worker's count (`idemproxy_worker_connections`).
    _load: Option<Counted>,
}

impl Busy {
    /// The counter of a connection that holds `slot`, and its place in its
    /// worker's `load` when it has one, for as long as it lives.
    pub fn holding(slot: OwnedSemaphorePermit, load: Option<Counted>) -> Self {
        Busy(Arc::new(Counter {
            _slot: Some(slot),
            _load: load,
            ..Counter::default()
        }))
    }

    /// Counts a request until the guard is dropped.
    pub fn enter(&self) -> BusyGuard {
        self.0.requests.fetch_add(1, Ordering::AcqRel);
        self.0.begun.fetch_add(1, Ordering::Relaxed);
        BusyGuard(self.0.clone())
    }

    pub fn idle(&self) -> bool {
        self.0.requests.load(Ordering::Acquire) == 0
    }

    /// The connection's answers waiting for the client's window.
    pub(crate) fn stalls(&self) -> &Stalls {
        &self.0.stalls
    }

    fn begun(&self) -> usize {
        self.0.begun.load(Ordering::Relaxed)
    }

    /// Whether the connection has been idle for the parking delay; clears it.
    pub(crate) fn take_park_wanted(&self) -> bool {
        self.0.park_wanted.load(Ordering::Relaxed)
            && self.0.park_wanted.swap(false, Ordering::AcqRel)
    }

    /// Marks the connection as being closed only to be parked (or not any more).
    pub(crate) fn set_parking(&self, on: bool) {
        self.0.parking.store(on, Ordering::Release);
    }

    pub(crate) fn parking(&self) -> bool {
        self.0.parking.load(Ordering::Acquire)
    }

    /// The connection speaks HTTP/1.1: its heads are timed ([`Guarded`]).
    pub(crate) fn set_http1(&self) {
        self.0.http1.store(true, Ordering::Relaxed);
    }

    /// Bytes kept from before a parking were handed to hyper with no request
    /// in progress: the start of a head.
    pub(crate) fn head_handed(&self) {
        if self.idle() {
            let mark = self.begun().wrapping_add(1);
            if self.0.head_handed.load(Ordering::Relaxed) != mark {
                self.0.head_handed.store(mark, Ordering::Relaxed);
            }
        }
    }
}

pub struct BusyGuard(Arc<Counter>);

impl BusyGuard {
    /// The connection's answers waiting for the client's window.
    pub(crate) fn stalls(&self) -> &Stalls {
        &self.0.stalls
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.requests.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Who sent a request: the client's address and the scheme it connected with
/// (`"http"` or `"https"`), told to the upstream as `X-Forwarded-For` and
/// `X-Forwarded-Proto` (the scheme so that the links and cookies it makes fit
/// what the client used). Handed along with the request, not as a request
/// extension: a request's first extension costs a map and a box, per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caller {
    pub addr: std::net::SocketAddr,
    pub scheme: &'static str,
}

/// What the one timer is counting down.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Armed {
    Nothing,
    /// A write is waiting for the client to accept bytes.
    Write,
    /// A read is waiting, with no request in progress; at the end, the
    /// connection may be parked, and the timer counts on to `idle_timeout`.
    Park,
    /// A read is waiting, with no request in progress.
    Idle,
    /// A read is waiting for the rest of a request's head.
    Head,
}

pub(crate) struct Guarded<IO> {
    io: IO,
    busy: Busy,
    write_timeout: Duration,
    idle_timeout: Duration,
    /// Idle this long (with a request since the last bytes read), the
    /// connection asks to be parked; `None`: never.
    park_after: Option<Duration>,
    /// `busy.begun()` when bytes were last read with no request in progress:
    /// while no request has begun since, those bytes are part of a request
    /// not yet whole, and the connection is not parked (a client trickling
    /// a request's head stays under `header_read_timeout`).
    read_mark: usize,
    /// `header_read_timeout`, for an HTTP/1.1 connection (see [`Busy::set_http1`]).
    head_timeout: Option<Duration>,
    /// When the last head's first bytes came. It is in progress while no
    /// request has begun since (`busy.begun() == read_mark`).
    head_since: Option<Instant>,
    timer: Pin<Box<Sleep>>,
    /// When an idle wait that began with `Park` runs out.
    idle_until: Instant,
    armed: Armed,
}

impl<IO> Guarded<IO> {
    pub fn new(io: IO, busy: Busy, write_timeout: Duration, idle_timeout: Duration) -> Self {
        Guarded {
            io,
            busy,
            write_timeout,
            idle_timeout,
            park_after: None,
            read_mark: 0,
            head_timeout: None,
            head_since: None,
            timer: Box::pin(tokio::time::sleep(idle_timeout)),
            idle_until: Instant::now(),
            armed: Armed::Nothing,
        }
    }

    /// Asks for the connection to be parked once idle for `after` (when that
    /// is shorter than `idle_timeout`).
    pub(crate) fn park_after(mut self, after: Duration) -> Self {
        self.park_after = (after < self.idle_timeout).then_some(after);
        self
    }

    /// Times each HTTP/1.1 request's head: it must arrive within `after` of
    /// its first byte.
    pub(crate) fn head_timeout(mut self, after: Duration) -> Self {
        self.head_timeout = Some(after);
        self
    }

    /// Bytes came with no request in progress: the first of a head, unless a
    /// head is already in progress (no request has begun since its first bytes).
    fn head_bytes(&mut self, begun: usize) {
        if self.head_timeout.is_some() && (self.head_since.is_none() || self.read_mark != begun) {
            self.head_since = Some(Instant::now());
        }
        self.read_mark = begun;
    }

    /// When the head in progress is due, if one is (and the connection speaks HTTP/1.1).
    fn head_due(&mut self) -> Option<Instant> {
        let begun = self.busy.begun();
        let handed = self.busy.0.head_handed.load(Ordering::Relaxed);
        if handed != 0 {
            self.busy.0.head_handed.store(0, Ordering::Relaxed);
            // Not if a request has begun since (those bytes were its head).
            if handed == begun.wrapping_add(1) {
                self.head_bytes(begun);
            }
        }
        match (self.head_timeout, self.head_since) {
            (Some(after), Some(since))
                if self.read_mark == begun && self.busy.0.http1.load(Ordering::Relaxed) =>
            {
                Some(since + after)
            }
            _ => None,
        }
    }

    /// Bytes were written. With no request in progress, they end the last
    /// answer: the idle clock (parking, `idle_timeout`) starts here. hyper
    /// reads next only when the client sends (its read during the request,
    /// watching for a hang-up, is still waiting), so the read side alone
    /// would never start it.
    fn written(&mut self, cx: &mut Context<'_>) {
        self.progressed();
        if self.busy.idle() {
            // An idle wait that is already over is reported by the next read.
            let _ = self.idle(cx);
        }
    }

    /// Progress either way: nothing is overdue.
    fn progressed(&mut self) {
        self.armed = Armed::Nothing;
    }

    /// A write waits for the client: an error once `client_write_timeout` has run out.
    fn write_stalled(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        if self.armed != Armed::Write {
            self.timer
                .as_mut()
                .reset(Instant::now() + self.write_timeout);
            self.armed = Armed::Write;
        }
        match self.timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client accepted no bytes within client_write_timeout",
            )),
            Poll::Pending => Poll::Pending,
        }
    }

    /// A read waits with no request in progress: for the rest of a head, an
    /// error once `header_read_timeout` has run out since its first byte;
    /// otherwise, on the way, the wish to be parked, and an error once
    /// `idle_timeout` has run out.
    fn idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        // Bytes handed back after a parking start a head, whatever was armed.
        let handed = self.busy.0.head_handed.load(Ordering::Relaxed) != 0;
        if handed || !matches!(self.armed, Armed::Park | Armed::Idle | Armed::Head) {
            let now = Instant::now();
            let head_due = self.head_due();
            match self.park_after {
                _ if head_due.is_some_and(|due| due < now + self.idle_timeout) => {
                    self.timer.as_mut().reset(head_due.unwrap_or(now));
                    self.armed = Armed::Head;
                }
                Some(after) if self.busy.begun() != self.read_mark => {
                    self.idle_until = now + self.idle_timeout;
                    self.timer.as_mut().reset(now + after);
                    self.armed = Armed::Park;
                }
                _ => {
                    self.timer.as_mut().reset(now + self.idle_timeout);
                    self.armed = Armed::Idle;
                }
            }
        }
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            match self.armed {
                Armed::Idle => {
                    return Poll::Ready(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the connection was idle for idle_timeout",
                    ))
                }
                Armed::Head => {
                    return Poll::Ready(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the request's head did not arrive within header_read_timeout",
                    ))
                }
                _ => {}
            }
            self.busy.0.park_wanted.store(true, Ordering::Release);
            self.armed = Armed::Idle;
            self.timer.as_mut().reset(self.idle_until);
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Guarded<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if matches!(this.armed, Armed::Park | Armed::Idle | Armed::Head) {
                    this.progressed();
                }
                if buf.filled().len() > before && this.busy.idle() {
                    this.head_bytes(this.busy.begun());
                }
                Poll::Ready(r)
            }
            // A write stall has its own deadline; a request in progress is not idleness.
            Poll::Pending if this.armed == Armed::Write || !this.busy.idle() => {
                if matches!(this.armed, Armed::Park | Armed::Idle | Armed::Head) {
                    this.progressed();
                }
                Poll::Pending
            }
            Poll::Pending => this.idle(cx).map(Err),
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Guarded<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_write(cx, buf) {
            Poll::Ready(r) => {
                this.written(cx);
                Poll::Ready(r)
            }
            Poll::Pending => this.write_stalled(cx).map(Err),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_write_vectored(cx, bufs) {
            Poll::Ready(r) => {
                this.written(cx);
                Poll::Ready(r)
            }
            Poll::Pending => this.write_stalled(cx).map(Err),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_times_out_unless_a_request_is_in_progress() {
        let (near, _far) = tokio::io::duplex(64);
        let busy = Busy::default();
        let mut g = Guarded::new(
            near,
            busy.clone(),
            Duration::from_secs(5),
            Duration::from_secs(60),
        );
        let guard = busy.enter();
        let mut buf = [0u8; 8];
        let read = tokio::time::timeout(Duration::from_secs(600), g.read(&mut buf)).await;
        assert!(read.is_err(), "busy: never idle");
        drop(guard);
        let start = Instant::now();
        let e = g.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(start.elapsed(), Duration::from_secs(60));
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_accepts_nothing_times_out_and_progress_resets_the_clock() {
        let (near, mut far) = tokio::io::duplex(16);
        let mut g = Guarded::new(
            near,
            Busy::default(),
            Duration::from_secs(5),
            Duration::from_secs(60),
        );
        g.write_all(&[1; 16]).await.unwrap();
        // The far side reads a little after 4 s: progress, so the clock starts again.
        let reader = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(4)).await;
            let mut b = [0u8; 8];
            far.read_exact(&mut b).await.unwrap();
            far
        });
        let start = Instant::now();
        g.write_all(&[2; 8]).await.unwrap();
        assert_eq!(start.elapsed(), Duration::from_secs(4));
        let _far = reader.await.unwrap();
        let e = g.write_all(&[3; 8]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(start.elapsed(), Duration::from_secs(4 + 5));
    }
}
