//! Large records in Redis, piece by piece. The shared connection's read and
//! write buffers grow to the largest message they ever carried and keep that
//! size, outside the memory budget; so no command or reply carries more than
//! [`PIECE`] bytes of a record, whatever `max_response_body` allows.
//!
//! Writing (`piece.lua`): the record replaces the caller's reservation piece
//! by piece, its state byte 'P' until the last piece turns it into 'F', so a
//! reader sees a reservation in progress, never half an answer. Reading:
//! `GETRANGE` pieces into a buffer of the record's exact size, then the length
//! and owner token again: a record written anew meanwhile (new token, or new
//! length) is not returned.

use std::sync::LazyLock;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use redis::aio::ConnectionLike;
use redis::Script;

use super::redis::{ms, run_script, Conn};
use super::wire::digits;
use super::Completion;
use crate::record::{Token, STATE_PROCESSING, TOKEN_RANGE};

/// The most of a record one command or reply carries.
pub const PIECE: usize = 256 * 1024;

/// How long a record being written piece by piece is kept at least (its
/// reservation's lease is extended to it): if the proxy dies mid-way, the
/// half-written reservation goes when it ends.
const WRITE_LEASE: Duration = Duration::from_secs(60);

pub static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("piece.lua")));

/// A record and its TTL. Up to [`PIECE`] bytes it is one round trip
/// (STRLEN, PTTL and the first piece); a larger one is read piece by piece.
/// `None` when the key is gone, or was written anew while it was being read.
/// The store's word is checked before it is acted on: a length over
/// `at_most` (longer than any record the proxy writes) or a piece longer
/// than asked for is an error, and nothing is allocated for it.
pub async fn get<C: ConnectionLike>(
    conn: &mut C,
    key: &str,
    at_most: u64,
) -> Result<Option<(Bytes, Duration)>, GetError> {
    let (len, pttl, first): (u64, i64, Vec<u8>) = redis::pipe()
        .strlen(key)
        .pttl(key)
        .getrange(key, 0, PIECE as isize - 1)
        .query_async(conn)
        .await?;
    if len > at_most {
        return Err(GetError::Untrue(format!(
            "a record of {len} bytes; none is over {at_most}"
        )));
    }
    let ttl = Duration::from_millis(pttl.max(0) as u64);
    if pttl == -2 || first.is_empty() {
        return Ok(None);
    }
    if len <= PIECE as u64 {
        return Ok((first.len() as u64 == len).then(|| (Bytes::from(first), ttl)));
    }
    let mut whole = BytesMut::with_capacity(len as usize);
    let mut piece = first;
    loop {
        if piece.len() > PIECE {
            return Err(GetError::Untrue(format!(
                "{} bytes for a piece of at most {PIECE}",
                piece.len()
            )));
        }
        if piece.is_empty() || whole.len() + piece.len() > len as usize {
            // Shorter or longer than it was: written anew meanwhile.
            return Ok(None);
        }
        whole.extend_from_slice(&piece);
        if whole.len() as u64 == len {
            break;
        }
        let from = whole.len() as isize;
        piece = redis::cmd("GETRANGE")
            .arg(key)
            .arg(from)
            .arg(from + PIECE as isize - 1)
            .query_async(conn)
            .await?;
    }
    // Written anew meanwhile? A new write has a new owner token (or length).
    let (len_now, token): (u64, Vec<u8>) = redis::pipe()
        .strlen(key)
        .getrange(
            key,
            TOKEN_RANGE.start as isize,
            TOKEN_RANGE.end as isize - 1,
        )
        .query_async(conn)
        .await?;
    let same =
        whole.len() as u64 == len && len_now == len && whole.get(TOKEN_RANGE) == Some(&token[..]);
    Ok(same.then(|| (whole.freeze(), ttl)))
}

/// Why a record could not be read.
#[derive(Debug)]
pub enum GetError {
    Redis(redis::RedisError),
    /// An answer no record the proxy wrote could give.
    Untrue(String),
}

impl From<redis::RedisError> for GetError {
    fn from(e: redis::RedisError) -> Self {
        GetError::Redis(e)
    }
}

/// Stores a large finished record in place of the reservation `token` owns.
/// `None` when the key went or changed mid-way (the caller starts again).
pub async fn complete(
    conn: &mut Conn,
    key: &str,
    token: Token,
    value: &Bytes,
    ttl: Duration,
) -> redis::RedisResult<Option<Completion>> {
    let (mut gone, mut offset) = (false, 0);
    while offset < value.len() {
        let end = (offset + PIECE).min(value.len());
        let mut piece = value.slice(offset..end);
        if offset == 0 {
            let mut first = BytesMut::from(&piece[..]);
            first[1] = STATE_PROCESSING;
            piece = first.freeze();
        }
        let last = end == value.len();
        let (mut at, mut lease, mut keep) = ([0; 20], [0; 20], [0; 20]);
        let args: [&[u8]; 5] = [
            &token.0,
            digits(offset as u64, &mut at),
            &piece,
            digits(ms(WRITE_LEASE), &mut lease),
            // The TTL goes with the last piece only.
            if last {
                digits(ms(ttl), &mut keep)
            } else {
                b""
            },
        ];
        let n: i64 = run_script(conn, &SCRIPT, key, &args).await?;
        match n {
            1 => {}
            2 => gone = true,
            0 => return Ok(Some(Completion::Refused)),
            _ => return Ok(None),
        }
        offset = end;
    }
    Ok(Some(if gone {
        Completion::StoredAfterExpiry
    } else {
        Completion::Stored
    }))
}
