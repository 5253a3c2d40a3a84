//! A worker's metric counts, batched: counted in the worker on the request path and handed
//! to the host in one call per counter that moved, from the tick (at least once a second).
//! A host call costs the request path as much as the rest of a local rule's decision
//! (BENCHMARKS.md, "Where the time goes"), so the host's counters run behind by one tick at
//! most; the metrics path flushes the answering worker first, and a configuration that
//! was replaced is flushed until its last request is gone.

use super::host::{Host, MetricId, MetricKind};
use crate::breaker::{Spec, Transition};
use crate::config::Rule;
use crate::metrics::DEGRADED_GAUGE;
use crate::metrics::{
    breaker_metric_name, prometheus_text, rule_metric_name, BreakerEvent, Event, MetricSink,
    RuleEvent, BREAKER_STATE,
};
use crate::time::Instant;
use hashbrown::HashMap;
use std::cell::Cell;

/// At most this many breaker transitions wait for the next flush (a flush comes at least
/// every tick, and transitions are rare: a few per breaker per `open_seconds`); past it,
/// they are dropped from the hook only — each was logged and counted already.
const TRANSITIONS_UNFLUSHED: usize = 64;

/// The metrics of one configuration: host ids defined once, counts kept here until the
/// next flush. Counting needs no mutable borrow (cells), so the engine reports through a
/// shared reference.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Per rule, per [`RuleEvent`]: the index in `defined`.
    rules: Vec<[Option<usize>; 3]>,
    /// Per breaker, per [`BreakerEvent`]: the index in `defined`; and its state gauge.
    breakers: Vec<([Option<usize>; 5], Option<MetricId>)>,
    events: HashMap<Event, usize>,
    degraded: Option<MetricId>,
    /// The outage switch's state not yet handed to the host.
    degraded_unset: Cell<Option<bool>>,
    /// Breakers' states not yet handed to the host.
    states_unset: std::cell::RefCell<Vec<(MetricId, u8)>>,
    /// Breakers' transitions not yet handed to the host ([`Host::breaker_transition`]).
    transitions_unset: std::cell::RefCell<Vec<(usize, Instant, Transition)>>,
    /// Every metric defined, for the metrics path and the flush.
    defined: Vec<Defined>,
}

#[derive(Debug)]
struct Defined {
    name: String,
    id: MetricId,
    kind: MetricKind,
    unflushed: Cell<u64>,
}

impl Counters {
    /// Defines the rules' counters, the process-wide event counters and the degraded
    /// gauge.
    pub(crate) fn define<'a>(
        host: &dyn Host,
        rules: impl Iterator<Item = &'a Rule>,
        breakers: impl Iterator<Item = &'a Spec>,
    ) -> Counters {
        let mut defined = Vec::new();
        let mut define = |kind: MetricKind, name: String| {
            let id = host.define_metric(kind, &name)?;
            defined.push(Defined {
                name,
                id,
                kind,
                unflushed: Cell::new(0),
            });
            Some((defined.len() - 1, id))
        };
        let rules = rules
            .map(|rule| {
                RuleEvent::ALL.map(|event| {
                    define(
                        MetricKind::Counter,
                        rule_metric_name(&rule.metric_name, event),
                    )
                    .map(|(index, _)| index)
                })
            })
            .collect();
        let events = Event::ALL
            .iter()
            .filter_map(|&event| {
                define(MetricKind::Counter, event.name().to_string())
                    .map(|(index, _)| (event, index))
            })
            .collect();
        let breakers = breakers
            .map(|spec| {
                let counters = BreakerEvent::ALL.map(|event| {
                    define(
                        MetricKind::Counter,
                        breaker_metric_name(&spec.metric_name, event.family()),
                    )
                    .map(|(index, _)| index)
                });
                let state = define(
                    MetricKind::Gauge,
                    breaker_metric_name(&spec.metric_name, BREAKER_STATE),
                )
                .map(|(_, id)| id);
                (counters, state)
            })
            .collect();
        let degraded = define(MetricKind::Gauge, DEGRADED_GAUGE.to_string()).map(|(_, id)| id);
        Counters {
            rules,
            breakers,
            events,
            degraded,
            degraded_unset: Cell::new(None),
            states_unset: std::cell::RefCell::new(Vec::new()),
            transitions_unset: std::cell::RefCell::new(Vec::new()),
            defined,
        }
    }

    /// Hands the counts to the host: one call per counter that moved.
    pub(crate) fn flush(&self, host: &dyn Host) {
        for metric in &self.defined {
            let count = metric.unflushed.take();
            if count > 0 {
                host.add_to_metric(metric.id, count);
            }
        }
        self.flush_gauge(host);
    }

    /// Hands the outage switch's and the breakers' states to the host, if they changed.
    pub(crate) fn flush_gauge(&self, host: &dyn Host) {
        if let (Some(id), Some(on)) = (self.degraded, self.degraded_unset.take()) {
            host.set_metric(id, u64::from(on));
        }
        if let Ok(mut states) = self.states_unset.try_borrow_mut() {
            for (id, state) in states.drain(..) {
                host.set_metric(id, u64::from(state));
            }
        }
        if let Ok(mut transitions) = self.transitions_unset.try_borrow_mut() {
            for (breaker, at, transition) in transitions.drain(..) {
                host.breaker_transition(breaker, at, &transition);
            }
        }
    }

    /// Every metric's value (summed over the workers by the host) in the Prometheus text
    /// format; this worker's counts are flushed first.
    pub(crate) fn exposition(&self, host: &dyn Host) -> String {
        self.flush(host);
        prometheus_text(self.defined.iter().map(|metric| {
            (
                metric.name.as_str(),
                host.metric_value(metric.id),
                metric.kind == MetricKind::Gauge,
            )
        }))
    }

    fn count(&self, index: Option<usize>, count: u64) {
        if let Some(metric) = index.and_then(|index| self.defined.get(index)) {
            metric
                .unflushed
                .set(metric.unflushed.get().saturating_add(count));
        }
    }

    pub(crate) fn event(&self, event: Event) {
        self.events(event, 1);
    }

    fn events(&self, event: Event, count: u64) {
        self.count(self.events.get(&event).copied(), count);
    }

    /// A [`MetricSink`] counting here.
    pub(crate) fn sink(&self) -> Sink<'_> {
        Sink(self)
    }
}

/// The engine's [`MetricSink`] over a [`Counters`].
pub(crate) struct Sink<'a>(&'a Counters);

impl MetricSink for Sink<'_> {
    fn rule_event(&mut self, rule: usize, event: RuleEvent) {
        let slot = RuleEvent::ALL.iter().position(|&e| e == event).unwrap_or(0);
        self.0.count(
            self.0
                .rules
                .get(rule)
                .and_then(|indices| indices.get(slot).copied().flatten()),
            1,
        );
    }

    fn events(&mut self, event: Event, count: u64) {
        self.0.events(event, count);
    }

    fn degraded(&mut self, on: bool) {
        self.0.degraded_unset.set(Some(on));
    }

    fn breaker_event(&mut self, breaker: usize, event: BreakerEvent, count: u64) {
        let slot = BreakerEvent::ALL
            .iter()
            .position(|&e| e == event)
            .unwrap_or(0);
        self.0.count(
            self.0
                .breakers
                .get(breaker)
                .and_then(|(indices, _)| indices.get(slot).copied().flatten()),
            count,
        );
    }

    fn breaker_state(&mut self, breaker: usize, state: u8) {
        if let (Some((_, Some(id))), Ok(mut states)) = (
            self.0.breakers.get(breaker),
            self.0.states_unset.try_borrow_mut(),
        ) {
            states.retain(|(held, _)| held != id);
            states.push((*id, state));
        }
    }

    fn breaker_transition(&mut self, breaker: usize, at: Instant, transition: &Transition) {
        if let Ok(mut transitions) = self.0.transitions_unset.try_borrow_mut() {
            if transitions.len() < TRANSITIONS_UNFLUSHED {
                transitions.push((breaker, at, *transition));
            }
        }
    }
}
