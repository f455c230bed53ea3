//! Real parts for the integration tests, all on loopback and port 0 (or a free port).
//!
//! - from the workspace's test kit (`crates/testkit`, shared with the store's
//!   conformance tests): a `redis-server` of the test's own with cluster,
//!   sentinel and replica setups (`RedisServer`), a PostgreSQL server of the
//!   test's own with a synchronous standby (`PgServer`), free ports, children
//!   killed and reaped, `DEADLINE` and `eventually`;
//! - `certs`: a CA and server certificates made with openssl;
//! - `curl`: the curl command line and its answer;
//! - `upstream`: a programmable upstream (`TestUpstream`) that counts and holds requests;
//! - `proxy`: the proxy under test (`Proxy`): the `idemproxy` binary as a child process,
//!   or the library's server in the test's runtime;
//! - `logs`: the in-process proxy's logs, captured as the binary writes them;
//! - `inprocess`: the proxy started from the library, for tests that pause time;
//! - `client`: a small HTTP client (`Call`, `Resp`, raw sockets);
//! - `config`: `ConfigBuilder`, the configuration text tests start the proxy with;
//! - `env`: `Env`, a standard set of the above, and `on_every_backend!`;
//! - `relay`: a fault-injecting TCP relay;
//! - `peers`: client peers in Python (grpcio, urllib3) run as subprocesses;
//! - `otel`: OpenTelemetry peers: a real OTLP receiver, the Python SDK's client, spans read back;
//! - `kube`: `idemproxy inject` run on manifests, and its output read back and validated;
//! - `failover`: the store failover tests' traffic (`Traffic`) and their final check (`settle`).
//!
//! Waits are on events with deadlines (`eventually`), never fixed sleeps.
// Every test binary compiles this module and uses a part of it: what one binary
// leaves unused is used by another.
#![allow(dead_code, unused_imports)]

mod certs;
mod client;
mod config;
mod curl;
mod env;
pub mod failover;
mod inprocess;
pub mod kube;
mod logs;
mod otel;
mod peers;
mod proxy;
pub mod relay;
mod upstream;

pub use certs::*;
pub use client::*;
pub use config::*;
pub use curl::*;
pub use env::*;
pub use inprocess::*;
pub use logs::*;
pub use otel::*;
pub use peers::*;
pub use proxy::*;
pub use upstream::*;

// The real servers (redis-server, PostgreSQL), ports and waits: shared with
// the store's conformance tests.
pub use idemproxy_testkit::*;
