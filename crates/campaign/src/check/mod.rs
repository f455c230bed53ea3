//! The checker: judges a history (`history.rs`) and says what went wrong,
//! key by key, with the shortest history that shows each violation.
//!
//! Pure: events in, a [`Report`] out. Every count in `violations` is a
//! number of keys (a key that got the wrong answer ten times is one
//! `wrong_answer`; its explanation says how many answers).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::Serialize;

use crate::history::{AtRisk, Event, Phase, Run};

mod answers;
mod index;
mod replay;
mod report;
mod settle;
mod twice;

pub(crate) use report::render_text;

/// The violation kinds, in the order they are judged and reported.
pub(crate) const KINDS: [&str; 5] = [
    EXECUTED_TWICE,
    WRONG_ANSWER,
    OTHER_KEY_ANSWER,
    NOT_REPLAYED,
    NOT_SETTLED,
];
pub(crate) const EXECUTED_TWICE: &str = "executed_twice";
pub(crate) const WRONG_ANSWER: &str = "wrong_answer";
pub(crate) const OTHER_KEY_ANSWER: &str = "other_key_answer";
pub(crate) const NOT_REPLAYED: &str = "not_replayed";
pub(crate) const NOT_SETTLED: &str = "not_settled";

/// At most this many details are kept per kind (the shortest histories);
/// the rest are counted in `details_omitted`.
pub(crate) const DETAILS_PER_KIND: usize = 100;

/// How far before a key's first execution a store fault still excuses a
/// second one (the record may have been written just before the fault).
pub(crate) const AT_RISK_LEAD_MS: u64 = 1000;

/// Fault kinds on a proxy's link to the store that can keep its writes
/// from landing within the lease: a cut, a partition, a stall, one way
/// down, and the campaign's `loss`, whose lost segments are held 200–1000 ms,
/// as long as a store operation's `op_timeout` (a `delay` only slows them).
const LINK_LOSS_KINDS: [&str; 5] = ["cut", "partition", "stall", "one_way", "loss"];

/// Fault kinds on a store that may lose a record (with `AtRisk::StoreFailover`).
const STORE_LOSS_KINDS: [&str; 4] = ["kill", "pause", "failover", "partition"];

#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct Report {
    /// The run's seed (`None` when the history has no `Run` line).
    pub seed: Option<u64>,
    /// Invoke events.
    pub operations: u64,
    /// Distinct keys (invoked or executed).
    pub keys: u64,
    /// Exec events.
    pub executions: u64,
    /// Answers and errors by outcome (see [`outcome_name`]).
    pub answers_by_outcome: BTreeMap<String, u64>,
    /// Fault starts by kind.
    pub faults_by_kind: BTreeMap<String, u64>,
    /// Keys by violation kind; every kind of [`KINDS`] is present.
    pub violations: BTreeMap<String, u64>,
    /// Keys that executed twice (or were not replayed) but are excused by a
    /// store fault under `at_risk: store_failover`.
    pub keys_at_risk: u64,
    pub keys_at_risk_list: Vec<String>,
    /// Keys answered by the upstream whose record could not be stored: a
    /// store fault, or a fault of the proxy that ran it or of its link to
    /// the store, while the record was being stored; their retries got 502
    /// `outcome-unknown` (never a second execution). The documented
    /// degradation, reported apart.
    pub answers_not_kept: u64,
    pub answers_not_kept_list: Vec<String>,
    /// Lines the checker could not place: an answer or error whose op has no
    /// invoke, an op invoked twice, a fault end without a start, no `Run`.
    pub malformed: u64,
    pub details: Vec<Violation>,
    /// Details left out past [`DETAILS_PER_KIND`] for a kind.
    pub details_omitted: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct Violation {
    pub kind: String,
    pub key: String,
    pub explanation: String,
    /// The Run line, every event of the key, the executions its answers
    /// name, the faults (start and end) overlapping the key's time span and
    /// the `Healed` line, in time order.
    pub history: Vec<Event>,
}

impl Report {
    /// No violation of any kind.
    pub(crate) fn ok(&self) -> bool {
        self.violations.values().all(|&n| n == 0)
    }
}

/// The coarse outcome of an answer or error (the timeline's colours).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Outcome {
    /// An upstream answer (names an execution), not replayed.
    Executed,
    /// An upstream answer replayed by the proxy.
    Replayed,
    /// 409 (a duplicate while the first is in flight).
    InFlight,
    /// A proxy's 5xx problem document.
    Proxy5xx,
    ErrorTimeout,
    ErrorConnect,
    /// Anything else: other statuses, other errors.
    Other,
}

impl Outcome {
    pub(crate) const ALL: [Outcome; 7] = [
        Outcome::Executed,
        Outcome::Replayed,
        Outcome::InFlight,
        Outcome::Proxy5xx,
        Outcome::ErrorTimeout,
        Outcome::ErrorConnect,
        Outcome::Other,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::Replayed => "replayed",
            Outcome::InFlight => "409 in flight",
            Outcome::Proxy5xx => "proxy 5xx",
            Outcome::ErrorTimeout => "error timeout",
            Outcome::ErrorConnect => "error connect",
            Outcome::Other => "other",
        }
    }
}

/// The coarse outcome of an `Answer` or `Error`; `None` for other events.
pub(crate) fn outcome(e: &Event) -> Option<Outcome> {
    match e {
        Event::Answer {
            status,
            replayed,
            exec,
            ..
        } => Some(match (exec.is_some(), *replayed, *status) {
            (true, false, _) => Outcome::Executed,
            (true, true, _) => Outcome::Replayed,
            (false, _, 409) => Outcome::InFlight,
            (false, _, 500..=599) => Outcome::Proxy5xx,
            _ => Outcome::Other,
        }),
        Event::Error { error, .. } => Some(match error.as_str() {
            "timeout" => Outcome::ErrorTimeout,
            "connect" => Outcome::ErrorConnect,
            _ => Outcome::Other,
        }),
        _ => None,
    }
}

/// The report's outcome name of an `Answer` or `Error`: `executed`,
/// `replayed`, `in_flight_409`, `proxy_409_<problem>`,
/// `proxy_<status>[_<problem>]` (5xx), `other_4xx`, `2xx_without_exec`,
/// `other_<status>`, `error_<error>`.
pub(crate) fn outcome_name(e: &Event) -> Option<String> {
    match e {
        Event::Answer {
            status,
            replayed,
            exec,
            problem,
            ..
        } => Some(match (exec.is_some(), *replayed, *status) {
            (true, false, _) => "executed".to_string(),
            (true, true, _) => "replayed".to_string(),
            (false, _, 409) => match problem.as_deref() {
                None | Some("in-flight") => "in_flight_409".to_string(),
                Some(p) => format!("proxy_409_{p}"),
            },
            (false, _, s @ 500..=599) => match problem {
                Some(p) => format!("proxy_{s}_{p}"),
                None => format!("proxy_{s}"),
            },
            (false, _, 400..=499) => "other_4xx".to_string(),
            (false, _, 200..=299) => "2xx_without_exec".to_string(),
            (false, _, s) => format!("other_{s}"),
        }),
        Event::Error { error, .. } => Some(format!("error_{error}")),
        _ => None,
    }
}

/// A fault from its start to its end (`None`: never ended).
struct Span {
    kind: String,
    target: String,
    start: u64,
    end: Option<u64>,
    start_ix: usize,
    end_ix: Option<usize>,
}

impl Span {
    fn overlaps(&self, from: u64, to: u64) -> bool {
        self.start <= to && self.end.is_none_or(|end| end >= from)
    }

    fn may_lose_store_records(&self) -> bool {
        self.target.starts_with("store") && STORE_LOSS_KINDS.contains(&self.kind.as_str())
    }
}

#[derive(Default)]
struct KeyData {
    /// Indices (in the sorted history) of its invokes, answers, errors, execs.
    events: Vec<usize>,
    execs: Vec<usize>,
    /// Answers (index, phase of their invoke).
    answers: Vec<(usize, Phase)>,
    invoked_in_load: bool,
}

/// One violation found, before its history is laid out.
struct Found {
    kind: &'static str,
    key: String,
    explanation: String,
    /// Events outside the key's own to show (other keys' executions).
    extra: Vec<usize>,
}

/// The history indexed for judging: sorted events, the run's settings,
/// the faults as spans and each key's events. Built by `index.rs`.
struct History<'a> {
    /// The events sorted by time (the `Run` line first).
    ev: Vec<&'a Event>,
    run: Option<&'a Run>,
    at_risk: AtRisk,
    settle_bound: u64,
    run_ix: Option<usize>,
    healed: Option<(usize, u64)>,
    faults: Vec<Span>,
    faults_by_kind: BTreeMap<String, u64>,
    /// The proxy each op was sent to.
    op_proxy: HashMap<u64, u32>,
    keys: BTreeMap<&'a str, KeyData>,
    /// Indices of the Exec events of each exec id.
    exec_ix: HashMap<&'a str, Vec<usize>>,
    answers_by_outcome: BTreeMap<String, u64>,
    operations: u64,
    executions: u64,
    malformed: u64,
}

/// What the per-key judges found: violations, and keys excused.
#[derive(Default)]
struct Verdicts<'a> {
    found: Vec<Found>,
    at_risk_keys: BTreeSet<&'a str>,
    not_kept_keys: BTreeSet<&'a str>,
}

/// Judges a history. Events may come in any order: they are sorted by time
/// (stably, the `Run` line first).
pub(crate) fn check(events: &[Event]) -> Report {
    let h = History::index(events);
    let mut v = Verdicts::default();
    for (&key, k) in &h.keys {
        let key_at_risk = h.executed_twice(key, k, &mut v);
        h.wrong_answers(key, k, &mut v);
        let settled_final = h.settled_final(k);
        h.not_replayed(key, k, key_at_risk, &settled_final, &mut v);
        h.not_settled(key, k, &settled_final, &mut v);
    }
    h.report(v)
}

/// An answer that settles a key: not 409, not 503 (errors are not answers).
fn settles(e: &Event) -> bool {
    matches!(e, Event::Answer { status, .. } if *status != 409 && *status != 503)
}

/// The execution an upstream answer names, with its status and body.
fn answer_exec(e: &Event) -> Option<(&str, u16, &str)> {
    match e {
        Event::Answer {
            exec: Some(x),
            status,
            body_sha,
            ..
        } => Some((x, *status, body_sha)),
        _ => None,
    }
}

fn exec_id(e: &Event) -> String {
    match e {
        Event::Exec { exec, .. } => exec.clone(),
        _ => String::new(),
    }
}

/// The first 12 hex digits of a hash, enough to tell two apart.
fn short(sha: &str) -> &str {
    sha.get(..12).unwrap_or(sha)
}

/// The first item, and how many there are: one line.
fn summarize(items: &[String], what: &str) -> String {
    match items {
        [one] => one.clone(),
        [first, ..] => format!("{first} (and {} more {what})", items.len() - 1),
        [] => String::new(),
    }
}

#[cfg(test)]
mod tests;
