//! One campaign, start to finish: the processes, the load, the nemesis,
//! healing, the final phase, the checker and the outputs.

mod finish;
mod schedule;
mod start;
mod world;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::clients::{self, Book};
use crate::history::{self, Event};
use crate::nemesis::{self, Planned};
use crate::record::Recorder;
use crate::relay::Owners;
use crate::rng::Rng;
use crate::topology::{Kind as Topology, Store};
use start::Settings;
use world::World;

#[derive(clap::Args, Debug)]
pub(crate) struct Options {
    /// The store topology the proxies share.
    #[arg(long, value_enum, default_value = "sentinel")]
    topology: Topology,
    /// Seeds the fault schedule, the clients and the relays.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How long the nemesis and the clients run (then: heal, final phase, check).
    #[arg(long, default_value = "60s", value_parser = crate::parse_duration)]
    duration: Duration,
    /// Where the history, summary.json, timeline.svg and the processes' logs go.
    #[arg(long, default_value = "campaign-out")]
    out: PathBuf,
    /// A TOML file of route settings (`lease = "1s"`, `lease_expiry = "re_execute"`...)
    /// applied to the campaign's route.
    #[arg(long)]
    proxy_config_extra: Option<PathBuf>,
    /// Proxy replicas (2-3 is the campaign's design; 1-8 allowed).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=8))]
    proxies: u32,
    /// Concurrent clients.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=256))]
    clients: u32,
    /// The idemproxy binary (default: the one beside this one).
    #[arg(long)]
    idemproxy: Option<PathBuf>,
    /// Faults off: the same load with no nemesis (a baseline).
    #[arg(long, conflicts_with = "faults")]
    no_faults: bool,
    /// Only these kinds of fault (comma-separated: kill, pause, failover,
    /// delay, loss, stall, one_way, partition, cut, slow_upstream).
    #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(nemesis::KINDS))]
    faults: Vec<String>,
}

pub(crate) fn main(opts: Options) -> ExitCode {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    rt.spawn(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("a SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        crate::procs::kill_all();
        eprintln!("campaign: interrupted; every process it started is killed");
        std::process::exit(130);
    });
    match rt.block_on(campaign(opts)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("campaign: {e}");
            ExitCode::from(2)
        }
    }
}

async fn campaign(opts: Options) -> Result<ExitCode, String> {
    let settings = Settings::read(&opts)?;
    let out = opts.out.clone();
    let logs = start::prepare_out(&out)?;
    let work = tempfile::Builder::new()
        .prefix("campaign-")
        .tempdir()
        .map_err(|e| e.to_string())?;
    let rng = Rng::new(opts.seed);
    let owners = Arc::new(Owners::default());
    eprintln!(
        "campaign: {} seed {} for {:?}, out {}",
        opts.topology.name(),
        opts.seed,
        opts.duration,
        out.display()
    );

    // The upstream, behind its relay.
    let journal = logs.join("journal.jsonl");
    let upstream = start::upstream(&logs, &journal, &owners, &rng).await?;

    // The store's data and logs under DIR/store (PostgreSQL's data
    // directories in a temporary directory: they belong to its user).
    let store_dir = out.join("store");
    let _ = std::fs::remove_dir_all(&store_dir);
    std::fs::create_dir_all(&store_dir).map_err(|e| e.to_string())?;
    let store = Store::start(opts.topology, &store_dir, work.path(), &owners, &rng).await?;
    let store_toml = store.store_toml();

    let (proxies, proxy_addrs) =
        start::proxies(&opts, &settings, &logs, upstream.relay.addr, &store_toml).await?;
    let store_procs = store.proc_names();
    let store_nodes = store.nodes.len();
    let world = World {
        proxies,
        upstream: upstream.proc,
        upstream_port: upstream.port,
        upstream_relay: upstream.relay,
        store,
        owners,
    };
    world.note_pids();
    let world = Arc::new(Mutex::new(world));

    let settle_bound = Duration::from_secs(30) + settings.lease * 2;
    let rec = Arc::new(
        Recorder::create(&out.join("history.jsonl"), opts.seed).map_err(|e| e.to_string())?,
    );
    rec.record(Event::Run(start::run_line(&opts, &settings, settle_bound)));
    let plan = schedule::plan(
        &opts,
        &rng,
        settings.lease,
        &store_procs,
        store_nodes,
        &logs,
    )?;
    let notes = drive(&opts, world, &rec, &rng, plan, &proxy_addrs, settle_bound).await?;
    finish::join_journal(&journal, &rec, &out, &logs, notes)?;
    Ok(check_file(&out.join("history.jsonl"), Some(&out)))
}

/// The load and the nemesis for the run's duration; then every fault
/// healed, the final phase, and the store faults' ends. Returns the notes.
async fn drive(
    opts: &Options,
    world: Arc<Mutex<World>>,
    rec: &Arc<Recorder>,
    rng: &Rng,
    plan: Vec<Planned>,
    proxy_addrs: &[SocketAddr],
    settle_bound: Duration,
) -> Result<Vec<String>, String> {
    let book = Arc::new(Book::default());
    let until = Instant::now() + opts.duration;
    let mut tasks = Vec::new();
    for c in 0..opts.clients {
        tasks.push(tokio::spawn(clients::run(
            c,
            rng.fork(1_000 + u64::from(c)),
            proxy_addrs.to_vec(),
            rec.clone(),
            book.clone(),
            until,
        )));
    }
    let nemesis = tokio::spawn(schedule::run_nemesis(
        world.clone(),
        rec.clone(),
        plan,
        rng.fork(3),
    ));
    let (mut notes, converging) = nemesis.await.map_err(|e| e.to_string())?;
    for t in tasks {
        let _ = t.await;
    }
    // Heal whatever is left, then ask every key once more.
    world.lock().await.heal_all().await?;
    rec.record(Event::Healed { t: rec.now() });
    let healed = Instant::now();
    let settled = world.lock().await.store.settled(settle_bound).await;
    if let Err(e) = &settled {
        notes.push(format!("the store did not settle: {e}"));
    }
    finish::final_phase(rec, &book, proxy_addrs, healed, settle_bound, rng.fork(4)).await;
    for c in converging {
        let _ = c.await;
    }
    rec.record(Event::End { t: rec.now() });
    rec.flush();
    drop(world);
    Ok(notes)
}

/// Checks a history, prints the report, writes summary.json and
/// timeline.svg into `out`; the exit status says whether it held.
pub(crate) fn check_file(path: &Path, out: Option<&Path>) -> ExitCode {
    // A run's directory names its history.
    let in_dir = path.join("history.jsonl");
    let path = if path.is_dir() {
        in_dir.as_path()
    } else {
        path
    };
    let events = match history::read(path) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("campaign: {e}");
            return ExitCode::from(2);
        }
    };
    let seed = events
        .iter()
        .find_map(|e| match e {
            Event::Run(r) => Some(r.seed),
            _ => None,
        })
        .unwrap_or(0);
    let report = crate::check::check(&events);
    print!("{}", crate::check::render_text(&report, seed));
    if let Some(dir) = out {
        let summary = serde_json::to_string_pretty(&report).expect("a report");
        let written = std::fs::write(dir.join("summary.json"), summary)
            .and_then(|_| std::fs::write(dir.join("timeline.svg"), crate::timeline::svg(&events)));
        if let Err(e) = written {
            eprintln!("campaign: {}: {e}", dir.display());
            return ExitCode::from(2);
        }
        println!(
            "summary: {}\ntimeline: {}",
            dir.join("summary.json").display(),
            dir.join("timeline.svg").display()
        );
    }
    if report.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
