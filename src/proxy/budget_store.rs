//! The spend store, the shell's side: sends the calls `budget_store::Calls` gives as
//! callouts to the `budget_store.cluster`, hands their answers back, and logs what they
//! taught. Which calls to make and what the answers mean is the core's.

use super::host::{self, SharedData};
use crate::core::api::call::HttpCall;
use crate::core::config::Config;
use crate::core::limits::budget_store::{self, Asked, Calls, Taught};
use crate::proxy::types::{BufferType, Status};

pub struct BudgetStore {
    /// The calls out and what their answers mean (`budget_store::Calls`).
    calls: Calls,
    /// Each write's tag.
    tags: host::Nonces,
}

impl Default for BudgetStore {
    fn default() -> Self {
        BudgetStore { calls: Calls::default(), tags: host::Nonces::new() }
    }
}

/// Callouts sent to the store: (token, the call's id).
pub type Sent = Vec<(u32, u64)>;

impl BudgetStore {
    /// Sends the calls the worker's tick gives (the reads calls wait for and, when this
    /// worker's round is due, the writes of what was settled since the last).
    pub fn tick(&mut self, config: &Config, now_ms: u64) -> Sent {
        let BudgetStore { calls, tags } = self;
        let mut sent = Sent::new();
        for (id, asked) in calls.tick(&SharedData, config, now_ms, || tags.next()) {
            self.send(config, id, &asked, now_ms, &mut sent);
        }
        sent
    }

    /// The store's call `id` was answered: the tenant whose key it was (`None`: no call
    /// of the store's), and the calls its answer asked for next.
    pub fn answered(
        &mut self,
        config: &Config,
        id: u64,
        num_headers: usize,
        body_size: usize,
    ) -> (Option<String>, Sent) {
        let (now, mut sent) = (host::now_ms(), Sent::new());
        let answer = answer(num_headers, body_size);
        let heard = answer.as_ref().map(|(status, body)| (*status, body.as_slice()));
        let Some(taught) = self.calls.answered(&SharedData, id, heard, now) else { return (None, sent) };
        let tenant = taught.tenant.clone();
        self.taught(config, taught, now, &mut sent);
        (Some(tenant), sent)
    }

    fn send(&mut self, config: &Config, id: u64, asked: &Asked, now_ms: u64, sent: &mut Sent) {
        match send(config, &asked.call(config)) {
            Some(token) => sent.push((token, id)),
            None => {
                if let Some(taught) = self.calls.unsent(&SharedData, id, now_ms) {
                    self.taught(config, taught, now_ms, sent);
                }
            }
        }
    }

    /// Logs what an answer taught (`Taught::notes`), and sends the call it asks for next.
    fn taught(&mut self, config: &Config, taught: Taught, now_ms: u64, sent: &mut Sent) {
        host::note(taught.notes(config));
        if let Some((id, asked)) = taught.next {
            self.send(config, id, &asked, now_ms, sent);
        }
    }
}

/// Sends `call` to etcd; the callout's token. The log says when the store's cluster
/// becomes one Envoy does not know, or one it knows again (`budget_store::sent`).
fn send(config: &Config, call: &HttpCall) -> Option<u32> {
    let sent = host::dispatch(call);
    host::note(budget_store::sent(&SharedData, config, matches!(sent, Err(Status::BadArgument))));
    sent.ok()
}

/// The callout's status and body (`None`: no answer).
fn answer(num_headers: usize, body_size: usize) -> Option<(u16, Vec<u8>)> {
    let status = host::callout_status(num_headers)?;
    Some((status, host::buffer(BufferType::HttpCallResponseBody, body_size)))
}
