//! A fault-injecting TCP relay: put it between the proxy and Redis, or the
//! proxy and the upstream, and switch its behaviour while traffic runs.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

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
    /// Delay each chunk by this many milliseconds.
    Delay(u64),
}

pub struct Relay {
    pub addr: SocketAddr,
    mode: watch::Sender<Fault>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    pub async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let addr = listener.local_addr().unwrap();
        let (mode, _) = watch::channel(Fault::Pass);
        let m = mode.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let rx = m.subscribe();
                tokio::spawn(handle(client, target, rx));
            }
        });
        Relay { addr, mode, task }
    }

    pub fn set(&self, fault: Fault) {
        self.mode.send_replace(fault);
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

async fn handle(mut client: TcpStream, target: SocketAddr, mut mode: watch::Receiver<Fault>) {
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
    loop {
        // Reads are cancel-safe: the branch not taken loses nothing.
        tokio::select! {
            r = client.read(&mut from_client) => {
                let n = match r { Ok(0) | Err(_) => break, Ok(n) => n };
                if !gate(&mut mode).await || server.write_all(&from_client[..n]).await.is_err() {
                    break;
                }
            }
            r = server.read(&mut from_server) => {
                let n = match r { Ok(0) | Err(_) => break, Ok(n) => n };
                if *mode.borrow() == Fault::ResetOnReply {
                    // The far side has acted and answers: cut the near side off.
                    return reset(client);
                }
                if !gate(&mut mode).await || client.write_all(&from_server[..n]).await.is_err() {
                    break;
                }
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
        Fault::Pass | Fault::ResetOnReply => true,
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
