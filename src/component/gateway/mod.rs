//! One request through the gateway: a governed endpoint's `POST` (chat, completions,
//! embeddings, Responses) goes through the core (cache, lease, buckets, retries), streams
//! too: a stream leader writes HolySheep's events to its client as they arrive while
//! reading them for the cache, its waiters and the bill. What becomes of every other
//! request the core says (`Head::ungoverned`): forwarded to HolySheep and streamed back
//! (`calls`), or answered here. The shell only performs what the core decides.

mod calls;
mod instance;

use super::host::{self, BodyError, Kv};
use super::wasi::http::types::{
    IncomingBody, IncomingRequest, IncomingResponse, Method, OutgoingBody, ResponseOutparam,
};
use crate::core::api::error::ApiError;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::reply::Reply;
use crate::core::coalesce::engine::{poll_delay_ms, Call, Engine, Step};
use crate::core::flight::leader::{Do, Leader};
use crate::core::flight::look::Answer;
use crate::core::intake::recall::{Admitted, Decided};
use crate::core::intake::{Head, Route, Ungoverned};
use crate::core::upstream::Outbound;
use calls::Failed;
use instance::Gateway;
use std::rc::Rc;

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
        let engine = self.engine();
        // A flight the intake ended at once has no waiter to wake here: waiters poll.
        let Decided { step, outbound, ended: _ } = match instance::admit(&engine, head, &body) {
            Ok(Admitted::Decided(d)) => d,
            // An instance keeps no answers of its own (`instance::admit`).
            Ok(Admitted::Kept(hit)) => return self.answer(out, hit.reply_at(host::now_ms()), &hit.outbound),
            Err(e) => return host::reply(out, &Reply::error(&e), &[]),
        };
        self.run(step, Rc::new(outbound), out);
    }

    /// Answers in the form the client asked for (events for a stream), with the model's
    /// `x-ratelimit-*` headers.
    fn answer(&self, out: ResponseOutparam, r: Reply, outbound: &Outbound) {
        let (reply, extra) = outbound.for_client(&self.kv, &self.config, &r, host::now_ms);
        host::reply(out, &reply, &extra);
    }

    fn engine(&self) -> Engine<'_, Kv> {
        Engine { store: &self.kv, config: &self.config }
    }

    /// Carries out the core's steps until it answers; a waiter polls the store.
    fn run(&self, mut step: Step, outbound: Rc<Outbound>, out: ResponseOutparam) {
        let mut polls = 0;
        loop {
            step = match step {
                Step::Reply(r) => return self.answer(out, r, &outbound),
                Step::Call(call) => return self.lead(call, outbound, out),
                Step::Wait(wait) => {
                    host::sleep_ms(poll_delay_ms(polls));
                    polls += 1;
                    self.engine().poll(&wait, host::now_ms(), host::nonce())
                }
            }
        }
    }

    /// A leader's call, carried out one `Do` at a time (`flight::leader`): its question's
    /// embedding, its attempts (a stream's events relayed once HolySheep starts them;
    /// errors before that are retried, failed over and answered as JSON), its backoffs,
    /// until it is over.
    fn lead(&self, call: Call, outbound: Rc<Outbound>, out: ResponseOutparam) {
        let (mut leader, mut next) = Leader::start(&self.engine(), call, outbound.clone(), self.env.clone(), self.at());
        loop {
            next = match next {
                Do::Embed(call) => {
                    let answer = self.embed(leader.call(), &call);
                    let answer = match &answer {
                        Ok((status, body)) => Answer::Got { status: *status, body: body.as_deref() },
                        Err(Failed::Unsent) => Answer::Unsent,
                        Err(Failed::Unknown) => Answer::Lost,
                    };
                    leader.on_embedding(&self.engine(), answer, self.at())
                }
                Do::Send { call, .. } if outbound.stream => {
                    let deadline = host::now_ms().saturating_add(call.timeout_ms);
                    let (outcome, hints) = match self.request(&call, leader.call(), deadline) {
                        Ok(response) if is_event_stream(&response) => {
                            return self.relay(leader, response, out);
                        }
                        Ok(response) => self.read_answer(response, &leader, deadline),
                        Err(failed) => (None, failed.hints()),
                    };
                    leader.on_response(&self.engine(), outcome, &hints, self.at())
                }
                Do::Send { call, .. } => {
                    let (outcome, hints) = self.attempt(&leader, &call);
                    leader.on_response(&self.engine(), outcome, &hints, self.at())
                }
                // No fleet here, the key-value store is this host's own (docs/component.md):
                // the flight goes on without a verdict.
                Do::Ask { .. } => leader.on_verdict(&self.engine(), None, self.at()),
                Do::Sleep { until_ms } => {
                    // The lease is kept while the leader waits.
                    let timer = host::after_deadline(until_ms);
                    host::wait_for(&timer, until_ms, self.config.tick_ms(), &mut || self.renew(leader.call()));
                    leader.on_timer(&self.engine(), self.at())
                }
                Do::Over(over) => {
                    let Some(ended) = over.ended else { return };
                    return self.answer(out, ended.reply, &outbound);
                }
            }
        }
    }

    /// Now, and a fresh random number.
    fn at(&self) -> (u64, u64) {
        (host::now_ms(), host::nonce())
    }

    /// Writes HolySheep's events to the client as they arrive (without the usage event
    /// unless asked for) while reassembling them; then shares a finished answer (cache and
    /// waiters) or, for a stream cut off, gives the lease up so a waiter leads anew. A
    /// client that leaves does not stop the reading: its waiters still get the answer.
    fn relay(&self, mut leader: Leader, response: IncomingResponse, out: ResponseOutparam) {
        let call = leader.call().clone();
        let Some(label) = leader.stream_label(&self.config) else { return };
        let (headers, mut tee) = label.relayed();
        let hints = ProviderHints::from_headers(200, &host::header_pairs(&response.headers()));
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
        leader.on_stream_end(&self.engine(), end, host::now_ms());
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

/// Whether HolySheep's answer is the event stream a stream leader relays.
fn is_event_stream(response: &IncomingResponse) -> bool {
    let content_type = host::header(&response.headers(), headers::CONTENT_TYPE);
    response.status() == 200 && content_type.is_some_and(|t| headers::is_event_stream(&t))
}

/// Writes to the client while it listens (a client gone does not stop the stream).
fn write(to: &Option<super::wasi::io::streams::OutputStream>, bytes: &[u8]) {
    if let Some(to) = to {
        if !bytes.is_empty() {
            host::write_all(to, bytes);
        }
    }
}
