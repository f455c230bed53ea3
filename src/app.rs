//! The state every request shares: routes, store, upstream client, metrics, and lifecycle flags.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::routes::RouteTable;
use crate::store::{Store, StoreSetupError};
use crate::upstream::Upstream;

pub struct App {
    /// Swapped whole on reload; readers clone the `Arc` and never hold the lock across an await.
    routes: RwLock<Arc<RouteTable>>,
    pub store: Store,
    pub upstream: Upstream,
    pub metrics: Arc<Metrics>,
    /// Forward-and-store tasks: they outlive a client that went away, and draining waits for them.
    pub tasks: TaskTracker,
    /// The main listener is bound and accepting.
    pub accepting: AtomicBool,
    /// The store has answered at least once since start.
    pub store_answered: AtomicBool,
    /// SIGTERM/SIGINT received: readiness is withdrawn.
    pub draining: AtomicBool,
    /// `shutdown_grace` ran out: requests still waiting for the upstream stop waiting.
    pub hard_stop: CancellationToken,
    /// A protected request's body must arrive within this time.
    pub body_read_timeout: std::time::Duration,
}

impl App {
    pub fn new(config: &Config) -> Result<Arc<App>, StoreSetupError> {
        let metrics = Arc::new(Metrics::new());
        let store = Store::new(&config.store, metrics.clone())?;
        let upstream = Upstream::new(
            config.server.upstream.clone(),
            config.server.upstream_timeout,
        );
        Ok(Arc::new(App {
            routes: RwLock::new(config.routes.clone()),
            store,
            upstream,
            metrics,
            tasks: TaskTracker::new(),
            accepting: AtomicBool::new(false),
            store_answered: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            hard_stop: CancellationToken::new(),
            body_read_timeout: config.server.body_read_timeout,
        }))
    }

    pub fn routes(&self) -> Arc<RouteTable> {
        self.routes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn set_routes(&self, routes: Arc<RouteTable>) {
        *self.routes.write().unwrap_or_else(|e| e.into_inner()) = routes;
    }

    /// `/readyz`: the listener accepts, the store has answered once, and we are not draining.
    pub fn is_ready(&self) -> bool {
        self.accepting.load(Ordering::Acquire)
            && self.store_answered.load(Ordering::Acquire)
            && !self.draining.load(Ordering::Acquire)
    }
}
