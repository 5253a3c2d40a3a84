//! The fleet view: what the gateways' reports (`POST /v1/report`) told this replica, kept
//! in memory (no Redis: each replica shows the reports it received) and served as JSON at
//! `GET /v1/view` (the shape is [`Snapshot`], documented in `docs/wire-format.md`) and as
//! metrics (`super::metrics`).
//!
//! ```text
//!   gateways  id → last report, reports, degraded, its breakers' statuses
//!   rules     name → totals, 90 × 10 s buckets of admitted / limited / dry-run limited,
//!                    the hottest identities (limited, admitted) of the last minute
//!   paths     the hottest paths of the last minute
//!   breakers  name → the fleet's state as last answered here, its last transitions,
//!                    each gateway's view of it
//! ```
//!
//! # Hot lists
//!
//! Each report carries per rule a summary of each worker's Space-Saving sketch
//! (`diana_core::hot`). The view merges every summary into the slot of a ring of
//! [`HOT_SLICES`] slots of [`HOT_INTERVAL`] (the last minute), each slot a merged summary
//! of at most [`HOT_CAPACITY`] counters ([`Summary::merge`]), and a read merges the slots the
//! minute covers (between 50 and 60 s of the past). For the merged list, of any number of
//! workers and gateways: a listed label's true count lies in `[count − error, count]`; a
//! label not listed counted at most `floor` (ε); and `ε ≤ N / m`, `N` the total counted,
//! `m` the smallest capacity among the gateways' sketches and [`HOT_CAPACITY`].
//!
//! # Bounds
//!
//! Whatever gateways send: at most [`Limits::gateways`] gateways, [`Limits::rules`] rules
//! and [`Limits::breakers`] breakers are tracked (each breaker with at most
//! [`Limits::gateways`] gateways' views and [`TRANSITIONS_KEPT`] transitions); a gateway,
//! rule or breaker without a report for [`SPAN`] (15 minutes) is dropped. When a table is
//! full of live entries a new one is not tracked (counted in `dropped`): the entries being
//! watched stay. Memory, worst case: a rule is 2 rings of 6 merged summaries of 100
//! labels (≈ 106 KB) and its series (≈ 2 KB): ≈ 28 MB for 256 rules; a gateway with 64
//! breakers ≈ 10 KB (≈ 10 MB for 1,024); a breaker with every gateway's view ≈ 170 KB
//! (≈ 44 MB for 256). Identity labels are data: at most 64 bytes each, carried as JSON
//! strings (a page escapes them).

use crate::store::breakers::Decided;
use diana_core::breaker::{Status, Tally, Transition};
use diana_core::hot::Summary;
use diana_core::report::{BreakerReport, FleetParams, ReportRequest, MAX_TOP};
use diana_core::time::{Instant, Nanos};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, VecDeque};

/// How far back the view looks: the series' length, and how long an entry without a
/// report is kept.
pub const SPAN: Nanos = Nanos::from_secs(15 * 60);
/// One bucket of a rule's series.
pub const BUCKET: Nanos = Nanos::from_secs(10);
/// Buckets in a series: [`SPAN`] / [`BUCKET`].
pub const BUCKETS: usize = 90;
/// One slot of a hot ring.
pub const HOT_INTERVAL: Nanos = Nanos::from_secs(10);
/// Slots in a hot ring: the last minute.
pub const HOT_SLICES: usize = 6;
/// Counters of a merged summary.
pub const HOT_CAPACITY: usize = MAX_TOP;
/// Transitions kept per breaker, the latest.
pub const TRANSITIONS_KEPT: usize = 20;
/// The least time between two sweeps of idle entries.
const SWEEP_GAP: Nanos = Nanos::from_secs(1);

/// How much the view tracks at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limits {
    pub gateways: usize,
    pub rules: usize,
    pub breakers: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            gateways: 1_024,
            rules: 256,
            breakers: 256,
        }
    }
}

/// Requests of a rule: admitted, limited, and those a dry run would have limited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Counts {
    pub admitted: u64,
    pub limited: u64,
    pub dry_run_limited: u64,
}

impl Counts {
    fn add(&mut self, more: Counts) {
        self.admitted = self.admitted.saturating_add(more.admitted);
        self.limited = self.limited.saturating_add(more.limited);
        self.dry_run_limited = self.dry_run_limited.saturating_add(more.dry_run_limited);
    }
}

/// Entries the view did not track because a table was full of live ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Dropped {
    pub gateways: u64,
    pub rules: u64,
    pub breakers: u64,
}

/// A ring of counts per [`BUCKET`]: slot `n % BUCKETS` holds bucket `n`.
#[derive(Debug, Clone)]
struct Series {
    slots: Vec<(u64, Counts)>,
}

impl Series {
    fn new() -> Series {
        Series {
            slots: vec![(0, Counts::default()); BUCKETS],
        }
    }

    fn add(&mut self, now: Instant, counts: Counts) {
        let number = now.periods(BUCKET);
        if let Some((bucket, slot)) = self.slots.get_mut(ring_index(number, BUCKETS)) {
            // A slot of an older bucket starts again; an instant older than the slot's (a
            // clock stepped back) is counted in it as it is.
            if *bucket < number {
                *bucket = number;
                *slot = Counts::default();
            }
            slot.add(counts);
        }
    }

    /// The last [`BUCKETS`] buckets at `now`, the oldest first, the current one last.
    fn read(&self, now: Instant) -> Vec<Counts> {
        let current = now.periods(BUCKET);
        (0..BUCKETS as u64)
            .rev()
            .map(|back| {
                current
                    .checked_sub(back)
                    .and_then(|number| {
                        self.slots
                            .get(ring_index(number, BUCKETS))
                            .filter(|(bucket, _)| *bucket == number)
                    })
                    .map_or_else(Counts::default, |(_, counts)| *counts)
            })
            .collect()
    }
}

fn ring_index(number: u64, slots: usize) -> usize {
    usize::try_from(number % slots as u64).unwrap_or(0)
}

/// The last minute of merged summaries (see the module's docs).
#[derive(Debug, Clone)]
struct HotRing {
    slots: Vec<(u64, Option<Summary>)>,
}

impl HotRing {
    fn new() -> HotRing {
        HotRing {
            slots: vec![(0, None); HOT_SLICES],
        }
    }

    fn add(&mut self, now: Instant, part: &Summary) {
        if part.total() == 0 {
            return;
        }
        let number = now.periods(HOT_INTERVAL);
        if let Some((slice, merged)) = self.slots.get_mut(ring_index(number, HOT_SLICES)) {
            if *slice < number {
                *slice = number;
                *merged = None;
            }
            *merged = Some(match merged.take() {
                None => Summary::merge([part], HOT_CAPACITY),
                Some(held) => Summary::merge([&held, part], HOT_CAPACITY),
            });
        }
    }

    /// The merge of the slots the minute covers at `now`; `None` when nothing was counted.
    fn read(&self, now: Instant) -> Option<Summary> {
        let number = now.periods(HOT_INTERVAL);
        let count = HOT_SLICES as u64;
        let live: Vec<&Summary> = self
            .slots
            .iter()
            .filter(|(slice, _)| *slice <= number && *slice + count > number)
            .filter_map(|(_, merged)| merged.as_ref())
            .collect();
        (!live.is_empty()).then(|| Summary::merge(live, HOT_CAPACITY))
    }
}

#[derive(Debug, Clone)]
struct Gateway {
    first: Instant,
    last: Instant,
    reports: u64,
    degraded: bool,
    breakers: Vec<GatewayBreaker>,
}

#[derive(Debug, Clone)]
struct Rule {
    last: Instant,
    totals: Counts,
    series: Series,
    hot_limited: HotRing,
    hot_admitted: HotRing,
}

#[derive(Debug, Clone)]
struct Breaker {
    last: Instant,
    fleet: bool,
    state: Option<FleetState>,
    transitions: VecDeque<TransitionJson>,
    /// Transitions made here, by the status they went to (closed, open, half-open).
    transitions_total: [u64; 3],
    /// Each gateway's view: its status, when it reported it.
    gateways: BTreeMap<String, (Status, Instant)>,
}

#[derive(Debug, Clone)]
struct FleetState {
    key: String,
    params: FleetParams,
    decided: Decided,
    at: Instant,
}

/// Everything the view holds (see the module's docs).
#[derive(Debug, Clone)]
pub struct View {
    limits: Limits,
    gateways: HashMap<String, Gateway>,
    rules: HashMap<String, Rule>,
    paths: HotRing,
    breakers: HashMap<String, Breaker>,
    reports: u64,
    dropped: Dropped,
    swept: Option<Instant>,
}

/// Whether an entry last seen at `last` is still shown at `now` (a clock stepped back
/// keeps it).
fn live(last: Instant, now: Instant) -> bool {
    now.saturating_since(last) < SPAN
}

/// The entry of `key` in `map`, made with `make` if there is room (after dropping the
/// idle ones, `last_of` telling when each was seen); `None` when the map is full of live
/// entries (`dropped` counts it).
fn entry<'m, V>(
    map: &'m mut HashMap<String, V>,
    key: &str,
    cap: usize,
    now: Instant,
    last_of: impl Fn(&V) -> Instant,
    make: impl FnOnce() -> V,
    dropped: &mut u64,
) -> Option<&'m mut V> {
    if !map.contains_key(key) {
        if map.len() >= cap {
            map.retain(|_, value| live(last_of(value), now));
        }
        if map.len() >= cap {
            *dropped = dropped.saturating_add(1);
            return None;
        }
        map.insert(key.to_string(), make());
    }
    map.get_mut(key)
}

impl View {
    pub fn new(limits: Limits) -> View {
        View {
            limits,
            gateways: HashMap::new(),
            rules: HashMap::new(),
            paths: HotRing::new(),
            breakers: HashMap::new(),
            reports: 0,
            dropped: Dropped::default(),
            swept: None,
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// What one report tells, received at `now` (the fleet's answers come apart:
    /// [`View::record_fleet`]).
    pub fn record_report(&mut self, report: &ReportRequest, now: Instant) {
        self.sweep(now);
        self.reports = self.reports.saturating_add(1);
        let statuses: Vec<GatewayBreaker> = report
            .breakers
            .iter()
            .map(|breaker| GatewayBreaker {
                name: breaker.name.clone(),
                status: breaker.status,
                fleet: breaker.fleet,
            })
            .collect();
        if let Some(gateway) = entry(
            &mut self.gateways,
            &report.gateway,
            self.limits.gateways,
            now,
            |gateway| gateway.last,
            || Gateway {
                first: now,
                last: now,
                reports: 0,
                degraded: false,
                breakers: Vec::new(),
            },
            &mut self.dropped.gateways,
        ) {
            gateway.last = now;
            gateway.reports = gateway.reports.saturating_add(1);
            gateway.degraded = report.degraded;
            gateway.breakers = statuses;
        }
        for line in &report.rules {
            let Some(rule) = entry(
                &mut self.rules,
                &line.name,
                self.limits.rules,
                now,
                |rule| rule.last,
                || Rule {
                    last: now,
                    totals: Counts::default(),
                    series: Series::new(),
                    hot_limited: HotRing::new(),
                    hot_admitted: HotRing::new(),
                },
                &mut self.dropped.rules,
            ) else {
                continue;
            };
            let counts = Counts {
                admitted: line.admitted,
                limited: line.limited,
                dry_run_limited: line.dry_run_limited,
            };
            rule.last = now;
            rule.totals.add(counts);
            rule.series.add(now, counts);
            if let Some(summary) = &line.hot_limited {
                rule.hot_limited.add(now, summary);
            }
            if let Some(summary) = &line.hot_admitted {
                rule.hot_admitted.add(now, summary);
            }
        }
        if let Some(paths) = &report.paths {
            self.paths.add(now, paths);
        }
        for reported in &report.breakers {
            let gateways = self.limits.gateways;
            let Some(breaker) = self.breaker(&reported.name, now) else {
                continue;
            };
            breaker.last = now;
            breaker.fleet |= reported.fleet;
            let known = breaker.gateways.contains_key(&report.gateway);
            if !known && breaker.gateways.len() >= gateways {
                breaker.gateways.retain(|_, (_, at)| live(*at, now));
            }
            if known || breaker.gateways.len() < gateways {
                breaker
                    .gateways
                    .insert(report.gateway.clone(), (reported.status, now));
            }
        }
    }

    fn breaker(&mut self, name: &str, now: Instant) -> Option<&mut Breaker> {
        entry(
            &mut self.breakers,
            name,
            self.limits.breakers,
            now,
            |breaker| breaker.last,
            || Breaker {
                last: now,
                fleet: false,
                state: None,
                transitions: VecDeque::new(),
                transitions_total: [0; 3],
                gateways: BTreeMap::new(),
            },
            &mut self.dropped.breakers,
        )
    }

    /// The fleet's state of a reported breaker as this replica answered it at `now`, and
    /// the transitions this replica's write made.
    pub fn record_fleet(&mut self, reported: &BreakerReport, decided: &Decided, now: Instant) {
        let Some(breaker) = self.breaker(&reported.name, now) else {
            return;
        };
        breaker.last = now;
        breaker.fleet = true;
        for transition in &decided.transitions {
            if let Some(total) = breaker
                .transitions_total
                .get_mut(usize::from(transition.to.gauge()))
            {
                *total = total.saturating_add(1);
            }
            if breaker.transitions.len() >= TRANSITIONS_KEPT {
                breaker.transitions.pop_front();
            }
            breaker
                .transitions
                .push_back(TransitionJson::of(&reported.key, transition, now));
        }
        breaker.state = Some(FleetState {
            key: reported.key.clone(),
            params: reported.params,
            decided: decided.clone(),
            at: now,
        });
    }

    /// Drops what has had no report for [`SPAN`] (at most once a second).
    fn sweep(&mut self, now: Instant) {
        if self
            .swept
            .is_some_and(|at| at <= now && now.saturating_since(at) < SWEEP_GAP)
        {
            return;
        }
        self.swept = Some(now);
        self.gateways.retain(|_, gateway| live(gateway.last, now));
        self.rules.retain(|_, rule| live(rule.last, now));
        self.breakers.retain(|_, breaker| live(breaker.last, now));
        for breaker in self.breakers.values_mut() {
            breaker.gateways.retain(|_, (_, at)| live(*at, now));
        }
    }

    /// The view at `now`, as `GET /v1/view` answers it (entries idle for [`SPAN`] left
    /// out), sorted by name.
    pub fn snapshot(&self, now: Instant) -> Snapshot {
        let current = now.periods(BUCKET);
        let oldest = current.saturating_sub(BUCKETS as u64 - 1);
        let mut gateways: Vec<GatewayJson> = self
            .gateways
            .iter()
            .filter(|(_, gateway)| live(gateway.last, now))
            .map(|(id, gateway)| GatewayJson {
                id: id.clone(),
                first_report_ms: millis(gateway.first),
                last_report_ms: millis(gateway.last),
                reports: gateway.reports,
                degraded: gateway.degraded,
                breakers: gateway.breakers.clone(),
            })
            .collect();
        gateways.sort_by(|a, b| a.id.cmp(&b.id));
        let mut rules: Vec<RuleJson> = self
            .rules
            .iter()
            .filter(|(_, rule)| live(rule.last, now))
            .map(|(name, rule)| {
                let series = rule.series.read(now);
                RuleJson {
                    name: name.clone(),
                    last_report_ms: millis(rule.last),
                    totals: rule.totals,
                    admitted: series.iter().map(|counts| counts.admitted).collect(),
                    limited: series.iter().map(|counts| counts.limited).collect(),
                    dry_run_limited: series.iter().map(|counts| counts.dry_run_limited).collect(),
                    hot_limited: rule.hot_limited.read(now).as_ref().map(HotJson::of),
                    hot_admitted: rule.hot_admitted.read(now).as_ref().map(HotJson::of),
                }
            })
            .collect();
        rules.sort_by(|a, b| a.name.cmp(&b.name));
        let mut breakers: Vec<BreakerJson> = self
            .breakers
            .iter()
            .filter(|(_, breaker)| live(breaker.last, now))
            .map(|(name, breaker)| BreakerJson::of(name, breaker, now))
            .collect();
        breakers.sort_by(|a, b| a.name.cmp(&b.name));
        Snapshot {
            now_ms: millis(now),
            series: SeriesShape {
                bucket_ms: BUCKET.whole_millis(),
                buckets: BUCKETS,
                start_ms: oldest.saturating_mul(BUCKET.whole_millis()),
            },
            hot_window_ms: HOT_INTERVAL
                .saturating_mul(HOT_SLICES as u64)
                .whole_millis(),
            reports: self.reports,
            limits: LimitsJson {
                gateways: self.limits.gateways,
                rules: self.limits.rules,
                breakers: self.limits.breakers,
                transitions: TRANSITIONS_KEPT,
                hot_capacity: HOT_CAPACITY,
            },
            dropped: self.dropped,
            gateways,
            rules,
            paths: self.paths.read(now).as_ref().map(HotJson::of),
            breakers,
        }
    }
}

fn millis(instant: Instant) -> u64 {
    instant.unix_nanos() / 1_000_000
}

// ---------------------------------------------------------------------------------------
// The JSON of `GET /v1/view`.

/// The whole view (`GET /v1/view`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Snapshot {
    /// This replica's clock, ms since the epoch.
    pub now_ms: u64,
    pub series: SeriesShape,
    /// How far back the hot lists look at most (60,000).
    pub hot_window_ms: u64,
    /// Reports received by this replica since it started.
    pub reports: u64,
    pub limits: LimitsJson,
    pub dropped: Dropped,
    pub gateways: Vec<GatewayJson>,
    pub rules: Vec<RuleJson>,
    /// The hottest paths of the last minute, fleet-wide.
    pub paths: Option<HotJson>,
    pub breakers: Vec<BreakerJson>,
}

/// Where every rule's series lies: `buckets` buckets of `bucket_ms`, the first starting
/// at `start_ms`, the last the current one (still filling).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SeriesShape {
    pub bucket_ms: u64,
    pub buckets: usize,
    pub start_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LimitsJson {
    pub gateways: usize,
    pub rules: usize,
    pub breakers: usize,
    pub transitions: usize,
    pub hot_capacity: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GatewayJson {
    pub id: String,
    pub first_report_ms: u64,
    pub last_report_ms: u64,
    /// Reports received from it (each worker reports on its own).
    pub reports: u64,
    /// Its last report said it runs global rules locally (the quota service unreachable).
    pub degraded: bool,
    /// Its breakers as its last report gave them.
    pub breakers: Vec<GatewayBreaker>,
}

/// One breaker as a gateway follows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GatewayBreaker {
    pub name: String,
    pub status: Status,
    /// `scope: global`.
    pub fleet: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RuleJson {
    pub name: String,
    pub last_report_ms: u64,
    /// Since this replica tracks the rule.
    pub totals: Counts,
    /// Per bucket of the series, oldest first.
    pub admitted: Vec<u64>,
    pub limited: Vec<u64>,
    pub dry_run_limited: Vec<u64>,
    pub hot_limited: Option<HotJson>,
    pub hot_admitted: Option<HotJson>,
}

/// A merged hot list: the last minute, fleet-wide.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HotJson {
    /// Requests counted (N).
    pub total: u64,
    /// ε: a label not listed counted at most this many; every listed count is at most
    /// this much above the truth. ε ≤ total / capacity.
    pub floor: u64,
    pub capacity: usize,
    /// Largest count first.
    pub items: Vec<HotItem>,
}

/// A hot label: its true count lies in `[count − error, count]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HotItem {
    /// The identity (or path) as the gateway shows it: at most 64 bytes of text, data
    /// (escape it before putting it in a page).
    pub label: String,
    pub count: u64,
    pub error: u64,
}

impl HotJson {
    fn of(summary: &Summary) -> HotJson {
        HotJson {
            total: summary.total(),
            floor: summary.floor(),
            capacity: summary.capacity(),
            items: summary
                .top(usize::MAX)
                .iter()
                .map(|hot| HotItem {
                    label: hot.label.as_str().to_string(),
                    count: hot.count,
                    error: hot.error,
                })
                .collect(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BreakerJson {
    pub name: String,
    /// A gateway reported it with `scope: global`.
    pub fleet: bool,
    /// The fleet's state as this replica last answered it (none for a local breaker).
    pub state: Option<FleetStateJson>,
    /// The latest transitions this replica's writes made, oldest first.
    pub transitions: Vec<TransitionJson>,
    /// Transitions made here since tracked, by the status they went to.
    pub transitions_total: TransitionTotals,
    /// Each gateway's view, by gateway id.
    pub gateways: Vec<GatewayView>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FleetStateJson {
    pub key: String,
    pub status: Status,
    /// Open: when the fleet's breaker goes half-open (ms since the epoch).
    pub half_open_at_ms: Option<u64>,
    /// Half-open: the round's id.
    pub round: Option<u64>,
    /// The fleet's window of calls when answered.
    pub window: Tally,
    pub params: FleetParams,
    pub updated_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TransitionTotals {
    pub closed: u64,
    pub open: u64,
    pub half_open: u64,
}

/// One transition of the fleet's state, with its figures (the window's calls for a trip,
/// the round's probes for a half-open outcome, none for the end of an opening).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TransitionJson {
    pub at_ms: u64,
    /// The state's key (several parameters under one name each have their own).
    pub key: String,
    pub from: Status,
    pub to: Status,
    pub cause: String,
    pub calls: u32,
    pub slow: u32,
    pub failed: u32,
}

impl TransitionJson {
    fn of(key: &str, transition: &Transition, now: Instant) -> TransitionJson {
        TransitionJson {
            at_ms: millis(now),
            key: key.to_string(),
            from: transition.from,
            to: transition.to,
            cause: transition.cause.to_string(),
            calls: transition.figures.calls,
            slow: transition.figures.slow,
            failed: transition.figures.failed,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GatewayView {
    pub gateway: String,
    pub status: Status,
    pub at_ms: u64,
}

impl BreakerJson {
    fn of(name: &str, breaker: &Breaker, now: Instant) -> BreakerJson {
        let [closed, open, half_open] = breaker.transitions_total;
        BreakerJson {
            name: name.to_string(),
            fleet: breaker.fleet,
            state: breaker.state.as_ref().map(|state| {
                let answer = state.decided.answer;
                FleetStateJson {
                    key: state.key.clone(),
                    status: answer.status,
                    half_open_at_ms: (answer.status == Status::Open)
                        .then(|| millis(state.at).saturating_add(answer.half_open_in_ms)),
                    round: (answer.status == Status::HalfOpen).then_some(answer.round),
                    window: state.decided.window,
                    params: state.params,
                    updated_ms: millis(state.at),
                }
            }),
            transitions: breaker.transitions.iter().cloned().collect(),
            transitions_total: TransitionTotals {
                closed,
                open,
                half_open,
            },
            gateways: breaker
                .gateways
                .iter()
                .filter(|(_, (_, at))| live(*at, now))
                .map(|(gateway, (status, at))| GatewayView {
                    gateway: gateway.clone(),
                    status: *status,
                    at_ms: millis(*at),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests;
