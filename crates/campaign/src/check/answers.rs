//! `wrong_answer` and `other_key_answer`: answers that are not their
//! execution's (another status or body, an exec of another key or none),
//! and answers carrying another key's body.

use super::{exec_id, short, summarize, Found, History, KeyData, Verdicts};
use super::{OTHER_KEY_ANSWER, WRONG_ANSWER};
use crate::history::Event;

impl<'a> History<'a> {
    /// Judges each answer of `key` against the execution it names.
    pub(super) fn wrong_answers(&self, key: &'a str, k: &KeyData, v: &mut Verdicts<'a>) {
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
            } = self.ev[i]
            else {
                continue;
            };
            match exec {
                Some(x) => {
                    if let Some(why) =
                        self.against_exec(k, *op, *status, body_sha, x, &mut wrong_extra)
                    {
                        wrong.push(why);
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
            v.found.push(Found {
                kind: WRONG_ANSWER,
                key: key.to_string(),
                explanation: summarize(&wrong, "wrong answers"),
                extra: wrong_extra,
            });
        }
        if !other.is_empty() {
            v.found.push(Found {
                kind: OTHER_KEY_ANSWER,
                key: key.to_string(),
                explanation: summarize(&other, "answers of another key"),
                extra: Vec::new(),
            });
        }
    }

    /// What is wrong with op's answer naming exec `x`, if anything; the
    /// Exec events of another key it names go to `extra`.
    fn against_exec(
        &self,
        k: &KeyData,
        op: u64,
        status: u16,
        body_sha: &str,
        x: &str,
        extra: &mut Vec<usize>,
    ) -> Option<String> {
        let ev = &self.ev;
        let own = k.execs.iter().find(|&&j| exec_id(ev[j]) == *x);
        match own.map(|&j| ev[j]) {
            Some(Event::Exec {
                status: s,
                body_sha: b,
                ..
            }) => (*s != status || b != body_sha).then(|| {
                format!(
                    "op {op} answered {status} sha {} for exec {x}, which answered {s} sha {}",
                    short(body_sha),
                    short(b)
                )
            }),
            _ => {
                let theirs = self.exec_ix.get(x).map(Vec::as_slice).unwrap_or(&[]);
                extra.extend_from_slice(theirs);
                let whose = match theirs.first().map(|&j| ev[j]) {
                    Some(Event::Exec { key: other, .. }) => {
                        format!("an execution of key {other}")
                    }
                    _ => "an execution the upstream never journaled".to_string(),
                };
                Some(format!(
                    "op {op} answered {status} naming exec {x}, {whose}"
                ))
            }
        }
    }
}
