//! The one change to a pod, shared by `idemproxy inject` and the injector: which port, then the sidecar.

use serde_norway::{Mapping, Value};

pub use super::ports::ServicePort;
pub(crate) use super::ports::PORT_ANNOTATION;
use super::ports::{self, Candidate, Says};
use super::{PortRef, Settings};

/// `idemproxy.dev/inject: disabled` leaves a workload as it was (`enabled` opts a pod in at the webhook).
pub(crate) const INJECT_ANNOTATION: &str = "idemproxy.dev/inject";
/// The sidecar's name; a pod that has an init container by this name is already injected.
pub(crate) const SIDECAR: &str = "idemproxy";
/// The pod volume that holds the configuration.
const CONFIG_VOLUME: &str = "idemproxy-config";
/// The proxy's port, when that number is free in the pod (else the next free one).
pub(crate) const PROXY_PORT_BASE: u16 = 15080;
/// The proxy port's name when the application's port has none.
const PROXY_PORT_NAME: &str = "idemproxy-http";

/// What was done to a pod.
#[derive(Debug)]
pub enum Injection {
    Injected(Change),
    /// Left as it was, with the reason (for a note on standard error).
    Skipped(String),
    /// Left as it was because the sidecar would make it an invalid pod (a
    /// container already named `idemproxy`, a Windows pod): always said, by
    /// a note or, at the webhook, an AdmissionReview warning.
    Refused(String),
    AlreadyInjected,
}

/// The ports of an injection, for rewiring the Services that target the app's port by number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub app_port: u16,
    pub proxy_port: u16,
    pub h2: bool,
}

/// An annotation that names no port of the pod: invalid input, not a reason to skip.
#[derive(Debug, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

/// One container port of an application container.
struct AppPort {
    container: usize,
    index: usize,
    number: u16,
    name: Option<String>,
    tcp: bool,
}

/// Adds the sidecar to `pod` (a Pod, or a workload's pod template: `metadata` and `spec`).
/// `owner` holds the workload's own annotations, looked at after the template's;
/// `services` are the ports of the Services that select the pod.
pub fn inject_pod(
    pod: &mut Value,
    owner: Option<&Mapping>,
    services: &[ServicePort],
    settings: &Settings,
) -> Result<Injection, FieldError> {
    let annotation = |key: &str| -> Option<String> {
        let own = pod
            .get("metadata")
            .and_then(|m| m.get("annotations"))
            .and_then(|a| a.get(key))
            .and_then(Value::as_str);
        let owners = owner.and_then(|a| a.get(key)).and_then(Value::as_str);
        own.or(owners).map(str::to_owned)
    };
    let Some(spec) = pod.get("spec") else {
        return Err(FieldError {
            field: "spec".into(),
            message: "missing".into(),
        });
    };
    if let Some(outcome) = left_alone(spec, annotation(INJECT_ANNOTATION).as_deref()) {
        return Ok(outcome);
    }
    let ports = app_ports(spec);
    let chosen = match chosen_port(&ports, services, settings, annotation(PORT_ANNOTATION))? {
        Ok(n) => n,
        Err(reason) => return Ok(Injection::Skipped(reason)),
    };
    let app = ports.iter().find(|p| p.number == chosen);
    if let Some(reason) = obstacle(spec, app, settings) {
        return Ok(Injection::Skipped(reason));
    }
    let targeting = services
        .iter()
        .filter(|s| resolve(&ports, &s.target) == Some(chosen));
    let h2 = targeting.clone().any(ServicePort::is_h2)
        || app
            .and_then(|p| p.name.as_deref())
            .is_some_and(|n| n.to_ascii_lowercase().starts_with("grpc"));
    let used = used_ports(spec);
    let proxy_port = (PROXY_PORT_BASE..=u16::MAX)
        .find(|n| !used.contains(n) && *n != settings.admin_port)
        .unwrap_or(PROXY_PORT_BASE);
    let change = Change {
        app_port: chosen,
        proxy_port,
        h2,
    };
    apply(pod, app, &change, settings)?;
    Ok(Injection::Injected(change))
}

/// A pod injected before, or one the sidecar must not be added to, and why.
fn left_alone(spec: &Value, inject: Option<&str>) -> Option<Injection> {
    let sidecar_like = |key| containers(spec, key).find(|c| name_of(c) == Some(SIDECAR));
    if let Some(init) = sidecar_like("initContainers") {
        let ours = init.get("restartPolicy").and_then(Value::as_str) == Some("Always")
            && injected_change_of(init).is_some();
        return Some(if ours {
            Injection::AlreadyInjected
        } else {
            Injection::Refused(format!(
                "it already has an init container named {SIDECAR:?} that is not the idemproxy \
                 sidecar (container names must be unique in a pod)"
            ))
        });
    }
    if sidecar_like("containers").is_some() || sidecar_like("ephemeralContainers").is_some() {
        return Some(Injection::Refused(format!(
            "it already has a container named {SIDECAR:?} (container names must be unique in a pod)"
        )));
    }
    if inject == Some("disabled") {
        return Some(Injection::Skipped(format!(
            "annotated {INJECT_ANNOTATION}: disabled"
        )));
    }
    if spec.get("hostNetwork").and_then(Value::as_bool) == Some(true) {
        return Some(Injection::Skipped(
            "hostNetwork: the proxy's ports would be the node's".into(),
        ));
    }
    let os = spec
        .get("os")
        .and_then(|o| o.get("name"))
        .and_then(Value::as_str);
    if os.is_some_and(|os| os != "linux") {
        return Some(Injection::Refused(format!(
            "a {} pod (spec.os.name): the sidecar is a Linux container",
            os.unwrap_or_default()
        )));
    }
    None
}

/// The port to protect: `--port`, else the annotation, else the one the
/// evidence shows (`Ok(Err(reason))` when there is none to take; `Err` when
/// the annotation names no port of the pod).
fn chosen_port(
    ports: &[AppPort],
    services: &[ServicePort],
    settings: &Settings,
    annotated: Option<String>,
) -> Result<Result<u16, String>, FieldError> {
    let explicit = match (&settings.port, annotated) {
        (Some(p), _) => match resolve(ports, p) {
            Some(n) => Some(n),
            None => return Ok(Err(format!("no container port {p} (--port)"))),
        },
        (None, Some(text)) => {
            let p = PortRef::parse(&text);
            Some(resolve(ports, &p).ok_or_else(|| FieldError {
                field: format!("metadata.annotations.{PORT_ANNOTATION}"),
                message: format!("no container port named or numbered {text:?}"),
            })?)
        }
        (None, None) => None,
    };
    let chosen = match explicit {
        Some(n) => n,
        None => match ports::choose(&candidates(ports, services)) {
            Ok(n) => n,
            Err(reason) => return Ok(Err(reason)),
        },
    };
    // Never a port that is not HTTP, whoever chose it.
    let targeting: Vec<&ServicePort> = services
        .iter()
        .filter(|s| resolve(ports, &s.target) == Some(chosen))
        .collect();
    let name = ports
        .iter()
        .find(|p| p.number == chosen)
        .and_then(|p| p.name.as_deref());
    if let Some(reason) = ports::never(chosen, name, &targeting) {
        return Ok(Err(reason));
    }
    if let Some(p) = ports.iter().find(|p| p.number == chosen && !p.tcp) {
        return Ok(Err(format!("port {} is not TCP", p.number)));
    }
    Ok(Ok(chosen))
}

/// The pod's TCP ports and the numbers its Services target, with what each says.
fn candidates(ports: &[AppPort], services: &[ServicePort]) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = Vec::new();
    for p in ports.iter().filter(|p| p.tcp) {
        if out.iter().any(|c| c.number == p.number) {
            continue;
        }
        let says = p.name.as_deref().map(ports::name_says);
        out.push(Candidate {
            number: p.number,
            name: p.name.clone(),
            evidence: (says == Some(Says::Http))
                .then(|| format!("container port {:?}", p.name.as_deref().unwrap_or(""))),
            against: match says {
                Some(Says::NotHttp | Says::Tls) => Some(format!(
                    "container port {:?} is not HTTP in clear text",
                    p.name.as_deref().unwrap_or("")
                )),
                _ => None,
            },
            named: p.name.is_some(),
        });
    }
    for s in services {
        let Some(n) = resolve(ports, &s.target) else {
            continue;
        };
        let at = match out.iter().position(|c| c.number == n) {
            Some(i) => i,
            None => {
                out.push(Candidate {
                    number: n,
                    name: None,
                    evidence: None,
                    against: None,
                    named: false,
                });
                out.len() - 1
            }
        };
        let c = &mut out[at];
        c.named |= s.name.is_some() || s.app_protocol.is_some();
        match s.says() {
            Says::Http => c.evidence = c.evidence.take().or_else(|| Some(s.label())),
            Says::Tls | Says::NotHttp => {
                c.against = c.against.take().or_else(|| ports::never(n, None, &[s]));
            }
            Says::Nothing => {}
        }
    }
    for c in &mut out {
        if let Some(what) = ports::well_known(c.number) {
            c.against = Some(format!("port {} is {what}'s, not HTTP", c.number));
        }
        let tls = ports::TLS_PORTS.iter().find(|(p, _)| *p == c.number);
        if let (Some((_, what)), None) = (tls, &c.evidence) {
            c.against = Some(format!(
                "port {} is {what}'s: the proxy cannot read requests in TLS",
                c.number
            ));
        }
    }
    out
}

/// What keeps the sidecar out of a pod once its port is chosen.
fn obstacle(spec: &Value, app: Option<&AppPort>, settings: &Settings) -> Option<String> {
    // Port names are unique within a container, not within a pod: with two
    // containers naming a port alike, a Service's named targetPort could
    // reach the other container after the rename.
    if let Some(name) = app.and_then(|p| p.name.as_deref()) {
        if port_names(spec).iter().filter(|n| *n == name).count() > 1 {
            return Some(format!(
                "several containers name a port {name:?}: a Service that targets it by name \
                 could reach any of them; rename the others, or choose with --port"
            ));
        }
    }
    if used_ports(spec).contains(&settings.admin_port) {
        return Some(format!(
            "the pod already uses port {}, the proxy's admin port",
            settings.admin_port
        ));
    }
    let volumes = spec.get("volumes").and_then(Value::as_sequence);
    if volumes.is_some_and(|v| v.iter().any(|v| name_of(v) == Some(CONFIG_VOLUME))) {
        return Some(format!(
            "the pod already has a volume named {CONFIG_VOLUME}"
        ));
    }
    None
}

/// Adds the sidecar and its volume, and renames the app's port (and moves
/// its host port) so that the proxy takes over what targets it by name.
fn apply(
    pod: &mut Value,
    app: Option<&AppPort>,
    change: &Change,
    settings: &Settings,
) -> Result<(), FieldError> {
    let names = pod.get("spec").map(port_names).unwrap_or_default();
    let proxy_port_name = match app.and_then(|p| p.name.clone()) {
        Some(name) => name,
        None => PROXY_PORT_NAME.to_owned(),
    };
    let mut sidecar = sidecar(settings, change, &proxy_port_name);
    let Some(spec) = pod.as_mapping_mut().and_then(|pod| map_at(pod, "spec")) else {
        return Err(FieldError {
            field: "spec".into(),
            message: "not a mapping".into(),
        });
    };
    if let Some(p) = app {
        let container = spec
            .get_mut("containers")
            .and_then(|c| c.get_mut(p.container));
        if let Some(c) = container {
            rename_app_port(c, p, &names, &mut sidecar);
        }
    }
    if let Some(init) = seq_at(spec, "initContainers") {
        init.insert(0, sidecar);
    }
    let mut volume = Mapping::new();
    volume.insert("name".into(), CONFIG_VOLUME.into());
    let mut cm = Mapping::new();
    cm.insert("name".into(), settings.config_map.clone().into());
    volume.insert("configMap".into(), cm.into());
    if let Some(volumes) = seq_at(spec, "volumes") {
        volumes.push(volume.into());
    }
    Ok(())
}

/// The app's port gets a new name (the proxy takes the old one), and a
/// hostPort on it moves to the proxy's port: node:hostPort would otherwise
/// reach the app around the proxy. Its probes follow the rename.
fn rename_app_port(c: &mut Value, p: &AppPort, names: &[String], sidecar: &mut Value) {
    let renamed = p.name.as_deref().map(|old| app_port_name(old, names));
    let port = c
        .get_mut("ports")
        .and_then(|ps| ps.get_mut(p.index))
        .and_then(Value::as_mapping_mut);
    if let Some(port) = port {
        if let Some(renamed) = &renamed {
            port.insert("name".into(), renamed.clone().into());
        }
        let host: Vec<(Value, Value)> = ["hostPort", "hostIP"]
            .iter()
            .filter_map(|k| port.remove(*k).map(|v| (Value::from(*k), v)))
            .collect();
        let proxy = sidecar
            .get_mut("ports")
            .and_then(|ps| ps.get_mut(0))
            .and_then(Value::as_mapping_mut);
        if let Some(proxy) = proxy {
            proxy.extend(host);
        }
    }
    // The kubelet resolves a probe's named port in the probe's own container:
    // the app's probes and lifecycle hooks follow the rename (and still reach the app).
    if let (Some(old), Some(renamed)) = (&p.name, &renamed) {
        rename_probe_ports(c, old, renamed);
    }
}

/// The ports of a pod injected before, read back from its sidecar's
/// `--listen` and `--upstream` arguments: what its Services must be rewired to.
pub(crate) fn injected_change(pod: &Value) -> Option<Change> {
    let spec = pod.get("spec")?;
    let sidecar = containers(spec, "initContainers").find(|c| name_of(c) == Some(SIDECAR))?;
    injected_change_of(sidecar)
}

/// The ports of an idemproxy sidecar, from its arguments.
fn injected_change_of(sidecar: &Value) -> Option<Change> {
    let args: Vec<&str> = sidecar
        .get("args")
        .and_then(Value::as_sequence)?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let after = |flag: &str| args.windows(2).find(|w| w[0] == flag).map(|w| w[1]);
    let port_of = |text: &str| {
        text.rsplit(':')
            .next()?
            .trim_end_matches('/')
            .parse::<u16>()
            .ok()
    };
    Some(Change {
        proxy_port: port_of(after("--listen")?)?,
        app_port: port_of(after("--upstream")?)?,
        h2: after("--upstream-protocol") == Some("h2c"),
    })
}

/// Points the probes and lifecycle hooks of `container` that name port `old` at `new`.
fn rename_probe_ports(container: &mut Value, old: &str, new: &str) {
    let Some(c) = container.as_mapping_mut() else {
        return;
    };
    let mut handlers: Vec<&mut Value> = Vec::new();
    for (k, v) in c.iter_mut() {
        match k.as_str() {
            Some("startupProbe" | "readinessProbe" | "livenessProbe") => handlers.push(v),
            Some("lifecycle") => {
                if let Some(l) = v.as_mapping_mut() {
                    handlers.extend(l.values_mut());
                }
            }
            _ => {}
        }
    }
    for h in handlers {
        for action in ["httpGet", "tcpSocket"] {
            if let Some(port) = h.get_mut(action).and_then(|a| a.get_mut("port")) {
                if port.as_str() == Some(old) {
                    *port = new.into();
                }
            }
        }
    }
}

/// A port reference resolved against the pod: by name among the declared
/// ports, by number whether declared or not (a Service may target a port the
/// container does not list).
fn resolve(ports: &[AppPort], p: &PortRef) -> Option<u16> {
    match p {
        PortRef::Number(n) => Some(*n),
        PortRef::Name(name) => ports
            .iter()
            .find(|p| p.name.as_deref() == Some(name))
            .map(|p| p.number),
    }
}

fn containers<'a>(spec: &'a Value, key: &str) -> impl Iterator<Item = &'a Value> {
    spec.get(key)
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
}

fn name_of(v: &Value) -> Option<&str> {
    v.get("name").and_then(Value::as_str)
}

fn number(v: Option<&Value>) -> Option<u16> {
    v.and_then(Value::as_u64)
        .and_then(|n| u16::try_from(n).ok())
}

fn app_ports(spec: &Value) -> Vec<AppPort> {
    let mut out = Vec::new();
    for (ci, c) in containers(spec, "containers").enumerate() {
        let ports = c.get("ports").and_then(Value::as_sequence);
        for (pi, p) in ports.into_iter().flatten().enumerate() {
            let Some(n) = number(p.get("containerPort")) else {
                continue;
            };
            out.push(AppPort {
                container: ci,
                index: pi,
                number: n,
                name: name_of(p).map(str::to_owned),
                tcp: p
                    .get("protocol")
                    .and_then(Value::as_str)
                    .is_none_or(|p| p == "TCP"),
            });
        }
    }
    out
}

/// Every port number the pod declares or probes, in any container.
fn used_ports(spec: &Value) -> Vec<u16> {
    let mut used = Vec::new();
    for c in containers(spec, "containers").chain(containers(spec, "initContainers")) {
        let ports = c.get("ports").and_then(Value::as_sequence);
        for p in ports.into_iter().flatten() {
            used.extend(number(p.get("containerPort")));
            used.extend(number(p.get("hostPort")));
        }
        for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
            let Some(probe) = c.get(probe) else { continue };
            for action in ["httpGet", "tcpSocket", "grpc"] {
                used.extend(number(probe.get(action).and_then(|a| a.get("port"))));
            }
        }
    }
    used
}

fn port_names(spec: &Value) -> Vec<String> {
    let mut names = Vec::new();
    for c in containers(spec, "containers").chain(containers(spec, "initContainers")) {
        let ports = c.get("ports").and_then(Value::as_sequence);
        names.extend(
            ports
                .into_iter()
                .flatten()
                .filter_map(name_of)
                .map(str::to_owned),
        );
    }
    names
}

/// The app port's new name: `app-<name>`, within the 15 characters of an
/// IANA service name and unlike any other name in the pod.
fn app_port_name(old: &str, taken: &[String]) -> String {
    for prefix in ["app-", "ap-", "a-", "a"] {
        let room = 15 - prefix.len();
        let stem: String = old.chars().take(room).collect();
        let candidate = format!("{prefix}{}", stem.trim_end_matches('-'));
        if !taken.contains(&candidate) {
            return candidate;
        }
    }
    format!("app-{}", taken.len())
}

fn sidecar(settings: &Settings, change: &Change, proxy_port_name: &str) -> Value {
    let mut args = vec![
        "--config".to_owned(),
        "/etc/idemproxy/idemproxy.toml".to_owned(),
        "--log-format".to_owned(),
        "json".to_owned(),
        "--listen".to_owned(),
        format!("0.0.0.0:{}", change.proxy_port),
        "--upstream".to_owned(),
        format!("http://127.0.0.1:{}", change.app_port),
        // The kubelet probes the pod's address, whatever the file's admin_listen says.
        "--admin-listen".to_owned(),
        format!("0.0.0.0:{}", settings.admin_port),
    ];
    if change.h2 {
        args.extend(["--upstream-protocol".to_owned(), "h2c".to_owned()]);
    }
    let quote = |s: &str| serde_json::Value::from(s).to_string();
    let text = include_str!("sidecar.yaml")
        .replace("{image}", &quote(&settings.image))
        .replace("{args}", &serde_json::Value::from(args).to_string())
        .replace("{proxy_port_name}", &quote(proxy_port_name))
        .replace("{proxy_port}", &change.proxy_port.to_string())
        .replace("{admin_port}", &settings.admin_port.to_string());
    // The template is ours and every value in it is quoted: it always parses.
    serde_norway::from_str(&text).unwrap_or(Value::Null)
}

/// The mapping under `key`, made when absent or not a mapping (always `Some`).
fn map_at<'a>(m: &'a mut Mapping, key: &str) -> Option<&'a mut Mapping> {
    let entry = m
        .entry(key.into())
        .or_insert_with(|| Value::Mapping(Mapping::new()));
    if !entry.is_mapping() {
        *entry = Value::Mapping(Mapping::new());
    }
    entry.as_mapping_mut()
}

/// The sequence under `key`, made when absent or not a sequence (always `Some`).
fn seq_at<'a>(m: &'a mut Mapping, key: &str) -> Option<&'a mut Vec<Value>> {
    let entry = m
        .entry(key.into())
        .or_insert_with(|| Value::Sequence(Vec::new()));
    if !entry.is_sequence() {
        *entry = Value::Sequence(Vec::new());
    }
    entry.as_sequence_mut()
}
