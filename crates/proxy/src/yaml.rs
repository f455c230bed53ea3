//! YAML out, read the same by YAML 1.1 parsers: Kubernetes reads manifests with one
//! (sigs.k8s.io/yaml), to which a plain `on`, `no`, `y`, `012` or `1:20` is not a string.
//!
//! serde_norway writes YAML 1.2, where those are plain strings; a value such
//! as `value: "no"` would come back as `value: no`, a boolean to the API
//! server. This emitter writes the block style `kubectl` writes and quotes
//! every string that is not plainly a string in both versions.

use serde_norway::Value;

/// The YAML text of one document (a mapping, as every Kubernetes object is).
pub fn to_yaml(v: &Value) -> String {
    let mut out = String::new();
    match v {
        Value::Mapping(m) if !m.is_empty() => write_map(&mut out, m, 0),
        other => {
            out.push_str(&inline(other));
            out.push('\n');
        }
    }
    out
}

fn pad(out: &mut String, indent: usize) {
    out.extend(std::iter::repeat_n(' ', indent));
}

fn write_map(out: &mut String, m: &serde_norway::Mapping, indent: usize) {
    for (k, v) in m {
        pad(out, indent);
        out.push_str(&inline(k));
        out.push(':');
        write_after(out, v, indent, indent + 2);
    }
}

fn write_seq(out: &mut String, s: &[Value], indent: usize) {
    for v in s {
        pad(out, indent);
        out.push('-');
        match v {
            // The first line of a nested block goes after the dash.
            Value::Mapping(m) if !m.is_empty() => {
                let mut inner = String::new();
                write_map(&mut inner, m, indent + 2);
                out.push(' ');
                out.push_str(&inner[indent + 2..]);
            }
            Value::Sequence(s) if !s.is_empty() => {
                let mut inner = String::new();
                write_seq(&mut inner, s, indent + 2);
                out.push(' ');
                out.push_str(&inner[indent + 2..]);
            }
            v => write_after(out, v, indent, indent + 2),
        }
    }
}

/// What follows `key:` or `-`: an inline value, or a nested block.
/// Sequences under a key sit at the key's indent, as kubectl writes them.
fn write_after(out: &mut String, v: &Value, indent: usize, nested: usize) {
    match v {
        Value::Mapping(m) if !m.is_empty() => {
            out.push('\n');
            write_map(out, m, nested);
        }
        Value::Sequence(s) if !s.is_empty() => {
            out.push('\n');
            write_seq(out, s, indent);
        }
        Value::String(s) if literal_block(s) => {
            let chomp = if !s.ends_with('\n') {
                "-"
            } else if s.ends_with("\n\n") {
                "+"
            } else {
                ""
            };
            out.push_str(" |");
            out.push_str(chomp);
            out.push('\n');
            let body = s.strip_suffix('\n').unwrap_or(s);
            for line in body.split('\n') {
                if !line.is_empty() {
                    pad(out, nested);
                    out.push_str(line);
                }
                out.push('\n');
            }
        }
        v => {
            out.push(' ');
            out.push_str(&inline(v));
            out.push('\n');
        }
    }
}

/// A multi-line string that a literal block keeps exactly.
fn literal_block(s: &str) -> bool {
    s.contains('\n')
        && !s.starts_with([' ', '\t', '\n'])
        && !s.chars().any(|c| c.is_control() && c != '\n' && c != '\t')
        // Trailing spaces survive a literal block, but not a line of only spaces.
        && !s.split('\n').any(|l| !l.is_empty() && l.trim().is_empty())
}

/// A scalar, or an empty or tagged collection, on one line.
fn inline(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => string(s),
        Value::Sequence(s) if s.is_empty() => "[]".into(),
        Value::Mapping(m) if m.is_empty() => "{}".into(),
        // Not in Kubernetes objects; JSON is valid YAML flow style.
        other => serde_json::to_string(other).unwrap_or_else(|_| "null".into()),
    }
}

fn string(s: &str) -> String {
    if plain(s) {
        s.to_owned()
    } else {
        // A JSON string is a valid YAML double-quoted scalar.
        serde_json::Value::from(s).to_string()
    }
}

/// Words YAML 1.1 reads as booleans or null.
const KEYWORDS: [&str; 26] = [
    "y", "Y", "yes", "Yes", "YES", "n", "N", "no", "No", "NO", "true", "True", "TRUE", "false",
    "False", "FALSE", "on", "On", "ON", "off", "Off", "OFF", "null", "Null", "NULL", "~",
];

/// True when `s` can be written without quotes and reads back as this string
/// under YAML 1.1 and 1.2: letters, digits and a few safe punctuation marks,
/// not a keyword, not starting like a number, an indicator or a space.
fn plain(s: &str) -> bool {
    let Some(first) = s.chars().next() else {
        return false;
    };
    if KEYWORDS.contains(&s) || s.ends_with([' ', ':']) || s.contains(": ") || s.contains(" #") {
        return false;
    }
    let safe = |c: char| c.is_ascii_alphanumeric() || " ._/:@=+,()-".contains(c);
    if !s.chars().all(safe) {
        return false;
    }
    if first.is_ascii_alphabetic() || first == '_' || first == '/' {
        return true;
    }
    // A quantity such as 100m or 64Mi: digits, then letters only, and not a
    // hex, octal or binary prefix.
    if first.is_ascii_digit() {
        let letters = s.trim_start_matches(|c: char| c.is_ascii_digit());
        let lower = s.to_ascii_lowercase();
        return !letters.is_empty()
            && letters.chars().all(|c| c.is_ascii_alphabetic())
            && !["0x", "0o", "0b"].iter().any(|p| lower.starts_with(p))
            && !letters.eq_ignore_ascii_case("e");
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every string comes back as itself from serde_norway (YAML 1.2); the
    /// YAML 1.1 cases are the reason for the quoting rules and are checked
    /// against PyYAML by tests/inject.rs.
    #[test]
    fn strings_round_trip() {
        let cases = [
            "on",
            "no",
            "y",
            "NULL",
            "~",
            "",
            " lead",
            "trail ",
            "1:20",
            "012",
            "0x1F",
            "0xFF",
            "1e3",
            "1E",
            "100m",
            "64Mi",
            "2026-12-03",
            ".5",
            "-.inf",
            "=",
            "<<",
            "a: b",
            "a #b",
            "#c",
            "&a",
            "*a",
            "!t",
            "|",
            ">",
            "%x",
            "@x",
            "`x",
            "'q'",
            "\"d\"",
            "a\nb",
            "a\nb\n",
            "a\nb\n\n",
            " a\nb",
            "a\n  \nb",
            "tab\there",
            "é",
            "http://x:1/p?q=1",
            "- x",
            "[x]",
            "{x}",
            "a,b",
            "x:",
            "/healthz",
            "_x",
            "1_000",
            "+1",
            "-1",
            "app.kubernetes.io/name",
        ];
        for s in cases {
            let mut m = serde_norway::Mapping::new();
            m.insert("k".into(), s.into());
            m.insert(s.into(), "v".into());
            m.insert("list".into(), vec![Value::from(s)].into());
            let v = Value::Mapping(m);
            let text = to_yaml(&v);
            let back: Value =
                serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert_eq!(back, v, "{text}");
        }
    }

    #[test]
    fn nested_blocks_in_the_kubectl_style() {
        let v: Value = serde_norway::from_str(
            "a:\n  b: 1\n  c:\n  - d: x\n    e: [1, [2, 3], {}]\n  - []\n  - - z\nf: {}\n",
        )
        .unwrap();
        let text = to_yaml(&v);
        assert_eq!(
            text,
            "a:\n  b: 1\n  c:\n  - d: x\n    e:\n    - 1\n    - - 2\n      - 3\n    - {}\n  - []\n  - - z\nf: {}\n"
        );
        assert_eq!(serde_norway::from_str::<Value>(&text).unwrap(), v);
    }
}
