//! Worker threads with a runtime each (`[server] runtime = "per_thread"`,
//! the default): a client connection is served from its first byte to its
//! last by one thread, and the requests on it use that thread's own store
//! connection, upstream pool and deadline timers. A request's tasks (the
//! connection, the forward-and-store job, the store connection's reader and
//! writer) then wake one another without crossing threads.
//!
//! Measured (`docs/dev/benchmarks-journal.md`, "A runtime per worker thread"): with two
//! workers on two CPUs, tokio's work-stealing runtime spent 8 % more CPU per
//! pass-through request, 21 % more per replay and 40 % more per new key than
//! one worker did: a task woken from another thread costs a futex call and
//! a context switch, and a new key woke three tasks that way.
//!
//! The listener is accepted from by one loop (on the thread that runs the
//! control plane: admin, health pings, signals, draining), which hands each
//! connection to the worker with the fewest open ones. That keeps a few
//! long-lived connections (a sidecar's usual client) spread over the
//! workers, which `SO_REUSEPORT`'s hashing does not, and costs one
//! hand-over per connection, not per request.
//!
//! Per-worker things are kept in a [`PerWorker`], indexed by the thread's
//! [`slot`]: 1..=N on the workers, 0 on every other thread (the control
//! plane, blocking tasks, a test's runtime; with `runtime =
//! "work_stealing"` there is only slot 0).

use std::future::Future;
use std::io;
use std::pin::Pin;

use prometheus_client::metrics::gauge::Gauge;
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use idemproxy_store::per_worker::set_slot;
pub use idemproxy_store::per_worker::PerWorker;

/// A connection's work, handed to a worker: first polled there, so that it
/// runs on that worker's thread from start to end.
pub(crate) type WorkerFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The worker threads, each with a current-thread runtime that runs the
/// jobs spawned onto it until [`Workers::stop`].
pub(crate) struct Workers {
    handles: Vec<Handle>,
    /// Connections each worker holds now (`idemproxy_worker_connections`).
    load: Vec<Gauge>,
    /// Told once draining is over: the runtimes may end, dropping what is left.
    finish: CancellationToken,
    ended: Vec<oneshot::Receiver<()>>,
}

impl Workers {
    /// Starts `n` worker threads (at least one); `load[i]` is worker `i + 1`'s
    /// connection gauge. The runtimes are built here, so that a failure is
    /// the caller's error, not a thread's panic.
    pub fn start(load: Vec<Gauge>) -> io::Result<Workers> {
        let finish = CancellationToken::new();
        let (mut handles, mut ended) = (Vec::new(), Vec::new());
        for worker in 1..=load.len().max(1) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (done, ended_rx) = oneshot::channel();
            handles.push(runtime.handle().clone());
            let finish = finish.clone();
            std::thread::Builder::new()
                .name(format!("idemproxy-worker-{worker}"))
                .spawn(move || {
                    set_slot(worker);
                    // Runs what is spawned onto it (from the accepting thread)
                    // until draining is over.
                    runtime.block_on(finish.cancelled());
                    drop(runtime);
                    let _ = done.send(());
                })?;
            ended.push(ended_rx);
        }
        Ok(Workers {
            handles,
            load,
            finish,
            ended,
        })
    }

    /// The worker with the fewest connections now (the first among equals).
    pub(crate) fn least_loaded(&self) -> usize {
        (0..self.handles.len())
            .min_by_key(|&i| self.load.get(i).map_or(0, Gauge::get))
            .unwrap_or(0)
    }

    /// The gauge of the connections worker `i` (from 0) holds.
    pub fn load(&self, i: usize) -> Option<&Gauge> {
        self.load.get(i)
    }

    /// Runs the job `make` makes on worker `i` (from 0). `make` runs here,
    /// in the worker's runtime context: what it registers (a socket, a
    /// timer) belongs to that runtime, and what it allocates, with the
    /// task, comes from this thread's heap. Long-lived small allocations
    /// made by the worker between the large short-lived ones of its
    /// requests would pin their pages once those are freed (measured: 2–3
    /// MiB more RSS with 1,000 parked connections). `false`: no job.
    pub fn run(&self, i: usize, make: impl FnOnce() -> Option<WorkerFuture>) -> bool {
        let Some(handle) = self.handles.get(i) else {
            return false;
        };
        let job = {
            let _context = handle.enter();
            make()
        };
        match job {
            Some(job) => {
                drop(handle.spawn(job));
                true
            }
            None => false,
        }
    }

    /// Ends the workers: their runtimes drop whatever still runs (call it once
    /// draining is over), and the threads are waited for.
    pub async fn stop(mut self) {
        self.finish.cancel();
        for ended in std::mem::take(&mut self.ended) {
            let _ = ended.await;
        }
    }
}

/// Workers never stopped (a server bound but never run) end all the same.
impl Drop for Workers {
    fn drop(&mut self) {
        self.finish.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_thread_that_is_no_worker_reads_slot_zero_and_one_value_serves_every_slot() {
        let values = PerWorker::new(3, |slot| slot * 10);
        assert_eq!(*values.get(), 0);
        assert_eq!(values.all(), &[0, 10, 20]);
        let one = PerWorker::new(0, |slot| slot + 7);
        assert_eq!(one.all(), &[7]);
        set_slot(2);
        assert_eq!(*values.get(), 20);
        assert_eq!(*one.get(), 7, "beyond the values: the first");
        set_slot(0);
    }

    #[tokio::test]
    async fn each_job_runs_on_its_worker_until_the_workers_stop() {
        let load: Vec<Gauge> = (0..2).map(|_| Gauge::default()).collect();
        let workers = Workers::start(load.clone()).unwrap();
        load[0].inc();
        assert_eq!(
            workers.least_loaded(),
            1,
            "the worker with fewer connections"
        );
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut ran = Vec::new();
        for worker in [0, 1, 1] {
            let (tx, rx) = oneshot::channel();
            let seen = seen.clone();
            let job: WorkerFuture = Box::pin(async move {
                let name = std::thread::current().name().map(str::to_string);
                seen.lock()
                    .unwrap()
                    .push((idemproxy_store::per_worker::slot(), name));
                let _ = tx.send(());
            });
            assert!(workers.run(worker, || Some(job)));
            ran.push(rx);
        }
        for rx in ran {
            rx.await.unwrap();
        }
        let mut seen = seen.lock().unwrap().clone();
        seen.sort();
        let names = |w: usize| Some(format!("idemproxy-worker-{w}"));
        assert_eq!(seen, [(1, names(1)), (2, names(2)), (2, names(2))]);
        // A job still running when the workers stop is dropped with its runtime.
        let (held, dropped) = oneshot::channel::<()>();
        let job: WorkerFuture = Box::pin(async move {
            let _held = held;
            std::future::pending::<()>().await;
        });
        assert!(workers.run(0, || Some(job)));
        assert!(!workers.run(1, || None), "no job made");
        assert!(!workers.run(2, || panic!("no such worker")));
        workers.stop().await;
        assert!(dropped.await.is_err(), "the pending job was dropped");
    }
}
