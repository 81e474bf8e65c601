//! The metrics a host keeps for the edge: every one the configuration names, defined once
//! on the host (its ids are the host's own), and what a reply, a refusal, a flight's events
//! and a tenant's budget record add to them, resolved to those ids. A host provides three
//! calls (`Meter`): Envoy's stats in the proxy-wasm shell.

use crate::core::api::endpoint::{self, Endpoint};
use crate::core::api::event::Event;
use crate::core::api::priority::CLASSES;
use crate::core::api::reply::Reply;
use crate::core::api::usage::Usage;
use crate::core::config::Config;
use crate::core::limits::admission::{self, Left};
use crate::core::observe::metrics::{
    self, ClassStat, Counter, LastUsage, PerCounter, Timing, CLASS_STATS, COUNTERS, TOKEN_USAGE,
};
use crate::core::store::CasStore;

/// What a metric is, as the host defines it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// A host's metric calls (a handle, copied into each stopwatch): define a metric by name
/// (`None` when the host refuses it), add to a counter, record a gauge's value or a
/// histogram's sample. A call that fails is dropped: metrics never disturb traffic.
pub trait Meter: Copy {
    fn define(self, kind: Kind, name: &str) -> Option<u32>;
    fn increment(self, id: u32, n: i64);
    fn record(self, id: u32, value: u64);
}

/// A host without metrics: it defines nothing, so nothing is counted.
#[cfg(test)]
impl Meter for () {
    fn define(self, _kind: Kind, _name: &str) -> Option<u32> {
        None
    }

    fn increment(self, _id: u32, _n: i64) {}

    fn record(self, _id: u32, _value: u64) {}
}

#[derive(Default, Clone)]
pub struct Meters<H> {
    /// The host's metric calls.
    host: H,
    ids: PerCounter<u32>,
    /// The usage of the answer counted last (followers share one answer).
    last_usage: LastUsage,
    /// Per tenant with a dollar budget: the ids of its gauges.
    budget_gauges: Vec<BudgetGauges>,
    /// Per priority class (by rank), the ids of its stats (by `ClassStat::index`).
    class_ids: [[Option<u32>; CLASS_STATS.len()]; CLASSES.len()],
    /// Per model label, the ids of its token histograms (by index in `TOKEN_USAGE`).
    token_ids: Vec<(String, [Option<u32>; TOKEN_USAGE.len()])>,
    /// Per model label, the ids of its timing histograms, by `Timing` and then endpoint (in
    /// `endpoint::ALL`'s order); none without `log_fields`, which they go with.
    timing_ids: Vec<(String, [[Option<u32>; endpoint::ALL.len()]; Timing::ALL.len()])>,
    /// Increments of the HITs answered from the worker's copy since the last flush, one sum
    /// per counter (at most one per counter defined): added to the host's counters at
    /// `flush` (a worker's root context, on its tick), so that such a HIT makes no metric
    /// call.
    held: Vec<(u32, i64)>,
}

/// The timing histograms a governed request records into, from when it arrived in full.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stopwatch<H> {
    host: H,
    started_ms: u64,
    duration: Option<u32>,
    /// Set for a stream until its first chunk is recorded.
    first_chunk: Option<u32>,
}

impl<H: Meter> Stopwatch<H> {
    /// A chunk of the answer goes out now: the first of a stream is recorded.
    pub fn chunk(&mut self, now_ms: impl FnOnce() -> u64) {
        if let Some(id) = self.first_chunk.take() {
            self.host.record(id, now_ms().saturating_sub(self.started_ms));
        }
    }

    /// The request is done now (recorded once).
    pub fn stop(&mut self, now_ms: impl FnOnce() -> u64) {
        if let Some(id) = self.duration.take() {
            self.host.record(id, now_ms().saturating_sub(self.started_ms));
        }
    }
}

/// A budgeted tenant's gauges: what is left of its day's and month's budgets, and with a
/// spend store, how many processes keep its spend (1: this one alone).
#[derive(Clone)]
struct BudgetGauges {
    tenant: String,
    day: Option<u32>,
    month: Option<u32>,
    keepers: Option<u32>,
}

impl<H: Meter> Meters<H> {
    /// Defines on `host` every metric `config` names.
    pub fn define(host: H, config: &Config) -> Meters<H> {
        let mut ids = PerCounter::new(config);
        for label in ids.labels().to_vec() {
            for counter in COUNTERS {
                if let Some(id) = host.define(Kind::Counter, &metrics::metric_name(config, &label, counter)) {
                    ids.set(&label, counter, id);
                }
            }
        }
        let gauge = |tenant: &str, stat: &str, defined: bool| {
            let name = format!("holysheep.{}{tenant}.budget_{stat}", metrics::TENANT_PREFIX);
            defined.then(|| host.define(Kind::Gauge, &name)).flatten()
        };
        let budget_gauges = config
            .tenants
            .iter()
            .filter(|(_, t)| !t.caps().is_none())
            .map(|(name, t)| BudgetGauges {
                tenant: name.clone(),
                day: gauge(name, "day_left_microusd", t.caps().per_day.is_some()),
                month: gauge(name, "month_left_microusd", t.caps().per_month.is_some()),
                keepers: gauge(name, "keepers", config.budget_store.enabled()),
            })
            .collect::<Vec<BudgetGauges>>();
        for id in budget_gauges.iter().filter_map(|g| g.keepers) {
            // This process alone, until the store says otherwise.
            host.record(id, 1);
        }
        let mut class_ids = [[None; CLASS_STATS.len()]; CLASSES.len()];
        for class in CLASSES {
            for stat in CLASS_STATS {
                let kind = if stat.is_histogram() { Kind::Histogram } else { Kind::Counter };
                class_ids[class.rank()][stat.index()] = host.define(kind, &stat.metric_name(class));
            }
        }
        let token_ids = metrics::token_labels(config)
            .into_iter()
            .map(|label| {
                let define = |kind| host.define(Kind::Histogram, &metrics::token_usage_name(config, label, kind));
                (label.to_owned(), TOKEN_USAGE.map(define))
            })
            .collect();
        // Timing costs two host calls per request (four for a stream): it goes with
        // `log_fields`, the switch of the per-request observability.
        let timed = if config.log_fields { metrics::token_labels(config) } else { Vec::new() };
        let timing_ids = timed
            .into_iter()
            .map(|label| {
                let define = |timing, endpoint| {
                    let name = metrics::timing_name(config, label, timing, endpoint);
                    host.define(Kind::Histogram, &name)
                };
                (label.to_owned(), Timing::ALL.map(|t| endpoint::ALL.map(|e| define(t, e))))
            })
            .collect();
        Meters {
            host,
            ids,
            last_usage: LastUsage::default(),
            budget_gauges,
            class_ids,
            token_ids,
            timing_ids,
            held: Vec::new(),
        }
    }

    /// The stopwatch of a request for `model` on `endpoint` that arrived in full at `now_ms`
    /// (`stream`: it also times the first chunk); one that records nothing without
    /// `log_fields`.
    pub fn stopwatch(
        &self,
        config: &Config,
        model: &str,
        endpoint: Endpoint,
        stream: bool,
        now_ms: u64,
    ) -> Stopwatch<H> {
        let label = metrics::label(config, model);
        let Some((_, ids)) = self.timing_ids.iter().find(|(l, _)| l == label) else { return self.idle(now_ms) };
        let Some(at) = endpoint::ALL.iter().position(|e| *e == endpoint) else { return self.idle(now_ms) };
        let pick =
            |timing: Timing| ids.get(timing as usize).and_then(|by_endpoint| by_endpoint.get(at)).copied().flatten();
        let first_chunk = pick(Timing::FirstChunk).filter(|_| stream);
        Stopwatch { host: self.host, started_ms: now_ms, duration: pick(Timing::Duration), first_chunk }
    }

    /// A refusal at intake: a key no tenant holds (counted for the table), a model outside
    /// the tenant's list (counted for the tenant), or a request no node of the fleet sent
    /// to an owner listener that serves only the fleet.
    pub fn count_refusal(&self, code: &str, tenant: Option<&str>) {
        let (counter, table) = match code {
            "invalid_api_key" => (Counter::Unauthorized, Some(metrics::TENANTS_LABEL)),
            "model_not_found" => (Counter::ModelRefused, None),
            "peer_required" => (Counter::PeerRefused, Some(metrics::FLEET_LABEL)),
            _ => return,
        };
        let ids = [table.and_then(|l| self.ids.get(l, counter)), tenant.and_then(|t| self.ids.get_tenant(t, counter))];
        for id in ids.into_iter().flatten() {
            self.host.increment(id, 1);
        }
    }

    /// Sets `tenant`'s budget gauges to what its record in `store` says is left now.
    pub fn record_budget(&self, store: &impl CasStore, config: &Config, tenant: &str, now_ms: u64) {
        if self.budget_gauges.iter().any(|g| g.tenant == tenant) {
            self.record_left(tenant, admission::budget_left(store, config, tenant, now_ms));
        }
    }

    /// Sets `tenant`'s budget gauges to what is `left`.
    fn record_left(&self, tenant: &str, left: Option<Left>) {
        let Some(g) = self.budget_gauges.iter().find(|g| g.tenant == tenant) else { return };
        let Some(left) = left else { return };
        for (id, left) in [(g.day, left.day), (g.month, left.month)] {
            if let (Some(id), Some(left)) = (id, left) {
                self.host.record(id, left);
            }
        }
        if let Some(id) = g.keepers {
            self.host.record(id, u64::from(left.keepers));
        }
    }

    /// Adds `increments` to their model's counters, and to `tenant`'s when there is one.
    pub fn count(&self, increments: Vec<(&str, Counter, u64)>, tenant: Option<&str>) {
        self.bump(&self.resolve(increments, tenant));
    }

    /// Counts a reply to a request for `model` (of `tenant`).
    pub fn count_reply(&mut self, config: &Config, model: &str, reply: &Reply, tenant: Option<&str>) {
        let increments = metrics::for_reply(config, model, reply, &mut self.last_usage);
        self.count(increments, tenant);
    }

    /// Counts a follower of a live tail for `model` (of `tenant`), answered COALESCED with
    /// a stream of `served` that carried `usage`.
    pub fn count_followed(
        &self,
        config: &Config,
        model: &str,
        served: &str,
        usage: Option<Usage>,
        tenant: Option<&str>,
    ) {
        self.count(metrics::for_followed(config, model, served, usage), tenant);
    }

    /// Holds resolved increments (`ids_for_reply`) until the next `flush`.
    pub fn hold(&mut self, ids: &[(u32, i64)]) {
        for &(id, n) in ids {
            match self.held.iter_mut().find(|(held, _)| *held == id) {
                Some((_, sum)) => *sum += n,
                None => self.held.push((id, n)),
            }
        }
    }

    /// Adds the increments held to the host's counters, one call per counter.
    pub fn flush(&mut self) {
        for (id, n) in self.held.drain(..) {
            self.host.increment(id, n);
        }
    }

    /// Counts what a flight (of `tenant`, for an `operation`) did.
    pub fn count_events(&self, config: &Config, events: &[Event], tenant: Option<&str>, operation: &str) {
        if events.is_empty() {
            return;
        }
        for (label, at, tokens) in events.iter().flat_map(|e| metrics::token_usage(config, operation, e)) {
            let ids = self.token_ids.iter().find(|(l, _)| l == label).and_then(|(_, ids)| ids.get(at).copied());
            if let Some(id) = ids.flatten() {
                self.host.record(id, tokens);
            }
        }
        self.count(events.iter().flat_map(|e| metrics::for_event(config, e)).collect(), tenant);
        for e in events {
            if let Event::BudgetStanding { tenant, spent, keepers } = e {
                self.record_left(tenant, admission::budget_left_after(config, tenant, *spent, *keepers));
            }
        }
        for (class, stat, n) in events.iter().filter_map(metrics::for_class) {
            let Some(id) = self.class_ids[class.rank()][stat.index()] else { continue };
            match stat {
                ClassStat::AdmissionWaitMs => self.host.record(id, n),
                _ => self.host.increment(id, n as i64),
            }
        }
    }

    /// The metric ids and amounts a reply adds, resolved once (for kept answers, `bump`).
    pub fn ids_for_reply(
        &mut self,
        config: &Config,
        model: &str,
        reply: &Reply,
        tenant: Option<&str>,
    ) -> Vec<(u32, i64)> {
        let increments = metrics::for_reply(config, model, reply, &mut self.last_usage);
        self.resolve(increments, tenant)
    }

    /// Adds resolved increments (`ids_for_reply`) to the host's counters.
    fn bump(&self, ids: &[(u32, i64)]) {
        for &(id, n) in ids {
            self.host.increment(id, n);
        }
    }

    /// A stopwatch that records nothing.
    fn idle(&self, now_ms: u64) -> Stopwatch<H> {
        Stopwatch { host: self.host, started_ms: now_ms, duration: None, first_chunk: None }
    }

    fn resolve(&self, increments: Vec<(&str, Counter, u64)>, tenant: Option<&str>) -> Vec<(u32, i64)> {
        let mut ids = Vec::with_capacity(increments.len() * 2);
        for (label, counter, n) in increments {
            let Some(n) = i64::try_from(n).ok().filter(|n| *n > 0) else { continue };
            ids.extend(self.ids.get(label, counter).map(|id| (id, n)));
            ids.extend(tenant.and_then(|t| self.ids.get_tenant(t, counter)).map(|id| (id, n)));
        }
        ids
    }
}
