//! The memory budget (`[server] max_buffered`, docs/reference/behaviour.md#memory-budget): the
//! bytes held at once for
//! protected request bodies, responses being recorded and replays being
//! written. Room is taken before bytes are held and given back when they are
//! dropped, however the request ends.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The shared count against the limit.
#[derive(Debug)]
pub struct Budget {
    limit: u64,
    used: AtomicU64,
}

impl Budget {
    pub fn new(limit: u64) -> Arc<Budget> {
        Arc::new(Budget {
            limit,
            used: AtomicU64::new(0),
        })
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Room for `n` bytes, or `None` when the budget cannot hold them now.
    pub fn take(self: &Arc<Self>, n: u64) -> Option<Room> {
        let mut room = self.nothing();
        room.grow(n).then_some(room)
    }

    /// Room for nothing yet: it may grow.
    pub(crate) fn nothing(self: &Arc<Self>) -> Room {
        Room {
            budget: self.clone(),
            held: 0,
        }
    }

    fn claim(&self, n: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&total| total <= self.limit)
            })
            .is_ok()
    }
}

/// Bytes held against the budget; given back on drop.
#[derive(Debug)]
pub struct Room {
    budget: Arc<Budget>,
    held: u64,
}

impl Room {
    /// Makes room for `n` more bytes; false (and nothing taken) when the budget is full.
    pub fn grow(&mut self, n: u64) -> bool {
        if n == 0 {
            return true;
        }
        let ok = self.budget.claim(n);
        if ok {
            self.held += n;
        }
        ok
    }

    /// Holds at least `n` bytes in all (grows by the difference).
    pub(crate) fn reach(&mut self, n: u64) -> bool {
        self.grow(n.saturating_sub(self.held))
    }

    pub fn held(&self) -> u64 {
        self.held
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.held, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_is_taken_up_to_the_limit_and_given_back_on_drop() {
        let b = Budget::new(100);
        let mut a = b.take(60).unwrap();
        assert!(b.take(41).is_none(), "over the limit");
        assert!(!a.grow(41));
        assert_eq!(b.used(), 60, "a refused grow takes nothing");
        assert!(a.grow(40));
        assert_eq!(b.used(), 100);
        assert!(b.take(1).is_none());
        drop(a);
        assert_eq!(b.used(), 0);
        let mut c = b.take(10).unwrap();
        assert!(c.reach(30) && c.held() == 30 && b.used() == 30);
        assert!(c.reach(5) && c.held() == 30, "reach never shrinks");
    }

    #[test]
    fn concurrent_takers_never_exceed_the_limit() {
        let b = Budget::new(1000);
        let held: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|_| s.spawn(|| (0..100).filter_map(|_| b.take(7)).collect::<Vec<_>>()))
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(held.len(), 1000 / 7);
        assert!(b.used() <= 1000);
        drop(held);
        assert_eq!(b.used(), 0);
    }
}
