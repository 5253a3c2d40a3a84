//! Concurrency places (`max_in_flight`), in one home: the places each admitted request
//! holds until it ends (`Holdings`), where each is counted (this gateway's shared data,
//! or the quota service), and the places of requests that ended waiting for the tick to
//! be given back to the service ([`leaving`]). The algorithm that counts them is
//! [`crate::algo::inflight`]; the calls that leave and renew them are planned by
//! [`crate::global`] and sent from the engine's tick.
//!
//! A place's life:
//!
//! ```text
//!   admitted ─▶ held (Holdings[id]) ──every RENEW_EVERY, from the tick──▶ renewed
//!                 │   local: at once in shared data
//!                 │   service: Renewing until its answer (the bucket it is counted in now)
//!                 └─ the request ends (end(id)) ─▶ local: given back at once
//!                                                 service: leaving ─tick─▶ a leave call
//!                                                 renewing: given back when the renewal
//!                                                 answers, from the bucket it names
//! ```
//!
//! The table lives in the engine, not with the worker's requests: the tick renews and the
//! answers update places without reaching into the worker.

pub mod leaving;

use crate::local::Taken;
use crate::store::SlotAddress;
use crate::time::Instant;
use hashbrown::HashMap;
use std::cell::{Cell, RefCell};

pub use leaving::MAX_LEAVING;

/// Concurrency places held at the quota service, to give back (`wire::LEAVE_PATH`) or
/// renew (`wire::RENEW_PATH`): the rule, the identity, the bucket the service counts
/// them in, and how many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServicePlace {
    pub index: usize,
    pub address: SlotAddress,
    pub bucket: u64,
    pub places: u32,
}

/// A concurrency place an admitted request holds until it ends
/// ([`crate::algo::InFlight`]); the tick renews it while the request is inside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Place {
    pub rule: usize,
    pub address: SlotAddress,
    pub at: PlaceAt,
    /// When it was taken or last renewed.
    pub renewed: Instant,
}

/// Where a place is counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PlaceAt {
    /// In this gateway's shared data (a local rule, or a global one while the quota
    /// service is unavailable).
    Local(Taken),
    /// At the quota service, in `bucket`. While a renewal is in flight (`renewing`), the
    /// renewal's answer says where it is: the request's end leaves it from there.
    Service {
        bucket: u64,
        places: u32,
        renewing: bool,
    },
}

impl Place {
    /// This place at the quota service, if it is counted there.
    pub(crate) fn at_service(&self) -> Option<ServicePlace> {
        match self.at {
            PlaceAt::Local(_) => None,
            PlaceAt::Service { bucket, places, .. } => Some(ServicePlace {
                index: self.rule,
                address: self.address,
                bucket,
                places,
            }),
        }
    }

    /// This place at the quota service, to give back now that its request ended; `None`
    /// when it is counted locally, or while its renewal is in flight (the renewal's answer
    /// says where it is, and gives it back from there).
    pub(crate) fn to_leave(&self) -> Option<ServicePlace> {
        match self.at {
            PlaceAt::Service {
                renewing: false, ..
            } => self.at_service(),
            _ => None,
        }
    }

    /// This place at the quota service, marked as renewing, unless a renewal of it is in
    /// flight already.
    pub(crate) fn start_renewal(&mut self) -> Option<ServicePlace> {
        let due = self.to_leave()?;
        if let PlaceAt::Service { renewing, .. } = &mut self.at {
            *renewing = true;
        }
        Some(due)
    }

    /// The answer to the renewal of `asked` came (`bucket`: where the service counts it
    /// now; `None`: not renewed, it stays where it was). True when `asked` is this place.
    pub(crate) fn renewal_answered(
        &mut self,
        asked: &ServicePlace,
        bucket: Option<u64>,
        now: Instant,
    ) -> bool {
        let PlaceAt::Service {
            bucket: held,
            places,
            renewing: true,
        } = self.at
        else {
            return false;
        };
        if self.rule != asked.index || self.address != asked.address || held != asked.bucket {
            return false;
        }
        self.at = PlaceAt::Service {
            bucket: bucket.unwrap_or(held),
            places,
            renewing: false,
        };
        if bucket.is_some() {
            self.renewed = now;
        }
        true
    }
}

/// The places one admitted request holds, by the id its worker keeps with the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HoldingId(u64);

/// The places of the requests inside. (Those of requests that ended wait for the tick in
/// the global part's [`leaving`] queue: giving them back is a call to the service.)
#[derive(Debug, Default)]
pub(crate) struct Holdings {
    held: RefCell<HashMap<HoldingId, Vec<Place>>>,
    next: Cell<u64>,
}

impl Holdings {
    /// Keeps `places` for a request that was admitted; its id ends them.
    pub(crate) fn hold(&self, places: Vec<Place>) -> Option<HoldingId> {
        if places.is_empty() {
            return None;
        }
        let id = HoldingId(self.next.get());
        self.next.set(self.next.get().wrapping_add(1));
        match self.held.try_borrow_mut() {
            Ok(mut held) => {
                held.insert(id, places);
                Some(id)
            }
            // Never borrowed across a call; if it were, the places are still counted
            // and reclaimed after their bound.
            Err(_) => None,
        }
    }

    /// The request of `id` ended: its places, taken out of the table.
    pub(crate) fn end(&self, id: HoldingId) -> Vec<Place> {
        self.held
            .try_borrow_mut()
            .ok()
            .and_then(|mut held| held.remove(&id))
            .unwrap_or_default()
    }

    /// True when some request holds places.
    pub(crate) fn any(&self) -> bool {
        self.held.try_borrow().is_ok_and(|held| !held.is_empty())
    }

    /// Runs `visit` over every held place (the tick renews them).
    pub(crate) fn visit(&self, mut visit: impl FnMut(HoldingId, &mut Place)) {
        if let Ok(mut held) = self.held.try_borrow_mut() {
            for (&id, places) in held.iter_mut() {
                for place in places.iter_mut() {
                    visit(id, place);
                }
            }
        }
    }

    /// The renewal of `asked`, a place of `id`, was answered: true when the request still
    /// holds it (now counted in `bucket`), false when it ended meanwhile.
    pub(crate) fn renewal_answered(
        &self,
        id: HoldingId,
        asked: &ServicePlace,
        bucket: Option<u64>,
        now: Instant,
    ) -> bool {
        let Ok(mut held) = self.held.try_borrow_mut() else {
            return false;
        };
        held.get_mut(&id).is_some_and(|places| {
            places
                .iter_mut()
                .any(|place| place.renewal_answered(asked, bucket, now))
        })
    }
}

/// The places `entries` carry.
pub(crate) fn places_in(entries: &[ServicePlace]) -> u64 {
    entries.iter().map(|entry| u64::from(entry.places)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::Nanos;

    fn service(bucket: u64) -> Place {
        Place {
            rule: 0,
            address: SlotAddress::of(7, 1024),
            at: PlaceAt::Service {
                bucket,
                places: 1,
                renewing: false,
            },
            renewed: Instant::EPOCH,
        }
    }

    #[test]
    fn a_holding_ends_once() {
        let holdings = Holdings::default();
        assert_eq!(holdings.hold(Vec::new()), None);
        let id = holdings.hold(vec![service(1)]);
        let Some(id) = id else { panic!("held") };
        assert!(holdings.any());
        assert_eq!(holdings.end(id).len(), 1);
        assert!(holdings.end(id).is_empty());
        assert!(!holdings.any());
    }

    #[test]
    fn a_renewal_answered_after_the_end_finds_no_place() {
        let holdings = Holdings::default();
        let Some(id) = holdings.hold(vec![service(1)]) else {
            panic!("held")
        };
        let mut asked = None;
        holdings.visit(|_, place| asked = place.start_renewal());
        let Some(asked) = asked else {
            panic!("renewing")
        };
        let later = Instant::EPOCH.saturating_add(Nanos::from_secs(5));
        assert!(holdings.renewal_answered(id, &asked, Some(2), later));
        let places = holdings.end(id);
        assert_eq!(places[0].to_leave().map(|place| place.bucket), Some(2));
        assert_eq!(places[0].renewed, later);
        assert!(!holdings.renewal_answered(id, &asked, Some(3), later));
    }
}
