//! A configuration's round on Envoy's main thread: what the plugin's workers do on their
//! tick that belongs to no request. Once per process, the check of the operator's key;
//! every `tick_ms`, the spend store's calls (`budget_store::Calls`: the reads that flights
//! wait for, then each round's writes), sent as the configuration's own callouts, their
//! answers handed back, and what they taught logged and shown in the budget gauges. The
//! module's timer thread wakes the round through the configuration's scheduler; a round
//! with nothing left to do is not woken again. Each configuration has its round (a reload
//! makes a new one); the key is checked once per process, and the store's writes are
//! shared out between rounds by the store's own record (`budget_store::round_due`).

use super::abi::{self, EnvoyConfig};
use super::store::ProcessStore;
use super::wake::{self, Waker, ROUND};
use super::{host, stats, Shared};
use crate::core::config::Config;
use crate::core::limits::budget_store::{self, Asked, Calls, Taught};
use crate::core::observe::notices::Notices;
use crate::core::upstream;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// One configuration's round.
pub struct Round {
    waker: Arc<Waker>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The spend store's calls out and what their answers mean.
    calls: Calls,
    /// Envoy's callout ids, and what each asks.
    out: HashMap<u64, Out>,
    key_checked: bool,
}

/// What a callout of the round asks.
enum Out {
    /// The spend store's call of this id.
    Store(u64),
    KeyCheck,
}

impl Round {
    /// The round of the configuration `envoy` (during `config_new`), first due at once.
    pub fn start(envoy: EnvoyConfig) -> Round {
        let round = Round { waker: Waker::for_config(envoy), state: Mutex::default() };
        wake::after(wake::now_ms(), &round.waker, ROUND);
        round
    }

    /// The configuration goes: nothing wakes its round any more.
    pub fn stop(&self) {
        self.waker.close();
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The round is due (on the main thread): the next one is set first, while there is a
    /// store to keep (so that a round that fails does not end them); then the key's check,
    /// once per process, and the store's calls.
    pub fn run(&self, envoy: EnvoyConfig, shared: &Shared) {
        let (config, now) = (&shared.config, wake::now_ms());
        if config.budget_store.enabled() {
            wake::after(now.saturating_add(config.tick_ms()), &self.waker, ROUND);
        }
        let mut state = self.state();
        if !std::mem::replace(&mut state.key_checked, true) {
            let bearer = shared.env.bearer.as_deref();
            // The first configuration to ask claims the check for the process.
            if let Some(call) = bearer.and_then(|bearer| upstream::key_check(&ProcessStore, config, bearer)) {
                match host::config_callout(envoy, &call) {
                    Ok(id) => drop(state.out.insert(id, Out::KeyCheck)),
                    Err(_) => host::note([Notices::key_checked(config, None)]),
                }
            }
        }
        let asked = state.calls.tick(&ProcessStore, config, now, super::nonce);
        for (id, asked) in asked {
            state.send(envoy, shared, id, &asked, now);
        }
    }

    /// The answer to the round's callout `id` (its status and body; `None`: none came).
    pub fn answered(&self, envoy: EnvoyConfig, shared: &Shared, id: u64, answer: Option<(u16, Vec<u8>)>) {
        let (config, now) = (&shared.config, wake::now_ms());
        let mut state = self.state();
        match state.out.remove(&id) {
            Some(Out::KeyCheck) => host::note([Notices::key_checked(config, answer.map(|(status, _)| status))]),
            Some(Out::Store(call)) => {
                let heard = answer.as_ref().map(|(status, body)| (*status, body.as_slice()));
                if let Some(taught) = state.calls.answered(&ProcessStore, call, heard, now) {
                    state.taught(envoy, shared, taught, now);
                }
            }
            None => {}
        }
    }
}

impl State {
    /// Sends the store's call `id`; one Envoy refuses is as never sent.
    fn send(&mut self, envoy: EnvoyConfig, shared: &Shared, id: u64, asked: &Asked, now: u64) {
        let config = &shared.config;
        let sent = host::config_callout(envoy, &asked.call(config));
        let unknown = sent == Err(abi::CALLOUT_CLUSTER_NOT_FOUND);
        host::note(budget_store::sent(&ProcessStore, config, unknown));
        match sent {
            Ok(callout) => drop(self.out.insert(callout, Out::Store(id))),
            Err(_) => {
                if let Some(taught) = self.calls.unsent(&ProcessStore, id, now) {
                    self.taught(envoy, shared, taught, now);
                }
            }
        }
    }

    /// Logs what an answer taught, shows the tenant's budget as it now stands, and sends
    /// the call it asks for next.
    fn taught(&mut self, envoy: EnvoyConfig, shared: &Shared, taught: Taught, now: u64) {
        let config: &Config = &shared.config;
        host::note(taught.notes(config));
        stats::through_config(envoy, || shared.meters.record_budget(&ProcessStore, config, &taught.tenant, now));
        if let Some((id, asked)) = taught.next {
            self.send(envoy, shared, id, &asked, now);
        }
    }
}
