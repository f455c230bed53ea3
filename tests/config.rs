//! Configuration: every shipped file loads, and each validation rule fails with file, place and key.

use std::time::Duration;

use idemproxy::config::{Backend, ByteSize, Config, HumanDuration, Overrides};
use idemproxy::policy::{Concurrent, FingerprintBody, KeyMode, KeySource, Pointer};
use proptest::prelude::*;

const BASE: &str = "[server]\nupstream = \"http://127.0.0.1:3000\"\n";

fn load(text: &str) -> Result<Config, String> {
    Config::from_toml(text, "test.toml", &Overrides::default()).map_err(|e| e.to_string())
}

/// Asserts that `text` is rejected with a message containing each of `parts`.
fn rejects(text: &str, parts: &[&str]) {
    let err = match load(text) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e,
    };
    for p in parts {
        assert!(err.contains(p), "error {err:?} should contain {p:?}");
    }
}

#[test]
fn every_shipped_config_file_loads() {
    let mut n = 0;
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/config")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            Config::load(Some(&path), &Overrides::default())
                .unwrap_or_else(|e| panic!("{} does not load: {e}", path.display()));
            n += 1;
        }
    }
    assert!(
        n >= 2,
        "config/ holds the reference and the quickstart files"
    );
}

#[test]
fn reference_config_resolves_defaults_and_overrides() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/config/idemproxy.toml");
    let c = Config::load(Some(path.as_ref()), &Overrides::default()).unwrap();
    assert_eq!(c.store.backend, Backend::Redis);
    let routes: Vec<_> = c.routes.iter().collect();
    assert_eq!(routes[0].name, "payments");
    assert_eq!(routes[0].policy.ttl, Duration::from_secs(48 * 3600));
    assert_eq!(
        routes[0].policy.lease,
        Duration::from_secs(30),
        "inherited from [defaults]"
    );
    assert_eq!(routes[1].policy.fingerprint_body, FingerprintBody::Json);
    assert_eq!(routes[2].policy.key, KeyMode::Optional);
    assert_eq!(routes[2].policy.concurrent, Concurrent::Wait);
    assert_eq!(routes[2].methods.len(), 3);
    assert!(c
        .routes
        .find(
            &http::Method::PATCH,
            &"/v1/orders/42".parse().unwrap(),
            &Default::default()
        )
        .is_some_and(|r| r.name == "orders"));
    assert!(c
        .routes
        .find(
            &http::Method::GET,
            &"/v1/payments".parse().unwrap(),
            &Default::default()
        )
        .is_none());
}

#[test]
fn defaults_without_a_file() {
    let c = Config::from_toml(
        "",
        "<none>",
        &Overrides {
            upstream: Some("http://127.0.0.1:3000".into()),
            ..Overrides::default()
        },
    )
    .unwrap();
    assert_eq!(c.server.listen, "0.0.0.0:8080");
    assert_eq!(c.server.admin_listen, "127.0.0.1:9901");
    assert_eq!(c.server.upstream_timeout, Duration::from_secs(30));
    assert_eq!(c.server.shutdown_grace, Duration::from_secs(20));
    assert_eq!(c.store.backend, Backend::Memory);
    assert_eq!(c.store.key_prefix, "idemproxy");
    assert_eq!(c.store.op_timeout, Duration::from_millis(500));
    assert!(c.routes.is_empty());
}

#[test]
fn overrides_win_and_redis_url_selects_redis() {
    let text = format!("{BASE}listen = \"127.0.0.1:1\"\n[store]\nbackend = \"memory\"\n");
    let c = Config::from_toml(
        &text,
        "t.toml",
        &Overrides {
            listen: Some("127.0.0.1:2".into()),
            upstream: Some("http://10.0.0.1:9".into()),
            redis_url: Some("redis://127.0.0.1:7000/1".into()),
            ..Overrides::default()
        },
    )
    .unwrap();
    assert_eq!(c.server.listen, "127.0.0.1:2");
    assert_eq!(c.server.upstream.to_string(), "http://10.0.0.1:9");
    assert_eq!(c.store.backend, Backend::Redis);
    assert_eq!(c.store.url, "redis://127.0.0.1:7000/1");
}

#[test]
fn unknown_keys_are_errors_with_line_and_column() {
    rejects(
        &format!("{BASE}lissten = \"x\"\n"),
        &["test.toml:3:1", "server.lissten", "unknown field"],
    );
    rejects(
        &format!("{BASE}[store]\nbackend = \"redis\"\nurll = \"x\"\n"),
        &["test.toml:5:1", "store.urll"],
    );
    rejects(
        &format!("{BASE}[[routes]]\nname = \"a\"\npath = \"/a\"\nttll = \"1s\"\n"),
        &["test.toml:6:1", "routes[0].ttll", "unknown field"],
    );
    rejects(&format!("{BASE}[extra]\n"), &["unknown field `extra`"]);
}

#[test]
fn upstream_is_required_and_checked() {
    rejects("", &["server.upstream", "required"]);
    rejects(
        "[server]\nupstream = \"https://x:1\"\n",
        &["test.toml:2:1", "server.upstream", "only http://"],
    );
    rejects(
        "[server]\nupstream = \"not a url\"\n",
        &["server.upstream", "invalid upstream URL"],
    );
    rejects(
        "[server]\nupstream = \"http://x:1/?a=1\"\n",
        &["a query is not allowed"],
    );
}

#[test]
fn listen_addresses_are_checked() {
    rejects(
        &format!("{BASE}listen = \"localhost\"\n"),
        &["server.listen", "invalid listen address"],
    );
    rejects(
        &format!("{BASE}admin_listen = \"1.2.3.4\"\n"),
        &["server.admin_listen"],
    );
}

#[test]
fn durations_are_human_and_positive() {
    rejects(
        &format!("{BASE}upstream_timeout = \"30\"\n"),
        &[
            "test.toml:3:20",
            "server.upstream_timeout",
            "a unit is required",
        ],
    );
    rejects(
        &format!("{BASE}[defaults]\nttl = \"24x\"\n"),
        &["test.toml:4:7", "defaults.ttl", "unknown unit \"x\""],
    );
    rejects(
        &format!("{BASE}[defaults]\nlease = \"0s\"\n"),
        &["defaults.lease", "greater than zero"],
    );
    rejects(
        &format!("{BASE}[defaults]\nlease = 30\n"),
        &["defaults.lease"],
    );
    rejects(
        &format!("{BASE}[store]\nop_timeout = \"\"\n"),
        &["store.op_timeout", "empty duration"],
    );
    assert_eq!(
        HumanDuration::parse("1m30s").unwrap().0,
        Duration::from_secs(90)
    );
    assert_eq!(
        HumanDuration::parse("250ms").unwrap().0,
        Duration::from_millis(250)
    );
    assert_eq!(
        HumanDuration::parse("1d").unwrap().0,
        Duration::from_secs(86400)
    );
    assert_eq!(HumanDuration::parse("2h30m").unwrap().to_string(), "150m");
}

#[test]
fn sizes_have_units_and_are_positive() {
    rejects(
        &format!("{BASE}[defaults]\nmax_request_body = \"1 Mb\"\n"),
        &["defaults.max_request_body", "unknown unit \"Mb\""],
    );
    rejects(
        &format!("{BASE}[defaults]\nmax_response_body = 0\n"),
        &["defaults.max_response_body", "greater than zero"],
    );
    rejects(
        &format!("{BASE}[defaults]\nmax_response_body = \"0KiB\"\n"),
        &["greater than zero"],
    );
    assert_eq!(ByteSize::parse("64KiB").unwrap().0, 65536);
    assert_eq!(ByteSize::parse("1KB").unwrap().0, 1000);
    assert_eq!(ByteSize::parse("1000").unwrap().0, 1000);
    assert_eq!(ByteSize::parse("2GiB").unwrap().0, 2 << 30);
    let c = load(&format!("{BASE}[defaults]\nmax_request_body = 2048\n")).unwrap();
    let _ = c;
}

#[test]
fn route_names_are_unique_and_required() {
    rejects(
        &format!("{BASE}[[routes]]\nname = \"a\"\npath = \"/a\"\n[[routes]]\nname = \"a\"\npath = \"/b\"\n"),
        &["test.toml:7:8", "routes[1].name", "duplicate route name \"a\""],
    );
    rejects(
        &format!("{BASE}[[routes]]\npath = \"/a\"\n"),
        &["routes[0].name", "needs a unique `name`"],
    );
    rejects(
        &format!("{BASE}[[routes]]\nname = \"a b\"\npath = \"/a\"\n"),
        &["routes[0].name", "invalid route name"],
    );
    rejects(
        &format!("{BASE}[[routes]]\nname = \"a\"\n"),
        &["routes[0].path", "needs a `path`"],
    );
}

#[test]
fn methods_and_paths_are_checked() {
    rejects(
        &format!(
            "{BASE}[[routes]]\nname = \"a\"\npath = \"/a\"\nmethods = [\"POST\", \"P OST\"]\n"
        ),
        &["routes[0].methods", "invalid HTTP method \"P OST\""],
    );
    rejects(
        &format!("{BASE}[[routes]]\nname = \"a\"\npath = \"/a\"\nmethods = []\n"),
        &["lists no methods"],
    );
    rejects(
        &format!("{BASE}[[routes]]\nname = \"a\"\npath = \"a\"\n"),
        &["routes[0].path", "must start with '/'"],
    );
    rejects(
        &format!("{BASE}[[routes]]\nname = \"a\"\npath = \"/a/{{x\"\n"),
        &["is not a parameter"],
    );
    rejects(
        &format!("{BASE}[[routes]]\nname = \"a\"\npath = \"/a/*/b\"\n"),
        &["whole last segment"],
    );
    // Lower-case methods are accepted and normalised.
    let c = load(&format!(
        "{BASE}[[routes]]\nname = \"a\"\npath = \"/a\"\nmethods = [\"put\"]\n"
    ))
    .unwrap();
    assert!(c
        .routes
        .find(
            &http::Method::PUT,
            &"/a".parse().unwrap(),
            &Default::default()
        )
        .is_some());
}

#[test]
fn policy_values_are_checked() {
    rejects(
        &format!("{BASE}[defaults]\nkey = \"sometimes\"\n"),
        &["defaults.key", "unknown variant `sometimes`"],
    );
    rejects(
        &format!("{BASE}[defaults]\nconcurrent = \"queue\"\n"),
        &["defaults.concurrent"],
    );
    rejects(
        &format!("{BASE}[defaults]\nrelease_statuses = [700]\n"),
        &["defaults.release_statuses", "invalid HTTP status 700"],
    );
    rejects(
        &format!("{BASE}[defaults]\nrelease_grpc_statuses = [17]\n"),
        &["defaults.release_grpc_statuses", "invalid gRPC status 17"],
    );
    rejects(
        &format!("{BASE}[defaults]\nscope_headers = [\"bad header\"]\n"),
        &["defaults.scope_headers", "invalid header name"],
    );
    rejects(
        &format!("{BASE}[defaults]\nmax_key_length = 0\n"),
        &["defaults.max_key_length", "1..=4096"],
    );
    rejects(
        &format!("{BASE}[defaults]\npath = \"/x\"\n"),
        &["defaults.path", "belongs in a [[routes]] entry"],
    );
    rejects(
        &format!("{BASE}[[routes]]\nname = \"a\"\npath = \"/a\"\nmode = \"audit\"\n"),
        &["test.toml:6:8", "routes[0].mode"],
    );
}

#[test]
fn store_values_are_checked() {
    rejects(
        &format!("{BASE}[store]\nbackend = \"redis\"\nurl = \"http://x\"\n"),
        &["store.url", "redis:// or rediss://"],
    );
    rejects(
        &format!("{BASE}[store]\nbackend = \"sqlite\"\n"),
        &["store.backend"],
    );
    rejects(
        &format!("{BASE}[store]\nkey_prefix = \"a b\"\n"),
        &["store.key_prefix"],
    );
    rejects(
        &format!("{BASE}[store]\nbackend = \"redis\"\nmode = \"cluster\"\n"),
        &["store.nodes", "seed node"],
    );
}

#[test]
fn bad_toml_syntax_names_the_place() {
    rejects(&format!("{BASE}[defaults\n"), &["test.toml:3:"]);
}

#[test]
fn an_upstream_error_is_at_the_upstream_line_even_after_upstream_timeout() {
    rejects(
        "[server]\nupstream_timeout = \"5s\"\nupstream = \"https://x:1\"\n",
        &["test.toml:3:1: server.upstream: invalid upstream URL: only http://"],
    );
    rejects(
        "[server]\nupstream = \"http://x:1\"\nadmin_listen = \"127.0.0.1:1\"\nlisten = \"nowhere\"\n",
        &["test.toml:4:1: server.listen: invalid listen address \"nowhere\""],
    );
}

#[test]
fn crlf_files_with_non_ascii_text_load_and_place_errors_exactly() {
    let valid = "# café ☕: the payments API\r\n[server]\r\nupstream = \"http://127.0.0.1:3000\"\r\n\r\n[[routes]]\r\nname = \"payments\" # é\r\npath = \"/v1/payments\"\r\nttl = \"48h\"\r\n";
    let c = load(valid).unwrap();
    let route = c.routes.iter().next().unwrap();
    assert_eq!(route.name, "payments");
    assert_eq!(route.path.as_str(), "/v1/payments");
    assert_eq!(route.policy.ttl, Duration::from_secs(48 * 3600));

    rejects(
        &valid.replace("\"48h\"", "\"48x\""),
        &["test.toml:8:7: routes[0].ttl: invalid duration \"48x\""],
    );
    rejects(
        &valid.replace("http://127.0.0.1:3000", "https://127.0.0.1:3000"),
        &["test.toml:3:1: server.upstream: "],
    );
    rejects(
        &valid.replace("[[routes]]", "[[routes]"),
        &["test.toml:5:9: "],
    );
    // Once made the loader slice inside the '☕' and panic.
    rejects(
        "[server]\r\n#\r\n# ☕\r\nupstream = \"https://x\"\r\n",
        &["test.toml:4:1: server.upstream: "],
    );
    // Columns count characters, not bytes: "café ☕" is 6 characters, 9 bytes.
    rejects(
        "store = { master_name = \"café ☕\", key_prefix = \"a b\" }\r\n[server]\r\nupstream = \"http://x:1\"\r\n",
        &["test.toml:1:35: store.key_prefix: invalid key prefix \"a b\""],
    );
    rejects(
        "[server]\r\nupstream = \"http://x:1\"\r\n[[routes]]\r\nname = \"café\"\r\npath = \"/a\"\r\n",
        &["test.toml:4:8: routes[0].name: invalid route name \"café\""],
    );
}

#[test]
fn a_bad_override_is_named_by_its_flag_and_env_var() {
    let error = |overrides: Overrides| match Config::from_toml(BASE, "test.toml", &overrides) {
        Ok(_) => panic!("accepted {overrides:?}"),
        Err(e) => e.to_string(),
    };
    let e = error(Overrides {
        upstream: Some("https://x:1".into()),
        ..Overrides::default()
    });
    assert!(
        e.starts_with("--upstream (IDEMPROXY_UPSTREAM): invalid upstream URL: only http://"),
        "{e}"
    );
    let e = error(Overrides {
        listen: Some("nowhere".into()),
        ..Overrides::default()
    });
    assert!(
        e.starts_with("--listen (IDEMPROXY_LISTEN): invalid listen address \"nowhere\""),
        "{e}"
    );
    let e = error(Overrides {
        redis_url: Some("http://user:secret@x".into()),
        ..Overrides::default()
    });
    assert!(
        e.starts_with("--redis-url (IDEMPROXY_REDIS_URL): invalid Redis URL"),
        "{e}"
    );
    assert!(!e.contains("secret"), "the URL may hold a password: {e}");
}

#[test]
fn route_headers_are_lowercased_and_sorted() {
    let c = load(&format!(
        "{BASE}[[routes]]\nname = \"a\"\npath = \"/a\"\nscope_headers = [\"X-Tenant\", \"Authorization\"]\n"
    ))
    .unwrap();
    let r = c.routes.iter().next().unwrap();
    let names: Vec<_> = r.policy.scope_headers.iter().map(|h| h.as_str()).collect();
    assert_eq!(names, ["authorization", "x-tenant"]);
}

/// The resolved key source of each route of `text`, as `--check` spells it.
fn key_sources(text: &str) -> Vec<String> {
    let c = load(text).unwrap_or_else(|e| panic!("{e}"));
    c.routes
        .iter()
        .map(|r| r.policy.key_from.to_string())
        .collect()
}

#[test]
fn key_from_resolves_per_route_and_follows_the_header() {
    let route = |name: &str, lines: &str| {
        format!("[[routes]]\nname = \"{name}\"\npath = \"/{name}\"\n{lines}\n")
    };
    let text = format!(
        "{BASE}{}{}{}{}{}{}",
        route("plain", ""),
        route("own-header", "header = \"X-Request-Key\""),
        route("github", "key_from = \"header:X-GitHub-Delivery\""),
        route("same", "key_from = \"header:Idempotency-Key\""),
        route("stripe", "key_from = \"json:/id\""),
        route("escaped", "key_from = \"json:/data/a~1b/m~0n/0\""),
    );
    assert_eq!(
        key_sources(&text),
        [
            "header:idempotency-key",
            "header:x-request-key",
            "header:x-github-delivery",
            "header:idempotency-key",
            "json:/id",
            "json:/data/a~1b/m~0n/0",
        ]
    );
    let c = load(&text).unwrap();
    let escaped = c.routes.iter().nth(5).unwrap();
    let KeySource::Json(pointer) = &escaped.policy.key_from else {
        panic!("{:?}", escaped.policy.key_from)
    };
    assert_eq!(pointer.tokens(), ["data", "a/b", "m~n", "0"]);
    assert_eq!(pointer, &Pointer::parse("/data/a~1b/m~0n/0").unwrap());

    // [defaults] is inherited; "header" is the route's own header, whatever it is.
    let text = format!(
        "{BASE}[defaults]\nkey_from = \"json:/id\"\n{}{}{}",
        route("inherits", ""),
        route(
            "back-to-header",
            "key_from = \"header\"\nheader = \"X-Key\""
        ),
        route("other", "key_from = \"header:X-Shopify-Webhook-Id\""),
    );
    assert_eq!(
        key_sources(&text),
        ["json:/id", "header:x-key", "header:x-shopify-webhook-id"]
    );
    let text = format!(
        "{BASE}[defaults]\nheader = \"X-Default\"\n{}{}",
        route("follows", "header = \"X-Route\""),
        route("default", ""),
    );
    assert_eq!(key_sources(&text), ["header:x-route", "header:x-default"]);
    let text = format!(
        "{BASE}[defaults]\nkey_from = \"header:X-Named\"\n{}",
        route("named", "header = \"X-Route\""),
    );
    assert_eq!(
        key_sources(&text),
        ["header:x-named"],
        "a named header stays named when the route changes `header`"
    );
}

#[test]
fn bad_key_from_values_are_errors_at_their_place() {
    // `key_from = ` is 11 characters: the value starts in column 12 of line 6.
    let route = |value: &str| {
        format!("{BASE}[[routes]]\nname = \"a\"\npath = \"/a\"\nkey_from = \"{value}\"\n")
    };
    for (value, message) in [
        ("cookie:x", "invalid key source \"cookie:x\""),
        ("Header", "invalid key source"),
        ("json", "invalid key source"),
        ("header:", "names no header"),
        ("header:bad name", "invalid header name \"bad name\""),
        ("header:X-Été", "invalid header name"),
        ("json:id", "starts with '/'"),
        ("json:", "names the whole body"),
        ("json:/a~2", "invalid JSON pointer \"/a~2\""),
        ("json:/a~", "'~' is written \"~0\""),
    ] {
        rejects(
            &route(value),
            &["test.toml:6:12", "routes[0].key_from", message],
        );
    }
    rejects(
        &format!("{BASE}[defaults]\nkey_from = \"json:/x~3\"\n"),
        &[
            "test.toml:4:12",
            "defaults.key_from",
            "invalid JSON pointer",
        ],
    );
    rejects(
        &format!("{BASE}[defaults]\nkey_from = 7\n"),
        &["test.toml:4:12", "defaults.key_from"],
    );
}

proptest! {
    #[test]
    fn any_duration_written_in_one_unit_roundtrips(n in 1u64..100_000, unit in 0usize..5) {
        let (suffix, ms) = [("ms", 1u64), ("s", 1000), ("m", 60_000), ("h", 3_600_000), ("d", 86_400_000)][unit];
        let d = HumanDuration::parse(&format!("{n}{suffix}")).unwrap();
        prop_assert_eq!(d.0, Duration::from_millis(n * ms));
        prop_assert_eq!(HumanDuration::parse(&d.to_string()).unwrap(), d);
    }

    #[test]
    fn config_loader_never_panics(text in "\\PC{0,200}") {
        let _ = load(&text);
    }

    #[test]
    fn an_error_is_placed_exactly_whatever_text_comes_before(
        comments in proptest::collection::vec("\\PC{0,12}", 0..5),
        crlf in any::<bool>(),
    ) {
        let nl = if crlf { "\r\n" } else { "\n" };
        let mut text: String = comments.iter().map(|c| format!("# {c}{nl}")).collect();
        text.push_str(&format!("[server]{nl}upstream_timeout = \"5s\"{nl}upstream = \"https://x:1\"{nl}"));
        let err = load(&text).unwrap_err();
        let place = format!("test.toml:{}:1: server.upstream: ", comments.len() + 3);
        prop_assert!(err.starts_with(&place), "{} in\n{}", err, text);
    }
}

/// The TOML inside the Kubernetes ConfigMap loads, and the pod's termination
/// grace covers the sidecar's `shutdown_grace` with a margin for the app's own
/// drain; no `sleep` lifecycle action (Kubernetes 1.29 drops it silently).
#[test]
fn kubernetes_configmap_holds_a_valid_config_aligned_with_the_pod() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kubernetes");
    let cm = std::fs::read_to_string(format!("{dir}/configmap.yaml")).unwrap();
    let toml: String = cm
        .lines()
        .skip_while(|l| !l.contains("idemproxy.toml: |"))
        .skip(1)
        .map(|l| l.strip_prefix("    ").unwrap_or(l.trim()))
        .collect::<Vec<_>>()
        .join("\n");
    let c = Config::from_toml(&toml, "configmap.yaml", &Overrides::default()).unwrap();
    assert!(!c.routes.is_empty());
    assert!(
        c.server.admin_listen.starts_with("0.0.0.0:"),
        "kubelet probes reach the pod IP"
    );
    let deployment = std::fs::read_to_string(format!("{dir}/deployment.yaml")).unwrap();
    // The kubelet probes from the node: a probe's `host: 127.0.0.1` is the
    // node's loopback, never the pod's.
    assert!(
        !deployment.lines().any(|l| l.trim() == "host: 127.0.0.1"),
        "a probe aimed at the node's loopback"
    );
    let number_after = |key: &str| -> u64 {
        let line = deployment
            .lines()
            .find(|l| l.trim_start().starts_with(key))
            .unwrap();
        line.split(':').nth(1).unwrap().trim().parse().unwrap()
    };
    let grace = number_after("terminationGracePeriodSeconds:");
    assert!(
        grace >= c.server.shutdown_grace.as_secs() + 10,
        "terminationGracePeriodSeconds {grace} must cover the app's drain and shutdown_grace {:?}",
        c.server.shutdown_grace
    );
    assert!(
        !deployment.contains("sleep:"),
        "the sleep action is off by default in 1.29 (the API server drops it)"
    );
}

#[test]
fn memory_bounds_are_checked() {
    rejects(
        &format!("{BASE}[[routes]]\nname = \"a\"\npath = \"/a\"\nmax_response_body = \"600MiB\"\n"),
        &["routes[0].max_response_body", "at most 512MiB"],
    );
    rejects(
        "[server]\nupstream = \"http://127.0.0.1:3000\"\nmax_buffered = \"2MiB\"\n[[routes]]\nname = \"a\"\npath = \"/a\"\nmax_request_body = \"4MiB\"\n",
        &["test.toml:7:20", "routes[0].max_request_body", "more than server.max_buffered"],
    );
    rejects(
        "[server]\nupstream = \"http://127.0.0.1:3000\"\nmax_buffered = \"512KiB\"\n",
        &["server.max_buffered", "at least 1MiB"],
    );
    rejects(
        "[server]\nupstream = \"http://127.0.0.1:3000\"\nworkers = -1\n",
        &["test.toml:3:11", "server.workers", "expected 0..=1024"],
    );
    let ok = "[server]\nupstream = \"http://127.0.0.1:3000\"\nmax_buffered = \"8MiB\"\nclient_write_timeout = \"5s\"\nidle_timeout = \"10s\"\nupstream_idle_timeout = \"500ms\"\nworkers = 1\n[store]\nmemory_limit = \"1MiB\"\n";
    let c = Config::from_toml(ok, "test.toml", &Overrides::default()).unwrap();
    assert_eq!(c.server.max_buffered, 8 << 20);
    assert_eq!(c.server.client_write_timeout, Duration::from_secs(5));
    assert_eq!(c.server.idle_timeout, Duration::from_secs(10));
    assert_eq!(c.server.upstream_idle_timeout, Duration::from_millis(500));
    assert_eq!(c.server.workers, 1);
    assert_eq!(c.store.memory_limit, 1 << 20);
    let d = Config::from_toml(
        "[server]\nupstream = \"http://127.0.0.1:3000\"\n",
        "test.toml",
        &Overrides::default(),
    )
    .unwrap();
    assert_eq!(
        (
            d.server.max_buffered,
            d.server.max_connections,
            d.server.max_header_bytes,
            d.server.workers
        ),
        (64 << 20, 256, 16 << 10, 0)
    );
    assert_eq!(d.store.memory_limit, 256 << 20);
}

#[test]
fn a_duration_without_a_unit_says_what_to_write() {
    rejects(
        &format!("{BASE}[defaults]\nttl = 3600\n"),
        &[
            "test.toml:4:7",
            "defaults.ttl",
            "\"3600s\"",
            "units: ms, s, m, h, d",
        ],
    );
    rejects(
        &format!("{BASE}[defaults]\nlease = 1.5\n"),
        &["defaults.lease", "a duration is a string with a unit"],
    );
    rejects(
        &format!("{BASE}[store]\nop_timeout = true\n"),
        &["store.op_timeout", "a duration string such as"],
    );
}

#[test]
fn a_route_that_can_never_match_is_an_error() {
    let two = |first: &str, second: &str| {
        format!("{BASE}[[routes]]\nname = \"a\"\n{first}\n\n[[routes]]\nname = \"b\"\n{second}\n")
    };
    for (first, second) in [
        ("path = \"/v1/payments\"", "path = \"/v1/payments\""),
        ("path = \"/v1/payments\"", "path = \"/v1/payments/\""),
        ("path = \"/v1/{id}\"", "path = \"/v1/payments\""),
        ("path = \"/v1/*\"", "path = \"/v1/orders/{id}/pay\""),
        (
            "path = \"/v1/payments\"\nmethods = [\"POST\", \"PUT\"]",
            "path = \"/v1//payments\"\nmethods = [\"PUT\"]",
        ),
    ] {
        rejects(
            &two(first, second),
            &[
                "routes[1].path",
                "route \"b\"",
                "can never match",
                "route \"a\"",
            ],
        );
    }
    // Overlapping but reachable: another method, a narrower route first, a path the first does not take.
    for (first, second) in [
        (
            "path = \"/v1/payments\"",
            "path = \"/v1/payments\"\nmethods = [\"PUT\"]",
        ),
        ("path = \"/v1/payments\"", "path = \"/v1/{id}\""),
        ("path = \"/v1/{id}\"", "path = \"/v1/*\""),
        ("path = \"/v1/payments\"", "path = \"/v1/payments/*\""),
    ] {
        load(&two(first, second)).unwrap_or_else(|e| panic!("{first} / {second}: {e}"));
    }
}

/// `lease_expiry` (docs/configuration.md#routes.lease_expiry): from
/// `[defaults]` or the route, checked like every policy value; with
/// `unknown_outcome` it decides what a vanished owner's key gets.
#[test]
fn lease_expiry_is_read_and_decides_with_unknown_outcome() {
    use idemproxy::policy::{DeadOwner, LeaseExpiry};
    let text = format!(
        "{BASE}[defaults]\nlease_expiry = \"re_execute\"\n\
         [[routes]]\nname = \"a\"\npath = \"/a\"\n\
         [[routes]]\nname = \"b\"\npath = \"/b\"\nlease_expiry = \"unknown_outcome\"\n\
         [[routes]]\nname = \"c\"\npath = \"/c\"\nlease_expiry = \"unknown_outcome\"\nunknown_outcome = \"release\"\n"
    );
    let c = load(&text).unwrap();
    let got: Vec<_> = c
        .routes
        .iter()
        .map(|r| (r.policy.lease_expiry, r.policy.dead_owner()))
        .collect();
    assert_eq!(
        got,
        [
            (LeaseExpiry::ReExecute, DeadOwner::ReExecute),
            (LeaseExpiry::UnknownOutcome, DeadOwner::StoreUnknown),
            (LeaseExpiry::UnknownOutcome, DeadOwner::ReExecute),
        ]
    );
    // The default: an unknown outcome, stored; kept `lease + ttl` in the store.
    let c = load(&format!("{BASE}[[routes]]\nname = \"a\"\npath = \"/a\"\n")).unwrap();
    let p = &c.routes.iter().next().unwrap().policy;
    assert_eq!(p.dead_owner(), DeadOwner::StoreUnknown);
    assert_eq!(p.reservation_hold(), p.lease + p.ttl);
    rejects(
        &format!("{BASE}[defaults]\nlease_expiry = \"retry\"\n"),
        &["defaults.lease_expiry", "unknown variant `retry`"],
    );
}
