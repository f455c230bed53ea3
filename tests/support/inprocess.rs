//! The proxy started from the library (`Server::bind` then `run`) in the test's own
//! runtime, with the memory store: the harness for tests that pause time.
//!
//! Time: `tokio::time::pause()` needs the current-thread runtime (a plain
//! `#[tokio::test]`). A paused clock jumps to the next timer whenever the runtime has
//! nothing to do, and a runtime waiting on a socket has nothing to do: a header or
//! upstream timeout could fire though nothing is wrong. So a test does its I/O with the
//! clock running, and pauses only while nothing is in flight but what it is about (a
//! request held at the upstream, a waiter), then resumes:
//!
//! ```ignore
//! tokio::time::pause();
//! tokio::time::sleep(lease).await; // timers fire in order: the owner renews on time
//! tokio::time::resume();
//! ```
//! The harness sets `upstream_timeout` to an hour so that a held request outlives any pause.

use std::net::SocketAddr;

use idemproxy::config::{Config, Overrides};
use idemproxy::server::Server;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::{metric_at, ConfigBuilder, TestUpstream};

/// A proxy running as a task of the test's runtime, in front of a [`TestUpstream`].
pub struct InProcess {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub upstream: TestUpstream,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl InProcess {
    /// Serves `routes` (with their `[defaults]`, as in [`ConfigBuilder::routes`]).
    pub async fn start(routes: &str) -> InProcess {
        let upstream = TestUpstream::start().await;
        // One runtime for all (the test's own, whose clock the test pauses):
        // worker threads would run runtimes of their own, with clocks of their own.
        let text = ConfigBuilder::new(&upstream.url())
            .server("upstream_timeout = \"1h\"\nruntime = \"work_stealing\"")
            .routes(routes)
            .build();
        let config = Config::from_toml(&text, "inprocess.toml", &Overrides::default())
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
        let server = Server::bind(config).await.expect("bind the proxy");
        let addr = server.local_addr().expect("proxy address");
        let admin = server.admin_addr().expect("admin address");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(async {
            let _ = stopped.await;
        }));
        InProcess {
            addr,
            admin,
            upstream,
            stop: Some(stop),
            task,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// The value of one metric series from /metrics (0 when absent).
    pub async fn metric(&self, series: &str) -> f64 {
        metric_at(self.admin, series).await
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        // The runtime ends with the test; nothing needs the drain to finish.
        self.task.abort();
    }
}
