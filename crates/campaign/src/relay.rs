//! The fault-injecting TCP relay between each proxy and what it talks to
//! (every store node, the upstream). `tc netem` is not on every machine,
//! and a relay's faults are exact and come from the seed.
//!
//! A relay serves every process that connects to it (all the proxies, and
//! for a store node also the sentinels and the replicas), and tells them
//! apart: each accepted connection is attributed to the proxy whose
//! process holds the other end (the kernel's `sock_diag` names the socket's
//! inode, `/proc/PID/fd` who holds it), so that a fault can hit the link between
//! one proxy and the store while the others work.
//!
//! The effects keep TCP's promise (bytes arrive in order or the
//! connection breaks): `delay` adds latency each way; `loss` holds a
//! chunk for a retransmission timeout now and then, as a lost segment
//! does; `hold` stops bytes one way or both (a stall, a one-way or a full
//! partition, which also leaves new connections hanging) until the fault
//! heals; `refuse` resets every open connection and each new one (a cut).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;

use crate::rng::Rng;

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Effect {
    /// Every chunk, each way, this many ms late.
    Delay(u64),
    /// Each chunk, with this chance, held this many ms (a lost segment
    /// retransmitted).
    Loss { chance: f64, rto_ms: u64 },
    /// Bytes toward the target and/or toward the connecting side wait
    /// until the fault heals; `new` also holds new connections.
    Hold {
        to_target: bool,
        to_client: bool,
        new: bool,
    },
    /// Reset every connection, and each new one.
    Refuse,
}

#[derive(Clone, Debug)]
struct Rule {
    id: u32,
    /// The proxy whose connections it hits; `None`: every connection.
    source: Option<u32>,
    effect: Effect,
}

/// Which proxy (by index) runs under which pid: the runner updates it as
/// proxies are killed and started again.
#[derive(Default)]
pub(crate) struct Owners(Mutex<Vec<Option<u32>>>);

impl Owners {
    pub(crate) fn set(&self, proxy: u32, pid: Option<u32>) {
        let mut v = self.0.lock().unwrap();
        if v.len() <= proxy as usize {
            v.resize(proxy as usize + 1, None);
        }
        v[proxy as usize] = pid;
    }

    /// The proxy whose process holds the socket connected from `peer_port` to `port`.
    fn attribute(&self, peer_port: u16, port: u16) -> Option<u32> {
        let pids: Vec<(u32, u32)> = self
            .0
            .lock()
            .unwrap()
            .iter()
            .enumerate()
            .filter_map(|(i, p)| Some((i as u32, (*p)?)))
            .collect();
        let inode = socket_inode(peer_port, port)?;
        let needle = format!("socket:[{inode}]");
        for (proxy, pid) in pids {
            let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
                continue;
            };
            for fd in fds.flatten() {
                if std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == needle.as_str()) {
                    return Some(proxy);
                }
            }
        }
        None
    }
}

/// `inet_diag_sockid`: a socket's four-tuple, as `sock_diag` takes and gives it.
#[repr(C)]
#[derive(Clone, Copy)]
struct SockId {
    sport: u16,
    dport: u16,
    src: [u32; 4],
    dst: [u32; 4],
    interface: u32,
    cookie: [u32; 2],
}

/// `inet_diag_req_v2` behind its netlink header: the lookup [`socket_inode`] sends.
#[repr(C)]
struct Request {
    header: libc::nlmsghdr,
    family: u8,
    protocol: u8,
    ext: u8,
    pad: u8,
    states: u32,
    id: SockId,
}

/// `inet_diag_msg`: the kernel's answer, with the socket's inode.
#[repr(C)]
#[derive(Clone, Copy)]
struct Message {
    family: u8,
    state: u8,
    timer: u8,
    retrans: u8,
    id: SockId,
    expires: u32,
    rqueue: u32,
    wqueue: u32,
    uid: u32,
    inode: u32,
}

/// The netlink message type of a `sock_diag` lookup.
const SOCK_DIAG_BY_FAMILY: u16 = 20;

/// The inode of the loopback socket from `local` to `remote` (ports),
/// asked of the kernel by its four-tuple over netlink (`sock_diag`): one
/// lookup, however many sockets the machine has (reading `/proc/net/tcp`
/// takes seconds with ten thousand of them).
fn socket_inode(local: u16, remote: u16) -> Option<u64> {
    let loopback = u32::from_ne_bytes([127, 0, 0, 1]);
    let request = Request {
        header: libc::nlmsghdr {
            nlmsg_len: std::mem::size_of::<Request>() as u32,
            nlmsg_type: SOCK_DIAG_BY_FAMILY,
            nlmsg_flags: libc::NLM_F_REQUEST as u16,
            nlmsg_seq: 1,
            nlmsg_pid: 0,
        },
        family: libc::AF_INET as u8,
        protocol: libc::IPPROTO_TCP as u8,
        ext: 0,
        pad: 0,
        states: !0,
        id: SockId {
            sport: local.to_be(),
            dport: remote.to_be(),
            src: [loopback, 0, 0, 0],
            dst: [loopback, 0, 0, 0],
            interface: 0,
            cookie: [!0, !0],
        },
    };
    // SAFETY: a netlink socket of our own, written a plain C struct and read
    // into a buffer whose length is checked before it is interpreted.
    unsafe {
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        );
        if fd < 0 {
            return None;
        }
        let sent = libc::send(
            fd,
            &request as *const Request as *const libc::c_void,
            std::mem::size_of::<Request>(),
            0,
        );
        let mut buf = [0u8; 1024];
        let got = if sent > 0 {
            libc::recv(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0)
        } else {
            -1
        };
        libc::close(fd);
        let header = std::mem::size_of::<libc::nlmsghdr>();
        if got < (header + std::mem::size_of::<Message>()) as isize {
            return None;
        }
        let h: libc::nlmsghdr = std::ptr::read_unaligned(buf.as_ptr() as *const libc::nlmsghdr);
        if h.nlmsg_type != SOCK_DIAG_BY_FAMILY {
            return None; // NLMSG_ERROR: no such socket
        }
        let m: Message = std::ptr::read_unaligned(buf.as_ptr().add(header) as *const Message);
        Some(u64::from(m.inode))
    }
}

/// An open connection: the proxy it is attributed to, and what cuts it.
type Open = (Option<u32>, Arc<Notify>);

struct Shared {
    /// Where it relays to: set once the far side's port is chosen.
    target: Mutex<SocketAddr>,
    port: u16,
    rules: Mutex<Vec<Rule>>,
    changed: watch::Sender<u64>,
    /// Open connections: their source and what cuts them.
    conns: Mutex<HashMap<u64, Open>>,
    next: AtomicU64,
    owners: Arc<Owners>,
    rng: Mutex<Rng>,
}

impl Shared {
    fn hits(rule: &Rule, source: Option<u32>) -> bool {
        rule.source.is_none() || rule.source == source
    }

    fn effects(&self, source: Option<u32>) -> Vec<Effect> {
        self.rules
            .lock()
            .unwrap()
            .iter()
            .filter(|r| Self::hits(r, source))
            .map(|r| r.effect.clone())
            .collect()
    }

    fn refused(&self, source: Option<u32>) -> bool {
        self.effects(source).contains(&Effect::Refuse)
    }

    fn held(&self, source: Option<u32>, to_target: bool, new: bool) -> bool {
        self.effects(source).iter().any(|e| match e {
            Effect::Hold {
                to_target: t,
                to_client: c,
                new: n,
            } => {
                if new {
                    *n
                } else if to_target {
                    *t
                } else {
                    *c
                }
            }
            _ => false,
        })
    }

    /// How late a chunk read now is delivered.
    fn lateness(&self, source: Option<u32>) -> Duration {
        let mut ms = 0;
        for e in self.effects(source) {
            match e {
                Effect::Delay(d) => ms += d,
                Effect::Loss { chance, rto_ms } if self.rng.lock().unwrap().chance(chance) => {
                    ms += rto_ms;
                }
                _ => {}
            }
        }
        Duration::from_millis(ms)
    }

    async fn wait_until_free(&self, source: Option<u32>, to_target: bool, new: bool) {
        let mut changed = self.changed.subscribe();
        while self.held(source, to_target, new) {
            if changed.changed().await.is_err() {
                return;
            }
        }
    }
}

pub(crate) struct Relay {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Listens on a free loopback port and relays to `target`.
    pub(crate) async fn start(
        target: SocketAddr,
        owners: Arc<Owners>,
        rng: Rng,
    ) -> std::io::Result<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            target: Mutex::new(target),
            port: addr.port(),
            rules: Mutex::new(Vec::new()),
            changed: watch::channel(0).0,
            conns: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
            owners,
            rng: Mutex::new(rng),
        });
        let s = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, peer)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let s = s.clone();
                tokio::spawn(async move {
                    let (owners, port) = (s.owners.clone(), s.port);
                    let source =
                        tokio::task::spawn_blocking(move || owners.attribute(peer.port(), port))
                            .await
                            .ok()
                            .flatten();
                    serve(s, client, source).await;
                });
            }
        });
        Ok(Relay { addr, shared, task })
    }

    /// Relays to `target` from now on (a relay is bound before the port of
    /// what it fronts is chosen, so that the two can never collide).
    pub(crate) fn set_target(&self, target: SocketAddr) {
        *self.shared.target.lock().unwrap() = target;
    }

    /// Applies `effect` to the connections of `source` (a proxy's index;
    /// `None`: all) until [`Relay::heal`] with the same id.
    pub(crate) fn inject(&self, id: u32, source: Option<u32>, effect: Effect) {
        let refuse = effect == Effect::Refuse;
        self.shared
            .rules
            .lock()
            .unwrap()
            .push(Rule { id, source, effect });
        self.shared.changed.send_modify(|n| *n += 1);
        if refuse {
            for (src, cut) in self.shared.conns.lock().unwrap().values() {
                if source.is_none() || source == *src {
                    cut.notify_one();
                }
            }
        }
    }

    pub(crate) fn heal(&self, id: u32) {
        self.shared.rules.lock().unwrap().retain(|r| r.id != id);
        self.shared.changed.send_modify(|n| *n += 1);
    }

    /// Resets every open connection (of `source`, or all).
    pub(crate) fn cut(&self, source: Option<u32>) {
        for (src, cut) in self.shared.conns.lock().unwrap().values() {
            if source.is_none() || source == *src {
                cut.notify_one();
            }
        }
    }

    pub(crate) fn heal_all(&self) {
        self.shared.rules.lock().unwrap().clear();
        self.shared.changed.send_modify(|n| *n += 1);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
        self.cut(None);
    }
}

/// SO_LINGER 0: closing the socket sends a reset.
fn reset_on_close(s: &TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &linger as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

async fn serve(s: Arc<Shared>, mut client: TcpStream, source: Option<u32>) {
    let _ = client.set_nodelay(true);
    if s.refused(source) {
        reset_on_close(&client);
        return;
    }
    s.wait_until_free(source, true, true).await;
    let far = *s.target.lock().unwrap();
    let mut target =
        match tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(far)).await {
            Ok(Ok(t)) => t,
            _ => {
                reset_on_close(&client);
                return;
            }
        };
    let _ = target.set_nodelay(true);
    let id = s.next.fetch_add(1, Ordering::Relaxed);
    let cut = Arc::new(Notify::new());
    s.conns.lock().unwrap().insert(id, (source, cut.clone()));
    if s.refused(source) {
        cut.notify_one();
    }
    let was_cut = {
        let (mut cr, mut cw) = client.split();
        let (mut tr, mut tw) = target.split();
        let up = pump(&s, source, true, &mut cr, &mut tw);
        let down = pump(&s, source, false, &mut tr, &mut cw);
        tokio::select! {
            _ = async { tokio::join!(up, down) } => false,
            _ = cut.notified() => true,
        }
    };
    s.conns.lock().unwrap().remove(&id);
    if was_cut {
        reset_on_close(&client);
        reset_on_close(&target);
    }
}

/// One direction: bytes read are queued with the time they may be
/// delivered, and written in order once that time has come and no hold
/// stops them.
async fn pump<R, W>(s: &Shared, source: Option<u32>, to_target: bool, rd: &mut R, wr: &mut W)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (tx, mut rx) = mpsc::unbounded_channel::<(Vec<u8>, Instant)>();
    let read = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let at = Instant::now() + s.lateness(source);
                    if tx.send((buf[..n].to_vec(), at)).is_err() {
                        break;
                    }
                }
            }
        }
    };
    let write = async {
        while let Some((bytes, at)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            s.wait_until_free(source, to_target, false).await;
            if wr.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = wr.shutdown().await;
    };
    tokio::join!(read, write);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_attributed_to_the_process_that_holds_it() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let local = client.local_addr().unwrap().port();
        let inode = socket_inode(local, port).expect("the kernel knows the socket");
        let link = std::fs::read_link(format!("/proc/self/fd/{}", client.as_raw_fd())).unwrap();
        assert_eq!(link.to_str().unwrap(), format!("socket:[{inode}]"));
        assert_eq!(socket_inode(local, port.wrapping_add(1)), None);

        let owners = Owners::default();
        assert_eq!(owners.attribute(local, port), None, "nobody registered");
        owners.set(2, Some(std::process::id()));
        assert_eq!(owners.attribute(local, port), Some(2));
    }
}
