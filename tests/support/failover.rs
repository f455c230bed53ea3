//! Traffic for the store failover tests (`pg_failover.rs`, `redis_failover.rs`):
//! clients sending fresh keys and retries of keys answered before, what they
//! saw, phase by phase, and the check once the failover is over: every key
//! answered 2xx retried, and the upstream's executions per key.
//!
//! A phase is a number the test moves on (`Traffic::enter`); its names are the
//! test's. Each fresh key counts in the phase it was sent in, and its answer
//! also remembers the phase it came in.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{eventually, Call, TestUpstream, DEADLINE};

/// Clients sending at once, each a fresh key per tick and every other tick a
/// retry of one it was answered before.
pub const CLIENTS: usize = 4;
pub const PACE: Duration = Duration::from_millis(10);

/// One protected route; a lease longer than any failover the tests wait for.
pub const ROUTES: &str = r#"
[defaults]
lease = "10s"

[[routes]]
name = "payments"
path = "/v1/payments"
"#;

/// A fresh key answered 2xx.
#[derive(Clone, Debug)]
pub struct Answer {
    /// The answer's body.
    pub body: Bytes,
    /// The phase the key was sent in, and the phase its answer came in.
    pub sent: u8,
    pub came: u8,
}

/// What the clients saw.
#[derive(Default)]
pub struct Log {
    /// The phases' names, by number.
    pub phases: Vec<&'static str>,
    /// The first 2xx answer, per key.
    pub answered: BTreeMap<String, Answer>,
    /// Fresh keys answered 2xx and refused, by the phase they were sent in.
    pub ok: Vec<usize>,
    pub refused: Vec<usize>,
    /// When the first fresh key sent in each phase was answered 2xx.
    pub first_ok: Vec<Option<Instant>>,
    /// A retry of an answered key that was executed again or got another answer.
    pub wrong_retries: Vec<String>,
}

impl Log {
    /// "before: 120 answered, 0 refused; failing: ..."
    pub fn counts(&self) -> String {
        let per: Vec<String> = self
            .phases
            .iter()
            .enumerate()
            .map(|(i, name)| {
                format!(
                    "{name}: {} answered, {} refused",
                    self.ok[i], self.refused[i]
                )
            })
            .collect();
        per.join("; ")
    }

    /// The keys answered 2xx that were sent in phase `sent`, their answer
    /// coming in a phase `came` accepts.
    pub fn keys(&self, sent: u8, came: impl Fn(u8) -> bool) -> Vec<&String> {
        self.answered
            .iter()
            .filter(|(_, a)| a.sent == sent && came(a.came))
            .map(|(k, _)| k)
            .collect()
    }
}

/// [`CLIENTS`] clients on one URL, until [`Traffic::stop`].
pub struct Traffic {
    phase: Arc<AtomicU8>,
    log: Arc<Mutex<Log>>,
    stop: Arc<AtomicBool>,
    hold: watch::Sender<bool>,
    held: Arc<AtomicUsize>,
    clients: Vec<JoinHandle<()>>,
}

impl Traffic {
    /// Starts the clients on `url`, in phase 0 of `phases`.
    pub fn start(url: &str, phases: &[&'static str]) -> Traffic {
        let n = phases.len();
        let phase = Arc::new(AtomicU8::new(0));
        let log = Arc::new(Mutex::new(Log {
            phases: phases.to_vec(),
            ok: vec![0; n],
            refused: vec![0; n],
            first_ok: vec![None; n],
            ..Log::default()
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (hold, _) = watch::channel(false);
        let held = Arc::new(AtomicUsize::new(0));
        let clients = (0..CLIENTS)
            .map(|me| {
                tokio::spawn(client(
                    url.to_string(),
                    me,
                    phase.clone(),
                    log.clone(),
                    stop.clone(),
                    (hold.subscribe(), held.clone()),
                ))
            })
            .collect();
        Traffic {
            phase,
            log,
            stop,
            hold,
            held,
            clients,
        }
    }

    /// Requests sent from now on are phase `phase`'s.
    pub fn enter(&self, phase: u8) {
        self.phase.store(phase, Ordering::Release);
    }

    /// Fresh keys sent in `phase` and answered 2xx so far.
    pub fn ok(&self, phase: u8) -> usize {
        self.log.lock().unwrap().ok[phase as usize]
    }

    /// Fresh keys sent in `phase` and refused so far.
    pub fn refused(&self, phase: u8) -> usize {
        self.log.lock().unwrap().refused[phase as usize]
    }

    /// Waits until `n` fresh keys sent in `phase` were answered 2xx.
    pub async fn wait_ok(&self, phase: u8, n: usize, what: &str) {
        eventually(what, DEADLINE, || async move {
            (self.ok(phase) >= n).then_some(())
        })
        .await;
    }

    /// Waits until `n` fresh keys sent in `phase` were refused.
    pub async fn wait_refused(&self, phase: u8, n: usize, what: &str) {
        eventually(what, DEADLINE, || async move {
            (self.refused(phase) >= n).then_some(())
        })
        .await;
    }

    /// Stops every client before its next request and returns once none has
    /// a request in flight (each answer it was waiting for came).
    pub async fn pause(&self) {
        self.hold.send_replace(true);
        eventually("the clients to pause", DEADLINE, || async {
            (self.held.load(Ordering::Acquire) == CLIENTS).then_some(())
        })
        .await;
    }

    pub fn resume(&self) {
        self.hold.send_replace(false);
    }

    /// Stops the clients and returns what they saw.
    pub async fn stop(self) -> Log {
        self.stop.store(true, Ordering::Release);
        self.hold.send_replace(false);
        for c in self.clients {
            c.await.unwrap();
        }
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

/// One client: a fresh key `c<me>-<i>` per tick, and every other tick a retry
/// of one of its keys answered before.
async fn client(
    url: String,
    me: usize,
    phase: Arc<AtomicU8>,
    log: Arc<Mutex<Log>>,
    stop: Arc<AtomicBool>,
    (mut hold, held): (watch::Receiver<bool>, Arc<AtomicUsize>),
) {
    let mut pace = tokio::time::interval(PACE);
    let mut answered: Vec<String> = Vec::new();
    for i in 0.. {
        if *hold.borrow() {
            held.fetch_add(1, Ordering::AcqRel);
            let _ = hold.wait_for(|h| !h).await;
            held.fetch_sub(1, Ordering::AcqRel);
        }
        if stop.load(Ordering::Acquire) {
            break;
        }
        pace.tick().await;
        let key = format!("c{me}-{i}");
        let during = phase.load(Ordering::Acquire);
        let r = Call::post(&url).key(&key).body(key.clone()).await;
        {
            let came = phase.load(Ordering::Acquire);
            let mut log = log.lock().unwrap();
            if (200..300).contains(&r.status) {
                assert!(!r.is_replay(), "{key}: a fresh key replayed");
                log.ok[during as usize] += 1;
                log.first_ok[during as usize].get_or_insert_with(Instant::now);
                let body = r.body.clone();
                log.answered.insert(
                    key.clone(),
                    Answer {
                        body,
                        sent: during,
                        came,
                    },
                );
                answered.push(key);
            } else {
                log.refused[during as usize] += 1;
            }
        }
        if i % 2 == 1 && !answered.is_empty() {
            let earlier = &answered[i * 7 % answered.len()];
            let r = Call::post(&url).key(earlier).body(earlier.clone()).await;
            let mut log = log.lock().unwrap();
            let first = log.answered.get(earlier).map(|a| &a.body);
            if (200..300).contains(&r.status) && !r.is_replay() {
                log.wrong_retries.push(format!("{earlier}: executed again"));
            } else if r.is_replay() && Some(&r.body) != first {
                log.wrong_retries.push(format!("{earlier}: another answer"));
            }
        }
    }
}

/// The failover's outcome, once the traffic has stopped.
pub struct Settled {
    /// Keys answered 2xx whose retry did not replay that same answer, with
    /// what the retry got.
    pub not_replayed: BTreeMap<String, String>,
    /// Keys the upstream executed more than once (those retries included),
    /// and how many times.
    pub twice: BTreeMap<String, usize>,
    /// Keys the upstream executed.
    pub executed: usize,
}

impl Settled {
    /// Nothing acknowledged lost: every key answered 2xx replayed its
    /// answer, and no key was executed more than once.
    pub fn assert_nothing_lost(&self, log: &Log) {
        let lost = &self.not_replayed;
        assert!(
            lost.is_empty(),
            "{} of {} acknowledged records lost or changed: {:?}",
            lost.len(),
            log.answered.len(),
            lost.iter().take(10).collect::<Vec<_>>()
        );
        assert!(
            self.twice.is_empty(),
            "executed more than once: {:?}",
            self.twice
        );
    }
}

/// Retries every key answered 2xx, each once its record is settled (a 409,
/// its completion still being written in the background, is retried until
/// [`DEADLINE`]); then counts the upstream's executions per key.
pub async fn settle(url: &str, log: &Log, upstream: &TestUpstream) -> Settled {
    let mut not_replayed = BTreeMap::new();
    for (key, first) in &log.answered {
        let r = eventually(&format!("{key} to replay"), DEADLINE, || async move {
            let r = Call::post(url).key(key).body(key.clone()).await;
            (r.status != 409).then_some(r)
        })
        .await;
        if (200..300).contains(&r.status) && !r.is_replay() {
            not_replayed.insert(key.clone(), format!("executed again ({})", r.status));
        } else if !r.is_replay() {
            not_replayed.insert(key.clone(), format!("{}", r.status));
        } else if r.body != first.body {
            not_replayed.insert(key.clone(), "another answer replayed".to_string());
        }
    }
    let executions = upstream.executions();
    let twice = executions
        .iter()
        .filter(|(_, &n)| n > 1)
        .map(|(k, &n)| (k.clone(), n))
        .collect();
    Settled {
        not_replayed,
        twice,
        executed: executions.len(),
    }
}
