//! Envoy host calls the shells need, as small safe wrappers: shared data as the core's
//! CAS store, the clock, nonces, logging and local replies, over `abi`'s host calls. None
//! of these can panic.

use super::abi as hostcalls;
use crate::core::api::call::HttpCall;
use crate::core::api::head::HeadEdit;
use crate::core::api::note::Note;
use crate::core::api::reply::Reply;
pub use crate::core::intake::text;
use crate::core::store::{CasStore, Read, StoreError};
use crate::core::wire::pairs;
use crate::proxy::types::{BufferType, LogLevel, MapType, Status};
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::time::UNIX_EPOCH;

/// Envoy shared data (the VM group's map).
pub struct SharedData;

impl CasStore for SharedData {
    fn get(&self, key: &str) -> Result<Read, StoreError> {
        match hostcalls::get_shared_data(key) {
            Ok((value, cas)) => Ok(Read { value: value.filter(|v| !v.is_empty()), cas }),
            Err(s) => Err(StoreError::Host(format!("get_shared_data: {s:?}"))),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(s) => Err(StoreError::Host(format!("set_shared_data: {s:?}"))),
        }
    }
}

/// Wall-clock milliseconds (Envoy offers no monotonic clock to plugins); while a `Pinned`
/// lives, the first reading of its callback.
pub fn now_ms() -> u64 {
    match CLOCK.get() {
        Clock::Pinned(Some(ms)) => ms,
        clock => {
            let ms = hostcalls::get_current_time()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_millis() as u64);
            if clock == Clock::Pinned(None) {
                CLOCK.set(Clock::Pinned(Some(ms)));
            }
            ms
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Clock {
    /// Every `now_ms` asks the host.
    Read,
    /// `now_ms` asks the host once, then answers that reading.
    Pinned(Option<u64>),
}

thread_local! {
    static CLOCK: std::cell::Cell<Clock> = const { std::cell::Cell::new(Clock::Read) };
}

/// The clock read at most once for the rest of a host callback: its work takes
/// microseconds, and every reading is a host call (a MISS's answer read it four times).
/// Taken at the top of a callback and dropped with it; a callback without one reads the
/// host's clock each time.
pub struct Pinned {
    before: Clock,
}

/// Pins the clock until the returned value drops.
pub fn pin_clock() -> Pinned {
    let before = CLOCK.get();
    if before == Clock::Read {
        CLOCK.set(Clock::Pinned(None));
    }
    Pinned { before }
}

/// The outermost pin lets the clock go; one inside it keeps the reading for the rest of the
/// outer one's callback.
impl Drop for Pinned {
    fn drop(&mut self) {
        if self.before == Clock::Read {
            CLOCK.set(Clock::Read);
        }
    }
}

/// The bytes Envoy has received of the current request so far, headers included
/// (`request.total_size`, an int64 in the host's byte order).
pub fn received_bytes() -> Option<u64> {
    property_u64(vec!["request", "total_size"])
}

/// A 64-bit integer property (Envoy passes `int` and `uint` attributes as 8 bytes in the
/// host's byte order; a negative `int` is no count).
/// Whether the current response's headers came from the upstream (`response.code_details`
/// is `via_upstream`), not from Envoy itself (a route timeout's 504, a reset's 503).
pub fn response_via_upstream() -> bool {
    let details = hostcalls::get_property(vec!["response", "code_details"]).ok().flatten();
    details.as_deref() == Some(b"via_upstream".as_slice())
}

fn property_u64(path: Vec<&str>) -> Option<u64> {
    let raw = hostcalls::get_property(path).ok().flatten()?;
    let bytes: [u8; 8] = raw.as_slice().try_into().ok()?;
    u64::try_from(i64::from_le_bytes(bytes)).ok()
}

/// The cluster the route Envoy chose for the current request leads to.
fn routed_cluster() -> Option<Vec<u8>> {
    hostcalls::get_property(vec!["xds", "cluster_name"]).ok().flatten()
}

/// The subject alternative names (the first URI and the first DNS name) of the client
/// certificate the current request's connection presented, when it came over TLS with
/// one; none otherwise. Envoy verified it when the listener validates client
/// certificates (`docs/fleet.md`).
pub fn peer_sans() -> Vec<String> {
    let mtls = hostcalls::get_property(vec!["connection", "mtls"]).ok().flatten();
    if mtls.is_none_or(|v| v.first().is_none_or(|b| *b == 0)) {
        return Vec::new();
    }
    ["uri_san_peer_certificate", "dns_san_peer_certificate"]
        .into_iter()
        .filter_map(|p| hostcalls::get_property(vec!["connection", p]).ok().flatten())
        .map(text)
        .filter(|s| !s.is_empty())
        .collect()
}

/// Whether the route Envoy chose for the current request leads to `cluster` (its
/// `xds.cluster_name`; logged when it does not). Envoy answers the route it last chose: a
/// change of the request's headers routes it again only as it leaves.
pub fn routed_to(cluster: &str) -> bool {
    let routed = routed_cluster();
    if routed.as_deref() == Some(cluster.as_bytes()) {
        return true;
    }
    let shown: String = routed.map_or_else(|| "none".to_owned(), |c| text(c).chars().take(128).collect());
    log(LogLevel::Warn, &format!("holysheep: a stream's route leads to cluster '{shown}', not '{cluster}'"));
    false
}

/// How many times Envoy's router tried the current request upstream (its
/// `upstream.request_attempt_count`, a uint64); 1 when it cannot tell.
pub fn upstream_attempts() -> u64 {
    property_u64(vec!["upstream", "request_attempt_count"]).unwrap_or(1).max(1)
}

/// Unique-enough 64-bit nonces: a per-VM random seed (WASI `random_get` via std) hashed
/// with a counter.
pub struct Nonces {
    seed: RandomState,
    counter: u64,
}

impl Nonces {
    pub fn new() -> Self {
        Nonces { seed: RandomState::new(), counter: 0 }
    }

    pub fn next(&mut self) -> u64 {
        self.counter += 1;
        self.seed.hash_one(self.counter).max(1)
    }
}

/// A host buffer (request body, callout body, configuration); empty when absent, whatever
/// the host's status.
pub fn buffer(kind: BufferType, size: usize) -> Vec<u8> {
    hostcalls::get_buffer(kind, 0, size).ok().flatten().unwrap_or_default()
}

/// A header's value as text. Envoy lets through values that are not UTF-8 (obs-text);
/// such bytes are kept as `%XX` escapes.
pub fn header(map: MapType, name: &str) -> Option<String> {
    hostcalls::get_map_value_bytes(map, name).ok().flatten().map(text)
}

/// The `:status` of `map`'s headers, as a number (`None`: none, or not a number).
pub fn status(map: MapType) -> Option<u16> {
    header(map, ":status")?.parse().ok()
}

/// The status of a callout's answer (`None`: it has none; `num_headers` 0 is no answer).
pub fn callout_status(num_headers: usize) -> Option<u16> {
    (num_headers > 0).then(|| status(MapType::HttpCallResponseHeaders)).flatten()
}

/// Every header of `map`, values as in `header`.
pub fn headers(map: MapType) -> Vec<(String, String)> {
    let raw = header_map(map);
    let pairs = pairs::parse(&raw).unwrap_or_default();
    pairs.into_iter().map(|(name, value)| (text(name.to_vec()), text(value.to_vec()))).collect()
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_header_map_pairs(map_type: MapType, data: *mut *mut u8, size: *mut usize) -> u32;
}

/// The serialized header map of `map` (see `core::wire::pairs`), as the host wrote it: one buffer,
/// read in place (no copy per name and value; any status but Ok is an empty map).
pub fn header_map(map: MapType) -> Vec<u8> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the host writes a buffer it allocated through this module's
    // `proxy_on_memory_allocate` (`entry`: a boxed `[u8]` of exactly `size` bytes), so the
    // Vec takes it back whole.
    unsafe {
        match proxy_get_header_map_pairs(map, &mut data, &mut size) {
            // The raw status, not the enum: a value outside it would be undefined.
            status if status == Status::Ok as u32 && !data.is_null() => Vec::from_raw_parts(data, size, size),
            _ => Vec::new(),
        }
    }
}

pub fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, message);
}

/// Sends a local reply (plus `extra` headers) on the current (effective) http context.
pub fn send(reply: &Reply, extra: &[(&str, String)]) -> bool {
    send_with(reply, extra.iter().map(|(n, v)| (*n, v.as_str())))
}

/// `send`, the extra headers given as pairs of any origin (serialized with the reply's
/// own in one buffer).
pub fn send_with<'e>(reply: &Reply, extra: impl Iterator<Item = (&'e str, &'e str)> + Clone) -> bool {
    let headers = reply.headers();
    // Not an identity: the closure narrows `extra`'s borrows to the reply's own, so the two chain.
    #[allow(clippy::map_identity)]
    let headers = headers.iter().map(|(n, v)| (*n, v.as_ref())).chain(extra.map(|(n, v)| (n, v)));
    send_serialized(reply.response.status, &pairs::serialize(headers), &reply.response.body)
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_send_local_response(
        status_code: u32,
        details: *const u8,
        details_size: usize,
        body: *const u8,
        body_size: usize,
        headers: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
}

/// Sends a local reply whose headers are serialized already (see `core::wire::pairs`);
/// `false` on any status but Ok.
fn send_serialized(status: u16, headers: &[u8], body: &[u8]) -> bool {
    // SAFETY: every pointer and length describes a live slice for the whole call; the host
    // copies what it keeps. No gRPC status (-1).
    let sent = unsafe {
        proxy_send_local_response(
            u32::from(status),
            std::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            -1,
        )
    };
    sent == Status::Ok as u32
}

/// Sends a local reply on another http context of this worker; `false` if it is gone.
pub fn send_to(context_id: u32, reply: &Reply, extra: &[(&str, String)]) -> bool {
    hostcalls::set_effective_context(context_id).is_ok() && send(reply, extra)
}

/// Carries out the core's edit of a head (`map`: the request's or the answer's headers).
pub fn apply(map: MapType, edit: &HeadEdit) {
    for name in &edit.remove {
        let _ = hostcalls::set_map_value(map, name, None);
    }
    for (name, value) in &edit.set {
        let _ = hostcalls::set_map_value(map, name, Some(value));
    }
}

/// Writes the core's lines to Envoy's log, each at its level.
pub fn note(notes: impl IntoIterator<Item = Note>) {
    for note in notes {
        match note {
            Note::Critical(line) => log(LogLevel::Critical, &line),
            Note::Error(line) => log(LogLevel::Error, &line),
            Note::Warn(line) => log(LogLevel::Warn, &line),
            Note::Info(line) => log(LogLevel::Info, &line),
        }
    }
}

/// Makes a call the core made ready; the callout's token.
pub fn dispatch(call: &HttpCall) -> Result<u32, Status> {
    let timeout = std::time::Duration::from_millis(call.timeout_ms);
    let body = (!call.body.is_empty()).then_some(call.body.as_slice());
    hostcalls::dispatch_http_call(&call.cluster, call.pairs(), body, timeout)
}
