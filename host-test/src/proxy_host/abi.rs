//! The proxy-wasm ABI 0.2.1 imports (module `env`), modelled on Envoy where
//! `docs/envoy-facts.md` says it matters. Imports we do not model answer
//! `Unimplemented`; nothing here traps on bad guest input (it answers `BadArgument`).

use super::state::{status, Headers, LocalReply, Outgoing, Queue, Shared, VmState};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use wasmtime::{Caller, Extern, Linker, Module, Val, ValType};

type I32x8 = (i32, i32, i32, i32, i32, i32, i32, i32);
type I32x10 = (i32, i32, i32, i32, i32, i32, i32, i32, i32, i32);

/// A point where the scheduler may run another VM (deterministic interleavings).
struct YieldNow(bool);

impl Future for YieldNow {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }
}

async fn maybe_yield(yields: bool) {
    if yields {
        YieldNow(false).await;
    }
}

fn read(caller: &mut Caller<'_, VmState>, ptr: i32, len: i32) -> Option<Vec<u8>> {
    let Some(Extern::Memory(mem)) = caller.get_export("memory") else { return None };
    let (start, len) = (ptr as u32 as usize, len as u32 as usize);
    mem.data(&caller).get(start..start.checked_add(len)?).map(<[u8]>::to_vec)
}

fn read_str(caller: &mut Caller<'_, VmState>, ptr: i32, len: i32) -> Option<String> {
    read(caller, ptr, len).and_then(|b| String::from_utf8(b).ok())
}

fn write(caller: &mut Caller<'_, VmState>, ptr: i32, bytes: &[u8]) -> bool {
    let Some(Extern::Memory(mem)) = caller.get_export("memory") else { return false };
    mem.write(caller, ptr as u32 as usize, bytes).is_ok()
}

/// Copies `data` into guest memory (allocated by the guest) and returns pointer and size
/// through `ret_ptr`/`ret_size`. Empty data is returned as a null pointer.
async fn give(caller: &mut Caller<'_, VmState>, data: &[u8], ret_ptr: i32, ret_size: i32) -> i32 {
    let mut ptr = 0i32;
    if !data.is_empty() {
        let Some(Extern::Func(alloc)) = caller.get_export("proxy_on_memory_allocate") else {
            return status::BAD_ARGUMENT;
        };
        let mut out = [Val::I32(0)];
        if alloc.call_async(&mut *caller, &[Val::I32(data.len() as i32)], &mut out).await.is_err() {
            return status::BAD_ARGUMENT;
        }
        ptr = out[0].unwrap_i32();
        if ptr == 0 || !write(caller, ptr, data) {
            return status::BAD_ARGUMENT;
        }
    }
    if write(caller, ret_ptr, &ptr.to_le_bytes()) && write(caller, ret_size, &(data.len() as u32).to_le_bytes()) {
        status::OK
    } else {
        status::BAD_ARGUMENT
    }
}

/// The ABI's header-map encoding: count, (key, value) sizes, then NUL-terminated bytes.
pub fn encode_map(map: &Headers) -> Vec<u8> {
    let mut out = (map.len() as u32).to_le_bytes().to_vec();
    for (k, v) in map {
        out.extend((k.len() as u32).to_le_bytes());
        out.extend((v.len() as u32).to_le_bytes());
    }
    for (k, v) in map {
        out.extend(k.as_bytes());
        out.push(0);
        out.extend(v.as_bytes());
        out.push(0);
    }
    out
}

pub fn decode_map(raw: &[u8]) -> Option<Headers> {
    let word = |i: usize| raw.get(i..i + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
    let n = word(0)?;
    let mut sizes = Vec::with_capacity(n.min(1024));
    for i in 0..n {
        sizes.push((word(4 + i * 8)?, word(8 + i * 8)?));
    }
    let mut at = 4 + n * 8;
    let mut out = Vec::with_capacity(sizes.len());
    for (k, v) in sizes {
        let key = String::from_utf8(raw.get(at..at + k)?.to_vec()).ok()?;
        at += k + 1;
        let value = String::from_utf8(raw.get(at..at + v)?.to_vec()).ok()?;
        at += v + 1;
        out.push((key, value));
    }
    Some(out)
}

/// The map a `map_type` names, for the effective context.
fn map_mut(state: &mut VmState, map_type: i32) -> Option<&mut Headers> {
    let ctx = state.effective;
    match map_type {
        0 => state.streams.get_mut(&ctx).map(|s| &mut s.request_headers),
        2 => state.streams.get_mut(&ctx).map(|s| &mut s.response_headers),
        6 => state.callout_response.as_mut().map(|(h, _)| h),
        _ => None,
    }
}

fn property(state: &VmState, path: &[u8]) -> Option<Vec<u8>> {
    let parts: Vec<&[u8]> = path.split(|b| *b == 0).filter(|p| !p.is_empty()).collect();
    match parts.as_slice() {
        [b"plugin_vm_id"] => Some(state.vm_id.clone().into_bytes()),
        [b"plugin_root_id"] | [b"plugin_name"] => Some(b"holysheep-edge".to_vec()),
        // The route of every request passed on leads to `holysheep` (see `World::pass_through`).
        [b"xds", b"cluster_name"] => Some(b"holysheep".to_vec()),
        // Envoy's CEL int64, in the VM's (little-endian) byte order.
        [b"request", b"total_size"] => {
            let stream = state.streams.get(&state.effective)?;
            let head: usize = stream.request_headers.iter().map(|(n, v)| n.len() + v.len()).sum();
            Some(((head as u64 + stream.body_received) as i64).to_le_bytes().to_vec())
        }
        _ => None,
    }
}

/// Notes the fuel left at this host call, when the profile traces fuel (see
/// `Shared::fuel_trace`).
fn trace_fuel(caller: &mut Caller<'_, VmState>, name: &'static str) {
    let Ok(left) = caller.get_fuel() else { return };
    let data = caller.data();
    if let Some(trace) = data.shared().fuel_trace.as_mut() {
        trace.push((data.export.clone(), name, left));
    }
}

/// Notes the plugin's function running at a point Binaryen's `--log-execution` logs, when
/// the world walks (see `Shared::walk`).
fn walked(caller: &Caller<'_, VmState>) {
    if caller.data().shared().walk.is_none() {
        return;
    }
    let trace = wasmtime::WasmBacktrace::capture(caller);
    let ours = trace.frames().iter().filter_map(|f| f.func_name()).find(|n| n.contains("holysheep_edge"));
    if let (Some(name), Some(walk)) = (ours, caller.data().shared().walk.as_mut()) {
        walk.push(name.to_owned());
    }
}

macro_rules! wrap {
    ($linker:expr, $name:literal, |$caller:ident, $args:tt : $ty:ty| $body:expr) => {
        $linker.func_wrap_async(
            "env",
            $name,
            |mut $caller: Caller<'_, VmState>, $args: $ty| -> Box<dyn Future<Output = i32> + Send + '_> {
                Box::new(async move {
                    #[allow(unused_mut)]
                    let mut $caller = &mut $caller;
                    *$caller.data().shared().host_calls.entry($name).or_default() += 1;
                    trace_fuel($caller, $name);
                    if $caller.data().shared().failing_calls.contains($name) {
                        return status::INTERNAL_FAILURE;
                    }
                    $body
                })
            },
        )?;
    };
}

/// Adds every modelled import; any other `env` import the module has answers
/// `Unimplemented`.
pub fn add_to_linker(linker: &mut Linker<VmState>, module: &Module) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    stub_everything(linker, module)?;
    if module.imports().any(|i| i.module() == "env" && i.name() == "log_execution") {
        linker.func_wrap("env", "log_execution", |caller: Caller<'_, VmState>, _point: i32| walked(&caller))?;
    }
    wrap!(linker, "proxy_log", |c, (level, ptr, len): (i32, i32, i32)| {
        let Some(msg) = read_str(c, ptr, len) else { return status::BAD_ARGUMENT };
        let worker = c.data().worker;
        c.data().shared().logs.push(format!("[{level}] worker {worker}: {msg}"));
        status::OK
    });
    wrap!(linker, "proxy_get_log_level", |c, (ret,): (i32,)| {
        if write(c, ret, &1u32.to_le_bytes()) {
            status::OK
        } else {
            status::BAD_ARGUMENT
        }
    });
    wrap!(linker, "proxy_get_current_time_nanoseconds", |c, (ret,): (i32,)| {
        let ns = c.data().clock.now_ms().saturating_mul(1_000_000);
        if write(c, ret, &ns.to_le_bytes()) {
            status::OK
        } else {
            status::BAD_ARGUMENT
        }
    });
    wrap!(linker, "proxy_set_tick_period_milliseconds", |c, (period,): (i32,)| {
        c.data_mut().tick_ms = (period > 0).then_some(period as u32 as u64);
        status::OK
    });
    wrap!(linker, "proxy_get_buffer_bytes", |c, (kind, start, max, ret_ptr, ret_size): (i32, i32, i32, i32, i32)| {
        let state = c.data();
        let whole: Option<Vec<u8>> = match kind {
            0 => state.streams.get(&state.effective).map(|s| s.request_body.clone()),
            1 => state.streams.get(&state.effective).map(|s| s.response_body.clone()),
            4 => state.callout_response.as_ref().map(|(_, b)| b.clone()),
            6 => Some(state.vm_config.clone()),
            7 => Some(state.plugin_config.clone()),
            _ => None,
        };
        let Some(whole) = whole else { return status::NOT_FOUND };
        let (start, max) = (start as u32 as usize, max as u32 as usize);
        let slice = whole.get(start..).map(|s| &s[..s.len().min(max)]).unwrap_or_default().to_vec();
        give(c, &slice, ret_ptr, ret_size).await
    });
    wrap!(linker, "proxy_set_buffer_bytes", |c, (kind, start, size, ptr, len): (i32, i32, i32, i32, i32)| {
        let Some(data) = read(c, ptr, len) else { return status::BAD_ARGUMENT };
        let state = c.data_mut();
        let ctx = state.effective;
        let Some(stream) = state.streams.get_mut(&ctx) else { return status::NOT_FOUND };
        let buffer = match kind {
            0 => &mut stream.request_body,
            1 => &mut stream.response_body,
            _ => return status::NOT_FOUND,
        };
        let (start, size) = (start as u32 as usize, size as u32 as usize);
        let end = start.saturating_add(size).min(buffer.len());
        if start > end {
            return status::BAD_ARGUMENT;
        }
        buffer.splice(start..end, data);
        status::OK
    });
    wrap!(linker, "proxy_get_header_map_pairs", |c, (kind, ret_ptr, ret_size): (i32, i32, i32)| {
        let Some(map) = map_mut(c.data_mut(), kind).map(|m| encode_map(m)) else { return status::NOT_FOUND };
        give(c, &map, ret_ptr, ret_size).await
    });
    wrap!(linker, "proxy_set_header_map_pairs", |c, (kind, ptr, len): (i32, i32, i32)| {
        let Some(new) = read(c, ptr, len).and_then(|b| decode_map(&b)) else { return status::BAD_ARGUMENT };
        let Some(map) = map_mut(c.data_mut(), kind) else { return status::NOT_FOUND };
        *map = new;
        status::OK
    });
    wrap!(linker, "proxy_get_header_map_value", |c, (kind, kp, kl, ret_ptr, ret_size): (i32, i32, i32, i32, i32)| {
        let Some(key) = read_str(c, kp, kl) else { return status::BAD_ARGUMENT };
        let Some(map) = map_mut(c.data_mut(), kind) else { return status::NOT_FOUND };
        let Some(value) = map.iter().find(|(k, _)| k.eq_ignore_ascii_case(&key)).map(|(_, v)| v.clone()) else {
            return status::NOT_FOUND;
        };
        give(c, value.as_bytes(), ret_ptr, ret_size).await
    });
    wrap!(linker, "proxy_remove_header_map_value", |c, (kind, kp, kl): (i32, i32, i32)| {
        let Some(key) = read_str(c, kp, kl) else { return status::BAD_ARGUMENT };
        let Some(map) = map_mut(c.data_mut(), kind) else { return status::NOT_FOUND };
        map.retain(|(k, _)| !k.eq_ignore_ascii_case(&key));
        status::OK
    });
    wrap!(linker, "proxy_replace_header_map_value", |c, (kind, kp, kl, vp, vl): (i32, i32, i32, i32, i32)| {
        let (Some(key), Some(value)) = (read_str(c, kp, kl), read_str(c, vp, vl)) else {
            return status::BAD_ARGUMENT;
        };
        let Some(map) = map_mut(c.data_mut(), kind) else { return status::NOT_FOUND };
        map.retain(|(k, _)| !k.eq_ignore_ascii_case(&key));
        map.push((key, value));
        status::OK
    });
    wrap!(linker, "proxy_add_header_map_value", |c, (kind, kp, kl, vp, vl): (i32, i32, i32, i32, i32)| {
        let (Some(key), Some(value)) = (read_str(c, kp, kl), read_str(c, vp, vl)) else {
            return status::BAD_ARGUMENT;
        };
        let Some(map) = map_mut(c.data_mut(), kind) else { return status::NOT_FOUND };
        map.push((key, value));
        status::OK
    });
    wrap!(linker, "proxy_get_property", |c, (pp, pl, ret_ptr, ret_size): (i32, i32, i32, i32)| {
        let Some(path) = read(c, pp, pl) else { return status::BAD_ARGUMENT };
        let Some(value) = property(c.data(), &path) else { return status::NOT_FOUND };
        give(c, &value, ret_ptr, ret_size).await
    });
    wrap!(linker, "proxy_get_shared_data", |c, (kp, kl, ret_ptr, ret_size, ret_cas): (i32, i32, i32, i32, i32)| {
        let Some(key) = read_str(c, kp, kl) else { return status::BAD_ARGUMENT };
        maybe_yield(c.data().yields).await;
        let found = c.data().shared().data.get(&key).cloned();
        let Some((value, cas)) = found else { return status::NOT_FOUND };
        if !write(c, ret_cas, &cas.to_le_bytes()) {
            return status::BAD_ARGUMENT;
        }
        give(c, &value, ret_ptr, ret_size).await
    });
    wrap!(linker, "proxy_set_shared_data", |c, (kp, kl, vp, vl, cas): (i32, i32, i32, i32, i32)| {
        let (Some(key), Some(value)) = (read_str(c, kp, kl), read(c, vp, vl)) else {
            return status::BAD_ARGUMENT;
        };
        maybe_yield(c.data().yields).await;
        let mut shared = c.data().shared();
        let cas = cas as u32;
        // Envoy: a CAS is checked only when the key exists; a missing key is inserted.
        if let Some((_, current)) = shared.data.get(&key) {
            if cas != 0 && cas != *current {
                return status::CAS_MISMATCH;
            }
        }
        let next = shared.next_cas();
        shared.data.insert(key, (value, next));
        status::OK
    });
    wrap!(linker, "proxy_register_shared_queue", |c, (np, nl, ret_id): (i32, i32, i32)| {
        let Some(name) = read_str(c, np, nl) else { return status::BAD_ARGUMENT };
        maybe_yield(c.data().yields).await;
        let (vm_id, owner) = (c.data().vm_id.clone(), (c.data().worker, c.data().root_id));
        let id = register_queue(&mut c.data().shared(), vm_id, name, owner);
        if write(c, ret_id, &id.to_le_bytes()) {
            status::OK
        } else {
            status::BAD_ARGUMENT
        }
    });
    wrap!(linker, "proxy_resolve_shared_queue", |c, (vp, vl, np, nl, ret_id): (i32, i32, i32, i32, i32)| {
        let (Some(vm_id), Some(name)) = (read_str(c, vp, vl), read_str(c, np, nl)) else {
            return status::BAD_ARGUMENT;
        };
        maybe_yield(c.data().yields).await;
        let vm_id = if vm_id.is_empty() { c.data().vm_id.clone() } else { vm_id };
        let found =
            c.data().shared().queues.iter().find(|(_, q)| q.vm_id == vm_id && q.name == name).map(|(id, _)| *id);
        let Some(id) = found else { return status::NOT_FOUND };
        if write(c, ret_id, &id.to_le_bytes()) {
            status::OK
        } else {
            status::BAD_ARGUMENT
        }
    });
    wrap!(linker, "proxy_dequeue_shared_queue", |c, (id, ret_ptr, ret_size): (i32, i32, i32)| {
        maybe_yield(c.data().yields).await;
        let item = match c.data().shared().queues.get_mut(&(id as u32)) {
            None => return status::NOT_FOUND,
            Some(q) => q.items.pop_front(),
        };
        let Some(item) = item else { return status::EMPTY };
        give(c, &item, ret_ptr, ret_size).await
    });
    wrap!(linker, "proxy_enqueue_shared_queue", |c, (id, vp, vl): (i32, i32, i32)| {
        let Some(value) = read(c, vp, vl) else { return status::BAD_ARGUMENT };
        maybe_yield(c.data().yields).await;
        let mut shared = c.data().shared();
        let owner = match shared.queues.get_mut(&(id as u32)) {
            None => return status::NOT_FOUND,
            Some(q) => {
                q.items.push_back(value);
                q.owner
            }
        };
        // One on_queue_ready per enqueue, on the registrant's worker (if its VM lives).
        if let Some((worker, root)) = owner {
            shared.queue_ready.push((worker, root, id as u32));
        }
        status::OK
    });
    wrap!(linker, "proxy_continue_stream", |c, (kind,): (i32,)| {
        let context_id = c.data().effective;
        if kind != 0 || !c.data().streams.contains_key(&context_id) || c.data().deleted.contains(&context_id) {
            return status::NOT_FOUND;
        }
        // Envoy carries out a resume after the VM call, still inside the stream's own
        // request callback when it was made there: the router then gets the headers as the
        // whole request while the body has not been buffered yet (an HTTP/2 request whose
        // body ends in one frame reaches the upstream with none). The callback's own
        // `Continue` is the way.
        let own = context_id == c.data().active && c.data().export.starts_with("proxy_on_request_");
        if own {
            let misuse = format!("proxy_continue_stream inside context {context_id}'s own {}", c.data().export);
            c.data().shared().misuses.push(misuse);
        }
        c.data_mut().outbox.push(Outgoing::Resume { context_id });
        status::OK
    });
    wrap!(linker, "proxy_send_local_response", |c, (code, _dp, _dl, bp, bl, hp, hl, _grpc): I32x8| {
        let (Some(body), Some(headers)) = (read(c, bp, bl), read(c, hp, hl).and_then(|h| decode_map(&h))) else {
            return status::BAD_ARGUMENT;
        };
        let context_id = c.data().effective;
        if !c.data().streams.contains_key(&context_id) {
            return status::NOT_FOUND;
        }
        c.data_mut().local_replies.push_back(LocalReply { context_id, status: code as u16, headers, body });
        status::OK
    });
    wrap!(linker, "proxy_http_call", |c, (up, ul, hp, hl, bp, bl, _tp, _tl, timeout, ret): I32x10| {
        let (Some(cluster), Some(headers), Some(body)) =
            (read_str(c, up, ul), read(c, hp, hl).and_then(|h| decode_map(&h)), read(c, bp, bl))
        else {
            return status::BAD_ARGUMENT;
        };
        let required = [":method", ":path", ":authority"];
        if !required.iter().all(|r| headers.iter().any(|(k, _)| k == r)) {
            return status::BAD_ARGUMENT;
        }
        let token = {
            let state = c.data_mut();
            state.next_token += 1;
            state.next_token
        };
        if !write(c, ret, &token.to_le_bytes()) {
            return status::BAD_ARGUMENT;
        }
        let timeout_ms = timeout as u32 as u64;
        c.data_mut().outbox.push(Outgoing::Callout { token, cluster, headers, body, timeout_ms });
        status::OK
    });
    wrap!(linker, "proxy_set_effective_context", |c, (ctx,): (i32,)| {
        let ctx = ctx as u32;
        let state = c.data_mut();
        if ctx != state.root_id && !state.streams.contains_key(&ctx) {
            return status::BAD_ARGUMENT;
        }
        state.effective = ctx;
        status::OK
    });
    wrap!(linker, "proxy_done", |c, _unit: ()| {
        c.data_mut().done = true;
        status::OK
    });
    wrap!(linker, "proxy_define_metric", |c, (_kind, np, nl, ret): (i32, i32, i32, i32)| {
        let Some(name) = read_str(c, np, nl) else { return status::BAD_ARGUMENT };
        let id = {
            let state = c.data_mut();
            state.next_metric += 1;
            let id = state.next_metric;
            state.metric_names.insert(id, format!("wasmcustom.{name}"));
            id
        };
        if write(c, ret, &id.to_le_bytes()) {
            status::OK
        } else {
            status::BAD_ARGUMENT
        }
    });
    wrap!(linker, "proxy_increment_metric", |c, (id, offset): (i32, i64)| {
        let Some(name) = c.data().metric_names.get(&(id as u32)).cloned() else { return status::NOT_FOUND };
        if offset <= 0 {
            return status::BAD_ARGUMENT;
        }
        *c.data().shared().metrics.entry(name).or_default() += offset;
        status::OK
    });
    wrap!(linker, "proxy_record_metric", |c, (id, value): (i32, i64)| {
        let Some(name) = c.data().metric_names.get(&(id as u32)).cloned() else { return status::NOT_FOUND };
        c.data().shared().metrics.insert(name, value);
        status::OK
    });
    wrap!(linker, "proxy_get_metric", |c, (id, ret): (i32, i32)| {
        let Some(name) = c.data().metric_names.get(&(id as u32)).cloned() else { return status::NOT_FOUND };
        let value = c.data().shared().metrics.get(&name).copied().unwrap_or(0);
        if write(c, ret, &value.to_le_bytes()) {
            status::OK
        } else {
            status::BAD_ARGUMENT
        }
    });
    Ok(())
}

/// Registering a name again re-points it: the last registrant receives `on_queue_ready`.
fn register_queue(shared: &mut Shared, vm_id: String, name: String, owner: (usize, u32)) -> u32 {
    let existing = shared.queues.iter().find(|(_, q)| q.vm_id == vm_id && q.name == name).map(|(id, _)| *id);
    if let Some(q) = existing.and_then(|id| shared.queues.get_mut(&id)) {
        q.owner = Some(owner);
    }
    existing.unwrap_or_else(|| {
        shared.next_queue_id = shared.next_queue_id.max(1);
        let id = shared.next_queue_id;
        shared.next_queue_id += 1;
        shared.queues.insert(id, Queue { vm_id, name, owner: Some(owner), items: Default::default() });
        id
    })
}

/// Every `env` import answers `Unimplemented` unless defined afterwards (shadowing).
fn stub_everything(linker: &mut Linker<VmState>, module: &Module) -> wasmtime::Result<()> {
    for import in module.imports() {
        let wasmtime::ExternType::Func(ty) = import.ty() else { continue };
        if import.module() != "env" {
            continue;
        }
        let returns_i32 = ty.results().len() == 1 && matches!(ty.results().next(), Some(ValType::I32));
        linker.func_new_async("env", import.name(), ty.clone(), move |_c, _params, results| {
            Box::new(async move {
                if returns_i32 {
                    results[0] = Val::I32(status::UNIMPLEMENTED);
                }
                Ok(())
            })
        })?;
    }
    Ok(())
}
