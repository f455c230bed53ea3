//! The protected request path, end to end: real redis-server (or the memory
//! store), a real upstream, the proxy served in-process, over loopback.

mod support;

use std::time::Duration;

use support::*;

on_every_backend!(
    first_request_is_forwarded_and_relayed,
    replay_is_byte_exact_with_status_and_headers,
    retry_in_flight_gets_409_with_retry_after,
    a_409s_retry_after_is_when_the_first_is_likely_done,
    same_key_different_request_is_422,
    missing_empty_long_and_repeated_keys_are_400,
    malformed_keys_are_400_even_on_optional_routes,
    too_large_body_is_413_and_reserves_nothing,
    optional_route_without_key_is_forwarded_unprotected,
    unprotected_routes_stream_through_untouched,
    quoted_and_bare_spellings_are_the_same_key,
    storm_of_50_same_key_requests_executes_once,
    scope_keeps_principals_apart,
    client_disconnect_does_not_cancel_the_operation,
    binary_64k_and_chunked_2m_bodies_replay_byte_exact,
    hop_by_hop_headers_are_not_relayed_or_stored,
    key_is_forwarded_and_forwarding_headers_added,
    problems_are_rfc9457,
    json_fingerprint_is_exact,
    every_spelling_of_a_protected_path_is_protected;
    current_thread: ttl_expiry_lets_the_key_execute_again,
);

async fn first_request_is_forwarded_and_relayed(backend: Backend) {
    let env = Env::start(backend).await;
    let r = Call::post(&env.url("/v1/payments"))
        .key("k-first")
        .body("amount=10")
        .await;
    assert_eq!(r.status, 201);
    assert_eq!(r.header("location"), Some("/things/1"));
    assert_eq!(
        r.header("idempotent-replayed"),
        None,
        "a fresh answer is not marked as a replay"
    );
    assert_eq!(
        r.header("set-cookie"),
        Some("session=secret-session; HttpOnly"),
        "the first answer is relayed whole"
    );
    assert_eq!(r.json()["body_len"], 9);
    assert_eq!(env.upstream.hits(), 1);
}

async fn replay_is_byte_exact_with_status_and_headers(backend: Backend) {
    let env = Env::start(backend).await;
    let first = Call::post(&env.url("/v1/payments"))
        .key("k-replay")
        .body("{\"a\":1}")
        .await;
    let again = Call::post(&env.url("/v1/payments"))
        .key("k-replay")
        .body("{\"a\":1}")
        .await;
    assert_eq!(env.upstream.hits(), 1, "a retry must not execute again");
    assert_eq!(again.status, 201);
    assert!(again.is_replay());
    assert_eq!(again.body, first.body);
    for h in ["location", "content-type", "x-custom", "server"] {
        assert_eq!(again.header(h), first.header(h), "header {h}");
    }
    let multi: Vec<_> = again.headers.get_all("x-multi").iter().collect();
    assert_eq!(multi, ["one", "two"], "repeated headers keep their order");
    assert_eq!(
        again.header("set-cookie"),
        None,
        "a replay must not hand out a session"
    );
    assert_eq!(
        again.header("content-length"),
        Some(first.body.len().to_string().as_str())
    );
    assert!(again.header("date").is_some(), "Date is regenerated");
    // A third retry is still a replay.
    let third = Call::post(&env.url("/v1/payments"))
        .key("k-replay")
        .body("{\"a\":1}")
        .await;
    assert!(third.is_replay());
    assert_eq!(third.body, first.body);
    assert_eq!(env.upstream.hits(), 1);
}

async fn retry_in_flight_gets_409_with_retry_after(backend: Backend) {
    let env = Env::start(backend).await;
    let url = env.url("/v1/payments");
    let first = Call::post(&url)
        .key("k-busy")
        .header("x-test-hold", "1")
        .spawn("x");
    env.upstream.wait_hits(1).await;
    let retry = Call::post(&url)
        .key("k-busy")
        .header("x-test-hold", "1")
        .body("x")
        .await;
    assert_eq!(retry.status, 409);
    let secs: u64 = retry
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .expect("whole seconds");
    assert!(
        (1..=10).contains(&secs),
        "Retry-After {secs} must be within the 10 s lease"
    );
    assert_eq!(retry.json()["retryable"], true);
    env.upstream.release(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    let after = Call::post(&url)
        .key("k-busy")
        .header("x-test-hold", "1")
        .body("x")
        .await;
    assert!(after.is_replay());
    assert_eq!(after.body, first.body);
    assert_eq!(env.upstream.hits(), 1);
}

/// A route whose upstream takes about 1.5 s, with a lease far longer.
const SLOW_ROUTE: &str = r#"
[[routes]]
name = "slow"
path = "/v1/slow"
lease = "30s"
"#;

/// How long the slow route's upstream takes.
const SLOW_MS: &str = "1500";

fn retry_after_secs(r: &Resp) -> u64 {
    r.header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("a Retry-After in whole seconds: {r:?}"))
}

/// A 409's `Retry-After` is an estimate of when the first request will be
/// done — the route's typical upstream duration less what the first has
/// run — not the remaining 30 s lease, which clients wait to the second.
async fn a_409s_retry_after_is_when_the_first_is_likely_done(backend: Backend) {
    let env = Env::with_routes(backend, SLOW_ROUTE).await;
    let url = env.url("/v1/slow");
    let slow = |key: &str| Call::post(&url).key(key).header("x-test-delay-ms", SLOW_MS);
    // Before anything was measured: the shortest, 1 s.
    let first = slow("k-unmeasured").spawn("x");
    env.upstream.wait_hits(1).await;
    let r = slow("k-unmeasured").body("x").await;
    assert_eq!(r.status, 409);
    assert_eq!(retry_after_secs(&r), 1, "unmeasured: {r:?}");
    assert_eq!(first.await.unwrap().status, 201);

    // Measured (1.5 s), a duplicate soon after the first: 2 s (1 if it came late).
    let first = slow("k-measured").spawn("x");
    env.upstream.wait_hits(2).await;
    let r = slow("k-measured").body("x").await;
    assert_eq!(r.status, 409);
    let secs = retry_after_secs(&r);
    assert!(
        (1..=2).contains(&secs),
        "Retry-After {secs}: when the 1.5 s first is likely done, not the 30 s lease"
    );
    assert!(r.json()["detail"]
        .as_str()
        .unwrap()
        .contains(&format!("retry after {secs} s")));
    assert_eq!(first.await.unwrap().status, 201);
}

/// urllib3's `Retry` (409 in `status_forcelist`) waits what `Retry-After`
/// says: while a 1.5 s first request runs, its retries get the replay within
/// a few seconds, not after the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn urllib3_retrying_a_409_gets_the_replay_within_seconds() {
    let env = Env::with_routes(Backend::Redis, SLOW_ROUTE).await;
    let url = env.url("/v1/slow");
    let slow = |key: &str| Call::post(&url).key(key).header("x-test-delay-ms", SLOW_MS);
    assert_eq!(slow("k-measure").body("x").await.status, 201);
    let first = slow("k-urllib3").spawn("x");
    env.upstream.wait_hits(2).await;
    let out = run_peer("urllib3_retry.py", &[&url, "k-urllib3", "x"]).await;
    let first = first.await.unwrap();
    assert_eq!(out["status"], 201, "{out}");
    assert_eq!(out["replayed"], "true", "{out}");
    assert_eq!(out["body"], String::from_utf8_lossy(&first.body).as_ref());
    assert!(out["retries"].as_u64().unwrap() >= 1, "{out}");
    let elapsed = out["elapsed"].as_f64().unwrap();
    assert!(elapsed < 5.0, "urllib3 waited {elapsed:.2} s: {out}");
    assert_eq!(env.upstream.hits(), 2);
    eprintln!(
        "urllib3: {} retries, the replay after {elapsed:.2} s",
        out["retries"]
    );
}

async fn same_key_different_request_is_422(backend: Backend) {
    let env = Env::start(backend).await;
    let ok = Call::post(&env.url("/v1/payments"))
        .key("k-reuse")
        .body("amount=10")
        .await;
    assert_eq!(ok.status, 201);
    let body = Call::post(&env.url("/v1/payments"))
        .key("k-reuse")
        .body("amount=99")
        .await;
    assert_eq!(body.status, 422);
    assert_eq!(body.json()["type"], "idempotency-key-reused");
    let query = Call::post(&env.url("/v1/payments?x=1"))
        .key("k-reuse")
        .body("amount=10")
        .await;
    assert_eq!(query.status, 422, "the query is part of the fingerprint");
    // The store key does not depend on the route: the same key on another endpoint is the same operation.
    let other_route = Call::post(&env.url("/v1/orders/7"))
        .key("k-reuse")
        .body("amount=10")
        .await;
    assert_eq!(other_route.status, 422);
    assert_eq!(env.upstream.hits(), 1);
    // The original still replays.
    assert!(Call::post(&env.url("/v1/payments"))
        .key("k-reuse")
        .body("amount=10")
        .await
        .is_replay());
}

async fn missing_empty_long_and_repeated_keys_are_400(backend: Backend) {
    let env = Env::start(backend).await;
    let url = env.url("/v1/payments");
    let missing = Call::post(&url).body("x").await;
    assert_eq!(missing.status, 400);
    assert_eq!(missing.json()["type"], "idempotency-key-missing");
    assert!(String::from_utf8_lossy(&missing.body).contains("section-2.1"));
    for bad in ["", "\"\"", &"a".repeat(256)] {
        let r = Call::post(&url).key(bad).body("x").await;
        assert_eq!(r.status, 400, "key {bad:?}");
        assert_eq!(r.json()["type"], "idempotency-key-invalid");
    }
    assert_eq!(
        Call::post(&url)
            .key(&"a".repeat(255))
            .body("x")
            .await
            .status,
        201,
        "255 is allowed"
    );
    // Per-route limit, counted on the decoded key.
    let small = env.url("/v1/small");
    assert_eq!(
        Call::post(&small)
            .key(&"b".repeat(17))
            .body("x")
            .await
            .status,
        400
    );
    assert_eq!(
        Call::post(&small)
            .key(&format!("\"{}\"", "b".repeat(16)))
            .body("x")
            .await
            .status,
        201
    );
    // Two header lines.
    let two = raw(
        env.proxy.addr,
        b"POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: a1\r\nIdempotency-Key: a2\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx",
    )
    .await;
    assert_eq!(raw_status(&two), 400, "{two}");
    assert_eq!(
        env.upstream.hits(),
        2,
        "only the two valid requests reached the upstream"
    );
}

async fn malformed_keys_are_400_even_on_optional_routes(backend: Backend) {
    let env = Env::start(backend).await;
    for bad in [
        "a,b",
        "\"a\";p=1",
        "a;p=1",
        "\"unterminated",
        "with space",
        "\"a\", \"b\"",
    ] {
        for path in ["/v1/payments", "/v1/optional"] {
            let r = Call::post(&env.url(path)).key(bad).body("x").await;
            assert_eq!(r.status, 400, "{path} with key {bad:?}");
        }
    }
    assert_eq!(env.upstream.hits(), 0);
}

async fn too_large_body_is_413_and_reserves_nothing(backend: Backend) {
    let env = Env::start(backend).await;
    let url = env.url("/v1/small");
    let big = vec![b'x'; 1025];
    let r = Call::post(&url).key("k-big").body(big.clone()).await;
    assert_eq!(r.status, 413);
    assert_eq!(r.json()["type"], "request-too-large");
    // Without Content-Length (chunked), the cap holds too.
    let chunked = raw(
        env.proxy.addr,
        format!(
            "POST /v1/small HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-big\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n400\r\n{}\r\n400\r\n{}\r\n0\r\n\r\n",
            "y".repeat(1024),
            "y".repeat(1024)
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(raw_status(&chunked), 413, "{chunked}");
    assert_eq!(env.upstream.hits(), 0);
    if let Some(keys) = env.store_keys().await {
        assert!(keys.is_empty(), "nothing reserved: {keys:?}");
    }
    // The key is still free: a request within the limit executes.
    let ok = Call::post(&url).key("k-big").body("small").await;
    assert_eq!(ok.status, 201);
    assert!(!ok.is_replay());
    assert_eq!(env.upstream.hits(), 1);
}

async fn optional_route_without_key_is_forwarded_unprotected(backend: Backend) {
    let env = Env::start(backend).await;
    let url = env.url("/v1/optional");
    assert_eq!(Call::post(&url).body("x").await.status, 201);
    assert_eq!(Call::post(&url).body("x").await.status, 201);
    assert_eq!(
        env.upstream.hits(),
        2,
        "without a key every request executes"
    );
    if let Some(keys) = env.store_keys().await {
        assert!(keys.is_empty());
    }
    // With a key it is protected.
    Call::post(&url).key("k-opt").body("x").await;
    assert!(Call::post(&url).key("k-opt").body("x").await.is_replay());
    assert_eq!(env.upstream.hits(), 3);
}

async fn unprotected_routes_stream_through_untouched(backend: Backend) {
    let env = Env::start(backend).await;
    // A GET on a POST-only route, and paths no route matches, with a key: not protected.
    for (method, path) in [
        ("GET", "/v1/payments"),
        ("POST", "/v1/other"),
        ("POST", "/v1/payments/x"),
    ] {
        let r = Call::new(method, &env.url(path))
            .key("k-pass")
            .body("x")
            .await;
        assert_eq!(r.status, 201, "{method} {path}");
        assert!(!r.is_replay());
        assert_eq!(
            r.header("set-cookie"),
            Some("session=secret-session; HttpOnly")
        );
    }
    // Twice the same: executed twice.
    Call::post(&env.url("/v1/other"))
        .key("k-pass")
        .body("x")
        .await;
    assert_eq!(env.upstream.hits(), 4);
    if let Some(keys) = env.store_keys().await {
        assert!(
            keys.is_empty(),
            "pass-through touches no store key: {keys:?}"
        );
    }
    // A large chunked answer streams through whole.
    let r = Call::new("GET", &env.url("/download"))
        .header("x-test-body-bytes", "3000000")
        .header("x-test-chunked", "1")
        .send()
        .await;
    assert_eq!(r.body, binary(3_000_000));
    let seen = env.upstream.seen();
    assert_eq!(seen[0].body.as_ref(), b"x");
    assert_eq!(seen[0].method, "GET");
}

/// On memory the store's clock is the runtime's: the 2 s pass in paused time (one
/// runtime, so `work_stealing`). Redis keeps its own clock: there they pass for real.
async fn ttl_expiry_lets_the_key_execute_again(backend: Backend) {
    let env = Env::builder(backend)
        .server("runtime = \"work_stealing\"")
        .start()
        .await;
    let url = env.url("/v1/short");
    let first = Call::post(&url).key("k-ttl").body("x").await;
    assert_eq!(first.status, 201);
    assert!(Call::post(&url).key("k-ttl").body("x").await.is_replay());
    if let Some(r) = &env.redis {
        let keys = r.keys().await;
        let pttl: i64 = r.cmd(&["PTTL", &keys[0]]).await;
        assert!(
            pttl > 0 && pttl <= 2000,
            "the record carries the route's 2 s TTL, got {pttl} ms"
        );
    }
    if backend == Backend::Memory {
        // Nothing in flight: the clock may jump (see tests/support/inprocess.rs).
        tokio::time::pause();
        tokio::time::sleep(Duration::from_secs(2)).await;
        tokio::time::resume();
    }
    // After the TTL the same key executes again.
    let fresh = eventually("the record to expire", DEADLINE, || {
        let url = url.clone();
        async move {
            let r = Call::post(&url).key("k-ttl").body("x").await;
            (!r.is_replay()).then_some(r)
        }
    })
    .await;
    assert_eq!(fresh.status, 201);
    assert_eq!(env.upstream.hits(), 2);
    assert_ne!(fresh.body, first.body);
}

async fn quoted_and_bare_spellings_are_the_same_key(backend: Backend) {
    let env = Env::start(backend).await;
    let url = env.url("/v1/payments");
    let bare = Call::post(&url)
        .key("8e03978e-40d5-43e8-bc93-6894a57f9324")
        .body("x")
        .await;
    let quoted = Call::post(&url)
        .key("\"8e03978e-40d5-43e8-bc93-6894a57f9324\"")
        .body("x")
        .await;
    assert!(quoted.is_replay());
    assert_eq!(quoted.body, bare.body);
    assert_eq!(env.upstream.hits(), 1);
}

async fn storm_of_50_same_key_requests_executes_once(backend: Backend) {
    let env = Env::start(backend).await;
    let url = env.url("/v1/payments");
    let mut tasks = Vec::new();
    for _ in 0..50 {
        tasks.push(
            Call::post(&url)
                .key("k-storm")
                .header("x-test-delay-ms", "200")
                .spawn("pay"),
        );
    }
    let mut fresh = 0;
    let mut replays = 0;
    let mut conflicts = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            201 if r.is_replay() => replays += 1,
            201 => fresh += 1,
            409 => conflicts += 1,
            other => panic!("unexpected status {other}: {:?}", r.body),
        }
    }
    assert_eq!(fresh, 1, "exactly one answer comes from the upstream");
    assert_eq!(replays + conflicts, 49);
    assert_eq!(env.upstream.hits(), 1, "exactly one execution");
}

async fn scope_keeps_principals_apart(backend: Backend) {
    let env = Env::start(backend).await;
    let url = env.url("/v1/payments");
    let alice = Call::post(&url)
        .key("k-shared")
        .header("authorization", "Bearer alice")
        .body("x")
        .await;
    let bob = Call::post(&url)
        .key("k-shared")
        .header("authorization", "Bearer bob")
        .body("x")
        .await;
    assert!(!bob.is_replay(), "bob must not get alice's answer");
    assert_ne!(alice.body, bob.body);
    assert_eq!(env.upstream.hits(), 2);
    let alice2 = Call::post(&url)
        .key("k-shared")
        .header("authorization", "Bearer alice")
        .body("x")
        .await;
    assert!(alice2.is_replay());
    assert_eq!(alice2.body, alice.body);
    // No Authorization and an empty one are the same principal.
    Call::post(&url).key("k-anon").body("x").await;
    let empty = Call::post(&url)
        .key("k-anon")
        .header("authorization", "")
        .body("x")
        .await;
    assert!(empty.is_replay());
    assert_eq!(env.upstream.hits(), 3);
}

async fn client_disconnect_does_not_cancel_the_operation(backend: Backend) {
    let env = Env::start(backend).await;
    {
        use tokio::io::AsyncWriteExt;
        let mut s = tokio::net::TcpStream::connect(env.proxy.addr)
            .await
            .unwrap();
        s.write_all(
            b"POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-gone\r\nx-test-hold: 1\r\nContent-Length: 3\r\n\r\npay",
        )
        .await
        .unwrap();
        env.upstream.wait_hits(1).await;
        // The client goes away while the upstream works.
    }
    env.upstream.release(1);
    let url = env.url("/v1/payments");
    let replay = eventually("the record of the abandoned request", DEADLINE, || {
        let url = url.clone();
        async move {
            let r = Call::post(&url)
                .key("k-gone")
                .header("x-test-hold", "1")
                .body("pay")
                .await;
            assert!(r.status == 409 || r.is_replay(), "got {}", r.status);
            r.is_replay().then_some(r)
        }
    })
    .await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.json()["n"], 1);
    assert_eq!(env.upstream.hits(), 1, "the operation ran once, to its end");
}

async fn binary_64k_and_chunked_2m_bodies_replay_byte_exact(backend: Backend) {
    let env = Env::start(backend).await;
    let url = env.url("/v1/payments");
    for (key, len, chunked) in [("k-64k", 64 * 1024, false), ("k-2m", 2 * 1024 * 1024, true)] {
        let call = || {
            let c = Call::post(&url)
                .key(key)
                .header("x-test-body-bytes", &len.to_string());
            if chunked {
                c.header("x-test-chunked", "1")
            } else {
                c
            }
        };
        let first = call().body("x").await;
        assert_eq!(first.body, binary(len), "first answer, {len} bytes");
        let again = call().body("x").await;
        assert!(again.is_replay());
        assert_eq!(again.body, binary(len), "replay, {len} bytes");
        assert_eq!(
            again.header("content-type"),
            Some("application/octet-stream")
        );
        assert_eq!(
            again.header("content-length"),
            Some(len.to_string().as_str())
        );
    }
    assert_eq!(env.upstream.hits(), 2);
}

async fn hop_by_hop_headers_are_not_relayed_or_stored(backend: Backend) {
    let env = Env::start(backend).await;
    let url = env.url("/v1/payments");
    let call = || Call::post(&url).key("k-hop").header("x-test-hop", "1");
    let first = call().body("x").await;
    assert_eq!(first.header("x-hop-secret"), None);
    assert_eq!(first.header("keep-alive"), None);
    let again = call().body("x").await;
    assert!(again.is_replay());
    assert_eq!(again.header("x-hop-secret"), None);
    assert_eq!(again.header("keep-alive"), None);
    // And towards the upstream.
    Call::post(&env.url("/v1/other"))
        .header("connection", "x-drop-me")
        .header("x-drop-me", "1")
        .header("te", "trailers")
        .header("proxy-authorization", "Basic secret")
        .body("x")
        .await;
    let seen = env.upstream.seen();
    let h = &seen.last().unwrap().headers;
    for gone in ["x-drop-me", "te", "proxy-authorization"] {
        assert!(!h.contains_key(gone), "{gone} reached the upstream");
    }
}

async fn key_is_forwarded_and_forwarding_headers_added(backend: Backend) {
    let env = Env::start(backend).await;
    Call::post(&env.url("/v1/payments"))
        .key("\"k-fwd\"")
        .header("x-forwarded-for", "203.0.113.9")
        .body("x")
        .await;
    Call::new("GET", &env.url("/v1/anything")).send().await;
    let seen = env.upstream.seen();
    let protected = &seen[0].headers;
    assert_eq!(
        protected["idempotency-key"], "\"k-fwd\"",
        "the key header reaches the upstream unchanged"
    );
    assert_eq!(protected["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert_eq!(protected["x-forwarded-proto"], "http");
    let passthrough = &seen[1].headers;
    assert_eq!(passthrough["x-forwarded-for"], "127.0.0.1");
    assert_eq!(passthrough["x-forwarded-proto"], "http");
    assert!(
        !passthrough.contains_key("x-request-id"),
        "pass-through changes nothing but X-Forwarded-*"
    );
    assert!(
        protected.contains_key("x-request-id"),
        "a protected request carries its request id upstream"
    );
}

async fn problems_are_rfc9457(backend: Backend) {
    let env = Env::start(backend).await;
    let r = Call::post(&env.url("/v1/payments")).body("x").await;
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.header("cache-control"), Some("no-store"));
    let v = r.json();
    for member in ["type", "title", "detail", "instance"] {
        assert!(v[member].is_string(), "{member} in {v}");
    }
    assert_eq!(v["status"], 400);
    assert_eq!(v["retryable"], false);
    assert!(v["instance"].as_str().unwrap().starts_with("urn:uuid:"));
    // The instance names the request in the log.
    let id = v["instance"]
        .as_str()
        .unwrap()
        .trim_start_matches("urn:uuid:")
        .to_string();
    settle_logs(&env.proxy, &id).await;
}

async fn settle_logs(proxy: &Proxy, request_id: &str) {
    let found = eventually("the request's log line", Duration::from_secs(5), || {
        let logs = proxy.logs();
        let id = request_id.to_string();
        async move {
            logs.into_iter().find(|l| l.contains(&id)).map(|l| {
                let v: serde_json::Value = serde_json::from_str(&l).unwrap();
                v
            })
        }
    })
    .await;
    assert_eq!(found["outcome"], "missing_key");
    assert_eq!(found["status"], 400);
    assert_eq!(found["route"], "payments");
}

/// `fingerprint_body = "json"` merges only reformatted bodies: a duplicate member, an integer
/// beyond 64 bits or a decimal beyond double precision is another request (issue 10, fault 2).
async fn json_fingerprint_is_exact(backend: Backend) {
    let env = Env::with_routes(
        backend,
        r#"
[[routes]]
name = "json"
path = "/v1/json"
fingerprint_body = "json"
"#,
    )
    .await;
    let post = |key: &str, body: &str| {
        Call::post(&env.url("/v1/json"))
            .key(key)
            .header("content-type", "application/json")
            .body(body.to_string())
    };
    let first = post("k-dup", r#"{"amount":1000,"currency":"EUR"}"#).await;
    assert_eq!(first.status, 201);
    let dup = post("k-dup", r#"{"amount":1,"amount":1000,"currency":"EUR"}"#).await;
    assert_eq!(dup.status, 422, "a duplicate member is another request");
    assert_eq!(dup.json()["type"], "idempotency-key-reused");
    let same = post(
        "k-dup",
        "{ \"currency\" : \"\\u0045UR\",\n  \"\\u0061mount\": 1000 }",
    )
    .await;
    assert!(
        same.is_replay(),
        "reformatted, reordered and escaped: the same request"
    );
    assert_eq!(same.body, first.body);

    for (key, a, b) in [
        ("k-big", "100000000000000000000", "100000000000000000001"),
        ("k-dec", "0.3", "0.30000000000000000001"),
        ("k-text", "1", "1.0"),
    ] {
        let first = post(key, &format!(r#"{{"amount":{a}}}"#)).await;
        assert_eq!(first.status, 201, "{key}");
        let other = post(key, &format!(r#"{{"amount":{b}}}"#)).await;
        assert_eq!(other.status, 422, "{a} and {b} are different amounts");
        assert!(post(key, &format!(r#"{{ "amount" : {a} }}"#))
            .await
            .is_replay());
    }
    assert_eq!(env.upstream.hits(), 4);
}

/// Paths many upstream frameworks take for `/v1/payments` (§3): each is
/// protected like it, and the upstream still gets the request-target as sent.
async fn every_spelling_of_a_protected_path_is_protected(backend: Backend) {
    let env = Env::start(backend).await;
    let spellings = [
        "/v1/payments/",
        "//v1/payments",
        "/v1//payments",
        "/v1/%70ayments",
        "/v1/./payments",
        "/v1/x/../payments",
        "/v1/%2e/payments",
        // Broadly, as some frameworks read them: %2F decoded, ;params cut, any case.
        "/v1%2Fpayments",
        "/v1/payments;jsessionid=7",
        "/V1/Payments",
    ];
    for path in spellings {
        let r = Call::post(&env.url(path)).body("x").await;
        assert_eq!(r.status, 400, "{path}: protected, so a key is required");
    }
    assert_eq!(env.upstream.hits(), 0);
    for (i, path) in spellings.iter().enumerate() {
        let key = format!("k-spelling-{i}");
        assert_eq!(
            Call::post(&env.url(path)).key(&key).body("x").await.status,
            201
        );
        let again = Call::post(&env.url(path)).key(&key).body("x").await;
        assert!(again.is_replay(), "{path}");
    }
    assert_eq!(env.upstream.hits(), spellings.len(), "each ran once");
    let targets: Vec<String> = env.upstream.seen().into_iter().map(|s| s.target).collect();
    assert_eq!(targets, spellings, "forwarded as the client sent them");
    // The fingerprint takes the path as sent: one key under two spellings is 422, never a second run.
    let r = Call::post(&env.url("/v1/payments"))
        .key("k-spelling-0")
        .body("x")
        .await;
    assert_eq!(r.status, 422);
    assert_eq!(env.upstream.hits(), spellings.len());
}
