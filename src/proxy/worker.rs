//! State shared by one worker thread's root context and its http contexts: the flights
//! and waiters it holds, the http contexts it may still answer, and how many local replies
//! the current VM call may still send.

use super::abi as hostcalls;
use super::body_watch::{self, BodyWatch};
use super::counters;
use super::host::{self, Nonces, SharedData};
use super::ids::{IdMap, IdSet};
use super::wakeups::{DISPATCH, ENDED};
use crate::core::cache::{self, Response};
use crate::core::codec;
use crate::core::config::Config;
use crate::core::engine::{CacheStatus, Call, Engine, Reply, Wait};
use crate::core::error::ApiError;
use crate::core::flight::Flight;
use crate::core::hot::{Hot, Raw, Seed};
use crate::core::limits::ProviderHints;
use crate::core::metrics::{self, LastUsage, PerCounter};
use crate::core::peer::Op;
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

/// A flight on its way, with the request it answers.
pub struct Run {
    pub context_id: u32,
    pub flight: Flight,
    pub outbound: Rc<Outbound>,
}

/// State shared by the root context and the http contexts of one VM.
pub struct Worker {
    pub config: Rc<Config>,
    /// `Bearer <key>` when the key is in the VM environment; never logged.
    pub(super) bearer: Option<String>,
    pub(super) vm_id: String,
    pub(super) queue: Option<(u32, String)>,
    pub(super) nonces: Nonces,
    pub(super) last_beat_ms: u64,
    pub(super) tick_ms: u64,
    pub(super) key_checked: bool,
    /// When this worker last logged that HolySheep refuses the configured key.
    pub(super) key_refused_logged_ms: u64,
    pub(super) key_check_token: Option<u32>,
    /// Calls decided in an http context, dispatched from the root on the next queue event.
    pub(super) pending: Vec<(u32, Call, Rc<Outbound>)>,
    /// Http contexts that may still be answered: created, not done, and not answered by
    /// the root on its own. (Envoy still resolves a reset stream's id until its deferred
    /// delete, and a reply sent there reaches the SDK for a context it already deleted: a
    /// panic.)
    pub(super) live: IdSet,
    pub body_watch: BodyWatch,
    /// Local replies the current root-context VM call may still send (see REPLY_BATCH).
    pub(super) replies_left: usize,
    pub(super) waiters: IdMap<(Wait, Rc<Outbound>)>,
    pub(super) flights: IdMap<Run>,
    pub(super) sleeping: Vec<(u64, Run)>,
    /// Stream flights forwarded along the route, by http context.
    pub(super) streams: IdMap<Run>,
    /// Keys of stream flights that ended, whose waiters the root wakes (here, and on
    /// every worker when the flight was watched).
    pub(super) ended: Vec<(Key, bool)>,
    /// Flights waiting for a model owner node's verdict, by callout token.
    pub(super) asking: IdMap<Run>,
    /// Settlements for model owner nodes, sent by the root.
    pub(super) outbox: Vec<Op>,
    /// The fleet's shared secret (from the environment); never logged.
    pub(super) peer_secret: Option<String>,
    /// Whether the last model owner asked answered (for logging the changes only).
    pub(super) fleet_reached: bool,
    /// HIT answers by the requests' raw bytes.
    pub(super) hot: Hot<HotAnswer>,
    /// Requests parsed before, by their raw bytes: every request on a forward node (its
    /// key routes it); on an owner, a request whose flight someone waits on, so that the
    /// rest of a crowd of identical requests is not parsed, canonicalised and hashed again.
    pub(super) parsed: Hot<ChatRequest>,
    /// What both tables hash the raw bytes with.
    pub(super) seed: Seed,
    pub(super) metrics: PerCounter<u32>,
    /// The usage of the answer counted last (followers share one answer).
    pub(super) last_usage: LastUsage,
}

pub type Shared = Rc<RefCell<Worker>>;

/// How a stream forwarded along the route ended, as its http context saw it.
pub struct StreamEnd {
    /// The reassembled `chat.completion`, or HolySheep's error; `None` when the stream
    /// broke off (reset, timeout, the client gone) before it finished.
    pub outcome: Option<Response>,
    pub usage: Option<(u64, u64)>,
    /// Completion tokens streamed before the end, estimated.
    pub streamed_tokens: u64,
    /// Attempts Envoy's router made (retries before the first byte), at least one.
    pub attempts: u64,
    /// What HolySheep's answer said about its limits.
    pub hints: ProviderHints,
}

impl StreamEnd {
    /// A forwarded stream that never got its answer's headers (or never left).
    pub fn broken() -> StreamEnd {
        StreamEnd { outcome: None, usage: None, streamed_tokens: 0, attempts: 1, hints: ProviderHints::default() }
    }
}

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
            queue: None,
            nonces: Nonces::new(),
            last_beat_ms: 0,
            tick_ms: 0,
            key_checked: false,
            key_refused_logged_ms: 0,
            key_check_token: None,
            pending: Vec::new(),
            live: Default::default(),
            body_watch: BodyWatch::default(),
            replies_left: REPLY_BATCH,
            waiters: Default::default(),
            flights: Default::default(),
            sleeping: Vec::new(),
            streams: Default::default(),
            ended: Vec::new(),
            asking: Default::default(),
            outbox: Vec::new(),
            peer_secret: None,
            fleet_reached: true,
            hot: Hot::new(0),
            parsed: Hot::new(0),
            seed: Seed::new(RandomState::new().hash_one(())),
            metrics: PerCounter::default(),
            last_usage: LastUsage::default(),
        }
    }

    pub fn nonce(&mut self) -> u64 {
        self.nonces.next()
    }

    /// Hands a call to the root context, which dispatches it on its next queue event (or
    /// tick, before the worker's queue exists); the client's reply comes from there.
    pub fn defer_call(&mut self, context_id: u32, call: Call, outbound: Rc<Outbound>) {
        self.pending.push((context_id, call, outbound));
        if let (Some((queue, _)), 1) = (&self.queue, self.pending.len()) {
            if hostcalls::enqueue_shared_queue(*queue, Some(DISPATCH)).is_err() {
                host::log(LogLevel::Warn, "holysheep: wake queue refused a message; the tick will dispatch");
            }
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
        let increments = metrics::for_reply(&self.config, &outbound.model, reply, &mut self.last_usage);
        self.count(increments);
        self.send_in_form(target, reply, outbound)
    }

    /// Sends `reply` as JSON or as events, as the request asked, with the model's
    /// `x-ratelimit-*` headers.
    fn send_in_form(&mut self, target: Target, reply: &Reply, outbound: &Outbound) -> bool {
        let extra = self.rate_headers(&outbound.model, host::now_ms);
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
        let increments = metrics::for_reply(&self.config, &request.model, &reply, &mut self.last_usage);
        let counters = self.counter_ids(increments);
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
        let rate = self.rate_headers(&hit.outbound.model, || now);
        let age = codec::decimal(age_s);
        let extra = rate.iter().map(|(n, v)| (*n, v.as_str())).chain([("age", age.as_str())]);
        host::send_with(&hit.reply, extra);
    }

    /// The headers of the stream forwarded for this http context, if it is one.
    pub fn stream_label(&self, context_id: u32) -> Option<StreamLabel> {
        let run = self.streams.get(&context_id)?;
        Some(StreamLabel {
            cache: run.flight.call.label,
            key: run.flight.call.key.hex().to_owned(),
            model: run.flight.model().to_owned(),
            include_usage: run.outbound.include_usage,
            sent: run.outbound.sent(self.bearer.is_some()),
        })
    }

    /// The forwarded stream of this http context ended: its flight is completed now
    /// (before the last bytes reach the client, so its next request is a HIT), and the root
    /// wakes the waiters in a VM call of its own.
    pub fn stream_ended(&mut self, context_id: u32, end: StreamEnd) {
        let Some(run) = self.streams.remove(&context_id) else { return };
        if let Some(ended) = self.complete_stream(run, end) {
            self.ended.push(ended);
        }
        if !self.ended.is_empty() || !self.outbox.is_empty() {
            self.continue_later(ENDED);
        }
    }

    /// A forwarded stream ended: settle its bucket; share a finished answer (stored, and
    /// handed to its waiters in their own forms); after a stream that broke off, give the
    /// lease up so that one of its waiters leads a new flight. The leader's client already
    /// has its answer. Returns the key whose waiters should look again.
    pub(super) fn complete_stream(&mut self, mut run: Run, end: StreamEnd) -> Option<(Key, bool)> {
        let now = host::now_ms();
        let cut_off = run.outbound.prompt_estimate() + end.streamed_tokens;
        run.flight.on_stream_end(&SharedData, &self.config, end.usage, cut_off, end.attempts, &end.hints, now);
        self.outbox.append(&mut run.flight.outbox);
        let events = std::mem::take(&mut run.flight.events);
        self.count(events.iter().flat_map(|e| metrics::for_event(&self.config, e)).collect());
        let call = run.flight.call;
        let watched = match end.outcome {
            Some(outcome) => {
                let (reply, watched) = self.engine().finish_flight(&call, Some(outcome), now);
                let increments = metrics::for_reply(&self.config, &run.outbound.model, &reply, &mut self.last_usage);
                self.count(increments);
                watched
            }
            None => self.engine().abandon(&call),
        };
        call.lease.map(|l| (l.key, watched))
    }

    pub(super) fn send(&mut self, target: Target, reply: &Reply, extra: &[(&str, String)]) -> bool {
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
    pub(super) fn answer_stalled(&mut self) {
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

    pub(super) fn engine(&self) -> Engine<'_, SharedData> {
        Engine { store: &SharedData, config: &self.config }
    }
}
