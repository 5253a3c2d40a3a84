//! A deterministic simulated gateway: workers sharing one [`MemoryHost`] (with the
//! compare-and-swap rule of the profile's host), a clock that steps, calls answered by an
//! in-process quota service ([`MemoryQuota`]) after a chosen latency — or not at all —,
//! requests whose clients leave at any point, and the host's rules enforced: a request is
//! resumed only while paused, resumed from another context only where the profile allows,
//! and on nginx resumed by the host once its call is answered. Every rule broken is a
//! [`Violation`], for tests to assert there are none.

use super::{CallToken, Command, ContextId, DispatchError, Host, HostProfile, MetricId};
use super::{LocalReply, MetricKind, Refused, Step, Watch, Worker};
use crate::breaker::Transition;
use crate::call::{Answer, Callout};
use crate::facts::RequestFacts;
use crate::quota::MemoryQuota;
use crate::store::{identity, CasSemantics, HostError, MemoryHost, SetOutcome, SharedData, Store};
use crate::time::{Clock, Instant, Nanos};
use hashbrown::{HashMap, HashSet};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

/// Header names and values, as the host holds them.
pub type Headers = Vec<(String, Vec<u8>)>;

/// The host services of the simulated gateway, shared by its workers.
pub struct SimHost {
    shared: MemoryHost,
    /// `None`: the clock cannot be read.
    clock: Cell<Option<Instant>>,
    /// The clock cannot be read now (time stands still for the host meanwhile).
    clock_broken: Cell<bool>,
    next_token: Cell<CallToken>,
    /// Calls dispatched during the current event.
    dispatched: RefCell<Vec<(CallToken, Callout)>>,
    /// The host refuses every dispatch.
    refuse_dispatch: Cell<bool>,
    metrics: RefCell<Vec<(String, u64)>>,
    /// The current request's headers and client address.
    request: RefCell<Headers>,
    client_ip: RefCell<Option<Vec<u8>>>,
    response: RefCell<Headers>,
    /// Breakers' transitions as the workers handed them over, oldest first, until taken
    /// ([`SimHost::take_transitions`]).
    transitions: RefCell<Vec<(usize, Instant, Transition)>>,
}

impl SimHost {
    pub fn new(profile: HostProfile, start: Instant) -> SimHost {
        let semantics = if profile.strict_compare_and_swap {
            CasSemantics::Nginx
        } else {
            CasSemantics::Envoy
        };
        let host = SimHost {
            shared: MemoryHost::new(semantics),
            clock: Cell::new(Some(start)),
            clock_broken: Cell::new(false),
            next_token: Cell::new(1),
            dispatched: RefCell::new(Vec::new()),
            refuse_dispatch: Cell::new(false),
            metrics: RefCell::new(Vec::new()),
            request: RefCell::new(Vec::new()),
            client_ip: RefCell::new(None),
            response: RefCell::new(Vec::new()),
            transitions: RefCell::new(Vec::new()),
        };
        // One identity key for every run, where a gateway draws one at random: the same
        // inputs replay to the same numbers.
        let _ = identity::process_key(&Store::new(), &host, || Ok([0x5a; identity::KEY_BYTES]));
        host
    }

    pub fn now(&self) -> Option<Instant> {
        if self.clock_broken.get() {
            return None;
        }
        self.clock.get()
    }

    /// Shared-data writes so far.
    pub fn writes(&self) -> u64 {
        self.shared.calls().1
    }

    /// The clock cannot be read (`false`) until it can again (`true`).
    pub fn set_clock_readable(&self, readable: bool) {
        self.clock_broken.set(!readable);
    }

    /// Moves the clock (never back).
    pub fn set_now(&self, now: Instant) {
        self.clock
            .set(Some(now.max(self.clock.get().unwrap_or(Instant::EPOCH))));
    }

    /// The host refuses (`true`) or makes (`false`) every later dispatch.
    pub fn refuse_dispatch(&self, refuse: bool) {
        self.refuse_dispatch.set(refuse);
    }

    /// The request the next `on_request_headers` reads: its headers (`:path` among them)
    /// and client address.
    pub fn set_request(&self, client_ip: Option<Vec<u8>>, headers: Headers) {
        *self.request.borrow_mut() = headers;
        *self.client_ip.borrow_mut() = client_ip;
    }

    /// The calls dispatched since the last time, with their tokens.
    pub fn take_dispatched(&self) -> Vec<(CallToken, Callout)> {
        self.dispatched.take()
    }

    /// The breakers' transitions handed over since the last time: the breaker's index
    /// among the policy's breakers, when, and the transition (workers hand theirs over
    /// with their metrics: [`Sim::flush_metrics`] or the tick).
    pub fn take_transitions(&self) -> Vec<(usize, Instant, Transition)> {
        self.transitions.take()
    }

    /// A metric's value by name (0 when never defined).
    pub fn metric(&self, name: &str) -> u64 {
        self.metrics
            .borrow()
            .iter()
            .filter(|(defined, _)| defined == name)
            .map(|(_, value)| *value)
            .max()
            .unwrap_or(0)
    }
}

impl SharedData for SimHost {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        self.shared.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<SetOutcome, HostError> {
        self.shared.set(key, value, cas)
    }
}

impl RequestFacts for SimHost {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        find(&self.request.borrow(), name)
    }

    fn client_ip(&self) -> Option<Vec<u8>> {
        self.client_ip.borrow().clone()
    }
}

impl Clock for SimHost {
    fn now(&self) -> Option<Instant> {
        SimHost::now(self)
    }
}

impl Host for SimHost {
    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        find(&self.response.borrow(), name)
    }

    fn dispatch(&self, callout: &Callout) -> Result<CallToken, DispatchError> {
        if self.refuse_dispatch.get() {
            return Err(DispatchError::Refused {
                upstream: callout.upstream.clone(),
                status: "BadArgument".into(),
            });
        }
        let token = self.next_token.get();
        self.next_token.set(token.wrapping_add(1).max(1));
        self.dispatched.borrow_mut().push((token, callout.clone()));
        Ok(token)
    }

    /// One metric per name for every worker, as the hosts keep them (Envoy's stats, nginx's
    /// shared metrics): counters add up, a gauge is the value set last.
    fn define_metric(&self, _kind: MetricKind, name: &str) -> Option<MetricId> {
        let mut metrics = self.metrics.borrow_mut();
        if let Some(at) = metrics.iter().position(|(defined, _)| defined == name) {
            return MetricId::try_from(at).ok();
        }
        metrics.push((name.to_string(), 0));
        MetricId::try_from(metrics.len() - 1).ok()
    }

    fn add_to_metric(&self, metric: MetricId, count: u64) {
        if let Some((_, value)) = self.metrics.borrow_mut().get_mut(metric as usize) {
            *value = value.saturating_add(count);
        }
    }

    fn set_metric(&self, metric: MetricId, value: u64) {
        if let Some((_, slot)) = self.metrics.borrow_mut().get_mut(metric as usize) {
            *slot = value;
        }
    }

    fn metric_value(&self, metric: MetricId) -> u64 {
        self.metrics
            .borrow()
            .get(metric as usize)
            .map_or(0, |(_, value)| *value)
    }

    fn breaker_transition(&self, breaker: usize, at: Instant, transition: &Transition) {
        self.transitions
            .borrow_mut()
            .push((breaker, at, *transition));
    }
}

/// A call to the quota service's API (a config-center poll is not).
fn is_quota_call(callout: &Callout) -> bool {
    callout
        .headers
        .iter()
        .any(|(name, value)| *name == ":path" && value.starts_with("/v1/"))
}

fn find(headers: &[(String, Vec<u8>)], name: &str) -> Option<Vec<u8>> {
    headers
        .iter()
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.clone())
}

/// What became of a request so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// Paused by the filter.
    Paused,
    /// Went on to the upstream at this time.
    Admitted(Instant),
    /// Answered by the filter with this status.
    Replied(u16),
    /// Its client left.
    Gone,
}

/// A host rule the worker broke.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// Resumed a request that was not paused.
    ResumedNotPaused(ContextId),
    /// Resumed or answered a request from another context where the host cannot.
    FromOtherContext(ContextId),
    /// Set the tick from a request, or to zero, where the host cannot.
    Tick(Duration),
    /// Asked for the tick at once where the host runs it only on its period.
    TickNow,
    /// A command for a request the host never had.
    Unknown(ContextId),
    /// Changed the headers of a request that had gone on already.
    EditedGoneOn(ContextId),
    /// Handed over a request's breaker calls ([`super::Step::watch`]) where the host does
    /// not keep them, from another event than the request's own, or twice.
    Watch(ContextId),
}

/// A call in flight, answered at `due`.
struct Flight {
    worker: usize,
    token: CallToken,
    callout: Callout,
    due: Instant,
    /// The request whose context made it (`None`: the root context).
    context: Option<ContextId>,
    /// Its context was deleted: the service still gets the call, the host drops the
    /// answer.
    dropped: bool,
}

/// How calls are answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// By the in-process quota service after this latency.
    Answers(Nanos),
    /// Never: each call fails (no answer) after this latency.
    Down(Nanos),
    /// The in-process quota service decides each call, and its answer is lost on the way
    /// (a timeout after the service acted): the gateway sees no answer after this latency.
    Lost(Nanos),
}

/// A gateway of `workers` workers under one profile. See the module docs.
pub struct Sim {
    pub host: SimHost,
    /// The quota service (several gateways may share one).
    quota: Rc<RefCell<MemoryQuota>>,
    profile: HostProfile,
    workers: Vec<Worker>,
    /// Per worker: its tick period and next tick.
    ticks: Vec<Option<(Duration, Instant)>>,
    service: Service,
    flights: Vec<Flight>,
    requests: HashMap<ContextId, (usize, Fate)>,
    /// Headers the worker added to each response.
    added: HashMap<ContextId, Vec<(&'static str, String)>>,
    /// Each request's own headers as the worker changed them before it went on (the
    /// upstream sees these).
    edited: HashMap<ContextId, Vec<(String, String)>>,
    /// The request headers the worker removed, by request.
    removed: HashMap<ContextId, Vec<String>>,
    /// The address and headers of requests whose body is still to come (the host shows
    /// them again at each body event).
    with_body: HashMap<ContextId, (Option<Vec<u8>>, Headers)>,
    /// Local replies, as the client receives them (the host's line feed added).
    replies: HashMap<ContextId, LocalReply>,
    next_context: ContextId,
    /// Requests whose clients left while paused for a call, on a host that notices only
    /// once the call answered (with whether to forget them then).
    leaving: HashMap<ContextId, bool>,
    /// Requests the worker stopped tracking at their request headers, whose later events
    /// the host skips, as the native module does (`Worker::tracks`).
    untracked: HashSet<ContextId>,
    /// Breaker calls kept for requests, as the native module keeps them (`Step::watch`).
    watches: HashMap<ContextId, Watch>,
    pub violations: Vec<Violation>,
}

impl Sim {
    /// A gateway configured with `document` on every worker, at time `start`.
    pub fn new(
        profile: HostProfile,
        document: &str,
        workers: usize,
        service: Service,
        start: Instant,
    ) -> Result<Sim, Refused> {
        let mut sim = Sim::unconfigured(profile, workers, service, start);
        sim.configure(document)?;
        Ok(sim)
    }

    /// A gateway whose workers have no configuration yet.
    pub fn unconfigured(
        profile: HostProfile,
        workers: usize,
        service: Service,
        start: Instant,
    ) -> Sim {
        Sim {
            host: SimHost::new(profile, start),
            quota: Rc::new(RefCell::new(MemoryQuota::new())),
            profile,
            workers: (0..workers.max(1)).map(|_| Worker::new(profile)).collect(),
            ticks: vec![None; workers.max(1)],
            service,
            flights: Vec::new(),
            requests: HashMap::new(),
            added: HashMap::new(),
            edited: HashMap::new(),
            removed: HashMap::new(),
            with_body: HashMap::new(),
            replies: HashMap::new(),
            next_context: 2,
            leaving: HashMap::new(),
            untracked: HashSet::new(),
            watches: HashMap::new(),
            violations: Vec::new(),
        }
    }

    /// The host hands `document` to every worker (`on_configure`).
    pub fn configure(&mut self, document: &str) -> Result<(), Refused> {
        for index in 0..self.workers.len() {
            let Some(worker) = self.workers.get_mut(index) else {
                continue;
            };
            let step = worker.configure(&self.host, document.as_bytes())?;
            self.carry_out(index, None, step, true);
        }
        Ok(())
    }

    pub fn now(&self) -> Instant {
        self.host.clock.get().unwrap_or(Instant::EPOCH)
    }

    /// Calls to the quota service answered `quota`, shared with other gateways.
    pub fn sharing_quota(mut self, quota: Rc<RefCell<MemoryQuota>>) -> Sim {
        self.quota = quota;
        self
    }

    /// Calls the quota service has answered.
    pub fn quota_calls(&self) -> u64 {
        self.quota.borrow().calls()
    }

    /// Calls the quota service has answered that are not the ticks' reports (those go
    /// every second while the document has a `global` section: the fleet view).
    pub fn decision_calls(&self) -> u64 {
        let quota = self.quota.borrow();
        quota.calls() - quota.reports_received()
    }

    /// Calls in flight that are not the ticks' reports.
    pub fn decision_calls_in_flight(&self) -> usize {
        self.flights
            .iter()
            .filter(|flight| {
                !flight.callout.headers.iter().any(|(name, value)| {
                    *name == ":path" && value.ends_with(crate::report::REPORT_PATH)
                })
            })
            .count()
    }

    /// The reports the quota service received since the last call, oldest first.
    pub fn take_reports(&self) -> Vec<crate::report::ReportRequest> {
        self.quota.borrow_mut().take_reports()
    }

    /// Hands every worker's metric counts to the host now (not at the next tick).
    pub fn flush_metrics(&self) {
        for worker in &self.workers {
            worker.flush_metrics(&self.host);
        }
    }

    /// The time a request waiting for its leaky-bucket turn will be resumed.
    pub fn waiting_until(&self, context: ContextId) -> Option<Instant> {
        let (worker, _) = self.requests.get(&context)?;
        self.workers.get(*worker)?.waiting_until(context)
    }

    pub fn worker(&self, index: usize) -> Option<&Worker> {
        self.workers.get(index)
    }

    pub fn set_service(&mut self, service: Service) {
        self.service = service;
    }

    /// The host refuses (`true`) or makes (`false`) every later dispatch.
    pub fn refuse_dispatch(&self, refuse: bool) {
        self.host.refuse_dispatch(refuse);
    }

    /// A request from `client_ip` with `headers` reaches worker `worker` now.
    pub fn send(&mut self, worker: usize, client_ip: &str, headers: &[(&str, &str)]) -> ContextId {
        let headers = headers
            .iter()
            .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()))
            .collect();
        self.send_raw(worker, Some(client_ip.as_bytes().to_vec()), headers)
    }

    /// A request with these raw headers (`:path` among them) and client address.
    pub fn send_raw(
        &mut self,
        worker: usize,
        client_ip: Option<Vec<u8>>,
        headers: Headers,
    ) -> ContextId {
        self.send_headers(worker, client_ip, headers, false)
    }

    /// A request whose body follows ([`Sim::send_body`]), from `client_ip` with `headers`.
    pub fn send_with_body(
        &mut self,
        worker: usize,
        client_ip: &str,
        headers: &[(&str, &str)],
    ) -> ContextId {
        let headers: Headers = headers
            .iter()
            .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()))
            .collect();
        let client_ip = Some(client_ip.as_bytes().to_vec());
        self.send_headers(worker, client_ip, headers, true)
    }

    /// The next bytes of a request's body; `end`: the last. As a binding does, they are
    /// handed over only while the worker holds the request for its body. Returns whether
    /// they were.
    pub fn send_body(&mut self, context: ContextId, chunk: &[u8], end: bool) -> bool {
        let Some(&(worker, _)) = self.requests.get(&context) else {
            return false;
        };
        let held = self
            .workers
            .get(worker)
            .is_some_and(|w| w.reads_request_body(context).is_some());
        if !held {
            return false;
        }
        if let Some((client_ip, headers)) = self.with_body.get(&context).cloned() {
            self.host.set_request(client_ip, headers);
        }
        let Some(step) = self
            .workers
            .get_mut(worker)
            .map(|w| w.on_request_body(&self.host, context, chunk, end))
        else {
            return false;
        };
        self.collect_calls(worker, Some(context));
        if !step.pause && self.fate(context) == Some(&Fate::Paused) {
            let now = self.now();
            self.set_fate(context, Fate::Admitted(now));
        }
        if end {
            self.with_body.remove(&context);
        }
        self.carry_out(worker, Some(context), step, false);
        true
    }

    fn send_headers(
        &mut self,
        worker: usize,
        client_ip: Option<Vec<u8>>,
        headers: Headers,
        body_follows: bool,
    ) -> ContextId {
        let context = self.next_context;
        self.next_context += 1;
        let worker = worker % self.workers.len().max(1);
        self.requests.insert(context, (worker, Fate::Paused));
        if body_follows {
            self.with_body
                .insert(context, (client_ip.clone(), headers.clone()));
        }
        self.host.set_request(client_ip, headers);
        let Some((step, tracked)) = self.workers.get_mut(worker).map(|w| {
            let step = if body_follows {
                w.on_request_headers_with_body(&self.host, context)
            } else {
                w.on_request_headers(&self.host, context)
            };
            (step, w.tracks(context))
        }) else {
            return context;
        };
        if !tracked && self.profile == HostProfile::ENVOY_NATIVE {
            self.untracked.insert(context);
        }
        self.collect_calls(worker, Some(context));
        if !step.pause {
            let now = self.now();
            self.set_fate(context, Fate::Admitted(now));
        }
        self.carry_out(worker, Some(context), step, false);
        context
    }

    /// The upstream answers an admitted request with `headers`; the headers the filter
    /// added are returned.
    pub fn respond(
        &mut self,
        context: ContextId,
        headers: &[(&str, &str)],
    ) -> Vec<(&'static str, String)> {
        let Some(&(worker, _)) = self.requests.get(&context) else {
            return Vec::new();
        };
        *self.host.response.borrow_mut() = headers
            .iter()
            .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()))
            .collect();
        if let Some(watch) = self.watches.remove(&context) {
            // As the native module: counted in the taps, or judged by the worker.
            let host = &self.host;
            if let Err(watch) = watch.count_alone(host.response_status(), || host.now()) {
                if let Some(step) = self
                    .workers
                    .get_mut(worker)
                    .map(|w| w.on_watch_answered(&self.host, watch))
                {
                    self.carry_out(worker, Some(context), step, false);
                }
            }
        }
        if self.untracked.contains(&context) {
            return self.added.remove(&context).unwrap_or_default();
        }
        if let Some(step) = self
            .workers
            .get_mut(worker)
            .map(|w| w.on_response_headers(&self.host, context))
        {
            self.carry_out(worker, Some(context), step, false);
        }
        self.added.remove(&context).unwrap_or_default()
    }

    /// A chunk of the answer's body passes (after [`Sim::respond`]); `end`: the last. As a
    /// binding does, the chunk is handed over only while the worker reads the body.
    /// Returns whether it was.
    pub fn respond_body(&mut self, context: ContextId, chunk: &[u8], end: bool) -> bool {
        let Some(&(worker, _)) = self.requests.get(&context) else {
            return false;
        };
        if self.untracked.contains(&context) {
            return false;
        }
        let Some(w) = self.workers.get_mut(worker) else {
            return false;
        };
        if !w.reads_response_body(context) {
            return false;
        }
        let step = w.on_response_body(&self.host, context, chunk, end);
        self.carry_out(worker, Some(context), step, false);
        true
    }

    /// The request's context is deleted (it ended, or its client left). `forget`: the
    /// simulation keeps no record of it either (long replays).
    pub fn end(&mut self, context: ContextId) {
        self.end_request(context, false);
    }

    /// Ends a request and forgets it.
    pub fn forget(&mut self, context: ContextId) {
        self.end_request(context, true);
    }

    /// The host runs a request on while it is paused for its call, and deletes its
    /// context before the call answers: what nginx does without
    /// `proxy_wasm_request_headers_in_access on;` (its worker then crashes when the call
    /// answers, which the simulation does not play).
    pub fn run_on(&mut self, context: ContextId) {
        if self.fate(context) == Some(&Fate::Paused) {
            let now = self.now();
            self.set_fate(context, Fate::Admitted(now));
        }
        self.delete(context, false);
    }

    fn end_request(&mut self, context: ContextId, forget: bool) {
        let calling = self
            .flights
            .iter()
            .any(|flight| flight.context == Some(context) && !flight.dropped);
        if self.profile.pausing_needs.is_some()
            && calling
            && self.fate(context) == Some(&Fate::Paused)
        {
            // ngx_wasm_module does not read the client of a paused request: it sees it gone
            // once the call answered and the request went on.
            self.leaving.insert(context, forget);
            return;
        }
        self.delete(context, forget);
    }

    /// The host deletes the request's context now.
    fn delete(&mut self, context: ContextId, forget: bool) {
        let Some((worker, fate)) = self.requests.get_mut(&context) else {
            return;
        };
        if *fate == Fate::Paused {
            *fate = Fate::Gone;
        }
        let worker = *worker;
        if let Some(watch) = self.watches.remove(&context) {
            if let Some(step) = self
                .workers
                .get_mut(worker)
                .map(|w| w.on_watch_unanswered(&self.host, watch))
            {
                self.carry_out(worker, Some(context), step, false);
            }
        }
        let tracked = !self.untracked.remove(&context);
        if let Some(step) = self
            .workers
            .get_mut(worker)
            .filter(|_| tracked)
            .map(|w| w.on_context_gone(&self.host, context))
        {
            self.carry_out(worker, Some(context), step, false);
        }
        self.collect_calls(worker, None);
        // The calls its context made are on their way all the same; the host drops their
        // answers (the SDK files an answer under the context that made the call).
        for flight in &mut self.flights {
            if flight.context == Some(context) {
                flight.dropped = true;
            }
        }
        if forget {
            self.requests.remove(&context);
            self.added.remove(&context);
            self.replies.remove(&context);
        }
    }

    /// The value the upstream sees of a request header the worker set (`None`: unset,
    /// removed, or set empty: nginx, where the worker clears a header by emptying it, sends
    /// no header of an empty value through `proxy_set_header NAME $http_NAME`; the
    /// simulation's requests carry no such header of their own).
    pub fn upstream_header(&self, context: ContextId, name: &str) -> Option<&str> {
        self.edited
            .get(&context)?
            .iter()
            .find(|(held, _)| held == name)
            .map(|(_, value)| value.as_str())
            .filter(|value| !value.is_empty())
    }

    /// Whether the worker left `name` on the request with an empty value (how it clears a
    /// header where a removed one would reach the upstream).
    pub fn emptied_header(&self, context: ContextId, name: &str) -> bool {
        self.edited.get(&context).is_some_and(|headers| {
            headers
                .iter()
                .any(|(held, value)| held == name && value.is_empty())
        })
    }

    /// Whether the worker removed `name` from the request before it went on.
    pub fn removed_header(&self, context: ContextId, name: &str) -> bool {
        self.removed
            .get(&context)
            .is_some_and(|names| names.iter().any(|held| held == name))
    }

    pub fn reply(&self, context: ContextId) -> Option<&LocalReply> {
        self.replies.get(&context)
    }

    pub fn fate(&self, context: ContextId) -> Option<&Fate> {
        self.requests.get(&context).map(|(_, fate)| fate)
    }

    /// Whether the host keeps this request's breaker calls (`Step::watch`), unjudged yet.
    pub fn keeps_calls_of(&self, context: ContextId) -> bool {
        self.watches.contains_key(&context)
    }

    /// Whether the worker that has this request tracks it (`Worker::tracks`).
    pub fn tracks(&self, context: ContextId) -> bool {
        self.requests
            .get(&context)
            .and_then(|(worker, _)| self.workers.get(*worker))
            .is_some_and(|worker| worker.tracks(context))
    }

    /// Every request's fate.
    pub fn fates(&self) -> impl Iterator<Item = (&ContextId, &Fate)> {
        self.requests
            .iter()
            .map(|(context, (_, fate))| (context, fate))
    }

    /// Calls in flight in the simulated network.
    pub fn in_flight(&self) -> usize {
        self.flights.len()
    }

    /// Moves the clock to `now + by`, delivering every answer and tick due on the way, in
    /// time order.
    pub fn advance(&mut self, by: Duration) {
        let target = self.now().saturating_add(Nanos::saturating_from_std(by));
        self.advance_to(target);
    }

    /// Moves the clock to `target` (never back), delivering every answer and tick due on
    /// the way, in time order.
    pub fn advance_to(&mut self, target: Instant) {
        loop {
            let next_flight = self.flights.iter().map(|flight| flight.due).min();
            let next_tick = self.ticks.iter().flatten().map(|&(_, at)| at).min();
            let next = match (next_flight, next_tick) {
                (Some(a), Some(b)) => a.min(b),
                (a, b) => match a.or(b) {
                    Some(next) => next,
                    None => break,
                },
            };
            if next > target {
                break;
            }
            self.host.clock.set(Some(next.max(self.now())));
            if next_flight == Some(next) {
                self.deliver_due();
            } else {
                self.tick_due();
            }
        }
        self.host.clock.set(Some(target.max(self.now())));
    }

    fn deliver_due(&mut self) {
        let now = self.now();
        let Some(position) = self.flights.iter().position(|flight| flight.due <= now) else {
            return;
        };
        let flight = self.flights.swap_remove(position);
        let answer = match self.service {
            Service::Answers(_) if is_quota_call(&flight.callout) => {
                self.quota.borrow_mut().answer(&flight.callout, now)
            }
            Service::Answers(_) => Answer::with(404, Vec::new()),
            Service::Down(_) => Answer::NoAnswer,
            Service::Lost(_) => {
                if is_quota_call(&flight.callout) {
                    let _ = self.quota.borrow_mut().answer(&flight.callout, now);
                }
                Answer::NoAnswer
            }
        };
        if flight.dropped {
            return;
        }
        let Some(step) = self
            .workers
            .get_mut(flight.worker)
            .map(|w| w.on_call_answered(&self.host, flight.token, answer))
        else {
            return;
        };
        self.collect_calls(flight.worker, flight.context);
        if let Some(context) = flight.context {
            // nginx resumes a request itself once its last call is answered.
            if self.profile.resumes_after_own_call
                && !step.pause
                && !step
                    .commands
                    .iter()
                    .any(|command| matches!(command, Command::Reply(c, _) if *c == context))
                && self.fate(context) == Some(&Fate::Paused)
            {
                self.set_fate(context, Fate::Admitted(now));
            }
        }
        self.carry_out(
            flight.worker,
            flight.context,
            step,
            flight.context.is_none(),
        );
        if let Some(forget) = flight.context.and_then(|c| self.leaving.remove(&c)) {
            if let Some(context) = flight.context {
                self.end_request(context, forget);
            }
        }
    }

    fn tick_due(&mut self) {
        let now = self.now();
        for index in 0..self.workers.len() {
            let Some(Some((period, at))) = self.ticks.get(index).copied() else {
                continue;
            };
            if at > now {
                continue;
            }
            if let Some(slot) = self.ticks.get_mut(index) {
                // A tick asked for with no period set runs once.
                *slot = (!period.is_zero()).then(|| {
                    (
                        period,
                        now.saturating_add(Nanos::saturating_from_std(period)),
                    )
                });
            }
            let Some(step) = self.workers.get_mut(index).map(|w| w.on_tick(&self.host)) else {
                continue;
            };
            self.collect_calls(index, None);
            self.carry_out(index, None, step, true);
        }
    }

    /// Keeps a request's breaker calls the worker handed over, as the native module does
    /// (`Step::watch`): only from the request's own event, on a host that keeps them.
    fn keep(&mut self, current: Option<ContextId>, watch: Watch) {
        let context = watch.context();
        if !self.profile.keeps_breaker_calls || current != Some(context) {
            self.violations.push(Violation::Watch(context));
        }
        if self.watches.insert(context, watch).is_some() {
            self.violations.push(Violation::Watch(context));
        }
    }

    /// Files the calls the last event dispatched.
    fn collect_calls(&mut self, worker: usize, context: Option<ContextId>) {
        let latency = match self.service {
            Service::Answers(latency) | Service::Down(latency) | Service::Lost(latency) => latency,
        };
        let due = self.now().saturating_add(latency);
        for (token, callout) in self.host.take_dispatched() {
            self.flights.push(Flight {
                worker,
                token,
                callout,
                due,
                context,
                dropped: false,
            });
        }
    }

    fn set_fate(&mut self, context: ContextId, fate: Fate) {
        if let Some((_, current)) = self.requests.get_mut(&context) {
            *current = fate;
        }
    }

    /// Carries out commands from `current` (`None`: the root context).
    fn carry_out(
        &mut self,
        worker: usize,
        current: Option<ContextId>,
        step: Step,
        from_root: bool,
    ) {
        let Step {
            commands, watch, ..
        } = step;
        if let Some(watch) = watch {
            self.keep(current, watch);
        }
        let mut tick_now = false;
        for command in commands {
            match command {
                Command::Resume(context) | Command::Reply(context, _)
                    if Some(context) != current && !self.profile.resumes_from_other_contexts =>
                {
                    self.violations.push(Violation::FromOtherContext(context));
                }
                Command::Resume(context) => match self.fate(context) {
                    Some(Fate::Paused) => {
                        let now = self.now();
                        self.set_fate(context, Fate::Admitted(now));
                    }
                    Some(Fate::Gone) => {}
                    Some(_) => self.violations.push(Violation::ResumedNotPaused(context)),
                    None => self.violations.push(Violation::Unknown(context)),
                },
                Command::Reply(context, mut reply) => match self.fate(context) {
                    Some(Fate::Gone) => {}
                    Some(_) => {
                        self.set_fate(context, Fate::Replied(reply.status));
                        if self.profile.appends_line_feed_to_replies {
                            reply.body.push('\n');
                        }
                        self.replies.insert(context, reply);
                    }
                    None => self.violations.push(Violation::Unknown(context)),
                },
                Command::AddHeaders(headers) => {
                    if let Some(context) = current {
                        self.added.entry(context).or_default().extend(headers);
                    }
                }
                Command::EditRequest(context, edits) => {
                    // Before the request goes on: at its headers (it is current), or while
                    // it is paused (entered from elsewhere where the host can).
                    let before = match self.fate(context) {
                        Some(Fate::Paused) => {
                            Some(context) == current || self.profile.resumes_from_other_contexts
                        }
                        Some(Fate::Admitted(_)) => Some(context) == current,
                        _ => false,
                    };
                    if !before {
                        self.violations.push(Violation::EditedGoneOn(context));
                        continue;
                    }
                    let headers = self.edited.entry(context).or_default();
                    for edit in edits {
                        headers.retain(|(name, _)| *name != edit.name);
                        match edit.value {
                            Some(value) => headers.push((edit.name, value)),
                            None => self.removed.entry(context).or_default().push(edit.name),
                        }
                    }
                }
                Command::SetTick(period) => {
                    if !self.profile.tick_settable_anywhere && (!from_root || period.is_zero()) {
                        self.violations.push(Violation::Tick(period));
                    }
                    let at = self
                        .now()
                        .saturating_add(Nanos::saturating_from_std(period));
                    if let Some(slot) = self.ticks.get_mut(worker) {
                        *slot = (!period.is_zero()).then_some((period, at));
                    }
                }
                Command::TickNow => {
                    if !self.profile.ticks_on_demand {
                        self.violations.push(Violation::TickNow);
                    }
                    tick_now = true;
                }
            }
        }
        // The host runs it next, at this instant, and its period goes on: a period set by
        // the same event does not put it off (as in the native module's `Core::settle`).
        if tick_now {
            let now = self.now();
            if let Some(slot) = self.ticks.get_mut(worker) {
                let period = slot.map_or(Duration::ZERO, |(period, _)| period);
                *slot = Some((period, now));
            }
        }
    }
}
