//! A proxy killed mid-request (SIGKILL: no draining, no release): its key's
//! next request finds an owner that vanished after the request may have
//! reached the upstream. The outcome is unknown, so it is stored as the 502
//! `outcome-unknown` and replayed, never executed again; `lease_expiry =
//! "re_execute"` runs it again (docs/reference/behaviour.md#dead-owner).
//! The killed proxy is a real process (only a process can be killed); the
//! one that answers next is served in-process.

mod support;

use support::*;

/// The store the killed proxy and the next one share.
enum Shared {
    Redis(RedisServer),
    Postgres(PgServer),
}

impl Shared {
    async fn start(backend: Backend) -> Shared {
        match backend {
            Backend::Redis => Shared::Redis(RedisServer::start().await),
            Backend::Postgres => Shared::Postgres(PgServer::start().await),
            Backend::Memory => unreachable!("one process only: nothing outlives it"),
        }
    }

    fn config(&self, upstream: &TestUpstream, route_lines: &str) -> String {
        let config =
            ConfigBuilder::new(&upstream.url()).route("payments", "/v1/payments", route_lines);
        match self {
            Shared::Redis(r) => config.redis(r),
            Shared::Postgres(p) => config.postgres(p),
        }
        .build()
    }
}

/// A request held by the upstream through a proxy that is then killed; the
/// client sees its connection cut, nothing more.
async fn held_then_killed(proxy: &mut Proxy, upstream: &TestUpstream, key: &str) {
    let req = http::Request::post(proxy.url("/v1/payments"))
        .header("idempotency-key", key)
        .header("x-test-hold", "1")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(b"pay")))
        .unwrap();
    let first = tokio::spawn(async move { send(req).await.ok() });
    upstream.wait_hits(1).await;
    proxy.kill(); // SIGKILL: no draining, no release
    let cut = first.await.unwrap();
    assert!(cut.is_none(), "the client's connection went with the proxy");
}

/// Retries `key` through `url` until the dead owner's lease has run out: 409
/// until then (the lease holds the key), then the answer returned.
async fn after_the_lease(url: &str, key: &str) -> Resp {
    eventually(
        "the dead owner's lease to run out",
        DEADLINE,
        || async move {
            let r = Call::post(url).key(key).body("pay").await;
            if r.status == 409 {
                assert!(r.header("retry-after").is_some());
                assert_eq!(r.json()["type"], "request-in-progress");
                return None;
            }
            Some(r)
        },
    )
    .await
}

/// Killed mid-request on `backend`; the retry goes to `next`, a proxy on the
/// same store, started after the kill or (`replica`) running beside the
/// killed one all along.
async fn killed_owner_is_an_unknown_outcome(backend: Backend, replica: bool) {
    let store = Shared::start(backend).await;
    let upstream = TestUpstream::start().await;
    let text = store.config(&upstream, "lease = \"1s\"");
    // The binary: it is killed (SIGKILL).
    let mut a = Proxy::start(&text).await;
    let b = match replica {
        true => Some(Proxy::in_process(&text, &[]).await),
        false => None,
    };
    held_then_killed(&mut a, &upstream, "k-dead").await;
    let next = match b {
        Some(b) => b,
        None => Proxy::in_process(&text, &[]).await,
    };
    let url = next.url("/v1/payments");
    let r = after_the_lease(&url, "k-dead").await;
    assert_eq!(r.status, 502, "{}", String::from_utf8_lossy(&r.body));
    assert!(!r.is_replay(), "the first answer of the unknown outcome");
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let problem = r.json();
    assert_eq!(problem["type"], "outcome-unknown");
    assert_eq!(problem["status"], 502);
    assert_eq!(problem["retryable"], false);
    // Later retries replay it, byte for byte.
    let again = Call::post(&url).key("k-dead").body("pay").await;
    assert_eq!(again.status, 502);
    assert!(again.is_replay(), "stored and replayed");
    assert_eq!(again.body, r.body);
    // A different request under the key is still a 422.
    let other = Call::post(&url).key("k-dead").body("refund").await;
    assert_eq!(other.status, 422);
    assert_eq!(upstream.hits(), 1, "never a second execution");
    let expired = "idemproxy_lease_expired_total{route=\"payments\",handling=\"unknown_outcome\"}";
    assert_eq!(metric(&next, expired).await, 1.0);
    let re_executed = "idemproxy_lease_expired_total{route=\"payments\",handling=\"re_execute\"}";
    assert_eq!(metric(&next, re_executed).await, 0.0);
    let warned = next.wait_log("the key's owner vanished mid-request").await;
    assert!(warned.to_string().contains("record_id"), "{warned}");
    upstream.release(1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_owner_on_redis_is_an_unknown_outcome_never_run_again() {
    killed_owner_is_an_unknown_outcome(Backend::Redis, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_owner_on_postgres_is_an_unknown_outcome_never_run_again() {
    killed_owner_is_an_unknown_outcome(Backend::Postgres, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_replica_the_other_replica_answers_the_unknown_outcome() {
    killed_owner_is_an_unknown_outcome(Backend::Redis, true).await;
}

/// `lease_expiry = "re_execute"`: the old behaviour, for upstreams that
/// deduplicate themselves — 409 while the lease runs, then the retry runs
/// again; counted as `re_execute`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_execute_runs_a_killed_owners_request_again() {
    let store = Shared::start(Backend::Redis).await;
    let upstream = TestUpstream::start().await;
    let text = store.config(&upstream, "lease = \"1s\"\nlease_expiry = \"re_execute\"");
    // The binary: it is killed (SIGKILL).
    let mut a = Proxy::start(&text).await;
    held_then_killed(&mut a, &upstream, "k-again").await;
    let b = Proxy::in_process(&text, &[]).await;
    let url = b.url("/v1/payments");
    let r = Call::post(&url).key("k-again").body("pay").await;
    if r.status == 409 {
        // The reservation is kept past its lease: Retry-After is the lease's, not the store's time.
        assert_eq!(r.header("retry-after"), Some("1"));
    }
    let fresh = after_the_lease(&url, "k-again").await;
    assert_eq!(fresh.status, 201);
    assert!(!fresh.is_replay(), "the retry executes");
    assert_eq!(upstream.hits(), 2);
    assert!(Call::post(&url)
        .key("k-again")
        .body("pay")
        .await
        .is_replay());
    assert_eq!(upstream.hits(), 2);
    let series = "idemproxy_lease_expired_total{route=\"payments\",handling=\"re_execute\"}";
    assert_eq!(metric(&b, series).await, 1.0);
    upstream.release(1);
}

/// `unknown_outcome = "release"` frees the key of any unknown outcome: a
/// dead owner's too (handled as `re_execute`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_routes_run_a_killed_owners_request_again() {
    let store = Shared::start(Backend::Postgres).await;
    let upstream = TestUpstream::start().await;
    let text = store.config(&upstream, "lease = \"1s\"\nunknown_outcome = \"release\"");
    // The binary: it is killed (SIGKILL).
    let mut a = Proxy::start(&text).await;
    held_then_killed(&mut a, &upstream, "k-released").await;
    let b = Proxy::in_process(&text, &[]).await;
    let fresh = after_the_lease(&b.url("/v1/payments"), "k-released").await;
    assert_eq!(fresh.status, 201);
    assert_eq!(upstream.hits(), 2);
    let series = "idemproxy_lease_expired_total{route=\"payments\",handling=\"re_execute\"}";
    assert_eq!(metric(&b, series).await, 1.0);
    upstream.release(1);
}

/// A duplicate that waits (`concurrent = "wait"`) for a request whose proxy
/// is then killed learns that the owner vanished when its lease ends, not
/// when its own wait does: it reads the key's time again when the lease is
/// due to end, and gets the 502 `outcome-unknown` then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_learns_of_a_killed_owner_when_the_lease_ends() {
    let store = Shared::start(Backend::Redis).await;
    let upstream = TestUpstream::start().await;
    let wait = "lease = \"3s\"\nconcurrent = \"wait\"\nwait_timeout = \"20s\"";
    let text = store.config(&upstream, wait);
    // The binary: it is killed (SIGKILL).
    let mut a = Proxy::start(&text).await;
    let b = Proxy::in_process(&text, &[]).await;
    held_then_killed(&mut a, &upstream, "k-waited").await;
    // Sent within the lease (renewed every second until the kill): it waits.
    let sent = std::time::Instant::now();
    let r = Call::post(&b.url("/v1/payments"))
        .key("k-waited")
        .body("pay")
        .await;
    let waited = sent.elapsed();
    assert_eq!(r.status, 502, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["type"], "outcome-unknown");
    assert!(
        waited < std::time::Duration::from_secs(10),
        "answered when the 3 s lease ended, not after the 20 s wait: {waited:?}"
    );
    assert_eq!(upstream.hits(), 1);
    let series = "idemproxy_lease_expired_total{route=\"payments\",handling=\"unknown_outcome\"}";
    assert_eq!(metric(&b, series).await, 1.0);
    upstream.release(1);
}

// In-process: an owner that is alive but taken for dead, its reservation's
// time in the store cut to its afterlife (as if its lease had run out while
// it stalled). What a vanished owner's key gets, and what the stalled owner
// then finds.

const IN_PROCESS_ROUTES: &str = r#"
[defaults]
lease = "10s"

[[routes]]
name = "payments"
path = "/v1/payments"

[[routes]]
name = "shadow"
path = "/v1/shadow"
mode = "shadow"
"#;

/// Cuts the only reservation's time in the store to less than its afterlife
/// (the routes' 24 h TTL): its lease has run out.
async fn lease_runs_out_under(redis: &RedisServer) {
    let keys = redis.keys().await;
    assert_eq!(keys.len(), 1);
    let cut: i64 = redis.cmd(&["PEXPIRE", &keys[0], "86399000"]).await;
    assert_eq!(cut, 1);
}

/// The owner was only stalled: the retry took its key for a vanished
/// owner's and stored the unknown outcome; the owner's answer still goes to
/// its client, but its completion is refused (lease lost), and the key keeps
/// the 502: never a second execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_owner_taken_for_dead_has_its_completion_refused() {
    let env = Env::with_routes(Backend::Redis, IN_PROCESS_ROUTES).await;
    let redis = env.redis.as_ref().unwrap();
    let url = env.url("/v1/payments");
    let first = Call::post(&url)
        .key("k-stalled")
        .header("x-test-hold", "1")
        .spawn("pay");
    env.upstream.wait_hits(1).await;
    lease_runs_out_under(redis).await;
    let retry = Call::post(&url).key("k-stalled").body("pay").await;
    assert_eq!(retry.status, 502);
    assert_eq!(retry.json()["type"], "outcome-unknown");
    env.upstream.release(1);
    let first = first.await.unwrap();
    assert_eq!(
        first.status, 201,
        "the stalled owner's client gets its answer"
    );
    env.metric_reaching("idemproxy_lease_lost_total{route=\"payments\"}", 1.0)
        .await;
    let again = Call::post(&url).key("k-stalled").body("pay").await;
    assert_eq!((again.status, again.is_replay()), (502, true));
    assert_eq!(env.upstream.hits(), 1);
}

/// Shadow mode takes a vanished owner's key over as enforcement would, and
/// counts what enforcement would answer: the unknown outcome
/// (`upstream_error`), then its replay; every request is forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_counts_a_vanished_owner_as_enforcement_would_answer() {
    let env = Env::with_routes(Backend::Redis, IN_PROCESS_ROUTES).await;
    let redis = env.redis.as_ref().unwrap();
    let url = env.url("/v1/shadow");
    let first = Call::post(&url)
        .key("k-shadow")
        .header("x-test-hold", "1")
        .spawn("pay");
    env.upstream.wait_hits(1).await;
    lease_runs_out_under(redis).await;
    let retry = Call::post(&url).key("k-shadow").body("pay").await;
    assert_eq!(retry.status, 201, "forwarded, as if the proxy were absent");
    let series = |outcome: &str| {
        format!("idemproxy_shadow_outcomes_total{{route=\"shadow\",outcome=\"{outcome}\"}}")
    };
    assert_eq!(env.metric(&series("upstream_error")).await, 1.0);
    let expired = "idemproxy_lease_expired_total{route=\"shadow\",handling=\"unknown_outcome\"}";
    assert_eq!(env.metric(expired).await, 1.0);
    let again = Call::post(&url).key("k-shadow").body("pay").await;
    assert_eq!(again.status, 201);
    assert_eq!(env.metric(&series("replayed")).await, 1.0);
    env.upstream.release(1);
    first.await.unwrap();
    assert_eq!(env.upstream.hits(), 3, "shadow mode forwards everything");
}
