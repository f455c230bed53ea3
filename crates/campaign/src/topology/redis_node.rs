//! Redis nodes: commands and INFO, a node's config and process, and
//! starting node `i` of a store on its port.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tokio::time::Instant;

use super::{Kind, Res, Store};
use crate::procs::{free_port, Proc};

pub(crate) async fn redis_cmd(port: u16, args: &[&str]) -> redis::RedisResult<redis::Value> {
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

pub(super) fn text(v: redis::Value) -> String {
    match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
        redis::Value::SimpleString(s) => s,
        redis::Value::VerbatimString { text, .. } => text,
        other => format!("{other:?}"),
    }
}

pub(super) async fn info(port: u16, section: &str) -> Option<String> {
    redis_cmd(port, &["INFO", section]).await.ok().map(text)
}

/// A port whose bus port (+10000) is free too.
pub(super) fn cluster_port(taken: &[u16]) -> u16 {
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

pub(super) async fn info_text(port: u16) -> Option<String> {
    info(port, "replication").await
}

impl Store {
    /// Starts Redis node `i` on its port, or on another when that one was
    /// taken meanwhile (the port was free when chosen; another process may
    /// have bound it since); returns once it answers PING.
    pub(super) async fn spawn_redis(
        &mut self,
        i: usize,
        extra: impl Fn(u16) -> String,
    ) -> Res<Proc> {
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
}
