//! Serving one client connection: HTTP/1.1, or cleartext HTTP/2 when the
//! first bytes are the HTTP/2 preface; an idle HTTP/1.1 connection parked.
//!
//! Parking: hyper keeps a connection's read and write buffers (8 KiB each)
//! and its state for as long as the connection lives, also while it waits
//! for the next request — with 1,000 idle keep-alive connections that is
//! most of the proxy's memory. Once an HTTP/1.1 connection has been idle for
//! [`PARK_AFTER`] (the connection's one timer, [`crate::conn::Guarded`], says when), its
//! hyper connection is closed without closing the socket, and the task waits
//! for the client's next byte with nothing but the socket; then a new hyper
//! connection serves it, with any bytes already read put back in front.
//! The client sees one keep-alive connection throughout. `idle_timeout`
//! still counts from the end of the last request. glibc keeps what was freed
//! between live allocations, so after parkings the free pages are given back
//! ([`give_back_freed_memory`], at most once a second).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use atomic_waker::AtomicWaker;
use bytes::{Buf, Bytes, BytesMut};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::HttpService;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::conn::Busy;
use crate::metrics::{Counted, Metrics};

/// How long an HTTP/1.1 connection waits for its next request with hyper's
/// state and buffers before it is parked. Parking and waking again cost about
/// what a new connection costs hyper, so a client that sends requests back to
/// back never pays it.
pub(crate) const PARK_AFTER: Duration = Duration::from_millis(250);

const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The two protocols' builders, set up once for all connections.
pub struct Builders {
    pub http1: http1::Builder,
    pub http2: http2::Builder<TokioExecutor>,
    /// How long an HTTP/2 answer's data may wait for the client's window
    /// (`client_write_timeout`) before the connection is closed (`crate::stall`).
    pub stream_send_timeout: Duration,
}

/// After an HTTP/2 answer's send deadline: how long the connection's other
/// streams get to finish (and the GOAWAY to reach the client) before it is closed.
const STALLED_CLOSE_GRACE: Duration = Duration::from_millis(500);

/// What serving one client connection needs besides its I/O, set up by the
/// accept loop: the protocols' builders, the connection's state (`busy`),
/// its service, the metrics (parked connections), and its two outside
/// events — the first request beginning (`began`) by `until`, and the proxy
/// stopping (`stop`).
pub struct Serving<'a, S> {
    pub builders: &'a Builders,
    pub busy: Busy,
    pub service: S,
    pub metrics: &'a Metrics,
    pub began: &'a Notify,
    pub until: Instant,
    pub stop: &'a CancellationToken,
}

/// Serves `io` until the client is done, the connection fails, or `stop` is
/// cancelled (then it closes once the request in progress is answered). If
/// no request has begun (`began`) by `until`, the connection is closed: until
/// the first bytes tell the protocol, neither protocol's own limits run.
pub async fn serve<IO, S>(mut io: IO, serving: Serving<'_, S>)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: HttpService<Incoming> + Unpin + Send + 'static,
    S::Future: Send + 'static,
    S::ResBody: Send + 'static,
    <S::ResBody as http_body::Body>::Data: Send,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    <S::ResBody as http_body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let Serving {
        builders,
        busy,
        service,
        metrics,
        began,
        until,
        stop,
    } = serving;
    // Made once per connection, not per wake-up: each would register a waiter or a timer.
    let stopped = stop.cancelled();
    tokio::pin!(stopped);
    let first = first_request(began, until);
    tokio::pin!(first);
    let mut events = Events {
        stopped: Woken::new(stopped),
        first,
        begun: false,
    };
    let sniffed = tokio::select! {
        r = tokio::time::timeout_at(until, sniff(&mut io)) => r,
        () = &mut events.stopped => return,
    };
    let Ok(Ok((prefix, h2))) = sniffed else {
        return;
    };
    if prefix.is_empty() {
        return;
    }
    let io = Client::new(prefix, io, &busy);
    if h2 {
        serve_http2(builders, io, service, &busy, &mut events).await;
    } else {
        serve_http1(io, service, (builders, metrics), &busy, &mut events).await;
    }
}

/// A connection's outside events, made once for all of its phases: the
/// proxy stopping, and whether the first request began in time (`begun`
/// once it has).
struct Events<St, Fi> {
    stopped: Woken<St>,
    first: Fi,
    begun: bool,
}

/// Cleartext HTTP/2 (the preface came first), until the client is done,
/// the proxy stops, or an answer is stuck on a window the client keeps shut
/// (`crate::stall`), also while draining: hyper cannot reset that one
/// stream, so the connection is closed (which resets all of its streams).
async fn serve_http2<IO, S, St, Fi>(
    builders: &Builders,
    io: Client<IO>,
    service: S,
    busy: &Busy,
    events: &mut Events<St, Fi>,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: HttpService<Incoming> + Unpin + Send + 'static,
    S::Future: Send + 'static,
    S::ResBody: Send + 'static,
    <S::ResBody as http_body::Body>::Data: Send,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    <S::ResBody as http_body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    St: Future<Output = ()> + Unpin,
    Fi: Future<Output = bool> + Unpin,
{
    let conn = builders.http2.serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let overdue = busy.stalls().overdue(builders.stream_send_timeout);
    tokio::pin!(overdue);
    let mut overdue = Woken::new(overdue);
    let mut closing = false;
    loop {
        tokio::select! {
            biased;
            _ = &mut conn => return,
            () = &mut overdue => break,
            () = &mut events.stopped, if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            ok = &mut events.first, if !events.begun => if ok { events.begun = true } else { return },
        }
    }
    tracing::warn!(
        timeout_ms = builders.stream_send_timeout.as_millis() as u64,
        "an HTTP/2 answer waited client_write_timeout for the client's window; closing the connection"
    );
    conn.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(STALLED_CLOSE_GRACE, conn).await;
}

/// HTTP/1.1: one hyper connection after another, each until it ends or is
/// parked once idle ([`PARK_AFTER`]); a parked connection waits for its next
/// byte with nothing but the socket ([`parked`]). Bytes with no request in
/// progress are a head, timed by the connection's own timer
/// (`header_read_timeout`, `crate::conn::Guarded`).
async fn serve_http1<IO, S, St, Fi>(
    mut io: Client<IO>,
    mut service: S,
    (builders, metrics): (&Builders, &Metrics),
    busy: &Busy,
    events: &mut Events<St, Fi>,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: HttpService<Incoming> + Unpin + Send + 'static,
    S::Future: Send + 'static,
    S::ResBody: Send + 'static,
    <S::ResBody as http_body::Body>::Data: Send,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    <S::ResBody as http_body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    St: Future<Output = ()> + Unpin,
    Fi: Future<Output = bool> + Unpin,
{
    busy.set_http1();
    loop {
        let mut conn = builders
            .http1
            .serve_connection(TokioIo::new(io), service)
            .with_upgrades();
        let mut closing = false;
        let done = loop {
            tokio::select! {
                biased;
                r = &mut conn => break r,
                () = &mut events.stopped, if !closing => {
                    closing = true;
                    Pin::new(&mut conn).graceful_shutdown();
                }
                // Set by the connection's timer while `conn` was polled just above
                // (`biased`: in this same round; no waker of its own needed).
                () = park_wanted(busy), if !closing => {
                    // A request that began after the timer asked is left to finish.
                    if busy.idle() {
                        closing = true;
                        busy.set_parking(true);
                        Pin::new(&mut conn).graceful_shutdown();
                    }
                }
                ok = &mut events.first, if !events.begun => if ok { events.begun = true } else { return },
            }
        };
        let parked = busy.parking();
        busy.set_parking(false);
        // Upgraded (the tunnel has the socket), failed, or over.
        let (Ok(()), true, Some(parts)) = (done, parked, conn.into_parts()) else {
            return;
        };
        let Client {
            prefix: left,
            io: inner,
            ..
        } = parts.io.into_inner();
        service = parts.service;
        let prefix = join(left, parts.read_buf);
        let Some((inner, prefix)) = parked_until_next(inner, prefix, metrics, events).await else {
            return;
        };
        io = Client::new(prefix, inner, busy);
    }
}

/// A parked connection: with no bytes of the next request read yet, waits
/// for its first byte with nothing but the socket (counted in the parked
/// gauge). The socket and the bytes read; `None` when the client closed,
/// `idle_timeout` ran out, or the proxy is stopping.
async fn parked_until_next<IO, St, Fi>(
    inner: IO,
    prefix: Bytes,
    metrics: &Metrics,
    events: &mut Events<St, Fi>,
) -> Option<(IO, Bytes)>
where
    IO: AsyncRead + Unpin,
    St: Future<Output = ()> + Unpin,
{
    if !prefix.is_empty() {
        return Some((inner, prefix));
    }
    let counted = Counted::new(&metrics.parked);
    PARKED_SINCE_TRIM.fetch_add(1, Ordering::Relaxed);
    let mut byte = [0u8; 1];
    let next = tokio::select! {
        r = read_one(inner, &mut byte) => r,
        () = &mut events.stopped => None,
    };
    drop(counted);
    Some((next?, Bytes::copy_from_slice(&byte)))
}

/// A future polled only on its first poll and once it has woken the task:
/// `select!` polls every branch on every wake-up of the connection's task,
/// and the stop token's own future takes two locks shared by every
/// connection each time it is polled (the token's state and its waiters').
/// In between, a poll registers the task's waker and reads a flag.
struct Woken<F> {
    inner: F,
    flag: Arc<Flag>,
    polled: bool,
}

/// Set when the inner future wakes its waker, which then wakes the task.
#[derive(Default)]
struct Flag {
    fired: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.fired.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl<F> Woken<F> {
    fn new(inner: F) -> Self {
        Woken {
            inner,
            flag: Arc::default(),
            polled: false,
        }
    }
}

impl<F: Future + Unpin> Future for Woken<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        // First the task's waker, then the flag: a wake in between finds it.
        this.flag.task.register(cx.waker());
        if this.polled && !this.flag.fired.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        this.polled = true;
        let waker = Waker::from(this.flag.clone());
        Pin::new(&mut this.inner).poll(&mut Context::from_waker(&waker))
    }
}

/// Connections parked since the freed memory was last given back.
static PARKED_SINCE_TRIM: AtomicUsize = AtomicUsize::new(0);

/// Gives the memory that parked connections freed back to the system, at
/// most once a second and only after parkings: the allocator (glibc's) keeps
/// freed memory between live allocations otherwise, so a burst of
/// connections that then go idle would keep the burst's memory resident.
pub(crate) async fn give_back_freed_memory() {
    let mut every = tokio::time::interval(Duration::from_secs(1));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        if PARKED_SINCE_TRIM.swap(0, Ordering::Relaxed) > 0 {
            let _ = tokio::task::spawn_blocking(trim).await;
        }
    }
}

#[cfg(all(feature = "alloc-mimalloc", feature = "alloc-jemalloc"))]
compile_error!("the alloc-* features choose one global allocator: enable at most one");

/// The binary's global allocator is not glibc's (a Cargo feature `alloc-*`
/// chose another): glibc's settings and trimming are then left alone.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const OTHER_ALLOCATOR: bool = cfg!(any(feature = "alloc-mimalloc", feature = "alloc-jemalloc"));

/// glibc's `malloc_trim(0)`: the free pages of every arena back to the
/// system (`MADV_DONTNEED`), live allocations untouched. Measured at 0.3 to
/// 2.5 ms after 1,000 connections were parked at once.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn trim() {
    if OTHER_ALLOCATOR {
        return;
    }
    extern "C" {
        fn malloc_trim(pad: usize) -> std::ffi::c_int;
    }
    // SAFETY: malloc_trim takes no pointers and has no caller-side
    // invariants; glibc locks each arena while it walks it.
    unsafe {
        malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() {}

/// glibc's allocator in one arena (`mallopt(M_ARENA_MAX, 1)`), unless the
/// operator set `MALLOC_ARENA_MAX`: by default each thread that allocates
/// may get an arena of its own, and each keeps what it freed, so large
/// answers freed on one worker are not reused by another. Measured
/// (`bench/hostile.py`, scenario (i), 20 clients storing 8 MiB answers):
/// peak RSS 126 MiB with the default, 109 with two arenas, 93 with one,
/// against `max_buffered` + 32 MiB = 96; requests per second unchanged
/// (thread caches take the small allocations without the arena's lock).
/// Measured beside mimalloc and jemalloc too (`bench/allocators.py`, the
/// `alloc-*` features); why this stays the default:
/// docs/performance.md#memory.
/// Call it first in `main`, before any other thread runs.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn one_arena() {
    if OTHER_ALLOCATOR || std::env::var_os("MALLOC_ARENA_MAX").is_some() {
        return;
    }
    extern "C" {
        fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
    }
    /// glibc's `M_ARENA_MAX` (malloc.h).
    const M_ARENA_MAX: std::ffi::c_int = -8;
    // SAFETY: mallopt takes no pointers and has no caller-side invariants;
    // it is called before any other thread allocates.
    unsafe {
        mallopt(M_ARENA_MAX, 1);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn one_arena() {}

/// jemalloc's settings when the `alloc-jemalloc` feature chooses it (read
/// by jemalloc as it starts; `_RJEM_MALLOC_CONF` in the environment still
/// overrides them): one arena, and a background thread that gives freed
/// pages back within a second. Measured (`bench/allocators.py`): with its
/// defaults jemalloc held 28–33 MiB with 1,000 idle connections after a
/// burst, with these 17.5–18.6 MiB, at 0.92–0.94× glibc's CPU per request;
/// giving pages back at once (`dirty_decay_ms:0`) cost 1.7–2× the CPU.
#[cfg(feature = "alloc-jemalloc")]
#[allow(unsafe_code)]
#[export_name = "_rjem_malloc_conf"]
pub(crate) static JEMALLOC_CONF: &[u8; 70] =
    b"narenas:1,background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0\0";

/// Whether a request began (`began`) by `until`.
async fn first_request(began: &Notify, until: Instant) -> bool {
    tokio::select! {
        () = began.notified() => true,
        () = tokio::time::sleep_until(until) => false,
    }
}

/// Ready once the connection's timer has asked for it to be parked (and
/// clears the ask); never registers a waker.
fn park_wanted(busy: &Busy) -> impl std::future::Future<Output = ()> + '_ {
    std::future::poll_fn(move |_| {
        if busy.take_park_wanted() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
}

/// Reads one byte into `byte`; the I/O back when there was one.
async fn read_one<IO: AsyncRead + Unpin>(mut io: IO, byte: &mut [u8; 1]) -> Option<IO> {
    match io.read(byte).await {
        Ok(1) => Some(io),
        _ => None,
    }
}

/// The bytes read and not yet served, `a` then `b`, in an allocation of their
/// own: `b` is a view into hyper's read buffer, which it would keep alive.
fn join(a: Bytes, b: Bytes) -> Bytes {
    if a.is_empty() && b.is_empty() {
        return Bytes::new();
    }
    let mut both = BytesMut::with_capacity(a.len() + b.len());
    both.extend_from_slice(&a);
    both.extend_from_slice(&b);
    both.freeze()
}

/// Reads until the bytes are the HTTP/2 preface or cannot be: the bytes
/// read, and whether they are the preface. Empty: the client closed.
async fn sniff<IO: AsyncRead + Unpin>(io: &mut IO) -> io::Result<(Bytes, bool)> {
    let mut buf = [0u8; PREFACE.len()];
    let mut n = 0;
    while n < buf.len() {
        let got = io.read(&mut buf[n..]).await?;
        if got == 0 {
            break;
        }
        n += got;
        if buf[..n] != PREFACE[..n] {
            break;
        }
    }
    Ok((Bytes::copy_from_slice(&buf[..n]), &buf[..] == PREFACE))
}

/// The client's bytes, with those already read put back in front; its
/// shutdown does not close the socket while the connection is being parked.
struct Client<IO> {
    prefix: Bytes,
    io: IO,
    busy: Busy,
}

impl<IO> Client<IO> {
    fn new(prefix: Bytes, io: IO, busy: &Busy) -> Self {
        Client {
            prefix,
            io,
            busy: busy.clone(),
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Client<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.prefix.is_empty() {
            // Read before (sniffed, or kept from before a parking): with no
            // request in progress, the start of a head whose clock runs.
            this.busy.head_handed();
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix[..n]);
            this.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Client<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.busy.parking() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}
