//! The Grafana dashboard (`deploy/grafana/idemproxy.json`) and the alert rules
//! (`deploy/prometheus/idemproxy-rules.yaml`) against a real Prometheus that
//! scrapes a real proxy: every panel's query returns data, every rule's
//! expression is a valid query, and each names only metrics the proxy exports.
//!
//! Needs the `prometheus` binary (Debian's `prometheus` package; `tests/run.sh`
//! installs it). Without it the test says so loudly and passes.

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long Prometheus may take to start, scrape and have two samples of
/// every series (it scrapes every 200 ms).
const PROMETHEUS_DEADLINE: Duration = Duration::from_secs(60);

/// What Grafana's `$__rate_interval` becomes here: with a 200 ms scrape
/// interval, a window that always holds several samples.
const RATE_INTERVAL: &str = "1m";

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// The Prometheus binary: `IDEMPROXY_TEST_PROMETHEUS`, else `/usr/bin/prometheus`.
fn prometheus_binary() -> Option<PathBuf> {
    let path = std::env::var_os("IDEMPROXY_TEST_PROMETHEUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/prometheus"));
    path.is_file().then_some(path)
}

/// A Prometheus of the test's own: its own data directory, a free port,
/// scraping one target each second and evaluating the rules file.
struct Prometheus {
    child: Option<Child>,
    addr: String,
    dir: tempfile::TempDir,
}

impl Prometheus {
    async fn start(binary: &Path, target: std::net::SocketAddr, rules: &Path) -> Prometheus {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 200ms\n  scrape_timeout: 200ms\n  evaluation_interval: 200ms\n\
                 rule_files:\n  - {rules:?}\n\
                 scrape_configs:\n  - job_name: idemproxy\n    static_configs:\n      - targets: [\"{target}\"]\n"
            ),
        )
        .expect("write prometheus.yml");
        let addr = format!("127.0.0.1:{}", free_port());
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log file");
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn prometheus");
        let mut prometheus = Prometheus {
            child: Some(child),
            addr,
            dir,
        };
        let ready = format!("http://{}/-/ready", prometheus.addr);
        let until = tokio::time::Instant::now() + PROMETHEUS_DEADLINE;
        loop {
            if matches!(get(&ready).await, Ok(r) if r.status == 200) {
                break;
            }
            // One that exits (a configuration or rules file it refuses) says why in its log.
            if let Some(status) = prometheus.child.as_mut().and_then(|c| c.try_wait().ok()?) {
                panic!(
                    "prometheus exited ({status}); its log:\n{}",
                    prometheus.log()
                );
            }
            assert!(
                tokio::time::Instant::now() < until,
                "prometheus did not become ready; its log:\n{}",
                prometheus.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        prometheus
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// `GET /api/v1/<path>?query=<query>`: the whole JSON answer (`status`
    /// is `success`, or `error` with `error` saying why).
    async fn api(&self, path: &str, query: Option<&str>) -> Value {
        let mut url = format!("http://{}/api/v1/{path}", self.addr);
        if let Some(q) = query {
            url.push_str("?query=");
            url.push_str(&percent_encode(q));
        }
        let r = get(&url).await.expect("prometheus answers");
        serde_json::from_slice(&r.body).unwrap_or_else(|e| {
            panic!(
                "prometheus answered {} with no JSON ({e}): {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            )
        })
    }

    /// An instant query's answer.
    async fn query(&self, q: &str) -> Value {
        self.api("query", Some(q)).await
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        kill_child(&mut self.child);
    }
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The metric names a PromQL expression uses. The rule: outside string
/// literals, an identifier (`[A-Za-z_:][A-Za-z0-9_:]*`) followed directly by
/// `{`, `[`, `)`, whitespace or the end of the expression is a metric name
/// when it starts with `idemproxy_` or ends in `_total`, `_seconds`,
/// `_bucket`, `_count`, `_sum` or `_bytes`. (Function names are followed by
/// `(`, label names by `=`, `!` or `,`; durations start with a digit.)
fn metric_names(expr: &str) -> BTreeSet<String> {
    const SUFFIXES: [&str; 6] = ["_total", "_seconds", "_bucket", "_count", "_sum", "_bytes"];
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            // A string literal: skipped to its closing quote (escapes too).
            i += 1;
            while i < chars.len() && chars[i] != c {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || "_:".contains(chars[i])) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = chars.get(i).copied();
            let followed = next.is_none_or(|n| n.is_whitespace() || "{[)".contains(n));
            let named =
                word.starts_with("idemproxy_") || SUFFIXES.iter().any(|s| word.ends_with(s));
            if followed && named {
                names.insert(word);
            }
        } else if c.is_ascii_digit() {
            // A number or a duration (`5m`, `1e3`): not an identifier.
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    names
}

/// The sample names of an OpenMetrics exposition: every sample line's name,
/// and for each `# TYPE` the names its samples take (a counter's `_total`, a
/// histogram's `_bucket`, `_count` and `_sum`, a gauge's own), so that a
/// family with no series yet (a counter of faults that never happened) counts
/// as exported.
fn exported_names(exposition: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in exposition.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "histogram" => &["_bucket", "_count", "_sum"],
                "gauge" => &[""],
                _ => &[],
            };
            names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}

/// One query of a panel or a rule, and where it came from.
struct Query {
    source: String,
    expr: String,
}

/// Every target of every panel of the dashboard, `$__rate_interval` made [`RATE_INTERVAL`].
fn panel_queries(dashboard: &Value) -> Vec<Query> {
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut queries = Vec::new();
    for panel in panels {
        let title = panel["title"].as_str().expect("a panel title");
        let targets = panel["targets"].as_array().expect("a panel's targets");
        assert!(!targets.is_empty(), "panel {title:?} has no target");
        for t in targets {
            let expr = t["expr"].as_str().expect("a target's expr");
            let expr = expr.replace("$__rate_interval", RATE_INTERVAL);
            assert!(
                !expr.contains('$'),
                "panel {title:?}: a variable this test does not fill in: {expr}"
            );
            queries.push(Query {
                source: format!("panel {title:?} target {}", t["refId"]),
                expr,
            });
        }
    }
    queries
}

/// Every alert of the rules file: its name and its `expr`. The file keeps
/// each expression on one line (`expr: ...`), which this reads.
fn rule_queries(rules: &str) -> Vec<Query> {
    let mut queries = Vec::new();
    let mut alert = None;
    for line in rules.lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix("- alert:") {
            alert = Some(name.trim().to_string());
        } else if let Some(expr) = line.strip_prefix("expr:") {
            let name = alert.take().expect("an expr under an alert");
            let expr = expr.trim();
            assert!(
                !expr.is_empty() && !expr.starts_with(['|', '>']),
                "alert {name}: its expr must be on one line"
            );
            queries.push(Query {
                source: format!("alert {name}"),
                expr: expr.to_string(),
            });
        }
    }
    let alerts = rules.matches("- alert:").count();
    assert_eq!(queries.len(), alerts, "every alert has an expr");
    queries
}

/// The names each query uses that the exposition does not have.
fn unknown_names(queries: &[Query], exported: &BTreeSet<String>) -> Vec<String> {
    let mut unknown = Vec::new();
    for q in queries {
        let names = metric_names(&q.expr);
        assert!(
            !names.is_empty(),
            "{}: no metric name found in {}",
            q.source,
            q.expr
        );
        for n in names.difference(exported) {
            unknown.push(format!("{}: {n} is not exported ({})", q.source, q.expr));
        }
    }
    unknown
}

/// Why a panel's query does not show what it should yet: an error, no
/// series, or (for a quantile) no finite value.
fn panel_problem(q: &Query, answer: &Value) -> Option<String> {
    if answer["status"] != "success" {
        return Some(format!(
            "{}: {} failed: {}",
            q.source, q.expr, answer["error"]
        ));
    }
    let result = answer["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if result.is_empty() {
        return Some(format!("{}: {} returned no data", q.source, q.expr));
    }
    let finite = result.iter().any(|s| {
        s["value"][1]
            .as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(f64::is_finite)
    });
    if q.expr.contains("histogram_quantile") && !finite {
        return Some(format!(
            "{}: {} has no finite value (no observations in the window): {}",
            q.source,
            q.expr,
            Value::Array(result)
        ));
    }
    None
}

/// One request on a kept-alive connection, then silence: the proxy parks it.
async fn idle_connection(proxy: &Proxy) -> TcpStream {
    let mut c = TcpStream::connect(proxy.addr).await.expect("connect");
    c.write_all(b"GET /idle HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut buf = [0u8; 4096];
    let n = tokio::time::timeout(DEADLINE, c.read(&mut buf))
        .await
        .expect("an answer in time")
        .expect("read");
    assert!(n > 0, "the proxy answered on the idle connection");
    c
}

/// The traffic before the loop: a lost lease, a conflict, a mismatch, a
/// missing key, pass-through and a parked connection.
async fn first_traffic(env: &Env) -> TcpStream {
    let url = env.url("/v1/payments");
    // A lost lease (as tests/failures.rs makes one): the reservation
    // vanishes from Redis while the upstream holds the call, a retry takes
    // the key, and the first finisher's completion is refused.
    let a = Call::post(&url)
        .key("lost")
        .header("x-test-hold", "1")
        .spawn("x");
    env.upstream.wait_hits(1).await;
    let redis = env.redis.as_ref().expect("redis");
    let keys = redis.keys().await;
    assert_eq!(keys.len(), 1, "only the held call's record: {keys:?}");
    let _: i64 = redis.cmd(&["DEL", &keys[0]]).await;
    assert_eq!(Call::post(&url).key("lost").body("x").await.status, 201);
    env.upstream.release(1);
    assert_eq!(a.await.unwrap().status, 201);
    // A conflict: a retry while the first is held upstream.
    let held = Call::post(&url)
        .key("held")
        .header("x-test-hold", "1")
        .spawn("x");
    env.upstream.wait_hits(3).await;
    assert_eq!(Call::post(&url).key("held").body("x").await.status, 409);
    env.upstream.release(1);
    assert_eq!(held.await.unwrap().status, 201);
    // A mismatch: the key again with another body.
    assert_eq!(Call::post(&url).key("held").body("y").await.status, 422);
    Call::post(&url).body("no key").await;
    idle_connection(&env.proxy).await
}

/// One round of the steady traffic: a new key, its replay, a pass-through.
async fn round(env: &Env, n: usize) {
    let url = env.url("/v1/payments");
    let key = format!("round-{n}");
    assert_eq!(Call::post(&url).key(&key).body("x").await.status, 201);
    assert!(Call::post(&url).key(&key).body("x").await.is_replay());
    Call::new("GET", &env.url("/other")).send().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_and_alert_queries_metrics_the_proxy_exports() {
    let Some(binary) = prometheus_binary() else {
        eprintln!(
            "\n{bar}\nSKIPPED dashboards: no prometheus binary (/usr/bin/prometheus, or \
             IDEMPROXY_TEST_PROMETHEUS).\nThe dashboard and the alert rules were NOT checked. \
             Install it: apt-get install -y prometheus (tests/run.sh does).\n{bar}\n",
            bar = "!".repeat(78)
        );
        return;
    };
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(repo("deploy/grafana/idemproxy.json")).expect("dashboard"),
    )
    .expect("the dashboard is JSON");
    let rules_path = repo("deploy/prometheus/idemproxy-rules.yaml");
    let panels = panel_queries(&dashboard);
    let alerts = rule_queries(&std::fs::read_to_string(&rules_path).expect("rules"));

    let env = Env::start(Backend::Redis).await;
    let prometheus = Prometheus::start(&binary, env.proxy.admin, &rules_path).await;
    // The proxy's series in Prometheus before the traffic, so that its
    // counters and histograms move between samples.
    let mut seen = false;
    let until = tokio::time::Instant::now() + PROMETHEUS_DEADLINE;
    while !seen {
        let a = prometheus.query("idemproxy_store_up == 1").await;
        seen = a["data"]["result"]
            .as_array()
            .is_some_and(|r| !r.is_empty());
        assert!(
            seen || tokio::time::Instant::now() < until,
            "prometheus never scraped the proxy: {a}\nits targets: {}\nits log:\n{}",
            prometheus.api("targets", None).await,
            prometheus.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _idle = first_traffic(&env).await;

    // Names: the exposition, read from the proxy itself.
    let exposition = get(&env.proxy.admin_url("/metrics"))
        .await
        .expect("/metrics");
    let exported = exported_names(&String::from_utf8_lossy(&exposition.body));
    let mut unknown = unknown_names(&panels, &exported);
    unknown.extend(unknown_names(&alerts, &exported));
    assert!(
        unknown.is_empty(),
        "queries name metrics the proxy does not export:\n{}\nexported: {exported:?}",
        unknown.join("\n")
    );

    // Panels: traffic until every query shows data, or the deadline.
    let until = tokio::time::Instant::now() + PROMETHEUS_DEADLINE;
    let mut n = 0;
    loop {
        round(&env, n).await;
        n += 1;
        let mut problems = Vec::new();
        for q in &panels {
            if let Some(p) = panel_problem(q, &prometheus.query(&q.expr).await) {
                problems.push(p);
            }
        }
        if problems.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "after {n} rounds of traffic, panels without data:\n{}",
            problems.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for q in &panels {
        let a = prometheus.query(&q.expr).await;
        let result = a["data"]["result"].as_array().cloned().unwrap_or_default();
        let values: Vec<&str> = result
            .iter()
            .filter_map(|s| s["value"][1].as_str())
            .collect();
        eprintln!("{}: {} series {values:?}", q.source, result.len());
    }
    eprintln!(
        "{} panel queries with data after {n} rounds; {} alert expressions",
        panels.len(),
        alerts.len()
    );
    // The outcomes the traffic made, as the first panel shows them.
    let by_outcome = prometheus.query(&panels[0].expr).await;
    let outcomes: BTreeSet<&str> = by_outcome["data"]["result"]
        .as_array()
        .expect("a vector")
        .iter()
        .filter_map(|s| s["metric"]["outcome"].as_str())
        .collect();
    for o in [
        "forwarded",
        "replayed",
        "conflict",
        "mismatch",
        "passthrough",
    ] {
        assert!(outcomes.contains(o), "{o} among {outcomes:?}");
    }

    // Alerts: each expression is a valid query (firing or not).
    for q in &alerts {
        let a = prometheus.query(&q.expr).await;
        assert_eq!(
            a["status"], "success",
            "{}: {} failed: {a}",
            q.source, q.expr
        );
    }
    // And Prometheus loaded the rules file and evaluates each rule cleanly.
    let until = tokio::time::Instant::now() + PROMETHEUS_DEADLINE;
    loop {
        let r = prometheus.api("rules", None).await;
        let rules: Vec<&Value> = r["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .collect();
        let healthy = rules.iter().filter(|r| r["health"] == "ok").count();
        if rules.len() == alerts.len() && healthy == rules.len() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "prometheus's rules ({healthy} of {} healthy, {} expected): {r}",
            rules.len(),
            alerts.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn the_metric_name_rule() {
    let names = metric_names(
        r#"histogram_quantile(0.99, sum by (le, op) (rate(idemproxy_store_duration_seconds_bucket{op!="x_total"}[5m]))) / up_total + max(idemproxy_inflight) + foo_bytes"#,
    );
    let want = [
        "foo_bytes",
        "idemproxy_inflight",
        "idemproxy_store_duration_seconds_bucket",
        "up_total",
    ];
    assert_eq!(names, want.iter().map(|s| s.to_string()).collect());
    let exported = exported_names(
        "# TYPE idemproxy_lease_lost counter\n# TYPE h histogram\nh_count 0\ng{a=\"b\"} 1\n",
    );
    let want = [
        "g",
        "h_bucket",
        "h_count",
        "h_sum",
        "idemproxy_lease_lost_total",
    ];
    assert_eq!(exported, want.iter().map(|s| s.to_string()).collect());
}

/// `docs/operations.md` describes the alerts the rules file holds: its
/// "Metrics and alerts" section names each alert, and no other.
#[test]
fn the_operations_guide_names_every_alert_and_no_other() {
    let rules =
        std::fs::read_to_string(repo("deploy/prometheus/idemproxy-rules.yaml")).expect("rules");
    let in_rules: BTreeSet<String> = rule_queries(&rules)
        .into_iter()
        .map(|q| q.source.trim_start_matches("alert ").to_string())
        .collect();
    let guide = std::fs::read_to_string(repo("docs/operations.md")).expect("guide");
    let start = guide
        .find("## Metrics and alerts")
        .expect("a \"Metrics and alerts\" section");
    let section = &guide[start..];
    let section = &section[..section[2..].find("\n## ").map_or(section.len(), |e| e + 2)];
    let in_guide: BTreeSet<String> = section
        .split('`')
        .filter(|w| w.starts_with("Idempotency") && w.chars().all(|c| c.is_ascii_alphanumeric()))
        .map(str::to_string)
        .collect();
    assert_eq!(
        in_guide, in_rules,
        "alerts in docs/operations.md vs the rules file"
    );
}
