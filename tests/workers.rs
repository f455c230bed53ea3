//! The worker threads (`[server] workers`, `runtime`): with a runtime per
//! thread, connections are spread over the workers and each worker has its
//! own store connection; the work-stealing runtime serves and drains as well.

mod support;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use support::*;
use tokio::net::TcpStream;

/// A client connection held open (keep-alive) until dropped.
struct Held {
    sender: SendRequest<Full<Bytes>>,
}

impl Held {
    async fn open(proxy: &Proxy) -> Held {
        let stream = TcpStream::connect(proxy.addr).await.expect("connect");
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .expect("handshake");
        tokio::spawn(conn);
        Held { sender }
    }

    /// A protected POST with its own key: the worker's store connection is used.
    async fn pay(&mut self, key: &str) -> u16 {
        let req = http::Request::post("/v1/payments")
            .header("host", "proxy")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let resp = self.sender.send_request(req).await.expect("answer");
        let status = resp.status().as_u16();
        resp.into_body().collect().await.expect("body");
        status
    }
}

/// Connections the test's Redis has, but the one asking.
async fn store_connections(redis: &RedisServer) -> usize {
    let list: String = redis.cmd(&["CLIENT", "LIST"]).await;
    list.lines()
        .filter(|l| !l.contains("cmd=client|list"))
        .count()
}

async fn worker_connections(proxy: &Proxy, worker: usize) -> f64 {
    metric(
        proxy,
        &format!("idemproxy_worker_connections{{worker=\"{worker}\"}}"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_go_to_the_least_loaded_worker_and_each_worker_has_its_own_store_connection() {
    let redis = RedisServer::start().await;
    let upstream = TestUpstream::start().await;
    let text = ConfigBuilder::new(&upstream.url())
        .server("workers = 2")
        .redis(&redis)
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    // The health ping's connection (every thread that is not a worker shares it).
    eventually("the ping's store connection", DEADLINE, || async {
        (store_connections(&redis).await == 1).then_some(())
    })
    .await;
    let mut held = Vec::new();
    for i in 0..4 {
        let mut conn = Held::open(&proxy).await;
        assert_eq!(conn.pay(&format!("k-{i}")).await, 201);
        held.push(conn);
    }
    // Handed out in turn to the worker with the fewest: two each.
    assert_eq!(worker_connections(&proxy, 1).await, 2.0);
    assert_eq!(worker_connections(&proxy, 2).await, 2.0);
    // Each worker made its own store connection for its requests.
    eventually("a store connection per worker", DEADLINE, || async {
        (store_connections(&redis).await == 3).then_some(())
    })
    .await;
    // Requests on any of them replay what any other stored: one store.
    for (i, conn) in held.iter_mut().enumerate() {
        let other = format!("k-{}", (i + 1) % 4);
        assert_eq!(conn.pay(&other).await, 201, "a replay keeps its status");
    }
    assert_eq!(upstream.hits(), 4);
    assert_eq!(
        metric(
            &proxy,
            "idemproxy_requests_total{route=\"payments\",outcome=\"replayed\"}"
        )
        .await,
        4.0
    );
    drop(held);
    eventually("the connections counted out", DEADLINE, || async {
        let open = worker_connections(&proxy, 1).await + worker_connections(&proxy, 2).await;
        (open == 0.0).then_some(())
    })
    .await;
    // A new connection goes to the first worker among equals.
    let mut conn = Held::open(&proxy).await;
    assert_eq!(conn.pay("k-new").await, 201);
    assert_eq!(worker_connections(&proxy, 1).await, 1.0);
    assert_eq!(worker_connections(&proxy, 2).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_work_stealing_runtime_serves_replays_and_drains_on_sigterm() {
    let redis = RedisServer::start().await;
    let upstream = TestUpstream::start().await;
    let text = ConfigBuilder::new(&upstream.url())
        .server("runtime = \"work_stealing\"\nworkers = 2")
        .redis(&redis)
        .build();
    let mut proxy = Proxy::start(&text).await;
    let url = proxy.url("/v1/payments");
    let first = Call::post(&url).key("k-ws").body("x").await;
    assert_eq!(first.status, 201);
    let again = Call::post(&url).key("k-ws").body("x").await;
    assert!(again.is_replay());
    assert_eq!(again.body, first.body);
    // No worker threads of its own: no per-worker series.
    let metrics = get(&proxy.admin_url("/metrics")).await.unwrap();
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(!text.contains("idemproxy_worker_connections{"), "{text}");
    // Draining: the request in flight gets its answer, then exit 0.
    let in_flight = Call::post(&url)
        .key("k-ws-held")
        .header("x-test-hold", "1")
        .spawn("y");
    upstream.wait_hits(2).await;
    proxy.signal("TERM");
    proxy.wait_log("shutting down").await;
    upstream.release(1);
    assert_eq!(in_flight.await.unwrap().status, 201);
    assert_eq!(proxy.wait_exit().await, Some(0));
}

#[test]
fn runtime_is_checked_at_load_time() {
    use idemproxy::config::{Config, Overrides, Runtime};
    let text = |p: &str| format!("[server]\nupstream = \"http://127.0.0.1:3000\"\n{p}");
    let load = |t: &str| Config::from_toml(t, "t.toml", &Overrides::default());
    let default = load(&text("")).expect("valid");
    assert_eq!(default.server.runtime, Runtime::PerThread);
    for (given, want) in [
        ("per_thread", Runtime::PerThread),
        ("work_stealing", Runtime::WorkStealing),
    ] {
        let c = load(&text(&format!("runtime = \"{given}\""))).expect("valid");
        assert_eq!(c.server.runtime, want);
        assert_eq!(want.to_string(), given);
    }
    let c = load(&text("workers = 3")).expect("valid");
    assert_eq!((c.server.worker_threads(), c.server.worker_slots()), (3, 4));
    let c = load(&text("workers = 3\nruntime = \"work_stealing\"")).expect("valid");
    assert_eq!((c.server.worker_threads(), c.server.worker_slots()), (3, 1));
    let e = load(&text("runtime = \"threads\""))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("t.toml:3:") && e.contains("server.runtime"),
        "{e}"
    );
}

/// A store connection that sent during a blackhole stays held by it. Once
/// the store answers again on another worker's connection, the worker whose
/// last operation failed makes its connection anew: a retry on it is
/// replayed, not sent down the dead connection (a 503 after `op_timeout`,
/// while the failed request's release still waits on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_the_store_answers_again_a_worker_whose_connection_failed_makes_it_anew() {
    use support::relay::{Fault, Relay};
    let redis = RedisServer::start().await;
    let relay = Relay::start(([127, 0, 0, 1], redis.port).into()).await;
    let upstream = TestUpstream::start().await;
    let text = ConfigBuilder::new(&upstream.url())
        .server("workers = 2")
        .redis_url(&format!("redis://{}/0", relay.addr))
        .store("op_timeout = \"500ms\"")
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    // One connection on each worker: a request on it uses that worker's store connection.
    let mut first = Held::open(&proxy).await;
    assert_eq!(first.pay("k-warm-1").await, 201);
    let mut second = Held::open(&proxy).await;
    assert_eq!(second.pay("k-warm-2").await, 201);
    assert_eq!(worker_connections(&proxy, 1).await, 1.0);
    assert_eq!(worker_connections(&proxy, 2).await, 1.0);

    // Only the second worker's connection sends during the blackhole: its
    // reserve times out, and its release waits another `op_timeout` on it.
    relay.set(Fault::Blackhole);
    assert_eq!(second.pay("k-b").await, 503);
    relay.set(Fault::Pass);

    // The first worker's connection sent nothing then: it answers at once.
    assert_eq!(first.pay("k-outage").await, 201);
    // The retry on the second worker, within that release's `op_timeout`.
    assert_eq!(second.pay("k-outage").await, 201, "replayed");
    assert_eq!(
        upstream.hits(),
        3,
        "two warm-ups and one execution of k-outage"
    );
}
