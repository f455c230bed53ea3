//! PostgreSQL failover under traffic: a primary and a synchronous streaming
//! standby (`synchronous_standby_names = '*'`), both on loopback; the proxy
//! has both hosts in its URL with `target_session_attrs=read-write`. The
//! primary is SIGKILLed, the standby promoted: no acknowledged record is
//! lost, no key is executed twice, and fresh keys are answered again soon
//! after the promotion, without restarting the proxy.

mod support;

use std::time::Duration;

use tokio::time::Instant;

use support::failover::{self, Traffic, ROUTES};
use support::{ConfigBuilder, PgServer, Proxy, TestUpstream};

/// How soon after the promotion fresh keys must be answered again.
const RECOVERY: Duration = Duration::from_secs(1);

const BEFORE: u8 = 0;
const FAILING: u8 = 1;
const PROMOTED: u8 = 2;
const PHASES: [&str; 3] = ["before the kill", "no primary", "promoted"];

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

    let traffic = Traffic::start(&url, &PHASES);
    traffic.wait_ok(BEFORE, 50, "answers before the kill").await;

    // No waiting for the standby to catch up: with a synchronous standby,
    // every commit the proxy saw is on it already.
    primary.kill();
    traffic.enter(FAILING);
    let killed = Instant::now();
    // Traffic goes on against a store with no primary for a while.
    traffic
        .wait_refused(FAILING, 5, "requests refused while there is no primary")
        .await;
    // Recovery counts from the moment `pg_ctl promote` is run: fresh keys
    // sent from then on are the promoted phase's.
    let promoting = Instant::now();
    traffic.enter(PROMOTED);
    standby.promote().await;
    let promoted = Instant::now();
    traffic
        .wait_ok(PROMOTED, 20, "fresh keys answered after the promotion")
        .await;
    let log = traffic.stop().await;
    let recovered = log.first_ok[PROMOTED as usize]
        .expect("a fresh key answered after the promotion")
        - promoting;
    eprintln!(
        "killed → promote issued {:?}; promote took {:?} (until the server accepted writes); \
         first fresh key answered {recovered:?} after `pg_ctl promote`; fresh keys: {}",
        promoting - killed,
        promoted - promoting,
        log.counts()
    );
    assert!(
        recovered <= RECOVERY,
        "fresh keys answered again only {recovered:?} after the promotion"
    );
    assert!(log.wrong_retries.is_empty(), "{:?}", log.wrong_retries);

    // Settled: every key answered 2xx replays the same answer from the new
    // primary; every key the upstream executed was executed once.
    let settled = failover::settle(&url, &log, &upstream).await;
    settled.assert_nothing_lost(&log);
    eprintln!(
        "{} acknowledged records, all replayed from the promoted standby; {} keys executed, none twice",
        log.answered.len(),
        settled.executed
    );
}
