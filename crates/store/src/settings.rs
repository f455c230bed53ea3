//! What the configuration makes of a connection: the password, the CA
//! certificates, one URL's connection info with the user and password
//! applied, and the connection manager's settings. Shared by the three modes.

use std::time::Duration;

use redis::aio::ConnectionManagerConfig;
use redis::{IntoConnectionInfo, TlsCertificates};

use super::StoreSetupError;
use crate::config::StoreConfig;

/// The env var that carries the Redis password (wins over `password_file`).
pub(crate) const PASSWORD_ENV: &str = "IDEMPROXY_REDIS_PASSWORD";

pub(super) fn setup(e: impl std::fmt::Display) -> StoreSetupError {
    StoreSetupError::Redis(e.to_string())
}

/// A store's password: the variable `env` (`IDEMPROXY_REDIS_PASSWORD`,
/// `IDEMPROXY_POSTGRES_PASSWORD`), else `password_file`, else none (a URL
/// may carry one).
pub(super) fn password(cfg: &StoreConfig, env: &str) -> Result<Option<String>, StoreSetupError> {
    match (std::env::var(env), &cfg.password_file) {
        (Ok(p), _) if !p.is_empty() => Ok(Some(p)),
        (_, Some(path)) => crate::files::read_regular_text(path, crate::files::SMALL_FILE_LIMIT)
            .map(|p| Some(p.trim_end_matches(['\r', '\n']).to_string()))
            .map_err(|source| StoreSetupError::PasswordFile {
                path: path.clone(),
                source,
            }),
        _ => Ok(None),
    }
}

pub(super) fn tls_certs(cfg: &StoreConfig) -> Result<Option<TlsCertificates>, StoreSetupError> {
    match &cfg.tls_ca_file {
        None => Ok(None),
        Some(path) => {
            // Read and checked here: a file with no certificate would
            // otherwise show only as handshakes failing, one ping at a time.
            let (pem, _) = ca_file(path)?;
            Ok(Some(TlsCertificates {
                client_tls: None,
                root_cert: Some(pem),
            }))
        }
    }
}

/// The CA file's bytes and its certificates: an error when it cannot be
/// read, is not PEM, or holds no certificate.
pub(crate) fn ca_file(
    path: &std::path::Path,
) -> Result<(Vec<u8>, Vec<rustls::pki_types::CertificateDer<'static>>), StoreSetupError> {
    use rustls::pki_types::pem::PemObject;
    let pem =
        crate::files::read_regular(path, crate::files::SMALL_FILE_LIMIT).map_err(|source| {
            StoreSetupError::CaFile {
                path: path.to_path_buf(),
                source,
            }
        })?;
    let invalid = |problem: String| StoreSetupError::CaInvalid {
        path: path.to_path_buf(),
        problem,
    };
    let certs = rustls::pki_types::CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(format!("not valid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(
            "no certificate in it (a PEM CERTIFICATE section)".into(),
        ));
    }
    Ok((pem, certs))
}

/// `--check`: the store's CA file, when one is named. `Ok(Err(warning))`
/// when it cannot be read here (it is read at start, where it is mounted);
/// `Err` when it is read and wrong.
pub fn check_ca_file(cfg: &StoreConfig) -> Result<Result<(), String>, StoreSetupError> {
    let unused = match cfg.backend {
        crate::config::Backend::Memory => true,
        crate::config::Backend::Postgres => cfg.sslmode == crate::config::SslMode::Disable,
        crate::config::Backend::Redis => false,
    };
    let Some(path) = cfg.tls_ca_file.as_ref().filter(|_| !unused) else {
        return Ok(Ok(()));
    };
    match ca_file(path) {
        Ok(_) => Ok(Ok(())),
        Err(e @ StoreSetupError::CaFile { .. }) => Ok(Err(format!("{e} (it is read at start)"))),
        Err(e) => Err(e),
    }
}

/// Connection info for one URL with the configured user and password applied.
pub(super) fn connection_info(
    url: &str,
    user: Option<&str>,
    password: Option<&str>,
) -> Result<redis::ConnectionInfo, StoreSetupError> {
    let info = url
        .into_connection_info()
        .map_err(|e| setup(format!("invalid Redis URL: {e}")))?;
    let mut settings = info.redis_settings().clone();
    if let Some(u) = user {
        settings = settings.set_username(u);
    }
    if let Some(p) = password {
        settings = settings.set_password(p);
    }
    Ok(info.set_redis_settings(settings))
}

/// The settings of redis-rs's connection manager (TLS and Unix sockets, and
/// the master Sentinel names when it is not plain TCP).
pub(super) fn manager_config(cfg: &StoreConfig) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(cfg.op_timeout))
        // Every operation is bounded by `op_timeout` in `Store` already: a
        // second timer per command here would cost a timer-wheel entry each.
        .set_response_timeout(None)
        .set_max_delay(Duration::from_secs(1))
}

/// A standalone server's client, built without connecting.
pub(super) fn standalone(
    cfg: &StoreConfig,
    user: Option<&str>,
    password: Option<&str>,
    certs: Option<TlsCertificates>,
) -> Result<redis::Client, StoreSetupError> {
    let info = connection_info(&cfg.url, user, password)?;
    match certs {
        Some(c) => redis::Client::build_with_tls(info, c),
        None => redis::Client::open(info),
    }
    .map_err(setup)
}
