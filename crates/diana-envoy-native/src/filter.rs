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
//!   own `on_http_filter_scheduled` on its thread. A request held for its body gets none
//!   until its body's end decides it: only its own body hooks move it on until then.
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
    BodyStatus, CalloutId, ConfigScheduler, EnvoyConfig, EnvoyFilter, HeadersStatus, RawAnswer,
    StreamScheduler, TrailersStatus,
};
use crate::host::{self, Metrics, NativeHost};
use crate::shared::SharedStore;
use crate::timer;
use diana_core::decision::HeaderEdit;
use diana_core::time::{Instant, Nanos};
use diana_core::worker::{
    Answer, CallToken, Command, ContextId, Host, HostProfile, LocalReply, Step, Watch, Worker,
};
use hashbrown::HashMap;
use std::borrow::Cow;
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
    /// The pause holds the current stream for its request's body (the worker reads it,
    /// `Worker::reads_request_body`): only its own body hooks move it on, so it has no
    /// scheduler.
    held: bool,
    /// Commands for the current stream, in order.
    commands: Vec<Command>,
    /// Calls made: Envoy's callout id and the worker's token.
    dispatched: Vec<(CalloutId, CallToken)>,
    /// The current stream's breaker calls, for it to keep (`Step::watch`).
    watch: Option<Watch>,
    /// The worker's next tick moved to this (wall clock, ns).
    rearm: Option<Instant>,
}

thread_local! {
    /// This thread's slot of each configuration, and its streams.
    static THREAD: RefCell<HashMap<u64, Rc<Local>>> = RefCell::new(HashMap::new());
    /// This thread holds a worker's lock: a hook re-entered from a callback made under it
    /// skips its event rather than deadlock.
    static HOLDING: Cell<bool> = const { Cell::new(false) };
    /// How many times this thread took a worker's lock (tests: which hooks take none).
    #[cfg(test)]
    static LOCKS: Cell<u64> = const { Cell::new(0) };
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
        #[cfg(test)]
        LOCKS.with(|locks| locks.set(locks.get() + 1));
        Some(Held(lock(&self.core)))
    }

    fn due(&self) -> Option<Instant> {
        self.lock().and_then(|core| core.0.due)
    }

    /// Runs one worker event at `site`, under the lock: commands for other streams are
    /// queued on their schedulers and the tick period is taken there; a current stream the
    /// event pauses gets its scheduler before the lock is let go (so that no command for it
    /// from the main thread can come first), unless the pause holds it for its body.
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
            held: false,
            commands: Vec::new(),
            dispatched: Vec::new(),
            watch: None,
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
        // Held for its body: no command comes for it from another event (it is neither
        // waiting nor calling) until its body's end decides it, and a pause then gets the
        // scheduler.
        let held = step.pause
            && context.is_some_and(|context| core.worker.reads_request_body(context).is_some());
        if let (true, false, false, Some((context, envoy))) = (step.pause, replied, held, current) {
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
        outcome.held = held;
        // The worker hands a request's breaker calls only to its own event: another
        // stream's would be a worker bug, and go uncounted rather than to the wrong stream.
        outcome.watch = step
            .watch
            .filter(|watch| Some(watch.context()) == context || log_stray(watch));
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

/// A watch for another stream than the event's (never: the worker hands one only to the
/// request's own event); logged, and let go.
fn log_stray(watch: &Watch) -> bool {
    log::error!(
        "diana: breaker calls of request {} handed to another event; not counted",
        watch.context()
    );
    false
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
///   filter_new ──▶ live ──request headers──▶ (held for its body: its body hooks read it,
///                   │                          and its end decides it)
///                   │                        (paused: a scheduler in the worker's table)
///                   │      callout answers, scheduled events, response headers and body
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
    /// Its breaker calls, which its worker handed over to keep here (`Step::watch`):
    /// judged at its response headers, counted in the breakers' taps without the worker's
    /// lock when good and closed; failed calls if it ends without them.
    watch: Option<Watch>,
    /// An event paused it, so its worker may keep a scheduler for it (deleted when it goes).
    paused: bool,
    /// Its worker no longer tracks it (`Worker::tracks`, asked at its request headers, or
    /// at the end of a body it was held for): its response headers and body and its end are
    /// skipped, with no lock.
    untracked: bool,
    /// Its worker holds the request for its body (`reserve.json`; a pause of its headers
    /// event that `Worker::reads_request_body` says reads it): its request-body and trailers
    /// hooks hand the body over until its end decides it. Any other request's body passes
    /// them with no lock and no read.
    body_held: bool,
    /// Its worker does not read its answer's body (`Worker::reads_response_body` said no
    /// once its response headers or a chunk of the body had passed, or the body ended): the
    /// rest of the body passes unread, with no lock. A worker that is not reading a body once
    /// its headers are in does not start later (it would have missed what passed).
    body_unread: bool,
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

/// The request's headers (`end_of_stream`: no body follows). A request whose body follows
/// is the worker's to hold for it (`Worker::on_request_headers_with_body`): held, its headers
/// stop alone (`StopIteration`), so that Envoy hands its body to the body hooks; paused
/// otherwise (a call, a wait), they stop with the body (`StopAllIterationAndWatermark`, as
/// proxy-wasm's pause) until the request is resumed.
pub fn request_headers(
    filter: &FilterBox,
    envoy: &dyn EnvoyFilter,
    end_of_stream: bool,
) -> HeadersStatus {
    let context = filter.context;
    let tracked = Cell::new(true);
    let outcome = filter.event(envoy, false, |worker, host| {
        let step = if end_of_stream {
            worker.on_request_headers(host, context)
        } else {
            worker.on_request_headers_with_body(host, context)
        };
        tracked.set(worker.tracks(context));
        step
    });
    filter.after_request_event(outcome.held, tracked.get());
    let (pause, held) = (outcome.pause, outcome.held);
    filter.carry_out(envoy, outcome.commands);
    if held {
        HeadersStatus::StopIteration
    } else if pause {
        HeadersStatus::StopAllAndWatermark
    } else {
        HeadersStatus::Continue
    }
}

/// A chunk of the request's body (`end_of_stream`: the last). Only a request the worker holds
/// for its body is read: its chunk where Envoy holds it — a host call and, only for a chunk
/// of several slices, a copy into one — handed to `Worker::on_request_body`. While the
/// request stays held, or its decision at the body's end pauses it (a call, a wait) or answers
/// it (a local reply, already sent), Envoy buffers the chunk (`StopIterationAndBuffer`); a
/// request admitted at its end goes on (`Continue`: its headers, the body Envoy buffered, this
/// chunk). Every other request's body takes no lock here and goes on unread.
pub fn request_body(
    filter: &FilterBox,
    envoy: &dyn EnvoyFilter,
    end_of_stream: bool,
) -> BodyStatus {
    if !filter.holds_body() {
        return BodyStatus::Continue;
    }
    let context = filter.context;
    let tracked = Cell::new(true);
    let outcome = filter.event(envoy, false, |worker, host| {
        if worker.reads_request_body(context).is_none() {
            return Step::default();
        }
        let mut step = Step::default();
        envoy.read_request_body(&mut |slices: &[&[u8]]| {
            step = worker.on_request_body(host, context, &joined(slices), end_of_stream);
        });
        tracked.set(worker.tracks(context));
        step
    });
    filter.after_request_event(outcome.held, tracked.get());
    let pause = outcome.pause;
    filter.carry_out(envoy, outcome.commands);
    if pause {
        BodyStatus::StopIterationAndBuffer
    } else {
        BodyStatus::Continue
    }
}

/// The request's trailers: the body of a request held for it ended with the chunk before them
/// (which did not say so), and the request is decided here (`StopIteration` while that pauses
/// it). Any other request's trailers take no lock and go on.
pub fn request_trailers(filter: &FilterBox, envoy: &dyn EnvoyFilter) -> TrailersStatus {
    if !filter.holds_body() {
        return TrailersStatus::Continue;
    }
    let context = filter.context;
    let tracked = Cell::new(true);
    let outcome = filter.event(envoy, false, |worker, host| {
        if worker.reads_request_body(context).is_none() {
            return Step::default();
        }
        let step = worker.on_request_body(host, context, &[], true);
        tracked.set(worker.tracks(context));
        step
    });
    filter.after_request_event(outcome.held, tracked.get());
    let pause = outcome.pause;
    filter.carry_out(envoy, outcome.commands);
    if pause {
        TrailersStatus::StopIteration
    } else {
        TrailersStatus::Continue
    }
}

/// The answer's headers (`end_of_stream`: no body follows them).
pub fn response_headers(filter: &FilterBox, envoy: &dyn EnvoyFilter, end_of_stream: bool) {
    let context = filter.context;
    if let Some(watch) = filter.take_watch() {
        // A closed breaker's good call is counted in its tap, without the worker's lock;
        // any other goes to the worker.
        if let Err(watch) = watch.count_alone(host::response_status(envoy), host::now) {
            filter.event(envoy, false, |worker, host| {
                worker.on_watch_answered(host, watch)
            });
        }
    }
    if !filter.tracked() {
        return;
    }
    // A request settled here (a breaker's call judged, its response costs charged) is
    // usually done with: its end then takes no lock either.
    let reading = Cell::new(false);
    let tracked = Cell::new(true);
    let outcome = filter.event(envoy, false, |worker, host| {
        let mut step = worker.on_response_headers(host, context);
        if worker.reads_response_body(context) {
            if end_of_stream {
                // An answer without a body (a HEAD, a 204): its empty body ends here.
                let ended = worker.on_response_body(host, context, &[], true);
                step.commands.extend(ended.commands);
            } else {
                reading.set(true);
            }
        }
        tracked.set(worker.tracks(context));
        step
    });
    filter.read_no_body_unless(reading.get());
    if !tracked.get() {
        filter.untrack();
    }
    filter.carry_out(envoy, outcome.commands);
}

/// A chunk of the answer's body passes (`end_of_stream`: the last). Envoy's hook answers
/// `Continue` whatever happens here: the chunk is read where Envoy holds it — a host call
/// and, only for a chunk of several slices, a copy into one — when the worker reads this
/// request's body, and never held, buffered or changed. Most streams take no lock here: one
/// the worker no longer tracks, or whose body it said it does not read.
pub fn response_body(filter: &FilterBox, envoy: &dyn EnvoyFilter, end_of_stream: bool) {
    if !filter.reads_body() {
        return;
    }
    let context = filter.context;
    let reading = Cell::new(false);
    let outcome = filter.event(envoy, false, |worker, host| {
        if !worker.reads_response_body(context) {
            return Step::default();
        }
        reading.set(!end_of_stream);
        let mut step = Step::default();
        envoy.read_response_body(&mut |slices: &[&[u8]]| {
            step = worker.on_response_body(host, context, &joined(slices), end_of_stream);
        });
        step
    });
    filter.read_no_body_unless(reading.get());
    filter.carry_out(envoy, outcome.commands);
}

/// The answer's trailers: its body ended with the chunk before them (which did not say so).
pub fn response_trailers(filter: &FilterBox, envoy: &dyn EnvoyFilter) {
    if !filter.reads_body() {
        return;
    }
    let context = filter.context;
    let outcome = filter.event(envoy, false, |worker, host| {
        if !worker.reads_response_body(context) {
            return Step::default();
        }
        worker.on_response_body(host, context, &[], true)
    });
    filter.read_no_body_unless(false);
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
    // One its worker does not track, that no event paused, that has no call in flight and
    // no breaker call unjudged has nothing to give back and no scheduler (most streams: no
    // lock).
    if stream.untracked && !stream.paused && stream.callouts.is_empty() && stream.watch.is_none() {
        return;
    }
    let paused = stream.paused;
    let outcome = local
        .slot
        .event(&local.config, Site::Stream(None), false, |worker, host| {
            let mut step = worker.on_context_gone(host, context);
            // Ended without response headers: its breaker calls failed.
            if let Some(watch) = stream.watch {
                step.commands
                    .extend(worker.on_watch_unanswered(host, watch).commands);
            }
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

/// A body chunk as one slice: borrowed when Envoy holds it in one (the common case), copied
/// into one only when it holds it in several.
fn joined<'a>(slices: &[&'a [u8]]) -> Cow<'a, [u8]> {
    match slices {
        [] => Cow::Borrowed(&[]),
        [chunk] => Cow::Borrowed(chunk),
        _ => Cow::Owned(slices.concat()),
    }
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
    /// After an event of the request: whether the worker holds it for its body, and whether
    /// it still tracks it.
    fn after_request_event(&self, held: bool, tracked: bool) {
        if held == self.holds_body() && tracked {
            return;
        }
        if let Ok(mut stream) = self.stream.try_borrow_mut() {
            stream.body_held = held;
            stream.untracked |= !tracked;
        }
    }

    /// Takes the breaker calls this stream keeps, to judge them.
    fn take_watch(&self) -> Option<Watch> {
        self.stream
            .try_borrow_mut()
            .ok()
            .and_then(|mut stream| stream.watch.take())
    }

    /// Whether the worker holds this stream's request for its body.
    fn holds_body(&self) -> bool {
        self.stream
            .try_borrow()
            .is_ok_and(|stream| stream.body_held)
    }

    /// Whether the worker may still track this stream.
    fn tracked(&self) -> bool {
        self.stream
            .try_borrow()
            .map_or(true, |stream| !stream.untracked)
    }

    /// Whether the worker may still read this stream's answer body.
    fn reads_body(&self) -> bool {
        self.stream
            .try_borrow()
            .map_or(true, |stream| !stream.untracked && !stream.body_unread)
    }

    /// After an answer's event: unless the worker still reads its body, the rest of it
    /// passes unread.
    fn read_no_body_unless(&self, reading: bool) {
        if reading {
            return;
        }
        if let Ok(mut stream) = self.stream.try_borrow_mut() {
            stream.body_unread = true;
        }
    }

    /// Its worker no longer tracks it (`Worker::tracks`): its later events, its end
    /// included, are skipped with no lock.
    fn untrack(&self) {
        if let Ok(mut stream) = self.stream.try_borrow_mut() {
            stream.untracked = true;
        }
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
        let watch = outcome.watch.take();
        if !dispatched.is_empty() || outcome.pause || watch.is_some() {
            match self.stream.try_borrow_mut() {
                Ok(mut stream) => {
                    stream.callouts.extend(dispatched);
                    stream.paused |= outcome.pause && !outcome.held;
                    if watch.is_some() {
                        stream.watch = watch;
                    }
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

/// How many times this thread took a worker's lock so far (tests).
#[cfg(test)]
pub fn locks_taken() -> u64 {
    LOCKS.with(Cell::get)
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
