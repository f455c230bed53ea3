//! `idemproxy inject`: a stream of manifests in, the same stream out with the sidecar added and the Services rewired.
//!
//! The YAML stream is split into documents here, so that a document the
//! injection does not change comes out as its original text, comments and
//! all; a changed one is written again from its parsed value (its leading
//! comments kept). JSON (one object, or a `List`) comes out as JSON.

use serde_norway::{Mapping, Value};

use super::emit::to_yaml;
use super::pod::{inject_pod, FieldError, Outcome, ServicePort};
use super::{PortRef, Settings};

/// The output, built whole before any of it is written, and the notes for standard error.
#[derive(Debug)]
pub struct Injected {
    pub output: String,
    pub notes: Vec<String>,
    /// How many workloads got the sidecar.
    pub injected: usize,
}

/// Input that cannot be read, or a workload whose annotation names no port.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("document {doc} (line {line}): {message}")]
    Yaml {
        doc: usize,
        line: usize,
        message: String,
    },
    #[error("invalid JSON: {0}")]
    Json(String),
    #[error("document {doc} ({what}): {field}.{error}")]
    Field {
        doc: usize,
        what: String,
        field: String,
        error: FieldError,
    },
    #[error("cannot write document {doc}: {message}")]
    Write { doc: usize, message: String },
}

/// The kinds that hold a pod template, and where.
fn template_path(kind: &str) -> Option<&'static [&'static str]> {
    Some(match kind {
        "Pod" => &[],
        "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => &["spec", "template"],
        "CronJob" => &["spec", "jobTemplate", "spec", "template"],
        _ => return None,
    })
}

/// One document of the input.
struct Document<'a> {
    /// The document's text as it came, separator line included.
    text: &'a str,
    /// Its leading separator, comment and blank lines, kept when it is rewritten.
    head: &'a str,
    value: Value,
    changed: bool,
}

/// An object of the input: a document, or an item of a document of kind `List`.
#[derive(Clone, Copy)]
struct At {
    doc: usize,
    item: Option<usize>,
}

impl At {
    fn get<'v>(&self, docs: &'v [Document]) -> &'v Value {
        let v = &docs[self.doc].value;
        match self.item {
            None => v,
            Some(i) => &v["items"][i],
        }
    }

    fn set(&self, docs: &mut [Document], new: Value) {
        let d = &mut docs[self.doc];
        d.changed = true;
        match self.item {
            None => d.value = new,
            Some(i) => {
                if let Some(slot) = d.value.get_mut("items").and_then(|items| items.get_mut(i)) {
                    *slot = new;
                }
            }
        }
    }

    /// "document 3" or "document 1, item 4", numbered from 1.
    fn number(&self) -> String {
        match self.item {
            None => format!("{}", self.doc + 1),
            Some(i) => format!("{}, item {}", self.doc + 1, i + 1),
        }
    }
}

fn str_at<'v>(v: &'v Value, path: &[&str]) -> Option<&'v str> {
    path.iter()
        .try_fold(v, |v, k| v.get(*k))
        .and_then(Value::as_str)
}

fn namespace(v: &Value) -> Option<&str> {
    str_at(v, &["metadata", "namespace"])
}

/// "Deployment shop/frontend", for notes and errors.
fn describe(v: &Value) -> String {
    let kind = str_at(v, &["kind"]).unwrap_or("object");
    let name = str_at(v, &["metadata", "name"])
        .or(str_at(v, &["metadata", "generateName"]))
        .unwrap_or("(no name)");
    match namespace(v) {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    }
}

/// Two objects can refer to each other unless both name a namespace and the names differ.
fn same_namespace(a: Option<&str>, b: Option<&str>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}

/// A Service's selector matches the labels (an empty selector selects nothing here:
/// such a Service has endpoints managed by hand).
fn selects(selector: &Mapping, labels: Option<&Mapping>) -> bool {
    !selector.is_empty()
        && labels.is_some_and(|labels| selector.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

fn service_ports(service: &Value) -> Vec<ServicePort> {
    let ports = service
        .get("spec")
        .and_then(|s| s.get("ports"))
        .and_then(Value::as_sequence);
    let text = |p: &Value, k: &str| p.get(k).and_then(Value::as_str).map(str::to_owned);
    ports
        .into_iter()
        .flatten()
        .filter_map(|p| {
            let port = p
                .get("port")
                .and_then(Value::as_u64)
                .and_then(|n| u16::try_from(n).ok())?;
            let target = match p.get("targetPort") {
                None => PortRef::Number(port),
                Some(Value::String(s)) => PortRef::parse(s),
                Some(v) => PortRef::Number(v.as_u64().and_then(|n| u16::try_from(n).ok())?),
            };
            Some(ServicePort {
                name: text(p, "name"),
                port,
                target,
                app_protocol: text(p, "appProtocol"),
                protocol: text(p, "protocol"),
            })
        })
        .collect()
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

/// Injects every workload of `text`. With `config`, the text of a configuration
/// file, a ConfigMap holding it is added for each namespace injected into,
/// unless the input has one by that name.
pub fn inject_manifests(
    text: &str,
    settings: &Settings,
    config: Option<&str>,
) -> Result<Injected, ManifestError> {
    let json = text.trim_start().starts_with(['{', '[']);
    let mut docs = if json {
        let value: Value =
            serde_json::from_str(text).map_err(|e| ManifestError::Json(e.to_string()))?;
        vec![Document {
            text,
            head: "",
            value,
            changed: false,
        }]
    } else {
        let mut docs = Vec::new();
        for (i, (line, piece)) in split_documents(text).into_iter().enumerate() {
            let value = if head_of(piece).len() == piece.len() {
                Value::Null
            } else {
                serde_norway::from_str(piece).map_err(|e| ManifestError::Yaml {
                    doc: i + 1,
                    line: line + e.location().map_or(0, |l| l.line().saturating_sub(1)),
                    message: e.to_string(),
                })?
            };
            docs.push(Document {
                text: piece,
                head: head_of(piece),
                value,
                changed: false,
            });
        }
        docs
    };

    let mut objects = Vec::new();
    for (doc, d) in docs.iter().enumerate() {
        if str_at(&d.value, &["kind"]) == Some("List") {
            let items = d.value.get("items").and_then(Value::as_sequence);
            let n = items.map_or(0, Vec::len);
            objects.extend((0..n).map(|i| At { doc, item: Some(i) }));
        } else if d.value.is_mapping() {
            objects.push(At { doc, item: None });
        }
    }
    let services: Vec<At> = objects
        .iter()
        .copied()
        .filter(|at| str_at(at.get(&docs), &["kind"]) == Some("Service"))
        .collect();

    let mut notes = Vec::new();
    let mut injected_namespaces: Vec<Option<String>> = Vec::new();
    let mut injected = 0;
    for at in &objects {
        let object = at.get(&docs);
        let Some(path) = str_at(object, &["kind"]).and_then(template_path) else {
            continue;
        };
        let what = describe(object);
        let ns = namespace(object).map(str::to_owned);
        let mut object = object.clone();
        let owner = match path {
            [] => None,
            _ => object
                .get("metadata")
                .and_then(|m| m.get("annotations"))
                .and_then(Value::as_mapping)
                .cloned(),
        };
        let Some(template) = path.iter().try_fold(&mut object, |v, k| v.get_mut(*k)) else {
            notes.push(format!(
                "document {} ({what}): left as it was: no pod template at {}",
                at.number(),
                path.join(".")
            ));
            continue;
        };
        let labels = template
            .get("metadata")
            .and_then(|m| m.get("labels"))
            .and_then(Value::as_mapping);
        let selecting: Vec<At> = services
            .iter()
            .copied()
            .filter(|s| {
                let svc = s.get(&docs);
                let selector = svc
                    .get("spec")
                    .and_then(|s| s.get("selector"))
                    .and_then(Value::as_mapping);
                same_namespace(namespace(svc), ns.as_deref())
                    && selector.is_some_and(|sel| selects(sel, labels))
            })
            .collect();
        let ports: Vec<ServicePort> = selecting
            .iter()
            .flat_map(|s| service_ports(s.get(&docs)))
            .collect();
        let outcome = inject_pod(template, owner.as_ref(), &ports, settings).map_err(|error| {
            let mut field = path.join(".");
            if field.is_empty() {
                field.push_str("(pod)");
            }
            ManifestError::Field {
                doc: at.doc + 1,
                what: what.clone(),
                field,
                error,
            }
        })?;
        match outcome {
            Outcome::Injected(change) => {
                injected += 1;
                at.set(&mut docs, object);
                if !injected_namespaces.contains(&ns) {
                    injected_namespaces.push(ns.clone());
                }
                for s in &selecting {
                    let mut svc = s.get(&docs).clone();
                    if retarget(&mut svc, change.app_port, change.proxy_port) {
                        s.set(&mut docs, svc);
                    }
                }
            }
            Outcome::Skipped(reason) => notes.push(format!(
                "document {} ({what}): left as it was: {reason}",
                at.number()
            )),
            Outcome::AlreadyInjected => notes.push(format!(
                "document {} ({what}): already injected",
                at.number()
            )),
        }
    }

    let mut config_maps = Vec::new();
    if let Some(config) = config {
        for ns in &injected_namespaces {
            let present = objects.iter().any(|at| {
                let v = at.get(&docs);
                str_at(v, &["kind"]) == Some("ConfigMap")
                    && str_at(v, &["metadata", "name"]) == Some(settings.config_map.as_str())
                    && same_namespace(namespace(v), ns.as_deref())
            });
            if !present {
                config_maps.push(config_map(&settings.config_map, ns.as_deref(), config));
            }
        }
    }

    let output = if json {
        render_json(text, docs.remove(0), config_maps)?
    } else {
        render_yaml(&docs, config_maps)
    };
    Ok(Injected {
        output,
        notes,
        injected,
    })
}

/// Points the Service's ports that target `app` by number at `proxy`; true when one changed.
fn retarget(service: &mut Value, app: u16, proxy: u16) -> bool {
    let mut changed = false;
    let ports = service
        .get_mut("spec")
        .and_then(|s| s.get_mut("ports"))
        .and_then(Value::as_sequence_mut);
    for p in ports.into_iter().flatten() {
        let port = p.get("port").and_then(Value::as_u64);
        let by_number = match p.get("targetPort") {
            None => port == Some(u64::from(app)),
            Some(Value::String(s)) => s.parse::<u16>() == Ok(app),
            Some(v) => v.as_u64() == Some(u64::from(app)),
        };
        if let (true, Some(p)) = (by_number, p.as_mapping_mut()) {
            p.insert("targetPort".into(), Value::from(proxy));
            changed = true;
        }
    }
    changed
}

fn config_map(name: &str, namespace: Option<&str>, config: &str) -> Value {
    let mut metadata = Mapping::new();
    metadata.insert("name".into(), name.into());
    if let Some(ns) = namespace {
        metadata.insert("namespace".into(), ns.into());
    }
    let mut labels = Mapping::new();
    labels.insert("app.kubernetes.io/component".into(), "idemproxy".into());
    metadata.insert("labels".into(), labels.into());
    let mut data = Mapping::new();
    data.insert("idemproxy.toml".into(), config.into());
    let mut cm = Mapping::new();
    cm.insert("apiVersion".into(), "v1".into());
    cm.insert("kind".into(), "ConfigMap".into());
    cm.insert("metadata".into(), metadata.into());
    cm.insert("data".into(), data.into());
    cm.into()
}

fn render_yaml(docs: &[Document], extra: Vec<Value>) -> String {
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

fn render_json(text: &str, doc: Document, extra: Vec<Value>) -> Result<String, ManifestError> {
    if !doc.changed && extra.is_empty() {
        return Ok(text.to_owned());
    }
    let mut value = doc.value;
    if !extra.is_empty() {
        if str_at(&value, &["kind"]) != Some("List") {
            let mut list = Mapping::new();
            list.insert("apiVersion".into(), "v1".into());
            list.insert("kind".into(), "List".into());
            list.insert("items".into(), Value::Sequence(vec![value]));
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
