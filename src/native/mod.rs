//! The native Envoy shell: the core as a dynamic module (a Linux shared object Envoy loads
//! through `envoy.filters.http.dynamic_modules`, ABI `v0.2.0`). The store is the process's
//! memory (`store`), shared by every worker; a waiter is woken by its flight's end through
//! Envoy's scheduler (`wake`); every hook catches a panic (`entry`). What it serves so far
//! is in docs/native.md.

mod abi;
mod entry;
mod filter;
mod host;
mod relay;
mod round;
mod slot;
mod stats;
mod store;
mod tails;
mod wake;

use crate::core::coalesce::engine::Engine;
use crate::core::config::environment::Environment;
use crate::core::config::Config;
use crate::core::intake::kept::Kept;
use crate::core::intake::recall::Recall;
use crate::core::observe::meters::Meters;
use crate::core::observe::metrics::LastUsage;
use crate::core::observe::notices::Notices;
use stats::EnvoyStats;
use std::cell::RefCell;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use store::ProcessStore;

/// A filter configuration, shared by every worker's filters: the configuration, the
/// operator's key and the fleet's secrets (read once, from the process's environment).
pub struct Shared {
    config: Config,
    env: Environment,
    /// Its metrics, defined on Envoy (`stats`): each worker counts with a copy.
    meters: Meters<EnvoyStats>,
    /// Which configuration this is: a worker's own copies follow it.
    generation: u64,
    /// Its round on the main thread: the key's check and the spend store.
    round: round::Round,
}

impl Shared {
    /// From the filter configuration's bytes (`filter_config`): the core's JSON, its
    /// metrics defined on Envoy's configuration `envoy`. `Err`: why it is refused, for the
    /// log.
    fn parse(raw: &[u8], envoy: abi::EnvoyConfig) -> Result<Shared, String> {
        let mut config = Config::parse(raw).map_err(|e| e.to_string())?;
        let unsupported = [
            (config.role != crate::core::config::Role::Owner, "role"),
            (config.fleet.shared_limits() || config.fleet.nodes > 1, "fleet"),
            (config.budget_store.tenants, "budget_store.tenants"),
        ];
        if let Some((_, field)) = unsupported.iter().find(|(set, _)| *set) {
            return Err(format!("'{field}' is not served by the native module yet (docs/native.md)"));
        }
        let env = Environment::read(&mut config, |name| std::env::var(name).ok());
        static GENERATIONS: AtomicU64 = AtomicU64::new(0);
        let generation = GENERATIONS.fetch_add(1, Ordering::Relaxed);
        let meters = stats::defining(envoy, || Meters::define(EnvoyStats, &config));
        Ok(Shared { config, env, meters, generation, round: round::Round::start(envoy) })
    }
}

/// What one worker keeps for one configuration: its copy of the secrets, its memory of
/// requests (`intake::recall`: HITs answered again without parsing), and its meters.
struct Worker {
    generation: u64,
    env: Rc<Environment>,
    recall: Recall,
    meters: Meters<EnvoyStats>,
    /// The usage of the answer published last (followers share one answer).
    log_usage: LastUsage,
    /// What it logged last of what it saw change (HolySheep refusing the key).
    notices: Notices,
}

impl Worker {
    /// This worker's state for `shared`, new to it: its budget gauges start from the records
    /// as they stand (through the filter whose hook runs: the module has no other).
    fn new(shared: &Shared) -> Worker {
        let worker = Worker {
            generation: shared.generation,
            env: Rc::new(shared.env.clone()),
            recall: Recall::new(&shared.config, RandomState::new().hash_one(()), true),
            meters: shared.meters.clone(),
            log_usage: LastUsage::default(),
            notices: Notices::default(),
        };
        for tenant in shared.config.tenants.keys() {
            worker.meters.record_budget(&ProcessStore, &shared.config, tenant, wake::now_ms());
        }
        worker
    }
}

/// Configurations a worker keeps its state for at once (listeners with configurations of
/// their own, and the one before a reload): the least recently used goes first.
const CONFIGS_PER_WORKER: usize = 8;

thread_local! {
    static WORKERS: RefCell<Vec<Worker>> = const { RefCell::new(Vec::new()) };
}

/// This worker's state for `shared`, made when the configuration is new to it.
fn with_worker<T>(shared: &Shared, f: impl FnOnce(&mut Worker) -> T) -> T {
    WORKERS.with_borrow_mut(|workers| {
        let mut worker = match workers.iter().position(|w| w.generation == shared.generation) {
            Some(at) => workers.remove(at),
            None => Worker::new(shared),
        };
        let out = f(&mut worker);
        workers.insert(0, worker);
        workers.truncate(CONFIGS_PER_WORKER);
        out
    })
}

fn worker_env(shared: &Shared) -> Rc<Environment> {
    with_worker(shared, |w| w.env.clone())
}

/// HolySheep refused the configured key with `status` (logged, at most so often per
/// worker).
fn key_refused(shared: &Shared, status: u16) {
    let note = with_worker(shared, |w| w.notices.key_refused(&shared.config, status, wake::now_ms()));
    host::note(note);
}

/// The usage `body` (an answer) carries, parsed once for the answers of one flight.
fn usage_of(shared: &Shared, body: &[u8]) -> Option<crate::core::api::usage::Usage> {
    with_worker(shared, |w| w.log_usage.of(body))
}

/// `f` with this worker's meters for `shared`.
fn with_meters<T>(shared: &Shared, f: impl FnOnce(&mut Meters<EnvoyStats>) -> T) -> T {
    with_worker(shared, |w| f(&mut w.meters))
}

/// A governed body through this worker's memory (`Recall::admit`), a HIT kept for the same
/// bytes next time.
fn admit(
    shared: &Shared,
    head: crate::core::intake::Head,
    body: &[u8],
    now: u64,
) -> Result<crate::core::intake::recall::Admitted, crate::core::api::error::ApiError> {
    let engine = Engine { store: &ProcessStore, config: &shared.config };
    with_worker(shared, |w| {
        let keep = |request: &_| Kept::of(&ProcessStore, &shared.config, &mut w.meters, request, now);
        w.recall.admit(&engine, keep, head, body, now, nonce)
    })
}

/// A fresh random number.
fn nonce() -> u64 {
    thread_local! {
        static STATE: std::cell::Cell<u64> = std::cell::Cell::new(RandomState::new().hash_one(()) | 1);
    }
    STATE.with(|s| {
        // xorshift64*: seeded per thread from the process's random keys.
        let mut x = s.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        s.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    })
}

/// Envoy shares a filter configuration between its workers: it must be safe to.
const _: fn() = || {
    fn shared_by_workers<T: Send + Sync>() {}
    shared_by_workers::<Shared>();
};
