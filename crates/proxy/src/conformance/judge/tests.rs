//! The judge on made-up runs: a conforming endpoint, and each defect the kit must report.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};

use super::*;
use crate::conformance::probe::{Concurrent, InFlight, PrincipalPair};

/// An answer `status` with `body`, sent `at` ms after `t0` and answered `took` ms later.
fn ex(t0: Instant, status: u16, body: &str, at: u64, took: u64) -> Exchange {
    let mut headers = HeaderMap::new();
    let media = if status >= 400 {
        "application/problem+json"
    } else {
        "application/json"
    };
    headers.insert("content-type", HeaderValue::from_static(media));
    if status == 409 {
        headers.insert("retry-after", HeaderValue::from_static("1"));
    }
    let sent = t0 + Duration::from_millis(at);
    Exchange {
        status: StatusCode::from_u16(status).unwrap(),
        headers,
        body: Bytes::from(body.to_string()),
        sent,
        answered: sent + Duration::from_millis(took),
    }
}

fn attempt(e: Exchange) -> Attempt {
    Attempt {
        answer: Ok(e),
        executions: None,
    }
}

/// What a conforming endpoint that takes 300 ms answers.
fn conforming() -> Observations {
    let t0 = Instant::now();
    let mut replay = ex(t0, 201, r#"{"id":1}"#, 400, 2);
    replay
        .headers
        .insert("idempotent-replayed", HeaderValue::from_static("true"));
    let mut concurrent = vec![Ok(ex(t0, 201, r#"{"id":4}"#, 2000, 300))];
    concurrent.extend((0..7).map(|_| Ok(ex(t0, 409, "{}", 2000, 2))));
    Observations {
        first: ex(t0, 201, r#"{"id":1}"#, 0, 300),
        first_executions: None,
        retry: attempt(replay),
        new_key: attempt(ex(t0, 201, r#"{"id":2}"#, 500, 300)),
        reuse: attempt(ex(t0, 422, "{}", 900, 2)),
        missing: Some(attempt(ex(t0, 400, "{}", 910, 2))),
        empty_key: attempt(ex(t0, 400, "{}", 920, 2)),
        long_key: attempt(ex(t0, 400, "{}", 930, 2)),
        in_flight: InFlight {
            first: Ok(ex(t0, 201, r#"{"id":3}"#, 1000, 300)),
            duplicate: Ok(ex(t0, 409, "{}", 1150, 2)),
            delay: Duration::from_millis(150),
            executions: None,
        },
        concurrent: Concurrent {
            answers: concurrent,
            executions: None,
        },
        principal: None,
    }
}

fn finding(rows: &[Row], id: &str) -> Finding {
    rows.iter()
        .find(|r| r.id == id)
        .unwrap_or_else(|| panic!("no row {id}"))
        .result
        .clone()
}

#[test]
fn a_conforming_run_passes_every_row_but_the_unasked_one() {
    let rows = super::rows(&conforming());
    assert_eq!(rows.len(), checks::ALL.len());
    for (row, check) in rows.iter().zip(checks::ALL) {
        assert_eq!(row.id, check.id, "rows in the order of checks::ALL");
        let want = match row.id {
            "principal-scope" => Finding::NotObserved,
            _ => Finding::Pass,
        };
        assert_eq!(row.result, want, "{row:?}");
    }
}

#[test]
fn a_201_replayed_as_200_fails_only_the_practice_row() {
    let mut obs = conforming();
    if let Ok(r) = &mut obs.retry.answer {
        r.status = StatusCode::OK;
    }
    let rows = super::rows(&obs);
    assert_eq!(finding(&rows, "replay-status"), Finding::Fail);
    assert_eq!(finding(&rows, "retry-same-result"), Finding::Pass);
    let report = crate::conformance::Report::new("t".into(), "POST".into(), None, rows);
    assert_eq!(report.exit_code, 0);
}

#[test]
fn a_duplicate_run_again_in_flight_fails_the_409_and_the_must() {
    let mut obs = conforming();
    let t0 = Instant::now();
    obs.in_flight.duplicate = Ok(ex(t0, 201, r#"{"id":9}"#, 150, 300));
    obs.concurrent.answers = (0..8)
        .map(|i| Ok(ex(t0, 201, &format!(r#"{{"id":{}}}"#, 20 + i), 0, 300)))
        .collect();
    let rows = super::rows(&obs);
    assert_eq!(finding(&rows, "in-flight-409"), Finding::Fail);
    assert_eq!(finding(&rows, "concurrent-runs-once"), Finding::Fail);
    assert_eq!(finding(&rows, "retry-after-409"), Finding::NotObserved);
}

#[test]
fn a_reused_key_answered_with_the_first_result_fails_the_must() {
    let mut obs = conforming();
    obs.reuse = attempt(ex(Instant::now(), 201, r#"{"id":1}"#, 0, 2));
    let rows = super::rows(&obs);
    assert_eq!(finding(&rows, "reuse-refused"), Finding::Fail);
    assert_eq!(finding(&rows, "reuse-422"), Finding::Fail);
}

#[test]
fn identical_answers_for_two_keys_leave_executions_unobserved() {
    let mut obs = conforming();
    obs.new_key = attempt(ex(Instant::now(), 201, r#"{"id":1}"#, 0, 300));
    let rows = super::rows(&obs);
    for id in [
        "retry-runs-once",
        "new-key-new-operation",
        "concurrent-runs-once",
    ] {
        assert_eq!(finding(&rows, id), Finding::NotObserved, "{id}");
    }
    // A counter settles it.
    obs.first_executions = Some(1);
    obs.retry.executions = Some(0);
    obs.new_key.executions = Some(0);
    let rows = super::rows(&obs);
    assert_eq!(finding(&rows, "retry-runs-once"), Finding::Pass);
    assert_eq!(finding(&rows, "new-key-new-operation"), Finding::Fail);
}

#[test]
fn an_endpoint_too_fast_to_overlap_is_not_observed() {
    let mut obs = conforming();
    let t0 = Instant::now();
    obs.in_flight.first = Ok(ex(t0, 201, r#"{"id":3}"#, 0, 2));
    obs.in_flight.duplicate = Ok(ex(t0, 201, r#"{"id":3}"#, 5, 1));
    assert_eq!(finding(&rows(&obs), "in-flight-409"), Finding::NotObserved);
    // Sent before the first's answer, which came back as fast as a replay does.
    obs.in_flight.first = Ok(ex(t0, 201, r#"{"id":3}"#, 0, 4));
    obs.in_flight.duplicate = Ok(ex(t0, 201, r#"{"id":3}"#, 2, 1));
    assert_eq!(finding(&rows(&obs), "in-flight-409"), Finding::NotObserved);
}

#[test]
fn a_duplicate_held_until_the_first_finished_fails_the_409_row() {
    let mut obs = conforming();
    let t0 = Instant::now();
    obs.in_flight.first = Ok(ex(t0, 201, r#"{"id":3}"#, 0, 300));
    obs.in_flight.duplicate = Ok(ex(t0, 201, r#"{"id":3}"#, 150, 152));
    let rows = super::rows(&obs);
    assert_eq!(finding(&rows, "in-flight-409"), Finding::Fail);
}

#[test]
fn another_principal_given_the_first_answer_fails_the_scope_row() {
    let mut obs = conforming();
    let t0 = Instant::now();
    obs.principal = Some(PrincipalPair {
        first: attempt(ex(t0, 201, r#"{"id":5}"#, 0, 300)),
        other: attempt(ex(t0, 201, r#"{"id":5}"#, 400, 2)),
    });
    assert_eq!(finding(&rows(&obs), "principal-scope"), Finding::Fail);
    obs.principal = Some(PrincipalPair {
        first: attempt(ex(t0, 201, r#"{"id":5}"#, 0, 300)),
        other: attempt(ex(t0, 201, r#"{"id":6}"#, 400, 300)),
    });
    assert_eq!(finding(&rows(&obs), "principal-scope"), Finding::Pass);
}

#[test]
fn json_bodies_with_other_spacing_are_the_same_result() {
    assert!(same_result(
        &Bytes::from_static(br#"{"a": 1, "b": 2}"#),
        &Bytes::from_static(br#"{"b":2,"a":1}"#)
    ));
    assert!(!same_result(
        &Bytes::from_static(b"{\"a\":1}"),
        &Bytes::from_static(b"{\"a\":2}")
    ));
}
