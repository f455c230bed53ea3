//! Fuzzes canonical JSON: never panics, a canonical form is valid JSON that
//! canonicalises to itself, and a JSON pointer finds the same value in a body
//! and in its canonical form.
#![no_main]

use idemproxy::canonical_json::{at_pointer, canonicalize};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first line, split at '/', is a pointer's tokens; the rest is the body.
    let (pointer, body) = match data.iter().position(|&b| b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (&data[..0], data),
    };
    let tokens: Vec<String> = String::from_utf8_lossy(pointer)
        .split('/')
        .map(str::to_string)
        .collect();
    let found = at_pointer(body, &tokens);
    match canonicalize(body) {
        Some(canon) => {
            assert_eq!(canonicalize(&canon).as_deref(), Some(canon.as_slice()));
            assert_eq!(at_pointer(&canon, &tokens), found);
        }
        None => assert_eq!(found, None),
    }
});
