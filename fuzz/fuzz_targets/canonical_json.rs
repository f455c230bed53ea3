//! Fuzzes canonical JSON: never panics, and a canonical form is valid JSON
//! that canonicalises to itself.
#![no_main]

use idemproxy::canonical_json::canonicalize;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(canon) = canonicalize(data) {
        assert_eq!(canonicalize(&canon).as_deref(), Some(canon.as_slice()));
    }
});
