//! The worker's Envoy counters: defined once per VM (ids are per VM), incremented by the
//! core's labelled increments.

use super::abi as hostcalls;
use crate::core::config::Config;
use crate::core::engine::Reply;
use crate::core::flight::Event;
use crate::core::metrics::{self, Counter, LastUsage, PerCounter, COUNTERS};
use proxy_wasm::types::MetricType;

#[derive(Default)]
pub struct Counters {
    ids: PerCounter<u32>,
    /// The usage of the answer counted last (followers share one answer).
    last_usage: LastUsage,
}

impl Counters {
    /// Defines every counter `config` names in Envoy.
    pub fn define(config: &Config) -> Counters {
        let mut ids = PerCounter::new(config);
        for label in ids.labels().to_vec() {
            for counter in COUNTERS {
                if let Ok(id) = hostcalls::define_metric(MetricType::Counter, &metrics::metric_name(&label, counter)) {
                    ids.set(&label, counter, id);
                }
            }
        }
        Counters { ids, last_usage: LastUsage::default() }
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

    /// Counts what a flight (of `tenant`) did.
    pub fn count_events(&self, config: &Config, events: &[Event], tenant: Option<&str>) {
        self.count(events.iter().flat_map(|e| metrics::for_event(config, e)).collect(), tenant);
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
pub fn bump(ids: &[(u32, i64)]) {
    for (id, n) in ids {
        let _ = hostcalls::increment_metric(*id, *n);
    }
}
