//! Concurrency (`max_in_flight: N`): at most N requests of an identity inside the gateway
//! at once. A request takes a *place* when it is admitted and gives it back when it ends
//! (its response is done, its client left, its stream was reset).
//!
//! A place whose end is never reported (a worker that died holding it, a host that never
//! said the request ended) must not be lost for good. Places are therefore counted in
//! time buckets of [`PLACE_SPAN`]: the state keeps the counts of the last [`BUCKETS`]
//! buckets, and a bucket that falls out of that ring is forgotten with its places. A
//! worker renews the places of its requests still inside every [`RENEW_EVERY`] (it moves
//! them to the current bucket), so a live request never loses its place, while a place
//! nobody renews is reclaimed [`RECLAIMED_AFTER`] after it was last renewed, at the
//! latest.
//!
//! ```text
//!   state: [top, count(top), count(top-1), count(top-2), count(top-3)]   (a ring)
//!            top = the newest bucket number (now / PLACE_SPAN + 1; 0: never used)
//!
//!   admit ──▶ count(now) += 1, mark = its bucket ──▶ ... ──▶ end: count(mark) -= 1
//!                                  │                        (if still in the ring)
//!                                  └─ every RENEW_EVERY: count(mark) -= 1, count(now) += 1
//! ```
//!
//! Clock going backwards: the newest bucket never moves back, a place is counted in it.

use super::{Algorithm, Limit, Mark, Verdict};
use crate::time::{Instant, Nanos, Unit, NANOS_PER_SECOND};
use std::num::NonZeroU32;

/// The concurrency algorithm. Not in [`super::REGISTRY`]: a rule gets it by writing
/// `max_in_flight` instead of `rpu`, never through `algo`.
#[derive(Debug)]
pub struct InFlight;

/// The span of one bucket of places.
pub const PLACE_SPAN: Nanos = Nanos::from_secs(20);
/// Buckets kept: a place lives 3 to 4 spans after it was last renewed.
pub const BUCKETS: u64 = 4;
/// How often a worker renews the places of its requests still inside.
pub const RENEW_EVERY: Nanos = PLACE_SPAN;
/// The longest a place whose end is never reported stays counted after it was last
/// renewed (60–80 s).
pub const RECLAIMED_AFTER: Nanos = Nanos::new(BUCKETS * PLACE_SPAN.get());

/// Words of state: the newest bucket, then the ring of counts.
const WORDS: usize = 1 + BUCKETS as usize;

fn bucket_of(now: Instant) -> u64 {
    now.periods(PLACE_SPAN) + 1
}

/// The state as of `now`: the newest bucket and the counts of the live buckets (oldest
/// forgotten). Garbage or a short state reads as fresh.
struct Places {
    top: u64,
    counts: [u64; BUCKETS as usize],
}

impl Places {
    fn read(state: &[u64], now: Instant) -> Places {
        let current = bucket_of(now);
        let mut places = Places {
            top: current,
            counts: [0; BUCKETS as usize],
        };
        let (Some(&top), Some(ring)) = (state.first(), state.get(1..WORDS)) else {
            return places;
        };
        // A newest bucket further ahead than a clock step explains is garbage.
        if top == 0 || top > current.saturating_add(BUCKETS) {
            return places;
        }
        places.top = top.max(current);
        for (slot, count) in places.counts.iter_mut().enumerate() {
            let bucket = Self::bucket_at(top, slot as u64);
            // Only the buckets still in the ring as of the (newer) top are kept.
            if places.top - bucket < BUCKETS {
                *count = ring.get(slot).copied().unwrap_or(0);
            }
        }
        places
    }

    /// The bucket whose count ring slot `slot` holds, for a ring whose newest is `top`.
    fn bucket_at(top: u64, slot: u64) -> u64 {
        let offset = (top + BUCKETS - slot) % BUCKETS;
        top.saturating_sub(offset)
    }

    fn slot(bucket: u64) -> usize {
        (bucket % BUCKETS) as usize
    }

    fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The count of `bucket`, if it is still in the ring.
    fn count_mut(&mut self, bucket: u64) -> Option<&mut u64> {
        if bucket == 0 || bucket > self.top || self.top - bucket >= BUCKETS {
            return None;
        }
        self.counts.get_mut(Self::slot(bucket))
    }

    fn write(&self, state: &mut [u64]) {
        if let Some(top) = state.first_mut() {
            *top = self.top;
        }
        if let Some(ring) = state.get_mut(1..WORDS) {
            ring.copy_from_slice(&self.counts);
        }
    }
}

impl InFlight {
    fn verdict(limit: &Limit, places: &Places, granted: u32) -> Verdict {
        let max = u64::from(limit.rpu.get());
        let inside = places.total();
        Verdict {
            granted,
            remaining: max.saturating_sub(inside),
            // A place may free at any moment: a client is told to try again in a second.
            reset: if inside > 0 {
                NANOS_PER_SECOND
            } else {
                Nanos::ZERO
            },
            retry_after: if granted == 0 {
                NANOS_PER_SECOND
            } else {
                Nanos::ZERO
            },
            delay: Nanos::ZERO,
            mark: Mark(u128::from(places.top)),
        }
    }
}

impl Algorithm for InFlight {
    fn code(&self) -> &'static str {
        "IF"
    }

    fn aliases(&self) -> &'static [&'static str] {
        &[]
    }

    fn default_burst(&self, rpu: NonZeroU32, _unit: Unit) -> NonZeroU32 {
        rpu
    }

    fn state_words(&self, _limit: &Limit) -> usize {
        WORDS
    }

    fn capacity(&self, limit: &Limit) -> u64 {
        u64::from(limit.rpu.get())
    }

    fn lends(&self) -> bool {
        // A worker holding spare places would keep them from requests of other workers,
        // and a denial remembered would outlive the place that frees a moment later.
        false
    }

    fn holds_until_done(&self) -> bool {
        true
    }

    fn state_follows_limit(&self) -> bool {
        false
    }

    fn acquire_at_least(
        &self,
        limit: &Limit,
        state: &mut [u64],
        now: Instant,
        need: u32,
        want: u32,
    ) -> Verdict {
        let mut places = Places::read(state, now);
        let available = u64::from(limit.rpu.get()).saturating_sub(places.total());
        if want == 0 || available < u64::from(need) {
            return InFlight::verdict(limit, &places, 0);
        }
        let granted = u32::try_from(available.min(u64::from(want))).unwrap_or(want);
        let top = places.top;
        if let Some(count) = places.count_mut(top) {
            *count += u64::from(granted);
        }
        places.write(state);
        InFlight::verdict(limit, &places, granted)
    }

    fn release(&self, _limit: &Limit, state: &mut [u64], now: Instant, tokens: u32, mark: Mark) {
        let mut places = Places::read(state, now);
        let bucket = u64::try_from(mark.0).unwrap_or(0);
        if let Some(count) = places.count_mut(bucket) {
            *count = count.saturating_sub(u64::from(tokens));
            places.write(state);
        }
    }

    /// Counts `tokens` places in the current bucket whatever the limit: a renewed place
    /// (given back from its old bucket first), never a new request.
    fn charge_debt(&self, limit: &Limit, state: &mut [u64], now: Instant, tokens: u32) -> Verdict {
        let mut places = Places::read(state, now);
        let top = places.top;
        if let Some(count) = places.count_mut(top) {
            *count = count.saturating_add(u64::from(tokens));
        }
        places.write(state);
        InFlight::verdict(limit, &places, 0)
    }

    fn is_idle(&self, _limit: &Limit, state: &[u64], now: Instant) -> bool {
        Places::read(state, now).total() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::NANOS_PER_SECOND;

    const S: Nanos = NANOS_PER_SECOND;
    const T0: Instant = Instant::from_unix_nanos(1_767_225_600_000_000_000);

    fn five() -> Limit {
        let five = NonZeroU32::new(5).unwrap();
        Limit {
            rpu: five,
            unit: Unit::Second,
            burst: five,
            slices: NonZeroU32::MIN,
            calendar: None,
            period: None,
        }
    }

    fn admit(state: &mut [u64], now: Instant) -> Option<Mark> {
        let verdict = InFlight.acquire_at_least(&five(), state, now, 1, 1);
        verdict.allowed().then_some(verdict.mark)
    }

    #[test]
    fn at_most_n_inside_and_an_end_frees_a_place() {
        let mut state = [0u64; WORDS];
        let marks: Vec<Mark> = (0..5).filter_map(|_| admit(&mut state, T0)).collect();
        assert_eq!(marks.len(), 5);
        assert_eq!(admit(&mut state, T0), None);
        let denied = InFlight.acquire_at_least(&five(), &mut state, T0, 1, 1);
        assert_eq!((denied.remaining, denied.retry_after), (0, S));
        InFlight.release(&five(), &mut state, T0 + S, 1, marks[0]);
        assert!(admit(&mut state, T0 + S).is_some());
        assert_eq!(admit(&mut state, T0 + S), None);
        // Ends reported across buckets still find their place.
        for mark in &marks[1..] {
            InFlight.release(&five(), &mut state, T0 + 30 * S, 1, *mark);
        }
        assert_eq!(
            (0..10)
                .filter(|_| admit(&mut state, T0 + 30 * S).is_some())
                .count(),
            4
        );
    }

    #[test]
    fn a_place_never_given_back_is_reclaimed_within_the_bound_and_a_renewed_one_is_kept() {
        let mut state = [0u64; WORDS];
        admit(&mut state, T0).unwrap(); // the lost place: never renewed, never given back
        let mut kept = admit(&mut state, T0).unwrap();
        let mut now = T0;
        // The worker renews `kept` every RENEW_EVERY; nobody renews `lost`.
        while now < T0 + RECLAIMED_AFTER {
            now += RENEW_EVERY;
            InFlight.release(&five(), &mut state, now, 1, kept);
            kept = InFlight.charge_debt(&five(), &mut state, now, 1).mark;
        }
        let inside = 5 - InFlight
            .acquire_at_least(&five(), &mut state, now, 1, 0)
            .remaining;
        assert_eq!(
            inside, 1,
            "the lost place is reclaimed, the renewed one is kept"
        );
        // Not before (BUCKETS - 1) spans.
        let mut state = [0u64; WORDS];
        admit(&mut state, T0).unwrap();
        let probe = |state: &mut [u64], at: Instant| {
            5 - InFlight
                .acquire_at_least(&five(), state, at, 1, 0)
                .remaining
        };
        assert_eq!(probe(&mut state, T0 + (BUCKETS - 1) * PLACE_SPAN - S), 1);
        assert_eq!(probe(&mut state, T0 + RECLAIMED_AFTER), 0);
    }

    #[test]
    fn fresh_garbage_and_clock_steps() {
        let limit = five();
        assert!(InFlight.is_idle(&limit, &[0; WORDS], T0));
        assert!(InFlight.is_idle(&limit, &[], T0));
        // A top far ahead is garbage: fresh.
        assert!(InFlight.is_idle(&limit, &[u64::MAX, 9, 9, 9, 9], T0));
        // A clock one bucket behind counts in the stored (newer) bucket; the place is
        // still found and given back.
        let mut state = [0u64; WORDS];
        let mark = admit(&mut state, T0 + PLACE_SPAN).unwrap();
        let behind = admit(&mut state, T0).unwrap();
        assert_eq!(mark, behind);
        InFlight.release(&limit, &mut state, T0, 2, mark);
        assert!(InFlight.is_idle(&limit, &state, T0));
    }
}
