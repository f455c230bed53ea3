//! OpenTelemetry peers: a real OTLP receiver (tests/peers/otlp_receiver.py: the
//! `opentelemetry-proto` TraceService on grpcio, or OTLP/HTTP protobuf) run as a
//! subprocess, the spans it writes read back as [`Span`]s, and waits on them with
//! deadlines; the clients are tests/peers/otel_client.py (the OpenTelemetry
//! Python SDK with its W3C propagator) and otel_export.py (the SDK's own exporter).
//!
//! ```ignore
//! let otlp = OtlpReceiver::start().await;
//! let env = Env::builder(Backend::Redis).telemetry(&otlp.config()).binary().start().await;
//! let server = otlp.wait_for_span("the SERVER span", DEADLINE, |s| s.kind == "SERVER").await;
//! ```

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use super::{eventually, get, kill_child, peer_python, DEADLINE};

/// One span as the receiver got it (ids in lower-case hex; see otlp_receiver.py).
#[derive(Clone, Debug, Deserialize)]
pub struct Span {
    pub trace_id: String,
    pub span_id: String,
    /// "" for a root span.
    pub parent_span_id: String,
    pub name: String,
    /// "SERVER", "CLIENT", "INTERNAL", ...
    pub kind: String,
    pub attributes: serde_json::Map<String, Value>,
    pub links: Vec<SpanLink>,
    /// The resource's attributes (service.name, ...).
    pub resource: serde_json::Map<String, Value>,
    pub scope: String,
    pub status: SpanStatus,
    pub trace_state: String,
    pub flags: u32,
    pub start_time_unix_nano: u64,
    pub end_time_unix_nano: u64,
    /// Where the export came: the HTTP path (OTLP/HTTP) or the gRPC method.
    pub export_path: String,
    /// The headers (gRPC metadata) the export came with, names lowercased.
    #[serde(default)]
    pub export_headers: serde_json::Map<String, Value>,
    /// The whole line, for looking through every value at once.
    #[serde(skip)]
    pub raw: Value,
}

#[derive(Clone, Debug, Deserialize)]
pub struct SpanLink {
    pub trace_id: String,
    pub span_id: String,
    #[serde(default)]
    pub trace_state: String,
    pub attributes: serde_json::Map<String, Value>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct SpanStatus {
    /// "UNSET", "OK" or "ERROR".
    pub code: String,
    pub message: String,
}

impl Span {
    pub fn parse(line: &str) -> Result<Span, String> {
        let raw: Value = serde_json::from_str(line).map_err(|e| format!("{e}: {line}"))?;
        let mut span: Span =
            serde_json::from_value(raw.clone()).map_err(|e| format!("{e}: {line}"))?;
        span.raw = raw;
        Ok(span)
    }

    pub fn attr(&self, name: &str) -> Option<&Value> {
        self.attributes.get(name)
    }

    /// A string attribute; `None` when absent or of another type.
    pub fn attr_str(&self, name: &str) -> Option<&str> {
        self.attr(name)?.as_str()
    }

    /// A string attribute of the resource (`service.name`, ...).
    pub fn resource_str(&self, name: &str) -> Option<&str> {
        self.resource.get(name)?.as_str()
    }

    /// An integer attribute; `None` when absent or of another type.
    pub fn attr_i64(&self, name: &str) -> Option<i64> {
        self.attr(name)?.as_i64()
    }

    pub fn is_child_of(&self, parent: &Span) -> bool {
        self.trace_id == parent.trace_id && self.parent_span_id == parent.span_id
    }

    pub fn is_root(&self) -> bool {
        self.parent_span_id.is_empty()
    }

    /// Whether any of the span's values (name, attributes, links, resource,
    /// status) contains `text`.
    pub fn mentions(&self, text: &str) -> bool {
        fn walk(v: &Value, text: &str) -> bool {
            match v {
                Value::String(s) => s.contains(text),
                Value::Array(a) => a.iter().any(|v| walk(v, text)),
                Value::Object(o) => o.iter().any(|(k, v)| k.contains(text) || walk(v, text)),
                _ => false,
            }
        }
        walk(&self.raw, text)
    }

    pub fn duration(&self) -> Duration {
        Duration::from_nanos(
            self.end_time_unix_nano
                .saturating_sub(self.start_time_unix_nano),
        )
    }
}

/// Looking through what the receiver got.
pub trait Spans {
    /// The spans named `name`.
    fn named(&self, name: &str) -> Vec<&Span>;
    /// The spans of one trace.
    fn in_trace(&self, trace_id: &str) -> Vec<&Span>;
    /// The spans whose parent is `parent`.
    fn children_of(&self, parent: &Span) -> Vec<&Span>;
    /// The one child of `parent` named `name`; panics when there is none or more.
    fn child(&self, parent: &Span, name: &str) -> &Span;
    /// The span with this id.
    fn by_id(&self, span_id: &str) -> Option<&Span>;
    /// The SERVER span of the request whose client span (its parent) is `client_span_id`.
    fn server_under(&self, client_span_id: &str) -> Option<&Span>;
    /// Name, kind, ids of each span: for a failing assertion's message.
    fn outline(&self) -> String;
}

impl Spans for [Span] {
    fn named(&self, name: &str) -> Vec<&Span> {
        self.iter().filter(|s| s.name == name).collect()
    }

    fn in_trace(&self, trace_id: &str) -> Vec<&Span> {
        self.iter().filter(|s| s.trace_id == trace_id).collect()
    }

    fn children_of(&self, parent: &Span) -> Vec<&Span> {
        self.iter().filter(|s| s.is_child_of(parent)).collect()
    }

    fn child(&self, parent: &Span, name: &str) -> &Span {
        let found: Vec<&Span> = self
            .children_of(parent)
            .into_iter()
            .filter(|s| s.name == name)
            .collect();
        assert_eq!(
            found.len(),
            1,
            "one child {name:?} of {:?} ({}); spans:\n{}",
            parent.name,
            parent.span_id,
            self.outline()
        );
        found[0]
    }

    fn by_id(&self, span_id: &str) -> Option<&Span> {
        self.iter().find(|s| s.span_id == span_id)
    }

    fn server_under(&self, client_span_id: &str) -> Option<&Span> {
        self.iter()
            .find(|s| s.kind == "SERVER" && s.parent_span_id == client_span_id)
    }

    fn outline(&self) -> String {
        self.iter()
            .map(|s| {
                format!(
                    "  {} {:?} trace={} span={} parent={} links={:?} attrs={}\n",
                    s.kind,
                    s.name,
                    s.trace_id,
                    s.span_id,
                    s.parent_span_id,
                    s.links
                        .iter()
                        .map(|l| format!("{}/{}", l.trace_id, l.span_id))
                        .collect::<Vec<_>>(),
                    Value::Object(s.attributes.clone())
                )
            })
            .collect()
    }
}

/// A W3C `traceparent` taken apart: version, trace id, parent id, flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceParent {
    pub version: String,
    pub trace_id: String,
    pub parent_id: String,
    pub flags: String,
}

impl TraceParent {
    pub fn parse(value: &str) -> TraceParent {
        let parts: Vec<&str> = value.trim().split('-').collect();
        assert!(
            parts.len() == 4
                && parts[0].len() == 2
                && parts[1].len() == 32
                && parts[2].len() == 16
                && parts[3].len() == 2
                && parts
                    .iter()
                    .all(|p| p.bytes().all(|b| b.is_ascii_hexdigit())),
            "not a traceparent: {value:?}"
        );
        TraceParent {
            version: parts[0].into(),
            trace_id: parts[1].into(),
            parent_id: parts[2].into(),
            flags: parts[3].into(),
        }
    }

    pub fn sampled(&self) -> bool {
        u8::from_str_radix(&self.flags, 16).expect("hex flags") & 1 == 1
    }
}

/// A real OTLP trace receiver (tests/peers/otlp_receiver.py) as a child process.
pub struct OtlpReceiver {
    child: Option<Child>,
    pub addr: SocketAddr,
    /// "grpc" or "http/protobuf".
    pub protocol: &'static str,
    spans: Arc<Mutex<Vec<Span>>>,
    /// Lines on stdout that are not spans, and stderr: what went wrong.
    noise: Arc<Mutex<Vec<String>>>,
}

impl OtlpReceiver {
    /// OTLP/gRPC on a free loopback port.
    pub async fn start() -> OtlpReceiver {
        Self::start_with("grpc").await
    }

    /// OTLP/HTTP with protobuf bodies on a free loopback port.
    pub async fn start_http() -> OtlpReceiver {
        Self::start_with("http/protobuf").await
    }

    /// OTLP/gRPC that answers a partial success rejecting one span in `n`.
    pub async fn start_rejecting(n: u32) -> OtlpReceiver {
        Self::start_with_args("grpc", &["--reject-every", &n.to_string()]).await
    }

    async fn start_with(protocol: &'static str) -> OtlpReceiver {
        Self::start_with_args(protocol, &[]).await
    }

    async fn start_with_args(protocol: &'static str, more: &[&str]) -> OtlpReceiver {
        let python = peer_python();
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/peers/otlp_receiver.py");
        let mut child = Command::new(&python)
            .arg(&script)
            .args(["--port", "0", "--protocol", protocol])
            .args(more)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {} ({e})", python.display()));
        let spans = Arc::new(Mutex::new(Vec::new()));
        let noise = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("stderr");
        let sink = noise.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(format!("stderr: {line}"));
            }
        });
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel::<u16>();
        let (span_sink, noise_sink) = (spans.clone(), noise.clone());
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            for line in lines.by_ref() {
                let Ok(line) = line else { return };
                let v: Value = serde_json::from_str(&line).unwrap_or_default();
                if let Some(port) = v["listening"].as_u64() {
                    let _ = tx.send(port as u16);
                    break;
                }
                noise_sink.lock().unwrap().push(line);
            }
            for line in lines {
                let Ok(line) = line else { break };
                match Span::parse(&line) {
                    Ok(span) => span_sink.lock().unwrap().push(span),
                    Err(e) => noise_sink.lock().unwrap().push(e),
                }
            }
        });
        let port = tokio::task::spawn_blocking(move || rx.recv_timeout(DEADLINE))
            .await
            .expect("join");
        let port = match port {
            Ok(p) => p,
            Err(_) => {
                let mut child = Some(child);
                kill_child(&mut child);
                panic!(
                    "the OTLP receiver did not start ({}; tests/run.sh installs grpcio and opentelemetry-proto into target/peers-venv):\n{}",
                    python.display(),
                    noise.lock().unwrap().join("\n")
                );
            }
        };
        OtlpReceiver {
            child: Some(child),
            addr: ([127, 0, 0, 1], port).into(),
            protocol,
            spans,
            noise,
        }
    }

    /// The base URL an exporter is given: `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The `[telemetry]` lines that send the proxy's spans here.
    pub fn config(&self) -> String {
        format!(
            "otlp_endpoint = \"{}\"\notlp_protocol = \"{}\"\n",
            self.endpoint(),
            self.protocol
        )
    }

    /// Every span received so far, in arrival order.
    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    /// What the receiver said besides spans (stderr, lines it could not read).
    pub fn noise(&self) -> Vec<String> {
        self.noise.lock().unwrap().clone()
    }

    /// Waits until `done` holds for all the spans received, and returns them;
    /// fails the test after `deadline`, showing what did come.
    pub async fn wait_for_spans(
        &self,
        what: &str,
        deadline: Duration,
        done: impl Fn(&[Span]) -> bool,
    ) -> Vec<Span> {
        let until = tokio::time::Instant::now() + deadline;
        loop {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            if tokio::time::Instant::now() >= until {
                panic!(
                    "timed out after {deadline:?} waiting for spans: {what}; received {}:\n{}receiver said:\n{}",
                    spans.len(),
                    spans.outline(),
                    self.noise().join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for one span `matches` accepts and returns it.
    pub async fn wait_for_span(
        &self,
        what: &str,
        deadline: Duration,
        matches: impl Fn(&Span) -> bool,
    ) -> Span {
        let spans = self
            .wait_for_spans(what, deadline, |all| all.iter().any(&matches))
            .await;
        spans.into_iter().find(|s| matches(s)).expect("found")
    }

    /// Waits for the SERVER span whose parent is the client span `client_span_id`.
    pub async fn wait_for_server_span(&self, client_span_id: &str) -> Span {
        self.wait_for_span(
            &format!("the SERVER span under client span {client_span_id}"),
            DEADLINE,
            |s| s.kind == "SERVER" && s.parent_span_id == client_span_id,
        )
        .await
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        kill_child(&mut self.child);
    }
}

/// The answer of tests/peers/otel_client.py: the client's span and the response.
#[derive(Clone, Debug)]
pub struct OtelCall {
    pub trace_id: String,
    pub span_id: String,
    pub sampled: bool,
    /// What the client sent, as its propagator wrote it.
    pub traceparent: Option<String>,
    pub status: u16,
    pub headers: serde_json::Map<String, Value>,
    pub body: String,
}

impl OtelCall {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name)?.as_str()
    }

    pub fn is_replay(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}

/// How tests/peers/otel_client.py starts its span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parent {
    /// A sampled client span (the SDK's ALWAYS_ON).
    Sampled,
    /// A client span that is not sampled (ALWAYS_OFF): flags 00.
    Unsampled,
    /// No span, no traceparent.
    None,
}

/// One request made by the OpenTelemetry Python SDK inside a client span:
/// `method url` with `Idempotency-Key: key` (when given), `body` and `headers`
/// ("Name: value").
pub async fn otel_call(
    method: &str,
    url: &str,
    key: Option<&str>,
    body: &str,
    headers: &[&str],
    parent: Parent,
) -> OtelCall {
    let mut args: Vec<String> = vec![
        url.into(),
        "--method".into(),
        method.into(),
        "--body".into(),
        body.into(),
    ];
    if let Some(k) = key {
        args.extend(["--key".into(), k.into()]);
    }
    for h in headers {
        args.extend(["--header".into(), (*h).into()]);
    }
    match parent {
        Parent::Sampled => {}
        Parent::Unsampled => args.push("--unsampled".into()),
        Parent::None => args.push("--no-span".into()),
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let v = super::run_peer("otel_client.py", &args).await;
    OtelCall {
        trace_id: v["trace_id"].as_str().unwrap_or_default().into(),
        span_id: v["span_id"].as_str().unwrap_or_default().into(),
        sampled: v["sampled"].as_bool().unwrap_or(false),
        traceparent: v["traceparent"].as_str().map(String::from),
        status: v["status"].as_u64().expect("status") as u16,
        headers: v["headers"].as_object().cloned().unwrap_or_default(),
        body: v["body"].as_str().unwrap_or_default().into(),
    }
}

/// Renders `spans` with tests/peers/trace_view.py: its summary (spans, traces,
/// links drawn, links_elsewhere) and the SVG. With `IDEMPROXY_TRACE_VIEW=DIR`
/// the SVG is kept there as `<name>.svg` (for the docs).
pub async fn trace_view(name: &str, spans: &[Span]) -> (Value, String) {
    use std::io::Write;
    let mut lines = tempfile::NamedTempFile::new().expect("temp file");
    for s in spans {
        writeln!(lines, "{}", s.raw).expect("write spans");
    }
    let svg_path = match std::env::var_os("IDEMPROXY_TRACE_VIEW") {
        Some(dir) => PathBuf::from(dir).join(format!("{name}.svg")),
        None => lines.path().with_extension("svg"),
    };
    let summary = super::run_peer(
        "trace_view.py",
        &[
            lines.path().to_str().unwrap(),
            "--out",
            svg_path.to_str().unwrap(),
            "--title",
            name,
        ],
    )
    .await;
    let svg = std::fs::read_to_string(&svg_path).expect("the SVG");
    if std::env::var_os("IDEMPROXY_TRACE_VIEW").is_none() {
        let _ = std::fs::remove_file(&svg_path);
    }
    (summary, svg)
}

/// The sum of every series of the metric family `name` (with or without labels)
/// on the admin listener's /metrics; 0 when absent.
pub async fn metric_family_sum(admin: SocketAddr, name: &str) -> f64 {
    let r = get(&format!("http://{admin}/metrics"))
        .await
        .expect("metrics");
    let text = String::from_utf8_lossy(&r.body);
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = match rest.chars().next()? {
                ' ' => rest,
                '{' => &rest[rest.find('}')? + 1..],
                _ => return None,
            };
            value.split_whitespace().next()?.parse::<f64>().ok()
        })
        .sum()
}

/// Waits until the metric family `name` sums to more than `above`; returns the sum.
pub async fn metric_family_above(admin: SocketAddr, name: &str, above: f64) -> f64 {
    eventually(&format!("{name} > {above}"), DEADLINE, || async move {
        let v = metric_family_sum(admin, name).await;
        (v > above).then_some(v)
    })
    .await
}

/// The resident set size of process `pid`, in KiB (Linux: /proc/PID/status VmRSS).
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}
