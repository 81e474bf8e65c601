//! Flights on one worker: a leader's call from dispatch through retries and sleeps to the
//! reply, executed from the core's `flight::Action`s; and the lease renewals that keep
//! them alive.

use super::host::{self, SharedData};
use super::root::Root;
use super::wakeups::DISPATCH;
use super::worker::{Run, StreamEnd, Target};
use crate::core::cache::Response;
use crate::core::engine::Call;
use crate::core::flight::{Action, Flight};
use crate::core::limits::ProviderHints;
use crate::core::metrics;
use crate::core::request::Key;
use crate::core::request::{CHAT_PATH, KEY_HEADER};
use crate::core::upstream::{self, Outbound};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::Context;
use proxy_wasm::types::{BufferType, LogLevel, MapType};
use std::rc::Rc;
use std::time::Duration;

/// Tick period while a flight sleeps (backoff, or held for its bucket).
const SLEEP_TICK_MS: u64 = 10;

impl Root {
    pub(super) fn start(&mut self, context_id: u32, call: Call, outbound: Rc<Outbound>) {
        let flight = Flight::new(&self.worker.borrow().config, call, &outbound.model, outbound.estimate_tokens);
        let mut run = Run { context_id, flight, outbound };
        let action = self.resume(&mut run);
        self.advance(run, action);
    }

    pub(super) fn resume(&self, run: &mut Run) -> Action {
        let mut w = self.worker.borrow_mut();
        let nonce = w.nonce();
        run.flight.resume(&SharedData, &w.config, host::now_ms(), nonce)
    }

    /// Performs a flight's next action until it is waiting on the host.
    pub(super) fn advance(&mut self, mut run: Run, mut action: Action) {
        loop {
            {
                let mut w = self.worker.borrow_mut();
                let events = std::mem::take(&mut run.flight.events);
                w.count(events.iter().flat_map(|e| metrics::for_event(&w.config, e)).collect());
                w.outbox.append(&mut run.flight.outbox);
            }
            self.send_settlements();
            match action {
                Action::Ask { bucket, op, timeout_ms } => match self.ask(&bucket, &op, timeout_ms) {
                    Some(token) => {
                        self.worker.borrow_mut().asking.insert(token, run);
                        return;
                    }
                    None => {
                        run.flight.on_verdict(None);
                        action = self.resume(&mut run);
                    }
                },
                Action::Send { model, .. } if run.outbound.stream => {
                    if self.forward(&run, &model) {
                        self.worker.borrow_mut().streams.insert(run.context_id, run);
                    } else {
                        let end = StreamEnd { outcome: None, usage: None, streamed_tokens: 0 };
                        let ended = self.worker.borrow_mut().complete_stream(run, end);
                        self.send_settlements();
                        if let Some((key, watched)) = ended {
                            self.wake_waiters(&key, watched);
                        }
                    }
                    return;
                }
                Action::Send { model, timeout_ms } => match self.dispatch(&run, &model, timeout_ms) {
                    Some(token) => {
                        self.worker.borrow_mut().flights.insert(token, run);
                        return;
                    }
                    None => action = self.on_outcome(&mut run, None, &ProviderHints::default()),
                },
                Action::Sleep { until_ms } => {
                    self.worker.borrow_mut().sleeping.push((until_ms, run));
                    self.set_tick();
                    return;
                }
                Action::Finish(outcome) => return self.finish(run, outcome),
            }
        }
    }

    pub(super) fn on_outcome(&self, run: &mut Run, outcome: Option<Response>, hints: &ProviderHints) -> Action {
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
        let mut headers =
            vec![(":method", "POST"), (":path", CHAT_PATH), (":authority", config.upstream.authority.as_str())];
        headers.extend(out.headers(bearer.as_deref()));
        let timeout = Duration::from_millis(timeout_ms.max(1));
        match self.dispatch_http_call(&config.upstream.cluster, headers, Some(&body), vec![], timeout) {
            // No debug line per callout: proxy_log crosses into Envoy even when it drops
            // the line (the SDK's log-level getter panics on surprises, so it is not asked).
            Ok(token) => Some(token),
            Err(status) => {
                let cluster = &config.upstream.cluster;
                host::log(LogLevel::Error, &format!("holysheep: callout to cluster '{cluster}' refused: {status:?}"));
                None
            }
        }
    }

    /// A stream leader goes along the route (Envoy's router streams the answer back while
    /// the http context tees it): its body asks for the usage event, on `model`, with the
    /// configured key and no compression (the tee reads the events). `false` when the
    /// request is gone.
    fn forward(&self, run: &Run, model: &str) -> bool {
        let id = run.context_id;
        let bearer = self.worker.borrow().bearer.clone();
        if !self.worker.borrow().is_live(id) || hostcalls::set_effective_context(id).is_err() {
            return false;
        }
        let body = run.outbound.body_for(model);
        let length = body.len().to_string();
        // A forward node's routing header is the fleet's own, not HolySheep's.
        let headers = [("content-length", Some(length.as_str())), ("accept-encoding", None), (KEY_HEADER, None)];
        let set = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, usize::MAX, &body).is_ok()
            && headers.iter().all(|(n, v)| hostcalls::set_map_value(MapType::HttpRequestHeaders, n, *v).is_ok())
            && bearer.is_none_or(|b| {
                hostcalls::set_map_value(MapType::HttpRequestHeaders, "authorization", Some(&b)).is_ok()
            });
        set && hostcalls::resume_http_request().is_ok()
    }

    /// Lets the waiters of the streams that ended look at their flights.
    pub(super) fn complete_streams(&mut self) {
        self.send_settlements();
        let ended = std::mem::take(&mut self.worker.borrow_mut().ended);
        for (key, watched) in ended {
            self.wake_waiters(&key, watched);
        }
    }

    /// A flight on `key` ended: its waiters here look again, and when someone waited on
    /// it (`watched`, maybe on another worker) the other workers' waiters too.
    fn wake_waiters(&mut self, key: &Key, watched: bool) {
        self.poll_waiters(Some(key));
        if watched {
            self.wake_other_workers(key, host::now_ms());
        }
    }

    /// The flight ended: answer its caller, then its waiters here and on other workers.
    pub(super) fn finish(&mut self, run: Run, outcome: Option<Response>) {
        let call = run.flight.call;
        let (reply, watched) = self.worker.borrow().engine().finish_flight(&call, outcome, host::now_ms());
        self.worker.borrow_mut().respond(Target::Context(run.context_id), &reply, &run.outbound);
        if call.lease.is_some() {
            self.wake_waiters(&call.key, watched);
        }
    }

    pub(super) fn dispatch_pending(&mut self) {
        loop {
            if self.out_of_replies() {
                let w = self.worker.borrow();
                if !w.pending.is_empty() {
                    w.continue_later(DISPATCH);
                }
                return;
            }
            let next = {
                let mut w = self.worker.borrow_mut();
                (!w.pending.is_empty()).then(|| w.pending.remove(0))
            };
            let Some((id, call, outbound)) = next else { return };
            self.start(id, call, outbound);
        }
    }

    /// Resumes the flights whose sleep is over (those beyond this call's replies wait for
    /// the next tick, which is fast while any flight sleeps).
    pub(super) fn wake_sleepers(&mut self) {
        let now = host::now_ms();
        while !self.out_of_replies() {
            let due = {
                let mut w = self.worker.borrow_mut();
                let at = w.sleeping.iter().position(|(until, _)| *until <= now);
                at.map(|i| w.sleeping.swap_remove(i).1)
            };
            let Some(mut run) = due else { break };
            let action = self.resume(&mut run);
            self.advance(run, action);
        }
        self.set_tick();
    }

    /// Fast ticks while a flight sleeps, the configured safety-net period otherwise.
    pub(super) fn set_tick(&self) {
        let mut w = self.worker.borrow_mut();
        if w.queue.is_none() {
            return;
        }
        let period = if w.sleeping.is_empty() { w.config.tick_ms() } else { SLEEP_TICK_MS };
        if period != w.tick_ms && hostcalls::set_tick_period(Duration::from_millis(period)).is_ok() {
            w.tick_ms = period;
        }
    }

    pub(super) fn renew_leases(&self) {
        let w = self.worker.borrow();
        let (engine, now) = (w.engine(), host::now_ms());
        for run in w.flights.values().chain(w.sleeping.iter().map(|(_, r)| r)).chain(w.streams.values()) {
            engine.renew(&run.flight.call, now);
        }
    }

    pub(super) fn callout_response(&self, num_headers: usize, body_size: usize) -> (Option<Response>, ProviderHints) {
        if num_headers == 0 {
            return (None, ProviderHints::default());
        }
        let headers = host::headers(MapType::HttpCallResponseHeaders);
        let status = headers.iter().find(|(k, _)| k == ":status").and_then(|(_, v)| v.parse().ok());
        let Some(status) = status else {
            return (None, ProviderHints::default());
        };
        let (response, hints) =
            upstream::response(status, &headers, host::buffer(BufferType::HttpCallResponseBody, body_size));
        (Some(response), hints)
    }
}
