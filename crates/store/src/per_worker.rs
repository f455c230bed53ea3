//! Values kept one per worker thread (a store connection, a pool, deadline
//! timers), so that a request's round trips stay on its own thread. The
//! proxy's workers set each thread's slot as they start (`set_slot`).

use std::cell::Cell;

thread_local! {
    static SLOT: Cell<usize> = const { Cell::new(0) };
}

/// Sets this thread's slot: a worker's number (1..=N) on a worker thread.
pub fn set_slot(slot: usize) {
    SLOT.with(|s| s.set(slot));
}

/// This thread's place among the per-worker things: its worker's number,
/// or 0 on a thread that is not a worker.
pub fn slot() -> usize {
    SLOT.with(Cell::get)
}

/// One value per slot: index 0 for the threads that are not workers, then
/// one per worker. Read through [`PerWorker::get`], which picks the calling
/// thread's; a slot beyond the values (one value: work stealing) reads the first.
pub struct PerWorker<T>(Box<[T]>);

impl<T> PerWorker<T> {
    /// `slots` values, made by `make(slot)`; at least one.
    pub fn new(slots: usize, make: impl FnMut(usize) -> T) -> Self {
        PerWorker((0..slots.max(1)).map(make).collect())
    }

    /// The calling thread's value.
    pub fn get(&self) -> &T {
        self.0.get(slot()).unwrap_or(&self.0[0])
    }

    /// Every value, slot 0 first.
    pub fn all(&self) -> &[T] {
        &self.0
    }
}
