//! The rate-limiting algorithms, as pure functions of (limit, state, now).
//!
//! An algorithm never reads a clock or a store: the caller loads the state words, passes
//! the current time, and stores the words back if the decision changed them. All-zero
//! state words mean "never used" for every algorithm, so a fresh slot needs no set-up.
//! Rejected requests never change the state (they are not counted).
//!
//! Adding an algorithm means adding a module and one line to [`REGISTRY`]; nothing else
//! matches on algorithm names.

mod common;
mod leaky;
mod sliding;
mod token;
mod window;

pub use leaky::LeakyBucket;
pub use sliding::SlidingWindow;
pub use token::TokenBucket;
pub use window::FixedWindow;

use crate::time::{Nanos, Unit};
use std::fmt;
use std::num::NonZeroU32;

/// The parameters of one rule, with every default already resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    /// Requests per unit.
    pub rpu: NonZeroU32,
    pub unit: Unit,
    /// Token-bucket capacity; leaky-bucket queue length. Resolved by
    /// [`Algorithm::default_burst`] when the document does not set it.
    pub burst: NonZeroU32,
    /// Sliding-window slices per unit.
    pub slices: NonZeroU32,
}

/// The outcome of asking an algorithm for `want` tokens (a request is one token; a lease
/// asks for several).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Verdict {
    /// Tokens granted, `0..=want`. Zero means the request is denied.
    pub granted: u32,
    /// Requests that would still be admitted right now after this decision.
    pub remaining: u64,
    /// Duration until the limit has fully recovered (window end, bucket full, queue empty).
    pub reset: Nanos,
    /// When denied: duration until one request would be admitted. Zero when admitted.
    pub retry_after: Nanos,
    /// Leaky bucket only: how long this admitted request must wait before it leaves.
    pub delay: Nanos,
}

impl Verdict {
    pub fn allowed(&self) -> bool {
        self.granted > 0
    }
}

/// One rate-limiting algorithm. Implementations are stateless singletons; all per-counter
/// state lives in the `state` words the caller passes in.
pub trait Algorithm: Send + Sync + fmt::Debug {
    /// The canonical short code (`"W"`, `"SW"`, `"LB"`, `"TB"`), used in keys and the wire format.
    fn code(&self) -> &'static str;

    /// Every spelling accepted in the configuration, lower case (e.g. `["tb", "token bucket"]`).
    fn aliases(&self) -> &'static [&'static str];

    /// `burst` when the rule does not set it.
    fn default_burst(&self, rpu: NonZeroU32, unit: Unit) -> NonZeroU32;

    /// Number of `u64` words of state for this limit (constant for a given limit).
    fn state_words(&self, limit: &Limit) -> usize;

    /// Decides on `want` tokens at `now`, granting as many as the limit allows, up to
    /// `want`, and updating `state` only for what was granted. `state.len()` is
    /// [`Algorithm::state_words`]; a shorter or garbled state is treated as fresh, never a panic.
    fn acquire(&self, limit: &Limit, state: &mut [u64], now: Nanos, want: u32) -> Verdict;

    /// True when the state carries no memory any more (as if fresh): the slot may be
    /// given to another identity without changing anyone's limit.
    fn is_idle(&self, limit: &Limit, state: &[u64], now: Nanos) -> bool;
}

/// Every algorithm Diana knows. Order matters only for documentation.
pub static REGISTRY: [&dyn Algorithm; 4] =
    [&FixedWindow, &SlidingWindow, &LeakyBucket, &TokenBucket];

/// The algorithm used when a rule does not say.
pub fn default_algorithm() -> &'static dyn Algorithm {
    &TokenBucket
}

/// Finds an algorithm by any of its spellings, case-insensitively (`TB`, `token bucket`, …).
pub fn lookup(name: &str) -> Option<&'static dyn Algorithm> {
    let wanted = name.trim().to_ascii_lowercase();
    REGISTRY.iter().copied().find(|algo| {
        algo.code().eq_ignore_ascii_case(&wanted) || algo.aliases().contains(&wanted.as_str())
    })
}

/// Every accepted spelling, for error messages.
pub fn known_names() -> Vec<&'static str> {
    REGISTRY
        .iter()
        .flat_map(|algo| std::iter::once(algo.code()).chain(algo.aliases().iter().copied()))
        .collect()
}
