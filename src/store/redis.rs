//! The Redis store: a multiplexed, reconnecting connection and four small Lua scripts beside this file.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{LazyLock, RwLock};
use std::time::Duration;

use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{IntoConnectionInfo, Script};

use super::{Completion, StoreError, StoreSetupError};
use crate::config::StoreConfig;
use crate::record::Token;

static RESERVE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("reserve.lua")));
static COMPLETE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("complete.lua")));
static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("renew.lua")));
static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("release.lua")));

/// The env var that carries the Redis password (wins over `password_file`).
pub const PASSWORD_ENV: &str = "IDEMPROXY_REDIS_PASSWORD";

/// After this many store timeouts in a row the connection is replaced: a
/// blackholed TCP connection (a partition, a failover without a reset) never
/// errors by itself, and the client only reconnects on I/O errors.
const TIMEOUTS_BEFORE_RECONNECT: u32 = 2;

pub struct RedisStore {
    client: redis::Client,
    config: ConnectionManagerConfig,
    conn: RwLock<ConnectionManager>,
    timeouts_in_a_row: AtomicU32,
    op_timeout: Duration,
}

fn ms(d: Duration) -> u64 {
    (d.as_millis() as u64).max(1)
}

impl RedisStore {
    /// Builds the client without connecting: an unreachable store is not a start-up failure.
    pub fn new(cfg: &StoreConfig) -> Result<Self, StoreSetupError> {
        let mut info = cfg
            .url
            .as_str()
            .into_connection_info()
            .map_err(|e| StoreSetupError::Redis(format!("invalid Redis URL: {e}")))?;
        let mut settings = info.redis_settings().clone();
        if let Some(user) = &cfg.username {
            settings = settings.set_username(user);
        }
        let password = match (std::env::var(PASSWORD_ENV), &cfg.password_file) {
            (Ok(p), _) if !p.is_empty() => Some(p),
            (_, Some(path)) => Some(
                std::fs::read_to_string(path)
                    .map_err(|source| StoreSetupError::PasswordFile {
                        path: path.clone(),
                        source,
                    })?
                    .trim_end_matches(['\r', '\n'])
                    .to_string(),
            ),
            _ => None,
        };
        if let Some(p) = password {
            settings = settings.set_password(p);
        }
        info = info.set_redis_settings(settings);
        let client =
            redis::Client::open(info).map_err(|e| StoreSetupError::Redis(e.to_string()))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(cfg.op_timeout))
            .set_response_timeout(Some(cfg.op_timeout))
            .set_max_delay(Duration::from_secs(1));
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
            .map_err(|e| StoreSetupError::Redis(e.to_string()))?;
        Ok(RedisStore {
            client,
            config,
            conn: RwLock::new(conn),
            timeouts_in_a_row: AtomicU32::new(0),
            op_timeout: cfg.op_timeout,
        })
    }

    /// A client error as a store error; the client's own response timeout counts as a timeout.
    /// (The crate's messages can carry addresses: callers log them, problems never show them.)
    fn backend(&self, e: redis::RedisError) -> StoreError {
        if e.is_timeout() {
            StoreError::Timeout(self.op_timeout)
        } else {
            StoreError::Backend(e.to_string())
        }
    }

    /// The shared multiplexed connection (a cheap handle).
    fn conn(&self) -> ConnectionManager {
        self.conn.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Told after every operation whether it timed out; replaces a connection that keeps timing out.
    pub fn note_timeout(&self, timed_out: bool) {
        if !timed_out {
            self.timeouts_in_a_row.store(0, Ordering::Relaxed);
            return;
        }
        if self.timeouts_in_a_row.fetch_add(1, Ordering::Relaxed) + 1 < TIMEOUTS_BEFORE_RECONNECT {
            return;
        }
        self.timeouts_in_a_row.store(0, Ordering::Relaxed);
        match ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone()) {
            Ok(fresh) => {
                tracing::warn!("store keeps timing out; replacing the connection");
                *self.conn.write().unwrap_or_else(|e| e.into_inner()) = fresh;
            }
            Err(e) => tracing::warn!(error = %e, "cannot replace the store connection"),
        }
    }

    pub async fn reserve(
        &self,
        key: &str,
        value: Bytes,
        lease: Duration,
    ) -> Result<Option<(Bytes, Duration)>, StoreError> {
        let mut conn = self.conn();
        let found: Option<(Vec<u8>, i64)> = RESERVE
            .key(key)
            .arg(value.as_ref())
            .arg(ms(lease))
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        Ok(found.map(|(v, pttl)| (Bytes::from(v), Duration::from_millis(pttl.max(0) as u64))))
    }

    pub async fn complete(
        &self,
        key: &str,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> Result<Completion, StoreError> {
        let mut conn = self.conn();
        let n: i64 = COMPLETE
            .key(key)
            .arg(&token.0[..])
            .arg(value.as_ref())
            .arg(ms(ttl))
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        Ok(match n {
            1 => Completion::Stored,
            2 => Completion::StoredAfterExpiry,
            _ => Completion::Refused,
        })
    }

    pub async fn renew(
        &self,
        key: &str,
        token: Token,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let mut conn = self.conn();
        let n: i64 = RENEW
            .key(key)
            .arg(&token.0[..])
            .arg(ms(lease))
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        Ok(n == 1)
    }

    pub async fn release(&self, key: &str, token: Token) -> Result<bool, StoreError> {
        let mut conn = self.conn();
        let n: i64 = RELEASE
            .key(key)
            .arg(&token.0[..])
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        Ok(n == 1)
    }

    pub async fn get(&self, key: &str) -> Result<Option<(Bytes, Duration)>, StoreError> {
        let mut conn = self.conn();
        let (value, pttl): (Option<Vec<u8>>, i64) = redis::pipe()
            .get(key)
            .pttl(key)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        Ok(value.map(|v| (Bytes::from(v), Duration::from_millis(pttl.max(0) as u64))))
    }

    pub async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let mut conn = self.conn();
        let n: i64 = redis::cmd("DEL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        Ok(n > 0)
    }

    /// PING, then make sure the scripts are loaded (after a Redis restart they are gone).
    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let _: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        let hashes = [&*RESERVE, &*COMPLETE, &*RENEW, &*RELEASE].map(|s| s.get_hash().to_string());
        let loaded: Vec<bool> = redis::cmd("SCRIPT")
            .arg("EXISTS")
            .arg(&hashes[..])
            .query_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        for (script, present) in [&*RESERVE, &*COMPLETE, &*RENEW, &*RELEASE]
            .into_iter()
            .zip(loaded)
        {
            if !present {
                script
                    .prepare_invoke()
                    .load_async(&mut conn)
                    .await
                    .map_err(|e| self.backend(e))?;
            }
        }
        Ok(())
    }
}
