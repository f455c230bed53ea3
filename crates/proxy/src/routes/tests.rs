//! The route table's tests: patterns, spellings, methods, judgements.

use std::borrow::Cow;

use super::spelling::without_format_suffix;
use super::*;
use http::{HeaderName, HeaderValue};
use proptest::prelude::*;

fn segments() -> impl Strategy<Value = Vec<String>> {
    let segment = "[a-z0-9_.~-]{1,8}".prop_filter("not a dot segment", |s| s != "." && s != "..");
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
    let judge = |m: Method, target: &str| t.judge(&m, &target.parse().unwrap(), &HeaderMap::new());
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
