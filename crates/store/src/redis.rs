//! The Redis store: standalone, Sentinel or Cluster behind one connection type
//! (our own [`Wire`](super::wire::Wire) over plain TCP, redis-rs's
//! connections otherwise). What it is made of: its connections
//! (`connections`, from `settings`, `sentinel` or `cluster`) and its
//! operations (`ops`).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use super::cluster::ClusterNodes;
use super::redis_conn::store_error;
use super::redis_connections::{Connections, Source};
use super::sentinel::Sentinel;
use super::settings::{manager_config, password, standalone, tls_certs, PASSWORD_ENV};
use super::{StoreError, StoreSetupError};
use crate::config::{RedisMode, StoreConfig};

pub(crate) struct RedisStore {
    /// Where its connections come from, and the connections made.
    pub(super) conns: Connections,
    pub(super) op_timeout: Duration,
    pub(super) wait_replicas: u32,
    pub(super) wait_timeout: Duration,
    /// The durability check ran (it runs once, after the first answer).
    pub(super) checked: AtomicBool,
}

impl RedisStore {
    /// Builds the client without connecting: an unreachable store is not a
    /// start-up failure. `slots`: per-worker places for connections.
    pub fn new(cfg: &StoreConfig, slots: usize) -> Result<Self, StoreSetupError> {
        // rustls needs a process-wide crypto provider; a second install is a no-op error.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let password = password(cfg, PASSWORD_ENV)?;
        let certs = tls_certs(cfg)?;
        let (user, password) = (cfg.username.as_deref(), password.as_deref());
        let source = match cfg.mode {
            RedisMode::Standalone => Source::Standalone {
                client: standalone(cfg, user, password, certs)?,
                config: manager_config(cfg),
            },
            RedisMode::Sentinel => {
                Source::Sentinel(Sentinel::new(cfg, user, password, manager_config(cfg))?)
            }
            RedisMode::Cluster => {
                Source::Cluster(Arc::new(ClusterNodes::new(cfg, user, password, certs)?))
            }
        };
        Ok(RedisStore {
            conns: Connections::new(source, slots, cfg.op_timeout),
            op_timeout: cfg.op_timeout,
            wait_replicas: cfg.wait_replicas,
            wait_timeout: cfg.wait_timeout,
            checked: AtomicBool::new(false),
        })
    }

    /// A client error as a store error (see [`store_error`]).
    pub(super) fn backend(&self, e: redis::RedisError) -> StoreError {
        store_error(e, self.op_timeout)
    }

    /// Told after every operation whether the store failed; gives up a connection that keeps failing.
    pub(crate) fn note_result(&self, failed: bool) {
        self.conns.note_result(failed);
    }
}
