//! Configuration: the TOML file (plus command-line overrides) turned into a typed, checked [`Config`].
//!
//! Every value that can be wrong is parsed while the file is read, so a typo
//! fails at load time with the file, the line and column, and the key. The
//! rooms: `grammar` (durations, sizes and other values), `raw` (the file as
//! written), `build` (the checks that turn it into a `Config`); the route
//! policy itself is [`crate::policy`].

pub use idemproxy_store::config::{Backend, RedisMode, SslMode, StoreConfig};
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::routes::RouteTable;

mod build;
pub use build::telemetry::shown_endpoint;
mod grammar;
mod raw;

pub use grammar::{ByteSize, HumanDuration};

/// A configuration problem, ready to print: it names the file, the place and the key,
/// or the flag the value came from.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read configuration file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A value in the file is wrong.
    #[error("{file}:{line}:{column}: {key}: {message}")]
    Invalid {
        file: String,
        line: usize,
        column: usize,
        key: String,
        message: String,
    },
    /// The text is not TOML: there is a place but no key to name.
    #[error("{file}:{line}:{column}: {message}")]
    Syntax {
        file: String,
        line: usize,
        column: usize,
        message: String,
    },
    /// A required value is absent, so there is no place in the file to point at.
    #[error("{file}: {key}: {message}")]
    Missing {
        file: String,
        key: String,
        message: String,
    },
    /// A value given on the command line or in the environment is wrong.
    #[error("{} ({}): {message}", flag.name, flag.env)]
    Override { flag: Flag, message: String },
    /// A standard OpenTelemetry environment variable that fills in a
    /// `[telemetry]` key the file does not set is wrong.
    #[error("environment variable {var}: {message}")]
    Env { var: &'static str, message: String },
}

/// A command-line flag and the environment variable that stands in for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flag {
    pub name: &'static str,
    pub env: &'static str,
}

#[derive(Clone, Debug)]
pub struct Config {
    /// Where the configuration came from, for messages (`<no config file>` when no file was given).
    pub source: String,
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub routes: Arc<RouteTable>,
    /// Distributed tracing (docs/telemetry.md); read at start only: a
    /// change needs a restart (SIGHUP does not apply it).
    pub telemetry: TelemetryConfig,
}

/// `[telemetry]`, with the standard OpenTelemetry environment variables
/// filling in what the file does not set (docs/telemetry.md#configuration).
#[derive(Clone, Debug, PartialEq)]
pub struct TelemetryConfig {
    /// Where spans go (OTLP); `None`: tracing is off, and costs nothing.
    pub otlp_endpoint: Option<String>,
    pub otlp_protocol: OtlpProtocol,
    /// The `service.name` resource attribute.
    pub service_name: String,
    /// Root spans sampled at this ratio.
    pub sample_ratio: f64,
    /// What a client's `traceparent` decides.
    pub client_context: ClientContext,
    /// Resource attributes from `OTEL_RESOURCE_ATTRIBUTES`, in order.
    pub resource_attributes: Vec<(String, String)>,
    /// Headers sent with every export (`OTEL_EXPORTER_OTLP_HEADERS`, then
    /// `OTEL_EXPORTER_OTLP_TRACES_HEADERS`, which wins for a name in both).
    pub headers: Vec<(http::HeaderName, http::HeaderValue)>,
}

/// What a client's W3C trace context decides (`[telemetry] client_context`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ClientContext {
    /// The request's spans join the client's trace; its sampled flag is followed.
    #[default]
    Follow,
    /// A new trace, sampled at `sample_ratio`, its SERVER span linked to the client's.
    Link,
    /// A new trace, sampled at `sample_ratio`; the client's context is not read.
    Ignore,
}

impl ClientContext {
    pub fn parse(text: &str) -> Option<ClientContext> {
        match text {
            "follow" => Some(ClientContext::Follow),
            "link" => Some(ClientContext::Link),
            "ignore" => Some(ClientContext::Ignore),
            _ => None,
        }
    }
}

/// The spelling the configuration file uses.
impl fmt::Display for ClientContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ClientContext::Follow => "follow",
            ClientContext::Link => "link",
            ClientContext::Ignore => "ignore",
        })
    }
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            otlp_protocol: OtlpProtocol::Grpc,
            service_name: "idemproxy".to_string(),
            sample_ratio: 1.0,
            client_context: ClientContext::Follow,
            resource_attributes: Vec::new(),
            headers: Vec::new(),
        }
    }
}

/// How spans are sent to the collector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (a collector's port 4317).
    Grpc,
    /// OTLP/HTTP with protobuf bodies (port 4318, path `/v1/traces`).
    HttpProtobuf,
}

impl OtlpProtocol {
    pub fn parse(text: &str) -> Option<OtlpProtocol> {
        match text {
            "grpc" => Some(OtlpProtocol::Grpc),
            "http/protobuf" => Some(OtlpProtocol::HttpProtobuf),
            _ => None,
        }
    }
}

/// The spelling the configuration file uses.
impl fmt::Display for OtlpProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OtlpProtocol::Grpc => "grpc",
            OtlpProtocol::HttpProtobuf => "http/protobuf",
        })
    }
}

/// Values given on the command line or in the environment; they win over the file.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub listen: Option<String>,
    pub upstream: Option<String>,
    pub redis_url: Option<String>,
    /// `--upstream-protocol`: lets one shared configuration file serve a
    /// gRPC workload (h2c) beside HTTP/1.1 ones, as `idemproxy inject` does.
    pub upstream_protocol: Option<UpstreamProtocol>,
    /// `--admin-listen`: the sidecar `idemproxy inject` adds sets it, so that
    /// the kubelet can probe a proxy whose file leaves `admin_listen` on loopback.
    pub admin_listen: Option<String>,
}

impl Overrides {
    pub(crate) const LISTEN: Flag = Flag {
        name: "--listen",
        env: "IDEMPROXY_LISTEN",
    };
    pub const UPSTREAM: Flag = Flag {
        name: "--upstream",
        env: "IDEMPROXY_UPSTREAM",
    };
    pub(crate) const REDIS_URL: Flag = Flag {
        name: "--redis-url",
        env: "IDEMPROXY_REDIS_URL",
    };
    pub(crate) const ADMIN_LISTEN: Flag = Flag {
        name: "--admin-listen",
        env: "IDEMPROXY_ADMIN_LISTEN",
    };
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    pub listen: String,
    pub upstream: UpstreamUrl,
    pub admin_listen: String,
    pub upstream_timeout: Duration,
    pub shutdown_grace: Duration,
    /// Request headers must arrive within this time (slowloris defence).
    pub header_read_timeout: Duration,
    /// A protected request's body must arrive within this time (408 otherwise).
    pub body_read_timeout: Duration,
    /// Client connections open at once; beyond it new ones wait in the
    /// kernel's backlog. Also the requests in progress at once, for HTTP/1.1
    /// and for HTTP/2 each (a request counts until its upstream exchange ends).
    pub max_connections: usize,
    /// Threads that run requests; 0: one per CPU the process may run on.
    pub workers: usize,
    /// How those threads share the work.
    pub runtime: Runtime,
    /// The request line and headers together; larger → 431.
    pub max_header_bytes: usize,
    /// Bytes held at once for protected request bodies, responses being
    /// recorded and replays being written (docs/reference/behaviour.md#memory-budget); beyond
    /// it, 503 `proxy-busy`.
    pub max_buffered: u64,
    /// A client that accepts no bytes of an answer for this long is
    /// disconnected; so is an HTTP/2 client whose window keeps one answer's
    /// data waiting this long.
    pub client_write_timeout: Duration,
    /// Idle keep-alive client connections are closed after this.
    pub idle_timeout: Duration,
    /// Idle upstream connections are closed after this: under the keep-alive
    /// timeout of common application servers, so that a request is not
    /// written onto a connection the upstream is closing.
    pub upstream_idle_timeout: Duration,
    /// What the proxy speaks to the upstream.
    pub upstream_protocol: UpstreamProtocol,
    /// Send the upstream the normalised path the routes matched rather than
    /// the request-target as the client wrote it (docs/routes-and-keys.md#forward-normalised-path).
    pub forward_normalised_path: bool,
    /// TLS on the client-facing listener; `None` for plain HTTP (and h2c).
    pub tls: Option<TlsFiles>,
}

/// The PEM files of the listener's certificate: both given or neither. Only
/// the paths are configuration; the files are read at start and on SIGHUP
/// (`crate::tls`), so that `--check` can run where the secrets are not mounted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, the server's own certificate first.
    pub cert_file: PathBuf,
    /// The private key of the first certificate (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

/// How the worker threads share the work (`[server] runtime`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Runtime {
    /// Each worker thread runs a runtime of its own and serves the
    /// connections handed to it from start to end, with its own store
    /// connection and upstream pool (`crate::workers`).
    PerThread,
    /// One tokio runtime whose workers steal each other's tasks.
    WorkStealing,
}

impl fmt::Display for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Runtime::PerThread => "per_thread",
            Runtime::WorkStealing => "work_stealing",
        })
    }
}

impl ServerConfig {
    /// The worker threads to run: `workers`, or with 0 one per CPU this
    /// process may run on (its affinity and cgroup quota).
    pub fn worker_threads(&self) -> usize {
        match self.workers {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }

    /// Places for per-worker things (`crate::workers::PerWorker`): one per
    /// worker thread and one for every other thread; one in all when the
    /// workers share one runtime.
    pub fn worker_slots(&self) -> usize {
        match self.runtime {
            Runtime::PerThread => self.worker_threads() + 1,
            Runtime::WorkStealing => 1,
        }
    }
}

/// The protocol of the requests sent to the upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamProtocol {
    /// HTTP/1.1, whatever the client spoke (the default: every server speaks it).
    Http1,
    /// Cleartext HTTP/2 with prior knowledge, whatever the client spoke.
    H2c,
    /// The inbound request's version: HTTP/2 for HTTP/2 (e.g. gRPC), else HTTP/1.1.
    Auto,
}

/// The spelling the configuration file uses, for logs.
impl fmt::Display for UpstreamProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            UpstreamProtocol::Http1 => "http1",
            UpstreamProtocol::H2c => "h2c",
            UpstreamProtocol::Auto => "auto",
        })
    }
}

/// The upstream base URL, checked: `http://host[:port]` with an optional path prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamUrl {
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    /// A path prefix without the trailing slash (empty for none).
    pub base_path: String,
}

impl UpstreamUrl {
    /// The messages never repeat `text`: a URL may carry a password, even
    /// one that does not parse as such.
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = |why: &str| Err(format!("invalid upstream URL: {why}"));
        if text.contains('@') {
            return bad(
                "it carries credentials (user:password@), which the proxy never sends upstream \
                 (the client's own Authorization header goes through); remove them",
            );
        }
        if text.contains('#') {
            return bad("a fragment (#) is not allowed");
        }
        let Ok(uri) = text.parse::<http::Uri>() else {
            return bad("expected http://host:port with an optional path");
        };
        let Some(scheme) = uri.scheme().cloned() else {
            return bad("expected http://host:port");
        };
        if scheme != http::uri::Scheme::HTTP {
            return bad(
                "only http:// is supported (the upstream is normally on loopback in the same pod)",
            );
        }
        let Some(authority) = uri.authority().cloned() else {
            return bad("missing host");
        };
        if authority.host().is_empty() {
            return bad("missing host");
        }
        // `http` takes `host:abc` (and uses port 80): a port is 1 to 65535.
        if let Some(port) = authority
            .as_str()
            .rsplit_once(':')
            .map(|(_, p)| p)
            .filter(|_| !authority.as_str().ends_with(']'))
        {
            if port.parse::<u16>().map_or(true, |p| p == 0) {
                return bad("the port is not a number from 1 to 65535");
            }
        }
        if uri.query().is_some() {
            return bad("a query is not allowed");
        }
        let base_path = uri.path().trim_end_matches('/').to_string();
        Ok(UpstreamUrl {
            scheme,
            authority,
            base_path,
        })
    }
}

impl fmt::Display for UpstreamUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}{}", self.scheme, self.authority, self.base_path)
    }
}

impl Config {
    /// Reads and checks a configuration file (or none: defaults plus overrides).
    pub fn load(path: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        match path {
            Some(path) => {
                let text = crate::store::files::read_regular_text(
                    path,
                    crate::store::files::CONFIG_FILE_LIMIT,
                )
                .map_err(|source| ConfigError::Read {
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
        let source = Source { file, text };
        let raw = toml::from_str(text).map_err(|e| source.toml_error(&e))?;
        build::build(raw, &source, overrides)
    }
}

/// The configuration text and its name: turns the parser's byte spans into messages.
struct Source<'a> {
    file: &'a str,
    text: &'a str,
}

/// Where a value that can be wrong came from.
enum Origin {
    /// The value's span in the file.
    File(Range<usize>),
    Flag(Flag),
    /// Not given: the built-in default (which is valid).
    Default,
}

impl Source<'_> {
    /// An error from toml itself, at its own span; the key is the parser's, when the text is TOML.
    fn toml_error(&self, e: &toml::de::Error) -> ConfigError {
        let offset = e.span().map_or(0, |s| s.start);
        let message = e.message().trim_end().to_string();
        match raw::key_at(self.text, offset) {
            Some(key) => self.invalid(offset, key, message),
            None => {
                let (line, column) = line_column(self.text, offset);
                ConfigError::Syntax {
                    file: self.file.to_string(),
                    line,
                    column,
                    message,
                }
            }
        }
    }

    /// An error at a byte offset of the file about `key`.
    fn invalid(
        &self,
        offset: usize,
        key: impl Into<String>,
        message: impl Into<String>,
    ) -> ConfigError {
        let (line, column) = line_column(self.text, offset);
        ConfigError::Invalid {
            file: self.file.to_string(),
            line,
            column,
            key: key.into(),
            message: message.into(),
        }
    }

    /// An error about a whole `key = value` entry: at the key, where the parser found it
    /// (the value's span when the key cannot be found, e.g. inside an inline table).
    fn entry(&self, value: &Range<usize>, key: &str, message: impl Into<String>) -> ConfigError {
        let offset = raw::key_start(self.text, key).unwrap_or(value.start);
        self.invalid(offset, key, message)
    }

    /// An error about an entry given in the file or by a flag.
    fn given(&self, origin: &Origin, key: &str, message: impl Into<String>) -> ConfigError {
        match origin {
            Origin::File(span) => self.entry(span, key, message),
            Origin::Flag(flag) => ConfigError::Override {
                flag: *flag,
                message: message.into(),
            },
            Origin::Default => self.missing(key, message),
        }
    }

    fn missing(&self, key: &str, message: impl Into<String>) -> ConfigError {
        ConfigError::Missing {
            file: self.file.to_string(),
            key: key.to_string(),
            message: message.into(),
        }
    }
}

/// The 1-based line and column of a byte offset, the column in characters as
/// an editor counts them. A `\r` before the `\n` of a CRLF line ends the line
/// and is never before a column on it; an offset inside a character (which the
/// parser never gives) counts as that character.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line = before.matches('\n').count() + 1;
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::line_column;

    #[test]
    fn columns_count_characters_and_crlf_lines_count_once() {
        let text = "a = 1\r\n# café ☕\r\nbad";
        let offset = text.find("bad").unwrap();
        assert_eq!(line_column(text, offset), (3, 1));
        let cup = text.find('☕').unwrap();
        assert_eq!(line_column(text, cup), (2, 8));
        assert_eq!(line_column(text, cup + 1), (2, 8), "inside a character");
        assert_eq!(line_column(text, text.len() + 10), (3, 4), "past the end");
    }
}

#[cfg(test)]
mod telemetry_tests {
    use super::build::telemetry;
    use super::raw::RawFile;
    use super::{ClientContext, ConfigError, OtlpProtocol, Source, TelemetryConfig};

    /// `[telemetry]` from `text`, with `vars` as the whole environment.
    fn load(text: &str, vars: &[(&str, &str)]) -> Result<TelemetryConfig, ConfigError> {
        let raw: RawFile = toml::from_str(text).map_err(|e| {
            let src = Source {
                file: "t.toml",
                text,
            };
            src.toml_error(&e)
        })?;
        let src = Source {
            file: "t.toml",
            text,
        };
        let env = |k: &str| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        };
        telemetry(raw.telemetry, &src, &env)
    }

    #[test]
    fn off_by_default() {
        let t = load("", &[]).unwrap();
        assert_eq!(t, TelemetryConfig::default());
        assert_eq!(t.otlp_endpoint, None);
        assert_eq!(t.otlp_protocol, OtlpProtocol::Grpc);
        assert_eq!(t.service_name, "idemproxy");
        assert_eq!(t.sample_ratio, 1.0);
    }

    #[test]
    fn the_file_sets_every_key() {
        let text = "[telemetry]\notlp_endpoint = \"http://collector:4318\"\notlp_protocol = \"http/protobuf\"\nservice_name = \"pay-proxy\"\nsample_ratio = 0.25\n";
        let t = load(text, &[]).unwrap();
        assert_eq!(t.otlp_endpoint.as_deref(), Some("http://collector:4318"));
        assert_eq!(t.otlp_protocol, OtlpProtocol::HttpProtobuf);
        assert_eq!(t.service_name, "pay-proxy");
        assert_eq!(t.sample_ratio, 0.25);
        // A whole number is a ratio too.
        let t = load("[telemetry]\nsample_ratio = 0\n", &[]).unwrap();
        assert_eq!(t.sample_ratio, 0.0);
    }

    #[test]
    fn the_standard_variables_fill_in_what_the_file_does_not_set() {
        let vars = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_SERVICE_NAME", "from-env"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.5"),
        ];
        let t = load("", &vars).unwrap();
        assert_eq!(t.otlp_endpoint.as_deref(), Some("http://env:4317"));
        assert_eq!(t.otlp_protocol, OtlpProtocol::HttpProtobuf);
        assert_eq!(t.service_name, "from-env");
        assert_eq!(t.sample_ratio, 0.5);
        // The file wins over every one of them.
        let text = "[telemetry]\notlp_endpoint = \"http://file:4317\"\notlp_protocol = \"grpc\"\nservice_name = \"file\"\nsample_ratio = 1.0\n";
        let t = load(text, &vars).unwrap();
        assert_eq!(t.otlp_endpoint.as_deref(), Some("http://file:4317"));
        assert_eq!(t.otlp_protocol, OtlpProtocol::Grpc);
        assert_eq!(t.service_name, "file");
        assert_eq!(t.sample_ratio, 1.0);
        // An empty variable is unset.
        let t = load("", &[("OTEL_EXPORTER_OTLP_ENDPOINT", "")]).unwrap();
        assert_eq!(t.otlp_endpoint, None);
    }

    /// `client_context`; the resource's attributes and the export's
    /// headers as the OpenTelemetry variables list them (percent-decoded; the
    /// traces variable wins for a header in both).
    #[test]
    fn client_context_resource_attributes_and_export_headers() {
        assert_eq!(load("", &[]).unwrap().client_context, ClientContext::Follow);
        for (text, mode) in [
            ("follow", ClientContext::Follow),
            ("link", ClientContext::Link),
            ("ignore", ClientContext::Ignore),
        ] {
            let t = load(&format!("[telemetry]\nclient_context = \"{text}\"\n"), &[]).unwrap();
            assert_eq!(t.client_context, mode);
            assert_eq!(mode.to_string(), text);
        }
        let vars = [
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                "deployment.environment=prod, service.version = 1.4.2,team=a%2Cb",
            ),
            ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=k1,x-tenant=t"),
            ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "api-key=k2"),
        ];
        let t = load("", &vars).unwrap();
        let pairs = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            t.resource_attributes,
            pairs(&[
                ("deployment.environment", "prod"),
                ("service.version", "1.4.2"),
                ("team", "a,b")
            ])
        );
        let headers: Vec<(String, String)> = t
            .headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_string()))
            .collect();
        assert_eq!(headers, pairs(&[("x-tenant", "t"), ("api-key", "k2")]));
    }

    /// Found by review: a mistyped list echoed its secret in the error,
    /// and headers that frame the export could be set.
    #[test]
    fn list_errors_name_no_value_and_framing_headers_are_refused() {
        for (var, value) in [
            ("OTEL_EXPORTER_OTLP_HEADERS", "authorization: Bearer s3cr3t"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=s3cr3t%zz"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=Bearer tok,s3cr3t"),
            ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x=s3cr3t\u{1}"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://user:s3cr3t 2@c:4317"),
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "http://c:4317/?api_key=s3cr3t",
            ),
            ("OTEL_EXPORTER_OTLP_HEADERS", "api-key:s3cr3tdG9rZW4="),
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "x=1,Authorization:Bearer_s3cr3t=",
            ),
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "https://c.example/s3cr3t/v1/traces",
            ),
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "http://c:4318/v1/traces#s3cr3t",
            ),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://:4318/s3cr3t"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:99999/s3cr3t"),
        ] {
            let e = load("", &[(var, value)]).unwrap_err();
            assert!(!e.to_string().contains("s3cr3t"), "{var}={value}: {e}");
        }
        for name in [
            "content-length",
            "Transfer-Encoding",
            "te",
            "host",
            "content-type",
        ] {
            let e = load("", &[("OTEL_EXPORTER_OTLP_HEADERS", &format!("{name}=1"))]);
            assert!(matches!(e, Err(ConfigError::Env { .. })), "{name}: {e:?}");
        }
    }

    /// The endpoint as errors, `--check` and the start-up line show it: no
    /// path, query or fragment (a token may be there); header values hidden.
    #[test]
    fn an_endpoint_is_shown_without_its_path() {
        use super::shown_endpoint;
        assert_eq!(shown_endpoint("http://c:4317"), "http://c:4317");
        assert_eq!(shown_endpoint("http://c:4318/"), "http://c:4318");
        assert_eq!(shown_endpoint("http://c/tok/v1/traces"), "http://c/…");
        assert_eq!(shown_endpoint("not a url at all"), "(not a URL)");
        let t = load("", &[("OTEL_EXPORTER_OTLP_HEADERS", "api-key=k")]).unwrap();
        assert!(!format!("{t:?}").contains("\"k\""), "{t:?}");
    }

    /// Found by review: `service.name` in `OTEL_RESOURCE_ATTRIBUTES` names
    /// the service unless the file or `OTEL_SERVICE_NAME` does (as the
    /// OpenTelemetry SDKs have it).
    #[test]
    fn the_resource_attribute_names_the_service_unless_something_else_does() {
        let attrs = ("OTEL_RESOURCE_ATTRIBUTES", "service.name=payments-api,x=1");
        assert_eq!(load("", &[attrs]).unwrap().service_name, "payments-api");
        let named = ("OTEL_SERVICE_NAME", "from-env");
        assert_eq!(load("", &[attrs, named]).unwrap().service_name, "from-env");
        let file = "[telemetry]\nservice_name = \"file\"\n";
        assert_eq!(load(file, &[attrs]).unwrap().service_name, "file");
    }

    #[test]
    fn bad_values_are_errors_at_their_place() {
        let cases = [
            (
                "otlp_endpoint = \"collector:4317\"",
                "telemetry.otlp_endpoint",
            ),
            ("otlp_endpoint = \"ftp://c:1\"", "telemetry.otlp_endpoint"),
            (
                "otlp_endpoint = \"https://c:4317\"",
                "telemetry.otlp_endpoint",
            ),
            (
                "otlp_endpoint = \"http://user:secret@c:4317\"",
                "telemetry.otlp_endpoint",
            ),
            ("otlp_protocol = \"http/json\"", "telemetry.otlp_protocol"),
            ("service_name = \"\"", "telemetry.service_name"),
            ("sample_ratio = 1.5", "telemetry.sample_ratio"),
            ("sample_ratio = -0.1", "telemetry.sample_ratio"),
            ("client_context = \"trust\"", "telemetry.client_context"),
        ];
        for (line, key) in cases {
            let text = format!("[telemetry]\n{line}\n");
            match load(&text, &[]) {
                Err(e @ ConfigError::Invalid { line: 2, .. }) => {
                    let ConfigError::Invalid { key: ref k, .. } = e else {
                        unreachable!()
                    };
                    assert_eq!(k, key, "{line}");
                    assert!(!e.to_string().contains("secret"), "{e}");
                }
                other => panic!("{line}: {other:?}"),
            }
        }
        // Unknown keys are refused, like in every other table.
        let e = load("[telemetry]\notlp_endpont = \"http://c:4317\"\n", &[]).unwrap_err();
        assert!(
            e.to_string().contains("unknown field `otlp_endpont`"),
            "{e}"
        );
        // A bad variable names itself.
        for (var, value) in [
            ("OTEL_TRACES_SAMPLER_ARG", "half"),
            ("OTEL_TRACES_SAMPLER_ARG", "2"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "not a url"),
            ("OTEL_RESOURCE_ATTRIBUTES", "env"),
            ("OTEL_RESOURCE_ATTRIBUTES", "a=%zz"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "bad name=1"),
            ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x=a%0Ab"),
        ] {
            match load("", &[(var, value)]) {
                Err(ConfigError::Env { var: v, .. }) => assert_eq!(v, var),
                other => panic!("{var}={value}: {other:?}"),
            }
        }
    }
}
