//! The pooled upstream client, hop-by-hop header stripping (RFC 9110 §7.6.1) and forwarding headers.

mod pool;

pub use crate::body::Inbound;
pub use pool::Pool;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{HeaderMap, Request, Response, StatusCode, Uri, Version};
use http_body::Body as _;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::body::Body;
use crate::config::{self, UpstreamProtocol};
use crate::conn::Caller;
use crate::deadline::Deadlines;
use crate::workers::PerWorker;

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
///
/// `Connection` is read as bytes, token by token: one odd (non-UTF-8 or
/// invalid) token is skipped alone instead of switching off the removal of
/// every header the value names.
///
/// A message framed by `Transfer-Encoding` also loses its `Content-Length`
/// (RFC 9112 §6.3: the length is stale). Once `Transfer-Encoding` is gone, the
/// stale length would look authoritative to the next hop and cut the body
/// short. hyper's server drops it from requests; its client keeps it on responses.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none of them (every name `Connection` lists needs a
    // `Connection`): one pass over the names costs less than nine hashed removals.
    if !headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .filter_map(|t| HeaderName::from_bytes(t.trim_ascii().to_ascii_lowercase().as_slice()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    if headers.contains_key(header::TRANSFER_ENCODING) {
        headers.remove(header::CONTENT_LENGTH);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// The `Upgrade` lines of a message, to put back with [`restore_upgrade`] after stripping.
fn upgrade_lines(headers: &HeaderMap) -> Vec<HeaderValue> {
    headers.get_all(header::UPGRADE).iter().cloned().collect()
}

/// Puts back, on a stripped upgrade message, what the next hop needs to
/// switch protocols: its `Upgrade` lines and `Connection: upgrade` (the other
/// `Connection` tokens described only the previous hop).
fn restore_upgrade(headers: &mut HeaderMap, lines: Vec<HeaderValue>) {
    if lines.is_empty() {
        return;
    }
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    for line in lines {
        headers.append(header::UPGRADE, line);
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
    /// An answer that cannot be relayed or kept (a 101 to a request that
    /// did not ask to upgrade): the request was not carried out as asked.
    #[error("invalid upstream answer: {0}")]
    Invalid(&'static str),
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

/// The upstream: base URL and keep-alive connection pools, one per protocol.
pub struct Upstream {
    /// HTTP/1.1 exchanges, driven by the request's own task: a pool per
    /// worker thread, so that a connection is driven where it was made.
    pool: PerWorker<Arc<pool::Pool>>,
    /// HTTP/1.1 upgrades (a WebSocket's 101 and the tunnel after it).
    http1: Client<HttpConnector, Body>,
    /// Cleartext HTTP/2 with prior knowledge: requests multiplexed on one connection.
    h2c: Client<HttpConnector, Body>,
    protocol: UpstreamProtocol,
    base: config::UpstreamUrl,
    /// `upstream_timeout` for every exchange, kept by one timer per worker thread.
    deadlines: PerWorker<Deadlines>,
}

impl Upstream {
    /// The upstream `server` names; `slots`: per-worker places for its pools
    /// and timers (`ServerConfig::worker_slots`).
    pub fn new(server: &config::ServerConfig, slots: usize) -> Self {
        let (timeout, idle_timeout) = (server.upstream_timeout, server.upstream_idle_timeout);
        let base = server.upstream.clone();
        let connect_timeout = timeout.min(Duration::from_secs(5));
        let pool = PerWorker::new(slots, |_| {
            pool::Pool::new(&base.authority, connect_timeout, idle_timeout)
        });
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(idle_timeout)
            .pool_max_idle_per_host(1024);
        let http1 = builder.build(connector.clone());
        // A client only ever builds its pools on first use: the one a
        // protocol never chooses costs nothing.
        let h2c = builder
            .http2_only(true)
            .timer(TokioTimer::new())
            .build(connector);
        Upstream {
            pool,
            http1,
            h2c,
            protocol: server.upstream_protocol,
            base,
            deadlines: PerWorker::new(slots, |_| Deadlines::new(timeout)),
        }
    }

    /// This thread's `upstream_timeout` deadlines.
    pub fn deadlines(&self) -> &Deadlines {
        self.deadlines.get()
    }

    /// The version a request goes upstream with, given the one it came in with.
    fn version_for(&self, inbound: Version) -> Version {
        match (self.protocol, inbound) {
            (UpstreamProtocol::H2c, _) | (UpstreamProtocol::Auto, Version::HTTP_2) => {
                Version::HTTP_2
            }
            _ => Version::HTTP_11,
        }
    }

    /// The origin form of the upstream request-target for a request's path
    /// and query: the client's own when the upstream URL has no path prefix
    /// (a shared-bytes clone, no parse), else the prefix in front of it.
    fn origin_form(&self, original: &Uri) -> Result<Uri, UpstreamError> {
        let pq = original.path_and_query();
        if self.base.base_path.is_empty() {
            let pq = pq
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/"));
            return Ok(Uri::from(pq));
        }
        let pq = pq.map_or("/", |pq| pq.as_str());
        let mut path = String::with_capacity(self.base.base_path.len() + pq.len());
        path.push_str(&self.base.base_path);
        path.push_str(pq);
        PathAndQuery::from_maybe_shared(path)
            .map(Uri::from)
            .map_err(|e| UpstreamError::Connect(format!("cannot build the upstream URI: {e}")))
    }

    /// The absolute form of an origin-form URI, for hyper-util's client
    /// (HTTP/2 and upgrades), which picks its connection by scheme and authority.
    fn absolute(&self, uri: &Uri) -> Result<Uri, UpstreamError> {
        if uri.scheme().is_some() {
            return Ok(uri.clone());
        }
        let pq = uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        Uri::builder()
            .scheme(self.base.scheme.clone())
            .authority(self.base.authority.clone())
            .path_and_query(pq)
            .build()
            .map_err(|e| UpstreamError::Connect(format!("cannot build the upstream URI: {e}")))
    }

    /// Prepares a client request for the upstream: URI (its origin form),
    /// version, hop-by-hop
    /// headers removed, `X-Forwarded-For` / `X-Forwarded-Proto` (the
    /// [`Caller`]'s scheme) added. The
    /// client's authority is kept as `Host` to an HTTP/1.1 upstream (over
    /// HTTP/2 it came as `:authority`), and goes as `X-Forwarded-Host` to an
    /// HTTP/2 one, whose `:authority` names the upstream itself.
    pub fn prepare(
        &self,
        mut parts: http::request::Parts,
        body: Body,
        caller: Caller,
    ) -> Result<Request<Body>, UpstreamError> {
        let version = self.version_for(parts.version);
        let client_authority = parts.uri.authority().cloned();
        parts.uri = self.origin_form(&parts.uri)?;
        parts.version = version;
        let h = &mut parts.headers;
        // `TE: trailers` is the one `TE` HTTP/2 allows (RFC 9113 §8.2.2), and
        // gRPC needs it; on HTTP/1.1 `TE` is hop-by-hop like the rest.
        let te_trailers = version == Version::HTTP_2 && asks_for_trailers(h);
        strip_hop_by_hop(h);
        if te_trailers {
            h.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        if let Some(authority) = client_authority.filter(|_| !h.contains_key(header::HOST)) {
            if let Ok(v) = HeaderValue::from_str(authority.as_str()) {
                h.insert(header::HOST, v);
            }
        }
        // Over HTTP/2 the authority is `:authority`, and it names the upstream
        // (the connection pool is keyed by it): a `Host` beside it that says
        // something else is a malformed request to strict servers (nginx
        // answers 400, RFC 9113 §8.3.1). The client's host goes as
        // `X-Forwarded-Host` instead, unless one is there already.
        if version == Version::HTTP_2 {
            if let Some(host) = h.remove(header::HOST) {
                if !h.contains_key(X_FORWARDED_HOST) {
                    h.insert(X_FORWARDED_HOST, host);
                }
            }
        }
        let xff = forwarded_for(h, caller.addr);
        h.insert(X_FORWARDED_FOR, xff);
        // hyper's HTTP/1.1 client sends a body of unknown length on GET, HEAD
        // and CONNECT as no body at all unless `Transfer-Encoding` says
        // otherwise (it was stripped above, being hop-by-hop): say it again,
        // so a chunked body on such a request reaches the upstream
        // (docs/reference/behaviour.md#forwarding).
        // HTTP/2 frames every body and forbids the header.
        if version == Version::HTTP_11
            && !body.is_end_stream()
            && body.size_hint().exact().is_none()
            && !h.contains_key(header::CONTENT_LENGTH)
        {
            h.insert(
                header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            );
        }
        // A TLS-terminating load balancer in front may have said "https" already: keep it.
        if !h.contains_key(X_FORWARDED_PROTO) {
            h.insert(X_FORWARDED_PROTO, HeaderValue::from_static(caller.scheme));
        }
        Ok(Request::from_parts(parts, body))
    }

    /// Prepares an upgrade request (a WebSocket handshake) as [`Upstream::prepare`]
    /// does, but keeps `Connection: upgrade` and `Upgrade`: the upstream must see them to answer 101.
    pub(crate) fn prepare_upgrade(
        &self,
        parts: http::request::Parts,
        body: Body,
        caller: Caller,
    ) -> Result<Request<Body>, UpstreamError> {
        let lines = upgrade_lines(&parts.headers);
        let mut req = self.prepare(parts, body, caller)?;
        restore_upgrade(req.headers_mut(), lines);
        Ok(req)
    }

    /// Sends a request and waits for the response headers, at most `timeout`
    /// (pass-through: a long body stream afterwards is not cut).
    pub async fn send_with_timeout(
        &self,
        req: Request<Body>,
    ) -> Result<Response<Inbound>, UpstreamError> {
        let start = tokio::time::Instant::now();
        let deadlines = self.deadlines.get();
        match deadlines.within(start, self.send(req)).await {
            None => Err(UpstreamError::Timeout(deadlines.after())),
            Some(r) => r,
        }
    }

    /// Sends a request and waits for the response headers; the caller bounds the time.
    pub async fn send(&self, mut req: Request<Body>) -> Result<Response<Inbound>, UpstreamError> {
        let client = match req.version() {
            Version::HTTP_2 => &self.h2c,
            _ if req.headers().contains_key(header::UPGRADE) => &self.http1,
            _ => {
                // The request line takes the origin form (`prepare` made it);
                // `Host` names the upstream when the client's request had none.
                if req.uri().scheme().is_some() {
                    let pq = req.uri().path_and_query().cloned();
                    *req.uri_mut() =
                        Uri::from(pq.unwrap_or_else(|| PathAndQuery::from_static("/")));
                }
                if !req.headers().contains_key(header::HOST) {
                    if let Ok(v) = HeaderValue::from_str(self.base.authority.as_str()) {
                        req.headers_mut().insert(header::HOST, v);
                    }
                }
                let mut resp = self.pool.get().send(req).await?;
                strip_hop_by_hop(resp.headers_mut());
                return Ok(resp);
            }
        };
        *req.uri_mut() = self.absolute(req.uri())?;
        // Boxed: hyper-util's request future is large (~10 KiB with its
        // connector's), and only upgrades and HTTP/2 take this path.
        match Box::pin(client.request(req))
            .await
            .map(|r| r.map(Inbound::from))
        {
            Err(e) if e.is_connect() => Err(UpstreamError::Connect(describe(&e))),
            Err(e) => Err(UpstreamError::Exchange(describe(&e))),
            // A 101 is relayed to the client, which needs its `Upgrade` to know what it switched to.
            Ok(mut resp) if resp.status() == StatusCode::SWITCHING_PROTOCOLS => {
                let lines = upgrade_lines(resp.headers());
                strip_hop_by_hop(resp.headers_mut());
                restore_upgrade(resp.headers_mut(), lines);
                Ok(resp)
            }
            Ok(mut resp) => {
                strip_hop_by_hop(resp.headers_mut());
                Ok(resp)
            }
        }
    }
}

/// Whether `TE` lists `trailers` (the client will read trailers).
fn asks_for_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .any(|t| {
            let t = t.split(|&b| b == b';').next().unwrap_or_default();
            t.trim_ascii().eq_ignore_ascii_case(b"trailers")
        })
}

/// The `X-Forwarded-For` to send: every incoming line, in order, joined with
/// `", "`, then the peer's address. Read as bytes, so an odd line is kept too.
fn forwarded_for(headers: &HeaderMap, peer: SocketAddr) -> HeaderValue {
    // One allocation, handed to the value as it is (every request makes one).
    let mut joined: Vec<u8> = Vec::with_capacity(48);
    for line in headers.get_all(X_FORWARDED_FOR) {
        let line = line.as_bytes().trim_ascii();
        if !line.is_empty() {
            joined.extend_from_slice(line);
            joined.extend_from_slice(b", ");
        }
    }
    push_ip(&mut joined, peer.ip());
    // Each line was a valid value and ", " and an IP address are too, so this
    // cannot fail; if it ever did, the peer's address alone is still true.
    HeaderValue::from_maybe_shared(bytes::Bytes::from(joined)).unwrap_or_else(|_| {
        HeaderValue::from_str(&peer.ip().to_string()).unwrap_or(HeaderValue::from_static("unknown"))
    })
}

/// An address as `Display` writes it; IPv4 without the formatting machinery
/// (its padding and width support cost more than the rest of the header).
fn push_ip(out: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                if octet >= 100 {
                    out.push(b'0' + octet / 100);
                }
                if octet >= 10 {
                    out.push(b'0' + octet / 10 % 10);
                }
                out.push(b'0' + octet % 10);
            }
        }
        IpAddr::V6(v6) => {
            use std::io::Write as _;
            let _ = write!(out, "{v6}");
        }
    }
}

pub(crate) const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub(crate) const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub(crate) const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

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

    #[test]
    fn an_odd_byte_in_connection_spoils_only_its_own_token() {
        let mut h = HeaderMap::new();
        let odd = HeaderValue::from_bytes(b"x-secret, \xff-odd,  X-Other\t").unwrap();
        h.insert(header::CONNECTION, odd);
        h.append(
            header::CONNECTION,
            HeaderValue::from_bytes(b"\xfe").unwrap(),
        );
        h.append(header::CONNECTION, HeaderValue::from_static("x-third"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("x-other", HeaderValue::from_static("2"));
        h.insert("x-third", HeaderValue::from_static("3"));
        h.insert("x-keep", HeaderValue::from_static("yes"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert_eq!(h["x-keep"], "yes");
    }

    #[test]
    fn an_upgrade_keeps_its_upgrade_lines_and_only_the_upgrade_token() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, Upgrade, x-secret"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.append(header::UPGRADE, HeaderValue::from_static("h2c"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert("x-keep", HeaderValue::from_static("yes"));
        let lines = upgrade_lines(&h);
        strip_hop_by_hop(&mut h);
        restore_upgrade(&mut h, lines);
        assert_eq!(h.len(), 4, "{h:?}");
        assert_eq!(h[header::CONNECTION], "upgrade");
        let upgrade: Vec<_> = h.get_all(header::UPGRADE).iter().collect();
        assert_eq!(upgrade, ["websocket", "h2c"]);
        assert_eq!(h["x-keep"], "yes");
        // Nothing to restore: the message is stripped as any other.
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        restore_upgrade(&mut h, upgrade_lines(&HeaderMap::new()));
        strip_hop_by_hop(&mut h);
        assert!(h.is_empty());
    }

    #[test]
    fn transfer_encoding_takes_the_content_length_with_it() {
        let mut h = HeaderMap::new();
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        strip_hop_by_hop(&mut h);
        assert!(h.is_empty(), "{h:?}");
        // Without Transfer-Encoding the length is the message's own.
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h[header::CONTENT_LENGTH], "5");
    }

    #[test]
    fn addresses_are_written_as_display_writes_them() {
        let mut ips: Vec<IpAddr> = (0..=255u8)
            .flat_map(|o| {
                [
                    IpAddr::from([o, 0, 9, 255]),
                    IpAddr::from([10, o, 100, 99]),
                    IpAddr::from([1, 20, o, 3]),
                    IpAddr::from([192, 168, 1, o]),
                ]
            })
            .collect();
        ips.extend(
            [
                "::1",
                "::ffff:10.0.0.1",
                "2001:db8::8a2e:370:7334",
                "fe80::1",
            ]
            .map(|a| a.parse::<IpAddr>().unwrap()),
        );
        for ip in ips {
            let mut out = Vec::new();
            push_ip(&mut out, ip);
            assert_eq!(String::from_utf8(out).unwrap(), ip.to_string());
        }
    }

    #[test]
    fn every_forwarded_for_line_is_kept_in_order() {
        let peer: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let mut h = HeaderMap::new();
        assert_eq!(forwarded_for(&h, peer), "127.0.0.1");
        h.append(X_FORWARDED_FOR, HeaderValue::from_static("a"));
        h.append(X_FORWARDED_FOR, HeaderValue::from_static("b, c"));
        h.append(X_FORWARDED_FOR, HeaderValue::from_static(""));
        h.append(X_FORWARDED_FOR, HeaderValue::from_bytes(b"d\xff").unwrap());
        assert_eq!(
            forwarded_for(&h, peer).as_bytes(),
            b"a, b, c, d\xff, 127.0.0.1"
        );
    }
}
