//! The logs of a proxy served in-process: the library's events, formatted as the binary
//! formats them with `--log-format json` (one JSON object a line, fields flattened),
//! and panics, kept in memory for [`super::Proxy::logs`] and `wait_log`.
//!
//! A `tracing` subscriber is global to the process, and so is the panic hook: nextest runs
//! each test in a process of its own, so the lines are that test's. (Under `cargo test`,
//! tests of one binary share the process and so these lines: a test looking for its own
//! request id or key still finds it.)

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

/// The lines captured in this process so far.
pub type LogLines = Arc<Mutex<Vec<String>>>;

/// Installs the capture (once per process) and returns its lines.
pub fn captured_logs() -> LogLines {
    static LINES: OnceLock<LogLines> = OnceLock::new();
    LINES
        .get_or_init(|| {
            let lines: LogLines = Arc::default();
            let sink = lines.clone();
            let installed = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
                .with_writer(move || LineWriter {
                    buf: Vec::new(),
                    lines: sink.clone(),
                })
                .with_ansi(false)
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .try_init();
            assert!(installed.is_ok(), "no other global subscriber in the tests");
            // The binary's stderr carries a panic's message: so do these lines.
            let sink = lines.clone();
            let default = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                let thread = std::thread::current();
                let line = format!(
                    "thread '{}' panicked at {}",
                    thread.name().unwrap_or("<unnamed>"),
                    info
                );
                sink.lock().unwrap_or_else(|e| e.into_inner()).push(line);
                default(info);
            }));
            lines
        })
        .clone()
}

/// One event's text: pushed as lines when the formatter is done with it.
struct LineWriter {
    buf: Vec<u8>,
    lines: LogLines,
}

impl Write for LineWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineWriter {
    fn drop(&mut self) {
        let text = String::from_utf8_lossy(&self.buf);
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        lines.extend(text.lines().filter(|l| !l.is_empty()).map(String::from));
    }
}
