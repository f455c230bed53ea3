//! The PostgreSQL store's table: the start-up check against the catalog,
//! the checks while the proxy runs, and `--init-store`.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{col, Lent, PostgresStore};
use crate::config::StoreConfig;
use crate::StoreError;

/// The table's definition, as shipped; `--init-store` runs it with the
/// configured table name in place of [`SCHEMA_TABLE`].
pub const SCHEMA: &str = include_str!("../../../../deploy/postgres/schema.sql");
const SCHEMA_TABLE: &str = "idemproxy_records";

/// The columns the proxy reads and writes, and their types as
/// `format_type` spells them: the start-up check compares the table with these.
const COLUMNS: [(&str, &str); 5] = [
    ("key", "text"),
    ("value", "bytea"),
    ("token", "bytea"),
    ("finished", "boolean"),
    ("expires_at", "timestamp with time zone"),
];

impl PostgresStore {
    /// The table as the proxy needs it: `Err(Missing)` when there is none,
    /// `Err(Different)` when its columns or its key differ, or it is not
    /// logged. Compared with the catalog, on one connection of its own; then
    /// a warning when the session's `synchronous_commit` does not wait for
    /// the flush.
    pub async fn check_schema(&self) -> Result<(), SchemaProblem> {
        // Several statements, each a prepare and an execute on a connection
        // that may be new: more than a request's `op_timeout`.
        let bound = (self.op_timeout * 10).max(Duration::from_secs(2));
        let check = async {
            let mut conn = self.any_conn().await.map_err(SchemaProblem::Unreachable)?;
            check_schema(&mut conn, self, &self.table).await?;
            let sync = self
                .query(
                    &mut conn,
                    "SELECT current_setting('synchronous_commit')",
                    &[],
                )
                .await
                .map_err(SchemaProblem::Unreachable)?;
            let sync: String = match sync.first() {
                Some(r) => col(r, 0).map_err(SchemaProblem::Unreachable)?,
                None => String::new(),
            };
            if !durable_commit(&sync) && !self.checked.load(Ordering::Acquire) {
                tracing::warn!(
                    synchronous_commit = %sync,
                    "PostgreSQL's synchronous_commit is not on (nor remote_apply) for the proxy's \
                     sessions: a record acknowledged just before a crash or a failover can be lost, \
                     and a retry then runs the operation again; set synchronous_commit = on \
                     (a role's, a database's or the URL's options can override the server's)"
                );
            }
            self.checked.store(true, Ordering::Release);
            Ok(())
        };
        tokio::time::timeout(bound, check)
            .await
            .unwrap_or(Err(SchemaProblem::Unreachable(StoreError::Timeout(bound))))
    }

    /// Has the table's check passed (and not failed since)?
    pub(crate) fn table_ok(&self) -> bool {
        self.checked.load(Ordering::Acquire)
    }

    /// The table's check again, while the proxy runs (before each sweep): a
    /// table altered to UNLOGGED, or that lost its unique key, is emptied by
    /// a crash or takes a key twice, so from then on no request's statement
    /// is sent (new keys 503, the proxy not ready) until the ping's check
    /// finds it right again. A PostgreSQL that does not answer is an outage,
    /// not a table problem: nothing changes for it.
    pub(crate) async fn recheck(&self) {
        if !self.checked.load(Ordering::Acquire) {
            return;
        }
        match self.check_schema().await {
            Ok(()) | Err(SchemaProblem::Unreachable(_) | SchemaProblem::Failed(_)) => {}
            Err(problem) => {
                self.checked.store(false, Ordering::Release);
                *self
                    .problem_logged
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(tokio::time::Instant::now());
                tracing::error!(
                    problem = %problem,
                    "the PostgreSQL table changed while the proxy runs and is no longer as it \
                     needs it: protected routes answer 503 and the proxy is not ready until it is"
                );
            }
        }
    }

    /// The table's check, when it has not passed yet (PostgreSQL could not
    /// be reached at start): the health ping runs it before the ping, within
    /// the check's own bound, not `op_timeout` (it is several statements, a
    /// prepare and an execute each on a new connection). A table missing or
    /// of another shape keeps the store down (not ready, requests 503),
    /// logged once a minute.
    pub(crate) async fn check_pending(&self) -> Result<(), StoreError> {
        if self.checked.load(Ordering::Acquire) {
            return Ok(());
        }
        match self.check_schema().await {
            Ok(()) => {
                tracing::info!(table = %self.table, "PostgreSQL answered: the table is as the proxy needs it")
            }
            Err(SchemaProblem::Unreachable(e)) => return Err(e),
            Err(problem) => {
                let now = tokio::time::Instant::now();
                let mut logged = self
                    .problem_logged
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                if logged.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(60)) {
                    *logged = Some(now);
                    tracing::error!(
                        problem = %problem,
                        "the PostgreSQL table is not as the proxy needs it: protected routes \
                         answer 503 until it is (run `idemproxy --init-store`, or fix the table)"
                    );
                }
                return Err(StoreError::Backend(problem.to_string()));
            }
        }
        Ok(())
    }
}

/// Is a commit acknowledged only once it is flushed (on the primary, and on
/// the synchronous standbys when there are any)? `on` and `remote_apply`
/// only: `remote_write` acknowledges before the standby's disk has it,
/// `local` and `off` before any standby has it (`off`: before the primary's
/// disk has it).
pub(crate) fn durable_commit(synchronous_commit: &str) -> bool {
    matches!(synchronous_commit, "on" | "remote_apply")
}

/// What the start-up check (and `--init-store`) found wrong with the table.
#[derive(Debug)]
pub enum SchemaProblem {
    Unreachable(StoreError),
    Missing(String),
    Different(String),
    /// The schema's statements failed (a lock not granted in time, say).
    Failed(StoreError),
}

impl std::fmt::Display for SchemaProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SchemaProblem::Unreachable(e) => write!(f, "PostgreSQL is unreachable: {e}"),
            SchemaProblem::Failed(e) => write!(f, "creating the table failed: {e}"),
            SchemaProblem::Missing(t) => write!(
                f,
                "the table \"{t}\" does not exist: create it with `idemproxy --init-store` \
                 (the same configuration) or by running deploy/postgres/schema.sql"
            ),
            SchemaProblem::Different(why) => write!(
                f,
                "{why}; the proxy needs the table deploy/postgres/schema.sql describes \
                 (`idemproxy --init-store` creates it, and never alters one that exists)"
            ),
        }
    }
}

/// The table's catalog entries as the proxy needs them: [`check_logged`],
/// [`check_columns`], [`check_key`], in that order.
async fn check_schema(
    conn: &mut Lent,
    store: &PostgresStore,
    table: &str,
) -> Result<(), SchemaProblem> {
    check_logged(conn, store, table).await?;
    check_columns(conn, store, table).await?;
    check_key(conn, store, table).await
}

/// The table is there (else `Missing`) and logged.
async fn check_logged(
    conn: &mut Lent,
    store: &PostgresStore,
    table: &str,
) -> Result<(), SchemaProblem> {
    let catalog = |e: StoreError| SchemaProblem::Unreachable(e);
    let exists = store
        .query(
            conn,
            "SELECT c.relpersistence::text FROM pg_class c WHERE c.oid = to_regclass($1::text)",
            &[&table],
        )
        .await
        .map_err(catalog)?;
    let Some(row) = exists.first() else {
        return Err(SchemaProblem::Missing(table.to_string()));
    };
    // An UNLOGGED table is emptied by a crash and not replicated: every
    // record would be lost, and retries run the operation again.
    let persistence: String = col(row, 0).map_err(catalog)?;
    if persistence != "p" {
        return Err(SchemaProblem::Different(format!(
            "the table \"{table}\" is not a logged table (relpersistence '{persistence}': \
             UNLOGGED or temporary, emptied by a crash and not replicated); make it logged \
             with `ALTER TABLE {table} SET LOGGED`"
        )));
    }
    Ok(())
}

/// The proxy's columns, of their types and not null; any other column
/// nullable or with a default.
async fn check_columns(
    conn: &mut Lent,
    store: &PostgresStore,
    table: &str,
) -> Result<(), SchemaProblem> {
    let catalog = |e: StoreError| SchemaProblem::Unreachable(e);
    let columns = "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), a.attnotnull, \
         a.atthasdef OR a.attidentity <> '' OR a.attgenerated <> '' \
         FROM pg_attribute a WHERE a.attrelid = to_regclass($1::text) AND a.attnum > 0 \
         AND NOT a.attisdropped ORDER BY a.attnum";
    let rows = store
        .query(conn, columns, &[&table])
        .await
        .map_err(catalog)?;
    let mut found: Vec<(String, String, bool, bool)> = Vec::with_capacity(rows.len());
    for r in &rows {
        found.push((
            col(r, 0).map_err(catalog)?,
            col(r, 1).map_err(catalog)?,
            col(r, 2).map_err(catalog)?,
            col(r, 3).map_err(catalog)?,
        ));
    }
    for (name, ty) in COLUMNS {
        match found.iter().find(|(n, ..)| n == name) {
            None => {
                return Err(SchemaProblem::Different(format!(
                    "the table \"{table}\" has no column \"{name}\""
                )))
            }
            Some((_, t, ..)) if t != ty => {
                return Err(SchemaProblem::Different(format!(
                    "the table \"{table}\"'s column \"{name}\" is {t}, not {ty}"
                )))
            }
            Some((_, _, false, _)) => {
                return Err(SchemaProblem::Different(format!(
                    "the table \"{table}\"'s column \"{name}\" may be null"
                )))
            }
            Some(_) => {}
        }
    }
    // Every other column: the inserts give it no value, so it must take
    // NULL or have a default.
    if let Some((extra, ..)) = found.iter().find(|(n, _, not_null, has_default)| {
        !COLUMNS.iter().any(|(c, _)| c == n) && *not_null && !*has_default
    }) {
        return Err(SchemaProblem::Different(format!(
            "the table \"{table}\" has a column \"{extra}\" that must be given a value"
        )));
    }
    Ok(())
}

/// A unique key the inserts' `ON CONFLICT (key)` can use.
async fn check_key(
    conn: &mut Lent,
    store: &PostgresStore,
    table: &str,
) -> Result<(), SchemaProblem> {
    let catalog = |e: StoreError| SchemaProblem::Unreachable(e);
    // The inserts name `ON CONFLICT (key)`: a valid unique index on the key alone.
    // A valid unique index on `key` alone, and none of them deferrable:
    // `ON CONFLICT (key)` takes every one as its arbiter, and refuses a
    // deferrable one.
    let keyed = "SELECT coalesce(bool_and(i.indimmediate), false) FROM pg_index i \
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
         WHERE i.indrelid = to_regclass($1::text) AND i.indisunique AND i.indnkeyatts = 1 \
         AND i.indisvalid AND i.indpred IS NULL AND a.attname = 'key'";
    let rows = store.query(conn, keyed, &[&table]).await.map_err(catalog)?;
    match rows.first().map(|r| col::<bool>(r, 0)) {
        Some(Ok(true)) => Ok(()),
        Some(Err(e)) => Err(catalog(e)),
        _ => Err(SchemaProblem::Different(format!(
            "the table \"{table}\" has no valid unique index on \"key\" alone, or one of \
             them is DEFERRABLE (ON CONFLICT cannot use a deferrable one)"
        ))),
    }
}

/// What `--init-store` did.
#[derive(Debug, PartialEq, Eq)]
pub enum Initialised {
    /// The table was missing: created.
    Created,
    /// The table was there, as the proxy needs it: nothing run.
    AlreadyThere,
}

/// How long `--init-store`'s DDL waits for a lock before it gives up.
const INIT_LOCK_TIMEOUT: &str = "2s";
/// How long each of its statements may run (not `op_timeout`: a lock
/// waited for is then reported as such).
const INIT_STATEMENT_TIMEOUT: &str = "10s";

/// `--init-store`: checks what is there first. A table as the proxy needs
/// it: nothing is run (no DDL, no lock on a live table). A table of that
/// name but another shape: an error, never altered. No table: the schema,
/// with the configured table's name, in one transaction that waits at most
/// [`INIT_LOCK_TIMEOUT`] for a lock; then checked.
pub async fn init_store(cfg: &StoreConfig) -> Result<Initialised, SchemaProblem> {
    let store = PostgresStore::new(cfg, 1)
        .map_err(|e| SchemaProblem::Unreachable(StoreError::Backend(e.to_string())))?;
    let mut conn = store.any_conn().await.map_err(SchemaProblem::Unreachable)?;
    match check_schema(&mut conn, &store, &cfg.table).await {
        Ok(()) => return Ok(Initialised::AlreadyThere),
        Err(SchemaProblem::Missing(_)) => {}
        Err(e) => return Err(e),
    }
    let ddl = format!(
        "BEGIN; SET LOCAL lock_timeout = '{INIT_LOCK_TIMEOUT}'; \
         SET LOCAL statement_timeout = '{INIT_STATEMENT_TIMEOUT}'; {}; COMMIT",
        SCHEMA.replace(SCHEMA_TABLE, &cfg.table)
    );
    let created = conn.client().batch_execute(&ddl).await;
    created.map_err(|e| SchemaProblem::Failed(store.error(e)))?;
    conn.healthy = true;
    check_schema(&mut conn, &store, &cfg.table).await?;
    Ok(Initialised::Created)
}
