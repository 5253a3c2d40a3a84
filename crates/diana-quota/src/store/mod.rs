//! The storage seam: where counters live. One call decides every rule of one gateway
//! request; each rule is decided atomically on its own.
//!
//! - [`MemoryStore`]: in-process, reuses `diana_core::algo` (one replica only).
//! - [`RedisStore`]: Redis or Redis Cluster, one Lua script per algorithm.

mod memory;
mod redis;

pub use self::memory::{Clock, MemoryStore, SystemClock};
pub use self::redis::{RedisOptions, RedisStore, RedisTarget};

use async_trait::async_trait;
use diana_core::global::wire::{ResolvedRule, RuleResult};
use std::fmt;

/// Why a store could not decide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The backend is unreachable, refused, or too slow (HTTP 503).
    Unavailable(String),
    /// The backend answered, but not as expected (HTTP 500).
    Internal(String),
    /// The store cannot evaluate this rule (HTTP 400), e.g. an algorithm without a Lua script.
    Unsupported(String),
}

impl StoreError {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Internal(_) => "internal",
            StoreError::Unsupported(_) => "unsupported",
        }
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Unavailable(reason) => write!(f, "store unavailable: {reason}"),
            StoreError::Internal(reason) => write!(f, "store error: {reason}"),
            StoreError::Unsupported(reason) => f.write_str(reason),
        }
    }
}

impl std::error::Error for StoreError {}

/// A place where counters live.
#[async_trait]
pub trait Store: Send + Sync {
    /// Decides every rule (each atomically, independently of the others) and returns one
    /// result per rule, in order. Each rule is granted `min(want, available)` tokens; a
    /// denied rule changes nothing.
    async fn check_and_update(
        &self,
        rules: &[ResolvedRule<'_>],
    ) -> Result<Vec<RuleResult>, StoreError>;

    /// Whether the store can serve requests right now.
    async fn health(&self) -> Result<(), StoreError>;

    /// A human-readable description for logs (no credentials).
    fn describe(&self) -> String;
}
