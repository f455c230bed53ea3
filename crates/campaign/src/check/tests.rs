use super::*;
use crate::history;
use crate::history::FaultPhase;

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
