//! A request's place among the requests in progress (docs/reference/behaviour.md#in-progress),
//! held for as long
//! as anything of the request lives: its handler, its answer being sent, and
//! the upstream exchange of a protected request, which goes on when the
//! client has gone.

use std::sync::Arc;

use tokio::sync::OwnedSemaphorePermit;

/// One place among the requests in progress. Owned by one holder until a
/// second one needs it ([`Permit::share`]): pass-through requests, the most
/// common, never pay for sharing.
#[derive(Debug, Default)]
pub(crate) enum Permit {
    /// Holds no place (what is left where a permit was moved out).
    #[default]
    None,
    One(OwnedSemaphorePermit),
    /// The place is free once every holder has dropped its share.
    Shared(Arc<OwnedSemaphorePermit>),
}

impl Permit {
    pub fn new(permit: OwnedSemaphorePermit) -> Self {
        Permit::One(permit)
    }

    /// A second holder of the same place.
    pub(crate) fn share(&mut self) -> Permit {
        let shared = match std::mem::take(self) {
            Permit::None => return Permit::None,
            Permit::One(p) => Arc::new(p),
            Permit::Shared(p) => p,
        };
        *self = Permit::Shared(shared.clone());
        Permit::Shared(shared)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::Semaphore;

    #[test]
    fn a_shared_place_is_free_once_every_holder_is_gone() {
        let places = Arc::new(Semaphore::new(1));
        let mut first = Permit::new(places.clone().try_acquire_owned().unwrap());
        let second = first.share();
        let third = first.share();
        drop(first);
        drop(third);
        assert_eq!(places.available_permits(), 0, "the second still holds it");
        drop(second);
        assert_eq!(places.available_permits(), 1);
        let mut none = Permit::None;
        assert!(matches!(none.share(), Permit::None));
    }
}
