//! A path's spellings: the normalised path routes match, the spellings an
//! upstream might read it as (dot segments, a format suffix, case, backslashes),
//! and the percent-decoding they rest on.

use std::borrow::Cow;

/// The path routes match (docs/reference/behaviour.md#normalised-path): percent-encoded
/// unreserved characters decoded
/// (other escapes kept, their hex in upper case), empty segments (repeated
/// and trailing slashes) dropped, `.` and `..` resolved; the root is "/".
/// Borrowed when the path is already so, as nearly every request's is.
pub(crate) fn normalise(path: &str) -> Cow<'_, str> {
    if !path.starts_with('/') || is_normal(path) {
        return Cow::Borrowed(path);
    }
    squash(path, true)
}

/// [`normalise`], but `.` and `..` kept as segments of their own (decoded
/// from `%2e` too): what Flask, FastAPI, aiohttp and Express 4 route by,
/// taking `.` or `..` as the value of a `{param}`. `None` when the path has no
/// dot segment (then it is the normalised path).
fn with_dot_segments(path: &str) -> Option<String> {
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
pub(super) fn without_format_suffix(path: &str) -> Option<&str> {
    format_cuts(path)[0]
}

/// The path cut at the last `.` of its last segment, and (when it has
/// another) at its first: Rails matches the path before decoding it, so in
/// `/v1/payments.xml%2ejson` its format is all of `xml%2ejson`, while the
/// decoded spelling's last `.` is the encoded one.
pub(super) fn format_cuts(path: &str) -> [Option<&str>; 2] {
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
pub(super) struct Spellings<'a> {
    /// Compared with the routes' literals as written.
    exact: [Option<Cow<'a, str>>; 2],
    /// Compared with the decoded literals, letters in any case.
    broad: [Option<String>; 4],
}

impl<'a> Spellings<'a> {
    pub(super) fn of(path: &'a str) -> Self {
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
    pub(super) fn each(&self, broad: bool, cased: bool) -> impl Iterator<Item = &str> {
        let differs =
            move |s: &&str| cased || s.bytes().any(|b| b.is_ascii_uppercase() || b == b'%');
        let exact = self.exact.iter().flatten().map(|s| &**s);
        let more = self.broad.iter().flatten().map(String::as_str);
        exact
            .filter(move |s| !broad || differs(s))
            .chain(more.filter(move |_| broad))
    }
}

/// Does the path hold a control character, raw or percent-encoded
/// (`%00`-`%1F`, `%7F`), or the query a NUL? Starlette routes
/// `/v1/payments%0a` as `/v1/payments`; no real API names such a path.
pub(super) fn has_control(path: &str, query: Option<&str>) -> bool {
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
pub(super) fn decode_all(text: &str) -> Vec<u8> {
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
pub(super) fn decode_unreserved(seg: &str) -> Cow<'_, str> {
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
