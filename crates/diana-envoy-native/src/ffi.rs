//! The one module with `unsafe`: Envoy's dynamic-module ABI ("v0.2.0", Envoy 1.40), written
//! by hand for what Diana uses (see the crate's README for the source and why not the SDK).
//!
//! Two directions:
//!
//! - **Callbacks** (`envoy_dynamic_module_callback_*`, implemented by Envoy): declared in the
//!   `extern "C"` block and reached only through the handles below, which implement
//!   `crate::envoy`'s traits ([`FilterRef`]: `EnvoyFilter`, [`ConfigRef`]: `EnvoyConfig`,
//!   the two schedulers), and [`log()`].
//! - **Event hooks** (`envoy_dynamic_module_on_*`, exported here): turn Envoy's raw pointers
//!   into safe values (slices borrowed for the hook, the module's objects, the handles) and
//!   call `crate::filter`.
//!
//! Audit invariants (each `unsafe` block names the one it relies on):
//!
//! 1. **Envoy pointers.** A `filter_envoy_ptr` is valid during the hook it comes with and
//!    used only there, on the stream's worker thread: its [`FilterRef`] lives in the hook's
//!    frame and is lent to `crate::filter` as `&dyn EnvoyFilter`, which cannot keep it (the
//!    raw pointer also keeps it `!Send`). A `filter_config_envoy_ptr` is valid until
//!    `on_http_filter_config_destroy`, after which no hook of the configuration runs
//!    (every filter holds the configuration, and a configuration event runs only while its
//!    weak reference still locks), so nothing reaches its [`ConfigRef`] any more. Envoy
//!    documents the config-level metric callbacks as callable from any thread; its
//!    callouts and scheduler are created only on the main thread (`EnvoyConfig`'s
//!    contract: `crate::filter` calls them from `on_http_filter_config_new`,
//!    `on_http_filter_config_scheduled` and `on_http_filter_config_http_callout_done`, which
//!    Envoy runs there), since Envoy keeps the callouts in an unsynchronised table of the
//!    configuration and looks the cluster up in the calling thread's cluster manager. So
//!    [`ConfigRef`] is `Send` and `Sync`.
//! 2. **Module pointers.** What `on_http_filter_config_new` returns is a `Box<Arc<Config>>`
//!    leaked here and taken back once, in `on_http_filter_config_destroy`; its hooks borrow
//!    it for their call only ([`with_config`]). What `on_http_filter_new` returns is an
//!    `Rc<FilterBox>` leaked here: Envoy's reference, taken back once in
//!    `on_http_filter_destroy`. Every other hook of the stream holds its own reference for
//!    its call ([`filter_of`]), so a destroy that Envoy runs inside one of that hook's
//!    callbacks (a local reply that ends the stream) frees nothing under it. All on the
//!    stream's worker thread, where Envoy runs every hook of a stream.
//! 3. **Buffers.** A buffer Envoy passes to a hook is valid for the hook (`ptr` may be
//!    null when `len` is 0): the hooks' parameters carry the hook's lifetime ([`Buf`],
//!    [`Header`]), so what is read from them borrows the hook and cannot be kept beyond it
//!    (see [`Buf`]'s second example). A buffer Envoy writes into ours (a header's value) is
//!    copied, or read in place, before the callback's caller returns and before any other
//!    call to Envoy (only a call to Envoy changes its header map). What we pass to Envoy is borrowed from
//!    Rust values alive for the whole call, and Envoy copies it before returning.
//! 4. **Schedulers.** Each is owned by one handle ([`StreamSchedulerRef`],
//!    [`ConfigSchedulerRef`]) made from a non-null `*_scheduler_new` and deleted exactly
//!    once, when the handle is dropped, so never committed to after. Envoy's commit only
//!    posts to a dispatcher (a stream's worker thread, or the main thread) with a weak
//!    reference to the filter or configuration, and delete destroys that weak reference:
//!    both are safe from any thread, so the handles are `Send` and `Sync`.
//! 5. **No unwinding across the boundary.** Release builds abort on panic (workspace
//!    profile) and the workspace lints deny `unwrap`/`expect`/`panic`/indexing; the glue
//!    handles every `None` and every `RefCell` borrow with `try_borrow*`.
//!
//! 6. **Response body chunks.** During `on_http_filter_response_body`, Envoy 1.40 points the
//!    filter's "received response body" at the chunk it is forwarding and clears it when the
//!    hook returns (`DynamicModuleHttpFilter::encodeData`: `current_response_body_ = &chunk`,
//!    the hook, `= nullptr`); `get_body_chunks` writes that buffer's slices (pointer and
//!    length into Envoy's memory, `getRawSlices`) into an array of ours that
//!    `get_body_chunks_size`, asked just before on the same thread, counted. They stay valid
//!    until the hook returns, as the module changes no body (it calls no body setter) and
//!    nothing else runs on the thread meanwhile. The slices are lent to the reader of
//!    `EnvoyFilter::read_response_body` only for its call (it takes them for any lifetime,
//!    so it cannot keep them), and it is called only from the response-body hook.
//! 7. **Request body chunks.** Likewise during `on_http_filter_request_body`: Envoy 1.40
//!    points the filter's "received request body" at the chunk it hands the hook and clears
//!    it when the hook returns (`DynamicModuleHttpFilter::decodeData`: `current_request_body_
//!    = &chunk`, the hook, `= nullptr`; in the installed binary, the store to and clear of the
//!    field `get_body_chunks_size`'s case 0 reads, around the call of the hook). Envoy buffers
//!    the chunk only after the hook returns (`StopIterationAndBuffer`), so the slices stay
//!    valid until then: the module changes no body, and they are read before any command
//!    of the hook is carried out (a local reply, a header edit), inside the worker's event.
//!    They are lent to the reader of `EnvoyFilter::read_request_body` only for its call, and
//!    it is called only from the request-body hook.
//!
//! (A worker moves between threads whole: `diana_core::worker::Worker` is `Send` by the
//! compiler's word, holding no shared pointer; nothing here vouches for it.)

#![allow(unsafe_code)]

use crate::envoy::{
    BodyStatus, CalloutId, CalloutRefused, ConfigScheduler, EnvoyConfig, EnvoyFilter,
    HeadersStatus, RawAnswer, StreamScheduler, TrailersStatus,
};
use crate::filter::{self, Config, FilterBox};
use diana_core::call::Callout;
use diana_core::worker::MetricKind;
use std::ffi::{c_char, c_void};
use std::marker::PhantomData;
use std::ptr::{self, NonNull};
use std::rc::Rc;
use std::sync::Arc;

/// The ABI version this module is written against, as Envoy 1.40 reports its own (Envoy
/// logs "Dynamic module ABI version v0.2.0 matched." when they are equal).
pub const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// `envoy_dynamic_module_type_{envoy,module}_buffer`: both are `{const char* ptr; size_t
/// length;}`. `'hook`: how long the bytes stay valid (invariant 3) — for one Envoy hands a
/// hook, that hook's call.
///
/// Reading a buffer within its hook:
///
/// ```
/// use diana_envoy_native::Buf;
///
/// extern "C" fn on_config(config: Buf<'_>) -> usize {
///     config.bytes().len()
/// }
/// # let _ = on_config;
/// ```
///
/// Keeping what was read beyond the hook does not compile (the bytes borrow the hook):
///
/// ```compile_fail,E0521
/// use diana_envoy_native::Buf;
/// use std::sync::Mutex;
///
/// static KEPT: Mutex<Vec<&'static [u8]>> = Mutex::new(Vec::new());
///
/// extern "C" fn on_config(config: Buf<'_>) {
///     if let Ok(mut kept) = KEPT.lock() {
///         kept.push(config.bytes());
///     }
/// }
/// # let _ = on_config;
/// ```
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Buf<'hook> {
    ptr: *const c_char,
    len: usize,
    bytes: PhantomData<&'hook [u8]>,
}

impl<'hook> Buf<'hook> {
    fn of(bytes: &'hook [u8]) -> Buf<'hook> {
        Buf {
            ptr: bytes.as_ptr().cast(),
            len: bytes.len(),
            bytes: PhantomData,
        }
    }

    /// No bytes, for Envoy to write a buffer into.
    fn empty() -> Buf<'hook> {
        Buf {
            ptr: ptr::null(),
            len: 0,
            bytes: PhantomData,
        }
    }

    /// The bytes, borrowed for as long as the buffer is valid (invariant 3).
    pub fn bytes(self) -> &'hook [u8] {
        if self.ptr.is_null() || self.len == 0 {
            return &[];
        }
        // SAFETY: invariant 3 — Envoy's buffer, valid and `len` bytes long for `'hook`, or
        // ours, borrowed for it.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), self.len) }
    }
}

/// `envoy_dynamic_module_type_{envoy,module}_http_header`: `{key_ptr, key_length, value_ptr,
/// value_length}` in both directions, valid for `'hook` as a [`Buf`] is.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Header<'hook> {
    key_ptr: *const c_char,
    key_len: usize,
    value_ptr: *const c_char,
    value_len: usize,
    bytes: PhantomData<&'hook [u8]>,
}

impl<'hook> Header<'hook> {
    fn of(key: &'hook [u8], value: &'hook [u8]) -> Header<'hook> {
        Header {
            key_ptr: key.as_ptr().cast(),
            key_len: key.len(),
            value_ptr: value.as_ptr().cast(),
            value_len: value.len(),
            bytes: PhantomData,
        }
    }

    fn name(self) -> &'hook [u8] {
        Buf {
            ptr: self.key_ptr,
            len: self.key_len,
            bytes: PhantomData,
        }
        .bytes()
    }

    fn value(self) -> &'hook [u8] {
        Buf {
            ptr: self.value_ptr,
            len: self.value_len,
            bytes: PhantomData,
        }
        .bytes()
    }
}

// Enumerations (C `enum`s are `int`), with the values Diana uses.
const HEADER_REQUEST: i32 = 0; // envoy_dynamic_module_type_http_header_type_RequestHeader
const HEADER_RESPONSE: i32 = 2; // ..._ResponseHeader
/// `envoy_dynamic_module_type_http_body_type_ReceivedResponseBody`: the chunk the
/// response-body hook is forwarding. The enum is `{ReceivedRequestBody, BufferedRequestBody,
/// ReceivedResponseBody, BufferedResponseBody}` in abi.h, and in the 1.40 binary the callbacks'
/// case 2 reads the filter's own pointer (`current_response_body_`), case 3 asks the encoder
/// callbacks for their buffer (`encodingBuffer()`).
const BODY_RECEIVED_RESPONSE: i32 = 2;
/// `envoy_dynamic_module_type_http_body_type_ReceivedRequestBody`: the chunk the request-body
/// hook is forwarding (in the 1.40 binary, case 0 reads the filter's own pointer,
/// `current_request_body_`; case 1, `BufferedRequestBody`, the decoder callbacks'
/// `decodingBuffer()`).
const BODY_RECEIVED_REQUEST: i32 = 0;
const ATTRIBUTE_SOURCE_ADDRESS: i32 = 24; // envoy_dynamic_module_type_attribute_id_SourceAddress
/// `envoy_dynamic_module_type_attribute_id_ResponseCode` (`response.code`: the 16th of the
/// enum, 9 before `SourceAddress`); in the 1.40 binary, the stream info's `responseCode()`,
/// false while unset.
const ATTRIBUTE_RESPONSE_CODE: i32 = 15;
const CALLOUT_INIT_SUCCESS: i32 = 0; // envoy_dynamic_module_type_http_callout_init_result_Success
const CALLOUT_RESULT_SUCCESS: i32 = 0; // envoy_dynamic_module_type_http_callout_result_Success
const METRICS_SUCCESS: i32 = 0; // envoy_dynamic_module_type_metrics_result_Success
/// `..._on_http_filter_{request,response}_headers_status_Continue`, and the body and
/// trailers statuses' `Continue`.
const CONTINUE: i32 = 0;
/// `envoy_dynamic_module_type_on_http_filter_request_headers_status_StopIteration` (abi.h:
/// `{Continue, StopIteration, ContinueAndDontEndStream, StopAllIterationAndBuffer,
/// StopAllIterationAndWatermark}`, Envoy's `FilterHeadersStatus`, which the 1.40 binary's
/// `decodeHeaders` returns as the hook answered it).
const HEADERS_STOP_ITERATION: i32 = 1;
/// `..._headers_status_StopAllIterationAndWatermark`.
const STOP_ALL_AND_WATERMARK: i32 = 4;
/// `envoy_dynamic_module_type_on_http_filter_request_body_status_StopIterationAndBuffer`
/// (abi.h: `{Continue, StopIterationAndBuffer, StopIterationAndWatermark,
/// StopIterationNoBuffer}`, Envoy's `FilterDataStatus`).
const BODY_STOP_ITERATION_AND_BUFFER: i32 = 1;
/// `envoy_dynamic_module_type_on_http_filter_request_trailers_status_StopIteration` (abi.h:
/// `{Continue, StopIteration}`, Envoy's `FilterTrailersStatus`).
const TRAILERS_STOP_ITERATION: i32 = 1;

/// Why a callout was not started (`envoy_dynamic_module_type_http_callout_init_result`).
fn callout_refused(result: i32) -> CalloutRefused {
    match result {
        1 => CalloutRefused::MissingRequiredHeaders,
        2 => CalloutRefused::ClusterNotFound,
        3 => CalloutRefused::DuplicateCalloutId,
        4 => CalloutRefused::CannotCreateRequest,
        _ => CalloutRefused::Unknown,
    }
}

fn headers_status(status: HeadersStatus) -> i32 {
    match status {
        HeadersStatus::Continue => CONTINUE,
        HeadersStatus::StopIteration => HEADERS_STOP_ITERATION,
        HeadersStatus::StopAllAndWatermark => STOP_ALL_AND_WATERMARK,
    }
}

fn body_status(status: BodyStatus) -> i32 {
    match status {
        BodyStatus::Continue => CONTINUE,
        BodyStatus::StopIterationAndBuffer => BODY_STOP_ITERATION_AND_BUFFER,
    }
}

fn trailers_status(status: TrailersStatus) -> i32 {
    match status {
        TrailersStatus::Continue => CONTINUE,
        TrailersStatus::StopIteration => TRAILERS_STOP_ITERATION,
    }
}

extern "C" {
    fn envoy_dynamic_module_callback_log(level: i32, message: Buf<'_>);
    fn envoy_dynamic_module_callback_log_enabled(level: i32) -> bool;

    fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: *mut c_void,
        name: Buf<'_>,
        label_names: *mut Buf<'_>,
        label_names_length: usize,
        id: *mut usize,
    ) -> i32;
    fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: *mut c_void,
        name: Buf<'_>,
        label_names: *mut Buf<'_>,
        label_names_length: usize,
        id: *mut usize,
    ) -> i32;
    fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: *mut c_void,
        id: usize,
        label_values: *mut Buf<'_>,
        label_values_length: usize,
        value: u64,
    ) -> i32;
    fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config: *mut c_void,
        id: usize,
        label_values: *mut Buf<'_>,
        label_values_length: usize,
        value: u64,
    ) -> i32;

    fn envoy_dynamic_module_callback_http_get_header(
        filter: *mut c_void,
        header_type: i32,
        key: Buf<'_>,
        result: *mut Buf<'_>,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_add_header(
        filter: *mut c_void,
        header_type: i32,
        key: Buf<'_>,
        value: Buf<'_>,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(
        filter: *mut c_void,
        header_type: i32,
        key: Buf<'_>,
        value: Buf<'_>,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_clear_route_cache(filter: *mut c_void);
    fn envoy_dynamic_module_callback_http_send_response(
        filter: *mut c_void,
        status_code: u32,
        headers: *mut Header<'_>,
        headers_size: usize,
        body: Buf<'_>,
        details: Buf<'_>,
    );
    fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: *mut c_void,
        attribute_id: i32,
        result: *mut Buf<'_>,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_filter_get_attribute_int(
        filter: *mut c_void,
        attribute_id: i32,
        result: *mut u64,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_filter_http_callout(
        filter: *mut c_void,
        callout_id_out: *mut u64,
        cluster_name: Buf<'_>,
        headers: *mut Header<'_>,
        headers_size: usize,
        body: Buf<'_>,
        timeout_milliseconds: u64,
    ) -> i32;
    fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: *mut c_void);

    // The request and response bodies (invariants 7 and 6). abi.h, identical in ABI v0.1.0
    // (envoyproxy/envoy 0199da4a, main before the 1.40 bump) and v0.2.0 (ElvinEfendi/envoy
    // 159515c7, after it), section "HTTP Request/Response body callbacks":
    //
    //   size_t envoy_dynamic_module_callback_http_get_body_chunks_size(
    //       envoy_dynamic_module_type_http_filter_envoy_ptr filter_envoy_ptr,
    //       envoy_dynamic_module_type_http_body_type body_type);
    //   bool envoy_dynamic_module_callback_http_get_body_chunks(
    //       envoy_dynamic_module_type_http_filter_envoy_ptr filter_envoy_ptr,
    //       envoy_dynamic_module_type_http_body_type body_type,
    //       envoy_dynamic_module_type_envoy_buffer* result_buffer_vector);
    //
    // "the number of buffers in the body. 0 if the body is not available or empty";
    // "PRECONDITION: The module must ensure that the result_buffer_vector is valid and has
    // enough length to store all the buffers"; "The lifetime of the buffer is guaranteed
    // until the end of the current event hook unless the setter callback is called"; "The
    // received body could only be available during the request/response body event hooks".
    // The installed 1.40 binary exports both; its `..._chunks_size` reads only `rdi`/`esi`
    // and returns the slice count in `rax` (no out-parameter, as in some older SDKs).
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter: *mut c_void,
        body_type: i32,
    ) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: *mut c_void,
        body_type: i32,
        result_buffer_vector: *mut Buf<'_>,
    ) -> bool;
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
        cluster_name: Buf<'_>,
        headers: *mut Header<'_>,
        headers_size: usize,
        body: Buf<'_>,
        timeout_milliseconds: u64,
    ) -> i32;
}

/// `envoy_dynamic_module_type_log_level`: Trace 0 … Critical 5. The logger's writer.
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

/// Envoy's filter configuration (`filter_config_envoy_ptr`), shared by the threads
/// (invariant 1).
pub struct ConfigRef(NonNull<c_void>);

// SAFETY: invariant 1 — valid until the configuration's destroy, after which nothing
// reaches it; its metric callbacks are thread-safe, and its callouts and scheduler are made
// on the main thread only.
unsafe impl Send for ConfigRef {}
// SAFETY: as for `Send`.
unsafe impl Sync for ConfigRef {}

impl EnvoyConfig for ConfigRef {
    fn concurrency(&self) -> u32 {
        // SAFETY: no arguments; called from `on_http_filter_config_new`, on the main thread
        // (Envoy answers 0 elsewhere).
        unsafe { envoy_dynamic_module_callback_get_concurrency() }
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<usize> {
        let mut id = 0usize;
        let name = Buf::of(name.as_bytes());
        let config = self.0.as_ptr();
        // SAFETY: invariants 1 (called from on_http_filter_config_new) and 3.
        let result = unsafe {
            match kind {
                MetricKind::Gauge => envoy_dynamic_module_callback_http_filter_config_define_gauge(
                    config,
                    name,
                    ptr::null_mut(),
                    0,
                    &mut id,
                ),
                MetricKind::Counter => {
                    envoy_dynamic_module_callback_http_filter_config_define_counter(
                        config,
                        name,
                        ptr::null_mut(),
                        0,
                        &mut id,
                    )
                }
            }
        };
        (result == METRICS_SUCCESS).then_some(id)
    }

    fn add_to_counter(&self, metric: usize, count: u64) -> bool {
        // SAFETY: invariant 1.
        let result = unsafe {
            envoy_dynamic_module_callback_http_filter_config_increment_counter(
                self.0.as_ptr(),
                metric,
                ptr::null_mut(),
                0,
                count,
            )
        };
        result == METRICS_SUCCESS
    }

    fn set_gauge(&self, metric: usize, value: u64) -> bool {
        // SAFETY: invariant 1.
        let result = unsafe {
            envoy_dynamic_module_callback_http_filter_config_set_gauge(
                self.0.as_ptr(),
                metric,
                ptr::null_mut(),
                0,
                value,
            )
        };
        result == METRICS_SUCCESS
    }

    fn callout(&self, callout: &Callout) -> Result<CalloutId, CalloutRefused> {
        // SAFETY: invariant 1 — the configuration lives, and `crate::filter` calls this on
        // the main thread only.
        unsafe {
            start_callout(
                envoy_dynamic_module_callback_http_filter_config_http_callout,
                self.0.as_ptr(),
                callout,
            )
        }
    }

    fn new_scheduler(&self) -> Option<Box<dyn ConfigScheduler>> {
        // SAFETY: invariant 1 (called from on_http_filter_config_new, on the main thread).
        let scheduler = unsafe {
            envoy_dynamic_module_callback_http_filter_config_scheduler_new(self.0.as_ptr())
        };
        NonNull::new(scheduler)
            .map(|scheduler| Box::new(ConfigSchedulerRef(scheduler)) as Box<dyn ConfigScheduler>)
    }
}

/// `envoy_dynamic_module_callback_http_filter_http_callout` and its configuration's twin,
/// which take the same arguments after their owner (a stream's filter, or the
/// configuration).
type SendCallout = unsafe extern "C" fn(
    *mut c_void,
    *mut u64,
    Buf<'_>,
    *mut Header<'_>,
    usize,
    Buf<'_>,
    u64,
) -> i32;

/// Starts a callout of `owner` with `send`: the cluster, the header array and the body are
/// borrowed for the call (Envoy copies them into its message before it returns). Envoy's
/// callout id, or why it refused.
///
/// # Safety
///
/// `owner` is valid for `send` and this runs where `send` may be called for it (invariant 1).
unsafe fn start_callout(
    send: SendCallout,
    owner: *mut c_void,
    callout: &Callout,
) -> Result<CalloutId, CalloutRefused> {
    let mut headers: Vec<Header<'_>> = callout
        .headers
        .iter()
        .map(|(name, value)| Header::of(name.as_bytes(), value.as_bytes()))
        .collect();
    let body = if callout.body.is_empty() {
        Buf::empty()
    } else {
        Buf::of(&callout.body)
    };
    let mut id = 0u64;
    // SAFETY: the caller's word for `owner` (invariant 1); invariant 3 for what we pass.
    let result = unsafe {
        send(
            owner,
            &mut id,
            Buf::of(callout.upstream.as_bytes()),
            headers.as_mut_ptr(),
            headers.len(),
            body,
            callout.timeout_ms,
        )
    };
    if result == CALLOUT_INIT_SUCCESS {
        Ok(id)
    } else {
        Err(callout_refused(result))
    }
}

/// One stream's filter in Envoy (`filter_envoy_ptr`), for the hook it came with
/// (invariant 1; the raw pointer keeps this type `!Send`).
pub struct FilterRef(*mut c_void);

impl FilterRef {
    fn header(&self, kind: i32, name: &str) -> Option<Vec<u8>> {
        self.read_header(kind, name, |value| value.map(<[u8]>::to_vec))
    }

    /// A header's first value, lent to `read` where Envoy holds it: `read` returns before
    /// any other call to Envoy, which alone could change the header map (invariant 3).
    fn read_header<T>(&self, kind: i32, name: &str, read: impl FnOnce(Option<&[u8]>) -> T) -> T {
        let mut value = Buf::empty();
        // SAFETY: invariants 1 and 3 (the value is read before any other call to Envoy).
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
        read((found && !value.ptr.is_null()).then(|| value.bytes()))
    }

    /// Lends `read` the slices of the body `body_type` names, as Envoy holds them.
    ///
    /// # Safety
    ///
    /// Called only from the body hook whose chunk `body_type` names (invariants 6 and 7:
    /// `BODY_RECEIVED_RESPONSE` from the response-body hook, `BODY_RECEIVED_REQUEST` from the
    /// request-body hook), so the chunk stays as Envoy counts it until `read` returns.
    unsafe fn read_body(&self, body_type: i32, read: &mut dyn FnMut(&[&[u8]])) {
        // SAFETY: invariant 1, and the caller's word (invariants 6 and 7).
        let count =
            unsafe { envoy_dynamic_module_callback_http_get_body_chunks_size(self.0, body_type) };
        if count == 0 {
            read(&[]);
            return;
        }
        let mut chunks = vec![Buf::empty(); count];
        // SAFETY: invariants 1, 6 and 7 — `chunks` has room for the `count` slices Envoy just
        // counted, and the chunk has not changed since.
        let available = unsafe {
            envoy_dynamic_module_callback_http_get_body_chunks(
                self.0,
                body_type,
                chunks.as_mut_ptr(),
            )
        };
        if !available {
            read(&[]);
            return;
        }
        // Borrowed for `read`'s call only (invariants 6 and 7).
        let slices: Vec<&[u8]> = chunks.iter().map(|chunk| chunk.bytes()).collect();
        read(&slices);
    }
}

impl EnvoyFilter for FilterRef {
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        self.header(HEADER_REQUEST, name)
    }

    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        self.header(HEADER_RESPONSE, name)
    }

    fn read_response_header(&self, name: &str, read: &mut dyn FnMut(Option<&[u8]>)) {
        self.read_header(HEADER_RESPONSE, name, read);
    }

    fn add_response_header(&self, name: &str, value: &str) -> bool {
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

    fn set_request_header(&self, name: &str, value: Option<&str>) -> bool {
        // Envoy takes a null value pointer (`Buf::empty`'s) for a removal.
        let value = value.map_or(Buf::empty(), |value| Buf::of(value.as_bytes()));
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

    fn clear_route_cache(&self) {
        // SAFETY: invariant 1.
        unsafe { envoy_dynamic_module_callback_http_clear_route_cache(self.0) }
    }

    fn response_code(&self) -> Option<u16> {
        let mut code = 0u64;
        // SAFETY: invariant 1; `code` outlives the call.
        let found = unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_int(
                self.0,
                ATTRIBUTE_RESPONSE_CODE,
                &mut code,
            )
        };
        found
            .then(|| u16::try_from(code).ok())
            .flatten()
            .filter(|&code| code > 0)
    }

    fn source_address(&self) -> Option<Vec<u8>> {
        let mut value = Buf::empty();
        // SAFETY: invariants 1 and 3 (the value is copied at once).
        let found = unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_string(
                self.0,
                ATTRIBUTE_SOURCE_ADDRESS,
                &mut value,
            )
        };
        found.then(|| value.bytes().to_vec())
    }

    fn send_response(&self, status: u16, headers: &[(&str, &str)], body: &[u8]) {
        let mut headers: Vec<Header<'_>> = headers
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

    fn callout(&self, callout: &Callout) -> Result<CalloutId, CalloutRefused> {
        // SAFETY: invariant 1 — during a hook of the stream, on its thread.
        unsafe {
            start_callout(
                envoy_dynamic_module_callback_http_filter_http_callout,
                self.0,
                callout,
            )
        }
    }

    fn continue_decoding(&self) {
        // SAFETY: invariant 1.
        unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(self.0) }
    }

    fn new_scheduler(&self) -> Option<Box<dyn StreamScheduler>> {
        // SAFETY: invariant 1.
        let scheduler = unsafe { envoy_dynamic_module_callback_http_filter_scheduler_new(self.0) };
        NonNull::new(scheduler)
            .map(|scheduler| Box::new(StreamSchedulerRef(scheduler)) as Box<dyn StreamScheduler>)
    }

    fn read_request_body(&self, read: &mut dyn FnMut(&[&[u8]])) {
        // SAFETY: invariant 7 — only the request-body hook calls this.
        unsafe { self.read_body(BODY_RECEIVED_REQUEST, read) }
    }

    fn read_response_body(&self, read: &mut dyn FnMut(&[&[u8]])) {
        // SAFETY: invariant 6 — only the response-body hook calls this.
        unsafe { self.read_body(BODY_RECEIVED_RESPONSE, read) }
    }
}

/// A stream's scheduler, owned (invariant 4).
pub struct StreamSchedulerRef(NonNull<c_void>);

// SAFETY: invariant 4 — commit and delete are thread-safe in Envoy.
unsafe impl Send for StreamSchedulerRef {}
// SAFETY: invariant 4.
unsafe impl Sync for StreamSchedulerRef {}

impl StreamScheduler for StreamSchedulerRef {
    fn commit(&self, event: u64) {
        // SAFETY: invariant 4 — not yet deleted (that is its drop).
        unsafe {
            envoy_dynamic_module_callback_http_filter_scheduler_commit(self.0.as_ptr(), event)
        }
    }
}

impl Drop for StreamSchedulerRef {
    fn drop(&mut self) {
        // SAFETY: invariant 4 — deleted once, here.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_delete(self.0.as_ptr()) }
    }
}

/// The configuration's scheduler, owned (invariant 4).
pub struct ConfigSchedulerRef(NonNull<c_void>);

// SAFETY: invariant 4 — commit and delete are thread-safe in Envoy.
unsafe impl Send for ConfigSchedulerRef {}
// SAFETY: invariant 4.
unsafe impl Sync for ConfigSchedulerRef {}

impl ConfigScheduler for ConfigSchedulerRef {
    fn commit(&self, event: u64) {
        // SAFETY: invariant 4 — not yet deleted (that is its drop).
        unsafe {
            envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                self.0.as_ptr(),
                event,
            )
        }
    }
}

impl Drop for ConfigSchedulerRef {
    fn drop(&mut self) {
        // SAFETY: invariant 4 — deleted once, here.
        unsafe {
            envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.0.as_ptr())
        }
    }
}

// ------------------------------------------------------------------------------------
// Event hooks.
// ------------------------------------------------------------------------------------

/// The configuration behind a module pointer, lent to `f` for the hook's call (invariant 2).
fn with_config<R>(ptr: *const c_void, f: impl FnOnce(&Arc<Config>) -> R) -> Option<R> {
    // SAFETY: invariant 2 — a pointer we leaked from a `Box<Arc<Config>>`, not yet taken
    // back (Envoy runs no hook of the configuration during or after its destroy).
    let config = unsafe { ptr.cast::<Arc<Config>>().as_ref() }?;
    Some(f(config))
}

/// The stream's module object behind a module pointer: a reference of the hook's own
/// (invariant 2).
fn filter_of(ptr: *const c_void) -> Option<Rc<FilterBox>> {
    let ptr = ptr.cast::<FilterBox>();
    if ptr.is_null() {
        return None;
    }
    // SAFETY: invariant 2 — from `Rc::into_raw` in on_http_filter_new, on this thread, and
    // Envoy's reference is not yet taken back (only its destroy hook does that), so the
    // count is at least 1 while we add ours.
    unsafe {
        Rc::increment_strong_count(ptr);
        Some(Rc::from_raw(ptr))
    }
}

/// A callout's answer as Envoy hands it to a hook (invariant 3: borrowed for the hook).
fn answer_of<'hook>(
    result: i32,
    headers: *const Header<'hook>,
    headers_size: usize,
    body_chunks: *const Buf<'hook>,
    body_chunks_size: usize,
) -> RawAnswer<'hook> {
    let headers: &[Header<'hook>] = if headers.is_null() || headers_size == 0 {
        &[]
    } else {
        // SAFETY: invariant 3 — Envoy's array of `headers_size` headers, valid during the hook.
        unsafe { std::slice::from_raw_parts(headers, headers_size) }
    };
    let chunks: &[Buf<'hook>] = if body_chunks.is_null() || body_chunks_size == 0 {
        &[]
    } else {
        // SAFETY: invariant 3.
        unsafe { std::slice::from_raw_parts(body_chunks, body_chunks_size) }
    };
    RawAnswer {
        answered: result == CALLOUT_RESULT_SUCCESS && !headers.is_empty(),
        headers: headers
            .iter()
            .map(|header| (header.name(), header.value()))
            .collect(),
        body: chunks.iter().map(|chunk| chunk.bytes()).collect(),
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    crate::logger::init(log);
    ABI_VERSION.as_ptr().cast()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy_ptr: *mut c_void,
    _name: Buf<'_>,
    config: Buf<'_>,
) -> *const c_void {
    let Some(envoy) = NonNull::new(config_envoy_ptr) else {
        return ptr::null();
    };
    match filter::config_new(
        Box::new(ConfigRef(envoy)),
        crate::host::store(),
        config.bytes(),
    ) {
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
    with_config(config_module_ptr, |config| {
        filter::config_scheduled(config, event_id)
    });
}

/// Runs on the main thread: the answer to a call the main thread made for a worker.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _config_envoy_ptr: *mut c_void,
    config_module_ptr: *const c_void,
    callout_id: u64,
    result: i32,
    headers: *const Header<'_>,
    headers_size: usize,
    body_chunks: *const Buf<'_>,
    body_chunks_size: usize,
) {
    let answer = answer_of(result, headers, headers_size, body_chunks, body_chunks_size);
    with_config(config_module_ptr, |config| {
        filter::config_callout_done(config, callout_id, &answer)
    });
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config_module_ptr: *const c_void,
    _filter_envoy_ptr: *mut c_void,
) -> *const c_void {
    match with_config(config_module_ptr, filter::filter_new).flatten() {
        Some(filter) => Rc::into_raw(Rc::new(filter)).cast(),
        None => ptr::null(),
    }
}

/// The request's headers (`end_of_stream`: no body follows). `Continue`,
/// `StopAllIterationAndWatermark` (paused: no body hook runs until it is resumed), or
/// `StopIteration` (held for its body, which comes to the body hooks).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    filter_envoy_ptr: *mut c_void,
    filter_module_ptr: *const c_void,
    end_of_stream: bool,
) -> i32 {
    match filter_of(filter_module_ptr) {
        Some(filter) => headers_status(filter::request_headers(
            &filter,
            &FilterRef(filter_envoy_ptr),
            end_of_stream,
        )),
        None => CONTINUE,
    }
}

/// A chunk of the request's body (`decodeData`). `Continue` (the chunk, and a request held
/// for its body with it, goes on), or `StopIterationAndBuffer` while the request is held
/// (Envoy buffers the chunk; a local reply was sent, or the request waits to be resumed).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    filter_envoy_ptr: *mut c_void,
    filter_module_ptr: *const c_void,
    end_of_stream: bool,
) -> i32 {
    match filter_of(filter_module_ptr) {
        Some(filter) => body_status(filter::request_body(
            &filter,
            &FilterRef(filter_envoy_ptr),
            end_of_stream,
        )),
        None => CONTINUE,
    }
}

/// The request's trailers: its body ended with the chunk before them. `Continue`, or
/// `StopIteration` while the request is held.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    filter_envoy_ptr: *mut c_void,
    filter_module_ptr: *const c_void,
) -> i32 {
    match filter_of(filter_module_ptr) {
        Some(filter) => trailers_status(filter::request_trailers(
            &filter,
            &FilterRef(filter_envoy_ptr),
        )),
        None => CONTINUE,
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    filter_envoy_ptr: *mut c_void,
    filter_module_ptr: *const c_void,
    end_of_stream: bool,
) -> i32 {
    if let Some(filter) = filter_of(filter_module_ptr) {
        filter::response_headers(&filter, &FilterRef(filter_envoy_ptr), end_of_stream);
    }
    CONTINUE
}

/// A chunk of the answer's body passes (`encodeData`). Always `Continue`
/// (`..._response_body_status_Continue`): the chunk is read where Envoy holds it, never
/// stopped, buffered or changed.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    filter_envoy_ptr: *mut c_void,
    filter_module_ptr: *const c_void,
    end_of_stream: bool,
) -> i32 {
    if let Some(filter) = filter_of(filter_module_ptr) {
        filter::response_body(&filter, &FilterRef(filter_envoy_ptr), end_of_stream);
    }
    CONTINUE
}

/// The answer's trailers: its body ended with the last chunk before them. Always
/// `Continue`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    filter_envoy_ptr: *mut c_void,
    filter_module_ptr: *const c_void,
) -> i32 {
    if let Some(filter) = filter_of(filter_module_ptr) {
        filter::response_trailers(&filter, &FilterRef(filter_envoy_ptr));
    }
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
    // SAFETY: invariant 2 — Envoy's reference, taken back once, here.
    let filter = unsafe { Rc::from_raw(filter_module_ptr.cast::<FilterBox>()) };
    filter::destroy(&filter);
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    filter_envoy_ptr: *mut c_void,
    filter_module_ptr: *const c_void,
    callout_id: u64,
    result: i32,
    headers: *const Header<'_>,
    headers_size: usize,
    body_chunks: *const Buf<'_>,
    body_chunks_size: usize,
) {
    let Some(filter) = filter_of(filter_module_ptr) else {
        return;
    };
    let answer = answer_of(result, headers, headers_size, body_chunks, body_chunks_size);
    filter::callout_done(&filter, &FilterRef(filter_envoy_ptr), callout_id, &answer);
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    filter_envoy_ptr: *mut c_void,
    filter_module_ptr: *const c_void,
    event_id: u64,
) {
    if let Some(filter) = filter_of(filter_module_ptr) {
        filter::scheduled(&filter, &FilterRef(filter_envoy_ptr), event_id);
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
    _headers: *const Header<'_>,
    _headers_size: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
    _stream_id: u64,
    _data: *const Buf<'_>,
    _data_count: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
    _stream_id: u64,
    _trailers: *const Header<'_>,
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

#[cfg(test)]
mod tests {
    use super::{callout_refused, ABI_VERSION};

    #[test]
    fn abi_version_is_a_c_string() {
        assert_eq!(ABI_VERSION, b"v0.2.0\0");
    }

    #[test]
    fn callout_failures_are_named() {
        assert_eq!(callout_refused(2).to_string(), "ClusterNotFound");
        assert_eq!(callout_refused(9).to_string(), "Unknown");
    }
}
