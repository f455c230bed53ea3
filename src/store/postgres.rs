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

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod};
use tokio_postgres::error::SqlState;
use tokio_postgres::NoTls;

use super::{Completion, Held, Operations, StoreError, StoreSetupError, PIECE};
use crate::config::{SslMode, StoreConfig};
use crate::deadline::Deadlines;
use crate::record::{Token, TOKEN_RANGE};
use crate::workers::PerWorker;

/// The env var that carries the PostgreSQL password (wins over `password_file`).
pub const PASSWORD_ENV: &str = "IDEMPROXY_POSTGRES_PASSWORD";

/// The table's definition, as shipped; `--init-store` runs it with the
/// configured table name in place of [`SCHEMA_TABLE`].
pub const SCHEMA: &str = include_str!("../../deploy/postgres/schema.sql");
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

/// How many expired rows one sweep statement deletes at most.
pub const SWEEP_BATCH: i64 = 500;
/// How often each proxy sweeps expired rows.
pub const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// How often a reserve is sent again when it neither reserved nor found a
/// live holder (the key changed hands between its read and its write).
const RESERVE_TRIES: u32 = 3;

/// Milliseconds left until `expires_at`, on the server's clock, at least 0.
const MS_LEFT: &str = "greatest(0, ceil(extract(epoch from expires_at - now()) * 1000))::bigint";

/// The statements, with the table's name spelt in.
struct Statements {
    reserve: String,
    complete: String,
    renew: String,
    release: String,
    pttl: String,
    first: String,
    piece: String,
    check: String,
    delete: String,
    ping: String,
    sweep: String,
}

impl Statements {
    fn new(t: &str) -> Statements {
        let lease = "now() + $4::bigint * interval '1 millisecond'";
        // The completion writes whenever it conflicts (the same outcome
        // either way, so that `RETURNING` tells the truth of the row now);
        // it changes the row only when the key is free, expired, or our own
        // reservation. A finished record of ours is final.
        let ours_to_write =
            "(r.expires_at <= now() OR (r.token = excluded.token AND NOT r.finished))";
        let keep = |col: &str| {
            format!("{col} = CASE WHEN {ours_to_write} THEN excluded.{col} ELSE r.{col} END")
        };
        Statements {
            // `cur` reads the key (a snapshot); the insert runs only when no
            // live row is there, and takes over an expired one. A live row
            // that appeared after the snapshot makes the insert do nothing
            // and `cur` show nothing: no row back, and the caller sends the
            // reserve again (it then sees that row).
            reserve: format!(
                "WITH cur AS (SELECT value, expires_at FROM {t} WHERE key = $1::text), \
                 ins AS (INSERT INTO {t} AS r (key, value, token, finished, expires_at) \
                   SELECT $1::text, $2::bytea, $3::bytea, false, {lease} \
                   WHERE NOT EXISTS (SELECT 1 FROM cur WHERE cur.expires_at > now()) \
                   ON CONFLICT (key) DO UPDATE SET value = excluded.value, token = excluded.token, \
                     finished = false, expires_at = excluded.expires_at \
                   WHERE r.expires_at <= now() \
                   RETURNING 1) \
                 SELECT true, NULL::bytea, 0::bigint, 0::bigint FROM ins \
                 UNION ALL \
                 SELECT false, substring(value from 1 for $5::int), octet_length(value)::bigint, {MS_LEFT} \
                   FROM cur WHERE expires_at > now()"
            ),
            complete: format!(
                "WITH cur AS (SELECT token, expires_at > now() AS live FROM {t} WHERE key = $1::text), \
                 up AS (INSERT INTO {t} AS r (key, value, token, finished, expires_at) \
                   VALUES ($1::text, $2::bytea, $3::bytea, true, {lease}) \
                   ON CONFLICT (key) DO UPDATE SET {}, {}, {}, {} \
                   RETURNING r.token = $3::bytea AS ours) \
                 SELECT ours, coalesce((SELECT live AND token = $3::bytea FROM cur), false) FROM up",
                keep("value"),
                keep("token"),
                keep("finished"),
                keep("expires_at"),
            ),
            renew: format!(
                "UPDATE {t} SET expires_at = now() + $3::bigint * interval '1 millisecond' \
                 WHERE key = $1::text AND token = $2::bytea AND NOT finished AND expires_at > now()"
            ),
            release: format!(
                "DELETE FROM {t} \
                 WHERE key = $1::text AND token = $2::bytea AND NOT finished AND expires_at > now()"
            ),
            pttl: format!("SELECT {MS_LEFT} FROM {t} WHERE key = $1::text AND expires_at > now()"),
            first: format!(
                "SELECT octet_length(value)::bigint, {MS_LEFT}, substring(value from 1 for $2::int) \
                 FROM {t} WHERE key = $1::text AND expires_at > now()"
            ),
            piece: format!(
                "SELECT substring(value from $2::int for $3::int) \
                 FROM {t} WHERE key = $1::text AND expires_at > now()"
            ),
            check: format!(
                "SELECT octet_length(value)::bigint, token \
                 FROM {t} WHERE key = $1::text AND expires_at > now()"
            ),
            delete: format!("DELETE FROM {t} WHERE key = $1::text RETURNING expires_at > now()"),
            ping: format!("SELECT 1 FROM {t} LIMIT 0"),
            // Rows another proxy is deleting are skipped, not waited for.
            sweep: format!(
                "DELETE FROM {t} WHERE key IN (SELECT key FROM {t} WHERE expires_at <= now() \
                 LIMIT $1::bigint FOR UPDATE SKIP LOCKED) AND expires_at <= now()"
            ),
        }
    }
}

pub struct PostgresStore {
    /// A pool per worker thread (`runtime = "per_thread"`; one with work
    /// stealing): a connection's task runs on the runtime of the requests
    /// that use it, so that a statement's answer wakes no other thread.
    pools: PerWorker<Pool>,
    sql: Statements,
    table: String,
    op_timeout: Duration,
}

/// The password: `IDEMPROXY_POSTGRES_PASSWORD`, else `password_file`, else none (the URL may carry one).
fn password(cfg: &StoreConfig) -> Result<Option<String>, StoreSetupError> {
    match (std::env::var(PASSWORD_ENV), &cfg.password_file) {
        (Ok(p), _) if !p.is_empty() => Ok(Some(p)),
        (_, Some(path)) => std::fs::read_to_string(path)
            .map(|p| Some(p.trim_end_matches(['\r', '\n']).to_string()))
            .map_err(|source| StoreSetupError::PasswordFile {
                path: path.clone(),
                source,
            }),
        _ => Ok(None),
    }
}

/// The TLS connector: none with `disable`, or with `prefer` and no CA file;
/// otherwise rustls with the CA file's certificates as the only roots.
fn tls(
    cfg: &StoreConfig,
) -> Result<Option<tokio_postgres_rustls::MakeRustlsConnect>, StoreSetupError> {
    let Some(path) = cfg
        .tls_ca_file
        .as_ref()
        .filter(|_| cfg.sslmode != SslMode::Disable)
    else {
        return Ok(None);
    };
    let pem = std::fs::read(path).map_err(|source| StoreSetupError::CaFile {
        path: path.clone(),
        source,
    })?;
    let mut roots = rustls::RootCertStore::empty();
    let mut reader = &pem[..];
    let certs = rustls_pemfile_certs(&mut reader)
        .map_err(|e| StoreSetupError::Postgres(format!("the CA file {}: {e}", path.display())))?;
    for cert in certs {
        roots.add(cert).map_err(|e| {
            StoreSetupError::Postgres(format!("the CA file {}: {e}", path.display()))
        })?;
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| StoreSetupError::Postgres(e.to_string()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Some(tokio_postgres_rustls::MakeRustlsConnect::new(config)))
}

/// The certificates of a PEM file.
fn rustls_pemfile_certs(
    reader: &mut &[u8],
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
    use rustls::pki_types::pem::PemObject;
    let certs: Result<Vec<_>, _> =
        rustls::pki_types::CertificateDer::pem_slice_iter(reader).collect();
    match certs {
        Ok(c) if c.is_empty() => Err("no certificate in it".into()),
        Ok(c) => Ok(c),
        Err(e) => Err(e.to_string()),
    }
}

/// The client's configuration: the URL, with the password, `op_timeout` as
/// the connect timeout and as the server's `statement_timeout` (a statement
/// the proxy gave up on does not keep running), and the TLS mode.
pub fn client_config(cfg: &StoreConfig) -> Result<tokio_postgres::Config, StoreSetupError> {
    let mut pg: tokio_postgres::Config = cfg
        .url
        .parse()
        .map_err(|e| StoreSetupError::Postgres(format!("invalid PostgreSQL URL: {e}")))?;
    if let Some(p) = password(cfg)? {
        pg.password(p);
    }
    pg.connect_timeout(cfg.op_timeout.max(Duration::from_millis(100)));
    pg.application_name("idemproxy");
    // Added to the URL's own `options` (a `search_path`, say), not in their place.
    let ms = cfg.op_timeout.as_millis().max(1);
    let options = match pg.get_options() {
        Some(given) if !given.trim().is_empty() => format!("{given} -c statement_timeout={ms}"),
        _ => format!("-c statement_timeout={ms}"),
    };
    pg.options(options);
    pg.ssl_mode(match cfg.sslmode {
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer if cfg.tls_ca_file.is_some() => tokio_postgres::config::SslMode::Prefer,
        SslMode::Prefer => tokio_postgres::config::SslMode::Disable,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
            tokio_postgres::config::SslMode::Require
        }
    });
    Ok(pg)
}

/// A client error as a store error: a connection that is gone, a server
/// shutting down, starting up or read-only (a standby: a failover in
/// progress) is `Unavailable`; a statement the server cancelled at its
/// `statement_timeout` a `Timeout`; anything else a `Backend` error.
fn pg_error(e: tokio_postgres::Error, op_timeout: Duration) -> StoreError {
    let unavailable = [
        SqlState::READ_ONLY_SQL_TRANSACTION,
        SqlState::ADMIN_SHUTDOWN,
        SqlState::CRASH_SHUTDOWN,
        SqlState::CANNOT_CONNECT_NOW,
        SqlState::CONNECTION_EXCEPTION,
        SqlState::CONNECTION_FAILURE,
        SqlState::CONNECTION_DOES_NOT_EXIST,
        SqlState::SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
        SqlState::TOO_MANY_CONNECTIONS,
    ];
    match e.code() {
        Some(c) if *c == SqlState::QUERY_CANCELED => StoreError::Timeout(op_timeout),
        Some(c) if unavailable.contains(c) => StoreError::Unavailable(described(&e)),
        Some(_) => StoreError::Backend(described(&e)),
        None => StoreError::Unavailable(described(&e)),
    }
}

/// An error with its causes ("error performing TLS handshake: invalid peer
/// certificate: UnknownIssuer"): the client's own message alone hides them.
fn described(e: &tokio_postgres::Error) -> String {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
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
        let pg = client_config(cfg)?;
        let tls = tls(cfg)?;
        let per_slot = cfg.pool_size.div_ceil(slots.max(1)).max(1);
        let mut pools = Vec::with_capacity(slots.max(1));
        for _ in 0..slots.max(1) {
            let manager_config = ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            };
            let manager = match &tls {
                Some(tls) => Manager::from_config(pg.clone(), tls.clone(), manager_config),
                None => Manager::from_config(pg.clone(), NoTls, manager_config),
            };
            let pool = Pool::builder(manager)
                .max_size(per_slot)
                .runtime(deadpool_postgres::Runtime::Tokio1)
                // No wait timeout here: every operation is bounded by
                // `op_timeout` already (in `Store`), and a second timer per
                // operation would cost a timer-wheel entry each.
                .create_timeout(Some(cfg.op_timeout.max(Duration::from_millis(100))))
                .build()
                .map_err(|e| StoreSetupError::Postgres(e.to_string()))?;
            pools.push(pool);
        }
        let mut pools = pools.into_iter();
        Ok(PostgresStore {
            pools: PerWorker::new(slots, |_| pools.next().expect("a pool per slot")),
            sql: Statements::new(&cfg.table),
            table: cfg.table.clone(),
            op_timeout: cfg.op_timeout,
        })
    }

    fn error(&self, e: tokio_postgres::Error) -> StoreError {
        pg_error(e, self.op_timeout)
    }

    async fn conn(&self) -> Result<Lent, StoreError> {
        match self.pools.get().get().await {
            Ok(c) => Ok(Lent {
                client: Some(c),
                healthy: false,
            }),
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
                // An error the server sent leaves the connection usable.
                conn.healthy = e.code().is_some() && !client.is_closed();
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
                conn.healthy = e.code().is_some() && !client.is_closed();
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

    /// Deletes expired rows, [`SWEEP_BATCH`] at a time, each batch one
    /// statement (never one long transaction), until a batch comes back
    /// short; rows another proxy is deleting are skipped. How many went.
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let batch = async {
                let mut conn = self.conn().await?;
                self.execute(&mut conn, &self.sql.sweep, &[&SWEEP_BATCH])
                    .await
            };
            let n = tokio::time::timeout(self.op_timeout.max(Duration::from_secs(5)), batch)
                .await
                .map_err(|_| StoreError::Timeout(self.op_timeout))??;
            total += n;
            if n < SWEEP_BATCH as u64 {
                return Ok(total);
            }
            // Let the requests' statements in between batches.
            tokio::task::yield_now().await;
        }
    }

    /// The table as the proxy needs it: `Err(Missing)` when there is none,
    /// `Err(Different)` when its columns or its key differ. Compared with
    /// the catalog, on one connection of its own.
    pub async fn check_schema(&self) -> Result<(), SchemaProblem> {
        let bound = self.op_timeout.max(Duration::from_secs(2));
        let check = async {
            let mut conn = self.conn().await.map_err(SchemaProblem::Unreachable)?;
            check_schema(&mut conn, self, &self.table).await
        };
        tokio::time::timeout(bound, check)
            .await
            .unwrap_or(Err(SchemaProblem::Unreachable(StoreError::Timeout(bound))))
    }
}

/// What the start-up check (and `--init-store`) found wrong with the table.
#[derive(Debug)]
pub enum SchemaProblem {
    Unreachable(StoreError),
    Missing(String),
    Different(String),
}

impl std::fmt::Display for SchemaProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SchemaProblem::Unreachable(e) => write!(f, "PostgreSQL is unreachable: {e}"),
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

async fn check_schema(
    conn: &mut Lent,
    store: &PostgresStore,
    table: &str,
) -> Result<(), SchemaProblem> {
    let columns = "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), a.attnotnull \
         FROM pg_attribute a WHERE a.attrelid = to_regclass($1::text) AND a.attnum > 0 \
         AND NOT a.attisdropped ORDER BY a.attnum";
    let exists = store
        .query(conn, "SELECT to_regclass($1::text) IS NOT NULL", &[&table])
        .await
        .map_err(SchemaProblem::Unreachable)?;
    if !exists.first().is_some_and(|r| r.get::<_, bool>(0)) {
        return Err(SchemaProblem::Missing(table.to_string()));
    }
    let rows = store
        .query(conn, columns, &[&table])
        .await
        .map_err(SchemaProblem::Unreachable)?;
    let found: Vec<(String, String, bool)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    for (name, ty) in COLUMNS {
        match found.iter().find(|(n, _, _)| n == name) {
            None => {
                return Err(SchemaProblem::Different(format!(
                    "the table \"{table}\" has no column \"{name}\""
                )))
            }
            Some((_, t, _)) if t != ty => {
                return Err(SchemaProblem::Different(format!(
                    "the table \"{table}\"'s column \"{name}\" is {t}, not {ty}"
                )))
            }
            Some((_, _, false)) => {
                return Err(SchemaProblem::Different(format!(
                    "the table \"{table}\"'s column \"{name}\" may be null"
                )))
            }
            Some(_) => {}
        }
    }
    if let Some((extra, _, true)) = found
        .iter()
        .find(|(n, _, _)| !COLUMNS.iter().any(|(c, _)| c == n))
    {
        return Err(SchemaProblem::Different(format!(
            "the table \"{table}\" has a column \"{extra}\" that must be given a value"
        )));
    }
    // The inserts name `ON CONFLICT (key)`: a unique index on the key alone.
    let keyed = "SELECT EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a \
         ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
         WHERE i.indrelid = to_regclass($1::text) AND i.indisunique AND i.indnkeyatts = 1 \
         AND i.indpred IS NULL AND a.attname = 'key')";
    let rows = store
        .query(conn, keyed, &[&table])
        .await
        .map_err(SchemaProblem::Unreachable)?;
    if !rows.first().is_some_and(|r| r.get::<_, bool>(0)) {
        return Err(SchemaProblem::Different(format!(
            "the table \"{table}\" has no unique index on \"key\" alone"
        )));
    }
    Ok(())
}

/// `--init-store`: runs the schema with the configured table's name, then
/// checks what is there (a table of that name but another shape is not
/// altered: an error). Ok when the table is as the proxy needs it.
pub async fn init_store(cfg: &StoreConfig) -> Result<(), SchemaProblem> {
    let store = PostgresStore::new(cfg, 1)
        .map_err(|e| SchemaProblem::Unreachable(StoreError::Backend(e.to_string())))?;
    let mut conn = store.conn().await.map_err(SchemaProblem::Unreachable)?;
    let ddl = SCHEMA.replace(SCHEMA_TABLE, &cfg.table);
    // A table of that name but another shape: say so, before any DDL.
    match check_schema(&mut conn, &store, &cfg.table).await {
        Ok(()) | Err(SchemaProblem::Missing(_)) => {}
        Err(e) => return Err(e),
    }
    let created = conn.client().batch_execute(&ddl).await;
    created.map_err(|e| SchemaProblem::Unreachable(store.error(e)))?;
    conn.healthy = true;
    check_schema(&mut conn, &store, &cfg.table).await
}

/// Milliseconds as the statements take them.
fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

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
    ) -> Result<Option<Held>, StoreError> {
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
            if row.get::<_, bool>(0) {
                return Ok(None);
            }
            taken.store(true, Ordering::Relaxed);
            let start: Vec<u8> = row.get(1);
            let len: i64 = row.get(2);
            let left: i64 = row.get(3);
            if start.len() > inline as usize {
                return Err(StoreError::Untrue(format!(
                    "{} bytes for a reserve of at most {inline}",
                    start.len()
                )));
            }
            let len = len.max(0) as u64;
            return Ok(Some(if len == start.len() as u64 {
                Held::Value {
                    value: Bytes::from(start),
                    ttl: Some(Duration::from_millis(left.max(0) as u64)),
                }
            } else {
                Held::Large {
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
        Ok(rows.first().map_or(Duration::ZERO, |r| {
            Duration::from_millis(r.get::<_, i64>(0).max(0) as u64)
        }))
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
            Ok(match (row.get::<_, bool>(0), row.get::<_, bool>(1)) {
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
        let (len, left, first): (i64, i64, Vec<u8>) = (row.get(0), row.get(1), row.get(2));
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
                Some(r) => next = r.get(0),
                None => return Ok(None),
            }
        }
        let rows = Self::step(steps, self.query(&mut conn, &self.sql.check, &[&key])).await?;
        let same = rows.first().is_some_and(|r| {
            let (len_now, token): (i64, Vec<u8>) = (r.get(0), r.get(1));
            len_now as u64 == len && whole.get(TOKEN_RANGE) == Some(&token[..])
        });
        Ok(same.then(|| (whole.freeze(), ttl)))
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let mut conn = self.conn().await?;
        let rows = self.query(&mut conn, &self.sql.delete, &[&key]).await?;
        Ok(rows.iter().any(|r| r.get::<_, bool>(0)))
    }

    /// A statement on the table: the server answers, it is a primary (the
    /// URL's `target_session_attrs` picks one), and the table is there.
    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        self.query(&mut conn, &self.sql.ping, &[]).await?;
        Ok(())
    }
}
