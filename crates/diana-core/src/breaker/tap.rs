//! A closed breaker's good calls, counted where the request is instead of in its worker.
//!
//! Judging a call is most often a plain count: a closed breaker's good call only adds one
//! to the calls its worker merges into the record at the next tick ([`super::Handle`]).
//! A binding whose worker sits behind a lock that a stream's thread would otherwise take
//! once more at every response (Envoy's dynamic modules: the worker of a thread is
//! reached from the main thread too, for its tick) keeps a request's breaker calls itself
//! ([`crate::worker::Watch`], [`crate::worker::HostProfile::keeps_breaker_calls`]) and, at
//! its response headers, counts a good call in the breaker's tap here: an atomic load and
//! an atomic add, no lock, no table.
//!
//! ```text
//!   worker (under its lock)                 stream (its own thread, no lock)
//!   Handle ── owns ──▶ Arc<Tap> ◀── one clone per call ── Watch
//!     count / flush / learn ──▶ takes_good     judge(status, time) good ∧ takes_good
//!     flush, judge, report ◀── take_counted      ──▶ count_good
//!                                               otherwise: the Watch goes back to the
//!                                               worker, which judges it the full way
//! ```
//!
//! `takes_good` is what [`super::Handle::records_in_memory`] answers for a good call: the
//! record as last read does not judge calls, or no slow or failed call is pending (a good
//! call after a pending bad one is what flushes it early, so that one goes to the
//! worker). The worker sets it after every change of its pending calls or its view of the
//! record. A stream that reads it just before the tick flushes only counts a good call a
//! flush later than it might have: the flag is advice on when the worker must see a call,
//! and every count in the tap reaches the handle at its next flush, judgement or report.
//! Nothing here is a secret or a client's value: a tap holds counts and the judging
//! settings of its breaker.

use super::settings::CallJudge;
use super::Outcome;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// One worker's tap on one breaker (see the module docs). Shared by the worker's
/// [`super::Handle`] and the requests in flight that keep a call of it.
#[derive(Debug)]
pub struct Tap {
    judge: CallJudge,
    /// Good calls counted here since the handle last took them (64 bits: one atomic add
    /// per call, which no traffic between two ticks can wrap).
    good: AtomicU64,
    /// A good call may be counted here ([`super::Handle::records_in_memory`] of a good
    /// call).
    takes_good: AtomicBool,
}

impl Tap {
    pub fn new(judge: CallJudge) -> Tap {
        Tap {
            judge,
            good: AtomicU64::new(0),
            takes_good: AtomicBool::new(true),
        }
    }

    /// How this breaker judges a call.
    pub fn judge(&self) -> &CallJudge {
        &self.judge
    }

    /// Whether a call with `outcome` may be counted here: a good one, while the worker
    /// says so.
    pub fn takes(&self, outcome: Outcome) -> bool {
        outcome.is_good() && self.takes_good.load(Ordering::Relaxed)
    }

    /// Counts one good call (after [`Tap::takes`] said it may).
    pub fn count_good(&self) {
        self.good.fetch_add(1, Ordering::Relaxed);
    }

    /// The worker's side: the good calls counted here since it last took them (at most
    /// `u32::MAX`, which a breaker's counts saturate at anyway).
    pub(crate) fn take_counted(&self) -> u32 {
        u32::try_from(self.good.swap(0, Ordering::Relaxed)).unwrap_or(u32::MAX)
    }

    /// The worker's side: whether a good call may be counted here from now on.
    pub(crate) fn set_takes_good(&self, takes: bool) {
        self.takes_good.store(takes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::StatusClasses;
    use crate::time::Nanos;

    fn tap(slow_ms: Option<u64>) -> Tap {
        Tap::new(CallJudge {
            slow_after: slow_ms.map(Nanos::from_millis),
            failure_status: StatusClasses::server_errors(),
        })
    }

    /// What a tap takes, by outcome and by the worker's word.
    #[test]
    fn a_tap_takes_only_good_calls_and_only_while_the_worker_says_so() {
        let slow = Outcome {
            slow: true,
            failed: false,
        };
        let failed = Outcome {
            slow: false,
            failed: true,
        };
        let table = [
            (true, Outcome::GOOD, true),
            (true, slow, false),
            (true, failed, false),
            (true, Outcome::LOST, false),
            (false, Outcome::GOOD, false),
            (false, slow, false),
        ];
        for (takes_good, outcome, taken) in table {
            let tap = tap(None);
            tap.set_takes_good(takes_good);
            assert_eq!(tap.takes(outcome), taken, "{takes_good} {outcome:?}");
        }
    }

    #[test]
    fn counted_calls_are_taken_once() {
        let tap = tap(Some(100));
        assert_eq!(tap.take_counted(), 0);
        for _ in 0..3 {
            tap.count_good();
        }
        assert_eq!(tap.take_counted(), 3);
        assert_eq!(tap.take_counted(), 0);
        tap.good.store(u64::from(u32::MAX), Ordering::Relaxed);
        tap.count_good();
        assert_eq!(tap.take_counted(), u32::MAX, "saturates, never wraps");
        assert_eq!(tap.take_counted(), 0);
    }

    #[test]
    fn the_judge_is_the_breakers() {
        let tap = tap(Some(100));
        assert!(tap.judge().times_calls());
        assert!(tap.judge().judge(Nanos::from_millis(101), Some(200)).slow);
        assert!(!tap.judge().judge(Nanos::from_millis(100), Some(200)).slow);
        assert!(tap.judge().judge(Nanos::ZERO, Some(503)).failed);
        assert!(tap.judge().judge(Nanos::ZERO, None).failed);
        assert!(!self::tap(None).judge().times_calls());
    }
}
