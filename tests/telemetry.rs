//! OpenTelemetry tracing end to end, with real peers on both sides: a client
//! instrumented with the OpenTelemetry Python SDK (tests/peers/otel_client.py)
//! whose W3C context the proxy continues, and a real OTLP receiver
//! (tests/peers/otlp_receiver.py: opentelemetry-proto's TraceService on grpcio,
//! or OTLP/HTTP protobuf) that the proxy's exporter sends its spans to. The
//! upstream records the `traceparent` it was sent.
//!
//! What is checked (the specification of the `[telemetry]` feature):
//! - one SERVER span per request, `{method} {http.route}` (`{method}` for
//!   pass-through), the client's span its parent, with the HTTP and
//!   `idempotency.*` attributes and never the raw key;
//! - on protected routes `idempotency.reserve`, a CLIENT span whose context the
//!   upstream receives in `traceparent`, and `idempotency.complete`;
//! - a replay, a 409 and a 422 link to the execution's SERVER span and name its
//!   trace in `idempotency.original_trace_id`;
//! - HTTP/2 and gRPC traced like HTTP/1.1; parent-based sampling; a collector
//!   that is down costs requests nothing (`idemproxy_spans_dropped_total`
//!   counts, memory stays bounded); with tracing off, `traceparent` and
//!   `tracestate` pass through untouched;
//! - the harness itself: the receiver reads what the SDK's own exporters send.
//!
//! Waits are on events with deadlines; a span that must NOT be sent is shown
//! absent by a later request's spans arriving first (the exporter sends spans
//! in the order they end).

mod support;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::relay::{Fault, Relay};
use support::*;

/// A key that must never show in any span.
const SECRET_KEY: &str = "k-otel-secret-4f1c9a";

/// The proxy's own spans under a client span: SERVER, and on protected routes
/// reserve, CLIENT, complete.
const PROTECTED_SPANS: [&str; 3] = ["idempotency.reserve", "POST", "idempotency.complete"];

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A proxy sending its spans to `otlp`.
async fn traced_env(backend: Backend, otlp: &OtlpReceiver, telemetry: &str) -> Env {
    Env::builder(backend)
        .telemetry(&format!("{}{telemetry}", otlp.config()))
        .start()
        .await
}

/// Waits until the SERVER span under `client_span_id` and its children named
/// `children` have all come; returns all spans then, and the SERVER span.
async fn wait_for_request(
    otlp: &OtlpReceiver,
    client_span_id: &str,
    children: &[&str],
) -> (Vec<Span>, Span) {
    let spans = otlp
        .wait_for_spans(
            &format!("the SERVER span under {client_span_id} and its children {children:?}"),
            DEADLINE,
            |all| match all.server_under(client_span_id) {
                Some(server) => {
                    let kids = all.children_of(server);
                    children
                        .iter()
                        .all(|name| kids.iter().any(|k| k.name == *name))
                }
                None => false,
            },
        )
        .await;
    let server = spans.server_under(client_span_id).expect("found").clone();
    (spans, server)
}

/// A sampled POST of `key` whose exchange the test upstream holds
/// (`x-test-hold`) until it is released: its call, running.
fn spawn_held(url: &str, key: &str) -> tokio::task::JoinHandle<OtelCall> {
    let (url, key) = (url.to_string(), key.to_string());
    tokio::spawn(async move {
        otel_call(
            "POST",
            &url,
            Some(&key),
            "a",
            &["x-test-hold: 1"],
            Parent::Sampled,
        )
        .await
    })
}

/// The attributes every SERVER span has.
fn assert_server_attributes(
    s: &Span,
    method: &str,
    path: &str,
    status: i64,
    protocol_version: &str,
) {
    assert_eq!(s.kind, "SERVER", "{s:?}");
    assert_eq!(s.attr_str("http.request.method"), Some(method), "{s:?}");
    assert_eq!(s.attr_str("url.path"), Some(path), "{s:?}");
    assert_eq!(s.attr_str("url.scheme"), Some("http"), "{s:?}");
    assert_eq!(
        s.attr_i64("http.response.status_code"),
        Some(status),
        "{s:?}"
    );
    assert_eq!(
        s.attr_str("network.protocol.version"),
        Some(protocol_version),
        "{s:?}"
    );
    assert!(
        s.attr_str("server.address").is_some_and(|a| !a.is_empty()),
        "server.address: {s:?}"
    );
    assert_eq!(s.attr_str("client.address"), Some("127.0.0.1"), "{s:?}");
}

/// The attributes of a protected route's SERVER span.
fn assert_protected_server_span(
    s: &Span,
    route_pattern: &str,
    path: &str,
    route_name: &str,
    key: &str,
    status: i64,
    protocol_version: &str,
) {
    assert_eq!(s.name, format!("POST {route_pattern}"), "{s:?}");
    assert_server_attributes(s, "POST", path, status, protocol_version);
    assert_eq!(s.attr_str("http.route"), Some(route_pattern), "{s:?}");
    assert_eq!(s.attr_str("idempotency.route"), Some(route_name), "{s:?}");
    let record_id = idemproxy::key::record_id([], key);
    assert_eq!(
        s.attr_str("idempotency.record_id"),
        Some(record_id.as_str()),
        "{s:?}"
    );
    assert!(!s.mentions(key), "the raw key in a span: {s:?}");
}

/// The `traceparent` the upstream was sent with the `n`th request it saw (from 1).
fn upstream_traceparent(upstream: &TestUpstream, n: usize) -> TraceParent {
    let seen = upstream.seen();
    let h = &seen[n - 1].headers;
    let values: Vec<&str> = h
        .get_all("traceparent")
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    assert_eq!(values.len(), 1, "one traceparent upstream: {h:?}");
    TraceParent::parse(values[0])
}

// ---------------------------------------------------------------------------
// The harness: the receiver reads what an OpenTelemetry SDK exports.

async fn receiver_reads_sdk_export(otlp: OtlpReceiver) {
    let sent = run_peer(
        "otel_export.py",
        &[&otlp.endpoint(), "--protocol", otlp.protocol],
    )
    .await;
    let trace_id = sent["trace_id"].as_str().unwrap().to_string();
    let spans = otlp
        .wait_for_spans("the SDK's two spans", DEADLINE, |all| {
            all.in_trace(&trace_id).len() == 2
        })
        .await;
    let server = spans
        .by_id(sent["server_span_id"].as_str().unwrap())
        .unwrap();
    let client = spans
        .by_id(sent["client_span_id"].as_str().unwrap())
        .unwrap();
    assert!(is_hex(&server.trace_id, 32) && is_hex(&server.span_id, 16));
    assert_eq!(server.trace_id, trace_id);
    assert!(server.is_root(), "{server:?}");
    assert_eq!(
        (server.name.as_str(), server.kind.as_str()),
        ("POST /v1/payments", "SERVER")
    );
    assert_eq!(
        (client.name.as_str(), client.kind.as_str()),
        ("POST", "CLIENT")
    );
    assert!(client.is_child_of(server), "{client:?}");
    assert_eq!(spans.children_of(server).len(), 1);
    // Attributes of each type, flat.
    assert_eq!(server.attr_str("http.request.method"), Some("POST"));
    assert_eq!(server.attr_i64("http.response.status_code"), Some(201));
    assert_eq!(server.attr("idempotency.replayed"), Some(&false.into()));
    assert_eq!(
        server.attr("sample.ratio").and_then(|v| v.as_f64()),
        Some(0.5)
    );
    assert_eq!(
        server.attr("list.of.strings"),
        Some(&serde_json::json!(["a", "b"]))
    );
    // The link, the status, the resource.
    assert_eq!(server.links.len(), 1, "{server:?}");
    assert_eq!(
        server.links[0].trace_id,
        sent["link_trace_id"].as_str().unwrap()
    );
    assert_eq!(
        server.links[0].span_id,
        sent["link_span_id"].as_str().unwrap()
    );
    assert_eq!(server.links[0].attributes["link.kind"], "original");
    assert_eq!(server.status.code, "ERROR");
    assert_eq!(server.status.message, "upstream said no");
    assert_eq!(
        server.resource_str("service.name"),
        Some("otel-export-check")
    );
    assert_eq!(server.resource_str("deployment.environment"), Some("test"));
    assert_eq!(server.scope, "idemproxy-tests");
    assert!(
        server.start_time_unix_nano > 0 && server.end_time_unix_nano >= server.start_time_unix_nano
    );
    assert!(client.start_time_unix_nano >= server.start_time_unix_nano);
    assert!(!server.mentions("k-never-sent") && server.mentions("upstream said no"));
    let path = if otlp.protocol == "grpc" {
        "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
    } else {
        "/v1/traces"
    };
    assert_eq!(server.export_path, path);
    assert!(otlp.noise().is_empty(), "{:?}", otlp.noise());
    // The timeline script reads the same lines.
    let (drawn, svg) = trace_view("sdk-export", &spans).await;
    assert_eq!(drawn["spans"], 2, "{drawn}");
    assert_eq!(drawn["traces"], 1, "{drawn}");
    assert_eq!(
        drawn["links_elsewhere"], 1,
        "the link to a span not captured: {drawn}"
    );
    assert!(
        svg.starts_with("<svg") && svg.contains("POST /v1/payments"),
        "{svg}"
    );
}

#[tokio::test]
async fn the_receiver_reads_what_an_otel_sdk_exports() {
    receiver_reads_sdk_export(OtlpReceiver::start().await).await;
}

#[tokio::test]
async fn the_http_receiver_reads_what_an_otel_sdk_exports() {
    receiver_reads_sdk_export(OtlpReceiver::start_http().await).await;
}

#[test]
fn traceparent_parses() {
    let tp = TraceParent::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
    assert_eq!(tp.trace_id, "0af7651916cd43dd8448eb211c80319c");
    assert_eq!(tp.parent_id, "b7ad6b7169203331");
    assert!(tp.sampled());
    assert!(
        !TraceParent::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00").sampled()
    );
}

// ---------------------------------------------------------------------------
// With tracing off (no [telemetry]), the client's context is not the proxy's business.

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
/// Two vendors, an odd but legal space inside: byte for byte, not re-serialized.
const TRACESTATE: &str = "rojo=00f067aa0ba902b7 ,congo=t61rcWkgMzE";

fn trace_headers(h: &HeaderMap) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let all = |name: &str| -> Vec<Vec<u8>> {
        h.get_all(name)
            .iter()
            .map(|v| v.as_bytes().to_vec())
            .collect()
    };
    (all("traceparent"), all("tracestate"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tracing_off_traceparent_and_tracestate_pass_through_untouched() {
    let env = Env::builder(Backend::Redis).start().await;
    let want = (
        vec![TRACEPARENT.as_bytes().to_vec()],
        vec![TRACESTATE.as_bytes().to_vec(), b"second=line".to_vec()],
    );
    // HTTP/1.1, protected then pass-through.
    let r = Call::post(&env.url("/v1/payments"))
        .key(SECRET_KEY)
        .header("traceparent", TRACEPARENT)
        .header("tracestate", TRACESTATE)
        .header("tracestate", "second=line")
        .body("amount=1")
        .await;
    assert_eq!(r.status, 201);
    let r = Call::new("GET", &env.url("/things?x=1"))
        .header("traceparent", TRACEPARENT)
        .header("tracestate", TRACESTATE)
        .header("tracestate", "second=line")
        .send()
        .await;
    assert_eq!(r.status, 201);
    // HTTP/2 (curl, prior knowledge), protected.
    let tp = format!("traceparent: {TRACEPARENT}");
    let ts = format!("tracestate: {TRACESTATE}");
    let args = [
        "--http2-prior-knowledge",
        "-H",
        "Idempotency-Key: k-off-h2",
        "-H",
        &tp,
        "-H",
        &ts,
        "-H",
        "tracestate: second=line",
        "--data-binary",
        "amount=2",
    ];
    let a = curl(&[&args[..], &[&env.url("/v1/payments")]].concat()).await;
    assert_eq!((a.version.as_str(), a.status), ("HTTP/2", 201), "{a:?}");
    assert_eq!(env.upstream.hits(), 3);
    for seen in env.upstream.seen() {
        assert_eq!(
            trace_headers(&seen.headers),
            want,
            "{} {}",
            seen.method,
            seen.target
        );
    }
    // A real instrumented client: its traceparent arrives as it sent it.
    let call = otel_call(
        "POST",
        &env.url("/v1/payments"),
        Some("k-off-sdk"),
        "amount=3",
        &[],
        Parent::Sampled,
    )
    .await;
    assert_eq!(call.status, 201, "{call:?}");
    let sent = call.traceparent.expect("the SDK sent a traceparent");
    let seen = env.upstream.seen();
    let h = &seen.last().unwrap().headers;
    assert_eq!(trace_headers(h).0, vec![sent.into_bytes()]);
    assert!(h.get("tracestate").is_none(), "{h:?}");
}

// ---------------------------------------------------------------------------
// A protected request: the client's trace goes on through the proxy to the upstream.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protected_request_continues_the_clients_trace_to_the_upstream() {
    let otlp = OtlpReceiver::start().await;
    let env = traced_env(Backend::Redis, &otlp, "").await;
    let call = otel_call(
        "POST",
        &env.url("/v1/payments?ref=q-visible-only-in-the-query"),
        Some(SECRET_KEY),
        "amount=10",
        &[],
        Parent::Sampled,
    )
    .await;
    assert_eq!(call.status, 201, "{call:?}");
    assert!(call.sampled);
    let (spans, server) = wait_for_request(&otlp, &call.span_id, &PROTECTED_SPANS).await;

    // (a) The SERVER span: the client's span its parent, in the client's trace.
    assert_eq!(server.trace_id, call.trace_id, "{server:?}");
    assert_eq!(server.parent_span_id, call.span_id);
    assert_protected_server_span(
        &server,
        "/v1/payments",
        "/v1/payments",
        "payments",
        SECRET_KEY,
        201,
        "1.1",
    );
    assert_eq!(server.attr_str("idempotency.outcome"), Some("forwarded"));
    assert!(server.attr("error.type").is_none(), "{server:?}");
    assert!(
        server.links.is_empty(),
        "an execution links nowhere: {server:?}"
    );
    assert_eq!(server.resource_str("service.name"), Some("idemproxy"));

    // (b) Its children: reserve, the CLIENT span to the upstream, complete.
    let reserve = spans.child(&server, "idempotency.reserve");
    let complete = spans.child(&server, "idempotency.complete");
    let client = spans.child(&server, "POST");
    assert_eq!(client.kind, "CLIENT", "{client:?}");
    assert_eq!(
        client.attr_str("url.full"),
        Some(format!("{}/v1/payments", env.upstream.url()).as_str()),
        "url.full, without the query: {client:?}"
    );
    assert_eq!(
        client.attr_str("server.address"),
        Some("127.0.0.1"),
        "{client:?}"
    );
    // The key is reserved before the upstream is called, completed after.
    assert!(reserve.start_time_unix_nano <= client.start_time_unix_nano);
    assert!(complete.start_time_unix_nano >= reserve.start_time_unix_nano);
    assert!(spans.named("idempotency.wait").is_empty(), "nothing waited");
    // The upstream was sent the CLIENT span's context.
    assert_eq!(env.upstream.hits(), 1);
    let tp = upstream_traceparent(&env.upstream, 1);
    assert_eq!(tp.trace_id, call.trace_id);
    assert_eq!(
        tp.parent_id, client.span_id,
        "the upstream's parent is the CLIENT span"
    );
    assert!(tp.sampled());
    // The key is in no span of the trace; the query is in no URL attribute.
    let trace = spans.in_trace(&call.trace_id);
    assert_eq!(
        trace.len(),
        4,
        "SERVER and its three children:\n{}",
        spans.outline()
    );
    for s in &trace {
        assert!(!s.mentions(SECRET_KEY), "the raw key in {s:?}");
        assert!(
            s.attr_str("url.full").is_none_or(|u| !u.contains('?')),
            "{s:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_through_request_has_a_server_and_a_client_span_only() {
    let otlp = OtlpReceiver::start().await;
    let env = traced_env(Backend::Memory, &otlp, "").await;
    let call = otel_call("GET", &env.url("/things/7"), None, "", &[], Parent::Sampled).await;
    assert_eq!(call.status, 201, "{call:?}");
    let (spans, server) = wait_for_request(&otlp, &call.span_id, &["GET"]).await;
    assert_eq!(server.name, "GET", "pass-through: the method alone");
    assert_server_attributes(&server, "GET", "/things/7", 201, "1.1");
    assert!(server.attr("http.route").is_none(), "{server:?}");
    // No route, no key: nothing to name them by.
    assert!(
        server.attr("idempotency.route").is_none()
            && server.attr("idempotency.record_id").is_none(),
        "{server:?}"
    );
    let kids = spans.children_of(&server);
    assert_eq!(kids.len(), 1, "only the CLIENT span:\n{}", spans.outline());
    assert_eq!(kids[0].kind, "CLIENT");
    assert_eq!(
        kids[0].attr_str("url.full"),
        Some(format!("{}/things/7", env.upstream.url()).as_str())
    );
    let tp = upstream_traceparent(&env.upstream, 1);
    assert_eq!(
        (tp.trace_id.as_str(), tp.parent_id.as_str()),
        (call.trace_id.as_str(), kids[0].span_id.as_str())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_cannot_be_reached_sets_error_type() {
    let otlp = OtlpReceiver::start().await;
    let closed = format!("http://127.0.0.1:{}", free_port());
    let env = Env::builder(Backend::Memory)
        .telemetry(&otlp.config())
        .upstream_url(&closed)
        .start()
        .await;
    let call = otel_call("GET", &env.url("/things"), None, "", &[], Parent::Sampled).await;
    assert!(call.status >= 500, "{call:?}");
    let server = otlp.wait_for_server_span(&call.span_id).await;
    assert_eq!(
        server.attr_i64("http.response.status_code"),
        Some(call.status as i64)
    );
    assert!(
        server.attr_str("error.type").is_some_and(|e| !e.is_empty()),
        "error.type on an error: {server:?}"
    );
}

// ---------------------------------------------------------------------------
// Replays, 409 and 422 link to the execution.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_a_409_and_a_422_link_to_the_executions_server_span() {
    let otlp = OtlpReceiver::start().await;
    let env = traced_env(Backend::Redis, &otlp, "").await;
    let url = env.url("/v1/orders/42");
    let key = "k-otel-linked";
    // The execution, held at the upstream.
    let first = spawn_held(&url, key);
    env.upstream.wait_hits(1).await;
    let busy = otel_call("POST", &url, Some(key), "a", &[], Parent::Sampled).await;
    assert_eq!(busy.status, 409, "{busy:?}");
    env.upstream.release(1);
    let first = first.await.expect("join");
    assert_eq!(first.status, 201, "{first:?}");
    let replay = otel_call("POST", &url, Some(key), "a", &[], Parent::Sampled).await;
    assert!(replay.status == 201 && replay.is_replay(), "{replay:?}");
    let other = otel_call("POST", &url, Some(key), "b", &[], Parent::Sampled).await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(env.upstream.hits(), 1);

    let (_, original) = wait_for_request(&otlp, &first.span_id, &PROTECTED_SPANS).await;
    assert_protected_server_span(
        &original,
        "/v1/orders/{id}",
        "/v1/orders/42",
        "orders",
        key,
        201,
        "1.1",
    );
    assert_eq!(original.attr_str("idempotency.outcome"), Some("forwarded"));
    for (what, call, status) in [
        ("409", &busy, 409),
        ("replay", &replay, 201),
        ("422", &other, 422),
    ] {
        let (spans, s) = wait_for_request(&otlp, &call.span_id, &[]).await;
        assert_eq!(
            s.trace_id, call.trace_id,
            "{what}: in its own client's trace"
        );
        assert_protected_server_span(
            &s,
            "/v1/orders/{id}",
            "/v1/orders/42",
            "orders",
            key,
            status,
            "1.1",
        );
        assert!(
            s.links
                .iter()
                .any(|l| l.trace_id == original.trace_id && l.span_id == original.span_id),
            "{what}: a link to the execution's SERVER span {}/{}: {s:?}",
            original.trace_id,
            original.span_id
        );
        assert_eq!(
            s.attr_str("idempotency.original_trace_id"),
            Some(original.trace_id.as_str()),
            "{what}: {s:?}"
        );
        assert!(is_hex(
            s.attr_str("idempotency.original_trace_id").unwrap(),
            32
        ));
        assert_ne!(
            s.attr_str("idempotency.outcome"),
            Some("forwarded"),
            "{what}: {s:?}"
        );
        assert!(
            spans.children_of(&s).iter().all(|c| c.kind != "CLIENT"),
            "{what}: no call upstream:\n{}",
            spans.outline()
        );
    }
    // The timeline for the docs: three arrows to the execution.
    let spans = otlp.spans();
    let (drawn, _) = trace_view("replay-409-422-linked-to-the-original", &spans).await;
    assert!(drawn["links"].as_u64() >= Some(3), "{drawn}");
}

/// With `concurrent = "wait"`, a duplicate waits for the execution: here past
/// its `wait_timeout`, so that it surely waited while the first is still held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_that_waits_has_an_idempotency_wait_span() {
    let otlp = OtlpReceiver::start().await;
    let routes = format!(
        "{ROUTES}\n[[routes]]\nname = \"waiting\"\npath = \"/v1/waiting\"\nconcurrent = \"wait\"\nwait_timeout = \"300ms\"\n"
    );
    let env = Env::builder(Backend::Redis)
        .routes(&routes)
        .telemetry(&otlp.config())
        .start()
        .await;
    let url = env.url("/v1/waiting");
    let first = spawn_held(&url, "k-wait");
    env.upstream.wait_hits(1).await;
    let waited = otel_call("POST", &url, Some("k-wait"), "a", &[], Parent::Sampled).await;
    assert_eq!(waited.status, 409, "past wait_timeout: {waited:?}");
    env.upstream.release(1);
    let first = first.await.expect("join");
    assert_eq!(first.status, 201);
    let (_, original) = wait_for_request(&otlp, &first.span_id, &PROTECTED_SPANS).await;
    let (spans, s) = wait_for_request(&otlp, &waited.span_id, &["idempotency.wait"]).await;
    assert_protected_server_span(
        &s,
        "/v1/waiting",
        "/v1/waiting",
        "waiting",
        "k-wait",
        409,
        "1.1",
    );
    let wait = spans.child(&s, "idempotency.wait");
    assert!(
        wait.duration() >= Duration::from_millis(250),
        "it waited out wait_timeout: {wait:?}"
    );
    assert!(
        s.links
            .iter()
            .any(|l| l.trace_id == original.trace_id && l.span_id == original.span_id),
        "{s:?}"
    );
    assert_eq!(
        s.attr_str("idempotency.original_trace_id"),
        Some(original.trace_id.as_str())
    );
    assert!(spans
        .children_of(&original)
        .iter()
        .all(|c| c.name != "idempotency.wait"));
}

// ---------------------------------------------------------------------------
// HTTP/2 and gRPC are traced as HTTP/1.1 is.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http2_requests_are_traced_like_http1() {
    let otlp = OtlpReceiver::start().await;
    let env = traced_env(Backend::Memory, &otlp, "").await;
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let parent = &uuid::Uuid::new_v4().simple().to_string()[..16];
    let tp = format!("traceparent: 00-{trace_id}-{parent}-01");
    let protected = [
        "--http2-prior-knowledge",
        "-H",
        &tp,
        "-H",
        "Idempotency-Key: k-otel-h2",
        "--data-binary",
        "amount=5",
    ];
    let a = curl(&[&protected[..], &[&env.url("/v1/payments")]].concat()).await;
    assert_eq!((a.version.as_str(), a.status), ("HTTP/2", 201), "{a:?}");
    let (spans, server) = wait_for_request(&otlp, parent, &PROTECTED_SPANS).await;
    assert_eq!(server.trace_id, trace_id);
    assert_protected_server_span(
        &server,
        "/v1/payments",
        "/v1/payments",
        "payments",
        "k-otel-h2",
        201,
        "2",
    );
    assert_eq!(server.attr_str("idempotency.outcome"), Some("forwarded"));
    let client = spans.child(&server, "POST");
    let up = upstream_traceparent(&env.upstream, 1);
    assert_eq!(
        (up.trace_id.as_str(), up.parent_id.as_str()),
        (trace_id.as_str(), client.span_id.as_str())
    );

    let parent2 = &uuid::Uuid::new_v4().simple().to_string()[..16];
    let tp2 = format!("traceparent: 00-{trace_id}-{parent2}-01");
    let a = curl(&["--http2-prior-knowledge", "-H", &tp2, &env.url("/things")]).await;
    assert_eq!((a.version.as_str(), a.status), ("HTTP/2", 201), "{a:?}");
    let (spans, server) = wait_for_request(&otlp, parent2, &["GET"]).await;
    assert_eq!(server.name, "GET");
    assert_server_attributes(&server, "GET", "/things", 201, "2");
    assert_eq!(spans.children_of(&server).len(), 1);
}

#[derive(Clone, PartialEq, prost::Message)]
struct Note {
    #[prost(string, tag = "1")]
    text: String,
}

const CHARGE: &str = "/pay.Payments/Charge";

/// A gRPC upstream over h2c that answers every call with `Note { text: "ok" }`
/// and status 0 in trailers, and keeps each call's headers.
async fn grpc_upstream() -> (String, Arc<Mutex<Vec<HeaderMap>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let log = log.clone();
            let svc = service_fn(move |req: Request<Incoming>| {
                log.lock().unwrap().push(req.headers().clone());
                async move {
                    let _ = req.into_body().collect().await;
                    let msg = prost::Message::encode_to_vec(&Note { text: "ok".into() });
                    let mut framed = vec![0u8];
                    framed.extend_from_slice(&(msg.len() as u32).to_be_bytes());
                    framed.extend_from_slice(&msg);
                    let mut trailers = HeaderMap::new();
                    trailers.insert("grpc-status", "0".parse().unwrap());
                    let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = vec![
                        Ok(Frame::data(Bytes::from(framed))),
                        Ok(Frame::trailers(trailers)),
                    ];
                    let body = StreamBody::new(tokio_stream::iter(frames));
                    let resp = Response::builder()
                        .header("content-type", "application/grpc")
                        .body(body)
                        .unwrap();
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            tokio::spawn(async move {
                let http = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
                let _ = http.serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    });
    (url, seen)
}

async fn grpc_charge(
    grpc: &mut tonic::client::Grpc<tonic::transport::Channel>,
    metadata: &[(&'static str, &str)],
) -> Result<tonic::Response<Note>, tonic::Status> {
    let mut req = tonic::Request::new(Note {
        text: "charge 5".into(),
    });
    for (name, value) in metadata {
        req.metadata_mut().insert(*name, value.parse().unwrap());
    }
    grpc.ready().await.unwrap();
    let codec = tonic::codec::ProstCodec::<Note, Note>::default();
    grpc.unary(req, http::uri::PathAndQuery::from_static(CHARGE), codec)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_are_traced_like_http1() {
    let otlp = OtlpReceiver::start().await;
    let (upstream, seen) = grpc_upstream().await;
    let routes = format!("[[routes]]\nname = \"charge\"\npath = \"{CHARGE}\"\n");
    let config = ConfigBuilder::new(&upstream)
        .server("upstream_protocol = \"h2c\"")
        .telemetry(&otlp.config())
        .routes(&routes)
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let channel = tonic::transport::Channel::from_shared(proxy.url(""))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let parent = uuid::Uuid::new_v4().simple().to_string()[..16].to_string();
    let tp = format!("00-{trace_id}-{parent}-01");
    let first = grpc_charge(
        &mut grpc,
        &[("idempotency-key", "k-otel-grpc"), ("traceparent", &tp)],
    )
    .await
    .expect("the call");
    assert_eq!(first.get_ref().text, "ok");
    let (spans, server) = wait_for_request(&otlp, &parent, &PROTECTED_SPANS).await;
    assert_eq!(server.trace_id, trace_id);
    assert_protected_server_span(&server, CHARGE, CHARGE, "charge", "k-otel-grpc", 200, "2");
    assert_eq!(server.attr_str("idempotency.outcome"), Some("forwarded"));
    let client = spans.child(&server, "POST");
    assert_eq!(client.kind, "CLIENT");
    assert_eq!(
        client.attr_str("url.full"),
        Some(format!("{upstream}{CHARGE}").as_str())
    );
    let up = {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        TraceParent::parse(seen[0]["traceparent"].to_str().unwrap())
    };
    assert_eq!(
        (up.trace_id.as_str(), up.parent_id.as_str()),
        (trace_id.as_str(), client.span_id.as_str())
    );

    // Its retry is replayed, and links to it.
    let trace2 = uuid::Uuid::new_v4().simple().to_string();
    let parent2 = uuid::Uuid::new_v4().simple().to_string()[..16].to_string();
    let tp2 = format!("00-{trace2}-{parent2}-01");
    let again = grpc_charge(
        &mut grpc,
        &[("idempotency-key", "k-otel-grpc"), ("traceparent", &tp2)],
    )
    .await
    .expect("the replay");
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    let replay = otlp.wait_for_server_span(&parent2).await;
    assert_eq!(replay.trace_id, trace2);
    assert!(
        replay
            .links
            .iter()
            .any(|l| l.trace_id == trace_id && l.span_id == server.span_id),
        "{replay:?}"
    );
    assert_eq!(
        replay.attr_str("idempotency.original_trace_id"),
        Some(trace_id.as_str())
    );
    assert_eq!(seen.lock().unwrap().len(), 1);
}

// ---------------------------------------------------------------------------
// Sampling: parent-based, `sample_ratio` for roots.

/// Every span received belongs to `trace_id`.
fn assert_only_trace(spans: &[Span], trace_id: &str) {
    let traces: HashSet<&str> = spans.iter().map(|s| s.trace_id.as_str()).collect();
    assert_eq!(
        traces,
        HashSet::from([trace_id]),
        "spans of another trace were sent:\n{}",
        spans.outline()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_ratio_zero_roots_send_nothing_and_a_sampled_parent_is_followed() {
    let otlp = OtlpReceiver::start().await;
    let env = traced_env(Backend::Memory, &otlp, "sample_ratio = 0.0\n").await;
    let root = otel_call(
        "POST",
        &env.url("/v1/payments"),
        Some("k-root"),
        "a",
        &[],
        Parent::None,
    )
    .await;
    assert_eq!(root.status, 201, "{root:?}");
    let pass = otel_call("GET", &env.url("/things"), None, "", &[], Parent::None).await;
    assert_eq!(pass.status, 201, "{pass:?}");
    // A sampled parent is followed even at 0; its spans coming shows the roots' never will.
    let sampled = otel_call(
        "POST",
        &env.url("/v1/payments"),
        Some("k-parent"),
        "a",
        &[],
        Parent::Sampled,
    )
    .await;
    assert_eq!(sampled.status, 201, "{sampled:?}");
    let (spans, server) = wait_for_request(&otlp, &sampled.span_id, &PROTECTED_SPANS).await;
    assert_eq!(server.trace_id, sampled.trace_id);
    assert_only_trace(&spans, &sampled.trace_id);
    assert_eq!(spans.len(), 4, "{}", spans.outline());
    // The upstream still gets a context for the unsampled roots, marked unsampled
    // when there is one.
    for seen in &env.upstream.seen()[..2] {
        if let Some(v) = seen.headers.get("traceparent") {
            assert!(!TraceParent::parse(v.to_str().unwrap()).sampled(), "{v:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsampled_parent_is_followed_and_nothing_is_sent() {
    let otlp = OtlpReceiver::start().await;
    let env = traced_env(Backend::Memory, &otlp, "sample_ratio = 1.0\n").await;
    let unsampled = otel_call(
        "POST",
        &env.url("/v1/payments"),
        Some("k-unsampled"),
        "a",
        &[],
        Parent::Unsampled,
    )
    .await;
    assert_eq!(unsampled.status, 201, "{unsampled:?}");
    assert!(!unsampled.sampled);
    // The upstream is sent the client's trace, still unsampled.
    let up = upstream_traceparent(&env.upstream, 1);
    assert_eq!(up.trace_id, unsampled.trace_id);
    assert!(!up.sampled(), "{up:?}");
    // A root at ratio 1 is sampled: its spans coming shows the unsampled ones never will.
    let root = otel_call(
        "POST",
        &env.url("/v1/payments"),
        Some("k-root-1"),
        "a",
        &[],
        Parent::None,
    )
    .await;
    assert_eq!(root.status, 201);
    let spans = otlp
        .wait_for_spans("the root request's four spans", DEADLINE, |all| {
            all.iter()
                .find(|s| s.kind == "SERVER" && s.is_root())
                .is_some_and(|root| all.children_of(root).len() == 3)
        })
        .await;
    let server = spans.iter().find(|s| s.kind == "SERVER").unwrap();
    assert!(server.is_root(), "{server:?}");
    assert_only_trace(&spans, &server.trace_id);
    assert_ne!(server.trace_id, unsampled.trace_id);
    let up = upstream_traceparent(&env.upstream, 2);
    assert_eq!(up.trace_id, server.trace_id);
    assert!(up.sampled());
}

/// `client_context = "link"`: a client that asks for sampling does not get
/// it (the ratio decides); a sampled request is a trace of the proxy's own,
/// its SERVER span linked to the client's span, and the upstream gets the
/// proxy's trace without the client's `tracestate`. `"ignore"`: the same,
/// without the link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_context_link_and_ignore_keep_sampling_with_the_operator() {
    for (mode, ratio) in [("link", "0.0"), ("link", "1.0"), ("ignore", "1.0")] {
        let otlp = OtlpReceiver::start().await;
        let config = format!("sample_ratio = {ratio}\nclient_context = \"{mode}\"\n");
        let env = traced_env(Backend::Memory, &otlp, &config).await;
        let call = otel_call(
            "POST",
            &env.url("/v1/payments"),
            Some("k-link"),
            "a",
            &["tracestate: vendor=opaque"],
            Parent::Sampled,
        )
        .await;
        assert_eq!(call.status, 201, "{mode}: {call:?}");
        assert!(call.sampled);
        let up = upstream_traceparent(&env.upstream, 1);
        assert_ne!(
            up.trace_id, call.trace_id,
            "{mode}: a trace of the proxy's own"
        );
        let seen = &env.upstream.seen()[0];
        assert!(!seen.headers.contains_key("tracestate"), "{mode}: {seen:?}");
        if ratio == "0.0" {
            assert!(!up.sampled(), "{mode}: the client cannot turn tracing on");
            // A request the ratio samples shows that nothing else will come.
            let env_on = traced_env(Backend::Memory, &otlp, "sample_ratio = 1.0\n").await;
            let root = otel_call("GET", &env_on.url("/x"), None, "", &[], Parent::None).await;
            let spans = otlp
                .wait_for_spans("the other proxy's spans", DEADLINE, |all| {
                    all.iter().any(|s| s.kind == "SERVER")
                })
                .await;
            assert!(
                spans
                    .iter()
                    .all(|s| s.trace_id != call.trace_id && s.trace_id != up.trace_id),
                "{mode}: {}",
                spans.outline()
            );
            assert_eq!(root.status, 201);
            continue;
        }
        assert!(up.sampled());
        let (spans, server) = wait_for_request_in(&otlp, &up.trace_id, &PROTECTED_SPANS).await;
        assert_only_trace(&spans, &up.trace_id);
        assert!(server.is_root(), "{mode}: {server:?}");
        assert_eq!(server.trace_state, "", "{mode}");
        match mode {
            "link" => {
                assert_eq!(server.links.len(), 1, "{mode}: {server:?}");
                assert_eq!(server.links[0].trace_id, call.trace_id);
                assert_eq!(server.links[0].span_id, call.span_id);
                assert_eq!(server.links[0].trace_state, "vendor=opaque");
            }
            _ => assert!(server.links.is_empty(), "{mode}: {server:?}"),
        }
    }
}

/// The spans of the request whose SERVER span is in `trace_id`: `names`, all there.
async fn wait_for_request_in(
    otlp: &OtlpReceiver,
    trace_id: &str,
    names: &[&str],
) -> (Vec<Span>, Span) {
    let spans = otlp
        .wait_for_spans("the request's spans", DEADLINE, |all| {
            let mine: Vec<&Span> = all.iter().filter(|s| s.trace_id == trace_id).collect();
            names
                .iter()
                .all(|n| mine.iter().any(|s| s.name.starts_with(n)))
        })
        .await;
    let mine: Vec<Span> = spans
        .into_iter()
        .filter(|s| s.trace_id == trace_id)
        .collect();
    let server = mine.iter().find(|s| s.kind == "SERVER").unwrap().clone();
    (mine, server)
}

// ---------------------------------------------------------------------------
// Configuration: the file, then the OTEL_* environment.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_chooses_otlp_over_http_protobuf() {
    let otlp = OtlpReceiver::start_http().await;
    let env = traced_env(Backend::Memory, &otlp, "service_name = \"payments-edge\"\n").await;
    let call = otel_call(
        "POST",
        &env.url("/v1/payments"),
        Some("k-http"),
        "a",
        &[],
        Parent::Sampled,
    )
    .await;
    assert_eq!(call.status, 201);
    let (_, server) = wait_for_request(&otlp, &call.span_id, &PROTECTED_SPANS).await;
    assert_eq!(server.resource_str("service.name"), Some("payments-edge"));
    assert!(otlp.noise().is_empty(), "{:?}", otlp.noise());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otel_environment_variables_fill_in_what_the_file_leaves_out() {
    let otlp = OtlpReceiver::start_http().await;
    let env = Env::builder(Backend::Memory)
        .telemetry("")
        .proxy_env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp.endpoint())
        .proxy_env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        .proxy_env("OTEL_SERVICE_NAME", "from-env")
        .proxy_env("OTEL_TRACES_SAMPLER_ARG", "0")
        .proxy_env(
            "OTEL_RESOURCE_ATTRIBUTES",
            "deployment.environment=otel-test,team=payments",
        )
        .proxy_env("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=k%3D1,x-tenant=t")
        .proxy_env("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-tenant=shop")
        // The binary: the OTEL_* variables are the process's environment.
        .binary()
        .start()
        .await;
    let root = otel_call(
        "POST",
        &env.url("/v1/payments"),
        Some("k-env"),
        "a",
        &[],
        Parent::None,
    )
    .await;
    assert_eq!(root.status, 201);
    // The environment's ratio, 0: the root sent nothing; a sampled parent is followed.
    let sampled = otel_call(
        "POST",
        &env.url("/v1/payments"),
        Some("k-env-2"),
        "a",
        &[],
        Parent::Sampled,
    )
    .await;
    assert_eq!(sampled.status, 201);
    let (spans, server) = wait_for_request(&otlp, &sampled.span_id, &PROTECTED_SPANS).await;
    assert_only_trace(&spans, &sampled.trace_id);
    assert_eq!(server.resource_str("service.name"), Some("from-env"));
    assert_eq!(
        server.resource_str("deployment.environment"),
        Some("otel-test")
    );
    assert_eq!(server.resource_str("team"), Some("payments"));
    // The environment's endpoint is a base: the signal's path is added (OTLP/HTTP).
    assert_eq!(server.export_path, "/v1/traces");
    // The export's headers, percent-decoded; the traces variable wins.
    assert_eq!(server.export_headers["x-api-key"], "k=1");
    assert_eq!(server.export_headers["x-tenant"], "shop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_wins_over_the_environment() {
    let otlp = OtlpReceiver::start().await;
    let nowhere = format!("http://127.0.0.1:{}", free_port());
    let env = Env::builder(Backend::Memory)
        .telemetry(&format!(
            "{}service_name = \"from-file\"\nsample_ratio = 1.0\n",
            otlp.config()
        ))
        .proxy_env("OTEL_EXPORTER_OTLP_ENDPOINT", &nowhere)
        .proxy_env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        .proxy_env("OTEL_SERVICE_NAME", "from-env")
        .proxy_env("OTEL_TRACES_SAMPLER_ARG", "0.0")
        .proxy_env("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=grpc")
        // The binary: the OTEL_* variables are the process's environment.
        .binary()
        .start()
        .await;
    let root = otel_call(
        "POST",
        &env.url("/v1/payments"),
        Some("k-file"),
        "a",
        &[],
        Parent::None,
    )
    .await;
    assert_eq!(root.status, 201);
    let server = otlp
        .wait_for_span(
            "a root SERVER span, sampled at the file's 1.0",
            DEADLINE,
            |s| s.kind == "SERVER",
        )
        .await;
    assert_eq!(server.resource_str("service.name"), Some("from-file"));
    // The export's headers go as gRPC metadata too.
    assert_eq!(server.export_headers["x-api-key"], "grpc");
}

// ---------------------------------------------------------------------------
// A collector that is down costs requests nothing.

/// Runs `REQUESTS` requests, `CONCURRENCY` at a time (one in four protected,
/// each with a key of its own), against a proxy exporting to `endpoint`, which
/// never takes a span: every request succeeds, none is slow, the proxy's
/// memory stays bounded, and the spans it could not send are counted.
async fn requests_go_on_while_spans_cannot_be_sent(endpoint: &str) {
    const REQUESTS: usize = 3000;
    const CONCURRENCY: usize = 16;
    const WARM_UP: usize = 40;
    /// Growth of the proxy's resident memory allowed over the run: the
    /// records of 750 keys and a bounded span queue fit many times over.
    const RSS_GROWTH_KIB: u64 = 16 * 1024;
    let env = Env::builder(Backend::Memory)
        .telemetry(&format!(
            "otlp_endpoint = \"{endpoint}\"\notlp_protocol = \"grpc\"\n"
        ))
        // The binary: the RSS of its process is measured.
        .binary()
        .start()
        .await;
    let pid = env.proxy.pid();
    let call = |i: usize| {
        if i % 4 == 0 {
            Call::post(&env.url("/v1/payments")).key(&format!("k-down-{i}"))
        } else {
            Call::new("GET", &env.url(&format!("/things/{i}")))
        }
    };
    // Warm up (connections, allocator), then take the baseline.
    for i in 0..WARM_UP {
        assert_eq!(call(REQUESTS + i).body("amount=1").await.status, 201);
    }
    let baseline = rss_kib(pid);
    let mut peak = baseline;
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut sent = 0;
    while sent < REQUESTS {
        let batch: Vec<_> = (sent..(sent + CONCURRENCY).min(REQUESTS))
            .map(|i| {
                let call = call(i);
                tokio::spawn(async move {
                    let t = Instant::now();
                    let r = call.body("amount=1").await;
                    (r.status, t.elapsed())
                })
            })
            .collect();
        for task in batch {
            let (status, took) = task.await.expect("join");
            assert_eq!(status, 201, "request {sent} failed: spans cannot be sent");
            slowest = slowest.max(took);
            sent += 1;
        }
        peak = peak.max(rss_kib(pid));
    }
    let elapsed = started.elapsed();
    eprintln!(
        "{REQUESTS} requests in {elapsed:?}, slowest {slowest:?}, RSS {baseline} -> {peak} KiB"
    );
    assert!(
        slowest < Duration::from_secs(2),
        "the slowest request took {slowest:?} while spans cannot be sent"
    );
    assert!(
        peak < baseline + RSS_GROWTH_KIB,
        "RSS grew from {baseline} KiB to {peak} KiB over {REQUESTS} requests"
    );
    assert_eq!(env.upstream.hits(), REQUESTS + WARM_UP);
    let dropped = metric_family_above(env.proxy.admin, "idemproxy_spans_dropped_total", 0.0).await;
    eprintln!("{dropped} spans dropped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_never_slows_or_fails_a_request() {
    // Nothing listens there: each export is refused at once.
    requests_go_on_while_spans_cannot_be_sent(&format!("http://127.0.0.1:{}", free_port())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_never_slows_or_fails_a_request() {
    // The kernel takes the connection; nobody ever reads it or answers:
    // each export hangs until the exporter's own timeout.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = format!("http://{}", silent.local_addr().unwrap());
    requests_go_on_while_spans_cannot_be_sent(&endpoint).await;
    drop(silent);
}

// ---------------------------------------------------------------------------
// Every kind of span against the semantic conventions' published registry:
// tests/peers/semconv_check.py reads the names, stability and enums from the
// `opentelemetry-semantic-conventions` package, not from a list of ours.

/// Runs tests/peers/semconv_check.py with `args`: its exit code and what it printed.
async fn run_semconv_check(args: &[&str]) -> (Option<i32>, String) {
    let python = peer_python();
    let script =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/peers/semconv_check.py");
    let child = tokio::process::Command::new(&python)
        .arg(&script)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {} ({e})", python.display()));
    let out = tokio::time::timeout(DEADLINE, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("semconv_check.py did not finish within {DEADLINE:?}"))
        .expect("semconv_check.py's output");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), printed)
}

/// Checks `spans` (written as the JSON lines the receiver wrote) against the
/// registry: what the checker printed, when it found nothing wrong.
async fn assert_spans_follow_the_conventions(spans: &[Span]) -> String {
    use std::io::Write;
    let mut lines = tempfile::NamedTempFile::new().expect("temp file");
    for s in spans {
        writeln!(lines, "{}", s.raw).expect("write spans");
    }
    lines.flush().expect("flush spans");
    let (code, printed) = run_semconv_check(&[lines.path().to_str().unwrap()]).await;
    assert_ne!(
        code,
        Some(3),
        "opentelemetry-semantic-conventions is missing (tests/run.sh installs it):\n{printed}"
    );
    assert_eq!(
        code,
        Some(0),
        "the spans break the semantic conventions:\n{printed}"
    );
    // Exit 0 and nothing said but the first line: which package, how many spans.
    let said: Vec<&str> = printed.lines().collect();
    assert!(
        said.len() == 1 && said[0].contains(&format!(", {} spans checked", spans.len())),
        "every span checked, none found wrong:\n{printed}"
    );
    printed
}

#[tokio::test]
async fn the_semconv_checker_catches_spans_that_break_the_conventions() {
    let (code, printed) = run_semconv_check(&["--self-test"]).await;
    assert_eq!(code, Some(0), "{printed}");
    assert!(printed.contains(" passed, 0 failed"), "{printed}");
}

/// A protected route for a method outside RFC 9110, and one whose duplicates wait.
const SEMCONV_ROUTES: &str = r#"
[[routes]]
name = "purge"
methods = ["PURGE"]
path = "/v1/purge"

[[routes]]
name = "waiting"
path = "/v1/waiting"
concurrent = "wait"
wait_timeout = "300ms"
"#;

/// One request of the conventions test, and the spans it must have made: a
/// SERVER span under the client's span `parent`, answering `status`, with
/// children of these kinds (and names, where given): one CLIENT span when
/// they name one, else none.
struct Exchange {
    what: &'static str,
    parent: String,
    status: u16,
    children: &'static [(&'static str, Option<&'static str>)],
}

const EXECUTION: &[(&str, Option<&str>)] = &[
    ("INTERNAL", Some("idempotency.reserve")),
    ("CLIENT", None),
    ("INTERNAL", Some("idempotency.complete")),
];
const ANSWERED_FROM_THE_STORE: &[(&str, Option<&str>)] =
    &[("INTERNAL", Some("idempotency.reserve"))];
const WAITED: &[(&str, Option<&str>)] = &[("INTERNAL", Some("idempotency.wait"))];
const FORWARDED: &[(&str, Option<&str>)] = &[("CLIENT", None)];
const RESERVED_AND_FORWARDED: &[(&str, Option<&str>)] =
    &[("INTERNAL", Some("idempotency.reserve")), ("CLIENT", None)];

impl Exchange {
    fn of(
        what: &'static str,
        call: &OtelCall,
        children: &'static [(&'static str, Option<&'static str>)],
    ) -> Exchange {
        Exchange {
            what,
            parent: call.span_id.clone(),
            status: call.status,
            children,
        }
    }

    /// Whether the request went upstream: one CLIENT span.
    fn upstream(&self) -> bool {
        self.children.iter().any(|(kind, _)| *kind == "CLIENT")
    }

    /// Waits for its spans; fails the test when they are not what it made.
    async fn wait(&self, otlp: &OtlpReceiver) {
        let spans = otlp
            .wait_for_spans(
                &format!(
                    "{}: the SERVER span under {} and its children {:?}",
                    self.what, self.parent, self.children
                ),
                DEADLINE,
                |all| {
                    all.server_under(&self.parent).is_some_and(|server| {
                        let kids = all.children_of(server);
                        self.children.iter().all(|(kind, name)| {
                            kids.iter()
                                .any(|k| k.kind == *kind && name.is_none_or(|n| k.name == n))
                        })
                    })
                },
            )
            .await;
        let server = spans.server_under(&self.parent).expect("found");
        assert_eq!(
            server.attr_i64("http.response.status_code"),
            Some(i64::from(self.status)),
            "{}: the status the client got: {server:?}",
            self.what
        );
        let clients = spans
            .children_of(server)
            .into_iter()
            .filter(|k| k.kind == "CLIENT")
            .count();
        assert_eq!(
            clients,
            usize::from(self.upstream()),
            "{}: CLIENT spans:\n{}",
            self.what,
            spans.outline()
        );
    }
}

/// A W3C parent for a client that is not the SDK's (curl, tonic): the
/// `traceparent` value and the parent span id the SERVER span will have.
fn sampled_parent() -> (String, String) {
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let parent = uuid::Uuid::new_v4().simple().to_string()[..16].to_string();
    (format!("00-{trace_id}-{parent}-01"), parent)
}

/// One request of each kind (an execution, a replay, a 409, a 409 after a
/// wait, a 422, pass-through, the upstream's 5xx and 4xx, a method outside
/// RFC 9110, HTTP/2, gRPC, an upstream that refuses the connection), each
/// kind's spans waited for so that the check cannot pass on nothing; then
/// every span received goes through semconv_check.py.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_span_follows_the_registered_conventions() {
    let started = Instant::now();
    let otlp = OtlpReceiver::start().await;
    let env = Env::builder(Backend::Memory)
        .routes(&format!("{ROUTES}{SEMCONV_ROUTES}"))
        .telemetry(&otlp.config())
        .start()
        .await;
    let call = |method: &'static str,
                path: &str,
                key: Option<&'static str>,
                body: &'static str,
                headers: &'static [&'static str]| {
        let url = env.url(path);
        async move { otel_call(method, &url, key, body, headers, Parent::Sampled).await }
    };
    let mut made = Vec::new();

    // An execution, then its replay and a 422 (same key, another body).
    let first = call("POST", "/v1/payments", Some("k-semconv-1"), "a", &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    made.push(Exchange::of("execution", &first, EXECUTION));
    let replay = call("POST", "/v1/payments", Some("k-semconv-1"), "a", &[]).await;
    assert!(replay.status == 201 && replay.is_replay(), "{replay:?}");
    made.push(Exchange::of("replay", &replay, ANSWERED_FROM_THE_STORE));
    let other = call("POST", "/v1/payments", Some("k-semconv-1"), "b", &[]).await;
    assert_eq!(other.status, 422, "{other:?}");
    made.push(Exchange::of("422", &other, ANSWERED_FROM_THE_STORE));

    // A 409 while the first is held upstream; a duplicate that waits, then 409s.
    let held = |path: &'static str, key: &'static str| spawn_held(&env.url(path), key);
    let hits = env.upstream.hits();
    let held_order = held("/v1/orders/7", "k-semconv-held");
    env.upstream.wait_hits(hits + 1).await;
    let busy = call("POST", "/v1/orders/7", Some("k-semconv-held"), "a", &[]).await;
    assert_eq!(busy.status, 409, "{busy:?}");
    made.push(Exchange::of("409", &busy, ANSWERED_FROM_THE_STORE));
    let held_wait = held("/v1/waiting", "k-semconv-wait");
    env.upstream.wait_hits(hits + 2).await;
    let waited = call("POST", "/v1/waiting", Some("k-semconv-wait"), "a", &[]).await;
    assert_eq!(waited.status, 409, "past wait_timeout: {waited:?}");
    made.push(Exchange::of("409 after a wait", &waited, WAITED));
    env.upstream.release(2);
    for (what, held) in [("held execution", held_order), ("held wait", held_wait)] {
        let done = held.await.expect("join");
        assert_eq!(done.status, 201, "{done:?}");
        made.push(Exchange::of(what, &done, EXECUTION));
    }

    // Pass-through; the upstream's 5xx and 4xx, passed on.
    let pass = call("GET", "/things/7", None, "", &[]).await;
    assert_eq!(pass.status, 201, "{pass:?}");
    made.push(Exchange::of("pass-through", &pass, FORWARDED));
    let pass_5xx = call("GET", "/things/8", None, "", &["x-test-status: 502"]).await;
    assert_eq!(pass_5xx.status, 502, "{pass_5xx:?}");
    made.push(Exchange::of(
        "pass-through upstream 502",
        &pass_5xx,
        FORWARDED,
    ));
    let pass_4xx = call("GET", "/things/9", None, "", &["x-test-status: 404"]).await;
    assert_eq!(pass_4xx.status, 404, "{pass_4xx:?}");
    made.push(Exchange::of(
        "pass-through upstream 404",
        &pass_4xx,
        FORWARDED,
    ));
    let exec_5xx = call(
        "POST",
        "/v1/payments",
        Some("k-semconv-5xx"),
        "a",
        &["x-test-status: 503"],
    )
    .await;
    assert_eq!(exec_5xx.status, 503, "{exec_5xx:?}");
    made.push(Exchange::of(
        "execution upstream 503",
        &exec_5xx,
        RESERVED_AND_FORWARDED,
    ));

    // A method outside RFC 9110: on a pass-through path, and on a route that takes it.
    let purge = call("PURGE", "/things/10", None, "", &[]).await;
    assert_eq!(purge.status, 201, "{purge:?}");
    made.push(Exchange::of("pass-through PURGE", &purge, FORWARDED));
    let purge_route = call("PURGE", "/v1/purge", Some("k-semconv-purge"), "a", &[]).await;
    assert_eq!(purge_route.status, 201, "{purge_route:?}");
    made.push(Exchange::of("execution PURGE", &purge_route, EXECUTION));

    // HTTP/2 (curl, prior knowledge): an execution and a pass-through.
    let (tp, parent) = sampled_parent();
    let tp = format!("traceparent: {tp}");
    let a = curl(&[
        "--http2-prior-knowledge",
        "-H",
        &tp,
        "-H",
        "Idempotency-Key: k-semconv-h2",
        "--data-binary",
        "a",
        &env.url("/v1/payments"),
    ])
    .await;
    assert_eq!((a.version.as_str(), a.status), ("HTTP/2", 201), "{a:?}");
    made.push(Exchange {
        what: "HTTP/2 execution",
        parent,
        status: 201,
        children: EXECUTION,
    });
    let (tp, parent) = sampled_parent();
    let tp = format!("traceparent: {tp}");
    let a = curl(&["--http2-prior-knowledge", "-H", &tp, &env.url("/things")]).await;
    assert_eq!((a.version.as_str(), a.status), ("HTTP/2", 201), "{a:?}");
    made.push(Exchange {
        what: "HTTP/2 pass-through",
        parent,
        status: 201,
        children: FORWARDED,
    });

    // gRPC through a proxy of its own (an h2c upstream).
    let (grpc_url, _) = grpc_upstream().await;
    let grpc_proxy = Proxy::in_process(
        &ConfigBuilder::new(&grpc_url)
            .server("upstream_protocol = \"h2c\"")
            .telemetry(&otlp.config())
            .routes(&format!(
                "[[routes]]\nname = \"charge\"\npath = \"{CHARGE}\"\n"
            ))
            .build(),
        &[],
    )
    .await;
    let channel = tonic::transport::Channel::from_shared(grpc_proxy.url(""))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    let (tp, parent) = sampled_parent();
    let charged = grpc_charge(
        &mut grpc,
        &[("idempotency-key", "k-semconv-grpc"), ("traceparent", &tp)],
    )
    .await
    .expect("the call");
    assert_eq!(charged.get_ref().text, "ok");
    made.push(Exchange {
        what: "gRPC execution",
        parent,
        status: 200,
        children: EXECUTION,
    });

    // An upstream nothing listens on: no response, on both kinds of path.
    let closed = format!("http://127.0.0.1:{}", free_port());
    let dead = Env::builder(Backend::Memory)
        .telemetry(&otlp.config())
        .upstream_url(&closed)
        .start()
        .await;
    let url = dead.url("/things");
    let refused = otel_call("GET", &url, None, "", &[], Parent::Sampled).await;
    assert!(refused.status >= 500, "{refused:?}");
    made.push(Exchange::of(
        "pass-through, connect refused",
        &refused,
        FORWARDED,
    ));
    let url = dead.url("/v1/payments");
    let refused = otel_call(
        "POST",
        &url,
        Some("k-semconv-dead"),
        "a",
        &[],
        Parent::Sampled,
    )
    .await;
    assert!(refused.status >= 500, "{refused:?}");
    made.push(Exchange::of(
        "execution, connect refused",
        &refused,
        RESERVED_AND_FORWARDED,
    ));

    for exchange in &made {
        exchange.wait(&otlp).await;
    }
    // Every span received, of every request: each kind's spans are among them.
    let spans = otlp.spans();
    assert!(otlp.noise().is_empty(), "{:?}", otlp.noise());
    let printed = assert_spans_follow_the_conventions(&spans).await;
    eprintln!(
        "{} requests, {} spans, in {:?}:\n{printed}",
        made.len(),
        spans.len(),
        started.elapsed()
    );
}

// ---------------------------------------------------------------------------
// Found by review.

/// A WebSocket handshake (no CLIENT span) under `client_context = "ignore"`
/// or `"link"`: the client's `traceparent` and `tracestate` must not reach
/// the upstream either, or a client could still have it sample.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_handshake_does_not_carry_the_clients_context_when_it_is_not_followed() {
    let otlp = OtlpReceiver::start().await;
    let client_tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    for mode in ["ignore", "link"] {
        let config = format!("sample_ratio = 0.0\nclient_context = \"{mode}\"\n");
        let env = traced_env(Backend::Memory, &otlp, &config).await;
        let r = Call::new("GET", &env.url("/chat"))
            .header("connection", "Upgrade")
            .header("upgrade", "websocket")
            .header("sec-websocket-version", "13")
            .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
            .header("traceparent", client_tp)
            .header("tracestate", "congo=t61rcWkgMzE")
            .send()
            .await;
        assert!(r.status < 500, "{mode}: {r:?}");
        let seen = env.upstream.seen();
        let h = &seen
            .last()
            .expect("the handshake reached the upstream")
            .headers;
        let tp = TraceParent::parse(h["traceparent"].to_str().unwrap());
        assert_ne!(
            tp.trace_id, "0af7651916cd43dd8448eb211c80319c",
            "{mode}: {h:?}"
        );
        assert!(
            !tp.sampled(),
            "{mode}: the client's sampled flag went upstream"
        );
        assert!(!h.contains_key("tracestate"), "{mode}: {h:?}");
    }
}

/// An OTLP/gRPC connection that stops answering while its socket stays
/// open: the export that times out drops its connection, and the next one
/// opens another (the stuck one was reused for ever, and spans stopped for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_connection_that_stops_answering_is_not_used_again() {
    let otlp = OtlpReceiver::start().await;
    let relay = Relay::start(otlp.addr).await;
    let env = Env::builder(Backend::Memory)
        .telemetry(&format!(
            "otlp_endpoint = \"http://{}\"\notlp_protocol = \"grpc\"\nsample_ratio = 1.0\n",
            relay.addr
        ))
        .start()
        .await;
    let first = otel_call("GET", &env.url("/a"), None, "", &[], Parent::Sampled).await;
    otlp.wait_for_span("the first request's span", DEADLINE, |s| {
        s.parent_span_id == first.span_id
    })
    .await;
    // Bytes on the open connection are now held for an hour.
    relay.set(Fault::Latency(3_600_000));
    let stuck = otel_call("GET", &env.url("/b"), None, "", &[], Parent::Sampled).await;
    eventually("the stuck export to time out", DEADLINE, || async {
        (env.metric("idemproxy_spans_dropped_total").await >= 1.0).then_some(())
    })
    .await;
    // New connections pass again; the stuck one stays stuck.
    relay.set(Fault::Pass);
    let after = otel_call("GET", &env.url("/c"), None, "", &[], Parent::Sampled).await;
    otlp.wait_for_span(
        "a later request's span, over a new connection",
        DEADLINE,
        |s| s.parent_span_id == after.span_id,
    )
    .await;
    assert!(relay.accepted() >= 2, "no new connection");
    assert!(
        !otlp
            .spans()
            .iter()
            .any(|s| s.parent_span_id == stuck.span_id),
        "the stuck export's spans arrived"
    );
}

/// A collector that takes an export but rejects some of its spans (a
/// partial success): those are counted as dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_a_collector_rejects_are_counted_as_dropped() {
    let otlp = OtlpReceiver::start_rejecting(2).await;
    let env = traced_env(Backend::Memory, &otlp, "sample_ratio = 1.0\n").await;
    for i in 0..3 {
        let r = Call::new("GET", &env.url(&format!("/r/{i}"))).send().await;
        assert_eq!(r.status, 201, "{r:?}");
    }
    // Six spans (SERVER and CLIENT each): whatever batches they went in,
    // the collector rejected one in two of each batch.
    let spans = otlp
        .wait_for_spans("six spans", DEADLINE, |all| all.len() >= 6)
        .await;
    assert_eq!(spans.len(), 6);
    eventually("the rejected spans to be counted", DEADLINE, || async {
        let dropped = env.metric("idemproxy_spans_dropped_total").await;
        (dropped >= 1.0).then_some(dropped)
    })
    .await;
    env.proxy.wait_log("the collector rejected spans").await;
}
