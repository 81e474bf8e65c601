//! One worker thread's VM: its root context owns every upstream callout (so a leader's
//! call survives its client), the waiters paused on this worker, and the worker's wake
//! queue. It translates host events into core calls and executes the core's decisions.

use super::host::{self, Nonces, SharedData};
use crate::core::cache::Response;
use crate::core::config::Config;
use crate::core::engine::{Call, Engine, Step, Wait};
use crate::core::request::{Key, CHAT_PATH};
use crate::core::wake;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

/// What an upstream call needs from the client's request.
pub struct Outbound {
    pub body: Vec<u8>,
    pub client_authorization: Option<String>,
}

/// Message on a worker's own queue: dispatch the pending calls from the root context.
const DISPATCH: &[u8] = b"dispatch";

/// Period of the first tick, which registers the worker's wake queue.
const FIRST_TICK_MS: u64 = 20;

/// State shared by the root context and the http contexts of one VM.
pub struct Worker {
    pub config: Rc<Config>,
    api_key: Option<String>,
    vm_id: String,
    queue: Option<(u32, String)>,
    nonces: Nonces,
    last_beat_ms: u64,
    /// Calls decided in an http context, dispatched from the root on the next queue event.
    pending: Vec<(u32, Call, Rc<Outbound>)>,
    waiters: HashMap<u32, (Wait, Rc<Outbound>)>,
    flights: HashMap<u32, (u32, Call)>,
}

pub type Shared = Rc<RefCell<Worker>>;

impl Worker {
    fn new() -> Self {
        Worker {
            config: Rc::new(Config::default()),
            api_key: None,
            vm_id: String::new(),
            queue: None,
            nonces: Nonces::new(),
            last_beat_ms: 0,
            pending: Vec::new(),
            waiters: HashMap::new(),
            flights: HashMap::new(),
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

    pub fn forget(&mut self, context_id: u32) {
        self.waiters.remove(&context_id);
    }

    pub fn api_key(&self) -> Option<&str> {
        self.api_key.as_deref()
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
                host::send_to(context_id, &reply);
            }
            Step::Call(call) => self.dispatch(context_id, call, &outbound),
            Step::Wait(wait) => self.worker.borrow_mut().wait(context_id, wait, outbound),
        }
    }

    fn dispatch(&mut self, context_id: u32, call: Call, outbound: &Outbound) {
        let (config, key) = {
            let w = self.worker.borrow();
            (w.config.clone(), w.api_key.clone())
        };
        let bearer = key.map(|k| format!("Bearer {k}"));
        let auth = bearer.as_deref().or(outbound.client_authorization.as_deref());
        let mut headers = vec![
            (":method", "POST"),
            (":path", CHAT_PATH),
            (":authority", config.upstream.authority.as_str()),
            ("content-type", "application/json"),
            ("accept", "application/json"),
            ("user-agent", concat!("holysheep-edge/", env!("CARGO_PKG_VERSION"))),
        ];
        if let Some(a) = auth {
            headers.push(("authorization", a));
        }
        let timeout = Duration::from_millis(config.upstream.timeout_ms);
        match self.dispatch_http_call(&config.upstream.cluster, headers, Some(&outbound.body), vec![], timeout) {
            Ok(token) => {
                host::log(LogLevel::Debug, &format!("holysheep: #{context_id} callout {token} for {}", call.key.hex()));
                self.worker.borrow_mut().flights.insert(token, (context_id, call));
            }
            Err(status) => {
                host::log(
                    LogLevel::Error,
                    &format!("holysheep: callout to cluster '{}' refused: {status:?}", config.upstream.cluster),
                );
                self.finish(context_id, call, None);
            }
        }
    }

    /// The flight ended: answer its caller, then its waiters here and on other workers.
    fn finish(&mut self, context_id: u32, call: Call, outcome: Option<Response>) {
        let config = self.worker.borrow().config.clone();
        let now = host::now_ms();
        let reply = Engine { store: &SharedData, config: &config }.complete(&call, outcome, now);
        host::send_to(context_id, &reply);
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

    /// Lets waiters (all, or those on `key`) look at their flight again.
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
            let taken = self.worker.borrow_mut().waiters.remove(&id);
            let Some((wait, outbound)) = taken else { continue };
            let (config, nonce) = {
                let mut w = self.worker.borrow_mut();
                (w.config.clone(), w.nonce())
            };
            let step = Engine { store: &SharedData, config: &config }.poll(&wait, host::now_ms(), nonce);
            self.execute(id, step, outbound);
        }
    }

    fn dispatch_pending(&mut self) {
        let pending = std::mem::take(&mut self.worker.borrow_mut().pending);
        for (id, call, outbound) in pending {
            self.dispatch(id, call, &outbound);
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
                let _ = hostcalls::set_tick_period(Duration::from_millis(w.config.tick_ms()));
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
        let engine = Engine { store: &SharedData, config: &w.config };
        let now = host::now_ms();
        for (_, call) in w.flights.values() {
            engine.renew(call, now);
        }
    }

    fn response_of_callout(&self, num_headers: usize, body_size: usize) -> Option<Response> {
        if num_headers == 0 {
            return None;
        }
        let header = |name: &str| {
            hostcalls::get_map_value(proxy_wasm::types::MapType::HttpCallResponseHeaders, name).ok().flatten()
        };
        let status = header(":status")?.parse().ok()?;
        Some(Response {
            status,
            content_type: header("content-type").unwrap_or_else(|| "application/json".into()),
            headers: header("retry-after").map(|v| vec![("retry-after".to_owned(), v)]).unwrap_or_default(),
            body: self.get_http_call_response_body(0, body_size).unwrap_or_default(),
        })
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        host::log(LogLevel::Debug, &format!("holysheep: callout {token} answered ({num_headers} headers)"));
        let flight = self.worker.borrow_mut().flights.remove(&token);
        if let Some((context_id, call)) = flight {
            let outcome = self.response_of_callout(num_headers, body_size);
            self.finish(context_id, call, outcome);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = self.get_plugin_configuration().unwrap_or_default();
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
        w.api_key = std::env::var(&config.upstream.api_key_env).ok().filter(|k| !k.is_empty());
        host::log(
            LogLevel::Info,
            &format!(
                "holysheep: configured (cluster '{}', upstream key {})",
                config.upstream.cluster,
                if w.api_key.is_some() { "from environment" } else { "absent: forwarding client authorization" }
            ),
        );
        w.config = Rc::new(config);
        drop(w);
        // A short first tick registers the worker's queue (not here: the canary VM and
        // the VM's thread binding make on_configure the wrong place, see ENVOY-FACTS).
        let _ = hostcalls::set_tick_period(Duration::from_millis(FIRST_TICK_MS));
        true
    }

    fn on_tick(&mut self) {
        self.register_queue();
        self.dispatch_pending();
        self.heartbeat();
        self.renew_leases();
        self.poll_waiters(None);
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        while let Ok(Some(message)) = hostcalls::dequeue_shared_queue(queue_id) {
            if message == DISPATCH {
                self.dispatch_pending();
            } else if let Some(key) = std::str::from_utf8(&message).ok().and_then(Key::from_hex) {
                self.poll_waiters(Some(&key));
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(super::http::Chat::new(context_id, self.worker.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
