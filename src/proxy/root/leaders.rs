//! The leaders this worker runs: each leader's `flight::leader::Do`s carried out (its
//! question's embedding, attempts as callouts or along the route, owners' verdicts,
//! sleeps, its end), what came of each handed back, and the lease renewals that keep them
//! alive.

use super::route::Forwarded;
use super::Root;
use crate::core::api::call::HttpCall;
use crate::core::api::error::ApiError;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::reply::Reply;
use crate::core::api::response::Response;
use crate::core::coalesce::engine::Call;
use crate::core::flight::leader::{Do, Leader, Over};
use crate::core::flight::look::Answer;
use crate::core::flight::tee::StreamEnd;
use crate::core::limits::fleet::{Op, Verdict};
use crate::core::semantic::MAX_EMBEDDING_BYTES;
use crate::core::upstream::{self, Outbound};
use crate::proxy::abi as hostcalls;
use crate::proxy::host;
use crate::proxy::runs::{Callout, Run};
use crate::proxy::types::{BufferType, LogLevel, MapType};
use crate::proxy::wake::DISPATCH;
use crate::proxy::worker::Target;
use std::rc::Rc;
use std::time::Duration;

/// Tick period while a flight sleeps (backoff, or held for its bucket).
const SLEEP_TICK_MS: u64 = 10;

impl Root {
    /// A leader's call (`flight::leader`): it looks for a paraphrase or flies.
    pub(super) fn begin(&mut self, context_id: u32, call: Call, outbound: Rc<Outbound>) {
        let (leader, next) = {
            let mut w = self.worker.borrow_mut();
            let (env, at) = (w.env.clone(), (host::now_ms(), w.nonce()));
            Leader::start(&w.engine(), call, outbound, env, at)
        };
        self.advance(Run { context_id, leader }, next);
    }

    /// Hands the leader what came back, and carries out what it does next.
    pub(super) fn step(&mut self, mut run: Run, event: Step<'_>) {
        let next = self.hand(&mut run, event);
        self.advance(run, next);
    }

    /// What the leader does next, given what came back.
    fn hand(&self, run: &mut Run, event: Step<'_>) -> Do {
        let mut w = self.worker.borrow_mut();
        let at = (host::now_ms(), w.nonce());
        let (engine, leader) = (w.engine(), &mut run.leader);
        match event {
            Step::Embedding(answer) => leader.on_embedding(&engine, answer, at),
            Step::Response(outcome, hints) => leader.on_response(&engine, outcome, &hints, at),
            Step::Verdict(verdict) => leader.on_verdict(&engine, verdict, at),
            Step::Timer => leader.on_timer(&engine, at),
        }
    }

    /// Carries out a leader's `Do`s until it waits on the host.
    fn advance(&mut self, mut run: Run, mut next: Do) {
        loop {
            self.drain(&mut run);
            let refused = match next {
                Do::Embed(call) => match self.call(&call) {
                    Some(token) => return self.out(token, Callout::Embedding(run)),
                    None => Step::Embedding(Answer::Unsent),
                },
                Do::Ask { bucket, op, timeout_ms } => match self.ask(&run, &bucket, &op, timeout_ms) {
                    Some(token) => return self.out(token, Callout::Verdict(run)),
                    None => Step::Verdict(None),
                },
                Do::Send { call, .. } if run.leader.outbound.stream => match self.forward(&run, &call) {
                    Forwarded::Sent => {
                        self.worker.borrow_mut().runs.streaming.insert(run.context_id, run);
                        return;
                    }
                    // Refused here: it never left for HolySheep.
                    Forwarded::Misrouted => {
                        let refused = Reply::error(&ApiError::misdirected()).response;
                        Step::Response(Some(refused), ProviderHints::unsent())
                    }
                    Forwarded::Gone => {
                        let wake = self.worker.borrow_mut().complete_stream(run, StreamEnd::never_sent());
                        self.send_settlements();
                        if let Some((key, watched)) = wake {
                            self.wake_waiters(&key, watched);
                        }
                        return;
                    }
                },
                Do::Send { call, .. } => match self.call(&call) {
                    Some(token) => return self.out(token, Callout::Attempt(run)),
                    // Refused at dispatch: it never left.
                    None => Step::Response(None, ProviderHints::unsent()),
                },
                Do::Sleep { until_ms } => {
                    self.worker.borrow_mut().runs.sleeping.push((until_ms, run));
                    self.set_tick();
                    return;
                }
                Do::Over(over) => return self.finish(run, over),
            };
            next = self.hand(&mut run, refused);
        }
    }

    /// A callout of `run`'s is in the air.
    fn out(&self, token: u32, callout: Callout) {
        self.worker.borrow_mut().runs.callouts.insert(token, callout);
    }

    /// What the leader left: its events counted, its settlements sent.
    fn drain(&self, run: &mut Run) {
        self.worker.borrow_mut().drain(&mut run.leader);
        self.send_settlements();
    }

    /// Makes a call the core made ready; `None` when Envoy refuses it (logged: no
    /// such cluster). No debug line per call: proxy_log crosses into Envoy even when it
    /// drops the line.
    pub(super) fn call(&self, call: &HttpCall) -> Option<u32> {
        match host::dispatch(call) {
            Ok(token) => Some(token),
            Err(status) => {
                let cluster = &call.cluster;
                host::log(LogLevel::Error, &format!("holysheep: callout to cluster '{cluster}' refused: {status:?}"));
                None
            }
        }
    }

    /// The leader is over: its request answered, then its flight's waiters here and on
    /// other workers.
    fn finish(&mut self, run: Run, over: Over) {
        if let Some(ended) = &over.ended {
            let mut w = self.worker.borrow_mut();
            w.count_evicted(ended, &run.leader.outbound);
            w.respond(Target::Context(run.context_id), &ended.reply, &run.leader.outbound, over.served);
        }
        if let Some((key, watched)) = over.wake {
            self.wake_waiters(&key, watched);
        }
    }

    pub(super) fn dispatch_pending(&mut self) {
        loop {
            if self.out_of_replies() {
                let w = self.worker.borrow();
                if !w.runs.pending.is_empty() {
                    w.queue.continue_later(DISPATCH);
                }
                return;
            }
            let next = self.worker.borrow_mut().runs.next_pending();
            let Some((context_id, call, outbound)) = next else { return };
            self.begin(context_id, call, outbound);
        }
    }

    /// Resumes the flights whose sleep is over (those beyond this call's replies wait for
    /// the next tick, which is fast while any flight sleeps).
    pub(super) fn wake_sleepers(&mut self) {
        let now = host::now_ms();
        while !self.out_of_replies() {
            let due = self.worker.borrow_mut().runs.take_due(now);
            let Some(run) = due else { break };
            self.step(run, Step::Timer);
        }
        self.set_tick();
    }

    /// Fast ticks while a flight sleeps, the configured safety-net period otherwise.
    pub(super) fn set_tick(&self) {
        let mut w = self.worker.borrow_mut();
        if !w.queue.is_registered() {
            return;
        }
        let period = if w.runs.sleeping.is_empty() { w.config.tick_ms() } else { SLEEP_TICK_MS };
        if period != w.tick_ms && hostcalls::set_tick_period(Duration::from_millis(period)).is_ok() {
            w.tick_ms = period;
        }
    }

    /// Renews the lease of every flight this worker leads, wherever it stands: in a call,
    /// asleep, streaming, asking a fleet peer for a verdict, or not yet dispatched.
    pub(super) fn renew_leases(&self) {
        let w = self.worker.borrow();
        let (engine, now) = (w.engine(), host::now_ms());
        for call in w.runs.calls() {
            engine.renew(call, now);
        }
    }

    /// An attempt's answer, from the callout's headers and body.
    pub(super) fn callout_response(&self, run: &Run, num_headers: usize, body_size: usize) -> Step<'static> {
        if num_headers == 0 {
            return Step::Response(None, ProviderHints::default());
        }
        let headers = host::headers(MapType::HttpCallResponseHeaders);
        let Some(status) = headers::status(&headers) else {
            return Step::Response(None, ProviderHints::default());
        };
        let body = host::buffer(BufferType::HttpCallResponseBody, body_size);
        // A callout goes through this Envoy, whose own replies say when it never left.
        let sent = upstream::Sent { envoy: true, ..run.leader.sent() };
        let (response, hints) = upstream::response(status, &headers, body, sent);
        if hints.key_refused {
            self.worker.borrow_mut().key_refused(status);
        }
        Step::Response(Some(response), hints)
    }

    /// Asks an owner node for `run`'s verdict; `None` when it cannot (no fleet secret, no
    /// fleet cluster): the flight then admits from this node's share.
    fn ask(&self, run: &Run, bucket: &str, op: &Op, timeout_ms: u64) -> Option<u32> {
        let config = self.worker.borrow().config.clone();
        self.to_owner(&run.leader.ask(&config, bucket, op, timeout_ms)?)
    }

    /// Makes a call to an owner node; when it cannot be made, the log says owners are not
    /// reached.
    fn to_owner(&self, call: &HttpCall) -> Option<u32> {
        match host::dispatch(call) {
            Ok(token) => Some(token),
            Err(status) => {
                let why = format!("callout to fleet cluster '{}' refused: {status:?}", call.cluster);
                self.worker.borrow_mut().owners_reached(false, &why);
                None
            }
        }
    }

    /// Sends the settlements the flights left for owner nodes, without waiting for them.
    pub(super) fn send_settlements(&self) {
        let (config, secret, ops) = {
            let mut w = self.worker.borrow_mut();
            (w.config.clone(), w.env.fleet_secret.clone(), std::mem::take(&mut w.outbox))
        };
        let Some(secret) = secret else { return };
        for call in ops.iter().filter_map(|op| op.settlement(&config, &secret)) {
            self.to_owner(&call);
        }
    }

    /// A model's or a tenant's owner answered (or failed to): the leader that asked goes on.
    pub(super) fn on_verdict(&mut self, run: Run, num_headers: usize, body_size: usize) {
        let for_tenant = run.leader.flight().is_some_and(|f| f.asking_tenant());
        let status = host::callout_status(num_headers);
        let verdict = (status == Some(200))
            .then(|| Verdict::parse(&host::buffer(BufferType::HttpCallResponseBody, body_size)))
            .flatten();
        // A tenant's owner is not logged: a node of the previous release refuses tenants'
        // calls, and its model answers must not flap the log.
        if !for_tenant {
            let status = status.map_or("none".to_owned(), |s| s.to_string());
            let why = format!("a model owner did not answer (status {status})");
            self.worker.borrow_mut().owners_reached(verdict.is_some(), &why);
        }
        self.step(run, Step::Verdict(verdict));
    }

    /// A leader's embedding call answered (or failed).
    pub(super) fn on_embedding(&mut self, run: Run, num_headers: usize, body_size: usize) {
        let body =
            (body_size <= MAX_EMBEDDING_BYTES).then(|| host::buffer(BufferType::HttpCallResponseBody, body_size));
        let answer = match host::callout_status(num_headers) {
            Some(status) => Answer::Got { status, body: body.as_deref() },
            None => Answer::Lost,
        };
        self.step(run, Step::Embedding(answer));
    }
}

/// What came back for a leader.
pub(super) enum Step<'a> {
    Embedding(Answer<'a>),
    Response(Option<Response>, ProviderHints),
    Verdict(Option<Verdict>),
    Timer,
}
