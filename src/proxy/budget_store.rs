//! The spend store, the shell's side: reads a tenant's record from etcd when a call asks
//! for it (`budget_store::want`), and writes settled spend behind once a round, by callouts
//! to the `budget_store.cluster`. What the answers mean is `budget_store`'s.

use super::abi as hostcalls;
use super::host::{self, SharedData};
use super::ids::IdMap;
use crate::core::api::headers;
use crate::core::config::Config;
use crate::core::limits::budget_store::{self, Due, EtcdCall, Flush};
use crate::proxy::types::{BufferType, LogLevel, MapType, Status};
use std::time::Duration;

pub struct BudgetStore {
    /// Reads out, by callout token: the tenant, and when it was sent.
    reading: IdMap<(String, u64)>,
    /// Writes out, by callout token.
    writing: IdMap<(Flush, u64)>,
    /// Reads after a write that got no answer, to learn whether it landed.
    checking: IdMap<(Flush, u64)>,
    /// Whether the store answered last (for logging the changes only).
    reached: bool,
    /// Each write's tag.
    tags: host::Nonces,
}

impl Default for BudgetStore {
    fn default() -> Self {
        BudgetStore {
            reading: IdMap::default(),
            writing: IdMap::default(),
            checking: IdMap::default(),
            reached: true,
            tags: host::Nonces::new(),
        }
    }
}

impl BudgetStore {
    /// Reads the records calls wait for, and, when this worker's round is due, writes what
    /// was settled since the last.
    pub fn tick(&mut self, config: &Config, now_ms: u64) {
        if !config.budget_store.enabled() {
            return;
        }
        // Envoy answers every callout by its timeout; one it never answered is forgotten.
        let stale = |sent: u64| now_ms.saturating_sub(sent) > config.budget_store.timeout_ms.saturating_mul(2) + 1_000;
        self.reading.retain(|_, (_, sent)| !stale(*sent));
        self.writing.retain(|_, (_, sent)| !stale(*sent));
        self.checking.retain(|_, (_, sent)| !stale(*sent));
        for tenant in budget_store::take_wanted(&SharedData) {
            if !self.reading.values().any(|(t, _)| *t == tenant) {
                self.start_read(config, &tenant, now_ms);
            }
        }
        if !budget_store::round_due(&SharedData, config, now_ms) {
            return;
        }
        for tenant in budget_store::budgeted(config) {
            if self.busy(tenant) {
                continue;
            }
            let tag = self.tags.next();
            match budget_store::due(&SharedData, config, tenant, now_ms, tag) {
                Some(Due::Write(flush)) => {
                    match send(config, &budget_store::txn(config, tenant, flush.revision, &flush.value)) {
                        Some(token) => {
                            self.writing.insert(token, (flush, now_ms));
                        }
                        // Never sent: not out.
                        None => budget_store::not_sent(&SharedData, &flush, now_ms),
                    }
                }
                Some(Due::Read) => self.start_read(config, tenant, now_ms),
                None => {}
            }
        }
    }

    /// Whether the callout answered under `token` was the store's: if so, its answer is
    /// taken, and the tenant whose key it was is returned.
    pub fn answered(&mut self, config: &Config, token: u32, num_headers: usize, body_size: usize) -> Option<String> {
        let now = host::now_ms();
        if let Some((tenant, _)) = self.reading.remove(&token) {
            let found = answer(num_headers, body_size).and_then(|(s, b)| budget_store::read_range(s, &b));
            self.read(config, &tenant, found, now);
            return Some(tenant);
        }
        if let Some((flush, _)) = self.checking.remove(&token) {
            let found = answer(num_headers, body_size).and_then(|(s, b)| budget_store::read_range(s, &b));
            self.reached(found.is_some());
            let sharing = budget_store::flushed(&SharedData, &flush, found.map(Err), now);
            sharing_began(config, &flush.tenant, sharing);
            return Some(flush.tenant);
        }
        let (flush, _) = self.writing.remove(&token)?;
        let written = answer(num_headers, body_size).and_then(|(s, b)| budget_store::read_txn(s, &b));
        self.reached(written.is_some());
        if written.is_none() {
            // It may have landed: the key says (a refusal that finds what was written is
            // taken as written).
            let tenant = flush.tenant.clone();
            if let Some(token) = send(config, &budget_store::range(config, &tenant)) {
                self.checking.insert(token, (flush, now));
            }
            return Some(tenant);
        }
        let sharing = budget_store::flushed(&SharedData, &flush, written, now);
        sharing_began(config, &flush.tenant, sharing);
        Some(flush.tenant)
    }

    /// Whether a read or a write of `tenant`'s key is out.
    fn busy(&self, tenant: &str) -> bool {
        self.reading.values().any(|(t, _)| t == tenant)
            || self.writing.values().chain(self.checking.values()).any(|(f, _)| f.tenant == tenant)
    }

    fn start_read(&mut self, config: &Config, tenant: &str, now_ms: u64) {
        match send(config, &budget_store::range(config, tenant)) {
            Some(token) => {
                self.reading.insert(token, (tenant.to_owned(), now_ms));
            }
            None => self.read(config, tenant, None, now_ms),
        }
    }

    fn read(&mut self, config: &Config, tenant: &str, found: Option<budget_store::Found>, now_ms: u64) {
        let learned = budget_store::read(&SharedData, tenant, found, now_ms);
        self.reached(learned.reached);
        sharing_began(config, tenant, learned.sharing);
    }

    /// Logs when the store stops answering and when it answers again: once per change in
    /// the process (the workers share a flag), not per request.
    fn reached(&mut self, reached: bool) {
        if std::mem::replace(&mut self.reached, reached) == reached && reached {
            return;
        }
        if !budget_store::set_reached(&SharedData, reached) {
            return;
        }
        if reached {
            host::log(LogLevel::Info, "holysheep: the spend store answers again");
        } else {
            host::log(
                LogLevel::Warn,
                "holysheep: the spend store (budget_store) does not answer: tenants' budgets are admitted from this \
                 node's share and settled spend waits to be written",
            );
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
    let status = host::header(MapType::HttpCallResponseHeaders, ":status").filter(|_| num_headers > 0)?;
    Some((status.parse().ok()?, host::buffer(BufferType::HttpCallResponseBody, body_size)))
}
