//! The one module with `unsafe`: Envoy's dynamic-module ABI ("v0.2.0", Envoy 1.40), written
//! by hand for what Diana uses (see the crate's README for the source and why not the SDK).
//!
//! Two directions:
//!
//! - **Callbacks** (`envoy_dynamic_module_callback_*`, implemented by Envoy): declared in the
//!   `extern "C"` block and reached only through the safe wrappers below ([`FilterRef`],
//!   [`ConfigRef`], [`Scheduler`], [`ConfigScheduler`], [`concurrency`], [`log()`]).
//! - **Event hooks** (`envoy_dynamic_module_on_*`, exported here): turn Envoy's raw pointers
//!   into safe values (slices, the module's boxed objects) and call `crate::filter`.
//!
//! Audit invariants (each `unsafe` block names the one it relies on):
//!
//! 1. **Envoy pointers.** A `filter_envoy_ptr` is valid from `on_http_filter_new` until
//!    `on_http_filter_destroy` and is only used on the worker thread that owns the stream
//!    (`FilterRef` is neither `Send` nor `Sync`; `crate::filter` drops it at destroy). A
//!    `filter_config_envoy_ptr` is valid until `on_http_filter_config_destroy` and outlives
//!    every filter made from it (Envoy's filters hold the config); Envoy documents the
//!    config-level metric callbacks as callable outside any request. Config-level callouts
//!    ([`ConfigRef::callout`]) are made only on the main thread (from
//!    `on_http_filter_config_scheduled` and `on_http_filter_config_http_callout_done`, which
//!    Envoy runs there): Envoy keeps them in an unsynchronised table of the config and
//!    looks the cluster up in the calling thread's cluster manager.
//! 2. **Module pointers.** What `on_http_filter_config_new` / `on_http_filter_new` return
//!    is a `Box` leaked here and taken back exactly once, in the matching destroy hook;
//!    between the two Envoy hands the same pointer back unchanged.
//! 3. **Buffers.** A buffer Envoy passes in (or writes into a `Buf` we hand it) is valid
//!    for the duration of the hook or callback (`ptr` may be null when `len` is 0); what we
//!    pass to Envoy is borrowed from Rust values alive for the whole call, and Envoy copies
//!    it before returning.
//! 4. **Schedulers.** A stream's scheduler is created on the stream's thread, committed to
//!    only under its worker's lock (`filter::Slot`), and deleted exactly once, on the
//!    stream's thread, under that lock after it was removed from the worker's table. The
//!    configuration's scheduler is created in `on_http_filter_config_new` (main thread),
//!    committed to by the timer thread under the timer's lock and by the configuration's
//!    own hooks (filter hooks and configuration hooks, which want the tick at once), and
//!    deleted exactly once in `on_http_filter_config_destroy`, after it was removed from
//!    the timer's table under that lock. Envoy runs no hook of a configuration after, or
//!    during, its destroy: every filter holds the configuration, and a configuration event
//!    runs only if its weak reference still locks. Envoy documents
//!    `commit` of both as safe from any thread (a no-op once the filter or configuration is
//!    gone: each holds a weak reference).
//! 5. **No unwinding across the boundary.** Release builds abort on panic (workspace
//!    profile) and the workspace lints deny `unwrap`/`expect`/`panic`/indexing; the glue
//!    handles every `None` and every `RefCell` borrow with `try_borrow*`.
//!
//! (A worker moves between threads whole: `diana_core::worker::Worker` is `Send` by the
//! compiler's word, holding no shared pointer; nothing here vouches for it.)

#![allow(unsafe_code)]

use crate::filter::{self, Config, FilterBox, RawAnswer};
use std::ffi::{c_char, c_void};
use std::ptr;
use std::sync::Arc;

/// The ABI version this module is written against, as Envoy 1.40 reports its own (Envoy
/// logs "Dynamic module ABI version v0.2.0 matched." when they are equal).
pub const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// `envoy_dynamic_module_type_{envoy,module}_buffer`: both are `{const char* ptr; size_t length;}`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Buf {
    ptr: *const c_char,
    len: usize,
}

impl Buf {
    fn of(bytes: &[u8]) -> Buf {
        Buf {
            ptr: bytes.as_ptr().cast(),
            len: bytes.len(),
        }
    }

    const EMPTY: Buf = Buf {
        ptr: ptr::null(),
        len: 0,
    };

    /// The bytes Envoy handed over (invariant 3).
    fn bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.len == 0 {
            return &[];
        }
        // SAFETY: invariant 3 — Envoy's buffer, valid and `len` bytes long for this hook.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), self.len) }
    }
}

/// `envoy_dynamic_module_type_{envoy,module}_http_header`: `{key_ptr, key_length, value_ptr,
/// value_length}` in both directions.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Header {
    key_ptr: *const c_char,
    key_len: usize,
    value_ptr: *const c_char,
    value_len: usize,
}

impl Header {
    fn of(key: &[u8], value: &[u8]) -> Header {
        Header {
            key_ptr: key.as_ptr().cast(),
            key_len: key.len(),
            value_ptr: value.as_ptr().cast(),
            value_len: value.len(),
        }
    }
}

// Enumerations (C `enum`s are `int`), with the values Diana uses.
const HEADER_REQUEST: i32 = 0; // envoy_dynamic_module_type_http_header_type_RequestHeader
const HEADER_RESPONSE: i32 = 2; // ..._ResponseHeader
const ATTRIBUTE_SOURCE_ADDRESS: i32 = 24; // envoy_dynamic_module_type_attribute_id_SourceAddress
const CALLOUT_INIT_SUCCESS: i32 = 0; // envoy_dynamic_module_type_http_callout_init_result_Success
const CALLOUT_RESULT_SUCCESS: i32 = 0; // envoy_dynamic_module_type_http_callout_result_Success
const METRICS_SUCCESS: i32 = 0; // envoy_dynamic_module_type_metrics_result_Success
/// `..._on_http_filter_{request,response}_headers_status_Continue`, and the body and
/// trailers statuses' `Continue`.
pub const CONTINUE: i32 = 0;
/// `..._headers_status_StopAllIterationAndWatermark`: what proxy-wasm's `Pause` is in Envoy
/// (the body is held, within the connection's buffer limits, until resumed).
pub const STOP_ALL_AND_WATERMARK: i32 = 4;

/// Why a callout was not started (`envoy_dynamic_module_type_http_callout_init_result`).
pub fn callout_init_name(result: i32) -> &'static str {
    match result {
        1 => "MissingRequiredHeaders",
        2 => "ClusterNotFound",
        3 => "DuplicateCalloutId",
        4 => "CannotCreateRequest",
        _ => "Unknown",
    }
}

extern "C" {
    fn envoy_dynamic_module_callback_log(level: i32, message: Buf);
    fn envoy_dynamic_module_callback_log_enabled(level: i32) -> bool;

    fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: *mut c_void,
        name: Buf,
        label_names: *mut Buf,
        label_names_length: usize,
        id: *mut usize,
    ) -> i32;
    fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: *mut c_void,
        name: Buf,
        label_names: *mut Buf,
        label_names_length: usize,
        id: *mut usize,
    ) -> i32;
    fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: *mut c_void,
        id: usize,
        label_values: *mut Buf,
        label_values_length: usize,
        value: u64,
    ) -> i32;
    fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config: *mut c_void,
        id: usize,
        label_values: *mut Buf,
        label_values_length: usize,
        value: u64,
    ) -> i32;

    fn envoy_dynamic_module_callback_http_get_header(
        filter: *mut c_void,
        header_type: i32,
        key: Buf,
        result: *mut Buf,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_add_header(
        filter: *mut c_void,
        header_type: i32,
        key: Buf,
        value: Buf,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(
        filter: *mut c_void,
        header_type: i32,
        key: Buf,
        value: Buf,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_send_response(
        filter: *mut c_void,
        status_code: u32,
        headers: *mut Header,
        headers_size: usize,
        body: Buf,
        details: Buf,
    );
    fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: *mut c_void,
        attribute_id: i32,
        result: *mut Buf,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_filter_http_callout(
        filter: *mut c_void,
        callout_id_out: *mut u64,
        cluster_name: Buf,
        headers: *mut Header,
        headers_size: usize,
        body: Buf,
        timeout_milliseconds: u64,
    ) -> i32;
    fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_scheduler_new(filter: *mut c_void) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
        scheduler: *mut c_void,
        event_id: u64,
    );
    fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: *mut c_void);

    fn envoy_dynamic_module_callback_get_concurrency() -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        config: *mut c_void,
    ) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler: *mut c_void,
        event_id: u64,
    );
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: *mut c_void,
        callout_id_out: *mut u64,
        cluster_name: Buf,
        headers: *mut Header,
        headers_size: usize,
        body: Buf,
        timeout_milliseconds: u64,
    ) -> i32;
}

/// Envoy's worker threads (`--concurrency`); only on the main thread (Envoy answers 0
/// elsewhere, and before its server context exists).
pub fn concurrency() -> u32 {
    // SAFETY: no arguments; called from `on_http_filter_config_new`, on the main thread.
    unsafe { envoy_dynamic_module_callback_get_concurrency() }
}

/// `envoy_dynamic_module_type_log_level`: Trace 0 … Critical 5.
pub fn log(level: log::Level, message: &str) {
    let level = match level {
        log::Level::Trace => 0,
        log::Level::Debug => 1,
        log::Level::Info => 2,
        log::Level::Warn => 3,
        log::Level::Error => 4,
    };
    // SAFETY: invariant 3 — `message` outlives the call; logging is thread-safe in Envoy.
    unsafe {
        if envoy_dynamic_module_callback_log_enabled(level) {
            envoy_dynamic_module_callback_log(level, Buf::of(message.as_bytes()));
        }
    }
}

/// Envoy's filter configuration (`filter_config_envoy_ptr`), kept as an address so the
/// process-wide [`Config`] can be shared by the worker threads (invariant 1: valid while
/// the config lives, and the config-level metric callbacks may be called from any thread).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigRef(usize);

impl ConfigRef {
    fn ptr(self) -> *mut c_void {
        self.0 as *mut c_void
    }

    /// Defines a counter (`gauge`: a gauge) — only during `on_http_filter_config_new`,
    /// after which Envoy freezes metric creation.
    pub fn define(self, gauge: bool, name: &str) -> Option<usize> {
        let mut id = 0usize;
        // SAFETY: invariant 1 (called from on_http_filter_config_new) and 3.
        let result = unsafe {
            if gauge {
                envoy_dynamic_module_callback_http_filter_config_define_gauge(
                    self.ptr(),
                    Buf::of(name.as_bytes()),
                    ptr::null_mut(),
                    0,
                    &mut id,
                )
            } else {
                envoy_dynamic_module_callback_http_filter_config_define_counter(
                    self.ptr(),
                    Buf::of(name.as_bytes()),
                    ptr::null_mut(),
                    0,
                    &mut id,
                )
            }
        };
        (result == METRICS_SUCCESS).then_some(id)
    }

    pub fn add_to_counter(self, id: usize, count: u64) -> bool {
        // SAFETY: invariant 1.
        let result = unsafe {
            envoy_dynamic_module_callback_http_filter_config_increment_counter(
                self.ptr(),
                id,
                ptr::null_mut(),
                0,
                count,
            )
        };
        result == METRICS_SUCCESS
    }

    pub fn set_gauge(self, id: usize, value: u64) -> bool {
        // SAFETY: invariant 1.
        let result = unsafe {
            envoy_dynamic_module_callback_http_filter_config_set_gauge(
                self.ptr(),
                id,
                ptr::null_mut(),
                0,
                value,
            )
        };
        result == METRICS_SUCCESS
    }

    /// The configuration's scheduler: posts events to `on_http_filter_config_scheduled` on
    /// the main thread, from any thread (invariant 4).
    pub fn scheduler(self) -> Option<ConfigScheduler> {
        // SAFETY: invariant 1 (called from on_http_filter_config_new).
        let scheduler =
            unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_new(self.ptr()) };
        (!scheduler.is_null()).then_some(ConfigScheduler(scheduler as usize))
    }

    /// Starts a one-shot callout of the configuration, bound to no stream; its answer comes
    /// to `on_http_filter_config_http_callout_done` on the main thread with the returned
    /// id. Only on the main thread (invariant 1).
    pub fn callout(
        self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u64, i32> {
        start_callout(
            cluster,
            headers,
            body,
            |id, cluster, headers, count, body| {
                // SAFETY: invariants 1 (main thread, config alive) and 3 (Envoy copies headers
                // and body into its message).
                unsafe {
                    envoy_dynamic_module_callback_http_filter_config_http_callout(
                        self.ptr(),
                        id,
                        cluster,
                        headers,
                        count,
                        body,
                        timeout_ms,
                    )
                }
            },
        )
    }
}

/// What both callouts hand Envoy, built once: the cluster, the header array and the body,
/// borrowed for the one `send` call that starts the callout (Envoy copies them into its
/// message before it returns, invariant 3). Envoy's callout id, or its init result.
fn start_callout(
    cluster: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    send: impl FnOnce(&mut u64, Buf, *mut Header, usize, Buf) -> i32,
) -> Result<u64, i32> {
    let mut headers: Vec<Header> = headers
        .iter()
        .map(|(name, value)| Header::of(name.as_bytes(), value.as_bytes()))
        .collect();
    let body = if body.is_empty() {
        Buf::EMPTY
    } else {
        Buf::of(body)
    };
    let mut id = 0u64;
    let result = send(
        &mut id,
        Buf::of(cluster.as_bytes()),
        headers.as_mut_ptr(),
        headers.len(),
        body,
    );
    if result == CALLOUT_INIT_SUCCESS {
        Ok(id)
    } else {
        Err(result)
    }
}

/// One stream's filter in Envoy (`filter_envoy_ptr`): used only on its worker thread while
/// it lives (invariant 1; the raw pointer keeps this type `!Send`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FilterRef(*mut c_void);

impl FilterRef {
    fn header(self, kind: i32, name: &str) -> Option<Vec<u8>> {
        let mut value = Buf::EMPTY;
        // SAFETY: invariants 1 and 3 (the value is copied before the hook returns).
        let found = unsafe {
            envoy_dynamic_module_callback_http_get_header(
                self.0,
                kind,
                Buf::of(name.as_bytes()),
                &mut value,
                0,
                ptr::null_mut(),
            )
        };
        (found && !value.ptr.is_null()).then(|| value.bytes().to_vec())
    }

    pub fn request_header(self, name: &str) -> Option<Vec<u8>> {
        self.header(HEADER_REQUEST, name)
    }

    pub fn response_header(self, name: &str) -> Option<Vec<u8>> {
        self.header(HEADER_RESPONSE, name)
    }

    pub fn add_response_header(self, name: &str, value: &str) -> bool {
        // SAFETY: invariants 1 and 3.
        unsafe {
            envoy_dynamic_module_callback_http_add_header(
                self.0,
                HEADER_RESPONSE,
                Buf::of(name.as_bytes()),
                Buf::of(value.as_bytes()),
            )
        }
    }

    /// Sets a request header to `value`, replacing every value it had; `None` removes it
    /// (Envoy takes a null value pointer for a removal: `Buf::EMPTY`'s).
    pub fn set_request_header(self, name: &str, value: Option<&str>) -> bool {
        let value = value.map_or(Buf::EMPTY, |value| Buf::of(value.as_bytes()));
        // SAFETY: invariants 1 and 3.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(
                self.0,
                HEADER_REQUEST,
                Buf::of(name.as_bytes()),
                value,
            )
        }
    }

    /// `source.address` (`ip:port` for an IP peer).
    pub fn source_address(self) -> Option<Vec<u8>> {
        let mut value = Buf::EMPTY;
        // SAFETY: invariants 1 and 3.
        let found = unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_string(
                self.0,
                ATTRIBUTE_SOURCE_ADDRESS,
                &mut value,
            )
        };
        found.then(|| value.bytes().to_vec())
    }

    pub fn send_response(self, status: u16, headers: &[(&str, &str)], body: &[u8]) {
        let mut headers: Vec<Header> = headers
            .iter()
            .map(|(name, value)| Header::of(name.as_bytes(), value.as_bytes()))
            .collect();
        // SAFETY: invariants 1 and 3 (`headers` and `body` live through the call).
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.0,
                u32::from(status),
                headers.as_mut_ptr(),
                headers.len(),
                Buf::of(body),
                Buf::of(b"diana_rate_limited"),
            );
        }
    }

    /// Starts a one-shot callout; its answer comes to `on_http_filter_http_callout_done` of
    /// this filter with the returned id (Envoy cancels it if the filter goes first).
    pub fn callout(
        self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u64, i32> {
        start_callout(
            cluster,
            headers,
            body,
            |id, cluster, headers, count, body| {
                // SAFETY: invariants 1 and 3 (Envoy copies headers and body into its message).
                unsafe {
                    envoy_dynamic_module_callback_http_filter_http_callout(
                        self.0, id, cluster, headers, count, body, timeout_ms,
                    )
                }
            },
        )
    }

    pub fn continue_decoding(self) {
        // SAFETY: invariant 1.
        unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(self.0) }
    }

    /// A scheduler that posts events to this filter on its worker thread (invariant 4).
    pub fn scheduler(self) -> Option<Scheduler> {
        // SAFETY: invariant 1.
        let scheduler = unsafe { envoy_dynamic_module_callback_http_filter_scheduler_new(self.0) };
        (!scheduler.is_null()).then_some(Scheduler(scheduler as usize))
    }
}

/// A stream's scheduler, kept as an address so the main thread can commit to it under the
/// stream's worker lock (invariant 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Scheduler(usize);

impl Scheduler {
    /// Posts `event` to the filter's worker thread (a no-op once the filter is gone).
    pub fn commit(self, event: u64) {
        // SAFETY: invariant 4 — not yet deleted (callers hold the worker's lock, under
        // which it is deleted); commit is thread-safe.
        unsafe {
            envoy_dynamic_module_callback_http_filter_scheduler_commit(self.0 as *mut c_void, event)
        }
    }

    /// Deletes it; called once, on the filter's thread, under the worker's lock after the
    /// worker's table forgot it.
    pub fn delete(self) {
        // SAFETY: invariant 4.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_delete(self.0 as *mut c_void) }
    }
}

/// The configuration's scheduler, kept as an address so the timer thread can commit to it
/// (invariant 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigScheduler(usize);

impl ConfigScheduler {
    /// Posts `event` to the main thread (a no-op once the configuration is gone).
    pub fn commit(self, event: u64) {
        // SAFETY: invariant 4 — not yet deleted (the timer commits under its lock, and it
        // is deleted only after it left the timer's table under that lock; the
        // configuration's hooks commit only while it lives).
        unsafe {
            envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                self.0 as *mut c_void,
                event,
            )
        }
    }

    /// Deletes it; called once, after the timer's table forgot it.
    pub fn delete(self) {
        // SAFETY: invariant 4.
        unsafe {
            envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.0 as *mut c_void)
        }
    }
}

// ------------------------------------------------------------------------------------
// Event hooks.
// ------------------------------------------------------------------------------------

/// The boxed module object behind a module pointer (invariant 2).
fn module<'a, T>(ptr: *const c_void) -> Option<&'a T> {
    // SAFETY: invariant 2 — a pointer we leaked from a `Box<T>` of this very type, not yet
    // taken back.
    unsafe { ptr.cast::<T>().as_ref() }
}

fn headers_of<'a>(headers: *const Header, size: usize) -> Vec<(&'a [u8], &'a [u8])> {
    if headers.is_null() || size == 0 {
        return Vec::new();
    }
    // SAFETY: invariant 3 — Envoy's array of `size` headers, valid during the hook.
    let headers = unsafe { std::slice::from_raw_parts(headers, size) };
    headers
        .iter()
        .map(|header| {
            (
                Buf {
                    ptr: header.key_ptr,
                    len: header.key_len,
                }
                .bytes(),
                Buf {
                    ptr: header.value_ptr,
                    len: header.value_len,
                }
                .bytes(),
            )
        })
        .collect()
}

fn chunks_of<'a>(chunks: *const Buf, size: usize) -> Vec<&'a [u8]> {
    if chunks.is_null() || size == 0 {
        return Vec::new();
    }
    // SAFETY: invariant 3.
    let chunks = unsafe { std::slice::from_raw_parts(chunks, size) };
    chunks.iter().map(|chunk| chunk.bytes()).collect()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    crate::logger::init();
    ABI_VERSION.as_ptr().cast()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy_ptr: *mut c_void,
    _name: Buf,
    config: Buf,
) -> *const c_void {
    match filter::config_new(ConfigRef(config_envoy_ptr as usize), config.bytes()) {
        Some(config) => Box::into_raw(Box::new(config)).cast_const().cast(),
        None => ptr::null(),
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(
    config_module_ptr: *const c_void,
) {
    if config_module_ptr.is_null() {
        return;
    }
    // SAFETY: invariant 2 — taken back once, here.
    let config = unsafe { Box::from_raw(config_module_ptr.cast::<Arc<Config>>().cast_mut()) };
    filter::config_destroy(&config);
}

/// Runs on the main thread: the timer's tick of this configuration's workers.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _config_envoy_ptr: *mut c_void,
    config_module_ptr: *const c_void,
    event_id: u64,
) {
    if let Some(config) = module::<Arc<Config>>(config_module_ptr) {
        filter::config_scheduled(config, event_id);
    }
}

/// Runs on the main thread: the answer to a call the main thread made for a worker.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _config_envoy_ptr: *mut c_void,
    config_module_ptr: *const c_void,
    callout_id: u64,
    result: i32,
    headers: *const Header,
    headers_size: usize,
    body_chunks: *const Buf,
    body_chunks_size: usize,
) {
    let Some(config) = module::<Arc<Config>>(config_module_ptr) else {
        return;
    };
    let answer = RawAnswer {
        answered: result == CALLOUT_RESULT_SUCCESS && !headers.is_null() && headers_size > 0,
        headers: headers_of(headers, headers_size),
        body: chunks_of(body_chunks, body_chunks_size),
    };
    filter::config_callout_done(config, callout_id, &answer);
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config_module_ptr: *const c_void,
    _filter_envoy_ptr: *mut c_void,
) -> *const c_void {
    let Some(config) = module::<Arc<Config>>(config_module_ptr) else {
        return ptr::null();
    };
    match filter::filter_new(config) {
        Some(filter) => Box::into_raw(Box::new(filter)).cast_const().cast(),
        None => ptr::null(),
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    filter_envoy_ptr: *mut c_void,
    filter_module_ptr: *const c_void,
    _end_of_stream: bool,
) -> i32 {
    match module::<FilterBox>(filter_module_ptr) {
        Some(filter) => filter::request_headers(filter, FilterRef(filter_envoy_ptr)),
        None => CONTINUE,
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
    _end_of_stream: bool,
) -> i32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
) -> i32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    filter_envoy_ptr: *mut c_void,
    filter_module_ptr: *const c_void,
    _end_of_stream: bool,
) -> i32 {
    match module::<FilterBox>(filter_module_ptr) {
        Some(filter) => filter::response_headers(filter, FilterRef(filter_envoy_ptr)),
        None => CONTINUE,
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
    _end_of_stream: bool,
) -> i32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
) -> i32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(filter_module_ptr: *const c_void) {
    if filter_module_ptr.is_null() {
        return;
    }
    // SAFETY: invariant 2 — taken back once, here.
    let filter = unsafe { Box::from_raw(filter_module_ptr.cast::<FilterBox>().cast_mut()) };
    filter::destroy(*filter);
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    filter_envoy_ptr: *mut c_void,
    filter_module_ptr: *const c_void,
    callout_id: u64,
    result: i32,
    headers: *const Header,
    headers_size: usize,
    body_chunks: *const Buf,
    body_chunks_size: usize,
) {
    let Some(filter) = module::<FilterBox>(filter_module_ptr) else {
        return;
    };
    let answer = RawAnswer {
        answered: result == CALLOUT_RESULT_SUCCESS && !headers.is_null() && headers_size > 0,
        headers: headers_of(headers, headers_size),
        body: chunks_of(body_chunks, body_chunks_size),
    };
    filter::callout_done(filter, FilterRef(filter_envoy_ptr), callout_id, &answer);
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    filter_envoy_ptr: *mut c_void,
    filter_module_ptr: *const c_void,
    event_id: u64,
) {
    if let Some(filter) = module::<FilterBox>(filter_module_ptr) {
        filter::scheduled(filter, FilterRef(filter_envoy_ptr), event_id);
    }
}

// Hooks Envoy resolves for every HTTP filter module, which Diana does not use (it starts
// no streamed callouts and is not a terminal filter). The configuration's streamed-callout
// hooks are optional in Envoy and not exported.

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
    _stream_id: u64,
    _headers: *const Header,
    _headers_size: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
    _stream_id: u64,
    _data: *const Buf,
    _data_count: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
    _stream_id: u64,
    _trailers: *const Header,
    _trailers_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
    _stream_id: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
    _stream_id: u64,
    _reason: i32,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
) {
}
