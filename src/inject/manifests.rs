//! `idemproxy inject`: a stream of manifests in, the same stream out with the sidecar added and the Services rewired.
//!
//! The YAML stream is split into documents here, so that a document the
//! injection does not change comes out as its original text, comments and
//! all; a changed one is written again from its parsed value (its leading
//! comments kept). JSON (one object, or a `List`) comes out as JSON.

use serde_norway::{Mapping, Value};

use super::emit::to_yaml;
use super::pod::{inject_pod, injected_change, Change, FieldError, Outcome, ServicePort};
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
    #[error(
        "document {doc} (line {line}): the plain value {value:?} is a string to YAML 1.2 but {meaning} \
         to Kubernetes (YAML 1.1); this document is rewritten, so write it as {fix}"
    )]
    Yaml11 {
        doc: usize,
        line: usize,
        value: String,
        meaning: &'static str,
        fix: &'static str,
    },
    #[error("document {doc} ({service}): {message}")]
    SharedService {
        doc: String,
        service: String,
        message: String,
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
    /// The line of the input its text starts on.
    line: usize,
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
/// With `network_policy`, a NetworkPolicy per injected workload lets ingress
/// reach only the proxy's and admin ports.
pub fn inject_manifests(
    text: &str,
    settings: &Settings,
    config: Option<&str>,
    network_policy: bool,
) -> Result<Injected, ManifestError> {
    let json = text.trim_start().starts_with(['{', '[']);
    let mut docs = if json {
        let value: Value =
            serde_json::from_str(text).map_err(|e| ManifestError::Json(e.to_string()))?;
        vec![Document {
            text,
            head: "",
            line: 1,
            value,
            changed: false,
        }]
    } else {
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
    let mut workloads: Vec<Workload> = Vec::new();
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
        let selector = object
            .get("spec")
            .and_then(|s| s.get("selector"))
            .and_then(|s| s.get("matchLabels"))
            .and_then(Value::as_mapping)
            .cloned();
        let name = str_at(&object, &["metadata", "name"]).map(str::to_owned);
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
            .and_then(Value::as_mapping)
            .cloned();
        let ports: Vec<ServicePort> = services
            .iter()
            .filter(|s| service_selects(s.get(&docs), ns.as_deref(), labels.as_ref()))
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
        let change = match outcome {
            Outcome::Injected(change) => {
                injected += 1;
                if !injected_namespaces.contains(&ns) {
                    injected_namespaces.push(ns.clone());
                }
                at.set(&mut docs, object);
                Some(change)
            }
            Outcome::Skipped(reason) => {
                notes.push(format!(
                    "document {} ({what}): left as it was: {reason}",
                    at.number()
                ));
                None
            }
            Outcome::AlreadyInjected => {
                notes.push(format!(
                    "document {} ({what}): already injected",
                    at.number()
                ));
                // Its Services are rewired still: one added since the last run may target the app.
                let change = injected_change(template);
                if change.is_none() {
                    notes.push(format!(
                        "document {} ({what}): its idemproxy sidecar has no --listen and \
                         --upstream arguments to read the ports from: its Services are left as \
                         they are",
                        at.number()
                    ));
                }
                change
            }
        };
        workloads.push(Workload {
            at: *at,
            what,
            name,
            ns,
            labels,
            selector,
            change,
        });
    }

    // A Service is rewired only when every workload of the input it selects
    // goes through a proxy on the same ports: never half of its endpoints cut off.
    for s in &services {
        let svc = s.get(&docs);
        let selected: Vec<&Workload> = workloads
            .iter()
            .filter(|w| service_selects(svc, w.ns.as_deref(), w.labels.as_ref()))
            .collect();
        let Some(first) = selected.iter().find_map(|w| w.change.as_ref()) else {
            continue;
        };
        if str_at(svc, &["spec", "clusterIP"]) == Some("None") {
            notes.push(format!(
                "document {} ({}): headless Service: its clients dial the pods' addresses and \
                 may name the application's port, around the proxy (see --network-policy)",
                s.number(),
                describe(svc)
            ));
        }
        let mut rewired = svc.clone();
        if !retarget(&mut rewired, first.app_port, first.proxy_port) {
            continue;
        }
        let differ: Vec<String> = selected
            .iter()
            .filter(|w| w.change.as_ref().is_none_or(|c| !same_ports(c, first)))
            .map(|w| match &w.change {
                None => format!("{} (left as it was)", w.what),
                Some(c) => format!(
                    "{} (app port {}, proxy port {})",
                    w.what, c.app_port, c.proxy_port
                ),
            })
            .collect();
        if !differ.is_empty() {
            let with: Vec<&str> = selected
                .iter()
                .filter(|w| w.change.as_ref().is_some_and(|c| same_ports(c, first)))
                .map(|w| w.what.as_str())
                .collect();
            return Err(ManifestError::SharedService {
                doc: s.number(),
                service: describe(svc),
                message: format!(
                    "it selects {} (app port {}, proxy port {}) and {}: retargeting it to the \
                     proxy's port would cut the others off; give them their own Service, or \
                     inject them alike (--port, or the {} annotation)",
                    with.join(", "),
                    first.app_port,
                    first.proxy_port,
                    differ.join(", "),
                    super::pod::PORT_ANNOTATION
                ),
            });
        }
        s.set(&mut docs, rewired);
    }

    let mut policies = Vec::new();
    if network_policy {
        for w in &workloads {
            let Some(change) = &w.change else { continue };
            let Some(name) = &w.name else {
                notes.push(format!(
                    "document {} ({}): no NetworkPolicy: the workload has no name",
                    w.at.number(),
                    w.what
                ));
                continue;
            };
            let Some(selector) = w.selector.as_ref().or(w.labels.as_ref()) else {
                notes.push(format!(
                    "document {} ({}): no NetworkPolicy: the pods have no labels to select them by",
                    w.at.number(),
                    w.what
                ));
                continue;
            };
            let policy_name = format!("{name}-idemproxy");
            let present = objects.iter().any(|at| {
                let v = at.get(&docs);
                str_at(v, &["kind"]) == Some("NetworkPolicy")
                    && str_at(v, &["metadata", "name"]) == Some(policy_name.as_str())
                    && same_namespace(namespace(v), w.ns.as_deref())
            });
            if !present {
                policies.push(network_policy_for(
                    &policy_name,
                    w.ns.as_deref(),
                    selector,
                    &[change.proxy_port, settings.admin_port],
                ));
            }
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

    config_maps.extend(policies);
    if !json {
        check_yaml_1_1(&docs)?;
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

/// A workload of the input and what became of it.
struct Workload {
    at: At,
    what: String,
    name: Option<String>,
    ns: Option<String>,
    /// The pod template's labels, which Services select.
    labels: Option<Mapping>,
    /// The workload's `spec.selector.matchLabels`, which a NetworkPolicy selects by.
    selector: Option<Mapping>,
    /// The ports, when it runs the sidecar (injected now or before).
    change: Option<Change>,
}

fn same_ports(a: &Change, b: &Change) -> bool {
    a.app_port == b.app_port && a.proxy_port == b.proxy_port
}

fn service_selects(svc: &Value, ns: Option<&str>, labels: Option<&Mapping>) -> bool {
    let selector = svc
        .get("spec")
        .and_then(|s| s.get("selector"))
        .and_then(Value::as_mapping);
    same_namespace(namespace(svc), ns) && selector.is_some_and(|sel| selects(sel, labels))
}

/// Ingress to the selected pods on `ports` (TCP) only, from anywhere.
fn network_policy_for(
    name: &str,
    namespace: Option<&str>,
    labels: &Mapping,
    ports: &[u16],
) -> Value {
    let mut metadata = Mapping::new();
    metadata.insert("name".into(), name.into());
    if let Some(ns) = namespace {
        metadata.insert("namespace".into(), ns.into());
    }
    let mut component = Mapping::new();
    component.insert("app.kubernetes.io/component".into(), "idemproxy".into());
    metadata.insert("labels".into(), component.into());
    let mut selector = Mapping::new();
    selector.insert("matchLabels".into(), labels.clone().into());
    let ports: Vec<Value> = ports
        .iter()
        .map(|p| {
            let mut m = Mapping::new();
            m.insert("protocol".into(), "TCP".into());
            m.insert("port".into(), Value::from(*p));
            m.into()
        })
        .collect();
    let mut rule = Mapping::new();
    rule.insert("ports".into(), ports.into());
    let mut spec = Mapping::new();
    spec.insert("podSelector".into(), selector.into());
    spec.insert("policyTypes".into(), vec![Value::from("Ingress")].into());
    spec.insert("ingress".into(), vec![Value::from(rule)].into());
    let mut np = Mapping::new();
    np.insert("apiVersion".into(), "networking.k8s.io/v1".into());
    np.insert("kind".into(), "NetworkPolicy".into());
    np.insert("metadata".into(), metadata.into());
    np.insert("spec".into(), spec.into());
    np.into()
}

/// A rewritten document is written from its parsed value, read as YAML 1.2:
/// a plain `yes`, `off`, `0644` or `1:20` came in as a string, and would go
/// out quoted, a string where Kubernetes (YAML 1.1) read a boolean or a
/// number. Such a document is refused, naming the line and value.
fn check_yaml_1_1(docs: &[Document]) -> Result<(), ManifestError> {
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
