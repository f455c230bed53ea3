//! TLS for `https://` endpoints: the system's roots, or the roots of a `--ca-file`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

/// Why no TLS client could be made.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("--ca-file {path}: {detail}")]
    CaFile { path: PathBuf, detail: String },
    #[error("no root certificates in the system's store ({0}): give --ca-file")]
    NoRoots(String),
    #[error("TLS: {0}")]
    Setup(String),
}

/// A client configuration that trusts `ca_file`'s certificates only, or the
/// system's roots without one (`SSL_CERT_FILE` and `SSL_CERT_DIR` are honoured).
/// ALPN offers only HTTP/1.1, the one protocol the kit speaks.
pub fn client_config(ca_file: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, TlsSetupError> {
    let mut roots = rustls::RootCertStore::empty();
    let certificates = match ca_file {
        Some(path) => pem_certificates(path)?,
        None => system_roots()?,
    };
    for certificate in certificates {
        let added = roots.add(certificate);
        if let (Err(e), Some(path)) = (added, ca_file) {
            let detail = e.to_string();
            let path = path.to_path_buf();
            return Err(TlsSetupError::CaFile { path, detail });
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsSetupError::Setup(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

fn pem_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    let failed = |detail: String| TlsSetupError::CaFile {
        path: path.to_path_buf(),
        detail,
    };
    let pem = std::fs::read(path).map_err(|e| failed(e.to_string()))?;
    let certificates: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(&pem).collect();
    match certificates {
        Ok(c) if c.is_empty() => Err(failed("no certificate in it".into())),
        Ok(c) => Ok(c),
        Err(e) => Err(failed(e.to_string())),
    }
}

fn system_roots() -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    let found = rustls_native_certs::load_native_certs();
    if found.certs.is_empty() {
        let errors: Vec<String> = found.errors.iter().map(|e| e.to_string()).collect();
        return Err(TlsSetupError::NoRoots(errors.join("; ")));
    }
    Ok(found.certs)
}
