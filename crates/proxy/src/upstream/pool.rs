//! HTTP/1.1 connections to the upstream, driven by the request's own task.
//!
//! hyper-util's pooled client runs every connection in a task of its own and
//! spawns one more per exchange to put the connection back when it is ready:
//! each exchange hands the request, the answer's head and its body across
//! tasks, and wakes three of them. Here the task that sends the request polls
//! the connection itself — while waiting for the head, then beside the body
//! as the body is read ([`Inbound`]) — and once the body is done the
//! connection goes back on a stack of idle ones (most recently used first).
//!
//! What the pool keeps of the old client's behaviour: idle connections are
//! closed after `upstream_idle_timeout` (docs/reference/behaviour.md#upstream-pool: before the
//! upstream closes them),
//! a connection found closed when it is taken is dropped, and a request that
//! a connection closed before it was written goes once more on a new one
//! (never a request that may have reached the upstream). Upgrades (a
//! WebSocket's 101) and HTTP/2 still go through hyper-util's client.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::Context;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::UpstreamError;
use crate::body::{Body, Inbound, LentConnection};

/// Idle connections kept at most (as many as hyper-util's client kept per host).
const MAX_IDLE: usize = 1024;

/// One HTTP/1.1 connection: the handle requests are sent through, and the
/// future that does its I/O (polled by whoever is using it).
struct Conn {
    sender: SendRequest<Body>,
    io: Connection<TokioIo<TcpStream>, Body>,
    /// The I/O future has finished (closed or failed): never poll it again.
    done: bool,
    /// Where the connection goes back once an answer's body is read to its end.
    pool: Weak<Pool>,
}

impl LentConnection for Conn {
    /// Drives the connection's I/O; true while it is still open.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.done && Pin::new(&mut self.io).poll(cx).is_ready() {
            self.done = true;
        }
        !self.done
    }

    /// The answer's body is read to its end: back to the pool once the
    /// connection is ready for the next request (one more poll lets hyper
    /// see that the exchange is over).
    fn give_back(mut self: Box<Self>, cx: &mut Context<'_>) {
        let open = self.drive(cx);
        if open && !self.sender.is_closed() {
            if let Some(pool) = self.pool.upgrade() {
                pool.put(self);
            }
        }
    }
}

/// Connections are boxed: hyper's connection state is large, and a pooled
/// one moves between the stack, a body and the idle stack.
struct Idle {
    conn: Box<Conn>,
    since: Instant,
}

pub struct Pool {
    idle: Mutex<Vec<Idle>>,
    /// The task that closes idle connections runs (started by the first
    /// `put`, on the runtime of the thread that uses the pool).
    reaping: std::sync::atomic::AtomicBool,
    host: String,
    port: u16,
    connect_timeout: Duration,
    idle_timeout: Duration,
}

impl Pool {
    /// A pool for `authority` (`host[:port]`, port 80 when none). A task
    /// started with its first idle connection, on the runtime that put it
    /// there (a worker's: `crate::workers`), closes idle connections after
    /// `idle_timeout`; it ends with the pool.
    pub fn new(
        authority: &http::uri::Authority,
        connect_timeout: Duration,
        idle_timeout: Duration,
    ) -> Arc<Self> {
        let host = authority.host();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        Arc::new(Pool {
            idle: Mutex::new(Vec::new()),
            reaping: std::sync::atomic::AtomicBool::new(false),
            host: host.to_string(),
            port: authority.port_u16().unwrap_or(80),
            connect_timeout,
            idle_timeout,
        })
    }

    /// Sends a request and waits for the answer's head, driving the
    /// connection from this task; the answer's body drives it on.
    pub async fn send(
        self: &Arc<Self>,
        mut req: Request<Body>,
    ) -> Result<Response<Inbound>, UpstreamError> {
        // A pooled connection may turn out closed before the request was
        // written: then once more, on a new connection.
        for fresh in [false, true] {
            let pooled = if fresh { None } else { self.take() };
            let mut conn = match pooled {
                Some(c) => c,
                // Boxed: connecting is rare, and its future would make every exchange's larger.
                None => Box::pin(self.connect()).await?,
            };
            let mut answer = std::pin::pin!(conn.sender.try_send_request(req));
            let result = std::future::poll_fn(|cx| {
                conn.drive(cx);
                answer.as_mut().poll(cx)
            })
            .await;
            match result {
                // A plain request never switches protocols
                // (docs/reference/behaviour.md#upstream-pool): the
                // connection is given up, and the answer is not relayed or kept.
                Ok(resp) if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS => {
                    return Err(UpstreamError::Invalid(
                        "101 Switching Protocols to a request that did not ask to upgrade",
                    ))
                }
                Ok(resp) => return Ok(Self::lease(conn, resp)),
                Err(mut e) => match e.take_message() {
                    Some(unsent) if !fresh => req = unsent,
                    // Never written, on a new connection: it did not reach the upstream.
                    Some(_) => return Err(UpstreamError::Connect(super::describe(e.error()))),
                    None => return Err(UpstreamError::Exchange(super::describe(e.error()))),
                },
            }
        }
        unreachable!("the second attempt returns")
    }

    /// The answer, its body holding the connection until it is read to the end.
    fn lease(conn: Box<Conn>, resp: Response<Incoming>) -> Response<Inbound> {
        resp.map(|body| Inbound::lent(body, conn))
    }

    /// The most recently used idle connection that is still open and ready.
    fn take(&self) -> Option<Box<Conn>> {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(mut entry) = idle.pop() {
            if now.duration_since(entry.since) >= self.idle_timeout {
                // The rest are older still.
                idle.clear();
                return None;
            }
            // One poll (no waker wanted) sees a close or a stray byte from the upstream.
            let mut cx = Context::from_waker(std::task::Waker::noop());
            if entry.conn.drive(&mut cx) && entry.conn.sender.is_ready() {
                return Some(entry.conn);
            }
        }
        None
    }

    fn put(self: &Arc<Self>, conn: Box<Conn>) {
        {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            if idle.len() < MAX_IDLE {
                idle.push(Idle {
                    conn,
                    since: Instant::now(),
                });
            }
        }
        if !self.reaping.load(std::sync::atomic::Ordering::Relaxed)
            && !self.reaping.swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn(reap(Arc::downgrade(self)))),
                Err(_) => self
                    .reaping
                    .store(false, std::sync::atomic::Ordering::Release),
            }
        }
    }

    async fn connect(self: &Arc<Self>) -> Result<Box<Conn>, UpstreamError> {
        let addr = (self.host.as_str(), self.port);
        let stream =
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr)).await {
                Err(_) => {
                    return Err(UpstreamError::Connect(format!(
                        "connecting to {}:{} timed out after {:?}",
                        self.host, self.port, self.connect_timeout
                    )))
                }
                Ok(Err(e)) => {
                    return Err(UpstreamError::Connect(format!(
                        "{}:{}: {e}",
                        self.host, self.port
                    )))
                }
                Ok(Ok(s)) => s,
            };
        let _ = stream.set_nodelay(true);
        let (sender, io) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| UpstreamError::Connect(super::describe(&e)))?;
        Ok(Box::new(Conn {
            sender,
            io,
            done: false,
            pool: Arc::downgrade(self),
        }))
    }
}

/// Closes idle connections older than the pool's idle timeout, every half of it.
async fn reap(pool: Weak<Pool>) {
    let every = match pool.upgrade() {
        Some(p) => (p.idle_timeout / 2).max(Duration::from_millis(10)),
        None => return,
    };
    loop {
        tokio::time::sleep(every).await;
        let Some(pool) = pool.upgrade() else { return };
        let now = Instant::now();
        let mut idle = pool.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.retain(|e| now.duration_since(e.since) < pool.idle_timeout);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// An HTTP/1.1 server on loopback that counts the connections it accepts;
    /// `/empty` answers 204, anything else a body of 100 KiB.
    async fn counting_server() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let body = if req.uri().path() == "/empty" {
                        Response::builder().status(204).body(Body::full(""))
                    } else {
                        Response::builder().body(Body::full(vec![b'x'; 100 * 1024]))
                    };
                    Ok::<_, std::convert::Infallible>(body.unwrap())
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        (addr, accepted)
    }

    async fn get(pool: &Arc<Pool>, addr: std::net::SocketAddr, path: &str) -> Response<Inbound> {
        let req = Request::get(format!("http://{addr}{path}"))
            .body(Body::full(""))
            .unwrap();
        pool.send(req).await.unwrap()
    }

    fn pool_for(addr: std::net::SocketAddr) -> Arc<Pool> {
        let authority = addr.to_string().parse().unwrap();
        Pool::new(&authority, Duration::from_secs(5), Duration::from_secs(60))
    }

    /// The lease: a body read to its end gives its connection back, also a
    /// body with nothing to read; a body dropped before its end takes its
    /// connection with it.
    #[tokio::test]
    async fn an_answer_read_to_its_end_gives_its_connection_back() {
        let (addr, accepted) = counting_server().await;
        let pool = pool_for(addr);
        for _ in 0..3 {
            let body = get(&pool, addr, "/").await.into_body().collect().await;
            assert_eq!(body.unwrap().to_bytes().len(), 100 * 1024);
        }
        for _ in 0..2 {
            let resp = get(&pool, addr, "/empty").await;
            assert_eq!(resp.status(), 204);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection, reused");

        let unread = get(&pool, addr, "/").await;
        drop(unread);
        let body = get(&pool, addr, "/").await.into_body().collect().await;
        assert_eq!(body.unwrap().to_bytes().len(), 100 * 1024);
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "a body left unread closes its connection"
        );
    }
}
