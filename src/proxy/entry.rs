//! The VM's exports: Envoy's callbacks (proxy-wasm ABI 0.2.1) handed to the worker's root
//! context and its http contexts.
//!
//! Every upstream callout is the root context's: Envoy makes a callout its caller's root
//! context's (`proxy_http_call` runs on the root of the effective context) and delivers the
//! answer there, whether or not the request that led to it is still there. So an http
//! context may dispatch a call itself, inside its own callback, and the answer still comes
//! to the root context after the client has gone.
//!
//! No callback panics: a context id Envoy does not know is ignored (a stream callback then
//! lets the stream go on untouched), and a callback that arrives while another of this VM
//! is still running (Envoy does not do that: its actions wait for the VM call to return) is
//! dropped the same way.

use super::host;
use super::http::Chat;
use super::ids::IdMap;
use super::root::Root;
use super::types::{Action, LogLevel};
use std::cell::RefCell;

/// The VM's contexts: its root context (one per plugin configuration; Envoy gives each
/// its own id) and the http contexts they made, each with its root's id.
#[derive(Default)]
struct Contexts {
    roots: Vec<(u32, Root)>,
    streams: IdMap<(u32, Chat)>,
}

thread_local! {
    static CONTEXTS: RefCell<Contexts> = RefCell::new(Contexts::default());
}

impl Contexts {
    fn root(&mut self, id: u32) -> Option<&mut Root> {
        self.roots.iter_mut().find(|(r, _)| *r == id).map(|(_, root)| root)
    }
}

/// Runs `f` on the VM's contexts; `None` when they are in use (a callback inside another).
fn with<T>(f: impl FnOnce(&mut Contexts) -> Option<T>) -> Option<T> {
    CONTEXTS.with(|c| match c.try_borrow_mut() {
        Ok(mut contexts) => f(&mut contexts),
        Err(_) => {
            host::log(LogLevel::Critical, "holysheep: a callback arrived inside another; dropped");
            None
        }
    })
}

/// An http context's response callback; a stream the VM does not know goes on untouched.
fn stream(id: u32, f: impl FnOnce(&mut Chat) -> Action) -> u32 {
    with(|c| c.streams.get_mut(&id).map(|(_, chat)| f(chat))).unwrap_or(Action::Continue) as u32
}

/// An http context's request callback, as `stream`. A call the stream handed to its root
/// context leaves before the VM call returns (its answer comes to the root context all the
/// same). Response callbacks hand over no call, and dispatch nothing: they may run inside
/// a chain of local replies, whose depth the root context bounds.
fn request(id: u32, f: impl FnOnce(&mut Chat) -> Action) -> u32 {
    with(|c| {
        let _clock = host::pin_clock();
        let (root_id, chat) = c.streams.get_mut(&id)?;
        let (root_id, action) = (*root_id, f(chat));
        let sent = c.root(root_id).is_some_and(|root| root.dispatch_handed(id));
        Some(if sent { Action::Continue } else { action })
    })
    .unwrap_or(Action::Continue) as u32
}

/// A root context's callback.
fn root<T>(id: u32, f: impl FnOnce(&mut Root) -> T) -> Option<T> {
    with(|c| c.root(id).map(f))
}

extern "C" {
    /// The module's constructors (wasm-ld makes it).
    fn __wasm_call_ctors();
}

/// Envoy calls it once, before any callback.
#[no_mangle]
pub extern "C" fn _initialize() {
    // SAFETY: called once, by the host, before anything else runs in the module.
    unsafe { __wasm_call_ctors() };
    // Nothing panics by design; should something all the same, Envoy's log says what
    // before the VM stops.
    std::panic::set_hook(Box::new(|panic| host::log(LogLevel::Critical, &panic.to_string())));
}

/// The ABI this module speaks.
#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

/// Memory for what the host hands over: a boxed `[u8]` of exactly `size` bytes, which the
/// shell takes back with `Vec::from_raw_parts(data, size, size)` (`abi::host_bytes`).
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    Box::into_raw(vec![0u8; size].into_boxed_slice()).cast::<u8>()
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(context_id: u32, root_context_id: u32) {
    with(|c| {
        if root_context_id == 0 {
            c.roots.retain(|(id, _)| *id != context_id);
            c.roots.push((context_id, Root::new()));
        } else {
            let chat = c.root(root_context_id)?.new_stream(context_id);
            c.streams.insert(context_id, (root_context_id, chat));
        }
        Some(())
    });
}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_root_context_id: u32, _vm_configuration_size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(root_context_id: u32, plugin_configuration_size: usize) -> u32 {
    u32::from(root(root_context_id, |r| r.on_configure(plugin_configuration_size)).unwrap_or(false))
}

#[no_mangle]
pub extern "C" fn proxy_on_tick(root_context_id: u32) {
    root(root_context_id, Root::on_tick);
}

#[no_mangle]
pub extern "C" fn proxy_on_queue_ready(root_context_id: u32, queue_id: u32) {
    root(root_context_id, |r| r.on_queue_ready(queue_id));
}

/// A callout's answer, for the root context that owns it (`context_id`, or the VM's first
/// root should a host name another context). The VM call starts with its context
/// effective: nothing to set.
#[no_mangle]
pub extern "C" fn proxy_on_http_call_response(
    context_id: u32,
    token: u32,
    num_headers: usize,
    body_size: usize,
    num_trailers: usize,
) {
    with(|c| {
        let id = if c.root(context_id).is_some() { context_id } else { c.roots.first()?.0 };
        c.root(id)?.on_http_call_response(token, num_headers, body_size, num_trailers);
        Some(())
    });
}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(context_id: u32, num_headers: usize, end_of_stream: bool) -> u32 {
    request(context_id, |s| s.on_http_request_headers(num_headers, end_of_stream))
}

#[no_mangle]
pub extern "C" fn proxy_on_request_body(context_id: u32, body_size: usize, end_of_stream: bool) -> u32 {
    request(context_id, |s| s.on_http_request_body(body_size, end_of_stream))
}

#[no_mangle]
pub extern "C" fn proxy_on_request_trailers(context_id: u32, num_trailers: usize) -> u32 {
    request(context_id, |s| s.on_http_request_trailers(num_trailers))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(context_id: u32, num_headers: usize, end_of_stream: bool) -> u32 {
    stream(context_id, |s| s.on_http_response_headers(num_headers, end_of_stream))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_body(context_id: u32, body_size: usize, end_of_stream: bool) -> u32 {
    stream(context_id, |s| s.on_http_response_body(body_size, end_of_stream))
}

/// The stream is done: an http context is never answered after this. A root context hands
/// Envoy the counters it held and is done at once.
#[no_mangle]
pub extern "C" fn proxy_on_done(context_id: u32) -> u32 {
    with(|c| {
        if let Some((_, s)) = c.streams.get_mut(&context_id) {
            s.on_done();
        } else if let Some(root) = c.root(context_id) {
            root.on_done();
        }
        Some(())
    });
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_delete(context_id: u32) {
    with(|c| {
        if c.streams.remove(&context_id).is_none() {
            c.roots.retain(|(id, _)| *id != context_id);
        }
        Some(())
    });
}
