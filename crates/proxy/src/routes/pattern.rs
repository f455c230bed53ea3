//! Path patterns: a route's path as configured (exact segments, `{param}`,
//! a trailing `*`), what each matches and covers.

use std::fmt;

use super::spelling::{decode_all, decode_unreserved, Spellings};

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
    pub(super) text: String,
    segments: Vec<Segment>,
    pub(super) prefix: bool,
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
    pub(super) fn matches_normal(&self, path: &str, broad: bool) -> bool {
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
    pub(crate) fn covers(&self, later: &PathPattern) -> bool {
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

impl fmt::Display for PathPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}
