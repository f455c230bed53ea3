//! TLS on the listener (§9): curl over HTTP/2 and HTTP/1.1 chosen by ALPN, a
//! protected route over TLS, the certificate swapped on SIGHUP under open
//! connections, a failed reload that keeps the certificate in use, the
//! configuration errors, and clients that do not speak TLS.

mod support;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Output;
use std::sync::Arc;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use support::*;

/// A test CA, two server certificates it signed ("one" and "two": other
/// names, other keys, other serials), and the two paths the proxy reads,
/// which hold one of them.
struct Certs {
    dir: tempfile::TempDir,
}

impl Certs {
    fn new() -> Certs {
        let dir = tempfile::tempdir().unwrap();
        make_ca(dir.path(), "ca");
        make_server_cert(dir.path(), "ca", "one", "idemproxy-one");
        make_server_cert(dir.path(), "ca", "two", "idemproxy-two");
        let certs = Certs { dir };
        certs.install("one");
        certs
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn cert_file(&self) -> PathBuf {
        self.path("tls.pem")
    }

    fn key_file(&self) -> PathBuf {
        self.path("tls.key")
    }

    /// Puts `<name>.pem` and `<name>.key` where the proxy reads its certificate.
    fn install(&self, name: &str) {
        std::fs::copy(self.path(&format!("{name}.pem")), self.cert_file()).unwrap();
        std::fs::copy(self.path(&format!("{name}.key")), self.key_file()).unwrap();
    }

    /// The `[server]` lines that switch TLS on.
    fn server_lines(&self) -> String {
        format!(
            "tls_cert_file = \"{}\"\ntls_key_file = \"{}\"",
            self.cert_file().display(),
            self.key_file().display()
        )
    }

    /// Certificate `name` as DER, to compare with what the proxy presents.
    fn der(&self, name: &str) -> CertificateDer<'static> {
        CertificateDer::from_pem_file(self.path(&format!("{name}.pem"))).unwrap()
    }
}

async fn tls_proxy(certs: &Certs, upstream: &TestUpstream, extra: &str) -> Proxy {
    let config = ConfigBuilder::new(&upstream.url())
        .server(&certs.server_lines())
        .server(extra);
    Proxy::in_process(&config.build(), &[]).await
}

/// As [`tls_proxy`], the binary: for what only a process has (SIGHUP reloads).
async fn tls_proxy_binary(certs: &Certs, upstream: &TestUpstream, extra: &str) -> Proxy {
    let config = ConfigBuilder::new(&upstream.url())
        .server(&certs.server_lines())
        .server(extra);
    Proxy::start(&config.build()).await
}

/// curl to `https://localhost:<port><path>`, trusting only the test CA.
async fn https(certs: &Certs, proxy: &Proxy, args: &[&str], path: &str) -> Answer {
    let port = proxy.addr.port();
    let resolve = format!("localhost:{port}:127.0.0.1");
    let url = format!("https://localhost:{port}{path}");
    let ca = certs.path("ca.pem").display().to_string();
    let common = ["--cacert", &ca, "--resolve", &resolve];
    curl(&[&common[..], args, &[url.as_str()]].concat()).await
}

/// A TLS connection to the proxy for the name "localhost", trusting only the
/// test CA, offering `alpn`.
async fn connect(certs: &Certs, addr: SocketAddr, alpn: &[&[u8]]) -> TlsStream<TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(certs.der("ca")).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let name = ServerName::try_from("localhost").unwrap();
    let handshake = async {
        let tcp = TcpStream::connect(addr).await?;
        TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
    };
    tokio::time::timeout(DEADLINE, handshake)
        .await
        .expect("the handshake within the deadline")
        .expect("the handshake")
}

/// The certificate a new connection is shown.
async fn presented(certs: &Certs, addr: SocketAddr) -> CertificateDer<'static> {
    let tls = connect(certs, addr, &[]).await;
    let chain = tls.get_ref().1.peer_certificates().expect("a certificate");
    chain[0].clone().into_owned()
}

/// Waits until new connections are shown certificate `name`.
async fn wait_presented(certs: &Certs, addr: SocketAddr, name: &str) {
    let want = certs.der(name);
    eventually(
        &format!("new connections to present certificate {name:?}"),
        DEADLINE,
        || {
            let want = want.clone();
            async move { (presented(certs, addr).await == want).then_some(()) }
        },
    )
    .await;
}

/// One keep-alive connection (ALPN `h2` or `http/1.1`); every request goes
/// on it, so an answer proves that this connection still works.
enum KeepAlive {
    H1(http1::SendRequest<Empty<Bytes>>),
    H2(http2::SendRequest<Empty<Bytes>>),
}

impl KeepAlive {
    async fn open(certs: &Certs, addr: SocketAddr, alpn: &[u8]) -> KeepAlive {
        let tls = connect(certs, addr, &[alpn]).await;
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(alpn), "ALPN");
        let io = TokioIo::new(tls);
        if alpn == b"h2" {
            let (sender, conn) = http2::handshake(TokioExecutor::new(), io).await.unwrap();
            tokio::spawn(conn);
            KeepAlive::H2(sender)
        } else {
            let (sender, conn) = http1::handshake(io).await.unwrap();
            tokio::spawn(conn);
            KeepAlive::H1(sender)
        }
    }

    /// GET `path` on this connection: the status and the upstream's echo.
    async fn get(&mut self, path: &str) -> (u16, serde_json::Value) {
        let req = Request::get(format!("https://localhost{path}"))
            .header("host", "localhost")
            .body(Empty::new())
            .unwrap();
        let sent = async {
            match self {
                KeepAlive::H1(s) => {
                    s.ready().await?;
                    s.send_request(req).await
                }
                KeepAlive::H2(s) => {
                    s.ready().await?;
                    s.send_request(req).await
                }
            }
        };
        let resp = tokio::time::timeout(DEADLINE, sent)
            .await
            .expect("an answer within the deadline")
            .expect("an answer on the same connection");
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).unwrap())
    }
}

// ---------------------------------------------------------------------------
// Both protocols over TLS

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_gets_http2_and_http1_over_tls_by_alpn() {
    let certs = Certs::new();
    let upstream = TestUpstream::start().await;
    let proxy = tls_proxy(&certs, &upstream, "").await;

    let h2 = https(&certs, &proxy, &["--http2"], "/hello?x=1").await;
    assert_eq!(h2.version, "HTTP/2", "curl negotiated h2 by ALPN");
    assert_eq!(h2.status, 201);
    assert_eq!(h2.json()["path"], "/hello");
    assert_eq!(h2.json()["query"], "x=1");
    assert_eq!(
        h2.json()["headers"]["x-forwarded-proto"],
        "https",
        "the upstream is told the client's scheme"
    );
    let h1 = https(&certs, &proxy, &["--http1.1"], "/hello").await;
    assert_eq!(h1.version, "HTTP/1.1");
    assert_eq!(h1.status, 201);
    // curl's own report of the version, as the issue shows it.
    let w = https(
        &certs,
        &proxy,
        &["--http2", "-w", "\n%{http_version}"],
        "/w",
    )
    .await;
    assert!(
        w.body.ends_with(b"\n2"),
        "{:?}",
        String::from_utf8_lossy(&w.body)
    );

    // The server's certificate is the configured one; a client that offers no
    // ALPN at all speaks HTTP/1.1, and a keep-alive connection serves twice.
    assert_eq!(presented(&certs, proxy.addr).await, certs.der("one"));
    for alpn in [&b"h2"[..], b"http/1.1"] {
        let mut conn = KeepAlive::open(&certs, proxy.addr, alpn).await;
        for path in ["/a", "/b"] {
            let (status, echo) = conn.get(path).await;
            assert_eq!((status, echo["path"].as_str()), (201, Some(path)));
        }
    }
    let mut no_alpn = connect(&certs, proxy.addr, &[]).await;
    assert_eq!(no_alpn.get_ref().1.alpn_protocol(), None);
    no_alpn
        .write_all(b"GET /plain HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    let read = tokio::time::timeout(DEADLINE, no_alpn.read_to_string(&mut answer)).await;
    assert!(read.is_ok(), "the answer within the deadline");
    assert_eq!(raw_status(&answer), 201, "{answer}");
}

/// The same payment, over `proto`.
async fn pay(certs: &Certs, proxy: &Proxy, proto: &str) -> Answer {
    let args = [
        proto,
        "-X",
        "POST",
        "-H",
        "Idempotency-Key: tls-1",
        "--data-binary",
        "{\"amount\":1}",
    ];
    https(certs, proxy, &args, "/v1/payments").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protected_route_over_tls_executes_once_and_replays() {
    let certs = Certs::new();
    let upstream = TestUpstream::start().await;
    let redis = RedisServer::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .redis(&redis)
        .server(&certs.server_lines());
    let proxy = Proxy::in_process(&config.build(), &[]).await;
    let first = pay(&certs, &proxy, "--http2").await;
    assert_eq!((first.version.as_str(), first.status), ("HTTP/2", 201));
    assert!(!first.is_replay());
    assert_eq!(first.json()["headers"]["x-forwarded-proto"], "https");
    let again = pay(&certs, &proxy, "--http2").await;
    assert!(again.is_replay(), "the retry over TLS replays");
    assert_eq!(again.body, first.body);
    let over_h1 = pay(&certs, &proxy, "--http1.1").await;
    assert!(over_h1.is_replay(), "and over HTTP/1.1 too");
    assert_eq!(over_h1.body, first.body);
    assert_eq!(upstream.hits(), 1, "executed once");
}

// ---------------------------------------------------------------------------
// Reload on SIGHUP

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_swaps_the_certificate_and_open_connections_keep_working() {
    let certs = Certs::new();
    let upstream = TestUpstream::start().await;
    let proxy = tls_proxy_binary(&certs, &upstream, "").await;
    let mut h2 = KeepAlive::open(&certs, proxy.addr, b"h2").await;
    let mut h1 = KeepAlive::open(&certs, proxy.addr, b"http/1.1").await;
    assert_eq!(h2.get("/before").await.0, 201);
    assert_eq!(h1.get("/before").await.0, 201);
    assert_eq!(presented(&certs, proxy.addr).await, certs.der("one"));

    certs.install("two");
    proxy.signal("HUP");
    wait_presented(&certs, proxy.addr, "two").await;
    let line = proxy.wait_log("TLS certificate reloaded").await;
    assert_eq!(line["level"], "INFO");
    // The connections opened before the reload were left alone.
    let (status, echo) = h2.get("/after").await;
    assert_eq!((status, echo["path"].as_str()), (201, Some("/after")));
    let (status, echo) = h1.get("/after").await;
    assert_eq!((status, echo["path"].as_str()), (201, Some("/after")));
    assert_eq!(
        https(&certs, &proxy, &["--http2"], "/new").await.status,
        201
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_certificate_reload_keeps_the_old_one_and_a_later_reload_works() {
    let certs = Certs::new();
    let upstream = TestUpstream::start().await;
    let proxy = tls_proxy_binary(&certs, &upstream, "").await;

    // A new certificate beside a key file that is not a key (and whose text
    // must never reach the log).
    std::fs::copy(certs.path("two.pem"), certs.cert_file()).unwrap();
    std::fs::write(
        certs.key_file(),
        "-----BEGIN PRIVATE KEY-----\nSECRET-MATERIAL!!\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    proxy.signal("HUP");
    let line = proxy.wait_log("TLS certificate reload failed").await;
    assert_eq!(line["level"], "ERROR");
    let error = line["error"].as_str().unwrap();
    let key_file = certs.key_file().display().to_string();
    assert!(
        error.contains("server.tls_key_file") && error.contains(&key_file),
        "{line}"
    );
    assert!(!proxy.logs().iter().any(|l| l.contains("SECRET-MATERIAL")));
    assert_eq!(presented(&certs, proxy.addr).await, certs.der("one"));
    assert_eq!(
        https(&certs, &proxy, &["--http2"], "/kept").await.status,
        201
    );

    // Half a rotation: the new certificate with the old key.
    std::fs::copy(certs.path("one.key"), certs.key_file()).unwrap();
    proxy.signal("HUP");
    let line = proxy.wait_log("does not match the certificate").await;
    assert!(line["message"]
        .as_str()
        .unwrap()
        .contains("TLS certificate reload failed"));
    assert_eq!(presented(&certs, proxy.addr).await, certs.der("one"));

    // The whole rotation: applied.
    certs.install("two");
    proxy.signal("HUP");
    wait_presented(&certs, proxy.addr, "two").await;
    assert_eq!(
        https(&certs, &proxy, &["--http1.1"], "/new").await.status,
        201
    );
}

// ---------------------------------------------------------------------------
// Clients that do not speak TLS

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_do_not_speak_tls_are_closed_and_do_not_hold_up_others() {
    let certs = Certs::new();
    let upstream = TestUpstream::start().await;
    let proxy = tls_proxy(
        &certs,
        &upstream,
        "header_read_timeout = \"5s\"\nidle_timeout = \"60s\"",
    )
    .await;
    // A client that connects and sends nothing: its handshake is pending.
    let mut silent = TcpStream::connect(proxy.addr).await.unwrap();

    // Plain HTTP to the TLS port: no HTTP answer, and the connection is closed.
    let mut plain = TcpStream::connect(proxy.addr).await.unwrap();
    plain
        .write_all(b"GET /v1/x HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let closed = tokio::time::timeout(DEADLINE, plain.read_to_end(&mut out)).await;
    assert!(closed.is_ok(), "the plain-HTTP connection is closed");
    assert!(!String::from_utf8_lossy(&out).contains("HTTP/1"), "{out:?}");

    // Others are served while the silent handshake waits: the handshake is
    // not done in the accept loop.
    assert_eq!(
        https(&certs, &proxy, &["--http2"], "/other").await.status,
        201
    );
    let mut byte = [0u8; 1];
    match silent.try_read(&mut byte) {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        other => {
            panic!("the silent connection was closed before the others were served: {other:?}")
        }
    }
    // It is closed by header_read_timeout, long before idle_timeout.
    let closed = tokio::time::timeout(DEADLINE, silent.read_to_end(&mut out)).await;
    assert!(closed.is_ok(), "the silent connection is closed");
    assert_eq!(
        upstream.hits(),
        1,
        "only the TLS request reached the upstream"
    );
    assert_eq!(
        https(&certs, &proxy, &["--http1.1"], "/after").await.status,
        201
    );
}

// ---------------------------------------------------------------------------
// Configuration errors: exit 2 naming the key or the file; an unreadable file
// stops the start (exit 1) but `--check` only warns.

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Both `--check` and the start exit `code` with each of `parts` in the message.
fn both_exit(text: &str, code: i32, parts: &[&str]) {
    for check in [true, false] {
        let out = run_to_exit(text, check);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(code), "check={check}: {err}");
        for p in parts {
            assert!(err.contains(p), "check={check}: {err:?} should name {p:?}");
        }
    }
}

const UPSTREAM: &str = "http://127.0.0.1:1";

#[test]
fn one_tls_key_without_the_other_is_a_configuration_error() {
    for (given, missing) in [
        ("tls_cert_file", "server.tls_key_file"),
        ("tls_key_file", "server.tls_cert_file"),
    ] {
        let text = ConfigBuilder::new(UPSTREAM)
            .server(&format!("{given} = \"/etc/idemproxy/tls.pem\""))
            .build();
        let line = text[..text.find(given).unwrap()].lines().count() + 1;
        let place = format!(".toml:{line}:1: server.{given}: {missing} is missing");
        both_exit(&text, 2, &[&place]);
    }
}

#[test]
fn files_that_are_not_a_certificate_and_its_key_exit_2_naming_the_file() {
    let certs = Certs::new();
    let text = ConfigBuilder::new(UPSTREAM)
        .server(&certs.server_lines())
        .build();
    let (cert, key) = (certs.cert_file(), certs.key_file());
    let (cert_name, key_name) = (cert.display().to_string(), key.display().to_string());
    let not_base64 = "-----BEGIN CERTIFICATE-----\nSECRET-MATERIAL!!\n-----END CERTIFICATE-----\n";
    let cases: [(&PathBuf, Option<&str>, &str, &str); 5] = [
        (&cert, Some(not_base64), &cert_name, "not valid PEM"),
        (
            &cert,
            Some("hello\n"),
            &cert_name,
            "holds no PEM certificate",
        ),
        (&key, Some("hello\n"), &key_name, "holds no PEM private key"),
        (
            &key,
            Some(&not_base64.replace("CERTIFICATE", "PRIVATE KEY")),
            &key_name,
            "not valid PEM",
        ),
        // The key of the other certificate.
        (&key, None, &key_name, "does not match the certificate"),
    ];
    for (file, contents, name, problem) in cases {
        certs.install("one");
        match contents {
            Some(text) => std::fs::write(file, text).unwrap(),
            None => {
                std::fs::copy(certs.path("two.key"), file).unwrap();
            }
        }
        both_exit(&text, 2, &["invalid configuration", name, problem]);
        for check in [true, false] {
            assert!(!stderr(&run_to_exit(&text, check)).contains("SECRET-MATERIAL"));
        }
    }
    certs.install("one");
    let out = run_to_exit(&text, true);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("tls cert={cert_name} key={key_name}")),
        "{stdout}"
    );
}

#[test]
fn an_unreadable_file_stops_the_start_but_check_only_warns() {
    let certs = Certs::new();
    let text = ConfigBuilder::new(UPSTREAM)
        .server(&certs.server_lines())
        .build();
    std::fs::remove_file(certs.key_file()).unwrap();
    let key_name = certs.key_file().display().to_string();

    let out = run_to_exit(&text, true);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("is valid"));
    let err = stderr(&out);
    assert!(
        err.contains("warning") && err.contains("server.tls_key_file") && err.contains(&key_name),
        "{err}"
    );

    let out = run_to_exit(&text, false);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot read server.tls_key_file") && err.contains(&key_name),
        "{err}"
    );

    // What can be read is still checked.
    std::fs::write(certs.cert_file(), "hello\n").unwrap();
    let out = run_to_exit(&text, true);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("holds no PEM certificate"));
}
