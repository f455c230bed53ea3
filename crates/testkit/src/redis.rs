//! Redis for the tests: a `redis-server` of the test's own (`RedisServer`), and the
//! topologies the scale-out tests need (`Cluster`, `SentinelSetup`, `master_and_replica`).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use super::{eventually, free_port, free_port_with_bus, kill_child, DEADLINE};

/// Arguments for a test redis-server: loopback only, no persistence, then `extra`.
pub fn redis_args(port: u16, extra: &[&str]) -> Vec<String> {
    let port = port.to_string();
    [
        "--port",
        &port,
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect()
}

pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    extra: Vec<String>,
}

impl RedisServer {
    pub async fn start() -> RedisServer {
        Self::start_with(&[]).await
    }

    pub async fn start_with(extra: &[&str]) -> RedisServer {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut server = RedisServer {
            child: None,
            port: 0,
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        for _ in 0..5 {
            server.port = free_port();
            if server.spawn().await {
                return server;
            }
        }
        panic!("redis-server did not start (is it installed?)");
    }

    /// Starts the server on its port; false when it did not come up (port taken).
    async fn spawn(&mut self) -> bool {
        let child = Command::new("redis-server")
            .args(redis_args(self.port, &[]))
            .args(["--dir", &self.dir.path().display().to_string()])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if let Ok(mut c) = self.conn().await {
                if redis::cmd("PING")
                    .query_async::<String>(&mut c)
                    .await
                    .is_ok()
                {
                    return true;
                }
            }
            if let Some(Ok(Some(_))) = self.child.as_mut().map(|c| c.try_wait()) {
                break; // exited: port taken
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.stop();
        false
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub async fn conn(&self) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        redis::Client::open(self.url())?
            .get_multiplexed_async_connection()
            .await
    }

    pub async fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut c = self.conn().await.expect("connect to test redis");
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query_async(&mut c).await.expect("redis command")
    }

    pub async fn keys(&self) -> Vec<String> {
        self.cmd(&["KEYS", "*"]).await
    }

    /// How many times `command` (lower case) has run (`INFO commandstats`).
    pub async fn calls(&self, command: &str) -> u64 {
        let info: String = self.cmd(&["INFO", "commandstats"]).await;
        let prefix = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|rest| rest.split(',').next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Stops the server (SIGKILL: nothing is saved).
    pub fn stop(&mut self) {
        kill_child(&mut self.child);
    }

    /// Starts it again on the same port.
    pub async fn restart(&mut self) {
        self.stop();
        assert!(
            self.spawn().await,
            "redis-server did not restart on port {}",
            self.port
        );
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------------------
// Topologies: plain nodes, a master with a replica, a cluster, sentinels.

/// A redis-server (or sentinel) process with its own directory; killed on drop.
pub struct Node {
    child: Option<Child>,
    pub port: u16,
}

impl Node {
    /// Sends `kill -SIG` (`STOP`, `CONT`) to the server.
    pub fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("running").id();
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{sig} {pid}");
    }

    /// Starts `redis-server args` in `dir`; the caller waits for it (`wait_pong`).
    pub fn start(dir: &Path, port: u16, args: &[String]) -> Node {
        let child = Command::new("redis-server")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server");
        Node {
            child: Some(child),
            port,
        }
    }

    pub fn kill(&mut self) {
        kill_child(&mut self.child);
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One command to the redis-server on `port`, on a connection of its own.
pub async fn redis_cmd(port: u16, args: &[&str]) -> redis::RedisResult<redis::Value> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    let mut c = client.get_multiplexed_async_connection().await?;
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query_async(&mut c).await
}

/// Waits until the redis-server on `port` answers PING.
pub async fn wait_pong(port: u16) {
    eventually(&format!("redis on {port}"), DEADLINE, || async move {
        redis_cmd(port, &["PING"]).await.ok().map(|_| ())
    })
    .await;
}

/// A reply as text ("" when it is not text).
pub fn reply_text(v: redis::Value) -> String {
    redis::from_redis_value::<String>(v).unwrap_or_default()
}

/// One field of `INFO <section>` of the redis-server on `port`.
pub async fn info_field(port: u16, section: &str, field: &str) -> Option<String> {
    let info = reply_text(redis_cmd(port, &["INFO", section]).await.ok()?);
    let prefix = format!("{field}:");
    info.lines()
        .find_map(|l| Some(l.strip_prefix(prefix.as_str())?.trim().to_string()))
}

/// A replica's first sync starts at once (by default a master waits 5 s for
/// more replicas to share its diskless transfer): for a master that has
/// replicas, and for a replica, which may become one.
const SYNC_AT_ONCE: [&str; 2] = ["--repl-diskless-sync-delay", "0"];

/// A master and a replica of it (no persistence), the replica in sync.
pub async fn master_and_replica(dir: &Path) -> (Node, Node) {
    let mp = free_port();
    let master = Node::start(dir, mp, &redis_args(mp, &SYNC_AT_ONCE));
    wait_pong(mp).await;
    let replica = replica_of(dir, mp).await;
    (master, replica)
}

/// A new replica (no persistence) of the master on `master`, in sync.
pub async fn replica_of(dir: &Path, master: u16) -> Node {
    let rp = free_port();
    let mp_text = master.to_string();
    let replica = Node::start(
        dir,
        rp,
        &redis_args(
            rp,
            &[&["--replicaof", "127.0.0.1", &mp_text][..], &SYNC_AT_ONCE].concat(),
        ),
    );
    eventually("the replica to sync", DEADLINE, || async move {
        let info = reply_text(redis_cmd(rp, &["INFO", "replication"]).await.ok()?);
        let up = info.contains("master_link_status:up");
        // And the master counts it (WAIT does from then on).
        let master = reply_text(redis_cmd(master, &["INFO", "replication"]).await.ok()?);
        let online = master.contains(&format!("port={rp},state=online"));
        (up && online).then_some(())
    })
    .await;
    replica
}

/// A Redis Cluster: masters (with replicas when asked for), every slot served.
pub struct Cluster {
    pub nodes: Vec<Node>,
    /// (master port, its replica's port), as `redis-cli --cluster create` paired
    /// them, sorted; empty without replicas.
    pub shards: Vec<(u16, u16)>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// Three masters, no replicas.
    pub async fn start() -> Cluster {
        Self::start_with(3, 0, &["--cluster-node-timeout", "2000"]).await
    }

    /// `masters`, each with `replicas` in sync, the nodes started with `extra` arguments;
    /// returns once every node sees the whole cluster in state ok.
    pub async fn start_with(masters: usize, replicas: usize, extra: &[&str]) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let count = masters * (1 + replicas);
        let mut nodes: Vec<Node> = Vec::new();
        for _ in 0..count {
            // Nothing listens on the ports taken so far yet: the OS may offer one again.
            let taken: Vec<u16> = nodes.iter().map(|n| n.port).collect();
            let port = loop {
                let port = free_port_with_bus();
                if !taken
                    .iter()
                    .any(|&t| [port, port + 10_000].contains(&t) || t + 10_000 == port)
                {
                    break port;
                }
            };
            let sub = dir.path().join(port.to_string());
            std::fs::create_dir(&sub).unwrap();
            let mut args = vec![
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ];
            args.extend_from_slice(extra);
            nodes.push(Node::start(&sub, port, &redis_args(port, &args)));
        }
        for n in &nodes {
            wait_pong(n.port).await;
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        let known = format!("cluster_known_nodes:{count}");
        for n in &nodes {
            let (port, known) = (n.port, known.as_str());
            eventually(
                "every node to see the whole cluster, state ok",
                DEADLINE,
                || async move {
                    let info = reply_text(redis_cmd(port, &["CLUSTER", "INFO"]).await.ok()?);
                    (info.contains("cluster_state:ok") && info.contains(known)).then_some(())
                },
            )
            .await;
        }
        let mut shards = Vec::new();
        if replicas > 0 {
            for n in &nodes {
                let port = n.port;
                // A replica in sync (a failover needs one), named by its master's port.
                let master = eventually("the replica to sync", DEADLINE, || async move {
                    let info = reply_text(redis_cmd(port, &["INFO", "replication"]).await.ok()?);
                    if info.contains("role:master") {
                        return Some(None);
                    }
                    let master: u16 = info
                        .lines()
                        .find_map(|l| l.strip_prefix("master_port:"))?
                        .trim()
                        .parse()
                        .ok()?;
                    info.contains("master_link_status:up")
                        .then_some(Some(master))
                })
                .await;
                if let Some(master) = master {
                    shards.push((master, port));
                }
            }
            shards.sort();
            assert_eq!(
                shards.len(),
                masters * replicas,
                "{masters} masters with {replicas} replicas each: {shards:?}"
            );
        }
        Cluster {
            nodes,
            shards,
            _dir: dir,
        }
    }

    /// SIGKILLs the node on `port`.
    pub fn kill(&mut self, port: u16) {
        for n in &mut self.nodes {
            if n.port == port {
                n.kill();
            }
        }
    }

    /// The master port that serves each slot, as the node on `port` sees it.
    pub async fn slot_owners(port: u16) -> Vec<(i64, i64, u16)> {
        let slots = redis_cmd(port, &["CLUSTER", "SLOTS"]).await.unwrap();
        let redis::Value::Array(ranges) = slots else {
            panic!("CLUSTER SLOTS: {slots:?}")
        };
        ranges
            .into_iter()
            .map(|range| {
                let redis::Value::Array(parts) = range else {
                    panic!("a slot range: {range:?}")
                };
                let start: i64 = redis::from_redis_value(parts[0].clone()).unwrap();
                let end: i64 = redis::from_redis_value(parts[1].clone()).unwrap();
                let redis::Value::Array(master) = parts[2].clone() else {
                    panic!("a master: {:?}", parts[2])
                };
                let port: i64 = redis::from_redis_value(master[1].clone()).unwrap();
                (start, end, port as u16)
            })
            .collect()
    }

    /// How many record keys each master holds.
    pub async fn keys_per_node(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for n in &self.nodes {
            let keys: Vec<String> =
                redis::from_redis_value(redis_cmd(n.port, &["KEYS", "idemproxy:*"]).await.unwrap())
                    .unwrap();
            out.push(keys.len());
        }
        out
    }
}

/// A master, its replica and three sentinels watching them as "mymaster".
pub struct SentinelSetup {
    pub master: Node,
    pub replica: Node,
    pub sentinels: Vec<Node>,
    _dir: tempfile::TempDir,
}

impl SentinelSetup {
    pub async fn start() -> SentinelSetup {
        let dir = tempfile::tempdir().unwrap();
        let (master, replica) = master_and_replica(dir.path()).await;
        let mp = master.port;
        let mut sentinels = Vec::new();
        for i in 0..3 {
            let sp = free_port();
            let conf = dir.path().join(format!("sentinel-{i}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "port {sp}\nbind 127.0.0.1\nsentinel monitor mymaster 127.0.0.1 {mp} 2\n\
                     sentinel down-after-milliseconds mymaster 1000\nsentinel failover-timeout mymaster 5000\n\
                     sentinel parallel-syncs mymaster 1\n"
                ),
            )
            .unwrap();
            let args = vec![conf.display().to_string(), "--sentinel".to_string()];
            sentinels.push(Node::start(dir.path(), sp, &args));
        }
        for s in &sentinels {
            let port = s.port;
            eventually(
                "sentinels to know the replica and each other",
                DEADLINE,
                || async move {
                    let v = redis_cmd(port, &["SENTINEL", "CKQUORUM", "mymaster"])
                        .await
                        .ok()?;
                    let replicas: Vec<redis::Value> = redis::from_redis_value(
                        redis_cmd(port, &["SENTINEL", "REPLICAS", "mymaster"])
                            .await
                            .ok()?,
                    )
                    .ok()?;
                    let master: Vec<redis::Value> = redis::from_redis_value(
                        redis_cmd(port, &["SENTINEL", "MASTER", "mymaster"])
                            .await
                            .ok()?,
                    )
                    .ok()?;
                    let others = master
                        .chunks(2)
                        .find(|kv| reply_text(kv[0].clone()) == "num-other-sentinels")
                        .map(|kv| reply_text(kv[1].clone()));
                    (reply_text(v).starts_with("OK")
                        && !replicas.is_empty()
                        && others.as_deref() == Some("2"))
                    .then_some(())
                },
            )
            .await;
        }
        SentinelSetup {
            master,
            replica,
            sentinels,
            _dir: dir,
        }
    }

    /// The `[store]` lines (after `backend = "redis"`) that reach the master through the sentinels.
    pub fn store_lines(&self) -> String {
        let s: Vec<String> = self
            .sentinels
            .iter()
            .map(|n| format!("\"redis://127.0.0.1:{}\"", n.port))
            .collect();
        format!(
            "mode = \"sentinel\"\nsentinels = [{}]\nmaster_name = \"mymaster\"\nop_timeout = \"300ms\"\n",
            s.join(", ")
        )
    }

    /// Cuts the replica off its master: it cannot log back in (a wrong
    /// `masteruser`/`masterauth`), but stays up and answers the sentinels.
    /// Returns once the master has no replica; from then on nothing the master
    /// writes reaches the replica (replication lag, made deterministic).
    pub async fn cut_replica_off(&self) {
        let (mp, rp) = (self.master.port, self.replica.port);
        redis_cmd(rp, &["CONFIG", "SET", "masteruser", "nobody"])
            .await
            .unwrap();
        redis_cmd(rp, &["CONFIG", "SET", "masterauth", "wrong"])
            .await
            .unwrap();
        redis_cmd(mp, &["CLIENT", "KILL", "TYPE", "replica"])
            .await
            .unwrap();
        eventually("the master to lose its replica", DEADLINE, || async move {
            let info = reply_text(redis_cmd(mp, &["INFO", "replication"]).await.ok()?);
            info.contains("connected_slaves:0").then_some(())
        })
        .await;
    }

    /// Waits until the replica has processed everything the master has
    /// written (their replication offsets are equal): with no writes meanwhile,
    /// everything the master acknowledged so far is on the replica.
    pub async fn wait_replica_caught_up(&self) {
        let (mp, rp) = (self.master.port, self.replica.port);
        eventually("the replica to catch up", DEADLINE, || async move {
            let master = info_field(mp, "replication", "master_repl_offset").await?;
            let replica = info_field(rp, "replication", "slave_repl_offset").await?;
            (master == replica).then_some(())
        })
        .await;
    }

    /// Waits until the sentinels name the replica as the master and it says
    /// it is one (after the master was killed).
    pub async fn wait_replica_promoted(&self) {
        let rp = self.replica.port;
        eventually(
            "the replica to be promoted",
            Duration::from_secs(30),
            || async move {
                let role = info_field(rp, "replication", "role").await?;
                (self.master_port().await == Some(rp) && role == "master").then_some(())
            },
        )
        .await;
    }

    pub async fn master_port(&self) -> Option<u16> {
        let v = redis_cmd(
            self.sentinels[0].port,
            &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster"],
        )
        .await
        .ok()?;
        let addr: Vec<String> = redis::from_redis_value(v).ok()?;
        addr.get(1)?.parse().ok()
    }
}
