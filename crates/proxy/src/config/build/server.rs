//! `[server]`: the listeners, the upstream, timeouts and the bounds on
//! client-driven memory, and the TLS files.

use std::path::PathBuf;
use std::time::Duration;

use toml::Spanned;

use super::{duration, Given};
use crate::config::raw::RawServer;
use crate::config::{
    ConfigError, Overrides, Runtime, ServerConfig, Source, TlsFiles, UpstreamProtocol, UpstreamUrl,
};

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

pub(super) fn server(
    raw: RawServer,
    src: &Source,
    ov: &Overrides,
) -> Result<ServerConfig, ConfigError> {
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
