//! The campaign's history: every client operation, every fault and every
//! execution the upstream journaled, one JSON object per line
//! (`DIR/history.jsonl`). The checker reads nothing else, so a history
//! written by hand (a test's planted violation) is checked like a real one.
//!
//! Times are milliseconds since the run started, on the campaign's clock;
//! the upstream's executions are put on the same clock when they are merged.

use std::io::{BufRead, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// One line of the history.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub(crate) enum Event {
    /// The first line: what ran and what the checker needs to judge it.
    Run(Run),
    /// A client sent a request (`attempt` 0 is the first with this key).
    Invoke {
        t: u64,
        op: u64,
        client: u32,
        key: String,
        attempt: u32,
        /// Which proxy replica it went to.
        proxy: u32,
        phase: Phase,
    },
    /// The request of `op` got an HTTP answer.
    Answer {
        t: u64,
        op: u64,
        status: u16,
        /// `Idempotent-Replayed: true` was on the answer.
        replayed: bool,
        /// SHA-256 of the body, hex.
        body_sha: String,
        /// The execution the body names (`exec` of the upstream's JSON), when
        /// the body is an upstream's answer; `None` for the proxy's own
        /// answers (problem documents).
        exec: Option<String>,
        /// The key the upstream's body names (it echoes the key it ran).
        answer_key: Option<String>,
        /// The problem type's last segment (`in-flight`, `outcome-unknown`...)
        /// of a proxy's problem document.
        problem: Option<String>,
        latency_ms: f64,
    },
    /// The request of `op` got no HTTP answer.
    Error {
        t: u64,
        op: u64,
        /// `timeout`, `connect`, `reset`, `other`.
        error: String,
        latency_ms: f64,
    },
    /// A fault began or healed. `id` pairs the two lines.
    Fault {
        t: u64,
        id: u32,
        /// `kill`, `pause`, `failover`, `delay`, `loss`, `stall`,
        /// `partition`, `one_way`, `cut`, `slow_upstream`.
        kind: String,
        /// What it hit: `proxy-1`, `upstream`, `store-0`,
        /// `proxy-1->store`, `proxy-0->upstream`, `store`.
        target: String,
        phase: FaultPhase,
    },
    /// The upstream ran the operation for `key` (journaled and fsynced
    /// before it answered).
    Exec {
        t: u64,
        key: String,
        exec: String,
        status: u16,
        body_sha: String,
    },
    /// Every fault has healed and every process is up again; the final
    /// phase (each key asked once more) starts.
    Healed { t: u64 },
    /// The last line.
    End { t: u64 },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Run {
    pub topology: String,
    pub seed: u64,
    pub duration_ms: u64,
    pub proxies: u32,
    pub clients: u32,
    /// The routes' lease, ms.
    pub lease_ms: u64,
    /// `unknown_outcome` or `re_execute`.
    pub lease_expiry: String,
    pub wait_replicas: u32,
    /// When a key executed twice counts as at risk rather than as a
    /// violation: `store_failover` (the store's replication is
    /// asynchronous: a record written before a store fault may be lost
    /// with it, as the docs say) or `never`.
    pub at_risk: AtRisk,
    /// After `Healed`, every key must settle (a final answer, not 409/503
    /// or an error) within this many ms.
    pub settle_bound_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum AtRisk {
    StoreFailover,
    Never,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Phase {
    /// While the nemesis runs.
    Load,
    /// After every fault healed: each key asked once more.
    Final,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum FaultPhase {
    Start,
    End,
}

impl Event {
    pub(crate) fn t(&self) -> u64 {
        match self {
            Event::Run(_) => 0,
            Event::Invoke { t, .. }
            | Event::Answer { t, .. }
            | Event::Error { t, .. }
            | Event::Fault { t, .. }
            | Event::Exec { t, .. }
            | Event::Healed { t }
            | Event::End { t } => *t,
        }
    }
}

/// Reads a history (JSON lines); a line that does not parse is an error
/// naming its number.
pub(crate) fn read(path: &Path) -> Result<Vec<Event>, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut events = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| format!("{}: {e}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let event = serde_json::from_str(&line)
            .map_err(|e| format!("{}:{}: {e}", path.display(), n + 1))?;
        events.push(event);
    }
    Ok(events)
}

/// Writes events as JSON lines.
pub(crate) fn write(out: &mut impl Write, events: &[Event]) -> std::io::Result<()> {
    for e in events {
        serde_json::to_writer(&mut *out, e)?;
        out.write_all(b"\n")?;
    }
    Ok(())
}
