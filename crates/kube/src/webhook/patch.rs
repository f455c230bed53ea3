//! The JSON patch (RFC 6902) an answer carries, of a bounded size.
//!
//! Field by field, as `json_patch::diff` makes it, a patch can be far larger
//! than the Pod: the sidecar goes first among the init containers, so every
//! other one shifts by one and each of their differing values becomes an
//! operation with a path of its own (10 000 init containers: 10 000 and more
//! operations); and a path repeats every key above its value (one 100 KB key
//! over 1 000 differing values: 100 MB of paths from a 200 KB review). So
//! the field-by-field patch is made only while it stays no larger than the
//! coarse one (or [`FINE_ANYWAY`]), which replaces each changed top-level
//! field (`/spec`) whole and is about the size of the Pod; and no patch over
//! [`MAX_PATCH_BYTES`] is made at all.

use std::io;

use serde::Serialize;
use serde_json::{Map, Value};

/// The largest patch made: 3 MiB, the largest request the API server takes
/// (a Pod it can store is smaller). A larger one is not made and the Pod is
/// allowed unchanged ([`TooLarge`]).
pub(crate) const MAX_PATCH_BYTES: usize = 3 << 20;

/// A field-by-field patch up to this size is made even when the coarse one
/// would be smaller (an ordinary Pod's is about 3 KiB).
pub(crate) const FINE_ANYWAY: usize = 64 << 10;

/// The patch would have been larger than [`MAX_PATCH_BYTES`] (at least this many bytes).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct TooLarge(pub usize);

#[derive(Serialize)]
struct Op<'a> {
    op: &'static str,
    path: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<&'a Value>,
}

/// Counts what serde_json writes, without keeping it.
struct Count(usize);

impl io::Write for Count {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Operations and the size of their serialised array, made until `limit`.
struct Ops<'a> {
    ops: Vec<Op<'a>>,
    /// Bytes of `[`, `]`, the operations and their commas.
    bytes: usize,
    limit: usize,
}

impl<'a> Ops<'a> {
    fn new(limit: usize) -> Ops<'a> {
        Ops {
            ops: Vec::new(),
            bytes: 2,
            limit,
        }
    }

    /// Adds one operation; `Err` (and nothing kept) once the patch passes the limit.
    fn push(&mut self, op: &'static str, path: &str, value: Option<&'a Value>) -> Result<(), ()> {
        // The path alone can pass it: counted before it is copied.
        if self.bytes + path.len() > self.limit {
            self.bytes += path.len();
            return Err(());
        }
        let op = Op {
            op,
            path: path.to_owned(),
            value,
        };
        let mut count = Count(usize::from(!self.ops.is_empty()));
        serde_json::to_writer(&mut count, &op).map_err(|_| ())?;
        self.bytes += count.0;
        if self.bytes > self.limit {
            return Err(());
        }
        self.ops.push(op);
        Ok(())
    }

    fn to_vec(&self) -> Vec<u8> {
        serde_json::to_vec(&self.ops).unwrap_or_default()
    }
}

/// The patch from `before` to `after` (both the Pod), serialised: field by
/// field when that is no larger than the coarse patch (or [`FINE_ANYWAY`]),
/// else the coarse one; never over [`MAX_PATCH_BYTES`].
pub(super) fn patch(before: &Value, after: &Value) -> Result<Vec<u8>, TooLarge> {
    let mut coarse = Ops::new(usize::MAX);
    top_level(before, after, &mut coarse);
    if coarse.bytes > MAX_PATCH_BYTES {
        return Err(TooLarge(coarse.bytes));
    }
    let mut fine = Ops::new(coarse.bytes.clamp(FINE_ANYWAY, MAX_PATCH_BYTES));
    let mut pointer = String::new();
    match diff(before, after, &mut pointer, &mut fine) {
        Ok(()) => Ok(fine.to_vec()),
        Err(()) => Ok(coarse.to_vec()),
    }
}

/// The coarse patch of a Pod whose spec alone changed: `spec` (any tree
/// that serialises as JSON) replaces it.
pub(super) fn replace_spec(spec: &impl Serialize) -> Result<Vec<u8>, TooLarge> {
    #[derive(Serialize)]
    struct Replace<'a, S> {
        op: &'static str,
        path: &'static str,
        value: &'a S,
    }
    let ops = [Replace {
        op: "replace",
        path: "/spec",
        value: spec,
    }];
    let mut count = Count(0);
    serde_json::to_writer(&mut count, &ops).map_err(|_| TooLarge(0))?;
    if count.0 > MAX_PATCH_BYTES {
        return Err(TooLarge(count.0));
    }
    let mut out = Vec::with_capacity(count.0);
    serde_json::to_writer(&mut out, &ops).map_err(|_| TooLarge(0))?;
    Ok(out)
}

/// One operation per top-level field that differs (the whole document when either is not an object).
fn top_level<'a>(before: &Value, after: &'a Value, ops: &mut Ops<'a>) {
    let (Value::Object(left), Value::Object(right)) = (before, after) else {
        if before != after {
            let _ = ops.push("replace", "", Some(after));
        }
        return;
    };
    for (key, value) in right {
        let path = format!("/{}", escape(key));
        match left.get(key) {
            Some(old) if old == value => {}
            Some(_) => {
                let _ = ops.push("replace", &path, Some(value));
            }
            None => {
                let _ = ops.push("add", &path, Some(value));
            }
        }
    }
    for key in left.keys().filter(|k| !right.contains_key(*k)) {
        let _ = ops.push("remove", &format!("/{}", escape(key)), None);
    }
}

/// A JSON pointer's reference token (RFC 6901): `~` and `/` escaped.
fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// `json_patch::diff`'s operations, in its order, until the limit.
fn diff<'a>(
    left: &Value,
    right: &'a Value,
    pointer: &mut String,
    ops: &mut Ops<'a>,
) -> Result<(), ()> {
    match (left, right) {
        (Value::Object(l), Value::Object(r)) => diff_object(l, r, pointer, ops),
        (Value::Array(l), Value::Array(r)) => diff_array(l, r, pointer, ops),
        _ if left == right => Ok(()),
        _ => ops.push("replace", pointer, Some(right)),
    }
}

fn diff_object<'a>(
    left: &Map<String, Value>,
    right: &'a Map<String, Value>,
    pointer: &mut String,
    ops: &mut Ops<'a>,
) -> Result<(), ()> {
    let depth = pointer.len();
    for (key, value) in right {
        pointer.push('/');
        pointer.push_str(&escape(key));
        match left.get(key) {
            Some(old) => diff(old, value, pointer, ops)?,
            None => ops.push("add", pointer, Some(value))?,
        }
        pointer.truncate(depth);
    }
    for key in left.keys().filter(|k| !right.contains_key(*k)) {
        pointer.push('/');
        pointer.push_str(&escape(key));
        ops.push("remove", pointer, None)?;
        pointer.truncate(depth);
    }
    Ok(())
}

fn diff_array<'a>(
    left: &[Value],
    right: &'a [Value],
    pointer: &mut String,
    ops: &mut Ops<'a>,
) -> Result<(), ()> {
    let depth = pointer.len();
    let mut shift = 0;
    for idx in 0..left.len().max(right.len()) {
        pointer.push('/');
        pointer.push_str(&(idx - shift).to_string());
        match (left.get(idx), right.get(idx)) {
            (Some(l), Some(r)) => diff(l, r, pointer, ops)?,
            (Some(_), None) => {
                shift += 1;
                ops.push("remove", pointer, None)?;
            }
            (None, Some(r)) => ops.push("add", pointer, Some(r))?,
            (None, None) => {}
        }
        pointer.truncate(depth);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn applied(before: &Value, patch: &[u8]) -> Value {
        let patch: json_patch::Patch = serde_json::from_slice(patch).unwrap();
        let mut doc = before.clone();
        json_patch::patch(&mut doc, &patch).unwrap();
        doc
    }

    #[test]
    fn small_changes_are_json_patch_diff() {
        let before = json!({
            "metadata": {"name": "p", "a/b~c": 1},
            "spec": {"containers": [{"name": "app", "ports": [{"name": "http"}]}], "x": [1, 2, 3]}
        });
        let after = json!({
            "metadata": {"name": "p", "a/b~c": 2},
            "spec": {
                "initContainers": [{"name": "idemproxy"}],
                "containers": [{"name": "app", "ports": [{"name": "http-app"}]}],
                "x": [1],
                "volumes": [{"name": "v"}]
            }
        });
        let ours = patch(&before, &after).unwrap();
        let theirs = serde_json::to_vec(&json_patch::diff(&before, &after)).unwrap();
        assert_eq!(
            String::from_utf8(ours.clone()).unwrap(),
            String::from_utf8(theirs).unwrap()
        );
        assert_eq!(applied(&before, &ours), after);
    }

    #[test]
    fn a_shifted_list_is_replaced_whole() {
        let init: Vec<Value> = (0..1000)
            .map(|i| json!({"name": format!("i{i}"), "image": format!("img{i}")}))
            .collect();
        let before = json!({"metadata": {"name": "p"}, "spec": {"initContainers": init.clone()}});
        let mut shifted = vec![json!({"name": "idemproxy"})];
        shifted.extend(init);
        let after = json!({"metadata": {"name": "p"}, "spec": {"initContainers": shifted}});
        let ours = patch(&before, &after).unwrap();
        let ops: Value = serde_json::from_slice(&ours).unwrap();
        assert_eq!(ops.as_array().unwrap().len(), 1, "{ops}");
        assert_eq!(ops[0]["path"], "/spec");
        let whole = serde_json::to_vec(&after).unwrap().len();
        assert!(ours.len() < whole + 64, "{} {whole}", ours.len());
        let theirs = serde_json::to_vec(&json_patch::diff(&before, &after)).unwrap();
        assert!(theirs.len() > 2 * whole, "{}", theirs.len());
        assert_eq!(applied(&before, &ours), after);
    }

    #[test]
    fn long_paths_cannot_make_it_larger_than_the_pod() {
        let key = "k".repeat(100_000);
        let a: Vec<u8> = (0..1000).map(|i| (i % 2) as u8).collect();
        let b: Vec<u8> = (0..1000).map(|i| ((i + 1) % 2) as u8).collect();
        let before = json!({"spec": {"initContainers": [{&key: a.clone()}, {&key: b}]}});
        let after = json!({"spec": {"initContainers": [{"name": "idemproxy"}, {&key: a.clone()}, {&key: a}]}});
        let ours = patch(&before, &after).unwrap();
        assert!(ours.len() < 250_000, "{}", ours.len());
        let ops: Value = serde_json::from_slice(&ours).unwrap();
        assert_eq!(ops[0]["path"], "/spec", "{}", ops[0]["op"]);
        assert_eq!(applied(&before, &ours), after);
    }

    #[test]
    fn over_the_limit_there_is_no_patch() {
        let before = json!({"spec": {}});
        let after = json!({"spec": {"blob": "x".repeat(MAX_PATCH_BYTES)}});
        assert!(matches!(patch(&before, &after), Err(TooLarge(n)) if n > MAX_PATCH_BYTES));
    }
}
