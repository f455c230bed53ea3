//! idemproxy: a reverse proxy that makes chosen routes of an unmodified HTTP API safe to retry.
//!
//! The request flow, for a route listed in the configuration:
//!
//! 1. read the `Idempotency-Key` header (`key`): missing or malformed → 400;
//! 2. read the body up to `max_request_body` (`proxy`): larger → 413;
//! 3. fingerprint method, path, query, chosen headers and body; derive the
//!    record id from the scope headers and the key (`key`);
//! 4. reserve the id in the store as `processing` with a lease (`store`), or
//!    find the record that holds it: replay it, 409 while in flight, 422 when
//!    the fingerprint differs;
//! 5. forward to the upstream in a task of its own, renewing the lease
//!    (`proxy`, `upstream`);
//! 6. store status, end-to-end headers and body with a TTL (`record`), then answer.
//!
//! Every other request streams through untouched.
#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod body;
pub mod budget;
pub mod canonical_json;
pub mod config;
pub mod conn;
pub mod key;
pub mod metrics;
pub mod policy;
pub mod problem;
pub mod proxy;
pub mod record;
pub mod routes;
pub mod server;
pub mod store;
pub mod upstream;
