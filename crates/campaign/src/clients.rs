//! Clients that behave as real ones do: one key per intended payment, a
//! timeout on every request, the same key again on a timeout, a 409, a
//! 5xx or a broken connection, with a bounded, jittered back-off; a client
//! that gives up may come back to the key much later. Each request goes to
//! any proxy replica, as behind a load balancer.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

use crate::history::{Event, Phase};
use crate::record::Recorder;
use crate::rng::Rng;
use crate::upstream::sha_hex;

pub(crate) type Http = Client<HttpConnector, Full<Bytes>>;

pub(crate) fn http() -> Http {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    c.set_connect_timeout(Some(Duration::from_secs(1)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(5))
        .build(c)
}

/// A key and the body that goes with it (the same on every retry).
#[derive(Clone)]
pub(crate) struct Op {
    pub key: String,
    pub body: Bytes,
    /// Attempts so far.
    pub attempts: u32,
}

/// What everyone shares: the keys so far, and the ones given up on.
#[derive(Default)]
pub(crate) struct Book {
    pub keys: Mutex<Vec<Op>>,
    /// Given-up keys and when their client comes back to them.
    late: Mutex<Vec<(Instant, Op)>>,
}

/// How an attempt ended: the status (`None`: no answer) and the answer's
/// `Retry-After`.
pub(crate) struct Outcome {
    pub status: Option<u16>,
    pub after: Option<Duration>,
}

impl Outcome {
    /// What a client retries: no answer, 409, 5xx.
    pub(crate) fn retried(&self) -> bool {
        self.status.is_none_or(|s| s == 409 || s >= 500)
    }

    /// What the final phase waits past: no answer, 409 (in flight), 503
    /// (the store unavailable); anything else is the key's answer.
    pub(crate) fn settled(&self) -> bool {
        self.status.is_some_and(|s| s != 409 && s != 503)
    }
}

/// Sends one attempt of `op` to `proxy` and records it.
pub(crate) async fn attempt(
    http: &Http,
    rec: &Recorder,
    client: u32,
    proxy: (u32, SocketAddr),
    op: &Op,
    phase: Phase,
    timeout: Duration,
) -> Outcome {
    let id = rec.op_id();
    rec.record(Event::Invoke {
        t: rec.now(),
        op: id,
        client,
        key: op.key.clone(),
        attempt: op.attempts,
        proxy: proxy.0,
        phase,
    });
    let started = Instant::now();
    let req = hyper::Request::post(format!("http://{}/pay", proxy.1))
        .header("content-type", "application/json")
        .header("idempotency-key", &op.key)
        .body(Full::new(op.body.clone()))
        .expect("a request");
    let result = send(http, req, timeout).await;
    let latency_ms = started.elapsed().as_secs_f64() * 1e3;
    let (parts, body) = match result {
        Err(error) => {
            rec.record(Event::Error {
                t: rec.now(),
                op: id,
                error,
                latency_ms,
            });
            return Outcome {
                status: None,
                after: None,
            };
        }
        Ok(v) => v,
    };
    let status = parts.status.as_u16();
    let replayed = parts
        .headers
        .get("idempotent-replayed")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
    let json: Option<serde_json::Value> = serde_json::from_slice(&body).ok();
    let field = |k: &str| json.as_ref()?.get(k)?.as_str().map(str::to_string);
    let problem = field("type").map(|t| t.rsplit('/').next().unwrap_or(&t).to_string());
    rec.record(Event::Answer {
        t: rec.now(),
        op: id,
        status,
        replayed,
        body_sha: sha_hex(&body),
        exec: field("exec"),
        answer_key: field("key"),
        problem,
        latency_ms,
    });
    let after = parts
        .headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .map(Duration::from_secs);
    Outcome {
        status: Some(status),
        after,
    }
}

/// Sends `req` and reads its whole answer within `timeout`; the error as
/// the history names it ("timeout", "connect", "reset", ...).
async fn send(
    http: &Http,
    req: hyper::Request<Full<Bytes>>,
    timeout: Duration,
) -> Result<(http::response::Parts, Bytes), String> {
    let sent = async {
        let resp = http.request(req).await.map_err(classify)?;
        let (parts, body) = resp.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|_| "reset".to_string())?
            .to_bytes();
        Ok::<_, String>((parts, body))
    };
    match tokio::time::timeout(timeout, sent).await {
        Err(_) => Err("timeout".into()),
        Ok(r) => r,
    }
}

fn classify(e: hyper_util::client::legacy::Error) -> String {
    let text = format!("{e:?}").to_ascii_lowercase();
    if e.is_connect() {
        "connect".into()
    } else if text.contains("reset") || text.contains("closed") || text.contains("incomplete") {
        "reset".into()
    } else {
        "other".into()
    }
}

/// The back-off before attempt `n` (1, 2...): 50 ms doubling to 2 s, ×0.5–1.5.
pub(crate) fn backoff(rng: &mut Rng, n: u32, after: Option<Duration>) -> Duration {
    let base = 50u64.saturating_mul(1 << n.min(6)).min(2_000);
    let jittered = base * rng.range(50, 150) / 100;
    let ms = after
        .map(|a| (a.as_millis() as u64).min(2_000))
        .unwrap_or(0)
        .max(jittered);
    Duration::from_millis(ms)
}

/// One client until `until`: payment after payment, each retried as above.
pub(crate) async fn run(
    id: u32,
    mut rng: Rng,
    proxies: Vec<SocketAddr>,
    rec: Arc<Recorder>,
    book: Arc<Book>,
    until: Instant,
) {
    let http = http();
    let timeout = Duration::from_millis(rng.range(800, 3_000));
    let mut n = 0u64;
    while Instant::now() < until {
        let late = {
            let mut late = book.late.lock().unwrap();
            let now = Instant::now();
            match late.iter().position(|(due, _)| *due <= now) {
                Some(i) if rng.chance(0.3) => Some(late.swap_remove(i).1),
                _ => None,
            }
        };
        let mut op = match late {
            Some(op) => op,
            None => {
                n += 1;
                let key = format!("{}-{id}-{n}", rec.seed_tag());
                let amount = rng.range(1, 10_000);
                let body =
                    serde_json::to_vec(&serde_json::json!({"key": key, "amount": amount})).unwrap();
                let op = Op {
                    key,
                    body: Bytes::from(body),
                    attempts: 0,
                };
                book.keys.lock().unwrap().push(op.clone());
                op
            }
        };
        let first = Instant::now();
        loop {
            let p = rng.range(0, proxies.len() as u64 - 1) as usize;
            let out = attempt(
                &http,
                &rec,
                id,
                (p as u32, proxies[p]),
                &op,
                Phase::Load,
                timeout,
            )
            .await;
            op.attempts += 1;
            if !out.retried() {
                break;
            }
            let after = out.after;
            if op.attempts >= 8
                || first.elapsed() > Duration::from_secs(20)
                || Instant::now() >= until
            {
                // Given up; some come back to it much later.
                if rng.chance(0.25) {
                    let back = Duration::from_millis(rng.range(5_000, 60_000));
                    book.late
                        .lock()
                        .unwrap()
                        .push((Instant::now() + back, op.clone()));
                }
                break;
            }
            tokio::time::sleep(backoff(&mut rng, op.attempts, after)).await;
        }
        tokio::time::sleep(Duration::from_millis(rng.range(0, 100))).await;
    }
}
