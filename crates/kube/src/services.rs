//! The Services of the input: which pods they select, on which ports, and
//! their rewiring to the proxy's port; the objects `inject` adds beside them.

use serde_norway::{Mapping, Value};

use super::documents::{namespace, str_at};
use super::ports::ServicePort;
use super::PortRef;

/// Two objects can refer to each other unless both name a namespace and the names differ.
pub(crate) fn same_namespace(a: Option<&str>, b: Option<&str>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}

/// A Service's selector matches the labels (an empty selector selects nothing here:
/// such a Service has endpoints managed by hand).
pub fn selects(selector: &Mapping, labels: Option<&Mapping>) -> bool {
    !selector.is_empty()
        && labels.is_some_and(|labels| selector.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

pub(crate) fn service_ports(service: &Value) -> Vec<ServicePort> {
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

pub(crate) fn service_selects(svc: &Value, ns: Option<&str>, labels: Option<&Mapping>) -> bool {
    let selector = svc
        .get("spec")
        .and_then(|s| s.get("selector"))
        .and_then(Value::as_mapping);
    same_namespace(namespace(svc), ns) && selector.is_some_and(|sel| selects(sel, labels))
}

/// Points the Service's ports that target `app` by number at `proxy`; true when one changed.
pub(crate) fn retarget(service: &mut Value, app: u16, proxy: u16) -> bool {
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

/// Ingress to the selected pods on `ports` (TCP) only, from anywhere.
pub(crate) fn network_policy_for(
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

pub fn config_map(name: &str, namespace: Option<&str>, config: &str) -> Value {
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

/// Pods that the input makes through a kind `inject` does not inject
/// (a ReplicationController, an Argo `Rollout`, any custom resource): one
/// entry per pod template found in such an object, with its namespace and
/// labels, and what makes them. A Rollout's `workloadRef` makes pods with the
/// labels of the workload it names. A `PodTemplate` makes none.
pub(crate) struct ForeignPods {
    pub what: String,
    pub namespace: Option<String>,
    pub labels: Mapping,
}

/// Every pod template inside `v`: a mapping with `metadata.labels` and `spec.containers`.
fn pod_templates<'v>(v: &'v Value, out: &mut Vec<&'v Mapping>) {
    match v {
        Value::Mapping(m) => {
            let labels = m
                .get("metadata")
                .and_then(|md| md.get("labels"))
                .and_then(Value::as_mapping);
            let containers = m
                .get("spec")
                .and_then(|s| s.get("containers"))
                .is_some_and(Value::is_sequence);
            if let (Some(labels), true) = (labels, containers) {
                out.push(labels);
                return;
            }
            for child in m.values() {
                pod_templates(child, out);
            }
        }
        Value::Sequence(s) => s.iter().for_each(|c| pod_templates(c, out)),
        _ => {}
    }
}

/// The foreign pods of `objects`, given `is_workload` (a kind `inject` injects)
/// and `template_labels` (the pod labels of a workload of the input, by kind, namespace and name).
pub(crate) fn foreign_pods<'a>(
    objects: impl Iterator<Item = &'a Value>,
    is_workload: impl Fn(&str) -> bool,
    template_labels: impl Fn(&str, Option<&str>, &str) -> Option<Mapping>,
) -> Vec<ForeignPods> {
    let mut out = Vec::new();
    for v in objects {
        let kind = str_at(v, &["kind"]).unwrap_or("");
        if is_workload(kind) || matches!(kind, "PodTemplate" | "CustomResourceDefinition") {
            continue;
        }
        let what = super::documents::describe(v);
        let ns = namespace(v).map(str::to_owned);
        let mut found = Vec::new();
        if let Some(spec) = v.get("spec") {
            pod_templates(spec, &mut found);
        }
        out.extend(found.into_iter().map(|labels| ForeignPods {
            what: what.clone(),
            namespace: ns.clone(),
            labels: labels.clone(),
        }));
        let reference = v.get("spec").and_then(|s| s.get("workloadRef"));
        let (rk, rn) = (
            reference.and_then(|r| str_at(r, &["kind"])),
            reference.and_then(|r| str_at(r, &["name"])),
        );
        if let (Some(rk), Some(rn)) = (rk, rn) {
            if let Some(labels) = template_labels(rk, ns.as_deref(), rn) {
                out.push(ForeignPods {
                    what: format!("{what} (its workloadRef, {rk} {rn})"),
                    namespace: ns.clone(),
                    labels,
                });
            }
        }
    }
    out
}

/// Whether a NetworkPolicy's `podSelector` selects pods with `labels` (an
/// empty one selects every pod of its namespace); `None` when it cannot be
/// told (`matchExpressions`, which are not evaluated).
fn policy_selects(policy: &Value, labels: Option<&Mapping>) -> Option<bool> {
    let sel = policy.get("spec").and_then(|s| s.get("podSelector"))?;
    if sel.get("matchExpressions").is_some() {
        return None;
    }
    let match_labels = sel.get("matchLabels").and_then(Value::as_mapping);
    Some(match match_labels {
        None => true,
        Some(m) if m.is_empty() => true,
        Some(m) => labels.is_some_and(|l| m.iter().all(|(k, v)| l.get(k) == Some(v))),
    })
}

/// A workload of the input as a NetworkPolicy sees it.
pub(crate) struct PolicyTarget<'a> {
    pub what: &'a str,
    pub namespace: Option<&'a str>,
    pub labels: Option<&'a Mapping>,
    /// (app port, proxy port) when it runs the sidecar.
    pub ports: Option<(u16, u16)>,
    /// The container ports it declares.
    pub declared: Vec<u16>,
}

/// Whether a `ports` entry of a rule allows TCP port `n` (by number or range).
fn allows(entry: &Value, n: u16) -> bool {
    let tcp = entry
        .get("protocol")
        .and_then(Value::as_str)
        .is_none_or(|p| p == "TCP");
    let start = entry.get("port").and_then(Value::as_u64);
    let end = entry.get("endPort").and_then(Value::as_u64).or(start);
    tcp && start
        .zip(end)
        .is_some_and(|(s, e)| (s..=e).contains(&u64::from(n)))
}

/// What became of one NetworkPolicy.
#[derive(Default)]
pub(crate) struct PolicyChange {
    /// (workload, app port, proxy port) now allowed.
    pub opened: Vec<(String, u16, u16)>,
    /// Why a rule that allowed an injected app's port was not opened.
    pub refused: Vec<String>,
}

/// Lets the ingress rules of an existing NetworkPolicy that allow an injected
/// app's port (by number or range) allow its proxy's port too: the Services
/// now send that traffic there. (A rule that names the port allows the proxy
/// already: it took the name.) Only when that opens nothing more: every pod
/// the policy selects that listens on the proxy's port must be one whose app
/// port the same rule allowed; otherwise the rule is left as it was and the
/// reason given. A policy whose selector cannot be evaluated is left alone.
pub(crate) fn open_proxy_ports(policy: &mut Value, targets: &[PolicyTarget]) -> PolicyChange {
    let mut change = PolicyChange::default();
    let ns = namespace(policy).map(str::to_owned);
    let mut selected = Vec::new();
    for t in targets
        .iter()
        .filter(|t| same_namespace(ns.as_deref(), t.namespace))
    {
        match policy_selects(policy, t.labels) {
            Some(true) => selected.push(t),
            Some(false) => {}
            None => {
                if t.ports.is_some() {
                    change.refused.push(format!(
                        "its podSelector has matchExpressions, which inject does not evaluate: \
                         allow the proxy's port of {} yourself if it selects it",
                        t.what
                    ));
                }
                return change;
            }
        }
    }
    let rules = policy
        .get_mut("spec")
        .and_then(|s| s.get_mut("ingress"))
        .and_then(Value::as_sequence_mut);
    for rule in rules.into_iter().flatten() {
        let Some(entries) = rule.get_mut("ports").and_then(Value::as_sequence_mut) else {
            continue; // no ports: every port is allowed
        };
        let mut add: Vec<u16> = Vec::new();
        for t in &selected {
            let Some((app, proxy)) = t.ports else {
                continue;
            };
            if !entries.iter().any(|e| allows(e, app)) || entries.iter().any(|e| allows(e, proxy)) {
                continue;
            }
            // Every selected pod that would answer on `proxy`: its app port allowed here too.
            let wider = selected.iter().find(|o| match o.ports {
                Some((oa, op)) => op == proxy && !entries.iter().any(|e| allows(e, oa)),
                None => o.declared.contains(&proxy),
            });
            match wider {
                Some(o) => change.refused.push(format!(
                    "a rule allows port {app} of {}, but opening its proxy's port {proxy} would \
                     let the same sources reach {} on {proxy} too: allow it yourself where you mean to",
                    t.what, o.what
                )),
                None => {
                    if !add.contains(&proxy) {
                        add.push(proxy);
                    }
                    change.opened.push((t.what.to_owned(), app, proxy));
                }
            }
        }
        for proxy in add {
            let mut port = Mapping::new();
            port.insert("protocol".into(), "TCP".into());
            port.insert("port".into(), Value::from(proxy));
            entries.push(port.into());
        }
    }
    change
}
