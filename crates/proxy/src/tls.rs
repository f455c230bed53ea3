//! TLS on the client-facing listener (docs/reference/behaviour.md#tls): the certificate and its
//! key from
//! PEM files, ALPN `h2` and `http/1.1`, and a certificate that SIGHUP replaces
//! without touching open connections.
//!
//! The files are read here, not by `config`: the configuration holds only
//! their paths, so `--check` can run where the secrets are not mounted
//! ([`check`] only warns then). At start an unreadable file stops the proxy
//! (exit 1, as the Redis password file does) and a file that is read but
//! wrong is a configuration error (exit 2). No message quotes a file's
//! contents: a key file's contents are the secret.
//!
//! The handshake runs in the connection's own task ([`Tls::accept`], from
//! `server`), inside the connection's deadlines ([`crate::conn::Guarded`]),
//! so a slow handshake holds its own `max_connections` slot and nothing else.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tracing::debug;

use crate::config::TlsFiles;

const CERT: &str = "server.tls_cert_file";
const KEY: &str = "server.tls_key_file";

/// What errors call the two files: the proxy's configuration keys
/// ([`Names::CONFIG`]), or the injector's flags.
#[derive(Clone, Copy, Debug)]
pub struct Names {
    pub cert: &'static str,
    pub key: &'static str,
}

impl Names {
    pub(crate) const CONFIG: Names = Names {
        cert: CERT,
        key: KEY,
    };

    /// `e` with its file named as these names name it.
    fn name(self, e: TlsError) -> TlsError {
        let rename = |key: &'static str| if key == KEY { self.key } else { self.cert };
        match e {
            TlsError::Read { key, path, source } => TlsError::Read {
                key: rename(key),
                path,
                source,
            },
            TlsError::Invalid { key, path, message } => TlsError::Invalid {
                key: rename(key),
                path,
                message,
            },
            e => e,
        }
    }
}

/// What ALPN offers, in the server's order of preference: HTTP/2 first, as a
/// client that speaks both gets the multiplexed protocol.
const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file cannot be read (not mounted, no permission): a start-up failure.
    #[error("cannot read {key} {path}: {source}")]
    Read {
        key: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// A file was read and is wrong: a configuration error.
    #[error("{key}: {path}: {message}")]
    Invalid {
        key: &'static str,
        path: PathBuf,
        message: String,
    },
    /// The crypto provider refused the protocol versions (a build problem).
    #[error("cannot set up TLS: {0}")]
    Setup(String),
}

fn invalid(key: &'static str, path: &Path, message: impl Into<String>) -> TlsError {
    TlsError::Invalid {
        key,
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// The one crypto provider of the build (ring, as for Redis TLS), given
/// explicitly rather than installed process-wide.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(key: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    crate::store::files::read_regular(path, crate::store::files::SMALL_FILE_LIMIT).map_err(
        |source| TlsError::Read {
            key,
            path: path.to_path_buf(),
            source,
        },
    )
}

/// What is wrong with a PEM file, without quoting any of it.
fn pem_problem(e: &pem::Error) -> &'static str {
    match e {
        pem::Error::MissingSectionEnd { .. } => "not valid PEM: a section has no END line",
        pem::Error::IllegalSectionStart { .. } => "not valid PEM: a malformed BEGIN line",
        pem::Error::Base64Decode(_) => "not valid PEM: a section is not valid base64",
        _ => "not valid PEM",
    }
}

/// The chain, the server's own certificate first (sections of other kinds,
/// such as a key kept in the same file, are skipped).
fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(CERT, path, pem_problem(&e)))?;
    if chain.is_empty() {
        return Err(invalid(CERT, path, "holds no PEM certificate"));
    }
    Ok(chain)
}

fn private_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        pem::Error::NoItemsFound => invalid(KEY, path, "holds no PEM private key"),
        e => invalid(KEY, path, pem_problem(&e)),
    })
}

/// The certificate with its key, checked to belong together (a mismatch
/// would fail every handshake, so it is refused here).
fn pair(
    files: &TlsFiles,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    provider: &CryptoProvider,
) -> Result<CertifiedKey, TlsError> {
    let signing = provider.key_provider.load_private_key(key).map_err(|_| {
        invalid(
            KEY,
            &files.key_file,
            "a private key TLS cannot use (RSA, ECDSA P-256/P-384 or Ed25519 expected)",
        )
    })?;
    let certified = CertifiedKey::new(chain, signing);
    match certified.keys_match() {
        // `Unknown`: the key cannot tell its public half; the handshake will show.
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {
            Ok(certified)
        }
        Err(rustls::Error::InconsistentKeys(_)) => Err(invalid(
            KEY,
            &files.key_file,
            format!(
                "does not match the certificate in {}",
                files.cert_file.display()
            ),
        )),
        Err(_) => Err(invalid(
            CERT,
            &files.cert_file,
            "the first certificate is not a valid X.509 certificate",
        )),
    }
}

/// Reads and checks both files.
fn load(files: &TlsFiles, provider: &CryptoProvider) -> Result<CertifiedKey, TlsError> {
    let cert_pem = read(CERT, &files.cert_file)?;
    let key_pem = read(KEY, &files.key_file)?;
    let chain = certificates(&files.cert_file, &cert_pem)?;
    let key = private_key(&files.key_file, &key_pem)?;
    pair(files, chain, key, provider)
}

/// For `--check`: the files' contents are checked when they can be read; an
/// unreadable file is a warning (returned), not an error, since the check
/// may run where the secrets are not mounted.
pub fn check(files: &TlsFiles) -> Result<Vec<String>, TlsError> {
    let mut warnings = Vec::new();
    let mut readable = |key, path| match read(key, path) {
        Ok(pem) => Ok(Some(pem)),
        Err(e @ TlsError::Read { .. }) => {
            warnings.push(format!("{e} (it is read at start)"));
            Ok(None)
        }
        Err(e) => Err(e),
    };
    let cert_pem = readable(CERT, &files.cert_file)?;
    let key_pem = readable(KEY, &files.key_file)?;
    let chain = cert_pem
        .map(|pem| certificates(&files.cert_file, &pem))
        .transpose()?;
    let key = key_pem
        .map(|pem| private_key(&files.key_file, &pem))
        .transpose()?;
    if let (Some(chain), Some(key)) = (chain, key) {
        pair(files, chain, key, &provider())?;
    }
    Ok(warnings)
}

/// The certificate the listener presents, swapped whole on reload. A
/// handshake takes the one current when it starts; an open connection has
/// finished its handshake and never looks again, so a reload leaves it alone.
#[derive(Debug)]
pub struct Certificates {
    files: TlsFiles,
    names: Names,
    provider: Arc<CryptoProvider>,
    current: ArcSwap<CertifiedKey>,
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

impl Certificates {
    /// Re-reads both files. On any problem the current certificate stays, so
    /// a half-written rotation (a new certificate, the old key) changes nothing.
    pub fn reload(&self) -> Result<(), TlsError> {
        let new = load(&self.files, &self.provider).map_err(|e| self.names.name(e))?;
        self.current.store(Arc::new(new));
        Ok(())
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }
}

/// The listener's TLS: the acceptor and the certificates it presents.
pub struct Tls {
    acceptor: TlsAcceptor,
    certificates: Arc<Certificates>,
}

impl Tls {
    /// Reads the files and builds the server configuration.
    pub fn new(files: &TlsFiles) -> Result<Tls, TlsError> {
        Tls::named(files, Names::CONFIG)
    }

    /// [`Tls::new`], its errors naming the files as `names` do.
    pub fn named(files: &TlsFiles, names: Names) -> Result<Tls, TlsError> {
        let provider = provider();
        let first = load(files, &provider).map_err(|e| names.name(e))?;
        let certificates = Arc::new(Certificates {
            files: files.clone(),
            names,
            provider: provider.clone(),
            current: ArcSwap::from_pointee(first),
        });
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Setup(e.to_string()))?
            .with_no_client_auth()
            .with_cert_resolver(certificates.clone());
        config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
        Ok(Tls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            certificates,
        })
    }

    /// For the SIGHUP reload.
    pub fn certificates(&self) -> Arc<Certificates> {
        self.certificates.clone()
    }

    /// The handshake, done by `until`; `None` when it fails or is late (a
    /// plain-HTTP client, a scanner, a client that sends nothing), and the
    /// connection is then dropped. Whatever ALPN chose, hyper tells HTTP/2
    /// from HTTP/1.1 by the preface, as on a plain connection.
    pub async fn accept<IO>(&self, io: IO, until: Instant) -> Option<ClientIo<IO>>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        match tokio::time::timeout_at(until, self.acceptor.accept(io)).await {
            Ok(Ok(stream)) => Some(ClientIo::Tls(Box::new(stream))),
            Ok(Err(e)) => {
                debug!(error = %e, "TLS handshake failed");
                None
            }
            Err(_) => {
                debug!("TLS handshake not done within header_read_timeout");
                None
            }
        }
    }
}

/// The connection's bytes: `io` itself without TLS, else after the
/// handshake ([`Tls::accept`]; `None` when it failed or was late).
pub async fn open<IO>(tls: Option<&Tls>, io: IO, until: Instant) -> Option<ClientIo<IO>>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    match tls {
        None => Some(ClientIo::Plain(io)),
        Some(tls) => tls.accept(io, until).await,
    }
}

/// A client connection's bytes: as accepted, or inside TLS. One type for
/// both, so that the connection is served by the same code either way.
pub enum ClientIo<IO> {
    Plain(IO),
    /// Boxed: the TLS state is large, and a plain connection need not carry its room.
    Tls(Box<TlsStream<IO>>),
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncRead for ClientIo<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientIo::Plain(io) => Pin::new(io).poll_read(cx, buf),
            ClientIo::Tls(io) => Pin::new(io).poll_read(cx, buf),
        }
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncWrite for ClientIo<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientIo::Plain(io) => Pin::new(io).poll_write(cx, buf),
            ClientIo::Tls(io) => Pin::new(io).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientIo::Plain(io) => Pin::new(io).poll_write_vectored(cx, bufs),
            ClientIo::Tls(io) => Pin::new(io).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            ClientIo::Plain(io) => io.is_write_vectored(),
            ClientIo::Tls(io) => io.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientIo::Plain(io) => Pin::new(io).poll_flush(cx),
            ClientIo::Tls(io) => Pin::new(io).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientIo::Plain(io) => Pin::new(io).poll_shutdown(cx),
            ClientIo::Tls(io) => Pin::new(io).poll_shutdown(cx),
        }
    }
}
