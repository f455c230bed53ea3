//! The input as documents, and the output: YAML streams split so that a
//! document the injection does not change comes out as its original text,
//! comments and all; a changed one is written again from its parsed value
//! (its leading comments kept). JSON (one object, or a list) comes out as JSON.

use serde_norway::{Mapping, Value};

use super::error::ManifestError;
use idemproxy::yaml::to_yaml;

/// One document of the input.
pub struct Document<'a> {
    /// The document's text as it came, separator line included.
    pub text: &'a str,
    /// Its leading separator, comment and blank lines, kept when it is rewritten.
    pub head: &'a str,
    /// The line of the input its text starts on.
    pub line: usize,
    pub value: Value,
    pub changed: bool,
}

/// An object of the input: a document, or an item of a list (`List`,
/// `DeploymentList`, ... and lists inside lists), by its indices.
#[derive(Clone, Debug)]
pub(crate) struct At {
    pub doc: usize,
    pub items: Vec<usize>,
}

impl At {
    pub fn get<'v>(&self, docs: &'v [Document]) -> &'v Value {
        let mut v = &docs[self.doc].value;
        for i in &self.items {
            v = &v["items"][*i];
        }
        v
    }

    pub fn set(&self, docs: &mut [Document], new: Value) {
        let d = &mut docs[self.doc];
        d.changed = true;
        let mut slot = &mut d.value;
        for i in &self.items {
            let Some(next) = slot.get_mut("items").and_then(|items| items.get_mut(*i)) else {
                return;
            };
            slot = next;
        }
        *slot = new;
    }

    /// "document 3", "document 1, item 4" or "document 1, item 2.3", numbered from 1.
    pub fn number(&self) -> String {
        if self.items.is_empty() {
            return format!("{}", self.doc + 1);
        }
        let items: Vec<String> = self.items.iter().map(|i| (i + 1).to_string()).collect();
        format!("{}, item {}", self.doc + 1, items.join("."))
    }
}

/// Whether `v` is a list whose items kubectl applies one by one: `List`, or a
/// typed list such as `DeploymentList` or `PodList`.
pub(crate) fn is_list(v: &Value) -> bool {
    str_at(v, &["kind"]).is_some_and(|k| k.ends_with("List"))
        && v.get("items").is_some_and(Value::is_sequence)
}

/// Every object of the input, the items of lists (and of lists inside them) unwrapped.
pub fn objects(docs: &[Document]) -> Vec<At> {
    fn collect(v: &Value, at: At, out: &mut Vec<At>) {
        if is_list(v) {
            let items = v.get("items").and_then(Value::as_sequence);
            for (i, item) in items.into_iter().flatten().enumerate() {
                let mut inner = at.clone();
                inner.items.push(i);
                collect(item, inner, out);
            }
        } else if v.is_mapping() {
            out.push(at);
        }
    }
    let mut out = Vec::new();
    for (doc, d) in docs.iter().enumerate() {
        collect(
            &d.value,
            At {
                doc,
                items: Vec::new(),
            },
            &mut out,
        );
    }
    out
}

pub(crate) fn str_at<'v>(v: &'v Value, path: &[&str]) -> Option<&'v str> {
    path.iter()
        .try_fold(v, |v, k| v.get(*k))
        .and_then(Value::as_str)
}

pub(crate) fn namespace(v: &Value) -> Option<&str> {
    str_at(v, &["metadata", "namespace"])
}

/// "Deployment shop/frontend", for notes and errors.
pub fn describe(v: &Value) -> String {
    let kind = str_at(v, &["kind"]).unwrap_or("object");
    let name = str_at(v, &["metadata", "name"])
        .or(str_at(v, &["metadata", "generateName"]))
        .unwrap_or("(no name)");
    match namespace(v) {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    }
}

/// Splits a YAML stream before each `---` line; the first piece holds what
/// comes before the first one (often only comments).
fn split_documents(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let (mut start, mut start_line, mut pos) = (0, 1, 0);
    for (n, line) in text.split_inclusive('\n').enumerate() {
        let separator =
            line.starts_with("---") && line[3..].chars().next().is_none_or(char::is_whitespace);
        if separator && pos > start {
            out.push((start_line, &text[start..pos]));
            start = pos;
            start_line = n + 1;
        }
        pos += line.len();
    }
    if pos > start || out.is_empty() {
        out.push((start_line, &text[start..]));
    }
    out
}

/// The leading lines of a document that carry no content: its separator, comments, blanks.
fn head_of(text: &str) -> &str {
    let mut end = 0;
    for line in text.split_inclusive('\n') {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') || t == "---" || t.starts_with("--- #") {
            end += line.len();
        } else {
            break;
        }
    }
    &text[..end]
}

/// The input as documents: one JSON document (an object or a list), or the
/// documents of a YAML stream, each with its text kept for output.
pub fn parse(text: &str) -> Result<(bool, Vec<Document<'_>>), ManifestError> {
    let json = text.trim_start().starts_with(['{', '[']);
    if json {
        let value: Value =
            serde_json::from_str(text).map_err(|e| ManifestError::Json(e.to_string()))?;
        let doc = Document {
            text,
            head: "",
            line: 1,
            value,
            changed: false,
        };
        return Ok((true, vec![doc]));
    }
    let mut docs = Vec::new();
    for (i, (line, piece)) in split_documents(text).into_iter().enumerate() {
        let yaml_error = |e: serde_norway::Error| ManifestError::Yaml {
            doc: i + 1,
            line: line + e.location().map_or(0, |l| l.line().saturating_sub(1)),
            message: e.to_string(),
        };
        let value = if head_of(piece).len() == piece.len() {
            Value::Null
        } else {
            let mut value: Value = serde_norway::from_str(piece).map_err(yaml_error)?;
            // `<<: *anchor` merge keys, as YAML 1.1 readers (Kubernetes) apply them.
            value.apply_merge().map_err(yaml_error)?;
            value
        };
        docs.push(Document {
            text: piece,
            head: head_of(piece),
            line,
            value,
            changed: false,
        });
    }
    Ok((false, docs))
}

/// A rewritten document is written from its parsed value, read as YAML 1.2:
/// a plain `yes`, `off`, `0644` or `1:20` came in as a string, and would go
/// out quoted, a string where Kubernetes (YAML 1.1) read a boolean or a
/// number. Such a document is refused, naming the line and value.
pub(crate) fn check_yaml_1_1(docs: &[Document]) -> Result<(), ManifestError> {
    use yaml_rust2::parser::{Event, Parser};
    use yaml_rust2::scanner::TScalarStyle;
    for (i, d) in docs.iter().enumerate().filter(|(_, d)| d.changed) {
        let mut parser = Parser::new_from_str(d.text);
        // The text parsed once already (serde_norway); an error here ends the check.
        while let Ok((event, mark)) = parser.next_token() {
            match event {
                Event::StreamEnd => break,
                Event::Scalar(value, TScalarStyle::Plain, _, None) => {
                    if let Some((meaning, fix)) = yaml_1_1_meaning(&value) {
                        return Err(ManifestError::Yaml11 {
                            doc: i + 1,
                            line: d.line + mark.line().saturating_sub(1),
                            value,
                            meaning,
                            fix,
                        });
                    }
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// What YAML 1.1 reads a plain scalar as, when YAML 1.2 (serde_norway) reads a string.
fn yaml_1_1_meaning(s: &str) -> Option<(&'static str, &'static str)> {
    const BOOLS: [&str; 16] = [
        "y", "Y", "yes", "Yes", "YES", "n", "N", "no", "No", "NO", "on", "On", "ON", "off", "Off",
        "OFF",
    ];
    if BOOLS.contains(&s) {
        return Some(("a boolean", "true or false, or quoted if a string is meant"));
    }
    if !matches!(serde_norway::from_str::<Value>(s), Ok(Value::String(_))) {
        return None;
    }
    let unsigned = s.strip_prefix(['-', '+']).unwrap_or(s);
    let digits =
        |t: &str, ok: fn(char) -> bool| !t.is_empty() && t.chars().all(|c| ok(c) || c == '_');
    let number = if let Some(b) = unsigned.strip_prefix("0b") {
        digits(b, |c| c == '0' || c == '1')
    } else if let Some(x) = unsigned.strip_prefix("0x") {
        digits(x, |c| c.is_ascii_hexdigit())
    } else if unsigned.starts_with('0') && unsigned.len() > 1 && !unsigned.contains('.') {
        digits(unsigned, |c| ('0'..='7').contains(&c))
    } else if unsigned.contains(':') {
        // Sexagesimal: 1:20, 190:20:30, 1:20.5.
        let mut parts = unsigned.split(':');
        let head = parts.next().unwrap_or("");
        digits(head, |c| c.is_ascii_digit())
            && parts.all(|p| {
                let whole = p.split('.').next().unwrap_or("");
                !whole.is_empty()
                    && whole.len() <= 2
                    && whole.chars().all(|c| c.is_ascii_digit())
                    && p[whole.len()..]
                        .strip_prefix('.')
                        .is_none_or(|f| f.chars().all(|c| c.is_ascii_digit() || c == '_'))
            })
    } else {
        // 1_000, 1_000.5: underscores in a number.
        unsigned.contains('_')
            && unsigned.starts_with(|c: char| c.is_ascii_digit())
            && unsigned
                .chars()
                .all(|c| c.is_ascii_digit() || c == '_' || c == '.')
            && unsigned.matches('.').count() <= 1
    };
    number.then_some((
        "a number",
        "a decimal number, or quoted if a string is meant",
    ))
}

pub(crate) fn render_yaml(docs: &[Document], extra: Vec<Value>) -> String {
    let mut out = String::new();
    for d in docs {
        if d.changed {
            out.push_str(d.head);
            out.push_str(&to_yaml(&d.value));
        } else {
            out.push_str(d.text);
        }
    }
    for v in &extra {
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str("---\n");
        out.push_str(&to_yaml(v));
    }
    out
}

pub(crate) fn render_json(
    text: &str,
    doc: Document,
    extra: Vec<Value>,
) -> Result<String, ManifestError> {
    if !doc.changed && extra.is_empty() {
        return Ok(text.to_owned());
    }
    let mut value = doc.value;
    if !extra.is_empty() {
        // A typed list (`DeploymentList`) holds one kind: its items and the
        // additions go into a `List`, which kubectl applies alike.
        let kind = str_at(&value, &["kind"]).map(str::to_owned);
        if kind.as_deref() != Some("List") {
            let items = match value.get_mut("items") {
                Some(Value::Sequence(items)) if kind.is_some_and(|k| k.ends_with("List")) => {
                    std::mem::take(items)
                }
                _ => vec![value],
            };
            let mut list = Mapping::new();
            list.insert("apiVersion".into(), "v1".into());
            list.insert("kind".into(), "List".into());
            list.insert("items".into(), Value::Sequence(items));
            value = list.into();
        }
        if let Some(items) = value.get_mut("items").and_then(Value::as_sequence_mut) {
            items.extend(extra);
        }
    }
    let mut out = serde_json::to_string_pretty(&value).map_err(|e| ManifestError::Write {
        doc: 1,
        message: e.to_string(),
    })?;
    out.push('\n');
    Ok(out)
}
