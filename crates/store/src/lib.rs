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
pub mod files;
pub mod per_worker;

mod backend;
mod cluster;
mod codec;
mod error;
mod keys;
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
mod timing;
pub mod wire;

/// The most of a record one command or reply carries (`pieces` writes and
/// reads larger ones piece by piece; `wire` refuses a longer bulk reply).
pub(crate) const PIECE: usize = 256 * 1024;

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::config::{Backend, StoreConfig};
use crate::deadline::Deadlines;
use crate::per_worker::PerWorker;
use crate::record::{DecodeError, Head, Record, Token, MAX_BODY, MAX_OVERHEAD};
use crate::seal::Sealing;

pub(crate) use self::backend::{Occupant, Operations};
pub use self::error::{StoreError, StoreSetupError};
pub use self::keys::{push_hex, RecordKey};
pub use self::settings::check_ca_file;
pub use self::timing::{retry, StoreMetrics};

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
