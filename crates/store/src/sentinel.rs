//! Redis Sentinel: the master is asked of the sentinels on every (re)connect,
//! so that after a failover the next connection goes to the new master.

use redis::aio::ConnectionManagerConfig;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use tracing::info;

use super::settings::{connection_info, setup};
use super::StoreSetupError;
use crate::config::StoreConfig;

/// The sentinels to ask, and the settings of a connection to the master they name.
pub(super) struct Sentinel {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    pub(super) config: ConnectionManagerConfig,
}

impl Sentinel {
    /// The client of `cfg`'s sentinels, built without connecting.
    pub(super) fn new(
        cfg: &StoreConfig,
        user: Option<&str>,
        password: Option<&str>,
        config: ConnectionManagerConfig,
    ) -> Result<Self, StoreSetupError> {
        let master = cfg
            .master_name
            .clone()
            .ok_or_else(|| setup("sentinel mode needs master_name"))?;
        // The master's own settings (user, password, db) come from `url`.
        let master_info = connection_info(&cfg.url, user, password)?;
        let node = SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(master_info.redis_settings().clone());
        let sentinels: Vec<redis::ConnectionInfo> = cfg
            .sentinels
            .iter()
            .map(|u| connection_info(u, None, None))
            .collect::<Result<_, _>>()?;
        let sentinel =
            SentinelClient::build(sentinels, master, Some(node), SentinelServerType::Master)
                .map_err(setup)?;
        Ok(Sentinel {
            sentinel: tokio::sync::Mutex::new(sentinel),
            config,
        })
    }

    /// The address of the master the sentinels name now (`host:port`).
    pub(super) async fn master_addr(&self) -> redis::RedisResult<String> {
        let client = self.sentinel.lock().await.async_get_client().await?;
        Ok(client.get_connection_info().addr().to_string())
    }

    /// A client for the master the sentinels name now.
    pub(super) async fn master(&self) -> redis::RedisResult<redis::Client> {
        let client = self.sentinel.lock().await.async_get_client().await?;
        info!(master = ?client.get_connection_info().addr(), "sentinel named the master");
        Ok(client)
    }
}
