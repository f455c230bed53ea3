//! The `cluster` topology: three masters and three replicas; a failover
//! is `CLUSTER FAILOVER` on a replica.

use std::time::Duration;

use super::redis_node::{info_text, redis_cmd, text};
use super::{eventually, Res, Store};
use crate::rng::Rng;

impl Store {
    pub(super) async fn start_cluster(&mut self) -> Res<()> {
        for i in 0..6 {
            let relay = self.relay_port(i);
            let node = self
                .spawn_redis(i, |port| {
                    format!(
                        "cluster-enabled yes\ncluster-config-file nodes.conf\ncluster-node-timeout 2000\n\
                         cluster-require-full-coverage no\ncluster-announce-ip 127.0.0.1\n\
                         cluster-announce-port {relay}\ncluster-announce-bus-port {}\n",
                        port + 10_000
                    )
                })
                .await?;
            self.nodes.push(node);
        }
        let addrs: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let out = tokio::process::Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .await
            .map_err(|e| format!("redis-cli: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "redis-cli --cluster create: {}",
                String::from_utf8_lossy(&out.stdout)
            ));
        }
        for &port in &self.ports {
            eventually(
                "every node to see the cluster ok",
                Duration::from_secs(30),
                || async move {
                    let info = text(redis_cmd(port, &["CLUSTER", "INFO"]).await.ok()?);
                    let repl = info_text(port).await?;
                    (info.contains("cluster_state:ok")
                        && info.contains("cluster_known_nodes:6")
                        && (repl.contains("role:master") || repl.contains("master_link_status:up")))
                    .then_some(())
                },
            )
            .await?;
        }
        Ok(())
    }

    /// `CLUSTER FAILOVER` (with `FORCE` half the time) on a replica drawn
    /// from `rng`; done when it is a master.
    pub(super) async fn cluster_failover(&mut self, rng: &mut Rng) -> Res<String> {
        let mut replicas = Vec::new();
        for &p in &self.ports {
            if info_text(p).await.is_some_and(|i| i.contains("role:slave")) {
                replicas.push(p);
            }
        }
        if replicas.is_empty() {
            return Err("no replica answers".into());
        }
        let port = *rng.pick(&replicas);
        let force = rng.chance(0.5);
        let mut args = vec!["CLUSTER", "FAILOVER"];
        if force {
            args.push("FORCE");
        }
        redis_cmd(port, &args)
            .await
            .map_err(|e| format!("CLUSTER FAILOVER: {e}"))?;
        eventually(
            "the replica to be a master",
            Duration::from_secs(20),
            || async move { info_text(port).await.filter(|i| i.contains("role:master")) },
        )
        .await
        .map(|_| format!("{} on {port}", args.join(" ")))
    }
}
