//! The campaign end to end, as CI runs it: one short campaign per topology
//! with a fixed seed (real stores, three proxies, the journaling upstream,
//! clients and the nemesis), the campaign failing where a second execution
//! is known to happen, and the `check` command on a planted history.
//!
//! The proxy is the `idemproxy` binary beside `campaign` (`cargo nextest run
//! --workspace` builds both).

use std::path::Path;
use std::process::Command;

use serde_json::Value;

struct Ran {
    code: i32,
    stdout: String,
    summary: Value,
    dir: tempfile::TempDir,
}

fn campaign(topology: &str, seed: u64, extra: &[&str]) -> Ran {
    campaign_with(topology, seed, 8, extra)
}

fn campaign_with(topology: &str, seed: u64, clients: u32, extra: &[&str]) -> Ran {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_campaign"))
        .args(["--topology", topology, "--seed", &seed.to_string()])
        .args([
            "--duration",
            "15s",
            "--clients",
            &clients.to_string(),
            "--out",
        ])
        .arg(dir.path())
        .args(extra)
        .output()
        .expect("running campaign");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let code = out.status.code().unwrap_or(-1);
    assert_ne!(code, 2, "the campaign could not run:\n{stderr}\n{stdout}");
    let text = std::fs::read_to_string(dir.path().join("summary.json"))
        .unwrap_or_else(|e| panic!("summary.json: {e}\n{stderr}\n{stdout}"));
    Ran {
        code,
        stdout,
        summary: serde_json::from_str(&text).expect("summary.json is JSON"),
        dir,
    }
}

fn violations(summary: &Value) -> u64 {
    summary["violations"]
        .as_object()
        .expect("violations")
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum()
}

/// A short campaign on `topology` holds: operations ran, faults were
/// injected, the checker found no violation, and the outputs are there.
fn holds(topology: &str, seed: u64) {
    let ran = campaign(topology, seed, &[]);
    let s = &ran.summary;
    assert_eq!(
        (ran.code, violations(s)),
        (0, 0),
        "{topology} seed {seed}:\n{}",
        ran.stdout
    );
    assert!(s["operations"].as_u64().unwrap() > 100, "{s}");
    // Every line placed: each fault's end pairs with its start, each answer with its request.
    assert_eq!(s["malformed"], 0, "{s}");
    let faults: u64 = s["faults_by_kind"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert!(faults >= 3, "few faults injected: {}", s["faults_by_kind"]);
    assert!(s["executions"].as_u64().unwrap() > 50, "{s}");
    let svg = std::fs::read_to_string(ran.dir.path().join("timeline.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(ran.dir.path().join("history.jsonl").exists());
}

#[test]
fn sentinel_holds() {
    holds("sentinel", 11);
}

#[test]
fn sentinel_with_wait_replicas_holds() {
    holds("sentinel-wait", 12);
}

#[test]
fn cluster_holds() {
    holds("cluster", 13);
}

#[test]
fn postgres_holds() {
    holds("postgres", 14);
}

/// Under `lease_expiry = "re_execute"` a proxy killed or paused past its
/// lease after the upstream ran a request leaves a key that runs again: the campaign must say so (exit 1,
/// the seed, the history), and the same faults without it must not.
#[test]
fn re_execute_with_proxies_killed_runs_a_key_twice_and_the_campaign_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let extra = dir.path().join("route.toml");
    std::fs::write(&extra, "lease = \"1s\"\nlease_expiry = \"re_execute\"\n").unwrap();
    let extra = extra.to_str().unwrap();
    // Kills and pauses (a proxy stopped past its lease with a request at
    // the upstream), and clients enough that some request is in flight.
    let faults = ["--faults", "kill,pause", "--proxy-config-extra"];
    let ran = campaign_with("postgres", 1, 16, &[&faults[..], &[extra]].concat());
    assert_eq!(ran.code, 1, "{}", ran.stdout);
    let twice = ran.summary["violations"]["executed_twice"]
        .as_u64()
        .unwrap();
    assert!(twice >= 1, "{}", ran.summary["violations"]);
    assert!(ran.stdout.contains("--seed 1"), "{}", ran.stdout);
    assert!(ran.stdout.contains("\"ev\":\"exec\""), "{}", ran.stdout);

    let control = dir.path().join("control.toml");
    std::fs::write(&control, "lease = \"1s\"\n").unwrap();
    let ran = campaign(
        "postgres",
        1,
        &[
            "--faults",
            "kill",
            "--proxy-config-extra",
            control.to_str().unwrap(),
        ],
    );
    assert_eq!(
        (ran.code, violations(&ran.summary)),
        (0, 0),
        "{}",
        ran.stdout
    );
}

/// The same on Redis, where a store fault excuses a second execution of a
/// record written while it was open: proxy kills under `re_execute` still
/// show, the store's faults excuse only what they could have lost.
#[test]
fn re_execute_is_found_on_redis_too() {
    let dir = tempfile::tempdir().unwrap();
    let extra = dir.path().join("route.toml");
    std::fs::write(&extra, "lease = \"1s\"\nlease_expiry = \"re_execute\"\n").unwrap();
    // Seed 6 draws four kills or pauses of proxies in 15 s.
    let ran = campaign_with(
        "sentinel",
        6,
        16,
        &[
            "--faults",
            "kill,pause",
            "--proxy-config-extra",
            extra.to_str().unwrap(),
        ],
    );
    assert_eq!(ran.code, 1, "{}", ran.stdout);
    let twice = ran.summary["violations"]["executed_twice"]
        .as_u64()
        .unwrap();
    assert!(twice >= 1, "{}", ran.summary["violations"]);
}

fn write_history(path: &Path, lines: &[&str]) {
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

/// `campaign check` on a history with a planted second execution: exit 1,
/// the kind, the key and the seed; the same history without it: exit 0.
#[test]
fn the_check_command_reports_a_planted_second_execution() {
    let dir = tempfile::tempdir().unwrap();
    let run = r#"{"ev":"run","topology":"postgres","seed":77,"duration_ms":10000,"proxies":2,"clients":1,"lease_ms":1000,"lease_expiry":"unknown_outcome","wait_replicas":0,"at_risk":"never","settle_bound_ms":5000}"#;
    let sha = "ab".repeat(32);
    let key_life = [
        r#"{"ev":"invoke","t":100,"op":0,"client":0,"key":"k1","attempt":0,"proxy":0,"phase":"load"}"#.to_string(),
        format!(r#"{{"ev":"exec","t":110,"key":"k1","exec":"e1","status":201,"body_sha":"{sha}"}}"#),
        format!(r#"{{"ev":"answer","t":120,"op":0,"status":201,"replayed":false,"body_sha":"{sha}","exec":"e1","answer_key":"k1","problem":null,"latency_ms":20.0}}"#),
        r#"{"ev":"healed","t":9000}"#.to_string(),
        r#"{"ev":"invoke","t":9100,"op":1,"client":9,"key":"k1","attempt":1,"proxy":1,"phase":"final"}"#.to_string(),
        format!(r#"{{"ev":"answer","t":9110,"op":1,"status":201,"replayed":true,"body_sha":"{sha}","exec":"e1","answer_key":"k1","problem":null,"latency_ms":10.0}}"#),
        r#"{"ev":"end","t":10000}"#.to_string(),
    ];
    let mut clean: Vec<&str> = vec![run];
    clean.extend(key_life.iter().map(String::as_str));
    let clean_path = dir.path().join("clean.jsonl");
    write_history(&clean_path, &clean);
    let planted_exec = format!(
        r#"{{"ev":"exec","t":5000,"key":"k1","exec":"e2","status":201,"body_sha":"{sha}"}}"#
    );
    let mut planted = clean.clone();
    planted.push(&planted_exec);
    let planted_path = dir.path().join("planted.jsonl");
    write_history(&planted_path, &planted);

    let check = |path: &Path| {
        let out = Command::new(env!("CARGO_BIN_EXE_campaign"))
            .arg("check")
            .arg(path)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, text) = check(&clean_path);
    assert_eq!(code, 0, "{text}");
    let (code, text) = check(&planted_path);
    assert_eq!(code, 1, "{text}");
    for want in ["executed_twice", "k1", "--seed 77", "e2"] {
        assert!(text.contains(want), "{want} missing:\n{text}");
    }
}
