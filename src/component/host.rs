//! The WASI calls the component needs, as small safe wrappers: the keyvalue bucket as the
//! core's CAS store, clocks, randomness, the environment, and HTTP bodies. None panic.

use super::wasi::clocks::{monotonic_clock, wall_clock};
use super::wasi::http::types::{
    Fields, IncomingBody, InputStream, OutgoingBody, OutgoingResponse, OutputStream, ResponseOutparam,
};
use super::wasi::io::poll::{poll, Pollable};
use super::wasi::io::streams::StreamError;
use super::wasi::keyvalue::atomics::{self, Cas, CasError};
use super::wasi::keyvalue::store::{self, Bucket};
use crate::core::api::reply::Reply;
use crate::core::store::{versioned, CasStore, Read, StoreError};

/// How many lost swaps an unconditional write retries before giving up.
const MAX_RACES: usize = 64;
/// Size of one read from a body stream.
const CHUNK: u64 = 64 * 1024;

/// The `wasi:keyvalue` bucket that holds the cache, leases and buckets.
pub struct Kv {
    bucket: Bucket,
}

fn kv_error(e: store::Error) -> StoreError {
    StoreError::Host(format!("wasi:keyvalue: {e:?}"))
}

impl Kv {
    pub fn open(name: &str) -> Result<Kv, String> {
        store::open(name).map(|bucket| Kv { bucket }).map_err(|e| format!("{e:?}"))
    }
}

/// The prefix of the keys that hand out the right to create a key (see `Kv::set`).
const CREATION_CLAIMS: &str = "holysheep/created/";

/// Claims taken on a key still missing before the right to create it is handed out again.
const CLAIM_ROUNDS: i64 = 64;

impl Kv {
    /// Takes the right to create `key`, by the host's atomic increment of a claim key beside
    /// it (one per key, so as bounded as the keys): the first claim wins, and, should the key
    /// still be missing `CLAIM_ROUNDS` claims later (its creator died between its claim and
    /// its write), the next one. Two creators then need 64 claims within one creator's two
    /// host calls.
    fn claim_creation(&self, key: &str) -> Result<bool, StoreError> {
        let claim = format!("{CREATION_CLAIMS}{key}");
        atomics::increment(&self.bucket, &claim, 1).map(|n| (n - 1) % CLAIM_ROUNDS == 0).map_err(kv_error)
    }
}

impl CasStore for Kv {
    fn get(&self, key: &str) -> Result<Read, StoreError> {
        let raw = self.bucket.get(key).map_err(kv_error)?;
        Ok(versioned::read(raw.as_deref()))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut handle = Cas::new(&self.bucket, key).map_err(kv_error)?;
        for _ in 0..MAX_RACES {
            let current = handle.current().map_err(kv_error)?;
            let raw = versioned::next(current.as_deref(), cas, value)?;
            // A conditional write that creates the key: some hosts' swap on a missing key
            // is an upsert (Spin's SQLite store), so two racers could both "create" it.
            // Only the caller that takes the key's creation claim may.
            if current.is_none() && cas.is_some_and(|c| c != 0) && !self.claim_creation(key)? {
                return Err(StoreError::CasMismatch);
            }
            match atomics::swap(handle, &raw) {
                Ok(()) => return Ok(()),
                Err(CasError::CasFailed(_)) if cas.is_some_and(|c| c != 0) => return Err(StoreError::CasMismatch),
                Err(CasError::CasFailed(fresh)) => handle = fresh,
                Err(CasError::StoreError(e)) => return Err(kv_error(e)),
            }
        }
        Err(StoreError::CasMismatch)
    }
}

/// Wall-clock milliseconds: leases and cache entries compare times across instances.
pub fn now_ms() -> u64 {
    let t = wall_clock::now();
    t.seconds.saturating_mul(1000).saturating_add(u64::from(t.nanoseconds / 1_000_000))
}

fn after_ms(ms: u64) -> Pollable {
    monotonic_clock::subscribe_duration(ms.saturating_mul(1_000_000))
}

/// A pollable ready at wall-clock `deadline_ms` (measured on the monotonic clock).
pub fn after_deadline(deadline_ms: u64) -> Pollable {
    after_ms(deadline_ms.saturating_sub(now_ms()))
}

pub fn sleep_ms(ms: u64) {
    after_ms(ms).block();
}

/// Blocks until `ready` is ready (`true`) or `deadline_ms` passes (`false`), calling
/// `between` at least every `every_ms` while it waits.
pub fn wait_for(ready: &Pollable, deadline_ms: u64, every_ms: u64, between: &mut dyn FnMut()) -> bool {
    loop {
        let left = deadline_ms.saturating_sub(now_ms());
        if left == 0 {
            return ready.ready();
        }
        let timer = after_ms(left.min(every_ms).max(1));
        if poll(&[ready, &timer]).contains(&0) {
            return true;
        }
        between();
    }
}

pub fn nonce() -> u64 {
    super::wasi::random::random::get_random_u64().max(1)
}

/// The instance's environment, read when it sets up (each read copies all of it).
pub struct Env(Vec<(String, String)>);

impl Env {
    pub fn read() -> Env {
        Env(super::wasi::cli::environment::get_environment())
    }

    pub fn get(&self, name: &str) -> Option<String> {
        self.0.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }
}

/// The first value of a header, as text.
pub fn header(fields: &Fields, name: &str) -> Option<String> {
    fields.get(name).into_iter().next().and_then(|v| String::from_utf8(v).ok())
}

pub enum BodyError {
    TooLarge,
    Broken,
}

/// Reads a whole body, refusing more than `limit` bytes.
fn read_all(stream: &InputStream, limit: usize) -> Result<Vec<u8>, BodyError> {
    let mut body = Vec::new();
    loop {
        match stream.blocking_read(CHUNK) {
            Ok(chunk) => {
                if body.len() + chunk.len() > limit {
                    return Err(BodyError::TooLarge);
                }
                body.extend_from_slice(&chunk);
            }
            Err(StreamError::Closed) => return Ok(body),
            Err(StreamError::LastOperationFailed(_)) => return Err(BodyError::Broken),
        }
    }
}

/// The next chunk of a body being streamed (`None` at its end), waiting at most until
/// `deadline_ms` and calling `between` at least every `every_ms` meanwhile.
pub fn read_chunk(
    stream: &InputStream,
    deadline_ms: u64,
    every_ms: u64,
    between: &mut dyn FnMut(),
) -> Result<Option<Vec<u8>>, BodyError> {
    let ready = stream.subscribe();
    if !wait_for(&ready, deadline_ms, every_ms, between) {
        return Err(BodyError::Broken);
    }
    drop(ready);
    match stream.read(CHUNK) {
        Ok(chunk) => Ok(Some(chunk)),
        Err(StreamError::Closed) => Ok(None),
        Err(StreamError::LastOperationFailed(_)) => Err(BodyError::Broken),
    }
}

/// Reads an incoming body (request or response) to its end.
pub fn consume(body: IncomingBody, limit: usize) -> Result<Vec<u8>, BodyError> {
    let stream = body.stream().map_err(|()| BodyError::Broken)?;
    let read = read_all(&stream, limit);
    drop(stream);
    drop(IncomingBody::finish(body));
    read
}

pub fn write_all(stream: &OutputStream, mut data: &[u8]) -> bool {
    while !data.is_empty() {
        let n = data.len().min(4096);
        if stream.blocking_write_and_flush(&data[..n]).is_err() {
            return false;
        }
        data = &data[n..];
    }
    true
}

/// Copies `from` into `to` until `from` ends (streaming pass-through).
pub fn pipe(from: &InputStream, to: &OutputStream) -> bool {
    loop {
        match to.blocking_splice(from, CHUNK) {
            Ok(_) => {}
            Err(StreamError::Closed) => return to.blocking_flush().is_ok(),
            Err(StreamError::LastOperationFailed(_)) => return false,
        }
    }
}

/// `Fields` from (name, value) pairs; pairs the host refuses are dropped one by one.
pub fn fields(headers: &[(String, String)]) -> Fields {
    let f = Fields::new();
    for (name, value) in headers {
        let _ = f.append(name, value.as_bytes());
    }
    f
}

/// Starts the response to the client; the caller writes the body.
pub fn start_response(out: ResponseOutparam, status: u16, headers: &[(String, String)]) -> Option<OutgoingBody> {
    let response = OutgoingResponse::new(fields(headers));
    if response.set_status_code(status).is_err() {
        let _ = response.set_status_code(500);
    }
    let body = response.body().ok()?;
    ResponseOutparam::set(out, Ok(response));
    Some(body)
}

/// Sends a whole response to the client.
pub fn respond(out: ResponseOutparam, status: u16, headers: &[(String, String)], body: &[u8]) {
    let Some(outgoing) = start_response(out, status, headers) else { return };
    if let Ok(stream) = outgoing.write() {
        write_all(&stream, body);
    }
    let _ = OutgoingBody::finish(outgoing, None);
}

/// Header pairs with lower-case names (values that are not text are left out).
pub fn header_pairs(fields: &Fields) -> Vec<(String, String)> {
    fields
        .entries()
        .into_iter()
        .filter_map(|(n, v)| Some((n.to_ascii_lowercase(), String::from_utf8(v).ok()?)))
        .collect()
}

/// Sends a reply of the core's to the client, with `extra` headers.
pub fn reply(out: ResponseOutparam, reply: &Reply, extra: &[(&str, String)]) {
    let headers: Vec<(String, String)> = reply
        .headers()
        .into_iter()
        .map(|(n, v)| (n, v.into_owned()))
        .chain(extra.iter().cloned())
        .map(|(n, v)| (n.to_owned(), v))
        .collect();
    respond(out, reply.response.status, &headers, &reply.response.body);
}
