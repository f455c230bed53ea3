use super::*;
use crate::config::UpstreamUrl;

#[test]
fn off_without_an_endpoint() {
    let config = TelemetryConfig::default();
    let upstream = UpstreamUrl::parse("http://127.0.0.1:9").unwrap();
    assert!(Telemetry::start(&config, &upstream, Counter::default()).is_none());
}

#[test]
fn http_endpoints_take_spans_at_v1_traces() {
    for (given, url) in [
        ("http://c:4318", "http://c:4318/v1/traces"),
        ("http://c:4318/", "http://c:4318/v1/traces"),
        ("http://c:4318/otlp", "http://c:4318/otlp/v1/traces"),
        ("http://c:4318/v1/traces", "http://c:4318/v1/traces"),
    ] {
        assert_eq!(http_traces_url(given), url);
    }
}

/// A `Telemetry` whose spans go to `queue` (no export thread), sampling
/// roots at `ratio`, reading the client's context as `client_context` says.
fn tracing(ratio: f64, client_context: ClientContext, queue: &Arc<SpanQueue>) -> Telemetry {
    Telemetry {
        queue: queue.clone(),
        flush: mpsc::unbounded_channel().0,
        ratio: Ratio::new(ratio),
        client_context,
        upstream_origin: "http://up:8081".into(),
        upstream_host: "up".into(),
        upstream_port: 8081,
    }
}

fn span(r: &SpanRecord, key: &str) -> Option<Value> {
    r.attributes
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.clone())
}

const CALLER: ([u8; 4], u16) = ([127, 0, 0, 1], 1);
const SAMPLED: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
const UNSAMPLED: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";

fn request(method: &str, traceparent: Option<&str>) -> Request<()> {
    let mut b = Request::builder()
        .method(method)
        .uri("/v1/pay")
        .header("host", "proxy:8080")
        .header("tracestate", "rojo=00f067aa0ba902b7");
    if let Some(tp) = traceparent {
        b = b.header("traceparent", tp);
    }
    b.body(()).unwrap()
}

/// A full queue drops the span at once, and counts it: nothing waits.
#[test]
fn spans_without_room_in_the_queue_are_dropped_and_counted() {
    let dropped = Counter::<u64>::default();
    let queue = SpanQueue::new(2, dropped.clone());
    let t = tracing(1.0, ClientContext::Follow, &queue);
    let one = || {
        let s = t.server_span(&request("GET", None), None, "http", CALLER.into());
        s.end(200, "passthrough", None);
    };
    for _ in 0..5 {
        one();
    }
    assert_eq!(dropped.get(), 3);
    assert_eq!(queue.take().len(), 2);
    one();
    assert_eq!(dropped.get(), 4, "spans being exported hold their room");
    queue.exported(2);
    one();
    assert_eq!(queue.take().len(), 1, "room again once they are exported");
    assert_eq!(dropped.get(), 4);
}

/// The export thread is woken when a batch is queued, not for every span
/// (a wake is a syscall and two context switches).
#[tokio::test]
async fn the_export_thread_is_woken_once_a_batch_is_queued() {
    let queue = SpanQueue::new(QUEUE, Counter::default());
    let t = tracing(1.0, ClientContext::Follow, &queue);
    let one = || {
        let s = t.server_span(&request("GET", None), None, "http", CALLER.into());
        s.end(200, "passthrough", None);
    };
    for _ in 0..export::BATCH - 1 {
        one();
    }
    assert!(!queue.woken().await, "woken before a batch was queued");
    one();
    assert!(queue.woken().await, "not woken with a batch queued");
    assert_eq!(queue.take().len(), export::BATCH);
    drop(t);
    assert!(queue.woken().await, "not told the end");
}

/// The client's sampled flag decides; a root is sampled by the ratio; the
/// execution's ids are kept only when sampled; the upstream gets the proxy's
/// CLIENT span as its parent.
#[test]
fn parent_based_sampling_and_kept_ids() {
    let queue = SpanQueue::new(16, Counter::default());
    let t = tracing(0.0, ClientContext::Follow, &queue);
    let s = t.server_span(&request("POST", Some(SAMPLED)), None, "http", CALLER.into());
    assert!(s.log_ids().is_some(), "a sampled parent is followed");
    let kept = s.trace_ref().unwrap();
    assert_eq!(
        context::hex_string(&kept.trace_id),
        "0af7651916cd43dd8448eb211c80319c"
    );
    let mut upstream = request("POST", Some(SAMPLED));
    let client = t.client_span(&s, &mut upstream).expect("recorded");
    let sent = upstream.headers()["traceparent"].to_str().unwrap();
    assert!(
        sent.starts_with("00-0af7651916cd43dd8448eb211c80319c-"),
        "{sent}"
    );
    assert!(!sent.contains("b7ad6b7169203331"), "{sent}");
    assert!(sent.ends_with("-01"), "{sent}");
    assert_eq!(upstream.headers()["tracestate"], "rojo=00f067aa0ba902b7");
    client.end(Ok(201));
    s.end(201, "forwarded", None);
    let spans = queue.take();
    assert_eq!(spans.len(), 2);
    let (client, server) = (&spans[0], &spans[1]);
    assert_eq!(
        server.parent,
        Some((context::traceparent(SAMPLED.as_bytes()).unwrap().1, true))
    );
    assert_eq!(client.parent, Some((server.span_id, false)));
    assert_eq!(server.trace_state.as_deref(), Some("rojo=00f067aa0ba902b7"));

    let s = t.server_span(
        &request("POST", Some(UNSAMPLED)),
        None,
        "http",
        CALLER.into(),
    );
    assert!(s.log_ids().is_none(), "an unsampled parent is followed");
    assert_eq!(s.trace_ref(), None);
    let mut upstream = request("POST", Some(UNSAMPLED));
    assert!(t.client_span(&s, &mut upstream).is_none());
    let sent = upstream.headers()["traceparent"].to_str().unwrap();
    assert!(
        sent.starts_with("00-0af7651916cd43dd8448eb211c80319c-"),
        "{sent}"
    );
    assert!(
        sent.ends_with("-00"),
        "the upstream samples as the proxy did: {sent}"
    );
    s.end(201, "forwarded", None);
    let s = t.server_span(&request("POST", None), None, "http", CALLER.into());
    assert!(s.log_ids().is_none(), "a root at ratio 0 is not sampled");
    drop(s);
    assert!(
        queue.take().is_empty(),
        "nothing recorded for unsampled requests"
    );
}

/// `link`: a new trace at the ratio, linked to the client's span, whose
/// `tracestate` does not go upstream; `ignore`: the same without the link.
#[test]
fn client_context_link_and_ignore_start_a_trace_of_their_own() {
    for mode in [ClientContext::Link, ClientContext::Ignore] {
        let queue = SpanQueue::new(16, Counter::default());
        let t = tracing(0.0, mode, &queue);
        let s = t.server_span(&request("POST", Some(SAMPLED)), None, "http", CALLER.into());
        assert!(
            s.log_ids().is_none(),
            "{mode}: the client's sampled flag is not followed"
        );
        let mut upstream = request("POST", Some(SAMPLED));
        assert!(t.client_span(&s, &mut upstream).is_none());
        let sent = upstream.headers()["traceparent"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(
            !sent.contains("0af7651916cd43dd8448eb211c80319c"),
            "{mode}: {sent}"
        );
        assert!(sent.ends_with("-00"), "{mode}: {sent}");
        assert!(!upstream.headers().contains_key("tracestate"), "{mode}");
        s.end(200, "forwarded", None);

        let t = tracing(1.0, mode, &queue);
        let s = t.server_span(
            &request("POST", Some(UNSAMPLED)),
            None,
            "http",
            CALLER.into(),
        );
        assert!(s.log_ids().is_some(), "{mode}: sampled by the ratio");
        s.end(200, "forwarded", None);
        let spans = queue.take();
        assert_eq!(spans.len(), 1);
        let server = &spans[0];
        assert_ne!(
            context::hex_string(&server.trace_id),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(server.parent, None);
        assert_eq!(server.trace_state, None);
        match mode {
            ClientContext::Link => {
                assert_eq!(server.links.len(), 1);
                let link = &server.links[0];
                assert_eq!(
                    context::hex_string(&link.trace_id),
                    "0af7651916cd43dd8448eb211c80319c"
                );
                assert_eq!(context::hex_string(&link.span_id), "b7ad6b7169203331");
                assert_eq!(link.trace_state.as_deref(), Some("rojo=00f067aa0ba902b7"));
            }
            _ => assert!(server.links.is_empty()),
        }
    }
}

/// An unknown method is `_OTHER`, with the method as it came beside it; a
/// 5xx and a failed exchange are errors, a 4xx is not.
#[test]
fn unknown_methods_and_error_status() {
    let queue = SpanQueue::new(16, Counter::default());
    let t = tracing(1.0, ClientContext::Follow, &queue);
    let s = t.server_span(
        &request("PURGE", None),
        Some(("pay", "/v1/pay")),
        "http",
        CALLER.into(),
    );
    let mut upstream = request("PURGE", None);
    t.client_span(&s, &mut upstream)
        .unwrap()
        .end(Err("connect"));
    s.end(502, "upstream_unreachable", None);
    let s2 = t.server_span(&request("GET", None), None, "http", CALLER.into());
    let mut upstream = request("GET", None);
    t.client_span(&s2, &mut upstream).unwrap().end(Ok(404));
    s2.end(404, "passthrough", None);
    let spans = queue.take();
    let (client, server) = (&spans[0], &spans[1]);
    assert_eq!(
        span(server, "http.request.method"),
        Some(Value::Static(OTHER))
    );
    assert_eq!(
        span(server, "http.request.method_original"),
        Some(Value::Text("PURGE".into()))
    );
    assert_eq!(span(server, "server.port"), Some(Value::Int(8080)));
    assert_eq!(span(client, "server.port"), Some(Value::Int(8081)));
    assert!(server.error && client.error);
    assert_eq!(span(client, "error.type"), Some(Value::Static("connect")));
    assert_eq!(span(server, "error.type"), Some(Value::Text("502".into())));
    let (client, server) = (&spans[2], &spans[3]);
    assert!(!server.error && !client.error, "a 4xx is not an error");
    assert_eq!(span(server, "error.type"), None);
}

/// A request dropped before its answer (the client went away) still sends
/// its SERVER span, marked cancelled.
#[test]
fn a_dropped_request_sends_its_span_as_cancelled() {
    let queue = SpanQueue::new(16, Counter::default());
    let t = tracing(1.0, ClientContext::Follow, &queue);
    let s = t.server_span(&request("POST", None), None, "http", CALLER.into());
    drop(s);
    let spans = queue.take();
    assert_eq!(spans.len(), 1);
    assert!(spans[0].error);
    assert_eq!(
        span(&spans[0], "error.type"),
        Some(Value::Static(CANCELLED))
    );
}

/// Found by review: every span keeps the client's `tracestate`; over W3C's
/// 32 members it is not read (the trace itself continues).
#[test]
fn a_tracestate_of_more_than_32_members_is_not_kept() {
    let queue = SpanQueue::new(16, Counter::default());
    let t = tracing(1.0, ClientContext::Follow, &queue);
    let state = |members: usize| {
        let list: Vec<String> = (0..members).map(|i| format!("k{i}=v")).collect();
        let req = Request::builder()
            .uri("/")
            .header("traceparent", SAMPLED)
            .header("tracestate", list.join(","))
            .body(())
            .unwrap();
        let s = t.server_span(&req, None, "http", CALLER.into());
        assert_eq!(
            context::hex_string(&s.parent().trace_id),
            "0af7651916cd43dd8448eb211c80319c"
        );
        s.parent().trace_state.clone()
    };
    assert_eq!(state(32).unwrap().split(',').count(), 32);
    assert_eq!(state(33), None);
}

/// Found by review: the export queue is bounded in spans, not in bytes. A
/// client that asks for sampling (`-01`) and sends long paths would pin
/// QUEUE spans of its own choosing while the collector is slow or stuck.
#[test]
fn the_queue_holds_few_client_chosen_bytes_however_long_the_path() {
    let queue = SpanQueue::new(QUEUE, Counter::default());
    let t = tracing(0.01, ClientContext::Follow, &queue);
    let path = format!("/{}", "a".repeat(15 * 1024));
    for _ in 0..QUEUE {
        let req = Request::builder()
            .method(&*format!("X{}", "M".repeat(8 * 1024)))
            .uri(path.as_str())
            .header("host", "proxy")
            .header("traceparent", SAMPLED)
            .body(())
            .unwrap();
        let s = t.server_span(&req, None, "http", CALLER.into());
        s.end(200, "passthrough", None);
    }
    let mut held = 0usize;
    for span in queue.take() {
        held += span
            .attributes
            .iter()
            .map(|(_, v)| match v {
                Value::Text(s) => s.len(),
                _ => 0,
            })
            .sum::<usize>();
    }
    assert!(
        held <= 16 << 20,
        "{} MiB of client-chosen attribute bytes held by the export queue",
        held >> 20
    );
}
