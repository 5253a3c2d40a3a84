//! The tick's report to the quota service (`POST /v1/report`, wire format in
//! docs/wire-format.md): what one gateway worker tells the fleet since its previous
//! report. Two readers at the service:
//!
//! - **The fleet's breakers** (`scope: global`, DESIGN §4b): each breaker's calls and probe
//!   outcomes, and the probe places the gateway gives back or wants. The service runs one
//!   state per breaker ([`crate::breaker::State`]) over every gateway's reports and
//!   answers its state ([`FleetAnswer`]), which every worker of the gateway then follows.
//! - **The fleet view** (DESIGN §5): per rule the requests admitted and limited and the
//!   hottest identities of each ([`crate::hot::Summary`]), the hottest paths, whether the
//!   gateway runs degraded, each breaker's state as the gateway sees it.
//!
//! When a worker reports: while its document writes a `global` section (it names the
//! quota service; also when every rule is local), every second, carrying its view
//! (`engine/view.rs`: per rule the counts since the previous report and, for a rule whose
//! actor is not `all`, the sketches of its limited and admitted identities; the paths),
//! and at every tick while it has a breaker of `scope: global`. Without a `global`
//! section, only for such breakers. The view's part is best effort: a report lost or
//! refused loses its counts, while its breakers' calls are restored for the next report. A
//! report is cut to [`MAX_REPORT_BYTES`] by [`ReportRequest::fit`] (hot lists left out).
//!
//! Everything here is bounded ([`validate`]): a report from a compromised or buggy gateway
//! can make the service hold no more than the bounds say. The counts are this worker's
//! since its previous report: the service adds the workers' reports up.

use crate::breaker::{
    Edition, FleetAnswer, Force, Params, PlaceClaim, ProbeTally, Ratio, Status, Tally, Window,
};
use crate::hot::Summary;
use crate::time::{Instant, Nanos};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::num::{NonZeroU32, NonZeroU8};

/// The endpoint beside `/v1/acquire`.
pub const REPORT_PATH: &str = "/v1/report";

/// Breakers in one report, at most.
pub const MAX_BREAKERS: usize = 64;
/// Rules in one report, at most.
pub const MAX_RULES: usize = 256;
/// Hot identities (or paths) one list carries, at most (the document's `hot.top`).
pub const MAX_TOP: usize = 100;
/// The longest gateway id, breaker key and name.
pub const MAX_NAME_BYTES: usize = 128;
/// The largest report body (a full report of 256 rules with two lists of 100 labels of 64
/// bytes each is about 3.5 MiB; reports are cut to fit, see [`ReportRequest::fit`]).
pub const MAX_REPORT_BYTES: usize = 1024 * 1024;
/// The longest interval a report may cover.
pub const MAX_INTERVAL_MS: u64 = 3_600_000;
/// The longest `window_seconds` of a fleet's breaker.
pub const MAX_WINDOW_SECONDS: u32 = 3_600;
/// The longest `open_ms` and `probe_timeout_ms` of a fleet's breaker (a day).
pub const MAX_SPAN_MS: u64 = 86_400_000;

/// One worker's report.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReportRequest {
    /// The reporting gateway process: its workers share it (1 to [`MAX_NAME_BYTES`] of
    /// `A-Z a-z 0-9 _ . : -`).
    pub gateway: String,
    /// Milliseconds the counts cover (since this worker's previous report), 1 to
    /// [`MAX_INTERVAL_MS`].
    pub interval_ms: u64,
    /// The gateway runs global rules locally (its quota-service outage switch is open).
    #[serde(default)]
    pub degraded: bool,
    #[serde(default)]
    pub breakers: Vec<BreakerReport>,
    #[serde(default)]
    pub rules: Vec<RuleLine>,
    /// The hottest paths (the longest matched resource of each request), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paths: Option<Summary>,
}

impl ReportRequest {
    /// The report's body, at most `most` bytes: when the whole does not fit, hot lists are
    /// left out until it does, the least telling first (the admitted identities before
    /// the limited, of the least limited rules first; the paths last). The counts and the
    /// breakers always stay (within [`validate`]'s bounds they take far less than
    /// [`MAX_REPORT_BYTES`]). `None` when even those do not fit, or the report cannot be
    /// written.
    pub fn fit(&mut self, most: usize) -> Option<Vec<u8>> {
        let body = serde_json::to_vec(self).ok()?;
        if body.len() <= most {
            return Some(body);
        }
        // The lists to leave out, in order: (rule, admitted list?), then the paths.
        let mut order: Vec<(usize, bool)> = (0..self.rules.len())
            .flat_map(|at| [(at, true), (at, false)])
            .collect();
        order.sort_by_key(|&(at, admitted)| {
            let limited = self.rules.get(at).map_or(0, |rule| rule.limited);
            (!admitted, limited)
        });
        let mut size = body.len();
        let listed = |summary: &Option<Summary>| {
            summary
                .as_ref()
                .and_then(|summary| serde_json::to_vec(summary).ok())
                .map_or(0, |text| text.len())
        };
        for (at, admitted) in order {
            let Some(rule) = self.rules.get_mut(at) else {
                continue;
            };
            let list = if admitted {
                &mut rule.hot_admitted
            } else {
                &mut rule.hot_limited
            };
            // The list and at most its field's name, `,"hot_admitted":`.
            size = size.saturating_sub(listed(list) + 16);
            *list = None;
            if size <= most {
                // The estimate may be a few bytes short: checked on the real text.
                let body = serde_json::to_vec(self).ok()?;
                if body.len() <= most {
                    return Some(body);
                }
                size = body.len();
            }
        }
        self.paths = None;
        let body = serde_json::to_vec(self).ok()?;
        (body.len() <= most).then_some(body)
    }
}

/// One breaker of the reporting gateway.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerReport {
    /// The breaker's fleet key: a hash of its name and every parameter the fleet's state
    /// depends on, so a gateway with other parameters has a state of its own.
    pub key: String,
    /// Its name (metrics, logs, the fleet view).
    pub name: String,
    /// `scope: global`: the service keeps the fleet's state and answers it. `false`: the
    /// breaker is local, reported for the view alone (no state kept, no answer but its
    /// status echoed).
    pub fleet: bool,
    /// The parameters the fleet's state runs with (all reporters of a key agree).
    pub params: FleetParams,
    /// The state this gateway follows now.
    pub status: Status,
    /// Calls since the previous report (probes apart).
    #[serde(default)]
    pub calls: Tally,
    /// Probe outcomes since the previous report.
    #[serde(default)]
    pub probes: ProbeTally,
    /// The fleet's probe places this gateway withdraws and wants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub places: Option<PlaceClaim>,
}

/// The parameters of a breaker the fleet's state needs (the thresholds are judged on each
/// gateway: slow_ms and failure_status do not travel).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetParams {
    /// 0: no slow threshold; else parts per million, 1 to 1,000,000.
    pub slow_ratio_ppm: u32,
    /// 0: no failure threshold; else parts per million, 1 to 1,000,000.
    pub failure_ratio_ppm: u32,
    pub min_calls: u32,
    pub window_seconds: u32,
    pub open_ms: u64,
    pub half_open_calls: u8,
    pub probe_timeout_ms: u64,
}

impl FleetParams {
    /// What a breaker's reports carry of its parameters (`force` stays with each gateway:
    /// the switch applies before the fleet's state).
    pub fn of(params: &Params) -> FleetParams {
        FleetParams {
            slow_ratio_ppm: params.slow_ratio.map_or(0, Ratio::ppm),
            failure_ratio_ppm: params.failure_ratio.map_or(0, Ratio::ppm),
            min_calls: params.min_calls.get(),
            window_seconds: params.window.seconds(),
            open_ms: params.open_for.whole_millis(),
            half_open_calls: params.half_open_calls.get(),
            probe_timeout_ms: params.probe_timeout.whole_millis(),
        }
    }

    /// The fleet's key of breaker `name` with these parameters: 16 hex digits of a hash
    /// of both, so that gateways whose parameters differ follow states of their own.
    pub fn key(&self, name: &str) -> String {
        let text = format!(
            "{name}\0{}:{}:{}:{}:{}:{}:{}",
            self.slow_ratio_ppm,
            self.failure_ratio_ppm,
            self.min_calls,
            self.window_seconds,
            self.open_ms,
            self.half_open_calls,
            self.probe_timeout_ms
        );
        format!(
            "{:016x}",
            crate::hash::hash64(FLEET_KEY_SEED, text.as_bytes())
        )
    }

    /// The machine's parameters the fleet's state runs with (`force: auto`), or `None`
    /// when a figure is out of the range [`validate`] allows.
    pub fn params(&self) -> Option<Params> {
        let ratio = |ppm: u32| match ppm {
            0 => Ok(None),
            ppm => Ratio::from_ppm(ppm).map(Some),
        };
        let (slow_ratio, failure_ratio) = (
            ratio(self.slow_ratio_ppm).ok()?,
            ratio(self.failure_ratio_ppm).ok()?,
        );
        let in_range = (slow_ratio.is_some() || failure_ratio.is_some())
            && self.window_seconds <= MAX_WINDOW_SECONDS
            && (1..=MAX_SPAN_MS).contains(&self.open_ms)
            && (1..=MAX_SPAN_MS).contains(&self.probe_timeout_ms);
        if !in_range {
            return None;
        }
        Some(Params {
            slow_ratio,
            failure_ratio,
            min_calls: NonZeroU32::new(self.min_calls)?,
            window: Window::from_secs(NonZeroU32::new(self.window_seconds)?),
            open_for: Nanos::from_millis(self.open_ms),
            half_open_calls: NonZeroU8::new(self.half_open_calls)?,
            probe_timeout: Nanos::from_millis(self.probe_timeout_ms),
            force: Force::Auto,
        })
    }

    /// The edition the fleet's state of these parameters runs under: one per parameters
    /// (the state is keyed by them), so it never changes and `installed` is the epoch.
    pub fn edition(&self) -> Option<Edition> {
        Some(Edition {
            params: self.params()?,
            installed: Instant::EPOCH,
        })
    }
}

/// Seed of the hash behind a breaker's fleet key.
const FLEET_KEY_SEED: u64 = 0x6469_616e_615f_666b; // "diana_fk"

/// One rule's counts and hottest identities since the previous report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleLine {
    /// The rule's name (its metric name's suffix).
    pub name: String,
    pub admitted: u64,
    pub limited: u64,
    /// Would have been limited (dry run).
    #[serde(default)]
    pub dry_run_limited: u64,
    /// The hottest identities among the limited requests, and among the admitted ones
    /// (rules with a per-identity actor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_limited: Option<Summary>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_admitted: Option<Summary>,
}

/// The service's answer: one entry per breaker of the report, in its order (a local
/// breaker's entry echoes its status).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ReportResponse {
    pub breakers: Vec<FleetAnswer>,
}

/// Checks a report against the bounds.
pub fn validate(report: &ReportRequest) -> Result<(), ReportError> {
    check_name("gateway", &report.gateway)?;
    if report.interval_ms == 0 || report.interval_ms > MAX_INTERVAL_MS {
        return Err(ReportError::at("interval_ms", ReportProblem::OutOfRange));
    }
    if report.breakers.len() > MAX_BREAKERS {
        return Err(ReportError::at(
            "breakers",
            ReportProblem::TooMany { most: MAX_BREAKERS },
        ));
    }
    if report.rules.len() > MAX_RULES {
        return Err(ReportError::at(
            "rules",
            ReportProblem::TooMany { most: MAX_RULES },
        ));
    }
    for (at, breaker) in report.breakers.iter().enumerate() {
        let field = |name: &str| format!("breakers[{at}].{name}");
        check_name(&field("key"), &breaker.key)?;
        check_text(&field("name"), &breaker.name)?;
        if breaker.params.params().is_none() {
            return Err(ReportError::at(&field("params"), ReportProblem::OutOfRange));
        }
    }
    for (at, rule) in report.rules.iter().enumerate() {
        check_text(&format!("rules[{at}].name"), &rule.name)?;
        for (list, summary) in [
            ("hot_limited", &rule.hot_limited),
            ("hot_admitted", &rule.hot_admitted),
        ] {
            if let Some(summary) = summary {
                check_summary(&format!("rules[{at}].{list}"), summary)?;
            }
        }
    }
    if let Some(paths) = &report.paths {
        check_summary("paths", paths)?;
    }
    Ok(())
}

/// Reads and checks a report body.
pub fn decode(body: &[u8]) -> Result<ReportRequest, ReportError> {
    if body.len() > MAX_REPORT_BYTES {
        return Err(ReportError::at("body", ReportProblem::TooLarge));
    }
    let report: ReportRequest = serde_json::from_slice(body)
        .map_err(|error| ReportError::at("body", ReportProblem::Syntax(error.to_string())))?;
    validate(&report)?;
    Ok(report)
}

/// Checks the service's answer against the report: one entry per breaker.
pub fn check_response(
    report: &ReportRequest,
    response: &ReportResponse,
) -> Result<(), ReportError> {
    if response.breakers.len() != report.breakers.len() {
        return Err(ReportError::at(
            "breakers",
            ReportProblem::Count {
                expected: report.breakers.len(),
                found: response.breakers.len(),
            },
        ));
    }
    for (at, (answer, asked)) in response.breakers.iter().zip(&report.breakers).enumerate() {
        let half_open = u32::from(asked.params.half_open_calls);
        if answer.places > half_open || answer.half_open_in_ms > asked.params.open_ms {
            return Err(ReportError::at(
                &format!("breakers[{at}]"),
                ReportProblem::OutOfRange,
            ));
        }
    }
    Ok(())
}

fn check_summary(field: &str, summary: &Summary) -> Result<(), ReportError> {
    if summary.top(usize::MAX).len() > MAX_TOP {
        return Err(ReportError::at(
            field,
            ReportProblem::TooMany { most: MAX_TOP },
        ));
    }
    Ok(())
}

fn check_name(field: &str, name: &str) -> Result<(), ReportError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(ReportError::at(field, ReportProblem::Name))
    }
}

fn check_text(field: &str, text: &str) -> Result<(), ReportError> {
    if text.is_empty() || text.len() > MAX_NAME_BYTES || text.chars().any(char::is_control) {
        return Err(ReportError::at(field, ReportProblem::Name));
    }
    Ok(())
}

/// Why a report (or its answer) breaks the format: the field to blame and what is wrong.
/// Displayed as `field: problem`, the message the service answers with a `400`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportError {
    pub field: String,
    pub problem: ReportProblem,
}

impl ReportError {
    pub fn at(field: &str, problem: ReportProblem) -> ReportError {
        ReportError {
            field: field.to_string(),
            problem,
        }
    }
}

/// What is wrong with one field of a report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReportProblem {
    /// Not JSON of the report's shape (the reader's message).
    Syntax(String),
    /// Larger than [`MAX_REPORT_BYTES`].
    TooLarge,
    /// Empty, too long, or a character outside its set.
    Name,
    /// A number outside its range.
    OutOfRange,
    TooMany {
        most: usize,
    },
    /// An answer whose entries do not match the report's breakers.
    Count {
        expected: usize,
        found: usize,
    },
}

impl fmt::Display for ReportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.problem)
    }
}

impl fmt::Display for ReportProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReportProblem::Syntax(reason) => f.write_str(reason),
            ReportProblem::TooLarge => write!(f, "larger than {MAX_REPORT_BYTES} bytes"),
            ReportProblem::Name => {
                write!(f, "1 to {MAX_NAME_BYTES} bytes of the allowed characters")
            }
            ReportProblem::OutOfRange => f.write_str("out of range"),
            ReportProblem::TooMany { most } => write!(f, "at most {most}"),
            ReportProblem::Count { expected, found } => {
                write!(f, "{found} entries for {expected} breakers")
            }
        }
    }
}

impl std::error::Error for ReportError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> BreakerReport {
        BreakerReport {
            key: "0123456789abcdef".into(),
            name: "payments".into(),
            fleet: true,
            params: FleetParams {
                slow_ratio_ppm: 500_000,
                failure_ratio_ppm: 0,
                min_calls: 20,
                window_seconds: 10,
                open_ms: 30_000,
                half_open_calls: 3,
                probe_timeout_ms: 2_000,
            },
            status: Status::Closed,
            calls: Tally::default(),
            probes: ProbeTally::default(),
            places: None,
        }
    }

    fn report() -> ReportRequest {
        ReportRequest {
            gateway: "gw-1".into(),
            interval_ms: 1_000,
            breakers: vec![breaker()],
            ..ReportRequest::default()
        }
    }

    #[test]
    fn a_report_round_trips_and_is_valid() {
        let body = serde_json::to_vec(&report()).unwrap();
        assert_eq!(decode(&body), Ok(report()));
    }

    #[test]
    fn bounds_are_enforced_naming_the_field() {
        type Change = Box<dyn Fn(&mut ReportRequest)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|r| r.gateway = String::new()), "gateway"),
            (Box::new(|r| r.gateway = "a b".into()), "gateway"),
            (Box::new(|r| r.interval_ms = 0), "interval_ms"),
            (
                Box::new(|r| r.interval_ms = MAX_INTERVAL_MS + 1),
                "interval_ms",
            ),
            (
                Box::new(|r| r.breakers = vec![breaker(); MAX_BREAKERS + 1]),
                "breakers",
            ),
            (
                Box::new(|r| r.breakers[0].params.min_calls = 0),
                "breakers[0].params",
            ),
            (
                Box::new(|r| {
                    r.breakers[0].params.slow_ratio_ppm = 0;
                    r.breakers[0].params.failure_ratio_ppm = 0;
                }),
                "breakers[0].params",
            ),
            (
                Box::new(|r| r.breakers[0].params.slow_ratio_ppm = 1_000_001),
                "breakers[0].params",
            ),
            (
                Box::new(|r| r.breakers[0].key = "k/1".into()),
                "breakers[0].key",
            ),
            (
                Box::new(|r| r.breakers[0].name = "\u{7}".into()),
                "breakers[0].name",
            ),
        ];
        for (change, field) in cases {
            let mut r = report();
            change(&mut r);
            let error = validate(&r).unwrap_err();
            assert_eq!(error.field, field);
        }
        let huge = vec![b' '; MAX_REPORT_BYTES + 1];
        assert_eq!(decode(&huge).unwrap_err().problem, ReportProblem::TooLarge);
        assert!(matches!(
            decode(b"{\"gateway\":\"g\",\"interval_ms\":1,\"extra\":1}")
                .unwrap_err()
                .problem,
            ReportProblem::Syntax(_)
        ));
    }

    #[test]
    fn fleet_params_travel_both_ways_without_the_switch() {
        let slow = crate::breaker::SlowCalls {
            threshold: Nanos::from_millis(700),
            ratio: Ratio::from_ppm(250_000).unwrap(),
        };
        let mut settings = crate::breaker::Settings::new("x", Some(slow), None).unwrap();
        settings.force = Force::Open;
        let fleet = FleetParams::of(&settings.params());
        assert_eq!(
            fleet,
            FleetParams {
                slow_ratio_ppm: 250_000,
                failure_ratio_ppm: 0,
                min_calls: 20,
                window_seconds: 10,
                open_ms: 30_000,
                half_open_calls: 3,
                probe_timeout_ms: 1_400,
            }
        );
        let back = fleet.params().unwrap();
        assert_eq!(
            back,
            Params {
                force: Force::Auto,
                ..settings.params()
            }
        );
        assert_eq!(fleet.edition().unwrap().installed, Instant::EPOCH);
        let out_of_range = [
            FleetParams {
                window_seconds: MAX_WINDOW_SECONDS + 1,
                ..fleet
            },
            FleetParams {
                open_ms: MAX_SPAN_MS + 1,
                ..fleet
            },
            FleetParams {
                probe_timeout_ms: 0,
                ..fleet
            },
            FleetParams {
                half_open_calls: 0,
                ..fleet
            },
        ];
        for params in out_of_range {
            assert_eq!(params.params(), None, "{params:?}");
        }
    }

    #[test]
    fn a_report_too_large_leaves_hot_lists_out_the_least_limited_first() {
        let list = |prefix: &str| {
            let mut sketch = crate::hot::SpaceSaving::new(MAX_TOP);
            for at in 0..MAX_TOP {
                sketch.add(format!("{prefix}{at:0>60}").as_bytes(), 1);
            }
            Some(sketch.summary())
        };
        let line = |name: &str, limited: u64| RuleLine {
            name: name.into(),
            admitted: 1,
            limited,
            dry_run_limited: 0,
            hot_limited: list("l"),
            hot_admitted: list("a"),
        };
        let mut full = report();
        full.rules = vec![line("calm", 1), line("flooded", 1_000)];
        full.paths = list("/");
        let whole = serde_json::to_vec(&full).unwrap();
        assert_eq!(full.clone().fit(whole.len()), Some(whole.clone()));
        // Room for all but about one list: the calm rule's admitted go.
        let mut cut = full.clone();
        let body = cut.fit(whole.len() - 100).unwrap();
        assert!(body.len() <= whole.len() - 100);
        assert_eq!(decode(&body), Ok(cut.clone()));
        assert!(cut.rules[0].hot_admitted.is_none());
        assert!(cut.rules[0].hot_limited.is_some() && cut.rules[1].hot_admitted.is_some());
        // Room for the counts alone: every list goes, the counts and breakers stay.
        let mut bare = full.clone();
        bare.rules.iter_mut().for_each(|rule| {
            rule.hot_limited = None;
            rule.hot_admitted = None;
        });
        bare.paths = None;
        let least = serde_json::to_vec(&bare).unwrap().len();
        let mut cut = full.clone();
        assert_eq!(cut.fit(least), Some(serde_json::to_vec(&bare).unwrap()));
        assert_eq!(cut, bare);
        assert_eq!(full.fit(least - 1), None);
    }

    #[test]
    fn an_answer_must_match_the_report() {
        let r = report();
        let answer = |places, half_open_in_ms| ReportResponse {
            breakers: vec![FleetAnswer {
                status: Status::HalfOpen,
                half_open_in_ms,
                round: 1,
                places,
            }],
        };
        assert!(check_response(&r, &answer(3, 0)).is_ok());
        assert!(check_response(&r, &answer(4, 0)).is_err());
        assert!(check_response(&r, &answer(0, 30_001)).is_err());
        assert!(check_response(&r, &ReportResponse::default()).is_err());
    }
}
