//! Timing, timeouts and metrics around each operation, and retries.

use std::pin::Pin;
use std::time::Duration;

use crate::{Inner, Store, StoreError};

/// Where the store reports each operation's time and outcome (the proxy's
/// Prometheus metrics).
pub trait StoreMetrics: Send + Sync {
    /// One operation `op` took `took`; `ok` unless the store failed it.
    fn store_op(&self, op: &'static str, took: Duration, ok: bool);
    /// A sweep of expired records failed (PostgreSQL).
    fn store_sweep_failed(&self);
}

/// Runs `op` up to `attempts` times, doubling a pause of `first_pause` between
/// attempts (none after the last: a failure is reported at once).
pub async fn retry<T, F, Fut>(
    attempts: u32,
    first_pause: Duration,
    mut op: F,
) -> Result<T, StoreError>
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut pause = first_pause;
    let mut attempt = 1;
    loop {
        match op(attempt).await {
            Err(_) if attempt < attempts => {
                tokio::time::sleep(pause).await;
                pause *= 2;
                attempt += 1;
            }
            done => return done,
        }
    }
}

impl Store {
    /// An operation with its timeout, its metric and the reconnect count.
    /// The backend's future is boxed here, in a plain function: it is the
    /// large part (the client's command and connection futures), and the
    /// request's own future would otherwise carry it, and copy it whole.
    pub(crate) fn timed<'a, T: 'a, F>(
        &'a self,
        op: &'static str,
        fut: F,
    ) -> impl std::future::Future<Output = Result<T, StoreError>> + 'a
    where
        F: std::future::Future<Output = Result<T, StoreError>> + Send + 'a,
    {
        self.timed_from(None, op, fut)
    }

    /// [`Store::timed`], its time counted from `start` when the caller has
    /// read the clock already (`None`: from now).
    pub(crate) fn timed_from<'a, T: 'a, F>(
        &'a self,
        start: Option<tokio::time::Instant>,
        op: &'static str,
        fut: F,
    ) -> impl std::future::Future<Output = Result<T, StoreError>> + 'a
    where
        F: std::future::Future<Output = Result<T, StoreError>> + Send + 'a,
    {
        let fut: Pin<Box<dyn std::future::Future<Output = Result<T, StoreError>> + Send + 'a>> =
            Box::pin(fut);
        self.timed_boxed(start, op, fut, Some(Duration::ZERO))
    }

    /// How much longer than `op_timeout` a reservation may take: a Redis
    /// store with `wait_replicas` sends `WAIT`, which the server holds for up
    /// to `wait_timeout` (cut at `op_timeout`, a `wait_timeout` as long would
    /// refuse every reservation the replicas are that slow to acknowledge).
    pub(crate) fn reserve_allowance(&self) -> Duration {
        match &self.inner {
            Inner::Redis(r) if r.wait_replicas > 0 => r.wait_timeout,
            _ => Duration::ZERO,
        }
    }

    /// An operation of several round trips, each bounded by `op_timeout` in
    /// the backend (a large record's pieces, `WAIT`): its metric and the
    /// reconnect count, no bound on the whole.
    pub(crate) fn in_steps<'a, T: 'a, F>(
        &'a self,
        op: &'static str,
        fut: F,
    ) -> impl std::future::Future<Output = Result<T, StoreError>> + 'a
    where
        F: std::future::Future<Output = Result<T, StoreError>> + Send + 'a,
    {
        let fut: Pin<Box<dyn std::future::Future<Output = Result<T, StoreError>> + Send + 'a>> =
            Box::pin(fut);
        self.timed_boxed(None, op, fut, None)
    }

    pub(crate) async fn timed_boxed<T>(
        &self,
        start: Option<tokio::time::Instant>,
        op: &'static str,
        fut: Pin<Box<dyn std::future::Future<Output = Result<T, StoreError>> + Send + '_>>,
        // `op_timeout` and this much more; `None`: no bound on the whole.
        bound: Option<Duration>,
    ) -> Result<T, StoreError> {
        let start = start.unwrap_or_else(tokio::time::Instant::now);
        let res = match bound {
            Some(extra) if extra.is_zero() => {
                let deadlines = self.deadlines.get();
                let timeout = deadlines.after();
                match deadlines.within(start, fut).await {
                    Some(r) => r,
                    None => Err(StoreError::Timeout(timeout)),
                }
            }
            Some(extra) => {
                let timeout = self.deadlines.get().after() + extra;
                match tokio::time::timeout_at(start + timeout, fut).await {
                    Ok(r) => r,
                    Err(_) => Err(StoreError::Timeout(timeout)),
                }
            }
            None => fut.await,
        };
        // A decode error is an answer from a live store.
        let store_ok = !matches!(
            res,
            Err(StoreError::Timeout(_)
                | StoreError::Backend(_)
                | StoreError::Unavailable(_)
                | StoreError::Untrue(_))
        );
        if let Inner::Redis(r) = &self.inner {
            r.note_result(matches!(
                res,
                Err(StoreError::Timeout(_) | StoreError::Unavailable(_))
            ));
        }
        self.metrics.store_op(op, start.elapsed(), store_ok);
        res
    }
}
