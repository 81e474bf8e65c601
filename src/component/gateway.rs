//! One request through the gateway: `POST /v1/chat/completions` goes through the core
//! (cache, lease, buckets, retries), streams too: a stream leader writes HolySheep's events
//! to its client as they arrive while reassembling them for the cache and its waiters.
//! Everything else is forwarded to HolySheep with the client's own credentials and
//! streamed back. The shell only performs what the core decides.

use super::host::{self, BodyError, Kv};
use super::wasi::http::outgoing_handler;
use super::wasi::http::types::{
    Fields, IncomingBody, IncomingRequest, IncomingResponse, Method, OutgoingBody, OutgoingRequest, RequestOptions,
    ResponseOutparam, Scheme,
};
use crate::core::config::Config;
use crate::core::engine::{poll_delay_ms, Call, Engine, Reply, Step};
use crate::core::error::ApiError;
use crate::core::flight::{Action, Flight};
use crate::core::hot::{self, Hot, Seed};
use crate::core::intake::{intake, Head, Intake, Route};
use crate::core::limits::ProviderHints;
use crate::core::request::ChatRequest;
use crate::core::request::CHAT_PATH;
use crate::core::stream::{self, Reassembler};
use crate::core::upstream::{self, Outbound};
use std::cell::RefCell;
use std::rc::Rc;

/// The most bytes read from one HolySheep answer.
const MAX_UPSTREAM_BODY: usize = 16 * 1024 * 1024;
/// Request headers never forwarded (hop-by-hop, or set by the gateway).
const NOT_FORWARDED: [&str; 8] =
    ["host", "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "content-length"];
/// Response headers not copied from a forwarded answer.
const NOT_RETURNED: [&str; 5] = ["connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"];

/// What every part of one request needs: configuration, the key, and the store.
struct Gateway {
    config: Config,
    bearer: Option<String>,
    kv: Kv,
}

/// What an instance keeps between the requests it serves, when its host reuses it (one
/// request at a time): its gateway, read once, and the requests it parsed that came again.
struct Kept {
    gateway: Option<Rc<Gateway>>,
    seed: Seed,
    parsed: Hot<ChatRequest>,
}

thread_local! {
    static KEPT: RefCell<Kept> =
        RefCell::new(Kept { gateway: None, seed: Seed::new(host::nonce()), parsed: Hot::new(0) });
}

/// The instance's gateway: its environment cannot change while it lives, so it is read once.
fn gateway() -> Result<Rc<Gateway>, ApiError> {
    if let Some(g) = KEPT.with_borrow(|k| k.gateway.clone()) {
        return Ok(g);
    }
    let gateway = Rc::new(setup()?);
    KEPT.with_borrow_mut(|k| {
        k.parsed = Hot::new(gateway.config.cache.hot_bytes.min(hot::PARSED_BYTES));
        k.gateway = Some(gateway.clone());
    });
    Ok(gateway)
}

pub fn handle(request: IncomingRequest, out: ResponseOutparam) {
    let gateway = match gateway() {
        Ok(g) => g,
        Err(e) => return reply(out, &Reply::error(&e), &[]),
    };
    let head = gateway.head(&request);
    if head.route() == Route::Chat {
        gateway.chat(request, head, out);
    } else {
        gateway.forward(request, out);
    }
}

/// The method as HTTP spells it.
fn method_name(method: &Method) -> String {
    let name = match method {
        Method::Get => "GET",
        Method::Head => "HEAD",
        Method::Post => "POST",
        Method::Put => "PUT",
        Method::Delete => "DELETE",
        Method::Connect => "CONNECT",
        Method::Options => "OPTIONS",
        Method::Trace => "TRACE",
        Method::Patch => "PATCH",
        Method::Other(other) => other,
    };
    name.to_owned()
}

/// Reads the configuration (`HOLYSHEEP_CONFIG`), the key and the bucket for this request.
fn setup() -> Result<Gateway, ApiError> {
    let env = host::Env::read();
    let raw = env.get("HOLYSHEEP_CONFIG").unwrap_or_default();
    let config = Config::parse(raw.as_bytes()).map_err(|e| {
        // The detail (which may quote configuration values) goes to the log only.
        eprintln!("holysheep: {e}");
        let message = format!("the gateway's configuration is invalid at '{}' (details in its log)", e.field());
        ApiError::server(message, "invalid_configuration")
    })?;
    let bearer = upstream::bearer(env.get(&config.upstream.api_key_env));
    let bucket = env.get("HOLYSHEEP_KV_BUCKET").unwrap_or_else(|| "default".into());
    let kv = Kv::open(&bucket).map_err(|e| {
        ApiError::server(format!("the wasi:keyvalue bucket '{bucket}' cannot be opened: {e}"), "store_unavailable")
    })?;
    Ok(Gateway { config, bearer, kv })
}

fn reply(out: ResponseOutparam, reply: &Reply, extra: &[(&str, String)]) {
    let headers: Vec<(String, String)> = reply
        .headers()
        .into_iter()
        .map(|(n, v)| (n, v.into_owned()))
        .chain(extra.iter().cloned())
        .map(|(n, v)| (n.to_owned(), v))
        .collect();
    host::respond(out, reply.response.status, &headers, &reply.response.body);
}

impl Gateway {
    /// The request headers the core reads, in one call. Field names are case-insensitive and
    /// a host may keep the client's spelling: they are lowered, as `header_pairs` does. The
    /// headers handle is a child of the request: it is gone before the request is handed on
    /// (dropping a parent with live children traps).
    fn head(&self, request: &IncomingRequest) -> Head {
        let entries: Vec<(String, Vec<u8>)> =
            request.headers().entries().into_iter().map(|(n, v)| (n.to_ascii_lowercase(), v)).collect();
        let pairs = entries.iter().map(|(n, v)| (n.as_bytes(), v.as_slice()));
        let mut head = Head::read(pairs, self.config.cache.tenant_header.as_deref());
        head.method = method_name(&request.method());
        head.path = request.path_with_query().unwrap_or_else(|| "/".into());
        head
    }

    fn chat(&self, request: IncomingRequest, head: Head, out: ResponseOutparam) {
        if let Err(e) = head.check_length(&self.config) {
            return reply(out, &Reply::error(&e), &[]);
        }
        let limit = self.config.max_body_bytes;
        let body = match request.consume().map_err(|()| BodyError::Broken).and_then(|b| host::consume(b, limit)) {
            Ok(b) => b,
            Err(BodyError::TooLarge) => return reply(out, &Reply::error(&ApiError::too_large(limit)), &[]),
            Err(BodyError::Broken) => {
                let e = ApiError::invalid("the request body could not be read", None, "invalid_body");
                return reply(out, &Reply::error(&e), &[]);
            }
        };
        drop(request);
        let tenant = hot::tenant_bytes(head.authorization.as_deref(), head.tenant.as_deref());
        let raw = KEPT.with_borrow(|k| k.seed.raw(&tenant, &body));
        // Directives change what may be served: such requests are parsed every time.
        let plain = head.cache_control.is_none();
        let known = if plain { KEPT.with_borrow(|k| k.parsed.get(&raw, host::now_ms())) } else { None };
        let Intake { request: parsed, policy } = match &known {
            Some(request) => Intake::known(&self.config, ChatRequest::clone(request)),
            None => match intake(&self.config, &head, &body) {
                Ok(i) => i,
                Err(e) => return reply(out, &Reply::error(&e), &[]),
            },
        };
        let step = self.engine().admit(&parsed.key, policy, host::now_ms(), host::nonce());
        // A request answered from the cache, or waiting for one, is likely to come again.
        if plain && known.is_none() && matches!(step, Step::Reply(_) | Step::Wait(_)) {
            KEPT.with_borrow_mut(|k| k.parsed.put(&raw, u64::MAX, hot::PARSED_SIZE, parsed.clone()));
        }
        let outbound = Outbound {
            stream: parsed.stream,
            include_usage: parsed.include_usage,
            body,
            client_authorization: head.authorization,
            model: parsed.model,
            estimate_tokens: parsed.estimate_tokens,
        };
        self.run(step, &outbound, out);
    }

    /// Answers in the form the client asked for (events for a stream), with the model's
    /// `x-ratelimit-*` headers.
    fn answer(&self, out: ResponseOutparam, r: Reply, outbound: &Outbound) {
        let rate = upstream::rate_headers(&self.kv, &self.config, &outbound.model, host::now_ms());
        let response = stream::for_client(r.response.clone(), outbound.stream, outbound.include_usage);
        reply(out, &Reply { response, ..r }, &rate);
    }

    fn engine(&self) -> Engine<'_, Kv> {
        Engine { store: &self.kv, config: &self.config }
    }

    /// Carries out the core's steps until it answers; a waiter polls the store.
    fn run(&self, mut step: Step, outbound: &Outbound, out: ResponseOutparam) {
        let mut polls = 0;
        loop {
            step = match step {
                Step::Reply(r) => return self.answer(out, r, outbound),
                Step::Call(call) if outbound.stream => return self.fly_stream(call, outbound, out),
                Step::Call(call) => return self.answer(out, self.fly(call, outbound), outbound),
                Step::Wait(wait) => {
                    host::sleep_ms(poll_delay_ms(polls));
                    polls += 1;
                    self.engine().poll(&wait, host::now_ms(), host::nonce())
                }
            }
        }
    }

    /// Performs one flight: attempts, backoff, failover, then completes the call.
    fn fly(&self, call: Call, outbound: &Outbound) -> Reply {
        let mut flight = Flight::new(&self.config, call, &outbound.model, outbound.estimate_tokens);
        let mut action = flight.resume(&self.kv, &self.config, host::now_ms(), host::nonce());
        loop {
            action = match action {
                Action::Send { model, timeout_ms } => {
                    let (outcome, hints) = self.attempt(&flight.call, outbound, &model, timeout_ms);
                    flight.on_response(&self.kv, &self.config, outcome, &hints, host::now_ms(), host::nonce())
                }
                Action::Ask { .. } => self.without_owner(&mut flight),
                Action::Sleep { until_ms } => self.back_off(&mut flight, until_ms),
                Action::Finish(outcome) => return self.engine().complete(&flight.call, outcome, host::now_ms()),
            }
        }
    }

    /// An ask for a model owner's verdict has no one to go to: there is no fleet here, the
    /// key-value store is this host's own (README). The flight goes on without a verdict.
    fn without_owner(&self, flight: &mut Flight) -> Action {
        flight.on_verdict(None);
        flight.resume(&self.kv, &self.config, host::now_ms(), host::nonce())
    }

    /// Waits out a backoff, keeping the lease, then goes on with the flight.
    fn back_off(&self, flight: &mut Flight, until_ms: u64) -> Action {
        let timer = host::after_deadline(until_ms);
        host::wait_for(&timer, until_ms, self.config.tick_ms(), &mut || self.renew(&flight.call));
        flight.resume(&self.kv, &self.config, host::now_ms(), host::nonce())
    }

    /// A stream's flight: like `fly` until HolySheep starts an event stream (errors before
    /// it are retried, failed over and answered as JSON); then the events are relayed.
    fn fly_stream(&self, call: Call, outbound: &Outbound, out: ResponseOutparam) {
        let mut flight = Flight::new(&self.config, call, &outbound.model, outbound.estimate_tokens);
        let mut action = flight.resume(&self.kv, &self.config, host::now_ms(), host::nonce());
        loop {
            action = match action {
                Action::Send { model, timeout_ms } => {
                    let deadline = host::now_ms().saturating_add(timeout_ms.max(1));
                    let Some(response) = self.request_head(&flight.call, outbound, &model, deadline) else {
                        let now = host::now_ms();
                        action = flight.on_response(
                            &self.kv,
                            &self.config,
                            None,
                            &ProviderHints::default(),
                            now,
                            host::nonce(),
                        );
                        continue;
                    };
                    let events = response.status() == 200
                        && host::header(&response.headers(), "content-type")
                            .is_some_and(|t| t.contains(stream::CONTENT_TYPE));
                    if events {
                        return self.relay(flight, outbound, response, out);
                    }
                    let (outcome, hints) = self.read_answer(response, &flight.call, deadline);
                    flight.on_response(&self.kv, &self.config, outcome, &hints, host::now_ms(), host::nonce())
                }
                Action::Ask { .. } => self.without_owner(&mut flight),
                Action::Sleep { until_ms } => self.back_off(&mut flight, until_ms),
                Action::Finish(outcome) => {
                    let r = self.engine().complete(&flight.call, outcome, host::now_ms());
                    return self.answer(out, r, outbound);
                }
            }
        }
    }

    /// Writes HolySheep's events to the client as they arrive (without the usage event
    /// unless asked for) while reassembling them; then shares a finished answer (cache and
    /// waiters) or, for a stream cut off, gives the lease up so a waiter leads anew. A
    /// client that leaves does not stop the reading: its waiters still get the answer.
    fn relay(&self, mut flight: Flight, outbound: &Outbound, response: IncomingResponse, out: ResponseOutparam) {
        let call = flight.call.clone();
        let headers = vec![
            ("content-type".to_owned(), stream::CONTENT_TYPE.to_owned()),
            ("cache-control".to_owned(), "no-cache".to_owned()),
            ("x-holysheep-cache".to_owned(), call.label.as_str().to_owned()),
            ("x-holysheep-key".to_owned(), call.key.hex().to_owned()),
            ("x-holysheep-model".to_owned(), flight.model().to_owned()),
        ];
        let mut events = Reassembler::new(outbound.include_usage);
        let client_body = host::start_response(out, 200, &headers);
        let to = client_body.as_ref().and_then(|b| b.write().ok());
        let complete = match response.consume() {
            Ok(from_body) => {
                let complete = from_body.stream().is_ok_and(|from| {
                    let idle_ms = self.config.upstream.timeout_ms;
                    loop {
                        let deadline = host::now_ms().saturating_add(idle_ms);
                        match host::read_chunk(&from, deadline, self.config.tick_ms(), &mut || self.renew(&call)) {
                            Ok(Some(chunk)) => write(&to, &events.push(&chunk)),
                            Ok(None) => break true,
                            Err(_) => break false,
                        }
                    }
                });
                drop(IncomingBody::finish(from_body));
                complete
            }
            Err(()) => false,
        };
        write(&to, &events.flush());
        // Shared before the client's stream ends, so its next request is a HIT.
        let now = host::now_ms();
        let cut_off = outbound.prompt_estimate() + events.streamed_tokens_estimate();
        flight.on_stream_end(&self.kv, &self.config, events.usage(), cut_off, now);
        match events.completion().filter(|_| complete) {
            Some(answer) => {
                self.engine().complete(&call, Some(answer), now);
            }
            None => {
                self.engine().abandon(&call);
            }
        }
        drop(to);
        if let Some(b) = client_body {
            let _ = OutgoingBody::finish(b, None);
        }
    }

    fn renew(&self, call: &Call) {
        self.engine().renew(call, host::now_ms());
    }

    /// One call to HolySheep for `model`, renewing the lease while it waits.
    fn attempt(
        &self,
        call: &Call,
        outbound: &Outbound,
        model: &str,
        timeout_ms: u64,
    ) -> (Option<crate::core::cache::Response>, ProviderHints) {
        let deadline = host::now_ms().saturating_add(timeout_ms.max(1));
        match self.request_head(call, outbound, model, deadline) {
            Some(response) => self.read_answer(response, call, deadline),
            None => (None, ProviderHints::default()),
        }
    }

    /// HolySheep's whole answer, read by `deadline_ms` (the call's), renewing the lease
    /// while the body arrives: a slow body must not let a waiter take over and call again.
    fn read_answer(
        &self,
        response: IncomingResponse,
        call: &Call,
        deadline_ms: u64,
    ) -> (Option<crate::core::cache::Response>, ProviderHints) {
        let status = response.status();
        let headers = header_pairs(&response.headers());
        let Ok(body) = response.consume() else { return (None, ProviderHints::default()) };
        let read = body.stream().ok().and_then(|from| {
            let mut bytes = Vec::new();
            loop {
                match host::read_chunk(&from, deadline_ms, self.config.tick_ms(), &mut || self.renew(call)) {
                    Ok(Some(chunk)) if bytes.len() + chunk.len() <= MAX_UPSTREAM_BODY => bytes.extend(chunk),
                    Ok(None) => return Some(bytes),
                    Ok(Some(_)) | Err(_) => return None,
                }
            }
        });
        drop(IncomingBody::finish(body));
        match read {
            Some(bytes) => {
                let (r, hints) = upstream::response(status, &headers, bytes);
                (Some(r), hints)
            }
            None => (None, ProviderHints::default()),
        }
    }

    /// Sends one call to HolySheep for `model` (with its `content-length`) and waits for
    /// the head of its answer until `deadline_ms`, renewing the lease meanwhile.
    fn request_head(
        &self,
        call: &Call,
        outbound: &Outbound,
        model: &str,
        deadline_ms: u64,
    ) -> Option<IncomingResponse> {
        let body = outbound.body_for(model);
        let mut headers: Vec<(String, String)> =
            outbound.headers(self.bearer.as_deref()).into_iter().map(|(n, v)| (n.to_owned(), v.to_owned())).collect();
        headers.push(("content-length".to_owned(), body.len().to_string()));
        if outbound.stream {
            headers.retain(|(n, _)| n != "accept");
            headers.push(("accept".to_owned(), stream::CONTENT_TYPE.to_owned()));
        }
        self.outgoing(Method::Post, CHAT_PATH, &headers)
            .and_then(|request| self.send(request, Body::Bytes(&body), deadline_ms, &mut || self.renew(call)))
    }

    /// Sends a request to HolySheep with `body` and waits for its head until `deadline_ms`,
    /// calling `between` while it waits.
    fn send(
        &self,
        request: OutgoingRequest,
        body: Body<'_>,
        deadline_ms: u64,
        between: &mut dyn FnMut(),
    ) -> Option<IncomingResponse> {
        let outgoing = request.body().ok()?;
        let future = outgoing_handler::handle(request, Some(options(deadline_ms))).ok()?;
        if let Ok(to) = outgoing.write() {
            match body {
                Body::Bytes(b) => {
                    host::write_all(&to, b);
                }
                Body::From(client) => {
                    if let Ok(incoming) = client.consume() {
                        if let Ok(from) = incoming.stream() {
                            host::pipe(&from, &to);
                        }
                    }
                }
            }
        }
        OutgoingBody::finish(outgoing, None).ok()?;
        let ready = future.subscribe();
        if !host::wait_for(&ready, deadline_ms, self.config.tick_ms(), between) {
            return None;
        }
        drop(ready);
        future.get()?.ok()?.ok()
    }

    fn outgoing(&self, method: Method, path: &str, headers: &[(String, String)]) -> Option<OutgoingRequest> {
        let request = OutgoingRequest::new(host::fields(headers));
        let scheme = if self.config.upstream.scheme == "http" { Scheme::Http } else { Scheme::Https };
        request.set_method(&method).ok()?;
        request.set_scheme(Some(&scheme)).ok()?;
        request.set_authority(Some(&self.config.upstream.authority)).ok()?;
        request.set_path_with_query(Some(path)).ok()?;
        Some(request)
    }

    /// Passes a request the gateway does not govern to HolySheep and streams the answer
    /// back. It carries the client's own credentials, never the operator's key: only calls
    /// that go through the cache, the single flight and the buckets use that.
    fn forward(&self, request: IncomingRequest, out: ResponseOutparam) {
        let received = header_pairs(&request.headers());
        let headers: Vec<(String, String)> =
            received.into_iter().filter(|(n, _)| !NOT_FORWARDED.contains(&n.as_str())).collect();
        let path = request.path_with_query().unwrap_or_else(|| "/".into());
        let deadline = host::now_ms().saturating_add(self.config.upstream.timeout_ms);
        let answer = self
            .outgoing(request.method(), &path, &headers)
            .and_then(|outgoing| self.send(outgoing, Body::From(&request), deadline, &mut || {}));
        let Some(answer) = answer else {
            let e = ApiError::upstream(502, "HolySheep could not be reached", "upstream_unavailable");
            return reply(out, &Reply::error(&e), &[]);
        };
        let headers: Vec<(String, String)> =
            header_pairs(&answer.headers()).into_iter().filter(|(n, _)| !NOT_RETURNED.contains(&n.as_str())).collect();
        let Some(client_body) = host::start_response(out, answer.status(), &headers) else { return };
        if let (Ok(from_body), Ok(to)) = (answer.consume(), client_body.write()) {
            if let Ok(from) = from_body.stream() {
                host::pipe(&from, &to);
            }
        }
        let _ = OutgoingBody::finish(client_body, None);
    }
}

/// Writes to the client while it listens (a client gone does not stop the stream).
fn write(to: &Option<super::wasi::io::streams::OutputStream>, bytes: &[u8]) {
    if let Some(to) = to {
        if !bytes.is_empty() {
            host::write_all(to, bytes);
        }
    }
}

fn options(deadline_ms: u64) -> RequestOptions {
    let options = RequestOptions::new();
    let ns = deadline_ms.saturating_sub(host::now_ms()).max(1).saturating_mul(1_000_000);
    let _ = options.set_connect_timeout(Some(ns));
    let _ = options.set_first_byte_timeout(Some(ns));
    options
}

/// The body of a request to HolySheep: bytes in hand, or the client's body streamed through.
enum Body<'a> {
    Bytes(&'a [u8]),
    From(&'a IncomingRequest),
}

/// Header pairs with lower-case names (values that are not text are left out).
fn header_pairs(fields: &Fields) -> Vec<(String, String)> {
    fields
        .entries()
        .into_iter()
        .filter_map(|(n, v)| Some((n.to_ascii_lowercase(), String::from_utf8(v).ok()?)))
        .collect()
}
