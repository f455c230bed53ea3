//! The forward-and-complete work of one reserved request, in a task of its own:
//! a client that goes away does not cancel the upstream exchange, and the
//! outcome is still stored (or the key released).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::response::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use tracing::{error, info, warn};
use uuid::Uuid;

use super::access::Held;
use super::verdict::storable_headers;
use crate::app::App;
use crate::body::{read_capped, Body, Capped, Cut};
use crate::budget::Room;
use crate::grpc;
use crate::metrics::Outcome;
use crate::policy::{Policy, UnknownOutcome};
use crate::problem::{self, Problem};
use crate::record::{now_ms, Finished, Record, Token};
use crate::routes::RouteName;
use crate::store::{self, Completion, RecordKey};
use crate::upstream::{Inbound, UpstreamError};

/// Releases: attempts, and the first pause between them.
const STORE_ATTEMPTS: u32 = 3;
const FIRST_PAUSE: Duration = Duration::from_millis(25);
/// The longest pause between background completion attempts.
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// A reservation that is ours, or may be (a reserve whose answer was lost).
/// Until it is disarmed — by the job that completed or released it, or on
/// learning the key is someone else's — dropping it releases it by its token:
/// whatever ends the request early (an error, a client that hung up while the
/// reserve was in flight, a panic) leaves no `processing` entry behind (§8).
pub struct Claim {
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
    pub fn disarm(&mut self) {
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

/// A reserved request: everything needed to finish it, owned, so it can outlive the client.
pub struct Job {
    pub claim: Claim,
    pub route_name: RouteName,
    pub policy: Arc<Policy>,
    pub fingerprint: [u8; 32],
    pub created_ms: u64,
    pub request_id: Uuid,
    /// A gRPC request: its own failure answers are gRPC errors, and the
    /// answer's `grpc-status` may release the key (§9).
    pub grpc: bool,
    /// When the lease runs out unless renewed (from before the reserve was sent, to be safe).
    pub lease_until: std::sync::Mutex<tokio::time::Instant>,
    /// The finished record the store has not taken yet (or not replicated),
    /// and how its last attempt went.
    pub unsaved: Option<(Bytes, Attempt)>,
    /// The request body's room in the budget, until the upstream has it.
    pub request_room: Option<Room>,
    /// The request's place in `idemproxy_inflight` and among the requests
    /// in progress, until the job ends (the client may be gone).
    pub _held: Held,
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

/// Header or trailer fields as a record keeps them.
type Fields = Vec<(HeaderName, HeaderValue)>;

fn fields(map: &HeaderMap) -> Fields {
    map.iter().map(|(n, v)| (n.clone(), v.clone())).collect()
}

/// The upstream's answer with its body read up to `max_response_body`, and its room in the budget.
type Exchanged = (Parts, Capped<Inbound>, Room);

impl Job {
    /// Forwards, records the outcome (or releases the key), and returns the
    /// client's answer. A record the store did not take is kept for [`Job::settle`].
    pub async fn run(&mut self, request: Request<Body>) -> (Response<Body>, Outcome) {
        // Pinned here and lent: moved into `holding_lease`, the exchange's
        // state (~2.7 KiB) would be held twice and copied between the two.
        let exchanged = {
            // One clock read for the upstream's deadline, its metric and the lease's first renewal.
            let sent = tokio::time::Instant::now();
            let exchange = std::pin::pin!(self.exchange(request, sent));
            self.holding_lease(exchange, sent).await
        };
        self.request_room = None;
        match exchanged {
            Ok((parts, Capped::Whole(body, trailers), room)) => {
                let (resp, outcome) = self.answered(parts, body, trailers).await;
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

    /// After the client has its answer: a record the store refused to take is
    /// retried until the lease would run out (a store failover shorter than the
    /// lease loses nothing, §8); then the key's fate is settled either way.
    pub async fn settle(mut self) {
        if let Some((record, last)) = self.unsaved.take() {
            tokio::select! {
                () = self.complete_in_background(record, last) => {}
                // The end of the shutdown grace: the lease frees the key.
                () = self.claim.app.hard_stop.cancelled() => {}
            }
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
            // Only replays carry the replay header: an upstream's own is not relayed (§7).
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
            () = app.hard_stop.cancelled() => Err(UpstreamError::Timeout(timeout)),
        }
    }

    /// A whole answer: released when its status (or, from a gRPC upstream, its
    /// `grpc-status`) says "try again", stored with its trailers otherwise.
    async fn answered(
        &mut self,
        parts: Parts,
        body: Bytes,
        trailers: Option<HeaderMap>,
    ) -> (Response<Body>, Outcome) {
        let status = parts.status.as_u16();
        let grpc_release = grpc::is_grpc(&parts.headers)
            && grpc::status_of(&parts.headers, trailers.as_ref())
                .is_some_and(|s| self.policy.release_grpc_statuses.contains(&s));
        let outcome = if grpc_release || self.policy.release_statuses.contains(&status) {
            self.release().await;
            Outcome::Released
        } else {
            let headers = storable_headers(&parts.headers);
            let kept = trailers.as_ref().map_or_else(Vec::new, storable_headers);
            self.complete(status, (headers, kept), body.clone(), true)
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
        self.complete(status, (headers, Vec::new()), Bytes::new(), false)
            .await;
    }

    /// No answer: a request that never left frees its key; otherwise the
    /// outcome is unknown, and `unknown_outcome` says whether to store the problem.
    async fn failed(&mut self, e: UpstreamError) -> (Response<Body>, Outcome) {
        let released = matches!(e, UpstreamError::Connect(_))
            || self.policy.unknown_outcome == UnknownOutcome::Release;
        warn!(request_id = %self.request_id, error = %e, released, "upstream failed");
        let problem = Problem::from_upstream(&e, released);
        let (status, headers, body, trailers) = if self.grpc {
            grpc::render(&problem, &self.request_id)
        } else {
            let (status, headers, body) = problem.render(&self.request_id);
            (status, headers, body, HeaderMap::new())
        };
        if released {
            self.release().await;
        } else {
            let fields = (fields(&headers), fields(&trailers));
            self.complete(status.as_u16(), fields, body.clone(), true)
                .await;
        }
        let response = problem::assemble((status, headers, body));
        (problem::trailed(response, trailers), problem.outcome())
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
        match app
            .store
            .renew(self.claim.store_key.as_str(), self.claim.token, lease)
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
                    "lease lost while the upstream was working; a retry may execute again"
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
        status: u16,
        (headers, trailers): (Fields, Fields),
        body: Bytes,
        body_stored: bool,
    ) {
        let record = Record::Finished(Finished {
            token: self.claim.token,
            fingerprint: self.fingerprint,
            created_ms: self.created_ms,
            route: self.route_name.to_string(),
            completed_ms: now_ms(),
            status,
            body_stored,
            headers,
            body,
            trailers,
        });
        // Sealed here, once: a retried completion sends the same bytes.
        let record = match self
            .claim
            .app
            .store
            .encode(self.claim.store_key.as_str(), &record)
        {
            Ok(record) => record,
            Err(e) => {
                error!(
                    request_id = %self.request_id,
                    route = %self.route_name,
                    error = %e,
                    "the record could not be sealed and is not stored; a retry with this key will execute again once the lease runs out"
                );
                return;
            }
        };
        match self.try_complete(record.clone()).await {
            Attempt::Settled => {}
            last => self.unsaved = Some((record, last)),
        }
    }

    /// One completion attempt: settled (stored, or someone else's), to be
    /// written again, or to be retried after a failure.
    async fn try_complete(&self, record: Bytes) -> Attempt {
        let (claim, ttl) = (&self.claim, self.policy.ttl);
        let stored = claim
            .app
            .store
            .complete(claim.store_key.as_str(), claim.token, record, ttl);
        let (id, route) = (&self.request_id, &self.route_name);
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
                warn!(request_id = %id, route = %route, wanted, acked, "record stored, but too few replicas acknowledged it; writing it again while the lease lasts");
                Attempt::Unreplicated
            }
            Err(e) => {
                warn!(request_id = %id, error = %e, "storing the record failed; retrying while the lease lasts");
                Attempt::Failed
            }
        }
    }

    /// Retries a completion until it is settled or the lease would run out.
    /// After a failure the lease is renewed where it can be, unless a write
    /// has reached a master already (an unreplicated one): that master holds
    /// the finished record, which a renewal would take for a lost lease.
    async fn complete_in_background(&self, record: Bytes, mut last: Attempt) {
        let mut pause = FIRST_PAUSE;
        let mut written = last == Attempt::Unreplicated;
        loop {
            let until = *self.lease_until.lock().unwrap_or_else(|e| e.into_inner());
            if tokio::time::Instant::now() + pause >= until {
                if last == Attempt::Unreplicated {
                    warn!(
                        request_id = %self.request_id,
                        route = %self.route_name,
                        "record stored, but not acknowledged by enough replicas before the lease ran out; a failover now could execute a retry again"
                    );
                } else {
                    error!(
                        request_id = %self.request_id,
                        route = %self.route_name,
                        "record could not be stored before the lease ran out; a retry with this key will execute again"
                    );
                }
                return;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_PAUSE);
            last = self.try_complete(record.clone()).await;
            match last {
                Attempt::Settled => {
                    info!(request_id = %self.request_id, route = %self.route_name, "record stored after the store recovered");
                    return;
                }
                Attempt::Failed if !written => {
                    self.renew().await;
                }
                Attempt::Failed => {}
                Attempt::Unreplicated => written = true,
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

/// Releases a reservation by its token, retrying briefly; if it cannot be released, the lease frees it.
pub async fn release(app: &App, store_key: &str, token: Token) {
    let _ = store::retry(STORE_ATTEMPTS, FIRST_PAUSE, |attempt| async move {
        let r = app.store.release(store_key, token).await;
        if let Err(e) = &r {
            warn!(error = %e, attempt, "releasing a reservation failed");
        }
        r
    })
    .await;
}
