//! A deterministic, seeded simulator of a fleet over the core's own machines: the flights
//! (`flight::Flight`) the shells run, their admission, the tenants' budgets and the fleet's
//! owner nodes (`limits::fleet::serve_op`), each node with its own store (Envoy's shared
//! data, `MemStore`) and clock. One seed fixes every choice: the scenario (nodes, clock
//! skew, budgets, retries, how faulty HolySheep is), every request, every fault of
//! HolySheep's (`holysheep::Fault`), every owner that stops answering, every settlement
//! lost on the way. After every step the money invariants are checked
//! (`Sim::check`); a violation names its seed and the command that replays it.
//!
//! Run by `cargo test` on a fixed set of seeds, and by `make sim` on as many as asked
//! (`SEEDS=`, `STEPS=`, `SEED=` for one).

mod holysheep;
mod rng;

use self::holysheep::{Attempt, Fault};
use self::rng::Rng;
use crate::core::api::event::Event;
use crate::core::api::priority::Class;
use crate::core::coalesce::engine::{CacheStatus, Call};
use crate::core::config::Config;
use crate::core::flight::{Action, Flight};
use crate::core::limits::budget;
use crate::core::limits::fleet::{self, Op, Verdict};
use crate::core::limits::tenant_gate;
use crate::core::request::{request_key, Policy};
use crate::core::store::MemStore;
use crate::core::upstream::Outbound;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

/// Noon, 2026-12-07 (UTC): a run of a few simulated minutes stays within one day.
const START_MS: u64 = 1_796_644_800_000;

/// What one seed chose for its run.
#[derive(Debug, Clone)]
pub(crate) struct Scenario {
    pub nodes: u32,
    /// Each node's clock, ahead of (or behind) the fleet's, in milliseconds.
    pub skew_ms: Vec<i64>,
    /// Each tenant's budget for the day, in micro-dollars.
    pub caps: Vec<u64>,
    pub max_attempts: u32,
    /// The share of attempts HolySheep does not answer plainly, in percent.
    pub faulty: u64,
    /// The chance per step that an owner node stops answering for a while, in per mille.
    pub silence: u64,
    /// The chance that a settlement is lost on the way, in percent.
    pub lost: u64,
    /// The share of requests that are streams, in percent.
    pub streams: u64,
}

impl Scenario {
    fn draw(rng: &mut Rng) -> Scenario {
        let nodes = 1 + rng.below(3) as u32;
        Scenario {
            nodes,
            skew_ms: (0..nodes).map(|_| rng.below(4_001) as i64 - 2_000).collect(),
            // One budget spent within seconds, one within the run, one that lasts.
            caps: vec![5_000 + rng.below(300_000), 300_000 + rng.below(3_000_000), 5_000_000 + rng.below(50_000_000)],
            max_attempts: 1 + rng.below(3) as u32,
            faulty: [0, 10, 40, 90][rng.below(4) as usize],
            silence: if nodes > 1 { rng.below(30) } else { 0 },
            lost: if nodes > 1 { rng.below(20) } else { 0 },
            streams: rng.below(50),
        }
    }

    fn config(&self) -> Config {
        let tenants: Vec<String> = self
            .caps
            .iter()
            .enumerate()
            .map(|(i, cap)| {
                let digest = format!("{:064x}", i + 1);
                format!(r#""t{i}":{{"keys_sha256":["{digest}"],"usd_per_day":{}}}"#, *cap as f64 / 1e6)
            })
            .collect();
        let fleet = if self.nodes > 1 {
            format!(r#","fleet":{{"cluster":"owners","nodes":{},"timeout_ms":200}}"#, self.nodes)
        } else {
            String::new()
        };
        let raw = format!(
            r#"{{"models":{{
                "gpt-4.1":{{"usd_per_mtok_input":2,"usd_per_mtok_output":8,"requests_per_minute":6000,
                    "fallback":["deepseek-v3"]}},
                "deepseek-v3":{{"usd_per_mtok_input":0.27,"usd_per_mtok_output":1.1}}}},
              "retry":{{"max_attempts":{},"base_delay_ms":50,"max_delay_ms":500}},
              "upstream":{{"timeout_ms":10000}},"rate_limit":{{"max_wait_ms":1000}},
              "tenants":{{{}}}{fleet}}}"#,
            self.max_attempts,
            tenants.join(",")
        );
        match Config::parse(raw.as_bytes()) {
            Ok(c) => c,
            Err(e) => panic!("the simulator's configuration: {e:?}"),
        }
    }
}

/// A node of the fleet: its shared data, its clock, and until when it does not answer.
struct Node {
    store: MemStore,
    skew_ms: i64,
    silent_until: u64,
}

/// A flight in the air, and what the simulator knows of it.
struct Live {
    node: usize,
    tenant: usize,
    flight: Flight,
    stream: bool,
    /// Its prompt tokens and the most completion tokens it allows.
    tokens: (u64, u64),
    /// What one attempt of unknown cost is charged.
    worst_micro: u64,
    /// What its attempts must be charged (the faults' truth), and what they were.
    due_micro: u64,
    charged_micro: u64,
    /// The attempt on its way, for a stream (answered by `on_stream_end`).
    fault: Option<Fault>,
}

enum Happening {
    Resume(u64),
    Answer(u64, Fault, Attempt),
    Verdict(u64, Option<Verdict>),
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
    scenario: Scenario,
    nodes: Vec<Node>,
    clock: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    happenings: BTreeMap<u64, Happening>,
    live: BTreeMap<u64, Live>,
    next_id: u64,
    /// What HolySheep billed each tenant, in micro-dollars, at the models' prices.
    billed: Vec<u64>,
    /// Invariants broken since the last check.
    broken: Vec<String>,
    pub finished: u64,
    pub attempts: u64,
}

impl Sim {
    pub(crate) fn new(seed: u64) -> Sim {
        let mut rng = Rng::new(seed);
        let scenario = Scenario::draw(&mut rng);
        let config = scenario.config();
        let nodes =
            scenario.skew_ms.iter().map(|&skew_ms| Node { store: MemStore::new(), skew_ms, silent_until: 0 }).collect();
        let billed = vec![0; scenario.caps.len()];
        Sim {
            rng,
            config,
            scenario,
            nodes,
            clock: START_MS,
            seq: 0,
            queue: BinaryHeap::new(),
            happenings: BTreeMap::new(),
            live: BTreeMap::new(),
            next_id: 1,
            billed,
            broken: Vec::new(),
            finished: 0,
            attempts: 0,
        }
    }

    pub(crate) fn scenario(&self) -> &Scenario {
        &self.scenario
    }

    fn now(&self, node: usize) -> u64 {
        self.clock.saturating_add_signed(self.nodes[node].skew_ms)
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
        let idle = self.queue.is_empty();
        if starting && (idle || self.rng.chance(30)) && self.live.len() < 64 {
            self.start();
            return true;
        }
        let Some(Reverse((time, seq))) = self.queue.pop() else { return starting };
        self.clock = self.clock.max(time);
        match self.happenings.remove(&seq) {
            Some(Happening::Resume(id)) => self.resume(id),
            Some(Happening::Answer(id, fault, attempt)) => self.answer(id, fault, attempt),
            Some(Happening::Verdict(id, verdict)) => self.verdict(id, verdict),
            None => {}
        }
        true
    }

    /// A tenant's request arrives at a node: a call, or a stream, of its own text.
    fn start(&mut self) {
        let (id, node) = (self.next_id, self.rng.below(self.nodes.len() as u64) as usize);
        self.next_id += 1;
        let tenant = self.rng.below(self.scenario.caps.len() as u64) as usize;
        let stream = self.rng.chance(self.scenario.streams);
        let max_tokens = 1 + self.rng.below(2_000);
        let text = "x".repeat(1 + self.rng.below(3_000) as usize);
        let body = format!(
            r#"{{"model":"gpt-4.1","max_tokens":{max_tokens},"stream":{stream},"messages":[{{"role":"user","content":"{id} {text}"}}]}}"#
        );
        let name = format!("t{tenant}");
        let meta = crate::core::request::RequestMeta { verified: Some(&name), ..Default::default() };
        let endpoint = crate::core::api::endpoint::Endpoint::Chat;
        let request = match crate::core::request::ApiRequest::parse(&self.config, &meta, endpoint, body.as_bytes()) {
            Ok(r) => r,
            Err(e) => panic!("the simulator's request does not parse: {e:?}"),
        };
        let outbound =
            Outbound { tenant: Some(name.clone()), ..Outbound::of(&request, body.as_bytes().to_vec(), None) };
        let now = self.now(node);
        let call = Call {
            key: request_key("/v1/chat/completions", &name, body.as_bytes()),
            lease: None,
            store: false,
            label: CacheStatus::Miss,
            started_ms: now,
            policy: Policy { read: true, max_age: None, coalesce: true, store: true, class: Class::Standard },
            place: None,
        };
        let flight = Flight::new(&self.config, call, &outbound);
        let models: Vec<String> = ["gpt-4.1", "deepseek-v3"].map(str::to_owned).to_vec();
        let worst_micro = tenant_gate::worst_micro(&self.config, &models, outbound.worst_tokens());
        // A token is at least one byte: the prompt HolySheep counts is within the body.
        let tokens = ((body.len() as u64).div_ceil(4), max_tokens);
        let live =
            Live { node, tenant, flight, stream, tokens, worst_micro, due_micro: 0, charged_micro: 0, fault: None };
        self.live.insert(id, live);
        self.resume(id);
    }

    fn resume(&mut self, id: u64) {
        let Some(node) = self.live.get(&id).map(|l| l.node) else { return };
        let (now, nonce) = (self.now(node), self.rng.next());
        let Some(l) = self.live.get_mut(&id) else { return };
        let action = l.flight.resume(&self.nodes[node].store, &self.config, now, nonce);
        self.act(id, action);
    }

    /// Carries out a flight's action, as a shell does.
    fn act(&mut self, id: u64, action: Action) {
        self.collect(id);
        let Some(l) = self.live.get(&id) else { return };
        let (node, stream) = (l.node, l.stream);
        match action {
            Action::Send { model, timeout_ms } => {
                let fault = Fault::draw(&mut self.rng, self.scenario.faulty, stream);
                let (tokens, worst) = (l.tokens, l.worst_micro);
                let config = &self.config;
                let attempt =
                    holysheep::attempt(&mut self.rng, fault, tokens, |u| config.cost_micro_usd(&model, u), worst);
                let tenant = l.tenant;
                if let Some(u) = attempt.billed {
                    self.billed[tenant] += self.config.cost_micro_usd(&model, &u);
                }
                self.attempts += 1;
                let latency = match fault {
                    Fault::Timeout { .. } => timeout_ms,
                    _ => attempt.latency_ms.min(timeout_ms),
                };
                if let Some(l) = self.live.get_mut(&id) {
                    l.due_micro += attempt.due_micro;
                    l.fault = Some(fault);
                }
                self.at(self.clock + latency, Happening::Answer(id, fault, attempt));
            }
            Action::Sleep { until_ms } => {
                let until = until_ms.saturating_add_signed(-self.nodes[node].skew_ms);
                self.at(until, Happening::Resume(id));
            }
            Action::Ask { bucket, op, timeout_ms } => {
                let owner = owner_of(&bucket, self.nodes.len());
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
            Action::Finish(_) => self.finish(id),
        }
    }

    fn answer(&mut self, id: u64, fault: Fault, attempt: Attempt) {
        let Some(l) = self.live.get_mut(&id) else { return };
        let node = l.node;
        let now = self.clock.saturating_add_signed(self.nodes[node].skew_ms);
        if l.stream {
            let (end, hints) = holysheep::stream_end(fault, &attempt, 0);
            l.flight.on_stream_end(&self.nodes[node].store, &self.config, &end, &hints, now);
            self.collect(id);
            return self.finish(id);
        }
        let random = self.rng.next();
        let action =
            l.flight.on_response(&self.nodes[node].store, &self.config, attempt.outcome, &attempt.hints, now, random);
        self.act(id, action);
    }

    fn verdict(&mut self, id: u64, verdict: Option<Verdict>) {
        let Some(l) = self.live.get_mut(&id) else { return };
        l.flight.on_verdict(verdict);
        self.resume(id);
    }

    /// The flight's events (what it charged) and its settlements for owner nodes, sent
    /// without waiting: a stopped owner never gets them, and some are lost on the way.
    fn collect(&mut self, id: u64) {
        let Some(l) = self.live.get_mut(&id) else { return };
        for e in l.flight.events.drain(..) {
            if let Event::BudgetCharged { micro, .. } = e {
                l.charged_micro += micro;
            }
        }
        let ops: Vec<Op> = l.flight.outbox.drain(..).collect();
        for op in ops {
            let Some(bucket) = op.bucket(&self.config) else { continue };
            let owner = owner_of(&bucket, self.nodes.len());
            if self.nodes[owner].silent_until > self.clock || self.rng.chance(self.scenario.lost) {
                continue;
            }
            let now = self.now(owner);
            fleet::serve_op(&self.nodes[owner].store, &self.config, op, now);
        }
    }

    fn finish(&mut self, id: u64) {
        self.collect(id);
        if let Some(l) = self.live.remove(&id) {
            self.finished += 1;
            if l.charged_micro != l.due_micro {
                self.broken.push(format!(
                    "flight {id} of t{} ({}; last fault {:?}) was charged {} micro-dollars where its attempts \
                     came to {}",
                    l.tenant,
                    if l.stream { "a stream" } else { "a call" },
                    l.fault,
                    l.charged_micro,
                    l.due_micro
                ));
            }
        }
    }

    /// The money invariants, as they stand now.
    pub(crate) fn check(&mut self) -> Vec<String> {
        let mut broken = std::mem::take(&mut self.broken);
        for (t, cap) in self.scenario.caps.iter().enumerate() {
            let name = format!("t{t}");
            let share = format!("{name}#share");
            let charged: u64 = (0..self.nodes.len())
                .map(|n| {
                    let now = self.now(n);
                    let store = &self.nodes[n].store;
                    budget::spent(store, &name, now).0 + budget::spent(store, &share, now).0
                })
                .sum();
            let billed = self.billed[t];
            // Charged at least what HolySheep billed (reservations in flight count).
            if charged < billed {
                broken.push(format!("{name} was charged {charged} micro-dollars but HolySheep billed {billed}"));
            }
            // Within the budget, plus, in a fleet, what the nodes' shares admit while the
            // tenant's owner is out of reach (docs/tenants.md).
            let bound = cap + self.share_bound(*cap);
            if billed > bound {
                broken.push(format!("HolySheep billed {name} {billed} micro-dollars, past its bound of {bound}"));
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

    pub(crate) fn live(&self) -> usize {
        self.live.len()
    }
}

/// The node of the fleet that owns `bucket` (the ring, as a hash of its name).
fn owner_of(bucket: &str, nodes: usize) -> usize {
    let hash = bucket.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    (hash % nodes as u64) as usize
}

/// Runs `seed` for `steps` steps, then until every flight has ended: the first violation.
pub(crate) fn run(seed: u64, steps: u64) -> Result<Sim, Violation> {
    let mut sim = Sim::new(seed);
    let mut step = 0;
    while step < steps || sim.live() > 0 {
        step += 1;
        if !sim.step(step < steps) {
            break;
        }
        if let Some(what) = sim.check().into_iter().next() {
            return Err(Violation { step, what });
        }
        if step > steps.saturating_mul(4) + 100_000 {
            return Err(Violation { step, what: format!("{} flights never ended", sim.live()) });
        }
    }
    if sim.live() > 0 {
        return Err(Violation { step, what: format!("{} flights never ended", sim.live()) });
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
            (None, None) => ((1..=40).collect(), steps),
        }
    }

    #[test]
    fn the_fleet_keeps_its_money_invariants_under_every_fault() {
        let (seeds, steps) = plan();
        let (mut total_steps, mut flights, mut attempts) = (0, 0, 0);
        for seed in seeds {
            match run(seed, steps) {
                Ok(sim) => {
                    total_steps += steps;
                    flights += sim.finished;
                    attempts += sim.attempts;
                }
                Err(v) => panic!(
                    "seed {seed}, step {}: {}\nscenario: {:?}\nreplay: make sim SEED={seed} STEPS={steps}",
                    v.step,
                    v.what,
                    Sim::new(seed).scenario()
                ),
            }
        }
        eprintln!("sim: {total_steps} steps, {flights} flights, {attempts} attempts, no violation");
    }
}
