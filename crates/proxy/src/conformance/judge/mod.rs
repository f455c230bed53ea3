//! Rows from what a run saw: each check's pass, failure, or "not observed", with its evidence.
//!
//! Executions are counted by the `--executions` counter when there is one.
//! Without it they are told apart by the answers: a created resource has an
//! id, so two executions answer with different bodies. The run shows that this
//! holds for the endpoint when two keys with one body get different answers;
//! when they get byte-identical ones, the kit cannot tell a replay from a
//! second execution, and every row that rests on that is "not observed"
//! rather than a pass. Rows judged so are marked `by_answers`: an endpoint
//! whose answers depend only on the key (it runs every request, and answers
//! each with a digest of its key) passes them, which only a counter can tell.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;

use super::checks::{self, Check};
use super::client::Exchange;
use super::probe::{Answer, Attempt, Observations};
use super::report::{Finding, Row};

/// Whether executions can be told apart in this run, and if not, why.
enum Telling {
    Yes,
    No(String),
}

/// Every row, in the order of [`checks::ALL`].
pub fn rows(obs: &Observations) -> Vec<Row> {
    let telling = telling(obs);
    let replay = replay(obs);
    vec![
        retry_runs_once(obs, &telling),
        retry_same_result(obs),
        replay_status(obs, replay),
        replay_bytes(obs, replay),
        replay_headers(obs, replay),
        replay_marker(obs, replay),
        new_key_new_operation(obs),
        reuse_refused(obs),
        status_is(&checks::REUSE_422, &obs.reuse.answer, 422),
        missing_key_refused(obs),
        missing_key_400(obs),
        status_is(&checks::EMPTY_KEY_400, &obs.empty_key.answer, 400),
        status_is(&checks::LONG_KEY_400, &obs.long_key.answer, 400),
        in_flight_409(obs),
        concurrent_runs_once(obs, &telling),
        retry_after_409(obs),
        problem_json(obs),
        principal_scope(obs, &telling),
    ]
}

/// Two answers carry one result: the same bytes, or the same JSON value.
pub(crate) fn same_result(a: &Bytes, b: &Bytes) -> bool {
    if a == b {
        return true;
    }
    let parse = |body: &Bytes| serde_json::from_slice::<serde_json::Value>(body).ok();
    matches!((parse(a), parse(b)), (Some(x), Some(y)) if x == y)
}

fn telling(obs: &Observations) -> Telling {
    if obs.first_executions.is_some() {
        return Telling::Yes;
    }
    match &obs.new_key.answer {
        Ok(other) if other.status.is_success() && !same_result(&obs.first.body, &other.body) => {
            Telling::Yes
        }
        Ok(other) if other.status.is_success() => Telling::No(
            "two keys with one body got byte-identical answers, so answers cannot tell \
             executions apart (give --executions)"
                .into(),
        ),
        Ok(other) => Telling::No(format!(
            "another key with the same body was answered {}, so answers cannot be shown to tell \
             executions apart (give --executions)",
            other.status.as_u16()
        )),
        Err(e) => Telling::No(format!("another key's request got no answer ({e})")),
    }
}

/// The retry's answer when it carries the first's result: the replay the PRACTICE rows look at.
fn replay(obs: &Observations) -> Option<&Exchange> {
    match &obs.retry.answer {
        Ok(r) if r.status.is_success() && same_result(&obs.first.body, &r.body) => Some(r),
        _ => None,
    }
}

fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

/// `201 (67 B)`.
fn brief(e: &Exchange) -> String {
    format!("{} ({} B)", e.status.as_u16(), e.body.len())
}

/// Statuses with their counts: `201×1, 409×7, no answer×0`.
fn histogram<'a>(answers: impl Iterator<Item = &'a Answer>) -> String {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for a in answers {
        let key = match a {
            Ok(e) => e.status.as_u16().to_string(),
            Err(_) => "no answer".to_string(),
        };
        *counts.entry(key).or_default() += 1;
    }
    let parts: Vec<String> = counts.iter().map(|(s, n)| format!("{s}×{n}")).collect();
    parts.join(", ")
}

fn no_answer(check: &Check, e: &str) -> Row {
    Row::new(check, Finding::NotObserved, format!("no answer: {e}"))
}

fn retry_runs_once(obs: &Observations, telling: &Telling) -> Row {
    let check = &checks::RETRY_RUNS_ONCE;
    let r = match &obs.retry.answer {
        Ok(r) => r,
        Err(e) => return no_answer(check, e),
    };
    let seen = format!("first {}, retry {}", brief(&obs.first), brief(r));
    if let Some(n) = obs.retry.executions {
        let finding = if n == 0 { Finding::Pass } else { Finding::Fail };
        return Row::new(check, finding, format!("{seen}; executions +{n}"));
    }
    if r.status.is_success() {
        if !same_result(&obs.first.body, &r.body) {
            let why = "a 2xx with another body: the operation ran again";
            return Row::new(check, Finding::Fail, format!("{seen}: {why}")).by_answers();
        }
        return match telling {
            Telling::Yes => Row::new(
                check,
                Finding::Pass,
                format!("{seen}: the first's body, and another key's answer differs"),
            )
            .by_answers(),
            Telling::No(why) => Row::new(check, Finding::NotObserved, format!("{seen}; {why}")),
        };
    }
    if r.status.is_client_error() {
        return Row::new(check, Finding::Pass, format!("{seen}: refused, not run"));
    }
    let why = "whether it ran is not shown (give --executions)";
    Row::new(check, Finding::NotObserved, format!("{seen}; {why}"))
}

fn retry_same_result(obs: &Observations) -> Row {
    let check = &checks::RETRY_SAME_RESULT;
    let r = match &obs.retry.answer {
        Ok(r) => r,
        Err(e) => return no_answer(check, e),
    };
    let seen = format!("first {}, retry {}", brief(&obs.first), brief(r));
    if !r.status.is_success() {
        return Row::new(check, Finding::Fail, format!("{seen}: not a 2xx"));
    }
    if same_result(&obs.first.body, &r.body) {
        Row::new(check, Finding::Pass, format!("{seen}: the same result"))
    } else {
        Row::new(check, Finding::Fail, format!("{seen}: another body"))
    }
}

fn no_replay(check: &Check) -> Row {
    let why = "no replay to look at: the retry did not get the first's result";
    Row::new(check, Finding::NotObserved, why)
}

fn replay_status(obs: &Observations, replay: Option<&Exchange>) -> Row {
    let check = &checks::REPLAY_STATUS;
    let Some(r) = replay else {
        return no_replay(check);
    };
    let (first, again) = (obs.first.status.as_u16(), r.status.as_u16());
    let finding = if first == again {
        Finding::Pass
    } else {
        Finding::Fail
    };
    Row::new(check, finding, format!("first {first}, replay {again}"))
}

fn replay_bytes(obs: &Observations, replay: Option<&Exchange>) -> Row {
    let check = &checks::REPLAY_BYTES;
    let Some(r) = replay else {
        return no_replay(check);
    };
    let (a, b) = (obs.first.body.len(), r.body.len());
    if obs.first.body == r.body {
        Row::new(check, Finding::Pass, format!("{a} B, identical"))
    } else {
        let why = format!("first {a} B, replay {b} B: the same JSON, other bytes");
        Row::new(check, Finding::Fail, why)
    }
}

fn replay_headers(obs: &Observations, replay: Option<&Exchange>) -> Row {
    let check = &checks::REPLAY_HEADERS;
    let Some(r) = replay else {
        return no_replay(check);
    };
    let mut same = Vec::new();
    let mut differ = Vec::new();
    for name in ["content-type", "location"] {
        let Some(first) = obs.first.header(name) else {
            continue;
        };
        match r.header(name) {
            Some(again) if again == first => same.push(format!("{name}: {first}")),
            again => differ.push(format!("{name}: {first} → {}", again.unwrap_or("(none)"))),
        }
    }
    if !differ.is_empty() {
        return Row::new(check, Finding::Fail, differ.join("; "));
    }
    if same.is_empty() {
        let why = "the first answer had neither Content-Type nor Location";
        return Row::new(check, Finding::NotObserved, why);
    }
    Row::new(check, Finding::Pass, same.join("; "))
}

fn replay_marker(obs: &Observations, replay: Option<&Exchange>) -> Row {
    let check = &checks::REPLAY_MARKER;
    let Some(r) = replay else {
        return no_replay(check);
    };
    let marker = r.headers.iter().find(|(name, value)| {
        name.as_str().contains("replay") && obs.first.headers.get(*name) != Some(*value)
    });
    match marker {
        Some((name, value)) => {
            let value = String::from_utf8_lossy(value.as_bytes());
            Row::new(check, Finding::Pass, format!("{name}: {value}"))
        }
        None => {
            let why = "no header that the first answer lacks names the replay";
            Row::new(check, Finding::Fail, why)
        }
    }
}

fn new_key_new_operation(obs: &Observations) -> Row {
    let check = &checks::NEW_KEY_NEW_OPERATION;
    let a = match &obs.new_key.answer {
        Ok(a) => a,
        Err(e) => return no_answer(check, e),
    };
    let seen = format!("first {}, other key {}", brief(&obs.first), brief(a));
    if let Some(n) = obs.new_key.executions {
        let finding = if n >= 1 { Finding::Pass } else { Finding::Fail };
        return Row::new(check, finding, format!("{seen}; executions +{n}"));
    }
    if !a.status.is_success() {
        return Row::new(check, Finding::Fail, format!("{seen}: not run"));
    }
    if same_result(&obs.first.body, &a.body) {
        let why = "byte-identical answers for two keys: the kit cannot tell executions apart \
                   (give --executions)";
        return Row::new(check, Finding::NotObserved, format!("{seen}; {why}"));
    }
    Row::new(
        check,
        Finding::Pass,
        format!("{seen}: an answer of its own"),
    )
    .by_answers()
}

/// A request that must be refused with a 4xx: run (2xx) or failed otherwise is a failure.
fn refused(check: &Check, attempt: &Attempt, first: &Exchange) -> Row {
    let a = match &attempt.answer {
        Ok(a) => a,
        Err(e) => return no_answer(check, e),
    };
    let status = a.status.as_u16();
    if a.status.is_client_error() {
        return match attempt.executions {
            Some(n) if n > 0 => Row::new(
                check,
                Finding::Fail,
                format!("{status}, yet executions +{n}"),
            ),
            _ => Row::new(check, Finding::Pass, format!("refused: {}", brief(a))),
        };
    }
    if a.status.is_success() && same_result(&first.body, &a.body) {
        let why = "the first request's answer, given to a different request";
        return Row::new(check, Finding::Fail, format!("{}: {why}", brief(a)));
    }
    if a.status.is_success() {
        let why = "a new answer: the request ran";
        return Row::new(check, Finding::Fail, format!("{}: {why}", brief(a)));
    }
    Row::new(check, Finding::Fail, format!("{}: not a 4xx", brief(a)))
}

fn reuse_refused(obs: &Observations) -> Row {
    refused(&checks::REUSE_REFUSED, &obs.reuse, &obs.first)
}

fn key_optional(check: &Check) -> Row {
    let why = "--key-optional: the route does not require a key";
    Row::new(check, Finding::NotObserved, why)
}

fn missing_key_refused(obs: &Observations) -> Row {
    match &obs.missing {
        Some(attempt) => refused(&checks::MISSING_KEY_REFUSED, attempt, &obs.first),
        None => key_optional(&checks::MISSING_KEY_REFUSED),
    }
}

fn missing_key_400(obs: &Observations) -> Row {
    match &obs.missing {
        Some(attempt) => status_is(&checks::MISSING_KEY_400, &attempt.answer, 400),
        None => key_optional(&checks::MISSING_KEY_400),
    }
}

fn status_is(check: &Check, answer: &Answer, want: u16) -> Row {
    match answer {
        Ok(a) if a.status.as_u16() == want => Row::new(check, Finding::Pass, brief(a)),
        Ok(a) => Row::new(check, Finding::Fail, format!("{}, not {want}", brief(a))),
        Err(e) => no_answer(check, e),
    }
}

/// Every 4xx refusal of the run: the key checks', the 409s of the in-flight and concurrency checks.
fn refusals(obs: &Observations) -> Vec<&Exchange> {
    let mut answers: Vec<&Answer> = vec![&obs.reuse.answer, &obs.empty_key.answer];
    answers.push(&obs.long_key.answer);
    if let Some(missing) = &obs.missing {
        answers.push(&missing.answer);
    }
    answers.extend([&obs.in_flight.first, &obs.in_flight.duplicate]);
    answers.extend(obs.concurrent.answers.iter());
    answers
        .into_iter()
        .filter_map(|a| a.as_ref().ok())
        .filter(|e| e.status.is_client_error())
        .collect()
}

fn problem_json(obs: &Observations) -> Row {
    let check = &checks::PROBLEM_JSON;
    let refusals = refusals(obs);
    if refusals.is_empty() {
        return Row::new(check, Finding::NotObserved, "no 4xx refusal was seen");
    }
    let mut statuses: Vec<u16> = refusals.iter().map(|e| e.status.as_u16()).collect();
    statuses.sort_unstable();
    statuses.dedup();
    let other: Vec<String> = refusals
        .iter()
        .filter(|e| e.media_type().as_deref() != Some("application/problem+json"))
        .map(|e| {
            let media = e.media_type().unwrap_or_else(|| "no Content-Type".into());
            format!("{} as {media}", e.status.as_u16())
        })
        .collect();
    let listed: Vec<String> = statuses.iter().map(u16::to_string).collect();
    if other.is_empty() {
        let seen = format!(
            "{} refusals ({}), all problem+json",
            refusals.len(),
            listed.join(", ")
        );
        return Row::new(check, Finding::Pass, seen);
    }
    let mut other = other;
    other.sort();
    other.dedup();
    Row::new(check, Finding::Fail, other.join("; "))
}

fn principal_scope(obs: &Observations, telling: &Telling) -> Row {
    let check = &checks::PRINCIPAL_SCOPE;
    let Some(pair) = &obs.principal else {
        let why = "give --other-principal 'Header: value' (another principal's credentials)";
        return Row::new(check, Finding::NotObserved, why);
    };
    let first = match &pair.first.answer {
        Ok(a) if a.status.is_success() => a,
        Ok(a) => {
            let why = format!("the first principal's request was answered {}", brief(a));
            return Row::new(check, Finding::NotObserved, why);
        }
        Err(e) => return no_answer(check, e),
    };
    let other = match &pair.other.answer {
        Ok(a) => a,
        Err(e) => return no_answer(check, e),
    };
    let seen = format!("first principal {}, other {}", brief(first), brief(other));
    if !other.status.is_success() {
        let why = "the other principal is refused a key the first one used";
        return Row::new(check, Finding::Fail, format!("{seen}: {why}"));
    }
    match pair.other.executions {
        Some(0) => Row::new(check, Finding::Fail, format!("{seen}; executions +0")),
        Some(n) => Row::new(check, Finding::Pass, format!("{seen}; executions +{n}")),
        None if same_result(&first.body, &other.body) => match telling {
            Telling::Yes => {
                let why = "the first principal's answer, given to the other";
                Row::new(check, Finding::Fail, format!("{seen}: {why}")).by_answers()
            }
            Telling::No(why) => Row::new(check, Finding::NotObserved, format!("{seen}; {why}")),
        },
        None => Row::new(
            check,
            Finding::Pass,
            format!("{seen}: an answer of its own"),
        )
        .by_answers(),
    }
}

mod concurrency;
use concurrency::{concurrent_runs_once, in_flight_409, retry_after_409};

#[cfg(test)]
mod tests;
