//! The generator of spellings: random compositions of the ways a client can spell a
//! protected request that some framework may still route to the protected handler.
//!
//! Seeded and deterministic: one seed gives the same spellings on every machine, so a
//! violation seen in CI is replayed with `IDEMPROXY_AGREEMENT_SEED`. A SplitMix64 of our
//! own rather than proptest's runner: the cases are made once and sent to eight
//! upstreams, and every violation is reported, not shrunk to the first.

use std::fmt;

/// SplitMix64 (Steele, Lea, Flood 2014): small, seedable, good enough to pick mutations.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// True with probability `percent` in 100.
    pub fn percent(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// The protected routes, the same in every upstream and in the proxy's configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Route {
    /// `POST /v1/payments`
    Payments,
    /// `POST /v1/orders/{id}/pay`
    Pay,
    /// `PATCH /v1/orders/{id}`
    Order,
}

impl Route {
    pub const ALL: [Route; 3] = [Route::Payments, Route::Pay, Route::Order];

    pub fn method(self) -> &'static str {
        match self {
            Route::Payments | Route::Pay => "POST",
            Route::Order => "PATCH",
        }
    }

    fn segments(self, id: &str) -> Vec<Vec<u8>> {
        let s = |x: &str| x.as_bytes().to_vec();
        match self {
            Route::Payments => vec![s("v1"), s("payments")],
            Route::Pay => vec![s("v1"), s("orders"), s(id), s("pay")],
            Route::Order => vec![s("v1"), s("orders"), s(id)],
        }
    }

    /// Where the `{id}` segment is, if the route has one.
    fn param(self) -> Option<usize> {
        match self {
            Route::Payments => None,
            Route::Pay | Route::Order => Some(2),
        }
    }
}

/// One kind of change to a canonical request; a case is a composition of a few.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mutation {
    /// A `.` segment (`.`, `%2e`, `%2E`) somewhere.
    DotSegment,
    /// `x/..` somewhere (resolves to the same path), or a bare `..` (eats a segment).
    DotDot,
    /// `.` or `..`, plain or encoded, as the value of `{id}` (or of another segment).
    DotParam,
    /// Some characters of a segment percent-encoded, each hex digit in either case.
    PercentEncode,
    /// A separator doubled or tripled.
    RepeatedSlash,
    /// A slash at the end.
    TrailingSlash,
    /// A separator spelt `\`, `%5C` or `%5c`.
    Backslash,
    /// A separator spelt `%2F` or `%2f`.
    EncodedSlash,
    /// `;params` on a segment.
    Params,
    /// A format suffix: `.json`, `.xml`, random text.
    Suffix,
    /// Whitespace or a control character at the end of a segment, raw or encoded.
    Junk,
    /// `http://host:port/...` as the request-target.
    AbsoluteForm,
    /// Letter case of a segment.
    SegmentCase,
    /// Letter case of the method.
    MethodCase,
    /// `X-HTTP-Method-Override` and its cousins.
    MethodOverride,
    /// A form body with `_method=PATCH` (Rack::MethodOverride reads it).
    FormMethod,
    /// A query string.
    Query,
    /// Sent over HTTP/2 (h2c, prior knowledge) instead of HTTP/1.1.
    Http2,
}

impl Mutation {
    /// What a case is composed of ([`Mutation::Http2`] is chosen apart: a quarter of the cases).
    const COMPOSABLE: [Mutation; 17] = [
        Mutation::DotSegment,
        Mutation::DotDot,
        Mutation::DotParam,
        Mutation::PercentEncode,
        Mutation::RepeatedSlash,
        Mutation::TrailingSlash,
        Mutation::Backslash,
        Mutation::EncodedSlash,
        Mutation::Params,
        Mutation::Suffix,
        Mutation::Junk,
        Mutation::AbsoluteForm,
        Mutation::SegmentCase,
        Mutation::MethodCase,
        Mutation::MethodOverride,
        Mutation::FormMethod,
        Mutation::Query,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mutation::DotSegment => "dot-segment",
            Mutation::DotDot => "dot-dot",
            Mutation::DotParam => "dot-param",
            Mutation::PercentEncode => "percent-encode",
            Mutation::RepeatedSlash => "repeated-slash",
            Mutation::TrailingSlash => "trailing-slash",
            Mutation::Backslash => "backslash",
            Mutation::EncodedSlash => "encoded-slash",
            Mutation::Params => "params",
            Mutation::Suffix => "suffix",
            Mutation::Junk => "junk",
            Mutation::AbsoluteForm => "absolute-form",
            Mutation::SegmentCase => "segment-case",
            Mutation::MethodCase => "method-case",
            Mutation::MethodOverride => "method-override",
            Mutation::FormMethod => "form-method",
            Mutation::Query => "query",
            Mutation::Http2 => "http2",
        }
    }
}

/// One spelling of a protected request, sent twice with one key.
#[derive(Clone, Debug)]
pub struct Case {
    pub number: usize,
    pub method: String,
    /// The path as it goes on the wire: each segment with the separator before it.
    path: Vec<u8>,
    query: Vec<u8>,
    /// `Some(scheme)` for an absolute-form target (`http`, `HTTP`).
    absolute: Option<&'static str>,
    /// Request headers beyond the fixed ones (the method overrides).
    pub headers: Vec<(String, String)>,
    /// `Some(method)`: a form body `_method=<method>` instead of `{}`.
    form_method: Option<&'static str>,
    pub http2: bool,
    /// What was applied, sorted, each once.
    pub mutations: Vec<Mutation>,
}

impl Case {
    /// The request-target for a proxy at `authority` (`127.0.0.1:port`).
    pub fn target(&self, authority: &str) -> Vec<u8> {
        let mut t = Vec::new();
        if let Some(scheme) = self.absolute {
            t.extend_from_slice(format!("{scheme}://{authority}").as_bytes());
        }
        t.extend_from_slice(&self.path);
        t.extend_from_slice(&self.query);
        t
    }

    /// The content type and the body.
    pub fn body(&self) -> (&'static str, &'static str) {
        match self.form_method {
            Some("PATCH") => ("application/x-www-form-urlencoded", "_method=PATCH"),
            // No type at all: Rack parses such a POST body as a form too.
            Some("none") => ("", "_method=PATCH"),
            Some(_) => ("application/x-www-form-urlencoded", "_method=patch"),
            None => ("application/json", "{}"),
        }
    }

    /// The path and query as an HTTP/2 `:path`.
    pub fn path_and_query(&self) -> Vec<u8> {
        let mut t = self.path.clone();
        t.extend_from_slice(&self.query);
        t
    }

    /// The composition, e.g. `dot-param+suffix` (`canonical` for none).
    pub fn kinds(&self) -> String {
        if self.mutations.is_empty() {
            return "canonical".to_string();
        }
        let names: Vec<&str> = self.mutations.iter().map(|m| m.name()).collect();
        names.join("+")
    }

    pub fn is_canonical(&self) -> bool {
        self.mutations.is_empty()
    }

    /// Whether the path holds a control character, raw or percent-encoded (`%00`–`%1F`,
    /// `%7F`): what the proxy refuses outright on a protected method (docs/routes-and-keys.md#what-is-refused).
    pub fn has_control(&self) -> bool {
        let p = &self.path;
        p.iter().any(|&b| b < 0x20 || b == 0x7f)
            || p.windows(3).any(|w| {
                w[0] == b'%'
                    && matches!((w[1], w[2].to_ascii_uppercase()), (b'0' | b'1', b'0'..=b'9' | b'A'..=b'F') | (b'7', b'F'))
            })
    }
}

impl fmt::Display for Case {
    /// The request line and the extra headers, bytes escaped (`\r`, `\x00`, ...).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let proto = if self.http2 { "HTTP/2" } else { "HTTP/1.1" };
        write!(
            f,
            "{} {} {proto}",
            self.method.as_bytes().escape_ascii(),
            self.target("PROXY").escape_ascii()
        )?;
        for (name, value) in &self.headers {
            write!(f, " + {name}: {value}")?;
        }
        if self.form_method.is_some() {
            write!(f, " + body {}", self.body().1)?;
        }
        Ok(())
    }
}

/// The canonical spelling of each route (ids fixed), which must run exactly once.
pub fn canonical() -> Vec<Case> {
    Route::ALL
        .iter()
        .enumerate()
        .map(|(i, &route)| {
            let mut b = Builder::new(route, "c1d2");
            b.number = i;
            b.finish()
        })
        .collect()
}

/// `n` random spellings from `seed`, numbered after the canonical ones.
pub fn generate(seed: u64, n: usize) -> Vec<Case> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|i| {
            let route = *rng.pick(&Route::ALL);
            let id = random_id(&mut rng);
            let mut b = Builder::new(route, &id);
            b.number = Route::ALL.len() + i;
            let count = match rng.below(100) {
                0..=39 => 1,
                40..=74 => 2,
                75..=92 => 3,
                _ => 4,
            };
            for _ in 0..count {
                let m = *rng.pick(&Mutation::COMPOSABLE);
                b.apply(m, &mut rng);
            }
            if rng.percent(25) {
                b.apply(Mutation::Http2, &mut rng);
            }
            b.finish()
        })
        .collect()
}

fn random_id(rng: &mut Rng) -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let len = 1 + rng.below(8);
    (0..len).map(|_| *rng.pick(ALPHABET) as char).collect()
}

fn random_text(rng: &mut Rng) -> Vec<u8> {
    random_id(rng).into_bytes()
}

/// A case under construction: the path as (separator, segment) pairs.
struct Builder {
    number: usize,
    route: Route,
    method: String,
    parts: Vec<(Vec<u8>, Vec<u8>)>,
    /// Where `{id}` now is in `parts` (moves when segments are inserted before it).
    param: Option<usize>,
    query: Vec<u8>,
    absolute: Option<&'static str>,
    headers: Vec<(String, String)>,
    form_method: Option<&'static str>,
    http2: bool,
    mutations: Vec<Mutation>,
}

impl Builder {
    fn new(route: Route, id: &str) -> Builder {
        Builder {
            number: 0,
            route,
            method: route.method().to_string(),
            parts: route
                .segments(id)
                .into_iter()
                .map(|s| (b"/".to_vec(), s))
                .collect(),
            param: route.param(),
            query: Vec::new(),
            absolute: None,
            headers: Vec::new(),
            form_method: None,
            http2: false,
            mutations: Vec::new(),
        }
    }

    fn insert(&mut self, at: usize, part: (Vec<u8>, Vec<u8>)) {
        self.parts.insert(at, part);
        if let Some(p) = self.param.as_mut() {
            if *p >= at {
                *p += 1;
            }
        }
    }

    fn apply(&mut self, m: Mutation, rng: &mut Rng) {
        let slash = || b"/".to_vec();
        let n = self.parts.len();
        match m {
            Mutation::DotSegment => {
                let dot = rng.pick(&[".", "%2e", "%2E"]).as_bytes().to_vec();
                let at = rng.below(n + 1);
                self.insert(at, (slash(), dot));
            }
            Mutation::DotDot => {
                let dd = rng
                    .pick(&["..", "%2e%2e", "%2E%2e", ".%2e", "%2E.", "%2e%2E"])
                    .as_bytes()
                    .to_vec();
                let at = rng.below(n + 1);
                if rng.percent(70) {
                    self.insert(at, (slash(), dd));
                    self.insert(at, (slash(), random_text(rng)));
                } else {
                    // A bare `..`: eats the segment before it (or none at the root).
                    self.insert(at, (slash(), dd));
                }
            }
            Mutation::DotParam => {
                let dot = rng
                    .pick(&[".", "..", "%2e", "%2E", "%2e%2e", "%2E.", ".%2E"])
                    .as_bytes()
                    .to_vec();
                let at = match self.param {
                    Some(p) if rng.percent(80) => p,
                    _ => rng.below(n),
                };
                self.parts[at].1 = dot;
            }
            Mutation::PercentEncode => {
                let at = rng.below(n);
                let seg = std::mem::take(&mut self.parts[at].1);
                let mut out = Vec::new();
                let all = rng.percent(30);
                for b in seg {
                    if all || rng.percent(40) {
                        out.extend_from_slice(&encode(b, rng));
                    } else {
                        out.push(b);
                    }
                }
                self.parts[at].1 = out;
            }
            Mutation::RepeatedSlash => {
                let at = rng.below(n);
                self.parts[at].0 = rng.pick(&["//", "///"]).as_bytes().to_vec();
            }
            Mutation::TrailingSlash => {
                self.insert(n, (slash(), Vec::new()));
            }
            Mutation::Backslash => {
                let at = if rng.percent(85) && n > 1 {
                    1 + rng.below(n - 1)
                } else {
                    0
                };
                self.parts[at].0 = rng.pick(&["\\", "%5C", "%5c"]).as_bytes().to_vec();
            }
            Mutation::EncodedSlash => {
                let at = if n > 1 { 1 + rng.below(n - 1) } else { 0 };
                self.parts[at].0 = rng.pick(&["%2F", "%2f"]).as_bytes().to_vec();
            }
            Mutation::Params => {
                let at = rng.below(n);
                let p = rng.pick(&[";", ";x", ";x=1", ";jsessionid=0a1b", ";v=2;w"]);
                self.parts[at].1.extend_from_slice(p.as_bytes());
            }
            Mutation::Suffix => {
                let at = if rng.percent(80) { n - 1 } else { rng.below(n) };
                let mut suffix = b".".to_vec();
                match rng.below(6) {
                    5 => {} // a bare dot
                    0 => suffix.extend_from_slice(b"json"),
                    1 => suffix.extend_from_slice(b"xml"),
                    2 => suffix.extend_from_slice(b"html"),
                    3 => suffix = b"%2ejson".to_vec(),
                    _ => suffix.extend_from_slice(&random_text(rng)),
                }
                self.parts[at].1.extend_from_slice(&suffix);
            }
            Mutation::Junk => {
                const JUNK: &[&[u8]] = &[
                    // Raw: what an HTTP/1.1 request line can carry at all.
                    b" ",
                    b"\t",
                    b"\x0b",
                    b"\x0c",
                    b"\x7f",
                    b"\x00",
                    b"\x85",
                    b"\xa0",
                    // Encoded.
                    b"%20",
                    b"%09",
                    b"%0a",
                    b"%0A",
                    b"%0d",
                    b"%0D",
                    b"%0d%0a",
                    b"%00",
                    b"%7f",
                    b"%7F",
                    b"%0b",
                    b"%0c",
                    b"%1f",
                    b"%C2%85",
                    b"%C2%A0",
                    b"%E2%80%A8",
                ];
                let at = if rng.percent(70) { n - 1 } else { rng.below(n) };
                let junk = *rng.pick(JUNK);
                self.parts[at].1.extend_from_slice(junk);
            }
            Mutation::AbsoluteForm => {
                self.absolute = Some(*rng.pick(&["http", "http", "HTTP"]));
            }
            Mutation::SegmentCase => {
                let at = rng.below(n);
                let seg = &mut self.parts[at].1;
                match rng.below(3) {
                    0 => seg.make_ascii_uppercase(),
                    1 => {
                        if let Some(b) = seg.first_mut() {
                            b.make_ascii_uppercase();
                        }
                    }
                    _ => {
                        for b in seg.iter_mut() {
                            if rng.percent(50) {
                                b.make_ascii_uppercase();
                            }
                        }
                    }
                }
            }
            Mutation::MethodCase => {
                self.method = match rng.below(3) {
                    0 => self.method.to_ascii_lowercase(),
                    1 => {
                        let lower = self.method.to_ascii_lowercase();
                        format!("{}{}", &self.method[..1], &lower[1..])
                    }
                    _ => self
                        .method
                        .chars()
                        .map(|c| {
                            if rng.percent(50) {
                                c.to_ascii_lowercase()
                            } else {
                                c
                            }
                        })
                        .collect(),
                };
            }
            Mutation::MethodOverride => {
                let name = *rng.pick(&[
                    "X-HTTP-Method-Override",
                    "X-HTTP-Method",
                    "X-Method-Override",
                    // puma maps `_` and `-` to one CGI name.
                    "X_HTTP_METHOD_OVERRIDE",
                    "X-HTTP-Method_Override",
                ]);
                let value = if self.route == Route::Order || rng.percent(30) {
                    // The protected method, asked for by a POST.
                    let wanted = self.route.method();
                    self.method = "POST".to_string();
                    if self.route == Route::Order {
                        rng.pick(&["PATCH", "patch", "Patch"]).to_string()
                    } else {
                        wanted.to_string()
                    }
                } else {
                    rng.pick(&["PATCH", "PUT", "DELETE", "GET"]).to_string()
                };
                self.headers.push((name.to_string(), value));
            }
            Mutation::FormMethod => {
                // A POST that asks to be run as the protected PATCH (or as PATCH at all).
                self.method = "POST".to_string();
                self.form_method = Some(*rng.pick(&["PATCH", "patch", "none"]));
            }
            Mutation::Query => {
                let q = rng.pick(&[
                    "?",
                    "?x=1",
                    "?format=json",
                    "?a=/../b",
                    "?_method=PATCH",
                    "?%5Fmethod=PATCH",
                    "?_metho%64=patch",
                    "?%2e%2e",
                    "#f",
                    "?x=1#f",
                ]);
                self.query = q.as_bytes().to_vec();
            }
            Mutation::Http2 => self.http2 = true,
        }
        if !self.mutations.contains(&m) {
            self.mutations.push(m);
        }
    }

    fn finish(mut self) -> Case {
        let mut path = Vec::new();
        for (sep, seg) in &self.parts {
            path.extend_from_slice(sep);
            path.extend_from_slice(seg);
        }
        if self.http2 {
            // An absolute form has no meaning in HTTP/2 (:scheme and :authority are always
            // sent); and a :path must be one the http crate carries byte for byte.
            self.absolute = None;
            self.mutations.retain(|m| *m != Mutation::AbsoluteForm);
            let mut pq = path.clone();
            pq.extend_from_slice(&self.query);
            if !h2_carries(&self.method, &pq) {
                self.http2 = false;
                self.mutations.retain(|m| *m != Mutation::Http2);
            }
        }
        self.mutations.sort();
        Case {
            number: self.number,
            method: self.method,
            path,
            query: self.query,
            absolute: self.absolute,
            headers: self.headers,
            form_method: self.form_method,
            http2: self.http2,
            mutations: self.mutations,
        }
    }
}

/// `%XY` for `b`, each hex digit in either case.
fn encode(b: u8, rng: &mut Rng) -> Vec<u8> {
    let hex = format!("{b:02X}");
    let mut out = b"%".to_vec();
    for c in hex.bytes() {
        out.push(if rng.percent(50) {
            c.to_ascii_lowercase()
        } else {
            c
        });
    }
    out
}

/// Whether an HTTP/2 request can carry this method and `:path` exactly.
fn h2_carries(method: &str, path_and_query: &[u8]) -> bool {
    let Ok(pq) = http::uri::PathAndQuery::try_from(path_and_query) else {
        return false;
    };
    http::Method::from_bytes(method.as_bytes()).is_ok() && pq.as_str().as_bytes() == path_and_query
}
