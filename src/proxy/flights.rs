//! Flights on one worker: a leader's call from dispatch through retries and sleeps to the
//! reply, executed from the core's `flight::Action`s; and the lease renewals that keep
//! them alive.

use super::abi as hostcalls;
use super::host::{self, SharedData};
use super::key_check;
use super::root::Root;
use super::wakeups::DISPATCH;
use super::worker::{Run, StreamEnd, Target};
use crate::core::cache::Response;
use crate::core::engine::{Call, Reply};
use crate::core::error::ApiError;
use crate::core::flight::{self, Action, Flight};
use crate::core::limits::ProviderHints;
use crate::core::metrics;
use crate::core::request::Key;
use crate::core::request::CHAT_PATH;
use crate::core::stream;
use crate::core::upstream::{self, Outbound};
use proxy_wasm::types::{BufferType, LogLevel, MapType};
use std::rc::Rc;
use std::time::Duration;

/// How a stream leader's request went on along its route.
enum Forwarded {
    Sent,
    /// The request is gone (client reset) or could not be rewritten.
    Gone,
    /// Its route leads elsewhere than `upstream.cluster`: it is not sent with the key.
    Misrouted,
}

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
                Action::Send { model, .. } if run.outbound.stream => match self.forward(&run, &model) {
                    Forwarded::Sent => {
                        self.worker.borrow_mut().streams.insert(run.context_id, run);
                        return;
                    }
                    Forwarded::Misrouted => {
                        let refused = Reply::error(&ApiError::misdirected()).response;
                        action = self.on_outcome(&mut run, Some(refused), &ProviderHints::default());
                    }
                    Forwarded::Gone => {
                        let end = StreamEnd::broken();
                        let ended = self.worker.borrow_mut().complete_stream(run, end);
                        self.send_settlements();
                        if let Some((key, watched)) = ended {
                            self.wake_waiters(&key, watched);
                        }
                        return;
                    }
                },
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
        match hostcalls::dispatch_http_call(&config.upstream.cluster, headers, Some(&body), vec![], timeout) {
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
    /// the http context tees it), when the route Envoy chose for the client's request
    /// leads to `upstream.cluster`. Envoy routes the request again once the filter changes
    /// its headers, and tells the filter the new route only after it was taken, so the
    /// request that leaves carries nothing of the client's that routing could look at: the
    /// canonical path, `upstream.authority`, the scheme, Envoy's request id, and the
    /// headers a callout sends (the configured key, no compression: the tee reads the
    /// events). Its body asks for the usage event, on `model`. The route that answers is
    /// checked again when its answer arrives (`Chat::on_http_response_headers`).
    fn forward(&self, run: &Run, model: &str) -> Forwarded {
        let id = run.context_id;
        let (config, bearer, latched) = {
            let w = self.worker.borrow();
            (w.config.clone(), w.bearer.clone(), w.streams_misrouted())
        };
        if !self.worker.borrow().is_live(id) || hostcalls::set_effective_context(id).is_err() {
            return Forwarded::Gone;
        }
        if latched || !host::routed_to(&config.upstream.cluster) {
            return Forwarded::Misrouted;
        }
        let head = host::headers(MapType::HttpRequestHeaders);
        if head.is_empty() {
            // Unreadable: the client's headers could not be taken off.
            return Forwarded::Gone;
        }
        let value = |name: &str| head.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
        let scheme = value(":scheme").or_else(|| value("x-forwarded-proto")).unwrap_or_else(|| "http".into());
        let body = run.outbound.body_for(model);
        let length = body.len().to_string();
        // Envoy's router retries before the first byte on the edge's terms, and says how
        // many attempts it made (`host::upstream_attempts`), each counted and charged.
        let retries = config.retry.max_attempts.saturating_sub(1).to_string();
        let mut set: Vec<(&str, &str)> = vec![
            (":path", CHAT_PATH),
            (":authority", config.upstream.authority.as_str()),
            // Without it Envoy 1.40 finds no route for the rewritten request.
            ("x-forwarded-proto", scheme.as_str()),
            ("content-length", length.as_str()),
            ("x-envoy-max-retries", retries.as_str()),
            ("x-envoy-retry-on", flight::STREAM_RETRY_ON),
            ("x-envoy-retriable-status-codes", flight::STREAM_RETRIABLE_STATUSES),
        ];
        set.extend(run.outbound.headers(bearer.as_deref()).into_iter().filter(|(n, _)| *n != "accept"));
        set.push(("accept", stream::CONTENT_TYPE));
        let stays = |n: &str| n.starts_with(':') || n == "x-request-id";
        let gone = head.iter().map(|(n, _)| n).filter(|n| !stays(n));
        let trailers = host::headers(MapType::HttpRequestTrailers);
        let done = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, usize::MAX, &body).is_ok()
            && gone.into_iter().all(|n| hostcalls::set_map_value(MapType::HttpRequestHeaders, n, None).is_ok())
            && trailers.iter().all(|(n, _)| hostcalls::set_map_value(MapType::HttpRequestTrailers, n, None).is_ok())
            && set.iter().all(|(n, v)| hostcalls::set_map_value(MapType::HttpRequestHeaders, n, Some(v)).is_ok())
            && hostcalls::resume_http_request().is_ok();
        if done {
            Forwarded::Sent
        } else {
            Forwarded::Gone
        }
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

    /// Renews the lease of every flight this worker leads, wherever it stands: in a call,
    /// asleep, streaming, asking a fleet peer for a verdict, or not yet dispatched.
    pub(super) fn renew_leases(&self) {
        let w = self.worker.borrow();
        let (engine, now) = (w.engine(), host::now_ms());
        let runs = w.flights.values().chain(w.sleeping.iter().map(|(_, r)| r)).chain(w.streams.values());
        let calls = runs.chain(w.asking.values()).map(|r| &r.flight.call).chain(w.pending.iter().map(|(_, c, _)| c));
        for call in calls {
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
        let status = headers.iter().find(|(k, _)| k == ":status").and_then(|(_, v)| v.parse().ok());
        let Some(status) = status else {
            return (None, ProviderHints::default());
        };
        let body = host::buffer(BufferType::HttpCallResponseBody, body_size);
        let (response, hints) =
            upstream::response(status, &headers, body, run.outbound.sent(self.worker.borrow().bearer.is_some()));
        if hints.key_refused {
            key_check::report_key_refused(&mut self.worker.borrow_mut(), status);
        }
        (Some(response), hints)
    }
}
