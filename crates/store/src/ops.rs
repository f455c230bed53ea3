//! The Redis store's operations: a reserve is two plain commands in one
//! write (`SET NX PX`, `GETRANGE`); the owner-checked writes are small Lua
//! scripts beside this file (complete, renew, release, the take-over of a
//! vanished owner's key, a large record's pieces); the rest are plain reads. Every operation touches one key.

use std::sync::atomic::Ordering;
use std::sync::LazyLock;
use std::time::Duration;

use bytes::Bytes;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Pipeline, Script, Value};
use tracing::{info, warn};

use super::pieces::{self, Step};
use super::redis::RedisStore;
use super::redis_conn::{command, ms, run_script, Conn};
use super::wire::{digits, pack};
use super::{Completion, Occupant, Operations, StoreError};
use crate::deadline::Deadlines;
use crate::record::Token;

static COMPLETE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("complete.lua")));
static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("renew.lua")));
static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("release.lua")));
static TAKE_OVER: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("take_over.lua")));

/// A reply, for an error message: its kind and size, never its bytes (a
/// store that lies can send megabytes, and the message is logged).
fn described(v: &Value) -> String {
    match v {
        Value::BulkString(b) => format!("a bulk string of {} bytes", b.len()),
        Value::SimpleString(s) => format!("a status of {} bytes", s.len()),
        Value::Array(a) => format!("an array of {} values", a.len()),
        Value::ServerError(e) => format!("an error ({})", e.code()),
        Value::Nil | Value::Okay | Value::Int(_) => format!("{v:?}"),
        _ => "a reply of an unexpected kind".to_string(),
    }
}

/// How often a reserve is sent when the key it found taken is gone by the
/// time it is read, before what is there is taken as the answer.
const RESERVE_TRIES: u32 = 3;

/// Sends a reserve in one write: `SET key value NX PX lease`, then
/// `GETRANGE key 0 inline-1` (at most `inline` bytes: no more than the room
/// the caller holds for the answer); the two answers. On our own connection the
/// commands are packed straight into its output, without `Cmd`s.
async fn send_reserve(
    conn: &mut Conn,
    key: &str,
    value: &[u8],
    lease: Duration,
    inline: u64,
) -> redis::RedisResult<(Value, Value)> {
    let (mut ms_digits, mut last_digits) = ([0; 20], [0; 20]);
    let lease = digits(ms(lease), &mut ms_digits);
    // `GETRANGE key 0 -1` would be the whole value: never below one byte.
    let last = digits(inline.max(1) - 1, &mut last_digits);
    let key = key.as_bytes();
    let set: [&[u8]; 6] = [b"SET", key, value, b"NX", b"PX", lease];
    let getrange: [&[u8]; 4] = [b"GETRANGE", key, b"0", last];
    let mut answers = match conn {
        Conn::Wire(wire) => {
            let write = |out: &mut Vec<u8>| {
                pack(out, &set);
                pack(out, &getrange);
            };
            wire.commands(write, 2).await?
        }
        other => {
            let mut pipe = Pipeline::with_capacity(2);
            pipe.add_command(command(&set))
                .add_command(command(&getrange));
            pipe.query_async(other).await?
        }
    };
    match (answers.pop(), answers.pop(), answers.is_empty()) {
        (Some(head), Some(set), true) => Ok((set, head)),
        _ => Err((redis::ErrorKind::Client, "a reserve without two answers").into()),
    }
}

fn unexpected(what: &str, v: &Value) -> StoreError {
    StoreError::Backend(format!("unexpected {what} answer: {}", described(v)))
}

/// The bytes a reserve's `GETRANGE` of at most `inline` bytes read; more
/// than asked for are not believed.
fn getrange_answer(head: Value, inline: u64) -> Result<Vec<u8>, StoreError> {
    match head {
        Value::BulkString(head) if head.len() as u64 > inline.max(1) => Err(StoreError::Untrue(
            format!("{} bytes for a GETRANGE of at most {inline}", head.len()),
        )),
        Value::BulkString(head) => Ok(head),
        other => Err(unexpected("GETRANGE", &other)),
    }
}

impl RedisStore {
    /// `WAIT n timeout` on the key's node. Fewer acknowledgements, or a WAIT
    /// that fails (an ACL without `+wait`), and the reservation just written is
    /// released by its token and the request refused (503): never forwarded on
    /// a write a failover could lose, never left `processing` for a lease.
    async fn wait_for_replicas(
        &self,
        conn: &mut Conn,
        key: &str,
        token: Token,
    ) -> Result<(), StoreError> {
        let acked = match self.wait(conn, key).await {
            Ok(acked) if acked >= i64::from(self.wait_replicas) => return Ok(()),
            Ok(acked) => Err(StoreError::NotReplicated {
                wanted: self.wait_replicas,
                acked: acked.max(0) as u32,
            }),
            Err(e) => Err(StoreError::Unconfirmed(e.to_string())),
        };
        if let Err(e) = self.release(key, token).await {
            warn!(error = %e, "withdrawing an unconfirmed reservation failed; its owner retries");
        }
        acked
    }

    /// A record over one piece, written in pieces (see [`pieces`]), each
    /// within its own `op_timeout`; once more if the key changed under the
    /// first attempt.
    async fn complete_in_pieces(
        &self,
        conn: &mut Conn,
        key: &str,
        token: Token,
        value: (&Bytes, Duration),
        step: &Step<'_>,
    ) -> Result<Completion, StoreError> {
        for _ in 0..2 {
            if let Some(done) = pieces::complete(conn, key, token, value, step).await? {
                return Ok(done);
            }
        }
        Err(StoreError::Backend(
            "the record changed while it was being written".into(),
        ))
    }

    /// `WAIT`; when it falls short, whether the master moved
    /// ([`Connections::master_moved`](super::redis_connections::Connections::master_moved)).
    async fn wait(&self, conn: &mut Conn, key: &str) -> redis::RedisResult<i64> {
        let waited = self.wait_once(conn, key).await;
        if !matches!(waited, Ok(acked) if acked >= i64::from(self.wait_replicas)) {
            self.conns.master_moved().await;
        }
        waited
    }

    async fn wait_once(&self, conn: &mut Conn, key: &str) -> redis::RedisResult<i64> {
        let mut wait = redis::cmd("WAIT");
        wait.arg(self.wait_replicas).arg(ms(self.wait_timeout));
        match conn {
            Conn::Wire(c) => wait.query_async(c).await,
            Conn::Single(c) => wait.query_async(c).await,
            Conn::Cluster(c) => {
                // WAIT names no key: send it to the master of the key's slot.
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                    Route::with_key(key, SlotAddr::Master),
                ));
                Ok(redis::from_redis_value(
                    c.route_command(wait, route).await?,
                )?)
            }
        }
    }

    /// Warns loudly when the store would lose reservations: an evicting memory
    /// policy, or no persistence. Managed Redis often refuses CONFIG: say so once.
    async fn check_durability(&self, conn: &mut Conn) {
        let get = |name: &'static str| {
            let mut c = conn.clone();
            async move {
                let pair: Result<Vec<String>, _> = redis::cmd("CONFIG")
                    .arg("GET")
                    .arg(name)
                    .query_async(&mut c)
                    .await;
                pair.map(|p| p.get(1).cloned().unwrap_or_default())
            }
        };
        let (policy, aof, save) = (
            get("maxmemory-policy").await,
            get("appendonly").await,
            get("save").await,
        );
        match (policy, aof, save) {
            (Ok(policy), Ok(aof), Ok(save)) => {
                if policy != "noeviction" {
                    warn!(
                        maxmemory_policy = %policy,
                        "the store may evict records: set maxmemory-policy noeviction, or reservations can vanish and a retry execute twice"
                    );
                }
                if aof != "yes" && save.trim().is_empty() {
                    warn!("the store has no persistence (appendonly no, no save points): a restart forgets every record");
                } else if aof != "yes" {
                    warn!("the store persists by snapshots only: a crash loses the records since the last one; appendonly yes is safer");
                }
                if policy == "noeviction" && aof == "yes" {
                    info!("store durability check: maxmemory-policy noeviction, appendonly yes");
                }
            }
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => warn!(
                error = %e,
                "the store refused CONFIG GET, so its eviction policy and persistence cannot be checked; make sure of noeviction and AOF"
            ),
        }
    }
}

impl Operations for RedisStore {
    /// `SET NX PX` with the lease and, in the same write, `GETRANGE` of
    /// the key's first `inline` bytes: a new key is ours; a taken one comes
    /// back with what holds it, whole when it is at most `inline` bytes
    /// (`STRLEN` tells when exactly `inline` came), otherwise only its
    /// length (a large record's bytes are fetched once the caller has room
    /// for them). Two plain commands cost Redis a
    /// third less than a script for a new key and two thirds less for a
    /// taken one (`docs/dev/benchmarks-journal.md`). They are not atomic, and need not
    /// be: the read names whatever holds the key after the `SET` failed, and
    /// a key gone in between is reserved again. The remaining lease is not
    /// read here (only a 409 needs it: [`Operations::pttl`]).
    async fn reserve(
        &self,
        key: &str,
        value: Bytes,
        lease: Duration,
        inline: u64,
        taken: &std::sync::atomic::AtomicBool,
    ) -> Result<Option<Occupant>, StoreError> {
        let mut conn = self.conns.conn().await?;
        let mut tries = 0;
        let held = loop {
            tries += 1;
            let (set, head) = send_reserve(&mut conn, key, &value, lease, inline)
                .await
                .map_err(|e| self.backend(e))?;
            match set {
                Value::Okay => break None,
                Value::Nil => taken.store(true, std::sync::atomic::Ordering::Relaxed),
                other => return Err(unexpected("SET NX", &other)),
            }
            let head = getrange_answer(head, inline)?;
            // Gone between the two commands (expired, released, deleted):
            // reserve again. An empty value that stays is not ours to
            // overwrite: after a few tries it is judged as what it is.
            if head.is_empty() && tries < RESERVE_TRIES {
                continue;
            }
            // Fewer than `inline` bytes are the whole value; `inline` bytes
            // are the whole value or its beginning, as its length says.
            let len = if (head.len() as u64) < inline {
                head.len() as u64
            } else {
                redis::cmd("STRLEN")
                    .arg(key)
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| self.backend(e))?
            };
            if len == head.len() as u64 {
                break Some(Occupant::Value {
                    value: Bytes::from(head),
                    ttl: None,
                });
            }
            if len > 0 || tries >= RESERVE_TRIES {
                break Some(Occupant::Large {
                    len,
                    start: Bytes::from(head),
                });
            }
        };
        if held.is_none() && self.wait_replicas > 0 {
            let token = Token::of_record(&value).ok_or_else(|| {
                StoreError::Backend("a reservation without an owner token".into())
            })?;
            // Boxed, as every path most operations do not take: the hot
            // path's future stays small, and so does each copy of it.
            Box::pin(self.wait_for_replicas(&mut conn, key, token)).await?;
        }
        Ok(held)
    }

    /// What is left of a key's lease or TTL (for `Retry-After`); zero when it is gone.
    async fn pttl(&self, key: &str) -> Result<Duration, StoreError> {
        let mut conn = self.conns.conn().await?;
        let ms: i64 = redis::cmd("PTTL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        Ok(Duration::from_millis(ms.max(0) as u64))
    }

    /// Each round trip within its own `op_timeout`: connecting, the record
    /// (each of its pieces when it is large), and `WAIT` (`op_timeout` beyond
    /// `wait_timeout`, which the server waits itself).
    async fn complete(
        &self,
        key: &str,
        token: Token,
        value: Bytes,
        ttl: Duration,
        steps: &Deadlines,
    ) -> Result<Completion, StoreError> {
        let error = |e| self.backend(e);
        let step = Step {
            deadlines: steps,
            error: &error,
        };
        let mut conn = step.bound(self.conns.conn()).await?;
        let done = if value.len() > pieces::PIECE {
            Box::pin(self.complete_in_pieces(&mut conn, key, token, (&value, ttl), &step)).await?
        } else {
            let mut ttl_digits = [0; 20];
            let ttl = digits(ms(ttl), &mut ttl_digits);
            let args: [&[u8]; 3] = [&token.0, &value, ttl];
            let n: i64 = step
                .run(run_script(&mut conn, &COMPLETE, key, &args))
                .await?;
            match n {
                1 => Completion::Stored,
                2 => Completion::StoredAfterExpiry,
                _ => Completion::Refused,
            }
        };
        if done == Completion::Refused || self.wait_replicas == 0 {
            return Ok(done);
        }
        // The finished record is replicated like the reservation was: without
        // this, a failover right after the answer would bring `processing` back.
        let waited = tokio::time::timeout(
            self.op_timeout + self.wait_timeout,
            Box::pin(self.wait(&mut conn, key)),
        )
        .await
        .unwrap_or_else(|_| Err((redis::ErrorKind::Io, "WAIT timed out").into()));
        Ok(match waited {
            Ok(acked) if acked >= i64::from(self.wait_replicas) => done,
            Ok(acked) => Completion::Unreplicated {
                wanted: self.wait_replicas,
                acked: acked.max(0) as u32,
            },
            Err(e) => {
                warn!(error = %e, "WAIT after a completion failed");
                Completion::Unreplicated {
                    wanted: self.wait_replicas,
                    acked: 0,
                }
            }
        })
    }

    async fn renew(&self, key: &str, token: Token, lease: Duration) -> Result<bool, StoreError> {
        let mut conn = self.conns.conn().await?;
        let mut lease_digits = [0; 20];
        let lease = digits(ms(lease), &mut lease_digits);
        let n: i64 = run_script(&mut conn, &RENEW, key, &[&token.0, lease])
            .await
            .map_err(|e| self.backend(e))?;
        Ok(n == 1)
    }

    async fn take_over(
        &self,
        key: &str,
        dead: Token,
        afterlife: Duration,
        value: Bytes,
        hold: Duration,
    ) -> Result<bool, StoreError> {
        let mut conn = self.conns.conn().await?;
        let (mut after_digits, mut hold_digits) = ([0; 20], [0; 20]);
        let after = digits(ms(afterlife), &mut after_digits);
        let hold = digits(ms(hold), &mut hold_digits);
        let args: [&[u8]; 4] = [&dead.0, after, &value, hold];
        let n: i64 = run_script(&mut conn, &TAKE_OVER, key, &args)
            .await
            .map_err(|e| self.backend(e))?;
        if n == 1 && self.wait_replicas > 0 {
            // As after a reserve: what took the key over is on enough
            // replicas, or (a reservation of the taker's) withdrawn and the
            // request refused; a failover must not bring back the vanished
            // owner's reservation for a second taker to run again.
            let taker = Token::of_record(&value)
                .ok_or_else(|| StoreError::Backend("a record without an owner token".into()))?;
            Box::pin(self.wait_for_replicas(&mut conn, key, taker)).await?;
        }
        Ok(n == 1)
    }

    async fn release(&self, key: &str, token: Token) -> Result<bool, StoreError> {
        let mut conn = self.conns.conn().await?;
        let n: i64 = run_script(&mut conn, &RELEASE, key, &[&token.0])
            .await
            .map_err(|e| self.backend(e))?;
        Ok(n == 1)
    }

    /// A record and its TTL, in pieces when it is large (see [`pieces`]),
    /// each round trip within its own `op_timeout`; one said to be longer
    /// than `at_most` is not believed.
    async fn get(
        &self,
        key: &str,
        at_most: u64,
        steps: &Deadlines,
    ) -> Result<Option<(Bytes, Duration)>, StoreError> {
        let error = |e| self.backend(e);
        let step = Step {
            deadlines: steps,
            error: &error,
        };
        let mut conn = step.bound(self.conns.conn()).await?;
        Box::pin(pieces::get(&mut conn, key, at_most, &step)).await
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let mut conn = self.conns.conn().await?;
        let n: i64 = redis::cmd("DEL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        Ok(n > 0)
    }

    /// PING, then make sure the scripts are loaded (after a restart or failover they
    /// are gone; on a cluster SCRIPT goes to every master), then, once, the durability check.
    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conns.conn().await?;
        let _: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        let scripts = [
            &*COMPLETE,
            &*RENEW,
            &*RELEASE,
            &*TAKE_OVER,
            &*pieces::SCRIPT,
        ];
        let hashes = scripts.map(|s| s.get_hash().to_string());
        let loaded: Vec<bool> = redis::cmd("SCRIPT")
            .arg("EXISTS")
            .arg(&hashes[..])
            .query_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        for (script, present) in scripts.into_iter().zip(loaded) {
            if !present {
                script
                    .prepare_invoke()
                    .load_async(&mut conn)
                    .await
                    .map_err(|e| self.backend(e))?;
            }
        }
        if let (Some(nodes), Conn::Cluster(c)) = (self.conns.cluster(), &mut conn) {
            // Keeps the known nodes current, for a reconnect that cannot rely on the seeds.
            nodes.learn(c).await;
        }
        if !self.checked.swap(true, Ordering::Relaxed) {
            self.check_durability(&mut conn).await;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Backend, RedisMode, SslMode, StoreConfig};

    /// A future is copied whole where it is made and where it is awaited, so
    /// the per-request operations carry only their common path: connecting,
    /// `WAIT` and a large record's pieces are boxed where they start. With
    /// connecting inline, each of these was over 3.5 KiB (`docs/dev/benchmarks-journal.md`,
    /// "Futures copied whole").
    #[test]
    fn the_per_request_operations_futures_stay_small() {
        // Never connected: the futures are made, measured and dropped.
        let config = StoreConfig {
            backend: Backend::Redis,
            url: "redis://127.0.0.1:1".into(),
            key_prefix: "idem".into(),
            op_timeout: Duration::from_millis(500),
            password_file: None,
            mode: RedisMode::Standalone,
            nodes: Vec::new(),
            sentinels: Vec::new(),
            master_name: None,
            username: None,
            tls_ca_file: None,
            wait_replicas: 1,
            wait_timeout: Duration::from_millis(500),
            memory_limit: 0,
            encryption_key_file: None,
            require_sealed: false,
            sslmode: SslMode::Disable,
            table: "idempotency_records".into(),
            pool_size: 1,
        };
        let store = RedisStore::new(&config, 1).unwrap();
        let (lease, token) = (Duration::from_secs(1), Token([7; 16]));
        let steps = Deadlines::new(lease);
        let taken = std::sync::atomic::AtomicBool::new(false);
        let sizes = [
            (
                "reserve",
                size_of_val(&store.reserve("k", Bytes::new(), lease, 1, &taken)),
            ),
            (
                "complete",
                size_of_val(&store.complete("k", token, Bytes::new(), lease, &steps)),
            ),
            ("renew", size_of_val(&store.renew("k", token, lease))),
            ("release", size_of_val(&store.release("k", token))),
        ];
        for (op, size) in sizes {
            assert!(size <= 1024, "{op}'s future is {size} bytes");
        }
    }
}
