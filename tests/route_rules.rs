//! Which requests a route protects, end to end (docs/routes-and-keys.md#what-is-protected):
//! every spelling an upstream framework might route to a protected handler is
//! protected or refused, never passed through; what the proxy adds to a
//! replay's status line; what feeds a 409's `Retry-After`. The memory store,
//! the test upstream and the proxy in-process, over loopback.

mod support;

use support::*;

const ROUTES: &str = r#"
[[routes]]
name = "payments"
path = "/v1/payments"

[[routes]]
name = "pay"
path = "/v1/orders/{id}/pay"

[[routes]]
name = "update"
methods = ["PATCH"]
path = "/v1/orders/{id}"

[[routes]]
name = "report"
path = "/v1/report"
format_suffix = false
"#;

async fn env() -> Env {
    Env::with_routes(Backend::Memory, ROUTES).await
}

/// Each spelling, sent twice with one key, runs once; without a key it is a 400
/// (protected), and it reaches the upstream as the client wrote it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spellings_frameworks_route_to_a_protected_handler_run_once() {
    let env = env().await;
    let spellings = [
        // Flask, FastAPI, aiohttp, Express 4: `.` or `..` as the `{id}`.
        "/v1/orders/./pay",
        "/v1/orders/../pay",
        "/v1/orders/%2e/pay",
        "/v1/orders/%2E%2E/pay",
        // Rails' `(.:format)`, Django REST framework's format suffixes.
        "/v1/payments.json",
        "/v1/payments.xml",
        "/v1/orders/42/pay.json",
    ];
    for path in spellings {
        let r = Call::post(&env.url(path)).body("x").await;
        assert_eq!(r.status, 400, "{path}: protected, so a key is required");
        assert_eq!(r.json()["type"], "idempotency-key-missing", "{path}");
    }
    assert_eq!(env.upstream.hits(), 0);
    for (i, path) in spellings.iter().enumerate() {
        let key = format!("k-spelling-{i}");
        let first = Call::post(&env.url(path)).key(&key).body("x").await;
        assert_eq!(first.status, 201, "{path}");
        let again = Call::post(&env.url(path)).key(&key).body("x").await;
        assert!(again.is_replay(), "{path}: {again:?}");
    }
    assert_eq!(env.upstream.hits(), spellings.len(), "each ran once");
    let targets: Vec<String> = env.upstream.seen().into_iter().map(|s| s.target).collect();
    assert_eq!(targets, spellings, "forwarded as the client sent them");
    // A route that opts out of suffixes: `/v1/report.csv` is another resource.
    let csv = Call::post(&env.url("/v1/report.csv")).body("x").await;
    assert_eq!(csv.status, 201, "format_suffix = false: passed through");
    assert_eq!(
        Call::post(&env.url("/v1/report")).body("x").await.status,
        400
    );
}

/// A control character in the path, raw or encoded, on a method a route
/// names: 400 `path-not-accepted` before anything is reserved or forwarded.
/// (Starlette routes `/v1/payments%0a` to `/v1/payments`.) Other methods pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_character_in_the_path_is_refused_on_a_method_a_route_names() {
    let env = env().await;
    for target in [
        "/v1/payments%0a",
        "/v1/payments%0D%0A",
        "/v1/payments%00",
        "/v1/payments%7F",
        "/nowhere%09/at/all",
        "/v1/payments?x=%00",
    ] {
        let request = format!(
            "POST {target} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-control\r\n\
             Content-Length: 1\r\nConnection: close\r\n\r\nx"
        );
        let answer = raw(env.proxy.addr, request.as_bytes()).await;
        assert_eq!(raw_status(&answer), 400, "{target}: {answer}");
        assert!(answer.contains("path-not-accepted"), "{target}: {answer}");
    }
    assert_eq!(env.upstream.hits(), 0, "nothing reached the upstream");
    let request = "GET /v1/payments%0a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    let answer = raw(env.proxy.addr, request.as_bytes()).await;
    assert_eq!(
        raw_status(&answer),
        201,
        "GET is no route's method: {answer}"
    );
    assert_eq!(env.upstream.hits(), 1);
    assert_eq!(
        env.metric("idemproxy_requests_total{route=\"\",outcome=\"bad_request\"}")
            .await,
        6.0
    );
}

/// Rails and Express run a POST with a method override as the method it
/// names: judged as that method too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_method_override_is_judged_as_the_method_it_names() {
    let env = env().await;
    let url = env.url("/v1/orders/7");
    let r = Call::post(&url)
        .header("x-http-method-override", "PATCH")
        .body("x")
        .await;
    assert_eq!(r.status, 400, "protected as a PATCH: {r:?}");
    let post = |key: &str| {
        Call::post(&url)
            .key(key)
            .header("x-http-method-override", "PATCH")
    };
    assert_eq!(post("k-override").body("x").await.status, 201);
    assert!(post("k-override").body("x").await.is_replay());
    // A form body may carry `_method` (Rack::MethodOverride): protected too.
    let form = Call::post(&url).header("content-type", "application/x-www-form-urlencoded");
    assert_eq!(form.body("_method=patch").await.status, 400);
    // ...and one whose type is not given, which Rack parses as a form too.
    assert_eq!(Call::post(&url).body("_method=patch").await.status, 400);
    // A POST of JSON to the same path is no route's.
    let json = Call::post(&url).header("content-type", "application/json");
    assert_eq!(json.body("{}").await.status, 201);
    assert_eq!(env.upstream.hits(), 2);
}

/// `forward_normalised_path`: the upstream gets the path the proxy matched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_normalised_path_sends_the_upstream_the_normalised_path() {
    let env = Env::builder(Backend::Memory)
        .routes(ROUTES)
        .server("forward_normalised_path = true")
        .start()
        .await;
    let r = Call::post(&env.url("//v1/./x/../payments/?a=%2F&b"))
        .key("k-normal")
        .body("x")
        .await;
    assert_eq!(r.status, 201);
    let again = Call::post(&env.url("/v1//%70ayments/?a=%2F&b"))
        .key("k-normal")
        .body("x")
        .await;
    assert!(
        again.is_replay(),
        "the same request once normalised: {again:?}"
    );
    assert_eq!(get(&env.url("/a//b/%7e/")).await.unwrap().status, 201);
    assert_eq!(get(&env.url("/a/./c")).await.unwrap().status, 201);
    let targets: Vec<String> = env.upstream.seen().into_iter().map(|s| s.target).collect();
    // A trailing slash is kept, as Envoy keeps it.
    assert_eq!(targets, ["/v1/payments/?a=%2F&b", "/a/b/~/", "/a/c"]);
}

/// A replay's status line repeats the upstream's own reason phrase (HTTP/1.1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_repeats_the_upstreams_reason_phrase() {
    let env = env().await;
    let request = "POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-reason\r\n\
                   X-Test-Reason: Charged Once\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx";
    let first = raw(env.proxy.addr, request.as_bytes()).await;
    assert!(
        first.starts_with("HTTP/1.1 201 Charged Once\r\n"),
        "{first}"
    );
    let again = raw(env.proxy.addr, request.as_bytes()).await;
    assert!(
        again.starts_with("HTTP/1.1 201 Charged Once\r\n"),
        "{again}"
    );
    assert!(
        again
            .to_ascii_lowercase()
            .contains("idempotent-replayed: true"),
        "{again}"
    );
    assert_eq!(env.upstream.hits(), 1);
}

const SLOW: &str = r#"
[[routes]]
name = "slow"
path = "/v1/slow"
lease = "30s"
"#;

/// One client's fast 4xx answers do not move the `Retry-After` every other
/// client gets: only stored successes feed the estimate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_client_errors_do_not_move_another_clients_retry_after() {
    let env = Env::with_routes(Backend::Memory, SLOW).await;
    let url = env.url("/v1/slow");
    let slow = |key: &str| Call::post(&url).key(key).header("x-test-delay-ms", "3000");
    assert_eq!(slow("k-measure").body("x").await.status, 201);
    for i in 0..20 {
        let r = Call::post(&url)
            .key(&format!("k-bad-{i}"))
            .header("x-test-status", "400")
            .body("x")
            .await;
        assert_eq!(r.status, 400);
    }
    let first = slow("k-busy").spawn("x");
    env.upstream.wait_hits(22).await;
    let r = slow("k-busy").body("x").await;
    assert_eq!(r.status, 409);
    let secs: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(
        secs >= 2,
        "Retry-After {secs}: the 3 s operation's, not the 4xx's"
    );
    assert_eq!(first.await.unwrap().status, 201);
}
