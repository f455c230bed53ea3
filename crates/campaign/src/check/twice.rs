//! `executed_twice`: a key the upstream executed more than once, unless a
//! store fault open at its first execution excuses it (`at_risk`).

use super::{exec_id, Found, History, KeyData, Verdicts, EXECUTED_TWICE};
use crate::history::AtRisk;

impl<'a> History<'a> {
    /// Judges `key`'s executions; true when it is at risk (excused).
    pub(super) fn executed_twice(&self, key: &'a str, k: &KeyData, v: &mut Verdicts<'a>) -> bool {
        if k.execs.len() < 2 {
            return false;
        }
        let ev = &self.ev;
        let first = ev[k.execs[0]].t();
        let last = ev[*k.execs.last().expect("two execs")].t();
        if self.store_loss_at(first) {
            v.at_risk_keys.insert(key);
            return true;
        }
        let ids: Vec<String> = k.execs.iter().map(|&i| exec_id(ev[i])).collect();
        let why = match (self.run.is_some(), self.at_risk) {
            (_, AtRisk::StoreFailover) => {
                "no store fault (kill, pause, failover, partition of a store) was open when its first execution was recorded"
            }
            (true, AtRisk::Never) => "at_risk is never: no fault excuses it",
            (false, _) => "no Run line: nothing excuses it",
        };
        v.found.push(Found {
            kind: EXECUTED_TWICE,
            key: key.to_string(),
            explanation: format!(
                "executed {} times ({}) from t={first} to t={last} ms; {why}",
                k.execs.len(),
                ids.join(", "),
            ),
            extra: Vec::new(),
        });
        false
    }
}
