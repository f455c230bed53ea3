//! The logs of a proxy served in-process: the library's events, formatted as the binary
//! formats them with `--log-format json` (one JSON object a line, fields flattened),
//! and panics, kept in memory for [`super::Proxy::logs`] and `wait_log`.
//!
//! A `tracing` subscriber is global to the process, and so is the panic hook: nextest runs
//! each test in a process of its own, so the lines are that test's. (Under `cargo test`,
//! tests of one binary share the process and so these lines: a test looking for its own
//! request id or key still finds it.)
//!
//! A proxy served on a runtime of its own ([`super::Proxy::in_process_apart`]) has lines
//! of its own as well: its runtime's threads are marked ([`mark_thread`]), and what they
//! log goes to its lines too. What threads no proxy marked log (the library's worker
//! threads, the test's) goes to every such proxy's lines, so that none misses a line.

use std::cell::RefCell;
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// The lines captured in this process so far.
pub type LogLines = Arc<Mutex<Vec<String>>>;

thread_local! {
    /// The lines of the proxy whose runtime this thread belongs to, if any.
    static THREAD_LINES: RefCell<Option<LogLines>> = const { RefCell::new(None) };
}

/// The lines of every proxy with lines of its own, while it lives.
type Apart = Mutex<Vec<Weak<Mutex<Vec<String>>>>>;

fn apart() -> &'static Apart {
    static APART: OnceLock<Apart> = OnceLock::new();
    APART.get_or_init(Mutex::default)
}

/// New lines of their own for a proxy (installing the capture first).
pub fn own_logs() -> LogLines {
    captured_logs();
    let lines: LogLines = Arc::default();
    let mut all = apart().lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|w| w.strong_count() > 0);
    all.push(Arc::downgrade(&lines));
    lines
}

/// Marks the calling thread as one of the proxy whose lines are `lines`.
pub fn mark_thread(lines: &LogLines) {
    THREAD_LINES.with(|t| *t.borrow_mut() = Some(lines.clone()));
}

/// Pushes `new` to the global lines and to the proxy lines they belong to.
fn push_lines(global: &LogLines, new: Vec<String>) {
    if new.is_empty() {
        return;
    }
    let own = THREAD_LINES.with(|t| t.borrow().clone());
    match own {
        Some(own) => own
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(new.iter().cloned()),
        None => {
            let all = apart().lock().unwrap_or_else(|e| e.into_inner());
            for lines in all.iter().filter_map(Weak::upgrade) {
                lines
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend(new.iter().cloned());
            }
        }
    }
    global.lock().unwrap_or_else(|e| e.into_inner()).extend(new);
}

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
                push_lines(&sink, vec![line]);
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
        let new = text.lines().filter(|l| !l.is_empty()).map(String::from);
        push_lines(&self.lines, new.collect());
    }
}
