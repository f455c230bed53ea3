//! Deadlines of one fixed length for many operations at once, kept by one
//! timer: a store operation's `op_timeout`, an upstream exchange's `timeout`.
//!
//! `tokio::time::timeout` puts an entry in the runtime's timer wheel for every
//! operation that has to wait, and takes it out again when the operation ends:
//! about 1.4k instructions each (`bench/callgrind.py`), and a new key waited
//! on three (its reserve, its upstream exchange, its completion). Here every
//! operation of one [`Deadlines`] waits at most the same length of time, so
//! only the earliest deadline among those waiting needs a timer. One task
//! sleeps until it, wakes the operations whose time is up and sleeps until the
//! next earliest; it runs only while operations wait, and once a deadline has
//! come. An operation that ends in time (almost all) takes its entry out with
//! one lock, and sets no timer at all.
//!
//! The bound is the same as `tokio::time::timeout`'s: an operation is cut off
//! once `after` has passed since its `start`, never before; it is woken by the
//! task when its deadline comes (to the timer's millisecond).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// Deadlines `after` from each operation's start; clones share them.
#[derive(Clone)]
pub struct Deadlines {
    inner: Arc<Inner>,
}

struct Inner {
    after: Duration,
    queue: Mutex<Queue>,
    /// An entry came with a deadline before the one the task sleeps until.
    sooner: Notify,
}

#[derive(Default)]
struct Queue {
    /// The operations waiting, at stable places (`Ticket::at`); `None` is free.
    slots: Vec<Option<Entry>>,
    /// Free places in `slots`, reused before it grows: its length is the
    /// most operations that ever waited at once, not how many ever waited.
    free: Vec<usize>,
    /// A task keeps the deadlines (it ends when nothing waits).
    watched: bool,
    /// What that task sleeps until.
    armed: Option<Instant>,
}

struct Entry {
    due: Instant,
    /// `None` once the task has woken it.
    waker: Option<Waker>,
}

impl Deadlines {
    pub fn new(after: Duration) -> Self {
        Deadlines {
            inner: Arc::new(Inner {
                after,
                queue: Mutex::new(Queue::default()),
                sooner: Notify::new(),
            }),
        }
    }

    /// How long an operation may take.
    pub fn after(&self) -> Duration {
        self.inner.after
    }

    /// Runs `fut` until it ends, or until `after` has passed since `start`
    /// (`None`: cut off). `fut` is polled first: an answer that is there
    /// costs no entry.
    pub fn within<F: Future>(&self, start: Instant, fut: F) -> Within<'_, F> {
        Within {
            fut,
            deadlines: self,
            // Beyond what the clock can say: no deadline.
            due: start.checked_add(self.inner.after),
            ticket: None,
        }
    }

    /// Operations waiting now (for tests).
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.inner.lock().slots.iter().flatten().count()
    }

    /// Whether a task keeps the deadlines now (for tests).
    #[cfg(test)]
    fn watched(&self) -> bool {
        self.inner.lock().watched
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Deadlines {
    /// Enters a waiting operation; the task that keeps the deadlines is
    /// started when none runs, and told when this deadline comes first.
    fn enter(&self, due: Instant, waker: &Waker) -> Ticket<'_> {
        let entry = Entry {
            due,
            waker: Some(waker.clone()),
        };
        let mut q = self.inner.lock();
        let at = match q.free.pop() {
            Some(at) => {
                q.slots[at] = Some(entry);
                at
            }
            None => {
                q.slots.push(Some(entry));
                q.slots.len() - 1
            }
        };
        if !q.watched {
            q.watched = true;
            q.armed = None;
            drop(q);
            tokio::spawn(keep(self.inner.clone()));
        } else if q.armed.is_some_and(|armed| due < armed) {
            drop(q);
            self.inner.sooner.notify_one();
        }
        Ticket {
            inner: &self.inner,
            at,
        }
    }
}

pin_project_lite::pin_project! {
    /// An operation under a deadline ([`Deadlines::within`]). A future of
    /// its own rather than an `async fn`: that would hold `fut` twice (as
    /// its argument and pinned) and copy it from one to the other.
    pub struct Within<'a, F> {
        #[pin]
        fut: F,
        deadlines: &'a Deadlines,
        due: Option<Instant>,
        ticket: Option<Ticket<'a>>,
    }
}

impl<F: Future> Future for Within<'_, F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(out) = this.fut.poll(cx) {
            return Poll::Ready(Some(out));
        }
        let Some(due) = *this.due else {
            return Poll::Pending;
        };
        match this.ticket {
            None => *this.ticket = Some(this.deadlines.enter(due, cx.waker())),
            Some(t) => {
                if Instant::now() >= due {
                    return Poll::Ready(None);
                }
                t.rewake(cx.waker());
            }
        }
        Poll::Pending
    }
}

/// An operation's place among those waiting; given back when it ends.
struct Ticket<'a> {
    inner: &'a Inner,
    at: usize,
}

impl Ticket<'_> {
    /// Polled again and still waiting: the task to wake may have changed
    /// (or the deadline's task has woken it already: the poll it asked for
    /// comes, and sees the time).
    fn rewake(&self, waker: &Waker) {
        let mut q = self.inner.lock();
        if let Some(Some(entry)) = q.slots.get_mut(self.at) {
            if !entry.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
                entry.waker = Some(waker.clone());
            }
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let waker = {
            let mut q = self.inner.lock();
            let entry = q.slots.get_mut(self.at).and_then(Option::take);
            q.free.push(self.at);
            entry.and_then(|e| e.waker)
        };
        // Dropped outside the lock: a waker's drop may run task code.
        drop(waker);
    }
}

/// The task that keeps the deadlines: sleeps until the earliest, wakes those
/// whose time has come, and ends when nothing waits.
async fn keep(inner: Arc<Inner>) {
    // A runtime shutting down drops this task: the next operation starts another.
    let mut unwatch = Unwatch {
        inner: &inner,
        ended: false,
    };
    loop {
        let (due, woken) = {
            let mut q = inner.lock();
            let now = Instant::now();
            let mut next: Option<Instant> = None;
            let mut woken = Vec::new();
            for entry in q.slots.iter_mut().flatten() {
                if entry.due <= now {
                    woken.extend(entry.waker.take());
                } else if entry.waker.is_some() {
                    next = Some(next.map_or(entry.due, |n| n.min(entry.due)));
                }
            }
            q.armed = next;
            if next.is_none() {
                q.watched = false;
                unwatch.ended = true;
            }
            (next, woken)
        };
        for waker in woken {
            waker.wake();
        }
        let Some(due) = due else { return };
        tokio::select! {
            () = tokio::time::sleep_until(due) => {}
            () = inner.sooner.notified() => {}
        }
    }
}

/// Marks the deadlines unwatched when their task is dropped before it ended.
struct Unwatch<'a> {
    inner: &'a Inner,
    ended: bool,
}

impl Drop for Unwatch<'_> {
    fn drop(&mut self) {
        if !self.ended {
            let mut q = self.inner.lock();
            q.watched = false;
            q.armed = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AFTER: Duration = Duration::from_secs(2);

    /// `d.within(start, pending)`, with a backstop far beyond the deadline:
    /// a deadline that is never kept fails the test instead of hanging it.
    async fn cut_off(d: &Deadlines, start: Instant) -> Duration {
        let never = d.within(start, std::future::pending::<()>());
        let out = tokio::time::timeout(AFTER * 10, never).await;
        assert_eq!(out, Ok(None), "the deadline was not kept");
        start.elapsed()
    }

    /// Yields until `cond` holds (the deadlines' task runs on the same runtime).
    async fn until(cond: impl Fn() -> bool) {
        for _ in 0..1000 {
            if cond() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the condition never held");
    }

    #[tokio::test(start_paused = true)]
    async fn an_operation_that_never_ends_is_cut_off_after_its_length_and_not_before() {
        let d = Deadlines::new(AFTER);
        let took = cut_off(&d, Instant::now()).await;
        assert!(
            took >= AFTER && took < AFTER + Duration::from_millis(5),
            "{took:?}"
        );
        // Nothing waits any more, and the task has ended.
        until(|| !d.watched()).await;
        assert_eq!(d.waiting(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn an_operation_that_ends_in_time_keeps_its_answer_and_its_place_is_freed() {
        let d = Deadlines::new(AFTER);
        let start = Instant::now();
        let out = d
            .within(start, async {
                tokio::time::sleep(Duration::from_millis(500)).await;
                7
            })
            .await;
        assert_eq!(out, Some(7));
        assert_eq!(d.waiting(), 0);
        // A ready answer never takes a place.
        assert_eq!(d.within(Instant::now(), async { 8 }).await, Some(8));
        assert_eq!(d.inner.lock().slots.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn each_of_many_operations_is_cut_off_at_its_own_deadline() {
        let d = Deadlines::new(AFTER);
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..5u64 {
            // Started 300 ms apart; the odd ones end after 1 s, in time.
            tokio::time::sleep_until(t0 + Duration::from_millis(300 * i)).await;
            let d = d.clone();
            tasks.push(tokio::spawn(async move {
                let start = Instant::now();
                if i % 2 == 0 {
                    return (false, cut_off(&d, start).await);
                }
                let out = d
                    .within(start, tokio::time::sleep(Duration::from_secs(1)))
                    .await;
                (out.is_some(), start.elapsed())
            }));
        }
        for (i, task) in tasks.into_iter().enumerate() {
            let (ended, took) = task.await.unwrap();
            if i % 2 == 1 {
                assert!(ended, "operation {i}");
                assert_eq!(took, Duration::from_secs(1));
            } else {
                assert!(!ended, "operation {i}");
                assert!(
                    took >= AFTER && took < AFTER + Duration::from_millis(5),
                    "{i}: {took:?}"
                );
            }
        }
        assert_eq!(d.waiting(), 0);
        // The places were reused: never more than were waiting at once.
        assert!(d.inner.lock().slots.len() <= 5);
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_sooner_than_the_one_kept_is_kept_on_time() {
        let d = Deadlines::new(AFTER);
        let t0 = Instant::now();
        // The task sleeps until this one's deadline (t0 + 2 s)...
        let late = {
            let d = d.clone();
            tokio::spawn(async move { d.within(t0, std::future::pending::<()>()).await })
        };
        until(|| d.inner.lock().armed.is_some()).await;
        // ...when one whose start was earlier begins to wait.
        let early_start = t0 - Duration::from_millis(500);
        assert_eq!(cut_off(&d, early_start).await, AFTER);
        late.abort();
    }

    #[test]
    fn deadlines_outlive_a_runtime_that_ended_while_operations_waited() {
        let d = Deadlines::new(AFTER);
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        first.block_on(async {
            let d2 = d.clone();
            tokio::spawn(async move {
                d2.within(Instant::now(), std::future::pending::<()>())
                    .await
            });
            until(|| d.watched()).await;
        });
        // The runtime goes with its tasks: the operation and the keeper.
        drop(first);
        assert!(!d.watched());
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        let took = second.block_on(async { cut_off(&d, Instant::now()).await });
        assert_eq!(took, AFTER);
    }
}
