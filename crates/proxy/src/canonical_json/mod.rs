//! Exact canonical JSON for `fingerprint_body = "json"`: merges only what every JSON parser reads alike.
//!
//! Two bodies canonicalise alike only if every JSON parser reads them as the
//! same value, so a retry that was reformatted still replays while a
//! different request never does. What is merged:
//!
//! - insignificant whitespace (space, tab, LF, CR between tokens);
//! - the order of object members: they are sorted by their decoded name, as
//!   UTF-8 bytes (that is Unicode code point order). RFC 8785 sorts by UTF-16
//!   code units instead; the two differ only between U+E000..U+FFFF and
//!   supplementary characters, and either order is as good for a fingerprint
//!   (it only has to be one order). Byte order is the order the previous
//!   serde_json-based fingerprint used, so a body of integers and strings
//!   keeps its fingerprint across the upgrade;
//! - string escapes: strings are decoded and written one way, the way
//!   serde_json and RFC 8785 write them (`\"`, `\\`, `\b`, `\f`, `\n`, `\r`,
//!   `\t`, other control characters as lower-case `\u00xx`, everything else
//!   as itself).
//!
//! Numbers keep their exact text (`1`, `1.0`, `1e0`, `-0` and
//! `100000000000000000001` all stay different; no parser's rounding can merge
//! two requests), after a check of the JSON number grammar.
//!
//! Refused (`None`, so the caller fingerprints the raw bytes): anything that
//! is not one JSON text (RFC 8259) in UTF-8, a duplicate member name after
//! escapes are decoded (`{"a":1,"\u0061":2}`: parsers disagree on which one
//! counts), an escape that encodes a lone surrogate (not a Unicode string;
//! parsers replace, reject or keep it), and nesting deeper than
//! [`MAX_DEPTH`].
//!
//! The parser is a hand-written recursive descent over bytes: recursion is
//! bounded by [`MAX_DEPTH`], and memory and time are linear in the body (plus
//! sorting each object's member names). It builds a flat list of items in
//! document order and writes the output once, so a deeply nested body is not
//! copied once per level.

use std::ops::Range;

/// The deepest nesting of arrays and objects accepted (serde_json's own limit
/// is of the same size). Deeper bodies are fingerprinted as raw bytes; the
/// limit also bounds the recursion of the parser and of the writer.
pub const MAX_DEPTH: usize = 128;

/// The canonical form of `body`, or `None` when it is not JSON this module
/// can canonicalise exactly (see the module documentation).
pub fn canonicalize(body: &[u8]) -> Option<Vec<u8>> {
    let parser = parse(body)?;
    let mut out = Vec::with_capacity(body.len());
    parser.write(0, &mut out);
    Some(out)
}

/// What a JSON pointer reaches in a body (see [`at_pointer`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pointed {
    /// A string, decoded.
    Str(String),
    /// A number without fraction or exponent (`-?(0|[1-9][0-9]*)`), its
    /// text exactly as written, however many digits it has.
    Integer(String),
    /// Anything else: a number with a fraction or an exponent, `true`,
    /// `false`, `null`, an array, an object.
    Other,
}

/// The value that the RFC 6901 reference tokens `tokens` point at in `body`.
/// `None` when nothing is there, or when `body` is not JSON that this module
/// reads exactly (the same refusals as [`canonicalize`]: a duplicate member
/// name is read differently by different parsers, so no value is taken from
/// such a body). An array element is named by its index in decimal without
/// leading zeros; `-` (the element after the last) is never there.
pub fn at_pointer(body: &[u8], tokens: &[String]) -> Option<Pointed> {
    let parser = parse(body)?;
    let mut at = 0;
    for token in tokens {
        at = parser.child(at, token)?;
    }
    Some(match &parser.items[at] {
        Item::Str(r) => Pointed::Str(String::from_utf8(parser.strings[r.clone()].to_vec()).ok()?),
        Item::Text(r) => {
            let text = std::str::from_utf8(&parser.input[r.clone()]).ok()?;
            let digits = text.strip_prefix('-').unwrap_or(text);
            if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
                Pointed::Integer(text.to_string())
            } else {
                Pointed::Other
            }
        }
        Item::Array | Item::ArrayEnd | Item::Object { .. } => Pointed::Other,
    })
}

/// The whole of `body` parsed, or `None` when it is not JSON this module reads exactly.
fn parse(body: &[u8]) -> Option<Parser<'_>> {
    // Outside strings the grammar allows ASCII only, so one check of the whole
    // body makes every string's raw bytes valid UTF-8.
    let text = std::str::from_utf8(body).ok()?.as_bytes();
    let mut parser = Parser {
        input: text,
        pos: 0,
        items: Vec::new(),
        members: Vec::new(),
        strings: Vec::new(),
    };
    parser.value(0)?;
    parser.skip_whitespace();
    if parser.pos != text.len() {
        return None;
    }
    Some(parser)
}

/// One token of the parsed document, in document order.
enum Item {
    /// A number or a literal: its exact text, `input[range]`.
    Text(Range<usize>),
    /// A string, decoded: `strings[range]`.
    Str(Range<usize>),
    /// `[`: the elements follow, then [`Item::ArrayEnd`].
    Array,
    ArrayEnd,
    /// `{`: its members are `members[members]`, sorted by name; the items of
    /// the member values follow (in document order) up to index `end`.
    Object {
        members: Range<usize>,
        end: usize,
    },
}

struct Member {
    /// The decoded name: `strings[name]`.
    name: Range<usize>,
    /// Index of the member value's first item.
    value: usize,
}

struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
    items: Vec<Item>,
    members: Vec<Member>,
    /// Every decoded string, back to back.
    strings: Vec<u8>,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    /// Parses one value; `depth` is the number of arrays and objects around it.
    fn value(&mut self, depth: usize) -> Option<()> {
        self.skip_whitespace();
        match self.peek()? {
            b'{' => self.object(depth),
            b'[' => self.array(depth),
            b'"' => {
                let s = self.string()?;
                self.items.push(Item::Str(s));
                Some(())
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn literal(&mut self, word: &'static [u8]) -> Option<()> {
        let start = self.pos;
        if !self.input[start..].starts_with(word) {
            return None;
        }
        self.pos += word.len();
        self.items.push(Item::Text(start..self.pos));
        Some(())
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, kept as written.
    fn number(&mut self) -> Option<()> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek()? {
            b'0' => self.pos += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            self.at_least_one_digit()?;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            self.at_least_one_digit()?;
        }
        self.items.push(Item::Text(start..self.pos));
        Some(())
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
    }

    fn at_least_one_digit(&mut self) -> Option<()> {
        let start = self.pos;
        self.digits();
        (self.pos > start).then_some(())
    }

    fn array(&mut self, depth: usize) -> Option<()> {
        if depth >= MAX_DEPTH {
            return None;
        }
        self.pos += 1; // '['
        self.items.push(Item::Array);
        self.skip_whitespace();
        if self.peek() == Some(b']') {
            self.pos += 1;
        } else {
            loop {
                self.value(depth + 1)?;
                self.skip_whitespace();
                match self.peek()? {
                    b',' => self.pos += 1,
                    b']' => {
                        self.pos += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        self.items.push(Item::ArrayEnd);
        Some(())
    }

    fn object(&mut self, depth: usize) -> Option<()> {
        if depth >= MAX_DEPTH {
            return None;
        }
        self.pos += 1; // '{'
        let at = self.items.len();
        self.items.push(Item::Object {
            members: 0..0,
            end: 0,
        });
        // This object's members; nested objects push theirs to `self.members`
        // while the values are parsed, so ours are appended as one block at the end.
        let mut members = Vec::new();
        self.skip_whitespace();
        if self.peek() == Some(b'}') {
            self.pos += 1;
        } else {
            loop {
                self.skip_whitespace();
                if self.peek()? != b'"' {
                    return None;
                }
                let name = self.string()?;
                self.skip_whitespace();
                if self.peek()? != b':' {
                    return None;
                }
                self.pos += 1;
                let value = self.items.len();
                self.value(depth + 1)?;
                members.push(Member { name, value });
                self.skip_whitespace();
                match self.peek()? {
                    b',' => self.pos += 1,
                    b'}' => {
                        self.pos += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        let strings = &self.strings;
        members.sort_unstable_by(|a, b| strings[a.name.clone()].cmp(&strings[b.name.clone()]));
        // Sorted, so a duplicate name sits next to its twin.
        if members
            .windows(2)
            .any(|w| strings[w[0].name.clone()] == strings[w[1].name.clone()])
        {
            return None;
        }
        let first = self.members.len();
        self.members.extend(members);
        self.items[at] = Item::Object {
            members: first..self.members.len(),
            end: self.items.len(),
        };
        Some(())
    }

    /// Decodes the string at `pos` (which is a `"`) into `strings`.
    fn string(&mut self) -> Option<Range<usize>> {
        self.pos += 1; // '"'
        let start = self.strings.len();
        loop {
            let b = self.peek()?;
            self.pos += 1;
            match b {
                b'"' => return Some(start..self.strings.len()),
                b'\\' => {
                    let escaped = self.peek()?;
                    self.pos += 1;
                    let c = match escaped {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => self.unicode_escape()?,
                        _ => return None,
                    };
                    let mut buf = [0u8; 4];
                    self.strings
                        .extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
                // A raw control character is not allowed in a JSON string.
                0x00..=0x1f => return None,
                // Other bytes, including those of multi-byte characters (all
                // >= 0x80, so never taken for a quote or a backslash), as they are.
                _ => self.strings.push(b),
            }
        }
    }

    /// The character of a `\uXXXX` escape (after `\u`), joining a surrogate
    /// pair; a lone surrogate is refused.
    fn unicode_escape(&mut self) -> Option<char> {
        let unit = self.hex4()?;
        match unit {
            0xD800..=0xDBFF => {
                if !self.input[self.pos..].starts_with(b"\\u") {
                    return None;
                }
                self.pos += 2;
                let low = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&low) {
                    return None;
                }
                char::from_u32(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00))
            }
            // A low surrogate without its high half.
            0xDC00..=0xDFFF => None,
            _ => char::from_u32(unit),
        }
    }

    fn hex4(&mut self) -> Option<u32> {
        let digits = self.input.get(self.pos..self.pos + 4)?;
        let mut v = 0;
        for &d in digits {
            v = v * 16 + (d as char).to_digit(16)?;
        }
        self.pos += 4;
        Some(v)
    }

    /// The first item of the member named `token` of the object at `at`, or
    /// of the element numbered `token` of the array at `at`.
    fn child(&self, at: usize, token: &str) -> Option<usize> {
        match &self.items[at] {
            Item::Object { members, .. } => {
                let members = &self.members[members.clone()];
                // Sorted by name, without duplicates.
                let found = members
                    .binary_search_by(|m| self.strings[m.name.clone()].cmp(token.as_bytes()))
                    .ok()?;
                Some(members[found].value)
            }
            Item::Array => {
                let index_ok = token == "0" || !token.starts_with('0');
                if !index_ok || token.is_empty() || !token.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                let index: usize = token.parse().ok()?;
                let mut next = at + 1;
                for _ in 0..index {
                    if matches!(self.items[next], Item::ArrayEnd) {
                        return None;
                    }
                    next = self.after(next);
                }
                (!matches!(self.items[next], Item::ArrayEnd)).then_some(next)
            }
            Item::Text(_) | Item::Str(_) | Item::ArrayEnd => None,
        }
    }

    /// The index after the last item of the value whose first item is `at`.
    fn after(&self, at: usize) -> usize {
        match &self.items[at] {
            Item::Text(_) | Item::Str(_) | Item::ArrayEnd => at + 1,
            Item::Object { end, .. } => *end,
            Item::Array => {
                let mut next = at + 1;
                while !matches!(self.items[next], Item::ArrayEnd) {
                    next = self.after(next);
                }
                next + 1
            }
        }
    }

    /// Writes the value whose first item is `at`; returns the index after its last item.
    fn write(&self, at: usize, out: &mut Vec<u8>) -> usize {
        match &self.items[at] {
            Item::Text(r) => {
                out.extend_from_slice(&self.input[r.clone()]);
                at + 1
            }
            Item::Str(r) => {
                write_string(&self.strings[r.clone()], out);
                at + 1
            }
            Item::Array => {
                out.push(b'[');
                let mut next = at + 1;
                while !matches!(self.items[next], Item::ArrayEnd) {
                    if next != at + 1 {
                        out.push(b',');
                    }
                    next = self.write(next, out);
                }
                out.push(b']');
                next + 1
            }
            // Only reached through `Item::Array`, which stops before it.
            Item::ArrayEnd => at + 1,
            Item::Object { members, end } => {
                out.push(b'{');
                for (i, m) in self.members[members.clone()].iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write_string(&self.strings[m.name.clone()], out);
                    out.push(b':');
                    self.write(m.value, out);
                }
                out.push(b'}');
                *end
            }
        }
    }
}

/// Writes a decoded string with the minimal escapes of RFC 8785 (and serde_json).
fn write_string(s: &[u8], out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    for &b in s {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x00..=0x1f => out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 0xf)],
            ]),
            _ => out.push(b),
        }
    }
    out.push(b'"');
}

#[cfg(test)]
mod tests;
