//! A fault-injecting TCP relay: put it between the proxy and Redis, or the
//! proxy and the upstream, and switch its behaviour while traffic runs.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Relay bytes both ways.
    Pass,
    /// Accept, read and drop everything, never answer.
    Blackhole,
    /// Accept, then reset at once (like a refused connection, after the handshake).
    Reset,
    /// Relay the request; when the far side starts to answer, reset the near side.
    ResetOnReply,
    /// Delay each chunk by this many milliseconds (one chunk after the
    /// other: a bandwidth limit of 16 KiB per that time, each way).
    Delay(u64),
    /// Deliver every byte this many milliseconds after it was read, bytes in
    /// flight not holding up the next ones: a peer that far away, each way.
    Latency(u64),
}

/// Bytes relayed so far, each way; connections accepted, open now and
/// open at most at once.
#[derive(Default)]
struct Counts {
    to_far: AtomicU64,
    to_near: AtomicU64,
    accepted: AtomicU64,
    open: AtomicU64,
    peak: AtomicU64,
}

/// One accepted connection, counted open until its handler ends.
struct Open(Arc<Counts>);

impl Open {
    fn new(counts: &Arc<Counts>) -> Open {
        counts.accepted.fetch_add(1, Ordering::SeqCst);
        let now = counts.open.fetch_add(1, Ordering::SeqCst) + 1;
        counts.peak.fetch_max(now, Ordering::SeqCst);
        Open(counts.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

pub struct Relay {
    pub addr: SocketAddr,
    mode: watch::Sender<Fault>,
    task: tokio::task::JoinHandle<()>,
    counts: Arc<Counts>,
}

impl Relay {
    pub async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let addr = listener.local_addr().unwrap();
        let (mode, _) = watch::channel(Fault::Pass);
        let m = mode.clone();
        let counts = Arc::new(Counts::default());
        let c = counts.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let rx = m.subscribe();
                let open = Open::new(&c);
                let c = c.clone();
                tokio::spawn(async move {
                    handle(client, target, rx, c).await;
                    drop(open);
                });
            }
        });
        Relay {
            addr,
            mode,
            task,
            counts,
        }
    }

    pub fn set(&self, fault: Fault) {
        self.mode.send_replace(fault);
    }

    /// Bytes delivered so far to the far side (Redis, the upstream).
    pub fn bytes_to_far(&self) -> u64 {
        self.counts.to_far.load(Ordering::SeqCst)
    }

    /// Bytes delivered so far back to the near side (the proxy).
    pub fn bytes_to_near(&self) -> u64 {
        self.counts.to_near.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.counts.accepted.load(Ordering::SeqCst)
    }

    /// Connections open now (accepted, and neither side closed yet).
    pub fn open(&self) -> u64 {
        self.counts.open.load(Ordering::SeqCst)
    }

    /// The most connections that were open at once.
    pub fn peak(&self) -> u64 {
        self.counts.peak.load(Ordering::SeqCst)
    }

    /// Counts the most open at once from now: the peak becomes the number open now.
    pub fn reset_peak(&self) {
        self.counts
            .peak
            .store(self.counts.open.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[allow(deprecated)] // SO_LINGER 0 is exactly what a reset needs; the socket is dropped at once.
fn reset(s: TcpStream) {
    let _ = s.set_linger(Some(Duration::ZERO));
    drop(s);
}

/// Bytes read from one side and not yet delivered to the other, with when
/// each chunk is due (`Fault::Latency`); other modes deliver at once, after
/// whatever is queued.
#[derive(Default)]
struct InFlight {
    chunks: VecDeque<(Instant, Vec<u8>)>,
    bytes: usize,
}

/// The most bytes held in flight each way: beyond it, reading that side waits.
const MAX_IN_FLIGHT: usize = 32 << 20;

impl InFlight {
    fn due(&self) -> Option<Instant> {
        self.chunks.front().map(|(at, _)| *at)
    }

    fn push(&mut self, at: Instant, bytes: &[u8]) {
        self.bytes += bytes.len();
        self.chunks.push_back((at, bytes.to_vec()));
    }

    fn pop(&mut self) -> Option<Vec<u8>> {
        let (_, bytes) = self.chunks.pop_front()?;
        self.bytes -= bytes.len();
        Some(bytes)
    }
}

async fn handle(
    mut client: TcpStream,
    target: SocketAddr,
    mut mode: watch::Receiver<Fault>,
    counts: Arc<Counts>,
) {
    let current = *mode.borrow();
    match current {
        Fault::Reset => return reset(client),
        Fault::Blackhole => return blackhole(client).await,
        _ => {}
    }
    let Ok(mut server) = TcpStream::connect(target).await else {
        return reset(client);
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let mut from_client = vec![0u8; 16 * 1024];
    let mut from_server = vec![0u8; 16 * 1024];
    let (mut to_server, mut to_client) = (InFlight::default(), InFlight::default());
    let far = Instant::now() + Duration::from_secs(86400);
    loop {
        let (server_due, client_due) = (to_server.due(), to_client.due());
        // Reads are cancel-safe: the branch not taken loses nothing.
        tokio::select! {
            r = client.read(&mut from_client), if to_server.bytes < MAX_IN_FLIGHT => {
                let n = match r { Ok(0) | Err(_) => break, Ok(n) => n };
                let latency = match *mode.borrow() { Fault::Latency(ms) => Some(ms), _ => None };
                if let Some(ms) = latency {
                    to_server.push(Instant::now() + Duration::from_millis(ms), &from_client[..n]);
                    continue;
                }
                if server_due.is_some() {
                    // Behind what is still in flight, in order.
                    to_server.push(Instant::now(), &from_client[..n]);
                    continue;
                }
                if !gate(&mut mode).await || server.write_all(&from_client[..n]).await.is_err() {
                    break;
                }
                counts.to_far.fetch_add(n as u64, Ordering::SeqCst);
            }
            r = server.read(&mut from_server), if to_client.bytes < MAX_IN_FLIGHT => {
                let n = match r { Ok(0) | Err(_) => break, Ok(n) => n };
                let current = *mode.borrow();
                if current == Fault::ResetOnReply {
                    // The far side has acted and answers: cut the near side off.
                    return reset(client);
                }
                if let Fault::Latency(ms) = current {
                    to_client.push(Instant::now() + Duration::from_millis(ms), &from_server[..n]);
                    continue;
                }
                if client_due.is_some() {
                    to_client.push(Instant::now(), &from_server[..n]);
                    continue;
                }
                if !gate(&mut mode).await || client.write_all(&from_server[..n]).await.is_err() {
                    break;
                }
                counts.to_near.fetch_add(n as u64, Ordering::SeqCst);
            }
            () = tokio::time::sleep_until(server_due.unwrap_or(far)), if server_due.is_some() => {
                let Some(bytes) = to_server.pop() else { continue };
                if server.write_all(&bytes).await.is_err() {
                    break;
                }
                counts.to_far.fetch_add(bytes.len() as u64, Ordering::SeqCst);
            }
            () = tokio::time::sleep_until(client_due.unwrap_or(far)), if client_due.is_some() => {
                let Some(bytes) = to_client.pop() else { continue };
                if client.write_all(&bytes).await.is_err() {
                    break;
                }
                counts.to_near.fetch_add(bytes.len() as u64, Ordering::SeqCst);
            }
        }
    }
}

/// Whether bytes may pass (after the mode's delay): false when the mode says to drop
/// the connection; never returns while the mode is `Blackhole`.
async fn gate(mode: &mut watch::Receiver<Fault>) -> bool {
    let m = *mode.borrow();
    match m {
        Fault::Delay(ms) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            true
        }
        Fault::Blackhole => std::future::pending().await,
        Fault::Reset => false,
        Fault::Pass | Fault::ResetOnReply | Fault::Latency(_) => true,
    }
}

async fn blackhole(mut s: TcpStream) {
    let mut buf = vec![0u8; 16 * 1024];
    while let Ok(n) = s.read(&mut buf).await {
        if n == 0 {
            break;
        }
    }
}
