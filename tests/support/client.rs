//! A small HTTP client for the tests: `Call` builds a request, `Resp` is the whole answer;
//! `raw` speaks bytes over a socket for what a well-behaved client would never send.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::DEADLINE;

/// A whole answer: status, headers and the body read to the end.
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

/// Sends `req` on a connection of its own; the answer's headers must come within [`DEADLINE`].
pub async fn send(req: Request<Full<Bytes>>) -> Result<Resp, String> {
    send_within(req, Some(DEADLINE)).await
}

/// Sends `req`; the answer's headers must come within `deadline` (any time when `None`).
pub async fn send_within(
    req: Request<Full<Bytes>>,
    deadline: Option<Duration>,
) -> Result<Resp, String> {
    let request = client().request(req);
    let resp = match deadline {
        Some(d) => tokio::time::timeout(d, request)
            .await
            .map_err(|_| "request timed out".to_string())?,
        None => request.await,
    }
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
    deadline: Option<Duration>,
}

impl Call {
    pub fn post(url: &str) -> Call {
        Self::new("POST", url)
    }

    pub fn new(method: &str, url: &str) -> Call {
        Call {
            builder: Request::builder().method(method).uri(url),
            deadline: Some(DEADLINE),
        }
    }

    pub fn key(self, key: &str) -> Call {
        self.header("idempotency-key", key)
    }

    pub fn header(self, name: &str, value: &str) -> Call {
        Call {
            builder: self.builder.header(name, value),
            ..self
        }
    }

    /// No deadline for the answer: for a request kept in flight while a test advances
    /// paused time, which would run the client's deadline out too.
    pub fn without_deadline(self) -> Call {
        Call {
            deadline: None,
            ..self
        }
    }

    pub async fn body(self, body: impl Into<Bytes>) -> Resp {
        send_within(
            self.builder.body(Full::new(body.into())).unwrap(),
            self.deadline,
        )
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

/// The value of one metric series (name with its labels, as exposed) from the admin
/// listener's /metrics; 0 when absent.
pub async fn metric_at(admin: SocketAddr, series: &str) -> f64 {
    let r = get(&format!("http://{admin}/metrics"))
        .await
        .expect("metrics");
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
