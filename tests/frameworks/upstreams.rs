//! The real upstream frameworks as child processes: installed by `setup.sh`, started
//! in parallel on free ports, waited for (a port that accepts, with a deadline), asked
//! how often each key ran a handler, and killed when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::{free_port, get, kill_child};

/// How long a framework may take to listen (Rails and Django import a lot).
const START_DEADLINE: Duration = Duration::from_secs(90);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Framework {
    Flask,
    FastApi,
    Aiohttp,
    Django,
    Express4,
    Express5,
    GoServeMux,
    Rails,
}

impl Framework {
    pub const ALL: [Framework; 8] = [
        Framework::Flask,
        Framework::FastApi,
        Framework::Aiohttp,
        Framework::Django,
        Framework::Express4,
        Framework::Express5,
        Framework::GoServeMux,
        Framework::Rails,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Framework::Flask => "flask",
            Framework::FastApi => "fastapi",
            Framework::Aiohttp => "aiohttp",
            Framework::Django => "django-drf",
            Framework::Express4 => "express4",
            Framework::Express5 => "express5",
            Framework::GoServeMux => "go-servemux",
            Framework::Rails => "rails",
        }
    }
}

/// Where the frameworks' files are: the sources in `tests/frameworks`, the installs under `target/`.
#[derive(Clone)]
pub struct Dirs {
    pub sources: PathBuf,
    pub target: PathBuf,
}

impl Dirs {
    pub fn new() -> Dirs {
        // target/debug/idemproxy: the target directory is two levels up, wherever
        // CARGO_TARGET_DIR put it.
        let bin = Path::new(env!("CARGO_BIN_EXE_idemproxy"));
        let target = bin
            .parent()
            .and_then(Path::parent)
            .expect("the target directory")
            .to_path_buf();
        Dirs {
            sources: Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/frameworks"),
            target,
        }
    }

    /// Runs `setup.sh` (idempotent; quick once everything is installed). A framework that
    /// cannot be installed fails the test: none is skipped.
    pub fn set_up(&self) -> Duration {
        self.set_up_parts(&[])
    }

    /// Runs `setup.sh` for some of its parts only (`python`, `node`, `go`, `rails`; none
    /// named: all of them), e.g. the Python venv alone for a Flask app.
    pub fn set_up_parts(&self, parts: &[&str]) -> Duration {
        let started = Instant::now();
        let status = Command::new("bash")
            .arg(self.sources.join("setup.sh"))
            .arg(&self.target)
            .args(parts)
            .status()
            .expect("run tests/frameworks/setup.sh");
        assert!(
            status.success(),
            "tests/frameworks/setup.sh failed ({status}): the frameworks must install"
        );
        started.elapsed()
    }
}

/// A framework's app, running.
pub struct Upstream {
    pub framework: Framework,
    pub port: u16,
    child: Option<Child>,
    log: PathBuf,
    /// To start it again on another port (see [`Upstream::wait_listening`]).
    dirs: Dirs,
    logs: PathBuf,
}

impl Upstream {
    /// Spawns the app on a free port; [`Upstream::wait_listening`] waits for it.
    pub fn spawn(framework: Framework, dirs: &Dirs, logs: &Path) -> Upstream {
        let port = free_port();
        let p = port.to_string();
        let python = dirs.target.join("frameworks-venv/bin/python");
        let apps = dirs.sources.join("python_apps.py");
        let mut cmd = match framework {
            Framework::Flask | Framework::FastApi | Framework::Aiohttp | Framework::Django => {
                let which = match framework {
                    Framework::Flask => "flask",
                    Framework::FastApi => "fastapi",
                    Framework::Aiohttp => "aiohttp",
                    _ => "django",
                };
                let mut c = Command::new(python);
                c.arg(apps).args([which, &p]);
                c
            }
            Framework::Express4 | Framework::Express5 => {
                let major = if framework == Framework::Express4 {
                    4
                } else {
                    5
                };
                let mut c = Command::new("node");
                c.arg(dirs.sources.join("express_app.js"))
                    .arg(dirs.target.join(format!("frameworks-node/express{major}")))
                    .arg(&p);
                c
            }
            Framework::GoServeMux => {
                let mut c = Command::new(dirs.target.join("frameworks-go/servemux"));
                c.arg(&p);
                c
            }
            Framework::Rails => {
                let mut c = Command::new("puma");
                c.args(["-b", &format!("tcp://127.0.0.1:{port}"), "-t", "2:4"])
                    .arg(dirs.sources.join("rails.ru"))
                    .current_dir(&dirs.sources);
                c
            }
        };
        let log = logs.join(format!("{}.log", framework.name()));
        let out = std::fs::File::create(&log).expect("a log file");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log file"))
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", framework.name()));
        Upstream {
            framework,
            port,
            child: Some(child),
            log,
            dirs: dirs.clone(),
            logs: logs.to_path_buf(),
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Waits until the app answers its count endpoint; fails (with its log) if it exits
    /// or takes longer than the deadline.
    pub async fn wait_listening(&mut self) -> Duration {
        let started = Instant::now();
        let mut respawns = 0;
        loop {
            if self.runs("none").await.is_ok() {
                return started.elapsed();
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            // The port was free when chosen; a process started meanwhile (the
            // tests run at once) may have taken it: another port.
            let log = self.log_text().to_ascii_lowercase();
            if exited.is_some()
                && respawns < 5
                && (log.contains("already in use") || log.contains("eaddrinuse"))
            {
                respawns += 1;
                let (dirs, logs) = (self.dirs.clone(), self.logs.clone());
                *self = Upstream::spawn(self.framework, &dirs, &logs);
                continue;
            }
            if exited.is_some() || started.elapsed() > START_DEADLINE {
                panic!(
                    "{} did not start ({}):\n{}",
                    self.framework.name(),
                    match exited {
                        Some(status) => format!("exited {status}"),
                        None => format!("not listening after {START_DEADLINE:?}"),
                    },
                    self.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// How many times a handler ran with `key`, and which handlers.
    pub async fn runs(&self, key: &str) -> Result<(usize, Vec<String>), String> {
        let resp = get(&format!("{}/__count?key={key}", self.url())).await?;
        if resp.status != 200 {
            return Err(format!("/__count answered {}", resp.status));
        }
        let text = String::from_utf8_lossy(&resp.body).to_string();
        let mut words = text.split_whitespace();
        let n = words
            .next()
            .and_then(|w| w.parse().ok())
            .ok_or_else(|| format!("/__count answered {text:?}"))?;
        Ok((n, words.map(str::to_string).collect()))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        kill_child(&mut self.child);
    }
}
