//! Bench floor for a HIT: pause on headers, read the whole body, answer a fixed local reply
//! (the body the bench's HIT serves, from the plugin configuration).

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::rc::Rc;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| Box::new(Root { body: Rc::new(Vec::new()) }));
}}

struct Root {
    body: Rc<Vec<u8>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        self.body = Rc::new(self.get_plugin_configuration().unwrap_or_default());
        size > 0
    }

    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Reply { body: self.body.clone() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Reply {
    body: Rc<Vec<u8>>,
}

impl Context for Reply {}

impl HttpContext for Reply {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
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
        self.send_http_response(200, vec![("content-type", "application/json")], Some(&self.body));
        Action::Pause
    }
}
