//! Redis failover under traffic, beside `pg_failover.rs` and with its traffic:
//! a master, one replica and three sentinels on loopback; the proxy reaches
//! the master through the sentinels and is never restarted.
//!
//! Redis acknowledges a write before its replica has it. The lag is made
//! deterministic: the replica is cut off from its master (it cannot log back
//! in), while the master goes on answering; then the master is SIGKILLed and
//! the sentinels promote the replica. What is lost is exactly what the master
//! acknowledged and the replica did not have: with `wait_replicas = 0` (the
//! default) the records answered during the lag, whose retries run again;
//! with `wait_replicas = 1` nothing, since no key is forwarded before its
//! reservation is on the replica (the lag costs 503s instead).

mod support;

use std::collections::BTreeSet;
use tokio::time::Instant;

use support::failover::{self, Log, Settled, Traffic, ROUTES};
use support::{replica_of, ConfigBuilder, Proxy, SentinelSetup, TestUpstream};

/// The replica in sync with the master.
const BEFORE: u8 = 0;
/// The replica cut off; the master answering alone.
const LAGGING: u8 = 1;
/// Sent while the master was being killed (a moment).
const KILLING: u8 = 2;
/// The master dead, until the sentinels name the replica as the master.
const FAILING: u8 = 3;
/// The replica promoted; it has no replica of its own.
const PROMOTED: u8 = 4;
/// A new replica of the promoted master syncing (`wait_replicas = 1` only).
const ATTACHING: u8 = 5;
/// The new replica in sync.
const REPLICATED: u8 = 6;
const PHASES: [&str; 7] = [
    "before the cut",
    "replica cut off",
    "at the kill",
    "no master",
    "promoted",
    "new replica syncing",
    "new replica in sync",
];

/// A failover up to the promotion: the same in both tests.
struct Failover {
    setup: SentinelSetup,
    upstream: TestUpstream,
    proxy: Proxy,
    url: String,
    traffic: Traffic,
    killed: Instant,
    promoted: Instant,
}

/// Traffic with the replica in sync; the replica cut off while the master
/// answers on; the master SIGKILLed under traffic; the replica promoted by
/// the sentinels. Returns with the traffic going on, in `PROMOTED`.
async fn until_promoted(phases: &[&'static str], wait_replicas: bool) -> Failover {
    let store = match wait_replicas {
        true => "wait_replicas = 1\nwait_timeout = \"100ms\"",
        false => "",
    };
    let mut setup = SentinelSetup::start().await;
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .redis_store(&setup.store_lines())
        .store(store)
        .routes(ROUTES)
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let url = proxy.url("/v1/payments");

    let traffic = Traffic::start(&url, phases);
    traffic.wait_ok(BEFORE, 50, "answers before the cut").await;

    // The cut is made between two requests of every client, once the replica
    // has everything the master wrote: a key answered before the cut is on
    // the replica, one sent after it is not (no key is half on it).
    traffic.pause().await;
    setup.wait_replica_caught_up().await;
    setup.cut_replica_off().await;
    traffic.enter(LAGGING);
    traffic.resume();
    if wait_replicas {
        let what = "fresh keys refused while the replica is cut off";
        traffic.wait_refused(LAGGING, 8, what).await;
    } else {
        let what = "fresh keys answered by the master alone";
        traffic.wait_ok(LAGGING, 20, what).await;
    }

    // Killed under traffic: a key answered before `KILLING` was entered was
    // acknowledged by the master before it died.
    traffic.enter(KILLING);
    setup.master.kill();
    let killed = Instant::now();
    traffic.enter(FAILING);
    setup.wait_replica_promoted().await;
    let promoted = Instant::now();
    traffic.enter(PROMOTED);
    Failover {
        setup,
        upstream,
        proxy,
        url,
        traffic,
        killed,
        promoted,
    }
}

/// What one failover showed, once the traffic has stopped and every answered
/// key was retried.
struct Run {
    log: Log,
    settled: Settled,
}

impl Failover {
    async fn finish(self, name: &str) -> Run {
        let log = self.traffic.stop().await;
        let settled = failover::settle(&self.url, &log, &self.upstream).await;
        let first = (FAILING..log.phases.len() as u8)
            .filter_map(|p| log.first_ok[p as usize])
            .min()
            .expect("a fresh key answered after the failover");
        eprintln!(
            "{name}: killed → promoted {:?}; first fresh key answered {:?} after the kill, \
             {:?} after the promotion; fresh keys: {}",
            self.promoted - self.killed,
            first - self.killed,
            first - self.promoted,
            log.counts()
        );
        Run { log, settled }
    }
}

/// `wait_replicas = 0`: the keys the master answered while its replica was
/// cut off are lost with it, and their retries run again; nothing answered
/// before the cut is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_loses_what_the_replica_had_not_received() {
    let failover = until_promoted(&PHASES[..=PROMOTED as usize], false).await;
    failover
        .traffic
        .wait_ok(PROMOTED, 20, "fresh keys answered after the promotion")
        .await;
    let Run { log, settled } = &failover.finish("wait_replicas = 0").await;

    // What the replica had: every key answered before the cut. What it had
    // not: every key answered during the lag. Both exactly (the cut fell
    // between requests, and these answers came before the kill began), so
    // the test counts keys, not a guess: all of the first replay, all of
    // the second run again. A key whose answer came while the master was
    // being killed may go either way: its record, not taken by the dying
    // master, is written again in the background and may reach the promoted
    // replica before the key's retry does.
    let set = |keys: Vec<&String>| -> BTreeSet<String> { keys.into_iter().cloned().collect() };
    let before = set(log.keys(BEFORE, |_| true));
    let lagged = set(log.keys(LAGGING, |came| came == LAGGING));
    let mut in_flight = set(log.keys(LAGGING, |came| came >= KILLING));
    in_flight.extend(set(log.keys(KILLING, |_| true)));
    let after = set(log
        .answered
        .keys()
        .filter(|k| log.answered[*k].sent >= FAILING)
        .collect());
    let not_replayed: BTreeSet<String> = settled.not_replayed.keys().cloned().collect();
    let twice: BTreeSet<String> = settled.twice.keys().cloned().collect();

    let lost_before: Vec<_> = before.intersection(&not_replayed).collect();
    assert!(
        lost_before.is_empty(),
        "answered before the cut, and lost: {lost_before:?}"
    );
    assert!(
        lagged.len() >= 20,
        "{} keys answered during the lag",
        lagged.len()
    );
    let kept: Vec<_> = lagged.difference(&not_replayed).collect();
    assert!(
        kept.is_empty(),
        "answered during the lag, yet replayed: {kept:?}"
    );
    let lost_after: Vec<_> = after.intersection(&not_replayed).collect();
    assert!(
        lost_after.is_empty(),
        "answered after the kill, and lost: {lost_after:?}"
    );
    let in_flight_lost = in_flight.intersection(&not_replayed).count();
    assert_eq!(
        not_replayed.len(),
        lagged.len() + in_flight_lost,
        "lost: only keys answered during the lag: {:?}",
        settled.not_replayed
    );
    // A lost key ran twice (its retry), no other key did, none more than twice.
    assert_eq!(
        twice, not_replayed,
        "the keys executed twice are the lost ones"
    );
    assert!(
        settled.twice.values().all(|&n| n == 2),
        "{:?}",
        settled.twice
    );
    assert_eq!(
        settled.executed,
        log.answered.len(),
        "every executed key was answered"
    );
    eprintln!(
        "{} acknowledged records: {} answered before the cut, all replayed; {} answered during \
         the lag, all lost (run again by their retry); {in_flight_lost} of {} answered as the \
         master was killed lost; {} answered after the kill, all replayed; {} keys executed",
        log.answered.len(),
        before.len(),
        lagged.len(),
        in_flight.len(),
        after.len(),
        settled.executed
    );
}

/// `wait_replicas = 1`: while the replica is cut off, no fresh key is
/// forwarded (503: its reservation cannot be replicated), so the failover
/// loses nothing acknowledged and runs nothing twice. The promoted master
/// takes fresh keys again once it has a replica of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_replicas_nothing_acknowledged_is_lost() {
    let failover = until_promoted(&PHASES, true).await;
    // The promoted master has no replica: its reservations are not
    // replicated either, and fresh keys get 503 (seen in the proxy's log).
    let short = "replicas in time";
    let so_far = failover.proxy.log_count(short);
    failover.proxy.wait_nth_log(short, so_far + 1).await;
    failover.traffic.enter(ATTACHING);
    let dir = tempfile::tempdir().unwrap();
    let _new_replica = replica_of(dir.path(), failover.setup.replica.port).await;
    let replicated = Instant::now();
    failover.traffic.enter(REPLICATED);
    failover
        .traffic
        .wait_ok(REPLICATED, 20, "fresh keys answered with a new replica")
        .await;
    let promoted = failover.promoted;
    let Run { log, settled } = &failover.finish("wait_replicas = 1").await;
    let first = log.first_ok[REPLICATED as usize].unwrap();
    eprintln!(
        "new replica in sync {:?} after the promotion; first fresh key answered {:?} after that",
        replicated - promoted,
        first - replicated
    );

    // Answered before the new replica was started: forwarded unreplicated.
    let unreplicated: Vec<_> = log
        .answered
        .iter()
        .filter(|(_, a)| (LAGGING..=PROMOTED).contains(&a.came))
        .map(|(k, _)| k)
        .collect();
    assert!(
        unreplicated.is_empty(),
        "fresh keys answered while the master had no replica in sync: {unreplicated:?}"
    );
    assert!(log.wrong_retries.is_empty(), "{:?}", log.wrong_retries);
    settled.assert_nothing_lost(log);
    // Refused keys never reached the upstream.
    assert_eq!(
        settled.executed,
        log.answered.len(),
        "every executed key was answered"
    );
    eprintln!(
        "{} acknowledged records, all replayed from the promoted replica; {} keys executed, none twice",
        log.answered.len(),
        settled.executed
    );
}

/// Found by the fault campaign (`sentinel-wait`): a `SENTINEL FAILOVER`
/// while a request is at the upstream. The old master stays up and takes
/// writes until a sentinel turns it into a replica (up to ten seconds);
/// the proxy's connection stays with it, so the completion landed there,
/// its `WAIT` fell short, and it was lost with the old master though the
/// client had its 201: the retry got 409, then 502 `outcome-unknown`. Now a
/// `WAIT` that falls short asks the sentinels which master they name, the
/// completion is written again on the new master, and the retry replays the
/// answer even with the old master gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_replicas_a_completion_after_a_sentinel_failover_goes_to_the_new_master() {
    let mut setup = SentinelSetup::start().await;
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .redis_store(&setup.store_lines())
        .store("wait_replicas = 1\nwait_timeout = \"100ms\"")
        .route("payments", "/v1/payments", "lease = \"2s\"")
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let url = proxy.url("/v1/payments");

    // Reserved and replicated, then held at the upstream.
    let first = support::Call::post(&url)
        .key("k-failover")
        .header("x-test-hold", "1")
        .without_deadline()
        .spawn("{\"amount\": 1}");
    upstream.wait_hits(1).await;
    setup.wait_replica_caught_up().await;
    let sentinel = setup.sentinels[0].port;
    support::redis_cmd(sentinel, &["SENTINEL", "FAILOVER", "mymaster"])
        .await
        .expect("SENTINEL FAILOVER");
    setup.wait_replica_promoted().await;
    // The old master still says it is one (the sentinels convert it later).
    let role = support::info_field(setup.master.port, "replication", "role").await;
    assert_eq!(
        role.as_deref(),
        Some("master"),
        "the old master was converted already"
    );

    upstream.release(1);
    let answered = first.await.unwrap();
    assert_eq!(answered.status, 201, "{answered:?}");
    // The proxy stores the record in the background, writing it again while
    // WAIT falls short, until the lease is over (the new master has no
    // replica yet either).
    proxy.wait_log("before its retries ran out").await;
    // Only the new master is left: the answer must come from there.
    setup.master.kill();
    let again = support::eventually("the retry to be answered", support::DEADLINE, || {
        let url = url.clone();
        async move {
            let r = support::Call::post(&url)
                .key("k-failover")
                .body("{\"amount\": 1}")
                .await;
            (r.status != 503 && r.status != 409).then_some(r)
        }
    })
    .await;
    assert_eq!(again.status, 201, "{again:?}");
    assert!(again.is_replay(), "not a replay: {:?}", again.headers);
    assert_eq!(upstream.hits(), 1, "the upstream ran it once");
}
