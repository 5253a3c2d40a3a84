//! Single flight: at most one callout per (global rule, identity) per worker at a time.
//!
//! When a request needs the quota service for a rule that already has a callout in flight
//! from this worker, it does not call too: it is *parked* behind that flight. When the
//! flight lands its spare tokens are in the lease stash, and the parked requests are
//! *woken* to plan again: most are served from the stash; the first one that still needs
//! tokens leads the next flight and asks for the demand of the woken requests that have
//! not planned again yet ([`Flights::expected`]), so the requests behind it are served by
//! its answer. Without this, a burst of N concurrent requests finding the stash empty
//! makes N callouts, each asking for a lease, and N leases are taken for a burst that
//! needed one. Only those still waiting count: a woken request served from the stash, or
//! gone, needs nothing more, and a token asked for nobody stays in this gateway's stash
//! while another gateway is refused it (with `lease: 1` the count would not be exact).
//!
//! For the same reason the woken requests a flight asks for are parked behind it again
//! ([`Flights::take_off`]): a token another flight brought (another worker's, for its own
//! riders) must not serve them while theirs is on its way, or theirs lands for nobody. And
//! the host is handed woken requests one at a time ([`Flights::next_woken`]), so that one
//! leading a flight takes the rest along before they plan.
//!
//! ```text
//!   park ──► riding a flight ──lands──► woken ──plans again──► served
//!                  ▲                      │                    leads a flight
//!                  └──────────────────────┘                    parks behind one
//!          a flight of its key takes off, asking for it
//! ```
//!
//! Parking needs a host that can resume a request from elsewhere (Envoy, from the root
//! context's tick); on nginx nothing is parked. Leaky-bucket rules never park: their turns
//! are per request and cannot be prefetched for others, so serialising them would only
//! slow them down.
//!
//! Everything here is per worker and bounded: at most [`MAX_RIDERS`] parked requests (more
//! call out on their own), one flight per key of a request in flight, one entry per woken
//! request that has not planned again.

use crate::time::{Instant, Nanos, NANOS_PER_SECOND};
use hashbrown::HashMap;
use smallvec::SmallVec;
use std::cell::RefCell;
use std::collections::VecDeque;

/// Identifies a parked request.
pub type RiderId = u64;

/// A (rule index, identity fingerprint) pair: what one flight is for.
pub type FlightKey = (usize, u64);

/// The most requests one worker keeps parked; beyond it a request makes its own callout
/// (memory stays bounded whatever the load).
pub const MAX_RIDERS: usize = 4096;

/// How long after its deadline a flight whose answer never came (its request vanished
/// without being abandoned) is treated as landed.
const LOST_FLIGHT_GRACE: Nanos = NANOS_PER_SECOND;

/// A woken request that has not planned again within this long (its host lost it) no
/// longer counts in the demand of its key.
const EXPECTED_TTL: Nanos = NANOS_PER_SECOND;

#[derive(Debug)]
struct Flight {
    /// When the flight counts as lost.
    deadline: Instant,
    /// Parked requests and their cost for this key, in arrival order.
    riders: SmallVec<[(RiderId, u32); 4]>,
}

/// A parked request whose flight has landed and which has not planned again.
#[derive(Debug, Clone, Copy)]
struct Waking {
    key: FlightKey,
    cost: u32,
    woken_at: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    next_rider: RiderId,
    flying: HashMap<FlightKey, Flight>,
    /// Parked requests whose flight has landed, in arrival order, not yet handed to the
    /// host.
    woken: VecDeque<RiderId>,
    /// Woken requests that have not planned again (handed to the host or not).
    waking: HashMap<RiderId, Waking>,
    /// The sum of the costs in `waking`, per key: what the next flight of the key asks for
    /// on their behalf.
    demand: HashMap<FlightKey, u64>,
}

/// This worker's flights and the requests parked behind them.
#[derive(Debug, Default)]
pub struct Flights {
    inner: RefCell<Inner>,
}

impl Flights {
    /// True when `key` has a callout in flight from this worker.
    pub fn in_flight(&self, key: FlightKey) -> bool {
        self.inner
            .try_borrow()
            .is_ok_and(|inner| inner.flying.contains_key(&key))
    }

    /// Parks a request of `cost` tokens behind the flight of `key`; `None` when the flight
    /// has landed meanwhile or [`MAX_RIDERS`] are parked already.
    pub fn park(&self, key: FlightKey, cost: u32) -> Option<RiderId> {
        let mut inner = self.inner.try_borrow_mut().ok()?;
        let parked: usize = inner.waking.len()
            + inner
                .flying
                .values()
                .map(|flight| flight.riders.len())
                .sum::<usize>();
        if parked >= MAX_RIDERS {
            return None;
        }
        inner.next_rider = inner.next_rider.wrapping_add(1);
        let rider = inner.next_rider;
        let flight = inner.flying.get_mut(&key)?;
        flight.riders.push((rider, cost));
        Some(rider)
    }

    /// Marks `keys` as in flight until they land or `deadline` (plus a grace) passes. The
    /// flight asked for the woken requests of its keys that have not planned again
    /// ([`Flights::expected`]): they are parked behind it again, so that no other token
    /// serves them while theirs is on its way (it would land for nobody: with `lease: 1`
    /// a token lost to the count).
    pub fn take_off(&self, keys: &[FlightKey], deadline: Instant) {
        let Ok(mut inner) = self.inner.try_borrow_mut() else {
            return;
        };
        for &key in keys {
            let adopted = inner.adopt_waking(key);
            inner
                .flying
                .entry(key)
                .or_insert_with(|| Flight {
                    deadline: deadline.saturating_add(LOST_FLIGHT_GRACE),
                    riders: SmallVec::new(),
                })
                .riders
                .extend(adopted);
        }
    }

    /// The tokens the requests woken from flights of `key` still need: those that have
    /// not planned again (0 if none). The next flight asks for them too.
    pub fn expected(&self, key: FlightKey) -> u64 {
        self.inner
            .try_borrow()
            .ok()
            .and_then(|inner| inner.demand.get(&key).copied())
            .unwrap_or(0)
    }

    /// A woken request plans again: from now on it asks for itself, it is no longer
    /// expected behind someone else's flight. Handed over one at a time, it is still
    /// waking (no flight took it along: O(1)); were it riding a flight, it is taken off
    /// (and parks anew if it still needs that flight).
    pub fn replanning(&self, rider: RiderId) {
        if let Ok(mut inner) = self.inner.try_borrow_mut() {
            if inner.waking.contains_key(&rider) {
                inner.forget(rider);
                return;
            }
        }
        self.unpark(rider);
    }

    /// The flights of `keys` have landed (answered, failed or abandoned): their riders are
    /// woken.
    pub fn land(&self, keys: &[FlightKey], now: Instant) {
        let Ok(mut inner) = self.inner.try_borrow_mut() else {
            return;
        };
        for key in keys {
            if let Some(flight) = inner.flying.remove(key) {
                inner.wake(*key, flight, now);
            }
        }
    }

    /// Lands the flights whose answer is overdue (their request vanished unannounced), and
    /// forgets stale expected demands.
    pub fn land_overdue(&self, now: Instant) {
        let Ok(mut inner) = self.inner.try_borrow_mut() else {
            return;
        };
        let overdue: SmallVec<[FlightKey; 4]> = inner
            .flying
            .iter()
            .filter(|(_, flight)| flight.deadline <= now)
            .map(|(key, _)| *key)
            .collect();
        for key in overdue {
            if let Some(flight) = inner.flying.remove(&key) {
                inner.wake(key, flight, now);
            }
        }
        let stale: SmallVec<[RiderId; 4]> = inner
            .waking
            .iter()
            .filter(|(_, waking)| now.saturating_since(waking.woken_at) >= EXPECTED_TTL)
            .map(|(rider, _)| *rider)
            .collect();
        for rider in stale {
            inner.forget(rider);
        }
    }

    /// The next parked request whose flight has landed, in the order they parked, to plan
    /// again. One at a time: one that plans again may lead a flight that takes the others
    /// along ([`Flights::take_off`]), and those must not plan again before it lands.
    pub fn next_woken(&self) -> Option<RiderId> {
        self.inner
            .try_borrow_mut()
            .ok()
            .and_then(|mut inner| inner.woken.pop_front())
    }

    /// Every parked request whose flight has landed, at once (tests).
    #[cfg(test)]
    pub fn woken(&self) -> Vec<RiderId> {
        std::iter::from_fn(|| self.next_woken()).collect()
    }

    /// True when a landed flight woke parked requests that are not yet planned again.
    pub fn has_woken(&self) -> bool {
        self.inner
            .try_borrow()
            .is_ok_and(|inner| !inner.woken.is_empty())
    }

    /// A parked request is gone (its client went away).
    pub fn unpark(&self, rider: RiderId) {
        let Ok(mut inner) = self.inner.try_borrow_mut() else {
            return;
        };
        for flight in inner.flying.values_mut() {
            if let Some(at) = flight.riders.iter().position(|(id, _)| *id == rider) {
                flight.riders.remove(at);
                return;
            }
        }
        inner.woken.retain(|id| *id != rider);
        inner.forget(rider);
    }

    /// True when requests are parked behind a flight or woken and not yet planned again:
    /// the host's tick must run to wake them (and to forget those it lost).
    pub fn busy(&self) -> bool {
        self.inner.try_borrow().map_or(true, |inner| {
            !inner.woken.is_empty()
                || !inner.waking.is_empty()
                || inner.flying.values().any(|f| !f.riders.is_empty())
        })
    }
}

impl Inner {
    fn wake(&mut self, key: FlightKey, flight: Flight, now: Instant) {
        for (rider, cost) in flight.riders {
            self.woken.push_back(rider);
            self.waking.insert(
                rider,
                Waking {
                    key,
                    cost,
                    woken_at: now,
                },
            );
            let demand = self.demand.entry(key).or_insert(0);
            *demand = demand.saturating_add(u64::from(cost));
        }
    }

    /// The woken requests of `key` that have not planned again, in the order they parked
    /// (rider ids grow), taken out of the waiting demand: a flight of `key` that asked for
    /// them takes off.
    fn adopt_waking(&mut self, key: FlightKey) -> SmallVec<[(RiderId, u32); 4]> {
        if !self.demand.contains_key(&key) {
            return SmallVec::new();
        }
        let mut adopted: SmallVec<[(RiderId, u32); 4]> = self
            .waking
            .iter()
            .filter(|(_, waking)| waking.key == key)
            .map(|(rider, waking)| (*rider, waking.cost))
            .collect();
        adopted.sort_unstable_by_key(|(rider, _)| *rider);
        let waking = &self.waking;
        self.woken
            .retain(|rider| waking.get(rider).is_none_or(|waking| waking.key != key));
        for (rider, _) in &adopted {
            self.forget(*rider);
        }
        adopted
    }

    /// `rider` no longer waits to plan again: its cost leaves its key's demand.
    fn forget(&mut self, rider: RiderId) {
        let Some(waking) = self.waking.remove(&rider) else {
            return;
        };
        if let Some(demand) = self.demand.get_mut(&waking.key) {
            *demand = demand.saturating_sub(u64::from(waking.cost));
            if *demand == 0 {
                self.demand.remove(&waking.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(nanos: u64) -> Instant {
        Instant::from_unix_nanos(nanos)
    }

    const KEY: FlightKey = (0, 7);

    #[test]
    fn riders_wait_for_the_flight_and_wake_in_order_with_their_demand() {
        let flights = Flights::default();
        assert_eq!(flights.park(KEY, 1), None, "nothing in flight");
        flights.take_off(&[KEY], at(50));
        assert!(flights.in_flight(KEY) && !flights.in_flight((1, 7)));
        assert!(!flights.busy(), "a flight without riders needs no tick");
        let first = flights.park(KEY, 2).unwrap();
        let second = flights.park(KEY, 3).unwrap();
        assert!(flights.woken().is_empty() && flights.busy());
        flights.land(&[KEY], at(10));
        assert!(flights.busy(), "woken, not yet planned again");
        assert!(!flights.in_flight(KEY));
        assert_eq!(flights.woken(), vec![first, second]);
        assert_eq!(flights.expected(KEY), 5, "both still to plan again");
        assert_eq!(flights.expected((1, 7)), 0);
        flights.replanning(first);
        assert_eq!(flights.expected(KEY), 3, "the first asks for itself now");
        assert!(flights.busy());
        flights.replanning(second);
        assert_eq!(flights.expected(KEY), 0);
        assert!(!flights.busy());
    }

    #[test]
    fn a_flight_that_asks_for_the_woken_takes_them_along() {
        let flights = Flights::default();
        flights.take_off(&[KEY], at(50));
        let handed = flights.park(KEY, 1).unwrap();
        let waiting = flights.park(KEY, 2).unwrap();
        let other = (1, 7);
        flights.take_off(&[other], at(50));
        let elsewhere = flights.park(other, 1).unwrap();
        flights.land(&[KEY, other], at(10));
        // Handed to the host, none has planned again yet.
        assert_eq!(flights.woken().len(), 3);
        assert_eq!(flights.expected(KEY), 3);
        flights.take_off(&[KEY], at(60));
        assert_eq!(flights.expected(KEY), 0, "asked for by the flight");
        assert_eq!(flights.expected(other), 1, "another key's are not");
        assert!(flights.woken().is_empty());
        // One of them plans again now: it is no longer behind the flight (it parks anew if
        // it still needs it).
        flights.replanning(handed);
        flights.replanning(elsewhere);
        flights.land(&[KEY], at(70));
        assert_eq!(
            flights.woken(),
            vec![waiting],
            "woken by the flight that asked"
        );
        assert_eq!(flights.expected(KEY), 2);
    }

    #[test]
    fn a_rider_that_leaves_is_not_woken() {
        let flights = Flights::default();
        flights.take_off(&[KEY], at(50));
        let gone = flights.park(KEY, 1).unwrap();
        let stays = flights.park(KEY, 1).unwrap();
        flights.unpark(gone);
        flights.land(&[KEY], at(10));
        assert_eq!(flights.woken(), vec![stays]);
        assert_eq!(flights.expected(KEY), 1);
    }

    #[test]
    fn a_lost_flight_lands_after_its_deadline_and_grace() {
        let flights = Flights::default();
        flights.take_off(&[KEY], at(50));
        let rider = flights.park(KEY, 1).unwrap();
        flights.land_overdue(at(50) + LOST_FLIGHT_GRACE - Nanos::new(1));
        assert!(flights.woken().is_empty());
        flights.land_overdue(at(50) + LOST_FLIGHT_GRACE);
        assert_eq!(flights.woken(), vec![rider]);
        flights.land_overdue(at(50) + LOST_FLIGHT_GRACE + EXPECTED_TTL);
        assert_eq!(flights.expected(KEY), 0, "stale demand forgotten");
    }

    #[test]
    fn parking_is_bounded() {
        let flights = Flights::default();
        flights.take_off(&[KEY], at(50));
        for _ in 0..MAX_RIDERS {
            assert!(flights.park(KEY, 1).is_some());
        }
        assert_eq!(flights.park(KEY, 1), None);
    }
}
