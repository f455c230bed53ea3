//! The floor of one client-facing HTTP/1.1 exchange on idemproxy's stack: a
//! hyper server built as idemproxy builds its own (a header-read timer, no
//! Nagle), on one tokio worker, answering every request with a fixed body.
//! A replay is this exchange plus a Redis round trip and the record's
//! decoding, so what this costs per request bounds what a replay can cost
//! from below. `docs/dev/benchmarks-journal.md` has the figures.
//!
//!     cargo run --release --example hyper_floor -- 127.0.0.1:18700 [MODE]
//!
//! MODE says where the body comes from:
//! - `memory` (the default): a 50-byte JSON body from memory;
//! - `redis:PORT`: each request runs `reserve.lua` (the store's reserve script until
//!   it became two plain commands; kept in [`RESERVE`])
//!   against a stored 300-byte value on the Redis at 127.0.0.1:PORT, through
//!   redis-rs's `ConnectionManager` configured as idemproxy's, and answers
//!   with the value: a replay's exchange and Redis round trip, without the
//!   rest of the protected path;
//! - `raw:PORT`: the same round trip through [`Raw`], about the least a
//!   pipelined Redis client can do on one connection: queued commands
//!   written together, replies parsed in place and handed to their waiters.
//!   What redis-rs costs beyond it is what a leaner client could save.
//! - `wire:PORT`: the same round trip through idemproxy's own connection
//!   (`idemproxy::store::wire::Wire`, behind redis-rs's `ConnectionLike`,
//!   as the store uses it on plain TCP): a `Cmd` in, a `Value` out.
//! - `proxy:PORT`: each request is forwarded as it came, headers and all,
//!   to the upstream at 127.0.0.1:PORT through idemproxy's own upstream
//!   pool (`idemproxy::upstream::Pool`: HTTP/1.1 connections driven by the
//!   request's task), and the answer is streamed back as it came: hyper's
//!   cost of a proxied exchange, with none of idemproxy's per-request work
//!   (routes, forwarding headers, hop-by-hop stripping, metrics, logs).
//! - `passthrough:PORT`: a pass-through with what the contract asks of one
//!   and nothing else, through idemproxy's own functions: the request made
//!   ready for the upstream by `idemproxy::upstream::Upstream::prepare`
//!   (the upstream's URI, hop-by-hop headers stripped, `X-Forwarded-For`
//!   and `X-Forwarded-Proto` added) and sent through its pool within
//!   `upstream_timeout` (`send_with_timeout`), the answer's hop-by-hop
//!   headers stripped and its body streamed back. Not done: routes,
//!   request ids, metrics, access records, the connection's own timers
//!   (write, idle, head) and parking, the connection and request limits.
//!   hyper's header timer is off, as for `replay:PORT`.
//! - `replay:PORT`: a replay with what the contract asks of one and nothing
//!   else, through idemproxy's own functions and connection: the POST's
//!   body read whole, the key parsed from `Idempotency-Key`, the
//!   fingerprint and the record id hashed (`idemproxy::key`), a
//!   `processing` record encoded and reserved with `SET NX PX` and
//!   `GETRANGE` in one write (`store::wire`, as the store sends them), the
//!   record that holds the key decoded (`idemproxy::record`), its
//!   fingerprint compared, and its status, headers and body answered with
//!   the replay header. A key found free is answered once as a new key
//!   would be stored (untimed warm-up). Not done: routes, the memory
//!   budget, the owner claim, deadlines, metrics, request ids, access
//!   records, the connection's own timers. hyper's header timer is off for
//!   this mode, as on idemproxy's listener (which times heads itself, and
//!   this server does not): the floor is, if anything, low.

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use idemproxy::body::Body;
use idemproxy::store::wire::Wire;
use idemproxy::upstream::{Inbound, Pool};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, Notify};

const BODY: &[u8] = br#"{"id":"pay_1","status":"succeeded","amount":4200}"#;
/// The store's reserve as one script, as it was sent until the store sent it
/// as two plain commands (`SET NX PX`, `GETRANGE`): kept in `bench/` so that
/// the floor's figures stay comparable from run to run. The client side of
/// the round trip (one command, one short reply) costs about the same.
const RESERVE: &str = include_str!("../bench/reserve.lua");
const KEY: &str = "idemproxy-floor:record";
/// What `reserve.lua` is sent as the reservation it will not get to write.
const PROCESSING: &[u8] = &[b'P'; 40];

enum Source {
    Memory,
    Redis(redis::aio::ConnectionManager, redis::Script),
    Raw(Arc<Raw>, String),
    Wire(Wire, String),
    Proxy(Arc<Pool>),
    Forward(Box<idemproxy::upstream::Upstream>),
    Replay(Wire),
}

impl Source {
    async fn body(&self) -> Bytes {
        match self {
            Source::Memory => Bytes::from_static(BODY),
            Source::Proxy(_) | Source::Forward(_) | Source::Replay(_) => {
                unreachable!("answered in `answer`")
            }
            Source::Redis(conn, script) => {
                let mut conn = conn.clone();
                let (value, _ttl): (Vec<u8>, i64) = script
                    .key(KEY)
                    .arg(PROCESSING)
                    .arg(30_000)
                    .arg(65_536)
                    .invoke_async(&mut conn)
                    .await
                    .expect("reserve.lua through redis-rs");
                Bytes::from(value)
            }
            Source::Raw(raw, sha) => {
                let mut cmd = Vec::with_capacity(128);
                pack(
                    &mut cmd,
                    &[
                        b"EVALSHA",
                        sha.as_bytes(),
                        b"1",
                        KEY.as_bytes(),
                        PROCESSING,
                        b"30000",
                        b"65536",
                    ],
                );
                let reply = raw.call(&cmd).await.expect("reserve.lua through Raw");
                first_bulk(&reply).expect("a {value, ttl} reply")
            }
            Source::Wire(wire, sha) => {
                let mut cmd = redis::Cmd::with_capacity(7, 160);
                // As the store builds it (`send_script` in crates/store/src/redis_conn.rs).
                cmd.arg("EVALSHA").arg(sha.as_str()).arg(1).arg(KEY);
                cmd.arg(PROCESSING).arg(30_000).arg(65_536);
                let (value, _ttl): (Vec<u8>, i64) = cmd
                    .query_async(&mut wire.clone())
                    .await
                    .expect("reserve.lua through Wire");
                Bytes::from(value)
            }
        }
    }
}

async fn answer(
    source: Arc<Source>,
    req: Request<Incoming>,
    peer: std::net::SocketAddr,
) -> Result<Response<Body>, String> {
    if let Source::Forward(upstream) = &*source {
        let caller = idemproxy::conn::Caller {
            addr: peer,
            scheme: "http",
        };
        let (parts, body) = req.into_parts();
        let req = upstream
            .prepare(parts, Body::Stream(Inbound::from(body)), caller)
            .map_err(|e| e.to_string())?;
        let resp = upstream
            .send_with_timeout(req)
            .await
            .map_err(|e| e.to_string())?;
        return Ok(resp.map(Body::Stream));
    }
    if let Source::Proxy(pool) = &*source {
        let req = req.map(|b| Body::Stream(Inbound::from(b)));
        let resp = pool.send(req).await.map_err(|e| e.to_string())?;
        return Ok(resp.map(Body::Stream));
    }
    if let Source::Replay(wire) = &*source {
        return replay(wire, req).await;
    }
    let mut resp = Response::new(Body::full(source.body().await));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

/// `replay:PORT` (see the module's doc): a replay's required work and no more.
async fn replay(wire: &Wire, req: Request<Incoming>) -> Result<Response<Body>, String> {
    use http::header::{HeaderValue, AUTHORIZATION};
    use http_body_util::BodyExt;
    use idemproxy::key;
    use idemproxy::policy::FingerprintBody;
    use idemproxy::record::{now_ms, Finished, Processing, Record, Token};
    // The store's own packing (this file's `pack` is the minimal client's).
    use idemproxy::store::wire::pack as wire_pack;
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    let raw = parts.headers.get("idempotency-key").ok_or("no key")?;
    let key = key::parse_key(raw.as_bytes(), 255).map_err(|e| format!("{e:?}"))?;
    let fingerprint = key::fingerprint(
        &parts.method,
        parts.uri.path(),
        parts.uri.query(),
        &parts.headers,
        &[],
        &body,
        FingerprintBody::Raw,
    );
    let digest = key::request_record_digest(&parts.headers, &[AUTHORIZATION], &key);
    let mut store_key = String::with_capacity(16 + 64);
    store_key.push_str("idemproxy-floor:");
    key::push_hex(&mut store_key, &digest);
    let token = Token::new();
    let processing = Record::Processing(Processing {
        token,
        fingerprint,
        created_ms: now_ms(),
        route: "payments".into(),
        trace: None,
        afterlife: None,
    })
    .encode();
    let k = store_key.as_bytes();
    let mut got = wire
        .commands(
            |out| {
                wire_pack(out, &[b"SET", k, &processing, b"NX", b"PX", b"30000"]);
                wire_pack(out, &[b"GETRANGE", k, b"0", b"65535"]);
            },
            2,
        )
        .await
        .map_err(|e| e.to_string())?;
    let head = match got.pop() {
        Some(redis::Value::BulkString(head)) => head,
        other => return Err(format!("GETRANGE answered {other:?}")),
    };
    let finished = match Record::decode(Bytes::from(head)).map_err(|e| e.to_string())? {
        Record::Finished(f) if f.fingerprint == fingerprint => f,
        Record::Finished(_) => return Err("another request under this key".into()),
        // Ours (the key was free): stored as a new key's answer would be.
        Record::Processing(_) => {
            let finished = Record::Finished(Finished {
                token,
                fingerprint,
                created_ms: now_ms(),
                route: "payments".into(),
                trace: None,
                completed_ms: now_ms(),
                status: 200,
                reason: None,
                body_stored: true,
                headers: vec![(
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                )],
                body: Bytes::from_static(BODY),
                trailers: Vec::new(),
            })
            .encode();
            let set: [&[u8]; 3] = [b"SET", k, &finished];
            wire.commands(|out| wire_pack(out, &set), 1)
                .await
                .map_err(|e| e.to_string())?;
            return Ok(Response::new(Body::full(Bytes::from_static(BODY))));
        }
    };
    // As `proxy::verdict::replay` builds the answer.
    let mut resp = Response::new(Body::full(finished.body));
    *resp.status_mut() = http::StatusCode::from_u16(finished.status).map_err(|e| e.to_string())?;
    let headers = resp.headers_mut();
    headers.reserve(finished.headers.len() + 1);
    for (name, value) in finished.headers {
        headers.append(name, value);
    }
    headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    Ok(resp)
}

/// One pipelined connection to Redis. A caller queues its command and its
/// waiter under one lock (so replies come back in the waiters' order); the
/// writer task writes the queue, the reader task parses replies and hands
/// each to the oldest waiter. No `Cmd`, no `Value`, no channel to a driver.
struct Raw {
    stream: TcpStream,
    state: Mutex<State>,
    queued: Notify,
}

#[derive(Default)]
struct State {
    waiting: VecDeque<oneshot::Sender<Bytes>>,
    unwritten: Vec<u8>,
}

impl Raw {
    async fn connect(port: u16) -> io::Result<Arc<Raw>> {
        let stream = TcpStream::connect(("127.0.0.1", port)).await?;
        stream.set_nodelay(true)?;
        let raw = Arc::new(Raw {
            stream,
            state: Mutex::new(State::default()),
            queued: Notify::new(),
        });
        tokio::spawn(raw.clone().read_replies());
        tokio::spawn(raw.clone().write_queued());
        Ok(raw)
    }

    async fn call(&self, cmd: &[u8]) -> Option<Bytes> {
        let (tx, rx) = oneshot::channel();
        {
            let mut state = self.state.lock().unwrap();
            state.waiting.push_back(tx);
            if state.unwritten.is_empty() {
                self.queued.notify_one();
            }
            state.unwritten.extend_from_slice(cmd);
        }
        rx.await.ok()
    }

    /// Writes what the callers queued. It lets the other ready tasks run
    /// first, so that one write carries the commands of many requests.
    async fn write_queued(self: Arc<Self>) {
        let mut out = Vec::new();
        loop {
            self.queued.notified().await;
            tokio::task::yield_now().await;
            std::mem::swap(&mut out, &mut self.state.lock().unwrap().unwritten);
            let mut written = 0;
            while written < out.len() {
                if self.stream.writable().await.is_err() {
                    return;
                }
                match self.stream.try_write(&out[written..]) {
                    Ok(n) => written += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(_) => return,
                }
            }
            out.clear();
        }
    }

    async fn read_replies(self: Arc<Self>) {
        let mut buf = BytesMut::with_capacity(64 * 1024);
        loop {
            if self.stream.readable().await.is_err() {
                return;
            }
            buf.reserve(16 * 1024);
            match self.stream.try_read_buf(&mut buf) {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(_) => return,
            }
            while let Some(len) = reply_len(&buf, 0) {
                let reply = buf.split_to(len).freeze();
                let waiter = self.state.lock().unwrap().waiting.pop_front();
                if let Some(waiter) = waiter {
                    let _ = waiter.send(reply);
                }
            }
        }
    }
}

/// A command in RESP: an array of bulk strings.
fn pack(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

/// The length of the complete RESP2 reply at `at`, if it has all arrived.
fn reply_len(buf: &[u8], at: usize) -> Option<usize> {
    let line_end = at + buf.get(at..)?.windows(2).position(|w| w == b"\r\n")?;
    let line = std::str::from_utf8(&buf[at + 1..line_end]).ok()?;
    let after = line_end + 2;
    match buf[at] {
        b'+' | b'-' | b':' => Some(after - at),
        b'$' => {
            let n: i64 = line.parse().ok()?;
            if n < 0 {
                return Some(after - at);
            }
            let end = after + n as usize + 2;
            (buf.len() >= end).then_some(end - at)
        }
        b'*' => {
            let n: i64 = line.parse().ok()?;
            let mut pos = after;
            for _ in 0..n.max(0) {
                pos += reply_len(buf, pos)?;
            }
            Some(pos - at)
        }
        _ => None,
    }
}

/// The first element of an array reply, when it is a bulk string.
fn first_bulk(reply: &Bytes) -> Option<Bytes> {
    let head = reply.iter().position(|&b| b == b'\n')? + 1;
    let line_end = head + reply[head..].iter().position(|&b| b == b'\r')?;
    let n: usize = std::str::from_utf8(&reply[head + 1..line_end])
        .ok()?
        .parse()
        .ok()?;
    Some(reply.slice(line_end + 2..line_end + 2 + n))
}

/// Stores the record every request reads.
async fn store_record(conn: &mut impl redis::aio::ConnectionLike, record: &[u8]) {
    let () = redis::cmd("SET")
        .arg(KEY)
        .arg(record)
        .query_async(conn)
        .await
        .expect("SET the record");
}

async fn source(mode: &str) -> Source {
    let port = |m: &str| -> u16 { m.parse().expect("MODE: memory or KIND:PORT") };
    let script = redis::Script::new(RESERVE);
    let record = vec![b'F'; 300];
    match mode.split_once(':') {
        None if mode == "memory" => Source::Memory,
        Some(("redis", p)) => {
            let client =
                redis::Client::open(format!("redis://127.0.0.1:{}/0", port(p))).expect("redis URL");
            let config = redis::aio::ConnectionManagerConfig::new()
                .set_response_timeout(None)
                .set_max_delay(Duration::from_secs(1));
            let mut conn = redis::aio::ConnectionManager::new_with_config(client, config)
                .await
                .expect("connect to redis");
            store_record(&mut conn, &record).await;
            Source::Redis(conn, script)
        }
        Some(("raw", p)) => {
            let raw = Raw::connect(port(p)).await.expect("connect to redis");
            let mut cmd = Vec::new();
            pack(&mut cmd, &[b"SCRIPT", b"LOAD", RESERVE.as_bytes()]);
            raw.call(&cmd).await.expect("SCRIPT LOAD");
            cmd.clear();
            pack(&mut cmd, &[b"SET", KEY.as_bytes(), &record]);
            raw.call(&cmd).await.expect("SET the record");
            Source::Raw(raw, script.get_hash().to_string())
        }
        Some(("wire", p)) => {
            let info = redis::IntoConnectionInfo::into_connection_info(format!(
                "redis://127.0.0.1:{}/0",
                port(p)
            ))
            .expect("redis URL");
            let mut wire = Wire::connect(&info)
                .await
                .expect("connect to redis")
                .expect("a plain TCP address");
            store_record(&mut wire, &record).await;
            script.load_async(&mut wire).await.expect("SCRIPT LOAD");
            Source::Wire(wire, script.get_hash().to_string())
        }
        Some(("replay", p)) => {
            let info = redis::IntoConnectionInfo::into_connection_info(format!(
                "redis://127.0.0.1:{}/0",
                port(p)
            ))
            .expect("redis URL");
            let wire = Wire::connect(&info)
                .await
                .expect("connect to redis")
                .expect("a plain TCP address");
            Source::Replay(wire)
        }
        Some(("proxy", p)) => {
            let authority: http::uri::Authority =
                format!("127.0.0.1:{}", port(p)).parse().expect("authority");
            let pool = Pool::new(&authority, Duration::from_secs(5), Duration::from_secs(60));
            Source::Proxy(pool)
        }
        Some(("passthrough", p)) => {
            // The upstream as idemproxy's defaults configure it (`upstream_timeout` 30 s).
            let text = format!("[server]\nupstream = \"http://127.0.0.1:{}\"\n", port(p));
            let config = idemproxy::config::Config::from_toml(&text, "floor", &Default::default())
                .expect("a valid configuration");
            Source::Forward(Box::new(idemproxy::upstream::Upstream::new(&config.server, 1)))
        }
        _ => panic!("MODE: memory, redis:PORT, raw:PORT, wire:PORT, proxy:PORT, passthrough:PORT or replay:PORT"),
    }
}

fn main() -> io::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:18700".into());
    let mode = args.next().unwrap_or_else(|| "memory".into());
    // One worker (a multi-thread runtime with one thread), as the figures in
    // docs/dev/benchmarks-journal.md were measured; idemproxy's workers now run
    // current-thread runtimes, 3 % fewer instructions: FLOOR_RUNTIME=current
    // measures the floors that way.
    let runtime = match std::env::var("FLOOR_RUNTIME").as_deref() {
        Ok("current") => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        _ => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?,
    };
    runtime.block_on(async move {
        let source = Arc::new(source(&mode).await);
        let listener = TcpListener::bind(&addr).await?;
        eprintln!("hyper_floor listening on {addr} ({mode})");
        loop {
            let (stream, peer) = listener.accept().await?;
            let _ = stream.set_nodelay(true);
            let source = source.clone();
            tokio::spawn(async move {
                let mut builder = http1::Builder::new();
                builder.timer(TokioTimer::new());
                if matches!(*source, Source::Replay(_) | Source::Forward(_)) {
                    builder.header_read_timeout(None);
                } else {
                    builder.header_read_timeout(Duration::from_secs(10));
                }
                let _ = builder
                    .serve_connection(
                        TokioIo::new(stream),
                        service_fn(move |req| answer(source.clone(), req, peer)),
                    )
                    .await;
            });
        }
    })
}
