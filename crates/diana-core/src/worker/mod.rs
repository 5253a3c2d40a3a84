//! One worker (one VM of one host thread or process), sans IO: everything per worker that
//! a binding would otherwise keep — the configuration and its reloads, requests waiting
//! for their turn or parked behind another request's call, the calls in flight and what
//! each answer resumes, the tick and the order of work in it, the config-center poll,
//! debts, refills, metric batching. A binding turns host callbacks into the events below
//! and carries out the [`Command`]s returned; what the host provides synchronously (shared
//! data, headers, the clock, dispatching a call, metrics) it provides through [`Host`].
//!
//! ```text
//!   binding (src/)                 Worker                          Engine
//!   on_configure ──────────▶ configure ── parse, adopt, install ─▶ Engine::new
//!   on_request_headers ────▶ on_request_headers ── evaluate ─────▶ Decision
//!                                 │ apply (the one interpreter of a Decision):
//!                                 │   Allow  → Continue (or Resume), headers kept
//!                                 │   Delay  → waiters            ┐
//!                                 │   Call   → Host::dispatch, calls[token] ├ Pause
//!                                 │   Wait   → parked[rider]      ┘
//!                                 │   Reject → Reply
//!   on_http_call_response ─▶ on_call_answered ── calls[token] says what it resumes:
//!                                 a request (complete → apply), an orphan (its client
//!                                 left: the grant goes to the stash), a refill, a
//!                                 payment, a release, a leave, a renewal (the
//!                                 places' new buckets), a poll
//!   on_tick ───────────────▶ on_tick ── remote check, debts, releases, place renewals
//!                                 and leaves, engine ticks, refills, metrics, sweeps;
//!                                 then parked and waiting requests
//!   on_response_headers ───▶ on_response_headers ── response costs, AddHeaders
//!   context deleted ───────▶ on_context_gone ── give back what a paused request held
//!                                 and the places a request held (at the quota service:
//!                                 queued for the next tick, made sooner);
//!                                 its own call's answer is lost with it, so a release
//!                                 of that call waits for the next tick (on nginx, one
//!                                 gone before its own call answered: the host runs
//!                                 paused requests on, see `unheld.rs`)
//! ```
//!
//! A request's life in the worker (`requests[context]`, absent when nothing is left):
//!
//! ```text
//!   (absent) ──evaluate──▶ Admitted ──response headers──▶ (absent)
//!       │                     ▲  ▲
//!       ├──Delay──▶ Waiting ──┘  │ (its turn, from the tick)
//!       ├──Call───▶ Calling ─────┤ (its answer; or Wait/Delay/Call again)
//!       └──Wait───▶ Parked ──────┘ (its flight landed, from the tick or an answer)
//!   any stage ──context gone──▶ (absent), what it held given back
//! ```
//!
//! Calls are dispatched while the worker handles an event; commands that touch other
//! requests' streams are returned and carried out after, in order. That is the host rule
//! the order follows: on Envoy a call made after entering another request's context would
//! be filed under that request.

mod configure;
mod counters;
pub mod host;
pub mod sim;
mod unheld;

pub use crate::decision::DispatchError;
pub use host::{is_host_port, CallToken, ContextId, Host, HostProfile, MetricId, MetricKind};
pub use unheld::{UNHELD_FOR, UNHELD_KEY};

use crate::config::OnInvalidConfig;
use crate::decision::{AfterResponse, Callout, Decision, Reply};
use crate::engine::{Engine, EngineDecision, Pending, Refill};
use crate::global::debts::Debt;
use crate::global::flights::RiderId;
use crate::global::wire::AcquireRequest;
use crate::global::{Leave, Release, ServicePlace, MAX_ANSWER_BYTES};
use crate::lifecycle;
use crate::metrics::Event;
use crate::response::Rejection;
use crate::store::Store;
use crate::time::{Clock, Instant};
use configure::Source;
pub use configure::{on_invalid_config_of, Refused};
use counters::Counters;
use hashbrown::HashMap;
use std::collections::BTreeSet;
use std::rc::Rc;
use std::time::Duration;

/// How often the tick looks for waiting requests whose turn has come.
const WAIT_TICK: Duration = Duration::from_millis(2);
/// How often the tick looks for parked requests whose flight has landed, or refills ahead
/// (the host's finest tick: a parked request waits at most this long beyond its flight).
const RIDER_TICK: Duration = Duration::from_millis(1);
/// The tick when nobody waits: config-center checks, metric flushes, debts, sweeps.
const BASE_TICK: Duration = Duration::from_secs(1);
/// The tick where the host lets it be set only once (nginx) and the policy holds places at
/// the quota service: a request's place is given back from the tick, so this long after
/// its end at most (a request cannot ask for the tick there).
const PLACES_TICK: Duration = Duration::from_millis(100);
/// Releases waiting for the tick, at most (beyond, a gone request's grant stays charged).
const MAX_RELEASES: usize = 1024;

/// What the binding does after an event, beyond the current request's [`Step::pause`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Resume this paused request (from another context: enter it first).
    Resume(ContextId),
    /// Answer this request with a local reply (from another context: enter it first).
    Reply(ContextId, LocalReply),
    /// Add these headers to the current response.
    AddHeaders(Vec<(&'static str, String)>),
    /// Set the tick period (zero stops it).
    SetTick(Duration),
    /// Run the tick as soon as the host can, without waiting for its period: work waits
    /// in it (a lease refill ahead, places to give back, requests parked behind a call
    /// that was answered). Only for a host whose profile
    /// [`HostProfile::ticks_on_demand`]; asked once until the tick runs.
    TickNow,
}

/// A local reply, as the host sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
}

/// What an event asks of the binding.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Step {
    /// The current request stays paused (request headers: `Action::Pause`).
    pub pause: bool,
    /// To carry out in order, after the event.
    pub commands: Vec<Command>,
}

/// An accepted policy: its engine and its metrics. Requests keep the one they started
/// with, so a reload never changes the rules under a request in flight.
pub(crate) struct Configured {
    /// Tells configurations apart (rider ids are per engine).
    generation: u64,
    engine: Engine,
    counters: Counters,
    /// The policy has a `metrics.path`.
    serves_metrics: bool,
}

/// A request the worker still has something for.
struct Request {
    configured: Rc<Configured>,
    stage: Stage,
    /// Rate-limit headers for the response.
    headers: Vec<(&'static str, String)>,
    /// Response costs to charge once the upstream has answered.
    after: Option<AfterResponse>,
}

enum Stage {
    /// Going on; only its response is left.
    Admitted,
    /// Answered; it holds concurrency places until it ends (`after.places`).
    Answered,
    /// Paused for its call (in `calls` under this token).
    Calling(CallToken, Pending),
    /// Paused behind another request's call (in `parked`).
    Parked(RiderId, Pending),
    /// Paused until its leaky-bucket turn (in `waiters`).
    Waiting(Instant),
}

/// What a call's answer resumes.
enum Call {
    /// A request; `own`: dispatched from its own context, so the answer arrives there.
    Request { context: ContextId, own: bool },
    /// A refill of lease stashes ahead.
    Refill(Rc<Configured>, Refill),
    /// A request's call made from another context, whose request is gone: its answer
    /// still comes, and what it grants serves later requests.
    Orphan(Rc<Configured>, Pending),
    /// Response costs sent to the quota service.
    Payment(Rc<Configured>, Vec<Debt>),
    /// The release of a gone request's call: its answer clears the denials cached
    /// meanwhile for what it freed.
    Release(Rc<Configured>, Release),
    /// Concurrency places of requests that ended, given back to the quota service.
    Leave(Rc<Configured>, Leave),
    /// Concurrency places renewed at the quota service: of which request each is, and
    /// what was asked.
    Renewal(Rc<Configured>, Renewing, AcquireRequest),
    /// The config center's document.
    Poll,
}

/// Places at the quota service being renewed, each with the request holding it.
type Renewing = Vec<(ContextId, ServicePlace)>;

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
    configured: Option<Rc<Configured>>,
    /// Replaced configurations still used by requests, or owing: flushed, ticked and
    /// paid from the tick until nothing holds them.
    retired: Vec<Rc<Configured>>,
    generations: u64,
    source: Source,
    requests: HashMap<ContextId, Request>,
    waiters: BTreeSet<(Instant, ContextId)>,
    parked: HashMap<(u64, RiderId), ContextId>,
    calls: HashMap<CallToken, Call>,
    /// A payment is in flight (one at a time).
    paying: bool,
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
    /// Releases of the calls of requests that went away, sent from the next tick (the
    /// root context, whose calls outlive any request).
    releases: Vec<(Rc<Configured>, Release)>,
}

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
            paying: false,
            base_tick: Duration::ZERO,
            tick: None,
            tick_coming: false,
            invalid: None,
            unheld_until: Instant::EPOCH,
            unheld_logged: false,
            releases: Vec::new(),
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
            .filter(|request| !matches!(request.stage, Stage::Admitted))
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
            configured.counters.flush(host);
        }
        if let Some(events) = &self.events {
            events.flush(host);
        }
    }

    /// A request's headers arrived: evaluate it.
    pub fn on_request_headers(&mut self, host: &dyn Host, context: ContextId) -> Step {
        let mut step = Step::default();
        // nginx: the first request or tick probes shared data and installs the document.
        self.shared_data_ready(host);
        let Some(configured) = self.configured.clone() else {
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
            let reply = LocalReply {
                status: 200,
                headers: vec![("content-type", "text/plain; version=0.0.4".to_string())],
                body: configured.counters.exposition(host),
            };
            step.commands.push(Command::Reply(context, reply));
            step.pause = true;
            return step;
        }
        let decision = configured.engine.evaluate(
            host,
            raw_path,
            host,
            HostClock(host),
            &mut configured.counters.sink(),
        );
        self.apply(
            host,
            context,
            configured,
            decision,
            Origin::Headers,
            &mut step,
        );
        self.retick(&mut step);
        step
    }

    /// A request's response headers arrived: charge its response costs, add its headers.
    pub fn on_response_headers(&mut self, host: &dyn Host, context: ContextId) -> Step {
        let mut step = Step::default();
        let Some(request) = self.requests.remove(&context) else {
            return step;
        };
        if !matches!(request.stage, Stage::Admitted) {
            // A paused request answered by the host itself (its own local reply): it is
            // still ours until its context goes.
            self.requests.insert(context, request);
            return step;
        }
        let Request {
            configured,
            headers,
            after,
            ..
        } = request;
        if let Some(mut after) = after {
            let places = std::mem::take(&mut after.places);
            let values: Vec<Option<Vec<u8>>> = after
                .headers()
                .map(|name| host.response_header(name))
                .collect();
            configured.engine.after_response(
                host,
                after,
                &values,
                host.now(),
                &mut configured.counters.sink(),
            );
            if !places.is_empty() {
                // Its places are held until the request ends (its context goes).
                let holding = AfterResponse {
                    places,
                    ..AfterResponse::default()
                };
                self.hold(
                    context,
                    configured,
                    Stage::Answered,
                    Vec::new(),
                    Some(holding),
                );
            }
        }
        if !headers.is_empty() {
            step.commands.push(Command::AddHeaders(headers));
        }
        step
    }

    /// The answer to a call (`headers == 0`: none came — timeout, refused, reset). From
    /// the context that made the call.
    pub fn on_call_answered(
        &mut self,
        host: &dyn Host,
        token: CallToken,
        headers: usize,
        body_size: usize,
    ) -> Step {
        let mut step = Step::default();
        let Some(call) = self.calls.remove(&token) else {
            return step;
        };
        match call {
            Call::Request { context, own } => {
                let Some(request) = self.requests.remove(&context) else {
                    return step;
                };
                let Stage::Calling(_, pending) = request.stage else {
                    self.requests.insert(context, request);
                    return step;
                };
                let configured = request.configured;
                let reply = call_reply(host, headers, body_size, MAX_ANSWER_BYTES);
                let decision = configured.engine.complete(
                    host,
                    pending,
                    reply,
                    host.now(),
                    &mut configured.counters.sink(),
                );
                let origin = if own {
                    Origin::OwnCall
                } else {
                    Origin::Elsewhere
                };
                self.apply(host, context, configured, decision, origin, &mut step);
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
            Call::Orphan(configured, pending) => {
                let reply = call_reply(host, headers, body_size, MAX_ANSWER_BYTES);
                configured.engine.complete_for_nobody(
                    host,
                    pending,
                    reply,
                    host.now(),
                    &mut configured.counters.sink(),
                );
                self.serve_riders(host, &mut step);
            }
            Call::Refill(configured, refill) => {
                let reply = call_reply(host, headers, body_size, MAX_ANSWER_BYTES);
                configured.engine.refilled(
                    host,
                    refill,
                    reply,
                    host.now(),
                    &mut configured.counters.sink(),
                );
                self.serve_riders(host, &mut step);
            }
            Call::Payment(configured, debts) => {
                self.paying = false;
                let reply = call_reply(host, headers, body_size, 0);
                configured.engine.debts_paid(
                    host,
                    debts,
                    reply,
                    host.now(),
                    &mut configured.counters.sink(),
                );
            }
            Call::Release(configured, release) => {
                // Whatever the answer (a grant given back now, or when its acquire is
                // decided, or none known), a denial cached since may hide tokens that
                // are back at the service.
                configured.engine.released(host, &release);
            }
            // Not given back (no answer, or not 2xx): counted; the service reclaims the
            // places after its bound.
            Call::Leave(configured, leave) => {
                let reply = call_reply(host, headers, body_size, 0);
                configured
                    .engine
                    .left(&leave, &reply, &mut configured.counters.sink());
            }
            Call::Renewal(configured, renewing, request) => {
                let reply = call_reply(host, headers, body_size, MAX_ANSWER_BYTES);
                let buckets = configured.engine.renewed(&request, reply);
                self.renewal_answered(host, &configured, &renewing, buckets);
            }
            Call::Poll => self.on_poll_answer(host, headers, body_size),
        }
        // The breaker's gauge is written when it changes, not at the next tick.
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
        let Some(request) = self.requests.remove(&context) else {
            return Step::default();
        };
        let configured = &request.configured;
        let mut step = Step::default();
        if let Some(after) = request.after.as_ref().filter(|after| after.holds_places()) {
            configured.engine.leave(
                host,
                &after.places,
                host.now(),
                &mut configured.counters.sink(),
            );
            // Places at the quota service go back from the next tick, made sooner.
            self.retick(&mut step);
        }
        match request.stage {
            Stage::Admitted | Stage::Answered => {}
            Stage::Waiting(until) => {
                if self.waiters.remove(&(until, context)) {
                    configured.counters.event(Event::DelayAbandoned);
                }
            }
            Stage::Calling(token, pending) => {
                let call = self.calls.remove(&token);
                if let (Some(Call::Request { own: true, .. }), Some(directive)) =
                    (&call, self.profile.pausing_needs)
                {
                    self.seen_unheld(host, directive);
                }
                // A call made from the request's own context is dropped with it by the
                // host (the SDK files its answer under the context): what it held goes
                // back now, and the call is released from the next tick (the service
                // gives its grant back). One made from another context still answers.
                match call {
                    Some(Call::Request { own: false, .. }) => {
                        let orphan = Call::Orphan(Rc::clone(configured), pending);
                        self.calls.insert(token, orphan);
                    }
                    _ => {
                        let release = configured.engine.abandon(host, pending, host.now());
                        if let Some(release) = release {
                            if self.releases.len() < MAX_RELEASES {
                                self.releases.push((Rc::clone(configured), release));
                            } else {
                                configured.counters.event(Event::ReleaseUnsent);
                            }
                        }
                    }
                }
            }
            Stage::Parked(rider, pending) => {
                self.parked.remove(&(configured.generation, rider));
                let _ = configured.engine.abandon(host, pending, host.now());
            }
        }
        step
    }

    /// The worker's tick: the config center, debts, engine ticks, refills, metrics and
    /// sweeps first (every call of the tick is made), then the parked and waiting requests
    /// whose time has come.
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
        self.pay_debts(host);
        self.send_releases(host);
        self.renew_places(host, now);
        self.send_leaves(host, now);
        // Collected: sending refills needs the worker mutably.
        let generations: Vec<Rc<Configured>> = self.generations().cloned().collect();
        for configured in generations {
            configured.engine.tick(host, Some(now));
            self.send_refills(host, &configured);
            configured.counters.flush(host);
        }
        // A replaced configuration is let go once no request holds it and it owes nothing.
        self.retired.retain(|configured| {
            Rc::strong_count(configured) > 1
                || configured.engine.owes()
                || configured.engine.has_riders()
                || configured.engine.wants_leave()
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

    /// The current configuration and the replaced ones still in use.
    fn generations(&self) -> impl Iterator<Item = &Rc<Configured>> {
        self.configured.iter().chain(&self.retired)
    }

    /// Takes `decision` for the request of `context`: the one place a [`Decision`] is
    /// interpreted.
    fn apply(
        &mut self,
        host: &dyn Host,
        context: ContextId,
        configured: Rc<Configured>,
        decision: EngineDecision,
        origin: Origin,
        step: &mut Step,
    ) {
        match decision {
            Decision::Allow { headers, after } => {
                if !headers.is_empty() || after.is_some() {
                    self.hold(context, configured, Stage::Admitted, headers, after);
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
            } => {
                self.waiters.insert((until, context));
                self.hold(context, configured, Stage::Waiting(until), headers, after);
                step.pause = true;
            }
            Decision::Reject(rejection) => {
                let reply = self.local_reply(rejection);
                step.commands.push(Command::Reply(context, reply));
                step.pause = true;
            }
            Decision::Call(callout, pending) => match self
                .may_pause(host)
                .and_then(|()| self.dispatch(host, &callout))
            {
                Ok(token) => {
                    let own = origin != Origin::Elsewhere;
                    self.calls.insert(token, Call::Request { context, own });
                    let stage = Stage::Calling(token, pending);
                    self.hold(context, configured, stage, Vec::new(), None);
                    step.pause = true;
                }
                Err(error) => {
                    let decision = configured.engine.complete(
                        host,
                        pending,
                        Reply::NotSent(error),
                        host.now(),
                        &mut configured.counters.sink(),
                    );
                    self.apply(host, context, configured, decision, origin, step);
                }
            },
            Decision::Wait(pending) => {
                // The engine parks only where the profile can resume from elsewhere.
                let Some(rider) = pending.rider() else {
                    return;
                };
                self.parked.insert((configured.generation, rider), context);
                self.hold(
                    context,
                    configured,
                    Stage::Parked(rider, pending),
                    Vec::new(),
                    None,
                );
                step.pause = true;
            }
        }
    }

    /// The concurrency places of the requests still inside are renewed
    /// ([`Engine::renew`]: each at most every `RENEW_EVERY`): local ones at once, those
    /// at the quota service in one call per configuration (of at most `wire::MAX_RULES`
    /// places; more wait for the next tick).
    fn renew_places(&mut self, host: &dyn Host, now: Instant) {
        let mut due: Vec<(Rc<Configured>, Renewing)> = Vec::new();
        for (&context, request) in self.requests.iter_mut() {
            let Some(after) = request.after.as_mut().filter(|after| after.holds_places()) else {
                continue;
            };
            let configured = &request.configured;
            let at_service = configured.engine.renew(
                host,
                &mut after.places,
                now,
                &mut configured.counters.sink(),
            );
            if at_service.is_empty() {
                continue;
            }
            let at = match due
                .iter()
                .position(|(known, _)| Rc::ptr_eq(known, configured))
            {
                Some(at) => at,
                None => {
                    due.push((Rc::clone(configured), Vec::new()));
                    due.len() - 1
                }
            };
            if let Some((_, batch)) = due.get_mut(at) {
                batch.extend(at_service.into_iter().map(|place| (context, place)));
            }
        }
        for (configured, places) in due {
            for renewing in places.chunks(crate::wire::MAX_RULES) {
                let asked: Vec<ServicePlace> = renewing.iter().map(|(_, place)| *place).collect();
                let planned = configured.engine.plan_renewal(host, &asked, now);
                let sent = planned.and_then(|(callout, request)| {
                    let token = self.dispatch(host, &callout).ok()?;
                    Some((token, request))
                });
                match sent {
                    Some((token, request)) => {
                        let call =
                            Call::Renewal(Rc::clone(&configured), renewing.to_vec(), request);
                        self.calls.insert(token, call);
                    }
                    // Not renewed now: due again at the next tick.
                    None => self.renewal_answered(host, &configured, renewing, None),
                }
            }
        }
    }

    /// A renewal of places at the quota service was answered (`buckets`: where each is
    /// counted now; `None`: not renewed). A place whose request ended meanwhile is given
    /// back from where the answer says it is.
    fn renewal_answered(
        &mut self,
        host: &dyn Host,
        configured: &Rc<Configured>,
        renewing: &[(ContextId, ServicePlace)],
        buckets: Option<Vec<u64>>,
    ) {
        let now = host.now().unwrap_or(Instant::EPOCH);
        for (at, (context, asked)) in renewing.iter().enumerate() {
            let bucket = buckets
                .as_ref()
                .and_then(|buckets| buckets.get(at).copied());
            let held = self
                .requests
                .get_mut(context)
                .filter(|request| Rc::ptr_eq(&request.configured, configured))
                .and_then(|request| request.after.as_mut())
                .is_some_and(|after| {
                    after
                        .places
                        .iter_mut()
                        .any(|place| place.renewal_answered(asked, bucket, now))
                });
            if !held {
                configured.engine.queue_leave(
                    ServicePlace {
                        bucket: bucket.unwrap_or(asked.bucket),
                        ..*asked
                    },
                    &mut configured.counters.sink(),
                );
            }
        }
    }

    /// Gives back the places of requests that ended to the quota service: every place
    /// waiting, in calls of at most `wire::MAX_RULES` places. The queue holds at most
    /// `global::MAX_LEAVING`, so a tick makes at most 16 such calls; a burst of ends that
    /// waited for the tick (nginx: 100 ms) is not held at the service a tick longer.
    fn send_leaves(&mut self, host: &dyn Host, now: Instant) {
        let generations: Vec<Rc<Configured>> = self
            .generations()
            .filter(|configured| configured.engine.wants_leave())
            .cloned()
            .collect();
        for configured in generations {
            let mut metrics = configured.counters.sink();
            while let Some(leave) = configured.engine.plan_leave(host, now, &mut metrics) {
                match self.dispatch(host, &leave.callout) {
                    Ok(token) => {
                        self.calls
                            .insert(token, Call::Leave(Rc::clone(&configured), leave));
                    }
                    Err(error) => {
                        log::debug!("diana: places not given back: {error}");
                        let reply = Reply::NotSent(error);
                        configured.engine.left(&leave, &reply, &mut metrics);
                    }
                }
            }
        }
    }

    fn hold(
        &mut self,
        context: ContextId,
        configured: Rc<Configured>,
        stage: Stage,
        headers: Vec<(&'static str, String)>,
        after: Option<AfterResponse>,
    ) {
        self.requests.insert(
            context,
            Request {
                configured,
                stage,
                headers,
                after,
            },
        );
    }

    /// A rejection as the host sends it (ngx_wasm_module appends a line feed to every
    /// local reply's body: one less is sent, so the client gets the configured body).
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
    fn may_pause(&mut self, host: &dyn Host) -> Result<(), DispatchError> {
        let Some(directive) = self.profile.pausing_needs else {
            return Ok(());
        };
        let Some(now) = host.now() else {
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

    /// Sends the releases queued by requests that went away. Nothing waits for their
    /// answers: one that fails leaves that grant charged, as before releases existed.
    fn send_releases(&mut self, host: &dyn Host) {
        for (configured, release) in std::mem::take(&mut self.releases) {
            match self.dispatch(host, &release.callout) {
                Ok(token) => {
                    configured.counters.event(Event::GlobalReleased);
                    self.calls.insert(token, Call::Release(configured, release));
                }
                Err(error) => {
                    configured.counters.event(Event::ReleaseUnsent);
                    log::debug!("diana: a release was not sent: {error}");
                }
            }
        }
    }

    /// Plans the parked requests whose flight has landed again.
    fn serve_riders(&mut self, host: &dyn Host, step: &mut Step) {
        if self.parked.is_empty() {
            return;
        }
        let now = host.now();
        let generations: Vec<Rc<Configured>> = self
            .generations()
            .filter(|configured| configured.engine.has_riders())
            .cloned()
            .collect();
        for configured in generations {
            configured.engine.land_overdue(now);
            // One at a time: a rider that leads a flight takes the riders after it along.
            while let Some(rider) = configured.engine.next_woken() {
                let Some(context) = self.parked.remove(&(configured.generation, rider)) else {
                    continue;
                };
                let Some(request) = self.requests.remove(&context) else {
                    continue;
                };
                let Stage::Parked(_, pending) = request.stage else {
                    self.requests.insert(context, request);
                    continue;
                };
                let decision =
                    configured
                        .engine
                        .resume(host, pending, now, &mut configured.counters.sink());
                self.apply(
                    host,
                    context,
                    Rc::clone(&configured),
                    decision,
                    Origin::Elsewhere,
                    step,
                );
            }
        }
    }

    /// Sends the response costs a configuration owes to the quota service (one payment in
    /// flight at a time; a replaced configuration's debts are paid too).
    fn pay_debts(&mut self, host: &dyn Host) {
        if self.paying {
            return;
        }
        let Some(configured) = self
            .generations()
            .find(|configured| configured.engine.owes())
            .cloned()
        else {
            return;
        };
        let Some((callout, debts)) =
            configured
                .engine
                .pay_debts(host, host.now(), &mut configured.counters.sink())
        else {
            return;
        };
        match self.dispatch(host, &callout) {
            Ok(token) => {
                self.paying = true;
                self.calls.insert(token, Call::Payment(configured, debts));
            }
            Err(error) => configured.engine.debts_paid(
                host,
                debts,
                Reply::NotSent(error),
                host.now(),
                &mut configured.counters.sink(),
            ),
        }
    }

    /// Sends the calls that refill running-low lease stashes ahead.
    fn send_refills(&mut self, host: &dyn Host, configured: &Rc<Configured>) {
        if !configured.engine.wants_refill() {
            return;
        }
        let refills = configured
            .engine
            .refill(host, host.now(), &mut configured.counters.sink());
        for (callout, refill) in refills {
            match self.dispatch(host, &callout) {
                Ok(token) => {
                    self.calls
                        .insert(token, Call::Refill(Rc::clone(configured), refill));
                }
                Err(error) => configured.engine.refilled(
                    host,
                    refill,
                    Reply::NotSent(error),
                    host.now(),
                    &mut configured.counters.sink(),
                ),
            }
        }
    }

    /// The tick period when nobody waits: an installed policy always needs it (metrics
    /// are flushed from the tick, and it may owe response costs or hold idle batches), as
    /// do config-center checks and releasing the records of dropped rules.
    fn wanted_base_tick(&self, host: &dyn Host) -> Duration {
        if self.source.remote.is_some()
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
        let refill = self
            .configured
            .as_ref()
            .is_some_and(|configured| configured.engine.wants_refill());
        refill
            || self.generations().any(|configured| {
                configured.engine.wants_leave()
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

/// The host's clock as the engine reads it (only when a rule applies).
struct HostClock<'a>(&'a dyn Host);

impl Clock for HostClock<'_> {
    fn now(&self) -> Option<Instant> {
        self.0.now()
    }
}

/// The `:status` of the call answer being delivered (0 when missing or unreadable).
fn call_status(host: &dyn Host) -> u16 {
    host.call_header(":status")
        .and_then(|s| std::str::from_utf8(&s).ok()?.trim().parse::<u16>().ok())
        .unwrap_or(0)
}

/// The host's account of a call: no headers means no answer; a body larger than
/// `max_body` (0: not wanted) is not read.
fn call_reply(host: &dyn Host, headers: usize, body_size: usize, max_body: usize) -> Reply {
    if headers == 0 {
        return Reply::NoAnswer;
    }
    let status = call_status(host);
    let body = if body_size > max_body {
        None
    } else {
        match host.call_body(body_size) {
            Ok(body) => Some(body),
            Err(error) => {
                log::debug!("diana: call answer's body unreadable: {error}");
                None
            }
        }
    };
    Reply::Answered { status, body }
}
