//! Sliding window (`SW`): a fixed window that moves forward one slice at a time.
//!
//! The unit is cut into `slices` equal time slices (default 10: a tenth of a second, six
//! seconds of a minute, …), aligned to the Unix epoch. A request is admitted if the
//! requests counted in the last `slices` slices — the current one included — number fewer
//! than `rpu`. So at any moment the limit looks back over (almost exactly) one unit, and
//! unlike the fixed window it never lets `2 × rpu` through across a boundary: no window of
//! one unit whose edges fall on slice boundaries ever holds more than `rpu` admissions.
//! More slices follow the true sliding window more closely, at one state word each.
//!
//! Slice `g` (counted from the epoch) is `floor(now × slices / unit)`, computed exactly in
//! 128 bits, so a unit that does not divide evenly (a second in 3 slices) has slices of
//! 333,333,333 or 333,333,334 ns and never drifts.
//!
//! State, `1 + slices` words: `[head, counts…]`, a ring buffer where `head` is the latest
//! slice written and `counts[g % slices]` holds slice `g` for the `slices` slices ending at
//! `head`. All zeros is "nothing counted". A gap of a whole unit or more clears everything.
//!
//! Clock going backwards (another worker slightly behind, an NTP step): requests are
//! counted in the head slice, never in an earlier one. A head more than one unit ahead of
//! the clock cannot come from such a step and is treated as garbage (fresh), as is a state
//! shorter than `1 + slices` words; counts are added with saturation.
//!
//! A response cost charged past the limit ([`Algorithm::charge_debt`]) is counted in the
//! current slice like any request: the window stays over its limit until that slice has
//! left it.

use super::{Algorithm, Limit, Mark, Verdict};
use crate::time::{Instant, Nanos, Unit};
use std::num::NonZeroU32;

/// The sliding-window algorithm (`SW`). See the module documentation.
#[derive(Debug)]
pub struct SlidingWindow;

/// The slice geometry of one limit.
#[derive(Debug, Clone, Copy)]
struct Slices {
    unit_ns: u64,
    /// Slices per unit, at least 1.
    n: u64,
}

impl Slices {
    fn of(limit: &Limit) -> Self {
        Slices {
            unit_ns: limit.unit.nanos().get(),
            n: u64::from(limit.slices.get()),
        }
    }

    /// The slice `now` falls in, counted from the epoch.
    fn index(self, now: Instant) -> u64 {
        let index = u128::from(now.unix_nanos()) * u128::from(self.n) / u128::from(self.unit_ns);
        u64::try_from(index).unwrap_or(u64::MAX)
    }

    /// The first nanosecond of slice `g` (which may lie beyond `u64`).
    fn start(self, g: u128) -> u128 {
        (g * u128::from(self.unit_ns)).div_ceil(u128::from(self.n))
    }

    /// Nanoseconds from `now` until slice `g` has left the window, i.e. until slice
    /// `g + slices` begins.
    fn until_expired(self, g: u64, now: Instant) -> Nanos {
        let end = self.start(u128::from(g) + u128::from(self.n));
        Nanos::new(
            u64::try_from(end.saturating_sub(u128::from(now.unix_nanos()))).unwrap_or(u64::MAX),
        )
    }

    /// Position of slice `g` in the ring.
    fn slot(self, g: u64) -> Option<usize> {
        usize::try_from(g % self.n).ok()
    }
}

/// The state as seen at one instant.
#[derive(Debug)]
struct View<'a> {
    slices: Slices,
    /// The ring, `n` words; `None` when the stored state is unusable (short or garbage),
    /// which reads as all zeros.
    ring: Option<&'a [u64]>,
    /// The stored head slice (or the current slice when `ring` is `None`).
    head: u64,
    /// The slice new requests are counted in: the later of the head and the clock's slice.
    effective: u64,
}

impl<'a> View<'a> {
    fn new(limit: &Limit, state: &'a [u64], now: Instant) -> Self {
        let slices = Slices::of(limit);
        let current = slices.index(now);
        let stored = state.split_first().and_then(|(&head, ring)| {
            let ring = ring.get(..usize::try_from(slices.n).ok()?)?;
            // Ahead by more than one unit: no clock step explains it, garbage.
            (head <= current.saturating_add(slices.n)).then_some((head, ring))
        });
        match stored {
            Some((head, ring)) => View {
                slices,
                ring: Some(ring),
                head,
                effective: head.max(current),
            },
            None => View {
                slices,
                ring: None,
                head: current,
                effective: current,
            },
        }
    }

    fn position(&self) -> Position {
        Position {
            slices: self.slices,
            head: self.head,
            effective: self.effective,
            usable: self.ring.is_some(),
        }
    }

    /// The oldest slice still inside the window ending at `effective`.
    fn oldest(&self) -> u64 {
        self.effective.saturating_sub(self.slices.n - 1)
    }

    /// `(slice, count)` for every stored slice still inside the window, oldest first.
    fn counted(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let ring = self.ring;
        let slices = self.slices;
        // Empty when the head has left the window (a gap of a whole unit or more).
        (self.oldest()..=self.head).filter_map(move |g| {
            let count = ring?.get(slices.slot(g)?).copied()?;
            Some((g, count))
        })
    }

    fn sum(&self) -> u64 {
        self.counted()
            .fold(0, |sum, (_, count)| sum.saturating_add(count))
    }
}

impl Algorithm for SlidingWindow {
    fn code(&self) -> &'static str {
        "SW"
    }

    fn aliases(&self) -> &'static [&'static str] {
        &["sw", "sliding window", "sliding_window", "sliding"]
    }

    /// Unused by this algorithm; `rpu` so that the resolved rule reads sensibly.
    fn default_burst(&self, rpu: NonZeroU32, _unit: Unit) -> NonZeroU32 {
        rpu
    }

    fn state_words(&self, limit: &Limit) -> usize {
        usize::try_from(limit.slices.get())
            .unwrap_or(usize::MAX)
            .saturating_add(1)
    }

    fn capacity(&self, limit: &Limit) -> u64 {
        u64::from(limit.rpu.get())
    }

    fn acquire_at_least(
        &self,
        limit: &Limit,
        state: &mut [u64],
        now: Instant,
        need: u32,
        want: u32,
    ) -> Verdict {
        let rpu = u64::from(limit.rpu.get());
        let view = View::new(limit, state, now);
        let slices = view.slices;
        let sum = view.sum();
        let available = rpu.saturating_sub(sum);
        let need = u64::from(need.clamp(1, want.max(1)));
        let granted = if want > 0 && available >= need {
            u64::from(want).min(available)
        } else {
            0
        };
        let remaining = available - granted;

        // Time until the newest counted slice expires.
        let newest = if granted > 0 {
            Some(view.effective)
        } else {
            view.counted()
                .filter(|&(_, count)| count > 0)
                .map(|(g, _)| g)
                .last()
        };
        let reset = newest.map_or(Nanos::ZERO, |g| slices.until_expired(g, now));

        // When not enough is available: expire the oldest slices until `need` fit.
        let retry_after = if granted > 0 || want == 0 {
            Nanos::ZERO
        } else {
            let must_free = sum.saturating_add(need).saturating_sub(rpu);
            let mut freed = 0u64;
            view.counted()
                .find(|&(_, count)| {
                    freed = freed.saturating_add(count);
                    freed >= must_free
                })
                .map_or(reset, |(g, _)| slices.until_expired(g, now))
                .max(Nanos::new(1))
        };

        let mark = Mark(u128::from(view.effective));
        if granted > 0 {
            let at = view.position();
            record(at, state, granted);
        }

        Verdict {
            granted: u32::try_from(granted).unwrap_or(0),
            remaining,
            reset,
            retry_after,
            delay: Nanos::ZERO,
            mark,
        }
    }

    /// Tokens counted in a slice may be spent only while it lasts: counted in an earlier
    /// slice, they would leave the window before the requests they admitted.
    fn lease_until(&self, limit: &Limit, mark: Mark, now: Instant) -> Instant {
        let slices = Slices::of(limit);
        let end = slices.start(mark.0.saturating_add(1));
        Instant::from_unix_nanos(u64::try_from(end).unwrap_or(u64::MAX)).max(now)
    }

    fn release(&self, limit: &Limit, state: &mut [u64], now: Instant, tokens: u32, mark: Mark) {
        let view = View::new(limit, state, now);
        let Ok(slice) = u64::try_from(mark.0) else {
            return;
        };
        if view.ring.is_none() || slice < view.oldest() || slice > view.head {
            // The slice has left the window (its tokens are gone) or was never stored.
            return;
        }
        let Some(position) = view.slices.slot(slice) else {
            return;
        };

        if let Some(count) = state.get_mut(1 + position) {
            *count = count.saturating_sub(u64::from(tokens));
        }
    }

    fn charge_debt(&self, limit: &Limit, state: &mut [u64], now: Instant, tokens: u32) -> Verdict {
        let rpu = u64::from(limit.rpu.get());
        let view = View::new(limit, state, now);
        let sum = view.sum().saturating_add(u64::from(tokens));
        let reset = view.slices.until_expired(view.effective, now);
        let mark = Mark(u128::from(view.effective));
        let at = view.position();
        record(at, state, u64::from(tokens));
        let after = View::new(limit, state, now);
        // The debt is paid when enough of the oldest slices have left the window.
        let must_free = sum.saturating_add(1).saturating_sub(rpu);
        let mut freed = 0u64;
        let retry_after = if sum < rpu {
            Nanos::ZERO
        } else {
            after
                .counted()
                .find(|&(_, count)| {
                    freed = freed.saturating_add(count);
                    freed >= must_free
                })
                .map_or(reset, |(g, _)| after.slices.until_expired(g, now))
                .max(Nanos::new(1))
        };
        Verdict {
            remaining: rpu.saturating_sub(sum),
            reset,
            retry_after,
            mark,
            ..Verdict::default()
        }
    }

    fn is_idle(&self, limit: &Limit, state: &[u64], now: Instant) -> bool {
        View::new(limit, state, now)
            .counted()
            .all(|(_, count)| count == 0)
    }
}

/// Where a [`View`] stands, without its borrow of the state.
#[derive(Debug, Clone, Copy)]
struct Position {
    slices: Slices,
    head: u64,
    effective: u64,
    /// False when the stored ring was read as fresh.
    usable: bool,
}

/// Counts `granted` tokens in the view's effective slice, first advancing the ring from
/// its head (clearing the slices that left the window). A ring read as fresh is cleared
/// entirely. A state too short to hold the ring is left alone.
fn record(at: Position, state: &mut [u64], granted: u64) {
    let Position {
        slices,
        head,
        effective,
        usable,
    } = at;
    let Some((head_word, ring)) = state.split_first_mut() else {
        return;
    };
    let Some(ring) = usize::try_from(slices.n)
        .ok()
        .and_then(|n| ring.get_mut(..n))
    else {
        return;
    };
    if !usable || effective - head >= slices.n {
        ring.fill(0);
    } else {
        // The slices after the head up to the effective one start empty.
        for g in (head..=effective).skip(1) {
            if let Some(count) = slices.slot(g).and_then(|slot| ring.get_mut(slot)) {
                *count = 0;
            }
        }
    }
    if let Some(count) = slices.slot(effective).and_then(|slot| ring.get_mut(slot)) {
        *count = count.saturating_add(granted);
    }
    *head_word = effective;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::common::testing::{self, at, Step, S};

    fn limit(rpu: u32, unit: Unit, slices: u32) -> Limit {
        testing::limit(&SlidingWindow, rpu, unit, None, slices)
    }

    fn fresh(limit: &Limit) -> Vec<u64> {
        vec![0; SlidingWindow.state_words(limit)]
    }

    fn run(limit: &Limit, state: &mut [u64], steps: &[Step]) {
        testing::run(&SlidingWindow, limit, state, steps);
    }

    #[test]
    fn names_and_words() {
        assert_eq!(SlidingWindow.code(), "SW");
        assert!(SlidingWindow.aliases().contains(&"sliding"));
        assert_eq!(SlidingWindow.state_words(&limit(5, Unit::Second, 10)), 11);
        assert_eq!(SlidingWindow.state_words(&limit(5, Unit::Second, 1)), 2);
    }

    #[test]
    fn slides_slice_by_slice() {
        // 4 per second, 4 slices of 250 ms.
        let l = limit(4, Unit::Second, 4);
        let q = S / 4;
        let t0 = 1_000 * S; // slice 4000
        let mut state = fresh(&l);
        run(
            &l,
            &mut state,
            &[
                // Slice 4000: 2 requests; they leave the window when slice 4004 begins.
                (t0, 1, 1, 3, S, 0),
                (t0 + 1, 1, 1, 2, S - 1, 0),
                // Slice 4001: 1; slice 4002: 1 (full).
                (t0 + q, 1, 1, 1, S, 0),
                (t0 + 2 * q + 7, 1, 1, 0, S - 7, 0),
                // Full: one request is free when slice 4000 leaves (t0 + S).
                (t0 + 2 * q + 8, 1, 0, 0, S - 8, 2 * q - 8),
                (t0 + S - 1, 1, 0, 0, 2 * q + 1, 1),
                // Last ns of slice 4003 / first of 4004: 2 free now.
                (t0 + S, 1, 1, 1, S, 0),
                (t0 + S, 1, 1, 0, S, 0),
                // Full again: next free when slice 4001 leaves.
                (t0 + S, 1, 0, 0, S, q),
                (t0 + S + q, 2, 1, 0, S, 0),
            ],
        );
        assert_eq!(state, vec![4005, 2, 1, 1, 0]);
    }

    #[test]
    fn uneven_slices_are_exact() {
        // One second in 3 slices: starts at 0, 333_333_334, 666_666_667, 1e9.
        let l = limit(1, Unit::Second, 3);
        let mut state = fresh(&l);
        let t0 = 7 * S; // slice 21
        run(
            &l,
            &mut state,
            &[
                // Slice 21 leaves when slice 24 (= 8 s) begins.
                (t0 + 333_333_333, 1, 1, 0, S - 333_333_333, 0),
                (t0 + 333_333_334, 1, 0, 0, S - 333_333_334, S - 333_333_334),
                (t0 + S - 1, 1, 0, 0, 1, 1),
                // Slice 24: free; it leaves when slice 27 begins at 9 s.
                (t0 + S, 1, 1, 0, S, 0),
                // Slice 25 starts at 8.333333334 s.
                (
                    t0 + S + 333_333_334,
                    1,
                    0,
                    0,
                    S - 333_333_334,
                    S - 333_333_334,
                ),
            ],
        );
        // Slice 22 (1 ns into it) expires with slice 25 at 8.333333334 s.
        let mut state = fresh(&l);
        run(
            &l,
            &mut state,
            &[
                (t0 + 333_333_334, 1, 1, 0, S, 0),
                (t0 + S, 1, 0, 0, 333_333_334, 333_333_334),
            ],
        );
        // Slice 23 starts at 7.666666667 s and expires at 8.666666667 s.
        let mut state = fresh(&l);
        run(
            &l,
            &mut state,
            &[
                (t0 + 666_666_667, 1, 1, 0, S, 0),
                (t0 + 666_666_666 + S, 1, 0, 0, 1, 1),
            ],
        );
        assert_eq!(
            SlidingWindow
                .acquire(&l, &mut state, at(t0 + 666_666_667 + S), 1)
                .granted,
            1
        );
    }

    #[test]
    fn hour_and_day_units() {
        // 3 per hour in 6 slices of 10 minutes.
        let l = limit(3, Unit::Hour, 6);
        let m = 60 * S;
        let h = 60 * m;
        let t0 = 1_700_000_000 * S; // 22:13:20, slice 22:10-22:20
        let slice_end = t0 + 6 * m + 40 * S;
        let mut state = fresh(&l);
        run(
            &l,
            &mut state,
            &[
                (t0, 2, 2, 1, slice_end + 50 * m - t0, 0),
                (t0 + 30 * m, 1, 1, 0, slice_end + 80 * m - t0 - 30 * m, 0),
                (
                    t0 + 40 * m,
                    1,
                    0,
                    0,
                    slice_end - t0 + 40 * m,
                    slice_end - t0 + 10 * m,
                ),
                // 23:10: the first slice has left, two free.
                (slice_end + 50 * m, 5, 2, 0, 60 * m, 0),
            ],
        );
        // 1 per day in 24 slices of one hour: the next request is allowed 24 hours on,
        // at the start of the slice, not at midnight.
        let l = limit(1, Unit::Day, 24);
        let mut state = fresh(&l);
        let t = 19_000 * 86_400 * S + 5 * h + 17; // 05:00:00.000000017
        run(
            &l,
            &mut state,
            &[
                (t, 1, 1, 0, 24 * h - 17, 0),
                (t + 23 * h, 1, 0, 0, h - 17, h - 17),
            ],
        );
        assert_eq!(
            SlidingWindow
                .acquire(&l, &mut state, at(t + 24 * h - 17), 1)
                .granted,
            1
        );
    }

    #[test]
    fn long_idle_gap_clears_everything() {
        let l = limit(5, Unit::Minute, 10);
        let mut state = fresh(&l);
        let t0 = 1_700_000_000 * S;
        for _ in 0..5 {
            assert_eq!(SlidingWindow.acquire(&l, &mut state, at(t0), 1).granted, 1);
        }
        // t0 is 2 s into a 6 s slice, which leaves the window 58 s after t0.
        assert!(!SlidingWindow.is_idle(&l, &state, at(t0 + 58 * S - 1)));
        assert!(SlidingWindow.is_idle(&l, &state, at(t0 + 58 * S)));
        let later = t0 + 3 * 86_400 * S;
        assert!(SlidingWindow.is_idle(&l, &state, at(later)));
        let verdict = SlidingWindow.acquire(&l, &mut state, at(later), 1);
        assert_eq!((verdict.granted, verdict.remaining), (1, 4));
        let head = later / (6 * S);
        let mut expected = vec![0u64; 11];
        expected[0] = head;
        expected[1 + usize::try_from(head % 10).unwrap()] = 1;
        assert_eq!(state, expected);
        // Exactly one unit later the slice has expired; one ns earlier it has not.
        let slice_start = head * 6 * S;
        assert!(!SlidingWindow.is_idle(&l, &state, at(slice_start + 60 * S - 1)));
        assert!(SlidingWindow.is_idle(&l, &state, at(slice_start + 60 * S)));
    }

    #[test]
    fn lease_and_probe() {
        let l = limit(10, Unit::Second, 5);
        let mut state = fresh(&l);
        run(
            &l,
            &mut state,
            &[
                (0, 4, 4, 6, S, 0),
                (S / 5, 4, 4, 2, S, 0),
                (S / 5, 4, 2, 0, S, 0),
                // Freeing one needs slice 0 (4 requests) to leave.
                (S / 5, 4, 0, 0, S, 4 * S / 5),
                // want = 0: a read-only probe.
                (S, 0, 0, 4, S / 5, 0),
                (S, 5, 4, 0, S, 0),
            ],
        );
    }

    #[test]
    fn clock_backwards_counts_in_the_head_slice() {
        let l = limit(2, Unit::Second, 10);
        let d = S / 10;
        let t0 = 50 * S; // slice 500
        let mut state = fresh(&l);
        run(
            &l,
            &mut state,
            &[
                (t0 + 3 * d, 1, 1, 1, S, 0),
                // Half a second back: counted in slice 503, which leaves at t0 + 1.3 s.
                (t0 - 2 * d, 1, 1, 0, S + 5 * d, 0),
                (t0 - 2 * d, 1, 0, 0, S + 5 * d, S + 5 * d),
            ],
        );
        assert_eq!(state[0], 503);
        assert_eq!(state[4], 2);
        assert!(!SlidingWindow.is_idle(&l, &state, at(t0 - 2 * d)));
        assert!(SlidingWindow.is_idle(&l, &state, at(t0 + 13 * d)));
    }

    #[test]
    fn rpu_one_and_large_rpu() {
        let l = limit(1, Unit::Second, 10);
        let mut state = fresh(&l);
        run(
            &l,
            &mut state,
            &[(S, 1, 1, 0, S, 0), (S + 1, 1, 0, 0, S - 1, S - 1)],
        );

        let l = limit(u32::MAX, Unit::Day, 24);
        let max = u64::from(u32::MAX);
        let mut state = fresh(&l);
        let day = 86_400 * S;
        let now = 20_000 * day;
        run(
            &l,
            &mut state,
            &[
                (now, u32::MAX - 1, u32::MAX - 1, 1, day, 0),
                (now + 1, u32::MAX, 1, 0, day - 1, 0),
                (now + 2, 1, 0, 0, day - 2, day - 2),
            ],
        );
        assert_eq!(state[1..].iter().sum::<u64>(), max);
        // Far in the future: a slice index near u64::MAX must not overflow.
        let mut state = fresh(&l);
        for now in [u64::MAX - 1, u64::MAX] {
            let verdict = SlidingWindow.acquire(&l, &mut state, at(now), 1);
            assert_eq!(verdict.granted, 1);
        }
    }

    #[test]
    fn garbage_and_short_state_do_not_panic() {
        let l = limit(3, Unit::Second, 4);
        let now = 100 * S;
        for len in 0..5 {
            let mut state = vec![u64::MAX; len];
            let verdict = SlidingWindow.acquire(&l, &mut state, at(now), 1);
            assert_eq!((verdict.granted, verdict.remaining), (1, 2));
            assert!(state.iter().all(|&w| w == u64::MAX), "short state written");
            assert!(SlidingWindow.is_idle(&l, &state, at(now)));
        }
        // Head far ahead: garbage, read as fresh and rewritten.
        let mut state = vec![u64::MAX; 5];
        assert!(SlidingWindow.is_idle(&l, &state, at(now)));
        assert_eq!(SlidingWindow.acquire(&l, &mut state, at(now), 1).granted, 1);
        assert_eq!(state, vec![400, 1, 0, 0, 0]);
        // Huge counts saturate and read as full.
        let mut state = vec![400, u64::MAX, u64::MAX, u64::MAX, u64::MAX];
        let verdict = SlidingWindow.acquire(&l, &mut state, at(now), 1);
        assert_eq!(verdict.granted, 0);
        assert!(!verdict.retry_after.is_zero());
        // A longer slice than needed is fine; extra words are left alone.
        let mut state = vec![0u64; 7];
        state[6] = 99;
        assert_eq!(SlidingWindow.acquire(&l, &mut state, at(now), 1).granted, 1);
        assert_eq!(state[6], 99);
        for now in [0, 1, u64::MAX] {
            let mut state = vec![u64::MAX - 1; 5];
            let _ = SlidingWindow.acquire(&l, &mut state, at(now), u32::MAX);
            let _ = SlidingWindow.is_idle(&l, &state, at(now));
        }
    }

    /// A tiny deterministic generator (xorshift64).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// Against a brute-force model: identical decisions, and never more than rpu in any
    /// window of `slices` consecutive slices.
    #[test]
    fn matches_brute_force_and_never_exceeds_rpu() {
        for (rpu, slices, seed) in [
            (5u32, 10u32, 1u64),
            (1, 3, 2),
            (7, 7, 3),
            (3, 1, 4),
            (20, 6, 5),
        ] {
            let l = limit(rpu, Unit::Second, slices);
            let geometry = Slices::of(&l);
            let mut state = fresh(&l);
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let mut admitted: Vec<(u64, u64)> = Vec::new(); // (slice, count)
            let mut now = 1_000 * S + rng.next() % S;
            for _ in 0..5_000 {
                // Mostly small steps, sometimes a long gap.
                now += match rng.next() % 20 {
                    0 => rng.next() % (3 * S),
                    1..=3 => 0,
                    _ => rng.next() % (S / 20),
                };
                let want = u32::try_from(rng.next() % 3).unwrap() + 1;
                let g = geometry.index(at(now));
                let n = u64::from(slices);
                let sum: u64 = admitted
                    .iter()
                    .rev()
                    .take_while(|(s, _)| s + n > g)
                    .map(|(_, c)| c)
                    .sum();
                let expected = u64::from(want).min(u64::from(rpu).saturating_sub(sum));
                let verdict = SlidingWindow.acquire(&l, &mut state, at(now), want);
                assert_eq!(u64::from(verdict.granted), expected, "at {now}");
                assert_eq!(verdict.remaining, u64::from(rpu) - sum - expected);
                if verdict.granted == 0 {
                    // Retrying exactly at retry_after succeeds, one ns before does not.
                    let mut probe = state.clone();
                    let then = now + verdict.retry_after.get();
                    assert_eq!(
                        SlidingWindow
                            .acquire(&l, &mut probe, at(then - 1), 1)
                            .granted,
                        0
                    );
                    assert_eq!(
                        SlidingWindow.acquire(&l, &mut probe, at(then), 1).granted,
                        1
                    );
                } else {
                    admitted.push((g, expected));
                }
                // Reset: every counted slice has expired then, not one ns before.
                let then = now + verdict.reset.get();
                assert!(SlidingWindow.is_idle(&l, &state, at(then)));
                if !verdict.reset.is_zero() {
                    assert!(!SlidingWindow.is_idle(&l, &state, at(then - 1)));
                }
            }
            // The fullest window starts at an admitted slice.
            let n = u64::from(slices);
            let mut per_slice = std::collections::BTreeMap::<u64, u64>::new();
            for &(s, c) in &admitted {
                *per_slice.entry(s).or_default() += c;
            }
            assert!(
                per_slice.values().sum::<u64>() > u64::from(rpu) * 10,
                "too few admitted to mean much"
            );
            for &start in per_slice.keys() {
                let in_window: u64 = per_slice.range(start..start + n).map(|(_, c)| c).sum();
                assert!(
                    in_window <= u64::from(rpu),
                    "{in_window} > {rpu} in slices {start}.."
                );
            }
        }
    }
}
