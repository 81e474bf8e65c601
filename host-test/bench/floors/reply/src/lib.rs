//! Bench floor for a HIT: pause on headers, read the whole body, answer a fixed local reply
//! (the body the bench's HIT serves, from the plugin configuration).
//!
//! With the configuration `hit-calls:BODY` it also makes the host calls a HIT of the plugin
//! makes and nothing else: it reads the request headers, the clock and bumps a counter, and
//! its reply carries the HIT's headers. The bench's row for it shows what those calls cost
//! inside Envoy, apart from any work of the plugin's own.
//!
//! With `held:N:BODY` it is the floor of a single flight's followers: every request is held
//! (paused) until `N` have arrived on any worker; the `N`th answers at once (labelled MISS,
//! the leader) and wakes every worker through its own shared queue, where the held requests
//! are answered (labelled COALESCED) in batches of `REPLY_BATCH` local replies per VM call,
//! as the plugin must (Envoy nests one VM call's deferred replies; a few hundred overflow
//! V8's stack). The least any filter does to answer followers after their leader.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType, Status};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

const HIT_CALLS: &[u8] = b"hit-calls:";
const HELD: &[u8] = b"held:";
/// Local replies one root-context VM call sends (the plugin's `REPLY_BATCH`).
const REPLY_BATCH: usize = 64;
/// Shared data: how many requests are held, and the workers' queue names (one per line).
const COUNT: &str = "floor_held/count";
const QUEUES: &str = "floor_held/queues";
/// A key as long as the plugin's (64 hex digits).
const KEY: &str = "5f0d3c8a1b2e4f6071829304a5b6c7d8e9f00112233445566778899aabbccdde";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| Box::new(Root { body: Rc::new(Vec::new()), metric: None, held: None }));
}}

struct Root {
    body: Rc<Vec<u8>>,
    /// The counter a HIT bumps, in `hit-calls` mode.
    metric: Option<u32>,
    /// In `held` mode: this worker's held requests and queue.
    held: Option<Rc<RefCell<Held>>>,
}

/// One worker's held requests, in `held` mode.
struct Held {
    /// Requests to hold before the last one releases them all.
    crowd: u64,
    vm_id: String,
    contexts: Vec<u32>,
    queue: Option<u32>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        if let Some(held) = config.strip_prefix(HELD) {
            let text = String::from_utf8_lossy(held);
            let (crowd, body) = text.split_once(':').unwrap_or(("0", ""));
            let crowd = crowd.parse().unwrap_or(0);
            self.held = Some(Rc::new(RefCell::new(Held { crowd, vm_id: vm_id(), contexts: Vec::new(), queue: None })));
            self.body = Rc::new(body.as_bytes().to_vec());
            // The queue is registered on the first tick, as the plugin does.
            let _ = hostcalls::set_tick_period(Duration::from_millis(20));
            return size > 0;
        }
        let body = match config.strip_prefix(HIT_CALLS) {
            Some(body) => {
                self.metric = hostcalls::define_metric(MetricType::Counter, "floor.hits").ok();
                body.to_vec()
            }
            None => config,
        };
        self.body = Rc::new(body);
        size > 0
    }

    fn on_tick(&mut self) {
        let _ = hostcalls::set_tick_period(Duration::from_secs(60));
        let Some(held) = &self.held else { return };
        let name = format!("floor_held/{}", nanos());
        let Ok(queue) = hostcalls::register_shared_queue(&name) else { return };
        held.borrow_mut().queue = Some(queue);
        // Compare-and-swap, retried only while another worker wrote in between.
        loop {
            let (names, cas) = hostcalls::get_shared_data(QUEUES).unwrap_or((None, None));
            let mut names = names.unwrap_or_default();
            names.extend_from_slice(format!("{name}\n").as_bytes());
            if hostcalls::set_shared_data(QUEUES, Some(&names), cas) != Err(Status::CasMismatch) {
                return;
            }
        }
    }

    /// Answers up to `REPLY_BATCH` held requests; the rest in a VM call of their own.
    fn on_queue_ready(&mut self, queue: u32) {
        let _ = hostcalls::dequeue_shared_queue(queue);
        let Some(held) = &self.held else { return };
        let batch: Vec<u32> = {
            let mut h = held.borrow_mut();
            let n = h.contexts.len().min(REPLY_BATCH);
            h.contexts.drain(..n).collect()
        };
        for context in batch {
            if hostcalls::set_effective_context(context).is_ok() {
                let _ = hostcalls::send_http_response(200, reply_headers("COALESCED"), Some(&self.body));
            }
        }
        if !held.borrow().contexts.is_empty() {
            let _ = hostcalls::enqueue_shared_queue(queue, Some(b"more"));
        }
    }

    fn create_http_context(&self, id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Reply { id, body: self.body.clone(), metric: self.metric, held: self.held.clone() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Reply {
    id: u32,
    body: Rc<Vec<u8>>,
    metric: Option<u32>,
    held: Option<Rc<RefCell<Held>>>,
}

impl Context for Reply {
    fn on_done(&mut self) -> bool {
        if let Some(held) = &self.held {
            held.borrow_mut().contexts.retain(|c| *c != self.id);
        }
        true
    }
}

impl HttpContext for Reply {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        if self.metric.is_some() {
            let _headers = self.get_http_request_headers_bytes();
        }
        if end_of_stream {
            return self.reply(0);
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        self.reply(size)
    }
}

impl Reply {
    fn reply(&mut self, size: usize) -> Action {
        let _request = self.get_http_request_body(0, size);
        if let Some(held) = self.held.clone() {
            return self.hold(&held);
        }
        let mut headers = vec![("content-type", "application/json")];
        if let Some(metric) = self.metric {
            let _now = hostcalls::get_current_time();
            let _ = hostcalls::increment_metric(metric, 1);
            let hit = [
                ("x-holysheep-cache", "HIT"),
                ("cache-control", "max-age=3600"),
                ("x-holysheep-key", KEY),
                ("x-holysheep-model", "gpt-4.1"),
                ("age", "0"),
            ];
            headers.extend(hit);
        }
        self.send_http_response(200, headers, Some(&self.body));
        Action::Pause
    }
}

impl Reply {
    /// Holds this request, or, as the crowd's last, answers it and wakes every worker.
    fn hold(&mut self, held: &RefCell<Held>) -> Action {
        held.borrow_mut().contexts.push(self.id);
        let crowd = held.borrow().crowd;
        let count = loop {
            let (value, cas) = hostcalls::get_shared_data(COUNT).unwrap_or((None, None));
            let count = value.and_then(|v| String::from_utf8(v).ok()?.parse::<u64>().ok()).unwrap_or(0) + 1;
            let next = if count >= crowd { 0 } else { count };
            match hostcalls::set_shared_data(COUNT, Some(next.to_string().as_bytes()), cas) {
                Ok(()) => break count,
                Err(Status::CasMismatch) => continue,
                // Not counted: released at once rather than held for good.
                Err(_) => break crowd,
            }
        };
        if count < crowd {
            return Action::Pause;
        }
        held.borrow_mut().contexts.retain(|c| *c != self.id);
        self.send_http_response(200, reply_headers("MISS"), Some(&self.body));
        let vm_id = held.borrow().vm_id.clone();
        let names = hostcalls::get_shared_data(QUEUES).ok().and_then(|(v, _)| v).unwrap_or_default();
        for name in String::from_utf8_lossy(&names).lines() {
            if let Ok(Some(queue)) = hostcalls::resolve_shared_queue(&vm_id, name) {
                let _ = hostcalls::enqueue_shared_queue(queue, Some(b"release"));
            }
        }
        Action::Pause
    }
}

/// The headers of a plugin's answer from a flight (HIT's, without `age`).
fn reply_headers(cache: &str) -> Vec<(&str, &str)> {
    vec![
        ("content-type", "application/json"),
        ("x-holysheep-cache", cache),
        ("cache-control", "max-age=3600"),
        ("x-holysheep-key", KEY),
        ("x-holysheep-model", "gpt-4.1"),
    ]
}

fn nanos() -> u128 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos())
}

fn vm_id() -> String {
    let id = hostcalls::get_property(vec!["plugin_vm_id"]).ok().flatten().unwrap_or_default();
    String::from_utf8_lossy(&id).into_owned()
}
