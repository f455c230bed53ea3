//! The `sentinel` topologies: a master and a replica, three Sentinels
//! monitoring them; a failover is `SENTINEL FAILOVER`.

use std::process::Command;
use std::time::Duration;

use super::redis_node::{info, redis_cmd, text};
use super::{eventually, Res, Store};
use crate::procs::{free_port, Proc};
use crate::rng::Rng;

impl Store {
    pub(super) async fn start_sentinel(&mut self) -> Res<()> {
        for i in 0..2 {
            let mut extra = format!(
                "replica-announce-ip 127.0.0.1\nreplica-announce-port {}\n",
                self.relay_port(i)
            );
            if i == 1 {
                extra.push_str(&format!("replicaof 127.0.0.1 {}\n", self.relay_port(0)));
            }
            let node = self.spawn_redis(i, |_| extra.clone()).await?;
            self.nodes.push(node);
        }
        let replica = self.ports[1];
        eventually(
            "the replica to sync",
            Duration::from_secs(20),
            || async move {
                info(replica, "replication")
                    .await
                    .filter(|i| i.contains("master_link_status:up"))
            },
        )
        .await?;
        for i in 0..3 {
            let (p, port) = self.spawn_sentinel(i)?;
            self.sentinels.push(p);
            self.sentinel_ports.push(port);
        }
        for &port in &self.sentinel_ports {
            eventually(
                "the sentinels to know the replica and each other",
                Duration::from_secs(30),
                || async move {
                    let ok = text(
                        redis_cmd(port, &["SENTINEL", "CKQUORUM", "mymaster"])
                            .await
                            .ok()?,
                    );
                    let master = redis_cmd(port, &["SENTINEL", "MASTER", "mymaster"])
                        .await
                        .ok()?;
                    let fields: Vec<String> = match master {
                        redis::Value::Array(v) => v.into_iter().map(text).collect(),
                        redis::Value::Map(m) => m
                            .into_iter()
                            .flat_map(|(k, v)| [text(k), text(v)])
                            .collect(),
                        _ => return None,
                    };
                    let get = |k: &str| {
                        fields
                            .chunks(2)
                            .find(|kv| kv[0] == k)
                            .map(|kv| kv[1].clone())
                    };
                    (ok.starts_with("OK")
                        && get("num-slaves").as_deref() == Some("1")
                        && get("num-other-sentinels").as_deref() == Some("2"))
                    .then_some(())
                },
            )
            .await?;
        }
        Ok(())
    }

    /// Sentinel `i`: its config (monitoring the master through its relay,
    /// quorum 2), started; the process and its port.
    fn spawn_sentinel(&self, i: usize) -> Res<(Proc, u16)> {
        let port = free_port();
        let name = format!("sentinel-{i}");
        let d = self.dir.join(&name);
        std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
        let file = d.join("sentinel.conf");
        std::fs::write(
            &file,
            format!(
                "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {}\n\
                 sentinel monitor mymaster 127.0.0.1 {} 2\n\
                 sentinel down-after-milliseconds mymaster 1000\n\
                 sentinel failover-timeout mymaster 4000\n\
                 sentinel parallel-syncs mymaster 1\n",
                d.display(),
                self.relay_port(0)
            ),
        )
        .map_err(|e| e.to_string())?;
        let log = self.dir.join(format!("{name}.log"));
        let p = Proc::start(
            &name,
            log,
            Box::new(move || {
                let mut c = Command::new("redis-server");
                c.arg(&file).arg("--sentinel");
                c
            }),
        )
        .map_err(|e| format!("redis-server --sentinel: {e}"))?;
        Ok((p, port))
    }

    /// `SENTINEL FAILOVER` on a sentinel drawn from `rng`; done when the
    /// sentinels name a new master.
    pub(super) async fn sentinel_failover(&mut self, rng: &mut Rng) -> Res<String> {
        let port = *rng.pick(&self.sentinel_ports);
        let before = master_addr(port).await;
        redis_cmd(port, &["SENTINEL", "FAILOVER", "mymaster"])
            .await
            .map_err(|e| format!("SENTINEL FAILOVER: {e}"))?;
        eventually(
            "the sentinels to name a new master",
            Duration::from_secs(20),
            || async {
                let now = master_addr(port).await?;
                (Some(&now) != before.as_ref()).then_some(now)
            },
        )
        .await
        .map(|now| format!("sentinel failover to {now}"))
    }
}

/// The master's address the sentinel on `port` names.
async fn master_addr(port: u16) -> Option<String> {
    match redis_cmd(port, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster"])
        .await
        .ok()?
    {
        redis::Value::Array(v) => Some(v.into_iter().map(text).collect::<Vec<_>>().join(":")),
        _ => None,
    }
}
