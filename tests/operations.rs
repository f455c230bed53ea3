//! Operations: metrics, logs, request ids, the key admin API, configuration reload.

mod support;

use support::*;

const TOKEN: &str = "s3cret-admin-token";

async fn admin(proxy: &Proxy, method: &str, path: &str, token: Option<&str>, body: &str) -> Resp {
    let mut b = http::Request::builder()
        .method(method)
        .uri(proxy.admin_url(path));
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    send(
        b.body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap(),
    )
    .await
    .unwrap()
}

async fn env_with_token(backend: Backend) -> Env {
    Env::builder(backend)
        .proxy_env("IDEMPROXY_ADMIN_TOKEN", TOKEN)
        .start()
        .await
}

on_every_backend!(
    metrics_follow_the_requests,
    admin_api_inspects_and_deletes_records
);

async fn metrics_follow_the_requests(backend: Backend) {
    let env = Env::start(backend).await;
    let m = |s: &'static str| {
        let proxy = &env.proxy;
        async move { metric(proxy, s).await }
    };
    assert_eq!(m("idemproxy_store_up").await, 1.0);
    let url = env.url("/v1/payments");
    Call::post(&url).key("m1").body("x").await;
    Call::post(&url).key("m1").body("x").await;
    Call::post(&url).key("m1").body("y").await;
    Call::post(&url).body("x").await;
    Call::post(&url).key("a,b").body("x").await;
    Call::post(&env.url("/v1/small"))
        .key("m2")
        .body(vec![0u8; 2000])
        .await;
    // Twice: the second is counted through the series the first found.
    Call::new("GET", &env.url("/other")).send().await;
    Call::new("GET", &env.url("/other")).send().await;
    for (outcome, n) in [
        ("forwarded", 1.0),
        ("replayed", 1.0),
        ("mismatch", 1.0),
        ("missing_key", 1.0),
        ("invalid_key", 1.0),
    ] {
        let series =
            format!("idemproxy_requests_total{{route=\"payments\",outcome=\"{outcome}\"}}");
        assert_eq!(metric(&env.proxy, &series).await, n, "{series}");
    }
    assert_eq!(
        m("idemproxy_requests_total{route=\"small\",outcome=\"too_large\"}").await,
        1.0
    );
    assert_eq!(
        m("idemproxy_requests_total{route=\"\",outcome=\"passthrough\"}").await,
        2.0
    );
    assert_eq!(
        m("idemproxy_upstream_duration_seconds_count").await,
        1.0,
        "protected upstream calls are timed"
    );
    assert!(m("idemproxy_store_duration_seconds_count{op=\"reserve\"}").await >= 3.0);
    assert_eq!(
        m("idemproxy_store_duration_seconds_count{op=\"complete\"}").await,
        1.0
    );
    // In flight while the upstream holds a request.
    let held = Call::post(&url)
        .key("m3")
        .header("x-test-hold", "1")
        .spawn("x");
    // One forwarded, two passed through, and this one.
    env.upstream.wait_hits(4).await;
    assert_eq!(m("idemproxy_inflight").await, 1.0);
    Call::post(&url).key("m3").body("x").await;
    assert_eq!(
        m("idemproxy_requests_total{route=\"payments\",outcome=\"conflict\"}").await,
        1.0
    );
    env.upstream.release(1);
    held.await.unwrap();
    assert_eq!(m("idemproxy_inflight").await, 0.0);
    // Names follow the Prometheus conventions: units and _total.
    let body = get(&env.proxy.admin_url("/metrics")).await.unwrap();
    let text = String::from_utf8_lossy(&body.body);
    for name in [
        "# TYPE idemproxy_requests counter",
        "# TYPE idemproxy_upstream_duration_seconds histogram",
        "# TYPE idemproxy_store_duration_seconds histogram",
        "# TYPE idemproxy_inflight gauge",
        "# TYPE idemproxy_store_up gauge",
        "# TYPE idemproxy_store_errors counter",
        "# TYPE idemproxy_lease_lost counter",
        "# TYPE idemproxy_shadow_outcomes counter",
    ] {
        assert!(text.contains(name), "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_the_fields_and_the_request_id() {
    // The binary's own log format is the subject.
    let env = Env::builder(Backend::Memory).binary().start().await;
    let id = "0b6f6a3e-3f7e-4c55-9a0e-4a3f6d7c2b11";
    let r = Call::post(&env.url("/v1/payments"))
        .header("x-request-id", id)
        .body("x")
        .await;
    assert_eq!(
        r.json()["instance"],
        format!("urn:uuid:{id}"),
        "a UUID X-Request-Id names the request"
    );
    let line = env.proxy.wait_log(id).await;
    assert_eq!(line["message"], "request");
    assert_eq!(line["request_id"], id);
    assert_eq!(line["route"], "payments");
    assert_eq!(line["outcome"], "missing_key");
    assert_eq!(line["status"], 400);
    assert!(line["duration_ms"].is_number());
    assert_eq!(line["level"], "INFO");

    Call::post(&env.url("/v1/payments"))
        .key("k-logged-secret")
        .body("x")
        .await;
    let seen = env.upstream.seen();
    let generated = seen[0].headers["x-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        uuid::Uuid::parse_str(&generated).is_ok(),
        "a request id is generated and sent upstream"
    );
    let line = env.proxy.wait_log(&generated).await;
    assert_eq!(line["outcome"], "forwarded");
    assert_eq!(line["record_id"].as_str().unwrap().len(), 64);
    // Pass-through lines carry no record id.
    Call::new("GET", &env.url("/elsewhere"))
        .header("x-request-id", "11111111-2222-3333-4444-555555555555")
        .send()
        .await;
    let line = env
        .proxy
        .wait_log("11111111-2222-3333-4444-555555555555")
        .await;
    assert_eq!(line["outcome"], "passthrough");
    assert!(line.get("record_id").is_none());
    for l in env.proxy.logs() {
        serde_json::from_str::<serde_json::Value>(&l)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(
            !l.contains("k-logged-secret"),
            "the raw key is never logged"
        );
    }
}

async fn admin_api_inspects_and_deletes_records(backend: Backend) {
    let env = env_with_token(backend).await;
    let p = &env.proxy;
    let url = env.url("/v1/payments");
    let held = Call::post(&url)
        .key("\"order-77\"")
        .header("authorization", "Bearer alice")
        .header("x-test-hold", "1")
        .spawn("x");
    env.upstream.wait_hits(1).await;
    let lookup = r#"{"key": "order-77", "scope": {"Authorization": "Bearer alice"}}"#;
    let r = admin(p, "POST", "/keys/lookup", Some(TOKEN), lookup).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let v = r.json();
    assert_eq!(v["state"], "processing");
    assert_eq!(v["route"], "payments");
    // The lease (10 s) runs; the store keeps the reservation its afterlife
    // (the 24 h TTL) past it, to recognise an owner that vanishes.
    let lease = v["lease_expires_in_seconds"].as_u64().unwrap();
    assert!(lease > 0 && lease <= 10, "{v}");
    let kept = v["expires_in_seconds"].as_u64().unwrap();
    assert!(kept > 86_400 && kept <= 86_410, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    assert!(v.get("status").is_none());
    env.upstream.release(1);
    held.await.unwrap();

    let v = admin(p, "GET", &format!("/keys/{id}"), Some(TOKEN), "")
        .await
        .json();
    assert_eq!(v["id"], id.as_str());
    assert_eq!(v["state"], "finished");
    assert_eq!(v["status"], 201);
    assert_eq!(v["body_stored"], true);
    assert!(v["age_seconds"].as_u64().unwrap() < 60);
    let expires = v["expires_in_seconds"].as_u64().unwrap();
    assert!(expires > 86_000 && expires <= 86_400, "{expires}");
    // The id is the one in the request's log line (read from the process's stderr: wait for it).
    p.wait_log(&id).await;

    // Another principal's scope is another record.
    let other = admin(
        p,
        "POST",
        "/keys/lookup",
        Some(TOKEN),
        r#"{"key": "order-77", "scope": {"authorization": "Bearer bob"}}"#,
    )
    .await;
    assert_eq!(other.status, 404);
    assert_ne!(other.json()["id"], id.as_str());

    // Delete: the key executes again.
    let d = admin(p, "DELETE", &format!("/keys/{id}"), Some(TOKEN), "").await;
    assert_eq!(d.status, 200);
    assert_eq!(
        admin(p, "GET", &format!("/keys/{id}"), Some(TOKEN), "")
            .await
            .status,
        404
    );
    assert_eq!(
        admin(p, "DELETE", &format!("/keys/{id}"), Some(TOKEN), "")
            .await
            .status,
        404
    );
    let again = Call::post(&url)
        .key("order-77")
        .header("authorization", "Bearer alice")
        .body("x")
        .await;
    assert!(!again.is_replay());
    assert_eq!(env.upstream.hits(), 2);

    // Unknown and malformed ids.
    let unknown = "0".repeat(64);
    assert_eq!(
        admin(p, "GET", &format!("/keys/{unknown}"), Some(TOKEN), "")
            .await
            .status,
        404
    );
    assert_eq!(
        admin(p, "GET", "/keys/not-an-id", Some(TOKEN), "")
            .await
            .status,
        404
    );
    assert_eq!(
        admin(p, "POST", "/keys/lookup", Some(TOKEN), "{\"nope\": 1}")
            .await
            .status,
        400
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_refuses_missing_or_wrong_tokens() {
    let env = env_with_token(Backend::Memory).await;
    let p = &env.proxy;
    let id = "a".repeat(64);
    for token in [
        None,
        Some("wrong"),
        Some(""),
        Some("s3cret-admin-token-but-longer"),
    ] {
        for (method, path) in [
            ("GET", format!("/keys/{id}")),
            ("DELETE", format!("/keys/{id}")),
            ("POST", "/keys/lookup".to_string()),
        ] {
            let r = admin(p, method, &path, token, "{\"key\": \"k\"}").await;
            assert_eq!(r.status, 401, "{method} {path} with {token:?}");
            assert!(r.header("www-authenticate").is_some());
        }
    }
    // Basic instead of Bearer.
    let r = send(
        http::Request::get(p.admin_url(&format!("/keys/{id}")))
            .header("authorization", format!("Basic {TOKEN}"))
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 401);
    // The key API lives on the admin listener only.
    let r = Call::new("GET", &env.url(&format!("/keys/{id}")))
        .header("authorization", &format!("Bearer {TOKEN}"))
        .send()
        .await;
    assert_eq!(
        r.status, 201,
        "the main listener passes /keys through to the upstream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_is_off_without_a_token() {
    let env = Env::start(Backend::Memory).await;
    let id = "a".repeat(64);
    for (method, path) in [
        ("GET", format!("/keys/{id}")),
        ("DELETE", format!("/keys/{id}")),
        ("POST", "/keys/lookup".to_string()),
    ] {
        let r = admin(&env.proxy, method, &path, Some("anything"), "{}").await;
        assert_eq!(r.status, 404, "{method} {path}");
    }
}

/// A configuration file swapped for a FIFO (or a device) is refused at once
/// by the reload, never read until a writer comes: the next reload of a
/// regular file applies, and SIGTERM ends the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_of_a_fifo_fails_at_once_and_holds_up_nothing() {
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url());
    let mut proxy = Proxy::start(&config.build()).await;
    let path = proxy.config_path().to_path_buf();
    std::fs::remove_file(&path).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(&path)
        .status()
        .unwrap();
    assert!(made.success());
    proxy.signal("HUP");
    let failed = proxy.wait_log("configuration reload failed").await;
    assert!(
        failed.to_string().contains("not a regular file"),
        "{failed}"
    );
    std::fs::remove_file(&path).unwrap();
    // The same listeners as the file said (port 0), and a route more.
    std::fs::write(&path, config.route("payments", "/v1/payments", "").build()).unwrap();
    proxy.signal("HUP");
    proxy.wait_log("configuration reloaded").await;
    proxy.signal("TERM");
    let exited = tokio::time::timeout(DEADLINE, proxy.wait_exit()).await;
    assert_eq!(exited, Ok(Some(0)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_routes_and_keeps_the_old_config_when_the_new_one_is_broken() {
    let upstream = TestUpstream::start().await;
    let one_route = ConfigBuilder::new(&upstream.url()).route("payments", "/v1/payments", "");
    // The binary: its config file is rewritten and SIGHUP sent to it.
    let proxy = Proxy::start(&one_route.build()).await;
    let new_url = proxy.url("/v1/new");
    Call::post(&new_url).key("k-new").body("x").await;
    assert!(
        !Call::post(&new_url)
            .key("k-new")
            .body("x")
            .await
            .is_replay(),
        "not protected yet"
    );

    // Keep the listen addresses: the proxy bound port 0, which is what the file says.
    let two_routes = one_route.route("new", "/v1/new", "");
    proxy.rewrite_config(&two_routes.build());
    proxy.signal("HUP");
    proxy.wait_log("configuration reloaded").await;
    Call::post(&new_url).key("k-new2").body("x").await;
    assert!(
        Call::post(&new_url)
            .key("k-new2")
            .body("x")
            .await
            .is_replay(),
        "protected after the reload"
    );

    proxy.rewrite_config("[server]\nupstream = 12\n");
    proxy.signal("HUP");
    let line = proxy.wait_log("configuration reload failed").await;
    assert!(
        line["error"].as_str().unwrap().contains("server.upstream"),
        "{line}"
    );
    Call::post(&new_url).key("k-new3").body("x").await;
    assert!(
        Call::post(&new_url)
            .key("k-new3")
            .body("x")
            .await
            .is_replay(),
        "the old configuration still applies"
    );
    assert_eq!(get(&proxy.admin_url("/readyz")).await.unwrap().status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_reload_keeps_the_config_and_a_later_reload_still_applies() {
    let upstream = TestUpstream::start().await;
    let one_route = ConfigBuilder::new(&upstream.url()).route("payments", "/v1/payments", "");
    // The binary: its config file is rewritten and SIGHUP sent to it.
    let proxy = Proxy::start(&one_route.build()).await;
    let new_url = proxy.url("/v1/new");

    // CRLF lines with non-ASCII text before the error: once a panic that ended
    // the reload task, so that no later SIGHUP was ever served.
    proxy.rewrite_config(
        "# café ☕\r\n[server]\r\n#\r\n# ☕\r\nupstream = \"https://127.0.0.1:1\"\r\n",
    );
    proxy.signal("HUP");
    let line = proxy.wait_log("configuration reload failed").await;
    let error = line["error"].as_str().unwrap();
    assert!(error.contains(":5:1: server.upstream: "), "{line}");
    Call::post(&new_url).key("k-1").body("x").await;
    assert!(
        !Call::post(&new_url).key("k-1").body("x").await.is_replay(),
        "not protected: the old configuration still applies"
    );

    let two_routes = one_route.route("new", "/v1/new", "").build();
    let fixed = format!("# ☕ fixed\n{two_routes}").replace('\n', "\r\n");
    proxy.rewrite_config(&fixed);
    proxy.signal("HUP");
    proxy.wait_log("configuration reloaded").await;
    Call::post(&new_url).key("k-2").body("x").await;
    assert!(
        Call::post(&new_url).key("k-2").body("x").await.is_replay(),
        "protected after the second reload"
    );
}

/// Connections to the admin listener that send nothing.
async fn idle_admin_connections(proxy: &Proxy, n: usize) -> Vec<tokio::net::TcpStream> {
    let mut held = Vec::new();
    for _ in 0..n {
        held.push(tokio::net::TcpStream::connect(proxy.admin).await.unwrap());
    }
    held
}

const HEALTHZ: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_caps_its_connections_without_locking_probes_out() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let config = ConfigBuilder::new("http://127.0.0.1:1")
        .server("idle_timeout = \"60s\"")
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    // The cap (32) taken by connections that say nothing, for a minute.
    let mut held = idle_admin_connections(&proxy, 32).await;
    // A probe still gets in: it takes the place of the oldest idle one.
    for _ in 0..3 {
        let mut probe = tokio::net::TcpStream::connect(proxy.admin).await.unwrap();
        probe.write_all(HEALTHZ).await.unwrap();
        let mut answer = Vec::new();
        // Within a kubelet probe's timeout, not once a held one times out (10 s).
        let probe_timeout = std::time::Duration::from_secs(2);
        tokio::time::timeout(probe_timeout, probe.read_to_end(&mut answer))
            .await
            .expect("a probe is answered at the cap")
            .unwrap();
        assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"));
    }
    // The oldest was given up for the first probe: the cap holds. (A probe
    // that closes frees its place, so the next may find one without it.)
    for mut oldest in held.drain(..1) {
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(DEADLINE, oldest.read(&mut buf))
            .await
            .expect("the oldest idle connection is closed");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_admin_connections_are_closed_after_idle_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let config = ConfigBuilder::new("http://127.0.0.1:1")
        .server("idle_timeout = \"1s\"")
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    // Kept alive after a scrape, and left open: closed once idle for 1 s
    // (well before the 10 s the header timeout would take).
    let mut held = idle_admin_connections(&proxy, 8).await;
    for conn in &mut held {
        conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: admin\r\n\r\n")
            .await
            .unwrap();
    }
    for mut conn in held {
        let mut seen = Vec::new();
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            conn.read_to_end(&mut seen),
        )
        .await
        .expect("an idle admin connection is closed by the proxy");
        assert!(
            String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 200"),
            "{read:?}"
        );
    }
    // And the listener still answers.
    let r = get(&proxy.admin_url("/healthz")).await.unwrap();
    assert_eq!(r.status, 200);
}
