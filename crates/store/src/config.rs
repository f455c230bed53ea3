//! What the store is told by the configuration: the `[store]` section as
//! the proxy's configuration checked and built it.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// The `[store]` section, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
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
    /// The memory store's bound on the bytes of its records (docs/reference/store.md#memory).
    pub memory_limit: u64,
    /// Keys that seal finished records at rest (docs/reference/store.md#sealing); read by the
    /// store, not here.
    pub encryption_key_file: Option<PathBuf>,
    /// A finished record that is not sealed is unreadable
    /// (docs/reference/failures.md#unreadable): nobody with
    /// write access to the store can plant a clear answer to be replayed.
    pub require_sealed: bool,
    /// PostgreSQL: whether and how the connection uses TLS.
    pub sslmode: SslMode,
    /// PostgreSQL: the records' table (a plain lower-case identifier).
    pub table: String,
    /// PostgreSQL: the most connections one proxy opens.
    pub pool_size: usize,
}

/// PostgreSQL's `sslmode`, as far as the proxy implements it: `disable`,
/// `prefer` (TLS when a `tls_ca_file` is given and the server offers it),
/// and `require`, `verify-ca`, `verify-full` (TLS, the server's certificate
/// checked against `tls_ca_file`, its name included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// Would the Redis store take `url` (the part of its reading that needs no
/// server: the scheme, host, port, database number)? The error names what is
/// wrong and never repeats the URL, which may hold a password.
pub fn check_redis_url(url: &str) -> Result<(), String> {
    use redis::IntoConnectionInfo as _;
    url.into_connection_info()
        .map(|_| ())
        // redis-rs's messages for a URL are fixed texts ("Invalid database
        // number"), never the URL.
        .map_err(|e| e.to_string())
}

impl SslMode {
    pub const NAMES: [&'static str; 5] =
        ["disable", "prefer", "require", "verify-ca", "verify-full"];

    pub fn parse(s: &str) -> Option<SslMode> {
        Some(match s {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    /// The name as the configuration spells it.
    pub fn name(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// TLS is a must (no plain connection is ever made).
    pub fn required(self) -> bool {
        matches!(
            self,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Memory,
    Redis,
    Postgres,
}

/// The spelling the configuration file uses, for `--check` and logs.
impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Memory => "memory",
            Backend::Redis => "redis",
            Backend::Postgres => "postgres",
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RedisMode {
    Standalone,
    Cluster,
    Sentinel,
}
