//! The key (from the `Idempotency-Key` header, another header, or the JSON
//! body), the scope, and the request fingerprint.

use http::{HeaderMap, HeaderName, Method};
use sha2::{Digest, Sha256};

use crate::canonical_json::{self, Pointed};
use crate::policy::{FingerprintBody, KeySource, Pointer};

/// Why a key header was refused (always a 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the key is empty")]
    Empty,
    #[error("the key is {len} characters long; at most {max} are allowed")]
    TooLong { len: usize, max: usize },
    #[error("the header appears more than once; send exactly one key")]
    Repeated,
    #[error("the key is not a valid value: {0}")]
    Syntax(&'static str),
}

/// Why a request has no key to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NoKey {
    /// None was sent: a 400 on required routes, forwarded unprotected on optional ones.
    Missing,
    /// One was sent that cannot be used: always a 400.
    Invalid(KeyError),
}

/// The key as far as the request's headers tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyRead<'p> {
    /// A header carried it.
    Read(String),
    /// It is in the JSON body, at this pointer: read once the body is (its size checked first).
    InBody(&'p Pointer),
}

/// The key of a request whose key a header carries (syntax:
/// docs/reference/behaviour.md#key-syntax; exactly one
/// line); a key in the body is left for [`KeyRead::or_from_body`].
pub(crate) fn from_headers<'p>(
    headers: &HeaderMap,
    source: &'p KeySource,
    max_len: usize,
) -> Result<KeyRead<'p>, NoKey> {
    let name = match source {
        KeySource::Header(name) => name,
        KeySource::Json(pointer) => return Ok(KeyRead::InBody(pointer)),
    };
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (None, _) => Err(NoKey::Missing),
        (Some(_), Some(_)) => Err(NoKey::Invalid(KeyError::Repeated)),
        (Some(v), None) => parse_key(v.as_bytes(), max_len)
            .map(KeyRead::Read)
            .map_err(NoKey::Invalid),
    }
}

impl KeyRead<'_> {
    /// The key: the one read from a header, or the one in the whole `body`.
    pub(crate) fn or_from_body(self, body: &[u8], max_len: usize) -> Result<String, NoKey> {
        match self {
            KeyRead::Read(key) => Ok(key),
            KeyRead::InBody(pointer) => json_key(body, pointer, max_len),
        }
    }
}

/// The key at `pointer` in a JSON body: a string as decoded (any characters:
/// the key is only ever hashed into the record id), or an integer's exact
/// decimal text (`123` and `"123"` are the same key; a number beyond 64 bits
/// keeps its digits). A body that is not JSON read exactly (see
/// [`canonical_json::at_pointer`]), nothing at the pointer, or another type
/// (a fraction, a boolean, null, an array, an object) is a missing key; an
/// empty string, or a key longer than `max_len` characters, an invalid one.
pub(crate) fn json_key(body: &[u8], pointer: &Pointer, max_len: usize) -> Result<String, NoKey> {
    let key = match canonical_json::at_pointer(body, pointer.tokens()) {
        Some(Pointed::Str(s)) => s,
        Some(Pointed::Integer(digits)) => digits,
        Some(Pointed::Other) | None => return Err(NoKey::Missing),
    };
    let len = key.chars().count();
    if len == 0 {
        return Err(NoKey::Invalid(KeyError::Empty));
    }
    if len > max_len {
        return Err(NoKey::Invalid(KeyError::TooLong { len, max: max_len }));
    }
    Ok(key)
}

/// Decodes one header value: `"quoted"` (sf-string, with `\"` and `\\`) or a
/// bare token of visible ASCII without spaces, quotes, commas or semicolons.
/// Both spellings of the same key decode to the same bytes.
pub fn parse_key(raw: &[u8], max_len: usize) -> Result<String, KeyError> {
    let v = trim_ows(raw);
    if v.is_empty() {
        return Err(KeyError::Empty);
    }
    let key = if v[0] == b'"' {
        let mut out = String::with_capacity(v.len());
        let mut i = 1;
        loop {
            let Some(&c) = v.get(i) else {
                return Err(KeyError::Syntax("a quoted key has no closing quote"));
            };
            match c {
                b'\\' => {
                    match v.get(i + 1) {
                        Some(&e @ (b'"' | b'\\')) => out.push(e as char),
                        _ => {
                            return Err(KeyError::Syntax(
                                "only \\\" and \\\\ may be escaped in a quoted key",
                            ))
                        }
                    }
                    i += 2;
                }
                b'"' => {
                    if i + 1 != v.len() {
                        return Err(KeyError::Syntax(
                            "nothing may follow the closing quote (no lists, no parameters)",
                        ));
                    }
                    break;
                }
                0x20..=0x7e => {
                    out.push(c as char);
                    i += 1;
                }
                _ => return Err(KeyError::Syntax("a quoted key holds printable ASCII only")),
            }
        }
        out
    } else {
        for &c in v {
            match c {
                b',' => return Err(KeyError::Syntax("a list of keys is not allowed")),
                b';' => return Err(KeyError::Syntax("parameters are not allowed")),
                b'"' => return Err(KeyError::Syntax("a bare key may not contain quotes")),
                0x21..=0x7e => {}
                _ => return Err(KeyError::Syntax(
                    "a bare key is visible ASCII without spaces; quote it as a string otherwise",
                )),
            }
        }
        // Checked above: every byte is visible ASCII.
        String::from_utf8_lossy(v).into_owned()
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > max_len {
        return Err(KeyError::TooLong {
            len: key.len(),
            max: max_len,
        });
    }
    Ok(key)
}

fn trim_ows(v: &[u8]) -> &[u8] {
    let start = v
        .iter()
        .position(|&b| b != b' ' && b != b'\t')
        .unwrap_or(v.len());
    let end = v
        .iter()
        .rposition(|&b| b != b' ' && b != b'\t')
        .map_or(start, |i| i + 1);
    &v[start..end]
}

/// Feeds a length-prefixed field, so that no two different inputs hash alike.
fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

/// Several lines of one header, joined with ", " as HTTP allows.
#[cfg(test)]
fn joined_values(headers: &HeaderMap, name: &HeaderName) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, v) in headers.get_all(name).iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(v.as_bytes());
    }
    out
}

/// The length of a header's lines joined with ", " as HTTP allows.
fn joined_len(headers: &HeaderMap, name: &HeaderName) -> usize {
    let lines = headers.get_all(name);
    let (n, bytes) = lines
        .iter()
        .fold((0usize, 0usize), |(n, bytes), v| (n + 1, bytes + v.len()));
    bytes + 2 * n.saturating_sub(1)
}

/// Feeds a header's lines joined with ", " as one length-prefixed field
/// (`len` from [`joined_len`]): what `field` would feed for the joined
/// value, without building it.
fn joined_field(h: &mut Sha256, headers: &HeaderMap, name: &HeaderName, len: usize) {
    h.update((len as u64).to_be_bytes());
    for (i, v) in headers.get_all(name).iter().enumerate() {
        if i > 0 {
            h.update(b", ");
        }
        h.update(v.as_bytes());
    }
}

/// The record id: hex SHA-256 over the non-empty scope header values (by
/// lower-cased name, in name order) and the decoded key. A missing header and
/// an empty one are the same principal. Neither the key nor any header value
/// can be read back from it.
pub fn record_id<'a>(scope: impl IntoIterator<Item = (&'a str, &'a [u8])>, key: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"idemproxy-scope-v1");
    for (name, value) in scope {
        if !value.is_empty() {
            field(&mut h, name.as_bytes());
            field(&mut h, value);
        }
    }
    field(&mut h, key.as_bytes());
    let mut id = String::with_capacity(64);
    push_hex(&mut id, &h.finalize().into());
    id
}

/// The digest behind the record id of a request ([`record_id`] over
/// `scope_headers`, already sorted by name, taken from its headers), hashed
/// as it is read: no joined header value is built.
pub fn request_record_digest(
    headers: &HeaderMap,
    scope_headers: &[HeaderName],
    key: &str,
) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"idemproxy-scope-v1");
    for name in scope_headers {
        let len = joined_len(headers, name);
        if len > 0 {
            field(&mut h, name.as_str().as_bytes());
            joined_field(&mut h, headers, name, len);
        }
    }
    field(&mut h, key.as_bytes());
    h.finalize().into()
}

pub use idemproxy_store::push_hex;

/// SHA-256 over method, path, query, the fingerprint headers (sorted by name) and the body.
pub fn fingerprint(
    method: &Method,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    fingerprint_headers: &[HeaderName],
    body: &[u8],
    body_mode: FingerprintBody,
) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"idemproxy-fp-v1");
    field(&mut h, method.as_str().as_bytes());
    field(&mut h, path.as_bytes());
    match query {
        Some(q) => {
            h.update([1]);
            field(&mut h, q.as_bytes());
        }
        None => h.update([0]),
    }
    for name in fingerprint_headers {
        field(&mut h, name.as_str().as_bytes());
        joined_field(&mut h, headers, name, joined_len(headers, name));
    }
    match body_mode {
        FingerprintBody::Json => match canonical_json(body) {
            Some(canon) => field(&mut h, &canon),
            None => field(&mut h, body),
        },
        FingerprintBody::Raw => field(&mut h, body),
    }
    h.finalize().into()
}

/// Canonical JSON (see [`crate::canonical_json`]). `None` when the body must be fingerprinted as raw bytes.
fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    crate::canonical_json::canonicalize(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hex_writes_every_byte_as_two_digits() {
        let all: Vec<u8> = (0..=255).collect();
        for digest in all.chunks_exact(32) {
            let expected: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            let mut out = String::from("p:");
            push_hex(&mut out, digest.try_into().unwrap());
            assert_eq!(out, format!("p:{expected}"));
        }
    }

    #[test]
    fn record_ids_stay_what_they_were() {
        let mut headers = HeaderMap::new();
        headers.insert("authorization", http::HeaderValue::from_static("Bearer a"));
        let mut id = String::new();
        let scope = [HeaderName::from_static("authorization")];
        push_hex(&mut id, &request_record_digest(&headers, &scope, "k-1"));
        // sha256(b"idemproxy-scope-v1" + u64be(13) + b"authorization" + u64be(8) + b"Bearer a" + u64be(3) + b"k-1")
        assert_eq!(
            id,
            "06aa74888313e4b7603c5437c9d245c15c4ecc6273d9cdff015369af4ac6f3b6"
        );
    }

    /// Record ids and fingerprints must not change between versions (a
    /// retry across an upgrade would execute again): the streamed hashing
    /// feeds what hashing the joined values fed.
    #[test]
    fn streamed_header_fields_hash_as_joined_ones() {
        let scope = [
            HeaderName::from_static("authorization"),
            HeaderName::from_static("x-tenant"),
        ];
        let cases: &[&[(&str, &str)]] = &[
            &[],
            &[("authorization", "Bearer a")],
            &[("authorization", "")],
            &[("authorization", ""), ("authorization", "")],
            &[
                ("authorization", "a"),
                ("authorization", "b"),
                ("x-tenant", "t"),
            ],
            &[("x-tenant", ""), ("authorization", "a")],
        ];
        for lines in cases {
            let mut headers = HeaderMap::new();
            for (n, v) in *lines {
                headers.append(*n, http::HeaderValue::from_static(v));
            }
            let joined: Vec<(&str, Vec<u8>)> = scope
                .iter()
                .map(|n| (n.as_str(), joined_values(&headers, n)))
                .collect();
            let before = record_id(joined.iter().map(|(n, v)| (*n, v.as_slice())), "k-1");
            let mut after = String::new();
            push_hex(&mut after, &request_record_digest(&headers, &scope, "k-1"));
            assert_eq!(before, after, "{lines:?}");

            let mut h = Sha256::new();
            for n in &scope {
                field(&mut h, &joined_values(&headers, n));
            }
            let mut streamed = Sha256::new();
            for n in &scope {
                joined_field(&mut streamed, &headers, n, joined_len(&headers, n));
            }
            assert_eq!(h.finalize(), streamed.finalize(), "{lines:?}");
        }
    }

    #[test]
    fn quoted_and_bare_are_the_same_key() {
        assert_eq!(parse_key(b"abc-123", 255).unwrap(), "abc-123");
        assert_eq!(parse_key(b"\"abc-123\"", 255).unwrap(), "abc-123");
        assert_eq!(parse_key(b"  \"a b\\\"c\\\\\"  ", 255).unwrap(), "a b\"c\\");
        assert_eq!(
            parse_key(b"8e03978e-40d5-43e8-bc93-6894a57f9324", 255).unwrap(),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
    }

    #[test]
    fn refusals() {
        assert_eq!(parse_key(b"", 255), Err(KeyError::Empty));
        assert_eq!(parse_key(b"\"\"", 255), Err(KeyError::Empty));
        assert_eq!(parse_key(b"   ", 255), Err(KeyError::Empty));
        assert!(matches!(
            parse_key(&[b'a'; 256], 255),
            Err(KeyError::TooLong { len: 256, max: 255 })
        ));
        assert!(parse_key(&[b'a'; 255], 255).is_ok());
        // max_key_length counts the decoded key
        let mut quoted = vec![b'"'];
        quoted.extend_from_slice(&[b'a'; 253]);
        quoted.extend_from_slice(b"\\\\\"");
        assert_eq!(parse_key(&quoted, 254).unwrap().len(), 254);
        for bad in [
            &b"a,b"[..],
            b"a;x=1",
            b"\"a\";x=1",
            b"\"a\", \"b\"",
            b"a b",
            b"\"abc",
            b"\"a\\b\"",
            b"ab\"c",
            b"\xc3\xa9",
            b"\"\xc3\xa9\"",
            b"a\x7f",
        ] {
            assert!(
                matches!(parse_key(bad, 255), Err(KeyError::Syntax(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn scope_separates_principals_and_hides_values() {
        let a = record_id([("authorization", &b"Bearer A"[..])], "k");
        let b = record_id([("authorization", &b"Bearer B"[..])], "k");
        let none = record_id([("authorization", &b""[..])], "k");
        assert_ne!(a, b);
        assert_eq!(
            none,
            record_id([], "k"),
            "missing and empty scope are the same principal"
        );
        assert_eq!(a.len(), 64);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
    }

    #[test]
    fn json_fingerprint_ignores_key_order_and_whitespace() {
        let m = Method::POST;
        let h = HeaderMap::new();
        let f = |b: &[u8], mode| fingerprint(&m, "/p", None, &h, &[], b, mode);
        let j = FingerprintBody::Json;
        assert_eq!(
            f(br#"{"a":1,"b":[1,2]}"#, j),
            f(b"{ \"b\" : [1, 2],\n \"a\": 1 }", j)
        );
        assert_ne!(f(br#"{"a":1}"#, j), f(br#"{"a":2}"#, j));
        assert_ne!(
            f(br#"{"a":1,"b":2}"#, FingerprintBody::Raw),
            f(br#"{"b":2,"a":1}"#, FingerprintBody::Raw)
        );
        // not JSON: raw bytes
        assert_eq!(f(b"not json", j), f(b"not json", FingerprintBody::Raw));
        // the query is part of it, and "no query" differs from an empty one
        assert_ne!(
            fingerprint(&m, "/p", None, &h, &[], b"", j),
            fingerprint(&m, "/p", Some(""), &h, &[], b"", j)
        );
    }

    #[test]
    fn keys_come_from_the_source_the_route_names() {
        let mut h = HeaderMap::new();
        h.insert("idempotency-key", "\"k-1\"".parse().unwrap());
        h.insert(
            "x-github-delivery",
            "72d3162e-cc78-11e3-81ab-4c9367dc0958".parse().unwrap(),
        );
        let header = |n: &'static str| KeySource::Header(HeaderName::from_static(n));
        // (A key read from a header needs no body.)
        let read = |h: &HeaderMap, name| {
            from_headers(h, &header(name), 255).and_then(|k| k.or_from_body(b"", 255))
        };
        assert_eq!(read(&h, "idempotency-key"), Ok("k-1".into()));
        assert_eq!(
            read(&h, "x-github-delivery"),
            Ok("72d3162e-cc78-11e3-81ab-4c9367dc0958".into())
        );
        assert_eq!(read(&h, "x-shopify-webhook-id"), Err(NoKey::Missing));
        h.append("x-github-delivery", "again".parse().unwrap());
        assert_eq!(
            read(&h, "x-github-delivery"),
            Err(NoKey::Invalid(KeyError::Repeated))
        );
        let id = KeySource::Json(Pointer::parse("/id").unwrap());
        let KeySource::Json(pointer) = &id else {
            unreachable!()
        };
        assert_eq!(
            from_headers(&h, &id, 255),
            Ok(KeyRead::InBody(pointer)),
            "headers are not looked at"
        );
        assert_eq!(
            KeyRead::InBody(pointer).or_from_body(br#"{"id":"evt_1"}"#, 255),
            Ok("evt_1".to_string())
        );
        assert_eq!(
            KeyRead::Read("k".into()).or_from_body(b"not json", 255),
            Ok("k".to_string())
        );
    }

    #[test]
    fn json_keys_are_strings_or_integers_of_bounded_length() {
        let id = Pointer::parse("/id").unwrap();
        let key = |body: &str, max| json_key(body.as_bytes(), &id, max);
        assert_eq!(key(r#"{"id":"evt_1"}"#, 255), Ok("evt_1".into()));
        assert_eq!(
            key(r#"{"id":" a\tb\u0000 "}"#, 255),
            Ok(" a\tb\0 ".into()),
            "as decoded"
        );
        assert_eq!(key(r#"{"id":123}"#, 255), Ok("123".into()));
        assert_eq!(key(r#"{"id":"123"}"#, 255), Ok("123".into()));
        assert_eq!(
            key(r#"{"id":100000000000000000001}"#, 255),
            Ok("100000000000000000001".into())
        );
        for missing in [
            "not json",
            "",
            r#"{"other":"x"}"#,
            r#"{"id":1.0}"#,
            r#"{"id":1e3}"#,
            r#"{"id":true}"#,
            r#"{"id":null}"#,
            r#"{"id":["a"]}"#,
            r#"{"id":{"a":1}}"#,
            r#"{"id":"a","id":"b"}"#,
            r#"["id"]"#,
        ] {
            assert_eq!(key(missing, 255), Err(NoKey::Missing), "{missing}");
        }
        assert_eq!(
            key(r#"{"id":""}"#, 255),
            Err(NoKey::Invalid(KeyError::Empty))
        );
        // max_key_length counts characters, as it does for header keys.
        assert_eq!(key(r#"{"id":"ééé"}"#, 3), Ok("ééé".into()));
        assert_eq!(
            key(r#"{"id":"éééé"}"#, 3),
            Err(NoKey::Invalid(KeyError::TooLong { len: 4, max: 3 }))
        );
        assert_eq!(
            key(r#"{"id":1234}"#, 3),
            Err(NoKey::Invalid(KeyError::TooLong { len: 4, max: 3 }))
        );
    }

    proptest! {
        #[test]
        fn bare_tokens_roundtrip_through_quoting(key in "[!#-+\\x2d-:<-~]{1,64}") {
            let bare = parse_key(key.as_bytes(), 255).unwrap();
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\"));
            prop_assert_eq!(&bare, &key);
            prop_assert_eq!(parse_key(quoted.as_bytes(), 255).unwrap(), key);
        }

        #[test]
        fn parser_never_panics_and_respects_max(raw in proptest::collection::vec(any::<u8>(), 0..300), max in 1usize..300) {
            if let Ok(k) = parse_key(&raw, max) {
                prop_assert!(!k.is_empty() && k.len() <= max);
                prop_assert!(k.bytes().all(|b| (0x20..0x7f).contains(&b)));
            }
        }
    }
}
