//! `idemproxy inject` on manifests written elsewhere (tests/fixtures/kubernetes): valid for
//! Kubernetes 1.29 and 1.37, every Service through the proxy, the applications untouched.

mod support;

use std::path::Path;
use std::process::Command;

use serde_norway::Value;

use support::kube::*;

const MICROSERVICES: &str = "microservices-demo/kubernetes-manifests.yaml";

#[test]
fn microservices_demo_comes_out_valid_with_every_service_through_the_proxy() {
    let input = fixture(MICROSERVICES);
    let (output, stderr) = injected(&[], &input);
    assert_valid(&output);
    let (before, after) = (documents(&input), documents(&output));
    assert_eq!(before.len(), after.len(), "no document added or lost");
    let deployments: Vec<(&Value, &Value)> = before
        .iter()
        .zip(&after)
        .filter(|(b, _)| kind(b) == "Deployment")
        .collect();
    assert_eq!(deployments.len(), 12);
    let mut injected = 0;
    for (b, a) in &deployments {
        assert_apps_unchanged(b, a);
        let Some(sidecar) = sidecar(a) else {
            // The Redis cache (a Service port named tcp-redis) and the load
            // generator (no port at all) are left alone, with a note.
            assert!(
                ["redis-cart", "loadgenerator"].contains(&name(a)),
                "{}",
                name(a)
            );
            assert_eq!(b, a);
            assert!(
                stderr.contains(&format!("(Deployment {}): left as it was", name(a))),
                "{stderr}"
            );
            continue;
        };
        injected += 1;
        assert_eq!(
            seq(&template(a)["spec"]["initContainers"])[0]["name"],
            "idemproxy",
            "the sidecar comes first"
        );
        assert_eq!(sidecar["restartPolicy"], "Always");
        // gRPC services (Service ports named grpc) are forwarded over HTTP/2; the frontend over HTTP/1.1.
        let args: Vec<&str> = seq(&sidecar["args"])
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let h2 = args.windows(2).any(|w| w == ["--upstream-protocol", "h2c"]);
        assert_eq!(h2, name(a) != "frontend", "{}: {args:?}", name(a));
        let app_port = seq(&template(b)["spec"]["containers"][0]["ports"])[0]["containerPort"]
            .as_u64()
            .unwrap();
        assert!(
            args.contains(&format!("http://127.0.0.1:{app_port}").as_str()),
            "{args:?}"
        );
    }
    assert_eq!(injected, 10);
    // frontend has two Services (frontend, frontend-external); every other injected one has one.
    assert_eq!(assert_services_reach_the_proxy(&after), 11);
    // The redis Service still reaches Redis, by its own number.
    let redis = after
        .iter()
        .find(|d| kind(d) == "Service" && name(d) == "redis-cart")
        .unwrap();
    assert_eq!(redis["spec"]["ports"][0]["targetPort"], 6379);
}

#[test]
fn documents_left_alone_come_out_byte_for_byte() {
    let input = fixture(MICROSERVICES);
    let (output, _) = injected(&[], &input);
    let mut unchanged = 0;
    for piece in input.split_inclusive("\n---\n") {
        let v: Value = serde_norway::from_str(piece.trim_end_matches("---\n")).unwrap();
        if kind(&v) == "ServiceAccount" || name(&v) == "redis-cart" || name(&v) == "loadgenerator" {
            assert!(output.contains(piece), "changed:\n{piece}");
            unchanged += 1;
        }
    }
    assert!(unchanged >= 12, "{unchanged}");
    // The licence header and everything up to the first document too.
    let header = &input[..input.find("---\n").unwrap()];
    assert!(output.starts_with(header));
}

#[test]
fn a_second_injection_changes_nothing() {
    for input in [
        fixture(MICROSERVICES),
        example(&["web/guestbook/all-in-one/guestbook-all-in-one.yaml"]),
        example(&[
            "AI/vllm-deployment/vllm-deployment.yaml",
            "AI/vllm-deployment/vllm-service.yaml",
        ]),
    ] {
        let (once, _) = injected(&[], &input);
        assert_ne!(once, input);
        let (twice, stderr) = injected(&[], &once);
        assert!(twice == once, "the second injection changed the output");
        assert!(stderr.contains("already injected"), "{stderr}");
    }
}

#[test]
fn kubernetes_examples_guestbook_frontend_through_the_proxy_redis_untouched() {
    let input = example(&["web/guestbook/all-in-one/guestbook-all-in-one.yaml"]);
    let (output, stderr) = injected(&[], &input);
    assert_valid(&output);
    let (before, after) = (documents(&input), documents(&output));
    for (b, a) in before
        .iter()
        .zip(&after)
        .filter(|(b, _)| kind(b) == "Deployment")
    {
        assert_apps_unchanged(b, a);
        // Redis behind Services whose unnamed ports are 6379: never taken.
        assert_eq!(sidecar(a).is_some(), name(a) == "frontend", "{}", name(a));
    }
    assert!(
        stderr.contains("Deployment redis-master): left as it was"),
        "{stderr}"
    );
    // The frontend Service had no targetPort (port 80 → 80): now it names the proxy's port.
    assert_eq!(assert_services_reach_the_proxy(&after), 1);
    let frontend = after
        .iter()
        .find(|d| kind(d) == "Service" && name(d) == "frontend")
        .unwrap();
    assert_eq!(frontend["spec"]["ports"][0]["targetPort"], 15080);
}

#[test]
fn kubernetes_examples_vllm_port_only_the_service_names() {
    // The container declares no port; the Service targets 8080 by number.
    let input = example(&[
        "AI/vllm-deployment/vllm-deployment.yaml",
        "AI/vllm-deployment/vllm-service.yaml",
    ]);
    let (output, _) = injected(&[], &input);
    assert_valid(&output);
    let after = documents(&output);
    assert_eq!(assert_services_reach_the_proxy(&after), 1);
    let args = &sidecar(&after[0]).unwrap()["args"];
    assert!(
        seq(args).iter().any(|a| a == "http://127.0.0.1:8080"),
        "{args:?}"
    );
}

#[test]
fn kubernetes_examples_tf_serving_the_port_named_grpc_unless_another_is_chosen() {
    let input = example(&[
        "AI/model-serving-tensorflow/deployment.yaml",
        "AI/model-serving-tensorflow/service.yaml",
    ]);
    // Only the Service port named grpc shows it speaks HTTP (h2c); "rest" says nothing.
    let (output, stderr) = injected(&[], &input);
    assert_valid(&output);
    assert!(stderr.contains("injected: port 8500"), "{stderr}");
    let after = documents(&output);
    let args = &sidecar(&after[0]).unwrap()["args"];
    assert!(seq(args).iter().any(|a| a == "h2c"), "{args:?}");
    // --port picks REST; the gRPC port stays the application's own.
    let (output, _) = injected(&["--port", "8501"], &input);
    assert_valid(&output);
    let after = documents(&output);
    let svc = &after[1];
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], 8500);
    assert_eq!(svc["spec"]["ports"][1]["targetPort"], 15080);
    let spec = &template(&after[0])["spec"];
    assert_eq!(
        reached(spec, &svc["spec"]["ports"][1]).unwrap()["name"],
        "idemproxy"
    );
    assert_eq!(
        reached(spec, &svc["spec"]["ports"][0]).unwrap()["name"],
        "tensorflow-serving"
    );
}

#[test]
fn kubernetes_examples_cassandra_is_left_alone() {
    let input = example(&[
        "databases/cassandra/cassandra-service.yaml",
        "databases/cassandra/cassandra-statefulset.yaml",
    ]);
    let (output, stderr) = injected(&[], &input);
    assert_eq!(output, input);
    assert!(
        stderr.contains("StatefulSet cassandra): left as it was"),
        "{stderr}"
    );
}

const NAMED: &str = "apiVersion: apps/v1
kind: Deployment
metadata:
  name: api
  namespace: shop
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
            - name: http
              containerPort: 3000
---
apiVersion: v1
kind: Service
metadata:
  name: api
  namespace: shop
spec:
  selector: {app: api}
  ports:
    - name: http
      port: 80
      targetPort: http
";

#[test]
fn a_named_port_is_taken_over_by_the_proxy_and_the_app_port_renamed() {
    let (output, _) = injected(&[], NAMED);
    assert_valid(&output);
    let after = documents(&output);
    let spec = &template(&after[0])["spec"];
    assert_eq!(spec["containers"][0]["ports"][0]["name"], "app-http");
    assert_eq!(spec["initContainers"][0]["ports"][0]["name"], "http");
    // The Service targets by name: unchanged, and it now reaches the proxy.
    assert_eq!(after[1], documents(NAMED)[1]);
    assert_eq!(assert_services_reach_the_proxy(&after), 1);
}

#[test]
fn config_file_becomes_a_config_map_in_the_workloads_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("idemproxy.toml");
    let text = "[server]\nadmin_listen = \"0.0.0.0:9902\"\n[[routes]]\nname = \"orders\"\npath = \"/orders\"\n";
    std::fs::write(&config, text).unwrap();
    let (output, _) = injected(
        &[
            "--config",
            config.to_str().unwrap(),
            "--config-map",
            "api-idem",
        ],
        NAMED,
    );
    assert_valid(&output);
    let after = documents(&output);
    assert_eq!(after.len(), 3);
    let cm = &after[2];
    assert_eq!(kind(cm), "ConfigMap");
    assert_eq!(name(cm), "api-idem");
    assert_eq!(cm["metadata"]["namespace"], "shop");
    assert_eq!(cm["data"]["idemproxy.toml"], text);
    let spec = &template(&after[0])["spec"];
    assert_eq!(spec["volumes"][0]["configMap"]["name"], "api-idem");
    // The probes use the admin port the file names.
    assert_eq!(spec["initContainers"][0]["ports"][1]["containerPort"], 9902);
    // Given the ConfigMap in the input, it is not emitted twice.
    let (again, _) = injected(
        &[
            "--config",
            config.to_str().unwrap(),
            "--config-map",
            "api-idem",
        ],
        &output,
    );
    assert_eq!(again, output);
}

/// The README's minimal configuration (no `admin_listen`: loopback by
/// default) injects: the sidecar opens its admin port to the kubelet on its
/// command line, and the proxy accepts those arguments with that file.
#[test]
fn the_readme_minimal_configuration_injects() {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let section = readme
        .split("## A minimal configuration")
        .nth(1)
        .expect("the README's minimal configuration");
    let toml = section
        .split("```toml\n")
        .nth(1)
        .and_then(|t| t.split("```").next())
        .expect("its TOML block");
    assert!(!toml.contains("admin_listen"), "{toml}");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("idemproxy.toml");
    std::fs::write(&config, toml).unwrap();
    let (output, _) = injected(&["--config", config.to_str().unwrap()], NAMED);
    assert_valid(&output);
    let after = documents(&output);
    let sidecar = sidecar(&after[0]).expect("injected");
    let args: Vec<&str> = seq(&sidecar["args"])
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    let at = args
        .iter()
        .position(|a| *a == "--admin-listen")
        .expect("--admin-listen");
    assert_eq!(args[at + 1], "0.0.0.0:9901");
    assert_eq!(
        sidecar["readinessProbe"]["httpGet"]["port"],
        "idemproxy-admin"
    );
    // The proxy takes the file with the sidecar's arguments.
    let mut check: Vec<&str> = vec!["--config", config.to_str().unwrap()];
    check.extend(
        args.iter()
            .filter(|a| **a != "--config" && !a.ends_with(".toml")),
    );
    check.push("--check");
    let out = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(&check)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{check:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("0.0.0.0:9901"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn json_in_json_out() {
    let docs = documents(NAMED);
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": docs});
    let (output, _) = injected(&[], &serde_json::to_string(&list).unwrap());
    let out: serde_json::Value = serde_json::from_str(&output).expect("JSON out");
    assert_eq!(
        out["items"][0]["spec"]["template"]["spec"]["initContainers"][0]["name"],
        "idemproxy"
    );
    assert_valid(&output);
    // A single object left alone comes out as it came.
    let redis =
        "{\"apiVersion\": \"v1\", \"kind\": \"ConfigMap\", \"metadata\": {\"name\": \"x\"}}";
    assert_eq!(injected(&[], redis).0, redis);
}

#[test]
fn disabled_workloads_are_left_alone_with_a_note() {
    let input = NAMED.replace(
        "  namespace: shop\nspec:\n  selector:\n    matchLabels",
        "  namespace: shop\n  annotations:\n    idemproxy.dev/inject: disabled\nspec:\n  selector:\n    matchLabels",
    );
    assert_ne!(input, NAMED);
    let (output, stderr) = injected(&[], &input);
    assert_eq!(output, input);
    assert!(
        stderr.contains("idemproxy.dev/inject: disabled"),
        "{stderr}"
    );
}

#[test]
fn unreadable_input_exits_2_without_output() {
    // A good document first: nothing of it may be written.
    for garbage in [
        format!("{NAMED}---\nkind: [unclosed\n"),
        "{\"kind\": ".to_owned(),
        format!("{NAMED}---\n\tkey: tab\n"),
    ] {
        let out = inject(&[], &garbage);
        assert_eq!(out.status.code(), Some(2), "{garbage}");
        assert!(
            out.stdout.is_empty(),
            "partial output: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    let out = inject(&[], &format!("{NAMED}---\nkind: [unclosed\n"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("document 3"), "{stderr}");
    // A port annotation that names no port: exit 2, naming the document and the field.
    let input = NAMED.replace(
        "      labels: {app: api}\n    spec:",
        "      labels: {app: api}\n      annotations: {idemproxy.dev/port: grpc}\n    spec:",
    );
    let out = inject(&[], &input);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("document 1 (Deployment shop/api)")
            && stderr.contains("spec.template.metadata.annotations.idemproxy.dev/port"),
        "{stderr}"
    );
    // A file that does not exist.
    let out = inject(&["/nonexistent/manifests.yaml"], "");
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn the_shipped_kubernetes_config_is_accepted() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/config/kubernetes.toml");
    let (output, _) = injected(&["--config", config], NAMED);
    let after = documents(&output);
    assert_eq!(kind(&after[2]), "ConfigMap");
    assert_eq!(
        after[2]["data"]["idemproxy.toml"].as_str(),
        Some(std::fs::read_to_string(config).unwrap().as_str())
    );
}

/// Kubernetes reads YAML 1.1, where a plain `on`, `no`, `y`, `012` or `1:20`
/// is not a string: a rewritten document quotes them. PyYAML (YAML 1.1, as
/// kubernetes-validate reads it) sees the same values before and after.
#[test]
fn rewritten_documents_read_the_same_in_yaml_1_1() {
    let input = fixture("yaml-1.1-strings.yaml");
    let (output, _) = injected(&[], &input);
    assert!(sidecar(&documents(&output)[0]).is_some());
    assert_valid(&output);
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("in.yaml"), dir.path().join("out.yaml"));
    std::fs::write(&a, &input).unwrap();
    std::fs::write(&b, &output).unwrap();
    let script = "import sys, yaml\n\
                  a, b = (yaml.safe_load(open(p)) for p in sys.argv[1:])\n\
                  assert a['metadata'] == b['metadata'], (a['metadata'], b['metadata'])\n\
                  ca = a['spec']['template']['spec']['containers']\n\
                  cb = b['spec']['template']['spec']['containers']\n\
                  assert ca == cb, (ca, cb)\n";
    let out = Command::new(support::peer_python())
        .args(["-c", script])
        .arg(&a)
        .arg(&b)
        .output()
        .expect("python");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The arguments the sidecar is given start the proxy: `--check` with the
/// shipped ConfigMap file in place of the mounted one, for an HTTP/1.1 and a gRPC workload.
#[test]
fn the_sidecar_arguments_are_accepted_by_the_proxy() {
    let (output, _) = injected(&[], &fixture(MICROSERVICES));
    let after = documents(&output);
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/config/kubernetes.toml");
    for name_ in ["frontend", "adservice"] {
        let w = after
            .iter()
            .find(|d| kind(d) == "Deployment" && name(d) == name_)
            .unwrap();
        let args: Vec<String> = seq(&sidecar(w).unwrap()["args"])
            .iter()
            .map(|a| {
                a.as_str()
                    .unwrap()
                    .replace("/etc/idemproxy/idemproxy.toml", config)
            })
            .collect();
        let out = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .env_remove("IDEMPROXY_CONFIG")
            .args(&args)
            .arg("--check")
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("listen 0.0.0.0:15080"), "{stdout}");
    }
}

/// A Service added after the first injection targets the app's port by
/// number: the second run rewires it from the sidecar's arguments.
#[test]
fn a_service_added_after_injection_is_rewired_on_the_next_run() {
    let (once, _) = injected(&[], NAMED);
    let input = format!(
        "{once}---\napiVersion: v1\nkind: Service\nmetadata:\n  name: api-direct\n  namespace: shop\n\
         spec:\n  selector: {{app: api}}\n  ports:\n    - port: 8080\n      targetPort: 3000\n"
    );
    let (twice, stderr) = injected(&[], &input);
    assert!(stderr.contains("already injected"), "{stderr}");
    assert_valid(&twice);
    let after = documents(&twice);
    let svc = after.iter().find(|d| name(d) == "api-direct").unwrap();
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], 15080);
    assert_eq!(assert_services_reach_the_proxy(&after), 2);
    // And a third run changes nothing.
    assert_eq!(injected(&[], &twice).0, twice);
}

const WITH_HOST_PORT_AND_PROBES: &str = "apiVersion: apps/v1
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
            - name: http
              containerPort: 8080
              hostPort: 8080
          startupProbe:
            tcpSocket: {port: http}
          readinessProbe:
            httpGet: {path: /ready, port: http}
          livenessProbe:
            httpGet: {path: /live, port: 8080}
          lifecycle:
            postStart:
              httpGet: {path: /started, port: http}
        - name: other
          image: example/other:1
          readinessProbe:
            httpGet: {path: /ready, port: http}
";

#[test]
fn the_host_port_moves_to_the_proxy() {
    let (output, _) = injected(&[], WITH_HOST_PORT_AND_PROBES);
    assert_valid(&output);
    let docs = documents(&output);
    let spec = &template(&docs[0])["spec"];
    let app = &spec["containers"][0]["ports"][0];
    assert_eq!(app["name"], "app-http");
    assert!(app.get("hostPort").is_none(), "{app:?}");
    let proxy = &spec["initContainers"][0]["ports"][0];
    assert_eq!(proxy["hostPort"], 8080);
    assert_eq!(proxy["containerPort"], 15080);
}

#[test]
fn the_apps_probes_follow_the_renamed_port() {
    let (output, _) = injected(&[], WITH_HOST_PORT_AND_PROBES);
    let docs = documents(&output);
    let spec = &template(&docs[0])["spec"];
    let app = &spec["containers"][0];
    assert_eq!(app["startupProbe"]["tcpSocket"]["port"], "app-http");
    assert_eq!(app["readinessProbe"]["httpGet"]["port"], "app-http");
    assert_eq!(app["livenessProbe"]["httpGet"]["port"], 8080);
    assert_eq!(app["lifecycle"]["postStart"]["httpGet"]["port"], "app-http");
    // Another container's probes are its own: untouched.
    assert_eq!(
        spec["containers"][1]["readinessProbe"]["httpGet"]["port"],
        "http"
    );
}

#[test]
fn network_policy_opens_only_the_proxy_and_admin_ports() {
    let (plain, _) = injected(&[], NAMED);
    assert!(!plain.contains("NetworkPolicy"));
    let (output, _) = injected(&["--network-policy"], NAMED);
    assert_valid(&output);
    let after = documents(&output);
    let policies: Vec<&Value> = after
        .iter()
        .filter(|d| kind(d) == "NetworkPolicy")
        .collect();
    assert_eq!(policies.len(), 1);
    let np = policies[0];
    assert_eq!(name(np), "api-idemproxy");
    assert_eq!(np["metadata"]["namespace"], "shop");
    assert_eq!(np["spec"]["podSelector"]["matchLabels"]["app"], "api");
    assert_eq!(np["spec"]["policyTypes"][0], "Ingress");
    let ingress = seq(&np["spec"]["ingress"]);
    assert_eq!(ingress.len(), 1);
    assert!(ingress[0].get("from").is_none());
    let ports: Vec<u64> = seq(&ingress[0]["ports"])
        .iter()
        .map(|p| p["port"].as_u64().unwrap())
        .collect();
    assert_eq!(ports, [15080, 9901], "not the app's port 3000");
    // Idempotent: the policy of the first run is not emitted again.
    assert_eq!(injected(&["--network-policy"], &output).0, output);
}

#[test]
fn a_headless_service_gets_a_note() {
    let input = NAMED.replace(
        "spec:\n  selector: {app: api}",
        "spec:\n  clusterIP: None\n  selector: {app: api}",
    );
    assert_ne!(input, NAMED);
    let (_, stderr) = injected(&[], &input);
    assert!(stderr.contains("headless Service"), "{stderr}");
    let (_, stderr) = injected(&[], NAMED);
    assert!(!stderr.contains("headless"), "{stderr}");
}

/// Plain YAML 1.1 booleans and octals are strings to serde_norway (YAML 1.2):
/// a document that would be rewritten with one is refused; quoted, they stay strings.
#[test]
fn yaml_1_1_plain_values_in_a_rewritten_document_are_refused() {
    for (plain, value) in [
        ("      hostNetwork: yes\n", "yes"),
        (
            "      volumes:\n        - name: c\n          configMap: {name: c, defaultMode: 0644}\n",
            "0644",
        ),
    ] {
        let input = NAMED.replace("    spec:\n      containers:", &format!("    spec:\n{plain}      containers:"));
        assert_ne!(input, NAMED);
        let out = inject(&[], &input);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(out.stdout.is_empty());
        assert!(
            stderr.contains("document 1 (line 1") && stderr.contains(&format!("{value:?}")),
            "{stderr}"
        );
    }
    // The line is the input's: the second document starts on line 5, tty is on line 21.
    let input = format!(
        "{}---\n{}",
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: yes}\n",
        NAMED.replace(
            "image: example/api:1",
            "image: example/api:1\n          tty: on"
        )
    );
    let out = inject(&[], &input);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("document 2 (line 21)"), "{stderr}");
    // Quoted, "yes" is a string and stays one.
    let input = NAMED.replace(
        "image: example/api:1",
        "image: example/api:1\n          env: [{name: XA, value: \"yes\"}, {name: XB, value: '0644'}]",
    );
    let (output, _) = injected(&[], &input);
    assert_valid(&output);
    let docs = documents(&output);
    let env = &template(&docs[0])["spec"]["containers"][0]["env"];
    assert_eq!(env[0]["value"], "yes");
    assert_eq!(env[1]["value"], "0644");
    assert!(output.contains("value: \"yes\""), "{output}");
}

#[test]
fn merge_keys_are_applied() {
    let input = NAMED.replace(
        "        - name: api\n          image: example/api:1\n",
        "        - &base\n          name: api\n          image: example/api:1\n          env: [{name: A, value: a}]\n          ports:\n            - name: http\n              containerPort: 3000\n        - <<: *base\n          name: worker\n          ports: []\n",
    )
    .replacen("          ports:\n            - name: http\n              containerPort: 3000\n---", "---", 1);
    let (output, _) = injected(&[], &input);
    assert!(!output.contains("<<"), "{output}");
    assert_valid(&output);
    let docs = documents(&output);
    let spec = &template(&docs[0])["spec"];
    assert_eq!(spec["containers"][1]["name"], "worker");
    assert_eq!(spec["containers"][1]["image"], "example/api:1");
    assert_eq!(spec["containers"][1]["env"][0]["value"], "a");
}

const SHARED: &str = "apiVersion: apps/v1
kind: Deployment
metadata:
  name: blue
spec:
  selector:
    matchLabels: {app: web, colour: blue}
  template:
    metadata:
      labels: {app: web, colour: blue}
    spec:
      containers:
        - name: web
          image: example/web:1
          ports: [{containerPort: 8080}]
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: green
  annotations: {idemproxy.dev/inject: disabled}
spec:
  selector:
    matchLabels: {app: web, colour: green}
  template:
    metadata:
      labels: {app: web, colour: green}
    spec:
      containers:
        - name: web
          image: example/web:1
          ports: [{containerPort: 8080}]
---
apiVersion: v1
kind: Service
metadata:
  name: web
spec:
  selector: {app: web}
  ports:
    - port: 80
      targetPort: 8080
";

#[test]
fn a_service_shared_with_a_workload_left_alone_is_refused() {
    let out = inject(&[], SHARED);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(out.stdout.is_empty());
    assert!(
        stderr.contains("Service web")
            && stderr.contains("Deployment blue")
            && stderr.contains("Deployment green (left as it was)"),
        "{stderr}"
    );
    // Both injected: one Service, both through the proxy.
    let both = SHARED.replace("  annotations: {idemproxy.dev/inject: disabled}\n", "");
    let (output, _) = injected(&[], &both);
    assert_valid(&output);
    assert_eq!(assert_services_reach_the_proxy(&documents(&output)), 2);
    // Both injected, but on different proxy ports (green's pod uses 15080): refused.
    let apart = both.replacen(
        "ports: [{containerPort: 8080}]\n---\napiVersion: v1",
        "ports: [{containerPort: 8080}, {containerPort: 15080}]\n---\napiVersion: v1",
        1,
    );
    assert_ne!(apart, both);
    let out = inject(&["--port", "8080"], &apart);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("proxy port 15081"), "{stderr}");
}

#[test]
fn two_containers_naming_the_port_alike_are_left_alone() {
    let input = NAMED.replace(
        "              containerPort: 3000\n",
        "              containerPort: 3000\n        - name: metrics\n          image: example/metrics:1\n          ports:\n            - name: http\n              containerPort: 9100\n",
    );
    assert_ne!(input, NAMED);
    let (output, stderr) = injected(&["--port", "3000"], &input);
    assert_eq!(output, input);
    assert!(
        stderr.contains("several containers name a port \"http\""),
        "{stderr}"
    );
}
