//! The wire protocol between the filter and the quota service (`diana-quota`): JSON over
//! HTTP/1.1. Plain serde types, no I/O, so the wasm filter and the service share them.
//! The full description, with examples, limits and error codes, is `docs/wire-format.md`.
//!
//! ```text
//! POST /v1/acquire   {"rules":[{"key":"…","algo":"TB","rpu":10,"unit":"second","burst":10,"slices":10,"want":1,"cost":1}]}
//! 200                {"results":[{"allowed":true,"granted":1,"remaining":9,"reset_ms":100,"retry_after_ms":0,"delay_ms":0}]}
//! POST /v1/charge    {"rules":[{"key":"…","algo":"TB","rpu":10,"unit":"second","burst":10,"slices":10,"want":250}]}
//! POST /v1/release   {"call":"9f2c…","rules":[…the rules of that acquire…]}
//! POST /v1/leave     {"rules":[{"key":"…","algo":"IF","rpu":5,…,"want":1,"cost":1,"place":88425001}]}
//! POST /v1/renew     (the same)  200 {"results":[{…,"granted":1,"place":88425002}]}
//! 400 / 413 / 415 / 503   {"error":"rules[2].rpu: must be ≥ 1"}
//! ```
//!
//! The rules of one acquire are decided together, all or nothing: either every rule has at
//! least its `cost` available and each is charged, or none is charged.

use crate::algo::{self, Algorithm, GivenPeriod, Limit, Verdict};
use crate::calendar::CalendarUnit;
use crate::time::{Instant, Nanos, Unit};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::num::NonZeroU32;

/// Asks for tokens; the answer carries admitted leaky-bucket delays for the caller to apply.
pub const ACQUIRE_PATH: &str = "/v1/acquire";
/// Same as [`ACQUIRE_PATH`], but the service itself waits out leaky-bucket delays (hosts
/// that cannot pause a request, e.g. nginx).
pub const WAIT_PATH: &str = "/v1/wait";
/// Charges response costs: every rule is charged `want` tokens unconditionally (past the
/// limit if need be: the identity then owes them). Algorithms without debts are refused.
pub const CHARGE_PATH: &str = "/v1/charge";
/// Gives back what the acquire with the same `call` id granted: its gateway request went
/// away before the answer came (the host dropped the answer), so nobody will spend it.
/// Sent after the acquire, it may still arrive first: the grant is then given back as
/// soon as it is made.
pub const RELEASE_PATH: &str = "/v1/release";
/// Gives back concurrency places (`max_in_flight`, algorithm `IF`): each rule names the
/// counter, its `want` the places and its `place` the bucket its acquire or last renewal
/// answered. Sent when the gateway request that held them ended. Answers
/// [`ReleaseResponse`] (`released` true once given back).
pub const LEAVE_PATH: &str = "/v1/leave";
/// Renews concurrency places of requests still inside (same body as [`LEAVE_PATH`]): each
/// rule's places move to the current bucket, so that the service never reclaims them as
/// lost; the answer's `place` is the bucket to send next time. A place nobody renews is
/// reclaimed 60–80 s after its last renewal (`algo::inflight::RECLAIMED_AFTER`).
pub const RENEW_PATH: &str = "/v1/renew";
/// Longest `call` id, in bytes (`[A-Za-z0-9_-]`).
pub const MAX_CALL_ID_BYTES: usize = 64;
/// Request header carrying the gateway's callout timeout in milliseconds: the service
/// answers (503 at worst) before it, so that no charge lands after the gateway gave up.
pub const TIMEOUT_HEADER: &str = "x-diana-timeout-ms";
/// The content type of requests and answers.
pub const CONTENT_TYPE: &str = "application/json";

/// Most rules in one request.
pub const MAX_RULES: usize = 64;
/// Longest key, in bytes.
pub const MAX_KEY_BYTES: usize = 128;
/// Most sliding-window slices.
pub const MAX_SLICES: u32 = 60;
/// Largest lease one rule may ask for.
pub const MAX_WANT: u32 = 100_000;
/// Largest request body, in bytes (larger: 413).
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// Longest delay `/v1/wait` sleeps before answering, in milliseconds.
pub const MAX_WAIT_MS: u64 = 10_000;
/// Largest `max_delay_ms` (a day); leave the field out for no cap.
pub const MAX_DELAY_MS: u64 = 86_400_000;
/// Longest a token or leaky bucket may span, `burst × unit / rpu`, in seconds (a day): the
/// time a full bucket takes to empty at the rate, or an empty one to refill. With windows
/// of at most a day, no counter remembers anything for much longer than a day (the exact
/// bounds of a Redis key's TTL are in `docs/wire-format.md`, "Bounds").
pub const MAX_BUCKET_SECONDS: u64 = 86_400;
/// Most tokens one request may ask for, `want` added up over its rules (every endpoint).
pub const MAX_TOTAL_WANT: u64 = 1_000_000;
/// Shortest calendar period a rule may name (`period.len_ms`): a day (a week of a zone
/// that skipped a day still has six).
pub const MIN_PERIOD_MS: u64 = 86_400_000;
/// Longest calendar period a rule may name: 31 days and an hour (a month of a change of
/// the clocks back).
pub const MAX_PERIOD_MS: u64 = 31 * 86_400_000 + 3_600_000;
/// How far the period a rule names may lie from the service's clock: it must begin no
/// later than this after the service's now, and end no earlier than this before it (the
/// gateways' clocks are trusted to a day, no further).
pub const PERIOD_SKEW_MS: u64 = 86_400_000;

/// `POST /v1/acquire` and `POST /v1/wait` body: every global rule of one gateway request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcquireRequest {
    pub rules: Vec<RuleRequest>,
    /// The gateway's id of this call, unique among its calls (at most
    /// [`MAX_CALL_ID_BYTES`] of `[A-Za-z0-9_-]`): with it, the service remembers what it
    /// granted for a while, so that [`RELEASE_PATH`] can give it back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call: Option<String>,
    /// [`RELEASE_PATH`] only: give back part of one rule's grant of `call`, the rule at
    /// this position in the call's `rules` (from 0). `rules` then holds that one rule as
    /// it was acquired, its `want` the tokens to give back (a request the answer did not
    /// count: `count: {status}`, a reservation settled for less). Absent: the whole call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<u32>,
}

/// One rule of an [`AcquireRequest`]: which counter, its limit, and how many tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleRequest {
    /// `<rule-id-hex>:<identity-hex>`: at most [`MAX_KEY_BYTES`] of `[A-Za-z0-9:_.-]`.
    pub key: String,
    /// Algorithm code or alias (`W`, `SW`, `LB`, `TB`, `token bucket`, …, case-insensitive).
    pub algo: String,
    /// Requests per unit, ≥ 1.
    pub rpu: u32,
    /// `second`, `minute`, `hour`, `day`.
    pub unit: String,
    /// Token-bucket capacity / leaky-bucket queue length, ≥ 1 (ignored by W and SW); a
    /// bucket spans at most a day (`burst × unit / rpu ≤` [`MAX_BUCKET_SECONDS`]).
    pub burst: u32,
    /// Sliding-window slices, 1..=[`MAX_SLICES`] (ignored by the other algorithms).
    pub slices: u32,
    /// Tokens asked for (the lease size), 1..=[`MAX_WANT`], and at most [`MAX_TOTAL_WANT`]
    /// over the rules of one request. Default 1.
    #[serde(default = "one")]
    pub want: u32,
    /// Tokens the gateway request itself needs (its cost), 1..=`want`: the rule admits the
    /// request only if at least this many are available. Default 1.
    #[serde(default = "one")]
    pub cost: u32,
    /// Leaky bucket: the longest an admitted request may be held, in milliseconds; a
    /// request whose turn is further away is denied (with `retry_after_ms`) instead of
    /// reserving it. Absent: the service's own maximum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_delay_ms: Option<u64>,
    /// A rule in dry run counts but never rejects: it is left out of the all-or-nothing
    /// decision (its denial does not stop the others), and it is charged when the request
    /// is admitted and it has `cost` available.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
    /// Concurrency (`IF`) only, on [`LEAVE_PATH`] and [`RENEW_PATH`]: the place bucket the
    /// acquire (or the last renewal) answered, where the `want` places are counted now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub place: Option<u64>,
    /// `unit: week | month` (W and TB): the calendar period the gateway found in the
    /// rule's time zone at the request's instant. The service counts a fixed window in
    /// this period (its counter keyed by the start) and refills a token bucket `rpu` per
    /// its length. Required with `unit` `week` or `month`, refused with any other.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period: Option<WirePeriod>,
}

/// A calendar period on the wire: its first instant and its length, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WirePeriod {
    /// The period's start, milliseconds since the epoch (Monday or the 1st, 00:00 in the
    /// rule's zone).
    pub start_ms: u64,
    /// Its length, [`MIN_PERIOD_MS`]`..=`[`MAX_PERIOD_MS`].
    pub len_ms: u64,
}

impl WirePeriod {
    /// The wire form of a calendar period (whole milliseconds: periods start and end on
    /// whole minutes of every zone).
    pub fn of(period: &crate::calendar::Period) -> WirePeriod {
        WirePeriod {
            start_ms: period.start.unix_nanos() / 1_000_000,
            len_ms: period.length().get() / 1_000_000,
        }
    }
}

fn one() -> u32 {
    1
}

/// The answer to an [`AcquireRequest`]: one result per rule, in the same order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcquireResponse {
    pub results: Vec<RuleResult>,
}

/// The decision for one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RuleResult {
    /// This rule had at least `cost` tokens available: it admits the request. The request
    /// is admitted when every rule does; otherwise no rule is charged (`granted` 0 for all).
    pub allowed: bool,
    /// Tokens charged: 0, or `cost..=want`; never more than the limit has available.
    pub granted: u32,
    /// Requests that would still be admitted right now, after this decision.
    pub remaining: u64,
    /// Milliseconds until the limit has fully recovered (window end, bucket full, queue empty).
    pub reset_ms: u64,
    /// When denied: milliseconds until one request would be admitted. 0 when allowed.
    pub retry_after_ms: u64,
    /// Leaky bucket: milliseconds the admitted request must be delayed (its slot is
    /// reserved). The `i`-th token of a lease (from 0) leaves at `delay_ms + i·unit/rpu`.
    #[serde(default)]
    pub delay_ms: u64,
    /// Concurrency (`IF`) only, when places were granted (or renewed): the bucket they are
    /// counted in. The gateway sends it back to give the places back ([`LEAVE_PATH`]) or to
    /// renew them ([`RENEW_PATH`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub place: Option<u64>,
}

/// The answer to a release: whether a grant was given back (`false`: none was known yet —
/// the acquire will give its grant back when it comes — or the call was forgotten).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseResponse {
    pub released: bool,
}

/// The body of every non-200 answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorResponse {
    pub error: String,
}

/// A validated [`RuleRequest`], with its algorithm and limit resolved.
#[derive(Debug, Clone)]
pub struct ResolvedRule<'a> {
    pub key: &'a str,
    pub algo: &'static dyn Algorithm,
    pub limit: Limit,
    pub want: NonZeroU32,
    /// At most `want`.
    pub cost: NonZeroU32,
    /// Leaky bucket: the longest wait the gateway accepts.
    pub max_delay: Option<Nanos>,
    /// Outside the all-or-nothing decision.
    pub dry_run: bool,
}

/// Nanoseconds to milliseconds, rounded up (a wait is never announced shorter than it is).
pub fn ceil_millis(duration: Nanos) -> u64 {
    duration.div_ceil(Nanos::from_millis(1))
}

impl RuleResult {
    /// This result with the bucket its places are counted in, for a concurrency limit that
    /// granted some (`mark` of the algorithm's verdict); unchanged for any other.
    pub fn placed(self, algo: &dyn Algorithm, mark: algo::Mark) -> RuleResult {
        if self.granted == 0 || !algo.holds_until_done() {
            return self;
        }
        RuleResult {
            place: u64::try_from(mark.0).ok(),
            ..self
        }
    }

    /// The wire form of an algorithm's verdict (durations rounded up to milliseconds).
    pub fn from_verdict(verdict: &Verdict) -> RuleResult {
        RuleResult {
            place: None,
            allowed: verdict.allowed(),
            granted: verdict.granted,
            remaining: verdict.remaining,
            reset_ms: ceil_millis(verdict.reset),
            retry_after_ms: if verdict.allowed() {
                0
            } else {
                ceil_millis(verdict.retry_after)
            },
            delay_ms: if verdict.allowed() {
                ceil_millis(verdict.delay)
            } else {
                0
            },
        }
    }
}

impl RuleRequest {
    /// The request for `want` tokens of a rule with this algorithm and limit, needing one.
    pub fn new(key: String, algo: &dyn Algorithm, limit: &Limit, want: u32) -> RuleRequest {
        RuleRequest {
            place: None,
            key,
            algo: algo.code().to_string(),
            rpu: limit.rpu.get(),
            unit: limit.unit_name().to_string(),
            burst: limit.burst.get(),
            slices: limit.slices.get(),
            want,
            cost: 1,
            max_delay_ms: None,
            dry_run: false,
            period: None,
        }
    }

    /// This request with the calendar period of `limit` that contains `now` (`unit: week
    /// | month`, in the rule's zone): the service, which knows no zones, counts in it.
    /// Unchanged for a fixed unit. A request for a calendar limit without its period is
    /// refused by the service.
    pub fn with_period(mut self, limit: &Limit, now: Instant) -> RuleRequest {
        if let Some(calendar) = &limit.calendar {
            self.unit = calendar.unit().name().to_string();
            self.period = Some(WirePeriod::of(&calendar.period(now)));
        }
        self
    }

    /// Checks this rule (the `index`-th of its request) and resolves it.
    pub fn resolve(&self, index: usize) -> Result<ResolvedRule<'_>, WireError> {
        let field = |name: &'static str| {
            move |problem| WireError::at(format!("rules[{index}].{name}"), problem)
        };
        check_key(&self.key).map_err(field("key"))?;
        let algo = algo::lookup_wire(&self.algo).ok_or_else(|| {
            field("algo")(WireProblem::UnknownAlgorithm {
                name: self.algo.clone(),
            })
        })?;
        let (unit, period) = match self.period {
            None => {
                let unit = Unit::parse(&self.unit).ok_or_else(|| {
                    field("unit")(if calendar_unit(&self.unit).is_some() {
                        WireProblem::CalendarWithoutPeriod {
                            name: self.unit.clone(),
                        }
                    } else {
                        WireProblem::UnknownUnit {
                            name: self.unit.clone(),
                        }
                    })
                })?;
                (unit, None)
            }
            Some(period) => {
                let calendar = calendar_unit(&self.unit).ok_or_else(|| {
                    field("unit")(WireProblem::PeriodOfFixedUnit {
                        name: self.unit.clone(),
                    })
                })?;
                if !matches!(algo.code(), "W" | "TB") {
                    return Err(field("period")(WireProblem::PeriodAlgorithm {
                        algo: algo.code(),
                    }));
                }
                (
                    Unit::Day,
                    Some(resolve_period(period, calendar).map_err(field("period"))?),
                )
            }
        };
        let rpu = NonZeroU32::new(self.rpu).ok_or_else(|| field("rpu")(WireProblem::Zero))?;
        let burst = NonZeroU32::new(self.burst).ok_or_else(|| field("burst")(WireProblem::Zero))?;
        let slices = NonZeroU32::new(self.slices)
            .filter(|slices| slices.get() <= MAX_SLICES)
            .ok_or_else(|| {
                field("slices")(WireProblem::OutOfRange {
                    max: MAX_SLICES,
                    got: self.slices,
                })
            })?;
        let want = NonZeroU32::new(self.want)
            .filter(|want| want.get() <= MAX_WANT)
            .ok_or_else(|| {
                field("want")(WireProblem::OutOfRange {
                    max: MAX_WANT,
                    got: self.want,
                })
            })?;
        let cost = NonZeroU32::new(self.cost)
            .filter(|cost| *cost <= want)
            .ok_or_else(|| {
                field("cost")(WireProblem::CostAboveWant {
                    want: want.get(),
                    cost: self.cost,
                })
            })?;
        if let Some(ms) = self.max_delay_ms.filter(|&ms| ms > MAX_DELAY_MS) {
            return Err(field("max_delay_ms")(WireProblem::DelayCapTooLong { ms }));
        }
        let limit = Limit {
            rpu,
            unit,
            burst,
            slices,
            calendar: None,
            period,
        };
        check_rule_limits(algo, &limit).map_err(|error| {
            field(error.field)(WireProblem::Limit {
                reason: error.reason,
            })
        })?;
        if u64::from(cost.get()) > algo.capacity(&limit) {
            return Err(field("cost")(WireProblem::CostNeverGranted {
                cost: cost.get(),
                capacity: algo.capacity(&limit),
            }));
        }
        Ok(ResolvedRule {
            key: &self.key,
            algo,
            limit,
            want,
            cost,
            max_delay: self.max_delay_ms.map(Nanos::saturating_from_millis),
            dry_run: self.dry_run,
        })
    }
}

/// `week` or `month` (case-insensitive): a unit that needs a period.
fn calendar_unit(name: &str) -> Option<CalendarUnit> {
    match name.trim().to_ascii_lowercase().as_str() {
        "week" => Some(CalendarUnit::Week),
        "month" => Some(CalendarUnit::Month),
        _ => None,
    }
}

/// A period's bounds: a length of [`MIN_PERIOD_MS`]`..=`[`MAX_PERIOD_MS`], an end that
/// fits the clock (where it lies against now is [`check_periods`]'s).
fn resolve_period(period: WirePeriod, unit: CalendarUnit) -> Result<GivenPeriod, WireProblem> {
    if !(MIN_PERIOD_MS..=MAX_PERIOD_MS).contains(&period.len_ms) {
        return Err(WireProblem::PeriodLength { ms: period.len_ms });
    }
    let start = period
        .start_ms
        .checked_add(period.len_ms)
        .and_then(|end| end.checked_mul(1_000_000))
        .map(|_| Instant::from_unix_nanos(period.start_ms * 1_000_000))
        .ok_or(WireProblem::PeriodOutOfTime {
            start_ms: period.start_ms,
        })?;
    Ok(GivenPeriod {
        unit,
        start,
        length: Nanos::from_millis(period.len_ms),
    })
}

/// Checks the periods of a request's rules against the service's clock: each must begin
/// no later than [`PERIOD_SKEW_MS`] after `now` and end no earlier than that before it. A
/// rule can then only name the calendar period around now (or, from a gateway whose
/// clock is off by less than a day, its neighbour), never a window of its own choosing.
pub fn check_periods(rules: &[ResolvedRule<'_>], now: Instant) -> Result<(), WireError> {
    let skew = Nanos::from_millis(PERIOD_SKEW_MS);
    for (index, rule) in rules.iter().enumerate() {
        let Some(period) = rule.limit.period else {
            continue;
        };
        if period.start > now.saturating_add(skew) || period.end() < now.saturating_sub(skew) {
            return Err(WireError::at(
                format!("rules[{index}].period"),
                WireProblem::PeriodNotNow {
                    start_ms: period.start.unix_nanos() / 1_000_000,
                    end_ms: period.end().unix_nanos() / 1_000_000,
                    now_ms: now.unix_nanos() / 1_000_000,
                },
            ));
        }
    }
    Ok(())
}

/// Why a request or an answer breaks the wire format: the field to blame (`rules[2].rpu`,
/// `results[0].granted`, `call`; empty when the body is not JSON at all) and what is wrong
/// there. Displayed as `field: problem`, the message the service answers with a `400`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError {
    pub field: String,
    pub problem: WireProblem,
}

impl WireError {
    pub fn at(field: impl Into<String>, problem: WireProblem) -> WireError {
        WireError {
            field: field.into(),
            problem,
        }
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}", self.problem)
        } else {
            write!(f, "{}: {}", self.field, self.problem)
        }
    }
}

impl std::error::Error for WireError {}

/// What is wrong with one field of a request or an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireProblem {
    /// Not JSON of the format's shape (the reader's message, with its position).
    Syntax {
        reason: String,
    },
    /// An empty key.
    Empty,
    KeyTooLong {
        bytes: usize,
    },
    KeyCharacter {
        character: char,
        at: usize,
    },
    UnknownAlgorithm {
        name: String,
    },
    UnknownUnit {
        name: String,
    },
    /// `week` or `month` without the period it is in.
    CalendarWithoutPeriod {
        name: String,
    },
    /// A period with a fixed unit.
    PeriodOfFixedUnit {
        name: String,
    },
    /// A period with another algorithm than W or TB.
    PeriodAlgorithm {
        algo: &'static str,
    },
    PeriodLength {
        ms: u64,
    },
    PeriodOutOfTime {
        start_ms: u64,
    },
    /// A period too far from the service's clock.
    PeriodNotNow {
        start_ms: u64,
        end_ms: u64,
        now_ms: u64,
    },
    /// Zero where at least 1 is needed.
    Zero,
    OutOfRange {
        max: u32,
        got: u32,
    },
    CostAboveWant {
        want: u32,
        cost: u32,
    },
    DelayCapTooLong {
        ms: u64,
    },
    /// A limit out of the bounds of [`check_rule_limits`] (its reason).
    Limit {
        reason: String,
    },
    CostNeverGranted {
        cost: u32,
        capacity: u64,
    },
    CallId,
    NoRules,
    TooManyRules {
        count: usize,
    },
    TooMuchWanted {
        total: u64,
    },
    /// A release without the call it releases.
    NoCall,
    /// A release naming a call whose grants do not match its rules.
    RulesOfCall {
        rules: usize,
        call: String,
        granted: usize,
    },
    /// A release naming another counter than the call's, at the same place.
    NotTheCallsCounter {
        call: String,
    },
    /// A position in a call's rules that no call has.
    NoSuchPosition {
        got: u32,
    },
    /// A release of part of one rule's grant with other than one rule.
    PartOfOneRule {
        count: usize,
    },
    /// A leave or renewal of a rule that holds no places.
    NotPlaces {
        algo: &'static str,
    },
    NoPlace,
    ResultCount {
        results: usize,
        rules: usize,
    },
    GrantedAboveWant {
        granted: u32,
        want: u32,
    },
    GrantedBelowCost {
        granted: u32,
        cost: u32,
    },
    DeniedWithGrant {
        granted: u32,
    },
    AllowedWithoutGrant,
    RemainingAboveCapacity {
        remaining: u64,
        capacity: u64,
    },
    DurationTooLong {
        value: u64,
        longest: u64,
    },
    PlaceMissing,
    DelayWithoutWait {
        delay_ms: u64,
    },
}

impl fmt::Display for WireProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireProblem::Syntax { reason } | WireProblem::Limit { reason } => f.write_str(reason),
            WireProblem::Empty => f.write_str("must not be empty"),
            WireProblem::KeyTooLong { bytes } => {
                write!(f, "{bytes} bytes, at most {MAX_KEY_BYTES}")
            }
            WireProblem::KeyCharacter { character, at } => write!(
                f,
                "invalid character {character:?} at byte {at} (allowed: A-Z a-z 0-9 : _ . -)"
            ),
            WireProblem::UnknownAlgorithm { name } => write!(
                f,
                "unknown algorithm {name:?} (known: {})",
                algo::known_names().join(", ")
            ),
            WireProblem::UnknownUnit { name } => write!(
                f,
                "unknown unit {name:?} (known: second, minute, hour, day; week and month with a period)"
            ),
            WireProblem::CalendarWithoutPeriod { name } => write!(
                f,
                "unit {name:?} needs the calendar period it is in (period: {{start_ms, len_ms}})"
            ),
            WireProblem::PeriodOfFixedUnit { name } => write!(
                f,
                "a period goes with unit week or month, not {name:?}"
            ),
            WireProblem::PeriodAlgorithm { algo } => write!(
                f,
                "only fixed windows (W) and token buckets (TB) count by calendar periods, not {algo}"
            ),
            WireProblem::PeriodLength { ms } => write!(
                f,
                "len_ms must be between {MIN_PERIOD_MS} (a day) and {MAX_PERIOD_MS} (31 days and an hour), got {ms}"
            ),
            WireProblem::PeriodOutOfTime { start_ms } => write!(
                f,
                "a period starting at {start_ms} ms ends beyond the clock's range"
            ),
            WireProblem::PeriodNotNow {
                start_ms,
                end_ms,
                now_ms,
            } => write!(
                f,
                "the period {start_ms}..{end_ms} ms is not the one around now ({now_ms} ms): it must begin at most a day after now and end at most a day before"
            ),
            WireProblem::Zero => f.write_str("must be ≥ 1"),
            WireProblem::OutOfRange { max, got } => {
                write!(f, "must be between 1 and {max}, got {got}")
            }
            WireProblem::CostAboveWant { want, cost } => {
                write!(f, "must be between 1 and want ({want}), got {cost}")
            }
            WireProblem::DelayCapTooLong { ms } => write!(
                f,
                "at most {MAX_DELAY_MS} (a day; leave it out for no cap), got {ms}"
            ),
            WireProblem::CostNeverGranted { cost, capacity } => write!(
                f,
                "{cost} is more than the limit can ever grant ({capacity})"
            ),
            WireProblem::CallId => {
                write!(f, "1 to {MAX_CALL_ID_BYTES} characters of [A-Za-z0-9_-]")
            }
            WireProblem::NoRules => f.write_str("must contain at least one rule"),
            WireProblem::TooManyRules { count } => {
                write!(f, "at most {MAX_RULES} rules, got {count}")
            }
            WireProblem::TooMuchWanted { total } => write!(
                f,
                "want adds up to {total} over the request's rules, at most {MAX_TOTAL_WANT}"
            ),
            WireProblem::NoCall => f.write_str("a release names the call it releases"),
            WireProblem::RulesOfCall {
                rules,
                call,
                granted,
            } => write!(f, "{rules} rules, the call {call} had {granted}"),
            WireProblem::NotTheCallsCounter { call } => write!(
                f,
                "not a counter the call {call} was granted by (a release gives back only to its own)"
            ),
            WireProblem::NoSuchPosition { got } => write!(
                f,
                "the position of a rule in its call, 0 to {}, got {got}",
                MAX_RULES - 1
            ),
            WireProblem::PartOfOneRule { count } => write!(
                f,
                "a release of one rule's grant (`rule`) carries that one rule, got {count}"
            ),
            WireProblem::NotPlaces { algo } => write!(
                f,
                "only concurrency places (IF) are left or renewed, got {algo}"
            ),
            WireProblem::NoPlace => f.write_str("the bucket the places are counted in is required"),
            WireProblem::ResultCount { results, rules } => {
                write!(f, "{results} results for {rules} rules")
            }
            WireProblem::GrantedAboveWant { granted, want } => {
                write!(f, "{granted} granted, {want} asked")
            }
            WireProblem::GrantedBelowCost { granted, cost } => {
                write!(f, "{granted} granted, below the cost {cost}")
            }
            WireProblem::DeniedWithGrant { granted } => {
                write!(f, "false with {granted} granted")
            }
            WireProblem::AllowedWithoutGrant => {
                f.write_str("true with nothing granted, and no rule denied")
            }
            WireProblem::RemainingAboveCapacity {
                remaining,
                capacity,
            } => write!(f, "{remaining} is more than the limit holds ({capacity})"),
            WireProblem::DurationTooLong { value, longest } => {
                write!(f, "{value} is longer than the limit allows ({longest})")
            }
            WireProblem::PlaceMissing => {
                f.write_str("places granted without the bucket they are counted in")
            }
            WireProblem::DelayWithoutWait { delay_ms } => {
                write!(f, "{delay_ms} for a request that does not wait")
            }
        }
    }
}

/// A rule's limit out of the bounds of the wire format: the field to blame, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitError {
    /// `rpu`, `burst`, `slices` (the wire's and the document's name alike).
    pub field: &'static str,
    /// Why, with the values (`burst 5 at 1 per day spans 432000 s …`).
    pub reason: String,
}

impl fmt::Display for LimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

impl std::error::Error for LimitError {}

/// Whether the service can keep a counter of this algorithm and limit: the bounds on what
/// one rule may make the service store, shared by [`validate`] (every rule of every
/// request) and the filter's configuration loader (every global rule, so that a document
/// the service would refuse is refused at load time instead).
///
/// - the unit is at most a day (a [`Unit`] cannot be longer);
/// - sliding windows have 1 to [`MAX_SLICES`] slices;
/// - token and leaky buckets (`TB`, `LB`) span at most a day: `burst × unit / rpu ≤`
///   [`MAX_BUCKET_SECONDS`] (1 per day with burst 1 is the longest; 10 per hour allows a
///   burst up to 240).
///
/// Fixed and sliding windows ignore `burst`; the other algorithms ignore `slices` beyond
/// its range check.
pub fn check_rule_limits(algo: &dyn Algorithm, limit: &Limit) -> Result<(), LimitError> {
    let slices = limit.slices.get();
    if slices > MAX_SLICES {
        return Err(LimitError {
            field: "slices",
            reason: format!("must be between 1 and {MAX_SLICES}, got {slices}"),
        });
    }
    if matches!(algo.code(), "TB" | "LB") {
        let (rpu, burst) = (u64::from(limit.rpu.get()), u64::from(limit.burst.get()));
        // A period's bucket may span the longest period (a month's budget spent at once).
        let (unit, longest, longest_name) = match limit.period {
            None => (limit.unit.seconds(), MAX_BUCKET_SECONDS, "a day"),
            Some(period) => (
                period.length.get().div_ceil(1_000_000_000),
                MAX_PERIOD_MS / 1_000,
                "31 days and an hour",
            ),
        };
        let unit = unit.max(1);
        // burst × unit / rpu ≤ longest, in integers: burst × unit ≤ rpu × longest.
        if u128::from(burst) * u128::from(unit) > u128::from(rpu) * u128::from(longest) {
            let span = (u128::from(burst) * u128::from(unit)).div_ceil(u128::from(rpu));
            let most = u128::from(rpu) * u128::from(longest) / u128::from(unit);
            return Err(LimitError {
                field: "burst",
                reason: format!(
                    "{burst} at {rpu} per {} spans {span} s (burst × unit / rpu), more than {longest_name} ({longest} s): \
                     at most {most} at this rate",
                    limit.unit_name()
                ),
            });
        }
    }
    Ok(())
}

fn check_key(key: &str) -> Result<(), WireProblem> {
    if key.is_empty() {
        return Err(WireProblem::Empty);
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(WireProblem::KeyTooLong { bytes: key.len() });
    }
    match key.char_indices().find(|&(_, c)| !is_key_char(c)) {
        Some((at, character)) => Err(WireProblem::KeyCharacter { character, at }),
        None => Ok(()),
    }
}

fn is_key_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, ':' | '_' | '.' | '-')
}

impl AcquireRequest {
    /// A request for `rules`, with no call id.
    pub fn new(rules: Vec<RuleRequest>) -> AcquireRequest {
        AcquireRequest {
            rules,
            call: None,
            rule: None,
        }
    }

    /// Checks every limit of the format and resolves each rule, in order.
    pub fn resolve(&self) -> Result<Vec<ResolvedRule<'_>>, WireError> {
        if let Some(call) = &self.call {
            let valid = !call.is_empty()
                && call.len() <= MAX_CALL_ID_BYTES
                && call
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !valid {
                return Err(WireError::at("call", WireProblem::CallId));
            }
        }
        if self.rules.is_empty() {
            return Err(WireError::at("rules", WireProblem::NoRules));
        }
        if self.rules.len() > MAX_RULES {
            return Err(WireError::at(
                "rules",
                WireProblem::TooManyRules {
                    count: self.rules.len(),
                },
            ));
        }
        let rules = self
            .rules
            .iter()
            .enumerate()
            .map(|(index, rule)| rule.resolve(index))
            .collect::<Result<Vec<_>, _>>()?;
        let total: u64 = self.rules.iter().map(|rule| u64::from(rule.want)).sum();
        if total > MAX_TOTAL_WANT {
            return Err(WireError::at("rules", WireProblem::TooMuchWanted { total }));
        }
        Ok(rules)
    }
}

/// One rule of a call that carried an id: what a release of part of that rule's grant
/// names ([`AcquireRequest::rule`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallRule {
    pub call: String,
    /// The rule's position in the call's `rules`.
    pub rule: u32,
}

/// What a [`RELEASE_PATH`] request gives back of its call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// Every rule's grant (the gateway request went away before the answer).
    Whole,
    /// Part of one rule's grant: the rule at this position in the call, the body's one
    /// rule, whose `want` tokens go back.
    Part { rule: usize },
}

/// Checks the body of a [`RELEASE_PATH`] request: a valid request that names its `call`,
/// and, with `rule`, exactly one rule at a position a call can have; resolved, with the
/// call and what it gives back.
pub fn resolve_release(
    request: &AcquireRequest,
) -> Result<(Vec<ResolvedRule<'_>>, &str, Released), WireError> {
    let rules = request.resolve()?;
    let call = request
        .call
        .as_deref()
        .ok_or_else(|| WireError::at("call", WireProblem::NoCall))?;
    let released = match request.rule {
        None => Released::Whole,
        Some(rule) => {
            let rule = usize::try_from(rule)
                .ok()
                .filter(|&rule| rule < MAX_RULES)
                .ok_or(WireError::at(
                    "rule",
                    WireProblem::NoSuchPosition { got: rule },
                ))?;
            if rules.len() != 1 {
                return Err(WireError::at(
                    "rules",
                    WireProblem::PartOfOneRule { count: rules.len() },
                ));
            }
            Released::Part { rule }
        }
    };
    Ok((rules, call, released))
}

/// Checks the body of a [`LEAVE_PATH`] or [`RENEW_PATH`] request: a valid request whose
/// every rule is a concurrency limit naming its `place`; resolved, with the places as
/// their marks.
pub fn resolve_places(
    request: &AcquireRequest,
) -> Result<(Vec<ResolvedRule<'_>>, Vec<algo::Mark>), WireError> {
    let rules = request.resolve()?;
    let mut places = Vec::with_capacity(rules.len());
    for (index, (rule, asked)) in rules.iter().zip(&request.rules).enumerate() {
        if !rule.algo.holds_until_done() {
            return Err(WireError::at(
                format!("rules[{index}].algo"),
                WireProblem::NotPlaces {
                    algo: rule.algo.code(),
                },
            ));
        }
        let Some(place) = asked.place else {
            return Err(WireError::at(
                format!("rules[{index}].place"),
                WireProblem::NoPlace,
            ));
        };
        places.push(algo::Mark(u128::from(place)));
    }
    Ok((rules, places))
}

/// Checks a request against every limit of the format; the error names the field
/// (`rules[2].rpu: must be ≥ 1`). Shared by the filter (before sending) and the service.
/// Each rule's limit is checked by [`check_rule_limits`]; the `want`s of all rules add up
/// to at most [`MAX_TOTAL_WANT`].
pub fn validate(request: &AcquireRequest) -> Result<(), WireError> {
    request.resolve().map(|_| ())
}

/// Parses a request body (without checking its size) and validates it. Syntax and type
/// errors name the field and position: `rules[0].rpu: invalid type: string "10", expected u32 at line 1 column 42`.
pub fn decode_request(body: &[u8]) -> Result<AcquireRequest, WireError> {
    let request: AcquireRequest = decode_json(body)?;
    validate(&request)?;
    Ok(request)
}

/// Parses an answer body and checks it against the request it answers (see
/// [`validate_response`]).
pub fn decode_response(
    request: &AcquireRequest,
    body: &[u8],
) -> Result<AcquireResponse, WireError> {
    let response: AcquireResponse = decode_json(body)?;
    validate_response(request, &response)?;
    Ok(response)
}

/// The longest duration a correct answer can announce for a limit, in milliseconds: two
/// windows or units (a counter last written by a clock up to one unit ahead — another
/// service instance, a clock that stepped back — is counted in that later window or slice,
/// which ends up to two units away), plus the deepest a bucket can go (a full queue, a
/// bucket in debt).
pub fn max_duration_ms(limit: &Limit) -> u64 {
    let unit_ms = match (&limit.period, &limit.calendar) {
        (Some(period), _) => u128::from(period.length.get().div_ceil(1_000_000)),
        // The gateway's own view of a calendar rule: its longest period.
        (None, Some(_)) => u128::from(MAX_PERIOD_MS),
        (None, None) => u128::from(limit.unit.seconds()) * 1_000,
    };
    let bucket = (u128::from(limit.burst.get()) + 1) * unit_ms * 2;
    let bucket_ms = bucket.div_ceil(u128::from(limit.rpu.get()));
    u64::try_from(2 * unit_ms + bucket_ms + 1).unwrap_or(u64::MAX)
}

/// Checks an answer against the request it answers before anything of it is believed:
/// one result per rule; `granted` is 0 or between the rule's `cost` and `want`; a rule
/// that was charged admitted the request; a rule that admitted but was not charged had
/// another rule deny; `remaining` within the limit; durations within
/// [`max_duration_ms`]; a delay only for an admitted request of an algorithm that waits.
pub fn validate_response(
    request: &AcquireRequest,
    response: &AcquireResponse,
) -> Result<(), WireError> {
    if response.results.len() != request.rules.len() {
        return Err(WireError::at(
            "results",
            WireProblem::ResultCount {
                results: response.results.len(),
                rules: request.rules.len(),
            },
        ));
    }
    let rules = request.resolve()?;
    let some_denied = rules
        .iter()
        .zip(&response.results)
        .any(|(rule, result)| !result.allowed && !rule.dry_run);
    for (index, (rule, result)) in rules.iter().zip(&response.results).enumerate() {
        let refuse =
            |name: &str, problem| Err(WireError::at(format!("results[{index}].{name}"), problem));
        let granted = result.granted;
        if granted > rule.want.get() {
            return refuse(
                "granted",
                WireProblem::GrantedAboveWant {
                    granted,
                    want: rule.want.get(),
                },
            );
        }
        if granted > 0 && granted < rule.cost.get() {
            return refuse(
                "granted",
                WireProblem::GrantedBelowCost {
                    granted,
                    cost: rule.cost.get(),
                },
            );
        }
        if granted > 0 && !result.allowed {
            return refuse("allowed", WireProblem::DeniedWithGrant { granted });
        }
        if result.allowed && granted == 0 && !some_denied {
            return refuse("allowed", WireProblem::AllowedWithoutGrant);
        }
        let capacity = rule.algo.capacity(&rule.limit);
        if result.remaining > capacity {
            return refuse(
                "remaining",
                WireProblem::RemainingAboveCapacity {
                    remaining: result.remaining,
                    capacity,
                },
            );
        }
        let longest = max_duration_ms(&rule.limit);
        for (name, value) in [
            ("reset_ms", result.reset_ms),
            ("retry_after_ms", result.retry_after_ms),
            ("delay_ms", result.delay_ms),
        ] {
            if value > longest {
                return refuse(name, WireProblem::DurationTooLong { value, longest });
            }
        }
        if granted > 0 && rule.algo.holds_until_done() && result.place.is_none() {
            return refuse("place", WireProblem::PlaceMissing);
        }
        if result.delay_ms > 0 && (granted == 0 || !rule.algo.waits()) {
            return refuse(
                "delay_ms",
                WireProblem::DelayWithoutWait {
                    delay_ms: result.delay_ms,
                },
            );
        }
    }
    Ok(())
}

fn decode_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, WireError> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let value: T = serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let path = error.path().to_string();
        let field = if path == "." { String::new() } else { path };
        WireError::at(
            field,
            WireProblem::Syntax {
                reason: error.into_inner().to_string(),
            },
        )
    })?;
    deserializer.end().map_err(|error| {
        WireError::at(
            "",
            WireProblem::Syntax {
                reason: error.to_string(),
            },
        )
    })?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::Instant;

    fn rule() -> RuleRequest {
        RuleRequest {
            place: None,
            key: "00ff:abc".to_string(),
            algo: "TB".to_string(),
            rpu: 10,
            unit: "second".to_string(),
            burst: 10,
            slices: 10,
            want: 1,
            cost: 1,
            max_delay_ms: None,
            dry_run: false,
            period: None,
        }
    }

    type Mutation = Box<dyn Fn(&mut RuleRequest)>;

    /// March 2026 in Berlin: 2026-02-28T23:00Z, 31 days less an hour.
    const MARCH: WirePeriod = WirePeriod {
        start_ms: 1_772_319_600_000,
        len_ms: 31 * 86_400_000 - 3_600_000,
    };

    fn monthly(algo: &str) -> RuleRequest {
        RuleRequest {
            algo: algo.to_string(),
            unit: "month".to_string(),
            period: Some(MARCH),
            ..rule()
        }
    }

    #[test]
    fn a_calendar_rule_names_its_period_and_only_a_plausible_one() {
        let window = monthly("W");
        let resolved = window.resolve(0).unwrap();
        let period = resolved.limit.period.unwrap();
        assert_eq!(period.unit, CalendarUnit::Month);
        assert_eq!(period.start.unix_nanos(), MARCH.start_ms * 1_000_000);
        assert_eq!(resolved.limit.unit_name(), "month");
        assert!(monthly("TB").resolve(0).is_ok());
        let refused = |rule: RuleRequest| rule.resolve(2).unwrap_err().to_string();
        assert!(refused(monthly("SW"))
            .starts_with("rules[2].period: only fixed windows (W) and token buckets (TB)"));
        assert!(refused(monthly("LB")).contains("not LB"));
        assert!(refused(RuleRequest {
            period: None,
            ..monthly("W")
        })
        .starts_with("rules[2].unit: unit \"month\" needs the calendar period"));
        assert!(refused(RuleRequest {
            unit: "hour".into(),
            ..monthly("W")
        })
        .starts_with("rules[2].unit: a period goes with unit week or month"));
        for len_ms in [0, MIN_PERIOD_MS - 1, MAX_PERIOD_MS + 1, u64::MAX] {
            let rule = RuleRequest {
                period: Some(WirePeriod { len_ms, ..MARCH }),
                ..monthly("W")
            };
            assert!(
                refused(rule).starts_with("rules[2].period: len_ms must be between"),
                "{len_ms}"
            );
        }
        let rule = RuleRequest {
            period: Some(WirePeriod {
                start_ms: u64::MAX / 1_000_000,
                ..MARCH
            }),
            ..monthly("W")
        };
        assert!(refused(rule).contains("beyond the clock's range"));
        // A month's bucket may hold the month (burst × len / rpu ≤ 31 days and an hour).
        let bucket = RuleRequest {
            rpu: 10,
            burst: 11,
            ..monthly("TB")
        };
        assert!(refused(bucket).starts_with("rules[2].burst: 11 at 10 per month spans"));
        // Where the period lies against the service's clock: within a day.
        let ms = |ms: u64| Instant::from_unix_nanos(ms * 1_000_000);
        let rules = [window.resolve(0).unwrap()];
        let end = MARCH.start_ms + MARCH.len_ms;
        for now in [
            MARCH.start_ms - PERIOD_SKEW_MS,
            MARCH.start_ms + 5,
            end - 1,
            end + PERIOD_SKEW_MS,
        ] {
            assert_eq!(check_periods(&rules, ms(now)), Ok(()), "{now}");
        }
        for now in [
            MARCH.start_ms - PERIOD_SKEW_MS - 1,
            end + PERIOD_SKEW_MS + 1,
            0,
        ] {
            let error = check_periods(&rules, ms(now)).unwrap_err().to_string();
            assert!(error.starts_with("rules[0].period: the period 1772319600000..1774994400000 ms is not the one around now"), "{error}");
        }
        // The wire form of a calendar period, as the gateway sends it.
        let limit = Limit {
            rpu: NonZeroU32::new(3).unwrap(),
            unit: Unit::Day,
            burst: NonZeroU32::new(3).unwrap(),
            slices: NonZeroU32::MIN,
            calendar: Some(crate::calendar::Calendar::new(
                CalendarUnit::Month,
                crate::calendar::Zone::parse("Europe/Berlin").unwrap(),
            )),
            period: None,
        };
        let sent = RuleRequest::new("k".into(), algo::lookup("W").unwrap(), &limit, 1)
            .with_period(&limit, ms(MARCH.start_ms + 86_400_000));
        assert_eq!((sent.unit.as_str(), sent.period), ("month", Some(MARCH)));
        let fixed = Limit {
            calendar: None,
            ..limit
        };
        let sent = RuleRequest::new("k".into(), algo::lookup("W").unwrap(), &fixed, 1)
            .with_period(&fixed, ms(MARCH.start_ms));
        assert_eq!((sent.unit.as_str(), sent.period), ("day", None));
    }

    fn request(rules: Vec<RuleRequest>) -> AcquireRequest {
        AcquireRequest::new(rules)
    }

    #[test]
    fn example_round_trips() {
        let body = br#"{"rules":[{"key":"5f3a:9c","algo":"TB","rpu":10,"unit":"second","burst":10,"slices":10,"want":1,"cost":1}]}"#;
        let decoded = decode_request(body).unwrap();
        assert_eq!(decoded.rules[0].key, "5f3a:9c");
        let encoded = serde_json::to_vec(&decoded).unwrap();
        assert_eq!(encoded, body.to_vec());
        let answer = br#"{"results":[{"allowed":true,"granted":1,"remaining":9,"reset_ms":100,"retry_after_ms":0,"delay_ms":0}]}"#;
        let response = decode_response(&decoded, answer).unwrap();
        assert_eq!(serde_json::to_vec(&response).unwrap(), answer.to_vec());
    }

    #[test]
    fn want_defaults_to_one_and_unknown_fields_are_ignored() {
        let body = br#"{"rules":[{"key":"k","algo":"sliding window","rpu":3,"unit":"Minutes","burst":1,"slices":6,"future":true}]}"#;
        let decoded = decode_request(body).unwrap();
        assert_eq!(decoded.rules[0].want, 1);
        let resolved = decoded.resolve().unwrap();
        assert_eq!(resolved[0].limit.unit, Unit::Minute);
        assert_eq!(resolved[0].limit.slices.get(), 6);
    }

    #[test]
    fn every_limit_has_a_named_reason() {
        let cases: Vec<(Mutation, &str)> = vec![
            (Box::new(|r| r.rpu = 0), "rules[2].rpu: must be ≥ 1"),
            (Box::new(|r| r.burst = 0), "rules[2].burst: must be ≥ 1"),
            (
                Box::new(|r| r.slices = 0),
                "rules[2].slices: must be between 1 and 60, got 0",
            ),
            (
                Box::new(|r| r.slices = 61),
                "rules[2].slices: must be between 1 and 60, got 61",
            ),
            (
                Box::new(|r| r.want = 0),
                "rules[2].want: must be between 1 and 100000, got 0",
            ),
            (
                Box::new(|r| r.want = 100_001),
                "rules[2].want: must be between 1 and 100000, got 100001",
            ),
            (
                Box::new(|r| r.key = String::new()),
                "rules[2].key: must not be empty",
            ),
            (
                Box::new(|r| r.key = "k".repeat(129)),
                "rules[2].key: 129 bytes, at most 128",
            ),
            (
                Box::new(|r| r.key = "ab{c}".to_string()),
                "rules[2].key: invalid character '{' at byte 2 (allowed: A-Z a-z 0-9 : _ . -)",
            ),
            (
                Box::new(|r| r.unit = "fortnight".to_string()),
                "rules[2].unit: unknown unit \"fortnight\"",
            ),
            (
                Box::new(|r| r.algo = "XX".to_string()),
                "rules[2].algo: unknown algorithm \"XX\"",
            ),
        ];
        for (mutate, expected) in cases {
            let mut bad = rule();
            mutate(&mut bad);
            let error = validate(&request(vec![rule(), rule(), bad]))
                .unwrap_err()
                .to_string();
            assert!(
                error.starts_with(expected),
                "{error:?} does not start with {expected:?}"
            );
        }
        assert!(validate(&request(vec![rule(); MAX_RULES])).is_ok());
        assert_eq!(
            validate(&request(vec![rule(); MAX_RULES + 1]))
                .unwrap_err()
                .to_string(),
            "rules: at most 64 rules, got 65"
        );
        assert_eq!(
            validate(&request(vec![])).unwrap_err().to_string(),
            "rules: must contain at least one rule"
        );
        assert_eq!(
            validate(&request(vec![])),
            Err(WireError::at("rules", WireProblem::NoRules))
        );
        let mut longest = rule();
        longest.key = "a".repeat(MAX_KEY_BYTES);
        assert!(validate(&request(vec![longest])).is_ok());
    }

    #[test]
    fn buckets_span_at_most_a_day() {
        let bucket = |algo: &str, rpu: u32, unit: &str, burst: u32| {
            let mut r = rule();
            (r.algo, r.rpu, r.unit, r.burst) = (algo.to_string(), rpu, unit.to_string(), burst);
            validate(&request(vec![r]))
        };
        for algo in ["TB", "LB"] {
            // 1 per day, burst 1: exactly a day, the longest.
            assert_eq!(bucket(algo, 1, "day", 1), Ok(()), "{algo}");
            assert_eq!(
                bucket(algo, 1, "day", 2).unwrap_err().to_string(),
                "rules[0].burst: 2 at 1 per day spans 172800 s (burst × unit / rpu), more than a day (86400 s): at most 1 at this rate"
            );
            // 10 per hour: 240 × 6 min = a day.
            assert_eq!(bucket(algo, 10, "hour", 240), Ok(()), "{algo}");
            assert!(bucket(algo, 10, "hour", 241)
                .unwrap_err()
                .to_string()
                .starts_with("rules[0].burst: 241 at 10 per hour spans 86760 s"));
            // The largest values of the format where the rate allows them.
            assert_eq!(bucket(algo, u32::MAX, "second", u32::MAX), Ok(()));
            assert!(bucket(algo, 1, "second", u32::MAX).is_err());
        }
        // Windows ignore burst.
        assert_eq!(bucket("W", 1, "day", u32::MAX), Ok(()));
        assert_eq!(bucket("SW", 1, "day", u32::MAX), Ok(()));
        // The function the configuration loader calls, with a typed error.
        let limit = |rpu, unit, burst, slices| Limit {
            rpu: NonZeroU32::new(rpu).unwrap(),
            unit,
            burst: NonZeroU32::new(burst).unwrap(),
            slices: NonZeroU32::new(slices).unwrap(),
            calendar: None,
            period: None,
        };
        let tb = algo::lookup("TB").unwrap();
        let sw = algo::lookup("SW").unwrap();
        assert_eq!(
            check_rule_limits(tb, &limit(5, Unit::Minute, 7200, 10)),
            Ok(())
        );
        let error = check_rule_limits(tb, &limit(5, Unit::Minute, 7201, 10)).unwrap_err();
        assert_eq!(error.field, "burst");
        assert!(
            error.to_string().starts_with("burst: 7201 at 5 per minute"),
            "{error}"
        );
        let error = check_rule_limits(sw, &limit(5, Unit::Minute, 1, 61))
            .unwrap_err()
            .to_string();
        assert_eq!(
            error.to_string(),
            "slices: must be between 1 and 60, got 61"
        );
    }

    #[test]
    fn the_total_want_of_a_request_is_bounded() {
        let lease = |want| RuleRequest { want, ..rule() };
        let ten = vec![lease(MAX_WANT); 10];
        assert_eq!(validate(&request(ten.clone())), Ok(()));
        let mut eleven = ten;
        eleven.push(lease(1));
        assert_eq!(
            validate(&request(eleven)).unwrap_err().to_string(),
            "rules: want adds up to 1000001 over the request's rules, at most 1000000"
        );
        // A rule's own error comes first.
        let mut bad = vec![lease(MAX_WANT); 11];
        bad[3].rpu = 0;
        assert_eq!(
            validate(&request(bad)).unwrap_err().to_string(),
            "rules[3].rpu: must be ≥ 1"
        );
    }

    #[test]
    fn syntax_errors_name_the_field() {
        let cases: [(&[u8], &str); 7] = [
            (
                br#"{"rules":[{"key":"k","algo":"TB","rpu":"10"}]}"#,
                "rules[0].rpu: invalid type: string \"10\", expected u32",
            ),
            (
                br#"{"rules":[{"key":"k","algo":"TB","rpu":-1}]}"#,
                "rules[0].rpu: invalid value: integer `-1`, expected u32",
            ),
            (
                br#"{"rules":[{"key":"k","algo":"TB","rpu":1}]}"#,
                "rules[0]: missing field `unit`",
            ),
            (br#"{"ruls":[]}"#, "missing field `rules`"),
            (
                br#"{"rules":[],"rule":-1}"#,
                "rule: invalid value: integer `-1`, expected u32",
            ),
            (b"not json", "expected ident"),
            (br#"{"rules":[]} trailing"#, "trailing characters"),
        ];
        for (body, expected) in cases {
            let error = decode_request(body).unwrap_err().to_string();
            assert!(
                error.starts_with(expected),
                "{error:?} does not start with {expected:?}"
            );
        }
    }

    #[test]
    fn answers_are_checked_against_the_request() {
        let asked = request(vec![rule(), rule()]);
        let ok = RuleResult {
            allowed: true,
            granted: 1,
            ..RuleResult::default()
        };
        assert!(validate_response(
            &asked,
            &AcquireResponse {
                results: vec![ok, ok]
            }
        )
        .is_ok());
        assert_eq!(
            validate_response(&asked, &AcquireResponse { results: vec![ok] })
                .unwrap_err()
                .to_string(),
            "results: 1 results for 2 rules"
        );
        let greedy = RuleResult { granted: 2, ..ok };
        assert_eq!(
            validate_response(
                &asked,
                &AcquireResponse {
                    results: vec![ok, greedy]
                }
            )
            .unwrap_err()
            .to_string(),
            "results[1].granted: 2 granted, 1 asked"
        );
        let liar = RuleResult {
            allowed: true,
            granted: 0,
            ..ok
        };
        assert!(validate_response(
            &asked,
            &AcquireResponse {
                results: vec![liar, ok]
            }
        )
        .is_err());
    }

    #[test]
    fn verdicts_round_up_to_milliseconds() {
        let verdict = Verdict {
            granted: 2,
            remaining: 3,
            reset: Nanos::new(1_000_001),
            retry_after: Nanos::ZERO,
            delay: Nanos::new(1),
            ..Verdict::default()
        };
        let result = RuleResult::from_verdict(&verdict);
        assert_eq!(
            result,
            RuleResult {
                place: None,
                allowed: true,
                granted: 2,
                remaining: 3,
                reset_ms: 2,
                retry_after_ms: 0,
                delay_ms: 1
            }
        );
        let denied = Verdict {
            granted: 0,
            remaining: 0,
            reset: Nanos::from_millis(5),
            retry_after: Nanos::new(2_500_000),
            delay: Nanos::ZERO,
            ..Verdict::default()
        };
        let result = RuleResult::from_verdict(&denied);
        assert!(!result.allowed);
        assert_eq!((result.reset_ms, result.retry_after_ms), (5, 3));
    }

    #[test]
    fn new_copies_the_limit() {
        let algo = algo::default_algorithm();
        let limit = Limit {
            rpu: NonZeroU32::new(5).unwrap(),
            unit: Unit::Hour,
            burst: NonZeroU32::new(7).unwrap(),
            slices: NonZeroU32::new(4).unwrap(),
            calendar: None,
            period: None,
        };
        let rule = RuleRequest::new("a:b".to_string(), algo, &limit, 3);
        let resolved = rule.resolve(0).unwrap();
        assert_eq!(resolved.limit, limit);
        assert_eq!(resolved.want.get(), 3);
        assert_eq!(resolved.algo.code(), algo.code());
    }

    #[test]
    fn cost_is_checked_against_want_and_capacity() {
        let mut costly = rule();
        costly.want = 5;
        costly.cost = 6;
        assert_eq!(
            validate(&request(vec![costly.clone()]))
                .unwrap_err()
                .to_string(),
            "rules[0].cost: must be between 1 and want (5), got 6"
        );
        costly.want = 20;
        costly.cost = 11;
        assert_eq!(
            validate(&request(vec![costly])).unwrap_err().to_string(),
            "rules[0].cost: 11 is more than the limit can ever grant (10)"
        );
        let mut late = rule();
        late.max_delay_ms = Some(MAX_DELAY_MS + 1);
        assert_eq!(
            validate(&request(vec![late.clone()])).unwrap_err().to_string(),
            "rules[0].max_delay_ms: at most 86400000 (a day; leave it out for no cap), got 86400001"
        );
        late.max_delay_ms = Some(MAX_DELAY_MS);
        assert!(validate(&request(vec![late])).is_ok());
        let body = br#"{"rules":[{"key":"k","algo":"LB","rpu":1,"unit":"hour","burst":1,"slices":1,"max_delay_ms":10000}]}"#;
        let decoded = decode_request(body).unwrap();
        let resolved = decoded.resolve().unwrap();
        assert_eq!(resolved[0].cost.get(), 1);
        assert_eq!(resolved[0].max_delay, Some(Nanos::from_secs(10)));
    }

    /// Found by `scripts/fuzz` (target `wire_answers`, seed 1, case 289): an honest answer
    /// for a counter last written by a clock up to a unit ahead (W and SW then count in
    /// the later window or slice) announces a reset up to two units away, and was refused
    /// as longer than the limit allows — the filter then treated a working service as
    /// failing. SW 2,689,673,342 per hour: `reset_ms` 6,335,877 against a bound of 3,600,002.
    #[test]
    fn an_answer_from_a_counter_written_a_unit_ahead_is_accepted() {
        for (algo, slices) in [("W", 1), ("SW", 25)] {
            let mut asked = rule();
            asked.algo = algo.to_string();
            asked.rpu = 2_689_673_342;
            asked.unit = "hour".to_string();
            asked.burst = 7;
            asked.slices = slices;
            let asked = request(vec![asked]);
            let resolved = asked.resolve().unwrap();
            let (algo, limit) = (resolved[0].algo, resolved[0].limit.clone());
            let hour = Unit::Hour.nanos();
            let now = Instant::EPOCH + 490_000 * hour + hour / 10;
            let mut state = vec![0; algo.state_words(&limit)];
            // Another instance, 0.99 h ahead, counted in the next window.
            algo.acquire(&limit, &mut state, now + hour * 99 / 100, 1);
            let verdict = algo.acquire(&limit, &mut state, now, 1);
            assert!(
                verdict.reset > hour,
                "{algo:?}: the reset is over one unit away"
            );
            let answer = AcquireResponse {
                results: vec![RuleResult::from_verdict(&verdict)],
            };
            assert_eq!(validate_response(&asked, &answer), Ok(()), "{algo:?}");
        }
    }

    #[test]
    fn all_or_nothing_answers_are_understood_and_lies_refused() {
        let asked = request(vec![rule(), rule()]);
        let charged = RuleResult {
            allowed: true,
            granted: 1,
            ..RuleResult::default()
        };
        let spared = RuleResult {
            allowed: true,
            granted: 0,
            ..RuleResult::default()
        };
        let denied = RuleResult {
            allowed: false,
            retry_after_ms: 100,
            ..RuleResult::default()
        };
        let ok = |results: Vec<RuleResult>| validate_response(&asked, &AcquireResponse { results });
        assert!(ok(vec![spared, denied]).is_ok());
        // An older service charged the first rule anyway: valid, the gateway keeps it.
        assert!(ok(vec![charged, denied]).is_ok());
        assert_eq!(
            ok(vec![spared, charged]).unwrap_err().to_string(),
            "results[0].allowed: true with nothing granted, and no rule denied"
        );
        let far = RuleResult {
            retry_after_ms: 3_600_000,
            ..denied
        };
        assert!(ok(vec![spared, far])
            .unwrap_err()
            .to_string()
            .starts_with("results[1].retry_after_ms: 3600000 is longer than the limit allows"));
        let full = RuleResult {
            remaining: 11,
            ..charged
        };
        assert_eq!(
            ok(vec![charged, full]).unwrap_err().to_string(),
            "results[1].remaining: 11 is more than the limit holds (10)"
        );
        let delayed = RuleResult {
            delay_ms: 5,
            ..charged
        };
        assert_eq!(
            ok(vec![charged, delayed]).unwrap_err().to_string(),
            "results[1].delay_ms: 5 for a request that does not wait"
        );
        let mut costly = rule();
        costly.want = 4;
        costly.cost = 3;
        let short = RuleResult {
            allowed: true,
            granted: 2,
            ..RuleResult::default()
        };
        assert_eq!(
            validate_response(
                &request(vec![costly]),
                &AcquireResponse {
                    results: vec![short]
                }
            )
            .unwrap_err()
            .to_string(),
            "results[0].granted: 2 granted, below the cost 3"
        );
    }
}
