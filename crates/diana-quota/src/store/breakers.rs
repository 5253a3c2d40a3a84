//! The fleet's breakers (`scope: global`, DESIGN §4b): one state per breaker for every
//! gateway, kept by the store, updated by the gateways' reports (`POST /v1/report`) and
//! answered to each of them as a
//! [`FleetAnswer`](diana_core::breaker::FleetAnswer).
//!
//! The state is the gateway's own machine ([`State`](diana_core::breaker::State)), run
//! here in Rust over every gateway's tallies; the store only keeps it. A state is keyed by
//! the breaker's key **and** its parameters
//! ([`FleetParams`](diana_core::report::FleetParams)): a report with the same key
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
//! The decisions are diana-core's (`diana_core::quota::fleet`: [`apply`], [`FleetTable`]),
//! so `diana simulate` and the worker's tests decide exactly as the service does.
//!
//! Stores: [`MemoryBreakers`] (the embedded store: a bounded table, idle states expire)
//! and the Redis store (`redis/breakers.rs`: the same machine, an optimistic
//! read-then-swap on one key per state). Time is the store's: the memory store's clock,
//! Redis `TIME`.

use super::Clock;
use super::StoreError;
use async_trait::async_trait;
pub use diana_core::quota::fleet::{
    answer, apply, decode, encode, idle_after, round_id, BreakerCall, Decided, FleetTable, Refused,
    DEFAULT_MAX_STATES,
};
use diana_core::time::Instant;
use std::sync::{Arc, Mutex, PoisonError};

/// A store that keeps the fleet's breakers.
#[async_trait]
pub trait FleetBreakers: Send + Sync {
    /// Applies each call to its breaker's state ([`apply`]) and answers each, in order.
    /// Calls on one state are applied one after the other (in order within a report);
    /// nothing is answered unless every call was applied.
    async fn report(&self, calls: &[BreakerCall]) -> Result<Vec<Decided>, StoreError>;
}

/// The embedded store's breaker states: the core's [`FleetTable`] under one lock, on the
/// store's clock.
pub struct MemoryBreakers {
    clock: Arc<dyn Clock>,
    table: Mutex<FleetTable>,
}

impl MemoryBreakers {
    /// A table of at most `max_states` (at least 1) on `clock`.
    pub fn new(clock: Arc<dyn Clock>, max_states: usize) -> MemoryBreakers {
        MemoryBreakers {
            clock,
            table: Mutex::new(FleetTable::new(max_states)),
        }
    }

    /// States held now (idle ones included until swept).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Idle states dropped since the start.
    pub fn evicted(&self) -> u64 {
        self.lock().evicted()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FleetTable> {
        // States are written back whole after the machine ran: a poisoned lock is usable.
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// [`FleetBreakers::report`] at `now`.
    pub fn report_at(
        &self,
        calls: &[BreakerCall],
        now: Instant,
    ) -> Result<Vec<Decided>, StoreError> {
        self.lock()
            .report_at(calls, now)
            .map_err(|refused| match refused {
                Refused::Full { .. } => StoreError::Full(refused.to_string()),
                Refused::OutOfRange { .. } => StoreError::Unsupported(refused.to_string()),
            })
    }
}

#[async_trait]
impl FleetBreakers for MemoryBreakers {
    async fn report(&self, calls: &[BreakerCall]) -> Result<Vec<Decided>, StoreError> {
        self.report_at(calls, self.clock.now())
    }
}

#[cfg(test)]
mod tests;
