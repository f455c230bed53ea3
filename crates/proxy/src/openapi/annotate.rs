//! `idemproxy openapi annotate`: a document with what the proxy adds to the
//! operations a configuration protects.
//!
//! Which operations: each is judged by the proxy's own route table
//! ([`crate::routes::RouteTable::judge`]) as a request to its path, with
//! each template parameter standing for a value no literal segment can be
//! (`%7Bcustomer%7D`), under its method and each content type its request
//! body declares (none when it declares no body: the proxy takes such a
//! POST for a possible form). An operation protected by an enforcing route
//! gets the key's header parameter, the proxy's 400, 409, 410, 422 and 503
//! answers where it does not describe those statuses itself, and the
//! replay header on its 2xx responses. Every other operation is left as it was.

use std::collections::HashMap;

use http::{HeaderMap, HeaderValue, Method, Uri};
use serde_norway::{Mapping, Value};

use super::components::{Additions, Components};
use super::{Document, OpenapiError, Operation};
use crate::config::Config;
use crate::policy::Mode;
use crate::routes::Judgement;

/// What `annotate` did.
#[derive(Clone, Debug, Default)]
pub struct Annotated {
    pub operations: usize,
    /// The operations annotated, with the name of the route that protects each.
    pub protected: Vec<(Operation, String)>,
    pub notes: Vec<String>,
}

/// Annotates the operations `config` protects; an error when it protects none.
pub(crate) fn annotate(doc: &mut Document, config: &Config) -> Result<Annotated, OpenapiError> {
    let operations = doc.operations();
    let mut done = Annotated {
        operations: operations.len(),
        ..Annotated::default()
    };
    let mut plan = Vec::new();
    for op in &operations {
        let Some(position) = protecting_route(doc, config, op) else {
            continue;
        };
        let route = config.routes.at(position);
        if route.policy.mode == Mode::Shadow {
            done.notes.push(format!(
                "{}: route {} is in shadow mode: the proxy adds nothing to its answers, so nothing is added",
                op.label(),
                route.name
            ));
            continue;
        }
        plan.push((op.clone(), position));
    }
    if plan.is_empty() {
        return Err(OpenapiError::Nothing {
            what: doc.what.clone(),
            message: format!(
                "none of its {} operations is protected by an enforcing route of {}",
                operations.len(),
                config.source
            ),
        });
    }
    let mut components = Components::new(doc);
    let mut by_route: HashMap<usize, Additions> = HashMap::new();
    let mut kept: HashMap<u16, usize> = HashMap::new();
    let mut no_success = 0;
    for (op, position) in plan {
        let route = config.routes.at(position);
        let adds = by_route
            .entry(position)
            .or_insert_with(|| components.for_policy(&route.policy))
            .clone();
        let has_parameter = adds
            .parameter
            .as_ref()
            .is_some_and(|(name, _)| declares_header(doc, &op, name));
        let derived = derived_responses(doc, &op, &adds, &mut components);
        let Some(operation) = doc.operation_mut(&op) else {
            continue;
        };
        if !has_parameter {
            if let Some((_, parameter)) = &adds.parameter {
                add_parameter(operation, parameter.clone());
            }
        }
        if !add_responses(operation, &adds, derived, &mut kept) {
            no_success += 1;
        }
        done.protected.push((op, route.name.to_string()));
    }
    components.write_into(&mut doc.root);
    if no_success > 0 {
        done.notes.push(format!(
            "{no_success} protected operations describe no 2xx response: Idempotent-Replayed is on none of theirs"
        ));
    }
    let mut kept: Vec<(u16, usize)> = kept.into_iter().collect();
    kept.sort();
    for (status, n) in kept {
        done.notes.push(format!(
            "{n} protected operations describe {status} themselves: theirs is kept, the proxy's {status} is not added to them"
        ));
    }
    Ok(done)
}

/// The position of the route that protects `op`, if one does.
fn protecting_route(doc: &Document, config: &Config, op: &Operation) -> Option<usize> {
    let method = Method::from_bytes(op.method.to_ascii_uppercase().as_bytes()).ok()?;
    let uri: Uri = concrete_path(&op.path).parse().ok()?;
    content_types(doc, op).into_iter().find_map(|ct| {
        let mut headers = HeaderMap::new();
        if let Some(value) = ct.and_then(|ct| HeaderValue::from_str(&ct).ok()) {
            headers.insert(http::header::CONTENT_TYPE, value);
        }
        match config.routes.judge(&method, &uri, &headers) {
            Judgement::Protected(position) => Some(position),
            Judgement::Refused | Judgement::Unprotected => None,
        }
    })
}

/// A request path for a template: each `{name}` as `%7Bname%7D` (a value
/// that only a route's `{param}` matches), other bytes a URI cannot hold percent-encoded.
pub(crate) fn concrete_path(template: &str) -> String {
    let mut out = String::with_capacity(template.len() + 16);
    for b in template.bytes() {
        match b {
            b'{' => out.push_str("%7B"),
            b'}' => out.push_str("%7D"),
            b'/' | b'-' | b'.' | b'_' | b'~' | b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*'
            | b'+' | b',' | b';' | b'=' | b':' | b'@' | b'%' => out.push(b as char),
            b if b.is_ascii_alphanumeric() => out.push(b as char),
            b => out.push_str(&format!("%{b:02X}")),
        }
    }
    if !out.starts_with('/') {
        out.insert(0, '/');
    }
    out
}

/// The content types the operation's request body declares; `[None]` when it declares none.
fn content_types(doc: &Document, op: &Operation) -> Vec<Option<String>> {
    let declared: Vec<Option<String>> = doc
        .operation(op)
        .and_then(|o| o.get("requestBody"))
        .and_then(|b| doc.resolve(b))
        .and_then(|b| b.get("content"))
        .and_then(Value::as_mapping)
        .map(|c| {
            c.keys()
                .filter_map(Value::as_str)
                .map(|k| Some(k.to_string()))
                .collect()
        })
        .unwrap_or_default();
    if declared.is_empty() {
        vec![None]
    } else {
        declared
    }
}

/// Does the operation, or its path item, already declare this header parameter?
fn declares_header(doc: &Document, op: &Operation, name: &str) -> bool {
    let item = doc.root.get("paths").and_then(|p| p.get(op.path.as_str()));
    let lists = [
        doc.operation(op).and_then(|o| o.get("parameters")),
        item.and_then(|i| i.get("parameters")),
    ];
    lists
        .into_iter()
        .flatten()
        .filter_map(Value::as_sequence)
        .flatten()
        .filter_map(|p| doc.resolve(p))
        .any(|p| {
            p.get("in").and_then(Value::as_str) == Some("header")
                && p.get("name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| n.eq_ignore_ascii_case(name))
        })
}

fn add_parameter(operation: &mut Mapping, parameter: Value) {
    let list = operation
        .entry(Value::String("parameters".into()))
        .or_insert_with(|| Value::Sequence(Vec::new()));
    if let Some(list) = list.as_sequence_mut() {
        list.push(parameter);
    }
}

/// Is this a key of `responses` for `status`? (YAML may write `200:`, a number.)
fn is_status(key: &Value, status: u16) -> bool {
    match key {
        Value::String(s) => s == &status.to_string(),
        Value::Number(n) => n.as_u64() == Some(u64::from(status)),
        _ => false,
    }
}

/// A 2xx key: `200`..`299` or `2XX`.
fn is_success(key: &Value) -> bool {
    match key {
        Value::String(s) => {
            s.eq_ignore_ascii_case("2XX") || s.parse::<u16>().is_ok_and(|n| (200..300).contains(&n))
        }
        Value::Number(n) => n.as_u64().is_some_and(|n| (200..300).contains(&n)),
        _ => false,
    }
}

/// Has a response object (not a reference) a header of this name?
fn has_header(response: &Value, name: &str) -> bool {
    response
        .get("headers")
        .and_then(Value::as_mapping)
        .is_some_and(|h| {
            h.keys()
                .filter_map(Value::as_str)
                .any(|k| k.eq_ignore_ascii_case(name))
        })
}

/// For each 2xx response of the operation that is a reference to a shared
/// response: a copy of it with the replay header, added under `components`
/// (once for all the operations that use it), by the response's key.
fn derived_responses(
    doc: &Document,
    op: &Operation,
    adds: &Additions,
    components: &mut Components,
) -> Vec<(Value, Value)> {
    let Some(responses) = doc
        .operation(op)
        .and_then(|o| o.get("responses"))
        .and_then(Value::as_mapping)
    else {
        return Vec::new();
    };
    let (header, header_ref) = &adds.replayed;
    let mut derived = Vec::new();
    for (key, response) in responses.iter().filter(|(k, _)| is_success(k)) {
        let Some(target) = response.get("$ref").and_then(Value::as_str) else {
            continue;
        };
        let Some(shared) = doc.resolve(response) else {
            continue;
        };
        if has_header(shared, header) {
            continue;
        }
        let mut copy = shared.clone();
        insert_header(&mut copy, header, header_ref.clone());
        let base = target.rsplit('/').next().unwrap_or("Response");
        let base = format!("{}Replayed", super::routes::sanitise(base));
        derived.push((key.clone(), components.add("responses", &base, copy)));
    }
    derived
}

fn insert_header(response: &mut Value, name: &str, header: Value) {
    let Some(response) = response.as_mapping_mut() else {
        return;
    };
    let headers = response
        .entry(Value::String("headers".into()))
        .or_insert_with(|| Value::Mapping(Mapping::new()));
    if let Some(headers) = headers.as_mapping_mut() {
        headers.insert(Value::String(name.to_string()), header);
    }
}

/// The proxy's answers for the statuses the operation does not describe,
/// and the replay header on its 2xx responses (false: it describes none).
/// `kept` counts, by status, the operations whose own description of a status is kept.
fn add_responses(
    operation: &mut Mapping,
    adds: &Additions,
    derived: Vec<(Value, Value)>,
    kept: &mut HashMap<u16, usize>,
) -> bool {
    let responses = operation
        .entry(Value::String("responses".into()))
        .or_insert_with(|| Value::Mapping(Mapping::new()));
    let Some(responses) = responses.as_mapping_mut() else {
        return false;
    };
    let (header, header_ref) = &adds.replayed;
    let successes = responses.keys().filter(|k| is_success(k)).count();
    for (key, response) in responses.iter_mut().filter(|(k, _)| is_success(k)) {
        if let Some((_, copy)) = derived.iter().find(|(k, _)| k == key) {
            *response = copy.clone();
        } else if response.get("$ref").is_none() && !has_header(response, header) {
            insert_header(response, header, header_ref.clone());
        }
    }
    for (status, response) in &adds.responses {
        if responses.keys().any(|k| is_status(k, *status)) {
            *kept.entry(*status).or_default() += 1;
        } else {
            responses.insert(Value::String(status.to_string()), response.clone());
        }
    }
    successes > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_stand_for_values_only_a_parameter_matches() {
        assert_eq!(
            concrete_path("/v1/customers/{customer}"),
            "/v1/customers/%7Bcustomer%7D"
        );
        assert_eq!(concrete_path("/a b/é"), "/a%20b/%C3%A9");
        assert!(concrete_path("/files/{name}.{ext}").parse::<Uri>().is_ok());
    }

    #[test]
    fn status_keys_are_strings_or_numbers() {
        assert!(is_status(&Value::String("409".into()), 409));
        assert!(is_status(&Value::Number(409.into()), 409));
        assert!(is_success(&Value::String("2XX".into())));
        assert!(is_success(&Value::Number(201.into())));
        assert!(!is_success(&Value::String("default".into())));
    }
}
