//! The crates' shape: within each crate of the workspace (the proxy's
//! library, the store, the Kubernetes tooling, the binary, the campaign), no two modules depend on
//! each other, directly or round a longer loop. Between crates the compiler
//! sees to it (Cargo refuses a loop of packages). A module here is a file of
//! a crate's `src/` (`crates/store/src/record/mod.rs` is `record`); a
//! dependency is a `crate::` or `super::` path that
//! names another module (in a `use` or in the code), tests excluded. A
//! module and its own parent or child are one concern and not counted: a
//! parent declares its children, and children use what it shares.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file below `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module a file is: `src/store/mod.rs` → `store`, `src/store/redis.rs`
/// → `store::redis`, `src/lib.rs` or `src/main.rs` → `` (the crate root).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The code of a file without its `#[cfg(test)]` modules and comments.
fn code_without_tests(text: &str) -> String {
    let mut out = String::new();
    let mut skipping = false;
    let mut depth = 0i32;
    let mut pending_cfg_test = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if skipping {
            depth += line.matches('{').count() as i32 - line.matches('}').count() as i32;
            if depth <= 0 {
                skipping = false;
            }
            continue;
        }
        if trimmed.starts_with("#[cfg(test)]") {
            pending_cfg_test = true;
            continue;
        }
        if pending_cfg_test && trimmed.starts_with("mod ") {
            pending_cfg_test = false;
            if trimmed.ends_with(';') {
                continue;
            }
            depth = line.matches('{').count() as i32 - line.matches('}').count() as i32;
            skipping = depth > 0;
            continue;
        }
        pending_cfg_test = false;
        if trimmed.starts_with("//") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The paths a file's code names: each `crate::a::b::…` or `super::…`
/// resolved to the module it names (the longest known module prefix).
fn dependencies(
    module: &[String],
    is_dir_module: bool,
    code: &str,
    modules: &BTreeSet<Vec<String>>,
) -> BTreeSet<Vec<String>> {
    let mut found = BTreeSet::new();
    let bytes = code.as_bytes();
    for (at, _) in code
        .match_indices("crate::")
        .chain(code.match_indices("super::"))
    {
        // Part of a longer name (`$crate::`, `my_super::`)?
        if at > 0
            && (bytes[at - 1].is_ascii_alphanumeric()
                || bytes[at - 1] == b'_'
                || bytes[at - 1] == b'$')
        {
            continue;
        }
        let mut base: Vec<String> = if code[at..].starts_with("crate::") {
            Vec::new()
        } else {
            // `super` of a `mod.rs` file is its parent's parent's level.
            let mut m = module.to_vec();
            if !is_dir_module || !m.is_empty() {
                m.pop();
            }
            m
        };
        let mut rest = &code[at..];
        rest = rest.split_once("::").map_or("", |(_, r)| r);
        // More `super::` in a row.
        while let Some(r) = rest.strip_prefix("super::") {
            base.pop();
            rest = r;
        }
        let path: Vec<String> = rest
            .split("::")
            .map(|seg| {
                seg.chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect::<String>()
            })
            .take_while(|seg| !seg.is_empty())
            .collect();
        // `use crate::{a, b::c}`: each name in the braces.
        let braced = rest.starts_with('{');
        let candidates: Vec<Vec<String>> = if braced {
            let inner = rest[1..].split('}').next().unwrap_or("");
            inner
                .split(',')
                .map(|item| {
                    item.trim()
                        .split("::")
                        .map(|s| {
                            s.trim()
                                .chars()
                                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                                .collect::<String>()
                        })
                        .take_while(|s| !s.is_empty())
                        .collect()
                })
                .collect()
        } else {
            vec![path]
        };
        for tail in candidates {
            let mut full = base.clone();
            let mut best = None;
            for seg in tail {
                full.push(seg);
                if modules.contains(&full) {
                    best = Some(full.clone());
                }
            }
            if let Some(m) = best.or_else(|| modules.contains(&base).then(|| base.clone())) {
                found.insert(m);
            }
        }
    }
    found
}

/// One is the other's ancestor (or the same module).
fn related(a: &[String], b: &[String]) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

/// Each module, and the modules it depends on.
type Graph = BTreeMap<Vec<String>, BTreeSet<Vec<String>>>;

/// The loops between the modules of the crate whose sources are `src`, and
/// the graph they were found in.
fn module_loops(src: &Path) -> (Vec<String>, Graph) {
    let mut files = Vec::new();
    sources(src, &mut files);
    files.retain(|f| !f.to_string_lossy().ends_with("/tests.rs"));
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(src, f)).collect();
    let mut graph = Graph::new();
    for file in &files {
        let module = module_of(src, file);
        let is_dir_module = file.ends_with("mod.rs") || file.ends_with("lib.rs");
        let code = code_without_tests(&std::fs::read_to_string(file).unwrap());
        let deps = dependencies(&module, is_dir_module, &code, &modules)
            .into_iter()
            .filter(|d| !related(d, &module))
            .collect();
        graph.insert(module, deps);
    }
    // A module that reaches itself through others is on a loop.
    let name = |m: &Vec<String>| {
        if m.is_empty() {
            "crate".to_string()
        } else {
            m.join("::")
        }
    };
    let mut loops = Vec::new();
    for start in graph.keys() {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<(Vec<String>, Vec<String>)> = vec![(start.clone(), vec![name(start)])];
        while let Some((at, trail)) = stack.pop() {
            for next in graph.get(&at).into_iter().flatten() {
                if next == start {
                    let mut l = trail.clone();
                    l.push(name(start));
                    loops.push(l.join(" → "));
                } else if seen.insert(next.clone()) {
                    let mut t = trail.clone();
                    t.push(name(next));
                    stack.push((next.clone(), t));
                }
            }
        }
    }
    (loops, graph)
}

#[test]
fn no_two_modules_of_a_crate_depend_on_each_other() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    for krate in [
        "src",
        "crates/proxy/src",
        "crates/kube/src",
        "crates/campaign/src",
    ] {
        let (loops, graph) = module_loops(&root.join(krate));
        assert!(
            loops.is_empty(),
            "{krate}: modules that depend on each other (every loop, once per member):\n{}",
            loops.join("\n")
        );
        checked += graph.len();
    }
    assert!(checked > 80, "{checked} modules");
    // The check sees dependencies at all: a module known to use another is found using it.
    let (_, graph) = module_loops(&root.join("crates/proxy/src"));
    let proxy = graph
        .get(&vec!["proxy".to_string()])
        .expect("crates/proxy/src/proxy/mod.rs");
    assert!(proxy.contains(&vec!["problem".to_string()]), "{proxy:?}");
}
