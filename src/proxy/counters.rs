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

    pub fn count(&self, increments: Vec<(&str, Counter, u64)>) {
        for (label, counter, n) in increments {
            if let Some((id, n)) = self.id_of(label, counter, n) {
                let _ = hostcalls::increment_metric(id, n);
            }
        }
    }

    /// Counts a reply to a request for `model`.
    pub fn count_reply(&mut self, config: &Config, model: &str, reply: &Reply) {
        let increments = metrics::for_reply(config, model, reply, &mut self.last_usage);
        self.count(increments);
    }

    /// Counts what a flight did.
    pub fn count_events(&self, config: &Config, events: &[Event]) {
        self.count(events.iter().flat_map(|e| metrics::for_event(config, e)).collect());
    }

    /// The metric ids and amounts a reply adds, resolved once (for kept answers, `bump`).
    pub fn ids_for_reply(&mut self, config: &Config, model: &str, reply: &Reply) -> Vec<(u32, i64)> {
        let increments = metrics::for_reply(config, model, reply, &mut self.last_usage);
        increments.into_iter().filter_map(|(label, counter, n)| self.id_of(label, counter, n)).collect()
    }

    fn id_of(&self, label: &str, counter: Counter, n: u64) -> Option<(u32, i64)> {
        let id = self.ids.get(label, counter)?;
        i64::try_from(n).ok().filter(|n| *n > 0).map(|n| (id, n))
    }
}

/// Adds resolved increments (`Counters::ids_for_reply`) to Envoy's counters.
pub fn bump(ids: &[(u32, i64)]) {
    for (id, n) in ids {
        let _ = hostcalls::increment_metric(*id, *n);
    }
}
