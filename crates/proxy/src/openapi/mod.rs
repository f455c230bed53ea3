//! OpenAPI documents in, configuration or documents out: `idemproxy openapi routes` and
//! `idemproxy openapi annotate` (docs/openapi.md).
//!
//! [`routes`] writes the `[[routes]]` that protect a document's operations
//! (those marked `x-idempotency-key: required|optional`, or every POST and
//! PATCH); [`annotate`] writes the document back with what the proxy adds to
//! each operation a configuration protects, judged by the proxy's own route
//! table. A document is read as JSON or YAML into one ordered tree
//! (serde_norway's `Value`, whose mappings keep their order), and written
//! back in the format it came in: JSON through serde_json, YAML through the
//! emitter `idemproxy inject` uses, which YAML 1.1 readers read alike.

use std::path::Path;

use serde_norway::{Mapping, Value};

use crate::config::{Config, ConfigError, Overrides};

pub(crate) mod annotate;
mod components;
pub mod routes;

/// Why a command could not write its output (exit status 2).
#[derive(Debug, thiserror::Error)]
pub enum OpenapiError {
    #[error("cannot read {what}: {source}")]
    Read {
        what: String,
        source: std::io::Error,
    },
    /// Neither JSON nor YAML, or not a mapping at the top.
    #[error("{what}: not a JSON or YAML document: {message}")]
    Syntax { what: String, message: String },
    /// A Swagger 2.0 document, or no `openapi` field, or another version.
    #[error("{what}: {message}")]
    NotOpenapi { what: String, message: String },
    /// An `x-idempotency-key` that says neither `required` nor `optional`.
    #[error("{what}: {message}")]
    Invalid { what: String, message: String },
    /// Nothing to write: no operation selected, or none protected.
    #[error("{what}: {message}")]
    Nothing { what: String, message: String },
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("cannot write the document: {0}")]
    Write(String),
}

/// The format a document came in, and goes out in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Json,
    Yaml,
}

/// The OpenAPI versions read; what `annotate` writes differs between them
/// (schema keywords such as `examples` and `const`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    V3_0,
    V3_1,
}

/// The HTTP methods an OpenAPI path item may hold operations for.
pub const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// A parsed OpenAPI document.
#[derive(Clone, Debug)]
pub struct Document {
    /// Where it came from, for messages (a path, or "standard input").
    pub what: String,
    pub format: Format,
    pub version: Version,
    /// The `openapi` field as written (`3.0.3`).
    pub version_text: String,
    pub root: Value,
}

/// One operation: a method of a path item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operation {
    /// The path template as the document writes it (`/v1/customers/{customer}`).
    pub path: String,
    /// Lower case, as the document writes it (`post`).
    pub method: String,
}

impl Operation {
    /// `POST /v1/customers`.
    pub fn label(&self) -> String {
        format!("{} {}", self.method.to_ascii_uppercase(), self.path)
    }
}

impl Document {
    /// Reads a document from a file, or standard input for `-`.
    pub fn read(path: &Path) -> Result<Document, OpenapiError> {
        let (what, text) = if path.as_os_str() == "-" {
            let what = "standard input".to_string();
            (what, read_capped(std::io::stdin()))
        } else {
            let text = std::fs::File::open(path).and_then(read_capped);
            (path.display().to_string(), text)
        };
        let text = text.map_err(|source| OpenapiError::Read {
            what: what.clone(),
            source,
        })?;
        Document::parse(&text, &what)
    }

    /// JSON when the text starts with `{` or `[`, YAML otherwise; then the version.
    /// Text over [`MAX_BYTES`], or YAML nested deeper than [`MAX_DEPTH`], is refused
    /// before it is parsed.
    pub fn parse(text: &str, what: &str) -> Result<Document, OpenapiError> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let syntax = |message: String| OpenapiError::Syntax {
            what: what.to_string(),
            message,
        };
        if text.len() > MAX_BYTES {
            return Err(syntax(too_large()));
        }
        let (format, root) = if text.trim_start().starts_with(['{', '[']) {
            // JSON, read by serde_json alone (its nesting limit, in linear time).
            let root = serde_json::from_str::<Value>(text).map_err(|e| syntax(e.to_string()))?;
            (Format::Json, root)
        } else {
            (Format::Yaml, yaml(text).map_err(syntax)?)
        };
        if !root.is_mapping() {
            return Err(syntax("the document is not a mapping (an object)".into()));
        }
        let (version, version_text) =
            version_of(&root).map_err(|message| OpenapiError::NotOpenapi {
                what: what.to_string(),
                message,
            })?;
        Ok(Document {
            what: what.to_string(),
            format,
            version,
            version_text,
            root,
        })
    }

    /// The document in the format it came in, ending with a newline.
    pub(crate) fn render(&self) -> Result<String, OpenapiError> {
        match self.format {
            Format::Json => {
                let mut text = serde_json::to_string_pretty(&self.root)
                    .map_err(|e| OpenapiError::Write(e.to_string()))?;
                text.push('\n');
                Ok(text)
            }
            Format::Yaml => Ok(crate::yaml::to_yaml(&self.root)),
        }
    }

    /// Every operation, in the document's order (paths, then methods as each path item writes them).
    pub fn operations(&self) -> Vec<Operation> {
        let mut found = Vec::new();
        let Some(paths) = self.root.get("paths").and_then(Value::as_mapping) else {
            return found;
        };
        for (path, item) in paths {
            let (Some(path), Some(item)) = (path.as_str(), item.as_mapping()) else {
                continue;
            };
            for (method, op) in item {
                let Some(method) = method.as_str().filter(|m| METHODS.contains(m)) else {
                    continue;
                };
                if op.is_mapping() {
                    found.push(Operation {
                        path: path.to_string(),
                        method: method.to_string(),
                    });
                }
            }
        }
        found
    }

    /// The operation object of `op`.
    pub fn operation(&self, op: &Operation) -> Option<&Mapping> {
        self.root
            .get("paths")?
            .get(op.path.as_str())?
            .get(op.method.as_str())?
            .as_mapping()
    }

    /// The operation object of `op`, to change.
    pub(crate) fn operation_mut(&mut self, op: &Operation) -> Option<&mut Mapping> {
        self.root
            .get_mut("paths")?
            .get_mut(op.path.as_str())?
            .get_mut(op.method.as_str())?
            .as_mapping_mut()
    }

    /// What a local `$ref` (`#/components/...`) points at, followed through
    /// further references (at most a few, so that a loop ends); any other value as it is.
    pub fn resolve<'a>(&'a self, value: &'a Value) -> Option<&'a Value> {
        let mut value = value;
        for _ in 0..8 {
            let Some(reference) = value.get("$ref").and_then(Value::as_str) else {
                return Some(value);
            };
            value = self.pointer(reference)?;
        }
        None
    }

    /// The value at a local reference (`#/a/b~1c`), if there is one.
    pub fn pointer(&self, reference: &str) -> Option<&Value> {
        let path = reference.strip_prefix("#/")?;
        let mut value = &self.root;
        for token in path.split('/') {
            let token = token.replace("~1", "/").replace("~0", "~");
            value = match value {
                Value::Mapping(m) => m.get(token.as_str())?,
                Value::Sequence(s) => s.get(token.parse::<usize>().ok()?)?,
                _ => return None,
            };
        }
        Some(value)
    }
}

/// The most a document may hold: the largest real descriptions are about 13 MB.
pub(crate) const MAX_BYTES: usize = 64 << 20;

/// The deepest a YAML document may nest, by a scan of its flow brackets and
/// indentation before the parser sees it: the YAML parser takes time growing
/// with the square of the depth, and its reader refuses more than 128 levels
/// anyway. Real descriptions nest about 20 levels.
pub const MAX_DEPTH: usize = 1_000;

fn too_large() -> String {
    format!("over {} MiB: not read", MAX_BYTES >> 20)
}

/// At most [`MAX_BYTES`] and one more byte of `source`, as text.
fn read_capped(source: impl std::io::Read) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    source
        .take(MAX_BYTES as u64 + 1)
        .read_to_string(&mut text)?;
    if text.len() > MAX_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            too_large(),
        ));
    }
    Ok(text)
}

/// A YAML document, once [`nesting`] says it is not too deep to parse.
fn yaml(text: &str) -> Result<Value, String> {
    let depth = nesting(text);
    if depth > MAX_DEPTH {
        return Err(format!(
            "nested {depth} levels deep or more, over the {MAX_DEPTH} read"
        ));
    }
    let mut root = serde_norway::from_str::<Value>(text).map_err(|e| e.to_string())?;
    // `<<: *anchor` merges, as YAML 1.1 readers (and OpenAPI tools) take them.
    root.apply_merge().map_err(|e| e.to_string())?;
    Ok(root)
}

/// An upper bound of a YAML text's nesting, in one pass: the open flow
/// brackets (`[`, `{`; a close never below none) plus a line's indentation,
/// with the `- ` and `? ` indicators that nest on one line. Brackets in
/// scalars count too, which only ever overstates it.
pub(crate) fn nesting(text: &str) -> usize {
    let mut flow = 0usize;
    let mut deepest = 0usize;
    for line in text.lines() {
        let body = line.trim_start_matches([' ', '\t', '-', '?']);
        let indent = line.len() - body.len();
        deepest = deepest.max(flow + indent);
        for b in body.bytes() {
            match b {
                b'[' | b'{' => {
                    flow += 1;
                    deepest = deepest.max(flow + indent);
                }
                b']' | b'}' => flow = flow.saturating_sub(1),
                _ => {}
            }
        }
    }
    deepest
}

/// The version a document declares: 3.0.x or 3.1.x; Swagger 2.0 and the rest are refused.
fn version_of(root: &Value) -> Result<(Version, String), String> {
    if let Some(swagger) = root.get("swagger") {
        let v = scalar_text(swagger);
        return Err(format!(
            "this is a Swagger {v} document (\"swagger\": \"{v}\"); idemproxy reads OpenAPI 3.0 \
             and 3.1 documents: convert it to OpenAPI 3 first"
        ));
    }
    let Some(openapi) = root.get("openapi") else {
        return Err(
            "not an OpenAPI document: it has no \"openapi\" field (OpenAPI 3.0 and 3.1 are read)"
                .to_string(),
        );
    };
    let Some(text) = openapi.as_str() else {
        return Err(format!(
            "the \"openapi\" field is {}, not a string such as \"3.1.0\"",
            scalar_text(openapi)
        ));
    };
    let version = if text == "3.0" || text.starts_with("3.0.") {
        Version::V3_0
    } else if text == "3.1" || text.starts_with("3.1.") {
        Version::V3_1
    } else {
        return Err(format!(
            "OpenAPI {text} is not read: idemproxy reads OpenAPI 3.0 and 3.1 documents"
        ));
    };
    Ok((version, text.to_string()))
}

/// A scalar as text, for messages.
fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => serde_json::to_string(other).unwrap_or_else(|_| "?".into()),
    }
}

/// A configuration as the proxy loads it, but that may leave `[server]
/// upstream` out (the output of `routes` alone is one): only its routes are used.
fn load_config(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let names_upstream = toml::from_str::<toml::Table>(&text)
        .ok()
        .and_then(|t| t.get("server")?.get("upstream").cloned())
        .is_some();
    let overrides = Overrides {
        upstream: (!names_upstream).then(|| "http://127.0.0.1:1".to_string()),
        ..Overrides::default()
    };
    Config::from_toml(&text, &path.display().to_string(), &overrides)
}

/// `1 route`, `2 routes`.
pub fn count(n: usize, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// What a command writes: its output for standard output, and notes for standard error.
#[derive(Clone, Debug, Default)]
pub struct Output {
    pub text: String,
    pub notes: Vec<String>,
}

/// `idemproxy openapi routes [--unsafe-methods] OPENAPI_FILE`.
pub fn run_routes(file: &Path, unsafe_methods: bool) -> Result<Output, OpenapiError> {
    let doc = Document::read(file)?;
    let written = routes::routes(&doc, unsafe_methods)?;
    let mut notes = written.notes;
    notes.push(format!(
        "{}: {}, {} selected, {} written",
        doc.what,
        count(written.operations, "operation"),
        written.selected,
        count(written.routes.len(), "route"),
    ));
    Ok(Output {
        text: written.toml,
        notes,
    })
}

/// `idemproxy openapi annotate --config FILE OPENAPI_FILE`: the configuration is loaded and
/// checked as the proxy loads it.
pub fn run_annotate(config: &Path, file: &Path) -> Result<Output, OpenapiError> {
    let config = load_config(config)?;
    let mut doc = Document::read(file)?;
    let done = annotate::annotate(&mut doc, &config)?;
    let mut notes = done.notes;
    notes.push(format!(
        "{}: {}, {} protected by the routes of {}",
        doc.what,
        count(done.operations, "operation"),
        done.protected.len(),
        config.source
    ));
    Ok(Output {
        text: doc.render()?,
        notes,
    })
}
