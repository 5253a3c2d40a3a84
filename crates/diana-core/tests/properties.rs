#![cfg(test)]
//! Property-based tests of the algorithms' invariants, through the public API only.
//!
//! Every algorithm of [`REGISTRY`] gets random limits and random sequences of requests
//! (random need and want), debts, releases (right after a grant, or later) and probes, on
//! a random clock that also steps backwards (by less than one unit: the documented range
//! a clock step is handled exactly; further back is "garbage" state, tested apart). The
//! checks are the algorithms' definitions, not their code:
//!
//! - `W`: per epoch-aligned window, never more than `rpu` counted (requests plus debts),
//!   and every decision equals that of a model that keeps those counts;
//! - `SW`: the same over every window of `slices` consecutive slices;
//! - `TB`: over any interval `[a, b]` of admissions, at most `burst + rpu·(b − a)/unit`;
//! - `LB`: departures (`now + delay`, then one interval apart for a lease) at least
//!   `unit/rpu` apart, and never more than `burst + 1` of them at or after `now`;
//! - for all: a rejection changes no state; a release right after a grant makes a probe
//!   answer as before it; an idle state answers like a fresh one; nothing panics.
//!
//! `PROPTEST_CASES` raises the case count (the defaults keep `cargo test` fast).
//! The engine's all-or-nothing properties are in `engine_properties.rs`.

mod common;

use common::config;
use diana_core::algo::{Algorithm, Limit, Mark, Verdict, REGISTRY};
use diana_core::time::{Instant, Nanos, Unit};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::num::NonZeroU32;

fn algorithm(code: &str) -> &'static dyn Algorithm {
    *REGISTRY.iter().find(|algo| algo.code() == code).unwrap()
}

/// A limit: `rpu` small (limits reached within a sequence) or large, every unit, `burst`
/// small or large, `slices` 1–60.
fn limits() -> impl Strategy<Value = Limit> {
    let rpu = prop_oneof![
        4 => 1u32..=12,
        2 => 1u32..=2_000,
        1 => Just(u32::MAX),
        1 => any::<u32>().prop_map(|v| v.max(1)),
    ];
    let burst = prop_oneof![4 => 1u32..=12, 1 => 1u32..=100_000, 1 => Just(u32::MAX)];
    let unit = prop::sample::select(Unit::ALL.to_vec());
    (rpu, unit, burst, 1u32..=60).prop_map(|(rpu, unit, burst, slices)| Limit {
        rpu: NonZeroU32::new(rpu).unwrap(),
        unit,
        burst: NonZeroU32::new(burst).unwrap(),
        slices: NonZeroU32::new(slices).unwrap(),
        calendar: None,
        period: None,
    })
}

/// How the clock moves before an operation.
#[derive(Debug, Clone, Copy)]
enum Step {
    Same,
    /// A few nanoseconds: boundaries.
    Tiny(u8),
    /// `k / 2^20` of a unit.
    Fraction(u32),
    /// `k` emission intervals (`unit / rpu`), plus or minus a nanosecond.
    Intervals(u8, i8),
    /// Whole units and a fraction.
    Units(u8, u32),
    /// Back by `k / 2^20` of a unit (only where the clock may go back).
    Back(u32),
}

fn steps(backwards: bool) -> BoxedStrategy<Step> {
    let forward = prop_oneof![
        3 => Just(Step::Same),
        2 => (0u8..4).prop_map(Step::Tiny),
        4 => (0u32..1 << 20).prop_map(Step::Fraction),
        3 => (0u8..5, -1i8..=1).prop_map(|(k, e)| Step::Intervals(k, e)),
        1 => (1u8..4, 0u32..1 << 20).prop_map(|(k, f)| Step::Units(k, f)),
    ];
    if backwards {
        prop_oneof![5 => forward, 2 => (0u32..1 << 20).prop_map(Step::Back)].boxed()
    } else {
        forward.boxed()
    }
}

/// How many tokens: picked relative to the limit's capacity when the case runs.
#[derive(Debug, Clone, Copy)]
enum Amount {
    Zero,
    One,
    Few(u8),
    /// `k / 256` of capacity + 2.
    Share(u8),
    Max,
}

fn amounts() -> impl Strategy<Value = Amount> {
    prop_oneof![
        1 => Just(Amount::Zero),
        4 => Just(Amount::One),
        3 => (0u8..6).prop_map(Amount::Few),
        2 => any::<u8>().prop_map(Amount::Share),
        1 => Just(Amount::Max),
    ]
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Acquire {
        step: Step,
        need: Amount,
        want: Amount,
        /// Give the grant back at once (another rule of the request denied it).
        release_now: bool,
    },
    Debt {
        step: Step,
        tokens: Amount,
    },
    /// Give back an earlier grant (the `k`-th still held, modulo), at the current time.
    ReleaseLater {
        step: Step,
        which: usize,
    },
}

fn ops(backwards: bool) -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        8 => (steps(backwards), amounts(), amounts(), prop::bool::weighted(0.2)).prop_map(
            |(step, need, want, release_now)| Op::Acquire { step, need, want, release_now }
        ),
        1 => (steps(backwards), amounts()).prop_map(|(step, tokens)| Op::Debt { step, tokens }),
        1 => (steps(backwards), any::<usize>())
            .prop_map(|(step, which)| Op::ReleaseLater { step, which }),
    ];
    prop::collection::vec(op, 1..160)
}

/// A start time: anywhere from the epoch to the 2100s, or near the end of `u64`.
fn starts() -> impl Strategy<Value = Instant> {
    prop_oneof![
        6 => 0u64..4_000_000_000_000_000_000,
        1 => 0u64..1 << 20,
        1 => (0u64..1 << 40).prop_map(|back| u64::MAX / 2 - back),
    ]
    .prop_map(Instant::from_unix_nanos)
}

/// The case's clock: `now` never more than one unit minus a nanosecond behind the latest
/// instant seen (a step back the algorithms handle exactly).
struct Clock {
    unit: Nanos,
    interval: u128,
    rpu: u128,
    now: Instant,
    latest: Instant,
}

impl Clock {
    fn new(limit: &Limit, start: Instant) -> Clock {
        Clock {
            unit: limit.unit.nanos(),
            interval: u128::from(limit.unit.nanos().get()),
            rpu: u128::from(limit.rpu.get()),
            now: start,
            latest: start,
        }
    }

    fn fraction(&self, k: u32) -> Nanos {
        Nanos::new(u64::try_from((u128::from(self.unit.get()) * u128::from(k)) >> 20).unwrap())
    }

    fn step(&mut self, step: Step) -> Instant {
        let now = match step {
            Step::Same => self.now,
            Step::Tiny(k) => self.now.saturating_add(Nanos::new(u64::from(k))),
            Step::Fraction(k) => self.now.saturating_add(self.fraction(k)),
            Step::Intervals(k, e) => {
                let dt = (u128::from(k) * self.interval).div_ceil(self.rpu);
                let dt = Nanos::new(u64::try_from(dt).unwrap_or(u64::MAX));
                let end = self.now.saturating_add(dt).unix_nanos();
                Instant::from_unix_nanos(end.saturating_add_signed(i64::from(e)))
            }
            Step::Units(k, f) => self
                .now
                .saturating_add(u64::from(k) * self.unit)
                .saturating_add(self.fraction(f)),
            Step::Back(k) => self.now.saturating_sub(self.fraction(k)),
        };
        // Never more than `unit - 1` behind the latest instant.
        self.now = now.max(self.latest.saturating_sub(self.unit - Nanos::new(1)));
        self.latest = self.latest.max(self.now);
        self.now
    }
}

fn tokens(amount: Amount, capacity: u64) -> u32 {
    let capacity = u32::try_from(capacity).unwrap_or(u32::MAX);
    match amount {
        Amount::Zero => 0,
        Amount::One => 1,
        Amount::Few(k) => u32::from(k),
        Amount::Share(k) => {
            u32::try_from(u64::from(capacity) * u64::from(k) / 256 + 2).unwrap_or(u32::MAX)
        }
        Amount::Max => u32::MAX,
    }
}

fn probe(algo: &dyn Algorithm, limit: &Limit, state: &[u64], now: Instant) -> Verdict {
    let mut copy = state.to_vec();
    let verdict = algo.acquire_at_least(limit, &mut copy, now, 0, 0);
    assert_eq!(copy, state, "a probe changed the state");
    assert_eq!(verdict.granted, 0, "a probe was granted tokens");
    verdict
}

/// A grant still held (not given back), for [`Op::ReleaseLater`].
#[derive(Debug, Clone, Copy)]
struct Held {
    at: Instant,
    tokens: u32,
    mark: Mark,
    /// Where the model counted it (window, slice, or departure run).
    place: u128,
    /// Late releases made before this grant (see [`Op::ReleaseLater`] for TB).
    late_releases: u64,
}

/// What each algorithm's definition says, kept beside the real state.
trait Model {
    /// Checks the verdict of an acquire at `now` (a grant counted at `place`), and
    /// records it. `state` is the algorithm's state after the decision.
    fn acquired(
        &mut self,
        now: Instant,
        need: u32,
        want: u32,
        verdict: &Verdict,
        state: &[u64],
    ) -> u128;
    /// The grant at `place` was given back right after (as if it never happened).
    fn undone(&mut self, now: Instant, held: &Held);
    /// A later release of `held`; `changed`: the release changed the state.
    fn released(&mut self, now: Instant, held: &Held, changed: bool);
    fn debt(&mut self, now: Instant, tokens: u32, verdict: &Verdict);
}

fn clamp_need(need: u32, want: u32) -> u32 {
    need.clamp(1, want.max(1))
}

/// Checks a counting algorithm's verdict when `counted` of `rpu` are taken: what it must
/// grant (`min(want, left)` if at least `need` is left, else nothing) and leave. Returns
/// the grant.
fn check_counted(code: &str, rpu: u64, counted: u64, need: u32, want: u32, v: &Verdict) -> u64 {
    let available = rpu.saturating_sub(counted);
    let need = u64::from(clamp_need(need, want));
    let expected = if want > 0 && available >= need {
        u64::from(want).min(available)
    } else {
        0
    };
    assert_eq!(u64::from(v.granted), expected, "{code}: granted");
    assert_eq!(v.remaining, available - expected, "{code}: remaining");
    assert!(
        counted + expected <= rpu || expected == 0,
        "{code}: over rpu"
    );
    expected
}

/// `W`: counts per window, in the later of the clock's window and the last one written.
struct WindowModel {
    rpu: u64,
    unit: Nanos,
    written: u64,
    counts: BTreeMap<u64, u64>,
}

impl WindowModel {
    fn effective(&self, now: Instant) -> u64 {
        now.periods(self.unit).max(self.written)
    }
}

impl Model for WindowModel {
    fn acquired(&mut self, now: Instant, need: u32, want: u32, v: &Verdict, _: &[u64]) -> u128 {
        let window = self.effective(now);
        let count = self.counts.get(&window).copied().unwrap_or(0);
        // The definition: never more than rpu counted in one window.
        let expected = check_counted("W", self.rpu, count, need, want, v);
        if expected > 0 {
            *self.counts.entry(window).or_default() += expected;
            self.written = window;
        }
        u128::from(window)
    }

    fn undone(&mut self, _: Instant, held: &Held) {
        let window = u64::try_from(held.place).unwrap();
        *self.counts.entry(window).or_default() -= u64::from(held.tokens);
    }

    fn released(&mut self, now: Instant, held: &Held, changed: bool) {
        // Tokens of a window that has passed are gone; in the current window they return.
        let window = u64::try_from(held.place).unwrap();
        let honoured = window == self.effective(now);
        assert!(!changed || honoured, "W: a release changed a passed window");
        if honoured {
            let count = self.counts.entry(window).or_default();
            *count = count.saturating_sub(u64::from(held.tokens));
        }
    }

    fn debt(&mut self, now: Instant, tokens: u32, v: &Verdict) {
        let window = self.effective(now);
        let count = self.counts.entry(window).or_default();
        *count += u64::from(tokens);
        assert_eq!(
            v.remaining,
            self.rpu.saturating_sub(*count),
            "W: debt remaining"
        );
        self.written = window;
    }
}

/// `SW`: counts per slice; a decision sums the `slices` slices ending at the later of the
/// clock's slice and the last one written.
struct SlidingModel {
    rpu: u64,
    unit: u128,
    slices: u64,
    head: u64,
    counts: BTreeMap<u64, u64>,
}

impl SlidingModel {
    fn slice(&self, now: Instant) -> u64 {
        u64::try_from(u128::from(now.unix_nanos()) * u128::from(self.slices) / self.unit).unwrap()
    }

    fn effective(&self, now: Instant) -> u64 {
        self.slice(now).max(self.head)
    }

    fn oldest(&self, now: Instant) -> u64 {
        self.effective(now).saturating_sub(self.slices - 1)
    }

    fn sum(&self, now: Instant) -> u64 {
        self.counts
            .range(self.oldest(now)..=self.effective(now))
            .map(|(_, count)| count)
            .sum()
    }
}

impl Model for SlidingModel {
    fn acquired(&mut self, now: Instant, need: u32, want: u32, v: &Verdict, _: &[u64]) -> u128 {
        let slice = self.effective(now);
        let sum = self.sum(now);
        // The definition: the window of `slices` slices ending here holds at most rpu.
        let expected = check_counted("SW", self.rpu, sum, need, want, v);
        if expected > 0 {
            *self.counts.entry(slice).or_default() += expected;
            self.head = slice;
        }
        u128::from(slice)
    }

    fn undone(&mut self, now: Instant, held: &Held) {
        let slice = u64::try_from(held.place).unwrap();
        *self.counts.entry(slice).or_default() -= u64::from(held.tokens);
        // The grant wrote the head forward; giving it back leaves it there.
        self.head = self.effective(now);
    }

    fn released(&mut self, now: Instant, held: &Held, changed: bool) {
        let slice = u64::try_from(held.place).unwrap();
        let honoured = slice >= self.oldest(now);
        assert!(
            !changed || honoured,
            "SW: a release changed a slice that has left"
        );
        if honoured {
            let count = self.counts.entry(slice).or_default();
            *count = count.saturating_sub(u64::from(held.tokens));
        }
    }

    fn debt(&mut self, now: Instant, tokens: u32, v: &Verdict) {
        let slice = self.effective(now);
        *self.counts.entry(slice).or_default() += u64::from(tokens);
        self.head = slice;
        assert_eq!(
            v.remaining,
            self.rpu.saturating_sub(self.sum(now)),
            "SW: debt remaining"
        );
    }
}

/// `TB`: the admissions still held, checked against `burst + rpu·(b − a)/unit` over every
/// interval between two of them.
struct BucketModel {
    rpu: u128,
    unit: u128,
    burst: u128,
    next_place: u128,
    /// place → (instant, tokens).
    admitted: BTreeMap<u128, (Instant, u32)>,
}

impl BucketModel {
    /// Every interval that ends with the latest admission (the earlier ones were checked
    /// when they ended; a release only takes admissions away).
    fn check(&self) {
        let Some((_, &(b, _))) = self.admitted.last_key_value() else {
            return;
        };
        let mut taken = 0u128;
        for &(a, tokens) in self.admitted.values().rev() {
            taken += u128::from(tokens);
            // taken ≤ burst + rpu·(b − a)/unit, kept in integers (a clock step back makes
            // `b − a` negative: the bound is then tighter, and still holds).
            let lhs = taken * self.unit;
            let budget = self.burst * self.unit;
            let ok = if b >= a {
                lhs <= budget + u128::from((b - a).get()) * self.rpu
            } else {
                lhs + u128::from((a - b).get()) * self.rpu <= budget
            };
            assert!(
                ok,
                "TB: {taken} admitted between {} and {} (burst {}, rpu {} per {} ns)",
                a.unix_nanos(),
                b.unix_nanos(),
                self.burst,
                self.rpu,
                self.unit
            );
        }
    }
}

impl Model for BucketModel {
    fn acquired(&mut self, now: Instant, _: u32, _: u32, v: &Verdict, _: &[u64]) -> u128 {
        self.next_place += 1;
        if v.granted > 0 {
            self.admitted.insert(self.next_place, (now, v.granted));
            self.check();
        }
        self.next_place
    }

    fn undone(&mut self, _: Instant, held: &Held) {
        self.admitted.remove(&held.place);
    }

    fn released(&mut self, _: Instant, held: &Held, _: bool) {
        self.admitted.remove(&held.place);
    }

    fn debt(&mut self, _: Instant, _: u32, _: &Verdict) {}
}

/// `LB`: departure runs (first departure ×`rpu`, count), checked for spacing and queue
/// length. The first departure is read exactly from the state (`next_free × rpu`, the
/// documented layout) and checked against the verdict's rounded delay.
struct LeakyModel {
    rpu: u128,
    interval: u128,
    burst: u128,
    runs: BTreeMap<u128, u128>,
}

fn load128(state: &[u64]) -> u128 {
    (u128::from(state[0]) << 64) | u128::from(state[1])
}

impl LeakyModel {
    /// Spacing always; the queue length when `now` is an admission's instant (a later
    /// clock step back shows more departures ahead, which no admission decided).
    fn check(&self, now: Option<Instant>) {
        let mut last: Option<u128> = None;
        for (&first, &count) in &self.runs {
            if let Some(last) = last {
                assert!(
                    first >= last + self.interval,
                    "LB: departures {last} and {first} (×rpu) closer than unit/rpu"
                );
            }
            last = Some(first + (count - 1) * self.interval);
        }
        let Some(now) = now else {
            return;
        };
        let now = u128::from(now.unix_nanos()) * self.rpu;
        let queued: u128 = self
            .runs
            .iter()
            .map(|(&first, &count)| {
                // Departures `first + k·interval` with `k < count` at or after `now`.
                let gone = now.saturating_sub(first).div_ceil(self.interval);
                count.saturating_sub(gone)
            })
            .sum();
        assert!(
            queued <= self.burst + 1,
            "LB: {queued} departures at or after now, burst {}",
            self.burst
        );
    }
}

impl Model for LeakyModel {
    fn acquired(&mut self, now: Instant, _: u32, _: u32, v: &Verdict, state: &[u64]) -> u128 {
        if v.granted == 0 {
            assert_eq!(v.delay, Nanos::ZERO, "LB: a denial with a delay");
            return u128::MAX;
        }
        let count = u128::from(v.granted);
        let first = load128(state) - count * self.interval;
        let scaled_now = u128::from(now.unix_nanos()) * self.rpu;
        assert!(first >= scaled_now, "LB: a departure before the arrival");
        assert_eq!(
            u128::from(v.delay.get()),
            // Saturated past u64 (a queue of centuries).
            (first - scaled_now)
                .div_ceil(self.rpu)
                .min(u128::from(u64::MAX)),
            "LB: delay"
        );
        assert!(self.runs.insert(first, count).is_none());
        self.check(Some(now));
        first
    }

    fn undone(&mut self, _: Instant, held: &Held) {
        self.runs.remove(&held.place);
    }

    fn released(&mut self, _: Instant, held: &Held, changed: bool) {
        if changed {
            // Given back: those turns will not be used (checked by the next grants).
            self.runs.remove(&held.place);
        }
        self.check(None);
    }

    fn debt(&mut self, _: Instant, _: u32, _: &Verdict) {}
}

fn model_for(algo: &dyn Algorithm, limit: &Limit) -> Box<dyn Model> {
    let rpu = limit.rpu.get();
    match algo.code() {
        "W" => Box::new(WindowModel {
            rpu: u64::from(rpu),
            unit: limit.unit.nanos(),
            written: 0,
            counts: BTreeMap::new(),
        }),
        "SW" => Box::new(SlidingModel {
            rpu: u64::from(rpu),
            unit: u128::from(limit.unit.nanos().get()),
            slices: u64::from(limit.slices.get()),
            head: 0,
            counts: BTreeMap::new(),
        }),
        "TB" => Box::new(BucketModel {
            rpu: u128::from(rpu),
            unit: u128::from(limit.unit.nanos().get()),
            burst: u128::from(limit.burst.get()),
            next_place: 0,
            admitted: BTreeMap::new(),
        }),
        "LB" => Box::new(LeakyModel {
            rpu: u128::from(rpu),
            interval: u128::from(limit.unit.nanos().get()),
            burst: u128::from(limit.burst.get()),
            runs: BTreeMap::new(),
        }),
        other => panic!("no model for {other}"),
    }
}

/// Runs one case on one algorithm, checking every property along the way.
fn run(algo: &dyn Algorithm, limit: &Limit, start: Instant, ops: &[Op]) {
    let words = algo.state_words(limit);
    let capacity = algo.capacity(limit);
    let mut state = vec![0u64; words];
    let mut clock = Clock::new(limit, start);
    let mut model = model_for(algo, limit);
    let mut held: Vec<Held> = Vec::new();
    let mut late_releases = 0u64;
    for op in ops {
        match *op {
            Op::Acquire {
                step,
                need,
                want,
                release_now,
            } => {
                let now = clock.step(step);
                let want = tokens(want, capacity);
                let need = tokens(need, capacity);
                let before = state.clone();
                let probe_before = probe(algo, limit, &state, now);
                let verdict = algo.acquire_at_least(limit, &mut state, now, need, want);
                let place = model.acquired(now, need, want, &verdict, &state);
                if verdict.granted == 0 {
                    assert_eq!(state, before, "a rejection changed the state");
                    assert_eq!(verdict.delay, Nanos::ZERO);
                    if want > 0 {
                        assert!(
                            !verdict.retry_after.is_zero(),
                            "a denial without retry_after"
                        );
                    }
                    continue;
                }
                assert!(verdict.granted <= want, "granted more than wanted");
                assert!(
                    verdict.granted >= clamp_need(need, want),
                    "granted below need"
                );
                assert!(
                    u64::from(verdict.granted) <= capacity,
                    "granted past capacity"
                );
                assert_eq!(
                    verdict.retry_after,
                    Nanos::ZERO,
                    "an admission with retry_after"
                );
                let grant = Held {
                    at: now,
                    tokens: verdict.granted,
                    mark: verdict.mark,
                    place,
                    late_releases,
                };
                if release_now {
                    algo.release(limit, &mut state, now, grant.tokens, grant.mark);
                    model.undone(now, &grant);
                    let probe_after = probe(algo, limit, &state, now);
                    assert_eq!(
                        probe_after.remaining, probe_before.remaining,
                        "a release right after the grant did not restore the probe"
                    );
                    assert_eq!(probe_after.retry_after, probe_before.retry_after);
                } else {
                    held.push(grant);
                }
            }
            Op::Debt {
                step,
                tokens: amount,
            } => {
                let now = clock.step(step);
                if !algo.allows_debt() {
                    continue;
                }
                let debt = tokens(amount, capacity);
                let verdict = algo.charge_debt(limit, &mut state, now, debt);
                assert_eq!(verdict.granted, 0);
                model.debt(now, debt, &verdict);
            }
            Op::ReleaseLater { step, which } => {
                let now = clock.step(step);
                if held.is_empty() {
                    continue;
                }
                let index = which % held.len();
                if algo.code() == "TB"
                    && (now < clock.latest || held[index].late_releases != late_releases)
                {
                    // TB gives back what of a grant is still ahead of the clock, by its
                    // mark (where its span of `tat` ended). Exact unless the clock is
                    // behind the latest instant, or an earlier grant was given back late
                    // since (which moved this grant's span earlier than its mark says):
                    // then up to the grant's tokens come back early (RELIABILITY.md).
                    continue;
                }
                late_releases += 1;
                let grant = held.swap_remove(index);
                assert!(grant.at <= clock.latest);
                let before = state.clone();
                algo.release(limit, &mut state, now, grant.tokens, grant.mark);
                model.released(now, &grant, state != before);
            }
        }
        let now = clock.now;
        let probe_now = probe(algo, limit, &state, now);
        assert!(
            probe_now.remaining <= capacity,
            "more left than the capacity"
        );
        if algo.is_idle(limit, &state, now) {
            let fresh = probe(algo, limit, &vec![0; words], now);
            assert_eq!(
                probe_now.remaining, fresh.remaining,
                "an idle state answers unlike a fresh one"
            );
        }
    }
}

fn cases(backwards: bool) -> impl Strategy<Value = (usize, Limit, Instant, Vec<Op>)> {
    (0..REGISTRY.len(), limits(), starts(), ops(backwards))
}

proptest! {
    #![proptest_config(config(256))]

    /// Forward clock: every definition, every algorithm.
    #[test]
    fn algorithms_keep_their_definition_on_a_forward_clock(
        (index, limit, start, ops) in cases(false)
    ) {
        run(REGISTRY[index], &limit, start, &ops);
    }

    /// A clock that also steps back (by less than one unit).
    #[test]
    fn algorithms_keep_their_definition_when_the_clock_steps_back(
        (index, limit, start, ops) in cases(true)
    ) {
        run(REGISTRY[index], &limit, start, &ops);
    }

    /// Any clock at all (arbitrary instants, garbage-sized steps back), any state words:
    /// no panic, a rejection changes nothing, a probe changes nothing, never more granted
    /// than wanted or than the capacity.
    #[test]
    fn algorithms_never_panic_on_any_clock_or_state(
        index in 0..REGISTRY.len(),
        limit in limits(),
        garbage in prop::collection::vec(any::<u64>(), 0..64),
        calls in prop::collection::vec((any::<u64>(), any::<u32>(), any::<u32>(), 0u8..4), 1..40),
    ) {
        let algo = REGISTRY[index];
        let words = algo.state_words(&limit);
        let mut state: Vec<u64> = garbage.iter().copied().cycle().take(words).collect();
        for (now, a, b, kind) in calls {
            let now = Instant::from_unix_nanos(now);
            let before = state.clone();
            match kind {
                0 | 1 => {
                    let verdict = algo.acquire_at_least(&limit, &mut state, now, a, b);
                    prop_assert!(verdict.granted <= b);
                    prop_assert!(u64::from(verdict.granted) <= algo.capacity(&limit));
                    if verdict.granted == 0 {
                        prop_assert_eq!(&state, &before);
                    }
                }
                2 => algo.release(&limit, &mut state, now, a, Mark(u128::from(b))),
                _ => {
                    if algo.allows_debt() {
                        let _ = algo.charge_debt(&limit, &mut state, now, a);
                    }
                }
            }
            let _ = algo.is_idle(&limit, &state, now);
            let _ = probe(algo, &limit, &state, now);
        }
    }
}

/// The models themselves can fail: a wrong algorithm is caught.
#[test]
fn the_window_model_catches_a_window_that_admits_twice() {
    let limit = Limit {
        rpu: NonZeroU32::new(2).unwrap(),
        unit: Unit::Second,
        burst: NonZeroU32::new(2).unwrap(),
        slices: NonZeroU32::new(1).unwrap(),
        calendar: None,
        period: None,
    };
    let mut model = model_for(algorithm("W"), &limit);
    let granted = Verdict {
        granted: 2,
        remaining: 0,
        ..Verdict::default()
    };
    let at = Instant::from_unix_nanos(5);
    model.acquired(at, 1, 2, &granted, &[]);
    // A third admission in the same window must fail the model's check.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        model.acquired(
            at,
            1,
            1,
            &Verdict {
                granted: 1,
                ..Verdict::default()
            },
            &[],
        );
    }));
    assert!(result.is_err());
}
