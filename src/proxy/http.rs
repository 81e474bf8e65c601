//! The http context: recognises a governed endpoint's `POST`, buffers the body, asks the
//! core what to do and does it. What becomes of every other request the core says
//! (`Head::ungoverned`). A stream leader goes along the route; its http context tees the
//! answer as it streams back, reassembling it in memory, and reports how it ended.

use super::abi as hostcalls;
use super::body_watch::Paused;
use super::counters::Stopwatch;
use super::host::{self, SharedData};
use super::worker::{Target, WorkerRef};
use crate::core::api::error::ApiError;
use crate::core::api::reply::Reply;
use crate::core::api::response::Response;
use crate::core::coalesce::engine::{Call, Engine, Step};
use crate::core::config::Role;
use crate::core::flight::tee::{AnswerHead, Arrival, StreamEnd, Tee};
use crate::core::intake::door::{Door, Entry};
use crate::core::intake::kept::Kept;
use crate::core::intake::recall::{Admitted, Decided};
use crate::core::intake::Head;
use crate::core::limits::fleet;
use crate::core::observe::log_fields::Served;
use crate::core::upstream::{self, misroute, Outbound};
use crate::core::wire::pairs;
use crate::proxy::types::{Action, BufferType, MapType};
use std::rc::Rc;

pub struct Chat {
    id: u32,
    worker: WorkerRef,
    state: State,
    /// The body being read is a model owner call from a fleet peer.
    peer: bool,
    /// The request headers the filter reads, all taken in one host call (each separate read
    /// is two crossings of the VM boundary), in the headers callback.
    head: Head,
    /// Times a governed request's answer for the timing histograms.
    stopwatch: Stopwatch,
}

enum State {
    /// Not ours: pass through.
    Ignored,
    /// Buffering the body.
    Reading,
    /// Answered, or handed to the root context.
    Handled,
    /// A forward node's call on its way to the owner, its answer's headers not back yet.
    Hopping,
    /// A stream leader's (or a hop's) answer coming back along the route.
    Teeing(Box<Tee>),
    /// The tee reported the end.
    Ended,
    /// Passed on with the operator's key (`passthrough_paths`).
    Passed,
    /// ... and HolySheep refused the key: its body, which may quote part of the key, is
    /// replaced by the edge's error.
    PassedRefused(u16),
}

impl Chat {
    pub fn new(id: u32, worker: WorkerRef) -> Self {
        Chat { id, worker, state: State::Ignored, peer: false, head: Head::default(), stopwatch: Stopwatch::default() }
    }

    fn reject(&mut self, e: &ApiError) -> Action {
        self.state = State::Handled;
        host::send(&Reply::error(e), &[]);
        Action::Pause
    }

    fn handle(&mut self, body: Vec<u8>) -> Action {
        if self.peer {
            return self.serve_peer(&body);
        }
        let config = self.worker.borrow().config.clone();
        let head = std::mem::take(&mut self.head);
        let (now, tenant) = (host::now_ms(), head.verified.clone());
        let admitted = {
            let w = &mut *self.worker.borrow_mut();
            let (engine, nonces) = (Engine { store: &SharedData, config: &config }, &mut w.nonces);
            let keep = |request: &_| Kept::of(&SharedData, &config, &mut w.counters, request, now);
            w.recall.admit(&engine, keep, head, &body, now, || nonces.next())
        };
        self.state = State::Handled;
        let Decided { step, outbound, ended } = match admitted {
            Ok(Admitted::Decided(decided)) => decided,
            Ok(Admitted::Kept(hit)) => {
                self.stopwatch = self.worker.borrow().stopwatch_of(&hit, now);
                self.worker.borrow_mut().respond_hot(&hit, now);
                return Action::Pause;
            }
            Err(e) => {
                self.worker.borrow().counters.count_refusal(e.code, tenant.as_deref());
                return self.reject(&e);
            }
        };
        let (model, endpoint) = (&outbound.model, outbound.endpoint);
        self.stopwatch = self.worker.borrow().counters.stopwatch(&config, model, endpoint, outbound.stream, now);
        if let Some((key, watched)) = ended {
            self.worker.borrow_mut().flight_ended(key, watched);
        }
        let outbound = Rc::new(outbound);
        match step {
            Step::Reply(reply) => {
                self.worker.borrow_mut().respond(Target::Current, &reply, &outbound, Served::default());
            }
            Step::Call(call) if config.role == Role::Forward => return self.hop(call, outbound),
            Step::Call(call) => self.worker.borrow_mut().defer_call(self.id, call, outbound),
            Step::Wait(wait) => self.worker.borrow_mut().wait(self.id, wait, outbound),
        }
        Action::Pause
    }

    /// A forward node's call: on to the key's owner node (`Worker::hop`).
    fn hop(&mut self, call: Call, outbound: Rc<Outbound>) -> Action {
        self.worker.borrow_mut().hop(self.id, call, outbound);
        self.state = State::Hopping;
        Action::Continue
    }

    /// The owner's answer to this forward node's hop arrives (`Hop::answer`).
    fn hop_answer(&mut self, end_of_stream: bool) -> Action {
        let head = host::headers(MapType::HttpResponseHeaders);
        let (edit, tee, disagreed) = {
            let mut w = self.worker.borrow_mut();
            let config = w.config.clone();
            let Some(hop) = w.runs.hops.get_mut(&self.id) else { return Action::Continue };
            let (edit, tee, disagreed) = hop.answer(&config, &head, host::now_ms());
            (edit, tee, disagreed.then(|| (hop.outbound.model.clone(), hop.outbound.tenant.clone())))
        };
        host::apply(MapType::HttpResponseHeaders, &edit);
        if let Some((model, tenant)) = disagreed {
            self.worker.borrow_mut().key_disagrees(&model, tenant.as_deref());
        }
        self.state = State::Teeing(Box::new(tee));
        if end_of_stream {
            self.end_stream(true);
        }
        Action::Continue
    }

    /// A fleet peer's call to this node's buckets, its secret checked.
    fn serve_peer(&mut self, body: &[u8]) -> Action {
        let config = self.worker.borrow().config.clone();
        let now = host::now_ms();
        match fleet::Op::parse(body) {
            Ok(op) => {
                let tenant = op.tenant().map(str::to_owned);
                let verdict = fleet::serve_op(&SharedData, &config, op, now);
                if let Some(tenant) = tenant {
                    self.worker.borrow().counters.record_budget(&SharedData, &config, &tenant, now);
                }
                self.state = State::Handled;
                let body = verdict.to_json();
                host::send(&Reply::plain(Response::json(200, body)), &[]);
                Action::Pause
            }
            Err(e) => self.reject(&e),
        }
    }

    /// HolySheep's answer to a request passed with the operator's key: as it is, unless it
    /// refuses the key (then the edge's 502, its body replaced as it comes).
    fn passed_answer(&mut self) -> Action {
        let status = host::status(MapType::HttpResponseHeaders).unwrap_or(0);
        if let Some(edit) = upstream::passed_refused(status) {
            self.worker.borrow_mut().key_refused(status);
            self.state = State::PassedRefused(status);
            host::apply(MapType::HttpResponseHeaders, &edit);
        }
        Action::Continue
    }

    /// A body callback (data or trailers): `Some(action)` when this request is not being
    /// read (any more), `None` to go on. A body arriving proves Envoy delivers bodies (see
    /// `body_watch`); one that comes after the root answered the request is dropped.
    fn body_arrives(&mut self) -> Option<Action> {
        match self.state {
            State::Reading => {}
            State::Handled => return Some(Action::Pause),
            _ => return Some(Action::Continue),
        }
        let live = {
            let mut w = self.worker.borrow_mut();
            w.body_watch.body_arrived();
            w.is_live(self.id)
        };
        if live {
            return None;
        }
        self.state = State::Handled;
        Some(Action::Pause)
    }

    /// The route that answered a forwarded stream leads elsewhere than `upstream.cluster`
    /// (its route for `upstream.authority` does): the edge refuses this answer and every
    /// stream from now on.
    fn misrouted(&self) -> Option<ApiError> {
        let config = self.worker.borrow().config.clone();
        if host::routed_to(&config.upstream.cluster) {
            return None;
        }
        let (note, e) = misroute::refuse(&SharedData, &config);
        host::note([note]);
        Some(e)
    }

    /// The forwarded stream (or hop) ended (`complete`: the upstream finished its answer).
    fn end_stream(&mut self, complete: bool) {
        if let State::Teeing(tee) = std::mem::replace(&mut self.state, State::Ended) {
            self.worker.borrow_mut().stream_ended(self.id, tee.end(complete));
        }
    }
}

/// Envoy's callbacks for the stream.
impl Chat {
    /// The stream is done: it is never answered after this.
    pub fn on_done(&mut self) {
        self.stopwatch.stop(host::now_ms);
        // A stream that had not ended broke off (client gone, upstream reset).
        self.end_stream(false);
        let mut w = self.worker.borrow_mut();
        if w.runs.streaming.contains_key(&self.id) || w.runs.hops.contains_key(&self.id) {
            // Gone before its answer's headers: the router may have made attempts already.
            w.stream_ended(self.id, StreamEnd { attempts: host::upstream_attempts(), ..StreamEnd::broken() });
        }
        w.forget(self.id);
    }

    pub fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let (config, env) = {
            let w = self.worker.borrow();
            (w.config.clone(), w.env.clone())
        };
        let raw = host::header_map(MapType::HttpRequestHeaders);
        let pairs = pairs::parse(&raw).unwrap_or_default();
        self.head = Head::read(pairs.iter().copied(), config.cache.tenant_header.as_deref());
        let names = pairs.iter().filter_map(|(n, _)| std::str::from_utf8(n).ok());
        let Entry { door, edit, foreign } = Door::of(&config, &env, &mut self.head, names, host::peer_sans);
        if let Some(theirs) = foreign {
            self.worker.borrow_mut().config_disagrees(&theirs);
        }
        if matches!(door, Door::WithOperatorKey) && !host::routed_to(&config.upstream.cluster) {
            return self.reject(&ApiError::misdirected());
        }
        host::apply(MapType::HttpRequestHeaders, &edit);
        match door {
            Door::Governed => {}
            Door::Refused { error, counted } => {
                if counted {
                    self.worker.borrow().counters.count_refusal(error.code, None);
                }
                return self.reject(&error);
            }
            Door::Peer => {
                self.peer = true;
                self.state = State::Reading;
                return Action::Pause;
            }
            Door::Answer(list) => {
                self.state = State::Handled;
                host::send(&Reply::plain(list), &[]);
                return Action::Pause;
            }
            Door::Pass => return Action::Continue,
            Door::WithOperatorKey => {
                self.state = State::Passed;
                return Action::Continue;
            }
        }
        self.state = State::Reading;
        if end_of_stream {
            return self.handle(Vec::new());
        }
        let declared = self.head.content_length;
        let paused = || {
            let header_bytes = pairs.iter().map(|(n, v)| (n.len() + v.len()) as u64).sum();
            Paused { since_ms: host::now_ms(), received: host::received_bytes(), header_bytes, declared }
        };
        self.worker.borrow_mut().body_watch.paused(self.id, paused);
        Action::Pause
    }

    pub fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let _clock = host::pin_clock();
        if let Some(action) = self.body_arrives() {
            return action;
        }
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

    /// Trailers end a body whose last data did not (HTTP/2, chunked with trailers): the
    /// body is complete now, and is handled like any other, never released unread.
    pub fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if let Some(action) = self.body_arrives() {
            return action;
        }
        let body = host::buffer(BufferType::HttpRequestBody, self.worker.borrow().config.max_body_bytes + 1);
        self.handle(body)
    }

    /// Only a forwarded stream's own answer is teed; the filter's local replies (which
    /// Envoy also runs through here) pass untouched.
    pub fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if matches!(self.state, State::Passed) {
            return self.passed_answer();
        }
        // A hop sent from here, or from the root for a waiter that came to lead.
        if self.worker.borrow().runs.hops.contains_key(&self.id) && !matches!(self.state, State::Teeing(_)) {
            return self.hop_answer(end_of_stream);
        }
        if !matches!(self.state, State::Handled) {
            return Action::Continue;
        }
        let Some(label) = self.worker.borrow().stream_label(self.id) else { return Action::Continue };
        let head = host::headers(MapType::HttpResponseHeaders);
        let arrival = Arrival { via_upstream: host::response_via_upstream(), attempts: host::upstream_attempts() };
        let AnswerHead { edit, tee, key_refused } = label.answer(&head, arrival, self.misrouted());
        host::apply(MapType::HttpResponseHeaders, &edit);
        if let Some(status) = key_refused {
            self.worker.borrow_mut().key_refused(status);
        }
        self.state = State::Teeing(Box::new(tee));
        if end_of_stream {
            self.end_stream(true);
        }
        Action::Continue
    }

    pub fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if body_size > 0 {
            self.stopwatch.chunk(host::now_ms);
        }
        if let State::PassedRefused(status) = self.state {
            let out = if end_of_stream { upstream::passed_refusal(status).body() } else { Vec::new() };
            let _ = hostcalls::set_buffer(BufferType::HttpResponseBody, 0, body_size, &out);
            return Action::Continue;
        }
        let State::Teeing(tee) = &mut self.state else { return Action::Continue };
        let chunk = host::buffer(BufferType::HttpResponseBody, body_size);
        if let Some(out) = tee.pass(&chunk, end_of_stream) {
            let _ = hostcalls::set_buffer(BufferType::HttpResponseBody, 0, body_size, &out);
        }
        if end_of_stream {
            self.end_stream(true);
        }
        Action::Continue
    }
}
