//! `[defaults]` and `[[routes]]`: each route's policy on top of the
//! defaults, the route table, and the routes' bodies against the memory budget.

use std::collections::HashSet;
use std::sync::Arc;

use http::{HeaderName, Method};
use toml::Spanned;

use crate::config::grammar::{ConfHeader, ConfKeyFrom};
use crate::config::raw::RawPolicy;
use crate::config::{ConfigError, ServerConfig, Source};
use crate::policy::{KeySource, Policy};
use crate::routes::{Route, RouteName, RouteTable};

/// Redis's largest value: a record body beyond it could never be stored.
const MAX_RECORD_BODY: u64 = crate::record::MAX_BODY;

/// A route whose largest body could never get room in the memory budget
/// would answer every such request 503: say so at load time, at the
/// `max_request_body` that sets it (the route's, else `[defaults]`'s).
pub(super) fn within_budget(
    server: &ServerConfig,
    defaults: &RawPolicy,
    raw: &[Spanned<RawPolicy>],
    routes: &RouteTable,
    src: &Source,
) -> Result<(), ConfigError> {
    for (i, (route, r)) in routes.iter().zip(raw).enumerate() {
        let limit = route.policy.max_request_body;
        if limit <= server.max_buffered {
            continue;
        }
        let (key, at) = match (&r.get_ref().max_request_body, &defaults.max_request_body) {
            (Some(v), _) => (format!("routes[{i}].max_request_body"), v.span().start),
            (None, Some(v)) => ("defaults.max_request_body".to_string(), v.span().start),
            (None, None) => (format!("routes[{i}]"), r.span().start),
        };
        return Err(src.invalid(
            at,
            key,
            format!(
                "{limit} bytes is more than server.max_buffered ({}): such a body could never be buffered",
                server.max_buffered
            ),
        ));
    }
    Ok(())
}

/// `[defaults]` on top of the built-in policy, then each route on top of `[defaults]`.
pub(super) fn routes(
    defaults: &RawPolicy,
    raw: &[Spanned<RawPolicy>],
    src: &Source,
) -> Result<RouteTable, ConfigError> {
    for (key, span) in [
        ("name", defaults.name.as_ref().map(Spanned::span)),
        ("methods", defaults.methods.as_ref().map(Spanned::span)),
        ("path", defaults.path.as_ref().map(Spanned::span)),
    ] {
        if let Some(span) = span {
            return Err(src.invalid(
                span.start,
                format!("defaults.{key}"),
                format!("`{key}` belongs in a [[routes]] entry, not in [defaults]"),
            ));
        }
    }
    let base = policy(Policy::default(), defaults, None, "defaults", src)?;
    let mut names = HashSet::new();
    let mut routes = Vec::with_capacity(raw.len());
    for (i, r) in raw.iter().enumerate() {
        let section = format!("routes[{i}]");
        let (defaults, inherited) = (&base, defaults.key_from.as_ref());
        routes.push(route(&section, r, defaults, inherited, &mut names, src)?);
    }
    let table = RouteTable::new(routes);
    // A route that can never match is a mistake the file would otherwise hide
    // (docs/reference/behaviour.md#normalised-path).
    if let Some((i, earlier)) = table.unreachable() {
        let (later, first) = (table.at(i), table.at(earlier));
        let span = raw[i]
            .get_ref()
            .path
            .as_ref()
            .map_or(raw[i].span(), Spanned::span);
        return Err(src.invalid(
            span.start,
            format!("routes[{i}].path"),
            format!(
                "route \"{}\" ({}) can never match: route \"{}\" ({}) comes first and takes \
                 every method and path it names; put the narrower route first or remove it",
                later.name, later.path, first.name, first.path
            ),
        ));
    }
    Ok(table)
}

fn route(
    section: &str,
    raw: &Spanned<RawPolicy>,
    defaults: &Policy,
    inherited_key_from: Option<&ConfKeyFrom>,
    names: &mut HashSet<String>,
    src: &Source,
) -> Result<Route, ConfigError> {
    let r = raw.get_ref();
    let name_field = r.name.as_ref().ok_or_else(|| {
        src.invalid(
            raw.span().start,
            format!("{section}.name"),
            "every route needs a unique `name`",
        )
    })?;
    let name = name_field.get_ref();
    let at_name =
        |message: String| src.invalid(name_field.span().start, format!("{section}.name"), message);
    let name_ok = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if !name_ok {
        return Err(at_name(format!(
            "invalid route name \"{name}\": use letters, digits, '_', '-', '.'"
        )));
    }
    if !names.insert(name.clone()) {
        return Err(at_name(format!("duplicate route name \"{name}\"")));
    }
    let path = r.path.as_ref().ok_or_else(|| {
        src.invalid(
            raw.span().start,
            format!("{section}.path"),
            format!("route \"{name}\" needs a `path`"),
        )
    })?;
    let methods = match &r.methods {
        Some(m) if m.get_ref().is_empty() => {
            return Err(src.invalid(
                m.span().start,
                format!("{section}.methods"),
                format!("route \"{name}\" lists no methods"),
            ));
        }
        Some(m) => m.get_ref().iter().map(|m| m.0.clone()).collect(),
        None => vec![Method::POST],
    };
    Ok(Route {
        name: RouteName::new(name),
        methods,
        path: path.get_ref().clone(),
        policy: Arc::new(policy(
            defaults.clone(),
            r,
            inherited_key_from,
            section,
            src,
        )?),
        series: Default::default(),
        typical: Default::default(),
    })
}

/// `raw`'s policy keys on top of `p`; `key_from` is `inherited_key_from`
/// (`[defaults]`'s) unless `raw` sets it, and follows the final `header`.
fn policy(
    mut p: Policy,
    raw: &RawPolicy,
    inherited_key_from: Option<&ConfKeyFrom>,
    section: &str,
    src: &Source,
) -> Result<Policy, ConfigError> {
    sizes(&mut p, raw, section, src)?;
    identity(&mut p, raw);
    treatment(&mut p, raw);
    p.key_from = key_source(raw.key_from.as_ref().or(inherited_key_from), &p.header);
    Ok(p)
}

/// The sizes `raw` sets: a key's length (1..=4096), a request body's, and a
/// response body's (at most what one Redis value holds), each checked where given.
fn sizes(p: &mut Policy, raw: &RawPolicy, section: &str, src: &Source) -> Result<(), ConfigError> {
    if let Some(v) = &raw.max_key_length {
        let n = *v.get_ref();
        if !(1..=4096).contains(&n) {
            return Err(src.invalid(
                v.span().start,
                format!("{section}.max_key_length"),
                format!("invalid value {n}: expected 1..=4096"),
            ));
        }
        p.max_key_length = n as usize;
    }
    if let Some(v) = &raw.max_request_body {
        p.max_request_body = v.get_ref().0;
    }
    if let Some(v) = &raw.max_response_body {
        if v.get_ref().0 > MAX_RECORD_BODY {
            return Err(src.invalid(
                v.span().start,
                format!("{section}.max_response_body"),
                format!(
                    "invalid value {}: at most 512MiB (a Redis value holds no more)",
                    v.get_ref().0
                ),
            ));
        }
        p.max_response_body = v.get_ref().0;
    }
    Ok(())
}

/// What `raw` says of what identifies a request: where its key is and
/// whether it must have one, what scopes the key and enters the
/// fingerprint, and how a replay is marked.
fn identity(p: &mut Policy, raw: &RawPolicy) {
    if let Some(v) = &raw.header {
        p.header = v.0.clone();
    }
    if let Some(v) = raw.key {
        p.key = v;
    }
    if let Some(v) = &raw.scope_headers {
        p.scope_headers = sorted_unique(v);
    }
    if let Some(v) = &raw.fingerprint_headers {
        p.fingerprint_headers = sorted_unique(v);
    }
    if let Some(v) = raw.fingerprint_body {
        p.fingerprint_body = v;
    }
    if let Some(v) = &raw.replayed_header {
        p.replayed_header = v.0.clone();
    }
    if let Some(v) = raw.format_suffix {
        p.format_suffix = v;
    }
}

/// What `raw` says of how a keyed request is treated: how long its record
/// and lease last, what a duplicate in flight gets, which answers release
/// the key, and whether the route enforces and passes when the store is down.
fn treatment(p: &mut Policy, raw: &RawPolicy) {
    if let Some(v) = raw.ttl {
        p.ttl = v.0;
    }
    if let Some(v) = raw.lease {
        p.lease = v.0;
    }
    if let Some(v) = raw.concurrent {
        p.concurrent = v;
    }
    if let Some(v) = raw.wait_timeout {
        p.wait_timeout = v.0;
    }
    if let Some(v) = &raw.release_statuses {
        p.release_statuses = v.iter().map(|s| s.0).collect();
    }
    if let Some(v) = &raw.release_grpc_statuses {
        p.release_grpc_statuses = v.iter().map(|s| s.0).collect();
    }
    if let Some(v) = raw.unknown_outcome {
        p.unknown_outcome = v;
    }
    if let Some(v) = raw.lease_expiry {
        p.lease_expiry = v;
    }
    if let Some(v) = raw.mode {
        p.mode = v;
    }
    if let Some(v) = raw.on_store_error {
        p.on_store_error = v;
    }
}

/// `key_from` resolved: `"header"` (or nothing) is the route's own `header`.
fn key_source(key_from: Option<&ConfKeyFrom>, header: &HeaderName) -> KeySource {
    match key_from {
        None | Some(ConfKeyFrom::RouteHeader) => KeySource::Header(header.clone()),
        Some(ConfKeyFrom::Header(name)) => KeySource::Header(name.clone()),
        Some(ConfKeyFrom::Json(pointer)) => KeySource::Json(pointer.clone()),
    }
}

fn sorted_unique(headers: &[ConfHeader]) -> Vec<HeaderName> {
    let mut v: Vec<HeaderName> = headers.iter().map(|h| h.0.clone()).collect();
    v.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    v.dedup();
    v
}
