//! What the document's circuit breakers did during a replay, as the simulated gateways'
//! workers reported it: each transition as the worker handed it over (the value its log
//! line is rendered from, with the simulated instant), and each breaker's counters
//! (`diana_breaker_calls`, `_slow`, `_failed`, `_fast_failed`) read from the gateway's
//! metrics. Nothing here judges a call or decides a state: the breaker is the worker's.

use diana_core::breaker::{Status, Transition};
use diana_core::config::Policy;
use diana_core::metrics::{breaker_metric_name, BreakerEvent};
use diana_core::time::{Instant, Nanos};

/// Transitions listed per breaker (all are counted).
pub const MAX_TRANSITIONS: usize = 1_000;

/// One transition of one gateway's breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransitionAt {
    pub at: Instant,
    pub gateway: usize,
    pub transition: Transition,
}

/// A breaker's counts on one gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatewayCounts {
    /// Calls judged (the worker's `diana_breaker_calls`), slow and failed among them.
    pub calls: u64,
    pub slow: u64,
    pub failed: u64,
    /// Requests it failed fast (`diana_breaker_fast_failed`: answered, or sent to the
    /// fallback).
    pub fast_failed: u64,
    /// Calls whose log line said no status: they ended without response headers, which
    /// the breaker judges failed (a reset).
    pub unanswered: u64,
    /// Time spent open (from a transition to open to the next one out of it, or to the
    /// end of the replay).
    pub open: Nanos,
    /// Its state at the end of the replay.
    pub last: Status,
}

impl Default for GatewayCounts {
    fn default() -> GatewayCounts {
        GatewayCounts {
            calls: 0,
            slow: 0,
            failed: 0,
            fast_failed: 0,
            unanswered: 0,
            open: Nanos::ZERO,
            // Where every breaker starts.
            last: Status::Closed,
        }
    }
}

/// One breaker over the whole replay.
#[derive(Debug, Clone)]
pub struct BreakerRun {
    /// Its index among the policy's breakers.
    pub index: usize,
    pub name: String,
    /// Its metrics' names: calls, slow, failed, fast-failed.
    metrics: [String; 4],
    /// Per gateway.
    pub gateways: Vec<GatewayCounts>,
    /// The first [`MAX_TRANSITIONS`], in time order.
    pub transitions: Vec<TransitionAt>,
    /// Every transition, listed or not.
    pub transitions_total: u64,
    /// Per gateway: since when it has been open.
    open_since: Vec<Option<Instant>>,
    /// Open periods (start, end, gateway), the first [`MAX_TRANSITIONS`]; an end of
    /// `None` is still open at the end of the replay.
    pub open_periods: Vec<(Instant, Option<Instant>, usize)>,
}

/// Every breaker of the document, in index order.
#[derive(Debug, Clone, Default)]
pub struct Breakers {
    pub runs: Vec<BreakerRun>,
    /// Per gateway, per breaker: the fast-failed counter's value already accounted for.
    seen: Vec<Vec<u64>>,
    /// Per gateway, per breaker: the calls counter's value already accounted for.
    seen_calls: Vec<Vec<u64>>,
}

const METRIC_EVENTS: [BreakerEvent; 4] = [
    BreakerEvent::Calls,
    BreakerEvent::Slow,
    BreakerEvent::Failed,
    BreakerEvent::FastFailed,
];

impl Breakers {
    pub fn new(policy: &Policy, gateways: usize) -> Breakers {
        let mut runs: Vec<BreakerRun> = policy
            .breakers()
            .map(|spec| BreakerRun {
                index: spec.index,
                name: spec.settings.name.clone(),
                metrics: METRIC_EVENTS
                    .map(|event| breaker_metric_name(&spec.metric_name, event.family())),
                gateways: vec![GatewayCounts::default(); gateways],
                transitions: Vec::new(),
                transitions_total: 0,
                open_since: vec![None; gateways],
                open_periods: Vec::new(),
            })
            .collect();
        runs.sort_by_key(|run| run.index);
        let count = runs.len();
        Breakers {
            runs,
            seen: vec![vec![0; count]; gateways],
            seen_calls: vec![vec![0; count]; gateways],
        }
    }

    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    fn run(&mut self, breaker: usize) -> Option<&mut BreakerRun> {
        self.runs.iter_mut().find(|run| run.index == breaker)
    }

    /// The transitions a gateway's workers handed over.
    pub fn transitions(&mut self, gateway: usize, handed: Vec<(usize, Instant, Transition)>) {
        for (breaker, at, transition) in handed {
            let Some(run) = self.run(breaker) else {
                continue;
            };
            run.transitions_total += 1;
            if run.transitions.len() < MAX_TRANSITIONS {
                run.transitions.push(TransitionAt {
                    at,
                    gateway,
                    transition,
                });
            }
            let Some(since) = run.open_since.get_mut(gateway) else {
                continue;
            };
            match (
                transition.from == Status::Open,
                transition.to == Status::Open,
            ) {
                (false, true) => {
                    *since = Some(at);
                }
                (true, false) => {
                    if let Some(start) = since.take() {
                        if let Some(counts) = run.gateways.get_mut(gateway) {
                            counts.open = Nanos::new(
                                counts
                                    .open
                                    .get()
                                    .saturating_add(at.saturating_since(start).get()),
                            );
                        }
                        if run.open_periods.len() < MAX_TRANSITIONS {
                            run.open_periods.push((start, Some(at), gateway));
                        }
                    }
                }
                _ => {}
            }
            if let Some(counts) = run.gateways.get_mut(gateway) {
                counts.last = transition.to;
            }
        }
    }

    /// Whether a gateway's breakers failed this request fast: the fast-failed counters
    /// moved since the last look (`metric`: the gateway's metric by name, flushed).
    pub fn fast_failed(&mut self, gateway: usize, metric: impl Fn(&str) -> u64) -> bool {
        let Some(seen) = self.seen.get_mut(gateway) else {
            return false;
        };
        let mut moved = false;
        for (run, seen) in self.runs.iter().zip(seen.iter_mut()) {
            let value = metric(&run.metrics[3]);
            moved |= value > *seen;
            *seen = value;
        }
        moved
    }

    /// A request whose log line said no status ended: the calls the worker judged at its
    /// end are calls without an answer.
    pub fn ended_unanswered(&mut self, gateway: usize, metric: impl Fn(&str) -> u64) {
        self.calls_moved(gateway, &metric, true);
    }

    /// Any other answer or end: only the calls counter's position is kept.
    pub fn answered(&mut self, gateway: usize, metric: impl Fn(&str) -> u64) {
        self.calls_moved(gateway, &metric, false);
    }

    fn calls_moved(&mut self, gateway: usize, metric: &impl Fn(&str) -> u64, count: bool) {
        let Some(seen) = self.seen_calls.get_mut(gateway) else {
            return;
        };
        for (run, seen) in self.runs.iter_mut().zip(seen.iter_mut()) {
            let value = metric(&run.metrics[0]);
            if count {
                if let Some(counts) = run.gateways.get_mut(gateway) {
                    counts.unanswered += value.saturating_sub(*seen);
                }
            }
            *seen = value;
        }
    }

    /// At the end of the replay (`end`: the last instant replayed): each gateway's
    /// counters, and the openings still going closed at `end`.
    pub fn finish(&mut self, end: Instant, metric: impl Fn(usize, &str) -> u64) {
        for run in &mut self.runs {
            for (gateway, counts) in run.gateways.iter_mut().enumerate() {
                let [calls, slow, failed, fast_failed] = &run.metrics;
                counts.calls = metric(gateway, calls);
                counts.slow = metric(gateway, slow);
                counts.failed = metric(gateway, failed);
                counts.fast_failed = metric(gateway, fast_failed);
                if let Some(start) = run.open_since.get_mut(gateway).and_then(Option::take) {
                    counts.open = Nanos::new(
                        counts
                            .open
                            .get()
                            .saturating_add(end.saturating_since(start).get()),
                    );
                    if run.open_periods.len() < MAX_TRANSITIONS {
                        run.open_periods.push((start, None, gateway));
                    }
                }
            }
            run.transitions.sort_by_key(|t| (t.at, t.gateway));
            run.open_periods
                .sort_by_key(|&(start, _, gateway)| (start, gateway));
        }
    }
}
