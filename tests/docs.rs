//! The documentation against the code: every TOML example is a configuration
//! the binary accepts, and `docs/configuration.md` names every configuration
//! key the binary knows, and no other.
//!
//! **TOML examples.** Every fenced block whose info string is exactly `toml`,
//! in `README.md` and in every `.md` file under `docs/` (whatever files exist
//! when the test runs), is written to a file of its own and must pass
//! `idemproxy --check --config FILE`. A block that is only part of a file
//! says so with the info string `toml fragment` and is skipped.
//!
//! **Configuration keys.** The code's keys come from the binary itself, not
//! from its source: every table of the file is a serde struct with
//! `deny_unknown_fields`, so a key the binary does not know is refused with
//! the list of those it does know (`unknown field `x`, expected one of
//! `listen`, ...`), spelt as the file spells them (renames included). The test
//! asks the root for its keys, then each key for its own (as `[k]`, `[[k]]`,
//! or, deeper down, as an inline table or an array of them).
//!
//! The documented keys come from the structure of `docs/configuration.md`:
//!
//! - a heading that names TOML tables in backticks (`` ### `[server]` ``,
//!   `` ## `[defaults]` and `[[routes]]` ``) opens a section for those
//!   tables, which lasts until the next heading of the same or a higher level;
//! - in such a section, each row of a Markdown table whose first cell holds a
//!   backticked name documents that key for each of the section's tables
//!   (the header row, whose first cell is `key`, and the separator are
//!   skipped). The first cell also holds the key's stable anchor,
//!   `<a id="TABLE.KEY"></a>` for one of the section's tables, e.g.
//!   `<a id="server.listen"></a>`, so that `configuration.md#server.listen`
//!   matches the `server.listen` an error message names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const PROBE: &str = "zzz_docs_probe";

/// `idemproxy --check --config FILE` on `text`: its exit code and stderr.
fn check_text(text: &str, name: &str) -> (Option<i32>, String) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("docs-test");
    std::fs::create_dir_all(&dir).unwrap();
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let file = dir.join(format!("{name}-{}-{n}.toml", std::process::id()));
    std::fs::write(&file, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .arg("--check")
        .arg("--config")
        .arg(&file)
        .env_remove("IDEMPROXY_CONFIG")
        .env_remove("IDEMPROXY_UPSTREAM")
        .env_remove("IDEMPROXY_LISTEN")
        .env_remove("IDEMPROXY_REDIS_URL")
        .current_dir(ROOT)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `README.md` and every `.md` file under `docs/`, sorted.
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let root = Path::new(ROOT);
    let mut files = vec![root.join("README.md")];
    walk(&root.join("docs"), &mut files);
    files.sort();
    files
}

/// A fenced code block: its info string, the 1-based line of its opening
/// fence, and its text.
struct Block {
    info: String,
    line: usize,
    text: String,
}

/// The fenced code blocks of a Markdown text (``` or ~~~ fences, indented or
/// not, as inside a list item).
fn blocks(markdown: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut lines = markdown.lines().enumerate();
    while let Some((i, line)) = lines.next() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        let Some(ch) = trimmed.chars().next().filter(|c| *c == '`' || *c == '~') else {
            continue;
        };
        let fence_len = trimmed.chars().take_while(|c| *c == ch).count();
        if fence_len < 3 {
            continue;
        }
        let info = trimmed[fence_len..].trim().to_string();
        let mut text = String::new();
        for (_, body) in lines.by_ref() {
            let t = body.trim_start();
            if t.chars().take_while(|c| *c == ch).count() >= fence_len
                && t.trim_start_matches(ch).trim().is_empty()
            {
                break;
            }
            // The fence's indentation is not part of the text.
            let strip = body.len() - t.len();
            text.push_str(&body[strip.min(indent)..]);
            text.push('\n');
        }
        out.push(Block {
            info,
            line: i + 1,
            text,
        });
    }
    out
}

#[test]
fn every_toml_example_passes_check() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let markdown = std::fs::read_to_string(&file).unwrap();
        let shown = file
            .strip_prefix(ROOT)
            .unwrap_or(&file)
            .display()
            .to_string();
        for block in blocks(&markdown).into_iter().filter(|b| b.info == "toml") {
            checked += 1;
            let (code, stderr) = check_text(&block.text, "example");
            if code != Some(0) {
                failures.push(format!(
                    "{shown}:{}: a ```toml block fails `idemproxy --check` (exit {code:?}): {}\n  \
                     (a block that is only part of a file takes the info string `toml fragment`)",
                    block.line,
                    stderr.trim()
                ));
            }
        }
    }
    assert!(checked > 0, "no ```toml block found at all");
    assert!(
        failures.is_empty(),
        "{} of {checked} TOML examples fail:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The keys a table accepts, from the error that refuses [`PROBE`] in it;
/// `None` when `text` does not make the binary refuse [`PROBE`] as an unknown
/// field (the place is not a table of known keys).
fn refused_probe(text: &str) -> Option<Vec<String>> {
    let (_, stderr) = check_text(text, "probe");
    let at = stderr.find(&format!("unknown field `{PROBE}`"))?;
    let rest = &stderr[at..];
    let line = rest.lines().next().unwrap_or("");
    if line.contains("there are no fields") {
        return Some(Vec::new());
    }
    let expected = &line[line.find("expected")?..];
    Some(
        expected
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect(),
    )
}

/// A place in the file: the table names from the root, each with whether it
/// is an array of tables.
type Place = Vec<(String, bool)>;

/// A file that puts `inner` (a `key = value` line) in the table at `place`:
/// the first name as a table header, the rest as inline tables.
fn at_place(place: &[(String, bool)], inner: &str) -> String {
    fn value(rest: &[(String, bool)], inner: &str) -> String {
        match rest.split_first() {
            None => format!("{{ {inner} }}"),
            Some(((name, array), tail)) => {
                let v = value(tail, inner);
                let v = if *array { format!("[{v}]") } else { v };
                format!("{{ {name} = {v} }}")
            }
        }
    }
    match place.split_first() {
        None => format!("{inner}\n"),
        Some(((first, first_array), rest)) => {
            let header = if *first_array {
                format!("[[{first}]]")
            } else {
                format!("[{first}]")
            };
            match rest.split_first() {
                None => format!("{header}\n{inner}\n"),
                Some(((name, array), tail)) => {
                    let v = value(tail, inner);
                    let v = if *array { format!("[{v}]") } else { v };
                    format!("{header}\n{name} = {v}\n")
                }
            }
        }
    }
}

fn dotted(place: &[(String, bool)]) -> String {
    place
        .iter()
        .map(|(n, _)| n.as_str())
        .collect::<Vec<_>>()
        .join(".")
}

/// Every key the binary accepts, as (table, key); the table is dotted
/// (`server`, `routes`), `""` for the root. A key whose value is a table
/// is listed and its own keys too.
fn code_keys() -> BTreeSet<(String, String)> {
    let probe_line = format!("{PROBE} = 1");
    let root = refused_probe(&probe_line)
        .expect("the binary does not refuse an unknown root key with the list of known ones");
    let mut out = BTreeSet::new();
    let mut todo: Vec<(Place, Vec<String>)> = vec![(Vec::new(), root)];
    while let Some((place, keys)) = todo.pop() {
        for key in keys {
            out.insert((dotted(&place), key.clone()));
            if place.len() >= 4 {
                continue;
            }
            for array in [false, true] {
                let mut inner_place = place.clone();
                inner_place.push((key.clone(), array));
                let text = if place.is_empty() {
                    at_place(&inner_place, &probe_line)
                } else {
                    // `key = { PROBE = 1 }` (or `[{ ... }]`) in the table at `place`.
                    let v = format!("{{ {probe_line} }}");
                    let v = if array { format!("[{v}]") } else { v };
                    at_place(&place, &format!("{key} = {v}"))
                };
                if let Some(inner) = refused_probe(&text) {
                    todo.push((inner_place, inner));
                    break;
                }
            }
        }
    }
    out
}

/// The keys `docs/configuration.md` documents, as (table, key), with the
/// line of each row; and the problems of its structure (a row without its
/// anchor, an anchor used twice).
type Documented = BTreeMap<(String, String), usize>;

fn documented_keys(markdown: &str) -> (Documented, Vec<String>) {
    let mut keys = BTreeMap::new();
    let mut problems = Vec::new();
    let mut anchors = BTreeSet::new();
    // The tables of the open section and the level of its heading.
    let mut section: Option<(usize, Vec<String>)> = None;
    let mut in_fence = false;
    for (i, line) in markdown.lines().enumerate() {
        let n = i + 1;
        let t = line.trim_start();
        if t.starts_with("```") || t.starts_with("~~~") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        let level = t.chars().take_while(|c| *c == '#').count();
        if level > 0 && t[level..].starts_with(' ') {
            let tables: Vec<String> = t
                .split('`')
                .skip(1)
                .step_by(2)
                .filter_map(|code| {
                    let name = code.trim_start_matches('[').trim_end_matches(']');
                    (code.starts_with('[') && code.ends_with(']') && !name.is_empty())
                        .then(|| name.to_string())
                })
                .collect();
            if !tables.is_empty() {
                section = Some((level, tables));
            } else if section.as_ref().is_some_and(|(l, _)| level <= *l) {
                section = None;
            }
            continue;
        }
        let Some((_, tables)) = &section else {
            continue;
        };
        if !t.starts_with('|') {
            continue;
        }
        let first = t[1..].split('|').next().unwrap_or("").trim();
        let Some(key) = first.split('`').nth(1).filter(|k| !k.is_empty()) else {
            continue;
        };
        let anchor = first
            .split("id=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next());
        match anchor {
            Some(id) if tables.iter().any(|t| id == format!("{t}.{key}")) => {
                if !anchors.insert(id.to_string()) {
                    problems.push(format!("line {n}: anchor \"{id}\" is used twice"));
                }
            }
            Some(id) => problems.push(format!(
                "line {n}: the anchor of `{key}` is \"{id}\"; expected \"{}.{key}\"",
                tables[0]
            )),
            None => problems.push(format!(
                "line {n}: the row of `{key}` has no anchor <a id=\"{}.{key}\"></a>",
                tables[0]
            )),
        }
        for table in tables {
            if keys.insert((table.clone(), key.to_string()), n).is_some() {
                problems.push(format!(
                    "line {n}: `{key}` of [{table}] is documented twice"
                ));
            }
        }
    }
    (keys, problems)
}

#[test]
fn the_configuration_reference_names_every_key_and_no_other() {
    let page = Path::new(ROOT).join("docs/configuration.md");
    let markdown = std::fs::read_to_string(&page).unwrap();
    let (documented, mut problems) = documented_keys(&markdown);
    let code = code_keys();
    // A key whose value is a table is documented by a section of its own.
    let sections: BTreeSet<String> = documented.keys().map(|(t, _)| t.clone()).collect();
    for (table, key) in &code {
        let full = if table.is_empty() {
            key.clone()
        } else {
            format!("{table}.{key}")
        };
        let is_table = code.iter().any(|(t, _)| *t == full);
        if is_table {
            if !sections.contains(&full) {
                problems.push(format!(
                    "[{full}] is a table of the configuration, but no heading names `[{full}]`"
                ));
            }
        } else if !documented.contains_key(&(table.clone(), key.clone())) {
            problems.push(format!(
                "`{full}` is a configuration key, but docs/configuration.md has no row for it"
            ));
        }
    }
    for ((table, key), line) in &documented {
        if !code.contains(&(table.clone(), key.clone())) {
            problems.push(format!(
                "line {line}: `{key}` is documented for [{table}], but the binary knows no such key"
            ));
        }
    }
    assert!(
        code.len() > 20,
        "too few keys found in the binary, the probe is broken: {code:?}"
    );
    assert!(
        problems.is_empty(),
        "docs/configuration.md and the code disagree:\n{}",
        problems.join("\n")
    );
}

/// The guide's links and the code's citations of it resolve, and no comment
/// cites a numbered section of a document the repository does not hold
/// (`docs/check-links.py`, which CI also runs by itself).
#[test]
fn links_and_the_codes_citations_of_the_guide_resolve() {
    let out = Command::new("python3")
        .arg(Path::new(ROOT).join("docs/check-links.py"))
        .output()
        .expect("python3 runs docs/check-links.py");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "broken links or citations:\n{report}");
    assert!(report.contains(" 0 broken"), "{report}");
}

/// The README's run-and-test block names `tests/run.sh` as the test command,
/// and CI runs that same command (its last step), so that what a new user
/// types is what CI proves.
#[test]
fn the_readme_test_command_is_what_ci_runs() {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let section = readme
        .split("## Run and test")
        .nth(1)
        .expect("README.md has a \"Run and test\" section");
    let block = blocks(section)
        .into_iter()
        .next()
        .expect("a code block in \"Run and test\"");
    let commands: Vec<&str> = block
        .text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .collect();
    assert!(
        commands.contains(&"tests/run.sh"),
        "the README's test command is not tests/run.sh: {commands:?}"
    );
    let ci = std::fs::read_to_string(Path::new(ROOT).join(".ci/run")).unwrap();
    let last = ci
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    assert!(
        last.trim().starts_with("exec bash tests/run.sh"),
        ".ci/run must end by running the README's test command, not {last:?}"
    );
    let script = std::fs::read_to_string(Path::new(ROOT).join("tests/run.sh")).unwrap();
    assert!(
        script.contains("exec cargo nextest run --workspace \"$@\""),
        "tests/run.sh must run every test of the workspace"
    );
}

/// One page per task, none over 600 lines (the benchmark journal is in parts).
#[test]
fn no_page_of_the_docs_is_over_600_lines() {
    let long: Vec<String> = markdown_files()
        .into_iter()
        .filter(|p| p.starts_with(Path::new(ROOT).join("docs")))
        .filter_map(|p| {
            let lines = std::fs::read_to_string(&p).unwrap().lines().count();
            (lines > 600).then(|| format!("{} ({lines} lines)", p.display()))
        })
        .collect();
    assert!(long.is_empty(), "pages over 600 lines: {long:?}");
}
