//! The waiters of flights: a step carried out for a waiting http context, waiters looking
//! at their flight again when it ends (here, and on the other workers through their
//! queues), in batches, each batch in a VM call of its own.

use super::Root;
use crate::core::api::key::Key;
use crate::core::coalesce::engine::{Engine, Step};
use crate::core::config::Role;
use crate::core::observe::log_fields::Served;
use crate::core::upstream::Outbound;
use crate::proxy::host::{self, SharedData};
use crate::proxy::wake::{Message, POLL_ALL};
use crate::proxy::worker::{Target, Worker};
use std::rc::Rc;

impl Root {
    /// Carries out the engine's step for the http context `context_id`.
    pub(super) fn execute(&mut self, context_id: u32, step: Step, outbound: Rc<Outbound>, served: Served) {
        match step {
            Step::Reply(reply) => {
                self.worker.borrow_mut().respond(Target::Context(context_id), &reply, &outbound, served);
            }
            Step::Call(call) if self.worker.borrow().config.role == Role::Forward => {
                self.hop(context_id, call, outbound)
            }
            Step::Call(call) => self.begin(context_id, call, outbound),
            Step::Wait(wait) => self.worker.borrow_mut().wait(context_id, wait, outbound),
        }
    }

    /// A flight on `key` ended: its waiters here look again, and when someone waited on
    /// it (`watched`, maybe on another worker) the other workers' waiters too.
    pub(super) fn wake_waiters(&mut self, key: &Key, watched: bool) {
        self.poll_waiters(Some(key));
        if watched {
            let (queue, vm_id) = {
                let w = self.worker.borrow();
                (w.queue.clone(), w.vm_id.clone())
            };
            queue.wake_others(&vm_id, key, host::now_ms());
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
        // One VM call: one clock reading, and a finished flight read once for its waiters,
        // kept for those a later VM call answers (its lease way may be another flight's by
        // then).
        let now = host::now_ms();
        for id in ids {
            if self.out_of_replies() {
                let w = self.worker.borrow();
                w.queue.continue_later(key.map_or(POLL_ALL, |k| k.hex().as_bytes()));
                return;
            }
            let taken = self.worker.borrow_mut().waiters.remove(&id);
            let Some((wait, outbound)) = taken else { continue };
            let step = {
                let w = &mut *self.worker.borrow_mut();
                let nonce = w.nonces.next();
                w.finishing.poll(&Engine { store: &SharedData, config: &w.config }, &wait, now, nonce)
            };
            self.execute(id, step, outbound, Served::waited(now.saturating_sub(wait.since_ms)));
        }
        // Every waiter looked: a finished flight none of whose waiters is left is forgotten.
        let mut w = self.worker.borrow_mut();
        let Worker { finishing, waiters, .. } = &mut *w;
        finishing.keep_for(waiters.values().map(|(wait, _)| wait));
    }

    /// One message from the worker's own queue.
    pub(super) fn on_message(&mut self, message: &[u8]) {
        match Message::parse(message) {
            Some(Message::Dispatch) => self.dispatch_pending(),
            Some(Message::PollAll) => self.poll_waiters(None),
            Some(Message::Ended) => self.complete_streams(),
            Some(Message::Ready(key)) => self.poll_waiters(Some(&key)),
            None => {}
        }
    }
}
