//! The pooled upstream client, hop-by-hop header stripping (RFC 9110 §7.6.1) and forwarding headers.

use std::net::SocketAddr;
use std::time::Duration;

use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Request, Response, Uri};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::body::Body;
use crate::config;

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1, plus the
/// legacy `Keep-Alive` and `Proxy-Connection`): never forwarded, never stored.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
];

/// Removes the hop-by-hop headers and every header named in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().to_ascii_lowercase().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// How an upstream exchange failed; decides the status and whether the key is released.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The request never reached the upstream (refused, DNS, connect timeout).
    #[error("cannot connect to the upstream: {0}")]
    Connect(String),
    /// Failed after the request was (maybe) sent: reset, closed, cut-off body.
    #[error("upstream exchange failed: {0}")]
    Exchange(String),
    #[error("upstream did not answer within {0:?}")]
    Timeout(Duration),
}

fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The upstream: base URL and a keep-alive connection pool.
pub struct Upstream {
    client: Client<HttpConnector, Body>,
    base: config::UpstreamUrl,
    pub timeout: Duration,
}

impl Upstream {
    pub fn new(base: config::UpstreamUrl, timeout: Duration, idle_timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout.min(Duration::from_secs(5))));
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(idle_timeout)
            .pool_max_idle_per_host(1024)
            .build(connector);
        Upstream {
            client,
            base,
            timeout,
        }
    }

    /// The upstream URI for a request's path and query.
    fn uri_for(&self, original: &Uri) -> Result<Uri, UpstreamError> {
        let pq = original.path_and_query().map_or("/", |pq| pq.as_str());
        let mut path = String::with_capacity(self.base.base_path.len() + pq.len());
        path.push_str(&self.base.base_path);
        path.push_str(pq);
        Uri::builder()
            .scheme(self.base.scheme.clone())
            .authority(self.base.authority.clone())
            .path_and_query(path)
            .build()
            .map_err(|e| UpstreamError::Connect(format!("cannot build the upstream URI: {e}")))
    }

    /// Prepares a client request for the upstream: URI, hop-by-hop headers
    /// removed, `X-Forwarded-For` / `X-Forwarded-Proto` added. `Host` is kept.
    pub fn prepare(
        &self,
        mut parts: http::request::Parts,
        body: Body,
        peer: SocketAddr,
    ) -> Result<Request<Body>, UpstreamError> {
        parts.uri = self.uri_for(&parts.uri)?;
        parts.version = http::Version::HTTP_11;
        let h = &mut parts.headers;
        strip_hop_by_hop(h);
        let ip = peer.ip().to_string();
        let xff = match h.get(X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
            Some(prev) if !prev.trim().is_empty() => format!("{prev}, {ip}"),
            _ => ip,
        };
        if let Ok(v) = HeaderValue::from_str(&xff) {
            h.insert(X_FORWARDED_FOR, v);
        }
        // A TLS-terminating load balancer in front may have said "https" already: keep it.
        if !h.contains_key(X_FORWARDED_PROTO) {
            h.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
        }
        Ok(Request::from_parts(parts, body))
    }

    /// Sends a request and waits for the response headers, at most `timeout`
    /// (pass-through: a long body stream afterwards is not cut).
    pub async fn send_with_timeout(
        &self,
        req: Request<Body>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        match tokio::time::timeout(self.timeout, self.send(req)).await {
            Err(_) => Err(UpstreamError::Timeout(self.timeout)),
            Ok(r) => r,
        }
    }

    /// Sends a request and waits for the response headers; the caller bounds the time.
    pub async fn send(&self, req: Request<Body>) -> Result<Response<Incoming>, UpstreamError> {
        match self.client.request(req).await {
            Err(e) if e.is_connect() => Err(UpstreamError::Connect(describe(&e))),
            Err(e) => Err(UpstreamError::Exchange(describe(&e))),
            Ok(mut resp) => {
                strip_hop_by_hop(resp.headers_mut());
                Ok(resp)
            }
        }
    }
}

pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_fixed_and_connection_named_headers() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, X-Secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert("proxy-authorization", HeaderValue::from_static("Basic x"));
        h.insert("x-keep", HeaderValue::from_static("yes"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert_eq!(h["x-keep"], "yes");
    }
}
