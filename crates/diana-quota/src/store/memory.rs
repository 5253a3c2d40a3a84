//! The embedded store: diana-core's in-memory decision table
//! ([`diana_core::quota::table`], the very table `diana simulate` and the worker's tests
//! decide with) behind one lock, on the service's clock. Every rule of a request is decided
//! under the lock, so all or nothing is simply: decide everything, then keep every change
//! or none. Correct for one replica only.
//!
//! Bounded memory, whatever clients send: the table holds at most `--memory-max-keys`
//! counters, evicts idle ones to make room, and refuses a request that needs a new counter
//! when every one is live ([`StoreError::Full`], HTTP 503). A counter is its key bound to
//! its parameters (`diana_core::quota::CounterId`).

use super::breakers::{FleetBreakers, MemoryBreakers, DEFAULT_MAX_STATES};
use super::{
    CounterDigest, Grant, Noted, Outcome, Part, Spending, Spent, Store, StoreError, Usage,
};
use async_trait::async_trait;
use diana_core::algo::Mark;
use diana_core::quota::ledger::CallLedger;
use diana_core::quota::table::{ChargeRefused, Full, Table};
use diana_core::time::Instant;
use diana_core::wire::{ResolvedRule, RuleResult};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

pub use diana_core::quota::table::DEFAULT_MAX_KEYS;

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

/// Counters in memory, one table for the process.
pub struct MemoryStore {
    clock: Arc<dyn Clock>,
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

/// The store's answer to a full table.
fn full(full: Full) -> StoreError {
    StoreError::Full(format!(
        "{} counters, none idle (--memory-max-keys {})",
        full.held, full.max_keys
    ))
}

fn refused(refused: ChargeRefused) -> StoreError {
    match refused {
        ChargeRefused::Debtless(debtless) => StoreError::Unsupported(debtless.to_string()),
        ChargeRefused::Full(table) => full(table),
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
            table: Mutex::new(Table::with_capacity(max_keys)),
            calls: Mutex::new(CallLedger::default()),
        }
    }

    /// Number of counters held (idle ones included until they are swept).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        // A panic while holding the lock cannot leave a counter half-written (states are
        // written back whole, after the decision), so a poisoned lock is usable.
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Decides every rule at `now` (nanoseconds since the epoch), all or nothing.
    pub fn acquire_at(
        &self,
        rules: &[ResolvedRule<'_>],
        now: Instant,
    ) -> Result<Vec<Outcome>, StoreError> {
        self.lock().acquire(rules, now).map_err(full)
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
        self.lock().charge(rules, now).map_err(refused)
    }

    /// Gives back the grants of `outcomes` at `now`.
    pub fn release_at(
        &self,
        rules: &[ResolvedRule<'_>],
        outcomes: &[Outcome],
        now: Instant,
    ) -> Result<Vec<RuleResult>, StoreError> {
        Ok(self.lock().release(rules, outcomes, now))
    }

    /// Renews concurrency places counted at `places` at `now`.
    pub fn renew_at(
        &self,
        rules: &[ResolvedRule<'_>],
        places: &[Mark],
        now: Instant,
    ) -> Result<Vec<Outcome>, StoreError> {
        self.lock().renew(rules, places, now).map_err(full)
    }

    /// Decides one RLS call at `now` ([`Store::spend`]).
    pub fn spend_at(
        &self,
        rules: &[ResolvedRule<'_>],
        how: &[Spending],
        now: Instant,
    ) -> Result<Spent, StoreError> {
        self.lock().spend(rules, how, now).map_err(refused)
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

    async fn spend(
        &self,
        rules: &[ResolvedRule<'_>],
        how: &[Spending],
    ) -> Result<Spent, StoreError> {
        self.spend_at(rules, how, self.clock.now())
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
            self.lock().max_keys()
        )
    }

    fn usage(&self) -> Option<Usage> {
        let table = self.lock();
        Some(Usage {
            keys: table.len() as u64,
            capacity: table.max_keys() as u64,
            evicted: table.evicted(),
        })
    }

    fn breakers(&self) -> Option<&dyn FleetBreakers> {
        Some(&self.breakers)
    }
}
