//! The nemesis: a schedule of faults drawn from the seed (the same seed,
//! the same schedule), then applied while the clients run.
//!
//! Kinds and what they hit:
//! - `kill` (SIGKILL, started again when it heals) and `pause`
//!   (SIGSTOP, then SIGCONT) of a proxy replica, the upstream, a store
//!   node or a sentinel;
//! - `failover` of the store;
//! - on the link from one proxy to the store (every store node) or to the
//!   upstream: `delay`, `loss`, `stall` (nothing either way), `one_way`
//!   (nothing one way), `partition` (nothing either way, new connections
//!   hang) and `cut` (every connection reset, new ones too);
//! - `partition` of one store node from everything (its replica link and
//!   the sentinels too);
//! - `slow_upstream`: every execution takes longer than the lease.
//!
//! At most three faults at once, one at a time per target; on PostgreSQL
//! the store's own faults do not overlap (a failover rebuilds a node).

use crate::rng::Rng;
use crate::topology::Kind as Topology;

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Target {
    Proxy(u32),
    Upstream,
    /// A store process by name (`store-0`, `sentinel-1`).
    StoreProc(String),
    /// The whole store (a failover).
    Store,
    /// The link from proxy N to every store node.
    ToStore(u32),
    /// The link from proxy N to the upstream.
    ToUpstream(u32),
    /// Store node N, from everything.
    StoreNode(usize),
}

impl Target {
    pub(crate) fn name(&self) -> String {
        match self {
            Target::Proxy(i) => format!("proxy-{i}"),
            Target::Upstream => "upstream".into(),
            Target::StoreProc(n) => n.clone(),
            Target::Store => "store".into(),
            Target::ToStore(i) => format!("proxy-{i}->store"),
            Target::ToUpstream(i) => format!("proxy-{i}->upstream"),
            Target::StoreNode(n) => format!("store-{n}"),
        }
    }

    /// The store's own processes and the store as a whole (not a proxy's link to it).
    pub(crate) fn is_store(&self) -> bool {
        matches!(self, Target::StoreProc(n) if n.starts_with("store"))
            || matches!(self, Target::Store | Target::StoreNode(_))
    }
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Kind {
    Kill,
    Pause,
    Failover,
    Delay(u64),
    Loss {
        chance: f64,
        rto_ms: u64,
    },
    Stall,
    /// Bytes toward the target (true) or back from it (false) held.
    OneWay(bool),
    Partition,
    Cut,
    /// Each execution this many ms longer.
    SlowUpstream(u64),
}

impl Kind {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Kind::Kill => "kill",
            Kind::Pause => "pause",
            Kind::Failover => "failover",
            Kind::Delay(_) => "delay",
            Kind::Loss { .. } => "loss",
            Kind::Stall => "stall",
            Kind::OneWay(_) => "one_way",
            Kind::Partition => "partition",
            Kind::Cut => "cut",
            Kind::SlowUpstream(_) => "slow_upstream",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Planned {
    pub id: u32,
    pub at_ms: u64,
    pub for_ms: u64,
    pub kind: Kind,
    pub target: Target,
}

/// What the schedule may hit.
pub(crate) struct Cast<'a> {
    pub topology: Topology,
    pub proxies: u32,
    pub store_procs: &'a [String],
    pub store_nodes: usize,
    pub lease_ms: u64,
    /// The kinds drawn (`kill`, `pause`...); empty: every kind.
    pub kinds: &'a [String],
}

/// Every kind's name, for `--faults`.
pub(crate) const KINDS: [&str; 10] = [
    "kill",
    "pause",
    "failover",
    "delay",
    "loss",
    "stall",
    "one_way",
    "partition",
    "cut",
    "slow_upstream",
];

/// The faults of a run of `duration_ms`, in order of start; the first
/// starts after a quiet second, the last heals a second before the end.
pub(crate) fn schedule(rng: &mut Rng, cast: &Cast, duration_ms: u64) -> Vec<Planned> {
    let mut out: Vec<Planned> = Vec::new();
    let mut t = 1_000u64;
    let end = duration_ms.saturating_sub(1_000);
    let mut id = 0;
    while t < end {
        t += rng.range(300, 3_000);
        let Some((kind, target)) = (0..1_000)
            .map(|_| draw(rng, cast))
            .find(|(k, _)| cast.kinds.is_empty() || cast.kinds.iter().any(|n| n == k.name()))
        else {
            break;
        };
        let for_ms = match kind {
            Kind::Failover => 1,
            Kind::Kill | Kind::Pause => rng.range(200, 6_000),
            Kind::SlowUpstream(_) => rng.range(cast.lease_ms, cast.lease_ms * 4),
            _ => rng.range(200, 8_000),
        };
        if t + for_ms > end {
            continue;
        }
        let active: Vec<&Planned> = out
            .iter()
            .filter(|p| {
                p.at_ms <= t
                    && t < p.at_ms + p.for_ms.max(10_000 * u64::from(p.kind == Kind::Failover))
            })
            .collect();
        // By name: a kill of `store-0` and a partition of store node 0 hit one target.
        let busy_target = active.iter().any(|p| p.target.name() == target.name());
        let pg_store_busy = cast.topology == Topology::Postgres
            && target.is_store()
            && active.iter().any(|p| p.target.is_store());
        if active.len() >= 3 || busy_target || pg_store_busy {
            continue;
        }
        out.push(Planned {
            id,
            at_ms: t,
            for_ms,
            kind,
            target,
        });
        id += 1;
    }
    out
}

fn draw(rng: &mut Rng, cast: &Cast) -> (Kind, Target) {
    let proxy = rng.range(0, u64::from(cast.proxies) - 1) as u32;
    let link = |rng: &mut Rng| match rng.range(0, 5) {
        0 => Kind::Delay(rng.range(20, 800)),
        1 => Kind::Loss {
            chance: rng.range(5, 40) as f64 / 100.0,
            rto_ms: rng.range(200, 1_000),
        },
        2 => Kind::Stall,
        3 => Kind::OneWay(rng.chance(0.5)),
        4 => Kind::Partition,
        _ => Kind::Cut,
    };
    match rng.range(0, 99) {
        0..=11 => (Kind::Kill, Target::Proxy(proxy)),
        12..=19 => (Kind::Pause, Target::Proxy(proxy)),
        20..=23 => (Kind::Kill, Target::Upstream),
        24..=26 => (Kind::Pause, Target::Upstream),
        27..=36 => {
            let p = rng.pick(cast.store_procs).clone();
            (Kind::Kill, Target::StoreProc(p))
        }
        37..=42 => {
            let p = rng.pick(cast.store_procs).clone();
            (Kind::Pause, Target::StoreProc(p))
        }
        43..=50 => (Kind::Failover, Target::Store),
        51..=70 => (link(rng), Target::ToStore(proxy)),
        71..=86 => (link(rng), Target::ToUpstream(proxy)),
        87..=93 => {
            let n = rng.range(0, cast.store_nodes as u64 - 1) as usize;
            (Kind::Partition, Target::StoreNode(n))
        }
        _ => (
            Kind::SlowUpstream(cast.lease_ms + rng.range(cast.lease_ms / 5, cast.lease_ms * 2)),
            Target::Upstream,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cast(procs: &[String]) -> Cast<'_> {
        Cast {
            topology: Topology::Postgres,
            proxies: 3,
            store_procs: procs,
            store_nodes: 2,
            lease_ms: 1_000,
            kinds: &[],
        }
    }

    #[test]
    fn only_the_kinds_asked_for_are_drawn() {
        let procs = vec!["store-0".to_string(), "store-1".to_string()];
        let kinds = vec!["kill".to_string()];
        let c = Cast {
            kinds: &kinds,
            ..cast(&procs)
        };
        let plan = schedule(&mut Rng::new(9), &c, 60_000);
        assert!(!plan.is_empty());
        assert!(plan.iter().all(|p| p.kind == Kind::Kill), "{plan:?}");
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule_within_the_run() {
        let procs = vec!["store-0".to_string(), "store-1".to_string()];
        let a = schedule(&mut Rng::new(42), &cast(&procs), 60_000);
        let b = schedule(&mut Rng::new(42), &cast(&procs), 60_000);
        let c = schedule(&mut Rng::new(43), &cast(&procs), 60_000);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.len() > 10, "{a:?}");
        for p in &a {
            assert!(p.at_ms >= 1_000 && p.at_ms + p.for_ms <= 59_000, "{p:?}");
        }
        // Never two faults on one target at once, never more than three.
        for p in &a {
            let at_once: Vec<&Planned> = a
                .iter()
                .filter(|q| q.at_ms <= p.at_ms && p.at_ms < q.at_ms + q.for_ms)
                .collect();
            assert!(at_once.len() <= 3, "{at_once:?}");
            assert_eq!(at_once.iter().filter(|q| q.target == p.target).count(), 1);
        }
    }
}
