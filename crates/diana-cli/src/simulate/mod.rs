//! `diana simulate POLICY LOG`: replays a request log through a policy with the log's own
//! clock — the filter's engine (`diana_core::engine`), no gateway — and tallies per rule
//! and per second what would have been admitted, delayed and rejected.
//!
//! - Every request goes through [`Engine::evaluate`] at its log time; the engine's
//!   decision is the only source of truth (rules, actors, costs, dry run all come from it).
//! - Local rules count in an in-memory shared-data store per gateway ([`MemoryHost`], the
//!   semantics of Envoy's shared data). With `--gateways N`, requests are spread round
//!   robin over N gateways, each with its own engine and local store.
//! - Global rules call an in-process quota service shared by every gateway
//!   ([`MemoryQuota`]: all or nothing per request, dry-run rules aside, leases granted as
//!   asked), answered at once: a callout never fails or times out here.
//! - A leaky-bucket wait is a "delayed" admission with its delay; the request is not held
//!   (its turn is reserved, as in the gateway).
//! - The log is streamed: a bounded reordering buffer ([`REORDER_SECONDS`] by default) puts requests back in
//!   time order (an Envoy access log is written when a request ends, so its lines are not
//!   in start order); a line later than that is replayed at the simulation's current time
//!   and counted as late.

mod clock;
mod log;
mod report;
mod svg;
mod tally;

pub use self::log::{EnvoyField, Format};
pub use self::report::{render_json, render_text};
pub use self::svg::render_svg;

use self::log::{parse_line, Line, LineReader, RawLine, Request};
use self::tally::{Fate, Tally};
use diana_core::config::Policy;
use diana_core::decision::Decision;
use diana_core::engine::Engine;
use diana_core::metrics::{Event, MetricSink, RuleEvent};
use diana_core::quota::MemoryQuota;
use diana_core::store::{CasSemantics, MemoryHost};
use diana_core::time::{Nanos, NANOS_PER_SECOND};
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::io::{self, BufRead};

/// The default reordering window, seconds: lines up to this much out of time order are
/// replayed in order.
pub const REORDER_SECONDS: f64 = 5.0;

/// At most this many requests wait in the reordering buffer (memory bound): past it,
/// the earliest is replayed even if its window has not passed.
const MAX_BUFFERED: usize = 1_000_000;

/// Malformed lines listed by number (all are counted).
pub const MALFORMED_EXAMPLES: usize = 5;

/// Callouts one request may make before it is given up (the engine makes at most one).
const MAX_CALLOUTS: usize = 4;

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
#[derive(Debug, Default, Clone, PartialEq, Eq)]
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
    pub malformed_examples: Vec<(u64, String)>,
    /// Lines later than the reordering window: replayed at the current simulated time.
    pub late: u64,
    pub first: Option<Nanos>,
    pub last: Option<Nanos>,
}

/// The whole result.
#[derive(Debug)]
pub struct Simulation {
    pub input: InputStats,
    pub tally: Tally,
    pub gateways: usize,
    pub callouts: u64,
    /// Requests the engine still wanted a callout for after [`MAX_CALLOUTS`] (counted
    /// as rejected; never expected).
    pub unresolved: u64,
}

/// Replays `input` through `policy`.
pub fn simulate<R: BufRead>(
    policy: &Policy,
    input: R,
    options: &Options,
) -> io::Result<Simulation> {
    let mut replay = Replay::new(policy, options.gateways.max(1));
    let mut stats = InputStats::default();
    let mut buffer = Reorder::new(options.reorder);
    let mut reader = LineReader::new(input);
    while let Some((number, raw)) = reader.next_line()? {
        stats.lines = number;
        let parsed = match raw {
            RawLine::TooLong => Err(format!("longer than {} bytes", log::MAX_LINE_BYTES)),
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
    Ok(Simulation {
        input: stats,
        callouts: replay.quota.calls(),
        gateways: replay.gateways.len(),
        unresolved: replay.unresolved,
        tally: replay.tally,
    })
}

/// A request ordered by (time, line).
struct Queued(Request);

impl Queued {
    fn key(&self) -> (Nanos, u64) {
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
    newest: Nanos,
}

impl Reorder {
    fn new(window: Nanos) -> Reorder {
        Reorder {
            heap: BinaryHeap::new(),
            window,
            newest: 0,
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

/// The rule events of one request, as the engine reports them.
#[derive(Default)]
struct RequestEvents {
    rules: Vec<(usize, RuleEvent)>,
}

impl MetricSink for RequestEvents {
    fn rule_event(&mut self, rule: usize, event: RuleEvent) {
        self.rules.push((rule, event));
    }
    fn event(&mut self, _event: Event) {}
    fn degraded(&mut self, _on: bool) {}
}

/// One simulated gateway: an engine (a worker's VM) and its process's shared data.
struct Gateway {
    engine: Engine,
    host: MemoryHost,
}

struct Replay {
    gateways: Vec<Gateway>,
    next: usize,
    quota: MemoryQuota,
    /// The simulated time: the latest request time replayed.
    clock: Nanos,
    events: RequestEvents,
    tally: Tally,
    unresolved: u64,
}

impl Replay {
    fn new(policy: &Policy, gateways: usize) -> Replay {
        Replay {
            gateways: (0..gateways)
                .map(|_| Gateway {
                    engine: Engine::new(policy.clone()),
                    host: MemoryHost::new(CasSemantics::Envoy),
                })
                .collect(),
            next: 0,
            quota: MemoryQuota::new(),
            clock: 0,
            events: RequestEvents::default(),
            tally: Tally::new(policy.rules().count()),
            unresolved: 0,
        }
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
        let index = self.next % self.gateways.len();
        self.next = index + 1;
        let Some(gateway) = self.gateways.get(index) else {
            return;
        };
        self.events.rules.clear();
        let fate = if gateway.engine.serves_metrics(&request.path) {
            // The filter answers its metrics page itself: no rule applies.
            Fate::Admitted
        } else {
            let mut decision = gateway.engine.evaluate(
                &gateway.host,
                &request.path,
                request,
                Some(now),
                &mut self.events,
            );
            for _ in 0..MAX_CALLOUTS {
                let Decision::Call(callout, pending) = decision else {
                    break;
                };
                let reply = self.quota.answer(&callout, now);
                decision = gateway.engine.complete(
                    &gateway.host,
                    pending,
                    reply,
                    Some(now),
                    &mut self.events,
                );
            }
            match decision {
                Decision::Allow { .. } => Fate::Admitted,
                Decision::Delay { until, .. } if until > now => Fate::Delayed(until - now),
                Decision::Delay { .. } => Fate::Admitted,
                Decision::Reject(_) => Fate::Rejected,
                // Calls are answered at once here, so nothing is ever parked behind one.
                Decision::Call(..) | Decision::Wait(_) => {
                    self.unresolved += 1;
                    Fate::Rejected
                }
            }
        };
        self.tally
            .record(request.ts / NANOS_PER_SECOND, fate, &self.events.rules);
    }
}
