//! `idemproxy inject` on real public manifests (Istio's Bookinfo, Argo CD's
//! install manifest, ingress-nginx's Helm-rendered static manifest), each
//! checked strict for Kubernetes 1.29 and 1.37, with what was injected and
//! what was left alone (and why) asserted per workload; and what keeps the
//! sidecar out: ports that are not HTTP, workloads not chosen, pods that
//! cannot take it, Services that also select pods of other kinds.

mod support;

use std::collections::BTreeMap;

use proptest::prelude::*;
use serde_norway::Value;

use support::kube::*;

/// What became of each workload: its app port through the proxy, or the
/// words of the note that left it alone.
#[derive(Debug)]
enum Fate {
    Injected { port: u64, h2: bool },
    LeftAlone(&'static str),
}

/// Injects `input` with `args`, validates the output, and checks every
/// workload against `expected` (by name): the sidecar and its app port, or
/// the document unchanged and the note's reason on standard error.
fn check_corpus(input: &str, args: &[&str], expected: &[(&str, Fate)]) -> Vec<Value> {
    let (output, stderr) = injected(args, input);
    assert_valid(&output);
    let (before, after) = (documents(input), documents(&output));
    let workloads: BTreeMap<&str, (&Value, &Value)> = before
        .iter()
        .zip(&after)
        .filter(|(b, _)| {
            matches!(
                kind(b),
                "Deployment" | "StatefulSet" | "DaemonSet" | "Job" | "CronJob" | "Pod"
            )
        })
        .map(|(b, a)| (name(b), (b, a)))
        .collect();
    assert_eq!(
        workloads.keys().copied().collect::<Vec<_>>(),
        {
            let mut names: Vec<&str> = expected.iter().map(|(n, _)| *n).collect();
            names.sort_unstable();
            names
        },
        "every workload of the input is accounted for"
    );
    for (wname, fate) in expected {
        let (b, a) = workloads[wname];
        assert_eq!(kind(b), kind(a));
        match fate {
            Fate::Injected { port, h2 } => {
                let sidecar = sidecar(a).unwrap_or_else(|| panic!("{wname}: no sidecar\n{stderr}"));
                assert_apps_unchanged(b, a);
                let args: Vec<&str> = seq(&sidecar["args"])
                    .iter()
                    .filter_map(Value::as_str)
                    .collect();
                assert!(
                    args.contains(&format!("http://127.0.0.1:{port}").as_str()),
                    "{wname}: {args:?}"
                );
                assert_eq!(
                    args.windows(2).any(|w| w == ["--upstream-protocol", "h2c"]),
                    *h2,
                    "{wname}: {args:?}"
                );
                // The app's start waits for the proxy to run, not for the store;
                // no lifecycle action that 1.29 drops.
                assert_eq!(sidecar["startupProbe"]["httpGet"]["path"], "/healthz");
                assert!(sidecar.get("lifecycle").is_none(), "{wname}");
                assert!(
                    stderr.contains(&format!("{wname}): injected: port {port} ")),
                    "{wname}: {stderr}"
                );
            }
            Fate::LeftAlone(why) => {
                assert_eq!(b, a, "{wname} changed");
                let line = stderr
                    .lines()
                    .find(|l| l.contains(&format!("{wname}): left as it was")))
                    .unwrap_or_else(|| panic!("{wname}: no note\n{stderr}"));
                assert!(line.contains(why), "{wname}: {line}");
            }
        }
    }
    assert_services_reach_the_proxy(&after);
    // Injecting the output again changes nothing.
    let (again, _) = injected(args, &output);
    assert_eq!(again, output, "a second injection changed something");
    after
}

const BOOKINFO: &str = "bookinfo/bookinfo.yaml";
const ARGO_CD: &str = "argo-cd/install.yaml";
const INGRESS_NGINX: &str = "ingress-nginx/deploy.yaml";

fn inj(port: u64) -> Fate {
    Fate::Injected { port, h2: false }
}

#[test]
fn bookinfo_every_service_named_http_goes_through_the_proxy() {
    let input = fixture(BOOKINFO);
    let all: Vec<(&str, Fate)> = [
        "details-v1",
        "ratings-v1",
        "reviews-v1",
        "reviews-v2",
        "reviews-v3",
        "productpage-v1",
    ]
    .into_iter()
    .map(|n| (n, inj(9080)))
    .collect();
    let after = check_corpus(&input, &[], &all);
    assert_eq!(assert_services_reach_the_proxy(&after), 6);
}

#[test]
fn bookinfo_only_what_is_asked_for() {
    let input = fixture(BOOKINFO);
    // By label: the three reviews versions, which share one Service.
    let (output, stderr) = injected(&["--selector", "app=reviews"], &input);
    assert_valid(&output);
    let after = documents(&output);
    let chosen: Vec<&str> = after
        .iter()
        .filter(|d| kind(d) == "Deployment" && sidecar(d).is_some())
        .map(name)
        .collect();
    assert_eq!(chosen, ["reviews-v1", "reviews-v2", "reviews-v3"]);
    assert!(
        stderr.contains("not chosen by --only/--selector, left as they were: Deployment details-v1, Deployment ratings-v1, Deployment productpage-v1"),
        "{stderr}"
    );
    assert_eq!(assert_services_reach_the_proxy(&after), 3);
    // By name, one workload; its Service is its own.
    let (output, _) = injected(&["--only", "deploy/productpage-v1"], &input);
    let after = documents(&output);
    let chosen: Vec<&str> = after
        .iter()
        .filter(|d| sidecar(d).is_some())
        .map(name)
        .collect();
    assert_eq!(chosen, ["productpage-v1"]);
    // One of three behind a shared Service would cut the others off: refused.
    let out = inject(&["--only", "deployment/reviews-v1"], &input);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Service reviews") && stderr.contains("reviews-v2"),
        "{stderr}"
    );
    // A name that matches nothing is a mistake, not an empty injection.
    let out = inject(&["--only", "deploy/reveiws-v1"], &input);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--only deploy/reveiws-v1 names no workload"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn argo_cd_only_ports_with_evidence_and_its_network_policies_follow() {
    let input = fixture(ARGO_CD);
    let after = check_corpus(
        &input,
        &[],
        &[
            // Service port "webhook" (7000).
            ("argocd-applicationset-controller", inj(7000)),
            // "http" 5556 has appProtocol: TCP; "grpc" 5557 is HTTP/2.
            (
                "argocd-dex-server",
                Fate::Injected {
                    port: 5557,
                    h2: true,
                },
            ),
            (
                "argocd-notifications-controller",
                Fate::LeftAlone("shows no sign of HTTP"),
            ),
            ("argocd-redis", Fate::LeftAlone("port 6379 is Redis's")),
            (
                "argocd-repo-server",
                Fate::LeftAlone("no port shows it speaks HTTP"),
            ),
            // 8080 serves HTTP and TLS alike (Service ports http and https): the proxy
            // cannot read the TLS half.
            ("argocd-server", Fate::LeftAlone("speaks TLS")),
            (
                "argocd-application-controller",
                Fate::LeftAlone("shows no sign of HTTP"),
            ),
        ],
    );
    // The NetworkPolicies that let ingress reach 7000 and 5557 let it reach the proxy too.
    for (policy, app) in [
        ("argocd-applicationset-controller-network-policy", 7000),
        ("argocd-dex-server-network-policy", 5557),
    ] {
        let np = after
            .iter()
            .find(|d| kind(d) == "NetworkPolicy" && name(d) == policy)
            .unwrap();
        let rule = seq(&np["spec"]["ingress"])
            .iter()
            .find(|r| seq(&r["ports"]).iter().any(|p| p["port"] == app))
            .unwrap();
        assert!(
            seq(&rule["ports"]).iter().any(|p| p["port"] == 15080),
            "{policy}: {rule:?}"
        );
    }
    let redis_policy = after
        .iter()
        .find(|d| name(d) == "argocd-redis-network-policy")
        .unwrap();
    assert!(!format!("{redis_policy:?}").contains("15080"));
}

#[test]
fn ingress_nginx_helm_rendered_http_through_the_proxy_tls_and_webhook_untouched() {
    let input = fixture(INGRESS_NGINX);
    let after = check_corpus(
        &input,
        &[],
        &[
            ("ingress-nginx-controller", inj(80)),
            (
                "ingress-nginx-admission-create",
                Fate::LeftAlone("no container port"),
            ),
            (
                "ingress-nginx-admission-patch",
                Fate::LeftAlone("no container port"),
            ),
        ],
    );
    let controller = after
        .iter()
        .find(|d| kind(d) == "Service" && name(d) == "ingress-nginx-controller")
        .unwrap();
    let targets: Vec<&Value> = seq(&controller["spec"]["ports"])
        .iter()
        .map(|p| &p["targetPort"])
        .collect();
    // http (appProtocol http) by name: the proxy took the name; https stays the app's.
    assert_eq!(targets, [&Value::from("http"), &Value::from("https")]);
}

fn one_port(port: u16, service_name: &str, app_protocol: Option<&str>) -> String {
    let app_protocol = app_protocol.map_or(String::new(), |p| format!("\n      appProtocol: {p}"));
    format!(
        "apiVersion: apps/v1
kind: Deployment
metadata:
  name: svc
spec:
  selector:
    matchLabels: {{app: svc}}
  template:
    metadata:
      labels: {{app: svc}}
    spec:
      containers:
        - name: svc
          image: example/svc:1
          ports:
            - containerPort: {port}
---
apiVersion: v1
kind: Service
metadata:
  name: svc
spec:
  selector: {{app: svc}}
  ports:
    - name: \"{service_name}\"
      port: {port}{app_protocol}
"
    )
}

fn run_library(input: &str, settings: &idemproxy_kube::Settings) -> idemproxy_kube::Injected {
    idemproxy_kube::inject_manifests(input, settings, &idemproxy_kube::Options::default())
        .expect("inject")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// A well-known port of a database, broker or other protocol that is not
    /// HTTP is never taken: whatever the Service calls it, even `http`, even
    /// with `appProtocol: http`, and even when the operator names it.
    #[test]
    fn a_well_known_non_http_port_is_never_taken(
        which in 0..idemproxy_kube::ports::NOT_HTTP_PORTS.len(),
        name in prop_oneof![
            Just("http".to_string()), Just("web".to_string()), Just("grpc".to_string()),
            Just("pg".to_string()), Just("client".to_string()), "[a-z][a-z0-9-]{0,13}",
        ],
        app_protocol in prop_oneof![Just(None), Just(Some("http")), Just(Some("grpc"))],
        explicit in any::<bool>(),
    ) {
        let (port, _) = idemproxy_kube::ports::NOT_HTTP_PORTS[which];
        let input = one_port(port, &name, app_protocol);
        let mut settings = idemproxy_kube::Settings::default();
        if explicit {
            settings.port = Some(idemproxy_kube::PortRef::Number(port));
        }
        let done = run_library(&input, &settings);
        prop_assert_eq!(done.injected, 0, "{:?}", done.notes);
        prop_assert_eq!(done.output, input);
    }

    /// Any other port is taken only with evidence: a name that starts with
    /// http, grpc, h2c or web (not https), or appProtocol http, h2c or grpc.
    #[test]
    fn another_port_is_taken_only_with_evidence(
        port in 1024u16..60000,
        name in "[a-z][a-z0-9-]{0,13}",
        app_protocol in prop_oneof![Just(None), Just(Some("http")), Just(Some("tcp")), Just(Some("https"))],
    ) {
        prop_assume!(idemproxy_kube::ports::well_known(port).is_none());
        prop_assume!(!(15080..=15090).contains(&port) && port != 9901);
        let input = one_port(port, &name, app_protocol);
        let done = run_library(&input, &idemproxy_kube::Settings::default());
        let by_name = ["http", "grpc", "h2c", "web"].iter().any(|p| name.starts_with(p))
            && !["https", "grpcs"].iter().any(|p| name.starts_with(p))
            && !["tcp", "udp", "redis", "mongo", "mysql", "maria", "postgres", "pg", "kafka",
                "amqp", "mqtt", "nats", "ldap", "smtp", "memcache", "cql"]
                .iter()
                .any(|p| name.starts_with(p));
        let evidence = match app_protocol {
            Some("http") => true,
            Some(_) => false,
            None => by_name,
        };
        prop_assert_eq!(done.injected, usize::from(evidence), "{} {:?}: {:?}", name, app_protocol, done.notes);
    }
}

/// The ports the issue found taken over by name before: each stays the app's.
#[test]
fn databases_and_brokers_named_anything_keep_their_ports() {
    for (port, name) in [
        (5432, "pg"),
        (3306, "mariadb"),
        (9092, "kafka"),
        (5672, "amqp"),
        (11211, "memcache"),
        (2181, "client"),
        (9042, "cql"),
        (4222, "nats"),
        (1883, "mqtt"),
        (389, "ldap"),
        (25, "smtp"),
        (9300, "transport"),
    ] {
        let input = one_port(port, name, None);
        let (output, stderr) = injected(&[], &input);
        assert_eq!(output, input, "{port} {name}");
        assert!(stderr.contains("left as it was"), "{stderr}");
        let (output, _) = injected(&["--port", &port.to_string()], &input);
        assert_eq!(output, input, "--port {port}");
    }
}

const POD_WITH: &str = "apiVersion: v1
kind: Pod
metadata:
  name: p
spec:
  EXTRA
  containers:
    - name: app
      image: example/app:1
      ports:
        - name: http
          containerPort: 8080
";

#[test]
fn pods_that_cannot_take_the_sidecar_are_left_unchanged_with_a_note() {
    for (extra, why) in [
        (
            "initContainers:\n    - name: idemproxy\n      image: someone/else:1\n  ",
            "not the idemproxy sidecar",
        ),
        ("os:\n    name: windows\n  ", "a windows pod"),
    ] {
        let input = POD_WITH.replace("EXTRA\n  ", extra);
        let (output, stderr) = injected(&[], &input);
        assert_eq!(output, input);
        assert!(stderr.contains(why), "{stderr}");
    }
    // A regular container by that name.
    let input = POD_WITH.replace(
        "EXTRA\n  containers:\n",
        "containers:\n    - name: idemproxy\n      image: someone/else:1\n",
    );
    let (output, stderr) = injected(&[], &input);
    assert_eq!(output, input);
    assert!(
        stderr.contains("already has a container named \"idemproxy\""),
        "{stderr}"
    );
}

const SHARED_WITH_OTHER_KIND: &str = "apiVersion: apps/v1
kind: Deployment
metadata:
  name: api
spec:
  selector:
    matchLabels: {app: api}
  template:
    metadata:
      labels: {app: api}
    spec:
      containers:
        - name: api
          image: example/api:1
          ports:
            - {name: http, containerPort: 8080}
---
apiVersion: v1
kind: Service
metadata:
  name: api
spec:
  selector: {app: api}
  ports:
    - {name: http, port: 80, targetPort: 8080}
---
OTHER";

const RC: &str = "apiVersion: v1
kind: ReplicationController
metadata:
  name: api-legacy
spec:
  selector: {app: api}
  template:
    metadata:
      labels: {app: api, generation: old}
    spec:
      containers:
        - name: api
          image: example/api:0
          ports:
            - {name: http, containerPort: 8080}
";

const ROLLOUT: &str = "apiVersion: argoproj.io/v1alpha1
kind: Rollout
metadata:
  name: api-rollout
spec:
  workloadRef:
    apiVersion: apps/v1
    kind: Deployment
    name: api
  strategy:
    canary: {}
";

const OTHER_SERVICE: &str = "---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  selector:
    matchLabels: {app: web}
  template:
    metadata:
      labels: {app: web}
    spec:
      containers:
        - name: web
          image: example/web:1
          ports:
            - {name: http, containerPort: 3000}
";

#[test]
fn a_service_that_also_selects_pods_of_another_kind_is_not_rewired() {
    for (other, owner) in [
        (RC, "ReplicationController api-legacy"),
        (ROLLOUT, "Rollout api-rollout"),
    ] {
        let input = SHARED_WITH_OTHER_KIND.replace("OTHER", other);
        let out = inject(&[], &input);
        assert_eq!(out.status.code(), Some(2), "{owner}");
        assert!(out.stdout.is_empty());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("Service api") && stderr.contains(owner),
            "{stderr}"
        );
        // --only leaves the Service's workloads out: the rest is injected.
        let input = format!("{input}{OTHER_SERVICE}");
        let (output, _) = injected(&["--only", "deploy/web"], &input);
        let after = documents(&output);
        let web = after.iter().find(|d| name(d) == "web").unwrap();
        assert!(sidecar(web).is_some());
        let api = after
            .iter()
            .find(|d| kind(d) == "Deployment" && name(d) == "api")
            .unwrap();
        assert!(sidecar(api).is_none());
    }
}

#[test]
fn every_list_kind_is_unwrapped() {
    let deployment = documents(&one_port(8080, "http", None)).remove(0);
    let service = documents(&one_port(8080, "http", None)).remove(1);
    let typed = serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "DeploymentList",
        "items": [deployment],
    });
    let nested = serde_json::json!({
        "apiVersion": "v1",
        "kind": "List",
        "items": [typed.clone(), service],
    });
    for input in [
        serde_norway::to_string(&typed).unwrap(),
        serde_norway::to_string(&nested).unwrap(),
        serde_json::to_string_pretty(&typed).unwrap(),
    ] {
        let (output, stderr) = injected(&[], &input);
        assert!(stderr.contains("injected: port 8080"), "{stderr}");
        assert!(output.contains("idemproxy"), "{output}");
        if input.starts_with('{') {
            let v: serde_json::Value = serde_json::from_str(&output).unwrap();
            assert!(v["kind"].as_str().unwrap().ends_with("List"), "{v}");
        } else {
            assert_valid(&output);
        }
    }
}

/// The docs' webhook walkthrough, followed from a clean checkout: each file
/// it applies exists and validates strict for 1.29 and 1.37; the pod the
/// injector would patch (the same change as `inject`, without its Services)
/// gets the sidecar; and every object that pod and its sidecar refer to —
/// the ConfigMap, the Secret, the store's Service — is made by a step of the
/// walkthrough. `deploy/build-image.sh --no-build` points every image
/// reference at one image.
#[test]
fn the_webhook_walkthrough_makes_every_object_the_pod_needs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let docs = std::fs::read_to_string(root.join("docs/kubernetes.md")).unwrap();
    let walk = docs
        .split("{#walkthrough}")
        .nth(1)
        .and_then(|t| t.split("```sh\n").nth(1))
        .and_then(|t| t.split("```").next())
        .expect("the walkthrough's commands");
    let mut applied = Vec::new();
    let mut secrets = Vec::new();
    for line in walk.lines().filter(|l| !l.starts_with('#')) {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let Some(i) = words.iter().position(|w| *w == "-k" || *w == "-f") {
            let path = words[i + 1];
            if !path.starts_with("https://") {
                assert!(root.join(path).exists(), "{path} (from: {line})");
                applied.push(path.to_owned());
            }
        }
        if let Some(i) = words.windows(2).position(|w| w == ["secret", "generic"]) {
            secrets.push(words[i + 2].to_owned());
        }
    }
    assert!(
        applied.contains(&"deploy/kubernetes/injector".to_owned()),
        "{applied:?}"
    );
    assert_eq!(secrets, ["idemproxy-redis"]);
    let example = root.join("deploy/kubernetes/injector/example");
    let read = |f: &str| std::fs::read_to_string(example.join(f)).unwrap();
    let manifests = [
        "namespace.yaml",
        "redis.yaml",
        "orders.yaml",
        "networkpolicy.yaml",
    ]
    .map(read)
    .join("---\n");
    assert_valid(&manifests);
    let objects = documents(&manifests);
    let has = |k: &str, n: &str| objects.iter().any(|d| kind(d) == k && name(d) == n);
    let ns = objects.iter().find(|d| kind(d) == "Namespace").unwrap();
    assert_eq!(ns["metadata"]["labels"]["idemproxy.dev/inject"], "enabled");
    let kustomization = read("kustomization.yaml");
    assert!(
        kustomization.contains("name: idemproxy-config")
            && kustomization.contains("- idemproxy.toml")
    );
    // The injector's change, to the Deployment's pod as the API server sends it.
    let orders = objects.iter().find(|d| kind(d) == "Deployment").unwrap();
    let mut pod = template(orders).clone();
    let outcome =
        idemproxy_kube::inject_pod(&mut pod, None, &[], &idemproxy_kube::Settings::default())
            .unwrap();
    assert!(
        matches!(outcome, idemproxy_kube::Injection::Injected(_)),
        "{outcome:?}"
    );
    let spec = &pod["spec"];
    for v in seq(&spec["volumes"]) {
        if let Some(cm) = v["configMap"]["name"].as_str() {
            assert!(
                cm == "idemproxy-config" || has("ConfigMap", cm),
                "ConfigMap {cm}"
            );
        }
    }
    let containers = seq(&spec["initContainers"])
        .iter()
        .chain(seq(&spec["containers"]));
    for c in containers {
        for e in seq(&c["env"]) {
            if let Some(s) = e["valueFrom"]["secretKeyRef"]["name"].as_str() {
                assert!(secrets.iter().any(|x| x == s), "Secret {s}");
            }
        }
    }
    for d in &objects {
        for v in seq(&template(d)["spec"]["volumes"]) {
            if let Some(s) = v["secret"]["secretName"].as_str() {
                assert!(secrets.iter().any(|x| x == s), "Secret {s} of {}", name(d));
            }
        }
    }
    // The store the configuration names is a Service of the namespace.
    let toml = read("idemproxy.toml");
    let host = toml
        .lines()
        .find_map(|l| l.trim().strip_prefix("url = \"redis://"))
        .and_then(|u| u.split(':').next())
        .expect("a redis url");
    assert!(has("Service", host), "the store {host}");
    // The sidecar's arguments with that file are a valid configuration.
    let sidecar = &seq(&spec["initContainers"])[0];
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), &toml).unwrap();
    let args: Vec<String> = seq(&sidecar["args"])
        .iter()
        .filter_map(Value::as_str)
        .map(|a| {
            if a.ends_with(".toml") {
                file.path().display().to_string()
            } else {
                a.to_owned()
            }
        })
        .collect();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(&args)
        .arg("--check")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // One command points every image reference at the image you pushed.
    let copy = copy_of_deploy();
    let out = std::process::Command::new("bash")
        .arg(copy.path().join("deploy/build-image.sh"))
        .args(["--no-build", "registry.example.com/team/idemproxy:9.9.9"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut named = 0;
    for dir in [
        "deploy/kubernetes",
        "deploy/kubernetes/injector",
        "deploy/kubernetes/injector/example",
    ] {
        for entry in std::fs::read_dir(copy.path().join(dir)).unwrap() {
            let path = entry.unwrap().path();
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            assert!(
                !text.contains("ghcr.io/idemproxy/idemproxy"),
                "{}",
                path.display()
            );
            named += text
                .matches("registry.example.com/team/idemproxy:9.9.9")
                .count();
        }
    }
    // The demo's two containers, the injector, the image it gives sidecars, the example API.
    assert!(named >= 5, "{named}");
}

/// A policy that lets monitoring reach port 8080 of every backend pod: 8080
/// is `a`'s app port but `b`'s metrics port. Opening the proxy's port (15080
/// in both) would let monitoring reach `b`'s API: left as it was, with a
/// note. A policy that allows `a`'s port through a range is opened.
#[test]
fn network_policies_are_opened_only_where_that_opens_nothing_more() {
    let input = fixture("ours/policy-widening.yaml");
    let (output, stderr) = injected(&[], &input);
    assert_valid(&output);
    let after = documents(&output);
    let widening = after.iter().find(|d| name(d) == "from-monitoring").unwrap();
    assert!(!format!("{widening:?}").contains("15080"), "{widening:?}");
    assert!(
        stderr.contains("NetworkPolicy shop/from-monitoring): left as it was")
            && stderr.contains("Deployment shop/b"),
        "{stderr}"
    );
    let range = after.iter().find(|d| name(d) == "range").unwrap();
    assert!(
        seq(&range["spec"]["ingress"][0]["ports"])
            .iter()
            .any(|p| p["port"] == 15080),
        "{range:?}"
    );
    let input = fixture("ours/policy-range.yaml");
    let (output, _) = injected(&[], &input);
    let after = documents(&output);
    let policy = after.iter().find(|d| kind(d) == "NetworkPolicy").unwrap();
    let ports = seq(&policy["spec"]["ingress"][0]["ports"]);
    assert!(ports.iter().any(|p| p["port"] == 15080), "{ports:?}");
    // Injecting again changes nothing.
    let (again, _) = injected(&[], &output);
    assert_eq!(again, output);
}

/// TLS ports and ports a container names as something else are never taken,
/// even when chosen: the proxy cannot read TLS.
#[test]
fn tls_and_named_non_http_container_ports_are_never_taken() {
    let pod = |name: Option<&str>, port: u16| {
        let name = name.map_or(String::new(), |n| format!("name: {n}, "));
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: p}}\nspec:\n  containers:\n    - name: app\n      image: a\n      ports: [{{{name}containerPort: {port}}}]\n"
        )
    };
    for (name, port, args) in [
        (Some("https"), 8443, vec!["--port", "8443"]),
        (Some("https"), 8443, vec!["--port", "https"]),
        (Some("tcp-api"), 8080, vec!["--port", "8080"]),
        (None, 443, vec![]),
        (None, 8443, vec![]),
        (None, 6443, vec![]),
    ] {
        let input = pod(name, port);
        let (output, stderr) = injected(&args, &input);
        assert_eq!(output, input, "{name:?} {port} {args:?}: {stderr}");
        assert!(stderr.contains("left as it was"), "{stderr}");
    }
    // A clear-text HTTP port that happens to be 8443, named so: taken.
    let input = pod(Some("http"), 8443);
    let (_, stderr) = injected(&[], &input);
    assert!(stderr.contains("injected: port 8443"), "{stderr}");
}

/// `deploy/build-image.sh` takes only an image reference: anything that sed
/// or YAML would read as syntax is refused before a file is touched.
#[test]
fn build_image_refuses_what_is_not_an_image_reference() {
    let copy = copy_of_deploy();
    let marker = copy.path().join("pwned");
    let before =
        std::fs::read_to_string(copy.path().join("deploy/kubernetes/deployment.yaml")).unwrap();
    for bad in [
        format!("r/x:y;touch${{IFS}}{};#e", marker.display()),
        "r/x:y#e".to_owned(),
        "r/x:y&z".to_owned(),
        "r/x:y\nimage: evil".to_owned(),
        "nohost:1".to_owned(),
        "reg.io/a/b".to_owned(),
        // What registries and Kubernetes refuse (InvalidImageName).
        "reg.example.com/x/IdemProxy:1.0".to_owned(),
        "reg.example.com/x/..:1".to_owned(),
        "reg.example.com/x/y:.bad".to_owned(),
        "reg.example.com/x/y:-bad".to_owned(),
        format!("reg.example.com/x/y:{}", "t".repeat(129)),
    ] {
        let out = std::process::Command::new("bash")
            .arg(copy.path().join("deploy/build-image.sh"))
            .args(["--no-build", &bad])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
    }
    assert!(!marker.exists());
    // A flag after the image, or a second argument: refused, never a build
    // and a push of an image the caller meant only to point at.
    for args in [
        &["registry.example.com/team/idemproxy:1.0", "--no-build"][..],
        &[
            "--no-build",
            "registry.example.com/team/idemproxy:1.0",
            "extra",
        ][..],
        &["--no-bulid", "registry.example.com/team/idemproxy:1.0"][..],
    ] {
        let out = std::process::Command::new("bash")
            .arg(copy.path().join("deploy/build-image.sh"))
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("usage:"),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let after =
        std::fs::read_to_string(copy.path().join("deploy/kubernetes/deployment.yaml")).unwrap();
    assert_eq!(before, after);
    let run = |args: &[&str]| {
        std::process::Command::new("bash")
            .arg(copy.path().join("deploy/build-image.sh"))
            .args(args)
            .output()
            .unwrap()
    };
    // A digest is for pinning an image already pushed, never for a build.
    let digest = format!("@sha256:{}", "a".repeat(64));
    let out = run(&[&format!(
        "registry.example.com/team/idemproxy:1.2.3{digest}"
    )]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        before,
        std::fs::read_to_string(copy.path().join("deploy/kubernetes/deployment.yaml")).unwrap()
    );
    let out = run(&[
        "--no-build",
        "registry.example.com:5000/team/idemproxy:1.2.3",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A second run finds nothing to point (an earlier one did): refused, before
    // any build, rather than a success that changed nothing.
    let out = run(&["--no-build", "registry.example.com/team/idemproxy:2.0.0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("git checkout -- deploy/kubernetes"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pointed =
        std::fs::read_to_string(copy.path().join("deploy/kubernetes/deployment.yaml")).unwrap();
    assert!(pointed.contains("registry.example.com:5000/team/idemproxy:1.2.3"));
    // The pinned form the docs recommend, a tag and a digest.
    let fresh = copy_of_deploy();
    let pinned = format!("registry.example.com/team/idemproxy:1.2.3{digest}");
    let out = std::process::Command::new("bash")
        .arg(fresh.path().join("deploy/build-image.sh"))
        .args(["--no-build", &pinned])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pointed =
        std::fs::read_to_string(fresh.path().join("deploy/kubernetes/deployment.yaml")).unwrap();
    assert!(pointed.contains(&pinned), "{pointed}");
    // The docs' two steps: a tag first (the build), then that tag pinned by
    // its digest, in manifests that name the tag now.
    let twice = copy_of_deploy();
    let script = twice.path().join("deploy/build-image.sh");
    for image in ["registry.example.com/team/idemproxy:1.2.3", &pinned] {
        let out = std::process::Command::new("bash")
            .arg(&script)
            .args(["--no-build", image])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{image}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let pointed =
        std::fs::read_to_string(twice.path().join("deploy/kubernetes/deployment.yaml")).unwrap();
    assert!(pointed.contains(&pinned), "{pointed}");
    assert_eq!(
        pointed.matches("idemproxy:1.2.3").count(),
        pointed.matches(&pinned).count(),
        "every reference pinned: {pointed}"
    );
    // Only whole references are pinned: not the end of a longer name.
    let other = copy_of_deploy();
    let script = other.path().join("deploy/build-image.sh");
    let run = |image: &str| {
        std::process::Command::new("bash")
            .arg(&script)
            .args(["--no-build", image])
            .output()
            .unwrap()
    };
    assert!(run("myreg.io/team/idemproxy:0.1").status.success());
    let out = run(&format!("reg.io/team/idemproxy:0.1{digest}"));
    assert_eq!(out.status.code(), Some(2), "a tag no manifest names whole");
    let pointed =
        std::fs::read_to_string(other.path().join("deploy/kubernetes/deployment.yaml")).unwrap();
    assert!(!pointed.contains("sha256"), "{pointed}");
    // A name registries refuse for its length.
    let out = run(&format!("reg.io/{}:1", "a".repeat(300)));
    assert_eq!(out.status.code(), Some(2));
}

/// A copy of `deploy/` in a temporary directory, for `deploy/build-image.sh` to rewrite.
fn copy_of_deploy() -> tempfile::TempDir {
    let copy = tempfile::tempdir().unwrap();
    let status = std::process::Command::new("cp")
        .args(["-r", "deploy"])
        .arg(copy.path())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(status.success());
    copy
}
