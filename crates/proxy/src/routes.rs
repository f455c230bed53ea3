//! The route table: (method, path pattern) → the policy of the first matching route.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use http::{HeaderMap, Method, Uri};

/// (A metric label as much as a route's name: the metrics own it.)
pub use crate::metrics::RouteName;
use crate::policy::{Mode, Policy};

/// One segment of a path pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    /// Normalised as request paths are ([`normalise`]); and every escape
    /// decoded, for the broad match (see [`RouteTable::position`]).
    Literal { exact: String, decoded: String },
    /// `{name}`: exactly one non-empty segment.
    Param,
}

impl Segment {
    /// Does this segment match every value `other` matches?
    fn covers(&self, other: &Segment) -> bool {
        match (self, other) {
            (Segment::Param, _) => true,
            (Segment::Literal { exact: a, .. }, Segment::Literal { exact: b, .. }) => a == b,
            (Segment::Literal { .. }, Segment::Param) => false,
        }
    }
}

/// A route path: exact segments, `{param}` for one segment, and an optional
/// trailing `/*` that matches the prefix followed by anything (even nothing).
/// It matches the normalised request path (docs/reference/behaviour.md#normalised-path):
/// repeated slashes and a
/// trailing slash do not count, `.` and `..` segments are resolved, and
/// percent-encoded unreserved characters are decoded, so every spelling
/// that common upstream frameworks take for the same path is matched alike.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathPattern {
    text: String,
    segments: Vec<Segment>,
    prefix: bool,
}

impl PathPattern {
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("invalid route path \"{text}\": {why}");
        if !text.starts_with('/') {
            return Err(bad("must start with '/'"));
        }
        if text.contains(['?', '#']) {
            return Err(bad("a route path has no query or fragment"));
        }
        if text.bytes().any(|b| !(0x21..0x7f).contains(&b)) {
            return Err(bad(
                "only visible ASCII is allowed (percent-encode the rest)",
            ));
        }
        let (body, prefix) = match text.strip_suffix("/*") {
            Some(rest) => (rest, true),
            None => (text, false),
        };
        let mut segments = Vec::new();
        let mut names = Vec::new();
        // Empty segments (repeated or trailing slashes) do not count, as in request paths.
        for seg in body.split('/').filter(|s| !s.is_empty()) {
            if seg.contains('*') {
                return Err(bad(
                    "'*' is only allowed as the whole last segment (\"/prefix/*\")",
                ));
            }
            if seg.starts_with('{') || seg.ends_with('}') || seg.contains(['{', '}']) {
                let name = seg
                    .strip_prefix('{')
                    .and_then(|s| s.strip_suffix('}'))
                    .filter(|n| {
                        !n.is_empty() && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                    })
                    .ok_or_else(|| {
                        bad(&format!(
                            "\"{seg}\" is not a parameter; write {{name}} as a whole segment"
                        ))
                    })?;
                if names.contains(&name) {
                    return Err(bad(&format!("parameter {{{name}}} appears twice")));
                }
                names.push(name);
                segments.push(Segment::Param);
            } else {
                let literal = decode_unreserved(seg);
                if literal == "." || literal == ".." {
                    return Err(bad("'.' and '..' segments are resolved in request paths; write the path they lead to"));
                }
                let decoded = String::from_utf8_lossy(&decode_all(&literal)).into_owned();
                segments.push(Segment::Literal {
                    exact: literal.into_owned(),
                    decoded,
                });
            }
        }
        Ok(PathPattern {
            text: text.to_string(),
            segments,
            prefix,
        })
    }

    /// Does the request path (without its query) match in any of its
    /// spellings, exactly or broadly (see [`RouteTable::judge`]), suffixes aside?
    pub fn matches(&self, path: &str) -> bool {
        let spellings = Spellings::of(path);
        spellings
            .each(false, true)
            .any(|s| self.matches_normal(s, false))
            || spellings
                .each(true, true)
                .any(|s| self.matches_normal(s, true))
    }

    /// Does a path [`normalise`] made match? `broad`: a broad spelling ([`Spellings`])
    /// made, compared with the decoded literals, letters in any case.
    fn matches_normal(&self, path: &str, broad: bool) -> bool {
        let Some(mut rest) = path.strip_prefix('/') else {
            return false;
        };
        let last = self.segments.len();
        for (i, seg) in self.segments.iter().enumerate() {
            let (head, tail) = match rest.bytes().position(|b| b == b'/') {
                Some(pos) => (&rest[..pos], Some(&rest[pos + 1..])),
                None => (rest, None),
            };
            let ok = match seg {
                Segment::Literal { exact, .. } if !broad => head == exact,
                Segment::Literal { decoded, .. } => head.eq_ignore_ascii_case(decoded),
                Segment::Param => !head.is_empty(),
            };
            if !ok {
                return false;
            }
            match tail {
                Some(t) => rest = t,
                // The path ended here: it matches when the pattern ends here
                // too (a prefix also matches nothing after it).
                None => return i + 1 == last,
            }
        }
        // The pattern's segments are used up and the path goes on after a '/'.
        // (A pattern with no segments is "/" or "/*": the root, or every path.)
        self.prefix || rest.is_empty()
    }

    /// Does this pattern match every path `later` matches? (Then a later
    /// route with it can never match for the methods this one takes.)
    pub fn covers(&self, later: &PathPattern) -> bool {
        let n = self.segments.len();
        let pairs_cover = || {
            self.segments
                .iter()
                .zip(&later.segments)
                .all(|(a, b)| a.covers(b))
        };
        if self.prefix {
            later.segments.len() >= n && pairs_cover()
        } else {
            !later.prefix && later.segments.len() == n && pairs_cover()
        }
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// The path routes match (docs/reference/behaviour.md#normalised-path): percent-encoded
/// unreserved characters decoded
/// (other escapes kept, their hex in upper case), empty segments (repeated
/// and trailing slashes) dropped, `.` and `..` resolved; the root is "/".
/// Borrowed when the path is already so, as nearly every request's is.
pub fn normalise(path: &str) -> Cow<'_, str> {
    if !path.starts_with('/') || is_normal(path) {
        return Cow::Borrowed(path);
    }
    squash(path, true)
}

/// [`normalise`], but `.` and `..` kept as segments of their own (decoded
/// from `%2e` too): what Flask, FastAPI, aiohttp and Express 4 route by,
/// taking `.` or `..` as the value of a `{param}`. `None` when the path has no
/// dot segment (then it is the normalised path).
pub fn with_dot_segments(path: &str) -> Option<String> {
    if !path.starts_with('/') || !has_dot_segment(path) {
        return None;
    }
    Some(squash(path, false).into_owned())
}

/// Does a segment of `path` read `.` or `..`, once unreserved escapes are decoded?
fn has_dot_segment(path: &str) -> bool {
    path.bytes().any(|b| b == b'.' || b == b'%')
        && path.split('/').any(|s| {
            let s = decode_unreserved(s);
            s == "." || s == ".."
        })
}

/// Empty segments dropped, unreserved escapes decoded; dot segments resolved
/// when `resolve` (else kept).
fn squash(path: &str, resolve: bool) -> Cow<'_, str> {
    let mut segments: Vec<Cow<'_, str>> = Vec::new();
    for raw in path.split('/').filter(|s| !s.is_empty()) {
        let seg = decode_unreserved(raw);
        match &*seg {
            "." if resolve => {}
            ".." if resolve => {
                segments.pop();
            }
            _ => segments.push(seg),
        }
    }
    let mut out = String::with_capacity(path.len());
    for seg in &segments {
        out.push('/');
        out.push_str(seg);
    }
    if out.is_empty() {
        out.push('/');
    }
    Cow::Owned(out)
}

/// A squashed path without the format suffix of its last segment: `.` and
/// what follows it to the end, with no `/` or `.` in it, as Rails' optional
/// `(.:format)` and Django REST framework's format suffixes take it
/// (`/v1/payments.json` is `/v1/payments`). `None` when the last segment has
/// no `.`, or is itself a dot segment.
#[cfg(test)]
fn without_format_suffix(path: &str) -> Option<&str> {
    format_cuts(path)[0]
}

/// The path cut at the last `.` of its last segment, and (when it has
/// another) at its first: Rails matches the path before decoding it, so in
/// `/v1/payments.xml%2ejson` its format is all of `xml%2ejson`, while the
/// decoded spelling's last `.` is the encoded one.
fn format_cuts(path: &str) -> [Option<&str>; 2] {
    let Some(last) = path.rfind('/') else {
        return [None, None];
    };
    let segment = &path[last + 1..];
    if segment == "." || segment == ".." {
        return [None, None];
    }
    let cut = |dot: usize| match &path[..last + 1 + dot] {
        // A segment that was all suffix (`/v1/payments/.json`): its parent.
        p if p.len() == last + 1 && last > 0 => &path[..last],
        "" | "/" => "/",
        p => p,
    };
    match (segment.find('.'), segment.rfind('.')) {
        (Some(first), Some(last_dot)) if first != last_dot => {
            [Some(cut(last_dot)), Some(cut(first))]
        }
        (_, Some(last_dot)) => [Some(cut(last_dot)), None],
        _ => [None, None],
    }
}

/// The broad form of a path, for what some upstream frameworks do beyond
/// [`normalise`], before it is normalised: every escape decoded (`%2F`
/// included: WSGI servers, Go's `URL.Path`, nginx's `proxy_pass` with a URI
/// decode before routing), `\` taken as `/` (IIS), `;parameters` cut from
/// each segment (Servlet containers, Spring). None when the path has none of
/// `%`, `;` or `\` (then only letter case can differ, which the broad match
/// ignores). Never forwarded: the upstream gets the request-target as sent.
fn broad_text(path: &str, backslash: Backslash) -> Option<String> {
    if !path.bytes().any(|b| matches!(b, b'%' | b';' | b'\\')) {
        return None;
    }
    let decoded = decode_all(path);
    let text = String::from_utf8_lossy(&decoded);
    let text = match backslash {
        Backslash::Separator => text.replace('\\', "/"),
        // Only where there is one (raw or `%5C`): else it is the other spelling.
        Backslash::Kept if text.contains('\\') => text.into_owned(),
        Backslash::Kept => return None,
    };
    let mut cut = String::with_capacity(text.len());
    for (i, seg) in text.split('/').enumerate() {
        if i > 0 {
            cut.push('/');
        }
        cut.push_str(seg.split(';').next().unwrap_or(""));
    }
    Some(cut)
}

/// What a `\\` is in a broad spelling: a separator (IIS), or a character of
/// its segment (Go's `net/http`, which decodes `%2F` but not `\\`).
#[derive(Clone, Copy)]
enum Backslash {
    Separator,
    Kept,
}

/// The spellings of one request path that upstream frameworks route by
/// (docs/routes-and-keys.md#what-is-protected): the normalised path, the
/// path with its dot segments kept, and the broad forms of both (`\\` a
/// separator, and kept). Each is also tried without its format suffix, on
/// routes that take one.
struct Spellings<'a> {
    /// Compared with the routes' literals as written.
    exact: [Option<Cow<'a, str>>; 2],
    /// Compared with the decoded literals, letters in any case.
    broad: [Option<String>; 4],
}

impl<'a> Spellings<'a> {
    fn of(path: &'a str) -> Self {
        let mut broad = [None, None, None, None];
        for (i, backslash) in [Backslash::Separator, Backslash::Kept]
            .into_iter()
            .enumerate()
        {
            if let Some(text) = broad_text(path, backslash) {
                broad[2 * i] = Some(normalise(&text).into_owned());
                broad[2 * i + 1] = with_dot_segments(&text);
            }
        }
        Spellings {
            exact: [
                Some(normalise(path)),
                with_dot_segments(path).map(Cow::Owned),
            ],
            broad,
        }
    }

    /// The spellings for one pass: the exact ones; or (`broad`) the broad
    /// ones, and those exact ones that a broad comparison could match where
    /// the exact one did not (with a capital letter or an escape in them;
    /// every one when `cased`: a route's literal has them).
    fn each(&self, broad: bool, cased: bool) -> impl Iterator<Item = &str> {
        let differs =
            move |s: &&str| cased || s.bytes().any(|b| b.is_ascii_uppercase() || b == b'%');
        let exact = self.exact.iter().flatten().map(|s| &**s);
        let more = self.broad.iter().flatten().map(String::as_str);
        exact
            .filter(move |s| !broad || differs(s))
            .chain(more.filter(move |_| broad))
    }
}

/// The methods the upstream might run a request as: its own, any that a
/// method-override header (`X-HTTP-Method-Override`, `X-HTTP-Method`,
/// `X-Method-Override`) or a `_method` query parameter names (Rails' and
/// Express's method-override, Laravel, Symfony), and every method for a POST
/// with a form body, whose `_method` field Rails' `Rack::MethodOverride` obeys.
struct Methods<'a> {
    own: &'a Method,
    overrides: Vec<Method>,
    any: bool,
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
    fn of(own: &'a Method, query: Option<&str>, headers: &HeaderMap) -> Self {
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
    fn among(&self, methods: &[Method]) -> bool {
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
fn is_post(method: &Method) -> bool {
    method.as_str().eq_ignore_ascii_case("POST")
}

/// A body where a `_method` field may override the method: a form
/// (urlencoded, any `multipart/*`), or one whose type is not given, which
/// Rack also parses as a form.
fn is_form(headers: &HeaderMap) -> bool {
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

/// Does the path hold a control character, raw or percent-encoded
/// (`%00`-`%1F`, `%7F`), or the query a NUL? Starlette routes
/// `/v1/payments%0a` as `/v1/payments`; no real API names such a path.
pub fn has_control(path: &str, query: Option<&str>) -> bool {
    let escaped = |text: &str, control: fn(u8) -> bool| {
        text.as_bytes().windows(3).any(|w| {
            w[0] == b'%'
                && matches!(
                    (char::from(w[1]).to_digit(16), char::from(w[2]).to_digit(16)),
                    (Some(h), Some(l)) if control((h * 16 + l) as u8)
                )
        })
    };
    let control = |b: u8| b < 0x20 || b == 0x7f;
    path.bytes().any(control)
        || (path.contains('%') && escaped(path, control))
        || query.is_some_and(|q| {
            q.bytes().any(|b| b == 0) || (q.contains('%') && escaped(q, |b| b == 0))
        })
}

/// Every `%XX` escape decoded to its byte (a malformed one kept as it came).
fn decode_all(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    let hex = |b: u8| (b as char).to_digit(16);
    while i < bytes.len() {
        if let Some([b'%', h, l]) = bytes.get(i..i + 3) {
            if let (Some(h), Some(l)) = (hex(*h), hex(*l)) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

/// No '%', no empty segment but the root's, no `.` or `..` segment.
fn is_normal(path: &str) -> bool {
    if path == "/" {
        return true;
    }
    !path.contains('%')
        && path
            .split('/')
            .skip(1)
            .all(|s| !s.is_empty() && s != "." && s != "..")
}

/// A segment with its percent-encoded unreserved characters (RFC 3986:
/// letters, digits, `-._~`) decoded; other escapes kept, in upper-case hex;
/// a `%` that starts no escape written `%25`.
fn decode_unreserved(seg: &str) -> Cow<'_, str> {
    if !seg.contains('%') {
        return Cow::Borrowed(seg);
    }
    let bytes = seg.as_bytes();
    let mut out = String::with_capacity(seg.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        let escaped = match bytes.get(i..i + 3) {
            Some([b'%', h, l]) => hex(*h).zip(hex(*l)).map(|(h, l)| (h * 16 + l) as u8),
            _ => None,
        };
        match escaped {
            Some(b) if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') => {
                out.push(b as char);
                i += 3;
            }
            Some(b) => {
                out.push('%');
                out.push(char::from(b"0123456789ABCDEF"[usize::from(b >> 4)]));
                out.push(char::from(b"0123456789ABCDEF"[usize::from(b & 15)]));
                i += 3;
            }
            // A `%` that starts no escape is itself escaped: kept bare, it
            // could start one with the characters decoded after it (`%%30a`
            // would be `%0a`, then `%0A`), and normalising again would
            // change the path.
            None if bytes[i] == b'%' => {
                out.push_str("%25");
                i += 1;
            }
            None => {
                let c = seg[i..].chars().next().unwrap_or('%');
                out.push(c);
                i += c.len_utf8();
            }
        }
    }
    Cow::Owned(out)
}

impl fmt::Display for PathPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// A protected route as configured.
#[derive(Clone, Debug)]
pub struct Route {
    pub name: RouteName,
    pub methods: Vec<Method>,
    pub path: PathPattern,
    pub policy: Arc<Policy>,
    /// Its request counters, once found (`Metrics::request_on`).
    pub series: crate::metrics::RouteSeries,
    /// Its upstream's typical duration, for a 409's `Retry-After` (shared
    /// with the jobs that measure it; a reload starts a new one).
    pub typical: Arc<crate::typical::Typical>,
}

impl Route {
    /// What the route covers, for `--check`: its paths, the spellings and
    /// methods taken for them, and what is refused.
    pub fn coverage(&self) -> Vec<String> {
        let methods: Vec<&str> = self.methods.iter().map(Method::as_str).collect();
        let methods = methods.join(", ");
        let path = self.path.as_str();
        let mut paths = vec![path.to_string()];
        if self.policy.format_suffix && !self.path.prefix {
            paths.push(format!("{}.{{format}}", path.trim_end_matches('/')));
        }
        let mut lines = vec![
            format!("covers {}", paths.join(" ")),
            "  spellings: letters in any case; repeated and trailing slashes; any percent-encoding \
             (%2F and %5C taken as / too); \\ as /; ;params cut; . and .. resolved, or taken as a {param}'s value"
                .to_string(),
            format!(
                "  methods: {methods}; or any method with X-HTTP-Method-Override, X-HTTP-Method, \
                 X-Method-Override or ?_method= naming one of them"
            ),
        ];
        if !self.methods.contains(&Method::POST) {
            lines
                .push("  and a POST with a form body (its _method field may name one)".to_string());
        }
        if self.policy.mode == Mode::Enforce {
            lines.push(format!(
                "  refused (400 path-not-accepted): {methods} with a control character in the path \
                 (raw, or %00-%1F, %7F) or a NUL in the query"
            ));
        }
        lines
    }
}

/// A spelling of a path with its format suffixes cut ([`format_cuts`]).
type Spelt<'s> = (&'s str, [Option<&'s str>; 2]);

/// What the route table makes of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Judgement {
    /// The route at this position protects it.
    Protected(usize),
    /// 400 `path-not-accepted`: a control character in the path, on a
    /// method a route names (docs/routes-and-keys.md#what-is-refused).
    Refused,
    /// No route protects it: passed through.
    Unprotected,
}

/// Routes in file order; the first whose method and path match wins.
#[derive(Debug, Default)]
pub struct RouteTable {
    routes: Vec<Route>,
    /// A route's literal has a capital letter or an escape: the broad pass
    /// compares every spelling, not only those with one.
    cased: bool,
}

impl RouteTable {
    pub fn new(routes: Vec<Route>) -> Self {
        let cased = routes.iter().any(|r| {
            r.path
                .text
                .bytes()
                .any(|b| b.is_ascii_uppercase() || b == b'%')
        });
        RouteTable { routes, cased }
    }

    /// The route that protects a request, if any (see [`RouteTable::judge`]).
    pub fn find(&self, method: &Method, uri: &Uri, headers: &HeaderMap) -> Option<&Route> {
        match self.judge(method, uri, headers) {
            Judgement::Protected(i) => Some(&self.routes[i]),
            Judgement::Refused | Judgement::Unprotected => None,
        }
    }

    /// What the table makes of a request (docs/routes-and-keys.md#what-is-protected).
    ///
    /// A request is protected by the first route that matches any spelling
    /// of its path the upstream might route by ([`Spellings`]) under any
    /// method it might run it as ([`Methods`]): first the exact spellings
    /// against the routes as written, then, when none matches, the broad
    /// ones with letters in any case too (Express and ASP.NET ignore case,
    /// WSGI decodes `%2F`, Tomcat cuts `;jsessionid`). Protecting a path the
    /// upstream takes for another costs a key; missing one it takes for a
    /// protected path costs a second execution. A path with a control
    /// character, on a method an enforcing route names, is refused.
    pub fn judge(&self, method: &Method, uri: &Uri, headers: &HeaderMap) -> Judgement {
        if self.routes.is_empty() {
            return Judgement::Unprotected;
        }
        let path = uri.path();
        let mut methods = Methods::of(method, uri.query(), headers);
        if has_control(path, uri.query()) {
            methods.any = is_post(method) && is_form(headers);
            let named = |r: &Route| r.policy.mode == Mode::Enforce && methods.among(&r.methods);
            if self.routes.iter().any(named) {
                return Judgement::Refused;
            }
        }
        // A method no route names (a GET, mostly) needs no spelling.
        let form = || is_post(method) && is_form(headers);
        if !self.routes.iter().any(|r| methods.among(&r.methods)) && !form() {
            return Judgement::Unprotected;
        }
        let spellings = Spellings::of(path);
        let found = |methods: &Methods<'_>| {
            self.first(methods, &spellings, false)
                .or_else(|| self.first(methods, &spellings, true))
        };
        let mut position = found(&methods);
        // A form POST that its own method and overrides leave unprotected:
        // its `_method` field may name any method (asked only then, as
        // protected requests are nearly all of those that match at once).
        if position.is_none() && form() {
            methods.any = true;
            position = found(&methods);
        }
        position.map_or(Judgement::Unprotected, Judgement::Protected)
    }

    fn first(
        &self,
        methods: &Methods<'_>,
        spellings: &Spellings<'_>,
        broad: bool,
    ) -> Option<usize> {
        // Each spelling with its suffix cut, once for every route.
        let mut each: [Option<Spelt<'_>>; 6] = [None; 6];
        for (slot, s) in each.iter_mut().zip(spellings.each(broad, self.cased)) {
            *slot = Some((s, format_cuts(s)));
        }
        self.routes.iter().position(|r| {
            methods.among(&r.methods)
                && each.iter().flatten().any(|(s, cuts)| {
                    r.path.matches_normal(s, broad)
                        || (r.policy.format_suffix
                            && cuts
                                .iter()
                                .flatten()
                                .any(|s| r.path.matches_normal(s, broad)))
                })
        })
    }

    /// The first route that can never match: each of its methods is taken,
    /// for every path it names, by one earlier route. With the earlier
    /// route's index.
    pub fn unreachable(&self) -> Option<(usize, usize)> {
        for (i, later) in self.routes.iter().enumerate() {
            let takers: Vec<usize> = later
                .methods
                .iter()
                .filter_map(|m| {
                    self.routes[..i]
                        .iter()
                        .position(|r| r.methods.contains(m) && r.path.covers(&later.path))
                })
                .collect();
            if !later.methods.is_empty() && takers.len() == later.methods.len() {
                return Some((i, takers[0]));
            }
        }
        None
    }

    /// The route at `position` (from [`RouteTable::judge`] on this table).
    pub fn at(&self, position: usize) -> &Route {
        &self.routes[position]
    }

    /// The largest `max_response_body` of the routes: no record is longer
    /// than it plus a record's overhead.
    pub fn largest_response_body(&self) -> u64 {
        self.routes
            .iter()
            .map(|r| r.policy.max_response_body)
            .max()
            .unwrap_or(0)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Route> {
        self.routes.iter()
    }

    pub fn len(&self) -> usize {
        self.routes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderName, HeaderValue};
    use proptest::prelude::*;

    fn segments() -> impl Strategy<Value = Vec<String>> {
        let segment =
            "[a-z0-9_.~-]{1,8}".prop_filter("not a dot segment", |s| s != "." && s != "..");
        proptest::collection::vec(segment, 1..6)
    }

    proptest! {
        #[test]
        fn a_literal_path_matches_itself_only(segs in segments(), extra in "[a-z0-9]{1,8}") {
            let path = format!("/{}", segs.join("/"));
            let pat = PathPattern::parse(&path).unwrap();
            prop_assert!(pat.matches(&path));
            let with_slash = format!("{path}/");
            let doubled = format!("/{}", segs.join("//"));
            let longer = format!("{path}/{extra}");
            let shorter = format!("/{}", segs[..segs.len() - 1].join("/"));
            // Other spellings of the same path (docs/reference/behaviour.md#normalised-path)
            // match; other paths do not.
            prop_assert!(pat.matches(&with_slash));
            prop_assert!(pat.matches(&doubled));
            prop_assert!(!pat.matches(&longer));
            prop_assert!(!pat.matches(&shorter) || shorter == path);
        }

        #[test]
        fn a_param_stands_for_any_one_segment(segs in segments(), i in 0usize..6, value in "[a-zA-Z0-9%:@-]{1,12}") {
            let i = i % segs.len();
            let mut pattern = segs.clone();
            pattern[i] = "{p}".to_string();
            let pat = PathPattern::parse(&format!("/{}", pattern.join("/"))).unwrap();
            let mut path = segs.clone();
            path[i] = value;
            let full = format!("/{}", path.join("/"));
            prop_assert!(pat.matches(&full));
            path[i] = String::new();
            let empty = format!("/{}", path.join("/"));
            prop_assert!(!pat.matches(&empty), "an empty segment is not a value: {}", empty);
        }

        #[test]
        fn a_prefix_matches_everything_below_it(segs in segments(), rest in "[a-z0-9/]{0,20}") {
            let base = format!("/{}", segs.join("/"));
            let pat = PathPattern::parse(&format!("{base}/*")).unwrap();
            let below = format!("{base}/{rest}");
            let sibling = format!("{base}x/{rest}");
            prop_assert!(pat.matches(&below));
            prop_assert!(pat.matches(&base), "a prefix also matches nothing after it");
            prop_assert!(!pat.matches(&sibling));
        }

        #[test]
        fn parsing_never_panics(text in "\\PC{0,40}", path in "\\PC{0,40}") {
            if let Ok(p) = PathPattern::parse(&text) {
                let _ = p.matches(&path);
            }
            let _ = normalise(&path);
        }

        #[test]
        fn normalising_is_idempotent_and_keeps_no_empty_or_dot_segment(path in "/[a-zA-Z0-9%./~_-]{0,40}") {
            let once = normalise(&path).into_owned();
            prop_assert_eq!(normalise(&once).into_owned(), once.clone());
            prop_assert!(once.starts_with('/'));
            prop_assert!(once == "/" || once.split('/').skip(1).all(|s| !s.is_empty() && s != "." && s != ".."), "{}", once);
        }

        #[test]
        fn a_covering_route_matches_every_path_the_covered_one_does(
            segs in segments(), i in 0usize..6, value in "[a-z0-9]{1,8}", rest in "[a-z0-9/]{0,12}"
        ) {
            let i = i % segs.len();
            let literal = format!("/{}", segs.join("/"));
            let mut with_param = segs.clone();
            with_param[i] = "{p}".to_string();
            let param = p(&format!("/{}", with_param.join("/")));
            let prefix = p(&format!("/{}/*", segs[..i].join("/")));
            let mut path = segs.clone();
            path[i] = value;
            let path = format!("/{}", path.join("/"));
            prop_assert!(param.covers(&p(&literal)));
            prop_assert!(!p(&literal).covers(&param));
            prop_assert!(prefix.covers(&param) && prefix.covers(&p(&literal)));
            // What covering promises, on paths.
            prop_assert!(param.matches(&path) && prefix.matches(&path));
            // A prefix goes on below where one segment ends: never covered by it.
            let below = p(&(literal.clone() + "/*"));
            prop_assert!(!param.covers(&below));
            let deeper = format!("{}/{}", literal, rest);
            prop_assert!(below.matches(&deeper));
        }
    }

    fn p(s: &str) -> PathPattern {
        PathPattern::parse(s).unwrap()
    }

    #[test]
    fn exact_paths_match_every_spelling_of_themselves() {
        let pat = p("/v1/payments");
        for same in [
            "/v1/payments",
            "/v1/payments/",
            "//v1/payments",
            "/v1//payments//",
            "/v1/%70ayments",
            "/v1/%70%61yments",
            "/%76%31/payments",
            "/v1/./payments",
            "/v1/x/../payments",
            "/v1/payments/.",
            "/../v1/payments",
            "/v1/%2e/payments",
            "/v1/x/%2E%2E/payments",
        ] {
            assert!(pat.matches(same), "{same}");
        }
        for other in [
            "/v1/payment",
            "/v1/payments/x",
            "/v1/payments/..",
            "/v2/../v1/payments/x",
            "/v1/payments.json",
        ] {
            assert!(!pat.matches(other), "{other}");
        }
        // Broadly: what some frameworks also take for the same path.
        for broad in [
            "/v1%2Fpayments",
            "/v1/payments%2F",
            "/v1%5Cpayments",
            "/v1/%50ayments",
            "/V1/PAYMENTS",
            "/v1/payments;jsessionid=1",
            "/v1;x=1/payments",
            "/v1/payments%3Bx",
        ] {
            assert!(pat.matches(broad), "{broad}");
        }
        assert!(p("/v1/payments/").matches("/v1/payments"));
        assert!(p("/v1//payments").matches("/v1/payments"));
        assert!(p("/v1/%70ayments").matches("/v1/payments"));
        assert!(p("/").matches("/"));
        assert!(p("/").matches("//"));
        assert!(p("/").matches("/a/.."));
        assert!(!p("/").matches("/a"));
    }

    fn table(routes: &[(&str, &[&str])]) -> RouteTable {
        RouteTable::new(
            routes
                .iter()
                .map(|(path, methods)| Route {
                    name: RouteName::new(path),
                    methods: methods.iter().map(|m| m.parse().unwrap()).collect(),
                    path: p(path),
                    policy: Arc::new(Policy::default()),
                    series: Default::default(),
                    typical: Default::default(),
                })
                .collect(),
        )
    }

    /// Where `judge` puts a request with no headers.
    impl RouteTable {
        fn position(&self, method: &Method, target: &str) -> Option<usize> {
            self.at_target(method, target, &HeaderMap::new())
        }

        fn at_target(&self, method: &Method, target: &str, headers: &HeaderMap) -> Option<usize> {
            match self.judge(method, &target.parse().unwrap(), headers) {
                Judgement::Protected(i) => Some(i),
                _ => None,
            }
        }
    }

    #[test]
    fn the_exact_match_comes_before_the_broad_one_and_methods_match_in_any_case() {
        let t = table(&[("/v1/Payments", &["POST"]), ("/v1/payments", &["POST"])]);
        let post = Method::POST;
        assert_eq!(t.position(&post, "/v1/payments"), Some(1), "exact first");
        assert_eq!(t.position(&post, "/v1/Payments"), Some(0));
        assert_eq!(
            t.position(&post, "/V1/PAYMENTS"),
            Some(0),
            "broad: the first in file order"
        );
        assert_eq!(t.position(&post, "/v1%2fpayments"), Some(0));
        let lower: Method = "post".parse().unwrap();
        assert_eq!(t.position(&lower, "/v1/payments"), Some(1));
        assert_eq!(t.position(&lower, "/V1%2FPAYMENTS;x"), Some(0));
        assert_eq!(t.position(&Method::GET, "/v1/payments"), None);
        assert_eq!(t.position(&post, "/v1/other"), None);
        assert_eq!(t.position(&post, "/v1/other;%2e"), None);
    }

    fn orders() -> RouteTable {
        table(&[
            ("/v1/payments", &["POST"]),
            ("/v1/orders/{id}/pay", &["POST"]),
            ("/v1/orders/{id}", &["PATCH"]),
        ])
    }

    #[test]
    fn dot_segments_taken_as_a_param_value_are_protected() {
        // Flask, FastAPI, aiohttp and Express 4 run the pay handler with id "." or "..".
        let t = orders();
        for target in [
            "/v1/orders/./pay",
            "/v1/orders/../pay",
            "/v1/orders/%2e/pay",
            "/v1/orders/%2E%2e/pay",
            "/v1/orders/.%2e/pay",
            "//v1//orders/./pay/",
            "/v1/ORDERS/%2e/pay",
        ] {
            assert_eq!(t.position(&Method::POST, target), Some(1), "{target}");
        }
        // Go decodes `%2F` and keeps `\`: its `{id}` is `a\b` here.
        assert_eq!(t.position(&Method::POST, "/v1/orders%2Fa%5Cb/pay"), Some(1));
        assert_eq!(t.position(&Method::POST, "/v1/orders%2F..%5C/pay"), Some(1));
        // Resolved, they are still the paths they lead to.
        assert_eq!(t.position(&Method::POST, "/v1/x/../payments"), Some(0));
        // (A POST of JSON: one of no type might carry `_method`, below.)
        let json: HeaderMap = [(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )]
        .into_iter()
        .collect();
        assert_eq!(
            t.at_target(&Method::POST, "/v1/orders/1/pay/..", &json),
            None
        );
    }

    #[test]
    fn a_format_suffix_is_the_same_path_unless_the_route_opts_out() {
        let t = orders();
        for target in [
            "/v1/payments.json",
            "/v1/payments.xml",
            "/v1/payments.anything-at-all",
            "/v1/payments.",
            "/v1/payments.json/",
            "/v1/payments%2Ejson",
            "/v1/PAYMENTS.JSON",
            "/v1/payments/.json",
        ] {
            assert_eq!(t.position(&Method::POST, target), Some(0), "{target}");
        }
        assert_eq!(t.position(&Method::POST, "/v1/orders/7/pay.json"), Some(1));
        // Rails matches before decoding: `xml%2ejson` is one format.
        assert_eq!(
            t.position(&Method::POST, "/v1/payments.xml%2ejson"),
            Some(0)
        );
        // From the first dot too: when in doubt, protect.
        assert_eq!(t.position(&Method::POST, "/v1/payments.tar.gz"), Some(0));
        assert_eq!(t.position(&Method::POST, "/v1/paymentsjson"), None);
        let strict = Policy {
            format_suffix: false,
            ..Policy::default()
        };
        let t = RouteTable::new(vec![Route {
            name: RouteName::new("csv"),
            methods: vec![Method::POST],
            path: p("/v1/report"),
            policy: Arc::new(strict),
            series: Default::default(),
            typical: Default::default(),
        }]);
        assert_eq!(t.position(&Method::POST, "/v1/report"), Some(0));
        assert_eq!(t.position(&Method::POST, "/v1/report.csv"), None);
    }

    #[test]
    fn without_format_suffix_cuts_the_last_segments_last_dot() {
        assert_eq!(
            without_format_suffix("/v1/payments.json"),
            Some("/v1/payments")
        );
        assert_eq!(without_format_suffix("/a.b/c.d.e"), Some("/a.b/c.d"));
        assert_eq!(without_format_suffix("/a/.json"), Some("/a"));
        assert_eq!(without_format_suffix("/.json"), Some("/"));
        assert_eq!(without_format_suffix("/a.b/c"), None);
        assert_eq!(without_format_suffix("/a/.."), None);
        assert_eq!(without_format_suffix("/a/."), None);
    }

    #[test]
    fn control_characters_are_refused_on_methods_a_route_names() {
        let t = orders();
        let judge =
            |m: Method, target: &str| t.judge(&m, &target.parse().unwrap(), &HeaderMap::new());
        for target in [
            "/v1/payments%0a",
            "/v1/payments%0A",
            "/v1/payments%0d%0a",
            "/v1/payments%09",
            "/v1/payments%00",
            "/v1/payments%7f",
            "/elsewhere%1f/x",
            "/v1/payments?x=%00",
        ] {
            assert_eq!(judge(Method::POST, target), Judgement::Refused, "{target}");
            assert_eq!(judge(Method::PATCH, target), Judgement::Refused, "{target}");
            assert_eq!(
                judge(Method::GET, target),
                Judgement::Unprotected,
                "{target}"
            );
        }
        for fine in [
            "/v1/payments%20",
            "/v1/payments?x=%0a",
            "/v1/payments%250a",
            "/v1/%C3%BC",
        ] {
            assert_ne!(judge(Method::POST, fine), Judgement::Refused, "{fine}");
        }
        // A method override names a method a route takes: refused too.
        let mut headers = HeaderMap::new();
        headers.insert("x-http-method-override", "PATCH".parse().unwrap());
        let target = "/v1/orders/1%0a".parse().unwrap();
        assert_eq!(t.judge(&Method::GET, &target, &headers), Judgement::Refused);
    }

    #[test]
    fn a_method_override_is_judged_as_the_method_it_names() {
        let t = orders();
        let with = |name: &str, value: &str| {
            let mut h = HeaderMap::new();
            h.insert(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
            h
        };
        for name in [
            "X-HTTP-Method-Override",
            "X-HTTP-Method",
            "X-Method-Override",
        ] {
            for value in ["PATCH", "patch", " PATCH ", "PATCH, GET", "GET,PATCH"] {
                let h = with(name, value);
                assert_eq!(
                    t.at_target(&Method::POST, "/v1/orders/9", &h),
                    Some(2),
                    "{name}: {value}"
                );
            }
        }
        let none = with("content-type", "application/json");
        assert_eq!(t.at_target(&Method::POST, "/v1/orders/9", &none), None);
        assert_eq!(
            t.at_target(&Method::POST, "/v1/orders/9?x_method=PATCH", &none),
            None
        );
        // A `_method` query key, decoded as frameworks decode it (Node
        // decodes keys and `+`, PHP takes `.` for `_`).
        for query in [
            "_method=PATCH",
            "a=1&_method=%50ATCH",
            "%5Fmethod=PATCH",
            "_metho%64=patch",
            ".method=PATCH",
            "_method=+PATCH+",
            "_METHOD=PATCH",
        ] {
            let target = format!("/v1/orders/9?{query}");
            assert_eq!(
                t.at_target(&Method::POST, &target, &none),
                Some(2),
                "{query}"
            );
        }
        // Override headers as frameworks read them: puma takes `_` for `-`;
        // Express's `trim()` takes a latin-1 no-break space.
        for (name, value) in [
            ("x_http_method_override", &b"PATCH"[..]),
            ("x-http-method_override", b"patch"),
            ("x-http-method-override", b"PATCH\xa0"),
            ("x-http-method", b"\xa0patch\xa0"),
        ] {
            let mut h = none.clone();
            let name = HeaderName::from_bytes(name.as_bytes()).unwrap();
            h.insert(name.clone(), HeaderValue::from_bytes(value).unwrap());
            assert_eq!(
                t.at_target(&Method::POST, "/v1/orders/9", &h),
                Some(2),
                "{name}"
            );
        }
        // A form body may carry `_method` (Rails): every method. Rack parses
        // any multipart body, and one of no type, as a form.
        for form in [
            "application/x-www-form-urlencoded",
            "Multipart/Form-Data; boundary=x",
            "multipart/mixed; boundary=x",
            "",
        ] {
            let form = with("content-type", form);
            assert_eq!(t.at_target(&Method::POST, "/v1/orders/9", &form), Some(2));
            assert_eq!(t.at_target(&Method::PUT, "/v1/orders/9", &form), None);
        }
        assert_eq!(
            t.at_target(&Method::POST, "/v1/orders/9", &HeaderMap::new()),
            Some(2)
        );
        // `post` too (hyper takes it for a method of its own).
        let lower: Method = "post".parse().unwrap();
        assert_eq!(
            t.at_target(&lower, "/v1/orders/9", &HeaderMap::new()),
            Some(2)
        );
    }

    #[test]
    fn a_route_with_capitals_protects_every_letter_case() {
        // Express ignores case: `/v1/paymentintents` runs `/v1/paymentIntents`.
        let t = table(&[("/v1/paymentIntents", &["POST"])]);
        for target in [
            "/v1/paymentIntents",
            "/v1/paymentintents",
            "/V1/PAYMENTINTENTS",
        ] {
            assert_eq!(t.position(&Method::POST, target), Some(0), "{target}");
        }
    }

    #[test]
    fn normalising_borrows_a_normal_path_and_keeps_reserved_escapes() {
        // A stray `%` does not make an escape of what is decoded after it
        // (found by the property below): normalising twice changes nothing.
        assert_eq!(normalise("/%%30a"), "/%250a");
        assert_eq!(normalise("/%250a"), "/%250a");
        assert_eq!(normalise("/a%/b%2"), "/a%25/b%252");
        assert!(matches!(normalise("/v1/payments"), Cow::Borrowed(_)));
        assert!(matches!(normalise("/"), Cow::Borrowed(_)));
        assert_eq!(normalise("/a/%2f/%7e%41"), "/a/%2F/~A");
        assert_eq!(normalise("/a/%zz/%4"), "/a/%25zz/%254");
        assert_eq!(normalise("/a/ü/%c3%bc"), "/a/ü/%C3%BC");
        assert_eq!(normalise("*"), "*");
    }

    #[test]
    fn covering_follows_methods_order_and_shapes() {
        assert!(p("/v1/payments").covers(&p("/v1/payments/")));
        assert!(p("/v1/{id}").covers(&p("/v1/payments")));
        assert!(!p("/v1/payments").covers(&p("/v1/{id}")));
        assert!(p("/v1/*").covers(&p("/v1/payments")));
        assert!(p("/v1/*").covers(&p("/v1")));
        assert!(p("/v1/*").covers(&p("/v1/x/*")));
        assert!(!p("/v1/x/*").covers(&p("/v1/*")));
        assert!(!p("/v1/payments").covers(&p("/v1/payments/*")));
        assert!(!p("/v1/payments").covers(&p("/v1/refunds")));
        assert!(p("/*").covers(&p("/")));
    }

    #[test]
    fn params_take_one_nonempty_segment() {
        let pat = p("/v1/orders/{id}/pay");
        assert!(pat.matches("/v1/orders/42/pay"));
        assert!(!pat.matches("/v1/orders//pay"));
        assert!(!pat.matches("/v1/orders/4/2/pay"));
        assert!(!pat.matches("/v1/orders/42"));
    }

    #[test]
    fn trailing_star_is_a_prefix() {
        let pat = p("/v1/orders/*");
        assert!(pat.matches("/v1/orders/"));
        assert!(pat.matches("/v1/orders/1"));
        assert!(pat.matches("/v1/orders/1/2"));
        assert!(pat.matches("/v1/orders"));
        assert!(!pat.matches("/v1/ordersx"));
        assert!(p("/*").matches("/anything/at/all"));
        assert!(p("/*").matches("/"));
    }

    #[test]
    fn bad_patterns_are_rejected() {
        for bad in [
            "v1",
            "/a/*/b",
            "/a*",
            "/{}",
            "/{a",
            "/x{a}",
            "/{a}/{a}",
            "/a?b=1",
            "/a b",
            "/a/../b",
            "/./a",
            "/a/%2e%2e",
        ] {
            assert!(PathPattern::parse(bad).is_err(), "{bad} should be rejected");
        }
    }
}
