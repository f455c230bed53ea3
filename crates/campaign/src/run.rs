//! One campaign, start to finish: the processes, the load, the nemesis,
//! healing, the final phase, the checker and the outputs.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::clients::{self, Book, Op};
use crate::history::{self, AtRisk, Event, FaultPhase, Phase, Run};
use crate::nemesis::{self, Cast, Kind, Planned, Target};
use crate::procs::{free_port, Proc};
use crate::record::Recorder;
use crate::relay::{Effect, Owners, Relay};
use crate::rng::Rng;
use crate::topology::{Kind as Topology, Store};

#[derive(clap::Args, Debug)]
pub struct Options {
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

/// The route's settings: the campaign's defaults, then the user's file.
fn route_settings(extra: Option<&Path>) -> Result<toml::Table, String> {
    let mut table: toml::Table = toml::from_str("lease = \"2s\"\nttl = \"1h\"\n").unwrap();
    if let Some(path) = extra {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let more: toml::Table = toml::from_str(&text)
            .map_err(|e| format!("{}: not TOML route settings: {e}", path.display()))?;
        for (k, v) in more {
            if ["path", "name", "methods"].contains(&k.as_str()) {
                return Err(format!(
                    "{}: `{k}` is the campaign's own; give route settings only (lease, ttl, lease_expiry...)",
                    path.display()
                ));
            }
            table.insert(k, v);
        }
    }
    Ok(table)
}

fn proxy_config(
    i: u32,
    ports: (u16, u16),
    upstream: SocketAddr,
    store: &str,
    route: &toml::Table,
) -> String {
    let mut lines = String::new();
    for (k, v) in route {
        lines.push_str(&format!("{k} = {v}\n"));
    }
    format!(
        "# proxy-{i}, written by the campaign\n[server]\nlisten = \"127.0.0.1:{}\"\nadmin_listen = \"127.0.0.1:{}\"\n\
         upstream = \"http://{upstream}\"\nupstream_timeout = \"10s\"\nshutdown_grace = \"1s\"\n\n\
         [store]\n{store}\n[[routes]]\nname = \"pay\"\npath = \"/pay\"\nmethods = [\"POST\"]\n{lines}",
        ports.0, ports.1
    )
}

/// Everything the nemesis may touch.
struct World {
    proxies: Vec<Proc>,
    upstream: Proc,
    upstream_port: u16,
    upstream_relay: Relay,
    store: Store,
    owners: Arc<Owners>,
}

impl World {
    fn proc_of(&mut self, target: &Target) -> Option<&mut Proc> {
        match target {
            Target::Proxy(i) => self.proxies.get_mut(*i as usize),
            Target::Upstream => Some(&mut self.upstream),
            Target::StoreProc(n) => self.store.proc_mut(n),
            _ => None,
        }
    }

    fn note_pids(&self) {
        for (i, p) in self.proxies.iter().enumerate() {
            self.owners.set(i as u32, p.pid());
        }
    }

    async fn set_slow(&self, ms: u64) {
        let req = hyper::Request::put(format!(
            "http://127.0.0.1:{}/__slow/{ms}",
            self.upstream_port
        ))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
        let _ = tokio::time::timeout(Duration::from_secs(2), clients::http().request(req)).await;
    }

    fn effect(kind: &Kind) -> Option<Effect> {
        Some(match kind {
            Kind::Delay(ms) => Effect::Delay(*ms),
            Kind::Loss { chance, rto_ms } => Effect::Loss {
                chance: *chance,
                rto_ms: *rto_ms,
            },
            Kind::Stall => Effect::Hold {
                to_target: true,
                to_client: true,
                new: false,
            },
            Kind::OneWay(to_target) => Effect::Hold {
                to_target: *to_target,
                to_client: !*to_target,
                new: false,
            },
            Kind::Partition => Effect::Hold {
                to_target: true,
                to_client: true,
                new: true,
            },
            Kind::Cut => Effect::Refuse,
            _ => return None,
        })
    }

    /// Starts fault `p`; returns a note for the log.
    async fn start(&mut self, p: &Planned, rng: &mut Rng) -> String {
        match (&p.kind, &p.target) {
            (Kind::Kill, t) => {
                if let Some(proc) = self.proc_of(t) {
                    proc.kill();
                }
                self.note_pids();
                String::new()
            }
            (Kind::Pause, t) => {
                if let Some(proc) = self.proc_of(t) {
                    proc.pause();
                }
                String::new()
            }
            (Kind::Failover, _) => match self.store.failover(rng).await {
                Ok(s) => s,
                Err(e) => format!("failed: {e}"),
            },
            (Kind::SlowUpstream(ms), _) => {
                self.set_slow(*ms).await;
                format!("{ms} ms per execution")
            }
            (kind, Target::ToStore(i)) => {
                let e = Self::effect(kind).expect("a link fault");
                for r in &self.store.relays {
                    r.inject(p.id, Some(*i), e.clone());
                }
                format!("{e:?}")
            }
            (kind, Target::ToUpstream(i)) => {
                let e = Self::effect(kind).expect("a link fault");
                self.upstream_relay.inject(p.id, Some(*i), e.clone());
                format!("{e:?}")
            }
            (kind, Target::StoreNode(n)) => {
                let e = Self::effect(kind).expect("a link fault");
                self.store.relays[*n].inject(p.id, None, e.clone());
                format!("{e:?}")
            }
            (kind, target) => format!(
                "{} on {} is not a fault the campaign knows",
                kind.name(),
                target.name()
            ),
        }
    }

    /// Heals fault `p`.
    async fn end(&mut self, p: &Planned) -> Result<(), String> {
        match (&p.kind, &p.target) {
            (Kind::Kill | Kind::Pause, t) => {
                let name = t.name();
                if let Some(proc) = self.proc_of(t) {
                    proc.heal().map_err(|e| format!("{name}: {e}"))?;
                }
                self.note_pids();
            }
            (Kind::Failover, _) => {}
            (Kind::SlowUpstream(_), _) => self.set_slow(0).await,
            (kind, Target::ToStore(i)) => {
                for r in &self.store.relays {
                    r.heal(p.id);
                    if *kind == Kind::Partition && p.for_ms > 3_000 {
                        // After a long partition TCP has given up on its connections.
                        r.cut(Some(*i));
                    }
                }
            }
            (kind, Target::ToUpstream(i)) => {
                self.upstream_relay.heal(p.id);
                if *kind == Kind::Partition && p.for_ms > 3_000 {
                    self.upstream_relay.cut(Some(*i));
                }
            }
            (kind, Target::StoreNode(n)) => {
                self.store.relays[*n].heal(p.id);
                if *kind == Kind::Partition && p.for_ms > 3_000 {
                    self.store.relays[*n].cut(None);
                }
            }
            _ => {}
        }
        Ok(())
    }

    async fn heal_all(&mut self) -> Result<(), String> {
        for p in self
            .proxies
            .iter_mut()
            .chain(std::iter::once(&mut self.upstream))
        {
            p.heal().map_err(|e| format!("{}: {e}", p.name))?;
        }
        self.note_pids();
        self.upstream_relay.heal_all();
        self.store.heal()?;
        self.set_slow(0).await;
        Ok(())
    }
}

async fn wait_http(url: &str, within: Duration) -> Result<(), String> {
    let http = clients::http();
    let until = Instant::now() + within;
    loop {
        let req = hyper::Request::get(url)
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(1), http.request(req)).await {
            if r.status() == 200 {
                return Ok(());
            }
        }
        if Instant::now() > until {
            return Err(format!("{url} did not answer 200 within {within:?}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn idemproxy_binary(given: Option<&Path>) -> Result<PathBuf, String> {
    let path = match given {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe()
            .map_err(|e| e.to_string())?
            .with_file_name("idemproxy"),
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "no idemproxy binary at {} (build both: cargo build --release --workspace; or give --idemproxy)",
            path.display()
        ))
    }
}

pub fn main(opts: Options) -> ExitCode {
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
    let binary = idemproxy_binary(opts.idemproxy.as_deref())?;
    let route = route_settings(opts.proxy_config_extra.as_deref())?;
    let lease = match route.get("lease") {
        Some(toml::Value::String(text)) => crate::parse_duration(text)?,
        Some(other) => {
            return Err(format!(
                "lease = {other}: a duration is written as a string, e.g. lease = \"1s\""
            ))
        }
        None => Duration::from_secs(2),
    };
    if opts.duration < Duration::from_secs(5) {
        return Err(
            "--duration must be at least 5s (the clients and the nemesis need time to run)".into(),
        );
    }
    let lease_expiry = route
        .get("lease_expiry")
        .and_then(|v| v.as_str())
        .unwrap_or("unknown_outcome")
        .to_string();
    let out = opts.out.clone();
    // Only into a directory of its own: it replaces what an earlier run left there.
    let marker = out.join(".campaign-out");
    let used = std::fs::read_dir(&out).is_ok_and(|mut d| d.next().is_some());
    if used && !marker.exists() {
        return Err(format!(
            "--out {}: not empty and not a campaign's output; give a new directory",
            out.display()
        ));
    }
    std::fs::create_dir_all(out.join("logs")).map_err(|e| format!("{}: {e}", out.display()))?;
    std::fs::write(
        &marker,
        "written by campaign; a later run may replace this directory's contents\n",
    )
    .map_err(|e| format!("{}: {e}", marker.display()))?;
    let logs = std::fs::canonicalize(out.join("logs")).map_err(|e| e.to_string())?;
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
    let _ = std::fs::remove_file(&journal);
    let upstream_port = free_port();
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let j = journal.clone();
    let upstream = Proc::start(
        "upstream",
        logs.join("upstream.log"),
        Box::new(move || {
            let mut c = Command::new(&me);
            c.args([
                "upstream",
                "--port",
                &upstream_port.to_string(),
                "--journal",
            ])
            .arg(&j);
            c
        }),
    )
    .map_err(|e| format!("the upstream: {e}"))?;
    wait_http(
        &format!("http://127.0.0.1:{upstream_port}/healthz"),
        Duration::from_secs(20),
    )
    .await?;
    let upstream_relay = Relay::start(
        SocketAddr::from(([127, 0, 0, 1], upstream_port)),
        owners.clone(),
        rng.fork(1),
    )
    .await
    .map_err(|e| e.to_string())?;

    // The store's data and logs under DIR/store (PostgreSQL's data
    // directories in a temporary directory: they belong to its user).
    let store_dir = out.join("store");
    let _ = std::fs::remove_dir_all(&store_dir);
    std::fs::create_dir_all(&store_dir).map_err(|e| e.to_string())?;
    let store = Store::start(opts.topology, &store_dir, work.path(), &owners, &rng).await?;
    let store_toml = store.store_toml();

    let mut proxies = Vec::new();
    let mut proxy_addrs = Vec::new();
    let mut admins = Vec::new();
    for i in 0..opts.proxies {
        let ports = (free_port(), free_port());
        let config = logs.join(format!("proxy-{i}.toml"));
        std::fs::write(
            &config,
            proxy_config(i, ports, upstream_relay.addr, &store_toml, &route),
        )
        .map_err(|e| e.to_string())?;
        let bin = binary.clone();
        let p = Proc::start(
            &format!("proxy-{i}"),
            logs.join(format!("proxy-{i}.log")),
            Box::new(move || {
                let mut c = Command::new(&bin);
                c.arg("--config").arg(&config).env("RUST_LOG", "warn");
                c
            }),
        )
        .map_err(|e| format!("{}: {e}", binary.display()))?;
        proxies.push(p);
        proxy_addrs.push(SocketAddr::from(([127, 0, 0, 1], ports.0)));
        admins.push(ports.1);
    }
    for (i, a) in admins.iter().enumerate() {
        wait_http(
            &format!("http://127.0.0.1:{a}/readyz"),
            Duration::from_secs(60),
        )
        .await
        .map_err(|e| {
            format!(
                "proxy-{i} is not ready ({e}); its log: {}",
                logs.join(format!("proxy-{i}.log")).display()
            )
        })?;
    }
    let store_procs = store.proc_names();
    let store_nodes = store.nodes.len();
    let world = World {
        proxies,
        upstream,
        upstream_port,
        upstream_relay,
        store,
        owners,
    };
    world.note_pids();
    let world = Arc::new(Mutex::new(world));

    let settle_bound = Duration::from_secs(30) + lease * 2;
    let rec = Arc::new(
        Recorder::create(&out.join("history.jsonl"), opts.seed).map_err(|e| e.to_string())?,
    );
    rec.record(Event::Run(Run {
        topology: opts.topology.name().into(),
        seed: opts.seed,
        duration_ms: opts.duration.as_millis() as u64,
        proxies: opts.proxies,
        clients: opts.clients,
        lease_ms: lease.as_millis() as u64,
        lease_expiry: lease_expiry.clone(),
        wait_replicas: opts.topology.wait_replicas(),
        at_risk: if opts.topology.asynchronous() {
            AtRisk::StoreFailover
        } else {
            AtRisk::Never
        },
        settle_bound_ms: settle_bound.as_millis() as u64,
    }));

    // The schedule, drawn before anything runs.
    let mut plan_rng = rng.fork(2);
    let plan = if opts.no_faults {
        Vec::new()
    } else {
        nemesis::schedule(
            &mut plan_rng,
            &Cast {
                topology: opts.topology,
                proxies: opts.proxies,
                store_procs: &store_procs,
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

    let book = Arc::new(Book::default());
    let until = Instant::now() + opts.duration;
    let mut tasks = Vec::new();
    for c in 0..opts.clients {
        tasks.push(tokio::spawn(clients::run(
            c,
            rng.fork(1_000 + u64::from(c)),
            proxy_addrs.clone(),
            rec.clone(),
            book.clone(),
            until,
        )));
    }
    let nemesis = tokio::spawn(run_nemesis(world.clone(), rec.clone(), plan, rng.fork(3)));
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
    final_phase(&rec, &book, &proxy_addrs, healed, settle_bound, rng.fork(4)).await;
    for c in converging {
        let _ = c.await;
    }
    rec.record(Event::End { t: rec.now() });
    rec.flush();
    drop(world);

    // The upstream's journal joins the history.
    let mut execs = Vec::new();
    let (journaled, torn) = crate::upstream::read_journal(&journal)
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
    Ok(check_file(&out.join("history.jsonl"), Some(&out)))
}

/// Runs the schedule; returns its notes and the store faults still
/// converging (each records its end when the store has).
async fn run_nemesis(
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

/// Every key once more, each retried until it settles or `bound` after
/// `from` or after it was first asked, whichever is later: every key is
/// asked, however many there are.
async fn final_phase(
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

/// Checks a history, prints the report, writes summary.json and
/// timeline.svg into `out`; the exit status says whether it held.
pub fn check_file(path: &Path, out: Option<&Path>) -> ExitCode {
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
