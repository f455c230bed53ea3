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
//! ([`Scan`]: each byte once, every length and count against a bound before
//! anything is read or reserved for it), and built only once it is whole.
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

/// A bulk reply longer than this is taken for a broken stream, not waited
/// for (checked on its length line, before anything is read or reserved for
/// it): no reply the store asks for is over a piece of a record.
const MAX_BULK: usize = super::PIECE;
/// A status, error or length line longer than this is a broken stream too.
const MAX_LINE: usize = 64 << 10;
/// The most bytes one reply may take, arrays included: one bulk at its
/// largest with room for a line beside it.
const MAX_REPLY: usize = MAX_BULK + MAX_LINE;
/// The most values one reply may hold (an array counts, and each element):
/// the largest the store asks for is `SCRIPT EXISTS` of its four scripts.
const MAX_VALUES: usize = 1024;
/// Bytes queued for a store that does not read them: beyond this, calls fail
/// at once (the store is down) instead of queueing more.
const MAX_UNWRITTEN: usize = 64 << 20;
/// Arrays nested deeper than this are taken for a broken stream: no reply the
/// store asks for nests more than two levels, and the builder recurses.
const MAX_DEPTH: usize = 8;
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
    pub fn is_broken(&self) -> bool {
        self.handle.shared.broken.load(Ordering::Acquire)
    }

    /// Why the connection failed, once it has.
    pub fn failure(&self) -> &'static str {
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
                return Err(io::Error::new(kind, why).into());
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
            io::Error::new(kind, why).into()
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
/// ([`MAX_REPLY`]) and one read beyond it.
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

/// Where the check of the reply at the start of the buffer stands, so that
/// each byte of a reply is looked at once, however many reads bring it (a
/// reply trickled a byte at a time costs no more than one read at once),
/// and a reply is given up as soon as it is over a bound: its size, the
/// length of a line or of a bulk, its values, its nesting. Nothing is
/// allocated for a reply until it is whole and within every bound.
#[derive(Default)]
struct Scan {
    /// The bytes before this are whole values or array headers.
    at: usize,
    /// Where the search for the end of the line at `at` goes on.
    line_from: usize,
    /// The end of the bulk string whose length line is in, while its bytes come.
    bulk_end: Option<usize>,
    /// Elements still to come in each array the scan is inside, innermost last.
    open: Vec<usize>,
    /// Values met so far in this reply (each array and each element).
    values: usize,
    /// Bytes the line search has looked at (for the test that none is looked at twice).
    #[cfg(test)]
    looked: usize,
}

impl Scan {
    /// The length of the reply at the start of `buf` once it is all there
    /// (the scan then starts over, for the next reply), `None` until then,
    /// or why the stream is broken. `buf` only grows between calls, until
    /// the reply is taken off its front.
    fn reply_len(&mut self, buf: &[u8]) -> Result<Option<usize>, &'static str> {
        loop {
            let end = match self.bulk_end {
                Some(end) => match buf.get(end..end + 2) {
                    None => return Ok(None),
                    Some(b"\r\n") => end + 2,
                    Some(_) => return Err("the store sent a bulk reply of the wrong length"),
                },
                None => match self.value_at(buf)? {
                    Step::Whole(end) => end,
                    Step::Wait => return Ok(None),
                    Step::Opened => continue,
                },
            };
            self.bulk_end = None;
            self.at = end;
            self.line_from = end;
            // One more element of each array this value closes.
            loop {
                match self.open.last_mut() {
                    None => {
                        // Starts over for the next reply (the stack's room kept).
                        *self = Scan {
                            open: std::mem::take(&mut self.open),
                            #[cfg(test)]
                            looked: self.looked,
                            ..Scan::default()
                        };
                        return Ok(Some(end));
                    }
                    Some(left) if *left > 1 => {
                        *left -= 1;
                        break;
                    }
                    Some(_) => {
                        self.open.pop();
                    }
                }
            }
        }
    }

    /// Reads the value whose first line starts at `at`.
    fn value_at(&mut self, buf: &[u8]) -> Result<Step, &'static str> {
        let from = self.line_from.max(self.at);
        let found = buf
            .get(from..)
            .and_then(|rest| rest.windows(2).position(|w| w == b"\r\n"));
        #[cfg(test)]
        {
            self.looked += found.map_or(buf.len().saturating_sub(from), |i| i + 2);
        }
        let Some(cr) = found.map(|i| from + i) else {
            if buf.len() - self.at > MAX_LINE + 2 {
                return Err("the store sent a line over 64 KiB");
            }
            // The last byte may be the CR of a CRLF still to come.
            self.line_from = buf.len().saturating_sub(1).max(self.at);
            return Ok(Step::Wait);
        };
        if cr == self.at {
            return Err("the store sent an empty line");
        }
        if cr - self.at > MAX_LINE + 1 {
            return Err("the store sent a line over 64 KiB");
        }
        let after = cr + 2;
        if after > MAX_REPLY {
            return Err("the store sent a reply larger than any it is asked for");
        }
        self.values += 1;
        if self.values > MAX_VALUES {
            return Err("the store sent a reply of more values than any it is asked for");
        }
        let line = &buf[self.at + 1..cr];
        match buf[self.at] {
            b'+' | b'-' => Ok(Step::Whole(after)),
            b':' => number(line).map(|_| Step::Whole(after)),
            b'$' => match number(line)? {
                n if n < 0 => Ok(Step::Whole(after)),
                n if n as u64 > MAX_BULK as u64 => {
                    Err("the store sent a bulk reply larger than a piece of a record")
                }
                n => {
                    let end = after + n as usize;
                    if end + 2 > MAX_REPLY {
                        return Err("the store sent a reply larger than any it is asked for");
                    }
                    self.bulk_end = Some(end);
                    self.at = after;
                    self.line_from = after;
                    Ok(Step::Opened)
                }
            },
            b'*' => match number(line)? {
                n if n <= 0 => Ok(Step::Whole(after)),
                n if n as u64 > MAX_VALUES as u64 => {
                    Err("the store sent a reply of more values than any it is asked for")
                }
                n => {
                    if self.open.len() >= MAX_DEPTH {
                        return Err("the store sent arrays nested too deep");
                    }
                    self.open.push(n as usize);
                    self.at = after;
                    self.line_from = after;
                    Ok(Step::Opened)
                }
            },
            _ => Err("the store sent a reply of an unknown type"),
        }
    }

    /// How long the buffer must be for the bulk string being read (0: no bulk).
    fn awaited(&self) -> usize {
        self.bulk_end.map_or(0, |end| end + 2)
    }
}

/// What reading one value's first line found.
enum Step {
    /// A value that ends here.
    Whole(usize),
    /// An array's elements, or a bulk's bytes, follow.
    Opened,
    /// The line has not all come.
    Wait,
}

fn number(digits: &[u8]) -> Result<i64, &'static str> {
    std::str::from_utf8(digits)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or("the store sent a malformed number")
}

/// The reply at the start of `buf`, which [`Scan::reply_len`] found whole
/// and within bounds, and its length. Values as redis-rs's parser makes them
/// (`+OK` is `Okay`, a null bulk or array is `Nil`); an error goes through
/// redis-rs's own parser, which knows the kinds (`NOSCRIPT`, `READONLY`...).
fn value(buf: &[u8], depth: usize) -> Result<(Value, usize), &'static str> {
    let end = buf
        .windows(2)
        .position(|w| w == b"\r\n")
        .filter(|&end| end > 0)
        .ok_or("a reply cut short")?;
    let (line, after) = (&buf[1..end], end + 2);
    let value = match buf[0] {
        b'+' if line == b"OK" => Value::Okay,
        b'+' => Value::SimpleString(String::from_utf8_lossy(line).into_owned()),
        b'-' => redis::parse_redis_value(&buf[..after])
            .map_err(|_| "the store sent a malformed error")?,
        b':' => Value::Int(number(line)?),
        b'$' | b'*' if number(line)? < 0 => Value::Nil,
        b'$' => {
            let n = usize::try_from(number(line)?).map_err(|_| "a reply cut short")?;
            let data = buf.get(after..after + n).ok_or("a reply cut short")?;
            return Ok((Value::BulkString(data.to_vec()), after + n + 2));
        }
        b'*' => {
            let n = usize::try_from(number(line)?).map_err(|_| "a reply cut short")?;
            if n > MAX_VALUES || depth >= MAX_DEPTH {
                return Err("the store sent a reply over its bounds");
            }
            let mut items = Vec::with_capacity(n);
            let mut at = after;
            for _ in 0..n {
                let (item, len) = value(buf.get(at..).ok_or("a reply cut short")?, depth + 1)?;
                items.push(item);
                at += len;
            }
            return Ok((Value::Array(items), at));
        }
        _ => return Err("the store sent a reply of an unknown type"),
    };
    Ok((value, after))
}

/// The next whole reply in `buf` and its length, `None` until it has arrived.
#[cfg(test)]
fn parse(buf: &[u8]) -> Result<Option<(Value, usize)>, &'static str> {
    match Scan::default().reply_len(buf)? {
        None => Ok(None),
        Some(len) => value(&buf[..len], 0).map(Some),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn whole(bytes: &[u8]) -> Value {
        let (value, len) = parse(bytes).unwrap().unwrap();
        assert_eq!(len, bytes.len(), "the whole reply is consumed");
        value
    }

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

    /// Every reply the store asks for parses as redis-rs's own parser parses it.
    #[test]
    fn replies_parse_as_redis_rs_parses_them() {
        let replies: &[&[u8]] = &[
            b"+OK\r\n",
            b"+PONG\r\n",
            b":42\r\n",
            b":-2\r\n",
            b"$-1\r\n",
            b"$0\r\n\r\n",
            b"$5\r\nhe\r\no\r\n",
            b"*-1\r\n",
            b"*0\r\n",
            b"*2\r\n$3\r\nabc\r\n:1500\r\n",
            b"*2\r\n*1\r\n:1\r\n$-1\r\n",
            b"-NOSCRIPT No matching script. Please use EVAL.\r\n",
            b"-READONLY You can't write against a read only replica.\r\n",
            b"-ERR wrong number of arguments\r\n",
        ];
        for reply in replies {
            assert_eq!(
                whole(reply),
                redis::parse_redis_value(reply).unwrap(),
                "{}",
                String::from_utf8_lossy(reply)
            );
        }
        let Value::ServerError(e) = whole(b"-NOSCRIPT No matching script.\r\n") else {
            panic!("an error reply is a ServerError");
        };
        assert_eq!(
            e.kind(),
            Some(redis::ServerErrorKind::NoScript),
            "the script is reloaded on NOSCRIPT"
        );
    }

    /// Every proper prefix of a reply is incomplete, never an error or a value.
    #[test]
    fn a_reply_cut_anywhere_waits_for_the_rest() {
        let reply = b"*3\r\n$3\r\nabc\r\n*2\r\n:1\r\n$-1\r\n+OK\r\n";
        for cut in 0..reply.len() {
            assert_eq!(parse(&reply[..cut]), Ok(None), "cut at {cut}");
        }
        assert!(matches!(parse(reply), Ok(Some((_, n))) if n == reply.len()));
        // A piece's room is taken at once, from its length line.
        let mut scan = Scan::default();
        assert_eq!(scan.reply_len(b"$200000\r\nab"), Ok(None));
        assert_eq!(scan.awaited(), 200_011);
        assert_eq!(Scan::default().awaited(), 0);
    }

    /// Fed a byte at a time, as a store that trickles its reply sends it,
    /// the scan looks at each byte about once (the rescans of a whole
    /// buffered reply at every read made a trickled reply quadratic), and
    /// ends at the reply's end; the bytes after it are the next reply's.
    #[test]
    fn a_trickled_reply_is_scanned_once() {
        let mut reply = b"*3\r\n$5\r\nhello\r\n*1000\r\n".to_vec();
        for i in 0..1000 {
            reply.extend_from_slice(format!(":{i}\r\n").as_bytes());
        }
        reply.extend_from_slice(b"-ERR a long error line to end the reply\r\n");
        let whole = reply.len();
        reply.extend_from_slice(b"+OK\r\n");
        let mut scan = Scan::default();
        for cut in 1..whole {
            assert_eq!(scan.reply_len(&reply[..cut]), Ok(None), "cut at {cut}");
        }
        assert_eq!(scan.reply_len(&reply[..whole]), Ok(Some(whole)));
        assert!(
            scan.looked <= 2 * whole,
            "{} bytes looked at for a {whole}-byte reply",
            scan.looked
        );
        let (value, len) = value(&reply[..whole], 0).unwrap();
        assert_eq!(len, whole);
        assert_eq!(value, redis::parse_redis_value(&reply[..whole]).unwrap());
        // The next reply, from a scan started over.
        assert_eq!(scan.reply_len(&reply[whole..]), Ok(Some(5)));
    }

    #[test]
    fn a_malformed_stream_is_an_error_not_a_wait() {
        let bad: &[&[u8]] = &[
            b"?what\r\n",
            b":12x\r\n",
            b"$abc\r\n",
            b"$3\r\nabcde\r\n",
            b"$99999999999\r\n",
            b"*1\r\n:x\r\n",
            b"$-99999999999999999999999\r\n",
        ];
        for reply in bad {
            assert!(parse(reply).is_err(), "{}", String::from_utf8_lossy(reply));
        }
        let deep = b"*1\r\n".repeat(MAX_DEPTH + 1);
        assert!(parse(&deep).is_err(), "nesting is bounded");
        // A line that never ends is not waited for without bound.
        assert_eq!(parse(&[b'+'; 1000]), Ok(None));
        assert!(parse(&vec![b'+'; MAX_LINE + 3]).is_err());
    }

    /// Every length and count is checked on its line, before anything is
    /// read or reserved for it: a length of 2^62, a count of 2^31, more
    /// values than any reply holds (an endless array), a bulk string larger
    /// than a piece of a record, and a reply larger than any the store is
    /// asked for are errors as soon as they show, never waited for.
    #[test]
    fn lengths_and_counts_are_bounded_before_anything_is_read_for_them() {
        assert!(parse(b"$4611686018427387904\r\n").is_err());
        assert!(parse(b"*2147483648\r\n").is_err());
        assert!(parse(format!("${}\r\n", MAX_BULK + 1).as_bytes()).is_err());
        assert_eq!(parse(format!("${MAX_BULK}\r\n").as_bytes()), Ok(None));
        assert!(parse(format!("*{}\r\n", MAX_VALUES + 1).as_bytes()).is_err());
        // An array of a count within bounds whose elements go on and on
        // (nested arrays of the most elements each) is cut at the bound on values.
        let mut endless = b"*1000\r\n".to_vec();
        for _ in 0..1000 {
            endless.extend_from_slice(b"*1000\r\n");
            endless.extend_from_slice(&b":1\r\n".repeat(999));
        }
        let mut scan = Scan::default();
        let cut = (1..endless.len())
            .find(|&n| scan.reply_len(&endless[..n]).is_err())
            .expect("an endless array is refused");
        assert!(cut <= 16 + 4 * MAX_VALUES, "refused after {cut} bytes");
        // Two bulk strings of a piece each: valid RESP, larger than any reply.
        let piece = vec![b'x'; MAX_BULK];
        let mut two = b"*2\r\n".to_vec();
        for _ in 0..2 {
            two.extend_from_slice(format!("${MAX_BULK}\r\n").as_bytes());
            two.extend_from_slice(&piece);
            two.extend_from_slice(b"\r\n");
        }
        assert!(parse(&two).is_err());
        // One piece is a reply the store asks for.
        let one = format!("${MAX_BULK}\r\n").len() + MAX_BULK + 2;
        assert_eq!(
            parse(&two[4..4 + one]).map(|r| r.map(|(_, n)| n)),
            Ok(Some(one))
        );
    }

    /// Feeds `bytes` to one scan as reads of the sizes in `reads` would
    /// bring them (then the rest at once), taking each whole reply off the
    /// front: the replies built, and whether the stream broke.
    fn drive(bytes: &[u8], reads: &[usize]) -> (Vec<Value>, bool) {
        let (mut buf, mut fed, mut got) = (Vec::new(), 0, Vec::new());
        let mut scan = Scan::default();
        let sizes = reads.iter().copied().chain(std::iter::once(bytes.len()));
        for size in sizes {
            let next = (fed + size.max(1)).min(bytes.len());
            buf.extend_from_slice(&bytes[fed..next]);
            fed = next;
            loop {
                match scan.reply_len(&buf) {
                    Ok(Some(len)) => match value(&buf[..len], 0) {
                        Ok((value, used)) => {
                            assert_eq!(used, len, "a value is the reply scanned");
                            got.push(value);
                            buf.drain(..len);
                        }
                        // An error line redis-rs cannot read (not UTF-8).
                        Err(_) => return (got, true),
                    },
                    Ok(None) => break,
                    Err(_) => return (got, true),
                }
            }
            if fed == bytes.len() {
                break;
            }
        }
        (got, false)
    }

    /// RESP2 replies of the kinds the store gets, nested.
    fn reply() -> impl Strategy<Value = Vec<u8>> {
        let leaf = prop_oneof![
            any::<i64>().prop_map(|n| format!(":{n}\r\n").into_bytes()),
            "[a-zA-Z ]{0,20}".prop_map(|t| format!("+{t}\r\n").into_bytes()),
            "[A-Z]{1,8} [a-z ]{0,20}".prop_map(|t| format!("-{t}\r\n").into_bytes()),
            Just(b"$-1\r\n".to_vec()),
            proptest::collection::vec(any::<u8>(), 0..40).prop_map(|b| {
                let mut out = format!("${}\r\n", b.len()).into_bytes();
                out.extend_from_slice(&b);
                out.extend_from_slice(b"\r\n");
                out
            }),
        ];
        leaf.prop_recursive(3, 32, 6, |inner| {
            proptest::collection::vec(inner, 0..6).prop_map(|items| {
                let mut out = format!("*{}\r\n", items.len()).into_bytes();
                for item in items {
                    out.extend_from_slice(&item);
                }
                out
            })
        })
    }

    proptest! {
        /// However the reads split them, valid replies come out as
        /// redis-rs's parser reads each of them.
        #[test]
        fn replies_split_anywhere_parse_as_redis_rs_parses_them(
            replies in proptest::collection::vec(reply(), 1..5),
            reads in proptest::collection::vec(1usize..40, 0..40),
        ) {
            let bytes = replies.concat();
            let (got, broke) = drive(&bytes, &reads);
            prop_assert!(!broke);
            let expected: Vec<Value> = replies
                .iter()
                .map(|r| redis::parse_redis_value(r).unwrap())
                .collect();
            prop_assert_eq!(got, expected);
        }

        /// Any bytes, split anyhow: no panic, and the same outcome as read at once.
        #[test]
        fn any_bytes_split_anyhow_are_read_as_at_once(
            bytes in proptest::collection::vec(
                prop_oneof![Just(b'\r'), Just(b'\n'), Just(b'*'), Just(b'$'), Just(b':'), Just(b'1'), Just(b'-'), any::<u8>()],
                0..200,
            ),
            reads in proptest::collection::vec(1usize..20, 0..30),
        ) {
            prop_assert_eq!(drive(&bytes, &reads), drive(&bytes, &[]));
        }
    }
}
