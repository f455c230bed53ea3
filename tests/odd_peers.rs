//! Odd HTTP from either side (contract §7 hop-by-hop and X-Forwarded-For, §8
//! malformed or odd HTTP, the upstream pool), over the proxy served in-process.

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use support::{Call, ConfigBuilder, Proxy, TestUpstream, DEADLINE};

/// A path no route protects.
const PASS: &str = "/v1/open";

/// The proxy in front of `upstream` with the one protected route, memory store.
async fn proxy_for(upstream: &str) -> Proxy {
    let config = ConfigBuilder::new(upstream)
        .route("payments", "/v1/payments", "")
        .build();
    Proxy::in_process(&config, &[]).await
}

/// Sends raw bytes (the request should say `Connection: close`) and reads the
/// answer until the proxy closes.
async fn raw_request(addr: SocketAddr, request: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(request).await.expect("write");
    let mut out = Vec::new();
    tokio::time::timeout(DEADLINE, s.read_to_end(&mut out))
        .await
        .expect("the proxy never closed")
        .expect("read");
    out
}

fn status_of(answer: &[u8]) -> u16 {
    let text = String::from_utf8_lossy(answer);
    text.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"))
}

/// Reads one request head (and a `Content-Length` body, if any) from `s`,
/// keeping whatever came after it in `buf`. None when the peer closed.
async fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap_or(0));
    while buf.len() < head_end + len {
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    Some(buf.drain(..head_end + len).collect())
}

/// An upstream that writes fixed bytes as its answer to every request, then
/// closes: it can say what a well-behaved HTTP library would not.
struct RawUpstream {
    url: String,
    /// Every request as received (head and body).
    requests: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl RawUpstream {
    async fn start(answer: &'static [u8]) -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let kept = requests.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let kept = kept.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    if let Some(request) = read_request(&mut s, &mut buf).await {
                        kept.lock().unwrap().push(request);
                        let _ = s.write_all(answer).await;
                    }
                    let _ = s.shutdown().await;
                });
            }
        });
        RawUpstream { url, requests }
    }

    fn hits(&self) -> usize {
        self.requests.lock().unwrap().len()
    }
}

// ---------------------------------------------------------------------------
// X-Forwarded-For (§7)

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_forwarded_for_line_is_kept_and_the_peer_appended() {
    let upstream = TestUpstream::start().await;
    let proxy = proxy_for(&upstream.url()).await;
    for (url, key) in [
        (proxy.url(PASS), None),
        (proxy.url("/v1/payments"), Some("k-xff")),
    ] {
        let mut call = Call::post(&url)
            .header("x-forwarded-for", "a")
            .header("x-forwarded-for", "b");
        if let Some(key) = key {
            call = call.key(key);
        }
        assert_eq!(call.body("x").await.status, 201, "{url}");
    }
    let seen = upstream.seen();
    assert_eq!(seen.len(), 2);
    for request in seen {
        let lines: Vec<_> = request.headers.get_all("x-forwarded-for").iter().collect();
        assert_eq!(lines, ["a, b, 127.0.0.1"], "{}", request.path);
    }
}

// ---------------------------------------------------------------------------
// Transfer-Encoding with a stale Content-Length (§8)

/// A chunked answer of 18 bytes that also claims a length of 5.
const CHUNKED_AND_LENGTH: &[u8] = b"HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\n\
Transfer-Encoding: chunked\r\nContent-Length: 5\r\nConnection: close\r\n\r\n\
7\r\nhello, \r\nb\r\nwhole world\r\n0\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_answer_loses_its_stale_content_length() {
    let upstream = RawUpstream::start(CHUNKED_AND_LENGTH).await;
    let proxy = proxy_for(&upstream.url).await;

    let passed = Call::new("GET", &proxy.url(PASS)).send().await;
    assert_eq!(passed.status, 201);
    assert_eq!(passed.body, "hello, whole world", "pass-through");

    let url = proxy.url("/v1/payments");
    let fresh = Call::post(&url).key("k-te-cl").body("x").await;
    assert_eq!(fresh.status, 201);
    assert_eq!(fresh.body, "hello, whole world", "first answer");
    assert_eq!(fresh.header("content-length"), Some("18"));
    let replay = Call::post(&url).key("k-te-cl").body("x").await;
    assert!(replay.is_replay());
    assert_eq!(replay.status, fresh.status);
    assert_eq!(
        replay.body, fresh.body,
        "the replay equals the first answer"
    );
    assert_eq!(upstream.hits(), 2);
}

// ---------------------------------------------------------------------------
// Connection read as bytes (§7, §8)

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_odd_byte_in_a_requests_connection_still_removes_what_it_names() {
    let upstream = TestUpstream::start().await;
    let proxy = proxy_for(&upstream.url()).await;
    for (path, key) in [(PASS, ""), ("/v1/payments", "Idempotency-Key: k-odd\r\n")] {
        let mut request = format!("POST {path} HTTP/1.1\r\nHost: x\r\n{key}").into_bytes();
        // The token after x-secret carries a byte that is not UTF-8. (`close`
        // has a line of its own: hyper reads a value with such a byte as no
        // `close` at all and would keep the connection open.)
        request.extend_from_slice(
            b"Connection: close\r\nConnection: x-secret, \xff-odd\r\nX-Secret: 1\r\n\
              Content-Length: 1\r\n\r\nx",
        );
        let answer = raw_request(proxy.addr, &request).await;
        assert_eq!(status_of(&answer), 201, "{path}");
    }
    let seen = upstream.seen();
    assert_eq!(seen.len(), 2);
    for request in seen {
        assert_eq!(request.headers.get("x-secret"), None, "{}", request.path);
        assert_eq!(request.headers.get("connection"), None, "{}", request.path);
    }
}

/// An answer whose `Connection` names `X-Secret` beside a token with a byte
/// that is not UTF-8.
const ODD_CONNECTION: &[u8] = b"HTTP/1.1 201 Created\r\nConnection: close, x-secret, \xff-odd\r\n\
X-Secret: 1\r\nX-Kept: yes\r\nContent-Length: 2\r\n\r\nok";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_odd_byte_in_an_answers_connection_still_removes_what_it_names() {
    let upstream = RawUpstream::start(ODD_CONNECTION).await;
    let proxy = proxy_for(&upstream.url).await;

    let passed = Call::new("GET", &proxy.url(PASS)).send().await;
    assert_eq!(passed.status, 201);
    assert_eq!(passed.header("x-kept"), Some("yes"));
    assert_eq!(passed.header("x-secret"), None, "pass-through");

    let url = proxy.url("/v1/payments");
    let fresh = Call::post(&url).key("k-odd-answer").body("x").await;
    let replay = Call::post(&url).key("k-odd-answer").body("x").await;
    assert!(replay.is_replay());
    for (what, r) in [("fresh", &fresh), ("replay", &replay)] {
        assert_eq!(r.status, 201, "{what}");
        assert_eq!(r.body, "ok", "{what}");
        assert_eq!(r.header("x-kept"), Some("yes"), "{what}");
        assert_eq!(r.header("x-secret"), None, "{what}");
    }
}

// ---------------------------------------------------------------------------
// Request bodies on GET, HEAD and DELETE (§8)

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_on_get_head_and_delete_pass_through_chunked_or_not() {
    let upstream = TestUpstream::start().await;
    let proxy = proxy_for(&upstream.url()).await;
    for method in ["GET", "HEAD", "DELETE"] {
        let request = format!(
            "{method} {PASS} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\
             Connection: close\r\n\r\n6\r\nhello \r\n5\r\nworld\r\n0\r\n\r\n"
        );
        let answer = raw_request(proxy.addr, request.as_bytes()).await;
        assert_eq!(status_of(&answer), 201, "{method}");
    }
    for method in ["GET", "HEAD", "DELETE"] {
        let r = Call::new(method, &proxy.url(PASS))
            .body("hello world")
            .await;
        assert_eq!(r.status, 201, "{method}");
    }
    let seen = upstream.seen();
    assert_eq!(seen.len(), 6);
    for request in seen {
        assert_eq!(request.body, "hello world", "{}", request.method);
    }
}

// ---------------------------------------------------------------------------
// The upstream pool (§8)

/// An upstream with a 2 s keep-alive timeout: after each answer it keeps the
/// connection for 2 s. A request that comes later on that connection meets
/// it closing and gets no answer. (A server that closed cleanly *before* the
/// request would let the proxy see the close first and the race would not
/// show: this is the moment that loses requests in production.) Counts the
/// connections it accepted.
struct ClosingUpstream {
    url: String,
    connections: Arc<Mutex<usize>>,
}

const KEEP_ALIVE: Duration = Duration::from_secs(2);

impl ClosingUpstream {
    async fn start() -> ClosingUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let connections = Arc::new(Mutex::new(0));
        let counted = connections.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                *counted.lock().unwrap() += 1;
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut answered_at: Option<tokio::time::Instant> = None;
                    while read_request(&mut s, &mut buf).await.is_some() {
                        if answered_at.is_some_and(|at| at.elapsed() >= KEEP_ALIVE) {
                            // Dropped unanswered: the close raced the request.
                            return;
                        }
                        let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                        if s.write_all(answer).await.is_err() {
                            return;
                        }
                        answered_at = Some(tokio::time::Instant::now());
                    }
                });
            }
        });
        ClosingUpstream { url, connections }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_closing_idle_connections_after_2s_never_causes_a_502() {
    let upstream = ClosingUpstream::start().await;
    // The default upstream_idle_timeout (below 2 s) is what is under test.
    let proxy = proxy_for(&upstream.url).await;
    let url = proxy.url(PASS);
    let first = Call::new("GET", &url).send().await;
    assert_eq!(first.status, 200);
    // Time itself is the subject here: the request must come after the
    // upstream's keep-alive timeout, on what would be a stale pooled connection.
    tokio::time::sleep(KEEP_ALIVE + Duration::from_millis(500)).await;
    let second = Call::new("GET", &url).send().await;
    assert_eq!(
        second.status,
        200,
        "{}",
        String::from_utf8_lossy(&second.body)
    );
    assert_eq!(
        *upstream.connections.lock().unwrap(),
        2,
        "a fresh connection"
    );
}

/// An upstream that keeps its connections alive and answers by path:
/// `/ok` "ok", `/empty` 204, `/cut` a body cut short by a close. Counts the
/// connections it accepted and those that the proxy closed.
struct CountingUpstream {
    url: String,
    accepted: Arc<Mutex<usize>>,
    closed: Arc<Mutex<usize>>,
}

impl CountingUpstream {
    async fn start() -> CountingUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (accepted, closed) = (Arc::new(Mutex::new(0)), Arc::new(Mutex::new(0)));
        let (a, c) = (accepted.clone(), closed.clone());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                *a.lock().unwrap() += 1;
                let c = c.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    while let Some(req) = read_request(&mut s, &mut buf).await {
                        let line = String::from_utf8_lossy(&req)
                            .lines()
                            .next()
                            .unwrap_or_default()
                            .to_string();
                        let answer: &[u8] = if line.contains("/cut") {
                            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf"
                        } else if line.contains("/empty") {
                            b"HTTP/1.1 204 No Content\r\n\r\n"
                        } else if line.starts_with("HEAD") {
                            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n"
                        } else {
                            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
                        };
                        if s.write_all(answer).await.is_err() || line.contains("/cut") {
                            return;
                        }
                    }
                    *c.lock().unwrap() += 1;
                });
            }
        });
        CountingUpstream {
            url,
            accepted,
            closed,
        }
    }

    fn accepted(&self) -> usize {
        *self.accepted.lock().unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_upstream_connection_serves_request_after_request_until_one_breaks() {
    let upstream = CountingUpstream::start().await;
    // One worker thread: each has an upstream pool of its own, and each
    // `Call` comes on a new client connection, which may go to any worker.
    let config = ConfigBuilder::new(&upstream.url)
        .server("workers = 1")
        .route("payments", "/v1/payments", "")
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    for (method, path, status) in [
        ("GET", "/ok", 200),
        ("POST", "/ok", 200),
        // No body to read: the connection goes back all the same.
        ("HEAD", "/ok", 200),
        ("GET", "/empty", 204),
        ("DELETE", "/empty", 204),
        ("GET", "/ok", 200),
    ] {
        let r = Call::new(method, &proxy.url(path)).send().await;
        assert_eq!(r.status, status, "{method} {path}");
    }
    assert_eq!(
        upstream.accepted(),
        1,
        "every exchange on the one connection"
    );
    // An answer cut short: that connection is never used again.
    raw_request(
        proxy.addr,
        b"GET /cut HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    let r = Call::new("GET", &proxy.url("/ok")).send().await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body, "ok");
    assert_eq!(
        upstream.accepted(),
        2,
        "a fresh connection after the broken one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_upstream_connections_are_closed_after_upstream_idle_timeout() {
    let upstream = CountingUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url)
        .server("upstream_idle_timeout = \"300ms\"")
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let r = Call::new("GET", &proxy.url("/ok")).send().await;
    assert_eq!(r.status, 200);
    // Nobody uses the pool now: the proxy closes the connection on its own.
    let closed = upstream.closed.clone();
    support::eventually("the idle upstream connection closed", DEADLINE, || {
        let n = *closed.lock().unwrap();
        async move { (n == 1).then_some(()) }
    })
    .await;
    let r = Call::new("GET", &proxy.url("/ok")).send().await;
    assert_eq!(r.status, 200);
    assert_eq!(upstream.accepted(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_url_with_a_path_puts_it_in_front_of_every_request_target() {
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&format!("{}/api", upstream.url()))
        .route("payments", "/v1/payments", "")
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let r = Call::new("GET", &proxy.url("/x/y?q=1&r=%20")).send().await;
    assert_eq!(r.status, 201);
    let r = Call::post(&proxy.url("/v1/payments?ref=7"))
        .key("k-prefix")
        .body("x")
        .await;
    assert_eq!(r.status, 201);
    let targets: Vec<String> = upstream.seen().into_iter().map(|s| s.target).collect();
    assert_eq!(targets, ["/api/x/y?q=1&r=%20", "/api/v1/payments?ref=7"]);
    // Without a path, the client's own target goes as it came.
    let upstream = TestUpstream::start().await;
    let proxy = proxy_for(&upstream.url()).await;
    let r = Call::new("GET", &proxy.url("/x/y?q=1")).send().await;
    assert_eq!(r.status, 201);
    assert_eq!(upstream.seen()[0].target, "/x/y?q=1");
}

// ---------------------------------------------------------------------------
// Upgrades on protected routes, and 101s nobody asked for (§9)

/// The first request the upstream saw came without these headers.
fn not_forwarded(upstream: &TestUpstream, names: &[&str]) {
    let seen = upstream.seen();
    for name in names {
        assert!(
            seen[0].headers.get(*name).is_none(),
            "{name}: {:?}",
            seen[0].headers
        );
    }
}

/// A protected POST that also asks to upgrade, with its key.
fn upgrade_post(key: &str) -> Vec<u8> {
    format!(
        "POST /v1/payments HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, close\r\n\
         Upgrade: websocket\r\nIdempotency-Key: {key}\r\nContent-Length: 2\r\n\r\nhi"
    )
    .into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_header_on_a_protected_route_is_no_way_around_the_key() {
    let upstream = TestUpstream::start().await;
    let proxy = proxy_for(&upstream.url()).await;
    // Without a key: refused like any protected request.
    let keyless = b"POST /v1/payments HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, close\r\n\
                    Upgrade: websocket\r\nContent-Length: 2\r\n\r\nhi";
    assert_eq!(status_of(&raw_request(proxy.addr, keyless).await), 400);
    assert_eq!(
        upstream.hits(),
        0,
        "a keyless request never reaches the upstream"
    );
    // With a key, three times: executed once, then replayed.
    let mut answers = Vec::new();
    for _ in 0..3 {
        let answer = raw_request(proxy.addr, &upgrade_post("k-upgrade")).await;
        answers.push(String::from_utf8_lossy(&answer).to_ascii_lowercase());
    }
    assert_eq!(upstream.hits(), 1, "the same key ran once: {answers:?}");
    for answer in &answers {
        assert_eq!(status_of(answer.as_bytes()), 201, "{answer}");
    }
    assert!(
        !answers[0].contains("idempotent-replayed"),
        "{}",
        answers[0]
    );
    for replay in &answers[1..] {
        assert!(replay.contains("idempotent-replayed: true"), "{replay}");
    }
    // The upgrade intent was dropped on the way: the upstream saw a plain request.
    not_forwarded(&upstream, &["upgrade", "connection"]);
    let reserves = r#"idemproxy_store_duration_seconds_count{op="reserve"}"#;
    assert!(support::metric(&proxy, reserves).await >= 3.0);
}

/// A 101 to a request that did not ask to switch protocols.
const UNASKED_101: &[u8] = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\
Connection: upgrade\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_101_to_a_plain_request_is_a_502_and_never_stored() {
    let upstream = RawUpstream::start(UNASKED_101).await;
    let proxy = proxy_for(&upstream.url).await;
    let url = proxy.url("/v1/payments");
    for attempt in 1..=2 {
        let answer = Call::post(&url).key("k-101").body("x").await;
        assert_eq!(answer.status, 502, "attempt {attempt}: {:?}", answer.body);
        assert!(!answer.is_replay(), "attempt {attempt}: nothing was stored");
        let problem = answer.json();
        assert_eq!(problem["retryable"], true, "{problem}");
        // The key was released: the retry reached the upstream again.
        assert_eq!(upstream.hits(), attempt);
    }
    // Pass-through: a 101 nobody asked for is not relayed either.
    let passed = Call::new("GET", &proxy.url(PASS)).send().await;
    assert_eq!(passed.status, 502);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_case_method_is_protected_like_its_upper_case_spelling() {
    let upstream = TestUpstream::start().await;
    let proxy = proxy_for(&upstream.url()).await;
    let post = |key: &str| {
        format!(
            "post /v1/payments HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
             Idempotency-Key: {key}\r\nContent-Length: 2\r\n\r\nhi"
        )
    };
    let keyless = b"post /v1/payments HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi";
    assert_eq!(status_of(&raw_request(proxy.addr, keyless).await), 400);
    for _ in 0..3 {
        let answer = raw_request(proxy.addr, post("k-lower").as_bytes()).await;
        assert_eq!(status_of(&answer), 201);
    }
    assert_eq!(upstream.hits(), 1, "the same key ran once");
}

/// A 101 that does not accept the handshake (no `Sec-WebSocket-Accept`),
/// after which the upstream would go on reading HTTP from the tunnel.
const UNACCEPTED_101: &[u8] = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\
Connection: upgrade\r\n\r\n";

const HANDSHAKE: &[u8] = b"GET /chat HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n\
Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_101_that_does_not_accept_the_handshake_opens_no_tunnel() {
    let upstream = RawUpstream::start(UNACCEPTED_101).await;
    let proxy = proxy_for(&upstream.url).await;
    let answer = raw_request(proxy.addr, HANDSHAKE).await;
    assert_eq!(
        status_of(&answer),
        502,
        "{}",
        String::from_utf8_lossy(&answer)
    );
    let upgraded = r#"idemproxy_requests_total{route="",outcome="upgraded"}"#;
    assert_eq!(support::metric(&proxy, upgraded).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_websocket_is_tunnelled_and_an_unanswered_upgrade_closes_the_connection() {
    let upstream = TestUpstream::start().await;
    let proxy = proxy_for(&upstream.url()).await;
    // h2c would carry HTTP/2 requests past the proxy: a plain request instead.
    let h2c = b"GET /chat HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n\
Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n";
    // Keep-alive, yet the answer closes: hyper would hold the connection for the upgrade.
    let answer = String::from_utf8_lossy(&raw_request(proxy.addr, h2c).await).to_ascii_lowercase();
    assert_eq!(status_of(answer.as_bytes()), 201, "{answer}");
    assert!(answer.contains("connection: close"), "{answer}");
    not_forwarded(&upstream, &["upgrade", "http2-settings"]);
    // A protected POST that named an upgrade is answered, and its connection closed too.
    let post = b"POST /v1/payments HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n\
Upgrade: websocket\r\nIdempotency-Key: k-keepalive\r\nContent-Length: 2\r\n\r\nhi";
    let answer = String::from_utf8_lossy(&raw_request(proxy.addr, post).await).to_ascii_lowercase();
    assert_eq!(status_of(answer.as_bytes()), 201, "{answer}");
    assert!(answer.contains("connection: close"), "{answer}");
}
