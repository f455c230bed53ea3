//! Real parts for the integration tests, all on loopback and port 0 (or a free
//! port): a `redis-server` of the test's own, a programmable upstream, the
//! `idemproxy` binary, and a small HTTP client. Waits are on events with deadlines.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;

pub const DEADLINE: Duration = Duration::from_secs(15);

/// Polls `check` until it returns `Some`, or panics after `deadline` naming `what`.
pub async fn eventually<T, F, Fut>(what: &str, deadline: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let until = Instant::now() + deadline;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < until, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Arguments for a test redis-server: loopback only, no persistence, then `extra`.
pub fn redis_args(port: u16, extra: &[&str]) -> Vec<String> {
    let port = port.to_string();
    [
        "--port",
        &port,
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect()
}

/// Kills a child process (SIGKILL) and reaps it; nothing when it is gone already.
pub fn kill_child(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

// ---------------------------------------------------------------------------
// redis-server

pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    extra: Vec<String>,
}

impl RedisServer {
    pub async fn start() -> RedisServer {
        Self::start_with(&[]).await
    }

    pub async fn start_with(extra: &[&str]) -> RedisServer {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut server = RedisServer {
            child: None,
            port: 0,
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        for _ in 0..5 {
            server.port = free_port();
            if server.spawn().await {
                return server;
            }
        }
        panic!("redis-server did not start (is it installed?)");
    }

    /// Starts the server on its port; false when it did not come up (port taken).
    async fn spawn(&mut self) -> bool {
        let child = Command::new("redis-server")
            .args(redis_args(self.port, &[]))
            .args(["--dir", &self.dir.path().display().to_string()])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if let Ok(mut c) = self.conn().await {
                if redis::cmd("PING")
                    .query_async::<String>(&mut c)
                    .await
                    .is_ok()
                {
                    return true;
                }
            }
            if let Some(Ok(Some(_))) = self.child.as_mut().map(|c| c.try_wait()) {
                break; // exited: port taken
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.stop();
        false
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub async fn conn(&self) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        redis::Client::open(self.url())?
            .get_multiplexed_async_connection()
            .await
    }

    pub async fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut c = self.conn().await.expect("connect to test redis");
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query_async(&mut c).await.expect("redis command")
    }

    pub async fn keys(&self) -> Vec<String> {
        self.cmd(&["KEYS", "*"]).await
    }

    /// Stops the server (SIGKILL: nothing is saved).
    pub fn stop(&mut self) {
        kill_child(&mut self.child);
    }

    /// Starts it again on the same port.
    pub async fn restart(&mut self) {
        self.stop();
        assert!(
            self.spawn().await,
            "redis-server did not restart on port {}",
            self.port
        );
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------------------
// A programmable upstream. Request headers steer it:
//   x-test-status: N        answer with status N (default 201)
//   x-test-body-bytes: N    answer with N bytes of binary data instead of the JSON echo
//   x-test-chunked: 1       send the body in 16 KiB chunks without Content-Length
//   x-test-hold: 1          after counting the hit, wait until the test opens the gate
//   x-test-delay-ms: N      sleep before answering
//   x-test-hop: 1           add hop-by-hop headers to the answer
// The default answer is 201 with Location, Content-Type, X-Custom, Set-Cookie,
// and a JSON echo of the request (method, path, query, headers, body length, hit number).

#[derive(Clone, Debug)]
pub struct Seen {
    pub method: Method,
    pub path: String,
    pub query: Option<String>,
    pub headers: HeaderMap,
    pub body: Bytes,
}

struct UpstreamState {
    hits: AtomicUsize,
    arrived: watch::Sender<usize>,
    gate: Semaphore,
    seen: Mutex<Vec<Seen>>,
}

#[derive(Clone)]
pub struct TestUpstream {
    pub addr: SocketAddr,
    state: Arc<UpstreamState>,
}

/// Deterministic binary data: every byte value appears.
pub fn binary(n: usize) -> Bytes {
    (0..n)
        .map(|i| (i.wrapping_mul(31) ^ (i >> 8)) as u8)
        .collect::<Vec<u8>>()
        .into()
}

fn header_num(h: &HeaderMap, name: &str) -> Option<u64> {
    h.get(name)?.to_str().ok()?.parse().ok()
}

type UpBody = http_body_util::Either<Full<Bytes>, Chunks>;

/// A body sent in pieces with no length given: hyper uses chunked encoding.
pub struct Chunks(std::collections::VecDeque<Bytes>);

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }
}

impl TestUpstream {
    pub async fn start() -> TestUpstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        let addr = listener.local_addr().expect("upstream addr");
        let state = Arc::new(UpstreamState {
            hits: AtomicUsize::new(0),
            arrived: watch::channel(0).0,
            gate: Semaphore::new(0),
            seen: Mutex::new(Vec::new()),
        });
        let st = state.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let st = st.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let st = st.clone();
                        async move { Ok::<_, std::convert::Infallible>(Self::answer(st, req).await) }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        TestUpstream { addr, state }
    }

    async fn answer(st: Arc<UpstreamState>, req: Request<Incoming>) -> Response<UpBody> {
        let (parts, body) = req.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let n = st.hits.fetch_add(1, Ordering::SeqCst) + 1;
        let h = parts.headers.clone();
        st.seen.lock().unwrap().push(Seen {
            method: parts.method.clone(),
            path: parts.uri.path().to_string(),
            query: parts.uri.query().map(str::to_string),
            headers: parts.headers.clone(),
            body: body.clone(),
        });
        st.arrived.send_replace(n);
        if h.contains_key("x-test-hold") {
            if let Ok(p) = st.gate.acquire().await {
                p.forget();
            }
        }
        if let Some(ms) = header_num(&h, "x-test-delay-ms") {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let status = header_num(&h, "x-test-status").map_or(201, |s| s as u16);
        let (content_type, payload) = match header_num(&h, "x-test-body-bytes") {
            Some(len) => ("application/octet-stream", binary(len as usize)),
            None => {
                let headers: serde_json::Map<String, serde_json::Value> = h
                    .iter()
                    .map(|(k, v)| (k.to_string(), String::from_utf8_lossy(v.as_bytes()).into()))
                    .collect();
                let echo = serde_json::json!({
                    "n": n,
                    "method": parts.method.as_str(),
                    "path": parts.uri.path(),
                    "query": parts.uri.query(),
                    "body_len": body.len(),
                    "headers": headers,
                });
                ("application/json", Bytes::from(echo.to_string()))
            }
        };
        let body = if h.contains_key("x-test-chunked") {
            let chunks = payload
                .chunks(16 * 1024)
                .map(Bytes::copy_from_slice)
                .collect();
            http_body_util::Either::Right(Chunks(chunks))
        } else {
            http_body_util::Either::Left(Full::new(payload))
        };
        let mut resp = Response::new(body);
        *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
        let rh = resp.headers_mut();
        rh.insert("content-type", HeaderValue::from_static(content_type));
        rh.insert(
            "location",
            HeaderValue::from_str(&format!("/things/{n}")).unwrap(),
        );
        rh.insert("x-custom", HeaderValue::from_static("custom-value"));
        rh.append("x-multi", HeaderValue::from_static("one"));
        rh.append("x-multi", HeaderValue::from_static("two"));
        rh.insert("server", HeaderValue::from_static("test-upstream/1"));
        rh.insert(
            "set-cookie",
            HeaderValue::from_static("session=secret-session; HttpOnly"),
        );
        if h.contains_key("x-test-hop") {
            rh.insert("connection", HeaderValue::from_static("x-hop-secret"));
            rh.insert("x-hop-secret", HeaderValue::from_static("1"));
            rh.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        }
        resp
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many requests reached the upstream.
    pub fn hits(&self) -> usize {
        self.state.hits.load(Ordering::SeqCst)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }

    /// Waits until at least `n` requests have reached the upstream.
    pub async fn wait_hits(&self, n: usize) {
        let mut rx = self.state.arrived.subscribe();
        tokio::time::timeout(DEADLINE, rx.wait_for(|&h| h >= n))
            .await
            .unwrap_or_else(|_| panic!("upstream never saw {n} requests (saw {})", self.hits()))
            .expect("upstream state");
    }

    /// Lets `n` held requests go on.
    pub fn release(&self, n: usize) {
        self.state.gate.add_permits(n);
    }
}

// ---------------------------------------------------------------------------
// The proxy, as the real binary.

pub struct Proxy {
    child: Option<Child>,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    logs: Arc<Mutex<Vec<String>>>,
    _config: tempfile::NamedTempFile,
}

pub fn write_config(toml: &str) -> tempfile::NamedTempFile {
    use std::io::Write;
    let mut f = tempfile::Builder::new()
        .suffix(".toml")
        .tempfile()
        .expect("temp config");
    f.write_all(toml.as_bytes()).expect("write config");
    f
}

impl Proxy {
    /// Starts `idemproxy --config <toml> --log-format json` and waits until `/readyz` is 200.
    pub async fn start(toml: &str) -> Proxy {
        Self::start_with_env(toml, &[]).await
    }

    pub async fn start_with_env(toml: &str, env: &[(&str, &str)]) -> Proxy {
        let proxy = Self::spawn(toml, env).await;
        proxy.wait_ready().await;
        proxy
    }

    /// Starts the binary and waits for its "listening" line, not for readiness.
    pub async fn spawn(toml: &str, env: &[(&str, &str)]) -> Proxy {
        let config = write_config(toml);
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .arg("--config")
            .arg(config.path())
            .args(["--log-format", "json"])
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn idemproxy");
        let stderr = child.stderr.take().expect("stderr");
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let sink = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(line.clone());
                let _ = tx.send(line);
            }
        });
        let listening = tokio::task::spawn_blocking(move || {
            let until = std::time::Instant::now() + DEADLINE;
            loop {
                let left = until.saturating_duration_since(std::time::Instant::now());
                match rx.recv_timeout(left) {
                    Ok(line) => {
                        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                            if v["message"] == "listening" {
                                return Ok(v);
                            }
                        }
                    }
                    Err(_) => return Err("no \"listening\" line"),
                }
            }
        })
        .await
        .expect("join");
        let v = match listening {
            Ok(v) => v,
            Err(e) => {
                let _ = child.kill();
                panic!(
                    "idemproxy did not start: {e}; logs:\n{}",
                    logs.lock().unwrap().join("\n")
                );
            }
        };
        let addr = v["proxy"].as_str().unwrap().parse().unwrap();
        let admin = v["admin"].as_str().unwrap().parse().unwrap();
        Proxy {
            child: Some(child),
            addr,
            admin,
            logs,
            _config: config,
        }
    }

    pub async fn wait_ready(&self) {
        let url = format!("http://{}/readyz", self.admin);
        eventually("/readyz to answer 200", DEADLINE, || {
            let url = url.clone();
            async move { (get(&url).await.ok()?.status == 200).then_some(()) }
        })
        .await;
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    pub fn logs(&self) -> Vec<String> {
        self.logs.lock().unwrap().clone()
    }

    /// Waits for a log line containing `text` and returns it parsed (JSON logs).
    pub async fn wait_log(&self, text: &str) -> serde_json::Value {
        let logs = self.logs.clone();
        let text = text.to_string();
        eventually(&format!("a log line with {text:?}"), DEADLINE, || {
            let found = logs
                .lock()
                .unwrap()
                .iter()
                .find(|l| l.contains(&text))
                .cloned();
            async move { found.map(|l| serde_json::from_str(&l).expect("JSON log line")) }
        })
        .await
    }

    /// Replaces the configuration file (for SIGHUP reload tests).
    pub fn rewrite_config(&self, text: &str) {
        std::fs::write(self._config.path(), text).expect("rewrite config");
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Waits for the process to exit and returns its exit code.
    pub async fn wait_exit(&mut self) -> Option<i32> {
        let mut child = self.child.take().expect("running");
        tokio::task::spawn_blocking(move || child.wait().ok().and_then(|s| s.code()))
            .await
            .expect("join")
    }

    pub fn kill(&mut self) {
        kill_child(&mut self.child);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---------------------------------------------------------------------------
// A small HTTP client.

#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn is_replay(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}

fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

pub async fn send(req: Request<Full<Bytes>>) -> Result<Resp, String> {
    let resp = tokio::time::timeout(DEADLINE, client().request(req))
        .await
        .map_err(|_| "request timed out".to_string())?
        .map_err(|e| format!("request failed: {e:?}"))?;
    let (parts, body) = resp.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|e| format!("body failed: {e}"))?
        .to_bytes();
    Ok(Resp {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    })
}

pub async fn get(url: &str) -> Result<Resp, String> {
    send(Request::get(url).body(Full::new(Bytes::new())).unwrap()).await
}

/// A request builder with the usual defaults for protected routes.
pub struct Call {
    builder: http::request::Builder,
}

impl Call {
    pub fn post(url: &str) -> Call {
        Call {
            builder: Request::post(url),
        }
    }

    pub fn new(method: &str, url: &str) -> Call {
        Call {
            builder: Request::builder().method(method).uri(url),
        }
    }

    pub fn key(self, key: &str) -> Call {
        self.header("idempotency-key", key)
    }

    pub fn header(self, name: &str, value: &str) -> Call {
        Call {
            builder: self.builder.header(name, value),
        }
    }

    pub async fn body(self, body: impl Into<Bytes>) -> Resp {
        send(self.builder.body(Full::new(body.into())).unwrap())
            .await
            .expect("request")
    }

    pub async fn send(self) -> Resp {
        self.body(Bytes::new()).await
    }

    /// Sends it in a task of its own (a request the test holds in flight).
    pub fn spawn(self, body: impl Into<Bytes>) -> tokio::task::JoinHandle<Resp> {
        let body = body.into();
        tokio::spawn(self.body(body))
    }
}

/// Sends raw bytes and reads the answer until the server closes (send `Connection: close`).
pub async fn raw(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(request).await.expect("write");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(DEADLINE, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// The status code of a raw HTTP/1.1 answer.
pub fn raw_status(answer: &str) -> u16 {
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"))
}

// ---------------------------------------------------------------------------
// A standard environment: redis (or not), upstream, proxy.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Redis,
    Memory,
}

pub struct Env {
    pub redis: Option<RedisServer>,
    pub upstream: TestUpstream,
    pub proxy: Proxy,
    /// Between the proxy and Redis, when asked for.
    pub redis_relay: Option<relay::Relay>,
    /// Between the proxy and the upstream, when asked for.
    pub upstream_relay: Option<relay::Relay>,
}

/// Routes most tests use (appended to the generated [server] and [store]).
pub const ROUTES: &str = r#"
[defaults]
lease = "10s"

[[routes]]
name = "payments"
path = "/v1/payments"

[[routes]]
name = "orders"
methods = ["POST", "PUT"]
path = "/v1/orders/{id}"

[[routes]]
name = "optional"
path = "/v1/optional"
key = "optional"

[[routes]]
name = "short-ttl"
path = "/v1/short"
ttl = "2s"

[[routes]]
name = "small"
path = "/v1/small"
max_request_body = "1KiB"
max_key_length = 16
"#;

pub fn store_section(backend: Backend, redis: Option<&RedisServer>) -> String {
    match (backend, redis) {
        (Backend::Redis, Some(r)) => {
            format!("[store]\nbackend = \"redis\"\nurl = \"{}\"\n", r.url())
        }
        _ => "[store]\nbackend = \"memory\"\n".to_string(),
    }
}

pub fn config_text(upstream: &str, store: &str, routes: &str) -> String {
    config_with(upstream, "", store, routes)
}

/// A whole config; `server_extra` lines go into [server] (later keys of the same name are errors, so
/// the defaults here are only the ones not given).
pub fn config_with(upstream: &str, server_extra: &str, store: &str, routes: &str) -> String {
    let mut server = format!("[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nupstream = \"{upstream}\"\n");
    for (key, default) in [
        ("upstream_timeout", "\"10s\""),
        ("shutdown_grace", "\"10s\""),
    ] {
        if !server_extra.contains(key) {
            server.push_str(&format!("{key} = {default}\n"));
        }
    }
    format!("{server}{server_extra}\n\n{store}\n{routes}")
}

/// Builds an [`Env`] with the parts a test needs.
pub struct EnvBuilder {
    backend: Backend,
    routes: String,
    server_extra: String,
    store_extra: String,
    redis_relay: bool,
    upstream_relay: bool,
    upstream_url: Option<String>,
}

impl EnvBuilder {
    pub fn routes(mut self, routes: &str) -> Self {
        self.routes = routes.to_string();
        self
    }

    /// Extra `key = value` lines for [server].
    pub fn server(mut self, lines: &str) -> Self {
        self.server_extra = lines.to_string();
        self
    }

    /// Extra `key = value` lines for [store].
    pub fn store(mut self, lines: &str) -> Self {
        self.store_extra = lines.to_string();
        self
    }

    /// Put a fault relay between the proxy and Redis.
    pub fn redis_relay(mut self) -> Self {
        self.redis_relay = true;
        self
    }

    /// Put a fault relay between the proxy and the upstream.
    pub fn upstream_relay(mut self) -> Self {
        self.upstream_relay = true;
        self
    }

    /// Send upstream traffic to this URL instead of the test upstream.
    pub fn upstream_url(mut self, url: &str) -> Self {
        self.upstream_url = Some(url.to_string());
        self
    }

    pub fn config(
        &self,
        redis: Option<&RedisServer>,
        redis_addr: Option<SocketAddr>,
        upstream: &str,
    ) -> String {
        let store = match (
            self.backend,
            redis_addr.or(redis.map(|r| ([127, 0, 0, 1], r.port).into())),
        ) {
            (Backend::Redis, Some(addr)) => {
                format!(
                    "[store]\nbackend = \"redis\"\nurl = \"redis://{addr}/0\"\n{}\n",
                    self.store_extra
                )
            }
            _ => format!("[store]\nbackend = \"memory\"\n{}\n", self.store_extra),
        };
        config_with(upstream, &self.server_extra, &store, &self.routes)
    }

    pub async fn start(self) -> Env {
        let redis = match self.backend {
            Backend::Redis => Some(RedisServer::start().await),
            Backend::Memory => None,
        };
        let redis_relay = match (&redis, self.redis_relay) {
            (Some(r), true) => Some(relay::Relay::start(([127, 0, 0, 1], r.port).into()).await),
            _ => None,
        };
        let upstream = TestUpstream::start().await;
        let upstream_relay = if self.upstream_relay {
            Some(relay::Relay::start(upstream.addr).await)
        } else {
            None
        };
        let upstream_url = match (&self.upstream_url, &upstream_relay) {
            (Some(u), _) => u.clone(),
            (None, Some(r)) => format!("http://{}", r.addr),
            (None, None) => upstream.url(),
        };
        let text = self.config(
            redis.as_ref(),
            redis_relay.as_ref().map(|r| r.addr),
            &upstream_url,
        );
        let proxy = Proxy::start(&text).await;
        Env {
            redis,
            upstream,
            proxy,
            redis_relay,
            upstream_relay,
        }
    }
}

impl Env {
    pub fn builder(backend: Backend) -> EnvBuilder {
        EnvBuilder {
            backend,
            routes: ROUTES.to_string(),
            server_extra: String::new(),
            store_extra: String::new(),
            redis_relay: false,
            upstream_relay: false,
            upstream_url: None,
        }
    }

    pub async fn start(backend: Backend) -> Env {
        Self::builder(backend).start().await
    }

    pub async fn with_routes(backend: Backend, routes: &str) -> Env {
        Self::builder(backend).routes(routes).start().await
    }

    pub fn url(&self, path: &str) -> String {
        self.proxy.url(path)
    }

    /// The store keys, when the store is Redis (the memory store cannot be looked into).
    pub async fn store_keys(&self) -> Option<Vec<String>> {
        match &self.redis {
            Some(r) => Some(r.keys().await),
            None => None,
        }
    }

    /// The value of one metric series from /metrics (0 when absent).
    pub async fn metric(&self, series: &str) -> f64 {
        metric(&self.proxy, series).await
    }
}

/// The value of one metric series (name with its labels, as exposed) from /metrics; 0 when absent.
pub async fn metric(proxy: &Proxy, series: &str) -> f64 {
    let r = get(&proxy.admin_url("/metrics")).await.expect("metrics");
    let text = String::from_utf8_lossy(&r.body);
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0.0)
}

/// Declares each scenario `async fn name(backend: Backend)` as a test on Redis and one on memory.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod on_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::Backend::Redis).await
                }
            )*
        }
        mod on_memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::Backend::Memory).await
                }
            )*
        }
    };
}
pub mod relay;
