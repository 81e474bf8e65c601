//! The spend store, the shell's side: sends the calls `budget_store::Calls` gives as
//! callouts to the `budget_store.cluster`, hands their answers back, and logs what they
//! taught. Which calls to make and what the answers mean is the core's.

use super::abi as hostcalls;
use super::host::{self, SharedData};
use crate::core::api::headers;
use crate::core::config::Config;
use crate::core::limits::budget_store::{self, Asked, Calls, EtcdCall, Taught};
use crate::proxy::types::{BufferType, LogLevel, Status};
use std::time::Duration;

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

    /// Logs what an answer taught (the store's silence or its return, once per change in
    /// the process; more keepers of a tenant), and sends the call it asks for next.
    fn taught(&mut self, config: &Config, taught: Taught, now_ms: u64, sent: &mut Sent) {
        match taught.reached {
            Some(true) => host::log(LogLevel::Info, "holysheep: the spend store answers again"),
            Some(false) => host::log(
                LogLevel::Warn,
                "holysheep: the spend store (budget_store) does not answer: tenants' budgets are admitted from this \
                 node's share and settled spend waits to be written",
            ),
            None => {}
        }
        sharing_began(config, &taught.tenant, taught.sharing);
        if let Some((id, asked)) = taught.next {
            self.send(config, id, &asked, now_ms, sent);
        }
    }
}

/// Logs that more processes than `budget_store.replicas` were seen writing `tenant`'s
/// spend (`sharing`: how many keep it now, when that grew): once per process each time
/// the number grows, not per request.
fn sharing_began(config: &Config, tenant: &str, sharing: Option<u32>) {
    let Some(keepers) = sharing.filter(|n| *n > config.budget_store.replicas) else { return };
    let why = if config.fleet.shared_limits() {
        "the fleet's ring gave the tenant to more than one owner, or another fleet shares the store without \
         budget_store.replicas"
    } else {
        "other Envoys share the store: set budget_store.replicas to their number"
    };
    host::log(
        LogLevel::Warn,
        &format!(
            "holysheep: tenant {tenant}'s spend is written by {keepers} processes ({why}); each admits its share of \
             what the store left while the others keep writing"
        ),
    );
}

/// Sends `call` to etcd; the callout's token. A call Envoy refuses as a bad argument (a
/// cluster it does not know) marks the store misconfigured for the process, logged once:
/// nothing budgeted is admitted until a call can be sent again. One that fails at once
/// for another reason (no healthy host, a full circuit breaker) is an outage, not that.
fn send(config: &Config, call: &EtcdCall) -> Option<u32> {
    let sent = dispatch(config, call);
    let unknown = matches!(sent, Err(Status::BadArgument));
    if budget_store::set_misconfigured(&SharedData, unknown) {
        if unknown {
            let cluster = &config.budget_store.cluster;
            host::log(
                LogLevel::Critical,
                &format!(
                    "holysheep: budget_store.cluster '{cluster}' is no cluster this Envoy knows: calls of tenants \
                     with a budget are refused until it is"
                ),
            );
        } else {
            host::log(LogLevel::Info, "holysheep: the spend store's cluster can be called again");
        }
    }
    sent.ok()
}

fn dispatch(config: &Config, call: &EtcdCall) -> Result<u32, Status> {
    let store = &config.budget_store;
    let headers = vec![
        (":method", "POST"),
        (":path", call.path),
        (":authority", store.authority.as_str()),
        (headers::CONTENT_TYPE, "application/json"),
    ];
    let timeout = Duration::from_millis(store.timeout_ms);
    hostcalls::dispatch_http_call(&store.cluster, headers, Some(&call.body), timeout)
}

/// The callout's status and body (`None`: no answer).
fn answer(num_headers: usize, body_size: usize) -> Option<(u16, Vec<u8>)> {
    let status = host::callout_status(num_headers)?;
    Some((status, host::buffer(BufferType::HttpCallResponseBody, body_size)))
}
