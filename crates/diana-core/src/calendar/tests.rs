use super::*;
use proptest::prelude::*;

/// An RFC 3339 instant.
fn at(text: &str) -> Instant {
    let timestamp: Timestamp = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
    Instant::from_unix_nanos(u64::try_from(timestamp.as_nanosecond()).unwrap())
}

fn zone(name: &str) -> Zone {
    Zone::parse(name).unwrap_or_else(|e| panic!("{name}: {e}"))
}

const HOUR: u64 = 3_600 * NANOS_PER_SECOND;
const DAY: u64 = 24 * HOUR;

use CalendarUnit::{Month, Week};

/// Zone, unit, now, start, end, length.
type Case = (
    &'static str,
    CalendarUnit,
    &'static str,
    &'static str,
    &'static str,
    u64,
);

#[rustfmt::skip]
const CASES: &[Case] = &[
    // Months of their real length, leap years, the year's end.
    ("UTC", Month, "2024-02-15T12:00:00Z", "2024-02-01T00:00:00Z", "2024-03-01T00:00:00Z", 29 * DAY),
    ("UTC", Month, "2023-02-28T23:59:59.999999999Z", "2023-02-01T00:00:00Z", "2023-03-01T00:00:00Z", 28 * DAY),
    ("UTC", Month, "2100-02-10T00:00:00Z", "2100-02-01T00:00:00Z", "2100-03-01T00:00:00Z", 28 * DAY),
    ("UTC", Month, "2000-02-29T00:00:00Z", "2000-02-01T00:00:00Z", "2000-03-01T00:00:00Z", 29 * DAY),
    ("UTC", Month, "2024-04-30T23:00:00Z", "2024-04-01T00:00:00Z", "2024-05-01T00:00:00Z", 30 * DAY),
    ("UTC", Month, "2024-12-31T23:59:59Z", "2024-12-01T00:00:00Z", "2025-01-01T00:00:00Z", 31 * DAY),
    // A boundary belongs to the period it begins.
    ("UTC", Month, "2025-01-01T00:00:00Z", "2025-01-01T00:00:00Z", "2025-02-01T00:00:00Z", 31 * DAY),
    ("UTC", Month, "1970-01-01T00:00:00Z", "1970-01-01T00:00:00Z", "1970-02-01T00:00:00Z", 31 * DAY),
    // ISO weeks, across a year's end.
    ("UTC", Week, "2024-12-31T10:00:00Z", "2024-12-30T00:00:00Z", "2025-01-06T00:00:00Z", 7 * DAY),
    ("UTC", Week, "2021-01-01T00:00:00Z", "2020-12-28T00:00:00Z", "2021-01-04T00:00:00Z", 7 * DAY),
    ("UTC", Week, "2024-03-11T00:00:00Z", "2024-03-11T00:00:00Z", "2024-03-18T00:00:00Z", 7 * DAY),
    ("UTC", Week, "2024-03-10T23:59:59.999999999Z", "2024-03-04T00:00:00Z", "2024-03-11T00:00:00Z", 7 * DAY),
    // The week of the epoch is cut at it.
    ("UTC", Week, "1970-01-02T00:00:00Z", "1970-01-01T00:00:00Z", "1970-01-05T00:00:00Z", 4 * DAY),
    // Europe/Berlin: summer time begins in the last week of March, ends in October's.
    ("Europe/Berlin", Month, "2024-03-31T12:00:00+02:00", "2024-03-01T00:00:00+01:00", "2024-04-01T00:00:00+02:00", 31 * DAY - HOUR),
    ("Europe/Berlin", Month, "2024-10-27T12:00:00+01:00", "2024-10-01T00:00:00+02:00", "2024-11-01T00:00:00+01:00", 31 * DAY + HOUR),
    ("Europe/Berlin", Week, "2024-03-31T12:00:00+02:00", "2024-03-25T00:00:00+01:00", "2024-04-01T00:00:00+02:00", 7 * DAY - HOUR),
    ("Europe/Berlin", Week, "2024-10-27T12:00:00+01:00", "2024-10-21T00:00:00+02:00", "2024-10-28T00:00:00+01:00", 7 * DAY + HOUR),
    ("Europe/Berlin", Month, "2024-02-29T23:00:00Z", "2024-03-01T00:00:00+01:00", "2024-04-01T00:00:00+02:00", 31 * DAY - HOUR),
    ("Europe/Berlin", Month, "2024-02-29T22:59:59Z", "2024-02-01T00:00:00+01:00", "2024-03-01T00:00:00+01:00", 29 * DAY),
    // America/New_York.
    ("America/New_York", Week, "2024-03-10T12:00:00-04:00", "2024-03-04T00:00:00-05:00", "2024-03-11T00:00:00-04:00", 7 * DAY - HOUR),
    ("America/New_York", Week, "2024-11-03T12:00:00-05:00", "2024-10-28T00:00:00-04:00", "2024-11-04T00:00:00-05:00", 7 * DAY + HOUR),
    ("America/New_York", Month, "2025-01-01T03:00:00Z", "2024-12-01T00:00:00-05:00", "2025-01-01T00:00:00-05:00", 31 * DAY),
    // Australia/Lord_Howe: summer time is 30 minutes.
    ("Australia/Lord_Howe", Week, "2024-10-06T12:00:00+11:00", "2024-09-30T00:00:00+10:30", "2024-10-07T00:00:00+11:00", 7 * DAY - HOUR / 2),
    ("Australia/Lord_Howe", Month, "2024-04-10T12:00:00+10:30", "2024-04-01T00:00:00+11:00", "2024-05-01T00:00:00+10:30", 30 * DAY + HOUR / 2),
    // Asia/Kathmandu: +05:45.
    ("Asia/Kathmandu", Month, "2023-12-31T18:15:00Z", "2024-01-01T00:00:00+05:45", "2024-02-01T00:00:00+05:45", 31 * DAY),
    ("Asia/Kathmandu", Month, "2023-12-31T18:14:59Z", "2023-12-01T00:00:00+05:45", "2024-01-01T00:00:00+05:45", 31 * DAY),
    ("Asia/Kathmandu", Week, "2024-01-07T18:14:59Z", "2024-01-01T00:00:00+05:45", "2024-01-08T00:00:00+05:45", 7 * DAY),
    // Midnight in a gap: the period begins when the clocks land after it.
    ("America/Asuncion", Month, "2023-10-15T12:00:00-03:00", "2023-10-01T01:00:00-03:00", "2023-11-01T00:00:00-03:00", 31 * DAY - HOUR),
    ("America/Asuncion", Month, "2023-09-30T23:59:59-04:00", "2023-09-01T00:00:00-04:00", "2023-10-01T01:00:00-03:00", 30 * DAY),
    ("Asia/Tehran", Week, "2021-03-24T12:00:00+04:30", "2021-03-22T01:00:00+04:30", "2021-03-29T00:00:00+04:30", 7 * DAY - HOUR),
    ("Asia/Tehran", Week, "2021-03-21T20:29:00Z", "2021-03-15T00:00:00+03:30", "2021-03-22T01:00:00+04:30", 7 * DAY),
    // Midnight twice: the period begins at the first.
    ("America/Havana", Month, "2020-11-01T04:30:00Z", "2020-11-01T00:00:00-04:00", "2020-12-01T00:00:00-05:00", 30 * DAY + HOUR),
    ("America/Havana", Month, "2020-11-01T05:30:00Z", "2020-11-01T00:00:00-04:00", "2020-12-01T00:00:00-05:00", 30 * DAY + HOUR),
    // The clock set back over midnight a minute after it: the new month goes on.
    ("America/St_Johns", Month, "2009-11-01T02:45:00Z", "2009-11-01T00:00:00-02:30", "2009-12-01T00:00:00-03:30", 30 * DAY + HOUR),
    ("America/St_Johns", Month, "2009-11-01T02:29:00Z", "2009-10-01T00:00:00-02:30", "2009-11-01T00:00:00-02:30", 31 * DAY),
    // A skipped day (Samoa crossed the date line): not in the period.
    ("Pacific/Apia", Week, "2011-12-31T12:00:00+14:00", "2011-12-26T00:00:00-10:00", "2012-01-02T00:00:00+14:00", 6 * DAY),
    ("Pacific/Apia", Month, "2011-12-31T12:00:00+14:00", "2011-12-01T00:00:00-10:00", "2012-01-01T00:00:00+14:00", 30 * DAY),
];

#[test]
fn periods_follow_the_local_calendar() {
    for &(name, unit, now, start, end, length) in CASES {
        let calendar = Calendar::new(unit, zone(name));
        let found = calendar.period(at(now));
        assert_eq!(
            found,
            Period {
                start: at(start),
                end: at(end)
            },
            "{name} {unit:?} at {now}"
        );
        assert_eq!(
            found.length(),
            Nanos::new(length),
            "{name} {unit:?} at {now}"
        );
        assert_eq!(calendar.length(at(now)), Nanos::new(length));
        assert_eq!(period(at(now), unit, &zone(name)), found);
    }
}

#[test]
fn periods_are_numbered_one_after_another() {
    let utc = |unit| Calendar::new(unit, Zone::utc());
    let cases: &[(CalendarUnit, &str, u64)] = &[
        (Week, "1970-01-01T00:00:00Z", 0),
        (Week, "1970-01-04T23:59:59Z", 0),
        (Week, "1970-01-05T00:00:00Z", 1),
        (Week, "2024-12-31T00:00:00Z", 2870),
        (Week, "2025-01-06T00:00:00Z", 2871),
        (Month, "1970-01-01T00:00:00Z", 1),
        (Month, "1970-12-31T00:00:00Z", 12),
        (Month, "2024-12-31T23:59:59Z", 660),
        (Month, "2025-01-01T00:00:00Z", 661),
    ];
    for &(unit, now, index) in cases {
        assert_eq!(utc(unit).index(at(now)), index, "{unit:?} at {now}");
    }
    // The epoch in New York is still December 1969: month 0.
    let new_york = Calendar::new(Month, zone("America/New_York"));
    assert_eq!(new_york.index(Instant::EPOCH), 0);
    assert_eq!(new_york.index(at("1970-01-01T05:00:00Z")), 1);
    assert_eq!(
        new_york.periods_between(at("2024-01-15T00:00:00Z"), at("2024-03-01T04:59:59Z")),
        1
    );
    assert_eq!(
        new_york.periods_between(at("2024-01-15T00:00:00Z"), at("2024-03-01T05:00:00Z")),
        2
    );
    assert_eq!(
        new_york.periods_between(at("2024-03-01T05:00:00Z"), at("2024-01-15T00:00:00Z")),
        0
    );
}

#[test]
fn the_seconds_to_a_period_s_end_are_rounded_up() {
    let month = Calendar::new(Month, zone("Europe/Berlin"));
    let cases: &[(&str, u64)] = &[
        ("2024-03-31T23:59:59+02:00", 1),
        ("2024-03-31T23:59:59.000000001+02:00", 1),
        ("2024-03-31T23:59:58.5+02:00", 2),
        ("2024-03-31T00:00:00+02:00", 86_400),
        ("2024-03-01T00:00:00+01:00", 31 * 86_400 - 3_600),
    ];
    for &(now, seconds) in cases {
        assert_eq!(month.seconds_to_end(at(now)), seconds, "{now}");
    }
    let period = month.period(at("2024-03-15T00:00:00Z"));
    assert_eq!(period.seconds_to_end(period.end), 0);
    assert_eq!(period.seconds_to_end(at("2025-01-01T00:00:00Z")), 0);
}

#[test]
fn zone_names_are_iana_names() {
    let cases: &[(&str, Result<&str, ZoneError>)] = &[
        ("UTC", Ok("UTC")),
        ("utc", Ok("UTC")),
        ("Europe/Berlin", Ok("Europe/Berlin")),
        ("europe/berlin", Ok("Europe/Berlin")),
        (
            "America/Argentina/ComodRivadavia",
            Ok("America/Argentina/ComodRivadavia"),
        ),
        ("Etc/GMT+5", Ok("Etc/GMT+5")),
        ("", Err(ZoneError::Empty)),
        (
            "Mars/Olympus_Mons",
            Err(ZoneError::Unknown {
                name: "Mars/Olympus_Mons".into(),
            }),
        ),
        (
            "+05:00",
            Err(ZoneError::Unknown {
                name: "+05:00".into(),
            }),
        ),
        (
            "EST5EDT,M3.2.0,M11.1.0",
            Err(ZoneError::Unknown {
                name: "EST5EDT,M3.2.0,M11.1.0".into(),
            }),
        ),
        (
            "Europe/Berlin ",
            Err(ZoneError::Unknown {
                name: "Europe/Berlin ".into(),
            }),
        ),
        (
            "../../etc/passwd",
            Err(ZoneError::Unknown {
                name: "../../etc/passwd".into(),
            }),
        ),
    ];
    for (name, expected) in cases {
        let parsed = Zone::parse(name);
        assert_eq!(
            parsed.as_ref().map(Zone::name),
            expected.as_ref().map(|s| *s),
            "{name:?}"
        );
    }
    let long = "A".repeat(ZONE_NAME_MAX + 1);
    assert_eq!(
        Zone::parse(&long),
        Err(ZoneError::TooLong {
            length: ZONE_NAME_MAX + 1
        })
    );
    assert_eq!(Zone::default(), Zone::utc());
    assert_eq!(
        ZoneError::Unknown {
            name: "Mars".into()
        }
        .to_string(),
        "\"Mars\" is not an IANA time zone name (such as Europe/Berlin or UTC)"
    );
}

/// Zones with every kind of change the calendar must get right.
const ZONES: &[&str] = &[
    "UTC",
    "Europe/Berlin",
    "America/New_York",
    "Australia/Lord_Howe",
    "Asia/Kathmandu",
    "America/Asuncion",
    "Asia/Tehran",
    "America/Havana",
    "America/St_Johns",
    "Pacific/Apia",
    "Pacific/Kiritimati",
    "Antarctica/Troll",
    "Pacific/Chatham",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn every_instant_is_in_one_period_and_periods_follow_one_another(
        // Up to 2500: the last period of u64 time is cut (see the module's docs).
        nanos in 0u64..16_725_225_600_000_000_000,
        zone_index in 0..ZONES.len(),
        week in any::<bool>(),
    ) {
        let unit = if week { Week } else { Month };
        let calendar = Calendar::new(unit, zone(ZONES[zone_index]));
        let now = Instant::from_unix_nanos(nanos);
        let found = calendar.period(now);
        prop_assert!(found.start <= now && now < found.end, "{:?} {:?}", now, found);
        // The next period begins where this one ends, and is numbered next.
        let next = calendar.period(found.end);
        prop_assert_eq!(next.start, found.end);
        prop_assert_eq!(calendar.index(found.end), calendar.index(now) + 1);
        prop_assert_eq!(calendar.period(found.start), found);
        // The previous one ends where this one begins (unless cut at the epoch).
        if found.start > Instant::EPOCH {
            let before = found.start.saturating_sub(Nanos::new(1));
            prop_assert_eq!(calendar.period(before).end, found.start);
            prop_assert_eq!(calendar.index(before) + 1, calendar.index(now));
        }
        // As long as the calendar says, give or take the clock's changes (Apia skipped a
        // day; Troll's summer time is two hours).
        let length = found.length().get();
        let (shortest, longest) = match unit {
            Week => (6 * DAY, 7 * DAY + 3 * HOUR),
            Month => (28 * DAY - 3 * HOUR, 31 * DAY + 3 * HOUR),
        };
        prop_assert!(
            (shortest..=longest).contains(&length) || found.start == Instant::EPOCH,
            "{:?} lasts {} h", found, length / HOUR
        );
        prop_assert_eq!(found.seconds_to_end(now), (found.end.unix_nanos() - nanos).div_ceil(NANOS_PER_SECOND));
    }
}

#[test]
fn the_last_period_of_u64_time_ends_at_its_last_instant() {
    let last = Instant::from_unix_nanos(u64::MAX);
    for unit in [Week, Month] {
        let found = Calendar::new(unit, Zone::utc()).period(last);
        assert_eq!(found.end, last);
        assert!(found.start < last);
    }
}
