//! The record's byte layout: reading and writing a head (with its afterlife
//! trailer and key id), an answer section, header fields and length-prefixed strings.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderName, HeaderValue};

use super::{
    need, Afterlife, Answered, DeadOwner, DecodeError, Finished, Head, HeaderFields, Token,
    TraceRef, AFTERLIFE_RE_EXECUTE, AFTERLIFE_UNKNOWN, FIXED_HEAD, STATE_FINISHED,
    STATE_PROCESSING, TRACE_BLOCK, VERSION_1, VERSION_TRACED, VERSION_TRACED_SEALED,
};
use crate::seal;
use std::time::Duration;

/// Reads the head, up to the flags of a finished record; returns the version with it.
pub(super) fn read_head(b: &mut Bytes) -> Result<(u8, Head), DecodeError> {
    need(b, FIXED_HEAD)?;
    let version = b.get_u8();
    if !(VERSION_1..=VERSION_TRACED_SEALED).contains(&version) {
        return Err(DecodeError::Malformed("unknown format version"));
    }
    let state = b.get_u8();
    let mut token = [0u8; 16];
    b.copy_to_slice(&mut token);
    let mut fingerprint = [0u8; 32];
    b.copy_to_slice(&mut fingerprint);
    let created_ms = b.get_u64();
    let route = get_str16(b)?;
    let route = String::from_utf8(route.to_vec())
        .map_err(|_| DecodeError::Malformed("route is not UTF-8"))?;
    let trace = if version >= VERSION_TRACED {
        need(b, TRACE_BLOCK)?;
        let mut t = TraceRef {
            trace_id: [0; 16],
            span_id: [0; 8],
        };
        b.copy_to_slice(&mut t.trace_id);
        b.copy_to_slice(&mut t.span_id);
        Some(t)
    } else {
        None
    };
    let finished = match state {
        // A record being written piece by piece reads as a reservation: what follows is not read.
        STATE_PROCESSING => None,
        STATE_FINISHED => {
            need(b, 11)?;
            Some(Answered {
                completed_ms: b.get_u64(),
                status: b.get_u16(),
                body_stored: b.get_u8() & 1 == 1,
            })
        }
        _ => return Err(DecodeError::Malformed("unknown state")),
    };
    // Read, not consumed: a reservation's trailer is not part of its head.
    let afterlife = finished.is_none().then(|| read_afterlife(b)).flatten();
    let head = Head {
        token: Token(token),
        fingerprint,
        created_ms,
        route,
        trace,
        afterlife,
        finished,
        sealed_with: None,
    };
    Ok((version, head))
}

/// The afterlife trailer of a reservation, from what follows its head: `None`
/// when there is none (an older build's reservation) or when what follows
/// is something else (a record being written piece by piece). Bytes after
/// the trailer are left for later trailers.
pub(super) fn read_afterlife(rest: &[u8]) -> Option<Afterlife> {
    let (&tag, ms) = rest.split_first()?;
    let then = match tag {
        AFTERLIFE_UNKNOWN => DeadOwner::StoreUnknown,
        AFTERLIFE_RE_EXECUTE => DeadOwner::ReExecute,
        _ => return None,
    };
    let ms: [u8; 8] = ms.get(..8)?.try_into().ok()?;
    Some(Afterlife {
        after: Duration::from_millis(u64::from_be_bytes(ms)),
        then,
    })
}

pub(super) fn put_afterlife(b: &mut BytesMut, a: Afterlife) {
    b.put_u8(match a.then {
        DeadOwner::StoreUnknown => AFTERLIFE_UNKNOWN,
        DeadOwner::ReExecute => AFTERLIFE_RE_EXECUTE,
    });
    b.put_u64(u64::try_from(a.after.as_millis()).unwrap_or(u64::MAX));
}

pub(super) fn read_key_id(b: &mut Bytes) -> Result<String, DecodeError> {
    need(b, 1)?;
    let len = b.get_u8() as usize;
    need(b, len)?;
    let id = b.split_to(len);
    if !seal::valid_key_id(&id) {
        return Err(DecodeError::Malformed("bad key id"));
    }
    Ok(String::from_utf8_lossy(&id).into_owned())
}

/// The associated data of a sealed answer: the record id, then the head as written.
pub(super) fn associated_data(record_id: &str, head: &[u8]) -> Vec<u8> {
    let mut aad = Vec::with_capacity(record_id.len() + head.len());
    aad.extend_from_slice(record_id.as_bytes());
    aad.extend_from_slice(head);
    aad
}

pub(super) fn fields_len(h: &[(HeaderName, HeaderValue)]) -> usize {
    2 + h
        .iter()
        .map(|(n, v)| 6 + n.as_str().len() + v.len())
        .sum::<usize>()
}

pub(super) fn head_len(f: &Finished) -> usize {
    FIXED_HEAD + 2 + f.route.len() + 11 + if f.trace.is_some() { TRACE_BLOCK } else { 0 }
}

pub(super) fn answer_len(f: &Finished, trailers: bool) -> usize {
    let t = if trailers { fields_len(&f.trailers) } else { 0 };
    let reason = f.reason.as_ref().map_or(0, |r| 1 + r.len());
    fields_len(&f.headers) + 4 + f.body.len() + t + reason
}

/// What a head holds before its route name and answer.
pub(super) struct Common<'a> {
    pub(super) token: Token,
    pub(super) fingerprint: &'a [u8; 32],
    pub(super) created_ms: u64,
    pub(super) route: &'a str,
    /// Written only by versions 4 and 5.
    pub(super) trace: Option<TraceRef>,
}

/// The head: a reservation's whole record, or a finished one's clear part.
pub(super) fn put_head(b: &mut BytesMut, version: u8, c: Common<'_>, finished: Option<Answered>) {
    b.put_u8(version);
    b.put_u8(if finished.is_some() {
        STATE_FINISHED
    } else {
        STATE_PROCESSING
    });
    b.put_slice(&c.token.0);
    b.put_slice(c.fingerprint);
    b.put_u64(c.created_ms);
    put_str16(b, c.route.as_bytes());
    if let Some(t) = c.trace.filter(|_| version >= VERSION_TRACED) {
        b.put_slice(&t.trace_id);
        b.put_slice(&t.span_id);
    }
    if let Some(a) = finished {
        b.put_u64(a.completed_ms);
        b.put_u16(a.status);
        b.put_u8(u8::from(a.body_stored));
    }
}

pub(super) fn put_finished_head(b: &mut BytesMut, version: u8, f: &Finished) {
    let common = Common {
        token: f.token,
        fingerprint: &f.fingerprint,
        created_ms: f.created_ms,
        route: &f.route,
        trace: f.trace,
    };
    let answered = Answered {
        completed_ms: f.completed_ms,
        status: f.status,
        body_stored: f.body_stored,
    };
    put_head(b, version, common, Some(answered));
}

/// Headers, body, and (from version 2 on) trailers, then a reason phrase
/// when there is one (u8 + bytes: a build that does not know it stops
/// reading before it, and replays the status's usual phrase).
pub(super) fn put_answer(b: &mut BytesMut, f: &Finished, trailers: bool) {
    put_fields(b, &f.headers);
    b.put_u32(f.body.len() as u32);
    b.put_slice(&f.body);
    if trailers {
        put_fields(b, &f.trailers);
        if let Some(reason) = f
            .reason
            .as_ref()
            .filter(|r| r.len() <= usize::from(u8::MAX))
        {
            put_str8(b, reason);
        }
    }
}

/// An answer section: headers, body, trailers, reason phrase.
pub(super) type Answer = (HeaderFields, Bytes, HeaderFields, Option<Bytes>);

pub(super) fn read_answer(mut b: Bytes, trailers: bool) -> Result<Answer, DecodeError> {
    let headers = get_fields(&mut b)?;
    need(&b, 4)?;
    let len = b.get_u32() as usize;
    need(&b, len)?;
    let body = b.split_to(len);
    let (trailers, reason) = if trailers {
        let fields = get_fields(&mut b)?;
        let reason = if b.has_remaining() {
            let len = usize::from(b.get_u8());
            need(&b, len)?;
            Some(b.split_to(len))
        } else {
            None
        };
        (fields, reason)
    } else {
        (Vec::new(), None)
    };
    Ok((headers, body, trailers, reason))
}

/// A count, then each field as u16 + name, u32 + value (at most 65,535 fields).
pub(super) fn put_fields(b: &mut BytesMut, fields: &[(HeaderName, HeaderValue)]) {
    b.put_u16(fields.len().min(u16::MAX as usize) as u16);
    for (n, v) in fields.iter().take(u16::MAX as usize) {
        put_str16(b, n.as_str().as_bytes());
        b.put_u32(v.len() as u32);
        b.put_slice(v.as_bytes());
    }
}

pub(super) fn get_fields(b: &mut Bytes) -> Result<Vec<(HeaderName, HeaderValue)>, DecodeError> {
    if b.remaining() < 2 {
        return Err(DecodeError::Malformed("truncated"));
    }
    let count = b.get_u16() as usize;
    // Each field takes at least 6 bytes: a short or hostile value cannot
    // make us reserve room for 65,535 of them.
    let mut fields = Vec::with_capacity(count.min(b.remaining() / 6));
    for _ in 0..count {
        let name = get_str16(b)?;
        let name =
            HeaderName::from_bytes(&name).map_err(|_| DecodeError::Malformed("bad header name"))?;
        if b.remaining() < 4 {
            return Err(DecodeError::Malformed("truncated"));
        }
        let len = b.get_u32() as usize;
        if b.remaining() < len {
            return Err(DecodeError::Malformed("truncated"));
        }
        let value = HeaderValue::from_maybe_shared(b.split_to(len))
            .map_err(|_| DecodeError::Malformed("bad header value"))?;
        fields.push((name, value));
    }
    Ok(fields)
}

pub(super) fn put_str16(b: &mut BytesMut, s: &[u8]) {
    let s = &s[..s.len().min(u16::MAX as usize)];
    b.put_u16(s.len() as u16);
    b.put_slice(s);
}

/// A key id: u8 + bytes (ids are at most 64 bytes).
pub(super) fn put_str8(b: &mut BytesMut, s: &[u8]) {
    let s = &s[..s.len().min(u8::MAX as usize)];
    b.put_u8(s.len() as u8);
    b.put_slice(s);
}

pub(super) fn get_str16(b: &mut Bytes) -> Result<Bytes, DecodeError> {
    if b.remaining() < 2 {
        return Err(DecodeError::Malformed("truncated"));
    }
    let len = b.get_u16() as usize;
    if b.remaining() < len {
        return Err(DecodeError::Malformed("truncated"));
    }
    Ok(b.split_to(len))
}
