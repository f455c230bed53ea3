//! Canonical JSON: the documented cases, the three faults, and properties over generated values.

use super::*;
use proptest::prelude::*;

fn canon(s: &str) -> Option<String> {
    canonicalize(s.as_bytes()).map(|v| String::from_utf8(v).unwrap())
}

#[test]
fn whitespace_member_order_and_escapes_merge() {
    assert_eq!(
        canon(" {\n\t\"b\" : [ 1 , {\"d\":null,\"c\":true} ] ,\r\"a\":\"x\" } ").as_deref(),
        Some(r#"{"a":"x","b":[1,{"c":true,"d":null}]}"#)
    );
    // Escapes decode, then re-encode one way.
    assert_eq!(
        canon(r#""\u0061\/\u00e9\u00E9""#).as_deref(),
        Some("\"a/éé\"")
    );
    assert_eq!(canon(r#""\ud83d\ude00""#).as_deref(), Some("\"😀\""));
    assert_eq!(
        canon(r#""\"\\\b\f\n\r\t\u0001\u001F\u007f""#).as_deref(),
        Some("\"\\\"\\\\\\b\\f\\n\\r\\t\\u0001\\u001f\u{7f}\"")
    );
    assert_eq!(canon(r#"{"\u0062":1,"a":2}"#), canon(r#"{"a":2,"b":1}"#));
    // Names sort by their decoded UTF-8 bytes (code point order): U+E000 before U+1F600,
    // which RFC 8785's UTF-16 order would put the other way round.
    assert_eq!(
        canon("{\"\u{1F600}\":1,\"\u{E000}\":2,\"\\\"\":3,\"a\":4}").as_deref(),
        Some("{\"\\\"\":3,\"a\":4,\"\u{E000}\":2,\"\u{1F600}\":1}")
    );
    for scalar in [
        "0", "-0", "1.5e-3", "true", "false", "null", "\"\"", "[]", "{}",
    ] {
        assert_eq!(canon(&format!(" {scalar} ")).as_deref(), Some(scalar));
    }
}

#[test]
fn numbers_keep_their_exact_text() {
    let texts = [
        "1",
        "1.0",
        "1e0",
        "1E0",
        "1e+0",
        "10e-1",
        "-0",
        "0",
        "0.0",
        "100000000000000000000",
        "100000000000000000001",
        "0.1000000000000000055511151231257827",
        "0.1",
        "1e400",
    ];
    for (i, a) in texts.iter().enumerate() {
        assert_eq!(canon(&format!("[{a}]")), Some(format!("[{a}]")));
        for b in &texts[i + 1..] {
            assert_ne!(canon(a), canon(b), "{a} vs {b}");
        }
    }
}

#[test]
fn the_faults_of_issue_10_no_longer_merge() {
    // Duplicate member: serde_json kept the last one, so both read as {"amount":1000}.
    assert_eq!(canon(r#"{"amount":1,"amount":1000}"#), None);
    assert_ne!(
        canon(r#"{"amount":1,"amount":1000}"#),
        canon(r#"{"amount":1000}"#)
    );
    // Beyond 64 bits.
    assert_ne!(
        canon(r#"{"amount":100000000000000000000}"#),
        canon(r#"{"amount":100000000000000000001}"#)
    );
    // Beyond double precision.
    assert_ne!(
        canon(r#"{"amount":0.30000000000000000001}"#),
        canon(r#"{"amount":0.3}"#)
    );
}

#[test]
fn refusals_fall_back_to_raw_bytes() {
    for bad in [
        "",
        " ",
        "not json",
        "{\"a\":1,\"\\u0061\":2}",
        "{\"a\":{},\"a\":{}}",
        "[{\"x\":1,\"y\":2,\"x\":3}]",
        "{\"a\":1} x",
        "{\"a\":1}{}",
        "[1,]",
        "{\"a\":1,}",
        "[01]",
        "[1.]",
        "[.5]",
        "[1e]",
        "[+1]",
        "[-]",
        "[0x10]",
        "[NaN]",
        "[Infinity]",
        "[tru]",
        "[True]",
        "{a:1}",
        "{'a':1}",
        "[\"\\ud800\"]",
        "[\"\\udc00\"]",
        "[\"\\ud800\\u0041\"]",
        "[\"\\ud800x\"]",
        "[\"\\x41\"]",
        "[\"\\u12\"]",
        "[\"\\u12G4\"]",
        "[\"raw\ttab\"]",
        "[\"unterminated]",
        "\u{feff}{}",
        "[1]\u{a0}",
    ] {
        assert_eq!(canon(bad), None, "{bad:?}");
    }
    assert_eq!(canonicalize(b"[\"\xff\"]"), None, "invalid UTF-8");
    assert_eq!(canonicalize(b"[\"\xc3\"]"), None, "truncated UTF-8");
}

#[test]
fn depth_is_limited() {
    let nested = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    assert_eq!(canon(&nested(MAX_DEPTH)), Some(nested(MAX_DEPTH)));
    assert_eq!(canon(&nested(MAX_DEPTH + 1)), None);
    let objects = |n: usize| format!("{}1{}", "{\"a\":".repeat(n), "}".repeat(n));
    assert!(canon(&objects(MAX_DEPTH)).is_some());
    assert_eq!(canon(&objects(MAX_DEPTH + 1)), None);
    // Far deeper than any stack would allow without the limit.
    assert_eq!(canon(&"[".repeat(1_000_000)), None);
}

#[test]
fn large_flat_and_wide_bodies_are_handled() {
    let flat = format!("[{}0]", "0,".repeat(200_000));
    assert_eq!(canon(&flat).as_deref(), Some(flat.as_str()));
    let wide: Vec<String> = (0..10_000)
        .rev()
        .map(|i| format!("\"k{i:05}\":{i}"))
        .collect();
    let out = canon(&format!("{{{}}}", wide.join(","))).unwrap();
    assert!(out.starts_with("{\"k00000\":0,\"k00001\":1,"));
}

fn at(body: &str, pointer: &[&str]) -> Option<Pointed> {
    let tokens: Vec<String> = pointer.iter().map(|t| t.to_string()).collect();
    at_pointer(body.as_bytes(), &tokens)
}

#[test]
fn pointers_reach_strings_and_exact_integers() {
    let body = r#"{"id":"evt_1","data":{"object":{"id":"pi_\u0031","n":[10,{"x":-7}]}},
        "a/b":"slash","m~n":"tilde","":"empty name","big":100000000000000000001}"#;
    let s = |v: &str| Some(Pointed::Str(v.to_string()));
    let i = |v: &str| Some(Pointed::Integer(v.to_string()));
    assert_eq!(at(body, &["id"]), s("evt_1"));
    assert_eq!(
        at(body, &["data", "object", "id"]),
        s("pi_1"),
        "escapes decoded"
    );
    assert_eq!(at(body, &["a/b"]), s("slash"));
    assert_eq!(at(body, &["m~n"]), s("tilde"));
    assert_eq!(at(body, &[""]), s("empty name"));
    assert_eq!(at(body, &["big"]), i("100000000000000000001"));
    assert_eq!(at(body, &["data", "object", "n", "0"]), i("10"));
    assert_eq!(at(body, &["data", "object", "n", "1", "x"]), i("-7"));
    assert_eq!(at(body, &["data"]), Some(Pointed::Other));
    assert_eq!(at(body, &["data", "object", "n"]), Some(Pointed::Other));
    for other in ["1.0", "1e3", "-0.5", "true", "false", "null", "[]", "{}"] {
        assert_eq!(
            at(&format!("{{\"id\":{other}}}"), &["id"]),
            Some(Pointed::Other),
            "{other}"
        );
    }
    assert_eq!(at(r#"{"id":-0}"#, &["id"]), i("-0"), "the text as written");
    // Nothing there.
    for missing in [
        &["nope"][..],
        &["id", "x"],
        &["data", "object", "n", "2"],
        &["data", "object", "n", "-"],
        &["data", "object", "n", "01"],
        &["data", "object", "n", "+1"],
        &["data", "object", "n", ""],
        &["data", "object", "n", "99999999999999999999999"],
        &["big", "0"],
    ] {
        assert_eq!(at(body, missing), None, "{missing:?}");
    }
    // Not JSON read exactly: no value, whatever is there.
    assert_eq!(
        at(r#"{"id":"a","id":"b"}"#, &["id"]),
        None,
        "duplicate names"
    );
    assert_eq!(at(r#"{"id":"a"} x"#, &["id"]), None);
    assert_eq!(at("id=a", &["id"]), None);
    assert_eq!(at("", &["id"]), None);
    assert_eq!(at(r#"["a","b"]"#, &["1"]), s("b"));
}

/// A JSON value as a generator sees it; numbers are their text.
#[derive(Clone, Debug, PartialEq)]
enum J {
    Null,
    Bool(bool),
    Num(String),
    Str(String),
    Arr(Vec<J>),
    /// Names are unique and sorted (built from a map).
    Obj(Vec<(String, J)>),
}

/// Equality under arbitrary precision: numbers compare by exact decimal value
/// (so `1`, `1.0` and `10e-1` are equal here), objects as maps.
fn same_value(a: &J, b: &J) -> bool {
    match (a, b) {
        (J::Num(x), J::Num(y)) => decimal(x) == decimal(y),
        (J::Arr(x), J::Arr(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_value(x, y))
        }
        (J::Obj(x), J::Obj(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y)
                    .all(|((kx, x), (ky, y))| kx == ky && same_value(x, y))
        }
        _ => a == b,
    }
}

/// (negative, significant digits, exponent) with no leading or trailing zero digits; zero is (false, "", 0).
fn decimal(text: &str) -> (bool, String, i64) {
    let (neg, t) = match text.strip_prefix('-') {
        Some(t) => (true, t),
        None => (false, text),
    };
    let (mantissa, exp) = match t.find(['e', 'E']) {
        Some(i) => (&t[..i], t[i + 1..].parse::<i64>().unwrap()),
        None => (t, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{int}{frac}");
    let mut exp = exp - frac.len() as i64;
    let digits = digits.trim_start_matches('0');
    let trimmed = digits.trim_end_matches('0');
    exp += (digits.len() - trimmed.len()) as i64;
    if trimmed.is_empty() {
        return (false, String::new(), 0);
    }
    (neg, trimmed.to_string(), exp)
}

/// Number texts that collide often in value but never in text.
const NUMBERS: &[&str] = &[
    "0",
    "-0",
    "0.0",
    "1",
    "1.0",
    "1e0",
    "1E0",
    "1e+0",
    "10e-1",
    "0.1e1",
    "-1",
    "100000000000000000000",
    "100000000000000000001",
    "1e20",
    "0.3",
    "0.30000000000000000001",
    "9007199254740993",
    "9007199254740992",
    "18446744073709551616",
    "-9223372036854775809",
    "1.5e-7",
];

fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        proptest::sample::select(NUMBERS).prop_map(str::to_string),
        "-?(0|[1-9][0-9]{0,24})(\\.[0-9]{1,24})?([eE][+-]?[0-9]{1,3})?",
    ]
}

fn text_char() -> impl Strategy<Value = char> {
    prop_oneof![
        proptest::sample::select(vec![
            'a',
            'b',
            '"',
            '\\',
            '/',
            '\u{0}',
            '\u{8}',
            '\u{1f}',
            '\n',
            '\u{7f}',
            'é',
            '\u{e000}',
            '\u{ffff}',
            '\u{1F600}',
            '\u{2028}',
        ]),
        any::<char>(),
    ]
}

fn name() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        proptest::sample::select(vec!['a', 'b', '"', '\u{e000}', '\u{1F600}']),
        0..3,
    )
    .prop_map(|v| v.into_iter().collect())
}

fn tree() -> impl Strategy<Value = J> {
    let leaf = prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::Bool),
        number().prop_map(J::Num),
        proptest::collection::vec(text_char(), 0..6).prop_map(|v| J::Str(v.into_iter().collect())),
    ];
    leaf.prop_recursive(5, 40, 5, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(J::Arr),
            proptest::collection::btree_map(name(), inner, 0..5)
                .prop_map(|m| J::Obj(m.into_iter().collect())),
        ]
    })
}

/// A tiny deterministic generator for the rendering choices.
struct Choices(u64);

impl Choices {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn ws(c: &mut Choices, out: &mut String) {
    for _ in 0..c.below(3) {
        out.push([' ', '\t', '\n', '\r'][c.below(4) as usize]);
    }
}

fn render_string(s: &str, c: &mut Choices, out: &mut String) {
    out.push('"');
    for ch in s.chars() {
        let short = match ch {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '/' => Some("\\/"),
            '\u{8}' => Some("\\b"),
            '\u{c}' => Some("\\f"),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            _ => None,
        };
        let must_escape = ch == '"' || ch == '\\' || ch < ' ';
        match c.below(3) {
            0 if !must_escape => out.push(ch),
            1 if short.is_some() => out.push_str(short.unwrap_or_default()),
            _ => {
                let mut units = [0u16; 2];
                for u in ch.encode_utf16(&mut units) {
                    if c.below(2) == 0 {
                        out.push_str(&format!("\\u{u:04x}"));
                    } else {
                        out.push_str(&format!("\\u{u:04X}"));
                    }
                }
            }
        }
    }
    out.push('"');
}

/// Renders `j` with random whitespace, member order and escapes.
fn render(j: &J, c: &mut Choices, out: &mut String) {
    ws(c, out);
    match j {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Num(n) => out.push_str(n),
        J::Str(s) => render_string(s, c, out),
        J::Arr(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                render(item, c, out);
            }
            ws(c, out);
            out.push(']');
        }
        J::Obj(members) => {
            let mut order: Vec<&(String, J)> = members.iter().collect();
            for i in (1..order.len()).rev() {
                order.swap(i, c.below(i as u64 + 1) as usize);
            }
            out.push('{');
            for (i, (k, v)) in order.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(c, out);
                render_string(k, c, out);
                ws(c, out);
                out.push(':');
                render(v, c, out);
            }
            ws(c, out);
            out.push('}');
        }
    }
    ws(c, out);
}

fn rendered(j: &J, seed: u64) -> String {
    let mut out = String::new();
    render(j, &mut Choices(seed), &mut out);
    out
}

/// What a mutation did to a tree.
enum Changed {
    /// Still a tree without duplicate names (maybe equal to the original).
    Tree(J),
    /// A rendering in which some object has a member name twice.
    Duplicate(String),
}

/// Changes one leaf or one member name, or repeats a member name, at a place chosen by `c`.
fn mutate(j: &J, c: &mut Choices, replacement: &J, new_name: &str) -> Changed {
    match j {
        J::Arr(items) if !items.is_empty() => {
            let i = c.below(items.len() as u64) as usize;
            match mutate(&items[i], c, replacement, new_name) {
                Changed::Tree(t) => {
                    let mut items = items.clone();
                    items[i] = t;
                    Changed::Tree(J::Arr(items))
                }
                Changed::Duplicate(inner) => {
                    let mut out = String::from("[");
                    for (n, item) in items.iter().enumerate() {
                        if n > 0 {
                            out.push(',');
                        }
                        if n == i {
                            out.push_str(&inner);
                        } else {
                            render(item, c, &mut out);
                        }
                    }
                    out.push(']');
                    Changed::Duplicate(out)
                }
            }
        }
        J::Obj(members) if !members.is_empty() => {
            let i = c.below(members.len() as u64) as usize;
            let mut members = members.clone();
            match c.below(4) {
                0 => {
                    let (_, value) = members.remove(i);
                    let clash = members.iter().any(|(k, _)| k == new_name);
                    members.push((new_name.to_string(), value));
                    if clash {
                        return Changed::Duplicate(render_members(&members, None, c));
                    }
                    members.sort_by(|a, b| a.0.cmp(&b.0));
                    Changed::Tree(J::Obj(members))
                }
                1 => {
                    members.push((members[i].0.clone(), replacement.clone()));
                    Changed::Duplicate(render_members(&members, None, c))
                }
                _ => match mutate(&members[i].1, c, replacement, new_name) {
                    Changed::Tree(t) => {
                        members[i].1 = t;
                        Changed::Tree(J::Obj(members))
                    }
                    Changed::Duplicate(inner) => {
                        Changed::Duplicate(render_members(&members, Some((i, &inner)), c))
                    }
                },
            }
        }
        _ => Changed::Tree(replacement.clone()),
    }
}

/// An object with these members in this order; `raw` puts a ready rendering in place of one value.
fn render_members(members: &[(String, J)], raw: Option<(usize, &str)>, c: &mut Choices) -> String {
    let mut out = String::from("{");
    for (n, (k, v)) in members.iter().enumerate() {
        if n > 0 {
            out.push(',');
        }
        render_string(k, c, &mut out);
        out.push(':');
        match raw {
            Some((i, text)) if i == n => out.push_str(text),
            _ => render(v, c, &mut out),
        }
    }
    out.push('}');
    out
}

fn leaf() -> impl Strategy<Value = J> {
    prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::Bool),
        proptest::sample::select(NUMBERS).prop_map(|n| J::Num(n.to_string())),
        proptest::sample::select(vec!["", "a", "b", "\"", "\u{1F600}"])
            .prop_map(|s| J::Str(s.to_string())),
        Just(J::Arr(vec![])),
        Just(J::Obj(vec![])),
    ]
}

/// Whether every number of `j` is an integer that serde_json keeps as it is written.
fn integers_only(j: &J) -> bool {
    match j {
        J::Num(n) => n != "-0" && (n.parse::<i64>().is_ok() || n.parse::<u64>().is_ok()),
        J::Arr(items) => items.iter().all(integers_only),
        J::Obj(members) => members.iter().all(|(_, v)| integers_only(v)),
        _ => true,
    }
}

fn serde(text: &[u8]) -> Option<serde_json::Value> {
    serde_json::from_slice(text).ok()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// The same value written differently canonicalises alike, to valid JSON
    /// that serde_json reads as it reads the input, and canonicalisation is idempotent.
    #[test]
    fn renderings_of_one_value_agree(j in tree(), s1 in any::<u64>(), s2 in any::<u64>()) {
        let (a, b) = (rendered(&j, s1), rendered(&j, s2));
        let ca = canonicalize(a.as_bytes());
        prop_assert!(ca.is_some(), "refused: {}", a);
        prop_assert_eq!(&ca, &canonicalize(b.as_bytes()), "{} vs {}", a, b);
        let ca = ca.unwrap_or_default();
        prop_assert_eq!(canonicalize(&ca), Some(ca.clone()), "not idempotent");
        // serde_json refuses numbers beyond f64's range (1e400); within it, it reads both alike.
        if let Some(v) = serde(a.as_bytes()) {
            prop_assert_eq!(Some(v), serde(&ca));
        }
    }

    /// Two values canonicalise alike only if they are equal under arbitrary precision,
    /// and in fact only if they are equal with numbers compared by their text.
    #[test]
    fn different_values_never_merge(
        j in tree(),
        seed in any::<u64>(),
        replacement in leaf(),
        new_name in name(),
    ) {
        let mut c = Choices(seed);
        let a = rendered(&j, seed);
        let ca = canonicalize(a.as_bytes());
        match mutate(&j, &mut c, &replacement, &new_name) {
            Changed::Tree(k) => {
                let b = rendered(&k, seed.rotate_left(7));
                let cb = canonicalize(b.as_bytes());
                prop_assert!(cb.is_some());
                if ca == cb {
                    prop_assert!(same_value(&j, &k), "merged: {} and {}", a, b);
                }
                prop_assert_eq!(ca == cb, j == k, "{} vs {}", a, b);
            }
            Changed::Duplicate(b) => {
                prop_assert_eq!(canonicalize(b.as_bytes()), None, "duplicate accepted: {}", b);
            }
        }
    }

    /// For strings and 64-bit integers the output is what the serde_json-based fingerprint
    /// used to hash, so such bodies keep their fingerprint across the upgrade.
    #[test]
    fn plain_bodies_keep_the_previous_canonical_form(j in tree(), seed in any::<u64>()) {
        prop_assume!(integers_only(&j));
        let text = rendered(&j, seed);
        let before: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        prop_assert_eq!(canonicalize(text.as_bytes()), serde_json::to_vec(&before).ok());
    }

    /// Any bytes: no panic; what is accepted is idempotent and read by serde_json as the input.
    #[test]
    fn arbitrary_bytes(raw in proptest::collection::vec(any::<u8>(), 0..64)) {
        if let Some(c) = canonicalize(&raw) {
            prop_assert_eq!(canonicalize(&c), Some(c.clone()));
            if let Some(v) = serde(&raw) {
                prop_assert_eq!(Some(v), serde(&c));
            }
        }
    }

    /// Whatever serde_json accepts (it keeps the last of duplicate members), this accepts
    /// too unless a member name repeats, and both read the same value.
    #[test]
    fn agrees_with_serde_json_on_json_like_text(raw in "[\\[\\]{}:, \"a1.e\\-]{0,24}") {
        if let Some(v) = serde(raw.as_bytes()) {
            match canonicalize(raw.as_bytes()) {
                Some(c) => prop_assert_eq!(Some(v), serde(&c)),
                // Only a repeated member name (which needs two members) is refused.
                None => prop_assert!(raw.matches(':').count() >= 2, "refused {}", raw),
            }
        }
    }

    /// Every value of a generated tree, however it is written, is found at its
    /// pointer as what it is; one step past a leaf, or to a name or index that
    /// is not there, finds nothing.
    #[test]
    fn every_value_is_found_at_its_pointer(j in tree(), seed in any::<u64>()) {
        let text = rendered(&j, seed);
        let canon = canonicalize(text.as_bytes()).unwrap_or_default();
        let mut paths = Vec::new();
        every_path(&j, &mut Vec::new(), &mut paths);
        for (path, value) in paths {
            let expected = match value {
                J::Str(s) => Pointed::Str(s.clone()),
                J::Num(n) if !n.contains(['.', 'e', 'E']) => Pointed::Integer(n.clone()),
                _ => Pointed::Other,
            };
            prop_assert_eq!(at_pointer(text.as_bytes(), &path), Some(expected.clone()), "{:?} in {}", path, text);
            prop_assert_eq!(at_pointer(&canon, &path), Some(expected), "canonical form");
            let absent = match value {
                J::Arr(items) => items.len().to_string(),
                // No generated name has a 'z'.
                J::Obj(_) => "z".to_string(),
                _ => "0".to_string(),
            };
            let mut beyond = path.clone();
            beyond.push(absent);
            prop_assert_eq!(at_pointer(text.as_bytes(), &beyond), None);
        }
    }
}

/// Every value in `j` with the reference tokens that lead to it.
fn every_path<'a>(j: &'a J, path: &mut Vec<String>, out: &mut Vec<(Vec<String>, &'a J)>) {
    out.push((path.clone(), j));
    match j {
        J::Arr(items) => {
            for (i, item) in items.iter().enumerate() {
                path.push(i.to_string());
                every_path(item, path, out);
                path.pop();
            }
        }
        J::Obj(members) => {
            for (name, value) in members {
                path.push(name.clone());
                every_path(value, path, out);
                path.pop();
            }
        }
        _ => {}
    }
}
