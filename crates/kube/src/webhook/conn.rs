//! One client connection: HTTP/1.1 or HTTP/2 served until the client leaves,
//! it is idle for [`IDLE_TIMEOUT`], or an answer on it is not taken within
//! [`ANSWER_DEADLINE`].
//!
//! An answer is sent in pieces ([`Answer`]) that hyper asks for only as the
//! client takes them (HTTP/2 flow control, a full socket), so an answer not
//! taken stays with its [`Answer`], and the bytes of the answer budget it
//! holds with it, until the client takes it or the connection goes.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::Request;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::budget::HeldBytes;
use super::{
    handle, Shared, ANSWER_DEADLINE, CONNECTION_WINDOW, HANDSHAKE_DEADLINE, IDLE_TIMEOUT,
    MAX_HEADER_BYTES, MAX_STREAMS, PIECE_BYTES, STREAM_WINDOW,
};

/// What a handler answers: the body's bytes and what they hold of the answer budget.
pub(super) struct Reply {
    pub(super) bytes: Bytes,
    pub(super) held: Option<HeldBytes>,
}

/// The exchanges in progress on one connection, and when the last one ended.
struct Activity {
    state: Mutex<State>,
    /// The connection's place, which counts its requests in progress.
    mark: Arc<super::places::Mark>,
    /// Woken whenever an exchange starts answering or ends.
    changed: Notify,
}

struct State {
    in_flight: usize,
    last_end: Instant,
    /// Answers being sent: an id and when it began.
    answering: Vec<(u64, Instant)>,
    next_id: u64,
}

/// Why a connection is closed before the client closes it.
enum Close {
    Idle,
    /// An answer not taken within [`ANSWER_DEADLINE`].
    Stalled,
}

impl Activity {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// When to look again, or why to close now.
    fn check(&self, now: Instant) -> Result<Instant, Close> {
        let state = self.lock();
        let mut next = now + IDLE_TIMEOUT;
        if let Some(oldest) = state.answering.iter().map(|a| a.1).min() {
            let due = oldest + ANSWER_DEADLINE;
            if due <= now {
                return Err(Close::Stalled);
            }
            next = next.min(due);
        }
        if state.in_flight == 0 {
            let due = state.last_end + IDLE_TIMEOUT;
            if due <= now {
                return Err(Close::Idle);
            }
            next = next.min(due);
        }
        Ok(next)
    }

    async fn watch(&self) -> Close {
        loop {
            match self.check(Instant::now()) {
                Err(close) => return close,
                Ok(next) => {
                    // notify_one keeps a wake-up given before this waits.
                    tokio::select! {
                        () = tokio::time::sleep_until(next) => {}
                        () = self.changed.notified() => {}
                    }
                }
            }
        }
    }
}

/// One request, from its headers until its answer is sent or abandoned.
struct Exchange {
    activity: Arc<Activity>,
    answer: Option<u64>,
}

impl Exchange {
    fn start(activity: &Arc<Activity>) -> Exchange {
        activity.lock().in_flight += 1;
        activity.mark.start();
        Exchange {
            activity: activity.clone(),
            answer: None,
        }
    }

    /// The answer starts: from now it has [`ANSWER_DEADLINE`] to be taken.
    fn answering(mut self) -> Exchange {
        let mut state = self.activity.lock();
        let id = state.next_id;
        state.next_id += 1;
        state.answering.push((id, Instant::now()));
        drop(state);
        self.answer = Some(id);
        self.activity.changed.notify_one();
        self
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        self.activity.mark.end();
        let mut state = self.activity.lock();
        state.in_flight -= 1;
        state.last_end = Instant::now();
        if let Some(id) = self.answer {
            state.answering.retain(|a| a.0 != id);
        }
        drop(state);
        self.activity.changed.notify_one();
    }
}

/// An answer's body, given to hyper [`PIECE_BYTES`] at a time as the client
/// takes it; the exchange and its share of the answer budget end when hyper
/// drops it (sent, or the stream or connection gone).
pub(super) struct Answer {
    rest: Bytes,
    _held: Option<HeldBytes>,
    _exchange: Exchange,
}

impl http_body::Body for Answer {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let me = self.get_mut();
        if me.rest.is_empty() {
            return Poll::Ready(None);
        }
        let n = me.rest.len().min(PIECE_BYTES);
        // A copy: a slice would keep the whole answer alive for as long as
        // hyper or h2 holds the piece, after the budget has let it go.
        let piece = Bytes::copy_from_slice(&me.rest[..n]);
        me.rest.advance(n);
        Poll::Ready(Some(Ok(Frame::data(piece))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.rest.len() as u64)
    }
}

/// HTTP/1.1 or HTTP/2 on one TLS connection, until the client leaves or [`Close`].
pub(super) async fn serve_connection<I>(
    io: I,
    shared: Arc<Shared>,
    mark: Arc<super::places::Mark>,
    mut draining: tokio::sync::watch::Receiver<bool>,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity {
        state: Mutex::new(State {
            in_flight: 0,
            last_end: Instant::now(),
            answering: Vec::new(),
            next_id: 0,
        }),
        changed: Notify::new(),
        mark,
    });
    let service = {
        let activity = activity.clone();
        hyper::service::service_fn(move |req: Request<Incoming>| {
            let (shared, exchange) = (shared.clone(), Exchange::start(&activity));
            async move {
                let response = handle(&shared, req).await;
                let exchange = exchange.answering();
                Ok::<_, Infallible>(response.map(|reply| Answer {
                    rest: reply.bytes,
                    _held: reply.held,
                    _exchange: exchange,
                }))
            }
        })
    };
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // Without a timer hyper's header timeout is silently off.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HANDSHAKE_DEADLINE)
        .max_buf_size(MAX_HEADER_BYTES);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_send_buf_size(PIECE_BYTES)
        .max_header_list_size(16 << 10);
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    let closing = tokio::select! {
        r = connection.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "connection ended");
            }
            return;
        }
        close = activity.watch() => close,
        () = async { drop(draining.wait_for(|d| *d).await) } => {
            // Finishes the review in progress (HTTP/2: every open stream),
            // then closes; the injector's drain bounds the wait.
            connection.as_mut().graceful_shutdown();
            if let Err(e) = connection.as_mut().await {
                tracing::debug!(error = %e, "connection ended");
            }
            return;
        }
    };
    match closing {
        Close::Stalled => {
            // Dropped, not shut down gracefully: that would wait for the answer.
            tracing::warn!(
                deadline = ?ANSWER_DEADLINE,
                "an answer was not taken in time; connection closed"
            );
        }
        Close::Idle => {
            tracing::debug!("idle connection closed");
            connection.as_mut().graceful_shutdown();
            if let Ok(Err(e)) = tokio::time::timeout(HANDSHAKE_DEADLINE, connection.as_mut()).await
            {
                tracing::debug!(error = %e, "connection ended");
            }
        }
    }
}
