//! The lifecycle, driven through its stream of signals in-process (the process's real
//! SIGHUP and SIGTERM are in operations.rs, sealed.rs, tls.rs and injector.rs): a
//! reload applies the edited file, a bad file keeps the configuration in use, a
//! shutdown drains what is in flight and flushes the spans before `run` ends; the
//! injector's certificate is swapped on a reload, and a shutdown answers the review
//! it is reading before `run` ends.

mod support;

use std::path::Path;
use std::sync::Arc;

use idemproxy::config::{Config, Overrides, TlsFiles};
use idemproxy::lifecycle::{self, ConfigSource, Signal};
use idemproxy::server::Server;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use support::*;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// `lifecycle::run` as a task, on a configuration file the test edits.
struct Running {
    file: tempfile::NamedTempFile,
    addr: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    signals: Option<mpsc::UnboundedSender<Signal>>,
    task: JoinHandle<()>,
    logs: LogLines,
}

impl Running {
    async fn start(text: &str) -> Running {
        let logs = captured_logs();
        let file = write_config(text);
        let source = ConfigSource {
            path: Some(file.path().to_path_buf()),
            overrides: Overrides::default(),
        };
        let config = Config::load(source.path.as_deref(), &source.overrides)
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
        let server = Server::bind(config).await.expect("bind the proxy");
        let addr = server.local_addr().expect("proxy address");
        let admin = server.admin_addr().expect("admin address");
        let (signals, received) = mpsc::unbounded_channel();
        let stream = UnboundedReceiverStream::new(received);
        let task = tokio::spawn(lifecycle::run(server, stream, source));
        Running {
            file,
            addr,
            admin,
            signals: Some(signals),
            task,
            logs,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    fn send(&self, signal: Signal) {
        let signals = self.signals.as_ref().expect("signals still open");
        signals.send(signal).expect("run is listening");
    }

    /// Rewrites the file, sends a reload and waits for the line that says how it went.
    async fn reload(&self, text: &str, outcome: &str) {
        std::fs::write(self.file.path(), text).expect("rewrite config");
        let before = log_count(&self.logs, outcome);
        self.send(Signal::Reload);
        wait_log_count(&self.logs, outcome, before + 1).await;
    }

    /// Waits for `run` to return.
    async fn ended(self) {
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("run ends in time")
            .expect("run does not panic");
    }
}

fn log_count(logs: &LogLines, text: &str) -> usize {
    let lines = logs.lock().unwrap();
    lines.iter().filter(|l| l.contains(text)).count()
}

async fn wait_log_count(logs: &LogLines, text: &str, n: usize) {
    eventually(&format!("{n} log lines with {text:?}"), DEADLINE, || {
        let reached = log_count(logs, text) >= n;
        async move { reached.then_some(()) }
    })
    .await;
}

/// Whether `path` is protected: the same key twice, and the second is a replay.
async fn protected(proxy: &Running, path: &str, key: &str) -> bool {
    Call::post(&proxy.url(path)).key(key).body("x").await;
    Call::post(&proxy.url(path))
        .key(key)
        .body("x")
        .await
        .is_replay()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_applies_the_edited_file() {
    let upstream = TestUpstream::start().await;
    let one_route = ConfigBuilder::new(&upstream.url()).route("payments", "/v1/payments", "");
    let proxy = Running::start(&one_route.build()).await;
    assert!(protected(&proxy, "/v1/payments", "k-1").await);
    assert!(!protected(&proxy, "/v1/new", "k-2").await, "no route yet");

    let two_routes = one_route.route("new", "/v1/new", "").build();
    proxy.reload(&two_routes, "configuration reloaded").await;
    assert!(protected(&proxy, "/v1/new", "k-3").await, "the new route");
    assert!(protected(&proxy, "/v1/payments", "k-4").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_file_keeps_the_configuration_and_a_later_reload_applies() {
    let upstream = TestUpstream::start().await;
    let one_route = ConfigBuilder::new(&upstream.url()).route("payments", "/v1/payments", "");
    let proxy = Running::start(&one_route.build()).await;

    let failed = "configuration reload failed; keeping the current configuration";
    proxy.reload("[server]\nupstream = 12\n", failed).await;
    assert!(
        protected(&proxy, "/v1/payments", "k-1").await,
        "still protected"
    );
    assert!(!protected(&proxy, "/v1/new", "k-2").await);
    let ready = get(&format!("http://{}/readyz", proxy.admin)).await;
    assert_eq!(ready.unwrap().status, 200);

    // The failure did not end the reloads.
    let two_routes = one_route.route("new", "/v1/new", "").build();
    proxy.reload(&two_routes, "configuration reloaded").await;
    assert!(protected(&proxy, "/v1/new", "k-3").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_accepting_drains_what_is_in_flight_then_run_ends() {
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url()).route("payments", "/v1/payments", "");
    let proxy = Running::start(&config.build()).await;
    let held = Call::post(&proxy.url("/v1/payments"))
        .key("k-held")
        .header("x-test-hold", "1")
        .spawn("x");
    upstream.wait_hits(1).await;

    proxy.send(Signal::Shutdown);
    wait_log_count(&proxy.logs, "shutting down: draining connections", 1).await;
    assert!(
        TcpStream::connect(proxy.addr).await.is_err(),
        "no longer accepting"
    );
    // The upstream holds the request: the drain waits for it.
    assert!(!proxy.task.is_finished(), "run ended before the drain");
    upstream.release(1);
    let answer = tokio::time::timeout(DEADLINE, held)
        .await
        .expect("the held request answered")
        .expect("join");
    assert_eq!(answer.status, 201, "answered, not cut short");
    proxy.ended().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_end_of_the_signals_is_a_shutdown() {
    let upstream = TestUpstream::start().await;
    let mut proxy = Running::start(&ConfigBuilder::new(&upstream.url()).build()).await;
    drop(proxy.signals.take());
    proxy.ended().await;
}

/// The last spans are flushed once the drain is done: to a collector that
/// accepts and never answers, the flush waits its deadline and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_spans_are_flushed_after_the_drain() {
    let collector = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", collector.local_addr().unwrap());
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = collector.accept().await {
            held.push(socket);
        }
    });
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .route("payments", "/v1/payments", "")
        .telemetry(&format!(
            "otlp_endpoint = \"{endpoint}\"\notlp_protocol = \"http/protobuf\"\nsample_ratio = 1.0"
        ));
    let proxy = Running::start(&config.build()).await;
    assert!(protected(&proxy, "/v1/payments", "k-1").await);
    let logs = proxy.logs.clone();
    let not_flushed = "spans not exported before the flush deadline were dropped";
    assert_eq!(log_count(&logs, not_flushed), 0);
    proxy.send(Signal::Shutdown);
    proxy.ended().await;
    let stopped = logs
        .lock()
        .unwrap()
        .iter()
        .position(|l| l.contains("\"stopped\""));
    let flushed = logs
        .lock()
        .unwrap()
        .iter()
        .position(|l| l.contains(not_flushed));
    assert!(
        matches!((stopped, flushed), (Some(s), Some(f)) if s < f),
        "the flush, after the drain: {stopped:?} {flushed:?}"
    );
    silent.abort();
}

/// The injector: `one` presented, `two` once installed and reloaded; a shutdown ends `run`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_injector_swaps_its_certificate_on_a_reload_and_ends_on_shutdown() {
    use idemproxy_kube::{self as inject, webhook::Injector};
    let dir = tempfile::tempdir().unwrap();
    make_ca(dir.path(), "ca");
    make_server_cert(dir.path(), "ca", "one", "injector-one");
    make_server_cert(dir.path(), "ca", "two", "injector-two");
    let install = |name: &str| {
        for ext in ["pem", "key"] {
            let from = dir.path().join(format!("{name}.{ext}"));
            std::fs::copy(from, dir.path().join(format!("tls.{ext}"))).unwrap();
        }
    };
    install("one");
    let files = TlsFiles {
        cert_file: dir.path().join("tls.pem"),
        key_file: dir.path().join("tls.key"),
    };
    let injector = Injector::bind("127.0.0.1:0", &files, inject::Settings::default())
        .await
        .expect("bind the injector");
    let addr = injector.local_addr().unwrap();
    let injector = injector.with_shutdown_delay(std::time::Duration::ZERO);
    let (signals, received) = mpsc::unbounded_channel();
    let stream = UnboundedReceiverStream::new(received);
    let task = tokio::spawn(inject::lifecycle::run(injector, stream));
    let certificate =
        |name: &str| CertificateDer::from_pem_file(dir.path().join(format!("{name}.pem"))).unwrap();
    assert_eq!(presented(addr, dir.path()).await, certificate("one"));

    install("two");
    signals.send(Signal::Reload).unwrap();
    let two = certificate("two");
    eventually("the new certificate", DEADLINE, || {
        let two = two.clone();
        let dir = dir.path().to_path_buf();
        async move { (presented(addr, &dir).await == two).then_some(()) }
    })
    .await;

    signals.send(Signal::Shutdown).unwrap();
    tokio::time::timeout(DEADLINE, task)
        .await
        .expect("run ends in time")
        .expect("run does not panic");
}

/// The injector, after a shutdown: for its delay, `/healthz` 503 and new
/// reviews still answered (the Service's endpoints are moving); then no new
/// connection, an idle one closed at once, and a review whose body is still
/// coming read and answered (the API server waits for it) before `run` ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_injector_answers_the_review_it_is_reading_before_it_ends() {
    use idemproxy_kube::{self as inject, webhook::Injector};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    make_ca(dir.path(), "ca");
    make_server_cert(dir.path(), "ca", "tls", "injector");
    let files = TlsFiles {
        cert_file: dir.path().join("tls.pem"),
        key_file: dir.path().join("tls.key"),
    };
    let injector = Injector::bind("127.0.0.1:0", &files, inject::Settings::default())
        .await
        .expect("bind the injector");
    let addr = injector.local_addr().unwrap();
    let injector = injector.with_shutdown_delay(std::time::Duration::from_secs(2));
    let (signals, received) = mpsc::unbounded_channel();
    let task = tokio::spawn(inject::lifecycle::run(
        injector,
        UnboundedReceiverStream::new(received),
    ));
    // An idle keep-alive connection, after one answer.
    let mut idle = tls_to(addr, dir.path()).await;
    idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: injector\r\n\r\n")
        .await
        .unwrap();
    let head = read_until(&mut idle, b"ok\n").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // A review whose body is half sent; `100 Continue` says the injector is reading it.
    let review = serde_json::to_vec(&serde_json::json!({
        "kind": "AdmissionReview",
        "apiVersion": "admission.k8s.io/v1",
        "request": {
            "uid": "8e1c4e0a-6a4e-4f7e-9f54-2f0f6f7b6c1d",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "shop",
            "operation": "CREATE",
            "object": {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "api", "annotations": {"idemproxy.dev/inject": "true"}},
                "spec": {"containers": [{"name": "api", "image": "api:1",
                    "ports": [{"name": "http", "containerPort": 8080}]}]}
            }
        }
    }))
    .unwrap();
    let mut busy = tls_to(addr, dir.path()).await;
    let headers = format!(
        "POST /mutate HTTP/1.1\r\nhost: injector\r\ncontent-type: application/json\r\n\
         expect: 100-continue\r\ncontent-length: {}\r\n\r\n",
        review.len()
    );
    busy.write_all(headers.as_bytes()).await.unwrap();
    let continued = read_until(&mut busy, b"\r\n\r\n").await;
    assert!(continued.starts_with("HTTP/1.1 100"), "{continued}");
    let half = review.len() / 2;
    busy.write_all(&review[..half]).await.unwrap();

    signals.send(Signal::Shutdown).unwrap();
    // The delay: not ready, yet a new connection's review is answered.
    let mut late = tls_to(addr, dir.path()).await;
    late.write_all(b"GET /healthz HTTP/1.1\r\nhost: injector\r\n\r\n")
        .await
        .unwrap();
    let head = read_until(&mut late, b"stopping\n").await;
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    // Alive all the same: liveness is not readiness.
    late.write_all(b"GET /livez HTTP/1.1\r\nhost: injector\r\n\r\n")
        .await
        .unwrap();
    let head = read_until(&mut late, b"ok\n").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let mut another = tls_to(addr, dir.path()).await;
    let request = format!(
        "POST /mutate HTTP/1.1\r\nhost: injector\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        review.len()
    );
    another.write_all(request.as_bytes()).await.unwrap();
    another.write_all(&review).await.unwrap();
    let head = read_until(&mut another, b"\r\n\r\n").await;
    assert!(
        head.starts_with("HTTP/1.1 200"),
        "a review during the delay: {head}"
    );
    eventually("new connections to be refused", DEADLINE, || async {
        TcpStream::connect(addr).await.is_err().then_some(())
    })
    .await;
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(DEADLINE, idle.read_to_end(&mut rest)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "the idle connection is closed at once: {closed:?}"
    );
    assert!(!task.is_finished(), "run waits for the review in progress");
    busy.write_all(&review[half..]).await.unwrap();
    let head = read_until(&mut busy, b"\r\n\r\n").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse().unwrap())
        })
        .expect("a content-length");
    let body_at = head.find("\r\n\r\n").unwrap() + 4;
    let mut answer = head.as_bytes()[body_at..].to_vec();
    answer.resize(length, 0);
    let already = head.len() - body_at;
    busy.read_exact(&mut answer[already..]).await.unwrap();
    let answer = String::from_utf8(answer).unwrap();
    assert!(answer.contains("\"allowed\":true"), "{answer}");
    tokio::time::timeout(DEADLINE, task)
        .await
        .expect("run ends once the review is answered")
        .expect("run does not panic");
}

/// Reads from `s` until `end` has been seen (what was read, as text).
async fn read_until(s: &mut (impl tokio::io::AsyncRead + Unpin), end: &[u8]) -> String {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(end.len()).any(|w| w == end) {
        let n = tokio::time::timeout(DEADLINE, s.read(&mut buf))
            .await
            .expect("an answer in time")
            .expect("read");
        assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// A TLS connection to `addr`, trusting `dir`'s ca.pem.
async fn tls_to(
    addr: std::net::SocketAddr,
    dir: &Path,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(dir.join("ca.pem")).unwrap())
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = ServerName::try_from("localhost").unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    tokio::time::timeout(
        DEADLINE,
        tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp),
    )
    .await
    .expect("the handshake in time")
    .expect("the handshake")
}

/// The certificate a new TLS connection to `addr` is shown (trusting `dir`'s ca.pem).
async fn presented(addr: std::net::SocketAddr, dir: &Path) -> CertificateDer<'static> {
    let tls = tls_to(addr, dir).await;
    let certificates = tls.get_ref().1.peer_certificates().expect("a certificate");
    certificates[0].clone().into_owned()
}

/// A reload is judged against the running `[server]` too: a route whose
/// `max_request_body` the file's new `max_buffered` allows, but the running
/// one (which changes only with a restart) does not, is refused, and the
/// route keeps its limit (413), where such bodies would have been 503 for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_whose_routes_exceed_the_running_max_buffered_is_refused() {
    let upstream = TestUpstream::start().await;
    let file = |buffered: &str, body: &str| {
        ConfigBuilder::new(&upstream.url())
            .server(&format!("max_buffered = \"{buffered}\""))
            .route(
                "payments",
                "/v1/payments",
                &format!("max_request_body = \"{body}\""),
            )
            .build()
    };
    let proxy = Running::start(&file("1MiB", "512KiB")).await;
    proxy
        .reload(&file("4MiB", "2MiB"), "configuration reload failed")
        .await;
    let big = vec![b'a'; 1_500_000];
    let answer = Call::post(&proxy.url("/v1/payments"))
        .key("k-big")
        .body(big)
        .await;
    assert_eq!(answer.status, 413, "{:?}", answer.body);
    // A reload within the running limits still applies.
    proxy
        .reload(&file("1MiB", "768KiB"), "configuration reloaded")
        .await;
    assert!(protected(&proxy, "/v1/payments", "k-1").await);
}
