//! The `postgres` topology: a primary and a synchronous standby, the
//! tools run as the `postgres` user; a failover kills the primary,
//! promotes the standby and rebuilds the old primary as the new standby.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::{eventually, Res, Store};
use crate::procs::Proc;

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

const SCHEMA: &str = include_str!("../../../../deploy/postgres/schema.sql");

pub(super) async fn pg_connect(port: u16) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
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
    pub(super) async fn start_postgres(&mut self) -> Res<()> {
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

    pub(super) async fn pg_failover(&mut self) -> Res<String> {
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
