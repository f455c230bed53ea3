//! The rows about overlapping requests: a duplicate in flight, simultaneous duplicates, and their 409s.

use std::time::Duration;

use super::{brief, histogram, ms, no_answer, same_result, Telling};
use crate::conformance::checks;
use crate::conformance::client::Exchange;
use crate::conformance::probe::Observations;
use crate::conformance::report::{Finding, Row};

/// A duplicate sent while the first was unanswered: 409 passes; a second
/// execution, a duplicate held until the first finished, or another status
/// fails; a first request answered before the duplicate could overlap it is
/// "not observed", with the timings.
pub(super) fn in_flight_409(obs: &Observations) -> Row {
    let check = &checks::IN_FLIGHT_409;
    let (first, dup) = match (&obs.in_flight.first, &obs.in_flight.duplicate) {
        (Ok(f), Ok(d)) => (f, d),
        (Err(e), _) | (_, Err(e)) => return no_answer(check, e),
    };
    let sent_after = dup.sent.saturating_duration_since(first.sent);
    let timing = format!(
        "duplicate sent {} after the first, first answered after {}",
        ms(sent_after),
        ms(first.latency())
    );
    if dup.sent >= first.answered {
        let why = "the first was answered before the duplicate was sent: too fast to overlap";
        return Row::new(check, Finding::NotObserved, format!("{timing}; {why}"));
    }
    let seen = format!("{timing}; first {}, duplicate {}", brief(first), brief(dup));
    if dup.status.as_u16() == 409 || first.status.as_u16() == 409 {
        let took = ms(dup.latency());
        return Row::new(check, Finding::Pass, format!("{seen} in {took}"));
    }
    if !(first.status.is_success() && dup.status.is_success()) {
        return Row::new(check, Finding::Fail, format!("{seen}: no 409"));
    }
    let twice = match obs.in_flight.executions {
        Some(n) => n > 1,
        None => !same_result(&first.body, &dup.body),
    };
    if twice {
        let why = "both ran: the duplicate was executed again";
        let row = Row::new(check, Finding::Fail, format!("{seen}: {why}"));
        return match obs.in_flight.executions {
            Some(_) => row,
            None => row.by_answers(),
        };
    }
    held_or_too_fast(obs, first, dup, seen)
}

/// Both got one result without a 409: the duplicate either waited for the
/// first (a failure of this row), or reached the endpoint after the first had
/// finished there, its answer still on the way (not observed). A replay is
/// quick (the retry check timed one); a duplicate that took about as long as
/// the first still had to run was held.
fn held_or_too_fast(obs: &Observations, first: &Exchange, dup: &Exchange, seen: String) -> Row {
    let check = &checks::IN_FLIGHT_409;
    let quick = obs
        .retry
        .answer
        .as_ref()
        .map_or(Duration::ZERO, Exchange::latency);
    let remaining = first.answered.saturating_duration_since(dup.sent);
    if remaining <= quick * 2 + Duration::from_millis(10) {
        let why = format!(
            "the first was answered {} after the duplicate was sent, about as long as a replay \
             takes ({}): too fast to overlap",
            ms(remaining),
            ms(quick)
        );
        return Row::new(check, Finding::NotObserved, format!("{seen}; {why}"));
    }
    if dup.latency() >= remaining / 2 {
        let why = format!(
            "the duplicate was held {} until the first finished, then given its result: no 409",
            ms(dup.latency())
        );
        return Row::new(check, Finding::Fail, format!("{seen}: {why}"));
    }
    let why = "the duplicate got the result before the first's answer arrived: the first had \
               finished at the endpoint already";
    Row::new(check, Finding::NotObserved, format!("{seen}; {why}"))
}

/// At most one execution among simultaneous identical requests.
pub(super) fn concurrent_runs_once(obs: &Observations, telling: &Telling) -> Row {
    let check = &checks::CONCURRENT_RUNS_ONCE;
    let answers = &obs.concurrent.answers;
    let statuses = format!("{} at once: {}", answers.len(), histogram(answers.iter()));
    if let Some(n) = obs.concurrent.executions {
        let finding = if n <= 1 { Finding::Pass } else { Finding::Fail };
        return Row::new(check, finding, format!("{statuses}; executions +{n}"));
    }
    let mut results: Vec<&Exchange> = Vec::new();
    for e in answers.iter().filter_map(|a| a.as_ref().ok()) {
        if e.status.is_success() && !results.iter().any(|r| same_result(&r.body, &e.body)) {
            results.push(e);
        }
    }
    // A request that failed may have run before it failed (a unique-constraint
    // error after the work): only a counter can show it did not.
    let failed = answers
        .iter()
        .filter(|a| a.as_ref().map_or(true, |e| e.status.is_server_error()))
        .count();
    match (results.len(), telling) {
        (0, _) => {
            let why = "no request succeeded";
            Row::new(check, Finding::NotObserved, format!("{statuses}; {why}"))
        }
        (1, _) if failed > 0 => {
            let why = format!(
                "{failed} of them failed (a 5xx or no answer), and a failed answer may hide an \
                 execution (give --executions)"
            );
            Row::new(check, Finding::NotObserved, format!("{statuses}; {why}"))
        }
        (1, Telling::Yes) => {
            let why = "one result among them";
            Row::new(check, Finding::Pass, format!("{statuses}: {why}")).by_answers()
        }
        (1, Telling::No(why)) => {
            Row::new(check, Finding::NotObserved, format!("{statuses}; {why}"))
        }
        (n, _) => {
            let why = format!("{n} different 2xx answers to one request: it ran {n} times");
            Row::new(check, Finding::Fail, format!("{statuses}: {why}")).by_answers()
        }
    }
}

/// Every 409 of the run has a `Retry-After`.
pub(super) fn retry_after_409(obs: &Observations) -> Row {
    let check = &checks::RETRY_AFTER_409;
    let in_flight = [&obs.in_flight.first, &obs.in_flight.duplicate];
    let conflicts: Vec<&Exchange> = in_flight
        .into_iter()
        .chain(obs.concurrent.answers.iter())
        .filter_map(|a| a.as_ref().ok())
        .filter(|e| e.status.as_u16() == 409)
        .collect();
    if conflicts.is_empty() {
        return Row::new(check, Finding::NotObserved, "no 409 was seen");
    }
    let with: Vec<&str> = conflicts
        .iter()
        .filter_map(|e| e.header("retry-after"))
        .collect();
    let n = conflicts.len();
    if with.len() == n {
        let value = with.first().copied().unwrap_or_default();
        return Row::new(
            check,
            Finding::Pass,
            format!("{n} of {n} 409s (Retry-After: {value})"),
        );
    }
    let why = format!("{} of {n} 409s without Retry-After", n - with.len());
    Row::new(check, Finding::Fail, why)
}
