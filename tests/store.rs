//! What reaches Redis: round trips per request, key names, stored bytes.

mod support;

use support::*;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// A `MONITOR` connection: top-level commands as Redis sees them.
struct Monitor {
    lines: tokio::io::Lines<BufReader<TcpStream>>,
    port: u16,
}

impl Monitor {
    async fn start(redis: &RedisServer) -> Monitor {
        let mut s = TcpStream::connect(("127.0.0.1", redis.port)).await.unwrap();
        s.write_all(b"MONITOR\r\n").await.unwrap();
        let mut lines = BufReader::new(s).lines();
        let ok = lines.next_line().await.unwrap().unwrap();
        assert_eq!(ok, "+OK");
        Monitor {
            lines,
            port: redis.port,
        }
    }

    /// The top-level commands (not those a script runs) that touched a record
    /// key since the last call. A marker command closes the window, so nothing
    /// is missed or counted twice.
    async fn record_commands(&mut self, marker: &str) -> Vec<String> {
        let mut c = TcpStream::connect(("127.0.0.1", self.port)).await.unwrap();
        c.write_all(format!("ECHO {marker}\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = Vec::new();
        loop {
            let line = tokio::time::timeout(DEADLINE, self.lines.next_line())
                .await
                .expect("monitor line")
                .unwrap()
                .unwrap();
            if line.contains(marker) {
                return out;
            }
            if line.contains("\"idemproxy:") && !line.contains("[0 lua]") {
                out.push(line);
            }
        }
    }
}

/// How a reserve's read of what holds the key ends in `MONITOR`: its first
/// 64 KiB (`INLINE_RECORD`), the room the reserve took for its answer.
const RESERVE_READ: &str = "\"0\" \"65535\"";

/// A proxy on a Redis of its own, with `routes` and the `[server]` lines `server`.
async fn on_redis(server: &str, routes: &str) -> (RedisServer, TestUpstream, Proxy) {
    let redis = RedisServer::start().await;
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .server(server)
        .redis(&redis)
        .routes(routes)
        .build();
    let proxy = Proxy::in_process(&config, &[]).await;
    (redis, upstream, proxy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_key_costs_two_round_trips_and_a_replay_one() {
    let env = Env::start(Backend::Redis).await;
    let redis = env.redis.as_ref().unwrap();
    let mut monitor = Monitor::start(redis).await;
    let url = env.url("/v1/payments");
    let before = redis.calls("evalsha").await;
    let command = |line: &str| {
        line.split("] \"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .map(str::to_ascii_lowercase)
            .unwrap_or_default()
    };

    let first = Call::post(&url).key("k-rt").body("x").await;
    assert_eq!(first.status, 201);
    let cmds = monitor.record_commands("marker-new").await;
    let names: Vec<String> = cmds.iter().map(|c| command(c)).collect();
    assert_eq!(
        names,
        ["set", "getrange", "evalsha"],
        "a new key: the reserve (SET NX PX and its read, sent together) and \
         the completion script, nothing else: {cmds:#?}"
    );
    assert!(cmds[0].contains("\"NX\" \"PX\""), "{cmds:#?}");
    let after_new = redis.calls("evalsha").await;
    assert_eq!(after_new - before, 1, "one script call: the completion");

    let again = Call::post(&url).key("k-rt").body("x").await;
    assert!(again.is_replay());
    let cmds = monitor.record_commands("marker-replay").await;
    let names: Vec<String> = cmds.iter().map(|c| command(c)).collect();
    assert_eq!(
        names,
        ["set", "getrange"],
        "a replay is the reserve alone: {cmds:#?}"
    );
    assert_eq!(redis.calls("evalsha").await, after_new, "and no script");

    // A mismatch is the reserve alone too.
    Call::post(&url).key("k-rt").body("other").await;
    assert_eq!(monitor.record_commands("marker-mismatch").await.len(), 2);

    // A conflict reads the remaining lease too, for its Retry-After.
    let held = Call::post(&url)
        .key("k-rt2")
        .header("x-test-hold", "1")
        .spawn("x");
    env.upstream.wait_hits(2).await;
    monitor.record_commands("marker-held").await;
    let conflict = Call::post(&url).key("k-rt2").body("x").await;
    assert_eq!(conflict.status, 409);
    let names: Vec<String> = monitor
        .record_commands("marker-conflict")
        .await
        .iter()
        .map(|c| command(c))
        .collect();
    assert_eq!(names, ["set", "getrange", "pttl"]);
    env.upstream.release(1);
    held.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_holds_neither_the_raw_key_nor_credentials() {
    let env = Env::start(Backend::Redis).await;
    let redis = env.redis.as_ref().unwrap();
    let key = "raw-key-SHOULD-NOT-LEAK-4242";
    let token = "Bearer tok-SECRET-9999";
    let r = Call::post(&env.url("/v1/payments"))
        .key(key)
        .header("authorization", token)
        .header("cookie", "sid=COOKIE-SECRET")
        .header("x-test-body-bytes", "64")
        .body("{\"amount\":1}")
        .await;
    assert_eq!(r.status, 201);
    let keys = redis.keys().await;
    assert_eq!(keys.len(), 1);
    let name = &keys[0];
    assert!(
        !name.contains(key) && !name.contains("tok-SECRET"),
        "{name}"
    );
    let id = name
        .strip_prefix("idemproxy:")
        .expect("the configured prefix");
    assert_eq!(id.len(), 64);
    assert!(id.chars().all(|c| c.is_ascii_hexdigit()));

    let mut c = redis.conn().await.unwrap();
    let value: Vec<u8> = redis::cmd("GET")
        .arg(name)
        .query_async(&mut c)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&value);
    for secret in [key, "tok-SECRET-9999", "COOKIE-SECRET", "secret-session"] {
        assert!(!text.contains(secret), "stored record contains {secret:?}");
    }
    assert_eq!(value[0], 1, "records carry their format version");
    assert_eq!(value[1], b'F', "finished");

    // The record id in the log line names the store key. (The line is read
    // from the proxy's stderr by a thread of the harness: waited for.)
    let proxy = &env.proxy;
    let logs = support::eventually("the request log line with the record id", DEADLINE, || {
        let logs = proxy.logs();
        async move { logs.iter().any(|l| l.contains(id)).then_some(logs) }
    })
    .await;
    assert!(
        !logs
            .iter()
            .any(|l| l.contains(key) || l.contains("tok-SECRET")),
        "logs hold no key or secret"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservation_is_processing_with_the_lease_while_in_flight() {
    let env = Env::start(Backend::Redis).await;
    let redis = env.redis.as_ref().unwrap();
    let url = env.url("/v1/payments");
    let first = Call::post(&url)
        .key("k-lease")
        .header("x-test-hold", "1")
        .spawn("x");
    env.upstream.wait_hits(1).await;
    let keys = redis.keys().await;
    assert_eq!(keys.len(), 1);
    let mut c = redis.conn().await.unwrap();
    let value: Vec<u8> = redis::cmd("GET")
        .arg(&keys[0])
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(value[1], b'P', "processing while the upstream works");
    // Kept its afterlife (the route's 24 h TTL) past the 10 s lease, so that
    // an owner that vanishes is recognised (docs/reference/behaviour.md#dead-owner).
    let pttl: i64 = redis.cmd(&["PTTL", &keys[0]]).await;
    let (lease, afterlife) = (10_000, 24 * 3600 * 1000);
    assert!(
        pttl > afterlife && pttl <= lease + afterlife,
        "the 10 s lease and the 24 h afterlife, got {pttl}"
    );
    env.upstream.release(1);
    assert_eq!(first.await.unwrap().status, 201);
    let pttl: i64 = redis.cmd(&["PTTL", &keys[0]]).await;
    assert!(
        pttl > 10_000 && pttl <= 24 * 3600 * 1000,
        "after completion the 24 h TTL applies, got {pttl}"
    );
}

/// The store a configuration describes, through the library API.
fn store_from(config: ConfigBuilder) -> idemproxy::store::Store {
    let text = config.build();
    let cfg = idemproxy::config::Config::from_toml(&text, "t.toml", &Default::default()).unwrap();
    idemproxy::store::Store::new(
        &cfg.store,
        std::sync::Arc::new(idemproxy::metrics::Metrics::new()),
        1,
    )
    .unwrap()
}

/// A reservation with an afterlife of `after` (what the proxy writes).
fn reservation_with(token: idemproxy::record::Token, after: std::time::Duration) -> bytes::Bytes {
    use idemproxy::record::{Afterlife, Processing, Record};
    Record::Processing(Processing {
        token,
        fingerprint: [1; 32],
        created_ms: 1,
        route: "r".into(),
        trace: None,
        afterlife: Some(Afterlife {
            after,
            then: idemproxy::policy::DeadOwner::StoreUnknown,
        }),
    })
    .encode()
}

/// A finished record of `token`'s (the unknown outcome a taker stores).
fn finished_by(token: idemproxy::record::Token, status: u16) -> idemproxy::record::Record {
    idemproxy::record::Record::Finished(idemproxy::record::Finished {
        token,
        fingerprint: [1; 32],
        created_ms: 1,
        route: "r".into(),
        trace: None,
        completed_ms: 2,
        status,
        reason: None,
        body_stored: true,
        headers: vec![],
        body: bytes::Bytes::from_static(b"outcome-unknown"),
        trailers: vec![],
    })
}

/// Waits until no more than `after` is left of `key`'s time: its lease has run out.
async fn lease_runs_out(store: &idemproxy::store::Store, key: &str, after: std::time::Duration) {
    eventually("the lease to run out", DEADLINE, || async move {
        let left = store.pttl(key).await.unwrap();
        assert!(!left.is_zero(), "the reservation outlives its lease");
        (left <= after).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_record_is_fetched_only_with_room_for_it() {
    let routes = "[defaults]\nmax_request_body = \"1MiB\"\n\n[[routes]]\nname = \"payments\"\npath = \"/v1/payments\"\n";
    let (redis, upstream, proxy) = on_redis("max_buffered = \"1MiB\"", routes).await;
    let url = proxy.url("/v1/payments");
    // Kept whole in a 1 MiB budget (the answer and its record's copy count
    // while it is stored), too large to fetch beside a held 700 KiB body.
    let size = 400 * 1024;
    let big = || {
        Call::post(&url)
            .key("k-large")
            .header("x-test-body-bytes", &size.to_string())
            .body("x")
    };
    assert_eq!(big().await.status, 201);
    let mut monitor = Monitor::start(&redis).await;
    // Another request holds 700 KiB of the 1 MiB budget at the upstream.
    let held = Call::post(&url)
        .key("k-held")
        .header("x-test-hold", "1")
        .spawn(vec![b'h'; 700 * 1024]);
    upstream.wait_hits(2).await;
    monitor.record_commands("marker-held").await;
    let busy = big().await;
    assert_eq!(busy.status, 503);
    assert_eq!(busy.json()["type"], "proxy-busy");
    let cmds = monitor.record_commands("marker-busy").await;
    // The reserve reads at most its inline size (the room it took first)
    // and the length; nothing else is read.
    let reads: Vec<&String> = cmds
        .iter()
        .filter(|c| c.to_ascii_lowercase().contains("\"getrange\""))
        .collect();
    assert!(
        reads.len() == 1 && reads[0].ends_with(RESERVE_READ),
        "the 400 KiB record was not fetched without room for it: {cmds:#?}"
    );
    upstream.release(1);
    held.await.unwrap();
    let replay = big().await;
    assert!(replay.is_replay());
    assert_eq!(replay.body, binary(size));
    let cmds = monitor.record_commands("marker-replay").await;
    // With room it is fetched, in pieces of at most 256 KiB: 400 KiB is
    // two, plus the owner-token check at the end. No reply carries the
    // whole record (the client's read buffer would keep its size).
    let pieces: Vec<(u64, u64)> = cmds
        .iter()
        .filter(|c| c.to_ascii_lowercase().contains("\"getrange\""))
        .filter_map(|c| {
            let args: Vec<&str> = c.split('"').filter(|a| a.trim() != "").collect();
            let n = args.len();
            Some((
                args.get(n - 2)?.parse().ok()?,
                args.get(n - 1)?.parse().ok()?,
            ))
        })
        .collect();
    assert!(
        !cmds
            .iter()
            .any(|c| c.to_ascii_lowercase().contains("\"get\"")),
        "no whole-record GET: {cmds:#?}"
    );
    // The reserve's own bounded read first, then the pieces.
    assert_eq!(pieces.first(), Some(&(0, 65_535)), "{cmds:#?}");
    let covered: Vec<(u64, u64)> = pieces[1..]
        .iter()
        .copied()
        .filter(|(a, _)| *a != 2)
        .collect();
    assert_eq!(
        covered,
        [(0, 262_143), (262_144, 524_287)],
        "pieces: {cmds:#?}"
    );
    assert!(
        pieces.contains(&(2, 17)),
        "token re-read at the end: {cmds:#?}"
    );
    assert_eq!(upstream.hits(), 2, "executed once");
}

/// Scripts are sent by their hash (`EVALSHA`). A store that has lost them (a
/// restart, a failover, `SCRIPT FLUSH`) answers NOSCRIPT: the proxy loads
/// the script and sends the command again, and the request never notices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_lost_its_scripts_gets_them_again() {
    let (redis, upstream, proxy) = on_redis("", ROUTES).await;
    let url = proxy.url("/v1/payments");
    assert_eq!(Call::post(&url).key("s-0").body("x").await.status, 201);
    let noscript = || async {
        let info: String = redis.cmd(&["INFO", "errorstats"]).await;
        info.lines()
            .find_map(|l| l.strip_prefix("errorstat_NOSCRIPT:count="))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    // The proxy's own ping reloads lost scripts every 2 s: flush again until
    // a request met the loss itself.
    for i in 1..=5 {
        let before = noscript().await;
        let () = redis.cmd(&["SCRIPT", "FLUSH"]).await;
        let key = format!("s-{i}");
        let r = Call::post(&url).key(&key).body("x").await;
        if noscript().await > before {
            assert_eq!(r.status, 201, "a new key after NOSCRIPT");
            assert!(Call::post(&url).key(&key).body("x").await.is_replay());
            assert_eq!(upstream.hits(), i + 1);
            return;
        }
    }
    panic!("no request met NOSCRIPT in five tries");
}

/// Records larger than a reserve brings back are read from Redis two at a
/// time: six replays of 1 MiB records at once all come back whole, and
/// Redis never sees more than two of their reads under way together (a read
/// runs from its first piece to the owner-token re-read at the end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_records_are_read_two_at_a_time() {
    let (redis, upstream, proxy) = on_redis("", ROUTES).await;
    let url = proxy.url("/v1/payments");
    let size = |i: usize| 1024 * 1024 + i * 1024;
    let big = |i: usize| {
        Call::post(&url)
            .key(&format!("k-big-{i}"))
            .header("x-test-body-bytes", &size(i).to_string())
    };
    for i in 0..6 {
        assert_eq!(big(i).body("x").await.status, 201);
    }
    let mut monitor = Monitor::start(&redis).await;
    let replays: Vec<_> = (0..6).map(|i| big(i).spawn("x")).collect();
    for (i, replay) in replays.into_iter().enumerate() {
        let replay = replay.await.unwrap();
        assert!(replay.is_replay(), "replay {i}: {}", replay.status);
        assert_eq!(replay.body, binary(size(i)), "replay {i} whole");
    }
    let cmds = monitor.record_commands("marker-reads").await;
    let (mut open, mut most, mut reads) = (std::collections::HashSet::new(), 0, 0);
    for c in &cmds {
        let args: Vec<&str> = c.split('"').filter(|a| !a.trim().is_empty()).collect();
        let Some(key) = args.iter().find(|a| a.starts_with("idemproxy:")) else {
            continue;
        };
        let name = args.get(1).map(|n| n.to_ascii_lowercase());
        // A read's first piece (the reserve's own bounded read also starts at 0).
        let first_piece = name.as_deref() == Some("getrange")
            && args.get(args.len() - 2) == Some(&"0")
            && !c.ends_with(RESERVE_READ);
        if first_piece && open.insert(key.to_string()) {
            reads += 1;
            most = most.max(open.len());
        }
        if name.as_deref() == Some("getrange") && args.ends_with(&["2", "17"]) {
            open.remove(*key);
        }
    }
    assert_eq!(reads, 6, "each record read once: {cmds:#?}");
    assert!(open.is_empty(), "every read ended: {open:?}");
    assert!(most <= 2, "at most two reads under way at once, saw {most}");
    assert_eq!(upstream.hits(), 6, "executed once each");
}

/// A record over 256 KiB is written in pieces (`piece.lua`), its state byte
/// 'P' until the last one: a retry that arrives mid-way is told the request
/// is in progress (409), never given half an answer or a 500; the last
/// piece makes it a replayable answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_record_is_written_in_pieces_and_never_read_half_written() {
    let (redis, upstream, proxy) = on_redis("", ROUTES).await;
    let url = proxy.url("/v1/payments");
    let size = 600 * 1024;
    let big = || {
        Call::post(&url)
            .key("k-pieces")
            .header("x-test-body-bytes", &size.to_string())
            .body("x")
    };
    let mut monitor = Monitor::start(&redis).await;
    assert_eq!(big().await.status, 201);
    let cmds = monitor.record_commands("marker-write").await;
    let scripts = cmds
        .iter()
        .filter(|c| c.to_ascii_lowercase().contains("\"evalsha\""))
        .count();
    assert_eq!(scripts, 3, "three pieces: {}", cmds.len());
    assert!(
        cmds.iter().all(|c| c.len() < 4 * 300 * 1024),
        "no command carries the whole record"
    );

    // Put the record back as the first piece left it, then finish it by hand.
    let key = redis
        .keys()
        .await
        .into_iter()
        .next()
        .expect("the record key");
    let mut conn = redis.conn().await.unwrap();
    let whole: Vec<u8> = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut first = whole[..256 * 1024].to_vec();
    first[1] = b'P';
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg(first)
        .arg("PX")
        .arg(60_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    let mid_way = big().await;
    assert_eq!(mid_way.status, 409, "half written: in progress");
    let script = redis::Script::new(include_str!("../crates/store/src/piece.lua"));
    let token = &whole[2..18];
    // Out of step (a piece for an offset the record has not reached): refused.
    let n: i64 = script
        .key(&key)
        .arg(token)
        .arg(7)
        .arg("x")
        .arg(60_000)
        .arg("")
        .invoke_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, -1);
    for (from, last) in [(256 * 1024, false), (512 * 1024, true)] {
        let to = (from + 256 * 1024).min(whole.len());
        let n: i64 = script
            .key(&key)
            .arg(token)
            .arg(from)
            .arg(&whole[from..to])
            .arg(60_000)
            .arg(if last { "86400000" } else { "" })
            .invoke_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(n, 1);
    }
    let replay = big().await;
    assert!(replay.is_replay(), "status {}", replay.status);
    assert_eq!(replay.body, binary(size));
    // A piece delivered late (its attempt given up), even from offset 0,
    // never turns the finished record back into a reservation.
    let n: i64 = script
        .key(&key)
        .arg(token)
        .arg(0)
        .arg(&whole[..256 * 1024])
        .arg(60_000)
        .arg("")
        .invoke_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, 3, "finished already: nothing written");
    let after: Vec<u8> = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(after == whole, "the finished record is left as it is");
    // Another owner: refused.
    let n: i64 = script
        .key(&key)
        .arg(&[0u8; 16][..])
        .arg(0)
        .arg("x")
        .arg(60_000)
        .arg("")
        .invoke_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, 0);
    assert_eq!(upstream.hits(), 1, "executed once");
}

// ---------------------------------------------------------------------------
// idemproxy's own Redis connection (`store::wire`, used on plain TCP): one
// socket pipelines every caller's commands, and replies go back in order.

/// A store on `redis` with more `[store]` lines.
fn store_on(redis: &RedisServer, lines: &str) -> idemproxy::store::Store {
    store_from(
        ConfigBuilder::new("http://127.0.0.1:1")
            .redis(redis)
            .store(lines),
    )
}

fn processing(token: idemproxy::record::Token) -> bytes::Bytes {
    idemproxy::record::Record::Processing(idemproxy::record::Processing {
        token,
        fingerprint: [1; 32],
        created_ms: 1,
        route: "r".into(),
        trace: None,
        afterlife: None,
    })
    .encode()
}

/// The store's connections from Redis's side (`CLIENT LIST`, less the
/// connection that asks).
async fn store_connections(redis: &RedisServer) -> usize {
    let list: String = redis.cmd(&["CLIENT", "LIST", "TYPE", "normal"]).await;
    list.lines().filter(|l| !l.contains("cmd=client")).count()
}

/// A caller that stops waiting leaves its reply to arrive later. That reply
/// must be dropped, not handed to the next caller on the same socket: here
/// the first call (on a taken key) is given up while Redis is paused, a
/// second (on a free key) queued behind it, and the second must get its own
/// answer, "reserved", not the first one's "taken".
/// A reserve brings back at most `INLINE_RECORD` bytes of what holds the
/// key, the room its caller took for the answer: a value of exactly that
/// size comes whole (its length says it is all), one byte more comes only
/// as its length and its head (all that a 409 or a 422 needs), the rest to
/// be fetched once there is room for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_brings_back_at_most_its_inline_size() {
    use idemproxy::record::Token;
    use idemproxy::store::{Reservation, INLINE_RECORD};

    let redis = RedisServer::start().await;
    let store = store_on(&redis, "");
    let lease = std::time::Duration::from_secs(30);
    let inline = INLINE_RECORD as usize;
    let mut c = redis.conn().await.unwrap();
    for (name, size) in [("under", inline - 1), ("at", inline), ("over", inline + 1)] {
        let key = store.key_for(name);
        // Another's reservation, padded to `size` bytes.
        let theirs = Token::new();
        let mut value = processing(theirs).to_vec();
        value.resize(size, b'x');
        let () = redis::cmd("SET")
            .arg(key.as_str())
            .arg(&value)
            .query_async(&mut c)
            .await
            .unwrap();
        let found = store
            .reserve(&key, processing(Token::new()), lease)
            .await
            .unwrap();
        match (size > inline, found) {
            // Came whole, and is no record of ours.
            (false, Reservation::Existing { record, .. }) => assert_eq!(record.token(), theirs),
            (false, Reservation::Unreadable(_)) => {}
            (true, Reservation::Large { len, head }) => {
                assert_eq!(len, size as u64);
                assert_eq!(head.token, theirs);
            }
            (_, other) => panic!("{name} ({size} bytes): {other:?}"),
        }
        let left: Vec<u8> = redis.cmd(&["GET", key.as_str()]).await;
        assert_eq!(left, value, "{name}: left as it was");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_that_comes_too_late_goes_to_nobody_else() {
    use idemproxy::record::Token;
    use idemproxy::store::Reservation;
    use std::time::Duration;

    let redis = RedisServer::start().await;
    let store = store_on(&redis, "op_timeout = \"5s\"");
    let lease = Duration::from_secs(30);
    let (taken, free) = (store.key_for("taken"), store.key_for("free"));
    let first = Token::new();
    let r = store
        .reserve(&taken, processing(first), lease)
        .await
        .unwrap();
    assert!(matches!(r, Reservation::Reserved), "{r:?}");
    assert_eq!(store_connections(&redis).await, 1, "one connection");

    let () = redis.cmd(&["CLIENT", "PAUSE", "700", "ALL"]).await;
    // Given up by its caller (not by the store's timeout, which would count
    // a failure): its command is on the wire already.
    let given_up = tokio::time::timeout(
        Duration::from_millis(200),
        store.reserve(&taken, processing(Token::new()), lease),
    )
    .await;
    assert!(given_up.is_err(), "Redis is paused: {given_up:?}");
    let second = Token::new();
    let r = store
        .reserve(&free, processing(second), lease)
        .await
        .unwrap();
    assert!(
        matches!(r, Reservation::Reserved),
        "the second caller gets its own answer, not the given-up one's: {r:?}"
    );
    // Both commands ran, in order, on the one connection.
    let owner = |key: String| {
        let store = &store;
        async move {
            match store.reserve(&key, processing(Token::new()), lease).await {
                Ok(Reservation::Existing { record, .. }) => record.token(),
                other => panic!("{key} is held: {other:?}"),
            }
        }
    };
    assert_eq!(owner(taken).await, first);
    assert_eq!(owner(free).await, second);
    assert_eq!(store_connections(&redis).await, 1, "still one connection");
}

/// A connection Redis closed is made anew by the next operation: at most the
/// one operation that raced the close fails (the store's rule of two failures
/// in a row before reconnecting is for connections that hang, not for ones
/// that are plainly gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_redis_closed_is_made_anew_by_the_next_operation() {
    let redis = RedisServer::start().await;
    let store = store_on(&redis, "op_timeout = \"2s\"");
    for round in 0..3 {
        store.ping().await.unwrap();
        let killed: i64 = redis
            .cmd(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"])
            .await;
        assert!(killed >= 1, "round {round}: the store's connection");
        let failed = std::cell::Cell::new(0);
        eventually("an operation to succeed again", DEADLINE, || {
            let (store, failed) = (&store, &failed);
            async move {
                match store.get(&store.key_for("k")).await {
                    Ok(_) => Some(()),
                    Err(e) => {
                        failed.set(failed.get() + 1);
                        assert!(failed.get() <= 1, "round {round}: failed twice: {e}");
                        None
                    }
                }
            }
        })
        .await;
    }
}

/// A connection the store gives up (operations kept timing out: a hung
/// store) is closed, not left open beside its replacement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_the_store_gave_up_is_closed() {
    let redis = RedisServer::start().await;
    let store = store_on(&redis, "op_timeout = \"100ms\"");
    store.ping().await.unwrap();
    let () = redis.cmd(&["CLIENT", "PAUSE", "800", "ALL"]).await;
    for _ in 0..2 {
        let e = store.get(&store.key_for("k")).await.unwrap_err();
        assert!(matches!(e, idemproxy::store::StoreError::Timeout(_)), "{e}");
    }
    // The next operation connects anew (and waits out the pause).
    eventually("the store to answer again", DEADLINE, || async {
        store.get(&store.key_for("k")).await.ok()
    })
    .await;
    eventually("the given-up connection to be closed", DEADLINE, || async {
        (store_connections(&redis).await == 1).then_some(())
    })
    .await;
}

/// A connect that fails (here a wrong password) is not tried again by every
/// operation: until the next attempt is due (50 ms, doubling to 1 s),
/// operations fail at once with the last error. Redis counts the connections
/// it was offered; once the password is right, the store connects by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_connect_is_not_tried_again_by_every_operation() {
    let redis = RedisServer::start().await;
    let store = store_from(
        ConfigBuilder::new("http://127.0.0.1:1")
            .redis_url(&format!("redis://idem:secret@127.0.0.1:{}/0", redis.port))
            .store("op_timeout = \"2s\""),
    );
    let connections = || async {
        let info: String = redis.cmd(&["INFO", "stats"]).await;
        info.lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .expect("total_connections_received")
    };
    let before = connections().await;
    for i in 0..30 {
        let e = store.get(&store.key_for("k")).await.unwrap_err();
        if i > 0 {
            assert!(e.to_string().contains("the next connect in"), "{e}");
        }
    }
    // One connection for the store's first attempt, at most one more if the
    // loop outlived the first 50 ms, and the counting connections' own.
    let offered = connections().await - before;
    assert!(offered <= 3, "{offered} connections for 30 operations");
    let () = redis
        .cmd(&["ACL", "SETUSER", "idem", "on", ">secret", "~*", "+@all"])
        .await;
    eventually(
        "the store to connect once its password is right",
        DEADLINE,
        || async { store.get(&store.key_for("k")).await.ok() },
    )
    .await;
}

/// With `wait_replicas`, a take-over waits for the replicas as a reserve
/// does: too few, and the request is refused (a reservation of the taker's
/// withdrawn), so that a failover cannot bring the vanished owner's
/// reservation back for a second taker to run it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_over_waits_for_the_replicas_as_a_reserve_does() {
    use idemproxy::record::Token;
    use idemproxy::store::{Reservation, StoreError};
    use std::time::Duration;

    let redis = RedisServer::start().await;
    let plain = store_on(&redis, "");
    // No replica answers this one's WAIT.
    let waiting = store_on(&redis, "wait_replicas = 1\nwait_timeout = \"50ms\"");
    let (lease, after) = (Duration::from_millis(300), Duration::from_secs(60));
    for (name, then_finished) in [("unknown", true), ("again", false)] {
        let key = plain.key_for(name);
        let owner = Token::new();
        let r = plain
            .reserve(&key, reservation_with(owner, after), lease + after)
            .await
            .unwrap();
        assert!(matches!(r, Reservation::Reserved), "{r:?}");
        lease_runs_out(&plain, &key, after).await;
        let taker = Token::new();
        let value = match then_finished {
            true => finished_by(taker, 502).encode(),
            false => reservation_with(taker, after),
        };
        let r = waiting
            .take_over(&key, owner, after, value, lease + after)
            .await;
        assert!(
            matches!(
                r,
                Err(StoreError::NotReplicated {
                    wanted: 1,
                    acked: 0
                })
            ),
            "{name}: {r:?}"
        );
        let left = plain.get(&key).await.unwrap();
        match then_finished {
            // On the master, for the replay once the replicas have it.
            true => assert_eq!(left.unwrap().record.token(), taker, "{name}"),
            // Withdrawn, as an unconfirmed reservation is.
            false => assert!(left.is_none(), "{name}: {left:?}"),
        }
    }
}
