//! The hooks Envoy calls (all 21 the ABI requires), each handing its call to the filter or
//! configuration it names. A panic never crosses into Envoy (it would abort the process):
//! every hook catches it, logs it, and answers as a hook that did nothing would.

use super::abi::{self, EnvoyBuffer, EnvoyFilter, Header};
use super::filter::{self, Filter};
use super::{host, Shared};
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// Runs `f`, or gives `fallback` when it panics (logged).
fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        host::log(abi::LOG_CRITICAL, "holysheep: a panic was caught in a hook; the request goes on untouched");
        fallback
    })
}

/// The filter behind Envoy's module pointer.
///
/// SAFETY: `ptr` is a pointer `on_http_filter_new` made and `on_http_filter_destroy` has not
/// freed; Envoy calls a filter's hooks on its one worker, one at a time.
unsafe fn filter<'a>(ptr: *const c_void) -> Option<&'a mut Filter> {
    (ptr as *mut Filter).as_mut()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const std::ffi::c_char {
    c"v0.2.0".as_ptr()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _envoy: *mut c_void,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    guard(std::ptr::null(), || match Shared::parse(&config.to_vec()) {
        Ok(shared) => {
            host::note(shared.env.notes(&shared.config));
            Box::into_raw(Box::new(Arc::new(shared))) as *const c_void
        }
        Err(e) => {
            host::log(abi::LOG_CRITICAL, &format!("holysheep: invalid holysheep-edge configuration: {e}"));
            std::ptr::null()
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    guard((), || {
        if !config.is_null() {
            // SAFETY: made by `config_new` with `Box::into_raw`, freed once here.
            drop(unsafe { Box::from_raw(config as *mut Arc<Shared>) });
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(config: *const c_void, envoy: EnvoyFilter) -> *const c_void {
    guard(std::ptr::null(), || {
        // SAFETY: a configuration `config_new` made, alive while Envoy makes its filters.
        let Some(shared) = (unsafe { (config as *const Arc<Shared>).as_ref() }) else { return std::ptr::null() };
        Box::into_raw(Box::new(Filter::new(shared.clone(), envoy))) as *const c_void
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    _envoy: EnvoyFilter,
    ptr: *const c_void,
    end_of_stream: bool,
) -> i32 {
    // SAFETY: see `filter`.
    guard(abi::CONTINUE, || unsafe { filter(ptr) }.map_or(abi::CONTINUE, |f| f.on_request_headers(end_of_stream)))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    _envoy: EnvoyFilter,
    ptr: *const c_void,
    end_of_stream: bool,
) -> i32 {
    // SAFETY: see `filter`.
    guard(abi::CONTINUE, || unsafe { filter(ptr) }.map_or(abi::CONTINUE, |f| f.on_request_body(end_of_stream)))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(_envoy: EnvoyFilter, ptr: *const c_void) -> i32 {
    // SAFETY: see `filter`.
    guard(abi::CONTINUE, || unsafe { filter(ptr) }.map_or(abi::CONTINUE, |f| f.on_request_trailers()))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    _envoy: EnvoyFilter,
    _ptr: *const c_void,
    _end_of_stream: bool,
) -> i32 {
    abi::CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    _envoy: EnvoyFilter,
    _ptr: *const c_void,
    _end_of_stream: bool,
) -> i32 {
    abi::CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _envoy: EnvoyFilter,
    _ptr: *const c_void,
) -> i32 {
    abi::CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(_envoy: EnvoyFilter, ptr: *const c_void) {
    // SAFETY: see `filter`.
    guard((), || unsafe { filter(ptr) }.map_or((), Filter::on_done))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(ptr: *const c_void) {
    guard((), || {
        if !ptr.is_null() {
            // SAFETY: made by `on_http_filter_new` with `Box::into_raw`, freed once here.
            let mut f = unsafe { Box::from_raw(ptr as *mut Filter) };
            f.on_done();
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _envoy: EnvoyFilter,
    ptr: *const c_void,
    id: u64,
    result: i32,
    headers: *const Header,
    headers_len: usize,
    chunks: *const EnvoyBuffer,
    chunks_len: usize,
) {
    guard((), || {
        // SAFETY: Envoy's arrays of `*_len` entries, valid during this hook (copied here).
        let headers = match headers.is_null() {
            true => Vec::new(),
            false => filter::header_pairs(unsafe { std::slice::from_raw_parts(headers, headers_len) }),
        };
        let mut body = Vec::new();
        if !chunks.is_null() {
            for chunk in unsafe { std::slice::from_raw_parts(chunks, chunks_len) } {
                body.extend_from_slice(&chunk.to_vec());
            }
        }
        // SAFETY: see `filter`.
        if let Some(f) = unsafe { filter(ptr) } {
            f.on_callout_done(id, result, headers, body);
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _envoy: EnvoyFilter,
    _ptr: *const c_void,
    _stream: u64,
    _headers: *const Header,
    _len: usize,
    _end: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _envoy: EnvoyFilter,
    _ptr: *const c_void,
    _stream: u64,
    _data: *const EnvoyBuffer,
    _count: usize,
    _end: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _envoy: EnvoyFilter,
    _ptr: *const c_void,
    _stream: u64,
    _trailers: *const Header,
    _len: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _envoy: EnvoyFilter,
    _ptr: *const c_void,
    _stream: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _envoy: EnvoyFilter,
    _ptr: *const c_void,
    _stream: u64,
    _reason: i32,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(_envoy: EnvoyFilter, ptr: *const c_void, event: u64) {
    // SAFETY: see `filter`.
    guard((), || unsafe { filter(ptr) }.map_or((), |f| f.on_scheduled(event)))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _envoy: EnvoyFilter,
    _ptr: *const c_void,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _envoy: EnvoyFilter,
    _ptr: *const c_void,
) {
}
