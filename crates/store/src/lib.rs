//! idemproxy's store, as a library of its own: what is kept under a key
//! (`record`, sealed at rest by `seal`), and the store that keeps it, one
//! key per operation, the same semantics on its three backends: in memory (`memory`), Redis — single, Sentinel or Cluster
//! (`redis`, `redis_connections`, `redis_conn`, `ops`, `pieces`) — and
//! PostgreSQL (`postgres`).
//!
//! Values are encoded [`Record`]s. Every operation touches exactly one key
//! (one round trip, but for a large record's pieces), so the code is the
//! same on a single Redis, Sentinel or Cluster; every operation is safe to
//! send twice.
//!
//! With `[store] encryption_key_file`, finished records are sealed here, the
//! same on every backend ([`Store::encode`]), and opened where they are
//! decoded. The associated data is the record id (with the record's clear
//! head, see `record`): the store key is always `{prefix}:{id}`
//! ([`Store::key_for`]), and the id is what follows the prefix.

#![forbid(unsafe_code)]

// What is kept, and how it is sealed.
pub mod record;
pub mod seal;
// What the store is told, and what it shares with the proxy's workers.
pub mod config;
pub mod deadline;
pub mod per_worker;

mod backend;
mod cluster;
mod error;
mod memory;
mod ops;
mod pieces;
pub mod postgres;
mod redis;
mod redis_conn;
mod redis_connections;
mod reply;
mod sentinel;
mod settings;
pub mod wire;

/// The most of a record one command or reply carries (`pieces` writes and
/// reads larger ones piece by piece; `wire` refuses a longer bulk reply).
pub const PIECE: usize = 256 * 1024;

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::config::{Backend, StoreConfig};
use crate::deadline::Deadlines;
use crate::per_worker::PerWorker;
use crate::record::{DecodeError, Head, Record, Token, MAX_BODY, MAX_OVERHEAD};
use crate::seal::{SealError, Sealing};

pub(crate) use self::backend::{Occupant, Operations};
pub use self::error::{StoreError, StoreSetupError};

/// Where the store reports each operation's time and outcome (the proxy's
/// Prometheus metrics).
pub trait StoreMetrics: Send + Sync {
    /// One operation `op` took `took`; `ok` unless the store failed it.
    fn store_op(&self, op: &'static str, took: Duration, ok: bool);
    /// A sweep of expired records failed (PostgreSQL).
    fn store_sweep_failed(&self);
}

/// Appends a digest in lower-case hex: the `hex` crate's encoder goes through
/// a char iterator (1.7k instructions for 32 bytes, callgrind); this is a
/// table lookup.
pub fn push_hex(out: &mut String, digest: &[u8; 32]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut hex = [0u8; 64];
    for (pair, &b) in hex.chunks_exact_mut(2).zip(digest) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0xf)];
    }
    out.push_str(std::str::from_utf8(&hex).expect("hex digits are ASCII"));
}
pub(crate) use self::memory::MemoryStore;
pub(crate) use self::postgres::PostgresStore;
pub(crate) use self::redis::RedisStore;

/// What `reserve` found, decoded: the store's one answer to a reserve (the
/// proxy judges it into a `Verdict`, `proxy::reserve`).
#[derive(Debug)]
pub enum Reservation {
    /// The key was free and is ours now.
    Reserved,
    /// A record holds the key (whose it is, the caller decides: a re-sent
    /// reserve finds the caller's own). `ttl` is what is left of its lease or
    /// TTL when the backend learnt it for free; `None` otherwise (see [`Store::pttl`]).
    Existing {
        record: Record,
        ttl: Option<Duration>,
    },
    /// A value holds the key that this build cannot decode: not ours, and not
    /// to be overwritten or bypassed (the operation may have run).
    Unreadable(DecodeError),
    /// A record larger than [`INLINE_RECORD`] holds the key: its clear
    /// head came with the reserve's answer, which is all a 409, 410 or 422
    /// needs; a replay fetches it whole with [`Store::get`] once there is
    /// room for `len` bytes.
    Large { len: u64, head: Head },
}

/// A record's store key (`prefix:id`) and where its id begins; clones share it.
#[derive(Clone, Debug)]
pub struct RecordKey {
    key: Arc<str>,
    id_at: usize,
}

impl RecordKey {
    /// The key in the store.
    pub fn as_str(&self) -> &str {
        &self.key
    }

    /// The record id (what follows the prefix), as logs and the admin API name it.
    pub fn id(&self) -> &str {
        &self.key[self.id_at..]
    }
}

/// What `complete` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    Stored,
    /// Stored, though our lease had run out (nobody else had taken the key).
    StoredAfterExpiry,
    /// Another owner holds the key; nothing was written.
    Refused,
    /// Written on the master, but fewer than `wait_replicas` replicas
    /// acknowledged it in time (or `WAIT` failed): a failover now could bring
    /// back the `processing` reservation, so the owner writes it again.
    Unreplicated {
        wanted: u32,
        acked: u32,
    },
}

/// A record read whole, with its remaining lease or TTL.
#[derive(Debug)]
pub struct Inspected {
    pub record: Record,
    pub ttl: Duration,
}

/// The largest record a reserve brings back with its answer; a larger one is
/// fetched only once there is room for it in the memory budget (docs/reference/store.md#pieces).
pub const INLINE_RECORD: u64 = 64 * 1024;

/// How many larger records one proxy reads from the store at a time; the
/// others wait their turn (first come, first served) before they take room
/// for the record.
/// Redis is single-threaded and shared: two reads keep large replays' pace
/// (one alone is latency-bound at about half of it) while leaving it free
/// for small keys' reserves and completions, which otherwise queue behind
/// a stream of 256 KiB pieces (`docs/dev/benchmarks-journal.md`, "Large replays").
pub const LARGE_READS: usize = 2;

/// Runs `op` up to `attempts` times, doubling a pause of `first_pause` between
/// attempts (none after the last: a failure is reported at once).
pub async fn retry<T, F, Fut>(
    attempts: u32,
    first_pause: Duration,
    mut op: F,
) -> Result<T, StoreError>
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut pause = first_pause;
    let mut attempt = 1;
    loop {
        match op(attempt).await {
            Err(_) if attempt < attempts => {
                tokio::time::sleep(pause).await;
                pause *= 2;
                attempt += 1;
            }
            done => return done,
        }
    }
}

enum Inner {
    Memory(MemoryStore),
    Redis(Box<RedisStore>),
    Postgres(Box<PostgresStore>),
}

/// A future that calls the same [`Operations`] method on whichever backend this is.
macro_rules! backend {
    ($inner:expr, $b:ident => $call:expr) => {
        async {
            match $inner {
                Inner::Memory($b) => $call.await,
                Inner::Redis($b) => $call.await,
                Inner::Postgres($b) => $call.await,
            }
        }
    };
}

/// The store used by the proxy: timing, timeouts and metrics around a backend.
pub struct Store {
    inner: Inner,
    prefix: String,
    /// Every operation's `op_timeout`, kept by one timer per worker thread.
    deadlines: PerWorker<Deadlines>,
    metrics: Arc<dyn StoreMetrics>,
    /// The keys that seal finished records, when a key file is configured.
    sealing: Option<Sealing>,
    /// A finished record that is not sealed is unreadable (`require_sealed`).
    require_sealed: bool,
    /// The longest record the proxy writes ([`Store::limit_records`]): the
    /// store's word for a longer one is not believed
    /// (docs/reference/store.md#untrusted-replies, the store's bytes
    /// are untrusted), so nothing is allocated for it.
    record_limit: AtomicU64,
}

impl Store {
    /// The store `cfg` describes; `slots`: per-worker places for its
    /// connections and timers (`ServerConfig::worker_slots`; 1 outside a server).
    pub fn new(
        cfg: &StoreConfig,
        metrics: Arc<dyn StoreMetrics>,
        slots: usize,
    ) -> Result<Store, StoreSetupError> {
        let sealing = cfg
            .encryption_key_file
            .as_deref()
            .map(Sealing::load)
            .transpose()?;
        if let Some(keys) = sealing.as_ref().map(Sealing::keys) {
            tracing::info!(
                keys = keys.ids().count(),
                sealing_key_id = keys.sealing_id(),
                "finished records are sealed at rest (encryption_key_file)"
            );
        }
        let inner = match cfg.backend {
            Backend::Memory => Inner::Memory(MemoryStore::new(cfg.memory_limit)),
            Backend::Redis => Inner::Redis(Box::new(RedisStore::new(cfg, slots)?)),
            Backend::Postgres => Inner::Postgres(Box::new(PostgresStore::new(cfg, slots)?)),
        };
        Ok(Store {
            inner,
            prefix: cfg.key_prefix.clone(),
            deadlines: PerWorker::new(slots, |_| Deadlines::new(cfg.op_timeout)),
            metrics,
            sealing,
            require_sealed: cfg.require_sealed,
            record_limit: AtomicU64::new(MAX_BODY + MAX_OVERHEAD),
        })
    }

    /// Records are at most `max_body` (the largest `max_response_body` of
    /// the routes) plus a record's overhead: a store that says a record is
    /// longer is not believed. Until this is called, the limit is the
    /// largest body any configuration allows.
    pub fn limit_records(&self, max_body: u64) {
        self.record_limit
            .store(max_body.saturating_add(MAX_OVERHEAD), Ordering::Relaxed);
    }

    /// After a reload: a larger `max_body` raises the limit, a smaller one
    /// leaves it, so that the records written before stay readable.
    pub fn raise_record_limit(&self, max_body: u64) {
        self.record_limit
            .fetch_max(max_body.saturating_add(MAX_OVERHEAD), Ordering::Relaxed);
    }

    /// The longest record believed.
    pub fn record_limit(&self) -> u64 {
        self.record_limit.load(Ordering::Relaxed)
    }

    /// The keys and their file, when records are sealed (for reloads on SIGHUP).
    pub fn sealing(&self) -> Option<&Sealing> {
        self.sealing.as_ref()
    }

    /// The record id of a store key made by [`Store::key_for`].
    fn record_id<'k>(&self, key: &'k str) -> &'k str {
        key.strip_prefix(self.prefix.as_str())
            .and_then(|id| id.strip_prefix(':'))
            .unwrap_or(key)
    }

    /// The value to store under `key`: a finished record sealed with the
    /// first key of the key file, when there is one; clear otherwise.
    pub fn encode(&self, key: &str, record: &Record) -> Result<Bytes, SealError> {
        match &self.sealing {
            Some(sealing) => record.seal(&sealing.keys(), self.record_id(key)),
            None => Ok(record.encode()),
        }
    }

    /// Does the key file hold the key `id` (a record sealed under it opens)?
    fn opens(&self, id: &str) -> bool {
        self.sealing
            .as_ref()
            .is_some_and(|s| s.keys().ids().any(|k| k == id))
    }

    /// A value read from `key`, opened when it is sealed. With
    /// `require_sealed`, a finished record in the clear is not an answer:
    /// someone who can write to the store may have planted it.
    fn decode(&self, key: &str, value: Bytes) -> Result<Record, DecodeError> {
        let sealed = crate::record::is_sealed(&value);
        let keys = self.sealing.as_ref().map(Sealing::keys);
        let record = Record::open(value, keys.as_deref(), self.record_id(key))?;
        if self.require_sealed && !sealed && matches!(record, Record::Finished(_)) {
            return Err(DecodeError::NotSealed);
        }
        Ok(record)
    }

    pub fn is_memory(&self) -> bool {
        matches!(self.inner, Inner::Memory(_))
    }

    /// Can requests use the store? False only for a PostgreSQL table found
    /// not as the proxy needs it (UNLOGGED, its key gone) since the start:
    /// the proxy is then not ready, until the table is right again.
    pub fn usable(&self) -> bool {
        match &self.inner {
            Inner::Postgres(p) => p.table_ok(),
            _ => true,
        }
    }

    /// PostgreSQL: is the table there, and as the proxy needs it? `Ok` for
    /// the other stores, and when PostgreSQL cannot be reached (the proxy
    /// starts, not ready, as with an unreachable Redis, and checks the
    /// table when the server first answers; no request's statement is sent
    /// before).
    pub async fn check_schema(&self) -> Result<(), StoreSetupError> {
        let Inner::Postgres(p) = &self.inner else {
            return Ok(());
        };
        match p.check_schema().await {
            Ok(()) => Ok(()),
            Err(postgres::SchemaProblem::Unreachable(e)) => {
                tracing::warn!(error = %e, "PostgreSQL cannot be reached yet: the table is checked when it first answers, and protected routes answer 503 until then");
                Ok(())
            }
            Err(e) => Err(StoreSetupError::Schema(e.to_string())),
        }
    }

    /// PostgreSQL: one sweep of the expired rows now (in batches); how many
    /// went. Nothing to do for the other stores.
    pub async fn sweep_expired_once(&self) -> Result<u64, StoreError> {
        match &self.inner {
            Inner::Postgres(p) => p.sweep().await,
            _ => Ok(0),
        }
    }

    /// PostgreSQL: deletes expired rows every [`postgres::SWEEP_EVERY`], in
    /// batches; runs until dropped. Returns at once for the other stores
    /// (Redis and memory expire keys themselves).
    pub async fn sweep_expired(&self) {
        let Inner::Postgres(p) = &self.inner else {
            return;
        };
        loop {
            tokio::time::sleep(postgres::SWEEP_EVERY).await;
            // The table is checked again first: one turned UNLOGGED (or
            // without its key) while the proxy runs is noticed here.
            p.recheck().await;
            match p.sweep().await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(rows = n, "expired records deleted"),
                Err(e) => {
                    self.metrics.store_sweep_failed();
                    tracing::warn!(error = %e, "deleting expired records failed; trying again later")
                }
            }
        }
    }

    /// The store key of the record whose id is `digest` in hex, made once per
    /// request and shared (a reference count) by its phases, its claim and
    /// its log line.
    pub fn record_key(&self, digest: &[u8; 32]) -> RecordKey {
        let mut k = String::with_capacity(self.prefix.len() + 1 + 64);
        k.push_str(&self.prefix);
        k.push(':');
        crate::push_hex(&mut k, digest);
        RecordKey {
            id_at: self.prefix.len() + 1,
            key: Arc::from(k),
        }
    }

    /// The store key for a record id: `{prefix}:{id}`. The id is a hash, never the raw key.
    pub fn key_for(&self, id: &str) -> String {
        let mut k = String::with_capacity(self.prefix.len() + 1 + id.len());
        k.push_str(&self.prefix);
        k.push(':');
        k.push_str(id);
        k
    }

    /// An operation with its timeout, its metric and the reconnect count.
    /// The backend's future is boxed here, in a plain function: it is the
    /// large part (the client's command and connection futures), and the
    /// request's own future would otherwise carry it, and copy it whole.
    fn timed<'a, T: 'a, F>(
        &'a self,
        op: &'static str,
        fut: F,
    ) -> impl std::future::Future<Output = Result<T, StoreError>> + 'a
    where
        F: std::future::Future<Output = Result<T, StoreError>> + Send + 'a,
    {
        self.timed_from(None, op, fut)
    }

    /// [`Store::timed`], its time counted from `start` when the caller has
    /// read the clock already (`None`: from now).
    fn timed_from<'a, T: 'a, F>(
        &'a self,
        start: Option<tokio::time::Instant>,
        op: &'static str,
        fut: F,
    ) -> impl std::future::Future<Output = Result<T, StoreError>> + 'a
    where
        F: std::future::Future<Output = Result<T, StoreError>> + Send + 'a,
    {
        let fut: Pin<Box<dyn std::future::Future<Output = Result<T, StoreError>> + Send + 'a>> =
            Box::pin(fut);
        self.timed_boxed(start, op, fut, Some(Duration::ZERO))
    }

    /// How much longer than `op_timeout` a reservation may take: a Redis
    /// store with `wait_replicas` sends `WAIT`, which the server holds for up
    /// to `wait_timeout` (cut at `op_timeout`, a `wait_timeout` as long would
    /// refuse every reservation the replicas are that slow to acknowledge).
    fn reserve_allowance(&self) -> Duration {
        match &self.inner {
            Inner::Redis(r) if r.wait_replicas > 0 => r.wait_timeout,
            _ => Duration::ZERO,
        }
    }

    /// An operation of several round trips, each bounded by `op_timeout` in
    /// the backend (a large record's pieces, `WAIT`): its metric and the
    /// reconnect count, no bound on the whole.
    fn in_steps<'a, T: 'a, F>(
        &'a self,
        op: &'static str,
        fut: F,
    ) -> impl std::future::Future<Output = Result<T, StoreError>> + 'a
    where
        F: std::future::Future<Output = Result<T, StoreError>> + Send + 'a,
    {
        let fut: Pin<Box<dyn std::future::Future<Output = Result<T, StoreError>> + Send + 'a>> =
            Box::pin(fut);
        self.timed_boxed(None, op, fut, None)
    }

    async fn timed_boxed<T>(
        &self,
        start: Option<tokio::time::Instant>,
        op: &'static str,
        fut: Pin<Box<dyn std::future::Future<Output = Result<T, StoreError>> + Send + '_>>,
        // `op_timeout` and this much more; `None`: no bound on the whole.
        bound: Option<Duration>,
    ) -> Result<T, StoreError> {
        let start = start.unwrap_or_else(tokio::time::Instant::now);
        let res = match bound {
            Some(extra) if extra.is_zero() => {
                let deadlines = self.deadlines.get();
                let timeout = deadlines.after();
                match deadlines.within(start, fut).await {
                    Some(r) => r,
                    None => Err(StoreError::Timeout(timeout)),
                }
            }
            Some(extra) => {
                let timeout = self.deadlines.get().after() + extra;
                match tokio::time::timeout_at(start + timeout, fut).await {
                    Ok(r) => r,
                    Err(_) => Err(StoreError::Timeout(timeout)),
                }
            }
            None => fut.await,
        };
        // A decode error is an answer from a live store.
        let store_ok = !matches!(
            res,
            Err(StoreError::Timeout(_)
                | StoreError::Backend(_)
                | StoreError::Unavailable(_)
                | StoreError::Untrue(_))
        );
        if let Inner::Redis(r) = &self.inner {
            r.note_result(matches!(
                res,
                Err(StoreError::Timeout(_) | StoreError::Unavailable(_))
            ));
        }
        self.metrics.store_op(op, start.elapsed(), store_ok);
        res
    }

    /// Reserves `key` with a lease, or returns the record that holds it.
    pub async fn reserve(
        &self,
        key: &str,
        processing: Bytes,
        lease: Duration,
    ) -> Result<Reservation, StoreError> {
        self.reserve_at(tokio::time::Instant::now(), key, processing, lease)
            .await
    }

    /// [`Store::reserve`] sent at `sent_at`, a clock the caller has read
    /// already (for its lease): `op_timeout` counts from it too.
    pub async fn reserve_at(
        &self,
        sent_at: tokio::time::Instant,
        key: &str,
        processing: Bytes,
        lease: Duration,
    ) -> Result<Reservation, StoreError> {
        // Set once the store has said the key is taken: an error after that
        // (a later round trip, or `op_timeout` running out during it) is not
        // a store that may be passed by.
        let taken = AtomicBool::new(false);
        let reserve =
            backend!(&self.inner, b => b.reserve(key, processing, lease, INLINE_RECORD, &taken));
        let reserve: Pin<Box<dyn std::future::Future<Output = _> + Send + '_>> = Box::pin(reserve);
        let found = self
            .timed_boxed(
                Some(sent_at),
                "reserve",
                reserve,
                Some(self.reserve_allowance()),
            )
            .await
            .map_err(|e| match taken.load(Ordering::Relaxed) {
                true => StoreError::Taken(Box::new(e)),
                false => e,
            })?;
        match found {
            None => Ok(Reservation::Reserved),
            Some(Occupant::Large { len, .. }) if len > self.record_limit() => {
                Err(StoreError::Untrue(format!(
                    "a record of {len} bytes; none is over {}",
                    self.record_limit()
                )))
            }
            Some(Occupant::Large { len, start }) => Ok(self.large(len, start)),
            Some(Occupant::Value { value, ttl }) => Ok(match self.decode(key, value) {
                Ok(record) => Reservation::Existing { record, ttl },
                Err(e) => Reservation::Unreadable(e),
            }),
        }
    }

    /// A large record found by a reserve, judged from its head (409, 410,
    /// 422), which came with the reserve's answer.
    fn large(&self, len: u64, start: Bytes) -> Reservation {
        match Head::decode(start) {
            // With `require_sealed`, a finished one in the clear is
            // unreadable from its head too.
            Ok(head)
                if self.require_sealed && head.finished.is_some() && head.sealed_with.is_none() =>
            {
                Reservation::Unreadable(DecodeError::NotSealed)
            }
            // Sealed under a key this proxy does not hold: unreadable, as
            // the whole record would be (the head's own bytes are only
            // authenticated when the seal is opened, for a replay).
            Ok(head)
                if head
                    .sealed_with
                    .as_deref()
                    .is_some_and(|id| !self.opens(id)) =>
            {
                Reservation::Unreadable(match (&self.sealing, head.sealed_with) {
                    (Some(_), Some(id)) => DecodeError::UnknownKey(id),
                    _ => DecodeError::NoKeyFile,
                })
            }
            Ok(head) => Reservation::Large { len, head },
            Err(e) => Reservation::Unreadable(e),
        }
    }

    /// The remaining lease or TTL of a key (for `Retry-After`).
    pub async fn pttl(&self, key: &str) -> Result<Duration, StoreError> {
        self.timed("pttl", backend!(&self.inner, b => b.pttl(key)))
            .await
    }

    pub async fn complete(
        &self,
        key: &str,
        token: Token,
        finished: Bytes,
        ttl: Duration,
    ) -> Result<Completion, StoreError> {
        let steps = self.deadlines.get();
        self.in_steps(
            "complete",
            backend!(&self.inner, b => b.complete(key, token, finished, ttl, steps)),
        )
        .await
    }

    /// Extends our lease; false when the key is no longer ours.
    pub async fn renew(
        &self,
        key: &str,
        token: Token,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.timed(
            "renew",
            backend!(&self.inner, b => b.renew(key, token, lease)),
        )
        .await
    }

    /// Takes over the reservation of `dead`, an owner whose lease ran out
    /// (no more than `afterlife` left of its time): `value` is written in
    /// its place for `hold`. False when the key holds something else now,
    /// or its owner renewed it (docs/reference/behaviour.md#dead-owner).
    pub async fn take_over(
        &self,
        key: &str,
        dead: Token,
        afterlife: Duration,
        value: Bytes,
        hold: Duration,
    ) -> Result<bool, StoreError> {
        self.timed(
            "take_over",
            backend!(&self.inner, b => b.take_over(key, dead, afterlife, value, hold)),
        )
        .await
    }

    /// Frees our reservation so that a retry re-executes; false when it was not ours.
    pub async fn release(&self, key: &str, token: Token) -> Result<bool, StoreError> {
        self.timed("release", backend!(&self.inner, b => b.release(key, token)))
            .await
    }

    /// Reads a record whole, opened when it is sealed (a large record's
    /// replay); each round trip within its own `op_timeout`.
    pub async fn get(&self, key: &str) -> Result<Option<Inspected>, StoreError> {
        let steps = self.deadlines.get();
        let found = self
            .in_steps(
                "get",
                backend!(&self.inner, b => b.get(key, self.record_limit(), steps)),
            )
            .await?;
        match found {
            None => Ok(None),
            Some((value, ttl)) => Ok(Some(Inspected {
                record: self.decode(key, value)?,
                ttl,
            })),
        }
    }

    /// Reads a record's clear head and its remaining time (admin API): a
    /// sealed record is not opened, so its answer is never at hand.
    pub async fn peek(&self, key: &str) -> Result<Option<(Head, Duration)>, StoreError> {
        let steps = self.deadlines.get();
        let found = self
            .in_steps(
                "get",
                backend!(&self.inner, b => b.get(key, self.record_limit(), steps)),
            )
            .await?;
        match found {
            None => Ok(None),
            Some((value, ttl)) => Ok(Some((Head::decode(value)?, ttl))),
        }
    }

    /// Removes a record whatever its state (admin API); true when there was one.
    pub async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.timed("delete", backend!(&self.inner, b => b.delete(key)))
            .await
    }

    /// A health check; also loads the scripts, so that the first request is
    /// not slowed by it. PostgreSQL: first the table's check, when it has not
    /// passed yet (outside `op_timeout`: it has a bound of its own).
    pub async fn ping(&self) -> Result<(), StoreError> {
        if let Inner::Postgres(p) = &self.inner {
            p.check_pending().await?;
        }
        self.timed("ping", backend!(&self.inner, b => b.ping()))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn retry_pauses_between_attempts_and_not_after_the_last() {
        let start = tokio::time::Instant::now();
        let mut tries = Vec::new();
        let r: Result<(), _> = retry(3, Duration::from_millis(25), |attempt| {
            tries.push(attempt);
            async { Err(StoreError::Backend("down".into())) }
        })
        .await;
        assert!(r.is_err());
        assert_eq!(tries, [1, 2, 3]);
        assert_eq!(start.elapsed(), Duration::from_millis(25 + 50));
    }

    #[tokio::test(start_paused = true)]
    async fn retry_stops_at_the_first_success() {
        let start = tokio::time::Instant::now();
        let r = retry(3, Duration::from_millis(25), |attempt| async move {
            if attempt == 2 {
                Ok(attempt)
            } else {
                Err(StoreError::Backend("down".into()))
            }
        })
        .await;
        assert_eq!(r.unwrap(), 2);
        assert_eq!(start.elapsed(), Duration::from_millis(25));
    }
}
