//! A pipelined Redis connection of idemproxy's own, for plain TCP (standalone
//! and Sentinel masters): the hot path's round trips without redis-rs's
//! driver task and channel.
//!
//! redis-rs's multiplexed connection sends every command through a channel to
//! a driver task that owns the socket and answers through a oneshot; measured
//! (`bench/floor.py`), that costs a replay 2–5 µs more per round trip than a
//! connection where the caller queues its bytes itself. Here a caller packs
//! its command straight into the output buffer and queues its waiter under one
//! lock (so replies come back in the waiters' order); one task writes what is
//! queued, another parses replies in place and hands each to the oldest
//! waiter. It speaks RESP2 and implements redis-rs's `ConnectionLike`, so the
//! store's code (commands, scripts, pipelines) is the same on every connection.
//!
//! The store's bytes are not trusted: a reply is checked as its bytes arrive
//! and built only once it is whole (`reply`, the parser).
//!
//! What it does not do, redis-rs's `ConnectionManager` still does: TLS, Unix
//! sockets and RESP3 connect through it (see `RedisStore`). A broken
//! connection stays broken: every call on it fails at once, and the store
//! makes a new one (asking the sentinels again) for the next operation.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Buf, BytesMut};
use redis::aio::ConnectionLike;
use redis::{
    Cmd, ConnectionAddr, ConnectionInfo, Pipeline, ProtocolVersion, RedisFuture, RedisResult, Value,
};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, Notify};
use tokio::task::AbortHandle;

use super::reply::{value, Scan};

/// Bytes queued for a store that does not read them: beyond this, calls fail
/// at once (the store is down) instead of queueing more.
const MAX_UNWRITTEN: usize = 64 << 20;
/// Buffers grown by a large record are given back once idle above this size.
const KEEP: usize = 64 << 10;
/// Bytes read at a time.
const READ: usize = 16 << 10;

/// One pipelined connection; clones share it. It closes when the last clone goes.
#[derive(Clone)]
pub struct Wire {
    handle: Arc<Handle>,
    db: i64,
}

/// Owned by the clones: dropping the last one stops the two tasks, which
/// closes the socket (a connection the store gave up must not linger).
struct Handle {
    shared: Arc<Shared>,
    tasks: [AbortHandle; 2],
}

impl Drop for Handle {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        self.shared
            .fail(io::ErrorKind::ConnectionAborted, "connection closed");
    }
}

struct Shared {
    stream: TcpStream,
    state: Mutex<State>,
    /// Set once, when the connection failed; read without the lock.
    broken: AtomicBool,
    /// Wakes the writer when the first bytes are queued.
    queued: Notify,
}

#[derive(Default)]
struct State {
    waiting: VecDeque<Waiter>,
    unwritten: Vec<u8>,
    /// Why the connection failed: every call fails with it from then on.
    failure: Option<(io::ErrorKind, &'static str)>,
}

/// A caller waiting for `left` more replies; `got` holds those that came.
struct Waiter {
    left: usize,
    got: Vec<Value>,
    tx: oneshot::Sender<Vec<Value>>,
}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks the connection failed and drops every waiter (each gets an error).
    fn fail(&self, kind: io::ErrorKind, why: &'static str) {
        self.broken.store(true, Ordering::Release);
        let waiting = {
            let mut state = self.state();
            state.failure.get_or_insert((kind, why));
            state.unwritten = Vec::new();
            std::mem::take(&mut state.waiting)
        };
        drop(waiting);
    }

    /// Hands one reply to the oldest waiter. `false`: nobody asked for it.
    fn deliver(&self, value: Value) -> bool {
        let mut state = self.state();
        let Some(waiter) = state.waiting.front_mut() else {
            return false;
        };
        waiter.got.push(value);
        waiter.left -= 1;
        if waiter.left == 0 {
            if let Some(done) = state.waiting.pop_front() {
                drop(state);
                // A caller that stopped waiting (its timeout) lets the reply go.
                let _ = done.tx.send(done.got);
            }
        }
        true
    }
}

impl Wire {
    /// Connects to `info` when it is a plain TCP address spoken in RESP2,
    /// authenticates and selects its database. `Ok(None)`: an address this
    /// connection does not handle (TLS, a Unix socket, RESP3).
    pub async fn connect(info: &ConnectionInfo) -> RedisResult<Option<Wire>> {
        let ConnectionAddr::Tcp(host, port) = info.addr() else {
            return Ok(None);
        };
        let settings = info.redis_settings();
        if settings.protocol() != ProtocolVersion::RESP2 {
            return Ok(None);
        }
        let stream = TcpStream::connect((host.as_str(), *port)).await?;
        stream.set_nodelay(true)?;
        let mut wire = Wire::start(stream, settings.db());
        if let Some(password) = settings.password() {
            let mut auth = redis::cmd("AUTH");
            if let Some(user) = settings.username() {
                auth.arg(user);
            }
            auth.arg(password).query_async::<()>(&mut wire).await?;
        }
        if settings.db() != 0 {
            redis::cmd("SELECT")
                .arg(settings.db())
                .query_async::<()>(&mut wire)
                .await?;
        } else if settings.password().is_none() {
            // Nothing above asked Redis anything: a connection is kept only
            // once it has answered (something that accepts and then never
            // answers, as a proxy in front of a lost Redis can, fails the
            // connect within `op_timeout` rather than the operations after it).
            redis::cmd("PING").query_async::<()>(&mut wire).await?;
        }
        Ok(Some(wire))
    }

    fn start(stream: TcpStream, db: i64) -> Wire {
        let shared = Arc::new(Shared {
            stream,
            state: Mutex::new(State::default()),
            broken: AtomicBool::new(false),
            queued: Notify::new(),
        });
        let reader = tokio::spawn(read_replies(shared.clone())).abort_handle();
        let writer = tokio::spawn(write_queued(shared.clone())).abort_handle();
        Wire {
            handle: Arc::new(Handle {
                shared,
                tasks: [reader, writer],
            }),
            db,
        }
    }

    /// The connection failed (or was closed): calls on it fail at once.
    pub(crate) fn is_broken(&self) -> bool {
        self.handle.shared.broken.load(Ordering::Acquire)
    }

    /// Why the connection failed, once it has.
    pub(crate) fn failure(&self) -> &'static str {
        self.handle
            .shared
            .state()
            .failure
            .map_or("", |(_, why)| why)
    }

    /// Queues what `write` packs and waits for `replies` replies to it.
    async fn call(
        &self,
        write: impl FnOnce(&mut Vec<u8>),
        replies: usize,
    ) -> RedisResult<Vec<Value>> {
        let shared = &self.handle.shared;
        if replies == 0 {
            return Ok(Vec::new());
        }
        let rx = {
            let mut state = shared.state();
            if let Some((kind, why)) = state.failure {
                return Err(failed(kind, why));
            }
            if state.unwritten.len() > MAX_UNWRITTEN {
                return Err(io::Error::new(
                    io::ErrorKind::WouldBlock,
                    "the store is not reading what was sent (64 MiB queued)",
                )
                .into());
            }
            let (tx, rx) = oneshot::channel();
            state.waiting.push_back(Waiter {
                left: replies,
                got: Vec::with_capacity(replies),
                tx,
            });
            if state.unwritten.is_empty() {
                shared.queued.notify_one();
            }
            write(&mut state.unwritten);
            rx
        };
        rx.await.map_err(|_| {
            let (kind, why) = shared
                .state()
                .failure
                .unwrap_or((io::ErrorKind::ConnectionAborted, "connection closed"));
            failed(kind, why)
        })
    }

    /// Sends the `count` commands `write` packs ([`pack`]) in one write:
    /// their replies in order; a server error among them is the `Err`.
    /// For the hot path: no `Cmd` or `Pipeline` to build.
    pub async fn commands(
        &self,
        write: impl FnOnce(&mut Vec<u8>),
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let got = self.call(write, count).await?;
        match first_error(&got) {
            Some(e) => Err(e),
            None => Ok(got),
        }
    }
}

/// Packs one command, its arguments as given, in RESP (an array of bulk
/// strings), as `Cmd::write_packed_command` does.
pub fn pack(out: &mut Vec<u8>, args: &[&[u8]]) {
    let room: usize = args.iter().map(|a| a.len() + 16).sum();
    out.reserve(room + 16);
    out.push(b'*');
    decimal(out, args.len() as u64);
    for arg in args {
        out.push(b'$');
        decimal(out, arg.len() as u64);
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

/// `n` in decimal, then CRLF.
fn decimal(out: &mut Vec<u8>, n: u64) {
    let mut buf = [0u8; 20];
    out.extend_from_slice(digits(n, &mut buf));
    out.extend_from_slice(b"\r\n");
}

/// `n`'s decimal digits, written into `buf`: an argument for [`pack`].
pub fn digits(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

impl ConnectionLike for Wire {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let mut got = self.call(|out| cmd.write_packed_command(out), 1).await?;
            got.pop().ok_or_else(|| lost().into())
        })
    }

    /// The pipeline's `offset + count` replies; the first `offset` are
    /// skipped (a transaction's `QUEUED`s), unless one is an error.
    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let mut got = if pipeline.is_transaction() {
                let packed = pipeline.get_packed_pipeline();
                self.call(|out| out.extend_from_slice(&packed), offset + count)
                    .await?
            } else {
                // Each command packed straight into the output: no vector
                // of the whole pipeline first.
                let write = |out: &mut Vec<u8>| {
                    for cmd in pipeline.cmd_iter() {
                        cmd.write_packed_command(out);
                    }
                };
                self.call(write, offset + count).await?
            };
            if let Some(e) = first_error(&got[..offset]) {
                return Err(e);
            }
            Ok(got.split_off(offset))
        })
    }

    fn get_db(&self) -> i64 {
        self.db
    }
}

/// The first server error among `replies`, as an error.
fn first_error(replies: &[Value]) -> Option<redis::RedisError> {
    let e = replies
        .iter()
        .find(|v| matches!(v, Value::ServerError(_)))?;
    Some(
        e.clone()
            .extract_error()
            .err()
            .unwrap_or_else(|| lost().into()),
    )
}

fn lost() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "a reply went missing")
}

/// Goes to the back of the worker's run queue once: the tasks ready now run
/// first (and queue their commands), without waiting for the I/O driver as
/// `tokio::task::yield_now` does. A task that wakes itself while it runs is
/// rescheduled as a yield, behind the others (tokio's harness), never in
/// the slot that runs next. Measured with `bench/ab.py` against writing
/// at once (a write per command: new keys 1.25x the CPU) and against
/// `yield_now` (this: new keys 0.96x, replays 0.97x the CPU, 2 % more of
/// both per second).
async fn behind_ready_tasks() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            return std::task::Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await
}

/// Writes what the callers queued. It lets the other ready tasks run first,
/// so that one write carries the commands of many requests.
async fn write_queued(shared: Arc<Shared>) {
    let mut out = Vec::new();
    loop {
        shared.queued.notified().await;
        behind_ready_tasks().await;
        std::mem::swap(&mut out, &mut shared.state().unwritten);
        let mut written = 0;
        while written < out.len() {
            if let Err(e) = shared.stream.writable().await {
                return shared.fail(e.kind(), "writing to the store failed");
            }
            match shared.stream.try_write(&out[written..]) {
                Ok(0) => return shared.fail(io::ErrorKind::WriteZero, "the store took no bytes"),
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return shared.fail(e.kind(), "writing to the store failed"),
            }
        }
        out.clear();
        if out.capacity() > KEEP {
            out = Vec::new();
        }
    }
}

/// Reads replies and hands each to its waiter, until the stream ends or
/// breaks the protocol. The buffer holds at most one reply in progress
/// (its bound is `reply`'s `MAX_REPLY`) and one read beyond it.
async fn read_replies(shared: Arc<Shared>) {
    let mut buf = BytesMut::with_capacity(READ);
    let mut scan = Scan::default();
    loop {
        if let Err(e) = shared.stream.readable().await {
            return shared.fail(e.kind(), "reading from the store failed");
        }
        buf.reserve(READ);
        match shared.stream.try_read_buf(&mut buf) {
            Ok(0) => {
                return shared.fail(
                    io::ErrorKind::ConnectionReset,
                    "the store closed the connection",
                )
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return shared.fail(e.kind(), "reading from the store failed"),
        }
        loop {
            let len = match scan.reply_len(&buf) {
                Ok(Some(len)) => len,
                Ok(None) => {
                    // A bulk whose length is in (at most a piece, checked)
                    // gets its room at once, not by doubling through the
                    // reads that bring it.
                    buf.reserve(scan.awaited().saturating_sub(buf.len()));
                    break;
                }
                Err(why) => return shared.fail(io::ErrorKind::InvalidData, why),
            };
            let value = match value(&buf[..len], 0) {
                Ok((value, _)) => value,
                Err(why) => return shared.fail(io::ErrorKind::InvalidData, why),
            };
            buf.advance(len);
            if !shared.deliver(value) {
                return shared.fail(
                    io::ErrorKind::InvalidData,
                    "the store sent a reply nobody asked for",
                );
            }
        }
        if buf.is_empty() && buf.capacity() > KEEP {
            buf = BytesMut::with_capacity(READ);
        }
    }
}

/// The reply parser's entry points for `fuzz/fuzz_targets/wire.rs`; not an API.
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::reply::{in_reads as replies_in_reads, parse as reply};
}

/// The error a request on a failed connection gets. A reply the reader
/// refused (`InvalidData`: beyond the parser's bounds, malformed, or not
/// asked for) is the store's answer not believed, a parse error, never a
/// store that is merely down: `on_store_error = "pass"` must not forward
/// on it (the key may be taken).
fn failed(kind: io::ErrorKind, why: &'static str) -> redis::RedisError {
    if kind == io::ErrorKind::InvalidData {
        redis::RedisError::from((redis::ErrorKind::Parse, why))
    } else {
        io::Error::new(kind, why).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Something that accepts and never answers (a proxy in front of a lost
    /// Redis) gives no connection: connecting waits for Redis's answer, so
    /// the store's `op_timeout` around it fails the connect and keeps nothing.
    #[tokio::test]
    async fn a_peer_that_accepts_and_never_answers_gives_no_connection() {
        use redis::IntoConnectionInfo;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _silent = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let info = format!("redis://{addr}/0")
            .as_str()
            .into_connection_info()
            .unwrap();
        let connect =
            tokio::time::timeout(std::time::Duration::from_millis(300), Wire::connect(&info)).await;
        assert!(connect.is_err(), "connected to a peer that never answered");
    }

    /// A command packed by hand is the bytes redis-rs packs for it.
    #[test]
    fn commands_pack_as_redis_rs_packs_them() {
        let value = vec![0u8, 255, b'\r', b'\n', 7];
        for (lease, inline) in [
            (0u64, 1u64),
            (9, 10),
            (30_000, 65_536),
            (u64::MAX, 123_456_789),
        ] {
            let mut ours = Vec::new();
            let (mut a, mut b) = ([0; 20], [0; 20]);
            pack(
                &mut ours,
                &[b"SET", b"k", &value, b"NX", b"PX", digits(lease, &mut a)],
            );
            pack(
                &mut ours,
                &[b"GETRANGE", b"k", b"0", digits(inline, &mut b)],
            );
            let mut theirs = Vec::new();
            redis::cmd("SET")
                .arg("k")
                .arg(&value)
                .arg("NX")
                .arg("PX")
                .arg(lease)
                .write_packed_command(&mut theirs);
            redis::cmd("GETRANGE")
                .arg("k")
                .arg(0)
                .arg(inline)
                .write_packed_command(&mut theirs);
            assert_eq!(ours, theirs, "lease {lease}, inline {inline}");
        }
    }
}
