//! The route table: (method, path pattern) → the policy of the first matching route.

use std::fmt;
use std::sync::Arc;

use http::Method;

use crate::policy::Policy;

/// One segment of a path pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(String),
    /// `{name}`: exactly one non-empty segment.
    Param,
}

/// A route path: exact segments, `{param}` for one segment, and an optional
/// trailing `/*` that matches the prefix followed by anything (even nothing).
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
        // `body` is "" for "/*", "/" for the root, else "/a/b" (maybe with a trailing slash).
        let mut names = Vec::new();
        for seg in body.split('/').skip(1) {
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
                segments.push(Segment::Literal(seg.to_string()));
            }
        }
        Ok(PathPattern {
            text: text.to_string(),
            segments,
            prefix,
        })
    }

    /// Does the request path (without its query) match? Trailing slashes are significant.
    pub fn matches(&self, path: &str) -> bool {
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
                Segment::Literal(l) => head == l,
                Segment::Param => !head.is_empty(),
            };
            if !ok {
                return false;
            }
            match tail {
                Some(t) => rest = t,
                None => {
                    // The path ended here: it matches when the pattern ends here too.
                    return i + 1 == last && !self.prefix;
                }
            }
        }
        // The pattern's segments are used up and the path goes on after a '/'.
        // (A pattern with no segments is "/*": every path that starts with '/'.)
        self.prefix || (last == 0 && rest.is_empty())
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for PathPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// A route's name: shared, so that metrics labels and log fields cost no allocation per request.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RouteName(Arc<str>);

impl RouteName {
    pub fn new(name: &str) -> Self {
        RouteName(Arc::from(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for RouteName {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RouteName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl PartialEq<&str> for RouteName {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl prometheus_client::encoding::EncodeLabelValue for RouteName {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder,
    ) -> Result<(), fmt::Error> {
        fmt::Write::write_str(encoder, &self.0)
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

    /// Where in the table the first route for `method` and `path` is.
    pub fn position(&self, method: &Method, path: &str) -> Option<usize> {
        self.routes
            .iter()
            .position(|r| r.methods.iter().any(|m| m == method) && r.path.matches(path))
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
        proptest::collection::vec("[a-z0-9_.~-]{1,8}", 1..6)
    }

    proptest! {
        #[test]
        fn a_literal_path_matches_itself_only(segs in segments(), extra in "[a-z0-9]{1,8}") {
            let path = format!("/{}", segs.join("/"));
            let pat = PathPattern::parse(&path).unwrap();
            prop_assert!(pat.matches(&path));
            let with_slash = format!("{path}/");
            let longer = format!("{path}/{extra}");
            let shorter = format!("/{}", segs[..segs.len() - 1].join("/"));
            prop_assert!(!pat.matches(&with_slash));
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
            prop_assert!(!pat.matches(&base));
            prop_assert!(!pat.matches(&sibling));
        }

        #[test]
        fn parsing_never_panics(text in "\\PC{0,40}", path in "\\PC{0,40}") {
            if let Ok(p) = PathPattern::parse(&text) {
                let _ = p.matches(&path);
            }
        }
    }

    fn p(s: &str) -> PathPattern {
        PathPattern::parse(s).unwrap()
    }

    #[test]
    fn exact_paths_match_exactly() {
        assert!(p("/v1/payments").matches("/v1/payments"));
        assert!(!p("/v1/payments").matches("/v1/payments/"));
        assert!(!p("/v1/payments").matches("/v1/payment"));
        assert!(!p("/v1/payments").matches("/v1/payments/x"));
        assert!(p("/v1/payments/").matches("/v1/payments/"));
        assert!(!p("/v1/payments/").matches("/v1/payments"));
        assert!(p("/").matches("/"));
        assert!(!p("/").matches("/a"));
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
        assert!(!pat.matches("/v1/orders"));
        assert!(!pat.matches("/v1/ordersx"));
        assert!(p("/*").matches("/anything/at/all"));
        assert!(p("/*").matches("/"));
    }

    #[test]
    fn bad_patterns_are_rejected() {
        for bad in [
            "v1", "/a/*/b", "/a*", "/{}", "/{a", "/x{a}", "/{a}/{a}", "/a?b=1", "/a b",
        ] {
            assert!(PathPattern::parse(bad).is_err(), "{bad} should be rejected");
        }
    }
}
