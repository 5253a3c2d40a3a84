//! The in-memory decision table: counters in a process-local map, decided by [`decide`]
//! (the same decisions `lua/decide.lua` makes in Redis). One table, two users, so that they
//! cannot drift: diana-quota's embedded store (`MemoryStore`, behind a lock, on the
//! service's clock) and [`super::MemoryQuota`] (`diana simulate`, the worker's `Sim`, the
//! engine's tests, on the caller's clock).
//!
//! A counter is its key bound to its parameters ([`CounterId`]: the algorithm, rpu, unit,
//! burst and slices): a rule with the same key and other parameters has a counter of its
//! own, and can neither read nor reset another's.
//!
//! Bounded memory, whatever clients send: the table holds at most `max_keys` counters. A
//! decision that would add counters beyond that first evicts the idle ones (counters that
//! remember nothing, as if fresh: their window passed, their bucket refilled); when the
//! table is full of live counters it is refused ([`Full`]) and never grows past the cap.
//! Decisions on counters already held, and denials, never need room. Idle counters are
//! also swept when the table doubles (from 4096).
//!
//! ```text
//!   load(rules) ──► one state per distinct counter (copies) ──► decide::<op>
//!        ▲                                                         │
//!        └──────────── write back: every state, or none ◄──────────┘
//!                      (new counters need room: sweep, else Full)
//! ```

use super::decide::{self, Spending, Spent};
use super::{CounterId, Outcome};
use crate::algo::{Algorithm, Limit, Mark};
use crate::time::{Instant, Nanos};
use crate::wire::{ResolvedRule, RuleResult};
use std::collections::HashMap;
use std::fmt;

/// Default cap on counters: at most ~700 bytes each (a 128-byte key, a 60-slice sliding
/// window, the table's overhead), so at most ~70 MB.
pub const DEFAULT_MAX_KEYS: usize = 100_000;

/// Idle entries are swept when the table reaches this size, then when it doubles.
pub const MIN_SWEEP: usize = 4096;

/// When full of live counters, the table is swept again at most this often (a sweep reads
/// every counter).
const FULL_SWEEP_INTERVAL: Nanos = Nanos::from_millis(100);

/// The table holds as many counters as it may and none is idle: a decision that needs a
/// new counter is refused (nothing written).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full {
    /// Counters held.
    pub held: usize,
    /// The cap.
    pub max_keys: usize,
}

impl fmt::Display for Full {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} counters, none idle (at most {})",
            self.held, self.max_keys
        )
    }
}

impl std::error::Error for Full {}

/// A rule that cannot be charged past its limit (a leaky bucket paces requests; it takes
/// no debts): a charge or a count on it is refused, nothing charged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Debtless {
    pub index: usize,
    pub algo: &'static str,
}

impl fmt::Display for Debtless {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rules[{}].algo: {} takes no debts (a leaky bucket paces requests; it cannot be charged after the fact)",
            self.index, self.algo
        )
    }
}

impl std::error::Error for Debtless {}

/// Why a charge was refused (nothing charged).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeRefused {
    Debtless(Debtless),
    Full(Full),
}

impl fmt::Display for ChargeRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChargeRefused::Debtless(refused) => refused.fmt(f),
            ChargeRefused::Full(full) => full.fmt(f),
        }
    }
}

impl std::error::Error for ChargeRefused {}

impl From<Debtless> for ChargeRefused {
    fn from(refused: Debtless) -> Self {
        ChargeRefused::Debtless(refused)
    }
}

impl From<Full> for ChargeRefused {
    fn from(full: Full) -> Self {
        ChargeRefused::Full(full)
    }
}

/// The first rule whose algorithm takes no debts, if any (`counts`: which rules are
/// charged past their limits; `None`: all of them).
pub fn debtless(rules: &[ResolvedRule<'_>], counts: Option<&[bool]>) -> Result<(), Debtless> {
    let charged = |index: usize| counts.is_none_or(|counts| counts.get(index) == Some(&true));
    match rules
        .iter()
        .enumerate()
        .find(|(index, rule)| charged(*index) && !rule.algo.allows_debt())
    {
        Some((index, rule)) => Err(Debtless {
            index,
            algo: rule.algo.code(),
        }),
        None => Ok(()),
    }
}

#[derive(Debug)]
struct Entry {
    algo: &'static dyn Algorithm,
    limit: Limit,
    state: Vec<u64>,
}

/// The counters one decision touches, loaded from the table: one state per distinct
/// counter, so that two rules on one counter see each other's tentative charges.
#[derive(Default)]
struct Loaded {
    ids: Vec<CounterId>,
    params: Vec<(&'static dyn Algorithm, Limit)>,
    states: Vec<Vec<u64>>,
    /// Per rule: which of them it uses.
    slots: Vec<usize>,
}

/// Counters in memory (see the module documentation).
#[derive(Debug)]
pub struct Table {
    entries: HashMap<CounterId, Entry>,
    max_keys: usize,
    sweep_at: usize,
    /// When full: no sweep before this instant.
    next_full_sweep: Instant,
    evicted: u64,
}

impl Default for Table {
    fn default() -> Self {
        Table::with_capacity(DEFAULT_MAX_KEYS)
    }
}

impl Table {
    pub fn new() -> Table {
        Table::default()
    }

    /// A table that holds at most `max_keys` counters (at least 1).
    pub fn with_capacity(max_keys: usize) -> Table {
        Table {
            entries: HashMap::new(),
            max_keys: max_keys.max(1),
            sweep_at: MIN_SWEEP,
            next_full_sweep: Instant::EPOCH,
            evicted: 0,
        }
    }

    /// Counters held (idle ones included until they are swept).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The most counters it may hold.
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// Idle counters evicted since it was made.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Drops every idle counter; returns how many.
    fn sweep(&mut self, now: Instant) -> usize {
        let before = self.entries.len();
        self.entries
            .retain(|_, entry| !entry.algo.is_idle(&entry.limit, &entry.state, now));
        let removed = before - self.entries.len();
        self.evicted += removed as u64;
        removed
    }

    fn load(&self, rules: &[ResolvedRule<'_>]) -> Loaded {
        let mut loaded = Loaded::default();
        for rule in rules {
            let slot = match loaded.ids.iter().position(|known| known.is(rule)) {
                Some(slot) => slot,
                None => {
                    let id = CounterId::of(rule);
                    let words = rule.algo.state_words(&rule.limit);
                    let state = self
                        .entries
                        .get(&id)
                        .filter(|entry| entry.state.len() == words)
                        .map_or_else(|| vec![0; words], |entry| entry.state.clone());
                    loaded.ids.push(id);
                    loaded.params.push((rule.algo, rule.limit.clone()));
                    loaded.states.push(state);
                    loaded.ids.len() - 1
                }
            };
            loaded.slots.push(slot);
        }
        loaded
    }

    /// Writes the counters back, making room for new ones first; refuses (writing nothing)
    /// when the table would grow past its cap.
    fn write(&mut self, loaded: Loaded, now: Instant) -> Result<(), Full> {
        let new = loaded
            .ids
            .iter()
            .filter(|id| !self.entries.contains_key(*id))
            .count();
        if new > 0 && self.entries.len() + new > self.max_keys {
            let clock_went_back = now.saturating_add(FULL_SWEEP_INTERVAL) < self.next_full_sweep;
            if now >= self.next_full_sweep || clock_went_back {
                self.sweep(now);
                self.next_full_sweep = now.saturating_add(FULL_SWEEP_INTERVAL);
            }
            if self.entries.len() + new > self.max_keys {
                return Err(Full {
                    held: self.entries.len(),
                    max_keys: self.max_keys,
                });
            }
        }
        for ((id, (algo, limit)), state) in
            loaded.ids.into_iter().zip(loaded.params).zip(loaded.states)
        {
            self.entries.insert(id, Entry { algo, limit, state });
        }
        if self.entries.len() >= self.sweep_at {
            self.sweep(now);
            self.sweep_at = MIN_SWEEP.max(self.entries.len().saturating_mul(2));
        }
        Ok(())
    }

    /// Writes back only the counters still held: giving back never creates one.
    fn write_held(&mut self, loaded: Loaded) {
        for ((id, (algo, limit)), state) in
            loaded.ids.into_iter().zip(loaded.params).zip(loaded.states)
        {
            if let Some(entry) = self.entries.get_mut(&id) {
                *entry = Entry { algo, limit, state };
            }
        }
    }

    /// Decides every rule at `now`, all or nothing ([`decide::acquire`]); a denial writes
    /// nothing.
    pub fn acquire(
        &mut self,
        rules: &[ResolvedRule<'_>],
        now: Instant,
    ) -> Result<Vec<Outcome>, Full> {
        let mut loaded = self.load(rules);
        let (outcomes, committed) = decide::acquire(rules, &loaded.slots, &mut loaded.states, now);
        if committed {
            self.write(loaded, now)?;
        }
        Ok(outcomes)
    }

    /// Charges every rule `want` tokens past its limit ([`decide::charge`]).
    pub fn charge(
        &mut self,
        rules: &[ResolvedRule<'_>],
        now: Instant,
    ) -> Result<Vec<RuleResult>, ChargeRefused> {
        debtless(rules, None)?;
        let mut loaded = self.load(rules);
        let results = decide::charge(rules, &loaded.slots, &mut loaded.states, now);
        self.write(loaded, now)?;
        Ok(results)
    }

    /// Gives back the grants of `outcomes`, an earlier decision of the same rules
    /// ([`decide::release`]); answers what each rule has after.
    pub fn release(
        &mut self,
        rules: &[ResolvedRule<'_>],
        outcomes: &[Outcome],
        now: Instant,
    ) -> Vec<RuleResult> {
        let mut loaded = self.load(rules);
        let results = decide::release(rules, &loaded.slots, &mut loaded.states, outcomes, now);
        self.write_held(loaded);
        results
    }

    /// Renews concurrency places counted at `places` ([`decide::renew`]).
    pub fn renew(
        &mut self,
        rules: &[ResolvedRule<'_>],
        places: &[Mark],
        now: Instant,
    ) -> Result<Vec<Outcome>, Full> {
        let mut loaded = self.load(rules);
        let outcomes = decide::renew(rules, &loaded.slots, &mut loaded.states, places, now);
        self.write(loaded, now)?;
        Ok(outcomes)
    }

    /// Decides one RLS call ([`decide::spend`]): its counts are kept whatever the answer,
    /// its takes only when it is admitted.
    pub fn spend(
        &mut self,
        rules: &[ResolvedRule<'_>],
        how: &[Spending],
        now: Instant,
    ) -> Result<Spent, ChargeRefused> {
        let counts: Vec<bool> = how
            .iter()
            .map(|spending| spending.spend == decide::Spend::Count)
            .collect();
        debtless(rules, Some(&counts))?;
        let mut loaded = self.load(rules);
        let spent = decide::spend(rules, &loaded.slots, &mut loaded.states, how, now);
        let changed = counts.iter().any(|&count| count)
            || spent
                .outcomes
                .iter()
                .any(|outcome| outcome.result.granted > 0);
        if changed {
            self.write(loaded, now)?;
        }
        Ok(spent)
    }
}
