//! One request through the native module: its head through the core's door, its body
//! through the core's memory and decision, then the `Step` carried out. A leader's `Do`s are
//! callouts from its own filter; a waiter is woken through its scheduler when its flight
//! ends (on any worker), with a safety poll at the tick; sleeps, lease renewals and
//! deadlines are timers. The shell decides nothing: it performs what the core says.

use super::abi::{self, EnvoyFilter};
use super::host;
use super::relay::{Answer as Streamed, Finished};
use super::stats::EnvoyStats;
use super::store::ProcessStore;
use super::tails::{self, Following};
use super::wake::{self, Waker, POLL, RENEW, TAIL, TIMER, WAKE};
use super::Shared;
use crate::core::api::error::ApiError;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::reply::{CacheStatus, Reply};
use crate::core::api::response::Response;
use crate::core::coalesce::engine::{Ended, Engine, Step, Wait};
use crate::core::flight::leader::{Do, Leader};
use crate::core::flight::look::Answer;
use crate::core::flight::tail::{Log, Reader};
use crate::core::flight::tee::StreamEnd;
use crate::core::intake::door::{Door, Entry};
use crate::core::intake::recall::{Admitted, Decided};
use crate::core::intake::Head;
use crate::core::observe::log_fields::Served;
use crate::core::observe::meters::Stopwatch;
use crate::core::observe::metrics::{self, Counter};
use crate::core::semantic::MAX_EMBEDDING_BYTES;
use crate::core::upstream::{self, Outbound};
use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;

/// A request's filter.
pub struct Filter {
    shared: Arc<Shared>,
    envoy: EnvoyFilter,
    head: Head,
    stage: Stage,
    waker: Option<Arc<Waker>>,
    /// Whether a lease renewal is due (one at a time, while it leads).
    renewing: bool,
    /// Whether a waiter's look at the tick is due (one at a time).
    polling: bool,
    /// Its client reads slower than it is sent to: a follower sends nothing more until it
    /// catches up (the slot sets it from the watermark hooks).
    pressure: Rc<Cell<bool>>,
    /// Times a governed request from when it arrived in full (with `log_fields`).
    stopwatch: Stopwatch<EnvoyStats>,
}

/// A part of a streaming call's answer.
pub enum Part {
    /// Its headers (and whether they end it).
    Head(Vec<(String, String)>, bool),
    /// Bytes of its body as one read brought them (and whether they end it).
    Data(Vec<u8>, bool),
    /// Its end: `true` when its last byte came, `false` when it was reset.
    End(bool),
}

enum Stage {
    /// Not the edge's to answer (passed on, or answered already).
    Passing,
    /// Passed on with the operator's key (`passthrough_paths`): HolySheep's answer goes
    /// back as it is, unless it refuses the key (then `Refusing`, with its status).
    Passed,
    Refusing(u16),
    /// A governed request's body on its way.
    Reading,
    /// Waiting for another request's flight.
    Waiting {
        wait: Wait,
        outbound: Rc<Outbound>,
    },
    /// Following a streaming leader's tail live, as a waiter of its flight.
    Tailing {
        following: Box<Following>,
        wait: Wait,
        outbound: Rc<Outbound>,
    },
    /// Leading a flight: what is out for it (a callout's id, or a sleep).
    Leading {
        leader: Box<Leader>,
        outbound: Rc<Outbound>,
        out: Out,
    },
    Done,
}

enum Out {
    Embedding(u64),
    Attempt(u64),
    /// A streaming call, and its answer as far as it came.
    Stream(u64, Option<Streamed>),
    Sleep,
}

impl Filter {
    pub fn new(shared: Arc<Shared>, envoy: EnvoyFilter) -> Filter {
        Filter {
            shared,
            envoy,
            head: Head::default(),
            stage: Stage::Passing,
            waker: None,
            renewing: false,
            polling: false,
            pressure: Rc::default(),
            stopwatch: Stopwatch::default(),
        }
    }

    /// Envoy's filter.
    pub fn envoy(&self) -> EnvoyFilter {
        self.envoy
    }

    /// The flag of its client's write buffer (see `Slot::pressure`).
    pub fn pressure(&self) -> Rc<Cell<bool>> {
        self.pressure.clone()
    }

    fn engine(&self) -> Engine<'_, ProcessStore> {
        Engine { store: &ProcessStore, config: &self.shared.config }
    }

    fn waker(&mut self) -> Arc<Waker> {
        let envoy = self.envoy;
        self.waker.get_or_insert_with(|| Waker::new(envoy)).clone()
    }

    /// Answers the request with `e`.
    fn reject(&mut self, e: &ApiError) -> i32 {
        self.stage = Stage::Done;
        host::send(self.envoy, &Reply::error(e), &[]);
        abi::STOP_ITERATION
    }

    pub fn on_request_headers(&mut self, end_of_stream: bool) -> i32 {
        let shared = self.shared.clone();
        let config = &shared.config;
        let pairs = host::request_headers(self.envoy);
        let read = pairs.iter().map(|(n, v)| (n.as_slice(), v.as_slice()));
        self.head = Head::read(read, config.cache.tenant_header.as_deref());
        let names = pairs.iter().filter_map(|(n, _)| std::str::from_utf8(n).ok());
        let envoy = self.envoy;
        let env = super::worker_env(&shared);
        let Entry { door, edit, foreign: _ } = Door::of(config, &env, &mut self.head, names, || host::peer_sans(envoy));
        if !matches!(door, Door::WithOperatorKey) {
            host::apply(self.envoy, &edit);
        }
        match door {
            Door::Governed => {}
            Door::Refused { error, counted } => {
                if counted {
                    super::with_meters(&shared, |m| m.count_refusal(error.code, None));
                }
                return self.reject(&error);
            }
            // No fleet on this module (docs/native.md): nothing calls it as a peer.
            Door::Peer => return self.reject(&ApiError::not_found(&self.head.method, &self.head.path)),
            // The operator's key goes on only along a route to HolySheep's cluster.
            Door::WithOperatorKey => {
                let routed = host::routed_cluster(envoy);
                if routed.as_deref() != Some(config.upstream.cluster.as_str()) {
                    let shown: String = routed.as_deref().unwrap_or("none").chars().take(128).collect();
                    let line = format!(
                        "holysheep: a request's route leads to cluster '{shown}', not '{}'",
                        config.upstream.cluster
                    );
                    host::log(abi::LOG_WARN, &line);
                    return self.reject(&ApiError::misdirected());
                }
                host::apply(self.envoy, &edit);
                self.stage = Stage::Passed;
                return abi::CONTINUE;
            }
            Door::Answer(list) => {
                self.stage = Stage::Done;
                host::send(self.envoy, &Reply::plain(list), &[]);
                return abi::STOP_ITERATION;
            }
            Door::Pass => return abi::CONTINUE,
        }
        if end_of_stream {
            self.handle(Vec::new());
            return abi::STOP_ITERATION;
        }
        self.stage = Stage::Reading;
        abi::STOP_ITERATION
    }

    pub fn on_request_body(&mut self, end_of_stream: bool) -> i32 {
        if !matches!(self.stage, Stage::Reading) {
            return abi::CONTINUE;
        }
        let limit = self.shared.config.max_body_bytes;
        if host::body_size(self.envoy) > limit {
            self.reject(&ApiError::too_large(limit));
            return abi::STOP_AND_BUFFER;
        }
        if end_of_stream {
            let body = host::whole_body(self.envoy);
            self.handle(body);
        }
        abi::STOP_AND_BUFFER
    }

    /// Trailers end a body whose last data did not: it is complete now.
    pub fn on_request_trailers(&mut self) -> i32 {
        if !matches!(self.stage, Stage::Reading) {
            return abi::CONTINUE;
        }
        let body = host::whole_body(self.envoy);
        self.handle(body);
        abi::STOP_ITERATION
    }

    /// HolySheep's answer to a request passed with the operator's key: as it is, unless it
    /// refuses the key (then the edge's 502, its body replaced as it comes). Every other
    /// answer (the filter's own replies among them) passes untouched.
    pub fn on_response_headers(&mut self) -> i32 {
        if !matches!(self.stage, Stage::Passed) {
            return abi::CONTINUE;
        }
        let status = host::response_status(self.envoy).unwrap_or(0);
        if let Some(edit) = upstream::passed_refused(status) {
            super::key_refused(&self.shared, status);
            host::apply_to_response(self.envoy, &edit);
            self.stage = Stage::Refusing(status);
        }
        abi::CONTINUE
    }

    pub fn on_response_body(&mut self, end_of_stream: bool) -> i32 {
        if let Stage::Refusing(status) = self.stage {
            let out = if end_of_stream { upstream::passed_refusal(status).body() } else { Vec::new() };
            host::replace_response_chunk(self.envoy, &out);
        }
        abi::CONTINUE
    }

    fn handle(&mut self, body: Vec<u8>) {
        let head = std::mem::take(&mut self.head);
        let (now, tenant) = (wake::now_ms(), head.verified.clone());
        let admitted = super::admit(&self.shared, head, &body, now);
        let Decided { step, outbound, ended: finished } = match admitted {
            Ok(Admitted::Decided(d)) => d,
            // A HIT this worker answered before from the same bytes: its counts resolved
            // then.
            Ok(Admitted::Kept(hit)) => {
                let (config, out) = (&self.shared.config, &hit.outbound);
                self.stopwatch = super::with_meters(&self.shared, |m| {
                    m.hold(&hit.counters);
                    m.flush();
                    m.stopwatch(config, &out.model, out.endpoint, out.stream, now)
                });
                if self.shared.config.log_fields {
                    host::publish(self.envoy, &hit.answered(&self.shared.config));
                }
                return self.send_reply(&hit.reply_at(now), &hit.outbound);
            }
            Err(e) => {
                super::with_meters(&self.shared, |m| m.count_refusal(e.code, tenant.as_deref()));
                self.reject(&e);
                return;
            }
        };
        ended(finished);
        let (config, out) = (&self.shared.config, &outbound);
        self.stopwatch =
            super::with_meters(&self.shared, |m| m.stopwatch(config, &out.model, out.endpoint, out.stream, now));
        self.run(step, Rc::new(outbound), Served::default());
    }

    /// Carries out a step of the engine.
    fn run(&mut self, step: Step, outbound: Rc<Outbound>, served: Served) {
        match step {
            Step::Reply(reply) => self.answer(&reply, &outbound, served),
            Step::Call(call) => {
                let env = super::worker_env(&self.shared);
                let at = (wake::now_ms(), super::nonce());
                let (leader, next) = Leader::start(&self.engine(), call, outbound.clone(), env, at);
                self.stage = Stage::Leading { leader: Box::new(leader), outbound, out: Out::Sleep };
                // Its lease is renewed every tick while it leads: calls, backoffs and waits
                // for its bucket may all outlast the lease.
                self.renew_later(at.0);
                self.advance(next);
            }
            Step::Wait(wait) => {
                let waker = self.waker();
                wake::wait_for(wait.key.hex(), &waker);
                // Registered first: a tail that begins after this look wakes it.
                if self.follow(&wait, &outbound) {
                    return;
                }
                // A look at the tick besides: a leader may be gone without ending its
                // flight, and the wait has a deadline.
                self.look_later();
                self.stage = Stage::Waiting { wait, outbound };
            }
        }
    }

    /// Counts `reply`, publishes what the access log shows of it (`served`: how the request
    /// came to it), then sends it (`send_reply`).
    fn answer(&mut self, reply: &Reply, outbound: &Outbound, served: Served) {
        let config = &self.shared.config;
        super::with_meters(&self.shared, |m| m.count_reply(config, &outbound.model, reply, outbound.tenant.as_deref()));
        if config.log_fields {
            let usage = (reply.response.status == 200).then(|| super::usage_of(&self.shared, &reply.response.body));
            host::publish(self.envoy, &outbound.answered(reply, served, usage.flatten()).priced(config));
        }
        self.send_reply(reply, outbound);
    }

    /// Sends `reply` in the form the request asked for, with the model's rate headers.
    fn send_reply(&mut self, reply: &Reply, outbound: &Outbound) {
        self.stage = Stage::Done;
        self.stopwatch.chunk(wake::now_ms);
        let (reply, extra) = outbound.for_client(&ProcessStore, &self.shared.config, reply, wake::now_ms);
        host::send(self.envoy, &reply, &extra);
    }

    /// Counts what the leader did since it was last looked at (its events).
    fn drain(shared: &Shared, leader: &mut Leader) {
        let events = std::mem::take(&mut leader.events);
        let (tenant, operation) = (leader.outbound.tenant.as_deref(), leader.outbound.endpoint.operation());
        super::with_meters(shared, |m| m.count_events(&shared.config, &events, tenant, operation));
    }

    /// Counts a flight's answer stored over another key's fresh one.
    fn count_evicted(shared: &Shared, ended: &Ended, outbound: &Outbound) {
        if ended.evicted {
            let label = metrics::label(&shared.config, &outbound.model);
            super::with_meters(shared, |m| m.count(vec![(label, Counter::Evicted, 1)], outbound.tenant.as_deref()));
        }
    }

    /// Carries out the leader's `Do`s until it waits on Envoy.
    fn advance(&mut self, mut next: Do) {
        loop {
            let Stage::Leading { leader, out, .. } = &mut self.stage else { return };
            Filter::drain(&self.shared, leader);
            let at = (wake::now_ms(), super::nonce());
            let engine = Engine { store: &ProcessStore, config: &self.shared.config };
            next = match next {
                Do::Embed(call) => match host::callout(self.envoy, &call) {
                    Some(id) => {
                        *out = Out::Embedding(id);
                        return;
                    }
                    None => leader.on_embedding(&engine, Answer::Unsent, at),
                },
                // A stream's answer comes in parts, as it arrives.
                Do::Send { call, .. } if leader.outbound.stream => match host::stream(self.envoy, &call) {
                    Some(id) => {
                        *out = Out::Stream(id, None);
                        return;
                    }
                    None => leader.on_response(&engine, None, &ProviderHints::unsent(), at),
                },
                Do::Send { call, .. } => match host::callout(self.envoy, &call) {
                    Some(id) => {
                        *out = Out::Attempt(id);
                        return;
                    }
                    None => leader.on_response(&engine, None, &ProviderHints::unsent(), at),
                },
                // No fleet on this module: the flight goes on without a verdict.
                Do::Ask { .. } => leader.on_verdict(&engine, None, at),
                Do::Sleep { until_ms } => {
                    *out = Out::Sleep;
                    wake::after(until_ms, &self.waker(), TIMER);
                    return;
                }
                Do::Over(over) => {
                    let Stage::Leading { outbound, .. } = std::mem::replace(&mut self.stage, Stage::Done) else {
                        return;
                    };
                    if let Some(ended) = &over.ended {
                        Filter::count_evicted(&self.shared, ended, &outbound);
                        self.answer(&ended.reply, &outbound, over.served);
                    }
                    return ended(over.wake);
                }
            };
        }
    }

    /// Renews the leader's lease a tick from `now` (once: a renewal already due stands).
    fn renew_later(&mut self, now: u64) {
        if !std::mem::replace(&mut self.renewing, true) {
            let waker = self.waker();
            wake::after(now.saturating_add(self.shared.config.tick_ms()), &waker, RENEW);
        }
    }

    /// A callout's answer: all of it at once, Envoy's until this returns.
    pub fn on_callout_done(&mut self, id: u64, result: i32, headers: Vec<(String, String)>, body: Vec<u8>) {
        let Stage::Leading { leader, out, .. } = &mut self.stage else { return };
        let at = (wake::now_ms(), super::nonce());
        let engine = Engine { store: &ProcessStore, config: &self.shared.config };
        let status = (result == abi::CALLOUT_OK).then(|| headers::status(&headers)).flatten();
        let next = match *out {
            Out::Embedding(sent) if sent == id => {
                let body = (body.len() <= MAX_EMBEDDING_BYTES).then_some(body.as_slice());
                let answer = match status {
                    Some(status) => Answer::Got { status, body },
                    None => Answer::Lost,
                };
                leader.on_embedding(&engine, answer, at)
            }
            Out::Attempt(sent) if sent == id => return self.answered(status, headers, body),
            _ => return,
        };
        self.advance(next);
    }

    /// An attempt's answer, whole (`None`: none came): read by the core, which may retry.
    fn answered(&mut self, status: Option<u16>, headers: Vec<(String, String)>, body: Vec<u8>) {
        let Stage::Leading { leader, .. } = &mut self.stage else { return };
        let at = (wake::now_ms(), super::nonce());
        let engine = Engine { store: &ProcessStore, config: &self.shared.config };
        let Some(status) = status else {
            let next = leader.on_response(&engine, None, &ProviderHints::default(), at);
            return self.advance(next);
        };
        let sent = upstream::Sent { envoy: true, ..leader.sent() };
        let (response, hints) = upstream::response(status, &headers, body, sent);
        if hints.key_refused {
            super::key_refused(&self.shared, status);
        }
        let next = leader.on_response(&engine, Some(response), &hints, at);
        self.advance(next);
    }

    /// A part of a streaming call's answer.
    pub fn on_stream(&mut self, id: u64, part: Part) {
        let envoy = self.envoy;
        let config = &self.shared.config;
        let Stage::Leading { leader, out: Out::Stream(sent, answer), .. } = &mut self.stage else { return };
        if *sent != id {
            return;
        }
        let end = match part {
            Part::Head(headers, end) => {
                answer.get_or_insert_with(|| Streamed::begin(envoy, config, leader, headers));
                end.then_some(true)
            }
            Part::Data(bytes, end) => {
                // Its client's first chunk (not a failed attempt's, which is read whole).
                if !bytes.is_empty() && matches!(answer, Some(Streamed::Live(_))) {
                    self.stopwatch.chunk(wake::now_ms);
                }
                if let Some(answer) = answer {
                    answer.pass(envoy, bytes, self.pressure.get());
                }
                end.then_some(true)
            }
            Part::End(complete) => Some(complete),
        };
        if let Some(complete) = end {
            self.stream_over(complete);
        }
    }

    /// A streaming call ended (`complete`: its last byte came).
    fn stream_over(&mut self, complete: bool) {
        let Stage::Leading { out, .. } = &mut self.stage else { return };
        let Out::Stream(_, answer) = std::mem::replace(out, Out::Sleep) else { return };
        match answer {
            Some(Streamed::Whole { headers, body }) if complete => {
                self.answered(headers::status(&headers), headers, body)
            }
            Some(Streamed::Live(live)) => {
                let Stage::Leading { mut leader, .. } = std::mem::replace(&mut self.stage, Stage::Done) else {
                    return;
                };
                let Finished { over, usage, last } = live.finish(&self.engine(), &mut leader, complete);
                Filter::drain(&self.shared, &mut leader);
                if let Some(ended) = &over.ended {
                    let (config, outbound) = (&self.shared.config, &leader.outbound);
                    let tenant = outbound.tenant.as_deref();
                    super::with_meters(&self.shared, |m| m.count_reply(config, &outbound.model, &ended.reply, tenant));
                    Filter::count_evicted(&self.shared, ended, outbound);
                    if config.log_fields {
                        host::publish(self.envoy, &outbound.answered(&ended.reply, over.served, usage).priced(config));
                    }
                }
                // Its end last: the access log is written at it.
                if let Some(last) = last {
                    host::send_data(self.envoy, &last, true);
                }
                ended(over.wake);
            }
            _ => self.answered(None, Vec::new(), Vec::new()),
        }
    }

    /// Begins following the live tail of the flight `wait` is for, when this request is a
    /// stream that shares one and the tail is there; `false` otherwise (it waits on).
    fn follow(&mut self, wait: &Wait, outbound: &Rc<Outbound>) -> bool {
        if !Log::shares(outbound) {
            return false;
        }
        let Some(tail) = tails::follow(wait.key.hex(), wait.nonce, &self.waker()) else { return false };
        let config = &self.shared.config;
        let extra = outbound.answer_headers(&ProcessStore, config, true, wake::now_ms);
        let following = Following::begin(self.envoy, tail, Reader::new(config, outbound), extra);
        let outbound = outbound.clone();
        self.stage = Stage::Tailing { following: Box::new(following), wait: wait.clone(), outbound };
        self.look_later();
        self.pump(false);
        true
    }

    /// A follower sends its client what its tail holds (unless its client is behind), or
    /// ends it cut (`cut`: its leader is gone).
    fn pump(&mut self, cut: bool) {
        let Stage::Tailing { following, outbound, wait } = &mut self.stage else { return };
        if self.pressure.get() {
            return;
        }
        let read = following.next(cut);
        if !read.bytes.is_empty() {
            self.stopwatch.chunk(wake::now_ms);
        }
        if !read.last {
            if !read.bytes.is_empty() {
                host::send_data(self.envoy, &read.bytes, false);
            }
            return;
        }
        // Its stream ends: a whole answer is counted and published as the COALESCED answer
        // it was, with what it saved, before its end (the access log is written at it).
        if read.complete {
            let (config, tenant) = (&self.shared.config, outbound.tenant.as_deref());
            let (model, usage) = (following.served(), following.usage());
            super::with_meters(&self.shared, |m| m.count_followed(config, &outbound.model, &model, usage, tenant));
            if config.log_fields {
                let response = Response::json(200, Vec::new()).with_header(headers::MODEL, model);
                let key = Some(wait.key.clone());
                let reply = Reply { response, cache: Some(CacheStatus::Coalesced), key, age_s: None, fresh_s: None };
                let served = Served::waited(wake::now_ms().saturating_sub(wait.since_ms));
                host::publish(self.envoy, &outbound.answered(&reply, served, usage).priced(config));
            }
        }
        self.stage = Stage::Done;
        host::send_data(self.envoy, &read.bytes, true);
    }

    /// A look at the tick (one at a time): a waiter's at its flight, a follower's at its
    /// leader.
    fn look_later(&mut self) {
        if !std::mem::replace(&mut self.polling, true) {
            let waker = self.waker();
            wake::after(wake::now_ms().saturating_add(self.shared.config.tick_ms()), &waker, POLL);
        }
    }

    /// Woken: a waiter looks again, a sleeper goes on, a leader renews its lease.
    pub fn on_scheduled(&mut self, event: u64) {
        let now = wake::now_ms();
        let engine = Engine { store: &ProcessStore, config: &self.shared.config };
        match (&mut self.stage, event) {
            (Stage::Waiting { wait, outbound }, WAKE) => {
                let step = engine.poll(wait, now, super::nonce());
                let (outbound, served) = (outbound.clone(), Served::waited(now.saturating_sub(wait.since_ms)));
                self.run(step, outbound, served);
            }
            (Stage::Tailing { .. }, TAIL | WAKE) => self.pump(false),
            // A follower whose leader is gone without ending its tail (its lease lapsed)
            // ends it cut; otherwise it looks again at the next tick.
            (Stage::Tailing { wait, .. }, POLL) => {
                self.polling = false;
                let gone = !engine.stands(wait, now);
                self.pump(gone);
                if matches!(self.stage, Stage::Tailing { .. }) {
                    self.look_later();
                }
            }
            (Stage::Waiting { wait, outbound }, TAIL) => {
                let (wait, outbound) = (wait.clone(), outbound.clone());
                self.follow(&wait, &outbound);
            }
            (Stage::Leading { leader, out: Out::Sleep, .. }, TIMER) => {
                let next = leader.on_timer(&engine, (now, super::nonce()));
                self.advance(next);
            }
            (Stage::Leading { leader, .. }, RENEW) => {
                engine.renew(leader.call(), now);
                self.renewing = false;
                self.renew_later(now);
            }
            (_, RENEW) => self.renewing = false,
            (Stage::Waiting { wait, outbound }, POLL) => {
                self.polling = false;
                let step = engine.poll(wait, now, super::nonce());
                let (outbound, served) = (outbound.clone(), Served::waited(now.saturating_sub(wait.since_ms)));
                self.run(step, outbound, served);
            }
            (_, POLL) => self.polling = false,
            _ => {}
        }
    }

    /// The filter is going (its client gone, or answered). A leader still leading ends its
    /// flight here, as a stream cut off: an attempt out may have been billed and is charged
    /// so, one never sent costs nothing, its hold on its limits is released, and its lease
    /// is given up so that a waiter leads anew. Nothing more is sent.
    pub fn on_done(&mut self) {
        self.stopwatch.stop(wake::now_ms);
        if let Some(waker) = self.waker.take() {
            waker.close();
        }
        let Stage::Leading { mut leader, out, .. } = std::mem::replace(&mut self.stage, Stage::Done) else { return };
        let engine = Engine { store: &ProcessStore, config: &self.shared.config };
        let now = wake::now_ms();
        let end = match out {
            Out::Stream(_, Some(Streamed::Live(live))) => live.abandon(),
            Out::Attempt(_) | Out::Stream(..) => StreamEnd::broken(),
            Out::Embedding(_) => match leader.on_embedding(&engine, Answer::Lost, (now, super::nonce())) {
                Do::Over(over) => {
                    Filter::drain(&self.shared, &mut leader);
                    return ended(over.wake);
                }
                _ => StreamEnd::never_sent(),
            },
            Out::Sleep => StreamEnd::never_sent(),
        };
        let over = leader.on_stream_end(&engine, end, now);
        Filter::drain(&self.shared, &mut leader);
        ended(over.wake);
    }
}

impl Drop for Filter {
    /// Its wake-ups end with it, also when it was never wound up (a hook that panicked).
    fn drop(&mut self) {
        if let Some(waker) = self.waker.take() {
            waker.close();
        }
    }
}

/// A flight ended: its waiters on every worker look again.
fn ended(wake: Option<(crate::core::api::key::Key, bool)>) {
    if let Some((key, _)) = wake {
        wake::flight_ended(key.hex());
    }
}
