//! `idemproxy injector`, the binary, as the API server meets it: AdmissionReview v1 over
//! TLS, the patch applied by another JSON-patch implementation, the certificate reloaded on SIGHUP.

mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use idemproxy_kube::webhook::{ANSWER_DEADLINE, BODY_DEADLINE};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

struct Injector {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
}

impl Drop for Injector {
    fn drop(&mut self) {
        kill_child(&mut self.child);
    }
}

impl Injector {
    /// The binary with certificate `one` (signed by `ca`), answering /healthz.
    async fn start() -> Injector {
        let dir = tempfile::tempdir().unwrap();
        make_ca(dir.path(), "ca");
        make_server_cert(dir.path(), "ca", "one", "injector-one");
        make_server_cert(dir.path(), "ca", "two", "injector-two");
        let mut injector = Injector {
            child: None,
            port: free_port(),
            dir,
        };
        injector.install("one");
        let child = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .arg("injector")
            .args(["--listen", &format!("127.0.0.1:{}", injector.port)])
            .arg("--tls-cert-file")
            .arg(injector.path("tls.pem"))
            .arg("--tls-key-file")
            .arg(injector.path("tls.key"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("idemproxy injector");
        injector.child = Some(child);
        let url = injector.url("/healthz");
        let ca = injector.path("ca.pem");
        eventually("the injector's /healthz", DEADLINE, || {
            let (url, ca) = (url.clone(), ca.clone());
            async move {
                let out = tokio::process::Command::new("curl")
                    .args(["-s", "-f", "--max-time", "5", "--cacert"])
                    .arg(&ca)
                    .arg(&url)
                    .output()
                    .await
                    .ok()?;
                (out.status.success() && out.stdout == b"ok\n").then_some(())
            }
        })
        .await;
        injector
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn url(&self, path: &str) -> String {
        format!("https://localhost:{}{path}", self.port)
    }

    fn install(&self, name: &str) {
        std::fs::copy(self.path(&format!("{name}.pem")), self.path("tls.pem")).unwrap();
        std::fs::copy(self.path(&format!("{name}.key")), self.path("tls.key")).unwrap();
    }

    /// POSTs `body` to `path` (verifying the certificate against the CA).
    async fn post(&self, path: &str, body: &[u8]) -> Answer {
        self.post_with(&[], path, body).await
    }

    /// [`Injector::post`] with more curl arguments (`--http1.1`).
    async fn post_with(&self, args: &[&str], path: &str, body: &[u8]) -> Answer {
        // A file of its own: posts may run at once.
        let file = self.path(&format!("body-{}.json", uuid::Uuid::new_v4()));
        std::fs::write(&file, body).unwrap();
        let ca = self.path("ca.pem").display().to_string();
        let data = format!("@{}", file.display());
        let url = self.url(path);
        let common = [
            "--cacert",
            &ca,
            "-H",
            "content-type: application/json",
            "--data-binary",
            &data,
        ];
        curl(&[&common[..], args, &[url.as_str()]].concat()).await
    }

    /// The AdmissionReview answer to a review of `pod`, checked for uid and allowed.
    async fn review(&self, path: &str, pod: &Value) -> Value {
        let review = admission_review(pod);
        let answer = self.post(path, review.to_string().as_bytes()).await;
        assert_eq!(
            answer.status,
            200,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
        let answer = answer.json();
        assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(answer["kind"], "AdmissionReview");
        assert_eq!(answer["response"]["uid"], review["request"]["uid"]);
        assert_eq!(answer["response"]["allowed"], true, "{answer}");
        answer["response"].clone()
    }

    /// The CN of the certificate new connections are shown.
    fn presented(&self) -> String {
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "openssl s_client -connect 127.0.0.1:{} -servername localhost </dev/null 2>/dev/null \
                 | openssl x509 -noout -subject",
                self.port
            ))
            .output()
            .expect("openssl s_client");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// A TLS connection for "localhost", trusting the test CA, offering `alpn`.
    async fn connect(&self, alpn: &[u8]) -> TlsStream<TcpStream> {
        let mut roots = rustls::RootCertStore::empty();
        let ca = CertificateDer::from_pem_file(self.path("ca.pem")).unwrap();
        roots.add(ca).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![alpn.to_vec()];
        let name = ServerName::try_from("localhost").unwrap();
        let port = self.port;
        let handshake = async move {
            let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
            TlsConnector::from(Arc::new(config))
                .connect(name, tcp)
                .await
        };
        tokio::time::timeout(DEADLINE, handshake)
            .await
            .expect("the handshake in time")
            .expect("the handshake")
    }

    /// An HTTP/2 connection from the `h2` crate's client, announcing `window`
    /// as its SETTINGS_INITIAL_WINDOW_SIZE (h2's 65 535 if `None`).
    async fn h2(&self, window: Option<u32>) -> H2 {
        let tls = self.connect(b"h2").await;
        let mut builder = h2::client::Builder::new();
        if let Some(w) = window {
            builder.initial_window_size(w);
        }
        let (send, mut connection) = builder.handshake(tls).await.expect("h2 handshake");
        let pings = connection.ping_pong().expect("the ping handle");
        let (ended, closed) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let _ = connection.await;
            let _ = ended.send(Instant::now());
        });
        H2 {
            send,
            pings,
            closed,
        }
    }

    /// A review POSTed over HTTP/2, declaring `len` bytes of body.
    fn h2_review(&self, len: usize) -> http::Request<()> {
        http::Request::post(self.url("/mutate"))
            .header("content-type", "application/json")
            .header("content-length", len)
            .body(())
            .unwrap()
    }

    async fn metric(&self, outcome: &str) -> u64 {
        let ca = self.path("ca.pem").display().to_string();
        let answer = curl(&["--cacert", &ca, &self.url("/metrics")]).await;
        let text = String::from_utf8_lossy(&answer.body).into_owned();
        let series = format!("idemproxy_injector_reviews_total{{outcome=\"{outcome}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&series))
            .map_or(0, |v| v.trim().parse().unwrap())
    }
}

/// An HTTP/2 connection to the injector; `closed` is when it was closed.
struct H2 {
    send: h2::client::SendRequest<Bytes>,
    pings: h2::PingPong,
    closed: tokio::sync::oneshot::Receiver<Instant>,
}

impl H2 {
    /// Returns once the injector has read every frame sent before: two
    /// PING round trips (h2 may send the first PING ahead of queued DATA).
    async fn synced(&mut self) {
        for _ in 0..2 {
            tokio::time::timeout(DEADLINE, self.pings.ping(h2::Ping::opaque()))
                .await
                .expect("a PONG in time")
                .expect("a PONG");
        }
    }
}

/// A Pod as the ReplicaSet controller creates it from microservices-demo's
/// frontend Deployment, with the defaults the API server has filled in.
fn frontend_pod(annotations: Value) -> Value {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/kubernetes/microservices-demo/kubernetes-manifests.yaml"),
    )
    .unwrap();
    let piece = text
        .split("\n---\n")
        .find(|d| d.contains("kind: Deployment\nmetadata:\n  name: frontend\n"))
        .expect("the frontend Deployment");
    let deployment: Value = serde_norway::from_str(piece).unwrap();
    let template = &deployment["spec"]["template"];
    let mut spec = template["spec"].clone();
    for c in spec["containers"].as_array_mut().unwrap() {
        c["imagePullPolicy"] = "IfNotPresent".into();
        c["terminationMessagePath"] = "/dev/termination-log".into();
        c["terminationMessagePolicy"] = "File".into();
        c["ports"][0]["protocol"] = "TCP".into();
    }
    spec["restartPolicy"] = "Always".into();
    spec["dnsPolicy"] = "ClusterFirst".into();
    spec["schedulerName"] = "default-scheduler".into();
    spec["terminationGracePeriodSeconds"] = 30.into();
    spec["enableServiceLinks"] = true.into();
    spec["preemptionPolicy"] = "PreemptLowerPriority".into();
    spec["priority"] = 0.into();
    let mut all_annotations = template["metadata"]["annotations"].clone();
    for (k, v) in annotations.as_object().unwrap() {
        all_annotations[k] = v.clone();
    }
    json!({
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "generateName": "frontend-6b8d9f7c5d-",
            "namespace": "shop",
            "labels": {"app": "frontend", "pod-template-hash": "6b8d9f7c5d"},
            "annotations": all_annotations,
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "frontend-6b8d9f7c5d",
                "uid": "4c3a0e2e-5b1e-4bd0-9c55-2f4c1d7b9a10", "controller": true,
                "blockOwnerDeletion": true
            }]
        },
        "spec": spec,
        "status": {}
    })
}

/// An AdmissionReview as the API server sends it for a Pod CREATE.
fn admission_review(pod: &Value) -> Value {
    let gvk = json!({"group": "", "version": "v1", "kind": "Pod"});
    let gvr = json!({"group": "", "version": "v1", "resource": "pods"});
    json!({
        "kind": "AdmissionReview",
        "apiVersion": "admission.k8s.io/v1",
        "request": {
            "uid": uuid::Uuid::new_v4().to_string(),
            "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
            "namespace": "shop",
            "operation": "CREATE",
            "userInfo": {
                "username": "system:serviceaccount:kube-system:replicaset-controller",
                "uid": "0b5d3d0e-2f0a-4b5e-8a0e-6f1e2a3b4c5d",
                "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"]
            },
            "object": pod,
            "oldObject": null,
            "dryRun": false,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
        }
    })
}

/// Applies the answer's patch to `pod` with Python's `jsonpatch` (another implementation).
fn apply(pod: &Value, response: &Value) -> Value {
    assert_eq!(response["patchType"], "JSONPatch", "{response}");
    let patch = base64::engine::general_purpose::STANDARD
        .decode(response["patch"].as_str().expect("a patch"))
        .expect("base64");
    let script = "import json, sys, jsonpatch\n\
                  doc, patch = json.load(sys.stdin)\n\
                  print(json.dumps(jsonpatch.apply_patch(doc, patch)))\n";
    let mut child = Command::new(peer_python())
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python");
    let input = format!("[{pod}, {}]", String::from_utf8(patch).unwrap());
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "jsonpatch (tests/run.sh installs it into the peers venv): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// What `idemproxy inject` makes of the same Pod (as JSON).
fn inject(pod: &Value) -> Value {
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .arg("inject")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(pod.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_annotated_pod_gets_the_same_sidecar_as_inject_gives() {
    let injector = Injector::start().await;
    let pod = frontend_pod(json!({"idemproxy.dev/inject": "enabled"}));
    let response = injector.review("/mutate", &pod).await;
    let patched = apply(&pod, &response);
    assert_ne!(patched, pod);
    assert_eq!(patched, inject(&pod));
    assert_eq!(patched["spec"]["initContainers"][0]["name"], "idemproxy");
    // The pod, once injected, comes back unchanged.
    let again = injector.review("/mutate", &patched).await;
    assert!(again.get("patch").is_none(), "{again}");
    assert_eq!(injector.metric("injected").await, 1);
    assert_eq!(injector.metric("already_injected").await, 1);
    // A pod with init containers of its own: the sidecar goes first, theirs after it.
    let mut with_init = pod.clone();
    with_init["spec"]["initContainers"] = json!([
        {"name": "wait-for-db", "image": "busybox:1.36", "command": ["sh", "-c", "true"]},
        {"name": "migrate", "image": "example/migrate:1"}
    ]);
    let response = injector.review("/mutate", &with_init).await;
    let patched = apply(&with_init, &response);
    assert_eq!(patched, inject(&with_init));
    let names: Vec<&str> = patched["spec"]["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["idemproxy", "wait-for-db", "migrate"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unannotated_pods_only_where_the_namespace_is_selected_and_never_when_disabled() {
    let injector = Injector::start().await;
    let plain = frontend_pod(json!({}));
    let response = injector.review("/mutate", &plain).await;
    assert!(response.get("patch").is_none(), "{response}");
    let response = injector.review("/mutate/namespace", &plain).await;
    assert_eq!(apply(&plain, &response), inject(&plain));
    let disabled = frontend_pod(json!({"idemproxy.dev/inject": "disabled"}));
    for path in ["/mutate", "/mutate/namespace"] {
        let response = injector.review(path, &disabled).await;
        assert!(response.get("patch").is_none(), "{path}: {response}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_it_cannot_inject_is_allowed_unchanged_and_counted() {
    let injector = Injector::start().await;
    // The annotation names a port the pod does not have.
    let pod =
        frontend_pod(json!({"idemproxy.dev/inject": "enabled", "idemproxy.dev/port": "grpc"}));
    let response = injector.review("/mutate", &pod).await;
    assert!(response.get("patch").is_none(), "{response}");
    assert_eq!(injector.metric("failed").await, 1);
    // ... and says so to whoever created it (kubectl prints the warnings).
    let warnings = response["warnings"].as_array().expect("a warning");
    assert_eq!(warnings.len(), 1, "{response}");
    let warning = warnings[0].as_str().unwrap();
    assert!(
        warning.starts_with("idemproxy: the sidecar was not added: "),
        "{warning}"
    );
    assert!(warning.contains("grpc"), "{warning}");
    // A port annotation with a line break and 1000 characters: one short printable line.
    let long = format!("no\nsuch{}", "x".repeat(1000));
    let pod = frontend_pod(json!({"idemproxy.dev/inject": "enabled", "idemproxy.dev/port": long}));
    let response = injector.review("/mutate", &pod).await;
    let warning = response["warnings"][0].as_str().expect("a warning");
    assert!(
        warning.chars().count() <= 201 && !warning.contains('\n'),
        "{warning}"
    );
    // A Redis pod: its only port is not HTTP. Annotated, it is warned; in an
    // injected namespace without the annotation, it is left alone quietly.
    let mut redis = frontend_pod(json!({"idemproxy.dev/inject": "enabled"}));
    redis["spec"]["containers"][0]["ports"][0]["containerPort"] = 6379.into();
    let response = injector.review("/mutate", &redis).await;
    assert!(response.get("patch").is_none(), "{response}");
    assert!(response["warnings"][0].as_str().is_some(), "{response}");
    let mut quiet_redis = frontend_pod(json!({}));
    quiet_redis["spec"]["containers"][0]["ports"][0]["containerPort"] = 6379.into();
    let response = injector.review("/mutate/namespace", &quiet_redis).await;
    assert!(response.get("patch").is_none(), "{response}");
    assert!(response.get("warnings").is_none(), "{response}");
    assert_eq!(injector.metric("skipped").await, 2);
    // A review without an object is allowed too.
    let mut review = admission_review(&pod);
    review["request"].as_object_mut().unwrap().remove("object");
    let answer = injector
        .post("/mutate", review.to_string().as_bytes())
        .await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.json()["response"]["allowed"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_review_is_a_400() {
    let injector = Injector::start().await;
    for body in [
        &b"not json"[..],
        b"{\"kind\": \"AdmissionReview\"}",
        b"{\"request\": {}}",
    ] {
        let answer = injector.post("/mutate", body).await;
        assert_eq!(answer.status, 400, "{}", String::from_utf8_lossy(body));
    }
    assert_eq!(injector.metric("malformed").await, 3);
    // Over 3 MiB: refused before it is read, by its Content-Length. (Over
    // HTTP/2 the stream is then reset while curl is still sending, which
    // curl 7.88 reports as an error even after the 413.)
    let big = format!("{{\"junk\": \"{}\"}}", "x".repeat(3 << 20));
    let answer = injector
        .post_with(&["--http1.1"], "/mutate", big.as_bytes())
        .await;
    assert_eq!(answer.status, 413);
}

/// The peak resident memory of a process (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .expect("VmHWM")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    kb * 1024
}

/// `n` copies of `{}` as a JSON array's items.
fn empties(n: usize) -> String {
    let mut s = String::with_capacity(n * 3);
    for i in 0..n {
        if i > 0 {
            s.push(',');
        }
        s.push_str("{}");
    }
    s
}

/// What anyone who can reach the port can send (the review's own limits):
/// bodies of nearly 3 MiB of empty objects, in the review and in the Pod, the
/// largest Pod it still reads (just under the value limit, with a 2 MiB
/// annotation), the Pod whose parsed tree is largest (49 000 one-key
/// objects), each 8 times over one HTTP/2 connection and 8 times over
/// HTTP/1.1 connections at once. The injector's peak memory stays under the
/// container's limit in `deploy/kubernetes/injector/deployment.yaml` less
/// 32 MiB (what the arithmetic there gives the connections, and a margin;
/// about 60 MiB measured), and it still answers reviews afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reviews_meant_to_exhaust_its_memory_stay_within_the_limit() {
    let injector = Injector::start().await;
    let pid = injector.child.as_ref().unwrap().id();
    let before = peak_rss(pid);
    let pod = frontend_pod(json!({"idemproxy.dev/inject": "enabled"}));
    // 1. Junk beside the request (the first finding's proof of concept).
    let mut outer = admission_review(&pod).to_string();
    outer.insert_str(
        outer.len() - 1,
        &format!(",\"junk\":[{}]", empties(1_000_000)),
    );
    // 2. Junk inside the Pod.
    let mut inner_pod = pod.clone();
    inner_pod["spec"]["junk"] = json!("JUNK");
    let inner = admission_review(&inner_pod)
        .to_string()
        .replace("\"JUNK\"", &format!("[{}]", empties(1_000_000)));
    // 3. The largest Pod it reads: just under the value limit, and a long string.
    let mut largest_pod = pod.clone();
    largest_pod["metadata"]["annotations"]["example.com/blob"] = "y".repeat(2 << 20).into();
    largest_pod["spec"]["junk"] = json!("JUNK");
    let largest = admission_review(&largest_pod)
        .to_string()
        .replace("\"JUNK\"", &format!("[{}]", empties(145_000)));
    // 4. The Pod whose parsed tree is largest for its size: 49 000 objects
    // of one key, near the value limit (each a map allocation of its own;
    // 92 MiB for one review before it was moved, not copied, through).
    let mut maps_pod = pod.clone();
    maps_pod["spec"]["junk"] = json!("JUNK");
    let one_key = vec!["{\"a\":0}"; 49_000].join(",");
    let maps = admission_review(&maps_pod)
        .to_string()
        .replace("\"JUNK\"", &format!("[{one_key}]"));
    let ca = injector.path("ca.pem").display().to_string();
    let url = injector.url("/mutate");
    let mut codes = String::new();
    let bodies = [
        ("outer", &outer),
        ("inner", &inner),
        ("largest", &largest),
        ("maps", &maps),
    ];
    for (name, body) in bodies {
        assert!(body.len() < 3 << 20, "{name}: {}", body.len());
        let file = injector.path(&format!("{name}.json"));
        std::fs::write(&file, body).unwrap();
        let data = format!("@{}", file.display());
        let common = [
            "-s",
            "--max-time",
            "30",
            "--cacert",
            &ca,
            "-H",
            "content-type: application/json",
            "--data-binary",
            &data,
            "-w",
            "%{http_version} %{http_code} %{errormsg}\n",
        ];
        // Eight streams on one HTTP/2 connection ...
        let mut h2 = tokio::process::Command::new("curl");
        h2.args(common)
            .args(["--http2", "--parallel", "--parallel-max", "8"]);
        for _ in 0..8 {
            h2.args(["-o", "/dev/null", &url]);
        }
        // ... and eight HTTP/1.1 connections, all at once.
        let mut runs = vec![h2.output()];
        let mut h1s: Vec<_> = (0..8)
            .map(|_| {
                let mut c = tokio::process::Command::new("curl");
                c.args(common).args(["--http1.1", "-o", "/dev/null", &url]);
                c
            })
            .collect();
        runs.extend(h1s.iter_mut().map(|c| c.output()));
        for out in futures_util::future::join_all(runs).await {
            let out = out.unwrap();
            codes.push_str(&String::from_utf8_lossy(&out.stdout));
        }
    }
    let after = peak_rss(pid);
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    eprintln!(
        "peak RSS {:.1} MiB before, {:.1} MiB after; answers:\n{codes}",
        mib(before),
        mib(after)
    );
    // Every request was answered: 200 (allowed) or 503 (too many at once; over
    // HTTP/2 the stream is reset once the 503 is sent, its body unread, which
    // curl reports as a framing error).
    let answers: Vec<&str> = codes.lines().collect();
    assert_eq!(answers.len(), 4 * 16, "{codes}");
    assert!(
        answers.iter().all(|a| a.contains(" 200 ")
            || a.contains(" 503 ")
            || a.starts_with("0 000 Stream error in the HTTP/2 framing layer")),
        "{codes}"
    );
    assert!(answers.iter().any(|a| a.starts_with("2 200")), "{codes}");
    assert!(injector.metric("too_large").await >= 1);
    let most = memory_limit() - (32 << 20);
    assert!(after < most, "peak RSS {:.1} MiB", mib(after));
    // Still serving.
    let response = injector.review("/mutate", &pod).await;
    assert_eq!(apply(&pod, &response), inject(&pod));
}

/// A Pod whose field-by-field patch would be 130 MB from a 200 KB review:
/// two init containers under one 100 KB key, their 1 000 values each
/// differing, and the sidecar shifting them, so that each value's path
/// repeats the key (it made the injector hold 312 MiB). The patch is about
/// the Pod's size instead, and says the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patch_is_never_much_larger_than_the_pod() {
    let injector = Injector::start().await;
    let pid = injector.child.as_ref().unwrap().id();
    let mut pod = frontend_pod(json!({"idemproxy.dev/inject": "enabled"}));
    let key = "k".repeat(100_000);
    let values = |first: u32| -> Vec<u32> { (0..1000).map(|i| (first + i) % 2).collect() };
    pod["spec"]["initContainers"] = json!([
        {"name": "a", "image": "busybox:1.36", &key: values(0)},
        {"name": "b", "image": "busybox:1.36", &key: values(1)}
    ]);
    let review = admission_review(&pod).to_string();
    let response = injector.review("/mutate", &pod).await;
    let patch = response["patch"].as_str().expect("a patch").len();
    eprintln!(
        "review {} bytes, patch {patch} bytes (base64), peak RSS {} KiB",
        review.len(),
        peak_rss(pid) >> 10
    );
    assert!(patch < 2 * review.len(), "{patch}");
    assert_eq!(apply(&pod, &response), inject(&pod));
    assert!(peak_rss(pid) < 64 << 20, "{} KiB", peak_rss(pid) >> 10);
}

/// Reads an HTTP/1.1 response head (to the blank line) from `tls`; "" if the
/// connection was closed first.
async fn read_head(tls: &mut TlsStream<TcpStream>) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match tokio::time::timeout(DEADLINE, tls.read(&mut byte)).await {
            Ok(Ok(1)) => head.push(byte[0]),
            Ok(_) => break,
            Err(_) => panic!(
                "no answer within {DEADLINE:?}: {}",
                String::from_utf8_lossy(&head)
            ),
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// An idle HTTP/1.1 review: its headers (declaring `declared` bytes and
/// expecting 100 Continue), and once the injector starts reading the body
/// (100 Continue), one byte of it. The connection, what it got first (the
/// 100, or a final answer), and when the headers went.
async fn idle_h1(injector: &Injector, declared: usize) -> (TlsStream<TcpStream>, String, Instant) {
    let mut tls = injector.connect(b"http/1.1").await;
    let head = format!(
        "POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {declared}\r\nExpect: 100-continue\r\n\r\n"
    );
    tls.write_all(head.as_bytes()).await.unwrap();
    let sent = Instant::now();
    let first = read_head(&mut tls).await;
    if first.starts_with("HTTP/1.1 100") {
        tls.write_all(b"{").await.unwrap();
        tls.flush().await.unwrap();
    }
    (tls, first, sent)
}

/// The finding: connections that send a review's headers and one
/// byte of its body, then nothing, held all four review slots, and real
/// reviews got 503 (with `failurePolicy: Ignore`, pods without the
/// sidecar). Sixteen such HTTP/1.1 connections and two HTTP/2 connections
/// of four such streams: each body is being read (100 Continue; a PING
/// answered after its frames), real reviews meanwhile are answered and
/// patched, in time, and the idle ones end at their body deadline (408).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_bodies_do_not_take_the_review_slots() {
    let injector = Injector::start().await;
    let pod = frontend_pod(json!({"idemproxy.dev/inject": "enabled"}));
    let declared = admission_review(&pod).to_string().len();
    let h1 = futures_util::future::join_all((0..16).map(|_| idle_h1(&injector, declared))).await;
    let mut h2s = Vec::new();
    for _ in 0..2 {
        let mut h2 = injector.h2(None).await;
        let mut streams = Vec::new();
        for _ in 0..4 {
            let mut send = h2.send.clone().ready().await.expect("a stream");
            let (response, mut body) = send
                .send_request(injector.h2_review(declared), false)
                .unwrap();
            body.send_data(Bytes::from_static(b"{"), false).unwrap();
            streams.push((response, body, Instant::now()));
        }
        h2.synced().await;
        h2s.push((h2, streams));
    }
    // Real reviews meanwhile: four one after the other, four at once.
    let mut took = Vec::new();
    for _ in 0..4 {
        let asked = Instant::now();
        let response = injector.review("/mutate", &pod).await;
        took.push(asked.elapsed());
        assert_eq!(apply(&pod, &response), inject(&pod));
    }
    let asked = Instant::now();
    let at_once = (0..4).map(|_| injector.review("/mutate", &pod));
    for response in futures_util::future::join_all(at_once).await {
        assert_eq!(apply(&pod, &response), inject(&pod));
    }
    took.push(asked.elapsed());
    eprintln!("real reviews took {took:?}");
    assert!(took.iter().all(|t| *t < BODY_DEADLINE), "{took:?}");
    assert_eq!(injector.metric("busy").await, 0);
    // The idle ones were all being read, and end at their deadline.
    let slack = Duration::from_secs(3);
    for (mut tls, first, sent) in h1 {
        assert!(first.starts_with("HTTP/1.1 100 Continue"), "{first}");
        let last = read_head(&mut tls).await;
        let after = sent.elapsed();
        assert!(
            last.is_empty() || last.starts_with("HTTP/1.1 408"),
            "{last}"
        );
        assert!(after < BODY_DEADLINE + slack, "{after:?}");
    }
    for (h2, streams) in h2s {
        for (response, _body, sent) in streams {
            let response = tokio::time::timeout(DEADLINE, response)
                .await
                .expect("an answer in time");
            let after = sent.elapsed();
            if let Ok(response) = response {
                assert_eq!(response.status(), 408);
            }
            assert!(after < BODY_DEADLINE + slack, "{after:?}");
        }
        drop(h2);
    }
    assert!(injector.metric("malformed").await >= 24);
}

/// What idle bodies can hold of the body budget cannot turn an ordinary
/// review away: two declaring 3 MiB (all the large ones may hold together)
/// and 36 HTTP/2 connections of 4 streams declaring 16 KiB (the most a
/// small one may), one byte each. Real reviews meanwhile find room, and
/// are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordinary_review_finds_room_whatever_idle_bodies_hold() {
    let injector = Injector::start().await;
    let pod = frontend_pod(json!({"idemproxy.dev/inject": "enabled"}));
    let large = futures_util::future::join_all((0..2).map(|_| idle_h1(&injector, 3 << 20))).await;
    for (_, first, _) in &large {
        assert!(first.starts_with("HTTP/1.1 100 Continue"), "{first}");
    }
    let mut small = Vec::new();
    for _ in 0..36 {
        let mut h2 = injector.h2(None).await;
        let mut streams = Vec::new();
        for _ in 0..4 {
            let mut send = h2.send.clone().ready().await.expect("a stream");
            let (response, mut body) = send
                .send_request(injector.h2_review(16 << 10), false)
                .unwrap();
            body.send_data(Bytes::from_static(b"{"), false).unwrap();
            streams.push((response, body));
        }
        h2.synced().await;
        small.push((h2, streams));
    }
    for _ in 0..4 {
        let asked = Instant::now();
        let response = injector.review("/mutate", &pod).await;
        assert!(asked.elapsed() < BODY_DEADLINE, "{:?}", asked.elapsed());
        assert_eq!(apply(&pod, &response), inject(&pod));
    }
    assert_eq!(injector.metric("busy").await, 0);
    drop((large, small));
}

/// The container's memory limit in `deploy/kubernetes/injector/deployment.yaml`, in bytes.
fn memory_limit() -> u64 {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes/injector/deployment.yaml"),
    )
    .unwrap();
    let deployment: Value = serde_norway::from_str(&text).unwrap();
    let limit = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        ["memory"]
        .as_str()
        .expect("a memory limit");
    let (n, unit) = limit.split_at(limit.find(|c: char| !c.is_ascii_digit()).unwrap());
    let unit = match unit {
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        _ => panic!("a memory limit in Mi or Gi: {limit}"),
    };
    n.parse::<u64>().unwrap() * unit
}

/// A Pod of 10 000 init containers (besides its own container): the
/// sidecar goes first, so each of them shifts, and its patch is large (2.9 MB
/// field by field; about 1.5 MB answered whole).
fn pod_of_many_containers() -> Value {
    let mut pod = frontend_pod(json!({"idemproxy.dev/inject": "enabled"}));
    let steps: Vec<Value> = (0..10_000)
        .map(|i| {
            json!({
                "name": format!("step-{i:05}"),
                "image": format!("registry.example.com/steps/step:{i:05}"),
                "args": ["--step", format!("{i:05}")]
            })
        })
        .collect();
    pod["spec"]["initContainers"] = steps.into();
    pod
}

/// What one stream of a client that never takes its answers keeps.
type Kept = (h2::SendStream<Bytes>, http::Response<h2::RecvStream>);

/// The answers a connection of [`keep_answers`] got: status, when the headers came.
type Answers = Arc<Mutex<Vec<(u16, Instant)>>>;

/// One stream of an HTTP/2 client that never takes its answers: asks for
/// the patch of `body`, records each answer's status and when its headers
/// came (`answered` counts the streams with one), and keeps the first 200
/// it gets (unread: its window stays shut); another answer (503, 408) is
/// dropped (the stream reset) and asked again, until `stop`.
async fn ask_and_keep(
    send: h2::client::SendRequest<Bytes>,
    request: impl Fn() -> http::Request<()>,
    body: Bytes,
    stop: tokio::sync::watch::Receiver<bool>,
    (answers, answered): (Answers, Arc<AtomicUsize>),
) -> Option<Kept> {
    let mut first = true;
    loop {
        let mut send = send.clone().ready().await.ok()?;
        let (response, mut stream) = send.send_request(request(), false).ok()?;
        let _ = stream.send_data(body.clone(), true);
        let response = response.await.ok()?;
        let status = response.status().as_u16();
        answers.lock().unwrap().push((status, Instant::now()));
        if std::mem::take(&mut first) {
            answered.fetch_add(1, Ordering::SeqCst);
        }
        if status == 200 || *stop.borrow() {
            return Some((stream, response));
        }
    }
}

/// One attacking connection: `window` (0: shut from the start; `None`:
/// h2's 65 535, never given back), four streams of [`ask_and_keep`]. Its
/// answers, and when the injector closed it (if within the deadline).
async fn keep_answers(
    injector: &Injector,
    window: Option<u32>,
    body: Bytes,
    stop: tokio::sync::watch::Receiver<bool>,
    answered: Arc<AtomicUsize>,
) -> (Vec<(u16, Instant)>, Option<Instant>) {
    let h2 = injector.h2(window).await;
    let answers: Answers = Arc::default();
    let (len, uri) = (body.len(), injector.url("/mutate"));
    let streams = (0..4).map(|_| {
        let uri = uri.clone();
        let request = move || {
            http::Request::post(uri.as_str())
                .header("content-type", "application/json")
                .header("content-length", len)
                .body(())
                .unwrap()
        };
        let counts = (answers.clone(), answered.clone());
        ask_and_keep(h2.send.clone(), request, body.clone(), stop.clone(), counts)
    });
    let kept = futures_util::future::join_all(streams).await;
    let closed = tokio::time::timeout(ANSWER_DEADLINE + DEADLINE, h2.closed).await;
    drop(kept);
    let answers = answers.lock().unwrap().clone();
    (answers, closed.ok().and_then(Result::ok))
}

/// HTTP/2 clients that keep their window shut (SETTINGS_INITIAL_WINDOW_SIZE
/// 0, or h2's 65 535 never given back) while asking for the patch of a Pod
/// with 10 000 containers, on 40 connections of 4 streams, asking again
/// when answered 503: with every answer held until sent, they made the
/// injector hold 223 MiB against its 128 MiB limit. Its peak memory stays
/// under the container's limit, a real review meanwhile is answered in
/// time, and each of these connections is closed once an answer on it has
/// not been taken for [`ANSWER_DEADLINE`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_not_taken_are_bounded_and_their_connections_closed() {
    let injector = Injector::start().await;
    let pid = injector.child.as_ref().unwrap().id();
    let (limit, before) = (memory_limit(), peak_rss(pid));
    let big = Bytes::from(admission_review(&pod_of_many_containers()).to_string());
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let answered = Arc::new(AtomicUsize::new(0));
    let attack = futures_util::future::join_all((0..40).map(|i| {
        let window = if i % 2 == 0 { Some(0) } else { None };
        keep_answers(
            &injector,
            window,
            big.clone(),
            stop.clone(),
            answered.clone(),
        )
    }));
    let pod = frontend_pod(json!({"idemproxy.dev/inject": "enabled"}));
    let review = admission_review(&pod);
    let meanwhile = async {
        eventually("an answer on each of the 160 streams", DEADLINE, || async {
            (answered.load(Ordering::SeqCst) >= 160).then_some(())
        })
        .await;
        let asked = Instant::now();
        let answer = injector
            .post("/mutate", review.to_string().as_bytes())
            .await;
        let took = asked.elapsed();
        stop_tx.send(true).unwrap();
        (answer, took)
    };
    let (connections, (answer, took)) = tokio::join!(attack, meanwhile);
    let after = peak_rss(pid);
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let statuses = connections.iter().flat_map(|c| c.0.iter().map(|a| a.0));
    let mut counts = std::collections::BTreeMap::<u16, usize>::new();
    statuses.for_each(|s| *counts.entry(s).or_default() += 1);
    let ok = counts.get(&200).copied().unwrap_or(0);
    // How long after its last answer each connection was closed.
    let closed: Vec<Option<Duration>> = connections
        .iter()
        .map(|(answers, closed)| {
            let last = answers.iter().map(|a| a.1).max()?;
            Some(closed.as_ref()?.saturating_duration_since(last))
        })
        .collect();
    eprintln!(
        "peak RSS {:.1} MiB before, {:.1} MiB after (limit {:.0} MiB); attacking streams \
         answered (status: times) {counts:?}; the real review: {} in {took:?}; \
         connections closed after their last answer: {closed:?}",
        mib(before),
        mib(after),
        mib(limit),
        answer.status
    );
    assert!(after < limit, "peak RSS {:.1} MiB", mib(after));
    assert!(ok > 0, "no large patch was answered");
    // 503: no room or no slot in time; 408: the body did not come in time
    // (the injector reads only what it has room for).
    assert!(
        counts.keys().all(|s| [200, 408, 503].contains(s)),
        "{counts:?}"
    );
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    let response = answer.json()["response"].clone();
    assert_eq!(apply(&pod, &response), inject(&pod));
    assert!(took < BODY_DEADLINE, "{took:?}");
    let slack = Duration::from_secs(3);
    assert!(
        closed
            .iter()
            .all(|c| c.is_some_and(|c| c < ANSWER_DEADLINE + slack)),
        "{closed:?}"
    );
}

/// A connection that sends no request is closed after the idle timeout (10 s),
/// HTTP/2 included: a client cannot hold connections open for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed() {
    let injector = Injector::start().await;
    let started = std::time::Instant::now();
    // openssl s_client completes the handshake (offering h2) and exits when the server closes.
    let mut child = tokio::process::Command::new("openssl")
        .args(["s_client", "-quiet", "-alpn", "h2", "-connect"])
        .arg(format!("127.0.0.1:{}", injector.port))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let _stdin = child.stdin.take();
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait())
        .await
        .expect("the idle connection closed within 30 s");
    eprintln!("closed after {:?} ({status:?})", started.elapsed());
    assert!(started.elapsed() >= std::time::Duration::from_secs(9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_swaps_the_certificate() {
    let injector = Injector::start().await;
    assert!(
        injector.presented().contains("injector-one"),
        "{}",
        injector.presented()
    );
    injector.install("two");
    let pid = injector.child.as_ref().unwrap().id().to_string();
    let status = Command::new("kill").args(["-HUP", &pid]).status().unwrap();
    assert!(status.success());
    eventually("the new certificate", DEADLINE, || async {
        injector.presented().contains("injector-two").then_some(())
    })
    .await;
    // Still answering reviews.
    let pod = frontend_pod(json!({"idemproxy.dev/inject": "enabled"}));
    let response = injector.review("/mutate", &pod).await;
    assert_eq!(apply(&pod, &response), inject(&pod));
}

/// A pod the sidecar would make invalid (a container already named
/// `idemproxy`, a Windows pod) is allowed unchanged with a warning, also
/// when it was sent only because its namespace is selected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_the_sidecar_would_make_invalid_is_allowed_unchanged_with_a_warning() {
    let injector = Injector::start().await;
    let mut windows = frontend_pod(json!({}));
    windows["spec"]["os"] = json!({"name": "windows"});
    let mut named = frontend_pod(json!({}));
    named["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "idemproxy", "image": "someone/else:1"}));
    for (pod, why) in [
        (windows, "windows pod"),
        (named, "already has a container named"),
    ] {
        for path in ["/mutate/namespace", "/mutate"] {
            let mut pod = pod.clone();
            if path == "/mutate" {
                pod["metadata"]["annotations"] = json!({"idemproxy.dev/inject": "enabled"});
            }
            let response = injector.review(path, &pod).await;
            assert!(response.get("patch").is_none(), "{path}: {response}");
            assert_eq!(response["allowed"], true, "{response}");
            let warnings = response["warnings"].as_array().expect("a warning");
            assert!(
                warnings
                    .iter()
                    .any(|w| w.as_str().is_some_and(|w| w.contains(why))),
                "{path}: {response}"
            );
        }
    }
}

/// Sockets that never start TLS (or finish it and say nothing) cannot keep
/// the API server out: with every connection place taken by them, a new
/// connection takes the place of the oldest one with no request in
/// progress, and a real review is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockets_that_never_start_tls_do_not_keep_reviews_out() {
    let injector = Injector::start().await;
    let pod = frontend_pod(json!({}));
    let mut idle = Vec::new();
    for _ in 0..2 * idemproxy_kube::webhook::MAX_CONNECTIONS {
        idle.push(
            tokio::net::TcpStream::connect(("127.0.0.1", injector.port))
                .await
                .expect("connect"),
        );
    }
    for _ in 0..3 {
        let response = injector.review("/mutate/namespace", &pod).await;
        assert_eq!(apply(&pod, &response), inject(&pod), "{response}");
    }
    drop(idle);
}
