//! One worker (one VM of one host thread or process), sans IO: everything per worker that
//! a binding would otherwise keep — the configuration and its reloads, requests waiting
//! for their turn or parked behind another request's call, the calls in flight and what
//! each answer resumes, the tick and the order of work in it, the config-center poll,
//! metric batching. A binding turns host callbacks into the events below and carries out
//! the [`Command`]s returned; what the host provides synchronously (shared data, headers,
//! the clock, dispatching a call, metrics) it provides through [`Host`]. The clock is read
//! once per event, here at the door ([`Cx`]); an answer arrives as a value ([`Answer`]).
//!
//! ```text
//!   binding (src/)                 Worker                          Engine
//!   on_configure ──────────▶ configure ── parse, adopt, install ─▶ Engine::new
//!   on_request_headers ────▶ on_request_headers ── evaluate ─────▶ Decision
//!                                 │ apply (the one interpreter of a Decision):
//!                                 │   Allow  → Continue (or Resume), headers kept,
//!                                 │            or only breaker calls: Step::watch
//!                                 │            (the binding keeps them, watch.rs)
//!                                 │   Delay  → waiters            ┐
//!                                 │   Call   → dispatch, calls[token] ├ Pause
//!                                 │   Wait   → parked[rider]      ┘
//!                                 │   Reject → Reply
//!   on_http_call_response ─▶ on_call_answered(token, Answer) ── calls[token]:
//!                                 a poll, or an engine's call: Engine::answered(then),
//!                                 which gives a request's Decision (→ apply) or settles
//!   on_tick ───────────────▶ on_tick ── remote check; per configuration Engine::tick,
//!                                 whose calls are dispatched; metrics, sweeps; then
//!                                 parked and waiting requests
//!   on_response_headers ───▶ on_response_headers ── response costs, AddHeaders
//!     (a Watch kept) ──────▶ Watch::count_alone in the taps, or on_watch_answered
//!   context deleted ───────▶ on_context_gone ── give back what a paused request held
//!                                 and the places a request held (at the quota service:
//!                                 queued for the next tick, made sooner);
//!                                 its own call's answer is lost with it, so a release
//!                                 of that call waits for the next tick (on nginx, one
//!                                 gone before its own call answered: the host runs
//!                                 paused requests on, see `unheld.rs`);
//!     (a Watch kept) ──────▶ on_watch_unanswered: failed breaker calls
//! ```
//!
//! A request's life in the worker (`requests[context]`, absent when nothing is left):
//!
//! ```text
//!   (absent) ──evaluate──▶ Admitted ──response headers──▶ (absent) or Answered
//!       │ ▲                   ▲  ▲        │                 (holds places until it ends)
//!       │ └ ReadingRequest    │  │        └─ a rule reads the answer's usage ─▶ Reading
//!       │   (reserve.json:    │  │             ──body ends──▶ (absent) or Answered
//!       │    its body ends)   │  │
//!       ├──Delay──▶ Waiting ──┘  │ (its turn, from the tick)
//!       ├──Call───▶ Calling ─────┤ (its answer; or Wait/Delay/Call again)
//!       └──Wait───▶ Parked ──────┘ (its flight landed, from the tick or an answer)
//!   any stage ──context gone──▶ (absent), what it held given back (Reading: settled
//!   as cut short)
//! ```
//!
//! Calls are dispatched while the worker handles an event; commands that touch other
//! requests' streams are returned and carried out after, in order. That is the host rule
//! the order follows: on Envoy a call made after entering another request's context would
//! be filed under that request.
//!
//! The worker is `Send` by the compiler's word: the one pointer it shares is each breaker
//! handle's tap (`Arc` of atomics, `breaker/tap.rs`), which the requests whose calls their
//! binding keeps share with it. Requests and calls name their configuration by its
//! generation, and the configurations are owned here (the current one and those replaced
//! but still in use, or still tapped).

mod configure;
mod counters;
pub mod host;
pub mod sim;
mod unheld;
mod watch;

pub use crate::call::{Answer, AnswerShape, DispatchError};
pub use host::{is_host_port, CallToken, ContextId, Host, HostProfile, MetricId, MetricKind};
pub use unheld::{UNHELD_FOR, UNHELD_KEY};
pub use watch::Watch;

use crate::call::Callout;
use crate::config::OnInvalidConfig;
use crate::cx::Cx;
use crate::decision::{AfterResponse, Decision, HeaderEdit};
use crate::engine::{Call, Engine, EngineDecision, Pending, Then};
use crate::global::flights::RiderId;
use crate::lifecycle;
use crate::metrics::Event;
use crate::places::HoldingId;
use crate::response::Rejection;
use crate::store::Store;
use crate::time::Instant;
use crate::usage::{Framing, JsonPath, NoValue, RequestReader, UsageReader};
use configure::Source;
pub use configure::{on_invalid_config_of, Refused};
use counters::Counters;
use hashbrown::HashMap;
use std::cell::Cell;
use std::collections::BTreeSet;
use std::time::Duration;

/// How often the tick looks for waiting requests whose turn has come.
const WAIT_TICK: Duration = Duration::from_millis(2);
/// How often the tick looks for parked requests whose flight has landed, or refills ahead
/// (the host's finest tick: a parked request waits at most this long beyond its flight).
const RIDER_TICK: Duration = Duration::from_millis(1);
/// The tick when nobody waits: config-center checks, metric flushes, debts, sweeps.
const BASE_TICK: Duration = Duration::from_secs(1);
/// The tick while a document has a breaker of `scope: global`: its calls are reported to
/// the quota service, and the fleet's state read back, every
/// [`crate::breaker::FLEET_REPORT_EVERY`].
const FLEET_TICK: Duration =
    Duration::from_millis(crate::breaker::FLEET_REPORT_EVERY.whole_millis());
/// The tick where the host lets it be set only once (nginx) and the policy holds places at
/// the quota service: a request's place is given back from the tick, so this long after
/// its end at most (a request cannot ask for the tick there).
const PLACES_TICK: Duration = Duration::from_millis(100);

/// What the binding does after an event, beyond the current request's [`Step::pause`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Resume this paused request (from another context: enter it first).
    Resume(ContextId),
    /// Answer this request with a local reply (from another context: enter it first).
    Reply(ContextId, LocalReply),
    /// Add these headers to the current response.
    AddHeaders(Vec<(&'static str, String)>),
    /// Change this paused or current request's own headers before it goes on (set, or
    /// remove when the value is `None`; from another context: enter it first).
    EditRequest(ContextId, Vec<HeaderEdit>),
    /// Set the tick period (zero stops it).
    SetTick(Duration),
    /// Run the tick as soon as the host can, without waiting for its period: work waits
    /// in it (a lease refill ahead, places to give back, requests parked behind a call
    /// that was answered). Only for a host whose profile
    /// [`HostProfile::ticks_on_demand`]; asked once until the tick runs.
    TickNow,
}

/// Diana's own answer to a request (a rejection, the metrics page, `on_invalid_config`),
/// as the host sends it. Not the quota service's answer to a call: that is an [`Answer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
}

/// What an event asks of the binding.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// The current request stays paused (request headers: `Action::Pause`).
    pub pause: bool,
    /// To carry out in order, after the event.
    pub commands: Vec<Command>,
    /// The event's own request was admitted with only its breaker calls left to judge,
    /// on a host whose binding keeps them ([`HostProfile::keeps_breaker_calls`]): the
    /// binding keeps this with the request until its response headers, or its end
    /// ([`Watch`]). Only ever for the request whose event this is (its headers, its body's
    /// end, the answer to its own call).
    pub watch: Option<Watch>,
}

/// An accepted policy: its engine and its metrics. Requests keep the generation they
/// started with, so a reload never changes the rules under a request in flight.
pub(crate) struct Configured {
    /// Tells configurations apart (rider ids are per engine).
    generation: u64,
    engine: Engine,
    counters: Counters,
    /// The policy has a `metrics.path`.
    serves_metrics: bool,
    /// An answer without usable usage was logged (once per configuration).
    usage_logged: Cell<bool>,
}

/// A request the worker still has something for.
struct Request {
    /// Its configuration.
    generation: u64,
    stage: Stage,
    /// Rate-limit headers for the response.
    headers: Vec<(&'static str, String)>,
    /// Response costs to charge once the upstream has answered, and the places it holds.
    after: Option<AfterResponse>,
}

enum Stage {
    /// Going on; only its response is left.
    Admitted,
    /// Answered; it holds concurrency places until it ends (`after.holding`).
    Answered,
    /// Answered; its body is read as it passes for the rules whose cost it gives (one
    /// reader each, fixed size: see `usage.rs`), settled when it ends.
    Reading(Box<AnswerBody>),
    /// Paused until its body has been read: its rules reserve from it (`reserve.json`).
    ReadingRequest(Box<RequestBody>),
    /// Paused for its call (in `calls` under this token).
    Calling(CallToken),
    /// Paused behind another request's call (in `parked`).
    Parked(RiderId, Pending),
    /// Paused until its leaky-bucket turn (in `waiters`).
    Waiting(Instant),
}

/// An answer whose body is being read: one reader per rule whose cost it gives, and the
/// body's length where `content-length` says it.
struct AnswerBody {
    readers: Vec<UsageReader>,
    /// A body of a known length has ended with its last byte, whether or not the host says
    /// so: ngx_wasm_module never does for one that came in more than one chunk (it takes
    /// a chunk for the last only when that chunk alone is `content-length` long).
    length: Option<u64>,
}

impl AnswerBody {
    fn complete(&self) -> bool {
        let read = self.readers.first().map_or(0, UsageReader::bytes_read);
        self.length.is_some_and(|length| read >= length)
    }
}

/// A request held for its body: where it goes, and one reader per path its rules reserve
/// from (fixed size each, whatever the body's size).
struct RequestBody {
    raw_path: Vec<u8>,
    readers: Vec<(JsonPath, RequestReader)>,
}

/// A call in flight, by its token: the config center's document, or one of an engine's
/// calls with what its answer resumes.
enum Flight {
    Poll,
    Engine {
        generation: u64,
        /// The request waiting for it, if any; `own`: the call was made from that
        /// request's context, so its answer arrives there.
        waiting: Option<(ContextId, bool)>,
        then: Then,
    },
}

/// Where a decision is applied from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// The request's own headers: it is not paused.
    Headers,
    /// The answer to its own call, in its own context.
    OwnCall,
    /// Another context: the tick, or another call's answer.
    Elsewhere,
}

/// See the module docs.
pub struct Worker {
    profile: HostProfile,
    store: Store,
    /// Configuration events, counted before any policy exists.
    events: Option<Counters>,
    configured: Option<Configured>,
    /// Replaced configurations still used by requests or calls, or owing: ticked until
    /// nothing holds them.
    retired: Vec<Configured>,
    generations: u64,
    source: Source,
    requests: HashMap<ContextId, Request>,
    waiters: BTreeSet<(Instant, ContextId)>,
    parked: HashMap<(u64, RiderId), ContextId>,
    calls: HashMap<CallToken, Flight>,
    /// The tick period when nobody waits (zero: none needed).
    base_tick: Duration,
    /// The tick period set last.
    tick: Option<Duration>,
    /// A tick is running, or was asked for with [`Command::TickNow`] and has not run yet.
    tick_coming: bool,
    /// No usable configuration on a host where refusing it stops the worker: what
    /// requests get meanwhile.
    invalid: Option<OnInvalidConfig>,
    /// Requests do not pause for calls before this instant: the host was seen running a
    /// paused request on ([`unheld`]; 0: not seen, as far as this worker knows).
    unheld_until: Instant,
    /// The error line naming the missing directive was logged.
    unheld_logged: bool,
    /// The warning about claims read from the `authorization` header was logged.
    claims_warned: bool,
}

// The compiler's word that a worker moves between threads whole (the native binding keeps
// one per Envoy worker thread behind a mutex, reached from the main thread too).
const _: fn() = || {
    fn send<T: Send>() {}
    send::<Worker>();
    send::<Step>();
};

impl Worker {
    pub fn new(profile: HostProfile) -> Worker {
        Worker {
            profile,
            store: if profile.strict_compare_and_swap {
                Store::strict()
            } else {
                Store::new()
            },
            events: None,
            configured: None,
            retired: Vec::new(),
            generations: 0,
            source: Source::default(),
            requests: HashMap::new(),
            waiters: BTreeSet::new(),
            parked: HashMap::new(),
            calls: HashMap::new(),
            base_tick: Duration::ZERO,
            tick: None,
            tick_coming: false,
            invalid: None,
            unheld_until: Instant::EPOCH,
            unheld_logged: false,
            claims_warned: false,
        }
    }

    pub fn profile(&self) -> HostProfile {
        self.profile
    }

    /// The engine new requests are evaluated with (for tests and tools).
    pub fn engine(&self) -> Option<&Engine> {
        self.configured
            .as_ref()
            .map(|configured| &configured.engine)
    }

    /// Requests the worker holds something for (bounded by the requests in the host).
    pub fn requests_held(&self) -> usize {
        self.requests.len()
    }

    /// Requests paused now: waiting, parked, or calling.
    pub fn paused(&self) -> usize {
        self.requests
            .values()
            .filter(|request| {
                !matches!(
                    request.stage,
                    Stage::Admitted | Stage::Answered | Stage::Reading(_)
                )
            })
            .count()
    }

    /// Calls in flight.
    pub fn calls_in_flight(&self) -> usize {
        self.calls.len()
    }

    /// When a request waiting for its leaky-bucket turn is resumed.
    pub fn waiting_until(&self, context: ContextId) -> Option<Instant> {
        match self.requests.get(&context)?.stage {
            Stage::Waiting(until) => Some(until),
            _ => None,
        }
    }

    /// Hands the counts of every configuration to the host now (the tick does otherwise).
    pub fn flush_metrics(&self, host: &dyn Host) {
        for configured in self.generations() {
            configured
                .engine
                .take_breaker_taps(&mut configured.counters.sink());
            configured.counters.flush(host);
        }
        if let Some(events) = &self.events {
            events.flush(host);
        }
    }

    /// A request's headers arrived: evaluate it. No body follows, or the binding does not
    /// hold the request for it ([`Worker::on_request_headers_with_body`]).
    pub fn on_request_headers(&mut self, host: &dyn Host, context: ContextId) -> Step {
        self.request_headers(host, context, false)
    }

    /// A request's headers arrived and its body follows. A request whose rules reserve
    /// from its body (`reserve.json`) is held (paused) until the body has been read, on a
    /// host that can ([`HostProfile::holds_requests_for_bodies`]): the binding hands its
    /// body over ([`Worker::on_request_body`]), and the decision comes at its end. Any
    /// other request is evaluated at once.
    pub fn on_request_headers_with_body(&mut self, host: &dyn Host, context: ContextId) -> Step {
        self.request_headers(host, context, self.profile.holds_requests_for_bodies)
    }

    fn request_headers(&mut self, host: &dyn Host, context: ContextId, body_follows: bool) -> Step {
        let mut step = Step::default();
        // nginx: the first request or tick probes shared data and installs the document.
        self.shared_data_ready(host);
        let Some(configured) = self.configured.as_ref() else {
            if let Some(reply) = self.invalid.and_then(configure::invalid_reply) {
                step.commands.push(Command::Reply(context, reply));
                step.pause = true;
            }
            return step;
        };
        // Read only when a decision depends on it (a host call, and a copy).
        let read_path;
        let raw_path: &[u8] = if configured.engine.needs_path() || configured.serves_metrics {
            read_path = host.header(":path").unwrap_or_default();
            &read_path
        } else {
            b"/"
        };
        if configured.serves_metrics && configured.engine.serves_metrics(raw_path) {
            configured
                .engine
                .take_breaker_taps(&mut configured.counters.sink());
            let reply = LocalReply {
                status: 200,
                headers: vec![("content-type", "text/plain; version=0.0.4".to_string())],
                body: configured.counters.exposition(host),
            };
            step.commands.push(Command::Reply(context, reply));
            step.pause = true;
            return step;
        }
        let Some(now) = host.now() else {
            // Without a clock nothing is written: admitted uncounted.
            configured.counters.event(Event::ClockError);
            return step;
        };
        let generation = configured.generation;
        if body_follows {
            let paths = configured.engine.request_body_paths(raw_path);
            if !paths.is_empty() {
                let body = RequestBody {
                    raw_path: raw_path.to_vec(),
                    readers: paths
                        .into_iter()
                        .map(|path| {
                            let reader = RequestReader::new(&path);
                            (path, reader)
                        })
                        .collect(),
                };
                let stage = Stage::ReadingRequest(Box::new(body));
                self.hold(context, generation, stage, Vec::new(), None);
                step.pause = true;
                return step;
            }
        }
        self.decide(host, now, context, generation, raw_path, &[], &mut step);
        step
    }

    /// Evaluates a request (with the numbers its body had, where it was read) and applies
    /// the decision, from its own event: headers, or the end of its body.
    #[allow(clippy::too_many_arguments)]
    fn decide(
        &mut self,
        host: &dyn Host,
        now: Instant,
        context: ContextId,
        generation: u64,
        raw_path: &[u8],
        numbers: &[(JsonPath, Option<u64>)],
        step: &mut Step,
    ) {
        let Some(configured) = self.generation(generation) else {
            return;
        };
        let mut sink = configured.counters.sink();
        let mut cx = Cx::new(host, now, &mut sink);
        let facts = host::ProfiledFacts {
            host,
            bearer: self.profile.bearer,
        };
        let decision = if numbers.is_empty() {
            configured.engine.evaluate(&mut cx, raw_path, &facts)
        } else {
            let facts = host::BodyFacts {
                facts: &facts,
                numbers,
            };
            configured.engine.evaluate(&mut cx, raw_path, &facts)
        };
        self.apply(
            host,
            now,
            context,
            generation,
            decision,
            Origin::Headers,
            step,
        );
        self.retick(step);
    }

    /// While the worker holds this request for its body: how many of the body's bytes it
    /// has read. A binding whose host hands over the whole body buffered so far at each
    /// callback passes on only the bytes after these.
    pub fn reads_request_body(&self, context: ContextId) -> Option<u64> {
        match &self.requests.get(&context)?.stage {
            Stage::ReadingRequest(body) => Some(
                body.readers
                    .first()
                    .map_or(0, |(_, reader)| reader.bytes_read()),
            ),
            _ => None,
        }
    }

    /// The next bytes of a request's body the worker holds it for; `end`: the body ends
    /// with them (they may be empty). Until the end the request stays paused (the host
    /// buffers its body); at the end it is decided, with the numbers its body had.
    pub fn on_request_body(
        &mut self,
        host: &dyn Host,
        context: ContextId,
        chunk: &[u8],
        end: bool,
    ) -> Step {
        let mut step = Step::default();
        let Some(request) = self.requests.get_mut(&context) else {
            return step;
        };
        let Stage::ReadingRequest(body) = &mut request.stage else {
            return step;
        };
        for (_, reader) in body.readers.iter_mut() {
            reader.feed(chunk);
        }
        if !end {
            step.pause = true;
            return step;
        }
        let Some(Request {
            generation,
            stage: Stage::ReadingRequest(body),
            ..
        }) = self.requests.remove(&context)
        else {
            return step;
        };
        let RequestBody { raw_path, readers } = *body;
        // A body without a number at a path (none, malformed, cut) reserves `default`.
        let numbers: Vec<(JsonPath, Option<u64>)> = readers
            .into_iter()
            .map(|(path, reader)| (path, reader.finish().ok()))
            .collect();
        let Some(now) = host.now() else {
            if let Some(configured) = self.generation(generation) {
                configured.counters.event(Event::ClockError);
            }
            return step;
        };
        self.decide(
            host, now, context, generation, &raw_path, &numbers, &mut step,
        );
        step
    }

    /// A request's response headers arrived: charge its response costs, add its headers.
    /// A rule whose cost the answer's body gives is settled when the body ends
    /// ([`Worker::on_response_body`]); a binding whose response headers end the stream
    /// hands over an empty last chunk.
    pub fn on_response_headers(&mut self, host: &dyn Host, context: ContextId) -> Step {
        let mut step = Step::default();
        let Some(mut request) = self.requests.remove(&context) else {
            return step;
        };
        if !matches!(request.stage, Stage::Admitted) {
            // A paused request answered by the host itself (its own local reply): it is
            // still ours until its context goes.
            self.requests.insert(context, request);
            return step;
        }
        if let Some(after) = request.after.take() {
            self.settle(host, request.generation, &after);
            let readers = if after.reads_body() {
                self.body_readers(host, request.generation, &after)
            } else {
                None
            };
            if let Some(readers) = readers {
                // Kept until its body ends: the body charges, and its places.
                self.hold(
                    context,
                    request.generation,
                    Stage::Reading(readers),
                    Vec::new(),
                    Some(after),
                );
            } else if let Some(holding) = after.holding() {
                self.hold_places(context, request.generation, holding);
            }
        }
        if !request.headers.is_empty() {
            step.commands.push(Command::AddHeaders(request.headers));
        }
        step
    }

    /// The response headers of a request whose breaker calls its binding kept
    /// ([`Step::watch`]) came, and [`Watch::count_alone`] gave the watch back: its calls are
    /// judged here as those of a request the worker kept (its status, as
    /// [`Host::response_status`] tells it, and the clock read again).
    pub fn on_watch_answered(&mut self, host: &dyn Host, watch: Watch) -> Step {
        self.settle(host, watch.generation, &watch.after());
        Step::default()
    }

    /// A request whose breaker calls its binding kept ([`Step::watch`]) ended without
    /// response headers (a reset, an upstream timeout, its client gone): a failed call of
    /// each breaker.
    pub fn on_watch_unanswered(&mut self, host: &dyn Host, watch: Watch) -> Step {
        let Some(configured) = self.generation(watch.generation) else {
            return Step::default();
        };
        let Some(now) = host.now() else {
            configured.counters.event(Event::ClockError);
            return Step::default();
        };
        let mut sink = configured.counters.sink();
        let mut cx = Cx::new(host, now, &mut sink);
        configured.engine.unanswered(&mut cx, &watch.after());
        Step::default()
    }

    /// The readers of an answer's body for the rules whose cost it gives, framed by its
    /// `content-type` (server-sent events, else one JSON document), and its length.
    fn body_readers(
        &self,
        host: &dyn Host,
        generation: u64,
        after: &AfterResponse,
    ) -> Option<Box<AnswerBody>> {
        let configured = self.generation(generation)?;
        let framing = host
            .response_header("content-type")
            .map_or(Framing::Json, |value| Framing::of_content_type(&value));
        let readers = configured.engine.body_readers(after, framing);
        if readers.is_empty() {
            return None;
        }
        let length = host
            .response_header("content-length")
            .and_then(|value| std::str::from_utf8(&value).ok()?.trim().parse().ok());
        Some(Box::new(AnswerBody { readers, length }))
    }

    /// True while the worker reads this request's answer body (a rule charges from it): a
    /// binding reads a body chunk (a host call and a copy) only then.
    pub fn reads_response_body(&self, context: ContextId) -> bool {
        self.requests
            .get(&context)
            .is_some_and(|request| matches!(request.stage, Stage::Reading(_)))
    }

    /// One chunk of a request's answer body, as the host forwards it (it is never held or
    /// changed); `end`: the body ends with it (the chunk may be empty). At the end the
    /// rules whose cost the body gives are settled.
    pub fn on_response_body(
        &mut self,
        host: &dyn Host,
        context: ContextId,
        chunk: &[u8],
        end: bool,
    ) -> Step {
        let mut step = Step::default();
        let Some(request) = self.requests.get_mut(&context) else {
            return step;
        };
        let Stage::Reading(body) = &mut request.stage else {
            return step;
        };
        for reader in body.readers.iter_mut() {
            reader.feed(chunk);
        }
        if !end && !body.complete() {
            return step;
        }
        let Some(request) = self.requests.remove(&context) else {
            return step;
        };
        if let Some((generation, holding)) = self.body_ended(host, request, true) {
            self.hold_places(context, generation, holding);
        }
        self.retick(&mut step);
        step
    }

    /// Settles a request whose body was being read: it ended (`whole`), or was cut short
    /// (its context went first). Gives back its configuration and places, if it holds
    /// any. A cut stream is never read as whole: what its events reported before the cut
    /// is a floor ([`crate::settle::BodyCost::CutShort`]).
    fn body_ended(
        &mut self,
        host: &dyn Host,
        request: Request,
        whole: bool,
    ) -> Option<(u64, HoldingId)> {
        let Request {
            generation,
            stage: Stage::Reading(body),
            after: Some(after),
            ..
        } = request
        else {
            return None;
        };
        let holding = after.holding().map(|holding| (generation, holding));
        // Its context may go right after its last byte, before the host said it ended.
        let whole = whole || body.complete();
        let read: Vec<_> = body
            .readers
            .into_iter()
            .map(|reader| match (reader.finish(), whole) {
                (read, true) => read,
                (Ok(usage), false) => Err(NoValue::CutShort { seen: Some(usage) }),
                (Err(NoValue::Absent), false) => Err(NoValue::CutShort { seen: None }),
                (Err(problem), false) => Err(problem),
            })
            .collect();
        let configured = self.generation(generation)?;
        let Some(now) = host.now() else {
            // Without a clock nothing is written: the reservations stand.
            configured.counters.event(Event::ClockError);
            return holding;
        };
        let mut sink = configured.counters.sink();
        let mut cx = Cx::new(host, now, &mut sink);
        let trouble = configured.engine.after_body(&mut cx, &after, read);
        if let Some(trouble) = trouble {
            if !configured.usage_logged.replace(true) {
                log::warn!(
                    "diana: rule {}: an answer's body gave no usage ({}); its reservation stands (counted in diana_usage_unread; logged once per document)",
                    trouble.rule,
                    trouble.problem
                );
            }
        }
        holding
    }

    /// Charges an answered request's response costs and judges its breakers' calls.
    fn settle(&self, host: &dyn Host, generation: u64, after: &AfterResponse) {
        let Some(configured) = self.generation(generation) else {
            return;
        };
        if after.charges.is_empty() && !after.reads_status() {
            return;
        }
        let status = after
            .reads_status()
            .then(|| host.response_status())
            .flatten();
        let mut sink = configured.counters.sink();
        // A breaker's good call without `slow_ms` is judged without the time.
        if configured
            .engine
            .judged_without_clock(&mut sink, after, status)
        {
            return;
        }
        let Some(now) = host.now() else {
            configured.counters.event(Event::ClockError);
            return;
        };
        let values: Vec<Option<Vec<u8>>> = after
            .headers()
            .map(|name| host.response_header(name))
            .collect();
        let mut cx = Cx::new(host, now, &mut sink);
        configured
            .engine
            .after_response(&mut cx, after, &values, status);
    }

    /// What of the answer to the call `token` the worker reads (for a binding that reads
    /// an answer through host calls): a poll's `ETag` and signature too, and its body up to
    /// a document's size.
    pub fn answer_shape(&self, token: CallToken) -> AnswerShape {
        match self.calls.get(&token) {
            Some(Flight::Engine { then, .. }) => then.answer_shape(),
            Some(Flight::Poll) => configure::POLL_ANSWER,
            None => AnswerShape::STATUS,
        }
    }

    /// The answer to a call, whatever it was for, as the host hands it over. From the
    /// context that made the call.
    pub fn on_call_answered(&mut self, host: &dyn Host, token: CallToken, answer: Answer) -> Step {
        let mut step = Step::default();
        let Some(flight) = self.calls.remove(&token) else {
            return step;
        };
        let (generation, waiting, then) = match flight {
            Flight::Poll => {
                self.on_poll_answer(host, answer);
                self.retick(&mut step);
                return step;
            }
            Flight::Engine {
                generation,
                waiting,
                then,
            } => (generation, waiting, then),
        };
        let now = host.now();
        let decision = match self.generation(generation) {
            Some(configured) => match now {
                Some(now) => {
                    let mut sink = configured.counters.sink();
                    let mut cx = Cx::new(host, now, &mut sink);
                    configured.engine.answered(&mut cx, then, answer)
                }
                None => {
                    configured.counters.event(Event::ClockError);
                    configured.engine.without_clock(host, then)
                }
            },
            None => None,
        };
        match (decision, waiting) {
            (Some(decision), Some((context, own))) => {
                let calling = self.requests.get(&context).is_some_and(
                    |request| matches!(request.stage, Stage::Calling(at) if at == token),
                );
                if calling {
                    self.requests.remove(&context);
                    let origin = if own {
                        Origin::OwnCall
                    } else {
                        Origin::Elsewhere
                    };
                    let now = now.unwrap_or(Instant::EPOCH);
                    self.apply(host, now, context, generation, decision, origin, &mut step);
                }
                if !own {
                    // The requests parked behind this flight are served now, not a tick
                    // later. Not from a request's own context: a rider that leads the next
                    // call makes it from the context it is served in, and a call made from
                    // a request's context dies with that request (the host drops its
                    // answer when the stream ends, which may come first); the calls of the
                    // root context (the tick, and here) outlive every request. Riders
                    // behind a request's own call are served by the tick, asked for at
                    // once where the host can (`work_waits_for_tick`).
                    self.serve_riders(host, &mut step);
                }
            }
            // An orphan's or a refill's answer: the riders behind its flight plan again.
            (None, None) => self.serve_riders(host, &mut step),
            _ => {}
        }
        // The outage gauge is written when it changes, not at the next tick.
        for configured in self.generations() {
            configured.counters.flush_gauge(host);
        }
        self.retick(&mut step);
        step
    }

    /// Whether the worker tracks this request (it waits, calls, is parked, or holds
    /// headers, response costs or places for it). One it does not track is done with: its
    /// later events ([`Worker::on_response_headers`], [`Worker::on_context_gone`]) do
    /// nothing, and no other event reaches it, so a binding may skip them (the native
    /// module does, to spare them its worker's lock). A request admitted with nothing kept
    /// is the common case: local rules without headers on allowed responses.
    pub fn tracks(&self, context: ContextId) -> bool {
        self.requests.contains_key(&context)
    }

    /// The host deleted a request's context (it ended, or its client went away): what a
    /// paused request held is given back, and the requests parked behind its call plan
    /// again. On a host that holds paused requests only with a directive, one deleted
    /// before its own call answered shows the directive missing (`unheld.rs`).
    pub fn on_context_gone(&mut self, host: &dyn Host, context: ContextId) -> Step {
        let Some(mut request) = self.requests.remove(&context) else {
            return Step::default();
        };
        if matches!(request.stage, Stage::Reading(_)) {
            // Its body was cut short: settled as such, then its places go back below.
            let Some((generation, holding)) = self.body_ended(host, request, false) else {
                return Step::default();
            };
            request = Request {
                generation,
                stage: Stage::Answered,
                headers: Vec::new(),
                after: Some(AfterResponse {
                    holding: Some(holding),
                    ..AfterResponse::default()
                }),
            };
        }
        let mut step = Step::default();
        let generation = request.generation;
        let now = host.now();
        let holding = request.after.as_ref().and_then(AfterResponse::holding);
        let mut own_call_lost = false;
        if let Some(configured) = self.generation(generation) {
            let mut sink = configured.counters.sink();
            match now {
                Some(now) => {
                    let mut cx = Cx::new(host, now, &mut sink);
                    if let Some(holding) = holding {
                        configured.engine.end(&mut cx, holding);
                    }
                    if let Some(after) = request.after.as_ref().filter(|a| a.reads_status()) {
                        match request.stage {
                            // Admitted, its response never came.
                            Stage::Admitted => configured.engine.unanswered(&mut cx, after),
                            // Its turn never came.
                            Stage::Waiting(_) => configured.engine.never_left(&mut cx, after),
                            _ => {}
                        }
                    }
                }
                None => {
                    if let Some(holding) = holding {
                        configured.engine.end_without_clock(holding, &mut sink);
                    }
                }
            }
        }
        if holding.is_some() {
            // Places at the quota service go back from the next tick, made sooner.
            self.retick(&mut step);
        }
        match request.stage {
            // Nothing taken yet: decided only once its body ended.
            Stage::Admitted | Stage::Answered | Stage::Reading(_) | Stage::ReadingRequest(_) => {}
            Stage::Waiting(until) => {
                if self.waiters.remove(&(until, context)) {
                    if let Some(configured) = self.generation(generation) {
                        configured.counters.event(Event::DelayAbandoned);
                    }
                }
            }
            Stage::Calling(token) => {
                // A call made from the request's own context is dropped with it by the
                // host (the SDK files its answer under the context): what it held goes
                // back now, and the call is released from the next tick (the service
                // gives its grant back). One made from another context still answers.
                match self.calls.remove(&token) {
                    Some(Flight::Engine {
                        generation,
                        waiting: Some((_, false)),
                        then,
                    }) => {
                        let orphan = Flight::Engine {
                            generation,
                            waiting: None,
                            then: then.for_nobody(),
                        };
                        self.calls.insert(token, orphan);
                    }
                    Some(Flight::Engine { then, .. }) => {
                        own_call_lost = true;
                        self.abandon_call(host, now, generation, then);
                    }
                    Some(poll @ Flight::Poll) => {
                        self.calls.insert(token, poll);
                    }
                    None => {}
                }
            }
            Stage::Parked(rider, pending) => {
                self.parked.remove(&(generation, rider));
                if let (Some(configured), Some(now)) = (self.generation(generation), now) {
                    let mut sink = configured.counters.sink();
                    let mut cx = Cx::new(host, now, &mut sink);
                    configured.engine.abandon(&mut cx, pending);
                }
            }
        }
        if let (true, Some(directive)) = (own_call_lost, self.profile.pausing_needs) {
            self.seen_unheld(host, directive);
        }
        step
    }

    /// The answer to a request's own call will never come: the engine gives back what the
    /// request held and releases the call's grant from the next tick. Without a clock
    /// nothing is written.
    fn abandon_call(&self, host: &dyn Host, now: Option<Instant>, generation: u64, then: Then) {
        let (Some(configured), Some(now)) = (self.generation(generation), now) else {
            return;
        };
        let mut sink = configured.counters.sink();
        let mut cx = Cx::new(host, now, &mut sink);
        configured.engine.abandon_call(&mut cx, then);
    }

    /// The worker's tick: the config center, then every configuration's own tick (its
    /// calls are made), metrics and sweeps; then the parked and waiting requests whose
    /// time has come.
    pub fn on_tick(&mut self, host: &dyn Host) -> Step {
        let mut step = Step::default();
        // nginx: the first tick or request probes shared data and installs the document;
        // the tick's own work starts with the next tick.
        if self.shared_data_ready(host) != configure::ZoneCheck::Usable {
            return step;
        }
        let Some(now) = host.now() else {
            return step;
        };
        self.tick_coming = true;
        self.check_remote(host, now);
        let mut due: Vec<(u64, Call)> = Vec::new();
        for configured in self.generations() {
            let mut sink = configured.counters.sink();
            let mut cx = Cx::new(host, now, &mut sink);
            let calls = configured.engine.tick(&mut cx);
            due.extend(calls.into_iter().map(|call| (configured.generation, call)));
        }
        for (generation, call) in due {
            self.send(host, now, generation, call);
        }
        for configured in self.generations() {
            configured.counters.flush(host);
        }
        // A replaced configuration is let go once no request or call names it and it owes
        // nothing.
        let in_use: BTreeSet<u64> = self
            .requests
            .values()
            .map(|request| request.generation)
            .chain(self.calls.values().filter_map(|flight| match flight {
                Flight::Engine { generation, .. } => Some(*generation),
                Flight::Poll => None,
            }))
            .collect();
        self.retired.retain(|configured| {
            in_use.contains(&configured.generation)
                || configured.engine.owes_work()
                || configured.engine.breakers_tapped()
        });
        if let Some(events) = &self.events {
            events.flush(host);
        }
        if lifecycle::has_work(&self.store, host) {
            lifecycle::sweep(&self.store, host);
        }
        if self.profile.resumes_from_other_contexts {
            self.serve_riders(host, &mut step);
            while let Some(&(until, context)) = self.waiters.first() {
                if until > now {
                    break;
                }
                self.waiters.pop_first();
                if let Some(request) = self.requests.get_mut(&context) {
                    request.stage = Stage::Admitted;
                }
                step.commands.push(Command::Resume(context));
            }
        }
        // The tick stops when nothing needs it any more (released records, no policy).
        self.base_tick = self.wanted_base_tick(host);
        self.retick(&mut step);
        self.tick_coming = false;
        step
    }

    /// Sends one of an engine's own calls (no request waits for it); one the host does not
    /// send is answered at once as not sent.
    fn send(&mut self, host: &dyn Host, now: Instant, generation: u64, call: Call) {
        match self.dispatch(host, &call.callout) {
            Ok(token) => {
                let flight = Flight::Engine {
                    generation,
                    waiting: None,
                    then: call.then,
                };
                self.calls.insert(token, flight);
            }
            Err(error) => {
                log::debug!("diana: a call was not sent: {error}");
                if let Some(configured) = self.generation(generation) {
                    let mut sink = configured.counters.sink();
                    let mut cx = Cx::new(host, now, &mut sink);
                    let _ = configured
                        .engine
                        .answered(&mut cx, call.then, Answer::NotSent(error));
                }
            }
        }
    }

    /// The current configuration and the replaced ones still in use.
    fn generations(&self) -> impl Iterator<Item = &Configured> {
        self.configured.iter().chain(&self.retired)
    }

    /// The configuration of `generation`, if it is still kept.
    fn generation(&self, generation: u64) -> Option<&Configured> {
        self.generations()
            .find(|configured| configured.generation == generation)
    }

    /// Takes `decision` for the request of `context`: the one place a [`Decision`] is
    /// interpreted.
    #[allow(clippy::too_many_arguments)]
    fn apply(
        &mut self,
        host: &dyn Host,
        now: Instant,
        context: ContextId,
        generation: u64,
        decision: EngineDecision,
        origin: Origin,
        step: &mut Step,
    ) {
        match decision {
            Decision::Allow {
                headers,
                after,
                upstream,
            } => {
                if !upstream.is_empty() {
                    let upstream = self.for_upstream(upstream);
                    step.commands.push(Command::EditRequest(context, upstream));
                }
                let own_event = matches!(origin, Origin::Headers | Origin::OwnCall);
                match after {
                    Some(after) if own_event && headers.is_empty() => {
                        match self.watch(context, generation, after) {
                            Ok(watch) => step.watch = Some(watch),
                            Err(after) => self.hold(
                                context,
                                generation,
                                Stage::Admitted,
                                headers,
                                Some(after),
                            ),
                        }
                    }
                    after @ Some(_) => {
                        self.hold(context, generation, Stage::Admitted, headers, after)
                    }
                    None if !headers.is_empty() => {
                        self.hold(context, generation, Stage::Admitted, headers, None)
                    }
                    None => {}
                }
                let resume = match origin {
                    Origin::Headers => false,
                    Origin::OwnCall => !self.profile.resumes_after_own_call,
                    Origin::Elsewhere => true,
                };
                if resume {
                    step.commands.push(Command::Resume(context));
                }
            }
            Decision::Delay {
                until,
                headers,
                after,
                upstream,
            } => {
                if !upstream.is_empty() {
                    let upstream = self.for_upstream(upstream);
                    step.commands.push(Command::EditRequest(context, upstream));
                }
                self.waiters.insert((until, context));
                self.hold(context, generation, Stage::Waiting(until), headers, after);
                step.pause = true;
            }
            Decision::Reject(rejection) => {
                let reply = self.local_reply(rejection);
                step.commands.push(Command::Reply(context, reply));
                step.pause = true;
            }
            Decision::Call(Call { callout, then }) => match self
                .may_hold_for_call(host, now)
                .and_then(|()| self.dispatch(host, &callout))
            {
                Ok(token) => {
                    let own = origin != Origin::Elsewhere;
                    let flight = Flight::Engine {
                        generation,
                        waiting: Some((context, own)),
                        then,
                    };
                    self.calls.insert(token, flight);
                    self.hold(context, generation, Stage::Calling(token), Vec::new(), None);
                    step.pause = true;
                }
                Err(error) => {
                    let Some(configured) = self.generation(generation) else {
                        return;
                    };
                    let mut sink = configured.counters.sink();
                    let mut cx = Cx::new(host, now, &mut sink);
                    let Some(decision) =
                        configured
                            .engine
                            .answered(&mut cx, then, Answer::NotSent(error))
                    else {
                        return;
                    };
                    self.apply(host, now, context, generation, decision, origin, step);
                }
            },
            Decision::Wait(pending) => {
                // The engine parks only where the profile can resume from elsewhere.
                let Some(rider) = pending.rider() else {
                    return;
                };
                self.parked.insert((generation, rider), context);
                self.hold(
                    context,
                    generation,
                    Stage::Parked(rider, pending),
                    Vec::new(),
                    None,
                );
                step.pause = true;
            }
        }
    }

    /// An answered request's places are held until it ends (its context goes).
    fn hold_places(&mut self, context: ContextId, generation: u64, holding: HoldingId) {
        let after = AfterResponse {
            holding: Some(holding),
            ..AfterResponse::default()
        };
        self.hold(
            context,
            generation,
            Stage::Answered,
            Vec::new(),
            Some(after),
        );
    }

    fn hold(
        &mut self,
        context: ContextId,
        generation: u64,
        stage: Stage,
        headers: Vec<(&'static str, String)>,
        after: Option<AfterResponse>,
    ) {
        self.requests.insert(
            context,
            Request {
                generation,
                stage,
                headers,
                after,
            },
        );
    }

    /// An admitted request's breaker calls as a value for its binding to keep, when the host
    /// keeps them ([`HostProfile::keeps_breaker_calls`]) and judging them is all that is left
    /// of it ([`Watch`]); else `after` back, for the worker to keep.
    fn watch(
        &self,
        context: ContextId,
        generation: u64,
        after: AfterResponse,
    ) -> Result<Watch, AfterResponse> {
        if !self.profile.keeps_breaker_calls {
            return Err(after);
        }
        let taps = self
            .generation(generation)
            .and_then(|configured| configured.engine.taps(&after));
        match taps {
            Some(calls) => Ok(Watch {
                context,
                generation,
                left_at: after.left_at,
                calls,
            }),
            None => Err(after),
        }
    }

    /// A rejection as the host sends it (ngx_wasm_module appends a line feed to every
    /// local reply's body: one less is sent, so the client gets the configured body).
    /// The edits as this host must make them: a removal is an empty value where a
    /// removed header would still reach the upstream
    /// ([`HostProfile::removed_headers_reach_upstream`]).
    fn for_upstream(&self, mut edits: Vec<HeaderEdit>) -> Vec<HeaderEdit> {
        if self.profile.removed_headers_reach_upstream {
            for edit in &mut edits {
                edit.value.get_or_insert_with(String::new);
            }
        }
        edits
    }

    fn local_reply(&self, rejection: Rejection) -> LocalReply {
        let mut body = rejection.body;
        if self.profile.appends_line_feed_to_replies && body.ends_with('\n') {
            body.pop();
        }
        LocalReply {
            status: rejection.status,
            headers: rejection.headers,
            body,
        }
    }

    /// A request paused for its own call was deleted before the answer, which a host that
    /// holds paused requests never does: this one runs them on (see [`unheld`]). Every
    /// worker stops pausing for a while; this one is likely to crash when the call
    /// answers, so the line that says why is logged now.
    fn seen_unheld(&mut self, host: &dyn Host, directive: &str) {
        let Some(now) = host.now() else {
            return;
        };
        unheld::record(&self.store, host, now);
        self.unheld_until = now.saturating_add(UNHELD_FOR);
        self.unheld_logged = true;
        log::error!(
            "diana: {} ran a request on while Diana held it paused for its call, and may crash \
             this worker when the call answers: add `{directive}` to every location with \
             `proxy_wasm diana` (nginx/README.md); until then every worker decides global \
             rules locally, for {} s after each time this is seen",
            self.profile.name,
            UNHELD_FOR / crate::time::NANOS_PER_SECOND
        );
    }

    /// Whether a request may pause for its call now: not for [`UNHELD_FOR`] after a
    /// worker saw this host run a paused request on. The refusal takes the path of a call
    /// not sent: decided locally, without pausing (and without blaming the service).
    fn may_hold_for_call(&mut self, host: &dyn Host, now: Instant) -> Result<(), DispatchError> {
        let Some(directive) = self.profile.pausing_needs else {
            return Ok(());
        };
        if now >= self.unheld_until {
            // Shared data is read only past what this worker already knows.
            match unheld::unheld_until(&self.store, host, now) {
                Some(until) => self.unheld_until = until,
                None => return Ok(()),
            }
        }
        if !self.unheld_logged {
            self.unheld_logged = true;
            log::error!(
                "diana: {} does not hold requests paused for their calls here: add \
                 `{directive}` to every location with `proxy_wasm diana` (nginx/README.md); \
                 until then global rules are decided locally, without pausing",
                self.profile.name
            );
        }
        Err(DispatchError::CannotPause { needs: directive })
    }

    /// Sends `callout` through the host, within this host's rules for upstreams.
    fn dispatch(&self, host: &dyn Host, callout: &Callout) -> Result<CallToken, DispatchError> {
        if self.profile.upstreams_are_host_port && !is_host_port(&callout.upstream) {
            return Err(DispatchError::NotHostPort {
                upstream: callout.upstream.clone(),
            });
        }
        host.dispatch(callout)
    }

    /// Plans the parked requests whose flight has landed again.
    fn serve_riders(&mut self, host: &dyn Host, step: &mut Step) {
        if self.parked.is_empty() {
            return;
        }
        let Some(now) = host.now() else {
            return;
        };
        let generations: Vec<u64> = self
            .generations()
            .filter(|configured| configured.engine.has_riders())
            .map(|configured| configured.generation)
            .collect();
        for generation in generations {
            if let Some(configured) = self.generation(generation) {
                configured.engine.land_overdue(now);
            }
            // One at a time: a rider that leads a flight takes the riders after it along.
            while let Some(rider) = self
                .generation(generation)
                .and_then(|configured| configured.engine.next_woken())
            {
                let Some(context) = self.parked.remove(&(generation, rider)) else {
                    continue;
                };
                let Some(request) = self.requests.remove(&context) else {
                    continue;
                };
                let Stage::Parked(_, pending) = request.stage else {
                    self.requests.insert(context, request);
                    continue;
                };
                let Some(configured) = self.generation(generation) else {
                    break;
                };
                let mut sink = configured.counters.sink();
                let mut cx = Cx::new(host, now, &mut sink);
                let decision = configured.engine.resume(&mut cx, pending);
                self.apply(
                    host,
                    now,
                    context,
                    generation,
                    decision,
                    Origin::Elsewhere,
                    step,
                );
            }
        }
    }

    /// The tick period when nobody waits: an installed policy always needs it (metrics
    /// are flushed from the tick, and it may owe response costs or hold idle batches), as
    /// do config-center checks and releasing the records of dropped rules; a breaker of
    /// `scope: global` needs it finer ([`FLEET_TICK`]).
    fn wanted_base_tick(&self, host: &dyn Host) -> Duration {
        if self
            .generations()
            .any(|configured| configured.engine.reports_breakers())
        {
            FLEET_TICK
        } else if self.source.remote.is_some()
            || self.configured.is_some()
            || lifecycle::has_work(&self.store, host)
        {
            BASE_TICK
        } else {
            Duration::ZERO
        }
    }

    /// Work waits for the tick: a stash to refill ahead, places to give back, requests
    /// parked behind a request's own call that was answered (its answer came to that
    /// request's context, which serves only itself).
    fn work_waits_for_tick(&self) -> bool {
        self.generations().any(|configured| {
            configured.engine.wants_tick_soon()
                || (self.profile.resumes_from_other_contexts
                    && configured.engine.has_woken_riders())
        })
    }

    /// The tick period this worker needs now: fine while requests wait or are parked.
    /// (`work_waits`: [`Self::work_waits_for_tick`], asked once by the caller.)
    fn wanted_tick(&self, work_waits: bool) -> Duration {
        if !self.parked.is_empty() || work_waits {
            RIDER_TICK
        } else if !self.waiters.is_empty() {
            WAIT_TICK
        } else {
            self.base_tick
        }
    }

    /// Asks for the tick at once where the host can run it on demand and work waits for
    /// it (so a refill ahead leaves before the lease runs out, and riders are served when
    /// their flight lands, not a period later); sets the tick period the worker needs, if
    /// it changed and the host lets it.
    fn retick(&mut self, step: &mut Step) {
        let work_waits = self.work_waits_for_tick();
        if self.profile.ticks_on_demand && !self.tick_coming && work_waits {
            self.tick_coming = true;
            step.commands.push(Command::TickNow);
        }
        if !self.profile.tick_settable_anywhere {
            return;
        }
        let wanted = self.wanted_tick(work_waits);
        if self.tick != Some(wanted) {
            self.tick = Some(wanted);
            step.commands.push(Command::SetTick(wanted));
        }
    }
}
