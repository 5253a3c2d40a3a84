//! `diana simulate POLICY LOG`: replays a request log through a policy with the log's own
//! clock — the filter's own worker (`diana_core::worker`) on a simulated host, no gateway —
//! and tallies per rule and per second what would have been admitted, delayed and rejected,
//! and what the document's circuit breakers did.
//!
//! - Every request goes through the worker at its log time, and time passes between
//!   requests as in a gateway: the worker's tick runs at the gateway's period (local
//!   batches returned, lease stashes refilled ahead, waiters resumed), so the numbers are
//!   a gateway's. The worker's decision is the only source of truth (rules, actors, costs,
//!   dry run all come from it); a request's rule events are what its rule counters moved.
//! - Local rules count in an in-memory shared-data store per gateway (Envoy's semantics).
//!   With `--gateways N`, requests are spread round robin over N gateways, each with its
//!   own worker and local store.
//! - Global rules call an in-process quota service shared by every gateway
//!   ([`MemoryQuota`]: all or nothing per request, dry-run rules aside, leases granted as
//!   asked), answered at once: a callout never fails or times out here.
//! - A leaky-bucket wait is a "delayed" admission with its delay; the request is not held
//!   (its turn is reserved, as in the gateway).
//! - An admitted request's answer (the log's status and response headers) comes at its
//!   log time plus its duration (or when it left Diana, if a leaky bucket held it past
//!   that), in time order with the requests (a heap of answers, drained before every
//!   later request and at the end), and the request ends then: the circuit breakers judge
//!   the time from leaving Diana to the answer and its status, response costs are charged,
//!   `max_in_flight` places are held until then. A line without a duration is answered
//!   at once. A line without a status (or Envoy's 0, "no answer came") gets no response
//!   headers: the request just ends, which the worker judges as a reset (a failed call of
//!   its breakers).
//! - A request an open breaker answered is *fast-failed* (not a rejection by a rule); one
//!   it sent on with its `fallback_header` counts as admitted and as fallback. Both are
//!   read from the worker's own `diana_breaker_fast_failed` counter and its fate, never
//!   decided here. Each breaker's transitions come from the worker as values (with their
//!   instants, [`diana_core::worker::Host::breaker_transition`]), its calls, slow and
//!   failed from its counters ([`breakers`]). `--gateways N`: a `scope: local` breaker is
//!   each gateway's own; a `scope: global` one reports to the shared quota service at
//!   each gateway's tick and follows the fleet's state it answers.
//! - The log is streamed: a bounded reordering buffer ([`REORDER_SECONDS`] by default) puts requests back in
//!   time order (an Envoy access log is written when a request ends, so its lines are not
//!   in start order); a line later than that is replayed at the simulation's current time
//!   and counted as late.

mod breakers;
mod clock;
mod log;
mod report;
mod svg;
mod tally;

pub use self::log::{EnvoyField, EnvoyFieldError, Format};
pub use self::report::{render_json, render_text};
pub use self::svg::render_svg;

pub use self::breakers::Breakers;
use self::log::{parse_line, Line, LineError, LineReader, RawLine, Request};
use self::tally::{Fate, Tally};
use diana_core::config::Policy;
use diana_core::metrics::{rule_metric_name, RuleEvent};
use diana_core::quota::MemoryQuota;
use diana_core::time::{Instant, Nanos, NANOS_PER_SECOND};
use diana_core::worker::sim::{Fate as SimFate, Service, Sim};
use diana_core::worker::{HostProfile, Refused};
use std::cell::RefCell;
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::io::{self, BufRead};
use std::rc::Rc;

/// The default reordering window, seconds: lines up to this much out of time order are
/// replayed in order.
pub const REORDER_SECONDS: f64 = 5.0;

/// At most this many requests wait in the reordering buffer (memory bound): past it,
/// the earliest is replayed even if its window has not passed.
const MAX_BUFFERED: usize = 1_000_000;

/// Malformed lines listed by number (all are counted).
pub const MALFORMED_EXAMPLES: usize = 5;

/// How to read and replay.
#[derive(Debug, Clone)]
pub struct Options {
    pub format: Format,
    /// Fields appended to Envoy's default format, in order.
    pub envoy_fields: Vec<EnvoyField>,
    /// Gateways the requests are spread over, at least 1.
    pub gateways: usize,
    /// How far out of time order a line may be and still be replayed in order.
    pub reorder: Nanos,
}

/// What was read.
#[derive(Debug, Default)]
pub struct InputStats {
    pub lines: u64,
    /// Requests replayed.
    pub requests: u64,
    pub jsonl: u64,
    pub envoy: u64,
    pub blank: u64,
    /// Envoy lines without a request (`"- - -"`).
    pub no_request: u64,
    pub malformed: u64,
    /// The first [`MALFORMED_EXAMPLES`]: line number and reason.
    pub malformed_examples: Vec<(u64, LineError)>,
    /// Lines later than the reordering window: replayed at the current simulated time.
    pub late: u64,
    pub first: Option<Instant>,
    pub last: Option<Instant>,
}

/// The whole result.
#[derive(Debug)]
pub struct Simulation {
    pub input: InputStats,
    pub tally: Tally,
    pub gateways: usize,
    /// Callouts of the requests' decisions to the simulated quota service (tick reports
    /// apart).
    pub callouts: u64,
    /// Requests with no fate once their calls were answered at their own instant: neither
    /// admitted, replied to nor waiting (counted as rejected; never expected).
    pub unresolved: u64,
    /// What the document's circuit breakers did (empty without breakers).
    pub breakers: Breakers,
}

/// Why a replay stopped. Malformed lines do not stop it: they are counted.
#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    #[error("{0}")]
    Read(#[from] io::Error),
    /// The simulated gateways refused the document (checked before: not expected).
    #[error("{0}")]
    Refused(#[from] Refused),
}

/// Replays `input` through `policy`.
pub fn simulate<R: BufRead>(
    policy: &Policy,
    document: &str,
    input: R,
    options: &Options,
) -> Result<Simulation, SimulateError> {
    let mut replay = Replay::new(policy, document, options.gateways.max(1))?;
    let mut stats = InputStats::default();
    let mut buffer = Reorder::new(options.reorder);
    let mut reader = LineReader::new(input);
    while let Some((number, raw)) = reader.next_line()? {
        stats.lines = number;
        let parsed = match raw {
            RawLine::TooLong => Err(LineError::TooLong),
            RawLine::Text(text) => parse_line(text, number, options.format, &options.envoy_fields),
        };
        match parsed {
            Ok(Line::Request(request, format)) => {
                if format == Format::Envoy {
                    stats.envoy += 1;
                } else {
                    stats.jsonl += 1;
                }
                buffer.push(request);
                while let Some(ready) = buffer.pop_ready() {
                    replay.request(&ready, &mut stats);
                }
            }
            Ok(Line::Blank) => stats.blank += 1,
            Ok(Line::NoRequest) => stats.no_request += 1,
            Err(reason) => {
                stats.malformed += 1;
                if stats.malformed_examples.len() < MALFORMED_EXAMPLES {
                    stats.malformed_examples.push((number, reason));
                }
            }
        }
    }
    while let Some(ready) = buffer.pop() {
        replay.request(&ready, &mut stats);
    }
    replay.finish();
    // The decisions' callouts: the ticks' reports (every second while the document has a
    // `global` section, for the fleet view) are not what a lease or a cost tunes.
    let callouts = {
        let quota = replay.quota.borrow();
        quota.calls() - quota.reports_received()
    };
    Ok(Simulation {
        input: stats,
        callouts,
        gateways: replay.gateways.len(),
        unresolved: replay.unresolved,
        tally: replay.tally,
        breakers: replay.breakers,
    })
}

/// A request ordered by (time, line).
struct Queued(Request);

impl Queued {
    fn key(&self) -> (Instant, u64) {
        (self.0.ts, self.0.line)
    }
}

impl PartialEq for Queued {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Queued {}

impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Queued {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key().cmp(&other.key())
    }
}

/// Puts requests back in time order, within a window.
struct Reorder {
    heap: BinaryHeap<Reverse<Queued>>,
    window: Nanos,
    newest: Instant,
}

impl Reorder {
    fn new(window: Nanos) -> Reorder {
        Reorder {
            heap: BinaryHeap::new(),
            window,
            newest: Instant::EPOCH,
        }
    }

    fn push(&mut self, request: Request) {
        self.newest = self.newest.max(request.ts);
        self.heap.push(Reverse(Queued(request)));
    }

    /// The earliest request, if no line still to come can be earlier (within the window).
    fn pop_ready(&mut self) -> Option<Request> {
        let Reverse(earliest) = self.heap.peek()?;
        if self.heap.len() > MAX_BUFFERED
            || earliest.0.ts.saturating_add(self.window) <= self.newest
        {
            self.pop()
        } else {
            None
        }
    }

    fn pop(&mut self) -> Option<Request> {
        self.heap.pop().map(|Reverse(Queued(request))| request)
    }
}

/// One simulated gateway: a worker ([`diana_core::worker::Worker`], the filter's own) on a
/// simulated host with its own shared data, and what its metrics said after the previous
/// request (a request's rule events are what they moved by).
struct Gateway {
    sim: Sim,
    seen: Vec<u64>,
}

struct Replay {
    /// Started at the first request's time.
    gateways: Vec<Gateway>,
    /// How many, and the document they run.
    count: usize,
    document: String,
    next: usize,
    quota: Rc<RefCell<MemoryQuota>>,
    /// Per rule, per [`RuleEvent`]: its metric's name.
    metrics: Vec<(usize, RuleEvent, String)>,
    /// The simulated time: the latest request time replayed.
    clock: Instant,
    tally: Tally,
    unresolved: u64,
    /// Admitted requests still inside (the log says how long they lasted), by when their
    /// answer comes and they end: what they hold (a `max_in_flight` place) is held until
    /// then, and the breakers judge the answer then.
    inside: BinaryHeap<Reverse<Inside>>,
    /// Numbers the requests inside, so that those ending at one instant end in order.
    admitted: u64,
    breakers: Breakers,
}

/// An admitted request until its answer and end: (when, order of admission, gateway,
/// context), and what the upstream answered (`None`: the log does not say — it ends
/// without response headers).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Inside {
    key: (Instant, u64),
    gateway: usize,
    context: u32,
    response: Option<Answered>,
}

/// What the upstream answered, as the log tells it: the status and headers, and the body
/// where the log has it.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Answered {
    headers: Vec<(String, Vec<u8>)>,
    body: Option<Vec<u8>>,
}

impl Replay {
    fn new(policy: &Policy, document: &str, gateways: usize) -> Result<Replay, Refused> {
        let mut replay = Replay::unstarted(policy, document, gateways);
        // Refused here rather than at the first request.
        replay.start(Instant::EPOCH + NANOS_PER_SECOND)?;
        replay.gateways.clear();
        Ok(replay)
    }

    fn unstarted(policy: &Policy, document: &str, count: usize) -> Replay {
        let metrics: Vec<(usize, RuleEvent, String)> = policy
            .rules()
            .flat_map(|rule| {
                RuleEvent::ALL.map(|event| {
                    (
                        rule.index,
                        event,
                        rule_metric_name(&rule.metric_name, event),
                    )
                })
            })
            .collect();
        Replay {
            gateways: Vec::new(),
            count: count.max(1),
            document: document.to_string(),
            next: 0,
            quota: Rc::new(RefCell::new(MemoryQuota::new())),
            tally: Tally::new(policy.rules().count()),
            metrics,
            clock: Instant::EPOCH,
            unresolved: 0,
            inside: BinaryHeap::new(),
            admitted: 0,
            breakers: Breakers::new(policy, count.max(1)),
        }
    }

    /// Starts the gateways at `now` (the first request's time).
    fn start(&mut self, now: Instant) -> Result<(), Refused> {
        for _ in 0..self.count {
            let sim = Sim::new(
                HostProfile::ENVOY,
                &self.document,
                1,
                Service::Answers(Nanos::ZERO),
                now,
            )?
            .sharing_quota(Rc::clone(&self.quota));
            self.gateways.push(Gateway {
                sim,
                seen: vec![0; self.metrics.len()],
            });
        }
        Ok(())
    }

    fn request(&mut self, request: &Request, stats: &mut InputStats) {
        stats.requests += 1;
        stats.first = Some(
            stats
                .first
                .map_or(request.ts, |first| first.min(request.ts)),
        );
        stats.last = Some(stats.last.map_or(request.ts, |last| last.max(request.ts)));
        if request.ts < self.clock {
            stats.late += 1;
        }
        let now = request.ts.max(self.clock);
        self.clock = now;
        if self.gateways.is_empty() && self.start(now).is_err() {
            return;
        }
        // The requests answered by now are answered first, and end, each at its own time:
        // what their end sends (places given back to the quota service) goes at the tick
        // after.
        self.answer_until(now);
        // Every gateway lives through the time that passed: its ticks run at the
        // gateway's period (batches returned, stashes refilled ahead, waiters resumed).
        for gateway in &mut self.gateways {
            gateway.sim.advance_to(now);
        }
        self.collect_transitions();
        let index = self.next % self.gateways.len();
        self.next = index + 1;
        let Some(gateway) = self.gateways.get_mut(index) else {
            return;
        };
        let mut headers = request.headers.clone();
        headers.push((":path".to_string(), request.path.clone()));
        let context = gateway.sim.send_raw(0, request.client_ip.clone(), headers);
        // Calls are answered at once: deliver them at this same instant.
        gateway.sim.advance_to(now);
        gateway.sim.flush_metrics();
        // An open breaker's fast fail is what its counter says, from the worker itself:
        // answered (a local reply), or sent on to the fallback.
        let breaker_failed = self
            .breakers
            .fast_failed(index, |name| gateway.sim.host.metric(name));
        let mut fate = match gateway.sim.fate(context) {
            Some(SimFate::Admitted(_)) | Some(SimFate::Replied(200)) => Fate::Admitted,
            Some(SimFate::Replied(_)) => Fate::Rejected,
            _ => match gateway.sim.waiting_until(context) {
                Some(until) if until > now => Fate::Delayed(until - now),
                Some(_) => Fate::Admitted,
                None => {
                    self.unresolved += 1;
                    Fate::Rejected
                }
            },
        };
        let fallback = breaker_failed && fate != Fate::Rejected;
        if breaker_failed && fate == Fate::Rejected {
            fate = Fate::FastFailed;
        }
        // An admitted request's answer, as the log tells it, comes when the log says it
        // ended: the breakers judge it then (the time from leaving Diana to the answer),
        // and it settles its rules (response costs, counted statuses). An Envoy status of
        // 0 says no answer came: it ends without response headers, as in the gateway.
        let response = (!request.response.is_empty()
            && !request
                .response
                .iter()
                .any(|(name, value)| name == ":status" && value.as_slice() == b"0"))
        .then(|| Answered {
            headers: request.response.clone(),
            body: request.response_body.clone(),
        });
        let passed = matches!(fate, Fate::Admitted | Fate::Delayed(_));
        let left = match fate {
            Fate::Delayed(delay) => now.saturating_add(delay),
            _ => now,
        };
        if passed && !request.duration.is_zero() {
            // Its turn stays taken, as in the gateway; the request itself is held only
            // while the log says it lasted (a log's duration counts from the request's
            // arrival), and never ends before it left.
            self.admitted += 1;
            self.inside.push(Reverse(Inside {
                key: (
                    now.saturating_add(request.duration).max(left),
                    self.admitted,
                ),
                gateway: index,
                context,
                response,
            }));
        } else {
            let response = response.filter(|_| passed);
            Self::answer(gateway, &mut self.breakers, index, context, response);
        }
        self.collect_transitions();
        let Some(gateway) = self.gateways.get_mut(index) else {
            return;
        };
        gateway.sim.flush_metrics();
        let mut events = Vec::new();
        for ((rule, event, name), seen) in self.metrics.iter().zip(gateway.seen.iter_mut()) {
            let value = gateway.sim.host.metric(name);
            for _ in *seen..value {
                events.push((*rule, *event));
            }
            *seen = value;
        }
        self.tally.record(
            request.ts.periods(NANOS_PER_SECOND),
            fate,
            fallback,
            &events,
        );
    }

    /// The upstream answers `context` with `response` (`None`: no response headers) and
    /// the request ends, at the gateway's current time.
    fn answer(
        gateway: &mut Gateway,
        breakers: &mut Breakers,
        index: usize,
        context: u32,
        response: Option<Answered>,
    ) {
        if let Some(answered) = &response {
            let response: Vec<(&str, String)> = answered
                .headers
                .iter()
                .map(|(name, value)| (name.as_str(), String::from_utf8_lossy(value).into_owned()))
                .collect();
            let response: Vec<(&str, &str)> = response
                .iter()
                .map(|(name, value)| (*name, value.as_str()))
                .collect();
            gateway.sim.respond(context, &response);
            // The rules that read the answer's usage settle at its end.
            let body = answered.body.as_deref().unwrap_or_default();
            gateway.sim.respond_body(context, body, true);
        }
        gateway.sim.forget(context);
        if breakers.is_empty() {
            return;
        }
        gateway.sim.flush_metrics();
        let metric = |name: &str| gateway.sim.host.metric(name);
        if response.is_none() {
            breakers.ended_unanswered(index, metric);
        } else {
            breakers.answered(index, metric);
        }
    }

    /// Answers and ends every request inside whose time has come by `now`, in time order,
    /// every gateway's clock brought to each answer's time first.
    fn answer_until(&mut self, now: Instant) {
        while let Some(Reverse(inside)) = self.inside.peek() {
            let at = inside.key.0;
            if at > now {
                break;
            }
            let Some(Reverse(inside)) = self.inside.pop() else {
                break;
            };
            for gateway in &mut self.gateways {
                gateway.sim.advance_to(at);
            }
            self.clock = self.clock.max(at);
            if let Some(gateway) = self.gateways.get_mut(inside.gateway) {
                Self::answer(
                    gateway,
                    &mut self.breakers,
                    inside.gateway,
                    inside.context,
                    inside.response,
                );
            }
            self.collect_transitions();
        }
    }

    /// The breakers' transitions every gateway's workers handed over.
    fn collect_transitions(&mut self) {
        if self.breakers.is_empty() {
            return;
        }
        for (index, gateway) in self.gateways.iter().enumerate() {
            gateway.sim.flush_metrics();
            self.breakers
                .transitions(index, gateway.sim.host.take_transitions());
        }
    }

    /// After the last request: the answers still to come, then the breakers' counters.
    fn finish(&mut self) {
        if let Some(last) = self.inside.iter().map(|Reverse(inside)| inside.key.0).max() {
            self.answer_until(last);
        }
        self.collect_transitions();
        let end = self.clock;
        let gateways = &self.gateways;
        self.breakers.finish(end, |gateway, name| {
            gateways
                .get(gateway)
                .map_or(0, |gateway| gateway.sim.host.metric(name))
        });
    }
}
