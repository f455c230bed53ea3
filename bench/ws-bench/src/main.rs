//! WebSocket echo server and round-trip load client for `bench/bench.py`.
//!
//! ```text
//! ws-bench echo ADDR
//!     Echoes every text and binary message on every connection, on one
//!     thread (as the HTTP upstream of the benchmark runs one nginx worker).
//! ws-bench load URL CONNECTIONS SIZE SECONDS
//!     Opens CONNECTIONS WebSockets to URL (untimed), then on each, for
//!     SECONDS: sends a binary message of SIZE bytes, waits for its echo,
//!     compares it with what was sent, and sends the next. Then closes each
//!     with a close handshake and prints one line of JSON.
//! ```
//!
//! It prints figures; it asserts nothing about speed.

use std::fmt::Write as _;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::{Bytes, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

const USAGE: &str = "usage: ws-bench echo ADDR | ws-bench load URL CONNECTIONS SIZE SECONDS";

/// How long the close handshake of one connection may take at the end.
const CLOSE_DEADLINE: Duration = Duration::from_secs(5);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("echo") if args.len() == 2 => echo(&args[1]),
        Some("load") if args.len() == 5 => {
            let number = |i: usize| -> u64 {
                args[i].parse().unwrap_or_else(|_| {
                    eprintln!("{USAGE}");
                    std::process::exit(2)
                })
            };
            load(&args[1], number(2) as usize, number(3) as usize, number(4));
        }
        _ => {
            eprintln!("{USAGE}");
            std::process::exit(2);
        }
    }
}

fn echo(addr: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let listener = TcpListener::bind(addr).await.expect("bind");
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    eprintln!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await else {
                    return;
                };
                // Pings and the close handshake are answered by tungstenite
                // itself (on the next read); the loop ends with the connection.
                while let Some(Ok(msg)) = ws.next().await {
                    if (msg.is_binary() || msg.is_text()) && ws.send(msg).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
}

type Client = WebSocketStream<MaybeTlsStream<TcpStream>>;

#[derive(Default)]
struct Stats {
    /// Echoes received before the end of the measured time.
    messages: u64,
    /// Echoes that differed from what was sent.
    mismatched: u64,
    /// Round-trip times of the counted echoes, microseconds.
    rtt_us: Vec<u32>,
    /// What ended the connection early, if anything did.
    error: Option<String>,
    /// The close handshake completed within [`CLOSE_DEADLINE`].
    closed_cleanly: bool,
}

fn load(url: &str, connections: usize, size: usize, seconds: u64) {
    // Two threads, as wrk runs with -t2 in the same benchmark.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let payload: Bytes = (0..size)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>()
            .into();
        let mut sockets = Vec::with_capacity(connections);
        let mut connect_errors = Vec::new();
        for _ in 0..connections {
            match tokio_tungstenite::connect_async_with_config(url, None, true).await {
                Ok((ws, _)) => sockets.push(ws),
                Err(e) => connect_errors.push(e.to_string()),
            }
        }
        let start = Instant::now();
        let deadline = start + Duration::from_secs(seconds);
        let tasks: Vec<_> = sockets
            .into_iter()
            .map(|ws| tokio::spawn(round_trips(ws, payload.clone(), deadline)))
            .collect();
        let mut all = Stats::default();
        let mut errors = Vec::new();
        let mut closed_cleanly = 0;
        for task in tasks {
            let s = task.await.expect("load task");
            all.messages += s.messages;
            all.mismatched += s.mismatched;
            all.rtt_us.extend(s.rtt_us);
            errors.extend(s.error);
            closed_cleanly += usize::from(s.closed_cleanly);
        }
        all.rtt_us.sort_unstable();
        let pct = |p: f64| -> f64 {
            if all.rtt_us.is_empty() {
                return 0.0;
            }
            let i = ((all.rtt_us.len() as f64 - 1.0) * p).round() as usize;
            f64::from(all.rtt_us[i]) / 1000.0
        };
        let secs = seconds as f64;
        let msgs_per_s = all.messages as f64 / secs;
        let mut out = String::new();
        let _ = write!(
            out,
            "{{\"connections\":{connections},\"size\":{size},\"seconds\":{seconds},\
             \"messages\":{},\"msgs_per_s\":{msgs_per_s:.1},\"mib_per_s\":{:.2},\
             \"rtt_p50_ms\":{:.3},\"rtt_p99_ms\":{:.3},\"mismatched\":{},\
             \"connect_errors\":{},\"errors\":{},\"closed_cleanly\":{closed_cleanly},\
             \"first_error\":{}}}",
            all.messages,
            msgs_per_s * size as f64 / (1024.0 * 1024.0),
            pct(0.5),
            pct(0.99),
            all.mismatched,
            connect_errors.len(),
            errors.len(),
            json_string(connect_errors.first().or(errors.first())),
        );
        println!("{out}");
    });
}

/// One message in flight per connection: send, wait for the echo, repeat
/// until `deadline`; then the close handshake.
async fn round_trips(mut ws: Client, payload: Bytes, deadline: Instant) -> Stats {
    let mut s = Stats::default();
    loop {
        let sent = Instant::now();
        if sent >= deadline {
            break;
        }
        if let Err(e) = ws.send(Message::Binary(payload.clone())).await {
            s.error = Some(format!("send: {e}"));
            return s;
        }
        match ws.next().await {
            Some(Ok(Message::Binary(echo))) => {
                let now = Instant::now();
                if echo != payload {
                    s.mismatched += 1;
                }
                if now <= deadline {
                    s.messages += 1;
                    s.rtt_us
                        .push(u32::try_from((now - sent).as_micros()).unwrap_or(u32::MAX));
                }
            }
            other => {
                s.error = Some(format!("receive: {other:?}"));
                return s;
            }
        }
    }
    let closed = tokio::time::timeout(CLOSE_DEADLINE, async {
        ws.close(None).await?;
        // The server's close frame, then the end of the stream.
        while let Some(msg) = ws.next().await {
            msg?;
        }
        Ok::<_, tokio_tungstenite::tungstenite::Error>(())
    })
    .await;
    s.closed_cleanly = matches!(closed, Ok(Ok(())));
    s
}

fn json_string(s: Option<&String>) -> String {
    let Some(s) = s else {
        return "null".to_string();
    };
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
