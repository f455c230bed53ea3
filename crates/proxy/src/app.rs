//! The state every request shares: routes, store, upstream client, metrics, and lifecycle flags.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::budget::Budget;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::routes::RouteTable;
use crate::store::{Store, StoreSetupError, LARGE_READS};
use crate::upstream::Upstream;

pub struct App {
    /// Swapped whole on reload; readers clone the `Arc` and never hold the lock across an await.
    routes: RwLock<Arc<RouteTable>>,
    pub store: Store,
    pub upstream: Upstream,
    pub metrics: Arc<Metrics>,
    /// Bytes held for protected bodies, recorded responses and replays (`max_buffered`).
    pub budget: Arc<Budget>,
    /// Turns to read a record larger than [`crate::store::INLINE_RECORD`] from the store ([`LARGE_READS`]).
    pub large_reads: Semaphore,
    /// Forward-and-store tasks and upgrade tunnels: they outlive the request
    /// that started them, and draining waits for them (until the grace runs out).
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
    /// `[server] forward_normalised_path`: the upstream gets the normalised path.
    pub forward_normalised_path: bool,
    /// The key admin API's token; `None` switches the API off.
    pub admin_token: Option<AdminToken>,
    /// Tracing, when `[telemetry]` names an endpoint; `None` costs nothing.
    pub telemetry: Option<crate::telemetry::Telemetry>,
    /// What was loaded at start, to tell on reload which changes need a restart.
    started_with: Config,
}

impl App {
    pub fn new(config: &Config) -> Result<Arc<App>, StoreSetupError> {
        let metrics = Arc::new(Metrics::new());
        let slots = config.server.worker_slots();
        let store = Store::new(&config.store, metrics.clone(), slots)?;
        store.limit_records(config.routes.largest_response_body());
        let upstream = Upstream::new(&config.server, slots);
        // Started once: a changed `[telemetry]` needs a restart (see `reload`).
        let telemetry = crate::telemetry::Telemetry::start(
            &config.telemetry,
            &config.server.upstream,
            metrics.spans_dropped.clone(),
        );
        Ok(Arc::new(App {
            telemetry,
            routes: RwLock::new(config.routes.clone()),
            store,
            upstream,
            metrics,
            budget: Budget::new(config.server.max_buffered),
            large_reads: Semaphore::new(LARGE_READS),
            tasks: TaskTracker::new(),
            accepting: AtomicBool::new(false),
            store_answered: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            hard_stop: CancellationToken::new(),
            body_read_timeout: config.server.body_read_timeout,
            forward_normalised_path: config.server.forward_normalised_path,
            admin_token: AdminToken::from_env(),
            started_with: config.clone(),
        }))
    }

    pub fn routes(&self) -> Arc<RouteTable> {
        self.routes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(crate) fn set_routes(&self, routes: Arc<RouteTable>) {
        *self.routes.write().unwrap_or_else(|e| e.into_inner()) = routes;
    }

    /// Applies a re-read configuration: routes and their policies change at
    /// once; listeners, the upstream and the store keep their start-up values
    /// (a warning names each such change, which needs a restart).
    pub fn reload(&self, new: &Config) {
        let old = &self.started_with;
        // The new routes meet the file's own [server], which `Config::load`
        // checked; they must meet the running one too, which keeps its
        // limits until a restart: a body the route admits but the running
        // `max_buffered` cannot hold would be refused 503 for ever.
        if let Some(route) = new
            .routes
            .iter()
            .find(|r| r.policy.max_request_body > old.server.max_buffered)
        {
            tracing::error!(
                route = %route.name,
                max_request_body = route.policy.max_request_body,
                running_max_buffered = old.server.max_buffered,
                "configuration reload failed: the route's max_request_body is more than the running \
                 server.max_buffered, which changes only with a restart; keeping the current configuration"
            );
            return;
        }
        let mut restart_needed = Vec::new();
        let s = (&old.server, &new.server);
        if s.0.listen != s.1.listen {
            restart_needed.push("server.listen");
        }
        if s.0.admin_listen != s.1.admin_listen {
            restart_needed.push("server.admin_listen");
        }
        if s.0.upstream != s.1.upstream {
            restart_needed.push("server.upstream");
        }
        // Which files the certificate comes from, or whether the listener
        // speaks TLS at all; the files themselves are re-read on every SIGHUP.
        if s.0.tls != s.1.tls {
            restart_needed.push("server.tls_cert_file/tls_key_file");
        }
        // Everything else in [server]: timeouts and limits.
        let same_but_addresses = |c: &crate::config::ServerConfig| crate::config::ServerConfig {
            listen: String::new(),
            admin_listen: String::new(),
            upstream: s.0.upstream.clone(),
            tls: None,
            ..c.clone()
        };
        if same_but_addresses(s.0) != same_but_addresses(s.1) {
            restart_needed.push("server timeouts and limits");
        }
        if old.store != new.store {
            restart_needed.push("[store]");
        }
        // Tracing is started with the process (its exporter thread and
        // tracer); SIGHUP does not restart it.
        if old.telemetry != new.telemetry {
            restart_needed.push("[telemetry]");
        }
        self.store
            .raise_record_limit(new.routes.largest_response_body());
        self.set_routes(new.routes.clone());
        tracing::info!(
            routes = new.routes.len(),
            "configuration reloaded: routes and policies applied"
        );
        if !restart_needed.is_empty() {
            tracing::warn!(
                changed = %restart_needed.join(", "),
                "these settings changed in the file but apply only after a restart"
            );
        }
    }

    /// `/readyz`: the listener accepts, the store has answered once, and we are not draining.
    pub(crate) fn is_ready(&self) -> bool {
        self.accepting.load(Ordering::Acquire)
            && self.store_answered.load(Ordering::Acquire)
            && self.store.usable()
            && !self.draining.load(Ordering::Acquire)
    }
}

/// The env var that switches the key API on and holds its bearer token.
pub(crate) const ADMIN_TOKEN_ENV: &str = "IDEMPROXY_ADMIN_TOKEN";
/// The admin token, kept only as its SHA-256 so that the comparison takes the
/// same time whatever the length or content of the guess.
#[derive(Clone)]
pub struct AdminToken([u8; 32]);

impl AdminToken {
    pub(crate) fn from_env() -> Option<AdminToken> {
        std::env::var(ADMIN_TOKEN_ENV)
            .ok()
            .filter(|t| !t.is_empty())
            .map(|t| AdminToken(Sha256::digest(t.as_bytes()).into()))
    }

    /// Constant-time: every byte of the digests is compared.
    pub(crate) fn accepts(&self, presented: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(presented).into();
        digest
            .iter()
            .zip(self.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}
