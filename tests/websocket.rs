//! Upgrade tunnels (§9): a real WebSocket client and a real WebSocket server
//! (tokio-tungstenite) talking through the proxy binary.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use support::{eventually, metric, Proxy, DEADLINE};

type Client = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// A text message that asks the server to close the connection itself.
const CLOSE_ME: &str = "server, close please";

/// A text message after which the server stops reading and keeps its socket
/// open, whatever the other side does.
const HOLD: &str = "server, hold the line";

/// A text message after which the server drops its socket without a close frame.
const VANISH: &str = "server, vanish";

/// A path on which the server refuses the handshake with a 403.
const FORBIDDEN: &str = "/forbidden";

/// A WebSocket echo server: echoes text and binary messages, closes with code
/// 4000 when asked to, holds or drops its socket when asked to ([`HOLD`],
/// [`VANISH`]), refuses handshakes on [`FORBIDDEN`], and reports each close
/// it sees on `events`.
struct EchoServer {
    addr: SocketAddr,
    events: mpsc::UnboundedReceiver<String>,
}

impl EchoServer {
    async fn start() -> EchoServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, events) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(echo(stream, tx.clone()));
            }
        });
        EchoServer { addr, events }
    }

    /// The next close (or error) the server saw, within the deadline.
    async fn next_event(&mut self) -> String {
        tokio::time::timeout(DEADLINE, self.events.recv())
            .await
            .expect("an event from the WebSocket server in time")
            .expect("server running")
    }
}

async fn echo(stream: TcpStream, events: mpsc::UnboundedSender<String>) {
    // The shape tungstenite's handshake callback must have.
    #[allow(clippy::result_large_err)]
    let refuse_forbidden = |req: &Request, resp: Response| {
        if req.uri().path() != FORBIDDEN {
            return Ok(resp);
        }
        let mut refusal = ErrorResponse::new(Some("no sockets here".to_string()));
        *refusal.status_mut() = http::StatusCode::FORBIDDEN;
        Err(refusal)
    };
    let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(stream, refuse_forbidden).await else {
        let _ = events.send("handshake failed".to_string());
        return;
    };
    while let Some(msg) = ws.next().await {
        let sent = match msg {
            Ok(Message::Text(t)) if t.as_str() == CLOSE_ME => {
                ws.close(Some(CloseFrame {
                    code: CloseCode::Library(4000),
                    reason: "server says bye".into(),
                }))
                .await
            }
            Ok(Message::Text(t)) if t.as_str() == HOLD => {
                let _ = events.send("holding".to_string());
                // Never reads again and never closes: the socket stays open.
                std::future::pending::<()>().await;
                Ok(())
            }
            Ok(Message::Text(t)) if t.as_str() == VANISH => {
                let _ = events.send("vanishing".to_string());
                return;
            }
            Ok(m @ (Message::Text(_) | Message::Binary(_))) => ws.send(m).await,
            Ok(Message::Close(frame)) => {
                let reason = frame.map(|f| f.reason.to_string()).unwrap_or_default();
                let _ = events.send(format!("close: {reason}"));
                // tungstenite answers the close on the next read; keep reading.
                Ok(())
            }
            Ok(_) => Ok(()),
            Err(e) => {
                let _ = events.send(format!("error: {e}"));
                return;
            }
        };
        if let Err(e) = sent {
            let _ = events.send(format!("send error: {e}"));
            return;
        }
    }
}

fn config(upstream: SocketAddr, server_extra: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
upstream = "http://{upstream}"
upstream_timeout = "10s"
{server_extra}

[store]
backend = "memory"

[[routes]]
name = "feed"
methods = ["GET"]
path = "/v1/feed"

[[routes]]
name = "payments"
path = "/v1/payments"

[[routes]]
name = "live"
methods = ["GET"]
path = "/v1/live"
key = "optional"

[[routes]]
name = "watch"
methods = ["GET"]
path = "/v1/watch"
mode = "shadow"
"#
    )
}

/// The echo server and the proxy in front of it, served in-process.
async fn start(server_extra: &str) -> (EchoServer, Proxy) {
    let server = EchoServer::start().await;
    let proxy = Proxy::in_process(&config(server.addr, &with_grace(server_extra)), &[]).await;
    (server, proxy)
}

/// As [`start`], the binary: for what only a process has (SIGTERM, its exit code).
async fn start_binary(server_extra: &str) -> (EchoServer, Proxy) {
    let server = EchoServer::start().await;
    let proxy = Proxy::start(&config(server.addr, &with_grace(server_extra))).await;
    (server, proxy)
}

fn with_grace(server_extra: &str) -> String {
    let mut extra = server_extra.to_string();
    if !extra.contains("shutdown_grace") {
        extra.push_str("\nshutdown_grace = \"10s\"");
    }
    extra
}

async fn connect(proxy: &Proxy, path: &str) -> Client {
    let url = format!("ws://{}{path}", proxy.addr);
    let (ws, resp) = tokio::time::timeout(DEADLINE, tokio_tungstenite::connect_async(url))
        .await
        .expect("handshake in time")
        .expect("WebSocket handshake through the proxy");
    assert_eq!(resp.status(), 101);
    ws
}

/// The next message the client receives, within the deadline.
async fn recv(ws: &mut Client) -> Message {
    tokio::time::timeout(DEADLINE, ws.next())
        .await
        .expect("a message in time")
        .expect("the connection is open")
        .expect("a message, not an error")
}

async fn echoes(ws: &mut Client, msg: Message) {
    ws.send(msg.clone()).await.expect("send");
    assert_eq!(recv(ws).await, msg);
}

/// Ends once the client's connection has ended (a close, an error or the end of the stream).
async fn wait_closed(ws: &mut Client) {
    loop {
        match tokio::time::timeout(DEADLINE, ws.next()).await {
            Err(_) => panic!("the tunnel was not closed in time"),
            Ok(None | Some(Err(_)) | Some(Ok(Message::Close(_)))) => return,
            Ok(Some(Ok(_))) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_binary_and_large_messages_echo_through_the_tunnel() {
    let (_server, proxy) = start("").await;
    let mut ws = connect(&proxy, "/chat").await;
    echoes(&mut ws, Message::text("hello through the proxy")).await;
    echoes(&mut ws, Message::binary(vec![0u8, 1, 2, 255, 254])).await;
    let large: Vec<u8> = (0..4 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
    echoes(&mut ws, Message::binary(large)).await;
    echoes(&mut ws, Message::text("still open after 4 MiB")).await;
    let series = r#"idemproxy_requests_total{route="",outcome="upgraded"}"#;
    assert_eq!(metric(&proxy, series).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_from_the_client_reaches_the_server_and_is_answered() {
    let (mut server, proxy) = start("").await;
    let mut ws = connect(&proxy, "/chat").await;
    echoes(&mut ws, Message::text("before the close")).await;
    ws.close(Some(CloseFrame {
        code: CloseCode::Normal,
        reason: "client says bye".into(),
    }))
    .await
    .expect("send the close");
    assert_eq!(server.next_event().await, "close: client says bye");
    // The server's answer to the close comes back through the tunnel, then the end.
    match recv(&mut ws).await {
        Message::Close(Some(f)) => assert_eq!(f.code, CloseCode::Normal),
        other => panic!("expected the server's close, got {other:?}"),
    }
    let end = tokio::time::timeout(DEADLINE, ws.next()).await;
    assert!(matches!(end, Ok(None)), "{end:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_from_the_server_reaches_the_client_and_is_answered() {
    let (mut server, proxy) = start("").await;
    let mut ws = connect(&proxy, "/chat").await;
    ws.send(Message::text(CLOSE_ME)).await.expect("send");
    match recv(&mut ws).await {
        Message::Close(Some(f)) => {
            assert_eq!(f.code, CloseCode::Library(4000));
            assert_eq!(f.reason.as_str(), "server says bye");
        }
        other => panic!("expected the server's close, got {other:?}"),
    }
    // Reading on sends the client's answer (tungstenite echoes the close), then the connection ends.
    let end = tokio::time::timeout(DEADLINE, ws.next()).await;
    assert!(matches!(end, Ok(None)), "{end:?}");
    assert_eq!(server.next_event().await, "close: server says bye");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_handshake_on_a_protected_route_is_protected_not_tunnelled() {
    let (_server, proxy) = start("").await;
    // No key: refused like any request on the route (an `Upgrade` header is no way around it).
    match tokio_tungstenite::connect_async(format!("ws://{}/v1/feed", proxy.addr)).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => assert_eq!(resp.status(), 400),
        other => panic!("expected a 400 for a keyless handshake, got {other:?}"),
    }
    // With a key: reserved and forwarded as a plain request, never a tunnel.
    let url = format!("ws://{}/v1/feed", proxy.addr);
    let mut req =
        tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(url)
            .expect("request");
    req.headers_mut()
        .insert("idempotency-key", "ws-1".parse().unwrap());
    let keyed = tokio_tungstenite::connect_async(req).await;
    assert!(keyed.is_err(), "no tunnel on a protected route");
    let upgraded = r#"idemproxy_requests_total{route="feed",outcome="upgraded"}"#;
    assert_eq!(metric(&proxy, upgraded).await, 0.0);
    let reserves = r#"idemproxy_store_duration_seconds_count{op="reserve"}"#;
    assert_eq!(
        metric(&proxy, reserves).await,
        1.0,
        "the keyed handshake was reserved"
    );
    // Elsewhere a handshake is still a tunnel.
    echoes(
        &mut connect(&proxy, "/chat").await,
        Message::text("still tunnelled"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_handshake_is_relayed_as_a_plain_answer() {
    let (_server, proxy) = start("").await;
    let url = format!("ws://{}{FORBIDDEN}", proxy.addr);
    let refused = tokio_tungstenite::connect_async(url).await;
    match refused {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            assert_eq!(resp.status(), 403);
            // (tungstenite's client reads the body raw: the proxy relays it chunked.)
            let body = String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default());
            assert!(body.contains("no sockets here"), "{body:?}");
        }
        other => panic!("expected the upstream's 403, got {other:?}"),
    }
    let passthrough = r#"idemproxy_requests_total{route="",outcome="passthrough"}"#;
    assert_eq!(metric(&proxy, passthrough).await, 1.0);
    let upgraded = r#"idemproxy_requests_total{route="",outcome="upgraded"}"#;
    assert_eq!(metric(&proxy, upgraded).await, 0.0);
    // A refusal leaves nothing behind: the next handshake is a tunnel.
    echoes(
        &mut connect(&proxy, "/chat").await,
        Message::text("and now"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_holds_its_connection_slot_until_it_closes() {
    let (mut server, proxy) = start("max_connections = 1").await;
    let mut first = connect(&proxy, "/chat").await;
    echoes(&mut first, Message::text("holding the only slot")).await;
    let url = format!("ws://{}/chat", proxy.addr);
    let mut second = tokio::spawn(tokio_tungstenite::connect_async(url));
    // Not served while the tunnel holds the slot (waiting is the subject here)...
    let early = tokio::time::timeout(Duration::from_millis(500), &mut second).await;
    assert!(
        early.is_err(),
        "a second connection was served beyond max_connections"
    );
    // ...and served once the tunnel has closed.
    first.close(None).await.expect("close");
    wait_closed(&mut first).await;
    assert_eq!(server.next_event().await, "close: ");
    // The tunnel ends when either side closes its socket.
    drop(first);
    let (mut second, _) = tokio::time::timeout(DEADLINE, second)
        .await
        .expect("the second handshake in time")
        .expect("join")
        .expect("the second handshake");
    echoes(&mut second, Message::text("my turn")).await;
}

/// `idemproxy_tunnels` counts a tunnel from its 101 until it closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_tunnels_are_counted_until_they_close() {
    let (mut server, proxy) = start("").await;
    let tunnels = || async { metric(&proxy, "idemproxy_tunnels").await };
    assert_eq!(tunnels().await, 0.0);
    let mut first = connect(&proxy, "/chat").await;
    let mut second = connect(&proxy, "/chat").await;
    echoes(&mut first, Message::text("one")).await;
    echoes(&mut second, Message::text("two")).await;
    eventually("two tunnels counted", DEADLINE, || async {
        (tunnels().await == 2.0).then_some(())
    })
    .await;
    first.close(None).await.expect("close");
    wait_closed(&mut first).await;
    assert_eq!(server.next_event().await, "close: ");
    drop(first);
    eventually("the closed tunnel uncounted", DEADLINE, || async {
        (tunnels().await == 1.0).then_some(())
    })
    .await;
    echoes(&mut second, Message::text("still open")).await;
}

/// A tunnel ends when either side closes (§9), not when both have: a side
/// that stays open after the other has gone (a server that never reads
/// again, a client that never reads the end) keeps no tunnel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_ends_when_either_side_closes() {
    let (mut server, proxy) = start("").await;
    let tunnels = || async { metric(&proxy, "idemproxy_tunnels").await };

    // The client goes away; the server holds its socket open.
    let mut ws = connect(&proxy, "/chat").await;
    ws.send(Message::text(HOLD)).await.expect("send");
    assert_eq!(server.next_event().await, "holding");
    eventually("the tunnel counted", DEADLINE, || async {
        (tunnels().await == 1.0).then_some(())
    })
    .await;
    drop(ws);
    closed_by(&proxy, "client").await;

    // The server goes away; the client stays connected and reads nothing.
    let mut ws = connect(&proxy, "/chat").await;
    ws.send(Message::text(VANISH)).await.expect("send");
    assert_eq!(server.next_event().await, "vanishing");
    closed_by(&proxy, "upstream").await;
    drop(ws);
}

/// Waits until no tunnel is open, and checks that the log says `side` ended it.
async fn closed_by(proxy: &Proxy, side: &str) {
    eventually(
        &format!("the tunnel closed by the {side}"),
        DEADLINE,
        || async { (metric(proxy, "idemproxy_tunnels").await == 0.0).then_some(()) },
    )
    .await;
    let ended = format!(r#""ended_by":"{side}""#);
    proxy
        .wait_log_where(&format!("\"tunnel closed\" with {ended}"), |l| {
            l.contains("tunnel closed") && l.contains(&ended)
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_tunnel_outlives_the_idle_timeout() {
    let (_server, proxy) = start("idle_timeout = \"500ms\"").await;
    let mut ws = connect(&proxy, "/chat").await;
    echoes(&mut ws, Message::text("before the quiet")).await;
    // Nothing either way for four idle timeouts: the subject of the test, not a synchronisation.
    tokio::time::sleep(Duration::from_secs(2)).await;
    echoes(&mut ws, Message::text("after the quiet")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_closes_a_live_tunnel_at_the_end_of_the_grace() {
    let grace = Duration::from_secs(2);
    // The binary: SIGTERM is sent to it, and its exit code read.
    let (_server, mut proxy) = start_binary("shutdown_grace = \"2s\"").await;
    let mut ws = connect(&proxy, "/chat").await;
    echoes(&mut ws, Message::text("before SIGTERM")).await;
    let signalled = Instant::now();
    proxy.signal("TERM");
    proxy.wait_log("draining connections").await;
    // Within the grace the tunnel still carries messages.
    echoes(&mut ws, Message::text("during the grace")).await;
    wait_closed(&mut ws).await;
    assert!(
        signalled.elapsed() >= grace,
        "closed {:?} after SIGTERM, before the grace ran out",
        signalled.elapsed()
    );
    proxy
        .wait_log("tunnel closed: the shutdown grace ran out")
        .await;
    assert_eq!(proxy.wait_exit().await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_a_route_would_forward_unprotected_stays_a_websocket() {
    let (_server, proxy) = start("").await;
    // No key on an optional route, and shadow mode: forwarded as if the proxy
    // were absent, so the handshake is not broken by dropping its upgrade.
    echoes(
        &mut connect(&proxy, "/v1/live").await,
        Message::text("optional"),
    )
    .await;
    echoes(
        &mut connect(&proxy, "/v1/watch").await,
        Message::text("shadow"),
    )
    .await;
    for route in ["live", "watch"] {
        let series = format!(r#"idemproxy_requests_total{{route="{route}",outcome="upgraded"}}"#);
        assert_eq!(metric(&proxy, &series).await, 1.0, "{route}");
    }
    let reserves = r#"idemproxy_store_duration_seconds_count{op="reserve"}"#;
    assert_eq!(metric(&proxy, reserves).await, 0.0);
}
