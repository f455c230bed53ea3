//! `not_settled`: a key invoked in the load phase with no settled final
//! answer within the run's settle bound after the heal.

use super::{Found, History, KeyData, Verdicts, NOT_SETTLED};
use crate::history::{Event, Phase};

impl<'a> History<'a> {
    /// Judges whether `key` settled in time.
    pub(super) fn not_settled(
        &self,
        key: &'a str,
        k: &KeyData,
        settled_final: &[usize],
        v: &mut Verdicts<'a>,
    ) {
        if !k.invoked_in_load {
            return;
        }
        let explanation = match self.healed {
            None => Some("the run never healed (no Healed line): no final phase".to_string()),
            Some((_, healed_t)) => self.late(k, healed_t, settled_final),
        };
        if let Some(explanation) = explanation {
            v.found.push(Found {
                kind: NOT_SETTLED,
                key: key.to_string(),
                explanation,
                extra: Vec::new(),
            });
        }
    }

    /// Why the key did not settle by its bound, healed at `healed_t`;
    /// `None` when it did.
    fn late(&self, k: &KeyData, healed_t: u64, settled_final: &[usize]) -> Option<String> {
        let ev = &self.ev;
        let settle_bound = self.settle_bound;
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
            return None;
        }
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
