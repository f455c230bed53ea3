//! Which port of a pod speaks HTTP: a port is taken over only with evidence.
//!
//! Evidence is the operator's choice (`--port`, the `idemproxy.dev/port`
//! annotation), an `appProtocol` of HTTP, or a port name (of a Service port
//! or of the container port) that starts with `http`, `grpc`, `h2c` or `web`.
//! An unnamed port with no evidence is taken only when it is the workload's
//! only port. Never taken, whatever else says so: a well-known port number of
//! a database, broker or other protocol that is not HTTP ([`NOT_HTTP_PORTS`]),
//! a port a Service marks as something else (a name such as `tcp-*`,
//! `redis*`, `mysql*`, an `appProtocol` that is not HTTP, UDP or SCTP), and a
//! port that speaks TLS (`https*` names, `appProtocol: https`): the proxy
//! would have to read requests it cannot decrypt.

use super::PortRef;

/// The port to protect, by name or number, when the Services do not say it.
pub(crate) const PORT_ANNOTATION: &str = "idemproxy.dev/port";

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

/// Port numbers of protocols that are not HTTP, never taken whatever their
/// name or annotation says (the docs list them: docs/kubernetes.md#ports).
pub const NOT_HTTP_PORTS: [(u16, &str); 41] = [
    (21, "FTP"),
    (22, "SSH"),
    (23, "Telnet"),
    (25, "SMTP"),
    (53, "DNS"),
    (110, "POP3"),
    (143, "IMAP"),
    (389, "LDAP"),
    (465, "SMTPS"),
    (587, "SMTP submission"),
    (636, "LDAPS"),
    (993, "IMAPS"),
    (995, "POP3S"),
    (1433, "SQL Server"),
    (1521, "Oracle"),
    (1883, "MQTT"),
    (2181, "ZooKeeper"),
    (2888, "ZooKeeper peers"),
    (3306, "MySQL/MariaDB"),
    (3888, "ZooKeeper elections"),
    (4222, "NATS"),
    (4369, "Erlang epmd"),
    (5222, "XMPP"),
    (5432, "PostgreSQL"),
    (5671, "AMQP over TLS"),
    (5672, "AMQP"),
    (6222, "NATS cluster"),
    (6379, "Redis"),
    (6650, "Pulsar"),
    (7687, "Neo4j Bolt"),
    (8883, "MQTT over TLS"),
    (9042, "Cassandra CQL"),
    (9092, "Kafka"),
    (9093, "Kafka (TLS)"),
    (9160, "Cassandra Thrift"),
    (9300, "Elasticsearch transport"),
    (11211, "memcached"),
    (25672, "RabbitMQ distribution"),
    (26379, "Redis Sentinel"),
    (27017, "MongoDB"),
    (61616, "ActiveMQ"),
];

/// Port numbers of HTTP over TLS: the proxy cannot read what passes, so
/// these are never taken either (unless a Service or the port's name says
/// it speaks HTTP in clear text there, which the choice then follows).
pub(crate) const TLS_PORTS: [(u16, &str); 4] = [
    (443, "HTTPS"),
    (6443, "the Kubernetes API (TLS)"),
    (8443, "HTTPS"),
    (9443, "HTTPS (webhooks)"),
];

/// Port-name prefixes that are evidence of HTTP.
const HTTP_NAMES: [&str; 4] = ["http", "grpc", "h2c", "web"];
/// Port-name prefixes of TLS (checked before [`HTTP_NAMES`]: `https` starts with `http`).
const TLS_NAMES: [&str; 5] = ["https", "grpcs", "wss", "tls", "ssl"];
/// Port-name prefixes that say "not HTTP".
const NOT_HTTP_NAMES: [&str; 16] = [
    "tcp", "udp", "redis", "mongo", "mysql", "maria", "postgres", "pg", "kafka", "amqp", "mqtt",
    "nats", "ldap", "smtp", "memcache", "cql",
];
/// `appProtocol` values that are HTTP in clear text.
const HTTP_PROTOCOLS: [&str; 7] = [
    "http",
    "http2",
    "h2c",
    "grpc",
    "kubernetes.io/h2c",
    "kubernetes.io/ws",
    "ws",
];
/// `appProtocol` values of HTTP over TLS.
const TLS_PROTOCOLS: [&str; 3] = ["https", "kubernetes.io/wss", "wss"];

/// The protocol a well-known non-HTTP port number belongs to.
pub fn well_known(n: u16) -> Option<&'static str> {
    NOT_HTTP_PORTS
        .iter()
        .find(|(p, _)| *p == n)
        .map(|(_, what)| *what)
}

/// What a port's name or a Service port says about the protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Says {
    Http,
    Tls,
    NotHttp,
    Nothing,
}

/// What a port name says.
pub(crate) fn name_says(name: &str) -> Says {
    let n = name.to_ascii_lowercase();
    if TLS_NAMES.iter().any(|p| n.starts_with(p)) {
        Says::Tls
    } else if HTTP_NAMES.iter().any(|p| n.starts_with(p)) {
        Says::Http
    } else if NOT_HTTP_NAMES.iter().any(|p| n.starts_with(p)) {
        Says::NotHttp
    } else {
        Says::Nothing
    }
}

impl ServicePort {
    /// What this Service port says: its protocol, then its `appProtocol`, then its name.
    pub fn says(&self) -> Says {
        if self.protocol.as_deref().is_some_and(|p| p != "TCP") {
            return Says::NotHttp;
        }
        if let Some(p) = self.app_protocol.as_deref() {
            let p = p.to_ascii_lowercase();
            return if TLS_PROTOCOLS.contains(&p.as_str()) {
                Says::Tls
            } else if HTTP_PROTOCOLS.contains(&p.as_str()) {
                Says::Http
            } else {
                Says::NotHttp
            };
        }
        self.name.as_deref().map_or(Says::Nothing, name_says)
    }

    /// Whether the proxy speaks HTTP/2 (h2c) to the application on this port.
    pub(crate) fn is_h2(&self) -> bool {
        self.name
            .as_deref()
            .is_some_and(|n| n.to_ascii_lowercase().starts_with("grpc"))
            || matches!(
                self.app_protocol.as_deref(),
                Some("grpc" | "h2c" | "kubernetes.io/h2c" | "http2")
            )
    }

    /// "Service port http (80)", for notes.
    pub fn label(&self) -> String {
        match &self.name {
            Some(n) => format!("Service port {n:?} ({})", self.port),
            None => format!("unnamed Service port {}", self.port),
        }
    }
}

/// One TCP port of the pod as the choice sees it: a container port, or a
/// number a Service targets that no container declares.
#[derive(Debug)]
pub(crate) struct Candidate {
    pub number: u16,
    /// The container port's name, if it is declared and named.
    pub name: Option<String>,
    /// Why it is HTTP, when something says so.
    pub evidence: Option<String>,
    /// Why it is never taken, when something says so.
    pub against: Option<String>,
    /// Named by a Service port or the container port.
    pub named: bool,
}

/// Why a port may not be taken even when the operator names it: a
/// well-known non-HTTP number, a container port name or a Service that says
/// it is something else (or TLS), or a TLS port number nothing says is clear text.
pub fn never(number: u16, name: Option<&str>, targeting: &[&ServicePort]) -> Option<String> {
    if let Some(what) = well_known(number) {
        return Some(format!("port {number} is {what}'s, not HTTP"));
    }
    match name.map(name_says) {
        Some(Says::NotHttp) => {
            return Some(format!(
                "port {number} is not HTTP (container port {:?})",
                name.unwrap_or_default()
            ))
        }
        Some(Says::Tls) => {
            return Some(format!(
            "port {number} speaks TLS (container port {:?}): the proxy cannot read its requests",
            name.unwrap_or_default()
        ))
        }
        _ => {}
    }
    let clear =
        name.map(name_says) == Some(Says::Http) || targeting.iter().any(|s| s.says() == Says::Http);
    if let (Some((_, what)), false) = (TLS_PORTS.iter().find(|(p, _)| *p == number), clear) {
        return Some(format!(
            "port {number} is {what}'s: the proxy cannot read requests in TLS"
        ));
    }
    targeting.iter().find_map(|s| match s.says() {
        Says::NotHttp => Some(format!("port {number} is not HTTP ({})", s.label())),
        Says::Tls => Some(format!(
            "port {number} speaks TLS ({}): the proxy cannot read its requests",
            s.label()
        )),
        _ => None,
    })
}

/// The port to take when neither `--port` nor the annotation chooses: the
/// only one with evidence of HTTP, else the only port when it has no name;
/// or why there is none to take.
pub(crate) fn choose(candidates: &[Candidate]) -> Result<u16, String> {
    let http: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| c.evidence.is_some() && c.against.is_none())
        .collect();
    match http.as_slice() {
        [one] => return Ok(one.number),
        [_, _, ..] => {
            let list: Vec<String> = http
                .iter()
                .map(|c| format!("{} ({})", c.number, c.evidence.as_deref().unwrap_or("")))
                .collect();
            return Err(format!(
                "several HTTP ports ({}): choose one with --port or the {PORT_ANNOTATION} annotation",
                list.join(", ")
            ));
        }
        [] => {}
    }
    match candidates {
        [] => Err("no container port to protect".into()),
        [only] if only.against.is_none() && !only.named => Ok(only.number),
        [only] => Err(match &only.against {
            Some(why) => why.clone(),
            None => format!(
                "its only port, {}, shows no sign of HTTP: name its Service port http-* (or \
                 appProtocol: http), or choose it with --port or the {PORT_ANNOTATION} annotation",
                describe(only)
            ),
        }),
        _ => {
            let list: Vec<String> = candidates.iter().map(describe).collect();
            Err(format!(
                "no port shows it speaks HTTP (ports {}): name the Service port http-* (or \
                 appProtocol: http), or choose with --port or the {PORT_ANNOTATION} annotation",
                list.join(", ")
            ))
        }
    }
}

fn describe(c: &Candidate) -> String {
    let mut s = c.number.to_string();
    if let Some(n) = &c.name {
        s.push_str(&format!(" {n:?}"));
    }
    if let Some(why) = &c.against {
        s.push_str(&format!(": {why}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sp(name: Option<&str>, app_protocol: Option<&str>) -> ServicePort {
        ServicePort {
            name: name.map(str::to_owned),
            port: 80,
            target: PortRef::Number(8080),
            app_protocol: app_protocol.map(str::to_owned),
            protocol: None,
        }
    }

    #[test]
    fn names_and_protocols_say_what_they_are() {
        for (name, says) in [
            ("http", Says::Http),
            ("http-web", Says::Http),
            ("grpc", Says::Http),
            ("h2c-api", Says::Http),
            ("webhook", Says::Http),
            ("https", Says::Tls),
            ("https-webhook", Says::Tls),
            ("tcp-redis", Says::NotHttp),
            ("postgresql", Says::NotHttp),
            ("metrics", Says::Nothing),
            ("server", Says::Nothing),
        ] {
            assert_eq!(name_says(name), says, "{name}");
        }
        assert_eq!(sp(Some("metrics"), Some("http")).says(), Says::Http);
        assert_eq!(sp(Some("http"), Some("https")).says(), Says::Tls);
        assert_eq!(sp(Some("http"), Some("mysql")).says(), Says::NotHttp);
        assert_eq!(sp(None, None).says(), Says::Nothing);
    }

    #[test]
    fn a_well_known_port_is_never_taken_whatever_its_name() {
        let http = sp(Some("http"), Some("http"));
        for n in [
            5432, 3306, 9092, 5672, 11211, 2181, 9042, 4222, 1883, 389, 25, 9300,
        ] {
            assert!(never(n, None, &[&http]).is_some(), "{n}");
        }
        assert!(never(8080, None, &[&http]).is_none());
        assert!(never(8443, Some("https"), &[]).is_some());
        assert!(never(8080, Some("tcp-x"), &[]).is_some());
        assert!(never(443, None, &[]).is_some());
        assert!(
            never(443, None, &[&http]).is_none(),
            "a Service says clear HTTP"
        );
    }

    #[test]
    fn evidence_chooses_and_silence_chooses_only_an_only_unnamed_port() {
        let c = |number, evidence: Option<&str>, named| Candidate {
            number,
            name: None,
            evidence: evidence.map(str::to_owned),
            against: None,
            named,
        };
        assert_eq!(
            choose(&[c(8080, Some("http"), true), c(9090, None, true)]),
            Ok(8080)
        );
        assert!(
            choose(&[c(8080, Some("a"), true), c(8081, Some("b"), true)])
                .unwrap_err()
                .contains("several HTTP ports")
        );
        assert_eq!(choose(&[c(8080, None, false)]), Ok(8080));
        assert!(choose(&[c(8080, None, true)]).is_err());
        assert!(choose(&[c(8080, None, false), c(8081, None, false)]).is_err());
    }
}
