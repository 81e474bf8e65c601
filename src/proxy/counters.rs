//! The worker's Envoy counters: defined once per VM (ids are per VM), incremented by the
//! core's labelled increments; and the gauges of each tenant's budget left (and its
//! spend's keepers), set from the shared-data record every worker reads (one stat per name
//! for the whole process).

use super::abi as hostcalls;
use super::host::SharedData;
use crate::core::api::endpoint::{self, Endpoint};
use crate::core::api::event::Event;
use crate::core::api::priority::CLASSES;
use crate::core::api::reply::Reply;
use crate::core::config::Config;
use crate::core::limits::admission::{self, Left};
use crate::core::observe::metrics::{
    self, ClassStat, Counter, LastUsage, PerCounter, Timing, CLASS_STATS, COUNTERS, TOKEN_USAGE,
};
use crate::proxy::types::MetricType;

#[derive(Default)]
pub struct Counters {
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
    /// per counter (at most one per counter defined): added to Envoy's counters by the
    /// worker's root context (`flush`), so that such a HIT makes no metric call.
    held: Vec<(u32, i64)>,
}

/// The timing histograms a governed request records into, from when it arrived in full.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stopwatch {
    started_ms: u64,
    duration: Option<u32>,
    /// Set for a stream until its first chunk is recorded.
    first_chunk: Option<u32>,
}

impl Stopwatch {
    /// A chunk of the answer goes out now: the first of a stream is recorded.
    pub fn chunk(&mut self, now_ms: impl FnOnce() -> u64) {
        if let Some(id) = self.first_chunk.take() {
            let _ = hostcalls::record_metric(id, now_ms().saturating_sub(self.started_ms));
        }
    }

    /// The request is done now (recorded once).
    pub fn stop(&mut self, now_ms: impl FnOnce() -> u64) {
        if let Some(id) = self.duration.take() {
            let _ = hostcalls::record_metric(id, now_ms().saturating_sub(self.started_ms));
        }
    }
}

/// A budgeted tenant's gauges: what is left of its day's and month's budgets, and with a
/// spend store, how many processes keep its spend (1: this one alone).
struct BudgetGauges {
    tenant: String,
    day: Option<u32>,
    month: Option<u32>,
    keepers: Option<u32>,
}

impl Counters {
    /// Defines every counter `config` names in Envoy.
    pub fn define(config: &Config) -> Counters {
        let mut ids = PerCounter::new(config);
        for label in ids.labels().to_vec() {
            for counter in COUNTERS {
                if let Ok(id) =
                    hostcalls::define_metric(MetricType::Counter, &metrics::metric_name(config, &label, counter))
                {
                    ids.set(&label, counter, id);
                }
            }
        }
        let gauge = |tenant: &str, stat: &str, defined: bool| {
            let name = format!("holysheep.{}{tenant}.budget_{stat}", metrics::TENANT_PREFIX);
            defined.then(|| hostcalls::define_metric(MetricType::Gauge, &name).ok()).flatten()
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
            let _ = hostcalls::record_metric(id, 1);
        }
        let mut class_ids = [[None; CLASS_STATS.len()]; CLASSES.len()];
        for class in CLASSES {
            for stat in CLASS_STATS {
                let kind = if stat.is_histogram() { MetricType::Histogram } else { MetricType::Counter };
                class_ids[class.rank()][stat.index()] = hostcalls::define_metric(kind, &stat.metric_name(class)).ok();
            }
        }
        let token_ids = metrics::token_labels(config)
            .into_iter()
            .map(|label| {
                let define = |kind| {
                    hostcalls::define_metric(MetricType::Histogram, &metrics::token_usage_name(config, label, kind))
                };
                (label.to_owned(), TOKEN_USAGE.map(|kind| define(kind).ok()))
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
                    hostcalls::define_metric(MetricType::Histogram, &name).ok()
                };
                (label.to_owned(), Timing::ALL.map(|t| endpoint::ALL.map(|e| define(t, e))))
            })
            .collect();
        Counters {
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
    pub fn stopwatch(&self, config: &Config, model: &str, endpoint: Endpoint, stream: bool, now_ms: u64) -> Stopwatch {
        let label = metrics::label(config, model);
        let Some((_, ids)) = self.timing_ids.iter().find(|(l, _)| l == label) else { return Stopwatch::default() };
        let Some(at) = endpoint::ALL.iter().position(|e| *e == endpoint) else { return Stopwatch::default() };
        let pick =
            |timing: Timing| ids.get(timing as usize).and_then(|by_endpoint| by_endpoint.get(at)).copied().flatten();
        let first_chunk = pick(Timing::FirstChunk).filter(|_| stream);
        Stopwatch { started_ms: now_ms, duration: pick(Timing::Duration), first_chunk }
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
        bump(&ids.into_iter().flatten().map(|id| (id, 1)).collect::<Vec<_>>());
    }

    /// Sets `tenant`'s budget gauges to what its record says is left now.
    pub fn record_budget(&self, config: &Config, tenant: &str, now_ms: u64) {
        if self.budget_gauges.iter().any(|g| g.tenant == tenant) {
            self.record_left(tenant, admission::budget_left(&SharedData, config, tenant, now_ms));
        }
    }

    /// Sets `tenant`'s budget gauges to what is `left`.
    fn record_left(&self, tenant: &str, left: Option<Left>) {
        let Some(g) = self.budget_gauges.iter().find(|g| g.tenant == tenant) else { return };
        let Some(left) = left else { return };
        for (id, left) in [(g.day, left.day), (g.month, left.month)] {
            if let (Some(id), Some(left)) = (id, left) {
                let _ = hostcalls::record_metric(id, left);
            }
        }
        if let Some(id) = g.keepers {
            let _ = hostcalls::record_metric(id, u64::from(left.keepers));
        }
    }

    /// Adds `increments` to their model's counters, and to `tenant`'s when there is one.
    pub fn count(&self, increments: Vec<(&str, Counter, u64)>, tenant: Option<&str>) {
        bump(&self.resolve(increments, tenant));
    }

    /// Counts a reply to a request for `model` (of `tenant`).
    pub fn count_reply(&mut self, config: &Config, model: &str, reply: &Reply, tenant: Option<&str>) {
        let increments = metrics::for_reply(config, model, reply, &mut self.last_usage);
        self.count(increments, tenant);
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

    /// Adds the increments held to Envoy's counters, one call per counter.
    pub fn flush(&mut self) {
        for (id, n) in self.held.drain(..) {
            let _ = hostcalls::increment_metric(id, n);
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
                let _ = hostcalls::record_metric(id, tokens);
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
            let _ = match stat {
                ClassStat::AdmissionWaitMs => hostcalls::record_metric(id, n),
                _ => hostcalls::increment_metric(id, n as i64),
            };
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

/// Adds resolved increments (`Counters::ids_for_reply`) to Envoy's counters.
fn bump(ids: &[(u32, i64)]) {
    for (id, n) in ids {
        let _ = hostcalls::increment_metric(*id, *n);
    }
}
