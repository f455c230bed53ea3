//! A programmable upstream on port 0: counts what reaches it, holds requests until the
//! test lets them go, and answers as the request's `x-test-*` headers say.
//!
//! Request headers steer it:
//!   x-test-status: N        answer with status N (default 201)
//!   x-test-body-bytes: N    answer with N bytes of binary data instead of the JSON echo
//!   x-test-chunked: 1       send the body in 16 KiB chunks without Content-Length
//!   x-test-hold: 1          after counting the hit, wait until the test opens the gate
//!   x-test-delay-ms: N      sleep before answering
//!   x-test-hop: 1           add hop-by-hop headers to the answer
//! The default answer is 201 with Location, Content-Type, X-Custom, Set-Cookie,
//! and a JSON echo of the request (method, path, query, headers, body length, hit number).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use super::DEADLINE;

/// One request as the upstream received it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: Method,
    pub path: String,
    /// The request-target as it came: path and query (origin form).
    pub target: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

struct UpstreamState {
    hits: AtomicUsize,
    /// Requests being answered now (from arrival to the answer), and the most at once.
    active: AtomicUsize,
    peak: AtomicUsize,
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

/// One request counted in `active` (and `peak`) until its answer is made.
struct Active<'a>(&'a UpstreamState);

impl<'a> Active<'a> {
    fn enter(st: &'a UpstreamState) -> Self {
        let now = st.active.fetch_add(1, Ordering::SeqCst) + 1;
        st.peak.fetch_max(now, Ordering::SeqCst);
        Active(st)
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
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
            active: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
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
        let _active = Active::enter(&st);
        let h = parts.headers.clone();
        st.seen.lock().unwrap().push(Seen {
            method: parts.method.clone(),
            path: parts.uri.path().to_string(),
            target: parts.uri.to_string(),
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
        // A reason phrase of the test's own (`x-test-reason`), on the status line.
        if let Some(reason) = h.get("x-test-reason") {
            let reason = hyper::ext::ReasonPhrase::try_from(reason.as_bytes().to_vec());
            resp.extensions_mut()
                .insert(reason.expect("a valid reason phrase"));
        }
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

    /// Requests the upstream is answering now (arrived, answer not yet made).
    pub fn active(&self) -> usize {
        self.state.active.load(Ordering::SeqCst)
    }

    /// The most requests the upstream was answering at once.
    pub fn peak(&self) -> usize {
        self.state.peak.load(Ordering::SeqCst)
    }

    /// How many requests reached the upstream.
    pub fn hits(&self) -> usize {
        self.state.hits.load(Ordering::SeqCst)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }

    /// Executions per idempotency key, as the upstream saw them.
    pub fn executions(&self) -> std::collections::HashMap<String, usize> {
        let mut out = std::collections::HashMap::new();
        for s in self.state.seen.lock().unwrap().iter() {
            if let Some(k) = s
                .headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
            {
                *out.entry(k.to_string()).or_default() += 1;
            }
        }
        out
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
