//! Listeners, the accept loops, the store health check, and draining on shutdown.
//! Here the bound server and its run; by role: the client listener
//! (`accept`), the admin listener (`admin_listener`), the store health
//! check (`health`), draining (`drain`).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::app::App;
use crate::config::{Config, Runtime};
use crate::serve;
use crate::store::StoreSetupError;
use crate::tls::{Certificates, Tls, TlsError};
use crate::workers::Workers;

mod accept;
mod admin_listener;
mod drain;
mod health;

use self::accept::{accept, Front};
use self::admin_listener::serve_admin;
use self::drain::drain;
use self::health::ping_store;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        what: &'static str,
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreSetupError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("cannot start the worker threads: {0}")]
    Workers(std::io::Error),
}

impl StartError {
    /// A file the configuration names was read and is wrong (a certificate
    /// that is not PEM, a key that does not match it): the configuration's
    /// fault, as opposed to a file not there yet or a port in use.
    pub fn is_configuration(&self) -> bool {
        matches!(self, StartError::Tls(TlsError::Invalid { .. }))
    }
}

/// A bound, not yet running proxy. `bind` then `run`: tests and `main` use the same path.
pub struct Server {
    app: Arc<App>,
    config: Config,
    listener: TcpListener,
    admin: TcpListener,
    tls: Option<Arc<Tls>>,
    /// `runtime = "per_thread"`: the threads that serve the connections
    /// (`None`: they are served by the runtime that runs the server).
    workers: Option<Workers>,
}

async fn bind(what: &'static str, addr: &str) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind {
            what,
            addr: addr.to_string(),
            source,
        })
}

impl Server {
    pub async fn bind(config: Config) -> Result<Server, StartError> {
        let tls = match &config.server.tls {
            Some(files) => Some(Arc::new(Tls::new(files)?)),
            None => None,
        };
        let app = App::new(&config)?;
        // PostgreSQL: a missing table, or one of another shape, stops the
        // start (exit 1, naming `--init-store`); it is never created here.
        app.store.check_schema().await?;
        let listener = bind("proxy", &config.server.listen).await?;
        let admin = bind("admin", &config.server.admin_listen).await?;
        let workers = match config.server.runtime {
            Runtime::PerThread => {
                let load = app.metrics.worker_gauges(config.server.worker_threads());
                Some(Workers::start(load).map_err(StartError::Workers)?)
            }
            Runtime::WorkStealing => None,
        };
        Ok(Server {
            app,
            config,
            listener,
            admin,
            tls,
            workers,
        })
    }

    /// The listener's certificates, for the SIGHUP reload; `None` without TLS.
    pub fn certificates(&self) -> Option<Arc<Certificates>> {
        self.tls.as_ref().map(|t| t.certificates())
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub fn admin_addr(&self) -> std::io::Result<SocketAddr> {
        self.admin.local_addr()
    }

    pub fn app(&self) -> Arc<App> {
        self.app.clone()
    }

    /// Serves until `shutdown` resolves, then drains: readiness off, no new
    /// connections, in-flight requests finish and their records are stored.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let Server {
            app,
            config,
            listener,
            admin,
            tls,
            workers,
        } = self;
        announce(&app, &config, &listener, &admin);
        let pinger = tokio::spawn(ping_store(app.clone()));
        let sweeper = tokio::spawn({
            let app = app.clone();
            async move { app.store.sweep_expired().await }
        });
        let trimmer = tokio::spawn(serve::give_back_freed_memory());
        let admin_task = tokio::spawn(serve_admin(app.clone(), admin, config.server.clone()));
        let connections = Connections::default();
        let front = Arc::new(Front::new(&app, &config.server, tls, &connections));
        accept(&front, listener, &connections, workers.as_ref(), shutdown).await;
        drain(&app, config.server.shutdown_grace, connections).await;
        // Whatever the workers still run (connections past the grace) ends with them.
        if let Some(workers) = workers {
            workers.stop().await;
        }
        pinger.abort();
        sweeper.abort();
        trimmer.abort();
        admin_task.abort();
        info!("stopped");
    }
}

fn announce(app: &App, config: &Config, listener: &TcpListener, admin: &TcpListener) {
    let addr = |l: &TcpListener| l.local_addr().map(|a| a.to_string()).unwrap_or_default();
    info!(
        proxy = %addr(listener),
        admin = %addr(admin),
        upstream = %config.server.upstream,
        upstream_protocol = %config.server.upstream_protocol,
        tls = config.server.tls.is_some(),
        runtime = %config.server.runtime,
        workers = config.server.worker_threads(),
        store = ?config.store.backend,
        routes = config.routes.len(),
        "listening"
    );
    if app.store.is_memory() {
        warn!("store backend is \"memory\": records live in this process only; run one replica, or use redis");
    }
}

/// The client connections' tasks, and the signal that tells them to finish.
#[derive(Default)]
struct Connections {
    tasks: TaskTracker,
    stop: CancellationToken,
}
