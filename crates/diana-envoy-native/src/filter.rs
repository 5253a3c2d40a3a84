//! Hooks to worker events, worker commands to Envoy's handles (`crate::envoy`: the ABI's in
//! `ffi`, the fake Envoy's in the tests).
//!
//! Each filter configuration (the Diana document) keeps its [`Worker`]s in slots, made and
//! configured on the main thread in `on_http_filter_config_new`, as each proxy-wasm VM
//! keeps one: one per Envoy worker thread (`--concurrency`; a thread's first stream claims
//! one for good) and the main thread's, which only ticks. They share counters through
//! the process's shared data, handed to [`config_new`]. A stream is a context id of its
//! thread's worker.
//!
//! A worker is reached only under its slot's mutex, from two threads: its Envoy worker
//! thread (the requests' events) and the main thread (its tick, and the answers to the
//! tick's calls). So the tick runs on an idle gateway, and no request stream carries the
//! tick's calls:
//!
//! - **Tick.** The timer thread (`timer.rs`) posts the configuration's tick event to the
//!   main thread when the earliest worker tick is due; the main thread runs each due
//!   worker's tick there and arms the next. A tick wanted at once (a refill ahead) is
//!   committed by the hook that wants it, on its own thread.
//! - **Calls** of a worker-thread event (a request's own call) are callouts of that
//!   request's stream; their answers come back on it. Calls of a main-thread event (lease
//!   refills, releases, response costs, config-center polls, and the calls of requests
//!   resumed from there) are callouts of the filter configuration, bound to no stream,
//!   answered on the main thread.
//! - **Other streams.** A paused request gets a scheduler, registered in its worker's table
//!   under the lock of the event that paused it; commands for it from another event (its
//!   turn came in the tick, another call landed) are queued there and carried out in its
//!   own `on_http_filter_scheduled` on its thread.
//!
//! The lock is held only while the worker handles one event and its commands are sorted,
//! never while a command is carried out: `continue_decoding` and `send_response` may run
//! the rest of the stream, and so our own hooks, before they return. What the main thread
//! does under it is in-memory work and starting callouts (a config-center document is
//! parsed there too), so a worker thread waits for it at most that long. A local reply may
//! end its stream at once, running the stream's [`destroy`] inside the hook that sent it:
//! the hook still holds the stream's module object (`ffi` lends each hook its own
//! reference), and carries out nothing more once the stream is gone.

use crate::envoy::{
    CalloutId, ConfigScheduler, EnvoyConfig, EnvoyFilter, HeadersStatus, RawAnswer, StreamScheduler,
};
use crate::host::{self, Metrics, NativeHost};
use crate::shared::SharedStore;
use crate::timer;
use diana_core::decision::HeaderEdit;
use diana_core::time::{Instant, Nanos};
use diana_core::worker::{
    Answer, CallToken, Command, ContextId, Host, HostProfile, LocalReply, Step, Worker,
};
use hashbrown::HashMap;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The scheduled event that carries out the commands queued for a paused request.
pub const DEFERRED_EVENT: u64 = 2;

/// One filter configuration (the Diana document), shared by the threads.
pub struct Config {
    id: u64,
    envoy: Box<dyn EnvoyConfig>,
    /// The process's shared data.
    store: &'static SharedStore,
    document: Vec<u8>,
    metrics: Metrics,
    alive: AtomicBool,
    /// Its scheduler, which the timer thread also keeps: a hook that wants the tick at
    /// once commits to it directly. Let go of in `config_destroy` (with the timer's, that
    /// deletes it), as no hook of the configuration runs any more.
    scheduler: Mutex<Option<Arc<dyn ConfigScheduler>>>,
    /// The workers: one per Envoy worker thread, then the main thread's.
    slots: Mutex<Vec<Arc<Slot>>>,
    /// Calls the main thread made for a worker: Envoy's callout id, the worker, its token.
    calls: Mutex<HashMap<CalloutId, (Arc<Slot>, CallToken)>>,
}

/// One worker and what the threads that reach it share.
pub struct Slot {
    /// A worker thread took it (the main thread's is taken from the start).
    claimed: AtomicBool,
    core: Mutex<Core>,
}

struct Core {
    worker: Worker,
    /// Paused streams: their scheduler and the commands queued for them.
    paused: HashMap<ContextId, Paused>,
    next_token: CallToken,
    /// The tick period the worker asked for (zero: none).
    tick: Duration,
    /// When its next tick is due (wall clock, ns).
    due: Option<Instant>,
    /// Stream events run under the lock (tests: which events take it).
    #[cfg(test)]
    stream_events: usize,
}

struct Paused {
    /// Dropped (so deleted) with the entry, under the lock it is committed under.
    scheduler: Box<dyn StreamScheduler>,
    pending: Vec<Deferred>,
}

/// Commands for a paused request, carried out in its own scheduled event.
enum Deferred {
    Resume,
    Reply(LocalReply),
    Edit(Vec<HeaderEdit>),
}

/// Where a worker event runs, and so where its calls go.
#[derive(Clone, Copy)]
enum Site<'a> {
    /// The main thread: calls are the configuration's callouts.
    Main,
    /// A stream's worker thread, with the stream current (its calls are its callouts) or
    /// none (it is being destroyed: no calls).
    Stream(Option<(ContextId, &'a dyn EnvoyFilter)>),
}

impl<'a> Site<'a> {
    fn current(self) -> Option<(ContextId, &'a dyn EnvoyFilter)> {
        match self {
            Site::Main => None,
            Site::Stream(current) => current,
        }
    }
}

/// What one event left for the caller, once the lock is released.
struct Outcome {
    pause: bool,
    /// Commands for the current stream, in order.
    commands: Vec<Command>,
    /// Calls made: Envoy's callout id and the worker's token.
    dispatched: Vec<(CalloutId, CallToken)>,
    /// The worker's next tick moved to this (wall clock, ns).
    rearm: Option<Instant>,
}

thread_local! {
    /// This thread's slot of each configuration, and its streams.
    static THREAD: RefCell<HashMap<u64, Rc<Local>>> = RefCell::new(HashMap::new());
    /// This thread holds a worker's lock: a hook re-entered from a callback made under it
    /// skips its event rather than deadlock.
    static HOLDING: Cell<bool> = const { Cell::new(false) };
}

/// Validates the document as every worker will (a refused one fails Envoy's configuration,
/// as the wasm filter's does), defines its metrics and makes its workers, on the main
/// thread. `store`: the process's shared data.
pub fn config_new(
    envoy: Box<dyn EnvoyConfig>,
    store: &'static SharedStore,
    document: &[u8],
) -> Option<Arc<Config>> {
    static IDS: AtomicU64 = AtomicU64::new(1);
    let config = Config {
        id: IDS.fetch_add(1, Ordering::Relaxed),
        envoy,
        store,
        document: document.to_vec(),
        metrics: Metrics::default(),
        alive: AtomicBool::new(true),
        scheduler: Mutex::new(None),
        slots: Mutex::new(Vec::new()),
        calls: Mutex::new(HashMap::new()),
    };
    // The main thread's worker first: it says whether the document is accepted.
    let main = Slot::configured(&config, true)?;
    let mut slots = Vec::new();
    for _ in 0..config.envoy.concurrency() {
        slots.extend(Slot::configured(&config, false));
    }
    slots.push(main);
    config.metrics.freeze();
    let earliest = slots.iter().filter_map(|slot| slot.due()).min();
    *lock(&config.slots) = slots;
    match config.envoy.new_scheduler() {
        Some(scheduler) => {
            let scheduler: Arc<dyn ConfigScheduler> = Arc::from(scheduler);
            if timer::register(config.id, Arc::clone(&scheduler)) {
                *lock(&config.scheduler) = Some(scheduler);
            }
        }
        None => log::error!("diana: Envoy gave no configuration scheduler: no tick runs"),
    }
    if let Some(due) = earliest {
        config.arm_tick(due);
    }
    Some(Arc::new(config))
}

/// Envoy destroys the configuration once no filter holds it: no stream is left, and the
/// configuration's callouts still in flight are cancelled without an answer.
pub fn config_destroy(config: &Config) {
    // No hook of this configuration runs any more (each holds it), so none commits to its
    // scheduler; the timer thread lets go of it under its lock, and with ours it is deleted.
    config.alive.store(false, Ordering::Release);
    drop(timer::remove(config.id));
    drop(lock(&config.scheduler).take());
    lock(&config.calls).clear();
}

/// The timer's event, on the main thread: every worker tick that is due runs.
pub fn config_scheduled(config: &Arc<Config>, event: u64) {
    if event != timer::TICK_EVENT {
        return;
    }
    let slots = lock(&config.slots).clone();
    let mut earliest: Option<Instant> = None;
    for slot in slots {
        let Some(now) = host::now() else {
            return;
        };
        if slot.due().is_some_and(|due| due <= now) {
            let outcome = slot.event(config, Site::Main, false, |worker, host| {
                worker.on_tick(host)
            });
            config.file_calls(&slot, outcome.dispatched);
        }
        if let Some(due) = slot.due() {
            earliest = Some(earliest.map_or(due, |earliest| earliest.min(due)));
        }
    }
    if let Some(due) = earliest {
        config.arm_tick(due);
    }
}

/// The answer to a call the main thread made, on the main thread.
pub fn config_callout_done(config: &Arc<Config>, callout_id: u64, answer: &RawAnswer<'_>) {
    let Some((slot, token)) = lock(&config.calls).remove(&callout_id) else {
        return;
    };
    let outcome = slot.event(config, Site::Main, true, |worker, host| {
        let answer = answer.read(worker.answer_shape(token));
        worker.on_call_answered(host, token, answer)
    });
    config.file_calls(&slot, outcome.dispatched);
    if let Some(due) = outcome.rearm {
        config.arm_tick(due);
    }
}

impl Config {
    /// Runs the workers' tick at `due` (wall clock, ns). One already due is committed at
    /// once, from this hook's thread and without the timer's lock: a worker asked for its
    /// tick now (a refill ahead waits in it), a detour through the timer thread would cost
    /// that thread's wake-up, and the main thread, woken by the commit, would block on the
    /// timer's lock if it were held across the commit (the worker thread, preempted inside
    /// it, holds it: measured, one extra main-thread wake-up per refill ahead).
    fn arm_tick(&self, due: Instant) {
        let after = until(due);
        if !after.is_zero() {
            timer::arm(self.id, after);
            return;
        }
        // Only a hook of this configuration gets here, and Envoy runs none after
        // `config_destroy` (which lets the scheduler go).
        if let Some(scheduler) = lock(&self.scheduler).as_ref() {
            scheduler.commit(timer::TICK_EVENT);
        }
    }

    /// Files the calls a main-thread event made under their callout ids.
    fn file_calls(&self, slot: &Arc<Slot>, dispatched: Vec<(CalloutId, CallToken)>) {
        if dispatched.is_empty() {
            return;
        }
        let mut calls = lock(&self.calls);
        for (id, token) in dispatched {
            calls.insert(id, (Arc::clone(slot), token));
        }
    }

    /// A slot for a worker thread: one made for it, or a new one if Envoy runs more
    /// threads than it said.
    fn claim(&self) -> Option<Arc<Slot>> {
        let mut slots = lock(&self.slots);
        if let Some(slot) = slots
            .iter()
            .find(|slot| !slot.claimed.swap(true, Ordering::AcqRel))
        {
            return Some(Arc::clone(slot));
        }
        let slot = Slot::configured(self, false)?;
        slot.claimed.store(true, Ordering::Release);
        slots.push(Arc::clone(&slot));
        drop(slots);
        if let Some(due) = slot.due() {
            self.arm_tick(due);
        }
        Some(slot)
    }
}

impl Slot {
    /// A worker configured with the document (`None`: refused; the worker logged why).
    fn configured(config: &Config, claimed: bool) -> Option<Arc<Slot>> {
        let next_token = Cell::new(0);
        let host = NativeHost {
            config: &*config.envoy,
            store: config.store,
            metrics: &config.metrics,
            filter: None,
            main: false,
            dispatched: RefCell::new(Vec::new()),
            next_token: &next_token,
        };
        let mut worker = Worker::new(HostProfile::ENVOY_NATIVE);
        let step = worker.configure(&host, &config.document).ok()?;
        let mut core = Core {
            worker,
            paused: HashMap::new(),
            next_token: next_token.get(),
            tick: Duration::ZERO,
            due: None,
            #[cfg(test)]
            stream_events: 0,
        };
        let mut rearm = None;
        core.settle(step.commands, None, &mut rearm);
        Some(Arc::new(Slot {
            claimed: AtomicBool::new(claimed),
            core: Mutex::new(core),
        }))
    }

    fn lock(&self) -> Option<Held<'_>> {
        if HOLDING.with(Cell::get) {
            log::error!("diana: worker busy (re-entered); event skipped");
            return None;
        }
        HOLDING.with(|holding| holding.set(true));
        Some(Held(lock(&self.core)))
    }

    fn due(&self) -> Option<Instant> {
        self.lock().and_then(|core| core.0.due)
    }

    /// Runs one worker event at `site`, under the lock: commands for other streams are
    /// queued on their schedulers and the tick period is taken there; a current stream the
    /// event pauses gets its scheduler before the lock is let go (so that no command for it
    /// from the main thread can come first).
    fn event(
        &self,
        config: &Config,
        site: Site<'_>,
        answering: bool,
        event: impl FnOnce(&mut Worker, &dyn Host) -> Step,
    ) -> Outcome {
        let current = site.current();
        let mut outcome = Outcome {
            pause: false,
            commands: Vec::new(),
            dispatched: Vec::new(),
            rearm: None,
        };
        let Some(mut held) = self.lock() else {
            return outcome;
        };
        let core = &mut held.0;
        #[cfg(test)]
        if matches!(site, Site::Stream(_)) {
            core.stream_events += 1;
        }
        let next_token = Cell::new(core.next_token);
        let host = NativeHost {
            config: &*config.envoy,
            store: config.store,
            metrics: &config.metrics,
            filter: current.map(|(_, envoy)| envoy),
            main: matches!(site, Site::Main),
            dispatched: RefCell::new(Vec::new()),
            next_token: &next_token,
        };
        let ticking = matches!(site, Site::Main) && !answering;
        if ticking {
            core.due = None;
        }
        let step = event(&mut core.worker, &host);
        core.next_token = next_token.get();
        outcome.dispatched = host.dispatched.into_inner();
        let context = current.map(|(context, _)| context);
        let replied = step
            .commands
            .iter()
            .any(|command| matches!(command, Command::Reply(c, _) if Some(*c) == context));
        if let (true, false, Some((context, envoy))) = (step.pause, replied, current) {
            if !core.paused.contains_key(&context) {
                match envoy.new_scheduler() {
                    Some(scheduler) => {
                        core.paused.insert(
                            context,
                            Paused {
                                scheduler,
                                pending: Vec::new(),
                            },
                        );
                    }
                    None => log::error!("diana: no scheduler for a paused request"),
                }
            }
        }
        outcome.pause = step.pause;
        outcome.commands = core.settle(step.commands, context, &mut outcome.rearm);
        if ticking && core.due.is_none() {
            core.schedule_next();
            outcome.rearm = core.due;
        }
        outcome
    }
}

/// A slot's lock, held by this thread.
struct Held<'a>(MutexGuard<'a, Core>);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        HOLDING.with(|holding| holding.set(false));
    }
}

impl Core {
    /// Takes the commands that are not the current stream's: other streams' are queued on
    /// their schedulers, the tick period is set (`rearm`: the new due time; now when the
    /// worker asked for the tick at once, whatever period it also set). Returns the
    /// current stream's, in order.
    fn settle(
        &mut self,
        commands: Vec<Command>,
        current: Option<ContextId>,
        rearm: &mut Option<Instant>,
    ) -> Vec<Command> {
        let mut mine = Vec::new();
        let mut tick_now = false;
        for command in commands {
            match command {
                Command::Resume(context) if Some(context) == current => {
                    mine.push(Command::Resume(context));
                }
                Command::Reply(context, reply) if Some(context) == current => {
                    mine.push(Command::Reply(context, reply));
                }
                Command::EditRequest(context, edits) if Some(context) == current => {
                    mine.push(Command::EditRequest(context, edits));
                }
                Command::EditRequest(context, edits) => self.defer(context, Deferred::Edit(edits)),
                Command::Resume(context) => self.defer(context, Deferred::Resume),
                Command::Reply(context, reply) => self.defer(context, Deferred::Reply(reply)),
                Command::AddHeaders(headers) => {
                    if current.is_some() {
                        mine.push(Command::AddHeaders(headers));
                    }
                }
                Command::SetTick(period) => {
                    self.tick = period;
                    self.schedule_next();
                    *rearm = self.due;
                }
                Command::TickNow => tick_now = true,
            }
        }
        if tick_now {
            self.due = host::now();
            *rearm = self.due;
        }
        mine
    }

    fn defer(&mut self, context: ContextId, deferred: Deferred) {
        match self.paused.get_mut(&context) {
            Some(paused) => {
                paused.pending.push(deferred);
                paused.scheduler.commit(DEFERRED_EVENT);
            }
            None => log::debug!("diana: request {context} is gone"),
        }
    }

    fn schedule_next(&mut self) {
        self.due = if self.tick.is_zero() {
            None
        } else {
            host::now().map(|now| now.saturating_add(Nanos::saturating_from_std(self.tick)))
        };
    }
}

/// From now until `due` (wall clock, ns).
fn until(due: Instant) -> Duration {
    host::now()
        .map(|now| Duration::from_nanos(due.saturating_since(now).get()))
        .unwrap_or(Duration::ZERO)
}

/// A mutex's guard; a poisoned one (a panic under it, which release builds turn into an
/// abort) is used as it is.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// A stream's module object: its context in its thread's worker, and what this thread
/// keeps for it. Envoy hands the object back with every event of the stream (and drops
/// it once, at its end), so its state lives here rather than in a table keyed by context.
///
/// ```text
///   filter_new ──▶ live ──request headers──▶ (paused: a scheduler in the worker's table)
///                   │      callout answers, scheduled events, response headers
///                   └──destroy──▶ gone: state given back; a hook still running on the
///                                 stack (a local reply that ended the stream) stops
/// ```
pub struct FilterBox {
    context: ContextId,
    local: Rc<Local>,
    stream: RefCell<Stream>,
    /// Its destroy ran (possibly inside one of its own hooks, from a command it carried
    /// out): nothing more is asked of its Envoy filter.
    gone: Cell<bool>,
}

/// A configuration's slot as one worker thread uses it.
struct Local {
    config: Arc<Config>,
    slot: Arc<Slot>,
    /// The last context id given to a stream: the slot is this thread's for good, so its
    /// worker's streams are all numbered here, without its lock.
    last_context: Cell<ContextId>,
}

/// What a stream's thread keeps for it.
#[derive(Default)]
struct Stream {
    /// Its own calls in flight: Envoy's id and the worker's token.
    callouts: Vec<(CalloutId, CallToken)>,
    /// An event paused it, so its worker may keep a scheduler for it (deleted when it goes).
    paused: bool,
    /// Its worker no longer tracks it (`Worker::tracks`, asked at its request headers):
    /// its response headers and its end are skipped, with no lock.
    untracked: bool,
}

fn local_for(config: &Arc<Config>) -> Option<Rc<Local>> {
    THREAD.with(|locals| {
        let mut locals = locals.try_borrow_mut().ok()?;
        // Slots of configurations Envoy has replaced go once their streams are gone.
        locals.retain(|_, local| {
            local.config.alive.load(Ordering::Acquire) || Rc::strong_count(local) > 1
        });
        if let Some(local) = locals.get(&config.id) {
            return Some(Rc::clone(local));
        }
        let local = Rc::new(Local {
            config: Arc::clone(config),
            slot: config.claim()?,
            last_context: Cell::new(0),
        });
        locals.insert(config.id, Rc::clone(&local));
        Some(local)
    })
}

pub fn filter_new(config: &Arc<Config>) -> Option<FilterBox> {
    let local = local_for(config)?;
    let context = local.last_context.get().wrapping_add(1).max(1);
    local.last_context.set(context);
    Some(FilterBox {
        context,
        local,
        stream: RefCell::new(Stream::default()),
        gone: Cell::new(false),
    })
}

pub fn request_headers(filter: &FilterBox, envoy: &dyn EnvoyFilter) -> HeadersStatus {
    let context = filter.context;
    let outcome = filter.tracking_event(envoy, |worker, host| {
        worker.on_request_headers(host, context)
    });
    let pause = outcome.pause;
    filter.carry_out(envoy, outcome.commands);
    if pause {
        HeadersStatus::StopAllAndWatermark
    } else {
        HeadersStatus::Continue
    }
}

pub fn response_headers(filter: &FilterBox, envoy: &dyn EnvoyFilter) {
    let context = filter.context;
    if !filter.tracked() {
        return;
    }
    // A request settled here (a breaker's call judged, its response costs charged) is
    // usually done with: its end then takes no lock either.
    let outcome = filter.tracking_event(envoy, |worker, host| {
        worker.on_response_headers(host, context)
    });
    filter.carry_out(envoy, outcome.commands);
}

pub fn callout_done(
    filter: &FilterBox,
    envoy: &dyn EnvoyFilter,
    callout_id: CalloutId,
    answer: &RawAnswer<'_>,
) {
    let token = filter.stream.try_borrow_mut().ok().and_then(|mut stream| {
        let at = stream
            .callouts
            .iter()
            .position(|(id, _)| *id == callout_id)?;
        Some(stream.callouts.swap_remove(at).1)
    });
    let Some(token) = token else {
        return;
    };
    let outcome = filter.event(envoy, true, |worker, host| {
        let answer = answer.read(worker.answer_shape(token));
        worker.on_call_answered(host, token, answer)
    });
    filter.carry_out(envoy, outcome.commands);
}

pub fn scheduled(filter: &FilterBox, envoy: &dyn EnvoyFilter, event: u64) {
    if event != DEFERRED_EVENT {
        return;
    }
    let pending = filter
        .local
        .slot
        .lock()
        .and_then(|mut held| {
            held.0
                .paused
                .get_mut(&filter.context)
                .map(|paused| std::mem::take(&mut paused.pending))
        })
        .unwrap_or_default();
    for deferred in pending {
        if filter.gone.get() {
            return;
        }
        match deferred {
            Deferred::Resume => envoy.continue_decoding(),
            Deferred::Reply(reply) => send(envoy, &reply),
            Deferred::Edit(edits) => edit(envoy, &edits),
        }
    }
}

/// The stream is gone (Envoy's destroy hook; possibly inside one of its own hooks, from a
/// local reply that ended it): its worker gives back what it held, and its calls in flight,
/// which Envoy cancels with it, count as unanswered.
pub fn destroy(filter: &FilterBox) {
    if filter.gone.replace(true) {
        return;
    }
    let stream = match filter.stream.try_borrow_mut() {
        Ok(mut stream) => std::mem::take(&mut *stream),
        // Unreachable (no borrow outlives a call); logged, not silent.
        Err(_) => {
            log::error!("diana: request {} busy at its end", filter.context);
            return;
        }
    };
    let (context, local) = (filter.context, &filter.local);
    // One its worker does not track, that no event paused and that has no call in flight
    // has nothing to give back and no scheduler (most streams: no lock).
    if stream.untracked && !stream.paused && stream.callouts.is_empty() {
        return;
    }
    let paused = stream.paused;
    let outcome = local
        .slot
        .event(&local.config, Site::Stream(None), false, |worker, host| {
            let mut step = worker.on_context_gone(host, context);
            // Its calls are cancelled with it: unanswered.
            for (_, token) in stream.callouts {
                let answered = worker.on_call_answered(host, token, Answer::NoAnswer);
                step.commands.extend(answered.commands);
            }
            step
        });
    // Its scheduler goes (dropped: deleted) under the lock the main thread commits under;
    // a stream no event paused has none (no second lock).
    if paused {
        if let Some(mut held) = local.slot.lock() {
            drop(held.0.paused.remove(&context));
        }
    }
    local.rearm(outcome.rearm);
}

fn edit(envoy: &dyn EnvoyFilter, edits: &[HeaderEdit]) {
    for edit in edits {
        if !envoy.set_request_header(&edit.name, edit.value.as_deref()) {
            log::debug!("diana: cannot set request header {}", edit.name);
        }
    }
    // A route may match on an edited header (a breaker's fallback_header routes to a
    // backup): chosen on the client's headers, it must be chosen again on Diana's.
    if !edits.is_empty() {
        envoy.clear_route_cache();
    }
}

fn send(envoy: &dyn EnvoyFilter, reply: &LocalReply) {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(name, value)| (*name, value.as_str()))
        .collect();
    envoy.send_response(reply.status, &headers, reply.body.as_bytes());
}

impl FilterBox {
    /// Whether the worker may still track this stream.
    fn tracked(&self) -> bool {
        self.stream
            .try_borrow()
            .map_or(true, |stream| !stream.untracked)
    }

    /// One event of this stream, after which the stream is marked untracked if its worker
    /// no longer tracks it (`Worker::tracks`): its later events are skipped, with no lock.
    fn tracking_event(
        &self,
        envoy: &dyn EnvoyFilter,
        event: impl FnOnce(&mut Worker, &dyn Host) -> Step,
    ) -> Outcome {
        let context = self.context;
        let tracked = Cell::new(true);
        let outcome = self.event(envoy, false, |worker, host| {
            let step = event(worker, host);
            tracked.set(worker.tracks(context));
            step
        });
        if !tracked.get() {
            if let Ok(mut stream) = self.stream.try_borrow_mut() {
                stream.untracked = true;
            }
        }
        outcome
    }

    /// One event of this stream; the calls it made are filed under it.
    fn event(
        &self,
        envoy: &dyn EnvoyFilter,
        answering: bool,
        event: impl FnOnce(&mut Worker, &dyn Host) -> Step,
    ) -> Outcome {
        let local = &self.local;
        let current = Some((self.context, envoy));
        let mut outcome = local
            .slot
            .event(&local.config, Site::Stream(current), answering, event);
        let dispatched = std::mem::take(&mut outcome.dispatched);
        if !dispatched.is_empty() || outcome.pause {
            match self.stream.try_borrow_mut() {
                Ok(mut stream) => {
                    stream.callouts.extend(dispatched);
                    stream.paused |= outcome.pause;
                }
                // Unreachable (no borrow outlives a call); logged, not silent.
                Err(_) => log::error!("diana: request {} busy; its calls not filed", self.context),
            }
        }
        local.rearm(outcome.rearm.take());
        outcome
    }

    /// Carries out this stream's commands, after the lock is let go; none after the
    /// stream is gone (a local reply may end it at once).
    fn carry_out(&self, envoy: &dyn EnvoyFilter, commands: Vec<Command>) {
        for command in commands {
            if self.gone.get() {
                return;
            }
            match command {
                Command::Resume(_) => envoy.continue_decoding(),
                Command::Reply(_, reply) => send(envoy, &reply),
                Command::EditRequest(_, edits) => edit(envoy, &edits),
                Command::AddHeaders(headers) => {
                    for (name, value) in headers {
                        if !envoy.add_response_header(name, &value) {
                            log::debug!("diana: cannot add {name}");
                        }
                    }
                }
                // Taken by `Core::settle`.
                Command::SetTick(_) | Command::TickNow => {}
            }
        }
    }
}

impl Local {
    fn rearm(&self, due: Option<Instant>) {
        if let Some(due) = due {
            self.config.arm_tick(due);
        }
    }
}

/// What a configuration's workers still hold, summed (tests: nothing is left behind).
#[cfg(test)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Census {
    /// Requests the workers keep something for.
    pub requests: usize,
    /// Calls the workers wait on.
    pub calls: usize,
    /// Paused streams' entries (each with its scheduler).
    pub schedulers: usize,
    /// Commands queued for paused streams, not yet carried out.
    pub pending: usize,
    /// Calls the main thread made, by callout id.
    pub main_calls: usize,
}

#[cfg(test)]
impl Config {
    pub fn census(&self) -> Census {
        let mut census = Census {
            main_calls: lock(&self.calls).len(),
            ..Census::default()
        };
        for slot in lock(&self.slots).iter() {
            let core = lock(&slot.core);
            census.requests += core.worker.requests_held();
            census.calls += core.worker.calls_in_flight();
            census.schedulers += core.paused.len();
            census.pending += core
                .paused
                .values()
                .map(|paused| paused.pending.len())
                .sum::<usize>();
        }
        census
    }

    /// The stream events its workers ran under their lock so far.
    pub fn stream_events(&self) -> usize {
        lock(&self.slots)
            .iter()
            .map(|slot| lock(&slot.core).stream_events)
            .sum()
    }

    /// Whether its scheduler is still held (by it or the timer).
    pub fn holds_scheduler(&self) -> bool {
        lock(&self.scheduler).is_some()
    }
}
