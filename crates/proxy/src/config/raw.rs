//! The file as written: `Raw*` serde structs (unknown keys rejected), and the parser's map of keys to spans.
//!
//! Every value that is checked after parsing is kept as `toml::Spanned`, so
//! the check can point at it. All policy keys are optional here: a route
//! inherits what it does not set from `[defaults]`.

use std::fmt;
use std::path::PathBuf;

use serde::de::{MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use toml::Spanned;

use super::grammar::{
    ByteSize, ConfGrpcStatus, ConfHeader, ConfKeyFrom, ConfMethod, ConfStatus, HumanDuration,
};
use super::{Backend, RedisMode, Runtime, UpstreamProtocol};
use crate::policy::{
    Concurrent, FingerprintBody, KeyMode, LeaseExpiry, Mode, OnStoreError, UnknownOutcome,
};
use crate::routes::PathPattern;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFile {
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub telemetry: RawTelemetry,
    #[serde(default)]
    pub defaults: RawPolicy,
    /// Spanned so that a route missing its `name` or `path` can be pointed at.
    #[serde(default)]
    pub routes: Vec<Spanned<RawPolicy>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub listen: Option<Spanned<String>>,
    pub upstream: Option<Spanned<String>>,
    pub admin_listen: Option<Spanned<String>>,
    pub upstream_timeout: Option<HumanDuration>,
    pub shutdown_grace: Option<HumanDuration>,
    pub header_read_timeout: Option<HumanDuration>,
    pub body_read_timeout: Option<HumanDuration>,
    pub max_connections: Option<Spanned<i64>>,
    pub workers: Option<Spanned<i64>>,
    pub runtime: Option<Runtime>,
    pub max_header_bytes: Option<Spanned<ByteSize>>,
    pub max_buffered: Option<Spanned<ByteSize>>,
    pub client_write_timeout: Option<HumanDuration>,
    pub idle_timeout: Option<HumanDuration>,
    pub upstream_idle_timeout: Option<HumanDuration>,
    pub upstream_protocol: Option<UpstreamProtocol>,
    pub forward_normalised_path: Option<bool>,
    pub tls_cert_file: Option<Spanned<PathBuf>>,
    pub tls_key_file: Option<Spanned<PathBuf>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    pub backend: Option<Backend>,
    pub url: Option<Spanned<String>>,
    pub key_prefix: Option<Spanned<String>>,
    pub op_timeout: Option<HumanDuration>,
    pub password_file: Option<PathBuf>,
    pub mode: Option<Spanned<RedisMode>>,
    pub nodes: Option<Spanned<Vec<String>>>,
    pub sentinels: Option<Spanned<Vec<String>>>,
    pub master_name: Option<String>,
    pub username: Option<String>,
    pub tls_ca_file: Option<PathBuf>,
    pub wait_replicas: Option<u32>,
    pub wait_timeout: Option<HumanDuration>,
    pub memory_limit: Option<ByteSize>,
    pub encryption_key_file: Option<Spanned<PathBuf>>,
    pub require_sealed: Option<Spanned<bool>>,
    pub sslmode: Option<Spanned<String>>,
    pub table: Option<Spanned<String>>,
    pub pool_size: Option<Spanned<u32>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTelemetry {
    pub otlp_endpoint: Option<Spanned<String>>,
    pub otlp_protocol: Option<Spanned<String>>,
    pub service_name: Option<Spanned<String>>,
    pub sample_ratio: Option<Spanned<f64>>,
    pub client_context: Option<Spanned<String>>,
}

/// A `[[routes]]` entry or the `[defaults]` table.
/// (One struct rather than `#[serde(flatten)]`, which would lose the spans
/// and the unknown-key check.)
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    pub name: Option<Spanned<String>>,
    pub methods: Option<Spanned<Vec<ConfMethod>>>,
    pub path: Option<Spanned<PathPattern>>,
    pub header: Option<ConfHeader>,
    pub key_from: Option<ConfKeyFrom>,
    pub key: Option<KeyMode>,
    pub ttl: Option<HumanDuration>,
    pub lease: Option<HumanDuration>,
    pub max_key_length: Option<Spanned<i64>>,
    pub max_request_body: Option<Spanned<ByteSize>>,
    pub max_response_body: Option<Spanned<ByteSize>>,
    pub scope_headers: Option<Vec<ConfHeader>>,
    pub fingerprint_headers: Option<Vec<ConfHeader>>,
    pub concurrent: Option<Concurrent>,
    pub wait_timeout: Option<HumanDuration>,
    pub release_statuses: Option<Vec<ConfStatus>>,
    pub release_grpc_statuses: Option<Vec<ConfGrpcStatus>>,
    pub unknown_outcome: Option<UnknownOutcome>,
    pub lease_expiry: Option<LeaseExpiry>,
    pub fingerprint_body: Option<FingerprintBody>,
    pub mode: Option<Mode>,
    pub on_store_error: Option<OnStoreError>,
    pub replayed_header: Option<ConfHeader>,
    pub format_suffix: Option<bool>,
}

/// The key of the entry an error at `offset` belongs to, as messages spell it
/// ("server.upstream", "routes[1].ttl"): the last key or array element the
/// parser placed at or before `offset`. `None` when the text is not TOML
/// (a syntax error has no key).
pub(super) fn key_at(text: &str, offset: usize) -> Option<String> {
    keys(text)?
        .into_iter()
        .filter(|(start, _)| *start <= offset)
        .max_by_key(|(start, _)| *start)
        .map(|(_, path)| path)
}

/// Where the parser found the key `path` (spelled as in [`key_at`]).
pub(super) fn key_start(text: &str, path: &str) -> Option<usize> {
    keys(text)?
        .into_iter()
        .find(|(_, p)| p == path)
        .map(|(start, _)| start)
}

/// Every key and array element of the document with the byte offset where the
/// parser found it. The typed structs cannot say which key a serde error is
/// about (toml keeps that path private), so the document is read a second
/// time, on the error path only, as this untyped tree.
fn keys(text: &str) -> Option<Vec<(usize, String)>> {
    // A datetime value arrives as a private map whose key has no span: the
    // tree cannot be read, and the error is then reported without a key.
    let root: Node = toml::from_str(text).ok()?;
    let mut out = Vec::new();
    root.flatten("", &mut out);
    Some(out)
}

/// A TOML document reduced to its keys, their spans, and array elements.
enum Node {
    Leaf,
    Table(Vec<(Spanned<String>, Node)>),
    Array(Vec<Spanned<Node>>),
}

impl Node {
    fn flatten(&self, prefix: &str, out: &mut Vec<(usize, String)>) {
        match self {
            Node::Leaf => {}
            Node::Table(entries) => {
                for (key, value) in entries {
                    let path = if prefix.is_empty() {
                        key.get_ref().clone()
                    } else {
                        format!("{prefix}.{}", key.get_ref())
                    };
                    out.push((key.span().start, path.clone()));
                    value.flatten(&path, out);
                }
            }
            Node::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    let path = format!("{prefix}[{i}]");
                    out.push((item.span().start, path.clone()));
                    item.get_ref().flatten(&path, out);
                }
            }
        }
    }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any TOML value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Node, E> {
        Ok(Node::Leaf)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Node, E> {
        Ok(Node::Leaf)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Node, E> {
        Ok(Node::Leaf)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Node, E> {
        Ok(Node::Leaf)
    }

    fn visit_str<E>(self, _: &str) -> Result<Node, E> {
        Ok(Node::Leaf)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Node::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key()? {
            entries.push((key, map.next_value()?));
        }
        Ok(Node::Table(entries))
    }
}
