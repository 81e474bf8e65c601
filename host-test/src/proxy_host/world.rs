//! A process of Envoy as the plugin sees it: a short-lived canary VM, then N worker VMs
//! (one wasmtime `Store` each) with their own event queues, sharing shared data and
//! queues. A seeded scheduler picks which runnable VM advances at every shared-state call,
//! so an interleaving that fails can be replayed from its seed; time is virtual in tests
//! and real in `serve`.

use super::abi;
use super::state::{lock, Clock, Headers, LocalReply, Outgoing, Shared, SharedRef, Stream, VmState};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use wasmtime::{Config, Engine, Instance, Linker, Module, Store, Val};

/// The root context id of every VM (per-VM counters collide across workers, as in Envoy).
pub const ROOT: u32 = 1;

/// How many deferred local replies one VM call may leave before the VM's stack overflows.
/// Envoy runs them one inside another: each reply's trip through the encoder chain calls
/// `proxy_on_response_headers`, whose own after-call actions send the next reply. Measured
/// on Envoy 1.40 (V8): 250 replies from one VM call passed, 350 crashed with
/// "Maximum call stack size exceeded".
pub const LOCAL_REPLY_DEPTH_LIMIT: usize = 300;

/// Bytes per chunk of an answer that passes through the filter (a prime, so chunk
/// boundaries fall anywhere in events).
pub const RESPONSE_CHUNK: usize = 97;

/// The compiled plugin, shared by every VM.
#[derive(Clone)]
pub struct Plugin {
    engine: Engine,
    module: Module,
    linker: Arc<Linker<VmState>>,
}

impl Plugin {
    pub fn load(path: &Path) -> wasmtime::Result<Plugin> {
        Plugin::load_with(path, &Config::new())
    }

    /// Loads with this engine configuration (e.g. a perf map for profiling).
    pub fn load_with(path: &Path, config: &Config) -> wasmtime::Result<Plugin> {
        let engine = Engine::new(config)?;
        let module = Module::from_file(&engine, path)?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p1::add_to_linker_async(&mut linker, |s: &mut VmState| &mut s.wasi)?;
        abi::add_to_linker(&mut linker, &module)?;
        Ok(Plugin { engine, module, linker: Arc::new(linker) })
    }
}

/// An HTTP request handed to a worker.
pub type ReqId = u64;

/// What the client of a request got (the same shape the HTTP client reads).
pub type Answer = crate::client::Resp;

/// A call leaving the process: a callout, or a request the plugin let through.
#[derive(Debug, Clone)]
pub struct UpstreamCall {
    pub worker: usize,
    pub token: u32,
    pub cluster: String,
    pub headers: Headers,
    pub body: Vec<u8>,
    pub timeout_ms: u64,
}

/// How the upstream answers: `Some((delay, response))` to deliver after `delay` ms
/// (`response: None` is a reset), or `None` when the caller delivers it itself later
/// with [`World::callout_done`].
pub type Delivery = Option<(u64, Option<(Headers, Vec<u8>)>)>;
pub type Upstream = Box<dyn FnMut(&UpstreamCall) -> Delivery + Send>;

#[derive(Debug)]
enum Event {
    /// `trailers`: the body ends with trailers (HTTP/2, or HTTP/1 chunked), so its last
    /// data callback does not end the stream; `proxy_on_request_trailers` does.
    Request {
        ctx: u32,
        headers: Headers,
        body: Vec<u8>,
        trailers: Option<Headers>,
    },
    Reset {
        ctx: u32,
    },
    CalloutDone {
        token: u32,
        response: Option<(Headers, Vec<u8>)>,
    },
    Passthrough {
        ctx: u32,
        response: Option<(Headers, Vec<u8>)>,
    },
    /// For the root context that registered the queue (dropped once it is gone).
    QueueReady {
        root: u32,
        queue: u32,
    },
    Tick,
    /// A new configuration, as Envoy applies a changed filter configuration to a running
    /// VM: a new root context `root` made and configured, then the old one done and deleted.
    Reload {
        root: u32,
        config: String,
    },
}

struct Vm {
    store: Store<VmState>,
    instance: Instance,
}

type Task = Pin<Box<dyn Future<Output = (Vm, wasmtime::Result<()>)> + Send>>;

struct Worker {
    vm: Option<Vm>,
    task: Option<Task>,
    alive: bool,
    events: VecDeque<Event>,
    next_ctx: u32,
    requests: HashMap<u32, ReqId>,
    next_tick: Option<u64>,
    tick_period: Option<u64>,
    /// Passthrough callouts: token → http context.
    passthrough: HashMap<u32, u32>,
}

pub struct Options {
    pub workers: usize,
    pub plugin_config: String,
    pub env: Vec<(String, String)>,
    pub seed: u64,
    pub clock: Clock,
    /// Yield at every shared-state call (deterministic interleavings).
    pub yields: bool,
    pub shared: Shared,
    /// The wasm filter's `allow_on_headers_stop_iteration` (true unless a test misconfigures).
    pub allow_on_headers_stop_iteration: bool,
}

impl Options {
    pub fn new(workers: usize, plugin_config: &str, seed: u64) -> Options {
        Options {
            workers,
            plugin_config: plugin_config.to_owned(),
            env: Vec::new(),
            seed,
            clock: Clock::Virtual(Arc::new(AtomicU64::new(1_000_000))),
            yields: true,
            shared: Shared::with_next_cas(1),
            allow_on_headers_stop_iteration: true,
        }
    }
}

pub struct World {
    plugin: Plugin,
    options: Options,
    shared: SharedRef,
    workers: Vec<Worker>,
    timers: BTreeMap<(u64, u64), (usize, Event)>,
    seq: u64,
    rng: u64,
    next_req: ReqId,
    owner: HashMap<ReqId, (usize, u32)>,
    answers: HashMap<ReqId, Answer>,
    upstream: Upstream,
    pub upstream_calls: Vec<UpstreamCall>,
    /// Traps and failed VM calls: a correct plugin has none.
    pub traps: Vec<String>,
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl World {
    /// Starts the canary VM (configured, then destroyed), then the workers' VMs.
    pub fn start(plugin: &Plugin, mut options: Options, upstream: Upstream) -> wasmtime::Result<World> {
        let shared = Arc::new(std::sync::Mutex::new(std::mem::take(&mut options.shared)));
        let mut world = World {
            plugin: plugin.clone(),
            rng: options.seed,
            options,
            shared,
            workers: Vec::new(),
            timers: BTreeMap::new(),
            seq: 0,
            next_req: 1,
            owner: HashMap::new(),
            answers: HashMap::new(),
            upstream,
            upstream_calls: Vec::new(),
            traps: Vec::new(),
        };
        let canary = world.boot(usize::MAX)?;
        drop(canary);
        world.forget_queues_of(usize::MAX);
        for w in 0..world.options.workers {
            let vm = world.boot(w)?;
            let tick = vm.store.data().tick_ms;
            let now = world.now();
            world.workers.push(Worker {
                vm: Some(vm),
                task: None,
                alive: true,
                events: VecDeque::new(),
                next_ctx: ROOT + 1,
                requests: HashMap::new(),
                next_tick: tick.map(|t| now + t),
                tick_period: tick,
                passthrough: HashMap::new(),
            });
        }
        Ok(world)
    }

    fn boot(&mut self, worker: usize) -> wasmtime::Result<Vm> {
        let mut wasi = wasmtime_wasi::WasiCtxBuilder::new();
        for (k, v) in &self.options.env {
            wasi.env(k, v);
        }
        let state = VmState {
            wasi: wasi.build_p1(),
            worker,
            vm_id: "holysheep".into(),
            plugin_config: self.options.plugin_config.clone().into_bytes(),
            vm_config: Vec::new(),
            shared: self.shared.clone(),
            clock: self.options.clock.clone(),
            yields: self.options.yields,
            allow_on_headers_stop_iteration: self.options.allow_on_headers_stop_iteration,
            root_id: ROOT,
            active: ROOT,
            effective: ROOT,
            streams: HashMap::new(),
            deleted: Default::default(),
            local_replies: Default::default(),
            callout_response: None,
            outbox: Vec::new(),
            next_token: 0,
            tick_ms: None,
            export: String::new(),
            metric_names: HashMap::new(),
            next_metric: 0,
            done: false,
        };
        let mut store = Store::new(&self.plugin.engine, state);
        // With an engine that meters fuel (wasm_profile), enough for any run; an error otherwise.
        let _ = store.set_fuel(u64::MAX / 2);
        let linker = self.plugin.linker.clone();
        let module = self.plugin.module.clone();
        let mut vm = block_on(async move {
            let instance = linker.instantiate_async(&mut store, &module).await?;
            wasmtime::Result::<Vm>::Ok(Vm { store, instance })
        })?;
        let config_len = self.options.plugin_config.len() as u32;
        let configured = block_on(async {
            if let Some(init) = vm.instance.get_func(&mut vm.store, "_initialize") {
                init.call_async(&mut vm.store, &[], &mut []).await?;
            }
            start_root(&mut vm, ROOT, config_len).await
        })?;
        if configured != Some(1) {
            let logs = self.logs().join("\n");
            return Err(wasmtime::Error::msg(format!("the plugin refused its configuration:\n{logs}")));
        }
        vm.store.data_mut().outbox.clear();
        Ok(vm)
    }

    pub fn now(&self) -> u64 {
        self.options.clock.now_ms()
    }

    pub fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        lock(&self.shared)
    }

    pub fn logs(&self) -> Vec<String> {
        self.shared().logs.clone()
    }

    /// Hands a request to `worker`; its answer appears in [`World::answer`].
    pub fn request(&mut self, worker: usize, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> ReqId {
        self.request_with_trailers(worker, method, path, headers, body, None)
    }

    /// A request whose body is followed by `trailers`.
    pub fn request_with_trailers(
        &mut self,
        worker: usize,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        trailers: Option<Headers>,
    ) -> ReqId {
        let id = self.next_req;
        self.next_req += 1;
        let w = &mut self.workers[worker];
        let ctx = w.next_ctx;
        w.next_ctx += 1;
        w.requests.insert(ctx, id);
        self.owner.insert(id, (worker, ctx));
        let mut all: Headers = vec![
            (":method".into(), method.into()),
            (":path".into(), path.into()),
            (":authority".into(), "edge".into()),
            (":scheme".into(), "http".into()),
            ("x-forwarded-proto".into(), "http".into()),
            ("content-length".into(), body.len().to_string()),
        ];
        all.extend(headers.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        w.events.push_back(Event::Request { ctx, headers: all, body: body.to_vec(), trailers });
        id
    }

    /// The client of `id` goes away (now, unless it has its answer already).
    pub fn reset(&mut self, id: ReqId) {
        if let Some((worker, ctx)) = self.owner.get(&id).copied() {
            self.workers[worker].events.push_back(Event::Reset { ctx });
        }
    }

    /// The client of `id` goes away at virtual time `at_ms`: in the same event-loop turn
    /// as the other events due then, in the order they were scheduled.
    pub fn reset_at(&mut self, id: ReqId, at_ms: u64) {
        if let Some((worker, ctx)) = self.owner.get(&id).copied() {
            self.seq += 1;
            self.timers.insert((at_ms, self.seq), (worker, Event::Reset { ctx }));
        }
    }

    pub fn answer(&self, id: ReqId) -> Option<&Answer> {
        self.answers.get(&id)
    }

    /// Removes and returns the answer of `id` (a long-running host must not keep them).
    pub fn take_answer(&mut self, id: ReqId) -> Option<Answer> {
        let answer = self.answers.remove(&id)?;
        self.owner.remove(&id);
        Some(answer)
    }

    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Every VM goes (a configuration reload, or a drain): what Envoy's process keeps,
    /// its shared data and queues, is handed back for the next configuration's VMs.
    pub fn stop(mut self) -> Shared {
        for w in 0..self.workers.len() {
            self.kill(w);
        }
        std::mem::take(&mut *self.shared())
    }

    /// The worker's VM dies with its thread: no more events, its callouts never answer,
    /// its queue wakes no one.
    pub fn kill(&mut self, worker: usize) {
        let w = &mut self.workers[worker];
        w.alive = false;
        w.vm = None;
        w.task = None;
        w.events.clear();
        self.forget_queues_of(worker);
    }

    fn forget_queues_of(&self, worker: usize) {
        for q in self.shared().queues.values_mut() {
            if q.owner.is_some_and(|(w, _)| w == worker) {
                q.owner = None;
            }
        }
    }

    /// Applies a changed `config` to every live worker's VM as Envoy does: a new root
    /// context made and configured, then the old one's `proxy_on_done` and
    /// `proxy_on_delete`. Runs when the worker's earlier events have. Envoy keeps the old
    /// root context until the last stream made under it ends; this host ends it at once,
    /// so a reload with a request still open is reported as a fault.
    pub fn reload(&mut self, config: &str) {
        for (n, w) in self.workers.iter_mut().enumerate().filter(|(_, w)| w.alive) {
            if !w.requests.is_empty() {
                self.traps.push(format!("worker {n}: reloaded with {} request(s) open", w.requests.len()));
            }
            let root = w.next_ctx;
            w.next_ctx += 1;
            w.events.push_back(Event::Reload { root, config: config.to_owned() });
        }
    }

    /// Delivers a callout answer that the upstream function deferred (`serve`).
    pub fn callout_done(&mut self, worker: usize, token: u32, response: Option<(Headers, Vec<u8>)>) {
        let Some(w) = self.workers.get_mut(worker).filter(|w| w.alive) else { return };
        match w.passthrough.remove(&token) {
            Some(ctx) => w.events.push_back(Event::Passthrough { ctx, response }),
            None => w.events.push_back(Event::CalloutDone { token, response }),
        }
    }

    /// Runs what is runnable now, interleaving VMs at shared-state calls. `false` when
    /// nothing was runnable.
    pub fn step(&mut self) -> bool {
        for w in 0..self.workers.len() {
            self.start_task(w);
        }
        let running: Vec<usize> = (0..self.workers.len()).filter(|w| self.workers[*w].task.is_some()).collect();
        if running.is_empty() {
            return false;
        }
        let w = running[(splitmix(&mut self.rng) % running.len() as u64) as usize];
        let Some(task) = self.workers[w].task.as_mut() else { return false };
        let mut cx = Context::from_waker(Waker::noop());
        if let Poll::Ready((vm, result)) = task.as_mut().poll(&mut cx) {
            self.workers[w].task = None;
            if let Err(e) = result {
                self.traps.push(format!("worker {w}: {e:#}"));
            }
            let misuses = std::mem::take(&mut self.shared().misuses);
            self.traps.extend(misuses.into_iter().map(|m| format!("worker {w}: {m}")));
            self.workers[w].vm = Some(vm);
            self.after_call(w);
            if self.workers[w].events.is_empty() {
                self.end_turn(w);
            }
        }
        true
    }

    /// The worker's event loop ran out of events: Envoy deletes the streams whose
    /// deletion it deferred, and their ids no longer resolve.
    fn end_turn(&mut self, w: usize) {
        let Some(vm) = self.workers[w].vm.as_mut() else { return };
        let state = vm.store.data_mut();
        for ctx in std::mem::take(&mut state.deleted) {
            state.streams.remove(&ctx);
        }
    }

    /// Runs until nothing is runnable at the current time.
    pub fn settle(&mut self) {
        while self.step() {}
    }

    /// Virtual time: runs, advancing the clock event by event, until `done` holds or
    /// `max_ms` of virtual time passed. Returns whether `done` held.
    pub fn run_until(&mut self, max_ms: u64, mut done: impl FnMut(&World) -> bool) -> bool {
        let Clock::Virtual(clock) = self.options.clock.clone() else { return false };
        let deadline = self.now() + max_ms;
        loop {
            self.settle();
            if done(self) {
                return true;
            }
            let Some(next) = self.next_due().filter(|t| *t <= deadline) else { return done(self) };
            clock.store(next.max(self.now()), Ordering::SeqCst);
            self.release_due();
        }
    }

    /// Real time: moves due timers and ticks into the workers' queues.
    pub fn release_due(&mut self) {
        let now = self.now();
        let due: Vec<(u64, u64)> = self.timers.range(..=(now, u64::MAX)).map(|(k, _)| *k).collect();
        for k in due {
            if let Some((w, event)) = self.timers.remove(&k) {
                if self.workers[w].alive {
                    self.workers[w].events.push_back(event);
                }
            }
        }
        for w in &mut self.workers {
            if w.alive && w.next_tick.is_some_and(|t| t <= now) {
                w.events.push_back(Event::Tick);
                w.next_tick = w.tick_period.map(|p| now + p);
            }
        }
    }

    /// When the next timer or tick is due.
    pub fn next_due(&self) -> Option<u64> {
        let timer = self.timers.keys().next().map(|(t, _)| *t);
        let tick = self.workers.iter().filter(|w| w.alive).filter_map(|w| w.next_tick).min();
        timer.into_iter().chain(tick).min()
    }

    fn start_task(&mut self, w: usize) {
        let worker = &mut self.workers[w];
        if !worker.alive || worker.task.is_some() {
            return;
        }
        let Some(event) = worker.events.pop_front() else { return };
        if let Event::Reset { ctx } = event {
            // A client that left gets no answer.
            worker.requests.remove(&ctx);
        }
        let Some(vm) = worker.vm.take() else { return };
        worker.task = Some(Box::pin(async move {
            let mut vm = vm;
            let result = deliver(&mut vm, event).await;
            (vm, result)
        }));
    }

    /// Performs what the VM asked for during its call, as Envoy does after the call returns.
    fn after_call(&mut self, w: usize) {
        let now = self.now();
        let (outbox, tick) = match self.workers[w].vm.as_mut() {
            Some(vm) => (std::mem::take(&mut vm.store.data_mut().outbox), vm.store.data().tick_ms),
            None => return,
        };
        let worker = &mut self.workers[w];
        if worker.tick_period != tick {
            worker.tick_period = tick;
            worker.next_tick = tick.map(|t| now + t);
        }
        for out in outbox {
            match out {
                Outgoing::Callout { token, cluster, headers, body, timeout_ms } => {
                    let call = UpstreamCall { worker: w, token, cluster, headers, body, timeout_ms };
                    self.send_upstream(call, None);
                }
                Outgoing::Reply(LocalReply { context_id, status, headers, body }) => {
                    self.finish_stream(w, context_id, Answer { status, headers, body });
                }
                Outgoing::Resume { context_id } => self.pass_through(w, context_id),
            }
        }
        let ready = std::mem::take(&mut self.shared().queue_ready);
        for (worker, root, queue) in ready {
            if let Some(target) = self.workers.get_mut(worker).filter(|t| t.alive) {
                target.events.push_back(Event::QueueReady { root, queue });
            }
        }
    }

    fn send_upstream(&mut self, call: UpstreamCall, passthrough: Option<u32>) {
        let (w, token, timeout) = (call.worker, call.token, call.timeout_ms);
        self.upstream_calls.push(call.clone());
        if let Some(ctx) = passthrough {
            self.workers[w].passthrough.insert(token, ctx);
        }
        let Some((delay, response)) = (self.upstream)(&call) else { return };
        // A callout that outlives its timeout fails as (0, 0, 0).
        let (delay, response) = if timeout > 0 && delay > timeout { (timeout, None) } else { (delay, response) };
        let event = match passthrough {
            Some(ctx) => {
                self.workers[w].passthrough.remove(&token);
                Event::Passthrough { ctx, response }
            }
            None => Event::CalloutDone { token, response },
        };
        self.seq += 1;
        self.timers.insert((self.now() + delay, self.seq), (w, event));
    }

    fn pass_through(&mut self, w: usize, ctx: u32) {
        let Some(vm) = self.workers[w].vm.as_mut() else { return };
        if vm.store.data().deleted.contains(&ctx) {
            return;
        }
        let Some(stream) = vm.store.data().streams.get(&ctx) else { return };
        let (headers, body) = (stream.request_headers.clone(), stream.request_body.clone());
        let token = {
            let s = vm.store.data_mut();
            s.next_token += 1;
            s.next_token
        };
        let call = UpstreamCall { worker: w, token, cluster: "holysheep".into(), headers, body, timeout_ms: 0 };
        self.send_upstream(call, Some(ctx));
    }

    fn finish_stream(&mut self, w: usize, ctx: u32, answer: Answer) {
        let worker = &mut self.workers[w];
        if let Some(id) = worker.requests.remove(&ctx) {
            self.answers.entry(id).or_insert(answer);
            worker.events.push_back(Event::Reset { ctx });
        }
    }
}

/// Calls an export with `ctx` active and effective. `None` if the export is absent.
async fn call(vm: &mut Vm, name: &str, ctx: u32, args: &[Val]) -> wasmtime::Result<Option<i32>> {
    let Some(func) = vm.instance.get_func(&mut vm.store, name) else { return Ok(None) };
    {
        let state = vm.store.data_mut();
        state.active = ctx;
        state.effective = ctx;
    }
    let mut results = vec![Val::I32(0); func.ty(&vm.store).results().len()];
    vm.store.data_mut().export.replace_range(.., name);
    let fuel_before = vm.store.get_fuel().ok();
    if let Some(before) = fuel_before {
        if let Some(trace) = vm.store.data().shared().fuel_trace.as_mut() {
            trace.push((name.to_owned(), "(called)", before));
        }
    }
    func.call_async(&mut vm.store, args, &mut results).await?;
    if let (Some(before), Ok(after)) = (fuel_before, vm.store.get_fuel()) {
        *vm.store.data().shared().fuel.entry(name.to_owned()).or_default() += before.saturating_sub(after);
        if let Some(trace) = vm.store.data().shared().fuel_trace.as_mut() {
            trace.push((name.to_owned(), "(returned)", after));
        }
    }
    state_reset(vm);
    Ok(results.first().and_then(Val::i32))
}

/// A root context made, started and given its configuration of `config_len` bytes, as
/// Envoy starts every root context: what `proxy_on_configure` returned.
async fn start_root(vm: &mut Vm, root: u32, config_len: u32) -> wasmtime::Result<Option<i32>> {
    let i = |v: u32| Val::I32(v as i32);
    call(vm, "proxy_on_context_create", root, &[i(root), i(0)]).await?;
    call(vm, "proxy_on_vm_start", root, &[i(root), i(0)]).await?;
    call(vm, "proxy_on_configure", root, &[i(root), i(config_len)]).await
}

fn state_reset(vm: &mut Vm) {
    let state = vm.store.data_mut();
    state.active = state.root_id;
    state.effective = state.root_id;
}

fn replied(vm: &Vm, ctx: u32) -> bool {
    vm.store.data().local_replies.iter().any(|r| r.context_id == ctx)
}

/// Envoy's after-VM-call actions: each deferred local reply goes through the encoder
/// chain, so this filter's `proxy_on_response_headers` (and `_body`) run for it, and the
/// next deferred reply is sent from inside that callback: one stack level per reply.
async fn send_local_replies(vm: &mut Vm) -> wasmtime::Result<()> {
    let i = |v: u32| Val::I32(v as i32);
    let mut depth = 0;
    while let Some(reply) = vm.store.data_mut().local_replies.pop_front() {
        depth += 1;
        if depth > LOCAL_REPLY_DEPTH_LIMIT {
            vm.store.data_mut().local_replies.clear();
            return Err(wasmtime::Error::msg(format!(
                "proxy_on_response_headers failed: Uncaught RangeError: Maximum call stack size exceeded \
                 ({depth} local replies sent from one VM call)"
            )));
        }
        let ctx = reply.context_id;
        let mut headers: Headers = vec![(":status".into(), reply.status.to_string())];
        headers.extend(reply.headers.iter().cloned());
        let n = headers.len() as u32;
        let Some(stream) = vm.store.data_mut().streams.get_mut(&ctx) else { continue };
        (stream.response_headers, stream.response_body) = (headers, reply.body);
        let body_len = stream.response_body.len() as u32;
        call(vm, "proxy_on_response_headers", ctx, &[i(ctx), i(n), i(u32::from(body_len == 0))]).await?;
        if body_len > 0 {
            call(vm, "proxy_on_response_body", ctx, &[i(ctx), i(body_len), i(1)]).await?;
        }
        let Some(stream) = vm.store.data().streams.get(&ctx) else { continue };
        let status = stream.response_headers.iter().find(|(k, _)| k == ":status").and_then(|(_, v)| v.parse().ok());
        let headers = stream.response_headers.iter().filter(|(k, _)| !k.starts_with(':')).cloned().collect();
        let sent = LocalReply {
            context_id: ctx,
            status: status.unwrap_or(reply.status),
            headers,
            body: stream.response_body.clone(),
        };
        vm.store.data_mut().outbox.push(Outgoing::Reply(sent));
    }
    Ok(())
}

/// One event, as the VM's callbacks Envoy would make for it.
async fn deliver(vm: &mut Vm, event: Event) -> wasmtime::Result<()> {
    let i = |v: u32| Val::I32(v as i32);
    match event {
        Event::Request { ctx, headers, body, trailers } => {
            let n = headers.len() as u32;
            let end = body.is_empty();
            vm.store
                .data_mut()
                .streams
                .insert(ctx, Stream { request_headers: headers, request_body: body.clone(), ..Stream::default() });
            let root = vm.store.data().root_id;
            call(vm, "proxy_on_context_create", ctx, &[i(ctx), i(root)]).await?;
            let mut action = call(vm, "proxy_on_request_headers", ctx, &[i(ctx), i(n), i(u32::from(end))]).await?;
            if let Some(stream) = vm.store.data_mut().streams.get_mut(&ctx) {
                stream.body_received = body.len() as u64;
            }
            let body_delivered = action != Some(1) || vm.store.data().allow_on_headers_stop_iteration;
            let body_ends = u32::from(trailers.is_none());
            if !end && !replied(vm, ctx) && body_delivered {
                action = call(vm, "proxy_on_request_body", ctx, &[i(ctx), i(body.len() as u32), i(body_ends)]).await?;
            }
            if let Some(t) = trailers.filter(|_| !replied(vm, ctx) && body_delivered) {
                action = call(vm, "proxy_on_request_trailers", ctx, &[i(ctx), i(t.len() as u32)]).await?;
            }
            if action == Some(0) && !replied(vm, ctx) {
                vm.store.data_mut().outbox.push(Outgoing::Resume { context_id: ctx });
            }
        }
        Event::Reset { ctx } => {
            let state = vm.store.data();
            if state.streams.contains_key(&ctx) && !state.deleted.contains(&ctx) {
                // Envoy's onDestroy; the context itself is deleted later (deferred delete).
                vm.store.data_mut().deleted.insert(ctx);
                call(vm, "proxy_on_log", ctx, &[i(ctx)]).await?;
                call(vm, "proxy_on_done", ctx, &[i(ctx)]).await?;
                call(vm, "proxy_on_delete", ctx, &[i(ctx)]).await?;
            }
        }
        Event::CalloutDone { token, response } => {
            let (nh, nb) = response.as_ref().map_or((0, 0), |(h, b)| (h.len() as u32, b.len() as u32));
            vm.store.data_mut().callout_response = response;
            // Callouts belong to the root context: Envoy names the root here.
            let root = vm.store.data().root_id;
            call(vm, "proxy_on_http_call_response", root, &[i(root), i(token), i(nh), i(nb), i(0)]).await?;
            vm.store.data_mut().callout_response = None;
        }
        Event::Passthrough { ctx, response } => {
            if vm.store.data().deleted.contains(&ctx) {
                return Ok(());
            }
            let Some(stream) = vm.store.data_mut().streams.get_mut(&ctx) else { return Ok(()) };
            let (headers, body) =
                response.unwrap_or_else(|| (vec![(":status".into(), "503".into())], b"upstream reset".to_vec()));
            stream.response_headers = headers.clone();
            let end = u32::from(body.is_empty());
            call(vm, "proxy_on_response_headers", ctx, &[i(ctx), i(headers.len() as u32), i(end)]).await?;
            // The body arrives in chunks that split events (and anything else) anywhere; the
            // filter sees each chunk alone and may rewrite it.
            let mut sent = Vec::new();
            let chunks: Vec<&[u8]> = body.chunks(RESPONSE_CHUNK).collect();
            for (n, chunk) in chunks.iter().enumerate() {
                let last = u32::from(n + 1 == chunks.len());
                let Some(stream) = vm.store.data_mut().streams.get_mut(&ctx) else { return Ok(()) };
                stream.response_body = chunk.to_vec();
                call(vm, "proxy_on_response_body", ctx, &[i(ctx), i(chunk.len() as u32), i(last)]).await?;
                sent.extend(vm.store.data().streams.get(&ctx).map(|s| s.response_body.clone()).unwrap_or_default());
            }
            let headers = vm.store.data().streams.get(&ctx).map(|s| s.response_headers.clone()).unwrap_or_default();
            let status = headers.iter().find(|(k, _)| k == ":status").and_then(|(_, v)| v.parse().ok()).unwrap_or(502);
            let headers = headers.into_iter().filter(|(k, _)| !k.starts_with(':')).collect();
            let reply = LocalReply { context_id: ctx, status, headers, body: sent };
            vm.store.data_mut().outbox.push(Outgoing::Reply(reply));
        }
        Event::QueueReady { root, queue } => {
            // A root context a reload ended never hears of its queue again.
            if root == vm.store.data().root_id {
                call(vm, "proxy_on_queue_ready", root, &[i(root), i(queue)]).await?;
            }
        }
        Event::Tick => {
            let root = vm.store.data().root_id;
            call(vm, "proxy_on_tick", root, &[i(root)]).await?;
        }
        Event::Reload { root, config } => {
            let (old, size) = (vm.store.data().root_id, config.len() as u32);
            let state = vm.store.data_mut();
            state.plugin_config = config.into_bytes();
            // From here on the new root context is the one host calls and events name.
            state.root_id = root;
            if start_root(vm, root, size).await? != Some(1) {
                return Err(wasmtime::Error::msg("the plugin refused the new configuration"));
            }
            if call(vm, "proxy_on_done", old, &[i(old)]).await? != Some(1) {
                return Err(wasmtime::Error::msg("the old root context is not done at once"));
            }
            call(vm, "proxy_on_delete", old, &[i(old)]).await?;
        }
    }
    send_local_replies(vm).await
}

/// Runs a future to completion on this thread (the VM's yields just re-poll).
pub fn block_on<F: Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
    }
}
