//! Writes the history as it happens (`DIR/history.jsonl`): a campaign that
//! dies leaves what it saw.

use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tokio::time::Instant;

use crate::history::Event;

pub(crate) struct Recorder {
    start: Instant,
    /// The Unix time of `start`, ms (to place the upstream's journal).
    pub start_unix_ms: u64,
    ops: AtomicU64,
    lost: AtomicU64,
    out: Mutex<BufWriter<std::fs::File>>,
    tag: String,
}

impl Recorder {
    pub(crate) fn create(path: &Path, seed: u64) -> std::io::Result<Recorder> {
        Ok(Recorder {
            start: Instant::now(),
            start_unix_ms: crate::upstream::unix_ms(),
            ops: AtomicU64::new(0),
            lost: AtomicU64::new(0),
            out: Mutex::new(BufWriter::new(std::fs::File::create(path)?)),
            tag: format!("s{seed:x}"),
        })
    }

    /// Milliseconds since the run started.
    pub(crate) fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    pub(crate) fn op_id(&self) -> u64 {
        self.ops.fetch_add(1, Ordering::Relaxed)
    }

    /// A prefix for the run's keys (a store reused by another run never
    /// holds one of this run's keys).
    pub(crate) fn seed_tag(&self) -> &str {
        &self.tag
    }

    pub(crate) fn record(&self, event: Event) {
        let mut out = self.out.lock().unwrap();
        let written = serde_json::to_writer(&mut *out, &event)
            .map_err(std::io::Error::from)
            .and_then(|()| out.write_all(b"\n"));
        if written.is_err() {
            self.lost.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Events that could not be written (a full disk): a history that
    /// misses them cannot be judged.
    pub(crate) fn lost(&self) -> u64 {
        self.lost.load(Ordering::Relaxed)
    }

    pub(crate) fn flush(&self) {
        if self.out.lock().unwrap().flush().is_err() {
            self.lost.fetch_add(1, Ordering::Relaxed);
        }
    }
}
