//! The Dockerfile's build stage, run here without Docker: its COPY steps
//! into an empty directory, its RUN steps there with `cargo build` as
//! `cargo tree --locked` (Cargo reads the whole workspace, its targets and
//! the lock, as the build would) — so a member whose manifest is not copied, or a file the
//! sources compile in (`include_str!`) that is not copied, fails here rather
//! than in `deploy/build-image.sh`.

use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The instructions of the first stage, continuation lines joined.
fn build_stage() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(Path::new(ROOT).join("Dockerfile")).unwrap();
    let joined = text.replace("\\\n", " ");
    let mut stage = Vec::new();
    let mut froms = 0;
    for line in joined.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (op, rest) = line.split_once(' ').unwrap_or((line, ""));
        if op == "FROM" {
            froms += 1;
            if froms > 1 {
                break;
            }
            continue;
        }
        stage.push((op.to_string(), rest.trim().to_string()));
    }
    stage
}

/// Is `rel` (a path in the build context) left out by `.dockerignore`? As
/// Docker reads it: patterns in order, the last that matches decides, `!`
/// takes a path back; a pattern matches from the context's root, component
/// by component (`*` and `?` within one), and a directory it matches takes
/// everything under it.
fn ignored(rel: &Path) -> bool {
    fn glob(pattern: &[u8], name: &[u8]) -> bool {
        match (pattern.first(), name.first()) {
            (None, None) => true,
            (Some(b'*'), _) => {
                glob(&pattern[1..], name) || (!name.is_empty() && glob(pattern, &name[1..]))
            }
            (Some(b'?'), Some(_)) => glob(&pattern[1..], &name[1..]),
            (Some(p), Some(n)) if p == n => glob(&pattern[1..], &name[1..]),
            _ => false,
        }
    }
    let rules = std::fs::read_to_string(Path::new(ROOT).join(".dockerignore")).unwrap_or_default();
    let parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let mut out = false;
    for line in rules
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (negated, pattern) = match line.strip_prefix('!') {
            Some(p) => (true, p),
            None => (false, line),
        };
        let pattern: Vec<&str> = pattern.trim_end_matches('/').split('/').collect();
        let matches = pattern.len() <= parts.len()
            && pattern
                .iter()
                .zip(&parts)
                .all(|(p, n)| glob(p.as_bytes(), n.as_bytes()));
        if matches {
            out = !negated;
        }
    }
    out
}

fn copy(from: &Path, to: &Path) {
    let rel = from.strip_prefix(ROOT).unwrap_or(from);
    if ignored(rel) {
        return;
    }
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            copy(&entry.path(), &to.join(entry.file_name()));
        }
    } else {
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(from, to).unwrap();
    }
}

/// Every `include_str!`/`include_bytes!` under `dir`, as the path it names.
fn included_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if !path.ends_with("target") {
                included_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            for piece in text.split("include_").skip(1) {
                let Some(rest) = piece
                    .strip_prefix("str!(\"")
                    .or_else(|| piece.strip_prefix("bytes!(\""))
                else {
                    continue;
                };
                let name = &rest[..rest.find('"').unwrap()];
                out.push(path.parent().unwrap().join(name));
            }
        }
    }
}

#[test]
fn dockerignore_is_read_as_docker_reads_it() {
    assert!(ignored(Path::new("target")));
    assert!(ignored(Path::new("target/debug/idemproxy")));
    assert!(ignored(Path::new("CHANGELOG.md")));
    assert!(!ignored(Path::new("README.md")));
    // `*.md` is the context root's only, as in Docker.
    assert!(!ignored(Path::new("docs/configuration.md")));
    assert!(!ignored(Path::new("src/main.rs")));
    assert!(ignored(Path::new("fuzz/target/x")));
}

#[test]
fn the_build_stage_has_every_manifest_and_every_file_the_sources_include() {
    let stage = build_stage();
    assert!(stage.iter().any(|(op, _)| op == "COPY"), "{stage:?}");
    let work = tempfile::tempdir().unwrap();
    let dir = work.path();
    let mut builds = 0;
    for (op, args) in &stage {
        match op.as_str() {
            "WORKDIR" | "ARG" | "ENV" => {}
            "COPY" => {
                let parts: Vec<&str> = args.split_whitespace().collect();
                assert!(
                    !parts[0].starts_with("--"),
                    "COPY {args}: flags are not run here"
                );
                let (dest, sources) = parts.split_last().unwrap();
                for source in sources {
                    let from = Path::new(ROOT).join(source);
                    let to = if dest.ends_with('/') && !from.is_dir() {
                        dir.join(dest).join(from.file_name().unwrap())
                    } else {
                        dir.join(dest)
                    };
                    copy(&from, &to);
                }
            }
            "RUN" => {
                assert!(args.contains("cargo build"), "RUN {args}");
                builds += 1;
                let script = args.replace(
                    "cargo build",
                    "cargo tree --offline --locked -e normal,build >/dev/null && : ",
                );
                let out = Command::new("sh")
                    .arg("-c")
                    .arg(&script)
                    .current_dir(dir)
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "RUN {args}\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                // What the binaries' sources compile in is there beside them.
                let mut included = Vec::new();
                for built in ["src", "crates", "examples/demo-upstream"] {
                    if dir.join(built).is_dir() {
                        included_files(&dir.join(built), &mut included);
                    }
                }
                for file in included {
                    assert!(
                        file.exists(),
                        "RUN {args}: {} is compiled in but not copied",
                        file.strip_prefix(dir).unwrap_or(&file).display()
                    );
                }
            }
            other => panic!("{other} {args}: not run by this test"),
        }
    }
    assert_eq!(builds, 2, "the dependencies' build, then the sources'");
    // After the last step the sources are all there: every crate of the workspace.
    for krate in [
        "src/main.rs",
        "crates/proxy/src/lib.rs",
        "crates/kube/src/lib.rs",
    ] {
        assert!(dir.join(krate).is_file(), "{krate}");
    }
}
