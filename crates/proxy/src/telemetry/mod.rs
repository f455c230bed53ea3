//! Distributed tracing (`[telemetry]`, docs/telemetry.md): spans recorded
//! on the request path as small records, encoded as OTLP and sent on a
//! thread of their own.
//!
//! Off unless an endpoint is configured: then `App::telemetry` is `None`, no
//! request has a trace context (`Ctx::trace` is `None`), and the request
//! path pays one branch on that `Option` where a span would start; the
//! client's `traceparent` and `tracestate` go upstream untouched.
//!
//! On: each request gets a [`ServerSpan`]: its trace id and span id (the
//! client's trace, or a new one: `client_context`) and whether it is
//! sampled. An unsampled request carries only those ids, to send upstream
//! in `traceparent`: no record, no attribute, no allocation. A sampled one
//! records its SERVER span, INTERNAL children for the reserve, a wait and
//! the completion on protected routes, and a CLIENT span for the upstream
//! exchange, whose context goes upstream. Each is a [`span::SpanRecord`] of ids,
//! times and typed values, queued when it ends; the export thread
//! ([`export`]) converts and encodes them ([`otlp`]).
//!
//! Started once, with the process: a changed `[telemetry]` needs a restart
//! (SIGHUP reports it, and keeps tracing as it is).

mod context;
mod export;
mod otlp;
mod span;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{HeaderValue, Request, Version};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::mpsc;

use self::context::{Ratio, SpanId, TraceId};
use self::export::SpanQueue;
use self::span::{Link, Name, SpanKind, SpanRecord};
use crate::config::{ClientContext, TelemetryConfig, UpstreamUrl};
use crate::record::TraceRef;

pub use self::span::Value;

/// Finished spans waiting for export, at most; beyond it they are dropped (and counted).
pub(crate) const QUEUE: usize = 2048;
/// How long shutdown waits for the last spans to go.
pub(crate) const FLUSH_DEADLINE: Duration = Duration::from_secs(2);

/// The `idempotency.*` attributes (docs/telemetry.md#spans).
pub(crate) const OUTCOME: &str = "idempotency.outcome";
pub(crate) const ROUTE: &str = "idempotency.route";
pub(crate) const RECORD_ID: &str = "idempotency.record_id";
pub(crate) const ORIGINAL_TRACE_ID: &str = "idempotency.original_trace_id";

/// `http.request.method` of a method the conventions do not know.
pub(crate) const OTHER: &str = "_OTHER";

/// `error.type` of a span whose request or exchange was dropped unanswered
/// (the client went away, or the proxy stopped).
const CANCELLED: &str = "cancelled";

/// Tracing, when it is on: how requests are sampled, and the way to the export thread.
pub struct Telemetry {
    queue: Arc<SpanQueue>,
    flush: mpsc::UnboundedSender<export::Flush>,
    ratio: Ratio,
    client_context: ClientContext,
    /// `scheme://authority` of the upstream, for `url.full`.
    upstream_origin: String,
    /// The upstream's host and port, for the CLIENT span's `server.*`.
    upstream_host: Arc<str>,
    upstream_port: i64,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Telemetry")
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.queue.close();
    }
}

impl Telemetry {
    /// Starts tracing when `config` names an endpoint; `dropped` counts the
    /// spans that could not be exported. `None` (logged) when the export
    /// thread cannot start: the proxy runs without tracing rather than not at all.
    pub fn start(
        config: &TelemetryConfig,
        upstream: &UpstreamUrl,
        dropped: Counter,
    ) -> Option<Telemetry> {
        let endpoint = config.otlp_endpoint.clone()?;
        let queue = SpanQueue::new(QUEUE, dropped);
        let (flush, flushes) = mpsc::unbounded_channel();
        let encoder = otlp::Encoder::new(&resource(config), "idemproxy", env!("CARGO_PKG_VERSION"));
        let to = export::Destination {
            protocol: config.otlp_protocol,
            endpoint,
            headers: config.headers.clone(),
        };
        if let Err(e) = export::start(to, encoder, queue.clone(), flushes) {
            tracing::error!(error = %e, "cannot start the span export; tracing is off");
            return None;
        }
        tracing::info!(
            endpoint = crate::config::shown_endpoint(config.otlp_endpoint.as_deref().unwrap_or_default()),
            protocol = %config.otlp_protocol,
            service_name = %config.service_name,
            sample_ratio = config.sample_ratio,
            client_context = %config.client_context,
            "tracing on: spans exported over OTLP"
        );
        let port = upstream.authority.port_u16().unwrap_or(80);
        Some(Telemetry {
            queue,
            flush,
            ratio: Ratio::new(config.sample_ratio),
            client_context: config.client_context,
            upstream_origin: format!("{}://{}", upstream.scheme, upstream.authority),
            upstream_host: Arc::from(upstream.authority.host()),
            upstream_port: i64::from(port),
        })
    }

    /// Sends what is queued and waits for it, at most `deadline` (at shutdown).
    pub fn flush(&self, deadline: Duration) {
        let (done, flushed) = std::sync::mpsc::sync_channel(1);
        if self.flush.send(done).is_ok() && flushed.recv_timeout(deadline).is_err() {
            tracing::warn!("spans not exported before the flush deadline were dropped");
        }
    }

    /// The SERVER span of a request (`route`: its name and path pattern,
    /// when one protects it). Its trace is the client's, or a new one, as
    /// `client_context` says; only a sampled span records anything.
    pub(crate) fn server_span<B>(
        &self,
        req: &Request<B>,
        route: Option<(&str, &str)>,
        scheme: &'static str,
        client: SocketAddr,
    ) -> ServerSpan {
        let remote = match self.client_context {
            ClientContext::Ignore => None,
            _ => context::remote(req.headers()),
        };
        let span_id = context::new_span_id();
        let (trace_id, sampled, parent, trace_state, link) = match (self.client_context, remote) {
            (ClientContext::Follow, Some(r)) => {
                (r.trace_id, r.sampled, Some(r.span_id), r.trace_state, None)
            }
            (_, remote) => {
                let trace_id = context::new_trace_id();
                (trace_id, self.ratio.samples(&trace_id), None, None, remote)
            }
        };
        let ids = Parent {
            trace_id,
            span_id,
            sampled,
            trace_state,
        };
        // The client's `tracestate` does not go upstream with a trace that
        // is not the client's (W3C: it is discarded with an invalid `traceparent`).
        let restarted = self.client_context != ClientContext::Follow || parent.is_none();
        if !sampled {
            return ServerSpan {
                ids,
                restarted,
                open: None,
            };
        }
        let method = method_name(req.method());
        let route = route.map(|(name, pattern)| (name, Arc::<str>::from(pattern)));
        let name = Name::Http {
            method,
            route: route.as_ref().map(|(_, p)| p.clone()),
        };
        let mut r = SpanRecord::new(SpanKind::Server, name, trace_id, span_id);
        r.parent = parent.map(|p| (p, true));
        r.trace_state = ids.trace_state.clone();
        r.attributes.reserve(14);
        method_attributes(&mut r, req.method(), method);
        r.set("url.path", Value::Text(cut(req.uri().path())));
        r.set("url.scheme", Value::Static(scheme));
        let version = protocol_version(req.version());
        r.set("network.protocol.version", Value::Static(version));
        r.set("client.address", Value::Ip(client.ip()));
        if let Some((host, port)) = server_address(req) {
            r.set("server.address", Value::Text(cut(host)));
            // No port named: the scheme's.
            let port = port.unwrap_or(if scheme == "https" { 443 } else { 80 });
            r.set("server.port", Value::Int(i64::from(port)));
        }
        if let Some((name, pattern)) = route {
            r.set(ROUTE, Value::Text(name.into()));
            r.set("http.route", Value::SpanQueue(pattern));
        }
        if let Some(remote) = link {
            r.links.push(Link {
                trace_id: remote.trace_id,
                span_id: remote.span_id,
                trace_state: remote.trace_state,
                sampled: remote.sampled,
                remote: true,
            });
        }
        ServerSpan {
            ids,
            restarted,
            open: Some(Mutex::new(Open::new(&self.queue, r, true))),
        }
    }

    /// An INTERNAL child of `parent`, when it is sampled: it ends when dropped.
    /// `attributes` are made only then.
    pub fn child(
        &self,
        parent: &Parent,
        name: &'static str,
        attributes: impl FnOnce() -> Vec<(&'static str, Value)>,
    ) -> Option<Child> {
        if !parent.sampled {
            return None;
        }
        let mut r = SpanRecord::new(
            SpanKind::Internal,
            Name::Static(name),
            parent.trace_id,
            context::new_span_id(),
        );
        r.parent = Some((parent.span_id, false));
        r.trace_state = parent.trace_state.clone();
        r.attributes = attributes();
        Some(Child(Open::new(&self.queue, r, false)))
    }

    /// The upstream exchange: `request` gets the trace's context in
    /// `traceparent` (the client's is replaced; its `tracestate` is kept, but
    /// not when the trace is not the client's); the CLIENT
    /// span when the request is sampled.
    pub(crate) fn client_span<B>(
        &self,
        server: &ServerSpan,
        request: &mut Request<B>,
    ) -> Option<ClientSpan> {
        let p = &server.ids;
        let span_id = if p.sampled {
            context::new_span_id()
        } else {
            p.span_id
        };
        set_context(request, p, &span_id, server.restarted);
        if !p.sampled {
            return None;
        }
        let method = method_name(request.method());
        let name = Name::Http {
            method,
            route: None,
        };
        let mut r = SpanRecord::new(SpanKind::Client, name, p.trace_id, span_id);
        r.parent = Some((p.span_id, false));
        r.trace_state = p.trace_state.clone();
        r.attributes.reserve(8);
        method_attributes(&mut r, request.method(), method);
        let full = format!("{}{}", self.upstream_origin, request.uri().path());
        r.set("url.full", Value::Text(cut(&full)));
        r.set(
            "server.address",
            Value::SpanQueue(self.upstream_host.clone()),
        );
        r.set("server.port", Value::Int(self.upstream_port));
        Some(ClientSpan(Open::new(&self.queue, r, true)))
    }
}

impl Telemetry {
    /// A tunnel's handshake, which has no CLIENT span: the client's
    /// `traceparent` and `tracestate` go upstream as they came when the
    /// request follows the client's trace; else (`client_context` link or
    /// ignore, or no valid `traceparent`) the proxy's context replaces them,
    /// so that a tunnel cannot carry a client's sampling decision either.
    pub(crate) fn tunnel_context<B>(&self, server: &ServerSpan, request: &mut Request<B>) {
        if server.restarted {
            set_context(request, &server.ids, &server.ids.span_id, true);
        }
    }
}

/// `traceparent` for the trace of `p` with `span_id` as the parent; the
/// client's `tracestate` removed when the trace is not the client's.
fn set_context<B>(request: &mut Request<B>, p: &Parent, span_id: &SpanId, restarted: bool) {
    let value = context::format_traceparent(&p.trace_id, span_id, p.sampled);
    if let Ok(v) = HeaderValue::from_bytes(&value) {
        request.headers_mut().insert(context::TRACEPARENT, v);
    }
    if restarted {
        request.headers_mut().remove(context::TRACESTATE);
    }
}

/// The resource every span comes from: what the SDKs report of themselves,
/// `OTEL_RESOURCE_ATTRIBUTES`, and `service.name` (which the configuration decides).
fn resource(config: &TelemetryConfig) -> Vec<(String, String)> {
    let mut attributes: Vec<(String, String)> = vec![
        ("telemetry.sdk.name".into(), "idemproxy".into()),
        ("telemetry.sdk.language".into(), "rust".into()),
        (
            "telemetry.sdk.version".into(),
            env!("CARGO_PKG_VERSION").into(),
        ),
    ];
    for (k, v) in &config.resource_attributes {
        attributes.retain(|(key, _)| key != k);
        attributes.push((k.clone(), v.clone()));
    }
    attributes.retain(|(key, _)| key != "service.name");
    attributes.push(("service.name".into(), config.service_name.clone()));
    attributes
}

/// A span's place in its trace: what its children and the upstream need.
#[derive(Clone, Debug)]
pub struct Parent {
    trace_id: TraceId,
    span_id: SpanId,
    sampled: bool,
    trace_state: Option<Arc<str>>,
}

impl Parent {
    /// The trace and span ids, as log fields, when the span records.
    pub(crate) fn log_ids(&self) -> Option<(String, String)> {
        self.sampled.then(|| {
            (
                context::hex_string(&self.trace_id),
                context::hex_string(&self.span_id),
            )
        })
    }
}

/// A request's SERVER span: its ids always, its record when sampled. Ended
/// by [`ServerSpan::end`]; dropped unended (the request was dropped), it is
/// sent with `error.type = "cancelled"`.
pub(crate) struct ServerSpan {
    ids: Parent,
    /// The trace is not the client's (`client_context` link or ignore, or
    /// no valid `traceparent` came).
    restarted: bool,
    /// Behind a lock: the request's handling shares its context by reference.
    open: Option<Mutex<Open>>,
}

impl ServerSpan {
    /// Its ids, for children that may outlive it.
    pub fn parent(&self) -> &Parent {
        &self.ids
    }

    /// The trace and span ids, as log fields, when it records.
    pub(crate) fn log_ids(&self) -> Option<(String, String)> {
        self.ids.log_ids()
    }

    /// The ids to keep with the execution's records: only a sampled span's
    /// (a link to a span never exported leads nowhere).
    pub(crate) fn trace_ref(&self) -> Option<TraceRef> {
        self.ids.sampled.then_some(TraceRef {
            trace_id: self.ids.trace_id,
            span_id: self.ids.span_id,
        })
    }

    fn record(&self, f: impl FnOnce(&mut SpanRecord)) {
        if let Some(open) = &self.open {
            let mut open = open.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(r) = open.record.as_deref_mut() {
                f(r);
            }
        }
    }

    /// A replay, a 409 or a 422: a link to the execution's SERVER span.
    pub(crate) fn link_original(&self, original: TraceRef) {
        if original.trace_id == [0; 16] || original.span_id == [0; 8] {
            return;
        }
        self.record(|r| {
            r.links.push(Link {
                trace_id: original.trace_id,
                span_id: original.span_id,
                trace_state: None,
                sampled: true,
                remote: true,
            });
            r.set(ORIGINAL_TRACE_ID, Value::TraceId(original.trace_id));
        });
    }

    /// Ends the span with what became of the request: a 5xx is an error.
    pub fn end(&self, status: u16, outcome: &'static str, record_id: Option<&str>) {
        let Some(open) = &self.open else { return };
        let mut open = open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = open.record.as_deref_mut() {
            r.set("http.response.status_code", Value::Int(i64::from(status)));
            r.set(OUTCOME, Value::Static(outcome));
            if let Some(id) = record_id {
                r.set(RECORD_ID, Value::Text(id.into()));
            }
            if status >= 500 {
                r.set("error.type", Value::Text(status.to_string().into()));
                r.error = true;
            }
        }
        open.cancelled_if_dropped = false;
        open.finish();
    }
}

/// A recorded span until it ends: queued then (on drop at the latest).
struct Open {
    queue: Arc<SpanQueue>,
    record: Option<Box<SpanRecord>>,
    /// Dropped without an end, it was cut short: `error.type = "cancelled"`.
    cancelled_if_dropped: bool,
}

impl Open {
    fn new(queue: &Arc<SpanQueue>, record: SpanRecord, cancelled_if_dropped: bool) -> Open {
        Open {
            queue: queue.clone(),
            record: Some(Box::new(record)),
            cancelled_if_dropped,
        }
    }

    fn finish(&mut self) {
        if let Some(mut r) = self.record.take() {
            if self.cancelled_if_dropped {
                r.set("error.type", Value::Static(CANCELLED));
                r.error = true;
            }
            r.end_ns = span::now_ns();
            self.queue.push(*r);
        }
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.finish();
    }
}

/// An INTERNAL span: ends when dropped (its record is queued then).
pub struct Child(#[allow(dead_code)] Open);

/// An upstream exchange's span; [`ClientSpan::end`] says how it went.
pub(crate) struct ClientSpan(Open);

impl ClientSpan {
    /// The upstream's status, or the kind of failure when there was none: a
    /// failure or a 5xx is an error (a 4xx is the API's answer to the client).
    pub fn end(mut self, answered: Result<u16, &'static str>) {
        if let Some(r) = self.0.record.as_deref_mut() {
            match answered {
                Ok(status) => {
                    r.set("http.response.status_code", Value::Int(i64::from(status)));
                    if status >= 500 {
                        r.set("error.type", Value::Text(status.to_string().into()));
                        r.error = true;
                    }
                }
                Err(kind) => {
                    r.set("error.type", Value::Static(kind));
                    r.error = true;
                }
            }
        }
        self.0.cancelled_if_dropped = false;
    }
}

/// The `idempotency.route` and `idempotency.record_id` of a child span.
pub(crate) fn record_attributes(route: &str, record_id: &str) -> Vec<(&'static str, Value)> {
    vec![
        (ROUTE, Value::Text(route.into())),
        (RECORD_ID, Value::Text(record_id.into())),
    ]
}

/// `http.request.method`, and the method as it came when the conventions do not know it.
fn method_attributes(r: &mut SpanRecord, method: &http::Method, name: &'static str) {
    r.set("http.request.method", Value::Static(name));
    if name == OTHER {
        r.set(
            "http.request.method_original",
            Value::Text(cut(method.as_str())),
        );
    }
}

fn protocol_version(v: Version) -> &'static str {
    match v {
        Version::HTTP_09 => "0.9",
        Version::HTTP_10 => "1.0",
        Version::HTTP_2 => "2",
        Version::HTTP_3 => "3",
        _ => "1.1",
    }
}

/// The host the client asked for (`Host`, or the URI's authority over
/// HTTP/2), and its port when it names one.
fn server_address<B>(req: &Request<B>) -> Option<(&str, Option<u16>)> {
    if let Some(authority) = req.uri().authority() {
        return Some((authority.host(), authority.port_u16()));
    }
    let host = req.headers().get(http::header::HOST)?.to_str().ok()?;
    let (name, port) = match host.rsplit_once(':') {
        // Not an IPv6 literal's colon.
        Some((name, port)) if !port.contains(']') => (name, Some(port.parse().ok()?)),
        _ => (host, None),
    };
    (!name.is_empty()).then_some((name, port))
}

/// The longest value a client's request puts in an attribute (a path, a
/// host, a method): the export queue holds `QUEUE` spans, and a client
/// chooses their size (a `traceparent` marked sampled is followed).
const MAX_ATTRIBUTE: usize = 1024;

/// `value` cut to `MAX_ATTRIBUTE` bytes (at a character boundary).
fn cut(value: &str) -> Box<str> {
    let mut end = value.len().min(MAX_ATTRIBUTE);
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    value[..end].into()
}

/// The method as the HTTP conventions name it: a method they do not know
/// (RFC 9110's and PATCH) is `_OTHER`, so that clients cannot make span
/// names without end; the span is then named `HTTP`, and the method is in
/// `http.request.method_original`.
fn method_name(method: &http::Method) -> &'static str {
    match *method {
        http::Method::GET => "GET",
        http::Method::HEAD => "HEAD",
        http::Method::POST => "POST",
        http::Method::PUT => "PUT",
        http::Method::DELETE => "DELETE",
        http::Method::CONNECT => "CONNECT",
        http::Method::OPTIONS => "OPTIONS",
        http::Method::TRACE => "TRACE",
        http::Method::PATCH => "PATCH",
        _ => OTHER,
    }
}

/// OTLP/HTTP takes spans at `/v1/traces` under the endpoint (as
/// `OTEL_EXPORTER_OTLP_ENDPOINT` means it); an endpoint that already ends so is kept.
pub(crate) fn http_traces_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    if base.ends_with("/v1/traces") {
        base.to_string()
    } else {
        format!("{base}/v1/traces")
    }
}

/// A label for an upstream failure, for `error.type`.
pub(crate) fn upstream_error_type(e: &crate::upstream::UpstreamError) -> &'static str {
    use crate::upstream::UpstreamError;
    match e {
        UpstreamError::Timeout(_) => "timeout",
        UpstreamError::Connect(_) => "connect",
        _ => "upstream_error",
    }
}

#[cfg(test)]
mod tests;
