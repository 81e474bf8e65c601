//! Wake-ups: each worker's own queue (registered lazily, published with a heartbeat),
//! waking the other workers when a flight ends, and answering waiters in batches, each
//! batch in a VM call of its own.

use super::abi as hostcalls;
use super::host::{self, SharedData};
use super::root::Root;
use super::worker::{Target, Worker};
use crate::core::engine::Step;
use crate::core::request::Key;
use crate::core::upstream::Outbound;
use crate::core::wake;
use proxy_wasm::types::LogLevel;
use std::rc::Rc;

/// Message on a worker's own queue: dispatch the pending calls from the root context.
pub const DISPATCH: &[u8] = b"dispatch";
/// Message on a worker's own queue: look at every waiter again (a continued tick).
pub const POLL_ALL: &[u8] = b"poll";
/// Message on a worker's own queue: complete the streams that ended.
pub const ENDED: &[u8] = b"ended";

impl Worker {
    /// Enqueues `message` on this worker's own queue, so its work continues in a VM call
    /// of its own. Without a queue yet, the next tick does it.
    pub(super) fn continue_later(&self, message: &[u8]) {
        if let Some((queue, _)) = &self.queue {
            if hostcalls::enqueue_shared_queue(*queue, Some(message)).is_err() {
                host::log(LogLevel::Warn, "holysheep: wake queue refused a message; the tick will continue");
            }
        }
    }
}

impl Root {
    pub(super) fn execute(&mut self, context_id: u32, step: Step, outbound: Rc<Outbound>) {
        match step {
            Step::Reply(reply) => {
                self.worker.borrow_mut().respond(Target::Context(context_id), &reply, &outbound);
            }
            Step::Call(call) => self.start(context_id, call, outbound),
            Step::Wait(wait) => self.worker.borrow_mut().wait(context_id, wait, outbound),
        }
    }

    pub(super) fn wake_other_workers(&self, key: &Key, now: u64) {
        let (vm_id, own) = {
            let w = self.worker.borrow();
            (w.vm_id.clone(), w.queue.as_ref().map(|(_, n)| n.clone()).unwrap_or_default())
        };
        for name in wake::live(&SharedData, now).into_iter().filter(|n| *n != own) {
            if let Ok(Some(queue)) = hostcalls::resolve_shared_queue(&vm_id, &name) {
                let _ = hostcalls::enqueue_shared_queue(queue, Some(key.hex().as_bytes()));
            }
        }
    }

    /// Lets waiters (all, or those on `key`) look at their flight again, as many as this VM
    /// call may answer; the rest continue in a VM call of their own.
    pub(super) fn poll_waiters(&mut self, key: Option<&Key>) {
        let ids: Vec<u32> = self
            .worker
            .borrow()
            .waiters
            .iter()
            .filter(|(_, (w, _))| key.is_none_or(|k| *k == w.key))
            .map(|(id, _)| *id)
            .collect();
        if ids.is_empty() {
            return;
        }
        // One VM call: one clock reading, and a finished flight read once for its waiters.
        let (now, mut seen) = (host::now_ms(), None);
        for id in ids {
            if self.out_of_replies() {
                let w = self.worker.borrow();
                w.continue_later(key.map_or(POLL_ALL, |k| k.hex().as_bytes()));
                return;
            }
            let taken = self.worker.borrow_mut().waiters.remove(&id);
            let Some((wait, outbound)) = taken else { continue };
            let step = {
                let mut w = self.worker.borrow_mut();
                let nonce = w.nonce();
                w.engine().poll_with(&wait, now, nonce, &mut seen)
            };
            self.execute(id, step, outbound);
        }
    }

    pub(super) fn register_queue(&mut self) {
        let mut w = self.worker.borrow_mut();
        if w.queue.is_some() {
            return;
        }
        let name = match wake::claim(&SharedData, host::now_ms()) {
            Ok(Some(name)) => name,
            Ok(None) => return host::log(LogLevel::Warn, "holysheep: every wake queue name is live; ticks will wake"),
            Err(e) => return host::log(LogLevel::Warn, &format!("holysheep: cannot claim a wake queue name: {e:?}")),
        };
        match hostcalls::register_shared_queue(&name) {
            Ok(id) => {
                host::log(LogLevel::Debug, &format!("holysheep: wake queue {name} registered"));
                w.queue = Some((id, name));
                w.last_beat_ms = host::now_ms();
            }
            Err(s) => host::log(LogLevel::Error, &format!("holysheep: cannot register wake queue: {s:?}")),
        }
    }

    pub(super) fn heartbeat(&mut self) {
        let now = host::now_ms();
        let mut w = self.worker.borrow_mut();
        if now.saturating_sub(w.last_beat_ms) < wake::HEARTBEAT_MS {
            return;
        }
        if let Some((_, name)) = &w.queue {
            if wake::publish(&SharedData, name, now).is_ok() {
                w.last_beat_ms = now;
            }
        }
    }

    /// One message from the worker's own queue.
    pub(super) fn on_message(&mut self, message: &[u8]) {
        if message == DISPATCH {
            self.dispatch_pending();
        } else if message == POLL_ALL {
            self.poll_waiters(None);
        } else if message == ENDED {
            self.complete_streams();
        } else if let Some(key) = std::str::from_utf8(message).ok().and_then(Key::from_hex) {
            self.poll_waiters(Some(&key));
        }
    }
}
