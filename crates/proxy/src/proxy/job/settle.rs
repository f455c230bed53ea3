//! A completion the store did not take before the client was answered,
//! retried in the background within the lease ([`Job::settle`]).

use std::time::Duration;

use bytes::Bytes;
use tracing::{error, info, warn};

use super::{Attempt, Job, Unsaved, FIRST_PAUSE};
use crate::metrics::Degraded;

/// The longest pause between background completion attempts.
const MAX_PAUSE: Duration = Duration::from_secs(1);
/// Attempts at most to store the whole record (the first, made before the
/// client is answered, included); with pauses doubling from 25 ms to 1 s,
/// about 20 s of a store that does not take it.
const WHOLE_TRIES: u32 = 24;
/// Attempts at most to store the small record that says the answer was not
/// kept, once the whole record could not be stored.
const NOT_KEPT_TRIES: u32 = 24;
/// How long, and how often, [`Job::retry`] sends a record again.
struct Retry {
    tries: u32,
    /// No attempt begins after this.
    until: tokio::time::Instant,
    /// Draining (SIGTERM) ends it too: the whole record's retries, which a
    /// small record can replace.
    yields_to_drain: bool,
    /// Before the first attempt (then doubling, 25 ms to 1 s).
    pause: Duration,
}

impl Job {
    /// Retries a completion, bounded in time and in tries
    /// (docs/reference/failures.md#completion): the whole
    /// record for at most [`WHOLE_TRIES`] attempts within the lease counted
    /// from the first (half of it when a small record can stand in for it),
    /// renewing the lease after each failure so that the key stays held. A
    /// large record that the store did not take by then — or when draining
    /// begins (SIGTERM) — is replaced by the small record that says the
    /// answer was not kept ([`NOT_KEPT_TRIES`] attempts, until the lease
    /// counted from the first runs out; the end of the shutdown grace leaves
    /// it one last attempt): once the upstream has answered, the key is not
    /// freed before its TTL unless the store takes nothing at all.
    pub(super) async fn complete_in_background(&self, u: Unsaved) {
        let app = &self.claim.app;
        let lease = self.policy.lease;
        let whole_until = match u.not_kept {
            Some(_) => u.since + lease / 2,
            None => u.since + lease,
        };
        let whole = Retry {
            tries: WHOLE_TRIES - 1,
            until: whole_until,
            yields_to_drain: u.not_kept.is_some(),
            pause: FIRST_PAUSE,
        };
        let (id, route) = (&self.request_id, &self.route_name);
        match (self.retry(&u.whole, u.last, whole).await, u.not_kept) {
            (Attempt::Settled, _) => {
                info!(request_id = %id, route = %route, "record stored after the store recovered");
            }
            (Attempt::Unreplicated, _) => {
                warn!(
                    request_id = %id,
                    route = %route,
                    "record stored, but not acknowledged by enough replicas before its retries ran out; a failover now could execute a retry again"
                );
            }
            (Attempt::Failed, Some(small)) => {
                // One attempt at least, however the whole record's retries ended.
                let until = (u.since + lease).max(tokio::time::Instant::now() + FIRST_PAUSE);
                let instead = Retry {
                    tries: NOT_KEPT_TRIES,
                    until,
                    yields_to_drain: false,
                    pause: Duration::ZERO,
                };
                match self.retry(&small, Attempt::Failed, instead).await {
                    Attempt::Failed => self.lost(),
                    _ => {
                        app.metrics.degraded(route, Degraded::NotKept);
                        warn!(
                            request_id = %id,
                            route = %route,
                            bytes = u.whole.len(),
                            "the answer could not be stored whole; stored without its body, so retries get 410 and never execute again"
                        );
                    }
                }
            }
            (Attempt::Failed, None) => self.lost(),
        }
    }

    /// Nothing could be stored: the lease frees the key.
    fn lost(&self) {
        self.claim
            .app
            .metrics
            .degraded(&self.route_name, Degraded::Lost);
        error!(
            request_id = %self.request_id,
            route = %self.route_name,
            "record could not be stored before the lease ran out; a retry with this key gets 502 outcome-unknown (or runs again under lease_expiry = re_execute or unknown_outcome = release)"
        );
    }

    /// Sends `record` again after `last` until it is settled, `how.tries`
    /// attempts are spent or `how.until` would pass; how the last went
    /// (`Unreplicated` when any attempt reached a master). After
    /// a failure the lease is renewed where it can be, unless a write has
    /// reached a master already (an unreplicated one): that master holds the
    /// finished record, which a renewal would take for a lost lease.
    async fn retry(&self, record: &Bytes, mut last: Attempt, how: Retry) -> Attempt {
        let app = &self.claim.app;
        let Retry {
            mut tries,
            until,
            yields_to_drain,
            mut pause,
        } = how;
        let mut written = last == Attempt::Unreplicated;
        while tries > 0 {
            let draining = app.draining.load(std::sync::atomic::Ordering::Acquire);
            if (yields_to_drain && draining) || tokio::time::Instant::now() + pause >= until {
                break;
            }
            // The end of the shutdown grace cuts the pause short: one last attempt.
            let cut = tokio::select! {
                () = tokio::time::sleep(pause) => false,
                () = app.hard_stop.cancelled() => true,
            };
            if cut && yields_to_drain {
                break;
            }
            tries -= 1;
            pause = (pause * 2).clamp(FIRST_PAUSE, MAX_PAUSE);
            last = self.try_complete(record.clone(), yields_to_drain).await;
            match last {
                Attempt::Settled => break,
                Attempt::Failed if !written => {
                    self.renew().await;
                }
                Attempt::Failed => {}
                Attempt::Unreplicated => written = true,
            }
            if cut {
                break;
            }
        }
        // A master took the record once: it is not to be replaced by less.
        if written && last == Attempt::Failed {
            return Attempt::Unreplicated;
        }
        last
    }
}
