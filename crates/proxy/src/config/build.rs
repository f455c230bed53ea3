//! The checked build: the file as written plus the overrides → a typed [`Config`], or the first error with its place.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method};
use toml::Spanned;

use super::grammar::{ConfHeader, ConfKeyFrom, HumanDuration};
use super::raw::{RawFile, RawPolicy, RawServer, RawStore, RawTelemetry};
use super::{
    Backend, ClientContext, Config, ConfigError, Flag, Origin, OtlpProtocol, Overrides, RedisMode,
    Runtime, ServerConfig, Source, SslMode, StoreConfig, TelemetryConfig, TlsFiles,
    UpstreamProtocol, UpstreamUrl,
};
use crate::policy::{KeySource, Policy};
use crate::routes::{Route, RouteName, RouteTable};

pub(super) fn build(raw: RawFile, src: &Source, ov: &Overrides) -> Result<Config, ConfigError> {
    let server = server(raw.server, src, ov)?;
    let store = store(raw.store, src, ov)?;
    let routes = routes(&raw.defaults, &raw.routes, src)?;
    within_budget(&server, &raw.defaults, &raw.routes, &routes, src)?;
    let telemetry = telemetry(raw.telemetry, src, &|var| std::env::var(var).ok())?;
    Ok(Config {
        source: src.file.to_string(),
        server,
        store,
        routes: Arc::new(routes),
        telemetry,
    })
}

/// The standard variables that fill in `[telemetry]` keys the file does not set.
pub(super) const OTEL_EXPORTER_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
pub(super) const OTEL_EXPORTER_OTLP_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_PROTOCOL";
pub(super) const OTEL_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
pub(super) const OTEL_TRACES_SAMPLER_ARG: &str = "OTEL_TRACES_SAMPLER_ARG";
const OTEL_RESOURCE_ATTRIBUTES: &str = "OTEL_RESOURCE_ATTRIBUTES";
const OTEL_EXPORTER_OTLP_HEADERS: &str = "OTEL_EXPORTER_OTLP_HEADERS";
const OTEL_EXPORTER_OTLP_TRACES_HEADERS: &str = "OTEL_EXPORTER_OTLP_TRACES_HEADERS";

/// A `[telemetry]` value from the file (at its span) or from a variable.
enum Told<T> {
    File(Spanned<T>),
    Env(&'static str, String),
}

/// `[telemetry]`: each key from the file, else from its standard variable
/// (`env` reads one; empty counts as unset), else its default. A wrong value
/// is an error at its place in the file, or naming its variable.
/// `OTEL_RESOURCE_ATTRIBUTES` and the export headers' variables have no key
/// in the file.
pub(super) fn telemetry(
    raw: RawTelemetry,
    src: &Source,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<TelemetryConfig, ConfigError> {
    let told = |file: Option<Spanned<String>>, var: &'static str| -> Option<Told<String>> {
        match file {
            Some(v) => Some(Told::File(v)),
            None => env(var)
                .filter(|v| !v.trim().is_empty())
                .map(|v| Told::Env(var, v.trim().to_string())),
        }
    };
    let fail = |told: &Told<String>, key: &str, message: String| match told {
        Told::File(v) => src.entry(&v.span(), key, message),
        Told::Env(var, _) => ConfigError::Env { var, message },
    };
    let text = |told: &Told<String>| match told {
        Told::File(v) => v.get_ref().clone(),
        Told::Env(_, v) => v.clone(),
    };
    let mut t = TelemetryConfig::default();
    if let Some(told) = told(raw.otlp_endpoint, OTEL_EXPORTER_OTLP_ENDPOINT) {
        let url = text(&told);
        check_otlp_endpoint(&url).map_err(|m| fail(&told, "telemetry.otlp_endpoint", m))?;
        t.otlp_endpoint = Some(url);
    }
    if let Some(told) = told(raw.otlp_protocol, OTEL_EXPORTER_OTLP_PROTOCOL) {
        let p = text(&told);
        t.otlp_protocol = OtlpProtocol::parse(&p).ok_or_else(|| {
            let m =
                format!("invalid OTLP protocol \"{p}\": expected \"grpc\" or \"http/protobuf\"");
            fail(&told, "telemetry.otlp_protocol", m)
        })?;
    }
    let service_name_told =
        raw.service_name.is_some() || env(OTEL_SERVICE_NAME).is_some_and(|v| !v.trim().is_empty());
    if let Some(told) = told(raw.service_name, OTEL_SERVICE_NAME) {
        let name = text(&told);
        if name.trim().is_empty() || name.chars().any(char::is_control) {
            let m = "invalid service name: empty, or with control characters".to_string();
            return Err(fail(&told, "telemetry.service_name", m));
        }
        t.service_name = name;
    }
    let ratio = match raw.sample_ratio {
        Some(v) => Some(Told::File(v)),
        None => env(OTEL_TRACES_SAMPLER_ARG)
            .filter(|v| !v.trim().is_empty())
            .map(|v| Told::Env(OTEL_TRACES_SAMPLER_ARG, v.trim().to_string())),
    };
    if let Some(told) = ratio {
        let (value, fail_at): (Option<f64>, Box<dyn Fn(String) -> ConfigError>) = match &told {
            Told::File(v) => {
                let span = v.span();
                (
                    Some(*v.get_ref()),
                    Box::new(move |m| src.entry(&span, "telemetry.sample_ratio", m)),
                )
            }
            Told::Env(var, v) => (
                v.parse::<f64>().ok(),
                Box::new(move |message| ConfigError::Env { var, message }),
            ),
        };
        match value {
            Some(r) if (0.0..=1.0).contains(&r) => t.sample_ratio = r,
            _ => {
                return Err(fail_at(
                    "invalid sample ratio: expected a number from 0.0 to 1.0".to_string(),
                ))
            }
        }
    }
    if let Some(v) = raw.client_context {
        t.client_context = ClientContext::parse(v.get_ref()).ok_or_else(|| {
            let m = format!(
                "invalid client_context \"{}\": expected \"follow\", \"link\" or \"ignore\"",
                v.get_ref()
            );
            src.entry(&v.span(), "telemetry.client_context", m)
        })?;
    }
    let listed = |var: &'static str| -> Result<Vec<(String, String)>, ConfigError> {
        match env(var) {
            Some(text) => key_values(&text).map_err(|message| ConfigError::Env { var, message }),
            None => Ok(Vec::new()),
        }
    };
    t.resource_attributes = listed(OTEL_RESOURCE_ATTRIBUTES)?;
    // OpenTelemetry's order: the file or OTEL_SERVICE_NAME, then the
    // resource attribute, then the default.
    if !service_name_told {
        let named = t
            .resource_attributes
            .iter()
            .find(|(k, _)| k == "service.name");
        if let Some((_, name)) = named.filter(|(_, v)| !v.trim().is_empty()) {
            t.service_name = name.clone();
        }
    }
    for var in [
        OTEL_EXPORTER_OTLP_HEADERS,
        OTEL_EXPORTER_OTLP_TRACES_HEADERS,
    ] {
        for (name, value) in listed(var)? {
            // The name only: a value is often a secret.
            let bad = |what: &str| ConfigError::Env {
                var,
                message: format!("header \"{name}\": {what}"),
            };
            // Not named: what is not a header name may be a secret typed
            // `name: value` (HTTP's way), with an `=` in the value.
            let name =
                http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| ConfigError::Env {
                    var,
                    message: "an item's key is not a valid header name (write name=value, \
                          items separated by commas)"
                        .to_string(),
                })?;
            if EXPORT_FRAMING.contains(&name.as_str()) {
                return Err(bad("the proxy sets it itself; it cannot come from here"));
            }
            let mut value =
                http::HeaderValue::from_str(&value).map_err(|_| bad("not a valid header value"))?;
            value.set_sensitive(true);
            t.headers.retain(|(n, _)| *n != name);
            t.headers.push((name, value));
        }
    }
    Ok(t)
}

/// Headers an export cannot take from the variables: its framing and
/// content type, which the proxy sets, and hop-by-hop ones.
const EXPORT_FRAMING: [&str; 10] = [
    "content-length",
    "content-type",
    "transfer-encoding",
    "host",
    "te",
    "connection",
    "upgrade",
    "keep-alive",
    "proxy-connection",
    "trailer",
];

/// A list in the form of `OTEL_RESOURCE_ATTRIBUTES` and
/// `OTEL_EXPORTER_OTLP_HEADERS`: `key=value` pairs separated by commas,
/// blanks around each trimmed, values percent-decoded (a later key wins).
/// Errors name an item by its place and key, never by its value (a
/// header's value is often a secret; so is what a mistyped item holds).
fn key_values(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    let items = text.split(',').map(str::trim).filter(|i| !i.is_empty());
    for (n, item) in items.enumerate() {
        let place = n + 1;
        let Some((key, value)) = item.split_once('=') else {
            return Err(format!(
                "item {place} is not key=value (items are separated by commas; write a comma in a value as %2C)"
            ));
        };
        let key = key.trim();
        let key_ok = !key.is_empty()
            && key
                .bytes()
                .all(|b| b.is_ascii_graphic() && !matches!(b, b'%' | b'"' | b'\\'));
        if !key_ok {
            return Err(format!("item {place}: invalid key"));
        }
        let value = percent_decoded(value.trim())
            .ok_or_else(|| format!("item {place} (\"{key}\"): invalid percent-encoding"))?;
        pairs.retain(|(k, _)| k != key);
        pairs.push((key.to_string(), value));
    }
    Ok(pairs)
}

/// `%XX` sequences decoded; the result must be UTF-8 without control characters.
fn percent_decoded(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    let text = String::from_utf8(out).ok()?;
    (!text.chars().any(char::is_control)).then_some(text)
}

/// An OTLP endpoint: an `http://` URL with a host. (This build speaks to
/// the collector without TLS: an `https://` one is refused here rather than
/// every export failing later.)
fn check_otlp_endpoint(url: &str) -> Result<(), String> {
    // Only the scheme and the host are repeated: a path, a query or a
    // fragment may hold a token, and a URL that does not parse anything.
    let bad = |why: &str| format!("invalid OTLP endpoint \"{}\": {why}", shown_endpoint(url));
    // Not echoed when it does not parse, nor with a query: either may hold a secret.
    let uri: http::Uri = url
        .parse()
        .map_err(|_| "invalid OTLP endpoint: not a URL".to_string())?;
    // Not echoed: the URL holds a password. The exporter would not send it,
    // and the log line that names the endpoint would show it.
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err(
            "invalid OTLP endpoint: a user or password in the URL is not used \
             (and would be logged); remove it"
                .to_string(),
        );
    }
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(bad(
                "TLS to the collector is not supported; use http:// (a collector beside the proxy)",
            ))
        }
        _ => return Err(bad("expected http://")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(bad("missing host"));
    }
    if uri.query().is_some() || url.contains('#') {
        return Err(bad("a query or a fragment is not allowed"));
    }
    let port = uri.authority().and_then(|a| a.as_str().rsplit_once(':'));
    if port.is_some_and(|(_, p)| !p.contains(']') && p.parse::<u16>().map_or(true, |n| n == 0)) {
        return Err(bad("the port is not a number from 1 to 65535"));
    }
    Ok(())
}

/// An endpoint as the proxy repeats it (errors, `--check`, its start-up
/// line): `scheme://host:port`, and `/…` when there is a path (it may hold a
/// token); nothing of a URL that does not parse.
pub fn shown_endpoint(url: &str) -> String {
    let Ok(uri) = url.parse::<http::Uri>() else {
        return "(not a URL)".to_string();
    };
    let host = uri.host().unwrap_or_default();
    let port = uri
        .port()
        .map(|p| format!(":{}", p.as_str()))
        .unwrap_or_default();
    let path = match uri.path() {
        "" | "/" => "",
        _ => "/…",
    };
    format!("{}://{host}{port}{path}", uri.scheme_str().unwrap_or("?"))
}

/// A route whose largest body could never get room in the memory budget
/// would answer every such request 503: say so at load time, at the
/// `max_request_body` that sets it (the route's, else `[defaults]`'s).
fn within_budget(
    server: &ServerConfig,
    defaults: &RawPolicy,
    raw: &[Spanned<RawPolicy>],
    routes: &RouteTable,
    src: &Source,
) -> Result<(), ConfigError> {
    for (i, (route, r)) in routes.iter().zip(raw).enumerate() {
        let limit = route.policy.max_request_body;
        if limit <= server.max_buffered {
            continue;
        }
        let (key, at) = match (&r.get_ref().max_request_body, &defaults.max_request_body) {
            (Some(v), _) => (format!("routes[{i}].max_request_body"), v.span().start),
            (None, Some(v)) => ("defaults.max_request_body".to_string(), v.span().start),
            (None, None) => (format!("routes[{i}]"), r.span().start),
        };
        return Err(src.invalid(
            at,
            key,
            format!(
                "{limit} bytes is more than server.max_buffered ({}): such a body could never be buffered",
                server.max_buffered
            ),
        ));
    }
    Ok(())
}

/// A text value that is checked after parsing, with where it came from.
struct Given {
    value: String,
    origin: Origin,
}

impl Given {
    /// The override wins over the file.
    fn pick(flag: Flag, over: &Option<String>, file: Option<Spanned<String>>) -> Option<Given> {
        match over {
            Some(value) => Some(Given {
                value: value.clone(),
                origin: Origin::Flag(flag),
            }),
            None => Given::file(file),
        }
    }

    fn file(file: Option<Spanned<String>>) -> Option<Given> {
        file.map(|v| Given {
            origin: Origin::File(v.span()),
            value: v.into_inner(),
        })
    }

    fn or_default(given: Option<Given>, default: &str) -> Given {
        given.unwrap_or_else(|| Given {
            value: default.to_string(),
            origin: Origin::Default,
        })
    }
}

/// The defaults of the three bounds on client-driven memory fit the shipped
/// manifest's 128Mi container limit together, with the margin
/// docs/reference/behaviour.md#memory-budget asks for
/// (`max_buffered` + 32 MiB): the budget (64 MiB), plus every connection with
/// hyper's buffers and an upstream connection of its own (256 × ~56 KiB
/// ≈ 14 MiB, measured in `docs/dev/hostile.md`), plus the process itself
/// (~8 MiB) and the store connection's buffers (pieces of 256 KiB).
const DEFAULT_MAX_BUFFERED: u64 = 64 << 20;
const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// As Node.js's default; room for large bearer tokens and cookies.
const DEFAULT_MAX_HEADER_BYTES: usize = 16 * 1024;
/// Redis's largest value: a record body beyond it could never be stored.
const MAX_RECORD_BODY: u64 = crate::record::MAX_BODY;

fn duration(value: Option<HumanDuration>, default: Duration) -> Duration {
    value.map_or(default, |d| d.0)
}

/// A whole number within `range`, or the error at the value given.
fn count(
    given: &Option<Spanned<i64>>,
    key: &str,
    range: std::ops::RangeInclusive<i64>,
    src: &Source,
) -> Result<Option<usize>, ConfigError> {
    match given {
        None => Ok(None),
        Some(v) if range.contains(v.get_ref()) => Ok(Some(*v.get_ref() as usize)),
        Some(v) => Err(src.invalid(
            v.span().start,
            key,
            format!(
                "invalid value {}: expected {}..={}",
                v.get_ref(),
                range.start(),
                range.end()
            ),
        )),
    }
}

fn server(raw: RawServer, src: &Source, ov: &Overrides) -> Result<ServerConfig, ConfigError> {
    let upstream =
        Given::pick(Overrides::UPSTREAM, &ov.upstream, raw.upstream).ok_or_else(|| {
            src.missing(
                "server.upstream",
                "required (or give --upstream / IDEMPROXY_UPSTREAM)",
            )
        })?;
    let upstream_url = UpstreamUrl::parse(&upstream.value)
        .map_err(|m| src.given(&upstream.origin, "server.upstream", m))?;
    let listen = Given::or_default(
        Given::pick(Overrides::LISTEN, &ov.listen, raw.listen),
        "0.0.0.0:8080",
    );
    check_addr(&listen, "server.listen", src)?;
    let admin_listen = Given::or_default(
        Given::pick(Overrides::ADMIN_LISTEN, &ov.admin_listen, raw.admin_listen),
        "127.0.0.1:9901",
    );
    check_addr(&admin_listen, "server.admin_listen", src)?;
    let max_connections = count(
        &raw.max_connections,
        "server.max_connections",
        1..=1_000_000,
        src,
    )?
    .unwrap_or(DEFAULT_MAX_CONNECTIONS);
    let workers = count(&raw.workers, "server.workers", 0..=1024, src)?.unwrap_or(0);
    let max_header_bytes = match &raw.max_header_bytes {
        None => DEFAULT_MAX_HEADER_BYTES,
        Some(b) if (8192..=1 << 20).contains(&b.get_ref().0) => b.get_ref().0 as usize,
        Some(b) => {
            return Err(src.entry(
                &b.span(),
                "server.max_header_bytes",
                format!("invalid value {}: expected 8KiB..=1MiB", b.get_ref().0),
            ))
        }
    };
    let max_buffered = match &raw.max_buffered {
        None => DEFAULT_MAX_BUFFERED,
        Some(b) if b.get_ref().0 >= 1 << 20 => b.get_ref().0,
        Some(b) => {
            return Err(src.invalid(
                b.span().start,
                "server.max_buffered",
                format!("invalid value {}: expected at least 1MiB", b.get_ref().0),
            ))
        }
    };
    Ok(ServerConfig {
        listen: listen.value,
        upstream: upstream_url,
        admin_listen: admin_listen.value,
        upstream_timeout: duration(raw.upstream_timeout, Duration::from_secs(30)),
        shutdown_grace: duration(raw.shutdown_grace, Duration::from_secs(20)),
        header_read_timeout: duration(raw.header_read_timeout, Duration::from_secs(10)),
        body_read_timeout: duration(raw.body_read_timeout, Duration::from_secs(30)),
        max_connections,
        workers,
        runtime: raw.runtime.unwrap_or(Runtime::PerThread),
        max_header_bytes,
        max_buffered,
        client_write_timeout: duration(raw.client_write_timeout, Duration::from_secs(30)),
        idle_timeout: duration(raw.idle_timeout, Duration::from_secs(60)),
        upstream_idle_timeout: duration(raw.upstream_idle_timeout, Duration::from_secs(1)),
        upstream_protocol: ov
            .upstream_protocol
            .or(raw.upstream_protocol)
            .unwrap_or(UpstreamProtocol::Http1),
        forward_normalised_path: raw.forward_normalised_path.unwrap_or(false),
        tls: tls_files(raw.tls_cert_file, raw.tls_key_file, src)?,
    })
}

/// `tls_cert_file` and `tls_key_file`: both or neither. One without the other
/// is an error at the one given, naming the one missing: a listener that
/// silently stayed plain HTTP would be found only by its clients.
fn tls_files(
    cert: Option<Spanned<PathBuf>>,
    key: Option<Spanned<PathBuf>>,
    src: &Source,
) -> Result<Option<TlsFiles>, ConfigError> {
    const CERT: &str = "server.tls_cert_file";
    const KEY: &str = "server.tls_key_file";
    for (given, name) in [(&cert, CERT), (&key, KEY)] {
        if let Some(p) = given
            .as_ref()
            .filter(|p| p.get_ref().as_os_str().is_empty())
        {
            return Err(src.entry(&p.span(), name, "an empty path: name a PEM file"));
        }
    }
    match (cert, key) {
        (None, None) => Ok(None),
        (Some(cert), Some(key)) => Ok(Some(TlsFiles {
            cert_file: cert.into_inner(),
            key_file: key.into_inner(),
        })),
        (Some(given), None) => Err(src.entry(
            &given.span(),
            CERT,
            format!("{KEY} is missing: TLS needs the certificate and its private key"),
        )),
        (None, Some(given)) => Err(src.entry(
            &given.span(),
            KEY,
            format!("{CERT} is missing: TLS needs the certificate and its private key"),
        )),
    }
}

fn check_addr(addr: &Given, key: &str, src: &Source) -> Result<(), ConfigError> {
    match addr.value.parse::<std::net::SocketAddr>() {
        Ok(_) => Ok(()),
        Err(_) => Err(src.given(
            &addr.origin,
            key,
            format!(
                "invalid listen address \"{}\": expected IP:PORT, e.g. 0.0.0.0:8080",
                addr.value
            ),
        )),
    }
}

fn store(s: RawStore, src: &Source, ov: &Overrides) -> Result<StoreConfig, ConfigError> {
    let backend = if ov.redis_url.is_some() {
        Backend::Redis
    } else {
        s.backend.unwrap_or(Backend::Memory)
    };
    if backend == Backend::Redis {
        check_topology(&s, src)?;
    }
    let default_url = match backend {
        Backend::Postgres => "postgres://idemproxy@127.0.0.1:5432/idemproxy",
        _ => "redis://127.0.0.1:6379/0",
    };
    let url = Given::or_default(
        Given::pick(Overrides::REDIS_URL, &ov.redis_url, s.url),
        default_url,
    );
    let scheme_ok = url.value.starts_with("redis://") || url.value.starts_with("rediss://");
    if backend == Backend::Redis && !scheme_ok {
        // The URL itself is not repeated: it may hold a password.
        return Err(src.given(
            &url.origin,
            "store.url",
            "invalid Redis URL: expected redis:// or rediss://",
        ));
    }
    if backend == Backend::Postgres {
        postgres_url(&url, src)?;
    }
    let sslmode_span = s.sslmode.as_ref().map(Spanned::span);
    let sslmode = sslmode(s.sslmode, src)?;
    if let Some(span) = sslmode_span.filter(|_| sslmode.required()) {
        if backend == Backend::Postgres && s.tls_ca_file.is_none() {
            return Err(src.entry(
                &span,
                "store.sslmode",
                "this sslmode needs TLS: name the CA that signed the server's certificate in tls_ca_file",
            ));
        }
    }
    if backend == Backend::Postgres {
        url_sslmode(&url, sslmode, src)?;
    }
    let table = table(s.table, src)?;
    let pool_size = match s.pool_size {
        Some(n) if *n.get_ref() == 0 => {
            return Err(src.entry(&n.span(), "store.pool_size", "must be at least 1"))
        }
        Some(n) => n.into_inner() as usize,
        None => 16,
    };
    let key_prefix = key_prefix(s.key_prefix, src)?;
    let require_sealed = require_sealed(&s.encryption_key_file, &s.require_sealed, src)?;
    Ok(StoreConfig {
        backend,
        url: url.value,
        key_prefix: key_prefix.value,
        op_timeout: duration(s.op_timeout, Duration::from_millis(500)),
        password_file: s.password_file,
        mode: s.mode.map_or(RedisMode::Standalone, Spanned::into_inner),
        nodes: s.nodes.map(Spanned::into_inner).unwrap_or_default(),
        sentinels: s.sentinels.map(Spanned::into_inner).unwrap_or_default(),
        master_name: s.master_name,
        username: s.username,
        tls_ca_file: s.tls_ca_file,
        wait_replicas: s.wait_replicas.unwrap_or(0),
        wait_timeout: duration(s.wait_timeout, Duration::from_millis(50)),
        memory_limit: s.memory_limit.map_or(256 << 20, |b| b.0),
        encryption_key_file: s.encryption_key_file.map(Spanned::into_inner),
        require_sealed,
        sslmode,
        table,
        pool_size,
    })
}

/// A PostgreSQL URL that the client can read (`postgres://` or
/// `postgresql://`, one host or several). The URL is not repeated in the
/// message: it may hold a password.
fn postgres_url(url: &Given, src: &Source) -> Result<(), ConfigError> {
    let scheme_ok = url.value.starts_with("postgres://") || url.value.starts_with("postgresql://");
    if !scheme_ok {
        return Err(src.given(
            &url.origin,
            "store.url",
            "invalid PostgreSQL URL: expected postgres:// or postgresql://",
        ));
    }
    if let Err(e) = url.value.parse::<tokio_postgres::Config>() {
        return Err(src.given(
            &url.origin,
            "store.url",
            format!("invalid PostgreSQL URL: {e}"),
        ));
    }
    Ok(())
}

/// An `sslmode` in the URL must say what `store.sslmode` says: the proxy
/// sets the client's TLS mode from `store.sslmode` (with `tls_ca_file`), so
/// a URL's `sslmode=require` would otherwise be overridden without a word,
/// and a connection meant to be encrypted made in plain text.
fn url_sslmode(url: &Given, sslmode: SslMode, src: &Source) -> Result<(), ConfigError> {
    let query = url.value.split_once('?').map_or("", |(_, q)| q);
    let query = query.split('#').next().unwrap_or("");
    for pair in query.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if name == "sslmode" && value != sslmode.name() {
            return Err(src.given(
                &url.origin,
                "store.url",
                format!(
                    "the URL says sslmode={value} but store.sslmode is \"{}\": the proxy's TLS \
                     follows store.sslmode (with tls_ca_file); set it there and leave sslmode \
                     out of the URL",
                    sslmode.name()
                ),
            ));
        }
    }
    Ok(())
}

fn sslmode(given: Option<Spanned<String>>, src: &Source) -> Result<SslMode, ConfigError> {
    match given {
        None => Ok(SslMode::Prefer),
        Some(s) => SslMode::parse(s.get_ref()).ok_or_else(|| {
            src.entry(
                &s.span(),
                "store.sslmode",
                format!(
                    "unknown sslmode \"{}\": one of {}",
                    s.get_ref(),
                    SslMode::NAMES.join(", ")
                ),
            )
        }),
    }
}

/// PostgreSQL's reserved key words (`pg_get_keywords()`, categories `R`
/// and `T`, in PostgreSQL 15, with 16's `system_user`): none can name a
/// table unquoted.
const RESERVED: &str = "\
    all analyse analyze and any array as asc asymmetric authorization binary \
    both case cast check collate collation column concurrently constraint \
    create cross current_catalog current_date current_role current_schema \
    current_time current_timestamp current_user default deferrable desc \
    distinct do else end except false fetch for foreign freeze from full grant \
    group having ilike in initially inner intersect into is isnull join lateral \
    leading left like limit localtime localtimestamp natural not notnull null \
    offset on only or order outer overlaps placing primary references returning \
    right select session_user similar some symmetric system_user table \
    tablesample then to trailing true union unique user using variadic verbose \
    when where window with";

/// The records' table: a plain lower-case SQL identifier (it is spelt into
/// every statement unquoted), not a reserved key word, at most 50 bytes so
/// that its index's name fits.
fn table(given: Option<Spanned<String>>, src: &Source) -> Result<String, ConfigError> {
    let Some(t) = given else {
        return Ok("idemproxy_records".to_string());
    };
    let name = t.get_ref();
    let ok = !name.is_empty()
        && name.len() <= 50
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if !ok {
        return Err(src.entry(
            &t.span(),
            "store.table",
            format!(
                "invalid table name \"{name}\": a lower-case identifier (a-z, 0-9, _; not starting with a digit), at most 50 bytes"
            ),
        ));
    }
    if RESERVED.split_whitespace().any(|w| w == name) {
        return Err(src.entry(
            &t.span(),
            "store.table",
            format!("invalid table name \"{name}\": a key word PostgreSQL reserves"),
        ));
    }
    Ok(t.into_inner())
}

/// The prefix of every key the proxy writes: visible ASCII without spaces,
/// not empty (it is spelt into Redis keys, and shared stores tell proxies apart by it).
fn key_prefix(given: Option<Spanned<String>>, src: &Source) -> Result<Given, ConfigError> {
    let key_prefix = Given::or_default(Given::file(given), "idemproxy");
    let prefix = &key_prefix.value;
    if prefix.is_empty() || prefix.bytes().any(|b| !(0x21..0x7f).contains(&b)) {
        return Err(src.given(
            &key_prefix.origin,
            "store.key_prefix",
            format!("invalid key prefix \"{prefix}\": visible ASCII without spaces, not empty"),
        ));
    }
    Ok(key_prefix)
}

/// Sealing's settings, checked together: a key file named by an empty path
/// is a mistake, not "no key"; `require_sealed = true` means nothing without
/// a key to seal and open records with. Whether sealing is required.
fn require_sealed(
    key_file: &Option<Spanned<PathBuf>>,
    required: &Option<Spanned<bool>>,
    src: &Source,
) -> Result<bool, ConfigError> {
    if let Some(p) = key_file
        .as_ref()
        .filter(|p| p.get_ref().as_os_str().is_empty())
    {
        return Err(src.entry(
            &p.span(),
            "store.encryption_key_file",
            "an empty path: name the key file",
        ));
    }
    let require_sealed = required.as_ref().is_some_and(|r| *r.get_ref());
    if let Some(r) = required.as_ref().filter(|_| require_sealed) {
        if key_file.is_none() {
            return Err(src.entry(
                &r.span(),
                "store.require_sealed",
                "require_sealed = true needs an encryption_key_file to seal and open records",
            ));
        }
    }
    Ok(require_sealed)
}

/// Cluster and sentinel modes need their seed addresses. The error points at
/// the empty list when there is one, else at the `mode` that asks for it.
fn check_topology(s: &RawStore, src: &Source) -> Result<(), ConfigError> {
    let Some(mode) = &s.mode else {
        return Ok(());
    };
    let empty =
        |list: &Option<Spanned<Vec<String>>>| list.as_ref().is_none_or(|l| l.get_ref().is_empty());
    let at = |list: &Option<Spanned<Vec<String>>>| list.as_ref().map_or(mode.span(), |l| l.span());
    match mode.get_ref() {
        RedisMode::Standalone => Ok(()),
        RedisMode::Cluster if empty(&s.nodes) => Err(src.invalid(
            at(&s.nodes).start,
            "store.nodes",
            "mode = \"cluster\" needs at least one seed node",
        )),
        RedisMode::Sentinel if empty(&s.sentinels) || s.master_name.is_none() => {
            let key = if empty(&s.sentinels) {
                "store.sentinels"
            } else {
                "store.master_name"
            };
            Err(src.invalid(
                at(&s.sentinels).start,
                key,
                "mode = \"sentinel\" needs `sentinels` and `master_name`",
            ))
        }
        RedisMode::Cluster | RedisMode::Sentinel => Ok(()),
    }
}

/// `[defaults]` on top of the built-in policy, then each route on top of `[defaults]`.
fn routes(
    defaults: &RawPolicy,
    raw: &[Spanned<RawPolicy>],
    src: &Source,
) -> Result<RouteTable, ConfigError> {
    for (key, span) in [
        ("name", defaults.name.as_ref().map(Spanned::span)),
        ("methods", defaults.methods.as_ref().map(Spanned::span)),
        ("path", defaults.path.as_ref().map(Spanned::span)),
    ] {
        if let Some(span) = span {
            return Err(src.invalid(
                span.start,
                format!("defaults.{key}"),
                format!("`{key}` belongs in a [[routes]] entry, not in [defaults]"),
            ));
        }
    }
    let base = policy(Policy::default(), defaults, None, "defaults", src)?;
    let mut names = HashSet::new();
    let mut routes = Vec::with_capacity(raw.len());
    for (i, r) in raw.iter().enumerate() {
        let section = format!("routes[{i}]");
        let (defaults, inherited) = (&base, defaults.key_from.as_ref());
        routes.push(route(&section, r, defaults, inherited, &mut names, src)?);
    }
    let table = RouteTable::new(routes);
    // A route that can never match is a mistake the file would otherwise hide
    // (docs/reference/behaviour.md#normalised-path).
    if let Some((i, earlier)) = table.unreachable() {
        let (later, first) = (table.at(i), table.at(earlier));
        let span = raw[i]
            .get_ref()
            .path
            .as_ref()
            .map_or(raw[i].span(), Spanned::span);
        return Err(src.invalid(
            span.start,
            format!("routes[{i}].path"),
            format!(
                "route \"{}\" ({}) can never match: route \"{}\" ({}) comes first and takes \
                 every method and path it names; put the narrower route first or remove it",
                later.name, later.path, first.name, first.path
            ),
        ));
    }
    Ok(table)
}

fn route(
    section: &str,
    raw: &Spanned<RawPolicy>,
    defaults: &Policy,
    inherited_key_from: Option<&ConfKeyFrom>,
    names: &mut HashSet<String>,
    src: &Source,
) -> Result<Route, ConfigError> {
    let r = raw.get_ref();
    let name_field = r.name.as_ref().ok_or_else(|| {
        src.invalid(
            raw.span().start,
            format!("{section}.name"),
            "every route needs a unique `name`",
        )
    })?;
    let name = name_field.get_ref();
    let at_name =
        |message: String| src.invalid(name_field.span().start, format!("{section}.name"), message);
    let name_ok = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if !name_ok {
        return Err(at_name(format!(
            "invalid route name \"{name}\": use letters, digits, '_', '-', '.'"
        )));
    }
    if !names.insert(name.clone()) {
        return Err(at_name(format!("duplicate route name \"{name}\"")));
    }
    let path = r.path.as_ref().ok_or_else(|| {
        src.invalid(
            raw.span().start,
            format!("{section}.path"),
            format!("route \"{name}\" needs a `path`"),
        )
    })?;
    let methods = match &r.methods {
        Some(m) if m.get_ref().is_empty() => {
            return Err(src.invalid(
                m.span().start,
                format!("{section}.methods"),
                format!("route \"{name}\" lists no methods"),
            ));
        }
        Some(m) => m.get_ref().iter().map(|m| m.0.clone()).collect(),
        None => vec![Method::POST],
    };
    Ok(Route {
        name: RouteName::new(name),
        methods,
        path: path.get_ref().clone(),
        policy: Arc::new(policy(
            defaults.clone(),
            r,
            inherited_key_from,
            section,
            src,
        )?),
        series: Default::default(),
        typical: Default::default(),
    })
}

/// `raw`'s policy keys on top of `p`; `key_from` is `inherited_key_from`
/// (`[defaults]`'s) unless `raw` sets it, and follows the final `header`.
fn policy(
    mut p: Policy,
    raw: &RawPolicy,
    inherited_key_from: Option<&ConfKeyFrom>,
    section: &str,
    src: &Source,
) -> Result<Policy, ConfigError> {
    sizes(&mut p, raw, section, src)?;
    identity(&mut p, raw);
    treatment(&mut p, raw);
    p.key_from = key_source(raw.key_from.as_ref().or(inherited_key_from), &p.header);
    Ok(p)
}

/// The sizes `raw` sets: a key's length (1..=4096), a request body's, and a
/// response body's (at most what one Redis value holds), each checked where given.
fn sizes(p: &mut Policy, raw: &RawPolicy, section: &str, src: &Source) -> Result<(), ConfigError> {
    if let Some(v) = &raw.max_key_length {
        let n = *v.get_ref();
        if !(1..=4096).contains(&n) {
            return Err(src.invalid(
                v.span().start,
                format!("{section}.max_key_length"),
                format!("invalid value {n}: expected 1..=4096"),
            ));
        }
        p.max_key_length = n as usize;
    }
    if let Some(v) = &raw.max_request_body {
        p.max_request_body = v.get_ref().0;
    }
    if let Some(v) = &raw.max_response_body {
        if v.get_ref().0 > MAX_RECORD_BODY {
            return Err(src.invalid(
                v.span().start,
                format!("{section}.max_response_body"),
                format!(
                    "invalid value {}: at most 512MiB (a Redis value holds no more)",
                    v.get_ref().0
                ),
            ));
        }
        p.max_response_body = v.get_ref().0;
    }
    Ok(())
}

/// What `raw` says of what identifies a request: where its key is and
/// whether it must have one, what scopes the key and enters the
/// fingerprint, and how a replay is marked.
fn identity(p: &mut Policy, raw: &RawPolicy) {
    if let Some(v) = &raw.header {
        p.header = v.0.clone();
    }
    if let Some(v) = raw.key {
        p.key = v;
    }
    if let Some(v) = &raw.scope_headers {
        p.scope_headers = sorted_unique(v);
    }
    if let Some(v) = &raw.fingerprint_headers {
        p.fingerprint_headers = sorted_unique(v);
    }
    if let Some(v) = raw.fingerprint_body {
        p.fingerprint_body = v;
    }
    if let Some(v) = &raw.replayed_header {
        p.replayed_header = v.0.clone();
    }
    if let Some(v) = raw.format_suffix {
        p.format_suffix = v;
    }
}

/// What `raw` says of how a keyed request is treated: how long its record
/// and lease last, what a duplicate in flight gets, which answers release
/// the key, and whether the route enforces and passes when the store is down.
fn treatment(p: &mut Policy, raw: &RawPolicy) {
    if let Some(v) = raw.ttl {
        p.ttl = v.0;
    }
    if let Some(v) = raw.lease {
        p.lease = v.0;
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
    if let Some(v) = &raw.release_grpc_statuses {
        p.release_grpc_statuses = v.iter().map(|s| s.0).collect();
    }
    if let Some(v) = raw.unknown_outcome {
        p.unknown_outcome = v;
    }
    if let Some(v) = raw.lease_expiry {
        p.lease_expiry = v;
    }
    if let Some(v) = raw.mode {
        p.mode = v;
    }
    if let Some(v) = raw.on_store_error {
        p.on_store_error = v;
    }
}

/// `key_from` resolved: `"header"` (or nothing) is the route's own `header`.
fn key_source(key_from: Option<&ConfKeyFrom>, header: &HeaderName) -> KeySource {
    match key_from {
        None | Some(ConfKeyFrom::RouteHeader) => KeySource::Header(header.clone()),
        Some(ConfKeyFrom::Header(name)) => KeySource::Header(name.clone()),
        Some(ConfKeyFrom::Json(pointer)) => KeySource::Json(pointer.clone()),
    }
}

fn sorted_unique(headers: &[ConfHeader]) -> Vec<HeaderName> {
    let mut v: Vec<HeaderName> = headers.iter().map(|h| h.0.clone()).collect();
    v.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::RESERVED;

    #[test]
    fn the_reserved_key_words_are_postgresql_15s_and_system_user() {
        let words: Vec<&str> = RESERVED.split_whitespace().collect();
        assert_eq!(words.len(), 101);
        assert!(words.windows(2).all(|w| w[0] < w[1]), "sorted, no repeats");
        for word in ["user", "order", "select", "system_user", "with", "all"] {
            assert!(words.contains(&word), "{word}");
        }
        // Column-name key words name a table unquoted: allowed.
        for word in ["values", "time", "between", "idemproxy_records"] {
            assert!(!words.contains(&word), "{word}");
        }
    }
}
