//! HTTP/2 cleartext (§9): curl with prior knowledge against the real proxy,
//! h2c to the upstream (`upstream_protocol`), and hostile HTTP/2 clients
//! (a stream flood that ignores the server's settings, an oversized header list).

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, Version};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use support::{curl, Answer, ConfigBuilder, Proxy, RedisServer, TestUpstream, DEADLINE};

const ROUTES: &str = r#"
[defaults]
lease = "10s"

[[routes]]
name = "payments"
path = "/v1/payments"
"#;

// ---------------------------------------------------------------------------
// curl, the client a user tries first.

const H2: &str = "--http2-prior-knowledge";
const H1: &str = "--http1.1";

async fn post(proto: &str, url: &str, key: Option<&str>, body: &str) -> Answer {
    let key_header = key.map(|k| format!("Idempotency-Key: {k}"));
    let mut args = vec![proto, "-X", "POST", "--data-binary", body];
    if let Some(h) = &key_header {
        args.extend(["-H", h.as_str()]);
    }
    args.push(url);
    curl(&args).await
}

async fn memory_proxy(upstream: &str, server_extra: &str) -> Proxy {
    let config = ConfigBuilder::new(upstream)
        .server(server_extra)
        .routes(ROUTES);
    Proxy::in_process(&config.build(), &[]).await
}

/// As [`memory_proxy`], the binary: for what only a process has (SIGTERM, its exit code).
async fn memory_proxy_binary(upstream: &str, server_extra: &str) -> Proxy {
    let config = ConfigBuilder::new(upstream)
        .server(server_extra)
        .routes(ROUTES);
    Proxy::start(&config.build()).await
}

async fn redis_proxy(upstream: &str, redis: &RedisServer) -> Proxy {
    let config = ConfigBuilder::new(upstream).redis(redis).routes(ROUTES);
    Proxy::in_process(&config.build(), &[]).await
}

// ---------------------------------------------------------------------------
// The listener speaks both.

#[tokio::test]
async fn pass_through_get_and_post_over_h2c() {
    let upstream = TestUpstream::start().await;
    let proxy = memory_proxy(&upstream.url(), "").await;
    let r = curl(&[H2, &proxy.url("/hello?x=1")]).await;
    assert_eq!((r.version.as_str(), r.status), ("HTTP/2", 201), "{r:?}");
    assert_eq!(r.header("x-custom"), Some("custom-value"));
    let echo = r.json();
    assert_eq!(echo["path"], "/hello");
    assert_eq!(echo["query"], "x=1");
    // The client's authority reaches the upstream as Host, as over HTTP/1.1.
    assert_eq!(echo["headers"]["host"], proxy.addr.to_string());
    let r = curl(&[H2, "--data-binary", "0123456789", &proxy.url("/things")]).await;
    assert_eq!((r.version.as_str(), r.status), ("HTTP/2", 201), "{r:?}");
    assert_eq!(r.json()["body_len"], 10);
    // The same port still speaks HTTP/1.1.
    let r = curl(&[H1, &proxy.url("/hello")]).await;
    assert_eq!((r.version.as_str(), r.status), ("HTTP/1.1", 201), "{r:?}");
    assert_eq!(upstream.hits(), 3);
}

#[tokio::test]
async fn protected_post_over_h2c_executes_once_and_replays_byte_for_byte() {
    let redis = RedisServer::start().await;
    let upstream = TestUpstream::start().await;
    let proxy = redis_proxy(&upstream.url(), &redis).await;
    let url = proxy.url("/v1/payments");
    let first = post(H2, &url, Some("k-h2"), "amount=10").await;
    assert_eq!((first.version.as_str(), first.status), ("HTTP/2", 201));
    assert!(!first.is_replay());
    let retry = post(H2, &url, Some("k-h2"), "amount=10").await;
    assert_eq!(retry.status, 201);
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.stored_headers(), first.stored_headers());
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn refusals_over_h2c_are_the_same_400_409_422() {
    let upstream = TestUpstream::start().await;
    let proxy = memory_proxy(&upstream.url(), "").await;
    let url = proxy.url("/v1/payments");
    let missing = post(H2, &url, None, "amount=10").await;
    assert_eq!((missing.version.as_str(), missing.status), ("HTTP/2", 400));
    assert_eq!(
        missing.header("content-type"),
        Some("application/problem+json")
    );
    // Held at the upstream: the retry meets the request in progress.
    let held = {
        let url = url.clone();
        tokio::spawn(async move {
            let args = [
                H2,
                "-H",
                "x-test-hold: 1",
                "-H",
                "Idempotency-Key: k-busy",
                "--data-binary",
                "a",
                &url,
            ];
            curl(&args).await
        })
    };
    upstream.wait_hits(1).await;
    let busy = post(H2, &url, Some("k-busy"), "a").await;
    assert_eq!(busy.status, 409, "{busy:?}");
    upstream.release(1);
    assert_eq!(held.await.expect("join").status, 201);
    let other = post(H2, &url, Some("k-busy"), "b").await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn the_same_key_over_http1_then_h2c_is_one_operation() {
    let redis = RedisServer::start().await;
    let upstream = TestUpstream::start().await;
    let proxy = redis_proxy(&upstream.url(), &redis).await;
    let url = proxy.url("/v1/payments");
    let first = post(H1, &url, Some("k-both"), "amount=7").await;
    assert_eq!((first.version.as_str(), first.status), ("HTTP/1.1", 201));
    let retry = post(H2, &url, Some("k-both"), "amount=7").await;
    assert_eq!((retry.version.as_str(), retry.status), ("HTTP/2", 201));
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test]
async fn an_h2c_request_in_flight_finishes_during_the_shutdown_grace() {
    let upstream = TestUpstream::start().await;
    let mut proxy = memory_proxy_binary(&upstream.url(), "").await;
    let url = proxy.url("/slow");
    let held = tokio::spawn(async move { curl(&[H2, "-H", "x-test-hold: 1", &url]).await });
    upstream.wait_hits(1).await;
    proxy.signal("TERM");
    proxy.wait_log("shutting down").await;
    upstream.release(1);
    let r = held.await.expect("join");
    assert_eq!((r.version.as_str(), r.status), ("HTTP/2", 201), "{r:?}");
    assert_eq!(proxy.wait_exit().await, Some(0));
}

// ---------------------------------------------------------------------------
// To the upstream: upstream_protocol.

/// An upstream that records the version of each request; HTTP/2 only, or both.
struct VersionUpstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<(Version, HeaderMap)>>>,
}

impl VersionUpstream {
    async fn start(h2_only: bool) -> VersionUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let log = log.clone();
                let svc = service_fn(move |req: Request<Incoming>| {
                    let version = format!("{:?}", req.version());
                    log.lock()
                        .unwrap()
                        .push((req.version(), req.headers().clone()));
                    // The body is read before the answer: answering first
                    // would reset the stream under a client still sending.
                    async move {
                        let _ = req.into_body().collect().await;
                        let answer = Response::new(Full::new(Bytes::from(version)));
                        Ok::<_, std::convert::Infallible>(answer)
                    }
                });
                let io = TokioIo::new(stream);
                tokio::spawn(async move {
                    if h2_only {
                        let http = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
                        let _ = http.serve_connection(io, svc).await;
                    } else {
                        let http =
                            hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                        let _ = http.serve_connection(io, svc).await;
                    }
                });
            }
        });
        VersionUpstream { addr, seen }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn versions(&self) -> Vec<Version> {
        self.seen.lock().unwrap().iter().map(|(v, _)| *v).collect()
    }

    fn last_headers(&self) -> HeaderMap {
        self.seen
            .lock()
            .unwrap()
            .last()
            .expect("a request")
            .1
            .clone()
    }
}

#[tokio::test]
async fn h2c_upstream_gets_every_request_over_http2() {
    let upstream = VersionUpstream::start(true).await;
    let proxy = memory_proxy(&upstream.url(), "upstream_protocol = \"h2c\"").await;
    let r = curl(&[H1, &proxy.url("/plain")]).await;
    assert_eq!((r.status, r.body.as_slice()), (200, &b"HTTP/2.0"[..]));
    let h = upstream.last_headers();
    // The client's host travels as X-Forwarded-Host: over HTTP/2 a Host
    // beside `:authority` (the upstream's address) would be malformed.
    assert!(!h.contains_key("host"), "{h:?}");
    assert_eq!(h["x-forwarded-host"], proxy.addr.to_string().as_str());
    assert!(
        !h.contains_key("connection") && !h.contains_key("te"),
        "{h:?}"
    );
    let args = [H2, "-H", "te: trailers", "--data-binary", "x"];
    let r = curl(&[&args[..], &[&proxy.url("/rpc")]].concat()).await;
    assert_eq!((r.version.as_str(), r.status), ("HTTP/2", 200));
    // gRPC's `TE: trailers` is the one TE HTTP/2 allows: kept.
    assert_eq!(upstream.last_headers()["te"], "trailers");
    let first = post(H2, &proxy.url("/v1/payments"), Some("k-up"), "a").await;
    let retry = post(H1, &proxy.url("/v1/payments"), Some("k-up"), "a").await;
    assert_eq!(first.body, b"HTTP/2.0");
    assert!(retry.is_replay() && retry.body == first.body, "{retry:?}");
    assert_eq!(upstream.versions(), vec![Version::HTTP_2; 3]);
}

#[tokio::test]
async fn auto_follows_the_inbound_version_and_http1_is_the_default() {
    let upstream = VersionUpstream::start(false).await;
    let proxy = memory_proxy(&upstream.url(), "upstream_protocol = \"auto\"").await;
    assert_eq!(curl(&[H1, &proxy.url("/a")]).await.body, b"HTTP/1.1");
    assert_eq!(curl(&[H2, &proxy.url("/b")]).await.body, b"HTTP/2.0");
    let te = curl(&[H1, "-H", "te: trailers", &proxy.url("/c")]).await;
    assert_eq!(te.body, b"HTTP/1.1");
    assert!(
        !upstream.last_headers().contains_key("te"),
        "hop-by-hop on HTTP/1.1"
    );
    let default = memory_proxy(&upstream.url(), "").await;
    assert_eq!(curl(&[H2, &default.url("/d")]).await.body, b"HTTP/1.1");
    let seen = upstream.versions();
    assert_eq!(
        seen,
        [
            Version::HTTP_11,
            Version::HTTP_2,
            Version::HTTP_11,
            Version::HTTP_11
        ]
    );
}

#[test]
fn upstream_protocol_is_checked_at_load_time() {
    use idemproxy::config::{Config, Overrides, UpstreamProtocol};
    let text = |p: &str| format!("[server]\nupstream = \"http://127.0.0.1:3000\"\n{p}");
    let load = |t: &str| Config::from_toml(t, "t.toml", &Overrides::default());
    let default = load(&text("")).expect("valid");
    assert_eq!(default.server.upstream_protocol, UpstreamProtocol::Http1);
    for (given, want) in [
        ("http1", UpstreamProtocol::Http1),
        ("h2c", UpstreamProtocol::H2c),
        ("auto", UpstreamProtocol::Auto),
    ] {
        let c = load(&text(&format!("upstream_protocol = \"{given}\""))).expect("valid");
        assert_eq!(c.server.upstream_protocol, want);
        assert_eq!(want.to_string(), given);
    }
    let e = load(&text("upstream_protocol = \"h3\""))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("t.toml:3:") && e.contains("server.upstream_protocol"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------
// Hostile HTTP/2 clients (§8 per stream).

#[tokio::test]
async fn an_oversized_header_list_is_refused_with_431() {
    let upstream = TestUpstream::start().await;
    let proxy = memory_proxy(&upstream.url(), "max_header_bytes = \"32KiB\"").await;
    let header = |n: usize| format!("x-big: {}", "a".repeat(n));
    // Within the setting (hyper's own HTTP/2 default, 16 KiB, would refuse it).
    let fits = curl(&[H2, "-H", &header(24 * 1024), &proxy.url("/")]).await;
    assert_eq!((fits.version.as_str(), fits.status), ("HTTP/2", 201));
    let big = curl(&[H2, "-H", &header(48 * 1024), &proxy.url("/")]).await;
    assert_eq!((big.version.as_str(), big.status), ("HTTP/2", 431));
    assert_eq!(upstream.hits(), 1);
    assert_eq!(curl(&[H2, &proxy.url("/")]).await.status, 201);
}

/// What a raw HTTP/2 client read back from the proxy.
#[derive(Clone, Debug, Default)]
struct Seen {
    max_concurrent_streams: Option<u32>,
    refused: usize,
    responses: usize,
    goaway: bool,
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = len.to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend(payload);
    f
}

/// `GET /` with `x-test-hold: 1` in HPACK without Huffman or indexing.
fn held_get(authority: &str) -> Vec<u8> {
    let mut block = vec![0x82, 0x86, 0x84, 0x01, authority.len() as u8];
    block.extend(authority.as_bytes());
    block.extend([0x00, 11]);
    block.extend(b"x-test-hold");
    block.extend([1, b'1']);
    block
}

/// Reads frames until the connection ends, publishing what it saw.
async fn read_frames(mut rd: tokio::net::tcp::OwnedReadHalf, tx: watch::Sender<Seen>) {
    let mut head = [0u8; 9];
    while rd.read_exact(&mut head).await.is_ok() {
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0u8; len];
        if rd.read_exact(&mut payload).await.is_err() {
            break;
        }
        let (kind, flags) = (head[3], head[4]);
        tx.send_modify(|s| match kind {
            0x1 => s.responses += 1,
            0x3 if payload == [0, 0, 0, 7] => s.refused += 1,
            0x4 if flags & 1 == 0 => {
                for setting in payload.chunks_exact(6) {
                    if setting[..2] == [0, 3] {
                        let v =
                            u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]);
                        s.max_concurrent_streams = Some(v);
                    }
                }
            }
            0x7 => s.goaway = true,
            _ => {}
        });
    }
}

/// Waits until what the reader saw passes `check`; panics with it after the deadline.
async fn wait_seen(rx: &mut watch::Receiver<Seen>, what: &str, check: fn(&Seen) -> bool) -> Seen {
    let probe = rx.clone();
    match tokio::time::timeout(DEADLINE, rx.wait_for(check)).await {
        Ok(Ok(seen)) => seen.clone(),
        _ => panic!("timed out waiting for {what}: {:?}", *probe.borrow()),
    }
}

#[tokio::test]
async fn a_flood_of_1000_streams_is_bounded_by_max_concurrent_streams() {
    let upstream = TestUpstream::start().await;
    let proxy = memory_proxy(&upstream.url(), "").await;
    let (rd, mut wr) = TcpStream::connect(proxy.addr)
        .await
        .expect("connect")
        .into_split();
    let (tx, mut rx) = watch::channel(Seen::default());
    tokio::spawn(read_frames(rd, tx));
    // A client that ignores the server's SETTINGS: 1000 requests at once.
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(0x4, 0, 0, &[]));
    out.extend(frame(0x8, 0, 0, &(1u32 << 24).to_be_bytes()));
    let block = held_get(&proxy.addr.to_string());
    for i in 0..1000u32 {
        out.extend(frame(0x1, 0x5, 2 * i + 1, &block));
    }
    wr.write_all(&out).await.expect("write the flood");
    upstream.wait_hits(100).await;
    let seen = wait_seen(&mut rx, "900 streams refused", |s| s.refused >= 900).await;
    assert_eq!(seen.max_concurrent_streams, Some(100), "{seen:?}");
    assert!(!seen.goaway, "{seen:?}");
    assert_eq!(
        upstream.hits(),
        100,
        "only the streams within the limit run"
    );
    upstream.release(100);
    wait_seen(&mut rx, "100 answers", |s| s.responses >= 100).await;
    assert_eq!(upstream.hits(), 100);
    // The proxy is still there for everyone else.
    let after = curl(&[H2, &proxy.url("/after")]).await;
    assert_eq!((after.version.as_str(), after.status), ("HTTP/2", 201));
}

#[tokio::test]
async fn a_first_header_block_that_never_ends_is_cut_off_at_the_header_timeout() {
    let upstream = TestUpstream::start().await;
    let proxy = memory_proxy(&upstream.url(), "header_read_timeout = \"500ms\"").await;
    let mut s = TcpStream::connect(proxy.addr).await.expect("connect");
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(0x4, 0, 0, &[]));
    // END_STREAM without END_HEADERS: a CONTINUATION is due, and never comes.
    out.extend(frame(0x1, 0x1, 1, &held_get(&proxy.addr.to_string())));
    s.write_all(&out).await.expect("write");
    let mut head = [0u8; 9];
    s.read_exact(&mut head)
        .await
        .expect("the server's SETTINGS");
    assert_eq!(head[3], 0x4, "an HTTP/2 SETTINGS frame: {head:?}");
    let started = tokio::time::Instant::now();
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(DEADLINE, s.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the connection was never closed");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "closed by the header timeout, not idle_timeout ({:?})",
        started.elapsed()
    );
    assert_eq!(upstream.hits(), 0);
}

/// Requests in progress at once, over all connections, are at most
/// `max_connections`: over HTTP/2 one connection could otherwise hold 100
/// handlers (and 100 upstream connections). One beyond gets 503 `proxy-busy`
/// at once; the limit frees as the requests end.
#[tokio::test]
async fn requests_in_progress_are_bounded_across_http2_streams() {
    let upstream = TestUpstream::start().await;
    let proxy = memory_proxy(&upstream.url(), "max_connections = 2").await;
    let client: hyper_util::client::legacy::Client<_, Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let get = |held: bool| {
        let mut r = Request::get(proxy.url("/held"));
        if held {
            r = r.header("x-test-hold", "1");
        }
        client.request(r.body(Full::new(Bytes::new())).unwrap())
    };
    let first = tokio::spawn(get(true));
    let second = tokio::spawn(get(true));
    upstream.wait_hits(2).await;
    let third = tokio::time::timeout(DEADLINE, get(false))
        .await
        .expect("answered at once")
        .unwrap();
    assert_eq!(third.status(), 503);
    let body = third.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&body).contains("proxy-busy"),
        "{body:?}"
    );
    assert_eq!(upstream.hits(), 2, "the third never reached the upstream");
    upstream.release(2);
    assert_eq!(first.await.unwrap().unwrap().status(), 201);
    assert_eq!(second.await.unwrap().unwrap().status(), 201);
    let after = get(false).await.unwrap();
    assert_eq!(after.status(), 201, "the places free as requests end");
}

/// An idle HTTP/2 connection carries frames of its own (here the client's
/// keep-alive pings). Unlike HTTP/1.1 bytes with no request in progress,
/// they are not a request's head, and `header_read_timeout` does not cut the
/// connection: the next request goes on the same one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_h2c_connection_with_pings_outlives_the_header_timeout() {
    let upstream = TestUpstream::start().await;
    let proxy = memory_proxy(
        &upstream.url(),
        "header_read_timeout = \"300ms\"\nidle_timeout = \"60s\"",
    )
    .await;
    let stream = TcpStream::connect(proxy.addr).await.expect("connect");
    let (mut send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive_interval(std::time::Duration::from_millis(50))
        .keep_alive_while_idle(true)
        .handshake::<_, Full<Bytes>>(TokioIo::new(stream))
        .await
        .expect("an HTTP/2 handshake");
    let conn = tokio::spawn(conn);
    let url = proxy.url("/v1/other");
    let get = || {
        Request::get(url.as_str())
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let first = send.send_request(get()).await.expect("the first answer");
    assert_eq!(first.status(), 201);
    // Pings every 50 ms, well past the 300 ms header timeout.
    let idle_until = tokio::time::Instant::now() + std::time::Duration::from_millis(1200);
    while tokio::time::Instant::now() < idle_until {
        assert!(!conn.is_finished(), "the connection was closed while idle");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await; // time is the subject: idle with pings
    }
    let second = tokio::time::timeout(DEADLINE, send.send_request(get()))
        .await
        .expect("an answer in time")
        .expect("the same connection still serves");
    assert_eq!(second.status(), 201);
    assert_eq!(upstream.hits(), 2);
}
