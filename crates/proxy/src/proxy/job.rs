//! The forward-and-complete work of one reserved request, in a task of its own:
//! a client that goes away does not cancel the upstream exchange, and the
//! outcome is still stored (or the key released).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::response::Parts;
use http::{HeaderMap, Request, Response};
use tracing::{debug, error, warn};
use uuid::Uuid;

use super::access::RequestPlace;
use super::verdict::storable_headers;
use crate::app::App;
use crate::body::{read_capped, Body, Capped, Cut};
use crate::budget::Room;
use crate::grpc;
use crate::metrics::{Degraded, Outcome};
use crate::policy::{Policy, UnknownOutcome};
use crate::problem::{self, Problem};
use crate::record::{now_ms, Finished, HeaderFields, Record, Token, TraceRef};
use crate::routes::RouteName;
use crate::store::{self, Completion, RecordKey, INLINE_RECORD};
use crate::telemetry;
use crate::typical::Typical;
use crate::upstream::{Inbound, UpstreamError};

mod settle;

/// Releases: attempts, and the first pause between them.
const STORE_ATTEMPTS: u32 = 3;
const FIRST_PAUSE: Duration = Duration::from_millis(25);
/// A record larger than this that cannot be stored whole is kept without its
/// body (410 `response-not-stored`) rather than retried to the end: its
/// pieces may be what the store cannot take in time. A smaller one is as
/// cheap to send as that small record, and is retried for the whole window.
const NOT_KEPT_ABOVE: usize = INLINE_RECORD as usize;

/// A reservation that is ours, or may be (a reserve whose answer was lost).
/// Until it is disarmed — by the job that completed or released it, or on
/// learning the key is someone else's — dropping it releases it by its token:
/// whatever ends the request early (an error, a client that hung up while the
/// reserve was in flight, a panic) leaves no `processing` entry behind
/// (docs/reference/failures.md#claim).
pub(crate) struct Claim {
    pub app: Arc<App>,
    pub store_key: RecordKey,
    pub token: Token,
    armed: bool,
}

impl Claim {
    pub fn new(app: Arc<App>, store_key: RecordKey, token: Token) -> Claim {
        Claim {
            app,
            store_key,
            token,
            armed: true,
        }
    }

    /// The key's fate is settled (or it was never ours): nothing to release.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        // Only in a runtime (always, but for a runtime shutting down, where the lease frees the key).
        if !self.armed || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let (app, key, token) = (self.app.clone(), self.store_key.clone(), self.token);
        self.app
            .tasks
            .spawn(async move { release(&app, key.as_str(), token).await });
    }
}

/// A reserved request's spans (tracing on): its SERVER span's context, for
/// the completion's span; the upstream exchange's CLIENT span; the trace
/// context its record keeps.
pub(crate) struct JobTrace {
    pub server: telemetry::Parent,
    pub client: Option<telemetry::ClientSpan>,
    pub record: Option<TraceRef>,
}

/// A reserved request: everything needed to finish it, owned, so it can outlive the client.
pub(crate) struct Job {
    /// Tracing on: the request's spans (boxed: `None` costs a word).
    pub trace: Option<Box<JobTrace>>,
    pub claim: Claim,
    pub route_name: RouteName,
    pub policy: Arc<Policy>,
    pub fingerprint: [u8; 32],
    pub created_ms: u64,
    pub request_id: Uuid,
    /// A gRPC request: its own failure answers are gRPC errors, and the
    /// answer's `grpc-status` may release the key (docs/reference/behaviour.md#release).
    pub grpc: bool,
    /// When the lease runs out unless renewed (from before the reserve was sent, to be safe).
    pub lease_until: std::sync::Mutex<tokio::time::Instant>,
    /// The finished record the store has not taken yet (or not replicated).
    pub unsaved: Option<Unsaved>,
    /// The request body's room in the budget, until the upstream has it.
    pub request_room: Option<Room>,
    /// The route's typical upstream duration, which each whole answer updates.
    pub typical: Arc<Typical>,
    /// The request's place in `idemproxy_inflight` and among the requests
    /// in progress, until the job ends (the client may be gone).
    pub _place: RequestPlace,
}

/// A completion the store has not taken yet (or not replicated), for [`Job::settle`].
pub(crate) struct Unsaved {
    /// The finished record, encoded (sealed) once: every attempt sends the same bytes.
    whole: Bytes,
    /// The small record stored when the whole one cannot be: status and
    /// headers, no body (retries get the 410 `response-not-stored`). `None`
    /// when the whole record is that small already.
    not_kept: Option<Bytes>,
    /// How the first attempt went.
    last: Attempt,
    /// When the first attempt was sent: the retries' window counts from it.
    since: tokio::time::Instant,
    /// A large `whole`'s room in the memory budget, while it is kept.
    _room: Option<Room>,
}

/// How one completion attempt went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// Stored, or the key is someone else's now: nothing more to do.
    Settled,
    /// Stored on the master, too few replicas acknowledged it: write it again.
    Unreplicated,
    /// The store did not take it.
    Failed,
}

/// The reason phrase an HTTP/1.1 upstream sent when it is not the status's
/// usual one (hyper keeps only such), for replays to repeat; at most 255
/// bytes, as a record keeps it.
fn reason_phrase(parts: &Parts) -> Option<Bytes> {
    let reason = parts
        .extensions
        .get::<hyper::ext::ReasonPhrase>()?
        .as_bytes();
    // (An empty one is hyper's for a phrase that was not UTF-8: not kept.)
    (!reason.is_empty() && reason.len() <= usize::from(u8::MAX))
        .then(|| Bytes::copy_from_slice(reason))
}

/// A header map's fields as a record keeps them.
fn fields(map: &HeaderMap) -> HeaderFields {
    map.iter().map(|(n, v)| (n.clone(), v.clone())).collect()
}

/// The upstream's answer with its body read up to `max_response_body`, and its room in the budget.
type Exchanged = (Parts, Capped<Inbound>, Room);

impl Job {
    /// The trace and span ids of the request's SERVER span for a log line, while it records.
    fn log_ids(&self) -> (Option<String>, Option<String>) {
        self.trace.as_ref().and_then(|t| t.server.log_ids()).unzip()
    }

    /// Forwards, records the outcome (or releases the key), and returns the
    /// client's answer. A record the store did not take is kept for [`Job::settle`].
    pub async fn run(&mut self, request: Request<Body>) -> (Response<Body>, Outcome) {
        // Pinned here and lent: moved into `holding_lease`, the exchange's
        // state (~2.7 KiB) would be held twice and copied between the two.
        let exchanged = {
            // One clock read for the upstream's deadline, its metric and the lease's first renewal.
            let sent = tokio::time::Instant::now();
            let exchange = std::pin::pin!(self.exchange(request, sent));
            let exchanged = self.holding_lease(exchange, sent).await;
            (exchanged, sent.elapsed())
        };
        let (exchanged, took) = exchanged;
        if let Some(client) = self.trace.as_mut().and_then(|t| t.client.take()) {
            client.end(match &exchanged {
                Ok((parts, ..)) => Ok(parts.status.as_u16()),
                Err(e) => Err(telemetry::upstream_error_type(e)),
            });
        }
        self.request_room = None;
        match exchanged {
            Ok((parts, Capped::Whole(body, trailers), room)) => {
                let (resp, outcome) = self.answered(parts, body, trailers, took).await;
                (resp.map(|b| b.counted(room)), outcome)
            }
            Ok((parts, Capped::Partial(read, rest, cut), room)) => {
                self.not_kept(&parts, &cut).await;
                let body = Body::Prefixed(Some(read), rest).counted(room);
                (Response::from_parts(parts, body), Outcome::Forwarded)
            }
            Err(e) => self.failed(e).await,
        }
    }

    /// After the client has its answer: a record the store did not take is
    /// retried in the background, a bounded number of times within the
    /// lease (see [`Job::complete_in_background`]); then the key's fate is
    /// settled either way.
    pub async fn settle(mut self) {
        if let Some(unsaved) = self.unsaved.take() {
            self.complete_in_background(unsaved).await;
        }
        self.claim.disarm();
    }

    /// Sends the request and reads the whole answer, bounded by the upstream
    /// timeout and by the end of the shutdown grace (either way: outcome unknown).
    async fn exchange(
        &self,
        request: Request<Body>,
        sent: tokio::time::Instant,
    ) -> Result<Exchanged, UpstreamError> {
        let app = &self.claim.app;
        let exchange = async {
            let resp = app.upstream.send(request).await?;
            app.metrics.upstream(sent.elapsed());
            let (mut parts, body) = resp.into_parts();
            // Only replays carry the replay header: an upstream's own is not relayed
            // (docs/reference/behaviour.md#replay).
            parts.headers.remove(&self.policy.replayed_header);
            let limit = self.policy.max_response_body;
            let declared = http_body::Body::size_hint(&body).lower();
            let Some(mut room) = app.budget.take(if declared > limit { 0 } else { declared })
            else {
                // No room even for the declared length: relayed as it comes, not kept.
                let nothing = Capped::Partial(Bytes::new(), body, Cut::NoRoom);
                return Ok((parts, nothing, app.budget.nothing()));
            };
            match read_capped(body, limit, None, &mut room).await {
                Capped::Partial(_, _, Cut::Failed(e)) => Err(UpstreamError::Exchange(format!(
                    "response body cut off: {e}"
                ))),
                body => Ok((parts, body, room)),
            }
        };
        let deadlines = app.upstream.deadlines();
        let timeout = deadlines.after();
        tokio::select! {
            r = deadlines.within(sent, exchange) => r.unwrap_or(Err(UpstreamError::Timeout(timeout))),
            // Cut by the end of the drain: a timeout (unknown_outcome applies),
            // after the time actually waited, not the timeout not reached.
            () = app.hard_stop.cancelled() => Err(UpstreamError::Timeout(sent.elapsed())),
        }
    }

    /// A whole answer, `took` from sending to its last byte: released when
    /// its status (or, from a gRPC upstream, its `grpc-status`) says "try
    /// again", stored with its trailers otherwise.
    async fn answered(
        &mut self,
        parts: Parts,
        body: Bytes,
        trailers: Option<HeaderMap>,
        took: Duration,
    ) -> (Response<Body>, Outcome) {
        let status = parts.status.as_u16();
        let grpc = grpc::is_grpc(&parts.headers);
        let grpc_status = grpc
            .then(|| grpc::status_of(&parts.headers, trailers.as_ref()))
            .flatten();
        let grpc_release =
            grpc_status.is_some_and(|s| self.policy.release_grpc_statuses.contains(&s));
        let outcome = if grpc_release || self.policy.release_statuses.contains(&status) {
            self.release().await;
            Outcome::Released
        } else {
            // What a duplicate's 409 estimates from: successes stored, and
            // only they (docs/reference/behaviour.md#conflict). A client's
            // fast 4xx, a failure's time, a timeout's above all, says nothing
            // of how long the operation takes.
            if parts.status.is_success() && (!grpc || grpc_status == Some(0)) {
                self.typical.observe(took);
            }
            let headers = storable_headers(&parts.headers);
            let kept = trailers.as_ref().map_or_else(Vec::new, storable_headers);
            let reason = reason_phrase(&parts);
            self.complete((status, reason), (headers, kept), body.clone(), true)
                .await;
            Outcome::Forwarded
        };
        let body = Body::full(body).trailed(trailers);
        (Response::from_parts(parts, body), outcome)
    }

    /// An answer not kept — over `max_response_body`, or no room in the memory
    /// budget — is relayed whole, and its record says the operation happened.
    async fn not_kept(&mut self, parts: &Parts, cut: &Cut<hyper::Error>) {
        let why = match cut {
            Cut::NoRoom => "no room in max_buffered",
            _ => "larger than max_response_body",
        };
        warn!(
            request_id = %self.request_id,
            route = %self.route_name,
            limit = self.policy.max_response_body,
            why,
            "response not kept; retries will get 410"
        );
        let headers = storable_headers(&parts.headers);
        let status = parts.status.as_u16();
        let reason = reason_phrase(parts);
        self.complete((status, reason), (headers, Vec::new()), Bytes::new(), false)
            .await;
    }

    /// No answer: a request that never left frees its key; otherwise the
    /// outcome is unknown, and `unknown_outcome` says whether to store the problem.
    async fn failed(&mut self, e: UpstreamError) -> (Response<Body>, Outcome) {
        let released = matches!(e, UpstreamError::Connect(_) | UpstreamError::Invalid(_))
            || self.policy.unknown_outcome == UnknownOutcome::Release;
        let (trace_id, span_id) = self.log_ids();
        warn!(request_id = %self.request_id, error = %e, released, trace_id, span_id, "upstream failed");
        let problem = Problem::from_upstream(&e, released);
        // On a gRPC call, Trailers-Only (no body, no trailers), stored so too.
        let (status, headers, body) = if self.grpc {
            let (status, headers) = problem.render_grpc(&self.request_id);
            (status, headers, Bytes::new())
        } else {
            problem.render(&self.request_id)
        };
        if released {
            self.release().await;
        } else {
            let fields = (fields(&headers), Vec::new());
            self.complete((status.as_u16(), None), fields, body.clone(), true)
                .await;
        }
        (
            problem::assemble((status, headers, body)),
            problem.outcome(),
        )
    }

    /// Runs `fut` while renewing the lease every third of it, so a slow upstream keeps the key.
    async fn holding_lease<F: std::future::Future>(
        &self,
        mut fut: Pin<&mut F>,
        from: tokio::time::Instant,
    ) -> F::Output {
        let period = (self.policy.lease / 3).max(Duration::from_millis(10));
        let mut tick = tokio::time::interval_at(from + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut held = true;
        loop {
            tokio::select! {
                biased;
                out = &mut fut => return out,
                _ = tick.tick(), if held => held = self.renew().await,
            }
        }
    }

    /// One renewal; false once the key is no longer ours (then renewing stops).
    async fn renew(&self) -> bool {
        let (app, lease) = (&self.claim.app, self.policy.lease);
        let asked = tokio::time::Instant::now();
        // The store keeps the reservation its afterlife past the lease.
        let hold = self.policy.reservation_hold();
        match app
            .store
            .renew(self.claim.store_key.as_str(), self.claim.token, hold)
            .await
        {
            Ok(true) => {
                *self.lease_until.lock().unwrap_or_else(|e| e.into_inner()) = asked + lease;
                true
            }
            Ok(false) => {
                app.metrics.lease_lost(&self.route_name);
                warn!(
                    request_id = %self.request_id,
                    route = %self.route_name,
                    "lease lost while the upstream was working; this answer is not stored (the key's next request found the lease over: it got 502 outcome-unknown, or ran again under lease_expiry = re_execute or unknown_outcome = release)"
                );
                false
            }
            Err(e) => {
                warn!(request_id = %self.request_id, error = %e, "lease renewal failed");
                true
            }
        }
    }

    /// Stores the finished record; if the store does not take it, the client
    /// gets its answer at once and [`Job::settle`] keeps trying.
    async fn complete(
        &mut self,
        (status, reason): (u16, Option<Bytes>),
        (headers, trailers): (HeaderFields, HeaderFields),
        body: Bytes,
        body_stored: bool,
    ) {
        // Ended when this returns: the first attempt (retries are the background's).
        let _span = self.trace.as_ref().and_then(|t| {
            let attributes = || {
                telemetry::record_attributes(self.route_name.as_str(), self.claim.store_key.id())
            };
            let tracer = self.claim.app.telemetry.as_ref()?;
            tracer.child(&t.server, "idempotency.complete", attributes)
        });
        let (room, (body_stored, body, trailers)) = self.room_for_copy(body_stored, body, trailers);
        let finished = Finished {
            token: self.claim.token,
            fingerprint: self.fingerprint,
            created_ms: self.created_ms,
            route: self.route_name.to_string(),
            trace: self.trace.as_ref().and_then(|t| t.record),
            completed_ms: now_ms(),
            status,
            reason,
            body_stored,
            headers,
            body,
            trailers,
        };
        // Sealed here, once: a retried completion sends the same bytes.
        let Some(whole) = self.encode(&Record::Finished(finished.clone())) else {
            return;
        };
        let since = tokio::time::Instant::now();
        let last = self.try_complete(whole.clone(), true).await;
        if last == Attempt::Settled {
            return;
        }
        let not_kept = (body_stored && whole.len() > NOT_KEPT_ABOVE)
            .then(|| self.without_body(finished))
            .flatten();
        self.unsaved = Some(Unsaved {
            whole,
            not_kept,
            last,
            since,
            _room: room,
        });
    }

    /// Room in `max_buffered` for the record's copy of a large answer: the
    /// record the store gets (encoded, maybe sealed) counts beside the answer
    /// on its way to the client, for as long as it is kept (its first
    /// attempt, which takes a while piece by piece, and its retries). Without
    /// room for it, the answer is kept without its body (410), as one without
    /// room while it was read; it never runs again. The room, and the body
    /// and trailers to keep.
    fn room_for_copy(
        &self,
        body_stored: bool,
        body: Bytes,
        trailers: HeaderFields,
    ) -> (Option<Room>, (bool, Bytes, HeaderFields)) {
        let large = body_stored && body.len() > NOT_KEPT_ABOVE;
        let room = large
            .then(|| self.claim.app.budget.take(body.len() as u64))
            .flatten();
        if !large || room.is_some() {
            return (room, (body_stored, body, trailers));
        }
        warn!(
            request_id = %self.request_id,
            route = %self.route_name,
            bytes = body.len(),
            why = "no room in max_buffered for the record",
            "response not kept; retries will get 410"
        );
        self.claim
            .app
            .metrics
            .degraded(&self.route_name, Degraded::NotKept);
        (None, (false, Bytes::new(), Vec::new()))
    }

    /// The small record [`Job::settle`] falls back to when the whole one
    /// cannot be stored: `finished` without its body (retries get the 410).
    fn without_body(&self, finished: Finished) -> Option<Bytes> {
        self.encode(&Record::Finished(Finished {
            body_stored: false,
            body: Bytes::new(),
            trailers: Vec::new(),
            ..finished
        }))
    }

    /// A record as the store keeps it (sealed when a key file is configured);
    /// `None`, logged, when it cannot be sealed.
    fn encode(&self, record: &Record) -> Option<Bytes> {
        let app = &self.claim.app;
        match app.store.encode(self.claim.store_key.as_str(), record) {
            Ok(encoded) => Some(encoded),
            Err(e) => {
                error!(
                    request_id = %self.request_id,
                    route = %self.route_name,
                    error = %e,
                    "the record could not be sealed and is not stored; once the lease runs out a retry with this key gets 502 outcome-unknown (or runs again under lease_expiry = re_execute or unknown_outcome = release)"
                );
                None
            }
        }
    }

    /// One completion attempt: settled (stored, or someone else's), to be
    /// written again, or to be retried after a failure. `whole`: the whole
    /// record, whose attempt the end of the shutdown grace cuts short (a
    /// large one takes a round trip per piece), so that the small record
    /// still has its turn.
    async fn try_complete(&self, record: Bytes, whole: bool) -> Attempt {
        let (claim, ttl) = (&self.claim, self.policy.ttl);
        let stored = claim
            .app
            .store
            .complete(claim.store_key.as_str(), claim.token, record, ttl);
        let (id, route) = (&self.request_id, &self.route_name);
        let stored = async {
            if !whole {
                return stored.await;
            }
            tokio::select! {
                stored = stored => stored,
                () = claim.app.hard_stop.cancelled() => Err(store::StoreError::Backend(
                    "cut short at the end of the shutdown grace".into(),
                )),
            }
        };
        match stored.await {
            Ok(Completion::Stored) => Attempt::Settled,
            Ok(Completion::StoredAfterExpiry) => {
                warn!(request_id = %id, route = %route, "lease had expired before completion; nobody else held the key, record stored");
                Attempt::Settled
            }
            Ok(Completion::Refused) => {
                claim.app.metrics.lease_lost(route);
                warn!(request_id = %id, route = %route, "completion refused: another request owns the key now");
                Attempt::Settled
            }
            Ok(Completion::Unreplicated { wanted, acked }) => {
                claim.app.metrics.degraded(route, Degraded::Unreplicated);
                warn!(request_id = %id, route = %route, wanted, acked, "record stored, but too few replicas acknowledged it; writing it again while the lease lasts");
                Attempt::Unreplicated
            }
            Err(e) => {
                warn!(request_id = %id, error = %e, "storing the record failed; retrying while the lease lasts");
                Attempt::Failed
            }
        }
    }

    async fn release(&self) {
        release(
            &self.claim.app,
            self.claim.store_key.as_str(),
            self.claim.token,
        )
        .await;
    }
}

/// Releases a reservation by its token, retrying briefly; if it cannot be
/// released, the lease frees it. One warning per release that failed (not
/// per attempt: during a store outage every request's release fails).
pub async fn release(app: &App, store_key: &str, token: Token) {
    let r = store::retry(STORE_ATTEMPTS, FIRST_PAUSE, |attempt| async move {
        let r = app.store.release(store_key, token).await;
        if let Err(e) = &r {
            debug!(error = %e, attempt, "a release attempt failed");
        }
        r
    })
    .await;
    if let Err(e) = r {
        warn!(error = %e, attempts = STORE_ATTEMPTS, "releasing a reservation failed; the lease will free it");
    }
}
