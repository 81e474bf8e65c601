//! The worker's metrics are Envoy's stats: the core's meters (`observe::meters`) defined
//! once per VM (ids are per VM) and carried out by proxy-wasm's three metric calls. Gauges
//! are one stat per name for the whole process.

use super::abi as hostcalls;
use crate::core::observe::meters::{self, Kind, Meter};
use crate::proxy::types::MetricType;

/// Envoy's stats, as the core's meters use them.
#[derive(Debug, Clone, Copy, Default)]
pub struct EnvoyStats;

pub type Counters = meters::Meters<EnvoyStats>;
pub type Stopwatch = meters::Stopwatch<EnvoyStats>;

impl Meter for EnvoyStats {
    fn define(self, kind: Kind, name: &str) -> Option<u32> {
        let kind = match kind {
            Kind::Counter => MetricType::Counter,
            Kind::Gauge => MetricType::Gauge,
            Kind::Histogram => MetricType::Histogram,
        };
        hostcalls::define_metric(kind, name).ok()
    }

    fn increment(self, id: u32, n: i64) {
        let _ = hostcalls::increment_metric(id, n);
    }

    fn record(self, id: u32, value: u64) {
        let _ = hostcalls::record_metric(id, value);
    }
}
