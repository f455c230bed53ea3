//! PostgreSQL failover under traffic: a primary and a synchronous streaming
//! standby (`synchronous_standby_names = '*'`), both on loopback; the proxy
//! has both hosts in its URL with `target_session_attrs=read-write`. The
//! primary is SIGKILLed, the standby promoted: no acknowledged record is
//! lost, no key is executed twice, and fresh keys are answered again soon
//! after the promotion, without restarting the proxy.

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use support::{eventually, Call, ConfigBuilder, PgServer, Proxy, TestUpstream, DEADLINE};

/// Clients sending at once, each a fresh key per tick and every other tick a
/// retry of one it was answered before.
const CLIENTS: usize = 4;
const PACE: Duration = Duration::from_millis(10);
/// How soon after the promotion fresh keys must be answered again.
const RECOVERY: Duration = Duration::from_secs(1);

const ROUTES: &str = r#"
[defaults]
lease = "10s"

[[routes]]
name = "payments"
path = "/v1/payments"
"#;

const BEFORE: u8 = 0;
const FAILING: u8 = 1;
const PROMOTED: u8 = 2;

#[derive(Default)]
struct Log {
    /// The first 2xx answer's body, per key.
    answered: BTreeMap<String, Bytes>,
    /// Fresh keys answered 2xx and refused, by the phase they were sent in.
    ok: [usize; 3],
    refused: [usize; 3],
    /// When the first fresh key sent after the promotion was answered 2xx.
    first_after_promotion: Option<Instant>,
    /// A retry of an answered key that was executed again or got another answer.
    wrong_retries: Vec<String>,
}

async fn client(
    url: String,
    me: usize,
    phase: Arc<AtomicU8>,
    log: Arc<Mutex<Log>>,
    stop: Arc<AtomicBool>,
) {
    let mut pace = tokio::time::interval(PACE);
    let mut answered: Vec<String> = Vec::new();
    for i in 0.. {
        if stop.load(Ordering::Acquire) {
            break;
        }
        pace.tick().await;
        let key = format!("c{me}-{i}");
        let during = phase.load(Ordering::Acquire);
        let r = Call::post(&url).key(&key).body(key.clone()).await;
        {
            let mut log = log.lock().unwrap();
            if (200..300).contains(&r.status) {
                assert!(!r.is_replay(), "{key}: a fresh key replayed");
                log.ok[during as usize] += 1;
                if during == PROMOTED && log.first_after_promotion.is_none() {
                    log.first_after_promotion = Some(Instant::now());
                }
                log.answered.insert(key.clone(), r.body.clone());
                answered.push(key);
            } else {
                log.refused[during as usize] += 1;
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
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_dies_and_the_synchronous_standby_takes_over_losing_nothing() {
    // Durable as in production: fsync and synchronous_commit on (the defaults).
    let mut primary = PgServer::start_with(&[]).await;
    let standby = PgServer::standby_of(&primary).await;
    let upstream = TestUpstream::start().await;
    let url_pg = format!(
        "postgres://{}@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        primary.role, primary.port, standby.port
    );
    let config = ConfigBuilder::new(&upstream.url())
        .postgres_url(&url_pg)
        .routes(ROUTES)
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let url = proxy.url("/v1/payments");

    let phase = Arc::new(AtomicU8::new(BEFORE));
    let log = Arc::new(Mutex::new(Log::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|me| {
            tokio::spawn(client(
                url.clone(),
                me,
                phase.clone(),
                log.clone(),
                stop.clone(),
            ))
        })
        .collect();
    let ok = |phase: u8| log.lock().unwrap().ok[phase as usize];
    eventually("answers before the kill", DEADLINE, || async {
        (ok(BEFORE) >= 50).then_some(())
    })
    .await;

    // No waiting for the standby to catch up: with a synchronous standby,
    // every commit the proxy saw is on it already.
    primary.kill();
    phase.store(FAILING, Ordering::Release);
    let killed = Instant::now();
    // Traffic goes on against a store with no primary for a while.
    eventually(
        "requests refused while there is no primary",
        DEADLINE,
        || async { (log.lock().unwrap().refused[FAILING as usize] >= 5).then_some(()) },
    )
    .await;
    // Recovery counts from the moment `pg_ctl promote` is run: fresh keys
    // sent from then on are the promoted phase's.
    let promoting = Instant::now();
    phase.store(PROMOTED, Ordering::Release);
    standby.promote().await;
    let promoted = Instant::now();
    eventually(
        "fresh keys answered after the promotion",
        DEADLINE,
        || async { (ok(PROMOTED) >= 20).then_some(()) },
    )
    .await;
    stop.store(true, Ordering::Release);
    for c in clients {
        c.await.unwrap();
    }
    let log = std::mem::take(&mut *log.lock().unwrap());
    let recovered = log
        .first_after_promotion
        .expect("a fresh key answered after the promotion")
        - promoting;
    eprintln!(
        "killed → promote issued {:?}; promote took {:?} (until the server accepted writes); \
         first fresh key answered {recovered:?} after `pg_ctl promote`; fresh keys answered {:?}, \
         refused {:?} ([before, failing, promoted])",
        promoting - killed,
        promoted - promoting,
        log.ok,
        log.refused
    );
    assert!(
        recovered <= RECOVERY,
        "fresh keys answered again only {recovered:?} after the promotion"
    );
    assert!(log.wrong_retries.is_empty(), "{:?}", log.wrong_retries);

    // Settled: every key the upstream executed was executed once; every key
    // answered 2xx replays the same answer from the new primary.
    let executed = upstream.executions();
    let twice: Vec<_> = executed.iter().filter(|(_, &n)| n > 1).collect();
    assert!(twice.is_empty(), "executed more than once: {twice:?}");
    let mut lost = Vec::new();
    for (key, first) in &log.answered {
        let r = eventually(&format!("{key} to replay"), DEADLINE, || {
            let url = url.clone();
            async move {
                let r = Call::post(&url).key(key).body(key.clone()).await;
                // 409: its completion is still being retried in the background.
                (r.status != 409).then_some(r)
            }
        })
        .await;
        if !r.is_replay() || r.body != *first {
            lost.push(format!("{key}: {} replay={}", r.status, r.is_replay()));
        }
    }
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged records lost or changed: {:?}",
        lost.len(),
        log.answered.len(),
        &lost[..lost.len().min(10)]
    );
    assert_eq!(upstream.executions(), executed, "a retry executed again");
    eprintln!(
        "{} acknowledged records, all replayed from the promoted standby; {} keys executed, none twice",
        log.answered.len(),
        executed.len()
    );
}
