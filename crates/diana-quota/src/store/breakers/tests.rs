#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use super::*;
use diana_core::breaker::{Cause, PlaceClaim, ProbeTally, State, Status, Tally};
use diana_core::report::FleetParams;

const T0: u64 = 1_700_000_000_000_000_000;

fn at(ms: u64) -> Instant {
    Instant::from_unix_nanos(T0 + ms * 1_000_000)
}

fn params() -> FleetParams {
    FleetParams {
        slow_ratio_ppm: 0,
        failure_ratio_ppm: 500_000,
        min_calls: 20,
        window_seconds: 10,
        open_ms: 1_000,
        half_open_calls: 3,
        probe_timeout_ms: 2_000,
    }
}

fn tally(calls: u32, failed: u32) -> Tally {
    Tally {
        calls,
        slow: 0,
        failed,
    }
}

/// A report's breaker: `calls` and `failed` calls, `good` and `bad` probes, `unused`
/// places withdrawn from `round` and `wanted` more.
struct Line {
    calls: u32,
    failed: u32,
    good: u32,
    bad: u32,
    claim: Option<(u64, u32, u32)>,
}

const EMPTY: Line = Line {
    calls: 0,
    failed: 0,
    good: 0,
    bad: 0,
    claim: None,
};

fn calls(calls: u32, failed: u32) -> Line {
    Line {
        calls,
        failed,
        ..EMPTY
    }
}

fn probes(good: u32, bad: u32) -> Line {
    Line { good, bad, ..EMPTY }
}

fn claim(round: u64, unused: u32, wanted: u32) -> Line {
    Line {
        claim: Some((round, unused, wanted)),
        ..EMPTY
    }
}

fn call(line: &Line) -> BreakerCall {
    BreakerCall {
        key: "payments-1".into(),
        params: params(),
        calls: tally(line.calls, line.failed),
        probes: ProbeTally {
            good: line.good,
            bad: tally(line.bad, line.bad),
        },
        places: line.claim.map(|(round, unused, wanted)| PlaceClaim {
            round,
            unused,
            wanted,
        }),
    }
}

fn one(store: &MemoryBreakers, line: &Line, ms: u64) -> Decided {
    let mut decided = store.report_at(&[call(line)], at(ms)).unwrap();
    assert_eq!(decided.len(), 1);
    decided.remove(0)
}

fn causes(decided: &Decided) -> Vec<(Status, Status, Cause)> {
    decided
        .transitions
        .iter()
        .map(|t| (t.from, t.to, t.cause))
        .collect()
}

use Status::{Closed as C, HalfOpen as H, Open as O};

#[test]
fn the_fleet_opens_on_combined_evidence_probes_with_shared_places_and_recovers() {
    let store = MemoryBreakers::new(Arc::new(SystemClockless), 100);
    // Gateway A: 12 failed calls, too few alone.
    let a = one(&store, &calls(12, 12), 0);
    assert_eq!((a.answer.status, a.window), (C, tally(12, 12)));
    // Gateway B never saw a bad call; its 10 good ones make 22 with 12 failed: open.
    let b = one(&store, &calls(10, 0), 100);
    assert_eq!(
        (b.answer.status, b.answer.half_open_in_ms),
        (O, 1_000),
        "{b:?}"
    );
    assert_eq!(
        causes(&b),
        vec![(
            C,
            O,
            Cause::Tripped {
                slow: false,
                failed: true
            }
        )]
    );
    assert_eq!(b.transitions[0].figures, tally(22, 12));
    // A's next report: open too, 900 ms to go; its calls while open are not counted.
    let a = one(&store, &calls(5, 5), 200);
    assert_eq!((a.answer.status, a.answer.half_open_in_ms), (O, 900));
    assert!(a.transitions.is_empty());
    // Half-open once open_ms is over; no place without demand.
    let a = one(&store, &EMPTY, 1_100);
    assert_eq!((a.answer.status, a.answer.places), (H, 0));
    assert_eq!(causes(&a), vec![(O, H, Cause::Elapsed)]);
    let round = a.answer.round;
    assert_eq!(round, round_id(at(1_100)));
    let want = |unused, wanted| claim(round, unused, wanted);
    // Three places for the fleet: A gets 2, B 1 of the 3 it wants, nobody more.
    let places: Vec<u32> = [
        (want(0, 2), 1_200),
        (want(0, 3), 1_300),
        (want(0, 3), 1_400),
    ]
    .iter()
    .map(|(line, ms)| one(&store, line, *ms).answer.places)
    .collect();
    assert_eq!(places, vec![2, 1, 0]);
    // A withdraws one it did not use: B gets it; a claim on another round frees nothing.
    assert_eq!(one(&store, &want(1, 0), 1_450).answer.places, 0);
    assert_eq!(one(&store, &want(0, 1), 1_460).answer.places, 1);
    let stale = claim(round - 1, 3, 1);
    assert_eq!(one(&store, &stale, 1_470).answer.places, 0);
    // One bad probe reopens.
    let b = one(&store, &probes(0, 1), 1_500);
    assert_eq!((b.answer.status, b.answer.half_open_in_ms), (O, 1_000));
    assert_eq!(causes(&b), vec![(H, O, Cause::ProbeFailed)]);
    // Next round: three good probes close it, the window cleared.
    let a = one(&store, &EMPTY, 2_500);
    assert_eq!(a.answer.status, H);
    let round = a.answer.round;
    assert_ne!(round, round_id(at(1_100)));
    let a = one(&store, &claim(round, 0, 3), 2_600);
    assert_eq!(a.answer.places, 3);
    let a = one(&store, &probes(2, 0), 2_700);
    assert_eq!(a.answer.status, H);
    let a = one(&store, &probes(1, 0), 2_800);
    assert_eq!((a.answer.status, a.window), (C, Tally::ZERO));
    assert_eq!(causes(&a), vec![(H, C, Cause::Recovered)]);
    assert_eq!(store.len(), 1);
}

#[test]
fn a_place_held_past_the_probe_timeout_reopens_and_other_parameters_are_another_state() {
    let store = MemoryBreakers::new(Arc::new(SystemClockless), 100);
    one(&store, &calls(20, 20), 0);
    let half_open = one(&store, &EMPTY, 1_000);
    let claim = claim(half_open.answer.round, 0, 1);
    assert_eq!(one(&store, &claim, 1_000).answer.places, 1);
    // No outcome within probe_timeout_ms (2 s): a lost probe.
    let lost = one(&store, &EMPTY, 3_000);
    assert_eq!(causes(&lost), vec![(H, O, Cause::ProbeLost)]);
    // The same key with other parameters: a state of its own, closed.
    let other = BreakerCall {
        params: FleetParams {
            min_calls: 50,
            ..params()
        },
        ..call(&calls(20, 20))
    };
    let decided = store.report_at(&[other], at(3_001)).unwrap();
    assert_eq!(decided[0].answer.status, C);
    assert_eq!(decided[0].window, tally(20, 20));
    assert_eq!(one(&store, &EMPTY, 3_002).answer.status, O);
    assert_eq!(store.len(), 2);
}

#[test]
fn the_table_is_bounded_and_idle_states_make_room() {
    let store = MemoryBreakers::new(Arc::new(SystemClockless), 2);
    let keyed = |key: &str| BreakerCall {
        key: key.into(),
        ..call(&calls(1, 0))
    };
    store.report_at(&[keyed("a"), keyed("b")], at(0)).unwrap();
    // A third state finds no room: refused, nothing applied.
    let refused = store.report_at(&[keyed("a"), keyed("c")], at(1));
    assert!(matches!(refused, Err(StoreError::Full(_))), "{refused:?}");
    let a = store.report_at(&[keyed("a")], at(2)).unwrap();
    assert_eq!(
        a[0].window,
        tally(2, 0),
        "the refused report counted nothing"
    );
    // Once "b" is idle (no report for idle_after), its place is taken.
    let idle = idle_after(&params()).whole_millis();
    assert_eq!(idle, 10_000 + 1_000 + 2_000 + 60_000);
    store.report_at(&[keyed("a")], at(idle)).unwrap();
    assert!(store.report_at(&[keyed("c")], at(idle + 1)).is_ok());
    assert_eq!((store.len(), store.evicted()), (2, 1));
    // An idle state is forgotten even when not swept: a half-open round nobody asked a
    // place of would otherwise stay half-open for ever.
    let store = MemoryBreakers::new(Arc::new(SystemClockless), 100);
    one(&store, &calls(20, 20), 0);
    assert_eq!(one(&store, &EMPTY, 1_000).answer.status, H);
    assert_eq!(one(&store, &EMPTY, 1_000 + idle - 1).answer.status, H);
    let later = 1_000 + 2 * idle;
    assert_eq!(one(&store, &EMPTY, later).answer.status, C);
}

#[test]
fn stored_bytes_that_are_not_this_state_read_as_fresh() {
    let fresh = State::new(&params().edition().unwrap());
    let other = FleetParams {
        open_ms: 5_000,
        ..params()
    };
    let mut opened = State::new(&other.edition().unwrap());
    let tripping = BreakerCall {
        params: other,
        ..call(&calls(20, 20))
    };
    apply(&mut opened, &tripping, at(0)).unwrap();
    assert_eq!(opened.status(), O);
    // What a state costs in Redis: 181 bytes open or closed, 9 more per half-open place.
    assert_eq!(encode(&opened).len(), 181);
    let cases: [(Option<&[u8]>, &str); 4] = [
        (None, "missing"),
        (Some(b"garbage"), "garbage"),
        (Some(&[]), "empty"),
        (Some(&encode(&opened)), "another parameters' state"),
    ];
    for (bytes, case) in cases {
        assert_eq!(decode(bytes, &params()), Some(fresh.clone()), "{case}");
    }
    let mut state = fresh.clone();
    apply(&mut state, &call(&calls(3, 0)), at(0)).unwrap();
    assert_eq!(decode(Some(&encode(&state)), &params()), Some(state));
    let broken = FleetParams {
        half_open_calls: 0,
        ..params()
    };
    assert_eq!(decode(None, &broken), None);
}

/// The tests pass every instant in; a clock that is read is a mistake.
struct SystemClockless;

impl Clock for SystemClockless {
    fn now(&self) -> Instant {
        panic!("the tests pass the time in")
    }
}
