//! Redis Cluster: the nodes a connection starts from, and what `CLUSTER
//! SLOTS` teaches about them (docs/reference/failures.md#failover: surviving the loss of the
//! seed nodes).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;
use redis::cluster_async::ClusterConnection;
use redis::{ConnectionAddr, ConnectionInfo, Pipeline, ServerErrorKind, TlsCertificates, Value};
use tracing::{debug, info, warn};

use super::settings::{connection_info, setup};
use super::StoreSetupError;
use crate::config::StoreConfig;

/// At most one cluster reconnect per this long: while a master fails over,
/// its keys fail for seconds, and each reconnect opens a connection per node.
const CLUSTER_RECONNECT_SPACING: Duration = Duration::from_secs(1);

/// Cluster mode: the nodes a connection starts from. The configured seeds
/// alone are not enough: when the only seed is the master that died, a
/// connection made from them fails until that node returns, although its
/// replica took over and every other master is healthy. So every node of the
/// last topology seen is remembered, and a new connection starts from all of
/// them; and the working connection is kept until a new one is up (the
/// cluster client follows MOVED, refreshes its slot map and repairs node
/// connections by itself; a new one only helps with nodes that hang).
pub(super) struct ClusterNodes {
    seeds: Vec<ConnectionInfo>,
    /// Every node `CLUSTER SLOTS` named last time it was asked (at connect and at each ping).
    learned: Mutex<Vec<ConnectionInfo>>,
    op_timeout: Duration,
    certs: Option<TlsCertificates>,
    /// A reconnect is running (one at a time, in the background).
    reconnecting: AtomicBool,
    last_reconnect: Mutex<Option<Instant>>,
}

impl ClusterNodes {
    /// The seeds `cfg` names, with the user and password applied.
    pub(super) fn new(
        cfg: &StoreConfig,
        user: Option<&str>,
        password: Option<&str>,
        certs: Option<TlsCertificates>,
    ) -> Result<Self, StoreSetupError> {
        let seeds: Vec<ConnectionInfo> = cfg
            .nodes
            .iter()
            .map(|u| connection_info(u, user, password))
            .collect::<Result<_, _>>()?;
        let nodes = ClusterNodes {
            seeds,
            learned: Mutex::new(Vec::new()),
            op_timeout: cfg.op_timeout,
            certs,
            reconnecting: AtomicBool::new(false),
            last_reconnect: Mutex::new(None),
        };
        // Built once here so that a bad seed list is a start-up error.
        nodes.client(nodes.seeds.clone()).map_err(setup)?;
        Ok(nodes)
    }

    fn client(
        &self,
        nodes: Vec<ConnectionInfo>,
    ) -> redis::RedisResult<redis::cluster::ClusterClient> {
        let mut builder = redis::cluster::ClusterClient::builder(nodes)
            .connection_timeout(self.op_timeout)
            .response_timeout(self.op_timeout)
            .retries(3);
        if let Some(c) = &self.certs {
            builder = builder.certs(c.clone());
        }
        builder.build()
    }

    /// A connection through the seeds and every node learned, then what it tells of the topology.
    pub(super) async fn connect(&self) -> redis::RedisResult<ClusterConnection> {
        let mut nodes = self.seeds.clone();
        for node in self
            .learned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            if !nodes.iter().any(|n| n.addr() == node.addr()) {
                nodes.push(node.clone());
            }
        }
        let mut conn = self.client(nodes)?.get_async_connection().await?;
        self.learn(&mut conn).await;
        Ok(conn)
    }

    /// Remembers the nodes `CLUSTER SLOTS` names (masters and replicas). Best
    /// effort: an ACL without `+cluster|slots` leaves the last list in place.
    pub(super) async fn learn(&self, conn: &mut ClusterConnection) {
        let slots: Value = match redis::cmd("CLUSTER").arg("SLOTS").query_async(conn).await {
            Ok(v) => v,
            Err(e) => {
                debug!(error = %e, "CLUSTER SLOTS failed; the known cluster nodes stay as they were");
                return;
            }
        };
        let Some(template) = self.seeds.first() else {
            return;
        };
        let learned = nodes_named(template, &slots);
        if !learned.is_empty() {
            *self.learned.lock().unwrap_or_else(|e| e.into_inner()) = learned;
        }
    }

    /// Makes a new connection in the background, through every node known,
    /// and hands it to `install` once it is up; until then, and if it fails,
    /// the current one (which keeps healing itself) stays in use. One at a
    /// time, and at most one per [`CLUSTER_RECONNECT_SPACING`].
    pub(super) fn reconnect(
        self: &Arc<Self>,
        install: impl FnOnce(ClusterConnection) + Send + 'static,
    ) {
        {
            let mut last = self
                .last_reconnect
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|t| t.elapsed() < CLUSTER_RECONNECT_SPACING)
                || self.reconnecting.swap(true, Ordering::AcqRel)
            {
                return;
            }
            *last = Some(Instant::now());
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.reconnecting.store(false, Ordering::Release);
            return;
        };
        let nodes = self.clone();
        runtime.spawn(async move {
            match nodes.connect().await {
                Ok(fresh) => {
                    install(fresh);
                    info!("store kept failing; made a new cluster connection through every known node");
                }
                Err(e) => warn!(
                    error = %e,
                    "store keeps failing and no new cluster connection could be made; the current one stays"
                ),
            }
            nodes.reconnecting.store(false, Ordering::Release);
        });
    }
}

/// Sends a pipeline (commands on one key) in one write, as redis-rs does;
/// when the key's slot is moving and the pipeline ends refused by a
/// redirection, sends its commands again one at a time, through redis-rs's
/// path for single commands, which follows `MOVED` and `ASK` properly.
///
/// redis-rs follows a pipeline's redirection as one request: on `ASK` it
/// sends `ASKING` once, then the whole pipeline to the importing node, which
/// honours `ASKING` for the first command only and answers the second with
/// `MOVED` back to the migrating node, which answers `ASK` again, until the
/// tries run out. So while a slot migrated, every reserve of a key already
/// moved failed (503) until the migration ended. Sending the commands again
/// is safe: each of the store's pipelines reserves or reads one key, and a
/// reserve that finds its own reservation knows it as its own.
pub(super) async fn pipeline(
    conn: &mut ClusterConnection,
    pipeline: &Pipeline,
    offset: usize,
    count: usize,
) -> redis::RedisResult<Vec<Value>> {
    let first = conn.req_packed_commands(pipeline, offset, count).await;
    match first {
        Err(e) if redirected(&e) && !pipeline.is_transaction() => {
            let mut got = Vec::with_capacity(count);
            for cmd in pipeline.cmd_iter().skip(offset).take(count) {
                got.push(conn.req_packed_command(cmd).await?);
            }
            Ok(got)
        }
        answer => answer,
    }
}

/// An error that says the key's slot is served elsewhere, or is moving.
fn redirected(e: &redis::RedisError) -> bool {
    matches!(
        e.kind(),
        redis::ErrorKind::Server(
            ServerErrorKind::Moved | ServerErrorKind::Ask | ServerErrorKind::TryAgain
        )
    )
}

/// Every node a `CLUSTER SLOTS` answer names, once each, with the user,
/// password and TLS settings of `template` (a seed); only the address differs.
fn nodes_named(template: &ConnectionInfo, slots: &Value) -> Vec<ConnectionInfo> {
    let mut out: Vec<ConnectionInfo> = Vec::new();
    for (host, port) in slot_nodes(slots) {
        let addr = match template.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host,
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(host, port),
        };
        if !out.iter().any(|n| *n.addr() == addr) {
            out.push(template.clone().set_addr(addr));
        }
    }
    out
}

/// (host, port) of every node in a `CLUSTER SLOTS` answer; nodes without a
/// usable address (an empty host or `?`, meaning unknown) are left out.
fn slot_nodes(slots: &Value) -> Vec<(String, u16)> {
    let mut out = Vec::new();
    let Value::Array(ranges) = slots else {
        return out;
    };
    for range in ranges {
        let Value::Array(parts) = range else { continue };
        for node in parts.iter().skip(2) {
            let Value::Array(fields) = node else { continue };
            let (Some(Value::BulkString(host)), Some(Value::Int(port))) =
                (fields.first(), fields.get(1))
            else {
                continue;
            };
            let host = String::from_utf8_lossy(host).into_owned();
            if host.is_empty() || host == "?" {
                continue;
            }
            if let Ok(port) = u16::try_from(*port) {
                out.push((host, port));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::settings::connection_info;
    use super::*;

    fn node(host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::BulkString(host.as_bytes().to_vec()),
            Value::Int(port),
            Value::BulkString(b"0123abcd".to_vec()),
            Value::Map(vec![]),
        ])
    }

    fn range(start: i64, end: i64, nodes: Vec<Value>) -> Value {
        let mut parts = vec![Value::Int(start), Value::Int(end)];
        parts.extend(nodes);
        Value::Array(parts)
    }

    #[test]
    fn every_node_of_the_topology_once_with_the_seeds_settings() {
        let slots = Value::Array(vec![
            range(
                0,
                5460,
                vec![node("10.0.0.1", 7000), node("10.0.0.4", 7000)],
            ),
            range(5461, 10922, vec![node("10.0.0.2", 7000), node("", 7001)]),
            range(10923, 11000, vec![node("10.0.0.3", 7000), node("?", 7002)]),
            // A range split in two names the same nodes again.
            range(11001, 16383, vec![node("10.0.0.3", 7000)]),
        ]);
        let seed =
            connection_info("rediss://10.0.0.9:7000", Some("idemproxy"), Some("pw")).unwrap();
        let learned = nodes_named(&seed, &slots);
        let addrs: Vec<String> = learned.iter().map(|n| n.addr().to_string()).collect();
        assert_eq!(
            addrs,
            [
                "10.0.0.1:7000",
                "10.0.0.4:7000",
                "10.0.0.2:7000",
                "10.0.0.3:7000"
            ]
        );
        for n in &learned {
            assert!(
                matches!(n.addr(), ConnectionAddr::TcpTls { .. }),
                "TLS like the seed"
            );
            assert_eq!(n.redis_settings().username(), Some("idemproxy"));
            assert_eq!(n.redis_settings().password(), Some("pw"));
        }
        let plain = connection_info("redis://10.0.0.9:7000", None, None).unwrap();
        assert!(nodes_named(&plain, &slots)
            .iter()
            .all(|n| matches!(n.addr(), ConnectionAddr::Tcp(..))));
        assert!(nodes_named(&plain, &Value::Nil).is_empty());
    }
}
