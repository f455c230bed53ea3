//! How long a route's upstream typically takes: what a 409's `Retry-After`
//! estimates from (when the first request will likely be done), rather than
//! the whole remaining lease, which clients obey to the second.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Until a route has measured an exchange: the shortest `Retry-After` there
/// is. An early retry costs one cheap 409; a late one costs the client's time.
pub(crate) const UNMEASURED: Duration = Duration::from_secs(1);

/// The shortest wait suggested. A first request that has run past the
/// typical duration may end any moment; its duplicates are still not
/// invited to poll faster than this (gRPC clients take the milliseconds).
pub(crate) const MIN_WAIT: Duration = Duration::from_millis(100);

/// A moving average of a route's successful exchanges the route stored
/// (sent → answer read), each new one weighing a quarter and first held
/// within half and twice the average: it follows a change within a few
/// requests, and no one answer moves it by more than a quarter of the way to
/// twice or half of itself (one client cannot steer every other client's
/// `Retry-After`). One atomic, in microseconds (0: none yet): no lock and no
/// allocation per request.
#[derive(Debug, Default)]
pub struct Typical(AtomicU64);

impl Typical {
    /// Counts one exchange that took `took`.
    pub(crate) fn observe(&self, took: Duration) {
        let sample = u64::try_from(took.as_micros()).unwrap_or(u64::MAX).max(1);
        // Racing observers: each update is applied to the value it read.
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                Some(match old {
                    0 => sample,
                    old => {
                        let sample = sample.clamp((old / 2).max(1), old.saturating_mul(2));
                        (old - old / 4).saturating_add(sample / 4)
                    }
                })
            });
    }

    /// The typical duration, or [`UNMEASURED`] before the first exchange.
    pub fn get(&self) -> Duration {
        match self.0.load(Ordering::Relaxed) {
            0 => UNMEASURED,
            us => Duration::from_micros(us),
        }
    }

    /// How long until a first request that has run for `ran` is likely done:
    /// the typical duration less `ran`, at least [`MIN_WAIT`].
    pub fn remaining(&self, ran: Duration) -> Duration {
        self.get().saturating_sub(ran).max(MIN_WAIT)
    }

    /// A 409's wait: [`Typical::remaining`], at most `lease_left`, and the
    /// floor last: a lease about to end (or a PTTL of 0) must not tell a gRPC
    /// client to retry at once (a pushback of 0 ms).
    pub fn retry_after(&self, ran: Duration, lease_left: Duration) -> Duration {
        self.remaining(ran).min(lease_left).max(MIN_WAIT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn unmeasured_it_suggests_a_second() {
        let t = Typical::default();
        assert_eq!(t.get(), UNMEASURED);
        assert_eq!(t.remaining(MS(0)), UNMEASURED);
    }

    #[test]
    fn the_first_exchange_is_the_estimate_and_later_ones_move_it_by_a_quarter() {
        let t = Typical::default();
        t.observe(MS(1500));
        assert_eq!(t.get(), MS(1500));
        t.observe(MS(1000));
        assert_eq!(t.get(), MS(1375));
        for _ in 0..30 {
            t.observe(MS(200));
        }
        assert!(
            t.get() < MS(210),
            "follows a faster upstream: {:?}",
            t.get()
        );
    }

    #[test]
    fn what_remains_is_the_typical_duration_less_what_ran_with_a_floor() {
        let t = Typical::default();
        t.observe(MS(1500));
        assert_eq!(t.remaining(MS(200)), MS(1300));
        assert_eq!(t.remaining(MS(1450)), MIN_WAIT);
        assert_eq!(t.remaining(Duration::from_secs(60)), MIN_WAIT);
    }

    #[test]
    fn the_wait_is_within_the_lease_and_never_below_the_floor() {
        let t = Typical::default();
        t.observe(MS(5000));
        assert_eq!(t.retry_after(MS(1000), Duration::from_secs(30)), MS(4000));
        assert_eq!(t.retry_after(MS(1000), MS(2500)), MS(2500));
        assert_eq!(t.retry_after(MS(1000), Duration::ZERO), MIN_WAIT);
        assert_eq!(t.retry_after(MS(1000), MS(30)), MIN_WAIT);
    }

    #[test]
    fn one_sample_moves_the_estimate_by_at_most_a_factor_of_two() {
        let t = Typical::default();
        t.observe(MS(6000));
        t.observe(Duration::ZERO);
        assert!(t.get() >= MS(3000), "{:?}", t.get());
        t.observe(Duration::from_secs(3600));
        assert!(t.get() <= MS(2 * 6000), "{:?}", t.get());
        // Many fast answers still bring it down, a step at a time.
        let t = Typical::default();
        t.observe(MS(6000));
        let mut last = t.get();
        for _ in 0..40 {
            t.observe(MS(1));
            assert!(t.get() * 2 >= last, "{:?} after {last:?}", t.get());
            last = t.get();
        }
        assert!(t.get() < MS(100));
    }

    #[test]
    fn extreme_samples_do_not_overflow() {
        let t = Typical::default();
        t.observe(Duration::MAX);
        t.observe(Duration::MAX);
        t.observe(Duration::ZERO);
        assert!(t.get() > Duration::from_secs(1 << 40));
    }
}
