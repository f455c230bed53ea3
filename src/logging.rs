//! Logs on stderr, as text or JSON, filtered by `RUST_LOG`.

use crate::cli::LogFormat;

/// `RUST_LOG`'s filter (`info` when it is unset or invalid), with
/// tokio-postgres's statement log held at `info` unless a directive names
/// it exactly (`tokio_postgres::query=debug`): at `debug` it logs every
/// statement's parameters, and a completion's parameter is the whole record,
/// the upstream's answer with its headers and body. A more specific target
/// wins in the filter, so no other directive (`debug`, `tokio_postgres=debug`,
/// `tokio_postgres::connection=info`, `tokio_postgres:=debug`) turns it on.
pub(crate) fn log_filter(spec: Option<&str>) -> tracing_subscriber::EnvFilter {
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

pub(crate) fn init_logging(format: LogFormat) {
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
