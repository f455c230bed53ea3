//! The Redis store's connections: one per worker thread (standalone,
//! Sentinel's master) or one for all (cluster), made on first use, made
//! anew when they keep failing, with a back-off after a failed connect.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tracing::warn;

use super::cluster::ClusterNodes;
use super::redis_conn::{store_error, Conn};
use super::sentinel::Sentinel;
use super::wire::Wire;
use super::StoreError;
use crate::per_worker::PerWorker;

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

/// One connection and what keeps it.
#[derive(Default)]
struct Slot {
    /// `None` until the first operation, and (standalone, Sentinel) after a
    /// connection was given up. Shared with a cluster reconnect running in the background.
    conn: Arc<RwLock<Option<Conn>>>,
    /// One connect at a time; the others wait for its result.
    connecting: tokio::sync::Mutex<()>,
    failures_in_a_row: AtomicU32,
    /// Sentinel: the master this slot's connection went to.
    master: Mutex<Option<String>>,
}

/// Where connections come from.
pub(super) enum Source {
    Standalone {
        client: redis::Client,
        config: ConnectionManagerConfig,
    },
    /// The master is asked of the sentinels on every (re)connect.
    Sentinel(Sentinel),
    Cluster(Arc<ClusterNodes>),
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

/// Where connections come from and the connections made.
pub(super) struct Connections {
    source: Source,
    /// The connections: one per worker thread for a standalone server or
    /// Sentinel's master (the proxy's workers, `per_worker`: a request's round trips then wake
    /// no other thread), one for every thread in a cluster (redis-rs's
    /// cluster connection already holds one per node).
    slots: PerWorker<Slot>,
    /// An operation failed since the store last answered on any slot: the
    /// next answer looks at the other slots' connections (`answered_again`).
    failing: AtomicBool,
    op_timeout: Duration,
    /// Standalone and Sentinel: when a connect failed, the next waits.
    backoff: Mutex<Backoff>,
    /// Sentinel: when the sentinels were last asked whether the master moved.
    master_asked: Mutex<Option<Instant>>,
}

/// How often, at most, a replica's missing acknowledgement sends the
/// sentinels a question (see [`Connections::master_moved`]).
const MASTER_ASKED_EVERY: Duration = Duration::from_millis(250);

impl Connections {
    pub(super) fn new(source: Source, slots: usize, op_timeout: Duration) -> Self {
        let slots = match &source {
            Source::Cluster(_) => 1,
            _ => slots,
        };
        Connections {
            source,
            slots: PerWorker::new(slots, |_| Slot::default()),
            failing: AtomicBool::new(false),
            op_timeout,
            backoff: Mutex::new(Backoff::default()),
            master_asked: Mutex::new(None),
        }
    }

    /// Sentinel: after a `WAIT` that fell short. A failover leaves the old
    /// master taking writes until a sentinel turns it into a replica (up to
    /// ten seconds), and a connection made before it stays with it: what is
    /// written there is lost, though the client has its answer. So the
    /// sentinels are asked (at most every 250 ms) which master they name,
    /// and every connection to another one is given up: the next operation
    /// (a completion written again) connects to the new master. A replica
    /// that only lags asks the same question and changes nothing.
    pub(super) async fn master_moved(&self) {
        let Source::Sentinel(sentinel) = &self.source else {
            return;
        };
        {
            let mut asked = self.master_asked.lock().unwrap_or_else(|e| e.into_inner());
            if asked.is_some_and(|t| t.elapsed() < MASTER_ASKED_EVERY) {
                return;
            }
            *asked = Some(Instant::now());
        }
        let Ok(Ok(named)) = tokio::time::timeout(self.op_timeout, sentinel.master_addr()).await
        else {
            return;
        };
        let mut given_up = 0;
        for slot in self.slots.all() {
            let stale = {
                let master = slot.master.lock().unwrap_or_else(|e| e.into_inner());
                master.as_ref().is_some_and(|m| *m != named)
            };
            if stale {
                given_up += usize::from(take_conn(slot));
            }
        }
        if given_up > 0 {
            warn!(
                master = %named,
                connections = given_up,
                "a replica did not acknowledge and the sentinels name another master; connecting to it"
            );
        }
    }

    /// The cluster's nodes, in cluster mode.
    pub(super) fn cluster(&self) -> Option<&ClusterNodes> {
        match &self.source {
            Source::Cluster(nodes) => Some(nodes),
            _ => None,
        }
    }

    fn backend(&self, e: redis::RedisError) -> StoreError {
        store_error(e, self.op_timeout)
    }

    /// This thread's connection (a cheap handle), connecting first when there
    /// is none or when ours broke.
    pub(super) async fn conn(&self) -> Result<Conn, StoreError> {
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
                let fresh = self.connect_single(single, slot).await;
                self.note_connect(&fresh);
                fresh?
            }
        };
        *slot.conn.write().unwrap_or_else(|e| e.into_inner()) = Some(fresh.clone());
        Ok(fresh)
    }

    async fn connect_single(&self, source: &Source, slot: &Slot) -> Result<Conn, StoreError> {
        match source {
            Source::Standalone { client, config } => {
                self.single(client.clone(), config.clone()).await
            }
            Source::Sentinel(sentinel) => {
                let client = sentinel.master().await.map_err(|e| self.backend(e))?;
                let named = client.get_connection_info().addr().to_string();
                *slot.master.lock().unwrap_or_else(|e| e.into_inner()) = Some(named);
                self.single(client, sentinel.config.clone()).await
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
    pub(super) fn note_result(&self, failed: bool) {
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

    /// Makes a new cluster connection in the background (see
    /// [`ClusterNodes::reconnect`]) and swaps it into `slot` once it is up.
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
        let slot = slot.conn.clone();
        nodes.reconnect(move |fresh| {
            *slot.write().unwrap_or_else(|e| e.into_inner()) = Some(Conn::Cluster(fresh));
        });
    }
}
