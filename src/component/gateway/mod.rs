//! One request through the gateway: a governed endpoint's `POST` (chat, completions,
//! embeddings, Responses) goes through the core (cache, lease, buckets, retries), streams
//! too: a stream leader writes HolySheep's events to its client as they arrive while
//! reading them for the cache, its waiters and the bill. What becomes of every other
//! request the core says (`Head::ungoverned`): forwarded to HolySheep and streamed back
//! (`calls`), or answered here. The shell only performs what the core decides.

mod calls;
mod instance;
mod semantic;

use super::host::{self, BodyError, Kv};
use super::wasi::http::types::{
    IncomingBody, IncomingRequest, IncomingResponse, Method, OutgoingBody, ResponseOutparam,
};
use crate::core::api::error::ApiError;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::reply::{stream_head, Reply};
use crate::core::coalesce::engine::{poll_delay_ms, Call, Engine, Step};
use crate::core::flight::tee::Events;
use crate::core::flight::{Action, Flight};
use crate::core::intake::{self, Decision, Head, Route, Ungoverned};
use crate::core::limits;
use crate::core::semantic::Learned;
use crate::core::stream::{self, Reassembler};
use crate::core::upstream::Outbound;
use instance::Gateway;
use semantic::Looked;

pub fn handle(request: IncomingRequest, out: ResponseOutparam) {
    let gateway = match instance::gateway() {
        Ok(g) => g,
        Err(e) => return host::reply(out, &Reply::error(&e), &[]),
    };
    let head = gateway.head(&request);
    if matches!(head.route(), Route::Governed(_)) {
        return gateway.governed(request, head, out);
    }
    match head.ungoverned(&gateway.config) {
        Ungoverned::Pass => gateway.forward(request, false, out),
        Ungoverned::WithOperatorKey => gateway.forward(request, true, out),
        Ungoverned::Answer(Ok(list)) => host::reply(out, &Reply::plain(list), &[]),
        Ungoverned::Answer(Err(e)) => host::reply(out, &Reply::error(&e), &[]),
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

    fn governed(&self, request: IncomingRequest, mut head: Head, out: ResponseOutparam) {
        if let Err(e) = head.check(&self.config) {
            return host::reply(out, &Reply::error(&e), &[]);
        }
        let limit = self.config.max_body_bytes;
        let body = match request.consume().map_err(|()| BodyError::Broken).and_then(|b| host::consume(b, limit)) {
            Ok(b) => b,
            Err(BodyError::TooLarge) => return host::reply(out, &Reply::error(&ApiError::too_large(limit)), &[]),
            Err(BodyError::Broken) => {
                let e = ApiError::invalid("the request body could not be read", None, "invalid_body");
                return host::reply(out, &Reply::error(&e), &[]);
            }
        };
        drop(request);
        let scope = head.scope_bytes();
        let raw = instance::raw(&scope, &body);
        // Directives change what may be served: such requests are parsed every time.
        let known = if head.plain() { instance::parsed(&raw) } else { None };
        let engine = self.engine();
        // A flight the intake ended at once has no waiter to wake here: waiters poll.
        let Decision { request: parsed, step, outbound, keep, ended: _ } =
            match intake::decide(&engine, head, &body, known.as_deref(), host::now_ms(), host::nonce()) {
                Ok(d) => d,
                Err(e) => return host::reply(out, &Reply::error(&e), &[]),
            };
        // No answers are kept in an instance's memory: a HIT's parse stands in for its answer.
        if keep.parse {
            instance::keep_parsed(&raw, parsed);
        }
        self.run(step, &outbound, out);
    }

    /// Answers in the form the client asked for (events for a stream), with the model's
    /// `x-ratelimit-*` headers.
    fn answer(&self, out: ResponseOutparam, r: Reply, outbound: &Outbound) {
        let mut extra = limits::rate_headers(&self.kv, &self.config, &outbound.model, host::now_ms);
        extra.extend(outbound.tenant_header());
        let response = stream::for_client(r.response.clone(), outbound.stream, outbound.include_usage);
        host::reply(out, &Reply { response, ..r }, &extra);
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
                Step::Call(call) => return self.lead(call, outbound, out),
                Step::Wait(wait) => {
                    host::sleep_ms(poll_delay_ms(polls));
                    polls += 1;
                    self.engine().poll(&wait, host::now_ms(), host::nonce())
                }
            }
        }
    }

    /// A leader's call: answered from a paraphrase when the semantic tier finds one, else
    /// its flight (which teaches the index its question when it looked).
    fn lead(&self, call: Call, outbound: &Outbound, out: ResponseOutparam) {
        let (call, learned) = match self.look_for_paraphrase(call, outbound) {
            Looked::Answered(reply) => return self.answer(out, reply, outbound),
            Looked::Go(call, learned) => (call, learned),
        };
        if outbound.stream {
            return self.fly_stream(call, learned, outbound, out);
        }
        self.answer(out, self.fly(call, learned.as_ref(), outbound), outbound)
    }

    /// The call's answer shared (cache and waiters), and its question learned.
    fn complete(
        &self,
        call: &Call,
        outcome: Option<crate::core::api::response::Response>,
        learned: Option<&Learned>,
    ) -> Reply {
        let now = host::now_ms();
        let reply = self.engine().complete(call, outcome, now);
        crate::core::semantic::keep(&self.kv, &self.config, learned, reply.stored_answer(), &call.key, now);
        reply
    }

    /// Performs one flight: attempts, backoff, failover, then completes the call.
    fn fly(&self, call: Call, learned: Option<&Learned>, outbound: &Outbound) -> Reply {
        let mut flight = Flight::new(&self.config, call, outbound);
        let mut action = flight.resume(&self.kv, &self.config, host::now_ms(), host::nonce());
        loop {
            action = match action {
                Action::Send { model, timeout_ms } => {
                    let (outcome, hints) = self.attempt(&flight.call, outbound, &model, timeout_ms);
                    flight.on_response(&self.kv, &self.config, outcome, &hints, host::now_ms(), host::nonce())
                }
                Action::Ask { .. } => self.without_owner(&mut flight),
                Action::Sleep { until_ms } => self.back_off(&mut flight, until_ms),
                Action::Finish(outcome) => return self.complete(&flight.call, outcome, learned),
            }
        }
    }

    /// An ask for a model owner's verdict has no one to go to: there is no fleet here, the
    /// key-value store is this host's own (docs/component.md). The flight goes on without
    /// a verdict.
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
    fn fly_stream(&self, call: Call, learned: Option<Learned>, outbound: &Outbound, out: ResponseOutparam) {
        let mut flight = Flight::new(&self.config, call, outbound);
        let mut action = flight.resume(&self.kv, &self.config, host::now_ms(), host::nonce());
        loop {
            action = match action {
                Action::Send { model, timeout_ms } => {
                    let deadline = host::now_ms().saturating_add(timeout_ms.max(1));
                    let response = match self.request_head(&flight.call, outbound, &model, deadline) {
                        Ok(response) => response,
                        Err(failed) => {
                            let now = host::now_ms();
                            let hints = failed.hints();
                            action = flight.on_response(&self.kv, &self.config, None, &hints, now, host::nonce());
                            continue;
                        }
                    };
                    let events = response.status() == 200
                        && host::header(&response.headers(), headers::CONTENT_TYPE)
                            .is_some_and(|t| headers::is_event_stream(&t));
                    if events {
                        return self.relay(flight, learned.as_ref(), outbound, response, out);
                    }
                    let (outcome, hints) = self.read_answer(response, &flight.call, outbound, deadline);
                    flight.on_response(&self.kv, &self.config, outcome, &hints, host::now_ms(), host::nonce())
                }
                Action::Ask { .. } => self.without_owner(&mut flight),
                Action::Sleep { until_ms } => self.back_off(&mut flight, until_ms),
                Action::Finish(outcome) => {
                    let r = self.complete(&flight.call, outcome, learned.as_ref());
                    return self.answer(out, r, outbound);
                }
            }
        }
    }

    /// Writes HolySheep's events to the client as they arrive (without the usage event
    /// unless asked for) while reassembling them; then shares a finished answer (cache and
    /// waiters) or, for a stream cut off, gives the lease up so a waiter leads anew. A
    /// client that leaves does not stop the reading: its waiters still get the answer.
    fn relay(
        &self,
        mut flight: Flight,
        learned: Option<&Learned>,
        outbound: &Outbound,
        response: IncomingResponse,
        out: ResponseOutparam,
    ) {
        let call = flight.call.clone();
        let fresh_s = call.store.then_some(self.config.cache.ttl_seconds);
        let head = stream_head(call.label, call.key.hex(), flight.model(), outbound.tenant.as_deref(), fresh_s);
        let mut headers = vec![(headers::CONTENT_TYPE.to_owned(), headers::EVENT_STREAM.to_owned())];
        headers.extend(head.into_iter().map(|(n, v)| (n.to_owned(), v)));
        let signer = self.config.signer(outbound.endpoint, outbound.tenant.as_deref());
        let events = Reassembler::of(outbound.endpoint, outbound.include_usage).signing(signer);
        let hints = ProviderHints::from_headers(200, &host::header_pairs(&response.headers()));
        let mut tee = Events::new(events);
        let client_body = host::start_response(out, 200, &headers);
        let to = client_body.as_ref().and_then(|b| b.write().ok());
        let complete = match response.consume() {
            Ok(from_body) => {
                let complete = from_body.stream().is_ok_and(|from| {
                    let idle_ms = self.config.upstream.timeout_ms;
                    loop {
                        let deadline = host::now_ms().saturating_add(idle_ms);
                        match host::read_chunk(&from, deadline, self.config.tick_ms(), &mut || self.renew(&call)) {
                            Ok(Some(chunk)) => write(&to, tee.pass(&chunk, false).as_deref().unwrap_or(&chunk)),
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
        // The rest (from `[DONE]` on) waits until the answer is shared: a client that stops
        // reading at `[DONE]` (the SDKs do) sends its next request only when that is a HIT.
        let held = tee.pass(&[], true).unwrap_or_default();
        // One attempt: the component's own loop made (and counted) any before it.
        let end = tee.end(complete, (Some(200), 1), hints);
        flight.on_stream_end(
            &self.kv,
            &self.config,
            &end.outcome(outbound.prompt_estimate()),
            &end.hints,
            host::now_ms(),
        );
        match end.outcome {
            Some(answer) => {
                self.complete(&call, Some(answer), learned);
            }
            None => {
                self.engine().abandon(&call, host::now_ms());
            }
        }
        write(&to, &held);
        drop(to);
        if let Some(b) = client_body {
            let _ = OutgoingBody::finish(b, None);
        }
    }

    pub(super) fn renew(&self, call: &Call) {
        self.engine().renew(call, host::now_ms());
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
