//! `idemproxy openapi routes`: the `[[routes]]` that protect a document's operations.
//!
//! An operation is selected by `x-idempotency-key: required` or `optional`,
//! or, with `--unsafe-methods`, by being a POST or a PATCH (then `required`
//! unless it says otherwise). Operations on one path with one key mode become
//! one route with several methods; its path is the template with each
//! `{param}` made a whole-segment parameter of the proxy's syntax. Routes are
//! written most specific first (a literal segment before a parameter at the
//! first place two paths differ), so that the proxy's first match is the
//! operation OpenAPI itself matches (concrete paths before templated ones).

use std::collections::HashSet;

use serde_norway::Value;

use super::{Document, OpenapiError, Operation};
use crate::policy::KeyMode;
use crate::routes::PathPattern;

/// The extension that marks an operation.
pub(crate) const EXTENSION: &str = "x-idempotency-key";

/// One route to write.
#[derive(Clone, Debug)]
pub struct RouteOut {
    pub name: String,
    /// Upper case, in the document's order.
    pub methods: Vec<String>,
    /// In the proxy's syntax.
    pub path: String,
    pub key: KeyMode,
    /// The operations it protects, with their operationIds.
    pub operations: Vec<(Operation, Option<String>)>,
    /// The shape of the path: literal segments, and `{}` for each parameter.
    shape: Vec<Option<String>>,
}

/// What `routes` found and wrote.
#[derive(Clone, Debug)]
pub struct Routes {
    pub operations: usize,
    pub selected: usize,
    pub routes: Vec<RouteOut>,
    pub toml: String,
    pub notes: Vec<String>,
}

/// The routes for a document's selected operations, as TOML.
pub fn routes(doc: &Document, unsafe_methods: bool) -> Result<Routes, OpenapiError> {
    let all = doc.operations();
    let mut notes = Vec::new();
    let mut routes: Vec<RouteOut> = Vec::new();
    let mut selected = 0;
    for op in &all {
        let Some(key) = selection(doc, op, unsafe_methods)? else {
            continue;
        };
        selected += 1;
        if op.path.chars().any(char::is_control) {
            return Err(control_in_path(doc, op));
        }
        let (path, shape) = match proxy_path(&op.path) {
            Ok(done) => done,
            Err(why) => {
                notes.push(format!("{}: left out: {why}", op.label()));
                continue;
            }
        };
        if path.broadened {
            notes.push(format!(
                "{}: a parameter that is part of a segment is taken for the whole segment ({})",
                op.label(),
                path.text
            ));
        }
        let id = doc
            .operation(op)
            .and_then(|o| o.get("operationId"))
            .and_then(Value::as_str)
            .map(str::to_string);
        let method = op.method.to_ascii_uppercase();
        match routes.iter_mut().find(|r| r.shape == shape && r.key == key) {
            Some(r) => {
                if !r.methods.contains(&method) {
                    r.methods.push(method);
                }
                r.operations.push((op.clone(), id));
            }
            None => routes.push(RouteOut {
                name: String::new(),
                methods: vec![method],
                path: path.text,
                key,
                operations: vec![(op.clone(), id)],
                shape,
            }),
        }
    }
    if selected == 0 {
        return Err(nothing_selected(doc, all.len(), unsafe_methods));
    }
    if routes.is_empty() {
        return Err(nothing_written(doc, selected, &notes));
    }
    // Most specific first: a stable sort keeps the document's order among equals.
    routes.sort_by_key(|r| r.shape.iter().map(Option::is_none).collect::<Vec<_>>());
    drop_shadowed(&mut routes, &mut notes);
    name_routes(&mut routes);
    let toml = to_toml(doc, all.len(), selected, unsafe_methods, &routes);
    Ok(Routes {
        operations: all.len(),
        selected,
        routes,
        toml,
        notes,
    })
}

/// The key mode an operation is selected with, if it is.
fn selection(
    doc: &Document,
    op: &Operation,
    unsafe_methods: bool,
) -> Result<Option<KeyMode>, OpenapiError> {
    let marked = doc.operation(op).and_then(|o| o.get(EXTENSION));
    match marked {
        Some(Value::String(s)) if s == "required" => Ok(Some(KeyMode::Required)),
        Some(Value::String(s)) if s == "optional" => Ok(Some(KeyMode::Optional)),
        Some(other) => Err(OpenapiError::Invalid {
            what: doc.what.clone(),
            message: format!(
                "{}: {EXTENSION} is {}; write \"required\" or \"optional\"",
                op.label(),
                serde_json::to_string(other).unwrap_or_else(|_| "?".into())
            ),
        }),
        None if unsafe_methods && matches!(op.method.as_str(), "post" | "patch") => {
            Ok(Some(KeyMode::Required))
        }
        None => Ok(None),
    }
}

fn nothing_selected(doc: &Document, operations: usize, unsafe_methods: bool) -> OpenapiError {
    let message = if operations == 0 {
        "no operation selected: the document has no operations under \"paths\"".to_string()
    } else if unsafe_methods {
        format!("no operation selected: none of its {operations} operations is a POST or a PATCH or is marked {EXTENSION}")
    } else {
        format!(
            "no operation selected: none of its {operations} operations is marked \
             {EXTENSION}: required or optional (--unsafe-methods selects every POST and PATCH)"
        )
    };
    OpenapiError::Nothing {
        what: doc.what.clone(),
        message,
    }
}

/// A selected operation whose path holds a line break, a tab or another
/// control character: no request line carries one, so no route could match
/// it, and such a path must not reach the output's comments.
fn control_in_path(doc: &Document, op: &Operation) -> OpenapiError {
    OpenapiError::Invalid {
        what: doc.what.clone(),
        message: format!(
            "{} {:?}: the path holds a control character (a line break, a tab...): no request \
             can have that path",
            op.method.to_ascii_uppercase(),
            op.path
        ),
    }
}

/// Every selected operation was left out: there is nothing to write.
fn nothing_written(doc: &Document, selected: usize, notes: &[String]) -> OpenapiError {
    OpenapiError::Nothing {
        what: doc.what.clone(),
        message: format!(
            "no route written: the {} selected were all left out ({})",
            super::count(selected, "operation"),
            notes.join("; ")
        ),
    }
}

/// A path in the proxy's syntax.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ProxyPath {
    pub text: String,
    /// A template parameter was part of a segment (`/files/{name}.{ext}`):
    /// the whole segment is a parameter, which matches more than the template.
    pub broadened: bool,
}

/// `/v1/customers/{customer}` → `/v1/customers/{customer}`, with parameter
/// names made of letters, digits and `_` (unique in the path), a segment
/// that holds a parameter and more made a parameter, and bytes the proxy
/// does not take in a literal percent-encoded. With the path's shape.
pub(crate) fn proxy_path(template: &str) -> Result<(ProxyPath, Vec<Option<String>>), String> {
    let mut text = String::new();
    let mut shape = Vec::new();
    let mut names: Vec<String> = Vec::new();
    let mut broadened = false;
    for seg in template.split('/').filter(|s| !s.is_empty()) {
        text.push('/');
        let Some(open) = seg.find('{') else {
            let literal = encode_literal(seg);
            text.push_str(&literal);
            shape.push(Some(literal));
            continue;
        };
        let inner = &seg[open + 1..];
        let name = inner.split('}').next().unwrap_or("");
        broadened |= !(open == 0 && inner.len() == name.len() + 1);
        let mut name: String = name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        if name.is_empty() {
            name = "param".into();
        }
        let base = name.clone();
        let mut n = 2;
        while names.contains(&name) {
            name = format!("{base}_{n}");
            n += 1;
        }
        text.push('{');
        text.push_str(&name);
        text.push('}');
        names.push(name);
        shape.push(None);
    }
    if text.is_empty() {
        text.push('/');
    }
    PathPattern::parse(&text).map_err(|e| format!("{e} (from the template {template})"))?;
    Ok((ProxyPath { text, broadened }, shape))
}

/// A literal segment as the proxy's route syntax takes it: visible ASCII
/// but `*`, `?`, `#`; anything else percent-encoded.
fn encode_literal(seg: &str) -> String {
    let mut out = String::with_capacity(seg.len());
    for b in seg.bytes() {
        if (0x21..0x7f).contains(&b) && !b"*?#{}".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Drops the methods a route can never get, because an earlier route with
/// the same path shape takes them (the proxy refuses a route that can never match).
fn drop_shadowed(routes: &mut Vec<RouteOut>, notes: &mut Vec<String>) {
    let mut kept: Vec<RouteOut> = Vec::with_capacity(routes.len());
    for mut r in routes.drain(..) {
        let taken: Vec<String> = r
            .methods
            .iter()
            .filter(|m| {
                kept.iter()
                    .any(|k| k.shape == r.shape && k.methods.contains(m))
            })
            .cloned()
            .collect();
        if !taken.is_empty() {
            for (op, _) in &r.operations {
                if taken.contains(&op.method.to_ascii_uppercase()) {
                    notes.push(format!(
                        "{}: left out: an earlier route takes {} on the same path",
                        op.label(),
                        op.method.to_ascii_uppercase()
                    ));
                }
            }
            r.methods.retain(|m| !taken.contains(m));
            r.operations
                .retain(|(op, _)| !taken.contains(&op.method.to_ascii_uppercase()));
        }
        if !r.methods.is_empty() {
            kept.push(r);
        }
    }
    *routes = kept;
}

/// Unique names: a route of one operation is named after its operationId;
/// otherwise, and when that is empty, after its methods and path.
fn name_routes(routes: &mut [RouteOut]) {
    let mut taken: HashSet<String> = HashSet::new();
    for r in routes.iter_mut() {
        let from_id = match r.operations.as_slice() {
            [(_, Some(id))] => sanitise(id),
            _ => String::new(),
        };
        let base = if from_id.is_empty() {
            let methods: Vec<String> = r.methods.iter().map(|m| m.to_ascii_lowercase()).collect();
            let path: Vec<&str> = r
                .path
                .split('/')
                .filter(|s| !s.is_empty())
                .map(|s| s.trim_start_matches('{').trim_end_matches('}'))
                .collect();
            sanitise(&format!("{}.{}", methods.join("-"), path.join(".")))
        } else {
            from_id
        };
        let base = base.trim_end_matches('.').to_string();
        let mut name = base.clone();
        let mut n = 2;
        while !taken.insert(name.clone()) {
            name = format!("{base}-{n}");
            n += 1;
        }
        r.name = name;
    }
}

/// Letters, digits, `_`, `-` and `.` kept; `/` becomes `.`, anything else `_`.
pub(crate) fn sanitise(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            c if c.is_ascii_alphanumeric() || "_-.".contains(c) => c,
            '/' => '.',
            _ => '_',
        })
        .collect::<String>()
        .trim_matches('.')
        .to_string()
}

/// A TOML basic string.
fn quoted(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// Text for a comment line: no line breaks or other control characters.
fn comment(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

fn to_toml(
    doc: &Document,
    operations: usize,
    selected: usize,
    unsafe_methods: bool,
    routes: &[RouteOut],
) -> String {
    let title = doc
        .root
        .get("info")
        .and_then(|i| i.get("title"))
        .and_then(Value::as_str)
        .unwrap_or("");
    let by = if unsafe_methods {
        format!("{EXTENSION}, and every POST and PATCH (--unsafe-methods)")
    } else {
        EXTENSION.to_string()
    };
    let mut out = format!(
        "# Written by `idemproxy openapi routes` from {} ({:?}, OpenAPI {}):\n\
         # {}, {selected} selected by {by}: {}.\n",
        comment(&doc.what),
        comment(title),
        comment(&doc.version_text),
        super::count(operations, "operation"),
        super::count(routes.len(), "route"),
    );
    for r in routes {
        out.push('\n');
        for (op, id) in &r.operations {
            match id {
                Some(id) => {
                    out.push_str(&format!("# {} ({})\n", comment(&op.label()), comment(id)))
                }
                None => out.push_str(&format!("# {}\n", comment(&op.label()))),
            }
        }
        let methods: Vec<String> = r.methods.iter().map(|m| quoted(m)).collect();
        out.push_str(&format!(
            "[[routes]]\nname = {}\nmethods = [{}]\npath = {}\nkey = \"{}\"\n",
            quoted(&r.name),
            methods.join(", "),
            quoted(&r.path),
            r.key
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_become_the_proxys_parameters() {
        let (p, shape) = proxy_path("/v1/customers/{customer}").unwrap();
        assert_eq!(p.text, "/v1/customers/{customer}");
        assert!(!p.broadened);
        assert_eq!(
            shape,
            vec![Some("v1".into()), Some("customers".into()), None]
        );
        let (p, _) = proxy_path("/a/{x-y}/b/{x.y}").unwrap();
        assert_eq!(p.text, "/a/{x_y}/b/{x_y_2}");
        let (p, _) = proxy_path("/files/{name}.{ext}").unwrap();
        assert_eq!(p.text, "/files/{name}");
        assert!(p.broadened);
        let (p, _) = proxy_path("/a b/*/é").unwrap();
        assert_eq!(p.text, "/a%20b/%2A/%C3%A9");
        assert_eq!(proxy_path("/").unwrap().0.text, "/");
        assert_eq!(proxy_path("/v1/items/").unwrap().0.text, "/v1/items");
    }

    /// A line break in anything a comment holds ends the comment: the rest
    /// would be read as TOML (a `[store]` of the document's choosing).
    #[test]
    fn comments_hold_no_line_breaks() {
        let json = r#"{"openapi": "3.0.0", "info": {"title": "t\n[store]"}, "paths": {}}"#;
        let doc = Document::parse(json, "doc\n[server]").unwrap();
        let hostile = "\n[store]\nbackend = \"redis\"\nurl = \"redis://evil:6379\"\n#";
        let op = Operation {
            path: format!("/a{hostile}"),
            method: "post".into(),
        };
        let route = RouteOut {
            name: "a".into(),
            methods: vec!["POST".into()],
            path: "/a".into(),
            key: KeyMode::Required,
            operations: vec![(op.clone(), Some(format!("id{hostile}"))), (op, None)],
            shape: vec![Some("a".into())],
        };
        let text = to_toml(&doc, 1, 1, false, &[route]);
        let table: toml::Table = text.parse().unwrap();
        assert_eq!(table.keys().collect::<Vec<_>>(), ["routes"], "{text}");
        assert_eq!(table["routes"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn names_are_sanitised() {
        assert_eq!(sanitise("repos/create-fork"), "repos.create-fork");
        assert_eq!(sanitise("Get Pets!"), "Get_Pets_");
        assert_eq!(sanitise("/"), "");
    }
}
