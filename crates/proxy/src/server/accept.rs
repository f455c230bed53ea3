//! The client listener: the accept loop, each connection served (TLS,
//! HTTP/1.1 or HTTP/2, its deadlines), its requests begun and their answers tracked.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::server::conn::http2;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::app::App;
use crate::body::Body;
use crate::config::ServerConfig;
use crate::conn::{Busy, BusyGuard, Caller, Guarded};
use crate::metrics::{Counted, Outcome};
use crate::permit::Permit;
use crate::problem::Problem;
use crate::serve::{Builders, PARK_AFTER};
use crate::tls::Tls;
use crate::workers::Workers;
use crate::{grpc, proxy, serve, tls};

use super::Connections;

/// HTTP/2 streams one client connection may have open at once; beyond it a
/// new stream is refused (`REFUSED_STREAM`, safe to retry).
const H2_MAX_CONCURRENT_STREAMS: u32 = 100;
/// HTTP/2 flow-control windows: what a client may send before the proxy
/// reads it, per stream and per connection. The protocol's own default
/// (64 KiB - 1), not hyper's 1 MiB: a connection then holds at most this much
/// unread body, as an HTTP/1.1 connection holds about its header buffer.
const H2_WINDOW: u32 = 65_535;
/// Answer bytes queued per HTTP/2 stream before the client's window takes them.
const H2_SEND_BUFFER: usize = 64 * 1024;
/// How long an HTTP/2 keep-alive ping may go unanswered before the connection is closed.
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// What every client connection needs, made once and shared by the accept
/// loop and the workers.
pub(super) struct Front {
    app: Arc<App>,
    server: ServerConfig,
    /// Requests in progress at once, over all connections, `max_connections`
    /// for each protocol: over HTTP/2 it keeps 100 streams on each of
    /// `max_connections` connections from holding a handler, an upstream
    /// connection and an answer each; over HTTP/1.1 it bounds the upstream
    /// exchanges of clients that hung up (they go on without a connection).
    /// A request holds its place until its answer is sent and its upstream
    /// exchange has ended (`Permit`). Two shares, so that HTTP/2 streams
    /// stuck on a shut window (until their send deadline, `crate::stall`)
    /// never take the places HTTP/1.1 clients need.
    http1_requests: Arc<Semaphore>,
    http2_requests: Arc<Semaphore>,
    http: Builders,
    tls: Option<Arc<Tls>>,
    scheme: &'static str,
    /// Tells the connections to finish (draining).
    stop: CancellationToken,
}

impl Front {
    pub(super) fn new(
        app: &Arc<App>,
        server: &ServerConfig,
        tls: Option<Arc<Tls>>,
        connections: &Connections,
    ) -> Self {
        Front {
            app: app.clone(),
            server: server.clone(),
            http1_requests: Arc::new(Semaphore::new(server.max_connections)),
            http2_requests: Arc::new(Semaphore::new(server.max_connections)),
            http: connection_builder(server),
            scheme: if tls.is_some() { "https" } else { "http" },
            tls,
            stop: connections.stop.clone(),
        }
    }
}

/// Accepts connections until `shutdown` resolves; each is served in a task of
/// its own, tracked by `connections` for draining: on this runtime, or with
/// `workers` on the worker that holds the fewest connections.
pub(super) async fn accept(
    front: &Arc<Front>,
    listener: TcpListener,
    connections: &Connections,
    workers: Option<&Workers>,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(front.server.max_connections));
    front.app.accepting.store(true, Ordering::Release);
    tokio::pin!(shutdown);
    loop {
        // At the connection limit, stop accepting: new clients wait in the kernel's backlog.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(s) => s,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let Some(workers) = workers else {
            let busy = Busy::holding(slot, None);
            let serving = connection(front.clone(), stream, peer, busy);
            connections.tasks.spawn(serving);
            continue;
        };
        // Handed over as a plain socket, registered again with the worker's runtime.
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "cannot hand a connection to a worker");
                continue;
            }
        };
        let worker = workers.least_loaded();
        let busy = Busy::holding(slot, workers.load(worker).map(Counted::new));
        let made = workers.run(worker, || match TcpStream::from_std(stream) {
            Ok(stream) => {
                let serving = connection(front.clone(), stream, peer, busy);
                Some(Box::pin(connections.tasks.track_future(serving)))
            }
            Err(e) => {
                warn!(error = %e, "a worker cannot take a connection");
                None
            }
        });
        if !made {
            warn!(worker = worker + 1, "connection closed: no worker took it");
        }
    }
    front.app.accepting.store(false, Ordering::Release);
}

/// Serves one client connection: its deadlines, the TLS handshake (a slow
/// one holds up no other connection) and its requests. Its timer and its
/// service are made now, in the context of the runtime that will run it
/// (see `Workers::run`).
fn connection(
    front: Arc<Front>,
    stream: TcpStream,
    peer: SocketAddr,
    busy: Busy,
) -> impl Future<Output = ()> + Send + 'static {
    let s = &front.server;
    let stream = Guarded::new(stream, busy.clone(), s.client_write_timeout, s.idle_timeout)
        .park_after(PARK_AFTER)
        .head_timeout(s.header_read_timeout);
    let requests = Requests {
        app: front.app.clone(),
        busy: busy.clone(),
        http1: front.http1_requests.clone(),
        http2: front.http2_requests.clone(),
        began: Arc::new(Notify::new()),
        caller: Caller {
            addr: peer,
            scheme: front.scheme,
        },
    };
    let began = requests.began.clone();
    let service = service_fn(move |req| requests.begin(req));
    // The handshake and the first request's headers, together.
    let until = Instant::now() + s.header_read_timeout;
    async move {
        // A handshake in progress does not hold up draining.
        let opened = tokio::select! {
            io = tls::open(front.tls.as_deref(), stream, until) => io,
            () = front.stop.cancelled() => None,
        };
        let Some(io) = opened else {
            return;
        };
        // Until the first bytes tell HTTP/1.1 from HTTP/2, neither protocol's
        // own limits run: a client that sends nothing, or trickles the HTTP/2
        // preface or its first header block, would otherwise hold its slot until
        // `idle_timeout`. So no request begun by `until` closes the connection.
        // Later requests: HTTP/1.1 has its header timeout; on HTTP/2, bytes that
        // keep arriving keep the connection open.
        let serving = serve::Serving {
            builders: &front.http,
            busy,
            service,
            metrics: &front.app.metrics,
            began: &began,
            until,
            stop: &front.stop,
        };
        serve::serve(io, serving).await;
    }
}

/// What a connection's service needs to begin each request on it: made
/// once per connection, in the context of the runtime that will run it.
struct Requests {
    app: Arc<App>,
    busy: Busy,
    /// The places among the requests in progress, per protocol (see [`Front`]).
    http1: Arc<Semaphore>,
    http2: Arc<Semaphore>,
    /// Told when a request begins: the connection's first deadline is then met.
    began: Arc<Notify>,
    caller: Caller,
}

impl Requests {
    /// Begins one request: counts it in progress on its connection, takes its
    /// place among the requests in progress (or answers that there is none),
    /// and hands it to the proxy. The future hyper keeps only awaits the answer.
    fn begin(
        &self,
        mut req: Request<Incoming>,
    ) -> impl Future<Output = Result<Response<Tracked>, Infallible>> + Send + 'static {
        // For an upgrade tunnel to keep its connection counted as busy
        // while it lives (only there: an extension costs allocations).
        if proxy::is_upgrade(&req) {
            req.extensions_mut().insert(self.busy.clone());
        }
        let in_progress = self.busy.enter();
        let h2 = req.version() >= http::Version::HTTP_2;
        // hyper keeps an HTTP/1.1 connection whose request named an upgrade
        // waiting for one: answered otherwise, it cannot carry another request.
        let asked_upgrade = !h2 && req.headers().contains_key(http::header::UPGRADE);
        let requests = if h2 { &self.http2 } else { &self.http1 };
        let permit = requests.clone().try_acquire_owned().ok();
        self.began.notify_one();
        // Begun here, so that the future hyper keeps (and moves) holds a box,
        // not the request. On the heap (`Handling`): the handler's state is
        // freed once it has answered, while the stream's task lives on to send the body.
        let handling = match permit {
            Some(p) => proxy::handle(self.app.clone(), req, self.caller, Permit::new(p)),
            None => Box::pin(std::future::ready((
                over_capacity(&self.app, &req),
                Permit::None,
            ))),
        };
        async move {
            let (mut resp, permit) = handling.await;
            if asked_upgrade && resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
                let close = http::HeaderValue::from_static("close");
                resp.headers_mut().insert(http::header::CONNECTION, close);
            }
            Ok::<_, Infallible>(resp.map(|body| Tracked {
                body,
                in_progress,
                _request: permit,
                sending: if h2 { Sending::Idle } else { Sending::Untimed },
            }))
        }
    }
}

/// The builders for client connections: HTTP/1.1, or cleartext HTTP/2 when
/// the connection opens with the HTTP/2 preface (prior knowledge, as gRPC
/// clients use it). The docs/reference/behaviour.md#h2-limits bounds hold per stream as per
/// request.
fn connection_builder(s: &ServerConfig) -> Builders {
    let mut http1 = http1::Builder::new();
    // Heads are timed by the connection's own timer (`Guarded::head_timeout`):
    // hyper's would box and register a timer per request.
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_buf_size(s.max_header_bytes.max(8192));
    let mut http2 = http2::Builder::new(TokioExecutor::new());
    http2
        .timer(TokioTimer::new())
        .max_concurrent_streams(H2_MAX_CONCURRENT_STREAMS)
        // Decoded header list beyond it: 431, as HTTP/1.1's header buffer gives.
        .max_header_list_size(u32::try_from(s.max_header_bytes).unwrap_or(u32::MAX))
        .initial_stream_window_size(H2_WINDOW)
        .initial_connection_window_size(H2_WINDOW)
        .max_send_buf_size(H2_SEND_BUFFER)
        // The ping finds a dead peer under a long request. It comes later than
        // `idle_timeout`, so that an idle connection is closed by that timeout
        // rather than kept open by its own pings (an answer is traffic).
        .keep_alive_interval(s.idle_timeout + Duration::from_secs(1))
        .keep_alive_timeout(H2_PING_TIMEOUT);
    Builders {
        http1,
        http2,
        stream_send_timeout: s.client_write_timeout,
    }
}

/// A response body; its request counts as in progress (so its connection is
/// not idle, and it holds its place among the requests in progress) until
/// the body is done with. Over HTTP/2 it tells its connection's
/// [`Stalls`](crate::stall::Stalls) while its data waits for the client's window.
struct Tracked {
    body: Body,
    in_progress: BusyGuard,
    _request: Permit,
    sending: Sending,
}

/// Where an answer's data is, for the HTTP/2 send deadline.
enum Sending {
    /// HTTP/1.1: the connection's write timer sees a client that reads nothing.
    Untimed,
    /// Nothing handed over that has not gone out.
    Idle,
    /// Data handed over waits to go out (its id among the connection's stalls).
    Waiting(u64),
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Sending::Waiting(id) = self.sending {
            self.in_progress.stalls().sent(id);
        }
    }
}

/// The answer to a request beyond the requests in progress at once: 503
/// `proxy-busy` (a gRPC error on a gRPC request), before any handler runs.
fn over_capacity(app: &App, req: &Request<Incoming>) -> Response<Body> {
    let problem = Problem::ProxyBusy;
    let routes = app.routes();
    let route = routes.find(req.method(), req.uri(), req.headers());
    let name = route.map_or(&*proxy::UNPROTECTED, |r| &r.name);
    app.metrics.request(name, Outcome::Busy);
    problem.response_to(&uuid::Uuid::new_v4(), grpc::is_grpc(req.headers()))
}

impl http_body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        // Asked again: what was handed over has gone out.
        if let Sending::Waiting(id) = this.sending {
            this.in_progress.stalls().sent(id);
            this.sending = Sending::Idle;
        }
        let polled = std::pin::Pin::new(&mut this.body).poll_frame(cx);
        if let (Sending::Idle, std::task::Poll::Ready(Some(Ok(frame)))) = (&this.sending, &polled) {
            if frame.data_ref().is_some_and(|d| !d.is_empty()) {
                this.sending = Sending::Waiting(this.in_progress.stalls().handed());
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
