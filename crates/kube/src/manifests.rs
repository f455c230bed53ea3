//! `idemproxy inject`: a stream of manifests in, the same stream out with the sidecar added and the Services rewired.
//!
//! The input is read as documents ([`super::documents`]); every workload
//! chosen (`--only`, `--selector`; all without them) gets the sidecar
//! ([`super::pod`]); the Services that select the injected pods are rewired
//! to the proxy's port when that cuts no other pod off ([`super::services`]).

use serde_norway::{Mapping, Value};

use super::documents::{self, describe, namespace, str_at, At, Document};
pub use super::error::ManifestError;
use super::pod::{inject_pod, injected_change, Change, Injection, ServicePort};
use super::select::Selection;
use super::services::{
    config_map, foreign_pods, network_policy_for, open_proxy_ports, retarget, same_namespace,
    selects, service_ports, service_selects, ForeignPods, PolicyTarget,
};
use super::Settings;

/// The output, built whole before any of it is written, and the notes for standard error.
#[derive(Debug)]
pub struct Injected {
    pub output: String,
    pub notes: Vec<String>,
    /// How many workloads got the sidecar.
    pub injected: usize,
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

/// What `inject_manifests` adds beside the sidecars, and which workloads it chooses.
#[derive(Clone, Debug, Default)]
pub struct Options<'a> {
    /// The text of a configuration file: a ConfigMap holding it is added for
    /// each namespace injected into, unless the input has one by that name.
    pub config: Option<&'a str>,
    /// A NetworkPolicy per injected workload that lets ingress reach only the
    /// proxy's and admin ports.
    pub network_policy: bool,
    /// `--only` and `--selector`.
    pub select: Selection,
}

/// Injects the chosen workloads of `text`.
pub fn inject_manifests(
    text: &str,
    settings: &Settings,
    options: &Options,
) -> Result<Injected, ManifestError> {
    let (json, mut docs) = documents::parse(text)?;
    let objects = documents::objects(&docs);
    let services: Vec<At> = objects
        .iter()
        .filter(|at| str_at(at.get(&docs), &["kind"]) == Some("Service"))
        .cloned()
        .collect();
    let mut run = Run::default();
    for at in &objects {
        run.workload(at, &mut docs, &services, settings, &options.select)?;
    }
    let unmatched = options.select.unmatched(&run.seen);
    if !unmatched.is_empty() {
        return Err(ManifestError::Selection(format!(
            "--only {} names no workload of the input",
            unmatched.join(", ")
        )));
    }
    if options.select.is_some() && !run.unchosen.is_empty() {
        run.notes.push(format!(
            "not chosen by --only/--selector, left as they were: {}",
            run.unchosen.join(", ")
        ));
    }
    let foreign = foreign_pods(
        objects.iter().map(|at| at.get(&docs)),
        |kind| template_path(kind).is_some(),
        |kind, ns, name| run.pod_labels(kind, ns, name),
    );
    run.rewire(&mut docs, &services, &foreign)?;
    run.open_policies(&mut docs, &objects);
    let mut extra = Vec::new();
    if let Some(config) = options.config {
        extra.extend(run.config_maps(&docs, &objects, settings, config));
    }
    if options.network_policy {
        extra.extend(run.policies(&docs, &objects, settings));
    }
    if !json {
        documents::check_yaml_1_1(&docs)?;
    }
    let output = if json {
        documents::render_json(text, docs.remove(0), extra)?
    } else {
        documents::render_yaml(&docs, extra)
    };
    Ok(Injected {
        output,
        notes: run.notes,
        injected: run.injected,
    })
}

/// A workload of the input and what became of it.
struct Workload {
    at: At,
    kind: String,
    /// The container ports its pods declare.
    declared: Vec<u16>,
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

/// What the injection has done so far.
#[derive(Default)]
struct Run {
    notes: Vec<String>,
    injected: usize,
    namespaces: Vec<Option<String>>,
    workloads: Vec<Workload>,
    /// Every workload of the input, by kind and name (for `--only` that names none).
    seen: Vec<(String, Option<String>)>,
    /// The workloads `--only`/`--selector` left out.
    unchosen: Vec<String>,
}

impl Run {
    /// Injects the workload at `at`, if it is one and is chosen.
    fn workload(
        &mut self,
        at: &At,
        docs: &mut [Document],
        services: &[At],
        settings: &Settings,
        select: &Selection,
    ) -> Result<(), ManifestError> {
        let original = at.get(docs);
        let Some(kind) = str_at(original, &["kind"]).filter(|k| template_path(k).is_some()) else {
            return Ok(());
        };
        let path = template_path(kind).unwrap_or_default();
        let kind = kind.to_owned();
        let what = describe(original);
        let ns = namespace(original).map(str::to_owned);
        let name = str_at(original, &["metadata", "name"]).map(str::to_owned);
        self.seen.push((kind.clone(), name.clone()));
        let mut object = original.clone();
        let mapping_at = |v: &Value, keys: &[&str]| -> Option<Mapping> {
            keys.iter()
                .try_fold(v, |v, k| v.get(*k))
                .and_then(Value::as_mapping)
                .cloned()
        };
        let own_labels = mapping_at(&object, &["metadata", "labels"]);
        let owner = match path {
            [] => None,
            _ => mapping_at(&object, &["metadata", "annotations"]),
        };
        let selector = mapping_at(&object, &["spec", "selector", "matchLabels"]);
        let Some(template) = path.iter().try_fold(&mut object, |v, k| v.get_mut(*k)) else {
            self.notes.push(format!(
                "document {} ({what}): left as it was: no pod template at {}",
                at.number(),
                path.join(".")
            ));
            return Ok(());
        };
        let labels = mapping_at(template, &["metadata", "labels"]);
        let mut workload = Workload {
            at: at.clone(),
            kind: kind.clone(),
            declared: declared_ports(template),
            what: what.clone(),
            name: name.clone(),
            ns: ns.clone(),
            labels: labels.clone(),
            selector,
            change: None,
        };
        if !select.admits(&kind, name.as_deref(), own_labels.as_ref(), labels.as_ref()) {
            self.unchosen.push(what);
            self.workloads.push(workload);
            return Ok(());
        }
        let ports: Vec<ServicePort> = services
            .iter()
            .filter(|s| service_selects(s.get(docs), ns.as_deref(), labels.as_ref()))
            .flat_map(|s| service_ports(s.get(docs)))
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
        let injected = matches!(outcome, Injection::Injected(_));
        workload.change = self.outcome(at, &what, ns, outcome, template);
        if injected {
            at.set(docs, object);
        }
        self.workloads.push(workload);
        Ok(())
    }

    /// Notes what became of a workload; its ports when it runs the sidecar.
    fn outcome(
        &mut self,
        at: &At,
        what: &str,
        ns: Option<String>,
        outcome: Injection,
        template: &Value,
    ) -> Option<Change> {
        let n = at.number();
        match outcome {
            Injection::Injected(change) => {
                self.injected += 1;
                if !self.namespaces.contains(&ns) {
                    self.namespaces.push(ns);
                }
                self.notes.push(format!(
                    "document {n} ({what}): injected: port {} through the proxy on {}{}",
                    change.app_port,
                    change.proxy_port,
                    if change.h2 {
                        " (HTTP/2 to the app)"
                    } else {
                        ""
                    }
                ));
                Some(change)
            }
            Injection::Skipped(reason) | Injection::Refused(reason) => {
                self.notes
                    .push(format!("document {n} ({what}): left as it was: {reason}"));
                None
            }
            Injection::AlreadyInjected => {
                self.notes
                    .push(format!("document {n} ({what}): already injected"));
                // Its Services are rewired still: one added since the last run may target the app.
                let change = injected_change(template);
                if change.is_none() {
                    self.notes.push(format!(
                        "document {n} ({what}): its idemproxy sidecar has no --listen and \
                         --upstream arguments to read the ports from: its Services are left as \
                         they are"
                    ));
                }
                change
            }
        }
    }

    /// The pod labels of the workload `kind`/`name` in `ns`.
    fn pod_labels(&self, kind: &str, ns: Option<&str>, name: &str) -> Option<Mapping> {
        self.workloads
            .iter()
            .find(|w| {
                w.kind == kind
                    && w.name.as_deref() == Some(name)
                    && same_namespace(w.ns.as_deref(), ns)
            })
            .and_then(|w| w.labels.clone())
    }

    /// A Service is rewired only when every workload of the input it selects
    /// goes through a proxy on the same ports, and no pods of another kind:
    /// never half of its endpoints cut off.
    fn rewire(
        &mut self,
        docs: &mut [Document],
        services: &[At],
        foreign: &[ForeignPods],
    ) -> Result<(), ManifestError> {
        for s in services {
            let svc = s.get(docs);
            let selected: Vec<&Workload> = self
                .workloads
                .iter()
                .filter(|w| service_selects(svc, w.ns.as_deref(), w.labels.as_ref()))
                .collect();
            let Some(first) = selected.iter().find_map(|w| w.change.as_ref()) else {
                continue;
            };
            if str_at(svc, &["spec", "clusterIP"]) == Some("None") {
                self.notes.push(format!(
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
            let sel = svc
                .get("spec")
                .and_then(|sp| sp.get("selector"))
                .and_then(Value::as_mapping);
            let other = foreign.iter().find(|f| {
                same_namespace(namespace(svc), f.namespace.as_deref())
                    && sel.is_some_and(|sel| selects(sel, Some(&f.labels)))
            });
            if let Some(f) = other {
                return Err(ManifestError::ForeignPods {
                    doc: s.number(),
                    service: describe(svc),
                    owner: f.what.clone(),
                });
            }
            shared_ports(s, svc, &selected, first)?;
            s.set(docs, rewired);
        }
        Ok(())
    }

    /// The input's NetworkPolicies that let traffic reach an injected app's
    /// port let it reach the proxy's port too, where that opens nothing more.
    fn open_policies(&mut self, docs: &mut [Document], objects: &[At]) {
        for at in objects {
            if str_at(at.get(docs), &["kind"]) != Some("NetworkPolicy") {
                continue;
            }
            let targets: Vec<PolicyTarget> = self
                .workloads
                .iter()
                .map(|w| PolicyTarget {
                    what: &w.what,
                    namespace: w.ns.as_deref(),
                    labels: w.labels.as_ref(),
                    ports: w.change.as_ref().map(|c| (c.app_port, c.proxy_port)),
                    declared: w.declared.clone(),
                })
                .collect();
            let mut policy = at.get(docs).clone();
            let change = open_proxy_ports(&mut policy, &targets);
            let (n, what) = (at.number(), describe(&policy));
            for (w, app, proxy) in &change.opened {
                self.notes.push(format!(
                    "document {n} ({what}): lets ingress reach the proxy's port {proxy} of {w} \
                     as it did the application's port {app}"
                ));
            }
            for why in &change.refused {
                self.notes
                    .push(format!("document {n} ({what}): left as it was: {why}"));
            }
            if !change.opened.is_empty() {
                at.set(docs, policy);
            }
        }
    }

    /// A ConfigMap holding `config` for each namespace injected into, unless the input has it.
    fn config_maps(
        &self,
        docs: &[Document],
        objects: &[At],
        settings: &Settings,
        config: &str,
    ) -> Vec<Value> {
        let mut out = Vec::new();
        for ns in &self.namespaces {
            let present = objects.iter().any(|at| {
                let v = at.get(docs);
                str_at(v, &["kind"]) == Some("ConfigMap")
                    && str_at(v, &["metadata", "name"]) == Some(settings.config_map.as_str())
                    && same_namespace(namespace(v), ns.as_deref())
            });
            if !present {
                out.push(config_map(&settings.config_map, ns.as_deref(), config));
            }
        }
        out
    }

    /// A NetworkPolicy per injected workload, unless the input has it.
    fn policies(&mut self, docs: &[Document], objects: &[At], settings: &Settings) -> Vec<Value> {
        let mut out = Vec::new();
        for w in &self.workloads {
            let Some(change) = &w.change else { continue };
            let Some(name) = &w.name else {
                self.notes.push(format!(
                    "document {} ({}): no NetworkPolicy: the workload has no name",
                    w.at.number(),
                    w.what
                ));
                continue;
            };
            let Some(selector) = w.selector.as_ref().or(w.labels.as_ref()) else {
                self.notes.push(format!(
                    "document {} ({}): no NetworkPolicy: the pods have no labels to select them by",
                    w.at.number(),
                    w.what
                ));
                continue;
            };
            let policy_name = format!("{name}-idemproxy");
            let present = objects.iter().any(|at| {
                let v = at.get(docs);
                str_at(v, &["kind"]) == Some("NetworkPolicy")
                    && str_at(v, &["metadata", "name"]) == Some(policy_name.as_str())
                    && same_namespace(namespace(v), w.ns.as_deref())
            });
            if !present {
                out.push(network_policy_for(
                    &policy_name,
                    w.ns.as_deref(),
                    selector,
                    &[change.proxy_port, settings.admin_port],
                ));
            }
        }
        out
    }
}

/// Every workload the Service selects must run the proxy on the same ports.
fn shared_ports(
    s: &At,
    svc: &Value,
    selected: &[&Workload],
    first: &Change,
) -> Result<(), ManifestError> {
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
    if differ.is_empty() {
        return Ok(());
    }
    let with: Vec<&str> = selected
        .iter()
        .filter(|w| w.change.as_ref().is_some_and(|c| same_ports(c, first)))
        .map(|w| w.what.as_str())
        .collect();
    Err(ManifestError::SharedService {
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
            super::ports::PORT_ANNOTATION
        ),
    })
}

/// The container ports a pod template declares.
fn declared_ports(template: &Value) -> Vec<u16> {
    let spec = template.get("spec");
    ["containers", "initContainers"]
        .iter()
        .filter_map(|k| spec.and_then(|s| s.get(*k)).and_then(Value::as_sequence))
        .flatten()
        .filter_map(|c| c.get("ports").and_then(Value::as_sequence))
        .flatten()
        .filter_map(|p| p.get("containerPort").and_then(Value::as_u64))
        .filter_map(|n| u16::try_from(n).ok())
        .collect()
}

fn same_ports(a: &Change, b: &Change) -> bool {
    a.app_port == b.app_port && a.proxy_port == b.proxy_port
}
