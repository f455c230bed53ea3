//! Whether a store has converged after a fault or healing: a master with
//! its replica linked, the cluster ok, the primary with its standby in sync.

use std::time::Duration;

use tokio::time::Instant;

use super::postgres::pg_connect;
use super::redis_node::{info_text, redis_cmd, text};
use super::{eventually, Kind, Res};

/// Asks the store's nodes whether it has converged.
#[derive(Clone)]
pub(crate) struct Probe {
    pub(super) kind: Kind,
    pub(super) ports: Vec<u16>,
    pub(super) primary: usize,
}

impl Probe {
    /// After a store fault: settled, and for Redis still settled eleven
    /// seconds later (a sentinel takes up to ten to turn a returning old
    /// master into a replica; until then it takes writes that the new
    /// master never sees), at most a minute. The fault's window, in which
    /// a record can be lost, lasts until then.
    pub(crate) async fn converged(&self) {
        let until = Instant::now() + Duration::from_secs(60);
        while Instant::now() < until {
            if self.settled(Duration::from_secs(30)).await.is_err() {
                continue;
            }
            if !self.kind.asynchronous() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(11)).await;
            if self.settled(Duration::from_millis(1)).await.is_ok() {
                return;
            }
        }
    }

    /// After healing: the store takes writes again (a master/primary that
    /// answers, replicas linked) — waited for with a deadline.
    pub(crate) async fn settled(&self, within: Duration) -> Res<()> {
        match self.kind {
            Kind::Sentinel | Kind::SentinelWait => {
                let ports = self.ports.clone();
                eventually("a master with its replica linked", within, || {
                    let ports = ports.clone();
                    async move {
                        let mut master = 0;
                        let mut linked = 0;
                        for p in ports {
                            let i = info_text(p).await?;
                            master += usize::from(i.contains("role:master"));
                            linked += usize::from(i.contains("master_link_status:up"));
                        }
                        (master == 1 && linked == 1).then_some(())
                    }
                })
                .await
            }
            Kind::Cluster => {
                let ports = self.ports.clone();
                eventually("the cluster ok on every node", within, || {
                    let ports = ports.clone();
                    async move {
                        for p in ports {
                            let info = text(redis_cmd(p, &["CLUSTER", "INFO"]).await.ok()?);
                            info.contains("cluster_state:ok").then_some(())?;
                        }
                        Some(())
                    }
                })
                .await
            }
            Kind::Postgres => {
                let port = self.ports[self.primary];
                eventually("the primary with its standby in sync", within, || async move {
                    let c = pg_connect(port).await.ok()?;
                    c.query_opt(
                        "SELECT 1 FROM pg_stat_replication WHERE sync_state = 'sync' AND state = 'streaming'",
                        &[],
                    )
                    .await
                    .ok()?
                    .map(|_| ())
                })
                .await
            }
        }
    }
}
