//! A request's breaker calls, kept by its binding instead of its worker.
//!
//! An admitted request whose only business with its response is judging its breakers'
//! calls (DESIGN §4b: no response costs, no concurrency places, no headers to add, no
//! probe) is, on a host that asks for it ([`HostProfile::keeps_breaker_calls`]), handed to
//! its binding as a value, [`Step::watch`], and the worker keeps nothing for it
//! ([`Worker::tracks`] is false). At the request's response headers the binding reads
//! the response's status as its host tells it ([`Host::response_status`]) and asks
//! [`Watch::count_alone`]: a good call of a closed breaker is counted in the breaker's tap
//! ([`crate::breaker::tap`]) without the worker; anything else (a slow or failed call, or
//! a breaker whose pending calls a good one must flush) comes back as the same value,
//! which the binding hands to [`Worker::on_watch_answered`]. A request
//! that ends without response headers (a reset, an upstream timeout, its client gone)
//! hands it to [`Worker::on_watch_unanswered`]: a failed call of each breaker.
//!
//! ```text
//!   request headers ──▶ Step::watch ──▶ the binding keeps it with the stream
//!   response headers ──▶ count_alone(status, clock) ─┬─ Ok: counted in the taps
//!                                                    └─ Err(watch) ─▶ on_watch_answered
//!   ended without them ──▶ on_watch_unanswered (failed calls)
//! ```
//!
//! A watch is not `Clone`: each call is judged once, by whoever holds its value. Dropped
//! unjudged (a binding's bug), its calls go uncounted and the breaker's handle keeps its
//! configuration until the tap is let go; nothing else is held for it.
//!
//! [`HostProfile::keeps_breaker_calls`]: super::HostProfile::keeps_breaker_calls
//! [`Host::response_status`]: super::Host::response_status
//! [`Step::watch`]: super::Step::watch
//! [`Worker::tracks`]: super::Worker::tracks
//! [`Worker::on_watch_answered`]: super::Worker::on_watch_answered
//! [`Worker::on_watch_unanswered`]: super::Worker::on_watch_unanswered

use super::ContextId;
use crate::breaker::answered_status;
use crate::decision::{AfterResponse, BreakerCall};
use crate::engine::TappedCalls;
use crate::time::{Instant, Nanos};
use std::fmt;
use std::sync::Arc;

/// One request's breaker calls, judged when its response headers come (see the module
/// docs).
pub struct Watch {
    pub(super) context: ContextId,
    pub(super) generation: u64,
    /// When the request left Diana: its calls' start.
    pub(super) left_at: Instant,
    /// Each call's breaker and its tap, in the order the worker judges them.
    pub(super) calls: TappedCalls,
}

impl Watch {
    /// The request whose calls these are.
    pub fn context(&self) -> ContextId {
        self.context
    }

    /// Whether judging the calls reads the clock (a breaker with `slow_ms`).
    pub fn times_calls(&self) -> bool {
        self.calls.iter().any(|(_, tap)| tap.judge().times_calls())
    }

    /// The response headers came with `status` ([`super::Host::response_status`]; one that
    /// cannot be read is judged by [`answered_status`], as the worker does). When every call is good and
    /// each breaker's tap takes it, they are counted there: `Ok`, and the request is done
    /// with. Otherwise nothing is counted and the watch comes back for
    /// [`super::Worker::on_watch_answered`]. `now` is asked only when a breaker judges
    /// slow calls; a clock that cannot be read sends the watch back too.
    pub fn count_alone(
        self,
        status: Option<u16>,
        now: impl FnOnce() -> Option<Instant>,
    ) -> Result<(), Watch> {
        let status = answered_status(status);
        let took = if self.times_calls() {
            match now() {
                Some(now) => now.saturating_since(self.left_at),
                None => return Err(self),
            }
        } else {
            Nanos::ZERO
        };
        let all_taken = self
            .calls
            .iter()
            .all(|(_, tap)| tap.takes(tap.judge().judge(took, status)));
        if !all_taken {
            return Err(self);
        }
        for (_, tap) in &self.calls {
            tap.count_good();
        }
        Ok(())
    }

    /// The calls as the worker judges those of a request it keeps.
    pub(super) fn after(&self) -> AfterResponse {
        AfterResponse {
            breakers: self
                .calls
                .iter()
                .map(|&(breaker, _)| BreakerCall {
                    breaker,
                    probe: None,
                })
                .collect(),
            left_at: self.left_at,
            ..AfterResponse::default()
        }
    }
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch")
            .field("context", &self.context)
            .field("generation", &self.generation)
            .field(
                "breakers",
                &self.calls.iter().map(|(b, _)| b).collect::<Vec<_>>(),
            )
            .field("left_at", &self.left_at)
            .finish()
    }
}

/// Two watches are the same when they are of the same request and calls, and count in
/// the same taps.
impl PartialEq for Watch {
    fn eq(&self, other: &Watch) -> bool {
        self.context == other.context
            && self.generation == other.generation
            && self.left_at == other.left_at
            && self.calls.len() == other.calls.len()
            && self
                .calls
                .iter()
                .zip(&other.calls)
                .all(|((a, tap_a), (b, tap_b))| a == b && Arc::ptr_eq(tap_a, tap_b))
    }
}

impl Eq for Watch {}
