//! The report: violations laid out with their shortest histories (capped
//! per kind), the counts, and the human summary of `render_text`.

use std::collections::{BTreeMap, BTreeSet};

use super::{History, KeyData, Report, Span, Verdicts, Violation, DETAILS_PER_KIND, KINDS};
use crate::history::Event;

impl History<'_> {
    /// The report of what the judges found.
    pub(super) fn report(&self, v: Verdicts<'_>) -> Report {
        let (violations, details, details_omitted) = self.details(&v);
        Report {
            seed: self.run.map(|r| r.seed),
            operations: self.operations,
            keys: self.keys.len() as u64,
            executions: self.executions,
            answers_by_outcome: self.answers_by_outcome.clone(),
            faults_by_kind: self.faults_by_kind.clone(),
            violations,
            keys_at_risk: v.at_risk_keys.len() as u64,
            keys_at_risk_list: v.at_risk_keys.iter().map(|k| k.to_string()).collect(),
            answers_not_kept: v.not_kept_keys.len() as u64,
            answers_not_kept_list: v.not_kept_keys.iter().map(|k| k.to_string()).collect(),
            malformed: self.malformed,
            details,
            details_omitted,
        }
    }

    /// Keys by violation kind, the details kept (the shortest histories
    /// past [`DETAILS_PER_KIND`]) and how many were left out.
    fn details(&self, v: &Verdicts<'_>) -> (BTreeMap<String, u64>, Vec<Violation>, u64) {
        let mut violations: BTreeMap<String, u64> =
            KINDS.iter().map(|k| (k.to_string(), 0)).collect();
        let mut details: Vec<Violation> = Vec::new();
        let mut details_omitted = 0u64;
        for kind in KINDS {
            let mut of_kind: Vec<Violation> = v
                .found
                .iter()
                .filter(|f| f.kind == kind)
                .map(|f| {
                    let k = &self.keys[f.key.as_str()];
                    Violation {
                        kind: kind.to_string(),
                        key: f.key.clone(),
                        explanation: f.explanation.clone(),
                        history: shortest_history(
                            &self.ev,
                            k,
                            &f.extra,
                            self.run_ix,
                            self.healed,
                            &self.faults,
                        ),
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
        (violations, details, details_omitted)
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
pub(crate) fn render_text(report: &Report, seed: u64) -> String {
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
