//! What is stored under a key: a `processing` reservation or a finished answer, in a small binary format.
//!
//! Layout (all integers big-endian). The first 18 bytes are the same for every
//! version and state, so the store scripts can check the owner token without decoding:
//!
//! ```text
//! 0      version (1 to 5)
//! 1      state: 'P' processing | 'F' finished
//! 2..18  owner token (16 bytes)
//! 18..50 request fingerprint (SHA-256)
//! 50..58 created, unix ms
//! u16 + route name
//! version 4 and 5 only: 16-byte trace id, 8-byte span id (the execution's)
//! 'F' only: u64 completed unix ms, u16 status, u8 flags (bit 0: body stored)
//!   — the head ends here; then the answer section:
//! 'P' only, optional: the afterlife trailer, a tag byte ('U' or 'R') and a
//!   u64 afterlife in ms (see below)
//! version 1: u16 header count, per header: u16 + name, u32 + value; u32 + body
//! version 2: as version 1, then u16 trailer count, per trailer as per header
//! version 3 (sealed, docs/reference/store.md#record-format): u8 + key id, 12-byte nonce, then
//! the version-2
//!   answer section sealed with AES-256-GCM, followed by its 16-byte tag
//! version 4 (traced): as version 2 (trailers section always present), with
//!   the trace block in the head; also every traced reservation
//! version 5 (traced, sealed): as version 3, with the trace block in the
//!   (clear, authenticated) head
//! ```
//!
//! Versions 4 and 5 (docs/telemetry.md#what-is-stored) are written only when
//! the record carries the trace and span ids of the request that executed
//! (tracing on, `[telemetry]`): a proxy without tracing writes versions 1 to
//! 3 exactly as before, and every version is read by this build. The ids are
//! not secret and stay in the clear head, sealed or not, so that a replay, a
//! 409 or a 422 can link to the execution without opening the answer. An
//! older build reads a version 4 or 5 record as an unknown format version
//! (500 `record-unreadable`, never a second execution): switch tracing on
//! once every replica runs this build.
//!
//! Version 2 (trailers, docs/reference/store.md#format-versions) is written only for an answer
//! that has trailers;
//! every other clear record is still written as version 1, which both versions
//! read: a rolling upgrade, or a rollback by one step, replays the other's
//! records (only an answer with trailers is unreadable to a version-1 proxy,
//! and that is a 500 `record-unreadable`, never a second execution).
//!
//! Version 3 is written only with `[store] encryption_key_file`, for finished
//! records (a reservation holds no answer and stays clear, as every version
//! 1 record). Its head stays clear — the scripts need the state and the token,
//! the verdict the fingerprint, the admin API the status and the times — and
//! only the answer (headers, body, trailers) is sealed, under a fresh random
//! nonce. The associated data is the record id (the hex name of the store key
//! after the prefix) followed by the head as written: a sealed value copied
//! under another id, or whose head was altered, does not open. A large record
//! written piece by piece (`piece.lua`) reads as a reservation until its last
//! piece sets the state to 'F'; the head is sealed with 'F', as it ends up.
//! An older build reads a version-3 record as an unknown format version (500
//! `record-unreadable`), never as something else.

//!
//! A reservation may end with an afterlife trailer: how long the store keeps
//! it past its lease, and what becomes of the key if its owner never comes
//! back (tag 'U': the 502 `outcome-unknown` is stored; 'R': the request runs
//! again). Every build before it ignores a reservation's bytes after its head
//! (a record written piece by piece reads as a reservation), so a rolling
//! upgrade reads it. A record being written piece by piece has its `completed`
//! stamp (a u64 of Unix ms, whose first byte is 0 until the year 2.2 million)
//! right after its head: never one of the tags, so it never reads as a
//! reservation with an afterlife.

mod layout;

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderName, HeaderValue};

use self::layout::{
    answer_len, associated_data, head_len, put_afterlife, put_answer, put_finished_head, put_head,
    put_str8, read_answer, read_head, read_key_id, Common,
};
use crate::seal::{Keyring, OpenError, SealError, NONCE_BYTES, TAG_LEN};

/// A clear record without trailers: every reservation, and most answers.
const VERSION_1: u8 = 1;
/// A clear answer with trailers.
const VERSION_2: u8 = 2;
/// A finished record whose answer is sealed (docs/reference/store.md#sealing).
pub(crate) const VERSION_SEALED: u8 = 3;
/// A clear record with the execution's trace context (answers as version 2).
const VERSION_TRACED: u8 = 4;
/// A sealed finished record with the execution's trace context in its clear head.
pub(crate) const VERSION_TRACED_SEALED: u8 = 5;
/// The trace block of versions 4 and 5: trace id and span id.
const TRACE_BLOCK: usize = 16 + 8;

/// Is this encoded record sealed (version 3 or 5)?
pub(crate) fn is_sealed(encoded: &[u8]) -> bool {
    matches!(
        encoded.first(),
        Some(&VERSION_SEALED | &VERSION_TRACED_SEALED)
    )
}

/// The trace context of the request that executed (its SERVER span), kept
/// with its reservation and its finished record so that replays, 409s and
/// 422s can link to it. Not secret: ids, no header or key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceRef {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
}
pub const STATE_PROCESSING: u8 = b'P';
pub(crate) const STATE_FINISHED: u8 = b'F';
/// The afterlife trailer's tags: a dead owner's key gets the unknown outcome
/// stored, or is run again. Neither is 0, the first byte of a `completed`
/// stamp (what follows the head of a record written piece by piece).
const AFTERLIFE_UNKNOWN: u8 = b'U';
const AFTERLIFE_RE_EXECUTE: u8 = b'R';
/// The trailer's length: its tag and a u64 of ms.
const AFTERLIFE_LEN: usize = 1 + 8;
/// Where the owner token sits; the Lua scripts read `string.sub(v, 3, 18)`.
pub(crate) const TOKEN_RANGE: std::ops::Range<usize> = 2..18;
/// The bytes of the head before the route name.
const FIXED_HEAD: usize = 58;

/// The largest body a record can hold: Redis's largest value (a larger
/// `max_response_body` is a configuration error).
pub const MAX_BODY: u64 = 512 << 20;

/// What a record holds besides its body, at most: the stored response head
/// (hyper's client takes at most ~408 KiB of it over HTTP/1.1, 16 KiB of
/// header list over HTTP/2), trailers (16 KiB), the route name (under 64
/// KiB), the head's fixed fields, and a seal's key id, nonce and tag. So no
/// record this proxy writes is longer than the largest `max_response_body`
/// plus this, and a store that says otherwise is not believed
/// (docs/reference/store.md#untrusted-replies).
pub(crate) const MAX_OVERHEAD: u64 = 1 << 20;

/// Identifies one reservation; a late finisher with an old token changes nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Token(pub [u8; 16]);

impl Token {
    /// The owner token of an encoded record (at the same place in both states).
    pub(crate) fn of_record(encoded: &[u8]) -> Option<Token> {
        encoded.get(TOKEN_RANGE)?.try_into().ok().map(Token)
    }

    pub fn new() -> Self {
        Token(*uuid::Uuid::new_v4().as_bytes())
    }
}

impl Default for Token {
    fn default() -> Self {
        Self::new()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Processing {
    pub token: Token,
    pub fingerprint: [u8; 32],
    pub created_ms: u64,
    pub route: String,
    /// The executing request's trace context (tracing on), else `None`.
    pub trace: Option<TraceRef>,
    /// How long the store keeps the reservation past its lease, and what
    /// becomes of the key if the owner never completes it; `None` in a
    /// reservation written without it (an older build).
    pub afterlife: Option<Afterlife>,
}

/// A reservation's afterlife: the store keeps it for `lease + after`; once
/// no more than `after` is left, the lease has run out without its owner
/// (docs/reference/behaviour.md#dead-owner).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Afterlife {
    pub after: Duration,
    /// What the next request with the key does.
    pub then: DeadOwner,
}

impl Afterlife {
    /// Has the lease of a reservation with `left` of its store time run out?
    /// (Clock-free: the store counts `left`; `after` is in the record.)
    pub fn lease_ended(&self, left: Duration) -> bool {
        !self.after.is_zero() && left <= self.after
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    pub token: Token,
    pub fingerprint: [u8; 32],
    pub created_ms: u64,
    pub route: String,
    pub completed_ms: u64,
    pub status: u16,
    /// The reason phrase the upstream sent, when not the status's usual one
    /// (HTTP/1.1; at most 255 bytes): replays repeat it.
    pub reason: Option<Bytes>,
    /// The executing request's trace context (tracing on), else `None`.
    pub trace: Option<TraceRef>,
    /// False when the answer was larger than `max_response_body`: retries get a 410.
    pub body_stored: bool,
    /// End-to-end headers only (no hop-by-hop, `Set-Cookie`, `Date`, `Content-Length`).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
    /// The answer's trailers (gRPC's `grpc-status` lives here), in order.
    pub trailers: Vec<(HeaderName, HeaderValue)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    Processing(Processing),
    Finished(Finished),
}

/// The clear head of any record, read without a key: what the admin API shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Head {
    pub token: Token,
    pub fingerprint: [u8; 32],
    pub created_ms: u64,
    pub route: String,
    /// The executing request's trace context, when the record keeps it.
    pub trace: Option<TraceRef>,
    /// A reservation's afterlife, when it has one.
    pub afterlife: Option<Afterlife>,
    /// `None` while processing.
    pub finished: Option<Answered>,
    /// The id of the key that sealed the answer; `None` for a clear record.
    pub sealed_with: Option<String>,
}

/// What the head of a finished record says of its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answered {
    pub completed_ms: u64,
    pub status: u16,
    pub body_stored: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("stored record cannot be decoded: {0}")]
    Malformed(&'static str),
    #[error("stored record is sealed, and no encryption_key_file is configured")]
    NoKeyFile,
    #[error("stored record is sealed under key id \"{0}\", which the key file does not hold")]
    UnknownKey(String),
    #[error("stored record sealed under key id \"{0}\" does not open: altered, or copied from another record id")]
    NotOpened(String),
    #[error("stored record is finished but not sealed, and require_sealed is on")]
    NotSealed,
}

fn need(b: &Bytes, n: usize) -> Result<(), DecodeError> {
    if b.remaining() < n {
        Err(DecodeError::Malformed("truncated"))
    } else {
        Ok(())
    }
}

impl Head {
    /// The clear head of a record of any version, sealed or not.
    pub fn decode(mut b: Bytes) -> Result<Head, DecodeError> {
        let (version, mut head) = read_head(&mut b)?;
        if is_sealed(&[version]) && head.finished.is_some() {
            head.sealed_with = Some(read_key_id(&mut b)?);
        }
        Ok(head)
    }
}

impl Record {
    pub fn token(&self) -> Token {
        match self {
            Record::Processing(p) => p.token,
            Record::Finished(f) => f.token,
        }
    }

    pub fn fingerprint(&self) -> &[u8; 32] {
        match self {
            Record::Processing(p) => &p.fingerprint,
            Record::Finished(f) => &f.fingerprint,
        }
    }

    pub fn route(&self) -> &str {
        match self {
            Record::Processing(p) => &p.route,
            Record::Finished(f) => &f.route,
        }
    }

    /// The executing request's trace context, when the record keeps it.
    pub fn trace(&self) -> Option<TraceRef> {
        match self {
            Record::Processing(p) => p.trace,
            Record::Finished(f) => f.trace,
        }
    }

    pub fn created_ms(&self) -> u64 {
        match self {
            Record::Processing(p) => p.created_ms,
            Record::Finished(f) => f.created_ms,
        }
    }

    /// The clear encoding: version 1, or 2 for an answer with trailers; 4
    /// for a record with a trace context.
    pub fn encode(&self) -> Bytes {
        match self {
            Record::Processing(p) => {
                let len = FIXED_HEAD + 2 + p.route.len() + TRACE_BLOCK + AFTERLIFE_LEN;
                let mut b = BytesMut::with_capacity(len);
                let common = Common {
                    token: p.token,
                    fingerprint: &p.fingerprint,
                    created_ms: p.created_ms,
                    route: &p.route,
                    trace: p.trace,
                };
                let version = if p.trace.is_some() {
                    VERSION_TRACED
                } else {
                    VERSION_1
                };
                put_head(&mut b, version, common, None);
                if let Some(a) = p.afterlife {
                    put_afterlife(&mut b, a);
                }
                b.freeze()
            }
            Record::Finished(f) => {
                let trailers = !f.trailers.is_empty() || f.trace.is_some() || f.reason.is_some();
                let version = match (f.trace.is_some(), trailers) {
                    (true, _) => VERSION_TRACED,
                    (false, true) => VERSION_2,
                    (false, false) => VERSION_1,
                };
                let mut b = BytesMut::with_capacity(head_len(f) + answer_len(f, trailers));
                put_finished_head(&mut b, version, f);
                put_answer(&mut b, f, trailers);
                b.freeze()
            }
        }
    }

    /// The encoding for the record `record_id` with a key file: a finished
    /// record sealed (version 3) with the first key; a reservation clear.
    pub fn seal(&self, keys: &Keyring, record_id: &str) -> Result<Bytes, SealError> {
        let Record::Finished(f) = self else {
            return Ok(self.encode());
        };
        let key_id = keys.sealing_id();
        let len = head_len(f) + 1 + key_id.len() + NONCE_BYTES + answer_len(f, true) + TAG_LEN;
        let mut b = BytesMut::with_capacity(len);
        let version = if f.trace.is_some() {
            VERSION_TRACED_SEALED
        } else {
            VERSION_SEALED
        };
        put_finished_head(&mut b, version, f);
        let aad = associated_data(record_id, &b);
        put_str8(&mut b, key_id.as_bytes());
        b.put_bytes(0, NONCE_BYTES);
        let sealed_at = b.len();
        put_answer(&mut b, f, true);
        let (nonce, tag) = keys.seal(&aad, &mut b[sealed_at..])?;
        b[sealed_at - NONCE_BYTES..sealed_at].copy_from_slice(&nonce);
        b.put_slice(&tag);
        Ok(b.freeze())
    }

    /// A clear record (a sealed one is an error: it needs [`Record::open`]).
    pub fn decode(b: Bytes) -> Result<Record, DecodeError> {
        Record::open(b, None, "")
    }

    /// Any record stored under `record_id`, a sealed one opened with `keys`.
    /// The answer is opened in place when `value` is not shared.
    pub fn open(
        value: Bytes,
        keys: Option<&Keyring>,
        record_id: &str,
    ) -> Result<Record, DecodeError> {
        let mut rest = value.clone();
        let (version, head) = read_head(&mut rest)?;
        let Some(answered) = head.finished else {
            return Ok(Record::Processing(Processing {
                token: head.token,
                fingerprint: head.fingerprint,
                created_ms: head.created_ms,
                route: head.route,
                trace: head.trace,
                afterlife: head.afterlife,
            }));
        };
        let answer = if is_sealed(&[version]) {
            let head_len = value.len() - rest.remaining();
            let key_id = read_key_id(&mut rest)?;
            need(&rest, NONCE_BYTES + TAG_LEN)?;
            let mut nonce = [0u8; NONCE_BYTES];
            rest.copy_to_slice(&mut nonce);
            let sealed_at = value.len() - rest.remaining();
            drop(rest);
            let keys = keys.ok_or(DecodeError::NoKeyFile)?;
            let aad = associated_data(record_id, &value[..head_len]);
            let mut buf = BytesMut::from(value);
            let opened = match keys.open(&key_id, nonce, &aad, &mut buf[sealed_at..]) {
                Ok(text) => text.len(),
                Err(OpenError::UnknownKey) => return Err(DecodeError::UnknownKey(key_id)),
                Err(OpenError::Rejected) => return Err(DecodeError::NotOpened(key_id)),
            };
            buf.freeze().slice(sealed_at..sealed_at + opened)
        } else {
            rest
        };
        let (headers, body, trailers, reason) = read_answer(answer, version != VERSION_1)?;
        Ok(Record::Finished(Finished {
            token: head.token,
            fingerprint: head.fingerprint,
            created_ms: head.created_ms,
            route: head.route,
            completed_ms: answered.completed_ms,
            status: answered.status,
            reason,
            trace: head.trace,
            body_stored: answered.body_stored,
            headers,
            body,
            trailers,
        }))
    }
}

/// Header or trailer fields as a record keeps them, in order (a name may repeat).
pub type HeaderFields = Vec<(HeaderName, HeaderValue)>;

/// Milliseconds since the Unix epoch, for `created` and `completed` stamps.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests;

/// What becomes of a dead owner's key, as the reservation records it
/// (the route's `lease_expiry` and `unknown_outcome`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeadOwner {
    /// The next request with the key stores and answers the 502 `outcome-unknown`.
    StoreUnknown,
    /// The next request with the key takes it over and runs again.
    ReExecute,
}

impl DeadOwner {
    /// The `handling` label of `idemproxy_lease_expired_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadOwner::StoreUnknown => "unknown_outcome",
            DeadOwner::ReExecute => "re_execute",
        }
    }
}
