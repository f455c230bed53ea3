//! The RESP2 reply parser of [`Wire`](super::wire::Wire): the store's bytes
//! are not trusted, so a reply is checked as its bytes arrive ([`Scan`]:
//! each byte once, every length and count against a bound before anything
//! is read or reserved for it), and built ([`value`]) only once it is whole.

use redis::Value;

/// A bulk reply longer than this is taken for a broken stream, not waited
/// for (checked on its length line, before anything is read or reserved for
/// it): no reply the store asks for is over a piece of a record.
const MAX_BULK: usize = super::PIECE;
/// A status, error or length line longer than this is a broken stream too.
const MAX_LINE: usize = 64 << 10;
/// The most bytes one reply may take, arrays included: one bulk at its
/// largest with room for a line beside it.
const MAX_REPLY: usize = MAX_BULK + MAX_LINE;
/// The most values one reply may hold (an array counts, and each element):
/// the largest the store asks for is `SCRIPT EXISTS` of its four scripts.
const MAX_VALUES: usize = 1024;
/// Arrays nested deeper than this are taken for a broken stream: no reply the
/// store asks for nests more than two levels, and the builder recurses.
const MAX_DEPTH: usize = 8;

/// Where the check of the reply at the start of the buffer stands, so that
/// each byte of a reply is looked at once, however many reads bring it (a
/// reply trickled a byte at a time costs no more than one read at once),
/// and a reply is given up as soon as it is over a bound: its size, the
/// length of a line or of a bulk, its values, its nesting. Nothing is
/// allocated for a reply until it is whole and within every bound.
#[derive(Default)]
pub(super) struct Scan {
    /// The bytes before this are whole values or array headers.
    at: usize,
    /// Where the search for the end of the line at `at` goes on.
    line_from: usize,
    /// The end of the bulk string whose length line is in, while its bytes come.
    bulk_end: Option<usize>,
    /// Elements still to come in each array the scan is inside, innermost last.
    open: Vec<usize>,
    /// Values met so far in this reply (each array and each element).
    values: usize,
    /// Bytes the line search has looked at (for the test that none is looked at twice).
    #[cfg(test)]
    looked: usize,
}

impl Scan {
    /// The length of the reply at the start of `buf` once it is all there
    /// (the scan then starts over, for the next reply), `None` until then,
    /// or why the stream is broken. `buf` only grows between calls, until
    /// the reply is taken off its front.
    pub(super) fn reply_len(&mut self, buf: &[u8]) -> Result<Option<usize>, &'static str> {
        loop {
            let end = match self.bulk_end {
                Some(end) => match buf.get(end..end + 2) {
                    None => return Ok(None),
                    Some(b"\r\n") => end + 2,
                    Some(_) => return Err("the store sent a bulk reply of the wrong length"),
                },
                None => match self.value_at(buf)? {
                    Step::Whole(end) => end,
                    Step::Wait => return Ok(None),
                    Step::Opened => continue,
                },
            };
            self.bulk_end = None;
            self.at = end;
            self.line_from = end;
            // One more element of each array this value closes.
            loop {
                match self.open.last_mut() {
                    None => {
                        // Starts over for the next reply (the stack's room kept).
                        *self = Scan {
                            open: std::mem::take(&mut self.open),
                            #[cfg(test)]
                            looked: self.looked,
                            ..Scan::default()
                        };
                        return Ok(Some(end));
                    }
                    Some(left) if *left > 1 => {
                        *left -= 1;
                        break;
                    }
                    Some(_) => {
                        self.open.pop();
                    }
                }
            }
        }
    }

    /// Reads the value whose first line starts at `at`.
    fn value_at(&mut self, buf: &[u8]) -> Result<Step, &'static str> {
        let from = self.line_from.max(self.at);
        let found = buf
            .get(from..)
            .and_then(|rest| rest.windows(2).position(|w| w == b"\r\n"));
        #[cfg(test)]
        {
            self.looked += found.map_or(buf.len().saturating_sub(from), |i| i + 2);
        }
        let Some(cr) = found.map(|i| from + i) else {
            if buf.len() - self.at > MAX_LINE + 2 {
                return Err("the store sent a line over 64 KiB");
            }
            // The last byte may be the CR of a CRLF still to come.
            self.line_from = buf.len().saturating_sub(1).max(self.at);
            return Ok(Step::Wait);
        };
        if cr == self.at {
            return Err("the store sent an empty line");
        }
        if cr - self.at > MAX_LINE + 1 {
            return Err("the store sent a line over 64 KiB");
        }
        let after = cr + 2;
        if after > MAX_REPLY {
            return Err("the store sent a reply larger than any it is asked for");
        }
        self.values += 1;
        if self.values > MAX_VALUES {
            return Err("the store sent a reply of more values than any it is asked for");
        }
        let line = &buf[self.at + 1..cr];
        match buf[self.at] {
            b'+' | b'-' => Ok(Step::Whole(after)),
            b':' => number(line).map(|_| Step::Whole(after)),
            b'$' => match number(line)? {
                n if n < 0 => Ok(Step::Whole(after)),
                n if n as u64 > MAX_BULK as u64 => {
                    Err("the store sent a bulk reply larger than a piece of a record")
                }
                n => {
                    let end = after + n as usize;
                    if end + 2 > MAX_REPLY {
                        return Err("the store sent a reply larger than any it is asked for");
                    }
                    self.bulk_end = Some(end);
                    self.at = after;
                    self.line_from = after;
                    Ok(Step::Opened)
                }
            },
            b'*' => match number(line)? {
                n if n <= 0 => Ok(Step::Whole(after)),
                n if n as u64 > MAX_VALUES as u64 => {
                    Err("the store sent a reply of more values than any it is asked for")
                }
                n => {
                    if self.open.len() >= MAX_DEPTH {
                        return Err("the store sent arrays nested too deep");
                    }
                    self.open.push(n as usize);
                    self.at = after;
                    self.line_from = after;
                    Ok(Step::Opened)
                }
            },
            _ => Err("the store sent a reply of an unknown type"),
        }
    }

    /// How long the buffer must be for the bulk string being read (0: no bulk).
    pub(super) fn awaited(&self) -> usize {
        self.bulk_end.map_or(0, |end| end + 2)
    }
}

/// What reading one value's first line found.
enum Step {
    /// A value that ends here.
    Whole(usize),
    /// An array's elements, or a bulk's bytes, follow.
    Opened,
    /// The line has not all come.
    Wait,
}

fn number(digits: &[u8]) -> Result<i64, &'static str> {
    std::str::from_utf8(digits)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or("the store sent a malformed number")
}

/// The reply at the start of `buf`, which [`Scan::reply_len`] found whole
/// and within bounds, and its length. Values as redis-rs's parser makes them
/// (`+OK` is `Okay`, a null bulk or array is `Nil`); an error goes through
/// redis-rs's own parser, which knows the kinds (`NOSCRIPT`, `READONLY`...).
pub(super) fn value(buf: &[u8], depth: usize) -> Result<(Value, usize), &'static str> {
    let end = buf
        .windows(2)
        .position(|w| w == b"\r\n")
        .filter(|&end| end > 0)
        .ok_or("a reply cut short")?;
    let (line, after) = (&buf[1..end], end + 2);
    let value = match buf[0] {
        b'+' if line == b"OK" => Value::Okay,
        b'+' => Value::SimpleString(String::from_utf8_lossy(line).into_owned()),
        b'-' => redis::parse_redis_value(&buf[..after])
            .map_err(|_| "the store sent a malformed error")?,
        b':' => Value::Int(number(line)?),
        b'$' | b'*' if number(line)? < 0 => Value::Nil,
        b'$' => {
            let n = usize::try_from(number(line)?).map_err(|_| "a reply cut short")?;
            let data = buf.get(after..after + n).ok_or("a reply cut short")?;
            return Ok((Value::BulkString(data.to_vec()), after + n + 2));
        }
        b'*' => {
            let n = usize::try_from(number(line)?).map_err(|_| "a reply cut short")?;
            if n > MAX_VALUES || depth >= MAX_DEPTH {
                return Err("the store sent a reply over its bounds");
            }
            let mut items = Vec::with_capacity(n);
            let mut at = after;
            for _ in 0..n {
                let (item, len) = value(buf.get(at..).ok_or("a reply cut short")?, depth + 1)?;
                items.push(item);
                at += len;
            }
            return Ok((Value::Array(items), at));
        }
        _ => return Err("the store sent a reply of an unknown type"),
    };
    Ok((value, after))
}

/// The next whole reply in `buf` and its length, `None` until it has arrived.
/// (The unit tests and the fuzz target read replies through it.)
pub fn parse(buf: &[u8]) -> Result<Option<(Value, usize)>, &'static str> {
    match Scan::default().reply_len(buf)? {
        None => Ok(None),
        Some(len) => value(&buf[..len], 0).map(Some),
    }
}

/// Feeds `bytes` to one scan as reads of the sizes in `reads` would bring
/// them (then the rest at once), taking each whole reply off the front, as
/// the connection's reader does: the replies built, and whether the stream
/// broke. (The unit tests and the fuzz target drive the parser through it.)
pub fn in_reads(bytes: &[u8], reads: &[usize]) -> (Vec<Value>, bool) {
    let (mut buf, mut fed, mut got) = (Vec::new(), 0, Vec::new());
    let mut scan = Scan::default();
    let sizes = reads.iter().copied().chain(std::iter::once(bytes.len()));
    for size in sizes {
        let next = (fed + size.max(1)).min(bytes.len());
        buf.extend_from_slice(&bytes[fed..next]);
        fed = next;
        loop {
            match scan.reply_len(&buf) {
                Ok(Some(len)) => match value(&buf[..len], 0) {
                    Ok((value, used)) => {
                        assert_eq!(used, len, "a value is the reply scanned");
                        got.push(value);
                        buf.drain(..len);
                    }
                    // An error line redis-rs cannot read (not UTF-8).
                    Err(_) => return (got, true),
                },
                Ok(None) => break,
                Err(_) => return (got, true),
            }
        }
        if fed == bytes.len() {
            break;
        }
    }
    (got, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn whole(bytes: &[u8]) -> Value {
        let (value, len) = parse(bytes).unwrap().unwrap();
        assert_eq!(len, bytes.len(), "the whole reply is consumed");
        value
    }

    /// Every reply the store asks for parses as redis-rs's own parser parses it.
    #[test]
    fn replies_parse_as_redis_rs_parses_them() {
        let replies: &[&[u8]] = &[
            b"+OK\r\n",
            b"+PONG\r\n",
            b":42\r\n",
            b":-2\r\n",
            b"$-1\r\n",
            b"$0\r\n\r\n",
            b"$5\r\nhe\r\no\r\n",
            b"*-1\r\n",
            b"*0\r\n",
            b"*2\r\n$3\r\nabc\r\n:1500\r\n",
            b"*2\r\n*1\r\n:1\r\n$-1\r\n",
            b"-NOSCRIPT No matching script. Please use EVAL.\r\n",
            b"-READONLY You can't write against a read only replica.\r\n",
            b"-ERR wrong number of arguments\r\n",
        ];
        for reply in replies {
            assert_eq!(
                whole(reply),
                redis::parse_redis_value(reply).unwrap(),
                "{}",
                String::from_utf8_lossy(reply)
            );
        }
        let Value::ServerError(e) = whole(b"-NOSCRIPT No matching script.\r\n") else {
            panic!("an error reply is a ServerError");
        };
        assert_eq!(
            e.kind(),
            Some(redis::ServerErrorKind::NoScript),
            "the script is reloaded on NOSCRIPT"
        );
    }

    /// Every proper prefix of a reply is incomplete, never an error or a value.
    #[test]
    fn a_reply_cut_anywhere_waits_for_the_rest() {
        let reply = b"*3\r\n$3\r\nabc\r\n*2\r\n:1\r\n$-1\r\n+OK\r\n";
        for cut in 0..reply.len() {
            assert_eq!(parse(&reply[..cut]), Ok(None), "cut at {cut}");
        }
        assert!(matches!(parse(reply), Ok(Some((_, n))) if n == reply.len()));
        // A piece's room is taken at once, from its length line.
        let mut scan = Scan::default();
        assert_eq!(scan.reply_len(b"$200000\r\nab"), Ok(None));
        assert_eq!(scan.awaited(), 200_011);
        assert_eq!(Scan::default().awaited(), 0);
    }

    /// Fed a byte at a time, as a store that trickles its reply sends it,
    /// the scan looks at each byte about once (the rescans of a whole
    /// buffered reply at every read made a trickled reply quadratic), and
    /// ends at the reply's end; the bytes after it are the next reply's.
    #[test]
    fn a_trickled_reply_is_scanned_once() {
        let mut reply = b"*3\r\n$5\r\nhello\r\n*1000\r\n".to_vec();
        for i in 0..1000 {
            reply.extend_from_slice(format!(":{i}\r\n").as_bytes());
        }
        reply.extend_from_slice(b"-ERR a long error line to end the reply\r\n");
        let whole = reply.len();
        reply.extend_from_slice(b"+OK\r\n");
        let mut scan = Scan::default();
        for cut in 1..whole {
            assert_eq!(scan.reply_len(&reply[..cut]), Ok(None), "cut at {cut}");
        }
        assert_eq!(scan.reply_len(&reply[..whole]), Ok(Some(whole)));
        assert!(
            scan.looked <= 2 * whole,
            "{} bytes looked at for a {whole}-byte reply",
            scan.looked
        );
        let (value, len) = value(&reply[..whole], 0).unwrap();
        assert_eq!(len, whole);
        assert_eq!(value, redis::parse_redis_value(&reply[..whole]).unwrap());
        // The next reply, from a scan started over.
        assert_eq!(scan.reply_len(&reply[whole..]), Ok(Some(5)));
    }

    #[test]
    fn a_malformed_stream_is_an_error_not_a_wait() {
        let bad: &[&[u8]] = &[
            b"?what\r\n",
            b":12x\r\n",
            b"$abc\r\n",
            b"$3\r\nabcde\r\n",
            b"$99999999999\r\n",
            b"*1\r\n:x\r\n",
            b"$-99999999999999999999999\r\n",
        ];
        for reply in bad {
            assert!(parse(reply).is_err(), "{}", String::from_utf8_lossy(reply));
        }
        let deep = b"*1\r\n".repeat(MAX_DEPTH + 1);
        assert!(parse(&deep).is_err(), "nesting is bounded");
        // A line that never ends is not waited for without bound.
        assert_eq!(parse(&[b'+'; 1000]), Ok(None));
        assert!(parse(&vec![b'+'; MAX_LINE + 3]).is_err());
    }

    /// Every length and count is checked on its line, before anything is
    /// read or reserved for it: a length of 2^62, a count of 2^31, more
    /// values than any reply holds (an endless array), a bulk string larger
    /// than a piece of a record, and a reply larger than any the store is
    /// asked for are errors as soon as they show, never waited for.
    #[test]
    fn lengths_and_counts_are_bounded_before_anything_is_read_for_them() {
        assert!(parse(b"$4611686018427387904\r\n").is_err());
        assert!(parse(b"*2147483648\r\n").is_err());
        assert!(parse(format!("${}\r\n", MAX_BULK + 1).as_bytes()).is_err());
        assert_eq!(parse(format!("${MAX_BULK}\r\n").as_bytes()), Ok(None));
        assert!(parse(format!("*{}\r\n", MAX_VALUES + 1).as_bytes()).is_err());
        // An array of a count within bounds whose elements go on and on
        // (nested arrays of the most elements each) is cut at the bound on values.
        let mut endless = b"*1000\r\n".to_vec();
        for _ in 0..1000 {
            endless.extend_from_slice(b"*1000\r\n");
            endless.extend_from_slice(&b":1\r\n".repeat(999));
        }
        let mut scan = Scan::default();
        let cut = (1..endless.len())
            .find(|&n| scan.reply_len(&endless[..n]).is_err())
            .expect("an endless array is refused");
        assert!(cut <= 16 + 4 * MAX_VALUES, "refused after {cut} bytes");
        // Two bulk strings of a piece each: valid RESP, larger than any reply.
        let piece = vec![b'x'; MAX_BULK];
        let mut two = b"*2\r\n".to_vec();
        for _ in 0..2 {
            two.extend_from_slice(format!("${MAX_BULK}\r\n").as_bytes());
            two.extend_from_slice(&piece);
            two.extend_from_slice(b"\r\n");
        }
        assert!(parse(&two).is_err());
        // One piece is a reply the store asks for.
        let one = format!("${MAX_BULK}\r\n").len() + MAX_BULK + 2;
        assert_eq!(
            parse(&two[4..4 + one]).map(|r| r.map(|(_, n)| n)),
            Ok(Some(one))
        );
    }

    /// RESP2 replies of the kinds the store gets, nested.
    fn reply() -> impl Strategy<Value = Vec<u8>> {
        let leaf = prop_oneof![
            any::<i64>().prop_map(|n| format!(":{n}\r\n").into_bytes()),
            "[a-zA-Z ]{0,20}".prop_map(|t| format!("+{t}\r\n").into_bytes()),
            "[A-Z]{1,8} [a-z ]{0,20}".prop_map(|t| format!("-{t}\r\n").into_bytes()),
            Just(b"$-1\r\n".to_vec()),
            proptest::collection::vec(any::<u8>(), 0..40).prop_map(|b| {
                let mut out = format!("${}\r\n", b.len()).into_bytes();
                out.extend_from_slice(&b);
                out.extend_from_slice(b"\r\n");
                out
            }),
        ];
        leaf.prop_recursive(3, 32, 6, |inner| {
            proptest::collection::vec(inner, 0..6).prop_map(|items| {
                let mut out = format!("*{}\r\n", items.len()).into_bytes();
                for item in items {
                    out.extend_from_slice(&item);
                }
                out
            })
        })
    }

    proptest! {
        /// However the reads split them, valid replies come out as
        /// redis-rs's parser reads each of them.
        #[test]
        fn replies_split_anywhere_parse_as_redis_rs_parses_them(
            replies in proptest::collection::vec(reply(), 1..5),
            reads in proptest::collection::vec(1usize..40, 0..40),
        ) {
            let bytes = replies.concat();
            let (got, broke) = in_reads(&bytes, &reads);
            prop_assert!(!broke);
            let expected: Vec<Value> = replies
                .iter()
                .map(|r| redis::parse_redis_value(r).unwrap())
                .collect();
            prop_assert_eq!(got, expected);
        }

        /// Any bytes, split anyhow: no panic, and the same outcome as read at once.
        #[test]
        fn any_bytes_split_anyhow_are_read_as_at_once(
            bytes in proptest::collection::vec(
                prop_oneof![Just(b'\r'), Just(b'\n'), Just(b'*'), Just(b'$'), Just(b':'), Just(b'1'), Just(b'-'), any::<u8>()],
                0..200,
            ),
            reads in proptest::collection::vec(1usize..20, 0..30),
        ) {
            prop_assert_eq!(in_reads(&bytes, &reads), in_reads(&bytes, &[]));
        }
    }
}
