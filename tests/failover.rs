//! Store failover on a real 6-node Redis Cluster (3 masters, 3 replicas): the
//! master that is the proxy's only seed is SIGKILLed under traffic, and no
//! operation runs twice, no record is lost, healthy masters keep answering.

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use tokio::time::Instant;

use support::{
    eventually, redis_cmd, reply_text, Call, Cluster, ConfigBuilder, Proxy, TestUpstream, DEADLINE,
};

/// Six nodes, three masters with one replica each; failures are detected within
/// a second. `cluster-require-full-coverage no`: otherwise Redis itself refuses
/// every key (CLUSTERDOWN) between a master's failure and its replica's promotion.
async fn cluster() -> Cluster {
    Cluster::start_with(
        3,
        1,
        &[
            "--cluster-node-timeout",
            "1000",
            "--cluster-require-full-coverage",
            "no",
        ],
    )
    .await
}

/// `INFO <section>` (or `CLUSTER INFO`) of one node, empty when it does not answer.
async fn info(port: u16, args: &[&str]) -> String {
    redis_cmd(port, args)
        .await
        .map(reply_text)
        .unwrap_or_default()
}

/// The store key of an idempotency key sent without Authorization.
fn store_key(key: &str) -> String {
    format!("idemproxy:{}", idemproxy::key::record_id([], key))
}

/// Fresh keys per side at most: the traffic is paced and stops once the failover is over.
const KEYS: usize = 500;
/// Each side sends at most one fresh key (and every other time a retry) per this long.
const PACE: Duration = Duration::from_millis(25);

const ROUTES: &str = r#"
[defaults]
lease = "10s"

[[routes]]
name = "payments"
path = "/v1/payments"
"#;

/// Keys `<prefix>-<n>`, `n` of each: those whose record's slot the master `port`
/// serves, and the others (slots as node `ask` computes and assigns them).
async fn keys_by_master(ask: u16, port: u16, prefix: &str, n: usize) -> (Vec<String>, Vec<String>) {
    let owners = Cluster::slot_owners(ask).await;
    let candidates: Vec<String> = (0..n * 6).map(|i| format!("{prefix}-{i}")).collect();
    let mut pipe = redis::pipe();
    for key in &candidates {
        pipe.cmd("CLUSTER").arg("KEYSLOT").arg(store_key(key));
    }
    let client = redis::Client::open(format!("redis://127.0.0.1:{ask}/")).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let slots: Vec<i64> = pipe.query_async(&mut conn).await.unwrap();
    let (mut on_port, mut others) = (Vec::new(), Vec::new());
    for (key, slot) in candidates.into_iter().zip(slots) {
        let owner = owners
            .iter()
            .find(|(start, end, _)| (*start..=*end).contains(&slot))
            .map(|o| o.2)
            .expect("every slot is served");
        match owner == port {
            true if on_port.len() < n => on_port.push(key),
            false if others.len() < n => others.push(key),
            _ => {}
        }
    }
    assert!(on_port.len() == n && others.len() == n, "not enough keys");
    (on_port, others)
}

const VICTIM: usize = 0;
const HEALTHY: usize = 1;
/// Phases of the failover, by when a request was sent.
const BEFORE: u8 = 0;
const FAILING: u8 = 1;
const PROMOTED: u8 = 2;

/// What the clients saw.
#[derive(Default)]
struct Log {
    /// The first 2xx answer's body, per key.
    answered: BTreeMap<String, Bytes>,
    /// Fresh keys answered 2xx, by side and phase.
    ok: [[usize; 3]; 2],
    /// Fresh keys refused, by side and phase.
    refused: [[usize; 3]; 2],
    /// A key on a healthy master that was not answered.
    healthy_refused: Vec<String>,
    /// A retry of an answered key that was executed again or got another answer.
    wrong_retries: Vec<String>,
}

/// One side's traffic: a fresh key per tick, and every other tick a retry of
/// one of its keys answered before. Bounded by its keys and by `stop`.
async fn traffic(
    url: String,
    side: usize,
    keys: Vec<String>,
    phase: Arc<AtomicU8>,
    log: Arc<Mutex<Log>>,
    stop: Arc<AtomicBool>,
    hold: Arc<[AtomicBool; 2]>,
) {
    let mut pace = tokio::time::interval(PACE);
    let mut answered: Vec<String> = Vec::new();
    for (i, key) in keys.into_iter().enumerate() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        // Paused on request (hold[0]), saying so (hold[1]).
        while side == VICTIM && hold[0].load(Ordering::Acquire) && !stop.load(Ordering::Acquire) {
            hold[1].store(true, Ordering::Release);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        hold[1].store(false, Ordering::Release);
        pace.tick().await;
        let during = phase.load(Ordering::Acquire) as usize;
        let r = Call::post(&url).key(&key).body(key.clone()).await;
        {
            let mut log = log.lock().unwrap();
            if (200..300).contains(&r.status) {
                assert!(!r.is_replay(), "{key}: a fresh key replayed");
                log.ok[side][during] += 1;
                log.answered.insert(key.clone(), r.body.clone());
                answered.push(key);
            } else {
                log.refused[side][during] += 1;
                if side == HEALTHY {
                    log.healthy_refused
                        .push(format!("{key} (phase {during}): {}", r.status));
                }
            }
        }
        if i % 2 == 1 && !answered.is_empty() {
            let earlier = &answered[i * 7 % answered.len()];
            let r = Call::post(&url).key(earlier).body(earlier.clone()).await;
            let mut log = log.lock().unwrap();
            if (200..300).contains(&r.status) && !r.is_replay() {
                log.wrong_retries.push(format!("{earlier}: executed again"));
            } else if r.is_replay() && Some(&r.body) != log.answered.get(earlier) {
                log.wrong_retries.push(format!("{earlier}: another answer"));
            } else if !r.is_replay() && side == HEALTHY {
                // (A retry on the failing master may get 503, or 409 while its completion is retried.)
                log.healthy_refused
                    .push(format!("{earlier} retry (phase {during}): {}", r.status));
            }
        }
    }
}

/// The proxy's only seed is the master that dies. While its replica takes over,
/// keys on the other masters keep answering; afterwards every key works through
/// the nodes the proxy learned; no key is executed twice and every executed
/// key replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_only_seed_master_dies_under_traffic() {
    let mut cluster = cluster().await;
    let (victim, its_replica) = cluster.shards[0];
    let other = cluster.shards[1].0;
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .redis_store(&format!(
            "mode = \"cluster\"\nnodes = [\"redis://127.0.0.1:{victim}\"]"
        ))
        .routes(ROUTES)
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let url = proxy.url("/v1/payments");
    let (victim_keys, healthy_keys) = keys_by_master(other, victim, "fo", KEYS).await;

    let phase = Arc::new(AtomicU8::new(BEFORE));
    let log = Arc::new(Mutex::new(Log::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let hold = Arc::new([AtomicBool::new(false), AtomicBool::new(false)]);
    let loops = [(VICTIM, victim_keys), (HEALTHY, healthy_keys)].map(|(side, keys)| {
        tokio::spawn(traffic(
            url.clone(),
            side,
            keys,
            phase.clone(),
            log.clone(),
            stop.clone(),
            hold.clone(),
        ))
    });
    let ok = |side: usize, phase: u8| log.lock().unwrap().ok[side][phase as usize];
    eventually(
        "answers on both sides before the kill",
        DEADLINE,
        || async { (ok(VICTIM, BEFORE) >= 5 && ok(HEALTHY, BEFORE) >= 5).then_some(()) },
    )
    .await;

    // Redis replicates asynchronously: a write its master acknowledged and
    // then died with is lost, whatever the proxy does
    // (docs/how-it-works.md#duplicates). So the victim's own traffic pauses until
    // its replica has every write, and the kill cannot fall into that window;
    // what is under test is the proxy's part (completions retried in the
    // background, reconnecting through learned nodes), not Redis's.
    hold[0].store(true, Ordering::Release);
    eventually("the victim's traffic to pause", DEADLINE, || async {
        hold[1].load(Ordering::Acquire).then_some(())
    })
    .await;
    eventually("the replica to have every write", DEADLINE, || async {
        let field = |text: String, name: &str| -> Option<u64> {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse().ok())
        };
        let master = field(
            info(victim, &["INFO", "replication"]).await,
            "master_repl_offset:",
        )?;
        let replica = field(
            info(its_replica, &["INFO", "replication"]).await,
            "slave_repl_offset:",
        )?;
        (replica >= master).then_some(())
    })
    .await;
    cluster.kill(victim);
    hold[0].store(false, Ordering::Release);
    phase.store(FAILING, Ordering::Release);
    let killed = Instant::now();
    eventually("the replica to be promoted", DEADLINE, || async {
        info(its_replica, &["INFO", "replication"])
            .await
            .contains("role:master")
            .then_some(())
    })
    .await;
    phase.store(PROMOTED, Ordering::Release);
    let promoted = killed.elapsed();
    // Until the failed master's keys work again (or a healthy key was refused, or the deadline).
    let until = Instant::now() + DEADLINE;
    while ok(VICTIM, PROMOTED) < 5
        && log.lock().unwrap().healthy_refused.is_empty()
        && Instant::now() < until
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Release);
    for l in loops {
        l.await.unwrap();
    }
    let log = std::mem::take(&mut *log.lock().unwrap());
    eprintln!(
        "promoted {promoted:?} after the kill; fresh keys answered {:?}, refused {:?} ([victim, healthy] × [before, failing, promoted])",
        log.ok, log.refused
    );
    assert!(
        log.healthy_refused.is_empty(),
        "keys on healthy masters were refused while one master failed over: {:?}",
        log.healthy_refused
    );
    assert!(log.wrong_retries.is_empty(), "{:?}", log.wrong_retries);
    assert!(
        log.ok[HEALTHY][FAILING as usize] >= 5,
        "too little traffic on healthy masters during the failover: {:?}",
        log.ok
    );
    assert!(
        log.ok[VICTIM][PROMOTED as usize] >= 5,
        "the failed master's keys never worked again through its promoted replica: {:?}",
        log.ok
    );

    // Settled: every key the upstream executed was executed once and replays
    // (whether or not its client got the answer): no record was lost.
    let executed = upstream.executions();
    let twice: Vec<_> = executed.iter().filter(|(_, &n)| n > 1).collect();
    assert!(twice.is_empty(), "executed more than once: {twice:?}");
    for key in log.answered.keys() {
        assert_eq!(
            executed.get(key),
            Some(&1),
            "{key}: answered 2xx but not executed"
        );
    }
    for key in executed.keys() {
        let url = url.clone();
        let r = eventually(&format!("{key} to replay"), DEADLINE, || {
            let url = url.clone();
            async move {
                let r = Call::post(&url).key(key).body(key.clone()).await;
                // 409: its completion is still being retried in the background.
                (r.status != 409).then_some(r)
            }
        })
        .await;
        assert!(r.is_replay(), "{key}: record lost, answered {}", r.status);
        if let Some(first) = log.answered.get(key) {
            assert_eq!(&r.body, first, "{key}: another answer");
        }
    }
    assert_eq!(upstream.executions(), executed, "a retry executed again");

    // A new connection can be made although the only seed is dead: writes
    // pause on every master, so that operations keep failing and the proxy
    // reconnects, through the nodes it learned.
    let masters = [its_replica, cluster.shards[1].0, cluster.shards[2].0];
    let reconnects = || proxy.log_count("made a new cluster connection");
    let before = reconnects();
    for port in masters {
        redis_cmd(port, &["CLIENT", "PAUSE", "3000", "WRITE"])
            .await
            .unwrap();
    }
    let mut paused_keys = (0..).map(|i| format!("paused-{i}"));
    eventually("a new cluster connection", DEADLINE, || {
        let key = paused_keys.next().unwrap();
        let url = url.clone();
        async move {
            if reconnects() > before {
                return Some(());
            }
            let r = Call::post(&url).key(&key).body(key.clone()).await;
            assert!(
                !(200..300).contains(&r.status),
                "a write while writes are paused"
            );
            None
        }
    })
    .await;
    let mut resumed_keys = (0..).map(|i| format!("resumed-{i}"));
    eventually("the end of the pause", DEADLINE, || {
        let key = resumed_keys.next().unwrap();
        let url = url.clone();
        async move {
            let r = Call::post(&url).key(&key).body(key.clone()).await;
            (r.status == 201).then_some(())
        }
    })
    .await;

    // Its only seed is dead, yet fresh keys on every master work.
    let (promoted_keys, other_keys) = keys_by_master(other, its_replica, "after", 3).await;
    for key in promoted_keys.iter().chain(&other_keys) {
        let r = Call::post(&url).key(key).body(key.clone()).await;
        assert_eq!(r.status, 201, "{key} after the failover");
        assert!(Call::post(&url)
            .key(key)
            .body(key.clone())
            .await
            .is_replay());
    }
}
