//! The PostgreSQL store's sweep: expired rows deleted in batches, each a
//! statement and a transaction of its own.

use std::time::Duration;

use tokio_postgres::error::SqlState;

use super::{PostgresStore, SWEEP_BATCH, SWEEP_TIMEOUT};
use crate::StoreError;

impl PostgresStore {
    /// Deletes expired rows, [`SWEEP_BATCH`] at a time, each batch one
    /// statement in a transaction of its own (never one long transaction)
    /// with its own statement timeout ([`SWEEP_TIMEOUT`], not `op_timeout`:
    /// deleting large rows takes longer than a request's statement), until
    /// a batch comes back short; rows another proxy is deleting are skipped.
    /// A batch that times out is tried again at half the size, down to one
    /// row: large rows are deleted a few at a time rather than never. How
    /// many went; an error when even one row could not be deleted in time.
    pub(crate) async fn sweep(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        let mut size = SWEEP_BATCH;
        loop {
            match self.sweep_batch(size).await {
                Ok(n) => {
                    total += n;
                    if n < size as u64 {
                        return Ok(total);
                    }
                }
                Err(StoreError::Timeout(_)) if size > 1 => size = (size / 2).max(1),
                Err(e) => return Err(e),
            }
            // Let the requests' statements in between batches.
            tokio::task::yield_now().await;
        }
    }

    /// One sweep batch of at most `size` rows, within [`SWEEP_TIMEOUT`] on
    /// the server (`SET LOCAL statement_timeout`) and a little more here.
    async fn sweep_batch(&self, size: i64) -> Result<u64, StoreError> {
        let server_ms = SWEEP_TIMEOUT.as_millis();
        let sql = format!(
            "BEGIN; SET LOCAL statement_timeout = {server_ms}; {}; COMMIT",
            self.sql.sweep.replace("$1::bigint", &size.to_string())
        );
        let batch = async {
            let mut conn = self.conn().await?;
            let res = conn.client().simple_query(&sql).await;
            match res {
                Ok(messages) => {
                    conn.healthy = true;
                    Ok(messages
                        .iter()
                        .map(|m| match m {
                            tokio_postgres::SimpleQueryMessage::CommandComplete(n) => *n,
                            _ => 0,
                        })
                        .sum())
                }
                // The transaction is left aborted: the connection is closed,
                // not given back.
                Err(e) => Err(match e.code() {
                    Some(c) if *c == SqlState::QUERY_CANCELED => StoreError::Timeout(SWEEP_TIMEOUT),
                    _ => self.error(e),
                }),
            }
        };
        tokio::time::timeout(SWEEP_TIMEOUT + Duration::from_secs(1), batch)
            .await
            .map_err(|_| StoreError::Timeout(SWEEP_TIMEOUT))?
    }
}
