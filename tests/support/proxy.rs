//! The proxy under test: the real binary (`idemproxy --config <file>`), with its
//! addresses, JSON logs, signals and exit code; or the library's server in the test's
//! own runtime ([`Proxy::in_process`], in `inprocess.rs`), with the same addresses and logs
//! and no process.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::{eventually, get, kill_child, DEADLINE};

pub struct Proxy {
    pub(super) child: Option<Child>,
    /// The server as a task of the test's runtime (instead of `child`).
    pub(super) task: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
    /// The runtime of a proxy served apart ([`Proxy::in_process_apart`]).
    pub(super) runtime: Option<tokio::runtime::Runtime>,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub(super) logs: Arc<Mutex<Vec<String>>>,
    pub(super) _config: Option<tempfile::NamedTempFile>,
}

pub fn write_config(toml: &str) -> tempfile::NamedTempFile {
    use std::io::Write;
    let mut f = tempfile::Builder::new()
        .suffix(".toml")
        .tempfile()
        .expect("temp config");
    f.write_all(toml.as_bytes()).expect("write config");
    f
}

/// Runs the binary on `text`, with `--check` or for real, and waits for it
/// to exit (configuration errors); one that starts and keeps running fails
/// the test at the deadline.
pub fn run_to_exit(text: &str, check: bool) -> std::process::Output {
    let config = write_config(text);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemproxy"));
    cmd.arg("--config").arg(config.path());
    if check {
        cmd.arg("--check");
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let until = std::time::Instant::now() + DEADLINE;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > until {
            let _ = child.kill();
            panic!("idemproxy did not exit: {:?}", child.wait_with_output());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

impl Proxy {
    /// Starts `idemproxy --config <toml> --log-format json` and waits until `/readyz` is 200.
    pub async fn start(toml: &str) -> Proxy {
        Self::start_with_env(toml, &[]).await
    }

    pub async fn start_with_env(toml: &str, env: &[(&str, &str)]) -> Proxy {
        let proxy = Self::spawn(toml, env).await;
        proxy.wait_ready().await;
        proxy
    }

    /// Starts the binary and waits for its "listening" line, not for readiness.
    pub async fn spawn(toml: &str, env: &[(&str, &str)]) -> Proxy {
        let config = write_config(toml);
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .arg("--config")
            .arg(config.path())
            .args(["--log-format", "json"])
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn idemproxy");
        let stderr = child.stderr.take().expect("stderr");
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let sink = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(line.clone());
                let _ = tx.send(line);
            }
        });
        let listening = tokio::task::spawn_blocking(move || {
            let until = std::time::Instant::now() + DEADLINE;
            loop {
                let left = until.saturating_duration_since(std::time::Instant::now());
                match rx.recv_timeout(left) {
                    Ok(line) => {
                        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                            if v["message"] == "listening" {
                                return Ok(v);
                            }
                        }
                    }
                    Err(_) => return Err("no \"listening\" line"),
                }
            }
        })
        .await
        .expect("join");
        let v = match listening {
            Ok(v) => v,
            Err(e) => {
                let _ = child.kill();
                panic!(
                    "idemproxy did not start: {e}; logs:\n{}",
                    logs.lock().unwrap().join("\n")
                );
            }
        };
        let addr = v["proxy"].as_str().unwrap().parse().unwrap();
        let admin = v["admin"].as_str().unwrap().parse().unwrap();
        Proxy {
            child: Some(child),
            task: None,
            runtime: None,
            addr,
            admin,
            logs,
            _config: Some(config),
        }
    }

    pub async fn wait_ready(&self) {
        let url = format!("http://{}/readyz", self.admin);
        eventually("/readyz to answer 200", DEADLINE, || {
            let url = url.clone();
            async move { (get(&url).await.ok()?.status == 200).then_some(()) }
        })
        .await;
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    pub fn logs(&self) -> Vec<String> {
        self.logs.lock().unwrap().clone()
    }

    /// Waits for a log line containing `text` and returns it parsed (JSON logs).
    pub async fn wait_log(&self, text: &str) -> serde_json::Value {
        let logs = self.logs.clone();
        let text = text.to_string();
        eventually(&format!("a log line with {text:?}"), DEADLINE, || {
            let found = logs
                .lock()
                .unwrap()
                .iter()
                .find(|l| l.contains(&text))
                .cloned();
            async move { found.map(|l| serde_json::from_str(&l).expect("JSON log line")) }
        })
        .await
    }

    /// Waits for a log line `matches` accepts (`what` names it) and returns it parsed.
    pub async fn wait_log_where(
        &self,
        what: &str,
        matches: impl Fn(&str) -> bool,
    ) -> serde_json::Value {
        eventually(&format!("a log line: {what}"), DEADLINE, || {
            let found = self
                .logs
                .lock()
                .unwrap()
                .iter()
                .find(|l| matches(l))
                .cloned();
            async move { found.map(|l| serde_json::from_str(&l).expect("JSON log line")) }
        })
        .await
    }

    /// How many log lines so far contain `text`.
    pub fn log_count(&self, text: &str) -> usize {
        self.logs
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(text))
            .count()
    }

    /// Waits until `n` log lines contain `text`; returns the `n`th, parsed.
    pub async fn wait_nth_log(&self, text: &str, n: usize) -> serde_json::Value {
        eventually(&format!("{n} log lines with {text:?}"), DEADLINE, || {
            let nth = self
                .logs
                .lock()
                .unwrap()
                .iter()
                .filter(|l| l.contains(text))
                .nth(n - 1)
                .cloned();
            async move { nth.map(|l| serde_json::from_str(&l).expect("JSON log line")) }
        })
        .await
    }

    /// Replaces the configuration file (for SIGHUP reload tests).
    pub fn rewrite_config(&self, text: &str) {
        let file = self._config.as_ref().expect("a config file: the binary's");
        std::fs::write(file.path(), text).expect("rewrite config");
    }

    /// The binary's configuration file.
    pub fn config_path(&self) -> &std::path::Path {
        self._config
            .as_ref()
            .expect("a config file: the binary's")
            .path()
    }

    pub fn pid(&self) -> u32 {
        assert!(self.task.is_none(), "a process: the binary, not in-process");
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Waits for the process to exit and returns its exit code.
    pub async fn wait_exit(&mut self) -> Option<i32> {
        let mut child = self.child.take().expect("running");
        tokio::task::spawn_blocking(move || child.wait().ok().and_then(|s| s.code()))
            .await
            .expect("join")
    }

    pub fn kill(&mut self) {
        kill_child(&mut self.child);
        if let Some((stop, task)) = self.task.take() {
            let _ = stop.send(());
            // The runtime ends with the test; nothing needs the drain to finish.
            task.abort();
        }
        // Apart: its runtime's tasks (store pings, sweeps, admin) end with it.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.kill();
    }
}
