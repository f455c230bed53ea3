//! The route table: (method, path pattern) → the policy of the first matching route.

mod method;
mod pattern;
mod spelling;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use http::{HeaderMap, Method, Uri};

/// (A metric label as much as a route's name: the metrics own it.)
pub(crate) use crate::metrics::RouteName;
use crate::policy::{Mode, Policy};

use self::method::{is_form, is_post, Methods};
pub(crate) use self::pattern::PathPattern;
pub(crate) use self::spelling::normalise;
use self::spelling::{format_cuts, has_control, Spellings};

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
    pub(crate) fn largest_response_body(&self) -> u64 {
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
