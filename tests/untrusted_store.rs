//! A store that lies (§8, the store's bytes are untrusted): a fake Redis
//! answers the proxy's connect like Redis, then with replies no Redis sends
//! — a bulk length of 2^62, an endless array, a reply trickled for ever, a
//! valid reply far larger than any record, a record length of 2^62. The
//! proxy answers 503 within `op_timeout`, stays up with its memory bounded,
//! and works again once a real Redis is behind the address.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use support::*;

const OP_TIMEOUT: Duration = Duration::from_millis(300);
/// Room for the request around the store operation, on a loaded machine.
const MARGIN: Duration = Duration::from_millis(1500);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lie {
    /// `$4611686018427387904` (2^62): a bulk string of 4 EiB, then silence.
    HugeBulk,
    /// `*2147483648` (2^31), then `:1` elements as fast as they are taken.
    EndlessArray,
    /// A bulk reply one byte every 10 ms, for ever.
    Trickle,
    /// A well-formed bulk reply of 15 MiB to a `GETRANGE` of 64 KiB.
    Oversized,
    /// Well-formed answers: the key is taken by a 1 MiB record, and then,
    /// when the proxy fetches it, the record is 2^62 bytes long (`STRLEN`).
    Length,
    /// Well-formed answers: the key is taken by a record of 2^62 bytes.
    TakenByHugeRecord,
    /// Well-formed answers: the key is taken by a large record, and the
    /// connection drops at the `STRLEN` that would tell its length (a
    /// failover between the two round trips).
    DroppedAtLength,
    /// Well-formed answers: the key is taken by a large record that is gone
    /// (`PTTL` -2) whenever it is fetched, for ever.
    GoneWhenRead,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Lie(Lie),
    /// Relay to the real Redis (lying connections are closed, as a restart would).
    Real,
}

/// A TCP listener that speaks enough Redis to be connected to.
struct FakeRedis {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeRedis {
    async fn start(lie: Lie, real: SocketAddr) -> FakeRedis {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, _) = watch::channel(Mode::Lie(lie));
        let modes = mode.clone();
        let strlen_calls = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let rx = modes.subscribe();
                let calls = strlen_calls.clone();
                tokio::spawn(async move {
                    let mode = *rx.borrow();
                    match mode {
                        Mode::Real => relay(stream, real).await,
                        Mode::Lie(lie) => {
                            let mut rx = rx;
                            tokio::select! {
                                _ = lie_to(stream, lie, calls) => {}
                                _ = rx.changed() => {}
                            }
                        }
                    }
                });
            }
        });
        FakeRedis { addr, mode, task }
    }

    fn url(&self) -> String {
        format!("redis://{}/0", self.addr)
    }
}

impl Drop for FakeRedis {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(mut near: TcpStream, real: SocketAddr) {
    if let Ok(mut far) = TcpStream::connect(real).await {
        let _ = tokio::io::copy_bidirectional(&mut near, &mut far).await;
    }
}

/// The next whole command (an array of bulk strings) at the front of `buf`.
fn next_command(buf: &mut Vec<u8>) -> Option<Vec<Vec<u8>>> {
    fn line(buf: &[u8], at: usize) -> Option<(&[u8], usize)> {
        let end = at + buf.get(at..)?.windows(2).position(|w| w == b"\r\n")?;
        Some((&buf[at..end], end + 2))
    }
    let (head, mut at) = line(buf, 0)?;
    let n: usize = std::str::from_utf8(head.strip_prefix(b"*")?)
        .ok()?
        .parse()
        .ok()?;
    let mut args = Vec::new();
    for _ in 0..n {
        let (len, after) = line(buf, at)?;
        let len: usize = std::str::from_utf8(len.strip_prefix(b"$")?)
            .ok()?
            .parse()
            .ok()?;
        args.push(buf.get(after..after + len)?.to_vec());
        at = after + len + 2;
    }
    if buf.len() < at {
        return None;
    }
    buf.drain(..at);
    Some(args)
}

/// The finished record of the tests' request (`POST /v1/payments`, body
/// `x`) with a 1 MiB answer, as the proxy writes it: the head a reserve
/// reads from it asks for a replay, so the proxy goes on to fetch the record.
static RECORD: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    use idemproxy::record::{Finished, Record, Token};
    let fingerprint = idemproxy::key::fingerprint(
        &http::Method::POST,
        "/v1/payments",
        None,
        &http::HeaderMap::new(),
        &[],
        b"x",
        idemproxy::policy::FingerprintBody::Raw,
    );
    let f = Finished {
        token: Token::new(),
        fingerprint,
        created_ms: 1,
        route: "payments".into(),
        trace: None,
        completed_ms: 2,
        status: 201,
        reason: None,
        body_stored: true,
        headers: Vec::new(),
        body: vec![b'x'; 1 << 20].into(),
        trailers: Vec::new(),
    };
    Record::Finished(f).encode().to_vec()
});

/// `GETRANGE key from to` of [`RECORD`], as a bulk reply.
fn record_range(from: usize, to: usize) -> Vec<u8> {
    let piece = RECORD
        .get(from..=to.min(RECORD.len() - 1))
        .unwrap_or_default();
    let mut out = format!("${}\r\n", piece.len()).into_bytes();
    out.extend_from_slice(piece);
    out.extend_from_slice(b"\r\n");
    out
}

fn bulk(n: usize) -> Vec<u8> {
    let mut out = format!("${n}\r\n").into_bytes();
    out.resize(out.len() + n, b'x');
    out.extend_from_slice(b"\r\n");
    out
}

/// Answers `PING` as Redis does, the rest with `lie`.
async fn lie_to(stream: TcpStream, lie: Lie, strlen_calls: Arc<AtomicUsize>) {
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
            (
                _,
                Lie::Length | Lie::TakenByHugeRecord | Lie::DroppedAtLength | Lie::GoneWhenRead,
            ) => {
                match name.as_str() {
                    "SET" => b"$-1\r\n".to_vec(),
                    "GETRANGE" => {
                        let arg = |i: usize| -> usize {
                            String::from_utf8_lossy(&cmd[i]).parse().unwrap_or(0)
                        };
                        record_range(arg(2), arg(3))
                    }
                    // The reserve's length first, then the fetch's.
                    "STRLEN"
                        if lie == Lie::Length
                            && strlen_calls.fetch_add(1, Ordering::Relaxed) % 2 == 0 =>
                    {
                        b":1048576\r\n".to_vec()
                    }
                    "STRLEN" if lie == Lie::DroppedAtLength => {
                        // Read on, answer nothing more.
                        let mut sink = vec![0u8; 64 << 10];
                        while matches!(rd.read(&mut sink).await, Ok(n) if n > 0) {}
                        return;
                    }
                    "STRLEN" if lie == Lie::GoneWhenRead => b":1048576\r\n".to_vec(),
                    "STRLEN" => b":4611686018427387904\r\n".to_vec(),
                    "PTTL" if lie == Lie::GoneWhenRead => b":-2\r\n".to_vec(),
                    "PTTL" => b":10000\r\n".to_vec(),
                    "SCRIPT" => b"*5\r\n:1\r\n:1\r\n:1\r\n:1\r\n:1\r\n".to_vec(),
                    "CONFIG" => b"*0\r\n".to_vec(),
                    _ => b":0\r\n".to_vec(),
                }
            }
            (_, other) => {
                // The rest of what the proxy sends is read and dropped.
                tokio::spawn(async move {
                    let mut sink = vec![0u8; 64 << 10];
                    while matches!(rd.read(&mut sink).await, Ok(n) if n > 0) {}
                });
                return spout(&mut wr, other).await;
            }
        };
        if wr.write_all(&answer).await.is_err() {
            return;
        }
    }
}

/// Sends the lie until the proxy hangs up.
async fn spout(wr: &mut tokio::net::tcp::OwnedWriteHalf, lie: Lie) {
    match lie {
        Lie::HugeBulk => {
            let _ = wr.write_all(b"$4611686018427387904\r\n").await;
            std::future::pending::<()>().await;
        }
        Lie::EndlessArray => {
            if wr.write_all(b"*2147483648\r\n").await.is_err() {
                return;
            }
            let elements = b":1\r\n".repeat(16 << 10);
            while wr.write_all(&elements).await.is_ok() {}
        }
        Lie::Trickle => {
            if wr.write_all(b"$200000\r\n").await.is_err() {
                return;
            }
            while wr.write_all(b"x").await.is_ok() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        Lie::Oversized => {
            let _ = wr.write_all(&bulk(15 << 20)).await;
            std::future::pending::<()>().await;
        }
        Lie::Length | Lie::TakenByHugeRecord | Lie::DroppedAtLength | Lie::GoneWhenRead => {
            unreachable!("answered command by command")
        }
    }
}

/// The resident memory of process `pid` in bytes; `None` once it is gone.
fn vm_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

async fn survives(lie: Lie) {
    let real = RedisServer::start().await;
    let fake = FakeRedis::start(lie, format!("127.0.0.1:{}", real.port).parse().unwrap()).await;
    let upstream = TestUpstream::start().await;
    let mut config = ConfigBuilder::new(&upstream.url())
        .redis_url(&fake.url())
        .store(&format!("op_timeout = \"{}ms\"", OP_TIMEOUT.as_millis()));
    if matches!(
        lie,
        Lie::Length | Lie::TakenByHugeRecord | Lie::DroppedAtLength | Lie::GoneWhenRead
    ) {
        // The key is taken, the store says: whatever it says of the record,
        // the request is not forwarded, even where a store that is down lets
        // requests through unprotected.
        config = config.routes(
            "[defaults]\non_store_error = \"pass\"\n[[routes]]\nname = \"payments\"\npath = \"/v1/payments\"\n",
        );
    }
    let config = config.build();
    // The binary: the resident memory of its process is measured.
    let proxy = Proxy::spawn(&config, &[]).await;
    let rss_at_start = vm_rss(proxy.pid()).expect("the proxy runs");

    // A dropped connection is a store down for the next operation on it
    // (which `on_store_error = "pass"` may pass): only the first request
    // meets the drop after the store said the key was taken.
    let rounds = if lie == Lie::DroppedAtLength { 1 } else { 4 };
    for i in 0..rounds {
        let started = Instant::now();
        let r = Call::post(&proxy.url("/v1/payments"))
            .key(&format!("lied-to-{i}"))
            .body("x")
            .await;
        let took = started.elapsed();
        assert_eq!(
            (r.status, r.json()["type"].as_str()),
            (503, Some("store-unavailable")),
            "{lie:?}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert!(
            took < OP_TIMEOUT + MARGIN,
            "{lie:?}: answered after {took:?}"
        );
        let rss = vm_rss(proxy.pid()).unwrap_or_else(|| panic!("{lie:?}: the proxy died"));
        assert!(
            rss < rss_at_start + (16 << 20),
            "{lie:?}: resident memory grew from {} to {} MiB",
            rss_at_start >> 20,
            rss >> 20
        );
    }
    assert_eq!(upstream.hits(), 0, "{lie:?}: nothing was forwarded");

    // A real Redis behind the address: the proxy connects anew and works.
    fake.mode.send_replace(Mode::Real);
    let url = proxy.url("/v1/payments");
    let first = eventually("the proxy to work with a real Redis", DEADLINE, || {
        let url = url.clone();
        async move {
            let r = Call::post(&url).key("after").body("x").await;
            (r.status == 201).then_some(r)
        }
    })
    .await;
    assert!(!first.is_replay());
    // Another worker's connection may still be the one the liar held: its
    // next operation fails once (503), as after any store restart, and the
    // worker connects anew.
    eventually("the retry to be replayed", DEADLINE, || {
        let url = url.clone();
        async move {
            let r = Call::post(&url).key("after").body("x").await;
            r.is_replay().then_some(())
        }
    })
    .await;
    assert_eq!(upstream.hits(), 1, "{lie:?}: executed once");
    proxy.wait_ready().await;
    assert!(vm_rss(proxy.pid()).is_some(), "{lie:?}: the proxy died");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_length_of_2_pow_62() {
    survives(Lie::HugeBulk).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_array() {
    survives(Lie::EndlessArray).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_trickled_for_ever() {
    survives(Lie::Trickle).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_reply_larger_than_any_record() {
    survives(Lie::Oversized).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_length_of_2_pow_62() {
    survives(Lie::Length).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_taken_by_a_record_of_2_pow_62_bytes() {
    survives(Lie::TakenByHugeRecord).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_key_whose_length_never_comes_is_not_passed() {
    survives(Lie::DroppedAtLength).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_key_whose_record_is_gone_whenever_it_is_read() {
    survives(Lie::GoneWhenRead).await;
}

// `on_store_error = "pass"` forwards when the store is down, never when it
// answered what no record the proxy wrote could be
// (docs/reference/failures.md#never-pass): an endless reply, or a reply
// beyond the reader's bounds after the store said the key is taken, is the
// store's answer not believed (503), not a store that is down. Found by a
// review: both were forwarded (the reader's refusal was counted as a
// connection failure).

#[derive(Clone, Copy, Debug)]
enum PassLie {
    /// `SET NX` answered with an array of 2^31 elements (endless).
    EndlessArrayForSet,
    /// `SET NX` answered `$-1` (the key is taken), then the reserve's
    /// `GETRANGE` of at most 64 KiB answered with a well-formed 300 KiB bulk.
    TakenThenOversizedHead,
}

async fn passing_fake_redis(lie: PassLie) -> SocketAddr {
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
                        ("SET", PassLie::EndlessArrayForSet) => {
                            let _ = wr.write_all(b"*2147483648\r\n").await;
                            let elements = b":1\r\n".repeat(4 << 10);
                            while wr.write_all(&elements).await.is_ok() {}
                            return;
                        }
                        ("SET", PassLie::TakenThenOversizedHead) => b"$-1\r\n".to_vec(),
                        ("GETRANGE", PassLie::TakenThenOversizedHead) => {
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

async fn never_passed(lie: PassLie) {
    let fake = passing_fake_redis(lie).await;
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .redis_url(&format!("redis://{fake}/0"))
        .store("op_timeout = \"300ms\"")
        .routes(
            "[defaults]\non_store_error = \"pass\"\n[[routes]]\nname = \"payments\"\npath = \"/v1/payments\"\n",
        )
        .build();
    let proxy = Proxy::spawn_in_process(&config, &[]).await;
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
    never_passed(PassLie::EndlessArrayForSet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_said_taken_with_an_oversized_head_is_never_passed() {
    never_passed(PassLie::TakenThenOversizedHead).await;
}
