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
//! cannot be told apart portably), so what one client can make it hold is
//! bounded: a body of at most [`MAX_REVIEW_BYTES`] and [`MAX_REVIEW_NODES`]
//! JSON values, read only once one of [`MAX_REVIEWS`] slots is free; at most
//! [`MAX_CONNECTIONS`] connections, [`MAX_STREAMS`] HTTP/2 streams each, and a
//! connection with no request for [`IDLE_TIMEOUT`] is closed. A review that
//! waits longer than [`QUEUE_WAIT`] for a slot gets a 503: the API server then
//! applies the failure policy (Ignore: the pod is created without the sidecar),
//! which is what would happen anyway once its own timeout passed.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::Settings;
use crate::config::TlsFiles;
use crate::tls::{Certificates, Tls, TlsError};

mod patch;
mod review;

pub use patch::MAX_PATCH_BYTES;

/// The largest review read. The API server takes request bodies of at most
/// 3 MiB (its `--max-request-bytes` default) and etcd stores objects of at most
/// 1.5 MiB in protobuf, which is smaller than the same Pod in JSON: a CREATE
/// review (one object, no `oldObject`) of a Pod the API server accepts fits.
pub const MAX_REVIEW_BYTES: usize = 3 << 20;
/// The most JSON values (and keys) a review may hold before it is parsed: a Pod
/// of 200 containers with 100 variables each has about 100 000. Beyond it the
/// review is answered "allowed, unchanged" without reading the Pod, so that
/// 3 MiB of `[{},{},...]` cannot become hundreds of MiB of parsed values.
pub const MAX_REVIEW_NODES: usize = 150_000;
/// Reviews read and answered at once; the others wait for [`QUEUE_WAIT`].
pub const MAX_REVIEWS: usize = 4;
/// How long a review waits for a slot before it is answered 503.
pub const QUEUE_WAIT: Duration = Duration::from_secs(2);
/// Connections served at once; one more is closed as soon as it is accepted.
pub const MAX_CONNECTIONS: usize = 128;
/// HTTP/2 streams one connection may have open.
pub const MAX_STREAMS: u32 = 4;
/// A connection with no request in progress for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// A TLS handshake and the request headers must each come within this.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);
/// The body must come within this once the review has a slot (the webhook's
/// `timeoutSeconds` is 5: after that the API server has stopped waiting).
const BODY_DEADLINE: Duration = Duration::from_secs(5);
/// HTTP/2 flow-control windows: what a client may send before it is read.
const STREAM_WINDOW: u32 = 64 << 10;
const CONNECTION_WINDOW: u32 = 256 << 10;
/// Kubernetes truncates longer warnings.
const MAX_WARNING_CHARS: usize = 200;

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
}

/// The webhook, bound and ready to serve.
pub struct Injector {
    listener: TcpListener,
    tls: Tls,
    shared: Arc<Shared>,
}

impl Injector {
    pub async fn bind(
        addr: &str,
        files: &TlsFiles,
        settings: Settings,
    ) -> Result<Injector, InjectorError> {
        let tls = Tls::new(files)?;
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
            }),
        })
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
        let connections = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        tracing::info!(addr = ?self.listener.local_addr().ok(), "injector listening");
        tokio::pin!(shutdown);
        loop {
            let accepted = tokio::select! {
                a = self.listener.accept() => a,
                () = &mut shutdown => return,
            };
            let (io, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(permit) = connections.clone().try_acquire_owned() else {
                tracing::warn!(%peer, limit = MAX_CONNECTIONS, "too many connections; closed");
                continue;
            };
            let (tls, shared) = (tls.clone(), self.shared.clone());
            tokio::spawn(async move {
                let _permit = permit;
                let until = tokio::time::Instant::now() + HANDSHAKE_DEADLINE;
                let Some(io) = tls.accept(io, until).await else {
                    return;
                };
                serve_connection(io, shared).await;
            });
        }
    }
}

/// Requests in progress on one connection, and when the last one ended.
struct Activity {
    started: tokio::time::Instant,
    in_flight: AtomicUsize,
    /// Milliseconds from `started` to the end of the last request.
    last_end_ms: AtomicU64,
}

impl Activity {
    fn idle_since(&self) -> tokio::time::Instant {
        self.started + Duration::from_millis(self.last_end_ms.load(Ordering::Acquire))
    }
}

/// Counts a request in progress until dropped (answered, or abandoned by the client).
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(activity: Arc<Activity>) -> InFlight {
        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(activity)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let ms = u64::try_from(self.0.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.0.last_end_ms.store(ms, Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// HTTP/1.1 or HTTP/2 on one TLS connection, closed once idle for [`IDLE_TIMEOUT`].
async fn serve_connection<I>(io: I, shared: Arc<Shared>)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity {
        started: tokio::time::Instant::now(),
        in_flight: AtomicUsize::new(0),
        last_end_ms: AtomicU64::new(0),
    });
    let service = {
        let activity = activity.clone();
        hyper::service::service_fn(move |req| {
            let (shared, busy) = (shared.clone(), InFlight::new(activity.clone()));
            async move {
                let response = handle(&shared, req).await;
                drop(busy);
                Ok::<_, Infallible>(response)
            }
        })
    };
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // Without a timer hyper's header timeout is silently off.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HANDSHAKE_DEADLINE);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_send_buf_size(64 << 10)
        .max_header_list_size(16 << 10);
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    let idle = async {
        loop {
            let deadline = activity.idle_since() + IDLE_TIMEOUT;
            tokio::time::sleep_until(deadline).await;
            if activity.in_flight.load(Ordering::Acquire) == 0
                && activity.idle_since() + IDLE_TIMEOUT <= tokio::time::Instant::now()
            {
                return;
            }
            if activity.in_flight.load(Ordering::Acquire) > 0 {
                // Checked again once that request has had time to end.
                tokio::time::sleep(IDLE_TIMEOUT).await;
            }
        }
    };
    let ended = tokio::select! {
        r = connection.as_mut() => Some(r),
        () = idle => None,
    };
    let result = match ended {
        Some(r) => r,
        None => {
            tracing::debug!("idle connection closed");
            connection.as_mut().graceful_shutdown();
            match tokio::time::timeout(HANDSHAKE_DEADLINE, connection.as_mut()).await {
                Ok(r) => r,
                Err(_) => return,
            }
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection ended");
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r
}

async fn handle(shared: &Shared, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let scope = match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => return text(StatusCode::OK, "ok\n"),
        (&Method::GET, "/metrics") => {
            let mut out = String::new();
            if prometheus_client::encoding::text::encode(&mut out, &shared.registry).is_err() {
                return text(StatusCode::INTERNAL_SERVER_ERROR, "");
            }
            let mut r = text(StatusCode::OK, out);
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            return r;
        }
        (&Method::POST, "/mutate") => Scope::Annotated,
        (&Method::POST, "/mutate/namespace") => Scope::Namespace,
        (_, "/mutate" | "/mutate/namespace" | "/healthz" | "/metrics") => {
            return text(StatusCode::METHOD_NOT_ALLOWED, "")
        }
        _ => return text(StatusCode::NOT_FOUND, ""),
    };
    // A slot before the body is read: a review waiting for one holds no more
    // than the flow-control window of its stream.
    let _slot = match tokio::time::timeout(QUEUE_WAIT, shared.slots.acquire()).await {
        Ok(Ok(permit)) => permit,
        _ => {
            count(shared, "busy");
            tracing::warn!(
                limit = MAX_REVIEWS,
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
            return r;
        }
    };
    let collect = Limited::new(req.into_body(), MAX_REVIEW_BYTES).collect();
    let body = match tokio::time::timeout(BODY_DEADLINE, collect).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) => {
            count(shared, "malformed");
            let status = if e.is::<http_body_util::LengthLimitError>() {
                StatusCode::PAYLOAD_TOO_LARGE
            } else {
                StatusCode::BAD_REQUEST
            };
            return text(status, format!("cannot read the body: {e}\n"));
        }
        Err(_) => {
            count(shared, "malformed");
            return text(
                StatusCode::REQUEST_TIMEOUT,
                "the body did not come in time\n",
            );
        }
    };
    match review::review(shared, &body, scope) {
        Ok(answer) => {
            let mut r = text(StatusCode::OK, answer);
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            r
        }
        Err(message) => {
            count(shared, "malformed");
            tracing::warn!(%message, "malformed admission review");
            text(StatusCode::BAD_REQUEST, format!("{message}\n"))
        }
    }
}

fn count(shared: &Shared, outcome: &'static str) {
    shared.reviews.get_or_create(&ReviewLabel { outcome }).inc();
}
