//! Configuration: `Raw*` serde structs (unknown keys rejected) turned into a typed, checked [`Config`].
//!
//! Every value that can be wrong is parsed while the file is read, so a typo
//! fails at load time with the file, the line and column, and the key.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method};
use serde::de::{self, Deserializer};
use serde::Deserialize;

use crate::routes::{PathPattern, Route, RouteTable};

/// A configuration problem, ready to print: it names the file, the place and the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read configuration file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{file}:{line}:{column}: {key}: {message}")]
    Invalid {
        file: String,
        line: usize,
        column: usize,
        key: String,
        message: String,
    },
    #[error("{file}: {key}: {message}")]
    Missing {
        file: String,
        key: String,
        message: String,
    },
}

// ---------------------------------------------------------------------------
// Human durations and sizes.

/// A duration written as `"250ms"`, `"30s"`, `"1m30s"`, `"24h"`, `"7d"`; always greater than zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    pub fn parse(text: &str) -> Result<Self, String> {
        let s = text.trim();
        if s.is_empty() {
            return Err("empty duration; write e.g. \"30s\" or \"250ms\"".into());
        }
        let mut total: u128 = 0;
        let mut rest = s;
        while !rest.is_empty() {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 {
                return Err(format!("invalid duration \"{text}\": expected a number before {rest:?} (units: ms, s, m, h, d)"));
            }
            let number: u128 = rest[..digits]
                .parse()
                .map_err(|_| format!("invalid duration \"{text}\": number too large"))?;
            rest = &rest[digits..];
            let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
            let unit = &rest[..unit_len];
            rest = &rest[unit_len..];
            let ms_per_unit: u128 = match unit {
                "ms" => 1,
                "s" => 1_000,
                "m" => 60_000,
                "h" => 3_600_000,
                "d" => 86_400_000,
                "" => {
                    return Err(format!(
                        "invalid duration \"{text}\": a unit is required (ms, s, m, h, d)"
                    ))
                }
                other => {
                    return Err(format!(
                    "invalid duration \"{text}\": unknown unit \"{other}\" (units: ms, s, m, h, d)"
                ))
                }
            };
            total = total
                .checked_add(number.saturating_mul(ms_per_unit))
                .ok_or_else(|| format!("invalid duration \"{text}\": too large"))?;
        }
        if total == 0 {
            return Err(format!(
                "invalid duration \"{text}\": must be greater than zero"
            ));
        }
        let ms =
            u64::try_from(total).map_err(|_| format!("invalid duration \"{text}\": too large"))?;
        Ok(HumanDuration(Duration::from_millis(ms)))
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        HumanDuration::parse(&s).map_err(de::Error::custom)
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        // Hours at most: "48h" reads better than "2d" next to a config that says "48h".
        for (unit, size) in [("h", 3_600_000u128), ("m", 60_000), ("s", 1_000)] {
            if ms % size == 0 {
                return write!(f, "{}{unit}", ms / size);
            }
        }
        write!(f, "{ms}ms")
    }
}

/// A size in bytes: an integer, or a string such as `"64KiB"`, `"1MB"`, `"1000"`; greater than zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub fn parse(text: &str) -> Result<Self, String> {
        let s = text.trim();
        let digits = s.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(format!(
                "invalid size \"{text}\": expected a number of bytes or e.g. \"64KiB\""
            ));
        }
        let number: u64 = s[..digits]
            .parse()
            .map_err(|_| format!("invalid size \"{text}\": number too large"))?;
        let multiplier: u64 = match s[digits..].trim() {
            "" | "B" => 1,
            "KB" => 1_000,
            "KiB" => 1 << 10,
            "MB" => 1_000_000,
            "MiB" => 1 << 20,
            "GB" => 1_000_000_000,
            "GiB" => 1 << 30,
            other => {
                return Err(format!(
                    "invalid size \"{text}\": unknown unit \"{other}\" (units: B, KB, KiB, MB, MiB, GB, GiB)"
                ))
            }
        };
        let bytes = number
            .checked_mul(multiplier)
            .ok_or_else(|| format!("invalid size \"{text}\": too large"))?;
        if bytes == 0 {
            return Err(format!(
                "invalid size \"{text}\": must be greater than zero"
            ));
        }
        Ok(ByteSize(bytes))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(i64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) if n > 0 => Ok(ByteSize(n as u64)),
            Raw::Int(n) => Err(de::Error::custom(format!(
                "invalid size {n}: must be greater than zero"
            ))),
            Raw::Text(s) => ByteSize::parse(&s).map_err(de::Error::custom),
        }
    }
}

// ---------------------------------------------------------------------------
// Small typed values.

/// An HTTP method parsed at load time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfMethod(pub Method);

impl<'de> Deserialize<'de> for ConfMethod {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let upper = s.to_ascii_uppercase();
        if upper.is_empty() || !upper.bytes().all(|b| b.is_ascii_alphabetic() || b == b'-') {
            return Err(de::Error::custom(format!("invalid HTTP method \"{s}\"")));
        }
        Method::from_bytes(upper.as_bytes())
            .map(ConfMethod)
            .map_err(|_| de::Error::custom(format!("invalid HTTP method \"{s}\"")))
    }
}

/// A header name parsed (and lower-cased) at load time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfHeader(pub HeaderName);

impl<'de> Deserialize<'de> for ConfHeader {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        HeaderName::from_bytes(s.to_ascii_lowercase().as_bytes())
            .map(ConfHeader)
            .map_err(|_| de::Error::custom(format!("invalid header name \"{s}\"")))
    }
}

/// An HTTP status code from 100 to 599.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConfStatus(pub u16);

impl<'de> Deserialize<'de> for ConfStatus {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = i64::deserialize(d)?;
        if (100..=599).contains(&n) {
            Ok(ConfStatus(n as u16))
        } else {
            Err(de::Error::custom(format!(
                "invalid HTTP status {n}: expected 100..=599"
            )))
        }
    }
}

impl<'de> Deserialize<'de> for PathPattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        PathPattern::parse(&s).map_err(de::Error::custom)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyMode {
    Required,
    Optional,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Concurrent {
    /// A duplicate of an in-flight request gets 409 with `Retry-After`.
    Reject,
    /// A duplicate waits (up to `wait_timeout`) for the first to finish and gets its replay.
    Wait,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnknownOutcome {
    Store,
    Release,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FingerprintBody {
    Raw,
    Json,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Enforce,
    Shadow,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreError {
    Reject,
    Pass,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Memory,
    Redis,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RedisMode {
    Standalone,
    Cluster,
    Sentinel,
}

// ---------------------------------------------------------------------------
// The file as written.

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    store: RawStore,
    #[serde(default)]
    defaults: RawPolicy,
    #[serde(default)]
    routes: Vec<RawPolicy>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<String>,
    upstream: Option<String>,
    admin_listen: Option<String>,
    upstream_timeout: Option<HumanDuration>,
    shutdown_grace: Option<HumanDuration>,
    header_read_timeout: Option<HumanDuration>,
    body_read_timeout: Option<HumanDuration>,
    max_connections: Option<toml::Spanned<i64>>,
    max_header_bytes: Option<ByteSize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStore {
    backend: Option<Backend>,
    url: Option<String>,
    key_prefix: Option<String>,
    op_timeout: Option<HumanDuration>,
    password_file: Option<PathBuf>,
    mode: Option<RedisMode>,
    nodes: Option<Vec<String>>,
    sentinels: Option<Vec<String>>,
    master_name: Option<String>,
    username: Option<String>,
    tls_ca_file: Option<PathBuf>,
    wait_replicas: Option<u32>,
    wait_timeout: Option<HumanDuration>,
}

/// A `[[routes]]` entry or the `[defaults]` table: the policy keys are all
/// optional, and a route inherits what it does not set from `[defaults]`.
/// (One struct rather than `#[serde(flatten)]`, which would lose the spans
/// and the unknown-key check.)
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    name: Option<toml::Spanned<String>>,
    methods: Option<toml::Spanned<Vec<ConfMethod>>>,
    path: Option<toml::Spanned<PathPattern>>,
    header: Option<ConfHeader>,
    key: Option<KeyMode>,
    ttl: Option<HumanDuration>,
    lease: Option<HumanDuration>,
    max_key_length: Option<toml::Spanned<i64>>,
    max_request_body: Option<ByteSize>,
    max_response_body: Option<ByteSize>,
    scope_headers: Option<Vec<ConfHeader>>,
    fingerprint_headers: Option<Vec<ConfHeader>>,
    concurrent: Option<Concurrent>,
    wait_timeout: Option<HumanDuration>,
    release_statuses: Option<Vec<ConfStatus>>,
    unknown_outcome: Option<UnknownOutcome>,
    fingerprint_body: Option<FingerprintBody>,
    mode: Option<Mode>,
    on_store_error: Option<OnStoreError>,
    replayed_header: Option<ConfHeader>,
}

// ---------------------------------------------------------------------------
// The checked configuration.

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub listen: String,
    pub upstream: Upstream,
    pub admin_listen: String,
    pub upstream_timeout: Duration,
    pub shutdown_grace: Duration,
    /// Request headers must arrive within this time (slowloris defence).
    pub header_read_timeout: Duration,
    /// A protected request's body must arrive within this time (408 otherwise).
    pub body_read_timeout: Duration,
    /// Client connections open at once; beyond it new ones wait in the kernel's backlog.
    pub max_connections: usize,
    /// The request line and headers together; larger → 431.
    pub max_header_bytes: usize,
}

/// The upstream base URL, checked: `http://host[:port]` with an optional path prefix.
#[derive(Clone, Debug)]
pub struct Upstream {
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    /// A path prefix without the trailing slash (empty for none).
    pub base_path: String,
}

impl Upstream {
    pub fn parse(text: &str) -> Result<Self, String> {
        let uri: http::Uri = text
            .parse()
            .map_err(|e| format!("invalid upstream URL \"{text}\": {e}"))?;
        let scheme = uri
            .scheme()
            .cloned()
            .ok_or_else(|| format!("invalid upstream URL \"{text}\": expected http://host:port"))?;
        if scheme != http::uri::Scheme::HTTP {
            return Err(format!(
                "invalid upstream URL \"{text}\": only http:// is supported (the upstream is normally on loopback in the same pod)"
            ));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("invalid upstream URL \"{text}\": missing host"))?;
        if uri.query().is_some() {
            return Err(format!(
                "invalid upstream URL \"{text}\": a query is not allowed"
            ));
        }
        let base_path = uri.path().trim_end_matches('/').to_string();
        Ok(Upstream {
            scheme,
            authority,
            base_path,
        })
    }
}

impl fmt::Display for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}{}", self.scheme, self.authority, self.base_path)
    }
}

#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub backend: Backend,
    pub url: String,
    pub key_prefix: String,
    pub op_timeout: Duration,
    pub password_file: Option<PathBuf>,
    pub mode: RedisMode,
    pub nodes: Vec<String>,
    pub sentinels: Vec<String>,
    pub master_name: Option<String>,
    pub username: Option<String>,
    pub tls_ca_file: Option<PathBuf>,
    pub wait_replicas: u32,
    pub wait_timeout: Duration,
}

/// What a protected route does; every field has a value (from the route or `[defaults]`).
#[derive(Clone, Debug)]
pub struct Policy {
    pub header: HeaderName,
    pub key: KeyMode,
    pub ttl: Duration,
    pub lease: Duration,
    pub max_key_length: usize,
    pub max_request_body: u64,
    pub max_response_body: u64,
    /// Sorted by name, so the scope hash does not depend on the order written.
    pub scope_headers: Vec<HeaderName>,
    /// Sorted by name, for the same reason.
    pub fingerprint_headers: Vec<HeaderName>,
    pub concurrent: Concurrent,
    pub wait_timeout: Duration,
    pub release_statuses: Vec<u16>,
    pub unknown_outcome: UnknownOutcome,
    pub fingerprint_body: FingerprintBody,
    pub mode: Mode,
    pub on_store_error: OnStoreError,
    pub replayed_header: HeaderName,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            header: HeaderName::from_static("idempotency-key"),
            key: KeyMode::Required,
            ttl: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(30),
            max_key_length: 255,
            max_request_body: 1 << 20,
            max_response_body: 8 << 20,
            scope_headers: vec![http::header::AUTHORIZATION],
            fingerprint_headers: Vec::new(),
            concurrent: Concurrent::Reject,
            wait_timeout: Duration::from_secs(10),
            release_statuses: vec![429, 503],
            unknown_outcome: UnknownOutcome::Store,
            fingerprint_body: FingerprintBody::Raw,
            mode: Mode::Enforce,
            on_store_error: OnStoreError::Reject,
            replayed_header: HeaderName::from_static("idempotent-replayed"),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    /// Where the configuration came from, for messages ("<defaults>" when no file was given).
    pub source: String,
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub routes: Arc<RouteTable>,
}

/// Values given on the command line or in the environment; they win over the file.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub listen: Option<String>,
    pub upstream: Option<String>,
    pub redis_url: Option<String>,
}

impl Config {
    /// Reads and checks a configuration file (or none: defaults plus overrides).
    pub fn load(path: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.to_path_buf(),
                    source,
                })?;
                Config::from_toml(&text, &path.display().to_string(), overrides)
            }
            None => Config::from_toml("", "<no config file>", overrides),
        }
    }

    /// Parses configuration text; `file` names it in error messages.
    pub fn from_toml(text: &str, file: &str, overrides: &Overrides) -> Result<Config, ConfigError> {
        let raw: RawFile = toml::from_str(text).map_err(|e| {
            let span = e.span().unwrap_or(0..0);
            located(file, text, span.start, e.message().to_string())
        })?;
        build(raw, text, file, overrides)
    }
}

fn build(raw: RawFile, text: &str, file: &str, ov: &Overrides) -> Result<Config, ConfigError> {
    let missing = |key: &str, message: &str| ConfigError::Missing {
        file: file.to_string(),
        key: key.to_string(),
        message: message.to_string(),
    };

    // [server]
    let upstream_text = ov.upstream.clone().or(raw.server.upstream).ok_or_else(|| {
        missing(
            "server.upstream",
            "required (or give --upstream / IDEMPROXY_UPSTREAM)",
        )
    })?;
    let upstream = Upstream::parse(&upstream_text)
        .map_err(|m| at_key(file, text, "upstream", "server.upstream", m))?;
    let listen = ov
        .listen
        .clone()
        .or(raw.server.listen)
        .unwrap_or_else(|| "0.0.0.0:8080".to_string());
    check_addr(&listen).map_err(|m| at_key(file, text, "listen", "server.listen", m))?;
    let admin_listen = raw
        .server
        .admin_listen
        .unwrap_or_else(|| "127.0.0.1:9901".to_string());
    check_addr(&admin_listen)
        .map_err(|m| at_key(file, text, "admin_listen", "server.admin_listen", m))?;
    let max_connections = match &raw.server.max_connections {
        None => 10_000,
        Some(v) if (1..=1_000_000).contains(v.get_ref()) => *v.get_ref() as usize,
        Some(v) => {
            return Err(located(
                file,
                text,
                v.span().start,
                format!(
                    "server.max_connections: invalid value {}: expected 1..=1000000",
                    v.get_ref()
                ),
            ))
        }
    };
    if let Some(b) = raw.server.max_header_bytes {
        if !(8192..=1 << 20).contains(&b.0) {
            return Err(at_key(
                file,
                text,
                "max_header_bytes",
                "server.max_header_bytes",
                format!("invalid value {}: expected 8KiB..=1MiB", b.0),
            ));
        }
    }
    let server = ServerConfig {
        listen,
        upstream,
        admin_listen,
        upstream_timeout: raw
            .server
            .upstream_timeout
            .map_or(Duration::from_secs(30), |d| d.0),
        shutdown_grace: raw
            .server
            .shutdown_grace
            .map_or(Duration::from_secs(20), |d| d.0),
        header_read_timeout: raw
            .server
            .header_read_timeout
            .map_or(Duration::from_secs(10), |d| d.0),
        body_read_timeout: raw
            .server
            .body_read_timeout
            .map_or(Duration::from_secs(30), |d| d.0),
        max_connections,
        max_header_bytes: raw
            .server
            .max_header_bytes
            .map_or(64 * 1024, |b| b.0 as usize),
    };

    // [store]
    let s = raw.store;
    let backend = if ov.redis_url.is_some() {
        Backend::Redis
    } else {
        s.backend.unwrap_or(Backend::Memory)
    };
    let url = ov
        .redis_url
        .clone()
        .or(s.url)
        .unwrap_or_else(|| "redis://127.0.0.1:6379/0".to_string());
    if backend == Backend::Redis && !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        return Err(at_key(
            file,
            text,
            "url",
            "store.url",
            "invalid Redis URL: expected redis:// or rediss://".to_string(),
        ));
    }
    let key_prefix = s.key_prefix.unwrap_or_else(|| "idemproxy".to_string());
    if key_prefix.is_empty() || key_prefix.bytes().any(|b| !(0x21..0x7f).contains(&b)) {
        return Err(at_key(
            file,
            text,
            "key_prefix",
            "store.key_prefix",
            format!("invalid key prefix \"{key_prefix}\": visible ASCII without spaces, not empty"),
        ));
    }
    let mode = s.mode.unwrap_or(RedisMode::Standalone);
    let store = StoreConfig {
        backend,
        url,
        key_prefix,
        op_timeout: s.op_timeout.map_or(Duration::from_millis(500), |d| d.0),
        password_file: s.password_file,
        mode,
        nodes: s.nodes.unwrap_or_default(),
        sentinels: s.sentinels.unwrap_or_default(),
        master_name: s.master_name,
        username: s.username,
        tls_ca_file: s.tls_ca_file,
        wait_replicas: s.wait_replicas.unwrap_or(0),
        wait_timeout: s.wait_timeout.map_or(Duration::from_millis(50), |d| d.0),
    };
    if backend == Backend::Redis {
        match mode {
            RedisMode::Standalone => {}
            RedisMode::Cluster if store.nodes.is_empty() => {
                return Err(missing(
                    "store.nodes",
                    "mode = \"cluster\" needs at least one seed node",
                ));
            }
            RedisMode::Sentinel if store.sentinels.is_empty() || store.master_name.is_none() => {
                return Err(missing(
                    "store.sentinels",
                    "mode = \"sentinel\" needs `sentinels` and `master_name`",
                ));
            }
            RedisMode::Cluster | RedisMode::Sentinel => {}
        }
    }

    // [defaults] then each route on top of it.
    for (key, span) in [
        ("name", raw.defaults.name.as_ref().map(|v| v.span())),
        ("methods", raw.defaults.methods.as_ref().map(|v| v.span())),
        ("path", raw.defaults.path.as_ref().map(|v| v.span())),
    ] {
        if let Some(span) = span {
            return Err(located(
                file,
                text,
                span.start,
                format!("defaults.{key}: `{key}` belongs in a [[routes]] entry, not in [defaults]"),
            ));
        }
    }
    let defaults = apply_policy(Policy::default(), &raw.defaults, text, file, "defaults")?;
    let mut names = HashSet::new();
    let mut routes = Vec::with_capacity(raw.routes.len());
    for (i, r) in raw.routes.iter().enumerate() {
        let name_field = r.name.as_ref().ok_or_else(|| {
            missing(
                &format!("routes[{i}].name"),
                "every route needs a unique `name`",
            )
        })?;
        let name = name_field.get_ref().clone();
        let at_name = |message: String| located(file, text, name_field.span().start, message);
        let name_ok = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
        if !name_ok {
            return Err(at_name(format!(
                "routes[{i}].name: invalid route name \"{name}\": use letters, digits, '_', '-', '.'"
            )));
        }
        if !names.insert(name.clone()) {
            return Err(at_name(format!(
                "routes[{i}].name: duplicate route name \"{name}\""
            )));
        }
        let path = r
            .path
            .as_ref()
            .ok_or_else(|| {
                missing(
                    &format!("routes[{i}].path"),
                    &format!("route \"{name}\" needs a `path`"),
                )
            })?
            .get_ref()
            .clone();
        let methods = match &r.methods {
            Some(m) if m.get_ref().is_empty() => {
                return Err(located(
                    file,
                    text,
                    m.span().start,
                    format!("routes[{i}].methods: route \"{name}\" lists no methods"),
                ));
            }
            Some(m) => m.get_ref().iter().map(|m| m.0.clone()).collect(),
            None => vec![Method::POST],
        };
        let policy = apply_policy(defaults.clone(), r, text, file, &format!("routes[{i}]"))?;
        routes.push(Route {
            name: crate::routes::RouteName::new(&name),
            methods,
            path,
            policy: Arc::new(policy),
        });
    }

    Ok(Config {
        source: file.to_string(),
        server,
        store,
        routes: Arc::new(RouteTable::new(routes)),
    })
}

fn apply_policy(
    mut p: Policy,
    raw: &RawPolicy,
    text: &str,
    file: &str,
    section: &str,
) -> Result<Policy, ConfigError> {
    if let Some(v) = &raw.header {
        p.header = v.0.clone();
    }
    if let Some(v) = raw.key {
        p.key = v;
    }
    if let Some(v) = raw.ttl {
        p.ttl = v.0;
    }
    if let Some(v) = raw.lease {
        p.lease = v.0;
    }
    if let Some(v) = &raw.max_key_length {
        let n = *v.get_ref();
        if !(1..=4096).contains(&n) {
            return Err(located(
                file,
                text,
                v.span().start,
                format!("{section}.max_key_length: invalid value {n}: expected 1..=4096"),
            ));
        }
        p.max_key_length = n as usize;
    }
    if let Some(v) = raw.max_request_body {
        p.max_request_body = v.0;
    }
    if let Some(v) = raw.max_response_body {
        p.max_response_body = v.0;
    }
    if let Some(v) = &raw.scope_headers {
        p.scope_headers = sorted_unique(v);
    }
    if let Some(v) = &raw.fingerprint_headers {
        p.fingerprint_headers = sorted_unique(v);
    }
    if let Some(v) = raw.concurrent {
        p.concurrent = v;
    }
    if let Some(v) = raw.wait_timeout {
        p.wait_timeout = v.0;
    }
    if let Some(v) = &raw.release_statuses {
        p.release_statuses = v.iter().map(|s| s.0).collect();
    }
    if let Some(v) = raw.unknown_outcome {
        p.unknown_outcome = v;
    }
    if let Some(v) = raw.fingerprint_body {
        p.fingerprint_body = v;
    }
    if let Some(v) = raw.mode {
        p.mode = v;
    }
    if let Some(v) = raw.on_store_error {
        p.on_store_error = v;
    }
    if let Some(v) = &raw.replayed_header {
        p.replayed_header = v.0.clone();
    }
    Ok(p)
}

fn sorted_unique(headers: &[ConfHeader]) -> Vec<HeaderName> {
    let mut v: Vec<HeaderName> = headers.iter().map(|h| h.0.clone()).collect();
    v.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    v.dedup();
    v
}

fn check_addr(addr: &str) -> Result<(), String> {
    addr.parse::<std::net::SocketAddr>()
        .map(|_| ())
        .map_err(|_| {
            format!("invalid listen address \"{addr}\": expected IP:PORT, e.g. 0.0.0.0:8080")
        })
}

/// An error at a byte offset of the file: line and column are computed, and the
/// key is read off the source line (`key = ...`) under its `[section]`.
fn located(file: &str, text: &str, offset: usize, message: String) -> ConfigError {
    let offset = offset.min(text.len());
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    let line_text = text[line_start..].lines().next().unwrap_or("");
    // The enclosing table: "[server]" → "server"; the n-th "[[routes]]" → "routes[n]".
    let section = before
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|header| {
            let name = header.trim_matches(|c| c == '[' || c == ']').trim();
            if header.starts_with("[[") {
                let index = before.lines().filter(|l| l.trim() == header).count() - 1;
                format!("{name}[{index}]")
            } else {
                name.to_string()
            }
        });
    let key_on_line = line_text
        .split_once('=')
        .map(|(k, _)| k.trim().to_string())
        .filter(|k| !k.is_empty() && !k.starts_with('['));
    let key = match (section, key_on_line) {
        (Some(s), Some(k)) => format!("{s}.{k}"),
        (None, Some(k)) => k,
        (Some(s), None) => s,
        (None, None) => "(top level)".to_string(),
    };
    // A message that already names its key ("routes[1].name: ...") keeps it.
    let (key, message) = match message.split_once(": ") {
        Some((k, m)) if k.starts_with("routes[") || k.starts_with("defaults.") => {
            (k.to_string(), m.to_string())
        }
        _ => (key, message),
    };
    ConfigError::Invalid {
        file: file.to_string(),
        line,
        column,
        key,
        message,
    }
}

/// An error about a key found by name in the source (for checks made after parsing).
fn at_key(file: &str, text: &str, name: &str, key: &str, message: String) -> ConfigError {
    let offset = text
        .lines()
        .scan(0usize, |pos, l| {
            let start = *pos;
            *pos += l.len() + 1;
            Some((start, l))
        })
        .find(|(_, l)| l.trim_start().starts_with(name) && l.contains('='))
        .map(|(start, l)| start + (l.len() - l.trim_start().len()));
    match offset {
        Some(off) => {
            let mut err = located(file, text, off, message);
            if let ConfigError::Invalid { key: k, .. } = &mut err {
                *k = key.to_string();
            }
            err
        }
        None => ConfigError::Missing {
            file: file.to_string(),
            key: key.to_string(),
            message,
        },
    }
}
