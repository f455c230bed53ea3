//! How a protected request leaves the protected path before it is forwarded
//! reserved: a phase stops it with a [`Stop`], which says what enforcement
//! does with it; [`Enforcement`] is the one place that works out what the
//! route's mode changes (shadow mode observes and never refuses, delays or
//! alters a request, docs/reference/behaviour.md#shadow); [`stopped`]
//! carries the stop out.

use http::header::{HeaderValue, CONNECTION};
use http::Request;

use super::verdict::replay;
use super::{forward, tunnel, Ctx, Handled, Pending};
use crate::body::Body;
use crate::budget::Room;
use crate::metrics::Outcome;
use crate::policy::{Concurrent, Mode, OnStoreError, Policy};
use crate::problem::Problem;
use crate::record::Finished;
use crate::routes::Route;

/// What becomes of a protected request that left the protected path before
/// it was forwarded reserved: made by the phase that stopped it, as
/// enforcement would carry it out; [`Enforcement::apply`] turns every stop
/// into [`Stop::Shadow`] in shadow mode, and [`stopped`] carries it out.
#[derive(Debug)]
pub(super) enum Stop {
    /// Enforcement answers with this problem.
    Refuse(Problem),
    /// The stored answer of the same request (boxed: it is the large one),
    /// and the room its bytes have held since they came from the store.
    Replay(Box<Finished>, Room),
    /// Forwarded without protection, counted as `Outcome`: pass-through (an
    /// optional route without a key), or a store bypassed under
    /// `on_store_error = "pass"`.
    Forward(Outcome),
    /// A WebSocket without a key on an optional route: a tunnel, unprotected
    /// either way (dropping its upgrade would only break it).
    Tunnel,
    /// Shadow mode: forwarded as if the proxy were absent, counting what
    /// enforcement would have answered (`would_be`, when it is counted).
    /// Made only by [`Enforcement::apply`].
    Shadow { would_be: Option<Outcome> },
}

impl Stop {
    /// No key on an optional route: forwarded unprotected; `upgrade`, the
    /// request asks for a WebSocket, which becomes a tunnel.
    pub(super) fn unprotected(upgrade: bool) -> Stop {
        match upgrade {
            true => Stop::Tunnel,
            false => Stop::Forward(Outcome::Passthrough),
        }
    }

    /// The store failed: forwarded only when it `may_pass` (see
    /// `reserve::store_down`) and the route says `on_store_error = "pass"`.
    pub(super) fn store_down(may_pass: bool, policy: &Policy) -> Stop {
        if may_pass && policy.on_store_error == OnStoreError::Pass {
            Stop::Forward(Outcome::StoreBypass)
        } else {
            Stop::Refuse(Problem::StoreUnavailable)
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
                | Problem::OutcomeUnknown
                | Problem::RecordUnreadable => Some(p.outcome()),
                _ => None,
            },
            _ => None,
        }
    }

    /// Does the proxy answer this itself (rather than forward the request)?
    fn answered_here(&self) -> bool {
        matches!(self, Stop::Refuse(_) | Stop::Replay(..))
    }
}

/// What the route's mode changes on the request path, worked out here once
/// per request ([`Enforcement::of`]) and used as it is by the phases. Shadow
/// mode (`mode = "shadow"`) writes records as enforcement does, and counts
/// what enforcement would answer, but never refuses, delays or alters a
/// request (docs/reference/behaviour.md#shadow).
#[derive(Clone, Copy, Debug)]
pub(super) struct Enforcement {
    /// Stops are carried out (a refusal, a replay, a 503); shadow mode
    /// forwards every stopped request as it came ([`Enforcement::apply`]).
    answers: bool,
    /// A duplicate of a request in flight may wait for it (`concurrent =
    /// "wait"`); shadow mode never delays a request to wait for another.
    pub(super) waits: bool,
    /// An upgrade request (a WebSocket) is tunnelled as it came, as if the
    /// proxy were absent; enforcement drops its upgrade intent and protects it.
    pub(super) tunnels_upgrades: bool,
}

impl Enforcement {
    /// The one decision of what the route's mode changes.
    pub(super) fn of(policy: &Policy) -> Enforcement {
        let enforce = policy.mode == Mode::Enforce;
        Enforcement {
            answers: enforce,
            waits: enforce && policy.concurrent == Concurrent::Wait,
            tunnels_upgrades: !enforce,
        }
    }

    /// The stop as this mode carries it out: as it is, or in shadow mode
    /// forwarded whatever it was, counting what enforcement would answer.
    fn apply(self, stop: Stop) -> Stop {
        match self.answers {
            true => stop,
            false => Stop::Shadow {
                would_be: stop.shadow_outcome(),
            },
        }
    }
}

/// Carries out a stopped request's [`Stop`], as `enforcement` says.
pub(super) async fn stopped(
    ctx: &Ctx<'_>,
    route: &Route,
    enforcement: Enforcement,
    stop: Stop,
    mut req: Pending,
) -> Handled {
    let policy = &route.policy;
    let stop = enforcement.apply(stop);
    let h2 = req.parts.version >= http::Version::HTTP_2;
    if h2 && stop.answered_here() && !matches!(req.body, Body::Full(_)) {
        req.body.drain_some().await;
    }
    // (HTTP/1 only: HTTP/2 has no `Connection`, and a stream ends by itself.)
    let unread = !matches!(req.body, Body::Full(_)) && req.parts.version < http::Version::HTTP_2;
    // Forwarding is boxed: a replay or a refusal, the common ends here, does
    // not carry (and copy) the exchange's ~3 KiB of state with it.
    let forward = |parts, body, outcome| Box::pin(forward(ctx, parts, body, outcome));
    let mut handled = match stop {
        Stop::Shadow { would_be } => {
            if let Some(would_be) = would_be {
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
        Stop::Tunnel => {
            let handshake = Request::from_parts(req.parts, req.body);
            let mut handled = Box::pin(tunnel::open(ctx, handshake)).await;
            handled.record_id = None;
            return handled;
        }
        Stop::Forward(outcome) => forward(req.parts, req.body, outcome).await,
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http::HeaderName;

    use super::*;
    use crate::budget::Budget;
    use crate::key;
    use crate::policy::KeySource;
    use crate::record::Token;

    /// What a stop says, in a form tests compare.
    #[derive(Debug, PartialEq, Eq)]
    enum Seen {
        Answer(Outcome),
        Replay,
        Forward(Outcome),
        Shadow(Option<Outcome>),
        Tunnel,
    }

    fn seen(d: &Stop) -> Seen {
        match d {
            Stop::Refuse(p) => Seen::Answer(p.outcome()),
            Stop::Replay(..) => Seen::Replay,
            Stop::Forward(o) => Seen::Forward(*o),
            Stop::Shadow { would_be } => Seen::Shadow(*would_be),
            Stop::Tunnel => Seen::Tunnel,
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

    /// Every kind of stop, made afresh (a replay holds room: stops are not
    /// cloned) for a route with `policy`; `upgrade`: the request asks for a WebSocket.
    fn every_stop(policy: &Policy, upgrade: bool) -> Vec<Stop> {
        vec![
            Stop::Refuse(Problem::Mismatch),
            Stop::Refuse(Problem::BodyTooLarge { limit: 1 }),
            replay(),
            Stop::unprotected(upgrade),
            Stop::store_down(true, policy),
            Stop::store_down(false, policy),
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
        let enforcement = Enforcement::of(&policy);
        every_stop(&policy, upgrade)
            .into_iter()
            .map(|stop| seen(&enforcement.apply(stop)))
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
        let answered = |d: Stop| d.answered_here();
        assert!(answered(Stop::Refuse(Problem::StoreUnavailable)));
        let Stop::Replay(f, room) = replay() else {
            unreachable!()
        };
        assert!(answered(Stop::Replay(f, room)));
        assert!(!answered(Stop::Forward(Outcome::StoreBypass)));
        assert!(!answered(Stop::Forward(Outcome::Passthrough)));
        assert!(!answered(Stop::Shadow {
            would_be: Some(Outcome::Replayed)
        }));
        assert!(!answered(Stop::Tunnel));
    }

    #[test]
    fn a_refusal_keeps_its_problem() {
        let policy = policy(Mode::Enforce, OnStoreError::Pass);
        let retry_after = Duration::from_secs(3);
        let stop = Stop::Refuse(Problem::Conflict { retry_after });
        let d = Enforcement::of(&policy).apply(stop);
        assert!(
            matches!(d, Stop::Refuse(Problem::Conflict { retry_after: r }) if r == retry_after)
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
        assert_eq!(Stop::unprotected(false).shadow_outcome(), None);
        assert_eq!(Stop::unprotected(true).shadow_outcome(), None);
        for on_store_error in [OnStoreError::Reject, OnStoreError::Pass] {
            let policy = policy(Mode::Enforce, on_store_error);
            assert_eq!(Stop::store_down(true, &policy).shadow_outcome(), None);
            assert_eq!(Stop::store_down(false, &policy).shadow_outcome(), None);
        }
    }

    #[test]
    fn shadow_mode_never_waits_and_lets_websockets_through() {
        for (mode, concurrent, waits, tunnels) in [
            (Mode::Enforce, Concurrent::Wait, true, false),
            (Mode::Enforce, Concurrent::Reject, false, false),
            (Mode::Shadow, Concurrent::Wait, false, true),
            (Mode::Shadow, Concurrent::Reject, false, true),
        ] {
            let policy = Policy {
                mode,
                concurrent,
                ..Policy::default()
            };
            let e = Enforcement::of(&policy);
            assert_eq!(
                (e.waits, e.tunnels_upgrades),
                (waits, tunnels),
                "{mode:?} {concurrent:?}"
            );
        }
    }
}
