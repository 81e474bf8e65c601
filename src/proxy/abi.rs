//! Envoy's imports (proxy-wasm ABI 0.2.1) as the shell calls them: every status comes back
//! as `Err(Status)`, so no host call can kill the VM.
//!
//! Imports return the raw `u32` (never a `Status`: an unknown value in the enum would be
//! undefined behaviour), mapped by `status`. Buffers the host hands back were allocated
//! through `proxy_on_memory_allocate` (`entry`: a boxed `[u8]` of exactly `size` bytes), so
//! a `Vec::from_raw_parts(data, size, size)` takes each one back.

use crate::core::wire::pairs;
use crate::proxy::types::{BufferType, Bytes, LogLevel, MapType, MetricType, Status};
use std::ptr::{null, null_mut};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const OK: u32 = 0;
const NOT_FOUND: u32 = 1;
const BAD_ARGUMENT: u32 = 2;
const SERIALIZATION_FAILURE: u32 = 3;
const PARSE_FAILURE: u32 = 4;
const EMPTY: u32 = 7;
const CAS_MISMATCH: u32 = 8;

/// The `Status` of a raw host result: InternalFailure (10) itself, and every value the
/// enum lacks (Envoy's BadExpression, InvalidMemoryAccess, ResultMismatch, BrokenConnection,
/// Unimplemented, anything newer), are `InternalFailure`.
fn status(raw: u32) -> Status {
    match raw {
        OK => Status::Ok,
        NOT_FOUND => Status::NotFound,
        BAD_ARGUMENT => Status::BadArgument,
        SERIALIZATION_FAILURE => Status::SerializationFailure,
        PARSE_FAILURE => Status::ParseFailure,
        EMPTY => Status::Empty,
        CAS_MISMATCH => Status::CasMismatch,
        _ => Status::InternalFailure,
    }
}

/// `Ok(())` for `OK`, else the status as an error.
fn done(raw: u32) -> Result<(), Status> {
    match raw {
        OK => Ok(()),
        other => Err(status(other)),
    }
}

/// Milliseconds for a `u32` host argument, saturating.
fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

/// Takes back a buffer the host allocated; `None` when it wrote a null pointer (an empty value).
///
/// # Safety
/// `data` is null or was returned by the host for this call with `size` bytes (allocated by
/// `proxy_on_memory_allocate(size)`), and is taken back once.
unsafe fn host_bytes(data: *mut u8, size: usize) -> Option<Bytes> {
    if data.is_null() {
        None
    } else {
        // SAFETY: per this function's contract: a `Box<[u8]>` of `size` bytes, owned by us now.
        Some(unsafe { Vec::from_raw_parts(data, size, size) })
    }
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: LogLevel, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_set_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        size: usize,
        buffer_data: *const u8,
        buffer_size: usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: MapType, key_data: *const u8, key_size: usize) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_set_property(path_data: *const u8, path_size: usize, value_data: *const u8, value_size: usize) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_register_shared_queue(name_data: *const u8, name_size: usize, return_id: *mut u32) -> u32;
    fn proxy_resolve_shared_queue(
        vm_id_data: *const u8,
        vm_id_size: usize,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_dequeue_shared_queue(queue_id: u32, return_value_data: *mut *mut u8, return_value_size: *mut usize)
        -> u32;
    fn proxy_enqueue_shared_queue(queue_id: u32, value_data: *const u8, value_size: usize) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_define_metric(metric_type: MetricType, name_data: *const u8, name_size: usize, return_id: *mut u32)
        -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
    #[allow(clippy::too_many_arguments)]
    fn proxy_http_call(
        upstream_data: *const u8,
        upstream_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        body_data: *const u8,
        body_size: usize,
        trailers_data: *const u8,
        trailers_size: usize,
        timeout_milliseconds: u32,
        return_token: *mut u32,
    ) -> u32;
}

/// The ABI's `StreamType::HttpRequest`, as the raw value the import takes.
const STREAM_HTTP_REQUEST: u32 = 0;

pub(crate) fn log(level: LogLevel, message: &str) -> Result<(), Status> {
    // SAFETY: the message slice is live for the call; the host copies it.
    done(unsafe { proxy_log(level, message.as_ptr(), message.len()) })
}

pub(crate) fn get_current_time() -> Result<SystemTime, Status> {
    let mut return_time: u64 = 0;
    // SAFETY: `return_time` is a live, writable u64 for the call.
    match unsafe { proxy_get_current_time_nanoseconds(&mut return_time) } {
        OK => UNIX_EPOCH.checked_add(Duration::from_nanos(return_time)).ok_or(Status::InternalFailure),
        other => Err(status(other)),
    }
}

pub(crate) fn set_tick_period(period: Duration) -> Result<(), Status> {
    // SAFETY: no pointers cross; a plain value call.
    done(unsafe { proxy_set_tick_period_milliseconds(millis(period)) })
}

/// `Ok(None)` when the buffer is absent (`NotFound`) or empty (the host writes no pointer).
pub(crate) fn get_buffer(buffer_type: BufferType, start: usize, max_size: usize) -> Result<Option<Bytes>, Status> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: the out-pointers are live locals; on `OK` the host wrote a buffer of `size`
    // bytes it allocated through `proxy_on_memory_allocate` (or null), taken back once.
    unsafe {
        match proxy_get_buffer_bytes(buffer_type, start, max_size, &mut data, &mut size) {
            OK => Ok(host_bytes(data, size)),
            NOT_FOUND => Ok(None),
            other => Err(status(other)),
        }
    }
}

pub(crate) fn set_buffer(buffer_type: BufferType, start: usize, size: usize, value: &[u8]) -> Result<(), Status> {
    // SAFETY: the value slice is live for the call; the host copies it.
    done(unsafe { proxy_set_buffer_bytes(buffer_type, start, size, value.as_ptr(), value.len()) })
}

/// `Ok(None)` when the header is absent, `Ok(Some(empty))` when its value is empty.
pub(crate) fn get_map_value_bytes(map_type: MapType, key: &str) -> Result<Option<Bytes>, Status> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: the key slice and out-pointers are live for the call; on `OK` the host wrote
    // a buffer it allocated through `proxy_on_memory_allocate` (or null), taken back once.
    unsafe {
        match proxy_get_header_map_value(map_type, key.as_ptr(), key.len(), &mut data, &mut size) {
            OK => Ok(Some(host_bytes(data, size).unwrap_or_default())),
            NOT_FOUND => Ok(None),
            other => Err(status(other)),
        }
    }
}

/// Replaces the header's value; `None` removes the header.
pub(crate) fn set_map_value(map_type: MapType, key: &str, value: Option<&str>) -> Result<(), Status> {
    // SAFETY: the key and value slices are live for the call; the host copies them.
    done(unsafe {
        match value {
            Some(value) => {
                proxy_replace_header_map_value(map_type, key.as_ptr(), key.len(), value.as_ptr(), value.len())
            }
            None => proxy_remove_header_map_value(map_type, key.as_ptr(), key.len()),
        }
    })
}

/// `Ok(None)` when the property is absent (`NotFound`) or empty (the host writes no pointer).
pub(crate) fn get_property(path: Vec<&str>) -> Result<Option<Bytes>, Status> {
    // The ABI's path layout: the parts joined by NULs, no trailing NUL; empty for no parts.
    let path = path.join("\0");
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: the path bytes and out-pointers are live for the call; on `OK` the host wrote
    // a buffer it allocated through `proxy_on_memory_allocate` (or null), taken back once.
    unsafe {
        match proxy_get_property(path.as_ptr(), path.len(), &mut data, &mut size) {
            OK => Ok(host_bytes(data, size)),
            NOT_FOUND => Ok(None),
            other => Err(status(other)),
        }
    }
}

/// Sets a property of the current stream (in Envoy, the filter state `wasm.<path>`).
pub(crate) fn set_property(path: &str, value: &[u8]) -> Result<(), Status> {
    // SAFETY: both slices are live for the call; nothing is handed back.
    done(unsafe { proxy_set_property(path.as_ptr(), path.len(), value.as_ptr(), value.len()) })
}

/// `(None, None)` for a missing key; `(None, cas)` for an empty value; a cas of 0 is `None`.
pub(crate) fn get_shared_data(key: &str) -> Result<(Option<Bytes>, Option<u32>), Status> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    let mut cas: u32 = 0;
    // SAFETY: the key slice and out-pointers are live for the call; on `OK` the host wrote
    // a buffer it allocated through `proxy_on_memory_allocate` (or null), taken back once.
    unsafe {
        match proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) {
            OK => Ok((host_bytes(data, size), Some(cas).filter(|&c| c != 0))),
            NOT_FOUND => Ok((None, None)),
            other => Err(status(other)),
        }
    }
}

/// `Err(CasMismatch)` when `cas` is stale; a `cas` of `None` writes unconditionally.
pub(crate) fn set_shared_data(key: &str, value: Option<&[u8]>, cas: Option<u32>) -> Result<(), Status> {
    // SAFETY: the key and value slices are live for the call (None: null, 0); the host copies them.
    done(unsafe {
        proxy_set_shared_data(
            key.as_ptr(),
            key.len(),
            value.map_or(null(), |v| v.as_ptr()),
            value.map_or(0, |v| v.len()),
            cas.unwrap_or(0),
        )
    })
}

pub(crate) fn register_shared_queue(name: &str) -> Result<u32, Status> {
    let mut id: u32 = 0;
    // SAFETY: the name slice and `id` are live for the call.
    match unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) } {
        OK => Ok(id),
        other => Err(status(other)),
    }
}

/// `Ok(None)` when no such queue is registered.
pub(crate) fn resolve_shared_queue(vm_id: &str, name: &str) -> Result<Option<u32>, Status> {
    let mut id: u32 = 0;
    // SAFETY: both slices and `id` are live for the call.
    match unsafe { proxy_resolve_shared_queue(vm_id.as_ptr(), vm_id.len(), name.as_ptr(), name.len(), &mut id) } {
        OK => Ok(Some(id)),
        NOT_FOUND => Ok(None),
        other => Err(status(other)),
    }
}

/// `Ok(None)` when the queue is empty (or the message is); `Err(NotFound)` for an unknown queue.
pub(crate) fn dequeue_shared_queue(queue_id: u32) -> Result<Option<Bytes>, Status> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: the out-pointers are live locals; on `OK` the host wrote a buffer it
    // allocated through `proxy_on_memory_allocate` (or null), taken back once.
    unsafe {
        match proxy_dequeue_shared_queue(queue_id, &mut data, &mut size) {
            OK => Ok(host_bytes(data, size)),
            EMPTY => Ok(None),
            other => Err(status(other)),
        }
    }
}

/// `Err(NotFound)` for an unknown queue.
pub(crate) fn enqueue_shared_queue(queue_id: u32, value: Option<&[u8]>) -> Result<(), Status> {
    // SAFETY: the value slice is live for the call (None: null, 0); the host copies it.
    done(unsafe {
        proxy_enqueue_shared_queue(queue_id, value.map_or(null(), |v| v.as_ptr()), value.map_or(0, |v| v.len()))
    })
}

pub(crate) fn resume_http_request() -> Result<(), Status> {
    // SAFETY: no pointers cross; a plain value call.
    done(unsafe { proxy_continue_stream(STREAM_HTTP_REQUEST) })
}

/// `Err(BadArgument)` when the context is gone.
pub(crate) fn set_effective_context(context_id: u32) -> Result<(), Status> {
    // SAFETY: no pointers cross; a plain value call.
    done(unsafe { proxy_set_effective_context(context_id) })
}

pub(crate) fn define_metric(metric_type: MetricType, name: &str) -> Result<u32, Status> {
    let mut id: u32 = 0;
    // SAFETY: the name slice and `id` are live for the call.
    match unsafe { proxy_define_metric(metric_type, name.as_ptr(), name.len(), &mut id) } {
        OK => Ok(id),
        other => Err(status(other)),
    }
}

pub(crate) fn increment_metric(metric_id: u32, offset: i64) -> Result<(), Status> {
    // SAFETY: no pointers cross; a plain value call.
    done(unsafe { proxy_increment_metric(metric_id, offset) })
}

pub(crate) fn record_metric(metric_id: u32, value: u64) -> Result<(), Status> {
    // SAFETY: no pointers cross; a plain value call.
    done(unsafe { proxy_record_metric(metric_id, value) })
}

/// Calls `upstream` (a cluster) with `headers` and `body`, answered within `timeout`: the
/// callout's token. Envoy makes the callout the root context's, whichever context calls
/// (`entry`), and answers it there. The timeout saturates instead of wrapping (Envoy
/// refuses one over `i32::MAX` ms: BadArgument).
pub(crate) fn dispatch_http_call(
    upstream: &str,
    headers: Vec<(&str, &str)>,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<u32, Status> {
    let headers = pairs::serialize(headers.iter().map(|(n, v)| (*n, *v)));
    // An empty map: its count alone.
    let trailers = [0u8; 4];
    let body = body.unwrap_or_default();
    let mut token: u32 = 0;
    // SAFETY: every pointer and length describes a live slice for the whole call (the host
    // copies what it keeps), and `token` is live for it.
    let raw = unsafe {
        proxy_http_call(
            upstream.as_ptr(),
            upstream.len(),
            headers.as_ptr(),
            headers.len(),
            body.as_ptr(),
            body.len(),
            trailers.as_ptr(),
            trailers.len(),
            millis(timeout),
            &mut token,
        )
    };
    done(raw).map(|()| token)
}
