//! The tenants table kept in the spend store (`budget_store::tenants`), the shell's side:
//! one worker of the process reads it each period, and every worker serves the table
//! shared data holds, rebuilding its configuration (and its counters) when it changed.

use super::Root;
use crate::core::config::Role;
use crate::core::intake::recall::Recall;
use crate::core::limits::budget_store::tenants;
use crate::core::observe::metrics::{Counter, TENANTS_LABEL};
use crate::proxy::counters::{Counters, EnvoyStats};
use crate::proxy::host::{self, SharedData};
use crate::proxy::runs::Callout;
use crate::proxy::types::{BufferType, LogLevel};
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::rc::Rc;

impl Root {
    /// Sends the read of the table when this worker's turn has come.
    pub(super) fn poll_tenants(&self) {
        let call = {
            let w = self.worker.borrow();
            let due = w.base.budget_store.tenants && tenants::poll_due(&SharedData, &w.base, host::now_ms());
            due.then(|| tenants::read_call(&w.base))
        };
        if let Some(token) = call.and_then(|call| self.call(&call)) {
            self.worker.borrow_mut().runs.callouts.insert(token, Callout::Tenants);
        }
    }

    /// The store answered the read (`num_headers` 0: it did not): the table is replaced in
    /// shared data when it changed, what changed is logged, and this worker serves it.
    pub(super) fn on_tenants(&self, num_headers: usize, body_size: usize) {
        let base = self.worker.borrow().base.clone();
        if body_size > tenants::max_answer_bytes(&base) {
            let why = format!("holysheep: the spend store's tenants table answered {body_size} bytes: not read");
            return host::log(LogLevel::Error, &why);
        }
        let answer = host::callout_status(num_headers)
            .map(|status| (status, host::buffer(BufferType::HttpCallResponseBody, body_size)));
        let heard = answer.as_ref().map(|(status, body)| (*status, body.as_slice()));
        let polled = tenants::answered(&SharedData, &base, heard);
        host::note(polled.notes);
        if !polled.refused.is_empty() {
            let refused = vec![(TENANTS_LABEL, Counter::TenantRecordsRefused, polled.refused.len() as u64)];
            self.worker.borrow().counters.count(refused, None);
        }
        self.serve_tenants();
    }

    /// Serves the table shared data holds, if it is not the one this worker serves.
    pub(super) fn serve_tenants(&self) {
        let w = &mut *self.worker.borrow_mut();
        if !w.base.budget_store.tenants {
            return;
        }
        let Some((version, served)) = tenants::served(&SharedData, &w.base, w.tenants_served) else { return };
        w.tenants_served = Some(version);
        let (config, left_out) = match served {
            Ok(served) => served,
            Err(e) => {
                let why = format!(
                    "holysheep: the spend store's tenants table does not fit this configuration ({e}): this worker \
                     keeps the tenants it served"
                );
                return host::log(LogLevel::Error, &why);
            }
        };
        if !left_out.is_empty() {
            let why = format!(
                "holysheep: the spend store's records of tenants {left_out:?} do not fit this configuration: they are \
                 left out"
            );
            host::log(LogLevel::Error, &why);
        }
        // Counters are defined again only for a new set of tenants (Envoy keeps every
        // definition a VM makes); the budget gauges start from the records as they stand.
        if !config.tenants.keys().eq(w.config.tenants.keys()) {
            w.counters.flush();
            w.counters = Counters::define(EnvoyStats, &config);
        }
        if !config.fleet.shared_limits() && config.role == Role::Owner {
            for tenant in config.tenants.keys() {
                w.counters.record_budget(&SharedData, &config, tenant, host::now_ms());
            }
        }
        // What it remembers by raw bytes was admitted under the old table (a model a
        // tenant may no longer call, say): it starts again.
        w.recall = Recall::new(&config, RandomState::new().hash_one(()), true);
        w.config = Rc::new(config);
    }
}
