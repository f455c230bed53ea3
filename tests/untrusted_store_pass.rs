//! `on_store_error = "pass"` forwards when the store is down, never when it
//! answered what no record the proxy wrote could be
//! (docs/reference/failures.md#never-pass): an endless reply, or a reply
//! beyond the reader's bounds after the store said the key is taken, is the
//! store's answer not believed (503), not a store that is down. Found by a
//! review: both were forwarded (the reader's refusal was counted as a
//! connection failure).

mod support;

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use support::*;

#[derive(Clone, Copy, Debug)]
enum Lie {
    /// `SET NX` answered with an array of 2^31 elements (endless).
    EndlessArrayForSet,
    /// `SET NX` answered `$-1` (the key is taken), then the reserve's
    /// `GETRANGE` of at most 64 KiB answered with a well-formed 300 KiB bulk.
    TakenThenOversizedHead,
}

/// The next whole command (an array of bulk strings) at the front of `buf`.
fn next_command(buf: &mut Vec<u8>) -> Option<Vec<Vec<u8>>> {
    fn line(buf: &[u8], at: usize) -> Option<(&[u8], usize)> {
        let end = buf.get(at..)?.windows(2).position(|w| w == b"\r\n")? + at;
        Some((&buf[at..end], end + 2))
    }
    let (head, mut at) = line(buf, 0)?;
    let n: usize = std::str::from_utf8(head.get(1..)?).ok()?.parse().ok()?;
    let mut args = Vec::with_capacity(n);
    for _ in 0..n {
        let (len, after) = line(buf, at)?;
        let len: usize = std::str::from_utf8(len.get(1..)?).ok()?.parse().ok()?;
        let arg = buf.get(after..after + len)?.to_vec();
        at = after + len + 2;
        if buf.len() < at {
            return None;
        }
        args.push(arg);
    }
    buf.drain(..at);
    Some(args)
}

async fn fake_redis(lie: Lie) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut rd, mut wr) = stream.into_split();
                let mut buf = Vec::new();
                let mut chunk = vec![0u8; 64 << 10];
                loop {
                    let Some(cmd) = next_command(&mut buf) else {
                        match rd.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let name = String::from_utf8_lossy(&cmd[0]).to_uppercase();
                    let answer: Vec<u8> = match (name.as_str(), lie) {
                        ("PING", _) => b"+PONG\r\n".to_vec(),
                        ("SCRIPT", _) => b"*4\r\n:1\r\n:1\r\n:1\r\n:1\r\n".to_vec(),
                        ("CONFIG", _) => b"*0\r\n".to_vec(),
                        ("SET", Lie::EndlessArrayForSet) => {
                            let _ = wr.write_all(b"*2147483648\r\n").await;
                            let elements = b":1\r\n".repeat(4 << 10);
                            while wr.write_all(&elements).await.is_ok() {}
                            return;
                        }
                        ("SET", Lie::TakenThenOversizedHead) => b"$-1\r\n".to_vec(),
                        ("GETRANGE", Lie::TakenThenOversizedHead) => {
                            let mut out = format!("${}\r\n", 300 << 10).into_bytes();
                            out.extend(std::iter::repeat_n(b'x', 300 << 10));
                            out.extend_from_slice(b"\r\n");
                            out
                        }
                        _ => b":0\r\n".to_vec(),
                    };
                    if wr.write_all(&answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

async fn never_passed(lie: Lie) {
    let fake = fake_redis(lie).await;
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .redis_url(&format!("redis://{fake}/0"))
        .store("op_timeout = \"300ms\"")
        .routes(
            "[defaults]\non_store_error = \"pass\"\n[[routes]]\nname = \"payments\"\npath = \"/v1/payments\"\n",
        )
        .build();
    let proxy = Proxy::spawn(&config, &[]).await;
    let r = Call::post(&proxy.url("/v1/payments"))
        .key("review-never-pass")
        .body("x")
        .await;
    assert_eq!(
        (r.status, upstream.hits()),
        (503, 0),
        "{lie:?}: a 503, never forwarded; got {} with {} upstream hit(s): {}",
        r.status,
        upstream.hits(),
        String::from_utf8_lossy(&r.body)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_reply_is_never_passed() {
    never_passed(Lie::EndlessArrayForSet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_said_taken_with_an_oversized_head_is_never_passed() {
    never_passed(Lie::TakenThenOversizedHead).await;
}
