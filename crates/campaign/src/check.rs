//! The checker: judges a history (`history.rs`) and says what went wrong,
//! key by key, with the shortest history that shows each violation.
//!
//! Pure: events in, a [`Report`] out. Every count in `violations` is a
//! number of keys (a key that got the wrong answer ten times is one
//! `wrong_answer`; its explanation says how many answers).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::Serialize;

use crate::history::{AtRisk, Event, FaultPhase, Phase, Run};

/// The violation kinds, in the order they are judged and reported.
pub const KINDS: [&str; 5] = [
    EXECUTED_TWICE,
    WRONG_ANSWER,
    OTHER_KEY_ANSWER,
    NOT_REPLAYED,
    NOT_SETTLED,
];
pub const EXECUTED_TWICE: &str = "executed_twice";
pub const WRONG_ANSWER: &str = "wrong_answer";
pub const OTHER_KEY_ANSWER: &str = "other_key_answer";
pub const NOT_REPLAYED: &str = "not_replayed";
pub const NOT_SETTLED: &str = "not_settled";

/// At most this many details are kept per kind (the shortest histories);
/// the rest are counted in `details_omitted`.
pub const DETAILS_PER_KIND: usize = 100;

/// How far before a key's first execution a store fault still excuses a
/// second one (the record may have been written just before the fault).
pub const AT_RISK_LEAD_MS: u64 = 1000;

/// Fault kinds on a proxy's link to the store that can keep its writes
/// from landing within the lease: a cut, a partition, a stall, one way
/// down, and the campaign's `loss`, whose lost segments are held 200–1000 ms,
/// as long as a store operation's `op_timeout` (a `delay` only slows them).
const LINK_LOSS_KINDS: [&str; 5] = ["cut", "partition", "stall", "one_way", "loss"];

/// Fault kinds on a store that may lose a record (with `AtRisk::StoreFailover`).
const STORE_LOSS_KINDS: [&str; 4] = ["kill", "pause", "failover", "partition"];

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
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
pub struct Violation {
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
    pub fn ok(&self) -> bool {
        self.violations.values().all(|&n| n == 0)
    }
}

/// The coarse outcome of an answer or error (the timeline's colours).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Outcome {
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
    pub const ALL: [Outcome; 7] = [
        Outcome::Executed,
        Outcome::Replayed,
        Outcome::InFlight,
        Outcome::Proxy5xx,
        Outcome::ErrorTimeout,
        Outcome::ErrorConnect,
        Outcome::Other,
    ];

    pub fn label(self) -> &'static str {
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
pub fn outcome(e: &Event) -> Option<Outcome> {
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
pub fn outcome_name(e: &Event) -> Option<String> {
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

/// Judges a history. Events may come in any order: they are sorted by time
/// (stably, the `Run` line first).
pub fn check(events: &[Event]) -> Report {
    let mut ev: Vec<&Event> = events.iter().collect();
    ev.sort_by_key(|e| (!matches!(e, Event::Run(_)), e.t()));

    let mut malformed = 0u64;
    let run: Option<&Run> = ev.iter().find_map(|e| match e {
        Event::Run(r) => Some(r),
        _ => None,
    });
    if run.is_none() {
        malformed += 1;
    }
    let at_risk = run.map_or(AtRisk::Never, |r| r.at_risk);
    let settle_bound = run.map_or(0, |r| r.settle_bound_ms);
    let run_ix = ev.iter().position(|e| matches!(e, Event::Run(_)));
    let healed: Option<(usize, u64)> = ev.iter().enumerate().find_map(|(i, e)| match e {
        Event::Healed { t } => Some((i, *t)),
        _ => None,
    });

    // Faults, paired by id.
    let mut faults: Vec<Span> = Vec::new();
    let mut faults_by_kind: BTreeMap<String, u64> = BTreeMap::new();
    let mut open: HashMap<u32, Vec<usize>> = HashMap::new();
    // Invokes first: an answer stamped before its invoke still finds it.
    let mut ops: HashMap<u64, (&str, Phase)> = HashMap::new();
    let mut op_proxy: HashMap<u64, u32> = HashMap::new();
    let mut keys: BTreeMap<&str, KeyData> = BTreeMap::new();
    let mut exec_ix: HashMap<&str, Vec<usize>> = HashMap::new();
    let mut operations = 0u64;
    let mut executions = 0u64;
    for (i, e) in ev.iter().enumerate() {
        match e {
            Event::Invoke {
                op,
                key,
                phase,
                proxy,
                ..
            } => {
                operations += 1;
                if ops.contains_key(op) {
                    malformed += 1;
                    continue;
                }
                op_proxy.insert(*op, *proxy);
                ops.insert(*op, (key.as_str(), *phase));
                let k = keys.entry(key).or_default();
                k.events.push(i);
                k.invoked_in_load |= *phase == Phase::Load;
            }
            Event::Exec { key, exec, .. } => {
                executions += 1;
                let k = keys.entry(key).or_default();
                k.events.push(i);
                k.execs.push(i);
                exec_ix.entry(exec).or_default().push(i);
            }
            Event::Fault {
                t,
                id,
                kind,
                target,
                phase,
            } => match phase {
                FaultPhase::Start => {
                    *faults_by_kind.entry(kind.clone()).or_default() += 1;
                    open.entry(*id).or_default().push(faults.len());
                    faults.push(Span {
                        kind: kind.clone(),
                        target: target.clone(),
                        start: *t,
                        end: None,
                        start_ix: i,
                        end_ix: None,
                    });
                }
                FaultPhase::End => match open.get_mut(id).and_then(Vec::pop) {
                    Some(f) => {
                        faults[f].end = Some(*t);
                        faults[f].end_ix = Some(i);
                    }
                    None => malformed += 1,
                },
            },
            _ => {}
        }
    }

    let mut answers_by_outcome: BTreeMap<String, u64> = BTreeMap::new();
    for (i, e) in ev.iter().enumerate() {
        let op = match e {
            Event::Answer { op, .. } | Event::Error { op, .. } => *op,
            _ => continue,
        };
        let Some(&(key, phase)) = ops.get(&op) else {
            malformed += 1;
            continue;
        };
        if let Some(name) = outcome_name(e) {
            *answers_by_outcome.entry(name).or_default() += 1;
        }
        let k = keys.get_mut(key).expect("an invoked key");
        k.events.push(i);
        if matches!(e, Event::Answer { .. }) {
            k.answers.push((i, phase));
        }
    }
    for k in keys.values_mut() {
        k.events.sort_unstable();
    }

    // The answer was given while its record was still being stored, and
    // storing it could fail: the store, or the link from the proxy that ran
    // it, faulted; or that proxy died or stalled before it stored the record.
    // The docs' degradation (`completions_degraded{result="lost"}`): a retry
    // gets 502 outcome-unknown, never a second execution.
    let completion_fault_within = |proxy: Option<u32>, from: u64, to: u64| {
        faults.iter().any(|f| {
            let kind = f.kind.as_str();
            let store = f.target.starts_with("store") && STORE_LOSS_KINDS.contains(&kind);
            let own = proxy.is_some_and(|p| {
                (f.target == format!("proxy-{p}->store") && LINK_LOSS_KINDS.contains(&kind))
                    || (f.target == format!("proxy-{p}") && ["kill", "pause"].contains(&kind))
            });
            (store || own) && f.overlaps(from, to)
        })
    };

    // A record written at `t` may be lost with the store when a store fault
    // was open then (from a second before it began to when the store had
    // converged again): the replica may not have it, or a deposed master
    // took it. A record written well before a fault was on the replica.
    let store_loss_at = |t: u64| {
        at_risk == AtRisk::StoreFailover
            && faults.iter().any(|f| {
                f.may_lose_store_records() && f.overlaps(t, t.saturating_add(AT_RISK_LEAD_MS))
            })
    };

    let mut found: Vec<Found> = Vec::new();
    let mut at_risk_keys: BTreeSet<&str> = BTreeSet::new();
    let mut not_kept_keys: BTreeSet<&str> = BTreeSet::new();
    for (&key, k) in &keys {
        // 1. executed_twice
        let mut key_at_risk = false;
        if k.execs.len() >= 2 {
            let first = ev[k.execs[0]].t();
            let last = ev[*k.execs.last().expect("two execs")].t();
            if store_loss_at(first) {
                key_at_risk = true;
                at_risk_keys.insert(key);
            } else {
                let ids: Vec<String> = k.execs.iter().map(|&i| exec_id(ev[i])).collect();
                let why = match (run.is_some(), at_risk) {
                    (_, AtRisk::StoreFailover) => {
                        "no store fault (kill, pause, failover, partition of a store) was open when its first execution was recorded"
                    }
                    (true, AtRisk::Never) => "at_risk is never: no fault excuses it",
                    (false, _) => "no Run line: nothing excuses it",
                };
                found.push(Found {
                    kind: EXECUTED_TWICE,
                    key: key.to_string(),
                    explanation: format!(
                        "executed {} times ({}) from t={first} to t={last} ms; {why}",
                        k.execs.len(),
                        ids.join(", "),
                    ),
                    extra: Vec::new(),
                });
            }
        }

        // 2. wrong_answer and 3. other_key_answer
        let mut wrong: Vec<String> = Vec::new();
        let mut wrong_extra: Vec<usize> = Vec::new();
        let mut other: Vec<String> = Vec::new();
        for &(i, _) in &k.answers {
            let Event::Answer {
                op,
                status,
                body_sha,
                exec,
                answer_key,
                ..
            } = ev[i]
            else {
                continue;
            };
            match exec {
                Some(x) => {
                    let own = k.execs.iter().find(|&&j| exec_id(ev[j]) == *x);
                    match own.map(|&j| ev[j]) {
                        Some(Event::Exec {
                            status: s,
                            body_sha: b,
                            ..
                        }) => {
                            if s != status || b != body_sha {
                                wrong.push(format!(
                                    "op {op} answered {status} sha {} for exec {x}, which answered {s} sha {}",
                                    short(body_sha),
                                    short(b)
                                ));
                            }
                        }
                        _ => {
                            let theirs = exec_ix.get(x.as_str()).map(Vec::as_slice).unwrap_or(&[]);
                            wrong_extra.extend_from_slice(theirs);
                            let whose = match theirs.first().map(|&j| ev[j]) {
                                Some(Event::Exec { key: other, .. }) => {
                                    format!("an execution of key {other}")
                                }
                                _ => "an execution the upstream never journaled".to_string(),
                            };
                            wrong.push(format!(
                                "op {op} answered {status} naming exec {x}, {whose}"
                            ));
                        }
                    }
                }
                None if (200..300).contains(status) => {
                    wrong.push(format!(
                        "op {op} answered {status} without an upstream body (no exec)"
                    ));
                }
                None => {}
            }
            if let Some(ak) = answer_key {
                if ak != key {
                    other.push(format!(
                        "op {op} answered {status} with the body of key {ak}"
                    ));
                }
            }
        }
        if !wrong.is_empty() {
            found.push(Found {
                kind: WRONG_ANSWER,
                key: key.to_string(),
                explanation: summarize(&wrong, "wrong answers"),
                extra: wrong_extra,
            });
        }
        if !other.is_empty() {
            found.push(Found {
                kind: OTHER_KEY_ANSWER,
                key: key.to_string(),
                explanation: summarize(&other, "answers of another key"),
                extra: Vec::new(),
            });
        }

        // 4. not_replayed
        let settled_final: Vec<usize> = k
            .answers
            .iter()
            .filter(|&&(i, phase)| phase == Phase::Final && settles(ev[i]))
            .map(|&(i, _)| i)
            .collect();
        let load_upstream = k
            .answers
            .iter()
            .find(|&&(i, phase)| phase == Phase::Load && answer_exec(ev[i]).is_some());
        if let (Some(&(first, _)), false) = (load_upstream, settled_final.is_empty()) {
            let (x, s, b) = answer_exec(ev[first]).expect("an upstream answer");
            let mut bad: Vec<String> = Vec::new();
            for &i in &settled_final {
                let Event::Answer { op, status, .. } = ev[i] else {
                    continue;
                };
                match answer_exec(ev[i]) {
                    Some(same) if same == (x, s, b) => {}
                    Some((y, s2, b2)) => bad.push(format!(
                        "final op {op} answered {s2} exec {y} sha {}, not the load phase's {s} exec {x} sha {}",
                        short(b2),
                        short(b)
                    )),
                    None => bad.push(format!(
                        "final op {op} answered {status} ({}), not the load phase's {s} exec {x}",
                        outcome_name(ev[i]).unwrap_or_default()
                    )),
                }
            }
            // A record written before a store fault and lost with it: the
            // retry gets 502 outcome-unknown (its reservation survived) or
            // runs again; at risk like a second execution.
            let lost_with_store = store_loss_at(ev[first].t());
            // Only the proxy's outcome-unknown (or 410, the answer not kept)
            // stands in for a record that was never stored.
            let unknown_only = settled_final.iter().all(|&i| match ev[i] {
                Event::Answer {
                    status, problem, ..
                } => {
                    answer_exec(ev[i]) == Some((x, s, b))
                        || (*status == 502 && problem.as_deref() == Some("outcome-unknown"))
                        || *status == 410
                }
                _ => true,
            });
            let answered_by = match ev[first] {
                Event::Answer { op, .. } => op_proxy.get(op).copied(),
                _ => None,
            };
            let not_kept = unknown_only
                && completion_fault_within(
                    answered_by,
                    ev[first].t().saturating_sub(AT_RISK_LEAD_MS),
                    ev[first].t() + AT_RISK_LEAD_MS,
                );
            if !bad.is_empty() && not_kept && !key_at_risk && !lost_with_store {
                not_kept_keys.insert(key);
            } else if !bad.is_empty() {
                if key_at_risk || lost_with_store {
                    at_risk_keys.insert(key);
                } else {
                    found.push(Found {
                        kind: NOT_REPLAYED,
                        key: key.to_string(),
                        explanation: summarize(&bad, "final answers not replayed"),
                        extra: Vec::new(),
                    });
                }
            }
        }

        // 5. not_settled
        if k.invoked_in_load {
            let explanation = match healed {
                None => Some("the run never healed (no Healed line): no final phase".to_string()),
                Some((_, healed_t)) => {
                    // From the heal, or from when the final phase first asked
                    // this key (a run of many keys asks them one after another).
                    let first_ask = k.events.iter().find_map(|&i| match ev[i] {
                        Event::Invoke {
                            t,
                            phase: Phase::Final,
                            ..
                        } => Some(*t),
                        _ => None,
                    });
                    let bound = healed_t
                        .max(first_ask.unwrap_or(0))
                        .saturating_add(settle_bound);
                    if settled_final.iter().any(|&i| ev[i].t() <= bound) {
                        None
                    } else {
                        let finals = k.answers.iter().filter(|a| a.1 == Phase::Final).count();
                        Some(match settled_final.first() {
                            Some(&i) => format!(
                                "first settled final answer at t={} ms, after the bound t={bound} (healed {healed_t} + {settle_bound})",
                                ev[i].t()
                            ),
                            None => format!(
                                "no settled final answer (not 409, 503 or an error) by t={bound} (healed {healed_t} + {settle_bound}); {finals} final answers, none settled"
                            ),
                        })
                    }
                }
            };
            if let Some(explanation) = explanation {
                found.push(Found {
                    kind: NOT_SETTLED,
                    key: key.to_string(),
                    explanation,
                    extra: Vec::new(),
                });
            }
        }
    }

    let mut violations: BTreeMap<String, u64> = KINDS.iter().map(|k| (k.to_string(), 0)).collect();
    let mut details: Vec<Violation> = Vec::new();
    let mut details_omitted = 0u64;
    for kind in KINDS {
        let mut of_kind: Vec<Violation> = found
            .iter()
            .filter(|f| f.kind == kind)
            .map(|f| {
                let k = &keys[f.key.as_str()];
                Violation {
                    kind: kind.to_string(),
                    key: f.key.clone(),
                    explanation: f.explanation.clone(),
                    history: shortest_history(&ev, k, &f.extra, run_ix, healed, &faults),
                }
            })
            .collect();
        violations.insert(kind.to_string(), of_kind.len() as u64);
        if of_kind.len() > DETAILS_PER_KIND {
            of_kind.sort_by(|a, b| (a.history.len(), &a.key).cmp(&(b.history.len(), &b.key)));
            details_omitted += (of_kind.len() - DETAILS_PER_KIND) as u64;
            of_kind.truncate(DETAILS_PER_KIND);
            of_kind.sort_by(|a, b| a.key.cmp(&b.key));
        }
        details.extend(of_kind);
    }

    Report {
        seed: run.map(|r| r.seed),
        operations,
        keys: keys.len() as u64,
        executions,
        answers_by_outcome,
        faults_by_kind,
        violations,
        keys_at_risk: at_risk_keys.len() as u64,
        keys_at_risk_list: at_risk_keys.iter().map(|k| k.to_string()).collect(),
        answers_not_kept: not_kept_keys.len() as u64,
        answers_not_kept_list: not_kept_keys.iter().map(|k| k.to_string()).collect(),
        malformed,
        details,
        details_omitted,
    }
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

/// The Run line, the key's events and `extra`, the faults overlapping the
/// key's span (both lines of each) and the Healed line, in time order.
fn shortest_history(
    ev: &[&Event],
    k: &KeyData,
    extra: &[usize],
    run_ix: Option<usize>,
    healed: Option<(usize, u64)>,
    faults: &[Span],
) -> Vec<Event> {
    let mut ix: BTreeSet<usize> = k.events.iter().chain(extra).copied().collect();
    ix.extend(run_ix);
    ix.extend(healed.map(|h| h.0));
    if let (Some(&first), Some(&last)) = (k.events.first(), k.events.last()) {
        let (from, to) = (ev[first].t(), ev[last].t());
        for f in faults.iter().filter(|f| f.overlaps(from, to)) {
            ix.insert(f.start_ix);
            ix.extend(f.end_ix);
        }
    }
    ix.into_iter().map(|i| ev[i].clone()).collect()
}

/// A human summary: the counts, and for each violated kind the seed to
/// repeat the run and the shortest history of that kind, one event a line.
pub fn render_text(report: &Report, seed: u64) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let verdict = if report.ok() { "OK" } else { "VIOLATIONS" };
    let _ = writeln!(s, "campaign check, seed {seed}: {verdict}");
    let _ = writeln!(
        s,
        "  {} operations, {} keys, {} executions, {} malformed lines",
        report.operations, report.keys, report.executions, report.malformed
    );
    let _ = writeln!(s, "  answers: {}", counts(&report.answers_by_outcome));
    let _ = writeln!(s, "  faults:  {}", counts(&report.faults_by_kind));
    let _ = writeln!(s, "  violations: {}", counts(&report.violations));
    let _ = write!(s, "  keys at risk: {}", report.keys_at_risk);
    if report.keys_at_risk > 0 {
        let shown: Vec<&str> = report
            .keys_at_risk_list
            .iter()
            .take(10)
            .map(String::as_str)
            .collect();
        let more = if report.keys_at_risk_list.len() > 10 {
            ", ..."
        } else {
            ""
        };
        let _ = write!(s, " ({}{more})", shown.join(", "));
    }
    s.push('\n');
    let _ = writeln!(
        s,
        "  answers not kept (a store or proxy fault while they were stored; retries got 502 outcome-unknown): {}",
        report.answers_not_kept
    );
    for kind in KINDS {
        let n = report.violations.get(kind).copied().unwrap_or(0);
        if n == 0 {
            continue;
        }
        let _ = writeln!(s, "\n{kind}: {n} key(s); repeat the run with --seed {seed}");
        let shortest = report
            .details
            .iter()
            .filter(|d| d.kind == kind)
            .min_by_key(|d| d.history.len());
        if let Some(d) = shortest {
            let _ = writeln!(s, "  key {}: {}", d.key, d.explanation);
            let _ = writeln!(s, "  history ({} events):", d.history.len());
            for e in &d.history {
                let line = serde_json::to_string(e).unwrap_or_default();
                let _ = writeln!(s, "    {line}");
            }
        }
    }
    if report.details_omitted > 0 {
        let _ = writeln!(
            s,
            "\n({} more violation details left out of the report)",
            report.details_omitted
        );
    }
    s
}

fn counts(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "none".to_string();
    }
    let parts: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v}")).collect();
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history;

    /// A history under construction: one Run line, then events at chosen
    /// times; ops are numbered as they are invoked.
    struct H {
        ev: Vec<Event>,
        next_op: u64,
        next_fault: u32,
    }

    fn sha(exec: &str) -> String {
        format!("sha-of-{exec}")
    }

    impl H {
        fn new(at_risk: AtRisk) -> H {
            H {
                ev: vec![Event::Run(Run {
                    topology: "redis-sentinel".into(),
                    seed: 7,
                    duration_ms: 20_000,
                    proxies: 2,
                    clients: 2,
                    lease_ms: 2000,
                    lease_expiry: "unknown_outcome".into(),
                    wait_replicas: 0,
                    at_risk,
                    settle_bound_ms: 5000,
                })],
                next_op: 1,
                next_fault: 1,
            }
        }

        fn invoke(&mut self, t: u64, key: &str, phase: Phase) -> u64 {
            let op = self.next_op;
            self.next_op += 1;
            self.ev.push(Event::Invoke {
                t,
                op,
                client: 0,
                key: key.into(),
                attempt: 0,
                proxy: 0,
                phase,
            });
            op
        }

        fn exec(&mut self, t: u64, key: &str, exec: &str) {
            self.ev.push(Event::Exec {
                t,
                key: key.into(),
                exec: exec.into(),
                status: 201,
                body_sha: sha(exec),
            });
        }

        /// An upstream answer naming `exec` of `key` (201, the exec's body).
        fn upstream(&mut self, t: u64, op: u64, key: &str, exec: &str, replayed: bool) {
            self.ev.push(Event::Answer {
                t,
                op,
                status: 201,
                replayed,
                body_sha: sha(exec),
                exec: Some(exec.into()),
                answer_key: Some(key.into()),
                problem: None,
                latency_ms: 12.5,
            });
        }

        fn problem(&mut self, t: u64, op: u64, status: u16, slug: &str) {
            self.ev.push(Event::Answer {
                t,
                op,
                status,
                replayed: false,
                body_sha: sha(slug),
                exec: None,
                answer_key: None,
                problem: Some(slug.into()),
                latency_ms: 3.0,
            });
        }

        fn error(&mut self, t: u64, op: u64, error: &str) {
            self.ev.push(Event::Error {
                t,
                op,
                error: error.into(),
                latency_ms: 2000.0,
            });
        }

        fn fault(&mut self, from: u64, to: u64, kind: &str, target: &str) {
            let id = self.next_fault;
            self.next_fault += 1;
            for (t, phase) in [(from, FaultPhase::Start), (to, FaultPhase::End)] {
                self.ev.push(Event::Fault {
                    t,
                    id,
                    kind: kind.into(),
                    target: target.into(),
                    phase,
                });
            }
        }

        fn healed(&mut self, t: u64) {
            self.ev.push(Event::Healed { t });
        }

        /// A key's whole clean life: invoked at `t`, executed, answered,
        /// asked again after healing (at 20 s) and replayed.
        fn clean_key(&mut self, t: u64, key: &str) {
            let exec = format!("x-{key}");
            let op = self.invoke(t, key, Phase::Load);
            self.exec(t + 5, key, &exec);
            self.upstream(t + 10, op, key, &exec, false);
            let fin = self.invoke(20_100 + t % 1000, key, Phase::Final);
            self.upstream(20_110 + t % 1000, fin, key, &exec, true);
        }

        fn done(mut self) -> Vec<Event> {
            self.ev.push(Event::End { t: 30_000 });
            self.ev
        }
    }

    /// Three keys, a proxy killed and a store delayed, all clean.
    fn clean(at_risk: AtRisk) -> H {
        let mut h = H::new(at_risk);
        h.fault(500, 3000, "kill", "proxy-1");
        h.fault(4000, 6000, "delay", "store-0");
        h.clean_key(100, "a");
        h.clean_key(1000, "b");
        h.clean_key(5000, "c");
        h.healed(20_000);
        h
    }

    fn count(r: &Report, kind: &str) -> u64 {
        r.violations[kind]
    }

    fn only(r: &Report, kind: &str) -> Vec<String> {
        assert_eq!(
            r.violations
                .iter()
                .filter(|(k, &n)| n > 0 && k.as_str() != kind)
                .count(),
            0,
            "only {kind}: {:?}",
            r.violations
        );
        r.details
            .iter()
            .filter(|d| d.kind == kind)
            .map(|d| d.key.clone())
            .collect()
    }

    #[test]
    fn clean_history_is_ok() {
        let r = check(&clean(AtRisk::Never).done());
        assert!(r.ok(), "{r:#?}");
        assert_eq!(r.violations.len(), KINDS.len());
        assert!(r.violations.values().all(|&n| n == 0));
        assert_eq!((r.operations, r.keys, r.executions), (6, 3, 3));
        assert_eq!(r.answers_by_outcome["executed"], 3);
        assert_eq!(r.answers_by_outcome["replayed"], 3);
        assert_eq!(r.faults_by_kind["kill"], 1);
        assert_eq!(r.faults_by_kind["delay"], 1);
        assert_eq!((r.keys_at_risk, r.malformed), (0, 0));
        assert!(r.details.is_empty());
        assert_eq!(r.seed, Some(7));
    }

    /// Key `d` executed twice around t=8000 (a second exec 2 s later).
    fn twice(at_risk: AtRisk) -> H {
        let mut h = clean(at_risk);
        let op = h.invoke(8000, "d", Phase::Load);
        h.exec(8005, "d", "x-d1");
        h.error(10_000, op, "timeout");
        let op = h.invoke(10_000, "d", Phase::Load);
        h.exec(10_005, "d", "x-d2");
        h.upstream(10_010, op, "d", "x-d2", false);
        let fin = h.invoke(20_200, "d", Phase::Final);
        h.upstream(20_210, fin, "d", "x-d2", true);
        h
    }

    #[test]
    fn executed_twice_is_a_violation() {
        let r = check(&twice(AtRisk::StoreFailover).done());
        assert_eq!(count(&r, EXECUTED_TWICE), 1);
        assert_eq!(only(&r, EXECUTED_TWICE), ["d"]);
        assert_eq!(r.keys_at_risk, 0);
        assert!(!r.ok());
        assert!(r.details[0].explanation.contains("x-d1, x-d2"));
    }

    #[test]
    fn executed_twice_with_a_store_failover_in_the_window_is_at_risk() {
        for (kind, target) in [
            ("failover", "store"),
            ("kill", "store-0"),
            ("pause", "store-3"),
            ("partition", "store-1"),
        ] {
            let mut h = twice(AtRisk::StoreFailover);
            h.fault(9000, 9500, kind, target);
            let r = check(&h.done());
            assert!(r.ok(), "{kind} {target}: {:?}", r.violations);
            assert_eq!(r.keys_at_risk, 1);
            assert_eq!(r.keys_at_risk_list, ["d"]);
        }
    }

    #[test]
    fn executed_twice_under_never_is_a_violation_despite_a_store_failover() {
        let mut h = twice(AtRisk::Never);
        h.fault(9000, 9500, "failover", "store");
        let r = check(&h.done());
        assert_eq!(only(&r, EXECUTED_TWICE), ["d"]);
        assert_eq!(r.keys_at_risk, 0);
    }

    #[test]
    fn a_proxy_to_store_link_fault_does_not_excuse() {
        let mut h = twice(AtRisk::StoreFailover);
        h.fault(9000, 9500, "partition", "proxy-0->store");
        h.fault(9000, 9500, "cut", "proxy-1->store");
        let r = check(&h.done());
        assert_eq!(only(&r, EXECUTED_TWICE), ["d"]);
        assert_eq!(r.keys_at_risk, 0);
    }

    #[test]
    fn a_store_delay_does_not_excuse() {
        let mut h = twice(AtRisk::StoreFailover);
        h.fault(9000, 9500, "delay", "store-0");
        let r = check(&h.done());
        assert_eq!(only(&r, EXECUTED_TWICE), ["d"]);
    }

    #[test]
    fn the_at_risk_window_is_the_first_execution_and_the_second_after_it() {
        // First exec at 8005: a store fault open then, or beginning within a
        // second after it, may have lost its record...
        for (from, to) in [(6000, 8005), (9005, 9100), (7000, 20_000)] {
            let mut h = twice(AtRisk::StoreFailover);
            h.fault(from, to, "failover", "store");
            let r = check(&h.done());
            assert!(r.ok(), "{from}-{to}: {:?}", r.violations);
            assert_eq!(r.keys_at_risk, 1, "{from}-{to}");
        }
        // ...one over before it, or beginning later (even before the
        // second execution: the record was on the replica by then), not.
        for (from, to) in [(6000, 8004), (9006, 9100), (9500, 10_004)] {
            let mut h = twice(AtRisk::StoreFailover);
            h.fault(from, to, "kill", "store-0");
            let r = check(&h.done());
            assert_eq!(only(&r, EXECUTED_TWICE), ["d"], "{from}-{to}");
        }
        // A fault that never ended covers everything after its start.
        let mut h = twice(AtRisk::StoreFailover);
        h.ev.push(Event::Fault {
            t: 2000,
            id: 99,
            kind: "kill".into(),
            target: "store-2".into(),
            phase: FaultPhase::Start,
        });
        assert!(check(&h.done()).ok());
    }

    #[test]
    fn an_answer_naming_an_unknown_exec_is_a_wrong_answer() {
        let mut h = clean(AtRisk::Never);
        let op = h.invoke(7000, "e", Phase::Load);
        h.exec(7005, "e", "x-e");
        h.upstream(7010, op, "e", "x-ghost", false);
        let fin = h.invoke(20_300, "e", Phase::Final);
        h.upstream(20_310, fin, "e", "x-e", true);
        let r = check(&h.done());
        // The final answer is not the load phase's: not replayed too.
        assert_eq!(count(&r, WRONG_ANSWER), 1);
        assert_eq!(count(&r, NOT_REPLAYED), 1);
        assert_eq!(count(&r, EXECUTED_TWICE), 0);
        let d = r.details.iter().find(|d| d.kind == WRONG_ANSWER).unwrap();
        assert_eq!(d.key, "e");
        assert!(d.explanation.contains("x-ghost"), "{}", d.explanation);
        assert!(
            d.explanation.contains("never journaled"),
            "{}",
            d.explanation
        );
    }

    #[test]
    fn an_answer_naming_another_keys_exec_is_a_wrong_answer_showing_that_exec() {
        let mut h = clean(AtRisk::Never);
        let fin = h.invoke(20_400, "a", Phase::Final);
        h.upstream(20_410, fin, "a", "x-b", true);
        let r = check(&h.done());
        assert_eq!(count(&r, WRONG_ANSWER), 1);
        let d = r.details.iter().find(|d| d.kind == WRONG_ANSWER).unwrap();
        assert_eq!(d.key, "a");
        assert!(d.explanation.contains("of key b"), "{}", d.explanation);
        assert!(d
            .history
            .iter()
            .any(|e| matches!(e, Event::Exec { exec, .. } if exec == "x-b")));
    }

    #[test]
    fn an_answer_with_another_status_or_body_than_its_exec_is_a_wrong_answer() {
        for wrong_status in [true, false] {
            let mut h = clean(AtRisk::Never);
            let op = h.invoke(7000, "e", Phase::Load);
            h.exec(7005, "e", "x-e");
            h.ev.push(Event::Answer {
                t: 7010,
                op,
                status: if wrong_status { 402 } else { 201 },
                replayed: false,
                body_sha: if wrong_status {
                    sha("x-e")
                } else {
                    "0123".into()
                },
                exec: Some("x-e".into()),
                answer_key: Some("e".into()),
                problem: None,
                latency_ms: 10.0,
            });
            let r = check(&h.done());
            assert_eq!(count(&r, WRONG_ANSWER), 1, "wrong status {wrong_status}");
            assert_eq!(r.details[0].key, "e");
        }
    }

    #[test]
    fn a_2xx_without_an_exec_is_a_wrong_answer() {
        let mut h = clean(AtRisk::Never);
        let op = h.invoke(7000, "e", Phase::Load);
        h.problem(7010, op, 200, "ok");
        let r = check(&h.done());
        assert_eq!(count(&r, WRONG_ANSWER), 1);
        let d = r.details.iter().find(|d| d.kind == WRONG_ANSWER).unwrap();
        assert_eq!(d.key, "e");
    }

    #[test]
    fn proxy_problems_are_not_wrong_answers() {
        let mut h = clean(AtRisk::Never);
        let op = h.invoke(7000, "e", Phase::Load);
        h.exec(7005, "e", "x-e");
        h.problem(7002, op, 409, "in-flight");
        h.problem(7010, op, 502, "outcome-unknown");
        h.problem(7020, op, 504, "upstream-timeout");
        h.problem(7030, op, 503, "store-unavailable");
        let fin = h.invoke(20_300, "e", Phase::Final);
        h.problem(20_310, fin, 503, "store-unavailable");
        let fin = h.invoke(20_400, "e", Phase::Final);
        h.problem(20_410, fin, 502, "outcome-unknown");
        let r = check(&h.done());
        assert!(r.ok(), "{:#?}", r.details);
        assert_eq!(r.answers_by_outcome["in_flight_409"], 1);
        assert_eq!(r.answers_by_outcome["proxy_502_outcome-unknown"], 2);
        assert_eq!(r.answers_by_outcome["proxy_503_store-unavailable"], 2);
        assert_eq!(r.answers_by_outcome["proxy_504_upstream-timeout"], 1);
    }

    #[test]
    fn an_answer_of_another_key_is_reported() {
        let mut h = clean(AtRisk::Never);
        let op = h.invoke(7000, "e", Phase::Load);
        h.exec(7005, "e", "x-e");
        h.ev.push(Event::Answer {
            t: 7010,
            op,
            status: 201,
            replayed: false,
            body_sha: sha("x-e"),
            exec: Some("x-e".into()),
            answer_key: Some("b".into()),
            problem: None,
            latency_ms: 10.0,
        });
        let fin = h.invoke(20_300, "e", Phase::Final);
        h.upstream(20_310, fin, "e", "x-e", true);
        let r = check(&h.done());
        assert_eq!(only(&r, OTHER_KEY_ANSWER), ["e"]);
        assert_eq!(count(&r, OTHER_KEY_ANSWER), 1);
        assert!(r.details[0].explanation.contains("key b"));
    }

    #[test]
    fn a_final_answer_of_another_execution_is_not_replayed() {
        let mut h = clean(AtRisk::Never);
        let op = h.invoke(7000, "e", Phase::Load);
        h.exec(7005, "e", "x-e");
        h.upstream(7010, op, "e", "x-e", false);
        let fin = h.invoke(20_300, "e", Phase::Final);
        h.exec(20_305, "e", "x-e2");
        h.upstream(20_310, fin, "e", "x-e2", false);
        let r = check(&h.done());
        assert_eq!(count(&r, NOT_REPLAYED), 1);
        assert_eq!(count(&r, EXECUTED_TWICE), 1);
        let d = r.details.iter().find(|d| d.kind == NOT_REPLAYED).unwrap();
        assert_eq!(d.key, "e");
        assert!(d.explanation.contains("x-e2"), "{}", d.explanation);
    }

    #[test]
    fn a_final_problem_after_an_upstream_answer_is_not_replayed() {
        let mut h = clean(AtRisk::Never);
        let fin = h.invoke(20_300, "b", Phase::Final);
        h.problem(20_310, fin, 502, "outcome-unknown");
        let r = check(&h.done());
        assert_eq!(only(&r, NOT_REPLAYED), ["b"]);
        assert_eq!(count(&r, NOT_REPLAYED), 1);
        // A 409 or 503 in the final phase does not settle: nothing to judge.
        let mut h = clean(AtRisk::Never);
        let fin = h.invoke(20_300, "b", Phase::Final);
        h.problem(20_310, fin, 409, "in-flight");
        assert!(check(&h.done()).ok());
    }

    #[test]
    fn an_acknowledged_record_lost_with_the_store_is_at_risk_only_under_store_failover() {
        // The load phase got 201 (at 1010); a failover half a second
        // later; the final phase gets the surviving reservation's 502
        // outcome-unknown. (at risk, not kept, violation)
        for (at_risk, kind, target, want) in [
            (AtRisk::StoreFailover, "failover", "store", (1, 0, 0)),
            // On PostgreSQL a record once stored survives: the completion did not land.
            (AtRisk::Never, "failover", "store", (0, 1, 0)),
            (AtRisk::StoreFailover, "delay", "proxy-0->store", (0, 0, 1)),
        ] {
            let mut h = clean(at_risk);
            h.fault(1_500, 15_000, kind, target);
            let fin = h.invoke(20_300, "b", Phase::Final);
            h.problem(20_310, fin, 502, "outcome-unknown");
            let r = check(&h.done());
            let got = (r.keys_at_risk, r.answers_not_kept, count(&r, NOT_REPLAYED));
            assert_eq!(got, want, "{at_risk:?} {kind} {target}");
        }
    }

    #[test]
    fn an_answer_whose_record_could_not_be_stored_is_not_kept_not_a_violation() {
        // "b" ran at 1005 (answered 1010 via proxy 0); a fault while its
        // record was being stored; after healing, 502 outcome-unknown.
        for (from, to, kind, target, kept_apart) in [
            (1_020, 9_000, "kill", "store-0", true),
            (1_000, 1_500, "partition", "proxy-0->store", true),
            (1_000, 1_500, "loss", "proxy-0->store", true),
            (1_000, 1_500, "delay", "proxy-0->store", false),
            (1_012, 1_400, "kill", "proxy-0", true),
            // Another proxy's link, or a fault long after the lease: a violation.
            (1_000, 1_500, "partition", "proxy-1->store", false),
            (8_000, 9_000, "kill", "store-0", false),
        ] {
            let mut h = clean(AtRisk::Never);
            h.fault(from, to, kind, target);
            let fin = h.invoke(20_300, "b", Phase::Final);
            h.problem(20_310, fin, 502, "outcome-unknown");
            let r = check(&h.done());
            let what = format!("{kind} {target} {from}-{to}");
            assert_eq!(r.answers_not_kept, u64::from(kept_apart), "{what}");
            assert_eq!(count(&r, NOT_REPLAYED), u64::from(!kept_apart), "{what}");
        }
        // Another execution after healing is never excused so.
        let mut h = clean(AtRisk::Never);
        h.fault(1_020, 9_000, "kill", "store-0");
        let fin = h.invoke(20_300, "b", Phase::Final);
        h.exec(20_305, "b", "x-b2");
        h.upstream(20_310, fin, "b", "x-b2", false);
        let r = check(&h.done());
        assert_eq!(count(&r, EXECUTED_TWICE), 1);
        assert_eq!(r.answers_not_kept, 0);
    }

    #[test]
    fn a_key_lost_with_the_store_and_executed_again_is_at_risk_not_unreplayed() {
        let mut h = clean(AtRisk::StoreFailover);
        let op = h.invoke(7000, "e", Phase::Load);
        h.exec(7005, "e", "x-e");
        h.upstream(7010, op, "e", "x-e", false);
        h.fault(7500, 9000, "failover", "store");
        let fin = h.invoke(20_300, "e", Phase::Final);
        h.exec(20_305, "e", "x-e2");
        h.upstream(20_310, fin, "e", "x-e2", false);
        let r = check(&h.done());
        assert!(r.ok(), "{:?}", r.violations);
        assert_eq!(r.keys_at_risk_list, ["e"]);
    }

    #[test]
    fn a_settled_answer_after_the_bound_is_not_settled() {
        // Healed at 20_000, first asked at 20_300, bound 5000: 25_300 is
        // in time, 25_301 is not.
        for (t, late) in [(25_300, false), (25_301, true)] {
            let mut h = clean(AtRisk::Never);
            let op = h.invoke(7000, "e", Phase::Load);
            h.error(9000, op, "timeout");
            let fin = h.invoke(20_300, "e", Phase::Final);
            h.problem(20_310, fin, 409, "in-flight");
            let fin = h.invoke(t - 10, "e", Phase::Final);
            h.exec(t - 5, "e", "x-e");
            h.upstream(t, fin, "e", "x-e", false);
            let r = check(&h.done());
            if late {
                assert_eq!(only(&r, NOT_SETTLED), ["e"]);
                assert_eq!(count(&r, NOT_SETTLED), 1);
                assert!(r.details[0].explanation.contains("after the bound"));
            } else {
                assert!(r.ok(), "{:?}", r.violations);
            }
        }
    }

    #[test]
    fn only_409_503_and_errors_do_not_settle() {
        let mut h = clean(AtRisk::Never);
        let op = h.invoke(7000, "e", Phase::Load);
        h.error(9000, op, "connect");
        let fin = h.invoke(20_300, "e", Phase::Final);
        h.problem(20_310, fin, 409, "in-flight");
        let fin = h.invoke(20_400, "e", Phase::Final);
        h.problem(20_410, fin, 503, "store-unavailable");
        let fin = h.invoke(20_500, "e", Phase::Final);
        h.error(22_500, fin, "timeout");
        let r = check(&h.done());
        assert_eq!(only(&r, NOT_SETTLED), ["e"]);
        // Two final answers (409, 503), and an error that is not one.
        assert!(r.details[0].explanation.contains("2 final answers"));
    }

    #[test]
    fn a_run_that_never_healed_settles_no_key() {
        let mut h = H::new(AtRisk::Never);
        let op = h.invoke(100, "a", Phase::Load);
        h.exec(105, "a", "x-a");
        h.upstream(110, op, "a", "x-a", false);
        let op = h.invoke(200, "b", Phase::Load);
        h.error(2200, op, "timeout");
        let r = check(&h.done());
        assert_eq!(count(&r, NOT_SETTLED), 2);
        assert_eq!(only(&r, NOT_SETTLED), ["a", "b"]);
        assert!(r.details[0].explanation.contains("never healed"));
    }

    #[test]
    fn the_shortest_history_holds_the_key_its_faults_and_nothing_else() {
        let mut h = twice(AtRisk::Never);
        h.fault(9000, 9500, "failover", "store"); // during d's life
        h.fault(25_000, 26_000, "pause", "proxy-0"); // after d's life
        let r = check(&h.done());
        let d = &r.details[0];
        assert_eq!((d.kind.as_str(), d.key.as_str()), (EXECUTED_TWICE, "d"));
        let h = &d.history;
        assert!(matches!(h[0], Event::Run(_)));
        let faults: Vec<(&str, FaultPhase)> = h
            .iter()
            .filter_map(|e| match e {
                Event::Fault { target, phase, .. } => Some((target.as_str(), *phase)),
                _ => None,
            })
            .collect();
        assert_eq!(
            faults,
            [("store", FaultPhase::Start), ("store", FaultPhase::End)]
        );
        // Its 3 invokes, 2 execs, 3 answers or errors, and the Healed line.
        let keyed = h
            .iter()
            .filter(|e| {
                !matches!(
                    e,
                    Event::Run(_) | Event::Fault { .. } | Event::Healed { .. }
                )
            })
            .count();
        assert_eq!(keyed, 8);
        assert!(h.iter().any(|e| matches!(e, Event::Healed { .. })));
        for e in h {
            match e {
                Event::Invoke { key, .. } | Event::Exec { key, .. } => assert_eq!(key, "d"),
                Event::Answer { answer_key, .. } => assert_eq!(answer_key.as_deref(), Some("d")),
                _ => {}
            }
        }
        assert!(h
            .windows(2)
            .all(|w| w[0].t() <= w[1].t() || matches!(w[0], Event::Run(_))));
    }

    #[test]
    fn events_out_of_order_are_sorted_first() {
        let mut ev = twice(AtRisk::StoreFailover).done();
        ev.push(Event::Fault {
            t: 9000,
            id: 50,
            kind: "failover".into(),
            target: "store".into(),
            phase: FaultPhase::End,
        });
        ev.push(Event::Fault {
            t: 8000,
            id: 50,
            kind: "failover".into(),
            target: "store".into(),
            phase: FaultPhase::Start,
        });
        ev.reverse(); // the Run line last, the End before its Start
        let r = check(&ev);
        assert!(r.ok(), "{:?}", r.violations);
        assert_eq!((r.keys_at_risk, r.malformed), (1, 0));
    }

    #[test]
    fn answers_without_an_invoke_are_malformed_and_ignored() {
        let mut h = clean(AtRisk::Never);
        h.upstream(7000, 999, "zz", "x-zz", false);
        h.error(7000, 998, "reset");
        let r = check(&h.done());
        assert!(r.ok());
        assert_eq!(r.malformed, 2);
        assert_eq!(r.keys, 3);
        assert!(!r.answers_by_outcome.contains_key("error_reset"));
    }

    #[test]
    fn a_history_without_a_run_line_is_judged_strictly() {
        let mut ev = twice(AtRisk::StoreFailover).done();
        ev.remove(0);
        let r = check(&ev);
        assert_eq!(r.seed, None);
        assert_eq!(r.malformed, 1);
        assert_eq!(count(&r, EXECUTED_TWICE), 1);
    }

    #[test]
    fn details_are_capped_per_kind_keeping_the_shortest() {
        let mut h = H::new(AtRisk::Never);
        for i in 0..(DETAILS_PER_KIND as u64 + 5) {
            let key = format!("k{i:04}");
            let op = h.invoke(i, &key, Phase::Load);
            if i % 2 == 0 {
                h.error(i + 1, op, "timeout");
            }
        }
        let r = check(&h.done());
        assert_eq!(count(&r, NOT_SETTLED), DETAILS_PER_KIND as u64 + 5);
        assert_eq!(r.details.len(), DETAILS_PER_KIND);
        assert_eq!(r.details_omitted, 5);
        // The odd keys (no error line) have the shortest histories: all kept.
        let odd = r.details.iter().filter(|d| d.history.len() == 2).count();
        assert_eq!(odd, (DETAILS_PER_KIND + 5) / 2);
    }

    #[test]
    fn render_text_gives_the_seed_and_the_shortest_history() {
        let mut h = twice(AtRisk::Never);
        // A second executed-twice key with a longer history.
        for (t, x) in [(11_000, "x-f1"), (11_100, "x-f2"), (11_200, "x-f3")] {
            let op = h.invoke(t, "f", Phase::Load);
            h.exec(t + 5, "f", x);
            h.upstream(t + 10, op, "f", x, false);
        }
        let fin = h.invoke(20_600, "f", Phase::Final);
        h.upstream(20_610, fin, "f", "x-f1", true);
        let r = check(&h.done());
        assert_eq!(count(&r, EXECUTED_TWICE), 2);
        let text = render_text(&r, 4242);
        assert!(text.contains("--seed 4242"), "{text}");
        assert!(text.contains("executed_twice: 2 key(s)"), "{text}");
        assert!(text.contains("key d:"), "{text}");
        assert!(!text.contains("key f:"), "{text}");
        assert!(
            text.contains(r#"{"ev":"exec","t":8005,"key":"d","exec":"x-d1""#),
            "{text}"
        );
        let clean = render_text(&check(&clean(AtRisk::Never).done()), 1);
        assert!(clean.contains(": OK"), "{clean}");
        assert!(!clean.contains("history"), "{clean}");
    }

    #[test]
    fn the_report_serializes_with_every_field() {
        let r = check(&twice(AtRisk::Never).done());
        let v = serde_json::to_value(&r).unwrap();
        for field in [
            "operations",
            "answers_by_outcome",
            "faults_by_kind",
            "violations",
            "keys_at_risk",
            "keys_at_risk_list",
            "keys",
            "executions",
            "details",
            "malformed",
        ] {
            assert!(v.get(field).is_some(), "{field}");
        }
        assert_eq!(v["violations"]["executed_twice"], 1);
        assert_eq!(v["details"][0]["history"][0]["ev"], "run");
    }

    #[test]
    fn a_history_round_trips_through_a_file() {
        let mut h = twice(AtRisk::StoreFailover);
        h.fault(9000, 9500, "partition", "proxy-0->store");
        let op = h.invoke(12_000, "g", Phase::Load);
        h.problem(12_010, op, 502, "outcome-unknown");
        let events = h.done();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.jsonl");
        let mut file = std::fs::File::create(&path).unwrap();
        history::write(&mut file, &events).unwrap();
        drop(file);
        let back = history::read(&path).unwrap();
        assert_eq!(back, events);
        assert_eq!(check(&back), check(&events));
    }
}
