//! Failure semantics: slow and broken upstreams, store faults, leases,
//! concurrency policies and shadow mode — counted at the upstream and seen in the store.

mod support;

use support::relay::Fault;
use support::*;

on_every_backend!(
    lease_renewal_keeps_a_slow_call_to_one_execution,
    connect_failure_is_502_and_releases_the_key,
    release_statuses_are_relayed_and_free_the_key,
    upstream_timeout_is_504_stored_and_replayed,
    upstream_timeout_with_release_lets_a_retry_execute,
    reset_after_the_request_was_sent_is_502_stored,
    response_too_large_to_store_is_relayed_and_retries_get_410,
    wait_mode_replays_the_first_answer,
    wait_mode_executes_when_the_first_releases_the_key,
    wait_mode_gives_409_after_wait_timeout,
    shadow_mode_forwards_everything_and_counts,
    slow_request_body_is_408_and_reserves_nothing,
);

const FAILURE_ROUTES: &str = r#"
[defaults]
lease = "10s"

[[routes]]
name = "payments"
path = "/v1/payments"

[[routes]]
name = "slow"
path = "/v1/slow"
lease = "300ms"

[[routes]]
name = "release"
path = "/v1/release"
unknown_outcome = "release"

[[routes]]
name = "tiny-response"
path = "/v1/tiny"
max_response_body = "64KiB"

[[routes]]
name = "wait"
path = "/v1/wait"
concurrent = "wait"
wait_timeout = "10s"

[[routes]]
name = "wait-short"
path = "/v1/wait-short"
concurrent = "wait"
wait_timeout = "300ms"

[[routes]]
name = "shadow"
path = "/v1/shadow"
mode = "shadow"

[[routes]]
name = "bypass"
path = "/v1/bypass"
on_store_error = "pass"
"#;

fn env(backend: Backend) -> EnvBuilder {
    Env::builder(backend).routes(FAILURE_ROUTES)
}

async fn lease_renewal_keeps_a_slow_call_to_one_execution(backend: Backend) {
    let env = env(backend).start().await;
    let url = env.url("/v1/slow");
    // The upstream takes five leases; the owner renews, so no retry may steal the key.
    let first = Call::post(&url)
        .key("k-slow")
        .header("x-test-delay-ms", "1500")
        .spawn("x");
    env.upstream.wait_hits(1).await;
    let mut retries = 0;
    while !first.is_finished() {
        let r = Call::post(&url).key("k-slow").body("x").await;
        if r.is_replay() {
            break; // the first finished between the check and the retry
        }
        assert_eq!(
            r.status, 409,
            "the key must stay reserved while the upstream works"
        );
        let secs: u64 = r.header("retry-after").unwrap().parse().unwrap();
        assert_eq!(
            secs, 1,
            "Retry-After is at most the remaining 300 ms lease, rounded up"
        );
        retries += 1;
        tokio::time::sleep(std::time::Duration::from_millis(50)).await; // pacing, not synchronisation
    }
    assert!(
        retries > 5,
        "retries ran while the call was slow ({retries})"
    );
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    let again = Call::post(&url).key("k-slow").body("x").await;
    assert!(again.is_replay());
    assert_eq!(env.upstream.hits(), 1);
    assert_eq!(
        env.metric("idemproxy_lease_lost_total{route=\"slow\"}")
            .await,
        0.0
    );
}

async fn connect_failure_is_502_and_releases_the_key(backend: Backend) {
    // A port nobody listens on: connection refused.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_addr = closed.local_addr().unwrap();
    drop(closed);
    let env2 = env_with_upstream(backend, &format!("http://{closed_addr}")).await;
    let url = env2.url("/v1/payments");
    let r = Call::post(&url).key("k-refused").body("x").await;
    assert_eq!(r.status, 502);
    assert_eq!(r.json()["type"], "upstream-unreachable");
    assert_eq!(r.json()["retryable"], true);
    if let Some(keys) = env2.store_keys().await {
        assert!(keys.is_empty(), "the key was released: {keys:?}");
    }
    // The retry is not a replay of the 502: it tries again (and fails again).
    let again = Call::post(&url).key("k-refused").body("x").await;
    assert_eq!(again.status, 502);
    assert!(!again.is_replay());
    assert_eq!(
        env2.metric("idemproxy_requests_total{route=\"payments\",outcome=\"upstream_error\"}")
            .await,
        2.0
    );
}

async fn env_with_upstream(backend: Backend, url: &str) -> Env {
    env(backend).upstream_url(url).start().await
}

async fn release_statuses_are_relayed_and_free_the_key(backend: Backend) {
    let env = env(backend).start().await;
    let url = env.url("/v1/payments");
    let busy = Call::post(&url)
        .key("k-429")
        .header("x-test-status", "429")
        .body("x")
        .await;
    assert_eq!(busy.status, 429, "the upstream's own answer is relayed");
    assert_eq!(busy.header("content-type"), Some("application/json"));
    assert!(!busy.is_replay());
    // The retry executes again, and this time succeeds and is stored.
    let ok = Call::post(&url).key("k-429").body("x").await;
    assert_eq!(ok.status, 201);
    assert!(!ok.is_replay());
    assert!(Call::post(&url).key("k-429").body("x").await.is_replay());
    assert_eq!(env.upstream.hits(), 2);
    assert_eq!(
        env.metric("idemproxy_requests_total{route=\"payments\",outcome=\"released\"}")
            .await,
        1.0
    );
}

async fn upstream_timeout_is_504_stored_and_replayed(backend: Backend) {
    let env = env(backend)
        .server("upstream_timeout = \"300ms\"")
        .start()
        .await;
    let url = env.url("/v1/payments");
    let r = Call::post(&url)
        .key("k-timeout")
        .header("x-test-delay-ms", "2000")
        .body("x")
        .await;
    assert_eq!(r.status, 504);
    assert_eq!(r.json()["type"], "upstream-timeout");
    assert_eq!(r.json()["retryable"], false);
    let again = Call::post(&url).key("k-timeout").body("x").await;
    assert_eq!(
        again.status, 504,
        "the unknown outcome is stored: never a second execution"
    );
    assert!(again.is_replay());
    assert_eq!(again.body, r.body);
    assert_eq!(env.upstream.hits(), 1);
}

async fn upstream_timeout_with_release_lets_a_retry_execute(backend: Backend) {
    let env = env(backend)
        .server("upstream_timeout = \"300ms\"")
        .start()
        .await;
    let url = env.url("/v1/release");
    let r = Call::post(&url)
        .key("k-rel")
        .header("x-test-delay-ms", "2000")
        .body("x")
        .await;
    assert_eq!(r.status, 504);
    assert_eq!(r.json()["retryable"], true, "the key was released");
    let again = Call::post(&url).key("k-rel").body("x").await;
    assert_eq!(again.status, 201);
    assert!(!again.is_replay());
    assert_eq!(env.upstream.hits(), 2);
}

async fn reset_after_the_request_was_sent_is_502_stored(backend: Backend) {
    let env = env(backend).upstream_relay().start().await;
    env.upstream_relay
        .as_ref()
        .unwrap()
        .set(Fault::ResetOnReply);
    let url = env.url("/v1/payments");
    let r = Call::post(&url).key("k-reset").body("x").await;
    assert_eq!(r.status, 502);
    assert_eq!(r.json()["type"], "upstream-reset");
    assert_eq!(r.json()["retryable"], false);
    assert_eq!(env.upstream.hits(), 1, "the upstream did execute");
    env.upstream_relay.as_ref().unwrap().set(Fault::Pass);
    let again = Call::post(&url).key("k-reset").body("x").await;
    assert_eq!(again.status, 502);
    assert!(
        again.is_replay(),
        "the unknown outcome is replayed, not re-executed"
    );
    assert_eq!(env.upstream.hits(), 1);
}

async fn response_too_large_to_store_is_relayed_and_retries_get_410(backend: Backend) {
    let env = env(backend).start().await;
    let url = env.url("/v1/tiny");
    let call = || {
        Call::post(&url)
            .key("k-huge")
            .header("x-test-body-bytes", "300000")
            .header("x-test-chunked", "1")
    };
    let first = call().body("x").await;
    assert_eq!(first.status, 201);
    assert_eq!(
        first.body,
        binary(300_000),
        "the whole answer reaches the first client"
    );
    let again = call().body("x").await;
    assert_eq!(again.status, 410);
    assert_eq!(again.json()["type"], "response-not-stored");
    assert!(again.is_replay());
    assert_eq!(again.json()["retryable"], false);
    assert_eq!(env.upstream.hits(), 1, "never a second execution");
    assert_eq!(
        env.metric("idemproxy_requests_total{route=\"tiny-response\",outcome=\"not_stored\"}")
            .await,
        1.0
    );
}

async fn wait_mode_replays_the_first_answer(backend: Backend) {
    let env = env(backend).start().await;
    let url = env.url("/v1/wait");
    let first = Call::post(&url)
        .key("k-wait")
        .header("x-test-hold", "1")
        .spawn("x");
    env.upstream.wait_hits(1).await;
    let second = Call::post(&url).key("k-wait").spawn("x");
    env.upstream.release(1);
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(first.status, 201);
    assert_eq!(second.status, 201);
    assert!(
        second.is_replay(),
        "the duplicate waited and got the replay"
    );
    assert_eq!(second.body, first.body);
    assert_eq!(env.upstream.hits(), 1);
}

async fn wait_mode_executes_when_the_first_releases_the_key(backend: Backend) {
    let env = env(backend).start().await;
    let url = env.url("/v1/wait");
    let first = Call::post(&url)
        .key("k-wait-rel")
        .header("x-test-hold", "1")
        .header("x-test-status", "503")
        .spawn("x");
    env.upstream.wait_hits(1).await;
    let second = Call::post(&url).key("k-wait-rel").spawn("x");
    env.upstream.release(1);
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(first.status, 503);
    assert_eq!(
        second.status, 201,
        "the waiter reserved the released key and executed"
    );
    assert!(!second.is_replay());
    assert_eq!(env.upstream.hits(), 2);
}

async fn wait_mode_gives_409_after_wait_timeout(backend: Backend) {
    let env = env(backend).start().await;
    let url = env.url("/v1/wait-short");
    let first = Call::post(&url)
        .key("k-wait-to")
        .header("x-test-hold", "1")
        .spawn("x");
    env.upstream.wait_hits(1).await;
    let second = Call::post(&url).key("k-wait-to").body("x").await;
    assert_eq!(second.status, 409);
    assert!(second.header("retry-after").is_some());
    env.upstream.release(1);
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(env.upstream.hits(), 1);
}

async fn shadow_mode_forwards_everything_and_counts(backend: Backend) {
    let env = env(backend).start().await;
    let url = env.url("/v1/shadow");
    let a = Call::post(&url).key("k-shadow").body("x").await;
    let b = Call::post(&url).key("k-shadow").body("x").await;
    assert_eq!((a.status, b.status), (201, 201));
    assert!(!b.is_replay(), "shadow mode never answers for the upstream");
    let mismatch = Call::post(&url).key("k-shadow").body("other").await;
    assert_eq!(mismatch.status, 201);
    let missing = Call::post(&url).body("x").await;
    assert_eq!(missing.status, 201);
    let invalid = Call::post(&url).key("a,b").body("x").await;
    assert_eq!(invalid.status, 201);
    assert_eq!(env.upstream.hits(), 5, "every request reached the upstream");
    for (outcome, n) in [
        ("replayed", 1.0),
        ("mismatch", 1.0),
        ("missing_key", 1.0),
        ("invalid_key", 1.0),
    ] {
        let series =
            format!("idemproxy_shadow_outcomes_total{{route=\"shadow\",outcome=\"{outcome}\"}}");
        assert_eq!(env.metric(&series).await, n, "{series}");
    }
}

async fn slow_request_body_is_408_and_reserves_nothing(backend: Backend) {
    use tokio::io::AsyncWriteExt;
    let env = env(backend)
        .server("body_read_timeout = \"300ms\"")
        .start()
        .await;
    let mut s = tokio::net::TcpStream::connect(env.proxy.addr)
        .await
        .unwrap();
    s.write_all(b"POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-slowbody\r\nContent-Length: 10\r\n\r\nabc")
        .await
        .unwrap();
    let mut out = Vec::new();
    let read = tokio::time::timeout(DEADLINE, async {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 4096];
        loop {
            let n = s.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
            if out.windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
    });
    read.await.expect("an answer before the deadline");
    assert_eq!(raw_status(&String::from_utf8_lossy(&out)), 408);
    assert_eq!(env.upstream.hits(), 0);
    if let Some(keys) = env.store_keys().await {
        assert!(keys.is_empty());
    }
}

// ---------------------------------------------------------------------------
// Redis only: faults between the proxy and the store, and several processes.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_blackhole_rejects_with_503_then_recovers() {
    let env = env(Backend::Redis)
        .store("op_timeout = \"200ms\"")
        .redis_relay()
        .start()
        .await;
    let relay = env.redis_relay.as_ref().unwrap();
    let url = env.url("/v1/payments");
    relay.set(Fault::Blackhole);
    let r = Call::post(&url).key("k-outage").body("x").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["type"], "store-unavailable");
    assert!(r.header("retry-after").is_some());
    assert_eq!(
        env.upstream.hits(),
        0,
        "never forwarded without a reservation"
    );
    assert_eq!(env.metric("idemproxy_store_up").await, 0.0);
    // Bypass route: forwarded unprotected and counted.
    let bypass = Call::post(&env.url("/v1/bypass"))
        .key("k-bypass")
        .body("x")
        .await;
    assert_eq!(bypass.status, 201);
    assert_eq!(
        env.metric("idemproxy_requests_total{route=\"bypass\",outcome=\"store_bypass\"}")
            .await,
        1.0
    );
    assert_eq!(
        get(&env.proxy.admin_url("/readyz")).await.unwrap().status,
        200,
        "an outage after start keeps readiness"
    );
    // Recovery by itself.
    relay.set(Fault::Pass);
    let ok = eventually("the store to come back", DEADLINE, || {
        let url = url.clone();
        async move {
            let r = Call::post(&url).key("k-outage").body("x").await;
            (r.status == 201).then_some(r)
        }
    })
    .await;
    assert!(!ok.is_replay());
    let again = Call::post(&url).key("k-outage").body("x").await;
    assert!(
        again.is_replay(),
        "{} {}",
        again.status,
        String::from_utf8_lossy(&again.body)
    );
    assert_eq!(
        env.upstream.hits(),
        2,
        "the bypassed request and the recovered one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_gives_503_then_recovers_without_a_proxy_restart() {
    let mut env = env(Backend::Redis)
        .store("op_timeout = \"200ms\"")
        .start()
        .await;
    let url = env.url("/v1/payments");
    assert_eq!(Call::post(&url).key("k-before").body("x").await.status, 201);
    env.redis.as_mut().unwrap().stop();
    for _ in 0..3 {
        let r = Call::post(&url).key("k-during").body("x").await;
        assert_eq!(r.status, 503);
    }
    env.redis.as_mut().unwrap().restart().await;
    eventually("protected routes to work again", DEADLINE, || {
        let url = url.clone();
        async move { (Call::post(&url).key("k-after").body("x").await.status == 201).then_some(()) }
    })
    .await;
    assert!(
        Call::post(&url).key("k-after").body("x").await.is_replay(),
        "scripts were loaded again"
    );
    assert!(env.proxy.logs().iter().all(|l| !l.contains("panicked")));
    let broke = env
        .proxy
        .wait_log("the store connection broke; connecting again")
        .await;
    assert!(
        broke["error"].as_str().is_some_and(|e| !e.is_empty()),
        "the broken connection is logged with its reason: {broke}"
    );
    assert_eq!(
        env.proxy
            .log_count("the store connection broke; connecting again"),
        1,
        "logged once, not by every request while Redis was away"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_failure_still_answers_the_client_and_is_counted() {
    let env = env(Backend::Redis)
        .store("op_timeout = \"200ms\"")
        .redis_relay()
        .start()
        .await;
    // The "slow" route's lease is 300 ms: completion is retried that long, then given up.
    let url = env.url("/v1/slow");
    let first = Call::post(&url)
        .key("k-nocomplete")
        .header("x-test-hold", "1")
        .spawn("x");
    env.upstream.wait_hits(1).await;
    env.redis_relay.as_ref().unwrap().set(Fault::Blackhole);
    env.upstream.release(1);
    let r = first.await.unwrap();
    assert_eq!(
        r.status, 201,
        "the client gets the upstream's answer although the store is gone"
    );
    // The first completion attempt fails before the answer is sent (and is
    // retried in the background after it): counted, and waited for.
    env.metric_reaching("idemproxy_store_errors_total{op=\"complete\"}", 1.0)
        .await;
    env.proxy
        .wait_log("record could not be stored before the lease ran out")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_shorter_than_the_lease_loses_no_record() {
    let env = env(Backend::Redis)
        .store("op_timeout = \"200ms\"")
        .redis_relay()
        .start()
        .await;
    let relay = env.redis_relay.as_ref().unwrap();
    let url = env.url("/v1/payments"); // lease 10 s
    let first = Call::post(&url)
        .key("k-outage")
        .header("x-test-hold", "1")
        .spawn("x");
    env.upstream.wait_hits(1).await;
    relay.set(Fault::Blackhole);
    env.upstream.release(1);
    let r = first.await.unwrap();
    assert_eq!(r.status, 201, "answered at once, not after the outage");
    // The first completion attempt fails before the answer is sent: counted, waited for.
    env.metric_reaching("idemproxy_store_errors_total{op=\"complete\"}", 1.0)
        .await;
    relay.set(Fault::Pass);
    env.proxy
        .wait_log("record stored after the store recovered")
        .await;
    let retry = Call::post(&url).key("k-outage").body("x").await;
    assert!(retry.is_replay(), "{}", retry.status);
    assert_eq!(env.upstream.hits(), 1, "executed once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_lease_the_late_finisher_does_not_overwrite() {
    let env = env(Backend::Redis).start().await;
    let redis = env.redis.as_ref().unwrap();
    let url = env.url("/v1/payments");
    let a = Call::post(&url)
        .key("k-stolen")
        .header("x-test-hold", "1")
        .spawn("x");
    env.upstream.wait_hits(1).await;
    // The reservation vanishes (an operator, an eviction, a failover)...
    let keys = redis.keys().await;
    let _: i64 = redis.cmd(&["DEL", &keys[0]]).await;
    // ...and a retry takes the key and finishes first.
    let b = Call::post(&url).key("k-stolen").body("x").await;
    assert_eq!(b.status, 201);
    assert_eq!(b.json()["n"], 2);
    env.upstream.release(1);
    let a = a.await.unwrap();
    assert_eq!(
        a.status, 201,
        "the late finisher's client still gets its answer"
    );
    assert_eq!(a.json()["n"], 1);
    let c = Call::post(&url).key("k-stolen").body("x").await;
    assert!(c.is_replay());
    assert_eq!(
        c.json()["n"],
        2,
        "the newer owner's record was not overwritten"
    );
    // Counted by the late finisher's completion, which may end after its answer.
    env.metric_reaching("idemproxy_lease_lost_total{route=\"payments\"}", 1.0)
        .await;
}

// A proxy killed mid-request: tests/dead_owner.rs.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_proxies_300_concurrent_same_key_requests_one_execution() {
    let redis = RedisServer::start().await;
    let upstream = TestUpstream::start().await;
    let text = ConfigBuilder::new(&upstream.url()).redis(&redis).build();
    let proxies = [
        Proxy::in_process(&text, &[]).await,
        Proxy::in_process(&text, &[]).await,
        Proxy::in_process(&text, &[]).await,
    ];
    let mut tasks = Vec::new();
    for i in 0..300 {
        tasks.push(
            Call::post(&proxies[i % 3].url("/v1/payments"))
                .key("k-fleet")
                .header("x-test-delay-ms", "300")
                .spawn("pay"),
        );
    }
    let mut fresh = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            201 if !r.is_replay() => fresh += 1,
            201 | 409 => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(fresh, 1);
    assert_eq!(
        upstream.hits(),
        1,
        "exactly one execution across three processes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_grace_running_out_stores_the_unknown_outcome_and_exits_0() {
    let redis = RedisServer::start().await;
    let upstream = TestUpstream::start().await;
    let text = ConfigBuilder::new(&upstream.url())
        .server("shutdown_grace = \"500ms\"")
        .redis(&redis)
        .build();
    // The binary: SIGTERM is sent to it, and its exit code read.
    let mut proxy = Proxy::start(&text).await;
    let stuck = tokio::spawn({
        let url = proxy.url("/v1/payments");
        async move {
            let req = http::Request::post(&url)
                .header("idempotency-key", "k-stuck")
                .header("x-test-hold", "1")
                .body(http_body_util::Full::new(bytes::Bytes::from_static(b"x")))
                .unwrap();
            send(req).await
        }
    });
    upstream.wait_hits(1).await;
    proxy.signal("TERM");
    assert_eq!(
        proxy.wait_exit().await,
        Some(0),
        "exit 0 even when the grace runs out"
    );
    let _ = stuck.await;
    // A warning names what was cut short (its line may still be on the way from stderr).
    proxy.wait_log("cutting them short").await;
    // The request cut short is treated like an upstream timeout: its 504 is stored.
    let next = Proxy::in_process(&text, &[]).await;
    let r = Call::post(&next.url("/v1/payments"))
        .key("k-stuck")
        .body("x")
        .await;
    assert_eq!(r.status, 504);
    assert!(r.is_replay());
    // It says how long the request actually waited (the grace), not the
    // upstream timeout it never reached.
    let detail = r.json()["detail"].as_str().unwrap_or_default().to_string();
    let waited: u64 = detail
        .strip_prefix("The upstream did not answer within ")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("{detail}"));
    assert!((500..5_000).contains(&waited), "{detail}");
    assert_eq!(upstream.hits(), 1);
    upstream.release(1);
}
