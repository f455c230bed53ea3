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

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::procs::{free_port, Proc};
use crate::relay::{Owners, Relay};
use crate::rng::Rng;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    Sentinel,
    SentinelWait,
    Cluster,
    Postgres,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Sentinel => "sentinel",
            Kind::SentinelWait => "sentinel-wait",
            Kind::Cluster => "cluster",
            Kind::Postgres => "postgres",
        }
    }

    pub fn wait_replicas(self) -> u32 {
        u32::from(self == Kind::SentinelWait)
    }

    /// Replication the docs call asynchronous (Redis, with or without
    /// `wait_replicas`, which narrows the window and cannot close it): a
    /// record written before a store fault may be gone after it, and its
    /// retry runs again or gets 502 `outcome-unknown`.
    pub fn asynchronous(self) -> bool {
        !matches!(self, Kind::Postgres)
    }
}

pub struct Store {
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

pub async fn redis_cmd(port: u16, args: &[&str]) -> redis::RedisResult<redis::Value> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    let mut conn = tokio::time::timeout(
        Duration::from_secs(2),
        client.get_multiplexed_async_connection(),
    )
    .await
    .map_err(|_| redis::RedisError::from((redis::ErrorKind::Io, "connect timed out")))??;
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    tokio::time::timeout(Duration::from_secs(2), cmd.query_async(&mut conn))
        .await
        .map_err(|_| redis::RedisError::from((redis::ErrorKind::Io, "timed out")))?
}

fn text(v: redis::Value) -> String {
    match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
        redis::Value::SimpleString(s) => s,
        redis::Value::VerbatimString { text, .. } => text,
        other => format!("{other:?}"),
    }
}

async fn info(port: u16, section: &str) -> Option<String> {
    redis_cmd(port, &["INFO", section]).await.ok().map(text)
}

/// A port whose bus port (+10000) is free too.
fn cluster_port(taken: &[u16]) -> u16 {
    loop {
        let p = free_port();
        if p < 55_000
            && std::net::TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok()
            && !taken
                .iter()
                .any(|&t| t == p || t + 10_000 == p || p + 10_000 == t)
        {
            return p;
        }
    }
}

fn redis_node(dir: &Path, name: &str, conf: String) -> Res<Proc> {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
    let file = d.join("redis.conf");
    std::fs::write(&file, conf).map_err(|e| e.to_string())?;
    let log = dir.join(format!("{name}.log"));
    Proc::start(
        name,
        log,
        Box::new(move || {
            let mut c = Command::new("redis-server");
            c.arg(&file);
            c
        }),
    )
    .map_err(|e| format!("redis-server: {e}"))
}

fn redis_conf(dir: &Path, name: &str, port: u16, extra: &str) -> String {
    format!(
        "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {}\nsave \"\"\nappendonly yes\n\
         appendfsync everysec\nmaxmemory-policy noeviction\n{extra}\n",
        dir.join(name).display()
    )
}

impl Store {
    pub async fn start(
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

    /// Starts Redis node `i` on its port, or on another when that one was
    /// taken meanwhile (the port was free when chosen; another process may
    /// have bound it since); returns once it answers PING.
    async fn spawn_redis(&mut self, i: usize, extra: impl Fn(u16) -> String) -> Res<Proc> {
        let name = format!("store-{i}");
        for _ in 0..5 {
            let port = self.ports[i];
            let conf = redis_conf(&self.dir, &name, port, &extra(port));
            let mut node = redis_node(&self.dir, &name, conf)?;
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until && node.alive() {
                if redis_cmd(port, &["PING"]).await.is_ok() {
                    return Ok(node);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            node.kill();
            let port = match self.kind {
                Kind::Cluster => cluster_port(&self.ports),
                _ => free_port(),
            };
            self.ports[i] = port;
            self.relays[i].set_target(SocketAddr::from(([127, 0, 0, 1], port)));
        }
        Err(format!(
            "{name} did not start; its log: {}",
            self.dir.join(format!("{name}.log")).display()
        ))
    }

    async fn start_sentinel(&mut self) -> Res<()> {
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

    async fn start_cluster(&mut self) -> Res<()> {
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

    /// The `[store]` lines every proxy gets (after `[store]`).
    pub fn store_toml(&self) -> String {
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
    pub fn heal(&mut self) -> Res<()> {
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
    pub async fn failover(&mut self, rng: &mut Rng) -> Res<String> {
        match self.kind {
            Kind::Sentinel | Kind::SentinelWait => {
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
            Kind::Cluster => {
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
            Kind::Postgres => self.pg_failover().await,
        }
    }

    /// Which process a store fault may hit: `store-N` and `sentinel-N`.
    pub fn proc_mut(&mut self, name: &str) -> Option<&mut Proc> {
        self.nodes
            .iter_mut()
            .chain(self.sentinels.iter_mut())
            .find(|p| p.name == name)
    }

    pub fn proc_names(&self) -> Vec<String> {
        self.nodes
            .iter()
            .chain(self.sentinels.iter())
            .map(|p| p.name.clone())
            .collect()
    }

    /// What [`Probe::settled`] needs, without the store itself.
    pub fn probe(&self) -> Probe {
        Probe {
            kind: self.kind,
            ports: self.ports.clone(),
            primary: self.primary,
        }
    }

    pub async fn settled(&self, within: Duration) -> Res<()> {
        self.probe().settled(within).await
    }
}

/// Asks the store's nodes whether it has converged.
#[derive(Clone)]
pub struct Probe {
    kind: Kind,
    ports: Vec<u16>,
    primary: usize,
}

impl Probe {
    /// After a store fault: settled, and for Redis still settled eleven
    /// seconds later (a sentinel takes up to ten to turn a returning old
    /// master into a replica; until then it takes writes that the new
    /// master never sees), at most a minute. The fault's window, in which
    /// a record can be lost, lasts until then.
    pub async fn converged(&self) {
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
    pub async fn settled(&self, within: Duration) -> Res<()> {
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

async fn info_text(port: u16) -> Option<String> {
    info(port, "replication").await
}

// --- PostgreSQL ---

fn pg_bin() -> Res<PathBuf> {
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").exists() {
            return Ok(dir);
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|_| "PostgreSQL is not installed (/usr/lib/postgresql)".to_string())?
        .filter_map(|e| Some(e.ok()?.path().join("bin")))
        .filter(|b| b.join("initdb").exists())
        .collect();
    found.sort();
    found
        .pop()
        .ok_or_else(|| "no initdb under /usr/lib/postgresql/*/bin".to_string())
}

fn is_root() -> bool {
    unsafe { libc::geteuid() == 0 }
}

/// A PostgreSQL tool, as the `postgres` user when we are root (PostgreSQL
/// refuses to run as root).
fn pg_tool(bin: &Path, name: &str) -> Command {
    if is_root() {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--",
        ])
        .arg(bin.join(name));
        c
    } else {
        Command::new(bin.join(name))
    }
}

fn give(path: &Path) -> Res<()> {
    if is_root() {
        let ok = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(path)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return Err(format!("chown {} to postgres", path.display()));
        }
    }
    Ok(())
}

/// A log a tool appends to.
fn log_file(path: &Path) -> Res<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))
}

const SCHEMA: &str = include_str!("../../../deploy/postgres/schema.sql");

async fn pg_connect(port: u16) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres?connect_timeout=2");
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

fn pg_recipe(bin: PathBuf, data: PathBuf, port: u16) -> crate::procs::Recipe {
    Box::new(move || {
        let mut c = pg_tool(&bin, "postgres");
        c.arg("-D").arg(&data).args([
            "-p",
            &port.to_string(),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "unix_socket_directories=",
            "-c",
            "max_connections=100",
            "-c",
            "shared_buffers=16MB",
            "-c",
            "dynamic_shared_memory_type=mmap",
            "-c",
            "fsync=off",
            "-c",
            "wal_sender_timeout=5s",
            "-c",
            "wal_receiver_timeout=5s",
        ]);
        c
    })
}

impl Store {
    async fn start_postgres(&mut self) -> Res<()> {
        let bin = pg_bin()?;
        let root = self.scratch.join("pg");
        std::fs::create_dir_all(&root).map_err(|e| e.to_string())?;
        give(&root)?;
        let data = root.join("store-0");
        let tool_log = self.dir.join("pg-tools.log");
        let ok = pg_tool(&bin, "initdb")
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
            .stdout(Stdio::null())
            .stderr(log_file(&tool_log)?)
            .status()
            .map_err(|e| {
                format!("initdb (as root it runs through setpriv as the postgres user): {e}")
            })?
            .success();
        if !ok {
            return Err(format!("initdb failed; its output: {}", tool_log.display()));
        }
        let log = self.dir.join("store-0.log");
        give(&root)?;
        let p = Proc::start("store-0", log, pg_recipe(bin.clone(), data, self.ports[0]))
            .map_err(|e| format!("postgres: {e}"))?;
        self.nodes.push(p);
        let port = self.ports[0];
        let client = eventually(
            "postgres to accept connections",
            Duration::from_secs(30),
            || async move { pg_connect(port).await.ok() },
        )
        .await?;
        client
            .batch_execute(SCHEMA)
            .await
            .map_err(|e| format!("the schema: {e}"))?;
        for sql in [
            "ALTER SYSTEM SET synchronous_standby_names = '*'",
            "SELECT pg_reload_conf()",
        ] {
            client
                .batch_execute(sql)
                .await
                .map_err(|e| format!("{sql}: {e}"))?;
        }
        let standby = self.pg_standby(1, 0).await?;
        self.nodes.push(standby);
        self.settled(Duration::from_secs(30)).await
    }

    /// A standby `name`d node `i`, built from node `of` (`pg_basebackup -R`).
    async fn pg_standby(&self, i: usize, of: usize) -> Res<Proc> {
        let bin = pg_bin()?;
        let data = self.scratch.join("pg").join(format!("store-{i}"));
        let _ = std::fs::remove_dir_all(&data);
        let mut base = pg_tool(&bin, "pg_basebackup");
        // Through the primary's relay: the standby's replication
        // (`primary_conninfo`, written by -R) then goes through it too, and
        // a partition of the primary cuts it.
        base.args(["-h", "127.0.0.1", "-p", &self.relay_port(of).to_string()])
            .args(["-U", "postgres", "-R", "-X", "stream", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .stderr(log_file(&self.dir.join("pg-tools.log"))?);
        let ok = tokio::task::spawn_blocking(move || base.status().is_ok_and(|s| s.success()))
            .await
            .unwrap_or(false);
        if !ok {
            return Err(format!(
                "pg_basebackup failed; its output: {}",
                self.dir.join("pg-tools.log").display()
            ));
        }
        let log = self.dir.join(format!("store-{i}.log"));
        Proc::start(
            &format!("store-{i}"),
            log,
            pg_recipe(bin, data, self.ports[i]),
        )
        .map_err(|e| format!("postgres: {e}"))
    }

    async fn pg_failover(&mut self) -> Res<String> {
        let (old, new) = (self.primary, 1 - self.primary);
        // Fence the old primary first: two primaries would split the records.
        self.nodes[old].kill();
        self.nodes[new].heal().map_err(|e| e.to_string())?;
        let bin = pg_bin()?;
        let data = self.scratch.join("pg").join(format!("store-{new}"));
        let mut promote = pg_tool(&bin, "pg_ctl");
        promote
            .args(["promote", "-w", "-t", "30", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let ok = tokio::task::spawn_blocking(move || promote.status().is_ok_and(|s| s.success()))
            .await
            .unwrap_or(false);
        if !ok {
            return Err("pg_ctl promote failed".into());
        }
        let port = self.ports[new];
        eventually(
            "the promoted standby to take writes",
            Duration::from_secs(30),
            || async move {
                let c = pg_connect(port).await.ok()?;
                let row = c.query_one("SELECT pg_is_in_recovery()", &[]).await.ok()?;
                (!row.get::<_, bool>(0)).then_some(())
            },
        )
        .await?;
        self.primary = new;
        // The old primary's data diverged: rebuilt from the new primary.
        let mut standby = None;
        for _ in 0..5 {
            match self.pg_standby(old, new).await {
                Ok(p) => {
                    standby = Some(p);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
        let standby = standby.ok_or("the new standby could not be built")?;
        let _ = std::mem::replace(&mut self.nodes[old], standby);
        self.settled(Duration::from_secs(30)).await?;
        Ok(format!(
            "store-{new} promoted, store-{old} rebuilt as its standby"
        ))
    }
}
