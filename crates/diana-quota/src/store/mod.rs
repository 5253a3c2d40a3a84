//! The storage seam: where counters live. One call decides every rule of one gateway
//! request, **all or nothing**: either every rule has at least its `cost` available and
//! each is charged `min(want, available)`, or no rule is charged.
//!
//! - [`MemoryStore`]: in-process, reuses `diana_core::algo` (one replica only), decides
//!   everything under one lock ([`decide`], shared with `diana_core::quota`).
//! - [`RedisStore`]: Redis (one Lua script over every key of the request, atomic; a lean
//!   one when every rule is a fixed window) or Redis Cluster (one script per key, then
//!   compensation: grants of a denied request are given back).
//!
//! Both also keep the fleet's breakers ([`breakers`], `POST /v1/report`).

pub mod breakers;
mod memory;
mod redis;

pub use diana_core::quota::decide::{Enforcement, Spend, Spending, Spent};
pub use diana_core::quota::ledger::{CounterDigest, Grant, Noted, Part};
pub use diana_core::quota::{decide, Outcome};

pub use self::breakers::{BreakerCall, Decided, FleetBreakers, MemoryBreakers};
pub use self::memory::{Clock, MemoryStore, SystemClock, DEFAULT_MAX_KEYS};
pub use self::redis::{
    breaker_key, cluster_slot, redis_key, RedisOptions, RedisStore, RedisTarget, RedisUrlError,
    BREAKER_SWAP_ATTEMPTS,
};

use async_trait::async_trait;
use diana_core::algo::Mark;
use diana_core::wire::{ResolvedRule, RuleResult};
use std::fmt;

/// Why a store could not decide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The backend is unreachable, refused, or too slow (HTTP 503).
    Unavailable(String),
    /// The backend answered, but not as expected (HTTP 500).
    Internal(String),
    /// The store cannot evaluate this rule (HTTP 400), e.g. a debt for an algorithm
    /// without debts.
    Unsupported(String),
    /// The store holds as many counters as it may and none is idle: a request that needs a
    /// new counter is refused (HTTP 503) rather than growing past the cap.
    Full(String),
}

impl StoreError {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Internal(_) => "internal",
            StoreError::Unsupported(_) => "unsupported",
            StoreError::Full(_) => "full",
        }
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Unavailable(reason) => write!(f, "store unavailable: {reason}"),
            StoreError::Internal(reason) => write!(f, "store error: {reason}"),
            StoreError::Unsupported(reason) => f.write_str(reason),
            StoreError::Full(reason) => write!(f, "store full: {reason}"),
        }
    }
}

impl std::error::Error for StoreError {}

/// Refuses a charge on a rule whose algorithm takes no debts (the leaky bucket paces
/// requests; it cannot be charged after the fact).
pub fn refuse_debtless(rules: &[ResolvedRule<'_>]) -> Result<(), StoreError> {
    diana_core::quota::table::debtless(rules, None)
        .map_err(|refused| StoreError::Unsupported(refused.to_string()))
}

/// How full a store with a bounded table is (the memory store).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Counters held now.
    pub keys: u64,
    /// The most it may hold.
    pub capacity: u64,
    /// Idle counters evicted since the start.
    pub evicted: u64,
}

/// A place where counters live.
#[async_trait]
pub trait Store: Send + Sync {
    /// Decides every rule of one request, all or nothing, and returns one outcome per rule
    /// in order: all charged (`granted ≥ cost` each), or none (`granted` 0 for all; the
    /// rules that had their cost available say `allowed`). A leaky-bucket rule whose turn
    /// is further away than its `max_delay` is denied.
    async fn check_and_update(
        &self,
        rules: &[ResolvedRule<'_>],
    ) -> Result<Vec<Outcome>, StoreError>;

    /// Charges every rule `want` tokens whatever is left (response costs: the counters may
    /// go past their limits). Every rule's algorithm must allow debts.
    async fn charge(&self, rules: &[ResolvedRule<'_>]) -> Result<Vec<RuleResult>, StoreError>;

    /// Gives back the grants of `outcomes` (an earlier [`Store::check_and_update`] of the
    /// same rules whose answer nobody will use), exactly as the algorithms' `release`.
    async fn release(
        &self,
        rules: &[ResolvedRule<'_>],
        outcomes: &[Outcome],
    ) -> Result<(), StoreError>;

    /// Renews concurrency places (every rule an `IF` limit; `want` places each) counted at
    /// `places`, the buckets their acquire or last renewal answered: they move to the
    /// current bucket, whose mark each outcome carries.
    async fn renew(
        &self,
        rules: &[ResolvedRule<'_>],
        places: &[Mark],
    ) -> Result<Vec<Outcome>, StoreError>;

    /// Decides one call of Envoy's rate limit protocol (RLS): each rule a take (all or
    /// nothing), a check or a count, as `how` says ([`decide::spend`]: the counts are
    /// charged whatever the answer, the takes only when the call is admitted). A count
    /// on an algorithm without debts is refused, nothing charged.
    async fn spend(
        &self,
        rules: &[ResolvedRule<'_>],
        how: &[Spending],
    ) -> Result<Spent, StoreError>;

    /// Notes what the acquire of `call` granted, so that a release can give it back
    /// (`diana_core::quota::ledger`); [`Noted::AlreadyReleased`] when the release came
    /// first: the caller gives the grant back.
    async fn note_call(&self, call: &str, grants: &[Grant]) -> Result<Noted, StoreError>;

    /// Takes what the acquire of `call` granted (at most once), or notes the release for
    /// an acquire still to come.
    async fn take_call(&self, call: &str) -> Result<Option<Vec<Grant>>, StoreError>;

    /// Takes up to `tokens` of what the acquire of `call` granted its rule at `rule`, if
    /// `counter` is that rule's counter ([`Part`]); the rest stays for a later release.
    /// Never notes anything for an acquire still to come. A store that keeps no ledger
    /// finds nothing (the gateway then keeps the tokens in its own lease stash).
    async fn take_part(
        &self,
        call: &str,
        rule: usize,
        tokens: u32,
        counter: CounterDigest,
    ) -> Result<Part, StoreError> {
        let _ = (call, rule, tokens, counter);
        Ok(Part::Nothing)
    }

    /// Whether the store can serve requests right now.
    async fn health(&self) -> Result<(), StoreError>;

    /// A human-readable description for logs (no credentials).
    fn describe(&self) -> String;

    /// How full the store is, for stores with a bounded table.
    fn usage(&self) -> Option<Usage> {
        None
    }

    /// The fleet's breakers this store keeps (`POST /v1/report`); `None`: it keeps none,
    /// and a report with a fleet breaker is answered 503.
    fn breakers(&self) -> Option<&dyn FleetBreakers> {
        None
    }
}
