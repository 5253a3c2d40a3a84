#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use super::*;
use diana_core::breaker::{Cause, FleetAnswer, ProbeTally};
use diana_core::hot::SpaceSaving;
use diana_core::report::RuleLine;
use proptest::prelude::*;

const T0_MS: u64 = 1_700_000_000_000;

fn at(ms: u64) -> Instant {
    Instant::from_unix_nanos((T0_MS + ms) * 1_000_000)
}

fn sketch(items: &[(&str, u64)], capacity: usize) -> Summary {
    let mut sketch = SpaceSaving::new(capacity);
    for (label, weight) in items {
        sketch.add(label.as_bytes(), *weight);
    }
    sketch.summary()
}

fn line(name: &str, admitted: u64, limited: u64, hot: Option<Summary>) -> RuleLine {
    RuleLine {
        name: name.into(),
        admitted,
        limited,
        dry_run_limited: 1,
        hot_limited: hot,
        hot_admitted: None,
    }
}

fn params() -> FleetParams {
    FleetParams {
        slow_ratio_ppm: 500_000,
        failure_ratio_ppm: 0,
        min_calls: 20,
        window_seconds: 10,
        open_ms: 30_000,
        half_open_calls: 3,
        probe_timeout_ms: 2_000,
    }
}

fn breaker(name: &str, status: Status, fleet: bool) -> BreakerReport {
    BreakerReport {
        key: format!("{name}-key"),
        name: name.into(),
        fleet,
        params: params(),
        status,
        calls: Tally::ZERO,
        probes: ProbeTally::default(),
        places: None,
    }
}

fn report(gateway: &str, rules: Vec<RuleLine>, breakers: Vec<BreakerReport>) -> ReportRequest {
    ReportRequest {
        gateway: gateway.into(),
        interval_ms: 1_000,
        degraded: false,
        breakers,
        rules,
        paths: None,
    }
}

#[test]
fn reports_add_up_per_rule_in_ten_second_buckets_over_fifteen_minutes() {
    let mut view = View::new(Limits::default());
    // Bucket numbers are counted from the epoch: T0 starts one.
    let cases: [(&str, u64, u64, u64); 4] = [
        ("gw-1", 0, 5, 2),
        ("gw-2", 3_000, 7, 1),
        ("gw-1", 12_000, 10, 0),
        ("gw-1", 905_000, 1, 1),
    ];
    for (gateway, ms, admitted, limited) in cases {
        view.record_report(
            &report(
                gateway,
                vec![line("per-user", admitted, limited, None)],
                vec![],
            ),
            at(ms),
        );
    }
    let snapshot = view.snapshot(at(905_000));
    let rule = &snapshot.rules[0];
    assert_eq!(
        rule.totals,
        Counts {
            admitted: 23,
            limited: 4,
            dry_run_limited: 4
        }
    );
    assert_eq!(rule.admitted.len(), BUCKETS);
    // 905 s later the first bucket (T0's) has left the 15 minutes; the second is the
    // oldest shown, and the current one is last.
    assert_eq!(snapshot.series.bucket_ms, 10_000);
    assert_eq!(
        snapshot.series.start_ms,
        (T0_MS + 905_000) / 10_000 * 10_000 - 89 * 10_000
    );
    let shown: u64 = rule.admitted.iter().sum();
    assert_eq!(shown, 10 + 1);
    assert_eq!(rule.admitted[0], 10);
    assert_eq!(rule.admitted[BUCKETS - 1], 1);
    assert_eq!(rule.limited[BUCKETS - 1], 1);
    // Both gateways were seen; gw-2 last 902 s ago: gone from the view.
    let ids: Vec<&str> = snapshot.gateways.iter().map(|g| g.id.as_str()).collect();
    assert_eq!(ids, vec!["gw-1"]);
    assert_eq!(snapshot.gateways[0].reports, 3);
    assert_eq!(snapshot.reports, 4);
}

#[test]
fn hot_lists_merge_gateways_over_the_last_minute() {
    let mut view = View::new(Limits::default());
    let a = sketch(&[("acct-7", 50), ("acct-1", 3)], 10);
    let b = sketch(&[("acct-7", 20), ("<script>", 9)], 10);
    view.record_report(
        &report("gw-1", vec![line("per-user", 0, 53, Some(a))], vec![]),
        at(0),
    );
    view.record_report(
        &report("gw-2", vec![line("per-user", 0, 29, Some(b))], vec![]),
        at(15_000),
    );
    let hot = view.snapshot(at(20_000)).rules[0]
        .hot_limited
        .clone()
        .unwrap();
    let items: Vec<(&str, u64)> = hot
        .items
        .iter()
        .map(|item| (item.label.as_str(), item.count))
        .collect();
    assert_eq!(
        items,
        vec![("acct-7", 70), ("<script>", 9), ("acct-1", 3)],
        "labels are data, kept as text"
    );
    assert_eq!((hot.total, hot.floor, hot.capacity), (82, 0, 10));
    // A minute later the first report has left the window; another 10 s and the second.
    let hot = view.snapshot(at(65_000)).rules[0]
        .hot_limited
        .clone()
        .unwrap();
    assert_eq!(hot.total, 29);
    assert_eq!(view.snapshot(at(80_000)).rules[0].hot_limited, None);
}

#[test]
fn the_view_is_bounded_whatever_gateways_send() {
    let limits = Limits {
        gateways: 2,
        rules: 2,
        breakers: 2,
    };
    let mut view = View::new(limits);
    for (at_ms, gateway) in [(0, "a"), (1, "b"), (2, "c")] {
        let rules = vec![line(gateway, 1, 0, None)];
        let breakers = vec![breaker(gateway, Status::Closed, false)];
        view.record_report(&report(gateway, rules, breakers), at(at_ms));
    }
    let snapshot = view.snapshot(at(3));
    assert_eq!(
        (
            snapshot.gateways.len(),
            snapshot.rules.len(),
            snapshot.breakers.len()
        ),
        (2, 2, 2)
    );
    assert_eq!(
        snapshot.dropped,
        Dropped {
            gateways: 1,
            rules: 1,
            breakers: 1
        }
    );
    // Once "a" and "b" have been silent for 15 minutes, "c" is tracked.
    let later = SPAN.whole_millis() + 2;
    view.record_report(&report("c", vec![line("c", 1, 0, None)], vec![]), at(later));
    let snapshot = view.snapshot(at(later));
    assert_eq!(snapshot.gateways.len(), 1);
    assert_eq!(snapshot.gateways[0].id, "c");
    assert_eq!(snapshot.rules[0].name, "c");
    // Transitions: the latest TRANSITIONS_KEPT, totals by target.
    let reported = breaker("payments", Status::Closed, true);
    let opening = Decided {
        answer: FleetAnswer {
            status: Status::Open,
            half_open_in_ms: 30_000,
            round: 0,
            places: 0,
        },
        transitions: vec![Transition {
            from: Status::Closed,
            to: Status::Open,
            cause: Cause::Tripped {
                slow: true,
                failed: false,
            },
            figures: Tally {
                calls: 20,
                slow: 11,
                failed: 0,
            },
        }],
        window: Tally {
            calls: 20,
            slow: 11,
            failed: 0,
        },
    };
    for n in 0..(TRANSITIONS_KEPT as u64 + 5) {
        view.record_fleet(&reported, &opening, at(later + n));
    }
    let snapshot = view.snapshot(at(later + 100));
    let payments = snapshot
        .breakers
        .iter()
        .find(|b| b.name == "payments")
        .unwrap();
    assert_eq!(payments.transitions.len(), TRANSITIONS_KEPT);
    assert_eq!(payments.transitions_total.open, TRANSITIONS_KEPT as u64 + 5);
    assert_eq!(payments.transitions[0].at_ms, T0_MS + later + 5);
    assert_eq!(payments.transitions[0].cause, "slow share reached");
    let state = payments.state.as_ref().unwrap();
    assert_eq!(state.status, Status::Open);
    assert_eq!(
        state.half_open_at_ms,
        Some(T0_MS + later + TRANSITIONS_KEPT as u64 + 4 + 30_000)
    );
}

#[test]
fn each_gateway_s_view_of_a_breaker_is_kept() {
    let mut view = View::new(Limits::default());
    view.record_report(
        &report(
            "gw-1",
            vec![],
            vec![breaker("payments", Status::Open, true)],
        ),
        at(0),
    );
    let mut degraded = report(
        "gw-2",
        vec![],
        vec![breaker("payments", Status::Closed, true)],
    );
    degraded.degraded = true;
    view.record_report(&degraded, at(10));
    let snapshot = view.snapshot(at(20));
    let seen: Vec<(&str, Status)> = snapshot.breakers[0]
        .gateways
        .iter()
        .map(|view| (view.gateway.as_str(), view.status))
        .collect();
    assert_eq!(seen, vec![("gw-1", Status::Open), ("gw-2", Status::Closed)]);
    assert!(snapshot.breakers[0].fleet);
    assert_eq!(snapshot.breakers[0].state, None);
    let degraded: Vec<bool> = snapshot.gateways.iter().map(|g| g.degraded).collect();
    assert_eq!(degraded, vec![false, true]);
    let json = serde_json::to_value(&snapshot).unwrap();
    assert_eq!(json["gateways"][0]["breakers"][0]["status"], "open");
    assert_eq!(json["breakers"][0]["gateways"][1]["status"], "closed");
}

/// Streams of labelled weights: a few heavy labels among many light ones.
fn stream() -> impl Strategy<Value = Vec<(u32, u64)>> {
    proptest::collection::vec((0u32..60, 1u64..6), 0..300)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Gateways' sketches, reported over the last minute and merged by the view, keep the
    /// merged bounds: a listed label's true count in [count − error, count], an unlisted
    /// one at most the floor, and the floor at most N / m.
    #[test]
    fn merged_hot_lists_keep_their_stated_bounds(
        reports in proptest::collection::vec((stream(), 0u64..59_000, 2usize..20), 1..8),
    ) {
        let mut view = View::new(Limits::default());
        let mut exact: HashMap<String, u64> = HashMap::new();
        let mut smallest = HOT_CAPACITY;
        let mut ordered = reports.clone();
        ordered.sort_by_key(|(_, ms, _)| *ms);
        for (items, ms, capacity) in &ordered {
            let mut sketch = SpaceSaving::new(*capacity);
            for (label, weight) in items {
                let label = format!("id-{label}");
                sketch.add(label.as_bytes(), *weight);
                *exact.entry(label).or_default() += weight;
            }
            smallest = smallest.min(*capacity);
            let line = line("r", 0, 0, Some(sketch.summary()));
            view.record_report(&report("gw", vec![line], vec![]), at(*ms));
        }
        let hot = view.snapshot(at(59_999)).rules[0].hot_limited.clone();
        let total: u64 = exact.values().sum();
        let Some(hot) = hot else {
            prop_assert_eq!(total, 0);
            return Ok(());
        };
        prop_assert_eq!(hot.total, total);
        prop_assert!(hot.floor <= total / smallest as u64, "{} > {}/{}", hot.floor, total, smallest);
        for item in &hot.items {
            let truth = exact.get(&item.label).copied().unwrap_or(0);
            prop_assert!(item.count - item.error <= truth && truth <= item.count, "{item:?}: {truth}");
        }
        for (label, truth) in &exact {
            if !hot.items.iter().any(|item| &item.label == label) {
                prop_assert!(*truth <= hot.floor, "{label}: {truth} > floor {}", hot.floor);
            }
        }
    }
}
