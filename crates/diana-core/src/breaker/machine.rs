//! The breaker's state machine: a plain value ([`State`]) and functions over it, with the
//! time passed in. No host, no clock, no floating point: the gateway runs it over one
//! shared-data record, the quota service over every gateway's tallies (its embedded store),
//! and its Lua port in Redis computes the same integers.
//!
//! Every operation first *syncs* the state: it adopts the caller's [`Edition`] if that is
//! newer than the one the state runs under (see [`State::sync`]), then makes the
//! transitions that only need time (open → half-open once `open_for` is over; half-open →
//! open when a probe's place has been held past `probe_timeout`). Then it does its own
//! work. Each transition made is returned once, as a value ([`Transition`]), to the caller
//! whose write of the state succeeds.
//!
//! The window is a ring of [`SLICES`] tallies; slice `g` (counted from the epoch) is
//! `floor(now / slice)`, so every writer of one state agrees on the slices whatever its
//! tick. Calls are counted in the slice of the instant they are recorded (a worker's batch
//! lands in the slice of its flush). A head slice up to one window ahead of the clock
//! (another writer's clock slightly ahead, a small step back) takes the calls; one a whole
//! window or more ahead cannot come from such a step and is cleared.

use super::settings::{Edition, Force, Params, SLICES};
use super::{Cause, Outcome, ProbeTally, Status, Tally, Transition, Transitions};
use crate::store::recordable;
use crate::time::{ceil_seconds_at_least_one, Instant, Nanos};

/// What a check answers. `T` is what a probe holds: a [`Ticket`] here, the record's
/// [`super::record::Probe`] (a local ticket or a place the fleet granted) there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission<T> {
    /// Closed (or forced closed): the request is a call, judged when it ends.
    Call,
    /// Half-open: the request is one of the probes. Its outcome, or its place given back
    /// if it never becomes a call, goes back with the ticket.
    Probe(T),
    /// Open (or forced open, or half-open with every place taken): answer at once, with
    /// `Retry-After` in whole seconds, at least 1.
    FastFail { retry_after: u64 },
}

impl<T> Admission<T> {
    pub fn map_probe<U>(self, change: impl FnOnce(T) -> U) -> Admission<U> {
        match self {
            Admission::Call => Admission::Call,
            Admission::Probe(ticket) => Admission::Probe(change(ticket)),
            Admission::FastFail { retry_after } => Admission::FastFail { retry_after },
        }
    }
}

/// A half-open probe's claim on one place: which round (the instant the breaker went
/// half-open), which place, and when it was taken. An outcome or a give-back settles the
/// place only if all three still match, so a late answer from an earlier round, or from a
/// place that timed out and was taken again, changes nothing. (Two tickets are equal only
/// when a place was given back and taken again at the same instant: the first holder is
/// done with it by then.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    pub round: Instant,
    pub place: u8,
    pub taken: Instant,
}

/// One probe place of a half-open round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Free,
    /// Taken at this instant; its outcome has not come.
    Out(Instant),
    /// Its probe answered well.
    Good,
}

/// Where the machine is. A forced state (`force: open | closed`) is always `Closed` here:
/// the switch decides the answers, and the window goes on counting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    Closed,
    /// Failing fast until `until`.
    Open {
        until: Instant,
    },
    /// Probing: `places` has `half_open_calls` entries.
    HalfOpen {
        round: Instant,
        places: Vec<Place>,
    },
}

/// The sliding window of calls: [`SLICES`] tallies in a ring, `slices[g % SLICES]` holding
/// slice `g` for the slices up to `head`. All zeros is "nothing counted".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CallWindow {
    head: u64,
    slices: [Tally; SLICES],
}

const RING: u64 = SLICES as u64;

impl CallWindow {
    pub const fn empty() -> CallWindow {
        CallWindow {
            head: 0,
            slices: [Tally::ZERO; SLICES],
        }
    }

    /// A window as stored: the head slice and the ring.
    pub const fn from_parts(head: u64, slices: [Tally; SLICES]) -> CallWindow {
        CallWindow { head, slices }
    }

    pub const fn head(&self) -> u64 {
        self.head
    }

    pub const fn slices(&self) -> &[Tally; SLICES] {
        &self.slices
    }

    fn slot(&self, g: u64) -> Tally {
        usize::try_from(g % RING)
            .ok()
            .and_then(|i| self.slices.get(i))
            .copied()
            .unwrap_or_default()
    }

    fn slot_mut(&mut self, g: u64) -> Option<&mut Tally> {
        usize::try_from(g % RING)
            .ok()
            .and_then(|i| self.slices.get_mut(i))
    }

    /// The calls of the last [`SLICES`] slices at `now`, the current one included.
    pub fn total(&self, slice: Nanos, now: Instant) -> Tally {
        let g = index(slice, now);
        if self.head >= g.saturating_add(RING) {
            return Tally::ZERO;
        }
        let top = g.max(self.head);
        (0..RING)
            .filter_map(|k| self.head.checked_sub(k))
            .filter(|&j| j + RING > top)
            .fold(Tally::ZERO, |total, j| total.merge(self.slot(j)))
    }

    /// Counts `tally` in the slice of `now` (or the head, if that is later).
    pub fn add(&mut self, slice: Nanos, tally: Tally, now: Instant) {
        let g = index(slice, now);
        if self.head >= g.saturating_add(RING) || g >= self.head.saturating_add(RING) {
            *self = CallWindow::empty();
            self.head = g;
        } else {
            for j in self.head + 1..=g {
                if let Some(old) = self.slot_mut(j) {
                    *old = Tally::ZERO;
                }
            }
            self.head = self.head.max(g);
        }
        let head = self.head;
        if let Some(current) = self.slot_mut(head) {
            *current = current.merge(tally);
        }
    }
}

/// The slice `now` falls in. A slice is at least 100 ms ([`super::settings::Window`]).
fn index(slice: Nanos, now: Instant) -> u64 {
    if slice.is_zero() {
        return now.unix_nanos();
    }
    now.periods(slice)
}

/// A breaker's whole state: the edition it runs under, its phase and its window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    edition: Edition,
    phase: Phase,
    calls: CallWindow,
}

impl State {
    /// A fresh, closed breaker with nothing counted (also what an evicted record becomes).
    pub fn new(edition: &Edition) -> State {
        State {
            edition: *edition,
            phase: Phase::Closed,
            calls: CallWindow::empty(),
        }
    }

    /// A state as stored. `None` when the parts contradict each other (a forced breaker
    /// that is not `Closed` underneath, a half-open round whose places do not number
    /// `half_open_calls`): a record that holds them is garbage.
    pub fn from_parts(edition: Edition, phase: Phase, calls: CallWindow) -> Option<State> {
        let consistent = match &phase {
            Phase::Closed => true,
            Phase::Open { .. } => edition.params.force == Force::Auto,
            Phase::HalfOpen { places, .. } => {
                edition.params.force == Force::Auto
                    && places.len() == usize::from(edition.params.half_open_calls.get())
            }
        };
        consistent.then_some(State {
            edition,
            phase,
            calls,
        })
    }

    pub fn edition(&self) -> &Edition {
        &self.edition
    }

    pub fn params(&self) -> &Params {
        &self.edition.params
    }

    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    pub fn calls(&self) -> &CallWindow {
        &self.calls
    }

    /// The window's calls at `now`.
    pub fn window_total(&self, now: Instant) -> Tally {
        self.calls.total(self.edition.params.window.slice(), now)
    }

    /// The state as metrics and logs show it: a forced breaker shows what it forces.
    pub fn status(&self) -> Status {
        match (self.edition.params.force, &self.phase) {
            (Force::Open, _) => Status::Open,
            (Force::Closed, _) | (Force::Auto, Phase::Closed) => Status::Closed,
            (Force::Auto, Phase::Open { .. }) => Status::Open,
            (Force::Auto, Phase::HalfOpen { .. }) => Status::HalfOpen,
        }
    }

    /// Adopts `mine` if it is newer, then makes the transitions that time alone makes.
    ///
    /// `mine` replaces the state's edition when its parameters differ and it was installed
    /// no earlier (or the state's instant is in the future). What carries over:
    /// - `force` changed: the phase becomes `Closed` (an opening, a half-open round and
    ///   its outstanding tickets are dropped), the window stays: back to `auto`, the
    ///   breaker goes on from the calls it has counted, not from a stale opening.
    /// - the window's length changed: its calls are cleared (slices of another length
    ///   cannot be mapped).
    /// - `half_open_calls` changed during a round: the round starts again with the new
    ///   number of places (outstanding tickets are void).
    /// - `open_seconds` shortened during an opening: it ends no later than the new
    ///   `open_seconds` from now; lengthened: the announced end stays.
    /// - thresholds and `min_calls`: the next recorded calls are judged by the new ones.
    pub fn sync(&mut self, mine: &Edition, now: Instant) -> Transitions {
        let mut transitions = Transitions::new();
        self.reconcile(mine, now, &mut transitions);
        self.advance(now, &mut transitions);
        transitions
    }

    fn reconcile(&mut self, mine: &Edition, now: Instant, out: &mut Transitions) {
        let ours = self.edition;
        if ours.params == mine.params {
            return;
        }
        if mine.installed < ours.installed && ours.installed <= now {
            return;
        }
        let before = self.status();
        let (old, new) = (ours.params, mine.params);
        self.edition = *mine;
        if old.force != new.force {
            self.phase = Phase::Closed;
        }
        match &mut self.phase {
            Phase::HalfOpen { round, places }
                if places.len() != usize::from(new.half_open_calls.get()) =>
            {
                *round = recordable(now.max(round.saturating_add(Nanos::new(1))));
                *places = vec![Place::Free; usize::from(new.half_open_calls.get())];
            }
            Phase::Open { until } if new.open_for < old.open_for => {
                *until = (*until).min(recordable(now.saturating_add(new.open_for)));
            }
            _ => {}
        }
        if old.window != new.window {
            self.calls = CallWindow::empty();
        }
        let after = self.status();
        if before != after {
            out.push(Transition {
                from: before,
                to: after,
                cause: Cause::Forced(new.force),
                figures: self.window_total(now),
            });
        }
    }

    fn advance(&mut self, now: Instant, out: &mut Transitions) {
        let params = self.edition.params;
        if params.force != Force::Auto {
            return;
        }
        match &self.phase {
            Phase::Closed => {}
            Phase::Open { until } => {
                if open_is_over(*until, params.open_for, now) {
                    self.phase = Phase::HalfOpen {
                        // Later than the round before, which ended before `until`.
                        round: recordable(now.max(*until)),
                        places: vec![Place::Free; usize::from(params.half_open_calls.get())],
                    };
                    out.push(Transition {
                        from: Status::Open,
                        to: Status::HalfOpen,
                        cause: Cause::Elapsed,
                        figures: Tally::ZERO,
                    });
                }
            }
            Phase::HalfOpen { places, .. } => {
                let lost = places.iter().any(|place| match place {
                    Place::Out(taken) => probe_is_lost(*taken, params.probe_timeout, now),
                    Place::Free | Place::Good => false,
                });
                if lost {
                    let figures = probe_figures(places, Outcome::LOST);
                    self.open(now);
                    out.push(Transition {
                        from: Status::HalfOpen,
                        to: Status::Open,
                        cause: Cause::ProbeLost,
                        figures,
                    });
                }
            }
        }
    }

    /// The fleet decides from now on (scope global): the machine goes closed underneath
    /// (a round's tickets are void) and keeps its window, to decide from it again if the
    /// fleet's answers stop.
    pub fn stand_down(&mut self) {
        self.phase = Phase::Closed;
    }

    fn open(&mut self, now: Instant) {
        let mut until = recordable(now.saturating_add(self.edition.params.open_for));
        if let Phase::HalfOpen { round, .. } = self.phase {
            // Even with no time to wait, the next round begins after this one: a round is
            // never the same instant twice, so its tickets never settle the next one's.
            until = until.max(round.saturating_add(Nanos::new(1)));
        }
        self.phase = Phase::Open { until };
    }

    /// Whether a request may go on (closed), probes (half-open, taking a place), or fails
    /// fast (open; half-open with every place taken: `Retry-After: 1`, a probe may answer
    /// any moment; forced open: `open_seconds`).
    pub fn check(&mut self, mine: &Edition, now: Instant) -> (Admission<Ticket>, Transitions) {
        let transitions = self.sync(mine, now);
        let params = self.edition.params;
        let admission = match (params.force, &mut self.phase) {
            (Force::Open, _) => Admission::FastFail {
                retry_after: params.forced_retry_after(),
            },
            (Force::Closed, _) | (Force::Auto, Phase::Closed) => Admission::Call,
            (Force::Auto, Phase::Open { until }) => Admission::FastFail {
                retry_after: ceil_seconds_at_least_one(until.saturating_since(now)),
            },
            (Force::Auto, Phase::HalfOpen { round, places }) => {
                let taken = recordable(now);
                let free = places
                    .iter_mut()
                    .enumerate()
                    .find(|(_, place)| **place == Place::Free)
                    .and_then(|(i, place)| Some((u8::try_from(i).ok()?, place)));
                match free {
                    Some((index, place)) => {
                        *place = Place::Out(taken);
                        Admission::Probe(Ticket {
                            round: *round,
                            place: index,
                            taken,
                        })
                    }
                    None => Admission::FastFail { retry_after: 1 },
                }
            }
        };
        (admission, transitions)
    }

    /// Records a batch of calls that were not probes; closed (and `auto`), opens when the
    /// window now holds at least `min_calls` calls and the slow or failed share reaches its
    /// ratio. Calls answered while open or half-open (in flight when it opened) are not
    /// counted: the breaker has decided, and a close starts from an empty window anyway.
    pub fn record(&mut self, mine: &Edition, tally: Tally, now: Instant) -> Transitions {
        let mut transitions = self.sync(mine, now);
        self.count_in(tally, now);
        self.evaluate(now, &mut transitions);
        transitions
    }

    /// Counts a batch of calls in the window without judging it (a gateway following the
    /// fleet's state keeps its own window for when it has to decide alone).
    pub fn count(&mut self, mine: &Edition, tally: Tally, now: Instant) -> Transitions {
        let transitions = self.sync(mine, now);
        self.count_in(tally, now);
        transitions
    }

    fn count_in(&mut self, tally: Tally, now: Instant) {
        let tally = tally.normalised();
        if tally.is_empty() || self.phase != Phase::Closed {
            return;
        }
        let slice = self.edition.params.window.slice();
        self.calls.add(slice, tally, now);
    }

    fn evaluate(&mut self, now: Instant, out: &mut Transitions) {
        if self.edition.params.force != Force::Auto || self.phase != Phase::Closed {
            return;
        }
        let total = self.window_total(now);
        let (slow, failed) = self.edition.params.reached(total);
        if slow || failed {
            self.open(now);
            out.push(Transition {
                from: Status::Closed,
                to: Status::Open,
                cause: Cause::Tripped { slow, failed },
                figures: total,
            });
        }
    }

    /// A probe's outcome: good, its place is done, and the last good one closes the
    /// breaker (window cleared); slow or failed, the breaker opens again for `open_for`.
    /// A ticket that no longer matches (another round, a place timed out) changes nothing.
    pub fn probe_outcome(
        &mut self,
        mine: &Edition,
        ticket: Ticket,
        outcome: Outcome,
        now: Instant,
    ) -> Transitions {
        let mut transitions = self.sync(mine, now);
        let Some(place) = self.place_of(ticket) else {
            return transitions;
        };
        if outcome.is_good() {
            *place = Place::Good;
            self.close_if_all_good(&mut transitions);
        } else {
            self.reopen(outcome, &mut transitions, now);
        }
        transitions
    }

    /// A probe that never became a call (a rule rejected it, Diana answered it): its place
    /// is free again. Not an outcome.
    pub fn give_back(&mut self, mine: &Edition, ticket: Ticket, now: Instant) -> Transitions {
        let transitions = self.sync(mine, now);
        if let Some(place) = self.place_of(ticket) {
            *place = Place::Free;
        }
        transitions
    }

    fn place_of(&mut self, ticket: Ticket) -> Option<&mut Place> {
        match &mut self.phase {
            Phase::HalfOpen { round, places } if *round == ticket.round => places
                .get_mut(usize::from(ticket.place))
                .filter(|place| **place == Place::Out(ticket.taken)),
            _ => None,
        }
    }

    fn close_if_all_good(&mut self, out: &mut Transitions) {
        let Phase::HalfOpen { places, .. } = &self.phase else {
            return;
        };
        if places.iter().all(|place| *place == Place::Good) {
            let probes = u32::try_from(places.len()).unwrap_or(u32::MAX);
            self.phase = Phase::Closed;
            self.calls = CallWindow::empty();
            out.push(Transition {
                from: Status::HalfOpen,
                to: Status::Closed,
                cause: Cause::Recovered,
                figures: Tally {
                    calls: probes,
                    slow: 0,
                    failed: 0,
                },
            });
        }
    }

    fn reopen(&mut self, bad: Outcome, out: &mut Transitions, now: Instant) {
        let Phase::HalfOpen { places, .. } = &self.phase else {
            return;
        };
        let figures = probe_figures(places, bad);
        self.open(now);
        out.push(Transition {
            from: Status::HalfOpen,
            to: Status::Open,
            cause: Cause::ProbeFailed,
            figures,
        });
    }

    /// The quota service's side of probing: takes up to `want` free places of the round
    /// for one gateway (which then probes with them); how many it took.
    pub fn grant(&mut self, mine: &Edition, want: u32, now: Instant) -> (u32, Transitions) {
        let transitions = self.sync(mine, now);
        let mut granted = 0;
        if let (Force::Auto, Phase::HalfOpen { places, .. }) =
            (self.edition.params.force, &mut self.phase)
        {
            for place in places.iter_mut().filter(|place| **place == Place::Free) {
                if granted >= want {
                    break;
                }
                *place = Place::Out(recordable(now));
                granted += 1;
            }
        }
        (granted, transitions)
    }

    /// The quota service's side: the probe outcomes gateways reported, as counts. The good
    /// ones settle outstanding places, the oldest first; one bad outcome opens the breaker
    /// again; every place good closes it.
    pub fn settle(&mut self, mine: &Edition, probes: ProbeTally, now: Instant) -> Transitions {
        let mut transitions = self.sync(mine, now);
        let Phase::HalfOpen { places, .. } = &mut self.phase else {
            return transitions;
        };
        let good = usize::try_from(probes.good).unwrap_or(usize::MAX);
        for i in outstanding(places).into_iter().take(good) {
            if let Some(place) = places.get_mut(i) {
                *place = Place::Good;
            }
        }
        if probes.bad.calls > 0 {
            let goods = places.iter().filter(|place| **place == Place::Good).count();
            let figures = Tally {
                calls: u32::try_from(goods)
                    .unwrap_or(u32::MAX)
                    .saturating_add(probes.bad.calls),
                ..probes.bad
            }
            .normalised();
            self.open(now);
            transitions.push(Transition {
                from: Status::HalfOpen,
                to: Status::Open,
                cause: Cause::ProbeFailed,
                figures,
            });
        } else {
            self.close_if_all_good(&mut transitions);
        }
        transitions
    }

    /// The quota service's side: `count` places granted but not used (their requests were
    /// rejected by a rule, or the gateway no longer needs them) are free again, the most
    /// recently taken first.
    pub fn release(&mut self, mine: &Edition, count: u32, now: Instant) -> Transitions {
        let transitions = self.sync(mine, now);
        if let Phase::HalfOpen { places, .. } = &mut self.phase {
            let count = usize::try_from(count).unwrap_or(usize::MAX);
            for i in outstanding(places).into_iter().rev().take(count) {
                if let Some(place) = places.get_mut(i) {
                    *place = Place::Free;
                }
            }
        }
        transitions
    }
}

/// An opening is over at its end, or when its end is further away than twice `open_for`
/// (no opening from this clock ends that late: the clock stepped back), so a step back
/// never keeps a breaker open for longer than the step's own `open_for`.
fn open_is_over(until: Instant, open_for: Nanos, now: Instant) -> bool {
    now >= until || until.saturating_since(now) > open_for.saturating_mul(2)
}

/// A probe's place held `probe_timeout` or longer (or taken further in the future than
/// that: a clock stepped back) counts as a failed probe.
fn probe_is_lost(taken: Instant, probe_timeout: Nanos, now: Instant) -> bool {
    now.saturating_since(taken) >= probe_timeout || taken.saturating_since(now) > probe_timeout
}

/// The places taken and not settled, the oldest first.
fn outstanding(places: &[Place]) -> Vec<usize> {
    let mut out: Vec<(Instant, usize)> = places
        .iter()
        .enumerate()
        .filter_map(|(i, place)| match place {
            Place::Out(taken) => Some((*taken, i)),
            Place::Free | Place::Good => None,
        })
        .collect();
    out.sort_unstable();
    out.into_iter().map(|(_, i)| i).collect()
}

/// The figures of a round that ends with one bad probe: the good ones and the bad one.
fn probe_figures(places: &[Place], bad: Outcome) -> Tally {
    let goods = places.iter().filter(|place| **place == Place::Good).count();
    Tally {
        calls: u32::try_from(goods).unwrap_or(u32::MAX).saturating_add(1),
        slow: u32::from(bad.slow),
        failed: u32::from(bad.failed),
    }
}

#[cfg(test)]
mod tests;
