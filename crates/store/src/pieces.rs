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
//!
//! Every round trip has its own `op_timeout` ([`Step`]): a 16 MiB record is
//! 64 pieces, and a store a few milliseconds away needs longer than one
//! `op_timeout` for all of them, though each piece takes a few milliseconds.

use std::future::Future;
use std::pin::Pin;
use std::sync::LazyLock;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use redis::aio::ConnectionLike;
use redis::Script;

use super::redis_conn::{ms, run_script, Conn};
use super::wire::digits;
use super::{Completion, StoreError};
use crate::deadline::{Deadlines, Within};
use crate::record::{Token, STATE_PROCESSING, TOKEN_RANGE};

pub(crate) use super::PIECE;

/// How long a record being written piece by piece is kept at least (its
/// reservation's time is extended to it): if the proxy dies mid-way, the
/// half-written reservation goes when that time ends — the reservation's
/// lease and afterlife, as the first piece keeps them (it carries no
/// afterlife trailer of its own, so it is never taken for a vanished
/// owner's: docs/reference/behaviour.md#dead-owner).
const WRITE_LEASE: Duration = Duration::from_secs(60);

pub(crate) static SCRIPT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("piece.lua")));

/// One round trip's bound and how its client errors read as store errors.
pub(crate) struct Step<'a> {
    /// `op_timeout`, counted from each round trip's start.
    pub deadlines: &'a Deadlines,
    pub error: &'a ErrorOf<'a>,
}

impl<'a> Step<'a> {
    /// Runs one round trip within its own `op_timeout`. (A future of its
    /// own, not an `async fn`: that would hold `fut` twice, as its argument
    /// and inside the bound, and the completion's future is copied whole.)
    pub fn run<T, F>(&self, fut: F) -> Bounded<'a, F, &'a ErrorOf<'a>>
    where
        F: Future<Output = redis::RedisResult<T>>,
    {
        Bounded {
            within: self.deadlines.within(tokio::time::Instant::now(), fut),
            convert: self.error,
            after: self.deadlines.after(),
        }
    }

    /// [`Step::run`] for a step whose errors are store errors already (connecting).
    pub fn bound<T, F>(&self, fut: F) -> Bounded<'a, F, fn(StoreError) -> StoreError>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        Bounded {
            within: self.deadlines.within(tokio::time::Instant::now(), fut),
            convert: std::convert::identity,
            after: self.deadlines.after(),
        }
    }
}

/// How a client error reads as a store error.
pub(crate) type ErrorOf<'a> = dyn Fn(redis::RedisError) -> StoreError + Sync + 'a;

pin_project_lite::pin_project! {
    /// One round trip cut off at its `op_timeout`, its error a store error.
    pub(crate) struct Bounded<'a, F, C> {
        #[pin]
        within: Within<'a, F>,
        convert: C,
        after: Duration,
    }
}

impl<T, E, F, C> Future for Bounded<'_, F, C>
where
    F: Future<Output = Result<T, E>>,
    C: Fn(E) -> StoreError,
{
    type Output = Result<T, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        Poll::Ready(match std::task::ready!(this.within.poll(cx)) {
            Some(answer) => answer.map_err(this.convert),
            None => Err(StoreError::Timeout(*this.after)),
        })
    }
}

/// A record and its TTL. Up to [`PIECE`] bytes it is one round trip
/// (STRLEN, PTTL and the first piece); a larger one is read piece by piece,
/// each round trip within its own `op_timeout`. `None` when the key is gone,
/// or was written anew while it was being read. The store's word is checked
/// before it is acted on: a length over `at_most` (longer than any record
/// the proxy writes) or a piece longer than asked for is an error
/// ([`StoreError::Untrue`]), and nothing is allocated for it.
pub async fn get<C: ConnectionLike>(
    conn: &mut C,
    key: &str,
    at_most: u64,
    step: &Step<'_>,
) -> Result<Option<(Bytes, Duration)>, StoreError> {
    let (len, pttl, first): (u64, i64, Vec<u8>) = step
        .run(
            redis::pipe()
                .strlen(key)
                .pttl(key)
                .getrange(key, 0, PIECE as isize - 1)
                .query_async(conn),
        )
        .await?;
    if len > at_most {
        return Err(StoreError::Untrue(format!(
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
            return Err(StoreError::Untrue(format!(
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
        piece = step
            .run(
                redis::cmd("GETRANGE")
                    .arg(key)
                    .arg(from)
                    .arg(from + PIECE as isize - 1)
                    .query_async(conn),
            )
            .await?;
    }
    let same = whole.len() as u64 == len && unchanged(conn, key, &whole, step).await?;
    Ok(same.then(|| (whole.freeze(), ttl)))
}

/// Is the record read piece by piece as `whole` still there? Written anew
/// meanwhile, it has a new owner token (or length).
async fn unchanged<C: ConnectionLike>(
    conn: &mut C,
    key: &str,
    whole: &[u8],
    step: &Step<'_>,
) -> Result<bool, StoreError> {
    let (len_now, token): (u64, Vec<u8>) = step
        .run(
            redis::pipe()
                .strlen(key)
                .getrange(
                    key,
                    TOKEN_RANGE.start as isize,
                    TOKEN_RANGE.end as isize - 1,
                )
                .query_async(conn),
        )
        .await?;
    Ok(len_now == whole.len() as u64 && whole.get(TOKEN_RANGE) == Some(&token[..]))
}

/// Stores a large finished record in place of the reservation `token` owns,
/// each piece within its own `op_timeout`. `None` when the key went or
/// changed mid-way (the caller starts again).
pub async fn complete(
    conn: &mut Conn,
    key: &str,
    token: Token,
    (value, ttl): (&Bytes, Duration),
    step: &Step<'_>,
) -> Result<Option<Completion>, StoreError> {
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
        let n: i64 = step.run(run_script(conn, &SCRIPT, key, &args)).await?;
        match n {
            1 => {}
            2 => gone = true,
            0 => return Ok(Some(Completion::Refused)),
            // Finished already: this attempt's earlier twin got there.
            3 => return Ok(Some(Completion::Stored)),
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
