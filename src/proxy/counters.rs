//! The worker's Envoy counters: defined once per VM (ids are per VM), incremented by the
//! core's labelled increments.

use super::worker::Worker;
use crate::core::metrics::{self, Counter, COUNTERS};
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

impl Worker {
    pub(super) fn count(&self, increments: Vec<(String, Counter, u64)>) {
        bump(&self.counter_ids(increments));
    }

    /// The metric ids and amounts of `increments`, resolved once (for kept answers).
    pub(super) fn counter_ids(&self, increments: Vec<(String, Counter, u64)>) -> Vec<(u32, i64)> {
        let resolved = increments.into_iter().filter_map(|(label, counter, n)| {
            let id = *self.metrics.get(&(label, counter))?;
            i64::try_from(n).ok().filter(|n| *n > 0).map(|n| (id, n))
        });
        resolved.collect()
    }

    pub(super) fn define_metrics(&mut self) {
        for label in metrics::labels(&self.config) {
            for counter in COUNTERS {
                if let Ok(id) = hostcalls::define_metric(MetricType::Counter, &metrics::metric_name(&label, counter)) {
                    self.metrics.insert((label.clone(), counter), id);
                }
            }
        }
    }
}

/// Adds resolved increments (`Worker::counter_ids`) to Envoy's counters.
pub(super) fn bump(ids: &[(u32, i64)]) {
    for (id, n) in ids {
        let _ = hostcalls::increment_metric(*id, *n);
    }
}
