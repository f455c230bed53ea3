//! What the tests of `idemproxy openapi` share (tests/openapi.rs): running
//! the binary, fixtures, the validator, and what an annotated document must hold.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_norway::Value;

use super::support;

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/openapi")
}

/// A fixture, decompressed into `dir` when it is an `.xz`.
pub fn fixture(dir: &Path, name: &str) -> PathBuf {
    let path = fixtures().join(name);
    let Some(plain) = name.strip_suffix(".xz") else {
        return path;
    };
    let out = Command::new("xz")
        .arg("-dc")
        .arg(&path)
        .output()
        .expect("xz (xz-utils) to decompress the fixture");
    assert!(out.status.success(), "xz -dc {}", path.display());
    let target = dir.join(plain);
    std::fs::write(&target, out.stdout).unwrap();
    target
}

pub fn idemproxy(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(args)
        .output()
        .expect("idemproxy")
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Standard output of a command that must succeed.
pub fn ok(args: &[&str]) -> (String, String) {
    let out = idemproxy(args);
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    let notes = stderr(&out);
    (String::from_utf8(out.stdout).unwrap(), notes)
}

/// The message of a command that must fail with exit status 2 and write nothing.
pub fn refused(args: &[&str]) -> String {
    let out = idemproxy(args);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
    assert!(out.stdout.is_empty(), "{args:?} wrote output");
    stderr(&out)
}

pub fn parse(text: &str) -> Value {
    if text.trim_start().starts_with('{') {
        serde_json::from_str(text).unwrap()
    } else {
        serde_norway::from_str(text).unwrap()
    }
}

pub fn read(path: &Path) -> Value {
    parse(&std::fs::read_to_string(path).unwrap())
}

pub const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// Every operation: (path, method) → the operation object.
pub fn operations(doc: &Value) -> Vec<((String, String), Value)> {
    let mut found = Vec::new();
    for (path, item) in doc["paths"].as_mapping().unwrap() {
        for (method, op) in item.as_mapping().unwrap() {
            let method = method.as_str().unwrap();
            if METHODS.contains(&method) {
                let key = (path.as_str().unwrap().to_string(), method.to_string());
                found.push((key, op.clone()));
            }
        }
    }
    found
}

/// The counts in the summary line a command writes last on stderr
/// (`FILE: 468 operations, 222 selected, 222 routes written`; `... protected by CONFIG's routes`).
pub fn summary(stderr: &str) -> Vec<usize> {
    let line = stderr.lines().last().unwrap_or("");
    let counts = line.rsplit(": ").next().unwrap_or("");
    let counts = counts.split(" by ").next().unwrap_or("");
    counts
        .split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty())
        .filter_map(|w| w.parse().ok())
        .collect()
}

/// The routes of a `routes` output, as (name, methods, path, key).
pub fn routes_of(toml_text: &str) -> Vec<(String, Vec<String>, String, String)> {
    let table: toml::Table = toml_text.parse().unwrap();
    let routes = table["routes"].as_array().unwrap();
    routes
        .iter()
        .map(|r| {
            let methods = r["methods"].as_array().unwrap();
            (
                r["name"].as_str().unwrap().to_string(),
                methods
                    .iter()
                    .map(|m| m.as_str().unwrap().to_string())
                    .collect(),
                r["path"].as_str().unwrap().to_string(),
                r["key"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// A complete configuration: `[server]` and `[store]` in front of the routes.
pub fn config_with(dir: &Path, name: &str, routes: &str) -> PathBuf {
    let path = dir.join(name);
    let text = format!(
        "[server]\nupstream = \"http://127.0.0.1:3000\"\n\n[store]\nbackend = \"memory\"\n\n{routes}"
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// `idemproxy --check` accepts the configuration; its route lines.
pub fn checked(config: &Path) -> Vec<String> {
    let (out, _) = ok(&["--check", "--config", config.to_str().unwrap()]);
    out.lines()
        .filter(|l| l.starts_with("route "))
        .map(str::to_string)
        .collect()
}

/// openapi-spec-validator's verdict on each file, with the seconds it took.
pub fn validate(files: &[&Path]) -> Vec<serde_json::Value> {
    let python = support::peer_python();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/peers/openapi_validate.py");
    let out = Command::new(&python)
        .arg(&script)
        .args(files)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    assert!(
        out.status.success(),
        "openapi_validate.py failed with {} (it needs openapi-spec-validator~=0.9: \
         pip install 'openapi-spec-validator~=0.9' into the Python of IDEMPROXY_TEST_PYTHON or \
         target/peers-venv):\n{}",
        python.display(),
        stderr(&out)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["results"].as_array().unwrap().clone()
}

pub fn assert_valid(files: &[&Path]) {
    for r in validate(files) {
        assert_eq!(r["valid"], true, "{r}");
        eprintln!(
            "validated {} (OpenAPI {}) in {} s",
            r["file"], r["version"], r["seconds"]
        );
    }
}

/// A response object, through one local reference.
pub fn response<'a>(doc: &'a Value, r: &'a Value) -> &'a Value {
    match r.get("$ref").and_then(Value::as_str) {
        Some(reference) => {
            let name = reference.rsplit('/').next().unwrap();
            &doc["components"]["responses"][name]
        }
        None => r,
    }
}

pub fn has_status(responses: &Value, status: u16) -> bool {
    let m = responses.as_mapping().unwrap();
    m.contains_key(status.to_string().as_str()) || m.contains_key(Value::from(status))
}

/// What a protected operation must have: the key's parameter (`required`
/// as given), every status of the proxy's answers (its own or the
/// document's), and the replay header on each 2xx response.
pub fn assert_protected(doc: &Value, key: &(String, String), op: &Value, required: bool) {
    let params = op["parameters"].as_sequence().unwrap();
    let ours = params
        .iter()
        .filter_map(|p| p.get("$ref").and_then(Value::as_str))
        .find(|r| r.starts_with("#/components/parameters/Idempotency"))
        .unwrap_or_else(|| panic!("{key:?}: no Idempotency-Key parameter"));
    let name = ours.rsplit('/').next().unwrap();
    let param = &doc["components"]["parameters"][name];
    assert_eq!(param["name"], "Idempotency-Key", "{key:?}");
    assert_eq!(param["in"], "header", "{key:?}");
    assert_eq!(param["required"], Value::Bool(required), "{key:?}");
    assert_eq!(param["schema"]["maxLength"], Value::from(255), "{key:?}");
    let responses = &op["responses"];
    for status in [400, 409, 410, 422, 503] {
        assert!(has_status(responses, status), "{key:?}: no {status}");
    }
    let mut successes = 0;
    for (status, r) in responses.as_mapping().unwrap() {
        let text = match status {
            Value::String(s) => s.clone(),
            other => serde_json::to_string(other).unwrap(),
        };
        if text.starts_with('2') {
            successes += 1;
            let headers = response(doc, r)["headers"].as_mapping();
            assert!(
                headers.is_some_and(|h| h.contains_key("Idempotent-Replayed")),
                "{key:?}: {text} without Idempotent-Replayed"
            );
        }
    }
    assert!(successes > 0, "{key:?}: no 2xx response");
}

/// Everything but the protected operations and the added components is as it was.
pub fn assert_rest_unchanged(
    before: &Value,
    after: &Value,
    protected: &BTreeSet<(String, String)>,
) {
    let (b, a) = (before.as_mapping().unwrap(), after.as_mapping().unwrap());
    let keys_b: Vec<&Value> = b.keys().collect();
    let keys_a: Vec<&Value> = a.keys().take(keys_b.len()).collect();
    assert_eq!(keys_a, keys_b, "the document's keys keep their order");
    for (k, v) in b {
        if k != "paths" && k != "components" {
            assert_eq!(&a[k], v, "{k:?} changed");
        }
    }
    for (key, op) in operations(before) {
        let now = &after["paths"][key.0.as_str()][key.1.as_str()];
        if !protected.contains(&key) {
            assert_eq!(now, &op, "{key:?} is not protected, and changed");
        }
    }
    for (section, entries) in before["components"].as_mapping().into_iter().flatten() {
        for (name, v) in entries.as_mapping().into_iter().flatten() {
            assert_eq!(
                &after["components"][section][name], v,
                "{section:?}/{name:?}"
            );
        }
    }
}

/// The references (`#/components/SECTION/NAME`) anywhere in `v`.
pub fn references(v: &Value, out: &mut Vec<(String, String)>) {
    match v {
        Value::Mapping(m) => {
            for (k, v) in m {
                match (k.as_str(), v.as_str()) {
                    (Some("$ref"), Some(r)) => {
                        let mut parts =
                            r.strip_prefix("#/components/").unwrap_or("").splitn(2, '/');
                        if let (Some(section), Some(name)) = (parts.next(), parts.next()) {
                            let name = name.replace("~1", "/").replace("~0", "~");
                            out.push((section.to_string(), name));
                        }
                    }
                    _ => references(v, out),
                }
            }
        }
        Value::Sequence(s) => s.iter().for_each(|v| references(v, out)),
        _ => {}
    }
}

/// A faithful part of an annotated document: its path items that hold a
/// protected operation, as written, the components they reference (and
/// those reference, to the end), the security schemes and the rest of the
/// top level as they are. Validating GitHub's whole document takes about a
/// minute on a busy two-core machine (26 s of CPU); this part, every
/// operation annotate changed, about 8 s.
pub fn protected_part(doc: &Value, protected: &BTreeSet<(String, String)>) -> Value {
    let mut paths = serde_norway::Mapping::new();
    for (path, item) in doc["paths"].as_mapping().unwrap() {
        let p = path.as_str().unwrap();
        if protected.iter().any(|(q, _)| q == p) {
            paths.insert(path.clone(), item.clone());
        }
    }
    let mut todo = Vec::new();
    references(&Value::Mapping(paths.clone()), &mut todo);
    let mut wanted: BTreeSet<(String, String)> = BTreeSet::new();
    while let Some((section, name)) = todo.pop() {
        if wanted.insert((section.clone(), name.clone())) {
            references(
                &doc["components"][section.as_str()][name.as_str()],
                &mut todo,
            );
        }
    }
    let mut components = serde_norway::Mapping::new();
    for (section, entries) in doc["components"].as_mapping().unwrap() {
        let s = section.as_str().unwrap();
        let mut kept = serde_norway::Mapping::new();
        for (name, v) in entries.as_mapping().unwrap() {
            let n = name.as_str().unwrap();
            if s == "securitySchemes" || wanted.contains(&(s.to_string(), n.to_string())) {
                kept.insert(name.clone(), v.clone());
            }
        }
        if !kept.is_empty() {
            components.insert(section.clone(), Value::Mapping(kept));
        }
    }
    let mut part = doc.as_mapping().unwrap().clone();
    part.insert("paths".into(), Value::Mapping(paths));
    part.insert("components".into(), Value::Mapping(components));
    Value::Mapping(part)
}

/// Standard output of a command that must succeed, given `input` on standard input.
pub fn ok_with_input(args: &[&str], input: &str) -> String {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("idemproxy");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input.as_bytes()).unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    String::from_utf8(out.stdout).unwrap()
}
