//! `not_replayed`: a key the upstream answered in the load phase whose
//! settled final answers are not that answer, unless its record was lost
//! with the store (at risk) or never stored (not kept).

use super::{answer_exec, outcome_name, settles, short, summarize, Found, History, KeyData};
use super::{Verdicts, AT_RISK_LEAD_MS, NOT_REPLAYED};
use crate::history::{Event, Phase};

impl<'a> History<'a> {
    /// The key's final-phase answers that settle it (not 409, not 503).
    pub(super) fn settled_final(&self, k: &KeyData) -> Vec<usize> {
        k.answers
            .iter()
            .filter(|&&(i, phase)| phase == Phase::Final && settles(self.ev[i]))
            .map(|&(i, _)| i)
            .collect()
    }

    /// Judges the key's settled final answers against its first upstream
    /// answer of the load phase.
    pub(super) fn not_replayed(
        &self,
        key: &'a str,
        k: &KeyData,
        key_at_risk: bool,
        settled_final: &[usize],
        v: &mut Verdicts<'a>,
    ) {
        let ev = &self.ev;
        let load_upstream = k
            .answers
            .iter()
            .find(|&&(i, phase)| phase == Phase::Load && answer_exec(ev[i]).is_some());
        let (Some(&(first, _)), false) = (load_upstream, settled_final.is_empty()) else {
            return;
        };
        let (x, s, b) = answer_exec(ev[first]).expect("an upstream answer");
        let mut bad: Vec<String> = Vec::new();
        for &i in settled_final {
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
        let lost_with_store = self.store_loss_at(ev[first].t());
        let not_kept = self.not_kept(first, settled_final);
        if !bad.is_empty() && not_kept && !key_at_risk && !lost_with_store {
            v.not_kept_keys.insert(key);
        } else if !bad.is_empty() {
            if key_at_risk || lost_with_store {
                v.at_risk_keys.insert(key);
            } else {
                v.found.push(Found {
                    kind: NOT_REPLAYED,
                    key: key.to_string(),
                    explanation: summarize(&bad, "final answers not replayed"),
                    extra: Vec::new(),
                });
            }
        }
    }

    /// The upstream answer `first` was likely never stored: the final
    /// answers other than it are only the proxy's outcome-unknown (or 410,
    /// the answer not kept), which stand in for a record never stored, and
    /// a completion fault was open around it.
    fn not_kept(&self, first: usize, settled_final: &[usize]) -> bool {
        let ev = &self.ev;
        let upstream = answer_exec(ev[first]);
        let unknown_only = settled_final.iter().all(|&i| match ev[i] {
            Event::Answer {
                status, problem, ..
            } => {
                answer_exec(ev[i]) == upstream
                    || (*status == 502 && problem.as_deref() == Some("outcome-unknown"))
                    || *status == 410
            }
            _ => true,
        });
        let answered_by = match ev[first] {
            Event::Answer { op, .. } => self.op_proxy.get(op).copied(),
            _ => None,
        };
        unknown_only
            && self.completion_fault_within(
                answered_by,
                ev[first].t().saturating_sub(AT_RISK_LEAD_MS),
                ev[first].t() + AT_RISK_LEAD_MS,
            )
    }
}
