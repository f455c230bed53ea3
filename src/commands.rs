//! The subcommands: `inject`, `injector`, `openapi` and `conformance`.

use std::process::ExitCode;

use idemproxy::config::{Config, Overrides, TlsFiles};
use idemproxy_kube::{self as inject, PortRef};

use crate::cli::{
    ConformanceArgs, InjectArgs, InjectorArgs, OpenapiArgs, OpenapiCommand, EXIT_CONFIG, EXIT_START,
};
use crate::logging::init_logging;

/// `idemproxy inject`: the whole output is built before any of it is written,
/// so a failure leaves standard output empty.
pub(crate) fn run_inject(args: InjectArgs) -> ExitCode {
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
        Some(p) => idemproxy::store::files::read_regular_text(
            p,
            idemproxy::store::files::CONFIG_FILE_LIMIT,
        )
        .map_err(|e| (p.display().to_string(), e)),
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
pub(crate) fn run_openapi(args: OpenapiArgs) -> ExitCode {
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
    // As the proxy reads it: a regular file, of bounded size (a FIFO would hang).
    let text = idemproxy::store::files::read_regular_text(
        path,
        idemproxy::store::files::CONFIG_FILE_LIMIT,
    )
    .map_err(|e| format!("{}: {e}", path.display()))?;
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
pub(crate) fn run_injector(args: InjectorArgs) -> ExitCode {
    init_logging(args.log_format);
    let settings = inject::Settings {
        image: args.image,
        config_map: args.config_map,
        port: None,
        admin_port: args.admin_port,
    };
    let files = TlsFiles {
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
    let code = runtime.block_on(async move {
        let injector = match inject::webhook::Injector::bind(&args.listen, &files, settings).await {
            Ok(i) => i.with_shutdown_delay(args.shutdown_delay),
            Err(e) => {
                tracing::error!("cannot start: {e}");
                return ExitCode::from(if e.is_configuration() {
                    EXIT_CONFIG
                } else {
                    EXIT_START
                });
            }
        };
        inject::lifecycle::run(injector, inject::lifecycle::process_signals()).await;
        ExitCode::SUCCESS
    });
    // Drained: a certificate reload blocked reading its files is not waited for.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}

/// `idemproxy conformance`: the table on standard output, the JSON with `--report`;
/// exit 0 (no MUST row failed), 1 (one did) or 2 (bad arguments, or the endpoint
/// cannot be exercised).
pub(crate) fn run_conformance(args: ConformanceArgs) -> ExitCode {
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
