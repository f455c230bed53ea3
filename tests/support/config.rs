//! `ConfigBuilder`: the configuration text a test starts the proxy with, from the parts
//! that test cares about; everything else listens on port 0 with the usual test defaults.
//!
//! ```ignore
//! let text = ConfigBuilder::new(&upstream.url())
//!     .redis(&redis)
//!     .route("payments", "/v1/payments", "lease = \"1s\"")
//!     .build();
//! ```
//! Tests whose subject is the configuration text itself (tests/config.rs) spell it out instead.

use super::{Backend, PgServer, RedisServer};

/// Routes most tests use, with their `[defaults]`; what a builder has until told otherwise.
pub const ROUTES: &str = r#"
[defaults]
lease = "10s"

[[routes]]
name = "payments"
path = "/v1/payments"

[[routes]]
name = "orders"
methods = ["POST", "PUT"]
path = "/v1/orders/{id}"

[[routes]]
name = "optional"
path = "/v1/optional"
key = "optional"

[[routes]]
name = "short-ttl"
path = "/v1/short"
ttl = "2s"

[[routes]]
name = "small"
path = "/v1/small"
max_request_body = "1KiB"
max_key_length = 16
"#;

/// `[server]` keys the builder sets unless the test sets them: long enough that no test
/// trips over them by accident, short enough that a hung test ends.
const SERVER_DEFAULTS: [(&str, &str); 2] = [
    ("upstream_timeout", "\"10s\""),
    ("shutdown_grace", "\"10s\""),
];

/// Builds configuration text; see the module documentation.
#[derive(Clone, Debug)]
pub struct ConfigBuilder {
    upstream: String,
    server: String,
    /// The `[store]` lines that choose the backend.
    backend: String,
    store: String,
    /// The `[telemetry]` lines; no table when `None`.
    telemetry: Option<String>,
    routes: Option<String>,
}

impl ConfigBuilder {
    /// Proxy and admin on port 0 in front of `upstream`, the memory store, [`ROUTES`].
    pub fn new(upstream: &str) -> Self {
        ConfigBuilder {
            upstream: upstream.to_string(),
            server: String::new(),
            backend: "backend = \"memory\"".to_string(),
            store: String::new(),
            telemetry: None,
            routes: None,
        }
    }

    /// More `key = value` lines for `[server]`; a key given here replaces the builder's default.
    pub fn server(mut self, lines: &str) -> Self {
        self.server.push_str(lines);
        self.server.push('\n');
        self
    }

    /// The test's own redis-server as the store.
    pub fn redis(self, server: &RedisServer) -> Self {
        self.redis_url(&server.url())
    }

    /// A Redis store at `url` (`redis://` or `rediss://`).
    pub fn redis_url(self, url: &str) -> Self {
        self.redis_store(&format!("url = \"{url}\""))
    }

    /// A Redis store described by `lines` (a cluster's nodes, sentinels).
    pub fn redis_store(mut self, lines: &str) -> Self {
        self.backend = format!("backend = \"redis\"\n{lines}");
        self
    }

    /// A PostgreSQL store on `server`.
    pub fn postgres(self, server: &PgServer) -> Self {
        self.postgres_url(&server.url())
    }

    /// A PostgreSQL store at `url` (several hosts, options).
    pub fn postgres_url(mut self, url: &str) -> Self {
        self.backend = format!("backend = \"postgres\"\nurl = \"{url}\"");
        self
    }

    /// The store a scenario runs on: the memory store, or `redis` (which must be given).
    pub fn backend(self, backend: Backend, redis: Option<&RedisServer>) -> Self {
        match (backend, redis) {
            (Backend::Redis, Some(r)) => self.redis(r),
            (Backend::Redis, None) => panic!("a Redis backend needs a redis-server"),
            (Backend::Postgres, _) => panic!("a PostgreSQL backend needs ConfigBuilder::postgres"),
            (Backend::Memory, _) => self,
        }
    }

    /// More `key = value` lines for `[store]` (after the backend's).
    pub fn store(mut self, lines: &str) -> Self {
        self.store.push_str(lines);
        self.store.push('\n');
        self
    }

    /// A `[telemetry]` table with `lines` (more lines when called again; an
    /// empty table for "").
    pub fn telemetry(mut self, lines: &str) -> Self {
        let t = self.telemetry.get_or_insert_with(String::new);
        t.push_str(lines);
        t.push('\n');
        self
    }

    /// Replaces the routes (and `[defaults]`) with `text`.
    pub fn routes(mut self, text: &str) -> Self {
        self.routes = Some(text.to_string());
        self
    }

    /// Adds one `[[routes]]` entry with `lines` of policy; the first one replaces [`ROUTES`].
    pub fn route(mut self, name: &str, path: &str, lines: &str) -> Self {
        let routes = self.routes.get_or_insert_with(String::new);
        routes.push_str(&format!(
            "\n[[routes]]\nname = \"{name}\"\npath = \"{path}\"\n{lines}\n"
        ));
        self
    }

    pub fn build(&self) -> String {
        let mut server = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nupstream = \"{}\"\n",
            self.upstream
        );
        let given: Vec<&str> = self
            .server
            .lines()
            .filter_map(|l| Some(l.split_once('=')?.0.trim()))
            .collect();
        for (key, value) in SERVER_DEFAULTS {
            if !given.contains(&key) {
                server.push_str(&format!("{key} = {value}\n"));
            }
        }
        server.push_str(&self.server);
        let routes = self.routes.as_deref().unwrap_or(ROUTES);
        let telemetry = match &self.telemetry {
            Some(lines) => format!("[telemetry]\n{lines}\n"),
            None => String::new(),
        };
        format!(
            "{server}\n[store]\n{}\n{}\n{telemetry}{routes}",
            self.backend, self.store
        )
    }
}
