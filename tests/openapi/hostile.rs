//! Documents written to break `idemproxy openapi routes`: a path that would
//! end a comment and write TOML of its own, operations that can all be left
//! out, and nesting deep enough to make the YAML parser crawl.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::helpers::{ok, refused, routes_of};

/// Far more than a refusal takes; the deep documents took minutes before they were refused.
const DEADLINE: Duration = Duration::from_secs(60);

/// A path that, written raw into a comment, ends it and adds a `[store]`.
const HOSTILE: &str = "/a\n[store]\nbackend = \"redis\"\nurl=\"redis://evil:6379\"\n#";

fn document(paths: serde_json::Value) -> String {
    serde_json::json!({
        "openapi": "3.0.3",
        "info": {"title": "Evil\n[server]\nlisten = \"0.0.0.0:1\"", "version": "1"},
        "paths": paths,
    })
    .to_string()
}

fn write(dir: &std::path::Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn a_path_with_a_line_break_is_refused_and_writes_no_toml_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let required = serde_json::json!({"post": {"x-idempotency-key": "required",
        "operationId": "evil\n[store]\nbackend = \"redis\"", "responses": {}}});
    let doc = document(serde_json::json!({ HOSTILE: required.clone() }));
    let file = write(dir.path(), "hostile.json", &doc);
    let m = refused(&["openapi", "routes", &file]);
    assert!(
        m.contains("POST \"/a\\n[store]\\nbackend") && m.contains("control character"),
        "{m}"
    );
    // Not selected, the path is never written; the title and the operationId
    // of the route that is are kept on their comment lines.
    let unmarked = serde_json::json!({"post": {"responses": {}}});
    let doc = document(serde_json::json!({ HOSTILE: unmarked, "/b": required }));
    let file = write(dir.path(), "mixed.json", &doc);
    let (text, _) = ok(&["openapi", "routes", &file]);
    let table: toml::Table = text.parse().unwrap();
    assert_eq!(table.keys().collect::<Vec<_>>(), ["routes"], "{text}");
    let routes = routes_of(&text);
    assert_eq!(routes.len(), 1, "{text}");
    assert_eq!(routes[0].2, "/b");
}

#[test]
fn no_route_written_is_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let op = serde_json::json!({"post": {"x-idempotency-key": "required", "responses": {}}});
    let doc = document(serde_json::json!({ "/a/..": op }));
    let file = write(dir.path(), "dots.json", &doc);
    let m = refused(&["openapi", "routes", &file]);
    assert!(m.contains("no route written"), "{m}");
    assert!(m.contains("POST /a/..: left out"), "{m}");
}

/// `idemproxy openapi routes FILE`, killed past [`DEADLINE`]: (exit code, stderr).
fn routes_within_deadline(file: &str) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["openapi", "routes", file])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
            return (status.code(), err);
        }
        if started.elapsed() > DEADLINE {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("idemproxy openapi routes {file} ran over {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn deep_nesting_is_refused_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let deep = "[".repeat(100_000);
    let cases = [
        (
            "deep.json",
            format!("{{\"openapi\": \"3.0.0\", \"paths\": {deep}"),
        ),
        ("deep-array.json", deep.clone()),
        ("deep.yaml", format!("openapi: 3.0.0\npaths: {deep}\n")),
        (
            "deep-map.yaml",
            format!("openapi: 3.0.0\npaths: {}\n", "{a: ".repeat(100_000)),
        ),
    ];
    for (name, text) in cases {
        let file = write(dir.path(), name, &text);
        let (code, err) = routes_within_deadline(&file);
        assert_eq!(code, Some(2), "{name}: {err}");
        assert!(err.contains("not a JSON or YAML document"), "{name}: {err}");
    }
    let (_, err) = routes_within_deadline(&write(dir.path(), "j", &format!("{{\"a\": {deep}")));
    assert!(
        err.contains("recursion limit"),
        "serde_json's own message: {err}"
    );
}

#[test]
fn a_document_over_64_mib_is_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.yaml");
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(b"openapi: 3.0.0\nx-padding: |\n").unwrap();
    let line = format!("  {}\n", "x".repeat(1021));
    for _ in 0..(65 << 10) {
        file.write_all(line.as_bytes()).unwrap();
    }
    drop(file);
    let (code, err) = routes_within_deadline(path.to_str().unwrap());
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("over 64 MiB"), "{err}");
}
