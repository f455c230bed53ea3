//! The injector's connection places: at most [`super::MAX_CONNECTIONS`] at
//! once; when they are all taken, a new connection takes the place of the
//! oldest one with no request in progress (a handshake that has not finished,
//! an idle connection), so that sockets held open, with or without TLS,
//! cannot keep the API server out. Only when every place is serving a
//! request is the new connection closed.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;

/// One connection's place: its requests in progress, and the signal to go.
#[derive(Default)]
pub(super) struct Mark {
    in_flight: AtomicUsize,
    evicted: Notify,
}

impl Mark {
    /// A request started on this connection.
    pub(super) fn start(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
    }

    /// A request ended.
    pub(super) fn end(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    /// Completes when the connection must give its place up.
    pub(super) async fn evicted(&self) {
        self.evicted.notified().await;
    }
}

/// The places, oldest first.
pub(super) struct Places {
    limit: usize,
    held: Mutex<VecDeque<(u64, Arc<Mark>)>>,
    next: AtomicUsize,
}

/// A place held until dropped.
pub(super) struct Place {
    places: Arc<Places>,
    id: u64,
    pub(super) mark: Arc<Mark>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut held = self.places.lock();
        held.retain(|(id, _)| *id != self.id);
    }
}

impl Places {
    pub(super) fn new(limit: usize) -> Arc<Places> {
        Arc::new(Places {
            limit,
            held: Mutex::new(VecDeque::new()),
            next: AtomicUsize::new(0),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(u64, Arc<Mark>)>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A place for a new connection: a free one, else the oldest without a
    /// request in progress (told to go); `None` when every one is working.
    pub(super) fn take(self: &Arc<Places>) -> Option<Place> {
        let mut held = self.lock();
        if held.len() >= self.limit {
            let idle = held
                .iter()
                .position(|(_, m)| m.in_flight.load(Ordering::Acquire) == 0)?;
            if let Some((_, mark)) = held.remove(idle) {
                // A permit is stored if the connection is not waiting yet.
                mark.evicted.notify_one();
            }
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed) as u64;
        let mark = Arc::new(Mark::default());
        held.push_back((id, mark.clone()));
        Some(Place {
            places: self.clone(),
            id,
            mark,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_oldest_idle_place_goes_and_working_ones_stay() {
        let places = Places::new(2);
        let a = places.take().unwrap();
        let b = places.take().unwrap();
        a.mark.start();
        // Full: b is the oldest idle one; it is told to go.
        let c = places.take().unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), b.mark.evicted())
            .await
            .expect("b evicted");
        // a and c: c idle, a working.
        c.mark.start();
        assert!(places.take().is_none(), "every place is working");
        a.mark.end();
        let d = places.take().expect("a idle now");
        tokio::time::timeout(std::time::Duration::from_secs(5), a.mark.evicted())
            .await
            .expect("a evicted");
        drop((b, c, d));
        assert!(places.lock().is_empty());
    }
}
