//! The route table: (method, path pattern) → the policy of the first matching route.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use http::Method;

/// (A metric label as much as a route's name: the metrics own it.)
pub use crate::metrics::RouteName;
use crate::policy::Policy;

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

    /// Does the request path (without its query) match, once normalised, or
    /// broadly (see [`RouteTable::position`])?
    pub fn matches(&self, path: &str) -> bool {
        self.matches_normal(&normalise(path), false)
            || self.matches_normal(&broaden(path).unwrap_or_default(), true)
            || self.matches_normal(&normalise(path), true)
    }

    /// Does a path [`normalise`] made match? `broad`: a path [`broaden`]
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
    let mut segments: Vec<Cow<'_, str>> = Vec::new();
    for raw in path.split('/').filter(|s| !s.is_empty()) {
        let seg = decode_unreserved(raw);
        match &*seg {
            "." => {}
            ".." => {
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

/// The broad form of a path, for what some upstream frameworks do beyond
/// [`normalise`]: every escape decoded (`%2F` included: WSGI servers, Go's
/// `URL.Path`, nginx's `proxy_pass` with a URI decode before routing), `\`
/// taken as `/` (IIS), `;parameters` cut from each segment (Servlet
/// containers, Spring), then normalised. None when the path has none of `%`,
/// `;` or `\` (then only letter case can differ, which the broad match
/// ignores). Never forwarded: the upstream gets the request-target as sent.
pub fn broaden(path: &str) -> Option<String> {
    if !path.bytes().any(|b| matches!(b, b'%' | b';' | b'\\')) {
        return None;
    }
    let decoded = decode_all(path);
    let text = String::from_utf8_lossy(&decoded).replace('\\', "/");
    let mut cut = String::with_capacity(text.len());
    for (i, seg) in text.split('/').enumerate() {
        if i > 0 {
            cut.push('/');
        }
        cut.push_str(seg.split(';').next().unwrap_or(""));
    }
    Some(normalise(&cut).into_owned())
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

/// Routes in file order; the first whose method and path match wins.
#[derive(Debug, Default)]
pub struct RouteTable {
    routes: Vec<Route>,
}

impl RouteTable {
    pub fn new(routes: Vec<Route>) -> Self {
        RouteTable { routes }
    }

    pub fn find(&self, method: &Method, path: &str) -> Option<&Route> {
        self.position(method, path).map(|i| &self.routes[i])
    }

    /// Where in the table the first route for `method` and `path` is
    /// (the path normalised once, for every route).
    ///
    /// Two passes: the normalised path (docs/reference/behaviour.md#normalised-path) against
    /// the routes as written;
    /// then, when that finds none and the path has anything more to undo, its
    /// broad form ([`broaden`]) with letters in any case, as upstream
    /// frameworks read paths in ways the proxy cannot know (Express and
    /// ASP.NET ignore case, WSGI decodes `%2F`, Tomcat cuts `;jsessionid`).
    /// Protecting a path the upstream takes for another costs a key; missing
    /// one it takes for a protected path costs a second execution. The
    /// method matches in any case too (`post`: hyper takes it as an
    /// extension method, and some frameworks upper-case it).
    pub fn position(&self, method: &Method, path: &str) -> Option<usize> {
        if self.routes.is_empty() {
            return None;
        }
        let normal = normalise(path);
        let found = self.first(method, &normal, false);
        if found.is_some() {
            return found;
        }
        match broaden(path) {
            Some(broad) => self.first(method, &broad, true),
            None if normal.bytes().any(|b| b.is_ascii_uppercase()) => {
                self.first(method, &normal, true)
            }
            None if method.as_str().bytes().any(|b| b.is_ascii_lowercase()) => {
                self.first(method, &normal, false)
            }
            None => None,
        }
    }

    fn first(&self, method: &Method, path: &str, broad: bool) -> Option<usize> {
        let same = |m: &Method| m == method || m.as_str().eq_ignore_ascii_case(method.as_str());
        self.routes
            .iter()
            .position(|r| r.methods.iter().any(same) && r.path.matches_normal(path, broad))
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

    /// The route at `position` (from [`RouteTable::position`] on this table).
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
