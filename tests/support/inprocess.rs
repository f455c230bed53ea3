//! The proxy served from the library (`Server::bind` then `run`), no process:
//! - [`Proxy::in_process`] (and [`Proxy::spawn_in_process`], not waiting for readiness):
//!   a task of the test's runtime, its logs those of the test's process;
//! - [`Proxy::in_process_apart`] (and `spawn_in_process_apart`): on a runtime of its own,
//!   with logs of its own, for tests with several proxies that read one's logs;
//! - [`InProcess`]: with the memory store, for tests that pause time.
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

use super::{captured_logs, mark_thread, metric_at, own_logs, ConfigBuilder, Proxy, TestUpstream};

impl Proxy {
    /// Serves `toml` from the library (`Server::bind`, then `run` as a task of the test's
    /// runtime) and waits until `/readyz` is 200. `env` is set while the server is built
    /// (the admin token and the store's password are read then) and removed after. Logs
    /// are captured in-process (`captured_logs`); signals, the config file and the exit
    /// code are the binary's.
    pub async fn in_process(toml: &str, env: &[(&str, &str)]) -> Proxy {
        let proxy = Self::spawn_in_process(toml, env).await;
        proxy.wait_ready().await;
        proxy
    }

    /// As [`Proxy::in_process`], without waiting for readiness (as [`Proxy::spawn`]):
    /// the server is bound and running, its store perhaps not yet usable.
    pub async fn spawn_in_process(toml: &str, env: &[(&str, &str)]) -> Proxy {
        let logs = captured_logs();
        let config = Config::from_toml(toml, "inprocess.toml", &Overrides::default())
            .unwrap_or_else(|e| panic!("{e}\n{toml}"));
        for (k, v) in env {
            std::env::set_var(k, v);
        }
        let server = Server::bind(config).await;
        for (k, _) in env {
            std::env::remove_var(k);
        }
        let server = server.expect("bind the proxy");
        let addr = server.local_addr().expect("proxy address");
        let admin = server.admin_addr().expect("admin address");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(async {
            let _ = stopped.await;
        }));
        Proxy {
            child: None,
            task: Some((stop, task)),
            runtime: None,
            addr,
            admin,
            logs,
            _config: None,
        }
    }

    /// As [`Proxy::in_process`], on a runtime of its own, with logs of its own: for a test
    /// with several proxies that reads one's logs. Its runtime's threads log to its lines
    /// ([`own_logs`]), and so, since no proxy can claim them, do the library's worker
    /// threads and the test's (every proxy served apart sees those).
    pub async fn in_process_apart(toml: &str, env: &[(&str, &str)]) -> Proxy {
        let proxy = Self::spawn_in_process_apart(toml, env).await;
        proxy.wait_ready().await;
        proxy
    }

    /// As [`Proxy::in_process_apart`], without waiting for readiness.
    pub async fn spawn_in_process_apart(toml: &str, env: &[(&str, &str)]) -> Proxy {
        let logs = own_logs();
        let marked = logs.clone();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .on_thread_start(move || mark_thread(&marked))
            .build()
            .expect("the proxy's runtime");
        let config = Config::from_toml(toml, "inprocess.toml", &Overrides::default())
            .unwrap_or_else(|e| panic!("{e}\n{toml}"));
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let (stop, stopped) = oneshot::channel::<()>();
        let (bound, addrs) = oneshot::channel();
        let task = runtime.spawn(async move {
            for (k, v) in &env {
                std::env::set_var(k, v);
            }
            let server = Server::bind(config).await;
            for (k, _) in &env {
                std::env::remove_var(k);
            }
            let server = server.expect("bind the proxy");
            let addr = server.local_addr().expect("proxy address");
            let admin = server.admin_addr().expect("admin address");
            let _ = bound.send((addr, admin));
            server
                .run(async {
                    let _ = stopped.await;
                })
                .await;
        });
        let Ok((addr, admin)) = addrs.await else {
            // The bind failed: its panic is the test's.
            match task.await {
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                other => panic!("the proxy neither bound nor panicked: {other:?}"),
            }
        };
        Proxy {
            child: None,
            task: Some((stop, task)),
            runtime: Some(runtime),
            addr,
            admin,
            logs,
            _config: None,
        }
    }
}

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
