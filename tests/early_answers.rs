//! Answers the proxy gives before a request's body was read say `Connection: close`,
//! so a keep-alive client does not send its next request onto a closing connection.

mod support;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads until the end of the response head.
async fn read_head(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let read = tokio::time::timeout(DEADLINE, s.read(&mut chunk)).await;
        match read.expect("an answer in time").expect("read") {
            0 => break,
            n => buf.extend_from_slice(&chunk[..n]),
        }
    }
    String::from_utf8_lossy(&buf).to_ascii_lowercase()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_answer_before_the_body_says_connection_close() {
    let upstream = TestUpstream::start().await;
    let routes = "[defaults]\nmax_request_body = \"1MiB\"\n\n[[routes]]\nname = \"payments\"\npath = \"/v1/payments\"\n";
    let config = ConfigBuilder::new(&upstream.url())
        .server("max_buffered = \"1MiB\"")
        .routes(routes)
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let addr = proxy
        .url("")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    // One upload that declares 1 MiB takes the whole budget and stalls.
    let mut stalled = TcpStream::connect(&addr).await.unwrap();
    let head = "POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-stall\r\nContent-Length: 1048576\r\n\r\nabc";
    stalled.write_all(head.as_bytes()).await.unwrap();
    let full = eventually("the budget to be taken", DEADLINE, || async {
        (metric(&proxy, "idemproxy_buffered_bytes").await >= 1048576.0).then_some(())
    });
    full.await;
    // A small request whose body has not come yet: 503 at once, and the connection is done.
    let mut c = TcpStream::connect(&addr).await.unwrap();
    let head = "POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-small\r\nContent-Length: 5\r\n\r\n";
    c.write_all(head.as_bytes()).await.unwrap();
    let answer = read_head(&mut c).await;
    assert!(answer.starts_with("http/1.1 503"), "{answer}");
    assert!(answer.contains("\r\nconnection: close\r\n"), "{answer}");
    drop(stalled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_after_the_whole_body_keeps_the_connection() {
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .route("payments", "/v1/payments", "")
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let addr = proxy
        .url("")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let mut c = TcpStream::connect(&addr).await.unwrap();
    // A 422 comes after the body was read: keep-alive stays.
    for (key, body) in [("k-ka", "a"), ("k-ka", "b")] {
        let req = format!("POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\nContent-Length: 1\r\n\r\n{body}");
        c.write_all(req.as_bytes()).await.unwrap();
        let answer = read_head(&mut c).await;
        assert!(!answer.contains("connection: close"), "{answer}");
        // Read the body by its length before the next request.
        let len: usize = answer
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().unwrap());
        let mut rest = vec![0u8; len];
        let tail = answer.split("\r\n\r\n").nth(1).map_or(0, str::len);
        c.read_exact(&mut rest[tail..]).await.unwrap();
    }
}
