//! Upgrade tunnels (§9): an HTTP/1.1 `Upgrade` request (a WebSocket handshake) on a path no route protects; on the upstream's 101 the two connections are joined until either side closes. (On a protected route the upgrade intent is dropped and the request protected.)

use http::header::{self, HeaderMap};
use http::{Request, StatusCode, Version};
use hyper::body::Incoming;
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

/// An HTTP/1.1 request that asks to switch protocols: an `Upgrade` line and
/// the `upgrade` token in `Connection` (without it, `Upgrade` is just a hop-by-hop header).
pub fn is_upgrade<B>(req: &Request<B>) -> bool {
    req.version() == Version::HTTP_11
        && req.headers().contains_key(header::UPGRADE)
        && connection_says_upgrade(req.headers())
}

fn connection_says_upgrade(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .any(|token| token.trim_ascii().eq_ignore_ascii_case(b"upgrade"))
}

/// Forwards an upgrade request with its `Connection`/`Upgrade` headers. A 101
/// is relayed with its own and the tunnel starts in a task of its own
/// (tracked: draining waits for it until the grace runs out); any other
/// answer is relayed as a plain response.
pub(super) async fn open(ctx: &Ctx<'_>, mut req: Request<Incoming>) -> Handled {
    let client = hyper::upgrade::on(&mut req);
    // Counted from now, before the 101's own count ends with its body: the
    // client connection is busy, not idle, for as long as the tunnel lives
    // (a quiet WebSocket is not an idle connection).
    let busy = req.extensions().get::<Busy>().map(Busy::enter);
    let (parts, body) = req.into_parts();
    let prepared = ctx
        .app
        .upstream
        .prepare_upgrade(parts, Body::Stream(body.into()), ctx.caller);
    let mut resp = match send(ctx, prepared).await {
        Ok(resp) => resp,
        Err(problem) => return problem,
    };
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        return Handled::new(resp.map(Body::Stream), Outcome::Passthrough);
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

/// Copies bytes both ways until either side ends (§9): its end is passed on
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
        ];
        assert!(is_upgrade(&request(Version::HTTP_11, &both)));
        let split = [
            ("connection", "keep-alive"),
            ("connection", " upgrade "),
            ("upgrade", "h2c"),
        ];
        assert!(is_upgrade(&request(Version::HTTP_11, &split)));
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
}
