//! A flood of strangers against one rule's slot table, measured natively (the real store,
//! the real token bucket, an in-memory Envoy host, a fake clock): what a newcomer gets,
//! and what an attacker gains by flushing a counter out of the table, under each
//! [`Eviction`] policy. The figures are in docs/security-slots.md.
//!
//! `cargo run --release -p diana-core --example slot_flood` (about a minute).

use diana_core::algo::{self, Algorithm, Limit};
use diana_core::store::{CasSemantics, Eviction, MemoryHost, SlotAddress, SlotTable, Store};
use diana_core::time::{Instant, Nanos, Unit, NANOS_PER_SECOND};
use std::num::NonZeroU32;

const SLOTS: u32 = 65_536;
const S: Nanos = NANOS_PER_SECOND;
const START: Instant = Instant::from_unix_nanos(1_767_225_600_000_000_000);

/// Identity hashes are keyed, so to anyone but the gateway they are uniform: a mixer of a
/// counter stands for them.
fn identity(n: u64) -> SlotAddress {
    let mut z = n.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    SlotAddress::of(z ^ (z >> 31), SLOTS)
}

fn limit(rpu: u32, unit: Unit) -> Limit {
    let rpu = NonZeroU32::new(rpu).unwrap_or(NonZeroU32::MIN);
    Limit {
        rpu,
        unit,
        burst: rpu,
        slices: NonZeroU32::new(10).unwrap_or(NonZeroU32::MIN),
        calendar: None,
        period: None,
    }
}

struct Rule {
    algo: &'static dyn Algorithm,
    limit: Limit,
}

impl Rule {
    fn table(&self) -> SlotTable<'_> {
        SlotTable {
            key_prefix: "diana/00000000000000aa/",
            generation: diana_core::store::ONLY_GENERATION,
            algo: self.algo,
            limit: &self.limit,
            max_delay: Nanos::ZERO,
        }
    }
}

fn admit(store: &Store, host: &MemoryHost, rule: &Rule, who: SlotAddress, now: Instant) -> bool {
    store
        .charge(host, &rule.table(), who, now, 1, 1)
        .map(|charge| charge.verdict.allowed())
        .unwrap_or(false)
}

/// Scenario 1: `strangers` distinct ids over 12 s, each sending `each` requests at once;
/// meanwhile `newcomers` devices each send 10 requests one second apart, starting 2 s in.
/// Returns (newcomer admissions of 10: mean, min, max; stranger requests admitted).
fn newcomers(
    eviction: Eviction,
    strangers: u64,
    each: u32,
    newcomers: u64,
) -> (f64, u32, u32, u64) {
    let rule = Rule {
        algo: algo::lookup("TB").unwrap_or_else(algo::default_algorithm),
        limit: limit(5, Unit::Minute),
    };
    let host = MemoryHost::new(CasSemantics::Envoy);
    let store = Store::new().with_eviction(eviction);
    let mut admitted = vec![0u32; newcomers as usize];
    let mut flood = 0u64;
    let step = 12 * S / strangers.max(1);
    // Newcomer requests: (time, which), sorted.
    let mut plan: Vec<(Instant, u64)> = (0..newcomers)
        .flat_map(|n| (0..10).map(move |i| (START + 2 * S + i * S + Nanos::new(n * 1_000_003), n)))
        .collect();
    plan.sort_unstable();
    let mut next = plan.into_iter().peekable();
    let newcomer = |at: Instant, n: u64, admitted: &mut Vec<u32>| {
        if admit(&store, &host, &rule, identity(1 << 40 | n), at) {
            if let Some(count) = admitted.get_mut(n as usize) {
                *count += 1;
            }
        }
    };
    for stranger in 0..strangers {
        let now = START + stranger * step;
        while let Some(&(at, n)) = next.peek() {
            if at > now {
                break;
            }
            newcomer(at, n, &mut admitted);
            next.next();
        }
        let who = identity(stranger);
        for _ in 0..each {
            flood += u64::from(admit(&store, &host, &rule, who, now));
        }
    }
    for (at, n) in next {
        newcomer(at, n, &mut admitted);
    }
    let mean = admitted.iter().map(|&a| f64::from(a)).sum::<f64>() / newcomers as f64;
    let min = admitted.iter().copied().min().unwrap_or(0);
    let max = admitted.iter().copied().max().unwrap_or(0);
    (mean, min, max, flood)
}

/// Scenario 2: an identity the attacker cannot replace (its address) spent its whole
/// budget at once (5 per hour: no refill interferes) in a table full of active clients;
/// the attacker then sends `flood` fresh ids (`each` requests apiece, 25,000 ids a second)
/// and tries the exhausted identity again: every 4 ms throughout (`insists`), or once at the
/// end. Returns whether it was admitted again, after how many flood requests, and how
/// many of the flood's requests were admitted.
fn flush(
    eviction: Eviction,
    each: u32,
    flood: u64,
    insists: bool,
    seed: u64,
) -> (Option<u64>, u64) {
    let rule = Rule {
        algo: algo::lookup("TB").unwrap_or_else(algo::default_algorithm),
        limit: limit(5, Unit::Hour),
    };
    let host = MemoryHost::new(CasSemantics::Envoy);
    let store = Store::new().with_eviction(eviction);
    for other in 0..u64::from(SLOTS) * 2 {
        admit(
            &store,
            &host,
            &rule,
            identity(seed << 48 | 1 << 44 | other),
            START,
        );
    }
    let victim = identity(seed << 48 | 1 << 45);
    let mut now = START + 60 * S;
    for _ in 0..5 {
        admit(&store, &host, &rule, victim, now);
    }
    let step = S / 25_000;
    let (mut sent, mut granted) = (0u64, 0u64);
    for fresh in 0..flood {
        now += step;
        let who = identity(seed << 48 | fresh);
        for _ in 0..each {
            sent += 1;
            granted += u64::from(admit(&store, &host, &rule, who, now));
        }
        if insists && fresh % 100 == 99 && admit(&store, &host, &rule, victim, now) {
            return (Some(sent), granted);
        }
    }
    let back = admit(&store, &host, &rule, victim, now + step);
    (back.then_some(sent), granted)
}

fn name(eviction: Eviction) -> &'static str {
    match eviction {
        Eviction::Share => "share (before)",
        Eviction::LeastRecent => "least recent",
        Eviction::ClosestToIdle => "closest to idle",
        Eviction::FewestVisits => "fewest visits (now)",
    }
}

fn main() {
    let policies = [
        Eviction::Share,
        Eviction::LeastRecent,
        Eviction::ClosestToIdle,
        Eviction::FewestVisits,
    ];
    println!(
        "## Newcomers under a flood: 300,000 ids in 12 s, device rule TB 5/minute, {SLOTS} slots"
    );
    println!("(100 newcomers, 10 requests each, one a second from t = 2 s; the limit allows 5)\n");
    println!("| policy | requests per stranger | newcomer admitted of 10: mean (min–max) | stranger requests admitted |");
    println!("|---|---|---|---|");
    for each in [1, 5, 20] {
        for eviction in policies {
            let (mean, min, max, flood) = newcomers(eviction, 300_000, each, 100);
            let sent = 300_000 * u64::from(each);
            println!(
                "| {} | {each} | {mean:.1} ({min}–{max}) | {flood} of {sent} |",
                name(eviction)
            );
        }
    }
    println!("\n## Flushing an exhausted counter (TB 5/hour, a table full of active clients)");
    println!("(fresh ids at 25,000/s; 5 trials each)\n");
    println!("| policy | requests per fresh id | exhausted identity | flood | admitted again | flood requests admitted |");
    println!("|---|---|---|---|---|---|");
    for each in [1, 5] {
        for eviction in policies {
            for (insists, flood) in [(true, 400_000u64), (false, 100_000), (false, 400_000)] {
                let trials: Vec<(Option<u64>, u64)> = (1..=5)
                    .map(|trial| flush(eviction, each, flood, insists, trial))
                    .collect();
                let back = trials.iter().filter(|(cost, _)| cost.is_some()).count();
                let granted = trials.iter().map(|(_, g)| g).sum::<u64>() / 5;
                let how = if insists {
                    "asks every 4 ms"
                } else {
                    "silent, then asks"
                };
                println!(
                    "| {} | {each} | {how} | {} ids | {back} of 5 | {granted} of {} |",
                    name(eviction),
                    flood,
                    flood * u64::from(each)
                );
            }
        }
    }
}
