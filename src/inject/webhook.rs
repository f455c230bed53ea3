//! `idemproxy injector`: the mutating admission webhook — an AdmissionReview in, the sidecar as a JSON patch out.
//!
//! Which Pods: the MutatingWebhookConfiguration's selectors choose what
//! reaches each path. `POST /mutate` injects the Pods annotated
//! `idemproxy.dev/inject: enabled`; `POST /mutate/namespace` (for namespaces
//! the configuration selects by label) injects every Pod not annotated
//! `disabled`. A review that cannot be injected is allowed unchanged, never
//! refused: a pod is created without the sidecar rather than not at all.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio::net::TcpListener;

use super::pod::{inject_pod, Outcome, INJECT_ANNOTATION};
use super::Settings;
use crate::config::TlsFiles;
use crate::tls::{Certificates, Tls, TlsError};

/// The API server sends at most a few MiB (an object is at most 1.5 MiB in etcd).
const MAX_REVIEW_BYTES: usize = 4 << 20;
/// A TLS handshake, the request headers and the body must each come within this.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);

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
             not_selected, failed, malformed)",
            reviews.clone(),
        );
        Ok(Injector {
            listener,
            tls,
            shared: Arc::new(Shared {
                settings,
                reviews,
                registry,
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
        tracing::info!(addr = ?self.listener.local_addr().ok(), "injector listening");
        tokio::pin!(shutdown);
        loop {
            let accepted = tokio::select! {
                a = self.listener.accept() => a,
                () = &mut shutdown => return,
            };
            let io = match accepted {
                Ok((io, _)) => io,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let (tls, shared) = (tls.clone(), self.shared.clone());
            tokio::spawn(async move {
                let until = tokio::time::Instant::now() + HANDSHAKE_DEADLINE;
                let Some(io) = tls.accept(io, until).await else {
                    return;
                };
                let service = hyper::service::service_fn(move |req| {
                    let shared = shared.clone();
                    async move { Ok::<_, Infallible>(handle(&shared, req).await) }
                });
                let mut builder =
                    hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                // Without a timer hyper's header timeout is silently off.
                builder
                    .http1()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HANDSHAKE_DEADLINE);
                if let Err(e) = builder.serve_connection(TokioIo::new(io), service).await {
                    tracing::debug!(error = %e, "connection ended");
                }
            });
        }
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
    let collect = Limited::new(req.into_body(), MAX_REVIEW_BYTES).collect();
    let body = match tokio::time::timeout(HANDSHAKE_DEADLINE, collect).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) => {
            count(shared, "malformed");
            return text(
                StatusCode::BAD_REQUEST,
                format!("cannot read the body: {e}\n"),
            );
        }
        Err(_) => {
            count(shared, "malformed");
            return text(
                StatusCode::REQUEST_TIMEOUT,
                "the body did not come in time\n",
            );
        }
    };
    match review(shared, &body, scope) {
        Ok(answer) => {
            let mut r = text(StatusCode::OK, answer.to_string());
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

/// The AdmissionReview answer; `Err` only when there is no review to answer (no uid).
fn review(shared: &Shared, body: &[u8], scope: Scope) -> Result<serde_json::Value, String> {
    let review: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let request = review
        .get("request")
        .ok_or("not an AdmissionReview: no request")?;
    let uid = request
        .get("uid")
        .and_then(serde_json::Value::as_str)
        .ok_or("not an AdmissionReview: no request.uid")?;
    let api_version = review
        .get("apiVersion")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("admission.k8s.io/v1");
    let (outcome, patch) = decide(shared, request, scope);
    count(shared, outcome);
    let mut response = json!({ "uid": uid, "allowed": true });
    if let Some(patch) = patch {
        response["patchType"] = "JSONPatch".into();
        response["patch"] = base64::engine::general_purpose::STANDARD
            .encode(patch)
            .into();
    }
    Ok(json!({
        "apiVersion": api_version,
        "kind": "AdmissionReview",
        "response": response,
    }))
}

/// The outcome label and the patch, if any.
fn decide(
    shared: &Shared,
    request: &serde_json::Value,
    scope: Scope,
) -> (&'static str, Option<Vec<u8>>) {
    let str_at = |path: &[&str]| {
        path.iter()
            .try_fold(request, |v, k| v.get(*k))
            .and_then(serde_json::Value::as_str)
    };
    let pod_name = str_at(&["object", "metadata", "name"])
        .or(str_at(&["object", "metadata", "generateName"]))
        .unwrap_or("")
        .to_owned();
    let namespace = str_at(&["namespace"]).unwrap_or("").to_owned();
    if str_at(&["kind", "kind"]) != Some("Pod") || str_at(&["operation"]) != Some("CREATE") {
        return ("not_selected", None);
    }
    let Some(object) = request.get("object") else {
        tracing::warn!(%namespace, "admission review without an object; allowed unchanged");
        return ("failed", None);
    };
    let annotation = object
        .get("metadata")
        .and_then(|m| m.get("annotations"))
        .and_then(|a| a.get(INJECT_ANNOTATION))
        .and_then(serde_json::Value::as_str);
    if scope == Scope::Annotated && annotation != Some("enabled") {
        return ("not_selected", None);
    }
    let mut pod: serde_norway::Value = match serde_norway::to_value(object) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(%namespace, pod = %pod_name, error = %e, "cannot read the pod; allowed unchanged");
            return ("failed", None);
        }
    };
    match inject_pod(&mut pod, None, &[], &shared.settings) {
        Ok(Outcome::Injected(change)) => {
            let after = match serde_json::to_value(&pod) {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(%namespace, pod = %pod_name, error = %e, "cannot write the pod; allowed unchanged");
                    return ("failed", None);
                }
            };
            let patch = json_patch::diff(object, &after);
            match serde_json::to_vec(&patch) {
                Ok(bytes) => {
                    tracing::info!(%namespace, pod = %pod_name, app_port = change.app_port, proxy_port = change.proxy_port, "sidecar injected");
                    ("injected", Some(bytes))
                }
                Err(e) => {
                    tracing::warn!(%namespace, pod = %pod_name, error = %e, "cannot write the patch; allowed unchanged");
                    ("failed", None)
                }
            }
        }
        Ok(Outcome::AlreadyInjected) => ("already_injected", None),
        Ok(Outcome::Skipped(reason)) => {
            tracing::info!(%namespace, pod = %pod_name, %reason, "pod left as it was");
            ("skipped", None)
        }
        Err(e) => {
            tracing::warn!(%namespace, pod = %pod_name, error = %e, "cannot inject; allowed unchanged");
            ("failed", None)
        }
    }
}
