//! RFC 9457 problem details: every answer the proxy makes itself, from one kind → status mapping.
//!
//! A [`Problem`] knows its status, its `type`, its metric [`Outcome`] and how
//! to render itself; the admin API renders its errors with the same [`document`].

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};

use crate::body::Body;
use crate::grpc::{self, GRPC_MESSAGE, GRPC_RETRY_PUSHBACK_MS, GRPC_STATUS};
use crate::key::KeyError;
use crate::metrics::Outcome;
use crate::policy::KeySource;
use crate::upstream::UpstreamError;

/// Every answer the proxy makes on its own.
#[derive(Debug, Clone)]
pub(crate) enum Problem {
    /// No key where the route's `key_from` looks.
    MissingKey {
        from: KeySource,
    },
    InvalidKey {
        from: KeySource,
        why: KeyError,
    },
    BodyTooLarge {
        limit: u64,
    },
    /// The first request with this key is still in flight.
    Conflict {
        retry_after: Duration,
    },
    /// The key was used with a different request.
    Mismatch,
    /// The operation ran, but its answer was too large to keep.
    NotStored,
    StoreUnavailable,
    /// Connect refused, DNS: the request never reached the upstream; the key was released.
    UpstreamUnreachable,
    /// Reset or cut off after the request was sent: the outcome is unknown.
    /// `released`: the key was freed (so a retry re-executes) rather than the problem stored.
    UpstreamReset {
        released: bool,
    },
    UpstreamTimeout {
        after: Duration,
        released: bool,
    },
    /// An earlier request with this key was in flight on a proxy that
    /// vanished (its lease ran out): it may have run. Stored and replayed,
    /// never executed again (docs/reference/behaviour.md#dead-owner).
    OutcomeUnknown,
    /// The request body could not be read (the client went away or sent bad chunking).
    BodyUnreadable,
    /// The request body did not arrive in time.
    BodyTimeout {
        after: Duration,
    },
    /// The record under the key cannot be decoded (garbage, another writer, a
    /// newer format): the operation may have run, so the request is not forwarded.
    RecordUnreadable,
    /// The memory budget (`max_buffered`) has no room for this request now.
    ProxyBusy,
    /// A control character in the path, on a method a route names: which
    /// handler the upstream would run is not to be judged (docs/routes-and-keys.md#what-is-refused).
    PathNotAccepted,
}

impl Problem {
    /// The one mapping of an upstream failure to an answer. `released`: the key
    /// was freed rather than the problem stored (always so on pass-through).
    pub(crate) fn from_upstream(e: &UpstreamError, released: bool) -> Problem {
        match e {
            UpstreamError::Connect(_) => Problem::UpstreamUnreachable,
            UpstreamError::Exchange(_) => Problem::UpstreamReset { released },
            // Never stored: the key is released whatever `unknown_outcome` says.
            UpstreamError::Invalid(_) => Problem::UpstreamReset { released: true },
            UpstreamError::Timeout(after) => Problem::UpstreamTimeout {
                after: *after,
                released,
            },
        }
    }

    /// The `outcome` label this answer is counted under.
    pub fn outcome(&self) -> Outcome {
        match self {
            Problem::MissingKey { .. } => Outcome::MissingKey,
            Problem::InvalidKey { .. } => Outcome::InvalidKey,
            Problem::BodyTooLarge { .. } => Outcome::TooLarge,
            Problem::Conflict { .. } => Outcome::Conflict,
            Problem::Mismatch => Outcome::Mismatch,
            Problem::NotStored => Outcome::NotStored,
            Problem::StoreUnavailable => Outcome::StoreError,
            Problem::UpstreamUnreachable
            | Problem::UpstreamReset { .. }
            | Problem::UpstreamTimeout { .. }
            | Problem::OutcomeUnknown => Outcome::UpstreamError,
            Problem::BodyUnreadable | Problem::BodyTimeout { .. } | Problem::PathNotAccepted => {
                Outcome::BadRequest
            }
            Problem::RecordUnreadable => Outcome::Unreadable,
            Problem::ProxyBusy => Outcome::Busy,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Problem::MissingKey { .. }
            | Problem::InvalidKey { .. }
            | Problem::BodyUnreadable
            | Problem::PathNotAccepted => StatusCode::BAD_REQUEST,
            Problem::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Problem::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Problem::Conflict { .. } => StatusCode::CONFLICT,
            Problem::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Problem::NotStored => StatusCode::GONE,
            Problem::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Problem::UpstreamUnreachable
            | Problem::UpstreamReset { .. }
            | Problem::OutcomeUnknown => StatusCode::BAD_GATEWAY,
            Problem::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            Problem::RecordUnreadable => StatusCode::INTERNAL_SERVER_ERROR,
            Problem::ProxyBusy => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The `type` member: a short stable name that tells apart problems sharing a status.
    pub fn kind(&self) -> &'static str {
        match self {
            Problem::MissingKey { .. } => "idempotency-key-missing",
            Problem::InvalidKey { .. } => "idempotency-key-invalid",
            Problem::BodyTooLarge { .. } => "request-too-large",
            Problem::Conflict { .. } => "request-in-progress",
            Problem::Mismatch => "idempotency-key-reused",
            Problem::NotStored => "response-not-stored",
            Problem::StoreUnavailable => "store-unavailable",
            Problem::UpstreamUnreachable => "upstream-unreachable",
            Problem::UpstreamReset { .. } => "upstream-reset",
            Problem::BodyUnreadable => "request-body-unreadable",
            Problem::BodyTimeout { .. } => "request-body-timeout",
            Problem::UpstreamTimeout { .. } => "upstream-timeout",
            Problem::OutcomeUnknown => "outcome-unknown",
            Problem::RecordUnreadable => "record-unreadable",
            Problem::ProxyBusy => "proxy-busy",
            Problem::PathNotAccepted => "path-not-accepted",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Problem::MissingKey { .. } => "Idempotency key is missing",
            Problem::InvalidKey { .. } => "Idempotency key is invalid",
            Problem::BodyTooLarge { .. } => "Request body is too large",
            Problem::Conflict { .. } => {
                "A request with this idempotency key is still being processed"
            }
            Problem::Mismatch => "Idempotency key was already used for a different request",
            Problem::NotStored => "The operation was performed but its response cannot be replayed",
            Problem::StoreUnavailable => "Idempotency store is unavailable",
            Problem::UpstreamUnreachable => "Upstream is unreachable",
            Problem::UpstreamReset { .. } => {
                "Upstream connection failed after the request was sent"
            }
            Problem::BodyUnreadable => "Request body could not be read",
            Problem::BodyTimeout { .. } => "Request body did not arrive in time",
            Problem::UpstreamTimeout { .. } => "Upstream did not answer in time",
            Problem::OutcomeUnknown => "The outcome of an earlier request with this key is unknown",
            Problem::RecordUnreadable => "The record of this idempotency key cannot be read",
            Problem::ProxyBusy => "The proxy is busy",
            Problem::PathNotAccepted => "The request path is not accepted",
        }
    }

    pub fn detail(&self) -> String {
        match self {
            Problem::MissingKey {
                from: KeySource::Header(name),
            } => format!(
                "This endpoint requires an {} header with a unique value per operation \
                 (draft-ietf-httpapi-idempotency-key-header, section-2.1).",
                header_display(name)
            ),
            Problem::MissingKey {
                from: KeySource::Json(pointer),
            } => format!(
                "This endpoint takes its idempotency key from the JSON request body: a string \
                 or an integer at {pointer}. The body is not JSON, or has no such value there."
            ),
            Problem::InvalidKey {
                from: KeySource::Header(name),
                why,
            } => format!(
                "The {} header is not usable: {why} (draft-ietf-httpapi-idempotency-key-header, section-2.1).",
                header_display(name)
            ),
            Problem::InvalidKey {
                from: KeySource::Json(pointer),
                why,
            } => format!("The idempotency key at {pointer} in the JSON request body is not usable: {why}."),
            Problem::BodyTooLarge { limit } => {
                format!("The request body exceeds the limit of {limit} bytes for this endpoint.")
            }
            Problem::Conflict { retry_after } => format!(
                "The first request with this key has not finished; retry after {} s.",
                retry_secs(*retry_after)
            ),
            Problem::Mismatch => "This idempotency key was used with a different method, path, query or body; \
                                  use a new key for a new operation."
                .to_string(),
            Problem::NotStored => "The original request was executed, but its response was too large to keep. \
                                   It will not be executed again."
                .to_string(),
            Problem::StoreUnavailable => {
                "The request was not forwarded because its idempotency key could not be recorded; retry later."
                    .to_string()
            }
            Problem::UpstreamUnreachable => {
                "The upstream service could not be reached; the request was not executed and may be retried."
                    .to_string()
            }
            Problem::UpstreamReset { released } => format!(
                "The upstream connection failed after the request was sent; whether it was executed is unknown. {}",
                if *released { "The key was released." } else { "Retries with this key get this answer." }
            ),
            Problem::UpstreamTimeout { after, released } => format!(
                "The upstream did not answer within {} ms; whether the request was executed is unknown. {}",
                after.as_millis(),
                if *released { "The key was released." } else { "Retries with this key get this answer." }
            ),
            Problem::OutcomeUnknown => "An earlier request with this idempotency key was being processed \
                                        when the proxy handling it stopped, so it may or may not have been \
                                        executed. It will not be executed again under this key: check the \
                                        state of the resource before repeating the operation with a new key."
                .to_string(),
            Problem::BodyUnreadable => "The request body ended early or was malformed.".to_string(),
            Problem::BodyTimeout { after } => format!(
                "The request body did not arrive within {} ms; nothing was executed.",
                after.as_millis()
            ),
            Problem::RecordUnreadable => "A record exists for this key, but this proxy cannot read it, \
                                          so the request was not forwarded (it may have been executed already). \
                                          The record id is in the proxy's log."
                .to_string(),
            Problem::ProxyBusy => "The proxy holds as many bytes as it may right now; nothing was executed. \
                                   Retry later."
                .to_string(),
            Problem::PathNotAccepted => "The request path holds a control character (raw or percent-encoded), \
                                         or the request-target a NUL; nothing was executed. \
                                         Send the path without it."
                .to_string(),
        }
    }

    /// Can a client usefully send the same request again?
    pub(crate) fn retryable(&self) -> bool {
        match self {
            Problem::Conflict { .. }
            | Problem::StoreUnavailable
            | Problem::UpstreamUnreachable
            | Problem::ProxyBusy => true,
            Problem::UpstreamReset { released } | Problem::UpstreamTimeout { released, .. } => {
                *released
            }
            _ => false,
        }
    }

    /// When to try again, if the answer says (`Retry-After` in whole
    /// seconds; `grpc-retry-pushback-ms` on a gRPC request).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Problem::Conflict { retry_after } => Some(*retry_after),
            Problem::StoreUnavailable | Problem::ProxyBusy => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    /// Status, headers and body of the answer; `request_id` becomes `instance`.
    /// (Also what `unknown_outcome = "store"` keeps in the record.)
    pub(crate) fn render(&self, request_id: &uuid::Uuid) -> (StatusCode, HeaderMap, Bytes) {
        let status = self.status();
        let mut body = document(status, self.kind(), self.title(), &self.detail());
        body["instance"] = format!("urn:uuid:{request_id}").into();
        body["retryable"] = self.retryable().into();
        if let Problem::MissingKey { from } | Problem::InvalidKey { from, .. } = self {
            body["idempotency_key"] = match from {
                KeySource::Header(name) => serde_json::json!({ "header": header_display(name) }),
                KeySource::Json(pointer) => {
                    serde_json::json!({ "json_pointer": pointer.to_string() })
                }
            };
        }
        let (headers, bytes) = rendered(&body, self.retry_after().map(retry_secs));
        (status, headers, bytes)
    }

    /// The gRPC status of a problem the proxy answers itself.
    pub(crate) fn grpc_code(&self) -> u32 {
        use crate::grpc::code::*;
        match self {
            Problem::MissingKey { .. }
            | Problem::InvalidKey { .. }
            | Problem::Mismatch
            | Problem::BodyUnreadable
            | Problem::PathNotAccepted => INVALID_ARGUMENT,
            Problem::BodyTooLarge { .. } => RESOURCE_EXHAUSTED,
            Problem::Conflict { .. } => ABORTED,
            Problem::NotStored => FAILED_PRECONDITION,
            Problem::StoreUnavailable | Problem::ProxyBusy | Problem::UpstreamUnreachable => {
                UNAVAILABLE
            }
            Problem::UpstreamReset { released: true } => UNAVAILABLE,
            Problem::UpstreamReset { released: false } | Problem::OutcomeUnknown => UNKNOWN,
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
    pub(crate) fn render_grpc(&self, request_id: &uuid::Uuid) -> (StatusCode, HeaderMap) {
        let mut headers = HeaderMap::with_capacity(4);
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(GRPC_STATUS, HeaderValue::from(self.grpc_code()));
        let message = format!("{}: {} (request {request_id})", self.kind(), self.detail());
        if let Ok(v) = HeaderValue::from_str(&grpc::percent_encode(&message)) {
            headers.insert(GRPC_MESSAGE, v);
        }
        if let Some(after) = self.retry_after() {
            let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
            headers.insert(GRPC_RETRY_PUSHBACK_MS, HeaderValue::from(ms));
        }
        (StatusCode::OK, headers)
    }

    /// The answer as a response.
    pub fn response(&self, request_id: &uuid::Uuid) -> Response<Body> {
        assemble(self.render(request_id))
    }

    /// The answer to a request: a problem document, or on a gRPC request
    /// the same problem as a Trailers-Only gRPC error (docs/reference/behaviour.md#grpc-errors).
    pub(crate) fn response_to(&self, request_id: &uuid::Uuid, grpc: bool) -> Response<Body> {
        if !grpc {
            return self.response(request_id);
        }
        let (status, headers) = self.render_grpc(request_id);
        assemble((status, headers, Bytes::new()))
    }
}

/// A header name as problems spell it: the standard one in its usual capitals.
fn header_display(name: &http::HeaderName) -> String {
    match name.as_str() {
        "idempotency-key" => "Idempotency-Key".to_string(),
        lower => lower.to_string(),
    }
}

/// A rendered problem as a response (also what a stored problem is answered with).
pub(crate) fn assemble((status, headers, body): (StatusCode, HeaderMap, Bytes)) -> Response<Body> {
    let mut resp = Response::new(Body::full(body));
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp
}

/// The RFC 9457 members every problem has.
pub fn document(status: StatusCode, kind: &str, title: &str, detail: &str) -> serde_json::Value {
    serde_json::json!({
        "type": kind,
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    })
}

/// A problem document as a response (the admin API's errors).
pub fn response(status: StatusCode, document: &serde_json::Value) -> Response<Body> {
    let (headers, body) = rendered(document, None);
    assemble((status, headers, body))
}

fn rendered(document: &serde_json::Value, retry_after: Option<u64>) -> (HeaderMap, Bytes) {
    let mut headers = HeaderMap::with_capacity(3);
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Some(secs) = retry_after {
        headers.insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    let bytes = serde_json::to_vec(document).unwrap_or_default();
    (headers, Bytes::from(bytes))
}

/// Whole seconds, rounded up, at least 1.
pub(crate) fn retry_secs(d: Duration) -> u64 {
    let ms = d.as_millis() as u64;
    ms.div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_renders_trailers_only_with_its_code() {
        let id = uuid::Uuid::nil();
        let (status, headers) = Problem::Mismatch.render_grpc(&id);
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
        assert_eq!(conflict.grpc_code(), grpc::code::ABORTED);
        assert_eq!(conflict.render_grpc(&id).1[&GRPC_RETRY_PUSHBACK_MS], "1300");
        assert_eq!(
            Problem::StoreUnavailable.grpc_code(),
            grpc::code::UNAVAILABLE
        );
        let (_, busy) = Problem::ProxyBusy.render_grpc(&id);
        assert_eq!(busy[&GRPC_RETRY_PUSHBACK_MS], "1000");
    }

    #[test]
    fn a_vanished_owners_outcome_is_a_502_that_says_it_will_not_run_again() {
        let id = uuid::Uuid::new_v4();
        let p = Problem::OutcomeUnknown;
        let (status, headers, body) = p.render(&id);
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        assert_eq!(headers[CONTENT_TYPE], "application/problem+json");
        assert!(!headers.contains_key(RETRY_AFTER));
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["type"], "outcome-unknown");
        assert_eq!(v["retryable"], false);
        let detail = v["detail"].as_str().unwrap();
        for says in ["may or may not", "will not be executed again", "new key"] {
            assert!(detail.contains(says), "{detail}");
        }
        assert_eq!(p.outcome(), Outcome::UpstreamError);
        assert_eq!(p.grpc_code(), grpc::code::UNKNOWN);
    }

    #[test]
    fn retry_after_is_whole_seconds_rounded_up_at_least_one() {
        assert_eq!(retry_secs(Duration::from_millis(0)), 1);
        assert_eq!(retry_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_secs(Duration::from_millis(1000)), 1);
        assert_eq!(retry_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_secs(Duration::from_secs(30)), 30);
    }

    #[test]
    fn rendered_problem_has_the_rfc9457_members() {
        let id = uuid::Uuid::new_v4();
        let (status, headers, body) = Problem::Conflict {
            retry_after: Duration::from_millis(2500),
        }
        .render(&id);
        assert_eq!(status, 409);
        assert_eq!(headers[CONTENT_TYPE], "application/problem+json");
        assert_eq!(headers[CACHE_CONTROL], "no-store");
        assert_eq!(headers[RETRY_AFTER], "3");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["status"], 409);
        assert_eq!(v["type"], "request-in-progress");
        assert_eq!(v["retryable"], true);
        assert_eq!(v["instance"], format!("urn:uuid:{id}"));
        assert!(v["title"].is_string() && v["detail"].is_string());
    }
}
