//! A span as the request path records it: a small struct of ids, times and
//! typed attribute values, converted to OTLP on the export thread
//! ([`super::otlp`]). Nothing is formatted on the request path: an address
//! stays an `IpAddr`, an id stays bytes, a status code an integer.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::context::{SpanId, TraceId};

/// OTLP's span kinds (the numbers are the protocol's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SpanKind {
    Internal = 1,
    Server = 2,
    Client = 3,
}

/// An attribute's value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Static(&'static str),
    Text(Box<str>),
    SpanQueue(Arc<str>),
    Int(i64),
    /// Written as the address's text.
    Ip(IpAddr),
    /// Written as 32 lowercase hex digits.
    TraceId(TraceId),
}

/// A span link: to the client's span (`client_context = "link"`) or to the
/// execution's SERVER span (a replay, a 409, a 422).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Link {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub trace_state: Option<Arc<str>>,
    /// The linked span's sampled flag.
    pub sampled: bool,
    /// The linked span is another process's (the client's).
    pub remote: bool,
}

/// A span's name: a fixed one, or an HTTP span's `{method}` (`HTTP` for an
/// unknown method) with the route's pattern after it when there is one.
#[derive(Clone, Debug, PartialEq)]
pub enum Name {
    Static(&'static str),
    Http {
        method: &'static str,
        route: Option<Arc<str>>,
    },
}

/// A recorded (sampled) span.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct SpanRecord {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    /// The parent span, and whether it is another process's.
    pub parent: Option<(SpanId, bool)>,
    pub trace_state: Option<Arc<str>>,
    pub kind: SpanKind,
    pub name: Name,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attributes: Vec<(&'static str, Value)>,
    pub links: Vec<Link>,
    /// Status Error (else Unset): the conventions' rule for the span's kind,
    /// applied where it ends.
    pub error: bool,
}

impl SpanRecord {
    pub fn new(kind: SpanKind, name: Name, trace_id: TraceId, span_id: SpanId) -> SpanRecord {
        SpanRecord {
            trace_id,
            span_id,
            parent: None,
            trace_state: None,
            kind,
            name,
            start_ns: now_ns(),
            end_ns: 0,
            attributes: Vec::new(),
            links: Vec::new(),
            error: false,
        }
    }

    pub fn set(&mut self, key: &'static str, value: Value) {
        self.attributes.push((key, value));
    }
}

/// Nanoseconds since the Unix epoch, now.
pub(crate) fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}
