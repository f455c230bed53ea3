//! `Env`: the standard set a scenario runs against (a redis-server, a PostgreSQL
//! server or neither, the test upstream, the proxy, fault relays when asked
//! for), and `on_every_backend!`.
//!
//! The proxy is served in-process (`Proxy::in_process`: the library's `Server` in the
//! test's runtime, its logs captured) unless the scenario asks for the binary
//! ([`EnvBuilder::binary`]): signals, SIGHUP reloads, the binary's own log format.

use super::relay::Relay;
use super::{
    eventually, metric_at, ConfigBuilder, PgServer, Proxy, RedisServer, TestUpstream, DEADLINE,
    ROUTES,
};

/// The store a scenario runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Redis,
    Memory,
    Postgres,
}

pub struct Env {
    pub redis: Option<RedisServer>,
    pub postgres: Option<PgServer>,
    pub upstream: TestUpstream,
    pub proxy: Proxy,
    /// Between the proxy and Redis, when asked for.
    pub redis_relay: Option<Relay>,
    /// Between the proxy and the upstream, when asked for.
    pub upstream_relay: Option<Relay>,
}

/// Builds an [`Env`] with the parts a test needs.
pub struct EnvBuilder {
    backend: Backend,
    routes: String,
    server: String,
    store: String,
    telemetry: Option<String>,
    proxy_env: Vec<(String, String)>,
    redis_relay: bool,
    upstream_relay: bool,
    upstream_url: Option<String>,
    binary: bool,
}

impl EnvBuilder {
    /// Replaces the standard [`ROUTES`] (and `[defaults]`).
    pub fn routes(mut self, routes: &str) -> Self {
        self.routes = routes.to_string();
        self
    }

    /// Extra `key = value` lines for [server].
    pub fn server(mut self, lines: &str) -> Self {
        self.server = lines.to_string();
        self
    }

    /// Extra `key = value` lines for [store].
    pub fn store(mut self, lines: &str) -> Self {
        self.store = lines.to_string();
        self
    }

    /// A `[telemetry]` table with `lines` ("" for an empty one).
    pub fn telemetry(mut self, lines: &str) -> Self {
        self.telemetry = Some(lines.to_string());
        self
    }

    /// Start the `idemproxy` binary rather than serving in-process: for what only a
    /// process has (signals, SIGHUP reloads, its exit code, its log format).
    pub fn binary(mut self) -> Self {
        self.binary = true;
        self
    }

    /// An environment variable for the proxy (the process's; in-process, set while it starts).
    pub fn proxy_env(mut self, name: &str, value: &str) -> Self {
        self.proxy_env.push((name.to_string(), value.to_string()));
        self
    }

    /// Put a fault relay between the proxy and Redis.
    pub fn redis_relay(mut self) -> Self {
        self.redis_relay = true;
        self
    }

    /// Put a fault relay between the proxy and the upstream.
    pub fn upstream_relay(mut self) -> Self {
        self.upstream_relay = true;
        self
    }

    /// Send upstream traffic to this URL instead of the test upstream.
    pub fn upstream_url(mut self, url: &str) -> Self {
        self.upstream_url = Some(url.to_string());
        self
    }

    pub async fn start(self) -> Env {
        let redis = match self.backend {
            Backend::Redis => Some(RedisServer::start().await),
            Backend::Memory | Backend::Postgres => None,
        };
        let postgres = match self.backend {
            Backend::Postgres => Some(PgServer::start().await),
            Backend::Memory | Backend::Redis => None,
        };
        let redis_relay = match (&redis, self.redis_relay) {
            (Some(r), true) => Some(Relay::start(([127, 0, 0, 1], r.port).into()).await),
            _ => None,
        };
        let upstream = TestUpstream::start().await;
        let upstream_relay = if self.upstream_relay {
            Some(Relay::start(upstream.addr).await)
        } else {
            None
        };
        let upstream_url = match (&self.upstream_url, &upstream_relay) {
            (Some(u), _) => u.clone(),
            (None, Some(r)) => format!("http://{}", r.addr),
            (None, None) => upstream.url(),
        };
        let mut config = ConfigBuilder::new(&upstream_url)
            .server(&self.server)
            .routes(&self.routes);
        match (&redis, &redis_relay) {
            (Some(_), Some(relay)) => {
                config = config.redis_url(&format!("redis://{}/0", relay.addr))
            }
            (Some(r), None) => config = config.redis(r),
            (None, _) => {}
        }
        if let Some(pg) = &postgres {
            config = config.postgres(pg);
        }
        if let Some(lines) = &self.telemetry {
            config = config.telemetry(lines);
        }
        let text = config.store(&self.store).build();
        let env: Vec<(&str, &str)> = self
            .proxy_env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let proxy = match self.binary {
            true => Proxy::start_with_env(&text, &env).await,
            false => Proxy::in_process(&text, &env).await,
        };
        Env {
            redis,
            postgres,
            upstream,
            proxy,
            redis_relay,
            upstream_relay,
        }
    }
}

impl Env {
    pub fn builder(backend: Backend) -> EnvBuilder {
        EnvBuilder {
            backend,
            routes: ROUTES.to_string(),
            server: String::new(),
            store: String::new(),
            telemetry: None,
            proxy_env: Vec::new(),
            redis_relay: false,
            upstream_relay: false,
            upstream_url: None,
            binary: false,
        }
    }

    pub async fn start(backend: Backend) -> Env {
        Self::builder(backend).start().await
    }

    pub async fn with_routes(backend: Backend, routes: &str) -> Env {
        Self::builder(backend).routes(routes).start().await
    }

    pub fn url(&self, path: &str) -> String {
        self.proxy.url(path)
    }

    /// The store keys, when the store is Redis or PostgreSQL (the memory store
    /// cannot be looked into).
    pub async fn store_keys(&self) -> Option<Vec<String>> {
        match (&self.redis, &self.postgres) {
            (Some(r), _) => Some(r.keys().await),
            (_, Some(p)) => Some(p.keys().await),
            (None, None) => None,
        }
    }

    /// The value of one metric series from /metrics (0 when absent).
    pub async fn metric(&self, series: &str) -> f64 {
        metric(&self.proxy, series).await
    }

    /// Waits until a metric series is at least `at_least` (what the proxy counts after
    /// it has answered: a completion, a lost lease) and returns its value.
    pub async fn metric_reaching(&self, series: &str, at_least: f64) -> f64 {
        metric_reaching(&self.proxy, series, at_least).await
    }
}

/// Waits until one metric series of `proxy` is at least `at_least`; returns its value.
pub async fn metric_reaching(proxy: &Proxy, series: &str, at_least: f64) -> f64 {
    eventually(
        &format!("{series} >= {at_least}"),
        DEADLINE,
        || async move {
            let v = metric(proxy, series).await;
            (v >= at_least).then_some(v)
        },
    )
    .await
}

/// The value of one metric series (name with its labels, as exposed) from /metrics; 0 when absent.
pub async fn metric(proxy: &Proxy, series: &str) -> f64 {
    metric_at(proxy.admin, series).await
}

/// Declares each scenario `async fn name(backend: Backend)` as a test on Redis, one on
/// memory and one on PostgreSQL, on a two-thread runtime. Those after `current_thread:`
/// run on the current-thread runtime instead: the one whose clock a scenario may pause
/// (`tokio::time::pause`, see tests/support/inprocess.rs).
#[macro_export]
macro_rules! on_every_backend {
    ($($name:ident),* $(,)? $(; current_thread: $($paused:ident),+ $(,)?)?) => {
        $crate::on_every_backend!(@on on_redis, Redis; $($name),* $(; current_thread: $($paused),+)?);
        $crate::on_every_backend!(@on on_memory, Memory; $($name),* $(; current_thread: $($paused),+)?);
        $crate::on_every_backend!(@on on_postgres, Postgres; $($name),* $(; current_thread: $($paused),+)?);
    };
    (@on $module:ident, $backend:ident; $($name:ident),* $(; current_thread: $($paused:ident),+)?) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::Backend::$backend).await
                }
            )*
            $($(
                #[tokio::test]
                async fn $paused() {
                    super::$paused($crate::support::Backend::$backend).await
                }
            )+)?
        }
    };
}
