//! Hostile clients, over raw sockets: slowloris, request smuggling shapes,
//! oversized headers, too many connections. Nothing of it may reach the upstream.

mod support;

use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn env(server: &str) -> Env {
    Env::builder(Backend::Memory).server(server).start().await
}

/// Reads until the server closes the connection; panics if it does not within the deadline.
async fn read_until_closed(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(DEADLINE, s.read_to_end(&mut out))
        .await
        .expect("the server closes the connection")
        .ok();
    String::from_utf8_lossy(&out).into_owned()
}

fn never_smuggled(env: &Env) {
    for seen in env.upstream.seen() {
        assert_ne!(
            seen.path, "/smuggled",
            "a smuggled request reached the upstream"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_is_cut_off_after_the_header_timeout() {
    let env = env("header_read_timeout = \"500ms\"").await;
    let mut s = TcpStream::connect(env.proxy.addr).await.unwrap();
    s.write_all(b"POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k\r\n")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    read_until_closed(&mut s).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "closed by the header timeout, not by the test deadline"
    );
    assert_eq!(env.upstream.hits(), 0);
    // The proxy still serves others.
    assert_eq!(
        Call::post(&env.url("/v1/payments"))
            .key("k")
            .body("x")
            .await
            .status,
        201
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_encoding_with_content_length_cannot_smuggle() {
    let env = env("").await;
    for path in ["/v1/other", "/v1/payments"] {
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-te-{path}\r\nContent-Length: 60\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
        );
        let mut s = TcpStream::connect(env.proxy.addr).await.unwrap();
        s.write_all(req.as_bytes()).await.unwrap();
        let answer = read_until_closed(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 201"), "{path}: {answer}");
    }
    never_smuggled(&env);
    // Each request reached the upstream once, with an empty body (chunked won).
    let seen = env.upstream.seen();
    assert_eq!(seen.len(), 2);
    assert!(seen.iter().all(|s| s.body.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_content_lengths_are_400() {
    let env = env("").await;
    for path in ["/v1/other", "/v1/payments"] {
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k\r\nContent-Length: 3\r\nContent-Length: 30\r\n\r\nabcGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
        );
        let answer = raw(env.proxy.addr, req.as_bytes()).await;
        assert_eq!(raw_status(&answer), 400, "{path}: {answer}");
    }
    assert_eq!(env.upstream.hits(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_chunking_never_reaches_the_upstream_as_a_request() {
    let env = env("").await;
    let protected = raw(
        env.proxy.addr,
        b"POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-chunk\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .await;
    assert_eq!(raw_status(&protected), 400, "{protected}");
    assert_eq!(
        env.upstream.hits(),
        0,
        "a protected request with a broken body is not forwarded"
    );
    // On a pass-through route the body streams, so the upstream may see a broken
    // request, but never the smuggled one.
    let mut s = TcpStream::connect(env.proxy.addr).await.unwrap();
    s.write_all(b"POST /v1/other HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    read_until_closed(&mut s).await;
    never_smuggled(&env);
    // The key of the refused protected request is free.
    assert_eq!(
        Call::post(&env.url("/v1/payments"))
            .key("k-chunk")
            .body("x")
            .await
            .status,
        201
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_too_many_headers_are_431() {
    let env = env("max_header_bytes = \"16KiB\"").await;
    let big = format!(
        "GET /v1/other HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
        "a".repeat(32 * 1024)
    );
    assert_eq!(raw_status(&raw(env.proxy.addr, big.as_bytes()).await), 431);
    let mut many = String::from("GET /v1/other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for i in 0..150 {
        many.push_str(&format!("X-H{i}: v\r\n"));
    }
    many.push_str("\r\n");
    assert_eq!(raw_status(&raw(env.proxy.addr, many.as_bytes()).await), 431);
    assert_eq!(env.upstream.hits(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_limit_wait_for_a_free_slot() {
    let env = env("max_connections = 2").await;
    let idle1 = TcpStream::connect(env.proxy.addr).await.unwrap();
    let _idle2 = TcpStream::connect(env.proxy.addr).await.unwrap();
    let mut third = TcpStream::connect(env.proxy.addr).await.unwrap();
    third
        .write_all(b"GET /v1/other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    // Not served while both slots are held...
    let mut buf = [0u8; 64];
    let early = tokio::time::timeout(Duration::from_millis(300), third.read(&mut buf)).await;
    assert!(early.is_err(), "served beyond the connection limit");
    assert_eq!(env.upstream.hits(), 0);
    // ...and served as soon as one is freed.
    drop(idle1);
    let answer = read_until_closed(&mut third).await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
}
