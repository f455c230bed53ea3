//! Scale-out: a real 3-master Redis Cluster, Sentinel failover, TLS with an ACL
//! user, replicated reservations, and the start-up durability check — all on loopback.

mod support;

use std::time::{Duration, Instant};

use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_behaviour_on_a_three_master_cluster() {
    let cluster = Cluster::start().await;
    let upstream = TestUpstream::start().await;
    // Seed with one node only: the client discovers the others and follows MOVED.
    let one_seed = format!(
        "mode = \"cluster\"\nnodes = [\"redis://127.0.0.1:{}\"]",
        cluster.nodes[0].port
    );
    let text = ConfigBuilder::new(&upstream.url())
        .redis_store(&one_seed)
        .build();
    // Three proxies, each with its own logs (read below).
    let proxies = [
        Proxy::in_process_apart(&text, &[]).await,
        Proxy::in_process_apart(&text, &[]).await,
        Proxy::in_process_apart(&text, &[]).await,
    ];
    let url = |i: usize, path: &str| proxies[i % 3].url(path);

    // Replay across processes, byte for byte.
    let first = Call::post(&url(0, "/v1/payments"))
        .key("c-replay")
        .body("x")
        .await;
    assert_eq!(first.status, 201);
    let again = Call::post(&url(1, "/v1/payments"))
        .key("c-replay")
        .body("x")
        .await;
    assert!(again.is_replay());
    assert_eq!(again.body, first.body);
    // 422 for a different request.
    assert_eq!(
        Call::post(&url(2, "/v1/payments"))
            .key("c-replay")
            .body("y")
            .await
            .status,
        422
    );
    // 409 while in flight.
    let held = Call::post(&url(0, "/v1/payments"))
        .key("c-busy")
        .header("x-test-hold", "1")
        .spawn("x");
    upstream.wait_hits(2).await;
    assert_eq!(
        Call::post(&url(1, "/v1/payments"))
            .key("c-busy")
            .body("x")
            .await
            .status,
        409
    );
    upstream.release(1);
    assert_eq!(held.await.unwrap().status, 201);
    // Scoping.
    let alice = Call::post(&url(0, "/v1/payments"))
        .key("c-scope")
        .header("authorization", "A")
        .body("x")
        .await;
    let bob = Call::post(&url(1, "/v1/payments"))
        .key("c-scope")
        .header("authorization", "B")
        .body("x")
        .await;
    assert!(!bob.is_replay());
    assert_ne!(alice.body, bob.body);
    // TTL.
    Call::post(&url(2, "/v1/short"))
        .key("c-ttl")
        .body("x")
        .await;
    let short = url(0, "/v1/short");
    eventually("the cluster record to expire", DEADLINE, || {
        let short = short.clone();
        async move { (!Call::post(&short).key("c-ttl").body("x").await.is_replay()).then_some(()) }
    })
    .await;
    let executed_so_far = upstream.hits();

    // A storm through three proxies: exactly one execution.
    let mut tasks = Vec::new();
    for i in 0..150 {
        tasks.push(
            Call::post(&url(i, "/v1/payments"))
                .key("c-storm")
                .header("x-test-delay-ms", "200")
                .spawn("x"),
        );
    }
    for t in tasks {
        let r = t.await.unwrap();
        assert!(r.status == 201 || r.status == 409, "{}", r.status);
    }
    assert_eq!(upstream.hits(), executed_so_far + 1);

    // Many keys land on every master: routing by slot works, and no operation spans two slots.
    for i in 0..30 {
        Call::post(&url(i, "/v1/payments"))
            .key(&format!("c-spread-{i}"))
            .body("x")
            .await;
    }
    let spread = cluster.keys_per_node().await;
    assert!(
        spread.iter().all(|&n| n > 0),
        "records on every master: {spread:?}"
    );
    for p in &proxies {
        assert!(!p.logs().iter().any(|l| l.contains("CROSSSLOT")));
    }
}

/// The hash slot of a store key (CRC16/XMODEM mod 16384; ours carry no hash tag).
fn slot_of(key: &str) -> u16 {
    let mut crc: u16 = 0;
    for &b in key.as_bytes() {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

fn store_key(key: &str) -> String {
    format!("idemproxy:{}", idemproxy::key::record_id([], key))
}

/// The first `n` client keys `{prefix}-{i}` whose records live in `slot`.
fn keys_in_slot(prefix: &str, slot: u16, n: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .filter(|k| slot_of(&store_key(k)) == slot)
        .take(n)
        .collect()
}

/// A live resharding (§5): a slot holding finished records is moved from one
/// master to another (`SETSLOT IMPORTING`/`MIGRATING`, `MIGRATE` key by key,
/// `SETSLOT NODE`) while requests run. A reserve is a pipeline, and a
/// pipeline is redirected like a single command: every replay and every new
/// key in the moving slot succeeds before, during and after the move, and no
/// key runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_resharding_fails_no_request() {
    let cluster = Cluster::start().await;
    let upstream = TestUpstream::start().await;
    let seed = format!(
        "mode = \"cluster\"\nnodes = [\"redis://127.0.0.1:{}\"]",
        cluster.nodes[0].port
    );
    let proxy = Proxy::in_process(
        &ConfigBuilder::new(&upstream.url())
            .redis_store(&seed)
            .build(),
        &[],
    )
    .await;
    let slot = slot_of(&store_key("move-0"));
    let stored = keys_in_slot("move", slot, 3);
    let fresh = keys_in_slot("fresh", slot, 24);
    let url = proxy.url("/v1/payments");
    for key in &stored {
        let r = Call::post(&url).key(key).body("x").await;
        assert_eq!(r.status, 201, "{key}");
    }

    // Who serves the slot, and who takes it over.
    let mut ids = Vec::new();
    for n in &cluster.nodes {
        ids.push(reply_text(
            redis_cmd(n.port, &["CLUSTER", "MYID"]).await.unwrap(),
        ));
    }
    let slot_text = slot.to_string();
    let mut source = None;
    for (i, n) in cluster.nodes.iter().enumerate() {
        let count = redis_cmd(n.port, &["CLUSTER", "COUNTKEYSINSLOT", &slot_text])
            .await
            .unwrap();
        if count == redis::Value::Int(stored.len() as i64) {
            source = Some(i);
        }
    }
    let source = source.expect("the node that holds the slot's records");
    let target = (source + 1) % 3;
    let (src, dst) = (cluster.nodes[source].port, cluster.nodes[target].port);

    // Traffic: each round replays the stored keys and sends one of the new
    // keys (new the first time, a replay after).
    let rounds = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let (rounds, stop, url) = (rounds.clone(), stop.clone(), url.clone());
        let (stored, fresh) = (stored.clone(), fresh.clone());
        tokio::spawn(async move {
            let mut failures = Vec::new();
            let mut sent = std::collections::HashSet::new();
            let mut round = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for key in &stored {
                    let r = Call::post(&url).key(key).body("x").await;
                    if r.status != 201 || !r.is_replay() {
                        failures.push(format!("round {round}: replay of {key}: {}", r.status));
                    }
                }
                let key = &fresh[round % fresh.len()];
                let first = sent.insert(key.clone());
                let r = Call::post(&url).key(key).body("x").await;
                if r.status != 201 || r.is_replay() == first {
                    failures.push(format!(
                        "round {round}: {key} ({}): {} {}",
                        if first { "new" } else { "replay" },
                        r.status,
                        String::from_utf8_lossy(&r.body)
                    ));
                }
                round += 1;
                rounds.store(round, std::sync::atomic::Ordering::Relaxed);
            }
            failures
        })
    };
    let some_rounds = || {
        let rounds = rounds.clone();
        async move {
            let from = rounds.load(std::sync::atomic::Ordering::Relaxed);
            eventually("traffic to go on", DEADLINE, || {
                let rounds = rounds.clone();
                async move {
                    (rounds.load(std::sync::atomic::Ordering::Relaxed) >= from + 4).then_some(())
                }
            })
            .await;
        }
    };
    let ok = |v: redis::RedisResult<redis::Value>, what: &str| {
        assert!(v.is_ok(), "{what}: {v:?}");
    };

    some_rounds().await;
    ok(
        redis_cmd(
            dst,
            &["CLUSTER", "SETSLOT", &slot_text, "IMPORTING", &ids[source]],
        )
        .await,
        "importing",
    );
    ok(
        redis_cmd(
            src,
            &["CLUSTER", "SETSLOT", &slot_text, "MIGRATING", &ids[target]],
        )
        .await,
        "migrating",
    );
    // New keys now go to the importing node (ASK); stored ones are still here.
    some_rounds().await;
    // The records move one at a time, traffic running between them.
    let dst_text = dst.to_string();
    loop {
        let keys: Vec<String> = redis::from_redis_value(
            redis_cmd(src, &["CLUSTER", "GETKEYSINSLOT", &slot_text, "1"])
                .await
                .unwrap(),
        )
        .unwrap();
        let Some(key) = keys.first() else { break };
        ok(
            redis_cmd(src, &["MIGRATE", "127.0.0.1", &dst_text, key, "0", "5000"]).await,
            "migrate",
        );
        some_rounds().await;
    }
    for n in [target, source, (source + 2) % 3] {
        ok(
            redis_cmd(
                cluster.nodes[n].port,
                &["CLUSTER", "SETSLOT", &slot_text, "NODE", &ids[target]],
            )
            .await,
            "setslot node",
        );
    }
    // After the move: MOVED, then the new owner straight away.
    some_rounds().await;
    some_rounds().await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let failures = traffic.await.unwrap();
    assert!(
        failures.is_empty(),
        "{} failed requests in {} rounds: {failures:#?}",
        failures.len(),
        rounds.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert_eq!(
        redis_cmd(dst, &["CLUSTER", "COUNTKEYSINSLOT", &slot_text])
            .await
            .unwrap(),
        redis::Value::Int((stored.len() + fresh.len()) as i64),
        "every record on the new owner"
    );
    // Each key ran once.
    let mut runs = std::collections::HashMap::<String, usize>::new();
    for seen in upstream.seen() {
        if let Some(k) = seen.headers.get("idempotency-key") {
            *runs.entry(k.to_str().unwrap().to_string()).or_default() += 1;
        }
    }
    for key in stored.iter().chain(&fresh) {
        assert_eq!(
            runs.get(key),
            Some(&1),
            "{key} ran {:?} times",
            runs.get(key)
        );
    }
}

// ---------------------------------------------------------------------------
// Sentinel

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_recovers_without_restarting_the_proxy() {
    let mut setup = SentinelSetup::start().await;
    let upstream = TestUpstream::start().await;
    let text = ConfigBuilder::new(&upstream.url())
        .redis_store(&setup.store_lines())
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    let url = proxy.url("/v1/payments");
    let before = Call::post(&url).key("s-before").body("x").await;
    assert_eq!(before.status, 201);
    // The record reaches the replica before the master dies.
    let rp = setup.replica.port;
    eventually("replication of the record", DEADLINE, || async move {
        let n: i64 = redis::from_redis_value(redis_cmd(rp, &["DBSIZE"]).await.ok()?).ok()?;
        (n >= 1).then_some(())
    })
    .await;

    // Traffic runs while the master is killed.
    let killed_at = Instant::now();
    setup.master.kill();
    let mut unavailable = Duration::ZERO;
    let mut first_503: Option<Instant> = None;
    let mut i = 0;
    let recovered = loop {
        i += 1;
        let r = Call::post(&url)
            .key(&format!("s-during-{i}"))
            .body("x")
            .await;
        match r.status {
            201 => break Instant::now(),
            503 => {
                first_503.get_or_insert_with(Instant::now);
            }
            other => panic!("unexpected status {other} during failover"),
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(60),
            "no recovery within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await; // steady traffic, not synchronisation
    };
    if let Some(start) = first_503 {
        unavailable = recovered - start;
    }
    eprintln!(
        "sentinel failover: protected routes answered 503 for {:.1} s (master killed {:.1} s before recovery, {i} requests)",
        unavailable.as_secs_f64(),
        (recovered - killed_at).as_secs_f64()
    );
    assert_eq!(
        setup.master_port().await,
        Some(setup.replica.port),
        "the replica was promoted"
    );
    // What was stored before the failover is still replayed from the new master.
    let replay = Call::post(&url).key("s-before").body("x").await;
    assert!(replay.is_replay());
    assert_eq!(replay.body, before.body);
    proxy.wait_log("sentinel named the master").await;
}

// ---------------------------------------------------------------------------
// Replicated reservations (store.wait_replicas)

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_replicas_refuses_to_forward_when_the_replica_does_not_acknowledge() {
    let dir = tempfile::tempdir().unwrap();
    let (master, mut replica) = master_and_replica(dir.path()).await;
    let mp = master.port;
    let upstream = TestUpstream::start().await;
    let text = ConfigBuilder::new(&upstream.url())
        .redis_url(&format!("redis://127.0.0.1:{mp}/0"))
        .store("wait_replicas = 1\nwait_timeout = \"100ms\"")
        .route("payments", "/v1/payments", "on_store_error = \"pass\"")
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    let url = proxy.url("/v1/payments");
    // The event, not a time: a key answered while the replica acknowledges
    // within `wait_timeout` (on a loaded machine one may miss it and get
    // 503, never forwarded).
    let tries = std::sync::atomic::AtomicUsize::new(0);
    let key = eventually(
        "a key answered with the replica acknowledging",
        DEADLINE,
        || {
            let key = format!(
                "w-ok-{}",
                tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            );
            let url = url.clone();
            async move {
                let r = Call::post(&url).key(&key).body("x").await;
                assert!(matches!(r.status, 201 | 503), "{r:?}");
                (r.status == 201).then_some(key)
            }
        },
    )
    .await;
    assert!(Call::post(&url).key(&key).body("x").await.is_replay());
    assert_eq!(
        upstream.hits(),
        1,
        "only the key answered 201 was forwarded"
    );

    replica.kill();
    eventually(
        "the master to notice the replica is gone",
        DEADLINE,
        || async move {
            let info = reply_text(redis_cmd(mp, &["INFO", "replication"]).await.ok()?);
            info.contains("connected_slaves:0").then_some(())
        },
    )
    .await;
    let r = Call::post(&url).key("w-lost").body("x").await;
    assert_eq!(
        r.status, 503,
        "never forwarded on an unreplicated reservation, even with on_store_error = pass"
    );
    assert_eq!(upstream.hits(), 1);
    let keys: Vec<String> =
        redis::from_redis_value(redis_cmd(mp, &["KEYS", "*"]).await.unwrap()).unwrap();
    assert_eq!(
        keys.len(),
        1,
        "the unreplicated reservation was withdrawn: {keys:?}"
    );
}

/// The failover `wait_replicas` could not cover when only reservations were
/// waited for: the master stores the finished record and dies before its
/// replica has it, and the promoted replica still holds `processing`. The
/// completion is waited for too, and written again until enough replicas
/// have it, so the retry after the failover is a replay, not a 409 until the
/// lease runs out and then a second execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_replicas_writes_a_completion_again_when_the_replica_missed_it() {
    let mut setup = SentinelSetup::start().await;
    let upstream = TestUpstream::start().await;
    let text = ConfigBuilder::new(&upstream.url())
        .redis_store(&setup.store_lines())
        .store("wait_replicas = 1\nwait_timeout = \"100ms\"")
        .route("payments", "/v1/payments", "lease = \"60s\"")
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    let url = proxy.url("/v1/payments");

    // Reserved and replicated (the reserve's WAIT), then held at the upstream.
    let first = Call::post(&url)
        .key("f-1")
        .header("x-test-hold", "1")
        .spawn("x");
    upstream.wait_hits(1).await;

    // Cut the replica off before the answer comes: it cannot log back in to
    // its master, but stays up and answers the sentinels.
    let rp = setup.replica.port;
    setup.cut_replica_off().await;

    upstream.release(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "the client has its answer");
    proxy.wait_log("too few replicas acknowledged it").await;
    // The record's second byte is its state.
    let key = format!("idemproxy:{}", idemproxy::key::record_id([], "f-1"));
    let state = reply_text(redis_cmd(rp, &["GETRANGE", &key, "1", "1"]).await.unwrap());
    assert_eq!(
        state, "P",
        "the replica holds the reservation, not the finished record"
    );

    // The master dies with the only finished copy; the sentinels promote the replica.
    setup.master.kill();
    setup.wait_replica_promoted().await;

    // The proxy writes the record again on the new master: the retry is a
    // replay (without that, 409 until the 60 s lease ran out, then a second run).
    let replay = eventually("the retry to be answered", DEADLINE, || {
        let url = url.clone();
        async move {
            let r = Call::post(&url).key("f-1").body("x").await;
            (r.status != 409 && r.status != 503).then_some(r)
        }
    })
    .await;
    assert!(replay.is_replay(), "status {}", replay.status);
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.hits(), 1, "executed once");
    // The new master has no replica: the proxy goes on writing the record
    // until its lease would run out, without renewing (a renewal would find
    // the finished record and take it for a lost lease).
    let rewrite = "too few replicas acknowledged it";
    let so_far = proxy.log_count(rewrite);
    proxy.wait_nth_log(rewrite, so_far + 2).await;
    assert!(!proxy.logs().iter().any(|l| l.contains("lease lost")));
}

// ---------------------------------------------------------------------------
// TLS and an ACL user limited to idemproxy's prefix and commands

/// The ACL line from docs/operations.md, so the documentation cannot rot.
fn documented_acl(password: &str) -> String {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let line = doc
        .lines()
        .find(|l| l.starts_with("ACL SETUSER idemproxy"))
        .expect("the ACL line in docs/operations.md");
    line.trim_start_matches("ACL SETUSER ")
        .replace(">LONG-RANDOM-PASSWORD", &format!(">{password}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_test_ca_and_a_least_privilege_acl_user() {
    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path());
    let port = free_port();
    let admin_port = free_port();
    let conf = dir.path().join("redis.conf");
    std::fs::write(
        &conf,
        format!(
            "port {admin_port}\nbind 127.0.0.1\ntls-port {port}\ntls-cert-file server.pem\ntls-key-file server.key\n\
             tls-ca-cert-file ca.pem\ntls-auth-clients no\nsave \"\"\nappendonly no\nuser {}\n",
            documented_acl("idem-pw")
        ),
    )
    .unwrap();
    let _redis = Node::start(dir.path(), port, &[conf.display().to_string()]);
    wait_pong(admin_port).await; // the plain port is for the test's own checks
    let upstream = TestUpstream::start().await;
    let ca = dir.path().join("ca.pem");
    let tls = ConfigBuilder::new(&upstream.url())
        .redis_url(&format!("rediss://127.0.0.1:{port}/0"))
        .store("username = \"idemproxy\"");
    let text = tls
        .clone()
        .store(&format!("tls_ca_file = \"{}\"", ca.display()))
        .build();
    // Three proxies, each with its own logs: each one's "store ping failed" is its own.
    let proxy = Proxy::in_process_apart(&text, &[("IDEMPROXY_REDIS_PASSWORD", "idem-pw")]).await;
    let url = proxy.url("/v1/payments");
    let first = Call::post(&url).key("t-1").body("x").await;
    assert_eq!(first.status, 201);
    let again = Call::post(&url).key("t-1").body("x").await;
    assert!(
        again.is_replay(),
        "reserve, complete and replay work over TLS with the ACL user"
    );
    // Renew and release too: a slow call and a released key.
    let released = Call::post(&url)
        .key("t-2")
        .header("x-test-status", "503")
        .body("x")
        .await;
    assert_eq!(released.status, 503);
    assert!(!Call::post(&url).key("t-2").body("x").await.is_replay());
    let keys: Vec<String> =
        redis::from_redis_value(redis_cmd(admin_port, &["KEYS", "*"]).await.unwrap()).unwrap();
    assert!(
        keys.iter().all(|k| k.starts_with("idemproxy:")) && keys.len() == 2,
        "{keys:?}"
    );
    // The ACL user refused CONFIG: the durability check says so instead of guessing.
    proxy.wait_log("refused CONFIG GET").await;

    // Without the CA, the server's certificate is not trusted: never ready.
    let no_ca = tls.store("op_timeout = \"300ms\"").build();
    let untrusting =
        Proxy::spawn_in_process_apart(&no_ca, &[("IDEMPROXY_REDIS_PASSWORD", "idem-pw")]).await;
    untrusting.wait_log("store ping failed").await;
    assert_eq!(
        get(&untrusting.admin_url("/readyz")).await.unwrap().status,
        503
    );
    // A wrong password is refused too.
    let wrong = Proxy::spawn_in_process_apart(&text, &[("IDEMPROXY_REDIS_PASSWORD", "nope")]).await;
    wrong.wait_log("store ping failed").await;
    assert_eq!(get(&wrong.admin_url("/readyz")).await.unwrap().status, 503);
}

// ---------------------------------------------------------------------------
// The durability check at start-up

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_check_warns_about_eviction_and_missing_persistence() {
    let upstream = TestUpstream::start().await;
    let evicting = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]).await;
    // Two proxies, each with its own logs: the second's must not hold the first's warnings.
    let evicting_config = ConfigBuilder::new(&upstream.url()).redis(&evicting).build();
    let proxy = Proxy::in_process_apart(&evicting_config, &[]).await;
    let line = proxy.wait_log("set maxmemory-policy noeviction").await;
    assert_eq!(line["level"], "WARN");
    assert_eq!(line["maxmemory_policy"], "allkeys-lru");
    proxy.wait_log("no persistence").await;

    let durable = RedisServer::start_with(&["--appendonly", "yes"]).await;
    let durable_config = ConfigBuilder::new(&upstream.url()).redis(&durable).build();
    let proxy = Proxy::in_process_apart(&durable_config, &[]).await;
    proxy.wait_log("store durability check").await;
    assert!(!proxy
        .logs()
        .iter()
        .any(|l| l.contains("no persistence") || l.contains("may evict")));
}

/// The take-over of a vanished owner's key is one key's script: on a
/// cluster it runs on the key's master, whichever master that is
/// (docs/reference/behaviour.md#dead-owner).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_owners_key_is_taken_over_on_any_master_of_a_cluster() {
    use idemproxy::policy::DeadOwner;
    use idemproxy::record::{Afterlife, Finished, Processing, Record, Token};
    use idemproxy::store::{Completion, Reservation};
    use std::time::Duration;

    let cluster = Cluster::start().await;
    let seed = format!(
        "mode = \"cluster\"\nnodes = [\"redis://127.0.0.1:{}\"]",
        cluster.nodes[0].port
    );
    let text = ConfigBuilder::new("http://127.0.0.1:1")
        .redis_store(&seed)
        .build();
    let cfg = idemproxy::config::Config::from_toml(&text, "t.toml", &Default::default()).unwrap();
    let metrics = std::sync::Arc::new(idemproxy::metrics::Metrics::new());
    let store = idemproxy::store::Store::new(&cfg.store, metrics, 1).unwrap();
    let (lease, after) = (Duration::from_millis(300), Duration::from_secs(60));
    // Keys on every master, in all likelihood (24 hashed keys, 3 masters).
    let keys: Vec<String> = (0..24)
        .map(|i| store.key_for(&format!("vanished-{i}")))
        .collect();
    let owners: Vec<Token> = keys.iter().map(|_| Token::new()).collect();
    for (key, owner) in keys.iter().zip(&owners) {
        let reservation = Record::Processing(Processing {
            token: *owner,
            fingerprint: [1; 32],
            created_ms: 1,
            route: "payments".into(),
            trace: None,
            afterlife: Some(Afterlife {
                after,
                then: DeadOwner::StoreUnknown,
            }),
        });
        let r = store
            .reserve(key, reservation.encode(), lease + after)
            .await
            .unwrap();
        assert!(matches!(r, Reservation::Reserved), "{r:?}");
    }
    for (key, owner) in keys.iter().zip(&owners) {
        eventually("the lease to run out", DEADLINE, || async {
            (store.pttl(key).await.unwrap() <= after).then_some(())
        })
        .await;
        let taker = Token::new();
        let unknown = Record::Finished(Finished {
            token: taker,
            fingerprint: [1; 32],
            created_ms: 1,
            route: "payments".into(),
            trace: None,
            completed_ms: 2,
            status: 502,
            reason: None,
            body_stored: true,
            headers: vec![],
            body: bytes::Bytes::from_static(b"outcome-unknown"),
            trailers: vec![],
        });
        let taken = store
            .take_over(
                key,
                *owner,
                after,
                unknown.encode(),
                Duration::from_secs(60),
            )
            .await
            .unwrap();
        assert!(taken, "{key}");
        let late = store
            .complete(key, *owner, unknown.encode(), Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(late, Completion::Refused, "{key}");
    }
}
