//! Hostile and abnormal conditions (contract §8): reservations never orphaned,
//! records the proxy cannot read never bypassed.

mod support;

use std::time::Duration;

use support::relay::{Fault, Relay};
use support::*;

const ROUTES: &str =
    "[[routes]]\nname = \"payments\"\npath = \"/v1/payments\"\non_store_error = \"pass\"\n";

fn redis_store(url: &str, extra: &str) -> String {
    format!("[store]\nbackend = \"redis\"\nurl = \"{url}\"\n{extra}\n")
}

/// The store key of a client key sent without scope headers.
fn store_key(key: &str) -> String {
    format!("idemproxy:{}", idemproxy::key::record_id([], key))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_wait_releases_the_reservation_and_never_forwards() {
    // WAIT unknown to the server: like an ACL without +wait.
    let redis = RedisServer::start_with(&["--rename-command", "WAIT", ""]).await;
    let upstream = TestUpstream::start().await;
    let store = redis_store(&redis.url(), "wait_replicas = 1");
    let proxy = Proxy::start(&config_text(&upstream.url(), &store, ROUTES)).await;
    let r = Call::post(&proxy.url("/v1/payments"))
        .key("k-wait")
        .body("x")
        .await;
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        upstream.hits(),
        0,
        "never forwarded, even with on_store_error = pass"
    );
    assert!(
        redis.keys().await.is_empty(),
        "released by its token, not left `processing` for a lease"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_while_the_reserve_is_in_flight_leaves_no_reservation() {
    let redis = RedisServer::start().await;
    let relay = Relay::start(([127, 0, 0, 1], redis.port).into()).await;
    let upstream = TestUpstream::start().await;
    let url = format!("redis://{}/0", relay.addr);
    let store = redis_store(&url, "op_timeout = \"3s\"");
    let proxy = Proxy::start(&config_text(&upstream.url(), &store, ROUTES)).await;
    // The reserve takes 2 × 300 ms; the client gives up after 100 ms.
    relay.set(Fault::Delay(300));
    let call = Call::post(&proxy.url("/v1/payments"))
        .key("k-hangup")
        .body("x");
    assert!(tokio::time::timeout(Duration::from_millis(100), call)
        .await
        .is_err());
    let released = eventually("the reservation to be released", DEADLINE, || async {
        let releases = metric(
            &proxy,
            "idemproxy_store_duration_seconds_count{op=\"release\"}",
        )
        .await;
        (releases >= 1.0 && redis.keys().await.is_empty()).then_some(())
    });
    released.await;
    assert_eq!(
        upstream.hits(),
        0,
        "nothing was forwarded for a client that left"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_the_proxy_cannot_read_is_500_never_forwarded_or_bypassed() {
    let redis = RedisServer::start().await;
    let upstream = TestUpstream::start().await;
    let store = redis_store(&redis.url(), "");
    let proxy = Proxy::start(&config_text(&upstream.url(), &store, ROUTES)).await;
    // Garbage, and a record of a newer format version than this build knows.
    let mut newer = vec![99u8, b'F'];
    newer.extend_from_slice(&[0; 64]);
    let _: () = redis
        .cmd(&["SET", &store_key("k-garbage"), "not a record"])
        .await;
    let mut conn = redis.conn().await.unwrap();
    let _: () = redis::cmd("SET")
        .arg(store_key("k-newer"))
        .arg(newer)
        .query_async(&mut conn)
        .await
        .unwrap();
    for key in ["k-garbage", "k-newer", "k-garbage"] {
        let r = Call::post(&proxy.url("/v1/payments"))
            .key(key)
            .body("x")
            .await;
        assert_eq!(r.status, 500, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["type"], "record-unreadable");
        assert_eq!(r.json()["retryable"], false);
    }
    assert_eq!(
        upstream.hits(),
        0,
        "never forwarded, even with on_store_error = pass"
    );
    let counted = metric(
        &proxy,
        "idemproxy_requests_total{route=\"payments\",outcome=\"unreadable\"}",
    );
    assert_eq!(counted.await, 3.0);
    assert_eq!(
        metric(&proxy, "idemproxy_store_up").await,
        1.0,
        "an unreadable record is not a store outage"
    );
    assert!(proxy
        .logs()
        .iter()
        .any(|l| l.contains("cannot be read") && l.contains(&store_key("k-garbage")[10..])));
}
