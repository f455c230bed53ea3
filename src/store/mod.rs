//! The store: one key per operation, the same semantics on Redis and in memory.
//!
//! Values are encoded [`Record`]s. Every operation is one round trip and
//! touches exactly one key, so the code is the same on a single Redis,
//! Sentinel or Cluster; every operation is safe to send twice.

mod memory;
mod redis;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::config::{Backend, StoreConfig};
use crate::metrics::Metrics;
use crate::record::{DecodeError, Record, Token};

pub use self::memory::MemoryStore;
pub use self::redis::RedisStore;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store operation timed out after {0:?}")]
    Timeout(Duration),
    #[error("store error: {0}")]
    Backend(String),
    /// The connection is broken, refused, or reaches a master that is no longer one.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// `wait_replicas` was not met: the reservation was withdrawn.
    #[error("reservation reached {acked} of {wanted} replicas in time")]
    NotReplicated { wanted: u32, acked: u32 },
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

#[derive(Debug, thiserror::Error)]
pub enum StoreSetupError {
    #[error("cannot read the Redis password file {path}: {source}")]
    PasswordFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("invalid Redis configuration: {0}")]
    Redis(String),
    #[error("cannot read the Redis CA file {path}: {source}")]
    CaFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// What `reserve` found.
#[derive(Debug)]
pub enum Reservation {
    /// The key is ours now.
    Reserved,
    /// Somebody's record holds the key; `ttl` is what is left of its lease (for a
    /// record in flight; zero for a finished one when the store did not say).
    Existing { record: Record, ttl: Duration },
}

/// What `complete` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    Stored,
    /// Stored, though our lease had run out (nobody else had taken the key).
    StoredAfterExpiry,
    /// Another owner holds the key; nothing was written.
    Refused,
}

/// A snapshot for the admin API.
#[derive(Debug)]
pub struct Inspected {
    pub record: Record,
    pub ttl: Duration,
}

enum Inner {
    Memory(MemoryStore),
    Redis(Box<RedisStore>),
}

/// The store used by the proxy: timing, timeouts and metrics around a backend.
pub struct Store {
    inner: Inner,
    prefix: String,
    op_timeout: Duration,
    metrics: Arc<Metrics>,
}

impl Store {
    pub fn new(cfg: &StoreConfig, metrics: Arc<Metrics>) -> Result<Store, StoreSetupError> {
        let inner = match cfg.backend {
            Backend::Memory => Inner::Memory(MemoryStore::new()),
            Backend::Redis => Inner::Redis(Box::new(RedisStore::new(cfg)?)),
        };
        Ok(Store {
            inner,
            prefix: cfg.key_prefix.clone(),
            op_timeout: cfg.op_timeout,
            metrics,
        })
    }

    pub fn is_memory(&self) -> bool {
        matches!(self.inner, Inner::Memory(_))
    }

    /// The store key for a record id: `{prefix}:{id}`. The id is a hash, never the raw key.
    pub fn key_for(&self, id: &str) -> String {
        let mut k = String::with_capacity(self.prefix.len() + 1 + id.len());
        k.push_str(&self.prefix);
        k.push(':');
        k.push_str(id);
        k
    }

    async fn timed<T, F>(&self, op: &'static str, fut: F) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, StoreError>>,
    {
        let start = Instant::now();
        let res = match tokio::time::timeout(self.op_timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout(self.op_timeout)),
        };
        // A decode error is an answer from a live store.
        let store_ok = !matches!(
            res,
            Err(StoreError::Timeout(_) | StoreError::Backend(_) | StoreError::Unavailable(_))
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

    /// Reserves `key` for `token` with a lease, or returns the record that holds it.
    pub async fn reserve(
        &self,
        key: &str,
        processing: Bytes,
        token: Token,
        lease: Duration,
    ) -> Result<Reservation, StoreError> {
        let found = self
            .timed("reserve", async {
                match &self.inner {
                    Inner::Memory(m) => Ok(m
                        .reserve(key, processing, lease)
                        .map(|(v, ttl)| (v, Some(ttl)))),
                    Inner::Redis(r) => {
                        Ok(r.reserve(key, processing, lease).await?.map(|v| (v, None)))
                    }
                }
            })
            .await?;
        let Some((value, ttl)) = found else {
            return Ok(Reservation::Reserved);
        };
        let record = Record::decode(value)?;
        // A re-sent reserve finds our own reservation.
        if matches!(&record, Record::Processing(p) if p.token == token) {
            return Ok(Reservation::Reserved);
        }
        // Only a request in flight needs the remaining lease (for Retry-After):
        // replays and mismatches stay at one round trip.
        let ttl = match (ttl, &record) {
            (Some(ttl), _) => ttl,
            (None, Record::Processing(_)) => self.pttl(key).await?,
            (None, Record::Finished(_)) => Duration::ZERO,
        };
        Ok(Reservation::Existing { record, ttl })
    }

    /// The remaining lease or TTL of a key.
    async fn pttl(&self, key: &str) -> Result<Duration, StoreError> {
        self.timed("pttl", async {
            match &self.inner {
                Inner::Memory(m) => Ok(m.get(key).map_or(Duration::ZERO, |(_, ttl)| ttl)),
                Inner::Redis(r) => r.pttl(key).await,
            }
        })
        .await
    }

    pub async fn complete(
        &self,
        key: &str,
        token: Token,
        finished: Bytes,
        ttl: Duration,
    ) -> Result<Completion, StoreError> {
        self.timed("complete", async {
            match &self.inner {
                Inner::Memory(m) => Ok(m.complete(key, token, finished, ttl)),
                Inner::Redis(r) => r.complete(key, token, finished, ttl).await,
            }
        })
        .await
    }

    /// Extends our lease; false when the key is no longer ours.
    pub async fn renew(
        &self,
        key: &str,
        token: Token,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.timed("renew", async {
            match &self.inner {
                Inner::Memory(m) => Ok(m.renew(key, token, lease)),
                Inner::Redis(r) => r.renew(key, token, lease).await,
            }
        })
        .await
    }

    /// Frees our reservation so that a retry re-executes; false when it was not ours.
    pub async fn release(&self, key: &str, token: Token) -> Result<bool, StoreError> {
        self.timed("release", async {
            match &self.inner {
                Inner::Memory(m) => Ok(m.release(key, token)),
                Inner::Redis(r) => r.release(key, token).await,
            }
        })
        .await
    }

    /// Reads a record (admin API, and waiting duplicates).
    pub async fn get(&self, key: &str) -> Result<Option<Inspected>, StoreError> {
        let found = self
            .timed("get", async {
                match &self.inner {
                    Inner::Memory(m) => Ok(m.get(key)),
                    Inner::Redis(r) => r.get(key).await,
                }
            })
            .await?;
        match found {
            None => Ok(None),
            Some((value, ttl)) => Ok(Some(Inspected {
                record: Record::decode(value)?,
                ttl,
            })),
        }
    }

    /// Removes a record whatever its state (admin API); true when there was one.
    pub async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.timed("delete", async {
            match &self.inner {
                Inner::Memory(m) => Ok(m.delete(key)),
                Inner::Redis(r) => r.delete(key).await,
            }
        })
        .await
    }

    /// A health check; also loads the scripts, so that the first request is not slowed by it.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.timed("ping", async {
            match &self.inner {
                Inner::Memory(_) => Ok(()),
                Inner::Redis(r) => r.ping().await,
            }
        })
        .await
    }
}
