//! The kit's HTTP client: one request per connection (HTTP/1.1 over TCP or TLS), every one under a deadline, timed.
//!
//! A connection of its own per request keeps concurrent duplicates really
//! concurrent (no pool to queue them on one connection) and makes each
//! exchange's timing its own: when it was sent, when its answer was whole.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, HOST};
use http::{HeaderMap, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// The most of an answer's body the kit reads: answers are compared whole, and
/// a conformance run has no use for larger ones.
pub(crate) const MAX_ANSWER_BYTES: usize = 4 << 20;

/// Why a request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No TCP connection: refused, no route, a name that does not resolve.
    #[error("cannot connect to {authority}: {source}")]
    Connect {
        authority: String,
        source: std::io::Error,
    },
    /// Connected, but no whole answer: a reset, a malformed answer, a body over the cap.
    #[error("no answer from {authority}: {detail}")]
    Exchange { authority: String, detail: String },
    #[error("no answer from {authority} within {timeout:?}")]
    Timeout {
        authority: String,
        timeout: Duration,
    },
}

/// One exchange: what was asked, what came back, and when.
#[derive(Clone, Debug)]
pub struct Exchange {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// When the request was started (before connecting).
    pub sent: Instant,
    /// When the whole answer had been read.
    pub answered: Instant,
}

impl Exchange {
    /// How long the exchange took.
    pub fn latency(&self) -> Duration {
        self.answered.duration_since(self.sent)
    }

    /// A header's value as text (`None` when absent or not visible ASCII).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The media type of `Content-Type`, lower-cased, without parameters.
    pub(crate) fn media_type(&self) -> Option<String> {
        let value = self.header(CONTENT_TYPE.as_str())?;
        let essence = value.split(';').next().unwrap_or("").trim();
        Some(essence.to_ascii_lowercase())
    }
}

/// What every request of a run shares: where, how, with which headers, and the deadline.
#[derive(Clone, Debug)]
pub struct Client {
    pub uri: Uri,
    pub method: Method,
    /// `--header` lines, sent on every request (auth, tenant, test switches).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub timeout: Duration,
    /// For `https://` URLs (the target's or the counter's).
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

impl Client {
    /// `host:port` of the target (port 80 when the URL has none).
    pub fn authority(&self) -> String {
        authority_of(&self.uri)
    }

    /// Sends the run's method to the target with `extra` headers (the key) and `body`.
    /// A body without a `Content-Type` among the headers is sent as `application/json`.
    pub async fn send(
        &self,
        extra: &[(HeaderName, HeaderValue)],
        body: Bytes,
    ) -> Result<Exchange, SendError> {
        // `extra` replaces the run's headers of the same name (another principal's credentials).
        let mut headers: Vec<_> = self
            .headers
            .iter()
            .filter(|(name, _)| extra.iter().all(|(n, _)| n != name))
            .cloned()
            .collect();
        headers.extend(extra.iter().cloned());
        let has_type = headers.iter().any(|(n, _)| n == CONTENT_TYPE);
        if !has_type && !body.is_empty() {
            headers.push((CONTENT_TYPE, HeaderValue::from_static("application/json")));
        }
        let request = build(&self.uri, self.method.clone(), &headers, body);
        exchange(&self.uri, request, self.tls.as_ref(), self.timeout).await
    }

    /// A GET of `uri` with the run's headers (the executions counter).
    pub async fn get(&self, uri: &Uri) -> Result<Exchange, SendError> {
        let request = build(uri, Method::GET, &self.headers, Bytes::new());
        exchange(uri, request, self.tls.as_ref(), self.timeout).await
    }
}

/// The request in origin form, with `Host` from the URL.
fn build(uri: &Uri, method: Method, headers: &[(HeaderName, HeaderValue)], body: Bytes) -> Built {
    let target = uri.path_and_query().map_or("/", |p| p.as_str());
    let authority = authority_of(uri);
    let host = uri.authority().map_or(authority.as_str(), |a| a.as_str());
    let mut request = Request::builder()
        .method(method)
        .uri(target)
        .header(HOST, host);
    for (name, value) in headers {
        request = request.header(name, value);
    }
    request.body(Full::new(body))
}

fn authority_of(uri: &Uri) -> String {
    let host = uri.host().unwrap_or("localhost");
    let default_port = if uri.scheme_str() == Some("https") {
        443
    } else {
        80
    };
    let port = uri.port_u16().unwrap_or(default_port);
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

type Built = Result<Request<Full<Bytes>>, http::Error>;

/// One request on a connection of its own, whole answer read, all within `timeout`.
async fn exchange(
    uri: &Uri,
    request: Built,
    tls: Option<&Arc<rustls::ClientConfig>>,
    timeout: Duration,
) -> Result<Exchange, SendError> {
    let authority = authority_of(uri);
    let sent = Instant::now();
    let answer = tokio::time::timeout(timeout, connect_and_send(uri, request, tls));
    match answer.await {
        Ok(Ok((status, headers, body))) => Ok(Exchange {
            status,
            headers,
            body,
            sent,
            answered: Instant::now(),
        }),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(SendError::Timeout { authority, timeout }),
    }
}

type Answered = (StatusCode, HeaderMap, Bytes);

/// Connects (TCP, then TLS for `https://`) and sends.
async fn connect_and_send(
    uri: &Uri,
    request: Built,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<Answered, SendError> {
    let authority = authority_of(uri);
    let failed = |detail: String| SendError::Exchange {
        authority: authority.clone(),
        detail,
    };
    let request = request.map_err(|e| failed(e.to_string()))?;
    let stream = TcpStream::connect(&authority)
        .await
        .map_err(|source| SendError::Connect {
            authority: authority.clone(),
            source,
        })?;
    let _ = stream.set_nodelay(true);
    if uri.scheme_str() != Some("https") {
        return send_on(stream, request).await.map_err(failed);
    }
    let config = tls.ok_or_else(|| failed("no TLS configuration for https".into()))?;
    let host = uri.host().unwrap_or_default().trim_matches(['[', ']']);
    let name = ServerName::try_from(host.to_owned()).map_err(|e| failed(e.to_string()))?;
    let connector = tokio_rustls::TlsConnector::from(config.clone());
    let stream = connector
        .connect(name, stream)
        .await
        .map_err(|e| failed(format!("TLS: {e}")))?;
    send_on(stream, request).await.map_err(failed)
}

/// The most informational (1xx) answers taken before the final one: an endless
/// stream of `100 Continue` is no answer.
pub(crate) const MAX_INFORMATIONAL: usize = 16;

/// The connection's task, ended when the exchange ends, however it ends (a
/// deadline drops the exchange; a task left running would keep reading).
struct Driver(tokio::task::JoinHandle<()>);

impl Drop for Driver {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// HTTP/1.1 on a connected stream: the request, then the whole answer.
async fn send_on<S>(io: S, mut request: Request<Full<Bytes>>) -> Result<Answered, String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| e.to_string())?;
    // hyper skips 1xx answers itself; counting them ends a flood of them.
    let flood = Arc::new(tokio::sync::Notify::new());
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (notify, count) = (flood.clone(), seen);
    hyper::ext::on_informational(&mut request, move |_| {
        if count.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1 == MAX_INFORMATIONAL {
            notify.notify_one();
        }
    });
    let _driver = Driver(tokio::spawn(async move {
        let _ = connection.await;
    }));
    let too_many = async {
        flood.notified().await;
        Err(format!(
            "over {MAX_INFORMATIONAL} informational (1xx) answers"
        ))
    };
    let result = async {
        let response = tokio::select! {
            answer = sender.send_request(request) => answer.map_err(|e| e.to_string())?,
            failed = too_many => return failed,
        };
        let (parts, incoming) = response.into_parts();
        let body = Limited::new(incoming, MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| format!("reading the body: {e}"))?
            .to_bytes();
        Ok((parts.status, parts.headers, body))
    }
    .await;
    result
}

/// A count of executions read from a counter's answer: the body is a number, or
/// JSON holding exactly one number, anywhere (`{"charges": 3}`); anything else
/// is ambiguous and gives `None`.
pub(crate) fn count_from(body: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(body).ok()?.trim();
    if let Ok(n) = text.parse::<u64>() {
        return Some(n);
    }
    let value: serde_json::Value = serde_json::from_str(text).ok()?;
    let mut numbers = Vec::new();
    collect_numbers(&value, &mut numbers);
    match numbers.as_slice() {
        [n] => n.as_u64(),
        _ => None,
    }
}

fn collect_numbers<'a>(value: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Number>) {
    match value {
        serde_json::Value::Number(n) => out.push(n),
        serde_json::Value::Array(items) => items.iter().for_each(|v| collect_numbers(v, out)),
        serde_json::Value::Object(members) => {
            members.values().for_each(|v| collect_numbers(v, out))
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_a_number_or_the_first_number_in_json() {
        assert_eq!(count_from(b"7\n"), Some(7));
        assert_eq!(count_from(br#"{"charges": 3}"#), Some(3));
        assert_eq!(
            count_from(br#"{"name": "x", "stats": {"runs": 12}}"#),
            Some(12)
        );
        assert_eq!(count_from(br#"[{"n": 2}]"#), Some(2));
        assert_eq!(count_from(b"none"), None);
        assert_eq!(count_from(br#"{"n": -1}"#), None);
        assert_eq!(
            count_from(br#"{"runs": 1, "failed": 0}"#),
            None,
            "two numbers: ambiguous"
        );
    }

    #[test]
    fn the_authority_has_a_port() {
        let uri: Uri = "http://127.0.0.1:8080/v1".parse().unwrap();
        assert_eq!(authority_of(&uri), "127.0.0.1:8080");
        let uri: Uri = "http://api.example/v1".parse().unwrap();
        assert_eq!(authority_of(&uri), "api.example:80");
        let uri: Uri = "http://[::1]:9/".parse().unwrap();
        assert_eq!(authority_of(&uri), "[::1]:9");
        let uri: Uri = "https://api.example/v1".parse().unwrap();
        assert_eq!(authority_of(&uri), "api.example:443");
    }
}
