//! The embedded store: counters in a process-local table, decided by the same algorithm
//! code the filter uses (`diana_core::algo`), all rules of a request under one lock (so
//! all or nothing is simply: decide everything, then keep every change or none). Correct
//! for one replica only.
//!
//! Bounded memory, whatever clients send: the table holds at most `max_keys` counters. A
//! request that would add counters beyond that first evicts the idle ones (counters that
//! remember nothing, as if fresh: their window passed, their bucket refilled); when the
//! table is full of live counters it is refused ([`StoreError::Full`], HTTP 503) and the
//! table never grows past the cap. Requests on counters already held, and denials, never
//! need room. Idle counters are also swept when the table doubles (from 4096).
//!
//! A counter is its key bound to its parameters ([`CounterId`]: the algorithm, rpu, unit,
//! burst and slices): a request with the same key and other parameters has a counter of
//! its own, and cannot read or reset another's.

use super::breakers::{FleetBreakers, MemoryBreakers, DEFAULT_MAX_STATES};
use super::{decide, CounterDigest, Grant, Noted, Outcome, Part, Store, StoreError, Usage};
use async_trait::async_trait;
use diana_core::algo::{Algorithm, Limit, Mark};
use diana_core::quota::ledger::CallLedger;
use diana_core::quota::CounterId;
use diana_core::time::{Instant, Nanos};
use diana_core::wire::{ResolvedRule, RuleResult};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

/// Where the memory store's "now" comes from (tests drive it by hand).
pub trait Clock: Send + Sync {
    /// Nanoseconds since the Unix epoch.
    fn now(&self) -> Instant;
}

/// The system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|elapsed| {
                Instant::from_unix_nanos(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX))
            })
            .unwrap_or(Instant::EPOCH)
    }
}

/// Default cap on counters: at most ~700 bytes each (a 128-byte key, a 60-slice sliding
/// window, the table's overhead), so at most ~70 MB.
pub const DEFAULT_MAX_KEYS: usize = 100_000;

/// Idle entries are swept when the table reaches this size, then when it doubles.
const MIN_SWEEP: usize = 4096;

/// When full of live counters, the table is swept again at most this often (a sweep reads
/// every counter, under the lock).
const FULL_SWEEP_INTERVAL: Nanos = Nanos::from_millis(100);

struct Entry {
    algo: &'static dyn Algorithm,
    limit: Limit,
    state: Vec<u64>,
}

type Id = CounterId;

struct Table {
    /// (key, algorithm, limit) → counter.
    entries: HashMap<Id, Entry>,
    sweep_at: usize,
    /// When full: no sweep before this instant.
    next_full_sweep: Instant,
    evicted: u64,
}

impl Table {
    /// Drops every idle counter; returns how many.
    fn sweep(&mut self, now: Instant) -> usize {
        let before = self.entries.len();
        self.entries
            .retain(|_, entry| !entry.algo.is_idle(&entry.limit, &entry.state, now));
        let removed = before - self.entries.len();
        self.evicted += removed as u64;
        removed
    }
}

/// The counters one request touches, loaded from the table.
struct Loaded {
    ids: Vec<Id>,
    algos: Vec<(&'static dyn Algorithm, Limit)>,
    states: Vec<Vec<u64>>,
    slots: Vec<usize>,
}

/// Counters in memory, one table for the process.
pub struct MemoryStore {
    clock: Arc<dyn Clock>,
    max_keys: usize,
    table: Mutex<Table>,
    /// Calls with an id, for their releases (bounded: `ledger::MAX_CALLS`).
    calls: Mutex<CallLedger>,
    /// The fleet's breakers (bounded: [`DEFAULT_MAX_STATES`]).
    breakers: MemoryBreakers,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new(Arc::new(SystemClock))
    }
}

impl MemoryStore {
    pub fn new(clock: Arc<dyn Clock>) -> MemoryStore {
        MemoryStore::with_capacity(clock, DEFAULT_MAX_KEYS)
    }

    /// A store that holds at most `max_keys` counters (at least 1).
    pub fn with_capacity(clock: Arc<dyn Clock>, max_keys: usize) -> MemoryStore {
        MemoryStore {
            breakers: MemoryBreakers::new(clock.clone(), DEFAULT_MAX_STATES),
            clock,
            max_keys: max_keys.max(1),
            table: Mutex::new(Table {
                entries: HashMap::new(),
                sweep_at: MIN_SWEEP,
                next_full_sweep: Instant::EPOCH,
                evicted: 0,
            }),
            calls: Mutex::new(CallLedger::default()),
        }
    }

    /// Number of counters held (idle ones included until they are swept).
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        // A panic while holding the lock cannot leave a counter half-written (states are
        // written back whole, after the decision), so a poisoned lock is usable.
        self.table
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Loads the counters of `rules` (each rule's own: its key bound to its parameters).
    fn load(table: &Table, rules: &[ResolvedRule<'_>]) -> Loaded {
        let mut loaded = Loaded {
            ids: Vec::new(),
            algos: Vec::new(),
            states: Vec::new(),
            slots: Vec::with_capacity(rules.len()),
        };
        for rule in rules {
            let known = loaded.ids.iter().position(|id| id.is(rule));
            let slot = known.unwrap_or_else(|| {
                let id = CounterId::of(rule);
                let words = rule.algo.state_words(&rule.limit);
                let state = table
                    .entries
                    .get(&id)
                    .filter(|entry| entry.state.len() == words)
                    .map_or_else(|| vec![0; words], |entry| entry.state.clone());
                loaded.ids.push(id);
                loaded.algos.push((rule.algo, rule.limit));
                loaded.states.push(state);
                loaded.ids.len() - 1
            });
            loaded.slots.push(slot);
        }
        loaded
    }

    /// Writes the counters back, making room for new ones first; refuses (writing nothing)
    /// when the table would grow past its cap.
    fn write(&self, table: &mut Table, loaded: Loaded, now: Instant) -> Result<(), StoreError> {
        let new = loaded
            .ids
            .iter()
            .filter(|id| !table.entries.contains_key(*id))
            .count();
        if new > 0 && table.entries.len() + new > self.max_keys {
            let clock_went_back = now.saturating_add(FULL_SWEEP_INTERVAL) < table.next_full_sweep;
            if now >= table.next_full_sweep || clock_went_back {
                table.sweep(now);
                table.next_full_sweep = now.saturating_add(FULL_SWEEP_INTERVAL);
            }
            if table.entries.len() + new > self.max_keys {
                return Err(StoreError::Full(format!(
                    "{} counters, none idle (--memory-max-keys {})",
                    table.entries.len(),
                    self.max_keys
                )));
            }
        }
        for ((id, (algo, limit)), state) in
            loaded.ids.into_iter().zip(loaded.algos).zip(loaded.states)
        {
            table.entries.insert(id, Entry { algo, limit, state });
        }
        if table.entries.len() >= table.sweep_at {
            table.sweep(now);
            table.sweep_at = MIN_SWEEP.max(table.entries.len().saturating_mul(2));
        }
        Ok(())
    }

    /// Decides every rule at `now` (nanoseconds since the epoch), all or nothing.
    pub fn acquire_at(
        &self,
        rules: &[ResolvedRule<'_>],
        now: Instant,
    ) -> Result<Vec<Outcome>, StoreError> {
        let mut table = self.lock();
        let mut loaded = Self::load(&table, rules);
        let (outcomes, committed) = decide::acquire(rules, &loaded.slots, &mut loaded.states, now);
        if committed {
            self.write(&mut table, loaded, now)?;
        }
        Ok(outcomes)
    }

    /// [`MemoryStore::acquire_at`], the results only.
    pub fn decide_at(
        &self,
        rules: &[ResolvedRule<'_>],
        now: Instant,
    ) -> Result<Vec<RuleResult>, StoreError> {
        Ok(self
            .acquire_at(rules, now)?
            .into_iter()
            .map(|outcome| outcome.result)
            .collect())
    }

    /// Charges every rule `want` tokens past its limit at `now`.
    pub fn charge_at(
        &self,
        rules: &[ResolvedRule<'_>],
        now: Instant,
    ) -> Result<Vec<RuleResult>, StoreError> {
        super::refuse_debtless(rules)?;
        let mut table = self.lock();
        let mut loaded = Self::load(&table, rules);
        let results = decide::charge(rules, &loaded.slots, &mut loaded.states, now);
        self.write(&mut table, loaded, now)?;
        Ok(results)
    }

    /// Gives back the grants of `outcomes` at `now`.
    pub fn release_at(
        &self,
        rules: &[ResolvedRule<'_>],
        outcomes: &[Outcome],
        now: Instant,
    ) -> Result<Vec<RuleResult>, StoreError> {
        let mut table = self.lock();
        let mut loaded = Self::load(&table, rules);
        let results = decide::release(rules, &loaded.slots, &mut loaded.states, outcomes, now);
        // Only counters still held are written back: a release never creates one.
        for ((id, (algo, limit)), state) in
            loaded.ids.into_iter().zip(loaded.algos).zip(loaded.states)
        {
            if let Some(entry) = table.entries.get_mut(&id) {
                *entry = Entry { algo, limit, state };
            }
        }
        Ok(results)
    }
}

impl MemoryStore {
    /// Renews concurrency places counted at `places` at `now`.
    pub fn renew_at(
        &self,
        rules: &[ResolvedRule<'_>],
        places: &[Mark],
        now: Instant,
    ) -> Result<Vec<Outcome>, StoreError> {
        let mut table = self.lock();
        let mut loaded = Self::load(&table, rules);
        let outcomes = decide::renew(rules, &loaded.slots, &mut loaded.states, places, now);
        self.write(&mut table, loaded, now)?;
        Ok(outcomes)
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn check_and_update(
        &self,
        rules: &[ResolvedRule<'_>],
    ) -> Result<Vec<Outcome>, StoreError> {
        self.acquire_at(rules, self.clock.now())
    }

    async fn charge(&self, rules: &[ResolvedRule<'_>]) -> Result<Vec<RuleResult>, StoreError> {
        self.charge_at(rules, self.clock.now())
    }

    async fn release(
        &self,
        rules: &[ResolvedRule<'_>],
        outcomes: &[Outcome],
    ) -> Result<(), StoreError> {
        self.release_at(rules, outcomes, self.clock.now())
            .map(|_| ())
    }

    async fn renew(
        &self,
        rules: &[ResolvedRule<'_>],
        places: &[Mark],
    ) -> Result<Vec<Outcome>, StoreError> {
        self.renew_at(rules, places, self.clock.now())
    }

    async fn note_call(&self, call: &str, grants: &[Grant]) -> Result<Noted, StoreError> {
        let now = self.clock.now();
        let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(calls.granted(call, grants.to_vec(), now))
    }

    async fn take_call(&self, call: &str) -> Result<Option<Vec<Grant>>, StoreError> {
        let now = self.clock.now();
        let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(calls.release(call, now))
    }

    async fn take_part(
        &self,
        call: &str,
        rule: usize,
        tokens: u32,
        counter: CounterDigest,
    ) -> Result<Part, StoreError> {
        let now = self.clock.now();
        let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(calls.take_part(call, rule, tokens, counter, now))
    }

    async fn health(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "memory (embedded, one replica only, at most {} counters)",
            self.max_keys
        )
    }

    fn usage(&self) -> Option<Usage> {
        let table = self.lock();
        Some(Usage {
            keys: table.entries.len() as u64,
            capacity: self.max_keys as u64,
            evicted: table.evicted,
        })
    }

    fn breakers(&self) -> Option<&dyn FleetBreakers> {
        Some(&self.breakers)
    }
}
