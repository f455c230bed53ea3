//! The request path. Unprotected requests stream through. A protected one goes
//! phase by phase — key → body → fingerprint and scope → reserve and verdict →
//! forward and complete — and any phase may stop it with a `Stop`, a value
//! that says what enforcement answers; shadow mode turns every stop into a
//! plain forward in one place (`Disposition::of`). An upgrade request (a WebSocket)
//! on a path no route protects becomes a tunnel (`tunnel`); on a protected
//! route its upgrade intent is dropped and it is protected like any other.

mod access;
mod job;
mod tunnel;
mod verdict;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONNECTION};
use http::{HeaderMap, HeaderName, Request, Response};
use hyper::body::Incoming;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::{error, info, warn};
use uuid::Uuid;

use self::access::{Begun, Held};
use self::job::{Claim, Job, JobTrace};
pub use self::tunnel::is_upgrade;
use self::verdict::{replay, Verdict};
use crate::app::App;
use crate::body::{read_capped, Body, Capped, Cut};
use crate::budget::Room;
use crate::conn::Caller;
use crate::key::{self, KeyRead, NoKey};
use crate::metrics::Outcome;
use crate::permit::Permit;
use crate::policy::{Concurrent, DeadOwner, KeyMode, Mode, OnStoreError, Policy};
use crate::problem::Problem;
use crate::record::{
    now_ms, Afterlife, DecodeError, Finished, Processing, Record, Token, TraceRef,
};
use crate::routes::{self, Judgement, Route, RouteName, RouteTable};
use crate::store::{Inspected, RecordKey, Reservation, StoreError, INLINE_RECORD};
use crate::telemetry;
use crate::upstream::{Inbound, UpstreamError};

pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The `route` label of requests that no route protects.
pub(crate) static UNPROTECTED: std::sync::LazyLock<RouteName> =
    std::sync::LazyLock::new(|| RouteName::new(""));

/// What the handler did, for the metrics and the log line.
struct Handled {
    response: Response<Body>,
    outcome: Outcome,
    record_id: Option<RecordKey>,
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

/// The per-request context every phase needs.
struct Ctx<'a> {
    app: &'a Arc<App>,
    caller: Caller,
    request_id: Uuid,
    /// A gRPC request: the proxy's own answers are gRPC errors
    /// (docs/reference/behaviour.md#grpc-errors).
    grpc: bool,
    /// When the request's handling began (its body is due `body_read_timeout` after).
    start: Instant,
    /// The request's SERVER span (tracing on), else `None`: then no span is made.
    trace: Option<telemetry::ServerSpan>,
}

impl Ctx<'_> {
    fn problem(&self, p: &Problem) -> Handled {
        Handled::new(p.response_to(&self.request_id, self.grpc), p.outcome())
    }

    /// An INTERNAL child of the request's SERVER span, when it is sampled;
    /// it ends when dropped.
    fn span(
        &self,
        name: &'static str,
        attributes: impl FnOnce() -> Vec<(&'static str, telemetry::Value)>,
    ) -> Option<telemetry::Child> {
        let server = self.trace.as_ref()?;
        self.app
            .telemetry
            .as_ref()?
            .child(server.parent(), name, attributes)
    }

    /// The upstream exchange's trace context put in `request` (tracing on),
    /// and its CLIENT span when the request is sampled.
    fn client_span(&self, request: &mut Request<Body>) -> Option<telemetry::ClientSpan> {
        let server = self.trace.as_ref()?;
        self.app.telemetry.as_ref()?.client_span(server, request)
    }

    /// A tunnel's handshake (no CLIENT span): the client's trace context
    /// goes on as it came, unless the proxy does not follow it (`client_context`).
    fn tunnel_context(&self, request: &mut Request<Body>) {
        if let (Some(t), Some(server)) = (self.app.telemetry.as_ref(), self.trace.as_ref()) {
            t.tunnel_context(server, request);
        }
    }

    /// The trace and span ids of the request's SERVER span for a log line,
    /// while it records (else both `None`: no field).
    fn log_ids(&self) -> (Option<String>, Option<String>) {
        self.trace
            .as_ref()
            .and_then(telemetry::ServerSpan::log_ids)
            .unzip()
    }

    /// The execution's trace context, to be kept with its records.
    fn trace_ref(&self) -> Option<TraceRef> {
        self.trace
            .as_ref()
            .and_then(telemetry::ServerSpan::trace_ref)
    }

    /// A replay, a 409 or a 422: the SERVER span links to the execution.
    fn link_original(&self, original: Option<TraceRef>) {
        if let (Some(server), Some(original)) = (&self.trace, original) {
            server.link_original(original);
        }
    }
}

/// A request's future, on the heap at the size of the path it takes. It
/// gives back the request's place among the requests in progress with the
/// answer, for the answer to hold while it is sent (shared, when an upstream
/// exchange goes on holding it too).
pub type Handling = Pin<Box<dyn Future<Output = (Response<Body>, Permit)> + Send>>;

/// Handles one request from a client. Pass-through gets a future of its own,
/// its exchange in it (4.1 KiB); the protected path's (3.5 KiB) forwards in a
/// task of its own (see [`forward_reserved`]). One future for both would be
/// as large as the larger for every request, and each future is copied whole
/// where it is made: paths taken rarely (a tunnel, a large record's read,
/// reconnecting to the store) are boxed where they start. `permit` is the
/// request's place among the requests in progress.
pub fn handle(
    app: Arc<App>,
    mut req: Request<Incoming>,
    caller: Caller,
    permit: Permit,
) -> Handling {
    if app.forward_normalised_path {
        normalise_target(req.uri_mut());
    }
    // Looked up once, in one table (a reload between two lookups could disagree).
    let routes = app.routes();
    let position = match routes.judge(req.method(), req.uri(), req.headers()) {
        Judgement::Protected(i) => Some(i),
        Judgement::Refused => return Box::pin(refused(app, req, caller, permit)),
        Judgement::Unprotected if !tunnel::is_upgrade(&req) => {
            return Box::pin(pass_through(app, req, caller, permit))
        }
        Judgement::Unprotected => None,
    };
    Box::pin(any_path(app, req, caller, (routes, position), permit))
}

/// `forward_normalised_path`: the request-target's path replaced by its
/// normalised form (docs/routes-and-keys.md#forward-normalised-path), the
/// query kept; a target that would not parse again is left as it came.
fn normalise_target(uri: &mut http::Uri) {
    let path = uri.path();
    let normal = routes::normalise(path);
    // A trailing slash is kept, as Envoy's `normalize_path` keeps it
    // (Django's APPEND_SLASH and Go's subtree roots tell `/a/` from `/a`).
    let slash = path.len() > 1 && path.ends_with('/') && normal != "/";
    if normal == path || (slash && path.strip_suffix('/') == Some(&normal)) {
        return;
    }
    let slash = if slash { "/" } else { "" };
    let target = match uri.query() {
        Some(query) => format!("{normal}{slash}?{query}"),
        None => format!("{normal}{slash}"),
    };
    let mut parts = std::mem::take(uri).into_parts();
    let kept = parts.path_and_query.clone();
    parts.path_and_query = Some(target.parse().unwrap_or_else(|_| {
        kept.clone()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"))
    }));
    *uri = http::Uri::from_parts(parts).unwrap_or_default();
}

/// A request whose path no route can be trusted to judge (a control
/// character in it, on a method a route names): 400 `path-not-accepted`,
/// before anything is reserved or forwarded.
async fn refused(
    app: Arc<App>,
    req: Request<Incoming>,
    caller: Caller,
    permit: Permit,
) -> (Response<Body>, Permit) {
    let begun = Begun::new(&app, &req, permit);
    let ctx = begun.ctx(&app, caller, &req, None);
    let mut handled = ctx.problem(&Problem::PathNotAccepted);
    // The body is not read: the connection cannot carry another request.
    if req.version() < http::Version::HTTP_2 {
        let closing = HeaderValue::from_static("close");
        handled.response.headers_mut().insert(CONNECTION, closing);
    }
    begun.finish(&app, &ctx, None, handled)
}

/// A request no route protects (and not an upgrade): streamed both ways. Its
/// exchange lives in this future: a client that goes away ends it.
async fn pass_through(
    app: Arc<App>,
    req: Request<Incoming>,
    caller: Caller,
    permit: Permit,
) -> (Response<Body>, Permit) {
    let begun = Begun::new(&app, &req, permit);
    let ctx = begun.ctx(&app, caller, &req, None);
    let (parts, body) = req.into_parts();
    let handled = forward(&ctx, parts, Body::Stream(body.into()), Outcome::Passthrough).await;
    begun.finish(&app, &ctx, None, handled)
}

/// Any request: a tunnel, pass-through or the protected path, under the
/// route `handle` found (its position in `routes`).
async fn any_path(
    app: Arc<App>,
    req: Request<Incoming>,
    caller: Caller,
    (routes, position): (Arc<RouteTable>, Option<usize>),
    permit: Permit,
) -> (Response<Body>, Permit) {
    let mut begun = Begun::new(&app, &req, permit);
    let route = position.map(|i| routes.at(i));
    let ctx = begun.ctx(&app, caller, &req, route);
    // The protected path's phases are awaited here, not in a function of
    // their own: each layer of future is one more copy of its state.
    let handled = match route {
        // An `Upgrade` header is never a way around the key check
        // (docs/reference/behaviour.md#upgrade): on a
        // protected route the intent is dropped (the upstream request is built
        // without hop-by-hop headers) and the request protected like any other.
        // Shadow mode forwards as if the proxy were absent: a WebSocket too.
        Some(route) if route.policy.mode == Mode::Shadow && tunnel::is_upgrade(&req) => {
            Box::pin(tunnel::open(&ctx, req.map(|b| Body::Stream(b.into())))).await
        }
        Some(route) => {
            let (parts, body) = req.into_parts();
            let pending = Pending {
                parts,
                body: Body::Stream(body.into()),
                record_id: None,
            };
            match enforce(&ctx, route, pending, &mut begun).await {
                Ok(handled) => handled,
                Err((stop, pending)) => stopped(&ctx, route, stop, pending).await,
            }
        }
        // An upgrade on a path no route protects: a tunnel, which has no
        // answer to store. (`handle` sends here only upgrades and routed requests.)
        // Boxed: its state (~3.5 KiB) is not made part of every request's.
        None => Box::pin(tunnel::open(&ctx, req.map(|b| Body::Stream(b.into())))).await,
    };
    begun.finish(&app, &ctx, route, handled)
}

/// Forwards without protection, streaming both ways.
async fn forward(
    ctx: &Ctx<'_>,
    parts: http::request::Parts,
    body: Body,
    outcome: Outcome,
) -> Handled {
    let mut prepared = ctx.app.upstream.prepare(parts, body, ctx.caller);
    let span = match &mut prepared {
        Ok(req) => ctx.client_span(req),
        Err(_) => None,
    };
    let sent = send(ctx, prepared).await;
    if let Some(span) = span {
        span.end(match &sent {
            Ok(resp) => Ok(resp.status().as_u16()),
            Err(_) => Err("upstream_error"),
        });
    }
    match sent {
        Ok(resp) => Handled::new(resp.map(Body::Stream), outcome),
        Err(problem) => problem,
    }
}

/// Sends an unprotected request upstream; a failure is already the problem to answer.
async fn send(
    ctx: &Ctx<'_>,
    prepared: Result<Request<Body>, UpstreamError>,
) -> Result<Response<Inbound>, Handled> {
    let sent = match prepared {
        Ok(req) => ctx.app.upstream.send_with_timeout(req).await,
        Err(e) => Err(e),
    };
    sent.map_err(|e| {
        let (trace_id, span_id) = ctx.log_ids();
        warn!(request_id = %ctx.request_id, error = %e, trace_id, span_id, "upstream failed (unprotected request)");
        ctx.problem(&Problem::from_upstream(&e, true))
    })
}

/// Why a protected request left the protected path before it was forwarded.
enum Stop {
    /// Enforcement answers with this problem; shadow mode forwards the request
    /// as it came, as if the proxy were absent (docs/reference/behaviour.md#shadow).
    Refuse(Problem),
    /// The stored answer of the same request (boxed: it is the large one),
    /// and the room its bytes have held since they came from the store.
    Replay(Box<Finished>, Room),
    /// Forwarded without protection (an optional route without a key).
    Unprotected,
    /// The store failed; `may_pass`: `on_store_error = "pass"` may forward it
    /// (not when the store answered: a reservation unconfirmed on the
    /// replicas, a full memory store).
    StoreDown { may_pass: bool },
}

impl Stop {
    /// What shadow mode counts: the answer enforcement would have given about
    /// the key and its record. (A body too large, or a store down, is not counted.)
    fn shadow_outcome(&self) -> Option<Outcome> {
        match self {
            Stop::Replay(..) => Some(Outcome::Replayed),
            Stop::Refuse(p) => match p {
                Problem::MissingKey { .. }
                | Problem::InvalidKey { .. }
                | Problem::Conflict { .. }
                | Problem::Mismatch
                | Problem::NotStored
                | Problem::OutcomeUnknown
                | Problem::RecordUnreadable => Some(p.outcome()),
                _ => None,
            },
            _ => None,
        }
    }
}

/// What becomes of a stopped request: decided once, here, from the stop and
/// the route's policy, and carried out by [`stopped`].
#[derive(Debug)]
enum Disposition {
    /// Enforcement answers with this problem.
    Answer(Problem),
    /// Enforcement replays the stored answer, in the room its bytes hold.
    Replay(Box<Finished>, Room),
    /// Forwarded without protection, counted as `Outcome` (pass-through, or a
    /// store bypassed under `on_store_error = "pass"`).
    Forward(Outcome),
    /// Shadow mode: forwarded as if the proxy were absent, counting what
    /// enforcement would have answered (`would_be`, when it is counted).
    Shadow { would_be: Option<Outcome> },
    /// A WebSocket without a key on an optional route: a tunnel, unprotected
    /// either way (dropping its upgrade would only break it).
    Tunnel,
}

impl Disposition {
    /// The one decision of what a stopped request gets. `upgrade`: the
    /// request asks for a WebSocket. Shadow mode forwards everything; a store
    /// failure is forwarded only when it may pass and the route says `pass`.
    fn of(stop: Stop, policy: &Policy, upgrade: bool) -> Disposition {
        match stop {
            stop if policy.mode == Mode::Shadow => Disposition::Shadow {
                would_be: stop.shadow_outcome(),
            },
            Stop::Refuse(p) => Disposition::Answer(p),
            Stop::Replay(f, room) => Disposition::Replay(f, room),
            Stop::Unprotected if upgrade => Disposition::Tunnel,
            Stop::Unprotected => Disposition::Forward(Outcome::Passthrough),
            Stop::StoreDown { may_pass: true } if policy.on_store_error == OnStoreError::Pass => {
                Disposition::Forward(Outcome::StoreBypass)
            }
            Stop::StoreDown { .. } => Disposition::Answer(Problem::StoreUnavailable),
        }
    }

    /// Does the proxy answer this itself (rather than forward the request)?
    fn answered_here(&self) -> bool {
        matches!(self, Disposition::Answer(_) | Disposition::Replay(..))
    }
}

/// A protected request as far as the phases have read it: enough to forward it unprotected.
struct Pending {
    parts: http::request::Parts,
    /// The body still to be sent: streaming, read whole, or a read prefix then the rest.
    body: Body,
    record_id: Option<RecordKey>,
}

/// `Ok(v)` goes on; `Err(stop)` leaves the phases with the request as read so far.
macro_rules! phase {
    ($result:expr, $pending:ident) => {
        match $result {
            Ok(v) => v,
            Err(stop) => return Err((stop, $pending)),
        }
    };
}

/// The phases, in the documented check order (docs/reference/behaviour.md#check-order): key
/// (400) → body (413) → store
/// → upstream; a key in the JSON body is read after the body (413 → 400).
/// The upstream exchange takes what `begun` holds for the request with it.
async fn enforce(
    ctx: &Ctx<'_>,
    route: &Route,
    mut req: Pending,
    begun: &mut Begun,
) -> Result<Handled, (Stop, Pending)> {
    let policy = &route.policy;
    let key = phase!(read_key(&req.parts.headers, policy), req);
    let (body, room) = phase!(read_body(ctx, policy, &mut req.body).await, req);
    let key = key.or_from_body(&body, policy.max_key_length);
    let key = phase!(key.map_err(|no| no_key(policy, no)), req);
    let id = Identity::of(ctx.app, policy, &req.parts, &key, &body);
    req.record_id = Some(id.key.clone());
    let reserved = phase!(reserve(ctx, route, &id).await, req);
    let Pending {
        parts, record_id, ..
    } = req;
    let held = begun.hand_over();
    let mut handled = forward_reserved(ctx, route, id, reserved, parts, (body, room), held).await;
    handled.record_id = record_id;
    Ok(handled)
}

/// Carries out what [`Disposition::of`] decided for a stopped request.
async fn stopped(ctx: &Ctx<'_>, route: &Route, stop: Stop, mut req: Pending) -> Handled {
    let policy = &route.policy;
    // Asked only of a request without a key: a replay's path reads no more headers.
    let upgrade = matches!(stop, Stop::Unprotected)
        && tunnel::asks_upgrade(req.parts.version, &req.parts.headers);
    let disposition = Disposition::of(stop, policy, upgrade);
    let h2 = req.parts.version >= http::Version::HTTP_2;
    if h2 && disposition.answered_here() && !matches!(req.body, Body::Full(_)) {
        req.body.drain_some().await;
    }
    // (HTTP/1 only: HTTP/2 has no `Connection`, and a stream ends by itself.)
    let unread = !matches!(req.body, Body::Full(_)) && req.parts.version < http::Version::HTTP_2;
    // Forwarding is boxed: a replay or a refusal, the common ends here, does
    // not carry (and copy) the exchange's ~3 KiB of state with it.
    let forward = |parts, body, outcome| Box::pin(forward(ctx, parts, body, outcome));
    let mut handled = match disposition {
        Disposition::Shadow { would_be } => {
            if let Some(would_be) = would_be {
                ctx.app.metrics.shadow(&route.name, would_be);
            }
            forward(req.parts, req.body, Outcome::Passthrough).await
        }
        Disposition::Answer(p) => refusal(ctx, policy, &p),
        // The room that has held the record since the store sent it goes on
        // with the replay's body: no gap in which the bytes are not counted.
        Disposition::Replay(f, mut room) => {
            if room.reach(f.body.len() as u64) {
                let resp = replay(*f, &policy.replayed_header).map(|b| b.counted(room));
                Handled::new(resp, Outcome::Replayed)
            } else {
                ctx.problem(&Problem::ProxyBusy)
            }
        }
        Disposition::Tunnel => {
            let handshake = Request::from_parts(req.parts, req.body);
            let mut handled = Box::pin(tunnel::open(ctx, handshake)).await;
            handled.record_id = None;
            return handled;
        }
        Disposition::Forward(outcome) => forward(req.parts, req.body, outcome).await,
    };
    // Answered here before the request body was read to its end: the
    // connection cannot carry another request, so say so rather than close it silently.
    let forwarded = matches!(handled.outcome, Outcome::Passthrough | Outcome::StoreBypass);
    if unread && !forwarded {
        let closing = HeaderValue::from_static("close");
        handled.response.headers_mut().insert(CONNECTION, closing);
    }
    handled.record_id = req.record_id;
    handled
}

/// A refusal as enforcement answers it; a retry of an answer too large to keep is marked as a replay.
fn refusal(ctx: &Ctx<'_>, policy: &Policy, p: &Problem) -> Handled {
    let mut handled = ctx.problem(p);
    if matches!(p, Problem::NotStored) {
        let h = handled.response.headers_mut();
        h.insert(
            policy.replayed_header.clone(),
            HeaderValue::from_static("true"),
        );
    }
    handled
}

/// Phase 1, the key: present, one line, valid, when a header carries it (a
/// key in the JSON body is read after phase 2).
fn read_key<'p>(headers: &HeaderMap, policy: &'p Policy) -> Result<KeyRead<'p>, Stop> {
    key::from_headers(headers, &policy.key_from, policy.max_key_length)
        .map_err(|no| no_key(policy, no))
}

/// No key to use: refused, or forwarded unprotected when an optional route has none.
fn no_key(policy: &Policy, no: NoKey) -> Stop {
    let from = policy.key_from.clone();
    match no {
        NoKey::Missing if policy.key == KeyMode::Optional => Stop::Unprotected,
        NoKey::Missing => Stop::Refuse(Problem::MissingKey { from }),
        NoKey::Invalid(why) => Stop::Refuse(Problem::InvalidKey { from, why }),
    }
}

/// Phase 2, the body: read into memory up to the route's limit, with room in
/// the memory budget (taken for the declared length at once, else as it
/// comes), within the body timeout (counted from the request's start). `body`
/// is left as what would be forwarded from here on: all of it, or what was
/// read and the rest (shadow mode forwards that as it came).
async fn read_body(ctx: &Ctx<'_>, policy: &Policy, body: &mut Body) -> Result<(Bytes, Room), Stop> {
    let app = ctx.app;
    let Body::Stream(incoming) = std::mem::replace(body, Body::Full(None)) else {
        return Err(Stop::Refuse(Problem::BodyUnreadable));
    };
    let limit = policy.max_request_body;
    let declared = http_body::Body::size_hint(&incoming).lower();
    // Over the limit: refused (413) before any room is asked for.
    let Some(mut room) = app.budget.take(if declared > limit { 0 } else { declared }) else {
        *body = Body::Stream(incoming);
        return Err(Stop::Refuse(Problem::ProxyBusy));
    };
    let after = app.body_read_timeout;
    let deadline = ctx.start + after;
    let (read, rest, cut) = match read_capped(incoming, limit, Some(deadline), &mut room).await {
        Capped::Whole(bytes, _) => {
            *body = Body::full(bytes.clone());
            return Ok((bytes, room));
        }
        Capped::Partial(read, rest, cut) => (read, rest, cut),
    };
    *body = Body::Prefixed(Some(read), rest);
    Err(Stop::Refuse(match cut {
        Cut::TooLarge => Problem::BodyTooLarge { limit },
        Cut::NoRoom => Problem::ProxyBusy,
        Cut::Late => Problem::BodyTimeout { after },
        Cut::Failed(e) => {
            warn!(error = %e, "request body could not be read");
            Problem::BodyUnreadable
        }
    }))
}

/// Phase 3: what identifies the operation (the fingerprint) and whose it is (the record id).
struct Identity {
    fingerprint: [u8; 32],
    key: RecordKey,
}

impl Identity {
    fn of(
        app: &App,
        policy: &Policy,
        parts: &http::request::Parts,
        key: &str,
        body: &[u8],
    ) -> Self {
        let fingerprint = key::fingerprint(
            &parts.method,
            parts.uri.path(),
            parts.uri.query(),
            &parts.headers,
            &policy.fingerprint_headers,
            body,
            policy.fingerprint_body,
        );
        let digest = key::request_record_digest(&parts.headers, &policy.scope_headers, key);
        Identity {
            fingerprint,
            key: app.store.record_key(&digest),
        }
    }
}

/// How often a reserve may find a record that is gone when it is fetched.
const GONE_TRIES: u32 = 3;

/// Phase 4's result: the key is ours.
struct Reserved {
    claim: Claim,
    created_ms: u64,
    /// Taken before the reserve was sent: the lease runs from no earlier.
    sent_at: tokio::time::Instant,
}

/// Phase 4: reserve the key, or learn what holds it. With `concurrent = "wait"`
/// a duplicate of a request in flight polls until it finishes or is released.
/// From the first reserve sent, a [`Claim`] releases the key if the request ends here.
async fn reserve(ctx: &Ctx<'_>, route: &Route, id: &Identity) -> Result<Reserved, Stop> {
    let (app, policy) = (ctx.app, &route.policy);
    let token = Token::new();
    let created_ms = now_ms();
    // The reserve's span (and, while a duplicate waits, the wait's, beside it): ended
    // when this returns. The SERVER span's ids go with the reservation.
    let span = ctx.span("idempotency.reserve", || {
        telemetry::record_attributes(route.name.as_str(), id.key.id())
    });
    let mut waiting = None;
    let processing = processing(route, id, token, created_ms, ctx.trace_ref());
    // Room for what a reserve may bring back with its answer (a record up to INLINE_RECORD).
    let inline = app
        .budget
        .take(INLINE_RECORD)
        .ok_or(Stop::Refuse(Problem::ProxyBusy))?;
    let mut claim = Claim::new(app.clone(), id.key.clone(), token);
    let mut patience = Patience::new(policy);
    // Records that went between the reserve and their fetch: an honest store
    // then has the key free for the next reserve; one that says so for ever
    // is not believed.
    let mut gone = 0;
    // When a waiting duplicate next reads what is left of a reservation's
    // time, to see whether its owner vanished: when its lease is due to end
    // by the last reading (store time, counted here on the monotonic clock);
    // `None`: at the next sighting.
    let mut next_look: Option<Instant> = None;
    loop {
        let sent_at = Instant::now();
        patience.start(sent_at);
        let hold = policy.reservation_hold();
        let found = app
            .store
            .reserve_at(sent_at, id.key.as_str(), processing.clone(), hold);
        let judged = match found.await.map_err(|e| reserve_failed(ctx, id, e))? {
            Reservation::Reserved => Ok(Judged::OURS),
            found => judge(ctx, id, token, found).await,
        };
        let (verdict, mut ttl, fetched, original) = match judged {
            Ok(Judged::Verdict {
                verdict,
                ttl,
                room,
                original,
            }) => (verdict, ttl, room, original),
            Ok(Judged::Gone) if gone < GONE_TRIES => {
                gone += 1;
                continue;
            }
            Ok(Judged::Gone) => {
                claim.disarm();
                let e = StoreError::Untrue("a record that is gone whenever it is read".into());
                return Err(store_down(ctx, id, e, Taken::Yes));
            }
            Err(stop) => {
                claim.disarm();
                return Err(stop);
            }
        };
        if let Verdict::InFlight {
            owner,
            afterlife: Some(mut afterlife),
            ..
        } = verdict
        {
            // The store's word, held to this route's own `ttl`: a record
            // claiming a longer afterlife (a hostile or corrupt value) would
            // have a live owner's lease judged over.
            afterlife.after = afterlife.after.min(route.policy.ttl);
            // Looked for when the time left is known for free, on the first
            // sighting, when the lease is due to end while a duplicate
            // waits, and before a 409. Shadow mode too: it writes records
            // as enforcement does, and counts what enforcement would answer.
            let due = next_look.is_none_or(|at| Instant::now() >= at);
            if ttl.is_some() || due || !patience.may_wait() {
                let left = match time_left(ctx, id, ttl).await {
                    Ok(left) => left,
                    Err(stop) => {
                        claim.disarm();
                        return Err(stop);
                    }
                };
                ttl = Some(left);
                next_look = Some(Instant::now() + left.saturating_sub(afterlife.after));
                if afterlife.lease_ended(left) {
                    let mine = (token, created_ms, &processing);
                    let vanished = (owner, afterlife);
                    // A take-over that failed may have written the key for
                    // this request: the claim, still armed, withdraws a
                    // reservation of its own.
                    match Box::pin(take_over(ctx, route, id, vanished, mine)).await? {
                        TakeOver::Answer(stop) => {
                            claim.disarm();
                            return Err(stop);
                        }
                        TakeOver::Ours(sent_at) => {
                            return Ok(Reserved {
                                claim,
                                created_ms,
                                sent_at,
                            });
                        }
                        // Renewed meanwhile: in flight after all, its time left to be read again.
                        TakeOver::Refused => (ttl, next_look) = (None, None),
                    }
                }
            }
        }
        if matches!(verdict, Verdict::InFlight { .. }) {
            if patience.waits && waiting.is_none() && span.is_some() {
                // A sibling of the reserve's span under the SERVER span, as
                // the guide's span reference draws it.
                waiting = ctx.span("idempotency.wait", Vec::new);
            }
            if patience.wait().await {
                continue;
            }
        }
        drop(waiting);
        if !matches!(verdict, Verdict::Ours) {
            claim.disarm();
            // A replay, a 409, a 422: linked to the request that executed.
            ctx.link_original(original);
        }
        return match verdict {
            Verdict::Ours => Ok(Reserved {
                claim,
                created_ms,
                sent_at,
            }),
            // A large record came with room of its own; an inline one in the reserve's.
            Verdict::Replay(f) => Err(Stop::Replay(Box::new(f), fetched.unwrap_or(inline))),
            Verdict::NotStored => Err(Stop::Refuse(Problem::NotStored)),
            Verdict::Mismatch => Err(Stop::Refuse(Problem::Mismatch)),
            Verdict::Unreadable => Err(Stop::Refuse(Problem::RecordUnreadable)),
            Verdict::InFlight {
                created_ms,
                afterlife,
                ..
            } => Err(conflict(ctx, route, id, ttl, (created_ms, afterlife)).await?),
        };
    }
}

/// How a duplicate of a request in flight waits for it to finish or be
/// released (`concurrent = "wait"`, enforcement only: shadow mode never
/// delays a request to wait for another): reserving again, backing off so as
/// not to hammer the store, until `wait_timeout` from the first reserve sent.
struct Patience {
    waits: bool,
    wait_timeout: Duration,
    /// Set when the first reserve is sent (one clock read for both).
    until: Option<Instant>,
    pause: Duration,
}

impl Patience {
    fn new(policy: &Policy) -> Self {
        Patience {
            waits: policy.concurrent == Concurrent::Wait && policy.mode == Mode::Enforce,
            wait_timeout: policy.wait_timeout,
            until: None,
            pause: Duration::from_millis(5),
        }
    }

    /// A reserve is sent at `sent_at`: the first starts the clock.
    fn start(&mut self, sent_at: Instant) {
        self.until.get_or_insert(sent_at + self.wait_timeout);
    }

    /// Would [`Patience::wait`] wait now?
    fn may_wait(&self) -> bool {
        self.waits && self.until.is_some_and(|u| Instant::now() < u)
    }

    /// Backs off before the next reserve, if the request waits and its time
    /// is not up; `false` (at once) when it is to be answered now.
    async fn wait(&mut self) -> bool {
        let Some(until) = self.until.filter(|u| self.waits && Instant::now() < *u) else {
            return false;
        };
        tokio::time::sleep(
            self.pause
                .min(until.saturating_duration_since(Instant::now())),
        )
        .await;
        self.pause = (self.pause * 2).min(Duration::from_millis(250));
        true
    }
}

/// A reserve that failed: whether the store had already said the key is
/// taken (`StoreError::Taken`) decides whether `on_store_error` may pass it.
fn reserve_failed(ctx: &Ctx<'_>, id: &Identity, e: StoreError) -> Stop {
    match e {
        StoreError::Taken(_) => store_down(ctx, id, e, Taken::Yes),
        e => store_down(ctx, id, e, Taken::No),
    }
}

/// The 409 for a key whose first request is still in flight, with a
/// `Retry-After` estimate (docs/reference/behaviour.md#conflict): the route's typical duration
/// less what the
/// first has run (its record's clock, so a first on another proxy counts
/// too), within the lease. Only a 409 needs the remaining lease (`ttl`, else
/// a `PTTL`): replays and mismatches stay at one round trip.
async fn conflict(
    ctx: &Ctx<'_>,
    route: &Route,
    id: &Identity,
    ttl: Option<Duration>,
    (created_ms, afterlife): (u64, Option<Afterlife>),
) -> Result<Stop, Stop> {
    let left = time_left(ctx, id, ttl).await?;
    // The store keeps a reservation its afterlife past its lease. At most
    // the lease: the first may have finished between the two round trips,
    // and then PTTL is its record's TTL, not a lease.
    let after = afterlife.map_or(Duration::ZERO, |a| a.after);
    let lease_left = left.saturating_sub(after).min(route.policy.lease);
    let ran = Duration::from_millis(now_ms().saturating_sub(created_ms));
    let retry_after = route.typical.retry_after(ran, lease_left);
    Ok(Stop::Refuse(Problem::Conflict { retry_after }))
}

/// What is left of a reservation's time in the store: `ttl` when the
/// reserve said it, else a `PTTL` (Redis), which a 409 pays anyway.
async fn time_left(ctx: &Ctx<'_>, id: &Identity, ttl: Option<Duration>) -> Result<Duration, Stop> {
    match ttl {
        Some(ttl) => Ok(ttl),
        None => ctx
            .app
            .store
            .pttl(id.key.as_str())
            .await
            .map_err(|e| store_down(ctx, id, e, Taken::Yes)),
    }
}

/// What became of a key whose owner vanished.
enum TakeOver {
    /// The unknown outcome is stored under the key: the request answers it.
    Answer(Stop),
    /// The key is ours (`re_execute`): the request runs again, its lease
    /// counted from the instant given.
    Ours(Instant),
    /// The key changed meanwhile (its owner renewed it): in flight after all.
    Refused,
}

/// A reservation whose lease ran out without its owner (its proxy died
/// after the request may have reached the upstream): taken over in one
/// owner-checked operation, as the reservation says — the 502
/// `outcome-unknown` stored under a fresh token (a late owner's completion is
/// refused by token), or the key reserved again for this request
/// (`re_execute`). Counted and logged; docs/reference/behaviour.md#dead-owner.
async fn take_over(
    ctx: &Ctx<'_>,
    route: &Route,
    id: &Identity,
    (vanished, afterlife): (Token, Afterlife),
    (token, created_ms, processing): (Token, u64, &Bytes),
) -> Result<TakeOver, Stop> {
    let (app, policy) = (ctx.app, &route.policy);
    let sent_at = Instant::now();
    let (value, hold) = match afterlife.then {
        DeadOwner::ReExecute => (processing.clone(), policy.reservation_hold()),
        DeadOwner::StoreUnknown => {
            let record = unknown_outcome(ctx, route, id, token, created_ms);
            match app.store.encode(id.key.as_str(), &record) {
                Ok(value) => (value, policy.ttl),
                Err(e) => {
                    let e = StoreError::Backend(format!("the record cannot be sealed: {e}"));
                    return Err(store_down(ctx, id, e, Taken::Yes));
                }
            }
        }
    };
    let key = id.key.as_str();
    let taken = app
        .store
        .take_over(key, vanished, afterlife.after, value, hold)
        .await
        .map_err(|e| store_down(ctx, id, e, Taken::Yes))?;
    if !taken {
        return Ok(TakeOver::Refused);
    }
    let handling = afterlife.then.as_str();
    app.metrics.lease_expired(&route.name, handling);
    let (trace_id, span_id) = ctx.log_ids();
    warn!(
        request_id = %ctx.request_id,
        route = %route.name,
        record_id = id.key.id(),
        handling,
        trace_id,
        span_id,
        "the key's owner vanished mid-request (its lease ran out): the request may have run; {}",
        match afterlife.then {
            DeadOwner::StoreUnknown => "its outcome is unknown, stored as a 502 outcome-unknown",
            DeadOwner::ReExecute => "running it again (lease_expiry = \"re_execute\")",
        }
    );
    Ok(match afterlife.then {
        DeadOwner::ReExecute => TakeOver::Ours(sent_at),
        DeadOwner::StoreUnknown => TakeOver::Answer(Stop::Refuse(Problem::OutcomeUnknown)),
    })
}

/// The finished record of a vanished owner's unknown outcome: the 502
/// `outcome-unknown` this request answers (as a gRPC error on a gRPC
/// request), under this request's token, replayed to every later retry.
fn unknown_outcome(
    ctx: &Ctx<'_>,
    route: &Route,
    id: &Identity,
    token: Token,
    created_ms: u64,
) -> Record {
    let problem = Problem::OutcomeUnknown;
    let (status, headers, body) = if ctx.grpc {
        let (status, headers) = problem.render_grpc(&ctx.request_id);
        (status, headers, Bytes::new())
    } else {
        problem.render(&ctx.request_id)
    };
    Record::Finished(Finished {
        token,
        fingerprint: id.fingerprint,
        created_ms,
        route: route.name.to_string(),
        trace: ctx.trace_ref(),
        completed_ms: now_ms(),
        status: status.as_u16(),
        reason: None,
        body_stored: true,
        headers: headers
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect(),
        body,
        trailers: Vec::new(),
    })
}

/// The `processing` record a reserve writes, with its afterlife: how long
/// the store keeps it past its lease, and what the route does with the key
/// of an owner that never comes back.
fn processing(
    route: &Route,
    id: &Identity,
    token: Token,
    created_ms: u64,
    trace: Option<TraceRef>,
) -> Bytes {
    let policy = &route.policy;
    Record::Processing(Processing {
        token,
        fingerprint: id.fingerprint,
        created_ms,
        route: route.name.to_string(),
        trace,
        afterlife: Some(Afterlife {
            after: policy.afterlife(),
            then: policy.dead_owner(),
        }),
    })
    .encode()
}

/// What holds the key, judged, with its remaining TTL when known. A record
/// too large to come with the reserve's answer is judged by its head, which
/// came with it; only a replay fetches it whole, with room for it in the
/// budget, and that room comes back with the verdict (the replay keeps it);
/// [`Judged::Gone`] when the record went away in between.
async fn judge(
    ctx: &Ctx<'_>,
    id: &Identity,
    token: Token,
    found: Reservation,
) -> Result<Judged, Stop> {
    let unreadable = |e: &dyn std::fmt::Display| {
        let (trace_id, span_id) = ctx.log_ids();
        error!(request_id = %ctx.request_id, record_id = id.key.id(), error = %e, trace_id, span_id, "the record under this key cannot be read; not forwarding");
        Ok(Judged::verdict(Verdict::Unreadable))
    };
    let (record, ttl, room) = match found {
        Reservation::Reserved => return Ok(Judged::OURS),
        Reservation::Existing { record, ttl } => (record, ttl, None),
        Reservation::Unreadable(e) => return unreadable(&e),
        // Only a replay needs more than the head (boxed: the large read's
        // state is not carried by every replay's).
        Reservation::Large { len, head } => match Verdict::of_head(&head, token, &id.fingerprint) {
            Some(verdict) => {
                return Ok(Judged::Verdict {
                    verdict,
                    ttl: None,
                    room: None,
                    original: head.trace,
                })
            }
            None => match Box::pin(fetch_large(ctx, id, len)).await? {
                Fetched::Gone => return Ok(Judged::Gone),
                Fetched::Unreadable(e) => return unreadable(&e),
                Fetched::Record(record, ttl, room) => (record, Some(ttl), Some(room)),
            },
        },
    };
    let original = record.trace();
    Ok(Judged::Verdict {
        verdict: Verdict::of(record, token, &id.fingerprint),
        ttl,
        room,
        original,
    })
}

/// What a reserve found under the key, once judged. (`Gone` is small, as
/// the `None` this replaces was: boxing the verdict would cost every
/// reserve an allocation to save a rare answer's bytes.)
#[allow(clippy::large_enum_variant)]
enum Judged {
    /// A record holds the key (ours, perhaps): what it means for this
    /// request, its remaining TTL when the store said, and the room a
    /// record fetched by itself holds.
    Verdict {
        verdict: Verdict,
        ttl: Option<Duration>,
        room: Option<Room>,
        /// The trace context of the request that executed, when its record keeps it.
        original: Option<TraceRef>,
    },
    /// The record went away between the reserve and its fetch: reserve again.
    Gone,
}

impl Judged {
    /// The reserve took the key.
    const OURS: Judged = Judged::Verdict {
        verdict: Verdict::Ours,
        ttl: None,
        room: None,
        original: None,
    };

    /// A verdict with no TTL known and no room of its own.
    fn verdict(verdict: Verdict) -> Judged {
        Judged::Verdict {
            verdict,
            ttl: None,
            room: None,
            original: None,
        }
    }
}

/// A record too large for the reserve's answer, read by itself (taken
/// apart at once: not boxed, as `Verdict`).
#[allow(clippy::large_enum_variant)]
enum Fetched {
    Record(Record, Duration, Room),
    /// The key went away in between.
    Gone,
    Unreadable(DecodeError),
}

/// Reads a record too large for the reserve's answer, with room for its
/// `len` bytes in the budget, its turn among large reads first: a request
/// waiting for one holds no room for the record (only the reserve's
/// `INLINE_RECORD`). The wait is outside `op_timeout`; each turn is bounded by it.
async fn fetch_large(ctx: &Ctx<'_>, id: &Identity, len: u64) -> Result<Fetched, Stop> {
    let _turn = ctx.app.large_reads.acquire().await;
    let Some(room) = ctx.app.budget.take(len) else {
        return Err(Stop::Refuse(Problem::ProxyBusy));
    };
    match ctx.app.store.get(id.key.as_str()).await {
        Ok(None) => Ok(Fetched::Gone),
        Ok(Some(Inspected { record, ttl })) => Ok(Fetched::Record(record, ttl, room)),
        Err(StoreError::Decode(e)) => Ok(Fetched::Unreadable(e)),
        Err(e) => Err(store_down(ctx, id, e, Taken::Yes)),
    }
}

/// Whether the store had said the key is taken before it failed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Taken {
    No,
    /// A record holds the key (its read, or its remaining lease, failed).
    Yes,
}

/// The store failed while reserving. The claim (still armed) releases whatever
/// the reserve may have written. Never forwarded, whatever `on_store_error`
/// says: a reservation that was written but not confirmed on the replicas, a
/// memory store that is full (the store is there, and forwarding would drop
/// protection silently), an answer that is not believed (a record longer than
/// any the proxy writes: the key may be taken), and a key the reserve found
/// taken whose record could not then be read in time (the operation may have
/// run, or be running).
fn store_down(ctx: &Ctx<'_>, id: &Identity, e: StoreError, taken: Taken) -> Stop {
    let (trace_id, span_id) = ctx.log_ids();
    warn!(request_id = %ctx.request_id, record_id = id.key.id(), error = %e, taken = taken == Taken::Yes, trace_id, span_id, "store unavailable while reserving");
    Stop::StoreDown {
        may_pass: taken == Taken::No
            && !matches!(
                e,
                StoreError::NotReplicated { .. }
                    | StoreError::Unconfirmed(_)
                    | StoreError::Full
                    | StoreError::Untrue(_)
            ),
    }
}

/// Phase 5: forward and complete in a task of its own (see [`Job`]), which
/// holds the request's place in `idemproxy_inflight` and among the requests
/// in progress (`held`) until it ends, whether or not the client is still
/// there (docs/reference/behaviour.md#request-id). The upstream learns the request id, to match
/// its logs with the record.
async fn forward_reserved(
    ctx: &Ctx<'_>,
    route: &Route,
    id: Identity,
    reserved: Reserved,
    mut parts: http::request::Parts,
    (body, room): (Bytes, Room),
    held: Held,
) -> Handled {
    let app = ctx.app;
    if !parts.headers.contains_key(X_REQUEST_ID) {
        if let Ok(v) = HeaderValue::from_str(&ctx.request_id.to_string()) {
            parts.headers.insert(X_REQUEST_ID, v);
        }
    }
    let mut request = match app.upstream.prepare(parts, Body::full(body), ctx.caller) {
        Ok(r) => r,
        Err(e) => {
            // Dropping the claim releases the key.
            warn!(request_id = %ctx.request_id, error = %e, "cannot build the upstream request");
            return ctx.problem(&Problem::UpstreamUnreachable);
        }
    };
    // The upstream's `traceparent` for every traced request; the rest only
    // for a sampled one (an unsampled one builds nothing).
    let client = ctx.client_span(&mut request);
    let trace = client.zip(ctx.trace.as_ref()).map(|(client, server)| {
        Box::new(JobTrace {
            server: server.parent().clone(),
            client: Some(client),
            record: ctx.trace_ref(),
        })
    });
    let mut job = Job {
        trace,
        claim: reserved.claim,
        route_name: route.name.clone(),
        policy: route.policy.clone(),
        fingerprint: id.fingerprint,
        created_ms: reserved.created_ms,
        request_id: ctx.request_id,
        grpc: ctx.grpc,
        lease_until: std::sync::Mutex::new(reserved.sent_at + route.policy.lease),
        unsaved: None,
        request_room: Some(room),
        typical: route.typical.clone(),
        _held: held,
    };
    let (tx, rx) = oneshot::channel();
    // Boxed here, once: the task's state (the exchange and the store's
    // futures, ~10 KiB) is not moved by value through the spawn's layers.
    app.tasks.spawn(Box::pin(async move {
        let (response, outcome) = job.run(request).await;
        let answered = tx.send((response, outcome));
        let request_id = job.request_id;
        let route_name = job.route_name.clone();
        job.settle().await;
        if let Err((resp, _)) = answered {
            info!(
                request_id = %request_id,
                route = %route_name,
                status = resp.status().as_u16(),
                outcome = outcome.as_str(),
                "client went away before the answer; the outcome was handled all the same"
            );
        }
    }));
    match rx.await {
        Ok((response, outcome)) => Handled::new(response, outcome),
        // The task panicked: nothing sensible was stored; the lease frees the key.
        Err(_) => ctx.problem(&Problem::UpstreamReset { released: true }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::Budget;
    use crate::policy::KeySource;

    /// What a disposition says, in a form tests compare.
    #[derive(Debug, PartialEq, Eq)]
    enum Seen {
        Answer(Outcome),
        Replay,
        Forward(Outcome),
        Shadow(Option<Outcome>),
        Tunnel,
    }

    fn seen(d: &Disposition) -> Seen {
        match d {
            Disposition::Answer(p) => Seen::Answer(p.outcome()),
            Disposition::Replay(..) => Seen::Replay,
            Disposition::Forward(o) => Seen::Forward(*o),
            Disposition::Shadow { would_be } => Seen::Shadow(*would_be),
            Disposition::Tunnel => Seen::Tunnel,
        }
    }

    fn replay() -> Stop {
        let f = Finished {
            token: Token::new(),
            fingerprint: [1; 32],
            created_ms: 1,
            route: "r".into(),
            trace: None,
            completed_ms: 2,
            status: 200,
            reason: None,
            body_stored: true,
            headers: vec![],
            body: Bytes::from_static(b"done"),
            trailers: vec![],
        };
        Stop::Replay(Box::new(f), Budget::new(1 << 20).nothing())
    }

    /// Every kind of stop, made afresh (a replay holds room: stops are not cloned).
    fn every_stop() -> Vec<Stop> {
        vec![
            Stop::Refuse(Problem::Mismatch),
            Stop::Refuse(Problem::BodyTooLarge { limit: 1 }),
            replay(),
            Stop::Unprotected,
            Stop::StoreDown { may_pass: true },
            Stop::StoreDown { may_pass: false },
        ]
    }

    fn policy(mode: Mode, on_store_error: OnStoreError) -> Policy {
        Policy {
            mode,
            on_store_error,
            ..Policy::default()
        }
    }

    fn decided(mode: Mode, on_store_error: OnStoreError, upgrade: bool) -> Vec<Seen> {
        let policy = policy(mode, on_store_error);
        every_stop()
            .into_iter()
            .map(|stop| seen(&Disposition::of(stop, &policy, upgrade)))
            .collect()
    }

    #[test]
    fn every_stop_in_every_mode_has_its_disposition() {
        use Outcome::{Mismatch, Passthrough, Replayed, StoreBypass, StoreError, TooLarge};
        let cases = [
            (
                OnStoreError::Reject,
                false,
                [Seen::Forward(Passthrough), Seen::Answer(StoreError)],
            ),
            (
                OnStoreError::Reject,
                true,
                [Seen::Tunnel, Seen::Answer(StoreError)],
            ),
            (
                OnStoreError::Pass,
                false,
                [Seen::Forward(Passthrough), Seen::Forward(StoreBypass)],
            ),
            (
                OnStoreError::Pass,
                true,
                [Seen::Tunnel, Seen::Forward(StoreBypass)],
            ),
        ];
        for (on_store_error, upgrade, [unprotected, may_pass]) in cases {
            // Refusals and replays are answered whatever the route says of the store.
            let mut want = vec![Seen::Answer(Mismatch), Seen::Answer(TooLarge), Seen::Replay];
            want.extend([unprotected, may_pass, Seen::Answer(StoreError)]);
            let got = decided(Mode::Enforce, on_store_error, upgrade);
            assert_eq!(got, want, "enforce, {on_store_error:?}, upgrade {upgrade}");
            // Shadow mode forwards all of them, counting what enforcement would answer.
            let got = decided(Mode::Shadow, on_store_error, upgrade);
            let want = [
                Seen::Shadow(Some(Mismatch)),
                Seen::Shadow(None),
                Seen::Shadow(Some(Replayed)),
                Seen::Shadow(None),
                Seen::Shadow(None),
                Seen::Shadow(None),
            ];
            assert_eq!(got, want, "shadow, {on_store_error:?}, upgrade {upgrade}");
        }
    }

    #[test]
    fn only_answers_and_replays_are_answered_here() {
        let answered = |d: Disposition| d.answered_here();
        assert!(answered(Disposition::Answer(Problem::StoreUnavailable)));
        let Stop::Replay(f, room) = replay() else {
            unreachable!()
        };
        assert!(answered(Disposition::Replay(f, room)));
        assert!(!answered(Disposition::Forward(Outcome::StoreBypass)));
        assert!(!answered(Disposition::Forward(Outcome::Passthrough)));
        assert!(!answered(Disposition::Shadow {
            would_be: Some(Outcome::Replayed)
        }));
        assert!(!answered(Disposition::Tunnel));
    }

    #[test]
    fn a_refusal_keeps_its_problem() {
        let policy = policy(Mode::Enforce, OnStoreError::Pass);
        let retry_after = Duration::from_secs(3);
        let stop = Stop::Refuse(Problem::Conflict { retry_after });
        let d = Disposition::of(stop, &policy, true);
        assert!(
            matches!(d, Disposition::Answer(Problem::Conflict { retry_after: r }) if r == retry_after)
        );
    }

    #[test]
    fn shadow_mode_counts_what_is_about_the_key_and_its_record() {
        let from = KeySource::Header(HeaderName::from_static("idempotency-key"));
        let counted = [
            (
                Problem::MissingKey { from: from.clone() },
                Outcome::MissingKey,
            ),
            (
                Problem::InvalidKey {
                    from,
                    why: key::KeyError::Empty,
                },
                Outcome::InvalidKey,
            ),
            (
                Problem::Conflict {
                    retry_after: Duration::from_secs(1),
                },
                Outcome::Conflict,
            ),
            (Problem::Mismatch, Outcome::Mismatch),
            (Problem::NotStored, Outcome::NotStored),
            (Problem::OutcomeUnknown, Outcome::UpstreamError),
            (Problem::RecordUnreadable, Outcome::Unreadable),
        ];
        for (p, want) in counted {
            let what = format!("{p:?}");
            assert_eq!(Stop::Refuse(p).shadow_outcome(), Some(want), "{what}");
        }
        assert_eq!(replay().shadow_outcome(), Some(Outcome::Replayed));
    }

    #[test]
    fn shadow_mode_does_not_count_the_body_the_store_or_the_proxy() {
        let not_counted = [
            Problem::BodyTooLarge { limit: 1 },
            Problem::BodyTimeout {
                after: Duration::from_secs(1),
            },
            Problem::BodyUnreadable,
            Problem::ProxyBusy,
            Problem::StoreUnavailable,
            Problem::UpstreamUnreachable,
        ];
        for p in not_counted {
            let what = format!("{p:?}");
            assert_eq!(Stop::Refuse(p).shadow_outcome(), None, "{what}");
        }
        assert_eq!(Stop::Unprotected.shadow_outcome(), None);
        assert_eq!(Stop::StoreDown { may_pass: true }.shadow_outcome(), None);
        assert_eq!(Stop::StoreDown { may_pass: false }.shadow_outcome(), None);
    }
}
