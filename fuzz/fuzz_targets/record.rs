//! Fuzzes the record decoder: any bytes (a value from the store) decode or
//! fail without panicking, and a decoded record survives re-encoding; opened
//! with a key file, any bytes open or fail without panicking too, and a
//! record sealed again opens to itself.
#![no_main]

use std::sync::LazyLock;

use bytes::Bytes;
use idemproxy::record::Record;
use idemproxy::seal::Keyring;
use libfuzzer_sys::fuzz_target;

const ID: &str = "6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e52ddb7875b4b";

static KEYS: LazyLock<Keyring> = LazyLock::new(|| {
    let file = b"k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\n";
    Keyring::parse(std::path::Path::new("keys"), file).expect("a valid key file")
});

fuzz_target!(|data: &[u8]| {
    if let Ok(record) = Record::decode(Bytes::copy_from_slice(data)) {
        let again = Record::decode(record.encode()).expect("a re-encoded record decodes");
        assert_eq!(again, record);
    }
    if let Ok(record) = Record::open(Bytes::copy_from_slice(data), Some(&*KEYS), ID) {
        let sealed = record.seal(&KEYS, ID).expect("sealing");
        let again = Record::open(sealed, Some(&*KEYS), ID).expect("a sealed record opens");
        assert_eq!(again, record);
    }
});
