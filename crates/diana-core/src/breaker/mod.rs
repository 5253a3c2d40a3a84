//! The circuit breaker of a resource's upstream (`breaker:`, DESIGN §4b): when the calls
//! to the upstream behind a resource get slow or fail past a threshold, fail fast for a
//! while instead of piling more requests onto it, then probe, and close again once it
//! answers well.
//!
//! (Not the quota service's outage fallback of global rules, [`crate::global::outage`].)
//!
//! ```text
//!               calls ≥ min_calls in the window, and slow share ≥ slow_ratio
//!               or failed share ≥ failure_ratio
//!   ┌────────┐ ──────────────────────────────────────────────▶ ┌──────┐ fail fast, Retry-After
//!   │ closed │                                                 │ open │ = seconds until
//!   └────────┘                                                 └──────┘ half-open
//!        ▲                                                       │    ▲
//!        │ every probe good               open_for over          │    │ one probe slow or
//!        │ (window cleared)           (when next looked at)      │    │ failed, or held past
//!        │                  ┌───────────┐ ◀──────────────────────┘    │ probe_timeout
//!        └───────────────── │ half-open │ ────────────────────────────┘
//!                           └───────────┘
//!     half_open_calls places: a request takes a free one (it probes) or fails fast
//!     (Retry-After: 1); a probe that a rule then rejects gives its place back.
//!
//!   force: open    every request fails fast, Retry-After = open_seconds
//!   force: closed  never trips; calls still counted
//!   Either switch puts the machine in `closed` underneath; back to `auto`, it goes on
//!   from the calls its window has counted, not from a stale opening.
//! ```
//!
//! - A *call* is the time from the request leaving Diana to the response headers
//!   ([`Settings::judge`]): slow when strictly later than `slow_ms`, failed when its status
//!   is in `failure_status` or it ended without one (a reset, an upstream timeout).
//!   Requests Diana itself answers are not calls; calls answered while open or half-open
//!   (in flight when it opened) are not counted either.
//! - The window slides in [`settings::SLICES`] slices of `window_seconds / 10`. A ratio is
//!   reached when `count × 1,000,000 ≥ ppm × calls` ([`Ratio`]), so exactly `min_calls`
//!   calls with exactly the share trip it.
//! - A probe's place held for [`Settings::probe_timeout`] without an outcome (twice
//!   `slow_ms`, at least 1 s; 60 s without `slow_ms`) counts as a failed probe: a lost
//!   outcome never wedges the breaker half-open.
//! - A reload: the newer document's parameters win, whichever worker applies them first;
//!   a changed `force` goes through `closed` keeping the window, a changed window length
//!   clears it, a changed `half_open_calls` restarts a round, a shorter `open_seconds`
//!   shortens an opening ([`State::sync`]).
//! - A clock that steps back never keeps it open or half-open for longer than the step's
//!   own `open_seconds` or `probe_timeout`.
//! - Every transition comes back as a value with its figures ([`Transition`]), once, to
//!   the caller whose write made it: the caller logs one line and counts it.
//!
//! Pieces: [`settings`] (the document's fields, valid by construction, and judging a
//! call), [`machine`] (the pure state machine over a plain [`State`]: the gateway, the
//! quota service's embedded store and its Lua port run the same integers), [`record`]
//! (the state in shared data, one per gateway process, with each worker's [`Handle`] that
//! keeps a closed breaker off the request path, and the *followed* mode of `scope:
//! global`), [`tap`] (a closed breaker's good calls counted where the request is, by a
//! binding that keeps a request's calls itself).

pub mod machine;
pub mod record;
pub mod settings;
pub mod spec;
pub mod tap;

pub use machine::{Admission, Phase, Place, State, Ticket};
pub use record::{
    record_key, Checked, FleetAnswer, Handle, PlaceClaim, Probe, Record, Report, Source,
    FLEET_REPORT_EVERY,
};
pub use settings::{
    CallJudge, Edition, Force, Params, Ratio, RatioError, Reach, Settings, SettingsError,
    SlowCalls, StatusClasses, StatusError, Window,
};
pub use spec::Spec;
pub use tap::Tap;

use serde::{Deserialize, Serialize};
use std::fmt;

/// One call's outcome ([`Settings::judge`]). A call may be both slow and failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Outcome {
    pub slow: bool,
    pub failed: bool,
}

impl Outcome {
    /// A good call: in time and not failed.
    pub const GOOD: Outcome = Outcome {
        slow: false,
        failed: false,
    };

    /// What a probe whose outcome never came counts as.
    pub const LOST: Outcome = Outcome {
        slow: false,
        failed: true,
    };

    pub const fn is_good(self) -> bool {
        !self.slow && !self.failed
    }
}

/// The status a call whose response headers came is judged by ([`Settings::judge`]): the
/// one read, or 200's when it cannot be read — an unreadable status is no verdict on the
/// upstream (its time still counts). `None` is for a call that ended without response
/// headers, which failed.
pub const fn answered_status(read: Option<u16>) -> Option<u16> {
    match read {
        Some(status) => Some(status),
        None => Some(200),
    }
}

/// Counts of calls: how many, how many slow, how many failed (a call may be both).
/// Counts saturate; `slow` and `failed` never exceed `calls` once [`Tally::normalised`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Tally {
    pub calls: u32,
    pub slow: u32,
    pub failed: u32,
}

impl Tally {
    pub const ZERO: Tally = Tally {
        calls: 0,
        slow: 0,
        failed: 0,
    };

    pub fn of(outcome: Outcome) -> Tally {
        Tally {
            calls: 1,
            slow: u32::from(outcome.slow),
            failed: u32::from(outcome.failed),
        }
    }

    pub fn add(&mut self, outcome: Outcome) {
        *self = self.merge(Tally::of(outcome));
    }

    pub fn merge(self, other: Tally) -> Tally {
        Tally {
            calls: self.calls.saturating_add(other.calls),
            slow: self.slow.saturating_add(other.slow),
            failed: self.failed.saturating_add(other.failed),
        }
    }

    pub const fn is_empty(self) -> bool {
        self.calls == 0 && self.slow == 0 && self.failed == 0
    }

    /// With `slow` and `failed` at most `calls` (a tally from the wire may say otherwise).
    pub fn normalised(self) -> Tally {
        Tally {
            calls: self.calls,
            slow: self.slow.min(self.calls),
            failed: self.failed.min(self.calls),
        }
    }

    /// The slow share in parts per million (0 on no calls).
    pub fn slow_ppm(self) -> u32 {
        share_ppm(self.slow, self.calls)
    }

    /// The failed share in parts per million (0 on no calls).
    pub fn failed_ppm(self) -> u32 {
        share_ppm(self.failed, self.calls)
    }
}

fn share_ppm(count: u32, calls: u32) -> u32 {
    if calls == 0 {
        return 0;
    }
    let ppm = u64::from(count.min(calls)) * u64::from(settings::PPM) / u64::from(calls);
    u32::try_from(ppm).unwrap_or(settings::PPM)
}

/// Probe outcomes as counts (what a gateway following the fleet reports): the good ones,
/// and a tally of the bad ones (how many, how many slow, how many failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct ProbeTally {
    pub good: u32,
    pub bad: Tally,
}

impl ProbeTally {
    pub fn add(&mut self, outcome: Outcome) {
        if outcome.is_good() {
            self.good = self.good.saturating_add(1);
        } else {
            self.bad.add(outcome);
        }
    }

    pub fn merge(self, other: ProbeTally) -> ProbeTally {
        ProbeTally {
            good: self.good.saturating_add(other.good),
            bad: self.bad.merge(other.bad),
        }
    }

    pub const fn is_empty(self) -> bool {
        self.good == 0 && self.bad.is_empty()
    }
}

/// A breaker's state as metrics and logs show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Closed,
    Open,
    HalfOpen,
}

impl Status {
    /// The value of `diana_breaker_state`: 0 closed, 1 open, 2 half-open.
    pub const fn gauge(self) -> u8 {
        match self {
            Status::Closed => 0,
            Status::Open => 1,
            Status::HalfOpen => 2,
        }
    }

    pub const fn from_gauge(gauge: u8) -> Option<Status> {
        match gauge {
            0 => Some(Status::Closed),
            1 => Some(Status::Open),
            2 => Some(Status::HalfOpen),
            _ => None,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Status::Closed => "closed",
            Status::Open => "open",
            Status::HalfOpen => "half-open",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a transition happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// Closed → open: the window reached the slow ratio, the failure ratio, or both.
    Tripped { slow: bool, failed: bool },
    /// Open → half-open: `open_seconds` are over.
    Elapsed,
    /// Half-open → closed: every probe answered well.
    Recovered,
    /// Half-open → open: a probe was slow or failed.
    ProbeFailed,
    /// Half-open → open: a probe's outcome did not come within `probe_timeout`.
    ProbeLost,
    /// The manual switch was set to this value (`auto`: lifted).
    Forced(Force),
    /// Scope global: the state the quota service answered for the fleet.
    Fleet,
    /// Scope global: the quota service stopped answering; the gateway's own breaker
    /// decides again.
    FleetLost,
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cause::Tripped {
                slow: true,
                failed: true,
            } => f.write_str("slow and failed shares reached"),
            Cause::Tripped { slow: true, .. } => f.write_str("slow share reached"),
            Cause::Tripped { .. } => f.write_str("failed share reached"),
            Cause::Elapsed => f.write_str("open_seconds over"),
            Cause::Recovered => f.write_str("every probe answered well"),
            Cause::ProbeFailed => f.write_str("a probe was slow or failed"),
            Cause::ProbeLost => f.write_str("a probe's outcome never came"),
            Cause::Forced(force) => write!(f, "force: {force}"),
            Cause::Fleet => f.write_str("the fleet's state"),
            Cause::FleetLost => f.write_str("quota service silent, deciding locally"),
        }
    }
}

/// One change of a breaker's state, with the figures that decided it: the window's calls
/// for a trip or a switch, the round's probes for a half-open outcome, none for the end of
/// an opening.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transition {
    pub from: Status,
    pub to: Status,
    pub cause: Cause,
    pub figures: Tally,
}

/// The transitions one operation made (rarely more than one; none on most calls, and then
/// nothing is allocated).
pub type Transitions = Vec<Transition>;

/// `closed -> open (slow share reached): 20 calls, 55.0% slow, 5.0% failed`: the caller
/// puts the breaker's name in front.
impl fmt::Display for Transition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let percent = |ppm: u32| format!("{}.{}%", ppm / 10_000, ppm % 10_000 / 1_000);
        write!(
            f,
            "{} -> {} ({}): {} calls, {} slow, {} failed",
            self.from,
            self.to,
            self.cause,
            self.figures.calls,
            percent(self.figures.slow_ppm()),
            percent(self.figures.failed_ppm()),
        )
    }
}
