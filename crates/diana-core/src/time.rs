//! Time as the core sees it: nanoseconds since the Unix epoch, passed in by the caller.
//! Nothing in the core reads a clock, so tests drive time exactly.
//!
//! Two types, never mixed up: an [`Instant`] (a point on the host's clock) and [`Nanos`]
//! (a span: a wait, a period, a lifetime). Both are `u64` nanoseconds underneath, which is
//! what counters' states, shared data and the wire store; the conversion happens where a
//! value crosses that boundary (`from_unix_nanos`/`unix_nanos`, `Nanos::new`/`get`).

use std::fmt;

/// An instant: nanoseconds since the Unix epoch (UTC), as the host's clock tells it.
///
/// A distinct type from [`Nanos`] (a span of time): an instant plus a span is an instant,
/// an instant minus an instant is a span, and an instant is never a wait or a period. The
/// arithmetic is `u64`'s, with its rules (the `saturating_`/`checked_` forms where a
/// caller needs them), so moving a computation onto these types changes no result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Instant(u64);

/// A span of time in nanoseconds (a wait, a period, a lifetime): never an instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Nanos(u64);

impl Instant {
    /// The Unix epoch; in a fresh state, "never".
    pub const EPOCH: Instant = Instant(0);

    pub const fn from_unix_nanos(nanos: u64) -> Instant {
        Instant(nanos)
    }

    /// Nanoseconds since the Unix epoch: the form a counter's state and the wire carry.
    pub const fn unix_nanos(self) -> u64 {
        self.0
    }

    /// The time from `earlier` to `self`, or zero if `earlier` is not earlier.
    pub const fn saturating_since(self, earlier: Instant) -> Nanos {
        Nanos(self.0.saturating_sub(earlier.0))
    }

    pub const fn saturating_add(self, span: Nanos) -> Instant {
        Instant(self.0.saturating_add(span.0))
    }

    pub const fn saturating_sub(self, span: Nanos) -> Instant {
        Instant(self.0.saturating_sub(span.0))
    }

    /// How many whole `span`s have passed since the epoch: the number of the period of
    /// length `span` that `self` falls in.
    pub const fn periods(self, span: Nanos) -> u64 {
        self.0 / span.0
    }
}

impl Nanos {
    pub const ZERO: Nanos = Nanos(0);
    pub const MAX: Nanos = Nanos(u64::MAX);

    pub const fn new(nanos: u64) -> Nanos {
        Nanos(nanos)
    }

    pub const fn from_millis(millis: u64) -> Nanos {
        Nanos(millis * 1_000_000)
    }

    /// `millis` milliseconds, or the longest span there is if that does not fit.
    pub const fn saturating_from_millis(millis: u64) -> Nanos {
        Nanos(millis.saturating_mul(1_000_000))
    }

    /// Whole milliseconds, rounded down: the unit of the wire's times.
    pub const fn whole_millis(self) -> u64 {
        self.0 / 1_000_000
    }

    pub const fn from_secs(seconds: u64) -> Nanos {
        Nanos(seconds * NANOS_PER_SECOND.0)
    }

    /// A `std` duration, or the longest span there is if it does not fit.
    pub fn saturating_from_std(duration: std::time::Duration) -> Nanos {
        Nanos(u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX))
    }

    pub const fn get(self) -> u64 {
        self.0
    }

    pub const fn is_zero(self) -> bool {
        self.0 == 0
    }

    pub const fn saturating_mul(self, times: u64) -> Nanos {
        Nanos(self.0.saturating_mul(times))
    }

    /// How many whole `span`s fit, rounded up.
    pub const fn div_ceil(self, span: Nanos) -> u64 {
        self.0.div_ceil(span.0)
    }
}

impl std::ops::Add<Nanos> for Instant {
    type Output = Instant;
    fn add(self, span: Nanos) -> Instant {
        Instant(self.0 + span.0)
    }
}

impl std::ops::AddAssign<Nanos> for Instant {
    fn add_assign(&mut self, span: Nanos) {
        self.0 += span.0;
    }
}

impl std::ops::Sub<Nanos> for Instant {
    type Output = Instant;
    fn sub(self, span: Nanos) -> Instant {
        Instant(self.0 - span.0)
    }
}

impl std::ops::Sub for Instant {
    type Output = Nanos;
    fn sub(self, earlier: Instant) -> Nanos {
        Nanos(self.0 - earlier.0)
    }
}

impl std::ops::Add for Nanos {
    type Output = Nanos;
    fn add(self, other: Nanos) -> Nanos {
        Nanos(self.0 + other.0)
    }
}

impl std::ops::AddAssign for Nanos {
    fn add_assign(&mut self, other: Nanos) {
        self.0 += other.0;
    }
}

impl std::ops::Sub for Nanos {
    type Output = Nanos;
    fn sub(self, other: Nanos) -> Nanos {
        Nanos(self.0 - other.0)
    }
}

impl std::ops::Mul<u64> for Nanos {
    type Output = Nanos;
    fn mul(self, times: u64) -> Nanos {
        Nanos(self.0 * times)
    }
}

impl std::ops::Mul<Nanos> for u64 {
    type Output = Nanos;
    fn mul(self, span: Nanos) -> Nanos {
        Nanos(self * span.0)
    }
}

impl std::ops::Div<u64> for Nanos {
    type Output = Nanos;
    fn div(self, parts: u64) -> Nanos {
        Nanos(self.0 / parts)
    }
}

/// How many whole `span`s fit.
impl std::ops::Div for Nanos {
    type Output = u64;
    fn div(self, span: Nanos) -> u64 {
        self.0 / span.0
    }
}

pub const NANOS_PER_SECOND: Nanos = Nanos(1_000_000_000);

/// The period a rule's `rpu` (requests per unit) is counted over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
}

impl Unit {
    pub const ALL: [Unit; 4] = [Unit::Second, Unit::Minute, Unit::Hour, Unit::Day];

    pub const fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
        }
    }

    pub const fn nanos(self) -> Nanos {
        Nanos::from_secs(self.seconds())
    }

    pub const fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
        }
    }

    /// Parses `second`, `minute`, `hour`, `day` (case-insensitive; a trailing `s` is accepted).
    pub fn parse(text: &str) -> Option<Unit> {
        let lower = text.trim().to_ascii_lowercase();
        let word = lower.strip_suffix('s').unwrap_or(&lower);
        Unit::ALL.into_iter().find(|unit| unit.name() == word)
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the current time comes from, read only when a decision needs it (a policy that
/// matches nothing never reads the clock). `None`: the clock could not be read.
pub trait Clock {
    fn now(&self) -> Option<Instant>;
}

/// A time already read (or known to be unavailable).
impl Clock for Option<Instant> {
    fn now(&self) -> Option<Instant> {
        *self
    }
}

/// Rounds a duration up to whole seconds, at least 1: the form `Retry-After` needs.
pub fn ceil_seconds_at_least_one(duration: Nanos) -> u64 {
    duration.div_ceil(NANOS_PER_SECOND).max(1)
}

/// Rounds a duration up to whole seconds (0 stays 0).
pub fn ceil_seconds(duration: Nanos) -> u64 {
    duration.div_ceil(NANOS_PER_SECOND)
}
