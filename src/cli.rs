//! The command line: the proxy's flags and the subcommands' arguments, and
//! the exit statuses they share.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use idemproxy::config::{HumanDuration, UpstreamProtocol};
use idemproxy_kube as inject;

/// Exit status for invalid usage or configuration.
pub(crate) const EXIT_CONFIG: u8 = 2;
/// Exit status for any other failure to start.
pub(crate) const EXIT_START: u8 = 1;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum UpstreamProtocolArg {
    Http1,
    H2c,
    Auto,
}

impl From<UpstreamProtocolArg> for UpstreamProtocol {
    fn from(p: UpstreamProtocolArg) -> UpstreamProtocol {
        match p {
            UpstreamProtocolArg::Http1 => UpstreamProtocol::Http1,
            UpstreamProtocolArg::H2c => UpstreamProtocol::H2c,
            UpstreamProtocolArg::Auto => UpstreamProtocol::Auto,
        }
    }
}

/// An idempotency-key reverse proxy: makes chosen routes of an HTTP API safe to retry.
#[derive(Debug, Parser)]
#[command(name = "idemproxy", version)]
pub(crate) struct Cli {
    /// Without a subcommand, the proxy runs.
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    /// TOML configuration file.
    #[arg(long, env = "IDEMPROXY_CONFIG", value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Address to listen on (overrides server.listen).
    #[arg(long, env = "IDEMPROXY_LISTEN", value_name = "ADDR")]
    pub(crate) listen: Option<String>,
    /// Address of the admin listener: probes, metrics (overrides server.admin_listen).
    #[arg(long, env = "IDEMPROXY_ADMIN_LISTEN", value_name = "ADDR")]
    pub(crate) admin_listen: Option<String>,
    /// Upstream base URL (overrides server.upstream).
    #[arg(
        long,
        env = "IDEMPROXY_UPSTREAM",
        value_name = "URL",
        hide_env_values = true
    )]
    pub(crate) upstream: Option<String>,
    /// Redis URL; selects the redis backend (overrides store.url).
    #[arg(
        long,
        env = "IDEMPROXY_REDIS_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    pub(crate) redis_url: Option<String>,
    /// What the proxy speaks to the upstream (overrides server.upstream_protocol).
    #[arg(
        long,
        env = "IDEMPROXY_UPSTREAM_PROTOCOL",
        value_enum,
        value_name = "PROTOCOL"
    )]
    pub(crate) upstream_protocol: Option<UpstreamProtocolArg>,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value = "text")]
    pub(crate) log_format: LogFormat,
    /// Validate the configuration, print the resolved routes and exit (0 valid, 2 not).
    #[arg(long, conflicts_with = "init_store")]
    pub(crate) check: bool,
    /// Create what the configured store needs (the PostgreSQL table; nothing
    /// for redis or memory), idempotently, and exit: 0 done, 1 the store
    /// refused or is unreachable, 2 invalid configuration.
    #[arg(long)]
    pub(crate) init_store: bool,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Adds the idemproxy sidecar to the workloads of Kubernetes manifests (YAML or JSON):
    /// manifests in, manifests out, for `kubectl apply -f -`.
    Inject(InjectArgs),
    /// Serves the mutating admission webhook that adds the sidecar to Pods as they are created.
    Injector(InjectorArgs),
    /// Drives an endpoint that claims Idempotency-Key support through the draft's requirements
    /// and common practice, and prints what it meets: exit 0 every MUST met, 1 one is not, 2 the
    /// endpoint cannot be reached (docs/conformance.md).
    Conformance(Box<ConformanceArgs>),
    /// Reads an OpenAPI 3.0/3.1 document (JSON or YAML): writes [[routes]] for its operations,
    /// or the document with what the proxy adds to the operations it protects.
    Openapi(OpenapiArgs),
}

impl Command {
    /// The subcommand as the command line spells it.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Command::Inject(_) => "inject",
            Command::Injector(_) => "injector",
            Command::Conformance(_) => "conformance",
            Command::Openapi(_) => "openapi",
        }
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct OpenapiArgs {
    #[command(subcommand)]
    pub(crate) command: OpenapiCommand,
}

#[derive(Debug, Subcommand)]
pub(crate) enum OpenapiCommand {
    /// Writes (to standard output) the [[routes]] that protect the operations marked
    /// `x-idempotency-key: required|optional`.
    Routes {
        /// Also every POST and PATCH operation (key required unless marked optional).
        #[arg(long)]
        unsafe_methods: bool,
        /// The OpenAPI document; `-` reads standard input.
        #[arg(value_name = "OPENAPI_FILE")]
        file: PathBuf,
    },
    /// Writes the document back with what the proxy adds to each operation the
    /// configuration protects: the key's header, its problem answers, the replay header.
    Annotate {
        /// The proxy's configuration file (its [server] upstream may be left out).
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// The OpenAPI document; `-` reads standard input.
        #[arg(value_name = "OPENAPI_FILE")]
        file: PathBuf,
    },
}

#[derive(Debug, clap::Args)]
pub(crate) struct InjectArgs {
    /// A configuration file for the sidecars: checked, and emitted as the ConfigMap unless the
    /// input has one by that name.
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// The ConfigMap the sidecar reads idemproxy.toml from.
    #[arg(long, value_name = "NAME", default_value = inject::DEFAULT_CONFIG_MAP)]
    pub(crate) config_map: String,
    /// The sidecar's image.
    #[arg(long, value_name = "IMAGE", default_value = inject::DEFAULT_IMAGE, value_parser = image)]
    pub(crate) image: String,
    /// Inject only this workload (repeatable): deployment/api, statefulset/db, pod/x...
    #[arg(long, value_name = "KIND/NAME")]
    pub(crate) only: Vec<String>,
    /// Inject only the workloads whose labels (or their pods') match: app=shop[,tier=web].
    #[arg(long, short = 'l', value_name = "LABEL=VALUE")]
    pub(crate) selector: Vec<String>,
    /// The port to protect in every workload, by name or number.
    #[arg(long, value_name = "NAME|NUMBER")]
    pub(crate) port: Option<String>,
    /// Also emit, per injected workload, a NetworkPolicy that lets ingress reach only the
    /// proxy's and admin ports (it closes every other port of the pod).
    #[arg(long)]
    pub(crate) network_policy: bool,
    /// The manifests; `-` or nothing reads standard input.
    #[arg(value_name = "MANIFESTS")]
    pub(crate) manifests: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub(crate) struct InjectorArgs {
    /// Address to listen on (HTTPS): IP:PORT.
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:8443", value_parser = socket_address)]
    pub(crate) listen: String,
    /// PEM certificate chain the webhook presents (re-read on SIGHUP).
    #[arg(long, value_name = "FILE")]
    pub(crate) tls_cert_file: PathBuf,
    /// PEM private key of the certificate (re-read on SIGHUP).
    #[arg(long, value_name = "FILE")]
    pub(crate) tls_key_file: PathBuf,
    /// The ConfigMap the sidecar reads idemproxy.toml from.
    #[arg(long, value_name = "NAME", default_value = inject::DEFAULT_CONFIG_MAP)]
    pub(crate) config_map: String,
    /// The sidecar's image.
    #[arg(long, value_name = "IMAGE", default_value = inject::DEFAULT_IMAGE, value_parser = image)]
    pub(crate) image: String,
    /// On SIGTERM, how long reviews are still taken (with /healthz 503) before the drain.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = shutdown_delay)]
    pub(crate) shutdown_delay: std::time::Duration,
    /// The proxy's admin port in the ConfigMap's configuration (admin_listen), for the probes.
    #[arg(long, value_name = "PORT", default_value_t = inject::DEFAULT_ADMIN_PORT)]
    pub(crate) admin_port: u16,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value = "text")]
    pub(crate) log_format: LogFormat,
}

#[derive(Debug, clap::Args)]
pub(crate) struct ConformanceArgs {
    /// The endpoint's URL (http:// or https://); its path unless --route is given.
    #[arg(value_name = "URL")]
    pub(crate) url: String,
    /// The path (and query) to send the requests to, replacing the URL's.
    #[arg(long, value_name = "PATH")]
    pub(crate) route: Option<String>,
    /// The method of every request.
    #[arg(long, default_value = "POST")]
    pub(crate) method: http::Method,
    /// The JSON body: {{seq}} becomes a number per request, {{run}} the run's id.
    #[arg(long, value_name = "TEMPLATE", default_value = idemproxy::conformance::DEFAULT_BODY)]
    pub(crate) body: String,
    /// A header sent with every request, e.g. auth (repeatable).
    #[arg(long = "header", value_name = "NAME: VALUE", value_parser = conformance_header)]
    pub(crate) headers: Vec<(http::HeaderName, http::HeaderValue)>,
    /// The header that carries the key.
    #[arg(long, value_name = "NAME", default_value = "Idempotency-Key")]
    pub(crate) key_header: http::HeaderName,
    /// The route does not require a key: skip the missing-key rows.
    #[arg(long)]
    pub(crate) key_optional: bool,
    /// A GET URL answering the number of executions so far (a number, or JSON with one),
    /// read before and after each check to count executions exactly.
    #[arg(long, value_name = "URL", value_parser = conformance_url)]
    pub(crate) executions: Option<http::Uri>,
    /// Another principal's credentials ('Authorization: Bearer other') for the key-scope row.
    #[arg(long, value_name = "NAME: VALUE", value_parser = conformance_header)]
    pub(crate) other_principal: Option<(http::HeaderName, http::HeaderValue)>,
    /// Simultaneous identical requests in the concurrency check.
    #[arg(long, default_value_t = idemproxy::conformance::DEFAULT_CONCURRENCY)]
    pub(crate) concurrency: usize,
    /// The deadline of every request.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = human_duration)]
    pub(crate) timeout: std::time::Duration,
    /// For https://: trust only the CA certificates of this PEM file (default: the system's roots).
    #[arg(long, value_name = "FILE")]
    pub(crate) ca_file: Option<PathBuf>,
    /// Also write the rows as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub(crate) report: Option<PathBuf>,
}

pub(crate) fn conformance_header(
    line: &str,
) -> Result<(http::HeaderName, http::HeaderValue), String> {
    idemproxy::conformance::header_line(line).map_err(|e| e.to_string())
}

pub(crate) fn conformance_url(text: &str) -> Result<http::Uri, String> {
    idemproxy::conformance::http_url(text).map_err(|e| e.to_string())
}

/// A duration as the configuration writes it (`5s`, `250ms`).
pub(crate) fn human_duration(text: &str) -> Result<std::time::Duration, String> {
    HumanDuration::parse(text).map(|d| d.0)
}

/// `--image`: a reference registries and the kubelet take (exit 2 otherwise).
fn image(s: &str) -> Result<String, String> {
    inject::check_image(s).map(|()| s.to_string())
}

/// `--listen` of the injector: IP:PORT, as the proxy's listeners (exit 2 otherwise).
fn socket_address(s: &str) -> Result<String, String> {
    s.parse::<std::net::SocketAddr>()
        .map(|_| s.to_string())
        .map_err(|_| "expected IP:PORT, as 0.0.0.0:8443".to_string())
}

/// `--shutdown-delay`: at most a minute (the Pod's grace period must cover it
/// and the drain; Kubernetes' default is 30 s).
fn shutdown_delay(text: &str) -> Result<std::time::Duration, String> {
    let delay = human_duration(text)?;
    if delay > std::time::Duration::from_secs(60) {
        return Err(
            "at most 60s (terminationGracePeriodSeconds must cover it and 5 s of drain)".into(),
        );
    }
    Ok(delay)
}
