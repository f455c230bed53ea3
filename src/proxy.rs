//! The request path. Unprotected requests stream through; a protected one goes
//! phase by phase — key → body cap → fingerprint and scope → reserve → forward
//! → complete → answer — and each phase may answer early.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::header::{HeaderValue, CONTENT_LENGTH, DATE, SET_COOKIE};
use http::{HeaderMap, HeaderName, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::oneshot;
use tracing::{info, warn};
use uuid::Uuid;

use crate::app::App;
use crate::body::Body;
use crate::key::{self, KeyError};
use crate::metrics::Outcome;
use crate::policy::{Concurrent, KeyMode, Mode, OnStoreError, Policy, UnknownOutcome};
use crate::problem::Problem;
use crate::record::{now_ms, Finished, Processing, Record, Token};
use crate::routes::{Route, RouteName};
use crate::store::{Completion, Reservation, StoreError};
use crate::upstream::UpstreamError;

pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The `route` label of requests that no route protects.
static UNPROTECTED: std::sync::LazyLock<RouteName> =
    std::sync::LazyLock::new(|| RouteName::new(""));

/// What the handler did, for the metrics and the log line.
struct Handled {
    response: Response<Body>,
    outcome: Outcome,
    record_id: Option<String>,
}

impl Handled {
    fn new(response: Response<Body>, outcome: Outcome) -> Self {
        Handled {
            response,
            outcome,
            record_id: None,
        }
    }
}

/// Keeps `idemproxy_inflight` right even when hyper drops the handler (client gone).
struct InflightGuard<'a>(&'a App);

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.0.metrics.inflight.dec();
    }
}

/// The per-request context every phase needs.
struct Ctx<'a> {
    app: &'a Arc<App>,
    peer: SocketAddr,
    request_id: Uuid,
}

/// Handles one request from a client.
pub async fn handle(app: Arc<App>, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
    let start = Instant::now();
    app.metrics.inflight.inc();
    let _inflight = InflightGuard(&app);

    // An incoming X-Request-Id that is a UUID names the request; otherwise we make one.
    // (It is sent upstream only on protected routes: pass-through changes nothing
    // but the X-Forwarded-* headers.)
    let request_id = match req
        .headers()
        .get(X_REQUEST_ID)
        .map(|v| v.to_str().map(Uuid::parse_str))
    {
        Some(Ok(Ok(id))) => id,
        _ => Uuid::new_v4(),
    };
    let ctx = Ctx {
        app: &app,
        peer,
        request_id,
    };
    let method = req.method().clone();
    // A cheap clone (shared bytes), kept for the log line.
    let uri = req.uri().clone();
    let routes = app.routes();
    let route = routes.find(&method, uri.path());
    let handled = match route {
        None => {
            let (parts, body) = req.into_parts();
            forward_unprotected(&ctx, parts, Body::Stream(body), Outcome::Passthrough).await
        }
        Some(route) => protected(&ctx, route, req).await,
    };
    let route_name = route.map_or(&*UNPROTECTED, |r| &r.name);
    app.metrics.request(route_name, handled.outcome);
    info!(
        target: "idemproxy::access",
        request_id = %request_id,
        method = %method,
        path = uri.path(),
        route = route_name.as_str(),
        outcome = handled.outcome.as_str(),
        status = handled.response.status().as_u16(),
        duration_ms = start.elapsed().as_secs_f64() * 1000.0,
        record_id = handled.record_id.as_deref(),
        "request"
    );
    handled.response
}

fn problem_response(p: &Problem, request_id: &Uuid) -> Response<Body> {
    let (status, headers, body) = p.render(request_id);
    let mut resp = Response::new(Body::full(body));
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp
}

/// Forwards without protection, streaming both ways.
async fn forward_unprotected(
    ctx: &Ctx<'_>,
    parts: http::request::Parts,
    body: Body,
    outcome: Outcome,
) -> Handled {
    let upstream = &ctx.app.upstream;
    let sent = match upstream.prepare(parts, body, ctx.peer) {
        Ok(req) => upstream.send_with_timeout(req).await,
        Err(e) => Err(e),
    };
    match sent {
        Ok(resp) => Handled::new(resp.map(Body::Stream), outcome),
        Err(e) => {
            warn!(request_id = %ctx.request_id, error = %e, "upstream failed (unprotected request)");
            let p = match e {
                UpstreamError::Connect(_) => Problem::UpstreamUnreachable,
                UpstreamError::Exchange(_) => Problem::UpstreamReset { released: true },
                UpstreamError::Timeout(after) => Problem::UpstreamTimeout {
                    after,
                    released: true,
                },
            };
            Handled::new(
                problem_response(&p, &ctx.request_id),
                Outcome::UpstreamError,
            )
        }
    }
}

/// Reads the key header: `Ok(None)` when absent.
fn read_key(headers: &HeaderMap, policy: &Policy) -> Result<Option<String>, KeyError> {
    let mut values = headers.get_all(&policy.header).iter();
    match (values.next(), values.next()) {
        (None, _) => Ok(None),
        (Some(_), Some(_)) => Err(KeyError::Repeated),
        (Some(v), None) => key::parse_key(v.as_bytes(), policy.max_key_length).map(Some),
    }
}

/// A body read up to a limit.
enum Capped {
    Whole(Bytes),
    /// Over the limit: what was read, and the rest still to come.
    TooLarge(Bytes, Incoming),
}

/// Reads a body into memory, refusing more than `limit` bytes (Content-Length first).
async fn read_capped(mut body: Incoming, limit: u64) -> Result<Capped, hyper::Error> {
    if http_body::Body::size_hint(&body).lower() > limit {
        return Ok(Capped::TooLarge(Bytes::new(), body));
    }
    let mut first: Option<Bytes> = None;
    let mut buf = BytesMut::new();
    let mut total: u64 = 0;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue; // trailers are not part of the fingerprint or the record
        };
        total += data.len() as u64;
        match first.take() {
            None if buf.is_empty() => first = Some(data),
            Some(f) => {
                buf.extend_from_slice(&f);
                buf.extend_from_slice(&data);
            }
            None => buf.extend_from_slice(&data),
        }
        if total > limit {
            let read = first.take().unwrap_or_else(|| buf.split().freeze());
            return Ok(Capped::TooLarge(read, body));
        }
    }
    Ok(Capped::Whole(first.unwrap_or_else(|| buf.freeze())))
}

/// What the stored record says about a request with the same key.
enum Verdict {
    Replay(Finished),
    NotStored,
    InFlight(Duration),
    Mismatch,
}

impl Verdict {
    fn outcome(&self) -> Outcome {
        match self {
            Verdict::Replay(_) => Outcome::Replayed,
            Verdict::NotStored => Outcome::NotStored,
            Verdict::InFlight(_) => Outcome::Conflict,
            Verdict::Mismatch => Outcome::Mismatch,
        }
    }
}

async fn protected(ctx: &Ctx<'_>, route: &Route, req: Request<Incoming>) -> Handled {
    let policy = &route.policy;
    let shadow = policy.mode == Mode::Shadow;
    let app = ctx.app;
    let problem =
        |p: Problem, outcome: Outcome| Handled::new(problem_response(&p, &ctx.request_id), outcome);

    // 1. The key: present, one line, valid.
    let header = policy.header.as_str();
    let key = match read_key(req.headers(), policy) {
        Ok(Some(k)) => k,
        Ok(None) if policy.key == KeyMode::Optional => {
            let (parts, body) = req.into_parts();
            return forward_unprotected(ctx, parts, Body::Stream(body), Outcome::Passthrough).await;
        }
        Ok(None) if shadow => return shadow_forward(ctx, route, Outcome::MissingKey, req).await,
        Ok(None) => {
            return problem(
                Problem::MissingKey {
                    header: header_display(header),
                },
                Outcome::MissingKey,
            )
        }
        Err(_) if shadow => return shadow_forward(ctx, route, Outcome::InvalidKey, req).await,
        Err(why) => {
            return problem(
                Problem::InvalidKey {
                    header: header_display(header),
                    why,
                },
                Outcome::InvalidKey,
            )
        }
    };

    // 2. The body, capped before it is buffered.
    let (parts, body) = req.into_parts();
    let read = tokio::time::timeout(
        app.body_read_timeout,
        read_capped(body, policy.max_request_body),
    );
    let body = match read.await {
        Err(_) => {
            return problem(
                Problem::BodyTimeout {
                    after: app.body_read_timeout,
                },
                Outcome::BadRequest,
            )
        }
        Ok(read) => read,
    };
    let body = match body {
        Ok(Capped::Whole(b)) => b,
        Ok(Capped::TooLarge(read, rest)) if shadow => {
            return forward_unprotected(
                ctx,
                parts,
                Body::Prefixed(Some(read), rest),
                Outcome::Passthrough,
            )
            .await;
        }
        Ok(Capped::TooLarge(..)) => {
            return problem(
                Problem::BodyTooLarge {
                    limit: policy.max_request_body,
                },
                Outcome::TooLarge,
            )
        }
        Err(e) => {
            warn!(request_id = %ctx.request_id, error = %e, "request body could not be read");
            return problem(Problem::BodyUnreadable, Outcome::BadRequest);
        }
    };

    // 3. Fingerprint and scope.
    let fingerprint = key::fingerprint(
        &parts.method,
        parts.uri.path(),
        parts.uri.query(),
        &parts.headers,
        &policy.fingerprint_headers,
        &body,
        policy.fingerprint_body,
    );
    let record_id = key::request_record_id(&parts.headers, &policy.scope_headers, &key);
    let store_key = app.store.key_for(&record_id);
    let with_id = |mut h: Handled| {
        h.record_id = Some(record_id.clone());
        h
    };

    // 4. Reserve, or learn what holds the key.
    let token = Token::new();
    let created_ms = now_ms();
    let processing = Record::Processing(Processing {
        token,
        fingerprint,
        created_ms,
        route: route.name.to_string(),
    })
    .encode();
    let wait_until = Instant::now() + policy.wait_timeout;
    let mut backoff = Duration::from_millis(5);
    loop {
        let verdict = match app
            .store
            .reserve(&store_key, processing.clone(), token, policy.lease)
            .await
        {
            Ok(Reservation::Reserved) => break,
            Err(e) => {
                warn!(request_id = %ctx.request_id, record_id = %record_id, error = %e, "store unavailable while reserving");
                // Too few replicas acknowledged the reservation: never forward
                // (unless in shadow mode, which forwards everything by definition).
                let replicated = !matches!(e, StoreError::NotReplicated { .. });
                if shadow || (replicated && policy.on_store_error == OnStoreError::Pass) {
                    let outcome = if shadow {
                        Outcome::Passthrough
                    } else {
                        Outcome::StoreBypass
                    };
                    return with_id(
                        forward_unprotected(ctx, parts, Body::full(body), outcome).await,
                    );
                }
                return with_id(problem(Problem::StoreUnavailable, Outcome::StoreError));
            }
            Ok(Reservation::Existing { record, ttl }) => {
                if record.fingerprint() != &fingerprint {
                    Verdict::Mismatch
                } else {
                    match record {
                        Record::Finished(f) if f.body_stored => Verdict::Replay(f),
                        Record::Finished(_) => Verdict::NotStored,
                        Record::Processing(_) => Verdict::InFlight(ttl),
                    }
                }
            }
        };
        if shadow {
            app.metrics.shadow(&route.name, verdict.outcome());
            return with_id(
                forward_unprotected(ctx, parts, Body::full(body), Outcome::Passthrough).await,
            );
        }
        let outcome = verdict.outcome();
        let handled = match verdict {
            Verdict::Mismatch => problem(Problem::Mismatch, outcome),
            Verdict::Replay(f) => Handled::new(replay(f, policy), outcome),
            Verdict::NotStored => {
                let mut h = problem(Problem::NotStored, outcome);
                h.response.headers_mut().insert(
                    policy.replayed_header.clone(),
                    HeaderValue::from_static("true"),
                );
                h
            }
            Verdict::InFlight(ttl) => {
                let now = Instant::now();
                if policy.concurrent == Concurrent::Wait && now < wait_until {
                    // Wait for the first request to finish, or for its key to be released
                    // (then reserve it ourselves); back off so as not to hammer the store.
                    tokio::time::sleep(backoff.min(wait_until - now)).await;
                    backoff = (backoff * 2).min(Duration::from_millis(250));
                    continue;
                }
                problem(Problem::Conflict { retry_after: ttl }, outcome)
            }
        };
        return with_id(handled);
    }

    // 5. Forward and complete in a task of its own: a client that goes away
    //    does not cancel the upstream exchange, and the record is still stored.
    //    The upstream learns the request id, to match its logs with the record.
    let mut parts = parts;
    if !parts.headers.contains_key(X_REQUEST_ID) {
        if let Ok(v) = HeaderValue::from_str(&ctx.request_id.to_string()) {
            parts.headers.insert(X_REQUEST_ID, v);
        }
    }
    let request = match app.upstream.prepare(parts, Body::full(body), ctx.peer) {
        Ok(r) => r,
        Err(e) => {
            warn!(request_id = %ctx.request_id, error = %e, "cannot build the upstream request");
            release(app, &store_key, token).await;
            return with_id(problem(
                Problem::UpstreamUnreachable,
                Outcome::UpstreamError,
            ));
        }
    };
    let job = Job {
        app: app.clone(),
        route_name: route.name.clone(),
        policy: policy.clone(),
        store_key,
        token,
        fingerprint,
        created_ms,
        request_id: ctx.request_id,
    };
    let (tx, rx) = oneshot::channel();
    app.tasks.spawn(async move {
        let (response, outcome) = job.run(request).await;
        if let Err((resp, _)) = tx.send((response, outcome)) {
            info!(
                request_id = %job.request_id,
                route = %job.route_name,
                status = resp.status().as_u16(),
                outcome = outcome.as_str(),
                "client went away before the answer; the outcome was handled all the same"
            );
        }
    });
    match rx.await {
        Ok((response, outcome)) => with_id(Handled::new(response, outcome)),
        // The task panicked: nothing sensible was stored; the lease frees the key.
        Err(_) => with_id(problem(
            Problem::UpstreamReset { released: true },
            Outcome::UpstreamError,
        )),
    }
}

/// Shadow mode: count what enforcement would have answered, and forward as if the proxy were absent.
async fn shadow_forward(
    ctx: &Ctx<'_>,
    route: &Route,
    would_be: Outcome,
    req: Request<Incoming>,
) -> Handled {
    ctx.app.metrics.shadow(&route.name, would_be);
    let (parts, body) = req.into_parts();
    forward_unprotected(ctx, parts, Body::Stream(body), Outcome::Passthrough).await
}

fn header_display(lower: &str) -> String {
    if lower == "idempotency-key" {
        "Idempotency-Key".to_string()
    } else {
        lower.to_string()
    }
}

/// The stored answer, byte for byte, marked as a replay. `Date` and `Content-Length` are recomputed.
fn replay(f: Finished, policy: &Policy) -> Response<Body> {
    let mut resp = Response::new(Body::full(f.body));
    *resp.status_mut() = StatusCode::from_u16(f.status).unwrap_or(StatusCode::OK);
    let headers = resp.headers_mut();
    headers.reserve(f.headers.len() + 1);
    for (name, value) in f.headers {
        headers.append(name, value);
    }
    headers.insert(
        policy.replayed_header.clone(),
        HeaderValue::from_static("true"),
    );
    resp
}

/// The end-to-end headers that may be replayed: hop-by-hop ones are already gone;
/// `Set-Cookie` must not be handed out again; `Date` and `Content-Length` are recomputed.
fn storable_headers(headers: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    headers
        .iter()
        .filter(|(n, _)| **n != SET_COOKIE && **n != DATE && **n != CONTENT_LENGTH)
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect()
}

/// Releases a reservation, retrying briefly; if it cannot be released, the lease frees it.
async fn release(app: &App, store_key: &str, token: Token) {
    for attempt in 0..3u32 {
        match app.store.release(store_key, token).await {
            Ok(_) => return,
            Err(e) => {
                warn!(error = %e, attempt, "releasing a reservation failed");
                tokio::time::sleep(Duration::from_millis(25 << attempt)).await;
            }
        }
    }
}

/// The forward-and-store work of one reserved request.
struct Job {
    app: Arc<App>,
    route_name: RouteName,
    policy: Arc<Policy>,
    store_key: String,
    token: Token,
    fingerprint: [u8; 32],
    created_ms: u64,
    request_id: Uuid,
}

impl Job {
    async fn run(&self, request: Request<Body>) -> (Response<Body>, Outcome) {
        let app = &self.app;
        let policy = &self.policy;
        let exchange = async {
            let sent = Instant::now();
            let resp = app.upstream.send(request).await?;
            app.metrics.upstream(sent.elapsed());
            let (parts, body) = resp.into_parts();
            let body = read_capped(body, policy.max_response_body)
                .await
                .map_err(|e| UpstreamError::Exchange(format!("response body cut off: {e}")))?;
            Ok::<_, UpstreamError>((parts, body))
        };
        let timeout = app.upstream.timeout;
        // Cut short by the upstream timeout, or by the end of the shutdown grace:
        // either way the outcome is unknown.
        let bounded = async {
            tokio::select! {
                r = tokio::time::timeout(timeout, exchange) => r.unwrap_or(Err(UpstreamError::Timeout(timeout))),
                () = app.hard_stop.cancelled() => Err(UpstreamError::Timeout(timeout)),
            }
        };
        let result = self.holding_lease(bounded).await;
        match result {
            Ok((parts, Capped::Whole(body))) => {
                let status = parts.status.as_u16();
                if policy.release_statuses.contains(&status) {
                    release(app, &self.store_key, self.token).await;
                    return (
                        Response::from_parts(parts, Body::full(body)),
                        Outcome::Released,
                    );
                }
                self.complete(status, storable_headers(&parts.headers), body.clone(), true)
                    .await;
                (
                    Response::from_parts(parts, Body::full(body)),
                    Outcome::Forwarded,
                )
            }
            Ok((parts, Capped::TooLarge(read, rest))) => {
                // Relay it, and keep a record that says the operation happened.
                warn!(
                    request_id = %self.request_id,
                    route = %self.route_name,
                    limit = policy.max_response_body,
                    "response too large to store; retries will get 410"
                );
                self.complete(
                    parts.status.as_u16(),
                    storable_headers(&parts.headers),
                    Bytes::new(),
                    false,
                )
                .await;
                (
                    Response::from_parts(parts, Body::Prefixed(Some(read), rest)),
                    Outcome::Forwarded,
                )
            }
            Err(UpstreamError::Connect(e)) => {
                warn!(request_id = %self.request_id, error = %e, "upstream unreachable; key released");
                release(app, &self.store_key, self.token).await;
                (
                    problem_response(&Problem::UpstreamUnreachable, &self.request_id),
                    Outcome::UpstreamError,
                )
            }
            Err(e) => {
                let released = policy.unknown_outcome == UnknownOutcome::Release;
                warn!(request_id = %self.request_id, error = %e, released, "upstream outcome unknown");
                let p = match e {
                    UpstreamError::Timeout(after) => Problem::UpstreamTimeout { after, released },
                    _ => Problem::UpstreamReset { released },
                };
                let (status, headers, body) = p.render(&self.request_id);
                if released {
                    release(app, &self.store_key, self.token).await;
                } else {
                    let stored: Vec<_> = headers
                        .iter()
                        .map(|(n, v)| (n.clone(), v.clone()))
                        .collect();
                    self.complete(status.as_u16(), stored, body.clone(), true)
                        .await;
                }
                let mut resp = Response::new(Body::full(body));
                *resp.status_mut() = status;
                *resp.headers_mut() = headers;
                (resp, Outcome::UpstreamError)
            }
        }
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
                _ = tick.tick(), if held => {
                    match self.app.store.renew(&self.store_key, self.token, self.policy.lease).await {
                        Ok(true) => {}
                        Ok(false) => {
                            held = false;
                            self.app.metrics.lease_lost(&self.route_name);
                            warn!(
                                request_id = %self.request_id,
                                route = %self.route_name,
                                "lease lost while the upstream was working; a retry may execute again"
                            );
                        }
                        Err(e) => warn!(request_id = %self.request_id, error = %e, "lease renewal failed"),
                    }
                }
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
        for attempt in 0..3u32 {
            match self
                .app
                .store
                .complete(&self.store_key, self.token, record.clone(), self.policy.ttl)
                .await
            {
                Ok(Completion::Stored) => return,
                Ok(Completion::StoredAfterExpiry) => {
                    warn!(request_id = %self.request_id, route = %self.route_name, "lease had expired before completion; nobody else held the key, record stored");
                    return;
                }
                Ok(Completion::Refused) => {
                    self.app.metrics.lease_lost(&self.route_name);
                    warn!(request_id = %self.request_id, route = %self.route_name, "completion refused: another request owns the key now");
                    return;
                }
                Err(e) => {
                    warn!(request_id = %self.request_id, error = %e, attempt, "storing the record failed");
                    tokio::time::sleep(Duration::from_millis(25 << attempt)).await;
                }
            }
        }
        tracing::error!(
            request_id = %self.request_id,
            route = %self.route_name,
            "record could not be stored; a retry with this key will execute again"
        );
    }
}
