//! Token bucket (`TB`, the default): bursts up to a capacity, a steady rate on average.
//!
//! The bucket holds up to `burst` tokens (default `rpu`) and is refilled continuously at
//! `rpu` tokens per unit — fractions included, so 3 per second gives a token every
//! 333,333,333⅓ ns and exactly 9 over any 3 seconds, with no drift. A request takes one
//! token or is rejected; a lease takes as many as it asked for, or as many as there are.
//! A fresh or long-idle bucket is full, so a client may spend `burst` at once and then
//! `rpu` per unit.
//!
//! It is implemented as GCRA (the generic cell rate algorithm): instead of a token count
//! and a refill timestamp, the state is one instant, the *theoretical arrival time* `tat`
//! at which the bucket will be full again if nothing more is taken. Taking a token pushes
//! `tat` one emission interval `unit / rpu` later; the bucket holds
//! `floor((burst·interval − (max(tat, now) − now)) / interval)` tokens. To keep the
//! fractional interval exact, all instants are multiplied by `rpu`: the interval is then
//! exactly `unit` nanoseconds. State, two words: `tat × rpu` as a 128-bit number, high word
//! first. All zeros is a `tat` at the epoch: a full bucket.
//!
//! A response cost charged past the limit ([`Algorithm::charge_debt`]) pushes `tat` beyond
//! an empty bucket: the bucket owes tokens, and requests are denied until the refill has
//! paid the debt back. The debt is capped at one bucket (`burst` tokens): a cost above that
//! is forgiven, so one huge answer cannot lock an identity out for longer than it takes to
//! refill the bucket twice.
//!
//! With a calendar (`unit: week | month`, [`Limit::calendar`]) the bucket holds `burst`
//! (default `rpu`) and refills `rpu` per period, evenly over each period whatever its real
//! length: a token every `length / rpu` of the period it refills in (2,000,000 a month
//! refills one every 1.21 s in February, 1.34 s in March in Berlin), with no jump at the
//! boundary and no reset at the period's start. It runs on a period clock that advances
//! [`nominal`] per period, `(now − start) × nominal / length` into the period; its waits
//! are turned back into real time through the periods they cross.
//!
//! Clock going backwards: the bucket simply looks emptier until the clock catches up. A
//! `tat` beyond the deepest debt plus one unit cannot come from a clock step and is treated
//! as garbage (a full bucket), as is a state shorter than two words.

use super::common::Scaled;
use super::{Algorithm, Limit, Mark, Verdict};
use crate::calendar::{Calendar, CalendarUnit, Period};
use crate::time::{Instant, Nanos, Unit};
use std::num::NonZeroU32;

/// How long a worker may hold tokens taken from a bucket in one batch.
pub const TOKEN_LEASE: Nanos = Nanos::from_millis(50);

/// The token-bucket algorithm (`TB`). See the module documentation.
#[derive(Debug)]
pub struct TokenBucket;

/// What a calendar period lasts on the period clock: its usual length, so that the state
/// reads in familiar spans (any constant would do).
fn nominal(unit: CalendarUnit) -> Nanos {
    match unit {
        CalendarUnit::Week => Unit::Day.nanos() * 7,
        CalendarUnit::Month => Unit::Day.nanos() * 30,
    }
}

/// The most periods a wait is followed through before the rest is taken at the last one's
/// pace: a bucket of `burst` up to a few times `rpu` empties in a few periods, and every
/// period is one more look-up of the zone's clock.
const PERIODS_FOLLOWED: u32 = 24;

/// A calendar bucket's clock at one instant (see the module documentation).
struct PeriodClock<'a> {
    calendar: &'a Calendar,
    index: u64,
    period: Period,
    nominal: Nanos,
}

impl<'a> PeriodClock<'a> {
    fn at(calendar: &'a Calendar, now: Instant) -> PeriodClock<'a> {
        let (index, period) = calendar.numbered(now);
        PeriodClock {
            calendar,
            index,
            period,
            nominal: nominal(calendar.unit()),
        }
    }

    /// `now` on the period clock: `nominal` per period before this one, and the share of
    /// this one that has passed.
    fn read(&self, now: Instant) -> Instant {
        let nominal = u128::from(self.nominal.get());
        let length = u128::from(self.period.length().get()).max(1);
        let into = u128::from(now.saturating_since(self.period.start).get());
        let at = u128::from(self.index) * nominal + (into * nominal / length).min(nominal);
        Instant::from_unix_nanos(u64::try_from(at).unwrap_or(u64::MAX))
    }

    /// The real time from `now` until the period clock has moved `wait` on from
    /// [`PeriodClock::read`]`(now)`, rounded up: each period it crosses at its own pace.
    fn real(&self, now: Instant, wait: Nanos) -> Nanos {
        if wait.is_zero() {
            return Nanos::ZERO;
        }
        let nominal = u128::from(self.nominal.get());
        let target = u128::from(self.read(now).unix_nanos()) + u128::from(wait.get());
        let mut base = u128::from(self.index) * nominal;
        let mut period = self.period;
        for _ in 0..PERIODS_FOLLOWED {
            if target <= base + nominal || period.end == Instant::from_unix_nanos(u64::MAX) {
                break;
            }
            base += nominal;
            period = self.calendar.period(period.end);
        }
        // Within `period` (or past the last one followed, at its pace).
        let length = u128::from(period.length().get()).max(1);
        let into = (target - base.min(target)) * length;
        let at = u128::from(period.start.unix_nanos()) + into.div_ceil(nominal);
        let wait = at.saturating_sub(u128::from(now.unix_nanos()));
        Nanos::new(u64::try_from(wait).unwrap_or(u64::MAX))
    }

    /// A verdict of the period clock in real time.
    fn verdict(&self, now: Instant, verdict: Verdict) -> Verdict {
        Verdict {
            reset: self.real(now, verdict.reset),
            retry_after: self.real(now, verdict.retry_after),
            ..verdict
        }
    }
}

/// A limit's rate and the time its bucket runs on: `now` for a fixed unit, the period
/// clock for a calendar.
fn clocked<'a>(limit: &'a Limit, now: Instant) -> (Scaled, Option<PeriodClock<'a>>) {
    match &limit.calendar {
        // A period a gateway named: `rpu` per its length, in real time (the periods
        // around it are taken to be as long; the next call names the next one).
        None => match limit.period {
            Some(period) => (
                Scaled::per(limit, Nanos::new(period.length.get().max(1)), now),
                None,
            ),
            None => (Scaled::new(limit, now), None),
        },
        Some(calendar) => {
            let clock = PeriodClock::at(calendar, now);
            (
                Scaled::per(limit, clock.nominal, clock.read(now)),
                Some(clock),
            )
        }
    }
}

/// `verdict` in real time (a fixed unit's already is).
fn in_real_time(clock: Option<PeriodClock<'_>>, now: Instant, verdict: Verdict) -> Verdict {
    match clock {
        None => verdict,
        Some(clock) => clock.verdict(now, verdict),
    }
}

/// `max(tat, now)` from the state; garbage and short states read as a full bucket.
fn tat(s: Scaled, state: &[u64]) -> u128 {
    // The deepest debt (an empty bucket owing one more), plus one unit of clock step.
    s.stored_or_now(state, 2 * s.capacity())
}

impl Algorithm for TokenBucket {
    fn code(&self) -> &'static str {
        "TB"
    }

    fn aliases(&self) -> &'static [&'static str] {
        &["tb", "token bucket", "token_bucket", "token"]
    }

    /// One unit's worth of tokens.
    fn default_burst(&self, rpu: NonZeroU32, _unit: Unit) -> NonZeroU32 {
        rpu
    }

    fn state_words(&self, _limit: &Limit) -> usize {
        2
    }

    fn capacity(&self, limit: &Limit) -> u64 {
        u64::from(limit.burst.get())
    }

    fn acquire_at_least(
        &self,
        limit: &Limit,
        state: &mut [u64],
        now: Instant,
        need: u32,
        want: u32,
    ) -> Verdict {
        let (s, clock) = clocked(limit, now);
        let capacity = s.capacity();
        let tat = tat(s, state);
        // How far the bucket is from full.
        let debt = tat - s.now;
        let available = capacity.saturating_sub(debt) / s.interval;
        let need = u128::from(need.clamp(1, want.max(1)));
        let free = if want > 0 && available >= need {
            available
        } else {
            0
        };
        let (granted, tat) = s.take(state, tat, want, free);
        let verdict = Verdict {
            granted: u32::try_from(granted).unwrap_or(0),
            remaining: u64::try_from(available - granted).unwrap_or(u64::MAX),
            reset: s.to_nanos(tat - s.now),
            // Short: `need` tokens are back when the debt is down to capacity − need·interval.
            retry_after: if granted > 0 || want == 0 {
                Nanos::ZERO
            } else {
                s.to_nanos(debt.saturating_sub(capacity.saturating_sub(need * s.interval)))
                    .max(Nanos::new(1))
            },
            delay: Nanos::ZERO,
            // Where the grant's span of `tat` ends: a later release gives back only the
            // part of it still ahead of the clock (the rest has refilled meanwhile).
            mark: if granted > 0 {
                Mark(tat)
            } else {
                Mark::default()
            },
        };
        in_real_time(clock, now, verdict)
    }

    /// Tokens taken from the bucket are spent within a short span: held longer, a
    /// worker's tokens would add to what the bucket refills meanwhile (a burst above
    /// `burst` by what the worker holds).
    fn lease_until(&self, _limit: &Limit, _mark: Mark, now: Instant) -> Instant {
        now.saturating_add(TOKEN_LEASE)
    }

    /// A grant moved `tat` over a span ending at its mark, `tokens` intervals long. What of
    /// that span is still ahead of the clock has not refilled yet and comes back; the rest
    /// already has (giving it back again would make the bucket fuller than if the grant had
    /// never been made). Never fuller than full: `tat` does not go back past now.
    fn release(&self, limit: &Limit, state: &mut [u64], now: Instant, tokens: u32, mark: Mark) {
        let (s, _) = clocked(limit, now);
        let tat = tat(s, state);
        let unrefilled = (u128::from(tokens) * s.interval).min(mark.0.saturating_sub(s.now));
        let back = tat.saturating_sub(unrefilled).max(s.now);
        if back != tat {
            super::common::store(state, back);
        }
    }

    fn charge_debt(&self, limit: &Limit, state: &mut [u64], now: Instant, tokens: u32) -> Verdict {
        let (s, clock) = clocked(limit, now);
        let capacity = s.capacity();
        // The debt is capped at one bucket past empty, and never lowers `tat`: with a clock
        // that stepped back, `now + 2·capacity` can lie before a `tat` charged earlier.
        let before = tat(s, state);
        let tat = (before + u128::from(tokens) * s.interval)
            .min(s.now + 2 * capacity)
            .max(before);
        super::common::store(state, tat);
        let debt = tat - s.now;
        let available = capacity.saturating_sub(debt) / s.interval;
        let verdict = Verdict {
            remaining: u64::try_from(available).unwrap_or(u64::MAX),
            reset: s.to_nanos(debt),
            retry_after: if available > 0 {
                Nanos::ZERO
            } else {
                s.to_nanos(debt - (capacity - s.interval))
                    .max(Nanos::new(1))
            },
            ..Verdict::default()
        };
        in_real_time(clock, now, verdict)
    }

    fn is_idle(&self, limit: &Limit, state: &[u64], now: Instant) -> bool {
        let (s, _) = clocked(limit, now);
        tat(s, state) == s.now
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::common::load;
    use crate::algo::common::testing::{self, at, Step, S};

    fn limit(rpu: u32, unit: Unit, burst: Option<u32>) -> Limit {
        testing::limit(&TokenBucket, rpu, unit, burst, 10)
    }

    fn run(limit: &Limit, state: &mut [u64], steps: &[Step]) {
        testing::run(&TokenBucket, limit, state, steps);
    }

    /// Drains the bucket at `now`; returns the tokens taken.
    fn drain(limit: &Limit, state: &mut [u64], now: u64) -> u32 {
        TokenBucket.acquire(limit, state, at(now), u32::MAX).granted
    }

    #[test]
    fn names() {
        assert_eq!(TokenBucket.code(), "TB");
        assert!(TokenBucket.aliases().contains(&"token bucket"));
        let rpu = NonZeroU32::new(12).unwrap();
        assert_eq!(TokenBucket.default_burst(rpu, Unit::Hour), rpu);
        assert_eq!(TokenBucket.state_words(&limit(12, Unit::Hour, None)), 2);
    }

    #[test]
    fn burst_then_steady_refill() {
        // 10 per second, capacity 10: a token every 100 ms.
        let l = limit(10, Unit::Second, None);
        let t = S / 10;
        let t0 = 1_700_000_000 * S;
        let mut state = [0u64; 2];
        let mut steps: Vec<Step> = (1..=10u64).map(|i| (t0, 1, 1, 10 - i, i * t, 0)).collect();
        steps.extend([
            (t0, 1, 0, 0, S, t),
            // Last ns before the first refill, and the refill itself.
            (t0 + t - 1, 1, 0, 0, S - t + 1, 1),
            (t0 + t, 1, 1, 0, S, 0),
            // Half a second on: 5 tokens.
            (t0 + 6 * t, 9, 5, 0, S, 0),
        ]);
        run(&l, &mut state, &steps);
        assert!(!TokenBucket.is_idle(&l, &state, at(t0 + 16 * t - 1)));
        assert!(TokenBucket.is_idle(&l, &state, at(t0 + 16 * t)));
        // Full again, never more than capacity.
        run(
            &l,
            &mut state,
            &[
                (t0 + 100 * S, 0, 0, 10, 0, 0),
                (t0 + 100 * S, 11, 10, 0, S, 0),
            ],
        );
    }

    #[test]
    fn a_late_release_gives_back_only_what_has_not_refilled() {
        // 3 per second, capacity 1: a token every 333,333,333.33 ns.
        let l = limit(3, Unit::Second, Some(1));
        let t0 = 50 * S;
        let mut state = [0u64; 2];
        let first = TokenBucket.acquire(&l, &mut state, at(t0), 1);
        assert_eq!(first.granted, 1);
        // Refilled: a second grant, then the first is given back. Its token refilled
        // long ago, so nothing comes back and the bucket stays empty.
        let later = t0 + 400_000_000;
        assert_eq!(TokenBucket.acquire(&l, &mut state, at(later), 1).granted, 1);
        TokenBucket.release(&l, &mut state, at(later), 1, first.mark);
        assert_eq!(TokenBucket.acquire(&l, &mut state, at(later), 1).granted, 0);
        // Given back a third of an interval after its grant: a third had refilled, two
        // thirds come back, the bucket is full again — and no fuller.
        let t1 = 60 * S;
        let mut state = [0u64; 2];
        let grant = TokenBucket.acquire(&l, &mut state, at(t1), 1);
        let third = 111_111_111;
        TokenBucket.release(&l, &mut state, at(t1 + third), 1, grant.mark);
        assert_eq!(
            TokenBucket
                .acquire(&l, &mut state, at(t1 + third), 1)
                .granted,
            1
        );
        assert_eq!(
            TokenBucket
                .acquire(&l, &mut state, at(t1 + third), 1)
                .granted,
            0
        );
    }

    #[test]
    fn fractional_refill_is_exact() {
        // 3 per second: a token every 333,333,333.33 ns.
        let l = limit(3, Unit::Second, None);
        let t0 = 50 * S;
        let mut state = [0u64; 2];
        assert_eq!(drain(&l, &mut state, t0), 3);
        run(
            &l,
            &mut state,
            &[
                (t0, 1, 0, 0, S, 333_333_334),
                (t0 + 333_333_333, 1, 0, 0, 666_666_667, 1),
                (t0 + 333_333_334, 1, 1, 0, S, 0),
                (t0 + 666_666_666, 1, 0, 0, S - 333_333_332, 1),
                (t0 + 666_666_667, 1, 1, 0, S, 0),
                (t0 + S, 1, 1, 0, S, 0),
            ],
        );
        // Over 3 seconds after the burst: exactly 9, the 9th at exactly t0 + 3 s.
        let mut state = [0u64; 2];
        assert_eq!(drain(&l, &mut state, t0), 3);
        let mut now = t0;
        let mut taken = 0u64;
        while now <= t0 + 3 * S {
            let verdict = TokenBucket.acquire(&l, &mut state, at(now), 1);
            if verdict.granted == 1 {
                taken += 1;
                assert_eq!(now, t0 + (taken * S).div_ceil(3), "token {taken}");
            } else {
                now += verdict.retry_after.get();
            }
        }
        assert_eq!(taken, 9);
    }

    #[test]
    fn no_drift_over_a_million_seconds() {
        let l = limit(3, Unit::Second, None);
        let t0 = 1_600_000_000 * S;
        let end = t0 + 1_000_000 * S;
        // Taking each token as soon as it is there.
        let mut state = [0u64; 2];
        assert_eq!(drain(&l, &mut state, t0), 3);
        let mut now = t0;
        let mut taken = 0u64;
        loop {
            let verdict = TokenBucket.acquire(&l, &mut state, at(now), 1);
            if verdict.granted == 1 {
                taken += 1;
                assert_eq!(now, t0 + (taken * S).div_ceil(3), "token {taken}");
            } else if now + verdict.retry_after.get() > end {
                break;
            } else {
                now += verdict.retry_after.get();
            }
        }
        assert_eq!(taken, 3_000_000);
        // Polling at an odd period instead (short enough that the bucket, 1.67 tokens per
        // poll plus a fraction kept, never overflows): exactly 3e6 taken by the end too.
        let mut state = [0u64; 2];
        assert_eq!(drain(&l, &mut state, t0), 3);
        let mut taken = 0u64;
        let mut now = t0;
        while now < end {
            now = (now + 555_555_557).min(end);
            taken += u64::from(drain(&l, &mut state, now));
        }
        assert_eq!(taken, 3_000_000);
    }

    #[test]
    fn hour_and_day_units() {
        let m = 60 * S;
        let h = 60 * m;
        // 4 per hour, capacity 2: a token every 15 minutes.
        let l = limit(4, Unit::Hour, Some(2));
        let t0 = 1_700_000_000 * S;
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (t0, 3, 2, 0, 30 * m, 0),
                (t0 + 15 * m - 1, 1, 0, 0, 15 * m + 1, 1),
                (t0 + 15 * m, 1, 1, 0, 30 * m, 0),
                (t0 + 2 * h, 5, 2, 0, 30 * m, 0),
            ],
        );
        // 1 per day.
        let l = limit(1, Unit::Day, None);
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (t0, 1, 1, 0, 24 * h, 0),
                (t0 + 23 * h, 1, 0, 0, h, h),
                (t0 + 24 * h, 1, 1, 0, 24 * h, 0),
            ],
        );
    }

    #[test]
    fn long_idle_gap_fills_the_bucket() {
        let l = limit(5, Unit::Minute, Some(8));
        let t0 = 1_700_000_000 * S;
        let mut state = [0u64; 2];
        assert_eq!(drain(&l, &mut state, t0), 8);
        let later = t0 + 365 * 86_400 * S;
        assert!(TokenBucket.is_idle(&l, &state, at(later)));
        run(&l, &mut state, &[(later, 10, 8, 0, 96 * S, 0)]);
    }

    #[test]
    fn lease_grants_up_to_available() {
        let l = limit(10, Unit::Second, None);
        let t = S / 10;
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (0, 4, 4, 6, 4 * t, 0),
                (0, 4, 4, 2, 8 * t, 0),
                (0, 4, 2, 0, S, 0),
                (0, 4, 0, 0, S, t),
                // 2.5 T later: 2 tokens (and half a token kept).
                (t * 5 / 2, 0, 0, 2, S - t * 5 / 2, 0),
                (t * 5 / 2, 4, 2, 0, S - t / 2, 0),
                (3 * t, 1, 1, 0, S, 0),
            ],
        );
    }

    #[test]
    fn clock_backwards_makes_the_bucket_look_emptier() {
        // 2 per second, capacity 4 (2 s to fill).
        let l = limit(2, Unit::Second, Some(4));
        let t0 = 100 * S;
        let ms = S / 1_000;
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (t0, 1, 1, 3, 500 * ms, 0),
                // 300 ms back: 800 ms from full, 2.4 tokens.
                (t0 - 300 * ms, 1, 1, 1, 1_300 * ms, 0),
                (t0 - 300 * ms, 1, 1, 0, 1_800 * ms, 0),
                (t0 - 300 * ms, 1, 0, 0, 1_800 * ms, 300 * ms),
                // Further back than the deepest debt plus one unit: garbage, full.
                (t0 - 5 * S, 1, 1, 3, 500 * ms, 0),
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
                (9, 1, 1, 0, S, 0),
                (10, 1, 0, 0, S - 1, S - 1),
                (S + 9, 1, 1, 0, S, 0),
            ],
        );

        let l = limit(u32::MAX, Unit::Second, None);
        let mut state = [0u64; 2];
        let now = u64::MAX - 2 * S;
        run(
            &l,
            &mut state,
            &[
                (now, u32::MAX - 1, u32::MAX - 1, 1, S, 0),
                (now, u32::MAX, 1, 0, S, 0),
                (now, 1, 0, 0, S, 1),
                (now + S, u32::MAX, u32::MAX, 0, S, 0),
            ],
        );
        let l = limit(u32::MAX, Unit::Day, Some(u32::MAX));
        let mut state = [0u64; 2];
        for now in [0, S, u64::MAX] {
            let verdict = TokenBucket.acquire(&l, &mut state, at(now), u32::MAX);
            assert!(verdict.granted > 0 || !verdict.retry_after.is_zero());
        }
    }

    /// Found by `tests/properties.rs` (clock stepping back): a debt charged by a clock
    /// behind the last grant was capped at `now + 2·capacity`, which lay before the stored
    /// `tat`, so the debt *lowered* it and refilled the bucket. Rate 2^32−1 per second,
    /// burst 1: one grant, the clock 0.126 s back, a debt of 0, the clock forward again.
    #[test]
    fn a_debt_charged_by_a_clock_behind_never_refills_the_bucket() {
        let l = limit(u32::MAX, Unit::Second, Some(1));
        let t1 = 282_216_072;
        let mut state = [0u64; 2];
        assert_eq!(TokenBucket.acquire(&l, &mut state, at(t1), 2).granted, 1);
        let before = load(&state).unwrap();
        let t2 = t1 - 125_547_027;
        let verdict = TokenBucket.charge_debt(&l, &mut state, at(t2), 0);
        assert_eq!(load(&state).unwrap(), before, "a debt of 0 changed tat");
        assert_eq!(verdict.remaining, 0);
        // Back at t1 the bucket is as empty as right after the grant.
        assert_eq!(TokenBucket.acquire(&l, &mut state, at(t1), 1).granted, 0);
        // A real debt at the lagging clock still adds (up to its cap), never subtracts.
        let mut state = [0u64; 2];
        TokenBucket.acquire(&l, &mut state, at(t1), 1);
        TokenBucket.charge_debt(&l, &mut state, at(t2), 5);
        assert!(load(&state).unwrap() >= before);
    }

    #[test]
    fn garbage_and_short_state_do_not_panic() {
        let l = limit(5, Unit::Second, None);
        let now = 100 * S;
        for len in 0..2 {
            let mut state = vec![u64::MAX; len];
            let verdict = TokenBucket.acquire(&l, &mut state, at(now), 1);
            assert_eq!((verdict.granted, verdict.remaining), (1, 4));
            assert!(state.iter().all(|&w| w == u64::MAX));
            assert!(TokenBucket.is_idle(&l, &state, at(now)));
        }
        let mut state = [u64::MAX, u64::MAX];
        assert!(TokenBucket.is_idle(&l, &state, at(now)));
        assert_eq!(drain(&l, &mut state, now), 5);
        assert_eq!(load(&state), Some(u128::from(now) * 5 + 5 * u128::from(S)));
        for now in [0, 1, u64::MAX] {
            let mut state = [u64::MAX - 1, 3];
            let _ = TokenBucket.acquire(&l, &mut state, at(now), u32::MAX);
            let _ = TokenBucket.is_idle(&l, &state, at(now));
        }
    }
}

#[cfg(test)]
mod calendar_tests {
    use super::*;
    use crate::algo::common::testing::{self, at, Step, S};

    const DAY: u64 = 86_400 * S;
    /// 2026-01-31T22:59:00Z: 23:59 on 31 January in Berlin (CET, UTC+1).
    const JAN_31_2359: u64 = 1_769_900_340 * S;
    /// 2026-01-31T23:00:00Z: 1 February 00:00 in Berlin; February lasts 28 days.
    const FEB_1: u64 = 1_769_900_400 * S;
    /// 2026-02-28T23:00:00Z: 1 March 00:00 in Berlin; March lasts 31 days less an hour.
    const MAR_1: u64 = 1_772_319_600 * S;
    const MARCH: u64 = 31 * DAY - 3_600 * S;

    fn month(rpu: u32, burst: Option<u32>) -> Limit {
        testing::calendar(
            &TokenBucket,
            rpu,
            CalendarUnit::Month,
            "Europe/Berlin",
            burst,
        )
    }

    fn run(limit: &Limit, state: &mut [u64], steps: &[Step]) {
        testing::run(&TokenBucket, limit, state, steps);
    }

    #[test]
    fn a_month_refills_rpu_evenly_over_the_month() {
        // 3 per month in February: a token every 28/3 days = 806,400 s.
        let l = month(3, None);
        let token = 806_400 * S;
        // 2026-02-10T00:00Z, 781,200 s into February.
        let t = 1_770_681_600 * S;
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (t, 1, 1, 2, token, 0),
                (t, 1, 1, 1, 2 * token, 0),
                // Full again a period from now on the period clock (837,000 s of 30 days
                // into February): the rest of February (1,638,000 s), then 837,000 s of
                // the clock at March's pace (× 2,674,800 / 2,592,000 = 863,737.5 s).
                (t, 1, 1, 0, 2_501_737_500_000_000, 0),
                (t, 1, 0, 0, 2_501_737_500_000_000, token),
                (t + token - 1, 1, 0, 0, 2_501_737_500_000_000 - token + 1, 1),
                // A token later: 831,600 s of February, 1,701,000 s of the clock in March.
                (t + token, 1, 1, 0, 2_586_937_500_000_000, 0),
            ],
        );
    }

    #[test]
    fn a_new_month_does_not_fill_the_bucket() {
        let l = month(2, None);
        let mut state = [0u64; 2];
        // Both tokens spent a minute before February. That minute is 60 × 30/31 s of
        // January's period clock (58,064,516,130 ns, the clock reading down); a token is
        // half a period. At midnight nothing comes back: what is missing refills at
        // February's pace, 28/30 of the period clock.
        let first = 1_209_545_806_451_612;
        run(
            &l,
            &mut state,
            &[
                (JAN_31_2359, 2, 2, 0, 60 * S + 2_419_145_806_451_612, 0),
                (FEB_1, 1, 0, 0, 2_419_145_806_451_612, first),
            ],
        );
        assert_eq!(
            TokenBucket
                .acquire(&l, &mut state, at(FEB_1 + first - 1), 1)
                .granted,
            0
        );
        // One token back, one still missing (half a period: 14 days of February).
        let verdict = TokenBucket.acquire(&l, &mut state, at(FEB_1 + first), 0);
        assert_eq!(
            (verdict.remaining, verdict.reset),
            (1, Nanos::new(14 * DAY))
        );
        // Taken, two missing: full again in the rest of February and, at March's pace,
        // the part of the period clock left over.
        let verdict = TokenBucket.acquire(&l, &mut state, at(FEB_1 + first), 1);
        assert_eq!(verdict.granted, 1);
        assert_eq!(verdict.reset, Nanos::new(2_546_994_274_193_549));
    }

    #[test]
    fn half_a_period_refills_half_of_rpu_whatever_its_length() {
        for (start, length) in [(FEB_1, 28 * DAY), (MAR_1, MARCH)] {
            let l = month(2, None);
            let mut state = [0u64; 2];
            assert_eq!(TokenBucket.acquire(&l, &mut state, at(start), 2).granted, 2);
            let probe = |state: &[u64], now: u64| {
                let mut copy = state.to_vec();
                TokenBucket.acquire(&l, &mut copy, at(now), 0).remaining
            };
            let half = start + length / 2;
            assert_eq!(probe(&state, half - 1), 0);
            assert_eq!(probe(&state, half), 1);
            // Full at the next period's start, not before.
            assert!(!TokenBucket.is_idle(&l, &state, at(start + length - 1)));
            assert!(TokenBucket.is_idle(&l, &state, at(start + length)));
        }
    }

    #[test]
    fn a_burst_above_rpu_and_a_debt_wait_through_the_periods_they_cross() {
        // 1 per week, 3 at once: empty, the bucket is full three weeks later.
        let l = testing::calendar(&TokenBucket, 1, CalendarUnit::Week, "UTC", Some(3));
        // Monday 2026-01-05 00:00 UTC.
        let monday = 1_767_571_200 * S;
        let week = 7 * DAY;
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (monday, 3, 3, 0, 3 * week, 0),
                (monday, 1, 0, 0, 3 * week, week),
                (monday + week, 1, 1, 0, 3 * week, 0),
            ],
        );
        // A debt of a whole bucket: denied for the bucket and the token a request needs.
        let mut state = [0u64; 2];
        let verdict = TokenBucket.charge_debt(&l, &mut state, at(monday), 6);
        assert_eq!(
            (verdict.remaining, verdict.reset),
            (0, Nanos::new(6 * week))
        );
        assert_eq!(verdict.retry_after, Nanos::new(4 * week));
    }

    #[test]
    fn a_release_gives_back_what_has_not_refilled() {
        let l = month(2, None);
        let mut state = [0u64; 2];
        let grant = TokenBucket.acquire(&l, &mut state, at(FEB_1), 1);
        TokenBucket.release(&l, &mut state, at(FEB_1), 1, grant.mark);
        assert!(TokenBucket.is_idle(&l, &state, at(FEB_1)));
    }
}
