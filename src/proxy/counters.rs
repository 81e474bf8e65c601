//! The worker's Envoy counters: defined once per VM (ids are per VM), incremented by the
//! core's labelled increments.

use super::abi as hostcalls;
use super::worker::Worker;
use crate::core::metrics::{self, Counter, PerCounter, COUNTERS};
use proxy_wasm::types::MetricType;

impl Worker {
    pub(super) fn count(&self, increments: Vec<(&str, Counter, u64)>) {
        for (label, counter, n) in increments {
            if let Some((id, n)) = self.counter_id(label, counter, n) {
                let _ = hostcalls::increment_metric(id, n);
            }
        }
    }

    /// The metric ids and amounts of `increments`, resolved once (for kept answers).
    pub(super) fn counter_ids(&self, increments: Vec<(&str, Counter, u64)>) -> Vec<(u32, i64)> {
        increments.into_iter().filter_map(|(label, counter, n)| self.counter_id(label, counter, n)).collect()
    }

    fn counter_id(&self, label: &str, counter: Counter, n: u64) -> Option<(u32, i64)> {
        let id = self.metrics.get(label, counter)?;
        i64::try_from(n).ok().filter(|n| *n > 0).map(|n| (id, n))
    }

    pub(super) fn define_metrics(&mut self) {
        let mut ids = PerCounter::new(&self.config);
        for label in ids.labels().to_vec() {
            for counter in COUNTERS {
                if let Ok(id) = hostcalls::define_metric(MetricType::Counter, &metrics::metric_name(&label, counter)) {
                    ids.set(&label, counter, id);
                }
            }
        }
        self.metrics = ids;
    }
}

/// Adds resolved increments (`Worker::counter_ids`) to Envoy's counters.
pub(super) fn bump(ids: &[(u32, i64)]) {
    for (id, n) in ids {
        let _ = hostcalls::increment_metric(*id, *n);
    }
}
