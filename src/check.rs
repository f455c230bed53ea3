//! `--check` and `--init-store`: the configuration checked, the store prepared, and exit.

use std::process::ExitCode;

use idemproxy::config::{Backend, Config, HumanDuration};
use idemproxy::seal;
use idemproxy::store::postgres;
use idemproxy::tls;

/// A line of the report on standard output; a reader that went away
/// (`idemproxy --check | head`) ends nothing badly (`println!` would panic).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

use crate::cli::{EXIT_CONFIG, EXIT_START};

/// `--check`: what can be checked without secrets or a store. The TLS files,
/// the store's CA file and the encryption key file are checked when they can be read; an
/// unreadable one is only a warning, since the check may run where the
/// secrets are not mounted. No key is ever printed, only key ids.
pub(crate) fn check(config: &Config) -> ExitCode {
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
    match idemproxy::store::check_ca_file(&config.store) {
        Ok(Ok(())) => {}
        Ok(Err(warning)) => warnings.push(warning),
        Err(e) => {
            eprintln!("idemproxy: invalid configuration: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    }
    print_check(config);
    if let Some(keys) = keys {
        let ids: Vec<&str> = keys.ids().collect();
        say!(
            "records sealed at rest: sealing key id {}, opening key ids {}",
            keys.sealing_id(),
            ids.join(",")
        );
    }
    if config.store.require_sealed {
        say!("require_sealed: a finished record in the clear is unreadable (500), never replayed");
    } else if config.store.encryption_key_file.is_some() {
        say!(
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
pub(crate) fn init_store(config: &Config) -> ExitCode {
    let store = &config.store;
    if store.backend != Backend::Postgres {
        say!(
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
            say!(
                "the PostgreSQL table \"{}\" was created: it is ready",
                store.table
            );
            ExitCode::SUCCESS
        }
        Ok(postgres::Initialised::AlreadyThere) => {
            say!(
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
    say!("configuration {} is valid", config.source);
    say!(
        "upstream {}  listen {}  admin {}  store {}",
        config.server.upstream,
        config.server.listen,
        config.server.admin_listen,
        config.store.backend
    );
    say!(
        "workers {} runtime {}",
        config.server.worker_threads(),
        config.server.runtime
    );
    if let Some(files) = &config.server.tls {
        say!(
            "tls cert={} key={}",
            files.cert_file.display(),
            files.key_file.display()
        );
    }
    for r in config.routes.iter() {
        let methods: Vec<&str> = r.methods.iter().map(|m| m.as_str()).collect();
        say!(
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
            say!("  {line}");
        }
    }
    if config.routes.is_empty() {
        say!("no routes: every request is passed through unprotected");
    }
    let t = &config.telemetry;
    match &t.otlp_endpoint {
        Some(endpoint) => say!(
            "telemetry otlp_endpoint={} otlp_protocol={} service_name={} sample_ratio={} client_context={}",
            idemproxy::config::shown_endpoint(endpoint),
            t.otlp_protocol,
            t.service_name,
            t.sample_ratio,
            t.client_context
        ),
        None => say!("telemetry off (no otlp_endpoint)"),
    }
}
