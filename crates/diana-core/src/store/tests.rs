use super::*;
use crate::algo::Mark;
use crate::time::{Nanos, Unit};
use std::num::NonZeroU32;
use std::sync::{Arc, Barrier};

/// The instant `nanos` after the epoch.
fn at(nanos: u64) -> Instant {
    Instant::from_unix_nanos(nanos)
}

/// A deliberately simple algorithm so these tests exercise the store, not the algorithms:
/// at most `rpu` tokens, and the counter forgets everything 1,000 ns after its last use.
#[derive(Debug)]
struct CountUpTo;

impl Algorithm for CountUpTo {
    fn code(&self) -> &'static str {
        "COUNT"
    }
    fn aliases(&self) -> &'static [&'static str] {
        &[]
    }
    fn default_burst(&self, rpu: NonZeroU32, _unit: Unit) -> NonZeroU32 {
        rpu
    }
    fn state_words(&self, _limit: &Limit) -> usize {
        2
    }
    fn capacity(&self, limit: &Limit) -> u64 {
        u64::from(limit.rpu.get())
    }
    fn acquire_at_least(
        &self,
        limit: &Limit,
        state: &mut [u64],
        now: Instant,
        need: u32,
        want: u32,
    ) -> Verdict {
        if self.is_idle(limit, state, now) {
            state[0] = 0;
        }
        let available = u64::from(limit.rpu.get()).saturating_sub(state[0]);
        let granted = if available >= u64::from(need.max(1)) {
            available.min(u64::from(want)) as u32
        } else {
            0
        };
        if granted > 0 {
            state[0] += u64::from(granted);
            state[1] = now.unix_nanos();
        }
        Verdict {
            granted,
            remaining: available - u64::from(granted),
            ..Verdict::default()
        }
    }
    fn release(&self, _limit: &Limit, state: &mut [u64], _now: Instant, tokens: u32, _mark: Mark) {
        state[0] = state[0].saturating_sub(u64::from(tokens));
    }
    fn charge_debt(&self, _limit: &Limit, state: &mut [u64], now: Instant, tokens: u32) -> Verdict {
        state[0] += u64::from(tokens);
        state[1] = now.unix_nanos();
        Verdict::default()
    }
    fn is_idle(&self, _limit: &Limit, state: &[u64], now: Instant) -> bool {
        state[0] == 0 || now.unix_nanos().saturating_sub(state[1]) >= 1_000
    }
}

fn prefix(rule_id: u64) -> String {
    crate::config::RuleKeys::of(rule_id, ONLY_GENERATION).slots
}

fn slot_key(rule_id: u64, slot: u32) -> String {
    slot_key_in(&prefix(rule_id), slot)
}

fn limit(rpu: u32) -> Limit {
    let rpu = NonZeroU32::new(rpu).unwrap();
    Limit {
        rpu,
        unit: Unit::Second,
        burst: rpu,
        slices: NonZeroU32::new(10).unwrap(),
        calendar: None,
        period: None,
    }
}

const BOTH: [CasSemantics; 2] = [CasSemantics::Envoy, CasSemantics::Nginx];

fn admitted(
    store: &Store,
    host: &dyn SharedData,
    table: &SlotTable<'_>,
    id: u64,
    n: usize,
) -> usize {
    (0..n)
        .filter(|_| {
            store
                .charge(host, table, SlotAddress::of(id, 64), at(100), 1, 1)
                .unwrap()
                .verdict
                .allowed()
        })
        .count()
}

#[test]
fn sequential_requests_admit_exactly_the_limit_on_both_hosts() {
    for semantics in BOTH {
        let host = MemoryHost::new(semantics);
        let store = Store::new();
        let limit = limit(20);
        let table = SlotTable {
            key_prefix: &prefix(7),
            generation: ONLY_GENERATION,
            algo: &CountUpTo,
            limit: &limit,
            max_delay: Nanos::MAX,
        };
        assert_eq!(
            admitted(&store, &host, &table, 42, 100),
            20,
            "{semantics:?}"
        );
        assert_eq!(store.host_is_strict(), semantics == CasSemantics::Nginx);
    }
}

#[test]
fn concurrent_workers_share_one_counter_on_both_hosts() {
    for semantics in BOTH {
        for round in 0..20 {
            let host = Arc::new(MemoryHost::new(semantics));
            let limit = limit(20);
            let start = Arc::new(Barrier::new(4));
            let workers: Vec<_> = (0..4)
                .map(|_| {
                    let host = Arc::clone(&host);
                    let start = Arc::clone(&start);
                    let limit = limit.clone();
                    std::thread::spawn(move || {
                        // Each worker has its own Store, as each Envoy worker has its own VM.
                        let store = Store::new();
                        let table = SlotTable {
                            key_prefix: &prefix(round),
                            generation: ONLY_GENERATION,
                            algo: &CountUpTo,
                            limit: &limit,
                            max_delay: Nanos::MAX,
                        };
                        start.wait();
                        admitted(&store, host.as_ref(), &table, 42, 50)
                    })
                })
                .collect();
            let total: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
            assert_eq!(total, 20, "{semantics:?} round {round}");
        }
    }
}

/// A host where another worker creates the key between our read and our first write:
/// exactly the interleaving that loses an update when creation passes CAS 0 on Envoy.
struct RacingHost {
    inner: MemoryHost,
    competitor_value: Vec<u8>,
    raced: Cell<bool>,
}

impl SharedData for RacingHost {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        self.inner.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<SetOutcome, HostError> {
        if !self.raced.replace(true) {
            assert_eq!(
                self.inner.set(key, &self.competitor_value, 0)?,
                SetOutcome::Written
            );
        }
        self.inner.set(key, value, cas)
    }
}

#[test]
fn creating_a_key_never_overwrites_a_competitors_creation() {
    for semantics in BOTH {
        let limit = limit(20);
        let table = SlotTable {
            key_prefix: &prefix(1),
            generation: ONLY_GENERATION,
            algo: &CountUpTo,
            limit: &limit,
            max_delay: Nanos::MAX,
        };
        let address = SlotAddress::single();
        // The competitor charged one request for the same identity.
        let competitor = Record {
            fingerprint: address.fingerprint,
            touched: at(100),
            visits: 0,
            words: vec![1, 100],
        };
        let host = RacingHost {
            inner: MemoryHost::new(semantics),
            competitor_value: seal(&slot_key(1, 0), &competitor.encode()),
            raced: Cell::new(false),
        };
        let store = Store::new();
        let charge = store.charge(&host, &table, address, at(100), 1, 1).unwrap();
        assert!(charge.verdict.allowed());
        let (bytes, _) = host.inner.get(&slot_key(1, 0)).unwrap().unwrap();
        let record = Record::decode(open(&slot_key(1, 0), &bytes).unwrap(), 2);
        assert_eq!(record.words[0], 2, "{semantics:?}: both charges must count");
    }
}

#[test]
fn memory_is_bounded_by_the_slot_table_whatever_identities_arrive() {
    let host = MemoryHost::new(CasSemantics::Envoy);
    let store = Store::new();
    let limit = limit(10);
    let table = SlotTable {
        key_prefix: &prefix(3),
        generation: ONLY_GENERATION,
        algo: &CountUpTo,
        limit: &limit,
        max_delay: Nanos::MAX,
    };
    for identity in 0..100_000u64 {
        let hash = crate::hash::hash64(0, &identity.to_le_bytes());
        store
            .charge(
                &host,
                &table,
                SlotAddress::of(hash, 1024),
                at(identity * 10),
                1,
                1,
            )
            .unwrap();
    }
    assert!(host.key_count() <= 1024, "{} keys", host.key_count());
    assert!(
        host.key_count() > 1000,
        "identities spread over the table: {}",
        host.key_count()
    );
}

#[test]
fn a_busy_slot_is_shared_conservatively_and_an_idle_one_is_reused() {
    let host = MemoryHost::new(CasSemantics::Nginx);
    // The policy before (still available): a newcomer shares a held counter. The policy
    // now takes one over: `a_held_slot_is_taken_over_with_a_fresh_counter_...`.
    let store = Store::new().with_eviction(Eviction::Share);
    let limit = limit(3);
    let table = SlotTable {
        key_prefix: &prefix(9),
        generation: ONLY_GENERATION,
        algo: &CountUpTo,
        limit: &limit,
        max_delay: Nanos::MAX,
    };
    let alice = SlotAddress {
        fingerprint: 11,
        first: 0,
        second: 0,
    };
    let bob = SlotAddress {
        fingerprint: 13,
        first: 0,
        second: 0,
    };
    assert!(
        !store
            .charge(&host, &table, alice, at(100), 1, 2)
            .unwrap()
            .collided
    );
    // Bob collides with active Alice: he is charged on her counter, never beyond the limit.
    let bob_charge = store.charge(&host, &table, bob, at(200), 1, 5).unwrap();
    assert!(bob_charge.collided);
    assert_eq!(bob_charge.verdict.granted, 1);
    assert_eq!(
        store
            .charge(&host, &table, alice, at(300), 1, 1)
            .unwrap()
            .verdict
            .granted,
        0
    );
    // Once Alice's counter is idle, Bob takes the slot with a fresh counter.
    let later = store.charge(&host, &table, bob, at(5_000), 1, 3).unwrap();
    assert!(!later.collided);
    assert_eq!(later.verdict.granted, 3);
}

#[test]
fn an_identity_finds_its_record_in_the_second_slot_before_claiming_the_first() {
    let host = MemoryHost::new(CasSemantics::Envoy);
    let store = Store::new();
    let limit = limit(2);
    let table = SlotTable {
        key_prefix: &prefix(5),
        generation: ONLY_GENERATION,
        algo: &CountUpTo,
        limit: &limit,
        max_delay: Nanos::MAX,
    };
    let carol = SlotAddress {
        fingerprint: 21,
        first: 0,
        second: 1,
    };
    let dave = SlotAddress {
        fingerprint: 23,
        first: 0,
        second: 1,
    };
    store.charge(&host, &table, carol, at(100), 1, 1).unwrap(); // slot 0
    store.charge(&host, &table, dave, at(1_000), 1, 2).unwrap(); // slot 1: Carol is still active
                                                                 // Carol's slot 0 went idle, and Dave used his budget: Dave must not reset himself by
                                                                 // claiming slot 0; he is found in slot 1 and stays limited.
    let again = store.charge(&host, &table, dave, at(1_200), 1, 1).unwrap();
    assert_eq!(again.verdict.granted, 0);
}

#[test]
fn garbage_in_a_slot_is_reclaimed_not_trusted() {
    for semantics in BOTH {
        let host = MemoryHost::new(semantics);
        host.put_raw(&slot_key(4, 0), b"\xff\x00garbage");
        let store = Store::new();
        let limit = limit(2);
        let table = SlotTable {
            key_prefix: &prefix(4),
            generation: ONLY_GENERATION,
            algo: &CountUpTo,
            limit: &limit,
            max_delay: Nanos::MAX,
        };
        let charge = store
            .charge(&host, &table, SlotAddress::single(), at(100), 1, 5)
            .unwrap();
        assert_eq!(charge.verdict.granted, 2, "{semantics:?}");
    }
}

#[test]
fn rejected_requests_write_nothing() {
    let host = MemoryHost::new(CasSemantics::Envoy);
    let store = Store::new();
    let limit = limit(1);
    let table = SlotTable {
        key_prefix: &prefix(8),
        generation: ONLY_GENERATION,
        algo: &CountUpTo,
        limit: &limit,
        max_delay: Nanos::MAX,
    };
    store
        .charge(&host, &table, SlotAddress::single(), at(100), 1, 1)
        .unwrap();
    let (_, cas_before) = host.get(&slot_key(8, 0)).unwrap().unwrap();
    assert!(!store
        .charge(&host, &table, SlotAddress::single(), at(101), 1, 1)
        .unwrap()
        .verdict
        .allowed());
    let (_, cas_after) = host.get(&slot_key(8, 0)).unwrap().unwrap();
    assert_eq!(cas_before, cas_after);
}

/// A host that always loses the race: the charge gives up after bounded attempts.
struct AlwaysRaced(MemoryHost);

impl SharedData for AlwaysRaced {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        self.0.get(key)
    }
    fn set(&self, key: &str, value: &[u8], _cas: u32) -> Result<SetOutcome, HostError> {
        self.0.put_raw(key, value);
        Ok(SetOutcome::CasMismatch)
    }
}

#[test]
fn endless_contention_is_bounded() {
    let host = AlwaysRaced(MemoryHost::new(CasSemantics::Envoy));
    let store = Store::new();
    let limit = limit(1_000_000);
    let table = SlotTable {
        key_prefix: &prefix(2),
        generation: ONLY_GENERATION,
        algo: &CountUpTo,
        limit: &limit,
        max_delay: Nanos::MAX,
    };
    let result = store.charge(&host, &table, SlotAddress::single(), at(100), 1, 1);
    assert_eq!(result, Err(ChargeError::Contention));
}

#[test]
fn slot_keys_are_spelled_the_same_by_both_builders() {
    for slot in [0, 1, 9, 10, 65_535, u32::MAX] {
        assert_eq!(
            slot_key(0xabc, slot),
            format!("diana/0000000000000abc/{slot}")
        );
    }
}

#[test]
fn a_release_gives_back_to_the_holder_only() {
    for semantics in BOTH {
        let host = MemoryHost::new(semantics);
        let store = Store::new();
        let limit = limit(3);
        let table = SlotTable {
            key_prefix: &prefix(12),
            generation: ONLY_GENERATION,
            algo: &CountUpTo,
            limit: &limit,
            max_delay: Nanos::MAX,
        };
        let alice = SlotAddress {
            fingerprint: 11,
            first: 0,
            second: 0,
        };
        let charge = store.charge(&host, &table, alice, at(100), 2, 2).unwrap();
        let receipt = charge.receipt.unwrap();
        assert_eq!((receipt.tokens, receipt.holder), (2, 11));
        store.release(&host, &table, &receipt, at(100)).unwrap();
        assert_eq!(
            store
                .charge(&host, &table, alice, at(100), 3, 3)
                .unwrap()
                .verdict
                .granted,
            3,
            "{semantics:?}: the two tokens came back"
        );
        // Once another identity took the idle slot over, an old receipt changes nothing.
        let bob = SlotAddress {
            fingerprint: 13,
            ..alice
        };
        let bob_charge = store.charge(&host, &table, bob, at(5_000), 1, 1).unwrap();
        assert!(!bob_charge.collided);
        store.release(&host, &table, &receipt, at(5_000)).unwrap();
        assert_eq!(store.peek(&host, &table, bob, at(5_000)).unwrap()[0], 1);
        // A denial takes nothing and leaves no receipt.
        let denied = store.charge(&host, &table, bob, at(5_000), 3, 3).unwrap();
        assert_eq!((denied.verdict.granted, denied.receipt), (0, None));
    }
}

/// Every key in one entry, as two keys with the same CRC32 share one in `shm_kv`.
fn same_entry(_key: &str) -> u64 {
    7
}

/// A slot key's entry by slot number, so that slot 0 of two rules share an entry.
fn entry_by_slot(key: &str) -> u64 {
    key.rsplit('/')
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(u64::MAX)
}

#[test]
fn another_keys_record_in_the_same_entry_is_not_trusted() {
    let host = MemoryHost::nginx_zone(entry_by_slot, 1024);
    let store = Store::new();
    let limit = limit(2);
    let (one, two) = (prefix(21), prefix(22));
    let table = |key_prefix| SlotTable {
        key_prefix,
        generation: ONLY_GENERATION,
        algo: &CountUpTo,
        limit: &limit,
        max_delay: Nanos::MAX,
    };
    let address = SlotAddress {
        fingerprint: 5,
        first: 0,
        second: 1,
    };
    // Rule 21 fills its counter in slot 0.
    assert_eq!(
        store
            .charge(&host, &table(&one), address, at(100), 1, 2)
            .unwrap()
            .verdict
            .granted,
        2
    );
    // Rule 22's identity finds rule 21's record in its slot 0: not its own, not counted
    // as its own (it would have been denied), and slot 1 is free: used instead.
    let charge = store
        .charge(&host, &table(&two), address, at(100), 1, 2)
        .unwrap();
    assert_eq!(charge.verdict.granted, 2);
    assert!(charge.receipt.unwrap().key.ends_with("/1"));
    // Rule 21's record is intact.
    assert_eq!(
        store
            .charge(&host, &table(&one), address, at(100), 1, 1)
            .unwrap()
            .verdict
            .granted,
        0
    );
    // Every candidate held by other keys' records: taken over like an evicted entry,
    // never a panic, never a foreign record's count believed.
    let host = MemoryHost::nginx_zone(same_entry, 1024);
    store
        .charge(&host, &table(&one), address, at(100), 1, 2)
        .unwrap();
    let charge = store
        .charge(&host, &table(&two), address, at(100), 1, 2)
        .unwrap();
    assert_eq!(charge.verdict.granted, 2);
}

#[test]
fn an_evicted_record_is_created_again_race_free() {
    let host = MemoryHost::nginx_zone(entry_by_slot, 4);
    let store = Store::new();
    let limit = limit(1_000);
    let table = SlotTable {
        key_prefix: &prefix(31),
        generation: ONLY_GENERATION,
        algo: &CountUpTo,
        limit: &limit,
        max_delay: Nanos::MAX,
    };
    // Eight identities in a zone of four entries: the oldest are evicted, nothing fails.
    for fingerprint in 1..=8u64 {
        let address = SlotAddress {
            fingerprint: fingerprint * 2 + 1,
            first: fingerprint as u32,
            second: fingerprint as u32,
        };
        assert!(store
            .charge(&host, &table, address, at(100), 1, 1)
            .unwrap()
            .verdict
            .allowed());
    }
    assert_eq!(host.key_count(), 4);
    assert_eq!(host.evictions(), 4);
    // An evicted identity starts over (its counter was dropped), by a strict create.
    let first = SlotAddress {
        fingerprint: 3,
        first: 1,
        second: 1,
    };
    assert_eq!(
        store.peek(&host, &table, first, at(100)).unwrap(),
        vec![0, 0]
    );
    assert!(store
        .charge(&host, &table, first, at(100), 1, 1)
        .unwrap()
        .verdict
        .allowed());
    assert!(store.host_is_strict());
}

#[test]
fn a_released_key_is_cleared_on_both_hosts() {
    for semantics in BOTH {
        let host = MemoryHost::new(semantics);
        let store = Store::new();
        let limit = limit(2);
        let table = SlotTable {
            key_prefix: &prefix(41),
            generation: ONLY_GENERATION,
            algo: &CountUpTo,
            limit: &limit,
            max_delay: Nanos::MAX,
        };
        store
            .charge(&host, &table, SlotAddress::single(), at(100), 1, 2)
            .unwrap();
        assert!(store.clear(&host, &slot_key(41, 0)).unwrap());
        assert!(
            !store.clear(&host, &slot_key(41, 1)).unwrap(),
            "never created"
        );
        match semantics {
            CasSemantics::Nginx => assert_eq!(host.key_count(), 0),
            CasSemantics::Envoy => assert_eq!(host.get(&slot_key(41, 0)).unwrap().unwrap().0, b""),
        }
        // A cleared slot is free again.
        assert_eq!(
            store
                .charge(&host, &table, SlotAddress::single(), at(100), 1, 2)
                .unwrap()
                .verdict
                .granted,
            2
        );
    }
}

/// Found by `tests/engine_properties.rs` (racing workers on a zone whose entries collide):
/// two one-counter rules whose slot-0 keys share an entry took it over from each other on
/// every request, each from a fresh counter, so neither limited: rules W 3/s on `/a` and
/// SW 3/min on `/a/b`, requests `/a`, `/a/b`, `//a/./b/`, `/a` admitted 4 on the first.
/// The second rule now keeps its counter in its spare slot 1.
#[test]
fn one_counter_rules_whose_slots_collide_keep_their_own_counts() {
    let host = MemoryHost::nginx_zone(entry_by_slot, 1024);
    let store = Store::new();
    let limit = limit(2);
    let (one, two) = (prefix(51), prefix(52));
    let table = |key_prefix| SlotTable {
        key_prefix,
        generation: ONLY_GENERATION,
        algo: &CountUpTo,
        limit: &limit,
        max_delay: Nanos::MAX,
    };
    let charge = |key_prefix| {
        store
            .charge(
                &host,
                &table(key_prefix),
                SlotAddress::single(),
                at(100),
                1,
                1,
            )
            .unwrap()
    };
    // Alternating requests: each rule admits exactly its limit, then denies.
    let mut admitted = [0, 0];
    for _ in 0..5 {
        for (count, key_prefix) in admitted.iter_mut().zip([&one, &two]) {
            *count += charge(key_prefix).verdict.granted;
        }
    }
    assert_eq!(admitted, [2, 2]);
    assert!(
        host.get(&slot_key(52, 1)).unwrap().is_some(),
        "spare slot used"
    );
}

// ---------------------------------------------------------------------------------------
// Both candidates held: a newcomer takes one over (docs/security-slots.md).

const SECOND: Nanos = crate::time::NANOS_PER_SECOND;
const T0: Instant = Instant::from_unix_nanos(1_767_225_600_000_000_000);

/// The real token bucket, `rpu` per minute (records stay active for minutes).
fn bucket(rpu: u32) -> (&'static dyn Algorithm, Limit) {
    let rpu = NonZeroU32::new(rpu).unwrap();
    let limit = Limit {
        rpu,
        unit: Unit::Minute,
        burst: rpu,
        slices: NonZeroU32::new(10).unwrap(),
        calendar: None,
        period: None,
    };
    (crate::algo::lookup("TB").unwrap(), limit)
}

/// Uniform identities (as keyed hashes are to anyone without the key).
fn stranger(n: u64, slots: u32) -> SlotAddress {
    SlotAddress::of(crate::hash::hash64(0x5eed, &n.to_le_bytes()), slots)
}

/// A flood of strangers (each spending its whole budget at once) and, meanwhile, newcomers
/// sending 10 requests a second apart: what each newcomer is admitted.
fn newcomers_under_a_flood(eviction: Eviction) -> Vec<usize> {
    let slots = 4096;
    let (algo, limit) = bucket(5);
    let table = SlotTable {
        key_prefix: &prefix(61),
        generation: ONLY_GENERATION,
        algo,
        limit: &limit,
        max_delay: Nanos::ZERO,
    };
    let host = MemoryHost::new(CasSemantics::Envoy);
    let store = Store::new().with_eviction(eviction);
    let charge = |who: SlotAddress, now: Instant| {
        store
            .charge(&host, &table, who, now, 1, 1)
            .unwrap()
            .verdict
            .allowed()
    };
    // 300,000 ids in 12 s against 65,536 slots, scaled to 4,096 slots.
    let strangers = 18_750u64;
    let step = 12 * SECOND / strangers;
    let mut admitted = vec![0; 20];
    for n in 0..strangers {
        let now = T0 + n * step;
        for _ in 0..5 {
            charge(stranger(n, slots), now);
        }
        // Newcomer k asks at 2 s + i s (+ k µs), i < 10.
        for (k, count) in admitted.iter_mut().enumerate() {
            let k = k as u64;
            let due = (0..10).map(|i| T0 + (2 + i) * SECOND + Nanos::new(k * 1_000));
            if due
                .clone()
                .any(|at| at > now.saturating_sub(step) && at <= now)
            {
                *count += usize::from(charge(stranger(1 << 40 | k, slots), now));
            }
        }
    }
    admitted
}

#[test]
fn a_flood_of_strangers_does_not_lock_newcomers_out() {
    let before = newcomers_under_a_flood(Eviction::Share);
    let now = newcomers_under_a_flood(Eviction::default());
    let mean = |admitted: &[usize]| admitted.iter().sum::<usize>() as f64 / admitted.len() as f64;
    // Sharing: newcomers share exhausted counters and get (nearly) nothing.
    assert!(mean(&before) < 3.0, "{before:?}");
    assert!(before.iter().any(|&a| a <= 1), "{before:?}");
    // Now every newcomer gets at least its limit (5 of 10), and not much beyond on average.
    assert!(now.iter().all(|&a| a >= 5), "{now:?}");
    assert!(mean(&now) <= 8.0, "{now:?}");
}

/// Every slot of a small table held by active strangers charged long enough ago.
fn saturated(store: &Store, host: &dyn SharedData, table: &SlotTable<'_>, slots: u32, at: Instant) {
    for n in 0..u64::from(slots) * 8 {
        store
            .charge(host, table, stranger(n, slots), at, 1, 1)
            .unwrap();
    }
}

#[test]
fn a_held_slot_is_taken_over_with_a_fresh_counter_but_a_leaky_buckets_never() {
    let (algo, limit) = bucket(5);
    let table = SlotTable {
        key_prefix: &prefix(62),
        generation: ONLY_GENERATION,
        algo,
        limit: &limit,
        max_delay: Nanos::ZERO,
    };
    let host = MemoryHost::new(CasSemantics::Envoy);
    let store = Store::new();
    let alice = SlotAddress {
        fingerprint: 11,
        first: 0,
        second: 0,
    };
    let bob = SlotAddress {
        fingerprint: 13,
        ..alice
    };
    let receipt = store
        .charge(&host, &table, alice, T0, 5, 5)
        .unwrap()
        .receipt
        .unwrap();
    // Bob takes the slot over with a fresh counter (Alice is forgiven what she spent).
    let bob_charge = store
        .charge(&host, &table, bob, T0 + Nanos::new(1), 1, 5)
        .unwrap();
    assert!(bob_charge.collided);
    assert_eq!(bob_charge.verdict.granted, 5);
    assert_eq!(bob_charge.receipt.unwrap().holder, 13);
    // Alice's late give-back leaves Bob's counter alone (holder check).
    store
        .release(&host, &table, &receipt, T0 + Nanos::new(2))
        .unwrap();
    assert!(!store
        .charge(&host, &table, bob, T0 + Nanos::new(2), 1, 1)
        .unwrap()
        .verdict
        .allowed());
    // The policy before: Bob would have shared Alice's exhausted counter.
    let host = MemoryHost::new(CasSemantics::Envoy);
    let sharing = Store::new().with_eviction(Eviction::Share);
    sharing.charge(&host, &table, alice, T0, 5, 5).unwrap();
    let shared = sharing
        .charge(&host, &table, bob, T0 + Nanos::new(1), 1, 1)
        .unwrap();
    assert!(shared.collided && !shared.verdict.allowed());

    // A leaky bucket's record holds queued turns: shared, never taken over.
    let leaky = crate::algo::lookup("LB").unwrap();
    let table = SlotTable {
        key_prefix: &prefix(63),
        generation: ONLY_GENERATION,
        algo: leaky,
        limit: &limit,
        max_delay: Nanos::MAX,
    };
    store.charge(&host, &table, alice, T0, 1, 1).unwrap();
    let later = store.charge(&host, &table, bob, T0 + SECOND, 1, 1).unwrap();
    assert!(later.collided);
    assert_eq!(
        later.receipt.unwrap().holder,
        11,
        "charged on Alice's record"
    );
}

/// A takeover never lands on a record its holder changed meanwhile: the holder's charge,
/// made between the newcomer's read and write, makes the takeover's CAS fail, and the
/// charge is decided again on what is there then.
#[test]
fn a_takeover_never_replaces_a_record_under_its_holders_charge() {
    type Charging<'a> = &'a dyn Fn(&MemoryHost);
    struct HolderCharges<'a> {
        inner: MemoryHost,
        holder: Cell<Option<Charging<'a>>>,
    }
    impl SharedData for HolderCharges<'_> {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<SetOutcome, HostError> {
            if let Some(charge) = self.holder.take() {
                charge(&self.inner);
            }
            self.inner.set(key, value, cas)
        }
    }
    let (algo, limit) = bucket(5);
    let table = SlotTable {
        key_prefix: &prefix(65),
        generation: ONLY_GENERATION,
        algo,
        limit: &limit,
        max_delay: Nanos::ZERO,
    };
    let alice = SlotAddress {
        fingerprint: 11,
        first: 0,
        second: 0,
    };
    let bob = SlotAddress {
        fingerprint: 13,
        ..alice
    };
    for semantics in BOTH {
        let alice_store = Store::new();
        let alice_charges = |host: &MemoryHost| {
            assert!(alice_store
                .charge(host, &table, alice, T0 + Nanos::new(1), 1, 1)
                .unwrap()
                .verdict
                .allowed());
        };
        let host = HolderCharges {
            inner: MemoryHost::new(semantics),
            holder: Cell::new(None),
        };
        alice_store
            .charge(&host.inner, &table, alice, T0, 1, 1)
            .unwrap();
        let (_, cas_read) = host.inner.get(&slot_key(65, 0)).unwrap().unwrap();
        host.holder.set(Some(&alice_charges));
        let bob_charge = Store::new()
            .charge(&host, &table, bob, T0 + Nanos::new(2), 1, 1)
            .unwrap();
        // Bob's first CAS (on the record as read) failed: Alice's charge was written
        // first and then Bob's takeover was decided again, on a later CAS.
        assert!(bob_charge.verdict.allowed() && bob_charge.collided);
        let (bytes, cas_now) = host.inner.get(&slot_key(65, 0)).unwrap().unwrap();
        assert!(cas_now > cas_read + 1, "{semantics:?}");
        let record = Record::decode(open(&slot_key(65, 0), &bytes).unwrap(), 2);
        assert_eq!(record.fingerprint, 13);
    }
}

#[test]
fn a_refused_client_that_insists_keeps_its_record_a_quiet_one_is_flushed() {
    let (algo, limit) = bucket(5);
    let table = SlotTable {
        key_prefix: &prefix(64),
        generation: ONLY_GENERATION,
        algo,
        limit: &limit,
        max_delay: Nanos::ZERO,
    };
    let victim = SlotAddress {
        fingerprint: 21,
        first: 0,
        second: 1,
    };
    for insists in [true, false] {
        let host = MemoryHost::new(CasSemantics::Envoy);
        let store = Store::new();
        for _ in 0..5 {
            store.charge(&host, &table, victim, T0, 1, 1).unwrap();
        }
        let mut now = T0;
        // The victim asks again every 50 ms (or not); from 1 s on, newcomers aim at its
        // two slots (which the keyed hash makes impossible to do on purpose), one every
        // 10 ms for 5 s, each spending 1.
        for n in 0..600u64 {
            now += SECOND / 100;
            if insists && n % 5 == 0 {
                let refused = store.charge(&host, &table, victim, now, 1, 1).unwrap();
                assert!(
                    !refused.verdict.allowed(),
                    "never admitted while it insists"
                );
            }
            if n >= 100 {
                let newcomer = SlotAddress {
                    fingerprint: 1001 + 2 * n,
                    ..victim
                };
                store.charge(&host, &table, newcomer, now, 1, 1).unwrap();
            }
        }
        // 5 s of refill is less than one token at 5 a minute: only a flush admits it.
        let back = store.charge(&host, &table, victim, now, 1, 1).unwrap();
        assert_eq!(back.verdict.allowed(), !insists, "insists: {insists}");
    }
}

/// Exact counting across workers holds for an identity that must take a slot over: the
/// workers' takeovers race on one record's CAS, one wins, the others find it and charge it.
#[test]
fn concurrent_workers_count_a_newcomer_exactly_in_a_full_table() {
    for semantics in BOTH {
        for round in 0..10u64 {
            let slots = 64;
            let (algo, limit) = bucket(20);
            let host = Arc::new(MemoryHost::new(semantics));
            let key_prefix = prefix(70 + round);
            {
                let table = SlotTable {
                    key_prefix: &key_prefix,
                    generation: ONLY_GENERATION,
                    algo,
                    limit: &limit,
                    max_delay: Nanos::ZERO,
                };
                saturated(&Store::new(), host.as_ref(), &table, slots, T0);
            }
            let newcomer = stranger(1 << 50 | round, slots);
            let start = Arc::new(Barrier::new(4));
            let workers: Vec<_> = (0..4)
                .map(|_| {
                    let host = Arc::clone(&host);
                    let start = Arc::clone(&start);
                    let key_prefix = key_prefix.clone();
                    let limit = limit.clone();
                    std::thread::spawn(move || {
                        let store = Store::new();
                        let table = SlotTable {
                            key_prefix: &key_prefix,
                            generation: ONLY_GENERATION,
                            algo,
                            limit: &limit,
                            max_delay: Nanos::ZERO,
                        };
                        start.wait();
                        (0..50)
                            .filter(|_| {
                                store
                                    .charge(host.as_ref(), &table, newcomer, T0 + SECOND, 1, 1)
                                    .unwrap()
                                    .verdict
                                    .allowed()
                            })
                            .count()
                    })
                })
                .collect();
            let total: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
            assert_eq!(total, 20, "{semantics:?} round {round}");
        }
    }
}
