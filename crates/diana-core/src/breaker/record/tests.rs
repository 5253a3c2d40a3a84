//! The record and the workers' handles on an in-memory host under both CAS rules (Envoy
//! lenient, nginx strict), a zone whose keys collide and evict, hosts that fail, and two
//! workers racing.

use super::*;
use crate::breaker::settings::SlowCalls;
use crate::store::{CasSemantics, HostError, MemoryHost, SetOutcome};
use proptest::prelude::*;
use std::num::NonZeroU32;
use std::sync::{Arc, Barrier};

const T0: u64 = 1_000_000 * 1_000_000_000;
const MS: u64 = 1_000_000;

fn at(ms: u64) -> Instant {
    Instant::from_unix_nanos(T0 + ms * MS)
}

const HOSTS: [CasSemantics; 2] = [CasSemantics::Envoy, CasSemantics::Nginx];

/// slow_ms 1000 / 0.5, failure_ratio 0.5, min_calls 4, window 10 s, open 5 s, 2 places.
fn settings() -> Settings {
    let half = Ratio::from_ppm(500_000).unwrap();
    let slow = SlowCalls {
        threshold: Nanos::from_millis(1_000),
        ratio: half,
    };
    let mut settings = Settings::new("payments", Some(slow), Some(half)).unwrap();
    settings.min_calls = NonZeroU32::new(4).unwrap();
    settings.open_for = Nanos::from_secs(5);
    settings.half_open_calls = NonZeroU8::new(2).unwrap();
    settings
}

fn global() -> Settings {
    let mut settings = settings();
    settings.reach = Reach::Fleet;
    settings
}

const GOOD: Outcome = Outcome::GOOD;
const FAILED: Outcome = Outcome {
    slow: false,
    failed: true,
};

fn causes(transitions: &[Transition]) -> Vec<(Status, Status, Cause)> {
    transitions
        .iter()
        .map(|t| (t.from, t.to, t.cause))
        .collect()
}

fn stored(host: &MemoryHost, settings: &Settings) -> Option<Record> {
    let key = record_key(&settings.name);
    let payload = Store::new().read(host, &key).unwrap()?;
    Some(Record::decode(&payload).unwrap())
}

use Status::{Closed as C, HalfOpen as H, Open as O};

const TRIP_FAILED: Cause = Cause::Tripped {
    slow: false,
    failed: true,
};

#[test]
fn keys_are_bounded_and_named_apart() {
    let key = record_key("payments");
    assert!(key.starts_with("diana/breaker/"));
    assert_eq!(key.len(), KEY_PREFIX.len() + 16);
    assert_eq!(record_key(&"x".repeat(10_000)).len(), key.len());
    assert_ne!(record_key("payments"), record_key("payment"));
}

/// One record of every shape.
fn records() -> Vec<Record> {
    let mine = settings().edition(at(0));
    let mut records = vec![Record::new(&mine)];
    let mut state = State::new(&mine);
    state.record(
        &mine,
        Tally {
            calls: 3,
            slow: 1,
            failed: 2,
        },
        at(0),
    );
    records.push(Record {
        state: state.clone(),
        source: Source::Local,
    });
    state.record(
        &mine,
        Tally {
            calls: 1,
            slow: 0,
            failed: 1,
        },
        at(1),
    );
    records.push(Record {
        state: state.clone(),
        source: Source::Local,
    });
    state.check(&mine, at(5_001));
    records.push(Record {
        state: state.clone(),
        source: Source::Local,
    });
    let mut following = Record::new(&mine);
    following.follow(
        &mine,
        FleetAnswer {
            status: Status::HalfOpen,
            half_open_in_ms: 0,
            round: 7,
            places: 2,
        },
        at(2),
    );
    records.push(following);
    // The longest: 255 places, all taken, and the fleet followed.
    let mut many = settings();
    many.half_open_calls = NonZeroU8::MAX;
    let mine = many.edition(at(0));
    let mut state = State::new(&mine);
    state.record(
        &mine,
        Tally {
            calls: 4,
            slow: 4,
            failed: 4,
        },
        at(0),
    );
    for _ in 0..255 {
        state.check(&mine, at(5_000));
    }
    records.push(Record {
        state,
        source: Source::Fleet(Fleet {
            trusted_until: at(3_000),
            status: Status::Open,
            half_open_at: at(100),
            round: u64::MAX,
            granted: 3,
            used: 2,
            wanted: 1,
        }),
    });
    records
}

#[test]
fn records_round_trip_and_stay_within_their_bound() {
    let records = records();
    for record in &records {
        let bytes = record.encode();
        assert_eq!(Record::decode(&bytes), Ok(record.clone()));
        let places = record.state.params().half_open_calls.get();
        assert!(8 + bytes.len() <= record_bytes(places), "{record:?}");
    }
    // The bound is reached by the longest record.
    let longest = records.last().unwrap();
    assert_eq!(8 + longest.encode().len(), record_bytes(255));
    assert_eq!(record_bytes(3), 253);
}

#[test]
fn bytes_that_are_not_a_record_are_refused_never_a_panic() {
    let bytes = records()[3].encode();
    for length in 0..bytes.len() {
        assert_eq!(
            Record::decode(&bytes[..length]),
            Err(DecodeError::Truncated),
            "{length}"
        );
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert_eq!(Record::decode(&longer), Err(DecodeError::Trailing));
    let mut version = bytes.clone();
    version[0] = 2;
    assert_eq!(Record::decode(&version), Err(DecodeError::Version(2)));
    // Field by field, at the offsets of the layout: version, slow and failure ratios,
    // min_calls (9), window (13), open_for, half_open_calls (25), probe_timeout, force
    // (34), installed, phase (43).
    let cases: [(std::ops::Range<usize>, u8, DecodeError); 6] = [
        (4..5, 0xff, DecodeError::Invalid("ratio")),
        (9..13, 0, DecodeError::Invalid("min_calls")),
        (13..17, 0, DecodeError::Invalid("window")),
        (25..26, 0, DecodeError::Invalid("half_open_calls")),
        (34..35, 3, DecodeError::Invalid("force")),
        (43..44, 9, DecodeError::Invalid("phase")),
    ];
    for (range, value, error) in cases {
        let mut bad = bytes.clone();
        bad[range.clone()].fill(value);
        assert_eq!(Record::decode(&bad), Err(error), "{range:?}");
    }
    // A forced breaker that is open underneath contradicts itself.
    let mut forced = bytes.clone();
    forced[34] = 1;
    assert_eq!(Record::decode(&forced), Err(DecodeError::Invalid("phase")));
}

proptest! {
    #[test]
    fn random_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = Record::decode(&bytes);
        let mut versioned = bytes.clone();
        versioned.insert(0, RECORD_VERSION);
        if let Ok(record) = Record::decode(&versioned) {
            prop_assert_eq!(Record::decode(&record.encode()), Ok(record));
        }
    }
}

proptest! {
    /// Recording in memory where that needs no instant ([`Handle::record_in_memory`]),
    /// else as usual, is recording as usual: the same answers, host calls and record.
    #[test]
    fn recording_in_memory_first_is_recording(
        calls in proptest::collection::vec((0u8..4, 0u64..300), 1..60),
        fleet in any::<bool>(),
    ) {
        let settings = if fleet { global() } else { settings() };
        let outcome = |kind: u8| Outcome { slow: kind & 1 != 0, failed: kind & 2 != 0 };
        let (plain_host, memory_host) =
            (MemoryHost::new(CasSemantics::Envoy), MemoryHost::new(CasSemantics::Envoy));
        let store = Store::new();
        let mut plain = Handle::new(&settings, at(0));
        let mut memory = Handle::new(&settings, at(0));
        let mut now = at(0);
        for (kind, gap) in calls {
            now += Nanos::from_millis(gap);
            let outcome = outcome(kind);
            let expected = plain.record(&store, &plain_host, outcome, now);
            let answer = if memory.record_in_memory(outcome) {
                Ok(vec![])
            } else {
                memory.record(&store, &memory_host, outcome, now)
            };
            prop_assert_eq!(answer, expected);
            prop_assert_eq!(memory_host.calls(), plain_host.calls());
            prop_assert_eq!(memory.pending, plain.pending);
            prop_assert_eq!(memory.report, plain.report);
        }
        prop_assert_eq!(stored(&memory_host, &settings), stored(&plain_host, &settings));
    }
}

#[test]
fn a_closed_breaker_stays_off_shared_data_between_readings() {
    for semantics in HOSTS {
        let host = MemoryHost::new(semantics);
        let store = Store::new();
        let mut worker = Handle::new(&settings(), at(0));
        assert_eq!(
            worker.check(&store, &host, at(0)).admission,
            Admission::Call
        );
        // Nothing was written: a closed breaker's record is created by its first flush.
        assert_eq!(host.calls().1, 0, "{semantics:?}");
        let before = host.calls();
        for i in 0..1_000 {
            let now = at(0) + Nanos::new(i * 49_000);
            assert_eq!(worker.check(&store, &host, now).admission, Admission::Call);
            assert_eq!(worker.record(&store, &host, GOOD, now), Ok(vec![]));
        }
        assert_eq!(
            host.calls(),
            before,
            "{semantics:?}: no host call within the cache"
        );
        // After VERDICT_CACHE, one read.
        worker.check(&store, &host, at(50));
        assert_eq!(host.calls(), (before.0 + 1, before.1));
        // The tick merges the thousand calls.
        assert_eq!(worker.flush(&store, &host, at(100)), Ok(vec![]));
        let record = stored(&host, &settings()).unwrap();
        assert_eq!(
            record.state.window_total(at(100)),
            Tally {
                calls: 1_000,
                slow: 0,
                failed: 0
            }
        );
        // A flush with nothing pending and nothing to change reads and does not write.
        let writes = host.calls().1;
        assert_eq!(worker.flush(&store, &host, at(1_100)), Ok(vec![]));
        assert_eq!(host.calls().1, writes);
    }
}

#[test]
fn outcomes_that_can_trip_it_are_flushed_at_once_and_the_other_worker_follows_within_the_cache() {
    for semantics in HOSTS {
        let host = MemoryHost::new(semantics);
        let (store_a, store_b) = (Store::new(), Store::new());
        let mut a = Handle::new(&settings(), at(0));
        let mut b = Handle::new(&settings(), at(0));
        assert_eq!(b.check(&store_b, &host, at(0)).admission, Admission::Call);
        // The first failure goes to the record at once (other workers may hold the rest of
        // the evidence); the next two, within 100 ms and below min_calls, wait.
        for ms in 0..3 {
            assert_eq!(a.record(&store_a, &host, FAILED, at(ms)), Ok(vec![]));
        }
        let window = |host: &MemoryHost| {
            stored(host, &settings()).map(|r| r.state.window_total(at(3)).calls)
        };
        assert_eq!(window(&host), Some(1), "{semantics:?}");
        // The fourth makes a trip possible: flushed now, within the 100 ms.
        let transitions = a.record(&store_a, &host, FAILED, at(3)).unwrap();
        assert_eq!(
            causes(&transitions),
            vec![(C, O, TRIP_FAILED)],
            "{semantics:?}"
        );
        assert_eq!(
            transitions[0].figures,
            Tally {
                calls: 4,
                slow: 0,
                failed: 4
            }
        );
        assert_eq!(a.status(), O);
        assert_eq!(
            a.check(&store_a, &host, at(4)).admission,
            Admission::FastFail { retry_after: 5 }
        );
        // b trusts its reading of "closed" for 50 ms, then fails fast too, with no
        // transition of its own.
        assert_eq!(b.check(&store_b, &host, at(49)).admission, Admission::Call);
        let checked = b.check(&store_b, &host, at(50));
        assert_eq!(
            (checked.admission, checked.transitions),
            (Admission::FastFail { retry_after: 5 }, vec![])
        );
        // Open is cached too: until its end, from memory.
        let before = host.calls();
        assert_eq!(
            b.check(&store_b, &host, at(99)).admission,
            Admission::FastFail { retry_after: 5 }
        );
        assert_eq!(host.calls(), before);
    }
}

#[test]
fn failures_spread_over_workers_trip_it_at_once() {
    // One failure on each of four workers: no worker can trip min_calls 4 alone, the
    // record does when the fourth arrives (not a tick later, after good calls diluted it).
    for semantics in HOSTS {
        let host = MemoryHost::new(semantics);
        let stores: Vec<Store> = (0..4).map(|_| Store::new()).collect();
        let mut workers: Vec<Handle> = (0..4).map(|_| Handle::new(&settings(), at(0))).collect();
        let mut transitions = Vec::new();
        for (ms, (worker, store)) in workers.iter_mut().zip(&stores).enumerate() {
            transitions = worker.record(store, &host, FAILED, at(ms as u64)).unwrap();
        }
        assert_eq!(
            causes(&transitions),
            vec![(C, O, TRIP_FAILED)],
            "{semantics:?}"
        );
        assert_eq!(workers[3].status(), O);
    }
}

#[test]
fn early_flushes_are_spaced() {
    let host = MemoryHost::new(CasSemantics::Envoy);
    let (store_a, store_b) = (Store::new(), Store::new());
    let mut a = Handle::new(&settings(), at(0));
    let mut b = Handle::new(&settings(), at(0));
    // b's tick brings 100 good calls; a has read them.
    for _ in 0..100 {
        b.record(&store_b, &host, GOOD, at(0)).unwrap();
    }
    b.flush(&store_b, &host, at(0)).unwrap();
    a.flush(&store_a, &host, at(0)).unwrap();
    // a's first failure is flushed.
    let writes = host.calls().1;
    assert_eq!(a.record(&store_a, &host, FAILED, at(1)), Ok(vec![]));
    assert_eq!(host.calls().1, writes + 1);
    // 49 more within 100 ms, far from the share of the window a knows: kept in memory,
    // and so is a good call after them.
    for _ in 0..49 {
        assert_eq!(a.record(&store_a, &host, FAILED, at(50)), Ok(vec![]));
    }
    assert_eq!(a.record(&store_a, &host, GOOD, at(60)), Ok(vec![]));
    assert_eq!(host.calls().1, writes + 1);
    // The first outcome 100 ms after the last early flush takes them (a good one too).
    assert_eq!(a.record(&store_a, &host, GOOD, at(101)), Ok(vec![]));
    assert_eq!(host.calls().1, writes + 2);
    assert_eq!(
        stored(&host, &settings()).map(|r| r.state.window_total(at(101))),
        Some(Tally {
            calls: 152,
            slow: 0,
            failed: 50
        })
    );
    // Good calls alone wait for the tick.
    assert_eq!(a.record(&store_a, &host, GOOD, at(300)), Ok(vec![]));
    assert_eq!(host.calls().1, writes + 2);
}

#[test]
fn exactly_half_open_calls_probes_across_workers_and_every_good_one_closes_it() {
    for semantics in HOSTS {
        let host = MemoryHost::new(semantics);
        let (store_a, store_b) = (Store::new(), Store::new());
        let mut a = Handle::new(&settings(), at(0));
        let mut b = Handle::new(&settings(), at(0));
        for ms in 0..4 {
            a.record(&store_a, &host, FAILED, at(ms)).unwrap();
        }
        // At 5 s: the first to look makes the transition, once.
        let first = a.check(&store_a, &host, at(5_003));
        assert_eq!(causes(&first.transitions), vec![(O, H, Cause::Elapsed)]);
        let Admission::Probe(probe_a) = first.admission else {
            panic!("{semantics:?}: no probe: {first:?}")
        };
        let second = b.check(&store_b, &host, at(5_004));
        assert_eq!(second.transitions, vec![]);
        let Admission::Probe(probe_b) = second.admission else {
            panic!("{semantics:?}: no second probe")
        };
        // Every place taken: the rest fail fast, on both workers.
        for (worker, store) in [(&mut a, &store_a), (&mut b, &store_b)] {
            assert_eq!(
                worker.check(store, &host, at(5_005)).admission,
                Admission::FastFail { retry_after: 1 }
            );
        }
        // A rule rejects b's probe: its place goes back, and a takes it.
        assert_eq!(b.give_back(&store_b, &host, probe_b, at(5_006)), Ok(vec![]));
        let Admission::Probe(probe_c) = a.check(&store_a, &host, at(5_007)).admission else {
            panic!("{semantics:?}: the place given back was not taken again")
        };
        assert_eq!(
            a.probe_outcome(&store_a, &host, probe_a, GOOD, at(5_100)),
            Ok(vec![])
        );
        let closing = b
            .probe_outcome(&store_b, &host, probe_c, GOOD, at(5_200))
            .unwrap();
        assert_eq!(causes(&closing), vec![(H, C, Cause::Recovered)]);
        // a reads "closed" at its next look (half-open was not cached).
        assert_eq!(
            a.check(&store_a, &host, at(5_201)).admission,
            Admission::Call
        );
    }
}

#[test]
fn a_failed_probe_reopens_it_for_every_worker() {
    let host = MemoryHost::new(CasSemantics::Nginx);
    let (store_a, store_b) = (Store::new(), Store::new());
    let mut a = Handle::new(&settings(), at(0));
    let mut b = Handle::new(&settings(), at(0));
    for ms in 0..4 {
        a.record(&store_a, &host, FAILED, at(ms)).unwrap();
    }
    let Admission::Probe(probe) = a.check(&store_a, &host, at(5_003)).admission else {
        panic!("no probe")
    };
    let reopened = a
        .probe_outcome(&store_a, &host, probe, FAILED, at(5_500))
        .unwrap();
    assert_eq!(causes(&reopened), vec![(H, O, Cause::ProbeFailed)]);
    assert_eq!(
        b.check(&store_b, &host, at(5_501)).admission,
        Admission::FastFail { retry_after: 5 }
    );
}

#[test]
fn an_evicted_or_foreign_or_garbled_record_reads_as_a_fresh_closed_breaker() {
    // A zone where every key lands on one entry (same CRC32), with room for one.
    let host = MemoryHost::nginx_zone(|_| 0, 1);
    let store = Store::new();
    let mut worker = Handle::new(&settings(), at(0));
    for ms in 0..4 {
        worker.record(&store, &host, FAILED, at(ms)).unwrap();
    }
    assert_eq!(worker.status(), O);
    // Another breaker's record takes the entry: ours reads as fresh.
    let mut other = settings();
    other.name = "search".into();
    let mut neighbour = Handle::new(&other, at(0));
    neighbour.record(&store, &host, GOOD, at(10)).unwrap();
    neighbour.flush(&store, &host, at(10)).unwrap();
    assert_eq!(
        worker.check(&store, &host, at(100)).admission,
        Admission::Call
    );
    assert_eq!(stored(&host, &settings()), None);
    // The entry evicted: fresh as well.
    host.evict(&record_key(&other.name));
    assert_eq!(
        neighbour.check(&store, &host, at(200)).admission,
        Admission::Call
    );
    // Garbage under our seal: fresh, and overwritten by the next change.
    let key = record_key(&settings().name);
    host.put_raw(&key, &crate::store::seal(&key, &[RECORD_VERSION, 1, 2, 3]));
    assert_eq!(
        worker.check(&store, &host, at(300)).admission,
        Admission::Call
    );
    worker.record(&store, &host, GOOD, at(301)).unwrap();
    worker.flush(&store, &host, at(301)).unwrap();
    assert_eq!(
        stored(&host, &settings()).map(|r| r.state.window_total(at(301)).calls),
        Some(1)
    );
}

/// A host whose every call fails.
struct Broken;

impl SharedData for Broken {
    fn get(&self, _key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        Err(HostError::Poisoned)
    }
    fn set(&self, _key: &str, _value: &[u8], _cas: u32) -> Result<SetOutcome, HostError> {
        Err(HostError::Poisoned)
    }
}

/// A host where another worker always wins the race.
struct Outraced(MemoryHost);

impl SharedData for Outraced {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        self.0.get(key)
    }
    fn set(&self, _key: &str, _value: &[u8], _cas: u32) -> Result<SetOutcome, HostError> {
        Ok(SetOutcome::CasMismatch)
    }
}

#[test]
fn a_failing_host_lets_calls_through_and_keeps_the_pending_calls() {
    let store = Store::new();
    let mut worker = Handle::new(&settings(), at(0));
    let checked = worker.check(&store, &Broken, at(0));
    assert_eq!(checked.admission, Admission::Call);
    assert_eq!(
        checked.trouble,
        Some(ChargeError::Host(HostError::Poisoned))
    );
    worker.record(&store, &Broken, GOOD, at(1)).unwrap();
    assert_eq!(
        worker.flush(&store, &Broken, at(2)),
        Err(ChargeError::Host(HostError::Poisoned))
    );
    // The calls are not lost: the next flush on a working host merges them.
    let host = MemoryHost::new(CasSemantics::Envoy);
    worker.flush(&store, &host, at(3)).unwrap();
    assert_eq!(
        stored(&host, &settings()).map(|r| r.state.window_total(at(3)).calls),
        Some(1)
    );
}

#[test]
fn contention_on_a_probe_fails_fast() {
    let host = MemoryHost::new(CasSemantics::Envoy);
    let store = Store::new();
    let mut worker = Handle::new(&settings(), at(0));
    for ms in 0..4 {
        worker.record(&store, &host, FAILED, at(ms)).unwrap();
    }
    let outraced = Outraced(host);
    let checked = worker.check(&store, &outraced, at(5_003));
    assert_eq!(
        (checked.admission, checked.trouble),
        (
            Admission::FastFail { retry_after: 1 },
            Some(ChargeError::Contention)
        )
    );
}

#[test]
fn a_switch_reaches_every_worker_once_and_an_old_document_does_not_undo_it() {
    for semantics in HOSTS {
        let host = MemoryHost::new(semantics);
        let (store_a, store_b) = (Store::new(), Store::new());
        let mut a = Handle::new(&settings(), at(0));
        let mut b = Handle::new(&settings(), at(0));
        b.record(&store_b, &host, GOOD, at(0)).unwrap();
        b.flush(&store_b, &host, at(0)).unwrap();
        let mut forced = settings();
        forced.force = Force::Open;
        a.reconfigure(&forced, at(1_000));
        let checked = a.check(&store_a, &host, at(1_000));
        assert_eq!(
            (checked.admission, causes(&checked.transitions)),
            (
                Admission::FastFail { retry_after: 5 },
                vec![(C, O, Cause::Forced(Force::Open))]
            )
        );
        // b, still on the document before, obeys the switch it reads.
        let checked = b.check(&store_b, &host, at(1_100));
        assert_eq!(
            (checked.admission, checked.transitions),
            (Admission::FastFail { retry_after: 5 }, vec![])
        );
        b.record(&store_b, &host, GOOD, at(1_200)).unwrap();
        assert_eq!(b.flush(&store_b, &host, at(1_200)), Ok(vec![]));
        // b gets the new document too: no second transition.
        b.reconfigure(&forced, at(1_300));
        assert_eq!(b.flush(&store_b, &host, at(1_300)), Ok(vec![]));
        // Back to auto on one worker: closed, once, the window kept.
        a.reconfigure(&settings(), at(2_000));
        let transitions = a.flush(&store_a, &host, at(2_000)).unwrap();
        assert_eq!(
            causes(&transitions),
            vec![(O, C, Cause::Forced(Force::Auto))]
        );
        assert_eq!(transitions[0].figures.calls, 2);
    }
}

#[test]
fn a_gateway_started_with_a_switch_makes_it_once() {
    for semantics in HOSTS {
        let host = MemoryHost::new(semantics);
        let (store_a, store_b) = (Store::new(), Store::new());
        let mut forced = settings();
        forced.force = Force::Open;
        let mut a = Handle::new(&forced, at(0));
        let mut b = Handle::new(&forced, at(0));
        let checked = a.check(&store_a, &host, at(1));
        assert_eq!(
            (checked.admission, causes(&checked.transitions)),
            (
                Admission::FastFail { retry_after: 5 },
                vec![(C, O, Cause::Forced(Force::Open))]
            ),
            "{semantics:?}"
        );
        let checked = b.check(&store_b, &host, at(2));
        assert_eq!(
            (checked.admission, checked.transitions),
            (Admission::FastFail { retry_after: 5 }, vec![])
        );
        // A worker still on an older document (without the switch) does not undo it.
        let mut old = Handle::new(&settings(), Instant::from_unix_nanos(T0 - MS));
        assert_eq!(old.flush(&Store::new(), &host, at(3)), Ok(vec![]));
        assert_eq!(stored(&host, &settings()).map(|r| r.status(at(3))), Some(O));
    }
}

#[test]
fn the_fleet_is_followed_while_it_answers_and_the_local_breaker_takes_over_once_it_stops() {
    for semantics in HOSTS {
        let host = MemoryHost::new(semantics);
        let (store_a, store_b) = (Store::new(), Store::new());
        let mut a = Handle::new(&global(), at(0));
        let mut b = Handle::new(&global(), at(0));
        // Another gateway's evidence: the fleet is open for 2 s more.
        let open = FleetAnswer {
            status: Status::Open,
            half_open_in_ms: 2_000,
            round: 0,
            places: 0,
        };
        let transitions = a.follow(&store_a, &host, open, at(0)).unwrap();
        assert_eq!(
            causes(&transitions),
            vec![(C, O, Cause::Fleet)],
            "{semantics:?}"
        );
        // b never saw a bad answer; it fails fast at its next reading.
        assert_eq!(
            b.check(&store_b, &host, at(10)).admission,
            Admission::FastFail { retry_after: 2 }
        );
        // Calls still count in the local window, unjudged, and in the report.
        for ms in 20..30 {
            b.record(&store_b, &host, FAILED, at(ms)).unwrap();
        }
        assert_eq!(b.flush(&store_b, &host, at(30)), Ok(vec![]));
        let report = b.take_report(&store_b, &host, at(31)).unwrap().unwrap();
        assert_eq!(
            report.calls,
            Tally {
                calls: 10,
                slow: 0,
                failed: 10
            }
        );
        assert_eq!(b.take_report(&store_b, &host, at(32)), Ok(None));
        // Half-open for the fleet, one place granted to this gateway.
        let half_open = FleetAnswer {
            status: Status::HalfOpen,
            half_open_in_ms: 0,
            round: 1,
            places: 1,
        };
        let transitions = b.follow(&store_b, &host, half_open, at(2_000)).unwrap();
        assert_eq!(causes(&transitions), vec![(O, H, Cause::Fleet)]);
        let Admission::Probe(probe) = a.check(&store_a, &host, at(2_001)).admission else {
            panic!("{semantics:?}: no fleet probe")
        };
        assert_eq!(probe, Probe::Fleet { round: 1 });
        assert_eq!(
            b.check(&store_b, &host, at(2_002)).admission,
            Admission::FastFail { retry_after: 1 }
        );
        // The same grant answered to the other worker's report does not refill it.
        a.follow(
            &store_a,
            &host,
            FleetAnswer {
                places: 0,
                ..half_open
            },
            at(2_003),
        )
        .unwrap();
        assert_eq!(
            b.check(&store_b, &host, at(2_004)).admission,
            Admission::FastFail { retry_after: 1 }
        );
        // The probe's outcome goes into a's report, with the demand b saw.
        assert_eq!(
            a.probe_outcome(&store_a, &host, probe, GOOD, at(2_100)),
            Ok(vec![])
        );
        let report = a.take_report(&store_a, &host, at(2_200)).unwrap().unwrap();
        assert_eq!(report.probes.good, 1);
        assert_eq!(
            report.places,
            Some(PlaceClaim {
                round: 1,
                unused: 0,
                wanted: 2
            })
        );
        // No answer for FLEET_TRUST: the local breaker decides again, said once, and its
        // window (the failures counted while following) trips it at the next flush.
        let lost = a.check(&store_a, &host, at(2_003 + 3_000));
        assert_eq!(causes(&lost.transitions), vec![(H, C, Cause::FleetLost)]);
        assert_eq!(lost.admission, Admission::Call);
        assert_eq!(
            b.flush(&store_b, &host, at(5_004)).map(|t| causes(&t)),
            Ok(vec![(C, O, TRIP_FAILED)])
        );
    }
}

#[test]
fn a_fleet_probe_given_back_is_used_again_and_a_switch_overrides_the_fleet() {
    let host = MemoryHost::new(CasSemantics::Nginx);
    let store = Store::new();
    let mut worker = Handle::new(&global(), at(0));
    let half_open = FleetAnswer {
        status: Status::HalfOpen,
        half_open_in_ms: 0,
        round: 4,
        places: 1,
    };
    worker.follow(&store, &host, half_open, at(0)).unwrap();
    let Admission::Probe(probe) = worker.check(&store, &host, at(1)).admission else {
        panic!("no probe")
    };
    worker.give_back(&store, &host, probe, at(2)).unwrap();
    // A give-back of another round changes nothing.
    worker
        .give_back(&store, &host, Probe::Fleet { round: 3 }, at(3))
        .unwrap();
    assert_eq!(
        worker.check(&store, &host, at(4)).admission,
        Admission::Probe(probe)
    );
    assert_eq!(
        worker.check(&store, &host, at(5)).admission,
        Admission::FastFail { retry_after: 1 }
    );
    // The places it did not use go back with the next report.
    worker
        .follow(
            &store,
            &host,
            FleetAnswer {
                places: 1,
                ..half_open
            },
            at(6),
        )
        .unwrap();
    let report = worker.take_report(&store, &host, at(7)).unwrap().unwrap();
    assert_eq!(
        report.places,
        Some(PlaceClaim {
            round: 4,
            unused: 1,
            wanted: 1
        })
    );
    assert_eq!(
        worker.check(&store, &host, at(8)).admission,
        Admission::FastFail { retry_after: 1 }
    );
    // The operator's switch comes first.
    let mut closed = global();
    closed.force = Force::Closed;
    worker.reconfigure(&closed, at(10));
    let checked = worker.check(&store, &host, at(10));
    assert_eq!(
        (checked.admission, causes(&checked.transitions)),
        (Admission::Call, vec![(H, C, Cause::Forced(Force::Closed))])
    );
}

#[test]
fn the_fleets_answer_is_bounded_by_the_local_settings() {
    let mine = global().edition(at(0));
    let mut record = Record::new(&mine);
    record.follow(
        &mine,
        FleetAnswer {
            status: Status::Open,
            half_open_in_ms: u64::MAX,
            round: 0,
            places: u32::MAX,
        },
        at(0),
    );
    // Open for at most open_seconds (5 s).
    assert_eq!(
        record.check(&mine, at(0)).0,
        Admission::FastFail { retry_after: 5 }
    );
    record.follow(
        &mine,
        FleetAnswer {
            status: Status::HalfOpen,
            half_open_in_ms: 0,
            round: 1,
            places: u32::MAX,
        },
        at(1),
    );
    let probes = (0..10)
        .filter(|_| matches!(record.check(&mine, at(2)).0, Admission::Probe(_)))
        .count();
    assert_eq!(probes, 2, "at most half_open_calls places");
    // A worker that read its clock before another wrote the answer (here 200 ms before)
    // still follows it: the fleet is not taken for silent.
    assert_eq!(record.status(at(1)), H);
    let earlier = Instant::from_unix_nanos(T0 - 200 * MS);
    assert_eq!(record.status(earlier), H);
    // A trust much further ahead than FLEET_TRUST (a clock stepped back) is not trusted.
    let before = Instant::from_unix_nanos(T0 - 10_000 * MS);
    assert_eq!(record.status(before), C);
}

#[test]
fn racing_workers_count_every_call_and_share_exactly_the_probe_places() {
    for semantics in HOSTS {
        let host = Arc::new(MemoryHost::new(semantics));
        let workers = 4;
        let calls_each = 500u32;
        let barrier = Arc::new(Barrier::new(workers));
        let threads: Vec<_> = (0..workers)
            .map(|w| {
                let (host, barrier) = (Arc::clone(&host), Arc::clone(&barrier));
                std::thread::spawn(move || {
                    let store = Store::new();
                    let mut handle = Handle::new(&settings(), at(0));
                    barrier.wait();
                    for i in 0..calls_each {
                        let now = at(u64::from(i % 50));
                        handle.record(&store, &*host, GOOD, now).unwrap();
                        if i % 7 == w as u32 {
                            // Outraced 32 times in a row: the calls stay pending.
                            if let Err(error) = handle.flush(&store, &*host, now) {
                                assert_eq!(error, ChargeError::Contention);
                            }
                        }
                    }
                    // The last tick: a flush that loses the race is made at the next one.
                    let flushed = (0..100).any(|_| handle.flush(&store, &*host, at(100)).is_ok());
                    assert!(flushed);
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let record = stored(&host, &settings()).unwrap();
        assert_eq!(
            record.state.window_total(at(100)).calls,
            calls_each * workers as u32,
            "{semantics:?}"
        );

        // Open it (once the good calls have left the window), then race for the places
        // at half-open.
        let store = Store::new();
        let mut opener = Handle::new(&settings(), at(0));
        for ms in 0..4 {
            opener
                .record(&store, &*host, FAILED, at(20_000 + ms))
                .unwrap();
        }
        assert_eq!(opener.status(), O, "{semantics:?}");
        let barrier = Arc::new(Barrier::new(workers));
        let threads: Vec<_> = (0..workers)
            .map(|_| {
                let (host, barrier) = (Arc::clone(&host), Arc::clone(&barrier));
                std::thread::spawn(move || {
                    let store = Store::new();
                    let mut handle = Handle::new(&settings(), at(0));
                    barrier.wait();
                    let mut probes = 0;
                    let mut elapsed = 0;
                    for _ in 0..50 {
                        let checked = handle.check(&store, &*host, at(25_300));
                        assert!(!matches!(checked.trouble, Some(ChargeError::Host(_))));
                        probes += usize::from(matches!(checked.admission, Admission::Probe(_)));
                        elapsed += checked.transitions.len();
                    }
                    (probes, elapsed)
                })
            })
            .collect();
        let (probes, elapsed) = threads
            .into_iter()
            .map(|thread| thread.join().unwrap())
            .fold((0, 0), |(p, e), (probes, elapsed)| {
                (p + probes, e + elapsed)
            });
        assert_eq!((probes, elapsed), (2, 1), "{semantics:?}");
    }
}
