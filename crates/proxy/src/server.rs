//! Listeners, the accept loops, the store health check, and draining on shutdown.

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
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::app::App;
use crate::body::Body;
use crate::config::{Config, Runtime, ServerConfig};
use crate::conn::{Busy, BusyGuard, Caller, Guarded};
use crate::metrics::{Counted, Outcome};
use crate::permit::Permit;
use crate::problem::Problem;
use crate::serve::{Builders, PARK_AFTER};
use crate::store::StoreSetupError;
use crate::tls::{Certificates, Tls, TlsError};
use crate::workers::Workers;
use crate::{admin, grpc, proxy, serve, tls};

/// Admin requests' headers must arrive within this time.
const ADMIN_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Admin connections open at once (docs/reference/behaviour.md#admin-limits): probes, a scrape
/// or two and an
/// operator need a handful; beyond it a new one takes an idle one's place.
const ADMIN_MAX_CONNECTIONS: usize = 32;
/// After `shutdown_grace`, how long requests cut short get to record their outcome.
const HARD_STOP_WINDOW: Duration = Duration::from_secs(2);
/// How often the store is pinged once it has answered (faster before that).
const PING_EVERY: Duration = Duration::from_secs(2);
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

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        what: &'static str,
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreSetupError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("cannot start the worker threads: {0}")]
    Workers(std::io::Error),
}

impl StartError {
    /// A file the configuration names was read and is wrong (a certificate
    /// that is not PEM, a key that does not match it): the configuration's
    /// fault, as opposed to a file not there yet or a port in use.
    pub fn is_configuration(&self) -> bool {
        matches!(self, StartError::Tls(TlsError::Invalid { .. }))
    }
}

/// A bound, not yet running proxy. `bind` then `run`: tests and `main` use the same path.
pub struct Server {
    app: Arc<App>,
    config: Config,
    listener: TcpListener,
    admin: TcpListener,
    tls: Option<Arc<Tls>>,
    /// `runtime = "per_thread"`: the threads that serve the connections
    /// (`None`: they are served by the runtime that runs the server).
    workers: Option<Workers>,
}

async fn bind(what: &'static str, addr: &str) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind {
            what,
            addr: addr.to_string(),
            source,
        })
}

impl Server {
    pub async fn bind(config: Config) -> Result<Server, StartError> {
        let tls = match &config.server.tls {
            Some(files) => Some(Arc::new(Tls::new(files)?)),
            None => None,
        };
        let app = App::new(&config)?;
        // PostgreSQL: a missing table, or one of another shape, stops the
        // start (exit 1, naming `--init-store`); it is never created here.
        app.store.check_schema().await?;
        let listener = bind("proxy", &config.server.listen).await?;
        let admin = bind("admin", &config.server.admin_listen).await?;
        let workers = match config.server.runtime {
            Runtime::PerThread => {
                let load = app.metrics.worker_gauges(config.server.worker_threads());
                Some(Workers::start(load).map_err(StartError::Workers)?)
            }
            Runtime::WorkStealing => None,
        };
        Ok(Server {
            app,
            config,
            listener,
            admin,
            tls,
            workers,
        })
    }

    /// The listener's certificates, for the SIGHUP reload; `None` without TLS.
    pub fn certificates(&self) -> Option<Arc<Certificates>> {
        self.tls.as_ref().map(|t| t.certificates())
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub fn admin_addr(&self) -> std::io::Result<SocketAddr> {
        self.admin.local_addr()
    }

    pub fn app(&self) -> Arc<App> {
        self.app.clone()
    }

    /// Serves until `shutdown` resolves, then drains: readiness off, no new
    /// connections, in-flight requests finish and their records are stored.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let Server {
            app,
            config,
            listener,
            admin,
            tls,
            workers,
        } = self;
        announce(&app, &config, &listener, &admin);
        let pinger = tokio::spawn(ping_store(app.clone()));
        let sweeper = tokio::spawn({
            let app = app.clone();
            async move { app.store.sweep_expired().await }
        });
        let trimmer = tokio::spawn(serve::give_back_freed_memory());
        let admin_task = tokio::spawn(serve_admin(app.clone(), admin, config.server.clone()));
        let connections = Connections::default();
        let front = Arc::new(Front::new(&app, &config.server, tls, &connections));
        accept(&front, listener, &connections, workers.as_ref(), shutdown).await;
        drain(&app, config.server.shutdown_grace, connections).await;
        // Whatever the workers still run (connections past the grace) ends with them.
        if let Some(workers) = workers {
            workers.stop().await;
        }
        pinger.abort();
        sweeper.abort();
        trimmer.abort();
        admin_task.abort();
        info!("stopped");
    }
}

fn announce(app: &App, config: &Config, listener: &TcpListener, admin: &TcpListener) {
    let addr = |l: &TcpListener| l.local_addr().map(|a| a.to_string()).unwrap_or_default();
    info!(
        proxy = %addr(listener),
        admin = %addr(admin),
        upstream = %config.server.upstream,
        upstream_protocol = %config.server.upstream_protocol,
        tls = config.server.tls.is_some(),
        runtime = %config.server.runtime,
        workers = config.server.worker_threads(),
        store = ?config.store.backend,
        routes = config.routes.len(),
        "listening"
    );
    if app.store.is_memory() {
        warn!("store backend is \"memory\": records live in this process only; run one replica, or use redis");
    }
}

/// The client connections' tasks, and the signal that tells them to finish.
#[derive(Default)]
struct Connections {
    tasks: TaskTracker,
    stop: CancellationToken,
}

/// What every client connection needs, made once and shared by the accept
/// loop and the workers.
struct Front {
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
    fn new(
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
async fn accept(
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

/// Draining: readiness off, open connections finish, then the forward-and-store
/// tasks; at the end of the grace, what still waits for the upstream is cut short.
async fn drain(app: &App, grace: Duration, connections: Connections) {
    app.draining.store(true, Ordering::Release);
    let deadline = tokio::time::Instant::now() + grace;
    info!(
        grace_ms = grace.as_millis() as u64,
        "shutting down: draining connections"
    );
    connections.stop.cancel();
    connections.tasks.close();
    if tokio::time::timeout_at(deadline, connections.tasks.wait())
        .await
        .is_err()
    {
        warn!("shutdown grace ran out with connections still open");
    }
    app.tasks.close();
    if tokio::time::timeout_at(deadline, app.tasks.wait())
        .await
        .is_ok()
    {
        return;
    }
    // Requests still waiting for the upstream are treated like an upstream
    // timeout (`unknown_outcome` applies); they get a moment to record that.
    warn!(
        requests = app.tasks.len(),
        "shutdown grace ran out with requests in flight; cutting them short"
    );
    app.hard_stop.cancel();
    if tokio::time::timeout(HARD_STOP_WINDOW, app.tasks.wait())
        .await
        .is_err()
    {
        warn!(
            requests = app.tasks.len(),
            "requests did not record their outcome in time; their leases will free the keys"
        );
    }
}

/// Pings the store: marks it answered (for `/readyz`) and keeps `idemproxy_store_up` current.
async fn ping_store(app: Arc<App>) {
    loop {
        let ok = match app.store.ping().await {
            Ok(()) => true,
            Err(e) => {
                warn!(error = %e, "store ping failed");
                false
            }
        };
        if ok && !app.store_answered.swap(true, Ordering::AcqRel) {
            info!("store answered");
        }
        let wait = if app.store_answered.load(Ordering::Acquire) {
            PING_EVERY
        } else {
            Duration::from_millis(250)
        };
        tokio::time::sleep(wait).await;
    }
}

/// The admin listener: at most `ADMIN_MAX_CONNECTIONS` at once, each with the
/// main listener's write and idle deadlines (a scraper that stops reading,
/// or a connection left open, holds nothing for long). At the cap a new
/// connection takes the place of the oldest one with no request in progress,
/// so connections held open (or trickling a head) cannot keep the kubelet's
/// probes out; only when every one is being answered is the new one closed.
async fn serve_admin(app: Arc<App>, listener: TcpListener, server: ServerConfig) {
    let open = Arc::new(std::sync::Mutex::new(AdminConnections::default()));
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                error!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let busy = Busy::default();
        let Some((id, evicted)) = admin_place(&open, &busy) else {
            warn!("admin connection closed: every admin connection is being answered");
            continue;
        };
        let io = Guarded::new(
            stream,
            busy.clone(),
            server.client_write_timeout,
            server.idle_timeout,
        );
        let app = app.clone();
        let service = service_fn(move |req| {
            let app = app.clone();
            // Counted while it is answered: a connection with a request in
            // progress is neither idle nor given up for a newer one.
            let in_progress = busy.enter();
            async move {
                let resp = admin::handle(app, req).await;
                drop(in_progress);
                Ok::<_, Infallible>(resp)
            }
        });
        let open = open.clone();
        tokio::spawn(async move {
            let serving = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(ADMIN_HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(io), service);
            tokio::select! {
                _ = serving => {}
                () = evicted.cancelled() => {}
            }
            let mut open = open
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            open.list.retain(|c| c.id != id);
        });
    }
}

/// The admin connections open, oldest first.
#[derive(Default)]
struct AdminConnections {
    next: u64,
    list: std::collections::VecDeque<AdminConnection>,
}

struct AdminConnection {
    id: u64,
    busy: Busy,
    /// Closes the connection when a newer one takes its place.
    evict: CancellationToken,
}

/// A place among the admin connections for a new one (its id, and what closes
/// it), giving up the oldest idle one at the cap; `None` when all are busy.
fn admin_place(
    open: &std::sync::Mutex<AdminConnections>,
    busy: &Busy,
) -> Option<(u64, CancellationToken)> {
    let mut open = open
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if open.list.len() >= ADMIN_MAX_CONNECTIONS {
        let oldest_idle = open.list.iter().position(|c| c.busy.idle())?;
        if let Some(gone) = open.list.remove(oldest_idle) {
            gone.evict.cancel();
        }
    }
    open.next += 1;
    let (id, evict) = (open.next, CancellationToken::new());
    open.list.push_back(AdminConnection {
        id,
        busy: busy.clone(),
        evict: evict.clone(),
    });
    Some((id, evict))
}
