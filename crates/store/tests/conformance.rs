//! The store's contract, run on every backend (memory, Redis, PostgreSQL),
//! clear and sealed, through the crate's own API (`Store`) against real
//! servers of the test's own (`idemproxy-testkit`).
//!
//! - a model of the contract, checked over generated sequences of operations
//!   (reserve, complete, renew, release, take-over, get, delete) on a few
//!   keys, with records from a few bytes to several pieces: every backend
//!   answers as the model does;
//! - one reserve wins among many sent at once;
//! - every operation is safe to send twice;
//! - leases run out: a vanished owner is taken over once, a renewed one never;
//! - a record sealed under a key the store does not hold is unreadable, never
//!   a clear answer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use idemproxy_store::config::{Backend, RedisMode, SslMode, StoreConfig};
use idemproxy_store::record::{Afterlife, DeadOwner, Finished, Processing, Record, Token};
use idemproxy_store::{Completion, Reservation, Store, StoreMetrics};
use idemproxy_testkit::{eventually, PgServer, RedisServer, DEADLINE};
use proptest::prelude::*;

/// The operations the store reported, as the proxy's metrics would see them.
#[derive(Default)]
struct Reported(Mutex<HashMap<&'static str, (u64, u64)>>);

impl StoreMetrics for Reported {
    fn store_op(&self, op: &'static str, _took: Duration, ok: bool) {
        let mut m = self.0.lock().unwrap();
        let e = m.entry(op).or_default();
        if ok {
            e.0 += 1;
        } else {
            e.1 += 1;
        }
    }
    fn store_sweep_failed(&self) {}
}

/// A store on `backend`, with the servers it runs on and its key file.
struct Fixture {
    store: Store,
    reported: Arc<Reported>,
    redis: Option<RedisServer>,
    postgres: Option<PgServer>,
    _keys: Option<tempfile::NamedTempFile>,
}

/// A key file with one key, `id`, of 32 bytes of `fill`.
fn key_file(id: &str, fill: u8) -> tempfile::NamedTempFile {
    use base64::Engine as _;
    use std::io::Write as _;
    let mut f = tempfile::NamedTempFile::new().unwrap();
    let key = base64::engine::general_purpose::STANDARD.encode([fill; 32]);
    writeln!(f, "{id}:{key}").unwrap();
    f
}

fn config(backend: Backend, url: String, keys: Option<&tempfile::NamedTempFile>) -> StoreConfig {
    StoreConfig {
        backend,
        url,
        key_prefix: "idemproxy".into(),
        op_timeout: Duration::from_secs(5),
        password_file: None,
        mode: RedisMode::Standalone,
        nodes: vec![],
        sentinels: vec![],
        master_name: None,
        username: None,
        tls_ca_file: None,
        wait_replicas: 0,
        wait_timeout: Duration::from_millis(100),
        memory_limit: 256 << 20,
        encryption_key_file: keys.map(|k| k.path().to_path_buf()),
        require_sealed: keys.is_some(),
        sslmode: SslMode::Disable,
        table: "idemproxy_records".into(),
        pool_size: 4,
    }
}

/// A store on `backend` (sealed under a key of its own when `sealed`), as the
/// server makes it before it serves (PostgreSQL's table checked).
async fn fixture(backend: Backend, sealed: bool) -> Fixture {
    let redis = match backend {
        Backend::Redis => Some(RedisServer::start().await),
        _ => None,
    };
    let postgres = match backend {
        Backend::Postgres => Some(PgServer::start().await),
        _ => None,
    };
    let keys = sealed.then(|| key_file("k1", 7));
    let store = store_on(backend, redis.as_ref(), postgres.as_ref(), keys.as_ref());
    let reported = Arc::new(Reported::default());
    let store = Store::new(&store, reported.clone(), 1).unwrap();
    store
        .check_schema()
        .await
        .expect("the table as the store needs it");
    Fixture {
        store,
        reported,
        redis,
        postgres,
        _keys: keys,
    }
}

fn store_on(
    backend: Backend,
    redis: Option<&RedisServer>,
    postgres: Option<&PgServer>,
    keys: Option<&tempfile::NamedTempFile>,
) -> StoreConfig {
    let url = match (redis, postgres) {
        (Some(r), _) => r.url(),
        (_, Some(p)) => p.url(),
        _ => String::new(),
    };
    config(backend, url, keys)
}

/// A reservation of `token`'s, with an afterlife of `after` (what the proxy writes).
fn reservation(token: Token, after: Duration) -> Bytes {
    processing_record(token, after).encode()
}

fn processing_record(token: Token, after: Duration) -> Record {
    Record::Processing(Processing {
        token,
        fingerprint: [1; 32],
        created_ms: 1,
        route: "r".into(),
        trace: None,
        afterlife: Some(Afterlife {
            after,
            then: DeadOwner::StoreUnknown,
        }),
    })
}

/// A finished record of `token`'s with a body of `body` bytes.
fn finished(token: Token, status: u16, body: usize) -> Record {
    Record::Finished(Finished {
        token,
        fingerprint: [1; 32],
        created_ms: 1,
        route: "r".into(),
        trace: None,
        completed_ms: 2,
        status,
        reason: None,
        body_stored: true,
        headers: vec![(
            http::HeaderName::from_static("content-type"),
            http::HeaderValue::from_static("application/json"),
        )],
        // Not all one byte, so that a piece out of place shows.
        body: Bytes::from((0..body).map(|i| (i % 251) as u8).collect::<Vec<u8>>()),
        trailers: vec![],
    })
}

macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {
        on_every_backend!(@on memory, Memory; $($name),*);
        on_every_backend!(@on redis, Redis; $($name),*);
        on_every_backend!(@on postgres, Postgres; $($name),*);
    };
    (@on $module:ident, $backend:ident; $($name:ident),*) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(idemproxy_store::config::Backend::$backend).await
                }
            )*
        }
    };
}

on_every_backend!(
    one_reserve_wins_among_many_sent_at_once,
    operations_are_safe_to_send_twice,
    a_vanished_owner_is_taken_over_once_and_its_late_completion_refused,
    an_owner_that_renewed_is_not_taken_over,
    a_finished_record_goes_with_its_ttl,
);

// ---------------------------------------------------------------------------
// The model.

/// What the model holds under a key.
#[derive(Clone, Debug)]
struct Held {
    token: usize,
    record: Record,
}

#[derive(Clone, Copy, Debug)]
enum Size {
    /// A few bytes: inline in a reserve's answer.
    Small,
    /// Over `INLINE_RECORD` (64 KiB): a reserve brings back only its head.
    OverInline,
    /// Over two 256 KiB pieces: written and read in pieces.
    Pieces,
}

impl Size {
    fn bytes(self) -> usize {
        match self {
            Size::Small => 12,
            Size::OverInline => 70 * 1024,
            Size::Pieces => 600 * 1024,
        }
    }
}

/// One operation of a generated sequence: on key `key` (of 3), by owner
/// `who` (of 3 tokens).
#[derive(Clone, Debug)]
enum Op {
    Reserve {
        key: usize,
        who: usize,
    },
    Complete {
        key: usize,
        who: usize,
        size: Size,
        status: u16,
    },
    Renew {
        key: usize,
        who: usize,
    },
    Release {
        key: usize,
        who: usize,
    },
    /// `taker` takes over `dead`'s reservation, writing its own finished
    /// record (or its reservation); `ripe`: the afterlife covers the whole lease.
    TakeOver {
        key: usize,
        dead: usize,
        taker: usize,
        ripe: bool,
        finish: bool,
    },
    Get {
        key: usize,
    },
    Delete {
        key: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0..3usize;
    let who = 0..3usize;
    let size =
        prop_oneof![8 => Just(Size::Small), 1 => Just(Size::OverInline), 1 => Just(Size::Pieces)];
    prop_oneof![
        4 => (key.clone(), who.clone()).prop_map(|(key, who)| Op::Reserve { key, who }),
        3 => (key.clone(), who.clone(), size, prop_oneof![Just(200u16), Just(201), Just(422), Just(500)])
            .prop_map(|(key, who, size, status)| Op::Complete { key, who, size, status }),
        1 => (key.clone(), who.clone()).prop_map(|(key, who)| Op::Renew { key, who }),
        2 => (key.clone(), who.clone()).prop_map(|(key, who)| Op::Release { key, who }),
        // A taker's token is never the dead owner's (the proxy makes a new one).
        2 => (key.clone(), who.clone(), 1..3usize, any::<bool>(), any::<bool>())
            .prop_map(|(key, dead, other, ripe, finish)| Op::TakeOver { key, dead, taker: (dead + other) % 3, ripe, finish }),
        2 => key.clone().prop_map(|key| Op::Get { key }),
        1 => key.prop_map(|key| Op::Delete { key }),
    ]
}

/// A reserve's answer as the model knows it: free, or whose record holds the
/// key and whether it is finished (a large record comes back as its head).
#[derive(Debug, PartialEq)]
enum Found {
    Reserved,
    Held { token: Token, finished: Option<u16> },
}

const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(600);

/// Runs `ops` on `store` (keys unique to this case) and on the model, and
/// compares every answer.
async fn agrees_with_the_model(store: &Store, case: u64, ops: &[Op]) -> Result<(), String> {
    let tokens = [Token::new(), Token::new(), Token::new()];
    let keys: Vec<String> = (0..3)
        .map(|k| store.key_for(&format!("case{case}-{k}")))
        .collect();
    let mut model: [Option<Held>; 3] = [None, None, None];
    for (step, op) in ops.iter().enumerate() {
        let at = format!("step {step} {op:?}");
        match *op {
            Op::Reserve { key, who } => {
                let r = store
                    .reserve(&keys[key], reservation(tokens[who], LEASE), LEASE)
                    .await
                    .map_err(|e| format!("{at}: {e}"))?;
                let got = match r {
                    Reservation::Reserved => Found::Reserved,
                    Reservation::Existing { record, .. } => Found::Held {
                        token: record.token(),
                        finished: match &record {
                            Record::Finished(f) => Some(f.status),
                            Record::Processing(_) => None,
                        },
                    },
                    Reservation::Large { head, .. } => Found::Held {
                        token: head.token,
                        finished: head.finished.map(|f| f.status),
                    },
                    Reservation::Unreadable(e) => return Err(format!("{at}: unreadable: {e}")),
                };
                let want = match &model[key] {
                    None => {
                        model[key] = Some(Held {
                            token: who,
                            record: processing_record(tokens[who], LEASE),
                        });
                        Found::Reserved
                    }
                    Some(h) => Found::Held {
                        token: tokens[h.token],
                        finished: match &h.record {
                            Record::Finished(f) => Some(f.status),
                            Record::Processing(_) => None,
                        },
                    },
                };
                check(&at, got, want)?;
            }
            Op::Complete {
                key,
                who,
                size,
                status,
            } => {
                let record = finished(tokens[who], status, size.bytes());
                let value = store.encode(&keys[key], &record).unwrap();
                let got = store
                    .complete(&keys[key], tokens[who], value, TTL)
                    .await
                    .map_err(|e| format!("{at}: {e}"))?;
                let want = match &model[key] {
                    Some(h) if h.token != who => Completion::Refused,
                    // Ours and finished: final, the first answer is kept.
                    Some(h) if matches!(h.record, Record::Finished(_)) => Completion::Stored,
                    Some(_) => {
                        model[key] = Some(Held { token: who, record });
                        Completion::Stored
                    }
                    None => {
                        model[key] = Some(Held { token: who, record });
                        Completion::StoredAfterExpiry
                    }
                };
                check(&at, got, want)?;
            }
            Op::Renew { key, who } => {
                let got = store
                    .renew(&keys[key], tokens[who], LEASE)
                    .await
                    .map_err(|e| format!("{at}: {e}"))?;
                let want = matches!(&model[key], Some(h) if h.token == who && matches!(h.record, Record::Processing(_)));
                check(&at, got, want)?;
            }
            Op::Release { key, who } => {
                let got = store
                    .release(&keys[key], tokens[who])
                    .await
                    .map_err(|e| format!("{at}: {e}"))?;
                let want = matches!(&model[key], Some(h) if h.token == who && matches!(h.record, Record::Processing(_)));
                if want {
                    model[key] = None;
                }
                check(&at, got, want)?;
            }
            Op::TakeOver {
                key,
                dead,
                taker,
                ripe,
                finish,
            } => {
                let record = match finish {
                    true => finished(tokens[taker], 502, 15),
                    false => processing_record(tokens[taker], LEASE),
                };
                let value = store.encode(&keys[key], &record).unwrap();
                // Ripe: no more than a whole hour left (the lease is a minute);
                // not: no time left at all (the lease has most of a minute).
                let afterlife = if ripe {
                    Duration::from_secs(3600)
                } else {
                    Duration::ZERO
                };
                let got = store
                    .take_over(&keys[key], tokens[dead], afterlife, value, TTL)
                    .await
                    .map_err(|e| format!("{at}: {e}"))?;
                let want = match &model[key] {
                    // The same take-over, sent twice.
                    Some(h) if h.token == taker => true,
                    Some(h)
                        if h.token == dead && ripe && matches!(h.record, Record::Processing(_)) =>
                    {
                        model[key] = Some(Held {
                            token: taker,
                            record,
                        });
                        true
                    }
                    _ => false,
                };
                check(&at, got, want)?;
            }
            Op::Get { key } => {
                let got = store
                    .get(&keys[key])
                    .await
                    .map_err(|e| format!("{at}: {e}"))?;
                let want = model[key].as_ref().map(|h| h.record.clone());
                if let Some(i) = &got {
                    if i.ttl.is_zero() || i.ttl > TTL {
                        return Err(format!("{at}: a time left of {:?}", i.ttl));
                    }
                }
                check(&at, got.map(|i| i.record), want)?;
            }
            Op::Delete { key } => {
                let got = store
                    .delete(&keys[key])
                    .await
                    .map_err(|e| format!("{at}: {e}"))?;
                let want = model[key].take().is_some();
                check(&at, got, want)?;
            }
        }
    }
    Ok(())
}

fn check<T: PartialEq + std::fmt::Debug>(at: &str, got: T, want: T) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        // A record's body can be 600 KiB: say what differs, not all of it.
        let (g, w) = (format!("{got:?}"), format!("{want:?}"));
        let cut = |s: &str| s.chars().take(400).collect::<String>();
        Err(format!(
            "{at}: the store answered\n  {}\nthe model\n  {}",
            cut(&g),
            cut(&w)
        ))
    }
}

/// The model, over `cases` generated sequences, on a store on `backend`.
fn the_model_holds(backend: Backend, sealed: bool, cases: u32) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let fixture = rt.block_on(fixture(backend, sealed));
    let case = AtomicU64::new(0);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let result = runner.run(&proptest::collection::vec(op(), 1..24), |ops| {
        let n = case.fetch_add(1, Ordering::Relaxed);
        rt.block_on(agrees_with_the_model(&fixture.store, n, &ops))
            .map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{backend:?} (sealed: {sealed}) differs from the model: {e}");
    }
    // Every operation was reported to the metrics, none as failed.
    let reported = fixture.reported.0.lock().unwrap();
    for op in [
        "reserve",
        "complete",
        "renew",
        "release",
        "take_over",
        "get",
        "delete",
    ] {
        assert!(
            reported.get(op).is_some_and(|&(ok, _)| ok > 0),
            "{op}: {reported:?}"
        );
    }
    assert!(
        reported.values().all(|&(_, failed)| failed == 0),
        "{reported:?}"
    );
    drop(reported);
    rt.block_on(async move { drop(fixture) });
}

#[test]
fn the_model_holds_on_memory() {
    the_model_holds(Backend::Memory, false, 256);
}

#[test]
fn the_model_holds_on_memory_sealed() {
    the_model_holds(Backend::Memory, true, 128);
}

#[test]
fn the_model_holds_on_redis() {
    the_model_holds(Backend::Redis, false, 256);
}

#[test]
fn the_model_holds_on_redis_sealed() {
    the_model_holds(Backend::Redis, true, 128);
}

#[test]
fn the_model_holds_on_postgres() {
    the_model_holds(Backend::Postgres, false, 192);
}

#[test]
fn the_model_holds_on_postgres_sealed() {
    the_model_holds(Backend::Postgres, true, 128);
}

// ---------------------------------------------------------------------------
// Scenarios.

/// Sixteen reserves of one key sent at once: one is `Reserved`, every other
/// finds the winner's reservation.
async fn one_reserve_wins_among_many_sent_at_once(backend: Backend) {
    let f = fixture(backend, false).await;
    let store = Arc::new(f.store);
    for round in 0..8 {
        let key = store.key_for(&format!("race-{round}"));
        let tokens: Vec<Token> = (0..16).map(|_| Token::new()).collect();
        let tasks: Vec<_> = tokens
            .iter()
            .map(|&t| {
                let (store, key) = (store.clone(), key.clone());
                tokio::spawn(async move { store.reserve(&key, reservation(t, LEASE), LEASE).await })
            })
            .collect();
        let mut winners = Vec::new();
        let mut holders = Vec::new();
        for (t, task) in tokens.iter().zip(tasks) {
            match task.await.unwrap().unwrap() {
                Reservation::Reserved => winners.push(*t),
                Reservation::Existing { record, .. } => holders.push(record.token()),
                r => panic!("{r:?}"),
            }
        }
        assert_eq!(
            winners.len(),
            1,
            "round {round}: one winner, not {}",
            winners.len()
        );
        assert!(
            holders.iter().all(|&h| h == winners[0]),
            "round {round}: every loser sees the winner"
        );
    }
}

/// The store's own contract: every operation is safe to send twice (the
/// client re-sends after reconnects).
async fn operations_are_safe_to_send_twice(backend: Backend) {
    let f = fixture(backend, false).await;
    let store = &f.store;
    let key = store.key_for("abc");
    let lease = Duration::from_secs(5);
    let mine = Token::new();
    // Reserve, twice: the second finds our own reservation (the request path
    // knows it by its token and goes on as the owner).
    let r = store
        .reserve(&key, reservation(mine, lease), lease)
        .await
        .unwrap();
    assert!(matches!(r, Reservation::Reserved), "{r:?}");
    let r = store
        .reserve(&key, reservation(mine, lease), lease)
        .await
        .unwrap();
    assert!(
        matches!(&r, Reservation::Existing { record, .. } if record.token() == mine),
        "{r:?}"
    );
    // Someone else finds it taken, with the lease left.
    let other = Token::new();
    match store
        .reserve(&key, reservation(other, lease), lease)
        .await
        .unwrap()
    {
        Reservation::Existing { record, ttl } => {
            assert_eq!(record.token(), mine);
            let ttl = match ttl {
                Some(ttl) => ttl,
                None => store.pttl(&key).await.unwrap(),
            };
            assert!(ttl <= lease && ttl > Duration::from_secs(4));
        }
        r => panic!("{r:?}"),
    }
    // Renewal: ours yes, theirs no.
    assert!(store.renew(&key, mine, lease).await.unwrap());
    assert!(!store.renew(&key, other, lease).await.unwrap());
    assert!(
        !store.release(&key, other).await.unwrap(),
        "a stranger cannot release"
    );
    // Complete, twice: the same record both times.
    let done = finished(mine, 201, 4);
    for _ in 0..2 {
        let c = store
            .complete(&key, mine, done.encode(), Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(c, Completion::Stored);
    }
    assert_eq!(store.get(&key).await.unwrap().unwrap().record, done);
    // A finished record of ours is final: a later completion of ours (the
    // small 410 record, sent after an attempt whose reply came too late but
    // whose write landed) does not replace it.
    let Record::Finished(mut small) = done.clone() else {
        unreachable!()
    };
    small.body_stored = false;
    small.body = Bytes::new();
    let c = store
        .complete(
            &key,
            mine,
            Record::Finished(small).encode(),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(c, Completion::Stored);
    assert_eq!(
        store.get(&key).await.unwrap().unwrap().record,
        done,
        "the answer is kept"
    );
    // A finished record is neither renewed nor released, and a stranger cannot overwrite it.
    assert!(!store.renew(&key, mine, lease).await.unwrap());
    assert!(!store.release(&key, mine).await.unwrap());
    assert_eq!(
        store
            .complete(&key, other, reservation(other, lease), lease)
            .await
            .unwrap(),
        Completion::Refused
    );
    // Release frees a reservation; a late completion then stores (nobody else holds the key).
    let key2 = store.key_for("def");
    store
        .reserve(&key2, reservation(mine, lease), lease)
        .await
        .unwrap();
    assert!(store.release(&key2, mine).await.unwrap());
    assert!(
        !store.release(&key2, mine).await.unwrap(),
        "releasing twice is harmless"
    );
    assert!(store.get(&key2).await.unwrap().is_none());
    assert_eq!(
        store
            .complete(&key2, mine, done.encode(), Duration::from_secs(60))
            .await
            .unwrap(),
        Completion::StoredAfterExpiry
    );
    assert!(store.delete(&key2).await.unwrap());
    assert!(!store.delete(&key2).await.unwrap());
}

/// Does a take-over of the reservation of `dead` (afterlife `after`),
/// writing `record` for a minute, go through?
async fn takes_over(
    store: &Store,
    key: &str,
    dead: Token,
    after: Duration,
    record: &Record,
) -> bool {
    let minute = Duration::from_secs(60);
    store
        .take_over(key, dead, after, record.encode(), minute)
        .await
        .unwrap()
}

/// Waits until no more than `after` is left of `key`'s time: its lease has run out.
async fn lease_runs_out(store: &Store, key: &str, after: Duration) {
    eventually("the lease to run out", DEADLINE, || async move {
        let left = store.pttl(key).await.unwrap();
        assert!(!left.is_zero(), "the reservation outlives its lease");
        (left <= after).then_some(())
    })
    .await;
}

/// A reservation whose owner never came back is taken over once its lease
/// has run out, by the dead owner's token, in one operation that is safe to
/// send twice; the owner's completion after that is refused (lease lost), and
/// its renewal and release too.
async fn a_vanished_owner_is_taken_over_once_and_its_late_completion_refused(backend: Backend) {
    let f = fixture(backend, false).await;
    let store = &f.store;
    let key = store.key_for("dead");
    let (lease, after) = (Duration::from_millis(400), Duration::from_secs(60));
    let (owner, taker, other) = (Token::new(), Token::new(), Token::new());
    let r = store
        .reserve(&key, reservation(owner, after), lease + after)
        .await
        .unwrap();
    assert!(matches!(r, Reservation::Reserved), "{r:?}");
    let unknown = finished(taker, 502, 15);
    // While the lease runs, nobody takes it over.
    assert!(!takes_over(store, &key, owner, after, &unknown).await);
    lease_runs_out(store, &key, after).await;
    // Not by a wrong token (another reservation holds the key).
    assert!(!takes_over(store, &key, other, after, &unknown).await);
    // Taken over, and the same call sent again is answered the same.
    for _ in 0..2 {
        assert!(takes_over(store, &key, owner, after, &unknown).await);
    }
    let got = store.get(&key).await.unwrap().unwrap();
    assert_eq!(got.record, unknown);
    assert!(
        got.ttl > Duration::from_secs(50),
        "the record's TTL: {:?}",
        got.ttl
    );
    // A second taker finds a finished record, not the dead owner's.
    assert!(!takes_over(store, &key, owner, after, &finished(other, 502, 15)).await);
    // The owner was only paused: its renewal, release and completion are refused.
    assert!(!store.renew(&key, owner, lease + after).await.unwrap());
    assert!(!store.release(&key, owner).await.unwrap());
    let late = finished(owner, 201, 4);
    let c = store
        .complete(&key, owner, late.encode(), Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(c, Completion::Refused, "a late owner's completion");
    assert_eq!(store.get(&key).await.unwrap().unwrap().record, unknown);
}

/// An owner that renews within the afterlife has its lease again: a take-over
/// judged on the time left before the renewal is refused, and so is one of
/// a finished record.
async fn an_owner_that_renewed_is_not_taken_over(backend: Backend) {
    let f = fixture(backend, false).await;
    let store = &f.store;
    let key = store.key_for("renewed");
    let (lease, after) = (Duration::from_millis(400), Duration::from_secs(60));
    let (owner, taker) = (Token::new(), Token::new());
    let r = store
        .reserve(&key, reservation(owner, after), lease + after)
        .await
        .unwrap();
    assert!(matches!(r, Reservation::Reserved), "{r:?}");
    lease_runs_out(store, &key, after).await;
    // The owner was slow, not dead: it renews before anyone takes over.
    assert!(store
        .renew(&key, owner, Duration::from_secs(30) + after)
        .await
        .unwrap());
    let unknown = finished(taker, 502, 15);
    assert!(
        !takes_over(store, &key, owner, after, &unknown).await,
        "a live lease is never taken over"
    );
    let done = finished(owner, 201, 4);
    let c = store
        .complete(&key, owner, done.encode(), Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(c, Completion::Stored);
    // A finished record with little time left is not a vanished owner's.
    assert!(!takes_over(store, &key, owner, after, &unknown).await);
    assert_eq!(store.get(&key).await.unwrap().unwrap().record, done);
}

/// A finished record is there for its TTL and gone after it: the key is
/// free for a new reservation (PostgreSQL's rows are judged by their
/// expiry whether or not a sweep has removed them yet).
async fn a_finished_record_goes_with_its_ttl(backend: Backend) {
    let f = fixture(backend, false).await;
    let store = &f.store;
    let key = store.key_for("short");
    let owner = Token::new();
    store
        .reserve(&key, reservation(owner, LEASE), LEASE)
        .await
        .unwrap();
    let done = finished(owner, 201, 4);
    let ttl = Duration::from_millis(300);
    assert_eq!(
        store
            .complete(&key, owner, done.encode(), ttl)
            .await
            .unwrap(),
        Completion::Stored
    );
    let got = store.get(&key).await.unwrap().expect("there for its TTL");
    assert!(got.ttl <= ttl, "{:?}", got.ttl);
    eventually("the record to expire", DEADLINE, || async {
        store.get(&key).await.unwrap().is_none().then_some(())
    })
    .await;
    assert!(store.pttl(&key).await.unwrap().is_zero());
    let next = Token::new();
    let r = store
        .reserve(&key, reservation(next, LEASE), LEASE)
        .await
        .unwrap();
    assert!(matches!(r, Reservation::Reserved), "{r:?}");
}

/// Two stores on one server, sealing under different keys (two proxies
/// whose key files differ): a record one sealed is unreadable to the other,
/// by a reserve and by a get, and never taken for a clear answer; a clear
/// record is unreadable to a store that requires sealing. Memory has no
/// second store to share with: Redis and PostgreSQL only.
async fn a_record_sealed_under_a_key_not_held_is_unreadable(backend: Backend) {
    let f = fixture(backend, true).await;
    let other_keys = key_file("k2", 9);
    let other = Store::new(
        &store_on(
            backend,
            f.redis.as_ref(),
            f.postgres.as_ref(),
            Some(&other_keys),
        ),
        Arc::new(Reported::default()),
        1,
    )
    .unwrap();
    other.check_schema().await.unwrap();
    let clear = Store::new(
        &store_on(backend, f.redis.as_ref(), f.postgres.as_ref(), None),
        Arc::new(Reported::default()),
        1,
    )
    .unwrap();
    clear.check_schema().await.unwrap();
    for size in [Size::Small, Size::OverInline, Size::Pieces] {
        let key = f.store.key_for(&format!("sealed-{size:?}"));
        let owner = Token::new();
        f.store
            .reserve(&key, reservation(owner, LEASE), LEASE)
            .await
            .unwrap();
        let done = finished(owner, 201, size.bytes());
        let sealed = f.store.encode(&key, &done).unwrap();
        let body = match &done {
            Record::Finished(f) => f.body.slice(..f.body.len().min(64)),
            Record::Processing(_) => unreachable!(),
        };
        assert!(
            !sealed.windows(body.len()).any(|w| w == &body[..]),
            "{size:?}: the body is not in the clear"
        );
        assert_eq!(
            f.store.complete(&key, owner, sealed, TTL).await.unwrap(),
            Completion::Stored
        );
        assert_eq!(
            f.store.get(&key).await.unwrap().unwrap().record,
            done,
            "{size:?}"
        );
        let r = other
            .reserve(&key, reservation(Token::new(), LEASE), LEASE)
            .await
            .unwrap();
        assert!(matches!(r, Reservation::Unreadable(_)), "{size:?}: {r:?}");
        assert!(
            other.get(&key).await.is_err(),
            "{size:?}: read under another key"
        );
        // A clear record planted under the key is not an answer to the sealed store.
        let planted = key.clone();
        assert!(clear.delete(&planted).await.unwrap());
        let stranger = Token::new();
        clear
            .reserve(&planted, reservation(stranger, LEASE), LEASE)
            .await
            .unwrap();
        let fake = finished(stranger, 200, size.bytes());
        clear
            .complete(&planted, stranger, fake.encode(), TTL)
            .await
            .unwrap();
        let r = f
            .store
            .reserve(&key, reservation(Token::new(), LEASE), LEASE)
            .await
            .unwrap();
        assert!(
            matches!(r, Reservation::Unreadable(_)),
            "{size:?}: a planted clear record: {r:?}"
        );
        assert!(f.store.get(&key).await.is_err(), "{size:?}");
    }
}

mod sealing {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_record_sealed_under_a_key_not_held_is_unreadable_on_redis() {
        super::a_record_sealed_under_a_key_not_held_is_unreadable(
            idemproxy_store::config::Backend::Redis,
        )
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_record_sealed_under_a_key_not_held_is_unreadable_on_postgres() {
        super::a_record_sealed_under_a_key_not_held_is_unreadable(
            idemproxy_store::config::Backend::Postgres,
        )
        .await
    }
}
