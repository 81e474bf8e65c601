//! The hooks Envoy calls (the 21 the ABI requires, and a configuration's round:
//! `config_scheduled`, `config_http_callout_done`), each handing its call to the filter or
//! configuration it names (a filter's through its `Slot`). A panic never crosses into Envoy (it
//! would abort the process): every hook catches it and logs it. A request hook that panics
//! answers its request with a 500, so that no governed request goes on ungoverned.

use super::abi::{self, EnvoyBuffer, EnvoyFilter, Header};
use super::filter::{Filter, Part};
use super::slot::Slot;
use super::{host, Shared};
use crate::core::api::error::ApiError;
use crate::core::api::headers;
use crate::core::api::reply::Reply;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

#[cfg(all(feature = "native", panic = "abort"))]
compile_error!("the native module catches panics at its hooks: build it with the `native` profile (`make native`)");

const PANICKED: &str = "holysheep: a panic was caught in a hook";

/// Runs `f`, or gives `fallback` when it panics (logged).
fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        host::log(abi::LOG_CRITICAL, PANICKED);
        fallback
    })
}

/// The slot behind Envoy's module pointer.
///
/// SAFETY: `ptr` is a pointer `on_http_filter_new` made, not yet freed (a slot is freed by
/// `destroy`, or by the hook it ran in: `release`).
unsafe fn slot<'a>(ptr: *const c_void) -> Option<&'a Slot> {
    (ptr as *const Slot).as_ref()
}

/// Frees the slot when Envoy destroyed its filter during the hook that just returned.
fn release(ptr: *const c_void) {
    // SAFETY: see `slot`; once orphaned, nothing refers to it any more.
    if unsafe { slot(ptr) }.is_some_and(Slot::orphaned) {
        drop(unsafe { Box::from_raw(ptr as *mut Slot) });
    }
}

/// A hook of the filter's slot that answers Envoy nothing: `f` under `guard`, then the
/// slot freed if Envoy destroyed its filter meanwhile (also after a panic, so that the
/// filter is wound up and dropped, its tail ended and its wake-ups closed).
fn slot_hook(ptr: *const c_void, f: impl FnOnce(&Slot)) {
    guard((), || {
        // SAFETY: see `slot`.
        if let Some(s) = unsafe { slot(ptr) } {
            f(s);
        }
    });
    release(ptr);
}

/// A request hook: the filter's status, or, when it panics, a 500 for the request (which
/// then goes no further).
fn request_hook(envoy: EnvoyFilter, ptr: *const c_void, f: impl FnOnce(&mut Filter) -> i32) -> i32 {
    // SAFETY: see `slot`.
    let Some(s) = (unsafe { slot(ptr) }) else { return abi::CONTINUE };
    let status = catch_unwind(AssertUnwindSafe(|| s.with(f))).unwrap_or_else(|_| {
        host::log(abi::LOG_CRITICAL, PANICKED);
        let e = ApiError::server("the edge failed on this request", "edge_failure");
        host::send(envoy, &Reply::error(&e), &[]);
        None
    });
    release(ptr);
    // Held while another hook of the filter runs (it answers the request).
    status.unwrap_or(abi::STOP_ITERATION)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const std::ffi::c_char {
    c"v0.2.0".as_ptr()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    envoy: *mut c_void,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    guard(std::ptr::null(), || match Shared::parse(&config.to_vec(), envoy) {
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
            let shared = unsafe { Box::from_raw(config as *mut Arc<Shared>) };
            // Its filters may outlive it; its round goes with it.
            shared.round.stop();
        }
    })
}

/// The configuration behind Envoy's module pointer.
///
/// SAFETY: `ptr` is a pointer `config_new` made, not yet destroyed.
unsafe fn shared<'a>(ptr: *const c_void) -> Option<&'a Arc<Shared>> {
    (ptr as *const Arc<Shared>).as_ref()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    envoy: abi::EnvoyConfig,
    config: *const c_void,
    event: u64,
) {
    guard((), || {
        // SAFETY: see `shared`: Envoy wakes a configuration only while it lives.
        if let (Some(shared), super::wake::ROUND) = (unsafe { shared(config) }, event) {
            shared.round.run(envoy, shared);
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    envoy: abi::EnvoyConfig,
    config: *const c_void,
    id: u64,
    result: i32,
    headers: *const Header,
    headers_len: usize,
    chunks: *const EnvoyBuffer,
    chunks_len: usize,
) {
    guard((), || {
        // SAFETY: see `shared`.
        let Some(shared) = (unsafe { shared(config) }) else { return };
        let answer = (result == abi::CALLOUT_OK).then(|| callout_answer(headers, headers_len, chunks, chunks_len));
        let answer = answer.and_then(|(headers, body)| Some((headers::status(&headers)?, body)));
        shared.round.answered(envoy, shared, id, answer);
    })
}

/// A callout's answer, copied: its headers and its body.
fn callout_answer(
    headers: *const Header,
    headers_len: usize,
    chunks: *const EnvoyBuffer,
    chunks_len: usize,
) -> (Vec<(String, String)>, Vec<u8>) {
    // SAFETY: Envoy's arrays of `*_len` entries, valid during this hook (copied here).
    let headers = match headers.is_null() {
        true => Vec::new(),
        false => host::header_pairs(unsafe { std::slice::from_raw_parts(headers, headers_len) }),
    };
    let mut body = Vec::new();
    if !chunks.is_null() {
        for chunk in unsafe { std::slice::from_raw_parts(chunks, chunks_len) } {
            body.extend_from_slice(&chunk.to_vec());
        }
    }
    (headers, body)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(config: *const c_void, envoy: EnvoyFilter) -> *const c_void {
    guard(std::ptr::null(), || {
        // SAFETY: see `shared`: alive while Envoy makes its filters.
        let Some(shared) = (unsafe { shared(config) }) else { return std::ptr::null() };
        Box::into_raw(Box::new(Slot::new(Filter::new(shared.clone(), envoy)))) as *const c_void
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: EnvoyFilter,
    ptr: *const c_void,
    end_of_stream: bool,
) -> i32 {
    request_hook(envoy, ptr, |f| f.on_request_headers(end_of_stream))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: EnvoyFilter,
    ptr: *const c_void,
    end_of_stream: bool,
) -> i32 {
    request_hook(envoy, ptr, |f| f.on_request_body(end_of_stream))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(envoy: EnvoyFilter, ptr: *const c_void) -> i32 {
    request_hook(envoy, ptr, Filter::on_request_trailers)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    _envoy: EnvoyFilter,
    ptr: *const c_void,
    _end_of_stream: bool,
) -> i32 {
    response_hook(ptr, Filter::on_response_headers)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    _envoy: EnvoyFilter,
    ptr: *const c_void,
    end_of_stream: bool,
) -> i32 {
    response_hook(ptr, |f| f.on_response_body(end_of_stream))
}

/// A response hook: the filter's status, or `CONTINUE` when it panics (the answer goes on
/// as it came) or when the filter never saw the request.
fn response_hook(ptr: *const c_void, f: impl FnOnce(&mut Filter) -> i32) -> i32 {
    let mut status = abi::CONTINUE;
    slot_hook(ptr, |s| status = s.with(f).unwrap_or(abi::CONTINUE));
    status
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _envoy: EnvoyFilter,
    _ptr: *const c_void,
) -> i32 {
    abi::CONTINUE
}

/// Nothing here: this hook may run inline while another hook of the same filter is on the
/// stack (from inside a local reply), so the filter is wound up in `destroy`, which Envoy
/// defers and never calls re-entrantly.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(_envoy: EnvoyFilter, _ptr: *const c_void) {}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(ptr: *const c_void) {
    guard((), || {
        // SAFETY: see `slot`. Freed here, or by the hook running now once it returns.
        if unsafe { slot(ptr) }.is_some_and(Slot::destroy) {
            drop(unsafe { Box::from_raw(ptr as *mut Slot) });
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
    slot_hook(ptr, |s| {
        let (headers, body) = callout_answer(headers, headers_len, chunks, chunks_len);
        s.callout_done(id, result, headers, body);
    })
}

/// Hands a part of a streaming callout's answer to its filter.
fn stream_part(ptr: *const c_void, id: u64, part: impl FnOnce() -> Part) {
    slot_hook(ptr, |s| s.stream(id, part()))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _envoy: EnvoyFilter,
    ptr: *const c_void,
    stream: u64,
    headers: *const Header,
    len: usize,
    end: bool,
) {
    stream_part(ptr, stream, || {
        // SAFETY: Envoy's array of `len` headers, valid during this hook (copied here).
        let headers = match headers.is_null() {
            true => Vec::new(),
            false => host::header_pairs(unsafe { std::slice::from_raw_parts(headers, len) }),
        };
        Part::Head(headers, end)
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _envoy: EnvoyFilter,
    ptr: *const c_void,
    stream: u64,
    data: *const EnvoyBuffer,
    count: usize,
    end: bool,
) {
    stream_part(ptr, stream, || {
        let mut bytes = Vec::new();
        if !data.is_null() {
            // SAFETY: Envoy's array of `count` slices of one read, valid during this hook.
            for chunk in unsafe { std::slice::from_raw_parts(data, count) } {
                bytes.extend_from_slice(&chunk.to_vec());
            }
        }
        Part::Data(bytes, end)
    })
}

/// Trailers end the answer (`complete` follows).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _envoy: EnvoyFilter,
    ptr: *const c_void,
    stream: u64,
    _trailers: *const Header,
    _len: usize,
) {
    stream_part(ptr, stream, || Part::End(true))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _envoy: EnvoyFilter,
    ptr: *const c_void,
    stream: u64,
) {
    stream_part(ptr, stream, || Part::End(true))
}

/// A reset ends the answer where it was (its reason says nothing in Envoy 1.40.0).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _envoy: EnvoyFilter,
    ptr: *const c_void,
    stream: u64,
    _reason: i32,
) {
    stream_part(ptr, stream, || Part::End(false))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(_envoy: EnvoyFilter, ptr: *const c_void, event: u64) {
    slot_hook(ptr, |s| s.scheduled(event))
}

/// Hands a watermark of the client's write buffer to the filter's slot (it may come from
/// inside a send of the filter's own).
fn pressure(ptr: *const c_void, above: bool) {
    slot_hook(ptr, |s| s.pressure(above))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _envoy: EnvoyFilter,
    ptr: *const c_void,
) {
    pressure(ptr, true)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _envoy: EnvoyFilter,
    ptr: *const c_void,
) {
    pressure(ptr, false)
}
