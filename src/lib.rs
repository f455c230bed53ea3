//! idemproxy: a reverse proxy that makes chosen routes of an unmodified HTTP API safe to retry.
//!
//! The request flow, for a route listed in the configuration (`proxy`, one
//! function per phase; any phase may stop the request with a value):
//!
//! 1. the key: the `Idempotency-Key` header or the route's `key_from` header
//!    (`key`): missing or malformed → 400;
//! 2. the body, up to `max_request_body` (413) and with room in the memory
//!    budget (`budget`: 503 `proxy-busy`), read by `body`; a `key_from =
//!    "json:<pointer>"` key is read from it now (`key`, `canonical_json`);
//! 3. the identity: fingerprint of method, path, query, chosen headers and
//!    body (`key`, `canonical_json`); record id from the scope headers and the key;
//! 4. reserve the id in the store as `processing` with a lease (`store`), or
//!    judge the record that holds it (`proxy::verdict`): replay, 409 while in
//!    flight, 422 when the fingerprint differs, 500 when unreadable;
//! 5. forward in a task of its own that owns the reservation (`proxy::job`),
//!    renewing the lease; store status, end-to-end headers and body with a TTL
//!    (`record`; sealed at rest by `seal` with an `encryption_key_file`), or
//!    release the key; then answer.
//!
//! What a route does is its `policy`, built from the file by `config`. Every
//! answer the proxy makes itself is a `problem`. Every other request streams
//! through untouched (`upstream`); an HTTP/1.1 `Upgrade` (a WebSocket) on a
//! path no route protects becomes a tunnel (`proxy::tunnel`); `server` accepts and
//! drains, with the per-connection deadlines of `conn` and the per-stream
//! send deadline of `stall`, counts each request's place among the requests
//! in progress (`permit`) until its upstream exchange ends, and speaks TLS when
//! configured (`tls`); each worker thread runs a runtime of its own and
//! serves whole connections (`workers`).
// `deny`, not `forbid`: two calls into glibc (`serve::trim`, `malloc_trim`;
// `serve::one_arena`, `mallopt`) are allowed by name; nothing else may use `unsafe`.
#![deny(unsafe_code)]

pub mod admin;
pub mod app;
pub mod body;
pub mod budget;
pub mod canonical_json;
pub mod config;
pub mod conn;
pub mod deadline;
pub mod grpc;
pub mod key;
pub mod metrics;
pub mod permit;
pub mod policy;
pub mod problem;
pub mod proxy;
pub mod record;
pub mod routes;
pub mod seal;
pub mod serve;
pub mod server;
pub mod stall;
pub mod store;
pub mod tls;
pub mod typical;
pub mod upstream;
pub mod workers;
