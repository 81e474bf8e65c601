//! The callbacks of `abi` as the shell calls them: safe, copying what Envoy owns, and
//! quiet when Envoy refuses (a filter already detached from its stream does nothing).

use super::abi::{self, EnvoyBuffer, EnvoyConfig, EnvoyFilter, Header, ModuleBuffer};
use crate::core::api::call::HttpCall;
use crate::core::api::head::HeadEdit;
use crate::core::api::note::Note;
use crate::core::api::reply::Reply;
use crate::core::observe::log_fields::{self, Answered};

/// Writes a line to Envoy's log.
pub fn log(level: i32, line: &str) {
    // SAFETY: the buffer is read during the call only.
    unsafe { abi::envoy_dynamic_module_callback_log(level, ModuleBuffer::of(line.as_bytes())) }
}

/// Writes the core's lines to Envoy's log, each at its level.
pub fn note(notes: impl IntoIterator<Item = Note>) {
    for note in notes {
        let (level, line) = match &note {
            Note::Critical(l) => (abi::LOG_CRITICAL, l),
            Note::Error(l) => (abi::LOG_ERROR, l),
            Note::Warn(l) => (abi::LOG_WARN, l),
            Note::Info(l) => (abi::LOG_INFO, l),
        };
        log(level, line);
    }
}

/// The request's headers, copied, names as Envoy holds them (lower case).
pub fn request_headers(filter: EnvoyFilter) -> Vec<(Vec<u8>, Vec<u8>)> {
    headers(filter, abi::REQUEST_HEADERS)
}

/// The headers of `kind` (`http_header_type`), copied.
fn headers(filter: EnvoyFilter, kind: i32) -> Vec<(Vec<u8>, Vec<u8>)> {
    // SAFETY: the array is sized from `get_headers_size` and filled by Envoy; the slices it
    // points to are copied before the hook returns.
    unsafe {
        let n = abi::envoy_dynamic_module_callback_http_get_headers_size(filter, kind);
        let mut out = vec![Header::of("", ""); n];
        if n == 0 || !abi::envoy_dynamic_module_callback_http_get_headers(filter, kind, out.as_mut_ptr()) {
            return Vec::new();
        }
        out.iter().map(Header::pair).collect()
    }
}

/// The status of the response whose headers the hook running has.
pub fn response_status(filter: EnvoyFilter) -> Option<u16> {
    let head = headers(filter, abi::RESPONSE_HEADERS);
    let (_, status) = head.iter().find(|(name, _)| name == b":status")?;
    std::str::from_utf8(status).ok()?.parse().ok()
}

/// The cluster the request's route leads to (`xds.cluster_name`), if any.
pub fn routed_cluster(filter: EnvoyFilter) -> Option<String> {
    let mut out = EnvoyBuffer { ptr: std::ptr::null(), len: 0 };
    // SAFETY: Envoy writes a buffer valid during this hook; it is copied at once.
    let found = unsafe {
        abi::envoy_dynamic_module_callback_http_filter_get_attribute_string(
            filter,
            abi::ATTRIBUTE_XDS_CLUSTER_NAME,
            &mut out,
        )
    };
    found.then(|| String::from_utf8_lossy(&out.to_vec()).into_owned())
}

/// Puts `out` in place of the response body's newest chunk.
pub fn replace_response_chunk(filter: EnvoyFilter, out: &[u8]) {
    // SAFETY: called from the response body hook; `out` is read during the call only.
    unsafe {
        abi::envoy_dynamic_module_callback_http_drain_body(filter, abi::RECEIVED_RESPONSE_BODY, usize::MAX);
        if !out.is_empty() {
            abi::envoy_dynamic_module_callback_http_append_body(
                filter,
                abi::RECEIVED_RESPONSE_BODY,
                ModuleBuffer::of(out),
            );
        }
    }
}

/// Carries out the core's edit of the request's head.
pub fn apply(filter: EnvoyFilter, edit: &HeadEdit) {
    apply_to(filter, abi::REQUEST_HEADERS, edit);
}

/// Carries out the core's edit of the response's head (in its headers hook).
pub fn apply_to_response(filter: EnvoyFilter, edit: &HeadEdit) {
    apply_to(filter, abi::RESPONSE_HEADERS, edit);
}

fn apply_to(filter: EnvoyFilter, kind: i32, edit: &HeadEdit) {
    let set = |name: &str, value: ModuleBuffer| {
        // SAFETY: both buffers are read during the call only.
        unsafe {
            abi::envoy_dynamic_module_callback_http_set_header(filter, kind, ModuleBuffer::of(name.as_bytes()), value)
        };
    };
    for name in &edit.remove {
        set(name, ModuleBuffer::none());
    }
    for (name, value) in &edit.set {
        set(name, ModuleBuffer::of(value.as_bytes()));
    }
}

/// The chunks of one of the request's body buffers, copied onto `into`.
fn chunks(filter: EnvoyFilter, kind: i32, into: &mut Vec<u8>) {
    // SAFETY: the array is sized from `get_body_chunks_size`; each chunk is copied before
    // the hook returns.
    unsafe {
        let n = abi::envoy_dynamic_module_callback_http_get_body_chunks_size(filter, kind);
        if n == 0 {
            return;
        }
        let mut out = vec![EnvoyBuffer { ptr: std::ptr::null(), len: 0 }; n];
        if abi::envoy_dynamic_module_callback_http_get_body_chunks(filter, kind, out.as_mut_ptr()) {
            for chunk in out {
                into.extend_from_slice(&chunk.to_vec());
            }
        }
    }
}

/// The bytes of the request's body so far.
pub fn body_size(filter: EnvoyFilter) -> usize {
    // SAFETY: queries of the filter's own state.
    unsafe {
        let buffered = abi::envoy_dynamic_module_callback_http_get_body_size(filter, abi::BUFFERED_REQUEST_BODY);
        if abi::envoy_dynamic_module_callback_http_received_buffered_request_body(filter) {
            return buffered;
        }
        buffered + abi::envoy_dynamic_module_callback_http_get_body_size(filter, abi::RECEIVED_REQUEST_BODY)
    }
}

/// The whole request body at its end: what was buffered, then the newest chunk (one buffer
/// when a buffer filter before this one holds it all).
pub fn whole_body(filter: EnvoyFilter) -> Vec<u8> {
    let mut body = Vec::new();
    chunks(filter, abi::BUFFERED_REQUEST_BODY, &mut body);
    // SAFETY: a query of the filter's own state.
    if !unsafe { abi::envoy_dynamic_module_callback_http_received_buffered_request_body(filter) } {
        chunks(filter, abi::RECEIVED_REQUEST_BODY, &mut body);
    }
    body
}

/// Sends `reply` (plus `extra` headers) as the request's local reply.
pub fn send(filter: EnvoyFilter, reply: &Reply, extra: &[(&str, String)]) {
    let own = reply.headers();
    let headers: Vec<Header> =
        own.iter().map(|(n, v)| Header::of(n, v)).chain(extra.iter().map(|(n, v)| Header::of(n, v))).collect();
    let body = &reply.response.body;
    // SAFETY: the headers array and every slice it points to live until the call returns.
    unsafe {
        abi::envoy_dynamic_module_callback_http_send_response(
            filter,
            u32::from(reply.response.status),
            headers.as_ptr(),
            headers.len(),
            ModuleBuffer::of(body),
            ModuleBuffer::none(),
        )
    }
}

/// Makes a call the core made ready, from this filter, its answer whole; its id, or `None`
/// when Envoy refuses it (logged: no such cluster).
pub fn callout(filter: EnvoyFilter, call: &HttpCall) -> Option<u64> {
    start(filter, call, false)
}

/// Makes a call the core made ready, from this filter, its answer in parts as it comes (the
/// `http_stream_*` hooks); its id, or `None` when Envoy refuses it (logged).
pub fn stream(filter: EnvoyFilter, call: &HttpCall) -> Option<u64> {
    start(filter, call, true)
}

fn start(filter: EnvoyFilter, call: &HttpCall, streamed: bool) -> Option<u64> {
    let sent = dispatch(call, |id, cluster, headers, len, body| {
        // SAFETY: see `dispatch`.
        unsafe {
            match streamed {
                false => abi::envoy_dynamic_module_callback_http_filter_http_callout(
                    filter,
                    id,
                    cluster,
                    headers,
                    len,
                    body,
                    call.timeout_ms,
                ),
                true => abi::envoy_dynamic_module_callback_http_filter_start_http_stream(
                    filter,
                    id,
                    cluster,
                    headers,
                    len,
                    body,
                    true,
                    call.timeout_ms,
                ),
            }
        }
    });
    match sent {
        Ok(id) => Some(id),
        Err(result) => {
            log(abi::LOG_ERROR, &format!("holysheep: callout to cluster '{}' refused: {result}", call.cluster));
            None
        }
    }
}

/// Makes `call` from the configuration `config`, on the main thread (its answer reaches
/// `on_http_filter_config_http_callout_done`): its id, or Envoy's refusal
/// (`http_callout_init_result`).
pub fn config_callout(config: EnvoyConfig, call: &HttpCall) -> Result<u64, i32> {
    dispatch(call, |id, cluster, headers, len, body| {
        // SAFETY: see `dispatch`.
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_config_http_callout(
                config,
                id,
                cluster,
                headers,
                len,
                body,
                call.timeout_ms,
            )
        }
    })
}

/// `call` as the callout callbacks take it (where Envoy writes the id it picks, the cluster,
/// the headers and their count, the body), handed to `send`: the id, or Envoy's refusal
/// (`http_callout_init_result`). Every buffer lives until `send` returns.
fn dispatch(
    call: &HttpCall,
    send: impl FnOnce(*mut u64, ModuleBuffer, *const Header, usize, ModuleBuffer) -> i32,
) -> Result<u64, i32> {
    let headers: Vec<Header> = call.headers.iter().map(|(n, v)| Header::of(n, v)).collect();
    let (cluster, body) = (ModuleBuffer::of(call.cluster.as_bytes()), ModuleBuffer::of(&call.body));
    let mut id = 0u64;
    match send(&mut id, cluster, headers.as_ptr(), headers.len(), body) {
        abi::CALLOUT_OK => Ok(id),
        refused => Err(refused),
    }
}

/// Starts the request's own answer with `head` (`:status` among it); its body follows by
/// `send_data`.
pub fn send_head(filter: EnvoyFilter, head: &[(String, String)]) {
    let headers: Vec<Header> = head.iter().map(|(n, v)| Header::of(n, v)).collect();
    // SAFETY: the headers array and every slice it points to live until the call returns.
    unsafe {
        abi::envoy_dynamic_module_callback_http_send_response_headers(filter, headers.as_ptr(), headers.len(), false)
    }
}

/// Sends the next part of the request's own answer (`last`: its end). A watermark hook of
/// the filter may run inside this call.
pub fn send_data(filter: EnvoyFilter, data: &[u8], last: bool) {
    // SAFETY: the data lives until the call returns.
    unsafe { abi::envoy_dynamic_module_callback_http_send_response_data(filter, ModuleBuffer::of(data), last) }
}

/// Publishes what the access log shows of the request (`log_fields::values`), each as
/// filter state `wasm.<name>`, where the plugin publishes it.
pub fn publish(filter: EnvoyFilter, answered: &Answered<'_>) {
    for (name, value) in log_fields::values(answered) {
        let key = format!("wasm.{name}");
        // SAFETY: both buffers live until the call returns.
        unsafe {
            abi::envoy_dynamic_module_callback_http_set_filter_state_bytes(
                filter,
                ModuleBuffer::of(key.as_bytes()),
                ModuleBuffer::of(value.as_bytes()),
            );
        }
    }
}

/// The names of the connection's verified client certificate (its first DNS and URI SANs),
/// none on a connection without mutual TLS.
pub fn peer_sans(filter: EnvoyFilter) -> Vec<String> {
    let mut mtls = false;
    // SAFETY: Envoy writes the bool; a false return leaves it false.
    if !unsafe {
        abi::envoy_dynamic_module_callback_http_filter_get_attribute_bool(filter, abi::ATTRIBUTE_MTLS, &mut mtls)
    } || !mtls
    {
        return Vec::new();
    }
    let mut sans = Vec::new();
    for id in [abi::ATTRIBUTE_DNS_SAN, abi::ATTRIBUTE_URI_SAN] {
        let mut out = EnvoyBuffer { ptr: std::ptr::null(), len: 0 };
        // SAFETY: Envoy fills the buffer, valid during this hook; it is copied.
        if unsafe { abi::envoy_dynamic_module_callback_http_filter_get_attribute_string(filter, id, &mut out) } {
            if let Ok(s) = String::from_utf8(out.to_vec()) {
                sans.extend((!s.is_empty()).then_some(s));
            }
        }
    }
    sans
}

/// A callout's headers as pairs of text.
pub fn header_pairs(headers: &[Header]) -> Vec<(String, String)> {
    headers
        .iter()
        .map(Header::pair)
        .map(|(n, v)| (String::from_utf8_lossy(&n).into_owned(), String::from_utf8_lossy(&v).into_owned()))
        .collect()
}
