//! PostgreSQL for the tests: a server of the test's own (`PgServer`) in a
//! temporary directory on a free loopback port, and a primary with a
//! synchronous streaming standby (`PgServer::standby_of`).
//!
//! The binaries are Debian's (`/usr/lib/postgresql/<version>/bin`, or
//! `pg_config --bindir`). PostgreSQL refuses to run as root: as root (here
//! and in CI) every tool runs as the `postgres` user through `setpriv`, which
//! execs it (the test's child is the server itself, so SIGKILL reaches it).
//! `initdb` runs once per test run into a template under target/tmp (with the
//! records' table created from deploy/postgres/schema.sql); each server
//! starts from a copy of it. `fsync = off` unless a test asks for durability
//! (commits are still acknowledged only once written: `synchronous_commit` stays on).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;

use super::{eventually, free_port, kill_child, target_tmp, DEADLINE};

/// The schema the proxy ships (`--init-store` runs the same file).
pub const SCHEMA: &str = include_str!("../../../deploy/postgres/schema.sql");

/// The directory of PostgreSQL's server binaries.
pub fn pg_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
            let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            if dir.join("initdb").exists() {
                return dir;
            }
        }
        let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL is not installed (/usr/lib/postgresql)")
            .filter_map(|e| Some(e.ok()?.path().join("bin")))
            .filter(|b| b.join("initdb").exists())
            .collect();
        found.sort();
        found
            .pop()
            .expect("no initdb under /usr/lib/postgresql/*/bin")
    })
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// A PostgreSQL tool, as the `postgres` user when we are root.
fn tool(name: &str) -> Command {
    let path = pg_bin().join(name);
    if is_root() {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--",
        ])
        .arg(path);
        c
    } else {
        Command::new(path)
    }
}

/// Gives `path` (recursively) to the `postgres` user, when we are root.
fn give(path: &Path) {
    if is_root() {
        let ok = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(path)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "chown {} to postgres", path.display());
    }
}

/// The template data directory, made once: initdb, then the records'
/// table. Made in a directory of its own and renamed into place, so that
/// test processes running at once never see half of one.
fn template() -> &'static Path {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let version = pg_bin()
            .parent()
            .and_then(|p| p.file_name())
            .map(|v| v.to_string_lossy().into_owned())
            .unwrap_or_default();
        let root = target_tmp();
        let done = root.join(format!("pg-template-{version}-v2"));
        if done.join("data/PG_VERSION").exists() && done.join("data/.with-schema").exists() {
            return done;
        }
        let work = root.join(format!("pg-template-{version}.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work).unwrap();
        give(&work);
        let data = work.join("data");
        let ok = tool("initdb")
            .args(["-D"])
            .arg(&data)
            // 1 MiB WAL segments: a copy of 24 MiB rather than 39.
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
            .arg("--wal-segsize=1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "initdb failed");
        // The table, created on a server started once on the template.
        let port = free_port();
        let mut child = Some(spawn_postgres(&data, port, &[]));
        let created = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let client = connect_within(port, Duration::from_secs(30)).await;
                client.batch_execute(SCHEMA).await.expect("the schema");
            })
        })
        .join();
        // A clean shutdown (SIGINT: fast), so the copy needs no recovery.
        if let Some(c) = &child {
            let _ = Command::new("kill")
                .args(["-INT", &c.id().to_string()])
                .status();
        }
        if let Some(mut c) = child.take() {
            let _ = c.wait();
        }
        created.expect("creating the schema on the template");
        std::fs::write(data.join(".with-schema"), b"").unwrap();
        give(&data);
        if std::fs::rename(&work, &done).is_err() {
            // Another test process got there first: use its template.
            let _ = std::fs::remove_dir_all(&work);
        }
        done
    })
}

/// Where a server's directory goes: in memory (/dev/shm) when it has room
/// (copying the template and running the server are then not disk-bound),
/// else the system's temporary directory.
fn temp_dir() -> tempfile::TempDir {
    static SHM: OnceLock<bool> = OnceLock::new();
    let shm = *SHM.get_or_init(|| {
        Command::new("df")
            .args(["--output=avail", "-k", "/dev/shm"])
            .output()
            .ok()
            .and_then(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .nth(1)?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .is_some_and(|kib| kib > 2 << 20)
    });
    match shm {
        true => tempfile::tempdir_in("/dev/shm"),
        false => tempfile::tempdir(),
    }
    .expect("temp dir")
}

/// Starts `postgres` on `data` and `port` (loopback only, no Unix socket)
/// with `settings` (`name=value`), its logs in `data/../log`.
fn spawn_postgres(data: &Path, port: u16, settings: &[&str]) -> Child {
    let log = std::fs::File::create(data.with_extension("log")).unwrap();
    give(&data.with_extension("log"));
    let mut cmd = tool("postgres");
    cmd.arg("-D").arg(data).args([
        "-p",
        &port.to_string(),
        "-c",
        "listen_addresses=127.0.0.1",
        "-c",
        "unix_socket_directories=",
        "-c",
        "max_connections=60",
        "-c",
        "shared_buffers=16MB",
        // Its dynamic shared memory in the data directory (not /dev/shm),
        // so that a server killed leaves nothing behind its directory.
        "-c",
        "dynamic_shared_memory_type=mmap",
    ]);
    for s in settings {
        cmd.args(["-c", s]);
    }
    // A process group of its own: `kill` ends the server and its backends at once.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    cmd.stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn postgres")
}

async fn connect(port: u16) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

async fn connect_within(port: u16, within: Duration) -> tokio_postgres::Client {
    eventually(&format!("postgres on {port}"), within, || async move {
        connect(port).await.ok()
    })
    .await
}

pub struct PgServer {
    /// The port held while the server is down ([`PgServer::kill_keeping_port`]).
    holder: Option<std::net::TcpListener>,
    /// The role the proxy connects as (`url`): this server's own.
    pub role: String,
    child: Option<Child>,
    pub port: u16,
    /// The data directory.
    pub data: PathBuf,
    settings: Vec<String>,
    dir: tempfile::TempDir,
}

impl PgServer {
    /// A server with the records' table, `fsync = off`: a server killed
    /// keeps every commit it acknowledged (the kernel has them), only a
    /// machine that dies would lose them.
    pub async fn start() -> PgServer {
        Self::start_with(&["fsync=off"]).await
    }

    /// A server with the records' table and these settings (`name=value`).
    pub async fn start_with(settings: &[&str]) -> PgServer {
        let dir = temp_dir();
        give(dir.path());
        let data = dir.path().join("data");
        let ok = Command::new("cp")
            .arg("-a")
            .arg(template().join("data"))
            .arg(&data)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "copying the template data directory");
        give(&data);
        let mut server = Self::run(dir, data, settings).await;
        // A role of this server's own, which the proxy connects as: tests
        // run at once, and one that kills its server frees its port for
        // another test's, where this role does not exist (a proxy that
        // reconnects there is refused, as it would be by no server at all).
        server.role = format!("t{}_{}", server.port, std::process::id());
        server
            .client()
            .await
            .batch_execute(&format!("CREATE ROLE {} LOGIN SUPERUSER", server.role))
            .await
            .expect("CREATE ROLE");
        server
    }

    async fn run(dir: tempfile::TempDir, data: PathBuf, settings: &[&str]) -> PgServer {
        let mut server = PgServer {
            holder: None,
            role: "postgres".to_string(),
            child: None,
            port: 0,
            data,
            settings: settings.iter().map(|s| s.to_string()).collect(),
            dir,
        };
        for _ in 0..5 {
            server.port = free_port();
            if server.spawn().await {
                return server;
            }
        }
        panic!("postgres did not start (is PostgreSQL installed?)");
    }

    /// A synchronous streaming standby of `primary` (`pg_basebackup -R`),
    /// started; the primary then waits for it on every commit
    /// (`synchronous_standby_names = '*'`). Returns once it is in sync.
    pub async fn standby_of(primary: &PgServer) -> PgServer {
        let dir = temp_dir();
        give(dir.path());
        let data = dir.path().join("data");
        let ok = tool("pg_basebackup")
            .args(["-h", "127.0.0.1", "-p", &primary.port.to_string()])
            .args(["-U", "postgres", "-R", "-X", "stream", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "pg_basebackup failed");
        let settings: Vec<&str> = primary.settings.iter().map(String::as_str).collect();
        let mut standby = Self::run(dir, data, &settings).await;
        // The primary's role came with the base backup.
        standby.role = primary.role.clone();
        let client = primary.client().await;
        // Two statements: ALTER SYSTEM refuses to run in the implicit
        // transaction of a multi-statement query.
        for sql in [
            "ALTER SYSTEM SET synchronous_standby_names = '*'",
            "SELECT pg_reload_conf()",
        ] {
            client.batch_execute(sql).await.expect(sql);
        }
        eventually("the standby to be synchronous", DEADLINE, || {
            let client = &client;
            async move {
                let row = client
                    .query_opt(
                        "SELECT 1 FROM pg_stat_replication WHERE sync_state = 'sync' AND state = 'streaming'",
                        &[],
                    )
                    .await
                    .ok()?;
                row.map(|_| ())
            }
        })
        .await;
        standby
    }

    /// Starts the server on its port; false when it did not come up (port taken).
    async fn spawn(&mut self) -> bool {
        let settings: Vec<&str> = self.settings.iter().map(String::as_str).collect();
        self.child = Some(spawn_postgres(&self.data, self.port, &settings));
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            if connect(self.port).await.is_ok() {
                return true;
            }
            if let Some(Ok(Some(_))) = self.child.as_mut().map(|c| c.try_wait()) {
                break; // exited: port taken
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.stop();
        false
    }

    /// The URL the proxy is given (one host).
    pub fn url(&self) -> String {
        format!("postgres://{}@127.0.0.1:{}/postgres", self.role, self.port)
    }

    /// A connection of the test's own.
    pub async fn client(&self) -> tokio_postgres::Client {
        connect_within(self.port, DEADLINE).await
    }

    /// One statement's rows.
    pub async fn query(&self, sql: &str) -> Vec<tokio_postgres::Row> {
        self.client().await.query(sql, &[]).await.expect(sql)
    }

    /// The keys of the live records.
    pub async fn keys(&self) -> Vec<String> {
        self.query("SELECT key FROM idemproxy_records WHERE expires_at > now()")
            .await
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    /// Drops the records' table (for the tests of a missing one).
    pub async fn drop_table(&self) {
        self.client()
            .await
            .batch_execute("DROP TABLE idemproxy_records")
            .await
            .expect("DROP TABLE");
    }

    /// `pg_ctl promote` (a standby becomes a primary); returns once it accepts writes.
    pub async fn promote(&self) {
        // pg_ctl waits for the promotion: off the runtime's threads, so that
        // the test's clients go on meanwhile.
        let mut promote = tool("pg_ctl");
        promote
            .args(["promote", "-D"])
            .arg(&self.data)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let ok = tokio::task::spawn_blocking(move || promote.status().is_ok_and(|s| s.success()))
            .await
            .expect("pg_ctl promote's thread");
        assert!(ok, "pg_ctl promote failed");
        let client = self.client().await;
        eventually("the promoted standby to accept writes", DEADLINE, || {
            let client = &client;
            async move {
                let row = client
                    .query_one("SELECT pg_is_in_recovery()", &[])
                    .await
                    .ok()?;
                (!row.get::<_, bool>(0)).then_some(())
            }
        })
        .await;
    }

    /// Stops the server at once (SIGQUIT: an immediate shutdown, nothing
    /// flushed; the server still ends its backends and frees its shared memory).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-QUIT", &c.id().to_string()])
                .status();
            let until = std::time::Instant::now() + Duration::from_secs(10);
            while std::time::Instant::now() < until {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            self.child = Some(c);
            kill_child(&mut self.child);
        }
    }

    /// Kills the server and every backend of it at once (SIGKILL to its
    /// process group, as a machine that dies would): nothing more is
    /// committed or sent to a standby.
    ///
    /// The backends are killed by their pids: each is a session (and a
    /// process group) of its own, so a signal to the server's group misses
    /// them, and an idle one would still answer a statement before it
    /// noticed that its server was gone.
    pub fn kill(&mut self) {
        if let Some(c) = &self.child {
            let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", c.id()))
                .unwrap_or_default();
            let mut kill = Command::new("kill");
            kill.args(["-KILL", "--", &format!("-{}", c.id())]);
            kill.args(children.split_whitespace());
            let _ = kill.status();
        }
        kill_child(&mut self.child);
    }

    /// [`PgServer::kill`], then keeps its port bound (a listener that never
    /// answers) until [`PgServer::restart`]: tests run at once, and another
    /// one's server could take the port meanwhile. A client connecting gets
    /// no answer (its connect timeout), not a refusal.
    pub fn kill_keeping_port(&mut self) {
        self.kill();
        self.holder = std::net::TcpListener::bind(("127.0.0.1", self.port)).ok();
    }

    /// Starts it again on the same port.
    pub async fn restart(&mut self) {
        self.stop();
        self.holder = None;
        assert!(
            self.spawn().await,
            "postgres did not restart on port {}",
            self.port
        );
    }

    /// Where its log is.
    pub fn log(&self) -> PathBuf {
        self.data.with_extension("log")
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.stop();
    }
}
