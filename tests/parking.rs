//! Idle HTTP/1.1 connections parked: their hyper state freed while the client
//! is silent, the next request served on the same socket, no byte lost.

mod support;

use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The proxy parks a connection idle this long (`serve::PARK_AFTER`), with margin.
const PAST_PARKING: Duration = Duration::from_millis(700);

fn addr(proxy: &Proxy) -> String {
    proxy
        .url("")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string()
}

/// Reads one answer (head and a `Content-Length` body): its status and body.
async fn answer(c: &mut TcpStream) -> (u16, String) {
    let mut got = Vec::new();
    let read = async {
        loop {
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                if got.len() >= end + 4 + len {
                    let body = String::from_utf8_lossy(&got[end + 4..end + 4 + len]).into_owned();
                    return (raw_status(&head), body);
                }
            }
            let mut buf = [0u8; 4096];
            let n = c.read(&mut buf).await.expect("read");
            assert!(
                n > 0,
                "closed before a whole answer: {:?}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&buf[..n]);
        }
    };
    tokio::time::timeout(DEADLINE, read)
        .await
        .expect("an answer in time")
}

/// The test upstream, a proxy protecting `/v1/payments` in front of it, and
/// one client connection to the proxy.
async fn payments() -> (TestUpstream, Proxy, TcpStream) {
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .route("payments", "/v1/payments", "")
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let c = TcpStream::connect(addr(&proxy)).await.unwrap();
    (upstream, proxy, c)
}

/// The test upstream, a proxy with `header_read_timeout` and a long
/// `idle_timeout` in front of it, and one client connection to the proxy.
async fn timed_heads(header_read_timeout: &str) -> (TestUpstream, Proxy, TcpStream) {
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .server(&format!(
            "header_read_timeout = \"{header_read_timeout}\"\nidle_timeout = \"60s\""
        ))
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let c = TcpStream::connect(addr(&proxy)).await.unwrap();
    (upstream, proxy, c)
}

async fn parked(proxy: &Proxy) -> f64 {
    metric(proxy, "idemproxy_parked_connections").await
}

/// Waits until `n` connections are parked.
async fn until_parked(proxy: &Proxy, n: f64, what: &str) {
    eventually(what, DEADLINE, || async {
        (parked(proxy).await == n).then_some(())
    })
    .await;
}

fn post(key: &str, body: &str) -> String {
    format!(
        "POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_parked_and_serves_its_next_request() {
    let (upstream, proxy, mut c) = payments().await;
    c.write_all(post("park-1", r#"{"n":1}"#).as_bytes())
        .await
        .unwrap();
    assert_eq!(answer(&mut c).await.0, 201);
    until_parked(&proxy, 1.0, "the idle connection parked").await;
    // The same socket: the next request is served, and the wait is over.
    c.write_all(post("park-2", r#"{"n":2}"#).as_bytes())
        .await
        .unwrap();
    let (status, body) = answer(&mut c).await;
    assert_eq!(status, 201);
    assert!(
        body.contains(r#""idempotency-key":"park-2""#) && body.contains(r#""n":2"#),
        "the second request's own answer: {body}"
    );
    // A retry over the parked-then-woken connection is still a replay.
    until_parked(&proxy, 1.0, "parked again").await;
    c.write_all(post("park-1", r#"{"n":1}"#).as_bytes())
        .await
        .unwrap();
    let (status, body) = answer(&mut c).await;
    assert_eq!((status, body.contains(r#""n":1"#)), (201, true));
    assert_eq!(upstream.hits(), 2, "the retry was replayed");
    // The client leaving ends the parked wait.
    until_parked(&proxy, 1.0, "parked again").await;
    drop(c);
    until_parked(&proxy, 0.0, "no parked connection left").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_read_before_parking_are_not_lost() {
    let (upstream, _proxy, mut c) = payments().await;
    // One whole request and the start of the next, in one write: the first is
    // answered, the second's first bytes sit in hyper's buffer while it waits.
    let second = post("buf-2", r#"{"n":2}"#);
    let (start, rest) = second.split_at(30);
    let first = post("buf-1", r#"{"n":1}"#) + start;
    c.write_all(first.as_bytes()).await.unwrap();
    assert_eq!(answer(&mut c).await.0, 201);
    tokio::time::sleep(PAST_PARKING).await; // time is the subject: past the parking delay
    c.write_all(rest.as_bytes()).await.unwrap();
    let (status, body) = answer(&mut c).await;
    assert_eq!(status, 201);
    assert!(
        body.contains(r#""idempotency-key":"buf-2""#) && body.contains(r#""body_len":7"#),
        "the second request whole: {body}"
    );
    assert_eq!(upstream.hits(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_trickled_in_is_not_parked_and_its_header_timeout_holds() {
    let (_upstream, proxy, mut c) = timed_heads("1500ms").await;
    c.write_all(b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(answer(&mut c).await.0, 201);
    // The next request's head, a few bytes at a time, each pause past the
    // parking delay: parking must not start the head's clock again.
    let started = tokio::time::Instant::now();
    let (mut r, mut w) = c.into_split();
    let closed = tokio::spawn(async move {
        let mut rest = Vec::new();
        let _ = r.read_to_end(&mut rest).await;
        (tokio::time::Instant::now(), rest)
    });
    for piece in [
        &b"GET /ot"[..],
        b"her HT",
        b"TP/1.1\r\n",
        b"Host: x\r\n",
        b"X-A: 1\r\n",
    ] {
        if closed.is_finished() || w.write_all(piece).await.is_err() {
            break;
        }
        assert_eq!(
            parked(&proxy).await,
            0.0,
            "a half-read request is never parked"
        );
        tokio::time::sleep(PAST_PARKING).await; // time is the subject: past the parking delay
    }
    let (at, rest) = tokio::time::timeout(DEADLINE, closed)
        .await
        .expect("closed by header_read_timeout")
        .unwrap();
    let text = String::from_utf8_lossy(&rest);
    assert!(!text.starts_with("HTTP/1.1 201"), "never answered: {text}");
    assert!(
        at - started < Duration::from_millis(2500),
        "closed near header_read_timeout (1.5 s), not later: {:?}",
        at - started
    );
}

/// Every kind of answer ends with the connection's idle clock running: each
/// connection below is parked once its answer is out (the clock starts with
/// the answer's last bytes, whatever its body: a length, chunks, none). An
/// answer given before the request's body was read closes the connection
/// instead (`Connection: close`), so it is not among them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_answer_leaves_its_connection_to_be_parked() {
    let (upstream, proxy, first) = payments().await;
    drop(first);
    let requests = [
        "GET /other HTTP/1.1\r\nHost: x\r\n\r\n".to_string(),
        "GET /other HTTP/1.1\r\nHost: x\r\nx-test-chunked: 1\r\n\r\n".to_string(),
        "HEAD /other HTTP/1.1\r\nHost: x\r\n\r\n".to_string(),
        "GET /other HTTP/1.1\r\nHost: x\r\nx-test-status: 204\r\n\r\n".to_string(),
        "GET /other HTTP/1.1\r\nHost: x\r\nx-test-status: 304\r\n\r\n".to_string(),
        post("kinds-1", r#"{"n":1}"#),
        post("kinds-1", r#"{"n":1}"#),
        "POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: kinds-2\r\n\
         x-test-chunked: 1\r\nx-test-body-bytes: 65536\r\nContent-Length: 2\r\n\r\n{}"
            .to_string(),
        "POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: kinds-2\r\n\
         x-test-chunked: 1\r\nx-test-body-bytes: 65536\r\nContent-Length: 2\r\n\r\n{}"
            .to_string(),
    ];
    let mut open = Vec::new();
    for (i, request) in requests.iter().enumerate() {
        let mut c = TcpStream::connect(addr(&proxy)).await.unwrap();
        c.write_all(request.as_bytes()).await.unwrap();
        let first_line = request.lines().next().unwrap_or_default();
        until_parked(
            &proxy,
            (i + 1) as f64,
            &format!("parked after #{i}, {first_line}"),
        )
        .await;
        open.push(c);
    }
    assert_eq!(upstream.hits(), 7, "the two retries were replayed");
}

/// The start of a second head sent with the first request, and then nothing:
/// hyper holds those bytes while the connection waits, so no read of the
/// connection's own sees them start. They are a head all the same, held to
/// `header_read_timeout` (from the parking that hands them back at the
/// latest), not to `idle_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelined_head_that_stops_halfway_is_cut_off_by_the_header_timeout() {
    let (upstream, _proxy, mut c) = timed_heads("1s").await;
    c.write_all(b"GET /other HTTP/1.1\r\nHost: x\r\n\r\nGET /other HTTP/1.1\r\nHo")
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    assert_eq!(answer(&mut c).await.0, 201);
    let mut rest = Vec::new();
    tokio::time::timeout(DEADLINE, c.read_to_end(&mut rest))
        .await
        .expect("closed by header_read_timeout, not idle_timeout")
        .unwrap();
    let text = String::from_utf8_lossy(&rest);
    assert!(!text.contains("HTTP/1.1 201"), "never answered: {text}");
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "closed near the parking delay and header_read_timeout (1.25 s): {:?}",
        started.elapsed()
    );
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_connection_does_not_hold_up_shutdown() {
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .server("shutdown_grace = \"30s\"")
        .build();
    let mut proxy = Proxy::start(&config).await;
    let mut c = TcpStream::connect(addr(&proxy)).await.unwrap();
    c.write_all(b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(answer(&mut c).await.0, 201);
    until_parked(&proxy, 1.0, "the idle connection parked").await;
    let asked = tokio::time::Instant::now();
    proxy.signal("TERM");
    let code = tokio::time::timeout(DEADLINE, proxy.wait_exit())
        .await
        .expect("the proxy stops");
    assert_eq!(code, Some(0));
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "not the 30 s grace"
    );
    let mut rest = Vec::new();
    let n = tokio::time::timeout(DEADLINE, c.read_to_end(&mut rest)).await;
    assert!(
        matches!(n, Ok(Ok(0)) | Ok(Err(_))),
        "the parked connection is closed"
    );
}
