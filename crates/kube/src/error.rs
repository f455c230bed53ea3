//! What stops an injection: input that cannot be read, a field that names
//! nothing, a Service that cannot be rewired without cutting pods off.

use super::pod::FieldError;

/// Input that cannot be read, or a workload whose annotation names no port.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("document {doc} (line {line}): {message}")]
    Yaml {
        doc: usize,
        line: usize,
        message: String,
    },
    #[error("invalid JSON: {0}")]
    Json(String),
    #[error("document {doc} ({what}): {field}.{error}")]
    Field {
        doc: usize,
        what: String,
        field: String,
        error: FieldError,
    },
    #[error(
        "document {doc} (line {line}): the plain value {value:?} is a string to YAML 1.2 but {meaning} \
         to Kubernetes (YAML 1.1); this document is rewritten, so write it as {fix}"
    )]
    Yaml11 {
        doc: usize,
        line: usize,
        value: String,
        meaning: &'static str,
        fix: &'static str,
    },
    #[error("document {doc} ({service}): {message}")]
    SharedService {
        doc: String,
        service: String,
        message: String,
    },
    #[error(
        "document {doc} ({service}): it selects the pods of {owner}, which inject does not \
         inject; rewired to the proxy's port it would cut them off: leave its workloads out \
         with --only or --selector, or give them a Service of their own"
    )]
    ForeignPods {
        doc: String,
        service: String,
        owner: String,
    },
    #[error("{0}")]
    Selection(String),
    #[error("cannot write document {doc}: {message}")]
    Write { doc: usize, message: String },
}
