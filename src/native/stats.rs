//! Envoy's stats for the module (the core's `Meter`): every metric the configuration names
//! is defined on Envoy's filter configuration while `config_new` runs (Envoy refuses
//! definitions after it), under the plugin's own names, so that one bootstrap's tag
//! extractors and histogram buckets serve both shells (`metrics_namespace: wasmcustom`). A
//! metric is counted through the filter whose hook is running, on its worker; a gauge set by
//! a configuration's round, through the configuration, on the main thread. An id holds
//! the metric's kind in its top bits: Envoy numbers each kind apart.

use super::abi::{self, EnvoyFilter, ModuleBuffer};
use crate::core::observe::meters::{Kind, Meter};
use std::cell::Cell;
use std::ffi::c_void;

/// Bits of an id below its kind.
const KIND_SHIFT: u32 = 28;
const INDEX: u32 = (1 << KIND_SHIFT) - 1;
const COUNTER: u32 = 1;
const GAUGE: u32 = 2;
const HISTOGRAM: u32 = 3;

thread_local! {
    /// Envoy's filter configuration while `config_new` defines its metrics, or while its
    /// round runs on the main thread (`round`).
    static CONFIG: Cell<*mut c_void> = const { Cell::new(std::ptr::null_mut()) };
    /// The filter whose hook runs on this worker.
    static FILTER: Cell<EnvoyFilter> = const { Cell::new(std::ptr::null_mut()) };
}

/// Envoy's stats, through the configuration or filter at hand (see the module's doc).
#[derive(Debug, Clone, Copy, Default)]
pub struct EnvoyStats;

/// Puts a thread-local back as it was when dropped (also when `f` panics).
struct Restore(&'static std::thread::LocalKey<Cell<*mut c_void>>, *mut c_void);

impl Drop for Restore {
    fn drop(&mut self) {
        self.0.set(self.1);
    }
}

/// Runs `f` with `config` as the configuration metrics are defined on.
pub fn defining<T>(config: *mut c_void, f: impl FnOnce() -> T) -> T {
    let _restore = Restore(&CONFIG, CONFIG.replace(config));
    f()
}

/// Runs `f` on the main thread with `config` as the configuration gauges are set through
/// (a round has no filter).
pub fn through_config<T>(config: *mut c_void, f: impl FnOnce() -> T) -> T {
    defining(config, f)
}

/// Runs `f` with `filter` as the filter metrics are counted through.
pub fn counting<T>(filter: EnvoyFilter, f: impl FnOnce() -> T) -> T {
    let _restore = Restore(&FILTER, FILTER.replace(filter));
    f()
}

impl Meter for EnvoyStats {
    fn define(self, kind: Kind, name: &str) -> Option<u32> {
        let config = CONFIG.get();
        if config.is_null() {
            return None;
        }
        let (code, define) = match kind {
            Kind::Counter => (COUNTER, abi::envoy_dynamic_module_callback_http_filter_config_define_counter as Define),
            Kind::Gauge => (GAUGE, abi::envoy_dynamic_module_callback_http_filter_config_define_gauge as Define),
            Kind::Histogram => {
                (HISTOGRAM, abi::envoy_dynamic_module_callback_http_filter_config_define_histogram as Define)
            }
        };
        let mut id = 0usize;
        // SAFETY: Envoy's configuration during `config_new`; the name lives until the call
        // returns; no labels.
        let result = unsafe { define(config, ModuleBuffer::of(name.as_bytes()), std::ptr::null(), 0, &mut id) };
        let index = u32::try_from(id).ok().filter(|i| *i <= INDEX)?;
        (result == abi::METRICS_OK).then_some(code << KIND_SHIFT | index)
    }

    fn increment(self, id: u32, n: i64) {
        let (filter, Ok(n)) = (FILTER.get(), u64::try_from(n)) else { return };
        if filter.is_null() || id >> KIND_SHIFT != COUNTER || n == 0 {
            return;
        }
        // SAFETY: the filter whose hook runs now, on this thread; no labels.
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_increment_counter(
                filter,
                (id & INDEX) as usize,
                std::ptr::null(),
                0,
                n,
            );
        }
    }

    fn record(self, id: u32, value: u64) {
        let (filter, config) = (FILTER.get(), CONFIG.get());
        if filter.is_null() {
            if !config.is_null() && id >> KIND_SHIFT == GAUGE {
                // SAFETY: the configuration whose round runs now, on the main thread.
                unsafe {
                    abi::envoy_dynamic_module_callback_http_filter_config_set_gauge(
                        config,
                        (id & INDEX) as usize,
                        std::ptr::null(),
                        0,
                        value,
                    );
                }
            }
            return;
        }
        let record = match id >> KIND_SHIFT {
            GAUGE => abi::envoy_dynamic_module_callback_http_filter_set_gauge as Record,
            HISTOGRAM => abi::envoy_dynamic_module_callback_http_filter_record_histogram_value as Record,
            _ => return,
        };
        // SAFETY: the filter whose hook runs now, on this thread; no labels.
        unsafe { record(filter, (id & INDEX) as usize, std::ptr::null(), 0, value) };
    }
}

type Define = unsafe extern "C" fn(*mut c_void, ModuleBuffer, *const ModuleBuffer, usize, *mut usize) -> i32;
type Record = unsafe extern "C" fn(EnvoyFilter, usize, *const ModuleBuffer, usize, u64) -> i32;
