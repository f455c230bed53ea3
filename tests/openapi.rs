//! `idemproxy openapi routes` and `annotate` on real OpenAPI documents
//! (tests/fixtures/openapi: Stripe's, GitHub's, the OpenAPI Initiative's
//! petstore) and on documents written here: the routes pass `--check`, the
//! annotated documents pass openapi-spec-validator 0.9
//! (tests/peers/openapi_validate.py), the protected operations get what
//! the proxy adds and every other one is left as it was.

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_norway::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/openapi")
}

/// A fixture, decompressed into `dir` when it is an `.xz`.
fn fixture(dir: &Path, name: &str) -> PathBuf {
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

fn idemproxy(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(args)
        .output()
        .expect("idemproxy")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Standard output of a command that must succeed.
fn ok(args: &[&str]) -> (String, String) {
    let out = idemproxy(args);
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    let notes = stderr(&out);
    (String::from_utf8(out.stdout).unwrap(), notes)
}

/// The message of a command that must fail with exit status 2 and write nothing.
fn refused(args: &[&str]) -> String {
    let out = idemproxy(args);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
    assert!(out.stdout.is_empty(), "{args:?} wrote output");
    stderr(&out)
}

fn parse(text: &str) -> Value {
    if text.trim_start().starts_with('{') {
        serde_json::from_str(text).unwrap()
    } else {
        serde_norway::from_str(text).unwrap()
    }
}

fn read(path: &Path) -> Value {
    parse(&std::fs::read_to_string(path).unwrap())
}

const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// Every operation: (path, method) → the operation object.
fn operations(doc: &Value) -> Vec<((String, String), Value)> {
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
fn summary(stderr: &str) -> Vec<usize> {
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
fn routes_of(toml_text: &str) -> Vec<(String, Vec<String>, String, String)> {
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
fn config_with(dir: &Path, name: &str, routes: &str) -> PathBuf {
    let path = dir.join(name);
    let text = format!(
        "[server]\nupstream = \"http://127.0.0.1:3000\"\n\n[store]\nbackend = \"memory\"\n\n{routes}"
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// `idemproxy --check` accepts the configuration; its route lines.
fn checked(config: &Path) -> Vec<String> {
    let (out, _) = ok(&["--check", "--config", config.to_str().unwrap()]);
    out.lines()
        .filter(|l| l.starts_with("route "))
        .map(str::to_string)
        .collect()
}

/// openapi-spec-validator's verdict on each file, with the seconds it took.
fn validate(files: &[&Path]) -> Vec<serde_json::Value> {
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

fn assert_valid(files: &[&Path]) {
    for r in validate(files) {
        assert_eq!(r["valid"], true, "{r}");
        eprintln!(
            "validated {} (OpenAPI {}) in {} s",
            r["file"], r["version"], r["seconds"]
        );
    }
}

/// A response object, through one local reference.
fn response<'a>(doc: &'a Value, r: &'a Value) -> &'a Value {
    match r.get("$ref").and_then(Value::as_str) {
        Some(reference) => {
            let name = reference.rsplit('/').next().unwrap();
            &doc["components"]["responses"][name]
        }
        None => r,
    }
}

fn has_status(responses: &Value, status: u16) -> bool {
    let m = responses.as_mapping().unwrap();
    m.contains_key(status.to_string().as_str()) || m.contains_key(Value::from(status))
}

/// What a protected operation must have: the key's parameter (`required`
/// as given), every status of the proxy's answers (its own or the
/// document's), and the replay header on each 2xx response.
fn assert_protected(doc: &Value, key: &(String, String), op: &Value, required: bool) {
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
fn assert_rest_unchanged(before: &Value, after: &Value, protected: &BTreeSet<(String, String)>) {
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

/// The whole round on a real document: routes (none without
/// `--unsafe-methods`, as no real document marks `x-idempotency-key`),
/// `--check`, annotate, and what changed. Returns the annotated file.
fn round(dir: &Path, doc: &Path, expect: [usize; 3]) -> PathBuf {
    let file = doc.to_str().unwrap();
    let none = refused(&["openapi", "routes", file]);
    assert!(none.contains("no operation selected"), "{none}");
    let (toml_text, notes) = ok(&["openapi", "routes", "--unsafe-methods", file]);
    let routes = routes_of(&toml_text);
    let [operations_found, selected, written] = expect;
    assert_eq!(
        summary(&notes),
        vec![operations_found, selected, written],
        "{notes}"
    );
    assert_eq!(routes.len(), written);
    let names: BTreeSet<&String> = routes.iter().map(|r| &r.0).collect();
    assert_eq!(names.len(), routes.len(), "route names are unique");
    assert!(routes.iter().all(|r| r.3 == "required"));
    let config = config_with(dir, "routes.toml", &toml_text);
    assert_eq!(
        checked(&config).len(),
        written,
        "--check prints every route"
    );

    let (annotated, notes) = ok(&[
        "openapi",
        "annotate",
        "--config",
        config.to_str().unwrap(),
        file,
    ]);
    let before = read(doc);
    let after = parse(&annotated);
    let unsafe_ops: BTreeSet<(String, String)> = operations(&before)
        .into_iter()
        .map(|(k, _)| k)
        .filter(|(_, m)| m == "post" || m == "patch")
        .collect();
    assert_eq!(unsafe_ops.len(), selected);
    assert_eq!(summary(&notes), vec![operations_found, selected], "{notes}");
    for (key, op) in operations(&after) {
        if unsafe_ops.contains(&key) {
            assert_protected(&after, &key, &op, true);
        }
    }
    assert_rest_unchanged(&before, &after, &unsafe_ops);
    let ext = doc.extension().unwrap().to_str().unwrap();
    let out = dir.join(format!("annotated.{ext}"));
    std::fs::write(&out, annotated).unwrap();
    out
}

#[test]
fn petstore_round_trip_is_valid() {
    let dir = tempfile::tempdir().unwrap();
    let doc = fixture(dir.path(), "petstore-expanded.yaml");
    let annotated = round(dir.path(), &doc, [4, 1, 1]);
    let text = std::fs::read_to_string(&annotated).unwrap();
    assert!(!text.trim_start().starts_with('{'), "YAML in, YAML out");
    assert_valid(&[&doc, &annotated]);
}

#[test]
fn stripe_spec3_yaml() {
    let dir = tempfile::tempdir().unwrap();
    let doc = fixture(dir.path(), "stripe-spec3.yaml.xz");
    let annotated = round(dir.path(), &doc, [468, 222, 222]);
    assert_valid(&[&annotated]);
}

/// The references (`#/components/SECTION/NAME`) anywhere in `v`.
fn references(v: &Value, out: &mut Vec<(String, String)>) {
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
/// top level as they are. Validating GitHub's whole document takes over a
/// minute; this part, every operation annotate changed, takes seconds.
fn protected_part(doc: &Value, protected: &BTreeSet<(String, String)>) -> Value {
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

#[test]
fn github_api_json() {
    let dir = tempfile::tempdir().unwrap();
    let doc = fixture(dir.path(), "github-api.github.com.json.xz");
    let annotated = round(dir.path(), &doc, [1223, 263, 262]);
    let text = std::fs::read_to_string(&annotated).unwrap();
    assert!(text.starts_with("{\n"), "JSON in, JSON out");
    let after = parse(&text);
    let protected: BTreeSet<(String, String)> = operations(&after)
        .into_iter()
        .map(|(k, _)| k)
        .filter(|(_, m)| m == "post" || m == "patch")
        .collect();
    let part = protected_part(&after, &protected);
    assert_eq!(
        operations(&part)
            .iter()
            .filter(|(k, _)| protected.contains(k))
            .count(),
        263
    );
    let file = dir.path().join("protected-part.json");
    std::fs::write(&file, serde_json::to_string_pretty(&part).unwrap()).unwrap();
    assert_valid(&[&file]);
}

/// A route for a templated path marks the operation of that template, as
/// the proxy matches a request to it; a literal route does not take a template.
#[test]
fn a_templated_route_marks_its_operation() {
    let dir = tempfile::tempdir().unwrap();
    let doc = fixture(dir.path(), "stripe-spec3.yaml.xz");
    let config = config_with(
        dir.path(),
        "two.toml",
        "[[routes]]\nname = \"customers\"\npath = \"/v1/customers\"\n\n\
         [[routes]]\nname = \"customer\"\npath = \"/v1/customers/{id}\"\nkey = \"optional\"\n\n\
         [[routes]]\nname = \"search\"\nmethods = [\"GET\"]\npath = \"/v1/customers/search\"\n",
    );
    let (annotated, notes) = ok(&[
        "openapi",
        "annotate",
        "--config",
        config.to_str().unwrap(),
        doc.to_str().unwrap(),
    ]);
    let before = read(&doc);
    let after = parse(&annotated);
    let post = |p: &str| (p.to_string(), "post".to_string());
    let get = |p: &str| (p.to_string(), "get".to_string());
    let marked: BTreeSet<(String, String)> = [
        post("/v1/customers"),
        post("/v1/customers/{customer}"),
        get("/v1/customers/search"),
    ]
    .into_iter()
    .collect();
    assert_eq!(summary(&notes), vec![468, 3], "{notes}");
    let op = |k: &(String, String)| after["paths"][k.0.as_str()][k.1.as_str()].clone();
    assert_protected(
        &after,
        &post("/v1/customers"),
        &op(&post("/v1/customers")),
        true,
    );
    let templated = post("/v1/customers/{customer}");
    assert_protected(&after, &templated, &op(&templated), false);
    // GET /v1/customers/{customer} is not taken by the literal /v1/customers/search.
    let one = get("/v1/customers/{customer}");
    assert_eq!(op(&one), before["paths"][one.0.as_str()]["get"]);
    assert_rest_unchanged(&before, &after, &marked);
}

/// An OpenAPI 3.1 document written here: `x-idempotency-key` marks, what a
/// 3.1 document gets (`const`, `examples`), a response the operation
/// describes itself kept, a shared 2xx response copied for the replay
/// header, JSON in and JSON out with the order of keys kept.
const DOC_3_1: &str = r##"{
  "openapi": "3.1.0",
  "info": {"title": "Orders", "version": "1"},
  "paths": {
    "/v1/orders": {
      "post": {
        "operationId": "createOrder",
        "x-idempotency-key": "required",
        "requestBody": {"content": {"application/json": {"schema": {"type": "object"}}}},
        "responses": {
          "201": {"$ref": "#/components/responses/Order"},
          "409": {"description": "Our own conflict"}
        }
      },
      "get": {"operationId": "listOrders", "responses": {"200": {"$ref": "#/components/responses/Order"}}}
    },
    "/v1/orders/{order-id}/pay": {
      "parameters": [{"name": "order-id", "in": "path", "required": true, "schema": {"type": "string"}}],
      "post": {
        "operationId": "pay order",
        "x-idempotency-key": "optional",
        "responses": {"200": {"description": "Paid", "content": {"application/json": {"schema": {"type": ["object", "null"]}}}}}
      },
      "patch": {"operationId": "patchOrder", "responses": {"200": {"description": "Patched"}}}
    }
  },
  "components": {
    "responses": {"Order": {"description": "An order", "content": {"application/json": {"schema": {"type": "object"}}}}},
    "schemas": {"IdempotencyProblem": {"type": "string"}}
  }
}
"##;

#[test]
fn an_openapi_3_1_document() {
    let dir = tempfile::tempdir().unwrap();
    let doc = dir.path().join("orders.json");
    std::fs::write(&doc, DOC_3_1).unwrap();
    let file = doc.to_str().unwrap();
    let (toml_text, notes) = ok(&["openapi", "routes", file]);
    assert_eq!(summary(&notes), vec![4, 2, 2], "{notes}");
    let routes = routes_of(&toml_text);
    let expected = [
        ("createOrder", "/v1/orders", "required"),
        ("pay_order", "/v1/orders/{order_id}/pay", "optional"),
    ];
    for (r, (name, path, key)) in routes.iter().zip(expected) {
        assert_eq!(
            (r.0.as_str(), r.1.as_slice(), r.2.as_str(), r.3.as_str()),
            (name, &["POST".to_string()][..], path, key)
        );
    }
    let config = config_with(dir.path(), "orders.toml", &toml_text);
    assert_eq!(checked(&config).len(), 2);
    // With --unsafe-methods the PATCH joins (required: a route of its own).
    let (unsafe_toml, notes) = ok(&["openapi", "routes", "--unsafe-methods", file]);
    assert_eq!(summary(&notes), vec![4, 3, 3], "{notes}");
    assert!(
        unsafe_toml.contains("name = \"patchOrder\""),
        "{unsafe_toml}"
    );

    let (annotated, _) = ok(&[
        "openapi",
        "annotate",
        "--config",
        config.to_str().unwrap(),
        file,
    ]);
    assert!(
        annotated.starts_with("{\n  \"openapi\": \"3.1.0\",\n  \"info\""),
        "{annotated}"
    );
    let before = parse(DOC_3_1);
    let after = parse(&annotated);
    let create = ("/v1/orders".to_string(), "post".to_string());
    let pay = ("/v1/orders/{order-id}/pay".to_string(), "post".to_string());
    assert_protected(&after, &create, &after["paths"]["/v1/orders"]["post"], true);
    assert_protected(&after, &pay, &after["paths"][pay.0.as_str()]["post"], false);
    let protected: BTreeSet<_> = [create, pay].into_iter().collect();
    assert_rest_unchanged(&before, &after, &protected);
    let ops = &after["paths"]["/v1/orders"];
    assert_eq!(
        ops["post"]["responses"]["409"]["description"],
        "Our own conflict"
    );
    assert_eq!(
        ops["post"]["responses"]["201"]["$ref"],
        "#/components/responses/OrderReplayed"
    );
    assert_eq!(
        ops["get"]["responses"]["200"]["$ref"],
        "#/components/responses/Order"
    );
    let components = &after["components"];
    assert!(components["responses"]["Order"]["headers"].is_null());
    // The document's own IdempotencyProblem stays; the proxy's takes another name.
    assert_eq!(
        components["schemas"]["IdempotencyProblem"]["type"],
        "string"
    );
    let problem = &components["schemas"]["IdempotencyProblem2"];
    assert!(
        problem["properties"]["type"]["examples"].is_sequence(),
        "3.1: examples"
    );
    let replayed = &components["headers"]["IdempotentReplayed"]["schema"];
    assert_eq!(replayed["const"], "true", "3.1: const");
    let out = dir.path().join("annotated.json");
    std::fs::write(&out, &annotated).unwrap();
    assert_valid(&[&doc, &out]);
}

#[test]
fn what_is_not_openapi_3_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let swagger = fixture(dir.path(), "petstore-expanded-swagger-2.0.yaml");
    let m = refused(&["openapi", "routes", swagger.to_str().unwrap()]);
    assert!(m.contains("Swagger 2.0") && m.contains("OpenAPI 3"), "{m}");
    let garbage = dir.path().join("garbage.json");
    std::fs::write(&garbage, "{\"openapi\": \"3.0.0\", \"paths\": ").unwrap();
    let m = refused(&["openapi", "routes", garbage.to_str().unwrap()]);
    assert!(m.contains("not a JSON or YAML document"), "{m}");
    let text = dir.path().join("text.yaml");
    std::fs::write(&text, "just some words\n").unwrap();
    let m = refused(&["openapi", "routes", text.to_str().unwrap()]);
    assert!(m.contains("not a mapping"), "{m}");
    let other = dir.path().join("other.yaml");
    std::fs::write(&other, "title: not an API\n").unwrap();
    let m = refused(&["openapi", "routes", other.to_str().unwrap()]);
    assert!(m.contains("no \"openapi\" field"), "{m}");
    let m = refused(&[
        "openapi",
        "routes",
        dir.path().join("absent.yaml").to_str().unwrap(),
    ]);
    assert!(m.contains("cannot read"), "{m}");
    let webhooks = fixture(dir.path(), "webhook-example-3.1.json");
    let m = refused(&[
        "openapi",
        "routes",
        "--unsafe-methods",
        webhooks.to_str().unwrap(),
    ]);
    assert!(m.contains("no operation selected"), "{m}");
    let wrong = dir.path().join("wrong.json");
    std::fs::write(&wrong, DOC_3_1.replace("\"optional\"", "\"maybe\"")).unwrap();
    let m = refused(&["openapi", "routes", wrong.to_str().unwrap()]);
    assert!(m.contains("x-idempotency-key is \"maybe\""), "{m}");
}

#[test]
fn annotate_refuses_a_bad_configuration_or_one_that_protects_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let doc = fixture(dir.path(), "petstore-expanded.yaml");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[[routes]]\nname = \"x\"\npath = \"v1\"\n").unwrap();
    let m = refused(&[
        "openapi",
        "annotate",
        "--config",
        bad.to_str().unwrap(),
        doc.to_str().unwrap(),
    ]);
    assert!(
        m.contains("invalid configuration") && m.contains("routes[0].path"),
        "{m}"
    );
    let elsewhere = dir.path().join("elsewhere.toml");
    std::fs::write(
        &elsewhere,
        "[[routes]]\nname = \"x\"\npath = \"/v1/payments\"\n",
    )
    .unwrap();
    let m = refused(&[
        "openapi",
        "annotate",
        "--config",
        elsewhere.to_str().unwrap(),
        doc.to_str().unwrap(),
    ]);
    assert!(m.contains("none of its 4 operations is protected"), "{m}");
}
