//! Upgrade tunnels (docs/reference/behaviour.md#upgrade): an HTTP/1.1 WebSocket handshake on a
//! path no route
//! protects (or that a route would forward unprotected: no key on an optional
//! route, shadow mode); on the upstream's 101, checked against the handshake,
//! the two connections are joined until either side closes. (On a protected
//! route the upgrade intent is dropped and the request protected.)
//!
//! Only WebSocket: once joined, every byte goes to the upstream unseen, so a
//! protocol that carries HTTP requests (`h2c`) or an upstream that answers 101
//! and goes on speaking HTTP would carry protected requests past the proxy.
//! Any other `Upgrade` is a hop-by-hop header like the rest, removed.

use base64::Engine;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, StatusCode, Version};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};
use uuid::Uuid;

use super::{send, Ctx, Handled};
use crate::body::Body;
use crate::conn::{Busy, BusyGuard};
use crate::metrics::{Counted, Outcome};
use crate::problem::Problem;

const SEC_WEBSOCKET_KEY: HeaderName = HeaderName::from_static("sec-websocket-key");
const SEC_WEBSOCKET_ACCEPT: HeaderName = HeaderName::from_static("sec-websocket-accept");
/// What RFC 6455 (§4.2.2) appends to the client's key before hashing it.
const WEBSOCKET_GUID: &[u8] = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// An HTTP/1.1 WebSocket handshake: one `Upgrade: websocket` line, the
/// `upgrade` token in `Connection` (without it, `Upgrade` is just a hop-by-hop
/// header) and one `Sec-WebSocket-Key`.
pub(crate) fn is_upgrade<B>(req: &Request<B>) -> bool {
    asks_upgrade(req.version(), req.headers())
}

/// [`is_upgrade`] for a request already taken apart.
pub(super) fn asks_upgrade(version: Version, headers: &HeaderMap) -> bool {
    version == Version::HTTP_11
        && one_line(headers, &header::UPGRADE)
            .is_some_and(|v| v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"websocket"))
        && one_line(headers, &SEC_WEBSOCKET_KEY).is_some()
        && connection_says_upgrade(headers)
}

/// The value of a header sent once, not twice.
fn one_line<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Option<&'h HeaderValue> {
    let mut lines = headers.get_all(name).iter();
    let first = lines.next()?;
    lines.next().is_none().then_some(first)
}

/// The `Sec-WebSocket-Accept` an upstream that took the handshake answers with.
fn accept_for(key: &HeaderValue) -> String {
    let mut input = key.as_bytes().trim_ascii().to_vec();
    input.extend_from_slice(WEBSOCKET_GUID);
    let digest = ring::digest::digest(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY, &input);
    base64::engine::general_purpose::STANDARD.encode(digest.as_ref())
}

/// A 101 that answers this handshake: `Upgrade: websocket` and the accept
/// value of its key. Anything else is not a WebSocket to be joined to.
fn answers_handshake(resp: &HeaderMap, expected_accept: &str) -> bool {
    one_line(resp, &header::UPGRADE)
        .is_some_and(|v| v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"websocket"))
        && one_line(resp, &SEC_WEBSOCKET_ACCEPT)
            .is_some_and(|v| v.as_bytes().trim_ascii() == expected_accept.as_bytes())
}

fn connection_says_upgrade(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .any(|token| token.trim_ascii().eq_ignore_ascii_case(b"upgrade"))
}

/// Forwards a WebSocket handshake with its `Connection`/`Upgrade` headers. A
/// 101 that answers it (its `Sec-WebSocket-Accept` made from the request's
/// key) is relayed with its own and the tunnel starts in a task of its own
/// (tracked: draining waits for it until the grace runs out); a 101 that
/// does not is an invalid answer (502); any other answer is relayed as a
/// plain response.
pub(super) async fn open(ctx: &Ctx<'_>, mut req: Request<Body>) -> Handled {
    let expected = req.headers().get(SEC_WEBSOCKET_KEY).map(accept_for);
    let client = hyper::upgrade::on(&mut req);
    // Counted from now, before the 101's own count ends with its body: the
    // client connection is busy, not idle, for as long as the tunnel lives
    // (a quiet WebSocket is not an idle connection).
    let busy = req.extensions().get::<Busy>().map(Busy::enter);
    let (parts, body) = req.into_parts();
    let mut prepared = ctx.app.upstream.prepare_upgrade(parts, body, ctx.caller);
    if let Ok(req) = &mut prepared {
        ctx.tunnel_context(req);
    }
    let mut resp = match send(ctx, prepared).await {
        Ok(resp) => resp,
        Err(problem) => return problem,
    };
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        return Handled::new(resp.map(Body::Stream), Outcome::Passthrough);
    }
    if !expected.is_some_and(|accept| answers_handshake(resp.headers(), &accept)) {
        tracing::warn!(request_id = %ctx.request_id, "upstream answered 101 without accepting the WebSocket handshake; not joined");
        return ctx.problem(&Problem::UpstreamReset { released: true });
    }
    let tunnel = Tunnel {
        client,
        upstream: hyper::upgrade::on(&mut resp),
        _busy: busy,
        _open: Counted::new(&ctx.app.metrics.tunnels),
        request_id: ctx.request_id,
        hard_stop: ctx.app.hard_stop.clone(),
    };
    ctx.app.tasks.spawn(tunnel.run());
    Handled::new(resp.map(Body::Stream), Outcome::Upgraded)
}

/// Both ends of a tunnel, once hyper hands over their connections.
struct Tunnel {
    /// Ready once hyper has written the 101 to the client.
    client: OnUpgrade,
    upstream: OnUpgrade,
    _busy: Option<BusyGuard>,
    /// Counted in `idemproxy_tunnels` from the 101 until the task ends.
    _open: Counted,
    request_id: Uuid,
    /// Cancelled when `shutdown_grace` runs out: the tunnel is closed then.
    hard_stop: CancellationToken,
}

impl Tunnel {
    async fn run(self) {
        let request_id = self.request_id;
        tokio::select! {
            () = self.hard_stop.cancelled() => {
                info!(request_id = %request_id, "tunnel closed: the shutdown grace ran out");
            }
            () = join(self.client, self.upstream, request_id) => {}
        }
    }
}

/// Copies bytes both ways until either side ends (docs/reference/behaviour.md#upgrade): its end
/// is passed on
/// to the other side as a shutdown of its write half, and then the tunnel
/// closes. A side that stays open after the other has gone, a peer that
/// ignores the end or never reads it, keeps no tunnel and no connection slot.
async fn join(client: OnUpgrade, upstream: OnUpgrade, request_id: Uuid) {
    let (client, upstream) = match tokio::try_join!(client, upstream) {
        Ok(both) => both,
        Err(e) => {
            // The client went away before the 101 reached it, or a side failed at the switch.
            debug!(request_id = %request_id, error = %e, "upgrade did not complete");
            return;
        }
    };
    let (mut from_client, mut to_client) = tokio::io::split(TokioIo::new(client));
    let (mut from_upstream, mut to_upstream) = tokio::io::split(TokioIo::new(upstream));
    let up = async {
        let copied = tokio::io::copy(&mut from_client, &mut to_upstream).await;
        let _ = to_upstream.shutdown().await;
        copied
    };
    let down = async {
        let copied = tokio::io::copy(&mut from_upstream, &mut to_client).await;
        let _ = to_client.shutdown().await;
        copied
    };
    let (ended_by, copied) = tokio::select! {
        copied = up => ("client", copied),
        copied = down => ("upstream", copied),
    };
    match copied {
        Ok(bytes) => info!(request_id = %request_id, ended_by, bytes, "tunnel closed"),
        Err(e) => {
            info!(request_id = %request_id, ended_by, error = %e, "tunnel closed by an error")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(version: Version, headers: &[(&str, &str)]) -> Request<()> {
        let mut b = Request::get("/chat").version(version);
        for (name, value) in headers {
            b = b.header(*name, *value);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn an_upgrade_needs_the_upgrade_header_and_the_connection_token_on_http_1_1() {
        let both = [
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "websocket"),
            ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ];
        assert!(is_upgrade(&request(Version::HTTP_11, &both)));
        let split = [
            ("connection", "keep-alive"),
            ("connection", " upgrade "),
            ("upgrade", "WebSocket"),
            ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ];
        assert!(is_upgrade(&request(Version::HTTP_11, &split)));
        // Only WebSocket, with its key: h2c and the like would carry HTTP past the proxy.
        for other in [
            vec![
                ("connection", "upgrade"),
                ("upgrade", "h2c"),
                ("sec-websocket-key", "a"),
            ],
            vec![
                ("connection", "upgrade"),
                ("upgrade", "websocket, h2c"),
                ("sec-websocket-key", "a"),
            ],
            vec![("connection", "upgrade"), ("upgrade", "websocket")],
            vec![
                ("connection", "upgrade"),
                ("upgrade", "websocket"),
                ("upgrade", "websocket"),
                ("sec-websocket-key", "a"),
            ],
        ] {
            assert!(!is_upgrade(&request(Version::HTTP_11, &other)), "{other:?}");
        }
        assert!(!is_upgrade(&request(Version::HTTP_10, &both)));
        assert!(!is_upgrade(&request(
            Version::HTTP_11,
            &[("upgrade", "websocket")]
        )));
        assert!(!is_upgrade(&request(
            Version::HTTP_11,
            &[("connection", "upgrade")]
        )));
        assert!(!is_upgrade(&request(
            Version::HTTP_11,
            &[("connection", "upgraded"), ("upgrade", "websocket")]
        )));
    }

    #[test]
    fn the_accept_value_is_rfc_6455s() {
        // RFC 6455 §1.3's example.
        let key = HeaderValue::from_static("dGhlIHNhbXBsZSBub25jZQ==");
        assert_eq!(accept_for(&key), "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
        let mut resp = HeaderMap::new();
        resp.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        resp.insert(
            SEC_WEBSOCKET_ACCEPT,
            HeaderValue::from_static("s3pPLMBiTxaQ9kYGzzhZRbK+xOo="),
        );
        assert!(answers_handshake(&resp, &accept_for(&key)));
        resp.insert(header::UPGRADE, HeaderValue::from_static("h2c"));
        assert!(!answers_handshake(&resp, &accept_for(&key)));
        resp.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        resp.insert(SEC_WEBSOCKET_ACCEPT, HeaderValue::from_static("x"));
        assert!(!answers_handshake(&resp, &accept_for(&key)));
    }
}
