//! Host state: what every VM shares (Envoy's process-wide shared data, queues, metrics)
//! and what each VM keeps for itself (its contexts, buffers and the actions it asked for).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use wasmtime_wasi::p1::WasiP1Ctx;

pub type Headers = Vec<(String, String)>;

/// Status codes of the proxy-wasm ABI 0.2.1.
pub mod status {
    pub const OK: i32 = 0;
    pub const NOT_FOUND: i32 = 1;
    pub const BAD_ARGUMENT: i32 = 2;
    pub const EMPTY: i32 = 7;
    pub const CAS_MISMATCH: i32 = 8;
    pub const INTERNAL_FAILURE: i32 = 10;
    pub const UNIMPLEMENTED: i32 = 12;
}

/// The time every VM sees: wall clock for `serve`, a virtual clock for tests.
#[derive(Clone)]
pub enum Clock {
    Real,
    Virtual(Arc<AtomicU64>),
}

impl Clock {
    pub fn now_ms(&self) -> u64 {
        match self {
            Clock::Real => {
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
            }
            Clock::Virtual(ms) => ms.load(Ordering::SeqCst),
        }
    }
}

pub struct Queue {
    pub vm_id: String,
    pub name: String,
    /// The worker whose root context receives `on_queue_ready`; `None` once its VM is gone.
    pub owner: Option<(usize, u32)>,
    pub items: VecDeque<Vec<u8>>,
}

/// Envoy's process-wide state, modelled as `docs/envoy-facts.md` describes it.
#[derive(Default)]
pub struct Shared {
    /// key → (value, cas). Keys are never removed.
    pub data: HashMap<String, (Vec<u8>, u32)>,
    /// The one process-wide CAS counter (starts at 1, skips 0 on wrap).
    pub cas_counter: u32,
    pub queues: HashMap<u32, Queue>,
    pub next_queue_id: u32,
    /// `on_queue_ready` owed: (worker, root context, queue id), drained by the world.
    pub queue_ready: Vec<(usize, u32, u32)>,
    /// Stats by name, summed over VMs (metric ids are per VM).
    pub metrics: HashMap<String, i64>,
    pub logs: Vec<String>,
    /// proxy-wasm host calls made, by import name, over all VMs (for the profile).
    pub host_calls: std::collections::BTreeMap<&'static str, u64>,
    /// Fuel (about one unit per wasm instruction) burnt in each export, over all VMs, when
    /// the engine meters fuel.
    pub fuel: std::collections::BTreeMap<String, u64>,
    /// With fuel metered and this set: every host call as (export being run, import
    /// called, fuel left when called), to see what the wasm did between two host calls.
    pub fuel_trace: Option<Vec<(String, &'static str, u64)>>,
    /// With a module instrumented by Binaryen's `--log-execution` and this set: at every
    /// function entry, loop header and return it logs, the innermost frame's function
    /// (its name-section name) whose name is the plugin crate's (`make walk`).
    pub walk: Option<Vec<String>>,
    /// Imports that answer `InternalFailure` whatever they are asked (a host whose calls
    /// fail in ways the SDK's wrappers do not expect).
    pub failing_calls: std::collections::BTreeSet<&'static str>,
    /// Host calls Envoy would carry out wrongly, as the VM made them (the world reports
    /// each as a trap).
    pub misuses: Vec<String>,
}

impl Shared {
    pub fn with_next_cas(next: u32) -> Shared {
        Shared { cas_counter: next.wrapping_sub(1), next_queue_id: 1, ..Shared::default() }
    }

    pub fn next_cas(&mut self) -> u32 {
        self.cas_counter = self.cas_counter.wrapping_add(1);
        if self.cas_counter == 0 {
            self.cas_counter = 1;
        }
        self.cas_counter
    }
}

pub type SharedRef = Arc<Mutex<Shared>>;

pub fn lock(shared: &SharedRef) -> MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

/// One HTTP stream as the VM sees it.
#[derive(Default)]
pub struct Stream {
    pub request_headers: Headers,
    pub request_body: Vec<u8>,
    /// Bytes of the request body the host has received (Envoy's `bytesReceived`): none
    /// while the headers are delivered, all of it from then on.
    pub body_received: u64,
    pub response_headers: Headers,
    pub response_body: Vec<u8>,
}

/// A local reply the VM asked for. Envoy defers it until the VM call returns, then sends
/// it through the encoder chain, this filter's own response callbacks included.
#[derive(Debug, Clone)]
pub struct LocalReply {
    pub context_id: u32,
    pub status: u16,
    pub headers: Headers,
    pub body: Vec<u8>,
}

/// What a VM asked the host to do; performed after the VM call returns, as Envoy does.
#[derive(Debug, Clone)]
pub enum Outgoing {
    Callout {
        token: u32,
        cluster: String,
        headers: Headers,
        body: Vec<u8>,
        timeout_ms: u64,
    },
    /// A local reply that went through the encoder chain: what the client receives.
    Reply(LocalReply),
    Resume {
        context_id: u32,
    },
}

/// Per-VM host state (one wasmtime `Store` each).
pub struct VmState {
    pub wasi: WasiP1Ctx,
    pub worker: usize,
    pub vm_id: String,
    pub plugin_config: Vec<u8>,
    pub vm_config: Vec<u8>,
    pub shared: SharedRef,
    pub clock: Clock,
    /// Yield to the scheduler at every shared-state call (deterministic interleavings).
    pub yields: bool,
    /// Envoy's filter setting: without it a request paused on headers never gets its body.
    pub allow_on_headers_stop_iteration: bool,
    pub root_id: u32,
    pub active: u32,
    pub effective: u32,
    pub streams: HashMap<u32, Stream>,
    /// Streams whose `proxy_on_delete` ran but whose Envoy context awaits its deferred
    /// delete (the end of the event-loop turn): `set_effective_context` still resolves them.
    pub deleted: HashSet<u32>,
    /// Local replies deferred until the VM call returns (Envoy's after-VM-call actions).
    pub local_replies: VecDeque<LocalReply>,
    /// Headers and body of the callout being delivered, during `on_http_call_response`.
    pub callout_response: Option<(Headers, Vec<u8>)>,
    pub outbox: Vec<Outgoing>,
    pub next_token: u32,
    pub tick_ms: Option<u64>,
    /// The export being called (for `Shared::fuel_trace`).
    pub export: String,
    pub metric_names: HashMap<u32, String>,
    pub next_metric: u32,
    /// Set when the VM called `proxy_done`.
    pub done: bool,
}

impl VmState {
    pub fn shared(&self) -> MutexGuard<'_, Shared> {
        lock(&self.shared)
    }
}
