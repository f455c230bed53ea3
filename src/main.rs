//! The `idemproxy` binary: command line, logging, exit codes. The work is in the library.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand, ValueEnum};
use idemproxy::config::{Backend, Config, HumanDuration, Overrides, Runtime, UpstreamProtocol};
use idemproxy::seal;
use idemproxy::server::{Server, StartError};
use idemproxy::store::postgres;
use idemproxy::tls::{self, Certificates};
use idemproxy_kube::{self as inject, PortRef};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum UpstreamProtocolArg {
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
struct Cli {
    /// Without a subcommand, the proxy runs.
    #[command(subcommand)]
    command: Option<Command>,
    /// TOML configuration file.
    #[arg(long, env = "IDEMPROXY_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Address to listen on (overrides server.listen).
    #[arg(long, env = "IDEMPROXY_LISTEN", value_name = "ADDR")]
    listen: Option<String>,
    /// Address of the admin listener: probes, metrics (overrides server.admin_listen).
    #[arg(long, env = "IDEMPROXY_ADMIN_LISTEN", value_name = "ADDR")]
    admin_listen: Option<String>,
    /// Upstream base URL (overrides server.upstream).
    #[arg(long, env = "IDEMPROXY_UPSTREAM", value_name = "URL")]
    upstream: Option<String>,
    /// Redis URL; selects the redis backend (overrides store.url).
    #[arg(
        long,
        env = "IDEMPROXY_REDIS_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    redis_url: Option<String>,
    /// What the proxy speaks to the upstream (overrides server.upstream_protocol).
    #[arg(
        long,
        env = "IDEMPROXY_UPSTREAM_PROTOCOL",
        value_enum,
        value_name = "PROTOCOL"
    )]
    upstream_protocol: Option<UpstreamProtocolArg>,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Validate the configuration, print the resolved routes and exit (0 valid, 2 not).
    #[arg(long, conflicts_with = "init_store")]
    check: bool,
    /// Create what the configured store needs (the PostgreSQL table; nothing
    /// for redis or memory), idempotently, and exit: 0 done, 1 the store
    /// refused or is unreachable, 2 invalid configuration.
    #[arg(long)]
    init_store: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
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

#[derive(Debug, clap::Args)]
struct OpenapiArgs {
    #[command(subcommand)]
    command: OpenapiCommand,
}

#[derive(Debug, Subcommand)]
enum OpenapiCommand {
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
struct InjectArgs {
    /// A configuration file for the sidecars: checked, and emitted as the ConfigMap unless the
    /// input has one by that name.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The ConfigMap the sidecar reads idemproxy.toml from.
    #[arg(long, value_name = "NAME", default_value = inject::DEFAULT_CONFIG_MAP)]
    config_map: String,
    /// The sidecar's image.
    #[arg(long, value_name = "IMAGE", default_value = inject::DEFAULT_IMAGE)]
    image: String,
    /// Inject only this workload (repeatable): deployment/api, statefulset/db, pod/x...
    #[arg(long, value_name = "KIND/NAME")]
    only: Vec<String>,
    /// Inject only the workloads whose labels (or their pods') match: app=shop[,tier=web].
    #[arg(long, short = 'l', value_name = "LABEL=VALUE")]
    selector: Vec<String>,
    /// The port to protect in every workload, by name or number.
    #[arg(long, value_name = "NAME|NUMBER")]
    port: Option<String>,
    /// Also emit, per injected workload, a NetworkPolicy that lets ingress reach only the
    /// proxy's and admin ports (it closes every other port of the pod).
    #[arg(long)]
    network_policy: bool,
    /// The manifests; `-` or nothing reads standard input.
    #[arg(value_name = "MANIFESTS")]
    manifests: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct InjectorArgs {
    /// Address to listen on (HTTPS).
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:8443")]
    listen: String,
    /// PEM certificate chain the webhook presents (re-read on SIGHUP).
    #[arg(long, value_name = "FILE")]
    tls_cert_file: PathBuf,
    /// PEM private key of the certificate (re-read on SIGHUP).
    #[arg(long, value_name = "FILE")]
    tls_key_file: PathBuf,
    /// The ConfigMap the sidecar reads idemproxy.toml from.
    #[arg(long, value_name = "NAME", default_value = inject::DEFAULT_CONFIG_MAP)]
    config_map: String,
    /// The sidecar's image.
    #[arg(long, value_name = "IMAGE", default_value = inject::DEFAULT_IMAGE)]
    image: String,
    /// The proxy's admin port in the ConfigMap's configuration (admin_listen), for the probes.
    #[arg(long, value_name = "PORT", default_value_t = inject::DEFAULT_ADMIN_PORT)]
    admin_port: u16,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
}

#[derive(Debug, clap::Args)]
struct ConformanceArgs {
    /// The endpoint's URL (http:// or https://); its path unless --route is given.
    #[arg(value_name = "URL")]
    url: String,
    /// The path (and query) to send the requests to, replacing the URL's.
    #[arg(long, value_name = "PATH")]
    route: Option<String>,
    /// The method of every request.
    #[arg(long, default_value = "POST")]
    method: http::Method,
    /// The JSON body: {{seq}} becomes a number per request, {{run}} the run's id.
    #[arg(long, value_name = "TEMPLATE", default_value = idemproxy::conformance::DEFAULT_BODY)]
    body: String,
    /// A header sent with every request, e.g. auth (repeatable).
    #[arg(long = "header", value_name = "NAME: VALUE", value_parser = conformance_header)]
    headers: Vec<(http::HeaderName, http::HeaderValue)>,
    /// The header that carries the key.
    #[arg(long, value_name = "NAME", default_value = "Idempotency-Key")]
    key_header: http::HeaderName,
    /// The route does not require a key: skip the missing-key rows.
    #[arg(long)]
    key_optional: bool,
    /// A GET URL answering the number of executions so far (a number, or JSON with one),
    /// read before and after each check to count executions exactly.
    #[arg(long, value_name = "URL", value_parser = conformance_url)]
    executions: Option<http::Uri>,
    /// Another principal's credentials ('Authorization: Bearer other') for the key-scope row.
    #[arg(long, value_name = "NAME: VALUE", value_parser = conformance_header)]
    other_principal: Option<(http::HeaderName, http::HeaderValue)>,
    /// Simultaneous identical requests in the concurrency check.
    #[arg(long, default_value_t = idemproxy::conformance::DEFAULT_CONCURRENCY)]
    concurrency: usize,
    /// The deadline of every request.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = conformance_timeout)]
    timeout: std::time::Duration,
    /// For https://: trust only the CA certificates of this PEM file (default: the system's roots).
    #[arg(long, value_name = "FILE")]
    ca_file: Option<PathBuf>,
    /// Also write the rows as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
}

fn conformance_header(line: &str) -> Result<(http::HeaderName, http::HeaderValue), String> {
    idemproxy::conformance::header_line(line).map_err(|e| e.to_string())
}

fn conformance_url(text: &str) -> Result<http::Uri, String> {
    idemproxy::conformance::http_url(text).map_err(|e| e.to_string())
}

fn conformance_timeout(text: &str) -> Result<std::time::Duration, String> {
    HumanDuration::parse(text).map(|d| d.0)
}

// The allocator, when a feature chooses one other than glibc's (Cargo.toml, `alloc-*`).
#[cfg(feature = "alloc-mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
#[cfg(feature = "alloc-jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Exit status for invalid usage or configuration.
const EXIT_CONFIG: u8 = 2;
/// Exit status for any other failure to start.
const EXIT_START: u8 = 1;

/// `RUST_LOG`'s filter (`info` when it is unset or invalid), with
/// tokio-postgres's statement log held at `info` unless a directive names
/// it exactly (`tokio_postgres::query=debug`): at `debug` it logs every
/// statement's parameters, and a completion's parameter is the whole record,
/// the upstream's answer with its headers and body. A more specific target
/// wins in the filter, so no other directive (`debug`, `tokio_postgres=debug`,
/// `tokio_postgres::connection=info`, `tokio_postgres:=debug`) turns it on.
fn log_filter(spec: Option<&str>) -> tracing_subscriber::EnvFilter {
    const STATEMENTS: &str = "tokio_postgres::query";
    let filter = spec
        .and_then(|s| tracing_subscriber::EnvFilter::try_new(s).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("info"));
    let names_it = |directive: &str| directive.split('=').next().map(str::trim) == Some(STATEMENTS);
    if spec.is_some_and(|s| s.split(',').any(names_it)) {
        return filter;
    }
    filter.add_directive(
        format!("{STATEMENTS}=info")
            .parse()
            .expect("a valid directive"),
    )
}

fn init_logging(format: LogFormat) {
    let filter = log_filter(std::env::var("RUST_LOG").ok().as_deref());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init(),
    }
}

fn main() -> ExitCode {
    idemproxy::serve::one_arena();
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Inject(args)) => return run_inject(args),
        Some(Command::Injector(args)) => return run_injector(args),
        Some(Command::Conformance(args)) => return run_conformance(*args),
        Some(Command::Openapi(args)) => return run_openapi(args),
        None => {}
    }
    let overrides = Overrides {
        listen: cli.listen.clone(),
        upstream: cli.upstream.clone(),
        redis_url: cli.redis_url.clone(),
        upstream_protocol: cli.upstream_protocol.map(UpstreamProtocol::from),
        admin_listen: cli.admin_listen.clone(),
    };
    let config = match Config::load(cli.config.as_deref(), &overrides) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("idemproxy: invalid configuration: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if cli.check {
        return check(&config);
    }
    if cli.init_store {
        return init_store(&config);
    }
    init_logging(cli.log_format);
    // With a runtime per worker thread (`idemproxy::workers`), this one runs
    // the rest on the main thread: accepting, the admin listener, health
    // pings, signals and draining.
    let mut builder = match config.server.runtime {
        Runtime::PerThread => tokio::runtime::Builder::new_current_thread(),
        Runtime::WorkStealing => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(config.server.worker_threads());
            builder
        }
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idemproxy: cannot start the runtime: {e}");
            return ExitCode::from(EXIT_START);
        }
    };
    runtime.block_on(async move {
        let server = match Server::bind(config).await {
            Ok(s) => s,
            // Logs go to stderr: one line says it (in the chosen log format).
            Err(e) if is_configuration(&e) => {
                tracing::error!("invalid configuration: {e}");
                return ExitCode::from(EXIT_CONFIG);
            }
            Err(e) => {
                tracing::error!("cannot start: {e}");
                return ExitCode::from(EXIT_START);
            }
        };
        let reloader = tokio::spawn(reload_on_sighup(
            server.app(),
            server.certificates(),
            cli.config.clone(),
            overrides,
        ));
        let app = server.app();
        server.run(shutdown_signal()).await;
        reloader.abort();
        // The last spans, with a short deadline (a collector that is down does not hold up the exit).
        if let Some(telemetry) = &app.telemetry {
            telemetry.flush(idemproxy::telemetry::FLUSH_DEADLINE);
        }
        ExitCode::SUCCESS
    })
}

/// `idemproxy inject`: the whole output is built before any of it is written,
/// so a failure leaves standard output empty.
fn run_inject(args: InjectArgs) -> ExitCode {
    let mut settings = inject::Settings {
        image: args.image,
        config_map: args.config_map,
        port: args.port.as_deref().map(PortRef::parse),
        ..inject::Settings::default()
    };
    let config = match args.config.as_deref().map(inject_config).transpose() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("idemproxy inject: invalid configuration: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if let Some((_, admin_port)) = &config {
        settings.admin_port = *admin_port;
    }
    let input = match args.manifests.as_deref() {
        None => std::io::read_to_string(std::io::stdin()).map_err(|e| ("standard input".into(), e)),
        Some(p) if p.as_os_str() == "-" => {
            std::io::read_to_string(std::io::stdin()).map_err(|e| ("standard input".into(), e))
        }
        Some(p) => std::fs::read_to_string(p).map_err(|e| (p.display().to_string(), e)),
    };
    let input = match input {
        Ok(text) => text,
        Err((what, e)) => {
            eprintln!("idemproxy inject: cannot read {what}: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let select = match inject::Selection::parse(&args.only, &args.selector) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("idemproxy inject: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let options = inject::Options {
        config: config.as_ref().map(|(text, _)| text.as_str()),
        network_policy: args.network_policy,
        select,
    };
    match inject::inject_manifests(&input, &settings, &options) {
        Ok(done) => emit("inject", &done.notes, &done.output),
        Err(e) => {
            eprintln!("idemproxy inject: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}

/// `idemproxy openapi`: notes on stderr, the output on stdout, written only when complete.
fn run_openapi(args: OpenapiArgs) -> ExitCode {
    use idemproxy::openapi;
    let done = match &args.command {
        OpenapiCommand::Routes {
            unsafe_methods,
            file,
        } => openapi::run_routes(file, *unsafe_methods),
        OpenapiCommand::Annotate { config, file } => openapi::run_annotate(config, file),
    };
    let done = match done {
        Ok(done) => done,
        Err(e) => {
            eprintln!("idemproxy openapi: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    emit("openapi", &done.notes, &done.text)
}

/// A tool's notes on stderr, then its whole output on stdout: exit 0, or 1
/// when the output cannot be written.
fn emit(tool: &str, notes: &[String], output: &str) -> ExitCode {
    for note in notes {
        eprintln!("idemproxy {tool}: {note}");
    }
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(output.as_bytes()).and_then(|()| out.flush()) {
        eprintln!("idemproxy {tool}: cannot write the output: {e}");
        return ExitCode::from(EXIT_START);
    }
    ExitCode::SUCCESS
}

/// `inject --config FILE`: the file's text, checked as the sidecar will load
/// it (the listen address, upstream and admin address come from its
/// arguments), and the port of its `admin_listen`, which the sidecar's
/// `--admin-listen 0.0.0.0:PORT` opens to the kubelet's probes.
fn inject_config(path: &std::path::Path) -> Result<(String, u16), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let overrides = Overrides {
        upstream: Some("http://127.0.0.1:1".into()),
        ..Overrides::default()
    };
    let config = Config::from_toml(&text, &path.display().to_string(), &overrides)
        .map_err(|e| e.to_string())?;
    let admin = &config.server.admin_listen;
    let addr: std::net::SocketAddr = admin
        .parse()
        .map_err(|e| format!("{}: server.admin_listen {admin:?}: {e}", path.display()))?;
    Ok((text, addr.port()))
}

/// `idemproxy injector`: the admission webhook until SIGTERM or SIGINT.
fn run_injector(args: InjectorArgs) -> ExitCode {
    init_logging(args.log_format);
    let settings = inject::Settings {
        image: args.image,
        config_map: args.config_map,
        port: None,
        admin_port: args.admin_port,
    };
    let files = idemproxy::config::TlsFiles {
        cert_file: args.tls_cert_file,
        key_file: args.tls_key_file,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idemproxy injector: cannot start the runtime: {e}");
            return ExitCode::from(EXIT_START);
        }
    };
    runtime.block_on(async move {
        let injector = match inject::webhook::Injector::bind(&args.listen, &files, settings).await {
            Ok(i) => i,
            Err(e) => {
                tracing::error!("cannot start: {e}");
                return ExitCode::from(if e.is_configuration() {
                    EXIT_CONFIG
                } else {
                    EXIT_START
                });
            }
        };
        let reloader = tokio::spawn(reload_injector_certificate(injector.certificates()));
        injector.run(shutdown_signal()).await;
        reloader.abort();
        ExitCode::SUCCESS
    })
}

/// `idemproxy conformance`: the table on standard output, the JSON with `--report`;
/// exit 0 (no MUST row failed), 1 (one did) or 2 (bad arguments, or the endpoint
/// cannot be exercised).
fn run_conformance(args: ConformanceArgs) -> ExitCode {
    use idemproxy::conformance::{self, Settings};
    let settings = conformance::target(&args.url, args.route.as_deref()).and_then(|target| {
        let ca_file = args.ca_file.as_deref();
        let tls = conformance::tls_for(&target, args.executions.as_ref(), ca_file)?;
        Ok(Settings {
            target,
            method: args.method,
            headers: args.headers,
            key_header: args.key_header,
            template: args.body,
            executions: args.executions,
            key_optional: args.key_optional,
            other_principal: args.other_principal,
            concurrency: args.concurrency,
            timeout: args.timeout,
            tls,
        })
    });
    let settings = match settings.and_then(|s| s.check().map(|()| s)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("idemproxy conformance: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idemproxy conformance: cannot start the runtime: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let (code, json) = match runtime.block_on(conformance::run(settings)) {
        Ok(report) => {
            print!("{}", report.table());
            (report.exit_code, serde_json::to_string_pretty(&report))
        }
        Err(e) => {
            eprintln!("idemproxy conformance: {e}");
            let failed = serde_json::json!({ "error": e.to_string(), "exit_code": EXIT_CONFIG });
            (EXIT_CONFIG, serde_json::to_string_pretty(&failed))
        }
    };
    if let Some(path) = &args.report {
        let written = json
            .map_err(std::io::Error::from)
            .and_then(|text| std::fs::write(path, text + "\n"));
        if let Err(e) = written {
            eprintln!(
                "idemproxy conformance: cannot write {}: {e}",
                path.display()
            );
            return ExitCode::from(EXIT_CONFIG);
        }
    }
    ExitCode::from(code)
}

/// The injector's certificate is re-read on SIGHUP, and when its files change:
/// in Kubernetes, cert-manager renews it into a mounted Secret and no one sends a signal.
async fn reload_injector_certificate(certificates: Arc<Certificates>) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = signal(SignalKind::hangup()).ok();
    if hup.is_none() {
        tracing::warn!(
            "cannot listen for SIGHUP; the certificate is re-read when its files change"
        );
    }
    let stamp = |files: &idemproxy::config::TlsFiles| {
        let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        (modified(&files.cert_file), modified(&files.key_file))
    };
    let mut seen = stamp(certificates.files());
    let mut tick = tokio::time::interval(INJECTOR_CERT_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let signalled = async {
            match hup.as_mut() {
                Some(hup) => hup.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            s = signalled => if s.is_none() { hup = None; continue },
            _ = tick.tick() => {
                let now = stamp(certificates.files());
                if now == seen {
                    continue;
                }
                seen = now;
            }
        }
        reload_certificate(certificates.clone()).await;
    }
}

/// How often the injector looks at its certificate files' modification times.
const INJECTOR_CERT_POLL: std::time::Duration = std::time::Duration::from_secs(30);

/// A file the configuration names was read and is wrong (a certificate that
/// is not PEM, a malformed key file): exit 2, as for the configuration itself.
fn is_configuration(e: &StartError) -> bool {
    match e {
        StartError::Store(e) => e.is_configuration(),
        e => e.is_configuration(),
    }
}

/// `--check`: what can be checked without secrets or a store. The TLS files
/// and the encryption key file are checked when they can be read; an
/// unreadable one is only a warning, since the check may run where the
/// secrets are not mounted. No key is ever printed, only key ids.
fn check(config: &Config) -> ExitCode {
    let mut warnings = match config.server.tls.as_ref().map(tls::check).transpose() {
        Ok(w) => w.unwrap_or_default(),
        Err(e) => {
            eprintln!("idemproxy: invalid configuration: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let keys = match config.store.encryption_key_file.as_deref().map(seal::check) {
        None => None,
        Some(Ok(Ok(keys))) => Some(keys),
        Some(Ok(Err(warning))) => {
            warnings.push(warning);
            None
        }
        Some(Err(e)) => {
            eprintln!("idemproxy: invalid configuration: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    print_check(config);
    if let Some(keys) = keys {
        let ids: Vec<&str> = keys.ids().collect();
        println!(
            "records sealed at rest: sealing key id {}, opening key ids {}",
            keys.sealing_id(),
            ids.join(",")
        );
    }
    if config.store.require_sealed {
        println!(
            "require_sealed: a finished record in the clear is unreadable (500), never replayed"
        );
    } else if config.store.encryption_key_file.is_some() {
        println!(
            "require_sealed is off: clear records written before sealing still replay. Once every \
             replica seals and the clear records have expired (the longest ttl after the last \
             replica began sealing), set [store] require_sealed = true"
        );
    }
    for w in warnings {
        eprintln!("idemproxy: warning: {w}");
    }
    ExitCode::SUCCESS
}

/// `--init-store`: the PostgreSQL table (deploy/postgres/schema.sql with the
/// configured table's name), created if missing and checked; nothing to do
/// for the other stores.
fn init_store(config: &Config) -> ExitCode {
    let store = &config.store;
    if store.backend != Backend::Postgres {
        println!(
            "the {} store needs nothing created: nothing to do",
            store.backend
        );
        return ExitCode::SUCCESS;
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idemproxy: cannot start the runtime: {e}");
            return ExitCode::from(EXIT_START);
        }
    };
    match runtime.block_on(postgres::init_store(store)) {
        Ok(postgres::Initialised::Created) => {
            println!(
                "the PostgreSQL table \"{}\" was created: it is ready",
                store.table
            );
            ExitCode::SUCCESS
        }
        Ok(postgres::Initialised::AlreadyThere) => {
            println!(
                "the PostgreSQL table \"{}\" exists and is as the proxy needs it: it is ready, nothing was changed",
                store.table
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("idemproxy: --init-store: {e}");
            ExitCode::from(EXIT_START)
        }
    }
}

/// The resolved routes, one line each, for `--check`.
fn print_check(config: &Config) {
    println!("configuration {} is valid", config.source);
    println!(
        "upstream {}  listen {}  admin {}  store {}",
        config.server.upstream,
        config.server.listen,
        config.server.admin_listen,
        config.store.backend
    );
    println!(
        "workers {} runtime {}",
        config.server.worker_threads(),
        config.server.runtime
    );
    if let Some(files) = &config.server.tls {
        println!(
            "tls cert={} key={}",
            files.cert_file.display(),
            files.key_file.display()
        );
    }
    for r in config.routes.iter() {
        let methods: Vec<&str> = r.methods.iter().map(|m| m.as_str()).collect();
        println!(
            "route {} methods={} path={} key={} key_from={} ttl={} lease={} mode={}",
            r.name,
            methods.join(","),
            r.path,
            r.policy.key,
            r.policy.key_from,
            HumanDuration(r.policy.ttl),
            HumanDuration(r.policy.lease),
            r.policy.mode,
        );
        for line in r.coverage() {
            println!("  {line}");
        }
    }
    if config.routes.is_empty() {
        println!("no routes: every request is passed through unprotected");
    }
    let t = &config.telemetry;
    match &t.otlp_endpoint {
        Some(endpoint) => println!(
            "telemetry otlp_endpoint={} otlp_protocol={} service_name={} sample_ratio={} client_context={}",
            idemproxy::config::shown_endpoint(endpoint),
            t.otlp_protocol,
            t.service_name,
            t.sample_ratio,
            t.client_context
        ),
        None => println!("telemetry off (no otlp_endpoint)"),
    }
}

/// SIGHUP re-reads the configuration file, and the listener's certificate
/// and key; either one that fails keeps what is in use, and neither depends
/// on the other (a rotated certificate is applied even while the file has an error).
async fn reload_on_sighup(
    app: Arc<idemproxy::app::App>,
    certificates: Option<Arc<Certificates>>,
    path: Option<PathBuf>,
    overrides: Overrides,
) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP; configuration reload is off");
        return;
    };
    while hup.recv().await.is_some() {
        let (path, overrides) = (path.clone(), overrides.clone());
        // Off the async workers, since reading the file blocks; and in a task of
        // its own, so that even a bug that panics while loading fails this one
        // reload, not the loop that serves the next SIGHUP.
        let loaded =
            tokio::task::spawn_blocking(move || Config::load(path.as_deref(), &overrides)).await;
        match loaded {
            Ok(Ok(new)) => app.reload(&new),
            Ok(Err(e)) => {
                tracing::error!(error = %e, "configuration reload failed; keeping the current configuration")
            }
            Err(e) => {
                tracing::error!(error = %e, "configuration reload failed; keeping the current configuration")
            }
        }
        if let Some(certificates) = &certificates {
            reload_certificate(certificates.clone()).await;
        }
        reload_keys(app.clone()).await;
    }
}

/// Re-reads the encryption key file, when records are sealed (off the async
/// workers); a failure keeps the keys in use. Only key ids are logged.
async fn reload_keys(app: Arc<idemproxy::app::App>) {
    if app.store.sealing().is_none() {
        return;
    }
    let reloaded =
        tokio::task::spawn_blocking(move || app.store.sealing().map(seal::Sealing::reload)).await;
    match reloaded {
        Ok(Some(Ok(keys))) => {
            let ids: Vec<&str> = keys.ids().collect();
            tracing::info!(
                sealing_key_id = keys.sealing_id(),
                key_ids = %ids.join(","),
                "encryption keys reloaded"
            )
        }
        Ok(None) => {}
        Ok(Some(Err(e))) => {
            tracing::error!(error = %e, "encryption key reload failed; keeping the current keys")
        }
        Err(e) => {
            tracing::error!(error = %e, "encryption key reload failed; keeping the current keys")
        }
    }
}

/// Re-reads the certificate and key files (off the async workers); a failure
/// keeps the current certificate. Open connections are never touched: only
/// handshakes after the swap present the new certificate.
async fn reload_certificate(certificates: Arc<Certificates>) {
    let files = certificates.files().clone();
    let reloaded = tokio::task::spawn_blocking(move || certificates.reload()).await;
    let (cert, key) = (files.cert_file.display(), files.key_file.display());
    match reloaded {
        Ok(Ok(())) => tracing::info!(%cert, %key, "TLS certificate reloaded"),
        Ok(Err(e)) => {
            tracing::error!(error = %e, "TLS certificate reload failed; keeping the current certificate")
        }
        Err(e) => {
            tracing::error!(error = %e, "TLS certificate reload failed; keeping the current certificate")
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers, Ctrl-C still ends the process (non-gracefully).
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}

#[cfg(test)]
mod tests {
    use super::log_filter;

    #[test]
    fn the_statement_log_is_held_at_info_unless_a_directive_names_it() {
        for spec in [
            None,
            Some("debug"),
            Some("trace"),
            Some("debug,tokio_postgres=debug"),
            Some("debug,tokio_postgres::connection=info"),
            Some("tokio_postgres:=debug"),
            Some("debug,tokio_postgres::query[span]=debug"),
        ] {
            let filter = log_filter(spec).to_string();
            assert!(
                filter.contains("tokio_postgres::query=info"),
                "{spec:?}: {filter}"
            );
        }
        let filter = log_filter(Some("debug,tokio_postgres::query=debug")).to_string();
        assert!(!filter.contains("tokio_postgres::query=info"), "{filter}");
    }
}
