//! `idemproxy injector`: the mutating admission webhook — an AdmissionReview in, the sidecar as a JSON patch out.
//!
//! Which Pods: the MutatingWebhookConfiguration's selectors choose what
//! reaches each path. `POST /mutate` injects the Pods annotated
//! `idemproxy.dev/inject: enabled`; `POST /mutate/namespace` (for namespaces
//! the configuration selects by label) injects every Pod not annotated
//! `disabled`. A review that cannot be injected is allowed unchanged, never
//! refused: a pod is created without the sidecar rather than not at all.
//!
//! Anything that reaches the port can send a review (the API server's address
//! cannot be told apart portably), so what clients can make it hold is
//! bounded, and slow clients cannot keep reviews from being answered:
//!
//! - a review's body (at most [`MAX_REVIEW_BYTES`]) is read first, within
//!   [`BODY_DEADLINE`] of its headers, into room for its declared length
//!   taken from the body budget ([`BODY_BUDGET`], [`budget::read_body`]);
//! - only then, for a large review, room for the largest answer it can have
//!   in the answer budget ([`ANSWER_BUDGET`]), and one of [`MAX_REVIEWS`]
//!   slots for the work: reading at most [`MAX_REVIEW_NODES`] JSON values,
//!   injecting, the patch ([`patch`]). A review that waits longer than
//!   [`QUEUE_WAIT`] for either is answered 503: the API server then applies
//!   the failure policy (Ignore: the pod is created without the sidecar), as
//!   it would once its own timeout passed;
//! - an answer over one piece holds its room until the client has taken
//!   it, and a connection with an answer not taken within
//!   [`ANSWER_DEADLINE`] is closed ([`conn`]);
//! - at most [`MAX_CONNECTIONS`] connections, [`MAX_STREAMS`] HTTP/2 streams
//!   each, small flow-control windows, and a connection with nothing in
//!   progress for [`IDLE_TIMEOUT`] is closed.
//!
//! The worst case of all of these together is in
//! `deploy/kubernetes/injector/deployment.yaml`, against the container's limit.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, SemaphorePermit};
use tokio::time::Instant;

use super::Settings;
use idemproxy::config::TlsFiles;
use idemproxy::tls::{Certificates, ClientIo, Tls, TlsError};

mod budget;
mod conn;
mod patch;
mod places;
mod review;

use budget::{BodyError, Budget};

use conn::{serve_connection, Reply};
pub(crate) use patch::MAX_PATCH_BYTES;

/// The largest review read. The API server takes request bodies of at most
/// 3 MiB (its `--max-request-bytes` default) and etcd stores objects of at most
/// 1.5 MiB in protobuf, which is smaller than the same Pod in JSON: a CREATE
/// review (one object, no `oldObject`) of a Pod the API server accepts fits.
pub(crate) const MAX_REVIEW_BYTES: usize = 3 << 20;
/// The most JSON values (and keys) a review may hold before it is parsed: a Pod
/// of 200 containers with 100 variables each has about 100 000. Beyond it the
/// review is answered "allowed, unchanged" without reading the Pod, so that
/// 3 MiB of `[{},{},...]` cannot become hundreds of MiB of parsed values.
pub(crate) const MAX_REVIEW_NODES: usize = 150_000;
/// Reviews worked on at once (parsed, injected, patched, serialised), once
/// their bodies are whole; the others wait for [`QUEUE_WAIT`].
pub(crate) const MAX_REVIEWS: usize = 4;
/// Of which large reviews (a body over [`SMALL_REVIEW_BYTES`]) may take this
/// many: the work on one near the value limit holds up to about 28 MiB, and
/// an ordinary Pod's review waits behind at most this many.
pub(crate) const MAX_LARGE_REVIEWS: usize = 1;
/// A review of at most this many bytes is small: an ordinary Pod's is 3 to
/// 10 KiB. Small reviews have room kept for them in each budget.
pub(crate) const SMALL_REVIEW_BYTES: usize = 16 << 10;
/// How long a review whose body is whole waits for room for its answer and
/// a slot before it is answered 503.
pub(crate) const QUEUE_WAIT: Duration = Duration::from_secs(2);
/// Connections served at once; one more is closed as soon as it is accepted.
/// The API server opens one per replica, and another only past
/// [`MAX_STREAMS`] reviews at once on each.
pub const MAX_CONNECTIONS: usize = 64;
/// HTTP/2 streams one connection may have open.
pub(crate) const MAX_STREAMS: u32 = 4;
/// A connection with no request in progress for this long is closed.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// A TLS handshake and the request headers must each come within this.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);
/// A review's body must be whole within this of its headers (the webhook's
/// `timeoutSeconds` is 5: after that the API server has stopped waiting);
/// else 408.
pub const BODY_DEADLINE: Duration = Duration::from_secs(5);
/// On SIGTERM, reviews are still taken for this long, with `/healthz` 503,
/// while the Service's endpoints (and the API server's connections) move to
/// the other replicas; then the drain.
pub(crate) const SHUTDOWN_DELAY: Duration = Duration::from_secs(5);
/// Then reviews in progress have this long to be answered (the API
/// server stops waiting for one after the webhook's `timeoutSeconds`, 5).
pub(crate) const DRAIN_GRACE: Duration = Duration::from_secs(5);
/// An answer must be taken by the client within this of its headers, else
/// its connection is closed. The API server reads at once; its webhook
/// timeout is at most 30 s, 5 s in `webhook.yaml`.
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(10);
/// The bodies being read or waiting for their turn, in bytes of buffer
/// room. Large bodies (declaring more than [`SMALL_REVIEW_BYTES`], or
/// nothing) hold at most [`LARGE_BODIES`] of it together; the rest (4 MiB)
/// is room for a small body on every stream there can be, so that a small
/// review always finds room.
pub(crate) const BODY_BUDGET: usize =
    LARGE_BODIES + MAX_CONNECTIONS * MAX_STREAMS as usize * SMALL_REVIEW_BYTES;
const LARGE_BODIES: usize = 6 << 20;
/// The answers over one piece ([`PIECE_BYTES`]) being made and sent, in
/// bytes: a large review takes room for the largest answer its body can
/// have ([`answer_bound`]) before its work, any review room for an answer
/// over a piece after it, kept until the client has taken it. Large answers
/// (over [`SMALL_ANSWER`]) hold at most [`LARGE_ANSWERS`] together. An
/// answer of one piece takes no room: every stream can hold one anyway.
pub(crate) const ANSWER_BUDGET: usize = 8 << 20;
const LARGE_ANSWERS: usize = 6 << 20;
const SMALL_ANSWER: usize = answer_bound(SMALL_REVIEW_BYTES);
/// What the sidecar and its volume add to a Pod, at most (about 2 KiB).
const SIDECAR_BYTES: usize = 16 << 10;
/// An answer less its patch: apiVersion, uid and a warning, each bounded.
const ANSWER_OVERHEAD: usize = 4 << 10;
/// HTTP/2 flow-control windows: what a client may send before it is read.
const STREAM_WINDOW: u32 = 64 << 10;
const CONNECTION_WINDOW: u32 = 64 << 10;
/// An answer goes to hyper in pieces of this size, as the client takes them;
/// no more than one piece waits in a stream's send buffer.
const PIECE_BYTES: usize = 16 << 10;
/// The largest request head (HTTP/1.1) or header list (HTTP/2).
const MAX_HEADER_BYTES: usize = 16 << 10;
/// Kubernetes truncates longer warnings.
const MAX_WARNING_CHARS: usize = 200;

const _: () = assert!(MAX_REVIEW_BYTES <= LARGE_BODIES);
const _: () = assert!(answer_bound(MAX_REVIEW_BYTES) <= LARGE_ANSWERS);

/// The largest answer a review of `body` bytes can have: its patch is no
/// larger than the Pod's changed top-level fields written again, which is
/// under 4 times what the review took to write them (`1e15,` comes back as
/// `1000000000000000.0,`: 3.8 times), plus the sidecar, or a field-by-field
/// patch of up to [`patch::FINE_ANYWAY`], and never over [`MAX_PATCH_BYTES`];
/// base64 makes it 4/3 of that.
const fn answer_bound(body: usize) -> usize {
    let patch = body.saturating_mul(4).saturating_add(SIDECAR_BYTES);
    // A field-by-field patch may be this large even when that is larger.
    let patch = if patch > patch::FINE_ANYWAY {
        patch
    } else {
        patch::FINE_ANYWAY
    };
    let patch = if patch < MAX_PATCH_BYTES {
        patch
    } else {
        MAX_PATCH_BYTES
    };
    patch.div_ceil(3) * 4 + ANSWER_OVERHEAD
}

/// What happened to one review, for the `idemproxy_injector_reviews_total` counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReviewLabel {
    outcome: &'static str,
}

/// Which Pods a path injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scope {
    /// Only Pods annotated `enabled`.
    Annotated,
    /// Every Pod not annotated `disabled`.
    Namespace,
}

/// Why the injector did not start.
#[derive(Debug, thiserror::Error)]
pub enum InjectorError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Tls(#[from] TlsError),
}

impl InjectorError {
    /// A certificate or key that was read and is wrong (exit 2), rather than an unreadable file or a busy port.
    pub fn is_configuration(&self) -> bool {
        matches!(self, InjectorError::Tls(TlsError::Invalid { .. }))
    }
}

struct Shared {
    settings: Settings,
    reviews: Family<ReviewLabel, Counter>,
    registry: Registry,
    /// [`MAX_REVIEWS`] slots.
    slots: Semaphore,
    /// [`MAX_LARGE_REVIEWS`] places for large reviews.
    large_slots: Semaphore,
    bodies: Arc<Budget>,
    answers: Arc<Budget>,
    /// Asked to stop: `/healthz` answers 503 while reviews are still taken.
    stopping: std::sync::atomic::AtomicBool,
}

/// The webhook, bound and ready to serve.
pub struct Injector {
    listener: TcpListener,
    tls: Tls,
    shared: Arc<Shared>,
    shutdown_delay: Duration,
}

impl Injector {
    pub async fn bind(
        addr: &str,
        files: &TlsFiles,
        settings: Settings,
    ) -> Result<Injector, InjectorError> {
        let names = idemproxy::tls::Names {
            cert: "--tls-cert-file",
            key: "--tls-key-file",
        };
        let tls = Tls::named(files, names)?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| InjectorError::Bind {
                addr: addr.to_owned(),
                source,
            })?;
        let reviews = Family::<ReviewLabel, Counter>::default();
        let mut registry = Registry::default();
        registry.register(
            "idemproxy_injector_reviews",
            "Admission reviews answered, by outcome (injected, already_injected, skipped, \
             not_selected, failed, too_large, busy, malformed)",
            reviews.clone(),
        );
        Ok(Injector {
            listener,
            tls,
            shared: Arc::new(Shared {
                settings,
                reviews,
                registry,
                slots: Semaphore::new(MAX_REVIEWS),
                large_slots: Semaphore::new(MAX_LARGE_REVIEWS),
                bodies: Budget::new(BODY_BUDGET, LARGE_BODIES, SMALL_REVIEW_BYTES),
                answers: Budget::new(ANSWER_BUDGET, LARGE_ANSWERS, SMALL_ANSWER),
                stopping: std::sync::atomic::AtomicBool::new(false),
            }),
            shutdown_delay: SHUTDOWN_DELAY,
        })
    }

    /// How long, once asked to stop, it still takes reviews (with `/healthz`
    /// 503) before it drains: [`SHUTDOWN_DELAY`] unless set.
    pub fn with_shutdown_delay(mut self, delay: Duration) -> Injector {
        self.shutdown_delay = delay;
        self
    }

    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.listener.local_addr()
    }

    /// For the SIGHUP reload of the certificate.
    pub fn certificates(&self) -> Arc<Certificates> {
        self.tls.certificates()
    }

    /// Serves until `shutdown` completes; connections in progress are dropped then.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let tls = Arc::new(self.tls);
        let listener = self.listener;
        let places = places::Places::new(MAX_CONNECTIONS);
        let (drain, draining) = tokio::sync::watch::channel(false);
        let mut connections = tokio::task::JoinSet::new();
        tracing::info!(addr = ?listener.local_addr().ok(), "injector listening");
        tokio::pin!(shutdown);
        // Set once asked to stop: until then reviews are still taken, while
        // the Service's endpoints forget this replica.
        let mut stop_at: Option<Instant> = None;
        loop {
            while connections.try_join_next().is_some() {}
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = &mut shutdown, if stop_at.is_none() => {
                    self.shared.stopping.store(true, std::sync::atomic::Ordering::Relaxed);
                    tracing::info!(
                        delay = ?self.shutdown_delay,
                        "stopping: /healthz is 503; reviews are taken for the delay, then drained"
                    );
                    stop_at = Some(Instant::now() + self.shutdown_delay);
                    continue;
                }
                () = tokio::time::sleep_until(stop_at.unwrap_or_else(Instant::now)), if stop_at.is_some() => break,
            };
            let (io, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Some(place) = places.take() else {
                tracing::warn!(%peer, limit = MAX_CONNECTIONS, "every connection is serving a review; closed");
                continue;
            };
            let (tls, shared, draining) = (tls.clone(), self.shared.clone(), draining.clone());
            connections.spawn(async move {
                let mark = place.mark.clone();
                let serve = async {
                    let until = tokio::time::Instant::now() + HANDSHAKE_DEADLINE;
                    let Some(mut io) = tls.accept(io, until).await else {
                        return;
                    };
                    if let ClientIo::Tls(stream) = &mut io {
                        // A client that reads nothing leaves a piece of an
                        // answer in TLS records, not 64 KiB (rustls' default).
                        stream.get_mut().1.set_buffer_limit(Some(PIECE_BYTES));
                    }
                    serve_connection(io, shared, mark.clone(), draining).await;
                };
                tokio::select! {
                    () = serve => {}
                    () = place.mark.evicted() => {
                        tracing::debug!("connection gave its place to a new one");
                    }
                }
            });
        }
        // The drain: no new connection; each open one finishes the review it
        // is reading or answering and closes, an idle one at once.
        drop(listener);
        let _ = drain.send(true);
        if !connections.is_empty() {
            tracing::info!(
                connections = connections.len(),
                "draining: reviews in progress are answered"
            );
        }
        let drained = async { while connections.join_next().await.is_some() {} };
        if tokio::time::timeout(DRAIN_GRACE, drained).await.is_err() {
            tracing::warn!(
                connections = connections.len(),
                grace = ?DRAIN_GRACE,
                "connections still open at the end of the drain; closed"
            );
        }
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Reply> {
    let mut r = Response::new(Reply {
        bytes: body.into(),
        held: None,
    });
    *r.status_mut() = status;
    r
}

/// The answer to anything but a review; `Err` with the review's scope.
fn route(shared: &Shared, req: &Request<Incoming>) -> Result<Response<Reply>, Scope> {
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz")
            if shared.stopping.load(std::sync::atomic::Ordering::Relaxed) =>
        {
            text(StatusCode::SERVICE_UNAVAILABLE, "stopping\n")
        }
        (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
        // Liveness: 200 while the process serves, stopping or not.
        (&Method::GET, "/livez") => text(StatusCode::OK, "ok\n"),
        (&Method::GET, "/metrics") => {
            let mut out = String::new();
            if prometheus_client::encoding::text::encode(&mut out, &shared.registry).is_err() {
                return Ok(text(StatusCode::INTERNAL_SERVER_ERROR, ""));
            }
            let mut r = text(StatusCode::OK, out);
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            r
        }
        (&Method::POST, "/mutate") => return Err(Scope::Annotated),
        (&Method::POST, "/mutate/namespace") => return Err(Scope::Namespace),
        (_, "/mutate" | "/mutate/namespace" | "/healthz" | "/livez" | "/metrics") => {
            text(StatusCode::METHOD_NOT_ALLOWED, "")
        }
        _ => text(StatusCode::NOT_FOUND, ""),
    })
}

/// 503: no room or no slot in time (`what` ran out).
fn busy(shared: &Shared, what: &'static str) -> Response<Reply> {
    count(shared, "busy");
    tracing::warn!(
        full = what,
        "too many reviews at once; answered 503 (the pod is created without the sidecar)"
    );
    let mut r = text(
        StatusCode::SERVICE_UNAVAILABLE,
        "too many reviews at once\n",
    );
    r.headers_mut().insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from_static("1"),
    );
    r
}

fn body_error(shared: &Shared, e: BodyError) -> Response<Reply> {
    let (status, message) = match e {
        BodyError::Busy => return busy(shared, "the bodies being read"),
        BodyError::TooLarge => (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body is over {MAX_REVIEW_BYTES} bytes\n"),
        ),
        BodyError::Late => (
            StatusCode::REQUEST_TIMEOUT,
            "the body did not come in time\n".to_owned(),
        ),
        BodyError::Broken(e) => (
            StatusCode::BAD_REQUEST,
            format!("cannot read the body: {e}\n"),
        ),
    };
    count(shared, "malformed");
    text(status, message)
}

/// A slot for a review's work, waiting until `until`; a large review also
/// takes one of the [`MAX_LARGE_REVIEWS`] places first, so that the
/// reviews of ordinary Pods queue behind at most that many large ones.
async fn turn(
    shared: &Shared,
    large: bool,
    until: Instant,
) -> Option<(Option<SemaphorePermit<'_>>, SemaphorePermit<'_>)> {
    let place = if large {
        let place = shared.large_slots.acquire();
        Some(tokio::time::timeout_at(until, place).await.ok()?.ok()?)
    } else {
        None
    };
    let slot = shared.slots.acquire();
    let slot = tokio::time::timeout_at(until, slot).await.ok()?.ok()?;
    Some((place, slot))
}

/// A review: its body whole (within [`BODY_DEADLINE`] of the headers); for
/// a large one, room for the largest answer it can have; a slot (both
/// within [`QUEUE_WAIT`]); the work. An answer over [`PIECE_BYTES`] keeps
/// the room it needs until it has been sent. An ordinary review (a body
/// and an answer of at most 16 KiB) needs no room from the answer budget,
/// and always finds room in the body budget.
async fn handle(shared: &Shared, req: Request<Incoming>) -> Response<Reply> {
    let started = Instant::now();
    let scope = match route(shared, &req) {
        Ok(response) => return response,
        Err(scope) => scope,
    };
    let declared = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let read = budget::read_body(
        req.into_body(),
        declared,
        MAX_REVIEW_BYTES,
        &shared.bodies,
        QUEUE_WAIT,
        started + BODY_DEADLINE,
    );
    let body = match read.await {
        Ok(body) => body,
        Err(e) => return body_error(shared, e),
    };
    let until = Instant::now() + QUEUE_WAIT;
    let large = body.bytes.len() > SMALL_REVIEW_BYTES;
    // A large review's work is not done unless its answer can be held.
    let bound = answer_bound(body.bytes.len());
    let mut room = shared.answers.hold(bound);
    if large && !shared.answers.grow(&mut room, bound, until).await {
        return busy(shared, "the answers being sent");
    }
    let Some(_turn) = turn(shared, large, until).await else {
        return busy(shared, "the review slots");
    };
    let answer = review::review(shared, &body.bytes, scope);
    drop((_turn, body));
    let answer = match answer {
        Ok(answer) => answer,
        Err(message) => {
            count(shared, "malformed");
            tracing::warn!(%message, "malformed admission review");
            return text(StatusCode::BAD_REQUEST, format!("{message}\n"));
        }
    };
    let held = if answer.len() <= PIECE_BYTES {
        None // one piece: what a stream holds anyway
    } else {
        // A small review's larger answer: room now, or 503 (never a wait
        // that keeps the answer unaccounted for); a large one's is there.
        if large && answer.len() > bound {
            tracing::error!(bytes = answer.len(), bound, "an answer over its bound");
        }
        if !shared
            .answers
            .grow(&mut room, answer.len(), Instant::now())
            .await
        {
            return busy(shared, "the answers being sent");
        }
        shared.answers.shrink(&mut room, answer.len());
        Some(room)
    };
    let mut r = text(StatusCode::OK, answer);
    r.body_mut().held = held;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

fn count(shared: &Shared, outcome: &'static str) {
    shared.reviews.get_or_create(&ReviewLabel { outcome }).inc();
}
