//! The PostgreSQL store's connections: the client's configuration, TLS, and
//! the pools that connect host by host, each attempt bounded on its own.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tokio_postgres::NoTls;

use super::PASSWORD_ENV;
use crate::config::{SslMode, StoreConfig};
use crate::StoreSetupError;

/// TCP keepalives start after this much idleness; unacknowledged data
/// closes a connection after as long.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);

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
    let (_, certs) = crate::settings::ca_file(path)?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in certs {
        roots.add(cert).map_err(|e| StoreSetupError::CaInvalid {
            path: path.clone(),
            problem: e.to_string(),
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

/// The client's configuration: the URL, with the password, `op_timeout` as
/// the connect timeout and as the server's `statement_timeout` (a statement
/// the proxy gave up on does not keep running), and the TLS mode.
pub fn client_config(cfg: &StoreConfig) -> Result<tokio_postgres::Config, StoreSetupError> {
    let mut pg: tokio_postgres::Config = cfg
        .url
        .parse()
        .map_err(|e| StoreSetupError::Postgres(format!("invalid PostgreSQL URL: {e}")))?;
    if let Some(p) = crate::settings::password(cfg, PASSWORD_ENV)? {
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
    pub(super) static REFUSED: Cell<bool>;
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

/// The pools, one per worker slot (`slots`, at least one), built without
/// connecting: `pool_size` is shared out among them, at least one
/// connection each.
pub(super) fn pools(cfg: &StoreConfig, slots: usize) -> Result<Vec<Pool>, StoreSetupError> {
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
    Ok(pools)
}
