//! Hooks to worker events, worker commands to callbacks.
//!
//! Envoy runs a stream's hooks on one worker thread. Each worker thread keeps, per filter
//! configuration, one [`Worker`] (as each proxy-wasm VM keeps one): configured from the
//! filter's string on the thread's first request, sharing counters with the other threads
//! through process memory (`host::store`). A stream is a context id of that worker.
//!
//! The worker is borrowed only while it handles an event, never while a command is carried
//! out: `continue_decoding` and `send_response` may run the rest of the stream, and so our
//! own hooks, before they return.
//!
//! - A paused request gets a scheduler: commands for it from another context (its turn
//!   came in the tick, another request's call landed) are queued on it and carried out in
//!   its own `on_http_filter_scheduled`.
//! - Calls are Envoy callouts of the stream that is current when the worker makes them: a
//!   request's own call from its own stream, the tick's calls (refills, releases, debts,
//!   polls) from the stream that runs the tick. Envoy cancels a stream's callouts when it
//!   ends, so a stream carrying calls holds its response headers until they are answered
//!   (one quota-service round trip at most, within the call's timeout); one whose client
//!   leaves reports them unanswered.

use crate::ffi::{ConfigRef, FilterRef, Scheduler, CONTINUE, STOP_ALL_AND_WATERMARK};
pub use crate::host::Answer;
use crate::host::{self, Metrics, NativeHost};
use crate::timer;
use diana_core::worker::{
    CallToken, Command, ContextId, Host, HostProfile, LocalReply, Step, Worker,
};
use hashbrown::{HashMap, HashSet};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The scheduled event that carries out the commands queued for a paused request.
const DEFERRED_EVENT: u64 = 2;

/// One filter configuration (the Diana document), shared by the worker threads.
pub struct Config {
    id: u64,
    envoy: ConfigRef,
    document: Vec<u8>,
    metrics: Metrics,
    alive: AtomicBool,
}

/// Validates the document as every worker will (a refused one fails Envoy's configuration,
/// as the wasm filter's does) and defines its metrics, on the main thread.
pub fn config_new(envoy: ConfigRef, document: &[u8]) -> Option<Arc<Config>> {
    static IDS: AtomicU64 = AtomicU64::new(1);
    let config = Config {
        id: IDS.fetch_add(1, Ordering::Relaxed),
        envoy,
        document: document.to_vec(),
        metrics: Metrics::default(),
        alive: AtomicBool::new(true),
    };
    let next_token = Cell::new(0);
    let probe = NativeHost {
        config: envoy,
        metrics: &config.metrics,
        filter: None,
        answer: None,
        dispatched: RefCell::new(Vec::new()),
        next_token: &next_token,
    };
    let mut worker = Worker::new(HostProfile::ENVOY_NATIVE);
    let accepted = worker.configure(&probe, document);
    config.metrics.freeze();
    match accepted {
        Ok(_) => Some(Arc::new(config)),
        // The worker has logged why (the field, its line and column).
        Err(_) => None,
    }
}

pub fn config_destroy(config: &Config) {
    config.alive.store(false, Ordering::Release);
}

/// A stream's module object: its context in this thread's worker.
pub struct FilterBox {
    context: ContextId,
    local: Rc<Local>,
}

/// Commands for a paused request, carried out in its own scheduled event.
enum Deferred {
    Resume,
    Reply(LocalReply),
}

/// A stream this thread's worker knows.
struct Entry {
    filter: FilterRef,
    scheduler: Option<Scheduler>,
    pending: Vec<Deferred>,
    /// Callouts in flight from this stream: Envoy's id and the worker's token.
    callouts: Vec<(u64, CallToken)>,
    /// Its response headers wait for its callouts.
    held: bool,
}

/// One configuration's worker on one Envoy worker thread.
struct Local {
    config: Arc<Config>,
    thread: u64,
    worker: RefCell<Option<Worker>>,
    filters: RefCell<HashMap<ContextId, Entry>>,
    /// Streams paused by the worker (tick targets; they have a scheduler).
    paused: RefCell<HashSet<ContextId>>,
    next_context: Cell<ContextId>,
    next_token: Cell<CallToken>,
    /// The tick period the worker asked for (zero: none).
    tick: Cell<Duration>,
    /// When the next tick is due.
    due: Cell<Option<u64>>,
    /// What the timer thread was last told.
    armed: Cell<Option<(Scheduler, u64)>>,
}

thread_local! {
    static THREAD: RefCell<HashMap<u64, Rc<Local>>> = RefCell::new(HashMap::new());
    static THREAD_KEY: u64 = {
        static KEYS: AtomicU64 = AtomicU64::new(1);
        KEYS.fetch_add(1, Ordering::Relaxed)
    };
}

fn local_for(config: &Arc<Config>) -> Option<Rc<Local>> {
    let thread = THREAD_KEY.with(|key| *key);
    THREAD.with(|locals| {
        let mut locals = locals.try_borrow_mut().ok()?;
        // Workers of configurations Envoy has replaced go once their streams are gone.
        locals.retain(|_, local| {
            local.config.alive.load(Ordering::Acquire) || Rc::strong_count(local) > 1
        });
        let local = locals.entry(config.id).or_insert_with(|| {
            Rc::new(Local {
                config: Arc::clone(config),
                thread,
                worker: RefCell::new(None),
                filters: RefCell::new(HashMap::new()),
                paused: RefCell::new(HashSet::new()),
                next_context: Cell::new(0),
                next_token: Cell::new(0),
                tick: Cell::new(Duration::ZERO),
                due: Cell::new(None),
                armed: Cell::new(None),
            })
        });
        Some(Rc::clone(local))
    })
}

pub fn filter_new(config: &Arc<Config>, filter: FilterRef) -> Option<FilterBox> {
    let local = local_for(config)?;
    let context = local.next_context.get().wrapping_add(1).max(1);
    local.next_context.set(context);
    local.filters.try_borrow_mut().ok()?.insert(
        context,
        Entry {
            filter,
            scheduler: None,
            pending: Vec::new(),
            callouts: Vec::new(),
            held: false,
        },
    );
    Some(FilterBox { context, local })
}

pub fn request_headers(filter: &FilterBox, envoy: FilterRef) -> i32 {
    let local = &filter.local;
    let current = Some((filter.context, envoy));
    local.ensure_worker(envoy);
    let context = filter.context;
    let step = local.event(current, None, |worker, host| {
        worker.on_request_headers(host, context)
    });
    let replied = step
        .commands
        .iter()
        .any(|command| matches!(command, Command::Reply(c, _) if *c == context));
    if step.pause && !replied {
        local.pause(context);
    }
    local.carry_out(current, step.commands);
    // A tick that came due while no paused request could carry it runs here, on a request
    // going on upstream: its response comes back through this filter, which holds it for
    // the tick's calls (a rejected request's stream ends at once, cancelling them).
    if !step.pause {
        if let (Some(due), Some(now)) = (local.due.get(), host::now()) {
            if now >= due {
                local.run_tick(context, envoy);
            }
        }
    }
    local.rearm();
    if step.pause {
        STOP_ALL_AND_WATERMARK
    } else {
        CONTINUE
    }
}

pub fn response_headers(filter: &FilterBox, envoy: FilterRef) -> i32 {
    let local = &filter.local;
    let context = filter.context;
    let current = Some((context, envoy));
    let step = local.event(current, None, |worker, host| {
        worker.on_response_headers(host, context)
    });
    local.carry_out(current, step.commands);
    let hold = local
        .filters
        .try_borrow_mut()
        .ok()
        .and_then(|mut filters| {
            let entry = filters.get_mut(&context)?;
            entry.held = !entry.callouts.is_empty();
            Some(entry.held)
        })
        .unwrap_or(false);
    if hold {
        STOP_ALL_AND_WATERMARK
    } else {
        CONTINUE
    }
}

pub fn callout_done(filter: &FilterBox, envoy: FilterRef, callout_id: u64, answer: &Answer<'_>) {
    let local = &filter.local;
    let context = filter.context;
    let token = local.filters.try_borrow_mut().ok().and_then(|mut filters| {
        let entry = filters.get_mut(&context)?;
        let at = entry
            .callouts
            .iter()
            .position(|(id, _)| *id == callout_id)?;
        Some(entry.callouts.swap_remove(at).1)
    });
    let Some(token) = token else {
        return;
    };
    let headers = if answer.answered {
        answer.headers.len()
    } else {
        0
    };
    let body = answer.body_size();
    let current = Some((context, envoy));
    let step = local.event(current, Some(answer), |worker, host| {
        worker.on_call_answered(host, token, headers, body)
    });
    local.carry_out(current, step.commands);
    // A response held for this stream's callouts goes on once none is left.
    let release = local
        .filters
        .try_borrow_mut()
        .ok()
        .and_then(|mut filters| {
            let entry = filters.get_mut(&context)?;
            let release = entry.held && entry.callouts.is_empty();
            if release {
                entry.held = false;
            }
            Some(release)
        })
        .unwrap_or(false);
    local.rearm();
    if release {
        envoy.continue_encoding();
    }
}

pub fn scheduled(filter: &FilterBox, envoy: FilterRef, event: u64) {
    let local = &filter.local;
    let context = filter.context;
    match event {
        timer::TICK_EVENT => {
            local.armed.set(None);
            local.run_tick(context, envoy);
            local.rearm();
        }
        DEFERRED_EVENT => {
            let pending = local
                .filters
                .try_borrow_mut()
                .ok()
                .and_then(|mut filters| {
                    filters
                        .get_mut(&context)
                        .map(|entry| std::mem::take(&mut entry.pending))
                })
                .unwrap_or_default();
            for deferred in pending {
                local.unpause(context);
                match deferred {
                    Deferred::Resume => envoy.continue_decoding(),
                    Deferred::Reply(reply) => send(envoy, &reply),
                }
            }
            local.rearm();
        }
        _ => {}
    }
}

pub fn destroy(filter: FilterBox) {
    let local = &filter.local;
    let context = filter.context;
    local.unpause(context);
    let entry = local
        .filters
        .try_borrow_mut()
        .ok()
        .and_then(|mut filters| filters.remove(&context));
    if let Some(scheduler) = entry.as_ref().and_then(|entry| entry.scheduler) {
        if local
            .armed
            .get()
            .is_some_and(|(armed, _)| armed == scheduler)
        {
            timer::disarm(local.thread);
            local.armed.set(None);
        }
        scheduler.delete();
    }
    let step = local.event(None, None, |worker, host| {
        worker.on_context_gone(host, context)
    });
    local.carry_out(None, step.commands);
    // Calls this stream carried for the worker are cancelled with it: unanswered.
    for (_, token) in entry.map(|entry| entry.callouts).unwrap_or_default() {
        let step = local.event(None, None, |worker, host| {
            worker.on_call_answered(host, token, 0, 0)
        });
        local.carry_out(None, step.commands);
    }
    let idle = local
        .filters
        .try_borrow()
        .map(|filters| filters.is_empty())
        .unwrap_or(false);
    if idle {
        // Nothing may run on this thread for a while: its counts go to Envoy's stats now.
        local.event(None, None, |worker, host| {
            worker.flush_metrics(host);
            Step::default()
        });
    }
    local.rearm();
}

fn send(envoy: FilterRef, reply: &LocalReply) {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(name, value)| (*name, value.as_str()))
        .collect();
    envoy.send_response(reply.status, &headers, reply.body.as_bytes());
}

impl Local {
    /// Configures this thread's worker with the filter's document, once.
    fn ensure_worker(&self, envoy: FilterRef) {
        let Ok(mut worker) = self.worker.try_borrow_mut() else {
            return;
        };
        if worker.is_some() {
            return;
        }
        let mut fresh = Worker::new(HostProfile::ENVOY_NATIVE);
        let host = self.host(Some(envoy), None);
        match fresh.configure(&host, &self.config.document) {
            Ok(step) => {
                *worker = Some(fresh);
                drop(worker);
                for command in step.commands {
                    if let Command::SetTick(period) = command {
                        self.set_tick(period);
                    }
                }
            }
            // Validated on the main thread already: not expected.
            Err(refused) => log::error!("diana: configuration refused on a worker: {refused:?}"),
        }
    }

    fn host<'a>(
        &'a self,
        filter: Option<FilterRef>,
        answer: Option<&'a Answer<'a>>,
    ) -> NativeHost<'a> {
        NativeHost {
            config: self.config.envoy,
            metrics: &self.config.metrics,
            filter,
            answer,
            dispatched: RefCell::new(Vec::new()),
            next_token: &self.next_token,
        }
    }

    /// Runs one worker event with `current` as the current stream; the calls it dispatched
    /// are filed under that stream.
    fn event(
        &self,
        current: Option<(ContextId, FilterRef)>,
        answer: Option<&Answer<'_>>,
        event: impl FnOnce(&mut Worker, &dyn Host) -> Step,
    ) -> Step {
        let host = self.host(current.map(|(_, envoy)| envoy), answer);
        let step = match self.worker.try_borrow_mut() {
            Ok(mut worker) => match worker.as_mut() {
                Some(worker) => event(worker, &host),
                None => Step::default(),
            },
            Err(_) => {
                log::error!("diana: worker busy; event skipped");
                Step::default()
            }
        };
        let dispatched = host.dispatched.into_inner();
        if let (Some((context, _)), false) = (current, dispatched.is_empty()) {
            if let Ok(mut filters) = self.filters.try_borrow_mut() {
                if let Some(entry) = filters.get_mut(&context) {
                    entry.callouts.extend(dispatched);
                }
            }
        }
        step
    }

    fn run_tick(&self, context: ContextId, envoy: FilterRef) {
        self.due.set(None);
        let current = Some((context, envoy));
        let step = self.event(current, None, |worker, host| worker.on_tick(host));
        if self.due.get().is_none() {
            self.schedule_next();
        }
        self.carry_out(current, step.commands);
    }

    fn set_tick(&self, period: Duration) {
        self.tick.set(period);
        self.schedule_next();
    }

    fn schedule_next(&self) {
        let period = self.tick.get();
        let due = if period.is_zero() {
            None
        } else {
            host::now()
                .map(|now| now.saturating_add(u64::try_from(period.as_nanos()).unwrap_or(u64::MAX)))
        };
        self.due.set(due);
    }

    fn pause(&self, context: ContextId) {
        if let Ok(mut filters) = self.filters.try_borrow_mut() {
            if let Some(entry) = filters.get_mut(&context) {
                if entry.scheduler.is_none() {
                    entry.scheduler = entry.filter.scheduler();
                }
                if entry.scheduler.is_some() {
                    if let Ok(mut paused) = self.paused.try_borrow_mut() {
                        paused.insert(context);
                    }
                }
            }
        }
    }

    fn unpause(&self, context: ContextId) {
        if let Ok(mut paused) = self.paused.try_borrow_mut() {
            paused.remove(&context);
        }
    }

    /// Tells the timer thread which paused stream carries this thread's next tick, and
    /// when (none paused: the next request runs it when due).
    fn rearm(&self) {
        let target = self.due.get().and_then(|due| {
            let paused = self.paused.try_borrow().ok()?;
            if paused.is_empty() {
                return None;
            }
            let filters = self.filters.try_borrow().ok()?;
            let armed = self.armed.get().map(|(scheduler, _)| scheduler);
            let schedulers = paused
                .iter()
                .filter_map(|context| filters.get(context)?.scheduler);
            let mut chosen = None;
            for scheduler in schedulers {
                if Some(scheduler) == armed {
                    chosen = Some(scheduler);
                    break;
                }
                chosen = chosen.or(Some(scheduler));
            }
            chosen.map(|scheduler| (scheduler, due))
        });
        if target == self.armed.get() {
            return;
        }
        match target {
            Some((scheduler, due)) => {
                let after = host::now()
                    .map(|now| Duration::from_nanos(due.saturating_sub(now)))
                    .unwrap_or(Duration::ZERO);
                timer::arm(self.thread, scheduler, after);
            }
            None => timer::disarm(self.thread),
        }
        self.armed.set(target);
    }

    /// Carries out `commands`: those for the current stream now, those for another paused
    /// stream in its own scheduled event.
    fn carry_out(&self, current: Option<(ContextId, FilterRef)>, commands: Vec<Command>) {
        let this = current.map(|(context, _)| context);
        for command in commands {
            match command {
                Command::Resume(context) if Some(context) == this => {
                    self.unpause(context);
                    if let Some((_, envoy)) = current {
                        envoy.continue_decoding();
                    }
                }
                Command::Reply(context, reply) if Some(context) == this => {
                    self.unpause(context);
                    if let Some((_, envoy)) = current {
                        send(envoy, &reply);
                    }
                }
                Command::Resume(context) => self.defer(context, Deferred::Resume),
                Command::Reply(context, reply) => self.defer(context, Deferred::Reply(reply)),
                Command::AddHeaders(headers) => {
                    if let Some((_, envoy)) = current {
                        for (name, value) in headers {
                            if !envoy.add_response_header(name, &value) {
                                log::debug!("diana: cannot add {name}");
                            }
                        }
                    }
                }
                Command::SetTick(period) => self.set_tick(period),
            }
        }
    }

    fn defer(&self, context: ContextId, deferred: Deferred) {
        let scheduler = self.filters.try_borrow_mut().ok().and_then(|mut filters| {
            let entry = filters.get_mut(&context)?;
            if entry.scheduler.is_none() {
                entry.scheduler = entry.filter.scheduler();
            }
            entry.pending.push(deferred);
            entry.scheduler
        });
        match scheduler {
            Some(scheduler) => scheduler.commit(DEFERRED_EVENT),
            None => log::debug!("diana: request {context} is gone"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn abi_version_is_a_c_string() {
        assert_eq!(crate::ffi::ABI_VERSION, b"v0.2.0\0");
    }

    #[test]
    fn callout_failures_are_named() {
        assert_eq!(crate::ffi::callout_init_name(2), "ClusterNotFound");
        assert_eq!(crate::ffi::callout_init_name(9), "Unknown");
    }
}
