//! Bench floor for a MISS: pause on headers, read the whole body, send it to the upstream
//! cluster by `dispatch_http_call` and reply with the answer.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::time::Duration;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| Box::new(Root));
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Call))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Call;

impl Context for Call {
    fn on_http_call_response(&mut self, _token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let body = self.get_http_call_response_body(0, body_size).unwrap_or_default();
        self.send_http_response(200, vec![("content-type", "application/json")], Some(&body));
    }
}

impl HttpContext for Call {
    fn on_http_request_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        Action::Pause
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, size).unwrap_or_default();
        let headers = vec![
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            (":authority", "api.holysheep.ai"),
            ("content-type", "application/json"),
        ];
        match self.dispatch_http_call("holysheep", headers, Some(&body), vec![], Duration::from_secs(60)) {
            Ok(_) => Action::Pause,
            Err(_) => {
                self.send_http_response(502, vec![], None);
                Action::Pause
            }
        }
    }
}
