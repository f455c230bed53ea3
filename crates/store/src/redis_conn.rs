//! One connection type for the store's three modes, and what every
//! operation sends on it: Lua scripts by `EVALSHA` (loaded again after
//! `NOSCRIPT`) and commands built at their final size. Below both the
//! operations (`ops`) and a large record's pieces (`pieces`).

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Script, Value};

use super::wire::{pack, Wire};
use super::StoreError;

/// One connection type for the three modes, so the store code is the same.
#[derive(Clone)]
pub(super) enum Conn {
    /// Standalone or Sentinel over plain TCP: idemproxy's own pipelined
    /// connection. Once broken it is made anew for the next operation.
    Wire(Wire),
    /// Standalone or Sentinel over TLS or a Unix socket: a multiplexed
    /// connection that reconnects on I/O errors.
    Single(ConnectionManager),
    /// Cluster: follows MOVED/ASK and the slot map by itself (a pipeline's
    /// with [`super::cluster::pipeline`]'s help).
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Wire(c) => c.req_packed_command(cmd),
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Wire(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => Box::pin(super::cluster::pipeline(c, pipeline, offset, count)),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Wire(c) => c.get_db(),
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

pub(super) fn ms(d: Duration) -> u64 {
    (d.as_millis() as u64).max(1)
}

/// Runs `script` on `key` with `args` (`EVALSHA`); when the server does not
/// have the script (a restart, a failover, `SCRIPT FLUSH`), loads it and
/// sends the command again, as `ScriptInvocation::invoke_async` does.
pub(super) async fn run_script<T: redis::FromRedisValue>(
    conn: &mut Conn,
    script: &Script,
    key: &str,
    args: &[&[u8]],
) -> redis::RedisResult<T> {
    match send_script(conn, script, key, args).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.load_async(conn).await?;
            send_script(conn, script, key, args).await
        }
        answer => answer,
    }
}

/// The most arguments a script of ours takes (a piece's five).
const SCRIPT_ARGS: usize = 5;

/// `EVALSHA script 1 key args…`, sent once. On our own connection it is packed
/// straight into the output, the arguments (a record among them) copied once;
/// on redis-rs's, built as a `Cmd` at its final size.
async fn send_script<T: redis::FromRedisValue>(
    conn: &mut Conn,
    script: &Script,
    key: &str,
    args: &[&[u8]],
) -> redis::RedisResult<T> {
    assert!(
        args.len() <= SCRIPT_ARGS,
        "a script with more arguments than SCRIPT_ARGS"
    );
    let mut all: [&[u8]; 4 + SCRIPT_ARGS] = [&[]; 4 + SCRIPT_ARGS];
    all[..4].copy_from_slice(&[
        b"EVALSHA",
        script.get_hash().as_bytes(),
        b"1",
        key.as_bytes(),
    ]);
    all[4..4 + args.len()].copy_from_slice(args);
    let all = &all[..4 + args.len()];
    let value = match conn {
        Conn::Wire(wire) => {
            let mut got = wire.commands(|out| pack(out, all), 1).await?;
            got.pop()
                .ok_or((redis::ErrorKind::Client, "a script without its answer"))?
        }
        other => command(all).query_async(other).await?,
    };
    Ok(redis::from_redis_value(value)?)
}

/// A command from its arguments (its name first), at its final size: for
/// redis-rs's connections, what [`pack`] writes on our own.
pub(super) fn command(args: &[&[u8]]) -> Cmd {
    let bytes = args.iter().map(|a| a.len()).sum();
    let mut cmd = Cmd::with_capacity(args.len(), bytes);
    for arg in args {
        cmd.arg(*arg);
    }
    cmd
}

/// A client error as a store error; the client's own response timeout counts
/// as a timeout (of `op_timeout`), and a reply that could not be parsed is
/// not believed. (The crate's messages can carry
/// addresses: callers log them, problems never show them.)
pub(super) fn store_error(e: redis::RedisError, op_timeout: Duration) -> StoreError {
    use redis::{ErrorKind, ServerErrorKind};
    let broken = e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || matches!(
            e.kind(),
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        );
    if e.is_timeout() {
        StoreError::Timeout(op_timeout)
    } else if e.kind() == ErrorKind::Parse {
        // A reply no store keeping our records would give (`wire::failed`).
        StoreError::Untrue(e.to_string())
    } else if broken {
        StoreError::Unavailable(e.to_string())
    } else {
        StoreError::Backend(e.to_string())
    }
}
