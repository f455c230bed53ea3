//! The request path. Unprotected requests stream through. A protected one goes
//! phase by phase — key → body → fingerprint and scope → reserve and verdict →
//! forward and complete — and any phase may stop it with a `Stop`, a value
//! that says what enforcement answers; shadow mode turns every stop into a
//! plain forward in one place (`stopped`). An upgrade request (a WebSocket)
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
use self::job::{Claim, Job};
pub use self::tunnel::is_upgrade;
use self::verdict::{replay, Verdict};
use crate::app::App;
use crate::body::{read_capped, Body, Capped, Cut};
use crate::budget::Room;
use crate::conn::Caller;
use crate::key::{self, KeyRead, NoKey};
use crate::metrics::Outcome;
use crate::permit::Permit;
use crate::policy::{Concurrent, KeyMode, Mode, OnStoreError, Policy};
use crate::problem::Problem;
use crate::record::{now_ms, DecodeError, Finished, Processing, Record, Token};
use crate::routes::{Route, RouteName, RouteTable};
use crate::store::{Inspected, RecordKey, Reservation, StoreError, INLINE_RECORD};
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
    /// A gRPC request: the proxy's own answers are gRPC errors (§9).
    grpc: bool,
    /// When the request's handling began (its body is due `body_read_timeout` after).
    start: Instant,
}

impl Ctx<'_> {
    fn problem(&self, p: &Problem) -> Handled {
        Handled::new(p.response_to(&self.request_id, self.grpc), p.outcome())
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
pub fn handle(app: Arc<App>, req: Request<Incoming>, caller: Caller, permit: Permit) -> Handling {
    // Looked up once, in one table (a reload between two lookups could disagree).
    let routes = app.routes();
    let position = routes.position(req.method(), req.uri().path());
    if position.is_none() && !tunnel::is_upgrade(&req) {
        Box::pin(pass_through(app, req, caller, permit))
    } else {
        Box::pin(any_path(app, req, caller, (routes, position), permit))
    }
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
    let ctx = begun.ctx(&app, caller);
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
    let ctx = begun.ctx(&app, caller);
    let route = position.map(|i| routes.at(i));
    // The protected path's phases are awaited here, not in a function of
    // their own: each layer of future is one more copy of its state.
    let handled = match route {
        // An `Upgrade` header is never a way around the key check (§9): on a
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
    let prepared = ctx.app.upstream.prepare(parts, body, ctx.caller);
    match send(ctx, prepared).await {
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
        warn!(request_id = %ctx.request_id, error = %e, "upstream failed (unprotected request)");
        ctx.problem(&Problem::from_upstream(&e, true))
    })
}

/// Why a protected request left the protected path before it was forwarded.
enum Stop {
    /// Enforcement answers with this problem; shadow mode forwards the request
    /// as it came, as if the proxy were absent (§8).
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
    /// Does the proxy answer this itself (rather than forward the request)?
    fn answered_here(&self, policy: &Policy) -> bool {
        match self {
            _ if policy.mode == Mode::Shadow => false,
            Stop::Unprotected => false,
            Stop::StoreDown { may_pass } => {
                !(*may_pass && policy.on_store_error == OnStoreError::Pass)
            }
            Stop::Refuse(_) | Stop::Replay(..) => true,
        }
    }

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
                | Problem::RecordUnreadable => Some(p.outcome()),
                _ => None,
            },
            _ => None,
        }
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

/// The phases, in the contract's check order: key (400) → body (413) → store
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

/// A stopped request: shadow mode counts what enforcement would have answered
/// and forwards it as if the proxy were absent; enforcement answers.
async fn stopped(ctx: &Ctx<'_>, route: &Route, stop: Stop, mut req: Pending) -> Handled {
    let policy = &route.policy;
    let h2 = req.parts.version >= http::Version::HTTP_2;
    if h2 && stop.answered_here(policy) && !matches!(req.body, Body::Full(_)) {
        req.body.drain_some().await;
    }
    // (HTTP/1 only: HTTP/2 has no `Connection`, and a stream ends by itself.)
    let unread = !matches!(req.body, Body::Full(_)) && req.parts.version < http::Version::HTTP_2;
    // Forwarding is boxed: a replay or a refusal, the common ends here, does
    // not carry (and copy) the exchange's ~3 KiB of state with it.
    let forward = |parts, body, outcome| Box::pin(forward(ctx, parts, body, outcome));
    let mut handled = match stop {
        stop if policy.mode == Mode::Shadow => {
            if let Some(would_be) = stop.shadow_outcome() {
                ctx.app.metrics.shadow(&route.name, would_be);
            }
            forward(req.parts, req.body, Outcome::Passthrough).await
        }
        Stop::Refuse(p) => refusal(ctx, policy, &p),
        // The room that has held the record since the store sent it goes on
        // with the replay's body: no gap in which the bytes are not counted.
        Stop::Replay(f, mut room) => {
            if room.reach(f.body.len() as u64) {
                let resp = replay(*f, &policy.replayed_header).map(|b| b.counted(room));
                Handled::new(resp, Outcome::Replayed)
            } else {
                ctx.problem(&Problem::ProxyBusy)
            }
        }
        // A WebSocket without a key on an optional route goes on as one:
        // unprotected either way, and dropping its upgrade would only break it.
        Stop::Unprotected if tunnel::asks_upgrade(req.parts.version, &req.parts.headers) => {
            let handshake = Request::from_parts(req.parts, req.body);
            let mut handled = Box::pin(tunnel::open(ctx, handshake)).await;
            handled.record_id = None;
            return handled;
        }
        Stop::Unprotected => forward(req.parts, req.body, Outcome::Passthrough).await,
        Stop::StoreDown { may_pass: true } if policy.on_store_error == OnStoreError::Pass => {
            forward(req.parts, req.body, Outcome::StoreBypass).await
        }
        Stop::StoreDown { .. } => ctx.problem(&Problem::StoreUnavailable),
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
    let processing = processing(route, id, token, created_ms);
    // Room for what a reserve may bring back with its answer (a record up to INLINE_RECORD).
    let inline = app
        .budget
        .take(INLINE_RECORD)
        .ok_or(Stop::Refuse(Problem::ProxyBusy))?;
    let mut claim = Claim::new(app.clone(), id.key.clone(), token);
    // Shadow mode never delays a request to wait for another.
    let waits = policy.concurrent == Concurrent::Wait && policy.mode == Mode::Enforce;
    // `wait_timeout` from the first reserve sent (one clock read for both).
    let mut waits_until = None;
    let mut pause = Duration::from_millis(5);
    // Records that went between the reserve and their fetch: an honest store
    // then has the key free for the next reserve; one that says so for ever
    // is not believed.
    let mut gone = 0;
    loop {
        let store_down = |e| match e {
            StoreError::Taken(_) => store_down(ctx, id, e, Taken::Yes),
            e => store_down(ctx, id, e, Taken::No),
        };
        let sent_at = Instant::now();
        let wait_until = *waits_until.get_or_insert(sent_at + policy.wait_timeout);
        let found =
            app.store
                .reserve_at(sent_at, id.key.as_str(), processing.clone(), policy.lease);
        let judged = match found.await.map_err(store_down)? {
            Reservation::Reserved => Ok(Some((Verdict::Ours, None, None))),
            found => judge(ctx, id, token, found).await,
        };
        let (verdict, ttl, fetched) = match judged {
            Ok(Some(judged)) => judged,
            // The record went between the reserve and its fetch: reserve again.
            Ok(None) if gone < GONE_TRIES => {
                gone += 1;
                continue;
            }
            Ok(None) => {
                claim.disarm();
                let e = StoreError::Untrue("a record that is gone whenever it is read".into());
                return Err(self::store_down(ctx, id, e, Taken::Yes));
            }
            Err(stop) => {
                claim.disarm();
                return Err(stop);
            }
        };
        if matches!(verdict, Verdict::InFlight { .. }) && waits && Instant::now() < wait_until {
            // Back off, so as not to hammer the store; a released key is then reserved by us.
            tokio::time::sleep(pause.min(wait_until.saturating_duration_since(Instant::now())))
                .await;
            pause = (pause * 2).min(Duration::from_millis(250));
            continue;
        }
        if !matches!(verdict, Verdict::Ours) {
            claim.disarm();
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
            Verdict::InFlight { created_ms } => {
                Err(conflict(ctx, route, id, ttl, created_ms).await?)
            }
        };
    }
}

/// The 409 for a key whose first request is still in flight, with a
/// `Retry-After` estimate (§7): the route's typical duration less what the
/// first has run (its record's clock, so a first on another proxy counts
/// too), within the lease. Only a 409 needs the remaining lease (`ttl`, else
/// a `PTTL`): replays and mismatches stay at one round trip.
async fn conflict(
    ctx: &Ctx<'_>,
    route: &Route,
    id: &Identity,
    ttl: Option<Duration>,
    created_ms: u64,
) -> Result<Stop, Stop> {
    let left = match ttl {
        Some(ttl) => ttl,
        None => ctx
            .app
            .store
            .pttl(id.key.as_str())
            .await
            .map_err(|e| store_down(ctx, id, e, Taken::Yes))?,
    };
    // At most the lease: the first may have finished between the two round
    // trips, and then PTTL is its record's TTL, not a lease.
    let lease_left = left.min(route.policy.lease);
    let ran = Duration::from_millis(now_ms().saturating_sub(created_ms));
    let retry_after = route.typical.retry_after(ran, lease_left);
    Ok(Stop::Refuse(Problem::Conflict { retry_after }))
}

/// The `processing` record a reserve writes.
fn processing(route: &Route, id: &Identity, token: Token, created_ms: u64) -> Bytes {
    Record::Processing(Processing {
        token,
        fingerprint: id.fingerprint,
        created_ms,
        route: route.name.to_string(),
    })
    .encode()
}

/// What holds the key, judged, with its remaining TTL when known. A record
/// too large to come with the reserve's answer is judged by its head, which
/// came with it; only a replay fetches it whole, with room for it in the
/// budget, and that room comes back with the verdict (the replay keeps it);
/// `None` when the record went away in between.
async fn judge(ctx: &Ctx<'_>, id: &Identity, token: Token, found: Reservation) -> Judged {
    let unreadable = |e: &dyn std::fmt::Display| {
        error!(request_id = %ctx.request_id, record_id = id.key.id(), error = %e, "the record under this key cannot be read; not forwarding");
        Ok(Some((Verdict::Unreadable, None, None)))
    };
    let (record, ttl, room) = match found {
        Reservation::Reserved => return Ok(Some((Verdict::Ours, None, None))),
        Reservation::Existing { record, ttl } => (record, ttl, None),
        Reservation::Unreadable(e) => return unreadable(&e),
        // Boxed: the large read's state is not carried by every replay's.
        // Only a replay needs more than the head (boxed: the large read's
        // state is not carried by every replay's).
        Reservation::Large { len, head } => match Verdict::of_head(&head, token, &id.fingerprint) {
            Some(verdict) => return Ok(Some((verdict, None, None))),
            None => match Box::pin(fetch_large(ctx, id, len)).await? {
                Fetched::Gone => return Ok(None),
                Fetched::Unreadable(e) => return unreadable(&e),
                Fetched::Record(record, ttl, room) => (record, Some(ttl), Some(room)),
            },
        },
    };
    Ok(Some((
        Verdict::of(record, token, &id.fingerprint),
        ttl,
        room,
    )))
}

/// A record too large for the reserve's answer, read by itself.
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

/// A verdict, the record's TTL when known, and the room a fetched record holds.
type Judged = Result<Option<(Verdict, Option<Duration>, Option<Room>)>, Stop>;

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
    warn!(request_id = %ctx.request_id, record_id = id.key.id(), error = %e, taken = taken == Taken::Yes, "store unavailable while reserving");
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
/// there (§8). The upstream learns the request id, to match its logs with the record.
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
    let request = match app.upstream.prepare(parts, Body::full(body), ctx.caller) {
        Ok(r) => r,
        Err(e) => {
            // Dropping the claim releases the key.
            warn!(request_id = %ctx.request_id, error = %e, "cannot build the upstream request");
            return ctx.problem(&Problem::UpstreamUnreachable);
        }
    };
    let mut job = Job {
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
