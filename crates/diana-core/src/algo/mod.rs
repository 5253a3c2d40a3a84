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
pub mod inflight;
mod leaky;
mod sliding;
mod token;
mod window;

pub use inflight::InFlight;
pub use leaky::LeakyBucket;
pub use sliding::SlidingWindow;
pub use token::TokenBucket;
pub use window::FixedWindow;

use crate::calendar::{Calendar, CalendarUnit};
use crate::time::{Instant, Nanos, Unit};
use std::fmt;
use std::num::NonZeroU32;

/// The parameters of one rule, with every default already resolved.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Limit {
    /// Requests per unit (per calendar period with [`Limit::calendar`]).
    pub rpu: NonZeroU32,
    /// The period of a fixed unit. With [`Limit::calendar`] it is [`Unit::Day`], the
    /// longest fixed unit, and no algorithm reads it as the period: the calendar is.
    pub unit: Unit,
    /// Token-bucket capacity; leaky-bucket queue length. Resolved by
    /// [`Algorithm::default_burst`] when the document does not set it.
    pub burst: NonZeroU32,
    /// Sliding-window slices per unit.
    pub slices: NonZeroU32,
    /// `unit: week | month` (W and TB only): the periods of a calendar in a time zone, whose
    /// length varies (a month of 28 to 31 days, a week of a change of the clocks). A fixed
    /// window is then the period; a token bucket refills `rpu` evenly over each period.
    pub calendar: Option<Calendar>,
    /// `unit: week | month` decided by the quota service (global scope): the one period
    /// the gateway found in the rule's zone at its instant ([`GivenPeriod`]). The service
    /// knows no zones: it counts in this period (W) or refills `rpu` per its length (TB).
    /// Never set with [`Limit::calendar`].
    pub period: Option<GivenPeriod>,
}

/// A calendar period as a gateway names it to the quota service: its unit, its first
/// instant and its length (from [`crate::calendar`], in the rule's zone). The periods
/// around it are taken to be as long (the service has no zone to find them by).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GivenPeriod {
    pub unit: CalendarUnit,
    pub start: Instant,
    pub length: Nanos,
}

impl GivenPeriod {
    /// The instant the period ends.
    pub fn end(&self) -> Instant {
        self.start.saturating_add(self.length)
    }

    /// The period as a counter is bound to it: a fixed window counts in this period
    /// only, so its start and length; a bucket carries on from one period to the next
    /// (only its rate follows the length), so its unit alone.
    pub fn bound(&self, algo: &str) -> GivenPeriod {
        if algo == "W" {
            *self
        } else {
            GivenPeriod {
                unit: self.unit,
                start: Instant::from_unix_nanos(0),
                length: Nanos::ZERO,
            }
        }
    }
}

impl Limit {
    /// The unit as the document writes it: `week` or `month` for a calendar, else the
    /// fixed unit's name.
    pub fn unit_name(&self) -> &'static str {
        match (&self.calendar, &self.period) {
            (Some(calendar), _) => calendar.unit().name(),
            (None, Some(period)) => period.unit.name(),
            (None, None) => self.unit.name(),
        }
    }

    /// The length of the limit's unit in whole seconds (rounded up): a given period's
    /// length, else the fixed unit's. A calendar limit has no one length (its months
    /// differ): ask [`Limit::at`] an instant first; alone it says a day, its `unit`.
    pub fn unit_seconds(&self) -> u64 {
        match self.period {
            Some(period) => period.length.get().div_ceil(1_000_000_000),
            None => self.unit.seconds(),
        }
    }

    /// The limit as a quota service counts it at `now`, which knows no zones: a calendar
    /// limit becomes the period of its zone that contains `now` ([`Limit::period`], as a
    /// gateway names it on the wire); any other limit is unchanged.
    pub fn at(&self, now: Instant) -> Limit {
        let Some(calendar) = &self.calendar else {
            return self.clone();
        };
        let period = calendar.period(now);
        Limit {
            calendar: None,
            period: Some(GivenPeriod {
                unit: calendar.unit(),
                start: period.start,
                length: period.length(),
            }),
            ..self.clone()
        }
    }
}

/// The outcome of asking an algorithm for tokens (a request takes its cost, one by default;
/// a lease asks for more).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Verdict {
    /// Tokens granted: zero (denied, nothing changed) or between what was needed and what
    /// was wanted.
    pub granted: u32,
    /// Tokens that would still be granted right now after this decision.
    pub remaining: u64,
    /// Duration until the limit has fully recovered (window end, bucket full, queue empty).
    pub reset: Nanos,
    /// When denied: duration until what was needed could be granted. Zero when admitted.
    pub retry_after: Nanos,
    /// Leaky bucket only: how long this admitted request must wait before it leaves.
    pub delay: Nanos,
    /// Where the granted tokens were counted, for [`Algorithm::release`].
    pub mark: Mark,
}

impl Verdict {
    pub fn allowed(&self) -> bool {
        self.granted > 0
    }
}

/// Where an algorithm counted a grant (the window, the slice, the departure slot), so that
/// the grant can be given back exactly when another rule of the same request denies it.
/// Opaque outside the algorithm that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Mark(pub u128);

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

    /// The most tokens one decision can ever grant on an idle counter: a request whose cost
    /// is above it could never pass (the configuration refuses such a cost).
    fn capacity(&self, limit: &Limit) -> u64;

    /// True when an admitted request may have to wait for its turn ([`Verdict::delay`]):
    /// the host must be able to hold it (or the quota service waits for it).
    fn waits(&self) -> bool {
        false
    }

    /// Until when a worker may spend tokens it took in one batch at `now` (counted at
    /// `mark`) without breaking the algorithm's definition: the end of the window (W), of
    /// the slice (SW), a short span (TB). `now` itself: no batches (LB, whose every turn
    /// has its own instant). See [`crate::local`].
    fn lease_until(&self, limit: &Limit, mark: Mark, now: Instant) -> Instant {
        let _ = (limit, mark);
        now
    }

    /// True when a worker may take a batch of tokens ahead of its requests, and remember
    /// a denial for a moment (see [`crate::local`]).
    fn lends(&self) -> bool {
        !self.waits()
    }

    /// True when what a request takes is held until the request ends, and then given back
    /// (a concurrency limit's place, [`InFlight`]).
    fn holds_until_done(&self) -> bool {
        false
    }

    /// True when the state means something only under the limit it was written with (a
    /// window's count, a bucket's level): a counter is then bound to its parameters, and a
    /// rule whose limit changes starts a new one. False for a concurrency limit: its state
    /// is the places held, whatever N, and an edit of N must keep counting them.
    fn state_follows_limit(&self) -> bool {
        true
    }

    /// True when tokens may be charged past the limit ([`Algorithm::charge_debt`]), as a
    /// response cost known only after the upstream answered.
    fn allows_debt(&self) -> bool {
        true
    }

    /// Decides on a request that needs `need` tokens and would take up to `want`
    /// (`need ≤ want`; a lease wants more than it needs). Grants `min(want, available)` if
    /// at least `need` are available, else nothing; the state changes only for what was
    /// granted. `want = 0` is a read-only probe. `state.len()` is
    /// [`Algorithm::state_words`]; a shorter or garbled state is treated as fresh, never a panic.
    fn acquire_at_least(
        &self,
        limit: &Limit,
        state: &mut [u64],
        now: Instant,
        need: u32,
        want: u32,
    ) -> Verdict;

    /// [`Algorithm::acquire_at_least`] with a need of one token: as many as are available,
    /// up to `want`.
    fn acquire(&self, limit: &Limit, state: &mut [u64], now: Instant, want: u32) -> Verdict {
        self.acquire_at_least(limit, state, now, want.min(1), want)
    }

    /// Gives back `tokens` of a grant counted at `mark` (a request that another rule
    /// denied consumes nothing). Tokens whose window or slice has passed are gone already;
    /// a bucket is never filled beyond its capacity.
    fn release(&self, limit: &Limit, state: &mut [u64], now: Instant, tokens: u32, mark: Mark);

    /// Charges `tokens` whatever is left (a response cost): the counter may go past its
    /// limit, and later requests are denied until the debt is paid back. Only called when
    /// [`Algorithm::allows_debt`]; returns the state after the charge as a zero-grant verdict.
    fn charge_debt(&self, limit: &Limit, state: &mut [u64], now: Instant, tokens: u32) -> Verdict;

    /// True when the state carries no memory any more (as if fresh): the slot may be
    /// given to another identity without changing anyone's limit.
    fn is_idle(&self, limit: &Limit, state: &[u64], now: Instant) -> bool;
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

/// Finds an algorithm by a code or spelling of the quota service's wire format: every
/// algorithm of [`lookup`], and concurrency (`IF`), which the configuration writes as
/// `max_in_flight` instead.
pub fn lookup_wire(name: &str) -> Option<&'static dyn Algorithm> {
    lookup(name).or_else(|| {
        let concurrency: &'static dyn Algorithm = &InFlight;
        name.trim()
            .eq_ignore_ascii_case(concurrency.code())
            .then_some(concurrency)
    })
}

/// Every accepted spelling, for error messages.
pub fn known_names() -> Vec<&'static str> {
    REGISTRY
        .iter()
        .flat_map(|algo| std::iter::once(algo.code()).chain(algo.aliases().iter().copied()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::common::testing::limit;
    use super::*;
    use crate::time::NANOS_PER_SECOND as S;

    /// Every registered algorithm with a limit of 10 per second (burst 10).
    fn each() -> impl Iterator<Item = (&'static dyn Algorithm, Limit)> {
        REGISTRY
            .iter()
            .map(|&algo| (algo, limit(algo, 10, Unit::Second, Some(10), 5)))
    }

    fn probe(algo: &dyn Algorithm, limit: &Limit, state: &[u64], now: Instant) -> u64 {
        let mut copy = state.to_vec();
        algo.acquire(limit, &mut copy, now, 0).remaining
    }

    #[test]
    fn a_need_above_what_is_left_takes_nothing() {
        let t0 = Instant::EPOCH + 1_000 * S;
        for (algo, limit) in each() {
            let mut state = vec![0; algo.state_words(&limit)];
            let capacity = algo.capacity(&limit);
            let taken = algo.acquire(&limit, &mut state, t0, u32::MAX).granted;
            assert_eq!(u64::from(taken), capacity, "{}", algo.code());
            assert_eq!(algo.acquire(&limit, &mut state, t0, 0).remaining, 0);
            // Nine taken of ten: a need of five is denied, and nothing changes.
            let mut fresh = vec![0; algo.state_words(&limit)];
            let first = algo.acquire(&limit, &mut fresh, t0, 9);
            assert_eq!(first.granted, 9.min(capacity as u32));
            let before = fresh.clone();
            let verdict = algo.acquire_at_least(&limit, &mut fresh, t0, 5, 5);
            assert_eq!(verdict.granted, 0, "{}", algo.code());
            assert!(!verdict.retry_after.is_zero(), "{}", algo.code());
            assert_eq!(fresh, before, "{}: a denial changed the state", algo.code());
            // What is left (one, or two for the leaky bucket's extra turn) is granted to
            // a need it covers, up to the want.
            let left = capacity - 9;
            let verdict = algo.acquire_at_least(&limit, &mut fresh, t0, 1, 5);
            assert_eq!(u64::from(verdict.granted), left, "{}", algo.code());
        }
    }

    #[test]
    fn a_release_gives_back_exactly_what_was_taken() {
        let t0 = Instant::EPOCH + 1_000 * S + S / 3;
        for (algo, limit) in each() {
            let mut state = vec![0; algo.state_words(&limit)];
            let _ = algo.acquire(&limit, &mut state, t0, 4);
            let before = probe(algo, &limit, &state, t0);
            let verdict = algo.acquire_at_least(&limit, &mut state, t0, 3, 3);
            assert_eq!(verdict.granted, 3, "{}", algo.code());
            assert_eq!(probe(algo, &limit, &state, t0), before - 3);
            algo.release(&limit, &mut state, t0, 3, verdict.mark);
            assert_eq!(
                probe(algo, &limit, &state, t0),
                before,
                "{}: the release did not give the tokens back",
                algo.code()
            );
            // A release never creates tokens that were not taken.
            let mut fresh = vec![0; algo.state_words(&limit)];
            algo.release(&limit, &mut fresh, t0, 5, Mark::default());
            assert_eq!(probe(algo, &limit, &fresh, t0), algo.capacity(&limit));
        }
    }

    #[test]
    fn debts_deny_until_paid_back() {
        let t0 = Instant::EPOCH + 1_000 * S;
        for (algo, limit) in each().filter(|(algo, _)| algo.allows_debt()) {
            let mut state = vec![0; algo.state_words(&limit)];
            let after = algo.charge_debt(&limit, &mut state, t0, 15);
            assert_eq!(after.remaining, 0, "{}", algo.code());
            assert!(!after.retry_after.is_zero(), "{}", algo.code());
            let verdict = algo.acquire(&limit, &mut state, t0, 1);
            assert_eq!(verdict.granted, 0, "{}", algo.code());
            // Still owing half a unit later (the windows, the bucket's refill).
            let verdict = algo.acquire(&limit, &mut state, t0 + S / 5, 1);
            assert_eq!(verdict.granted, 0, "{}", algo.code());
            // Paid back after two units at most.
            let verdict = algo.acquire(&limit, &mut state, t0 + 2 * S, 1);
            assert_eq!(verdict.granted, 1, "{}", algo.code());
        }
        assert!(!LeakyBucket.allows_debt());
    }

    #[test]
    fn only_the_leaky_bucket_waits() {
        let waiting: Vec<&str> = REGISTRY
            .iter()
            .filter(|algo| algo.waits())
            .map(|algo| algo.code())
            .collect();
        assert_eq!(waiting, ["LB"]);
    }
}
