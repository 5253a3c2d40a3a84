#![cfg(test)]
//! Property-based tests of the engine's all-or-nothing charging, through the public API.
//!
//! Random policies of 1–4 local rules over nested resources (`/`, `/a`, `/a/b`) with
//! random algorithms and limits, random request paths (several spellings of each),
//! random client addresses and a random forward clock:
//!
//! - one worker: every decision equals that of a model that runs each applicable rule's
//!   algorithm on its own state and commits them only when all admit; afterwards each
//!   rule's counter answers probes exactly like the model's, which counted the admitted
//!   requests only — a rejected request consumed nothing;
//! - racing workers (threads, one `Engine` each, one shared `MemoryHost`) at one instant,
//!   on Envoy's and nginx's CAS rules: each counter consumed exactly what the admitted
//!   requests it applies to took (a leaky-bucket turn may stay reserved, never the other
//!   way), and no rule admitted more than its capacity;
//! - the same on an nginx `shm_kv` zone whose entries collide (keys share entries as
//!   two keys with the same CRC32 do): never more than any rule's capacity.
//!
//! `PROPTEST_CASES` raises the case counts.

mod common;

use common::config;
use diana_core::actor::Identity;
use diana_core::algo::{Algorithm, Verdict};
use diana_core::config::{parse_policy, Policy, Rule};
use diana_core::cx::Cx;
use diana_core::decision::Decision;
use diana_core::engine::Engine;
use diana_core::facts::RequestFacts;
use diana_core::metrics::NoMetrics;
use diana_core::store::{CasSemantics, MemoryHost, SlotAddress, SlotTable, Store};
use diana_core::time::{Instant, Nanos, Unit, NANOS_PER_SECOND};
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Barrier};

const S: Nanos = NANOS_PER_SECOND;
/// 2026-01-01T00:00:00Z plus a little, inside every window.
const T0: Instant = Instant::from_unix_nanos(1_767_225_600_123_456_789);

const RESOURCES: [&str; 3] = ["/", "/a", "/a/b"];

/// Raw paths and what they normalise to.
const PATHS: [(&str, &str); 11] = [
    ("/", "/"),
    ("/a", "/a"),
    ("/a/b", "/a/b"),
    ("/a/b/c", "/a/b/c"),
    ("/b", "/b"),
    ("/ab", "/ab"),
    ("//a/./b/", "/a/b"),
    ("/a/%62", "/a/b"),
    ("/x/../a", "/a"),
    ("/a?q=/a/b", "/a"),
    ("/A/b", "/A/b"),
];

/// The client addresses requests come from.
const CLIENTS: [&str; 2] = ["10.0.0.1", "10.0.0.2"];

#[derive(Debug, Clone)]
struct RuleSpec {
    resource: usize,
    algo: &'static str,
    rpu: u32,
    unit: &'static str,
    burst: u32,
    slices: u32,
    per_ip: bool,
}

fn rule_specs(per_ip: bool) -> impl Strategy<Value = Vec<RuleSpec>> {
    let rule = (
        0..RESOURCES.len(),
        prop::sample::select(vec!["W", "SW", "TB", "LB"]),
        1u32..=6,
        prop::sample::select(vec!["second", "minute"]),
        1u32..=4,
        1u32..=5,
        prop::bool::weighted(if per_ip { 0.5 } else { 0.0 }),
    )
        .prop_map(
            |(resource, algo, rpu, unit, burst, slices, per_ip)| RuleSpec {
                resource,
                algo,
                rpu,
                unit,
                burst,
                slices,
                per_ip,
            },
        );
    prop::collection::vec(rule, 1..=4)
}

/// The document for `rules`: one block per resource that has rules, in random order of
/// resources (the engine sorts them).
fn document(rules: &[RuleSpec]) -> String {
    let mut text = String::from("resources:\n");
    for (index, url) in RESOURCES.iter().enumerate().rev() {
        let mine: Vec<(usize, &RuleSpec)> = rules
            .iter()
            .enumerate()
            .filter(|(_, rule)| rule.resource == index)
            .collect();
        if mine.is_empty() {
            continue;
        }
        text.push_str(&format!("  - Url: {url}\n    rules:\n"));
        for (n, rule) in mine {
            let mut fields = format!(
                "name: r{n}, rpu: {}, unit: {}, algo: {}, actor: {}",
                rule.rpu,
                rule.unit,
                rule.algo,
                if rule.per_ip { "ip" } else { "all" }
            );
            match rule.algo {
                "TB" | "LB" => fields.push_str(&format!(", burst: {}", rule.burst)),
                "SW" => fields.push_str(&format!(", slices: {}", rule.slices)),
                _ => {}
            }
            text.push_str(&format!("      - {{{fields}}}\n"));
        }
    }
    text
}

struct Client(&'static str);

impl RequestFacts for Client {
    fn header(&self, _name: &str) -> Option<Vec<u8>> {
        None
    }
    fn client_ip(&self) -> Option<Vec<u8>> {
        Some(self.0.as_bytes().to_vec())
    }
}

fn covers(url: &str, path: &str) -> bool {
    url == "/" || path == url || path.strip_prefix(url).is_some_and(|r| r.starts_with('/'))
}

fn address(rule: &Rule, client: &Client) -> SlotAddress {
    match rule.identify(client) {
        Identity::Key(hash) => SlotAddress::of(hash, rule.slots.get()),
        _ => SlotAddress::single(),
    }
}

/// False when the clients' candidate slots of a per-identity rule overlap (they would then
/// share a counter, which the model does not follow).
fn clients_apart(policy: &Policy) -> bool {
    policy.rules().all(|rule| {
        if who(rule, 1) == 0 {
            return true; // one counter for everyone
        }
        let [a, b] = CLIENTS.map(|ip| address(rule, &Client(ip)));
        let (a, b) = ([a.first, a.second], [b.first, b.second]);
        a.iter().all(|slot| !b.contains(slot))
    })
}

fn table(rule: &Rule, max_delay: Nanos) -> SlotTable<'_> {
    SlotTable {
        key_prefix: &rule.keys.slots,
        generation: rule.keys.generation,
        algo: rule.algo,
        limit: &rule.limit,
        max_delay,
    }
}

fn admits<C, W>(decision: &Decision<C, W>) -> bool {
    matches!(decision, Decision::Allow { .. } | Decision::Delay { .. })
}

fn probe(algo: &dyn Algorithm, rule: &Rule, state: &[u64], now: Instant) -> Verdict {
    let mut copy = state.to_vec();
    algo.acquire_at_least(&rule.limit, &mut copy, now, 0, 0)
}

/// Whose counter of `rule` a request from `CLIENTS[client]` is charged to: the client's
/// own (per-identity rules) or the one shared counter (0).
fn who(rule: &Rule, client: usize) -> usize {
    match rule.identify(&Client(CLIENTS[client])) {
        Identity::Key(_) => client,
        _ => 0,
    }
}

/// (rule index, whose counter) → the model's state words.
type ModelStates = HashMap<(usize, usize), Vec<u64>>;

/// The model's decision for a request at `now`, committed when every rule admits.
fn model_request(
    policy: &Policy,
    states: &mut ModelStates,
    path: &str,
    client: usize,
    now: Instant,
    max_delay: impl Fn(&Rule) -> Nanos,
) -> bool {
    let mut tentative = Vec::new();
    for resource in policy.resources.iter().filter(|r| covers(&r.url, path)) {
        for rule in &resource.rules {
            let key = (rule.index, who(rule, client));
            let mut state = states
                .get(&key)
                .cloned()
                .unwrap_or_else(|| vec![0; rule.algo.state_words(&rule.limit)]);
            let verdict = rule
                .algo
                .acquire_at_least(&rule.limit, &mut state, now, 1, 1);
            if !verdict.allowed() || verdict.delay > max_delay(rule) {
                return false;
            }
            tentative.push((key, state));
        }
    }
    states.extend(tentative);
    true
}

#[derive(Debug, Clone, Copy)]
struct Request {
    path: usize,
    client: usize,
    /// Nanoseconds after the previous request.
    step: Nanos,
}

fn requests(len: usize) -> impl Strategy<Value = Vec<Request>> {
    let step = prop_oneof![
        4 => Just(0u64),
        2 => 0u64..1_000,
        3 => 0u64..S.get(),
        1 => 0u64..40 * S.get(),
    ];
    let request =
        (0..PATHS.len(), 0..CLIENTS.len(), step).prop_map(|(path, client, step)| Request {
            path,
            client,
            step: Nanos::new(step),
        });
    prop::collection::vec(request, 1..len)
}

fn engine_for(policy: Policy, pausing: bool) -> Engine {
    Engine::new(policy).resuming_elsewhere(pausing)
}

proptest! {
    #![proptest_config(config(128))]

    /// One worker: the engine decides like the all-or-nothing model, and afterwards every
    /// counter holds exactly the admitted requests.
    #[test]
    fn one_worker_charges_exactly_the_admitted_requests(
        rules in rule_specs(true),
        requests in requests(120),
        nginx in any::<bool>(),
        pausing in any::<bool>(),
    ) {
        let policy = parse_policy(&document(&rules)).unwrap();
        prop_assume!(clients_apart(&policy));
        let semantics = if nginx { CasSemantics::Nginx } else { CasSemantics::Envoy };
        let host = MemoryHost::new(semantics);
        let engine = engine_for(policy.clone(), pausing);
        let max_delay = |rule: &Rule| if pausing { rule.max_wait } else { Nanos::ZERO };
        let mut states = ModelStates::new();
        let mut now = T0;
        for (i, request) in requests.iter().enumerate() {
            now += request.step;
            let (raw, path) = PATHS[request.path];
            let client = Client(CLIENTS[request.client]);
            let decision =
                engine.evaluate(&mut Cx::new(&host, now, &mut NoMetrics), raw.as_bytes(), &client);
            prop_assert!(!matches!(decision, Decision::Call(..)));
            let expected =
                model_request(&policy, &mut states, path, request.client, now, max_delay);
            prop_assert_eq!(admits(&decision), expected, "request {} {} at {:?}", i, raw, now);
        }
        // Every counter answers like the model's, now and later.
        let store = Store::new();
        for rule in policy.rules() {
            for (c, ip) in CLIENTS.iter().enumerate() {
                let client = Client(ip);
                let key = (rule.index, who(rule, c));
                let fresh = vec![0; rule.algo.state_words(&rule.limit)];
                let model = states.get(&key).unwrap_or(&fresh);
                let real = store
                    .peek(&host, &table(rule, max_delay(rule)), address(rule, &client), now)
                    .unwrap();
                for later in [Nanos::ZERO, S / 3, 7 * S / 5, 30 * S] {
                    let at = now + later;
                    let (m, r) = (probe(rule.algo, rule, model, at), probe(rule.algo, rule, &real, at));
                    prop_assert_eq!(
                        (m.remaining, m.reset), (r.remaining, r.reset),
                        "rule {} client {} at +{:?}", rule.name, ip, later
                    );
                }
            }
        }
    }
}

/// What racing workers did: per rule, the admitted requests it applied to.
fn race(policy: &Policy, host: &Arc<MemoryHost>, pausing: bool, plans: &[Vec<usize>]) -> Vec<u64> {
    let start = Arc::new(Barrier::new(plans.len()));
    let workers: Vec<_> = plans
        .iter()
        .map(|plan| {
            let host = Arc::clone(host);
            let start = Arc::clone(&start);
            let policy = policy.clone();
            let plan = plan.clone();
            std::thread::spawn(move || {
                let engine = engine_for(policy.clone(), pausing);
                let mut admitted = vec![0u64; policy.rules().count()];
                start.wait();
                for path in plan {
                    let (raw, normal) = PATHS[path];
                    let decision = engine.evaluate(
                        &mut Cx::new(host.as_ref(), T0, &mut NoMetrics),
                        raw.as_bytes(),
                        &Client(CLIENTS[0]),
                    );
                    if admits(&decision) {
                        for resource in policy.resources.iter().filter(|r| covers(&r.url, normal)) {
                            for rule in &resource.rules {
                                admitted[rule.index] += 1;
                            }
                        }
                    }
                }
                admitted
            })
        })
        .collect();
    let mut total = vec![0u64; policy.rules().count()];
    for worker in workers {
        for (sum, n) in total.iter_mut().zip(worker.join().unwrap()) {
            *sum += n;
        }
    }
    total
}

fn plans() -> impl Strategy<Value = Vec<Vec<usize>>> {
    prop::collection::vec(prop::collection::vec(0..PATHS.len(), 1..40), 2..=4)
}

/// Every rule's slot 0 in one entry, as if their keys had the same CRC32; other keys in
/// entries of their own. (When both candidates of a counter collide, the record is taken
/// over like an evicted one, and its count starts over: no store can keep two records in
/// one entry. CRC32 collisions of both are as rare as any two of four independent keys.)
fn colliding(key: &str) -> u64 {
    if key.ends_with("/0") {
        0
    } else {
        key.bytes()
            .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)))
            | 1
    }
}

proptest! {
    #![proptest_config(config(24))]

    /// Racing workers on one host: counters hold exactly what was admitted.
    #[test]
    fn racing_workers_charge_all_or_nothing(
        rules in rule_specs(false),
        plans in plans(),
        nginx in any::<bool>(),
    ) {
        let policy = parse_policy(&document(&rules)).unwrap();
        let semantics = if nginx { CasSemantics::Nginx } else { CasSemantics::Envoy };
        let host = Arc::new(MemoryHost::new(semantics));
        // nginx cannot hold a request: a leaky-bucket wait is a rejection there.
        let pausing = !nginx;
        let admitted = race(&policy, &host, pausing, &plans);
        let store = Store::new();
        for rule in policy.rules() {
            let max_delay = if pausing { rule.max_wait } else { Nanos::ZERO };
            let state = store
                .peek(host.as_ref(), &table(rule, max_delay), SlotAddress::single(), T0)
                .unwrap();
            let left = probe(rule.algo, rule, &state, T0).remaining;
            let capacity = rule.algo.capacity(&rule.limit);
            let consumed = capacity - left;
            let taken = admitted[rule.index];
            prop_assert!(taken <= capacity, "rule {} admitted {} of {}", rule.name, taken, capacity);
            if rule.algo.waits() {
                // A turn given back after another worker queued behind it stays reserved.
                prop_assert!(consumed >= taken, "rule {}: {} consumed, {} admitted", rule.name, consumed, taken);
            } else {
                prop_assert_eq!(consumed, taken, "rule {}: consumed vs admitted", rule.name);
            }
        }
    }

    /// Racing workers on an nginx zone whose slot-0 entries collide: no rule ever admits
    /// past its capacity.
    #[test]
    fn colliding_zone_entries_never_admit_past_the_limit(
        rules in rule_specs(false),
        plans in plans(),
    ) {
        let policy = parse_policy(&document(&rules)).unwrap();
        let host = Arc::new(MemoryHost::nginx_zone(colliding, 1_000));
        let admitted = race(&policy, &host, false, &plans);
        for rule in policy.rules() {
            let capacity = rule.algo.capacity(&rule.limit);
            prop_assert!(
                admitted[rule.index] <= capacity,
                "rule {} admitted {} of {} ({} evictions)",
                rule.name, admitted[rule.index], capacity, host.evictions()
            );
        }
    }
}

/// The model is not vacuous: a rule that counted a rejected request is caught.
#[test]
fn the_model_sees_a_charge_the_engine_would_have_kept() {
    let policy = parse_policy(&document(&[RuleSpec {
        resource: 0,
        algo: "W",
        rpu: 1,
        unit: "minute",
        burst: 1,
        slices: 1,
        per_ip: false,
    }]))
    .unwrap();
    let mut states = ModelStates::new();
    assert!(model_request(&policy, &mut states, "/", 0, T0, |_| {
        Nanos::ZERO
    }));
    assert!(!model_request(&policy, &mut states, "/a", 0, T0, |_| {
        Nanos::ZERO
    }));
    let rule = policy.rules().next().unwrap();
    assert_eq!(probe(rule.algo, rule, &states[&(0, 0)], T0).remaining, 0);
    assert_eq!(Unit::parse("minute"), Some(Unit::Minute));
}
