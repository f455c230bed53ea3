//! The export queue and the export thread.
//!
//! A finished span is put in a plain locked `Vec` without waiting (a span the
//! queue has no room for is dropped and counted); the export thread is woken
//! once a batch is queued, or takes what is there on its tick. It encodes the
//! batch into a buffer it reuses ([`Encoder`]) and posts it to the collector,
//! over OTLP/gRPC (HTTP/2 without TLS) or OTLP/HTTP with protobuf bodies, on
//! a runtime of its own that lives as long as the process.
//!
//! The queue is a plain locked `Vec`, not a channel, and wakes the export
//! thread once per [`BATCH`] spans (a wake is a syscall and two context
//! switches). Measured beside the OpenTelemetry SDK's spans with this queue
//! and with the SDK's `BatchSpanProcessor`, both with its OTLP exporter
//! (docs/telemetry.md#cost): the SDK's batch processor cost slightly more
//! than this queue, and the SDK's spans and exporter three to four times
//! what these records and this encoding cost.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::mpsc;

use super::otlp::{self, Encoder, Rejected};
use super::span::SpanRecord;
use crate::config::OtlpProtocol;

/// Spans sent to the collector at once, at most.
pub(crate) const BATCH: usize = 512;
/// A batch not full is sent after this.
const DELAY: Duration = Duration::from_secs(1);
/// One export, at most (then its spans are dropped and counted).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// The most of a collector's answer read (a partial success names what it refused).
const MAX_ANSWER: usize = 64 * 1024;

/// What the request path and the export thread share.
#[derive(Debug)]
pub(crate) struct SpanQueue {
    spans: Mutex<Queued>,
    /// A batch is ready, or the queue is closed.
    wake: tokio::sync::Notify,
    closed: AtomicBool,
    capacity: usize,
    dropped: Counter,
}

/// The spans queued, and how many taken are still being exported.
#[derive(Debug, Default)]
struct Queued {
    queued: Vec<SpanRecord>,
    exporting: usize,
}

impl SpanQueue {
    pub fn new(capacity: usize, dropped: Counter) -> Arc<SpanQueue> {
        Arc::new(SpanQueue {
            spans: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            closed: AtomicBool::new(false),
            capacity,
            dropped,
        })
    }

    fn held(&self) -> MutexGuard<'_, Queued> {
        self.spans.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a finished span, or drops and counts it when there is no room
    /// (spans taken and not yet exported count against the capacity too).
    pub fn push(&self, span: SpanRecord) {
        let queued = {
            let mut held = self.held();
            if held.queued.len() + held.exporting >= self.capacity {
                None
            } else {
                held.queued.push(span);
                Some(held.queued.len())
            }
        };
        match queued {
            None => {
                self.dropped.inc();
            }
            Some(BATCH) => self.wake.notify_one(),
            Some(_) => {}
        }
    }

    /// Everything queued, counted as being exported until [`SpanQueue::exported`].
    pub fn take(&self) -> Vec<SpanRecord> {
        let mut held = self.held();
        let spans = std::mem::take(&mut held.queued);
        held.exporting += spans.len();
        spans
    }

    /// `n` spans taken are gone (sent or dropped): room for as many.
    pub fn exported(&self, n: usize) {
        let mut held = self.held();
        held.exporting = held.exporting.saturating_sub(n);
    }

    /// No more spans come: the export thread sends the last and ends.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    #[cfg(test)]
    pub async fn woken(&self) -> bool {
        tokio::time::timeout(Duration::ZERO, self.wake.notified())
            .await
            .is_ok()
    }
}

/// Where batches go.
pub(crate) struct Destination {
    pub protocol: OtlpProtocol,
    pub endpoint: String,
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

/// A flush request: answered once what was queued before it is sent.
pub(crate) type Flush = std::sync::mpsc::SyncSender<()>;

/// Starts the export thread; an error when it or its sender cannot be made.
pub fn start(
    to: Destination,
    encoder: Encoder,
    queue: Arc<SpanQueue>,
    flushes: mpsc::UnboundedReceiver<Flush>,
) -> Result<(), String> {
    let (ready, built) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("otel-export".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready.send(Err(e.to_string()));
                    return;
                }
            };
            runtime.block_on(async move {
                let sender = match Sender::new(to) {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                let _ = ready.send(Ok(()));
                export_loop(sender, encoder, queue, flushes).await;
            });
        })
        .map_err(|e| e.to_string())?;
    built.recv().map_err(|e| e.to_string())?
}

/// Posts encoded batches to the collector.
struct Sender {
    client: Client<HttpConnector, Full<Bytes>>,
    uri: Uri,
    grpc: bool,
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl Sender {
    fn new(to: Destination) -> Result<Sender, String> {
        let grpc = to.protocol == OtlpProtocol::Grpc;
        let uri: Uri = if grpc {
            let base: Uri = to.endpoint.parse().map_err(|e| format!("{e}"))?;
            let authority = base.authority().ok_or("the endpoint has no host")?;
            format!("http://{authority}/opentelemetry.proto.collector.trace.v1.TraceService/Export")
                .parse()
                .map_err(|e| format!("{e}"))?
        } else {
            super::http_traces_url(&to.endpoint)
                .parse()
                .map_err(|e| format!("{e}"))?
        };
        Ok(Sender {
            client: Sender::client(grpc),
            uri,
            grpc,
            headers: to.headers,
        })
    }

    /// A client with no connection yet. HTTP/2 connections are pinged
    /// while idle: one the collector (or something between) stopped
    /// answering is closed, not reused for ever.
    fn client(grpc: bool) -> Client<HttpConnector, Full<Bytes>> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(EXPORT_TIMEOUT));
        Client::builder(TokioExecutor::new())
            .http2_only(grpc)
            .timer(hyper_util::rt::TokioTimer::new())
            .http2_keep_alive_interval(Some(Duration::from_secs(10)))
            .http2_keep_alive_timeout(EXPORT_TIMEOUT)
            .http2_keep_alive_while_idle(true)
            .build(connector)
    }

    /// After a failed export: its connection is not used again (a stream
    /// that timed out is reset, but its connection would stay pooled).
    fn reconnect(&mut self) {
        self.client = Sender::client(self.grpc);
    }

    /// The first bytes of a batch's body: gRPC's message prefix, filled in by [`Sender::send`].
    fn prefix(&self) -> &'static [u8] {
        if self.grpc {
            &[0; 5]
        } else {
            &[]
        }
    }

    /// Posts `body` (after [`Sender::prefix`]); `Ok` when the collector
    /// took it, with the spans it said it rejected (a partial success).
    async fn send(&self, body: &mut [u8]) -> Result<Option<Rejected>, String> {
        let content_type = if self.grpc {
            let len = u32::try_from(body.len() - 5).map_err(|_| "batch too large")?;
            body[1..5].copy_from_slice(&len.to_be_bytes());
            "application/grpc"
        } else {
            "application/x-protobuf"
        };
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(self.uri.clone())
            .header(http::header::CONTENT_TYPE, content_type);
        if self.grpc {
            req = req.header(http::header::TE, "trailers");
        }
        for (name, value) in &self.headers {
            req = req.header(name, value);
        }
        let req = req
            .body(Full::new(Bytes::copy_from_slice(body)))
            .map_err(|e| e.to_string())?;
        let resp = self.client.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let early = resp.headers().get("grpc-status").cloned();
        let answer = Limited::new(resp.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!("the collector answered {status}"));
        }
        let answer = if self.grpc {
            let grpc_status = early.or_else(|| answer.trailers()?.get("grpc-status").cloned());
            match grpc_status.as_ref().map(HeaderValue::as_bytes) {
                Some(b"0") => {}
                // Only a number is repeated in the log: the collector chose the rest.
                Some(code) if code.len() <= 2 && code.iter().all(u8::is_ascii_digit) => {
                    let code = String::from_utf8_lossy(code);
                    return Err(format!("the collector answered grpc-status {code}"));
                }
                Some(_) => {
                    return Err("the collector answered a grpc-status that is not a number".into())
                }
                None => return Err("the collector's answer has no grpc-status".into()),
            }
            // One uncompressed message after gRPC's five-byte prefix.
            let bytes = answer.to_bytes();
            bytes.slice(5.min(bytes.len())..)
        } else {
            answer.to_bytes()
        };
        Ok(otlp::rejected(&answer))
    }
}

async fn export_loop(
    mut sender: Sender,
    mut encoder: Encoder,
    queue: Arc<SpanQueue>,
    mut flushes: mpsc::UnboundedReceiver<Flush>,
) {
    let mut failing = false;
    let mut rejecting = false;
    let mut tick = tokio::time::interval(DELAY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut no_flushes = false;
    let mut buf = Vec::new();
    loop {
        let mut done = None;
        tokio::select! {
            () = queue.wake.notified() => {}
            flush = flushes.recv(), if !no_flushes => {
                no_flushes = flush.is_none();
                done = flush;
            }
            _ = tick.tick() => {}
        }
        // Everything queued so far goes now (a flush's spans with it).
        let closed = queue.is_closed();
        let batch = queue.take();
        for spans in batch.chunks(BATCH) {
            buf.clear();
            buf.extend_from_slice(sender.prefix());
            encoder.encode(spans, &mut buf);
            let sent = tokio::time::timeout(EXPORT_TIMEOUT, sender.send(&mut buf)).await;
            let error = match sent {
                Ok(Ok(rejected)) => {
                    // No more than were sent: the count is the collector's word.
                    let n = rejected
                        .as_ref()
                        .map_or(0, |r| r.spans.min(spans.len() as u64));
                    queue.dropped.inc_by(n);
                    if let (Some(r), false) = (&rejected, rejecting) {
                        tracing::warn!(
                            spans = n,
                            message = r.message,
                            "the collector rejected spans (a partial success); \
                             logged again once it has taken a batch whole"
                        );
                    }
                    rejecting = n > 0;
                    None
                }
                Ok(Err(e)) => Some(e),
                Err(_) => Some("no answer within 5s".to_string()),
            };
            if error.is_some() {
                queue.dropped.inc_by(spans.len() as u64);
                sender.reconnect();
            }
            queue.exported(spans.len());
            match (&error, failing) {
                (Some(e), false) => tracing::warn!(
                    spans = spans.len(),
                    error = %e,
                    "span export failed; spans are dropped until the collector takes them"
                ),
                (None, true) => tracing::info!("span export works again"),
                _ => {}
            }
            failing = error.is_some();
        }
        // Big batches' buffers are not kept: a burst does not pin its peak.
        if buf.capacity() > 4 << 20 {
            buf = Vec::new();
        }
        drop(batch);
        if let Some(done) = done {
            let _ = done.send(());
        }
        if closed {
            return;
        }
    }
}
