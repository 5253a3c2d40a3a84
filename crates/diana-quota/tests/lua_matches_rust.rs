//! The Lua scripts implement the same math as the Rust algorithms (`diana_core::algo`,
//! through `store::decide`): property-based random sequences of acquire (random need,
//! want, cost, max delay; one or two counters per request, the same counter twice too),
//! charge, release, renew and RLS spends (takes, checks and counts, enforced, shadow or
//! quota), on a fake clock that also steps back, give identical answers from
//! Redis and from the memory store; on Redis Cluster, identical to the Rust model of the
//! cluster's per-key decisions with compensation.

#![cfg(test)]

// Helpers outside #[test] functions (clippy.toml covers only those).

mod common;

use common::*;
use diana_core::time::Instant;
use diana_core::wire::{ResolvedRule, RuleRequest};
use diana_quota::store::{Enforcement, MemoryStore, Outcome, RedisStore, Spend, Spending};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use std::sync::atomic::{AtomicUsize, Ordering};

fn unit_us(unit: &str) -> u64 {
    match unit {
        "second" => 1_000_000,
        "minute" => 60_000_000,
        "hour" => 3_600_000_000,
        _ => 86_400_000_000,
    }
}

/// (algo, rpu, unit, burst, slices)
type Case = (&'static str, u32, &'static str, u32, u32);

const CASES: [Case; 28] = [
    ("TB", 10, "second", 10, 1),
    ("TB", 3, "second", 2, 1),
    ("TB", 7, "minute", 7, 1),
    ("TB", 1000, "second", 50, 1),
    ("TB", 5, "hour", 1, 1),
    ("TB", 7, "day", 3, 1),
    ("TB", 4_000_000, "second", 60_000, 1),
    ("LB", 10, "second", 5, 1),
    ("LB", 3, "second", 1, 1),
    ("LB", 7, "minute", 2, 1),
    ("LB", 1000, "second", 20, 1),
    ("LB", 6, "day", 4, 1),
    ("W", 5, "second", 5, 1),
    ("W", 100, "minute", 1, 1),
    ("W", 3, "hour", 1, 1),
    ("W", 2, "day", 1, 1),
    ("SW", 10, "second", 1, 10),
    ("SW", 7, "second", 1, 3),
    ("SW", 20, "minute", 1, 7),
    ("SW", 5, "second", 1, 1),
    ("SW", 50, "hour", 1, 60),
    ("SW", 9, "day", 1, 13),
    // Concurrency: the unit only sets the test's clock steps (its buckets are 20 s).
    ("IF", 5, "second", 5, 1),
    ("IF", 3, "minute", 3, 1),
    ("IF", 2, "hour", 2, 1),
    // Calendar periods a gateway names (`period`, see `request`): the test's clock moves
    // by days around them, into the periods after and (a little) before.
    ("W", 5, "month", 5, 1),
    ("TB", 4, "week", 4, 1),
    ("TB", 30, "month", 10, 1),
];

fn capacity(case: Case) -> u32 {
    let (algo, rpu, _, burst, _) = case;
    match algo {
        "TB" => burst,
        "LB" => burst + 1,
        _ => rpu,
    }
}

/// A clock move, in units of the counter's period (unit/rpu) or unit.
#[derive(Debug, Clone, Copy)]
enum Step {
    Still,
    Micro(u64),
    Periods(u64, u64),
    Units(u64),
    Back(u64),
    BackUnits(u64),
}

#[derive(Debug, Clone)]
enum Op {
    /// Counters of the request (0 or 1 each), a want and a cost per counter (reduced to
    /// what the counter allows), a max delay in ms for leaky buckets.
    Acquire {
        step: Step,
        counters: Vec<usize>,
        wants: Vec<u32>,
        costs: Vec<u32>,
        max_delay_ms: Option<u64>,
    },
    Charge {
        step: Step,
        counters: Vec<usize>,
        tokens: u32,
    },
    /// Gives back (some of) the grant of an earlier admitted acquire.
    Release { step: Step, which: usize, part: u32 },
    /// Renews the concurrency places of an earlier admitted acquire.
    Renew { step: Step, which: usize },
    /// An RLS call: per counter how it spends, its cost and its enforcement.
    Spend {
        step: Step,
        counters: Vec<usize>,
        how: Vec<(u8, u8)>,
        costs: Vec<u32>,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => Just(Step::Still),
        1 => (1..1_000u64).prop_map(Step::Micro),
        4 => (0..4u64, 0..1_000u64).prop_map(|(whole, part)| Step::Periods(whole, part)),
        1 => (1..3u64).prop_map(Step::Units),
        1 => (1..1_000u64).prop_map(Step::Back),
        1 => (1..1_000u64).prop_map(Step::BackUnits),
    ]
}

fn counters() -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![
        3 => Just(vec![0]),
        2 => Just(vec![1]),
        3 => Just(vec![0, 1]),
        1 => Just(vec![1, 0]),
        1 => Just(vec![0, 0]),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let want = prop_oneof![4 => 1..4u32, 1 => 1..200u32];
    prop_oneof![
        6 => (
            step(),
            counters(),
            prop::collection::vec(want, 2),
            prop::collection::vec(1..50u32, 2),
            prop::option::of(0..3_000u64)
        )
            .prop_map(|(step, counters, wants, costs, max_delay_ms)| Op::Acquire {
                step,
                counters,
                wants,
                costs,
                max_delay_ms
            }),
        1 => (step(), counters(), 1..40u32).prop_map(|(step, counters, tokens)| Op::Charge {
            step,
            counters,
            tokens
        }),
        2 => (step(), 0..8usize, 1..4u32).prop_map(|(step, which, part)| Op::Release {
            step,
            which,
            part
        }),
        1 => (step(), 0..8usize).prop_map(|(step, which)| Op::Renew { step, which }),
        3 => (
            step(),
            counters(),
            prop::collection::vec((0..3u8, 0..3u8), 2),
            prop::collection::vec(prop_oneof![3 => 1..4u32, 1 => 1..60u32], 2)
        )
            .prop_map(|(step, counters, how, costs)| Op::Spend {
                step,
                counters,
                how,
                costs
            }),
    ]
}

/// What one case of the property checks: two counters, their limits, the operations.
#[derive(Debug, Clone)]
struct Scenario {
    cases: [Case; 2],
    ops: Vec<Op>,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        0..CASES.len(),
        0..CASES.len(),
        prop::collection::vec(op(), 1..40),
    )
        .prop_map(|(first, second, ops)| Scenario {
            cases: [CASES[first], CASES[second]],
            ops,
        })
}

fn request(key: &str, case: Case, want: u32, cost: u32, max_delay_ms: Option<u64>) -> RuleRequest {
    let (algo, rpu, unit, burst, slices) = case;
    let want = want.min(100_000);
    RuleRequest {
        place: None,
        key: key.to_string(),
        algo: algo.to_string(),
        rpu,
        unit: unit.to_string(),
        burst,
        slices,
        want,
        cost: 1 + (cost - 1) % want.min(capacity(case)),
        max_delay_ms: if algo == "LB" { max_delay_ms } else { None },
        dry_run: false,
        period: period_of(unit),
    }
}

/// The test's clock starts here (µs).
const START_US: u64 = 1_700_000_000_000_000;

/// The period a gateway names for a calendar unit: one that began three days before the
/// test's clock starts, a week or 30 days long (the clock may leave it: the stores count
/// on in the periods after it, taken to be as long).
fn period_of(unit: &str) -> Option<diana_core::wire::WirePeriod> {
    let len_ms = match unit {
        "week" => 7 * 86_400_000,
        "month" => 30 * 86_400_000,
        _ => return None,
    };
    Some(diana_core::wire::WirePeriod {
        start_ms: START_US / 1_000 - 3 * 86_400_000,
        len_ms,
    })
}

/// The instant `us` microseconds after the epoch (the Redis script's clock, in µs).
fn at_us(us: u64) -> Instant {
    Instant::from_unix_nanos(us * 1_000)
}

fn moved(now_us: u64, step: Step, case: Case) -> u64 {
    let unit = unit_us(case.2);
    let period = (unit / u64::from(case.1)).max(1);
    match step {
        Step::Still => now_us,
        Step::Micro(us) => now_us + us,
        Step::Periods(whole, part) => now_us + whole * period + period * part / 1_000,
        Step::Units(units) => now_us + units * unit,
        Step::Back(part) => now_us - period * part / 1_000 - 1,
        Step::BackUnits(part) => now_us - unit * part / 1_000,
    }
}

/// The reference: the memory store, all or nothing in one step (a single Redis), or per
/// key then compensation (what the service does on a cluster).
struct Model {
    memory: MemoryStore,
    cluster: bool,
}

impl Model {
    fn acquire(&self, rules: &[ResolvedRule<'_>], now: Instant) -> Vec<Outcome> {
        if !self.cluster {
            return self.memory.acquire_at(rules, now).unwrap();
        }
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for (index, rule) in rules.iter().enumerate() {
            match groups
                .iter_mut()
                .find(|group| rules[group[0]].key == rule.key)
            {
                Some(group) => group.push(index),
                None => groups.push(vec![index]),
            }
        }
        let mut outcomes = vec![Outcome::default(); rules.len()];
        let mut per_group = Vec::new();
        for group in &groups {
            let subset: Vec<ResolvedRule<'_>> = group.iter().map(|&i| rules[i].clone()).collect();
            let decided = self.memory.acquire_at(&subset, now).unwrap();
            for (&i, outcome) in group.iter().zip(&decided) {
                outcomes[i] = *outcome;
            }
            per_group.push((subset, decided));
        }
        if outcomes.iter().all(|o| o.result.granted > 0) {
            return outcomes;
        }
        for (group, (subset, decided)) in groups.iter().zip(&per_group) {
            if decided.iter().any(|o| o.result.granted > 0) {
                let after = self.memory.release_at(subset, decided, now).unwrap();
                for (&i, result) in group.iter().zip(after) {
                    outcomes[i] = Outcome {
                        result,
                        ..Outcome::default()
                    };
                }
            }
        }
        outcomes
    }
}

/// What one property run compared (each test counts its own: the tests of this file run
/// side by side in one process under cargo test, each in its own under cargo-nextest).
#[derive(Default)]
struct Tally {
    /// Acquires admitted and denied (both must happen for the property to mean anything).
    admitted: AtomicUsize,
    denied: AtomicUsize,
    /// Renewals of concurrency places compared.
    renewed: AtomicUsize,
    /// RLS spends compared, and those admitted.
    spent: AtomicUsize,
    spent_admitted: AtomicUsize,
}

/// Runs one scenario against Redis and the model; the first difference fails it.
async fn check(
    redis: &RedisStore,
    cluster: bool,
    scenario: &Scenario,
    tally: &Tally,
) -> Result<(), TestCaseError> {
    let model = Model {
        memory: MemoryStore::default(),
        cluster,
    };
    let keys = [unique_key("p0"), unique_key("p1")];
    let mut now_us: u64 = START_US;
    // Admitted acquires: their rules and both sides' outcomes.
    let mut admitted: Vec<(Vec<RuleRequest>, Vec<Outcome>, Vec<Outcome>)> = Vec::new();
    for (index, op) in scenario.ops.iter().enumerate() {
        match op {
            Op::Acquire {
                step,
                counters,
                wants,
                costs,
                max_delay_ms,
            } => {
                now_us = moved(now_us, *step, scenario.cases[counters[0]]);
                let requests: Vec<RuleRequest> = counters
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| {
                        request(
                            &keys[c],
                            scenario.cases[c],
                            wants[i],
                            costs[i],
                            *max_delay_ms,
                        )
                    })
                    .collect();
                let rules: Vec<ResolvedRule<'_>> =
                    requests.iter().map(|r| r.resolve(0).unwrap()).collect();
                let expected = model.acquire(&rules, at_us(now_us));
                let actual = redis.acquire_at(&rules, Some(now_us)).await.unwrap();
                prop_assert_eq!(
                    &actual,
                    &expected,
                    "op {} (acquire {:?}) at {} µs",
                    index,
                    requests,
                    now_us
                );
                if actual.iter().all(|o| o.result.granted > 0) {
                    tally.admitted.fetch_add(1, Ordering::Relaxed);
                    admitted.push((requests, expected, actual));
                } else {
                    tally.denied.fetch_add(1, Ordering::Relaxed);
                }
            }
            Op::Charge {
                step,
                counters,
                tokens,
            } => {
                now_us = moved(now_us, *step, scenario.cases[counters[0]]);
                let requests: Vec<RuleRequest> = counters
                    .iter()
                    .filter(|&&c| scenario.cases[c].0 != "LB")
                    .map(|&c| request(&keys[c], scenario.cases[c], *tokens, 1, None))
                    .collect();
                if requests.is_empty() {
                    continue;
                }
                let rules: Vec<ResolvedRule<'_>> =
                    requests.iter().map(|r| r.resolve(0).unwrap()).collect();
                let expected = model.memory.charge_at(&rules, at_us(now_us)).unwrap();
                let actual = redis.charge_at(&rules, Some(now_us)).await.unwrap();
                prop_assert_eq!(
                    &actual,
                    &expected,
                    "op {} (charge {:?}) at {} µs",
                    index,
                    requests,
                    now_us
                );
            }
            Op::Release { step, which, part } => {
                if admitted.is_empty() {
                    continue;
                }
                let (requests, expected_grants, actual_grants) =
                    admitted.remove(which % admitted.len());
                now_us = moved(now_us, *step, scenario.cases[0]);
                // Give back a part of each grant: all, half, or one token.
                let portion = |outcomes: &[Outcome]| -> Vec<Outcome> {
                    outcomes
                        .iter()
                        .map(|o| {
                            let mut o = *o;
                            o.result.granted = match part {
                                1 => o.result.granted,
                                2 => o.result.granted.div_ceil(2),
                                _ => 1,
                            };
                            o
                        })
                        .collect()
                };
                let rules: Vec<ResolvedRule<'_>> =
                    requests.iter().map(|r| r.resolve(0).unwrap()).collect();
                let expected = model
                    .memory
                    .release_at(&rules, &portion(&expected_grants), at_us(now_us))
                    .unwrap();
                let actual = redis
                    .release_at(&rules, &portion(&actual_grants), Some(now_us))
                    .await
                    .unwrap();
                prop_assert_eq!(
                    &actual,
                    &expected,
                    "op {} (release {:?}) at {} µs",
                    index,
                    requests,
                    now_us
                );
            }
            Op::Spend {
                step,
                counters,
                how,
                costs,
            } => {
                // The cluster's per-key spend with compensation is checked against exact
                // answers by tests/scenarios.rs; here a single script against the table.
                if cluster {
                    continue;
                }
                now_us = moved(now_us, *step, scenario.cases[counters[0]]);
                let requests: Vec<RuleRequest> = counters
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| request(&keys[c], scenario.cases[c], costs[i], costs[i], None))
                    .collect();
                let spendings: Vec<Spending> = counters
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| {
                        let (spend, enforcement) = how[i];
                        let spend = match spend {
                            // A leaky bucket takes no debts: its count is a take.
                            2 if scenario.cases[c].0 != "LB" => Spend::Count,
                            1 => Spend::Check,
                            _ => Spend::Take,
                        };
                        let enforcement = match enforcement {
                            1 => Enforcement::Shadow,
                            2 => Enforcement::Quota,
                            _ => Enforcement::Enforced,
                        };
                        Spending { spend, enforcement }
                    })
                    .collect();
                let rules: Vec<ResolvedRule<'_>> =
                    requests.iter().map(|r| r.resolve(0).unwrap()).collect();
                let expected = model
                    .memory
                    .spend_at(&rules, &spendings, at_us(now_us))
                    .unwrap();
                let actual = redis
                    .spend_at(&rules, &spendings, Some(now_us))
                    .await
                    .unwrap();
                prop_assert_eq!(
                    &actual,
                    &expected,
                    "op {} (spend {:?} as {:?}) at {} µs",
                    index,
                    requests,
                    spendings,
                    now_us
                );
                tally.spent.fetch_add(1, Ordering::Relaxed);
                if actual.admitted {
                    tally.spent_admitted.fetch_add(1, Ordering::Relaxed);
                }
            }
            Op::Renew { step, which } => {
                if admitted.is_empty() {
                    continue;
                }
                let at = which % admitted.len();
                now_us = moved(now_us, *step, scenario.cases[0]);
                let (requests, expected_grants, actual_grants) = &mut admitted[at];
                // The places of the acquire's concurrency rules, `want` = what each took.
                let held: Vec<usize> = (0..requests.len())
                    .filter(|&i| requests[i].algo == "IF")
                    .collect();
                if held.is_empty() {
                    continue;
                }
                let renewals: Vec<RuleRequest> = held
                    .iter()
                    .map(|&i| RuleRequest {
                        want: expected_grants[i].result.granted,
                        cost: 1,
                        ..requests[i].clone()
                    })
                    .collect();
                let rules: Vec<ResolvedRule<'_>> =
                    renewals.iter().map(|r| r.resolve(0).unwrap()).collect();
                let marks = |grants: &[Outcome]| -> Vec<_> {
                    held.iter().map(|&i| grants[i].mark).collect()
                };
                let expected = model
                    .memory
                    .renew_at(&rules, &marks(expected_grants), at_us(now_us))
                    .unwrap();
                let actual = redis
                    .renew_at(&rules, &marks(actual_grants), Some(now_us))
                    .await
                    .unwrap();
                prop_assert_eq!(
                    &actual,
                    &expected,
                    "op {} (renew {:?}) at {} µs",
                    index,
                    renewals,
                    now_us
                );
                tally.renewed.fetch_add(1, Ordering::Relaxed);
                for (&i, (e, a)) in held.iter().zip(expected.iter().zip(&actual)) {
                    expected_grants[i].mark = e.mark;
                    actual_grants[i].mark = a.mark;
                }
            }
        }
    }
    Ok(())
}

/// Runs the property `cases` times (deterministic seed) against the store at `url`.
fn property(url: &str, cluster: bool, cases: u32) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let redis = redis_store(url);
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let tally = Tally::default();
    let outcome = runner.run(&scenario(), |scenario| {
        runtime.block_on(check(&redis, cluster, &scenario, &tally))
    });
    if let Err(failure) = outcome {
        panic!("Lua and Rust disagree: {failure}");
    }
    let (admitted, denied) = (
        tally.admitted.load(Ordering::Relaxed),
        tally.denied.load(Ordering::Relaxed),
    );
    let renewed = tally.renewed.load(Ordering::Relaxed);
    let (spent, spent_admitted) = (
        tally.spent.load(Ordering::Relaxed),
        tally.spent_admitted.load(Ordering::Relaxed),
    );
    eprintln!(
        "{cases} scenarios: {admitted} acquires admitted, {denied} denied, {renewed} renewals, \
         {spent} spends ({spent_admitted} admitted)"
    );
    // Bars per 256 scenarios: 100 admitted, 100 denied, 10 renewals (a run of fewer
    // scenarios, the cluster's, is held to the same share).
    let bar = |per_256: usize| per_256 * cases as usize / 256;
    assert!(
        admitted > bar(100) && denied > bar(100) && renewed > bar(10),
        "{admitted} admitted, {denied} denied, {renewed} renewed"
    );
    if !cluster {
        assert!(
            spent_admitted > 50 && spent - spent_admitted > 50,
            "{spent} spends, {spent_admitted} admitted"
        );
    }
}

#[test]
fn redis_scripts_match_the_rust_algorithms() {
    let server = RedisServer::start();
    property(&server.url(), false, 256);
    drop(server);
}

#[test]
fn cluster_scripts_match_the_rust_algorithms() {
    let cluster = RedisCluster::start();
    property(&cluster.url(), true, 64);
    drop(cluster);
}

/// Every algorithm and both sides of the limit are reached by the generator (so the
/// property above cannot pass by exercising nothing).
#[test]
fn the_generator_reaches_every_algorithm_and_every_operation() {
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let mut algos = std::collections::BTreeSet::new();
    let (mut acquires, mut charges, mut releases, mut renewals, mut back) = (0, 0, 0, 0, 0);
    let mut spends = 0;
    for _ in 0..200 {
        let scenario = scenario().new_tree(&mut runner).unwrap().current();
        for case in scenario.cases {
            algos.insert(case.0);
        }
        for op in &scenario.ops {
            match op {
                Op::Acquire { step, .. }
                | Op::Charge { step, .. }
                | Op::Release { step, .. }
                | Op::Renew { step, .. }
                | Op::Spend { step, .. } => {
                    back += usize::from(matches!(step, Step::Back(_) | Step::BackUnits(_)));
                }
            }
            match op {
                Op::Acquire { .. } => acquires += 1,
                Op::Charge { .. } => charges += 1,
                Op::Release { .. } => releases += 1,
                Op::Renew { .. } => renewals += 1,
                Op::Spend { .. } => spends += 1,
            }
        }
    }
    assert_eq!(algos.len(), 5, "{algos:?}");
    assert!(acquires > 0 && charges > 0 && releases > 0 && renewals > 0 && back > 0);
    assert!(spends > 0);
}
