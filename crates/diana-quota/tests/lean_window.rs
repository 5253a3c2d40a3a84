//! The lean script (`src/store/window.lua`, an acquire whose rules are all fixed windows)
//! decides exactly as the general script (`lua/decide.lua` with `lua/window.lua`): random
//! sequences of acquires (one to three rules, on one to three counters, the same counter
//! twice too, dry runs, costs, wants), interleaved with charges and releases (the general
//! script's, on the counters the lean one wrote), stored garbage (a window far ahead, one
//! ahead, behind, not a number, a missing field, a deleted key) and a fake clock that also
//! steps back, run against two stores on the same Redis — one taking the lean path, one
//! forced onto the general script — give the same answers (marks included) and leave the
//! same stored counters, every key with an expiry. On a single Redis and on a Redis
//! Cluster (per-key calls, compensation).

#![cfg(test)]

mod common;

use common::*;
use diana_core::wire::{ResolvedRule, RuleRequest};
use diana_quota::store::{redis_key, Outcome, RedisStore, Store};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

/// (rpu, unit, unit in µs)
type Case = (u32, &'static str, u64);

const CASES: [Case; 7] = [
    (1, "second", 1_000_000),
    (5, "second", 1_000_000),
    (7, "second", 1_000_000),
    (100, "minute", 60_000_000),
    (3, "hour", 3_600_000_000),
    (2, "day", 86_400_000_000),
    (40, "second", 1_000_000),
];

#[derive(Debug, Clone, Copy)]
enum Step {
    Still,
    Micro(u64),
    /// A thousandth-part of the unit.
    Part(u64),
    Units(u64),
    BackPart(u64),
    BackUnits(u64),
}

#[derive(Debug, Clone, Copy)]
enum Garbage {
    Delete,
    AheadOne,
    FarAhead,
    Behind,
    WindowNotANumber,
    CountNotANumber,
    NoWindow,
    NoCount,
}

#[derive(Debug, Clone)]
enum Op {
    Acquire {
        step: Step,
        rules: Vec<RuleSpec>,
    },
    Charge {
        step: Step,
        counter: usize,
        tokens: u32,
    },
    Release {
        step: Step,
        which: usize,
    },
    Garble {
        counter: usize,
        garbage: Garbage,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => Just(Step::Still),
        1 => (1..1_000u64).prop_map(Step::Micro),
        3 => (1..1_000u64).prop_map(Step::Part),
        1 => (1..3u64).prop_map(Step::Units),
        1 => (1..1_000u64).prop_map(Step::BackPart),
        1 => (1..3u64).prop_map(Step::BackUnits),
    ]
}

fn garbage() -> impl Strategy<Value = Garbage> {
    prop_oneof![
        Just(Garbage::Delete),
        Just(Garbage::AheadOne),
        Just(Garbage::FarAhead),
        Just(Garbage::Behind),
        Just(Garbage::WindowNotANumber),
        Just(Garbage::CountNotANumber),
        Just(Garbage::NoWindow),
        Just(Garbage::NoCount),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let rule = (
        0..3usize,
        1..4u32,
        prop_oneof![3 => Just(0u32), 1 => 1..6u32],
        prop::bool::weighted(0.15),
    );
    prop_oneof![
        12 => (step(), prop::collection::vec(rule, 1..4))
            .prop_map(|(step, rules)| Op::Acquire { step, rules }),
        1 => (step(), 0..3usize, 1..8u32)
            .prop_map(|(step, counter, tokens)| Op::Charge { step, counter, tokens }),
        2 => (step(), 0..8usize).prop_map(|(step, which)| Op::Release { step, which }),
        1 => (0..3usize, garbage()).prop_map(|(counter, garbage)| Op::Garble { counter, garbage }),
    ]
}

/// (counter, need, extra want, dry run) of one rule of an acquire.
type RuleSpec = (usize, u32, u32, bool);

/// An admitted acquire: its rules, and the outcomes of the lean side and the general side.
type Admitted = (Vec<RuleSpec>, [Vec<Outcome>; 2]);

#[derive(Debug, Clone)]
struct Scenario {
    cases: [Case; 3],
    ops: Vec<Op>,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        0..CASES.len(),
        0..CASES.len(),
        0..CASES.len(),
        prop::collection::vec(op(), 1..50),
    )
        .prop_map(|(a, b, c, ops)| Scenario {
            cases: [CASES[a], CASES[b], CASES[c]],
            ops,
        })
}

fn moved(now_us: u64, step: Step, unit_us: u64) -> u64 {
    match step {
        Step::Still => now_us,
        Step::Micro(us) => now_us + us,
        Step::Part(part) => now_us + unit_us * part / 1_000,
        Step::Units(units) => now_us + units * unit_us,
        Step::BackPart(part) => now_us - unit_us * part / 1_000 - 1,
        Step::BackUnits(units) => now_us - units * unit_us,
    }
}

fn request(key: &str, case: Case, need: u32, extra: u32, dry_run: bool) -> RuleRequest {
    let (rpu, unit, _) = case;
    let cost = need.min(rpu);
    RuleRequest {
        place: None,
        key: key.to_string(),
        algo: "W".to_string(),
        rpu,
        unit: unit.to_string(),
        burst: 1,
        slices: 1,
        want: cost + extra,
        cost,
        max_delay_ms: None,
        dry_run,
        period: None,
    }
}

/// A connection to either kind of Redis, for reading and garbling the counters.
enum Raw {
    Single(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Raw {
    async fn open(url: &str, cluster: bool) -> Raw {
        if cluster {
            let nodes: Vec<String> = url
                .trim_start_matches("redis+cluster://")
                .split(',')
                .map(|host| format!("redis://{host}"))
                .collect();
            let client = redis::cluster::ClusterClient::new(nodes).unwrap();
            Raw::Cluster(client.get_async_connection().await.unwrap())
        } else {
            let client = redis::Client::open(url).unwrap();
            Raw::Single(client.get_multiplexed_async_connection().await.unwrap())
        }
    }

    async fn query<T: redis::FromRedisValue>(&mut self, cmd: &redis::Cmd) -> T {
        match self {
            Raw::Single(conn) => cmd.query_async(conn).await.unwrap(),
            Raw::Cluster(conn) => cmd.query_async(conn).await.unwrap(),
        }
    }

    async fn hash(&mut self, key: &str) -> BTreeMap<String, String> {
        self.query(redis::cmd("HGETALL").arg(key)).await
    }

    async fn pttl(&mut self, key: &str) -> i64 {
        self.query(redis::cmd("PTTL").arg(key)).await
    }

    async fn run(&mut self, args: &[String]) {
        let mut cmd = redis::cmd(&args[0]);
        for arg in &args[1..] {
            cmd.arg(arg);
        }
        let _: redis::Value = self.query(&cmd).await;
    }
}

/// The same garbage written on a counter of both stores (window index as of `now_us`).
fn garble(key: &str, garbage: Garbage, now_us: u64, unit_us: u64) -> Vec<Vec<String>> {
    let current = now_us / unit_us;
    let hset = |fields: &[(&str, String)]| {
        let mut cmd = vec!["HSET".to_string(), key.to_string()];
        for (field, value) in fields {
            cmd.push((*field).to_string());
            cmd.push(value.clone());
        }
        vec![
            cmd,
            vec![
                "PEXPIRE".to_string(),
                key.to_string(),
                "3600000".to_string(),
            ],
        ]
    };
    let del = |field: &str| vec!["HDEL".to_string(), key.to_string(), field.to_string()];
    match garbage {
        Garbage::Delete => vec![vec!["DEL".to_string(), key.to_string()]],
        Garbage::AheadOne => hset(&[("w", (current + 1).to_string()), ("c", "1".to_string())]),
        Garbage::FarAhead => hset(&[("w", (current + 5).to_string()), ("c", "2".to_string())]),
        Garbage::Behind => hset(&[("w", (current - 1).to_string()), ("c", "3".to_string())]),
        Garbage::WindowNotANumber => hset(&[("w", "1.5".to_string()), ("c", "1".to_string())]),
        Garbage::CountNotANumber => hset(&[("w", current.to_string()), ("c", "x".to_string())]),
        Garbage::NoWindow => vec![del("w")],
        Garbage::NoCount => vec![del("c")],
    }
}

/// What one property run reached (so that it cannot pass by exercising nothing).
#[derive(Default)]
struct Reached {
    admitted: AtomicUsize,
    denied: AtomicUsize,
    several: AtomicUsize,
    dry_denied: AtomicUsize,
}

struct Side<'a> {
    store: &'a RedisStore,
    keys: [String; 3],
}

impl Side<'_> {
    fn requests(&self, cases: &[Case; 3], rules: &[RuleSpec]) -> Vec<RuleRequest> {
        rules
            .iter()
            .map(|&(c, need, extra, dry)| request(&self.keys[c], cases[c], need, extra, dry))
            .collect()
    }

    fn redis_key(&self, cases: &[Case; 3], counter: usize) -> String {
        let rule = request(&self.keys[counter], cases[counter], 1, 0, false);
        redis_key(&rule.resolve(0).unwrap())
    }
}

async fn check(
    lean: &RedisStore,
    general: &RedisStore,
    raw: &mut Raw,
    scenario: &Scenario,
    reached: &Reached,
) -> Result<(), TestCaseError> {
    let sides = [
        Side {
            store: lean,
            keys: [unique_key("l0"), unique_key("l1"), unique_key("l2")],
        },
        Side {
            store: general,
            keys: [unique_key("g0"), unique_key("g1"), unique_key("g2")],
        },
    ];
    let cases = &scenario.cases;
    let mut now_us: u64 = 1_700_000_000_000_000;
    let mut admitted: Vec<Admitted> = Vec::new();
    for (index, op) in scenario.ops.iter().enumerate() {
        let before = [
            snapshot(raw, &sides[0], cases).await,
            snapshot(raw, &sides[1], cases).await,
        ];
        match op {
            Op::Acquire { step, rules } => {
                now_us = moved(now_us, *step, cases[rules[0].0].2);
                let mut outcomes = Vec::new();
                for side in &sides {
                    let requests = side.requests(cases, rules);
                    let resolved: Vec<ResolvedRule<'_>> =
                        requests.iter().map(|r| r.resolve(0).unwrap()).collect();
                    outcomes.push(
                        side.store
                            .acquire_at(&resolved, Some(now_us))
                            .await
                            .unwrap(),
                    );
                }
                prop_assert_eq!(
                    &outcomes[0],
                    &outcomes[1],
                    "op {} (acquire {:?}) at {} µs",
                    index,
                    rules,
                    now_us
                );
                if rules.len() > 1 {
                    reached.several.fetch_add(1, Ordering::Relaxed);
                }
                let all = outcomes[0]
                    .iter()
                    .zip(rules)
                    .all(|(o, rule)| o.result.granted > 0 || rule.3);
                if all {
                    reached.admitted.fetch_add(1, Ordering::Relaxed);
                    if rules
                        .iter()
                        .zip(&outcomes[0])
                        .any(|(rule, o)| rule.3 && o.result.granted == 0)
                    {
                        reached.dry_denied.fetch_add(1, Ordering::Relaxed);
                    }
                    let general_side = outcomes.pop().unwrap_or_default();
                    let lean_side = outcomes.pop().unwrap_or_default();
                    admitted.push((rules.clone(), [lean_side, general_side]));
                } else {
                    reached.denied.fetch_add(1, Ordering::Relaxed);
                }
            }
            Op::Charge {
                step,
                counter,
                tokens,
            } => {
                now_us = moved(now_us, *step, cases[*counter].2);
                let mut results = Vec::new();
                for side in &sides {
                    let requests = side.requests(cases, &[(*counter, *tokens, 0, false)]);
                    let resolved: Vec<ResolvedRule<'_>> =
                        requests.iter().map(|r| r.resolve(0).unwrap()).collect();
                    results.push(side.store.charge_at(&resolved, Some(now_us)).await.unwrap());
                }
                prop_assert_eq!(&results[0], &results[1], "op {} (charge)", index);
            }
            Op::Release { step, which } => {
                if admitted.is_empty() {
                    continue;
                }
                let (rules, grants) = admitted.remove(which % admitted.len());
                now_us = moved(now_us, *step, cases[rules[0].0].2);
                let mut results = Vec::new();
                for (side, grant) in sides.iter().zip(&grants) {
                    let requests = side.requests(cases, &rules);
                    let resolved: Vec<ResolvedRule<'_>> =
                        requests.iter().map(|r| r.resolve(0).unwrap()).collect();
                    results.push(
                        side.store
                            .release_at(&resolved, grant, Some(now_us))
                            .await
                            .unwrap(),
                    );
                }
                prop_assert_eq!(&results[0], &results[1], "op {} (release)", index);
            }
            Op::Garble { counter, garbage } => {
                for side in &sides {
                    let key = side.redis_key(cases, *counter);
                    for command in garble(&key, *garbage, now_us, cases[*counter].2) {
                        raw.run(&command).await;
                    }
                }
            }
        }
        // The same counters on both sides, every key with an expiry; where a side entered
        // a new window, both set the same expiry.
        let after = [
            snapshot(raw, &sides[0], cases).await,
            snapshot(raw, &sides[1], cases).await,
        ];
        for counter in 0..3 {
            let (lean_state, general_state) = (&after[0][counter], &after[1][counter]);
            prop_assert_eq!(
                &lean_state.0,
                &general_state.0,
                "op {} ({:?}): counter {} differs",
                index,
                op,
                counter
            );
            if lean_state.0.is_empty() {
                continue;
            }
            prop_assert!(
                lean_state.1 > 0 && general_state.1 > 0,
                "op {} ({:?}): counter {} without expiry: lean {} ms, general {} ms",
                index,
                op,
                counter,
                lean_state.1,
                general_state.1
            );
            let entered = lean_state.0.get("w") != before[0][counter].0.get("w");
            if entered && !matches!(op, Op::Garble { .. }) {
                prop_assert!(
                    lean_state.1.abs_diff(general_state.1) <= 200,
                    "op {} ({:?}): counter {} entered a window with expiry {} ms, general {} ms",
                    index,
                    op,
                    counter,
                    lean_state.1,
                    general_state.1
                );
            }
        }
        // Real time must not expire what the fake clock keeps: both sides' expiries are
        // pushed far out (a lean call in the same window keeps it, as it keeps any).
        for side in &sides {
            for counter in 0..3 {
                let key = side.redis_key(cases, counter);
                raw.run(&["PEXPIRE".to_string(), key, "3600000".to_string()])
                    .await;
            }
        }
    }
    Ok(())
}

/// Each counter's stored hash and PTTL.
async fn snapshot(
    raw: &mut Raw,
    side: &Side<'_>,
    cases: &[Case; 3],
) -> Vec<(BTreeMap<String, String>, i64)> {
    let mut out = Vec::new();
    for counter in 0..3 {
        let key = side.redis_key(cases, counter);
        out.push((raw.hash(&key).await, raw.pttl(&key).await));
    }
    out
}

fn property(url: &str, cluster: bool, cases: u32) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let lean = redis_store(url);
    let general = redis_store(url).with_lean_window(false);
    let raw = std::cell::RefCell::new(runtime.block_on(Raw::open(url, cluster)));
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let reached = Reached::default();
    let outcome = runner.run(&scenario(), |scenario| {
        runtime.block_on(check(
            &lean,
            &general,
            &mut raw.borrow_mut(),
            &scenario,
            &reached,
        ))
    });
    if let Err(failure) = outcome {
        panic!("the lean and the general script disagree: {failure}");
    }
    let (admitted, denied, several, dry) = (
        reached.admitted.load(Ordering::Relaxed),
        reached.denied.load(Ordering::Relaxed),
        reached.several.load(Ordering::Relaxed),
        reached.dry_denied.load(Ordering::Relaxed),
    );
    eprintln!(
        "{cases} scenarios: {admitted} acquires admitted ({dry} past a dry run's denial), \
         {denied} denied, {several} with several rules"
    );
    assert!(
        admitted > 100 && denied > 100 && several > 100 && dry > 10,
        "{admitted} admitted, {denied} denied, {several} several, {dry} dry"
    );
}

#[test]
fn lean_script_matches_the_general_one_on_redis() {
    let server = RedisServer::start();
    property(&server.url(), false, 128);
    drop(server);
}

#[test]
fn lean_script_matches_the_general_one_on_a_cluster() {
    let cluster = RedisCluster::start();
    property(&cluster.url(), true, 32);
    drop(cluster);
}

/// Commands per acquire by name, from `INFO commandstats`.
fn commandstats(server: &RedisServer) -> BTreeMap<String, u64> {
    server
        .cli(&["INFO", "commandstats"])
        .lines()
        .filter_map(|line| {
            let (name, fields) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = fields.split(',').find_map(|f| f.strip_prefix("calls="))?;
            Some((name.to_string(), calls.trim().parse().ok()?))
        })
        .collect()
}

/// Fixed-window calls take the lean script (no PEXPIRE while the window stays), and it
/// survives a SCRIPT FLUSH (EVALSHA, NOSCRIPT, reload, once); any other algorithm in the
/// call takes the general one.
#[test]
fn fixed_windows_take_the_lean_script() {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let store = redis_store(&server.url());
    let w = rule(&unique_key("lean"), "W", 10, "hour", 10, 10, 1);
    let tb = rule(&unique_key("lean-tb"), "TB", 10, "hour", 10, 10, 1);
    let acquire = |rules: Vec<RuleRequest>| {
        let resolved: Vec<ResolvedRule<'_>> = rules.iter().map(|r| r.resolve(0).unwrap()).collect();
        runtime.block_on(store.check_and_update(&resolved)).unwrap()
    };
    away_from_boundary_blocking(3_600_000);
    assert_eq!(acquire(vec![w.clone()])[0].result.granted, 1);
    let key = redis_key(&w.resolve(0).unwrap());
    let ttl: i64 = server.cli(&["PTTL", &key]).trim().parse().unwrap();
    assert!(ttl > 1_000 && ttl <= 3_601_000, "{ttl}");
    let before = commandstats(&server);
    for _ in 0..5 {
        assert_eq!(acquire(vec![w.clone()])[0].result.granted, 1);
    }
    let after = commandstats(&server);
    let delta = |name: &str| after.get(name).unwrap_or(&0) - before.get(name).unwrap_or(&0);
    assert_eq!(
        (
            delta("evalsha"),
            delta("time"),
            delta("hmget"),
            delta("hset"),
            delta("pexpire")
        ),
        (5, 5, 5, 5, 0),
        "{after:?}"
    );
    assert_eq!(server.cli(&["HGET", &key, "c"]).trim(), "6");
    // Mixed with a token bucket: the general script (PEXPIRE on every write).
    let before = commandstats(&server);
    let outcomes = acquire(vec![w.clone(), tb]);
    assert!(outcomes.iter().all(|o| o.result.granted == 1));
    let after = commandstats(&server);
    let delta = |name: &str| after.get(name).unwrap_or(&0) - before.get(name).unwrap_or(&0);
    assert_eq!(delta("pexpire"), 2, "{after:?}");
    // Scripts flushed (a restart, a failover): reloaded, the call counted once.
    server.cli(&["SCRIPT", "FLUSH"]);
    assert_eq!(acquire(vec![w.clone()])[0].result.granted, 1);
    assert_eq!(server.cli(&["HGET", &key, "c"]).trim(), "8");
    // Dry run past its limit: the call passes, the dry rule is not charged.
    let tight = rule(&unique_key("lean-dry"), "W", 1, "hour", 1, 1, 1);
    assert_eq!(acquire(vec![tight.clone()])[0].result.granted, 1);
    let dry = RuleRequest {
        dry_run: true,
        ..tight.clone()
    };
    let outcomes = acquire(vec![w.clone(), dry]);
    assert_eq!(
        outcomes
            .iter()
            .map(|o| (o.result.allowed, o.result.granted))
            .collect::<Vec<_>>(),
        vec![(true, 1), (false, 0)]
    );
    let tight_key = redis_key(&tight.resolve(0).unwrap());
    assert_eq!(server.cli(&["HGET", &tight_key, "c"]).trim(), "1");
    // All or nothing: the tight rule refuses, the other is not charged.
    let outcomes = acquire(vec![w.clone(), tight]);
    assert_eq!(
        outcomes
            .iter()
            .map(|o| (o.result.allowed, o.result.granted))
            .collect::<Vec<_>>(),
        vec![(true, 0), (false, 0)]
    );
    assert_eq!(server.cli(&["HGET", &key, "c"]).trim(), "9");
    drop(server);
}

/// Waits (blocking) until the current window of `unit_ms` has more than 5 s left.
fn away_from_boundary_blocking(unit_ms: u64) {
    while unit_ms - now_ms() % unit_ms < 5_000 {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}
