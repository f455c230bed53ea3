//! The one change to a pod, shared by `idemproxy inject` and the injector: which port, then the sidecar.

use serde_norway::{Mapping, Value};

use super::{PortRef, Settings};

/// `idemproxy.dev/inject: disabled` leaves a workload as it was (`enabled` opts a pod in at the webhook).
pub const INJECT_ANNOTATION: &str = "idemproxy.dev/inject";
/// The port to protect, by name or number, when the Services do not say it.
pub const PORT_ANNOTATION: &str = "idemproxy.dev/port";
/// The sidecar's name; a pod that has an init container by this name is already injected.
pub const SIDECAR: &str = "idemproxy";
/// The pod volume that holds the configuration.
const CONFIG_VOLUME: &str = "idemproxy-config";
/// The proxy's port, when that number is free in the pod (else the next free one).
pub const PROXY_PORT_BASE: u16 = 15080;
/// The proxy port's name when the application's port has none.
const PROXY_PORT_NAME: &str = "idemproxy-http";
/// Ports that are never HTTP when a pod has only one and nothing else says
/// what it is: Redis, PostgreSQL, MySQL, MongoDB, memcached, Cassandra,
/// ZooKeeper, Kafka, AMQP.
const WELL_KNOWN_NOT_HTTP: [u16; 9] = [6379, 5432, 3306, 27017, 11211, 9042, 2181, 9092, 5672];
/// Port-name prefixes that say "not HTTP" (on a Service port or a container port).
const NOT_HTTP_NAMES: [&str; 5] = ["tcp", "redis", "mongo", "mysql", "postgres"];
/// `appProtocol` values that are HTTP (anything else is not taken).
const HTTP_PROTOCOLS: [&str; 6] = ["http", "https", "http2", "h2c", "grpc", "kubernetes.io/h2c"];

/// A Service port that selects the pod, as the injection needs it.
#[derive(Clone, Debug)]
pub struct ServicePort {
    pub name: Option<String>,
    pub port: u16,
    /// `targetPort` as written, or the port number when it is absent.
    pub target: PortRef,
    pub app_protocol: Option<String>,
    pub protocol: Option<String>,
}

impl ServicePort {
    fn is_http(&self) -> bool {
        let named_not_http = self
            .name
            .as_deref()
            .is_some_and(|n| NOT_HTTP_NAMES.iter().any(|p| n.starts_with(p)));
        let protocol_not_http = self
            .app_protocol
            .as_deref()
            .is_some_and(|p| !HTTP_PROTOCOLS.contains(&p));
        let not_tcp = self.protocol.as_deref().is_some_and(|p| p != "TCP");
        !(named_not_http || protocol_not_http || not_tcp)
    }

    fn is_h2(&self) -> bool {
        self.name.as_deref().is_some_and(|n| n.starts_with("grpc"))
            || matches!(
                self.app_protocol.as_deref(),
                Some("grpc" | "h2c" | "kubernetes.io/h2c")
            )
    }
}

/// What was done to a pod.
#[derive(Debug)]
pub enum Outcome {
    Injected(Change),
    /// Left as it was, with the reason (for a note on standard error).
    Skipped(String),
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
) -> Result<Outcome, FieldError> {
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
    if containers(spec, "initContainers").any(|c| name_of(c) == Some(SIDECAR)) {
        return Ok(Outcome::AlreadyInjected);
    }
    if annotation(INJECT_ANNOTATION).as_deref() == Some("disabled") {
        return Ok(Outcome::Skipped(format!(
            "annotated {INJECT_ANNOTATION}: disabled"
        )));
    }
    if spec.get("hostNetwork").and_then(Value::as_bool) == Some(true) {
        return Ok(Outcome::Skipped(
            "hostNetwork: the proxy's ports would be the node's".into(),
        ));
    }
    let ports = app_ports(spec);
    let chosen = match (&settings.port, annotation(PORT_ANNOTATION)) {
        (Some(p), _) => match resolve(&ports, p) {
            Some(n) => n,
            None => return Ok(Outcome::Skipped(format!("no container port {p} (--port)"))),
        },
        (None, Some(text)) => {
            let p = PortRef::parse(&text);
            resolve(&ports, &p).ok_or_else(|| FieldError {
                field: format!("metadata.annotations.{PORT_ANNOTATION}"),
                message: format!("no container port named or numbered {text:?}"),
            })?
        }
        (None, None) => match from_services(&ports, services) {
            Ok(n) => n,
            Err(reason) => return Ok(Outcome::Skipped(reason)),
        },
    };
    // Never a port that a Service says is not HTTP, whoever chose it.
    let targeting: Vec<&ServicePort> = services
        .iter()
        .filter(|s| resolve(&ports, &s.target) == Some(chosen))
        .collect();
    if let Some(s) = targeting.iter().find(|s| !s.is_http()) {
        return Ok(Outcome::Skipped(format!(
            "port {chosen} is not HTTP (Service port {})",
            s.name.as_deref().unwrap_or("without a name")
        )));
    }
    let app = ports.iter().find(|p| p.number == chosen);
    if let Some(p) = app.filter(|p| !p.tcp) {
        return Ok(Outcome::Skipped(format!("port {} is not TCP", p.number)));
    }
    // Port names are unique within a container, not within a pod: with two
    // containers naming a port alike, a Service's named targetPort could
    // reach the other container after the rename.
    if let Some(name) = app.and_then(|p| p.name.as_deref()) {
        if port_names(spec).iter().filter(|n| *n == name).count() > 1 {
            return Ok(Outcome::Skipped(format!(
                "several containers name a port {name:?}: a Service that targets it by name \
                 could reach any of them; rename the others, or choose with --port"
            )));
        }
    }
    let h2 = targeting.iter().any(|s| s.is_h2())
        || app
            .and_then(|p| p.name.as_deref())
            .is_some_and(|n| n.starts_with("grpc"));

    let used = used_ports(spec);
    if used.contains(&settings.admin_port) {
        return Ok(Outcome::Skipped(format!(
            "the pod already uses port {}, the proxy's admin port",
            settings.admin_port
        )));
    }
    let volumes = spec.get("volumes").and_then(Value::as_sequence);
    if volumes.is_some_and(|v| v.iter().any(|v| name_of(v) == Some(CONFIG_VOLUME))) {
        return Ok(Outcome::Skipped(format!(
            "the pod already has a volume named {CONFIG_VOLUME}"
        )));
    }
    let proxy_port = (PROXY_PORT_BASE..=u16::MAX)
        .find(|n| !used.contains(n) && *n != settings.admin_port)
        .unwrap_or(PROXY_PORT_BASE);

    // The proxy takes over the app port's name, so that whatever targets it by name reaches the proxy.
    let names = port_names(spec);
    let proxy_port_name = match app.and_then(|p| p.name.clone()) {
        Some(name) => name,
        None => PROXY_PORT_NAME.to_owned(),
    };
    let change = Change {
        app_port: chosen,
        proxy_port,
        h2,
    };
    let mut sidecar = sidecar(settings, &change, &proxy_port_name);
    let Some(spec) = pod.as_mapping_mut().and_then(|pod| map_at(pod, "spec")) else {
        return Err(FieldError {
            field: "spec".into(),
            message: "not a mapping".into(),
        });
    };
    if let Some(p) = app {
        let renamed = p.name.as_deref().map(|old| app_port_name(old, &names));
        let container = spec
            .get_mut("containers")
            .and_then(|c| c.get_mut(p.container));
        if let Some(c) = container {
            let port = c
                .get_mut("ports")
                .and_then(|ps| ps.get_mut(p.index))
                .and_then(Value::as_mapping_mut);
            if let Some(port) = port {
                if let Some(renamed) = &renamed {
                    port.insert("name".into(), renamed.clone().into());
                }
                // A hostPort on the app's port would let node:hostPort reach the
                // app around the proxy: it moves to the proxy's port.
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
    Ok(Outcome::Injected(change))
}

/// The ports of a pod injected before, read back from its sidecar's
/// `--listen` and `--upstream` arguments: what its Services must be rewired to.
pub fn injected_change(pod: &Value) -> Option<Change> {
    let spec = pod.get("spec")?;
    let sidecar = containers(spec, "initContainers").find(|c| name_of(c) == Some(SIDECAR))?;
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

/// The port the Services in the input target (the only HTTP one), else the
/// pod's only port; or why there is none to take.
fn from_services(ports: &[AppPort], services: &[ServicePort]) -> Result<u16, String> {
    let mut http: Vec<u16> = Vec::new();
    let mut not_http: Vec<u16> = Vec::new();
    for s in services {
        let Some(n) = resolve(ports, &s.target) else {
            continue;
        };
        // An unnamed port of Redis, PostgreSQL... is not taken on the Service's silence.
        let silent = s.name.is_none() && s.app_protocol.is_none();
        let list = if s.is_http() && !(silent && WELL_KNOWN_NOT_HTTP.contains(&n)) {
            &mut http
        } else {
            &mut not_http
        };
        if !list.contains(&n) {
            list.push(n);
        }
    }
    http.retain(|n| !not_http.contains(n));
    match http.as_slice() {
        [one] => return Ok(*one),
        [_, _, ..] => {
            return Err(format!(
                "Services target several HTTP ports ({http:?}): choose one with --port or the \
                 {PORT_ANNOTATION} annotation"
            ))
        }
        [] if !not_http.is_empty() => {
            return Err(format!(
                "the Services that select it target no HTTP port (port {not_http:?} is not HTTP)"
            ))
        }
        [] => {}
    }
    let tcp: Vec<&AppPort> = ports.iter().filter(|p| p.tcp).collect();
    match tcp.as_slice() {
        [] => Err("no container port to protect".into()),
        [one] => {
            let named_not_http = one
                .name
                .as_deref()
                .is_some_and(|n| NOT_HTTP_NAMES.iter().any(|p| n.starts_with(p)));
            if named_not_http || WELL_KNOWN_NOT_HTTP.contains(&one.number) {
                Err(format!(
                    "its only port {} is not HTTP (by its name or number)",
                    one.number
                ))
            } else {
                Ok(one.number)
            }
        }
        _ => Err(format!(
            "several container ports and no Service in the input says which is HTTP: choose one \
             with --port or the {PORT_ANNOTATION} annotation"
        )),
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
