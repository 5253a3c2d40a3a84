//! The breakers of an engine's policy (DESIGN §4b), one [`Handle`] each in this worker:
//! checked before the rules, judged when the response headers come (or the request ends
//! without them), flushed from the tick, and — `scope: global` — reported to the quota
//! service, whose answer every worker of the gateway then follows.
//!
//! ```text
//!   evaluate ── check (least specific resource first) ─┬─ Call ──────▶ the request's call
//!                                                      ├─ Probe ─────▶ the request probes
//!                                                      └─ FastFail ─┬─ fallback_header: goes on, marked
//!                                                                   └─ rejected (the rules are not charged)
//!   a rule rejects / the request never leaves ─▶ give_back (a probe's place; not an outcome)
//!   response headers ─▶ judge(status, time since it left Diana) ─▶ record / probe_outcome
//!     (or, a call its binding keeps, `worker::Watch`: a good one counted in the tap
//!      without the worker, taken into the handle before each flush, judgement, report)
//!   ended without them ─▶ judge(no status): failed
//!   tick ─▶ flush; scope global: report ─▶ answered ─▶ follow
//! ```
//!
//! A handle is made at first use, its edition dated by the instant the worker installed
//! the document ([`Engine::installed_at`](super::Engine::installed_at); the first use's
//! instant only where none was given): a newer document's settings win over an older
//! one's, whichever worker writes first. Not the first use's instant: an engine replaced
//! before it was ever used (a worker's local document, replaced at its first tick by the
//! remote one the other workers already run) is still ticked once, and its handles made
//! then would date the older document as the newest, forcing its settings (`force:
//! auto` over the fleet's `force: open`) on every worker until the next document. And an
//! engine the worker retired makes no handle at all: one installed late (a worker that
//! started after the others adopted a config-center document) is newer by its date, yet
//! older by its document.

use crate::breaker::{
    answered_status, Admission, FleetAnswer, Handle, Report, Spec, Status, Tap, Transition,
};
use crate::config::{Policy, Resource};
use crate::cx::Cx;
use crate::decision::{AfterResponse, BreakerCall, BreakerCalls, HeaderEdit};
use crate::metrics::{BreakerEvent, MetricSink};
use crate::store::{ChargeError, Store};
use crate::time::{Instant, Nanos};
use smallvec::SmallVec;
use std::cell::{Cell, RefCell};
use std::sync::Arc;

/// Breaker calls with their breakers' taps: each call's breaker, and the tap its good
/// outcome may be counted in; inline for one, as [`BreakerCalls`].
pub(crate) type TappedCalls = SmallVec<[(usize, Arc<Tap>); 1]>;

impl super::Engine {
    /// Settles an answered request whose only business with its response is its breakers'
    /// calls, when judging them needs no clock ([`Breakers::judge_in_memory`]): true when
    /// done, so that the worker does not read the clock (a host call) for it; false, with
    /// nothing done, when it must ([`Engine::after_response`](super::Engine::after_response)).
    /// `status` as read, judged by [`answered_status`](crate::breaker::answered_status), as there.
    pub(crate) fn judged_without_clock(
        &self,
        metrics: &mut dyn MetricSink,
        after: &AfterResponse,
        status: Option<u16>,
    ) -> bool {
        after.charges.is_empty()
            && !after.breakers.is_empty()
            && self
                .breakers
                .judge_in_memory(metrics, &after.breakers, answered_status(status))
    }

    /// An admitted request's breaker calls with their breakers' taps, in order, when
    /// judging its response is all it has left here (no response costs, no concurrency
    /// places) and none of its calls is a probe: then its binding may keep the calls
    /// itself ([`crate::worker::Watch`]). `None` otherwise.
    pub(crate) fn taps(&self, after: &AfterResponse) -> Option<TappedCalls> {
        if !after.charges.is_empty() || after.holding.is_some() || after.breakers.is_empty() {
            return None;
        }
        let handles = self.breakers.handles.try_borrow().ok()?;
        let mut calls = TappedCalls::new();
        for call in &after.breakers {
            if call.probe.is_some() {
                return None;
            }
            let tap = handles.get(call.breaker)?.as_ref()?.tap();
            calls.push((call.breaker, Arc::clone(tap)));
        }
        Some(calls)
    }

    /// The good calls counted in every tap since last taken join their handles' pending
    /// calls and the calls metric now (before metrics are shown or handed to the host;
    /// the tick takes them anyway).
    pub(crate) fn take_breaker_taps(&self, metrics: &mut dyn MetricSink) {
        let Ok(mut handles) = self.breakers.handles.try_borrow_mut() else {
            return;
        };
        for (breaker, handle) in handles.iter_mut().enumerate() {
            if let Some(handle) = handle {
                take_tapped(handle, breaker, metrics);
            }
        }
    }

    /// Whether a request in flight keeps a call of one of this policy's breakers, counted
    /// in its tap (the worker keeps a replaced configuration until none does).
    pub(crate) fn breakers_tapped(&self) -> bool {
        self.breakers.handles.try_borrow().map_or(true, |handles| {
            handles.iter().flatten().any(Handle::is_tapped)
        })
    }
}

/// The good calls a handle's tap counted since last taken join its pending calls, and
/// the calls metric.
fn take_tapped(handle: &mut Handle, breaker: usize, metrics: &mut dyn MetricSink) {
    let good = handle.take_tapped();
    if good > 0 {
        metrics.breaker_event(breaker, BreakerEvent::Calls, u64::from(good));
    }
}

/// A request the breakers let through: its calls, and what to change in its headers.
#[derive(Debug, Default)]
pub(crate) struct Passed {
    pub calls: BreakerCalls,
    pub upstream: Vec<HeaderEdit>,
}

/// A breaker answers the request itself: which, and in how many seconds it probes again.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FastFail {
    pub breaker: usize,
    pub retry_after: u64,
}

/// The breakers of one policy, in one worker.
#[derive(Debug, Default)]
pub(crate) struct Breakers {
    specs: Vec<Spec>,
    handles: RefCell<Vec<Option<Handle>>>,
    /// The instant the worker installed the document: every handle's edition.
    installed: Cell<Option<Instant>>,
    /// A newer document replaced this one in the worker: no handle is made any more (one
    /// made now would write this older document's settings into the shared records).
    retired: Cell<bool>,
}

impl Breakers {
    pub(crate) fn new(policy: &Policy) -> Breakers {
        let specs: Vec<Spec> = policy
            .resources
            .iter()
            .filter_map(|resource| resource.breaker.clone())
            .collect();
        let handles = RefCell::new(specs.iter().map(|_| None).collect());
        Breakers {
            specs,
            handles,
            installed: Cell::new(None),
            retired: Cell::new(false),
        }
    }

    /// The worker replaced this document by a newer one: the handles made so far still
    /// settle their requests, flush and report; no other is made.
    pub(crate) fn retire(&self) {
        self.retired.set(true);
    }

    /// Dates the document's editions: the instant the worker installed it.
    pub(crate) fn installed_at(&self, at: Instant) {
        self.installed.set(Some(at));
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }

    pub(crate) fn spec(&self, breaker: usize) -> Option<&Spec> {
        self.specs.get(breaker)
    }

    /// Runs `f` on the handle of `breaker`, made now if this worker never used it.
    fn with<T>(
        &self,
        breaker: usize,
        now: Instant,
        f: impl FnOnce(&mut Handle, &Spec) -> T,
    ) -> Option<T> {
        let spec = self.specs.get(breaker)?;
        let mut handles = self.handles.try_borrow_mut().ok()?;
        let slot = handles.get_mut(breaker)?;
        if slot.is_none() && self.retired.get() {
            return None;
        }
        let handle = slot.get_or_insert_with(|| {
            let installed = self.installed.get().unwrap_or(now);
            self.installed.set(Some(installed));
            Handle::new(&spec.settings, installed)
        });
        Some(f(handle, spec))
    }

    /// The breakers of `resources` (least specific first), before any rule: a request
    /// answered by an open breaker charges no rule; one a breaker lets through is a call
    /// of each (a probe where half-open). A client's own value of a fallback header is
    /// removed.
    pub(crate) fn check(
        &self,
        cx: &mut Cx<'_>,
        store: &Store,
        resources: &[&Resource],
    ) -> Result<Passed, FastFail> {
        let mut passed = Passed::default();
        for spec in resources
            .iter()
            .filter_map(|resource| resource.breaker.as_ref())
        {
            if let Some(header) = &spec.fallback_header {
                passed.upstream.push(HeaderEdit {
                    name: header.clone(),
                    value: None,
                });
            }
            let checked = self.with(spec.index, cx.now, |handle, _| {
                (!handle.calls_now(cx.now)).then(|| handle.check(store, cx.shared, cx.now))
            });
            let checked = match checked {
                Some(Some(checked)) => checked,
                // Closed, as read less than the verdict cache ago.
                Some(None) => {
                    passed.calls.push(BreakerCall {
                        breaker: spec.index,
                        probe: None,
                    });
                    continue;
                }
                None => continue,
            };
            self.transitions(cx, spec, &checked.transitions);
            if let Some(trouble) = &checked.trouble {
                self.trouble(cx, spec, trouble);
            }
            match checked.admission {
                Admission::Call => passed.calls.push(BreakerCall {
                    breaker: spec.index,
                    probe: None,
                }),
                Admission::Probe(probe) => passed.calls.push(BreakerCall {
                    breaker: spec.index,
                    probe: Some(probe),
                }),
                Admission::FastFail { retry_after } => {
                    cx.metrics
                        .breaker_event(spec.index, BreakerEvent::FastFailed, 1);
                    if let Some(header) = &spec.fallback_header {
                        // Sent to the backup: not a call of this breaker's upstream.
                        passed.upstream.retain(|edit| edit.name != *header);
                        passed.upstream.push(HeaderEdit {
                            name: header.clone(),
                            value: Some(spec.settings.name.clone()),
                        });
                        continue;
                    }
                    self.give_back(cx, store, &passed.calls);
                    return Err(FastFail {
                        breaker: spec.index,
                        retry_after,
                    });
                }
            }
        }
        Ok(passed)
    }

    /// The request of `calls` never became a call (a rule rejected it, Diana answered it,
    /// its client left before it went on): the probes' places go back. Not an outcome.
    pub(crate) fn give_back(&self, cx: &mut Cx<'_>, store: &Store, calls: &[BreakerCall]) {
        for call in calls {
            let Some(probe) = call.probe else {
                continue;
            };
            let given = self.with(call.breaker, cx.now, |handle, _| {
                handle.give_back(store, cx.shared, probe, cx.now)
            });
            self.settled(cx, call.breaker, given);
        }
    }

    /// The request of `calls`, which left Diana at `left_at`, was answered with `status`
    /// (`None`: it ended without response headers — a reset, an upstream timeout).
    pub(crate) fn judge(
        &self,
        cx: &mut Cx<'_>,
        store: &Store,
        calls: &[BreakerCall],
        left_at: Instant,
        status: Option<u16>,
    ) {
        let took = cx.now.saturating_since(left_at);
        for call in calls {
            let Some(outcome) = self
                .specs
                .get(call.breaker)
                .map(|spec| spec.settings.judge(took, status))
            else {
                continue;
            };
            cx.metrics
                .breaker_event(call.breaker, BreakerEvent::Calls, 1);
            if outcome.slow {
                cx.metrics
                    .breaker_event(call.breaker, BreakerEvent::Slow, 1);
            }
            if outcome.failed {
                cx.metrics
                    .breaker_event(call.breaker, BreakerEvent::Failed, 1);
            }
            let metrics = &mut *cx.metrics;
            let done = self.with(call.breaker, cx.now, |handle, _| {
                // The good calls counted since go first: they dilute this one's share.
                take_tapped(handle, call.breaker, metrics);
                match call.probe {
                    Some(probe) => handle.probe_outcome(store, cx.shared, probe, outcome, cx.now),
                    None => handle.record(store, cx.shared, outcome, cx.now),
                }
            });
            self.settled(cx, call.breaker, done);
        }
    }

    /// [`Breakers::judge`] without the time, when no call needs it: none is a probe, none
    /// of their breakers judges slow calls (no `slow_ms`), and each is only counted in
    /// memory ([`Handle::records_in_memory`]: a good call, or a breaker that does not judge
    /// now). Then the calls are judged and counted as `judge` would, and true; else
    /// nothing is judged, and false (the worker reads the clock and calls `judge`).
    pub(crate) fn judge_in_memory(
        &self,
        metrics: &mut dyn MetricSink,
        calls: &[BreakerCall],
        status: Option<u16>,
    ) -> bool {
        let Ok(mut handles) = self.handles.try_borrow_mut() else {
            return false;
        };
        let outcome = |call: &BreakerCall| {
            let settings = &self.specs.get(call.breaker)?.settings;
            // Without `slow_ms` a call is never slow, however long it took.
            (call.probe.is_none() && settings.slow().is_none())
                .then(|| settings.judge(Nanos::ZERO, status))
        };
        let in_memory = calls.iter().all(|call| {
            let handle = handles.get(call.breaker).and_then(Option::as_ref);
            outcome(call)
                .zip(handle)
                .is_some_and(|(outcome, handle)| handle.records_in_memory(outcome))
        });
        if !in_memory {
            return false;
        }
        for call in calls {
            let (Some(outcome), Some(Some(handle))) =
                (outcome(call), handles.get_mut(call.breaker))
            else {
                continue;
            };
            metrics.breaker_event(call.breaker, BreakerEvent::Calls, 1);
            if outcome.failed {
                metrics.breaker_event(call.breaker, BreakerEvent::Failed, 1);
            }
            handle.record_in_memory(outcome);
        }
        true
    }

    /// From the tick: every handle's pending calls go into the record, and the
    /// transitions that only need time are made. The state gauge is set to the state just
    /// read from the record: the gauge is one per gateway on hosts that share metrics
    /// between workers, and the last worker to write it on a transition may have written
    /// an older state than another worker's later transition; every tick puts it right.
    pub(crate) fn flush(&self, cx: &mut Cx<'_>, store: &Store) {
        for breaker in 0..self.specs.len() {
            let metrics = &mut *cx.metrics;
            let flushed = self.with(breaker, cx.now, |handle, _| {
                take_tapped(handle, breaker, metrics);
                let flushed = handle.flush(store, cx.shared, cx.now);
                let status = flushed.is_ok().then(|| handle.status());
                (flushed, status)
            });
            let Some((flushed, status)) = flushed else {
                continue;
            };
            self.settled(cx, breaker, Some(flushed));
            if let (Some(status), Some(spec)) = (status, self.specs.get(breaker)) {
                cx.metrics.breaker_state(spec.index, status.gauge());
            }
        }
    }

    /// From the tick: what each breaker of `scope: global` reports to the quota service
    /// (`None` for one with nothing to say), in breaker order.
    pub(crate) fn reports(&self, cx: &mut Cx<'_>, store: &Store) -> Vec<(usize, Option<Report>)> {
        let mut reports = Vec::new();
        for (breaker, spec) in self.specs.iter().enumerate() {
            if spec.settings.reach != crate::breaker::Reach::Fleet {
                continue;
            }
            let metrics = &mut *cx.metrics;
            let taken = self
                .with(breaker, cx.now, |handle, _| {
                    take_tapped(handle, breaker, metrics);
                    handle.take_report(store, cx.shared, cx.now)
                })
                .unwrap_or(Ok(None));
            match taken {
                Ok(report) => reports.push((breaker, report)),
                Err(trouble) => {
                    if let Some(spec) = self.specs.get(breaker) {
                        self.trouble(cx, spec, &trouble);
                    }
                    reports.push((breaker, None));
                }
            }
        }
        reports
    }

    /// A report that was not answered: its calls and probe outcomes go back.
    pub(crate) fn restore(&self, now: Instant, breaker: usize, report: Report) {
        let _ = self.with(breaker, now, |handle, _| handle.restore_report(report));
    }

    /// The fleet's state, as the quota service answered it for `breaker`.
    pub(crate) fn follow(
        &self,
        cx: &mut Cx<'_>,
        store: &Store,
        breaker: usize,
        answer: FleetAnswer,
    ) {
        let followed = self.with(breaker, cx.now, |handle, _| {
            handle.follow(store, cx.shared, answer, cx.now)
        });
        self.settled(cx, breaker, followed);
    }

    /// The status this worker last saw of `breaker`.
    pub(crate) fn status(&self, breaker: usize) -> Status {
        self.handles
            .try_borrow()
            .ok()
            .and_then(|handles| {
                handles
                    .get(breaker)
                    .and_then(|h| h.as_ref().map(Handle::status))
            })
            .unwrap_or(Status::Closed)
    }

    fn settled(
        &self,
        cx: &mut Cx<'_>,
        breaker: usize,
        result: Option<Result<Vec<Transition>, ChargeError>>,
    ) {
        let Some(spec) = self.specs.get(breaker) else {
            return;
        };
        match result {
            Some(Ok(transitions)) => self.transitions(cx, spec, &transitions),
            Some(Err(trouble)) => self.trouble(cx, spec, &trouble),
            None => {}
        }
    }

    /// One log line and one count per transition, and the state gauge.
    fn transitions(&self, cx: &mut Cx<'_>, spec: &Spec, transitions: &[Transition]) {
        for transition in transitions {
            log::warn!("diana: breaker {}: {transition}", spec.settings.name);
            cx.metrics
                .breaker_transition(spec.index, cx.now, transition);
            cx.metrics
                .breaker_event(spec.index, BreakerEvent::Transitions, 1);
            cx.metrics.breaker_state(spec.index, transition.to.gauge());
        }
    }

    fn trouble(&self, cx: &mut Cx<'_>, spec: &Spec, trouble: &ChargeError) {
        match trouble {
            ChargeError::Contention => cx.metrics.event(crate::metrics::Event::StoreContention),
            ChargeError::Host(error) => {
                log::warn!("diana: breaker {}: {error}", spec.settings.name);
                cx.metrics.event(crate::metrics::Event::StoreError);
            }
        }
    }
}
