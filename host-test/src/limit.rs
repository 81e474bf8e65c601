//! How many Envoy-starting tests run at once in this process: `HOLYSHEEP_TEST_ENVOYS`
//! (default 2) slots, one held by each running Envoy ([`crate::envoy::Envoy`]) and all of
//! them (up to its node count) by a fleet ([`crate::fleet::Fleet`]), from start to drop.
//! Each Envoy runs 2 workers and the mock 2 more: on a 2-core machine more than two at once
//! only makes every timing-sensitive test slower.
//!
//! Slots are handed out first come, first served, so a fleet waiting for all of them is not
//! passed over by single Envoys. A thread that already holds a slot takes its next Envoys
//! without waiting (a test that starts a second Envoy while holding the first cannot
//! deadlock against another doing the same).

use std::cell::Cell;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;

/// Slots held until dropped.
#[must_use]
pub struct Slots {
    weight: usize,
    taker: Option<ThreadId>,
}

struct Queue {
    /// Slots not held; `None` until the first take reads the capacity.
    free: Option<usize>,
    /// The next ticket to hand out, and the ticket whose turn it is.
    next: u64,
    turn: u64,
}

static QUEUE: Mutex<Queue> = Mutex::new(Queue { free: None, next: 0, turn: 0 });
static WAKE: Condvar = Condvar::new();

thread_local! {
    /// Slots this thread holds.
    static HELD: Cell<usize> = const { Cell::new(0) };
}

/// `HOLYSHEEP_TEST_ENVOYS`, at least 1 (read once).
pub fn capacity() -> usize {
    static CAPACITY: OnceLock<usize> = OnceLock::new();
    *CAPACITY
        .get_or_init(|| std::env::var("HOLYSHEEP_TEST_ENVOYS").ok().and_then(|v| v.parse().ok()).unwrap_or(2).max(1))
}

fn queue() -> MutexGuard<'static, Queue> {
    QUEUE.lock().unwrap_or_else(|e| e.into_inner())
}

impl Slots {
    /// `wanted` slots (at most the capacity), waiting for its turn and for them to be free;
    /// none when this thread already holds some.
    pub fn take(wanted: usize) -> Slots {
        if HELD.get() > 0 {
            return Slots::none();
        }
        let weight = wanted.clamp(1, capacity());
        let mut q = queue();
        let ticket = q.next;
        q.next += 1;
        while q.turn != ticket || q.free.unwrap_or_else(capacity) < weight {
            q = WAKE.wait(q).unwrap_or_else(|e| e.into_inner());
        }
        q.free = Some(q.free.unwrap_or_else(capacity) - weight);
        q.turn += 1;
        WAKE.notify_all();
        HELD.set(HELD.get() + weight);
        Slots { weight, taker: Some(std::thread::current().id()) }
    }

    /// No slot: for an Envoy whose slots someone else holds (a fleet's nodes).
    pub fn none() -> Slots {
        Slots { weight: 0, taker: None }
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        if self.weight == 0 {
            return;
        }
        // Dropped on another thread than the taker's, the taker's count stays: that thread
        // then starts its Envoys without waiting (the tests drop where they start).
        if self.taker == Some(std::thread::current().id()) {
            HELD.set(HELD.get().saturating_sub(self.weight));
        }
        let mut q = queue();
        q.free = Some(q.free.unwrap_or_else(capacity) + self.weight);
        WAKE.notify_all();
    }
}
