//! The proxy-wasm contexts. The root context owns the configuration and the tick that
//! resumes requests waiting for their leaky-bucket turn; each HTTP context evaluates its
//! request once and applies the [`Decision`]. Borrows of per-VM state are short and never
//! held across a hostcall: a local reply re-enters the filter synchronously on Envoy.

use crate::host::{self, HostKind, HostMetrics, HostRequest, HostSharedData, Sink};
use diana_core::config::{parse_policy, MetricsSpec, Policy, RemoteSpec};
use diana_core::decision::{AfterResponse, Callout, Decision, Reply};
use diana_core::engine::{Engine, EngineDecision, Pending};
use diana_core::global::debts::Debt;
use diana_core::global::MAX_ANSWER_BYTES;
use diana_core::lifecycle;
use diana_core::metrics::{Event, MetricSink};
use diana_core::remote::{self, PollOutcome};
use diana_core::store::Store;
use diana_core::time::{Nanos, NANOS_PER_SECOND};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType};
use std::cell::RefCell;
use std::collections::BTreeSet;
use std::rc::Rc;
use std::time::Duration;

/// How often the root context looks for waiting requests whose turn has come.
const WAIT_TICK: Duration = Duration::from_millis(2);

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

/// Per-VM state shared by the root context and the HTTP contexts of one worker.
#[derive(Default)]
struct Vm {
    configured: Option<Rc<Configured>>,
    /// Requests paused until their turn: (resume at, context id).
    waiters: BTreeSet<(Nanos, u32)>,
    /// The tick period when nobody waits (remote checks), zero for none.
    base_tick: Duration,
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

pub struct DianaRoot {
    vm: VmRef,
    /// Counters for configuration events, defined before any policy exists.
    events: Rc<HostMetrics>,
    host: HostKind,
    /// On hosts where the tick period may be set only once: whether it was.
    tick_fixed: bool,
    /// The config center, from the local document (a remote document cannot move it).
    remote: Option<RemoteSpec>,
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
}

impl DianaRoot {
    pub fn new(_context_id: u32) -> DianaRoot {
        DianaRoot {
            vm: Rc::new(RefCell::new(Vm::default())),
            events: Rc::new(HostMetrics::events_only()),
            host: HostKind::Envoy,
            tick_fixed: false,
            remote: None,
            metrics: None,
            applied_version: 0,
            poll_token: None,
            payment: None,
            next_remote_check: 0,
            store: Store::new(),
        }
    }

    /// Makes `policy` the one new requests are evaluated with.
    fn install(&mut self, mut policy: Policy, origin: &str) {
        policy.metrics = self.metrics.clone();
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
        match parse_policy(&published.text) {
            Ok(policy) => self.install(policy, &format!("remote (version {})", published.version)),
            Err(error) => log::error!("diana: published remote document refused: {error}"),
        }
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
        let etag = remote::read_published(&self.store, &HostSharedData).and_then(|p| p.etag);
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
        let (status, etag) = if num_headers == 0 {
            (0, None)
        } else {
            let status = host::callout_status();
            let etag = host::header_bytes(MapType::HttpCallResponseHeaders, "etag")
                .and_then(|e| String::from_utf8(e).ok());
            (status, etag)
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
        match remote::interpret(status, etag, &body, published.as_ref()) {
            PollOutcome::Unchanged => self.record_poll(Ok(())),
            PollOutcome::Rejected(reason) => {
                Sink(&self.events).event(Event::ConfigRejected);
                if remote::first_rejection(&self.store, &HostSharedData, &body) {
                    log::error!("diana: {reason}; keeping the current configuration");
                }
                self.record_poll(Err(reason));
            }
            PollOutcome::Failed(reason) => self.record_poll(Err(reason)),
            PollOutcome::New { policy, text, etag } => {
                self.record_poll(Ok(()));
                match remote::publish(&self.store, &HostSharedData, &text, etag) {
                    Some(version) => {
                        self.applied_version = version;
                        self.install(*policy, &format!("remote (version {version})"));
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

    /// The tick period when nobody waits: config-center checks, and releasing the records
    /// of rules an earlier document had.
    fn base_tick(&self) -> Duration {
        // Response costs to send, idle workers' batches to give back.
        let owes = with_vm(&self.vm, |vm| {
            vm.configured.as_ref().is_some_and(|configured| {
                configured.engine.lends()
                    || configured
                        .engine
                        .rules()
                        .any(|rule| rule.response_cost.is_some())
            })
        }) == Some(true);
        if self.remote.is_some() || owes || lifecycle::has_work(&self.store, &HostSharedData) {
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
        if self.poll_token == Some(token_id) {
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
                return false;
            }
        };
        self.host = host::detect();
        if self.host == HostKind::Nginx {
            self.store = Store::strict();
            log::info!("diana: ngx_wasm_module: leaky-bucket waits become Retry-After (local) or are done by the quota service (global)");
        }
        self.remote = policy.remote.clone();
        self.metrics = policy.metrics.clone();
        self.applied_version = 0;
        self.install(policy, "local");
        let base_tick = self.base_tick();
        match self.host {
            HostKind::Envoy => {
                let idle = with_vm(&self.vm, |vm| {
                    vm.base_tick = base_tick;
                    vm.waiters.is_empty()
                });
                if idle == Some(true) {
                    set_tick(base_tick);
                }
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
        let (due, rest_tick) = with_vm(&self.vm, |vm| {
            let mut due = Vec::new();
            while let Some(&(until, id)) = vm.waiters.first() {
                if until > now {
                    break;
                }
                vm.waiters.pop_first();
                due.push(id);
            }
            (due, vm.waiters.is_empty().then_some(vm.base_tick))
        })
        .unwrap_or_default();
        if self.host.can_pause() {
            for context_id in due {
                resume(context_id);
            }
            if let Some(base_tick) = rest_tick {
                set_tick(base_tick);
            }
        }
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
        }
        if lifecycle::has_work(&self.store, &HostSharedData) {
            lifecycle::sweep(&self.store, &HostSharedData);
        }
        if self.host == HostKind::Envoy {
            // The tick stops when nothing needs it any more (the records are released).
            let base_tick = self.base_tick();
            with_vm(&self.vm, |vm| vm.base_tick = base_tick);
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
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Resumes a paused request from the root context.
fn resume(context_id: u32) {
    if let Err(status) = hostcalls::set_effective_context(context_id) {
        log::debug!("diana: request {context_id} is gone: {status:?}");
        return;
    }
    if let Err(status) = hostcalls::resume_http_request() {
        log::debug!("diana: cannot resume request {context_id}: {status:?}");
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
                let first = with_vm(&self.vm, |vm| {
                    vm.waiters.insert((until, self.context_id));
                    vm.waiters.len() == 1
                });
                // Only Envoy pauses (HostKind::can_pause); nginx traps on a tick period set
                // outside the root context.
                if first == Some(true) && self.host.can_pause() {
                    set_tick(WAIT_TICK);
                }
                Action::Pause
            }
            Decision::Reject(rejection) => {
                let headers: Vec<(&str, &str)> = rejection
                    .headers
                    .iter()
                    .map(|(name, value)| (*name, value.as_str()))
                    .collect();
                // ngx_wasm_module appends a line feed to every local response body:
                // send one less so that the client gets the configured body.
                let body = match self.host {
                    HostKind::Nginx => rejection.body.strip_suffix('\n').unwrap_or(&rejection.body),
                    HostKind::Envoy => &rejection.body,
                };
                if let Err(status) = hostcalls::send_http_response(
                    u32::from(rejection.status),
                    headers,
                    Some(body.as_bytes()),
                ) {
                    log::warn!("diana: cannot send the rejection: {status:?}");
                }
                Action::Pause
            }
            Decision::Call(callout, pending) => self.dispatch(configured, callout, pending, paused),
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
        if let Some(until) = self.waiting_until.take() {
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
    }
}

impl HttpContext for DianaHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(configured) = self.configured.clone() else {
            return Action::Continue;
        };
        let raw_path = if configured.engine.needs_path() || configured.serves_metrics {
            host::header_bytes(MapType::HttpRequestHeaders, ":path").unwrap_or_default()
        } else {
            b"/".to_vec()
        };
        if configured.serves_metrics && configured.engine.serves_metrics(&raw_path) {
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
            &raw_path,
            &HostRequest,
            host::HostClock,
            &mut Sink(&configured.metrics),
        );
        self.apply(&configured, decision, false)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
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
