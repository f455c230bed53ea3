//! What the injector may hold at once, in bytes: the review bodies being
//! read ([`read_body`]) and the answers being sent, each in a [`Budget`] of
//! its own.
//!
//! A budget has two tiers, so that large holdings cannot take it all: a
//! holding that may grow past [`Budget::small`] bytes (a body that declares
//! more, or none; room for a large answer) is large, and all the large ones
//! together hold at most the budget's large part; what is left over is kept
//! for the small ones (an ordinary Pod's review and answer are a few KiB).
//! A holder waits for room until a deadline of its own.

use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use http_body::Body;
use http_body_util::BodyExt;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Bytes that may be held at once, shared by every review.
pub(super) struct Budget {
    used: Mutex<Used>,
    /// Woken whenever bytes are given back.
    freed: Notify,
    size: usize,
    /// What the large holdings may take of `size`, together.
    large: usize,
    /// The most a small holding holds.
    small: usize,
}

#[derive(Default)]
struct Used {
    all: usize,
    large: usize,
}

/// Bytes of a [`Budget`], held until dropped.
pub(super) struct HeldBytes {
    budget: Arc<Budget>,
    bytes: usize,
    large: bool,
}

impl HeldBytes {
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for HeldBytes {
    fn drop(&mut self) {
        let budget = Arc::clone(&self.budget);
        budget.set(self, 0);
    }
}

impl Budget {
    /// `size` bytes in all, of which the holdings over `small` bytes may take `large` together.
    pub(super) fn new(size: usize, large: usize, small: usize) -> Arc<Budget> {
        assert!(large <= size && small <= size);
        Arc::new(Budget {
            used: Mutex::new(Used::default()),
            freed: Notify::new(),
            size,
            large,
            small,
        })
    }

    /// Nothing yet, for a holding that may grow to `most` bytes (large if over `small`).
    pub(super) fn hold(self: &Arc<Self>, most: usize) -> HeldBytes {
        HeldBytes {
            budget: self.clone(),
            bytes: 0,
            large: most > self.small,
        }
    }

    /// Makes `held` `bytes` if there is room now (or it is shrinking); false if not.
    fn set(&self, held: &mut HeldBytes, bytes: usize) -> bool {
        // A small holding that grows past `small` is large from then on.
        let large = held.large || bytes > self.small;
        let in_large = |large: bool, n: usize| if large { n } else { 0 };
        let mut used = self.used.lock().unwrap_or_else(PoisonError::into_inner);
        let all_after = used.all - held.bytes + bytes;
        let large_after = used.large - in_large(held.large, held.bytes) + in_large(large, bytes);
        if bytes > held.bytes && (all_after > self.size || large_after > self.large) {
            return false;
        }
        let shrinking = bytes < held.bytes;
        (used.all, used.large) = (all_after, large_after);
        (held.bytes, held.large) = (bytes, large);
        drop(used);
        if shrinking {
            self.freed.notify_waiters();
        }
        true
    }

    /// Makes `held` `bytes` in all, waiting for room until `until`; false
    /// (and `held` as it was) if there was none by then.
    pub(super) async fn grow(&self, held: &mut HeldBytes, bytes: usize, until: Instant) -> bool {
        loop {
            // Registered before the check, so that a release in between wakes it.
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if self.set(held, bytes) {
                return true;
            }
            if tokio::time::timeout_at(until, freed).await.is_err() {
                return false;
            }
        }
    }

    /// Gives back what `held` has beyond `bytes`.
    pub(super) fn shrink(&self, held: &mut HeldBytes, bytes: usize) {
        if bytes < held.bytes {
            self.set(held, bytes);
        }
    }
}

/// A review's body, read whole, and the bytes of the body budget it holds until dropped.
pub(super) struct ReviewBody {
    pub(super) bytes: Vec<u8>,
    _held: HeldBytes,
}

/// Why a body was not read.
#[derive(Debug)]
pub(super) enum BodyError {
    /// Over the limit, declared or sent (413).
    TooLarge,
    /// Not whole by its deadline (408).
    Late,
    /// No room in the budget in time (503).
    Busy,
    /// The client broke it off, or sent something other than it declared (400).
    Broken(String),
}

/// The body's buffer grows from this, doubling as the bytes come.
const FIRST_ROOM: usize = 8 << 10;

/// Reads `body` (at most `limit` bytes, `declared` by its Content-Length if
/// it has one) whole by `until`. Room for all of it (what it declares, else
/// `limit`) is taken from `budget` before any of it is read, waiting at most
/// `wait`, holding nothing meanwhile but what its stream's flow-control
/// window lets the client send: counted as the bytes came instead, bodies
/// each holding part of the budget while waiting for the rest could keep
/// each other from ever completing. A body is small for the budget if it
/// declares so.
pub(super) async fn read_body<B>(
    mut body: B,
    declared: Option<u64>,
    limit: usize,
    budget: &Arc<Budget>,
    wait: std::time::Duration,
    until: Instant,
) -> Result<ReviewBody, BodyError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let limit = match declared {
        Some(n) if n > limit as u64 => return Err(BodyError::TooLarge),
        Some(n) => n as usize,
        None => limit,
    };
    let mut held = budget.hold(limit);
    if !budget
        .grow(&mut held, limit, until.min(Instant::now() + wait))
        .await
    {
        return Err(if Instant::now() >= until {
            BodyError::Late
        } else {
            BodyError::Busy
        });
    }
    let mut bytes = Vec::new();
    loop {
        let frame = match tokio::time::timeout_at(until, body.frame()).await {
            Err(_) => return Err(BodyError::Late),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(BodyError::Broken(e.to_string())),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue; // trailers
        };
        let needed = bytes.len() + data.len();
        if needed > limit {
            return Err(BodyError::TooLarge);
        }
        if needed > bytes.capacity() {
            let room = (bytes.capacity() * 2)
                .max(FIRST_ROOM)
                .min(limit)
                .max(needed);
            bytes.reserve_exact(room - bytes.len());
        }
        bytes.extend_from_slice(&data);
    }
    budget.shrink(&mut held, bytes.capacity());
    Ok(ReviewBody { bytes, _held: held })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use http_body::Frame;
    use http_body_util::{Full, StreamBody};

    #[tokio::test(start_paused = true)]
    async fn large_holdings_leave_the_reserve_to_small_ones() {
        let budget = Budget::new(100, 60, 10);
        let now = Instant::now();
        let (mut large, mut second) = (budget.hold(50), budget.hold(50));
        assert!(budget.grow(&mut large, 40, now).await);
        assert!(
            !budget.grow(&mut second, 30, now).await,
            "past the large part"
        );
        assert_eq!(second.bytes(), 0);
        assert!(budget.grow(&mut second, 20, now).await);
        // The other 40 are for small holdings only.
        let mut smalls: Vec<HeldBytes> = (0..4).map(|_| budget.hold(10)).collect();
        for small in &mut smalls {
            assert!(budget.grow(small, 10, now).await);
        }
        let mut late = budget.hold(10);
        assert!(!budget.grow(&mut late, 1, now).await, "full");
        // A small holding that grows past `small` is large: no room there.
        assert!(!budget.grow(&mut smalls[0], 11, now).await);
        // Waiting: woken when room is given back.
        let waiter = {
            let budget = budget.clone();
            tokio::spawn(async move {
                let mut late = budget.hold(10);
                let until = Instant::now() + Duration::from_secs(1);
                let ok = budget.grow(&mut late, 10, until).await;
                (ok, late.bytes())
            })
        };
        tokio::task::yield_now().await;
        budget.shrink(&mut large, 30);
        assert_eq!(waiter.await.unwrap(), (true, 10));
        drop((large, second, smalls));
        let mut all = budget.hold(60);
        assert!(budget.grow(&mut all, 60, now).await, "all given back");
        let mut rest = budget.hold(10);
        assert!(budget.grow(&mut rest, 10, now).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_holds_room_for_what_it_declares_until_it_ends() {
        let budget = Budget::new(1 << 20, 1 << 20, 16 << 10);
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, String>>(1);
        tx.send(Ok(Frame::data(Bytes::from_static(b"{"))))
            .await
            .unwrap();
        let idle = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let (wait, until) = (
            Duration::from_secs(2),
            Instant::now() + Duration::from_secs(5),
        );
        let reading = {
            let budget = budget.clone();
            tokio::spawn(async move {
                read_body(idle, Some(600 << 10), 3 << 20, &budget, wait, until)
                    .await
                    .map(|b| b.bytes.len())
            })
        };
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let mut probe = budget.hold(0);
        assert!(budget.grow(&mut probe, 424 << 10, Instant::now()).await);
        assert!(
            !budget
                .grow(&mut probe, (424 << 10) + 1, Instant::now())
                .await
        );
        drop(probe);
        // Another waits for room, then is turned away.
        let other = Full::new(Bytes::from(vec![b'x'; 500 << 10]));
        let other = read_body(other, Some(500 << 10), 3 << 20, &budget, wait, until).await;
        assert!(matches!(other, Err(BodyError::Busy)));
        // The idle one ends at its deadline, and gives its room back.
        assert!(matches!(reading.await.unwrap(), Err(BodyError::Late)));
        let mut all = budget.hold(0);
        assert!(budget.grow(&mut all, 1 << 20, Instant::now()).await);
        drop(all);
        // A whole body keeps what its buffer holds.
        let until = Instant::now() + Duration::from_secs(5);
        let whole = Full::new(Bytes::from(vec![b'x'; 100 << 10]));
        let whole = read_body(whole, None, 512 << 10, &budget, wait, until)
            .await
            .unwrap();
        assert_eq!(whole.bytes.len(), 100 << 10);
        let mut rest = budget.hold(0);
        let free = (1 << 20) - whole.bytes.capacity();
        assert!(budget.grow(&mut rest, free, Instant::now()).await);
        assert!(!budget.grow(&mut rest, free + 1, Instant::now()).await);
    }

    #[tokio::test]
    async fn declared_or_sent_over_the_limit_is_too_large() {
        let budget = Budget::new(1 << 20, 1 << 19, 64 << 10);
        let until = Instant::now() + Duration::from_secs(5);
        let wait = Duration::from_secs(1);
        let body = Full::new(Bytes::from(vec![b'x'; 100]));
        let r = read_body(body, Some(101), 50, &budget, wait, until).await;
        assert!(matches!(r, Err(BodyError::TooLarge)));
        let body = Full::new(Bytes::from(vec![b'x'; 100]));
        let r = read_body(body, None, 50, &budget, wait, until).await;
        assert!(matches!(r, Err(BodyError::TooLarge)));
        let body = Full::new(Bytes::from(vec![b'x'; 100]));
        let r = read_body(body, Some(100), 100, &budget, wait, until).await;
        assert_eq!(r.unwrap().bytes.len(), 100);
    }
}
