//! The counts of a simulation: per second and in total, per rule and for all requests.
//!
//! Per rule, as the filter's metrics count (`diana_rule_allowed`, `_limited`,
//! `_dry_run_limited`): a rule *admitted* or *delayed* a request it let through (delayed:
//! the request was held for a leaky-bucket turn), *rejected* the request it stopped, and
//! *dry-run* counts the requests it would have stopped. A rule that let a request through
//! which a later rule stopped counts nothing (nothing stays charged).
//!
//! For all requests: each is admitted, delayed, rejected or fast-failed (an open circuit
//! breaker answered it before any rule); dry-run counts those a dry-run rule would have
//! stopped; fallback those an open breaker sent on marked with its `fallback_header`
//! (admitted or delayed too); unmatched those no rule applied to.

use diana_core::metrics::RuleEvent;
use diana_core::time::Nanos;
use std::collections::BTreeMap;

/// What became of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Admitted,
    /// Admitted after this wait.
    Delayed(Nanos),
    Rejected,
    /// Answered by an open (or half-open and full) circuit breaker, before any rule: not
    /// a rejection by a rule.
    FastFailed,
}

/// Counts of one rule (or of all requests) over some time.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub admitted: u64,
    pub delayed: u64,
    pub rejected: u64,
    pub dry_run: u64,
    /// Answered by an open breaker (all requests only: no rule saw them).
    pub fast_failed: u64,
    /// Sent on by an open breaker with its `fallback_header` (all requests only; counted
    /// as admitted or delayed too).
    pub fallback: u64,
    /// Sum and longest of the delays of the delayed requests.
    pub delay_sum: u128,
    pub delay_max: Nanos,
}

impl Counts {
    pub fn is_empty(&self) -> bool {
        self.admitted == 0
            && self.delayed == 0
            && self.rejected == 0
            && self.dry_run == 0
            && self.fast_failed == 0
    }

    fn pass(&mut self, fate: Fate) {
        match fate {
            Fate::Delayed(delay) => {
                self.delayed += 1;
                self.delay_sum += u128::from(delay.get());
                self.delay_max = self.delay_max.max(delay);
            }
            Fate::Admitted => self.admitted += 1,
            // A rule's charge on a rejected request is given back, and no rule saw a
            // fast-failed one: nothing to count.
            Fate::Rejected | Fate::FastFailed => {}
        }
    }

    pub fn add(&mut self, other: &Counts) {
        self.admitted += other.admitted;
        self.delayed += other.delayed;
        self.rejected += other.rejected;
        self.dry_run += other.dry_run;
        self.fast_failed += other.fast_failed;
        self.fallback += other.fallback;
        self.delay_sum += other.delay_sum;
        self.delay_max = self.delay_max.max(other.delay_max);
    }

    /// Mean delay of the delayed requests, nanoseconds.
    pub fn delay_mean(&self) -> Nanos {
        if self.delayed == 0 {
            Nanos::ZERO
        } else {
            u64::try_from(self.delay_sum / u128::from(self.delayed)).map_or(Nanos::MAX, Nanos::new)
        }
    }
}

/// Counts over one stretch of time: all requests, and each rule (in rule index order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bin {
    pub all: Counts,
    pub rules: Vec<Counts>,
}

impl Bin {
    fn new(rules: usize) -> Bin {
        Bin {
            all: Counts::default(),
            rules: vec![Counts::default(); rules],
        }
    }

    pub fn add(&mut self, other: &Bin) {
        self.all.add(&other.all);
        for (mine, theirs) in self.rules.iter_mut().zip(&other.rules) {
            mine.add(theirs);
        }
    }

    fn record(&mut self, fate: Fate, fallback: bool, events: &[(usize, RuleEvent)]) {
        match fate {
            Fate::Rejected => self.all.rejected += 1,
            Fate::FastFailed => self.all.fast_failed += 1,
            passed => self.all.pass(passed),
        }
        if fallback && matches!(fate, Fate::Admitted | Fate::Delayed(_)) {
            self.all.fallback += 1;
        }
        if events
            .iter()
            .any(|&(_, event)| event == RuleEvent::DryRunLimited)
        {
            self.all.dry_run += 1;
        }
        for &(index, event) in events {
            let Some(rule) = self.rules.get_mut(index) else {
                continue;
            };
            match event {
                RuleEvent::Allowed => rule.pass(fate),
                RuleEvent::Limited => rule.rejected += 1,
                RuleEvent::DryRunLimited => rule.dry_run += 1,
            }
        }
    }
}

/// Every count of a simulation.
#[derive(Debug, Clone)]
pub struct Tally {
    rules: usize,
    /// Keyed by second since the epoch.
    pub seconds: BTreeMap<u64, Bin>,
    pub total: Bin,
    /// Requests no rule applied to (admitted).
    pub unmatched: u64,
}

impl Tally {
    pub fn new(rules: usize) -> Tally {
        Tally {
            rules,
            seconds: BTreeMap::new(),
            total: Bin::new(rules),
            unmatched: 0,
        }
    }

    /// Counts a request of `second` with its fate, whether an open breaker sent it to its
    /// fallback, and the engine's rule events.
    pub fn record(
        &mut self,
        second: u64,
        fate: Fate,
        fallback: bool,
        events: &[(usize, RuleEvent)],
    ) {
        let rules = self.rules;
        self.seconds
            .entry(second)
            .or_insert_with(|| Bin::new(rules))
            .record(fate, fallback, events);
        self.total.record(fate, fallback, events);
        // A fast-failed request never reached the rules: not "matched no rule".
        if events.is_empty() && fate != Fate::FastFailed {
            self.unmatched += 1;
        }
    }

    /// The counts in stretches of `interval` seconds (aligned to the epoch), in order.
    pub fn bins(&self, interval: u64) -> Vec<(u64, Bin)> {
        let interval = interval.max(1);
        let mut bins: Vec<(u64, Bin)> = Vec::new();
        for (&second, bin) in &self.seconds {
            let start = second - second % interval;
            match bins.last_mut() {
                Some((last, merged)) if *last == start => merged.add(bin),
                _ => bins.push((start, bin.clone())),
            }
        }
        bins
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_count_as_the_filter_metrics_do() {
        let mut tally = Tally::new(3);
        tally.record(10, Fate::Admitted, false, &[(0, RuleEvent::Allowed)]);
        tally.record(
            10,
            Fate::Delayed(Nanos::new(200)),
            false,
            &[(0, RuleEvent::Allowed), (2, RuleEvent::Allowed)],
        );
        tally.record(
            11,
            Fate::Rejected,
            false,
            &[(1, RuleEvent::DryRunLimited), (2, RuleEvent::Limited)],
        );
        tally.record(12, Fate::Admitted, false, &[]);
        let total = &tally.total;
        assert_eq!(
            (
                total.all.admitted,
                total.all.delayed,
                total.all.rejected,
                total.all.dry_run
            ),
            (2, 1, 1, 1)
        );
        assert_eq!((total.rules[0].admitted, total.rules[0].delayed), (1, 1));
        assert_eq!(total.rules[1].dry_run, 1);
        assert_eq!((total.rules[2].delayed, total.rules[2].rejected), (1, 1));
        assert_eq!(total.rules[2].delay_mean(), Nanos::new(200));
        assert_eq!(tally.unmatched, 1);
        let bins = tally.bins(2);
        assert_eq!(bins.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [10, 12]);
        assert_eq!(bins[0].1.all.rejected, 1);
        assert_eq!((bins[0].1.all.admitted, bins[0].1.all.delayed), (1, 1));
    }

    #[test]
    fn fast_failed_requests_are_neither_rejected_nor_unmatched() {
        let mut tally = Tally::new(1);
        tally.record(5, Fate::FastFailed, false, &[]);
        tally.record(5, Fate::FastFailed, false, &[]);
        tally.record(6, Fate::Admitted, true, &[(0, RuleEvent::Allowed)]);
        // A request sent to the fallback that a rule then stopped is a rejection only.
        tally.record(6, Fate::Rejected, true, &[(0, RuleEvent::Limited)]);
        let all = &tally.total.all;
        assert_eq!(
            (all.admitted, all.rejected, all.fast_failed, all.fallback),
            (1, 1, 2, 1)
        );
        assert_eq!(tally.unmatched, 0);
        assert_eq!(tally.seconds[&5].all.fast_failed, 2);
        assert!(!tally.seconds[&5].all.is_empty());
        assert_eq!(tally.total.rules[0].admitted, 1);
    }
}
