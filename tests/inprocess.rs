//! Time as the subject, in-process with paused time: a record's TTL, a lease the owner
//! renews, and `concurrent = "wait"` — hours and leases pass in milliseconds.
//! (See tests/support/inprocess.rs for why the clock runs during I/O.)

mod support;

use std::time::Duration;

use support::*;

const LEASE: Duration = Duration::from_secs(3);
const WAIT_TIMEOUT: Duration = Duration::from_secs(10);

const TIMED_ROUTES: &str = r#"
[[routes]]
name = "ttl"
path = "/v1/ttl"
ttl = "1h"

[[routes]]
name = "lease"
path = "/v1/lease"
lease = "3s"

[[routes]]
name = "wait"
path = "/v1/wait"
lease = "3s"
concurrent = "wait"
wait_timeout = "10s"
"#;

/// Lets `d` of paused time pass, then lets the clock run again. While paused, the runtime
/// jumps from one due timer to the next, so renewals and retries fire in order.
async fn let_time_pass(d: Duration) {
    tokio::time::pause();
    tokio::time::sleep(d).await;
    tokio::time::resume();
}

/// Waits until a second request has tried to reserve (found the key held, and waits).
async fn second_reservation(proxy: &InProcess) {
    let series = "idemproxy_store_duration_seconds_count{op=\"reserve\"}";
    eventually("a second reservation attempt", DEADLINE, || async move {
        (proxy.metric(series).await >= 2.0).then_some(())
    })
    .await;
}

fn retry_after(r: &Resp) -> u64 {
    r.header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("a Retry-After in seconds: {r:?}"))
}

#[tokio::test]
async fn a_finished_record_replays_until_its_ttl_and_executes_again_after_it() {
    let proxy = InProcess::start(TIMED_ROUTES).await;
    let url = proxy.url("/v1/ttl");
    let first = Call::post(&url).key("k-ttl").body("x").await;
    assert_eq!(first.status, 201);

    let_time_pass(Duration::from_secs(3600 - 5)).await;
    let replay = Call::post(&url).key("k-ttl").body("x").await;
    assert!(
        replay.is_replay(),
        "5 s before the 1 h TTL the record replays"
    );
    assert_eq!(replay.body, first.body);

    let_time_pass(Duration::from_secs(10)).await;
    let again = Call::post(&url).key("k-ttl").body("x").await;
    assert_eq!(again.status, 201);
    assert!(!again.is_replay(), "after the TTL the key executes again");
    assert_eq!(again.json()["n"], 2);
    assert_eq!(proxy.upstream.hits(), 2);
}

#[tokio::test]
async fn a_held_request_keeps_its_key_for_many_leases_because_the_owner_renews() {
    let proxy = InProcess::start(TIMED_ROUTES).await;
    let url = proxy.url("/v1/lease");
    let held = Call::post(&url)
        .key("k-held")
        .header("x-test-hold", "1")
        .without_deadline()
        .spawn("x");
    proxy.upstream.wait_hits(1).await;

    for leases in 1..=5 {
        let_time_pass(LEASE).await;
        let retry = Call::post(&url).key("k-held").body("x").await;
        assert_eq!(
            retry.status, 409,
            "after {leases} leases the owner still holds the key"
        );
        let after = retry_after(&retry);
        assert!(
            (1..=LEASE.as_secs()).contains(&after),
            "Retry-After {after} is within the lease"
        );
    }
    assert_eq!(proxy.upstream.hits(), 1, "no retry was forwarded");

    proxy.upstream.release(1);
    let first = held.await.unwrap();
    assert_eq!(first.status, 201);
    let replay = Call::post(&url).key("k-held").body("x").await;
    assert!(replay.is_replay());
    assert_eq!(replay.body, first.body);
    assert_eq!(
        proxy
            .metric("idemproxy_lease_lost_total{route=\"lease\"}")
            .await,
        0.0
    );
}

#[tokio::test]
async fn a_waiter_gets_the_replay_once_the_first_finishes() {
    let proxy = InProcess::start(TIMED_ROUTES).await;
    let url = proxy.url("/v1/wait");
    let first = Call::post(&url)
        .key("k-wait")
        .header("x-test-hold", "1")
        .without_deadline()
        .spawn("x");
    proxy.upstream.wait_hits(1).await;
    let waiter = Call::post(&url).key("k-wait").without_deadline().spawn("x");
    second_reservation(&proxy).await;

    // Longer than a lease, within wait_timeout: the waiter neither answers nor executes.
    let_time_pass(WAIT_TIMEOUT - Duration::from_secs(2)).await;
    assert!(!waiter.is_finished(), "the waiter waits for the first");

    proxy.upstream.release(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    let second = waiter.await.unwrap();
    assert_eq!(second.status, 201);
    assert!(second.is_replay(), "the waiter gets the first answer");
    assert_eq!(second.body, first.body);
    assert_eq!(proxy.upstream.hits(), 1);
}

#[tokio::test]
async fn a_waiter_gets_409_once_wait_timeout_passes() {
    let proxy = InProcess::start(TIMED_ROUTES).await;
    let url = proxy.url("/v1/wait");
    let first = Call::post(&url)
        .key("k-wait")
        .header("x-test-hold", "1")
        .without_deadline()
        .spawn("x");
    proxy.upstream.wait_hits(1).await;
    let waiter = Call::post(&url).key("k-wait").without_deadline().spawn("x");
    second_reservation(&proxy).await;

    let_time_pass(WAIT_TIMEOUT - Duration::from_secs(1)).await;
    assert!(!waiter.is_finished(), "still within wait_timeout");
    let_time_pass(Duration::from_secs(2)).await;
    // Real time, and little of it: the wait is measured on the (paused) clock.
    let r = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .expect("the waiter answers once wait_timeout has passed")
        .unwrap();
    assert_eq!(r.status, 409);
    let after = retry_after(&r);
    assert!(
        (1..=LEASE.as_secs()).contains(&after),
        "Retry-After {after} is within the lease"
    );
    assert_eq!(proxy.upstream.hits(), 1, "the waiter was not forwarded");

    proxy.upstream.release(1);
    assert_eq!(first.await.unwrap().status, 201);
}
