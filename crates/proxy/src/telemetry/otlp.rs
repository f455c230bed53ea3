//! OTLP's `ExportTraceServiceRequest`, encoded by hand (protobuf's wire
//! format) from [`SpanRecord`]s into a buffer the export thread reuses: the
//! resource and the instrumentation scope are encoded once, at start, and
//! each batch writes only its spans. The field numbers are those of
//! opentelemetry-proto's `trace/v1/trace.proto`, `common/v1/common.proto`,
//! `resource/v1/resource.proto` and `collector/trace/v1/trace_service.proto`;
//! the tests decode what this writes with opentelemetry-proto itself.

use std::fmt::Write as _;

use super::context::write_hex;
use super::span::{Link, Name, SpanRecord, Value};

/// Protobuf wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

/// `SpanFlags`: the low byte is the W3C trace flags; then whether the
/// parent's (or a link's) remoteness is known, and whether it is remote.
const HAS_IS_REMOTE: u32 = 0x100;
const IS_REMOTE: u32 = 0x200;
/// W3C's sampled flag: every span exported is sampled.
const SAMPLED: u32 = 0x01;
/// `Status.code` ERROR.
const STATUS_ERROR: u64 = 2;

/// Encodes batches of spans for one resource and scope.
pub(crate) struct Encoder {
    /// `ResourceSpans.resource` (field and length included).
    resource: Vec<u8>,
    /// `ScopeSpans.scope` (field and length included).
    scope: Vec<u8>,
    /// Room to write an address's text into.
    scratch: String,
}

impl Encoder {
    /// `resource`: the resource's attributes, `service.name` among them.
    pub fn new(resource: &[(String, String)], scope: &str, version: &str) -> Encoder {
        let mut r = Vec::new();
        message(&mut r, 1, |buf| {
            for (k, v) in resource {
                message(buf, 1, |kv| {
                    string(kv, 1, k);
                    message(kv, 2, |any| string(any, 1, v));
                });
            }
        });
        let mut s = Vec::new();
        message(&mut s, 1, |buf| {
            string(buf, 1, scope);
            string(buf, 2, version);
        });
        Encoder {
            resource: r,
            scope: s,
            scratch: String::new(),
        }
    }

    /// `spans` as one `ExportTraceServiceRequest`, appended to `out`.
    pub fn encode(&mut self, spans: &[SpanRecord], out: &mut Vec<u8>) {
        let Encoder {
            resource,
            scope,
            scratch,
        } = self;
        message(out, 1, |rs| {
            rs.extend_from_slice(resource);
            message(rs, 2, |ss| {
                ss.extend_from_slice(scope);
                for span in spans {
                    message(ss, 2, |buf| encode_span(buf, span, scratch));
                }
            });
        });
    }
}

fn encode_span(buf: &mut Vec<u8>, span: &SpanRecord, scratch: &mut String) {
    bytes(buf, 1, &span.trace_id);
    bytes(buf, 2, &span.span_id);
    if let Some(state) = &span.trace_state {
        string(buf, 3, state);
    }
    let mut flags = SAMPLED;
    if let Some((parent, remote)) = &span.parent {
        bytes(buf, 4, parent);
        flags |= HAS_IS_REMOTE | if *remote { IS_REMOTE } else { 0 };
    } else {
        flags |= HAS_IS_REMOTE;
    }
    match &span.name {
        Name::Static(name) => string(buf, 5, name),
        Name::Http { method, route } => {
            let method = if *method == super::OTHER {
                "HTTP"
            } else {
                method
            };
            let route = route.as_deref().unwrap_or_default();
            let space = usize::from(!route.is_empty());
            key(buf, 5, LEN);
            varint(buf, (method.len() + space + route.len()) as u64);
            buf.extend_from_slice(method.as_bytes());
            if space == 1 {
                buf.push(b' ');
                buf.extend_from_slice(route.as_bytes());
            }
        }
    }
    key(buf, 6, VARINT);
    varint(buf, span.kind as u64);
    fixed64(buf, 7, span.start_ns);
    fixed64(buf, 8, span.end_ns.max(span.start_ns));
    for (k, v) in &span.attributes {
        message(buf, 9, |kv| {
            string(kv, 1, k);
            message(kv, 2, |any| value(any, v, scratch));
        });
    }
    for link in &span.links {
        message(buf, 13, |l| encode_link(l, link));
    }
    if span.error {
        message(buf, 15, |status| {
            key(status, 3, VARINT);
            varint(status, STATUS_ERROR);
        });
    }
    key(buf, 16, FIXED32);
    buf.extend_from_slice(&flags.to_le_bytes());
}

fn encode_link(buf: &mut Vec<u8>, link: &Link) {
    bytes(buf, 1, &link.trace_id);
    bytes(buf, 2, &link.span_id);
    if let Some(state) = &link.trace_state {
        string(buf, 3, state);
    }
    let sampled = if link.sampled { SAMPLED } else { 0 };
    let flags = sampled | HAS_IS_REMOTE | if link.remote { IS_REMOTE } else { 0 };
    key(buf, 6, FIXED32);
    buf.extend_from_slice(&flags.to_le_bytes());
}

/// An `AnyValue`'s one field.
fn value(buf: &mut Vec<u8>, v: &Value, scratch: &mut String) {
    match v {
        Value::Static(s) => string(buf, 1, s),
        Value::Text(s) => string(buf, 1, s),
        Value::SpanQueue(s) => string(buf, 1, s),
        Value::Int(i) => {
            key(buf, 3, VARINT);
            varint(buf, *i as u64);
        }
        Value::Ip(ip) => {
            scratch.clear();
            let _ = write!(scratch, "{ip}");
            string(buf, 1, scratch);
        }
        Value::TraceId(id) => {
            let mut hex = [0u8; 32];
            write_hex(&mut hex, id);
            key(buf, 1, LEN);
            varint(buf, 32);
            buf.extend_from_slice(&hex);
        }
    }
}

fn varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

fn key(buf: &mut Vec<u8>, field: u32, wire: u8) {
    varint(buf, (u64::from(field) << 3) | u64::from(wire));
}

fn bytes(buf: &mut Vec<u8>, field: u32, b: &[u8]) {
    key(buf, field, LEN);
    varint(buf, b.len() as u64);
    buf.extend_from_slice(b);
}

fn string(buf: &mut Vec<u8>, field: u32, s: &str) {
    bytes(buf, field, s.as_bytes());
}

fn fixed64(buf: &mut Vec<u8>, field: u32, v: u64) {
    key(buf, field, FIXED64);
    buf.extend_from_slice(&v.to_le_bytes());
}

/// A length-delimited field whose contents `f` writes: one byte is kept for
/// the length, and the contents moved up when it needs more.
fn message(buf: &mut Vec<u8>, field: u32, f: impl FnOnce(&mut Vec<u8>)) {
    key(buf, field, LEN);
    let at = buf.len();
    buf.push(0);
    f(buf);
    let len = buf.len() - at - 1;
    if len < 0x80 {
        buf[at] = len as u8;
        return;
    }
    let mut prefix = Vec::with_capacity(10);
    varint(&mut prefix, len as u64);
    buf.splice(at..=at, prefix);
}

/// Spans a collector said it rejected (`ExportTraceServiceResponse.partial_success`).
#[derive(Debug, PartialEq, Eq)]
pub struct Rejected {
    pub spans: u64,
    /// Its `error_message`, cut to 256 bytes (the collector chose it).
    pub message: String,
}

/// The partial success in a collector's answer, when it rejected spans.
pub(crate) fn rejected(answer: &[u8]) -> Option<Rejected> {
    let partial = fields(answer).find_map(|(f, v)| match (f, v) {
        (1, Field::Bytes(b)) => Some(b),
        _ => None,
    })?;
    let mut rejected = Rejected {
        spans: 0,
        message: String::new(),
    };
    for (field, value) in fields(partial) {
        match (field, value) {
            // An int64: above i64::MAX it is negative, which is no count.
            (1, Field::Varint(n)) => rejected.spans = if n > i64::MAX as u64 { 0 } else { n },
            (2, Field::Bytes(text)) => {
                let text = String::from_utf8_lossy(&text[..text.len().min(256)]);
                rejected.message = text.chars().filter(|c| !c.is_control()).collect();
            }
            _ => {}
        }
    }
    (rejected.spans > 0).then_some(rejected)
}

/// A field's value, as far as [`rejected`] reads them.
enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

/// A message's fields, until the end or the first malformed byte.
fn fields(mut buf: &[u8]) -> impl Iterator<Item = (u64, Field<'_>)> {
    std::iter::from_fn(move || {
        let (key, rest) = read_varint(buf)?;
        let (field, wire) = (key >> 3, (key & 7) as u8);
        let (value, rest) = skip(wire, rest)?;
        buf = rest;
        let value = match wire {
            VARINT => Field::Varint(read_varint(value)?.0),
            LEN => Field::Bytes(value),
            _ => Field::Fixed,
        };
        Some((field, value))
    })
}

/// A field's value of wire type `wire` at the start of `buf`, and what follows.
fn skip(wire: u8, buf: &[u8]) -> Option<(&[u8], &[u8])> {
    let n = match wire {
        VARINT => buf.iter().position(|b| b & 0x80 == 0)? + 1,
        FIXED64 => 8,
        FIXED32 => 4,
        LEN => {
            let (len, rest) = read_varint(buf)?;
            let len = usize::try_from(len).ok()?;
            let at = buf.len() - rest.len();
            return (rest.len() >= len).then(|| (&buf[at..at + len], &rest[len..]));
        }
        _ => return None,
    };
    (buf.len() >= n).then(|| buf.split_at(n))
}

fn read_varint(buf: &[u8]) -> Option<(u64, &[u8])> {
    let mut v = 0u64;
    for (i, b) in buf.iter().enumerate().take(10) {
        // The tenth byte holds bit 63 only: more would not fit in 64 bits.
        if i == 9 && *b > 1 {
            return None;
        }
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((v, &buf[i + 1..]));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::span::SpanKind;

    /// The wire format's corner: a length that needs more than one byte
    /// moves what follows, and nothing is lost.
    #[test]
    fn long_contents_get_a_longer_length() {
        let mut buf = Vec::new();
        message(&mut buf, 1, |b| b.extend_from_slice(&[7u8; 300]));
        assert_eq!(&buf[..3], &[0x0a, 0xac, 0x02]);
        assert_eq!(buf.len(), 303);
        assert!(buf[3..].iter().all(|&b| b == 7));
    }

    /// A partial success is read; an empty answer, garbage or a success
    /// without rejections is none.
    #[test]
    fn rejected_spans_are_read_from_the_answer() {
        // partial_success { rejected_spans: 300, error_message: "quota" }
        let mut inner = Vec::new();
        key(&mut inner, 1, VARINT);
        varint(&mut inner, 300);
        string(&mut inner, 2, "quota\nexceeded");
        let mut answer = Vec::new();
        bytes(&mut answer, 1, &inner);
        assert_eq!(
            rejected(&answer),
            Some(Rejected {
                spans: 300,
                message: "quotaexceeded".into()
            })
        );
        assert_eq!(rejected(&[]), None);
        assert_eq!(rejected(&[0xff, 0xff, 0xff]), None);
        assert_eq!(rejected(&[0x0a, 0x00]), None);
        assert_eq!(rejected(&[0x0a, 0x05, 0x08]), None, "cut short");
        // -1 as an int64 (ten bytes), and a varint of more than 64 bits.
        let mut minus_one = vec![0x0a, 0x0b, 0x08];
        minus_one.extend([0xff; 9]);
        minus_one.push(0x01);
        assert_eq!(rejected(&minus_one), None, "a negative count");
        let mut too_long = vec![0x0a, 0x0b, 0x08];
        too_long.extend([0x80; 9]);
        too_long.push(0x7f);
        assert_eq!(rejected(&too_long), None, "more than 64 bits");
    }

    #[test]
    fn an_unknown_methods_span_is_named_http() {
        let mut span = SpanRecord::new(
            SpanKind::Server,
            Name::Http {
                method: crate::telemetry::OTHER,
                route: Some("/v1/pay".into()),
            },
            [1; 16],
            [2; 8],
        );
        span.end_ns = span.start_ns;
        let mut enc = Encoder::new(&[("service.name".into(), "s".into())], "idemproxy", "0");
        let mut out = Vec::new();
        enc.encode(&[span], &mut out);
        let name = b"HTTP /v1/pay";
        assert!(out.windows(name.len()).any(|w| w == name));
    }
}
