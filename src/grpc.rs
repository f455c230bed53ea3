//! gRPC on protected routes (§9): a unary call is an HTTP/2 POST whose answer
//! ends in trailers (`grpc-status`, `grpc-message`). The proxy's own refusals
//! on a gRPC request are gRPC errors a client library understands, with the
//! mapping below, sent Trailers-Only so that a client's retry policy may
//! retry them; an upstream answer whose `grpc-status` is in
//! `release_grpc_statuses` frees the key, like a release status.

use http::header::{HeaderValue, CONTENT_TYPE};
use http::{HeaderMap, HeaderName, StatusCode};

use crate::problem::Problem;

pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// When a client's retry policy should try again (gRPC's A6 retry design):
/// the `Retry-After` of the HTTP answer, in milliseconds.
pub const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// gRPC status codes the mapping uses (grpc/doc/statuscodes.md).
pub mod code {
    pub const UNKNOWN: u32 = 2;
    pub const INVALID_ARGUMENT: u32 = 3;
    pub const DEADLINE_EXCEEDED: u32 = 4;
    pub const RESOURCE_EXHAUSTED: u32 = 8;
    pub const FAILED_PRECONDITION: u32 = 9;
    pub const ABORTED: u32 = 10;
    pub const INTERNAL: u32 = 13;
    pub const UNAVAILABLE: u32 = 14;
}

/// Is this message gRPC (`content-type: application/grpc`, `+proto`, `+json`...)?
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers.get(CONTENT_TYPE).is_some_and(|v| {
        let v = v.as_bytes();
        v.len() >= 16
            && v[..16].eq_ignore_ascii_case(b"application/grpc")
            && matches!(v.get(16), None | Some(b'+' | b';'))
    })
}

/// The gRPC status of a problem the proxy answers itself.
pub fn code_of(p: &Problem) -> u32 {
    use code::*;
    match p {
        Problem::MissingKey { .. }
        | Problem::InvalidKey { .. }
        | Problem::Mismatch
        | Problem::BodyUnreadable => INVALID_ARGUMENT,
        Problem::BodyTooLarge { .. } => RESOURCE_EXHAUSTED,
        Problem::Conflict { .. } => ABORTED,
        Problem::NotStored => FAILED_PRECONDITION,
        Problem::StoreUnavailable | Problem::ProxyBusy | Problem::UpstreamUnreachable => {
            UNAVAILABLE
        }
        Problem::UpstreamReset { released: true } => UNAVAILABLE,
        Problem::UpstreamReset { released: false } => UNKNOWN,
        Problem::UpstreamTimeout { .. } | Problem::BodyTimeout { .. } => DEADLINE_EXCEEDED,
        Problem::RecordUnreadable => INTERNAL,
    }
}

/// A problem as a gRPC error, Trailers-Only: HTTP 200 and no message; the
/// headers carry `content-type: application/grpc`, `grpc-status`,
/// `grpc-message` (the problem type and detail) and, where the HTTP answer has
/// a `Retry-After`, `grpc-retry-pushback-ms`. With no body, the answer goes
/// out as one HEADERS frame with END_STREAM: gRPC clients take a call that
/// received response headers as committed, and their retry policy retries
/// only a call answered so. (Also what `unknown_outcome = "store"` records,
/// so that its replay has the same form.)
pub fn render(p: &Problem, request_id: &uuid::Uuid) -> (StatusCode, HeaderMap) {
    let mut headers = HeaderMap::with_capacity(4);
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(GRPC_STATUS, HeaderValue::from(code_of(p)));
    let message = format!("{}: {} (request {request_id})", p.kind(), p.detail());
    if let Ok(v) = HeaderValue::from_str(&percent_encode(&message)) {
        headers.insert(GRPC_MESSAGE, v);
    }
    if let Some(after) = p.retry_after() {
        let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        headers.insert(GRPC_RETRY_PUSHBACK_MS, HeaderValue::from(ms));
    }
    (StatusCode::OK, headers)
}

/// The `grpc-status` of an answer: from its trailers, or from its headers
/// (a "Trailers-Only" answer carries it there).
pub fn status_of(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<u32> {
    trailers
        .and_then(|t| t.get(&GRPC_STATUS))
        .or_else(|| headers.get(&GRPC_STATUS))
        .and_then(|v| v.to_str().ok()?.trim().parse().ok())
}

/// `grpc-message` is percent-encoded UTF-8: bytes outside printable ASCII, and `%`.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_content_types() {
        let h = |v: &'static str| {
            let mut m = HeaderMap::new();
            m.insert(CONTENT_TYPE, HeaderValue::from_static(v));
            m
        };
        assert!(is_grpc(&h("application/grpc")));
        assert!(is_grpc(&h("application/grpc+proto")));
        assert!(is_grpc(&h("Application/GRPC;charset=x")));
        assert!(!is_grpc(&h("application/grpc-web")));
        assert!(!is_grpc(&h("application/json")));
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn a_problem_renders_trailers_only_with_its_code() {
        let id = uuid::Uuid::nil();
        let (status, headers) = render(&Problem::Mismatch, &id);
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers[CONTENT_TYPE], "application/grpc");
        assert_eq!(headers[&GRPC_STATUS], "3");
        assert!(headers[&GRPC_MESSAGE]
            .to_str()
            .unwrap()
            .starts_with("idempotency-key-reused: "));
        assert!(!headers.contains_key(&GRPC_RETRY_PUSHBACK_MS));
        let conflict = Problem::Conflict {
            retry_after: std::time::Duration::from_millis(1300),
        };
        assert_eq!(code_of(&conflict), code::ABORTED);
        assert_eq!(render(&conflict, &id).1[&GRPC_RETRY_PUSHBACK_MS], "1300");
        assert_eq!(code_of(&Problem::StoreUnavailable), code::UNAVAILABLE);
        let (_, busy) = render(&Problem::ProxyBusy, &id);
        assert_eq!(busy[&GRPC_RETRY_PUSHBACK_MS], "1000");
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("a b%c\n€"), "a b%25c%0A%E2%82%AC");
    }

    #[test]
    fn status_from_trailers_or_headers() {
        let mut t = HeaderMap::new();
        t.insert(GRPC_STATUS, HeaderValue::from_static("14"));
        assert_eq!(status_of(&HeaderMap::new(), Some(&t)), Some(14));
        assert_eq!(status_of(&t, None), Some(14));
        assert_eq!(status_of(&HeaderMap::new(), None), None);
    }
}
