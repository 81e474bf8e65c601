//! Bench floor for a HIT: pause on headers, read the whole body, answer a fixed local reply
//! (the body the bench's HIT serves, from the plugin configuration).
//!
//! With the configuration `hit-calls:BODY` it also makes the host calls a HIT of the plugin
//! makes and nothing else: it reads the request headers, the clock and bumps a counter, and
//! its reply carries the HIT's headers. The bench's row for it shows what those calls cost
//! inside Envoy, apart from any work of the plugin's own.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType};
use std::rc::Rc;

const HIT_CALLS: &[u8] = b"hit-calls:";
/// A key as long as the plugin's (64 hex digits).
const KEY: &str = "5f0d3c8a1b2e4f6071829304a5b6c7d8e9f00112233445566778899aabbccdde";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| Box::new(Root { body: Rc::new(Vec::new()), metric: None }));
}}

struct Root {
    body: Rc<Vec<u8>>,
    /// The counter a HIT bumps, in `hit-calls` mode.
    metric: Option<u32>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
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

    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Reply { body: self.body.clone(), metric: self.metric }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Reply {
    body: Rc<Vec<u8>>,
    metric: Option<u32>,
}

impl Context for Reply {}

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
        let mut headers = vec![("content-type", "application/json")];
        if let Some(metric) = self.metric {
            let _now = hostcalls::get_current_time();
            let _ = hostcalls::increment_metric(metric, 1);
            let hit = [("x-holysheep-cache", "HIT"), ("x-holysheep-key", KEY), ("x-holysheep-model", "gpt-4.1"), ("age", "0")];
            headers.extend(hit);
        }
        self.send_http_response(200, headers, Some(&self.body));
        Action::Pause
    }
}
