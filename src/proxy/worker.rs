//! State shared by one worker thread's root context and its http contexts: the flights
//! it leads and the waiters it holds, the http contexts it may still answer, how many local
//! replies the current VM call may still send, and the parts each concern owns (wake
//! queue, counters, key check, fleet).

use super::abi as hostcalls;
use super::body_watch::{self, BodyWatch};
use super::counters::{self, Counters};
use super::fleet::Fleet;
use super::host::{self, Nonces, SharedData};
use super::ids::{IdMap, IdSet};
use super::key_check::KeyCheck;
use super::queue::{WakeQueue, DISPATCH, ENDED};
use super::runs::{Run, Runs, StreamEnd};
use crate::core::cache;
use crate::core::codec;
use crate::core::config::Config;
use crate::core::engine::{CacheStatus, Call, Engine, Reply, Wait};
use crate::core::error::ApiError;
use crate::core::hot::{Hot, Raw, Seed};
use crate::core::request::ChatRequest;
use crate::core::request::Key;
use crate::core::store::CasStore;
use crate::core::stream;
use crate::core::upstream::{self, Outbound, Sent};
use proxy_wasm::types::LogLevel;
use std::cell::RefCell;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::rc::Rc;

/// Local replies one root-context VM call may send to other http contexts. Envoy sends a
/// VM call's deferred local replies one inside another (each from the previous reply's
/// trip through this filter's response callbacks), one stack level per reply: a few
/// hundred overflow V8's stack and kill the VM. The rest go out in the next VM call,
/// continued through the worker's own queue.
pub const REPLY_BATCH: usize = 64;

/// Where a reply goes: the http context being called, or another one of this worker.
#[derive(Clone, Copy)]
pub enum Target {
    Current,
    Context(u32),
}

/// State shared by the root context and the http contexts of one VM.
pub struct Worker {
    pub config: Rc<Config>,
    /// `Bearer <key>` when the key is in the VM environment; never logged.
    pub bearer: Option<String>,
    pub vm_id: String,
    pub nonces: Nonces,
    /// The tick period set last.
    pub tick_ms: u64,
    pub queue: WakeQueue,
    pub counters: Counters,
    pub key_check: KeyCheck,
    pub fleet: Fleet,
    pub runs: Runs,
    pub waiters: IdMap<(Wait, Rc<Outbound>)>,
    /// Http contexts that may still be answered: created, not done, and not answered by
    /// the root on its own. (Envoy still resolves a reset stream's id until its deferred
    /// delete, and a reply sent there reaches the SDK for a context it already deleted: a
    /// panic.)
    pub live: IdSet,
    pub body_watch: BodyWatch,
    /// Local replies the current root-context VM call may still send (see REPLY_BATCH).
    pub replies_left: usize,
    /// HIT answers by the requests' raw bytes.
    pub hot: Hot<HotAnswer>,
    /// Requests parsed before, by their raw bytes: every request on a forward node (its
    /// key routes it); on an owner, a HIT and a request that waits for a flight
    /// (`intake::Keep`), so that the rest of a crowd of identical requests is not parsed,
    /// canonicalised and hashed again.
    pub parsed: Hot<ChatRequest>,
    /// What both tables hash the raw bytes with.
    pub seed: Seed,
}

/// A worker's state, as its root context and http contexts each hold it.
pub type WorkerRef = Rc<RefCell<Worker>>;

/// A cache entry a worker keeps in its own memory, ready to be sent again: the reply (its
/// `age` set when sent), the request's form, and the counters it adds.
pub struct HotAnswer {
    reply: Reply,
    stored_at_ms: u64,
    outbound: Outbound,
    counters: Vec<(u32, i64)>,
}

/// What a forwarded stream's response carries in its `x-holysheep-*` headers.
pub struct StreamLabel {
    pub cache: CacheStatus,
    pub key: String,
    pub model: String,
    pub include_usage: bool,
    pub sent: Sent,
    pub tenant: Option<String>,
}

/// Shared-data key that holds, once a stream's answer came from another cluster than
/// `upstream.cluster`, the configuration it happened under (`Worker::misroute_latch`): every
/// worker then refuses streams under that configuration.
pub const MISROUTED_KEY: &str = "holysheep/streams-misrouted";

impl Worker {
    /// What `MISROUTED_KEY` holds when streams are refused under this configuration.
    pub fn misroute_latch(&self) -> String {
        format!("{} {}", self.config.upstream.cluster, self.config.upstream.authority)
    }

    /// Whether streams are refused: a stream's answer came from another cluster, on this
    /// worker or another, under the same configuration.
    pub fn streams_misrouted(&self) -> bool {
        SharedData.get(MISROUTED_KEY).is_ok_and(|r| r.value.as_deref() == Some(self.misroute_latch().as_bytes()))
    }

    pub fn new() -> Self {
        Worker {
            config: Rc::new(Config::default()),
            bearer: None,
            vm_id: String::new(),
            nonces: Nonces::new(),
            tick_ms: 0,
            queue: WakeQueue::default(),
            counters: Counters::default(),
            key_check: KeyCheck::default(),
            fleet: Fleet::default(),
            runs: Runs::default(),
            waiters: Default::default(),
            live: Default::default(),
            body_watch: BodyWatch::default(),
            replies_left: REPLY_BATCH,
            hot: Hot::new(0),
            parsed: Hot::new(0),
            seed: Seed::new(RandomState::new().hash_one(())),
        }
    }

    /// HolySheep refused the configured key on a chat call (logged, rate-limited).
    pub fn key_refused(&mut self, status: u16) {
        self.key_check.refused(&self.config, status);
    }

    pub fn nonce(&mut self) -> u64 {
        self.nonces.next()
    }

    /// Hands a call to the root context, which dispatches it on its next queue event (or
    /// tick, before the worker's queue exists); the client's reply comes from there.
    pub fn defer_call(&mut self, context_id: u32, call: Call, outbound: Rc<Outbound>) {
        self.runs.pending.push((context_id, call, outbound));
        if self.runs.pending.len() == 1 {
            self.queue.continue_later(DISPATCH);
        }
    }

    pub fn wait(&mut self, context_id: u32, wait: Wait, outbound: Rc<Outbound>) {
        self.waiters.insert(context_id, (wait, outbound));
    }

    /// The http context is done: it is never answered after this.
    pub fn forget(&mut self, context_id: u32) {
        self.live.remove(&context_id);
        self.waiters.remove(&context_id);
        self.body_watch.forget(context_id);
    }

    /// Whether the http context may still be answered.
    pub fn is_live(&self, context_id: u32) -> bool {
        self.live.contains(&context_id)
    }

    /// Sends `reply` in the form the request asked for (JSON, or events for a stream) with
    /// the model's `x-ratelimit-*` headers, and counts it. Another context is answered only
    /// while it lives, and uses up one of this VM call's replies.
    pub fn respond(&mut self, target: Target, reply: &Reply, outbound: &Outbound) -> bool {
        if matches!(target, Target::Context(id) if !self.live.contains(&id)) {
            return false;
        }
        self.counters.count_reply(&self.config, &outbound.model, reply, outbound.tenant.as_deref());
        self.send_in_form(target, reply, outbound)
    }

    /// Sends `reply` as JSON or as events, as the request asked, with the model's
    /// `x-ratelimit-*` headers.
    fn send_in_form(&mut self, target: Target, reply: &Reply, outbound: &Outbound) -> bool {
        let mut extra = self.rate_headers(&outbound.model, host::now_ms);
        extra.extend(outbound.tenant_header());
        if !outbound.stream {
            return self.send(target, reply, &extra);
        }
        let response = stream::for_client(reply.response.clone(), true, outbound.include_usage);
        self.send(target, &Reply { response, ..reply.clone() }, &extra)
    }

    /// The model's `x-ratelimit-*` headers: none for a model without limits (the clock is
    /// read only for one with them, see `upstream::rate_headers`) or with fleet-wide limits
    /// (the buckets live on their owner nodes).
    fn rate_headers(&self, model: &str, now_ms: impl FnOnce() -> u64) -> Vec<(&'static str, String)> {
        if self.config.fleet.shared_limits() {
            return Vec::new();
        }
        upstream::rate_headers(&SharedData, &self.config, model, now_ms)
    }

    /// Keeps the entry `request` was just served from, for the same bytes next time.
    pub fn keep_hot(&mut self, raw: &Raw<'_>, request: &ChatRequest, now: u64) {
        let Some(entry) = cache::get(&SharedData, &self.config, &request.key).filter(|e| e.is_fresh(now)) else {
            return;
        };
        let expires_ms = entry.stored_at_ms.saturating_add(entry.ttl_ms);
        let size = entry.response.body.len();
        let reply =
            Reply { response: entry.response, cache: Some(CacheStatus::Hit), key: Some(entry.key), age_s: None };
        let counters = self.counters.ids_for_reply(&self.config, &request.model, &reply, request.tenant.as_deref());
        let outbound = Outbound::of(request, Vec::new(), None);
        let answer = HotAnswer { reply, stored_at_ms: entry.stored_at_ms, outbound, counters };
        self.hot.put(raw, expires_ms, size, answer);
    }

    /// Sends a kept HIT on the current http context, as `respond` would (a JSON answer
    /// without copying it).
    pub fn respond_hot(&mut self, hit: &HotAnswer, now: u64) {
        counters::bump(&hit.counters);
        let age_s = now.saturating_sub(hit.stored_at_ms) / 1000;
        if hit.outbound.stream {
            let reply = Reply { age_s: Some(age_s), ..hit.reply.clone() };
            self.send_in_form(Target::Current, &reply, &hit.outbound);
            return;
        }
        let mut rate = self.rate_headers(&hit.outbound.model, || now);
        rate.extend(hit.outbound.tenant_header());
        let age = codec::decimal(age_s);
        let extra = rate.iter().map(|(n, v)| (*n, v.as_str())).chain([("age", age.as_str())]);
        host::send_with(&hit.reply, extra);
    }

    /// The headers of the stream forwarded for this http context, if it is one.
    pub fn stream_label(&self, context_id: u32) -> Option<StreamLabel> {
        let run = self.runs.streaming.get(&context_id)?;
        Some(StreamLabel {
            cache: run.flight.call.label,
            key: run.flight.call.key.hex().to_owned(),
            model: run.flight.model().to_owned(),
            include_usage: run.outbound.include_usage,
            sent: run.outbound.sent(self.bearer.is_some()),
            tenant: run.outbound.tenant.clone(),
        })
    }

    /// The forwarded stream of this http context ended: its flight is completed now
    /// (before the last bytes reach the client, so its next request is a HIT), and the root
    /// wakes the waiters in a VM call of its own.
    pub fn stream_ended(&mut self, context_id: u32, end: StreamEnd) {
        let Some(run) = self.runs.streaming.remove(&context_id) else { return };
        if let Some(ended) = self.complete_stream(run, end) {
            self.runs.ended.push(ended);
        }
        if !self.runs.ended.is_empty() || !self.fleet.outbox.is_empty() {
            self.queue.continue_later(ENDED);
        }
    }

    /// A forwarded stream ended: settle its bucket; share a finished answer (stored, and
    /// handed to its waiters in their own forms); after a stream that broke off, give the
    /// lease up so that one of its waiters leads a new flight. The leader's client already
    /// has its answer. Returns the key whose waiters should look again.
    pub fn complete_stream(&mut self, mut run: Run, end: StreamEnd) -> Option<(Key, bool)> {
        let now = host::now_ms();
        let cut_off = run.outbound.prompt_estimate() + end.streamed_tokens;
        run.flight.on_stream_end(&SharedData, &self.config, end.usage, cut_off, end.attempts, &end.hints, now);
        self.fleet.outbox.append(&mut run.flight.outbox);
        if let Some(t) = run.outbound.tenant.as_deref().filter(|_| !self.config.fleet.shared_limits()) {
            self.counters.record_budget(&self.config, t, now);
        }
        self.counters.count_events(
            &self.config,
            &std::mem::take(&mut run.flight.events),
            run.outbound.tenant.as_deref(),
        );
        let call = run.flight.call;
        let watched = match end.outcome {
            Some(outcome) => {
                let (reply, watched) = self.engine().finish_flight(&call, Some(outcome), now);
                self.counters.count_reply(&self.config, &run.outbound.model, &reply, run.outbound.tenant.as_deref());
                watched
            }
            None => self.engine().abandon(&call),
        };
        call.lease.map(|l| (l.key, watched))
    }

    pub fn send(&mut self, target: Target, reply: &Reply, extra: &[(&str, String)]) -> bool {
        match target {
            Target::Current => host::send(reply, extra),
            Target::Context(id) if self.live.contains(&id) => {
                self.replies_left = self.replies_left.saturating_sub(1);
                host::send_to(id, reply, extra)
            }
            Target::Context(_) => false,
        }
    }

    /// Answers the requests whose body Envoy received but never delivered (see
    /// `body_watch`) with a 500.
    pub fn answer_stalled(&mut self) {
        let live = &self.live;
        let received = |id: u32| {
            let current = live.contains(&id) && hostcalls::set_effective_context(id).is_ok();
            current.then(host::received_bytes).flatten()
        };
        let (ids, first) = self.body_watch.stalled(host::now_ms(), received);
        if first {
            host::log(LogLevel::Error, &format!("holysheep: {}", body_watch::MESSAGE));
        }
        let reply = Reply::error(&ApiError::server(body_watch::MESSAGE, "edge_misconfigured"));
        for id in ids {
            self.send(Target::Context(id), &reply, &[]);
            self.live.remove(&id);
        }
    }

    pub fn engine(&self) -> Engine<'_, SharedData> {
        Engine { store: &SharedData, config: &self.config }
    }
}
