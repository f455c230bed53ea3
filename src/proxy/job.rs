//! The forward-and-complete work of one reserved request, in a task of its own:
//! a client that goes away does not cancel the upstream exchange, and the
//! outcome is still stored (or the key released).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::response::Parts;
use http::{HeaderName, HeaderValue, Request, Response};
use hyper::body::Incoming;
use tracing::{error, warn};
use uuid::Uuid;

use super::verdict::storable_headers;
use crate::app::App;
use crate::body::{read_capped, Body, Capped};
use crate::config::{Policy, UnknownOutcome};
use crate::metrics::Outcome;
use crate::problem::Problem;
use crate::record::{now_ms, Finished, Record, Token};
use crate::routes::RouteName;
use crate::store::{self, Completion};
use crate::upstream::UpstreamError;

/// Store writes after the upstream answered: attempts, and the first pause between them.
const STORE_ATTEMPTS: u32 = 3;
const FIRST_PAUSE: Duration = Duration::from_millis(25);

/// A reserved request: everything needed to finish it, owned, so it can outlive the client.
pub struct Job {
    pub app: Arc<App>,
    pub route_name: RouteName,
    pub policy: Arc<Policy>,
    pub store_key: String,
    pub token: Token,
    pub fingerprint: [u8; 32],
    pub created_ms: u64,
    pub request_id: Uuid,
}

/// The upstream's answer with its body read up to `max_response_body`.
type Exchanged = (Parts, Capped<Incoming>);

impl Job {
    /// Forwards, records the outcome (or releases the key), and returns the client's answer.
    pub async fn run(&self, request: Request<Body>) -> (Response<Body>, Outcome) {
        match self.holding_lease(self.exchange(request)).await {
            Ok((parts, Capped::Whole(body))) => self.answered(parts, body).await,
            Ok((parts, Capped::TooLarge(read, rest))) => {
                self.too_large(&parts).await;
                let resp = Response::from_parts(parts, Body::Prefixed(Some(read), rest));
                (resp, Outcome::Forwarded)
            }
            Err(e) => self.failed(e).await,
        }
    }

    /// Sends the request and reads the whole answer, bounded by the upstream
    /// timeout and by the end of the shutdown grace (either way: outcome unknown).
    async fn exchange(&self, request: Request<Body>) -> Result<Exchanged, UpstreamError> {
        let app = &self.app;
        let exchange = async {
            let sent = Instant::now();
            let resp = app.upstream.send(request).await?;
            app.metrics.upstream(sent.elapsed());
            let (parts, body) = resp.into_parts();
            let body = read_capped(body, self.policy.max_response_body)
                .await
                .map_err(|e| UpstreamError::Exchange(format!("response body cut off: {e}")))?;
            Ok((parts, body))
        };
        let timeout = app.upstream.timeout;
        tokio::select! {
            r = tokio::time::timeout(timeout, exchange) => r.unwrap_or(Err(UpstreamError::Timeout(timeout))),
            () = app.hard_stop.cancelled() => Err(UpstreamError::Timeout(timeout)),
        }
    }

    /// A whole answer: released when its status says "try again", stored otherwise.
    async fn answered(&self, parts: Parts, body: Bytes) -> (Response<Body>, Outcome) {
        let status = parts.status.as_u16();
        let outcome = if self.policy.release_statuses.contains(&status) {
            self.release().await;
            Outcome::Released
        } else {
            let headers = storable_headers(&parts.headers);
            self.complete(status, headers, body.clone(), true).await;
            Outcome::Forwarded
        };
        (Response::from_parts(parts, Body::full(body)), outcome)
    }

    /// An answer too large to keep: relayed, and a record that says the operation happened.
    async fn too_large(&self, parts: &Parts) {
        warn!(
            request_id = %self.request_id,
            route = %self.route_name,
            limit = self.policy.max_response_body,
            "response too large to store; retries will get 410"
        );
        let headers = storable_headers(&parts.headers);
        self.complete(parts.status.as_u16(), headers, Bytes::new(), false)
            .await;
    }

    /// No answer: a request that never left frees its key; otherwise the
    /// outcome is unknown, and `unknown_outcome` says whether to store the problem.
    async fn failed(&self, e: UpstreamError) -> (Response<Body>, Outcome) {
        let released = matches!(e, UpstreamError::Connect(_))
            || self.policy.unknown_outcome == UnknownOutcome::Release;
        warn!(request_id = %self.request_id, error = %e, released, "upstream failed");
        let problem = Problem::from_upstream(&e, released);
        let (status, headers, body) = problem.render(&self.request_id);
        if released {
            self.release().await;
        } else {
            let stored = headers
                .iter()
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect();
            self.complete(status.as_u16(), stored, body.clone(), true)
                .await;
        }
        let mut resp = Response::new(Body::full(body));
        *resp.status_mut() = status;
        *resp.headers_mut() = headers;
        (resp, problem.outcome())
    }

    /// Runs `fut` while renewing the lease every third of it, so a slow upstream keeps the key.
    async fn holding_lease<F: std::future::Future>(&self, fut: F) -> F::Output {
        tokio::pin!(fut);
        let period = (self.policy.lease / 3).max(Duration::from_millis(10));
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
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
        let lease = self.policy.lease;
        match self
            .app
            .store
            .renew(&self.store_key, self.token, lease)
            .await
        {
            Ok(true) => true,
            Ok(false) => {
                self.app.metrics.lease_lost(&self.route_name);
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

    /// Stores the finished record, retrying briefly; the client gets its answer either way.
    async fn complete(
        &self,
        status: u16,
        headers: Vec<(HeaderName, HeaderValue)>,
        body: Bytes,
        body_stored: bool,
    ) {
        let record = Record::Finished(Finished {
            token: self.token,
            fingerprint: self.fingerprint,
            created_ms: self.created_ms,
            route: self.route_name.to_string(),
            completed_ms: now_ms(),
            status,
            body_stored,
            headers,
            body,
        })
        .encode();
        let (store, ttl) = (&self.app.store, self.policy.ttl);
        let done = store::retry(STORE_ATTEMPTS, FIRST_PAUSE, |attempt| {
            let record = record.clone();
            async move {
                let r = store
                    .complete(&self.store_key, self.token, record, ttl)
                    .await;
                if let Err(e) = &r {
                    warn!(request_id = %self.request_id, error = %e, attempt, "storing the record failed");
                }
                r
            }
        });
        let (id, route) = (&self.request_id, &self.route_name);
        match done.await {
            Ok(Completion::Stored) => {}
            Ok(Completion::StoredAfterExpiry) => {
                warn!(request_id = %id, route = %route, "lease had expired before completion; nobody else held the key, record stored");
            }
            Ok(Completion::Refused) => {
                self.app.metrics.lease_lost(route);
                warn!(request_id = %id, route = %route, "completion refused: another request owns the key now");
            }
            Err(_) => error!(
                request_id = %id,
                route = %route,
                "record could not be stored; a retry with this key will execute again"
            ),
        }
    }

    async fn release(&self) {
        release(&self.app, &self.store_key, self.token).await;
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
