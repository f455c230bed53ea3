//! Key naming: a record's store key, `{prefix}:{id}`, and its id in hex.

use std::sync::Arc;

use crate::Store;

/// Appends a digest in lower-case hex: the `hex` crate's encoder goes through
/// a char iterator (1.7k instructions for 32 bytes, callgrind); this is a
/// table lookup.
pub fn push_hex(out: &mut String, digest: &[u8; 32]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut hex = [0u8; 64];
    for (pair, &b) in hex.chunks_exact_mut(2).zip(digest) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0xf)];
    }
    out.push_str(std::str::from_utf8(&hex).expect("hex digits are ASCII"));
}

/// A record's store key (`prefix:id`) and where its id begins; clones share it.
#[derive(Clone, Debug)]
pub struct RecordKey {
    key: Arc<str>,
    id_at: usize,
}

impl RecordKey {
    /// The key in the store.
    pub fn as_str(&self) -> &str {
        &self.key
    }

    /// The record id (what follows the prefix), as logs and the admin API name it.
    pub fn id(&self) -> &str {
        &self.key[self.id_at..]
    }
}

impl Store {
    /// The store key of the record whose id is `digest` in hex, made once per
    /// request and shared (a reference count) by its phases, its claim and
    /// its log line.
    pub fn record_key(&self, digest: &[u8; 32]) -> RecordKey {
        let mut k = String::with_capacity(self.prefix.len() + 1 + 64);
        k.push_str(&self.prefix);
        k.push(':');
        push_hex(&mut k, digest);
        RecordKey {
            id_at: self.prefix.len() + 1,
            key: Arc::from(k),
        }
    }

    /// The store key for a record id: `{prefix}:{id}`. The id is a hash, never the raw key.
    pub fn key_for(&self, id: &str) -> String {
        let mut k = String::with_capacity(self.prefix.len() + 1 + id.len());
        k.push_str(&self.prefix);
        k.push(':');
        k.push_str(id);
        k
    }

    /// The record id of a store key made by [`Store::key_for`].
    pub(crate) fn record_id<'k>(&self, key: &'k str) -> &'k str {
        key.strip_prefix(self.prefix.as_str())
            .and_then(|id| id.strip_prefix(':'))
            .unwrap_or(key)
    }
}
