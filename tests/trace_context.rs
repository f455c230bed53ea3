//! With tracing off (no `[telemetry]` endpoint, the default), the client's
//! W3C trace context goes upstream untouched, on a protected route and on
//! pass-through alike (docs/telemetry.md). The spans themselves, with a real
//! collector, are tests/telemetry.rs's.

mod support;

use support::*;

const ROUTES: &str = r#"
[[routes]]
name = "pay"
path = "/v1/pay"
"#;

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
const TRACESTATE: &str = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";

#[tokio::test]
async fn with_tracing_off_traceparent_and_tracestate_pass_through_untouched() {
    // Off whatever the environment of the test run says.
    std::env::remove_var("OTEL_EXPORTER_OTLP_ENDPOINT");
    let proxy = InProcess::start(ROUTES).await;
    let protected = Call::post(&proxy.url("/v1/pay"))
        .key("k-trace")
        .header("traceparent", TRACEPARENT)
        .header("tracestate", TRACESTATE)
        .body("x")
        .await;
    assert_eq!(protected.status, 201);
    let passed = Call::new("GET", &proxy.url("/v1/other"))
        .header("traceparent", TRACEPARENT)
        .header("tracestate", TRACESTATE)
        .send()
        .await;
    assert!(passed.status < 500, "{}", passed.status);
    let seen = proxy.upstream.seen();
    assert_eq!(seen.len(), 2);
    for s in &seen {
        let all = |name: &str| -> Vec<String> {
            s.headers
                .get_all(name)
                .iter()
                .map(|v| v.to_str().unwrap().to_string())
                .collect()
        };
        assert_eq!(all("traceparent"), [TRACEPARENT], "{}", s.path);
        assert_eq!(all("tracestate"), [TRACESTATE], "{}", s.path);
    }
    // A replay reaches no upstream, and says nothing of traces either.
    let replay = Call::post(&proxy.url("/v1/pay"))
        .key("k-trace")
        .header("traceparent", TRACEPARENT)
        .body("x")
        .await;
    assert!(replay.is_replay());
    assert_eq!(proxy.upstream.hits(), 2);
}
