//! The binary as an operator meets it: flags, env vars, exit codes, start-up and shutdown.

mod support;

use std::io::BufRead;
use std::process::{Command, Stdio};

use support::*;

fn idemproxy() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_idemproxy"));
    c.env_remove("IDEMPROXY_CONFIG")
        .env_remove("IDEMPROXY_UPSTREAM")
        .env_remove("IDEMPROXY_LISTEN")
        .env_remove("IDEMPROXY_REDIS_URL");
    c
}

/// Asserts the exit code, showing stderr when it differs.
fn assert_exit(out: &std::process::Output, code: i32) {
    assert_eq!(
        out.status.code(),
        Some(code),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn check_prints_the_resolved_routes_and_exits_0() {
    let out = idemproxy()
        .args([
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/config/idemproxy.toml"),
            "--check",
        ])
        .output()
        .unwrap();
    assert_exit(&out, 0);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let routes: Vec<&str> = stdout.lines().filter(|l| l.starts_with("route ")).collect();
    assert_eq!(routes.len(), 3, "{stdout}");
    assert!(
        routes[0].contains("payments")
            && routes[0].contains("POST")
            && routes[0].contains("/v1/payments")
    );
    assert!(
        routes[0].contains("ttl=48h")
            && routes[0].contains("lease=30s")
            && routes[0].contains("key=required")
    );
    assert!(routes[2].contains("key=optional"));
    // The worker threads as they will run: `workers = 0` resolved to a number.
    let workers = stdout
        .lines()
        .find(|l| l.starts_with("workers "))
        .unwrap_or_default();
    let n: usize = workers
        .split(' ')
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        n >= 1 && workers.ends_with(" runtime per_thread"),
        "{stdout}"
    );
    for route in &routes {
        assert!(
            route.contains(" key_from=header:idempotency-key "),
            "each route shows its key source: {route}"
        );
    }
}

#[test]
fn check_shows_each_routes_key_source_in_the_webhook_example() {
    let out = idemproxy()
        .args([
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/config/webhooks.toml"),
            "--check",
        ])
        .output()
        .unwrap();
    assert_exit(&out, 0);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let routes: Vec<&str> = stdout.lines().filter(|l| l.starts_with("route ")).collect();
    assert_eq!(routes.len(), 2, "{stdout}");
    assert!(
        routes[0].starts_with("route github ")
            && routes[0].contains(" key_from=header:x-github-delivery "),
        "{stdout}"
    );
    assert!(
        routes[1].starts_with("route stripe ") && routes[1].contains(" key_from=json:/id "),
        "{stdout}"
    );
}

#[test]
fn check_reads_no_secrets_and_contacts_no_store() {
    let cfg = write_config(
        "[server]\nupstream = \"http://127.0.0.1:1\"\n[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:1/0\"\npassword_file = \"/nonexistent/secret\"\n",
    );
    let out = idemproxy()
        .arg("--config")
        .arg(cfg.path())
        .arg("--check")
        .output()
        .unwrap();
    assert_exit(&out, 0);
    // Starting for real needs the secret: exit 1, naming the file.
    let out = idemproxy()
        .arg("--config")
        .arg(cfg.path())
        .args(["--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/secret"));
}

/// A Redis URL the store would refuse at start (a database that is not a
/// number, a port out of range) is refused by --check and at start alike,
/// exit 2, without the password.
#[test]
fn a_redis_url_the_store_cannot_read_exits_2_in_check_and_at_start() {
    for (url, says) in [
        ("redis://:s3cretpw@127.0.0.1/abc", "Invalid database number"),
        ("redis://:s3cretpw@127.0.0.1:99999/0", "did not parse"),
    ] {
        let text = format!(
            "[server]\nupstream = \"http://127.0.0.1:1\"\n[store]\nbackend = \"redis\"\nurl = \"{url}\"\n"
        );
        for err in exits_2_in_check_and_at_start(&text) {
            assert!(err.contains("store.url") && err.contains(says), "{err}");
            assert!(!err.contains("s3cretpw"), "{err}");
        }
    }
    // A cluster's seed nodes and Sentinel's sentinels are URLs too.
    for (store, key) in [
        (
            "mode = \"cluster\"\nnodes = [\"redis://127.0.0.1:7000\", \"127.0.0.1:7001\"]",
            "store.nodes",
        ),
        (
            "mode = \"sentinel\"\nmaster_name = \"m\"\nsentinels = [\"redis://127.0.0.1:99999\"]",
            "store.sentinels",
        ),
    ] {
        let text = format!(
            "[server]\nupstream = \"http://127.0.0.1:1\"\n[store]\nbackend = \"redis\"\n{store}\n"
        );
        for err in exits_2_in_check_and_at_start(&text) {
            assert!(err.contains(key), "{err}");
        }
    }
}

/// A store CA file that holds no certificate is refused by --check and at
/// start (exit 2), rather than starting a proxy whose every handshake with
/// the store fails; one that cannot be read where --check runs is a warning.
#[test]
fn a_store_ca_file_with_no_certificate_exits_2_in_check_and_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.crt");
    std::fs::write(&ca, "this is not a certificate\n").unwrap();
    for backend in [
        "backend = \"redis\"\nurl = \"rediss://127.0.0.1:1/0\"",
        "backend = \"postgres\"\nurl = \"postgres://u@127.0.0.1:1/db\"\nsslmode = \"verify-full\"",
    ] {
        let text = format!(
            "[server]\nupstream = \"http://127.0.0.1:1\"\n[store]\n{backend}\ntls_ca_file = \"{}\"\n",
            ca.display()
        );
        for err in exits_2_in_check_and_at_start(&text) {
            assert!(
                err.contains("store.tls_ca_file") && err.contains("no certificate"),
                "{err}"
            );
        }
    }
    let cfg = write_config(
        "[server]\nupstream = \"http://127.0.0.1:1\"\n[store]\nbackend = \"redis\"\nurl = \"rediss://127.0.0.1:1/0\"\ntls_ca_file = \"/nonexistent/ca.crt\"\n",
    );
    let out = idemproxy()
        .arg("--config")
        .arg(cfg.path())
        .arg("--check")
        .output()
        .unwrap();
    assert_exit(&out, 0);
    assert!(String::from_utf8_lossy(&out.stderr).contains("warning: cannot read the store CA file"));
}

/// What registries or the kubelet would refuse never reaches a manifest, and
/// the injector's address is IP:PORT as the proxy's are: exit 2.
#[test]
fn inject_and_injector_refuse_an_image_or_address_they_cannot_use() {
    for args in [
        &["inject", "--image", "bad image $(x)"][..],
        &["inject", "--image", "reg.example.com/x/IdemProxy:1.0"][..],
        &[
            "injector",
            "--image",
            "x:-bad",
            "--tls-cert-file",
            "a",
            "--tls-key-file",
            "b",
        ][..],
        &[
            "injector",
            "--listen",
            "bogus",
            "--tls-cert-file",
            "a",
            "--tls-key-file",
            "b",
        ][..],
        &[
            "injector",
            "--shutdown-delay",
            "2m",
            "--tls-cert-file",
            "a",
            "--tls-key-file",
            "b",
        ][..],
    ] {
        let out = idemproxy()
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

/// The injector names its files by its own flags, not the proxy's
/// configuration keys: exit 2 for a file that is wrong, 1 for one it cannot read.
#[test]
fn the_injector_names_its_certificate_files_by_its_flags() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    for (cert, code) in [(junk.clone(), 2), (dir.path().join("missing.pem"), 1)] {
        let out = idemproxy()
            .args(["injector", "--listen", "127.0.0.1:0", "--tls-cert-file"])
            .arg(&cert)
            .arg("--tls-key-file")
            .arg(&junk)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{err}");
        assert!(err.contains("--tls-cert-file"), "{err}");
        assert!(!err.contains("server.tls"), "{err}");
    }
}

/// Credentials in the upstream URL are refused (the proxy would drop them,
/// and print the password in its logs); `--help` never shows the value
/// `IDEMPROXY_UPSTREAM` holds.
#[test]
fn an_upstream_url_with_credentials_is_refused_without_repeating_them() {
    for url in [
        "http://user:s3cretUP@127.0.0.1:1",
        "http://s3cretUP@127.0.0.1:1/base",
        // Generated passwords hold `/`, `?` and `#`: still credentials.
        "http://user:s3cretUP/x@127.0.0.1:1",
        "http://user:s3cretUP?x@127.0.0.1:1",
        "http://user:s3cretUP#x@127.0.0.1:1",
    ] {
        for err in exits_2_in_check_and_at_start(&format!("[server]\nupstream = \"{url}\"\n")) {
            assert!(err.contains("credentials"), "{err}");
            assert!(!err.contains("s3cretUP"), "{err}");
        }
        let out = idemproxy()
            .args(["--upstream", url, "--check"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        assert!(!String::from_utf8_lossy(&out.stderr).contains("s3cretUP"));
    }
    // A port that is not one (`http` would take it and connect to 80).
    for url in [
        "http://127.0.0.1:abc",
        "http://127.0.0.1:3000x",
        "http://127.0.0.1:0",
    ] {
        let out = idemproxy()
            .args(["--upstream", url, "--check"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{url}: {err}");
        assert!(err.contains("port"), "{err}");
    }
    let out = idemproxy()
        .arg("--help")
        .env("IDEMPROXY_UPSTREAM", "http://user:s3cretUP@127.0.0.1:1")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(!String::from_utf8_lossy(&out.stdout).contains("s3cretUP"));
}

/// The configuration `text` run through `--check` and through a start: the
/// stderr of each, once both exited 2.
fn exits_2_in_check_and_at_start(text: &str) -> Vec<String> {
    let cfg = write_config(text);
    [&["--check"][..], &["--listen", "127.0.0.1:0"][..]]
        .into_iter()
        .map(|extra| {
            let out = idemproxy()
                .arg("--config")
                .arg(cfg.path())
                .args(extra)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
            err
        })
        .collect()
}

#[test]
fn invalid_configuration_exits_2_naming_file_line_and_key() {
    let cfg = write_config(
        "[server]\nupstream = \"http://127.0.0.1:1\"\n\n[defaults]\nttl = \"forever\"\n",
    );
    for extra in [&["--check"][..], &[][..]] {
        let out = idemproxy()
            .arg("--config")
            .arg(cfg.path())
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        let place = format!("{}:5:7", cfg.path().display());
        assert!(
            err.contains(&place) && err.contains("defaults.ttl"),
            "{err}"
        );
    }
    let out = idemproxy()
        .args(["--config", "/nonexistent.toml", "--check"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent.toml"));
    let out = idemproxy().arg("--no-such-flag").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = idemproxy()
        .args(["--log-format", "xml", "--check"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    // The proxy's flags with a subcommand: refused, not ignored (inject would
    // otherwise read stdin and print manifests, unchecked).
    for (flag, sub) in [("--check", "inject"), ("--init-store", "inject")] {
        let out = idemproxy()
            .args([flag, sub])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {sub}: {err}");
        assert!(err.contains(flag) && err.contains(sub), "{err}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn a_bad_key_from_exits_2_at_its_place_in_check_and_at_start() {
    for (value, message) in [
        ("cookie:session", "invalid key source"),
        ("json:id", "starts with '/'"),
        ("json:/a~2", "invalid JSON pointer"),
        ("header:", "names no header"),
        ("header:X Delivery", "invalid header name"),
    ] {
        let cfg = write_config(&format!(
            "[server]\nupstream = \"http://127.0.0.1:1\"\n\n[[routes]]\nname = \"hook\"\npath = \"/hook\"\n  key_from = \"{value}\"\n"
        ));
        for extra in [&["--check"][..], &["--listen", "127.0.0.1:0"][..]] {
            let out = idemproxy()
                .arg("--config")
                .arg(cfg.path())
                .args(extra)
                .output()
                .unwrap();
            assert_exit(&out, 2);
            let err = String::from_utf8_lossy(&out.stderr);
            let place = format!("{}:7:14: routes[0].key_from:", cfg.path().display());
            assert!(
                err.contains(&place) && err.contains(message),
                "{value}: {err}"
            );
        }
    }
}

#[test]
fn non_ascii_text_before_an_error_exits_2_with_the_exact_place() {
    // CRLF lines and a '☕' just before the bad line: this once made the loader
    // slice inside the character and exit 101.
    let crlf = write_config(
        "# café ☕\r\n[server]\r\n#\r\n# ☕\r\nupstream = \"https://127.0.0.1:1\"\r\n",
    );
    let lf = write_config(
        "# café ☕\n[server]\nupstream = \"http://127.0.0.1:1\"\n[[routes]]\nname = \"café\"\npath = \"/a\"\n",
    );
    for (cfg, place) in [
        (&crlf, "5:1: server.upstream: "),
        (&lf, "5:8: routes[0].name: "),
    ] {
        for extra in [&["--check"][..], &[][..]] {
            let out = idemproxy()
                .arg("--config")
                .arg(cfg.path())
                .args(extra)
                .output()
                .unwrap();
            assert_exit(&out, 2);
            let err = String::from_utf8_lossy(&out.stderr);
            let place = format!("{}:{place}", cfg.path().display());
            assert!(err.contains(&place), "{err} should contain {place}");
        }
    }
}

#[test]
fn an_invalid_override_exits_2_naming_the_flag_and_env_var() {
    let out = idemproxy()
        .args(["--upstream", "https://127.0.0.1:1", "--check"])
        .output()
        .unwrap();
    assert_exit(&out, 2);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--upstream (IDEMPROXY_UPSTREAM): invalid upstream URL"),
        "{err}"
    );
    let cfg = write_config("[server]\nupstream = \"http://127.0.0.1:1\"\n");
    let out = idemproxy()
        .arg("--config")
        .arg(cfg.path())
        .env("IDEMPROXY_LISTEN", "nowhere")
        .output()
        .unwrap();
    assert_exit(&out, 2);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--listen (IDEMPROXY_LISTEN): invalid listen address \"nowhere\""),
        "{err}"
    );
}

#[test]
fn env_vars_stand_in_for_flags() {
    let cfg = write_config("[[routes]]\nname = \"p\"\npath = \"/p\"\n");
    let out = idemproxy()
        .env("IDEMPROXY_CONFIG", cfg.path())
        .env("IDEMPROXY_UPSTREAM", "http://127.0.0.1:4444")
        .arg("--check")
        .output()
        .unwrap();
    assert_exit(&out, 0);
    assert!(String::from_utf8_lossy(&out.stdout).contains("http://127.0.0.1:4444"));
}

#[test]
fn a_port_in_use_exits_1() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = idemproxy()
        .args(["--upstream", "http://127.0.0.1:1", "--listen", &addr])
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&addr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_store_is_not_a_startup_failure() {
    let upstream = TestUpstream::start().await;
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = dead.local_addr().unwrap().port();
    drop(dead);
    let text = ConfigBuilder::new(&upstream.url())
        .redis_url(&format!("redis://127.0.0.1:{port}/0"))
        .store("op_timeout = \"200ms\"")
        .build();
    let proxy = Proxy::spawn(&text, &[]).await;
    assert_eq!(get(&proxy.admin_url("/healthz")).await.unwrap().status, 200);
    assert_eq!(
        get(&proxy.admin_url("/readyz")).await.unwrap().status,
        503,
        "not ready before the store answers"
    );
    let r = Call::post(&proxy.url("/v1/payments"))
        .key("k")
        .body("x")
        .await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["type"], "store-unavailable");
    assert_eq!(r.json()["retryable"], true);
    assert!(r.header("retry-after").unwrap().parse::<u64>().unwrap() >= 1);
    assert!(
        !String::from_utf8_lossy(&r.body).contains(&port.to_string()),
        "no internal address leaks"
    );
    assert_eq!(
        upstream.hits(),
        0,
        "not forwarded when the key cannot be recorded"
    );
    // Pass-through does not need the store.
    assert_eq!(
        Call::new("GET", &proxy.url("/other")).send().await.status,
        201
    );
    let metrics = get(&proxy.admin_url("/metrics")).await.unwrap();
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains("idemproxy_store_up 0"), "{text}");
    assert!(text.contains("idemproxy_requests_total{route=\"payments\",outcome=\"store_error\"} 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_the_request_in_flight_finish_and_exits_0() {
    let redis = RedisServer::start().await;
    let upstream = TestUpstream::start().await;
    let text = ConfigBuilder::new(&upstream.url()).redis(&redis).build();
    let mut proxy = Proxy::start(&text).await;
    let url = proxy.url("/v1/payments");
    let in_flight = Call::post(&url)
        .key("k-term")
        .header("x-test-hold", "1")
        .spawn("x");
    upstream.wait_hits(1).await;
    proxy.signal("TERM");
    let admin = proxy.admin_url("/readyz");
    eventually("readiness withdrawn", DEADLINE, || {
        let admin = admin.clone();
        async move {
            match get(&admin).await {
                Ok(r) if r.status == 200 => None,
                _ => Some(()),
            }
        }
    })
    .await;
    upstream.release(1);
    let r = in_flight.await.unwrap();
    assert_eq!(r.status, 201, "the request in flight gets its real answer");
    assert_eq!(proxy.wait_exit().await, Some(0));
    // The record is there for a new process.
    let proxy2 = Proxy::start(&text).await;
    let again = Call::post(&proxy2.url("/v1/payments"))
        .key("k-term")
        .header("x-test-hold", "1")
        .body("x")
        .await;
    assert!(again.is_replay());
    assert_eq!(again.body, r.body);
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_config_in_front_of_the_demo_upstream() {
    let mut demo = Command::new(env!("CARGO_BIN_EXE_demo-upstream"))
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(demo.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let demo_addr = line.trim().rsplit(' ').next().unwrap().to_string();
    let quickstart = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/config/quickstart.toml"
    ))
    .unwrap()
    .replace("127.0.0.1:8080", "127.0.0.1:0")
    .replace("127.0.0.1:9901", "127.0.0.1:0")
    .replace("127.0.0.1:3000", &demo_addr);
    let proxy = Proxy::start(&quickstart).await;
    let url = proxy.url("/v1/payments");
    let pay = || {
        Call::post(&url)
            .key("order-1001-attempt")
            .header("content-type", "application/json")
            .body(r#"{"amount": 4200}"#)
    };
    let first = pay().await;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("location"), Some("/v1/payments/pay_1"));
    let retry = pay().await;
    assert!(retry.is_replay());
    assert_eq!(retry.body, first.body);
    let charges = get(&proxy.url("/v1/charges")).await.unwrap();
    assert_eq!(charges.json()["charges"], 1, "one charge for two attempts");
    let _ = demo.kill();
    let _ = demo.wait();
}

/// The subcommands sit beside the proxy's flags without changing how those parse.
#[test]
fn inject_and_injector_are_subcommands_and_the_flags_still_parse() {
    let out = idemproxy().arg("--help").output().unwrap();
    assert_exit(&out, 0);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("inject") && help.contains("injector"),
        "{help}"
    );
    for sub in ["inject", "injector"] {
        assert_exit(&idemproxy().args([sub, "--help"]).output().unwrap(), 0);
    }
    // A flag's value that happens to be a subcommand's name is still the value.
    let out = idemproxy()
        .args([
            "--upstream",
            "http://127.0.0.1:1",
            "--listen",
            "inject",
            "--check",
        ])
        .output()
        .unwrap();
    assert_exit(&out, 2);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--listen"));
    let out = idemproxy()
        .args([
            "--upstream",
            "http://127.0.0.1:1",
            "--upstream-protocol",
            "h2c",
            "--check",
        ])
        .output()
        .unwrap();
    assert_exit(&out, 0);
    // The injector without its certificate files: a usage error.
    assert_exit(&idemproxy().arg("injector").output().unwrap(), 2);
}

/// A SIGHUP or SIGTERM that comes while the proxy starts (here a PostgreSQL
/// that accepts and never answers holds its schema check) is kept for when
/// it serves, not the signal's default action, which ended the process with
/// no word (exit 129 for a SIGHUP from a config watcher during a restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_while_the_proxy_starts_does_not_end_it_unannounced() {
    use std::os::unix::process::ExitStatusExt;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let store = silent.local_addr().unwrap().port();
    let config = write_config(&format!(
        r#"
[server]
listen = "127.0.0.1:{}"
admin_listen = "127.0.0.1:{}"
upstream = "http://127.0.0.1:9"

[store]
backend = "postgres"
url = "postgres://idemproxy@127.0.0.1:{store}/idemproxy"
sslmode = "disable"
op_timeout = "2s"
"#,
        free_port(),
        free_port()
    ));
    let child = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .arg("--config")
        .arg(config.path())
        .args(["--log-format", "json"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idemproxy");
    // Starting: it has connected to the store and waits for its answer.
    let (_held, _) = tokio::time::timeout(DEADLINE, silent.accept())
        .await
        .expect("the proxy connects to its store while it starts")
        .unwrap();
    for sig in ["-HUP", "-TERM"] {
        let sent = Command::new("kill")
            .args([sig, &child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    }
    let out = tokio::time::timeout(
        DEADLINE,
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await
    .expect("the proxy ends")
    .unwrap()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), None, "ended by a signal:\n{stderr}");
    // It serves (the store is down: not ready), then the SIGTERM drains it: exit 0.
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("SIGTERM received"), "{stderr}");
}
