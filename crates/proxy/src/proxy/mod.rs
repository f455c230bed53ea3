//! The request path. Unprotected requests stream through. A protected one goes
//! phase by phase — key → body → fingerprint and scope → reserve and verdict
//! (`reserve`) → forward and complete (`job`) — and any phase may stop it
//! with a `Stop`, a value that says what enforcement does (`stop`). What the
//! route's mode changes is worked out once per request (`Enforcement::of`):
//! shadow mode turns every stop into a plain forward, never waits, and lets
//! a WebSocket through. An upgrade request (a WebSocket) on a path no route
//! protects becomes a tunnel (`tunnel`); on a protected route under
//! enforcement its upgrade intent is dropped and it is protected like any other.

mod access;
mod job;
mod reserve;
mod stop;
mod tunnel;
mod verdict;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderValue, CONNECTION};
use http::{HeaderName, Request, Response};
use hyper::body::Incoming;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::{info, warn};
use uuid::Uuid;

use self::access::{Begun, RequestPlace};
use self::job::{Job, JobTrace};
use self::reserve::{reserve, Reserved};
use self::stop::{stopped, Enforcement, Stop};
pub(crate) use self::tunnel::is_upgrade;
use crate::app::App;
use crate::body::{read_capped, Body, Capped, Cut};
use crate::budget::Room;
use crate::conn::Caller;
use crate::key::{self, KeyRead, NoKey};
use crate::metrics::Outcome;
use crate::permit::Permit;
use crate::policy::{KeyMode, Policy};
use crate::problem::Problem;
use crate::record::TraceRef;
use crate::routes::{self, Judgement, Route, RouteName, RouteTable};
use crate::store::RecordKey;
use crate::telemetry;
use crate::upstream::{Inbound, UpstreamError};

pub(crate) const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

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
pub(crate) type Handling = Pin<Box<dyn Future<Output = (Response<Body>, Permit)> + Send>>;

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
    let handled = match route.map(|r| (r, Enforcement::of(&r.policy))) {
        // An `Upgrade` header is never a way around the key check
        // (docs/reference/behaviour.md#upgrade): on a
        // protected route the intent is dropped (the upstream request is built
        // without hop-by-hop headers) and the request protected like any other.
        // Shadow mode forwards as if the proxy were absent: a WebSocket too.
        Some((_, enforcement)) if enforcement.tunnels_upgrades && tunnel::is_upgrade(&req) => {
            Box::pin(tunnel::open(&ctx, req.map(|b| Body::Stream(b.into())))).await
        }
        Some((route, enforcement)) => {
            let (parts, body) = req.into_parts();
            let pending = Pending {
                parts,
                body: Body::Stream(body.into()),
                record_id: None,
            };
            match enforce(&ctx, (route, enforcement), pending, &mut begun).await {
                Ok(handled) => handled,
                Err((stop, pending)) => stopped(&ctx, route, enforcement, stop, pending).await,
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
    (route, enforcement): (&Route, Enforcement),
    mut req: Pending,
    begun: &mut Begun,
) -> Result<Handled, (Stop, Pending)> {
    let policy = &route.policy;
    let key = phase!(read_key(&req.parts, policy), req);
    let (body, room) = phase!(read_body(ctx, policy, &mut req.body).await, req);
    let key = key.or_from_body(&body, policy.max_key_length);
    let key = phase!(key.map_err(|no| no_key(policy, no, &req.parts)), req);
    let id = Identity::of(ctx.app, policy, &req.parts, &key, &body);
    req.record_id = Some(id.key.clone());
    let reserved = phase!(reserve(ctx, route, &id, enforcement).await, req);
    let Pending {
        parts, record_id, ..
    } = req;
    let place = begun.hand_over();
    let mut handled = forward_reserved(ctx, route, id, reserved, parts, (body, room), place).await;
    handled.record_id = record_id;
    Ok(handled)
}

/// Phase 1, the key: present, one line, valid, when a header carries it (a
/// key in the JSON body is read after phase 2).
fn read_key<'p>(parts: &http::request::Parts, policy: &'p Policy) -> Result<KeyRead<'p>, Stop> {
    key::from_headers(&parts.headers, &policy.key_from, policy.max_key_length)
        .map_err(|no| no_key(policy, no, parts))
}

/// No key to use: refused, or forwarded unprotected when an optional route
/// has none (a WebSocket's handshake then becomes a tunnel).
fn no_key(policy: &Policy, no: NoKey, parts: &http::request::Parts) -> Stop {
    let from = policy.key_from.clone();
    match no {
        NoKey::Missing if policy.key == KeyMode::Optional => {
            // Asked only of a request without a key: a replay's path reads no more headers.
            Stop::unprotected(tunnel::asks_upgrade(parts.version, &parts.headers))
        }
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

/// Phase 5: forward and complete in a task of its own (see [`Job`]), which
/// holds the request's place in `idemproxy_inflight` and among the requests
/// in progress (`place`) until it ends, whether or not the client is still
/// there (docs/reference/behaviour.md#request-id). The upstream learns the request id, to match
/// its logs with the record.
async fn forward_reserved(
    ctx: &Ctx<'_>,
    route: &Route,
    id: Identity,
    reserved: Reserved,
    mut parts: http::request::Parts,
    (body, room): (Bytes, Room),
    place: RequestPlace,
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
        _place: place,
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
