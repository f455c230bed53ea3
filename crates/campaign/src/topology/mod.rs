//! The stores a campaign runs against, each node behind a relay:
//!
//! - `sentinel` / `sentinel-wait`: a Redis master and a replica (AOF on,
//!   each announcing its relay's address, so that the replica, the
//!   sentinels and the proxies all reach it through the relay) and three
//!   Sentinels; the proxies use `wait_replicas` 0 and 1.
//! - `cluster`: a Redis Cluster of three masters and three replicas,
//!   announcing their relays (the cluster bus stays direct).
//! - `postgres`: a primary and a synchronous standby (`synchronous_standby_names
//!   = '*'`); a failover kills the primary, promotes the standby
//!   (`pg_ctl promote`) and rebuilds the old primary as the new standby.
//!
//! Here the topology kinds and the store as the campaign drives it; the
//! Redis nodes in `redis_node.rs`, each topology's start-up and failover in
//! `sentinel.rs`, `cluster.rs` and `postgres.rs`, convergence in `probe.rs`.

mod cluster;
mod postgres;
mod probe;
mod redis_node;
mod sentinel;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::procs::{free_port, Proc};
use crate::relay::{Owners, Relay};
use crate::rng::Rng;
use probe::Probe;
use redis_node::cluster_port;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Kind {
    Sentinel,
    SentinelWait,
    Cluster,
    Postgres,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Sentinel => "sentinel",
            Kind::SentinelWait => "sentinel-wait",
            Kind::Cluster => "cluster",
            Kind::Postgres => "postgres",
        }
    }

    pub(crate) fn wait_replicas(self) -> u32 {
        u32::from(self == Kind::SentinelWait)
    }

    /// Replication the docs call asynchronous (Redis, with or without
    /// `wait_replicas`, which narrows the window and cannot close it): a
    /// record written before a store fault may be gone after it, and its
    /// retry runs again or gets 502 `outcome-unknown`.
    pub(crate) fn asynchronous(self) -> bool {
        !matches!(self, Kind::Postgres)
    }
}

pub(crate) struct Store {
    pub kind: Kind,
    /// The store's nodes (`store-0`...): Redis servers or PostgreSQL servers.
    pub nodes: Vec<Proc>,
    /// Their real ports, and the relays in front of them (same index).
    pub ports: Vec<u16>,
    pub relays: Vec<Relay>,
    /// Sentinels (`sentinel-0`...), for the sentinel topologies.
    pub sentinels: Vec<Proc>,
    sentinel_ports: Vec<u16>,
    dir: PathBuf,
    /// PostgreSQL's data directories (they belong to its user).
    scratch: PathBuf,
    /// PostgreSQL: the node that is the primary now.
    primary: usize,
}

type Res<T> = Result<T, String>;

async fn eventually<T, F, Fut>(what: &str, within: Duration, mut f: F) -> Res<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let until = Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if Instant::now() > until {
            return Err(format!("timed out waiting for {what}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Store {
    pub(crate) async fn start(
        kind: Kind,
        dir: &Path,
        scratch: &Path,
        owners: &Arc<Owners>,
        rng: &Rng,
    ) -> Res<Store> {
        let mut store = Store {
            kind,
            nodes: Vec::new(),
            ports: Vec::new(),
            relays: Vec::new(),
            sentinels: Vec::new(),
            sentinel_ports: Vec::new(),
            dir: dir.to_path_buf(),
            scratch: scratch.to_path_buf(),
            primary: 0,
        };
        let count = match kind {
            Kind::Sentinel | Kind::SentinelWait | Kind::Postgres => 2,
            Kind::Cluster => 6,
        };
        // The relays first: their ports are bound before the nodes' are
        // chosen, so that no node is given a port a relay holds.
        for i in 0..count {
            let unset = SocketAddr::from(([127, 0, 0, 1], 0));
            let relay = Relay::start(unset, owners.clone(), rng.fork(100 + i as u64))
                .await
                .map_err(|e| e.to_string())?;
            store.relays.push(relay);
        }
        for i in 0..count {
            let port = match kind {
                Kind::Cluster => cluster_port(&store.ports),
                _ => free_port(),
            };
            store.relays[i].set_target(SocketAddr::from(([127, 0, 0, 1], port)));
            store.ports.push(port);
        }
        match kind {
            Kind::Sentinel | Kind::SentinelWait => store.start_sentinel().await?,
            Kind::Cluster => store.start_cluster().await?,
            Kind::Postgres => store.start_postgres().await?,
        }
        Ok(store)
    }

    fn relay_port(&self, i: usize) -> u16 {
        self.relays[i].addr.port()
    }

    /// The `[store]` lines every proxy gets (after `[store]`).
    pub(crate) fn store_toml(&self) -> String {
        let relay = |i: usize| format!("127.0.0.1:{}", self.relay_port(i));
        match self.kind {
            Kind::Sentinel | Kind::SentinelWait => {
                let s: Vec<String> = self
                    .sentinel_ports
                    .iter()
                    .map(|p| format!("\"redis://127.0.0.1:{p}\""))
                    .collect();
                format!(
                    "backend = \"redis\"\nmode = \"sentinel\"\nsentinels = [{}]\nmaster_name = \"mymaster\"\n\
                     op_timeout = \"500ms\"\nwait_replicas = {}\nwait_timeout = \"100ms\"\n",
                    s.join(", "),
                    self.kind.wait_replicas()
                )
            }
            Kind::Cluster => {
                let n: Vec<String> = (0..self.nodes.len())
                    .map(|i| format!("\"redis://{}\"", relay(i)))
                    .collect();
                format!(
                    "backend = \"redis\"\nmode = \"cluster\"\nnodes = [{}]\nop_timeout = \"500ms\"\n",
                    n.join(", ")
                )
            }
            Kind::Postgres => format!(
                "backend = \"postgres\"\nurl = \"postgres://postgres@{},{}/postgres?target_session_attrs=read-write\"\nop_timeout = \"1s\"\n",
                relay(0),
                relay(1)
            ),
        }
    }

    /// Every store process up (started again after a kill, resumed after a pause).
    pub(crate) fn heal(&mut self) -> Res<()> {
        for p in self.nodes.iter_mut().chain(self.sentinels.iter_mut()) {
            p.heal().map_err(|e| format!("{}: {e}", p.name))?;
        }
        for r in &self.relays {
            r.heal_all();
        }
        Ok(())
    }

    /// A failover the way its operators do one: `SENTINEL FAILOVER`, a
    /// `CLUSTER FAILOVER` (with `FORCE` half the time) on a replica, or
    /// the primary killed, the standby promoted and a new standby built.
    pub(crate) async fn failover(&mut self, rng: &mut Rng) -> Res<String> {
        match self.kind {
            Kind::Sentinel | Kind::SentinelWait => self.sentinel_failover(rng).await,
            Kind::Cluster => self.cluster_failover(rng).await,
            Kind::Postgres => self.pg_failover().await,
        }
    }

    /// Which process a store fault may hit: `store-N` and `sentinel-N`.
    pub(crate) fn proc_mut(&mut self, name: &str) -> Option<&mut Proc> {
        self.nodes
            .iter_mut()
            .chain(self.sentinels.iter_mut())
            .find(|p| p.name == name)
    }

    pub(crate) fn proc_names(&self) -> Vec<String> {
        self.nodes
            .iter()
            .chain(self.sentinels.iter())
            .map(|p| p.name.clone())
            .collect()
    }

    /// What [`Probe::settled`] needs, without the store itself.
    pub(crate) fn probe(&self) -> Probe {
        Probe {
            kind: self.kind,
            ports: self.ports.clone(),
            primary: self.primary,
        }
    }

    pub(crate) async fn settled(&self, within: Duration) -> Res<()> {
        self.probe().settled(within).await
    }
}
