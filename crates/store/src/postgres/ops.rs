//! The PostgreSQL store's operations: each one prepared statement, so one
//! round trip.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use super::{col, ms, PostgresStore};
use crate::deadline::Deadlines;
use crate::record::{Token, TOKEN_RANGE};
use crate::{Completion, Occupant, Operations, StoreError, PIECE};

/// How often a reserve is sent again when it neither reserved nor found a
/// live holder (the key changed hands between its read and its write).
const RESERVE_TRIES: u32 = 3;

impl Operations for PostgresStore {
    /// One statement: reserved, or what holds the key (its first `inline`
    /// bytes, its length, its time left); sent again when neither came back
    /// (the key changed hands between the statement's read and its write).
    async fn reserve(
        &self,
        key: &str,
        value: Bytes,
        lease: Duration,
        inline: u64,
        taken: &AtomicBool,
    ) -> Result<Option<Occupant>, StoreError> {
        let token = Token::of_record(&value)
            .ok_or_else(|| StoreError::Backend("a reservation without an owner token".into()))?;
        let inline = i32::try_from(inline.max(1)).unwrap_or(i32::MAX);
        let lease = ms(lease);
        let mut conn = self.conn().await?;
        for _ in 0..RESERVE_TRIES {
            let rows = self
                .query(
                    &mut conn,
                    &self.sql.reserve,
                    &[&key, &&value[..], &&token.0[..], &lease, &inline],
                )
                .await?;
            let Some(row) = rows.first() else { continue };
            if col::<bool>(row, 0)? {
                return Ok(None);
            }
            taken.store(true, Ordering::Relaxed);
            let start: Vec<u8> = col(row, 1)?;
            let len: i64 = col(row, 2)?;
            let left: i64 = col(row, 3)?;
            if start.len() > inline as usize {
                return Err(StoreError::Untrue(format!(
                    "{} bytes for a reserve of at most {inline}",
                    start.len()
                )));
            }
            let len = len.max(0) as u64;
            return Ok(Some(if len == start.len() as u64 {
                Occupant::Value {
                    value: Bytes::from(start),
                    ttl: Some(Duration::from_millis(left.max(0) as u64)),
                }
            } else {
                Occupant::Large {
                    len,
                    start: Bytes::from(start),
                }
            }));
        }
        Err(StoreError::Backend(
            "the key changed hands under every reserve sent".into(),
        ))
    }

    async fn pttl(&self, key: &str) -> Result<Duration, StoreError> {
        let mut conn = self.conn().await?;
        let rows = self.query(&mut conn, &self.sql.pttl, &[&key]).await?;
        Ok(match rows.first() {
            Some(r) => Duration::from_millis(col::<i64>(r, 0)?.max(0) as u64),
            None => Duration::ZERO,
        })
    }

    /// One statement, whatever the record's size, within `op_timeout`.
    async fn complete(
        &self,
        key: &str,
        token: Token,
        value: Bytes,
        ttl: Duration,
        steps: &Deadlines,
    ) -> Result<Completion, StoreError> {
        let ttl = ms(ttl);
        Self::step(steps, async {
            let mut conn = self.conn().await?;
            let rows = self
                .query(
                    &mut conn,
                    &self.sql.complete,
                    &[&key, &&value[..], &&token.0[..], &ttl],
                )
                .await?;
            let row = rows
                .first()
                .ok_or_else(|| StoreError::Backend("a completion without an answer".into()))?;
            Ok(match (col::<bool>(row, 0)?, col::<bool>(row, 1)?) {
                (false, _) => Completion::Refused,
                (true, true) => Completion::Stored,
                (true, false) => Completion::StoredAfterExpiry,
            })
        })
        .await
    }

    async fn renew(&self, key: &str, token: Token, lease: Duration) -> Result<bool, StoreError> {
        let mut conn = self.conn().await?;
        let n = self
            .execute(
                &mut conn,
                &self.sql.renew,
                &[&key, &&token.0[..], &ms(lease)],
            )
            .await?;
        Ok(n == 1)
    }

    async fn take_over(
        &self,
        key: &str,
        dead: Token,
        afterlife: Duration,
        value: Bytes,
        hold: Duration,
    ) -> Result<bool, StoreError> {
        let taker = Token::of_record(&value)
            .ok_or_else(|| StoreError::Backend("a record without an owner token".into()))?;
        let finished = value.get(1) == Some(&crate::record::STATE_FINISHED);
        let mut conn = self.conn().await?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] = [
            &key,
            &&value[..],
            &&taker.0[..],
            &finished,
            &ms(hold),
            &&dead.0[..],
            &ms(afterlife),
        ];
        let rows = self.query(&mut conn, &self.sql.take_over, &params).await?;
        match rows.first() {
            Some(row) => col::<bool>(row, 0),
            None => Err(StoreError::Backend("a take-over without an answer".into())),
        }
    }

    async fn release(&self, key: &str, token: Token) -> Result<bool, StoreError> {
        let mut conn = self.conn().await?;
        let n = self
            .execute(&mut conn, &self.sql.release, &[&key, &&token.0[..]])
            .await?;
        Ok(n == 1)
    }

    /// As on Redis: up to [`PIECE`] bytes one statement (length, time left
    /// and the first piece); a larger record piece by piece, each statement
    /// within its own `op_timeout`, then its length and owner token again
    /// (a record written anew meanwhile is not returned). A length over
    /// `at_most`, or a piece longer than asked for, is not believed.
    async fn get(
        &self,
        key: &str,
        at_most: u64,
        steps: &Deadlines,
    ) -> Result<Option<(Bytes, Duration)>, StoreError> {
        let piece = PIECE as i32;
        let mut conn = Self::step(steps, self.conn()).await?;
        let rows = Self::step(
            steps,
            self.query(&mut conn, &self.sql.first, &[&key, &piece]),
        )
        .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let (len, left, first): (i64, i64, Vec<u8>) = (col(row, 0)?, col(row, 1)?, col(row, 2)?);
        let len = len.max(0) as u64;
        if len > at_most {
            return Err(StoreError::Untrue(format!(
                "a record of {len} bytes; none is over {at_most}"
            )));
        }
        let ttl = Duration::from_millis(left.max(0) as u64);
        if first.len() > PIECE {
            return Err(StoreError::Untrue(format!(
                "{} bytes for a piece of at most {PIECE}",
                first.len()
            )));
        }
        if len <= PIECE as u64 {
            return Ok((first.len() as u64 == len).then(|| (Bytes::from(first), ttl)));
        }
        let mut whole = BytesMut::with_capacity(len as usize);
        let mut next = first;
        loop {
            if next.len() > PIECE {
                return Err(StoreError::Untrue(format!(
                    "{} bytes for a piece of at most {PIECE}",
                    next.len()
                )));
            }
            if next.is_empty() || whole.len() + next.len() > len as usize {
                // Shorter or longer than it was: written anew meanwhile.
                return Ok(None);
            }
            whole.extend_from_slice(&next);
            if whole.len() as u64 == len {
                break;
            }
            // `substring` counts from 1.
            let from = whole.len() as i32 + 1;
            let rows = Self::step(
                steps,
                self.query(&mut conn, &self.sql.piece, &[&key, &from, &piece]),
            )
            .await?;
            match rows.first() {
                Some(r) => next = col(r, 0)?,
                None => return Ok(None),
            }
        }
        let rows = Self::step(steps, self.query(&mut conn, &self.sql.check, &[&key])).await?;
        let same = match rows.first() {
            Some(r) => {
                let (len_now, token): (i64, Vec<u8>) = (col(r, 0)?, col(r, 1)?);
                len_now as u64 == len && whole.get(TOKEN_RANGE) == Some(&token[..])
            }
            None => false,
        };
        Ok(same.then(|| (whole.freeze(), ttl)))
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let mut conn = self.conn().await?;
        let rows = self.query(&mut conn, &self.sql.delete, &[&key]).await?;
        let mut live = false;
        for r in &rows {
            live |= col::<bool>(r, 0)?;
        }
        Ok(live)
    }

    /// A statement on the table: the server answers, it is a primary (the
    /// URL's `target_session_attrs` picks one), and the table is there.
    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        let rows = self.query(&mut conn, &self.sql.ping, &[]).await?;
        match rows.first() {
            Some(r) if col::<bool>(r, 0)? => Ok(()),
            _ => {
                // A standby or a read-only server: not this connection again.
                conn.healthy = false;
                Err(StoreError::Unavailable(
                    "the server is read-only (a standby, or default_transaction_read_only)".into(),
                ))
            }
        }
    }
}
