//! The state machine against a fake clock: scripts of operations with the exact answer,
//! transitions and status after each (every arrow of the diagram, the boundaries), and
//! properties over random sequences.

use super::*;
use crate::breaker::settings::{Ratio, Window};
use crate::breaker::{Cause, Outcome, ProbeTally, Status, Tally};
use proptest::prelude::*;
use std::num::{NonZeroU32, NonZeroU8};

/// The clock's origin: a whole number of every slice length used here.
const T0: u64 = 1_000_000 * 1_000_000_000;
const MS: u64 = 1_000_000;

fn at(ms: u64) -> Instant {
    Instant::from_unix_nanos(T0 + ms * MS)
}

fn ratio(ppm: u32) -> Option<Ratio> {
    Some(Ratio::from_ppm(ppm).unwrap())
}

/// min_calls 4, both ratios 0.5, a 10 s window (1 s slices), open 5 s, 2 places, probes
/// lost after 2 s.
fn params() -> Params {
    Params {
        slow_ratio: ratio(500_000),
        failure_ratio: ratio(500_000),
        min_calls: NonZeroU32::new(4).unwrap(),
        window: Window::from_secs(NonZeroU32::new(10).unwrap()),
        open_for: Nanos::from_secs(5),
        half_open_calls: NonZeroU8::new(2).unwrap(),
        probe_timeout: Nanos::from_secs(2),
        force: Force::Auto,
    }
}

fn edition(params: Params) -> Edition {
    Edition {
        params,
        installed: Instant::from_unix_nanos(T0),
    }
}

fn tally(calls: u32, slow: u32, failed: u32) -> Tally {
    Tally {
        calls,
        slow,
        failed,
    }
}

const GOOD: Outcome = Outcome::GOOD;
const SLOW: Outcome = Outcome {
    slow: true,
    failed: false,
};
const FAILED: Outcome = Outcome {
    slow: false,
    failed: true,
};

#[derive(Debug, Clone, Copy)]
enum Op {
    Check,
    Record(Tally),
    /// The outcome of the n-th ticket handed out in the script.
    Probe(usize, Outcome),
    GiveBack(usize),
    /// Run under other parameters (a reload), installed at the instant given in ms.
    Edition(Params, u64),
    Sync,
}

/// What a check answers, in short.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Call,
    Probe,
    FastFail(u64),
    /// Not a check.
    None,
}

use Answer::{Call, FastFail};
use Op::{Check, GiveBack, Record, Sync};

type Arrow = (Status, Status, Cause);

struct Row {
    at: u64,
    op: Op,
    answer: Answer,
    arrows: Vec<Arrow>,
    status: Status,
}

fn row(at: u64, op: Op, answer: Answer, arrows: &[Arrow], status: Status) -> Row {
    Row {
        at,
        op,
        answer,
        arrows: arrows.to_vec(),
        status,
    }
}

/// Runs a script from a fresh state under `params`; returns the state at its end.
fn run(params: Params, script: &[Row]) -> State {
    let mut mine = edition(params);
    let mut state = State::new(&mine);
    let mut tickets: Vec<Ticket> = Vec::new();
    for (line, row) in script.iter().enumerate() {
        let now = at(row.at);
        let (answer, transitions) = match row.op {
            Check => {
                let (admission, transitions) = state.check(&mine, now);
                let answer = match admission {
                    Admission::Call => Call,
                    Admission::Probe(ticket) => {
                        tickets.push(ticket);
                        Answer::Probe
                    }
                    Admission::FastFail { retry_after } => FastFail(retry_after),
                };
                (answer, transitions)
            }
            Record(tally) => (Answer::None, state.record(&mine, tally, now)),
            Op::Probe(n, outcome) => (
                Answer::None,
                state.probe_outcome(&mine, tickets[n], outcome, now),
            ),
            GiveBack(n) => (Answer::None, state.give_back(&mine, tickets[n], now)),
            Op::Edition(params, installed) => {
                mine = Edition {
                    params,
                    installed: at(installed),
                };
                (Answer::None, state.sync(&mine, now))
            }
            Sync => (Answer::None, state.sync(&mine, now)),
        };
        let arrows: Vec<Arrow> = transitions
            .iter()
            .map(|t| (t.from, t.to, t.cause))
            .collect();
        assert_eq!(
            (answer, arrows, state.status()),
            (row.answer, row.arrows.clone(), row.status),
            "line {line}: {:?} at {} ms",
            row.op,
            row.at
        );
    }
    state
}

use Status::{Closed as C, HalfOpen as H, Open as O};

const TRIP_FAILED: Cause = Cause::Tripped {
    slow: false,
    failed: true,
};
const TRIP_SLOW: Cause = Cause::Tripped {
    slow: true,
    failed: false,
};
const TRIP_BOTH: Cause = Cause::Tripped {
    slow: true,
    failed: true,
};

#[test]
fn closed_opens_at_exactly_min_calls_and_exactly_the_ratio() {
    run(
        params(),
        &[
            row(0, Check, Call, &[], C),
            // 3 calls, all failed: fewer than min_calls.
            row(0, Record(tally(3, 0, 3)), Answer::None, &[], C),
            row(100, Check, Call, &[], C),
            // The fourth call makes min_calls: 3 of 4 failed reaches the share.
            row(
                200,
                Record(tally(1, 0, 0)),
                Answer::None,
                &[(C, O, TRIP_FAILED)],
                O,
            ),
            row(200, Check, FastFail(5), &[], O),
        ],
    );
    // Exactly the share: 2 of 4.
    run(
        params(),
        &[
            row(0, Record(tally(2, 0, 0)), Answer::None, &[], C),
            row(
                0,
                Record(tally(2, 0, 2)),
                Answer::None,
                &[(C, O, TRIP_FAILED)],
                O,
            ),
        ],
    );
    // Just short of the share (499,999 of 999,999 calls), then exactly it.
    let short = Params {
        failure_ratio: ratio(500_000),
        slow_ratio: None,
        ..params()
    };
    run(
        short,
        &[
            row(0, Record(tally(999_999, 0, 499_999)), Answer::None, &[], C),
            row(0, Record(tally(0, 0, 0)), Answer::None, &[], C),
            row(
                0,
                Record(tally(1, 0, 1)),
                Answer::None,
                &[(C, O, TRIP_FAILED)],
                O,
            ),
        ],
    );
}

#[test]
fn the_slow_share_trips_too_and_the_figures_say_which() {
    let state = run(
        params(),
        &[row(
            0,
            Record(tally(4, 2, 1)),
            Answer::None,
            &[(C, O, TRIP_SLOW)],
            O,
        )],
    );
    assert_eq!(state.phase(), &Phase::Open { until: at(5_000) });
    let mut both = State::new(&edition(params()));
    let transitions = both.record(&edition(params()), tally(4, 3, 2), at(0));
    assert_eq!(
        transitions,
        vec![Transition {
            from: C,
            to: O,
            cause: Cause::Tripped {
                slow: true,
                failed: true
            },
            figures: tally(4, 3, 2),
        }]
    );
    // A breaker that judges failures only ignores slowness.
    let failures_only = Params {
        slow_ratio: None,
        ..params()
    };
    run(
        failures_only,
        &[row(0, Record(tally(10, 10, 0)), Answer::None, &[], C)],
    );
}

#[test]
fn the_window_slides_slice_by_slice() {
    // Slices of 1 s: calls at 0 ms leave the window at 10,000 ms exactly.
    run(
        params(),
        &[
            row(0, Record(tally(3, 0, 3)), Answer::None, &[], C),
            row(900, Record(tally(0, 0, 0)), Answer::None, &[], C),
            row(10_000, Record(tally(1, 0, 1)), Answer::None, &[], C),
        ],
    );
    run(
        params(),
        &[
            row(0, Record(tally(3, 0, 3)), Answer::None, &[], C),
            row(
                9_999,
                Record(tally(1, 0, 1)),
                Answer::None,
                &[(C, O, TRIP_FAILED)],
                O,
            ),
        ],
    );
    // Rolling over a slice boundary keeps both slices.
    run(
        params(),
        &[
            row(999, Record(tally(2, 0, 2)), Answer::None, &[], C),
            row(
                1_000,
                Record(tally(2, 0, 0)),
                Answer::None,
                &[(C, O, TRIP_FAILED)],
                O,
            ),
        ],
    );
    // Calls spread over the window, then the oldest leave: 4 failed calls in slices 0..3,
    // judged at 12,500 ms only slices 3.. count.
    let mut state = State::new(&edition(params()));
    let mine = edition(params());
    for second in 0..3 {
        state.record(&mine, tally(1, 0, 0), at(second * 1_000));
    }
    assert_eq!(state.window_total(at(2_000)), tally(3, 0, 0));
    assert_eq!(state.window_total(at(10_500)), tally(2, 0, 0));
    assert_eq!(state.window_total(at(12_000)), tally(0, 0, 0));
    assert_eq!(state.window_total(at(100_000)), tally(0, 0, 0));
}

#[test]
fn a_clock_behind_counts_in_the_head_slice() {
    let mine = edition(params());
    let mut state = State::new(&mine);
    state.record(&mine, tally(1, 0, 0), at(5_000));
    // Another writer 2 s behind: counted in the head slice, nothing lost.
    state.record(&mine, tally(1, 0, 0), at(3_000));
    assert_eq!(state.calls().head(), at(5_000).periods(Nanos::from_secs(1)));
    assert_eq!(state.window_total(at(5_000)), tally(2, 0, 0));
    assert_eq!(state.window_total(at(3_000)), tally(2, 0, 0));
    // A head a whole window ahead cannot come from such a step: garbage, cleared.
    let back = Instant::from_unix_nanos(T0 - 5_000 * MS);
    assert_eq!(state.window_total(back), tally(0, 0, 0));
    state.record(&mine, tally(1, 0, 0), back);
    assert_eq!(state.window_total(back), tally(1, 0, 0));
}

#[test]
fn open_goes_half_open_when_open_for_is_exactly_over() {
    run(
        params(),
        &[
            row(
                0,
                Record(tally(4, 0, 4)),
                Answer::None,
                &[(C, O, TRIP_FAILED)],
                O,
            ),
            row(1, Check, FastFail(5), &[], O),
            row(4_000, Check, FastFail(1), &[], O),
            row(4_999, Check, FastFail(1), &[], O),
            row(4_999, Sync, Answer::None, &[], O),
            row(5_000, Sync, Answer::None, &[(O, H, Cause::Elapsed)], H),
            row(5_000, Check, Answer::Probe, &[], H),
        ],
    );
}

/// A script prefix: trips at 0, half-open at 5,000 ms.
fn tripped_then_half_open() -> Vec<Row> {
    vec![
        row(
            0,
            Record(tally(4, 0, 4)),
            Answer::None,
            &[(C, O, TRIP_FAILED)],
            O,
        ),
        row(5_000, Sync, Answer::None, &[(O, H, Cause::Elapsed)], H),
    ]
}

fn script(prefix: Vec<Row>, rest: Vec<Row>) -> Vec<Row> {
    prefix.into_iter().chain(rest).collect()
}

#[test]
fn half_open_admits_exactly_its_places_and_every_good_probe_closes_it() {
    let state = run(
        params(),
        &script(
            tripped_then_half_open(),
            vec![
                row(5_000, Check, Answer::Probe, &[], H),
                row(5_001, Check, Answer::Probe, &[], H),
                // Both places taken: the rest fail fast.
                row(5_002, Check, FastFail(1), &[], H),
                row(5_100, Op::Probe(0, GOOD), Answer::None, &[], H),
                row(5_101, Check, FastFail(1), &[], H),
                row(
                    5_200,
                    Op::Probe(1, GOOD),
                    Answer::None,
                    &[(H, C, Cause::Recovered)],
                    C,
                ),
                row(5_201, Check, Call, &[], C),
            ],
        ),
    );
    // The window was cleared on closing.
    assert_eq!(state.window_total(at(5_201)), Tally::ZERO);
    // In turn: one place at a time.
    run(
        params(),
        &script(
            tripped_then_half_open(),
            vec![
                row(5_000, Check, Answer::Probe, &[], H),
                row(5_100, Op::Probe(0, GOOD), Answer::None, &[], H),
                row(5_200, Check, Answer::Probe, &[], H),
                row(
                    5_300,
                    Op::Probe(1, GOOD),
                    Answer::None,
                    &[(H, C, Cause::Recovered)],
                    C,
                ),
            ],
        ),
    );
}

#[test]
fn one_bad_probe_opens_it_again_and_late_answers_change_nothing() {
    let state = run(
        params(),
        &script(
            tripped_then_half_open(),
            vec![
                row(5_000, Check, Answer::Probe, &[], H),
                row(5_001, Check, Answer::Probe, &[], H),
                row(5_100, Op::Probe(0, GOOD), Answer::None, &[], H),
                row(
                    5_200,
                    Op::Probe(1, SLOW),
                    Answer::None,
                    &[(H, O, Cause::ProbeFailed)],
                    O,
                ),
                row(5_200, Check, FastFail(5), &[], O),
                // The round is over: a second answer for its tickets changes nothing.
                row(5_300, Op::Probe(1, GOOD), Answer::None, &[], O),
                row(10_200, Check, Answer::Probe, &[(O, H, Cause::Elapsed)], H),
                // Tickets of the earlier round do not settle the new round's places.
                row(10_201, Op::Probe(0, FAILED), Answer::None, &[], H),
                row(10_202, Op::Probe(1, GOOD), Answer::None, &[], H),
                row(10_203, GiveBack(1), Answer::None, &[], H),
                row(
                    10_300,
                    Op::Probe(2, FAILED),
                    Answer::None,
                    &[(H, O, Cause::ProbeFailed)],
                    O,
                ),
            ],
        ),
    );
    assert_eq!(state.phase(), &Phase::Open { until: at(15_300) });
}

#[test]
fn a_failed_probe_reports_the_rounds_figures() {
    let mine = edition(params());
    let mut state = State::new(&mine);
    state.record(&mine, tally(4, 0, 4), at(0));
    let Admission::Probe(first) = state.check(&mine, at(5_000)).0 else {
        panic!("not half-open")
    };
    let Admission::Probe(second) = state.check(&mine, at(5_000)).0 else {
        panic!("no second place")
    };
    assert_ne!(first.place, second.place);
    state.probe_outcome(&mine, first, GOOD, at(5_001));
    let transitions = state.probe_outcome(
        &mine,
        second,
        Outcome {
            slow: true,
            failed: true,
        },
        at(5_002),
    );
    assert_eq!(transitions[0].figures, tally(2, 1, 1));
    assert_eq!(
        transitions[0].to_string(),
        "half-open -> open (a probe was slow or failed): 2 calls, 50.0% slow, 50.0% failed"
    );
}

#[test]
fn a_probe_given_back_frees_its_place_once() {
    run(
        params(),
        &script(
            tripped_then_half_open(),
            vec![
                row(5_000, Check, Answer::Probe, &[], H),
                row(5_001, Check, Answer::Probe, &[], H),
                row(5_002, Check, FastFail(1), &[], H),
                // A rule rejected the first probe: its place is free, not an outcome.
                row(5_003, GiveBack(0), Answer::None, &[], H),
                row(5_004, Check, Answer::Probe, &[], H),
                // Given back twice, or its outcome after all: the place is another's now.
                row(5_005, GiveBack(0), Answer::None, &[], H),
                row(5_006, Op::Probe(0, FAILED), Answer::None, &[], H),
                row(5_007, Check, FastFail(1), &[], H),
                row(5_100, Op::Probe(1, GOOD), Answer::None, &[], H),
                row(
                    5_200,
                    Op::Probe(2, GOOD),
                    Answer::None,
                    &[(H, C, Cause::Recovered)],
                    C,
                ),
            ],
        ),
    );
}

#[test]
fn a_probe_whose_outcome_never_comes_counts_as_failed_after_probe_timeout() {
    run(
        params(),
        &script(
            tripped_then_half_open(),
            vec![
                row(5_000, Check, Answer::Probe, &[], H),
                row(5_500, Check, Answer::Probe, &[], H),
                row(5_600, Op::Probe(1, GOOD), Answer::None, &[], H),
                row(6_999, Check, FastFail(1), &[], H),
                // Exactly probe_timeout (2 s) after the first was taken.
                row(7_000, Check, FastFail(5), &[(H, O, Cause::ProbeLost)], O),
                row(7_001, Op::Probe(0, GOOD), Answer::None, &[], O),
                row(12_000, Check, Answer::Probe, &[(O, H, Cause::Elapsed)], H),
            ],
        ),
    );
    // Its figures: the good one and the lost one.
    let mine = edition(params());
    let mut state = State::new(&mine);
    state.record(&mine, tally(4, 0, 4), at(0));
    state.check(&mine, at(5_000));
    let transitions = state.sync(&mine, at(7_000));
    assert_eq!(transitions[0].figures, tally(1, 0, 1));
}

#[test]
fn calls_answered_while_open_or_half_open_are_not_counted() {
    let state = run(
        params(),
        &script(
            tripped_then_half_open(),
            vec![
                row(5_000, Record(tally(50, 50, 50)), Answer::None, &[], H),
                row(5_001, Check, Answer::Probe, &[], H),
                row(5_002, Check, Answer::Probe, &[], H),
                row(5_003, Op::Probe(0, GOOD), Answer::None, &[], H),
                row(
                    5_004,
                    Op::Probe(1, GOOD),
                    Answer::None,
                    &[(H, C, Cause::Recovered)],
                    C,
                ),
                row(5_005, Record(tally(3, 0, 3)), Answer::None, &[], C),
            ],
        ),
    );
    assert_eq!(state.window_total(at(5_005)), tally(3, 0, 3));
}

#[test]
fn force_open_fails_fast_and_going_back_to_auto_goes_on_from_the_window() {
    let forced = Params {
        force: Force::Open,
        ..params()
    };
    run(
        params(),
        &[
            row(0, Record(tally(3, 0, 3)), Answer::None, &[], C),
            row(
                100,
                Op::Edition(forced, 100),
                Answer::None,
                &[(C, O, Cause::Forced(Force::Open))],
                O,
            ),
            // Retry-After: open_seconds.
            row(200, Check, FastFail(5), &[], O),
            // Calls still in flight are counted; a forced breaker never trips itself.
            row(300, Record(tally(10, 10, 10)), Answer::None, &[], O),
            row(60_000, Check, FastFail(5), &[], O),
            row(60_100, Record(tally(3, 0, 3)), Answer::None, &[], O),
            row(
                60_200,
                Op::Edition(params(), 60_200),
                Answer::None,
                &[(O, C, Cause::Forced(Force::Auto))],
                C,
            ),
            // Back to auto: not a stale opening, the counted calls go on.
            row(60_300, Check, Call, &[], C),
            row(
                60_400,
                Record(tally(1, 0, 1)),
                Answer::None,
                &[(C, O, TRIP_FAILED)],
                O,
            ),
        ],
    );
}

#[test]
fn force_closed_never_trips_and_counts_and_lifts_an_opening() {
    let forced = Params {
        force: Force::Closed,
        ..params()
    };
    let state = run(
        params(),
        &[
            row(
                0,
                Record(tally(4, 0, 4)),
                Answer::None,
                &[(C, O, TRIP_FAILED)],
                O,
            ),
            row(
                100,
                Op::Edition(forced, 100),
                Answer::None,
                &[(O, C, Cause::Forced(Force::Closed))],
                C,
            ),
            row(200, Check, Call, &[], C),
            row(300, Record(tally(100, 100, 100)), Answer::None, &[], C),
            row(5_000, Check, Call, &[], C),
            // Back to auto: the same status, no transition; the next calls are judged on
            // the window, which is full of failures.
            row(5_100, Op::Edition(params(), 5_100), Answer::None, &[], C),
            row(
                5_200,
                Record(tally(1, 0, 0)),
                Answer::None,
                &[(C, O, TRIP_BOTH)],
                O,
            ),
        ],
    );
    assert_eq!(state.window_total(at(5_200)), tally(105, 100, 104));
}

#[test]
fn an_older_edition_does_not_undo_a_newer_one() {
    let forced = Params {
        force: Force::Open,
        ..params()
    };
    run(
        params(),
        &[
            row(
                100,
                Op::Edition(forced, 100),
                Answer::None,
                &[(C, O, Cause::Forced(Force::Open))],
                O,
            ),
            // A worker still on the document installed before: the state keeps the switch.
            row(110, Op::Edition(params(), 0), Answer::None, &[], O),
            row(120, Check, FastFail(5), &[], O),
            // ... unless the stored instant is in the future: a clock stepped back.
            row(
                50,
                Op::Edition(params(), 40),
                Answer::None,
                &[(O, C, Cause::Forced(Force::Auto))],
                C,
            ),
        ],
    );
}

#[test]
fn a_reload_keeps_what_it_can() {
    let mine = edition(params());
    // A new window length clears the window; new thresholds judge the next calls.
    let mut state = State::new(&mine);
    state.record(&mine, tally(3, 0, 1), at(0));
    let lower = Edition {
        params: Params {
            failure_ratio: ratio(300_000),
            ..params()
        },
        installed: at(1),
    };
    assert_eq!(state.sync(&lower, at(1)), vec![]);
    assert_eq!(state.window_total(at(1)), tally(3, 0, 1));
    let longer = Edition {
        params: Params {
            window: Window::from_secs(NonZeroU32::new(60).unwrap()),
            ..lower.params
        },
        installed: at(2),
    };
    state.sync(&longer, at(2));
    assert_eq!(state.window_total(at(2)), Tally::ZERO);

    // A shorter open_for ends an opening no later than the new length from the reload.
    let mut state = State::new(&mine);
    state.record(&mine, tally(4, 0, 4), at(0));
    let shorter = Edition {
        params: Params {
            open_for: Nanos::from_secs(1),
            ..params()
        },
        installed: at(1_000),
    };
    state.sync(&shorter, at(1_000));
    assert_eq!(state.phase(), &Phase::Open { until: at(2_000) });
    // A longer one keeps the end announced.
    let longer = Edition {
        params: Params {
            open_for: Nanos::from_secs(60),
            ..params()
        },
        installed: at(1_500),
    };
    state.sync(&longer, at(1_500));
    assert_eq!(state.phase(), &Phase::Open { until: at(2_000) });

    // Other half_open_calls during a round: the round starts again, its tickets void.
    let mut state = State::new(&mine);
    state.record(&mine, tally(4, 0, 4), at(0));
    let Admission::Probe(ticket) = state.check(&mine, at(5_000)).0 else {
        panic!("not half-open")
    };
    let three = Edition {
        params: Params {
            half_open_calls: NonZeroU8::new(3).unwrap(),
            ..params()
        },
        installed: at(5_001),
    };
    assert_eq!(state.sync(&three, at(5_001)), vec![]);
    let Phase::HalfOpen { round, places } = state.phase() else {
        panic!("not half-open")
    };
    assert_ne!(*round, ticket.round);
    assert_eq!(places, &vec![Place::Free; 3]);
    assert_eq!(
        state.probe_outcome(&three, ticket, FAILED, at(5_002)),
        vec![]
    );
    assert_eq!(state.status(), H);
}

#[test]
fn a_clock_stepped_back_does_not_keep_it_open() {
    let mine = edition(params());
    let mut state = State::new(&mine);
    state.record(&mine, tally(4, 0, 4), at(60_000));
    // A minute back: the opening's end is 65 s away, more than twice open_for: over.
    assert_eq!(
        state.sync(&mine, at(0)),
        vec![Transition {
            from: O,
            to: H,
            cause: Cause::Elapsed,
            figures: Tally::ZERO
        }]
    );
    // A small step back keeps it open, at most twice open_for.
    let mut state = State::new(&mine);
    state.record(&mine, tally(4, 0, 4), at(60_000));
    assert_eq!(state.sync(&mine, at(59_000)), vec![]);
    assert_eq!(
        state.check(&mine, at(59_000)).0,
        Admission::FastFail { retry_after: 6 }
    );
    // A probe taken "in the future" by more than probe_timeout is lost.
    let mut state = State::new(&mine);
    state.record(&mine, tally(4, 0, 4), at(60_000));
    state.check(&mine, at(65_000));
    let transitions = state.sync(&mine, at(62_000));
    assert_eq!(transitions[0].cause, Cause::ProbeLost);
}

#[test]
fn the_quota_service_grants_settles_and_releases_places_by_count() {
    let mine = edition(params());
    let mut state = State::new(&mine);
    state.record(&mine, tally(4, 0, 4), at(0));
    assert_eq!(
        state.grant(&mine, 5, at(1_000)).0,
        0,
        "open: nothing to grant"
    );
    let (granted, transitions) = state.grant(&mine, 5, at(5_000));
    assert_eq!((granted, transitions.len()), (2, 1));
    assert_eq!(state.grant(&mine, 1, at(5_001)).0, 0);
    // A gateway did not use one: it is free again, and granted again.
    state.release(&mine, 1, at(5_002));
    assert_eq!(state.grant(&mine, 1, at(5_003)).0, 1);
    let good = ProbeTally {
        good: 1,
        bad: Tally::ZERO,
    };
    assert_eq!(state.settle(&mine, good, at(5_004)), vec![]);
    let transitions = state.settle(&mine, good, at(5_005));
    assert_eq!(transitions[0].cause, Cause::Recovered);
    assert_eq!(state.status(), C);
    // One bad report reopens a round.
    state.record(&mine, tally(4, 0, 4), at(6_000));
    state.grant(&mine, 2, at(11_000));
    let bad = ProbeTally {
        good: 1,
        bad: tally(1, 1, 0),
    };
    let transitions = state.settle(&mine, bad, at(11_001));
    assert_eq!(
        (transitions[0].cause, transitions[0].figures),
        (Cause::ProbeFailed, tally(2, 1, 0))
    );
}

#[test]
fn a_state_whose_parts_contradict_each_other_is_refused() {
    let forced = edition(Params {
        force: Force::Open,
        ..params()
    });
    let open = Phase::Open { until: at(1) };
    assert!(State::from_parts(forced, open.clone(), CallWindow::empty()).is_none());
    assert!(State::from_parts(edition(params()), open, CallWindow::empty()).is_some());
    let three = Phase::HalfOpen {
        round: at(1),
        places: vec![Place::Free; 3],
    };
    assert!(State::from_parts(edition(params()), three, CallWindow::empty()).is_none());
}

// Properties over random sequences.

#[derive(Debug, Clone)]
enum Random {
    Wait(u64),
    Check,
    Record(Tally),
    Probe(usize, Outcome),
    GiveBack(usize),
    Force(Force),
}

fn outcome() -> impl Strategy<Value = Outcome> {
    (any::<bool>(), any::<bool>()).prop_map(|(slow, failed)| Outcome { slow, failed })
}

fn random_op(bad_calls: bool) -> impl Strategy<Value = Random> {
    let tally = (0..30u32, 0..30u32, 0..30u32).prop_map(move |(calls, slow, failed)| {
        if bad_calls {
            tally(calls, slow.min(calls), failed.min(calls))
        } else {
            tally(calls, 0, 0)
        }
    });
    let outcome = if bad_calls {
        outcome().boxed()
    } else {
        Just(GOOD).boxed()
    };
    prop_oneof![
        4 => (0..4_000u64).prop_map(Random::Wait),
        6 => Just(Random::Check),
        4 => tally.prop_map(Random::Record),
        4 => (0..8usize, outcome).prop_map(|(n, o)| Random::Probe(n, o)),
        2 => (0..8usize).prop_map(Random::GiveBack),
        1 => prop_oneof![Just(Force::Auto), Just(Force::Open), Just(Force::Closed)]
            .prop_map(Random::Force),
    ]
}

fn random_params() -> impl Strategy<Value = Params> {
    (
        1..30u32,
        1..=1_000_000u32,
        1..=1_000_000u32,
        1..5u32,
        // open_for is never zero (Params::open_for).
        1..8u64,
        1..5u8,
    )
        .prop_map(|(min_calls, slow, failed, window, open, places)| Params {
            slow_ratio: ratio(slow),
            failure_ratio: ratio(failed),
            min_calls: NonZeroU32::new(min_calls).unwrap(),
            window: Window::from_secs(NonZeroU32::new(window).unwrap()),
            open_for: Nanos::from_secs(open),
            half_open_calls: NonZeroU8::new(places).unwrap(),
            probe_timeout: Nanos::from_secs(2),
            force: Force::Auto,
        })
}

/// Runs a random sequence, checking after every step: live tickets hold distinct places
/// and never more than `half_open_calls`; every trip had at least `min_calls` calls and a
/// share reached; transitions chain from the status before to the status after; a fast
/// failure's Retry-After is at least 1; the state survives its encoding. Returns whether
/// it ever opened.
fn exercise(params: Params, ops: &[Random]) -> Result<bool, TestCaseError> {
    let mut mine = edition(params);
    let mut state = State::new(&mine);
    let mut now = at(0);
    let mut tickets: Vec<Ticket> = Vec::new();
    // Tickets whose holder is done with them (an outcome sent, the place given back).
    let mut done: Vec<bool> = Vec::new();
    let mut opened = false;
    for (step, op) in ops.iter().enumerate() {
        let before = state.status();
        let transitions = match op {
            Random::Wait(ms) => {
                now += Nanos::from_millis(*ms);
                state.sync(&mine, now)
            }
            Random::Check => {
                let (admission, transitions) = state.check(&mine, now);
                match admission {
                    Admission::Probe(ticket) => {
                        tickets.push(ticket);
                        done.push(false);
                    }
                    Admission::FastFail { retry_after } => prop_assert!(retry_after >= 1),
                    Admission::Call => prop_assert_ne!(state.status(), Status::Open),
                }
                transitions
            }
            Random::Record(tally) => {
                let window = state.window_total(now);
                let counted = if state.phase() == &Phase::Closed {
                    window.merge(*tally)
                } else {
                    window
                };
                let transitions = state.record(&mine, *tally, now);
                for t in &transitions {
                    if matches!(t.cause, Cause::Tripped { .. }) {
                        prop_assert!(t.figures.calls >= mine.params.min_calls.get());
                        prop_assert_eq!(t.figures, counted);
                        let (slow, failed) = mine.params.reached(t.figures);
                        prop_assert!(slow || failed);
                    }
                }
                transitions
            }
            // A holder sends one outcome or gives its place back, once.
            Random::Probe(n, outcome) => match tickets.get(*n).copied().filter(|_| !done[*n]) {
                Some(ticket) => {
                    done[*n] = true;
                    state.probe_outcome(&mine, ticket, *outcome, now)
                }
                None => state.sync(&mine, now),
            },
            Random::GiveBack(n) => match tickets.get(*n).copied().filter(|_| !done[*n]) {
                Some(ticket) => {
                    done[*n] = true;
                    state.give_back(&mine, ticket, now)
                }
                None => state.sync(&mine, now),
            },
            Random::Force(force) => {
                mine = Edition {
                    params: Params {
                        force: *force,
                        ..mine.params
                    },
                    installed: now,
                };
                state.sync(&mine, now)
            }
        };
        let mut status = before;
        for t in &transitions {
            prop_assert_eq!(t.from, status, "step {}: {:?}", step, transitions);
            prop_assert_ne!(t.from, t.to);
            status = t.to;
            opened |= t.to == Status::Open && t.cause != Cause::Forced(Force::Open);
        }
        prop_assert_eq!(status, state.status(), "step {}", step);
        // Live tickets: those whose place the state still holds for them and whose holder
        // still has them (a place given back may be taken again at the same instant, by
        // an equal ticket).
        if let Phase::HalfOpen { round, places } = state.phase() {
            let live: Vec<u8> = tickets
                .iter()
                .zip(&done)
                .filter(|(_, done)| !**done)
                .map(|(t, _)| t)
                .filter(|t| t.round == *round)
                .filter(|t| places.get(usize::from(t.place)) == Some(&Place::Out(t.taken)))
                .map(|t| t.place)
                .collect();
            let mut distinct = live.clone();
            distinct.sort_unstable();
            distinct.dedup();
            prop_assert_eq!(distinct.len(), live.len());
            prop_assert!(live.len() <= usize::from(mine.params.half_open_calls.get()));
        }
        let record = crate::breaker::Record {
            state: state.clone(),
            source: crate::breaker::Source::Local,
        };
        prop_assert_eq!(crate::breaker::Record::decode(&record.encode()), Ok(record));
    }
    Ok(opened)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_sequences_keep_every_invariant(
        params in random_params(),
        ops in proptest::collection::vec(random_op(true), 1..120),
    ) {
        exercise(params, &ops)?;
    }

    #[test]
    fn a_window_of_only_good_calls_never_opens(
        params in random_params(),
        ops in proptest::collection::vec(random_op(false), 1..120),
    ) {
        prop_assert!(!exercise(params, &ops)?);
    }

    #[test]
    fn closed_never_opens_below_min_calls(
        params in random_params(),
        batches in proptest::collection::vec((0..3u32, 0..2_000u64), 1..60),
    ) {
        // Every call failed and slow, but the window never holds min_calls of them.
        let mine = edition(params);
        let mut state = State::new(&mine);
        let mut now = at(0);
        for (calls, wait) in batches {
            now += Nanos::from_millis(wait);
            let window = state.window_total(now);
            let below = window.calls + calls < params.min_calls.get();
            let transitions = state.record(&mine, tally(calls, calls, calls), now);
            if below {
                prop_assert!(transitions.is_empty());
                prop_assert_eq!(state.status(), Status::Closed);
            } else if !transitions.is_empty() {
                break;
            }
        }
    }
}
