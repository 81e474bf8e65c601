//! Waking a filter from anywhere: its scheduler handle (`Waker`), timers on one thread of
//! the module's own, and the waiters of each flight, woken when it ends. A commit reaches
//! `on_http_filter_scheduled` on the filter's worker (a configuration's, its round on the
//! main thread); a handle is deleted once, when its owner goes, and never committed after.

use super::abi::{self, EnvoyConfig, EnvoyFilter, Scheduler};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::Duration;

/// What a filter is woken for.
pub const WAKE: u64 = 1;
pub const TIMER: u64 = 2;
pub const RENEW: u64 = 3;
pub const POLL: u64 = 4;
/// A tail grew or ended, or began (for its flight's waiters), or a client reads again.
pub const TAIL: u64 = 5;
/// A configuration's round is due (`round`).
pub const ROUND: u64 = 6;

/// A scheduler handle while its filter (or configuration) lives.
pub struct Waker(Mutex<Option<Handle>>);

/// Envoy's scheduler handle, with the calls that commit to it and delete it: a filter's
/// (woken on its worker) or a configuration's (woken on the main thread).
struct Handle {
    scheduler: Scheduler,
    commit: unsafe extern "C" fn(Scheduler, u64),
    delete: unsafe extern "C" fn(Scheduler),
}

// SAFETY: Envoy's scheduler handles may be committed from any thread; the mutex keeps a
// commit and the delete apart.
unsafe impl Send for Handle {}

impl Waker {
    /// A new handle for `filter` (on its worker).
    pub fn new(filter: EnvoyFilter) -> Arc<Waker> {
        // SAFETY: called on the filter's worker while the filter lives.
        let scheduler = unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_new(filter) };
        Waker::of(
            scheduler,
            abi::envoy_dynamic_module_callback_http_filter_scheduler_commit,
            abi::envoy_dynamic_module_callback_http_filter_scheduler_delete,
        )
    }

    /// A new handle for the configuration `config`, whose wake-ups run on the main thread
    /// (`on_http_filter_config_scheduled`).
    pub fn for_config(config: EnvoyConfig) -> Arc<Waker> {
        // SAFETY: called in `config_new`, on the main thread, while the configuration lives.
        let scheduler = unsafe { abi::envoy_dynamic_module_callback_http_filter_config_scheduler_new(config) };
        Waker::of(
            scheduler,
            abi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit,
            abi::envoy_dynamic_module_callback_http_filter_config_scheduler_delete,
        )
    }

    fn of(
        scheduler: Scheduler,
        commit: unsafe extern "C" fn(Scheduler, u64),
        delete: unsafe extern "C" fn(Scheduler),
    ) -> Arc<Waker> {
        let handle = (!scheduler.is_null()).then_some(Handle { scheduler, commit, delete });
        Arc::new(Waker(Mutex::new(handle)))
    }

    /// Wakes the filter (or configuration) with `event`, if it is still there.
    pub fn wake(&self, event: u64) {
        let handle = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = handle.as_ref() {
            // SAFETY: the handle is alive until `close`, which takes this lock.
            unsafe { (h.commit)(h.scheduler, event) }
        }
    }

    /// Its owner is going: the handle is deleted, and nothing wakes it after this.
    pub fn close(&self) {
        let handle = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            // SAFETY: taken out under the lock, so no commit can use it any more.
            unsafe { (h.delete)(h.scheduler) }
        }
    }
}

/// Timers: (when, sequence) in order; each sequence's filter and event; the last sequence.
struct Due {
    order: BinaryHeap<Reverse<(u64, u64)>>,
    wakes: HashMap<u64, (Weak<Waker>, u64)>,
    seq: u64,
}

struct Timers {
    due: Mutex<Due>,
    changed: Condvar,
}

fn timers() -> &'static Timers {
    static TIMERS: OnceLock<Timers> = OnceLock::new();
    TIMERS.get_or_init(|| {
        // The thread lives as long as the process (the module is never unloaded:
        // `do_not_close`), and only wakes filters that still live.
        if let Err(e) = std::thread::Builder::new().name("holysheep-timers".into()).spawn(run_timers) {
            super::host::log(super::abi::LOG_CRITICAL, &format!("holysheep: the timer thread did not start: {e}"));
        }
        Timers {
            due: Mutex::new(Due { order: BinaryHeap::new(), wakes: HashMap::new(), seq: 0 }),
            changed: Condvar::new(),
        }
    })
}

/// Wakes `waker` with `event` at `at_ms` (the core's clock); a timer whose filter went
/// does nothing.
pub fn after(at_ms: u64, waker: &Arc<Waker>, event: u64) {
    let t = timers();
    let mut due = t.due.lock().unwrap_or_else(|p| p.into_inner());
    let seq = due.seq.wrapping_add(1);
    due.seq = seq;
    due.order.push(Reverse((at_ms, seq)));
    due.wakes.insert(seq, (Arc::downgrade(waker), event));
    t.changed.notify_one();
}

fn run_timers() {
    let t = timers();
    let mut due = t.due.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let now = now_ms();
        // The clock counts whole milliseconds: a timer fires once its millisecond has
        // passed, never within it (a Retry-After is never cut short).
        let mut ready = Vec::new();
        while let Some(Reverse((at, seq))) = due.order.peek().copied() {
            if at >= now {
                break;
            }
            due.order.pop();
            ready.extend(due.wakes.remove(&seq));
        }
        if !ready.is_empty() {
            // Woken outside the lock: a commit never holds up `after`, nor it a commit.
            drop(due);
            for (waker, event) in ready {
                if let Some(waker) = waker.upgrade() {
                    waker.wake(event);
                }
            }
            due = t.due.lock().unwrap_or_else(|p| p.into_inner());
            continue;
        }
        due = match due.order.peek().copied() {
            Some(Reverse((at, _))) => {
                let wait = Duration::from_millis(at.saturating_add(1).saturating_sub(now).max(1));
                t.changed.wait_timeout(due, wait).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0)
            }
            None => t.changed.wait(due).unwrap_or_else(|p| p.into_inner()),
        };
    }
}

/// The clock the core is given: milliseconds since the epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Flights with waiters past which those no filter waits for any more are dropped.
const MAX_AWAITED: usize = 4096;

/// The waiters of each flight, by its key, on every worker.
fn waiters() -> &'static Mutex<HashMap<String, Vec<Weak<Waker>>>> {
    static WAITERS: OnceLock<Mutex<HashMap<String, Vec<Weak<Waker>>>>> = OnceLock::new();
    WAITERS.get_or_init(Mutex::default)
}

/// `waker` waits for the flight of `key` (once: a waiter that waits again is not added
/// twice); those whose filters went are dropped on the way.
pub fn wait_for(key: &str, waker: &Arc<Waker>) {
    let mut all = waiters().lock().unwrap_or_else(|p| p.into_inner());
    if all.len() >= MAX_AWAITED {
        // Flights whose leaders went without ending them: their waiters lead anew.
        all.retain(|_, list| list.iter().any(|w| w.strong_count() > 0));
    }
    let list = all.entry(key.to_owned()).or_default();
    list.retain(|w| w.strong_count() > 0);
    if !list.iter().any(|w| w.as_ptr() == Arc::as_ptr(waker)) {
        list.push(Arc::downgrade(waker));
    }
}

/// The flight of `key` ended: every filter that waits for it is woken.
pub fn flight_ended(key: &str) {
    let woken = waiters().lock().unwrap_or_else(|p| p.into_inner()).remove(key).unwrap_or_default();
    for waker in woken.iter().filter_map(Weak::upgrade) {
        waker.wake(WAKE);
    }
}

/// The flight of `key` streams live now: every filter that waits for it looks at its tail
/// (and still waits for its end).
pub fn tail_began(key: &str) {
    let woken: Vec<Arc<Waker>> = match waiters().lock().unwrap_or_else(|p| p.into_inner()).get(key) {
        Some(list) => list.iter().filter_map(Weak::upgrade).collect(),
        None => Vec::new(),
    };
    for waker in woken {
        waker.wake(TAIL);
    }
}
