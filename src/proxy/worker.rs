//! One worker thread's VM: its root context owns every upstream callout (so a leader's
//! call survives its client), the flights sleeping between attempts, the waiters paused
//! on this worker, its wake queue and its metrics. It translates host events into core
//! calls and executes the core's decisions.

use super::body_watch::{self, BodyWatch};
use super::host::{self, Nonces, SharedData};
use crate::core::cache::Response;
use crate::core::config::Config;
use crate::core::engine::{Call, Engine, Reply, Step, Wait};
use crate::core::error::ApiError;
use crate::core::flight::{Action, Flight};
use crate::core::limits::ProviderHints;
use crate::core::metrics::{self, Counter, COUNTERS};
use crate::core::request::{Key, CHAT_PATH};
use crate::core::store::claim;
use crate::core::upstream::{self, Outbound};
use crate::core::wake;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel, MapType, MetricType};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::time::Duration;

/// Message on a worker's own queue: dispatch the pending calls from the root context.
const DISPATCH: &[u8] = b"dispatch";
/// Message on a worker's own queue: look at every waiter again (a continued tick).
const POLL_ALL: &[u8] = b"poll";
/// Local replies one root-context VM call may send to other http contexts. Envoy sends a
/// VM call's deferred local replies one inside another (each from the previous reply's
/// trip through this filter's response callbacks), one stack level per reply: a few
/// hundred overflow V8's stack and kill the VM. The rest go out in the next VM call,
/// continued through the worker's own queue.
const REPLY_BATCH: usize = 64;
/// Period of the first tick, which registers the worker's wake queue.
const FIRST_TICK_MS: u64 = 20;
/// Tick period while a flight sleeps (backoff, or held for its bucket).
const SLEEP_TICK_MS: u64 = 10;
/// Shared-data key claimed by the one VM per Envoy process that checks the API key.
const KEY_CHECK: &str = "holysheep/key-check";

/// Where a reply goes: the http context being called, or another one of this worker.
#[derive(Clone, Copy)]
pub enum Target {
    Current,
    Context(u32),
}

/// A flight on its way, with the request it answers.
struct Run {
    context_id: u32,
    flight: Flight,
    outbound: Rc<Outbound>,
}

/// State shared by the root context and the http contexts of one VM.
pub struct Worker {
    pub config: Rc<Config>,
    /// `Bearer <key>` when the key is in the VM environment; never logged.
    bearer: Option<String>,
    vm_id: String,
    queue: Option<(u32, String)>,
    nonces: Nonces,
    last_beat_ms: u64,
    tick_ms: u64,
    key_checked: bool,
    key_check_token: Option<u32>,
    /// Calls decided in an http context, dispatched from the root on the next queue event.
    pending: Vec<(u32, Call, Rc<Outbound>)>,
    /// Http contexts that may still be answered: created, not done, and not answered by
    /// the root on its own. (Envoy still resolves a reset stream's id until its deferred
    /// delete, and a reply sent there reaches the SDK for a context it already deleted: a
    /// panic.)
    live: HashSet<u32>,
    pub body_watch: BodyWatch,
    /// Local replies the current root-context VM call may still send (see REPLY_BATCH).
    replies_left: usize,
    waiters: HashMap<u32, (Wait, Rc<Outbound>)>,
    flights: HashMap<u32, Run>,
    sleeping: Vec<(u64, Run)>,
    metrics: HashMap<(String, Counter), u32>,
}

pub type Shared = Rc<RefCell<Worker>>;

impl Worker {
    fn new() -> Self {
        Worker {
            config: Rc::new(Config::default()),
            bearer: None,
            vm_id: String::new(),
            queue: None,
            nonces: Nonces::new(),
            last_beat_ms: 0,
            tick_ms: 0,
            key_checked: false,
            key_check_token: None,
            pending: Vec::new(),
            live: HashSet::new(),
            body_watch: BodyWatch::default(),
            replies_left: REPLY_BATCH,
            waiters: HashMap::new(),
            flights: HashMap::new(),
            sleeping: Vec::new(),
            metrics: HashMap::new(),
        }
    }

    pub fn nonce(&mut self) -> u64 {
        self.nonces.next()
    }

    /// Hands a call to the root context, which dispatches it on its next queue event (or
    /// tick, before the worker's queue exists); the client's reply comes from there.
    pub fn defer_call(&mut self, context_id: u32, call: Call, outbound: Rc<Outbound>) {
        self.pending.push((context_id, call, outbound));
        if let (Some((queue, _)), 1) = (&self.queue, self.pending.len()) {
            if hostcalls::enqueue_shared_queue(*queue, Some(DISPATCH)).is_err() {
                host::log(LogLevel::Warn, "holysheep: wake queue refused a message; the tick will dispatch");
            }
        }
    }

    pub fn wait(&mut self, context_id: u32, wait: Wait, outbound: Rc<Outbound>) {
        self.waiters.insert(context_id, (wait, outbound));
    }

    /// The http context is done: it is never answered after this.
    pub fn forget(&mut self, context_id: u32) {
        self.live.remove(&context_id);
        self.waiters.remove(&context_id);
        self.body_watch.forget(context_id);
    }

    /// Whether the http context may still be answered.
    pub fn is_live(&self, context_id: u32) -> bool {
        self.live.contains(&context_id)
    }

    /// Enqueues `message` on this worker's own queue, so its work continues in a VM call
    /// of its own. Without a queue yet, the next tick does it.
    fn continue_later(&self, message: &[u8]) {
        if let Some((queue, _)) = &self.queue {
            if hostcalls::enqueue_shared_queue(*queue, Some(message)).is_err() {
                host::log(LogLevel::Warn, "holysheep: wake queue refused a message; the tick will continue");
            }
        }
    }

    pub fn bearer(&self) -> Option<&str> {
        self.bearer.as_deref()
    }

    /// Sends `reply` with the model's `x-ratelimit-*` headers, and counts it. Another
    /// context is answered only while it lives, and uses up one of this VM call's replies.
    pub fn respond(&mut self, target: Target, reply: &Reply, model: &str) -> bool {
        if matches!(target, Target::Context(id) if !self.live.contains(&id)) {
            return false;
        }
        let extra = upstream::rate_headers(&SharedData, &self.config, model, host::now_ms());
        self.count(metrics::for_reply(&self.config, model, reply));
        self.send(target, reply, &extra)
    }

    fn send(&mut self, target: Target, reply: &Reply, extra: &[(&str, String)]) -> bool {
        match target {
            Target::Current => host::send(reply, extra),
            Target::Context(id) if self.live.contains(&id) => {
                self.replies_left = self.replies_left.saturating_sub(1);
                host::send_to(id, reply, extra)
            }
            Target::Context(_) => false,
        }
    }

    /// Answers the requests that never received their body (see `body_watch`) with a 500.
    fn answer_stalled(&mut self) {
        let (ids, first) = self.body_watch.stalled(host::now_ms());
        if first {
            host::log(LogLevel::Error, &format!("holysheep: {}", body_watch::MESSAGE));
        }
        let reply = Reply::error(&ApiError::server(body_watch::MESSAGE, "edge_misconfigured"));
        for id in ids {
            self.send(Target::Context(id), &reply, &[]);
            self.live.remove(&id);
        }
    }

    fn count(&self, increments: Vec<(String, Counter, u64)>) {
        for (label, counter, n) in increments {
            if let (Some(id), Ok(n)) = (self.metrics.get(&(label, counter)), i64::try_from(n)) {
                if n > 0 {
                    let _ = hostcalls::increment_metric(*id, n);
                }
            }
        }
    }

    fn define_metrics(&mut self) {
        for label in metrics::labels(&self.config) {
            for counter in COUNTERS {
                if let Ok(id) = hostcalls::define_metric(MetricType::Counter, &metrics::metric_name(&label, counter)) {
                    self.metrics.insert((label.clone(), counter), id);
                }
            }
        }
    }

    fn engine(&self) -> Engine<'_, SharedData> {
        Engine { store: &SharedData, config: &self.config }
    }
}

pub struct Root {
    worker: Shared,
}

impl Root {
    pub fn new() -> Self {
        Root { worker: Rc::new(RefCell::new(Worker::new())) }
    }

    fn execute(&mut self, context_id: u32, step: Step, outbound: Rc<Outbound>) {
        match step {
            Step::Reply(reply) => {
                self.worker.borrow_mut().respond(Target::Context(context_id), &reply, &outbound.model);
            }
            Step::Call(call) => self.start(context_id, call, outbound),
            Step::Wait(wait) => self.worker.borrow_mut().wait(context_id, wait, outbound),
        }
    }

    fn start(&mut self, context_id: u32, call: Call, outbound: Rc<Outbound>) {
        let flight = Flight::new(&self.worker.borrow().config, call, &outbound.model, outbound.estimate_tokens);
        let mut run = Run { context_id, flight, outbound };
        let action = self.resume(&mut run);
        self.advance(run, action);
    }

    fn resume(&self, run: &mut Run) -> Action {
        let mut w = self.worker.borrow_mut();
        let nonce = w.nonce();
        run.flight.resume(&SharedData, &w.config, host::now_ms(), nonce)
    }

    /// Performs a flight's next action until it is waiting on the host.
    fn advance(&mut self, mut run: Run, mut action: Action) {
        loop {
            {
                let w = self.worker.borrow();
                let events = std::mem::take(&mut run.flight.events);
                w.count(events.iter().flat_map(|e| metrics::for_event(&w.config, e)).collect());
            }
            match action {
                Action::Send { model, timeout_ms } => match self.dispatch(&run, &model, timeout_ms) {
                    Some(token) => {
                        self.worker.borrow_mut().flights.insert(token, run);
                        return;
                    }
                    None => action = self.on_outcome(&mut run, None, &ProviderHints::default()),
                },
                Action::Sleep { until_ms } => {
                    self.worker.borrow_mut().sleeping.push((until_ms, run));
                    self.set_tick();
                    return;
                }
                Action::Finish(outcome) => return self.finish(run, outcome),
            }
        }
    }

    fn on_outcome(&self, run: &mut Run, outcome: Option<Response>, hints: &ProviderHints) -> Action {
        let mut w = self.worker.borrow_mut();
        let random = w.nonce();
        run.flight.on_response(&SharedData, &w.config, outcome, hints, host::now_ms(), random)
    }

    fn dispatch(&mut self, run: &Run, model: &str, timeout_ms: u64) -> Option<u32> {
        let (config, bearer) = {
            let w = self.worker.borrow();
            (w.config.clone(), w.bearer.clone())
        };
        let out = &run.outbound;
        let body = out.body_for(model);
        let mut headers =
            vec![(":method", "POST"), (":path", CHAT_PATH), (":authority", config.upstream.authority.as_str())];
        headers.extend(out.headers(bearer.as_deref()));
        let timeout = Duration::from_millis(timeout_ms.max(1));
        match self.dispatch_http_call(&config.upstream.cluster, headers, Some(&body), vec![], timeout) {
            Ok(token) => {
                host::log(LogLevel::Debug, &format!("holysheep: #{} callout {token} to {model}", run.context_id));
                Some(token)
            }
            Err(status) => {
                let cluster = &config.upstream.cluster;
                host::log(LogLevel::Error, &format!("holysheep: callout to cluster '{cluster}' refused: {status:?}"));
                None
            }
        }
    }

    /// The flight ended: answer its caller, then its waiters here and on other workers.
    fn finish(&mut self, run: Run, outcome: Option<Response>) {
        let now = host::now_ms();
        let call = run.flight.call;
        let reply = self.worker.borrow().engine().complete(&call, outcome, now);
        self.worker.borrow_mut().respond(Target::Context(run.context_id), &reply, &run.outbound.model);
        if call.lease.is_some() {
            self.poll_waiters(Some(&call.key));
            self.wake_other_workers(&call.key, now);
        }
    }

    fn wake_other_workers(&self, key: &Key, now: u64) {
        let (vm_id, own) = {
            let w = self.worker.borrow();
            (w.vm_id.clone(), w.queue.as_ref().map(|(_, n)| n.clone()).unwrap_or_default())
        };
        for name in wake::live(&SharedData, now).into_iter().filter(|n| *n != own) {
            if let Ok(Some(queue)) = hostcalls::resolve_shared_queue(&vm_id, &name) {
                let _ = hostcalls::enqueue_shared_queue(queue, Some(key.hex().as_bytes()));
            }
        }
    }

    /// Lets waiters (all, or those on `key`) look at their flight again, as many as this VM
    /// call may answer; the rest continue in a VM call of their own.
    fn poll_waiters(&mut self, key: Option<&Key>) {
        let ids: Vec<u32> = self
            .worker
            .borrow()
            .waiters
            .iter()
            .filter(|(_, (w, _))| key.is_none_or(|k| *k == w.key))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if self.out_of_replies() {
                let w = self.worker.borrow();
                w.continue_later(key.map_or(POLL_ALL, |k| k.hex().as_bytes()));
                return;
            }
            let taken = self.worker.borrow_mut().waiters.remove(&id);
            let Some((wait, outbound)) = taken else { continue };
            let step = {
                let mut w = self.worker.borrow_mut();
                let nonce = w.nonce();
                w.engine().poll(&wait, host::now_ms(), nonce)
            };
            self.execute(id, step, outbound);
        }
    }

    fn out_of_replies(&self) -> bool {
        self.worker.borrow().replies_left == 0
    }

    /// A root-context VM call starts: it may send a new batch of replies.
    fn begin_call(&self) {
        self.worker.borrow_mut().replies_left = REPLY_BATCH;
    }

    fn dispatch_pending(&mut self) {
        loop {
            if self.out_of_replies() {
                let w = self.worker.borrow();
                if !w.pending.is_empty() {
                    w.continue_later(DISPATCH);
                }
                return;
            }
            let next = {
                let mut w = self.worker.borrow_mut();
                (!w.pending.is_empty()).then(|| w.pending.remove(0))
            };
            let Some((id, call, outbound)) = next else { return };
            self.start(id, call, outbound);
        }
    }

    /// Resumes the flights whose sleep is over (those beyond this call's replies wait for
    /// the next tick, which is fast while any flight sleeps).
    fn wake_sleepers(&mut self) {
        let now = host::now_ms();
        while !self.out_of_replies() {
            let due = {
                let mut w = self.worker.borrow_mut();
                let at = w.sleeping.iter().position(|(until, _)| *until <= now);
                at.map(|i| w.sleeping.swap_remove(i).1)
            };
            let Some(mut run) = due else { break };
            let action = self.resume(&mut run);
            self.advance(run, action);
        }
        self.set_tick();
    }

    /// Fast ticks while a flight sleeps, the configured safety-net period otherwise.
    fn set_tick(&self) {
        let mut w = self.worker.borrow_mut();
        if w.queue.is_none() {
            return;
        }
        let period = if w.sleeping.is_empty() { w.config.tick_ms() } else { SLEEP_TICK_MS };
        if period != w.tick_ms && hostcalls::set_tick_period(Duration::from_millis(period)).is_ok() {
            w.tick_ms = period;
        }
    }

    fn register_queue(&mut self) {
        let mut w = self.worker.borrow_mut();
        if w.queue.is_some() {
            return;
        }
        let name = format!("holysheep-wake-{:016x}", w.nonce());
        match hostcalls::register_shared_queue(&name) {
            Ok(id) => {
                host::log(LogLevel::Debug, &format!("holysheep: wake queue {name} registered"));
                w.queue = Some((id, name));
            }
            Err(s) => host::log(LogLevel::Error, &format!("holysheep: cannot register wake queue: {s:?}")),
        }
    }

    fn heartbeat(&mut self) {
        let now = host::now_ms();
        let mut w = self.worker.borrow_mut();
        if now.saturating_sub(w.last_beat_ms) < wake::HEARTBEAT_MS {
            return;
        }
        if let Some((_, name)) = &w.queue {
            if wake::publish(&SharedData, name, now).is_ok() {
                w.last_beat_ms = now;
            }
        }
    }

    fn renew_leases(&self) {
        let w = self.worker.borrow();
        let (engine, now) = (w.engine(), host::now_ms());
        for run in w.flights.values().chain(w.sleeping.iter().map(|(_, r)| r)) {
            engine.renew(&run.flight.call, now);
        }
    }

    /// Once per Envoy process (the first worker to claim it), ask HolySheep whether the
    /// configured key is accepted. The key is never logged.
    fn check_key(&mut self) {
        let (config, bearer) = {
            let mut w = self.worker.borrow_mut();
            if w.key_checked {
                return;
            }
            w.key_checked = true;
            (w.config.clone(), w.bearer.clone())
        };
        let Some(bearer) = bearer else { return };
        if !claim(&SharedData, KEY_CHECK, b"1") {
            return;
        }
        let headers = vec![
            (":method", "GET"),
            (":path", "/v1/models"),
            (":authority", config.upstream.authority.as_str()),
            ("authorization", bearer.as_str()),
        ];
        let timeout = Duration::from_millis(config.upstream.timeout_ms);
        if let Ok(token) = self.dispatch_http_call(&config.upstream.cluster, headers, None, vec![], timeout) {
            self.worker.borrow_mut().key_check_token = Some(token);
        }
    }

    fn report_key_check(&self, num_headers: usize) {
        let env = self.worker.borrow().config.upstream.api_key_env.clone();
        let status = if num_headers == 0 { None } else { self.response_header(":status") };
        match status.as_deref() {
            Some("200") => host::log(LogLevel::Info, &format!("holysheep: HolySheep accepted the key from ${env}")),
            Some(s @ ("401" | "403")) => host::log(
                LogLevel::Error,
                &format!("holysheep: HolySheep REJECTED the key from ${env} (status {s}): every call will fail"),
            ),
            other => host::log(
                LogLevel::Warn,
                &format!("holysheep: could not check the key from ${env} (status {})", other.unwrap_or("none")),
            ),
        }
    }

    fn response_header(&self, name: &str) -> Option<String> {
        hostcalls::get_map_value(MapType::HttpCallResponseHeaders, name).ok().flatten()
    }

    fn callout_response(&self, num_headers: usize, body_size: usize) -> (Option<Response>, ProviderHints) {
        if num_headers == 0 {
            return (None, ProviderHints::default());
        }
        let headers = hostcalls::get_map(MapType::HttpCallResponseHeaders).unwrap_or_default();
        let status = headers.iter().find(|(k, _)| k == ":status").and_then(|(_, v)| v.parse().ok());
        let Some(status) = status else {
            return (None, ProviderHints::default());
        };
        let (response, hints) =
            upstream::response(status, &headers, host::buffer(BufferType::HttpCallResponseBody, body_size));
        (Some(response), hints)
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        self.begin_call();
        if self.worker.borrow().key_check_token == Some(token) {
            return self.report_key_check(num_headers);
        }
        let run = self.worker.borrow_mut().flights.remove(&token);
        if let Some(mut run) = run {
            let (outcome, hints) = self.callout_response(num_headers, body_size);
            let action = self.on_outcome(&mut run, outcome, &hints);
            self.advance(run, action);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = host::buffer(BufferType::PluginConfiguration, usize::MAX);
        let config = match Config::parse(&raw) {
            Ok(c) => c,
            Err(e) => {
                host::log(LogLevel::Critical, &e.to_string());
                return false;
            }
        };
        let vm_id = hostcalls::get_property(vec!["plugin_vm_id"]).ok().flatten().unwrap_or_default();
        let mut w = self.worker.borrow_mut();
        w.vm_id = String::from_utf8_lossy(&vm_id).into_owned();
        w.bearer = upstream::bearer(std::env::var(&config.upstream.api_key_env).ok());
        host::log(
            LogLevel::Info,
            &format!(
                "holysheep: configured (cluster '{}', upstream key {})",
                config.upstream.cluster,
                if w.bearer.is_some() { "from environment" } else { "absent: forwarding client authorization" }
            ),
        );
        w.config = Rc::new(config);
        w.define_metrics();
        drop(w);
        // A short first tick registers the worker's queue (not here: the canary VM and
        // the VM's thread binding make on_configure the wrong place, see ENVOY-FACTS).
        let _ = hostcalls::set_tick_period(Duration::from_millis(FIRST_TICK_MS));
        true
    }

    fn on_tick(&mut self) {
        self.begin_call();
        self.worker.borrow_mut().answer_stalled();
        self.register_queue();
        self.check_key();
        self.dispatch_pending();
        self.heartbeat();
        self.renew_leases();
        self.wake_sleepers();
        self.poll_waiters(None);
    }

    /// Every enqueue brings one call here, so stopping once this call's replies are spent
    /// leaves the messages still queued to the calls still due.
    fn on_queue_ready(&mut self, queue_id: u32) {
        self.begin_call();
        while !self.out_of_replies() {
            let Ok(Some(message)) = hostcalls::dequeue_shared_queue(queue_id) else { return };
            if message == DISPATCH {
                self.dispatch_pending();
            } else if message == POLL_ALL {
                self.poll_waiters(None);
            } else if let Some(key) = std::str::from_utf8(&message).ok().and_then(Key::from_hex) {
                self.poll_waiters(Some(&key));
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        self.worker.borrow_mut().live.insert(context_id);
        Some(Box::new(super::http::Chat::new(context_id, self.worker.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
