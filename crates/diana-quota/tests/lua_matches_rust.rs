//! The Lua scripts implement the same math as the Rust algorithms (`diana_core::algo`):
//! the same random sequences of (time, want), on the same fake clock, give identical
//! answers from Redis (single and cluster) and from the memory store.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::*;
use diana_core::global::wire::RuleRequest;
use diana_quota::store::{MemoryStore, RedisStore};

/// A small deterministic generator (no dependency needed).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn below(&mut self, bound: u64) -> u64 {
        if bound == 0 {
            0
        } else {
            self.next() % bound
        }
    }
}

fn unit_us(unit: &str) -> u64 {
    match unit {
        "second" => 1_000_000,
        "minute" => 60_000_000,
        "hour" => 3_600_000_000,
        _ => 86_400_000_000,
    }
}

const CASES: [(&str, u32, &str, u32, u32); 22] = [
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
];

async fn compare(redis: &RedisStore, steps: usize) {
    let memory = MemoryStore::default();
    let mut rng = Lcg(0x5eed_d1a4);
    for (algo, rpu, unit_name, burst, slices) in CASES {
        let key = unique_key("diff");
        let unit_us = unit_us(unit_name);
        let period = (unit_us / u64::from(rpu)).max(1);
        // Somewhere in 2023, with sub-second noise.
        let mut now_us: u64 = 1_700_000_000_000_000 + rng.below(unit_us);
        let (mut allowed, mut denied, mut partial) = (0, 0, 0);
        for step in 0..steps {
            now_us += match rng.below(10) {
                0 => 0,
                1 => 1,
                2 => rng.below(unit_us),
                3 => unit_us + rng.below(unit_us),
                4..=6 => rng.below(period),
                _ => rng.below(3 * period),
            };
            let want = match rng.below(8) {
                0 | 1 => 1 + rng.below(12) as u32,
                2 => (1 + rng.below(2 * u64::from(burst.max(rpu).min(50_000)) + 2) as u32)
                    .min(100_000),
                _ => 1,
            };
            let request = RuleRequest {
                key: key.clone(),
                algo: algo.to_string(),
                rpu,
                unit: unit_name.to_string(),
                burst,
                slices,
                want,
                cost: 1,
                max_delay_ms: None,
                dry_run: false,
            };
            let resolved = [request.resolve(0).unwrap()];
            let expected = memory.decide_at(&resolved, now_us * 1000);
            let actual = redis.check_at(&resolved, Some(now_us)).await.unwrap();
            assert_eq!(
                actual, expected,
                "{algo} rpu {rpu}/{unit_name} burst {burst} slices {slices}: step {step} at {now_us} µs, want {want}"
            );
            match actual[0].granted {
                0 => denied += 1,
                granted if granted < want => partial += 1,
                _ => allowed += 1,
            }
        }
        // The sequence exercised both sides of the limit.
        assert!(
            allowed > 0 && denied > 0,
            "{algo} rpu {rpu}/{unit_name}: {allowed} allowed, {denied} denied"
        );
        eprintln!("{algo} rpu {rpu}/{unit_name} burst {burst} slices {slices}: {allowed} allowed, {partial} partial, {denied} denied");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_scripts_match_the_rust_algorithms() {
    let server = RedisServer::start();
    compare(&redis_store(&server.url()), 400).await;
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_scripts_match_the_rust_algorithms() {
    let cluster = RedisCluster::start();
    compare(&redis_store(&cluster.url()), 100).await;
    drop(cluster);
}
