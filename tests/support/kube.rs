//! `idemproxy inject` as the tests run it, and what they read back from its
//! output: documents, workloads, sidecars, which container a Service port
//! reaches, and strict validation for Kubernetes 1.29 and 1.37.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_norway::Value;

pub fn fixture(path: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kubernetes")
        .join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The kubernetes/examples files of one example, as one stream.
pub fn example(paths: &[&str]) -> String {
    let texts: Vec<String> = paths
        .iter()
        .map(|p| fixture(&format!("kubernetes-examples/{p}")))
        .collect();
    texts.join("---\n")
}

/// Runs `idemproxy inject ARGS` with `input` on standard input.
pub fn inject(args: &[&str], input: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .arg("inject")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("idemproxy");
    let mut stdin = child.stdin.take().expect("stdin");
    let text = input.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(text.as_bytes()));
    let out = child.wait_with_output().expect("idemproxy inject");
    // A process that exits before reading (a bad --config) closes the pipe: not an error here.
    let _ = writer.join().expect("writer");
    out
}

/// The output of a successful injection.
pub fn injected(args: &[&str], input: &str) -> (String, String) {
    let out = inject(args, input);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    (String::from_utf8(out.stdout).expect("UTF-8"), stderr)
}

/// The documents of a YAML stream (empty ones left out).
pub fn documents(text: &str) -> Vec<Value> {
    let mut docs = Vec::new();
    for piece in text.split("\n---") {
        let v: Value = serde_norway::from_str(piece).unwrap_or_else(|e| panic!("{e}: {piece}"));
        if !v.is_null() {
            docs.push(v);
        }
    }
    docs
}

pub fn kind(v: &Value) -> &str {
    v["kind"].as_str().unwrap_or("")
}

pub fn name(v: &Value) -> &str {
    v["metadata"]["name"].as_str().unwrap_or("")
}

pub fn template(v: &Value) -> &Value {
    match kind(v) {
        "Pod" => v,
        "CronJob" => &v["spec"]["jobTemplate"]["spec"]["template"],
        _ => &v["spec"]["template"],
    }
}

pub fn seq(v: &Value) -> &[Value] {
    v.as_sequence().map(Vec::as_slice).unwrap_or(&[])
}

pub fn sidecar(workload: &Value) -> Option<&Value> {
    seq(&template(workload)["spec"]["initContainers"])
        .iter()
        .find(|c| c["name"] == "idemproxy")
}

pub fn selects(service: &Value, workload: &Value) -> bool {
    let Some(selector) = service["spec"]["selector"].as_mapping() else {
        return false;
    };
    let labels = &template(workload)["metadata"]["labels"];
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The container a Service port reaches in the pod: its targetPort (the port when
/// absent) resolved by name or number against every container's ports.
pub fn reached<'a>(pod_spec: &'a Value, service_port: &Value) -> Option<&'a Value> {
    let target = match &service_port["targetPort"] {
        Value::Null => service_port["port"].clone(),
        t => t.clone(),
    };
    let containers = seq(&pod_spec["initContainers"])
        .iter()
        .chain(seq(&pod_spec["containers"]));
    let mut found = None;
    for c in containers {
        for p in seq(&c["ports"]) {
            let hit = match &target {
                Value::String(n) => p["name"].as_str() == Some(n),
                n => p["containerPort"] == *n,
            };
            if hit {
                assert!(found.is_none(), "two containers answer {target:?}");
                found = Some(c);
            }
        }
    }
    found
}

/// kubernetes-validate, from the peers venv (tests/run.sh installs it there).
pub fn kubernetes_validate() -> PathBuf {
    let python = super::peer_python();
    let bin = python.with_file_name("kubernetes-validate");
    assert!(
        bin.exists(),
        "{} is missing: tests/run.sh installs kubernetes-validate into the peers venv",
        bin.display()
    );
    bin
}

/// Fails the test unless `--strict` validation passes for 1.29 and 1.37.
pub fn assert_valid(text: &str) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("out.yaml");
    std::fs::write(&file, text).unwrap();
    for version in ["1.29.0", "1.37.0"] {
        let out = Command::new(kubernetes_validate())
            .args(["--strict", "-k", version, "--quiet"])
            .arg(&file)
            .output()
            .expect("kubernetes-validate");
        assert!(
            out.status.success(),
            "kubernetes-validate --strict -k {version}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The application containers of `after` are those of `before` but for the names of their ports.
pub fn assert_apps_unchanged(before: &Value, after: &Value) {
    let strip = |v: &Value| {
        let mut cs = template(v)["spec"]["containers"].clone();
        for c in cs.as_sequence_mut().into_iter().flatten() {
            if let Some(ports) = c.get_mut("ports").and_then(Value::as_sequence_mut) {
                for p in ports {
                    if let Some(p) = p.as_mapping_mut() {
                        p.remove("name");
                    }
                }
            }
        }
        cs
    };
    assert_eq!(strip(before), strip(after), "{}", name(before));
    // Init containers of the application stay, after the sidecar.
    let init = |v: &Value| {
        seq(&template(v)["spec"]["initContainers"])
            .iter()
            .filter(|c| c["name"] != "idemproxy")
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(init(before), init(after), "{}", name(before));
}

/// Every Service that selects an injected workload reaches the sidecar on
/// every port that led to the protected application port (the sidecar's
/// `--upstream`), and no port of it reaches that application port around the
/// proxy; the ones that select a workload left alone reach the app. Returns
/// how many Service ports reach a sidecar.
pub fn assert_services_reach_the_proxy(out: &[Value]) -> usize {
    let mut through_proxy = 0;
    for svc in out.iter().filter(|d| kind(d) == "Service") {
        for w in out.iter().filter(|w| selects(svc, w)) {
            let spec = &template(w)["spec"];
            let app_port = sidecar(w).and_then(|s| {
                seq(&s["args"])
                    .iter()
                    .filter_map(Value::as_str)
                    .find_map(|a| a.strip_prefix("http://127.0.0.1:"))
                    .and_then(|p| p.parse::<u64>().ok())
            });
            for port in seq(&svc["spec"]["ports"]) {
                // A port no container declares (a number the app listens on
                // unannounced) must not be the protected one.
                let Some(c) = reached(spec, port) else {
                    let target = match &port["targetPort"] {
                        Value::Null => &port["port"],
                        t => t,
                    };
                    assert!(
                        app_port.is_none() || target.as_u64() != app_port,
                        "Service {} reaches {}'s protected port around the proxy",
                        name(svc),
                        name(w)
                    );
                    continue;
                };
                if c["name"] == "idemproxy" {
                    assert!(sidecar(w).is_some());
                    through_proxy += 1;
                    continue;
                }
                if let Some(app_port) = app_port {
                    let target = match &port["targetPort"] {
                        Value::Null => port["port"].clone(),
                        t => t.clone(),
                    };
                    let number = seq(&c["ports"])
                        .iter()
                        .find(|p| match &target {
                            Value::String(n) => p["name"].as_str() == Some(n),
                            n => p["containerPort"] == *n,
                        })
                        .map(|p| p["containerPort"].clone())
                        .unwrap_or(target);
                    assert_ne!(
                        number.as_u64(),
                        Some(app_port),
                        "Service {} port {port:?} reaches {}'s protected port around the proxy",
                        name(svc),
                        name(w)
                    );
                }
            }
        }
    }
    through_proxy
}
