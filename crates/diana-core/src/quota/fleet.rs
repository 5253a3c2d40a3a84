//! The fleet's breakers (`scope: global`, DESIGN §4b): one state per breaker for every
//! gateway, kept by the store, updated by the gateways' reports (`POST /v1/report`) and
//! answered to each of them as a [`FleetAnswer`].
//!
//! The state is the gateway's own machine ([`State`], `diana_core::breaker::machine`), run
//! here in Rust over every gateway's tallies; the store only keeps it. A state is keyed by
//! the breaker's key **and** its parameters ([`FleetParams`]): a report with the same key
//! and other parameters has a state of its own (a rollout of new thresholds does not mix
//! with the old ones), and can neither read nor reset another's.
//!
//! One report's work on one breaker ([`apply`]), in this order:
//!
//! ```text
//!   calls    → State::record   (counted while closed; may trip it open)
//!   probes   → State::settle   (good ones settle the oldest places; one bad reopens;
//!                               every place good closes)
//!   unused   → State::release  (places the gateway withdraws: only for the current round)
//!   wanted   → State::grant    (half-open: free places, up to what the gateway wants)
//!   answer   = status, ms until half-open (open), round id (half-open), places granted now
//! ```
//!
//! Every operation first syncs the state with the time (open → half-open once `open_ms`
//! is over; half-open → open when a place is held past `probe_timeout_ms`), so a report
//! that carries nothing still moves the state on. The round id is the round's instant in
//! nanoseconds since the epoch: unique per round, so a gateway's claim on an earlier
//! round's places frees nothing in the current one.
//!
//! Every store runs these decisions (the "one decision table" of the quota service, as
//! [`super::table`] is for the counters): diana-quota's embedded store ([`FleetTable`] under
//! its lock) and its Redis store (the same [`apply`] over an optimistic read-then-swap of
//! one key per state), and [`super::MemoryQuota`], the in-process service of `diana
//! simulate` and the worker's tests. Time is the store's.

use crate::breaker::{
    FleetAnswer, Phase, PlaceClaim, ProbeTally, Record, Source, State, Status, Tally, Transitions,
};
use crate::report::{BreakerReport, FleetParams};
use crate::time::{Instant, Nanos};
use std::collections::HashMap;

/// What one report says about one fleet breaker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerCall {
    /// The breaker's fleet key (the report's `key`).
    pub key: String,
    pub params: FleetParams,
    pub calls: Tally,
    pub probes: ProbeTally,
    pub places: Option<PlaceClaim>,
}

impl BreakerCall {
    /// The work a report's breaker asks for.
    pub fn of(report: &BreakerReport) -> BreakerCall {
        BreakerCall {
            key: report.key.clone(),
            params: report.params,
            calls: report.calls,
            probes: report.probes,
            places: report.places,
        }
    }

    /// Gives back `places` of `round` and nothing else (an answer that came too late for
    /// its gateway: the places it granted would sit unused until their probes time out).
    pub fn give_back(key: &str, params: FleetParams, round: u64, places: u32) -> BreakerCall {
        BreakerCall {
            key: key.to_string(),
            params,
            calls: Tally::ZERO,
            probes: ProbeTally::default(),
            places: Some(PlaceClaim {
                round,
                unused: places,
                wanted: 0,
            }),
        }
    }
}

/// The fleet's state of one breaker after one report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decided {
    pub answer: FleetAnswer,
    /// The transitions this report's write made (each comes back once, to the replica
    /// whose write made it).
    pub transitions: Transitions,
    /// The window's calls now (the figures the view shows).
    pub window: Tally,
}

/// A state left without a report for this long is forgotten (a fresh closed breaker
/// takes its place): longer than a window, an opening and a probe's timeout together, so
/// a state that still matters (calls in its window, an opening not over, a probe out) is
/// never forgotten while gateways report on it.
pub fn idle_after(params: &FleetParams) -> Nanos {
    let millis = u64::from(params.window_seconds)
        .saturating_mul(1_000)
        .saturating_add(params.open_ms)
        .saturating_add(params.probe_timeout_ms)
        .saturating_add(IDLE_MARGIN_MS);
    Nanos::saturating_from_millis(millis)
}

/// Added to [`idle_after`]: a minute of missed reports.
const IDLE_MARGIN_MS: u64 = 60_000;

/// The id of a half-open round in answers and claims: its instant, in nanoseconds since
/// the epoch.
pub fn round_id(round: Instant) -> u64 {
    round.unix_nanos()
}

/// A state as a store reads it: the bytes it holds ([`encode`]), or a fresh closed one
/// when there are none, they do not decode, or they hold other parameters (a store never
/// holds those under this key; garbage reads as fresh, never wedges).
pub fn decode(bytes: Option<&[u8]>, params: &FleetParams) -> Option<State> {
    let edition = params.edition()?;
    let stored = bytes
        .and_then(|bytes| Record::decode(bytes).ok())
        .map(|record| record.state)
        .filter(|state| *state.edition() == edition);
    Some(stored.unwrap_or_else(|| State::new(&edition)))
}

/// The bytes a store keeps for a state: the gateway's record layout
/// (`diana_core::breaker::record`), decided locally.
pub fn encode(state: &State) -> Vec<u8> {
    Record {
        state: state.clone(),
        source: Source::Local,
    }
    .encode()
}

/// One report's work on one breaker's state at `now` (see the module's docs). `None` when
/// the call's parameters are out of range (a checked report never has those).
pub fn apply(state: &mut State, call: &BreakerCall, now: Instant) -> Option<Decided> {
    let edition = call.params.edition()?;
    let mut transitions = state.record(&edition, call.calls, now);
    if !call.probes.is_empty() {
        transitions.extend(state.settle(&edition, call.probes, now));
    }
    let mut granted = 0;
    if let Some(claim) = call.places {
        if claim.unused > 0 && current_round(state) == Some(claim.round) {
            transitions.extend(state.release(&edition, claim.unused, now));
        }
        if claim.wanted > 0 {
            let (places, more) = state.grant(&edition, claim.wanted, now);
            granted = places;
            transitions.extend(more);
        }
    }
    Some(Decided {
        answer: answer(state, granted, now),
        transitions,
        window: state.window_total(now),
    })
}

fn current_round(state: &State) -> Option<u64> {
    match state.phase() {
        Phase::HalfOpen { round, .. } => Some(round_id(*round)),
        Phase::Closed | Phase::Open { .. } => None,
    }
}

/// The answer for a state at `now`, with `places` granted by this report.
pub fn answer(state: &State, places: u32, now: Instant) -> FleetAnswer {
    let open_ms = state.params().open_for.whole_millis();
    match state.phase() {
        Phase::Closed => FleetAnswer {
            status: Status::Closed,
            half_open_in_ms: 0,
            round: 0,
            places: 0,
        },
        Phase::Open { until } => FleetAnswer {
            status: Status::Open,
            half_open_in_ms: until
                .saturating_since(now)
                .div_ceil(Nanos::from_millis(1))
                .min(open_ms),
            round: 0,
            places: 0,
        },
        Phase::HalfOpen { round, .. } => FleetAnswer {
            status: Status::HalfOpen,
            half_open_in_ms: 0,
            round: round_id(*round),
            places,
        },
    }
}

/// The most breaker states the memory store holds by default.
pub const DEFAULT_MAX_STATES: usize = 10_000;

/// When full of live states, the table is swept at most this often.
const FULL_SWEEP_INTERVAL: Nanos = Nanos::from_millis(100);

#[derive(Debug)]
struct Held {
    state: State,
    /// The last report on it.
    touched: Instant,
}

/// Why a report was not applied: a new state found no room, every one being live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    Full {
        held: usize,
        most: usize,
    },
    /// A call's parameters are out of range (a checked report never has those).
    OutOfRange {
        key: String,
    },
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Full { held, most } => {
                write!(f, "{held} breaker states, none idle (at most {most})")
            }
            Refused::OutOfRange { key } => write!(f, "breaker {key}: parameters out of range"),
        }
    }
}

/// The fleet's breaker states in memory: one table, every report's work applied in order.
/// Bounded: at most `max_states` states (each a few hundred bytes and its key); idle ones
/// ([`idle_after`]) are dropped to make room, and when every one is live a report that
/// needs a new state is refused ([`Refused::Full`]) rather than growing the table.
#[derive(Debug)]
pub struct FleetTable {
    max_states: usize,
    states: HashMap<(String, FleetParams), Held>,
    next_full_sweep: Instant,
    evicted: u64,
}

impl FleetTable {
    fn sweep(&mut self, now: Instant) {
        let before = self.states.len();
        self.states
            .retain(|(_, params), held| !idle(held, params, now));
        self.evicted += (before - self.states.len()) as u64;
    }

    /// A table of at most `max_states` (at least 1).
    pub fn new(max_states: usize) -> FleetTable {
        FleetTable {
            max_states: max_states.max(1),
            states: HashMap::new(),
            next_full_sweep: Instant::EPOCH,
            evicted: 0,
        }
    }

    /// States held now (idle ones included until swept).
    pub fn len(&self) -> usize {
        self.states.len()
    }

    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// Idle states dropped since the start.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Applies each call to its state at `now` and answers each, in order. All or
    /// nothing: when a new state finds no room, no call of the report is applied.
    pub fn report_at(
        &mut self,
        calls: &[BreakerCall],
        now: Instant,
    ) -> Result<Vec<Decided>, Refused> {
        if let Some(call) = calls.iter().find(|call| call.params.edition().is_none()) {
            return Err(Refused::OutOfRange {
                key: call.key.clone(),
            });
        }
        let table = self;
        let mut new: Vec<(&str, FleetParams)> = Vec::new();
        for call in calls {
            let id = (call.key.as_str(), call.params);
            if !table.states.contains_key(&(call.key.clone(), call.params)) && !new.contains(&id) {
                new.push(id);
            }
        }
        if !new.is_empty() && table.states.len() + new.len() > table.max_states {
            let clock_went_back = now.saturating_add(FULL_SWEEP_INTERVAL) < table.next_full_sweep;
            if now >= table.next_full_sweep || clock_went_back {
                table.sweep(now);
                table.next_full_sweep = now.saturating_add(FULL_SWEEP_INTERVAL);
            }
            if table.states.len() + new.len() > table.max_states {
                return Err(Refused::Full {
                    held: table.states.len(),
                    most: table.max_states,
                });
            }
        }
        let mut decided = Vec::with_capacity(calls.len());
        for call in calls {
            let (Some(fresh), Some(edition)) = (decode(None, &call.params), call.params.edition())
            else {
                continue;
            };
            let held = table
                .states
                .entry((call.key.clone(), call.params))
                .or_insert(Held {
                    state: fresh.clone(),
                    touched: now,
                });
            if idle(held, &call.params, now) || *held.state.edition() != edition {
                // Forgotten: as if swept just now.
                held.state = fresh;
            }
            held.touched = now;
            if let Some(answer) = apply(&mut held.state, call, now) {
                decided.push(answer);
            }
        }
        Ok(decided)
    }
}

fn idle(held: &Held, params: &FleetParams, now: Instant) -> bool {
    held.touched <= now && now.saturating_since(held.touched) >= idle_after(params)
}

/// The answer to a report on `table` at `now`: each breaker of the fleet decided
/// ([`FleetTable::report_at`]), each local one's status echoed.
pub fn answer_report(
    table: &mut FleetTable,
    report: &crate::report::ReportRequest,
    now: Instant,
) -> Result<crate::report::ReportResponse, Refused> {
    let mut answers: Vec<FleetAnswer> = report.breakers.iter().map(echo).collect();
    let fleet: Vec<usize> = report
        .breakers
        .iter()
        .enumerate()
        .filter(|(_, breaker)| breaker.fleet)
        .map(|(at, _)| at)
        .collect();
    let calls: Vec<BreakerCall> = fleet
        .iter()
        .filter_map(|&at| report.breakers.get(at).map(BreakerCall::of))
        .collect();
    let decided = table.report_at(&calls, now)?;
    for (&at, decided) in fleet.iter().zip(decided) {
        if let Some(answer) = answers.get_mut(at) {
            *answer = decided.answer;
        }
    }
    Ok(crate::report::ReportResponse { breakers: answers })
}

/// A breaker's entry before (or without) the fleet's answer: its own status echoed.
pub fn echo(breaker: &BreakerReport) -> FleetAnswer {
    FleetAnswer {
        status: breaker.status,
        half_open_in_ms: 0,
        round: 0,
        places: 0,
    }
}
