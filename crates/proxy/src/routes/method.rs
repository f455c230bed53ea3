//! A request's methods: its own and any a method-override header, query
//! parameter or form field names.

use http::{HeaderMap, Method};

use super::spelling::decode_all;

/// The methods the upstream might run a request as: its own, any that a
/// method-override header (`X-HTTP-Method-Override`, `X-HTTP-Method`,
/// `X-Method-Override`) or a `_method` query parameter names (Rails' and
/// Express's method-override, Laravel, Symfony), and every method for a POST
/// with a form body, whose `_method` field Rails' `Rack::MethodOverride` obeys.
pub(super) struct Methods<'a> {
    own: &'a Method,
    overrides: Vec<Method>,
    pub(super) any: bool,
}

/// The headers frameworks take a method override from, as hyper names them
/// (lower case), `_` read as `-`: puma gives `X_HTTP_METHOD_OVERRIDE` and
/// `X-HTTP-Method-Override` the same CGI name.
const OVERRIDE_HEADERS: [&str; 3] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

/// Is `name` one of [`OVERRIDE_HEADERS`], `_` taken as `-`?
fn is_override_header(name: &str) -> bool {
    OVERRIDE_HEADERS.iter().any(|o| {
        o.len() == name.len()
            && o.bytes()
                .zip(name.bytes())
                .all(|(a, b)| a == b || (a == b'-' && b == b'_'))
    })
}

impl<'a> Methods<'a> {
    /// The request's own method and overrides (`any` is the caller's to set).
    pub(super) fn of(own: &'a Method, query: Option<&str>, headers: &HeaderMap) -> Self {
        let mut overrides = Vec::new();
        // One walk over the names (a lookup by a name given as text parses
        // and hashes it: three of them cost more than the walk).
        for name in headers.keys() {
            if is_override_header(name.as_str()) {
                for value in headers.get_all(name) {
                    let text = value.as_bytes();
                    overrides.extend(text.split(|b| *b == b',').filter_map(method_named));
                }
            }
        }
        if let Some(query) = query {
            for pair in query.split('&') {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                if is_method_key(key) {
                    overrides.extend(method_named(&form_decoded(value)));
                }
            }
        }
        Methods {
            own,
            overrides,
            any: false,
        }
    }

    /// Might the upstream run the request as one of `methods`?
    pub(super) fn among(&self, methods: &[Method]) -> bool {
        let same = |a: &Method, b: &Method| a == b || a.as_str().eq_ignore_ascii_case(b.as_str());
        self.any
            || methods
                .iter()
                .any(|m| same(m, self.own) || self.overrides.iter().any(|o| same(m, o)))
    }
}

/// Is a query key `_method` once decoded as frameworks decode it (escapes
/// and `+`; PHP also takes `.` and a space for `_`)? Letters in any case.
fn is_method_key(key: &str) -> bool {
    if key.len() < 7 {
        return false;
    }
    let key = form_decoded(key);
    key.len() == 7
        && matches!(key[0], b'_' | b'.' | b' ')
        && key[1..].eq_ignore_ascii_case(b"method")
}

/// A query key or value decoded as a form decodes it: `+` a space, escapes.
fn form_decoded(text: &str) -> Vec<u8> {
    let mut out = decode_all(&text.replace('+', " "));
    out.shrink_to_fit();
    out
}

/// A method named in an override, without what frameworks trim around it
/// (anything but letters: JavaScript's `trim()` also takes a latin-1
/// no-break space); `None` when it is no method.
fn method_named(text: &[u8]) -> Option<Method> {
    let start = text.iter().position(u8::is_ascii_alphabetic)?;
    let end = text.iter().rposition(u8::is_ascii_alphabetic)?;
    Method::from_bytes(&text[start..=end]).ok()
}

/// POST in any letter case (hyper takes `post` for a method of its own).
pub(super) fn is_post(method: &Method) -> bool {
    method.as_str().eq_ignore_ascii_case("POST")
}

/// A body where a `_method` field may override the method: a form
/// (urlencoded, any `multipart/*`), or one whose type is not given, which
/// Rack also parses as a form.
pub(super) fn is_form(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(http::header::CONTENT_TYPE) else {
        return true;
    };
    let value = value.as_bytes().trim_ascii_start();
    let starts = |prefix: &[u8]| {
        value
            .get(..prefix.len())
            .is_some_and(|v| v.eq_ignore_ascii_case(prefix))
    };
    value.is_empty() || starts(b"application/x-www-form-urlencoded") || starts(b"multipart/")
}
