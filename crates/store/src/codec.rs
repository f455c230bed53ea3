//! What the store writes and believes: records sealed or clear on the way
//! in, opened and checked on the way out, and the longest record believed.

use std::sync::atomic::Ordering;

use bytes::Bytes;

use crate::record::{DecodeError, Head, Record, MAX_OVERHEAD};
use crate::seal::{SealError, Sealing};
use crate::{Reservation, Store};

impl Store {
    /// Records are at most `max_body` (the largest `max_response_body` of
    /// the routes) plus a record's overhead: a store that says a record is
    /// longer is not believed. Until this is called, the limit is the
    /// largest body any configuration allows.
    pub fn limit_records(&self, max_body: u64) {
        self.record_limit
            .store(max_body.saturating_add(MAX_OVERHEAD), Ordering::Relaxed);
    }

    /// After a reload: a larger `max_body` raises the limit, a smaller one
    /// leaves it, so that the records written before stay readable.
    pub fn raise_record_limit(&self, max_body: u64) {
        self.record_limit
            .fetch_max(max_body.saturating_add(MAX_OVERHEAD), Ordering::Relaxed);
    }

    /// The longest record believed.
    pub(crate) fn record_limit(&self) -> u64 {
        self.record_limit.load(Ordering::Relaxed)
    }

    /// The keys and their file, when records are sealed (for reloads on SIGHUP).
    pub fn sealing(&self) -> Option<&Sealing> {
        self.sealing.as_ref()
    }

    /// The value to store under `key`: a finished record sealed with the
    /// first key of the key file, when there is one; clear otherwise.
    pub fn encode(&self, key: &str, record: &Record) -> Result<Bytes, SealError> {
        match &self.sealing {
            Some(sealing) => record.seal(&sealing.keys(), self.record_id(key)),
            None => Ok(record.encode()),
        }
    }

    /// Does the key file hold the key `id` (a record sealed under it opens)?
    fn opens(&self, id: &str) -> bool {
        self.sealing
            .as_ref()
            .is_some_and(|s| s.keys().ids().any(|k| k == id))
    }

    /// A value read from `key`, opened when it is sealed. With
    /// `require_sealed`, a finished record in the clear is not an answer:
    /// someone who can write to the store may have planted it.
    pub(crate) fn decode(&self, key: &str, value: Bytes) -> Result<Record, DecodeError> {
        let sealed = crate::record::is_sealed(&value);
        let keys = self.sealing.as_ref().map(Sealing::keys);
        let record = Record::open(value, keys.as_deref(), self.record_id(key))?;
        if self.require_sealed && !sealed && matches!(record, Record::Finished(_)) {
            return Err(DecodeError::NotSealed);
        }
        Ok(record)
    }

    /// A large record found by a reserve, judged from its head (409, 410,
    /// 422), which came with the reserve's answer.
    pub(crate) fn large(&self, len: u64, start: Bytes) -> Reservation {
        match Head::decode(start) {
            // With `require_sealed`, a finished one in the clear is
            // unreadable from its head too.
            Ok(head)
                if self.require_sealed && head.finished.is_some() && head.sealed_with.is_none() =>
            {
                Reservation::Unreadable(DecodeError::NotSealed)
            }
            // Sealed under a key this proxy does not hold: unreadable, as
            // the whole record would be (the head's own bytes are only
            // authenticated when the seal is opened, for a replay).
            Ok(head)
                if head
                    .sealed_with
                    .as_deref()
                    .is_some_and(|id| !self.opens(id)) =>
            {
                Reservation::Unreadable(match (&self.sealing, head.sealed_with) {
                    (Some(_), Some(id)) => DecodeError::UnknownKey(id),
                    _ => DecodeError::NoKeyFile,
                })
            }
            Ok(head) => Reservation::Large { len, head },
            Err(e) => Reservation::Unreadable(e),
        }
    }
}
