//! State shared by one worker thread's root context and its http contexts: the flights
//! it leads and the waiters it holds, the http contexts it may still answer, how many local
//! replies the current VM call may still send, and the parts each concern owns (wake
//! queue, counters, key check, fleet).

use super::abi as hostcalls;
use super::body_watch::{self, BodyWatch};
use super::budget_store::BudgetStore;
use super::counters::{Counters, Stopwatch};
use super::host::{self, Nonces, SharedData};
use super::ids::{IdMap, IdSet};
use super::runs::{Run, Runs};
use super::wake::{WakeQueue, ENDED};
use crate::core::api::error::ApiError;
use crate::core::api::key::Key;
use crate::core::api::reply::Reply;
use crate::core::api::usage::Usage;

use crate::core::coalesce::engine::{Call, Ended, Engine, Finishing, Wait};
use crate::core::config::environment::Environment;
use crate::core::config::Config;
use crate::core::flight::leader::Leader;
use crate::core::flight::tee::{Hop, StreamEnd, StreamLabel};
use crate::core::intake::kept::Kept;
use crate::core::intake::recall::Recall;
use crate::core::limits::fleet::Op;
use crate::core::observe::log_fields::{self, Answered, Served};
use crate::core::observe::metrics::{self, Counter, LastUsage};
use crate::core::observe::notices::Notices;
use crate::core::upstream::Outbound;
use crate::proxy::types::{BufferType, LogLevel, MapType};
use std::cell::RefCell;
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
    /// The configuration served: the file's (`base`), with the spend store's tenants
    /// table in place of its `tenants` when `budget_store.tenants` is on.
    pub config: Rc<Config>,
    pub base: Rc<Config>,
    /// The version (shared-data CAS) of the store's tenants table served last.
    pub tenants_served: Option<u32>,
    /// The operator's key and the fleet's secrets, from the VM environment; never logged.
    pub env: Rc<Environment>,
    pub vm_id: String,
    pub nonces: Nonces,
    /// The tick period set last.
    pub tick_ms: u64,
    pub queue: WakeQueue,
    pub counters: Counters,
    /// Whether this VM tried the check of the operator's key (`upstream::key_check`).
    pub key_checked: bool,
    /// What the log said last of what this worker sees change.
    notices: Notices,
    /// Settlements for owner nodes, sent from the root context (`Root::send_settlements`).
    pub outbox: Vec<Op>,
    pub budget_store: BudgetStore,
    pub runs: Runs,
    pub waiters: IdMap<(Wait, Rc<Outbound>)>,
    /// Finished flights whose waiters here are being answered, over one VM call or several
    /// (see REPLY_BATCH).
    pub finishing: Finishing,
    /// Http contexts that may still be answered: created, not done, and not answered by
    /// the root on its own. (Envoy still resolves a reset stream's id until its deferred
    /// delete, and a reply sent there would reach a context the plugin already forgot.)
    pub live: IdSet,
    pub body_watch: BodyWatch,
    /// Local replies the current root-context VM call may still send (see REPLY_BATCH).
    pub replies_left: usize,
    /// The stream whose request callback is running while the calls it handed over are
    /// dispatched (`Root::dispatch_handed`), and whether it was sent along its route then:
    /// it goes on by its callback's own `Continue`, never by a resume from inside that
    /// callback (Envoy would send its headers before its body has been buffered).
    pub handing: Option<(u32, bool)>,
    /// The HITs and parses it remembers by the requests' raw bytes.
    pub recall: Recall,
    /// The usage of the answer logged last (followers share one answer).
    pub log_usage: LastUsage,
}

/// A worker's state, as its root context and http contexts each hold it.
pub type WorkerRef = Rc<RefCell<Worker>>;

/// Publishes `answered` on the current http context (the values of `log_fields::NAMES`,
/// as filter state `wasm.<name>`).
fn publish(answered: &Answered<'_>) {
    for (name, value) in log_fields::values(answered) {
        let _ = hostcalls::set_property(name, value.as_bytes());
    }
}

impl Worker {
    pub fn new() -> Self {
        Worker {
            config: Rc::new(Config::default()),
            base: Rc::new(Config::default()),
            tenants_served: None,
            env: Rc::default(),
            vm_id: String::new(),
            nonces: Nonces::new(),
            tick_ms: 0,
            queue: WakeQueue::default(),
            counters: Counters::default(),
            key_checked: false,
            notices: Notices::default(),
            outbox: Vec::new(),
            budget_store: BudgetStore::default(),
            runs: Runs::default(),
            waiters: Default::default(),
            finishing: Finishing::default(),
            live: Default::default(),
            body_watch: BodyWatch::default(),
            replies_left: REPLY_BATCH,
            handing: None,
            // Replaced, with a random seed, by the configuration every VM gets before a request.
            recall: Recall::new(&Config::default(), 0, false),
            log_usage: LastUsage::default(),
        }
    }

    /// HolySheep refused the configured key on a chat call (logged, rate-limited).
    pub fn key_refused(&mut self, status: u16) {
        host::note(self.notices.key_refused(&self.config, status, host::now_ms()));
    }

    /// Whether a model owner answered (`why` it did not): logged when that changes (once,
    /// not per request: `fleet_local_share` counts those).
    pub fn owners_reached(&mut self, reached: bool, why: &str) {
        host::note(self.notices.owners(reached, why));
    }

    pub fn nonce(&mut self) -> u64 {
        self.nonces.next()
    }

    /// Hands a call to the root context, which dispatches it once the stream's callback
    /// is done (`Root::dispatch_handed`); the client's reply comes from there.
    pub fn defer_call(&mut self, context_id: u32, call: Call, outbound: Rc<Outbound>) {
        self.runs.pending.push((context_id, call, outbound));
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
    pub fn respond(&mut self, target: Target, reply: &Reply, outbound: &Outbound, served: Served) -> bool {
        if matches!(target, Target::Context(id) if !self.live.contains(&id)) {
            return false;
        }
        self.counters.count_reply(&self.config, &outbound.model, reply, outbound.tenant.as_deref());
        if self.config.log_fields {
            let usage = (reply.response.status == 200).then(|| self.log_usage.of(&reply.response.body)).flatten();
            self.publish(target, reply, outbound, served, usage);
        }
        self.send_in_form(target, reply, outbound)
    }

    /// Publishes what the access log shows of the request of `target` (the values of
    /// `log_fields::NAMES`, as filter state `wasm.<name>`).
    fn publish(&self, target: Target, reply: &Reply, outbound: &Outbound, served: Served, usage: Option<Usage>) {
        if !self.config.log_fields {
            return;
        }
        if let Target::Context(id) = target {
            if hostcalls::set_effective_context(id).is_err() {
                return;
            }
        }
        publish(&outbound.answered(reply, served, usage).priced(&self.config));
    }

    /// Sends `reply` as JSON or as events, as the request asked, with the model's
    /// `x-ratelimit-*` headers (`Outbound::for_client`).
    fn send_in_form(&mut self, target: Target, reply: &Reply, outbound: &Outbound) -> bool {
        let (reply, extra) = outbound.for_client(&SharedData, &self.config, reply, host::now_ms);
        self.send(target, &reply, &extra)
    }

    /// The stopwatch of a request a kept answer serves, arrived in full at `now`.
    pub fn stopwatch_of(&self, hit: &Kept, now: u64) -> Stopwatch {
        let outbound = &hit.outbound;
        self.counters.stopwatch(&self.config, &outbound.model, outbound.endpoint, outbound.stream, now)
    }

    /// Sends a kept HIT on the current http context, as `respond` would (a JSON answer
    /// without copying it).
    pub fn respond_hot(&mut self, hit: &Kept, now: u64) {
        self.counters.hold(&hit.counters);
        if self.config.log_fields {
            publish(&hit.answered(&self.config));
        }
        if hit.outbound.stream {
            self.send_in_form(Target::Current, &hit.reply_at(now), &hit.outbound);
            return;
        }
        let (labels, extra) = (hit.labels(now), hit.outbound.answer_headers(&SharedData, &self.config, true, || now));
        host::send_with(&hit.reply, labels.pairs().into_iter().chain(extra.iter().map(|(n, v)| (*n, v.as_str()))));
    }

    /// The headers of the stream forwarded for this http context, if it is one.
    pub fn stream_label(&self, context_id: u32) -> Option<StreamLabel> {
        self.runs.streaming.get(&context_id)?.leader.stream_label(&self.config)
    }

    /// A hop that could not go on (its request could not be resumed) ends now, broken:
    /// the key whose waiters should look again.
    pub fn stream_ended_now(&mut self, context_id: u32) -> Option<(Key, bool)> {
        let hop = self.runs.hops.remove(&context_id)?;
        self.complete_hop(hop, StreamEnd::broken())
    }

    /// A flight the intake ended at once (an embeddings list answered from its cached
    /// items): the root wakes its waiters in a VM call of its own.
    pub fn flight_ended(&mut self, key: Key, watched: bool) {
        self.runs.ended.push((key, watched));
        self.queue.continue_later(ENDED);
    }

    /// The forwarded stream of this http context ended: its flight is completed now
    /// (before the last bytes reach the client, so its next request is a HIT), and the root
    /// wakes the waiters in a VM call of its own.
    pub fn stream_ended(&mut self, context_id: u32, end: StreamEnd) {
        let ended = match (self.runs.streaming.remove(&context_id), self.runs.hops.remove(&context_id)) {
            (Some(run), _) => self.complete_stream(run, end),
            (None, Some(hop)) => self.complete_hop(hop, end),
            (None, None) => return,
        };
        if let Some(ended) = ended {
            self.runs.ended.push(ended);
        }
        if !self.runs.ended.is_empty() || !self.outbox.is_empty() {
            self.queue.continue_later(ENDED);
        }
    }

    /// A forwarded stream ended (`Leader::on_stream_end`): the leader's client already has
    /// its answer, which is counted and logged here. Returns the key whose waiters should
    /// look again.
    pub fn complete_stream(&mut self, mut run: Run, end: StreamEnd) -> Option<(Key, bool)> {
        let usage = end.usage;
        let over = run.leader.on_stream_end(&self.engine(), end, host::now_ms());
        self.drain(&mut run.leader);
        let outbound = &run.leader.outbound;
        if let Some(ended) = &over.ended {
            self.counters.count_reply(&self.config, &outbound.model, &ended.reply, outbound.tenant.as_deref());
            // The stream's own http context is the current one (its end is seen there).
            self.publish(Target::Current, &ended.reply, outbound, over.served, usage);
            self.count_evicted(ended, outbound);
        }
        over.wake
    }

    /// A forward node's call goes on to the key's owner node on the http context
    /// `context_id` (the current one), as `Hop::request` says; its answer is teed on its
    /// way back.
    pub fn hop(&mut self, context_id: u32, call: Call, outbound: Rc<Outbound>) {
        let hop = Hop::new(call, outbound);
        let (edit, body) = hop.request(&self.config);
        if let Some(body) = body {
            for (name, _) in host::headers(MapType::HttpRequestTrailers) {
                let _ = hostcalls::set_map_value(MapType::HttpRequestTrailers, &name, None);
            }
            let _ = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, usize::MAX, &body);
        }
        host::apply(MapType::HttpRequestHeaders, &edit);
        let label = metrics::label(&self.config, &hop.outbound.model);
        self.counters.count(vec![(label, Counter::Hops, 1)], hop.outbound.tenant.as_deref());
        self.runs.hops.insert(context_id, hop);
    }

    /// A forward node's hop ended (`Hop::end`). Returns the key whose waiters should look
    /// again.
    pub fn complete_hop(&mut self, hop: Hop, end: StreamEnd) -> Option<(Key, bool)> {
        let outbound = hop.outbound.clone();
        let (ended, wake) = hop.end(&self.engine(), end, host::now_ms());
        if let Some(ended) = &ended {
            self.count_evicted(ended, &outbound);
        }
        wake
    }

    /// What a leader left since it was last looked at: its events counted, its
    /// settlements for owner nodes queued (`Root::send_settlements`).
    pub fn drain(&mut self, leader: &mut Leader) {
        let events = std::mem::take(&mut leader.events);
        let (tenant, operation) = (leader.outbound.tenant.as_deref(), leader.outbound.endpoint.operation());
        self.counters.count_events(&self.config, &events, tenant, operation);
        self.outbox.append(&mut leader.outbox);
    }

    /// An owner keyed a hop's request otherwise than this forward node: counted, and logged
    /// once per worker (`Notices::key_disagreed`).
    pub fn key_disagrees(&mut self, model: &str, tenant: Option<&str>) {
        let label = metrics::label(&self.config, model);
        self.counters.count(vec![(label, Counter::HopKeyMismatch, 1)], tenant);
        host::note(self.notices.key_disagreed());
    }

    /// A node that runs other settings (configuration digest `theirs`) sent this owner a
    /// hop: counted, and logged for each digest seen last (`Notices::config_disagreed`).
    pub fn config_disagrees(&mut self, theirs: &str) {
        self.counters.count(vec![(metrics::FLEET_LABEL, Counter::ConfigMismatch, 1)], None);
        host::note(self.notices.config_disagreed(&self.config, theirs));
    }

    /// Counts a flight's answer stored over another key's fresh one.
    pub fn count_evicted(&self, ended: &Ended, outbound: &Outbound) {
        if ended.evicted {
            let label = metrics::label(&self.config, &outbound.model);
            self.counters.count(vec![(label, Counter::Evicted, 1)], outbound.tenant.as_deref());
        }
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
