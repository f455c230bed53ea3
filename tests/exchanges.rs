//! Every exchange counts until it ends, and sending has a deadline per stream
//! (§8): clients that reset their HTTP/2 streams or hang up once their
//! requests are under way cannot multiply the upstream exchanges beyond the
//! cap on requests in progress, and an HTTP/2 stream whose window stays shut
//! is reset (its connection closed) within `client_write_timeout` and a
//! margin, giving back what it held, while HTTP/1.1 clients are served all
//! along. The HTTP/2 peer is the `h2` crate's client, told to misbehave.

mod support;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use support::*;

/// Requests in progress at once (per protocol): small, so that a burst goes far beyond it.
const CAP: usize = 4;
/// How long the test upstream takes over each exchange of a burst.
const SLOW_MS: u64 = 2000;
/// Waves of `CAP` clients that go away once their request is under way.
const WAVES: usize = 4;

async fn env(server: &str) -> Env {
    let lines = format!("max_connections = {CAP}\n{server}");
    Env::builder(Backend::Memory).server(&lines).start().await
}

/// An HTTP/2 connection from the `h2` crate's client (driven by a task of its
/// own) and its ping handle; `window`: the initial window of every stream.
async fn h2_client(
    addr: SocketAddr,
    window: Option<u32>,
) -> (h2::client::SendRequest<Bytes>, h2::PingPong) {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let mut builder = h2::client::Builder::new();
    if let Some(w) = window {
        builder.initial_window_size(w);
    }
    let (send, mut conn) = builder.handshake(tcp).await.expect("h2 handshake");
    let pings = conn.ping_pong().expect("ping handle");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    (send, pings)
}

/// A protected POST to the proxy at `addr` over HTTP/2.
fn h2_post(addr: SocketAddr, key: &str, extra: &[(&str, &str)]) -> Request<()> {
    let mut b = Request::post(format!("http://{addr}/v1/payments")).header("idempotency-key", key);
    for (k, v) in extra {
        b = b.header(*k, *v);
    }
    b.body(()).expect("request")
}

/// The body each burst request sends with key `key`.
fn body_of(key: &str) -> String {
    format!("amount=1&for={key}")
}

/// How many times the upstream executed each idempotency key.
fn executions(upstream: &TestUpstream) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for seen in upstream.seen() {
        if let Some(k) = seen.headers.get("idempotency-key") {
            let k = String::from_utf8_lossy(k.as_bytes()).into_owned();
            *counts.entry(k).or_insert(0) += 1;
        }
    }
    counts
}

/// While the burst's exchanges are under way: `idemproxy_inflight` is the
/// number of exchanges the upstream is working on (it counts them whether or
/// not their client is still there).
async fn inflight_matches_the_upstream(env: &Env) {
    eventually(
        "idemproxy_inflight to equal the exchanges under way",
        DEADLINE,
        || async {
            let active = env.upstream.active();
            let inflight = env.metric("idemproxy_inflight").await;
            (active > 0 && inflight == active as f64 && env.upstream.active() == active)
                .then_some(())
        },
    )
    .await;
}

/// After the burst: every exchange ended (and the gauge with it), none ran
/// beside more than `CAP - 1` others, and every key is settled: a retry
/// replays what ran (never a second execution), or runs what never reached the upstream.
async fn every_key_settled_once(env: &Env, keys: &[String]) {
    eventually("the burst's exchanges to end", DEADLINE, || async {
        let inflight = env.metric("idemproxy_inflight").await;
        (env.upstream.active() == 0 && inflight == 0.0).then_some(())
    })
    .await;
    let peak = env.upstream.peak();
    assert!(
        (1..=CAP).contains(&peak),
        "{peak} upstream exchanges at once; the cap on requests in progress is {CAP}"
    );
    let ran = executions(&env.upstream);
    for key in keys {
        let retry = eventually(
            &format!("a retry of {key} not refused as in progress"),
            DEADLINE,
            || async {
                let r = Call::post(&env.url("/v1/payments"))
                    .key(key)
                    .body(body_of(key))
                    .await;
                (r.status != 409).then_some(r)
            },
        )
        .await;
        assert_eq!(retry.status, 201, "{key}: {retry:?}");
        assert_eq!(
            retry.is_replay(),
            ran.contains_key(key),
            "{key}: a key that ran is replayed, one that never reached the upstream runs now"
        );
    }
    for (key, n) in executions(&env.upstream) {
        assert_eq!(n, 1, "{key} executed {n} times");
    }
}

/// Keys that were answered (a 503 `proxy-busy` beyond the cap, here).
type Answered = Arc<Mutex<HashSet<String>>>;

/// Waits until each of `keys` has reached the upstream or been answered:
/// then its client may go away with the exchange under way, if there is one.
async fn until_each_is_under_way_or_answered(env: &Env, keys: &[String], answered: &Answered) {
    eventually("each request under way or answered", DEADLINE, || async {
        let ran = executions(&env.upstream);
        let answered = answered.lock().expect("answered").clone();
        keys.iter()
            .all(|k| ran.contains_key(k) || answered.contains(k))
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_reset_after_sending_cannot_multiply_upstream_exchanges() {
    let env = env("").await;
    let (mut send, _pings) = h2_client(env.proxy.addr, None).await;
    let delay = SLOW_MS.to_string();
    let answered = Answered::default();
    let mut keys = Vec::new();
    // Waves of as many streams as the cap; each stream is reset once its
    // request is under way. Another wave follows at once: the exchanges of
    // the last are still running, and must still hold their places.
    for wave in 0..WAVES {
        let mut streams = Vec::new();
        let wave_keys: Vec<String> = (0..CAP).map(|i| format!("k-rst-{wave}-{i}")).collect();
        for key in &wave_keys {
            send = send.ready().await.expect("stream allowed");
            let req = h2_post(env.proxy.addr, key, &[("x-test-delay-ms", &delay)]);
            let (answer, mut stream) = send.send_request(req, false).expect("HEADERS");
            stream
                .send_data(Bytes::from(body_of(key)), true)
                .expect("DATA");
            let (answered, key) = (answered.clone(), key.clone());
            tokio::spawn(async move {
                if answer.await.is_ok() {
                    answered.lock().expect("answered").insert(key);
                }
            });
            streams.push(stream);
        }
        until_each_is_under_way_or_answered(&env, &wave_keys, &answered).await;
        for mut stream in streams {
            stream.send_reset(h2::Reason::CANCEL);
        }
        keys.extend(wave_keys);
    }
    inflight_matches_the_upstream(&env).await;
    every_key_settled_once(&env, &keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_clients_that_hang_up_after_sending_cannot_multiply_upstream_exchanges() {
    let env = env("").await;
    let answered = Answered::default();
    let mut keys = Vec::new();
    // As over HTTP/2: waves of as many clients as the cap, each hanging up
    // once its request is under way.
    for wave in 0..WAVES {
        let (hang_up, hung_up) = watch::channel(false);
        let wave_keys: Vec<String> = (0..CAP).map(|i| format!("k-gone-{wave}-{i}")).collect();
        for key in &wave_keys {
            let body = body_of(key);
            let request = format!(
                "POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\nx-test-delay-ms: {SLOW_MS}\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            let mut s = TcpStream::connect(env.proxy.addr).await.expect("connect");
            s.write_all(request.as_bytes()).await.expect("write");
            let (answered, key, mut hung_up) = (answered.clone(), key.clone(), hung_up.clone());
            tokio::spawn(async move {
                let mut byte = [0u8; 1];
                tokio::select! {
                    Ok(1) = s.read(&mut byte) => {
                        answered.lock().expect("answered").insert(key);
                    }
                    // Hangs up without waiting for the answer.
                    _ = hung_up.wait_for(|h| *h) => {}
                }
            });
        }
        until_each_is_under_way_or_answered(&env, &wave_keys, &answered).await;
        hang_up.send_replace(true);
        keys.extend(wave_keys);
    }
    inflight_matches_the_upstream(&env).await;
    every_key_settled_once(&env, &keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_stream_whose_window_stays_shut_is_reset_and_gives_back_what_it_held() {
    const WRITE_TIMEOUT: Duration = Duration::from_secs(1);
    const LARGE: usize = 900_000;
    // Room for one large answer and its record's copy (both count while it
    // is stored), not for two answers and a copy.
    let env = env("client_write_timeout = \"1s\"\nmax_buffered = \"2MiB\"").await;
    let addr = env.proxy.addr;
    // Every stream's window 0, never opened; pings keep the connection lively.
    let (mut send, mut pings) = h2_client(addr, Some(0)).await;
    let pinging = tokio::spawn(async move {
        while pings.ping(h2::Ping::opaque()).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    // One protected answer that holds most of the memory budget, and
    // pass-through answers: as many streams as there are requests in progress.
    let large = LARGE.to_string();
    let mut stuck = Vec::new();
    for i in 0..CAP {
        send = send.ready().await.expect("stream allowed");
        let req = if i == 0 {
            h2_post(addr, "k-shut", &[("x-test-body-bytes", &large)])
        } else {
            Request::get(format!("http://{addr}/things/{i}"))
                .body(())
                .expect("request")
        };
        let (answer, mut stream) = send.send_request(req, false).expect("HEADERS");
        let body = if i == 0 {
            body_of("k-shut")
        } else {
            String::new()
        };
        stream.send_data(Bytes::from(body), true).expect("DATA");
        stuck.push(answer);
    }
    let mut bodies = Vec::new();
    for answer in stuck {
        let resp = tokio::time::timeout(DEADLINE, answer)
            .await
            .expect("the answer's headers (not flow-controlled)")
            .expect("an answer");
        assert_eq!(resp.status(), 201);
        bodies.push(resp.into_body());
    }
    let stuck_at = Instant::now();
    let held = env.metric("idemproxy_buffered_bytes").await;
    assert!(
        held >= LARGE as f64,
        "the stuck answer holds its room: {held}"
    );

    // HTTP/1.1 clients are served while every HTTP/2 permit is held.
    let h1 = Call::post(&env.url("/v1/payments"))
        .key("k-h1-meanwhile")
        .body("amount=2")
        .await;
    assert_eq!(
        h1.status, 201,
        "an HTTP/1.1 client beside stuck HTTP/2 streams: {h1:?}"
    );

    // Each stuck stream is reset within client_write_timeout and a margin,
    // though the connection stays lively; none of them delivered its body.
    for mut body in bodies {
        let ended = tokio::time::timeout(DEADLINE, body.data())
            .await
            .expect("the stuck stream is reset");
        assert!(
            !matches!(ended, Some(Ok(ref b)) if !b.is_empty()),
            "no window, no data: {ended:?}"
        );
    }
    let took = stuck_at.elapsed();
    assert!(
        took < WRITE_TIMEOUT + Duration::from_secs(3),
        "reset after {took:?}; client_write_timeout is {WRITE_TIMEOUT:?}"
    );
    pinging.abort();

    // What the streams held is back: the budget takes a large answer whole again.
    eventually("the budget to be given back", DEADLINE, || async {
        (env.metric("idemproxy_buffered_bytes").await == 0.0).then_some(())
    })
    .await;
    let fresh = Call::post(&env.url("/v1/payments"))
        .key("k-after")
        .header("x-test-body-bytes", &large)
        .body("amount=3")
        .await;
    assert_eq!((fresh.status, fresh.body.len()), (201, LARGE));
    let again = Call::post(&env.url("/v1/payments"))
        .key("k-after")
        .body("amount=3")
        .await;
    assert!(again.is_replay(), "{again:?}");
    assert_eq!(
        (again.status, again.body.len()),
        (201, LARGE),
        "kept whole, not 410"
    );
    // The stuck answer was recorded all the same, executed once.
    let replay = Call::post(&env.url("/v1/payments"))
        .key("k-shut")
        .body(body_of("k-shut"))
        .await;
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(replay.body.len(), LARGE);
    assert_eq!(executions(&env.upstream).get("k-shut"), Some(&1));
}
