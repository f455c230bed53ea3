//! What is stored under a key: a `processing` reservation or a finished answer, in a small binary format.
//!
//! Layout (all integers big-endian). The first 18 bytes are the same for both
//! states, so the store scripts can check the owner token without decoding:
//!
//! ```text
//! 0      version (1)
//! 1      state: 'P' processing | 'F' finished
//! 2..18  owner token (16 bytes)
//! 18..50 request fingerprint (SHA-256)
//! 50..58 created, unix ms
//! u16 + route name
//! 'F' only: u64 completed unix ms, u16 status, u8 flags (bit 0: body stored),
//!           u16 header count, per header: u16 + name, u32 + value; u32 + body
//! version 2, 'F' only: then u16 trailer count, per trailer as per header
//! ```
//!
//! Version 2 (trailers, §9) is written only for an answer that has trailers;
//! every other record is still written as version 1, which both versions
//! read: a rolling upgrade, or a rollback by one step, replays the other's
//! records (only an answer with trailers is unreadable to a version-1 proxy,
//! and that is a 500 `record-unreadable`, never a second execution).

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderName, HeaderValue};

/// The newest format this build writes (and reads).
pub const FORMAT_VERSION: u8 = 2;
/// The format without trailers: still written when there are none.
const VERSION_1: u8 = 1;
pub const STATE_PROCESSING: u8 = b'P';
pub const STATE_FINISHED: u8 = b'F';
/// Where the owner token sits; the Lua scripts read `string.sub(v, 3, 18)`.
pub const TOKEN_RANGE: std::ops::Range<usize> = 2..18;

/// Identifies one reservation; a late finisher with an old token changes nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Token(pub [u8; 16]);

impl Token {
    /// The owner token of an encoded record (at the same place in both states).
    pub fn of_record(encoded: &[u8]) -> Option<Token> {
        encoded.get(TOKEN_RANGE)?.try_into().ok().map(Token)
    }

    pub fn new() -> Self {
        Token(*uuid::Uuid::new_v4().as_bytes())
    }
}

impl Default for Token {
    fn default() -> Self {
        Self::new()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Processing {
    pub token: Token,
    pub fingerprint: [u8; 32],
    pub created_ms: u64,
    pub route: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    pub token: Token,
    pub fingerprint: [u8; 32],
    pub created_ms: u64,
    pub route: String,
    pub completed_ms: u64,
    pub status: u16,
    /// False when the answer was larger than `max_response_body`: retries get a 410.
    pub body_stored: bool,
    /// End-to-end headers only (no hop-by-hop, `Set-Cookie`, `Date`, `Content-Length`).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
    /// The answer's trailers (gRPC's `grpc-status` lives here), in order.
    pub trailers: Vec<(HeaderName, HeaderValue)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    Processing(Processing),
    Finished(Finished),
}

#[derive(Debug, thiserror::Error)]
#[error("stored record cannot be decoded: {0}")]
pub struct DecodeError(&'static str);

impl Record {
    pub fn token(&self) -> Token {
        match self {
            Record::Processing(p) => p.token,
            Record::Finished(f) => f.token,
        }
    }

    pub fn fingerprint(&self) -> &[u8; 32] {
        match self {
            Record::Processing(p) => &p.fingerprint,
            Record::Finished(f) => &f.fingerprint,
        }
    }

    pub fn route(&self) -> &str {
        match self {
            Record::Processing(p) => &p.route,
            Record::Finished(f) => &f.route,
        }
    }

    pub fn created_ms(&self) -> u64 {
        match self {
            Record::Processing(p) => p.created_ms,
            Record::Finished(f) => f.created_ms,
        }
    }

    pub fn encode(&self) -> Bytes {
        let (state, token, fp, created, route) = match self {
            Record::Processing(p) => (
                STATE_PROCESSING,
                p.token,
                &p.fingerprint,
                p.created_ms,
                &p.route,
            ),
            Record::Finished(f) => (
                STATE_FINISHED,
                f.token,
                &f.fingerprint,
                f.created_ms,
                &f.route,
            ),
        };
        let fields = |h: &[(HeaderName, HeaderValue)]| {
            h.iter()
                .map(|(n, v)| 6 + n.as_str().len() + v.len())
                .sum::<usize>()
        };
        let (version, extra) = match self {
            Record::Processing(_) => (VERSION_1, 0),
            Record::Finished(f) if f.trailers.is_empty() => {
                (VERSION_1, 32 + f.body.len() + fields(&f.headers))
            }
            Record::Finished(f) => (
                FORMAT_VERSION,
                34 + f.body.len() + fields(&f.headers) + fields(&f.trailers),
            ),
        };
        let mut b = BytesMut::with_capacity(60 + route.len() + extra);
        b.put_u8(version);
        b.put_u8(state);
        b.put_slice(&token.0);
        b.put_slice(fp);
        b.put_u64(created);
        put_str16(&mut b, route.as_bytes());
        if let Record::Finished(f) = self {
            b.put_u64(f.completed_ms);
            b.put_u16(f.status);
            b.put_u8(u8::from(f.body_stored));
            put_fields(&mut b, &f.headers);
            b.put_u32(f.body.len() as u32);
            b.put_slice(&f.body);
            if version == FORMAT_VERSION {
                put_fields(&mut b, &f.trailers);
            }
        }
        b.freeze()
    }

    pub fn decode(mut b: Bytes) -> Result<Record, DecodeError> {
        let need = |b: &Bytes, n: usize| {
            if b.remaining() < n {
                Err(DecodeError("truncated"))
            } else {
                Ok(())
            }
        };
        need(&b, 58)?;
        let version = b.get_u8();
        if version != VERSION_1 && version != FORMAT_VERSION {
            return Err(DecodeError("unknown format version"));
        }
        let state = b.get_u8();
        let mut token = [0u8; 16];
        b.copy_to_slice(&mut token);
        let mut fingerprint = [0u8; 32];
        b.copy_to_slice(&mut fingerprint);
        let created_ms = b.get_u64();
        let route = get_str16(&mut b)?;
        let route =
            String::from_utf8(route.to_vec()).map_err(|_| DecodeError("route is not UTF-8"))?;
        match state {
            STATE_PROCESSING => Ok(Record::Processing(Processing {
                token: Token(token),
                fingerprint,
                created_ms,
                route,
            })),
            STATE_FINISHED => {
                need(&b, 13)?;
                let completed_ms = b.get_u64();
                let status = b.get_u16();
                let body_stored = b.get_u8() & 1 == 1;
                let headers = get_fields(&mut b)?;
                need(&b, 4)?;
                let len = b.get_u32() as usize;
                need(&b, len)?;
                let body = b.split_to(len);
                let trailers = match version {
                    VERSION_1 => Vec::new(),
                    _ => get_fields(&mut b)?,
                };
                Ok(Record::Finished(Finished {
                    token: Token(token),
                    fingerprint,
                    created_ms,
                    route,
                    completed_ms,
                    status,
                    body_stored,
                    headers,
                    body,
                    trailers,
                }))
            }
            _ => Err(DecodeError("unknown state")),
        }
    }
}

/// A count, then each field as u16 + name, u32 + value (at most 65,535 fields).
fn put_fields(b: &mut BytesMut, fields: &[(HeaderName, HeaderValue)]) {
    b.put_u16(fields.len().min(u16::MAX as usize) as u16);
    for (n, v) in fields.iter().take(u16::MAX as usize) {
        put_str16(b, n.as_str().as_bytes());
        b.put_u32(v.len() as u32);
        b.put_slice(v.as_bytes());
    }
}

fn get_fields(b: &mut Bytes) -> Result<Vec<(HeaderName, HeaderValue)>, DecodeError> {
    if b.remaining() < 2 {
        return Err(DecodeError("truncated"));
    }
    let count = b.get_u16() as usize;
    // Each field takes at least 6 bytes: a short or hostile value cannot
    // make us reserve room for 65,535 of them.
    let mut fields = Vec::with_capacity(count.min(b.remaining() / 6));
    for _ in 0..count {
        let name = get_str16(b)?;
        let name = HeaderName::from_bytes(&name).map_err(|_| DecodeError("bad header name"))?;
        if b.remaining() < 4 {
            return Err(DecodeError("truncated"));
        }
        let len = b.get_u32() as usize;
        if b.remaining() < len {
            return Err(DecodeError("truncated"));
        }
        let value = HeaderValue::from_maybe_shared(b.split_to(len))
            .map_err(|_| DecodeError("bad header value"))?;
        fields.push((name, value));
    }
    Ok(fields)
}

fn put_str16(b: &mut BytesMut, s: &[u8]) {
    let s = &s[..s.len().min(u16::MAX as usize)];
    b.put_u16(s.len() as u16);
    b.put_slice(s);
}

fn get_str16(b: &mut Bytes) -> Result<Bytes, DecodeError> {
    if b.remaining() < 2 {
        return Err(DecodeError("truncated"));
    }
    let len = b.get_u16() as usize;
    if b.remaining() < len {
        return Err(DecodeError("truncated"));
    }
    Ok(b.split_to(len))
}

/// Milliseconds since the Unix epoch, for `created` and `completed` stamps.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_both_states() {
        let p = Record::Processing(Processing {
            token: Token::new(),
            fingerprint: [7; 32],
            created_ms: 123,
            route: "payments".into(),
        });
        assert_eq!(Record::decode(p.encode()).unwrap(), p);
        let f = Record::Finished(Finished {
            token: Token::new(),
            fingerprint: [9; 32],
            created_ms: 1,
            route: "r".into(),
            completed_ms: 2,
            status: 201,
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
            completed_ms: 2,
            status: 200,
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
        assert_eq!(enc[0], FORMAT_VERSION);
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
        })
        .encode();
        for cut in 0..p.len() {
            assert!(Record::decode(p.slice(..cut)).is_err());
        }
    }
}
