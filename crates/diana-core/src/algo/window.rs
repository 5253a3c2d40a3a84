//! Fixed window (`W`): a counter per calendar window.
//!
//! Time is cut into windows of one unit, aligned to the Unix epoch (UTC): every second,
//! every minute on the minute, every hour on the hour, every day at midnight UTC. Each
//! window admits at most `rpu` requests; the count starts again from zero when the next
//! window begins. This is the cheapest algorithm and the easiest to explain ("50 per
//! second"), at the price of allowing up to `2 × rpu` across a window boundary (the end of
//! one window and the start of the next).
//!
//! State, two words: `[window_index, count]` where `window_index = now / unit` counts
//! windows since the epoch. All zeros is window 0 with nothing counted, which decides
//! exactly like a fresh counter.
//!
//! Clock going backwards (another worker or gateway slightly behind, an NTP step): the
//! request is counted in the stored, later window, never in an earlier one, so a window is
//! never reset early. A stored window more than one window ahead of the clock cannot come
//! from a clock step within one unit and is treated as garbage (fresh).
//!
//! With a calendar (`unit: week | month`, [`Limit::calendar`]) the windows are its periods
//! in the rule's time zone, and `window_index` is the period's number
//! ([`crate::calendar::Calendar::index`]): the count starts again at the period's start
//! (Monday 00:00, the 1st at 00:00), and a denial waits until the period's end. Periods are
//! looked up only for such a rule; a fixed unit divides, as it always has.
//!
//! A response cost charged past the limit ([`Algorithm::charge_debt`]) leaves the count
//! above `rpu`: the rest of the window is denied, and the debt ends with the window.

use super::{Algorithm, Limit, Mark, Verdict};
use crate::calendar::Calendar;
use crate::time::{Instant, Nanos, Unit};
use std::cmp::Ordering;
use std::num::NonZeroU32;

/// The fixed-window algorithm (`W`). See the module documentation.
#[derive(Debug)]
pub struct FixedWindow;

/// The stored state, after validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WindowState {
    /// The window the count belongs to (windows since the epoch).
    window: u64,
    /// Tokens counted in `window` (above `rpu` only after a debt).
    count: u64,
}

/// Reads the state as seen at window `current`: a window that has passed (or garbage, or a
/// short slice) reads as an empty counter in `current`.
fn load(state: &[u64], current: u64) -> WindowState {
    let fresh = WindowState {
        window: current,
        count: 0,
    };
    let (Some(&window), Some(&count)) = (state.first(), state.get(1)) else {
        return fresh;
    };
    if window < current || window > current.saturating_add(1) {
        // Passed, or further ahead than a clock step of one unit can explain (garbage).
        return fresh;
    }
    // `window` is `current` or, with a clock that went backwards, the next one.
    WindowState { window, count }
}

fn store(state: &mut [u64], loaded: WindowState) {
    if let [window_word, count_word, ..] = state {
        *window_word = loaded.window;
        *count_word = loaded.count;
    }
}

/// Where a limit's windows are: every `unit` since the epoch, or a calendar's periods.
/// Found once per decision, from `now`.
enum Windows<'a> {
    Fixed {
        unit: Nanos,
    },
    Calendar {
        calendar: &'a Calendar,
        current: u64,
        end: Instant,
    },
    /// A period a gateway named ([`Limit::period`]): windows of its length from `origin`,
    /// the start of the period before it, so that the period itself is window 1 (0 for a
    /// service clock a little behind the gateway's, 2 for one past the period's end).
    Given {
        length: Nanos,
        origin: Instant,
    },
}

impl Windows<'_> {
    fn at(limit: &Limit, now: Instant) -> Windows<'_> {
        match &limit.calendar {
            None => match limit.period {
                None => Windows::Fixed {
                    unit: limit.unit.nanos(),
                },
                Some(period) => {
                    let length = Nanos::new(period.length.get().max(1));
                    Windows::Given {
                        length,
                        origin: period.start.saturating_sub(length),
                    }
                }
            },
            Some(calendar) => {
                let (current, period) = calendar.numbered(now);
                Windows::Calendar {
                    calendar,
                    current,
                    end: period.end,
                }
            }
        }
    }

    /// The number of the window that contains `now`.
    fn current(&self, now: Instant) -> u64 {
        match *self {
            Windows::Fixed { unit } => now.periods(unit),
            Windows::Calendar { current, .. } => current,
            Windows::Given { length, origin } => now.saturating_since(origin).get() / length.get(),
        }
    }

    /// Nanoseconds from `now` to the end of `window`, saturating (zero for a window that
    /// has passed).
    fn until_end(&self, window: u64, now: Instant) -> Nanos {
        match *self {
            Windows::Fixed { unit } => {
                let end = (u128::from(window) + 1) * u128::from(unit.get());
                Nanos::new(
                    u64::try_from(end.saturating_sub(u128::from(now.unix_nanos())))
                        .unwrap_or(u64::MAX),
                )
            }
            Windows::Given { length, origin } => {
                let end = u128::from(origin.unix_nanos())
                    + (u128::from(window) + 1) * u128::from(length.get());
                Nanos::new(
                    u64::try_from(end.saturating_sub(u128::from(now.unix_nanos())))
                        .unwrap_or(u64::MAX),
                )
            }
            Windows::Calendar {
                calendar,
                current,
                end,
            } => match window.cmp(&current) {
                Ordering::Less => Nanos::ZERO,
                Ordering::Equal => end.saturating_since(now),
                // A count a clock behind found one period ahead (`load` keeps none further):
                // it lasts until the next period ends.
                Ordering::Greater => calendar.period(end).end.saturating_since(now),
            },
        }
    }
}

impl Algorithm for FixedWindow {
    fn code(&self) -> &'static str {
        "W"
    }

    fn aliases(&self) -> &'static [&'static str] {
        &["w", "window", "fixed window", "fixed_window"]
    }

    /// Unused by this algorithm; `rpu` so that the resolved rule reads sensibly.
    fn default_burst(&self, rpu: NonZeroU32, _unit: Unit) -> NonZeroU32 {
        rpu
    }

    fn state_words(&self, _limit: &Limit) -> usize {
        2
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
        let windows = Windows::at(limit, now);
        let mut loaded = load(state, windows.current(now));
        let rpu = u64::from(limit.rpu.get());
        let available = rpu.saturating_sub(loaded.count);
        let need = u64::from(need.clamp(1, want.max(1)));
        // `granted <= want`, so it fits in u32.
        let granted = if want > 0 && available >= need {
            u64::from(want).min(available)
        } else {
            0
        };
        let reset = windows.until_end(loaded.window, now);
        if granted > 0 {
            loaded.count = loaded.count.saturating_add(granted);
            store(state, loaded);
        }
        Verdict {
            granted: u32::try_from(granted).unwrap_or(0),
            remaining: available - granted,
            reset,
            // Not enough left in this window: the next request passes when it ends.
            retry_after: if granted > 0 || want == 0 {
                Nanos::ZERO
            } else {
                reset.max(Nanos::new(1))
            },
            delay: Nanos::ZERO,
            mark: Mark(u128::from(loaded.window)),
        }
    }

    /// Tokens counted in a window may be spent until it ends.
    fn lease_until(&self, limit: &Limit, mark: Mark, now: Instant) -> Instant {
        let window = u64::try_from(mark.0).unwrap_or(u64::MAX);
        now.saturating_add(Windows::at(limit, now).until_end(window, now))
    }

    fn release(&self, limit: &Limit, state: &mut [u64], now: Instant, tokens: u32, mark: Mark) {
        let mut loaded = load(state, Windows::at(limit, now).current(now));
        if u128::from(loaded.window) == mark.0 {
            loaded.count = loaded.count.saturating_sub(u64::from(tokens));
            store(state, loaded);
        }
    }

    fn charge_debt(&self, limit: &Limit, state: &mut [u64], now: Instant, tokens: u32) -> Verdict {
        let windows = Windows::at(limit, now);
        let mut loaded = load(state, windows.current(now));
        loaded.count = loaded.count.saturating_add(u64::from(tokens));
        store(state, loaded);
        let remaining = u64::from(limit.rpu.get()).saturating_sub(loaded.count);
        let reset = windows.until_end(loaded.window, now);
        Verdict {
            remaining,
            reset,
            retry_after: if remaining > 0 {
                Nanos::ZERO
            } else {
                reset.max(Nanos::new(1))
            },
            mark: Mark(u128::from(loaded.window)),
            ..Verdict::default()
        }
    }

    fn is_idle(&self, limit: &Limit, state: &[u64], now: Instant) -> bool {
        load(state, Windows::at(limit, now).current(now)).count == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::common::testing::{self, at, Step, S};

    fn limit(rpu: u32, unit: Unit) -> Limit {
        testing::limit(&FixedWindow, rpu, unit, None, 10)
    }

    fn run(limit: &Limit, state: &mut [u64], steps: &[Step]) {
        testing::run(&FixedWindow, limit, state, steps);
    }

    #[test]
    fn names() {
        assert_eq!(FixedWindow.code(), "W");
        assert!(FixedWindow.aliases().contains(&"fixed window"));
        let rpu = NonZeroU32::new(7).unwrap();
        assert_eq!(FixedWindow.default_burst(rpu, Unit::Minute), rpu);
        assert_eq!(FixedWindow.state_words(&limit(7, Unit::Second)), 2);
    }

    #[test]
    fn window_boundaries_second() {
        let l = limit(3, Unit::Second);
        let t0 = 1_700_000_000 * S;
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (t0, 1, 1, 2, S, 0),
                (t0 + 1, 1, 1, 1, S - 1, 0),
                (t0 + S / 2, 1, 1, 0, S / 2, 0),
                // Full: rejected until the window ends, not counted.
                (t0 + S / 2 + 1, 1, 0, 0, S / 2 - 1, S / 2 - 1),
                // Last nanosecond of the window.
                (t0 + S - 1, 1, 0, 0, 1, 1),
                // First nanosecond of the next.
                (t0 + S, 1, 1, 2, S, 0),
                (t0 + S, 1, 1, 1, S, 0),
                (t0 + S, 1, 1, 0, S, 0),
                (t0 + S, 1, 0, 0, S, S),
            ],
        );
        assert_eq!(state, [1_700_000_001, 3]);
    }

    #[test]
    fn hour_and_day_windows_are_aligned_to_the_epoch() {
        // 2023-11-14T22:13:20Z
        let t0 = 1_700_000_000 * S;
        let hour = 3_600 * S;
        let day = 86_400 * S;
        let l = limit(2, Unit::Hour);
        let mut state = [0u64; 2];
        let hour_end = (t0 / hour + 1) * hour;
        run(
            &l,
            &mut state,
            &[
                (t0, 1, 1, 1, hour_end - t0, 0),
                (hour_end - 1, 1, 1, 0, 1, 0),
                (hour_end - 1, 1, 0, 0, 1, 1),
                (hour_end, 2, 2, 0, hour, 0),
            ],
        );
        let l = limit(1, Unit::Day);
        let mut state = [0u64; 2];
        let midnight = (t0 / day + 1) * day; // 2023-11-15T00:00:00Z
        assert_eq!(midnight, 1_700_006_400 * S);
        run(
            &l,
            &mut state,
            &[
                (t0, 1, 1, 0, midnight - t0, 0),
                (midnight - 1, 1, 0, 0, 1, 1),
                (midnight, 1, 1, 0, day, 0),
            ],
        );
    }

    #[test]
    fn long_idle_gap_starts_a_new_window() {
        let l = limit(1, Unit::Minute);
        let t0 = 1_700_000_000 * S;
        let mut state = [0u64; 2];
        assert_eq!(FixedWindow.acquire(&l, &mut state, at(t0), 1).granted, 1);
        assert!(!FixedWindow.is_idle(&l, &state, at(t0)));
        let later = t0 + 30 * 86_400 * S;
        assert!(FixedWindow.is_idle(&l, &state, at(later)));
        assert_eq!(FixedWindow.acquire(&l, &mut state, at(later), 1).granted, 1);
        assert_eq!(state, [later / (60 * S), 1]);
    }

    #[test]
    fn lease_grants_up_to_what_is_left() {
        let l = limit(10, Unit::Second);
        let t0 = 42 * S;
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (t0, 4, 4, 6, S, 0),
                (t0, 4, 4, 2, S, 0),
                (t0, 4, 2, 0, S, 0),
                (t0, 4, 0, 0, S, S),
                // want = 0 is a read-only probe.
                (t0 + S, 0, 0, 10, S, 0),
            ],
        );
        assert_eq!(state, [42, 10]);
    }

    #[test]
    fn clock_backwards_keeps_counting_in_the_later_window() {
        let l = limit(2, Unit::Second);
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (10 * S, 1, 1, 1, S, 0),
                // 1 ns earlier, in window 9: still window 10's count.
                (10 * S - 1, 1, 1, 0, S + 1, 0),
                (10 * S - 1, 1, 0, 0, S + 1, S + 1),
                (10 * S + 5, 1, 0, 0, S - 5, S - 5),
                (11 * S, 1, 1, 1, S, 0),
            ],
        );
    }

    #[test]
    fn rpu_one_and_large_rpu() {
        let l = limit(1, Unit::Second);
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[(5, 1, 1, 0, S - 5, 0), (6, 1, 0, 0, S - 6, S - 6)],
        );

        let l = limit(u32::MAX, Unit::Day);
        let max = u64::from(u32::MAX);
        let mut state = [0u64; 2];
        let now = u64::MAX - 1;
        let day = 86_400 * S;
        let reset =
            u64::try_from((u128::from(now / day) + 1) * u128::from(day) - u128::from(now)).unwrap();
        run(
            &l,
            &mut state,
            &[
                (now, u32::MAX, u32::MAX, 0, reset, 0),
                (now, 1, 0, 0, reset, reset),
            ],
        );
        assert_eq!(state[1], max);
    }

    #[test]
    fn garbage_and_short_state_do_not_panic() {
        let l = limit(3, Unit::Second);
        let now = 100 * S;
        // Short: decided as fresh, nothing stored.
        for len in 0..2 {
            let mut state = vec![u64::MAX; len];
            let verdict = FixedWindow.acquire(&l, &mut state, at(now), 1);
            assert_eq!((verdict.granted, verdict.remaining), (1, 2));
            assert!(state.iter().all(|&w| w == u64::MAX));
            assert!(FixedWindow.is_idle(&l, &state, at(now)));
        }
        // A window far in the future is garbage: fresh.
        let mut state = [u64::MAX, u64::MAX];
        assert!(FixedWindow.is_idle(&l, &state, at(now)));
        assert_eq!(FixedWindow.acquire(&l, &mut state, at(now), 1).granted, 1);
        assert_eq!(state, [100, 1]);
        // A count above rpu reads as full.
        let mut state = [100, u64::MAX];
        let verdict = FixedWindow.acquire(&l, &mut state, at(now), 1);
        assert_eq!(
            (verdict.granted, verdict.remaining, verdict.retry_after),
            (0, 0, Nanos::new(S))
        );
        // Extreme clock values.
        let mut state = [0u64; 2];
        for now in [0, 1, u64::MAX] {
            let _ = FixedWindow.acquire(&l, &mut state, at(now), u32::MAX);
            let _ = FixedWindow.is_idle(&l, &state, at(now));
        }
    }

    #[test]
    fn idle_when_count_zero_or_window_passed() {
        let l = limit(3, Unit::Second);
        let mut state = [0u64; 2];
        assert!(FixedWindow.is_idle(&l, &state, at(7 * S)));
        FixedWindow.acquire(&l, &mut state, at(7 * S), 1);
        assert!(!FixedWindow.is_idle(&l, &state, at(7 * S)));
        assert!(!FixedWindow.is_idle(&l, &state, at(8 * S - 1)));
        assert!(FixedWindow.is_idle(&l, &state, at(8 * S)));
        // Clock behind: the stored window is still live.
        assert!(!FixedWindow.is_idle(&l, &state, at(7 * S - 1)));
    }
}

#[cfg(test)]
mod release_tests {
    use super::*;
    use crate::algo::common::testing::{self, at, S};

    #[test]
    fn a_release_counts_only_in_its_own_window() {
        let l = testing::limit(&FixedWindow, 3, Unit::Second, None, 10);
        let mut state = [0u64; 2];
        let first = FixedWindow.acquire(&l, &mut state, at(10 * S), 2);
        algorithm_release(&l, &mut state, at(10 * S + 1), 1, first.mark);
        assert_eq!(state, [10, 1]);
        // The window has passed: its tokens are gone, the new window is untouched.
        let second = FixedWindow.acquire(&l, &mut state, at(11 * S), 1);
        algorithm_release(&l, &mut state, at(11 * S), 1, first.mark);
        assert_eq!(state, [11, 1]);
        algorithm_release(&l, &mut state, at(11 * S), 1, second.mark);
        assert_eq!(state, [11, 0]);
    }

    fn algorithm_release(l: &Limit, state: &mut [u64], now: Instant, tokens: u32, mark: Mark) {
        FixedWindow.release(l, state, now, tokens, mark);
    }
}

#[cfg(test)]
mod calendar_tests {
    use super::*;
    use crate::algo::common::testing::{self, at, Step, S};
    use crate::calendar::CalendarUnit;

    const DAY: u64 = 86_400 * S;
    /// 2026-01-31T22:59:00Z: 23:59 on Saturday 31 January in Berlin (CET, UTC+1).
    const JAN_31_2359: u64 = 1_769_900_340 * S;
    /// 2026-01-31T23:00:00Z: 1 February 00:00 in Berlin.
    const FEB_1: u64 = 1_769_900_400 * S;
    /// 2026-02-28T23:00:00Z: 1 March 00:00 in Berlin.
    const MAR_1: u64 = 1_772_319_600 * S;

    fn run(limit: &Limit, state: &mut [u64], steps: &[Step]) {
        testing::run(&FixedWindow, limit, state, steps);
    }

    #[test]
    fn a_month_in_berlin_starts_again_at_local_midnight_of_the_first() {
        let l = testing::calendar(&FixedWindow, 3, CalendarUnit::Month, "Europe/Berlin", None);
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                // January ends in a minute (it is 22:59 in UTC, and January there too).
                (JAN_31_2359, 1, 1, 2, 60 * S, 0),
                (JAN_31_2359, 1, 1, 1, 60 * S, 0),
                (JAN_31_2359, 1, 1, 0, 60 * S, 0),
                (JAN_31_2359, 1, 0, 0, 60 * S, 60 * S),
                (FEB_1 - 1, 1, 0, 0, 1, 1),
                // February, 28 days long, from 00:00 Berlin.
                (FEB_1, 1, 1, 2, 28 * DAY, 0),
            ],
        );
        // Months since December 1969: February 2026 is the 674th.
        assert_eq!(state, [674, 1]);
        // Shown as written (the placeholder day is never the period).
        assert_eq!((l.unit_name(), l.unit), ("month", Unit::Day));
        // The count lasts the whole month, not a day.
        run(
            &l,
            &mut state,
            &[
                (FEB_1 + 10 * DAY, 2, 2, 0, 18 * DAY, 0),
                (MAR_1 - 1, 1, 0, 0, 1, 1),
                // March: 31 days, one hour short (summer time from 29 March).
                (MAR_1, 1, 1, 2, 31 * DAY - 3_600 * S, 0),
            ],
        );
    }

    #[test]
    fn a_week_starts_on_monday_at_local_midnight() {
        // Sunday 2026-01-11 23:59:59 and Monday 2026-01-12 00:00 in Berlin.
        let sunday_night = 1_768_172_399 * S;
        let monday = 1_768_172_400 * S;
        let l = testing::calendar(&FixedWindow, 2, CalendarUnit::Week, "Europe/Berlin", None);
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (sunday_night, 2, 2, 0, S, 0),
                (sunday_night, 1, 0, 0, S, S),
                (monday, 1, 1, 1, 7 * DAY, 0),
            ],
        );
        // In UTC both are on Sunday (22:59:59 and 23:00): one week, one count, an hour
        // longer.
        let utc = testing::calendar(&FixedWindow, 2, CalendarUnit::Week, "UTC", None);
        let mut state = [0u64; 2];
        run(
            &utc,
            &mut state,
            &[
                (sunday_night, 2, 2, 0, 3_600 * S + S, 0),
                (monday, 1, 0, 0, 3_600 * S, 3_600 * S),
                (monday + 3_600 * S, 1, 1, 1, 7 * DAY, 0),
            ],
        );
    }

    #[test]
    fn the_week_summer_time_begins_is_an_hour_shorter() {
        // Monday 2026-03-23 00:00 CET to Monday 2026-03-30 00:00 CEST (29 March 02:00
        // became 03:00).
        let start = 1_774_220_400 * S;
        let end = 1_774_821_600 * S;
        assert_eq!(end - start, 7 * DAY - 3_600 * S);
        let l = testing::calendar(&FixedWindow, 1, CalendarUnit::Week, "Europe/Berlin", None);
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (start, 1, 1, 0, 7 * DAY - 3_600 * S, 0),
                (end - 1, 1, 0, 0, 1, 1),
                (end, 1, 1, 0, 7 * DAY, 0),
            ],
        );
    }

    #[test]
    fn a_clock_behind_counts_in_the_later_period_until_its_end() {
        let l = testing::calendar(&FixedWindow, 2, CalendarUnit::Month, "Europe/Berlin", None);
        let mut state = [0u64; 2];
        run(
            &l,
            &mut state,
            &[
                (FEB_1, 1, 1, 1, 28 * DAY, 0),
                // A second behind, in January: February's count, until February ends.
                (FEB_1 - S, 1, 1, 0, 28 * DAY + S, 0),
                (FEB_1 - S, 1, 0, 0, 28 * DAY + S, 28 * DAY + S),
            ],
        );
        assert_eq!(state, [674, 2]);
        // Tokens counted in a period may be spent until it ends; a passed one, not at all.
        let mark = Mark(674);
        assert_eq!(FixedWindow.lease_until(&l, mark, at(FEB_1)), at(MAR_1));
        assert_eq!(FixedWindow.lease_until(&l, Mark(673), at(FEB_1)), at(FEB_1));
        assert!(!FixedWindow.is_idle(&l, &state, at(MAR_1 - 1)));
        assert!(FixedWindow.is_idle(&l, &state, at(MAR_1)));
        // A release counts only in its own period.
        FixedWindow.release(&l, &mut state, at(FEB_1), 1, Mark(673));
        assert_eq!(state, [674, 2]);
        FixedWindow.release(&l, &mut state, at(FEB_1), 1, mark);
        assert_eq!(state, [674, 1]);
    }

    #[test]
    fn a_debt_lasts_until_the_period_ends() {
        let l = testing::calendar(&FixedWindow, 3, CalendarUnit::Month, "Europe/Berlin", None);
        let mut state = [0u64; 2];
        let verdict = FixedWindow.charge_debt(&l, &mut state, at(FEB_1 + DAY), 5);
        assert_eq!(verdict.retry_after, Nanos::new(27 * DAY));
        assert_eq!(
            FixedWindow
                .acquire(&l, &mut state, at(MAR_1 - 1), 1)
                .granted,
            0
        );
        assert_eq!(FixedWindow.acquire(&l, &mut state, at(MAR_1), 1).granted, 1);
    }
}
