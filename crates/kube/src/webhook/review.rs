//! One AdmissionReview read and answered: the fields it needs, the Pod
//! injected, the patch and the warning.

use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};

use super::patch::{self, TooLarge, MAX_PATCH_BYTES};
use super::{count, Scope, Shared, MAX_REVIEW_NODES, MAX_WARNING_CHARS};
use crate::pod::{inject_pod, Injection, INJECT_ANNOTATION};

/// A Pod of more JSON values than this is answered with its spec replaced
/// whole, not field by field ([`decide`]).
pub(crate) const FINE_PATCH_NODES: usize = 5_000;

/// The longest `request.uid` answered (the API server's are UUIDs, 36 bytes).
pub(crate) const MAX_UID_BYTES: usize = 128;
/// The longest `apiVersion` answered (`admission.k8s.io/v1` is 20 bytes).
pub(crate) const MAX_API_VERSION_BYTES: usize = 64;

/// The fields of an AdmissionReview the injector reads; serde skips the
/// others without keeping them. `O` is the Pod: a `Value`, or nothing at all.
#[derive(Deserialize)]
struct Review<O> {
    #[serde(rename = "apiVersion")]
    api_version: Option<String>,
    request: Option<ReviewRequest<O>>,
}

#[derive(Deserialize)]
struct ReviewRequest<O> {
    uid: Option<String>,
    kind: Option<Kind>,
    operation: Option<String>,
    namespace: Option<String>,
    object: Option<O>,
}

#[derive(Deserialize)]
struct Kind {
    kind: Option<String>,
}

/// An upper bound on the JSON values and keys in `body`: the `{`, `[`, `,`
/// and `:` outside strings, plus one. No allocation, one pass.
fn json_nodes(body: &[u8]) -> usize {
    let (mut n, mut in_string, mut escaped) = (1, false, false);
    for &b in body {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else {
            match b {
                b'"' => in_string = true,
                b'{' | b'[' | b',' | b':' => n += 1,
                _ => {}
            }
        }
    }
    n
}

/// A warning for `kubectl` (one line, printable, short).
fn warning(message: &str) -> String {
    let mut w = String::from("idemproxy: the sidecar was not added: ");
    for c in message.chars() {
        if w.chars().count() >= MAX_WARNING_CHARS {
            w.push('…');
            break;
        }
        w.push(if c.is_control() { ' ' } else { c });
    }
    w
}

/// The AdmissionReview answer, serialised; `Err` only when there is no
/// review to answer (no uid, or a uid or apiVersion too long to be one).
pub(super) fn review(shared: &Shared, body: &[u8], scope: Scope) -> Result<Vec<u8>, String> {
    let nodes = json_nodes(body);
    let (api_version, uid, decision) = if nodes > MAX_REVIEW_NODES {
        let (api_version, uid, request) = read::<IgnoredAny>(body)?;
        tracing::warn!(
            namespace = request.namespace.as_deref().unwrap_or(""),
            nodes,
            limit = MAX_REVIEW_NODES,
            "review too large to read; allowed unchanged"
        );
        let message = format!(
            "the review holds more than {MAX_REVIEW_NODES} JSON values, more than the injector reads"
        );
        (api_version, uid, Decision::warned("too_large", &message))
    } else if nodes > FINE_PATCH_NODES {
        let (api_version, uid, request) = read::<serde_norway::Value>(body)?;
        let (request, object) = request.split();
        (
            api_version,
            uid,
            decide(shared, &request, object.map(Pod::Large), scope),
        )
    } else {
        let (api_version, uid, request) = read::<serde_json::Value>(body)?;
        let (request, object) = request.split();
        (
            api_version,
            uid,
            decide(shared, &request, object.map(Pod::Small), scope),
        )
    };
    count(shared, decision.outcome);
    let answer = Answer {
        api_version: &api_version,
        kind: "AdmissionReview",
        response: AnswerResponse {
            uid: &uid,
            allowed: true,
            patch_type: decision.patch.as_ref().map(|_| "JSONPatch"),
            patch: decision.patch.as_deref().map(Base64),
            warnings: decision.warning.as_deref().map(|w| [w]),
        },
    };
    let size = decision
        .patch
        .as_ref()
        .map_or(0, |p| p.len().div_ceil(3) * 4);
    let mut out = Vec::with_capacity(size + 512);
    serde_json::to_writer(&mut out, &answer)
        .map_err(|e| format!("cannot write the answer: {e}"))?;
    Ok(out)
}

/// The review in `body`, its Pod read as an `O`; the apiVersion and uid
/// the answer repeats.
fn read<O: serde::de::DeserializeOwned>(
    body: &[u8],
) -> Result<(String, String, ReviewRequest<O>), String> {
    let review: Review<O> =
        serde_json::from_slice(body).map_err(|e| format!("not an AdmissionReview: {e}"))?;
    let mut request = review.request.ok_or("not an AdmissionReview: no request")?;
    let (api_version, uid) = echoed(review.api_version, request.uid.take())?;
    Ok((api_version, uid, request))
}

impl<O> ReviewRequest<O> {
    /// The request without its Pod, and the Pod.
    fn split(mut self) -> (ReviewRequest<()>, Option<O>) {
        let object = self.object.take();
        let rest = ReviewRequest {
            uid: None,
            kind: self.kind,
            operation: self.operation,
            namespace: self.namespace,
            object: None,
        };
        (rest, object)
    }
}

/// The Pod of a review, as read: a small one as JSON, to be diffed field by
/// field against what it becomes; a large one (more than
/// [`FINE_PATCH_NODES`] values) as the YAML tree the injection works on, so
/// that one tree of it is held at a time (about 500 bytes a value), and its
/// spec is replaced whole.
enum Pod {
    Small(serde_json::Value),
    Large(serde_norway::Value),
}

impl Pod {
    fn metadata_str(&self, keys: &[&str]) -> Option<String> {
        match self {
            Pod::Small(v) => {
                let mut v = v.get("metadata")?;
                for k in keys {
                    v = v.get(k)?;
                }
                v.as_str().map(str::to_owned)
            }
            Pod::Large(v) => {
                let mut v = v.get("metadata")?;
                for k in keys {
                    v = v.get(k)?;
                }
                v.as_str().map(str::to_owned)
            }
        }
    }
}

/// The apiVersion and uid the answer repeats, checked for length: an answer
/// is not made larger by what the review chose to put there.
fn echoed(api_version: Option<String>, uid: Option<String>) -> Result<(String, String), String> {
    let uid = uid.ok_or("not an AdmissionReview: no request.uid")?;
    if uid.len() > MAX_UID_BYTES {
        return Err(format!(
            "not an AdmissionReview: a request.uid of {} bytes (a UID has 36)",
            uid.len()
        ));
    }
    let api_version = api_version.unwrap_or_else(|| "admission.k8s.io/v1".into());
    if api_version.len() > MAX_API_VERSION_BYTES {
        return Err(format!(
            "not an AdmissionReview: an apiVersion of {} bytes",
            api_version.len()
        ));
    }
    Ok((api_version, uid))
}

/// The AdmissionReview answered, serialised as it is written: the patch is
/// encoded into the answer, not into a string of its own first.
#[derive(Serialize)]
struct Answer<'a> {
    #[serde(rename = "apiVersion")]
    api_version: &'a str,
    kind: &'static str,
    response: AnswerResponse<'a>,
}

#[derive(Serialize)]
struct AnswerResponse<'a> {
    uid: &'a str,
    allowed: bool,
    #[serde(rename = "patchType", skip_serializing_if = "Option::is_none")]
    patch_type: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch: Option<Base64<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    warnings: Option<[&'a str; 1]>,
}

/// Bytes as standard base64, written straight into the answer.
struct Base64<'a>(&'a [u8]);

impl Serialize for Base64<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&base64::display::Base64Display::new(
            self.0,
            &base64::engine::general_purpose::STANDARD,
        ))
    }
}

/// What the injector makes of one review.
struct Decision {
    /// The `idemproxy_injector_reviews_total` label.
    outcome: &'static str,
    patch: Option<Vec<u8>>,
    /// For a Pod that asked for the sidecar and did not get it.
    warning: Option<String>,
}

impl Decision {
    fn quiet(outcome: &'static str) -> Decision {
        Decision {
            outcome,
            patch: None,
            warning: None,
        }
    }

    fn warned(outcome: &'static str, message: &str) -> Decision {
        Decision {
            outcome,
            patch: None,
            warning: Some(warning(message)),
        }
    }
}

/// Injects the review's Pod if it is selected; the patch, and a warning when
/// a Pod that asked for the sidecar cannot have it.
fn decide(
    shared: &Shared,
    request: &ReviewRequest<()>,
    object: Option<Pod>,
    scope: Scope,
) -> Decision {
    let name = |key| object.as_ref()?.metadata_str(&[key]);
    // For the log: no longer than Kubernetes allows a name to be.
    let pod_name: String = name("name")
        .or_else(|| name("generateName"))
        .unwrap_or_default()
        .chars()
        .take(253)
        .collect();
    let namespace: String = request
        .namespace
        .clone()
        .unwrap_or_default()
        .chars()
        .take(63)
        .collect();
    let kind = request.kind.as_ref().and_then(|k| k.kind.as_deref());
    if kind != Some("Pod") || request.operation.as_deref() != Some("CREATE") {
        return Decision::quiet("not_selected");
    }
    let Some(object) = object else {
        tracing::warn!(%namespace, "admission review without an object; allowed unchanged");
        return Decision::quiet("failed");
    };
    let annotation = object.metadata_str(&["annotations", INJECT_ANNOTATION]);
    if scope == Scope::Annotated && annotation.as_deref() != Some("enabled") {
        return Decision::quiet("not_selected");
    }
    let (before, mut pod) = match object {
        Pod::Large(pod) => (None, pod),
        Pod::Small(object) => match serde_norway::to_value(&object) {
            Ok(pod) => (Some(object), pod),
            Err(e) => {
                let error = warning(&e.to_string());
                tracing::warn!(%namespace, pod = %pod_name, %error, "cannot read the pod; allowed unchanged");
                return Decision::warned("failed", &format!("cannot read the pod: {e}"));
            }
        },
    };
    match inject_pod(&mut pod, None, &[], &shared.settings) {
        Ok(Injection::Injected(change)) => match made_patch(before.as_ref(), pod) {
            Ok(bytes) => {
                tracing::info!(%namespace, pod = %pod_name, app_port = change.app_port, proxy_port = change.proxy_port, "sidecar injected");
                Decision {
                    outcome: "injected",
                    patch: Some(bytes),
                    warning: None,
                }
            }
            Err(Unmade::TooLarge(bytes)) => {
                tracing::warn!(%namespace, pod = %pod_name, bytes, limit = MAX_PATCH_BYTES, "the patch would be too large; allowed unchanged");
                let message = format!("the patch would be over {MAX_PATCH_BYTES} bytes");
                Decision::warned("too_large", &message)
            }
            Err(Unmade::Unwritable(e)) => {
                tracing::warn!(%namespace, pod = %pod_name, error = %e, "cannot write the pod; allowed unchanged");
                Decision::warned("failed", &format!("cannot write the pod: {e}"))
            }
        },
        Ok(Injection::AlreadyInjected) => Decision::quiet("already_injected"),
        Ok(Injection::Refused(reason)) => {
            // The sidecar would make the pod invalid: said whoever asked.
            tracing::warn!(%namespace, pod = %pod_name, %reason, "pod left as it was");
            Decision::warned("skipped", &reason)
        }
        Ok(Injection::Skipped(reason)) => {
            tracing::info!(%namespace, pod = %pod_name, %reason, "pod left as it was");
            // A Pod that asked by its annotation is told; one that only sits in
            // an injected namespace (a Redis, say) is not.
            if annotation.as_deref() == Some("enabled") {
                Decision::warned("skipped", &reason)
            } else {
                Decision::quiet("skipped")
            }
        }
        Err(e) => {
            // The message can quote the pod (an annotation's value): the log gets what the warning gets.
            let error = warning(&e.to_string());
            tracing::warn!(%namespace, pod = %pod_name, %error, "cannot inject; allowed unchanged");
            Decision::warned("failed", &e.to_string())
        }
    }
}

/// Why an injected Pod has no patch.
enum Unmade {
    TooLarge(usize),
    Unwritable(String),
}

/// The patch from `before` to the injected `pod`, field by field; without
/// `before` (a large Pod), the replacement of its spec, written straight
/// from the YAML tree.
fn made_patch(
    before: Option<&serde_json::Value>,
    mut pod: serde_norway::Value,
) -> Result<Vec<u8>, Unmade> {
    let too_large = |TooLarge(n)| Unmade::TooLarge(n);
    match before {
        Some(before) => {
            // By value: the YAML tree's strings move into the JSON one.
            let after = serde_json::Value::deserialize(pod)
                .map_err(|e| Unmade::Unwritable(e.to_string()))?;
            patch::patch(before, &after).map_err(too_large)
        }
        None => {
            let spec = pod.get_mut("spec").map(std::mem::take).unwrap_or_default();
            drop(pod);
            patch::replace_spec(&spec).map_err(too_large)
        }
    }
}
