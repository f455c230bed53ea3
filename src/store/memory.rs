//! The in-process store: the Redis scripts' semantics over a map with expiry; one process only.

use std::collections::HashMap;
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
    /// Writes since the last sweep of expired entries.
    writes: u32,
}

/// How many writes between sweeps; keeps expired records from piling up without a timer task.
const SWEEP_EVERY: u32 = 1024;

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
        self.writes += 1;
        if self.writes >= SWEEP_EVERY {
            self.writes = 0;
            self.entries.retain(|_, e| e.expires > now);
        }
        self.entries
            .insert(key.to_string(), Entry { value, expires });
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
        match map.live(key, now) {
            Some(e) if owned_processing(&e.value, token) => {
                e.expires = now + lease;
                true
            }
            _ => false,
        }
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
