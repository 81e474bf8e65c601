//! A deterministic, seeded simulator of a fleet over the core's own machines: the flights
//! (`flight::Flight`) the shells run, their admission, the tenants' budgets and the fleet's
//! owner nodes (`limits::fleet::serve_op`), each node with its own store (Envoy's shared
//! data, `MemStore`) and clock. One seed fixes every choice: the scenario (nodes, clock
//! skew, budgets, retries, how faulty HolySheep is), every request, every fault of
//! HolySheep's (`holysheep::Fault`), every owner that stops answering, every settlement
//! lost on the way, every node killed (the ring moving its keys to the others until it
//! starts again), every write another worker beats. After every step the money invariants
//! are checked
//! (`Sim::check`); a violation names its seed and the command that replays it.
//!
//! Run by `cargo test` on a fixed set of seeds, and by `make sim` on as many as asked
//! (`SEEDS=`, `STEPS=`, `SEED=` for one).

mod etcd;
mod holysheep;
mod rng;
mod scenario;
mod shared;

use self::etcd::{Etcd, Faults};
use self::holysheep::{Attempt, EmbedFault, Fault};
use self::rng::Rng;
use self::scenario::Scenario;
use self::shared::Shared;
use crate::core::api::error::ApiError;
use crate::core::api::event::Event;
use crate::core::api::key::Key;
use crate::core::api::priority::Class;
use crate::core::api::reply::CacheStatus;
use crate::core::api::reply::Reply;
use crate::core::api::usage::Usage;
use crate::core::coalesce::engine::Call;
use crate::core::coalesce::engine::{poll_delay_ms, Engine, Step, Wait};
use crate::core::config::environment::Environment;
use crate::core::config::Config;
use crate::core::flight::leader::{Do, Leader, Over};
use crate::core::limits::budget;
use crate::core::limits::budget_store::{Asked, Calls, Flush, Heard};
use crate::core::limits::fleet::{self, Op, Verdict};
use crate::core::limits::tenant_gate;
use crate::core::limits::{self, Limits};
use crate::core::request::Policy;
use crate::core::upstream::Outbound;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::rc::Rc;

/// Noon, 2026-12-07 (UTC): a run of a few simulated minutes stays within one day.
const START_MS: u64 = 1_796_644_800_000;

/// A node of the fleet: its shared data, its clock, until when it does not answer, and
/// when its workers next renew their leaders' leases.
struct Node {
    store: Shared,
    skew_ms: i64,
    silent_until: u64,
    next_tick: u64,
    /// Its calls to the spend store.
    side: Calls,
    /// Killed: out of the ring until it starts again, then.
    down_until: Option<u64>,
    /// How often it started: an answer to a call its previous process made finds no one.
    epoch: u64,
    /// Until when every compare-and-swap write on it is beaten by another worker's.
    storm_until: u64,
}

impl Node {
    fn new(skew_ms: i64, races: u64, seed: u64) -> Node {
        Node {
            store: Shared::new(races, seed),
            skew_ms,
            silent_until: 0,
            next_tick: 0,
            side: Calls::default(),
            down_until: None,
            epoch: 0,
            storm_until: 0,
        }
    }
}

/// A client's request: where it arrived, and whose it is (forgotten once answered).
struct Request {
    node: usize,
    tenant: usize,
    outbound: Outbound,
    stream: bool,
    /// Its prompt tokens and the most completion tokens it allows.
    tokens: (u64, u64),
    /// Waiting for another request's flight: the engine's wait and how often it looked.
    wait: Option<(Wait, u32)>,
    /// The latest look scheduled (an earlier one, overtaken by a wake-up, is dropped).
    looks: u64,
}

/// A flight in the air (led for request `req`), and what the simulator knows of it.
struct Live {
    req: u64,
    leader: Leader,
    /// What one attempt of unknown cost is charged.
    worst_micro: u64,
    /// What its attempts must be charged (the faults' truth), and what they were.
    due_micro: u64,
    charged_micro: u64,
    /// The last attempt's fault.
    fault: Option<Fault>,
}

enum Happening {
    Resume(u64),
    /// An attempt's answer, after the router's retries of a stream.
    Answer(u64, Fault, Attempt, u64),
    Verdict(u64, Option<Verdict>),
    /// A waiting request looks at its flight again (its look number).
    Poll(u64, u64),
    /// A leader's question was embedded (the tokens billed, `None`: no answer).
    Embedded(u64, EmbedFault, u64),
    /// The spend store answered a node's process (or its time ran out).
    Etcd(usize, u64, u64, Heard),
    /// A write a node gave up on lands in the spend store after all.
    Lands(Flush),
}

/// A broken invariant: what, at which step.
#[derive(Debug)]
pub(crate) struct Violation {
    pub step: u64,
    pub what: String,
}

pub(crate) struct Sim {
    rng: Rng,
    config: Config,
    /// Every node's secrets: the operator's key and the fleet's secret.
    env: Rc<Environment>,
    scenario: Scenario,
    nodes: Vec<Node>,
    clock: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    happenings: BTreeMap<u64, Happening>,
    requests: BTreeMap<u64, Request>,
    live: BTreeMap<u64, Live>,
    next_id: u64,
    /// Prompts asked so far, that a request may ask again.
    asked: Vec<String>,
    /// What HolySheep billed each tenant, in micro-dollars, at the models' prices.
    billed: Vec<u64>,
    /// Invariants broken since the last check.
    broken: Vec<String>,
    etcd: Etcd,
    /// The run is draining: no fault of the spend store's any more.
    calm: bool,
    /// Per budgeted tenant: a node admitted from its share of the tenant's budget (its
    /// owner out of reach), which is never written to the spend store.
    shared_out: Vec<bool>,
    /// Per budgeted tenant, what killed nodes' records charged beyond what the spend store
    /// held (their reservations and their spend not yet written): gone with them.
    lost: Vec<u64>,
    /// Per budgeted tenant, what its keepers charged beyond the spend store's value when
    /// the ring gave the tenant to another node that lived on (the new keeper knows
    /// nothing of it), and, with a spend store, one worst case per new keeper (what a
    /// keeper admits before it could read the store: `budget_store.outage_usd`).
    handed: Vec<u64>,
    /// The largest token estimate and dollar worst case of a call so far.
    most: (u64, u64),
    pub answered: u64,
    pub attempts: u64,
    pub shared: u64,
    /// Requests answered with a paraphrase's answer (SEMANTIC).
    pub paraphrased: u64,
    /// Nodes killed, and compare-and-swap writes another worker's beat.
    pub killed: u64,
    pub beaten: u64,
}

impl Sim {
    pub(crate) fn new(seed: u64) -> Result<Sim, String> {
        let mut rng = Rng::new(seed);
        let scenario = Scenario::draw(&mut rng);
        let config = scenario.config()?;
        let races = scenario.races.0;
        let nodes = scenario.skew_ms.iter().map(|&skew_ms| Node::new(skew_ms, races, rng.next())).collect();
        // The budgeted tenants, then one with buckets alone.
        let billed = vec![0; scenario.caps.len() + 1];
        Ok(Sim {
            lost: vec![0; billed.len() - 1],
            handed: vec![0; billed.len() - 1],
            shared_out: vec![false; billed.len() - 1],
            rng,
            config,
            env: Rc::new(Environment {
                bearer: Some("Bearer sk-sim".into()),
                fleet_secret: Some("fleet-sim".into()),
                fleet_secret_accepted: None,
            }),
            scenario,
            nodes,
            clock: START_MS,
            seq: 0,
            queue: BinaryHeap::new(),
            happenings: BTreeMap::new(),
            requests: BTreeMap::new(),
            live: BTreeMap::new(),
            next_id: 1,
            asked: Vec::new(),
            billed,
            broken: Vec::new(),
            etcd: Etcd::default(),
            calm: false,

            most: (0, 0),
            answered: 0,
            attempts: 0,
            shared: 0,
            paraphrased: 0,
            killed: 0,
            beaten: 0,
        })
    }

    fn now(&self, node: usize) -> u64 {
        self.clock.saturating_add_signed(self.nodes[node].skew_ms)
    }

    fn engine(&self, node: usize) -> Engine<'_, Shared> {
        Engine { store: &self.nodes[node].store, config: &self.config }
    }

    fn at(&mut self, time: u64, h: Happening) {
        self.seq += 1;
        self.queue.push(Reverse((time.max(self.clock), self.seq)));
        self.happenings.insert(self.seq, h);
    }

    /// One step: a new request, an owner falling silent, or the next thing due. `false`
    /// when nothing is left to do and no request may start (`starting`).
    pub(crate) fn step(&mut self, starting: bool) -> bool {
        if self.rng.below(1000) < self.scenario.silence {
            let n = self.rng.below(self.nodes.len() as u64) as usize;
            self.nodes[n].silent_until = self.clock + 100 + self.rng.below(5_000);
        }
        if self.rng.below(10_000) < self.scenario.crashes {
            let n = self.rng.below(self.nodes.len() as u64) as usize;
            self.kill(n);
        }
        if self.rng.below(1000) < self.scenario.races.1 {
            let n = self.rng.below(self.nodes.len() as u64) as usize;
            self.nodes[n].storm_until = self.clock + 10 + self.rng.below(300);
        }
        for node in &self.nodes {
            node.store.storm.set(self.clock < node.storm_until);
        }
        self.tick();
        let idle = self.queue.is_empty();
        if starting && (idle || self.rng.chance(30)) && self.live.len() < 64 {
            self.arrive();
            return true;
        }
        let Some(Reverse((time, seq))) = self.queue.pop() else { return starting };
        self.clock = self.clock.max(time);
        match self.happenings.remove(&seq) {
            Some(Happening::Resume(id)) => self.resume(id),
            Some(Happening::Answer(id, fault, attempt, retried)) => self.answer(id, fault, attempt, retried),
            Some(Happening::Verdict(id, verdict)) => self.verdict(id, verdict),
            Some(Happening::Poll(req, look)) => self.poll(req, look),
            Some(Happening::Embedded(id, fault, tokens)) => self.embedded(id, fault, tokens),
            Some(Happening::Etcd(node, epoch, id, heard)) => self.etcd_answered(node, epoch, id, heard),
            Some(Happening::Lands(flush)) => {
                let _ = self.etcd.txn(&flush);
            }
            None => {}
        }
        true
    }

    /// The nodes in the ring: those not killed.
    fn up(&self) -> Vec<usize> {
        (0..self.nodes.len()).filter(|&n| self.nodes[n].down_until.is_none()).collect()
    }

    /// The node of the fleet that owns `bucket`: the ring's pick among the nodes up, which
    /// moves only the keys of a node that leaves or comes back (as Envoy's ring hash does).
    fn owner(&self, bucket: &str) -> usize {
        let weight = |n: usize| fnv(format!("{bucket}@{n}").as_bytes());
        self.up().into_iter().max_by_key(|&n| weight(n)).unwrap_or(0)
    }

    /// What `node`'s records of `t` charge beyond what the spend store held: its own
    /// (the tenant's, if it keeps it, and its share's).
    fn unwritten(&self, node: usize, t: usize) -> u64 {
        let (store, now) = (&self.nodes[node].store, self.now(node));
        let name = format!("t{t}");
        let landed = |tag| self.etcd.holds(&name, tag);
        budget::unwritten(store, &name, now, landed)
            + budget::unwritten(store, &format!("{name}#share"), now, |_| false)
    }

    /// Node `n` is killed: its requests are reset (answered, once), its flights and its
    /// shared data are gone, and the ring gives its keys to the others until it starts
    /// again. What its records charged beyond the spend store is lost with them.
    fn kill(&mut self, n: usize) {
        if self.nodes[n].down_until.is_some() || self.up().len() < 2 && self.nodes.len() > 1 {
            return;
        }
        for t in 0..self.lost.len() {
            self.lost[t] += self.unwritten(n, t);
        }
        self.killed += 1;
        self.beaten += self.nodes[n].store.lost.get();
        let before = self.keepers();
        let gone: Vec<u64> = self.requests.iter().filter(|(_, r)| r.node == n).map(|(id, _)| *id).collect();
        self.live.retain(|_, l| !gone.contains(&l.req));
        for req in gone {
            self.reset(req);
        }
        let back = self.clock + 500 + self.rng.below(10_000);
        let (skew, races, seed) = (self.nodes[n].skew_ms, self.scenario.races.0, self.rng.next());
        let epoch = self.nodes[n].epoch + 1;
        self.nodes[n] = Node { down_until: Some(back), epoch, ..Node::new(skew, races, seed) };
        self.handover(before, false);
    }

    /// Killed nodes whose time came start again, empty, and take their keys back from the
    /// ring: a tenant's keeper that lives on hands over what the new one cannot know.
    fn restart(&mut self) {
        for n in 0..self.nodes.len() {
            if self.nodes[n].down_until.is_none_or(|until| until > self.clock) {
                continue;
            }
            let before = self.keepers();
            self.nodes[n].down_until = None;
            self.handover(before, true);
        }
    }

    /// Each budgeted tenant's keeper: its owner node.
    fn keepers(&self) -> Vec<usize> {
        (0..self.lost.len()).map(|t| self.owner(&tenant_gate::bucket(&format!("t{t}")))).collect()
    }

    /// The ring changed: a tenant whose keeper changed is kept by a node that knows only
    /// what the spend store holds (and, with one, admits one worst case before it could read
    /// it). A keeper that lives on (`alive`) left behind what it charged beyond the store.
    fn handover(&mut self, before: Vec<usize>, alive: bool) {
        let after = self.keepers();
        for (t, (was, is)) in before.into_iter().zip(after).enumerate() {
            if was == is {
                continue;
            }
            if alive {
                self.handed[t] += self.unwritten(was, t);
            }
            if self.scenario.store.is_some() {
                self.handed[t] += self.most.1;
            }
        }
    }

    /// A request whose node was killed: its client's connection is reset.
    fn reset(&mut self, req: u64) {
        if self.requests.remove(&req).is_some() {
            self.answered += 1;
        }
    }

    /// Each node's workers renew their leaders' leases on their tick, as the shells do.
    fn tick(&mut self) {
        self.restart();
        for n in 0..self.nodes.len() {
            if self.nodes[n].next_tick > self.clock || self.nodes[n].down_until.is_some() {
                continue;
            }
            self.nodes[n].next_tick = self.clock + self.config.tick_ms();
            let now = self.now(n);
            for l in self.live.values().filter(|l| self.requests.get(&l.req).is_some_and(|r| r.node == n)) {
                self.engine(n).renew(l.leader.call(), now);
            }
            if self.scenario.store.is_some() {
                let Sim { nodes, rng, config, .. } = self;
                let node = &mut nodes[n];
                for (id, asked) in node.side.tick(&node.store, config, now, || rng.next()) {
                    self.ask_etcd(n, id, &asked);
                }
            }
        }
    }

    /// A node's call to the spend store: its answer comes back after a while, or after
    /// `budget_store.timeout_ms` when none comes.
    fn ask_etcd(&mut self, node: usize, id: u64, asked: &Asked) {
        let faults = match self.scenario.store {
            Some((_, faults)) if !self.calm => faults,
            _ => Faults { down: 0, lost: 0, late: 0 },
        };
        let (heard, late) = etcd::serve(&mut self.etcd, asked, faults, &mut self.rng);
        let timeout = self.config.budget_store.timeout_ms;
        let answered = matches!(&heard, Heard::Range(Some(_)) | Heard::Txn(Some(_)));
        let latency = if answered { 1 + self.rng.below(timeout / 2) } else { timeout };
        let epoch = self.nodes[node].epoch;
        self.at(self.clock + latency, Happening::Etcd(node, epoch, id, heard));
        if let Some(flush) = late {
            let after = timeout + 1 + self.rng.below(2_000);
            self.at(self.clock + after, Happening::Lands(flush));
        }
    }

    fn etcd_answered(&mut self, node: usize, epoch: u64, id: u64, heard: Heard) {
        if self.nodes[node].epoch != epoch {
            return;
        }
        let now = self.now(node);
        let Node { side, store, .. } = &mut self.nodes[node];
        if let Some((id, asked)) = side.heard(store, id, heard, now).and_then(|t| t.next) {
            self.ask_etcd(node, id, &asked);
        }
    }

    /// After the run: the spend store answers again, and every node writes what it holds.
    pub(crate) fn drain(&mut self) {
        self.calm = true;
        for node in &mut self.nodes {
            node.storm_until = 0;
            node.store.storm.set(false);
        }
        let until = self.clock + 30_000;
        while self.clock < until {
            self.clock += 50;
            self.tick();
            while let Some(Reverse((time, seq))) = self.queue.peek().copied() {
                if time > self.clock {
                    break;
                }
                self.queue.pop();
                match self.happenings.remove(&seq) {
                    Some(Happening::Etcd(node, epoch, id, heard)) => self.etcd_answered(node, epoch, id, heard),
                    Some(Happening::Lands(flush)) => {
                        let _ = self.etcd.txn(&flush);
                    }
                    _ => {}
                }
            }
        }
    }

    /// Once drained: what the spend store holds for each budgeted tenant is at least what
    /// HolySheep billed it, but for what killed nodes had not written (and for a tenant a
    /// node admitted from its share of: the shares are never written).
    pub(crate) fn check_stored(&self) -> Vec<String> {
        if self.scenario.store.is_none() {
            return Vec::new();
        }
        let mut broken = Vec::new();
        for (t, billed) in self.billed.iter().enumerate().take(self.scenario.caps.len()) {
            if self.shared_out[t] {
                continue;
            }
            let stored = self.etcd.day_micro(&format!("t{t}"));
            if stored + self.lost[t] < *billed {
                broken.push(format!(
                    "the spend store holds {stored} micro-dollars of t{t} ({} lost with killed nodes), who was \
                     billed {billed}",
                    self.lost[t]
                ));
            }
        }
        broken
    }

    /// A tenant's request arrives at a node: a call, or a stream, of a new prompt or one
    /// asked before (by this tenant or another).
    fn arrive(&mut self) {
        let up = self.up();
        if up.is_empty() {
            return;
        }
        let (id, node) = (self.next_id, up[self.rng.below(up.len() as u64) as usize]);
        self.next_id += 1;
        let tenant = self.rng.below(self.billed.len() as u64) as usize;
        let stream = self.rng.chance(self.scenario.streams);
        let prompt = if !self.asked.is_empty() && self.rng.chance(self.scenario.repeats) {
            self.asked[self.rng.below(self.asked.len() as u64) as usize].clone()
        } else {
            let max_tokens = 1 + self.rng.below(2_000);
            let text = "x".repeat(1 + self.rng.below(3_000) as usize);
            let prompt = format!(
                r#""max_tokens":{max_tokens},"temperature":0,"messages":[{{"role":"user","content":"{id} {text}"}}]"#
            );
            if self.asked.len() < 64 {
                self.asked.push(prompt.clone());
            }
            prompt
        };
        let body = format!(r#"{{"model":"gpt-4.1","stream":{stream},{prompt}}}"#);
        let name = format!("t{tenant}");
        let meta = crate::core::request::RequestMeta { verified: Some(&name), ..Default::default() };
        let endpoint = crate::core::api::endpoint::Endpoint::Chat;
        let request = match crate::core::request::ApiRequest::parse(&self.config, &meta, endpoint, body.as_bytes()) {
            Ok(r) => r,
            Err(e) => return self.broken.push(format!("the simulator's request is refused: {e:?}")),
        };
        let outbound = Outbound { tenant: Some(name), ..Outbound::of(&request, body.as_bytes().to_vec(), None) };
        // A token is at least one byte: the prompt HolySheep counts is within the body. Most
        // text is about four bytes a token, as the edge estimates; some (code, CJK) is
        // denser, and its usage passes the estimate.
        let bytes = body.len() as u64;
        let dense = if self.rng.chance(25) { self.rng.below(bytes - bytes / 4) } else { 0 };
        let tokens = (bytes.div_ceil(4) + dense, request.completion_limit.unwrap_or(1));
        let req = Request { node, tenant, outbound, stream, tokens, wait: None, looks: 0 };
        self.requests.insert(id, req);
        let (now, nonce) = (self.now(node), self.rng.next());
        if stream {
            // Streams go along the route as their own flights (not shared here).
            let call = Call {
                key: request.key,
                lease: None,
                store: false,
                label: CacheStatus::Miss,
                started_ms: now,
                policy: POLICY,
                place: None,
            };
            return self.lead(id, call);
        }
        let step = self.engine(node).admit(&request.key, POLICY, now, nonce);
        self.take(id, step);
    }

    /// What the engine said of a request: its answer, a flight to lead, or a flight to wait for.
    fn take(&mut self, req: u64, step: Step) {
        match step {
            Step::Reply(reply) => self.reply(req, &reply),
            Step::Call(call) => self.lead(req, call),
            Step::Wait(wait) => {
                let Some(r) = self.requests.get_mut(&req) else { return };
                let polls = r.wait.as_ref().map_or(0, |(_, p)| p + 1);
                r.wait = Some((wait, polls));
                self.look(req, self.clock + poll_delay_ms(polls));
            }
        }
    }

    /// Request `req` looks at its flight at `time`, and not at any time scheduled before.
    fn look(&mut self, req: u64, time: u64) {
        let Some(r) = self.requests.get_mut(&req) else { return };
        r.looks += 1;
        let look = r.looks;
        self.at(time, Happening::Poll(req, look));
    }

    fn poll(&mut self, req: u64, look: u64) {
        let Some(r) = self.requests.get(&req) else { return };
        if r.looks != look {
            return;
        }
        let Some((wait, _)) = r.wait.clone() else { return };
        let (now, nonce) = (self.now(r.node), self.rng.next());
        let step = self.engine(r.node).poll(&wait, now, nonce);
        self.take(req, step);
    }

    /// Request `req` leads `call`'s flight (`flight::leader`, as the shells run it): with
    /// the semantic tier, it looks for a paraphrase first: its question is embedded when
    /// its tenant's budget and the embedding model's bucket admit it.
    fn lead(&mut self, req: u64, call: Call) {
        let Some(r) = self.requests.get_mut(&req) else { return };
        r.wait = None;
        let Some(r) = self.requests.get(&req) else { return };
        let (node, outbound) = (r.node, Rc::new(r.outbound.clone()));
        let models: Vec<String> = ["gpt-4.1", "deepseek-v3"].map(str::to_owned).to_vec();
        let worst_micro = tenant_gate::worst_micro(&self.config, &models, outbound.worst_tokens());
        self.most = (self.most.0.max(outbound.estimate_tokens), self.most.1.max(worst_micro));
        let at = (self.now(node), self.rng.next());
        let (leader, next) = Leader::start(&self.engine(node), call, outbound, self.env.clone(), at);
        let id = self.next_id;
        self.next_id += 1;
        let live = Live { req, leader, worst_micro, due_micro: 0, charged_micro: 0, fault: None };
        self.live.insert(id, live);
        self.act(id, next);
    }

    /// The leader's question goes to HolySheep's embeddings: billed its tokens (a token is
    /// at least one byte), or failed.
    fn embed(&mut self, id: u64) {
        let Some(r) = self.live.get(&id).and_then(|l| self.requests.get(&l.req)) else { return };
        let tenant = r.tenant;
        let text = r.outbound.semantic.as_ref().map_or(0, |p| p.text.len() as u64);
        let tokens = text.div_ceil(4);
        let fault = EmbedFault::draw(&mut self.rng);
        if fault.billed() {
            self.billed[tenant] += self.config.embedding_cost_micro_usd(tokens);
        }
        let latency = 5 + self.rng.below(200);
        self.at(self.clock + latency, Happening::Embedded(id, fault, tokens));
    }

    /// The embedding's answer came back: the leader charges it to the tenant (here, or a
    /// settlement for its owner node), then answers from a paraphrase or flies.
    fn embedded(&mut self, id: u64, fault: EmbedFault, tokens: u64) {
        let Some(node) = self.node_of(id) else { return };
        let at = (self.now(node), self.rng.next());
        let body = fault.body(tokens);
        let engine = Engine { store: &self.nodes[node].store, config: &self.config };
        let Some(l) = self.live.get_mut(&id) else { return };
        let next = l.leader.on_embedding(&engine, fault.answer(&body), at);
        self.act(id, next);
    }

    fn node_of(&self, id: u64) -> Option<usize> {
        let l = self.live.get(&id)?;
        self.requests.get(&l.req).map(|r| r.node)
    }

    fn resume(&mut self, id: u64) {
        let Some(node) = self.node_of(id) else { return };
        let at = (self.now(node), self.rng.next());
        let engine = Engine { store: &self.nodes[node].store, config: &self.config };
        let Some(l) = self.live.get_mut(&id) else { return };
        let next = l.leader.on_timer(&engine, at);
        self.act(id, next);
    }

    /// Carries out a leader's `Do`, as a shell does.
    fn act(&mut self, id: u64, next: Do) {
        self.collect(id);
        let Some(node) = self.node_of(id) else { return };
        match next {
            Do::Embed { .. } => self.embed(id),
            Do::Send { model, call } => {
                let timeout_ms = call.timeout_ms;
                let (Some(l), Some(r)) =
                    (self.live.get(&id), self.live.get(&id).and_then(|l| self.requests.get(&l.req)))
                else {
                    return;
                };
                let (tokens, worst, tenant, stream) = (r.tokens, l.worst_micro, r.tenant, r.stream);
                // A stream goes along the route: Envoy's router retries it on the edge's terms
                // (`Flight::stream_retries`), each retry charged its worst case.
                let retries = match l.leader.flight() {
                    Some(f) if stream => u64::from(f.stream_retries(&self.config)),
                    _ => 0,
                };
                let content = format!("answered for t{tenant}");
                let (mut retried, mut due) = (0, 0);
                let (fault, attempt) = loop {
                    let fault = Fault::draw(&mut self.rng, self.scenario.faulty, stream);
                    // A stream the router tried has left: it is not refused before leaving.
                    if retried > 0 && fault == Fault::DispatchRefused {
                        continue;
                    }
                    let config = &self.config;
                    let cost = |u: &Usage| config.cost_micro_usd(&model, u);
                    let attempt = holysheep::attempt(&mut self.rng, fault, tokens, (cost, worst), &content);
                    if let Some(u) = attempt.billed {
                        self.billed[tenant] += self.config.cost_micro_usd(&model, &u);
                    }
                    self.attempts += 1;
                    if retried < retries && fault.router_retries() {
                        (retried, due) = (retried + 1, due + worst);
                        continue;
                    }
                    break (fault, attempt);
                };
                let latency = match fault {
                    Fault::Timeout { .. } => timeout_ms,
                    _ => attempt.latency_ms.min(timeout_ms),
                };
                if let Some(l) = self.live.get_mut(&id) {
                    l.due_micro += due + attempt.due_micro;
                    l.fault = Some(fault);
                }
                self.at(self.clock + latency, Happening::Answer(id, fault, attempt, retried));
            }
            Do::Sleep { until_ms } => {
                let until = until_ms.saturating_add_signed(-self.nodes[node].skew_ms);
                self.at(until, Happening::Resume(id));
            }
            Do::Ask { bucket, op, timeout_ms } => {
                let owner = self.owner(&bucket);
                if self.nodes[owner].silent_until > self.clock {
                    // A stopped owner: the ask may have reached it, its answer never comes.
                    if self.rng.chance(30) {
                        let now = self.now(owner);
                        fleet::serve_op(&self.nodes[owner].store, &self.config, op, now);
                    }
                    self.at(self.clock + timeout_ms, Happening::Verdict(id, None));
                } else {
                    let now = self.now(owner);
                    let verdict = fleet::serve_op(&self.nodes[owner].store, &self.config, op, now);
                    let latency = 1 + self.rng.below(timeout_ms.clamp(1, 20));
                    self.at(self.clock + latency, Happening::Verdict(id, Some(verdict)));
                }
            }
            Do::Over(over) => self.finish(id, over),
        }
    }

    fn answer(&mut self, id: u64, fault: Fault, attempt: Attempt, retried: u64) {
        let Some(node) = self.node_of(id) else { return };
        let stream = self.live.get(&id).and_then(|l| self.requests.get(&l.req)).is_some_and(|r| r.stream);
        let at = (self.now(node), self.rng.next());
        let engine = Engine { store: &self.nodes[node].store, config: &self.config };
        let Some(l) = self.live.get_mut(&id) else { return };
        if stream {
            let end = holysheep::stream_end(fault, attempt, retried, l.leader.outbound.prompt_estimate());
            let over = l.leader.on_stream_end(&engine, end, at.0);
            return self.finish(id, over);
        }
        let next = l.leader.on_response(&engine, attempt.outcome, &attempt.hints, at);
        self.act(id, next);
    }

    fn verdict(&mut self, id: u64, verdict: Option<Verdict>) {
        let Some(node) = self.node_of(id) else { return };
        let at = (self.now(node), self.rng.next());
        let engine = Engine { store: &self.nodes[node].store, config: &self.config };
        let Some(l) = self.live.get_mut(&id) else { return };
        let next = l.leader.on_verdict(&engine, verdict, at);
        self.act(id, next);
    }

    /// The leader's events (what it charged) and its settlements for owner nodes, sent
    /// without waiting: a stopped owner never gets them, and some are lost on the way.
    fn collect(&mut self, id: u64) {
        let Some(l) = self.live.get_mut(&id) else { return };
        for e in l.leader.events.drain(..) {
            if let Event::BudgetCharged { micro, .. } = e {
                l.charged_micro += micro;
            }
        }
        let ops: Vec<Op> = l.leader.outbox.drain(..).collect();
        for op in ops {
            self.send(op);
        }
    }

    /// A settlement for its bucket's owner node, sent without waiting: a stopped owner
    /// never gets it, and some are lost on the way.
    fn send(&mut self, op: Op) {
        let Some(bucket) = op.bucket(&self.config) else { return };
        let owner = self.owner(&bucket);
        if self.nodes[owner].silent_until > self.clock || self.rng.chance(self.scenario.lost) {
            return;
        }
        let now = self.now(owner);
        fleet::serve_op(&self.nodes[owner].store, &self.config, op, now);
    }

    /// The leader is over: its request answered (its flight's answer stored and handed
    /// to its waiters; a stream that broke off reached its client cut), and the waiters on
    /// its node look at once.
    fn finish(&mut self, id: u64, over: Over) {
        self.collect(id);
        let Some(l) = self.live.remove(&id) else { return };
        // A tenant without a budget is charged nothing.
        let budgeted = self.requests.get(&l.req).is_some_and(|r| r.tenant < self.scenario.caps.len());
        let due = if budgeted { l.due_micro } else { 0 };
        if l.charged_micro != due {
            self.broken.push(format!(
                "the flight of request {} (last fault {:?}) was charged {} micro-dollars where its attempts \
                 came to {}",
                l.req, l.fault, l.charged_micro, due
            ));
        }
        let Some(node) = self.requests.get(&l.req).map(|r| r.node) else { return };
        match &over.ended {
            Some(ended) => {
                if ended.reply.cache == Some(CacheStatus::Semantic) {
                    self.paraphrased += 1;
                }
                self.reply(l.req, &ended.reply);
            }
            None => self.reply(l.req, &Reply::error(&ApiError::upstream(502, "cut", "stream_cut"))),
        }
        if let Some((key, _)) = over.wake {
            self.wake(node, &key);
        }
    }

    /// The requests on `node` waiting for the flight of `key` look at once.
    fn wake(&mut self, node: usize, key: &Key) {
        let woken: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, r)| r.node == node && r.wait.as_ref().is_some_and(|(w, _)| w.key == *key))
            .map(|(id, _)| *id)
            .collect();
        for req in woken {
            self.look(req, self.clock);
        }
    }

    /// A request is answered: once, and never with another tenant's answer. A request is
    /// forgotten once answered (or reset), so an answer to one no longer here is a second.
    fn reply(&mut self, req: u64, reply: &Reply) {
        let Some(r) = self.requests.get_mut(&req) else {
            return self.broken.push(format!("request {req} was answered again, or after its node was killed"));
        };
        r.wait = None;
        self.answered += 1;
        let shared = [CacheStatus::Hit, CacheStatus::Coalesced, CacheStatus::Stale, CacheStatus::Semantic];
        if reply.cache.is_some_and(|c| shared.contains(&c)) {
            self.shared += 1;
        }
        let body = String::from_utf8_lossy(&reply.response.body);
        let own = format!("answered for t{}", r.tenant);
        if body.contains("answered for t") && !body.contains(&own) {
            self.broken.push(format!("request {req} of t{} got another tenant's answer: {body}", r.tenant));
        }
        // A finished request is forgotten, so that the table stays bounded.
        self.requests.remove(&req);
    }

    /// The money invariants, as they stand now.
    pub(crate) fn check(&mut self) -> Vec<String> {
        let mut broken = std::mem::take(&mut self.broken);
        for json in self.etcd.unreadable.drain(..) {
            broken.push(format!("a spend record written to etcd does not read back: {json}"));
        }
        for (t, cap) in self.scenario.caps.iter().enumerate() {
            let name = format!("t{t}");
            // What the spend store holds, and what each node's records charge beyond what
            // it held when they read it (without a store: all they charge).
            let charged = self.etcd.day_micro(&name) + (0..self.nodes.len()).map(|n| self.unwritten(n, t)).sum::<u64>();
            // A node's share of the tenant's budget in use: never written to the store.
            let share = format!("{name}#share");
            if (0..self.nodes.len()).any(|n| budget::spent(&self.nodes[n].store, &share, self.now(n)).0 > 0) {
                self.shared_out[t] = true;
            }
            let (billed, lost, handed) = (self.billed[t], self.lost[t], self.handed[t]);
            // Charged at least what HolySheep billed (reservations in flight count), but
            // for what killed nodes' records took with them.
            if charged + lost < billed {
                broken.push(format!(
                    "{name} was charged {charged} micro-dollars ({lost} more lost with killed nodes) but \
                     HolySheep billed {billed}"
                ));
            }
            // Within the budget, plus, in a fleet, what the nodes' shares admit while the
            // tenant's owner is out of reach, plus what keepers killed or left behind by
            // the ring had charged beyond the spend store (docs/tenants.md).
            let bound = cap + self.share_bound(*cap) + lost + handed;
            if billed > bound {
                broken.push(format!(
                    "HolySheep billed {name} {billed} micro-dollars, past its bound of {bound} ({lost} lost with \
                     killed nodes, {handed} left behind by the ring)"
                ));
            }
        }
        broken.extend(self.floors());
        broken
    }

    /// A model's bucket, which every tenant shares (and each node's share of it), is never
    /// left more than one call's estimate below empty (docs/limits.md).
    fn floors(&self) -> Vec<String> {
        let Some((name, model)) = self.config.model("gpt-4.1") else { return Vec::new() };
        let whole = Limits::of(model, &self.config.rate_limit);
        let share = whole.share(self.config.fleet.nodes);
        let floor = -(self.most.0 as f64).min(whole.tpm.unwrap_or(0.0));
        let mut broken = Vec::new();
        for n in self.up() {
            let now = self.now(n);
            for (bucket, l) in [(name.to_owned(), &whole), (limits::share_bucket(name), &share)] {
                let b = limits::peek(&self.nodes[n].store, &bucket, l, now);
                if l.tpm.is_some() && b.tokens < floor.max(-l.tpm.unwrap_or(0.0)) - 1e-6 {
                    broken
                        .push(format!("node {n}'s bucket {bucket} holds {} tokens, below its floor {floor}", b.tokens));
                }
            }
        }
        broken
    }

    /// What the nodes' shares of a budget of `cap` may admit beside the owner's record.
    fn share_bound(&self, cap: u64) -> u64 {
        if self.nodes.len() < 2 {
            return 0;
        }
        let nodes = self.nodes.len() as u64;
        cap / nodes * nodes
    }

    /// The first requests still open, and the run's state: what a liveness violation shows.
    pub(crate) fn open_requests(&self) -> String {
        let mut out = String::new();
        for (id, r) in self.requests.iter().take(6) {
            let led = self.live.values().any(|l| l.req == *id);
            out += &format!(
                "request {id}: node {}, t{}, stream {}, leads a flight {led}, waits (key, looks) {:?}\n",
                r.node,
                r.tenant,
                r.stream,
                r.wait.as_ref().map(|(w, p)| (w.key.hex()[..8].to_owned(), p))
            );
        }
        out += &format!(
            "{} flights in the air, {} happenings due, at {} ms",
            self.live.len(),
            self.queue.len(),
            self.clock - START_MS
        );
        out
    }

    /// Requests not answered yet.
    pub(crate) fn open(&self) -> usize {
        self.requests.len()
    }
}

/// The cache directives of every simulated request: the defaults.
const POLICY: Policy = Policy { read: true, max_age: None, coalesce: true, store: true, class: Class::Standard };

/// FNV-1a: the ring's hash.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// How long, in simulated time, the last requests may take once no new one starts: a
/// waiter's longest wait (`lock.wait_timeout_ms`, 65 s) and a leader's call after it.
const ANSWERED_WITHIN_MS: u64 = 300_000;

/// Runs `seed` for `steps` steps, then until every flight has ended: the first violation.
pub(crate) fn run(seed: u64, steps: u64) -> Result<Sim, Violation> {
    let mut sim = Sim::new(seed).map_err(|what| Violation { step: 0, what })?;
    let mut step = 0;
    // Once no request starts, every one is answered within the simulated time the longest
    // wait may take (`lock.wait_timeout_ms`, and a leader's whole call after it).
    let mut stopped = None;
    while step < steps || sim.open() > 0 {
        step += 1;
        if !sim.step(step < steps) {
            break;
        }
        if let Some(what) = sim.check().into_iter().next() {
            return Err(Violation { step, what });
        }
        if step == steps {
            stopped = Some(sim.clock);
        }
        let since = stopped.map_or(0, |at| sim.clock.saturating_sub(at));
        if since > ANSWERED_WITHIN_MS || step > steps.saturating_mul(4) + 10_000_000 {
            return Err(Violation {
                step,
                what: format!("{} requests were never answered\n{}", sim.open(), sim.open_requests()),
            });
        }
    }
    if sim.open() > 0 {
        return Err(Violation { step, what: format!("{} requests were never answered", sim.open()) });
    }
    sim.drain();
    if let Some(what) = sim.check().into_iter().chain(sim.check_stored()).next() {
        return Err(Violation { step, what });
    }
    Ok(sim)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeds and steps from the environment (`make sim`), else a fixed set for CI.
    fn plan() -> (Vec<u64>, u64) {
        let var = |n: &str| std::env::var(n).ok().and_then(|v| v.parse::<u64>().ok());
        let steps = var("SIM_STEPS").unwrap_or(2_000);
        match (var("SIM_SEED"), var("SIM_SEEDS")) {
            (Some(seed), _) => (vec![seed], steps),
            (None, Some(n)) => ((1..=n).collect(), steps),
            (None, None) => ((1..=200).collect(), steps),
        }
    }

    #[test]
    fn the_fleet_keeps_its_money_invariants_under_every_fault() {
        let (seeds, steps) = plan();
        let (mut total_steps, mut flights, mut attempts, mut shared) = (0, 0, 0, 0);
        let (mut killed, mut beaten, mut paraphrased) = (0, 0, 0);
        for seed in seeds {
            match run(seed, steps) {
                Ok(sim) => {
                    total_steps += steps;
                    flights += sim.answered;
                    shared += sim.shared;
                    attempts += sim.attempts;
                    killed += sim.killed;
                    paraphrased += sim.paraphrased;
                    beaten += sim.beaten + sim.nodes.iter().map(|n| n.store.lost.get()).sum::<u64>();
                }
                Err(v) => panic!(
                    "seed {seed}, step {}: {}\nscenario: {:?}\nreplay: make sim SEED={seed} STEPS={steps}",
                    v.step,
                    v.what,
                    Scenario::draw(&mut Rng::new(seed))
                ),
            }
        }
        eprintln!(
            "sim: {total_steps} steps, {flights} requests answered ({shared} from the cache or a flight, {paraphrased} \
             SEMANTIC), \
             {attempts} attempts, {killed} nodes killed, {beaten} writes beaten by another worker's, no violation"
        );
    }
}
