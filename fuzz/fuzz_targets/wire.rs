//! Fuzzes the store connection's RESP2 reply parser (`store::wire`, whose
//! bytes come from a store that is not trusted): any bytes parse, wait for
//! more, or are refused, without panicking; a reply never takes more bytes
//! than it was given; and however reads split the bytes, the replies read
//! are those read at once.
#![no_main]

use idemproxy::store::wire::fuzzing::{replies_in_reads, reply};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first bytes, up to a zero, are the sizes of the reads; the rest is the stream.
    let (reads, bytes) = match data.iter().position(|&b| b == 0) {
        Some(i) if i <= 32 => (&data[..i], &data[i + 1..]),
        _ => (&data[..0], data),
    };
    let reads: Vec<usize> = reads.iter().map(|&b| usize::from(b)).collect();
    if let Ok(Some((_, used))) = reply(bytes) {
        assert!(used > 0 && used <= bytes.len(), "{used} of {} bytes", bytes.len());
    }
    let at_once = replies_in_reads(bytes, &[]);
    assert_eq!(replies_in_reads(bytes, &reads), at_once);
    // The first reply of a stream is the reply parsed alone.
    if let (Some(first), Ok(Some((alone, _)))) = (at_once.0.first(), reply(bytes)) {
        assert_eq!(first, &alone);
    }
});
