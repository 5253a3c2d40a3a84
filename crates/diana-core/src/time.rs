//! Time as the core sees it: nanoseconds since the Unix epoch, passed in by the caller.
//! Nothing in the core reads a clock, so tests drive time exactly.

use std::fmt;

/// An instant: nanoseconds since the Unix epoch (UTC), as the host's clock tells it.
pub type Instant = u64;

/// A span of time in nanoseconds (a wait, a period, a lifetime): never an instant. Kept
/// apart from [`Instant`] by name, so that a signature says which one it means.
pub type Nanos = u64;

pub const NANOS_PER_SECOND: Nanos = 1_000_000_000;

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
        self.seconds() * NANOS_PER_SECOND
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
