//! Fuzzes the configuration loader: any text is either a configuration or an
//! error naming the file; it never panics.
#![no_main]

use idemproxy::config::{Config, Overrides};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Err(e) = Config::from_toml(text, "fuzz.toml", &Overrides::default()) {
            assert!(e.to_string().contains("fuzz.toml"));
        }
    }
});
