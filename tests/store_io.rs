//! Store I/O bounded per operation (§8): large records through a store a few
//! milliseconds away, completions that the store will not take, a graceful
//! restart meanwhile, reads that time out under `on_store_error = "pass"`,
//! `WAIT` after the completion, and verdicts that read only a record's head.

mod support;

use std::time::Duration;

use support::relay::Fault;
use support::*;

const ROUTES: &str = r#"
[defaults]
lease = "10s"
max_response_body = "32MiB"

[[routes]]
name = "payments"
path = "/v1/payments"

[[routes]]
name = "pass"
path = "/v1/pass"
on_store_error = "pass"

[[routes]]
name = "short"
path = "/v1/short"
lease = "6s"
"#;

fn env() -> EnvBuilder {
    Env::builder(Backend::Redis)
        .routes(ROUTES)
        .server("max_buffered = \"128MiB\"")
}

/// The store key of an idempotency key sent without Authorization.
fn store_key(key: &str) -> String {
    format!("idemproxy:{}", idemproxy::key::record_id([], key))
}

/// Waits until the proxy has no request in progress (completions included, §8).
async fn settled(proxy: &Proxy) {
    eventually("no request in progress", DEADLINE, || async move {
        (metric(proxy, "idemproxy_inflight").await == 0.0).then_some(())
    })
    .await;
}

/// `INFO stats` total_net_output_bytes: what Redis has sent to its clients.
async fn redis_output(redis: &RedisServer) -> u64 {
    let info: String = redis.cmd(&["INFO", "stats"]).await;
    info.lines()
        .find_map(|l| l.strip_prefix("total_net_output_bytes:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("total_net_output_bytes")
}

/// 8 MiB is 32 pieces, 16 MiB 64: with Redis 10 ms away (20 ms a round
/// trip) neither fits in one `op_timeout` of 500 ms, while each piece does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_answers_through_a_store_10ms_away_are_stored_and_replay_byte_for_byte() {
    let env = env().redis_relay().start().await;
    env.redis_relay.as_ref().unwrap().set(Fault::Latency(10));
    let url = env.url("/v1/payments");
    for (key, size) in [("big-8", 8usize << 20), ("big-16", 16 << 20)] {
        let first = Call::post(&url)
            .key(key)
            .header("x-test-body-bytes", &size.to_string())
            .body("x")
            .await;
        assert_eq!(first.status, 201);
        assert_eq!(first.body.len(), size);
        let replay = Call::post(&url).key(key).body("x").await;
        assert!(
            replay.is_replay(),
            "{key}: a replay, not {} (the record was not stored)",
            replay.status
        );
        assert!(replay.body == first.body, "{key}: byte for byte");
    }
    assert_eq!(env.upstream.hits(), 2, "each executed once");
    assert!(!env
        .proxy
        .logs()
        .iter()
        .any(|l| l.contains("storing the record failed")));
}

/// A store that takes small writes but not a large record's pieces in time
/// (16 KiB per 40 ms: a 256 KiB piece needs 640 ms, over `op_timeout`):
/// the whole record is retried a bounded number of times, then the small
/// record saying it was not kept is stored; a retry gets 410 and never runs
/// again, and nothing is written any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_the_store_cannot_take_ends_as_the_410_record_and_retries_stop() {
    let env = env().redis_relay().start().await;
    let relay = env.redis_relay.as_ref().unwrap();
    relay.set(Fault::Delay(40));
    let url = env.url("/v1/short");
    let first = Call::post(&url)
        .key("k-slow-store")
        .header("x-test-body-bytes", "1048576")
        .body("x")
        .await;
    assert_eq!(first.status, 201, "the client has its answer");
    assert_eq!(first.body.len(), 1 << 20);
    // 409 while the whole record is being retried (503 while its pieces
    // hold up the connection); then the 410 record.
    let retry = eventually("the retry to be answered", DEADLINE, || {
        let url = url.clone();
        async move {
            let r = Call::post(&url).key("k-slow-store").body("x").await;
            (r.status != 409 && r.status != 503).then_some(r)
        }
    })
    .await;
    assert_eq!(
        retry.status,
        410,
        "{}",
        String::from_utf8_lossy(&retry.body)
    );
    let problem_type = retry.json()["type"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        problem_type.ends_with("response-not-stored"),
        "{problem_type}"
    );
    assert_eq!(env.upstream.hits(), 1, "never executed again");
    env.proxy
        .wait_log("the answer could not be stored whole; stored without its body")
        .await;
    settled(&env.proxy).await;
    let attempts = "idemproxy_store_duration_seconds_count{op=\"complete\"}";
    let made = env.metric(attempts).await;
    assert!(
        (2.0..=48.0).contains(&made),
        "bounded attempts (24 whole, 24 small at most): {made}"
    );
    assert_eq!(
        env.metric("idemproxy_completions_degraded_total{route=\"short\",result=\"not_kept\"}")
            .await,
        1.0
    );
    // The key holds a record with its TTL, not a reservation with a lease.
    relay.set(Fault::Pass);
    let redis = env.redis.as_ref().unwrap();
    let key = store_key("k-slow-store");
    let ttl: i64 = redis.cmd(&["PTTL", &key]).await;
    assert!(ttl > 60_000, "the record's TTL, not a lease: {ttl} ms");
    assert_eq!(
        env.metric(attempts).await,
        made,
        "no more completion attempts"
    );
    let again = Call::post(&url).key("k-slow-store").body("x").await;
    assert_eq!(again.status, 410);
    assert_eq!(env.upstream.hits(), 1);
}

/// SIGTERM while a large record's completion keeps failing: draining stores
/// the small 410 record instead of waiting out the grace, so the key is not
/// freed by the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_restart_while_a_large_completion_fails_leaves_the_410_record() {
    // SIGTERM and the exit code: the binary.
    let mut env = env()
        .routes(&ROUTES.replace("lease = \"10s\"", "lease = \"30s\""))
        .redis_relay()
        .binary()
        .start()
        .await;
    env.redis_relay.as_ref().unwrap().set(Fault::Delay(40));
    let url = env.url("/v1/payments");
    let first = Call::post(&url)
        .key("k-restart")
        .header("x-test-body-bytes", "1048576")
        .body("x")
        .await;
    assert_eq!(first.status, 201);
    env.proxy.wait_log("storing the record failed").await;
    env.proxy.signal("TERM");
    assert_eq!(env.proxy.wait_exit().await, Some(0));

    // The next proxy, straight on Redis.
    let redis = env.redis.as_ref().unwrap();
    let text = ConfigBuilder::new(&env.upstream.url())
        .redis(redis)
        .routes(ROUTES)
        .build();
    let next = Proxy::in_process(&text, &[]).await;
    let retry = Call::post(&next.url("/v1/payments"))
        .key("k-restart")
        .body("x")
        .await;
    assert_eq!(retry.status, 410, "not free, not processing");
    assert_eq!(env.upstream.hits(), 1, "never executed again");
    env.proxy.wait_log("stored without its body").await;
}

/// `on_store_error = "pass"` forwards when the store cannot say whether the
/// key is taken; a key it found taken whose record cannot then be read in
/// time is a 503, never forwarded (the operation ran).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pass_never_forwards_a_key_whose_large_record_cannot_be_read_in_time() {
    let env = env().redis_relay().start().await;
    let relay = env.redis_relay.as_ref().unwrap();
    let url = env.url("/v1/pass");
    let first = Call::post(&url)
        .key("k-pass")
        .header("x-test-body-bytes", "1048576")
        .body("x")
        .await;
    assert_eq!(first.status, 201);
    // The reserve's 64 KiB come in time; a 256 KiB piece does not.
    relay.set(Fault::Delay(40));
    let retry = Call::post(&url).key("k-pass").body("x").await;
    assert_eq!(
        retry.status,
        503,
        "{}",
        String::from_utf8_lossy(&retry.body)
    );
    let after: u64 = retry
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!(after >= 1);
    assert_eq!(env.upstream.hits(), 1, "not forwarded: it would run twice");
    relay.set(Fault::Pass);
    let replay = Call::post(&url).key("k-pass").body("x").await;
    assert!(replay.is_replay());
    assert!(replay.body == first.body);
}

/// With `wait_replicas = 1` the completion is followed by `WAIT` before the
/// client is answered; with the replica gone, the answer still goes out and
/// the shortfall is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completion_is_followed_by_wait_and_a_shortfall_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (master, mut replica) = master_and_replica(dir.path()).await;
    let mp = master.port;
    let upstream = TestUpstream::start().await;
    let text = ConfigBuilder::new(&upstream.url())
        .redis_url(&format!("redis://127.0.0.1:{mp}/0"))
        // Long enough for a replica on a loaded machine to acknowledge (a
        // `WAIT` that falls short of it would refuse the first key with 503);
        // the shortfall below costs this much once.
        .store("wait_replicas = 1\nwait_timeout = \"2s\"")
        .routes(ROUTES)
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    let url = proxy.url("/v1/payments");
    let waits = || async move {
        let info = reply_text(redis_cmd(mp, &["INFO", "commandstats"]).await.unwrap());
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_wait:calls="))
            .and_then(|rest| rest.split(',').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let before = waits().await;
    assert_eq!(Call::post(&url).key("w-1").body("x").await.status, 201);
    assert_eq!(
        waits().await - before,
        2,
        "one WAIT after the reserve, one after the completion, both before the answer"
    );

    // The replica goes while the upstream works: the reserve was replicated,
    // the completion cannot be.
    let held = Call::post(&url)
        .key("w-2")
        .header("x-test-hold", "1")
        .spawn("x");
    upstream.wait_hits(2).await;
    replica.kill();
    eventually("the master to lose its replica", DEADLINE, || async move {
        let info = reply_text(redis_cmd(mp, &["INFO", "replication"]).await.ok()?);
        info.contains("connected_slaves:0").then_some(())
    })
    .await;
    upstream.release(1);
    let answered = held.await.unwrap();
    assert_eq!(answered.status, 201, "the answer still goes out");
    let series = "idemproxy_completions_degraded_total{route=\"payments\",result=\"unreplicated\"}";
    assert!(
        metric(&proxy, series).await >= 1.0,
        "the shortfall is counted"
    );
    proxy.wait_log("too few replicas acknowledged it").await;
}

/// Found in CI: the whole reservation, its `WAIT` included, was bounded by
/// `op_timeout`, so a replica that acknowledged after `op_timeout` (but well
/// within `wait_timeout`) had the key refused with 503. The `WAIT` now has
/// `wait_timeout` beyond `op_timeout`, as the completion's has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_waits_for_its_replica_as_long_as_wait_timeout_says() {
    let dir = tempfile::tempdir().unwrap();
    let (master, replica) = master_and_replica(dir.path()).await;
    let upstream = TestUpstream::start().await;
    let text = ConfigBuilder::new(&upstream.url())
        .redis_url(&format!("redis://127.0.0.1:{}/0", master.port))
        .store("wait_replicas = 1\nwait_timeout = \"5s\"\nop_timeout = \"300ms\"")
        .routes(ROUTES)
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    let url = proxy.url("/v1/payments");
    // The replica stops for a while (the fault's length, not a wait for an event).
    replica.signal("STOP");
    let resume = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(900)).await;
        replica.signal("CONT");
        replica
    });
    let started = std::time::Instant::now();
    let r = Call::post(&url).key("slow-ack").body("x").await;
    let _replica = resume.await.unwrap();
    assert_eq!(r.status, 201, "{r:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(800),
        "the replica was stopped"
    );
    assert_eq!(upstream.hits(), 1);
}

/// A 422 needs only the record's head (fingerprint), a 409 its state and
/// token: neither reads a large record's body from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicts_and_mismatches_on_a_large_record_read_only_its_head() {
    let env = env().start().await;
    let redis = env.redis.as_ref().unwrap();
    let url = env.url("/v1/payments");
    let first = Call::post(&url)
        .key("k-head")
        .header("x-test-body-bytes", "4194304")
        .body("x")
        .await;
    assert_eq!(first.status, 201);

    let before = redis_output(redis).await;
    let other = Call::post(&url).key("k-head").body("another body").await;
    assert_eq!(other.status, 422);
    let read = redis_output(redis).await - before;
    assert!(
        read < 256 * 1024,
        "a 422 read {read} bytes of a 4 MiB record"
    );

    // The same record, as a reservation in progress (a large record being
    // written piece by piece reads so): a 409.
    let key = store_key("k-head");
    let _: i64 = redis.cmd(&["SETRANGE", &key, "1", "P"]).await;
    let before = redis_output(redis).await;
    let busy = Call::post(&url).key("k-head").body("x").await;
    assert_eq!(busy.status, 409);
    let read = redis_output(redis).await - before;
    assert!(
        read < 256 * 1024,
        "a 409 read {read} bytes of a 4 MiB record"
    );
    assert_eq!(env.upstream.hits(), 1);
}

/// The record the store gets is a copy of the answer, and a large one counts
/// in `max_buffered` beside the answer while it is kept: without room for it,
/// the answer is kept without its body (410) at once, never held outside the
/// budget while a slow store takes it piece by piece.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_record_without_room_beside_its_answer_is_kept_without_its_body() {
    let env = Env::builder(Backend::Redis)
        .routes(ROUTES)
        .server("max_buffered = \"3MiB\"")
        .redis_relay()
        .start()
        .await;
    let relay = env.redis_relay.as_ref().unwrap();
    relay.set(Fault::Delay(40));
    let url = env.url("/v1/short");
    let first = Call::post(&url)
        .key("k-no-room")
        .header("x-test-body-bytes", "2097152")
        .body("x")
        .await;
    assert_eq!(first.status, 201, "the client has its answer");
    assert_eq!(first.body.len(), 2 << 20);
    env.proxy
        .wait_log("response not kept; retries will get 410")
        .await;
    settled(&env.proxy).await;
    let attempts = "idemproxy_store_duration_seconds_count{op=\"complete\"}";
    let made = env.metric(attempts).await;
    assert!(made <= 2.0, "the small record only: {made}");
    assert_eq!(env.metric("idemproxy_buffered_bytes").await, 0.0);
    let not_kept = "idemproxy_completions_degraded_total{route=\"short\",result=\"not_kept\"}";
    assert_eq!(env.metric(not_kept).await, 1.0);
    relay.set(Fault::Pass);
    let again = Call::post(&url).key("k-no-room").body("x").await;
    assert_eq!(again.status, 410);
    assert_eq!(env.upstream.hits(), 1);
    // With room for both, the same answer is kept whole.
    let whole = Call::post(&url)
        .key("k-room")
        .header("x-test-body-bytes", "1048576")
        .body("x")
        .await;
    assert_eq!(whole.status, 201);
    settled(&env.proxy).await;
    let replay = Call::post(&url).key("k-room").body("x").await;
    assert!(replay.is_replay());
    assert_eq!(replay.body.len(), 1 << 20);
}

/// A store outage between the reservation and its release: the upstream
/// answers 503 (a release status) while Redis resets every connection, so
/// the release fails on each of its attempts. The operator reads one warning
/// for it, not one per attempt: during an outage every request does this.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_release_logs_one_line_not_one_per_attempt() {
    let env = env().redis_relay().start().await;
    let relay = env.redis_relay.as_ref().unwrap();
    let url = env.url("/v1/payments");
    let call = tokio::spawn(async move {
        Call::post(&url)
            .key("release-in-outage")
            .header("x-test-hold", "1")
            .header("x-test-status", "503")
            .body("x")
            .await
    });
    env.upstream.wait_hits(1).await;
    relay.set(Fault::Reset);
    env.upstream.release(1);
    let r = call.await.unwrap();
    assert_eq!(r.status, 503, "the upstream's 503 is relayed: {r:?}");
    let line = env.proxy.wait_log("releasing a reservation failed").await;
    assert_eq!(line["level"], "WARN", "{line}");
    settled(&env.proxy).await;
    assert_eq!(
        env.proxy.log_count("releasing a reservation failed"),
        1,
        "one line per failed release: {:#?}",
        env.proxy.logs()
    );
}
