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
//! Stores: [`MemoryBreakers`] (the embedded store: a bounded table, idle states expire)
//! and the Redis store (`redis/breakers.rs`: the same machine, an optimistic
//! read-then-swap on one key per state). Time is the store's: the memory store's clock,
//! Redis `TIME`.

use super::Clock;
use super::StoreError;
use async_trait::async_trait;
use diana_core::breaker::{
    FleetAnswer, Phase, PlaceClaim, ProbeTally, Record, Source, State, Status, Tally, Transitions,
};
use diana_core::report::{BreakerReport, FleetParams};
use diana_core::time::{Instant, Nanos};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

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

/// A store that keeps the fleet's breakers.
#[async_trait]
pub trait FleetBreakers: Send + Sync {
    /// Applies each call to its breaker's state ([`apply`]) and answers each, in order.
    /// Calls on one state are applied one after the other (in order within a report);
    /// nothing is answered unless every call was applied.
    async fn report(&self, calls: &[BreakerCall]) -> Result<Vec<Decided>, StoreError>;
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

// ---------------------------------------------------------------------------------------
// The embedded store's table.

/// The most breaker states the memory store holds by default.
pub const DEFAULT_MAX_STATES: usize = 10_000;

/// When full of live states, the table is swept at most this often.
const FULL_SWEEP_INTERVAL: Nanos = Nanos::from_millis(100);

struct Held {
    state: State,
    /// The last report on it.
    touched: Instant,
}

struct Table {
    states: HashMap<(String, FleetParams), Held>,
    next_full_sweep: Instant,
    evicted: u64,
}

impl Table {
    fn sweep(&mut self, now: Instant) {
        let before = self.states.len();
        self.states
            .retain(|(_, params), held| !idle(held, params, now));
        self.evicted += (before - self.states.len()) as u64;
    }
}

/// The embedded store's breaker states: one process-local table, every report's work
/// under one lock. Bounded: at most `max_states` states (each a few hundred bytes and its
/// key); idle ones ([`idle_after`]) are dropped to make room, and when every one is live a
/// report that needs a new state is refused ([`StoreError::Full`], HTTP 503) rather than
/// growing the table.
pub struct MemoryBreakers {
    clock: Arc<dyn Clock>,
    max_states: usize,
    table: Mutex<Table>,
}

impl MemoryBreakers {
    /// A table of at most `max_states` (at least 1) on `clock`.
    pub fn new(clock: Arc<dyn Clock>, max_states: usize) -> MemoryBreakers {
        MemoryBreakers {
            clock,
            max_states: max_states.max(1),
            table: Mutex::new(Table {
                states: HashMap::new(),
                next_full_sweep: Instant::EPOCH,
                evicted: 0,
            }),
        }
    }

    /// States held now (idle ones included until swept).
    pub fn len(&self) -> usize {
        self.lock().states.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Idle states dropped since the start.
    pub fn evicted(&self) -> u64 {
        self.lock().evicted
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        // States are written back whole after the machine ran: a poisoned lock is usable.
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// [`FleetBreakers::report`] at `now`. All or nothing: when a new state finds no
    /// room, no call of the report is applied.
    pub fn report_at(
        &self,
        calls: &[BreakerCall],
        now: Instant,
    ) -> Result<Vec<Decided>, StoreError> {
        if let Some(call) = calls.iter().find(|call| call.params.edition().is_none()) {
            return Err(out_of_range(&call.key));
        }
        let mut table = self.lock();
        let mut new: Vec<(&str, FleetParams)> = Vec::new();
        for call in calls {
            let id = (call.key.as_str(), call.params);
            if !table.states.contains_key(&(call.key.clone(), call.params)) && !new.contains(&id) {
                new.push(id);
            }
        }
        if !new.is_empty() && table.states.len() + new.len() > self.max_states {
            let clock_went_back = now.saturating_add(FULL_SWEEP_INTERVAL) < table.next_full_sweep;
            if now >= table.next_full_sweep || clock_went_back {
                table.sweep(now);
                table.next_full_sweep = now.saturating_add(FULL_SWEEP_INTERVAL);
            }
            if table.states.len() + new.len() > self.max_states {
                return Err(StoreError::Full(format!(
                    "{} breaker states, none idle (at most {})",
                    table.states.len(),
                    self.max_states
                )));
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

fn out_of_range(key: &str) -> StoreError {
    StoreError::Unsupported(format!("breaker {key}: parameters out of range"))
}

#[async_trait]
impl FleetBreakers for MemoryBreakers {
    async fn report(&self, calls: &[BreakerCall]) -> Result<Vec<Decided>, StoreError> {
        self.report_at(calls, self.clock.now())
    }
}

#[cfg(test)]
mod tests;
