//! Leaky bucket (`LB`): a queue that lets requests through at a steady rate.
//!
//! Requests leave the bucket one every `T = unit / rpu` (100 ms for 10 per second). A
//! request that arrives while the bucket is idle passes at once; one that arrives while
//! earlier requests are still leaving waits for its turn (the filter pauses it for
//! [`Verdict::delay`]). At most `burst` requests wait; one more is rejected at once. So the
//! upstream never sees more than one request per `T`, however bursty the clients are —
//! the seed's "smooth, never faster than the rate".
//!
//! The bucket is one number, `next_free`: the instant the next request may leave. On
//! arrival at `now`, `start = max(now, next_free)` and `wait = start − now`; the request's
//! place in the queue is `k = ceil(wait / T)` (0 = passes at once). It is admitted iff
//! `k ≤ burst`, and then `next_free = start + T`. When idle, 1 passes at once, `burst` more
//! wait `T, 2T, …, burst·T`, and the next is rejected. A lease (`want > 1`) takes as many
//! consecutive turns as fit; its delay is that of the first.
//!
//! `T` is rarely a whole number of nanoseconds (a third of a second), so time is kept
//! multiplied by `rpu`: `T` is then exactly `unit` nanoseconds and nothing drifts, even over
//! years. State, two words: `next_free × rpu` as a 128-bit number, high word first. All
//! zeros is "next free at the epoch", an empty bucket.
//!
//! Giving a turn back ([`Algorithm::release`], when another rule of the request denied it)
//! is exact while the turn is the last one reserved: `next_free` moves back. Once a later
//! request has queued behind it, moving `next_free` back would let two requests leave in
//! one interval, so the turn stays reserved and passes unused — the bucket stays smooth.
//! Debts ([`Algorithm::charge_debt`]) do not apply: a leaky bucket paces requests, it does
//! not count their cost after the fact.
//!
//! Clock going backwards: the queue simply looks longer, and requests wait or are rejected
//! until the clock catches up. A `next_free` beyond the longest possible queue plus one
//! unit cannot come from a clock step and is treated as garbage (fresh), as is a state
//! shorter than two words.

use super::common::Scaled;
use super::{Algorithm, Limit, Mark, Verdict};
use crate::time::{Instant, Nanos, Unit};
use std::num::NonZeroU32;

/// The leaky-bucket algorithm (`LB`). See the module documentation.
#[derive(Debug)]
pub struct LeakyBucket;

/// `start = max(next_free, now)` from the state; garbage and short states read as an empty
/// bucket.
fn start(s: Scaled, state: &[u64]) -> u128 {
    // The longest possible queue, `(burst + 1)·T`, plus one unit of clock step.
    s.stored_or_now(state, s.capacity() + s.interval)
}

impl Algorithm for LeakyBucket {
    fn code(&self) -> &'static str {
        "LB"
    }

    fn aliases(&self) -> &'static [&'static str] {
        &["lb", "leaky bucket", "leaky_bucket", "leaky"]
    }

    /// As many as leave in one second, at least 1.
    fn default_burst(&self, rpu: NonZeroU32, unit: Unit) -> NonZeroU32 {
        let per_second = u64::from(rpu.get()) / unit.seconds();
        u32::try_from(per_second)
            .ok()
            .and_then(NonZeroU32::new)
            .unwrap_or(NonZeroU32::MIN)
    }

    fn state_words(&self, _limit: &Limit) -> usize {
        2
    }

    fn capacity(&self, limit: &Limit) -> u64 {
        u64::from(limit.burst.get()) + 1
    }

    fn waits(&self) -> bool {
        true
    }

    fn allows_debt(&self) -> bool {
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
        let s = Scaled::new(limit, now);
        let start = start(s, state);
        let wait = start - s.now;
        // This request's place in the queue: 0 passes at once.
        let place = wait.div_ceil(s.interval);
        // Turns still free right now: places `place..=burst`.
        let free = (s.burst + 1).saturating_sub(place);
        let need = u128::from(need.clamp(1, want.max(1)));
        let grantable = if want > 0 && free >= need { free } else { 0 };
        let (granted, next_free) = s.take(state, start, want, grantable);
        Verdict {
            granted: u32::try_from(granted).unwrap_or(0),
            remaining: u64::try_from(free - granted).unwrap_or(u64::MAX),
            reset: s.to_nanos(next_free - s.now),
            // Short: `need` turns are free once the wait is down to (burst + 1 − need)·T.
            retry_after: if granted > 0 || want == 0 {
                Nanos::ZERO
            } else {
                s.to_nanos(wait.saturating_sub((s.burst + 1).saturating_sub(need) * s.interval))
                    .max(Nanos::new(1))
            },
            delay: if granted > 0 {
                s.to_nanos(wait)
            } else {
                Nanos::ZERO
            },
            mark: Mark(next_free),
        }
    }

    fn release(&self, limit: &Limit, state: &mut [u64], now: Instant, tokens: u32, mark: Mark) {
        let s = Scaled::new(limit, now);
        if super::common::load(state) == Some(mark.0) {
            // Still the last turn reserved.
            let back = mark.0.saturating_sub(u128::from(tokens) * s.interval);
            super::common::store(state, back);
        }
    }

    fn charge_debt(
        &self,
        _limit: &Limit,
        _state: &mut [u64],
        _now: Instant,
        _tokens: u32,
    ) -> Verdict {
        Verdict::default()
    }

    fn is_idle(&self, limit: &Limit, state: &[u64], now: Instant) -> bool {
        let s = Scaled::new(limit, now);
        start(s, state) == s.now
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::common::load;
    use crate::algo::common::testing::{self, at, S};

    fn limit(rpu: u32, unit: Unit, burst: Option<u32>) -> Limit {
        testing::limit(&LeakyBucket, rpu, unit, burst, 10)
    }

    /// `(now, want, granted, remaining, reset, retry_after, delay)`.
    type Step = (u64, u32, u32, u64, u64, u64, u64);

    fn run(limit: &Limit, state: &mut [u64], steps: &[Step]) {
        for (i, &(now, want, granted, remaining, reset, retry_after, delay)) in
            steps.iter().enumerate()
        {
            let expected = Verdict {
                granted,
                remaining,
                reset: Nanos::new(reset),
                retry_after: Nanos::new(retry_after),
                delay: Nanos::new(delay),
                ..Verdict::default()
            };
            testing::check(&LeakyBucket, limit, state, i, at(now), want, expected);
        }
    }

    #[test]
    fn names_and_default_burst() {
        assert_eq!(LeakyBucket.code(), "LB");
        assert!(LeakyBucket.aliases().contains(&"leaky bucket"));
        let burst = |rpu, unit| {
            LeakyBucket
                .default_burst(NonZeroU32::new(rpu).unwrap(), unit)
                .get()
        };
        assert_eq!(burst(10, Unit::Second), 10);
        assert_eq!(burst(u32::MAX, Unit::Second), u32::MAX);
        assert_eq!(burst(600, Unit::Minute), 10);
        assert_eq!(burst(59, Unit::Minute), 1);
        assert_eq!(burst(100, Unit::Day), 1);
        assert_eq!(burst(u32::MAX, Unit::Day), 49_710);
    }

    #[test]
    fn simultaneous_requests_are_spaced_and_the_one_past_burst_is_rejected() {
        // 10 per second, burst 10: T = 100 ms.
        let l = limit(10, Unit::Second, None);
        let t = S / 10;
        let t0 = 1_700_000_000 * S;
        let mut state = [0u64; 2];
        let mut steps: Vec<Step> = (0..=10)
            .map(|k| (t0, 1, 1, 10 - k, (k + 1) * t, 0, k * t))
            .collect();
        // The 12th: rejected at once, a turn frees in T.
        steps.push((t0, 1, 0, 0, 11 * t, t, 0));
        // One ns before that turn: still rejected.
        steps.push((t0 + t - 1, 1, 0, 0, 10 * t + 1, 1, 0));
        // At it: admitted at the back of the queue.
        steps.push((t0 + t, 1, 1, 0, 11 * t, 0, 10 * t));
        run(&l, &mut state, &steps);
        // Once the queue has drained, the bucket is idle and the next passes at once.
        assert!(!LeakyBucket.is_idle(&l, &state, at(t0 + 12 * t - 1)));
        assert!(LeakyBucket.is_idle(&l, &state, at(t0 + 12 * t)));
        run(&l, &mut state, &[(t0 + 12 * t, 1, 1, 10, t, 0, 0)]);
    }

    #[test]
    fn fractional_interval_is_exact() {
        // 3 per second: T = 333,333,333.33 ns; burst 3.
        let l = limit(3, Unit::Second, None);
        let mut state = [0u64; 2];
        let t0 = 5 * S;
        run(
            &l,
            &mut state,
            &[
                (t0, 1, 1, 3, 333_333_334, 0, 0),
                (t0, 1, 1, 2, 666_666_667, 0, 333_333_334),
                (t0, 1, 1, 1, S, 0, 666_666_667),
                (t0, 1, 1, 0, 1_333_333_334, 0, S),
                (t0, 1, 0, 0, 1_333_333_334, 333_333_334, 0),
                // 1 ns later the wait is 333,333,333.67 beyond burst·T: still 1 turn away.
                (t0 + 1, 1, 0, 0, 1_333_333_333, 333_333_333, 0),
                (t0 + 333_333_333, 1, 0, 0, S + 1, 1, 0),
                // Admitted at place 3, leaving at t0 + ceil(4T) = t0 + 1,333,333,334.
                (t0 + 333_333_334, 1, 1, 0, 1_333_333_333, 0, S),
            ],
        );
        assert_eq!(load(&state), Some(u128::from(t0) * 3 + 5 * u128::from(S)));
    }

    #[test]
    fn steady_queue_does_not_drift_over_a_million_seconds() {
        // The queue is kept full: each newcomer arrives when a turn frees (retry_after) and
        // its departure must be exactly t0 + ceil(j·T).
        let l = limit(3, Unit::Second, Some(2));
        let mut state = [0u64; 2];
        let t0 = 1_600_000_000 * S;
        let mut now = t0;
        let mut j: u64 = 0;
        while now < t0 + 1_000_000 * S {
            let verdict = LeakyBucket.acquire(&l, &mut state, at(now), 1);
            if verdict.granted == 1 {
                assert_eq!(
                    now + verdict.delay.get(),
                    t0 + (j * S).div_ceil(3),
                    "departure {j}"
                );
                j += 1;
            } else {
                now += verdict.retry_after.get();
            }
        }
        // Departure j is admitted (at place 2) from t0 + ceil((j - 2)·T): the last arrival
        // before t0 + 1e6 s is j = 3,000,001.
        assert_eq!(j, 3_000_002);
    }

    #[test]
    fn hour_and_day_units() {
        // 2 per hour: T = 30 min, burst 1.
        let m = 60 * S;
        let l = limit(2, Unit::Hour, None);
        let mut state = [0u64; 2];
        let t0 = 1_700_000_000 * S;
        run(
            &l,
            &mut state,
            &[
                (t0, 1, 1, 1, 30 * m, 0, 0),
                (t0 + m, 1, 1, 0, 59 * m, 0, 29 * m),
                (t0 + 2 * m, 1, 0, 0, 58 * m, 28 * m, 0),
                (t0 + 30 * m, 1, 1, 0, 60 * m, 0, 30 * m),
            ],
        );
        // 3 per day: T = 8 h; burst 2.
        let h = 60 * m;
        let l = limit(3, Unit::Day, Some(2));
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (t0, 5, 3, 0, 24 * h, 0, 0),
                (t0 + 8 * h - 1, 1, 0, 0, 16 * h + 1, 1, 0),
                (t0 + 8 * h, 1, 1, 0, 24 * h, 0, 16 * h),
            ],
        );
    }

    #[test]
    fn long_idle_gap_empties_the_queue() {
        let l = limit(1, Unit::Minute, Some(5));
        let mut state = [0u64; 2];
        let t0 = 1_700_000_000 * S;
        for _ in 0..6 {
            assert_eq!(LeakyBucket.acquire(&l, &mut state, at(t0), 1).granted, 1);
        }
        assert_eq!(LeakyBucket.acquire(&l, &mut state, at(t0), 1).granted, 0);
        let later = t0 + 10 * 86_400 * S;
        assert!(LeakyBucket.is_idle(&l, &state, at(later)));
        run(&l, &mut state, &[(later, 1, 1, 5, 60 * S, 0, 0)]);
    }

    #[test]
    fn lease_takes_consecutive_turns() {
        // 4 per second: T = 250 ms, burst 4 (five turns when idle).
        let q = S / 4;
        let l = limit(4, Unit::Second, None);
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (0, 3, 3, 2, 3 * q, 0, 0),
                // want = 0: a read-only probe.
                (0, 0, 0, 2, 3 * q, 0, 0),
                (0, 3, 2, 0, 5 * q, 0, 3 * q),
                (0, 3, 0, 0, 5 * q, q, 0),
                (q, 3, 1, 0, 5 * q, 0, 4 * q),
            ],
        );
    }

    #[test]
    fn clock_backwards_makes_the_queue_look_longer() {
        let l = limit(10, Unit::Second, Some(2));
        let t = S / 10;
        let t0 = 100 * S;
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (t0, 1, 1, 2, t, 0, 0),
                // Half a T earlier: the first waits 1.5 T (place 2).
                (t0 - t / 2, 1, 1, 0, 2 * t + t / 2, 0, t + t / 2),
                (t0 - t / 2, 1, 0, 0, 2 * t + t / 2, t / 2, 0),
                // Five seconds back (more than one unit): read as garbage, fresh.
                (t0 - 5 * S, 1, 1, 2, t, 0, 0),
            ],
        );
    }

    #[test]
    fn rpu_one_and_large_rpu() {
        let l = limit(1, Unit::Second, None);
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (7, 1, 1, 1, S, 0, 0),
                (7, 1, 1, 0, 2 * S, 0, S),
                (8, 1, 0, 0, 2 * S - 1, S - 1, 0),
            ],
        );

        let l = limit(u32::MAX, Unit::Second, None);
        let mut state = [0u64; 2];
        let now = u64::MAX - S;
        run(
            &l,
            &mut state,
            &[
                (now, u32::MAX, u32::MAX, 1, S, 0, 0),
                (now, u32::MAX, 1, 0, S + 1, 0, S),
                (now, 1, 0, 0, S + 1, 1, 0),
            ],
        );
        let l = limit(u32::MAX, Unit::Day, Some(u32::MAX));
        let mut state = [0u64; 2];
        for now in [0, S, u64::MAX] {
            let verdict = LeakyBucket.acquire(&l, &mut state, at(now), u32::MAX);
            assert!(verdict.granted > 0 || !verdict.retry_after.is_zero());
        }
    }

    #[test]
    fn garbage_and_short_state_do_not_panic() {
        let l = limit(5, Unit::Second, None);
        let now = 100 * S;
        for len in 0..2 {
            let mut state = vec![u64::MAX; len];
            let verdict = LeakyBucket.acquire(&l, &mut state, at(now), 1);
            assert_eq!(
                (verdict.granted, verdict.delay, verdict.remaining),
                (1, Nanos::ZERO, 5)
            );
            assert!(state.iter().all(|&w| w == u64::MAX));
            assert!(LeakyBucket.is_idle(&l, &state, at(now)));
        }
        let mut state = [u64::MAX, u64::MAX];
        assert!(LeakyBucket.is_idle(&l, &state, at(now)));
        let verdict = LeakyBucket.acquire(&l, &mut state, at(now), 1);
        assert_eq!((verdict.granted, verdict.delay), (1, Nanos::ZERO));
        assert_eq!(load(&state), Some(u128::from(now) * 5 + u128::from(S)));
        for now in [0, 1, u64::MAX] {
            let mut state = [u64::MAX - 1, 3];
            let _ = LeakyBucket.acquire(&l, &mut state, at(now), u32::MAX);
            let _ = LeakyBucket.is_idle(&l, &state, at(now));
        }
    }
}

#[cfg(test)]
mod release_tests {
    use super::*;
    use crate::algo::common::load;
    use crate::algo::common::testing::{self, at, S};

    #[test]
    fn only_the_last_turn_is_given_back() {
        // 10 per second: T = 100 ms.
        let l = testing::limit(&LeakyBucket, 10, Unit::Second, Some(5), 10);
        let t = u128::from(S / 10) * 10;
        let t0 = 100 * S;
        let now = u128::from(t0) * 10;
        let mut state = [0u64; 2];
        let a = LeakyBucket.acquire(&l, &mut state, at(t0), 1);
        let b = LeakyBucket.acquire(&l, &mut state, at(t0), 1);
        assert_eq!(load(&state), Some(now + 2 * t));
        // b is the last turn: given back exactly.
        LeakyBucket.release(&l, &mut state, at(t0), 1, b.mark);
        assert_eq!(load(&state), Some(now + t));
        let b = LeakyBucket.acquire(&l, &mut state, at(t0), 1);
        let c = LeakyBucket.acquire(&l, &mut state, at(t0), 1);
        assert_eq!(
            (b.delay, c.delay),
            (Nanos::new(S / 10), Nanos::new(2 * S / 10))
        );
        // b has c queued behind it: its turn passes unused, c keeps its own.
        LeakyBucket.release(&l, &mut state, at(t0), 1, b.mark);
        assert_eq!(load(&state), Some(now + 3 * t));
        assert_eq!(a.delay, Nanos::ZERO);
    }
}
