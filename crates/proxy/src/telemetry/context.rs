//! W3C Trace Context: a client's `traceparent` and `tracestate` read, new
//! ids, and the ratio sampler. Nothing here allocates but a kept `tracestate`.

use std::cell::Cell;
use std::hash::BuildHasher;
use std::sync::Arc;

use http::{HeaderMap, HeaderName};

pub(crate) type TraceId = [u8; 16];
pub(crate) type SpanId = [u8; 8];

/// The W3C headers, named once (a `&str` name is parsed at every lookup).
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// The longest `traceparent` or `tracestate` read (W3C: 512 bytes of
/// `tracestate` are enough to keep); a longer one is ignored, as if absent.
pub(crate) const MAX_TRACE_HEADER: usize = 512;

/// The most `tracestate` list members W3C Trace Context allows: every span of
/// the trace keeps the client's `tracestate`, and many tiny members cost far
/// more than their bytes when it is parsed downstream.
pub(crate) const MAX_TRACESTATE_MEMBERS: usize = 32;

/// A client's trace context, as its `traceparent` and `tracestate` say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Remote {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub sampled: bool,
    /// `None` when absent, too long, of too many members or not well formed.
    pub trace_state: Option<Arc<str>>,
}

/// The client's trace context, when its `traceparent` is valid (one
/// header: two are invalid, as W3C's test suite has it). Several
/// `tracestate` headers are one list, joined.
pub fn remote(headers: &HeaderMap) -> Option<Remote> {
    let mut parents = headers.get_all(&TRACEPARENT).iter();
    let parent = parents.next()?.as_bytes();
    if parents.next().is_some() {
        return None;
    }
    let (trace_id, span_id, flags) = traceparent(parent)?;
    let mut states = headers.get_all(&TRACESTATE).iter();
    let trace_state = match (states.next(), states.next()) {
        (None, _) => None,
        (Some(one), None) => one
            .to_str()
            .ok()
            .filter(|v| tracestate_ok(v))
            .map(Arc::from),
        (Some(_), Some(_)) => joined(headers).filter(|v| tracestate_ok(v)).map(Arc::from),
    };
    Some(Remote {
        trace_id,
        span_id,
        sampled: flags & 1 == 1,
        trace_state,
    })
}

/// Several `tracestate` headers as one list; `None` when longer than W3C's 512 bytes.
fn joined(headers: &HeaderMap) -> Option<String> {
    let mut joined = String::new();
    for v in headers.get_all(&TRACESTATE) {
        let v = v.to_str().ok()?;
        if joined.len() + v.len() + 1 > MAX_TRACE_HEADER {
            return None;
        }
        if !joined.is_empty() {
            joined.push(',');
        }
        joined.push_str(v);
    }
    Some(joined)
}

/// `version-traceid-parentid-flags`, lowercase hex (W3C Trace Context level
/// 1). Version `00` is exactly 55 bytes; a later version may append fields
/// after a `-`; version `ff` and all-zero ids are invalid.
pub fn traceparent(value: &[u8]) -> Option<(TraceId, SpanId, u8)> {
    if value.len() < 55 || value.len() > MAX_TRACE_HEADER {
        return None;
    }
    let version = hex::<1>(&value[0..2])?[0];
    if version == 0xff || (version == 0 && value.len() != 55) {
        return None;
    }
    if value.len() > 55 && value[55] != b'-' {
        return None;
    }
    if value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    let trace_id = hex::<16>(&value[3..35])?;
    let span_id = hex::<8>(&value[36..52])?;
    let flags = hex::<1>(&value[53..55])?[0];
    if trace_id == [0; 16] || span_id == [0; 8] {
        return None;
    }
    Some((trace_id, span_id, flags))
}

/// `N` bytes from `2N` lowercase hex digits.
fn hex<const N: usize>(text: &[u8]) -> Option<[u8; N]> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, pair) in text.chunks_exact(2).enumerate().take(N) {
        out[i] = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    (text.len() == 2 * N).then_some(out)
}

/// A `tracestate` kept on the request's spans: at most `MAX_TRACE_HEADER`
/// bytes and `MAX_TRACESTATE_MEMBERS` members, each `key=value` by W3C's
/// grammar (a key `lcalpha *(lcalpha / digit / _-*/)` of up to 256 bytes,
/// or `tenant@system`; a value of printable ASCII but `,` and `=`, not
/// ending in a blank), no key twice.
pub(crate) fn tracestate_ok(value: &str) -> bool {
    if value.len() > MAX_TRACE_HEADER {
        return false;
    }
    let mut keys: Vec<&str> = Vec::new();
    for member in value.split(',').map(|m| m.trim_matches([' ', '\t'])) {
        if member.is_empty() {
            continue;
        }
        let Some((key, val)) = member.split_once('=') else {
            return false;
        };
        let val_ok = !val.is_empty()
            && val.len() <= 256
            && !val.ends_with(' ')
            && val
                .bytes()
                .all(|b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=');
        let full = keys.len() == MAX_TRACESTATE_MEMBERS;
        if !key_ok(key) || !val_ok || keys.contains(&key) || full {
            return false;
        }
        keys.push(key);
    }
    true
}

/// A `tracestate` key: `simple-key` or `tenant-id@system-id`.
fn key_ok(key: &str) -> bool {
    fn part(text: &str, first: fn(u8) -> bool, max: usize) -> bool {
        let rest = |b: u8| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'*' | b'/');
        let bytes = text.as_bytes();
        !bytes.is_empty()
            && bytes.len() <= max
            && first(bytes[0])
            && bytes[1..].iter().all(|&b| rest(b))
    }
    match key.split_once('@') {
        None => part(key, |b| b.is_ascii_lowercase(), 256),
        Some((tenant, system)) => {
            part(
                tenant,
                |b| b.is_ascii_lowercase() || b.is_ascii_digit(),
                241,
            ) && part(system, |b| b.is_ascii_lowercase(), 14)
        }
    }
}

/// `traceparent` for `trace_id` and `span_id`, version 00, with the sampled flag.
pub(crate) fn format_traceparent(trace_id: &TraceId, span_id: &SpanId, sampled: bool) -> [u8; 55] {
    let mut out = [b'-'; 55];
    out[0] = b'0';
    out[1] = b'0';
    write_hex(&mut out[3..35], trace_id);
    write_hex(&mut out[36..52], span_id);
    out[53] = b'0';
    out[54] = if sampled { b'1' } else { b'0' };
    out
}

/// `bytes` as lowercase hex into `out` (twice as long).
pub(crate) fn write_hex(out: &mut [u8], bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (pair, b) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0xf)];
    }
}

/// `bytes` as a lowercase hex string.
pub(crate) fn hex_string(bytes: &[u8]) -> String {
    let mut out = vec![0u8; bytes.len() * 2];
    write_hex(&mut out, bytes);
    String::from_utf8(out).unwrap_or_default()
}

thread_local! {
    /// A per-thread wyrand state, seeded from the process's random hasher
    /// keys (the OS's randomness) and the thread.
    static RNG: Cell<u64> = Cell::new(seed());
}

fn seed() -> u64 {
    let keys = std::collections::hash_map::RandomState::new();
    keys.hash_one(std::thread::current().id()) | 1
}

/// The next 64 random bits of this thread (wyrand: fast, and uniform enough
/// for ids and for the sampler, which reads the trace id's low bits).
fn next_u64() -> u64 {
    RNG.with(|state| {
        let s = state.get().wrapping_add(0xa076_1d64_78bd_642f);
        state.set(s);
        let t = u128::from(s) * u128::from(s ^ 0xe703_7ed1_a0b4_28db);
        (t >> 64) as u64 ^ t as u64
    })
}

/// A new trace id (never all zero).
pub(crate) fn new_trace_id() -> TraceId {
    loop {
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&next_u64().to_be_bytes());
        id[8..].copy_from_slice(&next_u64().to_be_bytes());
        if id != [0; 16] {
            return id;
        }
    }
}

/// A new span id (never all zero).
pub(crate) fn new_span_id() -> SpanId {
    loop {
        let id = next_u64();
        if id != 0 {
            return id.to_be_bytes();
        }
    }
}

/// Roots sampled at a ratio, decided by the trace id as OpenTelemetry's
/// `TraceIdRatioBased` does (its low 64 bits, shifted right by one, below
/// `ratio × 2^63`): every service that samples so agrees on a trace.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ratio(u64);

impl Ratio {
    pub fn new(ratio: f64) -> Ratio {
        if ratio >= 1.0 {
            Ratio(u64::MAX)
        } else {
            Ratio((ratio.max(0.0) * (1u64 << 63) as f64) as u64)
        }
    }

    pub(crate) fn samples(self, trace_id: &TraceId) -> bool {
        let mut low = [0u8; 8];
        low.copy_from_slice(&trace_id[8..]);
        (u64::from_be_bytes(low) >> 1) < self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_as_w3c_says() {
        let good = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let (t, s, f) = traceparent(good).unwrap();
        assert_eq!(hex_string(&t), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(hex_string(&s), "b7ad6b7169203331");
        assert_eq!(f, 1);
        assert_eq!(&format_traceparent(&t, &s, true), good);
        let later = b"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00-what-comes";
        assert!(traceparent(later).is_some());
        for bad in [
            &b"00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01"[..],
            b"00-00000000000000000000000000000000-b7ad6b7169203331-01",
            b"00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            b"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
            b"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01x",
            b"00-0af7651916cd43dd8448eb211c80319c_b7ad6b7169203331-01",
            b"00-0af7651916cd43dd8448eb211c80319-cb7ad6b7169203331-01",
            b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0g",
            b"",
        ] {
            assert_eq!(traceparent(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn tracestates_kept_and_refused() {
        assert!(tracestate_ok("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"));
        assert!(tracestate_ok("a/b_d-e*f=1 2"));
        assert!(tracestate_ok("1tenant@sys=v,t@s=w"));
        assert!(tracestate_ok(""));
        let many = |n: usize| {
            (0..n)
                .map(|i| format!("k{i}=v"))
                .collect::<Vec<_>>()
                .join(",")
        };
        assert!(tracestate_ok(&many(32)));
        assert!(!tracestate_ok(&many(33)));
        for bad in [
            "Rojo=1",
            "rojo",
            "rojo=",
            "rojo=a,b",
            "rojo=a=b",
            "rojo=a\u{1}",
            "_a=1",
            "1abc=2",
            "a@b@c=1",
            "@=x",
            "*=*",
            "x=1,x=2",
            "t@1s=v",
            "t@systemtoolong15=v",
        ] {
            assert!(!tracestate_ok(bad), "{bad}");
        }
        assert!(!tracestate_ok(&format!("k={}", "v".repeat(600))));
    }

    /// Two `traceparent` headers are no context; several `tracestate`
    /// headers are one list (and refused together when it is not valid).
    #[test]
    fn repeated_headers() {
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let mut h = HeaderMap::new();
        h.append("traceparent", tp.parse().unwrap());
        h.append("tracestate", "a=1".parse().unwrap());
        h.append("tracestate", "b=2".parse().unwrap());
        assert_eq!(remote(&h).unwrap().trace_state.as_deref(), Some("a=1,b=2"));
        h.append("tracestate", "a=3".parse().unwrap());
        assert_eq!(remote(&h).unwrap().trace_state, None, "a key twice");
        h.append("traceparent", tp.parse().unwrap());
        assert_eq!(remote(&h), None);
    }

    #[test]
    fn ids_are_never_zero_and_differ() {
        let a = new_trace_id();
        let b = new_trace_id();
        assert_ne!(a, b);
        assert_ne!(new_span_id(), new_span_id());
    }

    /// The ratio sampler agrees with OpenTelemetry's: the bound at the ends,
    /// and about the ratio's share of random ids in between.
    #[test]
    fn the_ratio_samples_its_share() {
        let all = Ratio::new(1.0);
        let none = Ratio::new(0.0);
        let tenth = Ratio::new(0.1);
        let mut sampled = 0;
        for _ in 0..100_000 {
            let id = new_trace_id();
            assert!(all.samples(&id));
            assert!(!none.samples(&id));
            sampled += usize::from(tenth.samples(&id));
        }
        assert!((9_000..11_000).contains(&sampled), "{sampled}");
        let mut id = [0u8; 16];
        id[8..].copy_from_slice(&(0x0ccc_cccc_cccc_cccc_u64 << 1).to_be_bytes());
        assert!(tenth.samples(&id), "just below 0.1 x 2^63");
        id[8..].copy_from_slice(&(0x0ccd_0000_0000_0000_u64 << 1).to_be_bytes());
        assert!(!tenth.samples(&id));
    }
}
