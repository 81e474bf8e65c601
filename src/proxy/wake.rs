//! A worker's own wake queue: registered lazily under a name claimed in shared data,
//! published with a heartbeat so other workers can find it, and used to continue work in a
//! VM call of its own. Other workers' queues get a flight's key when it ends.

use super::abi as hostcalls;
use super::host::{self, SharedData};
use crate::core::api::key::Key;
use crate::core::coalesce::wake;
use crate::proxy::types::LogLevel;

/// Message: dispatch the pending calls from the root context.
pub const DISPATCH: &[u8] = b"dispatch";
/// Message: look at every waiter again (a continued tick).
pub const POLL_ALL: &[u8] = b"poll";
/// Message: complete the streams that ended.
pub const ENDED: &[u8] = b"ended";

/// A message from a worker's queue.
pub enum Message {
    Dispatch,
    PollAll,
    Ended,
    /// A flight on this key ended: its waiters look again.
    Ready(Key),
}

impl Message {
    pub fn parse(message: &[u8]) -> Option<Message> {
        match message {
            DISPATCH => Some(Message::Dispatch),
            POLL_ALL => Some(Message::PollAll),
            ENDED => Some(Message::Ended),
            key => std::str::from_utf8(key).ok().and_then(Key::from_hex).map(Message::Ready),
        }
    }
}

#[derive(Clone, Default)]
pub struct WakeQueue {
    /// The queue's id and claimed name, once registered.
    own: Option<(u32, String)>,
    last_beat_ms: u64,
}

impl WakeQueue {
    pub fn is_registered(&self) -> bool {
        self.own.is_some()
    }

    /// Enqueues `message` on this worker's own queue, so its work continues in a VM call of
    /// its own. Without a queue yet, the next tick does it.
    pub fn continue_later(&self, message: &[u8]) {
        if let Some((queue, _)) = &self.own {
            if hostcalls::enqueue_shared_queue(*queue, Some(message)).is_err() {
                host::log(LogLevel::Warn, "holysheep: wake queue refused a message; the tick will do its work");
            }
        }
    }

    /// Claims a name and registers the queue, once.
    pub fn register(&mut self) {
        if self.own.is_some() {
            return;
        }
        let name = match wake::claim(&SharedData, host::now_ms()) {
            Ok(Some(name)) => name,
            Ok(None) => return host::log(LogLevel::Warn, "holysheep: every wake queue name is live; ticks will wake"),
            Err(e) => return host::log(LogLevel::Warn, &format!("holysheep: cannot claim a wake queue name: {e}")),
        };
        match hostcalls::register_shared_queue(&name) {
            Ok(id) => {
                host::log(LogLevel::Debug, &format!("holysheep: wake queue {name} registered"));
                self.own = Some((id, name));
                self.last_beat_ms = host::now_ms();
            }
            Err(s) => host::log(LogLevel::Error, &format!("holysheep: cannot register wake queue: {s:?}")),
        }
    }

    /// Publishes the queue's name as live, every `wake::HEARTBEAT_MS`.
    pub fn heartbeat(&mut self, now: u64) {
        if now.saturating_sub(self.last_beat_ms) < wake::HEARTBEAT_MS {
            return;
        }
        if let Some((_, name)) = &self.own {
            if wake::publish(&SharedData, name, now).is_ok() {
                self.last_beat_ms = now;
            }
        }
    }

    /// Tells every other live worker's queue (of this VM, `vm_id`) that the flight on `key`
    /// ended.
    pub fn wake_others(&self, vm_id: &str, key: &Key, now: u64) {
        let own = self.own.as_ref().map(|(_, n)| n.as_str()).unwrap_or_default();
        for name in wake::live(&SharedData, now).into_iter().filter(|n| n != own) {
            if let Ok(Some(queue)) = hostcalls::resolve_shared_queue(vm_id, &name) {
                let _ = hostcalls::enqueue_shared_queue(queue, Some(key.hex().as_bytes()));
            }
        }
    }
}
