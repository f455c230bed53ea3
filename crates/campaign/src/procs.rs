//! The processes a campaign runs (stores, proxies, the upstream): each in a
//! process group of its own, so that a kill or a pause reaches all of it
//! (PostgreSQL's backends too), and restartable with the same command.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

/// Every process group started and not yet killed: what an interrupted
/// campaign kills on its way out.
static LIVE: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// SIGKILLs every process the campaign started (on SIGINT or SIGTERM: they
/// run in process groups of their own, which a terminal's Ctrl-C does not reach).
pub(crate) fn kill_all() {
    for pid in LIVE.lock().unwrap().drain(..) {
        // SAFETY: kill(2) on a process group we started.
        unsafe {
            libc::kill(-(pid as i32), libc::SIGCONT);
            libc::kill(-(pid as i32), libc::SIGKILL);
        }
    }
}

/// How to start a process again after a kill.
pub(crate) type Recipe = Box<dyn Fn() -> Command + Send + Sync>;

pub(crate) struct Proc {
    pub name: String,
    recipe: Recipe,
    log: PathBuf,
    child: Option<Child>,
    paused: bool,
}

impl Proc {
    /// Starts `recipe()`'s command, its output appended to `log`.
    pub(crate) fn start(name: &str, log: PathBuf, recipe: Recipe) -> std::io::Result<Proc> {
        let mut p = Proc {
            name: name.to_string(),
            recipe,
            log,
            child: None,
            paused: false,
        };
        p.spawn()?;
        Ok(p)
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let mut cmd = (self.recipe)();
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        cmd.stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        let child = cmd.spawn()?;
        LIVE.lock().unwrap().push(child.id());
        self.child = Some(child);
        self.paused = false;
        Ok(())
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Alive: started and not exited (a paused process is alive).
    pub(crate) fn alive(&mut self) -> bool {
        let Some(c) = self.child.as_mut() else {
            return false;
        };
        if matches!(c.try_wait(), Ok(None)) {
            return true;
        }
        // Exited and reaped: its pid may be another process's soon, so it
        // is signalled no more.
        let pid = c.id();
        LIVE.lock().unwrap().retain(|&p| p != pid);
        self.child = None;
        self.paused = false;
        false
    }

    fn signal(&self, sig: i32) {
        if let Some(pid) = self.pid() {
            // The group: the process and everything it started.
            unsafe {
                libc::kill(-(pid as i32), sig);
            }
        }
    }

    /// SIGKILL (the group), and reaps it.
    pub(crate) fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        if let Some(pid) = self.pid() {
            LIVE.lock().unwrap().retain(|&p| p != pid);
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
        self.paused = false;
    }

    pub(crate) fn pause(&mut self) {
        self.signal(libc::SIGSTOP);
        self.paused = true;
    }

    pub(crate) fn resume(&mut self) {
        self.signal(libc::SIGCONT);
        self.paused = false;
    }

    /// Up and not paused: resumes a paused one, starts a dead one again.
    pub(crate) fn heal(&mut self) -> std::io::Result<()> {
        if self.paused {
            self.resume();
        }
        if !self.alive() {
            self.child = None;
            self.spawn()?;
        }
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.paused {
            self.signal(libc::SIGCONT);
        }
        self.kill();
    }
}

/// A free loopback port (bound, then released).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}
