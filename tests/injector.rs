//! `idemproxy injector`, the binary, as the API server meets it: AdmissionReview v1 over
//! TLS, the patch applied by another JSON-patch implementation, the certificate reloaded on SIGHUP.

mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use base64::Engine as _;
use serde_json::{json, Value};
use support::*;

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
        let file = self.path("body.json");
        std::fs::write(&file, body).unwrap();
        let ca = self.path("ca.pem").display().to_string();
        let data = format!("@{}", file.display());
        curl(&[
            "--cacert",
            &ca,
            "-H",
            "content-type: application/json",
            "--data-binary",
            &data,
            &self.url(path),
        ])
        .await
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
    // Over 3 MiB: refused before it is parsed.
    let big = format!("{{\"junk\": \"{}\"}}", "x".repeat(3 << 20));
    let answer = injector.post("/mutate", big.as_bytes()).await;
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
/// annotation), each 8 times over one HTTP/2 connection and 8 times over
/// HTTP/1.1 connections at once. The injector's peak memory stays under
/// 64 MiB, the container's limit in `deploy/kubernetes/injector/deployment.yaml`
/// less a margin, and it still answers reviews afterwards.
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
    let ca = injector.path("ca.pem").display().to_string();
    let url = injector.url("/mutate");
    let mut codes = String::new();
    for (name, body) in [("outer", &outer), ("inner", &inner), ("largest", &largest)] {
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
    assert_eq!(answers.len(), 3 * 16, "{codes}");
    assert!(
        answers.iter().all(|a| a.contains(" 200 ")
            || a.contains(" 503 ")
            || a.starts_with("0 000 Stream error in the HTTP/2 framing layer")),
        "{codes}"
    );
    assert!(answers.iter().any(|a| a.starts_with("2 200")), "{codes}");
    assert!(injector.metric("too_large").await >= 1);
    assert!(after < 64 << 20, "peak RSS {:.1} MiB", mib(after));
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
