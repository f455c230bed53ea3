//! idemproxy: a reverse proxy that makes chosen routes of an unmodified HTTP API safe to retry.
//! This is its library (the package `idemproxy-proxy`, used as `idemproxy`);
//! the binary, the Kubernetes tooling and the fault campaign are crates of
//! their own beside it.
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
//! serves whole connections (`workers`). `lifecycle` runs the bound server
//! until a shutdown, applying reloads meanwhile (SIGHUP, SIGTERM in the binary).
// `deny`, not `forbid`: two calls into glibc (`serve::trim`, `malloc_trim`;
// `serve::one_arena`, `mallopt`) and jemalloc's settings by their exported
// name (`serve::JEMALLOC_CONF`, with `alloc-jemalloc`) are allowed by name;
// nothing else may use `unsafe`.
#![deny(unsafe_code)]

// The map. `pub`: what the binary, the tests, the fuzz targets and the
// examples use; `pub(crate)`: used only inside the crate.

// Starting and serving.
// Listeners, accept loops, the store health check, draining on shutdown.
pub mod server;
// One client connection: HTTP/1.1 or h2c, and the process's memory settings.
pub mod serve;
// A client connection's I/O with its header, idle and send deadlines.
pub mod conn;
// The send deadline of HTTP/2 answers.
pub(crate) mod stall;
// Deadlines of one length for many operations, kept by one timer (the
// store's crate has them; the upstream's timeouts use them too).
pub(crate) use idemproxy_store::deadline;
// TLS on the client-facing listener.
pub mod tls;
// Worker threads with a runtime each.
pub(crate) mod workers;
// A request's place among the requests in progress.
pub(crate) mod permit;
// The admin listener: health, readiness, metrics, the key admin API.
pub(crate) mod admin;
// The state every request shares, and the admin token.
pub mod app;
// Serving until asked to stop, reloading when asked to, the last spans flushed.
pub mod lifecycle;

// Configuration and what it builds.
// The TOML file and overrides, turned into a typed, checked `Config`.
pub mod config;
// What a protected route does.
pub mod policy;
// The route table: (method, path) → a route and its policy.
pub(crate) mod routes;

// The protected request.
// The request path, phase by phase.
pub(crate) mod proxy;
// The key, the request's identity and its fingerprint.
pub mod key;
// Exact canonical JSON for JSON fingerprints.
pub mod canonical_json;
// Bodies in both directions, and reading one up to a limit.
pub mod body;
// The memory budget for bytes held at once.
pub(crate) mod budget;
// How long a route's upstream typically takes (a 409's `Retry-After`).
pub(crate) mod typical;
// Every answer the proxy makes itself (RFC 9457 problem details).
pub(crate) mod problem;
// gRPC's vocabulary: statuses, trailers, Trailers-Only answers.
pub(crate) mod grpc;
// The pooled upstream client and header hygiene.
pub mod upstream;

// What is kept: a crate of its own (crates/store), under the names the
// proxy has always used.
// What is stored under a key, in its binary format.
pub use idemproxy_store::record;
// Records sealed at rest (AES-256-GCM).
pub use idemproxy_store::seal;
// The store: one key per operation, in memory, on Redis or on PostgreSQL.
pub use idemproxy_store as store;
// Prometheus metrics.
pub mod metrics;
// Distributed tracing: spans exported over OTLP (`[telemetry]`).
pub mod telemetry;

// YAML out that YAML 1.1 readers (Kubernetes) read the same: `openapi`
// and the Kubernetes tooling (crates/kube) write with it.
pub mod yaml;
// OpenAPI documents: routes from operations, operations annotated (`idemproxy openapi`).
pub mod openapi;

// `idemproxy conformance`: a black-box check of any endpoint's Idempotency-Key handling.
pub mod conformance;

#[cfg(test)]
mod sizes;
