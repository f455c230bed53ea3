//! The send deadline of HTTP/2 answers (docs/reference/behaviour.md#h2-send-deadline): an
//! answer whose data waits for
//! the client's flow-control window for `client_write_timeout` is stalled,
//! even while its connection stays lively with pings or other streams (the
//! connection's own write timer, `crate::conn`, sees only the socket).
//!
//! hyper asks an answer's body for its next frame only once the last one has
//! window to go out, and holds that frame meanwhile: an answer waits from
//! the moment it hands data over until it is asked again (or dropped). While
//! it waits, no timer of its own is polled, and hyper gives no way to reset
//! one stream from outside: so each connection keeps the answers waiting in
//! [`Stalls`], and the task that serves the connection closes it when the
//! oldest has waited too long (`crate::serve`). That resets every stream
//! the client held open, and drops what each held: its memory budget, its
//! place among the requests in progress.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// The answers of one connection whose data waits for the client's window.
#[derive(Debug, Default)]
pub(crate) struct Stalls {
    /// Each waiting answer's id and since when it waits (at most one entry
    /// per stream, so at most the connection's concurrent streams).
    waiting: Mutex<Vec<(u64, Instant)>>,
    next_id: AtomicU64,
    /// Woken when an answer starts waiting with none waiting before it.
    first: Notify,
}

impl Stalls {
    /// An answer handed data to send: it waits from now; the id to end the wait with.
    pub(crate) fn handed(&self) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let mut waiting = self.lock();
        if waiting.is_empty() {
            self.first.notify_one();
        }
        waiting.push((id, now));
        id
    }

    /// The answer's data went out (it is asked for more) or the answer is gone.
    pub fn sent(&self, id: u64) {
        let mut waiting = self.lock();
        if let Some(i) = waiting.iter().position(|(w, _)| *w == id) {
            waiting.swap_remove(i);
        }
    }

    /// Resolves once an answer has waited `limit` without its data going out.
    pub(crate) async fn overdue(&self, limit: Duration) {
        loop {
            let oldest = self.lock().iter().map(|(_, since)| *since).min();
            match oldest {
                None => self.first.notified().await,
                Some(since) if since + limit <= Instant::now() => return,
                // The oldest may go out meanwhile: then look again.
                Some(since) => tokio::time::sleep_until(since + limit).await,
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(u64, Instant)>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_oldest_waiting_answer_sets_the_deadline() {
        let stalls = Stalls::default();
        let limit = Duration::from_secs(5);
        let start = Instant::now();
        let a = stalls.handed();
        tokio::time::sleep(Duration::from_secs(3)).await;
        let _b = stalls.handed();
        // `a` goes out: `b`, handed at 3 s, is due at 8 s.
        stalls.sent(a);
        stalls.overdue(limit).await;
        assert_eq!(start.elapsed(), Duration::from_secs(8));
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_waiting_is_never_overdue() {
        let stalls = Stalls::default();
        let id = stalls.handed();
        stalls.sent(id);
        let waited = tokio::time::timeout(
            Duration::from_secs(600),
            stalls.overdue(Duration::from_secs(1)),
        )
        .await;
        assert!(waited.is_err());
    }
}
