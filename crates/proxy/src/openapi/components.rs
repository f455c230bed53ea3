//! What `annotate` adds under `components`: one problem schema, the key
//! parameter, the `Idempotent-Replayed` and `Retry-After` headers, and one
//! response per status the proxy answers with, written for the document's
//! OpenAPI version. Each is added once, under a name the document does not
//! use yet, and referenced from the operations.

use std::time::Duration;

use http::HeaderName;
use serde_norway::{Mapping, Value};

use super::{Document, Version};
use crate::key::KeyError;
use crate::policy::{KeyMode, KeySource, Policy};
use crate::problem::Problem;

/// The sections of `components` this module writes, in the order they are written.
const SECTIONS: [&str; 4] = ["schemas", "parameters", "headers", "responses"];

/// The components added so far, and the names the document already uses.
pub(crate) struct Components {
    version: Version,
    taken: Vec<(&'static str, Vec<String>)>,
    added: Vec<(&'static str, String, Value)>,
}

/// What one route's operations get: references into `components`.
#[derive(Clone, Debug)]
pub(crate) struct Additions {
    /// The key's header and the parameter that describes it (none for a key in the body).
    pub parameter: Option<(String, Value)>,
    /// Status → response, in the order written.
    pub responses: Vec<(u16, Value)>,
    /// The replay header's name, and the header object that describes it.
    pub replayed: (String, Value),
}

/// A mapping from pairs, in their order.
pub(crate) fn obj<const N: usize>(pairs: [(&str, Value); N]) -> Value {
    let mut m = Mapping::with_capacity(N);
    for (k, v) in pairs {
        m.insert(Value::String(k.to_string()), v);
    }
    Value::Mapping(m)
}

fn s(text: &str) -> Value {
    Value::String(text.to_string())
}

/// A local reference.
pub fn reference(section: &str, name: &str) -> Value {
    obj([("$ref", s(&format!("#/components/{section}/{name}")))])
}

/// A header's name as written in documents: `Idempotency-Key`, `X-Request-Id`.
pub fn display(name: &HeaderName) -> String {
    name.as_str()
        .split('-')
        .map(|part| {
            let mut chars = part.chars();
            match chars.next() {
                Some(first) => first.to_ascii_uppercase().to_string() + chars.as_str(),
                None => String::new(),
            }
        })
        .collect::<Vec<_>>()
        .join("-")
}

impl Components {
    pub fn new(doc: &Document) -> Components {
        let existing = doc.root.get("components");
        let taken = SECTIONS
            .iter()
            .map(|&section| {
                let names = existing
                    .and_then(|c| c.get(section))
                    .and_then(Value::as_mapping)
                    .map(|m| m.keys().filter_map(Value::as_str).map(str::to_string))
                    .into_iter()
                    .flatten()
                    .collect();
                (section, names)
            })
            .collect();
        Components {
            version: doc.version,
            taken,
            added: Vec::new(),
        }
    }

    /// Adds `value` under `base` (or `base2`, `base3`, ... when the name is
    /// used), or finds it added already; returns a reference to it.
    pub fn add(&mut self, section: &'static str, base: &str, value: Value) -> Value {
        if let Some((_, name, _)) = self
            .added
            .iter()
            .find(|(sec, _, v)| *sec == section && *v == value)
        {
            return reference(section, name);
        }
        let used = |name: &str| {
            self.taken
                .iter()
                .any(|(sec, names)| *sec == section && names.iter().any(|n| n == name))
                || self
                    .added
                    .iter()
                    .any(|(sec, n, _)| *sec == section && n == name)
        };
        let mut name = base.to_string();
        let mut n = 2;
        while used(&name) {
            name = format!("{base}{n}");
            n += 1;
        }
        self.added.push((section, name.clone(), value));
        reference(section, &name)
    }

    /// Writes what was added into the document's `components` (made if absent).
    pub(crate) fn write_into(self, root: &mut Value) {
        let Some(root) = root.as_mapping_mut() else {
            return;
        };
        if self.added.is_empty() {
            return;
        }
        let components = root
            .entry(s("components"))
            .or_insert_with(|| Value::Mapping(Mapping::new()));
        if !components.is_mapping() {
            *components = Value::Mapping(Mapping::new());
        }
        let Some(components) = components.as_mapping_mut() else {
            return;
        };
        for section in SECTIONS {
            for (_, name, value) in self.added.iter().filter(|(sec, _, _)| *sec == section) {
                let entries = components
                    .entry(s(section))
                    .or_insert_with(|| Value::Mapping(Mapping::new()));
                if let Some(entries) = entries.as_mapping_mut() {
                    entries.insert(s(name), value.clone());
                }
            }
        }
    }

    /// The references one route's policy needs.
    pub(crate) fn for_policy(&mut self, policy: &Policy) -> Additions {
        let problem = self.add("schemas", "IdempotencyProblem", self.problem_schema());
        let retry_after = self.add("headers", "IdempotencyRetryAfter", retry_after_header());
        let replayed = self.add("headers", "IdempotentReplayed", self.replayed_header());
        let replayed_name = display(&policy.replayed_header);
        let parameter = match &policy.key_from {
            KeySource::Header(name) => {
                let base = match policy.key {
                    KeyMode::Required => "IdempotencyKey",
                    KeyMode::Optional => "IdempotencyKeyOptional",
                };
                let value = key_parameter(name, policy);
                Some((display(name), self.add("parameters", base, value)))
            }
            KeySource::Json(_) => None,
        };
        let mut responses = Vec::new();
        for (status, base, problems) in problems(policy) {
            let mut headers = Vec::new();
            if problems.iter().any(|p| p.retry_after().is_some()) {
                headers.push(("Retry-After".to_string(), retry_after.clone()));
            }
            if matches!(problems[0], Problem::NotStored) {
                headers.push((replayed_name.clone(), replayed.clone()));
            }
            let value = self.response(status, &problems, &problem, headers);
            responses.push((status, self.add("responses", base, value)));
        }
        Additions {
            parameter,
            responses,
            replayed: (replayed_name, replayed),
        }
    }

    /// One value the schema allows: `examples: [v]` in 3.1, `example: v` in 3.0.
    fn example(&self, v: &str) -> (&'static str, Value) {
        match self.version {
            Version::V3_0 => ("example", s(v)),
            Version::V3_1 => ("examples", Value::Sequence(vec![s(v)])),
        }
    }

    /// Exactly these values: `const` for one in 3.1, `enum` otherwise.
    fn only(&self, ty: &str, values: Vec<Value>) -> Value {
        match (self.version, values.as_slice()) {
            (Version::V3_1, [one]) => obj([("type", s(ty)), ("const", one.clone())]),
            _ => obj([("type", s(ty)), ("enum", Value::Sequence(values))]),
        }
    }

    fn problem_schema(&self) -> Value {
        let string = |description: &str, example: Option<(&'static str, Value)>| {
            let mut m = Mapping::new();
            m.insert(s("type"), s("string"));
            m.insert(s("description"), s(description));
            if let Some((k, v)) = example {
                m.insert(s(k), v);
            }
            Value::Mapping(m)
        };
        let properties = obj([
            (
                "type",
                string(
                    "A short, stable name of the problem (a relative URI reference).",
                    Some(self.example("idempotency-key-reused")),
                ),
            ),
            ("title", string("A short summary of the problem.", None)),
            (
                "status",
                obj([
                    ("type", s("integer")),
                    ("description", s("The HTTP status of the answer.")),
                ]),
            ),
            (
                "detail",
                string("What happened, and what the client can do.", None),
            ),
            (
                "instance",
                string(
                    "urn:uuid: and the request id, the id in the proxy's log line.",
                    Some(self.example("urn:uuid:7905d610-cf39-462a-9212-f20203215485")),
                ),
            ),
            (
                "retryable",
                obj([
                    ("type", s("boolean")),
                    (
                        "description",
                        s("Whether sending the same request again may succeed."),
                    ),
                ]),
            ),
            (
                "idempotency_key",
                obj([
                    ("type", s("object")),
                    (
                        "description",
                        s("On a 400 about the key: where the proxy looked for it."),
                    ),
                    (
                        "properties",
                        obj([
                            ("header", obj([("type", s("string"))])),
                            ("json_pointer", obj([("type", s("string"))])),
                        ]),
                    ),
                ]),
            ),
        ]);
        let required = ["type", "title", "status", "detail", "instance", "retryable"];
        obj([
            ("type", s("object")),
            ("description", s("An answer the idempotency proxy (idemproxy) makes itself: RFC 9457 problem details, sent with Cache-Control: no-store.")),
            ("required", Value::Sequence(required.iter().map(|r| s(r)).collect())),
            ("properties", properties),
        ])
    }

    fn replayed_header(&self) -> Value {
        obj([
            ("description", s("\"true\" on an answer the idempotency proxy replayed from its record of the first request with this key: status, headers and body as the first answer had them.")),
            ("schema", self.only("string", vec![s("true")])),
        ])
    }

    fn response(
        &self,
        status: u16,
        problems: &[Problem],
        schema: &Value,
        headers: Vec<(String, Value)>,
    ) -> Value {
        let kinds: Vec<Value> = problems.iter().map(|p| s(p.kind())).collect();
        let narrowed = obj([
            ("type", s("object")),
            (
                "properties",
                obj([
                    ("type", self.only("string", kinds.clone())),
                    (
                        "status",
                        self.only("integer", vec![Value::Number(status.into())]),
                    ),
                ]),
            ),
        ]);
        let mut examples = Mapping::new();
        for p in problems {
            let (_, _, body) = p.render(&uuid::Uuid::nil());
            let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let title = value.get("title").cloned().unwrap_or(Value::Null);
            examples.insert(s(p.kind()), obj([("summary", title), ("value", value)]));
        }
        let media = obj([
            (
                "schema",
                obj([("allOf", Value::Sequence(vec![schema.clone(), narrowed]))]),
            ),
            ("examples", Value::Mapping(examples)),
        ]);
        let kinds: Vec<&str> = problems.iter().map(|p| p.kind()).collect();
        let description = format!("{} ({}).", summary(status), kinds.join(", "));
        let mut m = Mapping::new();
        m.insert(s("description"), s(&description));
        if !headers.is_empty() {
            let mut h = Mapping::new();
            for (name, value) in headers {
                h.insert(s(&name), value);
            }
            m.insert(s("headers"), Value::Mapping(h));
        }
        m.insert(s("content"), obj([("application/problem+json", media)]));
        Value::Mapping(m)
    }
}

fn retry_after_header() -> Value {
    obj([
        (
            "description",
            s("When to try again, in whole seconds (at least 1)."),
        ),
        (
            "schema",
            obj([("type", s("integer")), ("minimum", Value::Number(1.into()))]),
        ),
    ])
}

fn key_parameter(name: &HeaderName, policy: &Policy) -> Value {
    let required = policy.key == KeyMode::Required;
    let max = policy.max_key_length;
    let without = if required {
        "Required: a request without it is refused (400 idempotency-key-missing)."
    } else {
        "Optional: a request without it is forwarded unprotected; an invalid one is refused (400)."
    };
    let description = format!(
        "A unique key per intended operation, the same for every retry of it \
         (draft-ietf-httpapi-idempotency-key-header): a retry gets the first answer replayed. \
         {without} An RFC 8941 sf-string or a token of visible ASCII (a UUID is fine), \
         at most {max} characters (of the key: an sf-string's quotes are not counted)."
    );
    obj([
        ("name", s(&display(name))),
        ("in", s("header")),
        ("description", s(&description)),
        ("required", Value::Bool(required)),
        (
            "schema",
            obj([
                ("type", s("string")),
                ("minLength", Value::Number(1.into())),
                ("maxLength", Value::Number((max as u64).into())),
            ]),
        ),
        ("example", s("8e03978e-40d5-43e8-bc93-6894a57f9324")),
    ])
}

/// What each status is, for the responses' descriptions.
fn summary(status: u16) -> &'static str {
    match status {
        400 => "Answered by the idempotency proxy: the idempotency key is missing or invalid, or the request could not be read; nothing was executed",
        409 => "Answered by the idempotency proxy: a request with this idempotency key is still being processed; retry with the same key after Retry-After seconds",
        410 => "Answered by the idempotency proxy: the operation was executed, but its response was too large to keep, so it cannot be replayed; it will not be executed again",
        422 => "Answered by the idempotency proxy: this idempotency key was used with a different request; use a new key for a new operation",
        _ => "Answered by the idempotency proxy: its store is unavailable or it is busy; nothing was executed: retry after Retry-After seconds",
    }
}

/// The proxy's own answers on a protected route, by status, with a base
/// name for each response (docs/reference/behaviour.md#problems).
fn problems(policy: &Policy) -> Vec<(u16, &'static str, Vec<Problem>)> {
    let from = policy.key_from.clone();
    let max = policy.max_key_length;
    let mut bad = Vec::new();
    if policy.key == KeyMode::Required {
        bad.push(Problem::MissingKey { from: from.clone() });
    }
    bad.push(Problem::InvalidKey {
        from,
        why: KeyError::TooLong { len: max + 1, max },
    });
    bad.extend([Problem::BodyUnreadable, Problem::PathNotAccepted]);
    let bad_name = match policy.key {
        KeyMode::Required => "IdempotencyBadRequest",
        KeyMode::Optional => "IdempotencyBadRequestOptional",
    };
    vec![
        (400, bad_name, bad),
        (
            409,
            "IdempotencyConflict",
            vec![Problem::Conflict {
                retry_after: Duration::from_secs(1),
            }],
        ),
        (410, "IdempotencyNotStored", vec![Problem::NotStored]),
        (422, "IdempotencyKeyReused", vec![Problem::Mismatch]),
        (
            503,
            "IdempotencyUnavailable",
            vec![Problem::StoreUnavailable, Problem::ProxyBusy],
        ),
    ]
}
