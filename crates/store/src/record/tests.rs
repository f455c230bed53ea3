//! The record format: round trips of every version, sealed records, and bytes that are not records.

use super::layout::get_fields;
use super::*;

#[test]
fn roundtrip_both_states() {
    let p = Record::Processing(Processing {
        token: Token::new(),
        fingerprint: [7; 32],
        created_ms: 123,
        route: "payments".into(),
        trace: None,
        afterlife: None,
    });
    assert_eq!(Record::decode(p.encode()).unwrap(), p);
    let f = Record::Finished(Finished {
        token: Token::new(),
        fingerprint: [9; 32],
        created_ms: 1,
        route: "r".into(),
        trace: None,
        completed_ms: 2,
        status: 201,
        reason: None,
        body_stored: true,
        headers: vec![
            (
                HeaderName::from_static("location"),
                HeaderValue::from_static("/x/1"),
            ),
            (HeaderName::from_static("x-a"), HeaderValue::from_static("")),
        ],
        body: Bytes::from_static(b"\x00\x01binary\xff"),
        trailers: vec![],
    });
    let enc = f.encode();
    assert_eq!(enc[0], 1, "no trailers: written as version 1");
    assert_eq!(&enc[TOKEN_RANGE], &f.token().0);
    assert_eq!(Record::decode(enc).unwrap(), f);
}

#[test]
fn trailers_make_a_version_2_record_that_roundtrips() {
    let mut f = Finished {
        token: Token::new(),
        fingerprint: [3; 32],
        created_ms: 1,
        route: "grpc".into(),
        trace: None,
        completed_ms: 2,
        status: 200,
        reason: None,
        body_stored: true,
        headers: vec![(
            HeaderName::from_static("content-type"),
            HeaderValue::from_static("application/grpc"),
        )],
        body: Bytes::from_static(b"\x00\x00\x00\x00\x02hi"),
        trailers: vec![
            (
                HeaderName::from_static("grpc-status"),
                HeaderValue::from_static("0"),
            ),
            (
                HeaderName::from_static("grpc-message"),
                HeaderValue::from_static(""),
            ),
        ],
    };
    let enc = Record::Finished(f.clone()).encode();
    assert_eq!(enc[0], VERSION_2);
    assert_eq!(
        Record::decode(enc.clone()).unwrap(),
        Record::Finished(f.clone())
    );
    for cut in 0..enc.len() {
        assert!(Record::decode(enc.slice(..cut)).is_err(), "cut at {cut}");
    }
    // A version-1 record (what the previous build wrote) reads without trailers.
    f.trailers.clear();
    let v1 = Record::Finished(f.clone()).encode();
    assert_eq!(v1[0], 1);
    assert_eq!(Record::decode(v1).unwrap(), Record::Finished(f));
}

#[test]
fn garbage_is_an_error_not_a_panic() {
    assert!(Record::decode(Bytes::from_static(b"processing")).is_err());
    let p = Record::Processing(Processing {
        token: Token::new(),
        fingerprint: [7; 32],
        created_ms: 123,
        route: "payments".into(),
        trace: None,
        afterlife: None,
    })
    .encode();
    for cut in 0..p.len() {
        assert!(Record::decode(p.slice(..cut)).is_err());
    }
}

fn keys(text: &str) -> Keyring {
    Keyring::parse(std::path::Path::new("keys"), text.as_bytes()).unwrap()
}

const OLD: &str = "old:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
const NEW: &str = "new:ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=";
const ID: &str = "6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e52ddb7875b4b";

fn answer() -> Finished {
    Finished {
        token: Token::new(),
        fingerprint: [5; 32],
        created_ms: 10,
        route: "payments".into(),
        trace: None,
        completed_ms: 20,
        status: 201,
        reason: None,
        body_stored: true,
        headers: vec![(
            HeaderName::from_static("location"),
            HeaderValue::from_static("/secret/location/42"),
        )],
        body: Bytes::from_static(b"{\"card\":\"4242-secret-body\"}"),
        trailers: vec![(
            HeaderName::from_static("grpc-message"),
            HeaderValue::from_static("secret-trailer"),
        )],
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn a_sealed_record_keeps_its_head_clear_and_its_answer_sealed() {
    let ring = keys(OLD);
    let f = answer();
    let sealed = Record::Finished(f.clone()).seal(&ring, ID).unwrap();
    assert_eq!(sealed[0], VERSION_SEALED);
    assert_eq!(sealed[1], STATE_FINISHED);
    assert_eq!(&sealed[TOKEN_RANGE], &f.token.0);
    assert_eq!(&sealed[18..50], &f.fingerprint);
    for secret in [
        &b"4242-secret-body"[..],
        b"/secret/location",
        b"secret-trailer",
    ] {
        assert!(!contains(&sealed, secret));
    }
    let opened = Record::open(sealed.clone(), Some(&ring), ID).unwrap();
    assert_eq!(opened, Record::Finished(f.clone()));
    // The head reads without a key: what the admin API shows.
    let head = Head::decode(sealed.clone()).unwrap();
    assert_eq!(head.token, f.token);
    assert_eq!(head.sealed_with.as_deref(), Some("old"));
    let answered = head.finished.unwrap();
    assert_eq!((answered.status, answered.completed_ms), (201, 20));
    assert!(answered.body_stored);
    // A fresh nonce per record: the same answer seals differently.
    let again = Record::Finished(f).seal(&ring, ID).unwrap();
    assert_ne!(again, sealed);
}

#[test]
fn a_sealed_record_opens_only_under_its_id_with_its_key_and_unaltered() {
    let f = Record::Finished(answer());
    let sealed = f.seal(&keys(OLD), ID).unwrap();
    // Rotation: a new first key seals, the old one still opens.
    let rotated = keys(&format!("{NEW}\n{OLD}\n"));
    assert_eq!(Record::open(sealed.clone(), Some(&rotated), ID).unwrap(), f);
    let resealed = f.seal(&rotated, ID).unwrap();
    assert_eq!(Head::decode(resealed).unwrap().sealed_with.unwrap(), "new");
    let other_id = ID.replace('6', "7");
    let cases = [
        Record::open(sealed.clone(), Some(&keys(NEW)), ID),
        Record::open(sealed.clone(), Some(&rotated), &other_id),
        Record::open(sealed.clone(), None, ID),
        Record::decode(sealed.clone()),
    ];
    let errors: Vec<String> = cases
        .into_iter()
        .map(|r| r.unwrap_err().to_string())
        .collect();
    assert!(
        errors[0].contains("\"old\", which the key file does not hold"),
        "{errors:?}"
    );
    assert!(errors[1].contains("does not open"), "{errors:?}");
    assert!(errors[2].contains("no encryption_key_file"), "{errors:?}");
    assert!(errors[3].contains("no encryption_key_file"), "{errors:?}");
    // Any altered byte, in the head (the status) or in the sealed answer.
    for at in [59 + 8, 59 + 8 + 8, sealed.len() - 1, sealed.len() - 20] {
        let mut altered = sealed.to_vec();
        altered[at] ^= 0x01;
        let r = Record::open(Bytes::from(altered), Some(&rotated), ID);
        assert!(r.is_err(), "byte {at} altered");
    }
    for cut in 0..sealed.len() {
        assert!(Record::open(sealed.slice(..cut), Some(&rotated), ID).is_err());
    }
}

#[test]
fn a_sealed_record_being_written_in_pieces_reads_as_a_reservation() {
    let f = answer();
    let sealed = Record::Finished(f.clone()).seal(&keys(OLD), ID).unwrap();
    let mut first_piece = sealed[..100].to_vec();
    first_piece[1] = STATE_PROCESSING;
    let read = Record::open(Bytes::from(first_piece), Some(&keys(OLD)), ID).unwrap();
    assert!(matches!(read, Record::Processing(p) if p.token == f.token));
    // A reservation is never sealed.
    let p = Record::Processing(Processing {
        token: Token::new(),
        fingerprint: [1; 32],
        created_ms: 1,
        route: "r".into(),
        trace: None,
        afterlife: None,
    });
    assert_eq!(p.seal(&keys(OLD), ID).unwrap(), p.encode());
}

// The execution's trace context (versions 4 and 5, docs/telemetry.md#what-is-stored).

const TRACE: TraceRef = TraceRef {
    trace_id: [0xab; 16],
    span_id: [0xcd; 8],
};

/// A version-1 finished record and a version-1 reservation, byte for byte as
/// the builds before versions 4 and 5 wrote them (not made by this encoder).
fn written_by_an_older_build() -> (Vec<u8>, Vec<u8>) {
    let mut head = vec![1u8, b'F'];
    head.extend_from_slice(&[9; 16]);
    head.extend_from_slice(&[8; 32]);
    head.extend_from_slice(&77u64.to_be_bytes());
    head.extend_from_slice(&2u16.to_be_bytes());
    head.extend_from_slice(b"rt");
    let mut processing = head.clone();
    processing[1] = b'P';
    let mut finished = head;
    finished.extend_from_slice(&88u64.to_be_bytes());
    finished.extend_from_slice(&201u16.to_be_bytes());
    finished.push(1);
    finished.extend_from_slice(&1u16.to_be_bytes());
    finished.extend_from_slice(&1u16.to_be_bytes());
    finished.extend_from_slice(b"x");
    finished.extend_from_slice(&1u32.to_be_bytes());
    finished.extend_from_slice(b"y");
    finished.extend_from_slice(&2u32.to_be_bytes());
    finished.extend_from_slice(b"ok");
    (processing, finished)
}

#[test]
fn records_written_before_trace_contexts_still_decode_and_replay() {
    let (processing, finished) = written_by_an_older_build();
    let Record::Processing(p) = Record::decode(Bytes::from(processing)).unwrap() else {
        panic!("a reservation")
    };
    assert_eq!((p.created_ms, p.route.as_str(), p.trace), (77, "rt", None));
    let Record::Finished(f) = Record::decode(Bytes::from(finished.clone())).unwrap() else {
        panic!("a finished record")
    };
    assert_eq!((f.status, f.trace, &f.body[..]), (201, None, &b"ok"[..]));
    assert_eq!(f.headers[0].1, "y");
    // Written again without a trace context, it is the same bytes.
    assert_eq!(Record::Finished(f).encode()[..], finished[..]);
    let head = Head::decode(Bytes::from(finished)).unwrap();
    assert_eq!(head.trace, None);
}

#[test]
fn a_trace_context_makes_a_version_4_record_that_roundtrips() {
    let p = Processing {
        token: Token::new(),
        fingerprint: [7; 32],
        created_ms: 123,
        route: "payments".into(),
        trace: Some(TRACE),
        afterlife: None,
    };
    let enc = Record::Processing(p.clone()).encode();
    assert_eq!((enc[0], enc[1]), (4, STATE_PROCESSING));
    assert_eq!(
        &enc[TOKEN_RANGE], &p.token.0,
        "the token stays where the scripts read it"
    );
    assert_eq!(Record::decode(enc.clone()).unwrap(), Record::Processing(p));
    assert_eq!(Head::decode(enc).unwrap().trace, Some(TRACE));
    for trailers in [false, true] {
        let mut f = answer();
        if !trailers {
            f.trailers.clear();
        }
        f.trace = Some(TRACE);
        let enc = Record::Finished(f.clone()).encode();
        assert_eq!(enc[0], 4);
        assert_eq!(
            Record::decode(enc.clone()).unwrap(),
            Record::Finished(f.clone())
        );
        assert_eq!(Head::decode(enc.clone()).unwrap().trace, Some(TRACE));
        for cut in 0..enc.len() {
            assert!(Record::decode(enc.slice(..cut)).is_err(), "cut at {cut}");
        }
        // Without a trace context: the versions written before, unchanged.
        f.trace = None;
        let enc = Record::Finished(f.clone()).encode();
        assert_eq!(enc[0], if trailers { 2 } else { 1 });
        assert_eq!(Record::decode(enc).unwrap(), Record::Finished(f));
    }
}

#[test]
fn a_sealed_record_keeps_its_trace_context_in_the_clear() {
    let ring = keys(OLD);
    let mut f = answer();
    f.trace = Some(TRACE);
    let sealed = Record::Finished(f.clone()).seal(&ring, ID).unwrap();
    assert_eq!(sealed[0], VERSION_TRACED_SEALED);
    assert!(is_sealed(&sealed));
    assert!(contains(&sealed, &TRACE.trace_id));
    assert!(contains(&sealed, &TRACE.span_id));
    assert!(!contains(&sealed, b"secret"), "the answer is still sealed");
    // Readable without the key: the head says it.
    let head = Head::decode(sealed.clone()).unwrap();
    assert_eq!(head.trace, Some(TRACE));
    assert_eq!(head.sealed_with.as_deref(), Some("old"));
    assert!(matches!(
        Record::decode(sealed.clone()),
        Err(DecodeError::NoKeyFile)
    ));
    assert_eq!(
        Record::open(sealed.clone(), Some(&ring), ID).unwrap(),
        Record::Finished(f.clone())
    );
    // The ids are authenticated with the head: altered, the record does not open.
    let at = sealed
        .windows(16)
        .position(|w| w == TRACE.trace_id)
        .unwrap();
    let mut altered = sealed.to_vec();
    altered[at] ^= 1;
    assert!(Record::open(Bytes::from(altered), Some(&ring), ID).is_err());
    // Without a trace context, sealing writes version 3 as before.
    f.trace = None;
    let sealed = Record::Finished(f).seal(&ring, ID).unwrap();
    assert_eq!(sealed[0], VERSION_SEALED);
    assert!(is_sealed(&sealed));
}

// Review (s32 telemetry): a v5 record from an untrusted store — every id
// byte authenticated, and no downgrade to v3/v4 opens as the same answer.
#[test]
fn v5_ids_altered_or_downgraded_do_not_open() {
    let ring = keys(OLD);
    let mut f = answer();
    f.trace = Some(TRACE);
    let sealed = Record::Finished(f.clone()).seal(&ring, ID).unwrap();
    let at = sealed
        .windows(16)
        .position(|w| w == TRACE.trace_id)
        .unwrap();
    // Every byte of the trace id and of the span id.
    for i in at..at + TRACE_BLOCK {
        let mut altered = sealed.to_vec();
        altered[i] ^= 0x80;
        assert!(
            Record::open(Bytes::from(altered), Some(&ring), ID).is_err(),
            "byte {i} of the trace block altered"
        );
    }
    // Downgrade to v3: the trace block cut out, the version byte changed.
    let mut v3 = sealed.to_vec();
    v3.drain(at..at + TRACE_BLOCK);
    v3[0] = VERSION_SEALED;
    assert!(Record::open(Bytes::from(v3), Some(&ring), ID).is_err());
    // Version byte alone changed to 3 (the block then read as the finished fields).
    let mut v3b = sealed.to_vec();
    v3b[0] = VERSION_SEALED;
    assert!(Record::open(Bytes::from(v3b), Some(&ring), ID).is_err());
    // To v4: not sealed (a store with require_sealed refuses it as finished in the clear).
    let mut v4 = sealed.to_vec();
    v4[0] = 4;
    assert!(!is_sealed(&v4));
    // The ids moved to another record id: does not open.
    let other = ID.replace('6', "7");
    assert!(Record::open(sealed.clone(), Some(&ring), &other).is_err());
    // A v3 record upgraded to v5 with planted ids: does not open.
    let mut plain = f.clone();
    plain.trace = None;
    let v3 = Record::Finished(plain).seal(&ring, ID).unwrap();
    let route_end = FIXED_HEAD + 2 + f.route.len();
    let mut up = v3[..route_end].to_vec();
    up[0] = VERSION_TRACED_SEALED;
    up.extend_from_slice(&[0x11; TRACE_BLOCK]);
    up.extend_from_slice(&v3[route_end..]);
    assert!(
        Head::decode(Bytes::from(up.clone())).is_ok(),
        "the head alone reads"
    );
    assert!(Record::open(Bytes::from(up), Some(&ring), ID).is_err());
}

/// Review: a v4/v5 head cut anywhere in the trace block is an error, never a panic.
#[test]
fn v4_v5_heads_truncated_in_the_trace_block_are_errors() {
    let p = Record::Processing(Processing {
        token: Token::new(),
        fingerprint: [1; 32],
        created_ms: 1,
        route: "r".into(),
        trace: Some(TRACE),
        afterlife: None,
    })
    .encode();
    for cut in 0..p.len() {
        assert!(Head::decode(p.slice(..cut)).is_err(), "cut at {cut}");
        assert!(Record::decode(p.slice(..cut)).is_err(), "cut at {cut}");
    }
    let mut f = answer();
    f.trace = Some(TRACE);
    let sealed = Record::Finished(f).seal(&keys(OLD), ID).unwrap();
    for cut in 0..sealed.len() {
        let _ = Head::decode(sealed.slice(..cut));
        assert!(Record::open(sealed.slice(..cut), Some(&keys(OLD)), ID).is_err());
    }
}

#[test]
fn a_reason_phrase_roundtrips_clear_sealed_and_traced_and_older_readers_stop_before_it() {
    let mut f = answer();
    f.trailers.clear();
    f.reason = Some(Bytes::from_static(b"Charged Once"));
    let clear = Record::Finished(f.clone()).encode();
    assert_eq!(clear[0], VERSION_2, "a reason needs the version-2 layout");
    assert_eq!(
        Record::decode(clear.clone()).unwrap(),
        Record::Finished(f.clone())
    );
    // What a build without reason phrases reads: the answer up to its trailers.
    let mut rest = clear.clone();
    read_head(&mut rest).unwrap();
    let headers = get_fields(&mut rest).unwrap();
    assert_eq!(headers, f.headers);
    let len = rest.get_u32() as usize;
    assert_eq!(&rest.split_to(len)[..], &f.body[..]);
    assert!(get_fields(&mut rest).unwrap().is_empty());
    assert_eq!(&rest[..], b"\x0cCharged Once", "the reason comes last");

    let k = keys(OLD);
    let sealed = Record::Finished(f.clone()).seal(&k, ID).unwrap();
    assert!(
        !contains(&sealed, b"Charged Once"),
        "sealed with the answer"
    );
    assert_eq!(
        Record::open(sealed, Some(&k), ID).unwrap(),
        Record::Finished(f.clone())
    );
    f.trace = Some(TraceRef {
        trace_id: [1; 16],
        span_id: [2; 8],
    });
    let traced = Record::Finished(f.clone()).encode();
    assert_eq!(Record::decode(traced).unwrap(), Record::Finished(f.clone()));
    // A reason cut short is a malformed record, not a shorter reason.
    let cut = clear.slice(..clear.len() - 1);
    assert!(Record::decode(cut).is_err());
}

// The afterlife trailer of a reservation (docs/reference/behaviour.md#dead-owner).

fn reservation(trace: Option<TraceRef>, afterlife: Option<Afterlife>) -> Processing {
    Processing {
        token: Token::new(),
        fingerprint: [3; 32],
        created_ms: 1_764_900_000_000,
        route: "payments".into(),
        trace,
        afterlife,
    }
}

#[test]
fn a_reservation_keeps_its_afterlife_and_what_becomes_of_a_dead_owner() {
    for then in [DeadOwner::StoreUnknown, DeadOwner::ReExecute] {
        for trace in [None, Some(TRACE)] {
            let afterlife = Afterlife {
                after: Duration::from_secs(86_400),
                then,
            };
            let with = reservation(trace, Some(afterlife));
            let encoded = Record::Processing(with.clone()).encode();
            assert_eq!(
                Record::decode(encoded.clone()).unwrap(),
                Record::Processing(with.clone())
            );
            // What an older build reads: the same head, then bytes it ignores
            // (it reads every reservation's head alone).
            let without = Processing {
                afterlife: None,
                ..with
            };
            let old = Record::Processing(without.clone()).encode();
            assert_eq!(
                &encoded[..old.len()],
                &old[..],
                "the trailer follows the head"
            );
            assert_eq!(encoded.len(), old.len() + AFTERLIFE_LEN);
            let head = Head::decode(encoded).unwrap();
            assert_eq!((head.token, head.finished), (without.token, None));
            assert_eq!(
                head.afterlife,
                Some(afterlife),
                "the head says it too (admin API)"
            );
        }
    }
}

#[test]
fn a_reservation_without_a_trailer_has_no_afterlife() {
    // Written by a build before the trailer, or with none to write.
    let p = reservation(None, None);
    let read = Record::decode(Record::Processing(p).encode()).unwrap();
    assert!(matches!(read, Record::Processing(p) if p.afterlife.is_none()));
    // A trailer cut short, or of an unknown tag, is no afterlife: such a
    // reservation is never taken for a dead owner's.
    let a = Afterlife {
        after: Duration::from_secs(60),
        then: DeadOwner::StoreUnknown,
    };
    let whole = Record::Processing(reservation(None, Some(a))).encode();
    for cut in whole.len() - AFTERLIFE_LEN..whole.len() {
        let read = Record::decode(whole.slice(..cut)).unwrap();
        assert!(
            matches!(read, Record::Processing(p) if p.afterlife.is_none()),
            "{cut}"
        );
    }
    let mut other = whole.to_vec();
    let at = whole.len() - AFTERLIFE_LEN;
    other[at] = b'X';
    let read = Record::decode(Bytes::from(other)).unwrap();
    assert!(matches!(read, Record::Processing(p) if p.afterlife.is_none()));
}

#[test]
fn a_record_being_written_in_pieces_is_never_read_as_an_afterlife() {
    // What follows the head of a piece in progress is its `completed` stamp:
    // a u64 of Unix ms, whose first byte is 0 (never a tag).
    for f in [
        answer(),
        Finished {
            trace: Some(TRACE),
            ..answer()
        },
        Finished {
            completed_ms: now_ms(),
            trailers: vec![],
            ..answer()
        },
    ] {
        let mut first_piece = Record::Finished(f.clone()).encode().to_vec();
        first_piece[1] = STATE_PROCESSING;
        for len in [first_piece.len(), 100] {
            let piece = Bytes::from(first_piece[..len.min(first_piece.len())].to_vec());
            let read = Record::decode(piece).unwrap();
            assert!(
                matches!(&read, Record::Processing(p) if p.token == f.token && p.afterlife.is_none()),
                "{read:?}"
            );
        }
    }
    assert_eq!(now_ms().to_be_bytes()[0], 0);
}

#[test]
fn a_lease_has_ended_once_no_more_than_the_afterlife_is_left() {
    let a = Afterlife {
        after: Duration::from_secs(10),
        then: DeadOwner::StoreUnknown,
    };
    assert!(!a.lease_ended(Duration::from_millis(10_001)));
    assert!(a.lease_ended(Duration::from_secs(10)));
    assert!(a.lease_ended(Duration::ZERO));
    let none = Afterlife {
        after: Duration::ZERO,
        ..a
    };
    assert!(
        !none.lease_ended(Duration::ZERO),
        "no afterlife, never judged"
    );
}
