//! The route policy: what a protected route does. Configuration builds it; the request path reads it.
//!
//! This vocabulary belongs to neither side: `config` turns the file into
//! policies, `routes`, `key` and `proxy` act on them, and none of those needs
//! the others to name a mode. The enums derive `Deserialize` (their TOML
//! spelling is their lower-case name) because serde is not configuration.

use std::fmt;
use std::time::Duration;

use http::HeaderName;
use serde::Deserialize;

/// What a protected route does; every field has a value (from the route or `[defaults]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    pub header: HeaderName,
    /// Where the key is read: resolved at load time (`key_from = "header"`
    /// is `KeySource::Header` of the route's `header`).
    pub key_from: KeySource,
    pub key: KeyMode,
    pub ttl: Duration,
    pub lease: Duration,
    pub max_key_length: usize,
    pub max_request_body: u64,
    pub max_response_body: u64,
    /// Sorted by name, so the scope hash does not depend on the order written.
    pub scope_headers: Vec<HeaderName>,
    /// Sorted by name, for the same reason.
    pub fingerprint_headers: Vec<HeaderName>,
    pub concurrent: Concurrent,
    pub wait_timeout: Duration,
    pub release_statuses: Vec<u16>,
    /// gRPC answers (docs/reference/behaviour.md#release) whose `grpc-status` frees the key,
    /// like a release status.
    pub release_grpc_statuses: Vec<u32>,
    pub unknown_outcome: UnknownOutcome,
    /// What a request finds when its key's owner vanished mid-request (its
    /// proxy was killed) and the lease ran out (docs/reference/behaviour.md#dead-owner).
    pub lease_expiry: LeaseExpiry,
    pub fingerprint_body: FingerprintBody,
    pub mode: Mode,
    pub on_store_error: OnStoreError,
    pub replayed_header: HeaderName,
    /// The route also protects its path with a format suffix (`/v1/payments.json`,
    /// as Rails and Django REST framework route it).
    pub format_suffix: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            header: HeaderName::from_static("idempotency-key"),
            key_from: KeySource::Header(HeaderName::from_static("idempotency-key")),
            key: KeyMode::Required,
            ttl: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(30),
            max_key_length: 255,
            max_request_body: 1 << 20,
            max_response_body: 8 << 20,
            scope_headers: vec![http::header::AUTHORIZATION],
            fingerprint_headers: Vec::new(),
            concurrent: Concurrent::Reject,
            wait_timeout: Duration::from_secs(10),
            release_statuses: vec![401, 403, 429, 503],
            // RESOURCE_EXHAUSTED, UNAVAILABLE: "try again later".
            release_grpc_statuses: vec![8, 14],
            unknown_outcome: UnknownOutcome::Store,
            lease_expiry: LeaseExpiry::UnknownOutcome,
            fingerprint_body: FingerprintBody::Raw,
            mode: Mode::Enforce,
            on_store_error: OnStoreError::Reject,
            replayed_header: HeaderName::from_static("idempotent-replayed"),
            format_suffix: true,
        }
    }
}

/// Where a route's key comes from (`key_from`, docs/reference/behaviour.md#webhook-keys).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    /// A request header, its value in the key syntax of docs/reference/behaviour.md#key-syntax.
    Header(HeaderName),
    /// A string or an integer in the JSON request body: the body is read
    /// (and its size checked) before the key.
    Json(Pointer),
}

/// An RFC 6901 JSON pointer, parsed into its reference tokens (escapes decoded).
/// Never empty: a key is a member or an element, not the whole body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pointer {
    tokens: Vec<String>,
}

impl Pointer {
    /// `/a/b~1c/0` → `["a", "b/c", "0"]`; `~0` is `~`, `~1` is `/`, any other `~` is an error.
    pub fn parse(text: &str) -> Result<Pointer, String> {
        let bad = |why: &str| format!("invalid JSON pointer \"{text}\": {why}");
        let Some(rest) = text.strip_prefix('/') else {
            return Err(bad(if text.is_empty() {
                "it names the whole body; point at a member, e.g. \"json:/id\""
            } else {
                "it starts with '/' (RFC 6901), e.g. \"json:/id\""
            }));
        };
        let mut tokens = Vec::new();
        for raw in rest.split('/') {
            let mut token = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(c) = chars.next() {
                if c != '~' {
                    token.push(c);
                    continue;
                }
                match chars.next() {
                    Some('0') => token.push('~'),
                    Some('1') => token.push('/'),
                    _ => return Err(bad("'~' is written \"~0\", and '/' in a name \"~1\"")),
                }
            }
            tokens.push(token);
        }
        Ok(Pointer { tokens })
    }

    /// The reference tokens, decoded, from the root down.
    pub fn tokens(&self) -> &[String] {
        &self.tokens
    }
}

/// The pointer as RFC 6901 writes it (`~` as `~0`, `/` in a name as `~1`).
impl fmt::Display for Pointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for t in &self.tokens {
            write!(f, "/{}", t.replace('~', "~0").replace('/', "~1"))?;
        }
        Ok(())
    }
}

/// The spelling of `key_from`, resolved: `header:<name>` or `json:<pointer>` (for `--check`).
impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Header(name) => write!(f, "header:{name}"),
            KeySource::Json(pointer) => write!(f, "json:{pointer}"),
        }
    }
}

/// Is a request without a key refused (400) or forwarded unprotected?
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyMode {
    Required,
    Optional,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Concurrent {
    /// A duplicate of an in-flight request gets 409 with `Retry-After`.
    Reject,
    /// A duplicate waits (up to `wait_timeout`) for the first to finish and gets its replay.
    Wait,
}

/// What an upstream timeout or reset leaves behind: the stored 504/502, or a released key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnknownOutcome {
    Store,
    Release,
}

/// How a request is handled that finds its key's owner gone: a reservation
/// whose lease ran out without a completion or a release (the owner's process
/// died after the request may have reached the upstream).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaseExpiry {
    /// The outcome is unknown: handled as `unknown_outcome` says (the 502
    /// `outcome-unknown` stored and replayed, or the key freed with `release`).
    UnknownOutcome,
    /// The request runs again (for upstreams that deduplicate themselves).
    ReExecute,
}

/// What becomes of a dead owner's key (see [`Policy::dead_owner`]): the
/// store records it in the reservation.
pub use idemproxy_store::record::DeadOwner;

impl Policy {
    /// How a dead owner's key is handled: stored as an unknown outcome when
    /// `lease_expiry = "unknown_outcome"` and `unknown_outcome = "store"`,
    /// run again otherwise (`re_execute`, or `release`, which frees the key of
    /// any unknown outcome).
    pub fn dead_owner(&self) -> DeadOwner {
        match (self.lease_expiry, self.unknown_outcome) {
            (LeaseExpiry::UnknownOutcome, UnknownOutcome::Store) => DeadOwner::StoreUnknown,
            _ => DeadOwner::ReExecute,
        }
    }

    /// How long a reservation is kept past its lease so that a dead owner
    /// is recognised (its "afterlife"): as long as its answer would have
    /// been kept, the route's `ttl`. The store keeps a reservation for
    /// `lease + afterlife`; within the last `afterlife` of that, its lease
    /// has run out.
    pub fn afterlife(&self) -> Duration {
        self.ttl
    }

    /// How long the store keeps a reservation (and each renewal extends it to).
    pub fn reservation_hold(&self) -> Duration {
        self.lease.saturating_add(self.afterlife())
    }
}

/// How the body enters the fingerprint: its bytes, or its JSON value (keys sorted, spaces ignored).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FingerprintBody {
    Raw,
    Json,
}

/// `shadow` forwards everything and only counts what enforcing would have done.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Enforce,
    Shadow,
}

/// When the store cannot answer: refuse (503), or forward unprotected (counted).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreError {
    Reject,
    Pass,
}

/// The spelling the configuration file uses, for `--check` and messages.
impl fmt::Display for KeyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyMode::Required => "required",
            KeyMode::Optional => "optional",
        })
    }
}

/// The spelling the configuration file uses, for `--check` and messages.
impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers_parse_into_decoded_tokens_and_print_back() {
        let p = |t: &str| Pointer::parse(t).map(|p| p.tokens().to_vec());
        assert_eq!(p("/id").unwrap(), ["id"]);
        assert_eq!(p("/data/object/id").unwrap(), ["data", "object", "id"]);
        assert_eq!(p("/a~1b/m~0n/~01").unwrap(), ["a/b", "m~n", "~1"]);
        assert_eq!(p("/").unwrap(), [""], "the member named \"\"");
        assert_eq!(p("/a//0").unwrap(), ["a", "", "0"]);
        for text in ["/id", "/a~1b/m~0n/~01", "/", "/a//0", "/é"] {
            assert_eq!(Pointer::parse(text).unwrap().to_string(), text);
        }
        for bad in ["", "id", "#/id", "/a~2", "/a~", "/~/b"] {
            assert!(Pointer::parse(bad).is_err(), "{bad:?}");
        }
    }
}
