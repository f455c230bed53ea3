//! A client connection's I/O with its two deadlines (§8): a client that
//! accepts no bytes of an answer for `client_write_timeout` is disconnected,
//! and a connection with no request in progress and no bytes either way for
//! `idle_timeout` is closed. One timer per connection, reset in place.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{Instant, Sleep};

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
    _slot: Option<OwnedSemaphorePermit>,
}

impl Busy {
    /// The counter of a connection that holds `slot` for as long as it lives.
    pub fn holding(slot: OwnedSemaphorePermit) -> Self {
        Busy(Arc::new(Counter {
            requests: AtomicUsize::new(0),
            _slot: Some(slot),
        }))
    }

    /// Counts a request until the guard is dropped.
    pub fn enter(&self) -> BusyGuard {
        self.0.requests.fetch_add(1, Ordering::AcqRel);
        BusyGuard(self.0.clone())
    }

    fn idle(&self) -> bool {
        self.0.requests.load(Ordering::Acquire) == 0
    }
}

pub struct BusyGuard(Arc<Counter>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.requests.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The scheme the client connected with, `"http"` or `"https"` (a request
/// extension set by the listener): the upstream is told it as
/// `X-Forwarded-Proto`, so that the links and cookies it makes fit what the
/// client used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientScheme(pub &'static str);

/// What the one timer is counting down.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Armed {
    Nothing,
    /// A write is waiting for the client to accept bytes.
    Write,
    /// A read is waiting, with no request in progress.
    Idle,
}

pub struct Guarded<IO> {
    io: IO,
    busy: Busy,
    write_timeout: Duration,
    idle_timeout: Duration,
    timer: Pin<Box<Sleep>>,
    armed: Armed,
}

impl<IO> Guarded<IO> {
    pub fn new(io: IO, busy: Busy, write_timeout: Duration, idle_timeout: Duration) -> Self {
        Guarded {
            io,
            busy,
            write_timeout,
            idle_timeout,
            timer: Box::pin(tokio::time::sleep(idle_timeout)),
            armed: Armed::Nothing,
        }
    }

    /// Progress either way: nothing is overdue.
    fn progressed(&mut self) {
        self.armed = Armed::Nothing;
    }

    /// Waits on `what`, arming the timer if it was counting something else;
    /// an error once it has run out.
    fn stalled(&mut self, what: Armed, cx: &mut Context<'_>) -> Poll<io::Error> {
        if self.armed != what {
            let after = match what {
                Armed::Write => self.write_timeout,
                _ => self.idle_timeout,
            };
            self.timer.as_mut().reset(Instant::now() + after);
            self.armed = what;
        }
        match self.timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(io::Error::new(
                io::ErrorKind::TimedOut,
                match what {
                    Armed::Write => "the client accepted no bytes within client_write_timeout",
                    _ => "the connection was idle for idle_timeout",
                },
            )),
            Poll::Pending => Poll::Pending,
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
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if this.armed == Armed::Idle {
                    this.progressed();
                }
                Poll::Ready(r)
            }
            // A write stall has its own deadline; a request in progress is not idleness.
            Poll::Pending if this.armed == Armed::Write || !this.busy.idle() => {
                if this.armed == Armed::Idle {
                    this.progressed();
                }
                Poll::Pending
            }
            Poll::Pending => this.stalled(Armed::Idle, cx).map(Err),
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
                this.progressed();
                Poll::Ready(r)
            }
            Poll::Pending => this.stalled(Armed::Write, cx).map(Err),
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
                this.progressed();
                Poll::Ready(r)
            }
            Poll::Pending => this.stalled(Armed::Write, cx).map(Err),
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
