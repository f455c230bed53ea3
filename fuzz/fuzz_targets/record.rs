//! Fuzzes the record decoder: any bytes (a value from the store) decode or
//! fail without panicking, and a decoded record survives re-encoding.
#![no_main]

use bytes::Bytes;
use idemproxy::record::Record;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(record) = Record::decode(Bytes::copy_from_slice(data)) {
        let again = Record::decode(record.encode()).expect("a re-encoded record decodes");
        assert_eq!(again, record);
    }
});
