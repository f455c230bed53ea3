//! The in-process store: the Redis scripts' semantics over a map with expiry; one process only.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::{Completion, Occupant, Operations, StoreError};
use crate::deadline::Deadlines;
use crate::record::{Token, STATE_PROCESSING, TOKEN_RANGE};

struct Entry {
    value: Bytes,
    expires: Instant,
}

#[derive(Default)]
struct Map {
    entries: HashMap<String, Entry>,
    /// Bytes of the live entries' keys and values, against `[store] memory_limit`.
    bytes: u64,
    /// Expiry times in order, soonest first. Every write pushes one; a renewal
    /// leaves the older one behind, which is skipped when it comes up.
    expiries: BinaryHeap<Reverse<(Instant, String)>>,
}

/// How many due expiries one write clears at most: the work per write stays
/// bounded, and writes outpace nothing (each write adds one entry to clear).
const EXPIRE_PER_WRITE: usize = 4;

pub(crate) struct MemoryStore {
    map: Mutex<Map>,
    /// New reservations are refused once the records hold this many bytes;
    /// records are never evicted before their TTL (docs/reference/store.md#memory).
    limit: u64,
}

fn size(key: &str, value: &Bytes) -> u64 {
    (key.len() + value.len()) as u64
}

impl Map {
    fn remove(&mut self, key: &str) -> bool {
        match self.entries.remove_entry(key) {
            Some((k, e)) => {
                self.bytes -= size(&k, &e.value);
                true
            }
            None => false,
        }
    }

    fn live(&mut self, key: &str, now: Instant) -> Option<&mut Entry> {
        if self.entries.get(key).is_some_and(|e| e.expires <= now) {
            self.remove(key);
        }
        self.entries.get_mut(key)
    }

    fn put(&mut self, key: &str, value: Bytes, expires: Instant, now: Instant) {
        let _ = self.expire_some(now);
        self.expiries.push(Reverse((expires, key.to_string())));
        self.bytes += size(key, &value);
        if let Some(old) = self
            .entries
            .insert(key.to_string(), Entry { value, expires })
        {
            self.bytes -= size(key, &old.value);
        }
    }

    fn extend(&mut self, key: &str, expires: Instant, now: Instant) {
        let _ = self.expire_some(now);
        if let Some(e) = self.entries.get_mut(key) {
            e.expires = expires;
            self.expiries.push(Reverse((expires, key.to_string())));
        }
    }

    /// Removes a few entries whose time has come, so that expired records do
    /// not pile up; no timer task and no full scan (the map may hold millions).
    /// True when more may be due.
    fn expire_some(&mut self, now: Instant) -> bool {
        for _ in 0..EXPIRE_PER_WRITE {
            match self.expiries.peek() {
                Some(Reverse((due, _))) if *due <= now => {}
                _ => return false,
            }
            let Some(Reverse((_, key))) = self.expiries.pop() else {
                return false;
            };
            // Renewed or rewritten since: its entry now expires later; keep it.
            if self.entries.get(&key).is_some_and(|e| e.expires <= now) {
                self.remove(&key);
            }
        }
        true
    }
}

fn owned_processing(value: &[u8], token: Token) -> bool {
    value.get(1) == Some(&STATE_PROCESSING) && value.get(TOKEN_RANGE) == Some(&token.0[..])
}

impl MemoryStore {
    pub fn new(limit: u64) -> Self {
        MemoryStore {
            map: Mutex::default(),
            limit,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Map> {
        // A panic while holding the lock cannot leave the map half-written
        // (every change is a single insert or remove), so a poisoned lock is usable.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Each operation takes the lock once: it is as atomic as the Redis command or script it mirrors.
impl Operations for MemoryStore {
    /// The value is shared, not copied: `inline` does not matter here.
    async fn reserve(
        &self,
        key: &str,
        value: Bytes,
        lease: Duration,
        _inline: u64,
        _taken: &std::sync::atomic::AtomicBool,
    ) -> Result<Option<Occupant>, StoreError> {
        let now = Instant::now();
        let mut map = self.lock();
        if let Some(e) = map.live(key, now) {
            return Ok(Some(Occupant::Value {
                value: e.value.clone(),
                ttl: Some(e.expires - now),
            }));
        }
        if map.bytes + size(key, &value) > self.limit {
            // Expired records still counted go first (each is cleared once).
            while map.expire_some(now) {}
        }
        if map.bytes + size(key, &value) > self.limit {
            // Completions still go in (their operation ran); only new keys wait.
            tracing::warn!(
                limit = self.limit,
                "memory store full: new keys are refused until records expire"
            );
            return Err(StoreError::Full);
        }
        map.put(key, value, now + lease, now);
        Ok(None)
    }

    async fn pttl(&self, key: &str) -> Result<Duration, StoreError> {
        let now = Instant::now();
        Ok(self
            .lock()
            .live(key, now)
            .map_or(Duration::ZERO, |e| e.expires - now))
    }

    async fn complete(
        &self,
        key: &str,
        token: Token,
        value: Bytes,
        ttl: Duration,
        _steps: &Deadlines,
    ) -> Result<Completion, StoreError> {
        let now = Instant::now();
        let mut map = self.lock();
        let existed = match map.live(key, now) {
            Some(e) if e.value.get(TOKEN_RANGE) != Some(&token.0[..]) => {
                return Ok(Completion::Refused)
            }
            // Ours and finished already: final (as `complete.lua` keeps it).
            Some(e) if e.value.get(1) == Some(&crate::record::STATE_FINISHED) => {
                return Ok(Completion::Stored)
            }
            Some(_) => true,
            None => false,
        };
        map.put(key, value, now + ttl, now);
        Ok(if existed {
            Completion::Stored
        } else {
            Completion::StoredAfterExpiry
        })
    }

    async fn renew(&self, key: &str, token: Token, lease: Duration) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut map = self.lock();
        let owned = map
            .live(key, now)
            .is_some_and(|e| owned_processing(&e.value, token));
        if owned {
            map.extend(key, now + lease, now);
        }
        Ok(owned)
    }

    async fn take_over(
        &self,
        key: &str,
        dead: Token,
        afterlife: Duration,
        value: Bytes,
        hold: Duration,
    ) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut map = self.lock();
        match map.live(key, now) {
            // Taken already by this same call, sent twice.
            Some(e) if e.value.get(TOKEN_RANGE) == value.get(TOKEN_RANGE) => return Ok(true),
            Some(e) if owned_processing(&e.value, dead) && e.expires - now <= afterlife => {}
            _ => return Ok(false),
        }
        map.put(key, value, now + hold, now);
        Ok(true)
    }

    async fn release(&self, key: &str, token: Token) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut map = self.lock();
        match map.live(key, now) {
            Some(e) if owned_processing(&e.value, token) => {
                map.remove(key);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Its own memory holds only what the proxy put there: nothing to check `_at_most` against.
    async fn get(
        &self,
        key: &str,
        _at_most: u64,
        _steps: &Deadlines,
    ) -> Result<Option<(Bytes, Duration)>, StoreError> {
        let now = Instant::now();
        Ok(self
            .lock()
            .live(key, now)
            .map(|e| (e.value.clone(), e.expires - now)))
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut map = self.lock();
        Ok(map.live(key, now).is_some() && map.remove(key))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v() -> Bytes {
        Bytes::from_static(b"v")
    }

    #[tokio::test(start_paused = true)]
    async fn expired_records_are_cleared_by_later_writes_without_a_scan() {
        let store = MemoryStore::new(1 << 20);
        let short = Duration::from_millis(1);
        for i in 0..100 {
            assert!(store
                .reserve(&format!("k{i}"), v(), short, 0, &Default::default())
                .await
                .unwrap()
                .is_none());
        }
        tokio::time::advance(Duration::from_millis(5)).await;
        // Each later write clears a few of the expired ones.
        for i in 0..10 {
            let _ = store
                .reserve(
                    &format!("new{i}"),
                    v(),
                    Duration::from_secs(60),
                    0,
                    &Default::default(),
                )
                .await;
        }
        let map = store.lock();
        assert_eq!(map.entries.len(), 10 + 100 - 10 * EXPIRE_PER_WRITE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewed_reservation_survives_its_first_expiry() {
        let store = MemoryStore::new(1 << 20);
        let token = Token::new();
        let mut value = vec![1u8, STATE_PROCESSING];
        value.extend_from_slice(&token.0);
        let value = Bytes::from(value);
        let reserved = store
            .reserve("k", value, Duration::from_millis(2), 0, &Default::default())
            .await;
        assert!(reserved.unwrap().is_none());
        assert!(store
            .renew("k", token, Duration::from_secs(60))
            .await
            .unwrap());
        tokio::time::advance(Duration::from_millis(5)).await; // past the first expiry
        for i in 0..10 {
            let _ = store
                .reserve(
                    &format!("other{i}"),
                    v(),
                    Duration::from_secs(60),
                    0,
                    &Default::default(),
                )
                .await;
        }
        assert!(
            store
                .get("k", u64::MAX, &Deadlines::new(Duration::from_secs(1)))
                .await
                .unwrap()
                .is_some(),
            "the stale expiry entry must not remove the renewed record"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn reserve_reports_what_holds_the_key_and_its_time_left() {
        let store = MemoryStore::new(1 << 20);
        assert!(store
            .reserve("k", v(), Duration::from_secs(30), 0, &Default::default())
            .await
            .unwrap()
            .is_none());
        tokio::time::advance(Duration::from_secs(10)).await;
        let held = store
            .reserve("k", v(), Duration::from_secs(30), 0, &Default::default())
            .await
            .unwrap();
        let held = held.expect("the key is taken");
        let Occupant::Value { value, ttl } = held else {
            panic!("the memory store shares values whatever their size")
        };
        assert_eq!(value, v());
        assert_eq!(ttl, Some(Duration::from_secs(20)));
        assert_eq!(store.pttl("k").await.unwrap(), Duration::from_secs(20));
        tokio::time::advance(Duration::from_secs(20)).await;
        assert_eq!(store.pttl("k").await.unwrap(), Duration::ZERO);
        assert!(store
            .reserve("k", v(), Duration::from_secs(30), 0, &Default::default())
            .await
            .unwrap()
            .is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_store_refuses_new_keys_but_not_completions_and_frees_room_on_expiry() {
        let store = MemoryStore::new(100);
        let v40 = Bytes::from(vec![0u8; 40]);
        let token = Token::new();
        let mut mine = vec![1u8, STATE_PROCESSING];
        mine.extend_from_slice(&token.0);
        mine.resize(40, 0);
        let ttl = Duration::from_secs(10);
        assert!(store
            .reserve("k1", Bytes::from(mine), ttl, 0, &Default::default())
            .await
            .unwrap()
            .is_none());
        assert!(store
            .reserve("k2", v40.clone(), ttl, 0, &Default::default())
            .await
            .unwrap()
            .is_none());
        let full = store
            .reserve("k3", v40.clone(), ttl, 0, &Default::default())
            .await;
        assert!(matches!(full, Err(StoreError::Full)), "84 + 42 > 100");
        // A completion may take the store over its limit: the operation ran.
        let big = Bytes::from(vec![0u8; 90]);
        let steps = Deadlines::new(Duration::from_secs(1));
        let done = store
            .complete("k1", token, big, Duration::from_secs(60), &steps)
            .await;
        assert_eq!(done.unwrap(), Completion::Stored);
        assert_eq!(store.lock().bytes, 2 + 90 + 2 + 40);
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(
            store
                .reserve("k3", v40, ttl, 0, &Default::default())
                .await
                .unwrap()
                .is_none(),
            "room again after expiry"
        );
        assert_eq!(store.lock().bytes, 2 + 40);
    }
}
