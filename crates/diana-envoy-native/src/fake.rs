//! A fake Envoy for the binding's tests: real threads — a main thread and N worker threads,
//! each an event loop (Envoy's dispatchers) — that implement `crate::envoy`'s traits and
//! call `crate::filter`'s hooks as `ffi` does, following Envoy 1.40's rules for dynamic
//! modules. It records what the module asked of Envoy ([`Seen`], in order) and every rule
//! the module broke ([`Envoy::violations`]); the quota service behind its callouts is
//! diana-core's in-process one (`MemoryQuota`), answered when a test says so.
//!
//! The rules, and where each is in Envoy's source (`source/extensions/filters/http/
//! dynamic_modules/`; read in the stored copy of envoyproxy/envoy, `filter_config.cc` at
//! commit 02bdd7b8, which has the 1.40 ABI's configuration scheduler and callouts):
//!
//! 1. **The configuration's scheduler posts to the main thread**, from any thread; the
//!    event runs only if the configuration is still there. `abi_impl.cc`,
//!    `envoy_dynamic_module_callback_http_filter_config_scheduler_new` (made with the
//!    configuration's `main_thread_dispatcher_`); `filter_config.h`,
//!    `DynamicModuleHttpFilterConfigScheduler::commit` (`dispatcher_.post`, weak
//!    reference locked in the posted event); `filter_config.cc`,
//!    `DynamicModuleHttpFilterConfig::onScheduled`.
//! 2. **Configuration callouts start and finish on the main thread.**
//!    `filter_config.cc`, `DynamicModuleHttpFilterConfig::sendHttpCallout` looks the
//!    cluster up in `cluster_manager_.getThreadLocalCluster` (the calling thread's) and
//!    files the callout in `http_callouts_`, a plain map; `HttpCalloutCallback::onSuccess`
//!    and `onFailure` run on that thread's dispatcher and skip the module once
//!    `in_module_config_` is null. Here a configuration callout off the main thread is a
//!    violation (and refused).
//! 3. **A configuration is destroyed after its last stream, and its callouts in flight are
//!    cancelled unanswered.** Filters hold the configuration (`filter.h`, `config_`, a
//!    shared pointer); `~DynamicModuleHttpFilterConfig` calls
//!    `on_http_filter_config_destroy`, nulls `in_module_config_`, then cancels every
//!    callout in `http_callouts_`. Here destroying a configuration that streams still hold
//!    is a test error.
//! 4. **A stream's scheduler posts to the stream's worker thread**, and an event for a
//!    stream destroyed by then is dropped. `abi_impl.cc`,
//!    `envoy_dynamic_module_callback_http_filter_scheduler_new` (made with
//!    `decoder_callbacks_->dispatcher()`); `filter.h`,
//!    `DynamicModuleHttpFilterScheduler::commit` (weak reference); `filter.cc`,
//!    `DynamicModuleHttpFilter::onScheduled` (runs the hook only while
//!    `in_module_filter_` is set).
//! 5. **A stream's destroy comes after the stream is gone, then its callouts are
//!    cancelled unanswered.** `filter.cc`, `DynamicModuleHttpFilter::destroy`: calls
//!    `on_http_filter_destroy`, nulls `in_module_filter_`, then cancels each request in
//!    `http_callouts_` (an `AsyncClient` cancel calls back nothing, and
//!    `HttpCalloutCallback::onSuccess`/`onFailure` return early once `in_module_filter_` is
//!    null). Nothing may be asked of a destroyed stream's filter here (a violation).
//! 6. **A stream's callout answers on its worker thread**, with the headers and body
//!    slices valid for the hook, or fails with no headers (`Reset`). `filter.cc`,
//!    `HttpCalloutCallback::onSuccess` / `onFailure`.
//! 7. **A local reply may end the stream at once**: its destroy hook runs inside
//!    `send_response`. `filter.cc`, `HttpCalloutCallback::onSuccess` ("on_http_filter_
//!    http_callout_done_ might result in the local reply which destroys the filter"); and
//!    `DynamicModuleHttpFilter::sendLocalReply` goes through `decoder_callbacks_`, which
//!    `destroy` nulls, so nothing may be asked of the stream after. Here every local reply
//!    ends its stream inside the call (the module answers a request with a body only once
//!    the body is in, or at its headers).
//! 8. **`continue_decoding` resumes only a stopped request** (`filter.cc`,
//!    `DynamicModuleHttpFilter::continueDecoding`, guarded by `decode_in_continue_`, which
//!    each request hook sets when it answers `Continue`); here one on a request that is not
//!    stopped is recorded as [`Seen::ContinueIgnored`].
//! 9. **`get_concurrency` answers on the main thread only**, and **metrics are defined
//!    only while the configuration is made** (`abi_impl.cc`,
//!    `envoy_dynamic_module_callback_get_concurrency`; `filter_config.cc`,
//!    `newDynamicModuleHttpFilterConfig` sets `stat_creation_frozen_` after the module's
//!    `on_http_filter_config_new`).
//! 10. **The answer passes through the stream's hooks in order**: its headers
//!     (`end_of_stream` when no body follows), then each body chunk (the last with
//!     `end_of_stream`, unless trailers end it), then its trailers; none of them after the
//!     module's own local reply (`filter.cc`, `encodeHeaders`/`encodeData`/`encodeTrailers`
//!     return `Continue` without the module once `sent_local_reply_` is set). A chunk's bytes
//!     can be read only during its own hook (`encodeData` sets `current_response_body_` to
//!     the chunk around the hook and clears it after; `abi_impl.cc`, `getBufferByType`), as
//!     the slices Envoy holds it in; here a read outside the hook is a violation, each read is
//!     recorded ([`Seen::BodyRead`]), and a chunk is given as several slices when a test says
//!     so. The hooks' answers go unchecked: the module's `ffi` answers `Continue` to each.
//!     (`filter.cc` of the ABI v0.2.0 fork ElvinEfendi/envoy at 8ffb50a1; the installed 1.40
//!     binary's `encodeData` does the same: skip once a local reply was sent or without a
//!     module filter, set the chunk pointer, call the hook, clear the pointer.)
//! 11. **The request passes the stream's hooks in order, as the headers hook's status
//!     lets it**: its headers (`end_of_stream` when no body follows), then each body chunk
//!     (the last with `end_of_stream`, unless trailers end it), then its trailers; nothing
//!     after a local reply (`FilterManager::decodeData`/`decodeTrailers` return once
//!     `local_complete_`). A chunk's bytes can be read only during its own hook
//!     (`DynamicModuleHttpFilter::decodeData` sets `current_request_body_` around the hook;
//!     the 1.40 binary's likewise, the field `get_body_chunks_size`'s case 0 reads). After
//!     `StopIteration` the headers wait alone: the body still comes to the filter's body
//!     hook, `StopIterationAndBuffer` keeps each chunk, and a body or trailers hook that
//!     answers `Continue` sends the request on (`FilterManager`'s
//!     `commonHandleAfterDataCallback`/`commonHandleAfterTrailersCallback`: a filter stopped
//!     for one iteration that continues calls `commonContinue`). After
//!     `StopAllIterationAndWatermark` Envoy holds the body and trailers back from the filter
//!     itself (`handleDataIfStopAll`; `decodeTrailers` returns on `stoppedAll()`): no body
//!     hook runs ([`Seen::BodyHeldBack`]) until `continue_decoding`, which hands the filter
//!     what was held back — its body in one chunk, then its trailers (`commonContinue` with
//!     `iterate_from_current_filter_`). `continue_decoding` after `StopIterationAndBuffer`
//!     sends the request on without the filter's hooks. A request left stopped once it is
//!     complete, with no local reply, no callout of its stream in flight and no scheduler of
//!     its stream — nothing that could run the module for it again — can never go on: a
//!     violation (Envoy would hold it until a timeout). (`source/common/http/
//!     filter_manager.cc` of envoyproxy/envoy; the 1.40 binary's `decodeHeaders`,
//!     `decodeData` and `decodeTrailers` return the hook's status as it is and set
//!     `decode_in_continue_` to whether it is `Continue`.)

use crate::envoy::{
    BodyStatus, CalloutId, CalloutRefused, ConfigScheduler, EnvoyConfig, EnvoyFilter,
    HeadersStatus, RawAnswer, StreamScheduler, TrailersStatus,
};
use crate::filter::{self, Census, Config, FilterBox};
use crate::shared::SharedStore;
use diana_core::call::{Answer, Callout};
use diana_core::quota::MemoryQuota;
use diana_core::worker::MetricKind;
use hashbrown::HashMap;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The quota service's cluster (diana-core's default).
pub const QUOTA_CLUSTER: &str = "diana_quota";

/// How long a test waits for something it expects before it fails.
const PATIENCE: Duration = Duration::from_secs(10);

/// A thread of the fake Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum On {
    Main,
    Worker(usize),
    /// Any other thread: the test's, the module's timer thread.
    Elsewhere,
}

thread_local! {
    static ON: Cell<On> = const { Cell::new(On::Elsewhere) };
    /// A worker thread's streams: Envoy's reference to each stream's module object, and
    /// Envoy's side of the stream.
    static STREAMS: RefCell<HashMap<StreamId, Stream>> = RefCell::new(HashMap::new());
}

fn on() -> On {
    ON.with(Cell::get)
}

/// The fake's name for a stream (unique in one fake Envoy).
pub type StreamId = u64;
/// The fake's name for a configuration (1, 2, … in the order they were made).
pub type ConfigId = usize;

/// Who started a callout (Envoy numbers callouts per owner, from 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Owner {
    Stream(StreamId),
    Config(ConfigId),
}

/// What the module asked of Envoy, or what Envoy did to the module, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// The request-headers hook answered.
    Headers {
        stream: StreamId,
        status: HeadersStatus,
    },
    /// The module read the body chunk of the request-body hook that is running.
    RequestBodyRead {
        stream: StreamId,
    },
    /// A request-body hook answered.
    RequestBody {
        stream: StreamId,
        end_of_stream: bool,
        status: BodyStatus,
    },
    /// A chunk of the request's body that Envoy held back from the filter (stopped for all):
    /// no hook ran.
    BodyHeldBack {
        stream: StreamId,
        end_of_stream: bool,
    },
    /// The request-trailers hook answered.
    RequestTrailers {
        stream: StreamId,
        status: TrailersStatus,
    },
    /// The request's trailers, held back from the filter (stopped for all): no hook ran.
    TrailersHeldBack {
        stream: StreamId,
    },
    /// The response-headers hook ran.
    ResponseHeaders {
        stream: StreamId,
    },
    /// The module read the body chunk of the response-body hook that is running.
    BodyRead {
        stream: StreamId,
    },
    /// A response-body hook ran (and the chunk went on).
    ResponseBody {
        stream: StreamId,
        end_of_stream: bool,
    },
    /// The response-trailers hook ran.
    ResponseTrailers {
        stream: StreamId,
    },
    /// `continue_decoding` resumed a stopped request.
    Continue {
        stream: StreamId,
    },
    /// `continue_decoding` on a request that was not stopped (Envoy ignores it).
    ContinueIgnored {
        stream: StreamId,
    },
    /// `clear_route_cache`: the route is chosen again from the edited headers.
    RouteCleared {
        stream: StreamId,
    },
    /// `send_response`.
    Reply {
        stream: StreamId,
        status: u16,
    },
    /// A callout started, from a thread, to the quota service's endpoint (the path's
    /// last segment).
    Callout {
        owner: Owner,
        id: CalloutId,
        endpoint: String,
        on: On,
    },
    /// A callout's answer was handed to its owner's hook (`answered`: with headers).
    Answered {
        owner: Owner,
        id: CalloutId,
        answered: bool,
    },
    /// A callout cancelled with its owner: never answered.
    Cancelled {
        owner: Owner,
        id: CalloutId,
    },
    /// A stream's scheduler was made, committed to (from a thread), ran its event on the
    /// stream, dropped an event (the stream was gone), was deleted.
    SchedulerNew {
        stream: StreamId,
    },
    Commit {
        stream: StreamId,
        event: u64,
        on: On,
    },
    Scheduled {
        stream: StreamId,
        event: u64,
    },
    Dropped {
        stream: StreamId,
        event: u64,
    },
    SchedulerDeleted {
        stream: StreamId,
    },
    /// The configuration's scheduler, likewise.
    ConfigCommit {
        config: ConfigId,
        event: u64,
        on: On,
    },
    ConfigScheduled {
        config: ConfigId,
        event: u64,
    },
    ConfigDropped {
        config: ConfigId,
        event: u64,
    },
    ConfigSchedulerDeleted {
        config: ConfigId,
    },
    /// The stream's destroy hook ran.
    Destroyed {
        stream: StreamId,
    },
    /// The configuration's destroy hook ran.
    ConfigDestroyed {
        config: ConfigId,
    },
}

impl Seen {
    /// The stream it is about, if any.
    pub fn stream(&self) -> Option<StreamId> {
        match self {
            Seen::Headers { stream, .. }
            | Seen::RequestBodyRead { stream }
            | Seen::RequestBody { stream, .. }
            | Seen::BodyHeldBack { stream, .. }
            | Seen::RequestTrailers { stream, .. }
            | Seen::TrailersHeldBack { stream }
            | Seen::ResponseHeaders { stream }
            | Seen::BodyRead { stream }
            | Seen::ResponseBody { stream, .. }
            | Seen::ResponseTrailers { stream }
            | Seen::Continue { stream }
            | Seen::ContinueIgnored { stream }
            | Seen::Reply { stream, .. }
            | Seen::RouteCleared { stream }
            | Seen::SchedulerNew { stream }
            | Seen::Commit { stream, .. }
            | Seen::Scheduled { stream, .. }
            | Seen::Dropped { stream, .. }
            | Seen::SchedulerDeleted { stream }
            | Seen::Destroyed { stream } => Some(*stream),
            Seen::Callout { owner, .. }
            | Seen::Answered { owner, .. }
            | Seen::Cancelled { owner, .. } => match owner {
                Owner::Stream(stream) => Some(*stream),
                Owner::Config(_) => None,
            },
            _ => None,
        }
    }
}

/// A callout in flight.
#[derive(Clone)]
pub struct Pending {
    pub owner: Owner,
    pub id: CalloutId,
    pub callout: Callout,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} #{} {} {}",
            self.owner,
            self.id,
            self.endpoint(),
            String::from_utf8_lossy(&self.callout.body)
        )
    }
}

impl Pending {
    /// The quota service's endpoint it calls (the path's last segment).
    pub fn endpoint(&self) -> String {
        endpoint(&self.callout)
    }
}

fn endpoint(callout: &Callout) -> String {
    callout
        .headers
        .iter()
        .find(|(name, _)| *name == ":path")
        .and_then(|(_, path)| path.rsplit('/').next())
        .unwrap_or("")
        .to_string()
}

enum Job {
    Run(Box<dyn FnOnce() + Send>),
    Stop,
}

/// One event loop on its own thread.
struct Dispatcher {
    tx: Sender<Job>,
    thread: Option<JoinHandle<()>>,
}

impl Dispatcher {
    fn start(on: On, name: String) -> Dispatcher {
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                ON.with(|cell| cell.set(on));
                while let Ok(Job::Run(job)) = rx.recv() {
                    job();
                }
                // The thread's streams go before it does (their module objects hold
                // schedulers that post here).
                STREAMS.with(|streams| streams.borrow_mut().clear());
            })
            .expect("a dispatcher thread");
        Dispatcher {
            tx,
            thread: Some(thread),
        }
    }
}

/// Envoy's side of a configuration.
struct ConfigState {
    id: ConfigId,
    /// Metric creation is frozen (after `on_http_filter_config_new`).
    frozen: AtomicBool,
    next_callout: AtomicU64,
    /// The metrics' values, by Envoy's id.
    metrics: Mutex<Vec<u64>>,
}

struct ConfigEntry {
    /// The module's object (`None` once destroyed).
    module: Option<Arc<Config>>,
    /// The module's object, to tell when nothing holds it any more.
    weak: Weak<Config>,
    /// Streams that hold it.
    streams: usize,
}

/// Envoy's side of a stream (its `DynamicModuleHttpFilter`).
struct StreamState {
    id: StreamId,
    worker: usize,
    config: ConfigId,
    request: Vec<(String, String)>,
    source: String,
    response: Mutex<Vec<(String, String)>>,
    /// The response code Envoy's stream info records (`response.code`), when set.
    recorded: Mutex<Option<u16>>,
    /// Request headers the module set or removed (what the upstream sees of them).
    request_edits: Mutex<Vec<(String, String)>>,
    /// The answer: its headers have passed (its body may follow), it has ended.
    answering: AtomicBool,
    answered: AtomicBool,
    /// The body chunk of the response-body hook that is running, as its slices (`None`
    /// outside that hook: Envoy's `current_response_body_`).
    chunk: Mutex<Option<Vec<Vec<u8>>>>,
    /// Likewise the request-body hook's chunk (`current_request_body_`).
    request_chunk: Mutex<Option<Vec<Vec<u8>>>>,
    /// The whole request is in: headers with `end_of_stream`, its last body chunk, or its
    /// trailers.
    request_ended: AtomicBool,
    /// A request hook stopped it and nothing continued it yet.
    stopped: AtomicBool,
    /// Stopped for all (`StopAllIterationAndWatermark` at its headers): what comes of the
    /// request meanwhile is held back from the filter's hooks.
    stopped_all: AtomicBool,
    /// What was held back: the body's chunks (one buffer), whether trailers came.
    held_back: Mutex<HeldBack>,
    /// Its schedulers made and not yet deleted.
    schedulers: AtomicU64,
    replied: AtomicBool,
    destroyed: AtomicBool,
    next_callout: AtomicU64,
}

struct Stream {
    module: Rc<FilterBox>,
    state: Arc<StreamState>,
}

/// What Envoy held back from a filter stopped for all (rule 11).
#[derive(Default)]
struct HeldBack {
    body: Option<Vec<Vec<u8>>>,
    trailers: bool,
}

/// What the threads share.
struct Shared {
    seen: Mutex<Vec<Seen>>,
    changed: Condvar,
    violations: Mutex<Vec<String>>,
    store: &'static SharedStore,
    quota: Mutex<MemoryQuota>,
    configs: Mutex<Vec<ConfigEntry>>,
    /// The configuration new streams get (the listener's latest).
    current: Mutex<Option<ConfigId>>,
    callouts: Mutex<Vec<Pending>>,
    next_stream: AtomicU64,
    /// Each stream's worker thread.
    stream_workers: Mutex<HashMap<StreamId, usize>>,
    main: Sender<Job>,
    workers: Vec<Sender<Job>>,
    /// Schedulers made and not yet deleted: the streams', the configurations'.
    stream_schedulers: AtomicU64,
    config_schedulers: AtomicU64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

impl Shared {
    fn see(&self, seen: Seen) {
        lock(&self.seen).push(seen);
        self.changed.notify_all();
    }

    fn violation(&self, what: String) {
        lock(&self.violations).push(what);
        self.changed.notify_all();
    }

    fn post(&self, on: On, job: impl FnOnce() + Send + 'static) {
        let tx = match on {
            On::Main => Some(&self.main),
            On::Worker(index) => self.workers.get(index),
            On::Elsewhere => None,
        };
        if tx.is_none_or(|tx| tx.send(Job::Run(Box::new(job))).is_err()) {
            self.violation(format!("posted to {on:?}, which is not running"));
        }
    }

    /// Changes how many streams hold a configuration.
    fn held_by_streams(&self, config: ConfigId, change: impl FnOnce(&mut usize)) {
        let mut configs = lock(&self.configs);
        if let Some(entry) = config.checked_sub(1).and_then(|at| configs.get_mut(at)) {
            change(&mut entry.streams);
        }
    }

    fn module(&self, config: ConfigId) -> Option<Arc<Config>> {
        lock(&self.configs)
            .get(config.checked_sub(1)?)
            .and_then(|entry| entry.module.clone())
    }

    fn take_callouts(&self, owner: Owner) -> Vec<Pending> {
        let mut callouts = lock(&self.callouts);
        let (mine, others) = callouts
            .drain(..)
            .partition(|pending| pending.owner == owner);
        *callouts = others;
        mine
    }

    fn take_callout(&self, owner: Owner, id: CalloutId) -> Option<Pending> {
        let mut callouts = lock(&self.callouts);
        let at = callouts
            .iter()
            .position(|pending| pending.owner == owner && pending.id == id)?;
        Some(callouts.remove(at))
    }

    /// Starts a callout for `owner` (Envoy's checks of the cluster and the headers).
    fn callout(
        &self,
        owner: Owner,
        next: &AtomicU64,
        callout: &Callout,
    ) -> Result<CalloutId, CalloutRefused> {
        if callout.upstream != QUOTA_CLUSTER {
            return Err(CalloutRefused::ClusterNotFound);
        }
        let has = |wanted: &str| callout.headers.iter().any(|(name, _)| *name == wanted);
        if !(has(":path") && has(":method") && (has(":authority") || has("host"))) {
            return Err(CalloutRefused::MissingRequiredHeaders);
        }
        let id = next.fetch_add(1, Ordering::Relaxed) + 1;
        lock(&self.callouts).push(Pending {
            owner,
            id,
            callout: callout.clone(),
        });
        self.see(Seen::Callout {
            owner,
            id,
            endpoint: endpoint(callout),
            on: on(),
        });
        Ok(id)
    }
}

/// The fake Envoy: its threads, and what they saw.
pub struct Envoy {
    shared: Arc<Shared>,
    threads: Vec<Dispatcher>,
}

impl Envoy {
    /// An Envoy with `workers` worker threads and a main thread, its own shared data (one
    /// process) and its own quota service.
    pub fn start(workers: usize) -> Envoy {
        let main = Dispatcher::start(On::Main, "envoy-main".to_string());
        let worker_threads: Vec<Dispatcher> = (0..workers)
            .map(|index| Dispatcher::start(On::Worker(index), format!("envoy-worker-{index}")))
            .collect();
        let shared = Arc::new(Shared {
            seen: Mutex::new(Vec::new()),
            changed: Condvar::new(),
            violations: Mutex::new(Vec::new()),
            store: Box::leak(Box::new(SharedStore::default())),
            quota: Mutex::new(MemoryQuota::new()),
            configs: Mutex::new(Vec::new()),
            current: Mutex::new(None),
            callouts: Mutex::new(Vec::new()),
            next_stream: AtomicU64::new(0),
            stream_workers: Mutex::new(HashMap::new()),
            main: main.tx.clone(),
            workers: worker_threads
                .iter()
                .map(|worker| worker.tx.clone())
                .collect(),
            stream_schedulers: AtomicU64::new(0),
            config_schedulers: AtomicU64::new(0),
        });
        let mut threads = vec![main];
        threads.extend(worker_threads);
        Envoy { shared, threads }
    }

    /// Runs `job` on a thread and waits for what it returns.
    fn run<R: Send + 'static>(
        &self,
        on: On,
        job: impl FnOnce(&Arc<Shared>) -> R + Send + 'static,
    ) -> R {
        let (tx, rx): (Sender<R>, Receiver<R>) = mpsc::channel();
        let shared = Arc::clone(&self.shared);
        self.shared.post(on, move || {
            let _ = tx.send(job(&shared));
        });
        match rx.recv_timeout(PATIENCE) {
            Ok(value) => value,
            Err(_) => panic!("{on:?} did not run a job\n{}", self.report()),
        }
    }

    /// The log, the violations and the callouts in flight, for a failure's message.
    pub fn report(&self) -> String {
        let mut report = String::from("seen:\n");
        for seen in lock(&self.shared.seen).iter() {
            report.push_str(&format!("  {seen:?}\n"));
        }
        report.push_str(&format!(
            "violations: {:#?}\ncallouts in flight: {:#?}",
            lock(&self.shared.violations),
            lock(&self.shared.callouts)
        ));
        report
    }

    /// Makes a configuration on the main thread (`on_http_filter_config_new`); new
    /// streams get it. `None`: the module refused the document.
    pub fn configure(&self, document: &str) -> Option<ConfigId> {
        let document = document.to_string();
        self.run(On::Main, move |shared| {
            let id = lock(&shared.configs).len() + 1;
            let state = Arc::new(ConfigState {
                id,
                frozen: AtomicBool::new(false),
                next_callout: AtomicU64::new(0),
                metrics: Mutex::new(Vec::new()),
            });
            let handle = ConfigHandle {
                shared: Arc::clone(shared),
                state: Arc::clone(&state),
            };
            let module = filter::config_new(Box::new(handle), shared.store, document.as_bytes());
            state.frozen.store(true, Ordering::Release);
            let module = module?;
            lock(&shared.configs).push(ConfigEntry {
                weak: Arc::downgrade(&module),
                module: Some(module),
                streams: 0,
            });
            *lock(&shared.current) = Some(id);
            Some(id)
        })
    }

    /// Destroys a configuration no stream holds, on the main thread: its destroy hook,
    /// then its callouts cancelled (rule 3).
    pub fn destroy_config(&self, config: ConfigId) {
        self.run(On::Main, move |shared| {
            let module = {
                let mut configs = lock(&shared.configs);
                let Some(entry) = config.checked_sub(1).and_then(|at| configs.get_mut(at)) else {
                    return;
                };
                assert_eq!(
                    entry.streams, 0,
                    "Envoy destroys a configuration after its streams"
                );
                entry.module.take()
            };
            let Some(module) = module else {
                return;
            };
            filter::config_destroy(&module);
            shared.see(Seen::ConfigDestroyed { config });
            for pending in shared.take_callouts(Owner::Config(config)) {
                shared.see(Seen::Cancelled {
                    owner: pending.owner,
                    id: pending.id,
                });
            }
            if lock(&shared.current).as_ref() == Some(&config) {
                *lock(&shared.current) = None;
            }
        });
    }

    /// What the workers of a configuration still hold.
    pub fn census(&self, config: ConfigId) -> Census {
        self.shared
            .module(config)
            .map(|module| module.census())
            .unwrap_or_default()
    }

    /// Whether the module let go of everything of a configuration (after its destroy, and
    /// the next stream of each worker thread that used it).
    pub fn freed(&self, config: ConfigId) -> bool {
        lock(&self.shared.configs)
            .get(config.saturating_sub(1))
            .is_some_and(|entry| entry.weak.strong_count() == 0)
    }

    /// The stream events a configuration's workers ran under their lock so far.
    pub fn stream_events(&self, config: ConfigId) -> usize {
        self.shared
            .module(config)
            .map(|module| module.stream_events())
            .unwrap_or_default()
    }

    /// Whether the module still holds a configuration's scheduler.
    pub fn holds_scheduler(&self, config: ConfigId) -> bool {
        self.shared
            .module(config)
            .is_some_and(|module| module.holds_scheduler())
    }

    /// A request for `path` from `client` reaches worker `worker`: a new stream of the
    /// current configuration and its request-headers hook (the request is complete).
    pub fn request(&self, worker: usize, path: &str, client: &str) -> StreamId {
        self.request_with(worker, path, client, &[])
    }

    /// [`Envoy::request`] with these request headers too.
    pub fn request_with(
        &self,
        worker: usize,
        path: &str,
        client: &str,
        headers: &[(&str, &str)],
    ) -> StreamId {
        self.open(worker, path, client, headers, true)
    }

    /// A request with a body reaches worker `worker` (a `POST` with these headers too): a new
    /// stream and its request-headers hook, not at the end of the stream. Its body follows
    /// ([`Envoy::request_body`], then perhaps [`Envoy::request_trailers`]).
    pub fn request_with_body(
        &self,
        worker: usize,
        path: &str,
        client: &str,
        headers: &[(&str, &str)],
    ) -> StreamId {
        self.open(worker, path, client, headers, false)
    }

    fn open(
        &self,
        worker: usize,
        path: &str,
        client: &str,
        headers: &[(&str, &str)],
        end_of_stream: bool,
    ) -> StreamId {
        let id = self.shared.next_stream.fetch_add(1, Ordering::Relaxed) + 1;
        let method = if end_of_stream { "GET" } else { "POST" };
        let mut request = vec![
            (":path".to_string(), path.to_string()),
            (":method".to_string(), method.to_string()),
            (":authority".to_string(), "gateway".to_string()),
        ];
        request.extend(
            headers
                .iter()
                .map(|(name, value)| (name.to_string(), value.to_string())),
        );
        let source = format!("{client}:40000");
        self.run(On::Worker(worker), move |shared| {
            let Some(config) = *lock(&shared.current) else {
                shared.violation(format!("stream {id}: no configuration"));
                return;
            };
            let Some(module) = shared.module(config) else {
                shared.violation(format!("stream {id}: configuration {config} is gone"));
                return;
            };
            let Some(filter) = filter::filter_new(&module) else {
                shared.violation(format!("stream {id}: on_http_filter_new refused"));
                return;
            };
            shared.held_by_streams(config, |streams| *streams += 1);
            lock(&shared.stream_workers).insert(id, worker);
            let state = Arc::new(StreamState {
                id,
                worker,
                config,
                request,
                source,
                response: Mutex::new(Vec::new()),
                recorded: Mutex::new(None),
                request_edits: Mutex::new(Vec::new()),
                answering: AtomicBool::new(false),
                answered: AtomicBool::new(false),
                chunk: Mutex::new(None),
                request_chunk: Mutex::new(None),
                request_ended: AtomicBool::new(end_of_stream),
                stopped: AtomicBool::new(false),
                stopped_all: AtomicBool::new(false),
                held_back: Mutex::new(HeldBack::default()),
                schedulers: AtomicU64::new(0),
                replied: AtomicBool::new(false),
                destroyed: AtomicBool::new(false),
                next_callout: AtomicU64::new(0),
            });
            let module = Rc::new(filter);
            STREAMS.with(|streams| {
                streams.borrow_mut().insert(
                    id,
                    Stream {
                        module: Rc::clone(&module),
                        state: Arc::clone(&state),
                    },
                )
            });
            let handle = FilterHandle {
                shared,
                state: &state,
            };
            let status = filter::request_headers(&module, &handle, end_of_stream);
            if status != HeadersStatus::Continue && !state.replied.load(Ordering::Acquire) {
                state.stopped.store(true, Ordering::Release);
                state.stopped_all.store(
                    status == HeadersStatus::StopAllAndWatermark,
                    Ordering::Release,
                );
            }
            shared.see(Seen::Headers { stream: id, status });
            check_stuck(shared, &state);
        });
        id
    }

    /// A chunk of the request's body, as the slices `slices` (none: an empty chunk), reaches
    /// the stream (`end_of_stream`: the last): its request-body hook, or, while it is stopped
    /// for all, Envoy's buffer (rule 11).
    pub fn request_body(&self, stream: StreamId, slices: &[&str], end_of_stream: bool) {
        let worker = self.worker_of(stream);
        let slices: Vec<Vec<u8>> = slices.iter().map(|s| s.as_bytes().to_vec()).collect();
        self.run(On::Worker(worker), move |shared| {
            // Gone (answered, or its client left): Envoy runs nothing of it any more.
            let Some((module, state)) = stream_of(stream) else {
                return;
            };
            assert!(
                !state.request_ended.swap(end_of_stream, Ordering::AcqRel),
                "stream {stream}: a request body chunk after the request's end"
            );
            if state.replied.load(Ordering::Acquire) {
                return;
            }
            if state.stopped_all.load(Ordering::Acquire) {
                lock(&state.held_back)
                    .body
                    .get_or_insert_with(Vec::new)
                    .extend(slices);
                shared.see(Seen::BodyHeldBack {
                    stream,
                    end_of_stream,
                });
            } else {
                body_hook(shared, &module, &state, slices, end_of_stream);
            }
            if end_of_stream {
                check_stuck(shared, &state);
            }
        });
    }

    /// The request's trailers end it: its request-trailers hook, or, while it is stopped for
    /// all, Envoy keeps them back (rule 11).
    pub fn request_trailers(&self, stream: StreamId) {
        let worker = self.worker_of(stream);
        self.run(On::Worker(worker), move |shared| {
            let Some((module, state)) = stream_of(stream) else {
                return;
            };
            assert!(
                !state.request_ended.swap(true, Ordering::AcqRel),
                "stream {stream}: request trailers after the request's end"
            );
            if state.replied.load(Ordering::Acquire) {
                return;
            }
            if state.stopped_all.load(Ordering::Acquire) {
                lock(&state.held_back).trailers = true;
                shared.see(Seen::TrailersHeldBack { stream });
            } else {
                trailers_hook(shared, &module, &state);
            }
            check_stuck(shared, &state);
        });
    }

    /// The upstream answers a stream that went on, with headers alone (they end the
    /// answer): its response-headers hook.
    pub fn respond(&self, stream: StreamId, headers: &[(&str, &str)]) {
        self.answer_headers(stream, headers, true, None);
    }

    /// As [`Envoy::respond`], with the stream info's response code set to `recorded`
    /// first (Envoy's router records the upstream's status; a filter between it and the
    /// module may have changed `:status` since).
    pub fn respond_recorded(&self, stream: StreamId, headers: &[(&str, &str)], recorded: u16) {
        self.answer_headers(stream, headers, true, Some(recorded));
    }

    /// The upstream answers a stream that went on with headers, and a body follows
    /// ([`Envoy::body`]): its response-headers hook.
    pub fn respond_with_body(&self, stream: StreamId, headers: &[(&str, &str)]) {
        self.answer_headers(stream, headers, false, None);
    }

    fn answer_headers(
        &self,
        stream: StreamId,
        headers: &[(&str, &str)],
        end_of_stream: bool,
        recorded: Option<u16>,
    ) {
        let worker = self.worker_of(stream);
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect();
        self.run(On::Worker(worker), move |shared| {
            let Some((module, state)) = stream_of(stream) else {
                return;
            };
            assert!(
                !state.stopped.load(Ordering::Acquire),
                "stream {stream}: no response comes to a stopped request"
            );
            assert!(
                !state.answering.swap(true, Ordering::AcqRel),
                "stream {stream}: answered twice"
            );
            state.answered.store(end_of_stream, Ordering::Release);
            if state.replied.load(Ordering::Acquire) {
                return;
            }
            *lock(&state.response) = headers;
            *lock(&state.recorded) = recorded;
            let handle = FilterHandle {
                shared,
                state: &state,
            };
            filter::response_headers(&module, &handle, end_of_stream);
            shared.see(Seen::ResponseHeaders { stream });
        });
    }

    /// A chunk of the answer's body, as the slices `slices` (none: an empty chunk), passes
    /// through the stream's response-body hook (`end_of_stream`: the last).
    pub fn body(&self, stream: StreamId, slices: &[&str], end_of_stream: bool) {
        let worker = self.worker_of(stream);
        let slices: Vec<Vec<u8>> = slices.iter().map(|s| s.as_bytes().to_vec()).collect();
        self.run(On::Worker(worker), move |shared| {
            // Gone (its client left): Envoy runs nothing of it any more.
            let Some((module, state)) = stream_of(stream) else {
                return;
            };
            assert!(
                state.answering.load(Ordering::Acquire) && !state.answered.load(Ordering::Acquire),
                "stream {stream}: a body chunk outside an answer's body"
            );
            state.answered.store(end_of_stream, Ordering::Release);
            if state.replied.load(Ordering::Acquire) {
                return;
            }
            *lock(&state.chunk) = Some(slices);
            let handle = FilterHandle {
                shared,
                state: &state,
            };
            filter::response_body(&module, &handle, end_of_stream);
            *lock(&state.chunk) = None;
            shared.see(Seen::ResponseBody {
                stream,
                end_of_stream,
            });
        });
    }

    /// The answer's trailers end it: the stream's response-trailers hook.
    pub fn trailers(&self, stream: StreamId) {
        let worker = self.worker_of(stream);
        self.run(On::Worker(worker), move |shared| {
            let Some((module, state)) = stream_of(stream) else {
                return;
            };
            assert!(
                state.answering.load(Ordering::Acquire)
                    && !state.answered.swap(true, Ordering::AcqRel),
                "stream {stream}: trailers outside an answer"
            );
            if state.replied.load(Ordering::Acquire) {
                return;
            }
            let handle = FilterHandle {
                shared,
                state: &state,
            };
            filter::response_trailers(&module, &handle);
            shared.see(Seen::ResponseTrailers { stream });
        });
    }

    /// The stream ends (its client left, or it completed): its destroy hook, then its
    /// callouts cancelled (rule 5).
    pub fn end(&self, stream: StreamId) {
        let worker = self.worker_of(stream);
        self.run(On::Worker(worker), move |shared| end_stream(shared, stream));
    }

    /// Waits until the thread has run every job posted to it so far (the hook that is
    /// running finishes first).
    pub fn sync(&self, on: On) {
        self.run(on, |_| ());
    }

    /// Blocks the thread until the returned sender is dropped or sent to (jobs posted
    /// meanwhile queue behind).
    pub fn hold(&self, on: On) -> Sender<()> {
        let (release, held) = mpsc::channel::<()>();
        let (ready, running) = mpsc::channel::<()>();
        self.shared.post(on, move || {
            let _ = ready.send(());
            let _ = held.recv_timeout(PATIENCE);
        });
        if running.recv_timeout(PATIENCE).is_err() {
            panic!("{on:?} was not held\n{}", self.report());
        }
        release
    }

    /// Posts `end(stream)` to its worker without waiting (behind whatever is queued there).
    pub fn end_later(&self, stream: StreamId) {
        let worker = self.worker_of(stream);
        let shared = Arc::clone(&self.shared);
        self.shared
            .post(On::Worker(worker), move || end_stream(&shared, stream));
    }

    fn worker_of(&self, stream: StreamId) -> usize {
        match lock(&self.shared.stream_workers).get(&stream) {
            Some(worker) => *worker,
            None => panic!("no stream {stream}\n{}", self.report()),
        }
    }

    /// The callouts in flight, in the order they started.
    pub fn callouts(&self) -> Vec<Pending> {
        lock(&self.shared.callouts).clone()
    }

    /// The quota service answers a callout in flight now; the answer reaches its owner's
    /// hook on its thread (unless the owner went meanwhile: then it was cancelled).
    pub fn answer(&self, owner: Owner, id: CalloutId) {
        let Some(pending) = self
            .callouts()
            .into_iter()
            .find(|p| p.owner == owner && p.id == id)
        else {
            panic!("no callout {id} of {owner:?} in flight\n{}", self.report());
        };
        let now = crate::host::now().unwrap_or(diana_core::time::Instant::EPOCH);
        let answer = lock(&self.shared.quota).answer(&pending.callout, now);
        self.deliver(owner, id, answer);
    }

    /// The callout fails: no answer (a reset or a timeout), delivered as `answer` is.
    pub fn fail(&self, owner: Owner, id: CalloutId) {
        self.deliver(owner, id, Answer::NoAnswer);
    }

    fn deliver(&self, owner: Owner, id: CalloutId, answer: Answer) {
        let on = match owner {
            Owner::Stream(stream) => On::Worker(self.worker_of(stream)),
            Owner::Config(_) => On::Main,
        };
        self.run(on, move |shared| {
            // Cancelled with its owner meanwhile: Envoy calls nothing back.
            if shared.take_callout(owner, id).is_none() {
                return;
            }
            let (status, body) = match &answer {
                Answer::Answered(answered) => (
                    Some(answered.status.to_string()),
                    answered.body.clone().unwrap_or_default(),
                ),
                _ => (None, Vec::new()),
            };
            // Envoy's body is a list of slices: two, to be read as one.
            let (first, second) = body.split_at(body.len() / 2);
            let headers: Vec<(&[u8], &[u8])> = status
                .iter()
                .map(|status| (b":status".as_slice(), status.as_bytes()))
                .collect();
            let raw = RawAnswer {
                answered: !headers.is_empty(),
                headers,
                body: vec![first, second],
            };
            shared.see(Seen::Answered {
                owner,
                id,
                answered: raw.answered,
            });
            match owner {
                Owner::Stream(stream) => {
                    let Some((module, state)) = stream_of(stream) else {
                        return;
                    };
                    let handle = FilterHandle {
                        shared,
                        state: &state,
                    };
                    filter::callout_done(&module, &handle, id, &raw);
                }
                Owner::Config(config) => {
                    if let Some(module) = shared.module(config) {
                        filter::config_callout_done(&module, id, &raw);
                    }
                }
            }
        });
    }

    /// Waits until `done` holds of the log (or fails the test).
    pub fn wait_until(&self, what: &str, done: impl Fn(&[Seen]) -> bool) {
        let deadline = Instant::now() + PATIENCE;
        let mut seen = lock(&self.shared.seen);
        while !done(&seen) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                drop(seen);
                panic!("waited in vain for {what}\n{}", self.report());
            }
            seen = match self.shared.changed.wait_timeout(seen, left) {
                Ok((seen, _)) => seen,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }

    /// The log so far.
    pub fn seen(&self) -> Vec<Seen> {
        lock(&self.shared.seen).clone()
    }

    /// The log of one stream.
    pub fn seen_by(&self, stream: StreamId) -> Vec<Seen> {
        self.seen()
            .into_iter()
            .filter(|seen| seen.stream() == Some(stream))
            .collect()
    }

    /// The rules the module broke.
    pub fn violations(&self) -> Vec<String> {
        lock(&self.shared.violations).clone()
    }

    /// How many times a thread took a worker's lock so far (the module's count).
    pub fn locks_on(&self, on: On) -> u64 {
        self.run(on, |_| filter::locks_taken())
    }

    /// Schedulers made and not yet deleted: the streams', the configurations'.
    pub fn schedulers(&self) -> (u64, u64) {
        (
            self.shared.stream_schedulers.load(Ordering::Acquire),
            self.shared.config_schedulers.load(Ordering::Acquire),
        )
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        // Envoy's configurations go with it, on the main thread (their module objects, and
        // the handles in them that point back here, are let go); then every thread stops.
        let shared = Arc::clone(&self.shared);
        self.shared.post(On::Main, move || {
            let modules: Vec<Arc<Config>> = lock(&shared.configs)
                .iter_mut()
                .filter_map(|entry| entry.module.take())
                .collect();
            for module in modules {
                filter::config_destroy(&module);
            }
        });
        for thread in &self.threads {
            let _ = thread.tx.send(Job::Stop);
        }
        for thread in &mut self.threads {
            if let Some(thread) = thread.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

/// A stream of this worker thread: its module object (a reference for the hook, as
/// `ffi` holds one) and Envoy's side.
fn stream_of(stream: StreamId) -> Option<(Rc<FilterBox>, Arc<StreamState>)> {
    STREAMS.with(|streams| {
        streams
            .borrow()
            .get(&stream)
            .map(|stream| (Rc::clone(&stream.module), Arc::clone(&stream.state)))
    })
}

/// The request-body hook of a stream of this worker thread with `slices` as its chunk
/// (`decodeData`), and what its status asks of Envoy (rule 11).
fn body_hook(
    shared: &Arc<Shared>,
    module: &FilterBox,
    state: &Arc<StreamState>,
    slices: Vec<Vec<u8>>,
    end_of_stream: bool,
) {
    *lock(&state.request_chunk) = Some(slices);
    let handle = FilterHandle { shared, state };
    let status = filter::request_body(module, &handle, end_of_stream);
    *lock(&state.request_chunk) = None;
    if !state.replied.load(Ordering::Acquire) {
        // `Continue` sends on a request stopped for one iteration; `StopIterationAndBuffer`
        // keeps the chunk and stops it until `continue_decoding`.
        state.stopped.store(
            status == BodyStatus::StopIterationAndBuffer,
            Ordering::Release,
        );
    }
    shared.see(Seen::RequestBody {
        stream: state.id,
        end_of_stream,
        status,
    });
}

/// The request-trailers hook of a stream of this worker thread (`decodeTrailers`), and what
/// its status asks of Envoy (rule 11).
fn trailers_hook(shared: &Arc<Shared>, module: &FilterBox, state: &Arc<StreamState>) {
    let handle = FilterHandle { shared, state };
    let status = filter::request_trailers(module, &handle);
    if !state.replied.load(Ordering::Acquire) {
        state
            .stopped
            .store(status == TrailersStatus::StopIteration, Ordering::Release);
    }
    shared.see(Seen::RequestTrailers {
        stream: state.id,
        status,
    });
}

/// Rule 11: a complete request left stopped, with nothing that could run the module for it
/// again (no local reply, no callout of its stream, no scheduler of it), is stuck.
fn check_stuck(shared: &Arc<Shared>, state: &StreamState) {
    let stuck = state.request_ended.load(Ordering::Acquire)
        && state.stopped.load(Ordering::Acquire)
        && !state.replied.load(Ordering::Acquire)
        && !state.destroyed.load(Ordering::Acquire)
        && state.schedulers.load(Ordering::Acquire) == 0
        && !lock(&shared.callouts)
            .iter()
            .any(|pending| pending.owner == Owner::Stream(state.id));
    if stuck {
        shared.violation(format!(
            "stream {}: stopped with its whole request in, and nothing can continue it",
            state.id
        ));
    }
}

/// Ends a stream of this worker thread (rule 5).
fn end_stream(shared: &Arc<Shared>, id: StreamId) {
    let Some(stream) = STREAMS.with(|streams| streams.borrow_mut().remove(&id)) else {
        return;
    };
    filter::destroy(&stream.module);
    stream.state.destroyed.store(true, Ordering::Release);
    shared.see(Seen::Destroyed { stream: id });
    for pending in shared.take_callouts(Owner::Stream(id)) {
        shared.see(Seen::Cancelled {
            owner: pending.owner,
            id: pending.id,
        });
    }
    shared.held_by_streams(stream.state.config, |streams| {
        *streams = streams.saturating_sub(1)
    });
}

/// A stream's filter as a hook of it is lent it.
struct FilterHandle<'a> {
    shared: &'a Arc<Shared>,
    state: &'a Arc<StreamState>,
}

impl FilterHandle<'_> {
    /// Rule 5 and the handle's contract: only on the stream's thread, only while it lives.
    fn usable(&self, what: &str) -> bool {
        let stream = self.state.id;
        if on() != On::Worker(self.state.worker) {
            self.shared
                .violation(format!("stream {stream}: {what} on {:?}", on()));
            return false;
        }
        if self.state.destroyed.load(Ordering::Acquire) {
            self.shared
                .violation(format!("stream {stream}: {what} after its destroy"));
            return false;
        }
        true
    }
}

impl EnvoyFilter for FilterHandle<'_> {
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        if !self.usable("request_header") {
            return None;
        }
        self.state
            .request
            .iter()
            .find(|(held, _)| held == name)
            .map(|(_, value)| value.as_bytes().to_vec())
    }

    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        if !self.usable("response_header") {
            return None;
        }
        lock(&self.state.response)
            .iter()
            .find(|(held, _)| held == name)
            .map(|(_, value)| value.as_bytes().to_vec())
    }

    fn response_code(&self) -> Option<u16> {
        if !self.usable("response_code") {
            return None;
        }
        *lock(&self.state.recorded)
    }

    fn add_response_header(&self, name: &str, value: &str) -> bool {
        if !self.usable("add_response_header") {
            return false;
        }
        lock(&self.state.response).push((name.to_string(), value.to_string()));
        true
    }

    fn set_request_header(&self, name: &str, value: Option<&str>) -> bool {
        if !self.usable("set_request_header") {
            return false;
        }
        let mut edits = lock(&self.state.request_edits);
        edits.retain(|(held, _)| held != name);
        if let Some(value) = value {
            edits.push((name.to_string(), value.to_string()));
        }
        true
    }

    fn clear_route_cache(&self) {
        if self.usable("clear_route_cache") {
            self.shared.see(Seen::RouteCleared {
                stream: self.state.id,
            });
        }
    }

    fn source_address(&self) -> Option<Vec<u8>> {
        self.usable("source_address")
            .then(|| self.state.source.as_bytes().to_vec())
    }

    fn send_response(&self, status: u16, _headers: &[(&str, &str)], _body: &[u8]) {
        if !self.usable("send_response") {
            return;
        }
        let stream = self.state.id;
        if self.state.replied.swap(true, Ordering::AcqRel) {
            self.shared
                .violation(format!("stream {stream}: a second local reply"));
        }
        self.state.stopped.store(false, Ordering::Release);
        self.shared.see(Seen::Reply { stream, status });
        // Rule 7: the reply completes the stream, which ends inside this call.
        end_stream(self.shared, stream);
    }

    fn callout(&self, callout: &Callout) -> Result<CalloutId, CalloutRefused> {
        if !self.usable("callout") {
            return Err(CalloutRefused::CannotCreateRequest);
        }
        self.shared.callout(
            Owner::Stream(self.state.id),
            &self.state.next_callout,
            callout,
        )
    }

    fn continue_decoding(&self) {
        if !self.usable("continue_decoding") {
            return;
        }
        let stream = self.state.id;
        if !self.state.stopped.swap(false, Ordering::AcqRel) {
            self.shared.see(Seen::ContinueIgnored { stream });
            return;
        }
        self.shared.see(Seen::Continue { stream });
        if !self.state.stopped_all.swap(false, Ordering::AcqRel) {
            return;
        }
        // Rule 11: the filter gets what was held back from it, inside this call: its body
        // (in one chunk, the last unless trailers came), then its trailers.
        let held = std::mem::take(&mut *lock(&self.state.held_back));
        let Some((module, state)) = stream_of(stream) else {
            return;
        };
        if let Some(body) = held.body {
            let end_of_stream = state.request_ended.load(Ordering::Acquire) && !held.trailers;
            body_hook(self.shared, &module, &state, body, end_of_stream);
        }
        if held.trailers && !state.destroyed.load(Ordering::Acquire) {
            trailers_hook(self.shared, &module, &state);
        }
    }

    fn read_request_body(&self, read: &mut dyn FnMut(&[&[u8]])) {
        if !self.usable("read_request_body") {
            read(&[]);
            return;
        }
        let stream = self.state.id;
        let Some(chunk) = lock(&self.state.request_chunk).clone() else {
            self.shared.violation(format!(
                "stream {stream}: request body read outside its body hook"
            ));
            read(&[]);
            return;
        };
        self.shared.see(Seen::RequestBodyRead { stream });
        let slices: Vec<&[u8]> = chunk.iter().map(Vec::as_slice).collect();
        read(&slices);
    }

    fn read_response_body(&self, read: &mut dyn FnMut(&[&[u8]])) {
        if !self.usable("read_response_body") {
            read(&[]);
            return;
        }
        let stream = self.state.id;
        let Some(chunk) = lock(&self.state.chunk).clone() else {
            self.shared.violation(format!(
                "stream {stream}: response body read outside its body hook"
            ));
            read(&[]);
            return;
        };
        self.shared.see(Seen::BodyRead { stream });
        let slices: Vec<&[u8]> = chunk.iter().map(Vec::as_slice).collect();
        read(&slices);
    }

    fn new_scheduler(&self) -> Option<Box<dyn StreamScheduler>> {
        if !self.usable("scheduler_new") {
            return None;
        }
        self.shared.stream_schedulers.fetch_add(1, Ordering::AcqRel);
        self.state.schedulers.fetch_add(1, Ordering::AcqRel);
        self.shared.see(Seen::SchedulerNew {
            stream: self.state.id,
        });
        Some(Box::new(FakeStreamScheduler {
            shared: Arc::clone(self.shared),
            state: Arc::clone(self.state),
            stream: self.state.id,
            worker: self.state.worker,
        }))
    }
}

/// Rule 4: posts to the stream's worker thread; dropped there if the stream is gone.
struct FakeStreamScheduler {
    shared: Arc<Shared>,
    state: Arc<StreamState>,
    stream: StreamId,
    worker: usize,
}

impl StreamScheduler for FakeStreamScheduler {
    fn commit(&self, event: u64) {
        let stream = self.stream;
        self.shared.see(Seen::Commit {
            stream,
            event,
            on: on(),
        });
        let shared = Arc::clone(&self.shared);
        self.shared.post(On::Worker(self.worker), move || {
            let Some((module, state)) = stream_of(stream) else {
                shared.see(Seen::Dropped { stream, event });
                return;
            };
            shared.see(Seen::Scheduled { stream, event });
            let handle = FilterHandle {
                shared: &shared,
                state: &state,
            };
            filter::scheduled(&module, &handle, event);
        });
    }
}

impl Drop for FakeStreamScheduler {
    fn drop(&mut self) {
        self.shared.stream_schedulers.fetch_sub(1, Ordering::AcqRel);
        self.state.schedulers.fetch_sub(1, Ordering::AcqRel);
        self.shared.see(Seen::SchedulerDeleted {
            stream: self.stream,
        });
    }
}

/// The configuration as the module is handed it.
struct ConfigHandle {
    shared: Arc<Shared>,
    state: Arc<ConfigState>,
}

impl ConfigHandle {
    fn on_main(&self, what: &str) -> bool {
        let main = on() == On::Main;
        if !main {
            self.shared.violation(format!(
                "configuration {}: {what} on {:?}",
                self.state.id,
                on()
            ));
        }
        main
    }

    fn set(&self, metric: usize, change: impl FnOnce(&mut u64)) -> bool {
        let mut metrics = lock(&self.state.metrics);
        match metrics.get_mut(metric) {
            Some(value) => {
                change(value);
                true
            }
            None => false,
        }
    }
}

impl EnvoyConfig for ConfigHandle {
    fn concurrency(&self) -> u32 {
        if !self.on_main("get_concurrency") {
            return 0;
        }
        u32::try_from(self.shared.workers.len()).unwrap_or(0)
    }

    fn define_metric(&self, _kind: MetricKind, name: &str) -> Option<usize> {
        if self.state.frozen.load(Ordering::Acquire) {
            self.shared.violation(format!(
                "configuration {}: metric {name} defined after creation",
                self.state.id
            ));
            return None;
        }
        let mut metrics = lock(&self.state.metrics);
        metrics.push(0);
        Some(metrics.len() - 1)
    }

    fn add_to_counter(&self, metric: usize, count: u64) -> bool {
        self.set(metric, |value| *value += count)
    }

    fn set_gauge(&self, metric: usize, value: u64) -> bool {
        self.set(metric, |held| *held = value)
    }

    fn callout(&self, callout: &Callout) -> Result<CalloutId, CalloutRefused> {
        if !self.on_main("callout") {
            return Err(CalloutRefused::CannotCreateRequest);
        }
        self.shared.callout(
            Owner::Config(self.state.id),
            &self.state.next_callout,
            callout,
        )
    }

    fn new_scheduler(&self) -> Option<Box<dyn ConfigScheduler>> {
        if !self.on_main("scheduler_new") {
            return None;
        }
        self.shared.config_schedulers.fetch_add(1, Ordering::AcqRel);
        Some(Box::new(FakeConfigScheduler {
            shared: Arc::clone(&self.shared),
            config: self.state.id,
        }))
    }
}

/// Rule 1: posts to the main thread; dropped there if the configuration is gone.
struct FakeConfigScheduler {
    shared: Arc<Shared>,
    config: ConfigId,
}

impl ConfigScheduler for FakeConfigScheduler {
    fn commit(&self, event: u64) {
        let config = self.config;
        self.shared.see(Seen::ConfigCommit {
            config,
            event,
            on: on(),
        });
        let shared = Arc::clone(&self.shared);
        self.shared
            .post(On::Main, move || match shared.module(config) {
                Some(module) => {
                    shared.see(Seen::ConfigScheduled { config, event });
                    filter::config_scheduled(&module, event);
                }
                None => shared.see(Seen::ConfigDropped { config, event }),
            });
    }
}

impl Drop for FakeConfigScheduler {
    fn drop(&mut self) {
        self.shared.config_schedulers.fetch_sub(1, Ordering::AcqRel);
        self.shared.see(Seen::ConfigSchedulerDeleted {
            config: self.config,
        });
    }
}
