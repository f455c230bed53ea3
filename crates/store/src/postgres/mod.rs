//! The PostgreSQL store: one row per key in a table of its own
//! (`deploy/postgres/schema.sql`), a pool of connections (deadpool) that
//! drops broken ones, so that after a failover new ones find the new primary
//! (a multi-host URL with `target_session_attrs=read-write`).
//!
//! Every operation is one statement, prepared once per connection, so one
//! round trip: the reserve inserts the row, or takes over an expired one, or
//! returns what holds the key (its first `inline` bytes, its length and what
//! is left of its time), in one statement; the completion, renewal and
//! release compare the owner token in their `WHERE`.
//!
//! Time is the database server's clock (`now()`), never the proxy's: every
//! proxy sharing the table then agrees on when a lease or a record ends,
//! whatever their own clocks say, and a replica whose clock is off by seconds
//! cannot take over a live reservation. (The proxy's clock still bounds its
//! own waits: `op_timeout`, the lease it renews.)
//!
//! An expired row is never served: every statement reads only rows whose
//! `expires_at` is ahead, and the reserve takes an expired row over as if
//! the key were free. Expired rows are deleted by [`PostgresStore::sweep`]
//! in batches of [`SWEEP_BATCH`], each batch a statement of its own.

mod error;
mod ops;
mod pool;
mod schema;
mod statements;
mod sweep;

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use deadpool_postgres::{Object, Pool, PoolError};

use self::error::{keeps_connection, pg_error};
use self::pool::REFUSED;
use self::statements::Statements;
use super::{StoreError, StoreSetupError};
use crate::config::StoreConfig;
use crate::deadline::Deadlines;
use crate::per_worker::PerWorker;

pub use self::pool::client_config;
pub use self::schema::{init_store, Initialised, SchemaProblem, SCHEMA};

/// The env var that carries the PostgreSQL password (wins over `password_file`).
pub(crate) const PASSWORD_ENV: &str = "IDEMPROXY_POSTGRES_PASSWORD";

/// How many expired rows one sweep statement deletes at most.
pub(crate) const SWEEP_BATCH: i64 = 500;
/// How long one sweep batch may run on the server (its own statement
/// timeout; a request's statements have `op_timeout`).
pub(crate) const SWEEP_TIMEOUT: Duration = Duration::from_secs(5);
/// How often each proxy sweeps expired rows.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(10);

pub(crate) struct PostgresStore {
    /// A pool per worker thread (`runtime = "per_thread"`; one with work
    /// stealing): a connection's task runs on the runtime of the requests
    /// that use it, so that a statement's answer wakes no other thread.
    pools: PerWorker<Pool>,
    sql: Statements,
    table: String,
    op_timeout: Duration,
    /// The table was found as the proxy needs it. Until then no request's
    /// statement is sent (its operation is `Unavailable`): a proxy that
    /// could not reach PostgreSQL at start checks the table when the
    /// server first answers (the health ping), and a table missing,
    /// UNLOGGED or of another shape is never written to.
    checked: AtomicBool,
    /// When the table's problem was last logged (once a minute, not at
    /// every ping).
    problem_logged: Mutex<Option<tokio::time::Instant>>,
}

/// A pooled connection for one operation. Dropped before the operation
/// finished (its `op_timeout` ran out) or after it failed for want of a
/// connection, it is not given back to the pool but closed: a statement may
/// still be running on it, or the network under it be gone.
struct Lent {
    client: Option<Object>,
    healthy: bool,
}

impl Lent {
    fn client(&self) -> &Object {
        self.client.as_ref().expect("a lent connection")
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let (false, Some(c)) = (self.healthy, self.client.take()) {
            drop(Object::take(c));
        }
    }
}

impl PostgresStore {
    /// Builds the pools without connecting: an unreachable store is not a
    /// start-up failure. `slots`: per-worker places (`pool_size` is shared
    /// out among them, at least one connection each).
    pub fn new(cfg: &StoreConfig, slots: usize) -> Result<Self, StoreSetupError> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut pools = pool::pools(cfg, slots)?.into_iter();
        Ok(PostgresStore {
            pools: PerWorker::new(slots, |_| pools.next().expect("a pool per slot")),
            sql: Statements::new(&cfg.table),
            table: cfg.table.clone(),
            op_timeout: cfg.op_timeout,
            checked: AtomicBool::new(false),
            problem_logged: Mutex::new(None),
        })
    }

    fn error(&self, e: tokio_postgres::Error) -> StoreError {
        pg_error(e, self.op_timeout)
    }

    /// A pooled connection for a request's statement, once the table is
    /// checked ([`PostgresStore::checked`]).
    async fn conn(&self) -> Result<Lent, StoreError> {
        if !self.checked.load(Ordering::Acquire) {
            return Err(StoreError::Unavailable(
                "the table has not been checked yet (PostgreSQL has not answered since the start, \
                 or the table is not as the proxy needs it)"
                    .into(),
            ));
        }
        self.any_conn().await
    }

    /// A pooled connection, whether or not the table was checked: for the
    /// check itself and `--init-store`.
    async fn any_conn(&self) -> Result<Lent, StoreError> {
        let (got, refused) = REFUSED
            .scope(Cell::new(false), async {
                let got = self.pools.get().get().await;
                (got, REFUSED.with(Cell::get))
            })
            .await;
        match got {
            Ok(c) => Ok(Lent {
                client: Some(c),
                healthy: false,
            }),
            Err(PoolError::Backend(_)) if refused => Err(StoreError::Unavailable(
                "connection attempts to PostgreSQL already in flight, as many as the pool holds"
                    .into(),
            )),
            Err(PoolError::Backend(e)) => Err(self.error(e)),
            Err(PoolError::Timeout(_)) => Err(StoreError::Unavailable(
                "no connection to PostgreSQL in time".into(),
            )),
            Err(e) => Err(StoreError::Unavailable(e.to_string())),
        }
    }

    /// Runs one prepared statement on `conn`, returning its rows; the
    /// connection stays in the pool unless it broke.
    async fn query(
        &self,
        conn: &mut Lent,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>, StoreError> {
        // Not given back to the pool if this statement does not finish
        // (its operation's `op_timeout` runs out): it may still be running.
        conn.healthy = false;
        let client = conn.client();
        let res = match client.prepare_cached(sql).await {
            Ok(stmt) => client.query(&stmt, params).await,
            Err(e) => Err(e),
        };
        match res {
            Ok(rows) => {
                conn.healthy = true;
                Ok(rows)
            }
            Err(e) => {
                // An error the server sent leaves the connection usable,
                // unless it says the server is read-only or going away.
                conn.healthy = keeps_connection(&e, client);
                Err(self.error(e))
            }
        }
    }

    /// [`PostgresStore::query`] that counts the rows changed.
    async fn execute(
        &self,
        conn: &mut Lent,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        conn.healthy = false;
        let client = conn.client();
        let res = match client.prepare_cached(sql).await {
            Ok(stmt) => client.execute(&stmt, params).await,
            Err(e) => Err(e),
        };
        match res {
            Ok(n) => {
                conn.healthy = true;
                Ok(n)
            }
            Err(e) => {
                conn.healthy = keeps_connection(&e, client);
                Err(self.error(e))
            }
        }
    }

    /// One statement within its own `op_timeout` from `steps`.
    async fn step<T>(
        steps: &Deadlines,
        fut: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match steps.within(tokio::time::Instant::now(), fut).await {
            Some(r) => r,
            None => Err(StoreError::Timeout(steps.after())),
        }
    }
}

/// Column `i` of a row the store sent, or `Untrue` when it is NULL or of
/// another type (a table someone altered): never a panic.
fn col<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a tokio_postgres::Row,
    i: usize,
) -> Result<T, StoreError> {
    row.try_get(i)
        .map_err(|e| StoreError::Untrue(format!("column {i} of the reply: {e}")))
}

/// Milliseconds as the statements take them.
fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}
