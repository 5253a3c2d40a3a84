//! An Envoy dynamic module whose HTTP filter does nothing: the floor of the native module's
//! overhead (`bench/overhead.py`, variant "empty native module"). The hook signatures are
//! those `crates/diana-envoy-native/src/ffi.rs` declares from Envoy 1.40's `abi.h`; no
//! hook reads its pointers, so nothing here is `unsafe`. The configuration and every
//! stream get the same static, non-null module pointer (Envoy takes null as a failure).

use std::ffi::{c_char, c_void};

/// The ABI version Envoy 1.40 checks `on_program_init`'s answer against.
static ABI_VERSION: &[u8] = b"v0.2.0\0";
/// What the configuration and every stream point to.
static NOTHING: u8 = 0;
/// `envoy_dynamic_module_type_on_http_filter_*_status_Continue`.
const CONTINUE: i32 = 0;

/// Envoy's `envoy_dynamic_module_type_buffer_envoy_ptr`: a pointer and a length.
#[repr(C)]
pub struct Buf {
    ptr: *const c_char,
    len: usize,
}

fn nothing() -> *const c_void {
    std::ptr::addr_of!(NOTHING).cast()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    ABI_VERSION.as_ptr().cast()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _config_envoy_ptr: *mut c_void,
    _name: Buf,
    _config: Buf,
) -> *const c_void {
    nothing()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(_config_module_ptr: *const c_void) {}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    _config_module_ptr: *const c_void,
    _filter_envoy_ptr: *mut c_void,
) -> *const c_void {
    nothing()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
    _end_of_stream: bool,
) -> i32 {
    CONTINUE
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
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
    _end_of_stream: bool,
) -> i32 {
    CONTINUE
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
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(_filter_module_ptr: *const c_void) {}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
    _callout_id: u64,
    _result: i32,
    _headers: *const c_void,
    _headers_size: usize,
    _body_chunks: *const Buf,
    _body_chunks_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
    _event_id: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _filter_envoy_ptr: *mut c_void,
    _filter_module_ptr: *const c_void,
    _stream_id: u64,
    _headers: *const c_void,
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
    _trailers: *const c_void,
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
