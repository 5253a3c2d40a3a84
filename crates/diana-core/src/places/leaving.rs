//! Concurrency places held at the quota service by requests that ended, waiting for the
//! worker's tick to give them back ([`wire::LEAVE_PATH`]).
//!
//! ```text
//! a request ends ─ push ─┬─ same counter and bucket waiting, room in it ─▶ merged (one entry, more places)
//!                        ├─ room in the queue ──────────────────────────▶ a new entry
//!                        └─ MAX_LEAVING entries waiting ────────────────▶ refused: counted, the
//!                                                                          service reclaims them
//! the tick ─ take(wire::MAX_RULES) ─▶ one leave call, until the queue is empty
//! ```
//!
//! Many requests of one identity end between two ticks (nginx ticks every 100 ms): they
//! wait as one entry, so that a burst of one hot key neither fills the queue nor spends
//! the calls' rules.

use super::ServicePlace;
use crate::wire;
use std::cell::RefCell;

/// Entries waiting for the tick, at most (beyond, a place is reclaimed by the service
/// after `algo::inflight::RECLAIMED_AFTER`).
pub const MAX_LEAVING: usize = 1024;

/// Most places one entry carries: a leave call of [`wire::MAX_RULES`] full entries asks
/// at most [`wire::MAX_TOTAL_WANT`], and each entry at most [`wire::MAX_WANT`].
pub const MAX_PLACES_PER_ENTRY: u32 = {
    let per_rule = wire::MAX_TOTAL_WANT / wire::MAX_RULES as u64;
    if per_rule < wire::MAX_WANT as u64 {
        per_rule as u32
    } else {
        wire::MAX_WANT
    }
};

// A call of full entries is one the service accepts.
const _: () = assert!(
    MAX_PLACES_PER_ENTRY as u64 * wire::MAX_RULES as u64 <= wire::MAX_TOTAL_WANT
        && MAX_PLACES_PER_ENTRY <= wire::MAX_WANT
);

/// The queue of places to give back.
#[derive(Debug, Default)]
pub struct Leaving {
    waiting: RefCell<Vec<ServicePlace>>,
}

/// Places that could not wait: [`MAX_LEAVING`] entries wait already (or the queue was
/// being read, which a worker never does while it reports an end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotQueued {
    pub places: u32,
}

impl Leaving {
    /// Queues `place`, merged into an entry of the same rule, identity and bucket while
    /// that entry has room. Places of no count are nothing to give back.
    pub fn push(&self, place: ServicePlace) -> Result<(), NotQueued> {
        if place.places == 0 {
            return Ok(());
        }
        let mut waiting = self.waiting.try_borrow_mut().map_err(|_| NotQueued {
            places: place.places,
        })?;
        let mut rest = place.places;
        for entry in waiting
            .iter_mut()
            .filter(|entry| same_counter(entry, &place))
        {
            let room = MAX_PLACES_PER_ENTRY.saturating_sub(entry.places);
            let moved = room.min(rest);
            entry.places += moved;
            rest -= moved;
            if rest == 0 {
                return Ok(());
            }
        }
        // A place count above one entry's bound (a cost that large) takes several.
        while rest > 0 {
            if waiting.len() >= MAX_LEAVING {
                return Err(NotQueued { places: rest });
            }
            let places = rest.min(MAX_PLACES_PER_ENTRY);
            waiting.push(ServicePlace { places, ..place });
            rest -= places;
        }
        Ok(())
    }

    /// The first `most` entries, taken out of the queue.
    pub fn take(&self, most: usize) -> Vec<ServicePlace> {
        match self.waiting.try_borrow_mut() {
            Ok(mut waiting) => {
                let count = waiting.len().min(most);
                waiting.drain(..count).collect()
            }
            Err(_) => Vec::new(),
        }
    }

    /// True when places wait.
    pub fn is_empty(&self) -> bool {
        self.waiting
            .try_borrow()
            .map_or(true, |waiting| waiting.is_empty())
    }
}

/// The same counter at the service, counted in the same bucket.
fn same_counter(a: &ServicePlace, b: &ServicePlace) -> bool {
    a.index == b.index && a.address == b.address && a.bucket == b.bucket
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SlotAddress;

    fn place(identity: u64, bucket: u64, places: u32) -> ServicePlace {
        ServicePlace {
            index: 0,
            address: SlotAddress::of(identity, 1024),
            bucket,
            places,
        }
    }

    #[test]
    fn ends_of_one_counter_and_bucket_wait_as_one_entry() {
        let leaving = Leaving::default();
        for _ in 0..5_000 {
            assert_eq!(leaving.push(place(7, 3, 1)), Ok(()));
        }
        assert_eq!(leaving.push(place(7, 4, 2)), Ok(()));
        assert_eq!(leaving.push(place(8, 3, 1)), Ok(()));
        let taken = leaving.take(wire::MAX_RULES);
        assert_eq!(
            taken,
            vec![place(7, 3, 5_000), place(7, 4, 2), place(8, 3, 1)]
        );
        assert!(leaving.is_empty());
    }

    #[test]
    fn an_entry_carries_at_most_its_bound() {
        let leaving = Leaving::default();
        let many = MAX_PLACES_PER_ENTRY * 2 + 10;
        assert_eq!(leaving.push(place(1, 1, many)), Ok(()));
        assert_eq!(leaving.push(place(1, 1, 5)), Ok(()));
        let taken = leaving.take(usize::MAX);
        let counts: Vec<u32> = taken.iter().map(|entry| entry.places).collect();
        assert_eq!(counts, vec![MAX_PLACES_PER_ENTRY, MAX_PLACES_PER_ENTRY, 15]);
    }

    #[test]
    fn distinct_counters_beyond_the_bound_are_refused_not_queued() {
        let leaving = Leaving::default();
        for identity in 0..MAX_LEAVING as u64 {
            assert_eq!(leaving.push(place(identity, 1, 1)), Ok(()));
        }
        assert_eq!(
            leaving.push(place(u64::MAX, 1, 3)),
            Err(NotQueued { places: 3 })
        );
        // A counter already waiting still takes more places.
        assert_eq!(leaving.push(place(3, 1, 1)), Ok(()));
        assert_eq!(leaving.take(usize::MAX).len(), MAX_LEAVING);
    }

    #[test]
    fn no_places_is_nothing_to_queue() {
        let leaving = Leaving::default();
        assert_eq!(leaving.push(place(1, 1, 0)), Ok(()));
        assert!(leaving.is_empty());
    }
}
