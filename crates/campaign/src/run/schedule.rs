//! Running the nemesis: the schedule drawn from the seed before anything
//! runs, then each fault started and ended on the world at its time.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;

use super::world::World;
use super::Options;
use crate::history::{Event, FaultPhase};
use crate::nemesis::{self, Cast, Kind, Planned};
use crate::record::Recorder;
use crate::rng::Rng;

/// The schedule, drawn before anything runs (none with `--no-faults`),
/// written to `logs/schedule.txt`.
pub(super) fn plan(
    opts: &Options,
    rng: &Rng,
    lease: Duration,
    store_procs: &[String],
    store_nodes: usize,
    logs: &Path,
) -> Result<Vec<Planned>, String> {
    let mut plan_rng = rng.fork(2);
    let plan = if opts.no_faults {
        Vec::new()
    } else {
        nemesis::schedule(
            &mut plan_rng,
            &Cast {
                topology: opts.topology,
                proxies: opts.proxies,
                store_procs,
                store_nodes,
                lease_ms: lease.as_millis() as u64,
                kinds: &opts.faults,
            },
            opts.duration.as_millis() as u64,
        )
    };
    std::fs::write(
        logs.join("schedule.txt"),
        plan.iter().map(|p| format!("{p:?}\n")).collect::<String>(),
    )
    .map_err(|e| e.to_string())?;
    Ok(plan)
}

/// Runs the schedule; returns its notes and the store faults still
/// converging (each records its end when the store has).
pub(super) async fn run_nemesis(
    world: Arc<Mutex<World>>,
    rec: Arc<Recorder>,
    plan: Vec<Planned>,
    mut rng: Rng,
) -> (Vec<String>, Vec<tokio::task::JoinHandle<()>>) {
    // Starts and ends in time order.
    let mut steps: Vec<(u64, bool, Planned)> = Vec::new();
    for p in plan {
        steps.push((p.at_ms, true, p.clone()));
        steps.push((p.at_ms + p.for_ms, false, p));
    }
    steps.sort_by_key(|(t, start, p)| (*t, *start, p.id));
    let mut notes = Vec::new();
    let mut converging = Vec::new();
    for (t, start, p) in steps {
        if !start && p.kind == Kind::Failover {
            continue; // a failover ends when it is done (below), not on the clock
        }
        let now = rec.now();
        if t > now {
            tokio::time::sleep(Duration::from_millis(t - now)).await;
        }
        let mut w = world.lock().await;
        if start {
            rec.record(fault(&rec, &p, FaultPhase::Start));
            let note = w.start(&p, &mut rng).await;
            if !note.is_empty() {
                notes.push(format!(
                    "{} {} {}: {note}",
                    rec.now(),
                    p.kind.name(),
                    p.target.name()
                ));
            }
        } else if let Err(e) = w.end(&p).await {
            notes.push(format!("healing {}: {e}", p.target.name()));
        }
        let ended = !start || p.kind == Kind::Failover;
        if ended && p.target.is_store() {
            // A store fault lasts until the store has converged again (one
            // master, its replica linked; a sentinel takes up to ten seconds
            // to turn a returning old master into a replica, and writes it
            // takes meanwhile are lost): that is the window in which a
            // record can be lost.
            let (probe, rec) = (w.store.probe(), rec.clone());
            converging.push(tokio::spawn(async move {
                probe.converged().await;
                rec.record(fault(&rec, &p, FaultPhase::End));
            }));
        } else if ended {
            rec.record(fault(&rec, &p, FaultPhase::End));
        }
    }
    (notes, converging)
}

fn fault(rec: &Recorder, p: &Planned, phase: FaultPhase) -> Event {
    Event::Fault {
        t: rec.now(),
        id: p.id,
        kind: p.kind.name().into(),
        target: p.target.name(),
        phase,
    }
}
