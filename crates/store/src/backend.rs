//! What each backend (memory, Redis, PostgreSQL) implements, under [`Store`](super::Store).

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use bytes::Bytes;

use super::{Completion, StoreError};
use crate::deadline::Deadlines;
use crate::record::Token;

/// What a backend found under a key it was asked to reserve, as stored
/// (not decoded: [`Store::reserve`](super::Store::reserve) decodes it into a
/// [`Reservation`](super::Reservation)).
pub(crate) enum Occupant {
    Value {
        value: Bytes,
        /// What is left of the key's lease or TTL, when the backend knows it without another round trip.
        ttl: Option<Duration>,
    },
    /// A value larger than the caller wanted inline: its length and its
    /// first bytes (the record's head among them).
    Large { len: u64, start: Bytes },
}

/// The operations each backend implements, with the same shapes; [`Store`]
/// adds timing, timeouts, metrics and record decoding around them. Every one
/// touches one key and is safe to send twice.
pub(crate) trait Operations {
    /// `SET NX` with the lease; `Some` with what holds the key when it is
    /// taken (its value only when it is at most `inline` bytes).
    async fn reserve(
        &self,
        key: &str,
        value: Bytes,
        lease: Duration,
        inline: u64,
        taken: &AtomicBool,
    ) -> Result<Option<Occupant>, StoreError>;
    /// What is left of the key's lease or TTL; zero when it is gone.
    async fn pttl(&self, key: &str) -> Result<Duration, StoreError>;
    /// Writes the finished record if `token` still owns the key (or nobody
    /// does); each round trip (each piece of a large record, the `WAIT`)
    /// within its own `op_timeout` from `steps`.
    async fn complete(
        &self,
        key: &str,
        token: Token,
        value: Bytes,
        ttl: Duration,
        steps: &Deadlines,
    ) -> Result<Completion, StoreError>;
    /// Extends the lease if `token` still owns the key.
    async fn renew(&self, key: &str, token: Token, lease: Duration) -> Result<bool, StoreError>;
    /// Writes `value` (a finished record, or the taker's own reservation)
    /// for `hold` in place of `dead`'s reservation, if the key still holds
    /// it and no more than `afterlife` of its time is left: its lease ran out
    /// and its owner never came back. True when written, or when the key
    /// holds `value`'s token already (the same call, sent twice).
    async fn take_over(
        &self,
        key: &str,
        dead: Token,
        afterlife: Duration,
        value: Bytes,
        hold: Duration,
    ) -> Result<bool, StoreError>;
    /// Deletes the reservation if `token` still owns it.
    async fn release(&self, key: &str, token: Token) -> Result<bool, StoreError>;
    /// The value and its remaining time; each round trip (each piece of a
    /// large record) within its own `op_timeout` from `steps`. A store that
    /// says the value is longer than `at_most` bytes is not believed (an error).
    async fn get(
        &self,
        key: &str,
        at_most: u64,
        steps: &Deadlines,
    ) -> Result<Option<(Bytes, Duration)>, StoreError>;
    /// Deletes the key whatever it holds.
    async fn delete(&self, key: &str) -> Result<bool, StoreError>;
    async fn ping(&self) -> Result<(), StoreError>;
}
