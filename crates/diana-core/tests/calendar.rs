//! Budgets by the calendar (`unit: week | month` in a `timezone`) on a simulated gateway:
//! the count lasts the period in the rule's zone, a spent budget says how long until the
//! period ends, and the next period starts at local midnight.

// The helpers below stop a test at once when a scenario cannot even be set up.
#![allow(clippy::panic)]

mod common;

use diana_core::response::RETRY_AFTER;
use diana_core::time::{Instant, Nanos, NANOS_PER_SECOND};
use diana_core::worker::sim::{Fate, Service, Sim};
use diana_core::worker::HostProfile;

const S: u64 = NANOS_PER_SECOND.get();
const DAY: u64 = 86_400 * S;
/// 2026-01-31T22:59:00Z: 23:59 on 31 January in Berlin (CET, UTC+1).
const JAN_31_2359: Instant = Instant::from_unix_nanos(1_769_900_340 * S);
/// 2026-01-31T23:00:00Z: 1 February 00:00 in Berlin.
const FEB_1: Instant = Instant::from_unix_nanos(1_769_900_400 * S);

fn sim(profile: HostProfile, document: &str, workers: usize, start: Instant) -> Sim {
    common::started_sim(
        profile,
        document,
        workers,
        Service::Answers(Nanos::ZERO),
        start,
    )
}

fn local(rule: &str) -> String {
    format!("response: {{status: 429}}\nresources:\n  - Url: /\n    rules: [{{{rule}}}]\n")
}

/// Sends one request on `worker`; `None` when admitted, else its `Retry-After`.
fn send(sim: &mut Sim, worker: usize) -> Option<String> {
    let context = sim.send(worker, "10.0.0.1", &[(":path", "/")]);
    fate_of(sim, context)
}

/// `(at, worker, expected)`: `None` admitted, `Some(retry_after)` refused.
type Step = (Instant, usize, Option<&'static str>);

fn run(document: &str, workers: usize, steps: &[Step]) {
    let Some(&(start, _, _)) = steps.first() else {
        return;
    };
    for profile in HostProfile::ALL {
        let mut sim = sim(profile, document, workers, start);
        for (i, &(at, worker, expected)) in steps.iter().enumerate() {
            jump(&mut sim, at);
            assert_eq!(
                send(&mut sim, worker).as_deref(),
                expected,
                "{profile:?} step {i} at {at:?}"
            );
        }
        assert!(sim.violations.is_empty(), "{:?}", sim.violations);
    }
}

/// Moves the clock to `at` with one tick on arrival, as after a host asleep meanwhile: the
/// days of ticks in between would change no counter and take minutes to replay.
fn jump(sim: &mut Sim, at: Instant) {
    sim.host.set_now(at);
    sim.advance_to(at);
}

fn at(instant: Instant, nanos: u64) -> Instant {
    instant.saturating_add(Nanos::new(nanos))
}

#[test]
fn a_monthly_window_in_berlin_starts_again_at_local_midnight() {
    let document = local("rpu: 3, unit: month, timezone: Europe/Berlin, algo: W");
    run(
        &document,
        2,
        &[
            (JAN_31_2359, 0, None),
            (JAN_31_2359, 1, None),
            (JAN_31_2359, 0, None),
            // A minute until February in Berlin (22:59 UTC is still January there too).
            (JAN_31_2359, 1, Some("60")),
            (at(JAN_31_2359, 30 * S + 1), 0, Some("30")),
            (FEB_1, 1, None),
            (FEB_1, 0, None),
            (at(FEB_1, 27 * DAY), 1, None),
            // February is 28 days long, not one: its budget is spent.
            (at(FEB_1, 27 * DAY), 0, Some("86400")),
            (at(FEB_1, 28 * DAY), 0, None),
        ],
    );
}

#[test]
fn a_weekly_window_starts_again_on_monday_at_local_midnight() {
    // Sunday 2026-01-11 23:59:59 and Monday 2026-01-12 00:00 in Berlin.
    let sunday_night = Instant::from_unix_nanos(1_768_172_399 * S);
    let monday = Instant::from_unix_nanos(1_768_172_400 * S);
    let document = local("rpu: 1, unit: week, timezone: Europe/Berlin, algo: W");
    run(
        &document,
        1,
        &[
            (sunday_night, 0, None),
            (sunday_night, 0, Some("1")),
            (monday, 0, None),
            (at(monday, 3 * DAY), 0, Some("345600")),
        ],
    );
}

#[test]
fn the_week_summer_time_begins_is_an_hour_shorter() {
    // Monday 2026-03-23 00:00 CET; the next Monday's 00:00 is CEST, 7 days less an hour on.
    let start = Instant::from_unix_nanos(1_774_220_400 * S);
    let document = local("rpu: 1, unit: week, timezone: Europe/Berlin, algo: W");
    run(
        &document,
        1,
        &[
            (start, 0, None),
            (start, 0, Some("601200")),
            (at(start, 7 * DAY - 3_600 * S), 0, None),
        ],
    );
}

#[test]
fn a_monthly_bucket_refills_over_the_month_not_at_its_start() {
    // 2 per month: a token every 14 days of February.
    let document = local("rpu: 2, unit: month, timezone: Europe/Berlin");
    run(
        &document,
        1,
        &[
            (FEB_1, 0, None),
            (FEB_1, 0, None),
            (FEB_1, 0, Some("1209600")),
            (at(FEB_1, 14 * DAY - S), 0, Some("1")),
            (at(FEB_1, 14 * DAY), 0, None),
            // 1 March: the token refilled over February's second half, and no more (the
            // bucket does not fill at the month's start); the next one takes half of
            // March, 31 days less an hour.
            (at(FEB_1, 28 * DAY), 0, None),
            (at(FEB_1, 28 * DAY), 0, Some("1337400")),
        ],
    );
}

/// Reads the fate of `context` on `sim`: `None` admitted, else its `Retry-After`.
fn fate_of(sim: &Sim, context: u32) -> Option<String> {
    match sim.fate(context) {
        Some(Fate::Admitted(_)) => None,
        Some(Fate::Replied(429)) => {
            let reply = sim.reply(context)?;
            let retry = reply.headers.iter().find(|(name, _)| *name == RETRY_AFTER);
            Some(retry.map_or_else(|| "none".to_string(), |(_, value)| value.clone()))
        }
        other => panic!("unexpected fate {other:?}"),
    }
}

/// A month's budget in global scope (`scope: global`): two gateways share one count at the
/// in-process quota service, which knows no zones; each names the period it finds in
/// Europe/Berlin (`period` on the wire). The count lasts January in Berlin (a minute before
/// its end, Retry-After says 60), starts again at 00:00 on 1 February local time (23:00 UTC),
/// and a spent February says 28 days, under every host profile.
#[test]
fn two_gateways_share_a_global_month_across_its_boundary_in_berlin() {
    use diana_core::quota::MemoryQuota;
    use std::cell::RefCell;
    use std::rc::Rc;
    use std::time::Duration;

    let document = "response: {status: 429}\nresources:\n  - Url: /\n    rules: [{rpu: 3, unit: month, timezone: Europe/Berlin, algo: W, scope: global, lease: 1}]\nglobal: {cluster: \"127.0.0.1:18081\"}\n";
    for profile in HostProfile::ALL {
        let quota = Rc::new(RefCell::new(MemoryQuota::new()));
        let gateway = || {
            common::started_sim(
                profile,
                document,
                1,
                Service::Answers(Nanos::ZERO),
                JAN_31_2359,
            )
            .sharing_quota(Rc::clone(&quota))
        };
        let mut gateways = [gateway(), gateway()];
        // One request on gateway `on`, its call answered (both clocks move 1 ms).
        let ask = |gateways: &mut [Sim; 2], on: usize| {
            let context = gateways[on].send(0, "10.0.0.1", &[(":path", "/")]);
            for sim in gateways.iter_mut() {
                sim.advance(Duration::from_millis(1));
            }
            fate_of(&gateways[on], context)
        };
        let to = |gateways: &mut [Sim; 2], at: Instant| {
            for sim in gateways.iter_mut() {
                jump(sim, at);
            }
        };
        // 23:59 on 31 January in Berlin: three in all, over both gateways.
        assert_eq!(ask(&mut gateways, 0), None, "{profile:?}");
        assert_eq!(ask(&mut gateways, 1), None, "{profile:?}");
        assert_eq!(ask(&mut gateways, 0), None, "{profile:?}");
        assert_eq!(ask(&mut gateways, 1).as_deref(), Some("60"), "{profile:?}");
        // 1 February 00:00 in Berlin: a new count for both.
        to(&mut gateways, FEB_1);
        assert_eq!(ask(&mut gateways, 1), None, "{profile:?}");
        assert_eq!(ask(&mut gateways, 0), None, "{profile:?}");
        to(&mut gateways, at(FEB_1, 20 * DAY));
        assert_eq!(ask(&mut gateways, 0), None, "{profile:?}");
        // Spent until 1 March 00:00 in Berlin: 8 days less the 3 ms the calls took.
        assert_eq!(
            ask(&mut gateways, 1).as_deref(),
            Some("691200"),
            "{profile:?}"
        );
        assert!(quota.borrow().calls() >= 8, "{profile:?}");
        for sim in &gateways {
            assert!(
                sim.violations.is_empty(),
                "{profile:?}: {:?}",
                sim.violations
            );
        }
    }
}

mod properties {
    //! The algorithms' definitions on calendar periods, over random zones, units, limits and
    //! clocks that cross boundaries (a step lands on a period's last or first nanosecond).

    use super::common;
    use diana_core::algo::{Algorithm, Limit, REGISTRY};
    use diana_core::calendar::{Calendar, CalendarUnit, Zone};
    use diana_core::time::{Instant, Nanos, Unit};
    use proptest::prelude::*;
    use std::collections::BTreeMap;
    use std::num::NonZeroU32;

    const ZONES: [&str; 5] = [
        "UTC",
        "Europe/Berlin",
        "America/New_York",
        "Australia/Lord_Howe",
        "Asia/Kathmandu",
    ];
    /// 2025-01-01T00:00:00Z.
    const START: u64 = 1_735_689_600;

    fn algorithm(code: &str) -> Option<&'static dyn Algorithm> {
        REGISTRY.iter().copied().find(|algo| algo.code() == code)
    }

    fn limit(unit: CalendarUnit, zone: &str, rpu: u32, burst: u32) -> Option<Limit> {
        Some(Limit {
            rpu: NonZeroU32::new(rpu)?,
            unit: Unit::Day,
            burst: NonZeroU32::new(burst)?,
            slices: NonZeroU32::MIN,
            calendar: Some(Calendar::new(unit, Zone::parse(zone).ok()?)),
            period: None,
        })
    }

    /// How the clock moves on: a little, a lot, or onto the end of the current period
    /// (`back` nanoseconds before it: 0 is the next period's first instant).
    #[derive(Debug, Clone, Copy)]
    enum Step {
        Nanos(u64),
        Hours(u16),
        ToEnd(u8),
    }

    fn steps() -> impl Strategy<Value = Vec<(Step, u32)>> {
        let step = prop_oneof![
            3 => (0u64..1_000).prop_map(Step::Nanos),
            3 => (0u16..400).prop_map(Step::Hours),
            2 => (0u8..3).prop_map(Step::ToEnd),
        ];
        prop::collection::vec((step, 1u32..=3), 1..60)
    }

    fn next(calendar: &Calendar, now: Instant, step: Step) -> Instant {
        match step {
            Step::Nanos(n) => now.saturating_add(Nanos::new(n)),
            Step::Hours(h) => now.saturating_add(Nanos::from_secs(3_600 * u64::from(h))),
            Step::ToEnd(back) => calendar
                .period(now)
                .end
                .saturating_sub(Nanos::new(u64::from(back)))
                .max(now),
        }
    }

    proptest! {
        #![proptest_config(common::config(96))]

        /// W: per period, exactly `rpu` (a model's count per period number decides alike);
        /// a denial waits until the period's end, and changes nothing.
        #[test]
        fn a_calendar_window_admits_rpu_per_period(
            zone in prop::sample::select(ZONES.to_vec()),
            week in any::<bool>(),
            rpu in 1u32..=5,
            offset in 0u64..(2 * 366 * 86_400),
            steps in steps(),
        ) {
            let unit = if week { CalendarUnit::Week } else { CalendarUnit::Month };
            let (Some(algo), Some(limit)) = (algorithm("W"), limit(unit, zone, rpu, rpu)) else {
                return Err(TestCaseError::fail("no W or no limit"));
            };
            let Some(calendar) = limit.calendar.clone() else {
                return Err(TestCaseError::fail("no calendar"));
            };
            let mut state = [0u64; 2];
            let mut counts: BTreeMap<u64, u32> = BTreeMap::new();
            let mut now = Instant::from_unix_nanos((START + offset) * 1_000_000_000);
            for (step, want) in steps {
                now = next(&calendar, now, step);
                let before = state;
                let verdict = algo.acquire_at_least(&limit, &mut state, now, want, want);
                let period = calendar.period(now);
                let count = counts.entry(calendar.index(now)).or_insert(0);
                if *count + want <= rpu {
                    prop_assert_eq!(verdict.granted, want);
                    *count += want;
                } else {
                    prop_assert_eq!(verdict.granted, 0);
                    prop_assert_eq!(state, before);
                    prop_assert_eq!(verdict.retry_after, period.end.saturating_since(now).max(Nanos::new(1)));
                }
                prop_assert_eq!(verdict.reset, period.end.saturating_since(now));
                prop_assert_eq!(verdict.remaining, u64::from(rpu - *count));
            }
        }

        /// TB: within one period, at most `burst` plus what `rpu` per period refills over the
        /// span of admissions (rounded up); over the whole run, at most `burst` plus `rpu`
        /// per period touched. A denial changes nothing and its wait is honest: at
        /// `now + retry_after` the same request passes.
        #[test]
        fn a_calendar_bucket_refills_rpu_per_period(
            zone in prop::sample::select(ZONES.to_vec()),
            week in any::<bool>(),
            rpu in 1u32..=5,
            burst in 1u32..=6,
            offset in 0u64..(2 * 366 * 86_400),
            steps in steps(),
        ) {
            let unit = if week { CalendarUnit::Week } else { CalendarUnit::Month };
            let (Some(algo), Some(limit)) = (algorithm("TB"), limit(unit, zone, rpu, burst)) else {
                return Err(TestCaseError::fail("no TB or no limit"));
            };
            let Some(calendar) = limit.calendar.clone() else {
                return Err(TestCaseError::fail("no calendar"));
            };
            let mut state = [0u64; 2];
            let mut now = Instant::from_unix_nanos((START + offset) * 1_000_000_000);
            let first = calendar.index(now);
            let mut admitted: Vec<(Instant, u32)> = Vec::new();
            for (step, want) in steps {
                let want = want.min(burst);
                now = next(&calendar, now, step);
                let before = state;
                let verdict = algo.acquire_at_least(&limit, &mut state, now, want, want);
                if verdict.granted == 0 {
                    prop_assert_eq!(state, before);
                    let mut copy = state;
                    let later = now.saturating_add(verdict.retry_after);
                    let retry = algo.acquire_at_least(&limit, &mut copy, later, want, want);
                    prop_assert_eq!(retry.granted, want, "not back after {:?}", verdict.retry_after);
                    continue;
                }
                admitted.push((now, verdict.granted));
                // Every span of admissions within one period.
                let period = calendar.period(now);
                let length = u128::from(period.length().get());
                let mut total = 0u128;
                for &(at, granted) in admitted.iter().rev() {
                    if at < period.start {
                        break;
                    }
                    total += u128::from(granted);
                    let span = u128::from(now.saturating_since(at).get());
                    let refill = (u128::from(rpu) * span).div_ceil(length);
                    prop_assert!(total <= u128::from(burst) + refill,
                        "{} admitted over {} ns of a {} ns period", total, span, length);
                }
            }
            let periods = u128::from(calendar.index(now) - first + 1);
            let all: u128 = admitted.iter().map(|&(_, granted)| u128::from(granted)).sum();
            prop_assert!(all <= u128::from(burst) + u128::from(rpu) * periods);
        }
    }
}
