//! The flights this worker leads: a leader's call from dispatch through retries and sleeps
//! to the reply, executed from the core's `flight::Action`s; a model owner's verdict when
//! limits are fleet-wide; and the lease renewals that keep them alive.

use super::route::Forwarded;
use super::Root;
use crate::core::api::error::ApiError;
use crate::core::api::headers;
use crate::core::api::hints::ProviderHints;
use crate::core::api::reply::Reply;
use crate::core::api::response::Response;
use crate::core::cache::Fresh;
use crate::core::coalesce::engine::Call;
use crate::core::flight::tee::StreamEnd;
use crate::core::flight::{self, Flight};
use crate::core::limits::fleet::Op;
use crate::core::observe::log_fields::{Served, Spent};
use crate::core::semantic::Learned;
use crate::core::upstream::{self, Outbound};
use crate::proxy::abi as hostcalls;
use crate::proxy::fleet;
use crate::proxy::host::{self, SharedData};
use crate::proxy::runs::{Callout, Run};
use crate::proxy::types::{BufferType, LogLevel, MapType};
use crate::proxy::wake::DISPATCH;
use crate::proxy::worker::Target;
use std::rc::Rc;
use std::time::Duration;

/// Tick period while a flight sleeps (backoff, or held for its bucket).
const SLEEP_TICK_MS: u64 = 10;

impl Root {
    /// The flight of a leader's call (that looked for a paraphrase first when `learned`,
    /// which spent `spent` on it).
    pub(super) fn start(
        &mut self,
        context_id: u32,
        call: Call,
        outbound: Rc<Outbound>,
        learned: Option<Learned>,
        spent: Spent,
    ) {
        let flight = Flight::new(&self.worker.borrow().config, call, &outbound);
        let mut run = Run { context_id, flight, outbound, spent, learned };
        let action = self.resume(&mut run);
        self.advance(run, action);
    }

    pub(super) fn resume(&self, run: &mut Run) -> flight::Action {
        let mut w = self.worker.borrow_mut();
        let nonce = w.nonce();
        run.flight.resume(&SharedData, &w.config, host::now_ms(), nonce)
    }

    /// Performs a flight's next action until it is waiting on the host.
    pub(super) fn advance(&mut self, mut run: Run, mut action: flight::Action) {
        loop {
            {
                let w = &mut *self.worker.borrow_mut();
                w.take_events(&mut run);
                // (The tenant's budget gauges follow the record its settlement wrote here:
                // `Event::BudgetStanding`.)
                w.fleet.outbox.append(&mut run.flight.outbox);
            }
            self.send_settlements();
            match action {
                flight::Action::Ask { bucket, op, timeout_ms } => match self.ask(&bucket, &op, timeout_ms) {
                    Some(token) => {
                        self.worker.borrow_mut().runs.callouts.insert(token, Callout::Verdict(run));
                        return;
                    }
                    None => {
                        run.flight.on_verdict(None);
                        action = self.resume(&mut run);
                    }
                },
                flight::Action::Send { model, .. } if run.outbound.stream => match self.forward(&run, &model) {
                    Forwarded::Sent => {
                        self.worker.borrow_mut().runs.streaming.insert(run.context_id, run);
                        return;
                    }
                    Forwarded::Misrouted => {
                        // Refused here: it never left for HolySheep.
                        let refused = Reply::error(&ApiError::misdirected()).response;
                        action = self.on_outcome(&mut run, Some(refused), &ProviderHints::unsent());
                    }
                    Forwarded::Gone => {
                        let end = StreamEnd::never_sent();
                        let ended = self.worker.borrow_mut().complete_stream(run, end);
                        self.send_settlements();
                        if let Some((key, watched)) = ended {
                            self.wake_waiters(&key, watched);
                        }
                        return;
                    }
                },
                flight::Action::Send { model, timeout_ms } => match self.dispatch(&run, &model, timeout_ms) {
                    Some(token) => {
                        self.worker.borrow_mut().runs.callouts.insert(token, Callout::Attempt(run));
                        return;
                    }
                    // Refused at dispatch: it never left.
                    None => action = self.on_outcome(&mut run, None, &ProviderHints::unsent()),
                },
                flight::Action::Sleep { until_ms } => {
                    self.worker.borrow_mut().runs.sleeping.push((until_ms, run));
                    self.set_tick();
                    return;
                }
                flight::Action::Finish(outcome) => return self.finish(run, outcome),
            }
        }
    }

    pub(super) fn on_outcome(&self, run: &mut Run, outcome: Option<Response>, hints: &ProviderHints) -> flight::Action {
        let mut w = self.worker.borrow_mut();
        let random = w.nonce();
        run.flight.on_response(&SharedData, &w.config, outcome, hints, host::now_ms(), random)
    }

    pub(super) fn dispatch(&mut self, run: &Run, model: &str, timeout_ms: u64) -> Option<u32> {
        let (config, bearer) = {
            let w = self.worker.borrow();
            (w.config.clone(), w.bearer.clone())
        };
        let out = &run.outbound;
        let body = out.body_for(model);
        let mut headers = vec![
            (":method", "POST"),
            (":path", out.endpoint.path()),
            (":authority", config.upstream.authority.as_str()),
        ];
        headers.extend(out.headers(bearer.as_deref()));
        let timeout = Duration::from_millis(timeout_ms.max(1));
        match hostcalls::dispatch_http_call(&config.upstream.cluster, headers, Some(&body), timeout) {
            // No debug line per callout: proxy_log crosses into Envoy even when it drops
            // the line.
            Ok(token) => Some(token),
            Err(status) => {
                let cluster = &config.upstream.cluster;
                host::log(LogLevel::Error, &format!("holysheep: callout to cluster '{cluster}' refused: {status:?}"));
                None
            }
        }
    }

    /// The flight ended: answer its caller, then its waiters here and on other workers.
    pub(super) fn finish(&mut self, run: Run, outcome: Option<Response>) {
        let call = run.flight.call;
        let now = host::now_ms();
        let ended = {
            let w = self.worker.borrow();
            let ended = w.engine().end_flight(&call, outcome, now, Some(Fresh::of(&w.config, now)));
            w.count_evicted(&ended, &run.outbound);
            w.learn(run.learned.as_ref(), &ended, &call.key, now);
            ended
        };
        let watched = ended.watched;
        // A flight that never called (refused for its bucket, perhaps after waiting in line)
        // waited all its time.
        let served = match run.spent.attempts {
            0 => Served { spent: run.spent, wait_ms: now.saturating_sub(call.started_ms) },
            _ => Served::by_flight(run.spent),
        };
        self.worker.borrow_mut().respond(Target::Context(run.context_id), &ended.reply, &run.outbound, served);
        if call.lease.is_some() {
            self.wake_waiters(&call.key, watched);
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
            let Some(mut run) = due else { break };
            let action = self.resume(&mut run);
            self.advance(run, action);
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

    pub(super) fn callout_response(
        &self,
        run: &Run,
        num_headers: usize,
        body_size: usize,
    ) -> (Option<Response>, ProviderHints) {
        if num_headers == 0 {
            return (None, ProviderHints::default());
        }
        let headers = host::headers(MapType::HttpCallResponseHeaders);
        let Some(status) = headers::status(&headers) else {
            return (None, ProviderHints::default());
        };
        let body = host::buffer(BufferType::HttpCallResponseBody, body_size);
        // A callout goes through this Envoy, whose own replies say when it never left.
        let sent = upstream::Sent { envoy: true, ..run.outbound.sent(self.worker.borrow().bearer.is_some()) };
        let (response, hints) = upstream::response(status, &headers, body, sent);
        if hints.key_refused {
            self.worker.borrow_mut().key_refused(status);
        }
        (Some(response), hints)
    }

    /// Sends `op` to the owner of `bucket`; `None` when it cannot be sent (no secret, no
    /// cluster): the flight then admits from this node's share. No borrow of the worker is
    /// held across a host call that may call back into it.
    fn ask(&self, bucket: &str, op: &Op, timeout_ms: u64) -> Option<u32> {
        let (config, secret) = {
            let w = self.worker.borrow();
            (w.config.clone(), w.fleet.secret.clone()?)
        };
        match fleet::ask(&config, &secret, bucket, op, timeout_ms) {
            Ok(token) => Some(token),
            Err(status) => {
                let why = format!("callout to fleet cluster '{}' refused: {status:?}", config.fleet.cluster);
                self.worker.borrow_mut().fleet.reached(false, &why);
                None
            }
        }
    }

    /// Sends the settlements the flights left for model owners, without waiting for them.
    pub(super) fn send_settlements(&self) {
        let (config, ops) = {
            let mut w = self.worker.borrow_mut();
            (w.config.clone(), std::mem::take(&mut w.fleet.outbox))
        };
        for op in ops {
            if let Some(bucket) = op.bucket(&config) {
                self.ask(&bucket, &op, fleet::SETTLE_TIMEOUT_MS);
            }
        }
    }

    /// A model's or a tenant's owner answered (or failed to): the flight that asked goes on.
    pub(super) fn on_verdict(&mut self, mut run: Run, num_headers: usize, body_size: usize) {
        let for_tenant = run.flight.asking_tenant();
        let verdict = self.worker.borrow_mut().fleet.verdict(num_headers, body_size, for_tenant);
        run.flight.on_verdict(verdict);
        let action = self.resume(&mut run);
        self.advance(run, action);
    }
}
