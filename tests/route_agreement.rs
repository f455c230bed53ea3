//! Route agreement (docs/routes-and-keys.md#what-is-protected): the proxy and real upstream frameworks agree on which
//! request is protected: every spelling, sent twice with one key, runs a handler at most once.
//!
//! Eight real upstreams (tests/frameworks: Flask, FastAPI on uvicorn, aiohttp, Django REST
//! framework's DefaultRouter, Express 4 and 5 with method-override, Go's ServeMux, Rails
//! 6.1), each behind a proxy of its own with the same three routes, get the same seeded
//! random spellings of those routes (tests/frameworks/spellings.rs), byte for byte over
//! HTTP/1.1 or HTTP/2. Every violation is reported, grouped by framework and by the
//! composition of mutations that made the spelling, not only the first.
//!
//! ```sh
//! cargo nextest run --test route_agreement                # the bounded CI run
//! IDEMPROXY_AGREEMENT_CASES=5000 cargo nextest run --test route_agreement --no-capture
//! IDEMPROXY_AGREEMENT_SEED=0x5eed cargo nextest run --test route_agreement   # another seed
//! ```
//! The report is printed and written to `target/route-agreement-report.txt`.

mod support;

#[path = "frameworks/spellings.rs"]
mod spellings;
#[path = "frameworks/upstreams.rs"]
mod upstreams;
#[path = "frameworks/wire.rs"]
mod wire;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use spellings::{Case, Mutation};
use support::{ConfigBuilder, Proxy};
use upstreams::{Dirs, Framework, Upstream};
use wire::Answer;

/// The seed when `IDEMPROXY_AGREEMENT_SEED` is not set: fixed, so CI runs the same cases.
const DEFAULT_SEED: u64 = 0x1de9_2026;
/// Spellings per framework when `IDEMPROXY_AGREEMENT_CASES` is not set: within the
/// 3-minute budget on 2 cores with room to spare.
const DEFAULT_CASES: usize = 800;
/// Spellings in flight at once per framework (the frameworks run side by side too): more
/// than the cores, because a spelling an upstream leaves unanswered waits out the upstream
/// timeout; twice as many for Rails, whose puma leaves about one spelling in ten so.
fn workers_for(framework: Framework) -> usize {
    match framework {
        Framework::Rails => 12,
        _ => 6,
    }
}

/// The protected routes: the same as every app's handlers.
const ROUTES: &str = r#"
[defaults]
key = "required"

[[routes]]
name = "payments"
methods = ["POST"]
path = "/v1/payments"

[[routes]]
name = "pay"
methods = ["POST"]
path = "/v1/orders/{id}/pay"

[[routes]]
name = "order"
methods = ["PATCH"]
path = "/v1/orders/{id}"
"#;

/// What one spelling did at one framework.
struct Outcome {
    framework: Framework,
    case: usize,
    /// The HTTP/1.1 bytes sent (twice), or the HTTP/2 request described.
    sent: String,
    answers: [Answer; 2],
    runs: usize,
    handlers: Vec<String>,
}

impl Outcome {
    /// The proxy refused it (a 4xx problem of its own), as against answering for an
    /// upstream that did not answer (a 5xx problem such as `upstream-timeout`).
    fn refused_by_proxy(&self) -> bool {
        self.answers
            .iter()
            .any(|a| a.problem.is_some() && (400..500).contains(&a.status))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spelling_runs_a_handler_at_most_once() {
    let seed = env_number("IDEMPROXY_AGREEMENT_SEED").unwrap_or(DEFAULT_SEED);
    let n = env_number("IDEMPROXY_AGREEMENT_CASES").map_or(DEFAULT_CASES, |n| n as usize);
    let dirs = Dirs::new();
    let setup = tokio::task::block_in_place(|| dirs.set_up());

    let started = Instant::now();
    let logs = tempfile::tempdir().expect("a log directory");
    let mut upstreams: Vec<Upstream> = Framework::ALL
        .iter()
        .map(|&f| Upstream::spawn(f, &dirs, logs.path()))
        .collect();
    for u in &mut upstreams {
        u.wait_listening().await;
    }
    let listening = started.elapsed();

    let mut cases = spellings::canonical();
    cases.extend(spellings::generate(seed, n));
    let cases = Arc::new(cases);
    let started = Instant::now();
    let mut runs = Vec::new();
    for upstream in upstreams {
        runs.push(tokio::spawn(run_framework(
            Arc::new(upstream),
            cases.clone(),
        )));
    }
    let mut outcomes = Vec::new();
    for run in runs {
        outcomes.extend(run.await.expect("a framework's run"));
    }
    let sending = started.elapsed();

    let report = report(&cases, &outcomes, seed, n, setup, listening, sending);
    println!("{report}");
    let file = dirs.target.join("route-agreement-report.txt");
    std::fs::write(&file, report + &every_outcome(&cases, &outcomes)).expect("write the report");
    println!("(written to {})", file.display());

    // The test can fail: a canonical spelling runs exactly once everywhere, so a dead
    // upstream or a broken counter does not pass for agreement.
    let broken: Vec<String> = outcomes
        .iter()
        .filter(|o| cases[o.case].is_canonical())
        .filter(|o| o.runs != 1 || !o.answers[1].replayed)
        .map(|o| {
            format!(
                "{}: {} ran {} time(s), answers {}, {}",
                o.framework.name(),
                cases[o.case],
                o.runs,
                o.answers[0].describe(),
                o.answers[1].describe()
            )
        })
        .collect();
    assert!(
        broken.is_empty(),
        "canonical spellings must run exactly once and replay (seed {seed:#x}):\n{}",
        broken.join("\n")
    );
    let violations = outcomes.iter().filter(|o| o.runs > 1).count();
    assert_eq!(
        violations,
        0,
        "{violations} spellings ran a handler more than once with one key \
         (IDEMPROXY_AGREEMENT_SEED={seed:#x} IDEMPROXY_AGREEMENT_CASES={n}); the report above lists them all"
    );
}

/// Sends every case through a proxy of the framework's own; reads the counts back.
async fn run_framework(upstream: Arc<Upstream>, cases: Arc<Vec<Case>>) -> Vec<Outcome> {
    // Puma leaves some requests unanswered (lower-case methods): a short upstream timeout
    // keeps those from holding a worker for long (the 504 is stored, and counts as an answer).
    let text = ConfigBuilder::new(&upstream.url())
        .server("upstream_timeout = \"2s\"")
        .routes(ROUTES)
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    let next = Arc::new(AtomicUsize::new(0));
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let mut workers = Vec::new();
    for _ in 0..workers_for(upstream.framework) {
        let (upstream, cases, next, outcomes) = (
            upstream.clone(),
            cases.clone(),
            next.clone(),
            outcomes.clone(),
        );
        let addr = proxy.addr;
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(case) = cases.get(i) else { break };
                let outcome = run_case(&upstream, addr, i, case).await;
                outcomes.lock().unwrap().push(outcome);
            }
        }));
    }
    for w in workers {
        w.await.expect("a worker");
    }
    drop(proxy);
    let mut outcomes = std::mem::take(&mut *outcomes.lock().unwrap());
    outcomes.sort_by_key(|o| o.case);
    outcomes
}

async fn run_case(upstream: &Upstream, proxy: SocketAddr, i: usize, case: &Case) -> Outcome {
    let key = format!("agree-{}-{}", case.number, upstream.port);
    let (sent, answers) = if case.http2 {
        let answers = wire::send_h2_twice(proxy, case, &key).await;
        (format!("HTTP/2 {case}"), answers)
    } else {
        let request = wire::h1_request(case, proxy, &key);
        let first = wire::send_h1(proxy, &request).await;
        let second = wire::send_h1(proxy, &request).await;
        (format!("\"{}\"", request.escape_ascii()), [first, second])
    };
    let (runs, handlers) = upstream.runs(&key).await.unwrap_or_else(|e| {
        panic!(
            "{}: the count for {key} could not be read: {e}\n{}",
            upstream.framework.name(),
            upstream.log_text()
        )
    });
    Outcome {
        framework: upstream.framework,
        case: i,
        sent,
        answers,
        runs,
        handlers,
    }
}

fn env_number(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    Some(parsed.unwrap_or_else(|e| panic!("{name}={v:?}: {e}")))
}

/// The figures per framework, then every violation grouped by framework and by kind.
fn report(
    cases: &[Case],
    outcomes: &[Outcome],
    seed: u64,
    n: usize,
    setup: std::time::Duration,
    listening: std::time::Duration,
    sending: std::time::Duration,
) -> String {
    let mut r = String::new();
    let h2 = cases.iter().filter(|c| c.http2).count();
    let _ = writeln!(
        r,
        "route agreement: seed {seed:#x}, {n} random spellings + {} canonical per framework \
         ({} over HTTP/1.1, {h2} over HTTP/2), each sent twice with one key",
        cases.len() - n,
        cases.len() - h2,
    );
    let _ = writeln!(
        r,
        "set-up {:.1}s, frameworks listening after {:.1}s, sending and counting {:.1}s",
        setup.as_secs_f64(),
        listening.as_secs_f64(),
        sending.as_secs_f64()
    );
    let _ = writeln!(
        r,
        "\n{:<12} {:>8} {:>10} {:>10} {:>10}   not run: the answers (first / second)",
        "framework", "reached", "ran-twice", "refused", "not-run"
    );
    for f in Framework::ALL {
        let mine: Vec<&Outcome> = outcomes.iter().filter(|o| o.framework == f).collect();
        let reached = mine.iter().filter(|o| o.runs >= 1).count();
        let twice = mine.iter().filter(|o| o.runs >= 2).count();
        let refused = mine
            .iter()
            .filter(|o| o.runs == 0 && o.refused_by_proxy())
            .count();
        let not_run = mine
            .iter()
            .filter(|o| o.runs == 0 && !o.refused_by_proxy())
            .count();
        let mut answers: BTreeMap<String, usize> = BTreeMap::new();
        for o in mine.iter().filter(|o| o.runs == 0) {
            let a = if o.answers[0].status == o.answers[1].status {
                status_word(&o.answers[0])
            } else {
                format!(
                    "{}/{}",
                    status_word(&o.answers[0]),
                    status_word(&o.answers[1])
                )
            };
            *answers.entry(a).or_default() += 1;
        }
        let answers: Vec<String> = answers.iter().map(|(a, n)| format!("{a}×{n}")).collect();
        let _ = writeln!(
            r,
            "{:<12} {reached:>8} {twice:>10} {refused:>10} {not_run:>10}   {}",
            f.name(),
            answers.join(", ")
        );
    }
    let _ = writeln!(
        r,
        "(reached: a handler ran; refused: nothing ran, the proxy answered a 4xx problem; \
         not-run: nothing ran, the answers were the upstream's, or the proxy's for an \
         upstream that did not answer)"
    );

    // The proxy refuses a control character in the path outright: how the
    // spellings with one fared (informational; the property is the one above).
    let _ = writeln!(
        r,
        "\ncontrol characters in the path (raw or %00-%1F, %7F): refused with a problem / \
         reached a handler / neither"
    );
    for f in Framework::ALL {
        let with: Vec<&Outcome> = outcomes
            .iter()
            .filter(|o| o.framework == f && cases[o.case].has_control())
            .collect();
        let refused = with.iter().filter(|o| o.refused_by_proxy()).count();
        let reached = with.iter().filter(|o| o.runs >= 1).count();
        let neither = with
            .iter()
            .filter(|o| o.runs == 0 && !o.refused_by_proxy())
            .count();
        let _ = writeln!(
            r,
            "  {:<12} {} spellings: {refused} / {reached} / {neither}",
            f.name(),
            with.len()
        );
    }

    // Which single mutations the violations contain, per framework.
    let violations: Vec<&Outcome> = outcomes.iter().filter(|o| o.runs > 1).collect();
    let _ = writeln!(
        r,
        "\n{} violations (a key ran a handler more than once)",
        violations.len()
    );
    if violations.is_empty() {
        return r;
    }
    let mut by_mutation: BTreeMap<Mutation, BTreeMap<&str, usize>> = BTreeMap::new();
    for o in &violations {
        for m in &cases[o.case].mutations {
            *by_mutation
                .entry(*m)
                .or_default()
                .entry(o.framework.name())
                .or_default() += 1;
        }
    }
    let _ = writeln!(r, "\nviolations containing each mutation, per framework:");
    for (m, per) in &by_mutation {
        let per: Vec<String> = per.iter().map(|(f, n)| format!("{f} {n}")).collect();
        let _ = writeln!(r, "  {:<16} {}", m.name(), per.join(", "));
    }

    let _ = writeln!(r, "\nevery violation, by framework and composition:");
    for f in Framework::ALL {
        let mut groups: BTreeMap<String, Vec<&Outcome>> = BTreeMap::new();
        for o in violations.iter().filter(|o| o.framework == f) {
            groups.entry(cases[o.case].kinds()).or_default().push(o);
        }
        if groups.is_empty() {
            continue;
        }
        let total: usize = groups.values().map(Vec::len).sum();
        let _ = writeln!(r, "\n== {} ({total})", f.name());
        for (kinds, group) in groups {
            let _ = writeln!(r, "  -- {kinds} ({})", group.len());
            for o in group {
                let case = &cases[o.case];
                let _ = writeln!(
                    r,
                    "     #{} {case}\n        answers: {} then {}; ran {}×: {}\n        sent: {}",
                    case.number,
                    o.answers[0].describe(),
                    o.answers[1].describe(),
                    o.runs,
                    o.handlers.join(" "),
                    o.sent
                );
            }
        }
    }
    let _ = writeln!(
        r,
        "\nreplay with IDEMPROXY_AGREEMENT_SEED={seed:#x} IDEMPROXY_AGREEMENT_CASES={n}"
    );
    r
}

/// One line per spelling and framework (for the report file).
fn every_outcome(cases: &[Case], outcomes: &[Outcome]) -> String {
    let mut r = String::from("\nevery spelling at every framework (runs, answers):\n");
    for o in outcomes {
        let case = &cases[o.case];
        let _ = writeln!(
            r,
            "{:<12} #{:<5} ran {} [{}] {} / {}   {case}",
            o.framework.name(),
            case.number,
            o.runs,
            o.handlers.join(" "),
            o.answers[0].describe(),
            o.answers[1].describe(),
        );
    }
    r
}

fn status_word(a: &Answer) -> String {
    match (&a.problem, a.status) {
        (Some(p), s) => format!("{s} {p}"),
        (None, 0) => "none".to_string(),
        (None, s) if a.empty => format!("{s} (no body)"),
        (None, s) => s.to_string(),
    }
}
