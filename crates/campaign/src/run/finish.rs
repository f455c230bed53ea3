//! Ending a campaign: the final phase that asks every key once more, and
//! the upstream's journal joined to the history.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::clients::{self, Book, Op};
use crate::history::{self, Event, Phase};
use crate::record::Recorder;
use crate::rng::Rng;

/// Every key once more, each retried until it settles or `bound` after
/// `from` or after it was first asked, whichever is later: every key is
/// asked, however many there are.
pub(super) async fn final_phase(
    rec: &Arc<Recorder>,
    book: &Arc<Book>,
    proxies: &[SocketAddr],
    from: Instant,
    bound: Duration,
    rng: Rng,
) {
    let keys: Vec<Op> = book.keys.lock().unwrap().clone();
    let queue = Arc::new(std::sync::Mutex::new(keys));
    let mut workers = Vec::new();
    for w in 0..16u32 {
        let (queue, rec, proxies) = (queue.clone(), rec.clone(), proxies.to_vec());
        let mut rng = rng.fork(u64::from(w));
        workers.push(tokio::spawn(async move {
            let http = clients::http();
            loop {
                let Some(mut op) = queue.lock().unwrap().pop() else {
                    break;
                };
                let deadline = from.max(Instant::now()) + bound;
                loop {
                    let p = rng.range(0, proxies.len() as u64 - 1) as usize;
                    let out = clients::attempt(
                        &http,
                        &rec,
                        10_000 + w,
                        (p as u32, proxies[p]),
                        &op,
                        Phase::Final,
                        Duration::from_secs(3),
                    )
                    .await;
                    op.attempts += 1;
                    if out.settled() || Instant::now() >= deadline {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }));
    }
    for w in workers {
        let _ = w.await;
    }
}

/// Appends the upstream's journal to the history as `Exec` events and
/// writes the notes; an error when the history lost lines.
pub(super) fn join_journal(
    journal: &Path,
    rec: &Recorder,
    out: &Path,
    logs: &Path,
    mut notes: Vec<String>,
) -> Result<(), String> {
    let mut execs = Vec::new();
    let (journaled, torn) = crate::upstream::read_journal(journal)
        .map_err(|e| format!("the upstream's journal {}: {e}", journal.display()))?;
    if torn > 0 {
        notes.push(format!(
            "{torn} journal line(s) cut by a kill mid-write (never answered)"
        ));
    }
    for j in journaled {
        execs.push(Event::Exec {
            t: j.t_unix_ms.saturating_sub(rec.start_unix_ms),
            key: j.key,
            exec: j.exec,
            status: j.status,
            body_sha: j.body_sha,
        });
    }
    {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(out.join("history.jsonl"))
            .map_err(|e| e.to_string())?;
        history::write(&mut f, &execs).map_err(|e| e.to_string())?;
    }
    std::fs::write(logs.join("notes.txt"), notes.join("\n")).map_err(|e| e.to_string())?;
    if rec.lost() > 0 {
        return Err(format!(
            "{} history line(s) could not be written to {}: the history cannot be judged",
            rec.lost(),
            out.join("history.jsonl").display()
        ));
    }
    Ok(())
}
