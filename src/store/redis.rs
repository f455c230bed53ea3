//! The Redis store: standalone, Sentinel or Cluster behind one connection type
//! (our own [`Wire`] over plain TCP, redis-rs's connections otherwise).
//! A reserve is two plain commands in one write (`SET NX PX`, `GETRANGE`);
//! the owner-checked writes are small Lua scripts beside this file
//! (complete, renew, release, a large record's pieces); the rest are plain
//! reads. Every operation touches one key.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, LazyLock, Mutex, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{IntoConnectionInfo, Pipeline, Script, TlsCertificates, Value};
use tracing::{info, warn};

use super::cluster::ClusterNodes;
use super::conn::{command, ms, run_script, Conn};
use super::pieces::{self, Step};
use super::wire::{digits, pack, Wire};
use super::{Completion, Held, Operations, StoreError, StoreSetupError};
use crate::config::{RedisMode, StoreConfig};
use crate::deadline::Deadlines;
use crate::record::Token;
use crate::workers::PerWorker;

static COMPLETE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("complete.lua")));
static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("renew.lua")));
static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("release.lua")));

/// The env var that carries the Redis password (wins over `password_file`).
pub const PASSWORD_ENV: &str = "IDEMPROXY_REDIS_PASSWORD";

/// After this many store failures in a row (timeouts, broken or refused
/// connections, a demoted master) the connection is made anew: a blackholed
/// TCP connection never errors by itself, the client reconnects only on I/O
/// errors, and after a Sentinel failover the master has moved. A cluster
/// connection is replaced only once a new one is up (see [`ClusterNodes`]).
const FAILURES_BEFORE_RECONNECT: u32 = 2;

/// Takes a slot's connection (the next operation on that worker connects);
/// whether there was one. Operations under way finish on the one taken.
fn take_conn(slot: &Slot) -> bool {
    let taken = slot.conn.write().unwrap_or_else(|e| e.into_inner()).take();
    taken.is_some()
}

/// At most one cluster reconnect per this long: while a master fails over,
/// its keys fail for seconds, and each reconnect opens a connection per node.
const CLUSTER_RECONNECT_SPACING: Duration = Duration::from_secs(1);

/// One connection and what keeps it.
#[derive(Default)]
struct Slot {
    /// `None` until the first operation, and (standalone, Sentinel) after a
    /// connection was given up. Shared with a cluster reconnect running in the background.
    conn: Arc<RwLock<Option<Conn>>>,
    /// One connect at a time; the others wait for its result.
    connecting: tokio::sync::Mutex<()>,
    failures_in_a_row: AtomicU32,
}

/// Where connections come from.
enum Source {
    Standalone {
        client: redis::Client,
        config: ConnectionManagerConfig,
    },
    /// The master is asked of the sentinels on every (re)connect.
    Sentinel {
        sentinel: tokio::sync::Mutex<SentinelClient>,
        config: ConnectionManagerConfig,
    },
    Cluster(Arc<ClusterNodes>),
}

pub struct RedisStore {
    source: Source,
    /// The connections: one per worker thread for a standalone server or
    /// Sentinel's master (`crate::workers`: a request's round trips then wake
    /// no other thread), one for every thread in a cluster (redis-rs's
    /// cluster connection already holds one per node).
    slots: PerWorker<Slot>,
    /// An operation failed since the store last answered on any slot: the
    /// next answer looks at the other slots' connections (`answered_again`).
    failing: AtomicBool,
    op_timeout: Duration,
    wait_replicas: u32,
    wait_timeout: Duration,
    /// The durability check ran (it runs once, after the first answer).
    checked: AtomicBool,
    /// Standalone and Sentinel: when a connect failed, the next waits.
    backoff: Mutex<Backoff>,
}

/// After a connect that failed (refused, a wrong password, no master named),
/// operations fail at once with its error until the next attempt is due: a
/// store that is down is not asked again (nor the sentinels) by every
/// request. 50 ms after the first failure, doubling to 1 s; reset by a success.
struct Backoff {
    until: Option<Instant>,
    delay: Duration,
    why: String,
}

const FIRST_RETRY: Duration = Duration::from_millis(50);
const LAST_RETRY: Duration = Duration::from_secs(1);

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            until: None,
            delay: FIRST_RETRY,
            why: String::new(),
        }
    }
}

fn setup(e: impl std::fmt::Display) -> StoreSetupError {
    StoreSetupError::Redis(e.to_string())
}

/// The password: `IDEMPROXY_REDIS_PASSWORD`, else `password_file`, else none (a URL may carry one).
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

fn tls_certs(cfg: &StoreConfig) -> Result<Option<TlsCertificates>, StoreSetupError> {
    match &cfg.tls_ca_file {
        None => Ok(None),
        Some(path) => std::fs::read(path)
            .map(|pem| {
                Some(TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                })
            })
            .map_err(|source| StoreSetupError::CaFile {
                path: path.clone(),
                source,
            }),
    }
}

/// Connection info for one URL with the configured user and password applied.
pub(super) fn connection_info(
    url: &str,
    user: Option<&str>,
    password: Option<&str>,
) -> Result<redis::ConnectionInfo, StoreSetupError> {
    let info = url
        .into_connection_info()
        .map_err(|e| setup(format!("invalid Redis URL: {e}")))?;
    let mut settings = info.redis_settings().clone();
    if let Some(u) = user {
        settings = settings.set_username(u);
    }
    if let Some(p) = password {
        settings = settings.set_password(p);
    }
    Ok(info.set_redis_settings(settings))
}

/// A reply, for an error message: its kind and size, never its bytes (a
/// store that lies can send megabytes, and the message is logged).
fn described(v: &Value) -> String {
    match v {
        Value::BulkString(b) => format!("a bulk string of {} bytes", b.len()),
        Value::SimpleString(s) => format!("a status of {} bytes", s.len()),
        Value::Array(a) => format!("an array of {} values", a.len()),
        Value::ServerError(e) => format!("an error ({})", e.code()),
        Value::Nil | Value::Okay | Value::Int(_) => format!("{v:?}"),
        _ => "a reply of an unexpected kind".to_string(),
    }
}

/// How often a reserve is sent when the key it found taken is gone by the
/// time it is read, before what is there is taken as the answer.
const RESERVE_TRIES: u32 = 3;

/// Sends a reserve in one write: `SET key value NX PX lease`, then
/// `GETRANGE key 0 inline-1` (at most `inline` bytes: no more than the room
/// the caller holds for the answer); the two answers. On our own connection the
/// commands are packed straight into its output, without `Cmd`s.
async fn send_reserve(
    conn: &mut Conn,
    key: &str,
    value: &[u8],
    lease: Duration,
    inline: u64,
) -> redis::RedisResult<(Value, Value)> {
    let (mut ms_digits, mut last_digits) = ([0; 20], [0; 20]);
    let lease = digits(ms(lease), &mut ms_digits);
    // `GETRANGE key 0 -1` would be the whole value: never below one byte.
    let last = digits(inline.max(1) - 1, &mut last_digits);
    let key = key.as_bytes();
    let set: [&[u8]; 6] = [b"SET", key, value, b"NX", b"PX", lease];
    let getrange: [&[u8]; 4] = [b"GETRANGE", key, b"0", last];
    let mut answers = match conn {
        Conn::Wire(wire) => {
            let write = |out: &mut Vec<u8>| {
                pack(out, &set);
                pack(out, &getrange);
            };
            wire.commands(write, 2).await?
        }
        other => {
            let mut pipe = Pipeline::with_capacity(2);
            pipe.add_command(command(&set))
                .add_command(command(&getrange));
            pipe.query_async(other).await?
        }
    };
    match (answers.pop(), answers.pop(), answers.is_empty()) {
        (Some(head), Some(set), true) => Ok((set, head)),
        _ => Err((redis::ErrorKind::Client, "a reserve without two answers").into()),
    }
}

impl RedisStore {
    /// Builds the client without connecting: an unreachable store is not a
    /// start-up failure. `slots`: per-worker places for connections.
    pub fn new(cfg: &StoreConfig, slots: usize) -> Result<Self, StoreSetupError> {
        // rustls needs a process-wide crypto provider; a second install is a no-op error.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let password = password(cfg)?;
        let certs = tls_certs(cfg)?;
        let user = cfg.username.as_deref();
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(cfg.op_timeout))
            // Every operation is bounded by `op_timeout` in `Store` already: a
            // second timer per command here would cost a timer-wheel entry each.
            .set_response_timeout(None)
            .set_max_delay(Duration::from_secs(1));
        let source = match cfg.mode {
            RedisMode::Standalone => {
                let info = connection_info(&cfg.url, user, password.as_deref())?;
                let client = match certs {
                    Some(c) => redis::Client::build_with_tls(info, c),
                    None => redis::Client::open(info),
                }
                .map_err(setup)?;
                Source::Standalone {
                    client,
                    config: manager_config,
                }
            }
            RedisMode::Sentinel => {
                let master = cfg
                    .master_name
                    .clone()
                    .ok_or_else(|| setup("sentinel mode needs master_name"))?;
                // The master's own settings (user, password, db) come from `url`.
                let master_info = connection_info(&cfg.url, user, password.as_deref())?;
                let node = SentinelNodeConnectionInfo::default()
                    .set_redis_connection_info(master_info.redis_settings().clone());
                let sentinels: Vec<redis::ConnectionInfo> = cfg
                    .sentinels
                    .iter()
                    .map(|u| connection_info(u, None, None))
                    .collect::<Result<_, _>>()?;
                let sentinel = SentinelClient::build(
                    sentinels,
                    master,
                    Some(node),
                    SentinelServerType::Master,
                )
                .map_err(setup)?;
                Source::Sentinel {
                    sentinel: tokio::sync::Mutex::new(sentinel),
                    config: manager_config,
                }
            }
            RedisMode::Cluster => {
                let seeds: Vec<redis::ConnectionInfo> = cfg
                    .nodes
                    .iter()
                    .map(|u| connection_info(u, user, password.as_deref()))
                    .collect::<Result<_, _>>()?;
                let nodes = ClusterNodes {
                    seeds,
                    learned: Mutex::new(Vec::new()),
                    op_timeout: cfg.op_timeout,
                    certs,
                    reconnecting: AtomicBool::new(false),
                    last_reconnect: Mutex::new(None),
                };
                // Built once here so that a bad seed list is a start-up error.
                nodes.client(nodes.seeds.clone()).map_err(setup)?;
                Source::Cluster(Arc::new(nodes))
            }
        };
        let slots = match &source {
            Source::Cluster(_) => 1,
            _ => slots,
        };
        Ok(RedisStore {
            source,
            slots: PerWorker::new(slots, |_| Slot::default()),
            failing: AtomicBool::new(false),
            op_timeout: cfg.op_timeout,
            wait_replicas: cfg.wait_replicas,
            wait_timeout: cfg.wait_timeout,
            checked: AtomicBool::new(false),
            backoff: Mutex::new(Backoff::default()),
        })
    }

    /// A client error as a store error; the client's own response timeout counts as a timeout.
    /// (The crate's messages can carry addresses: callers log them, problems never show them.)
    fn backend(&self, e: redis::RedisError) -> StoreError {
        use redis::{ErrorKind, ServerErrorKind};
        let broken = e.is_io_error()
            || e.is_connection_refusal()
            || e.is_connection_dropped()
            || matches!(
                e.kind(),
                ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
            );
        if e.is_timeout() {
            StoreError::Timeout(self.op_timeout)
        } else if broken {
            StoreError::Unavailable(e.to_string())
        } else {
            StoreError::Backend(e.to_string())
        }
    }

    /// This thread's connection (a cheap handle), connecting first when there
    /// is none or when ours broke.
    async fn conn(&self) -> Result<Conn, StoreError> {
        match self.usable() {
            Some(c) => Ok(c),
            // Boxed: connecting's state (~3 KiB) would otherwise be part of
            // every operation's future, and copied with it on every call.
            None => Box::pin(self.connect()).await,
        }
    }

    /// A new connection, one connect at a time (unless another connect
    /// finished meanwhile), after the back-off of a failed one.
    async fn connect(&self) -> Result<Conn, StoreError> {
        let slot = self.slots.get();
        let _one_at_a_time = slot.connecting.lock().await;
        if let Some(c) = self.usable() {
            return Ok(c);
        }
        // Taken out, so that it is logged once, not by every operation while
        // Redis stays away.
        let broken = {
            let mut held = slot.conn.write().unwrap_or_else(|e| e.into_inner());
            match held.as_ref() {
                Some(Conn::Wire(w)) if w.is_broken() => held.take(),
                _ => None,
            }
        };
        if let Some(Conn::Wire(w)) = broken {
            warn!(
                error = w.failure(),
                "the store connection broke; connecting again"
            );
        }
        let fresh = match &self.source {
            Source::Cluster(nodes) => {
                Conn::Cluster(nodes.connect().await.map_err(|e| self.backend(e))?)
            }
            single => {
                self.backing_off()?;
                let fresh = self.connect_single(single).await;
                self.note_connect(&fresh);
                fresh?
            }
        };
        *slot.conn.write().unwrap_or_else(|e| e.into_inner()) = Some(fresh.clone());
        Ok(fresh)
    }

    async fn connect_single(&self, source: &Source) -> Result<Conn, StoreError> {
        match source {
            Source::Standalone { client, config } => {
                self.single(client.clone(), config.clone()).await
            }
            Source::Sentinel { sentinel, config } => {
                let client = sentinel
                    .lock()
                    .await
                    .async_get_client()
                    .await
                    .map_err(|e| self.backend(e))?;
                info!(master = ?client.get_connection_info().addr(), "sentinel named the master");
                self.single(client, config.clone()).await
            }
            Source::Cluster(_) => Err(StoreError::Backend("a cluster has no single node".into())),
        }
    }

    /// The last connect's error while the next attempt is not yet due.
    fn backing_off(&self) -> Result<(), StoreError> {
        let backoff = self.backoff.lock().unwrap_or_else(|e| e.into_inner());
        match backoff.until {
            Some(until) if Instant::now() < until => Err(StoreError::Unavailable(format!(
                "{} (the next connect in {} ms)",
                backoff.why,
                until.saturating_duration_since(Instant::now()).as_millis()
            ))),
            _ => Ok(()),
        }
    }

    fn note_connect(&self, result: &Result<Conn, StoreError>) {
        let mut backoff = self.backoff.lock().unwrap_or_else(|e| e.into_inner());
        match result {
            Ok(_) => *backoff = Backoff::default(),
            Err(e) => {
                backoff.until = Some(Instant::now() + backoff.delay);
                backoff.delay = (backoff.delay * 2).min(LAST_RETRY);
                backoff.why = match e {
                    StoreError::Unavailable(why) | StoreError::Backend(why) => why.clone(),
                    other => other.to_string(),
                };
            }
        }
    }

    /// The current connection, unless there is none or it is one of ours that broke.
    fn usable(&self) -> Option<Conn> {
        let slot = self.slots.get();
        match slot.conn.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
            Some(Conn::Wire(w)) if w.is_broken() => None,
            other => other.cloned(),
        }
    }

    /// A standalone server or Sentinel's master: our own connection over
    /// plain TCP (connected now, within `op_timeout`), redis-rs's otherwise
    /// (connected by its first command).
    async fn single(
        &self,
        client: redis::Client,
        config: ConnectionManagerConfig,
    ) -> Result<Conn, StoreError> {
        let wire =
            tokio::time::timeout(self.op_timeout, Wire::connect(client.get_connection_info()))
                .await
                .map_err(|_| StoreError::Timeout(self.op_timeout))?;
        match wire.map_err(|e| self.backend(e))? {
            Some(w) => Ok(Conn::Wire(w)),
            None => Ok(Conn::Single(
                ConnectionManager::new_lazy_with_config(client, config)
                    .map_err(|e| self.backend(e))?,
            )),
        }
    }

    /// Told after every operation whether the store failed; gives up a connection that keeps failing.
    pub fn note_result(&self, failed: bool) {
        let slot = self.slots.get();
        if !failed {
            // Read first: most operations succeed, and a store to the line would dirty it.
            if slot.failures_in_a_row.load(Ordering::Relaxed) != 0 {
                slot.failures_in_a_row.store(0, Ordering::Relaxed);
            }
            if self.failing.load(Ordering::Acquire) {
                self.answered_again(slot);
            }
            return;
        }
        let failures = slot.failures_in_a_row.fetch_add(1, Ordering::Relaxed) + 1;
        // After the count: an answer that sees the flag sees the count.
        if !self.failing.load(Ordering::Relaxed) {
            self.failing.store(true, Ordering::Release);
        }
        if failures < FAILURES_BEFORE_RECONNECT {
            return;
        }
        slot.failures_in_a_row.store(0, Ordering::Relaxed);
        if let Source::Cluster(nodes) = &self.source {
            self.reconnect_cluster(nodes, slot);
            return;
        }
        if take_conn(slot) {
            warn!("store keeps failing; the connection will be made anew");
        }
    }

    /// The store answered on `slot`'s connection while another worker's last
    /// operation had failed: that worker's connection, not the store, is the
    /// likely fault (one that sent during a blackhole stays held by it), so
    /// it is made anew now rather than after one more failed request.
    fn answered_again(&self, slot: &Slot) {
        self.failing.store(false, Ordering::Relaxed);
        let mut given_up = 0;
        for other in self.slots.all() {
            if !std::ptr::eq(other, slot) && other.failures_in_a_row.swap(0, Ordering::Relaxed) != 0
            {
                given_up += usize::from(take_conn(other));
            }
        }
        if given_up > 0 {
            warn!(
                connections = given_up,
                "the store answers again; connections that failed before will be made anew"
            );
        }
    }

    /// Makes a new cluster connection in the background, through every node
    /// known, and swaps it in once it is up; until then, and if it fails, the
    /// current one (which keeps healing itself) stays in use.
    fn reconnect_cluster(&self, nodes: &Arc<ClusterNodes>, slot: &Slot) {
        if slot
            .conn
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
        {
            // Nothing to replace: the next operation connects.
            return;
        }
        {
            let mut last = nodes
                .last_reconnect
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|t| t.elapsed() < CLUSTER_RECONNECT_SPACING)
                || nodes.reconnecting.swap(true, Ordering::AcqRel)
            {
                return;
            }
            *last = Some(Instant::now());
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            nodes.reconnecting.store(false, Ordering::Release);
            return;
        };
        let (nodes, slot) = (nodes.clone(), slot.conn.clone());
        runtime.spawn(async move {
            match nodes.connect().await {
                Ok(fresh) => {
                    *slot.write().unwrap_or_else(|e| e.into_inner()) = Some(Conn::Cluster(fresh));
                    info!("store kept failing; made a new cluster connection through every known node");
                }
                Err(e) => warn!(
                    error = %e,
                    "store keeps failing and no new cluster connection could be made; the current one stays"
                ),
            }
            nodes.reconnecting.store(false, Ordering::Release);
        });
    }

    /// `WAIT n timeout` on the key's node. Fewer acknowledgements, or a WAIT
    /// that fails (an ACL without `+wait`), and the reservation just written is
    /// released by its token and the request refused (503): never forwarded on
    /// a write a failover could lose, never left `processing` for a lease.
    async fn wait_for_replicas(
        &self,
        conn: &mut Conn,
        key: &str,
        token: Token,
    ) -> Result<(), StoreError> {
        let acked = match self.wait(conn, key).await {
            Ok(acked) if acked >= i64::from(self.wait_replicas) => return Ok(()),
            Ok(acked) => Err(StoreError::NotReplicated {
                wanted: self.wait_replicas,
                acked: acked.max(0) as u32,
            }),
            Err(e) => Err(StoreError::Unconfirmed(e.to_string())),
        };
        if let Err(e) = self.release(key, token).await {
            warn!(error = %e, "withdrawing an unconfirmed reservation failed; its owner retries");
        }
        acked
    }

    /// A record over one piece, written in pieces (see [`pieces`]), each
    /// within its own `op_timeout`; once more if the key changed under the
    /// first attempt.
    async fn complete_in_pieces(
        &self,
        conn: &mut Conn,
        key: &str,
        token: Token,
        value: (&Bytes, Duration),
        step: &Step<'_>,
    ) -> Result<Completion, StoreError> {
        for _ in 0..2 {
            if let Some(done) = pieces::complete(conn, key, token, value, step).await? {
                return Ok(done);
            }
        }
        Err(StoreError::Backend(
            "the record changed while it was being written".into(),
        ))
    }

    async fn wait(&self, conn: &mut Conn, key: &str) -> redis::RedisResult<i64> {
        let mut wait = redis::cmd("WAIT");
        wait.arg(self.wait_replicas).arg(ms(self.wait_timeout));
        match conn {
            Conn::Wire(c) => wait.query_async(c).await,
            Conn::Single(c) => wait.query_async(c).await,
            Conn::Cluster(c) => {
                // WAIT names no key: send it to the master of the key's slot.
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                    Route::with_key(key, SlotAddr::Master),
                ));
                Ok(redis::from_redis_value(
                    c.route_command(wait, route).await?,
                )?)
            }
        }
    }

    /// Warns loudly when the store would lose reservations: an evicting memory
    /// policy, or no persistence. Managed Redis often refuses CONFIG: say so once.
    async fn check_durability(&self, conn: &mut Conn) {
        let get = |name: &'static str| {
            let mut c = conn.clone();
            async move {
                let pair: Result<Vec<String>, _> = redis::cmd("CONFIG")
                    .arg("GET")
                    .arg(name)
                    .query_async(&mut c)
                    .await;
                pair.map(|p| p.get(1).cloned().unwrap_or_default())
            }
        };
        let (policy, aof, save) = (
            get("maxmemory-policy").await,
            get("appendonly").await,
            get("save").await,
        );
        match (policy, aof, save) {
            (Ok(policy), Ok(aof), Ok(save)) => {
                if policy != "noeviction" {
                    warn!(
                        maxmemory_policy = %policy,
                        "the store may evict records: set maxmemory-policy noeviction, or reservations can vanish and a retry execute twice"
                    );
                }
                if aof != "yes" && save.trim().is_empty() {
                    warn!("the store has no persistence (appendonly no, no save points): a restart forgets every record");
                } else if aof != "yes" {
                    warn!("the store persists by snapshots only: a crash loses the records since the last one; appendonly yes is safer");
                }
                if policy == "noeviction" && aof == "yes" {
                    info!("store durability check: maxmemory-policy noeviction, appendonly yes");
                }
            }
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => warn!(
                error = %e,
                "the store refused CONFIG GET, so its eviction policy and persistence cannot be checked; make sure of noeviction and AOF"
            ),
        }
    }
}

impl Operations for RedisStore {
    /// `SET NX PX` with the lease and, in the same write, `GETRANGE` of
    /// the key's first `inline` bytes: a new key is ours; a taken one comes
    /// back with what holds it, whole when it is at most `inline` bytes
    /// (`STRLEN` tells when exactly `inline` came), otherwise only its
    /// length (a large record's bytes are fetched once the caller has room
    /// for them). Two plain commands cost Redis a
    /// third less than a script for a new key and two thirds less for a
    /// taken one (`docs/benchmarks.md`). They are not atomic, and need not
    /// be: the read names whatever holds the key after the `SET` failed, and
    /// a key gone in between is reserved again. The remaining lease is not
    /// read here (only a 409 needs it: [`Operations::pttl`]).
    async fn reserve(
        &self,
        key: &str,
        value: Bytes,
        lease: Duration,
        inline: u64,
        taken: &std::sync::atomic::AtomicBool,
    ) -> Result<Option<Held>, StoreError> {
        let mut conn = self.conn().await?;
        let mut tries = 0;
        let held = loop {
            tries += 1;
            let (set, head) = send_reserve(&mut conn, key, &value, lease, inline)
                .await
                .map_err(|e| self.backend(e))?;
            let unexpected = |what, v: &Value| {
                StoreError::Backend(format!("unexpected {what} answer: {}", described(v)))
            };
            match set {
                Value::Okay => break None,
                Value::Nil => taken.store(true, std::sync::atomic::Ordering::Relaxed),
                other => return Err(unexpected("SET NX", &other)),
            }
            let head = match head {
                Value::BulkString(head) if head.len() as u64 > inline.max(1) => {
                    return Err(StoreError::Untrue(format!(
                        "{} bytes for a GETRANGE of at most {inline}",
                        head.len()
                    )))
                }
                Value::BulkString(head) => head,
                other => return Err(unexpected("GETRANGE", &other)),
            };
            // Gone between the two commands (expired, released, deleted):
            // reserve again. An empty value that stays is not ours to
            // overwrite: after a few tries it is judged as what it is.
            if head.is_empty() && tries < RESERVE_TRIES {
                continue;
            }
            // Fewer than `inline` bytes are the whole value; `inline` bytes
            // are the whole value or its beginning, as its length says.
            let len = if (head.len() as u64) < inline {
                head.len() as u64
            } else {
                redis::cmd("STRLEN")
                    .arg(key)
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| self.backend(e))?
            };
            if len == head.len() as u64 {
                break Some(Held::Value {
                    value: Bytes::from(head),
                    ttl: None,
                });
            }
            if len > 0 || tries >= RESERVE_TRIES {
                break Some(Held::Large {
                    len,
                    start: Bytes::from(head),
                });
            }
        };
        if held.is_none() && self.wait_replicas > 0 {
            let token = Token::of_record(&value).ok_or_else(|| {
                StoreError::Backend("a reservation without an owner token".into())
            })?;
            // Boxed, as every path most operations do not take: the hot
            // path's future stays small, and so does each copy of it.
            Box::pin(self.wait_for_replicas(&mut conn, key, token)).await?;
        }
        Ok(held)
    }

    /// What is left of a key's lease or TTL (for `Retry-After`); zero when it is gone.
    async fn pttl(&self, key: &str) -> Result<Duration, StoreError> {
        let mut conn = self.conn().await?;
        let ms: i64 = redis::cmd("PTTL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        Ok(Duration::from_millis(ms.max(0) as u64))
    }

    /// Each round trip within its own `op_timeout`: connecting, the record
    /// (each of its pieces when it is large), and `WAIT` (`op_timeout` beyond
    /// `wait_timeout`, which the server waits itself).
    async fn complete(
        &self,
        key: &str,
        token: Token,
        value: Bytes,
        ttl: Duration,
        steps: &Deadlines,
    ) -> Result<Completion, StoreError> {
        let error = |e| self.backend(e);
        let step = Step {
            deadlines: steps,
            error: &error,
        };
        let mut conn = step.bound(self.conn()).await?;
        let done = if value.len() > pieces::PIECE {
            Box::pin(self.complete_in_pieces(&mut conn, key, token, (&value, ttl), &step)).await?
        } else {
            let mut ttl_digits = [0; 20];
            let ttl = digits(ms(ttl), &mut ttl_digits);
            let args: [&[u8]; 3] = [&token.0, &value, ttl];
            let n: i64 = step
                .run(run_script(&mut conn, &COMPLETE, key, &args))
                .await?;
            match n {
                1 => Completion::Stored,
                2 => Completion::StoredAfterExpiry,
                _ => Completion::Refused,
            }
        };
        if done == Completion::Refused || self.wait_replicas == 0 {
            return Ok(done);
        }
        // The finished record is replicated like the reservation was: without
        // this, a failover right after the answer would bring `processing` back.
        let waited = tokio::time::timeout(
            self.op_timeout + self.wait_timeout,
            Box::pin(self.wait(&mut conn, key)),
        )
        .await
        .unwrap_or_else(|_| Err((redis::ErrorKind::Io, "WAIT timed out").into()));
        Ok(match waited {
            Ok(acked) if acked >= i64::from(self.wait_replicas) => done,
            Ok(acked) => Completion::Unreplicated {
                wanted: self.wait_replicas,
                acked: acked.max(0) as u32,
            },
            Err(e) => {
                warn!(error = %e, "WAIT after a completion failed");
                Completion::Unreplicated {
                    wanted: self.wait_replicas,
                    acked: 0,
                }
            }
        })
    }

    async fn renew(&self, key: &str, token: Token, lease: Duration) -> Result<bool, StoreError> {
        let mut conn = self.conn().await?;
        let mut lease_digits = [0; 20];
        let lease = digits(ms(lease), &mut lease_digits);
        let n: i64 = run_script(&mut conn, &RENEW, key, &[&token.0, lease])
            .await
            .map_err(|e| self.backend(e))?;
        Ok(n == 1)
    }

    async fn release(&self, key: &str, token: Token) -> Result<bool, StoreError> {
        let mut conn = self.conn().await?;
        let n: i64 = run_script(&mut conn, &RELEASE, key, &[&token.0])
            .await
            .map_err(|e| self.backend(e))?;
        Ok(n == 1)
    }

    /// A record and its TTL, in pieces when it is large (see [`pieces`]),
    /// each round trip within its own `op_timeout`; one said to be longer
    /// than `at_most` is not believed.
    async fn get(
        &self,
        key: &str,
        at_most: u64,
        steps: &Deadlines,
    ) -> Result<Option<(Bytes, Duration)>, StoreError> {
        let error = |e| self.backend(e);
        let step = Step {
            deadlines: steps,
            error: &error,
        };
        let mut conn = step.bound(self.conn()).await?;
        Box::pin(pieces::get(&mut conn, key, at_most, &step)).await
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let mut conn = self.conn().await?;
        let n: i64 = redis::cmd("DEL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        Ok(n > 0)
    }

    /// PING, then make sure the scripts are loaded (after a restart or failover they
    /// are gone; on a cluster SCRIPT goes to every master), then, once, the durability check.
    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        let _: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        let scripts = [&*COMPLETE, &*RENEW, &*RELEASE, &*pieces::SCRIPT];
        let hashes = scripts.map(|s| s.get_hash().to_string());
        let loaded: Vec<bool> = redis::cmd("SCRIPT")
            .arg("EXISTS")
            .arg(&hashes[..])
            .query_async(&mut conn)
            .await
            .map_err(|e| self.backend(e))?;
        for (script, present) in scripts.into_iter().zip(loaded) {
            if !present {
                script
                    .prepare_invoke()
                    .load_async(&mut conn)
                    .await
                    .map_err(|e| self.backend(e))?;
            }
        }
        if let (Source::Cluster(nodes), Conn::Cluster(c)) = (&self.source, &mut conn) {
            // Keeps the known nodes current, for a reconnect that cannot rely on the seeds.
            nodes.learn(c).await;
        }
        if !self.checked.swap(true, Ordering::Relaxed) {
            self.check_durability(&mut conn).await;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, Overrides};

    /// A future is copied whole where it is made and where it is awaited, so
    /// the per-request operations carry only their common path: connecting,
    /// `WAIT` and a large record's pieces are boxed where they start. With
    /// connecting inline, each of these was over 3.5 KiB (`docs/benchmarks.md`,
    /// "Futures copied whole").
    #[test]
    fn the_per_request_operations_futures_stay_small() {
        // Never connected: the futures are made, measured and dropped.
        let toml = r#"
            [server]
            upstream = "http://127.0.0.1:1"
            [store]
            backend = "redis"
            url = "redis://127.0.0.1:1"
            wait_replicas = 1
        "#;
        let config = Config::from_toml(toml, "<test>", &Overrides::default()).unwrap();
        let store = RedisStore::new(&config.store, 1).unwrap();
        let (lease, token) = (Duration::from_secs(1), Token([7; 16]));
        let steps = Deadlines::new(lease);
        let taken = std::sync::atomic::AtomicBool::new(false);
        let sizes = [
            (
                "reserve",
                size_of_val(&store.reserve("k", Bytes::new(), lease, 1, &taken)),
            ),
            (
                "complete",
                size_of_val(&store.complete("k", token, Bytes::new(), lease, &steps)),
            ),
            ("renew", size_of_val(&store.renew("k", token, lease))),
            ("release", size_of_val(&store.release("k", token))),
        ];
        for (op, size) in sizes {
            assert!(size <= 1024, "{op}'s future is {size} bytes");
        }
    }
}
