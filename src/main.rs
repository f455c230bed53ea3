//! The `idemproxy` binary: command line, logging, exit codes. The work is in the library.
#![forbid(unsafe_code)]

mod check;
mod cli;
mod commands;
mod logging;

use std::process::ExitCode;

use clap::Parser;
use idemproxy::config::{Config, Overrides, Runtime, UpstreamProtocol};
use idemproxy::lifecycle::{self, ConfigSource};
use idemproxy::server::{Server, StartError};

use cli::{Cli, Command, EXIT_CONFIG, EXIT_START};

// The allocator, when a feature chooses one other than glibc's (Cargo.toml, `alloc-*`).
#[cfg(feature = "alloc-mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
#[cfg(feature = "alloc-jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    idemproxy::serve::one_arena();
    let cli = Cli::parse();
    if let Some(command) = &cli.command {
        if cli.check || cli.init_store {
            // `idemproxy --check inject` would otherwise run inject, unchecked.
            let flag = if cli.check { "--check" } else { "--init-store" };
            eprintln!(
                "idemproxy: {flag} is the proxy's; `idemproxy {}` takes no {flag}",
                command.name()
            );
            return ExitCode::from(EXIT_CONFIG);
        }
    }
    match cli.command {
        Some(Command::Inject(args)) => return commands::run_inject(args),
        Some(Command::Injector(args)) => return commands::run_injector(args),
        Some(Command::Conformance(args)) => return commands::run_conformance(*args),
        Some(Command::Openapi(args)) => return commands::run_openapi(args),
        None => {}
    }
    let source = ConfigSource {
        path: cli.config,
        overrides: Overrides {
            listen: cli.listen,
            upstream: cli.upstream,
            redis_url: cli.redis_url,
            upstream_protocol: cli.upstream_protocol.map(UpstreamProtocol::from),
            admin_listen: cli.admin_listen,
        },
    };
    let config = match Config::load(source.path.as_deref(), &source.overrides) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("idemproxy: invalid configuration: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if cli.check {
        return check::check(&config);
    }
    if cli.init_store {
        return check::init_store(&config);
    }
    logging::init_logging(cli.log_format);
    run_proxy(config, source)
}

/// The proxy until SIGTERM or SIGINT, reloading on SIGHUP (`idemproxy::lifecycle`).
fn run_proxy(config: Config, source: ConfigSource) -> ExitCode {
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
    let code = runtime.block_on(async move {
        // Before anything that takes time (the store's schema check, key and
        // certificate files, binding): a SIGHUP or SIGTERM sent while the
        // proxy starts is then kept for when it serves, not the default
        // action that ends the process with no word.
        let signals = lifecycle::process_signals();
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
        lifecycle::run(server, signals, source).await;
        ExitCode::SUCCESS
    });
    // Drained and flushed: a reload still blocked reading a file (a FIFO, a
    // mount that stopped answering) is not waited for.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}

/// A file the configuration names was read and is wrong (a certificate that
/// is not PEM, a malformed key file): exit 2, as for the configuration itself.
fn is_configuration(e: &StartError) -> bool {
    match e {
        StartError::Store(e) => e.is_configuration(),
        e => e.is_configuration(),
    }
}
