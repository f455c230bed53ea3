//! Fuzzes the Idempotency-Key parser: never panics, and what it accepts is a
//! non-empty, printable key within the limit that re-parses to itself when quoted.
#![no_main]

use idemproxy::key::parse_key;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let max = 1 + data.first().copied().unwrap_or(0) as usize;
    if let Ok(key) = parse_key(data, max) {
        assert!(!key.is_empty() && key.len() <= max);
        assert!(key.bytes().all(|b| (0x20..0x7f).contains(&b)));
        let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
        assert_eq!(parse_key(quoted.as_bytes(), max).as_deref(), Ok(key.as_str()));
    }
});
