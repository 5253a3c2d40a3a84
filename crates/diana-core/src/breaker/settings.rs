//! A breaker's settings (the document's `breaker:`), the figures they are built from, and
//! how one call is judged.
//!
//! Everything here is valid by construction: a ratio is a [`Ratio`] in (0, 1], a window
//! is whole seconds ([`Window`]), `min_calls` and `half_open_calls` cannot be 0, and a
//! [`Settings`] has at least one threshold ([`Settings::new`] refuses one with neither).
//! The state machine reads the integer part of them, [`Params`]: no floating point past
//! the parser, so that the gateway, the quota service's embedded store and its Lua port in
//! Redis compute the same thresholds exactly.

use super::{Outcome, Tally};
use crate::time::{Instant, Nanos};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::num::{NonZeroU32, NonZeroU8};

/// Parts per million in a whole: a [`Ratio`] of 1.
pub const PPM: u32 = 1_000_000;

/// `min_calls` when the document does not say.
pub const DEFAULT_MIN_CALLS: NonZeroU32 = match NonZeroU32::new(20) {
    Some(calls) => calls,
    None => NonZeroU32::MIN,
};
/// `window_seconds` when the document does not say.
pub const DEFAULT_WINDOW: Window = match NonZeroU32::new(10) {
    Some(seconds) => Window(seconds),
    None => Window(NonZeroU32::MIN),
};
/// `open_seconds` when the document does not say.
pub const DEFAULT_OPEN_FOR: Nanos = Nanos::from_secs(30);
/// `half_open_calls` when the document does not say.
pub const DEFAULT_HALF_OPEN_CALLS: NonZeroU8 = match NonZeroU8::new(3) {
    Some(calls) => calls,
    None => NonZeroU8::MIN,
};

/// The time slices a [`Window`] is cut into: it slides one tenth at a time.
pub const SLICES: usize = 10;

/// The least time a probe has before its missing outcome counts as failed, when the
/// breaker judges slow calls ([`Settings::probe_timeout`]).
pub const PROBE_TIMEOUT_FLOOR: Nanos = Nanos::from_secs(1);

/// A probe's missing outcome counts as failed after this long when the breaker does not
/// judge slow calls: nginx's default `proxy_read_timeout` (Envoy's default route timeout
/// is 15 s), so by then the gateway itself has answered or timed the call out, and an
/// outcome that has still not come is lost.
pub const PROBE_TIMEOUT_WITHOUT_SLOW: Nanos = Nanos::from_secs(60);

/// A share in (0, 1], kept in parts per million.
///
/// Integral so that every implementation of the machine agrees: a share is reached when
/// `count × 1,000,000 ≥ ppm × calls`, which for 32-bit counts stays below 2^53 and is
/// exact in Lua's doubles too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub struct Ratio(NonZeroU32);

/// Why a number is not a [`Ratio`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RatioError {
    /// Zero or below (or not a number at all).
    NotAbove0,
    /// Above 1.
    Above1,
    /// Above 0 but below one part in a million: the machine's resolution.
    FinerThanAMillionth,
}

impl fmt::Display for RatioError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RatioError::NotAbove0 => "a ratio must be above 0 (and at most 1)",
            RatioError::Above1 => "a ratio must be at most 1 (and above 0)",
            RatioError::FinerThanAMillionth => "a ratio must be at least 0.000001",
        })
    }
}

impl std::error::Error for RatioError {}

impl Ratio {
    /// A ratio of `ppm` parts per million, 1 to 1,000,000.
    pub const fn from_ppm(ppm: u32) -> Result<Ratio, RatioError> {
        match NonZeroU32::new(ppm) {
            None => Err(RatioError::NotAbove0),
            Some(_) if ppm > PPM => Err(RatioError::Above1),
            Some(ppm) => Ok(Ratio(ppm)),
        }
    }

    /// The ratio a document writes (`0.5`), rounded to the nearest part per million.
    pub fn from_f64(value: f64) -> Result<Ratio, RatioError> {
        if value > 1.0 {
            return Err(RatioError::Above1);
        }
        // NaN is neither above 0 nor at most 1: refused here with zero and below.
        if value.is_nan() || value <= 0.0 {
            return Err(RatioError::NotAbove0);
        }
        let ppm = (value * f64::from(PPM)).round();
        if ppm < 1.0 {
            return Err(RatioError::FinerThanAMillionth);
        }
        // In [1, 1e6] by the checks above: the cast is exact.
        Ratio::from_ppm(ppm as u32)
    }

    pub const fn ppm(self) -> u32 {
        self.0.get()
    }

    /// True when `count` of `calls` is at least this share (never on no calls).
    pub fn reached_by(self, count: u32, calls: u32) -> bool {
        calls > 0 && u64::from(count) * u64::from(PPM) >= u64::from(self.ppm()) * u64::from(calls)
    }
}

impl TryFrom<u32> for Ratio {
    type Error = RatioError;
    fn try_from(ppm: u32) -> Result<Ratio, RatioError> {
        Ratio::from_ppm(ppm)
    }
}

impl From<Ratio> for u32 {
    fn from(ratio: Ratio) -> u32 {
        ratio.ppm()
    }
}

/// As a document writes it: `0.5`, `1`, `0.000001`.
impl fmt::Display for Ratio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (whole, part) = (self.ppm() / PPM, self.ppm() % PPM);
        if part == 0 {
            return write!(f, "{whole}");
        }
        let digits = format!("{part:06}");
        write!(f, "{whole}.{}", digits.trim_end_matches('0'))
    }
}

/// `slow_ms` and `slow_ratio`: a call whose response headers come later than `threshold`
/// is slow; the breaker opens when at least `ratio` of the window's calls were.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlowCalls {
    pub threshold: Nanos,
    pub ratio: Ratio,
}

/// Whose calls a breaker's state follows (`scope`): this gateway process's (`local`), or
/// every gateway's, kept by the quota service (`global`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Reach {
    #[default]
    Gateway,
    Fleet,
}

impl Reach {
    /// As the document writes it (`scope`).
    pub const fn name(self) -> &'static str {
        match self {
            Reach::Gateway => "local",
            Reach::Fleet => "global",
        }
    }
}

/// `force`: the manual switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Force {
    /// The breaker decides from the calls.
    #[default]
    Auto,
    /// Every request fails fast (or goes to the fallback), whatever the calls say.
    Open,
    /// Never trips; calls are still counted.
    Closed,
}

impl Force {
    pub const fn name(self) -> &'static str {
        match self {
            Force::Auto => "auto",
            Force::Open => "open",
            Force::Closed => "closed",
        }
    }

    pub(super) const fn code(self) -> u8 {
        match self {
            Force::Auto => 0,
            Force::Open => 1,
            Force::Closed => 2,
        }
    }

    pub(super) const fn from_code(code: u8) -> Option<Force> {
        match code {
            0 => Some(Force::Auto),
            1 => Some(Force::Open),
            2 => Some(Force::Closed),
            _ => None,
        }
    }
}

impl fmt::Display for Force {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `window_seconds`: how far back the breaker looks, in whole seconds, cut into
/// [`SLICES`] slices (a slice is a whole number of 100 ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Window(NonZeroU32);

impl Window {
    pub const fn from_secs(seconds: NonZeroU32) -> Window {
        Window(seconds)
    }

    pub const fn seconds(self) -> u32 {
        self.0.get()
    }

    /// The window's length.
    pub const fn span(self) -> Nanos {
        Nanos::from_secs(self.0.get() as u64)
    }

    /// One slice's length: a tenth of the window, exactly (whole seconds / 10).
    pub const fn slice(self) -> Nanos {
        Nanos::new(self.span().get() / SLICES as u64)
    }
}

impl Default for Window {
    fn default() -> Window {
        DEFAULT_WINDOW
    }
}

/// `failure_status`: the response statuses that count as a failure (a call that ends
/// without one — a reset, an upstream timeout — always does). Any of 100 to 599, as single
/// statuses or whole classes (`"5xx"`). A status outside 100–599 is in no class.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct StatusClasses {
    /// Bit `status - 100`.
    bits: [u64; 8],
}

/// What judging one call reads of a breaker's settings: `slow_ms` and `failure_status`
/// (a copy, for the [`super::Tap`] a binding counts good calls in without its worker).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallJudge {
    /// `slow_ms` (`None`: slow calls are not judged).
    pub slow_after: Option<Nanos>,
    pub failure_status: StatusClasses,
}

impl CallJudge {
    /// [`Settings::judge`].
    pub fn judge(&self, duration: Nanos, status: Option<u16>) -> Outcome {
        Outcome {
            slow: self.slow_after.is_some_and(|slow| duration > slow),
            failed: status.is_none_or(|status| self.failure_status.contains(status)),
        }
    }

    /// Whether a call's time is part of its verdict (`slow_ms`): only then is the clock
    /// read for it.
    pub fn times_calls(&self) -> bool {
        self.slow_after.is_some()
    }
}

/// Why an item of `failure_status` is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StatusError {
    /// A status outside 100–599.
    OutOfRange(u32),
    /// Text that is neither a status nor a class `1xx` to `5xx`.
    NotAClass(String),
}

impl fmt::Display for StatusError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StatusError::OutOfRange(status) => {
                write!(f, "status {status} is not between 100 and 599")
            }
            StatusError::NotAClass(text) => write!(
                f,
                "{text:?} is neither a status nor a class \"1xx\" to \"5xx\""
            ),
        }
    }
}

impl std::error::Error for StatusError {}

const FIRST_STATUS: u16 = 100;
const LAST_STATUS: u16 = 599;

impl StatusClasses {
    /// No status fails: only calls without an answer do (`failure_status: []`).
    pub const fn none() -> StatusClasses {
        StatusClasses { bits: [0; 8] }
    }

    /// `[5xx]`, the default.
    pub fn server_errors() -> StatusClasses {
        let mut classes = StatusClasses::none();
        classes.insert_range(500, 599);
        classes
    }

    /// Adds one status, 100 to 599.
    pub fn add_status(&mut self, status: u32) -> Result<(), StatusError> {
        match u16::try_from(status) {
            Ok(status) if (FIRST_STATUS..=LAST_STATUS).contains(&status) => {
                self.insert_range(status, status);
                Ok(())
            }
            _ => Err(StatusError::OutOfRange(status)),
        }
    }

    /// Adds an item as a document writes it: a status (`"503"`) or a class (`"5xx"`,
    /// any case).
    pub fn add(&mut self, item: &str) -> Result<(), StatusError> {
        let refused = || StatusError::NotAClass(item.chars().take(16).collect());
        let bytes = item.as_bytes();
        if let [class @ b'1'..=b'5', x, y] = bytes {
            if x.eq_ignore_ascii_case(&b'x') && y.eq_ignore_ascii_case(&b'x') {
                let first = u16::from(class - b'0') * 100;
                self.insert_range(first, first + 99);
                return Ok(());
            }
        }
        if bytes.is_empty() || bytes.len() > 3 || !bytes.iter().all(u8::is_ascii_digit) {
            return Err(refused());
        }
        let status = item.parse::<u32>().map_err(|_| refused())?;
        self.add_status(status)
    }

    /// True when `status` counts as a failure.
    pub fn contains(&self, status: u16) -> bool {
        let Some(bit) = status.checked_sub(FIRST_STATUS) else {
            return false;
        };
        status <= LAST_STATUS
            && self
                .bits
                .get(usize::from(bit / 64))
                .is_some_and(|word| word & (1 << (bit % 64)) != 0)
    }

    fn insert_range(&mut self, first: u16, last: u16) {
        for status in first..=last {
            let bit = status - FIRST_STATUS;
            if let Some(word) = self.bits.get_mut(usize::from(bit / 64)) {
                *word |= 1 << (bit % 64);
            }
        }
    }
}

impl Default for StatusClasses {
    fn default() -> StatusClasses {
        StatusClasses::server_errors()
    }
}

/// As a document writes it, whole classes first: `[5xx, 429]`.
impl fmt::Display for StatusClasses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut items = Vec::new();
        for class in 1..=5u16 {
            let first = class * 100;
            if (first..first + 100).all(|status| self.contains(status)) {
                items.push(format!("{class}xx"));
            }
        }
        for class in 1..=5u16 {
            let first = class * 100;
            let statuses: Vec<u16> = (first..first + 100).filter(|&s| self.contains(s)).collect();
            if statuses.len() < 100 {
                items.extend(statuses.iter().map(u16::to_string));
            }
        }
        write!(f, "[{}]", items.join(", "))
    }
}

impl fmt::Debug for StatusClasses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StatusClasses{self}")
    }
}

/// Why settings are refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettingsError {
    /// Neither `slow_ms`/`slow_ratio` nor `failure_ratio`: the breaker could never open.
    NoThreshold,
}

impl fmt::Display for SettingsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SettingsError::NoThreshold => {
                f.write_str("a breaker needs slow_ms with slow_ratio, or failure_ratio, or both")
            }
        }
    }
}

impl std::error::Error for SettingsError {}

/// One resource's `breaker`. The two thresholds are private so that a breaker without
/// either cannot be built ([`Settings::new`]); every other field is valid by its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// In metrics and logs; also what names its shared-data record
    /// ([`super::record::record_key`]).
    pub name: String,
    slow: Option<SlowCalls>,
    failure_ratio: Option<Ratio>,
    pub failure_status: StatusClasses,
    pub min_calls: NonZeroU32,
    pub window: Window,
    /// `open_seconds`: how long it fails fast before probing.
    pub open_for: Nanos,
    /// At most 255: each place is a few bytes of the shared record.
    pub half_open_calls: NonZeroU8,
    /// `scope`: this gateway alone (`local`), or one state for every gateway (`global`).
    pub reach: Reach,
    pub force: Force,
}

impl Settings {
    /// A breaker with these thresholds (at least one) and every other field at its
    /// default: `failure_status: [5xx]`, `min_calls: 20`, `window_seconds: 10`,
    /// `open_seconds: 30`, `half_open_calls: 3`, `scope: local`, `force: auto`.
    pub fn new(
        name: impl Into<String>,
        slow: Option<SlowCalls>,
        failure_ratio: Option<Ratio>,
    ) -> Result<Settings, SettingsError> {
        if slow.is_none() && failure_ratio.is_none() {
            return Err(SettingsError::NoThreshold);
        }
        Ok(Settings {
            name: name.into(),
            slow,
            failure_ratio,
            failure_status: StatusClasses::default(),
            min_calls: DEFAULT_MIN_CALLS,
            window: DEFAULT_WINDOW,
            open_for: DEFAULT_OPEN_FOR,
            half_open_calls: DEFAULT_HALF_OPEN_CALLS,
            reach: Reach::Gateway,
            force: Force::Auto,
        })
    }

    pub fn slow(&self) -> Option<SlowCalls> {
        self.slow
    }

    pub fn failure_ratio(&self) -> Option<Ratio> {
        self.failure_ratio
    }

    /// One call's outcome: `duration` from the request leaving Diana to the response
    /// headers, `status` the response's (`None`: no answer — a reset, an upstream timeout).
    /// Slow only when the breaker judges slow calls and the headers came strictly later
    /// than `slow_ms`; failed when there was no answer or its status is in
    /// `failure_status`.
    pub fn judge(&self, duration: Nanos, status: Option<u16>) -> Outcome {
        self.call_judge().judge(duration, status)
    }

    /// What judging a call reads of these settings ([`Settings::judge`]), on its own.
    pub fn call_judge(&self) -> CallJudge {
        CallJudge {
            slow_after: self.slow.map(|slow| slow.threshold),
            failure_status: self.failure_status,
        }
    }

    /// How long a half-open probe's place is held before a missing outcome counts as a
    /// failed probe (so that a lost outcome never wedges the breaker half-open): twice
    /// `slow_ms` (past `slow_ms` the call is slow whatever it answers), at least
    /// [`PROBE_TIMEOUT_FLOOR`]; without `slow_ms`, [`PROBE_TIMEOUT_WITHOUT_SLOW`].
    pub fn probe_timeout(&self) -> Nanos {
        match self.slow {
            Some(slow) => slow.threshold.saturating_mul(2).max(PROBE_TIMEOUT_FLOOR),
            None => PROBE_TIMEOUT_WITHOUT_SLOW,
        }
    }

    /// What the state machine reads.
    pub fn params(&self) -> Params {
        Params {
            slow_ratio: self.slow.map(|slow| slow.ratio),
            failure_ratio: self.failure_ratio,
            min_calls: self.min_calls,
            window: self.window,
            open_for: self.open_for,
            half_open_calls: self.half_open_calls,
            probe_timeout: self.probe_timeout(),
            force: self.force,
        }
    }

    /// These settings as installed at `installed` (see [`Edition`]).
    pub fn edition(&self, installed: Instant) -> Edition {
        Edition {
            params: self.params(),
            installed,
        }
    }
}

/// The integer parameters of the state machine: what a [`Settings`] says about opening,
/// probing and closing (not how a call is judged, which happens before).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Params {
    pub slow_ratio: Option<Ratio>,
    pub failure_ratio: Option<Ratio>,
    pub min_calls: NonZeroU32,
    pub window: Window,
    /// More than zero (the document: at least a second; a record with zero does not
    /// decode): an opening then ends after the instant it began, so a half-open round that
    /// follows a forced reset at one instant never shares its instant with the round the
    /// reset dropped (their tickets would match each other's places).
    pub open_for: Nanos,
    pub half_open_calls: NonZeroU8,
    pub probe_timeout: Nanos,
    pub force: Force,
}

impl Params {
    /// Which thresholds `tally` reaches: (slow, failed); neither below `min_calls`.
    pub fn reached(&self, tally: Tally) -> (bool, bool) {
        if tally.calls < self.min_calls.get() {
            return (false, false);
        }
        (
            self.slow_ratio
                .is_some_and(|ratio| ratio.reached_by(tally.slow, tally.calls)),
            self.failure_ratio
                .is_some_and(|ratio| ratio.reached_by(tally.failed, tally.calls)),
        )
    }

    /// `Retry-After` of a forced-open breaker: `open_seconds`, what an opening announces.
    pub fn forced_retry_after(&self) -> u64 {
        crate::time::ceil_seconds_at_least_one(self.open_for)
    }
}

/// Parameters as installed at one instant: a state remembers the edition it runs under,
/// and a worker's edition replaces it only when it was installed no earlier (or the stored
/// instant lies in the future: a clock stepped back). So while a reload reaches the
/// workers one by one, a worker still on the old document does not undo what the new one
/// switched (a `force`, a window), and the transition is logged once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Edition {
    pub params: Params,
    pub installed: Instant,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_are_parts_per_million_in_0_exclusive_to_1() {
        let cases: [(f64, Result<u32, RatioError>); 10] = [
            (0.5, Ok(500_000)),
            (1.0, Ok(1_000_000)),
            (0.1, Ok(100_000)),
            (0.333_333_3, Ok(333_333)),
            (0.000_001, Ok(1)),
            (0.000_000_4, Err(RatioError::FinerThanAMillionth)),
            (0.0, Err(RatioError::NotAbove0)),
            (-0.5, Err(RatioError::NotAbove0)),
            (1.000_001, Err(RatioError::Above1)),
            (f64::NAN, Err(RatioError::NotAbove0)),
        ];
        for (value, expected) in cases {
            assert_eq!(Ratio::from_f64(value).map(Ratio::ppm), expected, "{value}");
        }
        assert_eq!(Ratio::from_ppm(0), Err(RatioError::NotAbove0));
        assert_eq!(Ratio::from_ppm(1_000_001), Err(RatioError::Above1));
        assert_eq!(Ratio::from_f64(f64::INFINITY), Err(RatioError::Above1));
    }

    #[test]
    fn a_ratio_is_reached_exactly_at_its_share() {
        let half = Ratio::from_ppm(500_000).unwrap();
        let third = Ratio::from_ppm(333_333).unwrap();
        let cases = [
            (half, 10, 20, true),
            (half, 9, 20, false),
            (half, 1, 2, true),
            (half, 0, 0, false),
            (third, 1, 3, true),
            (third, 333_332, 1_000_000, false),
            (third, 333_333, 1_000_000, true),
            (Ratio::from_ppm(PPM).unwrap(), u32::MAX - 1, u32::MAX, false),
            (Ratio::from_ppm(PPM).unwrap(), u32::MAX, u32::MAX, true),
        ];
        for (ratio, count, calls, reached) in cases {
            assert_eq!(ratio.reached_by(count, calls), reached, "{count}/{calls}");
        }
    }

    #[test]
    fn ratios_print_as_a_document_writes_them() {
        for (ppm, text) in [
            (500_000, "0.5"),
            (1_000_000, "1"),
            (1, "0.000001"),
            (123_450, "0.12345"),
        ] {
            assert_eq!(Ratio::from_ppm(ppm).unwrap().to_string(), text);
        }
    }

    #[test]
    fn failure_statuses_take_statuses_and_classes() {
        let mut classes = StatusClasses::none();
        for item in ["5xx", "429", "4XX"] {
            classes.add(item).unwrap();
        }
        assert_eq!(classes.to_string(), "[4xx, 5xx]");
        let mut some = StatusClasses::none();
        some.add("503").unwrap();
        some.add_status(429).unwrap();
        assert_eq!(some.to_string(), "[429, 503]");
        for (status, expected) in [
            (503, true),
            (429, true),
            (500, false),
            (99, false),
            (600, false),
        ] {
            assert_eq!(some.contains(status), expected, "{status}");
        }
        assert_eq!(StatusClasses::default().to_string(), "[5xx]");
        assert!(StatusClasses::default().contains(599));
        assert!(!StatusClasses::default().contains(499));
        let refusals = [
            ("6xx", StatusError::NotAClass("6xx".into())),
            ("5x", StatusError::NotAClass("5x".into())),
            ("", StatusError::NotAClass(String::new())),
            ("+50", StatusError::NotAClass("+50".into())),
            ("1000", StatusError::NotAClass("1000".into())),
            ("600", StatusError::OutOfRange(600)),
            ("099", StatusError::OutOfRange(99)),
        ];
        for (item, error) in refusals {
            assert_eq!(StatusClasses::none().add(item), Err(error), "{item}");
        }
        assert_eq!(
            StatusClasses::none().add_status(70_000),
            Err(StatusError::OutOfRange(70_000))
        );
    }

    #[test]
    fn a_breaker_needs_a_threshold() {
        assert_eq!(
            Settings::new("x", None, None),
            Err(SettingsError::NoThreshold)
        );
        let settings = Settings::new("x", None, Some(Ratio::from_ppm(1).unwrap())).unwrap();
        assert_eq!(settings.min_calls.get(), 20);
        assert_eq!(settings.window.seconds(), 10);
        assert_eq!(settings.window.slice(), Nanos::from_millis(1_000));
        assert_eq!(settings.open_for, Nanos::from_secs(30));
        assert_eq!(settings.half_open_calls.get(), 3);
        assert_eq!(settings.force, Force::Auto);
        assert_eq!(settings.reach, Reach::Gateway);
        assert_eq!(settings.probe_timeout(), PROBE_TIMEOUT_WITHOUT_SLOW);
    }

    #[test]
    fn a_call_is_judged_by_its_time_to_headers_and_its_status() {
        let slow = SlowCalls {
            threshold: Nanos::from_millis(1_000),
            ratio: Ratio::from_ppm(500_000).unwrap(),
        };
        let settings = Settings::new("x", Some(slow), None).unwrap();
        let ms = Nanos::from_millis;
        let cases = [
            (ms(1_000), Some(200), false, false),
            (ms(1_000) + Nanos::new(1), Some(200), true, false),
            (ms(10), Some(503), false, true),
            (ms(10), Some(404), false, false),
            (ms(10), None, false, true),
            (ms(5_000), None, true, true),
        ];
        for (duration, status, slow, failed) in cases {
            assert_eq!(
                settings.judge(duration, status),
                Outcome { slow, failed },
                "{duration:?} {status:?}"
            );
        }
        // Without slow_ms nothing is slow.
        let failures = Settings::new("x", None, Some(Ratio::from_ppm(1).unwrap())).unwrap();
        assert!(!failures.judge(Nanos::from_secs(100), Some(200)).slow);
        // The probe timeout: twice slow_ms, at least a second.
        assert_eq!(settings.probe_timeout(), Nanos::from_secs(2));
        let quick = SlowCalls {
            threshold: ms(100),
            ..slow
        };
        assert_eq!(
            Settings::new("x", Some(quick), None)
                .unwrap()
                .probe_timeout(),
            PROBE_TIMEOUT_FLOOR
        );
    }
}
