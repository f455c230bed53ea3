//! gRPC's vocabulary (docs/reference/behaviour.md#grpc-errors): a unary call is an HTTP/2 POST
//! whose answer ends
//! in trailers (`grpc-status`, `grpc-message`); what tells a gRPC request,
//! an answer's status, the codes and header names. An upstream answer whose
//! `grpc-status` is in `release_grpc_statuses` frees the key, like a release
//! status. (How a problem of the proxy's own becomes a gRPC error is the
//! problem's: `Problem::grpc_code`, `Problem::render_grpc`.)

use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderName};

pub(crate) const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub(crate) const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// When a client's retry policy should try again (gRPC's A6 retry design):
/// the `Retry-After` of the HTTP answer, in milliseconds.
pub(crate) const GRPC_RETRY_PUSHBACK_MS: HeaderName =
    HeaderName::from_static("grpc-retry-pushback-ms");

/// gRPC status codes the mapping uses (grpc/doc/statuscodes.md).
pub mod code {
    pub(crate) const UNKNOWN: u32 = 2;
    pub(crate) const INVALID_ARGUMENT: u32 = 3;
    pub(crate) const DEADLINE_EXCEEDED: u32 = 4;
    pub(crate) const RESOURCE_EXHAUSTED: u32 = 8;
    pub(crate) const FAILED_PRECONDITION: u32 = 9;
    pub(crate) const ABORTED: u32 = 10;
    pub(crate) const INTERNAL: u32 = 13;
    pub const UNAVAILABLE: u32 = 14;
}

/// Is this message gRPC (`content-type: application/grpc`, `+proto`, `+json`...)?
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers.get(CONTENT_TYPE).is_some_and(|v| {
        let v = v.as_bytes();
        v.len() >= 16
            && v[..16].eq_ignore_ascii_case(b"application/grpc")
            && matches!(v.get(16), None | Some(b'+' | b';'))
    })
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
pub fn percent_encode(s: &str) -> String {
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
    use http::HeaderValue;

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
