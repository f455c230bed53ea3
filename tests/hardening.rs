//! Hostile and abnormal conditions (contract §8): reservations never orphaned,
//! records the proxy cannot read never bypassed.

mod support;

use std::time::Duration;

use support::relay::{Fault, Relay};
use support::*;

/// One route that would pass requests through when the store fails, where allowed.
fn config(upstream: &TestUpstream, redis_url: &str) -> ConfigBuilder {
    ConfigBuilder::new(&upstream.url())
        .redis_url(redis_url)
        .route("payments", "/v1/payments", "on_store_error = \"pass\"")
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
    let text = config(&upstream, &redis.url())
        .store("wait_replicas = 1")
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
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
    let text = config(&upstream, &url).store("op_timeout = \"3s\"").build();
    let proxy = Proxy::in_process(&text, &[]).await;
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
    let proxy = Proxy::in_process(&config(&upstream, &redis.url()).build(), &[]).await;
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
    // An empty value: the reserve's read finds nothing, as when a key goes
    // between its `SET NX` and the read. It is sent again (three tries in
    // all), then judged as what it is, and left as it is.
    let _: () = redis.cmd(&["SET", &store_key("k-empty"), ""]).await;
    let before = redis.calls("set").await;
    let r = Call::post(&proxy.url("/v1/payments"))
        .key("k-empty")
        .body("x")
        .await;
    assert_eq!(r.status, 500, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["type"], "record-unreadable");
    assert_eq!(
        redis.calls("set").await - before,
        3,
        "the reserve is sent three times"
    );
    let left: String = redis.cmd(&["GET", &store_key("k-empty")]).await;
    assert_eq!(left, "", "an empty value is not overwritten");
    assert_eq!(
        upstream.hits(),
        0,
        "never forwarded, even with on_store_error = pass"
    );
    let counted = metric(
        &proxy,
        "idemproxy_requests_total{route=\"payments\",outcome=\"unreadable\"}",
    );
    assert_eq!(counted.await, 4.0);
    assert_eq!(
        metric(&proxy, "idemproxy_store_up").await,
        1.0,
        "an unreadable record is not a store outage"
    );
    let record = &store_key("k-garbage")[10..];
    proxy
        .wait_log_where("\"cannot be read\" naming the record", |l| {
            l.contains("cannot be read") && l.contains(record)
        })
        .await;
}

/// An upstream of raw bytes: counts request heads as they arrive, reads each
/// body by its Content-Length, keeps it, and answers with `answer` as given.
struct RawUpstream {
    url: String,
    heads: tokio::sync::watch::Receiver<usize>,
    bodies: std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
}

impl RawUpstream {
    async fn start(answer: &'static [u8]) -> RawUpstream {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, heads) = tokio::sync::watch::channel(0usize);
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = bodies.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let (tx, kept) = (tx.clone(), kept.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    tx.send_modify(|n| *n += 1);
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap_or(0));
                    while buf.len() < head_end + len {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    kept.lock()
                        .unwrap()
                        .push(buf[head_end..head_end + len].to_vec());
                    let _ = s.write_all(answer).await;
                    let _ = s.shutdown().await;
                });
            }
        });
        RawUpstream { url, heads, bodies }
    }
}

const FRESH_WITH_REPLAY_HEADER: &[u8] = b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\nIdempotent-Replayed: true\r\nConnection: close\r\n\r\nok";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstreams_own_replay_header_never_marks_a_fresh_answer() {
    let upstream = RawUpstream::start(FRESH_WITH_REPLAY_HEADER).await;
    let text = ConfigBuilder::new(&upstream.url)
        .route("payments", "/v1/payments", "")
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    let url = proxy.url("/v1/payments");
    let fresh = Call::post(&url).key("k-own-header").body("x").await;
    assert_eq!(fresh.status, 201);
    assert_eq!(fresh.header("idempotent-replayed"), None, "a fresh answer");
    let again = Call::post(&url).key("k-own-header").body("x").await;
    assert!(again.is_replay());
    assert_eq!(again.body, "ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_uuid_request_id_goes_upstream_unchanged_and_is_logged_beside_ours() {
    let upstream = TestUpstream::start().await;
    let text = ConfigBuilder::new(&upstream.url())
        .route("payments", "/v1/payments", "")
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    let r = Call::post(&proxy.url("/v1/payments"))
        .key("k-rid")
        .header("x-request-id", "order-42/attempt-1")
        .body("x")
        .await;
    assert_eq!(r.status, 201);
    assert_eq!(
        upstream.seen()[0].headers["x-request-id"],
        "order-42/attempt-1"
    );
    let line = proxy.wait_log("order-42/attempt-1").await;
    assert_eq!(line["client_request_id"], "order-42/attempt-1", "{line}");
    let ours = line["request_id"].as_str().unwrap_or_default();
    assert!(uuid::Uuid::parse_str(ours).is_ok(), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_forwards_a_slow_body_as_it_comes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut upstream = RawUpstream::start(
        b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\ndone",
    )
    .await;
    let config = ConfigBuilder::new(&upstream.url)
        .server("body_read_timeout = \"300ms\"")
        .route("payments", "/v1/payments", "mode = \"shadow\"")
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let addr = proxy
        .url("")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = "POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-slow\r\nContent-Length: 10\r\nConnection: close\r\n\r\n12345";
    client.write_all(head.as_bytes()).await.unwrap();
    // The proxy gives up reading after 300 ms and, in shadow mode, forwards what it has...
    let forwarded = upstream.heads.wait_for(|n| *n >= 1);
    tokio::time::timeout(DEADLINE, forwarded)
        .await
        .expect("forwarded")
        .unwrap();
    // ...and the rest as it comes.
    client.write_all(b"67890").await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(DEADLINE, client.read_to_end(&mut answer))
        .await
        .unwrap()
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("done"), "{answer}");
    assert_eq!(upstream.bodies.lock().unwrap()[0], b"1234567890");
}

/// A proxy with a 1 MiB memory budget in front of a test upstream (memory store).
async fn budgeted() -> (TestUpstream, Proxy) {
    let upstream = TestUpstream::start().await;
    let routes = "[defaults]\nmax_request_body = \"1MiB\"\n\n[[routes]]\nname = \"payments\"\npath = \"/v1/payments\"\n";
    let config = ConfigBuilder::new(&upstream.url())
        .server("max_buffered = \"1MiB\"")
        .routes(routes)
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    (upstream, proxy)
}

/// Holds a protected request with a 700 KiB body at the upstream: its room stays taken.
async fn hold_700k(
    upstream: &TestUpstream,
    proxy: &Proxy,
    key: &str,
) -> tokio::task::JoinHandle<Resp> {
    let before = upstream.hits();
    let held = Call::post(&proxy.url("/v1/payments"))
        .key(key)
        .header("x-test-hold", "1")
        .spawn(vec![b'h'; 700 * 1024]);
    upstream.wait_hits(before + 1).await;
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_room_in_the_budget_is_503_before_anything_is_reserved() {
    let (upstream, proxy) = budgeted().await;
    let url = proxy.url("/v1/payments");
    let held = hold_700k(&upstream, &proxy, "k-held").await;
    let r = Call::post(&url)
        .key("k-busy")
        .body(vec![b'b'; 500 * 1024])
        .await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["type"], "proxy-busy");
    assert_eq!(r.json()["retryable"], true);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(upstream.hits(), 1, "not forwarded");
    upstream.release(1);
    assert_eq!(held.await.unwrap().status, 201);
    // The room came back: the same request now goes through, once (nothing was reserved before).
    let r = Call::post(&url)
        .key("k-busy")
        .body(vec![b'b'; 500 * 1024])
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(r.json()["n"], 2);
    let busy = metric(
        &proxy,
        "idemproxy_requests_total{route=\"payments\",outcome=\"busy\"}",
    );
    assert_eq!(busy.await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_without_room_is_relayed_whole_and_kept_without_its_body() {
    let (upstream, proxy) = budgeted().await;
    let url = proxy.url("/v1/payments");
    let held = hold_700k(&upstream, &proxy, "k-held").await;
    let big = 500 * 1024;
    let r = Call::post(&url)
        .key("k-big-answer")
        .header("x-test-body-bytes", &big.to_string())
        .body("x")
        .await;
    assert_eq!(r.status, 201);
    assert_eq!(r.body, binary(big), "relayed whole");
    upstream.release(1);
    held.await.unwrap();
    let retry = Call::post(&url)
        .key("k-big-answer")
        .header("x-test-body-bytes", &big.to_string())
        .body("x")
        .await;
    assert_eq!(
        retry.status, 410,
        "the operation ran once; its answer was not kept"
    );
    assert_eq!(retry.json()["type"], "response-not-stored");
    assert_eq!(upstream.hits(), 2, "never executed again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_without_room_is_503_and_replays_once_there_is_room() {
    let (upstream, proxy) = budgeted().await;
    let url = proxy.url("/v1/payments");
    // Kept whole in a 1 MiB budget (the answer and its record's copy), too
    // large to replay beside a held 700 KiB body.
    let size = 400 * 1024;
    let call = || {
        Call::post(&url)
            .key("k-big-replay")
            .header("x-test-body-bytes", &size.to_string())
            .body("x")
    };
    assert_eq!(call().await.status, 201);
    let held = hold_700k(&upstream, &proxy, "k-held").await;
    let r = call().await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["type"], "proxy-busy");
    upstream.release(1);
    held.await.unwrap();
    let r = call().await;
    assert!(r.is_replay());
    assert_eq!(r.body, binary(size));
    assert_eq!(upstream.hits(), 2, "the big operation ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_disconnected_and_its_replay_memory_freed() {
    use tokio::io::AsyncWriteExt;
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .server("client_write_timeout = \"500ms\"")
        .route("payments", "/v1/payments", "max_response_body = \"32MiB\"")
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let size = 16 << 20;
    let first = Call::post(&proxy.url("/v1/payments"))
        .key("k-big")
        .header("x-test-body-bytes", &size.to_string())
        .body("x")
        .await;
    assert_eq!(first.body.len(), size);
    // A retry from a client with a tiny receive buffer that never reads.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let addr = proxy
        .url("")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .unwrap();
    let mut stalled = socket.connect(addr).await.unwrap();
    let retry = format!("POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-big\r\nx-test-body-bytes: {size}\r\nContent-Length: 1\r\n\r\nx");
    stalled.write_all(retry.as_bytes()).await.unwrap();
    let buffered = |at_least: f64, at_most: f64| {
        let proxy = &proxy;
        eventually(
            "idemproxy_buffered_bytes in range",
            DEADLINE,
            move || async move {
                let v = metric(proxy, "idemproxy_buffered_bytes").await;
                (at_least..=at_most).contains(&v).then_some(())
            },
        )
    };
    buffered((size / 2) as f64, f64::MAX).await; // the replay is held for the client...
    buffered(0.0, 0.0).await; // ...until client_write_timeout disconnects it
    drop(stalled);
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_closed_but_a_slow_request_is_not() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .server("idle_timeout = \"300ms\"\nheader_read_timeout = \"30s\"")
        .route("payments", "/v1/payments", "")
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    // A request that takes longer than idle_timeout at the upstream is not cut.
    let slow = Call::post(&proxy.url("/v1/payments"))
        .key("k-slow")
        .header("x-test-hold", "1")
        .spawn("x");
    upstream.wait_hits(1).await;
    tokio::time::sleep(Duration::from_millis(900)).await; // time is the subject: 3 × idle_timeout
    upstream.release(1);
    assert_eq!(slow.await.unwrap().status, 201);
    // A kept-alive connection with nothing to do is closed.
    let addr = proxy
        .url("")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    c.write_all(b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let eof = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut got)).await;
    assert!(eof.is_ok(), "closed after idle_timeout, not held open");
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 201"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_memory_store_refuses_new_keys_and_keeps_every_record() {
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .store("memory_limit = \"1000\"")
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let url = proxy.url("/v1/payments");
    // Each finished record holds the upstream's JSON echo (several hundred bytes).
    let mut answered = Vec::new();
    for i in 0..50 {
        let key = format!("k-fill-{i}");
        let r = Call::post(&url).key(&key).body("x").await;
        if r.status != 201 {
            assert_eq!(r.status, 503, "{:?}", r.body);
            assert_eq!(r.json()["type"], "store-unavailable");
            break;
        }
        answered.push(key);
    }
    assert!(!answered.is_empty() && answered.len() < 50, "{answered:?}");
    assert_eq!(
        upstream.hits(),
        answered.len(),
        "a refused key is not forwarded, even with on_store_error = pass"
    );
    for key in &answered {
        assert!(
            Call::post(&url).key(key).body("x").await.is_replay(),
            "{key} kept"
        );
    }
    proxy.wait_log("memory store full").await;
}
