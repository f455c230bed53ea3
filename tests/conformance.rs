//! `idemproxy conformance` (docs/conformance.md) against real endpoints: idemproxy in
//! front of the demo upstream, over HTTP and over TLS; an in-app implementation in the common tutorial style
//! (Flask and SQLite, a UNIQUE constraint as the lock: tests/conformance/flask_sqlite.py)
//! and its deliberately broken variants; and an address where nothing listens.
//!
//! Each run's rows are read from its `--report` JSON, not only its exit code: the
//! conforming endpoints pass every row, and each defect fails its own rows and no other.

mod support;

#[path = "conformance/fake.rs"]
mod fake;

// The Flask app runs from the frameworks' venv (tests/frameworks/setup.sh, Python part).
#[allow(dead_code)]
#[path = "frameworks/upstreams.rs"]
mod upstreams;

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::{free_port, get, kill_child, make_certs, ConfigBuilder, Proxy};
use upstreams::Dirs;

/// How long the Flask app may take to listen (Python imports Flask first).
const START_DEADLINE: Duration = Duration::from_secs(60);
/// How long one run of the kit may take: about twenty requests, a few of them slow.
const RUN_DEADLINE: Duration = Duration::from_secs(90);
/// How long the endpoints' operation takes: long enough that the kit's duplicate,
/// sent halfway through, overlaps it even on a loaded machine.
const OPERATION_MS: &str = "400";

/// One run of the kit: its exit code, its table, and its rows by id (`result` of each).
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    report: serde_json::Value,
}

impl Run {
    fn results(&self) -> BTreeMap<String, String> {
        let rows = self.report["rows"].as_array().cloned().unwrap_or_default();
        rows.iter()
            .map(|r| {
                let id = r["id"].as_str().unwrap_or_default().to_string();
                (id, r["result"].as_str().unwrap_or_default().to_string())
            })
            .collect()
    }

    /// The row was marked as judged from the answers alone.
    fn by_answers(&self, id: &str) -> bool {
        let rows = self.report["rows"].as_array().cloned().unwrap_or_default();
        rows.iter()
            .any(|r| r["id"] == id && r["by_answers"] == serde_json::Value::Bool(true))
    }

    /// Every row passes but those in `failing` (which fail) and `unobserved`.
    fn assert_rows(&self, failing: &[&str], unobserved: &[&str]) {
        let results = self.results();
        assert_eq!(results.len(), 18, "every row is reported:\n{}", self.stdout);
        for (id, result) in &results {
            let want = if failing.contains(&id.as_str()) {
                "fail"
            } else if unobserved.contains(&id.as_str()) {
                "not_observed"
            } else {
                "pass"
            };
            assert_eq!(result, want, "row {id}:\n{}\n{}", self.stdout, self.stderr);
        }
    }
}

/// Runs `idemproxy conformance ARGS --report FILE` and reads the report.
async fn conformance(args: &[&str]) -> Run {
    conformance_within(args, RUN_DEADLINE).await
}

/// [`conformance`], failing the test if the run takes over `deadline`.
async fn conformance_within(args: &[&str], deadline: Duration) -> Run {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let report = dir.path().join("report.json");
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .arg("conformance")
        .args(args)
        .arg("--report")
        .arg(&report)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run idemproxy conformance");
    let out = tokio::time::timeout(deadline, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("idemproxy conformance {args:?} took over {deadline:?}"))
        .expect("its output");
    let text = std::fs::read_to_string(&report).unwrap_or_default();
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        report: serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
    }
}

/// The demo upstream (examples/demo-upstream) on a port of its own, every answer `OPERATION_MS` late.
struct Demo(Option<Child>, String);

impl Demo {
    fn start() -> Demo {
        let mut child = Command::new(env!("CARGO_BIN_EXE_demo-upstream"))
            .args(["--listen", "127.0.0.1:0", "--delay-ms", OPERATION_MS])
            .stdout(Stdio::piped())
            .spawn()
            .expect("start demo-upstream");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("its stdout");
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("its listening line");
        let addr = line
            .trim()
            .rsplit(' ')
            .next()
            .unwrap_or_default()
            .to_string();
        Demo(Some(child), format!("http://{addr}"))
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        kill_child(&mut self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idemproxy_in_front_of_the_demo_upstream_meets_every_row() {
    let demo = Demo::start();
    let config = ConfigBuilder::new(&demo.1)
        .route("payments", "/v1/payments", "")
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let run = conformance(&[
        &proxy.url(""),
        "--route",
        "/v1/payments",
        "--executions",
        &proxy.url("/v1/charges"),
        "--header",
        "Authorization: Bearer alice",
        "--other-principal",
        "Authorization: Bearer bob",
    ])
    .await;
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    run.assert_rows(&[], &[]);
    assert_eq!(run.report["exit_code"], 0);
    assert!(
        !run.stdout.contains("by answers"),
        "counted: {}",
        run.stdout
    );
    assert!(run.stdout.contains("| `concurrent-runs-once` | MUST |"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idemproxy_over_https_trusting_a_ca_file() {
    let demo = Demo::start();
    let certs = tempfile::tempdir().expect("a directory for certificates");
    make_certs(certs.path());
    let tls = format!(
        "tls_cert_file = \"{}\"\ntls_key_file = \"{}\"",
        certs.path().join("server.pem").display(),
        certs.path().join("server.key").display()
    );
    let config = ConfigBuilder::new(&demo.1)
        .server(&tls)
        .route("payments", "/v1/payments", "")
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    let url = format!("https://{}/v1/payments", proxy.addr);
    let ca = certs.path().join("ca.pem");
    let run = conformance(&[&url, "--ca-file", &ca.to_string_lossy()]).await;
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    // No --other-principal: that row alone is not observed.
    run.assert_rows(&[], &["principal-scope"]);
    // Without the CA the certificate is refused, and nothing can be checked.
    let untrusted = conformance(&[&url]).await;
    assert_eq!(untrusted.code, Some(2), "{}", untrusted.stderr);
    assert!(untrusted.stderr.contains("TLS"), "{}", untrusted.stderr);
}

/// The Flask + SQLite app, with `defect` or as written correctly.
struct Flask {
    child: Option<Child>,
    port: u16,
    log: PathBuf,
    /// Its database and log, removed with it.
    _dir: Option<tempfile::TempDir>,
}

impl Flask {
    /// Starts the app on a free port and waits until it answers; a port taken between
    /// choosing and binding (tests run at once) means another port.
    async fn start(defect: Option<&str>) -> Flask {
        let dirs = Dirs::new();
        tokio::task::block_in_place(|| dirs.set_up_parts(&["python"]));
        let dir = tempfile::tempdir().expect("a directory for the database and log");
        for _ in 0..5 {
            let mut flask = Flask::spawn(&dirs, dir.path(), defect);
            match flask.wait_listening().await {
                Ok(()) => {
                    flask._dir = Some(dir);
                    return flask;
                }
                Err(log) if log.contains("already in use") => continue,
                Err(log) => panic!("the Flask app did not start:\n{log}"),
            }
        }
        panic!("the Flask app found no free port in five tries");
    }

    fn spawn(dirs: &Dirs, logs: &Path, defect: Option<&str>) -> Flask {
        let port = free_port();
        let log = logs.join(format!("flask-{port}.log"));
        let out = std::fs::File::create(&log).expect("a log file");
        let mut cmd = Command::new(dirs.target.join("frameworks-venv/bin/python"));
        cmd.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/conformance/flask_sqlite.py"))
            .arg(port.to_string())
            .args(["--delay-ms", OPERATION_MS])
            .args([
                "--db",
                &logs.join(format!("orders-{port}.db")).to_string_lossy(),
            ]);
        if let Some(defect) = defect {
            cmd.args(["--defect", defect]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("the log file"))
            .stderr(out)
            .spawn()
            .expect("start the Flask app");
        Flask {
            child: Some(child),
            port,
            log,
            _dir: None,
        }
    }

    /// Waits for `/health` to answer; `Err(log)` when the app exits or the deadline passes.
    async fn wait_listening(&mut self) -> Result<(), String> {
        let started = Instant::now();
        let health = format!("http://127.0.0.1:{}/health", self.port);
        loop {
            if get(&health).await.is_ok_and(|r| r.status == 200) {
                return Ok(());
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || started.elapsed() > START_DEADLINE {
                kill_child(&mut self.child);
                return Err(std::fs::read_to_string(&self.log).unwrap_or_default());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/orders", self.port)
    }

    /// The kit against the app, with another principal for the key-scope row.
    async fn check(&self) -> Run {
        conformance(&[
            &self.url(),
            "--header",
            "Authorization: Bearer alice",
            "--other-principal",
            "Authorization: Bearer bob",
        ])
        .await
    }
}

impl Drop for Flask {
    fn drop(&mut self) {
        kill_child(&mut self.child);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tutorial_flask_sqlite_implementation_meets_every_row() {
    let flask = Flask::start(None).await;
    let run = flask.check().await;
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    run.assert_rows(&[], &[]);
    // No counter: the rows about executions say they were judged from the answers.
    for id in [
        "retry-runs-once",
        "concurrent-runs-once",
        "new-key-new-operation",
    ] {
        assert!(
            run.stdout.contains(&format!("`{id}` |")) && run.by_answers(id),
            "{id}:\n{}",
            run.stdout
        );
    }
    assert!(
        run.stdout.contains("| pass (by answers) |"),
        "{}",
        run.stdout
    );
    let last = run.stdout.trim_end().lines().last().unwrap_or_default();
    assert!(last.contains("give --executions URL"), "{}", run.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_201_replayed_as_200_fails_the_replay_status_row_and_no_must() {
    let flask = Flask::start(Some("replay-200")).await;
    let run = flask.check().await;
    run.assert_rows(&["replay-status"], &[]);
    assert_eq!(run.code, Some(0), "a PRACTICE row: no MUST failed");
    assert!(
        run.stdout.contains("first 201, replay 200"),
        "{}",
        run.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_in_flight_check_fails_the_409_row_and_the_concurrency_must() {
    let flask = Flask::start(Some("no-409")).await;
    let run = flask.check().await;
    // Without a 409 there is none to carry a Retry-After.
    run.assert_rows(
        &["in-flight-409", "concurrent-runs-once"],
        &["retry-after-409"],
    );
    assert_eq!(run.code, Some(1), "concurrent-runs-once is a MUST");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_fingerprint_fails_the_reuse_rows() {
    let flask = Flask::start(Some("no-fingerprint")).await;
    let run = flask.check().await;
    run.assert_rows(&["reuse-refused", "reuse-422"], &[]);
    assert_eq!(run.code, Some(1), "reuse-refused is a MUST");
    assert!(
        run.stdout
            .contains("the first request's answer, given to a different request"),
        "{}",
        run.stdout
    );
}

#[tokio::test]
async fn an_endpoint_that_cannot_be_reached_is_exit_2() {
    let port = free_port();
    let run = conformance(&[&format!("http://127.0.0.1:{port}/orders")]).await;
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    assert!(run.stderr.contains("cannot be reached"), "{}", run.stderr);
    assert_eq!(run.report["exit_code"], 2);
    assert!(run.stdout.is_empty(), "no table: {}", run.stdout);
}

#[tokio::test]
async fn arguments_it_cannot_use_are_exit_2_before_anything_is_sent() {
    for args in [
        &["ftp://127.0.0.1:1/"][..],
        &["https://127.0.0.1:1/", "--ca-file", "/nonexistent/ca.pem"],
        &["http://127.0.0.1:1/", "--body", "{}"],
        &["http://127.0.0.1:1/", "--route", "orders"],
        &["http://127.0.0.1:1/", "--header", "no colon"],
    ] {
        let run = conformance(args).await;
        assert_eq!(run.code, Some(2), "{args:?}: {}", run.stderr);
        assert!(
            !run.stderr.contains("cannot be reached"),
            "{args:?}: {}",
            run.stderr
        );
    }
}

/// Every concurrent duplicate runs; one stores its answer, the rest fail on the
/// key's UNIQUE constraint with a 500. One 2xx among them is no proof of one execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executions_hidden_behind_500s_are_not_a_pass() {
    let flask = Flask::start(Some("race-500")).await;
    let run = flask.check().await;
    let results = run.results();
    assert_eq!(
        results["concurrent-runs-once"], "not_observed",
        "{}\n{}",
        run.stdout, run.stderr
    );
    assert!(
        run.stdout.contains("a failed answer may hide an execution"),
        "{}",
        run.stdout
    );
    // The app's counter shows what the answers could not: it ran every time.
    let counter = format!("http://127.0.0.1:{}/__executions", flask.port);
    let counted = conformance(&[&flask.url(), "--executions", &counter]).await;
    assert_eq!(
        counted.results()["concurrent-runs-once"],
        "fail",
        "{}",
        counted.stdout
    );
    assert_eq!(counted.code, Some(1), "{}", counted.stdout);
}

/// The first request answered, every later one with an endless stream of
/// `100 Continue`: each of the run's twenty-odd requests ends at its deadline
/// at the latest, and nothing more being observed, the run with exit 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_100_continue_ends_within_the_timeout() {
    let url = fake::start(fake::Fake::Flood).await;
    let run = conformance_within(&[&url, "--timeout", "1s"], Duration::from_secs(45)).await;
    assert_eq!(run.code, Some(2), "{}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("informational"), "{}", run.stdout);
}

/// The first request answered, then nothing: no MUST row can be observed, and
/// that is no conformance (exit 2), though a table is printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_must_row_observed_is_exit_2() {
    let url = fake::start(fake::Fake::FirstOnly).await;
    let run = conformance(&[&url, "--timeout", "2s"]).await;
    assert_eq!(run.code, Some(2), "{}\n{}", run.stdout, run.stderr);
    assert_eq!(run.report["exit_code"], 2);
    assert!(
        run.stdout.contains("no MUST row could be observed"),
        "{}",
        run.stdout
    );
}
