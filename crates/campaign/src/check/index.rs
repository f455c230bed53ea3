//! Indexing a history for the checker: the events sorted, the run's
//! settings read, faults paired into spans, each key's events gathered.
//! Also the fault questions the judges ask of the spans.

use std::collections::{BTreeMap, HashMap};

use super::{
    outcome_name, History, KeyData, Span, AT_RISK_LEAD_MS, LINK_LOSS_KINDS, STORE_LOSS_KINDS,
};
use crate::history::{AtRisk, Event, FaultPhase, Phase, Run};

/// Each op's key and phase (invokes first: an answer stamped before its
/// invoke still finds it).
type Ops<'a> = HashMap<u64, (&'a str, Phase)>;

impl<'a> History<'a> {
    /// Sorts `events` by time (stably, the `Run` line first) and indexes them.
    pub(super) fn index(events: &'a [Event]) -> History<'a> {
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
        let run_ix = ev.iter().position(|e| matches!(e, Event::Run(_)));
        let healed: Option<(usize, u64)> = ev.iter().enumerate().find_map(|(i, e)| match e {
            Event::Healed { t } => Some((i, *t)),
            _ => None,
        });
        let mut h = History {
            ev,
            run,
            at_risk: run.map_or(AtRisk::Never, |r| r.at_risk),
            settle_bound: run.map_or(0, |r| r.settle_bound_ms),
            run_ix,
            healed,
            faults: Vec::new(),
            faults_by_kind: BTreeMap::new(),
            op_proxy: HashMap::new(),
            keys: BTreeMap::new(),
            exec_ix: HashMap::new(),
            answers_by_outcome: BTreeMap::new(),
            operations: 0,
            executions: 0,
            malformed,
        };
        let ops = h.index_invokes_execs_faults();
        h.index_answers(&ops);
        h
    }

    /// Invokes, executions and faults (paired by id), in one pass.
    fn index_invokes_execs_faults(&mut self) -> Ops<'a> {
        let mut ops: Ops<'a> = HashMap::new();
        let mut open: HashMap<u32, Vec<usize>> = HashMap::new();
        let ev = self.ev.clone();
        for (i, e) in ev.into_iter().enumerate() {
            match e {
                Event::Invoke {
                    op,
                    key,
                    phase,
                    proxy,
                    ..
                } => {
                    self.operations += 1;
                    if ops.contains_key(op) {
                        self.malformed += 1;
                        continue;
                    }
                    self.op_proxy.insert(*op, *proxy);
                    ops.insert(*op, (key.as_str(), *phase));
                    let k = self.keys.entry(key).or_default();
                    k.events.push(i);
                    k.invoked_in_load |= *phase == Phase::Load;
                }
                Event::Exec { key, exec, .. } => {
                    self.executions += 1;
                    let k = self.keys.entry(key).or_default();
                    k.events.push(i);
                    k.execs.push(i);
                    self.exec_ix.entry(exec).or_default().push(i);
                }
                Event::Fault {
                    t,
                    id,
                    kind,
                    target,
                    phase,
                } => match phase {
                    FaultPhase::Start => {
                        *self.faults_by_kind.entry(kind.clone()).or_default() += 1;
                        open.entry(*id).or_default().push(self.faults.len());
                        self.faults.push(Span {
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
                            self.faults[f].end = Some(*t);
                            self.faults[f].end_ix = Some(i);
                        }
                        None => self.malformed += 1,
                    },
                },
                _ => {}
            }
        }
        ops
    }

    /// Answers and errors, each to its invoke's key; counted by outcome.
    fn index_answers(&mut self, ops: &Ops<'a>) {
        for (i, e) in self.ev.iter().enumerate() {
            let op = match e {
                Event::Answer { op, .. } | Event::Error { op, .. } => *op,
                _ => continue,
            };
            let Some(&(key, phase)) = ops.get(&op) else {
                self.malformed += 1;
                continue;
            };
            if let Some(name) = outcome_name(e) {
                *self.answers_by_outcome.entry(name).or_default() += 1;
            }
            let k: &mut KeyData = self.keys.get_mut(key).expect("an invoked key");
            k.events.push(i);
            if matches!(e, Event::Answer { .. }) {
                k.answers.push((i, phase));
            }
        }
        for k in self.keys.values_mut() {
            k.events.sort_unstable();
        }
    }

    /// The answer was given while its record was still being stored, and
    /// storing it could fail: the store, or the link from the proxy that ran
    /// it, faulted; or that proxy died or stalled before it stored the record.
    /// The docs' degradation (`completions_degraded{result="lost"}`): a retry
    /// gets 502 outcome-unknown, never a second execution.
    pub(super) fn completion_fault_within(&self, proxy: Option<u32>, from: u64, to: u64) -> bool {
        self.faults.iter().any(|f| {
            let kind = f.kind.as_str();
            let store = f.target.starts_with("store") && STORE_LOSS_KINDS.contains(&kind);
            let own = proxy.is_some_and(|p| {
                (f.target == format!("proxy-{p}->store") && LINK_LOSS_KINDS.contains(&kind))
                    || (f.target == format!("proxy-{p}") && ["kill", "pause"].contains(&kind))
            });
            (store || own) && f.overlaps(from, to)
        })
    }

    /// A record written at `t` may be lost with the store when a store fault
    /// was open then (from a second before it began to when the store had
    /// converged again): the replica may not have it, or a deposed master
    /// took it. A record written well before a fault was on the replica.
    pub(super) fn store_loss_at(&self, t: u64) -> bool {
        self.at_risk == AtRisk::StoreFailover
            && self.faults.iter().any(|f| {
                f.may_lose_store_records() && f.overlaps(t, t.saturating_add(AT_RISK_LEAD_MS))
            })
    }
}
