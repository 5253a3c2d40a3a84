//! Pieces shared by the algorithms: the bucket algorithms' (`LB`, `TB`) time kept
//! multiplied by `rpu` in 128 bits, and the unit tests' scenario runner.
//!
//! The leaky and token buckets both keep one instant, as two state words. Their interval
//! `T = unit / rpu` is rarely a whole number of nanoseconds, so all their instants and
//! durations are multiplied by `rpu`: `T` is then exactly `unit` nanoseconds and nothing
//! drifts. The stored instant is that product as a 128-bit number, high word first.

use super::Limit;
use crate::time::{Instant, Nanos};

/// Reads the 128-bit value stored as two words, high first; `None` for a short state.
pub(super) fn load(state: &[u64]) -> Option<u128> {
    match state {
        [high, low, ..] => Some((u128::from(*high) << 64) | u128::from(*low)),
        _ => None,
    }
}

/// Stores a 128-bit value as two words, high first; a short state is left alone.
pub(super) fn store(state: &mut [u64], value: u128) {
    if let [high, low, ..] = state {
        // Truncations intended: the two halves.
        *high = (value >> 64) as u64;
        *low = value as u64;
    }
}

/// A limit's quantities for the bucket algorithms, all in nanoseconds × `rpu`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Scaled {
    pub rpu: u128,
    /// `T × rpu`: the time to refill one token (`TB`), between two departures (`LB`).
    pub interval: u128,
    pub burst: u128,
    pub now: u128,
}

impl Scaled {
    pub fn new(limit: &Limit, now: Instant) -> Self {
        Scaled::per(limit, limit.unit.nanos(), now)
    }

    /// `rpu` per `unit` (the token bucket's calendar clock has its own, see `token.rs`).
    pub fn per(limit: &Limit, unit: Nanos, now: Instant) -> Self {
        let rpu = u128::from(limit.rpu.get());
        Scaled {
            rpu,
            interval: u128::from(unit.get()),
            burst: u128::from(limit.burst.get()),
            now: u128::from(now.unix_nanos()) * rpu,
        }
    }

    /// `burst × interval`: the time to refill the whole bucket (`TB`), the longest wait
    /// that still has a place in the queue (`LB`).
    pub fn capacity(self) -> u128 {
        self.burst * self.interval
    }

    /// `max(stored, now)` for the instant stored in `state`. An instant more than `ahead`
    /// plus one unit (of clock step) beyond `now` cannot come from a clock step and is
    /// garbage; it reads as `now`, like a short state.
    pub fn stored_or_now(self, state: &[u64], ahead: u128) -> u128 {
        let stored = load(state).unwrap_or(0);
        if stored.saturating_sub(self.now) > ahead + self.interval * self.rpu {
            self.now
        } else {
            stored.max(self.now)
        }
    }

    /// Takes as many as `want` of the `free` intervals that follow `start`, and stores the
    /// instant after the last one taken if any were. Returns how many and that instant.
    pub fn take(self, state: &mut [u64], start: u128, want: u32, free: u128) -> (u128, u128) {
        let granted = u128::from(want).min(free);
        let end = start + granted * self.interval;
        if granted > 0 {
            store(state, end);
        }
        (granted, end)
    }

    /// Converts a duration kept multiplied by `rpu` back to nanoseconds, rounding up.
    pub fn to_nanos(self, scaled: u128) -> Nanos {
        Nanos::new(u64::try_from(scaled.div_ceil(self.rpu)).unwrap_or(u64::MAX))
    }
}

/// The algorithms' unit tests: limits and scenarios of expected verdicts.
#[cfg(test)]
pub(super) mod testing {
    use super::super::{Algorithm, Limit, Verdict};
    use crate::calendar::{Calendar, CalendarUnit, Zone};
    use crate::time::{Instant, Nanos, Unit, NANOS_PER_SECOND};
    use std::num::NonZeroU32;

    /// One second in the tables' raw nanoseconds: instants and spans in a table are plain
    /// numbers, made [`Instant`]s and [`Nanos`] where they meet the algorithm.
    pub const S: u64 = NANOS_PER_SECOND.get();

    /// The instant `nanos` after the epoch.
    pub const fn at(nanos: u64) -> Instant {
        Instant::from_unix_nanos(nanos)
    }

    /// A limit; without `burst`, the algorithm's default.
    pub fn limit(
        algo: &dyn Algorithm,
        rpu: u32,
        unit: Unit,
        burst: Option<u32>,
        slices: u32,
    ) -> Limit {
        let rpu = NonZeroU32::new(rpu).unwrap();
        let burst = burst.map_or_else(
            || algo.default_burst(rpu, unit),
            |b| NonZeroU32::new(b).unwrap(),
        );
        Limit {
            rpu,
            unit,
            burst,
            slices: NonZeroU32::new(slices).unwrap(),
            calendar: None,
            period: None,
        }
    }

    /// A limit of `rpu` per calendar `unit` in `zone` (`unit: week | month`).
    pub fn calendar(
        algo: &dyn Algorithm,
        rpu: u32,
        unit: CalendarUnit,
        zone: &str,
        burst: Option<u32>,
    ) -> Limit {
        Limit {
            calendar: Some(Calendar::new(unit, Zone::parse(zone).unwrap())),
            ..limit(algo, rpu, Unit::Day, burst, 1)
        }
    }

    /// `(now, want, granted, remaining, reset, retry_after)`, for an algorithm that never
    /// delays.
    pub type Step = (u64, u32, u32, u64, u64, u64);

    /// Runs the steps in order on one state, each expecting its verdict with no delay.
    pub fn run(algo: &dyn Algorithm, limit: &Limit, state: &mut [u64], steps: &[Step]) {
        for (i, &(now, want, granted, remaining, reset, retry_after)) in steps.iter().enumerate() {
            let expected = Verdict {
                granted,
                remaining,
                reset: Nanos::new(reset),
                retry_after: Nanos::new(retry_after),
                ..Verdict::default()
            };
            check(algo, limit, state, i, at(now), want, expected);
        }
    }

    /// Step `i` of a scenario: asks for `want` at `now` and expects `expected`; a rejection
    /// must leave the state as it was.
    pub fn check(
        algo: &dyn Algorithm,
        limit: &Limit,
        state: &mut [u64],
        i: usize,
        now: Instant,
        want: u32,
        expected: Verdict,
    ) {
        let before = state.to_vec();
        let verdict = algo.acquire(limit, state, now, want);
        let compared = Verdict {
            mark: expected.mark,
            ..verdict
        };
        assert_eq!(compared, expected, "step {i} at {now:?}");
        if verdict.granted == 0 {
            assert_eq!(
                state,
                &before[..],
                "step {i}: a rejection changed the state"
            );
        }
    }
}
