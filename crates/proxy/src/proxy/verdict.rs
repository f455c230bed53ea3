//! What a record found under the key means for this request: ours, a replay,
//! in flight, or another request's — decided in one place, without I/O; and
//! a replay's answer, and the headers a record keeps.

use http::header::{HeaderValue, CONTENT_LENGTH, DATE, SET_COOKIE};
use http::{HeaderMap, HeaderName, Response, StatusCode};

use std::time::Duration;

use crate::body::Body;
use crate::budget::Room;
use crate::record::{Afterlife, Finished, Head, Record, Token, TraceRef};

/// What the store's answer to a reserve means for this request: phase 4's
/// one decision type, made from a [`Reservation`](crate::store::Reservation)
/// (by [`Verdict::of`] for a record, [`Verdict::of_head`] for a large one's
/// head) and carried out by `reserve`. It carries what the rest of phase 4
/// needs: the room a record fetched by itself holds, what is left of a
/// reservation's lease when the store said, and the trace context of the
/// request that executed (a replay, a 409 or a 422 links to it). (A replay's
/// record is moved into the answer, not boxed: a boxed one would cost every
/// replay an allocation to save the other verdicts' bytes.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub(crate) enum Verdict {
    /// Our own reservation: the key was free, or a reserve sent twice (the
    /// client library re-sent it) finds it.
    Ours,
    /// The same request, finished: its answer is replayed, in the room it
    /// has held since it came from the store when it was fetched by itself
    /// (a large record; `None`: the reserve's own room holds it).
    Replay(Finished, Option<Room>),
    /// The same request, finished, but its answer was too large to keep.
    NotStored { original: Option<TraceRef> },
    /// The same request, still in flight since `created_ms` (its reservation,
    /// Unix ms), or left behind by an `owner` that vanished: its reservation's
    /// `afterlife` says how to tell (docs/reference/behaviour.md#dead-owner).
    /// `ttl`: what is left of its lease, when the store said.
    InFlight {
        created_ms: u64,
        owner: Token,
        afterlife: Option<Afterlife>,
        ttl: Option<Duration>,
        original: Option<TraceRef>,
    },
    /// Another request under the same key.
    Mismatch { original: Option<TraceRef> },
    /// A record this build cannot read: not ours, not to be replaced or bypassed.
    Unreadable,
    /// A large record that went away between the reserve and its fetch: reserve again.
    Gone,
}

impl Verdict {
    /// Judges `record` for a request with `fingerprint` whose reservation would carry `token`.
    pub fn of(record: Record, token: Token, fingerprint: &[u8; 32]) -> Verdict {
        if matches!(&record, Record::Processing(p) if p.token == token) {
            return Verdict::Ours;
        }
        let original = record.trace();
        if record.fingerprint() != fingerprint {
            return Verdict::Mismatch { original };
        }
        match record {
            Record::Finished(f) if f.body_stored => Verdict::Replay(f, None),
            Record::Finished(_) => Verdict::NotStored { original },
            Record::Processing(p) => Verdict::InFlight {
                created_ms: p.created_ms,
                owner: p.token,
                afterlife: p.afterlife,
                ttl: None,
                original,
            },
        }
    }

    /// Judges a record by its clear head alone, as [`Verdict::of`] would
    /// judge it whole; `None` when the verdict is a replay, the one verdict
    /// that needs the answer itself (a large record is then fetched whole).
    /// A large reservation is a record being written piece by piece: its
    /// owner is at work, never judged gone (no afterlife).
    pub(crate) fn of_head(head: &Head, token: Token, fingerprint: &[u8; 32]) -> Option<Verdict> {
        let original = head.trace;
        match head.finished {
            None if head.token == token => Some(Verdict::Ours),
            _ if head.fingerprint != *fingerprint => Some(Verdict::Mismatch { original }),
            None => Some(Verdict::InFlight {
                created_ms: head.created_ms,
                owner: head.token,
                afterlife: None,
                ttl: None,
                original,
            }),
            Some(answered) if !answered.body_stored => Some(Verdict::NotStored { original }),
            Some(_) => None,
        }
    }

    /// The verdict with what the store said besides the record: what is
    /// left of its lease or TTL (kept by a record in flight), and the room
    /// of a record fetched by itself (kept by a replay).
    pub(crate) fn with_lease_and_room(
        mut self,
        lease_left: Option<Duration>,
        fetched: Option<Room>,
    ) -> Verdict {
        match &mut self {
            Verdict::InFlight { ttl, .. } => *ttl = lease_left,
            Verdict::Replay(_, room) => *room = fetched,
            _ => {}
        }
        self
    }

    /// The trace context of the request that executed, for a replay, a 409
    /// or a 422 to link to, when its record keeps it.
    pub fn original(&self) -> Option<TraceRef> {
        match self {
            Verdict::Replay(f, _) => f.trace,
            Verdict::NotStored { original }
            | Verdict::Mismatch { original }
            | Verdict::InFlight { original, .. } => *original,
            Verdict::Ours | Verdict::Unreadable | Verdict::Gone => None,
        }
    }
}

/// The stored answer, byte for byte and with its trailers, marked as a
/// replay. `Date` and `Content-Length` are recomputed (an answer with
/// trailers goes out chunked on HTTP/1.1).
pub fn replay(f: Finished, replayed_header: &HeaderName) -> Response<Body> {
    let trailers = (!f.trailers.is_empty()).then(|| {
        let mut t = HeaderMap::with_capacity(f.trailers.len());
        for (name, value) in f.trailers {
            t.append(name, value);
        }
        t
    });
    let mut resp = Response::new(Body::full(f.body).trailed(trailers));
    *resp.status_mut() = StatusCode::from_u16(f.status).unwrap_or(StatusCode::OK);
    // HTTP/1.1 clients get the upstream's own reason phrase back (HTTP/2 has none).
    if let Some(reason) = f
        .reason
        .and_then(|r| hyper::ext::ReasonPhrase::try_from(r).ok())
    {
        resp.extensions_mut().insert(reason);
    }
    let headers = resp.headers_mut();
    headers.reserve(f.headers.len() + 1);
    for (name, value) in f.headers {
        headers.append(name, value);
    }
    headers.insert(replayed_header.clone(), HeaderValue::from_static("true"));
    resp
}

/// The end-to-end headers that may be replayed: hop-by-hop ones are already gone;
/// `Set-Cookie` must not be handed out again; `Date` and `Content-Length` are recomputed.
pub(crate) fn storable_headers(headers: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    headers
        .iter()
        .filter(|(n, _)| **n != SET_COOKIE && **n != DATE && **n != CONTENT_LENGTH)
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Answered, Processing};
    use bytes::Bytes;

    fn processing(token: Token, fingerprint: [u8; 32]) -> Record {
        Record::Processing(Processing {
            token,
            fingerprint,
            created_ms: 1,
            route: "r".into(),
            trace: None,
            afterlife: None,
        })
    }

    fn finished(fingerprint: [u8; 32], body_stored: bool) -> Record {
        Record::Finished(Finished {
            token: Token::new(),
            fingerprint,
            created_ms: 1,
            route: "r".into(),
            trace: None,
            completed_ms: 2,
            status: 201,
            reason: None,
            body_stored,
            headers: vec![
                (
                    HeaderName::from_static("x-a"),
                    HeaderValue::from_static("1"),
                ),
                (
                    HeaderName::from_static("x-a"),
                    HeaderValue::from_static("2"),
                ),
            ],
            body: Bytes::from_static(b"done"),
            trailers: vec![],
        })
    }

    #[test]
    fn our_own_reservation_is_ours_whatever_else() {
        let t = Token::new();
        assert!(matches!(
            Verdict::of(processing(t, [1; 32]), t, &[1; 32]),
            Verdict::Ours
        ));
    }

    #[test]
    fn another_owner_with_the_same_request_is_in_flight() {
        let v = Verdict::of(processing(Token::new(), [1; 32]), Token::new(), &[1; 32]);
        assert!(matches!(v, Verdict::InFlight { created_ms: 1, .. }));
    }

    #[test]
    fn a_different_fingerprint_is_a_mismatch_in_flight_or_finished() {
        let v = Verdict::of(processing(Token::new(), [1; 32]), Token::new(), &[2; 32]);
        assert!(matches!(v, Verdict::Mismatch { .. }));
        let v = Verdict::of(finished([1; 32], true), Token::new(), &[2; 32]);
        assert!(matches!(v, Verdict::Mismatch { .. }));
        let v = Verdict::of(finished([1; 32], false), Token::new(), &[2; 32]);
        assert!(matches!(v, Verdict::Mismatch { .. }));
    }

    #[test]
    fn a_finished_record_replays_unless_its_body_was_not_kept() {
        let v = Verdict::of(finished([1; 32], true), Token::new(), &[1; 32]);
        assert!(matches!(v, Verdict::Replay(f, _) if f.status == 201));
        let v = Verdict::of(finished([1; 32], false), Token::new(), &[1; 32]);
        assert!(matches!(v, Verdict::NotStored { .. }));
    }

    #[test]
    fn a_replay_keeps_status_repeated_headers_and_body_and_is_marked() {
        let Record::Finished(f) = finished([1; 32], true) else {
            unreachable!()
        };
        let marker = HeaderName::from_static("idempotent-replayed");
        let r = replay(f, &marker);
        assert_eq!(r.status(), 201);
        let a: Vec<_> = r.headers().get_all("x-a").iter().collect();
        assert_eq!(a, ["1", "2"]);
        assert_eq!(r.headers()[&marker], "true");
    }

    #[test]
    fn cookies_date_and_length_are_never_stored() {
        let mut h = HeaderMap::new();
        h.insert(SET_COOKIE, HeaderValue::from_static("s=1"));
        h.insert(
            DATE,
            HeaderValue::from_static("Mon, 30 Nov 2026 10:00:00 GMT"),
        );
        h.insert(CONTENT_LENGTH, HeaderValue::from_static("4"));
        h.insert("location", HeaderValue::from_static("/p/1"));
        let kept = storable_headers(&h);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].0, "location");
    }

    fn head(token: Token, fingerprint: [u8; 32], finished: Option<bool>) -> Head {
        Head {
            afterlife: None,
            token,
            fingerprint,
            created_ms: 7,
            route: "r".into(),
            trace: None,
            finished: finished.map(|body_stored| Answered {
                completed_ms: 8,
                status: 201,
                body_stored,
            }),
            sealed_with: None,
        }
    }

    #[test]
    fn a_head_of_our_own_reservation_is_ours() {
        let t = Token::new();
        let v = Verdict::of_head(&head(t, [1; 32], None), t, &[1; 32]);
        assert!(matches!(v, Some(Verdict::Ours)));
    }

    #[test]
    fn a_head_of_another_owner_in_flight_is_in_flight_since_its_creation() {
        let v = Verdict::of_head(&head(Token::new(), [1; 32], None), Token::new(), &[1; 32]);
        assert!(matches!(v, Some(Verdict::InFlight { created_ms: 7, .. })));
    }

    #[test]
    fn a_head_with_another_fingerprint_is_a_mismatch_in_flight_or_finished() {
        for finished in [None, Some(true), Some(false)] {
            let v = Verdict::of_head(
                &head(Token::new(), [1; 32], finished),
                Token::new(),
                &[2; 32],
            );
            assert!(matches!(v, Some(Verdict::Mismatch { .. })), "{finished:?}");
        }
    }

    #[test]
    fn a_finished_head_needs_the_record_only_when_its_answer_was_kept() {
        let v = Verdict::of_head(
            &head(Token::new(), [1; 32], Some(false)),
            Token::new(),
            &[1; 32],
        );
        assert!(matches!(v, Some(Verdict::NotStored { .. })));
        let v = Verdict::of_head(
            &head(Token::new(), [1; 32], Some(true)),
            Token::new(),
            &[1; 32],
        );
        assert!(v.is_none());
    }

    #[test]
    fn a_finished_head_under_our_token_is_judged_as_finished() {
        // A token is ours only while it reserves: a finished record is a replay.
        let t = Token::new();
        let v = Verdict::of_head(&head(t, [1; 32], Some(false)), t, &[1; 32]);
        assert!(matches!(v, Some(Verdict::NotStored { .. })));
    }
}
