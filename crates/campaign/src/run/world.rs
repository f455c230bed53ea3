//! The world the nemesis acts on: the proxies, the upstream and its relay,
//! the store; how a planned fault starts and ends on it, and healing all.

use std::sync::Arc;
use std::time::Duration;

use crate::clients;
use crate::nemesis::{Kind, Planned, Target};
use crate::procs::Proc;
use crate::relay::{Effect, Owners, Relay};
use crate::rng::Rng;
use crate::topology::Store;

/// Everything the nemesis may touch.
pub(super) struct World {
    pub(super) proxies: Vec<Proc>,
    pub(super) upstream: Proc,
    pub(super) upstream_port: u16,
    pub(super) upstream_relay: Relay,
    pub(super) store: Store,
    pub(super) owners: Arc<Owners>,
}

impl World {
    pub(super) fn proc_of(&mut self, target: &Target) -> Option<&mut Proc> {
        match target {
            Target::Proxy(i) => self.proxies.get_mut(*i as usize),
            Target::Upstream => Some(&mut self.upstream),
            Target::StoreProc(n) => self.store.proc_mut(n),
            _ => None,
        }
    }

    pub(super) fn note_pids(&self) {
        for (i, p) in self.proxies.iter().enumerate() {
            self.owners.set(i as u32, p.pid());
        }
    }

    pub(super) async fn set_slow(&self, ms: u64) {
        let req = hyper::Request::put(format!(
            "http://127.0.0.1:{}/__slow/{ms}",
            self.upstream_port
        ))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
        let _ = tokio::time::timeout(Duration::from_secs(2), clients::http().request(req)).await;
    }

    pub(super) fn effect(kind: &Kind) -> Option<Effect> {
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
    pub(super) async fn start(&mut self, p: &Planned, rng: &mut Rng) -> String {
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
    pub(super) async fn end(&mut self, p: &Planned) -> Result<(), String> {
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

    pub(super) async fn heal_all(&mut self) -> Result<(), String> {
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
