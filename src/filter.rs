//! The proxy-wasm contexts. The root context owns the configuration and the tick that
//! resumes requests waiting for their leaky-bucket turn or parked behind another request's
//! callout (single flight); each HTTP context evaluates its request once and applies the
//! [`Decision`]. Borrows of per-VM state are short and never held across a hostcall: a
//! local reply re-enters the filter synchronously on Envoy. For the same reason requests
//! other than the current one are only ever resumed or answered from the root context:
//! from an HTTP context, the re-entry would find the SDK's table of HTTP contexts borrowed.

use crate::host::{self, HostKind, HostMetrics, HostRequest, HostSharedData, Sink};
use diana_core::config::{parse_policy, MetricsSpec, Policy, RemoteSpec};
use diana_core::decision::{AfterResponse, Callout, Decision, Reply};
use diana_core::engine::{Engine, EngineDecision, Pending, Refill};
use diana_core::global::debts::Debt;
use diana_core::global::flights::RiderId;
use diana_core::global::MAX_ANSWER_BYTES;
use diana_core::lifecycle;
use diana_core::metrics::{Event, MetricSink};
use diana_core::remote::{self, PollOutcome};
use diana_core::store::Store;
use diana_core::time::{Nanos, NANOS_PER_SECOND};
use hashbrown::HashMap;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType};
use std::cell::RefCell;
use std::collections::BTreeSet;
use std::rc::Rc;
use std::time::Duration;

/// How often the root context looks for waiting requests whose turn has come.
const WAIT_TICK: Duration = Duration::from_millis(2);
/// How often the root context looks for parked requests whose flight has landed (the
/// host's finest tick: a parked request waits at most this long beyond its flight).
const RIDER_TICK: Duration = Duration::from_millis(1);

/// An accepted policy with its host metrics. HTTP contexts keep the one they started
/// with, so a reload never changes the rules under a request in flight.
struct Configured {
    engine: Engine,
    metrics: HostMetrics,
    /// The policy has a `metrics.path`.
    serves_metrics: bool,
}

/// How often a worker checks for a newer remote document published by another worker.
const REMOTE_CHECK: Duration = Duration::from_secs(1);
/// The least time between two checks when the tick runs faster (leaky-bucket waiters).
const REMOTE_CHECK_SPACING: Nanos = NANOS_PER_SECOND * 3 / 4;

/// How long a config-center poll may take.
const POLL_TIMEOUT: Duration = Duration::from_secs(5);

/// A request parked behind another request's callout: its context, the configuration it
/// started with, and its state.
struct Parked {
    context_id: u32,
    configured: Rc<Configured>,
    pending: Pending,
}

/// What the root context does to another request's stream once its own calls are made.
struct Effect {
    context_id: u32,
    decision: EngineDecision,
}

/// What the root context decided for a parked request, for its own context to use.
struct Answer {
    headers: Vec<(&'static str, String)>,
    after: Option<AfterResponse>,
    /// The request was admitted after a wait and is among the waiters until then.
    waiting_until: Option<Nanos>,
}

/// Per-VM state shared by the root context and the HTTP contexts of one worker.
#[derive(Default)]
struct Vm {
    configured: Option<Rc<Configured>>,
    /// Requests paused until their turn: (resume at, context id).
    waiters: BTreeSet<(Nanos, u32)>,
    /// Requests parked behind another request's callout.
    parked: HashMap<RiderId, Parked>,
    /// The root context's decisions for parked requests, by context id.
    answers: HashMap<u32, Answer>,
    /// The tick period when nobody waits (remote checks), zero for none.
    base_tick: Duration,
    /// The tick period set last (Envoy).
    tick: Duration,
}

impl Vm {
    /// The tick period this worker needs now: fine while requests wait or are parked.
    fn wanted_tick(&self) -> Duration {
        let refill = self
            .configured
            .as_ref()
            .is_some_and(|configured| configured.engine.wants_refill());
        if !self.parked.is_empty() || refill {
            RIDER_TICK
        } else if !self.waiters.is_empty() {
            WAIT_TICK
        } else {
            self.base_tick
        }
    }
}

type VmRef = Rc<RefCell<Vm>>;

/// Runs `f` on the VM state if it is not already borrowed (it never is, by construction;
/// if it were, skipping is the defined behaviour, never a panic).
fn with_vm<T>(vm: &VmRef, f: impl FnOnce(&mut Vm) -> T) -> Option<T> {
    match vm.try_borrow_mut() {
        Ok(mut state) => Some(f(&mut state)),
        Err(_) => {
            log::error!("diana: VM state busy; operation skipped");
            None
        }
    }
}

fn set_tick(period: Duration) {
    if let Err(status) = hostcalls::set_tick_period(period) {
        log::warn!("diana: cannot set tick period: {status:?}");
    }
}

/// Sets the tick period the worker needs now, if it changed (Envoy: the period may be set
/// from any context, any number of times).
fn retick(vm: &VmRef) {
    let change = with_vm(vm, |vm| {
        let wanted = vm.wanted_tick();
        (wanted != vm.tick).then(|| {
            vm.tick = wanted;
            wanted
        })
    })
    .flatten();
    if let Some(period) = change {
        set_tick(period);
    }
}

pub struct DianaRoot {
    context_id: u32,
    vm: VmRef,
    /// Counters for configuration events, defined before any policy exists.
    events: Rc<HostMetrics>,
    host: HostKind,
    /// On hosts where the tick period may be set only once: whether it was.
    tick_fixed: bool,
    /// The config center, from the local document (a remote document moves it only if the
    /// local one's `remote.allow` names `remote`).
    remote: Option<RemoteSpec>,
    /// The local document: what a remote one is judged against (DESIGN §6).
    local: Option<Rc<Policy>>,
    /// The metrics path, from the local document too (a remote document cannot move it
    /// or take it away).
    metrics: Option<MetricsSpec>,
    /// Version of the published remote document this worker runs (0 = local document).
    applied_version: u64,
    /// The poll this worker has in flight.
    poll_token: Option<u32>,
    /// The callout paying this worker's response costs: its token, the policy it was made
    /// with, and the debts it carries.
    payment: Option<(u32, Rc<Configured>, Vec<Debt>)>,
    next_remote_check: Nanos,
    store: Store,
    /// Callouts made for woken parked requests, by token.
    rider_calls: HashMap<u32, Parked>,
    /// Callouts refilling lease stashes ahead, by token.
    refill_calls: HashMap<u32, (Rc<Configured>, Refill)>,
}

impl DianaRoot {
    pub fn new(context_id: u32) -> DianaRoot {
        DianaRoot {
            context_id,
            vm: Rc::new(RefCell::new(Vm::default())),
            events: Rc::new(HostMetrics::events_only()),
            host: HostKind::Envoy,
            tick_fixed: false,
            remote: None,
            local: None,
            metrics: None,
            applied_version: 0,
            poll_token: None,
            payment: None,
            next_remote_check: 0,
            store: Store::new(),
            rider_calls: HashMap::new(),
            refill_calls: HashMap::new(),
        }
    }

    /// Plans the parked requests whose flight has landed again. Their calls are made at
    /// once; what touches their streams is added to `effects`, to be carried out after
    /// every call of this callback (see [`DianaRoot::carry_out`]).
    fn serve_riders(&mut self, effects: &mut Vec<Effect>) {
        let engines: Vec<Rc<Configured>> = with_vm(&self.vm, |vm| {
            let mut engines: Vec<Rc<Configured>> = Vec::new();
            for parked in vm.parked.values() {
                if !engines.iter().any(|c| Rc::ptr_eq(c, &parked.configured)) {
                    engines.push(Rc::clone(&parked.configured));
                }
            }
            engines
        })
        .unwrap_or_default();
        for configured in engines {
            for rider in configured.engine.woken(host::now()) {
                let Some(parked) = with_vm(&self.vm, |vm| vm.parked.remove(&rider)).flatten()
                else {
                    continue;
                };
                let decision = parked.configured.engine.resume(
                    &HostSharedData,
                    parked.pending,
                    host::now(),
                    &mut Sink(&parked.configured.metrics),
                );
                self.settle(parked.context_id, parked.configured, decision, effects);
            }
        }
    }

    /// Takes `decision` for the parked request of `context_id`: parks it again, or makes
    /// its call, or adds what its stream must do to `effects`.
    fn settle(
        &mut self,
        context_id: u32,
        configured: Rc<Configured>,
        decision: EngineDecision,
        effects: &mut Vec<Effect>,
    ) {
        match decision {
            Decision::Wait(pending) => {
                if let Some(rider) = pending.rider() {
                    with_vm(&self.vm, |vm| {
                        vm.parked.insert(
                            rider,
                            Parked {
                                context_id,
                                configured,
                                pending,
                            },
                        )
                    });
                }
            }
            Decision::Call(callout, pending) => {
                // Made by the root context, which outlives any request.
                match host::dispatch(self.host, &callout) {
                    Ok(token) => {
                        self.rider_calls.insert(
                            token,
                            Parked {
                                context_id,
                                configured,
                                pending,
                            },
                        );
                    }
                    Err(reason) => {
                        let decision = configured.engine.complete(
                            &HostSharedData,
                            pending,
                            Reply::NotSent(reason),
                            host::now(),
                            &mut Sink(&configured.metrics),
                        );
                        self.settle(context_id, configured, decision, effects);
                    }
                }
            }
            decided => effects.push(Effect {
                context_id,
                decision: decided,
            }),
        }
    }

    /// Resumes or answers other requests' streams. Last in a callback: either may re-enter
    /// the filter for that request (a local reply does at once), after which the SDK would
    /// file a callout made by this callback under that request instead of the root
    /// context.
    fn carry_out(&self, effects: Vec<Effect>) {
        for Effect {
            context_id,
            decision,
        } in effects
        {
            if !enter(context_id) {
                continue;
            }
            match decision {
                Decision::Allow { headers, after } => {
                    answer(&self.vm, context_id, headers, after, None);
                    resume_current(context_id);
                }
                Decision::Delay {
                    until,
                    headers,
                    after,
                } => {
                    answer(&self.vm, context_id, headers, after, Some(until));
                    with_vm(&self.vm, |vm| vm.waiters.insert((until, context_id)));
                }
                Decision::Reject(rejection) => send_rejection(self.host, &rejection),
                // Settled before (see `settle`).
                Decision::Wait(_) | Decision::Call(..) => {}
            }
        }
        self.restore_context();
    }

    /// Makes the root context the effective one again after acting for a request (a
    /// callout made meanwhile would belong to that request).
    fn restore_context(&self) {
        if let Err(status) = hostcalls::set_effective_context(self.context_id) {
            log::debug!("diana: cannot restore the root context: {status:?}");
        }
    }

    /// Makes `policy` the one new requests are evaluated with.
    fn install(&mut self, mut policy: Policy, origin: &str) {
        policy.metrics = self.metrics.clone();
        // Identities keyed with the process's random key when the document sets no
        // identity_key (read again at every install); one warning when global rules hash
        // with the public key (DESIGN §6).
        diana_core::store::identity::prepare(&mut policy, &self.store, &HostSharedData);
        let dropped = lifecycle::adopt(&self.store, &HostSharedData, &policy);
        if dropped > 0 {
            log::info!("diana: {dropped} rules left the configuration; their records are released");
        }
        let engine = Engine::new(policy).with_pausing(self.host.can_pause());
        let metrics = HostMetrics::define(engine.rules());
        log::info!(
            "diana: {origin} configuration applied: {} resources, {} rules",
            engine.policy().resources.len(),
            engine.rules().count()
        );
        Sink(&self.events).event(Event::ConfigReload);
        with_vm(&self.vm, |vm| {
            let serves_metrics = engine.policy().metrics.is_some();
            vm.configured = Some(Rc::new(Configured {
                engine,
                metrics,
                serves_metrics,
            }));
        });
    }

    /// Applies a remote document that any worker published and this one does not run yet.
    fn adopt_published(&mut self) {
        if remote::published_version(&self.store, &HostSharedData) <= self.applied_version {
            return;
        }
        let Some(published) = remote::read_published(&self.store, &HostSharedData) else {
            return;
        };
        if published.version <= self.applied_version {
            return;
        }
        self.applied_version = published.version;
        let Some(local) = self.local.clone() else {
            return;
        };
        match remote::adopt(&published, &local) {
            Ok(policy) => {
                self.install_remote(policy, &format!("remote (version {})", published.version))
            }
            Err(error) => {
                log::error!("diana: published {error}; keeping the current configuration")
            }
        }
    }

    /// Installs a remote document, and polls where it says (the local document's config
    /// center unless `remote.allow` lets it move).
    fn install_remote(&mut self, policy: Policy, origin: &str) {
        if policy.remote.is_some() {
            self.remote.clone_from(&policy.remote);
        }
        self.install(policy, origin);
    }

    /// Polls the config center if this worker claims this period's poll.
    fn poll(&mut self, spec: &RemoteSpec, now: Nanos) {
        if self.poll_token.is_some() || !remote::claim_poll(&self.store, &HostSharedData, spec, now)
        {
            return;
        }
        if self.host == HostKind::Nginx && !host::is_host_port(&spec.cluster) {
            self.record_poll(Err(format!(
                "remote.cluster {:?} is not host:port, which nginx needs",
                spec.cluster
            )));
            return;
        }
        // Conditional only for the document this worker runs: one it refused (its local
        // document changed since) is asked for again in full.
        let etag = remote::read_published(&self.store, &HostSharedData)
            .filter(|p| p.version == self.applied_version)
            .and_then(|p| p.etag);
        let headers = remote::poll_headers(spec, etag.as_deref());
        match hostcalls::dispatch_http_call(&spec.cluster, headers, None, vec![], POLL_TIMEOUT) {
            Ok(token) => self.poll_token = Some(token),
            Err(status) => self.record_poll(Err(format!(
                "dispatch to {} failed: {status:?}",
                spec.cluster
            ))),
        }
    }

    fn record_poll(&mut self, result: Result<(), String>) {
        let switched = remote::record_health(&self.store, &HostSharedData, result.is_ok());
        match result {
            Ok(()) if switched => log::warn!("diana: config center is back"),
            Ok(()) => {}
            Err(reason) => {
                Sink(&self.events).event(Event::ConfigFetchError);
                if switched {
                    log::warn!("diana: config center failing ({reason}); keeping the current configuration");
                }
            }
        }
    }

    fn on_poll_answer(&mut self, num_headers: usize, body_size: usize) {
        let (status, etag, signature) = if num_headers == 0 {
            (0, None, None)
        } else {
            let status = host::callout_status();
            let etag = host::header_bytes(MapType::HttpCallResponseHeaders, "etag")
                .and_then(|e| String::from_utf8(e).ok());
            let signature =
                host::header_bytes(MapType::HttpCallResponseHeaders, remote::SIGNATURE_HEADER);
            (status, etag, signature)
        };
        let Some(local) = self.local.clone() else {
            return;
        };
        let body = if status == 200 && body_size <= remote::MAX_DOCUMENT_BYTES {
            match hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size) {
                Ok(body) => body.unwrap_or_default(),
                Err(status) => {
                    self.record_poll(Err(format!("unreadable body: {status:?}")));
                    return;
                }
            }
        } else {
            vec![0; body_size.min(remote::MAX_DOCUMENT_BYTES + 1)]
        };
        let published = remote::read_published(&self.store, &HostSharedData);
        match remote::interpret(
            status,
            etag,
            signature.as_deref(),
            &body,
            published.as_ref(),
            &local,
        ) {
            PollOutcome::Unchanged => self.record_poll(Ok(())),
            PollOutcome::Refused(reason) => {
                Sink(&self.events).event(Event::ConfigRejected);
                Sink(&self.events).event(Event::ConfigRemoteRefused);
                // Once per document and reason: the same body unsigned, then badly signed,
                // is logged twice.
                let refusal = [body.as_slice(), reason.as_bytes()].concat();
                if remote::first_rejection(&self.store, &HostSharedData, &refusal) {
                    log::error!("diana: {reason}; keeping the current configuration");
                }
                self.record_poll(Err(reason));
            }
            PollOutcome::Rejected(reason) => {
                Sink(&self.events).event(Event::ConfigRejected);
                if remote::first_rejection(&self.store, &HostSharedData, &body) {
                    log::error!("diana: {reason}; keeping the current configuration");
                }
                self.record_poll(Err(reason));
            }
            PollOutcome::Failed(reason) => self.record_poll(Err(reason)),
            PollOutcome::New {
                policy,
                text,
                etag,
                signature,
            } => {
                self.record_poll(Ok(()));
                match remote::publish(&self.store, &HostSharedData, &text, etag, signature) {
                    Some(version) => {
                        self.applied_version = version;
                        self.install_remote(*policy, &format!("remote (version {version})"));
                    }
                    None => log::warn!(
                        "diana: could not publish the remote document; retrying next poll"
                    ),
                }
            }
        }
    }

    /// Sends the response costs this worker owes to the quota service (one callout at a
    /// time).
    fn pay_debts(&mut self) {
        if self.payment.is_some() {
            return;
        }
        let Some(configured) = with_vm(&self.vm, |vm| vm.configured.clone()).flatten() else {
            return;
        };
        if !configured.engine.owes() {
            return;
        }
        let Some((callout, debts)) = configured.engine.pay_debts(
            &HostSharedData,
            host::now(),
            &mut Sink(&configured.metrics),
        ) else {
            return;
        };
        match host::dispatch(self.host, &callout) {
            Ok(token) => self.payment = Some((token, configured, debts)),
            Err(reason) => configured.engine.debts_paid(
                &HostSharedData,
                debts,
                Reply::NotSent(reason),
                host::now(),
                &mut Sink(&configured.metrics),
            ),
        }
    }

    /// Sends the calls that refill running-low lease stashes ahead (Envoy: the engine
    /// orders none where requests cannot wait on a flight).
    fn send_refills(&mut self, configured: &Rc<Configured>) {
        if !configured.engine.wants_refill() {
            return;
        }
        let refills =
            configured
                .engine
                .refill(&HostSharedData, host::now(), &mut Sink(&configured.metrics));
        for (callout, refill) in refills {
            match host::dispatch(self.host, &callout) {
                Ok(token) => {
                    self.refill_calls
                        .insert(token, (Rc::clone(configured), refill));
                }
                Err(reason) => configured.engine.refilled(
                    &HostSharedData,
                    refill,
                    Reply::NotSent(reason),
                    host::now(),
                    &mut Sink(&configured.metrics),
                ),
            }
        }
    }

    /// The tick period when nobody waits: config-center checks, and releasing the records
    /// of rules an earlier document had. An installed policy always needs it: its metrics
    /// are flushed from the tick (and it may owe response costs or hold idle batches).
    fn base_tick(&self) -> Duration {
        let installed = with_vm(&self.vm, |vm| vm.configured.is_some()) == Some(true);
        if self.remote.is_some() || installed || lifecycle::has_work(&self.store, &HostSharedData) {
            REMOTE_CHECK
        } else {
            Duration::ZERO
        }
    }

    fn read_configuration(size: usize) -> Result<String, String> {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => Vec::new(),
            Err(status) => return Err(format!("cannot read the plugin configuration: {status:?}")),
        };
        String::from_utf8(bytes).map_err(|e| format!("configuration is not UTF-8: {e}"))
    }
}

impl Context for DianaRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(parked) = self.rider_calls.remove(&token_id) {
            let reply = host::callout_reply(num_headers, body_size, MAX_ANSWER_BYTES);
            let decision = parked.configured.engine.complete(
                &HostSharedData,
                parked.pending,
                reply,
                host::now(),
                &mut Sink(&parked.configured.metrics),
            );
            let mut effects = Vec::new();
            self.settle(parked.context_id, parked.configured, decision, &mut effects);
            // The requests parked behind this flight are served now, not a tick later.
            self.serve_riders(&mut effects);
            self.carry_out(effects);
            retick(&self.vm);
        } else if let Some((configured, refill)) = self.refill_calls.remove(&token_id) {
            let reply = host::callout_reply(num_headers, body_size, MAX_ANSWER_BYTES);
            configured.engine.refilled(
                &HostSharedData,
                refill,
                reply,
                host::now(),
                &mut Sink(&configured.metrics),
            );
            let mut effects = Vec::new();
            self.serve_riders(&mut effects);
            self.carry_out(effects);
            retick(&self.vm);
        } else if self.poll_token == Some(token_id) {
            self.poll_token = None;
            self.on_poll_answer(num_headers, body_size);
        } else if let Some((token, configured, debts)) = self.payment.take() {
            if token != token_id {
                self.payment = Some((token, configured, debts));
                return;
            }
            let reply = host::callout_reply(num_headers, body_size, 0);
            configured.engine.debts_paid(
                &HostSharedData,
                debts,
                reply,
                host::now(),
                &mut Sink(&configured.metrics),
            );
        }
    }
}

impl RootContext for DianaRoot {
    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let policy = Self::read_configuration(plugin_configuration_size)
            .and_then(|text| parse_policy(&text).map_err(|e| e.message));
        let policy = match policy {
            Ok(policy) => policy,
            Err(message) => {
                log::error!("diana: configuration rejected: {message}");
                Sink(&self.events).event(Event::ConfigRejected);
                self.events.flush();
                return false;
            }
        };
        self.host = host::detect();
        if self.host == HostKind::Nginx {
            self.store = Store::strict();
            log::info!("diana: ngx_wasm_module: leaky-bucket waits become Retry-After (local) or are done by the quota service (global)");
        }
        self.remote = policy.remote.clone();
        self.local = Some(Rc::new(policy.clone()));
        self.metrics = policy.metrics.clone();
        self.applied_version = 0;
        self.install(policy, "local");
        let base_tick = self.base_tick();
        match self.host {
            HostKind::Envoy => {
                with_vm(&self.vm, |vm| vm.base_tick = base_tick);
                retick(&self.vm);
            }
            HostKind::Nginx if !self.tick_fixed && !base_tick.is_zero() => {
                // Once, from the root context, and never zero (a zero period re-arms at
                // once there: a busy loop).
                set_tick(base_tick);
                self.tick_fixed = true;
            }
            HostKind::Nginx => {}
        }
        true
    }

    fn on_tick(&mut self) {
        let Some(now) = host::now() else {
            return;
        };
        let due = with_vm(&self.vm, |vm| {
            let mut due = Vec::new();
            while let Some(&(until, id)) = vm.waiters.first() {
                if until > now {
                    break;
                }
                vm.waiters.pop_first();
                due.push(id);
            }
            due
        })
        .unwrap_or_default();
        if let Some(spec) = self.remote.clone() {
            if now >= self.next_remote_check {
                // A tick that lands a little early must still count: with a deadline of
                // exactly one period, tick jitter made a worker skip every other tick and
                // adopt a published document up to two seconds late.
                self.next_remote_check = now.saturating_add(REMOTE_CHECK_SPACING);
                self.adopt_published();
                self.poll(&spec, now);
            }
        }
        self.pay_debts();
        if let Some(configured) = with_vm(&self.vm, |vm| vm.configured.clone()).flatten() {
            configured.engine.tick(&HostSharedData, host::HostClock);
            // Before any other request's stream is entered (see `carry_out`).
            self.send_refills(&configured);
            configured.metrics.flush();
        }
        self.events.flush();
        if lifecycle::has_work(&self.store, &HostSharedData) {
            lifecycle::sweep(&self.store, &HostSharedData);
        }
        // Other requests' streams last: every call of this tick is made (see `carry_out`).
        if self.host.can_pause() {
            let mut effects = Vec::new();
            self.serve_riders(&mut effects);
            for context_id in due {
                if enter(context_id) {
                    resume_current(context_id);
                }
            }
            self.carry_out(effects);
        }
        if self.host == HostKind::Envoy {
            // The tick stops when nothing needs it any more (the records are released).
            let base_tick = self.base_tick();
            with_vm(&self.vm, |vm| vm.base_tick = base_tick);
            retick(&self.vm);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let configured = with_vm(&self.vm, |vm| vm.configured.clone()).flatten();
        Some(Box::new(DianaHttp {
            context_id,
            vm: Rc::clone(&self.vm),
            configured,
            host: self.host,
            pending: None,
            response_headers: Vec::new(),
            after: None,
            waiting_until: None,
            parked: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// From the root context: makes the request of `context_id` the effective context, or
/// says it is gone.
fn enter(context_id: u32) -> bool {
    match hostcalls::set_effective_context(context_id) {
        Ok(()) => true,
        Err(status) => {
            log::debug!("diana: request {context_id} is gone: {status:?}");
            false
        }
    }
}

/// Resumes the effective (paused) request.
fn resume_current(context_id: u32) {
    if let Err(status) = hostcalls::resume_http_request() {
        log::debug!("diana: cannot resume request {context_id}: {status:?}");
    }
}

/// Leaves the root context's decision for a parked request where its context finds it.
fn answer(
    vm: &VmRef,
    context_id: u32,
    headers: Vec<(&'static str, String)>,
    after: Option<AfterResponse>,
    waiting_until: Option<Nanos>,
) {
    if headers.is_empty() && after.is_none() && waiting_until.is_none() {
        return;
    }
    with_vm(vm, |vm| {
        vm.answers.insert(
            context_id,
            Answer {
                headers,
                after,
                waiting_until,
            },
        )
    });
}

/// Sends `rejection` as the effective request's local reply.
fn send_rejection(host: HostKind, rejection: &diana_core::response::Rejection) {
    let headers: Vec<(&str, &str)> = rejection
        .headers
        .iter()
        .map(|(name, value)| (*name, value.as_str()))
        .collect();
    // ngx_wasm_module appends a line feed to every local response body: send one less so
    // that the client gets the configured body.
    let body = match host {
        HostKind::Nginx => rejection.body.strip_suffix('\n').unwrap_or(&rejection.body),
        HostKind::Envoy => &rejection.body,
    };
    if let Err(status) =
        hostcalls::send_http_response(u32::from(rejection.status), headers, Some(body.as_bytes()))
    {
        log::warn!("diana: cannot send the rejection: {status:?}");
    }
}

struct DianaHttp {
    context_id: u32,
    vm: VmRef,
    configured: Option<Rc<Configured>>,
    host: HostKind,
    /// The request is paused for this callout.
    pending: Option<Pending>,
    /// Rate-limit headers for the response (`headers: all`).
    response_headers: Vec<(&'static str, String)>,
    /// Response costs to charge once the upstream has answered.
    after: Option<AfterResponse>,
    /// The request is paused until this time (leaky bucket).
    waiting_until: Option<Nanos>,
    /// The request was parked behind another request's callout under this id; the root
    /// context carries out its decision.
    parked: Option<RiderId>,
}

impl DianaHttp {
    /// Applies a decision. `paused` says whether the request is currently paused (so
    /// admitting it means resuming it).
    fn apply(&mut self, configured: &Configured, decision: EngineDecision, paused: bool) -> Action {
        match decision {
            Decision::Allow { headers, after } => {
                self.response_headers = headers;
                self.after = after;
                // ngx_wasm_module resumes a request by itself once its last callout is
                // answered (ngx_http_proxy_wasm_dispatch.c); Envoy needs the explicit
                // resume.
                if paused && self.host == HostKind::Envoy {
                    if let Err(status) = hostcalls::resume_http_request() {
                        log::warn!("diana: cannot resume request: {status:?}");
                    }
                }
                Action::Continue
            }
            Decision::Delay {
                until,
                headers,
                after,
            } => {
                self.response_headers = headers;
                self.after = after;
                self.waiting_until = Some(until);
                with_vm(&self.vm, |vm| vm.waiters.insert((until, self.context_id)));
                // Only Envoy pauses (HostKind::can_pause); nginx traps on a tick period set
                // outside the root context.
                if self.host.can_pause() {
                    retick(&self.vm);
                }
                Action::Pause
            }
            Decision::Reject(rejection) => {
                send_rejection(self.host, &rejection);
                Action::Pause
            }
            Decision::Call(callout, pending) => self.dispatch(configured, callout, pending, paused),
            Decision::Wait(pending) => {
                // Only where the host can pause (the engine parks nothing elsewhere).
                let (Some(rider), Some(configured)) = (pending.rider(), self.configured.clone())
                else {
                    return Action::Continue;
                };
                self.parked = Some(rider);
                with_vm(&self.vm, |vm| {
                    vm.parked.insert(
                        rider,
                        Parked {
                            context_id: self.context_id,
                            configured,
                            pending,
                        },
                    )
                });
                retick(&self.vm);
                Action::Pause
            }
        }
    }

    fn dispatch(
        &mut self,
        configured: &Configured,
        callout: Callout,
        pending: Pending,
        paused: bool,
    ) -> Action {
        match host::dispatch(self.host, &callout) {
            Ok(_token) => {
                self.pending = Some(pending);
                Action::Pause
            }
            Err(reason) => {
                let decision = configured.engine.complete(
                    &HostSharedData,
                    pending,
                    Reply::NotSent(reason),
                    host::now(),
                    &mut Sink(&configured.metrics),
                );
                self.apply(configured, decision, paused)
            }
        }
    }

    fn forget_waiter(&mut self) {
        let answered = match self.parked {
            Some(_) => with_vm(&self.vm, |vm| vm.answers.remove(&self.context_id)).flatten(),
            None => None,
        };
        if let Some(until) = self
            .waiting_until
            .take()
            .or(answered.and_then(|answer| answer.waiting_until))
        {
            let abandoned = with_vm(&self.vm, |vm| vm.waiters.remove(&(until, self.context_id)));
            if abandoned == Some(true) {
                if let Some(configured) = &self.configured {
                    Sink(&configured.metrics).event(Event::DelayAbandoned);
                }
            }
        }
    }
}

impl Context for DianaHttp {
    fn on_http_call_response(
        &mut self,
        _token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let (Some(pending), Some(configured)) = (self.pending.take(), self.configured.clone())
        else {
            return;
        };
        let reply = host::callout_reply(num_headers, body_size, MAX_ANSWER_BYTES);
        let decision = configured.engine.complete(
            &HostSharedData,
            pending,
            reply,
            host::now(),
            &mut Sink(&configured.metrics),
        );
        let _ = self.apply(&configured, decision, true);
    }
}

/// A request that ends while it waits in the leaky bucket (its client went away) leaves
/// the queue here: the SDK drops the context on `proxy_on_delete`, the one end-of-request
/// callback the trimmed module keeps (see `crates/diana-trim`).
impl Drop for DianaHttp {
    fn drop(&mut self) {
        self.forget_waiter();
        // Gone while paused for its callout or parked behind another's: what it charged
        // goes back, and the requests parked behind its callout plan again.
        let parked = self
            .parked
            .and_then(|rider| with_vm(&self.vm, |vm| vm.parked.remove(&rider)).flatten());
        if let Some(parked) = parked {
            parked
                .configured
                .engine
                .abandon(&HostSharedData, parked.pending, host::now());
        }
        if let (Some(pending), Some(configured)) = (self.pending.take(), &self.configured) {
            configured
                .engine
                .abandon(&HostSharedData, pending, host::now());
        }
    }
}

impl HttpContext for DianaHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(configured) = self.configured.clone() else {
            return Action::Continue;
        };
        // Read only when a decision depends on it (a host call, and a copy into the VM).
        let read_path;
        let raw_path: &[u8] = if configured.engine.needs_path() || configured.serves_metrics {
            read_path =
                host::header_bytes(MapType::HttpRequestHeaders, ":path").unwrap_or_default();
            &read_path
        } else {
            b"/"
        };
        if configured.serves_metrics && configured.engine.serves_metrics(raw_path) {
            let text = configured.metrics.exposition();
            if let Err(status) = hostcalls::send_http_response(
                200,
                vec![("content-type", "text/plain; version=0.0.4")],
                Some(text.as_bytes()),
            ) {
                log::warn!("diana: cannot answer with the metrics: {status:?}");
            }
            return Action::Pause;
        }
        let decision = configured.engine.evaluate(
            &HostSharedData,
            raw_path,
            &HostRequest,
            host::HostClock,
            &mut Sink(&configured.metrics),
        );
        if configured.engine.wants_refill() {
            retick(&self.vm);
        }
        self.apply(&configured, decision, false)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.parked.is_some() {
            if let Some(answer) =
                with_vm(&self.vm, |vm| vm.answers.remove(&self.context_id)).flatten()
            {
                self.response_headers = answer.headers;
                self.after = answer.after;
            }
        }
        if let (Some(after), Some(configured)) = (self.after.take(), self.configured.as_ref()) {
            let values: Vec<Option<Vec<u8>>> = after
                .headers()
                .map(|name| host::header_bytes(MapType::HttpResponseHeaders, name))
                .collect();
            configured.engine.after_response(
                &HostSharedData,
                after,
                &values,
                host::now(),
                &mut Sink(&configured.metrics),
            );
        }
        for (name, value) in self.response_headers.drain(..) {
            if let Err(status) =
                hostcalls::add_map_value(MapType::HttpResponseHeaders, name, &value)
            {
                log::debug!("diana: cannot add {name}: {status:?}");
            }
        }
        Action::Continue
    }
}
