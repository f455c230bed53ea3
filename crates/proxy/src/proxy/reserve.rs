//! Phase 4: reserve the key, or learn what holds it and what that means for
//! this request. One answer of the store goes through two types:
//!
//! - [`Reservation`] is the store's answer, decoded (`store`): the key is
//!   ours, a record holds it (with what is left of its lease when the store
//!   said), a value this build cannot read holds it, or a record too large to
//!   come with the answer does (its clear head came instead).
//! - [`Verdict`] is the decision (`verdict`): what that answer means for
//!   this request — ours, a replay, a 410, a 422, unreadable, in flight, or
//!   gone before a large record could be fetched (then reserve again). A
//!   large record is judged by its head; only a replay fetches it whole.
//!
//! [`reserve`] acts on the verdict: a duplicate in flight waits (`concurrent
//! = "wait"`), takes the key over from an owner that vanished, or gets its
//! 409; the key that is ours goes on as [`Reserved`]; every other end leaves
//! the protected path as the [`Stop`] that says what enforcement answers.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use tracing::{error, warn};

use super::job::Claim;
use super::stop::{Enforcement, Stop};
use super::verdict::Verdict;
use super::{Ctx, Identity};
use crate::policy::{DeadOwner, Policy};
use crate::problem::Problem;
use crate::record::{now_ms, Afterlife, Finished, Processing, Record, Token, TraceRef};
use crate::routes::Route;
use crate::store::{Inspected, Reservation, StoreError, INLINE_RECORD};
use crate::telemetry;

/// How often a reserve may find a record that is gone when it is fetched
/// ([`Verdict::Gone`]): an honest store then has the key free for the next
/// reserve; one that says so for ever is not believed.
const GONE_TRIES: u32 = 3;

/// Phase 4's result: the key is ours.
pub(super) struct Reserved {
    pub(super) claim: Claim,
    pub(super) created_ms: u64,
    /// Taken before the reserve was sent: the lease runs from no earlier.
    pub(super) sent_at: Instant,
}

/// One request's reserve: what each of its steps needs.
struct Reserving<'r, 'c> {
    ctx: &'r Ctx<'c>,
    route: &'r Route,
    id: &'r Identity,
    /// The token of the reservation this request writes.
    token: Token,
    created_ms: u64,
    /// The `processing` record its reserves write ([`processing`]).
    processing: Bytes,
}

/// Phase 4: reserve the key, or learn what holds it. With `concurrent = "wait"`
/// a duplicate of a request in flight polls until it finishes or is released.
/// From the first reserve sent, a [`Claim`] releases the key if the request ends here.
pub(super) async fn reserve(
    ctx: &Ctx<'_>,
    route: &Route,
    id: &Identity,
    enforcement: Enforcement,
) -> Result<Reserved, Stop> {
    let (app, policy) = (ctx.app, &route.policy);
    let r = Reserving::new(ctx, route, id);
    let created_ms = r.created_ms;
    // The reserve's span (and, while a duplicate waits, the wait's, beside it): ended
    // when this returns. The SERVER span's ids go with the reservation.
    let span = ctx.span("idempotency.reserve", || {
        telemetry::record_attributes(route.name.as_str(), id.key.id())
    });
    let mut waiting = None;
    // Room for what a reserve may bring back with its answer (a record up to INLINE_RECORD).
    let inline = app
        .budget
        .take(INLINE_RECORD)
        .ok_or(Stop::Refuse(Problem::ProxyBusy))?;
    let mut claim = Claim::new(app.clone(), id.key.clone(), r.token);
    let mut patience = Patience::new(policy, enforcement);
    let mut gone = 0;
    loop {
        let sent_at = Instant::now();
        patience.start(sent_at);
        let hold = policy.reservation_hold();
        let found = app
            .store
            .reserve_at(sent_at, id.key.as_str(), r.processing.clone(), hold);
        let mut verdict = match found.await.map_err(|e| r.reserve_failed(e))? {
            Reservation::Reserved => Verdict::Ours,
            found => match r.judge(found).await {
                Ok(Verdict::Gone) if gone < GONE_TRIES => {
                    gone += 1;
                    continue;
                }
                Ok(verdict) => verdict,
                Err(stop) => {
                    claim.disarm();
                    return Err(stop);
                }
            },
        };
        let looked = r.look_for_vanished(&mut verdict, &mut claim, &mut patience);
        if let Some(sent_at) = looked.await? {
            return Ok(Reserved {
                claim,
                created_ms,
                sent_at,
            });
        }
        let in_flight = matches!(verdict, Verdict::InFlight { .. });
        if in_flight && patience.wait(ctx, span.is_some(), &mut waiting).await {
            continue;
        }
        drop(waiting);
        if !matches!(verdict, Verdict::Ours) {
            claim.disarm();
            // A replay, a 409, a 422: linked to the request that executed.
            ctx.link_original(verdict.original());
        }
        return match verdict {
            Verdict::Ours => Ok(Reserved {
                claim,
                created_ms,
                sent_at,
            }),
            // A large record came with room of its own; an inline one in the reserve's.
            Verdict::Replay(f, fetched) => {
                Err(Stop::Replay(Box::new(f), fetched.unwrap_or(inline)))
            }
            Verdict::NotStored { .. } => Err(Stop::Refuse(Problem::NotStored)),
            Verdict::Mismatch { .. } => Err(Stop::Refuse(Problem::Mismatch)),
            Verdict::Unreadable => Err(Stop::Refuse(Problem::RecordUnreadable)),
            Verdict::InFlight {
                created_ms,
                afterlife,
                ttl,
                ..
            } => Err(r.conflict(ttl, (created_ms, afterlife)).await?),
            Verdict::Gone => {
                let e = StoreError::Untrue("a record that is gone whenever it is read".into());
                Err(r.store_down(e, Taken::Yes))
            }
        };
    }
}

/// How a duplicate of a request in flight waits for it to finish or be
/// released (`concurrent = "wait"`, enforcement only: see [`Enforcement`]):
/// reserving again, backing off so as not to hammer the store, until
/// `wait_timeout` from the first reserve sent; and when it looks again
/// whether the request's owner vanished.
struct Patience {
    waits: bool,
    wait_timeout: Duration,
    /// Set when the first reserve is sent (one clock read for both).
    until: Option<Instant>,
    pause: Duration,
    /// When a waiting duplicate next reads what is left of a reservation's
    /// time, to see whether its owner vanished: when its lease is due to end
    /// by the last reading (store time, counted here on the monotonic clock);
    /// `None`: at the next sighting.
    next_look: Option<Instant>,
}

impl Patience {
    fn new(policy: &Policy, enforcement: Enforcement) -> Self {
        Patience {
            waits: enforcement.waits,
            wait_timeout: policy.wait_timeout,
            until: None,
            pause: Duration::from_millis(5),
            next_look: None,
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
    /// is not up; `false` (at once) when it is to be answered now. A request
    /// that waits has the wait's span (`waiting`) from its first wait, when
    /// the reserve's is `traced`.
    async fn wait(
        &mut self,
        ctx: &Ctx<'_>,
        traced: bool,
        waiting: &mut Option<telemetry::Child>,
    ) -> bool {
        if self.waits && waiting.is_none() && traced {
            // A sibling of the reserve's span under the SERVER span, as
            // the guide's span reference draws it.
            *waiting = ctx.span("idempotency.wait", Vec::new);
        }
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

/// Whether the store had said the key is taken before it failed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Taken {
    No,
    /// A record holds the key (its read, or its remaining lease, failed).
    Yes,
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

impl<'r, 'c> Reserving<'r, 'c> {
    /// A reserve for the request `id` names, under a token of its own.
    fn new(ctx: &'r Ctx<'c>, route: &'r Route, id: &'r Identity) -> Self {
        let token = Token::new();
        let created_ms = now_ms();
        Reserving {
            ctx,
            route,
            id,
            token,
            created_ms,
            processing: processing(route, id, token, created_ms, ctx.trace_ref()),
        }
    }

    /// A duplicate in flight whose owner may have vanished (its reservation
    /// has an afterlife): what is left of its time is read when known for
    /// free, on the first sighting, when the lease is due to end while a
    /// duplicate waits, and before a 409 (shadow mode too: it writes records
    /// as enforcement does, and counts what enforcement would answer); a
    /// lease that ended is taken over. `Some(sent_at)`: the key is ours now
    /// (`re_execute`), its lease counted from `sent_at`. The claim is
    /// disarmed when the request is answered here.
    async fn look_for_vanished(
        &self,
        verdict: &mut Verdict,
        claim: &mut Claim,
        patience: &mut Patience,
    ) -> Result<Option<Instant>, Stop> {
        let Verdict::InFlight {
            owner,
            afterlife: Some(afterlife),
            ttl,
            ..
        } = verdict
        else {
            return Ok(None);
        };
        let mut afterlife = *afterlife;
        // The store's word, held to this route's own `ttl`: a record
        // claiming a longer afterlife (a hostile or corrupt value) would
        // have a live owner's lease judged over.
        afterlife.after = afterlife.after.min(self.route.policy.ttl);
        let due = patience.next_look.is_none_or(|at| Instant::now() >= at);
        if !(ttl.is_some() || due || !patience.may_wait()) {
            return Ok(None);
        }
        let left = match self.time_left(*ttl).await {
            Ok(left) => left,
            Err(stop) => {
                claim.disarm();
                return Err(stop);
            }
        };
        *ttl = Some(left);
        patience.next_look = Some(Instant::now() + left.saturating_sub(afterlife.after));
        if !afterlife.lease_ended(left) {
            return Ok(None);
        }
        // A take-over that failed may have written the key for this
        // request: the claim, still armed, withdraws a reservation of its own.
        match Box::pin(self.take_over((*owner, afterlife))).await? {
            TakeOver::Answer(stop) => {
                claim.disarm();
                Err(stop)
            }
            TakeOver::Ours(sent_at) => Ok(Some(sent_at)),
            // Renewed meanwhile: in flight after all, its time left to be read again.
            TakeOver::Refused => {
                (*ttl, patience.next_look) = (None, None);
                Ok(None)
            }
        }
    }

    /// What holds the key, judged. A record too large to come with the
    /// reserve's answer is judged by its head, which came with it; only a
    /// replay fetches it whole ([`Reserving::fetch_large`]).
    async fn judge(&self, found: Reservation) -> Result<Verdict, Stop> {
        let (token, fingerprint) = (self.token, &self.id.fingerprint);
        match found {
            Reservation::Reserved => Ok(Verdict::Ours),
            Reservation::Existing { record, ttl } => {
                Ok(Verdict::of(record, token, fingerprint).with_lease_and_room(ttl, None))
            }
            Reservation::Unreadable(e) => Ok(self.unreadable(&e)),
            // Only a replay needs more than the head (boxed: the large read's
            // state is not carried by every replay's).
            Reservation::Large { len, head } => match Verdict::of_head(&head, token, fingerprint) {
                Some(verdict) => Ok(verdict),
                None => Box::pin(self.fetch_large(len)).await,
            },
        }
    }

    /// A record under the key that this build cannot read: logged, not forwarded.
    fn unreadable(&self, e: &dyn std::fmt::Display) -> Verdict {
        let (ctx, id) = (self.ctx, self.id);
        let (trace_id, span_id) = ctx.log_ids();
        error!(request_id = %ctx.request_id, record_id = id.key.id(), error = %e, trace_id, span_id, "the record under this key cannot be read; not forwarding");
        Verdict::Unreadable
    }

    /// Reads a record too large for the reserve's answer, with room for its
    /// `len` bytes in the budget, its turn among large reads first: a request
    /// waiting for one holds no room for the record (only the reserve's
    /// `INLINE_RECORD`). The wait is outside `op_timeout`; each turn is
    /// bounded by it. Judged whole, with its remaining TTL and the room that
    /// holds it (a replay keeps it); [`Verdict::Gone`] when it went away in between.
    async fn fetch_large(&self, len: u64) -> Result<Verdict, Stop> {
        let app = self.ctx.app;
        let _turn = app.large_reads.acquire().await;
        let Some(room) = app.budget.take(len) else {
            return Err(Stop::Refuse(Problem::ProxyBusy));
        };
        match app.store.get(self.id.key.as_str()).await {
            Ok(None) => Ok(Verdict::Gone),
            Ok(Some(Inspected { record, ttl })) => {
                let verdict = Verdict::of(record, self.token, &self.id.fingerprint);
                Ok(verdict.with_lease_and_room(Some(ttl), Some(room)))
            }
            Err(StoreError::Decode(e)) => Ok(self.unreadable(&e)),
            Err(e) => Err(self.store_down(e, Taken::Yes)),
        }
    }

    /// A reserve that failed: whether the store had already said the key is
    /// taken (`StoreError::Taken`) decides whether `on_store_error` may pass it.
    fn reserve_failed(&self, e: StoreError) -> Stop {
        match e {
            StoreError::Taken(_) => self.store_down(e, Taken::Yes),
            e => self.store_down(e, Taken::No),
        }
    }

    /// The store failed while reserving. The claim (still armed) releases
    /// whatever the reserve may have written. Never forwarded, whatever
    /// `on_store_error` says: a reservation that was written but not confirmed
    /// on the replicas, a memory store that is full (the store is there, and
    /// forwarding would drop protection silently), an answer that is not
    /// believed (a record longer than any the proxy writes: the key may be
    /// taken), and a key the reserve found taken whose record could not then
    /// be read in time (the operation may have run, or be running).
    fn store_down(&self, e: StoreError, taken: Taken) -> Stop {
        let (ctx, id) = (self.ctx, self.id);
        let (trace_id, span_id) = ctx.log_ids();
        warn!(request_id = %ctx.request_id, record_id = id.key.id(), error = %e, taken = taken == Taken::Yes, trace_id, span_id, "store unavailable while reserving");
        let may_pass = taken == Taken::No
            && !matches!(
                e,
                StoreError::NotReplicated { .. }
                    | StoreError::Unconfirmed(_)
                    | StoreError::Full
                    | StoreError::Untrue(_)
            );
        Stop::store_down(may_pass, &self.route.policy)
    }

    /// The 409 for a key whose first request is still in flight, with a
    /// `Retry-After` estimate (docs/reference/behaviour.md#conflict): the
    /// route's typical duration less what the first has run (its record's
    /// clock, so a first on another proxy counts too), within the lease. Only
    /// a 409 needs the remaining lease (`ttl`, else a `PTTL`): replays and
    /// mismatches stay at one round trip.
    async fn conflict(
        &self,
        ttl: Option<Duration>,
        (created_ms, afterlife): (u64, Option<Afterlife>),
    ) -> Result<Stop, Stop> {
        let left = self.time_left(ttl).await?;
        // The store keeps a reservation its afterlife past its lease. At most
        // the lease: the first may have finished between the two round trips,
        // and then PTTL is its record's TTL, not a lease.
        let after = afterlife.map_or(Duration::ZERO, |a| a.after);
        let lease_left = left.saturating_sub(after).min(self.route.policy.lease);
        let ran = Duration::from_millis(now_ms().saturating_sub(created_ms));
        let retry_after = self.route.typical.retry_after(ran, lease_left);
        Ok(Stop::Refuse(Problem::Conflict { retry_after }))
    }

    /// What is left of a reservation's time in the store: `ttl` when the
    /// reserve said it, else a `PTTL` (Redis), which a 409 pays anyway.
    async fn time_left(&self, ttl: Option<Duration>) -> Result<Duration, Stop> {
        match ttl {
            Some(ttl) => Ok(ttl),
            None => self
                .ctx
                .app
                .store
                .pttl(self.id.key.as_str())
                .await
                .map_err(|e| self.store_down(e, Taken::Yes)),
        }
    }

    /// A reservation whose lease ran out without its owner (its proxy died
    /// after the request may have reached the upstream): taken over in one
    /// owner-checked operation, as the reservation says — the 502
    /// `outcome-unknown` stored under a fresh token (a late owner's completion is
    /// refused by token), or the key reserved again for this request
    /// (`re_execute`). Counted and logged; docs/reference/behaviour.md#dead-owner.
    async fn take_over(&self, (vanished, afterlife): (Token, Afterlife)) -> Result<TakeOver, Stop> {
        let (ctx, route, id) = (self.ctx, self.route, self.id);
        let (app, policy) = (ctx.app, &route.policy);
        let sent_at = Instant::now();
        let (value, hold) = match afterlife.then {
            DeadOwner::ReExecute => (self.processing.clone(), policy.reservation_hold()),
            DeadOwner::StoreUnknown => {
                let record = self.unknown_outcome();
                match app.store.encode(id.key.as_str(), &record) {
                    Ok(value) => (value, policy.ttl),
                    Err(e) => {
                        let e = StoreError::Backend(format!("the record cannot be sealed: {e}"));
                        return Err(self.store_down(e, Taken::Yes));
                    }
                }
            }
        };
        let key = id.key.as_str();
        let taken = app
            .store
            .take_over(key, vanished, afterlife.after, value, hold)
            .await
            .map_err(|e| self.store_down(e, Taken::Yes))?;
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
    fn unknown_outcome(&self) -> Record {
        let ctx = self.ctx;
        let problem = Problem::OutcomeUnknown;
        let (status, headers, body) = if ctx.grpc {
            let (status, headers) = problem.render_grpc(&ctx.request_id);
            (status, headers, Bytes::new())
        } else {
            problem.render(&ctx.request_id)
        };
        Record::Finished(Finished {
            token: self.token,
            fingerprint: self.id.fingerprint,
            created_ms: self.created_ms,
            route: self.route.name.to_string(),
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
