//! One worker thread's root context: it owns every upstream callout (so a leader's call
//! survives its client), ticks, and receives the worker's queue. Each host callback starts
//! a fresh batch of local replies and hands the work on: to the flights this worker leads
//! (`leaders`, and `route` for streams), to their waiters (`waiters`), or to the key check.

mod leaders;
mod route;
mod tenants;
mod waiters;

use super::abi as hostcalls;
use super::counters::{Counters, EnvoyStats};
use super::host::{self, SharedData};
use super::http::Chat;
use super::runs::Callout;
use super::worker::{Worker, WorkerRef, REPLY_BATCH};
use crate::core::config::environment::Environment;
use crate::core::config::{Config, Role};
use crate::core::intake::recall::Recall;
use crate::core::observe::notices::Notices;
use crate::core::upstream;
use crate::proxy::types::{BufferType, LogLevel};
use std::cell::RefCell;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::rc::Rc;
use std::time::Duration;

/// Period of the first tick, which registers the worker's wake queue.
const FIRST_TICK_MS: u64 = 20;

pub struct Root {
    worker: WorkerRef,
}

impl Root {
    pub fn new() -> Self {
        Root { worker: Rc::new(RefCell::new(Worker::new())) }
    }

    fn out_of_replies(&self) -> bool {
        self.worker.borrow().replies_left == 0
    }

    /// Once per VM, and once per Envoy process (`upstream::key_check`), asks HolySheep
    /// whether the configured key is accepted.
    fn check_key(&self) {
        let call = {
            let mut w = self.worker.borrow_mut();
            if std::mem::replace(&mut w.key_checked, true) {
                return;
            }
            w.env.bearer.as_deref().and_then(|bearer| upstream::key_check(&SharedData, &w.config, bearer))
        };
        if let Some(token) = call.and_then(|call| self.call(&call)) {
            self.worker.borrow_mut().runs.callouts.insert(token, Callout::KeyCheck);
        }
    }

    /// A root-context VM call starts: it may send a new batch of replies, and reads the
    /// clock once.
    fn begin_call(&self) -> host::Pinned {
        self.worker.borrow_mut().replies_left = REPLY_BATCH;
        host::pin_clock()
    }

    /// A callout's answer (every callout is the root context's).
    pub fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        let _clock = self.begin_call();
        let callout = self.worker.borrow_mut().runs.callouts.remove(&token);
        match callout {
            Some(Callout::Attempt(run)) => {
                let answer = self.callout_response(&run, num_headers, body_size);
                self.step(run, answer);
            }
            Some(Callout::Verdict(run)) => self.on_verdict(run, num_headers, body_size),
            Some(Callout::Embedding(run)) => self.on_embedding(run, num_headers, body_size),
            Some(Callout::Store(id)) => {
                let w = &mut *self.worker.borrow_mut();
                let config = w.config.clone();
                let (tenant, sent) = w.budget_store.answered(&config, id, num_headers, body_size);
                w.runs.store_calls(sent);
                // What the store taught (others' spend, other keepers) shows in the gauges.
                if let Some(tenant) = tenant {
                    w.counters.record_budget(&SharedData, &config, &tenant, host::now_ms());
                }
            }
            Some(Callout::Tenants) => self.on_tenants(num_headers, body_size),
            Some(Callout::KeyCheck) => {
                let config = self.worker.borrow().config.clone();
                host::note([Notices::key_checked(&config, host::callout_status(num_headers))]);
            }
            // A settlement's answer: nobody waits for it.
            None => {}
        }
    }

    /// The plugin's configuration (again on each reload); `false` refuses it.
    pub fn on_configure(&mut self, _size: usize) -> bool {
        let raw = host::buffer(BufferType::PluginConfiguration, usize::MAX);
        let mut config = match Config::parse(&raw) {
            Ok(c) => c,
            Err(e) => {
                host::log(LogLevel::Critical, &e.to_string());
                return false;
            }
        };
        let vm_id = hostcalls::get_property(vec!["plugin_vm_id"]).ok().flatten().unwrap_or_default();
        let mut w = self.worker.borrow_mut();
        w.vm_id = String::from_utf8_lossy(&vm_id).into_owned();
        let environment = Environment::read(&mut config, |name| std::env::var(name).ok());
        host::note(environment.notes(&config));
        w.env = Rc::new(environment);
        w.recall = Recall::new(&config, RandomState::new().hash_one(()), true);
        // What the counters held goes to Envoy before they are defined anew.
        w.counters.flush();
        w.counters = Counters::define(EnvoyStats, &config);
        if !config.fleet.shared_limits() && config.role == Role::Owner {
            // The gauges start from the budget records as they stand (kept across reloads).
            for tenant in config.tenants.keys() {
                w.counters.record_budget(&SharedData, &config, tenant, host::now_ms());
            }
        }
        w.config = Rc::new(config);
        w.base = w.config.clone();
        // A reload serves the store's table at once, as far as it fits the new file.
        w.tenants_served = None;
        drop(w);
        self.serve_tenants();
        // A short first tick registers the worker's queue (not here: the canary VM and
        // the VM's thread binding make on_configure the wrong place, see
        // docs/envoy-facts.md).
        let _ = hostcalls::set_tick_period(Duration::from_millis(FIRST_TICK_MS));
        true
    }

    pub fn on_tick(&mut self) {
        let _clock = self.begin_call();
        // HITs answered from the worker's copy reach Envoy's counters here.
        self.worker.borrow_mut().counters.flush();
        self.worker.borrow_mut().answer_stalled();
        self.worker.borrow_mut().queue.register();
        if self.worker.borrow().config.role == Role::Owner {
            // A forward node calls no HolySheep: it has no key to check.
            self.check_key();
        }
        self.dispatch_pending();
        self.poll_tenants();
        self.serve_tenants();
        {
            let w = &mut *self.worker.borrow_mut();
            if w.config.role == Role::Owner {
                let sent = w.budget_store.tick(&w.config, host::now_ms());
                w.runs.store_calls(sent);
            }
        }
        self.worker.borrow_mut().queue.heartbeat(host::now_ms());
        self.renew_leases();
        self.wake_sleepers();
        self.complete_streams();
        self.poll_waiters(None);
    }

    /// Every enqueue brings one call here, so one message per call empties the queue (a
    /// second dequeue would only find it empty). A message whose work outlasts this call's
    /// replies continues through the queue; whatever a message asks for, the tick also does.
    pub fn on_queue_ready(&mut self, queue_id: u32) {
        let _clock = self.begin_call();
        if let Ok(Some(message)) = hostcalls::dequeue_shared_queue(queue_id) {
            self.on_message(&message);
        }
    }

    /// Dispatches the calls stream `id` handed over, right after the request callback in
    /// which it did (the same VM call: a fresh batch of local replies, the clock as
    /// pinned). Whether the stream was sent along its route: its callback then lets it go
    /// on (`Action::Continue`).
    pub fn dispatch_handed(&mut self, id: u32) -> bool {
        if self.worker.borrow().runs.pending.is_empty() {
            return false;
        }
        {
            let mut w = self.worker.borrow_mut();
            w.replies_left = REPLY_BATCH;
            w.handing = Some((id, false));
        }
        self.dispatch_pending();
        self.worker.borrow_mut().handing.take().is_some_and(|(_, sent)| sent)
    }

    /// The root context is done (its configuration replaced, or the VM stopping): what its
    /// counters held goes to Envoy now.
    pub fn on_done(&mut self) {
        self.worker.borrow_mut().counters.flush();
    }

    /// The http context `context_id`, a stream of this worker.
    pub fn new_stream(&self, context_id: u32) -> Chat {
        self.worker.borrow_mut().live.insert(context_id);
        Chat::new(context_id, self.worker.clone())
    }
}
