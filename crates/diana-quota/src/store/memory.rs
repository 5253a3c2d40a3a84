//! The embedded store: counters in a process-local table, decided by the same algorithm
//! code the filter uses (`diana_core::algo`). Correct for one replica only.

use super::{Store, StoreError};
use async_trait::async_trait;
use diana_core::algo::{Algorithm, Limit};
use diana_core::global::wire::{ResolvedRule, RuleResult};
use diana_core::time::Nanos;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// Where the memory store's "now" comes from (tests drive it by hand).
pub trait Clock: Send + Sync {
    /// Nanoseconds since the Unix epoch.
    fn now(&self) -> Nanos;
}

/// The system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Nanos {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|elapsed| u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}

/// Idle entries are swept when the table reaches this size, then when it doubles.
const MIN_SWEEP: usize = 4096;

struct Entry {
    algo: &'static dyn Algorithm,
    limit: Limit,
    state: Vec<u64>,
}

struct Table {
    /// (key, algorithm code) → counter.
    entries: HashMap<(String, &'static str), Entry>,
    sweep_at: usize,
}

/// Counters in memory, one table for the process.
pub struct MemoryStore {
    clock: Arc<dyn Clock>,
    table: Mutex<Table>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new(Arc::new(SystemClock))
    }
}

impl MemoryStore {
    pub fn new(clock: Arc<dyn Clock>) -> MemoryStore {
        MemoryStore {
            clock,
            table: Mutex::new(Table {
                entries: HashMap::new(),
                sweep_at: MIN_SWEEP,
            }),
        }
    }

    /// Number of counters held (idle ones included until the next sweep).
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        // A panic while holding the lock cannot leave a counter half-written (each
        // decision writes its state words in one assignment), so a poisoned lock is usable.
        self.table
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Decides every rule at `now` (nanoseconds since the epoch).
    pub fn decide_at(&self, rules: &[ResolvedRule<'_>], now: Nanos) -> Vec<RuleResult> {
        let mut table = self.lock();
        let results = rules
            .iter()
            .map(|rule| {
                let words = rule.algo.state_words(&rule.limit);
                let entry = table
                    .entries
                    .entry((rule.key.to_string(), rule.algo.code()))
                    .or_insert_with(|| Entry {
                        algo: rule.algo,
                        limit: rule.limit,
                        state: vec![0; words],
                    });
                if entry.limit != rule.limit || entry.state.len() != words {
                    // Same key, other parameters: a new counter.
                    *entry = Entry {
                        algo: rule.algo,
                        limit: rule.limit,
                        state: vec![0; words],
                    };
                }
                let verdict =
                    rule.algo
                        .acquire(&rule.limit, &mut entry.state, now, rule.want.get());
                RuleResult::from_verdict(&verdict)
            })
            .collect();
        if table.entries.len() >= table.sweep_at {
            table
                .entries
                .retain(|_, entry| !entry.algo.is_idle(&entry.limit, &entry.state, now));
            table.sweep_at = MIN_SWEEP.max(table.entries.len().saturating_mul(2));
        }
        results
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn check_and_update(
        &self,
        rules: &[ResolvedRule<'_>],
    ) -> Result<Vec<RuleResult>, StoreError> {
        Ok(self.decide_at(rules, self.clock.now()))
    }

    async fn health(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn describe(&self) -> String {
        "memory (embedded, one replica only)".to_string()
    }
}
