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
    /// Its transitions, listed or not.
    pub transitions: u64,
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
            transitions: 0,
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
                counts.transitions += 1;
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

#[cfg(test)]
mod tests {
    use super::super::{simulate, Format, Options, Simulation};
    use diana_core::config::parse_policy;
    use diana_core::time::Nanos;

    /// 2026-01-01T00:00:00Z.
    const T0: u64 = 1_767_225_600;

    /// JSON lines on /pay, one every `step_ms` from [`T0`]: `count` requests answered
    /// `status` (`None`: not said) after `duration_ms`, group after group.
    fn jsonl(step_ms: u64, groups: &[(usize, Option<u16>, u64)]) -> String {
        let mut out = String::new();
        let mut at = 0;
        for &(count, status, duration) in groups {
            for _ in 0..count {
                let status = status.map_or(String::new(), |s| format!(r#", "status": {s}"#));
                out.push_str(&format!(
                    r#"{{"ts": {}.{:03}, "path": "/pay"{status}, "duration_ms": {duration}}}"#,
                    T0 + at / 1_000,
                    at % 1_000
                ));
                out.push('\n');
                at += step_ms;
            }
        }
        out
    }

    /// Envoy's default format: `%RESPONSE_CODE%` and `%DURATION%` (ms) as given.
    fn envoy(lines: &[(&str, u16, u64)]) -> String {
        lines
            .iter()
            .map(|(time, code, duration)| {
                format!(
                    r#"[2026-01-01T00:00:{time}Z] "GET /pay HTTP/1.1" {code} - 0 2 {duration} 1 "-" "curl" "-" "api" "127.0.0.1:8080""#
                ) + "\n"
            })
            .collect()
    }

    fn run(breaker: &str, log: &str, gateways: usize) -> Simulation {
        let document = format!("resources:\n  - Url: /pay\n    breaker: {breaker}\n");
        let policy = parse_policy(&document).unwrap();
        let options = Options {
            format: Format::Auto,
            envoy_fields: Vec::new(),
            gateways,
            reorder: Nanos::from_secs(5),
        };
        simulate(&policy, &document, log.as_bytes(), &options).unwrap()
    }

    struct Case {
        name: &'static str,
        breaker: &'static str,
        log: String,
        /// (ms after the log's first request, from, to, the figures: calls, slow, failed)
        transitions: Vec<(u64, &'static str, &'static str, u32, u32, u32)>,
        /// The worker's counters: calls, slow, failed, fast-failed; calls with no answer.
        counters: (u64, u64, u64, u64, u64),
        /// The report's all-requests counts: admitted, fast-failed, sent to the fallback.
        fates: (u64, u64, u64),
        open_ms: u64,
        last: &'static str,
    }

    #[test]
    fn breakers_open_fail_fast_probe_and_close_as_the_log_answers() {
        let cases = [
            Case {
                name: "failures",
                breaker: "{failure_ratio: 0.4, min_calls: 20, open_seconds: 5, half_open_calls: 2}",
                // Every 100 ms, answered in 20 ms: 30 × 200, 25 × 503, 60 × 200.
                log: jsonl(
                    100,
                    &[
                        (30, Some(200), 20),
                        (25, Some(503), 20),
                        (60, Some(200), 20),
                    ],
                ),
                transitions: vec![
                    // f failures after 30 good calls reach 0.4 at f/(30 + f) ≥ 0.4: f = 20,
                    // the request sent at 4.9 s, answered at 4.92 s; 50 calls, 20 failed.
                    (4_920, "closed", "open", 50, 0, 20),
                    // Open until 9.92 s: the request of 10.0 s finds it over and probes ...
                    (10_000, "open", "half-open", 0, 0, 0),
                    // ... as does the one of 10.1 s, answered at 10.12 s: both good.
                    (10_120, "half-open", "closed", 2, 0, 0),
                ],
                // The 50 requests of 5.0 s to 9.9 s fail fast (five of them 503 in the
                // log): 115 − 50 calls, 20 failed.
                counters: (65, 0, 20, 50, 0),
                fates: (65, 50, 0),
                open_ms: 10_000 - 4_920,
                last: "closed",
            },
            Case {
                name: "slow",
                breaker: "{slow_ms: 100, slow_ratio: 0.5, min_calls: 4}",
                // Every 100 ms: 4 answered in 50 ms, 6 in 250 ms (slow), 2 more.
                log: jsonl(
                    100,
                    &[(4, Some(200), 50), (6, Some(200), 250), (2, Some(200), 50)],
                ),
                // Slow answers come at 650, 750, 850, 950 ms: the fourth makes 4 of 8.
                transitions: vec![(950, "closed", "open", 8, 4, 0)],
                // The answers of 1050 and 1150 ms (sent at 800 and 900) still count as
                // calls in the metrics (not in the window); 1.0 s and 1.1 s fail fast.
                counters: (10, 6, 0, 2, 0),
                fates: (10, 2, 0),
                // Open from 950 ms to the last answer, 1150 ms (open_seconds: 30).
                open_ms: 200,
                last: "open",
            },
            Case {
                name: "envoy",
                breaker: "{failure_ratio: 0.6, min_calls: 3}",
                // A 200, a 503, a 0 (no answer: a reset, failed), each lasting 10 ms.
                log: envoy(&[
                    ("01.000", 200, 10),
                    ("01.100", 503, 10),
                    ("01.200", 0, 10),
                    ("01.300", 200, 10),
                ]),
                // 2 of 3 failed ≥ 0.6 when the reset ends, at 1.21 s; 1.3 s fails fast.
                transitions: vec![(210, "closed", "open", 3, 0, 2)],
                counters: (3, 0, 2, 1, 1),
                fates: (3, 1, 0),
                open_ms: 300 - 210,
                last: "open",
            },
            Case {
                name: "force open",
                breaker: "{failure_ratio: 0.5, force: open}",
                log: jsonl(100, &[(5, Some(200), 10)]),
                // The switch shows as a transition at the first request: every request
                // fails fast.
                transitions: vec![(0, "closed", "open", 0, 0, 0)],
                counters: (0, 0, 0, 5, 0),
                fates: (0, 5, 0),
                open_ms: 400,
                last: "open",
            },
            Case {
                name: "fallback",
                breaker: "{failure_ratio: 1, min_calls: 2, fallback_header: x-backup}",
                log: jsonl(100, &[(2, Some(503), 10), (3, Some(200), 10)]),
                // Both failed at 110 ms; the next three go on, marked, not calls.
                transitions: vec![(110, "closed", "open", 2, 0, 2)],
                counters: (2, 0, 2, 3, 0),
                fates: (5, 0, 3),
                // Until the last (fallback) request's answer, at 410 ms.
                open_ms: 410 - 110,
                last: "open",
            },
        ];
        for case in cases {
            let simulation = run(case.breaker, &case.log, 1);
            let run = &simulation.breakers.runs[0];
            let start = simulation.input.first.unwrap();
            let transitions: Vec<_> = run
                .transitions
                .iter()
                .map(|t| {
                    let figures = t.transition.figures;
                    (
                        t.at.saturating_since(start).whole_millis(),
                        t.transition.from.name(),
                        t.transition.to.name(),
                        figures.calls,
                        figures.slow,
                        figures.failed,
                    )
                })
                .collect();
            assert_eq!(transitions, case.transitions, "{}", case.name);
            assert_eq!(run.transitions_total, case.transitions.len() as u64);
            let counts = run.gateways[0];
            assert_eq!(
                (
                    counts.calls,
                    counts.slow,
                    counts.failed,
                    counts.fast_failed,
                    counts.unanswered
                ),
                case.counters,
                "{}",
                case.name
            );
            let all = &simulation.tally.total.all;
            assert_eq!(
                (all.admitted, all.fast_failed, all.fallback),
                case.fates,
                "{}",
                case.name
            );
            assert_eq!(all.rejected, 0, "{}", case.name);
            assert_eq!(counts.open.whole_millis(), case.open_ms, "{}", case.name);
            assert_eq!(counts.last.name(), case.last, "{}", case.name);
        }
    }

    #[test]
    fn each_gateway_has_its_own_local_breaker() {
        // Requests alternate between two gateways: each sees 2 of the 4 failures.
        let log = jsonl(100, &[(4, Some(503), 10), (4, Some(200), 10)]);
        let simulation = run("{failure_ratio: 1, min_calls: 2}", &log, 2);
        let run = &simulation.breakers.runs[0];
        let opened: Vec<(usize, u64)> = run
            .transitions
            .iter()
            .map(|t| (t.gateway, t.at.unix_nanos() / 1_000_000 - T0 * 1_000))
            .collect();
        // Gateway 0's second call was sent at 200 ms, gateway 1's at 300 ms.
        assert_eq!(opened, [(0, 210), (1, 310)]);
        let fast: Vec<u64> = run.gateways.iter().map(|g| g.fast_failed).collect();
        assert_eq!(fast, [2, 2]);
        assert_eq!(simulation.tally.total.all.fast_failed, 4);
    }

    #[test]
    fn transitions_past_the_bound_are_counted_not_listed() {
        use super::{Breakers, MAX_TRANSITIONS};
        use diana_core::breaker::{Cause, Status, Tally, Transition};
        use diana_core::time::Instant;
        let document = "resources:\n  - Url: /pay\n    breaker: {failure_ratio: 1}\n";
        let policy = parse_policy(document).unwrap();
        let mut breakers = Breakers::new(&policy, 1);
        let extra = 5;
        // Open for 1 s, closed for 1 s, over and over.
        let handed: Vec<_> = (0..MAX_TRANSITIONS + extra)
            .map(|k| {
                let (from, to) = if k % 2 == 0 {
                    (Status::Closed, Status::Open)
                } else {
                    (Status::Open, Status::Closed)
                };
                let at = Instant::from_unix_nanos(T0 * 1_000_000_000 + k as u64 * 1_000_000_000);
                let cause = Cause::Forced(diana_core::breaker::Force::Auto);
                (
                    0,
                    at,
                    Transition {
                        from,
                        to,
                        cause,
                        figures: Tally::ZERO,
                    },
                )
            })
            .collect();
        breakers.transitions(0, handed);
        let end = Instant::from_unix_nanos((T0 + 2_000) * 1_000_000_000);
        breakers.finish(end, |_, _| 0);
        let run = &breakers.runs[0];
        assert_eq!(run.transitions.len(), MAX_TRANSITIONS);
        assert_eq!(run.transitions_total, (MAX_TRANSITIONS + extra) as u64);
        assert_eq!(
            run.gateways[0].transitions,
            (MAX_TRANSITIONS + extra) as u64
        );
        // 503 openings of 1 s each (the last, at 1004 s, still open until 2000 s).
        let openings = (MAX_TRANSITIONS + extra).div_ceil(2) as u64;
        let last_opened = (MAX_TRANSITIONS + extra - 1) as u64;
        assert_eq!(
            run.gateways[0].open.get(),
            ((openings - 1) + (2_000 - last_opened)) * 1_000_000_000
        );
        assert_eq!(run.gateways[0].last, Status::Open);
    }

    #[test]
    fn a_request_without_a_status_ends_unanswered() {
        // No status in the log: the request ends without response headers when the log
        // says it ended, which the breaker judges failed (as a reset).
        let log = jsonl(100, &[(3, None, 10)]);
        let simulation = run("{failure_ratio: 1, min_calls: 2}", &log, 1);
        let counts = simulation.breakers.runs[0].gateways[0];
        assert_eq!(
            (
                counts.calls,
                counts.failed,
                counts.unanswered,
                counts.fast_failed
            ),
            (2, 2, 2, 1)
        );
    }
}
