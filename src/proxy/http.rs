//! The http context: recognises `POST /v1/chat/completions`, buffers the body, asks the
//! core what to do and does it. Every other request passes through untouched.

use super::host::{self, SharedData};
use super::worker::{Shared, Target};
use crate::core::engine::{Engine, Reply, Step};
use crate::core::error::ApiError;
use crate::core::request::{CacheControl, ChatRequest, RequestMeta, CHAT_PATH};
use crate::core::upstream::Outbound;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};
use std::rc::Rc;

pub struct Chat {
    id: u32,
    worker: Shared,
    state: State,
}

#[derive(PartialEq, Eq)]
enum State {
    /// Not ours: pass through.
    Ignored,
    /// Buffering the body.
    Reading,
    /// Answered, or handed to the root context.
    Handled,
    /// `stream: true`: forwarded along the route; only headers are added.
    Streaming(String),
}

fn request_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpRequestHeaders, name).ok().flatten()
}

impl Chat {
    pub fn new(id: u32, worker: Shared) -> Self {
        Chat { id, worker, state: State::Ignored }
    }

    fn reject(&mut self, e: &ApiError) -> Action {
        self.state = State::Handled;
        host::send(&Reply::error(e), &[]);
        Action::Pause
    }

    fn handle(&mut self, body: Vec<u8>) -> Action {
        let config = self.worker.borrow().config.clone();
        let authorization = request_header("authorization");
        let tenant = config.cache.tenant_header.as_deref().and_then(request_header);
        let cache_control = request_header("cache-control");
        let meta = RequestMeta {
            authorization: authorization.as_deref(),
            tenant: tenant.as_deref(),
            cache_control: cache_control.as_deref(),
        };
        let request = match ChatRequest::parse(&config, &meta, &body) {
            Ok(r) => r,
            Err(e) => return self.reject(&e),
        };
        if request.stream {
            return self.pass_stream(request.key.hex().to_owned());
        }
        self.state = State::Handled;
        let policy = request.policy(&config, CacheControl::parse(meta.cache_control));
        let nonce = self.worker.borrow_mut().nonce();
        let step = Engine { store: &SharedData, config: &config }.admit(&request.key, policy, host::now_ms(), nonce);
        let outbound = Rc::new(Outbound {
            body,
            client_authorization: authorization,
            model: request.model,
            estimate_tokens: request.estimate_tokens,
        });
        match step {
            Step::Reply(reply) => {
                self.worker.borrow_mut().respond(Target::Current, &reply, &outbound.model);
            }
            Step::Call(call) => self.worker.borrow_mut().defer_call(self.id, call, outbound),
            Step::Wait(wait) => self.worker.borrow_mut().wait(self.id, wait, outbound),
        }
        Action::Pause
    }

    fn pass_stream(&mut self, key: String) -> Action {
        let bearer = self.worker.borrow().bearer().map(str::to_owned);
        if let Some(bearer) = bearer {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, "authorization", Some(&bearer));
        }
        self.state = State::Streaming(key);
        Action::Continue
    }
}

impl Context for Chat {
    fn on_done(&mut self) -> bool {
        self.worker.borrow_mut().forget(self.id);
        true
    }
}

impl HttpContext for Chat {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let method = request_header(":method").unwrap_or_default();
        let path = request_header(":path").unwrap_or_default();
        if method != "POST" || path.split('?').next() != Some(CHAT_PATH) {
            return Action::Continue;
        }
        self.state = State::Reading;
        let limit = self.worker.borrow().config.max_body_bytes;
        let declared = request_header("content-length").and_then(|l| l.trim().parse::<u64>().ok());
        if declared.is_some_and(|l| l > limit as u64) {
            return self.reject(&ApiError::too_large(limit));
        }
        if end_of_stream {
            return self.handle(Vec::new());
        }
        self.worker.borrow_mut().body_watch.paused(self.id, host::now_ms());
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.state != State::Reading {
            return if self.state == State::Handled { Action::Pause } else { Action::Continue };
        }
        let mut worker = self.worker.borrow_mut();
        worker.body_watch.body_arrived();
        if !worker.is_live(self.id) {
            // Already answered from the root (the body came too late).
            drop(worker);
            self.state = State::Handled;
            return Action::Pause;
        }
        drop(worker);
        let limit = self.worker.borrow().config.max_body_bytes;
        if body_size > limit {
            return self.reject(&ApiError::too_large(limit));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = host::buffer(BufferType::HttpRequestBody, body_size);
        self.handle(body)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if let State::Streaming(key) = &self.state {
            let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, "x-holysheep-cache", Some("BYPASS"));
            let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, "x-holysheep-key", Some(key));
        }
        Action::Continue
    }
}
