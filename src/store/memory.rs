//! The in-process store: the Redis scripts' semantics over a map with expiry; one process only.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::record::{Token, STATE_PROCESSING, TOKEN_RANGE};

struct Entry {
    value: Bytes,
    expires: Instant,
}

#[derive(Default)]
struct Map {
    entries: HashMap<String, Entry>,
    /// Expiry times in order, soonest first. Every write pushes one; a renewal
    /// leaves the older one behind, which is skipped when it comes up.
    expiries: BinaryHeap<Reverse<(Instant, String)>>,
}

/// How many due expiries one write clears at most: the work per write stays
/// bounded, and writes outpace nothing (each write adds one entry to clear).
const EXPIRE_PER_WRITE: usize = 4;

#[derive(Default)]
pub struct MemoryStore {
    map: Mutex<Map>,
}

impl Map {
    fn live(&mut self, key: &str, now: Instant) -> Option<&mut Entry> {
        if self.entries.get(key).is_some_and(|e| e.expires <= now) {
            self.entries.remove(key);
        }
        self.entries.get_mut(key)
    }

    fn put(&mut self, key: &str, value: Bytes, expires: Instant, now: Instant) {
        self.expire_some(now);
        self.expiries.push(Reverse((expires, key.to_string())));
        self.entries
            .insert(key.to_string(), Entry { value, expires });
    }

    fn extend(&mut self, key: &str, expires: Instant, now: Instant) {
        self.expire_some(now);
        if let Some(e) = self.entries.get_mut(key) {
            e.expires = expires;
            self.expiries.push(Reverse((expires, key.to_string())));
        }
    }

    /// Removes a few entries whose time has come, so that expired records do
    /// not pile up; no timer task and no full scan (the map may hold millions).
    fn expire_some(&mut self, now: Instant) {
        for _ in 0..EXPIRE_PER_WRITE {
            match self.expiries.peek() {
                Some(Reverse((due, _))) if *due <= now => {}
                _ => return,
            }
            let Some(Reverse((_, key))) = self.expiries.pop() else {
                return;
            };
            // Renewed or rewritten since: its entry now expires later; keep it.
            if self.entries.get(&key).is_some_and(|e| e.expires <= now) {
                self.entries.remove(&key);
            }
        }
    }
}

fn owned_processing(value: &[u8], token: Token) -> bool {
    value.get(1) == Some(&STATE_PROCESSING) && value.get(TOKEN_RANGE) == Some(&token.0[..])
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Map> {
        // A panic while holding the lock cannot leave the map half-written
        // (every change is a single insert or remove), so a poisoned lock is usable.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn reserve(&self, key: &str, value: Bytes, lease: Duration) -> Option<(Bytes, Duration)> {
        let now = Instant::now();
        let mut map = self.lock();
        if let Some(e) = map.live(key, now) {
            return Some((e.value.clone(), e.expires - now));
        }
        map.put(key, value, now + lease, now);
        None
    }

    pub fn complete(
        &self,
        key: &str,
        token: Token,
        value: Bytes,
        ttl: Duration,
    ) -> super::Completion {
        let now = Instant::now();
        let mut map = self.lock();
        let existed = match map.live(key, now) {
            Some(e) if e.value.get(TOKEN_RANGE) != Some(&token.0[..]) => {
                return super::Completion::Refused
            }
            Some(_) => true,
            None => false,
        };
        map.put(key, value, now + ttl, now);
        if existed {
            super::Completion::Stored
        } else {
            super::Completion::StoredAfterExpiry
        }
    }

    pub fn renew(&self, key: &str, token: Token, lease: Duration) -> bool {
        let now = Instant::now();
        let mut map = self.lock();
        let owned = map
            .live(key, now)
            .is_some_and(|e| owned_processing(&e.value, token));
        if owned {
            map.extend(key, now + lease, now);
        }
        owned
    }

    pub fn release(&self, key: &str, token: Token) -> bool {
        let now = Instant::now();
        let mut map = self.lock();
        match map.live(key, now) {
            Some(e) if owned_processing(&e.value, token) => {
                map.entries.remove(key);
                true
            }
            _ => false,
        }
    }

    pub fn get(&self, key: &str) -> Option<(Bytes, Duration)> {
        let now = Instant::now();
        let mut map = self.lock();
        map.live(key, now)
            .map(|e| (e.value.clone(), e.expires - now))
    }

    pub fn delete(&self, key: &str) -> bool {
        let now = Instant::now();
        let mut map = self.lock();
        map.live(key, now).is_some() && map.entries.remove(key).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expired_records_are_cleared_by_later_writes_without_a_scan() {
        let store = MemoryStore::new();
        let short = Duration::from_millis(1);
        for i in 0..100 {
            assert!(store
                .reserve(&format!("k{i}"), Bytes::from_static(b"v"), short)
                .is_none());
        }
        std::thread::sleep(Duration::from_millis(5)); // the subject here is time itself
                                                      // Each later write clears a few of the expired ones.
        for i in 0..10 {
            store.reserve(
                &format!("new{i}"),
                Bytes::from_static(b"v"),
                Duration::from_secs(60),
            );
        }
        let map = store.lock();
        assert_eq!(map.entries.len(), 10 + 100 - 10 * EXPIRE_PER_WRITE);
    }

    #[test]
    fn a_renewed_reservation_survives_its_first_expiry() {
        let store = MemoryStore::new();
        let token = Token::new();
        let mut value = vec![1u8, STATE_PROCESSING];
        value.extend_from_slice(&token.0);
        let value = Bytes::from(value);
        assert!(store
            .reserve("k", value, Duration::from_millis(2))
            .is_none());
        assert!(store.renew("k", token, Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(5)); // past the first expiry
        for i in 0..10 {
            store.reserve(
                &format!("other{i}"),
                Bytes::from_static(b"v"),
                Duration::from_secs(60),
            );
        }
        assert!(
            store.get("k").is_some(),
            "the stale expiry entry must not remove the renewed record"
        );
    }
}
