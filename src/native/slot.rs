//! A filter as Envoy holds it: one hook at a time may use it. Envoy can call one of its
//! hooks from inside another: a callout answered at once from inside the call that sends
//! it, or the filter destroyed from inside a local reply. Such a call is kept for when the
//! running hook is done (a callout's answer, a wake-up), or, for `destroy`, the filter is
//! wound up and freed then. Nothing runs for a filter once Envoy destroyed it.

use super::abi::EnvoyFilter;
use super::filter::{Filter, Part};
use super::stats;
use super::wake::TAIL;
use std::cell::{Cell, RefCell, UnsafeCell};
use std::collections::VecDeque;
use std::rc::Rc;

/// What came in while another hook of the filter ran.
enum Later {
    Callout { id: u64, result: i32, headers: Vec<(String, String)>, body: Vec<u8> },
    Stream(u64, Part),
    Scheduled(u64),
}

pub struct Slot {
    filter: UnsafeCell<Filter>,
    /// Envoy's filter: what its hooks count metrics through.
    envoy: EnvoyFilter,
    /// The filter's client reads slower than it is sent to (above the write high
    /// watermark): set from the watermark hooks, which may run inside a send.
    pressure: Rc<Cell<bool>>,
    busy: Cell<bool>,
    later: RefCell<VecDeque<Later>>,
    /// Envoy destroyed the filter while a hook of it ran.
    destroyed: Cell<bool>,
}

/// Marks the slot busy until dropped (also when a hook panics).
struct Busy<'a>(&'a Cell<bool>);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.set(false);
    }
}

impl Slot {
    pub fn new(filter: Filter) -> Slot {
        Slot {
            envoy: filter.envoy(),
            pressure: filter.pressure(),
            filter: UnsafeCell::new(filter),
            busy: Cell::new(false),
            later: RefCell::default(),
            destroyed: Cell::new(false),
        }
    }

    /// Runs `f` on the filter, then what came in meanwhile; `None` when a hook of it is
    /// running already (the caller answers as a hook that waits).
    pub fn with<T>(&self, f: impl FnOnce(&mut Filter) -> T) -> Option<T> {
        if self.busy.replace(true) {
            return None;
        }
        let _busy = Busy(&self.busy);
        stats::counting(self.envoy, || self.run(f))
    }

    /// `with`'s work, the slot taken.
    fn run<T>(&self, f: impl FnOnce(&mut Filter) -> T) -> Option<T> {
        // SAFETY: `busy` lets one hook at a time take the filter, on the filter's worker.
        let filter = unsafe { &mut *self.filter.get() };
        let out = f(filter);
        loop {
            if self.destroyed.get() {
                // Envoy is done with it: no call of ours may reach it any more.
                self.later.borrow_mut().clear();
                filter.on_done();
                break;
            }
            let next = self.later.borrow_mut().pop_front();
            match next {
                Some(Later::Callout { id, result, headers, body }) => filter.on_callout_done(id, result, headers, body),
                Some(Later::Stream(id, part)) => filter.on_stream(id, part),
                Some(Later::Scheduled(event)) => filter.on_scheduled(event),
                None => break,
            }
        }
        Some(out)
    }

    /// A callout's answer, now or once the running hook is done.
    pub fn callout_done(&self, id: u64, result: i32, headers: Vec<(String, String)>, body: Vec<u8>) {
        if self.busy.get() {
            self.later.borrow_mut().push_back(Later::Callout { id, result, headers, body });
            return;
        }
        self.with(|f| f.on_callout_done(id, result, headers, body));
    }

    /// A part of a streaming callout's answer, now or once the running hook is done.
    pub fn stream(&self, id: u64, part: Part) {
        if self.busy.get() {
            self.later.borrow_mut().push_back(Later::Stream(id, part));
            return;
        }
        self.with(|f| f.on_stream(id, part));
    }

    /// The client's write buffer went above its high watermark (`true`) or below its low
    /// one; below, what waits to be sent goes on.
    pub fn pressure(&self, above: bool) {
        self.pressure.set(above);
        if !above {
            self.scheduled(TAIL);
        }
    }

    /// A wake-up, now or once the running hook is done.
    pub fn scheduled(&self, event: u64) {
        if self.busy.get() {
            self.later.borrow_mut().push_back(Later::Scheduled(event));
            return;
        }
        self.with(|f| f.on_scheduled(event));
    }

    /// Envoy destroys the filter: `true` when it can be freed now, `false` when a hook of
    /// it is running (that hook winds it up, and the caller frees it once it returns).
    pub fn destroy(&self) -> bool {
        self.destroyed.set(true);
        // `with` winds a destroyed filter up once its hook is done.
        self.with(|_| ()).is_some()
    }

    /// Whether the hook that just returned should free it (Envoy destroyed it meanwhile).
    pub fn orphaned(&self) -> bool {
        self.destroyed.get() && !self.busy.get()
    }
}
