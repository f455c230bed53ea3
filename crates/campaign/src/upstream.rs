//! The upstream the campaign protects (`campaign upstream`, a process of
//! its own so that the nemesis can kill and pause it): a payments endpoint
//! that journals every execution (append, then fsync) before it answers,
//! so that a second execution of a key is on disk whatever happens after.
//!
//! `POST /pay` with `{"key": K, "amount": N}` runs the operation: 201, or
//! 402 (declined) for amounts divisible by 7; the body names the
//! execution (`exec`, unique), the key and the amount. `PUT /__slow/MS`
//! (sent to it directly, not through a proxy) makes each execution take MS
//! longer: an upstream slower than the lease.

use std::convert::Infallible;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::rng::Rng;

/// One journaled execution.
#[derive(Serialize, Deserialize)]
pub(crate) struct Journaled {
    pub t_unix_ms: u64,
    pub key: String,
    pub exec: String,
    pub status: u16,
    pub body_sha: String,
}

struct State {
    journal: Mutex<std::fs::File>,
    slow_ms: AtomicU64,
    count: AtomicU64,
    rng: Mutex<Rng>,
}

pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub(crate) fn sha_hex(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Serves on `port` until killed.
pub(crate) fn run(port: u16, journal: PathBuf) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&journal)?;
        // A line cut by a kill mid-write would swallow the next one.
        let text = std::fs::read(&journal)?;
        if text.last().is_some_and(|&b| b != b'\n') {
            file.write_all(b"\n")?;
            file.sync_data()?;
        }
        let state = Arc::new(State {
            journal: Mutex::new(file),
            slow_ms: AtomicU64::new(0),
            count: AtomicU64::new(0),
            rng: Mutex::new(Rng::new(u64::from(std::process::id()))),
        });
        let listener =
            tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await?;
        loop {
            let (stream, _) = listener.accept().await?;
            let state = state.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| handle(state.clone(), req));
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    })
}

#[derive(Deserialize)]
struct Payment {
    key: String,
    amount: u64,
}

async fn handle(
    state: Arc<State>,
    req: Request<hyper::body::Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let answer = |status: u16, body: Vec<u8>| {
        Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap()
    };
    if let Some(ms) = path.strip_prefix("/__slow/") {
        state
            .slow_ms
            .store(ms.parse().unwrap_or(0), Ordering::SeqCst);
        return Ok(answer(204, Vec::new()));
    }
    if path == "/healthz" {
        return Ok(answer(200, b"{}".to_vec()));
    }
    if method != hyper::Method::POST || path != "/pay" {
        return Ok(answer(404, b"{\"error\":\"not found\"}".to_vec()));
    }
    let Ok(p) = serde_json::from_slice::<Payment>(&body) else {
        return Ok(answer(400, b"{\"error\":\"bad payment\"}".to_vec()));
    };
    let status = if p.amount % 7 == 0 { 402 } else { 201 };
    let n = state.count.fetch_add(1, Ordering::SeqCst);
    let exec = format!("{}-{n}", std::process::id());
    let out = serde_json::to_vec(&serde_json::json!({
        "exec": exec, "key": p.key, "amount": p.amount, "status": status,
    }))
    .unwrap();
    let line = Journaled {
        t_unix_ms: unix_ms(),
        key: p.key,
        exec,
        status,
        body_sha: sha_hex(&out),
    };
    let mut text = serde_json::to_vec(&line).unwrap();
    text.push(b'\n');
    let st = state.clone();
    let written = tokio::task::spawn_blocking(move || {
        let mut f = st.journal.lock().unwrap();
        f.write_all(&text)?;
        f.sync_data()
    })
    .await;
    if !matches!(written, Ok(Ok(()))) {
        return Ok(answer(500, b"{\"error\":\"journal\"}".to_vec()));
    }
    // The work after the side effect: a little, or more than the lease.
    let work = state.rng.lock().unwrap().range(2, 30) + state.slow_ms.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(work)).await;
    Ok(answer(status, out))
}

/// Reads the journal, and how many lines were not whole executions (a
/// line cut by a kill mid-write: never fsynced, so never answered).
pub(crate) fn read_journal(path: &std::path::Path) -> std::io::Result<(Vec<Journaled>, u64)> {
    let bytes = std::fs::read(path)?;
    let mut out = Vec::new();
    let mut torn = 0;
    for line in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        match serde_json::from_slice(line) {
            Ok(j) => out.push(j),
            Err(_) => torn += 1,
        }
    }
    Ok((out, torn))
}
