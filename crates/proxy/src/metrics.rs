//! Prometheus metrics (prometheus-client): what operators watch, named per the Prometheus conventions.

use std::fmt;
use std::sync::OnceLock;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry, Unit};

/// What became of a request; the `outcome` label of `idemproxy_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    Passthrough,
    Forwarded,
    Replayed,
    Conflict,
    Mismatch,
    MissingKey,
    InvalidKey,
    TooLarge,
    StoreError,
    UpstreamError,
    Released,
    StoreBypass,
    NotStored,
    /// The request itself was unusable (a body that could not be read).
    BadRequest,
    /// The record under the key could not be read (docs/reference/failures.md#unreadable):
    /// answered 500, never forwarded.
    Unreadable,
    /// No room in the memory budget (docs/reference/behaviour.md#memory-budget): answered 503
    /// `proxy-busy`.
    Busy,
    /// An HTTP/1.1 `Upgrade` (a WebSocket) the upstream accepted with 101: now a tunnel.
    Upgraded,
}

/// How many outcomes there are (an outcome added after `Upgraded` is
/// counted through the family's lookup until this names it).
const OUTCOMES: usize = Outcome::Upgraded as usize + 1;

/// Tells one `Metrics` from another (a route's series belong to one).
static METRICS_IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A protected route's `idemproxy_requests` series by outcome, kept beside
/// the route once found: counting a request then hashes no label and takes
/// no lock (the family's lookup is a SipHash of the route name and a
/// read lock). They belong to the first `Metrics` that counts the route;
/// any other counts through the family. A clone starts empty.
#[derive(Default)]
pub struct RouteSeries(OnceLock<(u64, [OnceLock<Counter>; OUTCOMES])>);

impl Clone for RouteSeries {
    fn clone(&self) -> Self {
        RouteSeries::default()
    }
}

impl std::fmt::Debug for RouteSeries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RouteSeries")
    }
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Passthrough => "passthrough",
            Outcome::Forwarded => "forwarded",
            Outcome::Replayed => "replayed",
            Outcome::Conflict => "conflict",
            Outcome::Mismatch => "mismatch",
            Outcome::MissingKey => "missing_key",
            Outcome::InvalidKey => "invalid_key",
            Outcome::TooLarge => "too_large",
            Outcome::StoreError => "store_error",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Released => "released",
            Outcome::StoreBypass => "store_bypass",
            Outcome::NotStored => "not_stored",
            Outcome::BadRequest => "bad_request",
            Outcome::Unreadable => "unreadable",
            Outcome::Busy => "busy",
            Outcome::Upgraded => "upgraded",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteOutcome {
    route: RouteName,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabel {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: RouteName,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HandlingLabel {
    route: RouteName,
    handling: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DegradedLabel {
    route: RouteName,
    result: &'static str,
}

/// A completion that did not end as the whole record, acknowledged where
/// `wait_replicas` asks for it; the `result` label of
/// `idemproxy_completions_degraded_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Degraded {
    /// Written on the master, fewer than `wait_replicas` replicas acknowledged
    /// it (counted for each `WAIT` that fell short).
    Unreplicated,
    /// The whole record could not be stored; the small record that says so
    /// was (retries get the 410 `response-not-stored`).
    NotKept,
    /// Nothing could be stored: the key is freed when its lease runs out.
    Lost,
}

impl Degraded {
    fn as_str(self) -> &'static str {
        match self {
            Degraded::Unreplicated => "unreplicated",
            Degraded::NotKept => "not_kept",
            Degraded::Lost => "lost",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabel {
    worker: String,
}

/// One unit of a gauge while this lives: raised when made, lowered when
/// dropped, also when the task holding it is dropped half-way.
pub struct Counted(Gauge);

impl Counted {
    pub fn new(gauge: &Gauge) -> Counted {
        gauge.inc();
        Counted(gauge.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The store operations every protected request makes, one of them at least.
const HOT_OPS: [&str; 4] = ["reserve", "complete", "renew", "release"];

/// Every metric idemproxy exports; cheap to share (the handles are reference-counted).
pub struct Metrics {
    registry: Registry,
    requests: Family<RouteOutcome, Counter>,
    shadow_outcomes: Family<RouteOutcome, Counter>,
    upstream_duration: Histogram,
    store_duration: Family<OpLabel, Histogram>,
    /// `store_duration`'s series of the operations a request makes, taken
    /// from the family on first use: found without hashing the label and
    /// taking the family's lock each time.
    store_seen: [OnceLock<Histogram>; HOT_OPS.len()],
    store_errors: Family<OpLabel, Counter>,
    /// `requests`' series of unprotected requests (route `""`), by outcome,
    /// taken from the family on first use.
    unprotected: [OnceLock<Counter>; OUTCOMES],
    /// Whose a route's `RouteSeries` are.
    id: u64,
    lease_lost: Family<RouteLabel, Counter>,
    lease_expired: Family<HandlingLabel, Counter>,
    degraded: Family<DegradedLabel, Counter>,
    worker_connections: Family<WorkerLabel, Gauge>,
    pub inflight: Gauge,
    pub parked: Gauge,
    pub tunnels: Gauge,
    pub store_up: Gauge,
    /// The memory budget in use; set when the metrics are read.
    pub buffered_bytes: Gauge,
    /// Spans that could not be exported (a full queue, a collector slow,
    /// down or refusing); zero while tracing is off.
    pub spans_dropped: Counter,
}

/// The request path's metrics, registered by [`Traffic::register`]: what
/// each route's requests came to, what shadow mode would have done, and how
/// long the upstream took (named, so that two families of the same type
/// cannot trade places).
struct Traffic {
    requests: Family<RouteOutcome, Counter>,
    shadow_outcomes: Family<RouteOutcome, Counter>,
    upstream_duration: Histogram,
}

impl Traffic {
    fn register(registry: &mut Registry) -> Traffic {
        let requests = registered(
            registry,
            "requests",
            "Requests by route (\"\" when unprotected) and outcome",
            Family::<RouteOutcome, Counter>::default(),
        );
        let shadow_outcomes = registered(
            registry,
            "shadow_outcomes",
            "What enforcement would have done on routes in shadow mode",
            Family::<RouteOutcome, Counter>::default(),
        );
        let upstream_duration = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        registry.register_with_unit(
            "upstream_duration",
            "Time from sending a request upstream to the end of its response headers",
            Unit::Seconds,
            upstream_duration.clone(),
        );
        Traffic {
            requests,
            shadow_outcomes,
            upstream_duration,
        }
    }
}

/// The store's metrics, registered by [`StoreMetrics::register`]: its round
/// trips and failures by operation, and the completions it refused or
/// degraded, by route.
struct StoreMetrics {
    store_duration: Family<OpLabel, Histogram>,
    store_errors: Family<OpLabel, Counter>,
    lease_lost: Family<RouteLabel, Counter>,
    lease_expired: Family<HandlingLabel, Counter>,
    degraded: Family<DegradedLabel, Counter>,
}

impl StoreMetrics {
    fn register(registry: &mut Registry) -> StoreMetrics {
        let store_duration = Family::<OpLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.00005, 2.0, 16))
        });
        registry.register_with_unit(
            "store_duration",
            "Store round trips by operation",
            Unit::Seconds,
            store_duration.clone(),
        );
        let store_errors = registered(
            registry,
            "store_errors",
            "Store operations that failed or timed out",
            Family::<OpLabel, Counter>::default(),
        );
        let lease_lost = registered(
            registry,
            "lease_lost",
            "Completions refused because another owner held the key",
            Family::<RouteLabel, Counter>::default(),
        );
        let lease_expired = registered(
            registry,
            "lease_expired",
            "Keys whose owner vanished mid-request (its lease ran out), taken over by the next request with the key, by route and handling (unknown_outcome, re_execute)",
            Family::<HandlingLabel, Counter>::default(),
        );
        let degraded = registered(
            registry,
            "completions_degraded",
            "Completions that did not end as the whole record on enough replicas, by route and result (unreplicated, not_kept, lost)",
            Family::<DegradedLabel, Counter>::default(),
        );
        StoreMetrics {
            store_duration,
            store_errors,
            lease_lost,
            lease_expired,
            degraded,
        }
    }
}

/// The gauges, registered by [`Gauges::register`]: named, not a tuple of
/// six, so that two of the same type cannot trade places.
struct Gauges {
    worker_connections: Family<WorkerLabel, Gauge>,
    inflight: Gauge,
    parked: Gauge,
    tunnels: Gauge,
    store_up: Gauge,
    buffered_bytes: Gauge,
}

impl Gauges {
    /// The gauges: worker connections, in-flight requests, parked connections,
    /// tunnels, the store's health and the bytes buffered.
    fn register(registry: &mut Registry) -> Gauges {
        let worker_connections = registered(
            registry,
            "worker_connections",
            "Client connections each worker thread serves now (runtime = \"per_thread\")",
            Family::<WorkerLabel, Gauge>::default(),
        );
        let inflight = registered(
            registry,
            "inflight",
            "Requests being handled now",
            Gauge::default(),
        );
        let parked = registered(
            registry,
            "parked_connections",
            "Idle HTTP/1.1 client connections parked: their HTTP state and buffers freed until the client sends again",
            Gauge::default(),
        );
        let tunnels = registered(
            registry,
            "tunnels",
            "Upgrade tunnels open (WebSocket and others); each holds its client connection's slot",
            Gauge::default(),
        );
        let store_up = registered(
            registry,
            "store_up",
            "1 when the last store operation or health ping succeeded",
            Gauge::default(),
        );
        let buffered_bytes = Gauge::default();
        registry.register_with_unit(
            "buffered",
            "Bytes held for protected bodies, recorded responses and replays (bounded by max_buffered)",
            Unit::Bytes,
            buffered_bytes.clone(),
        );
        Gauges {
            worker_connections,
            inflight,
            parked,
            tunnels,
            store_up,
            buffered_bytes,
        }
    }
}

/// `metric`, registered under `name` with `help`.
fn registered<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("idemproxy");
        // Registered in this order, which is the order of the exposition.
        let Traffic {
            requests,
            shadow_outcomes,
            upstream_duration,
        } = Traffic::register(&mut registry);
        let StoreMetrics {
            store_duration,
            store_errors,
            lease_lost,
            lease_expired,
            degraded,
        } = StoreMetrics::register(&mut registry);
        let Gauges {
            worker_connections,
            inflight,
            parked,
            tunnels,
            store_up,
            buffered_bytes,
        } = Gauges::register(&mut registry);
        let spans_dropped = registered(
            &mut registry,
            "spans_dropped",
            "Spans not exported: no room in the export queue, or the collector did not take them (docs/telemetry.md)",
            Counter::default(),
        );
        Metrics {
            spans_dropped,
            buffered_bytes,
            registry,
            requests,
            shadow_outcomes,
            upstream_duration,
            store_duration,
            store_seen: Default::default(),
            store_errors,
            unprotected: Default::default(),
            id: METRICS_IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            lease_lost,
            lease_expired,
            degraded,
            worker_connections,
            inflight,
            parked,
            tunnels,
            store_up,
        }
    }

    /// The connection gauges of `n` worker threads, `worker` "1" to "n".
    pub(crate) fn worker_gauges(&self, n: usize) -> Vec<Gauge> {
        (1..=n)
            .map(|w| {
                let label = WorkerLabel {
                    worker: w.to_string(),
                };
                self.worker_connections.get_or_create(&label).clone()
            })
            .collect()
    }

    /// Counts a request on a protected route, its counters found once in
    /// the route's `series` (kept by the route table, passed in here).
    pub(crate) fn request_on(&self, route: &RouteName, series: &RouteSeries, outcome: Outcome) {
        let (owner, series) = series.0.get_or_init(|| (self.id, Default::default()));
        match series.get(outcome as usize) {
            Some(s) if *owner == self.id => {
                let counter = s.get_or_init(|| {
                    let label = RouteOutcome {
                        route: route.clone(),
                        outcome: outcome.as_str(),
                    };
                    self.requests.get_or_create(&label).clone()
                });
                counter.inc();
            }
            _ => self.request(route, outcome),
        }
    }

    pub fn request(&self, route: &RouteName, outcome: Outcome) {
        let label = || RouteOutcome {
            route: route.clone(),
            outcome: outcome.as_str(),
        };
        match self.unprotected.get(outcome as usize) {
            // Unprotected requests (most of them): their series found
            // without hashing the label and taking the family's lock.
            Some(series) if route.is_empty() => {
                series
                    .get_or_init(|| self.requests.get_or_create(&label()).clone())
                    .inc();
            }
            _ => {
                self.requests.get_or_create(&label()).inc();
            }
        }
    }

    pub(crate) fn shadow(&self, route: &RouteName, outcome: Outcome) {
        self.shadow_outcomes
            .get_or_create(&RouteOutcome {
                route: route.clone(),
                outcome: outcome.as_str(),
            })
            .inc();
    }

    pub fn upstream(&self, took: Duration) {
        self.upstream_duration.observe(took.as_secs_f64());
    }

    pub fn store_op(&self, op: &'static str, took: Duration, ok: bool) {
        let took = took.as_secs_f64();
        match HOT_OPS.iter().position(|&hot| hot == op) {
            Some(i) => self.store_seen[i]
                .get_or_init(|| self.store_duration.get_or_create(&OpLabel { op }).clone())
                .observe(took),
            None => self
                .store_duration
                .get_or_create(&OpLabel { op })
                .observe(took),
        }
        if !ok {
            self.store_errors.get_or_create(&OpLabel { op }).inc();
        }
        self.store_up.set(i64::from(ok));
    }

    /// A sweep of expired PostgreSQL rows that failed (counted as a store
    /// error of the operation `sweep`; `store_up` is left to the requests).
    pub fn store_sweep_failed(&self) {
        self.store_errors
            .get_or_create(&OpLabel { op: "sweep" })
            .inc();
    }

    pub(crate) fn lease_lost(&self, route: &RouteName) {
        self.lease_lost
            .get_or_create(&RouteLabel {
                route: route.clone(),
            })
            .inc();
    }

    /// A vanished owner's key taken over; `handling`: `unknown_outcome` or `re_execute`.
    pub(crate) fn lease_expired(&self, route: &RouteName, handling: &'static str) {
        self.lease_expired
            .get_or_create(&HandlingLabel {
                route: route.clone(),
                handling,
            })
            .inc();
    }

    pub(crate) fn degraded(&self, route: &RouteName, result: Degraded) {
        self.degraded
            .get_or_create(&DegradedLabel {
                route: route.clone(),
                result: result.as_str(),
            })
            .inc();
    }

    /// The OpenMetrics text exposition (Prometheus reads it).
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(8192);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// A route's name: shared, so that metrics labels and log fields cost no allocation per request.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RouteName(std::sync::Arc<str>);

impl RouteName {
    pub fn new(name: &str) -> Self {
        RouteName(std::sync::Arc::from(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for RouteName {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RouteName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl PartialEq<&str> for RouteName {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl prometheus_client::encoding::EncodeLabelValue for RouteName {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder,
    ) -> Result<(), fmt::Error> {
        fmt::Write::write_str(encoder, &self.0)
    }
}

/// The store (its own crate) reports each operation's time and outcome here.
impl idemproxy_store::StoreMetrics for Metrics {
    fn store_op(&self, op: &'static str, took: Duration, ok: bool) {
        Metrics::store_op(self, op, took, ok);
    }

    fn store_sweep_failed(&self) {
        Metrics::store_sweep_failed(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `idemproxy_requests` line of one route and outcome.
    fn count(m: &Metrics, outcome: &str) -> Option<String> {
        let want = format!("route=\"payments\",outcome=\"{outcome}\"");
        m.encode()
            .lines()
            .find(|l| l.starts_with("idemproxy_requests_total") && l.contains(&want))
            .map(|l| l.rsplit(' ').next().unwrap_or("").to_string())
    }

    #[test]
    fn a_routes_own_series_count_in_its_metrics_and_no_other() {
        let (a, b) = (Metrics::new(), Metrics::new());
        let (name, series) = (RouteName::new("payments"), RouteSeries::default());
        // `a` counts first: the route keeps `a`'s series.
        a.request_on(&name, &series, Outcome::Replayed);
        a.request_on(&name, &series, Outcome::Replayed);
        a.request_on(&name, &series, Outcome::Forwarded);
        // `b` is not `a`: its counts go through its own family.
        b.request_on(&name, &series, Outcome::Replayed);
        // The family's lookup and the kept series are one series.
        a.request(&name, Outcome::Replayed);
        assert_eq!(count(&a, "replayed").as_deref(), Some("3"));
        assert_eq!(count(&a, "forwarded").as_deref(), Some("1"));
        assert_eq!(count(&b, "replayed").as_deref(), Some("1"));
        assert_eq!(count(&b, "forwarded"), None);
        // A clone of the route's series (another configuration's) starts empty.
        let again = series.clone();
        b.request_on(&name, &again, Outcome::Forwarded);
        assert_eq!(count(&b, "forwarded").as_deref(), Some("1"));
        assert_eq!(count(&a, "forwarded").as_deref(), Some("1"));
    }
}
