//! Bench floor for a MISS: pause on headers, read the whole body, send it to the upstream
//! cluster by `dispatch_http_call` and reply with the answer.
//!
//! With the configuration `miss-calls` it also makes the host calls a MISS of the plugin
//! makes, in the same callbacks, and nothing else: it reads the request headers and the
//! clock, reads two shared-data records and writes one (the cache group's index, the lease
//! group and its compare-and-swap), bumps a counter and dispatches the call from the same
//! callback with the plugin's upstream headers (`accept`, `user-agent`, the client's
//! `authorization`); on the answer it reads the answer's headers, writes the
//! cache index and the answer, reads and writes the lease group, bumps three counters,
//! records three histogram values and replies with the MISS's headers (the host calls
//! `a_miss_is_dispatched_from_its_own_request_callback` counts). The bench's row for it
//! shows what those calls cost inside Envoy, apart from any work of the plugin's own.
//!
//! With `miss-work` it makes the same calls and also does the work no governed MISS can
//! skip, in the simplest form serde_json and sha2 offer: the request body parsed, written
//! back compact with its keys sorted and hashed with SHA-256 (the key, in hex), and the
//! answer parsed for its `usage`. Its row shows what that work costs inside Envoy: its
//! wasm, and what it does to the speed of Envoy's own code around it.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType, MetricType};
use sha2::{Digest, Sha256};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

const MISS_CALLS: &[u8] = b"miss-calls";
const MISS_WORK: &[u8] = b"miss-work";
/// A key as long as the plugin's (64 hex digits).
const KEY: &str = "5f0d3c8a1b2e4f6071829304a5b6c7d8e9f00112233445566778899aabbccdde";
/// Slots of the shared-data tables the floor writes (bounded, like the plugin's).
const SLOTS: u64 = 1024;
/// A lease group about as long as the plugin's (four ways of about 160 bytes).
const LEASE_GROUP: [u8; 640] = [b'l'; 640];
/// A cache group's index as long as the plugin's (four ways of 33 bytes).
const CACHE_INDEX: [u8; 132] = [b'i'; 132];

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| Box::new(Root { miss_calls: None }));
}}

/// What the root context and the http contexts of one worker share in `miss-calls` mode.
#[derive(Default)]
struct Worker {
    /// `miss-work` mode: parse and hash the request, parse the answer.
    work: bool,
    queue: Option<u32>,
    metric: u32,
    histogram: u32,
}

struct Root {
    miss_calls: Option<Rc<RefCell<Worker>>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        if config == MISS_CALLS || config == MISS_WORK {
            let metric = hostcalls::define_metric(MetricType::Counter, "floor.misses").unwrap_or(0);
            let histogram = hostcalls::define_metric(MetricType::Histogram, "floor.miss_ms").unwrap_or(0);
            let work = config == MISS_WORK;
            self.miss_calls = Some(Rc::new(RefCell::new(Worker { work, metric, histogram, ..Worker::default() })));
            // The queue is registered on the first tick, as the plugin does.
            let _ = hostcalls::set_tick_period(Duration::from_millis(20));
        }
        true
    }

    fn on_tick(&mut self) {
        let Some(worker) = &self.miss_calls else { return };
        if worker.borrow().queue.is_none() {
            let name = format!("floor_miss/{}", hostcalls::get_current_time().map(nanos).unwrap_or(0));
            worker.borrow_mut().queue = hostcalls::register_shared_queue(&name).ok();
        }
        let _ = hostcalls::set_tick_period(Duration::from_secs(60));
    }

    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Call { miss_calls: self.miss_calls.clone(), authorization: None }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Call {
    miss_calls: Option<Rc<RefCell<Worker>>>,
    authorization: Option<String>,
}

impl Context for Call {
    fn on_http_call_response(&mut self, _token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let Some(worker) = &self.miss_calls else {
            let body = self.get_http_call_response_body(0, body_size).unwrap_or_default();
            self.send_http_response(200, vec![("content-type", "application/json")], Some(&body));
            return;
        };
        let (work, metric, histogram) = (worker.borrow().work, worker.borrow().metric, worker.borrow().histogram);
        let _headers = self.get_http_call_response_headers_bytes();
        let body = self.get_http_call_response_body(0, body_size).unwrap_or_default();
        if work {
            std::hint::black_box(usage(&body));
        }
        let now = hostcalls::get_current_time().map(nanos).unwrap_or(0);
        for _ in 0..2 {
            let _ = hostcalls::increment_metric(metric, 1);
        }
        for _ in 0..3 {
            let _ = hostcalls::record_metric(histogram, now % 1000);
        }
        let _ = hostcalls::set_shared_data(&slot("index", now), Some(&CACHE_INDEX), None);
        let _ = hostcalls::set_shared_data(&slot("cache", now), Some(&body), None);
        let lease = slot("lease", now);
        let (_, cas) = hostcalls::get_shared_data(&lease).unwrap_or((None, None));
        let _ = hostcalls::set_shared_data(&lease, Some(&LEASE_GROUP), cas);
        let _ = hostcalls::increment_metric(metric, 1);
        // The SDK named the request effective before this callback, as the plugin does
        // before its reply.
        {
            let mut headers = vec![("content-type", "application/json")];
            headers.extend([
                ("x-holysheep-cache", "MISS"),
                ("cache-control", "max-age=3600"),
                ("x-holysheep-key", KEY),
                ("x-holysheep-model", "gpt-4.1"),
            ]);
            let _ = hostcalls::send_http_response(200, headers, Some(&body));
        }
    }
}

impl HttpContext for Call {
    fn on_http_request_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        if self.miss_calls.is_some() {
            let headers = hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default();
            let authorization = headers.into_iter().find(|(n, _)| n == "authorization");
            self.authorization = authorization.and_then(|(_, v)| String::from_utf8(v).ok());
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, size).unwrap_or_default();
        if let Some(worker) = self.miss_calls.clone() {
            let (work, metric) = (worker.borrow().work, worker.borrow().metric);
            if work {
                std::hint::black_box(key(&body));
            }
            let now = hostcalls::get_current_time().map(nanos).unwrap_or(0);
            // The cache group's index, the lease group and the lease taken.
            let _ = hostcalls::get_shared_data(&slot("index", now));
            let lease = slot("lease", now);
            let (_, cas) = hostcalls::get_shared_data(&lease).unwrap_or((None, None));
            let _ = hostcalls::set_shared_data(&lease, Some(&LEASE_GROUP), cas);
            let _ = hostcalls::increment_metric(metric, 1);
            // The headers the plugin sends HolySheep (the client's own key, none configured).
            let mut headers = vec![("accept", "application/json"), ("user-agent", "holysheep-edge/0.1.0")];
            let authorization = self.authorization.take();
            headers.extend(authorization.as_deref().map(|a| ("authorization", a)));
            if dispatch(self, &body, headers).is_none() {
                self.send_http_response(502, vec![], None);
            }
            return Action::Pause;
        }
        if dispatch(self, &body, vec![]).is_none() {
            self.send_http_response(502, vec![], None);
        }
        Action::Pause
    }
}

fn dispatch(context: &dyn Context, body: &[u8], extra: Vec<(&str, &str)>) -> Option<u32> {
    let mut headers = vec![
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "api.holysheep.ai"),
        ("content-type", "application/json"),
    ];
    headers.extend(extra);
    context.dispatch_http_call("holysheep", headers, Some(body), vec![], Duration::from_secs(60)).ok()
}

/// The request's key: its JSON written back compact, keys sorted (serde_json's map is a
/// BTreeMap), hashed with SHA-256, in hex. Any body that is not JSON keys as its bytes.
fn key(body: &[u8]) -> String {
    let canonical = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| serde_json::to_vec(&v).ok())
        .unwrap_or_else(|| body.to_vec());
    let digits = b"0123456789abcdef";
    let digest = Sha256::digest(&canonical);
    digest.iter().flat_map(|b| [digits[usize::from(b >> 4)], digits[usize::from(b & 15)]]).map(char::from).collect()
}

/// The answer's `usage`: prompt and completion tokens.
fn usage(body: &[u8]) -> Option<(u64, u64)> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let u = v.get("usage")?;
    Some((u.get("prompt_tokens")?.as_u64()?, u.get("completion_tokens")?.as_u64()?))
}

fn nanos(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos().into())
}

/// One of `SLOTS` keys of a table, picked by the clock (distinct prompts spread the same way).
fn slot(table: &str, now: u64) -> String {
    format!("floor/{table}/{}", now % SLOTS)
}
