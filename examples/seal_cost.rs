//! The in-process cost of sealing a 1 KiB answer: `Record::seal` against
//! `Record::encode`, and `Record::open` against `Record::decode`, in a loop
//! (what bench/sealing.py measures end to end, without the network around it).
//!
//!     cargo run --release --example seal_cost

use std::time::Instant;

use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use idemproxy::record::{Finished, Record, Token};
use idemproxy::seal::Keyring;

const ROUNDS: u32 = 200_000;
const ID: &str = "6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e52ddb7875b4b";

/// Nanoseconds per call of `f`, over [`ROUNDS`] calls.
fn per_call(mut f: impl FnMut() -> usize) -> f64 {
    let start = Instant::now();
    let mut sink = 0;
    for _ in 0..ROUNDS {
        sink += f();
    }
    std::hint::black_box(sink);
    start.elapsed().as_nanos() as f64 / f64::from(ROUNDS)
}

fn main() {
    let file = b"bench:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\n";
    let keys = Keyring::parse(std::path::Path::new("bench-keys"), file).expect("key file");
    let record = Record::Finished(Finished {
        token: Token::new(),
        fingerprint: [1; 32],
        created_ms: 1,
        route: "payments".into(),
        trace: None,
        completed_ms: 2,
        status: 201,
        reason: None,
        body_stored: true,
        headers: vec![
            (
                HeaderName::from_static("content-type"),
                HeaderValue::from_static("application/json"),
            ),
            (
                HeaderName::from_static("location"),
                HeaderValue::from_static("/v1/payments/pay_1"),
            ),
        ],
        body: Bytes::from(vec![b'x'; 1024]),
        trailers: vec![],
    });
    let (clear, sealed) = (record.encode(), record.seal(&keys, ID).expect("seal"));
    for round in 1..=3 {
        let encode = per_call(|| record.encode().len());
        let seal = per_call(|| record.seal(&keys, ID).map_or(0, |b| b.len()));
        // A fresh buffer each time, as a value read from Redis is (opened in place).
        let decode = per_call(|| Record::decode(Bytes::from(clear.to_vec())).is_ok() as usize);
        let open = per_call(|| {
            Record::open(Bytes::from(sealed.to_vec()), Some(&keys), ID).is_ok() as usize
        });
        println!(
            "round {round}: 1 KiB answer: encode {encode:.0} ns, seal {seal:.0} ns (+{:.2} us); \
             decode {decode:.0} ns, open {open:.0} ns (+{:.2} us)",
            (seal - encode) / 1000.0,
            (open - decode) / 1000.0
        );
    }
}
