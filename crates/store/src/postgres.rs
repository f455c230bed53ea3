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

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tokio_postgres::error::SqlState;
use tokio_postgres::NoTls;

use super::{Completion, Occupant, Operations, StoreError, StoreSetupError, PIECE};
use crate::config::{SslMode, StoreConfig};
use crate::deadline::Deadlines;
use crate::per_worker::PerWorker;
use crate::record::{Token, TOKEN_RANGE};

/// The env var that carries the PostgreSQL password (wins over `password_file`).
pub const PASSWORD_ENV: &str = "IDEMPROXY_POSTGRES_PASSWORD";

/// The table's definition, as shipped; `--init-store` runs it with the
/// configured table name in place of [`SCHEMA_TABLE`].
pub const SCHEMA: &str = include_str!("../../../deploy/postgres/schema.sql");
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
/// How long one sweep batch may run on the server (its own statement
/// timeout; a request's statements have `op_timeout`).
pub const SWEEP_TIMEOUT: Duration = Duration::from_secs(5);
/// TCP keepalives start after this much idleness; unacknowledged data
/// closes a connection after as long.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
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
    take_over: String,
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
            // A vanished owner's reservation whose lease ran out: no more
            // than its afterlife ($7) left, on the server's clock. A row
            // that holds the taker's token already was taken by this same
            // statement, sent twice (the outer read sees the row as it was
            // before the update).
            take_over: format!(
                "WITH up AS (UPDATE {t} SET value = $2::bytea, token = $3::bytea, \
                   finished = $4::boolean, expires_at = now() + $5::bigint * interval '1 millisecond' \
                   WHERE key = $1::text AND token = $6::bytea AND NOT finished AND expires_at > now() \
                     AND expires_at <= now() + $7::bigint * interval '1 millisecond' \
                   RETURNING 1) \
                 SELECT EXISTS (SELECT 1 FROM up) \
                   OR EXISTS (SELECT 1 FROM {t} WHERE key = $1::text AND token = $3::bytea \
                     AND expires_at > now())"
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
            // Writable (not a standby, not read-only by default), and the table there.
            ping: format!(
                "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off' \
                 FROM (SELECT 1) one LEFT JOIN (SELECT 1 FROM {t} LIMIT 0) t ON true"
            ),
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
    if let Some(p) = super::settings::password(cfg, PASSWORD_ENV)? {
        pg.password(p);
    }
    pg.connect_timeout(cfg.op_timeout.max(Duration::from_millis(100)));
    // A server gone without a word (a host down, a network cut) is noticed
    // on an idle connection by keepalives, and on a busy one when what was
    // sent stays unacknowledged.
    pg.keepalives(true)
        .keepalives_idle(KEEPALIVE_IDLE)
        .keepalives_interval(Duration::from_secs(2))
        .keepalives_retries(3)
        .tcp_user_timeout(KEEPALIVE_IDLE);
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

/// The URL's hosts, one [`tokio_postgres::Config`] each (its `hostaddr` and
/// port with it; everything else the same).
fn hosts_of(pg: &tokio_postgres::Config) -> Vec<tokio_postgres::Config> {
    use tokio_postgres::config::Host;
    let n = pg.get_hosts().len().max(pg.get_hostaddrs().len());
    (0..n)
        .map(|i| {
            let mut one = tokio_postgres::Config::new();
            if let Some(u) = pg.get_user() {
                one.user(u);
            }
            if let Some(p) = pg.get_password() {
                one.password(p);
            }
            if let Some(d) = pg.get_dbname() {
                one.dbname(d);
            }
            if let Some(o) = pg.get_options() {
                one.options(o);
            }
            if let Some(a) = pg.get_application_name() {
                one.application_name(a);
            }
            one.ssl_mode(pg.get_ssl_mode())
                .ssl_negotiation(pg.get_ssl_negotiation())
                .keepalives(pg.get_keepalives())
                .keepalives_idle(pg.get_keepalives_idle())
                .target_session_attrs(pg.get_target_session_attrs())
                .channel_binding(pg.get_channel_binding());
            if let Some(t) = pg.get_connect_timeout() {
                one.connect_timeout(*t);
            }
            if let Some(t) = pg.get_tcp_user_timeout() {
                one.tcp_user_timeout(*t);
            }
            if let Some(t) = pg.get_keepalives_interval() {
                one.keepalives_interval(t);
            }
            if let Some(r) = pg.get_keepalives_retries() {
                one.keepalives_retries(r);
            }
            match pg.get_hosts().get(i) {
                Some(Host::Tcp(h)) => {
                    one.host(h);
                }
                Some(Host::Unix(p)) => {
                    one.host_path(p);
                }
                None => {}
            }
            if let Some(a) = pg.get_hostaddrs().get(i) {
                one.hostaddr(*a);
            }
            if let Some(port) = pg.get_ports().get(i).or(pg.get_ports().first()) {
                one.port(*port);
            }
            one
        })
        .collect()
}

/// How the pools connect: host by host, each attempt (TCP, TLS, the
/// start-up, the read-write check of `target_session_attrs`) bounded on its
/// own, so that a host that accepts connections and never answers (a frozen
/// server) costs one attempt, not every connection. The client's own
/// multi-host connect bounds only the TCP connect of each host.
///
/// The walk runs in a task of its own: a request that gives up on its
/// connection does not stop it, so a hung first host is passed over and
/// the host that answered is remembered; the next connections start there.
///
/// A pool has at most its size of walks in flight: each holds a permit of
/// `attempts` until it ends. Without that bound, a request that gave up
/// freed its pool slot while its walk went on, and the next request started
/// another: while logins were slower than `op_timeout`, the attempts in
/// flight grew with the request rate (each one a backend forked on the
/// server) until the server ran out of `max_connections`. With no permit
/// free, `connect` fails at once (a 503, as a timeout would give) and no
/// walk starts. So a pool has at most its size of connections and as many
/// attempts again.
///
/// A walk that connects after its request gave up keeps the connection, with
/// its permit, for the pool's next `connect`, which takes it without
/// connecting. (deadpool's managed pool cannot be handed a connection made
/// outside its `get`, so it waits here rather than in the pool.)
struct HostByHost<T> {
    tls: T,
    per_host: Duration,
    /// The index of the host to try first: the last that answered as asked
    /// (or the one after the last that did not).
    first: Arc<AtomicUsize>,
    /// A permit per walk in flight or connection waiting in `spare`.
    attempts: Arc<Semaphore>,
    /// Connections made after their request had given up.
    spare: Arc<Mutex<Vec<Spare>>>,
}

/// A new connection: the client and the task that runs its connection.
type Connected = (tokio_postgres::Client, tokio::task::JoinHandle<()>);

/// A connection no request took yet, and its attempt's permit.
type Spare = (Connected, OwnedSemaphorePermit);

tokio::task_local! {
    /// Set by [`HostByHost::connect`] when it refused to start a walk (every
    /// permit held), for [`PostgresStore::conn`] to say so: the client's
    /// error type has no constructor for a message of ours.
    static REFUSED: Cell<bool>;
}

impl<T> HostByHost<T> {
    /// `attempts`: the walks in flight at most (the pool's size).
    fn new(tls: T, per_host: Duration, first: &Arc<AtomicUsize>, attempts: usize) -> Self {
        HostByHost {
            tls,
            per_host,
            first: first.clone(),
            attempts: Arc::new(Semaphore::new(attempts)),
            spare: Arc::default(),
        }
    }

    /// A spare connection still open, if any (its permit is given back: it
    /// is the pool's now).
    fn take_spare(&self) -> Option<Connected> {
        loop {
            let (conn, _permit) = self.spare.lock().expect("spare connections").pop()?;
            if !conn.0.is_closed() {
                return Some(conn);
            }
        }
    }
}

impl<T> deadpool_postgres::Connect for HostByHost<T>
where
    T: tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket> + Clone + Sync + Send + 'static,
    T::Stream: Sync + Send,
    T::TlsConnect: Sync + Send,
    <T::TlsConnect as tokio_postgres::tls::TlsConnect<tokio_postgres::Socket>>::Future: Send,
{
    fn connect(
        &self,
        pg: &tokio_postgres::Config,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<
                    Output = Result<
                        (tokio_postgres::Client, tokio::task::JoinHandle<()>),
                        tokio_postgres::Error,
                    >,
                > + Send
                + '_,
        >,
    > {
        if let Some(conn) = self.take_spare() {
            return Box::pin(async move { Ok(conn) });
        }
        let Ok(permit) = self.attempts.clone().try_acquire_owned() else {
            let _ = REFUSED.try_with(|r| r.set(true));
            return Box::pin(async { Err(tokio_postgres::Error::__private_api_timeout()) });
        };
        let mut hosts = hosts_of(pg);
        if hosts.is_empty() {
            // No host at all: the client's own connect says what is wrong.
            hosts.push(pg.clone());
        }
        let tls = self.tls.clone();
        let per_host = self.per_host;
        let first = self.first.clone();
        let spare = self.spare.clone();
        let (done, walked) = oneshot::channel::<Result<Connected, tokio_postgres::Error>>();
        let walk = async move {
            let n = hosts.len().max(1);
            let start = first.load(Ordering::Relaxed);
            let mut last = None;
            for k in 0..hosts.len() {
                let i = (start + k) % n;
                match tokio::time::timeout(per_host, hosts[i].connect(tls.clone())).await {
                    Ok(Ok((client, connection))) => {
                        first.store(i, Ordering::Relaxed);
                        let task = tokio::spawn(async move {
                            if let Err(e) = connection.await {
                                tracing::debug!(error = %e, "a PostgreSQL connection ended");
                            }
                        });
                        return Ok((client, task));
                    }
                    Ok(Err(e)) => last = Some(e),
                    Err(_) => last = Some(tokio_postgres::Error::__private_api_timeout()),
                }
                first.store((i + 1) % n, Ordering::Relaxed);
            }
            Err(last.unwrap_or_else(tokio_postgres::Error::__private_api_timeout))
        };
        tokio::spawn(async move {
            if let Err(Ok(conn)) = done.send(walk.await) {
                // Its request gave up: the next one takes it.
                spare
                    .lock()
                    .expect("spare connections")
                    .push((conn, permit));
            }
            // Otherwise the permit is given back here, as the walk ends.
        });
        Box::pin(async move {
            walked
                .await
                .unwrap_or_else(|_| Err(tokio_postgres::Error::__private_api_timeout()))
        })
    }
}

/// A client error as a store error: a connection that is gone, a server
/// shutting down, starting up or read-only (a standby: a failover in
/// progress) is `Unavailable`; a statement the server cancelled at its
/// `statement_timeout` a `Timeout`; anything else a `Backend` error.
fn pg_error(e: tokio_postgres::Error, op_timeout: Duration) -> StoreError {
    match e.code() {
        Some(c) if *c == SqlState::QUERY_CANCELED => StoreError::Timeout(op_timeout),
        Some(c) if UNAVAILABLE.contains(c) => StoreError::Unavailable(described(&e)),
        Some(_) => StoreError::Backend(described(&e)),
        None => StoreError::Unavailable(described(&e)),
    }
}

/// Does the connection stay in the pool after `e`? Only when the server
/// answered with an error of the statement: not when the connection broke,
/// nor when the server is read-only (a standby, or a fenced old primary: a
/// new connection finds the primary), shutting down or refusing.
fn keeps_connection(e: &tokio_postgres::Error, client: &tokio_postgres::Client) -> bool {
    e.code().is_some_and(|c| !UNAVAILABLE.contains(c)) && !client.is_closed()
}

/// The server errors that say "not here, not now": the store is unavailable
/// (a failover in progress), and the connection is not used again.
const UNAVAILABLE: [SqlState; 9] = [
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
        // Each host's attempt (TCP, TLS, start-up, the read-write check)
        // has this long; the host to try first is shared by the pools.
        let per_host = cfg.op_timeout.max(Duration::from_millis(100));
        let first = Arc::new(AtomicUsize::new(0));
        let mut pools = Vec::with_capacity(slots.max(1));
        for _ in 0..slots.max(1) {
            let manager_config = ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            };
            let manager = match &tls {
                Some(tls) => Manager::from_connect(
                    pg.clone(),
                    HostByHost::new(tls.clone(), per_host, &first, per_slot),
                    manager_config,
                ),
                None => Manager::from_connect(
                    pg.clone(),
                    HostByHost::new(NoTls, per_host, &first, per_slot),
                    manager_config,
                ),
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

    /// Deletes expired rows, [`SWEEP_BATCH`] at a time, each batch one
    /// statement in a transaction of its own (never one long transaction)
    /// with its own statement timeout ([`SWEEP_TIMEOUT`], not `op_timeout`:
    /// deleting large rows takes longer than a request's statement), until
    /// a batch comes back short; rows another proxy is deleting are skipped.
    /// A batch that times out is tried again at half the size, down to one
    /// row: large rows are deleted a few at a time rather than never. How
    /// many went; an error when even one row could not be deleted in time.
    pub async fn sweep(&self) -> Result<u64, StoreError> {
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
    pub fn table_ok(&self) -> bool {
        self.checked.load(Ordering::Acquire)
    }

    /// The table's check again, while the proxy runs (before each sweep): a
    /// table altered to UNLOGGED, or that lost its unique key, is emptied by
    /// a crash or takes a key twice, so from then on no request's statement
    /// is sent (new keys 503, the proxy not ready) until the ping's check
    /// finds it right again. A PostgreSQL that does not answer is an outage,
    /// not a table problem: nothing changes for it.
    pub async fn recheck(&self) {
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
    pub async fn check_pending(&self) -> Result<(), StoreError> {
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
pub fn durable_commit(synchronous_commit: &str) -> bool {
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

async fn check_schema(
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
